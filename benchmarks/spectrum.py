"""Where to compute the spectral entropy's eigenvalues: median ms of the candidate routes at the paper's shapes.

    python benchmarks/spectrum.py [--device cuda] [--repeats 9]
    python benchmarks/spectrum.py --smoke      # a check of the script (seconds): small shapes, one repeat

The spectrum of the centered N x N Gram (N = 576 for CLIP views, 1296 for Qwen2.5-VL) is the one step of PromPrune
that DivPrune does not have. A GPU eigensolver runs one matrix at a time (cuSOLVER's batched Jacobi solver only
takes matrices up to 32 x 32), so a batch of views costs a batch of solves. Routes: ``eigvalsh`` on the device in
float32 / float64, on the host CPU after a copy (the copy is timed too), SciPy's LAPACK ``syevd`` on the host, and
the certified bounds PromPrune's split uses instead (``certified``: k Lanczos steps on the device in float64, the
recurrence read once, the Gauss / Gauss-Radau bracket on the host). Printed, never asserted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags  # noqa: E402
from benchmarks.selection import centered_gram, make_inputs, median_ms  # noqa: E402
from promprune.selection import certified  # noqa: E402


def host_scipy(g: torch.Tensor) -> list:
    """LAPACK's syevd through SciPy (its own OpenBLAS): faster than torch's alone on 2 cores, but not inside the
    selection, where its spinning BLAS threads compete with torch's (benchmarks/RESULTS.md)."""
    from scipy.linalg import eigh

    return [eigh(m, eigvals_only=True, driver="evd", check_finite=False) for m in g.cpu().numpy()]


SHAPES = {"llava-1.5 (1x576)": (1, 576, 4096), "llava-next (5x576)": (5, 576, 4096),
          "next batch 8 (40x576)": (40, 576, 4096), "qwen2.5-vl (1x1296)": (1, 1296, 3584)}
SMOKE_SHAPES = {"small (1x64)": (1, 64, 128), "small views (5x64)": (5, 64, 128)}  # --smoke


ROUTES = {
    "device fp32": lambda g: torch.linalg.eigvalsh(g),
    "host SciPy syevd fp32": host_scipy,
    "device fp64": lambda g: torch.linalg.eigvalsh(g.double()),
    "host fp32": lambda g: torch.linalg.eigvalsh(g.cpu()),
    "host fp64": lambda g: torch.linalg.eigvalsh(g.double().cpu()),
}


def bracket(g: torch.Tensor, steps: int):
    """The certified split's bounds after ``steps`` Lanczos steps (device), read once and evaluated on the host."""
    state = certified.Lanczos.start(certified.density(g)).run(steps)
    coeffs = certified.host_read(torch.cat([state.alpha, state.beta], 1))
    return certified.bounds(coeffs[:, :steps], coeffs[:, steps:], g.shape[-1])


for _k in certified.STEPS:
    ROUTES[f"bounds {_k} steps"] = lambda g, k=_k: bracket(g, k)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="a check of the script: small shapes, one repeat")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    flags = Flags(__file__)
    flags.device("--device", args.device)
    flags.at_least("--repeats", args.repeats, 1, "timed calls per route", 9)
    flags.refuse()
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.device.startswith("cuda"):
        print(certified.describe_route(args.device, tuple(sorted({min(N, d) for _, N, d in shapes.values()}))))
    print(f"| shape | {' | '.join(ROUTES)} |\n|---|{'---:|' * len(ROUTES)}")
    for name, (B, N, d) in shapes.items():
        g = centered_gram(make_inputs(B, N, d, args.device)[0])
        cells = [f"{median_ms(fn, g, args.repeats):.1f}" for fn in ROUTES.values()]
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
