"""Pre-LLM baselines, each faithful to its paper and released code: DivPrune, VisPruner, VisionZip, random."""
from __future__ import annotations

import hashlib

import torch

from .diversity import farthest_point
from .kernels import stable_descending_order, unit_tokens
from .registry import Selection, TokenSet, in_range, register_method

# VisPruner removes at most this many near-duplicate tokens per round (its released code).
VISPRUNER_ROUND = 8
# VisionZip keeps 54 dominant + 10 contextual tokens of 64 (108+20 of 128, 162+30 of 192): contextual = 10/64.
VISIONZIP_CONTEXTUAL = 10 / 64


def _no_saliency(tokens: TokenSet) -> torch.Tensor:
    return torch.zeros(tokens.batch, dtype=torch.long, device=tokens.x.device)


@register_method("divprune", needs_saliency=False)
def divprune(tokens: TokenSet, budget: int) -> Selection:
    """DivPrune: greedy max-min diversity on cosine distance (first pick: the most isolated token)."""
    B, N = tokens.batch, tokens.n
    distance = (1.0 - tokens.cosine).clamp_min(0)
    every = torch.ones(B, N, dtype=torch.bool, device=tokens.x.device)
    counts = torch.full((B,), budget, dtype=torch.long, device=tokens.x.device)
    picks = farthest_point(distance, every, counts)
    return Selection(picks, _no_saliency(tokens), None, None, torch.zeros_like(picks, dtype=torch.bool))


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, N, d]`` at ``index [B, M]`` -> ``[B, M, d]``."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def _submatrix(mat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``mat [B, N, N]`` at ``rows [B, R]`` x ``cols [B, C]`` -> ``[B, R, C]``."""
    batch = torch.arange(mat.shape[0], device=mat.device)[:, None, None]
    return mat[batch, rows[:, :, None], cols[:, None, :]]


def vispruner_diverse(cosine: torch.Tensor, rest: torch.Tensor, keep: int) -> torch.Tensor:
    """VisPruner's duplicate removal: shrink the ordered candidates ``rest [B, R]`` to ``keep`` tokens.

    Each round splits the current list into even and odd positions, matches every even token to its most similar
    odd token (cosine), and drops the ``min(8, R - keep)`` even tokens with the highest match; the new list is the
    surviving even tokens (by descending match) followed by the odd ones. ``cosine [B, N, N]``: the token kernel,
    computed once, so each round is a gather instead of a fresh ``[R/2, d] x [d, R/2]`` product.
    """
    if keep <= 0:
        return rest[:, :0]
    while rest.shape[1] > keep:
        drop = min(VISPRUNER_ROUND, rest.shape[1] - keep)
        even, odd = rest[:, 0::2], rest[:, 1::2]
        match = _submatrix(cosine, even, odd).amax(dim=2)  # [B, R_even]
        survivors = stable_descending_order(match)[:, min(drop, even.shape[1]):]
        rest = torch.cat([even.gather(1, survivors), odd], dim=1)
    return rest


@register_method("vispruner", needs_saliency=True, options={"important_ratio": 0.5},
                 check=in_range("important_ratio", 0.0, 1.0))
def vispruner(tokens: TokenSet, budget: int, *, important_ratio: float) -> Selection:
    """VisPruner: floor(T r) tokens by saliency, the rest by iterative near-duplicate removal."""
    t_imp = int(budget * float(important_ratio))  # floor
    order = stable_descending_order(tokens.require_saliency("vispruner"))  # [B, N] descending saliency
    diverse = vispruner_diverse(tokens.cosine, order[:, t_imp:], budget - t_imp)
    indices = torch.cat([order[:, :t_imp], diverse], dim=1)
    salient = torch.arange(budget, device=indices.device)[None, :].expand(tokens.batch, budget) < t_imp
    return Selection(indices, torch.full((tokens.batch,), t_imp, device=indices.device), None, None, salient)


@register_method("visionzip", needs_saliency=True, merges=True, options={"contextual_ratio": VISIONZIP_CONTEXTUAL},
                 check=in_range("contextual_ratio", 0.0, 1.0))
def visionzip(tokens: TokenSet, budget: int, *, contextual_ratio: float) -> Selection:
    """VisionZip: dominant tokens by attention + contextual tokens merged by similarity (merged features out).

    The ``n_ctx = round(T * contextual_ratio)`` contextual tokens are targets spaced evenly (step ``R // n_ctx``)
    through the remaining tokens in raster order; every other remaining token joins its most similar target
    (cosine of the features; VisionZip uses the encoder's attention keys, which a projected-feature API does not
    see) and each target becomes the mean of its group, itself included. Indices report the targets' positions.
    """
    B, N, d = tokens.x.shape
    n_ctx = min(round(budget * float(contextual_ratio)), budget)
    n_dom = budget - n_ctx
    order = stable_descending_order(tokens.require_saliency("visionzip"))
    dominant = order[:, :n_dom]
    rest = order[:, n_dom:].sort(dim=1).values  # [B, R] remaining tokens in raster order
    R = rest.shape[1]
    slots = torch.arange(0, R, max(1, R // max(n_ctx, 1)), device=rest.device)[:n_ctx]
    is_target = torch.zeros(R, dtype=torch.bool, device=rest.device)
    is_target[slots] = True
    targets, others = rest[:, is_target], rest[:, ~is_target]
    merged = _gather_rows(tokens.x, targets)  # [B, n_ctx, d]
    if others.shape[1] and n_ctx:
        unit = unit_tokens(tokens.x)
        sim = _gather_rows(unit, others) @ _gather_rows(unit, targets).transpose(1, 2)  # [B, R - n_ctx, n_ctx]
        assign = torch.nn.functional.one_hot(sim.argmax(dim=2), n_ctx).to(merged.dtype)  # [B, R - n_ctx, n_ctx]
        merged = (merged + assign.transpose(1, 2) @ _gather_rows(tokens.x, others)) / (1 + assign.sum(dim=1))[..., None]
    indices = torch.cat([dominant, targets], dim=1)
    features = torch.cat([_gather_rows(tokens.x, dominant), merged], dim=1)
    salient = torch.arange(budget, device=indices.device)[None, :].expand(B, budget) < n_dom
    return Selection(indices, torch.full((B,), n_dom, device=indices.device), None, features, salient)


@register_method("random", needs_saliency=False, options={"seed": 0})
def random_tokens(tokens: TokenSet, budget: int, *, seed: int) -> Selection:
    """T tokens uniformly at random, reproducible from ``seed`` and the image itself.

    Each image draws from a CPU generator seeded by ``seed`` and a fingerprint of its own features, so an image
    gets the same tokens whatever batch or shard it lands in, and every device agrees.
    """
    rows = []
    for b in range(tokens.batch):
        gen = torch.Generator().manual_seed(_fingerprint(tokens.x[b], int(seed)))
        rows.append(torch.randperm(tokens.n, generator=gen)[:budget])
    indices = torch.stack(rows).to(tokens.x.device)
    return Selection(indices, _no_saliency(tokens), None, None, torch.zeros_like(indices, dtype=torch.bool))


# The fingerprint reads the first few channels of every token: cheap, and enough to tell images apart.
_FINGERPRINT_CHANNELS = 16


def _fingerprint(x: torch.Tensor, seed: int) -> int:
    """A 63-bit seed from ``seed`` and the bytes of ``x [N, d]`` (first channels)."""
    data = x[:, :_FINGERPRINT_CHANNELS].detach().float().cpu().contiguous().numpy().tobytes()
    digest = hashlib.blake2b(data, digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") >> 1
