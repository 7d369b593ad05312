"""Median selection time of every registered method at the paper's shapes, and its ratio to DivPrune.

    python benchmarks/selection.py [--repeats 7] [--device cpu|cuda] [--threads N] [--dtype float16] [--batch 1 8]
    python benchmarks/selection.py --smoke      # a check of the script (seconds): small shapes, one repeat

Shapes: LLaVA-1.5 (B=1, N=576, d=4096, T=64), LLaVA-NeXT (B=5 crops x 576, d=4096, T=64 per crop = 320),
Qwen2.5-VL (B=1, N=1296, d=3584, T=128), each times ``--batch`` images. Inputs are random features with a smooth
low-rank structure plus noise (so spectral entropy lands in the paper's range) and random saliency, in ``--dtype``
(selection itself computes in float32, as the adapters feed it the model's dtype). The CPU bar (issue 53): promprune
<= 2.5x divprune at every shape. The random inputs' entropies (~0.55) lie far from the default mu (0.42), where the
certified split decides every view with its first stage; the row ``promprune, mu~H`` times PromPrune again with mu at
its inputs' median entropy (a real image near mu needs more stages) and says how the split decided. On the CPU a
second table splits PromPrune's extra time into the exact entropy's eigensolve and the rest.

On CUDA, times come from CUDA events, every method is timed on the fast path (``promprune.selection.accel``: Triton
greedy kernels, PromPrune's split through certified entropy bounds) and on the plain torch path ("old"), and
PromPrune's stages are timed one by one: Gram, split (the certified bounds, or the exact entropy on the old path),
saliency stage (top-k order), coverage stage (the DPP); and PromPrune eager and with CUDA graphs for a first view just
above a count boundary (rows ``boundary``: mu placed by ``boundary_mu`` so that a later Lanczos stage decides it, as
for a real image near mu). Targets (issue 53, H100, fp16): PromPrune <= 2.5 ms
(LLaVA-1.5), <= 4 ms (NeXT, 5 views), <= 5 ms (Qwen2.5-VL) at batch 1, <= 15 ms (NeXT, batch 8); no method above 3x
DivPrune.

Every run also prints a cost model counted on the CPU (``benchmarks/launches.py``): each method's kernel launches,
host syncs and matmul GFLOPs of one call on the fast path at each ``--batch``, and a GPU time projected from them;
the host's share of a call measured on this CPU (``launches.host_ms``: kernels stubbed, graph bodies skipped, at
stand-in sizes ``HOST_SHAPES``, batch 1), which the projection prices only on average (both with PromPrune's
``boundary`` rows too: the cost of one Lanczos stage more); and the certified split's decisions (``--split-images``
images per shape whose entropy lies in the sigmoid's steep part, mu placed around it): the share decided by each
stage's bounds and by the exact eigensolve (how many of those before the last stage, no later stage able to decide
them), the brackets' widths, and whether every count equals the exact algorithm's.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
import promprune  # noqa: E402
from benchmarks import Flags  # noqa: E402
from benchmarks.inputs import instruction_for, make_inputs  # noqa: E402
from benchmarks.launches import count, fast_path_on_cpu, project_ms  # noqa: E402
from promprune.selection import accel, certified  # noqa: E402
from promprune.selection.budget import split_budget  # noqa: E402
from promprune.selection.entropy import entropy_of_matrix, spectral_matrix  # noqa: E402
from promprune.selection.kernels import ranks_to_mask, stable_descending_order  # noqa: E402
from promprune.selection.registry import TokenSet  # noqa: E402
from promprune.selection.two_stage import (  # noqa: E402
    DEFAULT_MU,
    DEFAULT_TAU,
    certified_split,
    coverage_picks,
    minmax,
    two_stage,
)

SHAPES = {  # name: (B, N, d, T)
    "llava-1.5": (1, 576, 4096, 64),
    "llava-next": (5, 576, 4096, 64),
    "qwen2.5-vl": (1, 1296, 3584, 128),
}
# --smoke: the same three layouts (NeXT's 5 views, Qwen's longer sequence) at a size a CPU selects in milliseconds
SMOKE_SHAPES = {"llava-1.5": (1, 64, 128, 8), "llava-next": (5, 64, 128, 8), "qwen2.5-vl": (1, 144, 112, 16)}


def median_ms(fn, arg, repeats: int) -> float:
    """Median ms of ``fn(arg)`` over ``repeats`` calls after one warm-up: CUDA events around each call on a CUDA
    ``arg`` (the device idle before it), wall time otherwise."""
    fn(arg)
    samples = []
    for _ in range(repeats):
        if getattr(arg, "is_cuda", False):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn(arg)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(arg)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_method(method: str, x: torch.Tensor, s: torch.Tensor, budget: int, repeats: int, **options) -> float:
    text = instruction_for(x) if promprune.method_spec(method).needs_instruction else None
    return median_ms(lambda features: promprune.select(features, s, budget=budget, method=method, instruction=text,
                                                       **options), x, repeats)


def time_vispruner_wide(x: torch.Tensor, s: torch.Tensor, budget: int, repeats: int) -> float:
    """VisPruner's median ms with its other kernel (``VisTiles(rank="wide")``), NaN where Triton cannot build it
    here; the default kernel is left as it was (a failure here does not send the other rows to the torch loop)."""
    from promprune.selection import greedy_triton

    default_tiles, broken = greedy_triton.VIS_TILES, accel._BROKEN.get("vispruner")
    greedy_triton.VIS_TILES = dataclasses.replace(default_tiles, rank="wide")
    try:
        ms = time_method("vispruner", x, s, budget, repeats)
        return ms if accel._BROKEN.get("vispruner") == broken else float("nan")
    finally:
        greedy_triton.VIS_TILES = default_tiles
        if broken is None:
            accel._BROKEN.pop("vispruner", None)
        else:
            accel._BROKEN["vispruner"] = broken


def time_near_mu(x: torch.Tensor, s: torch.Tensor, budget: int, repeats: int) -> tuple[float, str]:
    """PromPrune's median ms with mu at the inputs' median exact entropy, and how its split decided: the random
    inputs' entropies (~0.55) lie far from the default mu (0.42), where the first stage decides every image, while a
    real image near mu needs more Lanczos stages (the model path's LLaVA-NeXT photograph: three; RESULTS
    2026-11-27)."""
    mu = float(entropy_of_matrix(spectral_matrix(x)).median())
    ms = time_method("promprune", x, s, budget, repeats, mu=mu)
    report = certified.LAST_REPORT[0] if certified.applies(min(x.shape[1], x.shape[2]), x) and \
        certified.LAST_REPORT else None
    return ms, (f"stages {report.decided}, exact {report.exact_note}" if report else "exact entropy")


# Offsets (normalized H) tried by ``boundary_mu``, largest first: halving from 1e-3 to ~1e-10
BOUNDARY_OFFSETS = tuple(1e-3 * 0.5 ** i for i in range(24))


def boundary_mu(x: torch.Tensor, s: torch.Tensor, budget: int, stages: int = 2) -> tuple[float | None, str]:
    """A mu that puts the first view's entropy just above the count boundary between ``t_sal = budget // 2`` and one
    more (``split_budget``'s half-even rounding), so that the certified split runs at least ``stages`` stages for it
    and still decides it without the eigensolve: a real image near mu. The largest offset of `BOUNDARY_OFFSETS` that
    does so, found by calling ``select`` and reading its report; ``(None, why)`` where none does (the split off this
    path, or every offset decided sooner or went to the eigensolve). The other views of the call decide as they
    fall. The calls run in the caller's mode: with CUDA graphs on (as the tables search it), the eager schedule's stage
    ends include the graphs' (``certified.schedule``), so the same mu runs at least as many stages eagerly."""
    h0 = float(entropy_of_matrix(spectral_matrix(x[:1].float())).double()[0])
    k = budget // 2
    keep = 1.0 - (k + 0.5) / budget  # sigmoid((H - mu) / tau) at the boundary (ratio_range (0, 1))
    z = np.log(keep / (1.0 - keep))
    seen = []
    for offset in BOUNDARY_OFFSETS:
        mu = h0 - offset - DEFAULT_TAU * z  # the boundary at h0 - offset
        promprune.select(x, s, budget=budget, method="promprune", mu=mu)
        if not (certified.applies(min(x.shape[1], x.shape[2]), x) and certified.LAST_REPORT):
            return None, "exact entropy"
        report = certified.LAST_REPORT[0]
        seen.append(len(report.decided))
        if len(report.decided) >= stages and report.exact == 0:  # a later stage decided the view that went on
            return mu, f"offset {offset:.1e}: stages {report.decided}"
    return None, f"no offset ran {stages} stages without the eigensolve (stages run: {seen})"


def time_boundary(x: torch.Tensor, s: torch.Tensor, budget: int, repeats: int) -> tuple[float, float, str]:
    """PromPrune's median ms eager and with CUDA graphs for a first view just above a count boundary
    (``boundary_mu``, searched with graphs: two stages or more either way), NaN where no mu does that; and how the
    split decided."""
    with accel.graphs(True):
        mu, note = boundary_mu(x, s, budget)
    if mu is None:
        return float("nan"), float("nan"), note
    eager = time_method("promprune", x, s, budget, repeats, mu=mu)
    with accel.graphs(True):  # every stage's graph seen once eagerly (SIGHTINGS), then captured in the warm-up
        promprune.select(x, s, budget=budget, method="promprune", mu=mu)
        graphs = time_method("promprune", x, s, budget, repeats, mu=mu)
    return eager, graphs, note


def paired_ratio(x: torch.Tensor, s: torch.Tensor, budget: int, pairs: int) -> float:
    """Median over ``pairs`` pairs of PromPrune's time over DivPrune's on the same inputs (wall time, the CPU), the two
    timed within moments of each other (each after one untimed call): a machine whose speed drifts between the two
    methods' timing windows moves this less than the ratio of two medians taken one method after the other."""
    ratios = []
    for _ in range(pairs + 1):  # the first pair warms up
        ms = {m: time_method(m, x, s, budget, 1) for m in ("divprune", "promprune")}
        ratios.append(ms["promprune"] / ms["divprune"])
    return statistics.median(ratios[1:])


def centered_gram(x: torch.Tensor) -> torch.Tensor:
    """The N x N Gram of the L2-normalized, centered tokens: the matrix whose spectrum the entropy reads."""
    xn = torch.nn.functional.normalize(x.float(), dim=-1)
    xc = xn - xn.mean(dim=1, keepdim=True)
    return xc @ xc.transpose(1, 2)


def time_exact_entropy(x: torch.Tensor, repeats: int) -> float:
    """Median ms of what the exact entropy adds to a PromPrune call on these inputs: centering the tokens' Gram, which
    the call forms anyway for its coverage kernel (as DivPrune does), and the eigensolve. (Before 2026-11-27 this row
    formed its own Gram too, which overstated the floor below by one Gram.)"""
    gram = TokenSet(x, None).unit_gram if x.shape[1] <= x.shape[2] else None  # N > d: the covariance, not shared
    return median_ms(lambda g: entropy_of_matrix(spectral_matrix(x, g)), gram, repeats)


def promprune_stages(x: torch.Tensor, s: torch.Tensor, budget: int) -> dict:
    """PromPrune's stages as separate calls on ``x [B, N, d]``, each on the outputs of the one before:
    name -> (function, its argument). The split is the certified one on the fast path, the exact one otherwise."""
    def fresh() -> TokenSet:
        return TokenSet(x.float(), s, source=x)

    def count_of(h):
        return split_budget(h, budget, mu=DEFAULT_MU, tau=DEFAULT_TAU)

    done = fresh()
    t_sal = count_of(done.spectral_entropy).to(x.device)
    anchor = ranks_to_mask(stable_descending_order(minmax(s)), t_sal)
    counts = budget - t_sal
    width = int(counts.max())

    def split(gram):
        tokens = fresh()
        tokens.__dict__["unit_gram"] = gram  # the Gram given: time the centering and the split only
        if certified.applies(tokens.n, tokens.x):
            return certified_split(tokens, count_of)[0].to(x.device)
        return count_of(tokens.spectral_entropy).to(x.device)

    return {"gram": (lambda _: fresh().unit_gram, x),
            "split": (split, done.unit_gram),
            "saliency stage": (lambda t: ranks_to_mask(stable_descending_order(minmax(s)), t), t_sal),
            "coverage stage": (lambda a: coverage_picks(done, ~a, counts, a, diversity="dpp", conditional=False,
                                                        width=width), anchor),
            # both stages as the call runs them: two kernels on the fast path (``greedy_triton.salient_front``); the
            # two rows above are their torch ops, which run where Triton cannot build it
            "both stages": (lambda t: two_stage(done, budget, t, diversity="dpp", conditional=False,
                                                method="promprune").indices, t_sal)}


def time_stages(x: torch.Tensor, s: torch.Tensor, budget: int, repeats: int) -> dict[str, float]:
    return {name: median_ms(fn, arg, repeats) for name, (fn, arg) in promprune_stages(x, s, budget).items()}


TABLES = ("timing", "costs", "split", "schedules", "routes", "traffic", "bounds")  # --tables


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="dtype of the features handed to select (the model's dtype)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="images per call (NeXT: 5 crops each)")
    ap.add_argument("--split-images", type=int, default=12, help="images per shape for the certified split's "
                    "decision table (0: leave it out)")
    ap.add_argument("--tables", default="timing,costs,split", help="which tables to print (comma-separated): timing "
                    "(every method timed), costs (the cost model), split (the certified split's decisions), "
                    "schedules (Lanczos steps each stage schedule would run; not by default), routes (the split's "
                    "projected device ms by route and float64 rate; not by default), traffic (VisPruner's "
                    "kernel: what it loads of the similarity, modeled from the shapes; not by default), bounds (the "
                    "host's ms at the end of a split stage, by views and Lanczos steps; not by default)")
    ap.add_argument("--smoke", action="store_true", help="a check of the script: small shapes (SMOKE_SHAPES), one "
                    "repeat")
    ap.add_argument("--shapes", default=None, help="which shapes to run (comma-separated, e.g. llava-1.5; default: "
                    "all of " + ", ".join(SHAPES) + ")")
    args = ap.parse_args(argv)
    tables = set(args.tables.split(","))
    if args.smoke:
        args.repeats = 1
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    flags = Flags(__file__)
    flags.at_least("--repeats", args.repeats, 1, "timed calls", 7)
    flags.device("--device", args.device)
    flags.at_least("--threads", args.threads, 1, "torch CPU threads", 2)
    flags.at_least("--batch", args.batch, 1, "images per call", 1)
    flags.at_least("--split-images", args.split_images, 0, "0: leave the split's table out", 12)
    flags.choice("--tables", sorted(tables), TABLES, "table")
    if args.shapes:
        named = args.shapes.split(",")
        flags.choice("--shapes", named, shapes, "shape")
        shapes = {name: shape for name, shape in shapes.items() if name in named}
    flags.refuse()
    if args.threads:
        torch.set_num_threads(args.threads)
    if "timing" in tables:
        for batch in args.batch:
            run_batch(args, batch, shapes)
            print()
    if "costs" in tables:
        for i, batch in enumerate(args.batch):
            print_costs(shapes, batch, host=i == 0)
            print()
    if "split" in tables and args.split_images:
        print_split_decisions(shapes, args.split_images, args.device)
    if "schedules" in tables and args.split_images:
        print_schedules(shapes, args.split_images, args.device)
    if "routes" in tables and args.split_images:
        print_routes(shapes, args.split_images, args.device)
    if "traffic" in tables:
        print_vispruner_traffic(shapes)
    if "bounds" in tables:
        print_bounds_host(smoke=args.smoke)


# Issue 53's targets for PromPrune's selection on an H100 in fp16: ms per call, by images per call and shape.
TARGETS_MS = {1: {"llava-1.5": 2.5, "llava-next": 4.0, "qwen2.5-vl": 5.0}, 8: {"llava-next": 15.0}}


def print_targets(batch: int, dtype: str, eager_ms: dict[str, float], graphs_ms: dict[str, float]) -> None:
    """One line per target of ``TARGETS_MS`` at this batch whose shape was timed: PromPrune's ms eager and with
    graphs, and whether it is met (eagerly, only with graphs, or not)."""
    for shape, target in TARGETS_MS.get(batch, {}).items():
        if shape in eager_ms and shape in graphs_ms:
            eager, graphs = eager_ms[shape], graphs_ms[shape]
            verdict = "met" if eager <= target else "met with graphs" if graphs <= target else "missed"
            print(f"issue 53's target at {shape}, batch {batch} ({dtype}): promprune {eager:.2f} ms, with graphs "
                  f"{graphs:.2f} ms, target <= {target:g} ms: {verdict}")


def run_batch(args, batch: int, shapes: dict) -> None:
    """Every method at every shape for ``batch`` images per call; on CUDA also the old path and the stages."""
    cuda = args.device.startswith("cuda")
    names = promprune.methods()
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device={args.device} ({device_name}) dtype={args.dtype} batch={batch} threads={torch.get_num_threads()} "
          f"repeats={args.repeats} torch={torch.__version__} entropy={accel.entropy_mode()}")
    if cuda:
        print(certified.describe_route(args.device, tuple(sorted({min(N, d) for _, N, d, _ in shapes.values()}))))
    results: dict[str, dict[str, float]] = {m: {} for m in names}
    old: dict[str, dict[str, float]] = {m: {} for m in names}
    exact_ms: dict[str, float] = {}
    graphs_ms: dict[str, float] = {}
    loop_ms: dict[str, float] = {}
    steps_ms: dict[bool, dict[str, float]] = {True: {}, False: {}}
    torch_stages_ms: dict[str, float] = {}
    wide_ms: dict[str, float] = {}
    stages: dict[str, dict[str, float]] = {}
    near_mu: dict[str, tuple[float, str]] = {}
    boundary: dict[str, tuple[float, float, str]] = {}
    paired: dict[str, float] = {}
    for shape, (B, N, d, T) in shapes.items():
        x, s = make_inputs(B * batch, N, d, args.device, dtype=getattr(torch, args.dtype))
        for m in names:
            results[m][shape] = time_method(m, x, s, T, args.repeats)
        near_mu[shape] = time_near_mu(x, s, T, args.repeats)
        if cuda:
            stages[shape] = time_stages(x, s, T, args.repeats)
            boundary[shape] = time_boundary(x, s, T, args.repeats)
            with accel.graphs(True):  # PromPrune as CUDA graphs (off by default until measured)
                promprune.select(x, s, budget=T, method="promprune")  # a shape's first call runs eagerly (SIGHTINGS)
                graphs_ms[shape] = time_method("promprune", x, s, T, args.repeats)  # its warm-up captures
            with accel.without_kernel("lanczos"):  # the split in torch (its rho from the Gram, its recurrence)
                loop_ms[shape] = time_method("promprune", x, s, T, args.repeats)
            from promprune.selection import lanczos_triton

            for fused in (True, False):  # the recurrence one way at every shape (lanczos_triton.FUSED_UP_TO)
                with lanczos_triton.fusing(fused):
                    steps_ms[fused][shape] = time_method("promprune", x, s, T, args.repeats)
            with accel.without_kernel("front"):  # the stages after the split in torch ops, not two kernels
                torch_stages_ms[shape] = time_method("promprune", x, s, T, args.repeats)
            wide_ms[shape] = time_vispruner_wide(x, s, T, args.repeats)
            with accel.disabled():
                for m in names:
                    old[m][shape] = time_method(m, x, s, T, args.repeats)
        else:
            exact_ms[shape] = time_exact_entropy(x, args.repeats)
            paired[shape] = paired_ratio(x, s, T, args.repeats)
    print_methods(names, results, old if cuda else None, shapes)

    def row(label: str, ms: dict[str, float], note: str) -> None:  # ms per shape, and against DivPrune's
        cells = (f"{ms[sh]:>17.2f} ({ms[sh] / results['divprune'][sh]:4.2f}x)" for sh in shapes)
        print(f"{label:<16}" + "".join(cells) + f"   ({note})")

    row("promprune, mu~H", {sh: v[0] for sh, v in near_mu.items()},
        "mu at the inputs' median entropy; split: " + "; ".join(f"{sh} {near_mu[sh][1]}" for sh in shapes))
    if cuda:
        print_stages(stages, results, shapes)
        row("select, graphs", graphs_ms, "PROMPRUNE_GRAPHS=1")
        row("boundary", {sh: v[0] for sh, v in boundary.items()}, "the first view just above a count boundary: "
            "two stages or more; " + "; ".join(f"{sh} {boundary[sh][2]}" for sh in shapes))
        row("boundary, graphs", {sh: v[1] for sh, v in boundary.items()}, "the same with PROMPRUNE_GRAPHS=1")
        row("select, fused", steps_ms[True], "a Lanczos step one launch at every shape (_fused_kernel)")
        row("select, unfused", steps_ms[False], "a Lanczos step three launches at every shape (cuBLAS' product, "
            "the dot, the update); the default takes the fused way up to lanczos_triton.FUSED_UP_TO")
        row("select, loop", loop_ms, "the split in torch, not lanczos_triton: its rho in eleven launches against "
            "two, seven a Lanczos step against three")
        row("select, stages", torch_stages_ms, "the stages after the split in torch ops (~30 launches), not "
            "greedy_triton.salient_front and the DPP after it (two)")
        row("vispruner, wide", wide_ms, "VisTiles(rank='wide'): a round's evens at once, one sort sized to the "
            "round; not the default")
        worst = max(results[m][sh] / results["divprune"][sh] for m in names for sh in shapes)
        print(f"\nslowest method / divprune, worst shape: {worst:.2f}x at batch {batch} (target: <= 3x)")
        print_targets(batch, args.dtype, results["promprune"], graphs_ms)
    else:
        print_exact_entropy(results, exact_ms, shapes)
        print(f"{'paired (x div)':<16}" + "".join(f"{paired[sh]:>25.2f}x" for sh in shapes))
        print(f"(paired: the median of {args.repeats} ratios of a PromPrune call to a DivPrune call timed just before "
              "it, each after one untimed call, on the same inputs)")
    worst = max(results["promprune"][sh] / results["divprune"][sh] for sh in shapes)
    print(f"\npromprune / divprune, worst shape: {worst:.2f}x at batch {batch} (CPU bar: <= 2.5x)")
    if paired:
        print(f"promprune / divprune paired, worst shape: {max(paired.values()):.2f}x at batch {batch} "
              "(CPU bar: <= 2.5x)")


