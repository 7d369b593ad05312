"""``adaptive_views``' share decision per image: the exact route (one eigensolve per view) against certified brackets.

Under ``budget_mode="adaptive_views"`` (and ``video_budget="adaptive_frames"``, the same split over a clip's frames)
the budget is split over an image's views by their spectral entropies (``batched_select._view_shares``). The exact
route eigensolves every view; the certified route (``certified.settle`` with ``batched_select.certain_shares``)
brackets the entropies stage by stage and eigensolves only the views of images whose brackets leave the integer
shares undecided (after the last stage, or as soon as no later stage can decide them). This script times
``_view_shares`` itself (from the views' features: their spectral matrices, the entropies or brackets, the shares)
on both routes, forced (``accel.entropy("exact")`` / ``("certified")``), and prints per shape and batch (on the
certified route PromPrune's split afterwards reuses these intervals, ``Unit.bounds``: a view whose interval decides its
``t_sal`` runs no second bracket and no eigensolve there, ``two_stage.known_split``; that saving is not in these
timings, which are ``_view_shares``' alone):

- the median ms of one call (CUDA events around it on a GPU, the device idle before; wall time on the CPU);
- the share of views whose image's shares the brackets decided without an eigensolve (``batched_select.LAST_SHARES``)
  and the views decided at each Lanczos stage; the views eigensolved, and how many of them went there before the last
  stage because no later stage could prove their image's shares (``certified.settle``'s ``hopeless``: a quota within
  the margins' reach of an integer);
- the host's reads of device values in one call: ``certified.host_read`` (counted by ``accel.count_sync``) and
  ``transfer.to_host`` (the exact route's read). The eigensolve's own error check, a wait on CUDA too, is not counted;
- whether every call's shares, on every image timed, were the exact route's.

Inputs: ``benchmarks/inputs.make_inputs``' features (a smooth rank-32 structure plus noise) for each view, each view
with isotropic noise of its own scale added, drawn from ``[0, --detail]`` (views of one image differ as a flat crop
and a detailed one do: entropies ~0.55-0.65 at 576 x 4096, ~0.65-0.74 at 196 x 3584), seeded; float16 on CUDA and
float32 on the CPU unless ``--dtype`` says otherwise. Shapes: LLaVA-NeXT (5 views x 576 tokens x 4096, 64 kept per
view: 320), LLaVA-OneVision video (8 or 16 frames x 196 tokens x 3584, 22 kept per frame).

    python benchmarks/view_shares.py --device cuda --batch 1 8 --repeats 9    # the checklist's stage view-shares
    python benchmarks/view_shares.py --device cpu --shapes llava-next --repeats 3
    python benchmarks/view_shares.py --smoke                                   # small shapes on the CPU, seconds
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags, comma_list  # noqa: E402
from benchmarks.inputs import make_inputs  # noqa: E402
from benchmarks.selection import median_ms  # noqa: E402
from promprune.models import batched_select  # noqa: E402
from promprune.models.adapters import HostIndex, VisualItem  # noqa: E402
from promprune.selection import accel, certified  # noqa: E402

SHAPES = {  # name: (views, tokens per view, d, tokens kept per view)
    "llava-next": (5, 576, 4096, 64),
    "ov-video-8": (8, 196, 3584, 22),
    "ov-video-16": (16, 196, 3584, 22),
}
# --smoke: the same layouts (NeXT's 5 views, a clip's frames) at a size the CPU decides in milliseconds
SMOKE_SHAPES = {"llava-next": (5, 64, 128, 24), "ov-video-8": (4, 49, 112, 20)}
ROUTES = ("exact", "certified")


def items_for(views: int, n: int, d: int, batch: int, device: str, dtype: torch.dtype, detail: float,
              seed: int = 0) -> list[VisualItem]:
    """``batch`` images of ``views`` views of ``n`` tokens (``[views * n, d]`` features, view after view, in ``dtype``
    on ``device``): each view ``make_inputs``' features plus isotropic noise of a scale drawn from ``[0, detail]``,
    seeded per image. Their host index is set (``HostIndex``): nothing is read to plan them."""
    items = []
    for b in range(batch):
        x, _ = make_inputs(views, n, d, "cpu", seed=seed + b)
        g = torch.Generator().manual_seed(10_000 + seed + b)
        scale = detail * torch.rand(views, 1, 1, generator=g)
        x = (x + scale * torch.randn(x.shape, generator=g)).reshape(views * n, d)
        idx = np.arange(views * n, dtype=np.int64)
        groups = np.repeat(np.arange(views, dtype=np.int64), n)
        features = x.to(device, dtype)
        items.append(VisualItem(run=features, features=features, run_pos=torch.from_numpy(idx).to(device),
                                grid_index=torch.from_numpy(idx).to(device), saliency=None,
                                groups=torch.from_numpy(groups).to(device),
                                host=HostIndex(run_pos=idx, grid_index=idx, groups=groups)))
    return items


def view_units(items: list[VisualItem], budget: int) -> dict[int, list[batched_select.Unit]]:
    """Each item's per-view units (their indices on the device), as ``select_items`` forms them before the shares:
    ``_units``' of ``per_crop``, whose shares ``_view_shares`` does not read (``budget`` at least the views: none
    dropped)."""
    per_view: dict[int, list[batched_select.Unit]] = {}
    for unit in batched_select._units(items, [it.host for it in items], budget, "per_crop"):
        per_view.setdefault(unit.item, []).append(unit)
    assert all(len(per_view[b]) == len(np.unique(it.host.groups)) for b, it in enumerate(items)), "a view dropped"
    return per_view


@contextmanager
def counted_reads():
    """The host's reads of device values inside the block, in a one-entry list filled at its end:
    ``certified.host_read``'s (``accel.syncs``) and ``batched_select``'s ``to_host`` calls."""
    calls = [0]
    plain = batched_select.to_host

    def counting(tensors):
        calls[0] += 1
        return plain(tensors)

    before = accel.syncs()
    batched_select.to_host = counting
    out = [0]
    try:
        yield out
    finally:
        batched_select.to_host = plain
        out[0] = calls[0] + accel.syncs() - before


def measure(items: list[VisualItem], budget: int, repeats: int, entropies: bool = False) -> dict:
    """Both routes on ``items``: median ms, reads of one call, the certified route's report, whether every call's
    shares were the exact route's; with ``entropies``, the views' exact entropies (an eigensolve more, untimed)."""
    per_view = view_units(items, budget)
    out: dict = {"views": sum(len(u) for u in per_view.values())}
    shares: dict[str, list[dict]] = {route: [] for route in ROUTES}
    for route in ROUTES:
        seen = shares[route]
        with accel.entropy(route):
            with counted_reads() as reads:
                seen.append(batched_select._view_shares(items, per_view, budget))
            out[f"reads {route}"] = reads[0]
            if route == "certified":
                out["report"] = batched_select.LAST_SHARES[0]
            out[f"ms {route}"] = median_ms(
                lambda _, seen=seen: seen.append(batched_select._view_shares(items, per_view, budget)),
                items[0].features, repeats)
    reference = shares["exact"][0]
    out["identical"] = all(s == reference for route in ROUTES for s in shares[route])
    out["shares"] = {route: shares[route][0] for route in ROUTES}
    if entropies:
        out["entropies"] = batched_select._view_entropies(items, per_view)
    return out


def auto_route(n: int, like: torch.Tensor) -> str:
    """The route ``auto`` (the default) takes for views of size ``n`` on ``like``'s device."""
    with accel.entropy("auto"):
        return "bounds" if certified.applies(n, like) else "eigensolve"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the features and both routes run (default: cuda when there is one)")
    ap.add_argument("--dtype", default="auto", help="the features' dtype (the model's; auto: float16 on cuda, "
                    "float32 on cpu)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="images per call (default 1 8)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per route (default 7)")
    ap.add_argument("--shapes", type=comma_list(str, "llava-next,ov-video-8"), default=None,
                    help="which shapes (comma-separated; default: all of " + ", ".join(SHAPES) + ")")
    ap.add_argument("--detail", type=float, default=2.0, help="the largest scale of a view's added noise (default "
                    "2; 0: make_inputs' features as they are, every view's entropy alike)")
    ap.add_argument("--smoke", action="store_true", help="a check of the script: small shapes (SMOKE_SHAPES) on the "
                    "CPU, one repeat, batches 1 and 2")
    args = ap.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        args.repeats, args.batch, args.device = 1, [1, 2], "cpu"
    flags = Flags(__file__)
    flags.at_least("--repeats", args.repeats, 1, "timed calls per route", 7)
    flags.at_least("--batch", args.batch, 1, "images per call", 1)
    flags.at_least("--detail", args.detail, 0, "the largest scale of a view's added noise", 2)
    flags.device("--device", args.device)
    flags.dtype("--dtype", args.dtype, allow_auto=True)
    if args.shapes:
        shapes = {name: shapes[name] for name in flags.choice("--shapes", args.shapes, shapes, "shape")}
    flags.refuse()
    from promprune.dtypes import parse_dtype

    cuda = torch.device(args.device).type == "cuda"
    dtype = (torch.float16 if cuda else torch.float32) if args.dtype == "auto" else parse_dtype(args.dtype)
    name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    print(f"device={args.device} ({name}) dtype={str(dtype).removeprefix('torch.')} repeats={args.repeats} "
          f"threads={torch.get_num_threads()} torch={torch.__version__} detail={args.detail:g}")
    sizes = tuple(sorted({min(n, d) for _v, n, d, _t in shapes.values()}))
    probe = torch.zeros(1, device=args.device)
    if cuda:
        print(certified.describe_route(args.device, sizes))
    print("auto (the default) takes " + ", ".join(f"the {auto_route(n, probe)} at n = {n}" for n in sizes)
          + " here; both routes below are forced")
    print()
    print("| shape | batch | views | exact ms | certified ms | exact / certified | decided w/o eigensolve | "
          "by stage | eigensolved | of them early | reads exact | reads certified | shares identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|")
    firsts = []
    for shape, (views, n, d, per_view_kept) in shapes.items():
        budget = views * per_view_kept
        for batch in args.batch:
            items = items_for(views, n, d, batch, args.device, dtype, args.detail)
            row = measure(items, budget, args.repeats, entropies=batch == args.batch[0])
            report = row["report"]
            decided = sum(report.decided)
            print(f"| {shape} | {batch} | {row['views']} | {row['ms exact']:.2f} | {row['ms certified']:.2f} | "
                  f"{row['ms exact'] / row['ms certified']:.2f}x | {decided} / {row['views']} "
                  f"({100 * decided / row['views']:.0f}%) | {report.decided} | {report.exact} | {report.hopeless} | "
                  f"{row['reads exact']} | {row['reads certified']} | {'yes' if row['identical'] else 'NO'} |",
                  flush=True)
            if batch == args.batch[0]:
                firsts.append((shape, budget, row))
            del items
            if cuda:
                torch.cuda.empty_cache()
    print()
    for shape, budget, row in firsts:
        ents = ", ".join(f"{h:.6f}" for h in row["entropies"][0])
        print(f"image 0 of {shape} (budget {budget}): entropies [{ents}]; shares exact {row['shares']['exact'][0]}, "
              f"certified {row['shares']['certified'][0]}")
    print("(decided w/o eigensolve: views whose image's shares the certified brackets proved, in the first "
          "(untimed) call; by stage: views decided at each Lanczos stage; eigensolved: views of images the brackets "
          "left undecided; of them early: eigensolved before the last stage, no later stage able to prove their "
          "image's shares; reads: the host's reads of device values in one call; shares identical: every call's "
          "shares on every image equal the exact route's first call's)")


if __name__ == "__main__":
    main()
