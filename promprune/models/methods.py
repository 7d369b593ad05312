"""Method names and options the adapters accept, validated without loading a model.

Methods and their options come from one registry (``promprune.methods(None)``, ``promprune.method_spec``): the
pre-LLM methods ``select`` runs and the in-LLM ones (``fastv``, ``sparsevlm``) that prune inside the language model.
Beside them, the adapter options are valid with every method: how LLaVA-NeXT spreads the budget over views, what
happens to its ``image_newline`` tokens, which Qwen2.5-VL vision block gives saliency, and a fixed Qwen token count.
"""
from __future__ import annotations

from typing import Any

import promprune

# Adapter options, valid with every method (ignored by architectures they do not concern).
ADAPTER_OPTIONS: dict[str, Any] = {
    # LLaVA-NeXT: "per_crop" splits the budget evenly over the views like the released code and VisPruner.
    "budget_mode": "per_crop",
    # LLaVA-NeXT: "drop" feeds no image_newline tokens once pruned (so the LLM gets exactly `budget` visual tokens);
    # "rows" keeps a row's newline when any token of that row is kept (extra tokens, not counted by the budget).
    "image_newline": "drop",
    # Qwen2.5-VL: index of the full-attention vision block whose attention gives saliency; None = the last one.
    "saliency_block": None,
    # Qwen2.5-VL: a fixed number of merged visual tokens per image (the paper: 1296 = 36 x 36); must be a square.
    # None keeps the processor's resolution-dependent count.
    "image_tokens": None,
    # The order of the kept tokens in the LLM's input (pre-LLM methods; each token keeps its own position embedding
    # on Qwen2.5-VL, its place in the sequence on LLaVA): "raster" (ascending grid index: spatial order), "selection"
    # (as picked: salient by descending saliency, then coverage in pick order), "stages" (salient tokens ascending,
    # then the rest ascending), or "released": what each method's released code feeds its LLM (RELEASED_ORDER).
    "token_order": "raster",
}
ADAPTER_CHOICES = {"budget_mode": ("per_crop", "global", "adaptive_views"), "image_newline": ("drop", "rows"),
                   "token_order": ("raster", "selection", "stages", "released")}

# The token order of each method's released code (read in the authors' repositories; README: "What each method
# feeds the LLM"). PromPrune concatenates its stage-1 top-k and its stage-2 DPP picks without re-sorting; VisionZip
# emits its dominant tokens in index order, then its contextual ones; DivPrune, VisPruner, FastV and SparseVLM
# re-sort to index order. Methods not listed (our ablations of PromPrune's stages) follow PromPrune.
RELEASED_ORDER = {"promprune": "selection", "fixed_ratio": "selection", "saliency_only": "selection",
                  "coverage_only": "selection", "visionzip": "stages", "divprune": "raster", "vispruner": "raster",
                  "random": "raster"}


def token_order(method: str | None, option: str) -> str:
    """The order the adapter feeds the kept tokens in: ``option``, with "released" resolved for ``method``."""
    if option != "released":
        return option
    return RELEASED_ORDER.get(method, "raster")

# Prominence threshold mu per vision encoder: 0.42 was calibrated on CLIP ViT-L/14 features, 0.5744 on Qwen2.5-VL's.
DEFAULT_MU = {"clip": 0.42, "qwen2_5_vl": 0.5744}


def all_methods() -> list[str]:
    """Every method name an adapter runs: the whole registry, pre-LLM and in-LLM."""
    return promprune.methods(stage=None)


def is_in_llm(method: str | None) -> bool:
    """Whether ``method`` prunes inside the LLM (False for None, the unpruned model)."""
    return method is not None and promprune.method_spec(method).stage == promprune.IN_LLM


def validate_method(method: str | None, budget: int | None = None, **options) -> tuple[dict, dict]:
    """Check a method name, budget and options up front; returns ``(method_options, adapter_options)``.

    ``method_options`` are the given method options (defaults are filled in later, so ``mu`` can default per
    encoder); ``adapter_options`` are the adapter options with defaults filled in. ``method=None`` means unpruned:
    then no budget and no method options are allowed. Errors are ValueErrors naming the bad field and listing the
    valid values.
    """
    adapter = {k: options.pop(k) for k in list(options) if k in ADAPTER_OPTIONS}
    adapter = {**ADAPTER_OPTIONS, **adapter}
    for key, allowed in ADAPTER_CHOICES.items():
        if adapter[key] not in allowed:
            raise ValueError(f"option {key!r} must be one of {list(allowed)}, got {adapter[key]!r}")
    _check_image_tokens(adapter["image_tokens"])
    if adapter["image_newline"] == "rows" and token_order(method, adapter["token_order"]) != "raster":
        raise ValueError("option image_newline='rows' places each row's newline after the row's kept tokens, which "
                         "needs token_order 'raster'; use image_newline='drop' with another token order")
    if method is None:
        if budget is not None or options:
            raise ValueError(f"method=None (unpruned) takes no budget or method options; got budget={budget!r}, "
                             f"options={sorted(options)}")
        return {}, adapter
    spec = promprune.method_spec(method)  # an unknown name: ValueError with did-you-mean and every method
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive int for method {method!r}, got {budget!r}")
    spec.resolve(options, also_valid=ADAPTER_OPTIONS, budget=budget)  # names, choices, the method's own checks
    return dict(options), adapter


def _check_image_tokens(n) -> None:
    if n is None:
        return
    side = int(round(n ** 0.5)) if isinstance(n, int) and n > 0 else 0
    if isinstance(n, bool) or side * side != n:
        raise ValueError(f"option 'image_tokens' must be a positive perfect square (e.g. 1296 = 36^2), got {n!r}")
