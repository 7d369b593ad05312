"""VisPruner's Triton kernel at other block sizes: which part of a round its time follows, on a GPU.

The kernel runs every round of a view in one program (one SM), so its time is a chain of loop iterations, each a few
dependent loads and a block-wide reduction: the ranking's ``[BLOCK_E, BLOCK_P]`` tiles (``tile`` elements) and the scan
down the sorted rows (``evens`` x ``chunk``). This script times ``greedy_triton.vispruner_rounds`` at the default
``VisTiles`` and at each block size changed alone, on the candidates of the paper's shapes (important_ratio 0.5:
LLaVA-1.5 544 -> 32, Qwen2.5-VL 1232 -> 64, LLaVA-NeXT's one 2880-token image 2720 -> 160), batch 1 and 8, and checks
that every configuration keeps exactly the picks of the torch loop (``baselines.vispruner_diverse`` on the CPU). A row
whose time moves with ``tile`` says the ranking is the chain; with ``evens`` or ``chunk``, the scan; ``rank=sort``
ranks by one sort a round instead of tiles; ``rank=wide`` is the other kernel (a round's evens at once, one sort sized
to the round), at its default and with its ``scan`` tile and warps changed alone.

``--chain`` prints instead, for the same configurations and inputs, the steps one program runs in sequence and the keys
it sorts, counted exactly by replaying the rounds on the CPU (``chain``): the same on every machine, so a GPU's times
beside them say what a step and a sorted key cost there::

    python benchmarks/vispruner_tiles.py                       # on a GPU: ~2 min expected, most of it compiling
    python benchmarks/vispruner_tiles.py --device cpu --sizes 40:8 --batch 1 --repeats 1   # under TRITON_INTERPRET=1
    python benchmarks/vispruner_tiles.py --chain               # anywhere: ~80 s on 2 cores

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
from benchmarks import Flags  # noqa: E402

# Each block size changed alone from the default (``greedy_triton.VIS_TILES``).
VARIANTS = {"tile": (4096, 16384), "evens": (32, 128, 256), "chunk": (16, 64), "warps": (4, 16), "rank": ("sort",)}
# The wide kernel (``rank="wide"``: a round's evens at once) at its default and with its own sizes changed.
WIDE = {"scan": (2048, 8192), "warps": (4, 8)}  # 32 warps spill (ptxas, sm_90)


def configs() -> list[tuple[str, object]]:
    """``(label, VisTiles)``: the default first, then each field changed alone, then the wide kernel and each of its
    sizes changed alone."""
    from promprune.selection.greedy_triton import VIS_TILES

    out = [("default " + _describe(VIS_TILES), VIS_TILES)]
    for field, values in VARIANTS.items():
        for value in values:
            if getattr(VIS_TILES, field) != value:
                out.append((f"{field}={value}", dataclasses.replace(VIS_TILES, **{field: value})))
    wide = dataclasses.replace(VIS_TILES, rank="wide")
    out.append((f"rank=wide (scan {wide.scan}, warps {wide.warps or 'auto'})", wide))
    for field, values in WIDE.items():
        for value in values:
            if getattr(wide, field) != value:
                out.append((f"rank=wide, {field}={value}", dataclasses.replace(wide, **{field: value})))
    return out


def replay(C: torch.Tensor, keep: int) -> list[tuple[int, torch.Tensor]]:
    """The rounds of one view's duplicate removal on its similarity ``C [R0, R0]`` (CPU), replayed as the kernels run
    them: per round the length of the list and how deep each even looks down its sorted row (the place of its first
    odd candidate). Its picks are checked against the loop's (``baselines.vispruner_diverse``)."""
    from promprune.selection.baselines import VISPRUNER_ROUND, vispruner_diverse
    from promprune.selection.kernels import stable_descending_order

    R0 = C.shape[0]
    values, columns = torch.sort(C, dim=1, descending=True)
    order, rounds = torch.arange(R0), []
    while order.numel() > keep:
        R = order.numel()
        even, odd = order[0::2], order[1::2]
        is_odd = torch.zeros(R0, dtype=torch.bool)
        is_odd[odd] = True
        depth = is_odd[columns[even]].to(torch.uint8).argmax(dim=1)  # each even's first odd entry down its row
        rounds.append((R, depth))
        drop = min(VISPRUNER_ROUND, R - keep, even.numel())
        order = torch.cat([even[stable_descending_order(values[even, depth][None])[0, drop:]], odd])
    if not torch.equal(order, vispruner_diverse(C[None], torch.arange(R0)[None], keep)[0]):
        raise AssertionError("the replay's picks differ from the loop's")
    return rounds