def print_methods(names, results, old, shapes) -> None:
    header = f"{'method':<16}" + "".join(f"{shape:>26}" for shape in shapes)
    print(header)
    unit = "ms (x div) | old ms" if old else "median ms (x divprune)"
    print(f"{'':<16}" + "".join(f"{unit:>26}" for _ in shapes))
    for m in names:
        cells = ""
        for sh in shapes:
            ratio = results[m][sh] / results["divprune"][sh]
            cells += (f"{results[m][sh]:>9.2f} ({ratio:4.2f}x) | {old[m][sh]:6.1f}" if old
                      else f"{results[m][sh]:>16.1f} ({ratio:4.2f}x)   ")
        print(f"{m:<16}{cells}")


def print_stages(stages, results, shapes) -> None:
    print("\nPromPrune's stages, each timed alone (CUDA events, median ms); select = the whole call")
    print(f"{'':<16}" + "".join(f"{shape:>26}" for shape in shapes))
    for name in next(iter(stages.values())):
        print(f"{name:<16}" + "".join(f"{stages[sh][name]:>26.2f}" for sh in shapes))
    print(f"{'select':<16}" + "".join(f"{results['promprune'][sh]:>26.2f}" for sh in shapes))


def print_exact_entropy(results, exact_ms, shapes) -> None:
    print("\nAround the exact entropy (the step DivPrune lacks; the CPU split computes it): median ms")
    print(f"{'':<16}" + "".join(f"{shape:>26}" for shape in shapes))
    rows = {"divprune": lambda sh: results["divprune"][sh], "promprune": lambda sh: results["promprune"][sh],
            "exact entropy": lambda sh: exact_ms[sh],
            "remainder": lambda sh: results["promprune"][sh] - results["divprune"][sh] - exact_ms[sh]}
    for name, cell in rows.items():
        print(f"{name:<16}" + "".join(f"{cell(sh):>26.1f}" for sh in shapes))
    floor = {sh: (results["divprune"][sh] + exact_ms[sh]) / results["divprune"][sh] for sh in shapes}
    print(f"{'floor (x div)':<16}" + "".join(f"{floor[sh]:>25.2f}x" for sh in shapes))
    print("(exact entropy: the Gram's centering and the eigensolve, the Gram shared with the coverage kernel; "
          "remainder: PromPrune's time beyond DivPrune's and that: saliency order, the DPP loop vs DivPrune's; floor: "
          "DivPrune + the exact entropy)")


