"""The batched eigensolve (``eigensolve``): the cuSOLVER call's arguments and memory layout against a stand-in that
reads the buffers through their raw pointers as cuSOLVER would (CPU), the fallback decision, and on a GPU with
nvmath-python the real call against ``torch.linalg.eigvalsh``."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from promprune.selection import accel, eigensolve

NOVECTOR, LOWER, SYEV_BATCHED, ALG_1 = 0, 0, 7, 1
R_32F, R_64F = 0, 1
_CTYPES = {R_32F: (ctypes.c_float, np.float32), R_64F: (ctypes.c_double, np.float64)}


def _view(ptr: int, ctype, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * count).from_address(ptr))


class FakeDn:
    """cusolverDn's two batched-eigensolve entry points, on host memory: A column-major with leading dimension lda,
    batch stride lda * n, lower triangle read; W batch stride n; info int32 per matrix; the workspace must arrive
    zeroed (the solver scribbles on it, as cuSOLVER does)."""

    def __init__(self, work_bytes: int = 96, host_bytes: int = 16):
        self.work_bytes, self.host_bytes = work_bytes, host_bytes
        self.calls: list[tuple] = []

    def set_stream(self, handle, stream):
        self.calls.append(("set_stream", handle, stream))

    def xsyev_batched_buffer_size(self, handle, params, jobz, uplo, n, dta, a, lda, dtw, w, ct, batch):
        self.calls.append(("buffer_size", handle, params, jobz, uplo, n, dta, lda, dtw, ct, batch))
        return self.work_bytes, self.host_bytes

    def xsyev_batched(self, handle, params, jobz, uplo, n, dta, a, lda, dtw, w, ct, work, work_bytes, host,
                      host_bytes, info, batch):
        self.calls.append(("solve", handle, params, jobz, uplo, n, dta, lda, dtw, ct, work_bytes, host_bytes, batch))
        assert (jobz, uplo) == (NOVECTOR, LOWER) and dta == dtw == ct
        for ptr, size in ((work, work_bytes), (host, host_bytes)):
            scratch = _view(ptr, ctypes.c_uint8, size)
            assert (scratch == 0).all(), "workspace not zeroed before the call"
            scratch[:] = 0xAB
        ctype, np_dtype = _CTYPES[dta]
        A = _view(a, ctype, lda * n * batch).reshape(batch, n, lda)  # [k, column j, row i]
        W = _view(w, ctype, n * batch).reshape(batch, n)
        for k in range(batch):
            lower = np.tril(A[k, :, :n].T)  # rows i >= j of matrix k
            W[k] = np.linalg.eigvalsh(lower + np.tril(lower, -1).T).astype(np_dtype)
        A[:] = np.nan  # the solver destroys its input
        _view(info, ctypes.c_int32, batch)[:] = 0


def fake_lib(dn: FakeDn) -> eigensolve.CusolverLib:
    return eigensolve.CusolverLib(dn=dn, novector=NOVECTOR, lower=LOWER, syev_batched=SYEV_BATCHED, alg=ALG_1,
                                  types={torch.float32: R_32F, torch.float64: R_64F})


def _symmetric(B: int, n: int, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, n, n, generator=g, dtype=torch.float64)
    return (m + m.transpose(1, 2)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_syev_batched_layout_and_arguments(dtype):
    sym = _symmetric(4, 7, dtype)
    before = sym.clone()
    dn = FakeDn()
    w, info = eigensolve.syev_batched(sym, fake_lib(dn), handle=11, params=22, stream=33)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(w, torch.linalg.eigvalsh(sym), atol=tol, rtol=tol)
    assert w.dtype == dtype and info.tolist() == [0, 0, 0, 0]
    assert torch.equal(sym, before), "the input must be copied: the solver overwrites it"
    code = R_64F if dtype == torch.float64 else R_32F
    assert dn.calls == [("set_stream", 11, 33),
                        ("buffer_size", 11, 22, NOVECTOR, LOWER, 7, code, 7, code, code, 4),
                        ("solve", 11, 22, NOVECTOR, LOWER, 7, code, 7, code, code, 96, 16, 4)]


def test_syev_batched_splits_a_batch_over_the_int32_limit(monkeypatch):
    monkeypatch.setattr(eigensolve, "INT32_MAX", 5 * 5 * 2)  # two 5 x 5 matrices per call
    sym = _symmetric(5, 5, torch.float64, seed=1)
    dn = FakeDn()
    w, _ = eigensolve.syev_batched(sym, fake_lib(dn), 1, 2, 3)
    torch.testing.assert_close(w, torch.linalg.eigvalsh(sym))
    assert [c[-1] for c in dn.calls if c[0] == "solve"] == [2, 2, 1]  # each call's workspace zeroed again


def test_chunk_sizes():
    assert eigensolve.chunk_sizes(40, 576) == [40]
    assert eigensolve.chunk_sizes(10, 20000) == [5, 5]  # 20000^2 * 5 <= 2^31 - 1 < 20000^2 * 6
    assert eigensolve.chunk_sizes(0, 8) == []


def test_syev_batched_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32 or float64"):
        eigensolve.syev_batched(_symmetric(1, 3, torch.float16), fake_lib(FakeDn()), 1, 2, 3)


def test_cpu_keeps_torch_eigvalsh_in_its_own_dtype():
    sym = _symmetric(3, 6, torch.float32)
    assert not eigensolve.use_cusolver(sym)
    assert eigensolve.solve_dtype(sym) == torch.float32
    assert torch.equal(eigensolve.eigvalsh(sym), torch.linalg.eigvalsh(sym))


def test_without_nvmath_cuda_falls_back(monkeypatch):
    monkeypatch.setattr(accel, "active", lambda t: True)  # as if on CUDA with the fast path on
    monkeypatch.setattr(eigensolve, "load_nvmath", lambda: None)
    sym = _symmetric(2, 5, torch.float32)
    assert not eigensolve.use_cusolver(sym) and eigensolve.solve_dtype(sym) == torch.float32
    assert torch.equal(eigensolve.eigvalsh(sym), torch.linalg.eigvalsh(sym))


def test_with_nvmath_the_solve_is_float64(monkeypatch):
    monkeypatch.setattr(accel, "active", lambda t: True)
    monkeypatch.setattr(eigensolve, "load_nvmath", lambda: fake_lib(FakeDn()))
    assert eigensolve.solve_dtype(_symmetric(1, 3, torch.float32)) == torch.float64


def _cuda_nvmath() -> bool:
    return torch.cuda.is_available() and eigensolve.load_nvmath() is not None


needs_cusolver = pytest.mark.skipif(not _cuda_nvmath(), reason="needs a CUDA GPU and nvmath-python (.[cuda])")


@needs_cusolver
def test_cuda_batched_eigvalsh_matches_torch():
    sym = _symmetric(6, 200, torch.float64, seed=3).cuda()
    assert eigensolve.use_cusolver(sym)
    torch.testing.assert_close(eigensolve.eigvalsh(sym), torch.linalg.eigvalsh(sym), atol=1e-9, rtol=1e-9)


@needs_cusolver
def test_cuda_eigenvalues_do_not_depend_on_the_batch():
    sym = _symmetric(5, 576, torch.float64, seed=4).cuda()
    together = eigensolve.eigvalsh(sym)
    for i in range(5):
        assert torch.equal(eigensolve.eigvalsh(sym[i:i + 1].clone())[0], together[i]), f"matrix {i}"
