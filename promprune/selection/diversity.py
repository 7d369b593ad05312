"""Stage-2 coverage selectors: greedy DPP MAP, farthest point sampling, facility location.

Every selector has the same batched contract::

    picks = selector(tokens, available, counts, anchor=None, conditional=False, fallback=None)

- ``available [B, N]`` bool: candidates (tokens not taken by stage 1).
- ``counts [B]`` long: how many tokens to pick per image (may differ per image).
- ``anchor [B, N]`` bool or None: the stage-1 (salient) tokens already kept.
- ``conditional``: make the picks diverse with respect to the anchor tokens too.
- ``fallback [B, N]``: deterministic order used once every remaining gain is 0 (higher first); None = raster order.
- ``steps``: a host-known bound on ``counts.max()``, the width K of the result; None: ``counts.max()`` (read from
  the device).
- returns ``picks [B, K]`` long in pick order, padded with -1 past ``counts[b]``.

A chosen token is never chosen twice. The loop runs over picks (inherently sequential); each step is a tensor op
over the whole batch and all tokens. On CUDA (``accel.active``) each selector runs as one Triton kernel instead
(``greedy_triton``: the same steps, no launch per pick) and nothing waits on the device when ``steps`` is given.
"""
from __future__ import annotations

import torch

from ..dtypes import upcast
from . import accel
from .kernels import masked_argmax, near_tie_argmax

# Farthest point sampling counts scores within this of the best as tied (the lowest index wins), in the torch loop and
# the Triton kernel alike: duplicated tokens have distances that agree mathematically but differ by float32 rounding
# (~1e-7), which would otherwise pick among them by the last bits of a device's matmul.
FPS_TIE_EPS = 1e-6
# Facility location counts gains within this share of the best (of 1, for gains below 1) as tied, the lowest index
# winning, in the torch loop and the Triton kernel alike: once two clients remain under-covered their gains agree
# mathematically (1 + s_ab - c_a - c_b) and differ by rounding, and a gain sums N clients in an order each device
# picks; the same inputs in float32 and float64 picked differently in 23 of 600 random cases without it.
FL_TIE_EPS = 1e-5
# Residual DPP gains at or below this are numerically zero: the kernel's rank is exhausted. Dividing by the square
# root of such a gain would amplify float32 noise, so those steps fall back to the deterministic order instead.
GAIN_EPS = 1e-6


def _width(counts: torch.Tensor, steps: int | None) -> int:
    """Columns of the pick matrix: ``steps`` when the caller knows it, else ``counts.max()`` (a host sync)."""
    if steps is not None:
        return steps
    return int(counts.max()) if counts.numel() else 0