def print_costs(shapes, batch: int = 1, host: bool = True) -> None:
    """Each method's launches / host syncs / matmul GFLOPs of one call of ``batch`` images (``--batch``; NeXT: 5 views
    each) on the fast path, counted on the CPU, and a GPU time projected from them (``launches.project_ms``: an
    assumption, not a measurement); with ``host``, then the host's share at batch-1 stand-ins (:func:`print_host`)."""
    from benchmarks import launches

    print(f"Cost model of one call on the GPU fast path, counted on the CPU (batch {batch}; projection: "
          f"{launches.LAUNCH_US:g} us per launch, {launches.SYNC_US:g} us per sync, {launches.MATMUL_TFLOPS:g} "
          "TFLOP/s matmul)")
    print(f"{'method':<16}" + "".join(f"{shape:>30}" for shape in shapes))
    print(f"{'':<16}" + "".join(f"{'launches syncs GFLOP proj.ms':>30}" for _ in shapes))
    scaled = {name: (B * batch, N, d, T) for name, (B, N, d, T) in shapes.items()}
    for label, graphs, calls in _cost_rows(scaled):
        cells = ""
        for x, s, kwargs in calls:
            if kwargs is None:
                cells += f"{'-':>10} {'-':>5} {'-':>6} {'-':>6}"
                continue
            with fast_path_on_cpu(graphs=graphs):
                c = count(promprune.select, x, s, **kwargs)
            cells += f"{c.launches:>10d} {c.syncs:>5d} {c.flops / 1e9:>6.2f} {project_ms(c):>6.2f}"
        print(f"{label:<16}{cells}")
    print("(promprune, graphs: the split's and the picking stages replayed as CUDA graphs, PROMPRUNE_GRAPHS=1; each "
          "replay counted as its input copies, one launch and its output clones. boundary: PromPrune with mu placed "
          "so that the first view's entropy lies just above a count boundary, which a later Lanczos stage decides: "
          "a real image near mu)")
    if host:
        full = all(SHAPES.get(name) == shape for name, shape in shapes.items())  # the paper's (or some): stand-ins
        print_host({name: HOST_SHAPES[name] for name in shapes} if full else shapes)