def chain(rounds: list[tuple[int, torch.Tensor]], R0: int, tiles) -> dict[str, int]:
    """The steps one program runs in sequence over ``rounds`` (``replay``) with ``tiles``, counted exactly: "scan"
    (chunks down the sorted rows until every even of a block has met an odd candidate), "rank" (the ranking's tiles),
    "flag" (marking a round's odd candidates and copying them after the evens, ``BLOCK_P`` at a time), "sorts" and
    "keys" (one sort a round and the keys it sorts: ``rank="sort"``, ``"wide"``). Each step is a few dependent loads
    and a block-wide reduction: with a GPU's times beside them, these say what a step and a sorted key cost there."""
    from promprune.selection import greedy_triton

    wide = greedy_triton.vispruner_wide_blocks(R0, tiles) if tiles.rank == "wide" else None
    block_e, block_p, _ = greedy_triton.vispruner_blocks(R0, tiles)
    sort_n = greedy_triton.vispruner_sort_keys(R0, tiles)
    out = dict.fromkeys(("scan", "rank", "flag", "sorts", "keys"), 0)
    for R, depth in rounds:
        E, n_odd = (R + 1) // 2, R // 2
        if wide is not None:
            width = max(greedy_triton.triton.next_power_of_2(E), greedy_triton.VIS_WIDE_MIN)
            out["scan"] += -(-(int(depth.max()) + 1) // (wide[1] // width))
            out["sorts"] += 1
            out["keys"] += width
            continue
        for e0 in range(0, E, tiles.evens):
            out["scan"] += -(-(int(depth[e0:e0 + tiles.evens].max()) + 1) // tiles.chunk)
        out["flag"] += 2 * -(-n_odd // block_p)
        if sort_n:
            out["sorts"] += 1
            out["keys"] += sort_n
        else:
            out["rank"] += -(-E // block_e) * -(-E // block_p)
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


def check_flags(args) -> tuple[list[tuple[int, int]], list[int]]:
    """Refuse the command line's mistakes (exit 2, `benchmarks.Flags`) before a kernel compiles; the sizes as
    (candidates, kept) and the batches."""
    flags = Flags(__file__)
    sizes, batches = [], []
    for pair in args.sizes.split(","):
        parts = pair.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not 0 < int(parts[1]) < int(parts[0]):
            flags.add(f"--sizes {pair}", "expected CANDIDATES:KEPT, ints with 0 < KEPT < CANDIDATES, "
                      "comma-separated, e.g. --sizes 544:32,1232:64")
        else:
            sizes.append((int(parts[0]), int(parts[1])))
    for batch in args.batch.split(","):
        if not batch.strip().isdigit() or int(batch) < 1:
            flags.add(f"--batch {batch}", "expected views per call, positive ints, comma-separated, e.g. --batch 1,8")
        else:
            batches.append(int(batch))
    if not args.chain:
        flags.device("--device", args.device, indexed=False)
        if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            flags.add("--device cpu", "on the CPU the kernel runs only under Triton's interpreter: set "
                      "TRITON_INTERPRET=1 (or --chain: the counts, no kernel)")
        flags.at_least("--repeats", args.repeats, 1, "timed calls", 9)
    flags.refuse()
    return sizes, batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="544:32,1232:64,2720:160", help="candidates:kept pairs, comma-separated")
    ap.add_argument("--batch", default="1,8", help="views per call, comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--chain", action="store_true",
                    help="print each configuration's steps in sequence instead of its time (counted on the CPU: no "
                         "kernel runs, no GPU needed; the same on every machine)")
    args = ap.parse_args(argv)
    sizes, batches = check_flags(args)
    if args.chain:
        return print_chain(sizes, batches)
    from promprune.selection import greedy_triton
    from promprune.selection.baselines import VISPRUNER_ROUND, vispruner_diverse, vispruner_round_count

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
    times: dict[tuple[int, int, int], dict[str, float]] = {column: {} for column in columns}
    for label, tiles in configs():
        cells = []
        for R0, keep, B in columns:
            C = inputs[(R0, B)]
            rounds = vispruner_round_count(R0, keep)
            call = functools.partial(greedy_triton.vispruner_rounds, C, keep, rounds, VISPRUNER_ROUND, tiles)
            try:
                if not torch.equal(call().cpu(), reference[(R0, B)]):
                    differ.append(f"{label} at {R0}->{keep} x{B}")
                times[(R0, keep, B)][label] = time_call(call, args.device, args.repeats)
                cells.append(f"{times[(R0, keep, B)][label]:>16.2f}")
            except Exception as e:  # a block size the compiler refuses (registers, shared memory): the rest go on
                failed.append(f"{label} at {R0}->{keep} x{B}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                cells.append(f"{'failed':>16}")
        print(f"{label:<66}" + "".join(cells), flush=True)
    default = configs()[0][0]
    for (R0, keep, B), row in times.items():  # what to make the default, per column (a wrong pick is listed below)
        if row:
            best = min(row, key=row.get)
            versus = ", the default" if best == default else \
                f", {row[default] / row[best]:.2f}x faster than the default" if default in row else ""
            print(f"fastest at {R0}->{keep} x{B}: {best} ({row[best]:.2f} ms{versus})")
    for line in failed:
        print("failed: " + line)
    if differ:
        print("picks differ from the torch loop's: " + "; ".join(differ))
    if differ or failed:
        return 1
    print("every configuration kept the torch loop's picks")
    return 0


def print_chain(sizes: list[tuple[int, int]], batches: list[int]) -> int:
    """``--chain``: every configuration's steps in sequence on this script's inputs (the worst view of a call)."""
    columns = [(R0, keep, B) for B in batches for R0, keep in sizes]
    print("VisPruner's kernel: steps one program runs in sequence (scan + rank + flag; the worst view of the call) and "
          "its sorts x thousands of keys, counted by replaying the rounds on the CPU; columns: candidates -> kept x "
          "views")
    print(f"{'':<66}" + "".join(f"{f'{R0}->{keep} x{B}':>18}" for R0, keep, B in columns))
    rounds = {(R0, B): [replay(C, keep) for C in similarity(B, R0, 64, "cpu", seed=R0)] for R0, keep, B in columns}
    for label, tiles in configs():
        cells = []
        for R0, _, B in columns:
            counts = [chain(r, R0, tiles) for r in rounds[(R0, B)]]
            worst = max(counts, key=lambda c: c["scan"] + c["rank"] + c["flag"])
            steps = worst["scan"] + worst["rank"] + worst["flag"]
            cells.append(f"{steps:>9} {worst['sorts']:>3}x{worst['keys'] / 1e3:<4.0f}")
        print(f"{label:<66}" + "".join(f"{c:>18}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
