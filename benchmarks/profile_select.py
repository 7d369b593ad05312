"""Where a method's selection spends its time inside the model path (``PrunedVLM``), on one image: a profile.

Table 6's ``select ms`` on an H100 (2026-11-26, ``shape:llava_next_7b``, fp16, 320 tokens) was 35.4 ms for PromPrune
against 10.0 ms for ``promprune.select`` alone at the same five 576-token views (``benchmarks/selection.py``). This
runs the model path's selection (``PrunedVLM._plan``: candidates in, kept tokens out) under ``torch.profiler`` and
prints the operators by host time and by device time, how the certified split decided, the entropy the sample
records (with its half-width where the bounds decided), and the selection's time with and without CUDA graphs
(``PROMPRUNE_GRAPHS``)::

    python benchmarks/profile_select.py --model shape:llava_next_7b --dtype float16 --budget 320    # on a GPU
    python benchmarks/profile_select.py --model tiny:llava_next --entropy certified                # anywhere

``shape:`` models are built with ``--text-layers`` decoder layers (the selection happens before the LLM).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags  # noqa: E402
from benchmarks.efficiency import sample_images  # noqa: E402
from promprune.models import PrunedVLM  # noqa: E402
from promprune.selection import accel, certified, graphed  # noqa: E402


def build(model: str, dtype: str, device: str, text_layers: int) -> tuple:
    """``(model, processor, PrunedVLM options)``: a checkpoint, ``tiny:<arch>`` or ``shape:<name>``."""
    if model.startswith("shape:"):
        from promprune.dtypes import parse_dtype
        from promprune.models.shapes import default_options, shape_vlm

        name = model.split(":", 1)[1]
        net, processor = shape_vlm(name, dtype=parse_dtype(dtype), device=device, text_layers=text_layers)
        return net, processor, default_options(name)
    base = PrunedVLM.from_pretrained(model, method=None, dtype=dtype, device_map=device)
    return base.model, base.processor, {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_flags(args) -> None:
    """Refuse the command line's mistakes (exit 2, `benchmarks.Flags`) before the model is built."""
    flags = Flags(__file__)
    flags.methods("--method", [args.method])
    options = {}
    if args.model.startswith("shape:"):
        from promprune.models.shapes import default_options, shapes

        name = args.model.split(":", 1)[1]
        options = default_options(name) if name in shapes() else {}
    flags.budgets("--budget", [args.budget], flags.model("--model", args.model, options), args.model)
    flags.dtype("--dtype", args.dtype)
    flags.device("--device", args.device)
    flags.at_least("--text-layers", args.text_layers, 1, "decoder layers of a shape: model", 2)
    flags.at_least("--repeats", args.repeats, 1, "timed selections", 9)
    flags.at_least("--rows", args.rows, 1, "operators per table", 18)
    flags.refuse()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:llava_next")
    parser.add_argument("--method", default="promprune")
    parser.add_argument("--budget", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--text-layers", type=int, default=2, help="decoder layers of a shape: model")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", type=int, default=18, help="operators per table")
    parser.add_argument("--entropy", default="auto", choices=accel.ENTROPY_MODES,
                        help="how PromPrune's split reads the entropy (certified: the bounds on the CPU too)")
    args = parser.parse_args(argv)
    check_flags(args)

    net, processor, options = build(args.model, args.dtype, args.device, args.text_layers)
    vlm = PrunedVLM(net, processor, method=args.method, budget=args.budget, **options)
    device = vlm.model.device
    plan = vlm._plan
    seen: dict[str, list] = {"ms": [], "profile": []}

    def timed(candidates):  # the selection alone, as PrunedVLM times it (select ms)
        _sync(device)
        start = time.perf_counter()
        if seen["profile"] == [None]:
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                                              else [])) as prof:
                out = plan(candidates)
                _sync(device)
            seen["profile"] = [prof]
        else:
            out = plan(candidates)
            _sync(device)
        seen["ms"].append((time.perf_counter() - start) * 1e3)
        return out

    vlm._plan = timed
    images, prompts = sample_images(1), ["Describe the image briefly."]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} {args.method} budget {args.budget} {args.dtype} on {device} ({name}), "
          f"torch {torch.__version__}")
    for graphs in ([False, True] if device.type == "cuda" else [False]):
        with accel.graphs(graphs), accel.entropy(args.entropy):
            seen["ms"].clear()
            warm = graphed.SIGHTINGS if graphs else 1  # warm-up: kernels; a shape is captured at its second call
            for _ in range(args.repeats + warm):
                with certified.collected() as splits:  # every split of the call (one per budget bucket)
                    stats = vlm.prepare(images, prompts).stats[0]
            ms = statistics.median(seen["ms"][warm:])
            report = certified.SplitReport.total(splits)  # the last call's
            recorded = "" if stats.get("entropy") is None else f"; entropy recorded {stats['entropy']:.4f}" + (
                "" if stats.get("entropy_halfwidth") is None else f" +- {stats['entropy_halfwidth']:.1e}")
            print(f"selection {'with' if graphs else 'without'} CUDA graphs: {ms:.2f} ms median of {args.repeats}"
                  + (f"; split decided per stage {report.decided}, exact {report.exact_note}" if report else "")
                  + recorded)
    seen["profile"] = [None]
    with accel.entropy(args.entropy):
        vlm.prepare(images, prompts)
    prof = seen["profile"][0]
    for key in ("self_cpu_time_total",) + (("self_cuda_time_total",) if device.type == "cuda" else ()):
        print(f"\n### operators by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=48))


if __name__ == "__main__":
    main()
