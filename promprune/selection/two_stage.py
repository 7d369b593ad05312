"""PromPrune and its split ablations: saliency stage (top-k attention) + coverage stage (diversity selector).

Registered here: ``promprune`` (adaptive split from a prominence metric), ``fixed_ratio`` (Table 4, Fig. 1a / A1),
``saliency_only`` and ``coverage_only``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from . import accel, certified, graphed
from .budget import fixed_count, fixed_split, split_budget
from .diversity import GAIN_EPS, dpp_greedy, facility_location, fallback_score, farthest_point
from .entropy import attention_entropy, feature_norm_entropy
from .kernels import ranks_to_mask, stable_descending_order
from .registry import Selection, TokenSet, in_range, register_method

# mu = 0.42 was calibrated for CLIP encoders on the spectral entropy (Qwen2.5-VL's encoder: 0.5744, set by its
# adapter); tau = 0.02 makes the sigmoid go from 12% to 88% coverage over H in mu +- 0.04.
DEFAULT_MU = 0.42
DEFAULT_TAU = 0.02

DIVERSITY = ("dpp", "fps", "facility_location")
METRICS = ("spectral", "feature_norm", "attention")

_STAGE_OPTIONS = {"diversity": "dpp", "conditional": False}
_STAGE_CHOICES = {"diversity": DIVERSITY, "conditional": (False, True)}


def minmax(s: torch.Tensor) -> torch.Tensor:
    """Per-image min-max normalization of saliency ``[B, N]`` (a constant row maps to 0)."""
    lo, hi = s.amin(dim=1, keepdim=True), s.amax(dim=1, keepdim=True)
    return (s - lo) / (hi - lo).clamp_min(torch.finfo(s.dtype).tiny)


def coverage_picks(tokens: TokenSet, available: torch.Tensor, counts: torch.Tensor, anchor: torch.Tensor | None,
                   *, diversity: str, conditional: bool, width: int) -> torch.Tensor:
    """Stage 2 over the ``available`` tokens: ``[B, width]`` picks (-1 padded) by the chosen diversity selector;
    ``width`` >= ``counts.max()``."""
    if width == 0:  # saliency-only split: no kernel needed
        return counts.new_zeros(counts.shape[0], 0)
    fallback = tokens.saliency  # once gains hit 0, fill by saliency (raster order when there is none)
    stage = {"anchor": anchor, "conditional": conditional, "steps": width}
    if diversity == "dpp":
        return dpp_greedy(tokens.cosine, available, counts, fallback=fallback, **stage)
    if diversity == "fps":
        distance = (1.0 - tokens.cosine).clamp_min(0)
        return farthest_point(distance, available, counts, **stage)
    similarity = ((tokens.cosine + 1.0) / 2.0).clamp(0.0, 1.0)
    return facility_location(similarity, available, counts, fallback=fallback, **stage)


def two_stage(tokens: TokenSet, budget: int, t_sal: torch.Tensor, *, diversity: str, conditional: bool,
              method: str, entropy: torch.Tensor | None = None, fixed: int | None = None,
              host_counts: torch.Tensor | None = None) -> Selection:
    """Keep the ``t_sal[b]`` most salient tokens, then ``budget - t_sal[b]`` coverage tokens from the rest.

    ``fixed``: the ``t_sal`` every image shares when the host knows it (fixed splits), else None; ``host_counts``: the
    per-image ``t_sal`` when the host holds it already (the certified split). Without either, on the GPU fast path the
    stage sizes are bounded from what the host knows (``budget``) instead of read from the device.
    Returns indices in selection order: salient tokens by descending saliency, then coverage picks in pick order.
    """
    fused = _fused_stages(tokens, budget, t_sal, diversity=diversity, conditional=conditional, fixed=fixed)
    if fused is not None:
        return Selection(fused[0], t_sal, entropy, None, fused[1])
    B, N = tokens.batch, tokens.n
    pos = torch.arange(budget, device=tokens.x.device)[None, :]  # [1, T]
    if fixed is not None:
        sal_max, cov_max = fixed, budget - fixed
    elif host_counts is not None:
        sal_max, cov_max = int(host_counts.max()), int((budget - host_counts).max())
    elif accel.active(tokens.x):  # no host sync: the widest the stages can be
        sal_max, cov_max = budget, budget
    else:
        sal_max = int(t_sal.max())
        cov_max = int((budget - t_sal).max())
    if sal_max > 0:
        sal_order = stable_descending_order(minmax(tokens.require_saliency(method)))  # [B, N]
        anchor = ranks_to_mask(sal_order, t_sal)  # [B, N] stage-1 tokens
    else:
        sal_order = torch.arange(N, device=tokens.x.device).expand(B, N)
        anchor = torch.zeros(B, N, dtype=torch.bool, device=tokens.x.device)
    counts = budget - t_sal
    picks = coverage_picks(tokens, ~anchor, counts, anchor, diversity=diversity, conditional=conditional,
                           width=cov_max)
    from_cov = picks.gather(1, (pos - t_sal[:, None]).clamp(0, max(picks.shape[1] - 1, 0))) if picks.numel() else pos
    salient = pos < t_sal[:, None]  # [B, T]
    indices = torch.where(salient, sal_order[:, :budget], from_cov)
    return Selection(indices, t_sal, entropy, None, salient)


def _fused_stages(tokens: TokenSet, budget: int, t_sal: torch.Tensor, *, diversity: str, conditional: bool,
                  fixed: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``two_stage``'s ``(indices, salient)`` with a DPP coverage stage in two Triton launches on the fast path
    (``greedy_triton.salient_front``, then ``dpp_after_front``), where ~30 torch launches (the min-max, the sort, the
    masks, the first pick, the assembly) did it; the same tokens (the interpreted corpus' ``select-*`` cases). None
    where it does not apply (another selector, no saliency but for coverage alone, float64, a budget past the tokens,
    more tokens than one sort takes) or Triton cannot build it: ``two_stage``'s torch ops then run.

    Coverage alone (``fixed`` 0, no saliency: ``coverage_only``) takes it too, with the DPP's raster fallback order
    (``diversity.fallback_score``: ``-index``) standing in for the saliency: the front then takes no token and finds
    no first pick, and the DPP falls back in raster order, as ``two_stage``'s torch ops do without a saliency."""
    saliency = tokens.saliency
    raster = saliency is None and fixed == 0  # coverage alone: the DPP's raster fallback order for a saliency
    if diversity != "dpp" or not (raster or saliency is not None) or not accel.fused(tokens.x) \
            or (saliency is not None and saliency.dtype != torch.float32) or not budget <= tokens.n:
        return None
    from . import greedy_triton

    if tokens.n > greedy_triton.FRONT_MAX:
        return None
    coverage = fixed != budget  # a coverage stage to run (saliency-only has none, nor needs the cosine)
    kernel = tokens.cosine if coverage else None
    order = []  # the DPP's fallback order: the saliency itself (float32 here), as ``coverage_picks`` passes it

    def launch_front():
        order.append(fallback_score(None, tokens.x[:, :, 0]) if raster else saliency)  # [B, N]: -0, -1, -2, ...
        return greedy_triton.salient_front(order[0], t_sal, budget, None if conditional else kernel, GAIN_EPS)

    front = accel.kernel("front", launch_front)
    if front is None:
        return None
    if coverage:
        if accel.kernel("dpp", lambda: greedy_triton.dpp_after_front(kernel, front, t_sal, order[0], conditional,
                                                                      GAIN_EPS)) is None:
            return None
    return front[0], front[1]


