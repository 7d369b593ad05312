"""VisPruner's Triton kernel at other block sizes: which part of a round its time follows, on a GPU.

The kernel runs every round of a view in one program (one SM), so its time is a chain of loop iterations, each a few
dependent loads and a block-wide reduction: the ranking's ``[BLOCK_E, BLOCK_P]`` tiles (``tile`` elements) and the scan
down the sorted rows (``evens`` x ``chunk``). This script times ``greedy_triton.vispruner_rounds`` at the default
``VisTiles`` and at each block size changed alone, on the candidates of the paper's shapes (important_ratio 0.5:
LLaVA-1.5 544 -> 32, Qwen2.5-VL 1232 -> 64, LLaVA-NeXT's one 2880-token image 2720 -> 160), batch 1 and 8, and checks
that every configuration keeps exactly the picks of the torch loop (``baselines.vispruner_diverse`` on the CPU). A row
whose time moves with ``tile`` says the ranking is the chain; with ``evens`` or ``chunk``, the scan; ``rank=sort``
ranks by one sort a round instead of tiles::

    python benchmarks/vispruner_tiles.py                       # on a GPU: ~1 min, most of it compiling
    python benchmarks/vispruner_tiles.py --device cpu --sizes 40:8 --batch 1 --repeats 1   # under TRITON_INTERPRET=1

On the CPU it needs ``TRITON_INTERPRET=1`` (the kernels then run in Triton's interpreter: a check of the picks, its
times mean nothing).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Each block size changed alone from the default (``greedy_triton.VIS_TILES``).
VARIANTS = {"tile": (4096, 16384), "evens": (32, 128, 256), "chunk": (16, 64), "warps": (4, 16), "rank": ("sort",)}


def configs() -> list[tuple[str, object]]:
    """``(label, VisTiles)``: the default first, then each field changed alone."""
    from promprune.selection.greedy_triton import VIS_TILES

    out = [("default " + _describe(VIS_TILES), VIS_TILES)]
    for field, values in VARIANTS.items():
        for value in values:
            if getattr(VIS_TILES, field) != value:
                out.append((f"{field}={value}", dataclasses.replace(VIS_TILES, **{field: value})))
    return out


def _describe(tiles) -> str:
    return (f"(tile {tiles.tile}, evens {tiles.evens}, chunk {tiles.chunk}, warps {tiles.warps or 'auto'}, "
            f"rank {tiles.rank})")


def similarity(batch: int, R0: int, d: int, device: str, seed: int = 0) -> torch.Tensor:
    """Cosine similarities ``[batch, R0, R0]`` (float32) of random unit features with a few near-duplicates."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, R0, d, generator=g)
    x[:, 1::7] = x[:, 0::7][:, :x[:, 1::7].shape[1]] + 0.05 * torch.randn(x[:, 1::7].shape, generator=g)
    x = torch.nn.functional.normalize(x, dim=-1)
    return (x @ x.transpose(1, 2)).to(device)


def time_call(fn, device: str, repeats: int) -> float:
    """Median ms of ``fn()`` over ``repeats`` calls, after one untimed call (compiles, caches)."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="544:32,1232:64,2720:160", help="candidates:kept pairs, comma-separated")
    ap.add_argument("--batch", default="1,8", help="views per call, comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("on the CPU the kernel runs only under Triton's interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from promprune.selection import greedy_triton
    from promprune.selection.baselines import VISPRUNER_ROUND, vispruner_diverse, vispruner_round_count

    sizes = [tuple(int(v) for v in pair.split(":")) for pair in args.sizes.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    columns = [(R0, keep, B) for B in batches for R0, keep in sizes]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter: times mean nothing)"
    print(f"VisPruner's kernel, median ms of {args.repeats} on {name}, torch {torch.__version__}; "
          f"columns: candidates -> kept x views")
    header = "".join(f"{f'{R0}->{keep} x{B}':>16}" for R0, keep, B in columns)
    print(f"{'':<66}{header}")
    inputs = {(R0, B): similarity(B, R0, 64, args.device, seed=R0) for R0, _, B in columns}
    reference = {(R0, B): vispruner_diverse(inputs[(R0, B)].cpu(), torch.arange(R0).expand(B, R0), keep)
                 for R0, keep, B in columns}  # the loop (CPU tensors never take the kernel): positions kept
    differ, failed = [], []
    for label, tiles in configs():
        cells = []
        for R0, keep, B in columns:
            C = inputs[(R0, B)]
            rounds = vispruner_round_count(R0, keep)
            call = functools.partial(greedy_triton.vispruner_rounds, C, keep, rounds, VISPRUNER_ROUND, tiles)
            try:
                if not torch.equal(call().cpu(), reference[(R0, B)]):
                    differ.append(f"{label} at {R0}->{keep} x{B}")
                cells.append(f"{time_call(call, args.device, args.repeats):>16.2f}")
            except Exception as e:  # a block size the compiler refuses (registers, shared memory): the rest go on
                failed.append(f"{label} at {R0}->{keep} x{B}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                cells.append(f"{'failed':>16}")
        print(f"{label:<66}" + "".join(cells), flush=True)
    for line in failed:
        print("failed: " + line)
    if differ:
        print("picks differ from the torch loop's: " + "; ".join(differ))
    if differ or failed:
        return 1
    print("every configuration kept the torch loop's picks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
