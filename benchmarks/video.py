"""A clip's visual tokens and PromPrune's selection time per video budget mode, on the published shapes (a printed
table, never an assertion).

    python benchmarks/video.py                                   # CPU: 1 text / 2 vision layers at full width
    python benchmarks/video.py --frames 16 --size 384 --budget 392 --device cuda --full
    python benchmarks/video.py --smoke      # a check of the script (~1 min on 2 cores): 2 small frames, widths / 4

The clip is a procedural testbed clip (``promprune.testbed.clips``) resized to ``--size`` px; the processors are the
shapes' (the released checkpoints' image / video settings), so the token counts are the released models'. Times are
the median of ``--repeats`` ``prepare_video`` calls after one warm-up (vision tower + saliency hook; selection).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags  # noqa: E402
from promprune.models import PrunedVLM  # noqa: E402
from promprune.models.shapes import shape_vlm  # noqa: E402
from promprune.testbed.clips import scene_clip  # noqa: E402

SHAPES = ("llava_onevision_7b", "qwen2_5_vl_7b", "qwen3_vl_8b")
MODES = (("per_frame", "unit"), ("clip", "unit"), ("per_frame", "clip"), ("clip", "per_frame"))


def check_flags(args) -> None:
    """Refuse the command line's mistakes (exit 2, `benchmarks.Flags`) before a model is built."""
    flags = Flags(__file__)
    flags.at_least("--frames", args.frames, 1, "frames of the clip", 8)
    flags.at_least("--size", args.size, 1, "frame side in px", 384)
    flags.at_least("--budget", args.budget, 1, "visual tokens kept", 196)
    flags.at_least("--repeats", args.repeats, 1, "timed calls per mode", 3)
    flags.at_least("--width-divisor", args.width_divisor, 1, "1: full width", 4)
    if args.width_divisor > 1:
        from promprune.models.shapes import narrowed, shape_spec

        for name in SHAPES:
            try:
                narrowed(shape_spec(name), args.width_divisor)
            except ValueError as exc:
                flags.add(f"--width-divisor {args.width_divisor}", f"{name}: {exc} (heads stay whole); use a "
                          "divisor of every shape's widths, e.g. 2 or 4")
                break
    flags.device("--device", args.device)
    flags.refuse()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=384, help="frame side in px")
    parser.add_argument("--budget", type=int, default=196)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="every layer (default: 1 text / 2 vision layers)")
    parser.add_argument("--width-divisor", type=int, default=1, help="both towers' widths divided by this "
                        "(promprune.models.shapes.narrowed; heads stay whole: 4 divides all three shapes)")
    parser.add_argument("--smoke", action="store_true", help="a check of the script: 2 frames of 112 px, budget 16, "
                        "one call per mode (no warm-up), widths / 4")
    args = parser.parse_args(argv)
    if args.smoke:
        args.frames, args.size, args.budget, args.repeats, args.width_divisor = 2, 112, 16, 1, 4
    check_flags(args)
    clip = [f.resize((args.size, args.size)) for f in scene_clip(index=3, frames=args.frames)]
    layers = {} if args.full else {"text_layers": 1, "vision_layers": 2}
    dtype = torch.float16 if args.device.startswith("cuda") else torch.bfloat16
    print("| model | video_budget | video_split | candidates | frames (views) | fed | salient | vision ms | "
          "select ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        model, processor = shape_vlm(name, dtype=dtype, device=args.device, width_divisor=args.width_divisor,
                                     **layers)
        for budget_mode, split in MODES:
            vlm = PrunedVLM(model, processor, method="promprune", budget=args.budget, video_budget=budget_mode,
                            video_split=split)
            if not args.smoke:
                vlm.prepare_video([clip], ["What moves?"])  # warm-up
            runs = [vlm.prepare_video([clip], ["What moves?"]) for _ in range(args.repeats)]
            item, stats = runs[0].items[0], runs[0].stats[0]
            print(f"| {name} | {budget_mode} | {split} | {item.features.shape[0]} | {item.groups.unique().numel()} | "
                  f"{stats['visual_tokens']} | {stats['saliency_count']} | "
                  f"{statistics.median(r.vision_ms for r in runs):.0f} | "
                  f"{statistics.median(r.select_ms for r in runs):.1f} |", flush=True)
        del model


if __name__ == "__main__":
    main()