def known_split(tokens: TokenSet, count) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``certified_split``'s ``(t_sal, entropy, halfwidth)`` (host tensors), where the caller may have bracketed the
    rows' entropies already (``tokens.entropy_bounds``: ``adaptive_views``' shares, ``batched_select``): the rows
    whose interval decides (``certified.known_counts``: widened for the other matrix this method's exact route
    eigensolves) take its ``t_sal``, the exact route's, with no Lanczos stage, no eigensolve and no read; the others
    go through ``certified_split``: all of the rows (nothing gathered) where none decided, else those alone, gathered
    (a few launches: their indices, tokens and Gram rows, against stages and perhaps an eigensolve of every decided
    row), their spectral matrix cut from the bucket's own (``tokens.unit_gram``'s rows: the exact route's bits,
    whatever the batch). The report (``certified.LAST_REPORT``) counts the decided rows as ``known``."""
    bounds = tokens.entropy_bounds
    if bounds is None:
        return certified_split(tokens, count)
    decided, t_sal, entropy, halfwidth = certified.known_counts(bounds, count, min(tokens.n, tokens.dim))
    known = int(decided.sum())
    if not known:
        return certified_split(tokens, count)
    t_sal, entropy, halfwidth = t_sal.astype(np.int64), entropy.astype(np.float32), halfwidth.astype(np.float32)
    if known < tokens.batch:
        rows = np.flatnonzero(~decided)
        rest = certified_split(tokens, count, rows=rows, known=known)
        for out, part in zip((t_sal, entropy, halfwidth), rest):
            out[rows] = part.numpy()
    else:
        certified.publish(certified.SplitReport(known=known))
    return torch.from_numpy(t_sal), torch.from_numpy(entropy), torch.from_numpy(halfwidth)


def certified_split(tokens: TokenSet, count, rows: np.ndarray | None = None,
                    known: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``certified.split`` of the tokens' spectral matrix: for N <= d that is their centered unit Gram, so the split
    gets the shared Gram and centers it inside its first stage (one CUDA graph with the Lanczos steps); where that
    stage replays as a graph (``graphed.fits``), the graph forms the Gram itself from the tokens (``_opening``).
    ``rows``: split only these rows (host indices; ``known_split``), their Gram or spectral matrix cut from the whole
    batch's; ``known``: the rows decided without it, for the report."""
    x, source, matrix = tokens.x, tokens.half_source, None
    if rows is not None:
        index = torch.from_numpy(rows).to(x.device, non_blocking=True)
        x, source = x[index], None if source is None else source[index]
        matrix = (lambda: tokens.unit_gram[index]) if tokens.n <= tokens.dim else tokens.spectral_matrix[index]
    if tokens.n <= tokens.dim:
        gram = (lambda: tokens.unit_gram) if matrix is None else matrix
        if graphed.fits(x, x.shape[0] * tokens.n ** 2):
            return certified.split(gram, count, tokens=x, opening_with=(_opening, (x, source)), known=known)
        return certified.split(gram(), count, tokens=x, known=known)
    return certified.split(tokens.spectral_matrix if matrix is None else matrix, count, known=known)