# print_host's stand-ins for the paper's shapes: the same layouts (views, budget share, N <= d) at a size where each
# eager op costs the CPU about what dispatching it costs
HOST_SHAPES = {"llava-1.5": (1, 96, 128, 16), "llava-next": (5, 96, 128, 16), "qwen2.5-vl": (1, 144, 192, 16)}


def print_host(shapes, calls: int = 30) -> None:
    """The host's work in one call on the fast path, measured on this CPU (``launches.host_ms``: kernels stubbed,
    graph bodies skipped, stand-in sizes): what the launch count prices only on average."""
    from benchmarks import launches

    stand_ins = ", ".join(f"{sh} {B}x{N}x{d} T={T}" for sh, (B, N, d, T) in shapes.items())
    print(f"\nHost time of one call on the fast path, this CPU ({torch.get_num_threads()} threads; median ms of "
          f"{calls}; kernels stubbed, graph bodies not run; stand-ins {stand_ins})")
    print(f"{'method':<18}" + "".join(f"{shape:>12}" for shape in shapes))
    for label, graphs, per_shape in _cost_rows(shapes):
        cells = [float("nan") if kwargs is None else
                 launches.host_ms(promprune.select, x, s, graphs=graphs, calls=calls, **kwargs)
                 for x, s, kwargs in per_shape]
        print(f"{label:<18}" + "".join(f"{ms:>12.2f}" for ms in cells))


