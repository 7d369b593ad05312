"""Registry entries of the in-LLM baselines, FastV, SparseVLM, DART and PyramidDrop: their options and checks.

They prune inside the language model, so ``select`` does not run them; their decoder-layer hooks are
``promprune.models.llm_hooks``'s (this module stays free of model code).
"""
from __future__ import annotations

from .registry import check_layers, register_in_llm_method


def _check_layer(method: str, layer) -> None:
    """FastV's and DART's option 'layer': None (K = 2 of 32 layers scaled to the LLM's depth) or an absolute K."""
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 1):
        raise ValueError(f"option 'layer' of {method} must be None (the paper's K = 2 of 32 layers scaled to the "
                         f"LLM's depth) or an int >= 1 (an absolute K), got {layer!r}")


def _check_fastv(opts: dict, budget: int | None = None) -> None:
    _check_layer("fastv", opts["layer"])


# SparseVLM's released schedule (Gumpest/SparseVLMs, score.py): visual tokens kept after each of its three pruning
# layers (2, 6, 15 of LLaMA's 32: cuts before 3, 7, 16) for each budget it ships. A budget is the layer-averaged token
# count, not the count after the last layer (64 ends at 17 tokens). There is no 32-token schedule.
SPARSEVLM_RELEASED = {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}


def _check_sparsevlm(opts: dict, budget: int | None = None) -> None:
    layers = opts["layers"]
    check_layers("sparsevlm", layers)
    if opts["schedule"] == "released":
        if layers is not None and len(layers) != 3:
            raise ValueError(f"sparsevlm's released schedule prunes at three layers; option 'layers' has {layers!r}")
        if budget is not None and budget not in SPARSEVLM_RELEASED:
            raise ValueError(f"sparsevlm's released schedule has budgets {sorted(SPARSEVLM_RELEASED)}, not {budget}; "
                             "use schedule='geometric' for other budgets")
    for key in ("recycle_ratio", "merge_ratio"):
        value = opts[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"option {key!r} of sparsevlm must be a number in [0, 1], got {value!r}")


# FastV (Chen et al., ECCV 2024): K = 2 of LLaMA's 32 layers is the paper's default pruning layer; the attention of
# layer K - 1 (the last token's row, head mean) ranks the visual tokens. layer=None keeps that fraction of the depth,
# as SparseVLM's and PyramidDrop's layers do (round(2 * depth / 32), at least 1: K = 2 on every 7B LLM here, 28-36
# layers; K = 1 on the testbed's 4); an int is an absolute K (the released K on any depth: layer=2).
register_in_llm_method("fastv", options={"layer": None}, check=_check_fastv,
                       description="FastV: drop visual tokens after layer K by the last token's attention")

# SparseVLM (Zhang et al., ICML 2025; Gumpest/SparseVLMs@26a5f48, USE_VERSION 1_0, its default): at each of its
# pruning layers 2, 6 and 15 of LLaMA's 32 (`pruning_loc`) the layer runs on every token, its own attention from the
# raters ranks the visual tokens, and its output is pruned: the cuts are before layers 3, 7 and 16. Option 'layers'
# names the layers cut before, as PyramidDrop's does (the released pruning_loc is layers=[3, 7, 16]); layers=None
# scales the released ones to the depth. 30% of each stage's deleted tokens are recycled into merged tokens, one
# merged token per 10 recycled (its paper's tau and theta).
# schedule "geometric" (ours): from all tokens to exactly `budget` after the last pruning layer, geometric in between
# (a stronger baseline than the released one at equal budget); "released": SPARSEVLM_RELEASED.
# positions "released": the released code renumbers the kept sequence contiguously at every cut and decodes from each
# layer's cache length (LLaMA's 1D RoPE); on M-RoPE (no released path) tokens keep their positions; "original": keep
# them everywhere (its USE_VERSION 2_0 "keep position id").
register_in_llm_method("sparsevlm", options={"layers": None, "recycle_ratio": 0.3, "merge_ratio": 0.1,
                                             "schedule": "geometric", "positions": "released"},
                       choices={"schedule": ("geometric", "released"), "positions": ("released", "original")},
                       check=_check_sparsevlm,
                       description="SparseVLM: text-guided pruning at several layers with token recycling")


