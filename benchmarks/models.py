"""Per-stage latency of every method through a PrunedVLM (a printed table, never an assertion).

    python benchmarks/models.py                                  # tiny offline LLaVA, every method
    python benchmarks/models.py --model tiny:qwen2_5_vl --budget 8
    python benchmarks/models.py --model llava-hf/llava-1.5-7b-hf --budget 64 --dtype float16 --device-map cuda

Reports the median over ``--repeats`` runs (after one warm-up) of vision, selection, prefill and decode time,
and the visual tokens the LLM received.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags  # noqa: E402
from promprune.models import PrunedVLM, all_methods  # noqa: E402


def demo_images(n: int, size: int) -> list[Image.Image]:
    """Smooth random colour fields, seeded (the benchmark needs pixels, not meaning)."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((size, size), Image.BILINEAR)
            for _ in range(n)]


def measure(vlm: PrunedVLM, images, prompts, repeats: int, new_tokens: int) -> dict:
    vlm.generate(images, prompts, max_new_tokens=new_tokens)  # warm-up
    runs = [vlm.generate(images, prompts, max_new_tokens=new_tokens)[0] for _ in range(repeats)]
    row = {k: statistics.median(getattr(g, k) for g in runs) for k in ("vision_ms", "select_ms", "prefill_ms",
                                                                        "decode_ms")}
    row["visual_tokens"] = runs[0].visual_tokens
    return row


def check_flags(args) -> None:
    """Refuse the command line's mistakes (exit 2, `benchmarks.Flags`) before the model loads."""
    flags = Flags(__file__)
    flags.methods("--methods", args.methods or [])
    flags.budgets("--budget", [args.budget], flags.model("--model", args.model), args.model)
    flags.at_least("--batch", args.batch, 1, "images per call", 1)
    flags.at_least("--image-size", args.image_size, 1, "image side in px", 336)
    flags.at_least("--repeats", args.repeats, 1, "timed runs", 5)
    flags.at_least("--max-new-tokens", args.max_new_tokens, 1, "tokens generated per run", 8)
    flags.dtype("--dtype", args.dtype, allow_auto=True)
    if args.device_map is not None:
        flags.device("--device-map", args.device_map, words=("auto", "balanced", "balanced_low_0", "sequential"))
    flags.refuse()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny:llava")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--methods", nargs="*", default=None, help="default: unpruned + every method")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=336)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device-map", default=None)
    args = ap.parse_args(argv)
    check_flags(args)

    images = demo_images(args.batch, args.image_size)
    prompts = ["Describe the image."] * args.batch
    base = PrunedVLM.from_pretrained(args.model, method=None, dtype=args.dtype, device_map=args.device_map)
    print(f"{'method':<14}{'tokens':>8}{'vision ms':>11}{'select ms':>11}{'prefill ms':>12}{'decode ms':>11}")
    for method in [None] + (args.methods or all_methods()):
        budget = None if method is None else args.budget
        vlm = PrunedVLM(base.model, base.processor, method=method, budget=budget)
        r = measure(vlm, images, prompts, args.repeats, args.max_new_tokens)
        print(f"{str(method):<14}{r['visual_tokens']:>8}{r['vision_ms']:>11.2f}{r['select_ms']:>11.2f}"
              f"{r['prefill_ms']:>12.2f}{r['decode_ms']:>11.2f}")


if __name__ == "__main__":
    main()
