"""How much of PromPrune's decision margin the float32 matrix's rounding takes, per view size.

The certified split (``promprune.selection.certified``) decides an image's T_sal from a bracket on its entropy, widened
by ``certified.decision_margin(n)``. The bracket holds the entropy of the float32 spectral matrix's spectrum taken as
non-negative; what it does not hold is that matrix's rounding: near-low-rank tokens give a float32 matrix negative
rounding eigenvalues, which move its float64 entropy, and the exact route (a float32 eigensolve, clamped at 1e-12)
reads them with its own rounding. This script feeds adversarial near-low-rank tokens (rank 1-16 around a common
offset, noise 0 to 1e-3: the cases a probe of 2026-12-07 found worst) through ``promprune.select`` with the certified
route forced and, for every image the bracket decided, prints by how much the two references lie outside the bracket:

- ``float64``: the float64 eigensolve of the float32 matrix the exact route builds (the metric itself);
- ``exact route``: ``PROMPRUNE_ENTROPY=exact``'s entropy of the same tokens (what the certified route must agree with).

Each is the worst over the inputs of one size, with the margin at that size and the headroom (margin / worst miss;
below 1 the certified route could keep other tokens than the exact route).

    python benchmarks/margin_by_size.py                        # n = 576, 1296 (d = 4096): ~5 CPU-minutes
    python benchmarks/margin_by_size.py --sizes 2304,3600      # larger views: ~45 CPU-minutes at 3600
    python benchmarks/margin_by_size.py --device cuda          # on a GPU: its eigensolve is the exact route
    python benchmarks/margin_by_size.py --smoke                # n = 128, d = 256, one seed
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
import promprune  # noqa: E402
from promprune.selection import accel, certified  # noqa: E402
from promprune.selection.registry import TokenSet  # noqa: E402
from benchmarks import Flags, comma_list  # noqa: E402

RANKS = (1, 2, 4, 8, 16)
NOISES = (0.0, 1e-5, 1e-4, 1e-3)


def tokens(n: int, d: int, rank: int, noise: float, seed: int, device: str = "cpu") -> torch.Tensor:
    """``[1, n, d]`` float32 tokens on ``device``: a rank-``rank`` part around one common offset, plus ``noise``."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, d)) / math.sqrt(d) * 0.6 \
        + 1.7 * rng.standard_normal(d) / math.sqrt(d) + noise * rng.standard_normal((n, d)) / math.sqrt(d)
    return torch.tensor(t, dtype=torch.float32, device=device)[None]


def float64_entropy(matrix: np.ndarray) -> float:
    """The normalized entropy of ``matrix``'s spectrum by numpy's float64 eigensolve, clamped at 1e-12."""
    lam = np.maximum(np.linalg.eigvalsh(matrix.astype(np.float64)), 1e-12)
    p = lam / lam.sum()
    return float(-(p * np.log(p)).sum() / math.log(len(lam)))


def entropy(x: torch.Tensor, route: str) -> tuple[float, float | None]:
    """``(entropy, the bracket's half-width or None)`` of PromPrune's selection of ``x`` on ``route``; the half-width
    without the margin (None: the eigensolve ran, not the bracket)."""
    saliency = torch.rand(1, x.shape[1], generator=torch.Generator().manual_seed(0)).to(x.device)
    with accel.entropy(route):
        sel = promprune.select(x, saliency, budget=64, method="promprune", mu=0.9)
    if route == "exact" or certified.LAST_REPORT[0].exact:
        return float(sel.entropy[0]), None
    return float(sel.entropy[0]), certified.LAST_REPORT[0].widths[0] / 2


def measure(n: int, d: int, seeds: int, device: str = "cpu") -> dict:
    """The worst misses over the adversarial inputs of size ``n`` whose bracket decided."""
    worst = {"float64": 0.0, "exact route": 0.0}
    decided = total = 0
    matrix_size = n
    for rank in RANKS:
        for noise in NOISES:
            for seed in range(seeds):
                x = tokens(n, d, rank, noise, seed, device)
                total += 1
                mid, half = entropy(x, "certified")
                if half is None:
                    continue
                decided += 1
                spectral = TokenSet(x, None).spectral_matrix[0].cpu().numpy()
                matrix_size = spectral.shape[0]
                refs = {"float64": float64_entropy(spectral), "exact route": entropy(x, "exact")[0]}
                for name, ref in refs.items():
                    worst[name] = max(worst[name], abs(ref - mid) - half)
    return {"n": matrix_size, "decided": decided, "total": total, **worst}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=comma_list(int, "576,1296"), default=[576, 1296],
                    help="token counts per view, comma-separated (default 576,1296)")
    ap.add_argument("--dim", type=int, default=4096, help="the tokens' dimension (default 4096, LLaVA's LLM)")
    ap.add_argument("--seeds", type=int, default=2, help="inputs per rank and noise (default 2)")
    ap.add_argument("--device", default="cpu", help="where the tokens and both routes run (default cpu; cuda: the "
                    "GPU's own eigensolve is the exact route to agree with)")
    ap.add_argument("--smoke", action="store_true", help="n = 128, d = 256, one seed (a check of the script)")
    args = ap.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--sizes", args.sizes, 2, "tokens per view", "576,1296")
    flags.at_least("--dim", args.dim, 2, "the tokens' dimension", 4096)
    flags.at_least("--seeds", args.seeds, 1, "inputs per rank and noise", 2)
    flags.device("--device", args.device)
    flags.refuse()
    sizes = args.sizes
    if args.smoke:
        sizes, args.dim, args.seeds = [128], 256, 1
    print(f"adversarial near-low-rank tokens, d = {args.dim}, {len(RANKS) * len(NOISES) * args.seeds} inputs per "
          f"size on {args.device}; torch {torch.__version__}, the certified route forced")
    print(f"{'tokens':>6} {'matrix':>6} {'decided':>8} | {'float64 miss':>12} {'exact-route miss':>16} | "
          f"{'margin':>8} {'headroom':>8} {'s':>5}")
    for n in sizes:
        start = time.perf_counter()
        row = measure(n, args.dim, args.seeds, args.device)
        margin = certified.decision_margin(row["n"])
        worst = max(row["float64"], row["exact route"])
        headroom = f"{margin / worst:.2f}x" if worst > 0 else "inf"
        print(f"{n:>6} {row['n']:>6} {row['decided']:>3} / {row['total']:<2} | {row['float64']:>12.2e} "
              f"{row['exact route']:>16.2e} | {margin:>8.2e} {headroom:>8} {time.perf_counter() - start:>5.0f}",
              flush=True)
    print("(miss: how far the reference lies outside the bracket, the worst over the decided inputs, in normalized H; "
          "margin: certified.decision_margin at the matrix's size; headroom below 1: a decision the exact route "
          "would not make)")


if __name__ == "__main__":
    main()
