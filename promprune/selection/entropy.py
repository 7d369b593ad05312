"""Prominence metrics: how spread out an image's visual tokens are, each normalized to [0, 1] and shaped ``[B]``.

- ``spectral_entropy``: entropy of the spectrum of the centered, L2-normalized tokens (the paper's metric).
- ``feature_norm_entropy``: entropy of the distribution of token L2 norms (Fig. 4 ablation).
- ``attention_entropy``: entropy of the saliency (attention) distribution (Fig. 4 ablation).
"""
from __future__ import annotations

import math

import torch

from ..dtypes import upcast
from . import accel
from .kernels import ENTROPY_EPS, batch_free, exactly_symmetric, nonfinite, token_norms, unit_tokens

# Eigenvalues below this are numerical noise of a rank-deficient Gram; the reference clamps them here. Absolute: for
# tokens nearly alike (a tiny trace) it moves H, which the certified split allows for (``certified.FLOOR_PER_ROW``).
EIGEN_FLOOR = 1e-12
# Tokens that coincide up to rounding (the same token repeated, all-zero tokens): their spectral matrix is zero in exact
# arithmetic, where the reference's clamp makes every eigenvalue 1e-12 and H = 1; computed, it is rounding noise (a
# trace of up to ~3 float32 ulps a token measured, 2026-11-29) whose eigenvalues are anything, NaN, or a LAPACK failure.
# A matrix whose trace (the tokens' total variance, summed in float64) is at most this many ulps of its dtype per row
# is taken as zero: H = 1, the same on every device (``degenerate``; the certified split refuses such rows, so they
# reach the same rule). Real tokens lie orders of magnitude above it (64 float32 ulps a token: an RMS angle of 2.8e-3
# between the tokens and their mean).
NOISE_ULPS = 64


# Centering in Gram space (``centered_gram``) subtracts terms of size ~1 to leave entries of the size of the tokens'
# spread about their mean (1 - |mean unit token|^2, the centered Gram's trace over N): the float32 Gram's
# rounding then moves H by ~2e-6 / spread (measured 2026-12-07, N=576 d=4096 and N=1296 d=3584, against float64:
# 3e-6 at spread 0.5, 2-3e-5 at 0.08, 1e-2 at 1e-4), and its negative rounding eigenvalues grow to where the certified
# bounds' argument (a measure on [0, inf)) fails. Tokens centered before their product keep 1.3e-6 at every spread
# down to 1e-4. Below this spread (tokens whose mean cosine is above ~0.75) the spectral matrix is the centered tokens'
# own product, on every route (``spectral_matrix``, the certified split's eigensolve), so the routes agree.
SPREAD_FLOOR = 0.25