def _row(mat: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Row ``j[b]`` of each ``mat[b]``: ``[B, N, N], [B] -> [B, N]``."""
    B, _, N = mat.shape
    return mat.gather(1, j.view(B, 1, 1).expand(B, 1, N)).squeeze(1)


def fallback_score(fallback: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The order ``[B, N]`` (like ``like``'s shape) the selectors fall back on once their gains run out, highest
    first: the given ``fallback`` (the saliency), else raster order (``-index``, float32)."""
    if fallback is not None:
        return upcast(fallback)  # float64 saliency stays float64: no ties float32 rounding would make
    B, N = like.shape
    return -torch.arange(N, device=like.device, dtype=torch.float32).expand(B, N)  # raster order


def _argmax_tiebreak(score: torch.Tensor, mask: torch.Tensor, order: torch.Tensor):
    """Masked row-wise argmax of ``score [B, N]``; exact ties go to the highest ``order`` (then lowest index)."""
    _, best = masked_argmax(score, mask)
    tied = mask & (score == best[:, None])
    index, _ = masked_argmax(order, tied)
    return index, best


def _first_from_anchor(similarity: torch.Tensor, available: torch.Tensor, anchor: torch.Tensor):
    """The available token whose largest similarity to any anchor token is smallest, among those with a gain to give
    (a zero token, an fp16 feature that underflowed, has similarity 0 to everything and no gain: as the first pick it
    sent the step to the fallback order while other gains were positive): ``-> (index [B], has_anchor [B])``. Where
    no available token has a gain, any available one (the step falls back as every later one would)."""
    max_sim = similarity.masked_fill(~anchor[:, None, :], float("-inf")).amax(dim=2)  # [B, N]
    # no gain: ranked below every other available token (the largest finite value, not inf: an available token
    # stays above the unavailable ones' -inf)
    max_sim = max_sim.masked_fill(similarity.diagonal(dim1=1, dim2=2) <= GAIN_EPS, torch.finfo(max_sim.dtype).max)
    index, _ = masked_argmax(-max_sim, available)
    return index, anchor.any(dim=1)


class _Picks:
    """Bookkeeping shared by the greedy loops: the free mask and the padded pick matrix."""

    def __init__(self, available: torch.Tensor, counts: torch.Tensor, steps: int | None = None):
        self.free = available.clone()
        self.counts = counts
        self.steps = _width(counts, steps)
        self.out = torch.full((available.shape[0], self.steps), -1, dtype=torch.long, device=available.device)

    def take(self, k: int, j: torch.Tensor) -> torch.Tensor:
        """Record pick ``j [B]`` at step ``k`` for the rows still picking; returns that row mask ``[B]``."""
        active = k < self.counts
        self.out[:, k] = torch.where(active, j, -1)
        # free[b, j[b]] &= ~active[b], without a host sync (a GPU loop must not wait on every step)
        still = self.free.gather(1, j[:, None]) & ~active[:, None]
        self.free.scatter_(1, j[:, None], still)
        return active


def dpp_greedy(kernel: torch.Tensor, available: torch.Tensor, counts: torch.Tensor, *,
               anchor: torch.Tensor | None = None, conditional: bool = False,
               fallback: torch.Tensor | None = None, steps: int | None = None) -> torch.Tensor:
    """Greedy MAP inference for a DPP (Chen, Zhang & Zhou, NeurIPS 2018), batched.

    ``kernel [B, N, N]`` is PSD (the cosine-similarity kernel). Keeps an incremental Cholesky factor: picking j
    adds the row ``e = (L_j - c_j^T C) / sqrt(d2_j)`` and lowers every residual gain ``d2 -= e^2`` (clamped at 0).
    Exactly ``counts[b]`` picks, no early stop.

    - Unconditional with a non-empty anchor (the released PromPrune code): the first pick is the available token
      whose largest cosine similarity to the anchor tokens is smallest; after that, the largest residual gain.
    - ``conditional=True``: the anchor tokens enter the Cholesky factor first, so gains are those of the Schur
      complement of the kernel on the anchor set: picks are diverse with respect to the salient tokens as well.
    - When every remaining gain is (numerically) 0, i.e. ``counts`` exceeds the kernel's rank, the rest is filled
      by ``fallback`` (saliency, when the caller has it), else in raster order. Tokens are never repeated.
    """
    if accel.fused(kernel):
        out = accel.kernel("dpp", lambda: _dpp_fused(kernel, available, counts, anchor, conditional, fallback, steps))
        if out is not None:  # None: Triton could not build the kernel here (accel.kernel), the loop picks the same
            return out
    B, N, _ = kernel.shape
    picks = _Picks(available, counts, steps)
    n_cond = int(anchor.sum(dim=1).max()) if (conditional and anchor is not None and anchor.numel()) else 0
    factor = kernel.new_zeros(B, n_cond + picks.steps, N)  # incremental Cholesky rows
    gains = kernel.diagonal(dim1=1, dim2=2).clone()  # [B, N] residual gains d2
    order_fb = fallback_score(fallback, available)

    def extend(step: int, j: torch.Tensor, update: torch.Tensor) -> None:
        rows = factor[:, :step, :]  # [B, step, N]
        c_j = rows.gather(2, j.view(B, 1, 1).expand(B, step, 1))  # [B, step, 1]
        e = _row(kernel, j) - torch.bmm(c_j.transpose(1, 2), rows).squeeze(1)  # [B, N]
        e = e / gains.gather(1, j[:, None]).clamp_min(GAIN_EPS).sqrt()
        e = e * update[:, None]
        factor[:, step, :] = e
        gains.sub_(e * e).clamp_(min=0)

    step = 0
    if n_cond:
        cond_order = torch.sort(anchor.to(torch.int8), dim=1, descending=True, stable=True).indices
        for t in range(n_cond):
            j = cond_order[:, t]
            is_anchor = anchor.gather(1, j[:, None]).squeeze(1)
            extend(step, j, is_anchor & (gains.gather(1, j[:, None]).squeeze(1) > GAIN_EPS))
            step += 1

    first = None
    if anchor is not None and not conditional:
        first = _first_from_anchor(kernel, available, anchor)

    for k in range(picks.steps):
        j, gain = _argmax_tiebreak(gains, picks.free, order_fb)
        if k == 0 and first is not None:
            j = torch.where(first[1], first[0], j)
            gain = gains.gather(1, j[:, None]).squeeze(1)
        exhausted = gain <= GAIN_EPS
        j = torch.where(exhausted, masked_argmax(order_fb, picks.free)[0], j)  # no `if`: no host sync per step
        active = picks.take(k, j)
        extend(step, j, active & ~exhausted)
        step += 1
    return picks.out


def _dpp_fused(kernel, available, counts, anchor, conditional, fallback, steps) -> torch.Tensor:
    """``dpp_greedy`` as one Triton launch; the first pick from the anchor is found here, in torch."""
    from . import greedy_triton

    first = None
    if anchor is not None and not conditional:
        index, has_anchor = _first_from_anchor(kernel, available, anchor)
        first = torch.where(has_anchor, index, -1)
    return greedy_triton.dpp_greedy(kernel, available, counts, fallback_score(fallback, available), first,
                                    anchor if conditional else None, _width(counts, steps), GAIN_EPS)


def farthest_point(distance: torch.Tensor, available: torch.Tensor, counts: torch.Tensor, *,
                   anchor: torch.Tensor | None = None, conditional: bool = False,
                   fallback: torch.Tensor | None = None, steps: int | None = None) -> torch.Tensor:
    """Farthest point sampling (greedy max-min) on a distance matrix ``[B, N, N]`` (here ``1 - cos``).

    Each pick is the available token whose smallest distance to the picked set is largest. The first pick is the
    token farthest from the anchor set when there is one (the same rule as the DPP's first pick), otherwise the
    token with the largest distance to its nearest available neighbour (DivPrune's rule). ``conditional=True``
    keeps the anchor tokens in the picked set throughout. ``fallback`` is unused: ties (scores within
    ``FPS_TIE_EPS`` of the best) resolve to the lowest index.
    """
    fused = accel.fused(distance)
    first_score, nearest = _fps_start(distance, available, anchor, conditional, sync=not fused)
    if fused:
        from . import greedy_triton

        out = accel.kernel("fps", lambda: greedy_triton.farthest_point(
            distance, available, counts, first_score, nearest, _width(counts, steps), FPS_TIE_EPS))
        if out is not None:
            return out
    picks = _Picks(available, counts, steps)
    for k in range(picks.steps):
        j = near_tie_argmax(first_score if k == 0 else nearest, picks.free, FPS_TIE_EPS)
        picks.take(k, j)
        nearest = torch.minimum(nearest, _row(distance, j))
    return picks.out


def _fps_start(distance: torch.Tensor, available: torch.Tensor, anchor: torch.Tensor | None, conditional: bool,
               sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Farthest point sampling's first-pick score and initial distance to the picked set, both ``[B, N]``.

    ``sync=False`` skips the host-side test for an empty anchor (the result is the same, computed either way).
    """
    B, N, _ = distance.shape
    inf = float("inf")  # a Python scalar: a 0-d tensor made on the host would be a blocking copy to the device
    if anchor is not None and (not sync or bool(anchor.any())):
        to_anchor = distance.masked_fill(~anchor[:, None, :], inf).amin(dim=2)  # [B, N]
        has_anchor = anchor.any(dim=1)
    else:
        to_anchor = torch.full((B, N), float("inf"), device=distance.device)
        has_anchor = torch.zeros(B, dtype=torch.bool, device=distance.device)
    eye = torch.eye(N, dtype=torch.bool, device=distance.device)
    nn_dist = distance.masked_fill(eye | ~available[:, None, :], inf).amin(dim=2)  # [B, N] to nearest other
    first_score = torch.where(has_anchor[:, None], to_anchor, nn_dist)
    nearest = to_anchor.clone() if conditional else torch.full_like(to_anchor, float("inf"))
    return first_score, nearest


def facility_location(similarity: torch.Tensor, available: torch.Tensor, counts: torch.Tensor, *,
                      anchor: torch.Tensor | None = None, conditional: bool = False,
                      fallback: torch.Tensor | None = None, steps: int | None = None) -> torch.Tensor:
    """Greedy facility location: maximize ``F(S) = sum_{i in R} w_i max_{j in S} s_ij`` with uniform ``w``, ``R`` the
    available tokens (the paper's candidate set: what stage 1 left).

    ``similarity [B, N, N]`` must lie in [0, 1] (here ``clip((cos + 1) / 2, 0, 1)``); the clients ``i`` and the
    candidates ``j`` are the available tokens. The marginal gain of j is ``sum_i max(0, s_ij - cover_i)``; a token
    outside ``R`` starts covered (``cover_i = 1``), so it adds nothing. ``conditional=True`` starts ``cover`` from
    the anchor tokens. Gains within ``FL_TIE_EPS`` of the best (relative, of 1 below 1) tie, the lowest index
    winning. Once every gain is 0 the rest is filled by ``fallback`` (else raster order).
    """
    B, N, _ = similarity.shape
    cover = similarity.new_zeros(B, N)
    if conditional and anchor is not None:
        cover = similarity.masked_fill(~anchor[:, None, :], 0.0).amax(dim=2)
    cover = cover.masked_fill(~available, 1.0)  # not a client: s_ij <= 1 leaves it no gain to give
    order_fb = fallback_score(fallback, available)
    if accel.fused(similarity):
        from . import greedy_triton

        out = accel.kernel("fl", lambda: greedy_triton.facility_location(
            similarity, available, counts, cover, order_fb, _width(counts, steps), FL_TIE_EPS))
        if out is not None:
            return out
    picks = _Picks(available, counts, steps)
    for k in range(picks.steps):
        gain = (similarity - cover[:, :, None]).clamp_min(0).sum(dim=1)  # [B, N]: column j's gain
        _, best = masked_argmax(gain, picks.free)
        j = near_tie_argmax(gain, picks.free, FL_TIE_EPS * best.clamp_min(1.0)[:, None])
        j = torch.where(best <= 0, masked_argmax(order_fb, picks.free)[0], j)  # exhausted rows: fallback order
        picks.take(k, j)
        cover = torch.maximum(cover, _row(similarity, j))
    return picks.out