def _cost_rows(shapes):
    """The rows of the cost tables: ``(label, graphs, [(x, s, select's keyword arguments) per shape])``, every
    method on the fast path, then PromPrune with its graphs, then PromPrune eager and with graphs for a first view
    just above a count boundary (``boundary_mu``: two stages or more; keyword arguments None where no mu does
    that)."""
    inputs = [make_inputs(B, N, d, "cpu") + (T,) for B, N, d, T in shapes.values()]
    rows = [(m, m, False) for m in promprune.methods()] + [("promprune, graphs", "promprune", True)]
    out = [(label, graphs, [(x, s, {"budget": T, "method": m, "instruction": instruction_for(x)
                                    if promprune.method_spec(m).needs_instruction else None})
                            for x, s, T in inputs])
           for label, m, graphs in rows]
    with fast_path_on_cpu(graphs=True):  # two stages as graphs: as many or more eagerly
        mus = [boundary_mu(x, s, T)[0] for x, s, T in inputs]
    for label, graphs in (("boundary", False), ("boundary, graphs", True)):
        out.append((label, graphs, [(x, s, None if mu is None else {"budget": T, "method": "promprune", "mu": mu})
                                    for (x, s, T), mu in zip(inputs, mus)]))
    return out


def _no_odd_prefixes(R0: int, odds: int) -> list[float]:
    """For m = 0 .. R0, the chance that the first m entries of a sorted row of ``R0`` hold none of the ``odds`` odd
    candidates, were their places random (hypergeometric; a running product)."""
    out = [1.0]
    for i in range(R0):
        out.append(out[-1] * max(R0 - odds - i, 0) / (R0 - i))
    return out


def _no_odd_within(R0: int, odds: int, m: int) -> float:
    """``_no_odd_prefixes`` at ``m`` entries."""
    return _no_odd_prefixes(R0, odds)[min(m, R0)]