def _graphs_fit(tokens: TokenSet) -> bool:
    """Whether PromPrune's stages on these tokens replay as CUDA graphs (``graphed.fits``: their ``[B, N, N]`` Gram)."""
    return graphed.fits(tokens.x, tokens.batch * tokens.n ** 2)


def _opening(x: torch.Tensor, source: torch.Tensor | None, steps: int) -> tuple[torch.Tensor, ...]:
    """The certified split's first stage from the tokens ``x [B, N, d]`` (N <= d; ``source``: their fp16 / bf16 form
    or None): their unit Gram as ``TokenSet.unit_gram`` forms it, then ``certified.opening_from_gram``. One graph."""
    return certified.opening_from_gram(TokenSet(x, None, source=source).unit_gram, steps)


def _picking(x: torch.Tensor, source: torch.Tensor | None, saliency: torch.Tensor, t_sal: torch.Tensor,
             static: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """PromPrune's two stages after its split, from the tokens, their saliency and the per-image ``t_sal [B]`` on the
    device: ``(indices [B, T], salient [B, T])`` as ``two_stage`` gives them. The stages are as wide as the budget
    (the picks past each image's count are never read), so one graph serves every split of a shape.
    ``static``: ``(budget, diversity, conditional)``."""
    budget, diversity, conditional = static
    sel = two_stage(TokenSet(x, saliency, source=source), budget, t_sal, diversity=diversity, conditional=conditional,
                    method="promprune")
    return sel.indices, sel.salient


def prominence(tokens: TokenSet, metric: str) -> torch.Tensor:
    """The prominence metric ``[B]`` that drives the adaptive split."""
    if metric == "spectral":
        return tokens.spectral_entropy
    if metric == "feature_norm":
        return feature_norm_entropy(tokens.x)
    return attention_entropy(tokens.require_saliency("promprune (metric='attention')"))


@register_method(
    "promprune", needs_saliency=True,
    options={"mu": DEFAULT_MU, "tau": DEFAULT_TAU, "metric": "spectral", "rounding": "half_even",
             "saliency_ratio_range": (0.0, 1.0), **_STAGE_OPTIONS},
    choices={"metric": METRICS, "rounding": ("half_even", "floor"), **_STAGE_CHOICES},
    check=lambda o, budget=None: (in_range("tau", 0.0, math.inf, low_open=True)(o),
                                  _ratio_range(o["saliency_ratio_range"])))
def promprune(tokens: TokenSet, budget: int, *, mu: float, tau: float, metric: str, rounding: str,
              saliency_ratio_range, diversity: str, conditional: bool) -> Selection:
    """PromPrune: split the budget by spectral entropy, then saliency top-k + DPP coverage."""
    kr_min, kr_max = _ratio_range(saliency_ratio_range)

    def count(entropy: torch.Tensor) -> torch.Tensor:
        return split_budget(entropy, budget, mu=mu, tau=tau, ratio_range=(kr_min, kr_max), rounding=rounding)

    if metric == "spectral" and certified.applies(min(tokens.n, tokens.dim), tokens.x):
        t_sal, entropy, halfwidth = known_split(tokens, count)  # host values, the exact algorithm's counts
        on_device = t_sal.to(tokens.x.device, non_blocking=True)
        entropy = entropy.to(tokens.x.device, non_blocking=True)  # (the half-widths stay on the host: no copy)
        if _graphs_fit(tokens):  # both stages in one graph per shape and options
            indices, salient = graphed.replay(_picking, (tokens.x, tokens.half_source, tokens.saliency, on_device),
                                              (budget, diversity, conditional))
            return Selection(indices, on_device, entropy, None, salient, entropy_halfwidth=halfwidth)
        sel = two_stage(tokens, budget, on_device, diversity=diversity, conditional=conditional, method="promprune",
                        entropy=entropy, host_counts=t_sal)
        return dataclasses.replace(sel, entropy_halfwidth=halfwidth)
    entropy = prominence(tokens, metric)
    return two_stage(tokens, budget, count(entropy).to(tokens.x.device), diversity=diversity, conditional=conditional,
                     method="promprune", entropy=entropy.float())


def _ratio_range(value) -> tuple[float, float]:
    try:
        kr_min, kr_max = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"option 'saliency_ratio_range' must be a pair (kr_min, kr_max), got {value!r}") from None
    if not 0.0 <= kr_min <= kr_max <= 1.0:
        raise ValueError(f"option 'saliency_ratio_range' needs 0 <= kr_min <= kr_max <= 1, got {value!r}")
    return kr_min, kr_max


