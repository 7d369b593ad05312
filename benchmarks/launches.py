"""A GPU cost model counted on the CPU: the kernel launches, host syncs and matmul FLOPs of one call on the fast path.

``with fast_path_on_cpu(): counts = count(fn, *args)`` runs ``fn`` with the selection's CUDA fast path switched on
for CPU tensors (``accel.active`` true, the Triton greedy kernels replaced by stubs that count one launch each and
fill their output with valid picks) under a dispatch mode that counts every ATen op that would launch a kernel (view
and metadata ops excluded), the ops that make the host wait on the device (``item``/``int``/``bool`` of a tensor,
``nonzero``, boolean indexing, ``tolist``, ``equal``) and the selection's own deliberate reads (``accel.syncs``).
Only ops on the device's tensors count (the call's tensor arguments and what device ops made from them, plus
factories): the host's arithmetic on values it has read does not.
What the counts are for: a change that adds launches or syncs shows here without a GPU; a GPU time can be projected
from them (``project_ms``), and the GPU run says how good the projection was.
"""
from __future__ import annotations

import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from promprune.selection import accel, greedy_triton

# ops that launch nothing: views, metadata, allocation without a fill
NO_LAUNCH = {"view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select",
             "as_strided", "detach", "alias", "permute", "diagonal", "unbind", "split", "split_with_sizes", "chunk",
             "lift_fresh", "_reshape_alias", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "resolve_conj", "resolve_neg", "unfold", "narrow", "expand_as", "view_as",
             "_local_scalar_dense"}  # the last: a device-to-host copy, counted as a sync
# ops whose result the host needs before it can go on (a device-to-host wait on CUDA)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "_unique2", "unique_dim", "unique_consecutive",
            "nonzero_static"}
MATMUL = {"bmm", "mm", "matmul", "baddbmm", "addmm", "addbmm"}


@dataclass
class Costs:
    """What one call costs: ``launches`` (kernels), ``syncs`` (host waits), ``flops`` (matmul), per-op counts."""

    launches: int = 0
    syncs: int = 0
    flops: float = 0.0
    ops: Counter = field(default_factory=Counter)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


class _Counter(TorchDispatchMode):
    """Counts the ops of the device: those with a device tensor among their inputs (the call's arguments and what
    device ops made from them) or with no tensor input (factories); an op on host tensors only (the host's own
    arithmetic on values it read, e.g. ``torch.from_numpy`` results) launches nothing and waits for nothing."""

    def __init__(self, costs: Costs, inputs):
        super().__init__()
        self.costs = costs
        self.paused = False
        self.device: dict[int, weakref.ref] = {}  # id -> weak reference (tensors compare by value, not identity)
        self.mark(_tensors(inputs))

    def mark(self, tensors) -> None:
        for t in tensors:
            self.device[id(t)] = weakref.ref(t)

    def on_device(self, t: torch.Tensor) -> bool:
        ref = self.device.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = _tensors(args) + _tensors(kwargs or {})
        if self.paused or (ins and not any(self.on_device(t) for t in ins)):
            return out
        self.mark(_tensors(out))
        name = func.overloadpacket.__name__.rstrip("_")
        if name in SYNC_OPS:
            self.costs.syncs += 1
        if name not in NO_LAUNCH:
            self.costs.launches += 1
            self.costs.ops[name] += 1
        if name in MATMUL and isinstance(out, torch.Tensor):
            inner = args[0].shape[-1] if name in ("bmm", "mm", "matmul") else args[1].shape[-1]  # the summed dim
            self.costs.flops += 2.0 * out.numel() * inner
        return out


_ACTIVE: list[_Counter] = []


class _KernelStub:
    """Stands for a Triton kernel: ``stub[grid](*args, **meta)`` counts one launch and fills the picks it would write
    (``args[out_arg]``, ``[B, width]``) with distinct in-range indices."""

    def __init__(self, out_arg: int):
        self.out_arg = out_arg

    def __getitem__(self, grid):
        def launch(*args, **meta):
            out, n = args[self.out_arg], args[self.out_arg + 1]
            if _ACTIVE:
                _ACTIVE[-1].costs.launches += 1
                _ACTIVE[-1].costs.ops["triton:" + type(self).__name__] += 1
                _ACTIVE[-1].paused = True
            try:
                out.copy_(torch.arange(out.shape[1]).remainder(n).expand_as(out))
            finally:
                if _ACTIVE:
                    _ACTIVE[-1].paused = False
        return launch


