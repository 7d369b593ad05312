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
from .kernels import ENTROPY_EPS, exactly_symmetric, token_norms, unit_tokens

# Eigenvalues below this are numerical noise of a rank-deficient Gram; the reference clamps them here.
EIGEN_FLOOR = 1e-12
# Tokens that coincide up to rounding (the same token repeated, all-zero tokens): their spectral matrix is zero in exact
# arithmetic, where the reference's clamp makes every eigenvalue 1e-12 and H = 1; computed, it is rounding noise (a
# trace of up to ~3 float32 ulps a token measured, 2026-11-29) whose eigenvalues are anything, NaN, or a LAPACK failure.
# A matrix whose trace (the tokens' total variance, summed in float64) is at most this many ulps of its dtype per row
# is taken as zero: H = 1, the same on every device (``degenerate``; the certified split refuses such rows, so they
# reach the same rule). Real tokens lie orders of magnitude above it (64 float32 ulps a token: an RMS angle of 2.8e-3
# between the tokens and their mean).
NOISE_ULPS = 64


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
    float32 (float64 tokens stay float64)."""
    xn = unit_tokens(upcast(features), ENTROPY_EPS)
    xc = xn - xn.mean(dim=1, keepdim=True)
    return exactly_symmetric(xc.transpose(1, 2) @ xc)  # [B, d, d]


def spectral_matrix(features: torch.Tensor, gram: torch.Tensor | None = None) -> torch.Tensor:
    """The symmetric matrix ``[B, K, K]``, K = min(N, d), whose eigenvalues the spectral entropy reads: the centered
    Gram of the L2-normalized tokens (N <= d; ``gram``, their uncentered Gram, when already computed) or their
    covariance (N > d)."""
    B, N, d = features.shape
    if N > d:
        return covariance(features)
    if gram is None:
        xn = unit_tokens(upcast(features), ENTROPY_EPS)
        gram = xn @ xn.transpose(1, 2)
    return centered_gram(gram)


def entropy_of_matrix(mat: torch.Tensor) -> torch.Tensor:
    """The exact normalized entropy of the spectrum of the symmetric ``mat [B, K, K]`` -> ``[B]`` float32: eigenvalues
    by ``torch.linalg.eigvalsh`` in ``mat``'s dtype, clamped at 1e-12, read as a distribution. A matrix that is zero
    up to rounding (``degenerate``: tokens that coincide) has H = 1, its value in exact arithmetic."""
    zero = degenerate(mat)
    mat = mat.masked_fill(zero[:, None, None], 0.0)  # no eigensolve of rounding noise (NaN or a LAPACK failure)
    return torch.where(zero, 1.0, _entropy_of_spectrum(torch.linalg.eigvalsh(mat)).float())


def _entropy_of_spectrum(eig: torch.Tensor) -> torch.Tensor:
    """``eig [B, K]`` -> normalized entropy of ``clamp(eig, 1e-12) / sum`` -> ``[B]``."""
    lam = eig.clamp_min(EIGEN_FLOOR)
    return _normalized_entropy(lam / lam.sum(dim=-1, keepdim=True), eig.shape[-1])


def _batched(t, dims: int, shape: str, fn: str) -> None:
    """The public entropies take a batch: a tensor of ``dims`` dimensions (``shape``), else a ValueError."""
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        one = "features[None]" if dims == 3 else "saliency[None]"
        raise ValueError(f"{fn} takes a batch {shape}, got {got} (one image: {one})")


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
    norms = token_norms(features.float())  # [B, N]
    total = norms.sum(dim=1, keepdim=True)
    p = torch.where(total > 0, norms / total.clamp_min(torch.finfo(norms.dtype).tiny), 1.0 / norms.shape[1])
    return _normalized_entropy(p, norms.shape[1])


def attention_entropy(saliency: torch.Tensor) -> torch.Tensor:
    """Normalized entropy of the saliency distribution ``s_i / sum s`` (negatives clamped to 0): ``[B, N] -> [B]``."""
    _batched(saliency, 2, "[B, N]", "attention_entropy")
    s = saliency.float().clamp_min(0)
    total = s.sum(dim=1, keepdim=True)
    p = torch.where(total > 0, s / total.clamp_min(torch.finfo(s.dtype).tiny), 1.0 / s.shape[1])
    return _normalized_entropy(p, s.shape[1])