def cancels(features: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """``[B]`` bool: the rows of ``features [B, N, d]`` (``norms``: their L2 norms, when known) whose centering in
    Gram space would cancel, their spread 1 - |mean unit token|^2 (the centered unit Gram's trace over N for tokens
    of nonzero norm) below ``SPREAD_FLOOR``: |mean unit token| above sqrt(1 - SPREAD_FLOOR). Tensor operations only
    (six launches), no host read."""
    x = upcast(features)
    n = token_norms(x) if norms is None else norms
    mean = (x / n.clamp_min(ENTROPY_EPS)[..., None]).mean(dim=1)  # [B, d]
    return torch.linalg.vector_norm(mean, dim=-1) > math.sqrt(1.0 - SPREAD_FLOOR)


def centered_unit_gram(features: torch.Tensor) -> torch.Tensor:
    """The centered Gram ``[B, N, N]`` of the L2-normalized tokens ``[B, N, d]`` centered before their product (the
    accurate form at any spread), exactly symmetric, float32 (float64 tokens stay float64); each row's the same
    bits alone as in any batch on the CPU (``kernels.batch_free``)."""
    xn = unit_tokens(upcast(features), ENTROPY_EPS)
    xc = xn - xn.mean(dim=1, keepdim=True)
    return exactly_symmetric(batch_free(lambda t: t @ t.transpose(1, 2), xc))


def noise_trace(n: int, dtype: torch.dtype) -> float:
    """The largest trace of an ``n x n`` spectral matrix of ``dtype`` taken as rounding noise (``NOISE_ULPS``)."""
    return n * NOISE_ULPS * torch.finfo(dtype).eps


def degenerate(mat: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the rows of the spectral matrix ``mat [B, K, K]`` whose trace is rounding noise (``noise_trace``),
    for K >= 2 (one eigenvalue: H is 0 whatever it is)."""
    trace = mat.diagonal(dim1=1, dim2=2).double().sum(-1)
    return (trace <= noise_trace(mat.shape[-1], mat.dtype)) & (mat.shape[-1] > 1)


def _normalized_entropy(p: torch.Tensor, support: int) -> torch.Tensor:
    """``-sum p log p / log(support)`` over the last dim of a distribution ``p [B, K]`` -> ``[B]``."""
    h = -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(dim=-1)
    return h / math.log(support) if support > 1 else torch.zeros_like(h)


def centered_gram(gram: torch.Tensor) -> torch.Tensor:
    """The centered Gram ``[B, N, N]`` from the (uncentered) Gram of L2-normalized tokens, for N <= d.

    Centering in Gram space: with tokens X (rows) and mean m, ``(X - m)(X - m)^T = G - r 1^T - 1 r^T + g`` where
    ``r = G 1 / N`` and ``g = 1^T G 1 / N^2``. The N x N centered Gram has the same nonzero spectrum as the
    d x d covariance, so the eigenvalue count is N = min(N, d). Made exactly symmetric for the eigensolver.
    """
    r = gram.mean(dim=2)  # [B, N]
    g = r.mean(dim=1)  # [B]
    return exactly_symmetric(gram - r[:, :, None] - r[:, None, :] + g[:, None, None])


def covariance(features: torch.Tensor) -> torch.Tensor:
    """The ``[B, d, d]`` covariance of the centered, L2-normalized tokens ``[B, N, d]`` (for N > d), symmetric, in
    float32 (float64 tokens stay float64); each row's the same bits alone as in any batch on the CPU
    (``kernels.batch_free``: the batched product summed a row's entries by its place in the batch)."""
    xn = unit_tokens(upcast(features), ENTROPY_EPS)
    xc = xn - xn.mean(dim=1, keepdim=True)
    return exactly_symmetric(batch_free(lambda t: t.transpose(1, 2) @ t, xc))  # [B, d, d]


def spectral_matrix(features: torch.Tensor, gram: torch.Tensor | None = None,
                    cancelling: torch.Tensor | None = None) -> torch.Tensor:
    """The symmetric matrix ``[B, K, K]``, K = min(N, d), whose eigenvalues the spectral entropy reads: the centered
    Gram of the L2-normalized tokens (N <= d) or their covariance (N > d).

    ``gram``: their uncentered Gram, when already computed: it is centered in Gram space (``centered_gram``), except
    in the rows whose centering cancels (``cancelling [B]`` bool on the host where known, else ``cancels``, read here:
    a host read), which are the tokens centered before their product (``centered_unit_gram``, ``SPREAD_FLOOR``)."""
    B, N, d = features.shape
    if N > d:
        return covariance(features)
    if gram is None:
        return centered_unit_gram(features)
    out = centered_gram(gram)
    rows = torch.as_tensor(cancels(features) if cancelling is None else cancelling).cpu().nonzero().flatten()
    if len(rows):
        rows = rows.to(out.device)
        out[rows] = centered_unit_gram(features[rows]).to(out.dtype)
    return out


def entropy_of_matrix(mat: torch.Tensor) -> torch.Tensor:
    """The exact normalized entropy of the spectrum of the symmetric ``mat [B, K, K]`` -> ``[B]`` float32: eigenvalues
    by ``torch.linalg.eigvalsh`` in ``mat``'s dtype, clamped at 1e-12, read as a distribution. A matrix that is zero
    up to rounding (``degenerate``: tokens that coincide) has H = 1, its value in exact arithmetic. On the CPU each
    matrix is eigensolved on its own (``kernels.batch_free``): MKL's batched eigensolve gave a matrix other
    eigenvalues by its place in the batch, so H moved by an ulp between an image alone and in a batch, and between the
    exact route and the certified split's eigensolve of its undecided rows."""
    zero = degenerate(mat)
    mat = mat.masked_fill(zero[:, None, None], 0.0)  # no eigensolve of rounding noise (NaN or a LAPACK failure)
    return torch.where(zero, 1.0, _entropy_of_spectrum(batch_free(torch.linalg.eigvalsh, mat)).float())


def _entropy_of_spectrum(eig: torch.Tensor) -> torch.Tensor:
    """``eig [B, K]`` -> normalized entropy of ``clamp(eig, 1e-12) / sum`` -> ``[B]``."""
    lam = eig.clamp_min(EIGEN_FLOOR)
    return _normalized_entropy(lam / lam.sum(dim=-1, keepdim=True), eig.shape[-1])


def _batched(t, dims: int, shape: str, fn: str) -> None:
    """The public entropies take a finite batch: a tensor of ``dims`` dimensions (``shape``) without NaN or Inf, else
    a ValueError (a NaN made LAPACK fail, or the entropy 1.0 or NaN, without a word)."""
    one = "features" if dims == 3 else "saliency"
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn} takes a batch {shape}, got {got} (one image: {one}[None])")
    if t.numel() and (problem := nonfinite(one, t)) is not None:
        raise ValueError(f"{fn}: {problem}")


def spectral_entropy(features: torch.Tensor) -> torch.Tensor:
    """Normalized spectral entropy of visual tokens ``[B, N, d]`` -> ``[B]`` in [0, 1] (float32), exact.

    Tokens are L2-normalized (eps 1e-8) and centered; the eigenvalues of the smaller Gram matrix (N x N if
    N <= d, else d x d) are clamped at 1e-12 and read as a distribution; its entropy is divided by
    ``log(min(N, d))``. mu = 0.42 (CLIP) was calibrated on exactly this quantity. PromPrune's split reads it through
    certified bounds on the GPU where they cost less than this eigensolve (``promprune.selection.certified``), with
    the same decisions. The Gram's float32 products run at full precision where the process turned TF32 on
    (``accel.full_float32``).
    """
    _batched(features, 3, "[B, N, d]", "spectral_entropy")
    with accel.full_float32():
        return entropy_of_matrix(spectral_matrix(features))


def feature_norm_entropy(features: torch.Tensor) -> torch.Tensor:
    """Normalized entropy of the token L2-norm distribution ``n_i / sum n``: ``[B, N, d] -> [B]``."""
    _batched(features, 3, "[B, N, d]", "feature_norm_entropy")
    norms = token_norms(upcast(features))  # [B, N], float64 tokens' in float64 (float32 made those past it inf)
    total = norms.sum(dim=1, keepdim=True)
    p = torch.where(total > 0, norms / total.clamp_min(torch.finfo(norms.dtype).tiny), 1.0 / norms.shape[1])
    return _normalized_entropy(p, norms.shape[1]).float()


def attention_entropy(saliency: torch.Tensor) -> torch.Tensor:
    """Normalized entropy of the saliency distribution ``s_i / sum s`` (negatives clamped to 0): ``[B, N] -> [B]``."""
    _batched(saliency, 2, "[B, N]", "attention_entropy")
    s = saliency.float().clamp_min(0)
    total = s.sum(dim=1, keepdim=True)
    p = torch.where(total > 0, s / total.clamp_min(torch.finfo(s.dtype).tiny), 1.0 / s.shape[1])
    return _normalized_entropy(p, s.shape[1])
