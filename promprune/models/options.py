"""Method names and options the adapters accept, validated without loading a model.

Methods and their options come from one registry (``promprune.methods(None)``, ``promprune.method_spec``): the pre-LLM
methods ``select`` runs and the in-LLM ones (``fastv``, ``sparsevlm``, ``dart``, ``pyramiddrop``) that prune inside the
language model. Beside them, the adapter options are valid with every method: how LLaVA-NeXT spreads the budget over
views, what happens to its ``image_newline`` tokens and to the picks in its padding, which Qwen2.5-VL vision block
gives saliency, and a fixed Qwen token count.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import promprune
from promprune.selection.registry import as_budget, in_llm_hooks_problem

class OptionError(ValueError):
    """A ValueError about one option (``option``: its name), so a caller can say which field of a spec set it."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


# Adapter options, valid with every method (ignored by architectures they do not concern).
ADAPTER_OPTIONS: dict[str, Any] = {
    # Families whose image gives several views (``VisualItem.groups``): how the budget meets them (LLaVA-NeXT's and
    # LLaVA-OneVision's base view and crops, InternVL's tiles and thumbnail; each family's module says what its views
    # are).
    # "per_crop": split evenly over the image's views (our choice for PromPrune: its released code has no working
    #   NeXT path); "global": one selection over every view; "adaptive_views": shares by each view's entropy;
    # "view_quota": every view gets budget // (1 + the most crops of any grid pinpoint), budget 160 -> 32 per view
    #   on llava-v1.6 (5 views), whatever the image's view count, selected on the view's full grid, padding
    #   included; with "unpad" True the model's unpadding then drops the picks in the padding, with False they are
    #   fed (VisPruner's, CDPruner's and VisionZip's released code: `visual_token_num` per view, nothing unpadded);
    # "packed": one selection over the whole packed sequence, image_newline tokens included as candidates
    #   (DivPrune's released code; for methods that need neither saliency nor the vision tower's features);
    # "released": each method's released NeXT layout (RELEASED_NEXT), "per_crop" for methods without one.
    "budget_mode": "per_crop",
    # LLaVA-NeXT: "drop" feeds no image_newline tokens once pruned (so the LLM gets exactly `budget` visual tokens);
    # "rows" keeps a row's newline when any token of that row is kept; "all" keeps every newline token, as the
    # unpruned sequence has them; both extra tokens, not counted by the budget.
    # budget_mode "packed" selects among the newline tokens instead, and "released" sets this per method.
    "image_newline": "drop",
    # LLaVA-NeXT, pre-LLM methods under budget_mode "view_quota": True: the model's own packing (transformers'
    # `pack_image_features`) unpads the stitched crop grid to the image's aspect ratio, so the picks in its padding
    # are not fed. False: LLaVA's "spatial" merge without "_unpad", as VisPruner's and CDPruner's released code runs
    # llava-v1.6 (each strips "_unpad" from `mm_patch_merge_type`; VisionZip's replaces the unpadding with its own
    # restore_image_features_sorted, which neither unpads nor adds a newline): every pick on every view's whole grid
    # is fed, padding included, no image_newline token, the base view's picks first, then the crops' in the raster
    # order of their stitched grid (with token_order "stages": VisionZip's released layout, see token_order); the
    # placeholder run grows where that feeds more tokens than the unpadded prompt holds.
    # False needs budget_mode "view_quota" and image_newline "drop"; budget_mode "released" sets it per method. The
    # unpruned model, the in-LLM methods and the other families feed their model's own packing whatever it says.
    "unpad": True,
    # The vision layer whose attention gives saliency, on families that take one (each family's module says which
    # layers it accepts; e.g. Qwen2.5-VL a full-attention block, Qwen3-VL any block, InternVL any InternViT layer);
    # None = the family's default (the layer whose output the LLM reads, or the last). LLaVA, LLaVA-NeXT and
    # LLaVA-OneVision take none (saliency at `vision_feature_layer`, the paper's protocol) and refuse one set.
    "saliency_block": None,
    # CDPruner on CLIP-based models (LLaVA, LLaVA-NeXT): the CLIP checkpoint whose text tower and visual projection
    # embed the question; None: the model config's `promprune_clip_text` (the tiny models: "tiny", a seeded random
    # CLIP sized to their vision tower), else openai/clip-vit-large-patch14-336 (the released code's).
    "clip_text": None,
    # Native-resolution families with a merged token grid (Qwen2.5-VL and the families whose adapter derives from its
    # own): a fixed number of merged visual tokens per image (the paper: 1296 = 36 x 36); must be a square.
    # None keeps the processor's resolution-dependent count.
    "image_tokens": None,
    # The order of the kept tokens in the LLM's input (pre-LLM methods; each token keeps its own position embedding
    # on Qwen2.5-VL, its place in the sequence on LLaVA): "raster" (ascending grid index: spatial order), "selection"
    # (as picked: salient by descending saliency, then coverage in pick order), "stages" (salient tokens ascending,
    # then the rest ascending; several views one after the other, every view's CLS first, except LLaVA-NeXT with
    # unpad False: VisionZip's released layout, the base view's CLS, salient and other tokens, then the crops'
    # salient tokens in their stitched grid's raster order, the crops' CLS tokens, each crop's other tokens crop
    # after crop), or "released": what each method's released code feeds its LLM (RELEASED_ORDER).
    "token_order": "raster",
    # Video (the families whose adapter handles clips, promprune.models.video.video_families()): how the budget meets
    # a clip's frames (Qwen: its temporal patches of 2 frames). "per_frame": split evenly over the frames (each frame
    # one selection); "clip": one selection over every frame's tokens (refused with a grid method, one that pools a
    # view's token grid: downsample; validate_method); "adaptive_frames": shares by each frame's spectral entropy.
    "video_budget": "per_frame",
    # Video, PromPrune: where its entropy and saliency/coverage split come from. "unit": each selection of
    # video_budget (per frame, or over the clip); "clip": the clip's entropy splits every frame's share (with
    # video_budget per_frame / adaptive_frames); "per_frame": each frame's entropy splits its even share of the budget
    # and the clip's saliency count is their sum, selected over the clip (with video_budget "clip"). Other than
    # "unit" it is refused with every other method, pre-LLM or in-LLM (validate_method); unpruned ignores it.
    "video_split": "unit",
    # Chat templates with a reasoning switch (Qwen3.5's): passed to the template as enable_thinking. None: the
    # template's default (Qwen3.5-4B and larger think first, as lmms-eval 0.7.3's qwen3_5 model runs them); False: the
    # empty think block, the answer at once (short-answer benchmarks: the Qwen3.5 sweeps); True: think first. A
    # thinking answer's reasoning (up to </think>) is dropped from the answer text, as lmms-eval's qwen3_5 does.
    "enable_thinking": None,
    # Gemma 4: the most soft tokens per image, one of 70 / 140 / 280 / 560 / 1120 (Gemma4ImageProcessor's
    # max_soft_tokens); None keeps the processor's own (the released processor and lmms-eval's gemma4 model: 280).
    "max_soft_tokens": None,
    # A system turn before the user's, rendered by the model's own chat template; None: none given (a template may
    # add its own: Qwen2.5-VL's adds "You are a helpful assistant.", as lmms-eval's qwen2_5_vl model sends). lmms-eval's
    # gemma4, qwen3_vl and qwen3_5 models send "You are a helpful assistant." and those families' templates add none,
    # so the sweeps of those models set it (sweeps/extended_models.yaml, extended_models_gemma4.yaml); so does its
    # llava_onevision model (LLaVA's qwen_1_5 conversation), whose numbers the OneVision sweeps follow
    # (extended_models_llava_onevision.yaml, extended_models_video.yaml: llava-hf's OneVision template adds none);
    # lmms-eval's llava_hf and internvl_hf models send none.
    "system_prompt": None,
    # LLaVA-1.5: pad each image to a square of the image processor's mean colour, centred, before the processor
    # (LLaVA's own `image_aspect_ratio: pad`, which lmms-eval's llava model and the paper's runs apply), so the
    # processor's centre crop keeps the whole image; False: the Hugging Face processor's centre crop of the shorter
    # side (llava-hf's default). Other families ignore it.
    "pad_to_square": False,
}
ADAPTER_CHOICES = {"budget_mode": ("per_crop", "global", "adaptive_views", "view_quota", "packed", "released"),
                   "image_newline": ("drop", "rows", "all"),
                   "unpad": (True, False),
                   "token_order": ("raster", "selection", "stages", "released"),
                   "video_budget": ("per_frame", "clip", "adaptive_frames"),
                   "video_split": ("unit", "per_frame", "clip"),
                   "enable_thinking": (None, True, False),
                   "pad_to_square": (False, True)}

