"""How far the float32 spectral entropy moves from float64 as an image's tokens grow alike, by route.

Tokens: one direction shared by all, plus a rank-``r`` variation scaled so the spread (1 - |mean unit token|^2, the
centered unit Gram's trace over N) runs from ~0.9 down to ~1e-4 (a mean cosine near 0.9999: a blank page). For each,
the normalized spectral entropy in float32 three ways against float64 numpy on the same tokens:

- ``gram``: centered in Gram space (``entropy.centered_gram`` of the shared unit Gram), what the exact route did
  for every image before 2026-12-07;
- ``tokens``: the tokens centered before their product (``entropy.centered_unit_gram``);
- ``library``: what ``promprune.select``'s exact route reads (``TokenSet.spectral_entropy``: the Gram it shares with
  the coverage stage, ``entropy.cancels`` picking ``tokens`` below the spread ``entropy.SPREAD_FLOOR``; a last column
  says which). ``promprune.spectral_entropy`` alone, with no Gram to share, always centers the tokens first.

    python benchmarks/alike_tokens.py           # N=576 d=4096 (LLaVA-1.5) and N=1296 d=3584 (Qwen2.5-VL), ranks 20, 200
    python benchmarks/alike_tokens.py --smoke   # one small shape, one rank
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not

from benchmarks import Flags  # noqa: E402

SHAPES = ((576, 4096), (1296, 3584))
SCALES = (3.0, 1.0, 0.3, 0.1, 0.03, 0.01)  # of the variation against the shared direction: spread ~0.9 .. ~1e-4


def reference(x) -> float:
    """The normalized spectral entropy of one image's tokens ``[N, d]`` in float64 numpy (the independent value)."""
    import numpy as np

    t = x.double().numpy()
    t = t / np.linalg.norm(t, axis=1, keepdims=True)
    t = t - t.mean(0)
    lam = np.clip(np.linalg.eigvalsh(t @ t.T), 1e-12, None)
    p = lam / lam.sum()
    return float(-(p * np.log(p)).sum() / math.log(len(p)))


def rows(shapes, ranks, seed: int):
    import torch

    from promprune.selection import entropy
    from promprune.selection.kernels import unit_tokens
    from promprune.selection.registry import TokenSet

    g = torch.Generator().manual_seed(seed)
    for n, d in shapes:
        for r in ranks:
            for scale in SCALES:
                x = torch.randn(1, 1, d, generator=g) + scale * (
                    torch.randn(1, n, r, generator=g) @ torch.randn(1, r, d, generator=g) / math.sqrt(r))
                unit = unit_tokens(x, entropy.ENTROPY_EPS)
                spread = 1.0 - float((unit.mean(1) ** 2).sum())
                want = reference(x[0])
                gram = entropy.entropy_of_matrix(entropy.centered_gram(unit @ unit.transpose(1, 2)))
                tokens = entropy.entropy_of_matrix(entropy.centered_unit_gram(x))
                shipped = TokenSet(x, None).spectral_entropy
                yield (n, d, r, spread, *(abs(float(h[0]) - want) for h in (gram, tokens, shipped)),
                       "tokens" if bool(entropy.cancels(x)[0]) else "gram")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[20, 200], help="ranks of the variation (default 20 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a quick check of this script: 144 x 256 tokens, rank 8")
    args = ap.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--ranks", args.ranks, 1, "dimensions of the tokens' variation", 20)
    flags.refuse()
    import torch

    from promprune.selection import entropy

    torch.set_num_threads(min(2, torch.get_num_threads()))
    shapes, ranks = (((144, 256),), [8]) if args.smoke else (SHAPES, args.ranks)
    print(f"|H float32 - H float64| of the normalized spectral entropy (SPREAD_FLOOR {entropy.SPREAD_FLOOR})")
    print("| N | d | rank | spread | gram | tokens | library | library's route |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, d, r, spread, gram, tokens, shipped, route in rows(shapes, ranks, args.seed):
        print(f"| {n} | {d} | {r} | {spread:.2e} | {gram:.2e} | {tokens:.2e} | {shipped:.2e} | {route} |", flush=True)


if __name__ == "__main__":
    main()