@contextmanager
def fast_path_on_cpu():
    """The selection's CUDA fast path taken by CPU tensors, its Triton kernels stubbed (launch counted, picks
    filled)."""
    saved = (accel.active, accel.has_triton, greedy_triton._dpp_kernel, greedy_triton._fps_kernel,
             greedy_triton._fl_kernel)
    accel.active = lambda t: True
    accel.has_triton = lambda: True
    greedy_triton._dpp_kernel, greedy_triton._fps_kernel, greedy_triton._fl_kernel = (
        _KernelStub(7), _KernelStub(5), _KernelStub(5))
    try:
        yield
    finally:
        (accel.active, accel.has_triton, greedy_triton._dpp_kernel, greedy_triton._fps_kernel,
         greedy_triton._fl_kernel) = saved


def count(fn, *args, warmup: bool = True, **kwargs) -> Costs:
    """The launches, syncs and matmul FLOPs of ``fn(*args, **kwargs)`` (``Tensor.tolist`` counts as a sync), after one
    uncounted call (``warmup``) that fills what a process builds once (cached pooling matrices, compiled kernels)."""
    if warmup:
        fn(*args, **kwargs)
    costs = Costs()
    real_tolist = torch.Tensor.tolist
    syncs_before = accel.syncs()

    def tolist(t):
        if _ACTIVE and not _ACTIVE[-1].paused and _ACTIVE[-1].on_device(t):
            costs.syncs += 1
        return real_tolist(t)

    torch.Tensor.tolist = tolist
    counter = _Counter(costs, (args, kwargs))
    _ACTIVE.append(counter)
    try:
        with counter:
            fn(*args, **kwargs)
    finally:
        _ACTIVE.pop()
        torch.Tensor.tolist = real_tolist
    costs.syncs += accel.syncs() - syncs_before
    return costs


# A projection's constants (assumptions, not measurements): what one eager launch costs the host on an H100-class
# machine, what one host wait costs, and the float64 / float32 matmul rate.
LAUNCH_US = 6.0
SYNC_US = 20.0
MATMUL_TFLOPS = 40.0


def project_ms(c: Costs) -> float:
    """A GPU time projected from the counts: launches and waits at their cost, matmuls at ``MATMUL_TFLOPS``."""
    return (c.launches * LAUNCH_US + c.syncs * SYNC_US) / 1e3 + c.flops / (MATMUL_TFLOPS * 1e12) * 1e3


def main(argv: list[str] | None = None) -> None:
    """``python benchmarks/launches.py [--method M ...] [--shape BxNxd] [--budget T]``: the cost table of methods."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
    import promprune
    from benchmarks.selection import instruction_for, make_inputs

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("--method", nargs="+", default=None, help="registered methods (default: all pre-LLM ones)")
    ap.add_argument("--shape", default="1x576x4096", help="B x N x d of the features (default: LLaVA-1.5's)")
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args(argv)
    B, N, d = (int(v) for v in args.shape.split("x"))
    x, s = make_inputs(B, N, d, "cpu")
    print(f"one call at {args.shape}, T={args.budget}, on the GPU fast path counted on the CPU")
    print("| method | launches | syncs | matmul GFLOP | projected ms |\n|---|---:|---:|---:|---:|")
    for m in args.method or promprune.methods():
        text = instruction_for(x) if promprune.method_spec(m).needs_instruction else None
        with fast_path_on_cpu():
            c = count(promprune.select, x, s, budget=args.budget, method=m, instruction=text)
        print(f"| {m} | {c.launches} | {c.syncs} | {c.flops / 1e9:.2f} | {project_ms(c):.2f} |")


if __name__ == "__main__":
    main()