TRAFFIC_ROWS = ("rounds", "gathered sectors", "rows sectors", "scan sectors", "tall ranking", "tile ranking",
                "rank steps", "scan steps", "flag steps", "flag steps, cleared")


def vispruner_traffic(R0: int, keep: int) -> dict[str, float]:
    """What VisPruner's kernel loads of the candidates' similarity ``C [R0, R0]`` over all its rounds, in 32-byte
    sectors (8 floats), and the comparisons its ranking runs, for each of its three forms: before 2026-11-27
    ("gathered": the odd columns gathered, each element its own sector; the ranking over tiles as tall as the first
    round's evens), 2026-11-27 ("rows": each even's row read contiguously where odd columns lie, at most ``min(R0 / 8,
    odds)`` sectors a row) and since 2026-11-28 ("scan": each even reads its sorted row and its columns ``chunk``
    entries at a time down to the first odd candidate, the chunks expected were the odd candidates' places in the row
    random). The ranking of "rows" and "scan": evens ``BLOCK_E`` at a time. And the loop steps one program runs in
    sequence besides the ranking (each ends in a reduction or a barrier): "scan steps" (per block of ``BLOCK_M``
    evens, chunks until none of them is pending), "flag steps" (marking a round's odd candidates and copying them
    after the evens: ``BLOCK_P`` at a time), "flag steps, cleared" (the same with every flag cleared first each
    round, as before 2026-11-28's stamps), and for comparison "rank steps" (the ranking's tiles; ``rank="sort"``
    instead sorts once a round). Host arithmetic from the sizes alone: a model, not a measurement."""
    from promprune.selection import greedy_triton
    from promprune.selection.baselines import VISPRUNER_ROUND

    block_e, block_p, _ = greedy_triton.vispruner_blocks(R0)
    chunk = greedy_triton.VIS_TILES.chunk
    old_h = greedy_triton.triton.next_power_of_2(max((R0 + 1) // 2, 16))  # the first kernel's BLOCK_H
    evens = greedy_triton.VIS_TILES.evens
    out = dict.fromkeys(TRAFFIC_ROWS, 0.0)
    per_chunk = 2 * -(-min(chunk, R0) // 8)  # a chunk's values and its columns (int32)
    R = R0
    while R > keep:
        E, odds = (R + 1) // 2, R // 2
        free = _no_odd_prefixes(R0, odds)[0:R0:chunk]  # for each chunk: the chance an even still looks past it
        chunks = sum(free)  # expected chunks read: one per prefix still odd-free
        for size in [evens] * (E // evens) + ([E % evens] if E % evens else []):  # a block goes on while any waits
            out["scan steps"] += sum(1 - (1 - p) ** size for p in free)
        flags = 2 * -(-odds // block_p)  # marking the odds, then copying them after the evens
        out["flag steps"] += flags
        out["flag steps, cleared"] += flags + -(-R0 // block_p)  # and clearing every flag first
        out["rounds"] += 1
        out["gathered sectors"] += E * odds
        out["rows sectors"] += E * min(-(-R0 // 8), odds)
        out["scan sectors"] += E * chunks * per_chunk
        out["tall ranking"] += old_h * E
        out["tile ranking"] += -(-E // block_e) * block_e * -(-E // block_p) * block_p
        out["rank steps"] += -(-E // block_e) * -(-E // block_p)
        R -= min(VISPRUNER_ROUND, R - keep, E)
    return out


def print_bounds_host(smoke: bool = False, calls: int = 200) -> None:
    """The host's work at the end of each stage of the certified split, measured on this CPU: the Gauss / Gauss-Radau
    bracket (``certified.bounds``: two batched dense eigensolves of k x k and (k + 1) x (k + 1) tridiagonals) and the
    decision (``certified.decide``: the counts of both ends), for ``views`` images still undecided after ``k`` steps.
    The device waits meanwhile (the next stage's launches follow it), so on a GPU this adds to the call."""
    n = 64 if smoke else 576
    views, steps = ((1, 5), (6, 12)) if smoke else ((1, 5, 40), (6, 12, 24, 48))
    print(f"\nHost ms at the end of a split stage, this CPU (median of {calls}; n = {n}; LLaVA-NeXT at batch 8 is 40 "
          "views)")
    print(f"{'views':<8}" + "".join(f"{f'k={k} bounds':>14}{'decide':>8}" for k in steps))
    g = torch.Generator().manual_seed(0)

    def count_of(h):
        return split_budget(h, 64, mu=DEFAULT_MU, tau=DEFAULT_TAU)

    for B in views:
        x = torch.randn(B, n, 2 * n, generator=g, dtype=torch.float64)
        rho = certified.density(spectral_matrix(x))
        cells = ""
        for k in steps:
            state = certified.Lanczos.start(rho).run(k)
            alpha, beta = state.alpha.numpy(), state.beta.numpy()
            lo, hi = certified.bounds(alpha, beta, n)
            ms = [median_ms(lambda a: certified.bounds(*a), (alpha, beta, n), calls),
                  median_ms(lambda a: certified.decide(*a), (lo, hi, count_of), calls)]
            cells += f"{ms[0]:>14.3f}{ms[1]:>8.3f}"
        print(f"{B:<8}" + cells)


def print_vispruner_traffic(shapes) -> None:
    print("VisPruner's kernel per view: 32-byte sectors of the similarity loaded and ranking comparisons (millions), "
          "loop steps in sequence (thousands), modeled from the sizes (important_ratio 0.5), not measured")
    print(f"{'':<24}" + "".join(f"{shape:>26}" for shape in shapes))
    cells = {}
    for sh, (_, N, _, T) in shapes.items():
        t_imp = T // 2
        cells[sh] = vispruner_traffic(N - t_imp, T - t_imp)
    for name in TRAFFIC_ROWS:
        scale = 1 if name == "rounds" else 1e3 if "steps" in name else 1e6
        print(f"{name:<24}" + "".join(f"{cells[sh][name] / scale:>26.{0 if scale == 1 else 2}f}" for sh in shapes))
    for new, old in (("scan sectors", "rows sectors"), ("scan sectors", "gathered sectors"),
                     ("tile ranking", "tall ranking")):
        print(f"{new.split()[0] + ' / ' + old.split()[0] + ' ' + old.split()[1]:<24}"
              + "".join(f"{c[new] / c[old]:>26.2f}" for c in cells.values()))


def spread_inputs(B: int, N: int, d: int, seed: int) -> torch.Tensor:
    """``[B, N, d]`` features of varied spectra: power laws (exponents 0.8..2) and low rank plus noise, so entropies
    spread over the paper's range."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        if b % 2:
            alpha = 0.8 + 1.2 * b / max(B - 1, 1)
            scale = torch.arange(1, d + 1, dtype=torch.float32) ** (-alpha / 2)
            rows.append(torch.randn(N, d, generator=g) * scale[torch.randperm(d, generator=g)])
        else:
            rank = 4 + 8 * b % 40
            rows.append(torch.randn(N, rank, generator=g) @ torch.randn(rank, d, generator=g)
                        + (0.1 + 0.1 * b) * torch.randn(N, d, generator=g))
    return torch.stack(rows)


def split_images(N: int, d: int, T: int, images: int, device: str):
    """The split tables' images at one shape: ``(matrix [images, n, n], counts, exact_h [images])``, where
    ``counts[i]`` maps normalized entropies to t_sal with mu placed so that image i's entropy falls in the sigmoid's
    steep part (z uniform in [-2, 2]: 12% to 88% coverage, the hardest place to decide)."""
    matrix = spectral_matrix(spread_inputs(images, N, d, seed=N).to(device))
    exact_h = entropy_of_matrix(matrix).double().cpu()
    z = torch.linspace(-2, 2, images, dtype=torch.float64)

    def count_for(mu: float):
        return lambda h: split_budget(h, T, mu=mu, tau=DEFAULT_TAU)

    return matrix, [count_for(float(exact_h[i] - DEFAULT_TAU * z[i])) for i in range(images)], exact_h


def print_split_decisions(shapes, images: int, device: str) -> None:
    """The certified split on ``images`` varied images per shape, mu placed so that each image's entropy falls in the
    sigmoid's steep part (z uniform in [-2, 2]: 12% to 88% coverage, the hardest place to decide): who decided (the
    eigensolve's images, and of them those sent there before the last stage, ``SplitReport.hopeless``), the
    brackets' widths, and the counts against the exact algorithm's. Each image runs the schedule of an eager call at
    its shape (``certified.schedule``: the leading stage, then `certified.STEPS`)."""
    print(f"Certified split, {images} images per shape, mu within +-2 tau of each entropy (device={device}):")
    print(f"{'':<24}" + "".join(f"{shape:>26}" for shape in shapes))
    schedules = {name: certified.schedule(B, N) for name, (B, N, _d, _T) in shapes.items()}
    stage_rows = [f"stage {i + 1} decided" for i in range(max(map(len, schedules.values())))]
    rows: dict[str, list[str]] = {k: [] for k in (*stage_rows, "exact eigensolve", "of them early", "median width",
                                                  "max width", "counts equal exact")}
    for name, (_B, N, d, T) in shapes.items():
        matrix, counts, exact_h = split_images(N, d, T, images, device)
        decided, exact_n, early, widths, equal = [0] * len(stage_rows), 0, 0, [], True
        for i, count_of in enumerate(counts):  # one image per call: its own mu
            t_sal, _, _ = certified.split(matrix[i:i + 1], count_of, steps=schedules[name])
            report = certified.LAST_REPORT[0]
            decided = [a + b for a, b in zip(decided, report.decided + [0] * (len(stage_rows) - len(report.decided)))]
            exact_n += report.exact
            early += report.hopeless
            widths += report.widths
            equal &= bool(torch.equal(t_sal, count_of(exact_h[i:i + 1])))
        for i, (row, n) in enumerate(zip(stage_rows, decided)):
            rows[row].append(f"{n}/{images}" if i < len(schedules[name]) else "-")
        rows["exact eigensolve"].append(f"{exact_n}/{images}")
        rows["of them early"].append(f"{early}/{exact_n}")
        rows["median width"].append(f"{np.median(widths):.1e}" if widths else "-")
        rows["max width"].append(f"{max(widths):.1e}" if widths else "-")
        rows["counts equal exact"].append("yes" if equal else "NO")
    for name, cells in rows.items():
        print(f"{name:<24}" + "".join(f"{c:>26}" for c in cells))
    print("(stages, Lanczos steps: " + "; ".join(f"{name} {', '.join(map(str, steps))}" for name, steps in
                                               schedules.items()) + "; of them early: eigensolved before the last "
          "stage, their bracket within the margin of a count boundary (certified.judge); widths in normalized H of "
          "the decided images)")


# Stage schedules compared by print_schedules: the one before 2026-11-26's H100 run, the shipped ones (STEPS, and STEPS
# after the lead: `certified.schedule`, eager or as graphs), and others.
SCHEDULES = ((16, 48), (12, 24, 48), (16, 24, 48), (12, 20, 32, 48), (12, 24, 32, 48), (8, 16, 24, 48),
             (4, 12, 24, 32, 48), (6, 12, 24, 32, 48))
PROBE_STEPS = (4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48)


_NEEDED: dict[tuple, list["Need"]] = {}


@dataclasses.dataclass(frozen=True)
class Need:
    """What one of the split table's images needs (``steps_needed``): ``steps``, the fewest Lanczos steps of
    ``PROBE_STEPS`` whose bracket decides it (None: none does, the eigensolve), and ``hopeless``, the probe steps
    after which ``certified.judge`` gives it up (its bracket within the margin of a count boundary: the split
    eigensolves it at the first stage that ends there, without the remaining stages)."""

    steps: int | None
    hopeless: frozenset[int] = frozenset()

    def stage(self, schedule: tuple[int, ...]) -> tuple[int, bool]:
        """``(i, decided)``: the stage of ``schedule`` after which the split is done with the image, and whether its
        bracket decided it there (else it goes on to the eigensolve: given up on, or the last stage's undecided)."""
        for i, end in enumerate(schedule):
            if self.steps is not None and self.steps <= end:
                return i, True
            if end in self.hopeless and i < len(schedule) - 1:  # ``_split`` gives up only before the last stage
                return i, False
        return len(schedule) - 1, False


def steps_needed(N: int, d: int, T: int, images: int, device: str) -> list[Need]:
    """For each of the split table's images at a shape (``split_images``), its ``Need``: judged as ``certified.split``
    judges (``floored_bounds``, ``decision_margin`` of the size) at every step of ``PROBE_STEPS``. Computed once per
    shape and process."""
    key = (N, d, T, images, device)
    if key not in _NEEDED:
        matrix, counts, _exact_h = split_images(N, d, T, images, device)
        n = matrix.shape[-1]
        margin = certified.decision_margin(n)
        need = []
        for i, count_of in enumerate(counts):
            state, done, first, hopeless = certified.Lanczos.start(certified.density(matrix[i:i + 1])), 0, None, set()
            for k in PROBE_STEPS:
                state, done = state.run(k - done), k
                lo, hi = certified.floored_bounds(*(certified.host_read(t) for t in (state.alpha, state.beta)), n)
                decided, _, gave_up = certified.judge(lo, hi, count_of, margin)
                if decided[0]:
                    first = k
                    break
                if gave_up[0]:
                    hopeless.add(k)
            need.append(Need(first, frozenset(hopeless)))
        _NEEDED[key] = need
    return _NEEDED[key]


# float64 rates (TFLOP/s, spec sheets; the H100's as cuBLAS reached it on 2026-11-26) the routes table prices
ROUTE_RATES = (("A40", 0.58), ("H800", 1.0), ("L40S", 1.35), ("V100", 7.8), ("A100", 19.5), ("H100", 50.0))


def route_ms(need: "Need | int | None", n: int, tflops: float, schedule: tuple[int, ...], auto: bool) -> float:
    """Projected device ms of one view on the bracket route with ``schedule``: ``need`` (``Need``; an int or None: the
    steps whose bracket first decides it, None never, and never given up on) prices its stages' steps at ``tflops``
    (``certified.step_ms``) and the eigensolve where no stage decides it (given up on after a stage, ``Need.hopeless``,
    the remaining stages left out); with ``auto`` a stage runs only where it pays (``certified.stage_pays``; the first
    one deciding the route), else the view goes to the eigensolve there."""
    need = need if isinstance(need, Need) else Need(need)
    stage, decided = need.stage(schedule)
    done = 0
    for end in schedule[:stage + 1]:
        if auto and not certified.stage_pays(end - done, n, tflops):
            decided = False
            break
        done = end
    return done * certified.step_ms(n, tflops) + (0.0 if decided else certified.eigensolve_ms(n))


def print_routes(shapes, images: int, device: str) -> None:
    """Projected device ms per view of PromPrune's split by route and float64 rate, over the split table's images
    (mu within +-2 tau: views near mu, where a calibrated mu puts real images) and for a view far from mu (decided at
    the lead): the exact eigensolve, the bracket's every stage (``PROMPRUNE_ENTROPY=certified``) and "auto"
    (``certified.stage_pays``). Host work and launches left out; the eigensolve's cost is the H100's fit. A
    projection from the steps each image needs, counted here, and spec rates."""
    print(f"Projected device ms per view of the split by route, {images} images per shape near mu (device={device}; "
          "eigensolve / every stage / auto, near mu | far from mu):")
    print(f"{'float64 rate':<20}" + "".join(f"{shape:>36}" for shape in shapes))
    for gpu, tflops in ROUTE_RATES:
        cells = ""
        for B, N, d, T in shapes.values():
            n, need = min(N, d), steps_needed(N, d, T, images, device)
            schedule = certified.schedule(B, n)
            near = [np.mean([route_ms(k, n, tflops, schedule, auto) for k in need]) for auto in (False, True)]
            far = [route_ms(certified.LEAD, n, tflops, schedule, auto) for auto in (False, True)]
            cells += (f"{certified.eigensolve_ms(n):>9.2f} / {near[0]:>5.2f} / {near[1]:>5.2f} | {far[0]:>4.2f} / "
                      f"{far[1]:>4.2f}")
        print(f"{gpu + f' ({tflops:g})':<20}{cells}")
    print("(auto far from mu: the bracket's lead where it pays, else the eigensolve)")


def print_schedules(shapes, images: int, device: str) -> None:
    """How many Lanczos steps each stage schedule runs over the split table's images (the same images, mu within +-2
    tau): for each image the fewest steps (of ``PROBE_STEPS``) whose bracket decides it; a schedule runs an image to
    the first stage at or above that, or to the first stage before the last after which ``certified.judge`` gives it
    up (its bracket within the margin of a count boundary), or to the last: then the exact eigensolve (``Need``).
    Steps are what the device pays per view (each one a float64 n x n product); reads are the host's, one per stage a
    call runs (its sync and bounds, ~0.2 ms). A schedule is marked with the shapes whose call takes it, eagerly and
    replayed as CUDA graphs (``certified.schedule``: a leading stage where the batch's steps cost the device or the
    host more than a read)."""
    print(f"Lanczos steps per stage schedule, {images} images per shape, mu within +-2 tau (device={device}):")
    print(f"{'schedule':<24}" + "".join(f"{shape:>26}" for shape in shapes))
    needs = {name: steps_needed(N, d, T, images, device) for name, (_B, N, d, T) in shapes.items()}
    for schedule in SCHEDULES:
        cells = ""
        for name in shapes:
            went = [need.stage(schedule) for need in needs[name]]  # where each image is done, and whether decided
            steps, reads = sum(schedule[i] for i, _ in went), sum(i + 1 for i, _ in went)
            exact = sum(not decided for _, decided in went)
            cells += f"{steps:>5d} steps{reads:>4d} reads{exact:>3d} exact"
        marks = []
        for label, eager in (("eager", True), ("graphs", False)):
            shipped = [name for name, (B, N, _d, _T) in shapes.items() if certified.schedule(B, N, eager) == schedule]
            marks += [f"{label}: {', '.join(shipped)}"] if shipped else []
        mark = f"  (shipped: {'; '.join(marks)})" if marks else ""
        print(f"{', '.join(map(str, schedule)):<24}{cells}{mark}")


if __name__ == "__main__":
    main()
