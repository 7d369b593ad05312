"""What TF32 would change in the selection, emulated on the CPU: tokens kept differently per method and shape.

    python benchmarks/tf32_picks.py [--seeds 3]
    python benchmarks/tf32_picks.py --smoke      # a check of the script (seconds): small shapes, one seed

A process may turn TF32 on for its float32 matrix products (``torch.backends.cuda.matmul.allow_tf32 = True``,
``torch.set_float32_matmul_precision("high")``: common in training scripts). cuBLAS then reads each float32 input of a
product with 10 of its 23 mantissa bits. ``EmulatedTF32`` does that to CPU tensors (each float32 input of a matrix
product rounded to 10 mantissa bits, where the process's CUDA setting says TF32), so the effect shows without a GPU.
Every registered pre-LLM method selects the same stand-in features (``benchmarks/inputs.py``) three ways: TF32 off
(the reference), TF32 on as it would run without ``accel.full_float32`` (the guard replaced by a no-op), and TF32 on
as it runs (the guard keeps the products at full precision). The table prints the kept tokens that differ from the
reference (summed over views and seeds) and how far TF32 moves the unit Gram's cosines. An emulation of TF32's
input rounding, not a GPU measurement: cuBLAS' own accumulation order is not modeled.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
import promprune  # noqa: E402
from benchmarks import Flags  # noqa: E402
from benchmarks.inputs import instruction_for, make_inputs  # noqa: E402
from promprune.selection import accel  # noqa: E402

SHAPES = {"llava-1.5": (1, 576, 4096, 64), "llava-next": (5, 576, 4096, 64), "qwen2.5-vl": (1, 1296, 3584, 128)}
SMOKE_SHAPES = {"small": (1, 64, 128, 8), "small views": (5, 64, 128, 8)}
PRODUCTS = {torch.bmm, torch.mm, torch.matmul, torch.baddbmm, torch.addmm, torch.Tensor.__matmul__,
            torch.Tensor.matmul, torch.Tensor.bmm, torch.Tensor.mm}


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's values with 10 mantissa bits (round to nearest), as TF32 tensor cores read them."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def tf32_on() -> bool:
    """Whether this process asked for TF32 products on CUDA (its effective setting, whichever API set it)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


class EmulatedTF32(TorchFunctionMode):
    """Matrix products of CPU float32 tensors read their inputs as TF32 where the process's CUDA setting says TF32
    (read at each product, as cuBLAS reads it at each call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS and tf32_on():
            args = tuple(tf32_round(a) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                         for a in args)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def tf32(on: bool):
    """The process's CUDA float32 products set to TF32 (``on``) or IEEE inside the block, then back."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if on else "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def picks(method: str, x: torch.Tensor, s: torch.Tensor, budget: int) -> torch.Tensor:
    text = instruction_for(x) if promprune.method_spec(method).needs_instruction else None
    with EmulatedTF32():
        return promprune.select(x, s, budget=budget, method=method, instruction=text).indices


def changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Kept tokens of ``b`` not kept in ``a``, summed over the views."""
    return sum(len(set(r.tolist()) - set(q.tolist())) for r, q in zip(b, a))


def cosine_shift(x: torch.Tensor) -> tuple[float, float]:
    """(max, median) of |cos - cos under TF32| over the unit Gram of ``x``."""
    unit = torch.nn.functional.normalize(x.float(), dim=-1)
    exact = unit @ unit.transpose(1, 2)
    rounded = tf32_round(unit) @ tf32_round(unit).transpose(1, 2)
    shift = (exact - rounded).abs()
    return float(shift.max()), float(shift.median())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="stand-in inputs per shape")
    ap.add_argument("--smoke", action="store_true", help="small shapes, one seed")
    args = ap.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--seeds", args.seeds, 1, "stand-in inputs per shape", 3)
    flags.refuse()
    shapes, seeds = (SMOKE_SHAPES, 1) if args.smoke else (SHAPES, args.seeds)
    methods = promprune.methods(stage="pre_llm")
    counts = {m: {name: [0, 0, 0] for name in shapes} for m in methods}  # [without guard, with guard, kept]
    shifts = {}
    for name, (B, N, d, T) in shapes.items():
        for seed in range(seeds):
            x, s = make_inputs(B, N, d, "cpu", seed=seed)
            shifts.setdefault(name, []).append(cosine_shift(x))
            for m in methods:
                with tf32(False):
                    reference = picks(m, x, s, T)
                with tf32(True), mock.patch.object(accel, "full_float32", contextlib.nullcontext):
                    unguarded = picks(m, x, s, T)
                with tf32(True):
                    guarded = picks(m, x, s, T)
                counts[m][name][0] += changed(reference, unguarded)
                counts[m][name][1] += changed(reference, guarded)
                counts[m][name][2] += reference.numel()
    print(f"Kept tokens that differ from TF32 off, TF32 emulated on the CPU ({seeds} seed(s) per shape; "
          "without the guard / with accel.full_float32 / tokens kept)")
    print("| method | " + " | ".join(shapes) + " |\n|---|" + "---:|" * len(shapes))
    for m in methods:
        cells = [f"{a} / {b} / {n}" for a, b, n in counts[m].values()]
        print(f"| {m} | " + " | ".join(cells) + " |")
    for name, values in shifts.items():
        print(f"{name}: TF32 moves the unit Gram's cosines by up to {max(v[0] for v in values):.2e} "
              f"(median {sorted(v[1] for v in values)[len(values) // 2]:.2e})")
    worst = max(row[1] for m in methods for row in counts[m].values())
    print(f"with the guard, most tokens changed in one cell: {worst}")


if __name__ == "__main__":
    main()
