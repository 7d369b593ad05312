"""The certified split's Lanczos steps fused (a launch a step) or not (cuBLAS' product, the dot, the update): which is
faster at which size, on a GPU; ``lanczos_triton.FUSED_UP_TO`` is the bound ``steps`` takes between them.

``lanczos_triton.steps`` runs a stage of the recurrence on ``rho [views, n, n]`` (float64) two ways: ``fused``
(``_fused_kernel``: each step's update and the next step's product in one Triton launch, float64 MMA) with
``count + 1`` launches from the start, or a cuBLAS ``bmm``, the dot's shares and the update a step (``3 count``). At
batch 1 the host's launches set a step's time; at large batches the device's product does, where cuBLAS may be faster.
For each shape this times a first stage of ``--steps`` steps and a stage continued from its state, both ways, eagerly
and replayed as a CUDA graph (``PROMPRUNE_GRAPHS=1``'s way), with CUDA events (median ms of ``--repeats``), checks
both against the torch loop (``certified.lanczos_steps`` with the kernels off: coefficients within 1e-10 of the
largest), and prints which way is faster and where ``fuses`` puts the shape::

    python benchmarks/lanczos_steps.py                         # on a GPU: ~1 min, most of it compiling
    TRITON_INTERPRET=1 python benchmarks/lanczos_steps.py --device cpu --shapes 1x40 2x70 --repeats 1   # a check

On the CPU it needs ``TRITON_INTERPRET=1`` (the kernels run in Triton's interpreter: a check of the values, its times
mean nothing).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import Flags  # noqa: E402
from benchmarks.selection import median_ms  # noqa: E402

# views x tokens: LLaVA-1.5 and LLaVA-NeXT (five views of 576) and Qwen2.5-VL (1296) at batch 1, then batches of them
SHAPES = ("1x576", "5x576", "1x1296", "2x576", "8x576", "40x576", "8x1296")


def density(views: int, n: int, device: str, seed: int = 0) -> torch.Tensor:
    """A trace-normalized centered Gram ``[views, n, n]`` (float64) of random unit tokens (d = 2n): a full spectrum,
    so no recurrence runs out."""
    from promprune.selection import certified
    from promprune.selection.entropy import centered_gram

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(views, n, 2 * n, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    return certified.density(centered_gram(x @ x.transpose(1, 2))).to(device)


def graphed_ms(fn, rho: torch.Tensor, repeats: int) -> float:
    """Median ms of one replay of ``fn``'s work captured as a CUDA graph (NaN where the capture fails); ``rho``: the
    stage's matrix (``median_ms`` times with CUDA events where it is on CUDA)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # the kernels compiled and cuBLAS' workspace made before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        print(f"    (capture failed: {str(exc).splitlines()[0]})")
        return float("nan")
    return median_ms(lambda _: graph.replay(), rho, repeats)


def agreement(got: tuple, want: tuple) -> float:
    """The largest coefficient difference over the largest coefficient (the packed alphas and betas)."""
    return float((got[0].cpu() - want[0]).abs().max() / want[0].abs().max())


def ways(blocks: list[int]) -> list[tuple[str, bool, int]]:
    """``(label, fused, block)``: the fused step at each block size (`lanczos_triton.BLOCK`, the product's block
    edge), then the unfused one."""
    return [(f"fused {b}x{b}", True, b) for b in blocks] + [("unfused", False, 0)]


def measure(views: int, n: int, steps: int, repeats: int, device: str, blocks: list[int]) -> dict:
    """One shape: ``{(way, stage, mode): ms}`` for each of ``ways``, stage first (from the start) / more (from its
    state), mode eager / graph (graphs on CUDA only), and ``(way, "check")``: the worse coefficient difference of
    the two stages from the torch loop's."""
    from promprune.selection import accel, certified, lanczos_triton

    rho = density(views, n, device)
    with accel.without_kernel("lanczos"):
        ref = certified.lanczos_steps(rho.cpu(), None, None, None, steps)
        ref_more = certified.lanczos_steps(rho.cpu(), ref[1], ref[2], ref[0][:, -1], steps)
    out = {}
    saved = lanczos_triton.BLOCK
    try:
        for way, fused, block in ways(blocks):
            lanczos_triton.BLOCK = block or saved
            first = lanczos_triton.steps(rho, None, None, None, steps, fused=fused)
            more = lanczos_triton.steps(rho, first[1], first[2], first[0][:, -1], steps, fused=fused)
            out[way, "check"] = max(agreement(first, ref), agreement(more, ref_more))
            state = (first[1].clone(), first[2].clone(), first[0][:, -1].clone())
            calls = {"first": lambda f=fused: lanczos_triton.steps(rho, None, None, None, steps, fused=f),
                     "more": lambda f=fused, st=state: lanczos_triton.steps(rho, *st, steps, fused=f)}
            for stage, call in calls.items():
                out[way, stage, "eager"] = median_ms(lambda _, c=call: c(), rho, repeats)
                if device == "cuda":
                    out[way, stage, "graph"] = graphed_ms(call, rho, repeats)
    finally:
        lanczos_triton.BLOCK = saved
    return out


