"""Median selection time of every registered method at the paper's shapes, and its ratio to DivPrune.

    python benchmarks/selection.py [--repeats 7] [--device cpu|cuda] [--threads N] [--dtype float16] [--batch 8]

Shapes: LLaVA-1.5 (B=1, N=576, d=4096, T=64), LLaVA-NeXT (B=5 crops x 576, d=4096, T=64 per crop = 320),
Qwen2.5-VL (B=1, N=1296, d=3584, T=128), each times ``--batch`` images. Inputs are random features with a smooth
low-rank structure plus noise (so spectral entropy lands in the paper's range) and random saliency, in ``--dtype``
(selection itself computes in float32, as the adapters feed it the model's dtype). Target (issue 16): promprune
< 1.5x divprune at every shape. A second table splits PromPrune's extra time into the eigensolve and the rest.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import promprune

SHAPES = {  # name: (B, N, d, T)
    "llava-1.5": (1, 576, 4096, 64),
    "llava-next": (5, 576, 4096, 64),
    "qwen2.5-vl": (1, 1296, 3584, 128),
}


def make_inputs(B: int, N: int, d: int, device: str, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(B, 32, d, generator=g)
    mix = torch.randn(B, N, 32, generator=g)
    x = mix @ basis + 0.5 * torch.randn(B, N, d, generator=g)
    return x.to(device, dtype), torch.rand(B, N, generator=g).softmax(dim=1).to(device)


def median_ms(fn, arg, repeats: int) -> float:
    """Median wall ms of ``fn(arg)`` over ``repeats`` calls after one warm-up (CUDA synchronized around each)."""
    sync = torch.cuda.synchronize if getattr(arg, "is_cuda", False) else (lambda: None)
    fn(arg)
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn(arg)
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_method(method: str, x: torch.Tensor, s: torch.Tensor, budget: int, repeats: int) -> float:
    return median_ms(lambda features: promprune.select(features, s, budget=budget, method=method), x, repeats)


def centered_gram(x: torch.Tensor) -> torch.Tensor:
    """The N x N Gram of the L2-normalized, centered tokens: the matrix whose spectrum the entropy reads."""
    xn = torch.nn.functional.normalize(x.float(), dim=-1)
    xc = xn - xn.mean(dim=1, keepdim=True)
    return xc @ xc.transpose(1, 2)


def time_eigensolve(x: torch.Tensor, repeats: int) -> float:
    """Median ms of the spectral entropy's eigensolve alone on these inputs' centered Gram."""
    return median_ms(torch.linalg.eigvalsh, centered_gram(x), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="dtype of the features handed to select (the model's dtype)")
    ap.add_argument("--batch", type=int, default=1, help="images per call (NeXT: 5 crops each)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = promprune.methods()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device={args.device} ({device_name}) dtype={args.dtype} batch={args.batch} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} torch={torch.__version__}")
    header = f"{'method':<16}" + "".join(f"{shape:>26}" for shape in SHAPES)
    print(header)
    print(f"{'':<16}" + "".join(f"{'median ms (x divprune)':>26}" for _ in SHAPES))
    results: dict[str, dict[str, float]] = {m: {} for m in names}
    eig_ms: dict[str, float] = {}
    for shape, (B, N, d, T) in SHAPES.items():
        x, s = make_inputs(B * args.batch, N, d, args.device, dtype=getattr(torch, args.dtype))
        for m in names:
            results[m][shape] = time_method(m, x, s, T, args.repeats)
        eig_ms[shape] = time_eigensolve(x, args.repeats)
    for m in names:
        cells = "".join(f"{results[m][sh]:>16.1f} ({results[m][sh] / results['divprune'][sh]:4.2f}x)   "
                        for sh in SHAPES)
        print(f"{m:<16}{cells}")
    print("\nAround the eigensolve (the one step DivPrune lacks; exact entropy needs it): median ms")
    print(f"{'':<16}" + "".join(f"{shape:>26}" for shape in SHAPES))
    rows = {"divprune": lambda sh: results["divprune"][sh], "promprune": lambda sh: results["promprune"][sh],
            "eigensolve": lambda sh: eig_ms[sh],
            "remainder": lambda sh: results["promprune"][sh] - results["divprune"][sh] - eig_ms[sh]}
    for name, cell in rows.items():
        print(f"{name:<16}" + "".join(f"{cell(sh):>26.1f}" for sh in SHAPES))
    floor = {sh: (results["divprune"][sh] + eig_ms[sh]) / results["divprune"][sh] for sh in SHAPES}
    print(f"{'floor (x div)':<16}" + "".join(f"{floor[sh]:>25.2f}x" for sh in SHAPES))
    print("(remainder: PromPrune's time beyond DivPrune's and the eigensolve: centering, saliency order, the DPP "
          "loop vs DivPrune's; floor: DivPrune + the eigensolve alone, the best an exact PromPrune can do)")
    worst = max(results["promprune"][sh] / results["divprune"][sh] for sh in SHAPES)
    print(f"\npromprune / divprune, worst shape: {worst:.2f}x (target < 1.5x)")


if __name__ == "__main__":
    main()