# The token order of each method's released code (read in the authors' repositories; docs/methods.md: "What each method
# feeds the LLM"). PromPrune concatenates its stage-1 top-k and its stage-2 DPP picks without re-sorting; VisionZip
# emits its CLS, its dominant tokens in index order, then its contextual ones (on LLaVA-NeXT's released layout the
# crops' dominant tokens stitched: "stages" above); DivPrune, VisPruner, FastV and SparseVLM
# re-sort to index order, and so does CDPruner; the downsampling control feeds its cells in raster order. Methods not
# listed (our ablations of PromPrune's stages) follow PromPrune.
RELEASED_ORDER = {"promprune": "selection", "fixed_ratio": "selection", "saliency_only": "selection",
                  "coverage_only": "selection", "visionzip": "stages", "divprune": "raster", "vispruner": "raster",
                  "random": "raster", "cdpruner": "raster", "downsample": "raster"}


def token_order(method: str | None, option: str) -> str:
    """The order the adapter feeds the kept tokens in: ``option``, with "released" resolved for ``method``."""
    if option != "released":
        return option
    return RELEASED_ORDER.get(method, "raster")


# The LLaVA-NeXT layout of each method's released code (budget_mode, image_newline, unpad; docs/methods.md: "What each
# method feeds the LLM"). DivPrune selects over the packed sequence, newline tokens included (it keeps a ratio of the
# sequence's length; we keep the budget). VisPruner and CDPruner run llava-v1.6 with "_unpad" stripped from its
# `mm_patch_merge_type` (LLaVA's "spatial" merge), VisionZip with its own restore_image_features_sorted in the unpad
# branch, which neither unpads nor adds a newline: every view gets `visual_token_num` tokens (VisionZip: its dominant
# + contextual counts) on its whole grid, the picks in the padding are fed, no newline token, the base view first,
# then the crops' stitched grid in raster order (VisionZip: its crops' dominant tokens so, then their CLS and
# contextual tokens; its token order "stages" does that on this layout): exactly `visual_token_num` x views tokens
# (VisPruner's README: 32 x 5 = 160). PromPrune's released code has no working NeXT path, so PromPrune (and every
# method not listed) splits the budget per view: "per_crop", our choice, with the image_newline and unpad options as
# given.
RELEASED_NEXT = {"divprune": ("packed", "drop", True), "vispruner": ("view_quota", "drop", False),
                 "visionzip": ("view_quota", "drop", False), "cdpruner": ("view_quota", "drop", False)}


