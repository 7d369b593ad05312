"""Method names and options the adapters accept, validated without loading a model.

Three kinds of names and options meet here:

- pre-LLM methods: everything in ``promprune.methods()``; their options are ``promprune.method_spec(m).options``;
- in-LLM methods: ``fastv`` and ``sparsevlm`` (pruning inside the language model, see ``in_llm.py``);
- adapter options, valid with every method: how LLaVA-NeXT spreads the budget over views, what happens to its
  ``image_newline`` tokens, which Qwen2.5-VL vision block gives saliency, and a fixed Qwen token count.
"""
from __future__ import annotations

import difflib
from typing import Any

import promprune

# In-LLM methods and their option defaults.
IN_LLM_METHODS: dict[str, dict[str, Any]] = {
    # FastV (Chen et al., ECCV 2024): K = 2 is the paper's default pruning layer; the attention of layer K - 1
    # (the last token's row, head mean) ranks the visual tokens.
    "fastv": {"layer": 2},
    # SparseVLM (Zhang et al., ICML 2025): the released code prunes at LLaMA layers 2, 6 and 15 of 32; on other
    # depths we keep those fractions. 30% of each stage's deleted tokens are recycled into merged tokens, one merged
    # token per 10 recycled (its paper's tau and theta).
    "sparsevlm": {"layers": None, "recycle_ratio": 0.3, "merge_ratio": 0.1},
}

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
}
ADAPTER_CHOICES = {"budget_mode": ("per_crop", "global", "adaptive_views"), "image_newline": ("drop", "rows")}

# Prominence threshold mu per vision encoder: 0.42 was calibrated on CLIP ViT-L/14 features, 0.5744 on Qwen2.5-VL's.
DEFAULT_MU = {"clip": 0.42, "qwen2_5_vl": 0.5744}


def all_methods() -> list[str]:
    """Every method name an adapter runs: ``promprune.methods()`` (pre-LLM) plus the in-LLM ones."""
    return sorted(promprune.methods()) + sorted(IN_LLM_METHODS)


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    if method is None:
        if budget is not None or options:
            raise ValueError(f"method=None (unpruned) takes no budget or method options; got budget={budget!r}, "
                             f"options={sorted(options)}")
        return {}, adapter
    valid = all_methods()
    if method not in valid:
        raise ValueError(f"unknown method {method!r}{_did_you_mean(method, valid)}; valid methods: {', '.join(valid)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive int for method {method!r}, got {budget!r}")
    defaults = IN_LLM_METHODS[method] if method in IN_LLM_METHODS else promprune.method_spec(method).options
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        valid_opts = sorted(set(defaults) | set(ADAPTER_OPTIONS))
        hints = ", ".join(f"{u!r}{_did_you_mean(u, valid_opts)}" for u in unknown)
        raise ValueError(f"unknown option(s) for method {method!r}: {hints}; valid options: {', '.join(valid_opts)}")
    if method in IN_LLM_METHODS:
        _check_in_llm(method, {**defaults, **options})
    else:
        promprune.method_spec(method).resolve(options)  # value checks (choices) by the core library
    return dict(options), adapter


def _check_image_tokens(n) -> None:
    if n is None:
        return
    side = int(round(n ** 0.5)) if isinstance(n, int) and n > 0 else 0
    if isinstance(n, bool) or side * side != n:
        raise ValueError(f"option 'image_tokens' must be a positive perfect square (e.g. 1296 = 36^2), got {n!r}")


def _check_in_llm(method: str, opts: dict) -> None:
    if method == "fastv" and (not isinstance(opts["layer"], int) or opts["layer"] < 1):
        raise ValueError(f"option 'layer' of fastv must be an int >= 1, got {opts['layer']!r}")
    if method == "sparsevlm":
        layers = opts["layers"]
        if layers is not None and (not layers or any(not isinstance(x, int) or x < 1 for x in layers)):
            raise ValueError(f"option 'layers' of sparsevlm must be None or a list of ints >= 1, got {layers!r}")
        for key in ("recycle_ratio", "merge_ratio"):
            if not 0.0 <= float(opts[key]) <= 1.0:
                raise ValueError(f"option {key!r} of sparsevlm must be in [0, 1], got {opts[key]!r}")
