"""The model path around the selection, counted on the CPU: kernel launches and host syncs of ``PrunedVLM.prepare``.

    python benchmarks/model_path.py [--methods divprune,vispruner,promprune] [--batch 2]

``PrunedVLM.prepare`` of a batch (processor, vision tower, selection, the LLM's inputs; no LLM forward) on the tiny
LLaVA-1.5 (one view per image) and the tiny LLaVA-NeXT (up to five views per image: its images here give 3 and 5),
with the selection's GPU fast path switched on for CPU tensors and counted by ``benchmarks.launches.count_model``:
launches (ATen ops that launch a kernel, copies to the device, Triton launches), syncs (reads of device values by the
host, blocking copies, host indices meeting device tensors). Beside each method, the same counts of the bare
``promprune.select`` calls the path makes (its buckets), so what goes around the selection is the difference. A
projection of the GPU time (``launches.project_ms``) is an assumption, not a measurement.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
import promprune  # noqa: E402
from benchmarks.launches import Costs, count_model, fast_path_on_cpu, project_ms  # noqa: E402

# images whose LLaVA-NeXT anyres grids differ: a square one (2 x 2 crops, 5 views) and a wide one (1 x 2, 3 views)
SIZES = [(64, 64), (40, 80), (48, 48), (30, 64)]


def images(batch: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for h, w in (SIZES * batch)[:batch]:
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        out.append(Image.fromarray(coarse).resize((w, h), Image.BILINEAR))
    return out


def selections(vlm, batch_images, prompts) -> Costs:
    """The bare ``promprune.select`` calls of the path (one per bucket), counted alone: their inputs as the path
    builds them, recorded on a first run."""
    calls = []
    real = promprune.select

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    promprune.select = record
    try:
        vlm.prepare(batch_images, prompts)
    finally:
        promprune.select = real
    total = Costs()
    for args, kwargs in calls:
        c = count_model(vlm.model, real, *args, **kwargs)
        total.launches, total.syncs = total.launches + c.launches, total.syncs + c.syncs
    return total


def row(model_name: str, method: str | None, batch: int, budget: int) -> str:
    from promprune.models import PrunedVLM

    vlm = PrunedVLM.from_pretrained(model_name, method=method, budget=budget if method else None)
    batch_images = images(batch)
    prompts = ["What is in the picture?"] * batch
    with fast_path_on_cpu():
        vlm.prepare(batch_images, prompts)  # warm: lazy imports, caches
        c = count_model(vlm.model, vlm.prepare, batch_images, prompts)
        bare = selections(vlm, batch_images, prompts) if method else Costs()
    views = [len(item.groups.unique()) for item in vlm.prepare(batch_images, prompts).items]
    top = ", ".join(f"{k} {v}" for k, v in c.ops.most_common() if k.startswith(("implicit", "read", "to_device")))
    return (f"| {model_name} | {method or 'unpruned'} | {batch} ({'+'.join(map(str, views))} views) | {c.launches} | "
            f"{c.syncs} | {bare.launches} | {bare.syncs} | {project_ms(c):.2f} | {top} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="divprune,vispruner,promprune", type=lambda s: s.split(","))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", default="tiny:llava,tiny:llava_next", type=lambda s: s.split(","))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print("| model | method | batch (views) | launches | syncs | of which select: launches | syncs | proj. ms "
          "| transfers |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        budget = 8 if name == "tiny:llava" else 20
        for batch in args.batch:
            for method in [None, *args.methods]:
                print(row(name, method, batch, budget), flush=True)


if __name__ == "__main__":
    main()
