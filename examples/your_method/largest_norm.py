"""A pruning method of your own, from outside promprune: keep the tokens of largest feature norm.

A pre-LLM method is one function, ``fn(tokens, budget, **options) -> promprune.Selection``, registered under a
name; importing this file registers it. ``tokens.x [B, N, d]`` holds the projected visual tokens (float32; float64
features stay float64; also ``tokens.saliency [B, N]`` when registered with ``needs_saliency=True``); the function
returns, for each image, ``budget`` distinct token indices. A sweep imports it with ``plugins: [largest_norm.py]``.
"""
import torch

import promprune


def _check(options: dict, budget: int | None = None) -> None:
    if options["p"] < 1:
        raise ValueError(f"option 'p' of largest_norm must be >= 1 (a norm), got {options['p']!r}")


@promprune.register_method("largest_norm", options={"p": 2.0}, check=_check)
def largest_norm(tokens, budget: int, *, p: float) -> promprune.Selection:
    """The ``budget`` tokens of largest L-p norm (ties: the lower index)."""
    norms = tokens.x.norm(p=p, dim=-1)  # [B, N]
    kept = norms.argsort(dim=1, descending=True, stable=True)[:, :budget]  # [B, T], largest first
    none = torch.zeros(tokens.batch, dtype=torch.long, device=kept.device)  # no token came from a saliency stage
    return promprune.Selection(kept, saliency_count=none, salient=torch.zeros_like(kept, dtype=torch.bool))
