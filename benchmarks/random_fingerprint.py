"""How often Random's fallback key (``select`` without ``keys``: a fingerprint of the features) changes when the
features change in their last bits, and how often two different feature sets share one.

    python benchmarks/random_fingerprint.py [--sets 300] [--tokens 576] [--dim 64]

Seeded feature sets ``x [N, d]`` (per-channel offsets plus noise, as projected visual tokens have), each perturbed as
another machine or dtype would compute it: a few ulps per value (another CPU type, the GPU at float32), a float16 and a
bfloat16 round trip. The table prints the share of sets whose key changed (and with it the whole draw); the last line
counts distinct keys. PrunedVLM passes exact keys (a hash of the image's pixels) and never meets these rates.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import Flags  # noqa: E402
from promprune.selection.baselines import feature_key  # noqa: E402

ULPS = 4  # a drift of up to 4 ulps per value: more than CPU types / devices differ at the end of a vision tower


def perturbations(x: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``x`` as another machine or dtype computes it."""
    steps = torch.randint(-ULPS, ULPS + 1, x.shape, generator=gen).float()
    return {f"+-{ULPS} ulps": x + steps * torch.finfo(torch.float32).eps * x.abs(),
            "float16 round trip": x.half().float(), "bfloat16 round trip": x.bfloat16().float()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", type=int, default=300)
    p.add_argument("--tokens", type=int, default=576)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--sets", args.sets, 1, "feature sets", 300)
    flags.at_least("--tokens", args.tokens, 1, "tokens a set", 576)
    flags.at_least("--dim", args.dim, 1, "feature width", 64)
    flags.refuse()
    gen = torch.Generator().manual_seed(0)
    changed: dict[str, int] = {}
    keys = set()
    for _ in range(args.sets):
        x = torch.randn(args.tokens, args.dim, generator=gen) * 0.5 + torch.randn(args.dim, generator=gen) * 0.3
        key = feature_key(x)
        keys.add(key)
        for name, y in perturbations(x, gen).items():
            changed[name] = changed.get(name, 0) + int(feature_key(y) != key)
    print(f"| perturbation | keys changed, of {args.sets} [{args.tokens}, {args.dim}] feature sets |")
    print("|---|---:|")
    for name, n in changed.items():
        print(f"| {name} | {n} ({100 * n / args.sets:.1f}%) |")
    print(f"distinct keys: {len(keys)} of {args.sets}")


if __name__ == "__main__":
    main()