def _fixed(tokens: TokenSet, budget: int, ratio: float, method: str, diversity: str, conditional: bool) -> Selection:
    t_sal = fixed_split(tokens.batch, budget, float(ratio), tokens.x.device)
    return two_stage(tokens, budget, t_sal, diversity=diversity, conditional=conditional, method=method,
                     fixed=fixed_count(budget, float(ratio)))


@register_method("fixed_ratio", needs_saliency=True, options={"saliency_ratio": 0.5, **_STAGE_OPTIONS},
                 choices=_STAGE_CHOICES, check=in_range("saliency_ratio", 0.0, 1.0))
def fixed_ratio(tokens: TokenSet, budget: int, *, saliency_ratio: float, diversity: str,
                conditional: bool) -> Selection:
    """Fixed split: round(saliency_ratio * T) salient tokens, the rest by the diversity selector."""
    return _fixed(tokens, budget, saliency_ratio, "fixed_ratio", diversity, conditional)


@register_method("saliency_only", needs_saliency=True)
def saliency_only(tokens: TokenSet, budget: int) -> Selection:
    """The T tokens with the highest saliency."""
    return _fixed(tokens, budget, 1.0, "saliency_only", "dpp", False)


@register_method("coverage_only", needs_saliency=False, options={"diversity": "dpp"},
                 choices={"diversity": DIVERSITY})
def coverage_only(tokens: TokenSet, budget: int, *, diversity: str) -> Selection:
    """T tokens by the diversity selector alone (DPP by default)."""
    return _fixed(tokens, budget, 0.0, "coverage_only", diversity, False)
