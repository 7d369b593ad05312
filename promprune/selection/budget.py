"""The budget split: how many of the T kept tokens come from saliency and how many from coverage."""
from __future__ import annotations

import torch

# The logit is clamped so sigmoid saturates cleanly instead of under/overflowing (reference implementation).
LOGIT_CLAMP = 20.0


def saliency_ratio(entropy: torch.Tensor, mu: float, tau: float,
                   ratio_range: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """Adaptive saliency ratio ``kr_min + (1 - sigmoid((H - mu) / tau)) (kr_max - kr_min)``: ``[B] -> [B]`` float64.

    Concentrated meaning (low H) gives a high ratio (mostly salient tokens); spread-out meaning (high H) a low one.
    """
    kr_min, kr_max = ratio_range
    s = _sigmoid_logit(entropy, mu, tau)
    return kr_min + (1.0 - s) * (kr_max - kr_min)


def _sigmoid_logit(entropy: torch.Tensor, mu: float, tau: float) -> torch.Tensor:
    z = ((entropy.double() - mu) / tau).clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
    return torch.sigmoid(z)


def split_budget(entropy: torch.Tensor, budget: int, *, mu: float, tau: float,
                 ratio_range: tuple[float, float] = (0.0, 1.0), rounding: str = "half_even") -> torch.Tensor:
    """Per-image saliency-stage token count ``T_sal [B]`` (long); ``T_cov = budget - T_sal``.

    ``rounding="half_even"`` (released code): ``T_sal = round_half_even(ratio * T)`` clipped to [0, T].
    ``rounding="floor"`` (paper's literal formula): ``T_cov = floor(T * cov_ratio)`` with
    ``cov_ratio = 1 - ratio``, which is ``sigmoid(z)`` under the default range.
    """
    if rounding == "half_even":
        t_sal = torch.round(saliency_ratio(entropy, mu, tau, ratio_range) * budget)  # torch.round: half to even
    elif rounding == "floor":
        kr_min, kr_max = ratio_range
        cov_ratio = (1.0 - kr_max) + _sigmoid_logit(entropy, mu, tau) * (kr_max - kr_min)
        t_sal = budget - torch.floor(cov_ratio * budget)
    else:
        raise ValueError(f"rounding must be 'half_even' or 'floor', got {rounding!r}")
    return t_sal.clamp(0, budget).long()


def fixed_count(budget: int, ratio: float) -> int:
    """The saliency-stage count of a fixed split: ``round_half_even(ratio * T)`` clipped to [0, T]."""
    return min(max(round(ratio * budget), 0), budget)  # Python's round is half-to-even too


def fixed_split(batch: int, budget: int, ratio: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``T_sal [B]`` for a fixed saliency ratio: ``fixed_count(T, ratio)`` for every image."""
    return torch.full((batch,), fixed_count(budget, ratio), dtype=torch.long, device=device)
