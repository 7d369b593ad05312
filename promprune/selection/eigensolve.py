"""Eigenvalues of a batch of symmetric matrices ``[B, n, n] -> [B, n]`` (ascending): one cuSOLVER call on CUDA.

On CUDA, torch's ``eigvalsh`` solves a batch one matrix at a time for n > 32 (about 6 ms per 576 x 576 on an H100)
and waits on the device. cuSOLVER's ``cusolverDnXsyevBatched`` (CUDA >= 12.6 update 2) solves the whole batch at
once; nvmath-python binds it (``pip install ".[cuda]"``). This module calls it when the input is on CUDA, the fast
path is on (``accel``) and nvmath-python imports; otherwise ``torch.linalg.eigvalsh``. CPU installs never import
nvmath. On that path the spectral entropy solves in float64 (the solve is latency-bound: it costs about what
float32 does), with one pinned algorithm (``CUSOLVER_ALG_1``: the same algorithm for every matrix, so an image's
eigenvalues never depend on what else is in its batch) and a zeroed workspace before each call (cuSOLVER 11.7.1
reads uninitialized workspace in this routine).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from . import accel

# cuSOLVER limits one batched call to n * lda * batch <= INT32_MAX elements.
INT32_MAX = 2**31 - 1
# The dtype the batched path solves in.
SOLVE_DTYPE = torch.float64


@dataclass(frozen=True)
class CusolverLib:
    """What a batched eigensolve needs from nvmath-python: the cusolverDn binding module and the enum values."""

    dn: Any  # nvmath.bindings.cusolverDn (or a stand-in with the same functions, in tests)
    novector: int  # cusolverEigMode_t: eigenvalues only
    lower: int  # cublasFillMode_t: read the lower triangle (the matrix is symmetric; either would do)
    syev_batched: int  # cusolverDnFunction_t of XsyevBatched, for cusolverDnSetAdvOptions
    alg: int  # cusolverAlgMode_t pinned for it
    types: dict  # torch dtype -> cudaDataType


@cache
def load_nvmath() -> CusolverLib | None:
    """nvmath-python's cuSOLVER binding, or None when it is not installed (the CPU-only default)."""
    try:
        from nvmath import CudaDataType
        from nvmath.bindings import cublas, cusolver, cusolverDn
    except ImportError:
        return None
    return CusolverLib(dn=cusolverDn, novector=int(cusolver.EigMode.NOVECTOR), lower=int(cublas.FillMode.LOWER),
                       syev_batched=int(cusolverDn.Function.SYEVBATCHED), alg=int(cusolver.AlgMode.ALG_1),
                       types={torch.float32: int(CudaDataType.CUDA_R_32F), torch.float64: int(CudaDataType.CUDA_R_64F)})


def use_cusolver(sym: torch.Tensor) -> bool:
    """Whether ``eigvalsh(sym)`` takes the batched cuSOLVER path (CUDA, fast path on, nvmath-python installed)."""
    return accel.active(sym) and load_nvmath() is not None


def solve_dtype(sym: torch.Tensor) -> torch.dtype:
    """The dtype to hand ``eigvalsh``: float64 on the batched cuSOLVER path, else ``sym``'s own (unchanged)."""
    return SOLVE_DTYPE if use_cusolver(sym) else sym.dtype


def eigvalsh(sym: torch.Tensor) -> torch.Tensor:
    """Ascending eigenvalues ``[B, n]`` of symmetric ``sym [B, n, n]``."""
    if not use_cusolver(sym):
        return torch.linalg.eigvalsh(sym)
    handle, params = _solver(sym.device.index if sym.device.index is not None else torch.cuda.current_device())
    w, info = syev_batched(sym, load_nvmath(), handle, params, torch.cuda.current_stream(sym.device).cuda_stream)
    torch._assert_async((info == 0).all(), "cusolverDnXsyevBatched did not converge (info != 0)")  # no host sync
    return w


@cache
def _solver(device_index: int) -> tuple[int, int]:
    """A cuSOLVER handle and params (algorithm pinned) for one device, created once."""
    lib = load_nvmath()
    with torch.cuda.device(device_index):
        handle = lib.dn.create()
        params = lib.dn.create_params()
        lib.dn.set_adv_options(params, lib.syev_batched, lib.alg)
    return handle, params


def chunk_sizes(batch: int, n: int) -> list[int]:
    """Split ``batch`` matrices of ``n x n`` into calls of at most INT32_MAX elements each."""
    per_call = max(1, INT32_MAX // max(n * n, 1))
    return [min(per_call, batch - start) for start in range(0, batch, per_call)]


def syev_batched(sym: torch.Tensor, lib: CusolverLib, handle: int, params: int,
                 stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``[B, n]`` and per-matrix ``info [B]`` (int32, 0 = converged) of ``sym [B, n, n]``.

    ``sym`` is float32 or float64 and symmetric, so its row-major storage is also its column-major one (lda = n);
    it is copied, as the solver overwrites its input. Everything is enqueued on ``stream``; nothing waits.
    """
    B, n, _ = sym.shape
    dtype = lib.types.get(sym.dtype)
    if dtype is None:
        raise ValueError(f"the batched eigensolve takes float32 or float64, got {sym.dtype}")
    a = sym.contiguous().clone()  # [B, n, n], destroyed by the solver
    w = sym.new_empty(B, n)
    info = torch.zeros(B, dtype=torch.int32, device=sym.device)
    lib.dn.set_stream(handle, stream)
    start = 0
    for size in chunk_sizes(B, n):
        a_ptr, w_ptr, info_ptr = a[start].data_ptr(), w[start].data_ptr(), info[start].data_ptr()
        common = (lib.novector, lib.lower, n, dtype, a_ptr, n, dtype, w_ptr, dtype)
        dev_bytes, host_bytes = lib.dn.xsyev_batched_buffer_size(handle, params, *common, size)
        work = torch.zeros(dev_bytes, dtype=torch.uint8, device=sym.device)  # zeroed: the 11.7.1 defect
        host = torch.zeros(host_bytes, dtype=torch.uint8)
        lib.dn.xsyev_batched(handle, params, *common, work.data_ptr(), dev_bytes, host.data_ptr(), host_bytes,
                             info_ptr, size)
        start += size
    return w, info