def check_flags(args) -> list[tuple[int, int]]:
    """Refuse the command line's mistakes (exit 2, `benchmarks.Flags`) before a kernel compiles; the shapes as
    (views, tokens)."""
    import os

    flags = Flags(__file__)
    flags.device("--device", args.device, indexed=False)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        flags.add("--device cpu", "on the CPU the kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                  "(TRITON_INTERPRET=1 python benchmarks/lanczos_steps.py --device cpu ...)")
    shapes = []
    for shape in args.shapes:
        parts = shape.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            flags.add(f"--shapes {shape}", "expected VIEWSxTOKENS, two positive ints, e.g. --shapes 1x576 5x576")
        else:
            shapes.append((int(parts[0]), int(parts[1])))
    flags.at_least("--steps", args.steps, 1, "Lanczos steps a stage", 6)
    bad = [b for b in args.blocks if b < 16 or b & (b - 1)]
    if bad:
        flags.add(f"--blocks {' '.join(map(str, bad))}", "a block edge is a power of two, at least 16 (Triton's "
                  "tiles), e.g. --blocks 64 32")
    flags.at_least("--repeats", args.repeats, 1, "timed calls", 15)
    flags.refuse()
    return shapes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="views x tokens (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=6, help="steps a stage (default: the lead's 6)")
    ap.add_argument("--blocks", nargs="+", type=int, default=[64, 32],
                    help="the fused product's block edges to time (default: %(default)s; the shipped one first)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    args.shapes = check_flags(args)
    from promprune.selection import accel, certified, lanczos_triton

    if args.device == "cpu":
        accel.active = lambda t: True  # the fast path on CPU tensors: a check of the values
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter: times mean nothing)"
    print(f"Lanczos stages of {args.steps} steps, fused or not (lanczos_triton.steps), median ms of {args.repeats}; "
          f"{dev}; torch {torch.__version__}; FUSED_UP_TO = {lanczos_triton.FUSED_UP_TO:.3g} (views x n^3), "
          f"BLOCK = {lanczos_triton.BLOCK}; float64 tensor cores: "
          f"{'yes' if accel.float64_mma(args.device) else 'no (the fused way is off by default here)'}")
    if args.device == "cuda":
        print(certified.describe_route(args.device, (576, 1296)))
    modes = ("eager", "graph") if args.device == "cuda" else ("eager",)
    cols = [(stage, mode) for stage in ("first", "more") for mode in modes]
    print(f"{'shape':<8}{'fuses':>6}  {'way':<14}{'launches':>9}" + "".join(f"{f'{st} {m}':>13}" for st, m in cols)
          + f"{'check':>10}")
    faster_at = {}  # views x n^3 -> whether the shipped fused block's first stage was faster eagerly
    for shape in args.shapes:
        views, n = shape
        shape = f"{views}x{n}"
        r = measure(views, n, args.steps, args.repeats, args.device, args.blocks)
        shipped = f"fused {args.blocks[0]}x{args.blocks[0]}"
        faster_at[views * n ** 3] = r[shipped, "first", "eager"] < r["unfused", "first", "eager"]
        for i, (way, fused, _block) in enumerate(ways(args.blocks)):
            launches = f"{args.steps + 1}/{args.steps + 2}" if fused else f"{3 * args.steps}/{3 * args.steps + 1}"
            fuses = "yes" if lanczos_triton.fuses(views, n, args.device) else "no"
            lead = f"{shape:<8}{fuses:>6}" if i == 0 else " " * 14
            print(f"{lead}  {way:<14}{launches:>9}" + "".join(f"{r[way, st, m]:>13.3f}" for st, m in cols)
                  + f"{r[way, 'check']:>10.1e}")
    print("(fuses: where steps takes the fused path by default; launches: a first stage / a stage from a state; "
          "check: the worse coefficient difference of the two stages from the torch loop, over the largest; graph: "
          "one replay of the stage captured as a CUDA graph)")
    print(bound_line(faster_at, lanczos_triton.FUSED_UP_TO))


def bound_line(faster_at: dict[int, bool], shipped: float) -> str:
    """What the shapes say of ``FUSED_UP_TO``: the largest views x n^3 up to which the fused first stage (at the
    shipped block) was faster eagerly at every shape measured, and the smallest where it was not."""
    sizes = sorted(faster_at)
    slower = [size for size in sizes if not faster_at[size]]
    if not slower:
        said = f"fused faster eagerly at every shape measured (up to {sizes[-1]:.3g})"
    elif slower[0] == sizes[0]:
        said = f"fused slower eagerly from the smallest shape measured ({sizes[0]:.3g})"
    else:
        said = f"fused faster eagerly up to {max(s for s in sizes if s < slower[0]):.3g}, slower from {slower[0]:.3g}"
    return f"views x n^3: {said}; FUSED_UP_TO is {shipped:.3g}"


if __name__ == "__main__":
    main()