BUDGET_SEMANTICS = ("exact", "released")


def _check_int(method: str, key: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"option {key!r} of {method} must be an int >= {low}, got {value!r}")


def _check_dart(opts: dict, budget: int | None = None) -> None:
    _check_layer("dart", opts["layer"])
    _check_int("dart", "pivot_image", opts["pivot_image"], 1)
    _check_int("dart", "pivot_text", opts["pivot_text"], 0)
    if budget is not None and budget < opts["pivot_image"]:
        raise ValueError(f"dart keeps its {opts['pivot_image']} image pivots: budget {budget} is smaller; lower "
                         "option 'pivot_image'")


# DART (Wen et al., EMNLP 2025; ZichenWen1/DART, LLaVA scripts: K=2, 4 image + 4 text pivots): at layer K, pivot
# tokens are the visual tokens and the text tokens after the image with the largest L1 norm of their keys (layer
# K-1's attention, after the rotary embedding); each pivot in turn takes the not yet kept visual tokens least
# cosine-similar to it (hidden states through the LLM's final norm). Kept tokens keep their positions (FastV-like).
# layer=None: K = 2 of 32 scaled to the depth, as FastV's (2 on every 7B LLM here, 1 on the testbed's 4 layers);
# an int is an absolute K (layer=2: the released K on any depth).
# budget_semantics "exact": image pivots + picks = budget; "released": the released count for max_num_trunction =
# budget, i.e. pivot_image + (pivot_image + pivot_text) * (budget // (pivot_image + pivot_text)) (132 at 128).
register_in_llm_method("dart", options={"layer": None, "pivot_image": 4, "pivot_text": 4, "budget_semantics": "exact"},
                       choices={"budget_semantics": BUDGET_SEMANTICS}, check=_check_dart,
                       description="DART: keep the visual tokens least similar to pivot tokens at layer K")


def _check_pyramiddrop(opts: dict, budget: int | None = None) -> None:
    ratio = opts["ratio"]
    check_layers("pyramiddrop", opts["layers"])
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ValueError(f"option 'ratio' of pyramiddrop (lambda) must be a number in (0, 1), got {ratio!r}")


# PyramidDrop (Xing et al., CVPR 2025; Cooperx521/PyramidDrop, LLaVA-1.5: layer_list [8, 16, 24] of 32, lambda 0.5):
# after each stage layer the visual tokens are ranked by the attention the last instruction token pays them
# (computed with the NEXT layer's query/key projections on its input-normed hidden states) and the top ones kept.
# layers=None: 8, 16, 24 as fractions of the depth. budget_semantics "exact": lambda-geometric counts ending at exactly
# `budget` after the last stage (budget / lambda^(S - s) after stage s, capped at N); "released": the released rule
# int(N lambda^s) with lambda set so that the visual-token count averaged over all layers equals the budget (the way
# PyramidDrop and SparseVLM report budgets; the option 'ratio' is then not used), floored as released: a small budget
# can leave a late stage no visual token (llm_hooks warns). positions "released": the released
# code renumbers the kept sequence contiguously (LLaMA's 1D RoPE); on Qwen2.5-VL's / Qwen3-VL's M-RoPE (no released
# path) tokens keep their original positions; "original": keep them everywhere (FastV-like).
register_in_llm_method("pyramiddrop", options={"layers": None, "ratio": 0.5, "budget_semantics": "exact",
                                               "positions": "released"},
                       choices={"budget_semantics": BUDGET_SEMANTICS, "positions": ("released", "original")},
                       check=_check_pyramiddrop,
                       description="PyramidDrop: staged dropping by the last instruction token's attention")