class NextLayout(NamedTuple):
    """How LLaVA-NeXT's views and newline tokens meet the budget: the adapter options ``budget_mode``,
    ``image_newline`` and ``unpad`` (:data:`ADAPTER_OPTIONS`), "released" resolved."""

    budget_mode: str
    image_newline: str
    unpad: bool


def next_layout(method: str | None, budget_mode: str, image_newline: str, unpad: bool = True) -> NextLayout:
    """The :class:`NextLayout` the adapter uses: the options, with budget_mode "released" resolved for ``method``
    (it then sets image_newline and unpad too where the method's released code has a NeXT path)."""
    if budget_mode != "released":
        return NextLayout(budget_mode, image_newline, bool(unpad))
    return NextLayout(*RELEASED_NEXT.get(method, ("per_crop", image_newline, bool(unpad))))


def all_methods() -> list[str]:
    """Every method name an adapter runs: the whole registry, pre-LLM and in-LLM."""
    return promprune.methods(stage=None)


def is_in_llm(method: str | None) -> bool:
    """Whether ``method`` prunes inside the LLM (False for None, the unpruned model)."""
    return method is not None and promprune.method_spec(method).stage == promprune.IN_LLM


def validate_method(method: str | None, budget: int | None = None, **options) -> tuple[dict, dict]:
    """Check a method name, budget and options up front; returns ``(method_options, adapter_options)``.

    ``method_options`` are the given method options, numpy's numbers as Python's (defaults are filled in later, so
    ``mu`` can default per family); ``adapter_options`` are the adapter options with defaults filled in.
    ``method=None`` means unpruned: then no budget and no method options are allowed. Errors are ValueErrors naming
    the bad field and listing the valid values.
    """
    adapter = {k: options.pop(k) for k in list(options) if k in ADAPTER_OPTIONS}
    adapter = {**ADAPTER_OPTIONS, **adapter}
    for key, allowed in ADAPTER_CHOICES.items():
        if adapter[key] not in allowed:
            raise ValueError(f"option {key!r} must be one of {list(allowed)}, got {adapter[key]!r}")
    _check_image_tokens(adapter["image_tokens"])
    _check_max_soft_tokens(adapter["max_soft_tokens"])
    if adapter["system_prompt"] is not None and not (isinstance(adapter["system_prompt"], str)
                                                     and adapter["system_prompt"].strip()):
        raise ValueError(f"option 'system_prompt' must be a non-empty string or None, got {adapter['system_prompt']!r}")
    mode, newline, unpad = next_layout(method, adapter["budget_mode"], adapter["image_newline"], adapter["unpad"])
    order = token_order(method, adapter["token_order"])
    if newline in ("rows", "all") and mode != "packed" and order != "raster":
        raise ValueError(f"option image_newline={newline!r} places each row's newline after the row's kept tokens, "
                         "which needs token_order 'raster'; use image_newline='drop' with another token order")
    if not unpad and method is not None and not is_in_llm(method) and (mode != "view_quota" or newline != "drop"):
        raise ValueError(f"option unpad=False feeds the picks on LLaVA-NeXT's whole view grids, padding included, as "
                         f"LLaVA's 'spatial' merge does (no unpadding, no newline token): it needs budget_mode "
                         f"'view_quota' and image_newline 'drop', got budget_mode={mode!r}, image_newline={newline!r}; "
                         "set those, or leave unpad True (budget_mode 'released' sets all three per method)")
    if method is None:
        if budget is not None or options:
            raise ValueError(f"method=None (unpruned) takes no budget or method options; got budget={budget!r}, "
                             f"options={sorted(options)}")
        return {}, adapter
    if adapter["video_split"] != "unit" and method != "promprune":  # unpruned (None, above): nothing to split
        raise ValueError(f"option video_split={adapter['video_split']!r} sets PromPrune's entropy / split over a clip; "
                         f"method {method!r} has none: use video_split='unit' (the default)")
    spec = promprune.method_spec(method)  # an unknown name: ValueError with did-you-mean and every method
    if spec.stage == promprune.IN_LLM:  # one the hooks do not implement (not registry.IN_LLM_HOOKED, which a test
        problem = in_llm_hooks_problem(method)  # pins equal to llm_hooks.STAGE_KINDS, nor scored): no model runs it
        if problem is not None:
            raise ValueError(problem)
    budget = as_budget(budget, method)
    resolved = spec.resolve(options, also_valid=ADAPTER_OPTIONS, budget=budget)  # names, choices, the method's checks
    if spec.needs_grid and adapter["video_budget"] == "clip":  # a grid method (downsample) pools one view's rectangle
        raise OptionError("video_budget", f"option video_budget='clip' makes one selection over every frame of a clip, "
                          f"and method {method!r} pools one view's token grid (a rectangle of one frame), which that "
                          "selection's tokens are not: every clip would fail. Use video_budget='per_frame' (the "
                          "default: the budget split evenly over the frames) or 'adaptive_frames' (shares by each "
                          f"frame's entropy), each frame its own selection; or leave {method!r} out of this run")
    if mode == "packed" and spec.stage == promprune.PRE_LLM and (spec.needs_saliency or spec.reads_vision
                                                                 or spec.needs_instruction or spec.needs_grid):
        raise ValueError(f"budget_mode 'packed' makes one selection over the image's whole packed sequence (on "
                         f"LLaVA-NeXT its image_newline tokens too, which have no saliency, vision-tower features or "
                         f"grid place), by the LLM-side features alone; method {method!r} needs more: use another "
                         "budget_mode (packed suits divprune and random)")
    return {key: resolved[key] for key in options}, adapter  # numpy's numbers as Python's


def _check_image_tokens(n) -> None:
    if n is None:
        return
    whole = isinstance(n, numbers.Integral) and not isinstance(n, bool)  # numpy ints too
    side = math.isqrt(int(n)) if whole and n > 0 else 0
    if not whole or n <= 0 or side * side != n:  # 0 = 0^2 passed, and failed inside the processor
        raise ValueError(f"option 'image_tokens' must be a positive perfect square (e.g. 1296 = 36^2), got {n!r}")


SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # Gemma4ImageProcessor's accepted max_soft_tokens


def _check_max_soft_tokens(n) -> None:
    if n is not None and (isinstance(n, bool) or n not in SOFT_TOKEN_BUDGETS):
        raise ValueError(f"option 'max_soft_tokens' must be one of {list(SOFT_TOKEN_BUDGETS)} (Gemma 4's soft-token "
                         f"budgets), got {n!r}")
