"""Token geometry shared by the selectors: normalization, cosine Gram, masked arg-extrema.

All functions take batched tensors: features ``[B, N, d]``, masks ``[B, N]``.
"""
from __future__ import annotations

import math

import torch

from . import accel

# Entropy normalizes tokens with eps 1e-8 (reference implementation); the DPP / cosine kernels with eps 1e-6.
ENTROPY_EPS = 1e-8
KERNEL_EPS = 1e-6


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of every token ``[B, N, d] -> [B, N]``, in ``x``'s dtype, finite wherever it fits that dtype.

    ``x.norm`` sums the squares in ``x``'s dtype, which overflows long before the norm does (float32 from entries of
    ~1e19): the norm came out inf, the unit tokens 0, and selections repeated token 0. Tokens whose norm overflowed
    are measured again with the squares summed in float64 (where the square of any float32 fits) and the norm cast
    back; float64 tokens whose squares overflow are measured again scaled by their largest entry. Every other norm is
    ``x.norm``'s, bit for bit (one read of a ``[B, N]`` test). On the GPU fast path (``accel.active``), which never
    waits on the device, this is ``x.norm`` alone: ``registry.select`` sends features whose squares overflow to the
    plain path (its finiteness total, the inputs' whole norms, overflows first), so the fast path pays nothing for
    them.
    """
    norms = x.norm(dim=-1)
    if accel.active(x):
        return norms
    over = torch.isinf(norms)
    if bool(over.any()):
        rows = x[over]  # [K, d] the overflowed tokens only
        if x.dtype == torch.float64:  # no wider type: scaled by the largest entry (a norm past float64's range stays
            top = rows.abs().amax(dim=-1, keepdim=True)  # inf, and ``select`` refuses it)
            wide = top[:, 0] * (rows / top).norm(dim=-1)
        else:
            wide = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64)
        norms = norms.masked_scatter(over, wide.to(norms.dtype))
    return norms


def nonfinite(name: str, t: torch.Tensor) -> str | None:
    """What is wrong with ``t [B, ...]`` named ``name`` if it holds NaN or Inf ("features contain NaN values (batch
    items [1])"), else None. One read of the device."""
    bad = ~torch.isfinite(t).flatten(1).all(dim=1)
    if not bool(bad.any()):
        return None
    kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
    verb = "contain" if name.endswith(("features", "keys", "tokens")) else "contains"  # saliency contains
    return f"{name} {verb} {kind} values (batch items {bad.nonzero().flatten().tolist()})"


def unit_tokens(x: torch.Tensor, eps: float = KERNEL_EPS) -> torch.Tensor:
    """L2-normalize every token: ``[B, N, d] -> [B, N, d]``, norms (:func:`token_norms`: no overflow) floored at
    ``eps``."""
    return x / token_norms(x)[..., None].clamp_min(eps)


def segment_sums(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs of rows: ``rows [B, L, d]`` cut into S runs of ``lengths [B, S]`` rows (int64, each
    image's summing to L) -> ``[B, S, d]`` in ``rows``' dtype, an empty run 0. One call whatever B: a launch count
    constant in the batch (one ATen op; on CUDA a few kernels inside it, the lengths' running sum among them).

    Each entry is summed in a fixed order: 0, then its run's rows first to last, one rounded add at a time in
    ``rows``' dtype (``torch.segment_reduce``: its CPU kernel and its CUDA kernel both give each output entry one
    loop over its run, started from 0; no split of the loop, no tree, no blocking). So an entry depends on its own
    run's values only, never on the batch, the other runs, the thread count or the device's occupancy: an image gets
    the same bits alone as in any batch. A matmul sums in its library's order instead, which the library picks by
    the problem's shape: MKL blocks the reduction (MKL 2024.2 on an AMD EPYC sums a float32 ``[64, 576] x [576, d]``
    product's tokens in blocks of 192, each an FMA chain), cuBLAS picks a kernel, split-K or not, by the sizes, the
    batch's among them; ``torch.sum`` over an axis picks its order from the shape too (the CUDA reduction's block
    layout, the CPU's cascade). What this rests on: the two kernels as torch writes them
    (``aten/src/ATen/native/SegmentReduce.cpp``, ``native/cuda/SegmentReduce.cu``), not a documented guarantee;
    ``tests/selection/test_kernels.py`` pins the CPU's order against a Python loop, and
    ``tests/selection/test_gpu_selection.py`` the GPU's sums against the CPU's, bit for bit, alone and in a batch
    (needs a GPU; not yet run on one). ``lengths`` must sum to L: on CUDA torch's check of that is a read of the
    device, so it is skipped there (``unsafe``) and the callers build the lengths so; their shape is checked here (a
    mismatch crashes torch's kernel)."""
    if lengths.shape != (rows.shape[0], lengths.shape[-1]) or lengths.dtype != torch.long:
        raise ValueError(f"segment_sums: lengths {tuple(lengths.shape)} {lengths.dtype} for rows "
                         f"{tuple(rows.shape)}: expected [B, S] int64 with B = {rows.shape[0]}")
    return torch.segment_reduce(rows, "sum", lengths=lengths, axis=1, unsafe=rows.device.type != "cpu")


def per_image(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on each batch row of ``tensors`` (``[1, ...]`` slices), the results joined along dim 0: for a function
    the selection cannot reformulate whose products' shapes have the batch in them (VisionZip's projector, the
    model's module: one GEMM over every image's ``[B M, dv]`` rows sums in an order that depends on B, and merged
    features then differed by an ulp between an image alone and in a batch; float64 and float32, CPU). One call of
    ``fn`` per row, each the same whatever the batch, so its launches grow with the batch: the selection's own sums
    take :func:`segment_sums` instead, one call whatever the batch."""
    if tensors[0].shape[0] <= 1:  # one row, or none (an empty batch: ``fn``'s own empty result)
        return fn(*tensors)
    return torch.cat([fn(*(t[b:b + 1] for t in tensors)) for b in range(tensors[0].shape[0])])


def exactly_symmetric(gram: torch.Tensor) -> torch.Tensor:
    """``(G + G^T) / 2`` of a Gram ``[B, N, N]``: symmetric bit for bit. A BLAS product ``X X^T`` need not be: some
    kernels (MKL's AVX2 path for ``[145, 64]`` tokens, for one) sum ``(i, j)`` and ``(j, i)`` in different orders,
    and exact ties such as two mutual nearest neighbours (DivPrune's first pick) would then break by the CPU's
    kernel instead of by index. Where the product is symmetric already this returns the same values."""
    return 0.5 * (gram + gram.transpose(1, 2))


def batch_free(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on ``tensors [B, ...]`` where each row's result has the bits it has alone, whatever the batch: on the CPU
    off the fast path, ``fn`` on each row (:func:`per_image`), its inputs in storage aligned to 64 bytes (a slice
    that is not, copied), since MKL's results depend on both. Measured (MKL 2024.2, AVX-512, 2026-12-08): a batched
    ``eigvalsh`` gives a matrix other eigenvalues at offsets of 8 mod 16 bytes in its batch (its LAPACK call per
    matrix is the same, the matrix's storage is not), a batched product other sums by its position and by the batch
    size (the covariance ``X^T X`` of ``[100, 7]`` tokens, the Gram of ``[33, 64]`` float64 ones), and a batch-1
    product other sums for float64 inputs at 8 mod 16 bytes; an H within an ulp of a rounding boundary of T_sal then
    kept other tokens alone than in a batch. Elsewhere (CUDA, the fast path's cost model on the CPU) ``fn`` on the
    whole batch: one launch."""
    if tensors[0].device.type != "cpu" or accel.active(tensors[0]):
        return fn(*tensors)
    return per_image(lambda *rows: fn(*(aligned(r) for r in rows)), *tensors)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is contiguous and starts at a multiple of 64 bytes (every fresh CPU allocation of torch does), else
    a copy that does."""
    return t if t.is_contiguous() and t.data_ptr() % 64 == 0 else t.clone(memory_format=torch.contiguous_format)


def rescale_gram(gram: torch.Tensor, norms: torch.Tensor, eps_from: float, eps_to: float) -> torch.Tensor:
    """Turn a Gram of tokens normalized with ``eps_from`` into the Gram with ``eps_to``, exactly.

    ``x / max(n, eps_to) = (x / max(n, eps_from)) * max(n, eps_from) / max(n, eps_to)``, so the Gram rescales by
    an outer product of per-token factors; this lets one ``[B,N,d] x [B,d,N]`` product serve entropy and kernel.
    ``gram``: ``[B, N, N]``; ``norms``: ``[B, N]``.
    """
    s = norms.clamp_min(eps_from) / norms.clamp_min(eps_to)  # [B, N]; 1 wherever n >= eps_to
    if not accel.active(gram) and bool((s == 1).all()):  # the GPU fast path never waits: x * 1.0 is exact anyway
        return gram
    return gram * s[:, :, None] * s[:, None, :]


def unit_gram_from_product(raw: torch.Tensor, norms: torch.Tensor, eps: float = ENTROPY_EPS) -> torch.Tensor:
    """The unit Gram ``[B, N, N]`` from the tokens' raw product ``raw`` (float32) and their ``norms [B, N]``: each
    entry over both tokens' norms floored at ``eps``, exactly symmetric (``TokenSet.unit_gram`` of half tokens on the
    fast path; ``greedy_triton.scaled_gram`` makes the same bits in one launch)."""
    inv = 1.0 / norms.clamp_min(eps)  # [B, N]
    return exactly_symmetric(raw * inv[:, :, None] * inv[:, None, :])


def cosine_from_unit_gram(gram: torch.Tensor, norms: torch.Tensor, eps_from: float = ENTROPY_EPS,
                          eps_to: float = KERNEL_EPS) -> torch.Tensor:
    """The cosine kernel ``[B, N, N]`` from the unit Gram of tokens normalized with ``eps_from``: rescaled to
    ``eps_to`` (:func:`rescale_gram`), exactly symmetric, its diagonal set to its exact value ``(n / max(n,
    eps_to))^2`` (``TokenSet.cosine``; ``greedy_triton.scaled_gram`` makes the same bits in one launch)."""
    kernel = rescale_gram(gram, norms, eps_from, eps_to)
    kernel = kernel.clone() if kernel is gram else exactly_symmetric(kernel)
    kernel.diagonal(dim1=1, dim2=2).copy_((norms / norms.clamp_min(eps_to)).square())
    return kernel


def masked_argmax(score: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise argmax of ``score [B, N]`` over ``mask [B, N]`` (first index on ties).

    Returns ``(index [B], value [B])``; value is ``-inf`` for a row with no admissible entry.
    """
    masked = score.masked_fill(~mask, float("-inf"))
    value, index = masked.max(dim=1)
    return index, value


def near_tie_argmax(score: torch.Tensor, mask: torch.Tensor, tol) -> torch.Tensor:
    """Row-wise argmax of ``score [B, N]`` over ``mask [B, N]`` where every admissible score within ``tol`` (a float,
    or a ``[B, 1]`` tensor: one per row) of the row's max counts as tied and the lowest index wins -> ``index [B]``
    (0 for a row with no admissible entry)."""
    N = score.shape[1]
    masked = score.masked_fill(~mask, float("-inf"))
    best = masked.amax(dim=1, keepdim=True)  # [B, 1]
    offs = torch.arange(N, device=score.device).expand_as(score)
    return torch.where(masked >= best - tol, offs, N).amin(dim=1)  # an empty row: every entry ties at -inf: 0


def stable_descending_order(score: torch.Tensor) -> torch.Tensor:
    """Indices sorting ``score [B, N]`` high to low; ties keep raster order (lower index first)."""
    return torch.sort(score, dim=1, descending=True, stable=True).indices


def ranks_to_mask(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mask ``[B, N]`` of the first ``counts[b]`` entries of each row of ``order [B, N]``."""
    B, N = order.shape
    take = torch.arange(N, device=order.device)[None, :] < counts[:, None]  # [B, N], by rank
    mask = torch.zeros(B, N, dtype=torch.bool, device=order.device)
    return mask.scatter(1, order, take)


def start_basis(rho: torch.Tensor) -> torch.Tensor:
    """``I / sqrt(n)`` for each of the ``B`` images of ``rho [B, n, n]`` (unit Frobenius norm), contiguous: the
    certified split's Lanczos start (``certified``, ``lanczos_triton``)."""
    B, n, _ = rho.shape
    return (torch.eye(n, dtype=rho.dtype, device=rho.device) / math.sqrt(n)).expand(B, n, n).contiguous()
