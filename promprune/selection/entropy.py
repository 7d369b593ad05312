"""Prominence metrics: how spread out an image's visual tokens are, each normalized to [0, 1] and shaped ``[B]``.

- ``spectral_entropy``: entropy of the spectrum of the centered, L2-normalized tokens (the paper's metric).
- ``feature_norm_entropy``: entropy of the distribution of token L2 norms (Fig. 5 ablation).
- ``attention_entropy``: entropy of the saliency (attention) distribution (Fig. 5 ablation).
"""
from __future__ import annotations

import math

import torch

from ..dtypes import upcast
from . import eigensolve
from .kernels import ENTROPY_EPS

# Eigenvalues below this are numerical noise of a rank-deficient Gram; the reference clamps them here.
EIGEN_FLOOR = 1e-12


def _normalized_entropy(p: torch.Tensor, support: int) -> torch.Tensor:
    """``-sum p log p / log(support)`` over the last dim of a distribution ``p [B, K]`` -> ``[B]``."""
    h = -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(dim=-1)
    return h / math.log(support) if support > 1 else torch.zeros_like(h)


def spectral_entropy_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Spectral entropy from the (uncentered) Gram ``[B, N, N]`` of L2-normalized tokens, for N <= d.

    Centering in Gram space: with tokens X (rows) and mean m, ``(X - m)(X - m)^T = G - r 1^T - 1 r^T + g`` where
    ``r = G 1 / N`` and ``g = 1^T G 1 / N^2``. The N x N centered Gram has the same nonzero spectrum as the
    d x d covariance, so the eigenvalue count is N = min(N, d).
    """
    gram = gram.to(eigensolve.solve_dtype(gram))  # float64 for the batched cuSOLVER path; else unchanged
    r = gram.mean(dim=2)  # [B, N]
    g = r.mean(dim=1)  # [B]
    centered = gram - r[:, :, None] - r[:, None, :] + g[:, None, None]
    return _entropy_of_symmetric(centered)


def _entropy_of_symmetric(mat: torch.Tensor) -> torch.Tensor:
    """Normalized entropy of the spectrum of ``mat [B, K, K]`` (made exactly symmetric first) -> ``[B]`` float32."""
    mat = 0.5 * (mat + mat.transpose(1, 2))  # exact symmetry for the eigensolver
    return _entropy_of_spectrum(eigensolve.eigvalsh(mat)).float()


def _entropy_of_spectrum(eig: torch.Tensor) -> torch.Tensor:
    """``eig [B, K]`` -> normalized entropy of ``clamp(eig, 1e-12) / sum`` -> ``[B]``."""
    lam = eig.clamp_min(EIGEN_FLOOR)
    return _normalized_entropy(lam / lam.sum(dim=-1, keepdim=True), eig.shape[-1])


def spectral_entropy(features: torch.Tensor) -> torch.Tensor:
    """Normalized spectral entropy of visual tokens ``[B, N, d]`` -> ``[B]`` in [0, 1] (float32).

    Tokens are L2-normalized (eps 1e-8) and centered; the eigenvalues of the smaller Gram matrix (N x N if
    N <= d, else d x d) are clamped at 1e-12 and read as a distribution; its entropy is divided by
    ``log(min(N, d))``. mu = 0.42 (CLIP) was calibrated on exactly this quantity.
    """
    x = upcast(features)  # float32; float64 stays float64
    B, N, d = x.shape
    xn = x / x.norm(dim=-1, keepdim=True).clamp_min(ENTROPY_EPS)
    if N <= d:
        return spectral_entropy_from_gram(xn @ xn.transpose(1, 2))
    xc = xn - xn.mean(dim=1, keepdim=True)
    cov = xc.transpose(1, 2) @ xc  # [B, d, d]
    return _entropy_of_symmetric(cov.to(eigensolve.solve_dtype(cov)))


def feature_norm_entropy(features: torch.Tensor) -> torch.Tensor:
    """Normalized entropy of the token L2-norm distribution ``n_i / sum n``: ``[B, N, d] -> [B]``."""
    norms = features.float().norm(dim=-1)  # [B, N]
    total = norms.sum(dim=1, keepdim=True)
    p = torch.where(total > 0, norms / total.clamp_min(torch.finfo(norms.dtype).tiny), 1.0 / norms.shape[1])
    return _normalized_entropy(p, norms.shape[1])


def attention_entropy(saliency: torch.Tensor) -> torch.Tensor:
    """Normalized entropy of the saliency distribution ``s_i / sum s`` (negatives clamped to 0): ``[B, N] -> [B]``."""
    s = saliency.float().clamp_min(0)
    total = s.sum(dim=1, keepdim=True)
    p = torch.where(total > 0, s / total.clamp_min(torch.finfo(s.dtype).tiny), 1.0 / s.shape[1])
    return _normalized_entropy(p, s.shape[1])
