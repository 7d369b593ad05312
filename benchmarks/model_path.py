"""The model path around the selection, counted on the CPU: kernel launches and host syncs of ``PrunedVLM.prepare``.

    python benchmarks/model_path.py [--methods divprune,vispruner,promprune] [--batch 2]

``PrunedVLM.prepare`` of a batch (the copy of the processor's outputs to the device, the vision tower, the selection,
the LLM's inputs; no LLM forward; the processor itself runs on the host and is not counted) on the tiny LLaVA-1.5 (one
view per image) and the tiny LLaVA-NeXT (up to five views per image: the images here give 5, 3, 5 and 3), with the
selection's GPU fast path switched on for CPU tensors and counted by ``benchmarks.launches.count_model``: launches
(ATen ops that launch a kernel, copies to the device, Triton launches), syncs (reads of device values by the host,
blocking copies, host indices meeting device tensors, waits inside ops: an eigensolve's error check) and where they
happen. Beside each method, the counts of the
bare ``promprune.select`` calls the path makes (one per bucket of equal token count and budget), so what goes around
the selection is the difference. A projection of the GPU time (``launches.project_ms``) is an assumption, not a
measurement.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
import promprune  # noqa: E402
from benchmarks import Flags, comma_list  # noqa: E402
from benchmarks.launches import Costs, count_model, fast_path_on_cpu, on_host, project_ms  # noqa: E402

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


def prepare_costs(vlm, batch_images, prompts, graphs: bool = False) -> Costs:
    """The counts of ``vlm.prepare(batch_images, prompts)`` (after a warm-up call), the processor on the host; with
    ``graphs`` PromPrune's selection replays as CUDA graphs (``fast_path_on_cpu(graphs=True)``)."""
    with fast_path_on_cpu(graphs=graphs), on_host(vlm, "processed"):
        return count_model(vlm.model, vlm.prepare, batch_images, prompts)  # after one warm-up call


def select_costs(vlm, batch_images, prompts) -> Costs:
    """The bare ``promprune.select`` calls of the path (one per bucket), counted alone on the inputs the path built."""
    calls = []
    real = promprune.select

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    promprune.select = record
    try:
        with fast_path_on_cpu(), on_host(vlm, "processed"):
            vlm.prepare(batch_images, prompts)
    finally:
        promprune.select = real
    total = Costs()
    with fast_path_on_cpu(), torch.inference_mode():  # as prepare runs them (VisionZip calls the projector)
        for args, kwargs in calls:
            bare = {k: v for k, v in kwargs.items() if k != "checked"}  # a bare call checks its inputs itself
            c = count_model(vlm.model, real, *args, **bare)
            total.launches, total.syncs = total.launches + c.launches, total.syncs + c.syncs
    return total


def row(model_name: str, method: str | None, batch: int, budget: int) -> str:
    from promprune.models import PrunedVLM

    vlm = PrunedVLM.from_pretrained(model_name, method=method, budget=budget if method else None)
    batch_images = images(batch)
    prompts = ["What is in the picture?"] * batch
    c = prepare_costs(vlm, batch_images, prompts)
    bare = select_costs(vlm, batch_images, prompts) if method else Costs()
    views = [len(item.groups.unique()) for item in vlm.prepare(batch_images, prompts).items]
    sites = "; ".join(f"{n} {site.split()[0].rsplit('/', 1)[-1]}" for site, n in c.sync_sites.most_common())
    return (f"| {model_name} | {method or 'unpruned'} | {batch} ({'+'.join(map(str, views))}) | {c.launches} | "
            f"{c.syncs} | {bare.launches} | {bare.syncs} | {project_ms(c):.2f} | {sites} |")


def check_flags(args) -> None:
    """Refuse the command line's mistakes (exit 2, `benchmarks.Flags`) before a model is built: every method and
    model known, the budget each model is run at (8 for tiny:llava, else 20) within what it gives an image."""
    flags = Flags(__file__)
    flags.methods("--methods", args.methods)
    for name in args.models:
        capacity = flags.model("--models", name)
        if capacity is not None and (8 if name == "tiny:llava" else 20) > capacity:
            flags.add(f"--models {name}", f"it gives an image {capacity} visual tokens, fewer than the budget this "
                      "benchmark keeps (8 for tiny:llava, else 20); use a larger model, e.g. tiny:llava_next")
    flags.at_least("--batch", args.batch, 1, "images per call", 1)
    flags.refuse()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="divprune,vispruner,promprune", type=comma_list(example="divprune,promprune"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", default="tiny:llava,tiny:llava_next",
                    type=comma_list(example="tiny:llava,tiny:llava_next"))
    args = ap.parse_args(argv)
    check_flags(args)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print("| model | method | images (views) | launches | syncs | bare select: launches | syncs | proj. ms "
          "| where the syncs are |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        budget = 8 if name == "tiny:llava" else 20
        for batch in args.batch:
            for method in [None, *args.methods]:
                print(row(name, method, batch, budget), flush=True)


if __name__ == "__main__":
    main()
