"""How often vision once and prefix once change an answer, per dtype, on a model that reads its tokens.

    python benchmarks/prefix_agreement.py                  # testbed:llava, 4 testbed tasks x 100 questions
    python benchmarks/prefix_agreement.py --device cuda --dtypes float16 bfloat16

The shipped ``testbed:llava`` (trained; its answers depend on the image) answers the testbed's four question families
three ways through ``run_requests`` (batch size 8, the sweeps' blocks): both options off, ``vision_once``, and
``vision_once`` + ``prefix_cache``. In float32 the three give the same tokens (tests/models/test_sharing.py); in half
precision the cached prefix's keys and values come from a batch of another shape than the whole prompt's, so their
last bits differ and an answer at a near-tie may flip. Printed per dtype and method: answers equal to the options-off
path's, how many went through a cached prefix (a batch of images asked once each runs the whole prompt), and each
task's primary metric both ways. Last line: ``prefix cache agreement: <dtype> <share>, ...``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import Flags  # noqa: E402

TASKS = ["testbed_exist", "testbed_count", "testbed_attribute", "testbed_relation"]
CONFIGS = [(None, None), ("promprune", 16)]  # unpruned, and the testbed's PromPrune budget (16 of 144 tokens)


def count_continued() -> list[int]:
    """A counter of the questions answered through a cached prefix (``promprune.models.prefix.inputs`` returning
    their rows' continuation; a batch it declines runs the whole prompt)."""
    from promprune.models import prefix

    counter, inputs = [0], prefix.inputs

    def counted(vlm, prep, cache, *args, **kwargs):
        out = inputs(vlm, prep, cache, *args, **kwargs)
        counter[0] += 0 if out is None else len(prep.keys)
        return out

    prefix.inputs = counted
    return counter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=100, help="questions per task")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--limit", args.limit, 1, "questions per task", 100)
    for dtype in args.dtypes:
        flags.dtype("--dtypes", dtype)
    flags.device("--device", args.device)
    flags.at_least("--batch-size", args.batch_size, 1, "rows per block", 8)
    flags.refuse()
    import torch

    from promprune.eval import build_requests, run_requests, score
    from promprune.eval.requests import pack_requests
    from promprune.eval.tasks import PRIMARY_METRICS
    from promprune.models import PrunedVLM

    continued = count_continued()
    rows = build_requests(TASKS, limit=args.limit)
    blocks = pack_requests(rows, args.batch_size)
    images = len({r.image_key for r in rows})
    print(f"# {len(rows)} questions over {images} images ({', '.join(TASKS)}), testbed:llava on {args.device}, "
          f"batch size {args.batch_size}\n")
    print("| dtype | method | vision once = off | prefix once = off | through a cached prefix | " +
          " | ".join(f"{t} off / prefix" for t in TASKS) + " |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(TASKS))
    shares = []
    for dtype in args.dtypes:
        same_all = total = 0
        for method, budget in CONFIGS:
            vlm = PrunedVLM.from_pretrained("testbed:llava", method=method, budget=budget, dtype=dtype,
                                            device_map=args.device)
            out = {}
            with torch.inference_mode():
                for name, flags in (("off", (False, False)), ("vision", (True, False)), ("prefix", (True, True))):
                    out[name] = [q for b in blocks for q in run_requests(vlm, b, batch_size=args.batch_size,
                                                                         vision_once=flags[0],
                                                                         prefix_cache=flags[1])]
                    if name == "prefix":
                        via, continued[0] = continued[0], 0
                    continued[0] = 0
            same = {k: sum(a.prediction == b.prediction for a, b in zip(out["off"], out[k])) for k in out}
            scores = {k: score(v) for k, v in out.items() if k != "vision"}
            cells = [f"{scores['off'][t][PRIMARY_METRICS[t][0]]:.3f} / {scores['prefix'][t][PRIMARY_METRICS[t][0]]:.3f}"
                     for t in TASKS]
            label = "unpruned" if method is None else f"{method} {budget}"
            print(f"| {dtype} | {label} | {same['vision']}/{len(rows)} | {same['prefix']}/{len(rows)} | {via} | "
                  + " | ".join(cells) + " |")
            same_all, total = same_all + same["prefix"], total + len(rows)
        shares.append(f"{dtype} {same_all / total:.3f}")
    print(f"\nprefix cache agreement: {', '.join(shares)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
