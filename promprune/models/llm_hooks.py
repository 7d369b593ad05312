"""In-LLM pruning baselines, FastV, SparseVLM, DART and PyramidDrop, and in-LLM methods of one's own that score the
visual tokens at their layers, as hooks on the language model's decoder layers.

The language model is not forked: forward pre-hooks on its decoder layers shrink the sequence between layers.

- A hook on the self-attention of layer ``l - 1`` recomputes the attention rows the method ranks by (queries:
  FastV the last token; SparseVLM the text raters after the image) with the module's own projections and rotary
  embedding, so the LLM keeps SDPA everywhere; for DART it takes the L1 norms of that layer's keys instead.
  PyramidDrop ranks inside layer ``l``'s own hook, with layer ``l``'s projections on its input-normed states; so does
  an in-LLM method of one's own (``registry.register_in_llm_method(name, score=fn, layers=...)``), by the scores ``fn``
  gives for layer ``l``'s input (:class:`ScoreInputs`: the hidden states, the candidates, on demand the layer's own
  last-token attention and key norms), checked for shape and finite values within the stage's one read.
- A hook on layer ``l`` drops visual tokens from the hidden states, gathers the rotary embeddings at the kept
  columns (positions stay the original ones, as FastV's and DART's code does; PyramidDrop's and SparseVLM's released
  code renumbers the kept sequence contiguously, their option ``positions``), and hands every later layer a mask built
  for the kept columns. The KV cache of layers ``>= l`` therefore holds only kept tokens; during decoding the same
  hooks give those layers masks over their own kept columns plus the generated tokens.

Qwen3-VL's DeepStack adds visual features to the image positions' hidden states after its first LLM layers; once
a layer has pruned, the addition goes to the kept image columns only (each gets its own rows).

LLMs that mix layer types (``config.layer_types``) rank at full-attention layers only. Qwen3.5's Gated DeltaNet
``linear_attention`` layers keep a recurrent state and have no attention map; Gemma 4's ``sliding_attention`` layers'
rows see only the window (and its vision tokens both ways), so the rows the hooks recompute would not be the model's
own (DART, which ranks by key norms, may rank at a sliding layer). :func:`stage_layers` moves the default layers to the
first full-attention layer at or after the one they rank at (and after the previous stage's) and refuses explicit ones
that rank elsewhere; ``InLLMPruner.layer_map`` records (requested, used). Gemma 4's E2B / E4B (KV-shared layers,
per-layer embeddings) are refused (:func:`unsupported`).

The cut reaches every layer after it. A linear layer gets the 2D mask of the live columns instead of a 4D one, and
the dead columns (padding, fillers) come first in every row, so its scan reads zeros from a zero state and then only
the kept tokens, in order; decoding steps leave it transformers' mask (a new token is never padding). The cache's
sequence length (its first layer with keys, :func:`cache_length_layer`, which every stage cuts after) stays the
unpruned prompt's. A sliding
layer gets a mask with the window counted in the live columns it holds and each vision run bidirectional, and the
sliding layers' cache keeps every column for the generation (the window is in the masks).

Rows of a batch may hold different numbers of visual tokens (LLaVA-NeXT, Qwen2.5-VL); all rows keep the same
sequence length, padded with masked "dead" tokens that nobody attends to.
In-LLM methods see the unpruned sequence, LLaVA-NeXT's ``image_newline`` tokens included, as visual tokens.

SparseVLM, as implemented here (next to its released code, Gumpest/SparseVLMs@26a5f48 with its default USE_VERSION
1_0): as released, each ranking layer (LLaMA-32's 2, 6, 15, as fractions of the depth) runs on every token and its
own attention ranks, so the cuts are before the layers after them (3, 7, 16: ``sparsevlm_layers``; option ``layers``
names the layers cut before), and the kept sequence is renumbered contiguously and decoded from each layer's cache
length (option ``positions``, as PyramidDrop's; M-RoPE models keep their positions). Ours: a geometric schedule ending
at ``budget`` by default (option ``schedule="released"``: the released code's per-layer counts, where a budget is a
layer-averaged count, e.g. 64 -> 66 / 30 / 17 tokens); raters are the text tokens after the image whose attention to
the visual tokens at the ranking layer is at least their mean (released: chosen once, by the similarity of the input
embeddings); a visual token's score is its attention from the raters (head and rater mean). Recycling: of each
stage's deleted tokens the top ``ceil(recycle_ratio * deleted)`` by score (released: ``int(0.3 * deleted) + 1``) are
grouped around the ``ceil(merge_ratio * n)`` best of them by cosine similarity of hidden states, and each group's mean
replaces its centre token's hidden state (the centre keeps its place); recycled tokens count toward the stage's
budget (released: int(merge_ratio * n) + 1 merged tokens on top of it). Its paper clusters with density-peak kNN; we
use best-score centres.
"""
from __future__ import annotations

import inspect
import math
import sys
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import torch

import promprune
from promprune.selection import accel
from promprune.selection.in_llm import SPARSEVLM_RELEASED
from promprune.selection.registry import in_llm_hooks_problem

from .adapters import host_index
from .attention import in_llm_attention_problem
from .registry import find_family

# Pruning layers of SparseVLM's / PyramidDrop's released code on LLaMA-based LLaVA (32 layers), kept as fractions of
# the depth. SparseVLM's (`pruning_loc`) are the layers whose own attention ranks, each run on every token: the cuts
# are after them, before layers 3, 7 and 16 (`sparsevlm_layers`). PyramidDrop's are the layers cut before.
SPARSEVLM_LAYERS_OF_32 = (2, 6, 15)
PYRAMIDDROP_LAYERS_OF_32 = (8, 16, 24)
# What the hooks read from the language model's forward: the KV cache (to tell the prefill from a decoding step), under
# either of its names (transformers 5.24 renamed past_key_values to cache; the old name is accepted until 5.40), and
# the input embeddings and padding mask.
CACHE_ARGUMENTS = ("cache", "past_key_values")
LM_ARGUMENTS = ("inputs_embeds", "attention_mask")
# FastV's K = 2 of LLaMA's 32 layers (its paper's default), scaled the same way unless option 'layer' gives K.
FASTV_LAYER_OF_32 = (2,)


# The in-LLM methods these hooks implement by name, each with the kind of :class:`Stage` it prunes with: every dispatch
# on a method's name below reads this table or :data:`SCORED`, and any other name is refused (:func:`hooks_problem`),
# where it used to fall through to SparseVLM's branch. ``registry.IN_LLM_HOOKED`` names the same methods for
# ``register_in_llm_method``.
STAGE_KINDS = {"fastv": "fastv", "sparsevlm": "sparsevlm", "dart": "dart", "pyramiddrop": "pdrop"}
# The kind of an in-LLM method of one's own (registered with a ``score``): ranked at each of its layers by its score of
# the layer's input, like PyramidDrop by the layer's own attention (its stages, its hybrid-layer rules).
SCORED = "scored"


def hooks_problem(method: str) -> str | None:
    """Why these hooks cannot prune with the in-LLM ``method`` (none of :data:`STAGE_KINDS`, nor registered with a
    score), or None."""
    return in_llm_hooks_problem(method, tuple(STAGE_KINDS))


def _stage_kind(method: str) -> str:
    """``method``'s :class:`Stage` kind; a method the hooks do not implement is a ValueError (:func:`hooks_problem`)."""
    problem = hooks_problem(method)
    if problem is not None:
        raise ValueError(problem)
    return STAGE_KINDS.get(method, SCORED)


def _ranks_own_layer(method: str) -> bool:
    """Whether ``method`` ranks at the layer it cuts before, on that layer's input (PyramidDrop; a scored method of
    one's own), rather than at the layer before it (FastV, SparseVLM, DART)."""
    return _stage_kind(method) in ("pdrop", SCORED)


def make(method: str, model, input_ids: torch.Tensor, budget: int, options: dict) -> "InLLMPruner":
    """A context manager that prunes inside ``model``'s LLM during ``generate`` on ``input_ids [B, L]``."""
    kind = _stage_kind(method)
    layers = _decoder_layers(model)
    opts, at, plan, layer_map = schedule(method, model.config, budget, options, model_name(model))
    check_llm(model, method)
    impl = model.config.text_config._attn_implementation or "sdpa"
    problem = in_llm_attention_problem(method, impl)
    if problem is not None:  # PrunedVLM refuses it at construction; a pruner made by hand, here
        raise ValueError(problem)
    compact = False
    if kind in ("fastv", "dart"):
        stages = [Stage(at[0], None, kind=kind)]
        if kind == "dart":
            stages[0].pivots = (opts["pivot_image"], opts["pivot_text"])
    elif kind in ("pdrop", SCORED):
        stages = [Stage(layer, None, kind=kind) for layer in at]
        if kind == SCORED:  # the method's own options, as its score takes them
            own = {key: value for key, value in opts.items() if key != "layers"}
            score = promprune.method_spec(method).score
            for stage in stages:
                stage.score, stage.options = score, own
    else:  # "sparsevlm"
        stages = [Stage(layer, None, kind=kind, recycle=opts["recycle_ratio"], merge=opts["merge_ratio"])
                  for layer in at]
    if method in ("pyramiddrop", "sparsevlm"):  # their released code renumbers (LLaMA's 1D RoPE only)
        compact = opts["positions"] == "released" and not _mrope(model)
    pruner = InLLMPruner(model, layers, input_ids, budget, stages, eager=impl == "eager", plan=plan, compact=compact,
                         method=method)
    pruner.layer_map = layer_map
    return pruner


def schedule(method: str, config, budget: int, options: dict, name: str | None = None) \
        -> tuple[dict, list[int], Callable, list[tuple[int, int]]]:
    """Where and how much an in-LLM method prunes, model-free: ``(opts, at, plan, layer_map)``, the method's options
    resolved by the registry, the layers it prunes before (ascending, :func:`stage_layers`), ``plan(n)``: the visual
    tokens kept after each of those layers when a row has ``n``, and (requested, used) per stage.

    ``config``: the VLM's config or its text config (hybrid layer types honoured), or a plain depth (an LLM whose
    layers all attend in full). :func:`make` and the FLOP estimates (``benchmarks/sweep_cost.py``) read this one answer.
    """
    if isinstance(config, int):
        config = SimpleNamespace(num_hidden_layers=config, model_type=None)
    kind = _stage_kind(method)  # a method the hooks do not implement: refused before its options
    opts = promprune.method_spec(method).resolve(options, budget=budget)
    at, layer_map = stage_layers(config, method, opts, name)
    if method == "fastv":
        def plan(n):
            return [budget]
    elif method == "dart":
        plan = _dart_plan(budget, opts)
    elif method == "pyramiddrop":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        plan = _pyramid_plan(budget, opts, at, int(text.num_hidden_layers))
    elif kind == "sparsevlm" and opts["schedule"] == "released":  # the budget one of the released ones
        def plan(n):
            return list(SPARSEVLM_RELEASED[budget])
    else:  # sparsevlm's geometric schedule; a scored method of one's own (one stage: the budget)
        def plan(n):
            return [geometric(budget, n, s, len(at)) for s in range(1, len(at) + 1)]
    return opts, at, plan, layer_map


def plan_problem(config, method: str, budget: int, options: dict, n: int) -> str | None:
    """Why ``method``'s schedule (:func:`schedule`) at ``budget`` cannot prune a row of ``n`` visual tokens, in the
    words its plan raises with at run time, on every such row (PyramidDrop's ``budget_semantics="released"``: a budget
    below the layer-averaged count the layers before its first stage already see, :func:`pyramid_ratio_for_average`);
    None when it can. From the config alone (``options``: the method's validated options). The only refusal, the
    released floor ``n x first stage / depth``, rises with ``n``: a budget refused at some ``n`` is refused at every
    larger one, so construction and the pipeline's preflight ask at the fewest tokens every image gives
    (``adapters.visual_token_floor``; every image's count on LLaVA-1.5) and refuse only what no image can run
    (``vlm.construction_problems``); a larger image the budget cannot prune fails as its own sample at run time
    (:class:`InLLMPruner` raises this message, naming its count). Layers this LLM cannot prune at are
    :func:`stage_layers`' to refuse: None here. The plan's warnings (a released stage left no token) are not repeated
    here; the run gives them."""
    try:
        plan = schedule(method, config, budget, options)[2]
    except ValueError:
        return None  # stage_layers' refusal, raised where it is checked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan(n)
        except ValueError as exc:
            return str(exc)
    return None


def stage_layers(config, method: str, opts: dict, name: str | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """The decoder layers an in-LLM ``method`` prunes before (ascending), and per requested stage ``(requested,
    used)``, from the config alone.

    ``config``: the VLM's config (or its text config); ``opts``: the method's resolved options; ``name``: how errors
    name the model (default: its checkpoint name, else "this model"). Requested layers are the options' or the released
    ones scaled to the depth. On an LLM that mixes layer types (:func:`hybrid_layer_types`: linear-attention or
    sliding-window layers) a stage must rank at a full-attention layer and cut after the cache's first layer with keys
    (:func:`hybrid_stages`): default layers move forward, explicit ones that do not are refused. A ValueError in one
    paragraph names the method, the model and the fix; so does an LLM the hooks cannot prune (:func:`unsupported`).
    """
    _stage_kind(method)  # a method the hooks do not implement: its problem, whatever the model
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = name or getattr(config, "_name_or_path", "") or "this model"
    problem = unsupported(text, method, name)
    if problem:
        raise ValueError(problem)
    depth = int(text.num_hidden_layers)
    at, explicit = requested_layers(method, opts, depth)
    types = hybrid_layer_types(text)
    model = f"{name} (model type {getattr(config, 'model_type', None) or text.model_type!r})"
    mapped = at if types is None else hybrid_stages(types, method, at, explicit, model,
                                                    getattr(text, "sliding_window", None))
    used = sorted(set(mapped))
    if method == "sparsevlm" and opts["schedule"] == "released" and len(used) != 3:
        raise ValueError(f"sparsevlm's released schedule prunes at three layers; this {depth}-layer LLM gives {used}: "
                         "pass option 'layers' with three layers")
    return used, list(zip(at, mapped))


def requested_layers(method: str, opts: dict, depth: int) -> tuple[list[int], bool]:
    """``(layers, explicit)``: the layers ``method``'s options give (explicit), else the released ones scaled to
    ``depth``, ascending and checked against the depth (given layers are ascending and distinct: the registry's
    check; the scaled ones may coincide on a shallow LLM and are taken once)."""
    kind = _stage_kind(method)
    if kind in ("fastv", "dart"):
        explicit = opts["layer"] is not None
        at = [opts["layer"] if explicit else fastv_layer(depth)]
        if not 1 <= at[0] < depth:
            raise ValueError(f"{method} option 'layer' must be in [1, {depth - 1}], got {at[0]}")
        return at, explicit
    if kind == SCORED:  # the layers it registered, for 32 layers
        default = scaled_layers(depth, promprune.method_spec(method).score_layers)
    else:
        default = scaled_layers(depth, PYRAMIDDROP_LAYERS_OF_32) if kind == "pdrop" else sparsevlm_layers(depth)
    at = list(opts["layers"]) if opts["layers"] else sorted(set(default))
    if max(at) >= depth:
        raise ValueError(f"{method} option 'layers' must be < {depth} (LLM depth), got {at}")
    return at, bool(opts["layers"])


# Layer types (``config.layer_types``) whose token mixer keeps a recurrent state instead of attending: no attention
# map to rank tokens by, no KV cache that grows (Qwen3.5's Gated DeltaNet layers).
RECURRENT_LAYER_TYPES = ("linear_attention",)
# Layer types that attend within a window only (Gemma 4): their rows are not the attention over the whole image, but
# their keys are the layer's own (DART may rank there).
SLIDING_LAYER_TYPES = ("sliding_attention",)


def hybrid_layer_types(text_config) -> list[str] | None:
    """The LLM's ``layer_types`` when some layers are recurrent or sliding-window (:data:`RECURRENT_LAYER_TYPES`,
    :data:`SLIDING_LAYER_TYPES`), else None."""
    types = getattr(text_config, "layer_types", None)
    if not types or not any(t in RECURRENT_LAYER_TYPES + SLIDING_LAYER_TYPES for t in types):
        return None
    return list(types)


def ranking_layer(method: str, stage: int) -> int:
    """The layer whose attention ranks the tokens pruned before decoder layer ``stage``: ``stage - 1`` (FastV,
    SparseVLM: the layer before the cut; DART: that layer's keys), ``stage`` itself for PyramidDrop (the layer's own
    projections) and a scored method of one's own (the layer's input, its own attention on demand)."""
    return stage if _ranks_own_layer(method) else stage - 1


def rankable_layers(types: list[str], method: str) -> list[int]:
    """The layers ``method`` can rank at: full attention, and for DART (key norms, no attention row) any layer with
    keys, sliding-window ones included."""
    barred = RECURRENT_LAYER_TYPES + (() if method == "dart" else SLIDING_LAYER_TYPES)
    return [i for i, t in enumerate(types) if t not in barred]


def cache_length_layer(types: list[str]) -> int:
    """The layer whose KV cache gives the cache's sequence length (transformers 5.23's ``Cache.get_seq_length()``: its
    first layer with keys, not a linear-attention one; Qwen3.5-4B's layer 3, tiny:qwen3_5's 1; from 5.25 a linear
    layer counts the tokens it saw and ``get_seq_length()`` reads layer 0, before this one, so a cut after this layer
    leaves both whole). The hooks read the prompt's length there during decoding (and Qwen3.5 its decode positions),
    so every stage must cut after it: a cut at or before it left it holding only the kept columns, and the first
    decoding step failed. Layer 0 where no layer is recurrent (every stage cuts after it)."""
    return next((i for i, t in enumerate(types) if t not in RECURRENT_LAYER_TYPES), 0)


def stage_range(types: list[str], method: str) -> list[int]:
    """The layers ``method``'s stages may cut before on an LLM of ``types``: each ranks at one of
    :func:`rankable_layers` (the cut layer itself, or the one before it) and cuts after :func:`cache_length_layer`
    and before the last layer's end."""
    shift = 0 if _ranks_own_layer(method) else 1
    first = cache_length_layer(types)
    return [a + shift for a in rankable_layers(types, method) if first < a + shift < len(types)]


def _why_not(kind: str, window: int | None) -> str:
    """Why a layer of type ``kind`` cannot rank visual tokens, for errors."""
    if kind in RECURRENT_LAYER_TYPES:
        return "a linear-attention layer (linear attention: a recurrent state, no attention map to rank tokens by)"
    return (f"a sliding-window layer (it sees only the last {window} tokens, so its rows are not the attention over "
            "the whole image)")


def hybrid_stages(types: list[str], method: str, requested: list[int], explicit: bool, model: str,
                  window: int | None = None) -> list[int]:
    """Per requested stage, the layer it prunes before on an LLM that mixes layer types: each stage ranks at a layer
    of :func:`rankable_layers` and cuts before the layers after it, linear-attention ones included (they then run on
    the kept tokens only, so their recurrent state sees no dropped token from the cut on) and sliding ones (masks with
    the window over the live columns).

    Every stage cuts after :func:`cache_length_layer` (the layer whose cache the decoding steps read the prompt's
    length from), which matters to the methods ranking at the layer they cut before (PyramidDrop, a scored method of
    one's own): they may not cut before Qwen3.5's first full-attention layer (:func:`stage_range`).
    Requested (default) stages move to the first such stage whose ranking layer (:func:`ranking_layer`) is at or
    after theirs and after the previous stage's, so each stage keeps its own layer: the 32-layer Qwen3.5's
    every-4th full attention takes FastV / DART's K = 2 (ranked at layer 1) to K = 4 (ranked at 3), SparseVLM's 3, 7,
    16 to 4, 8, 16, PyramidDrop's 8, 16, 24 to 11, 19, 27 and a scored method's 2 to 7 (3 is the cache's length
    layer). A later stage with no such layer left joins the previous stage's layer (tiny:gemma4's PyramidDrop 2, 3, 4
    -> 3, 5, 5); a first stage with none is refused. Explicit options (``layer`` / ``layers``) are used as given, and
    refused when one ranks elsewhere or cuts at or before the cache's length layer. A ValueError (one paragraph,
    naming ``method``, ``model`` and the valid values) on refusal; ``window``: the sliding window, for the message.
    """
    valid = stage_range(types, method)
    if explicit:
        for stage in requested:
            if stage not in valid:
                raise ValueError(_refusal(types, method, model, stage, window))
        return list(requested)
    used, previous = [], -1
    for stage in requested:
        rank = ranking_layer(method, stage)
        found = next((cut for cut in valid if ranking_layer(method, cut) >= max(rank, previous + 1)), None)
        if found is None and used:  # no layer left for this stage: it joins the previous one
            used.append(used[-1])
            continue
        if found is None:
            raise ValueError(_refusal(types, method, model, stage, window, moved=True))
        previous = ranking_layer(method, found)
        used.append(found)
    return used


def _refusal(types: list[str], method: str, model: str, stage: int, window: int | None, moved: bool = False) -> str:
    """The paragraph refusing ``method``'s stage at ``stage`` on an LLM of ``types`` (given in the options, or a
    default one that found no layer to move to), naming the model, the full-attention layers and the valid values."""
    rank = ranking_layer(method, stage)
    full = [i for i, t in enumerate(types) if t not in RECURRENT_LAYER_TYPES + SLIDING_LAYER_TYPES]
    option = "layer" if _stage_kind(method) in ("fastv", "dart") else "layers"
    valid = stage_range(types, method)
    first = cache_length_layer(types)
    where = f"in-LLM method {method!r} on {model}: this LLM attends in full only at layers {full}"
    if moved:
        return (f"{where}; its stage at layer {stage} finds no full-attention layer at or after layer {rank} to rank "
                f"at with a layer left to prune before, so {method} is refused on this model. Give option {option!r} "
                f"from {valid}, or run a pre-LLM method")
    if rank in rankable_layers(types, method):  # ranks at a layer it may, but cuts before the cache's length layer
        why = (f"cuts before layer {first}, the first with a KV cache, whose length the decoding steps read as the "
               f"prompt's (a cut at or before it leaves it only the kept tokens); {method} ranks at the layer it cuts "
               f"before, so its stages must cut after layer {first}")
    else:
        why = f"ranks the visual tokens at layer {rank}, {_why_not(types[rank], window)}"
    return (f"{where}; option {option!r} gives layer {stage}, which {why}. Give {option!r} from {valid} (each ranks "
            "at a full-attention layer), or leave it unset (the scaled default moves to the first of them at or after "
            "it)")


def unsupported(config, method: str, name: str = "this model") -> str | None:
    """Why ``method`` (in-LLM) cannot run on the LLM of ``config`` (the VLM's or its text config), in one paragraph;
    None when it can. Gemma 4's smaller models (E2B, E4B) reuse the keys and values of an earlier layer in their last
    layers (``num_kv_shared_layers``) and add per-layer token embeddings (``hidden_size_per_layer_input``): a pruned
    sequence would meet full-length shared keys and per-layer inputs the hooks do not shrink, so they are refused."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    per_layer = getattr(text, "hidden_size_per_layer_input", 0) or 0
    if not shared and not per_layer:
        return None
    what = " and ".join(x for x in (f"reuses an earlier layer's keys and values in its last {shared} layers "
                                    "(num_kv_shared_layers)" if shared else "",
                                    f"adds per-layer token embeddings (hidden_size_per_layer_input {per_layer})"
                                    if per_layer else "") if x)
    return (f"in-LLM method {method!r} cannot run on {name}: its language model {what}. The hooks shrink the hidden "
            "states, masks and rotary embeddings of the layers after the pruning layer, not the keys a later layer "
            "borrows from an earlier one nor the per-layer inputs, so the pruned sequence would not be the one those "
            "layers see. Run a pre-LLM method on this model, or an in-LLM method on a model without them (Gemma 4 31B "
            "or 26B-A4B).")


def model_name(model) -> str:
    """How errors name a loaded model: its checkpoint name, else its class."""
    return getattr(model.config, "_name_or_path", "") or getattr(model.config, "name_or_path", "") \
        or type(model).__name__


def geometric(budget: int, n: int, s: int, stages: int) -> int:
    """Tokens a row with ``n`` visual tokens keeps after stage ``s`` of ``stages``: geometric from n to budget."""
    if s == stages or n <= budget:
        return budget
    return max(budget, round(n * (budget / n) ** (s / stages)))


def _dart_plan(budget: int, opts: dict):
    """DART's kept count for ``n`` visual tokens: ``budget`` ("exact") or the released count (see the registry)."""
    group = opts["pivot_image"] + opts["pivot_text"]

    def plan(n: int) -> list[int]:
        if opts["budget_semantics"] == "exact":
            return [min(budget, n)]
        return [min(n, opts["pivot_image"] + group * (budget // group))]
    return plan


def _pyramid_plan(budget: int, opts: dict, at: list[int], depth: int):
    """PyramidDrop's per-stage kept counts for ``n`` visual tokens (see the registry's comment)."""
    S = len(at)

    def exact(n: int) -> list[int]:
        counts, prev = [], n
        for s in range(1, S + 1):
            prev = min(prev, max(budget, round(budget / opts["ratio"] ** (S - s))))
            counts.append(prev)
        return counts

    def released(n: int) -> list[int]:
        lam = pyramid_ratio_for_average(n, budget, at, depth)
        counts = [int(n * lam ** s) for s in range(1, S + 1)]
        if counts[-1] == 0:  # the released int() floors n lambda^s < 1 to nothing: kept, as released, but said
            warnings.warn(f"pyramiddrop with budget_semantics='released' keeps no visual token after its stage at "
                          f"layer {at[counts.index(0)]} (stage counts {counts} of {n}: int(n lambda^s), lambda "
                          f"{lam:.3f} for a layer average of {budget}); use budget_semantics='exact' to end at the "
                          "budget", stacklevel=2)
        return counts

    return exact if opts["budget_semantics"] == "exact" else released


def pyramid_average(n: int, lam: float, at: list[int], depth: int) -> float:
    """Visual tokens averaged over all ``depth`` layers when stage s (before layer ``at[s-1]``) keeps int(n lam^s)."""
    bounds = [0, *at, depth]
    return sum(int(n * lam ** s) * (bounds[s + 1] - bounds[s]) for s in range(len(at) + 1)) / depth


def pyramid_ratio_for_average(n: int, budget: int, at: list[int], depth: int) -> float:
    """The largest lambda in (0, 1] whose layer-averaged count (:func:`pyramid_average`) is at most ``budget``."""
    if pyramid_average(n, 1.0, at, depth) <= budget:
        return 1.0
    floor = n * at[0] / depth  # lambda -> 0: only the layers before the first stage see tokens
    if budget < floor:
        raise ValueError(f"pyramiddrop's released budget semantics average the visual tokens over the LLM's layers: "
                         f"with {n} tokens and the first stage at layer {at[0]} of {depth} the average is at least "
                         f"{floor:g}, above the budget {budget}; use budget_semantics='exact' or earlier 'layers'")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if pyramid_average(n, mid, at, depth) <= budget else (low, mid)
    return low


def dart_keep(key_norms: torch.Tensor, hidden: torch.Tensor, cand: torch.Tensor, text: torch.Tensor, n_img: int,
              n_txt: int, n_keep: int) -> torch.Tensor:
    """DART's rule: which ``n_keep`` of the visual columns ``cand`` stay. ``key_norms [L]``: L1 norm of each column's
    keys; ``hidden [L, D]``: the states compared (DART: through the LLM's final norm); ``text``: the text columns
    after the image.

    Image pivots: the ``n_img`` candidates with the largest key norm; text pivots: the ``n_txt`` text columns with
    the largest key norm. The pivots, in column order, each take the remaining candidates least cosine-similar to
    them, ``n_keep - n_img`` picks shared out as evenly as possible (earlier pivots take the remainder). Returns the
    image pivots, then each pivot's picks.

    Every size here follows from the shapes of ``cand`` and ``text`` and the picks made, so the host never reads the
    device (no ``nonzero``, no ``tolist``): the remaining candidates are read with :func:`true_positions`.
    """
    img = cand[key_norms[cand].topk(min(n_img, n_keep, cand.numel())).indices]
    txt = text[key_norms[text].topk(min(n_txt, text.numel())).indices]
    pivots = torch.cat([img, txt]).sort().values
    left = torch.zeros(hidden.shape[0], dtype=torch.bool, device=cand.device)
    left.index_fill_(0, cand, True)
    left.index_fill_(0, img, False)
    n_left = cand.numel() - img.numel()
    unit = torch.nn.functional.normalize(hidden.float(), dim=-1)
    picks, need, n_pivots = [img], n_keep - img.numel(), pivots.numel()
    for p in range(n_pivots):
        share = need // n_pivots + (1 if p < need % n_pivots else 0)
        pool = true_positions(left[None], n_left)[0]  # the remaining candidates, ascending
        pivot = unit.index_select(0, pivots[p:p + 1])[0]  # [D]
        take = pool[(-(unit[pool] @ pivot)).topk(min(share, n_left)).indices]
        left.index_fill_(0, take, False)
        n_left -= take.numel()
        picks.append(take)
    return torch.cat(picks)


def _top(values: torch.Tensor, allowed: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``[B, L]`` bool: in each row the ``counts[b]`` largest ``values`` among the ``allowed`` columns (no more than
    a row allows), one ``topk`` for the batch."""
    k = min(max(counts), values.shape[1])
    top = values.masked_fill(~allowed, float("-inf")).topk(k, dim=1).indices  # [B, k]
    n = _sent(counts, values.device)
    picked = (torch.arange(k, device=values.device) < n[:, None]) & allowed.gather(1, top)
    return torch.zeros_like(allowed).scatter_(1, top, picked)


def true_positions(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., width]``: the positions of the True entries along ``mask``'s last dimension, ascending (a row with
    fewer than ``width`` gives positions of False entries after them). ``nonzero`` without its host read: the caller
    knows ``width`` (a count read once for the whole batch, or one it kept)."""
    return (~mask).to(torch.uint8).argsort(dim=-1, stable=True)[..., :width]


def _sent(values: list, device) -> torch.Tensor:
    """Host integers as a long tensor on ``device``, copied without making the host wait for the device (the copy is
    staged at once; a blocking one would wait for the stream)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _mrope(model) -> bool:
    """3D M-RoPE positions (``Family.mrope``: Qwen2.5-VL, Qwen3-VL, ...): kept tokens keep them (no contiguous
    renumbering)."""
    found = find_family(model.config)
    return found is not None and found.mrope


def _queries_keys(attn, hidden: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module's own queries ``[B, H, L, hd]`` and keys ``[B, Hkv, L, hd]`` of ``hidden [B, L, D]``,
    after its per-head norms where it has them (Qwen3-VL's ``q_norm`` / ``k_norm``) and the rotary embedding (the
    module's own ``apply_rotary_pos_emb``: Qwen3.5's rotates the first quarter of each head). A gated attention
    (Qwen3.5: ``q_proj`` gives each head its query and an output gate, ``[query | gate]``) gives its queries."""
    B, L, _ = hidden.shape
    apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q = attn.q_proj(hidden).view(B, L, -1, attn.head_dim)
    if q.shape[2] == 2 * attn.config.num_attention_heads:  # gated: [query | gate] per head
        q = q.view(B, L, -1, 2 * attn.head_dim)[..., :attn.head_dim]
    k = attn.k_proj(hidden).view(B, L, -1, attn.head_dim)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    # transformers >= 5.25 with `kernels` installed makes it a module (its `forward` the function; kernelizable)
    signature = inspect.signature(apply_rope.forward if isinstance(apply_rope, torch.nn.Module) else apply_rope)
    if "k" not in signature.parameters:  # Gemma 4: one tensor at a time
        return apply_rope(q, *rope), apply_rope(k, *rope)
    return apply_rope(q, k, *rope)


def scaled_layers(depth: int, of_32) -> list[int]:
    """Layers given for a 32-layer LLM scaled to ``depth`` layers (each >= 1, unique, ascending)."""
    return sorted({min(max(1, round(layer * depth / 32)), depth - 1) for layer in of_32})


def fastv_layer(depth: int) -> int:
    """FastV's K = 2 of 32 layers scaled to ``depth`` layers (:func:`scaled_layers`): 2 for 28-36 layers, 1 for 4."""
    return scaled_layers(depth, FASTV_LAYER_OF_32)[0]


def sparsevlm_layers(depth: int) -> list[int]:
    """The layers SparseVLM cuts before on ``depth`` layers: its released ranking layers
    (:data:`SPARSEVLM_LAYERS_OF_32`, each run on every token) scaled from 32 to ``depth`` as :func:`scaled_layers`
    does but left a layer after them, plus one: 3, 7, 16 on 32 layers, 3, 6, 14 on 28, 2, 3 on 4."""
    ranks = {min(max(1, round(layer * depth / 32)), depth - 2) for layer in SPARSEVLM_LAYERS_OF_32}
    return sorted(rank + 1 for rank in ranks)


def check_llm(model, method: str) -> None:
    """Fail now, in one paragraph, when the language model's forward does not take the arguments the hooks read
    (:data:`CACHE_ARGUMENTS`, :data:`LM_ARGUMENTS`): a release that renames them would otherwise make every decoding
    step look like a prefill (nothing pruned, or a crash mid-run)."""
    lm = model.model.language_model
    params = inspect.signature(lm.forward).parameters
    missing = [name for name in LM_ARGUMENTS if name not in params]
    if not any(name in params for name in CACHE_ARGUMENTS):
        missing.insert(0, " / ".join(repr(n) for n in CACHE_ARGUMENTS))
    if missing:
        import transformers

        raise ValueError(
            f"in-LLM method {method!r} cannot hook this language model: {type(lm).__name__}.forward (transformers "
            f"{transformers.__version__}) takes no argument {', '.join(missing)} (its arguments: "
            f"{', '.join(p for p in params if p not in ('self', 'kwargs'))}). The hooks read the KV cache under "
            f"{' or '.join(CACHE_ARGUMENTS)} to tell the prefill from decoding steps; this transformers release "
            "renamed it. Install a transformers release inside the range pyproject.toml allows (constraints.txt "
            "pins the tested one), or run a pre-LLM method.")


def _cache_of(kwargs: dict):
    """The KV cache the LLM's forward was called with, under either name (None: no cache)."""
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_argument(model) -> str:
    """The name under which ``model``'s forward (and so its ``generate``) takes a KV cache: ``cache`` from
    transformers 5.24, ``past_key_values`` before (5.24 still accepts it, with a deprecation warning, until 5.40)."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in params), CACHE_ARGUMENTS[-1])


def cache_in(output):
    """The KV cache a forward returned (a ModelOutput), under either name."""
    cache = _cache_of(output)
    if cache is None:
        raise ValueError(f"{type(output).__name__} carries no KV cache under {' or '.join(CACHE_ARGUMENTS)}")
    return cache


def _decoder_layers(model):
    return model.model.language_model.layers


class _Unwrap:
    """A handle that removes an instance attribute set over a method (restoring the class's method)."""

    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def remove(self):
        self.obj.__dict__.pop(self.name, None)


class Stage:
    """Prune before decoder layer ``layer``; ``kind`` says how tokens are ranked: "fastv" (the last token's attention
    at layer - 1), "sparsevlm" (the raters' attention at layer - 1, with recycling), "pdrop" (the last token's
    attention with layer ``layer``'s own projections), "dart" (pivots; see :meth:`InLLMPruner._dart_kept`),
    :data:`SCORED` (the method's ``score`` of layer ``layer``'s input, :class:`ScoreInputs`).
    ``targets`` (per row) come from the method's plan."""

    def __init__(self, layer, target, kind, recycle=0.0, merge=0.0):
        self.layer, self.target, self.kind, self.recycle, self.merge = layer, target, kind, recycle, merge
        self.queries = "raters" if kind == "sparsevlm" else "last"
        self.scores = None  # [B, L_cur] attention received by each current column (set by the hook at layer-1)
        self.keys = None  # DART: [B, L_cur] L1 norm of layer-1's keys per current column
        self.pivots = (0, 0)  # DART: (image pivots, text pivots)
        self.score, self.options = None, {}  # SCORED: the method's score function and its own options


class ScoreInputs:
    """What an in-LLM method of one's own scores (``registry.register_in_llm_method(name, score=fn)``): what the
    pre-hook of decoder layer ``layer`` has in the prefill, before it cuts. ``fn(inputs, **options)`` returns a float
    tensor ``[B, L]``, one score per current column (the top-scored candidates of each row are kept; only the
    candidates' scores are read, and they must be finite).

    - ``hidden [B, L, D]``: the layer's input hidden states (the previous layer's output) of the current columns: the
      prompt's columns kept so far, padding and dead filler columns included, in the model's dtype.
    - ``visual [B, L]`` bool: the candidates, the live visual columns still in the sequence.
    - ``alive [B, L]`` bool: the live columns (False: padding, dead fillers).
    - ``columns [B, L]`` long: each current column's column in the prompt (``input_ids``).
    - ``layer``: the decoder layer's index; ``stage``: the stage's (0 for the first of the method's layers).
    - ``attention()``: ``[B, L]`` float32, the attention each column receives from the row's last token, head mean, with
      this layer's own projections on its input-normed states (PyramidDrop's ranking); ``key_norms()``: ``[B, L]``
      float32, the L1 norm of this layer's keys after the rotary embedding, all KV heads (DART's pivots'). Each is
      computed on first use, once.

    Everything is on the device of ``hidden`` and covers the whole batch: a score made of batched tensor ops keeps the
    stage at one read of the device, whatever the batch size (a ``.item()`` / ``.tolist()`` / boolean indexing in it
    would make a GPU's host wait every call). The tensors are the hooks' own: read them, never write them in place."""

    def __init__(self, hidden, visual, alive, columns, layer: int, stage: int, own: Callable):
        self.hidden, self.visual, self.alive, self.columns = hidden, visual, alive, columns
        self.layer, self.stage = layer, stage
        self._own, self._made = own, {}

    def attention(self) -> torch.Tensor:
        if "attention" not in self._made:
            self._made["attention"] = self._own("attention")
        return self._made["attention"]

    def key_norms(self) -> torch.Tensor:
        if "key_norms" not in self._made:
            self._made["key_norms"] = self._own("key_norms")
        return self._made["key_norms"]


class InLLMPruner:
    """Hooks that prune visual tokens inside the LLM; use as ``with pruner: model.generate(...)``."""

    def __init__(self, model, layers, input_ids, budget, stages, eager, plan, compact=False, method="in-LLM"):
        self.model, self.layers, self.stages, self.eager = model, layers, stages, eager
        self.method = method  # named in errors
        video = getattr(model.config, "video_token_id", None)  # a clip's tokens (promprune.models.video)
        self.visual = (input_ids == model.config.image_token_id) | (input_ids == (-1 if video is None else video))
        self.prompt_len = input_ids.shape[1]
        self.budget = budget
        self.compact = compact  # renumber kept tokens contiguously (PyramidDrop's released positions)
        plans = [plan(n) for n in self.visual.sum(1).tolist()]  # per row: kept visual tokens after each stage
        for s, stage in enumerate(stages):
            stage.targets = [p[s] for p in plans]
        self.first = stages[0].layer
        self.layer_map = [(st.layer, st.layer) for st in stages]  # (requested, used) per stage; make() sets it
        self.handles = []
        text = model.config.get_text_config()
        self.layer_types = list(getattr(text, "layer_types", None) or [])  # Qwen3.5, Gemma 4: the type of each layer
        # per layer: a recurrent token mixer (linear attention), which reads a 2D padding mask and scans its tokens in
        # the order they come; None: no such layer (then the columns stay in column order)
        recurrent = [t in RECURRENT_LAYER_TYPES for t in self.layer_types]
        self.recurrent = recurrent if any(recurrent) else None
        self.window = text.sliding_window if set(SLIDING_LAYER_TYPES) & set(self.layer_types) else None
        # Gemma 4's sliding layers let each run of vision tokens attend within itself both ways (transformers reads
        # the runs from mm_token_type_ids; here from the placeholders): [B, L] run id, -1 for text
        starts = self.visual & ~torch.nn.functional.pad(self.visual, (1, 0))[:, :-1]
        self.blocks = (starts.long().cumsum(1) - 1).masked_fill(~self.visual, -1) \
            if getattr(text, "use_bidirectional_attention", None) == "vision" else None
        self.outer_mask = None  # the 2D padding mask the outer model got (Gemma 4's LLM gets per-type 4D masks)

    # ---- context manager -------------------------------------------------------------------------------
    def __enter__(self):
        check_llm(self.model, self.method)
        try:
            return self._attach()
        except BaseException:
            self.__exit__()  # no hook outlives a failed entry
            raise

    def _attach(self):
        lm = self.model.model.language_model
        self.handles.append(self.model.model.register_forward_pre_hook(self._on_outer, with_kwargs=True))
        self.handles.append(lm.register_forward_pre_hook(self._on_lm, with_kwargs=True))
        for stage in self.stages:
            if stage.kind in ("pdrop", SCORED):  # scored inside the layer's own hook
                continue
            attn = self.layers[stage.layer - 1].self_attn
            self.handles.append(attn.register_forward_pre_hook(self._scorer(stage), with_kwargs=True))
        for idx in range(self.first, len(self.layers)):
            self.handles.append(self.layers[idx].register_forward_pre_hook(self._on_layer(idx), with_kwargs=True))
        if hasattr(lm, "_deepstack_process"):  # Qwen3-VL: a method, not a module, so no hook: wrap it meanwhile
            lm._deepstack_process = self._deepstack(lm._deepstack_process)
            self.handles.append(_Unwrap(lm, "_deepstack_process"))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return False

    def _deepstack(self, original):
        """Qwen3-VL's DeepStack addition on the current (maybe pruned) columns. ``visual_pos_masks [B, L]`` and
        ``embeds [V, d]`` (one row per image column, row-major): each kept, live image column gets its own row added,
        as transformers' ``_deepstack_process`` adds them, but by a gather and a ``where`` over ``[B, L_cur]`` instead
        of its boolean indexing (a host read per DeepStack layer). Each image column's row is worked out once per
        prefill. Decoding steps carry no image columns: transformers' own."""

        def process(hidden, visual_pos_masks, embeds):
            if not self.prefill:
                return original(hidden, visual_pos_masks, embeds)
            if embeds.shape[0] == 0:  # no image column in the batch
                return hidden
            if self.deepstack_rows is None:
                masks = visual_pos_masks.to(self.keep.device)
                row = (masks.flatten().long().cumsum(0) - 1).view_as(masks).clamp(min=0)  # [B, L]: embeds row
                self.deepstack_rows = (masks, row)
            masks, row = self.deepstack_rows
            kept = (masks.gather(1, self.keep) & self.alive).to(hidden.device)  # [B, L_cur]: kept, live image columns
            rows = row.gather(1, self.keep).to(embeds.device)
            add = embeds.index_select(0, rows.flatten()).view(*rows.shape, -1).to(hidden.device, hidden.dtype)
            return torch.where(kept[..., None], hidden + add, hidden)

        return process

    # ---- per forward ---------------------------------------------------------------------------------
    def _on_outer(self, module, args, kwargs):
        """Remember the 2D padding mask the multimodal model was called with (its LLM may get 4D masks only)."""
        mask = kwargs.get("attention_mask")
        self.outer_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _full_cache(self, cache) -> None:
        """Before the prefill: make the sliding-window layers of ``cache`` keep every column (plain DynamicLayers), so
        the layers the hooks prune hold exactly the columns their masks name; the window is applied by the masks
        (transformers' for the layers before the first pruning, the hooks' after), so attention is unchanged."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if self.window is None or layers is None:
            return
        for i, layer in enumerate(layers):
            if getattr(layer, "is_sliding", False):
                if layer.get_seq_length() > 0:
                    raise RuntimeError("in-LLM pruning needs an empty KV cache at the prefill")
                layers[i] = DynamicLayer()

    def _on_lm(self, module, args, kwargs):
        """Remember the 2D padding mask and whether this forward is the prefill."""
        embeds = kwargs.get("inputs_embeds")
        cache = _cache_of(kwargs)
        past = cache.get_seq_length() if cache is not None else 0
        # transformers 5.25's hybrid cache (Qwen3.5) gives its length as a 0-d tensor: read it once here, where every
        # later test of it (``self.prefill`` in each layer's hook, the mask's length) read the device again
        past = int(past) if isinstance(past, torch.Tensor) else past
        if embeds.shape[0] != self.visual.shape[0]:
            raise ValueError("in-LLM methods run one sequence per prompt: use num_beams=1 and "
                             "num_return_sequences=1")
        self.q_len = embeds.shape[1]
        self.prefill = past == 0
        if self.prefill and self.q_len != self.prompt_len:  # a decoding step whose cache the hook did not find
            raise RuntimeError(f"the language model ran {self.q_len} new tokens without a cache the hooks can read "
                               f"(the prompt has {self.prompt_len}): generate ran without a KV cache (use_cache=False, "
                               "e.g. in the model's generation_config; PrunedVLM.generate refuses the kwarg) or passed "
                               f"it under a name other than {' or '.join(CACHE_ARGUMENTS)}; see "
                               "promprune.models.llm_hooks.check_llm")
        mask2d = kwargs.get("attention_mask")
        B = embeds.shape[0]
        total = past + self.q_len
        if not isinstance(mask2d, torch.Tensor) or mask2d.dim() != 2:
            mask2d = self.outer_mask  # Gemma 4's LLM is given its masks by layer type
        if not isinstance(mask2d, torch.Tensor) or tuple(mask2d.shape) != (B, total):
            mask2d = torch.ones(B, total, dtype=torch.bool, device=embeds.device)
        mask2d = mask2d.to(embeds.device)
        self.mask2d = mask2d.bool()  # [B, past + q]
        if self.prefill:
            self._full_cache(cache)
            L = self.q_len
            cols = torch.arange(L, device=embeds.device).expand(B, L)
            self.keep, self.alive = cols, self.mask2d[:, :L].clone()  # current columns, alive (non-pad, not dead)
            vis = torch.zeros(B, L, dtype=torch.bool, device=embeds.device)
            vis[:, :self.prompt_len] = self.visual.to(embeds.device)[:, :L]
            self.vis = vis
            self.layer_cols = {}  # layer idx -> (keep [B, L_l], alive [B, L_l]) for decoding
            # [B, L] absolute columns holding a recycled (merged) group
            self.merged = torch.zeros(B, L, dtype=torch.bool, device=embeds.device)
            self.deepstack_rows = None  # Qwen3-VL: (image columns, their DeepStack rows), set at the first addition

    def _scorer(self, stage: Stage):
        def hook(attn, args, kwargs):
            if not self.prefill:
                return None
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            with accel.full_float32():  # the scores' float32 products at full precision, as in select
                if stage.kind == "dart":
                    stage.keys = self._key_norms(attn, hidden, kwargs["position_embeddings"])
                else:
                    stage.scores = self._received(attn, hidden, kwargs["position_embeddings"], stage.queries)
            return None
        return hook

    @staticmethod
    def _key_norms(attn, hidden, rope) -> torch.Tensor:
        """L1 norm of every column's attention keys (after the rotary embedding, all KV heads): ``[B, L]``."""
        _, k = _queries_keys(attn, hidden, rope)  # [B, Hkv, L, hd]
        return k.float().abs().sum(dim=(1, 3))

    def _received(self, attn, hidden, rope, queries):
        """Attention each current column receives from the method's queries, ``[B, L_cur]`` (float32).

        "last" (FastV, PyramidDrop): every row's last column, one batched product. "raters" (SparseVLM): each row's
        query rows and raters have their own count, read for the whole batch at once (two reads of the device per
        call, whatever the batch size or token count); the rows are padded to the batch's most, and a score sums
        each row's raters first and zeros after them (a sum over rows that zeros end adds exactly what one row's own
        sum adds, on the CPU). The raters' relevance, a sum along a padded last dimension, may order its sums
        otherwise than one row alone (the last bit of a value compared with the mean)."""
        B, L, _ = hidden.shape
        q, k = _queries_keys(attn, hidden, rope)  # [B, H, L, hd], [B, Hkv, L, hd]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
        keep, alive = self.keep.to(q.device), self.alive.to(q.device)  # the layer's device (a model spread over GPUs)
        if queries == "last":
            logits = (q[:, :, -1:].float() @ k.transpose(-1, -2)) * attn.scaling  # [B, H, 1, L]
            allowed = alive & (keep <= keep[:, -1:])  # [B, L]: live columns up to the last (causal)
            logits = logits.masked_fill(~allowed[:, None, None], float("-inf"))
            return torch.softmax(logits, dim=-1).mean(dim=(1, 2)).to(hidden.device)
        vis_cols = self.vis.gather(1, self.keep).to(q.device)  # [B, L]
        mask = self._query_mask(vis_cols)
        seen = vis_cols & alive
        n_rows, n_seen = torch.stack([mask.sum(1), seen.sum(1)]).tolist()  # one read for the batch
        R, S = max(n_rows), max(n_seen)
        rows, cols = true_positions(mask, R), true_positions(seen, S)  # [B, R], [B, S]
        H, hd = q.shape[1], q.shape[-1]
        qr = q.gather(2, rows[:, None, :, None].expand(B, H, R, hd)).float()
        logits = (qr @ k.transpose(-1, -2)) * attn.scaling  # [B, H, R, L]
        allowed = alive[:, None, :] & (keep[:, None, :] <= keep.gather(1, rows)[:, :, None])  # [B, R, L] causal
        probs = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        raters = self._raters(probs, cols, _sent([n_rows, n_seen], q.device))  # [B, R]
        n_raters = raters.sum(1).tolist()  # one read for the batch
        # each row's raters, head by head, first in one [B, H x R, L] stack, zeros after: summed over it as a row's
        # own [H, raters, L] rows are (a sum's rows after the last real one add zeros, exactly)
        nr = _sent(n_raters, q.device)
        slot = torch.arange(H * R, device=q.device)
        per = nr.clamp(min=1)[:, None]
        head, nth = (slot // per).clamp(max=H - 1), slot % per  # [B, H x R]; past a row's raters: masked below
        src = head * R + true_positions(raters, R).gather(1, nth.clamp(max=R - 1))
        picked = probs.reshape(B, H * R, L).gather(1, src[..., None].expand(-1, -1, L))
        picked = picked.masked_fill(~(slot < H * nr[:, None])[..., None], 0)
        return (picked.sum(1) / (H * nr)[:, None]).to(hidden.device)

    def _query_mask(self, vis_cols: torch.Tensor) -> torch.Tensor:
        """``[B, L_cur]`` bool: the live text columns after each row's last visual column (``vis_cols [B, L_cur]``:
        the current columns that are visual, live or dead): SparseVLM's query rows, DART's text."""
        pos = torch.arange(vis_cols.shape[1], device=vis_cols.device)
        last_vis = torch.where(vis_cols, pos, -1).amax(dim=1)  # [B]
        return (pos > last_vis[:, None]) & self.alive.to(vis_cols.device) & ~vis_cols

    @staticmethod
    def _raters(probs, vis_cols, counts) -> torch.Tensor:
        """SparseVLM raters, ``[B, R]`` bool: each row's query rows of ``probs [B, H, R, L]`` whose total attention to
        its live visual columns ``vis_cols [B, S]`` (ascending) is at least the mean over its query rows (``counts
        [2, B]``: each row's query rows and live visual columns; the padding after them is never a rater)."""
        B, H, R, _ = probs.shape
        n_rows, n_seen = counts
        seen = torch.arange(vis_cols.shape[1], device=probs.device) < n_seen[:, None]  # [B, S]
        attn = probs.gather(3, vis_cols[:, None, None, :].expand(B, H, R, -1))
        relevance = attn.masked_fill(~seen[:, None, None], 0).sum(-1).mean(1)  # [B, R]
        real = torch.arange(R, device=probs.device) < n_rows[:, None]
        mean = relevance.masked_fill(~real, 0).sum(1) / n_rows.clamp(min=1)
        return real & (relevance >= mean[:, None])

    def _on_layer(self, idx):
        stage = next((s for s in self.stages if s.layer == idx), None)

        def hook(layer, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if self.prefill:
                if stage is not None:
                    with accel.full_float32():  # the ranking's float32 products at full precision, as in select
                        if stage.kind == "pdrop":
                            stage.scores = self._own_ranking(layer, hidden, kwargs, idx)("attention")
                        elif stage.kind == SCORED:
                            stage.scores = self._scored(stage, layer, hidden, kwargs, idx)
                        hidden = self._prune(stage, hidden.to(self.keep.device))
                self.layer_cols[idx] = (self.keep, self.alive, self._gone().sum(1))
                kwargs = self._prefill_kwargs(kwargs, hidden, idx)
                if self.recurrent is not None:  # dead columns zero: a linear layer masks by multiplying (NaN * 0)
                    hidden = hidden.masked_fill(~self.alive[..., None], 0)
            else:
                kwargs = self._decode_kwargs(idx, kwargs, hidden)
            if "hidden_states" in kwargs or not args:
                kwargs["hidden_states"] = hidden
                return (), kwargs
            return (hidden, *args[1:]), kwargs
        return hook

    def _own_ranking(self, layer, hidden, kwargs, idx: int) -> Callable[[str], torch.Tensor]:
        """``get(what)``: decoder layer ``idx``'s own ranking of its input ``hidden`` (the current columns), on the
        layer's own device (a model spread over GPUs): "attention", the last token's attention with the layer's
        projections on its input-normed states (PyramidDrop's), or "key_norms", the L1 norms of its keys (DART's
        kind). The normed states and rotary embeddings are made once, at the first call."""
        made = {}

        def get(what: str) -> torch.Tensor:
            if not made:
                dev = layer.input_layernorm.weight.device
                made["normed"] = layer.input_layernorm(hidden.to(dev))
                made["rope"] = tuple(t.to(dev) for t in self._rope(kwargs, hidden, idx))
            if what == "attention":
                return self._received(layer.self_attn, made["normed"], made["rope"], "last")
            return self._key_norms(layer.self_attn, made["normed"], made["rope"])
        return get

    def _scored(self, stage: Stage, layer, hidden, kwargs, idx: int) -> torch.Tensor:
        """A scored stage's scores ``[B, L_cur]``: the method's ``score`` of layer ``idx``'s input
        (:class:`ScoreInputs`), called once for the batch; a score that is no float tensor of the columns' shape is a
        ValueError naming the method (its values are checked in :meth:`_prune`'s read)."""
        dev = hidden.device
        alive, keep = self.alive.to(dev), self.keep.to(dev)
        own = self._own_ranking(layer, hidden, kwargs, idx)
        inputs = ScoreInputs(hidden, self.vis.to(dev).gather(1, keep) & alive, alive, keep, idx,
                             self.stages.index(stage), lambda what: own(what).to(dev))
        scores = stage.score(inputs, **stage.options)
        B, L = hidden.shape[:2]
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or tuple(scores.shape) != (B, L):
            got = (f"a {scores.dtype} tensor of shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor)
                   else f"a {type(scores).__name__}")
            raise ValueError(f"in-LLM method {self.method!r}: its score returned {got} at layer {idx}; a score is a "
                             f"float tensor [B, L] = [{B}, {L}], one value per column of the layer's input "
                             "(inputs.hidden's first two dimensions; the candidates inputs.visual are ranked, the "
                             "highest kept), e.g. inputs.hidden.float().norm(dim=-1)")
        return scores

    # ---- pruning ---------------------------------------------------------------------------------------
    def _prune(self, stage: Stage, hidden: torch.Tensor) -> torch.Tensor:
        """Keep ``stage.target`` visual columns per row (+ recycling); returns the gathered hidden states.

        Batched over the rows: the host reads the device once per stage (each row's live visual columns, and DART's
        text columns); every other count follows from those and the targets, and the columns are chosen by masks
        and sorts over ``[B, L]``. The rows keep one length: a row that keeps fewer columns than the longest is
        filled with its first dropped columns (the method's order: by score, DART's by column), dead."""
        B, L, D = hidden.shape
        dev = hidden.device
        if stage.keys is not None:
            stage.keys = stage.keys.to(dev)
        vis_cols = self.vis.gather(1, self.keep)
        vis_alive = vis_cols & self.alive  # [B, L]: the candidates
        text = self._query_mask(vis_cols) if stage.kind == "dart" else None
        extra = [] if text is None else [text.sum(1)]
        if stage.kind == SCORED:  # a method of one's own: its candidates' non-finite scores, in the same read
            extra.append((~torch.isfinite(stage.scores.to(dev)) & vis_alive).sum(1))
        counts = torch.stack([vis_alive.sum(1)] + extra).tolist()  # the one read
        if stage.kind == SCORED and any(counts[-1]):
            rows = [b for b, n in enumerate(counts[-1]) if n]
            raise ValueError(f"in-LLM method {self.method!r}: its score gave NaN or infinite values to visual tokens "
                             f"at layer {stage.layer} (batch rows {rows}: {[counts[-1][b] for b in rows]} tokens); "
                             "the hooks rank the visual tokens by it, so every candidate's score must be finite "
                             "(mask what the score cannot rate with a finite low value, e.g. torch.nan_to_num)")
        n_cand = counts[0]
        n_keep = [min(t, n) for t, n in zip(stage.targets, n_cand)]
        hidden = hidden.clone()
        pos = torch.arange(L, device=dev).expand(B, L)
        if stage.kind == "dart":
            kept, order = self._dart_kept(stage, hidden, vis_alive, text, n_cand, counts[1], n_keep), pos
        else:
            kept, order = self._ranked_kept(stage, hidden, vis_alive, n_cand, n_keep)
        dropped = vis_alive & ~kept
        sizes = [L - n + k for n, k in zip(n_cand, n_keep)]  # each row's other columns and kept ones
        width = max(sizes)
        fill = _sent([width - n for n in sizes], dev)  # dead fillers so all rows have the same length
        filler = order.masked_fill(~dropped, 2 * L).argsort(dim=1, stable=True)  # dropped columns first, in order
        nth = torch.empty_like(filler).scatter_(1, filler, pos)  # each dropped column's place among them
        extra = dropped & (nth < fill[:, None])
        chosen = ~vis_alive | kept | extra
        live = chosen & self.alive & ~extra
        # column order; on a hybrid LLM every dead column first (like left padding), so a linear-attention
        # layer's scan meets the kept tokens alone, in order, after a zero prefix that leaves its state zero
        key = pos + L * live.long() if self.recurrent is not None else pos
        rel = key.masked_fill(~chosen, 3 * L).argsort(dim=1)[:, :width]
        self.keep = self.keep.gather(1, rel)
        self.alive = live.gather(1, rel)
        return hidden.gather(1, rel[..., None].expand(-1, -1, D))

    def _ranked_kept(self, stage, hidden, vis_alive, n_cand, n_keep):
        """``(kept [B, L] bool, rank [B, L])`` for the ranking methods: each row's candidates ranked by ``stage.scores``
        (descending; a tie to the earlier column), the first ``n_keep`` kept. With recycling (SparseVLM) the top
        ``recycle`` of each row's deleted columns are merged around the first ``ceil(merge * n)`` of them
        (:meth:`_merge`, into ``hidden``), which stay in place of as many of the lowest-ranked kept columns."""
        B, L = vis_alive.shape
        scores = stage.scores.to(hidden.device)  # ranked on the layer's device
        order = scores.masked_fill(~vis_alive, float("-inf")).argsort(dim=1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(L, device=order.device).expand(B, L))
        pools, centres = [0] * B, [0] * B
        for b in range(B):  # host arithmetic on the counts already read
            deleted = n_cand[b] - n_keep[b]
            if stage.recycle > 0 and deleted > 0:
                pools[b] = math.ceil(stage.recycle * deleted)
                centres[b] = min(math.ceil(stage.merge * pools[b]), n_keep[b]) if pools[b] else 0
        sent = _sent([n_keep, centres, pools], rank.device)
        if max(centres):
            self._merge(hidden, order, sent, max(pools), max(centres),
                        max(p - c for p, c in zip(pools, centres)) + 1)
        keep_n, c = sent[0, :, None], sent[1, :, None]
        kept = (rank < keep_n - c) | ((rank >= keep_n) & (rank < keep_n + c))
        return kept & vis_alive, rank

    def _merge(self, hidden, order, sent, P, C, M):
        """SparseVLM's recycling, for the whole batch (into ``hidden [B, L, D]``): row ``b``'s pool is its deleted
        columns ranked ``n_keep .. n_keep + pool`` in ``order [B, L]`` (relative columns, best first; ``sent [3, B]``:
        ``n_keep``, centres, pool sizes; ``P``, ``C``, ``M``: the batch's largest pool, centre count and group). Each
        pool column joins the most cosine-similar of the pool's first ``centres`` (the centres, each its own group),
        and each centre's hidden state becomes its group's mean. The groups are summed as a padded ``[B, C, M, D]``
        tensor, each member in pool order and zeros after, so each mean is the sum ``hidden[b][group].mean(0)``
        makes, without reading the groups' sizes on the host (bit for bit on the CPU at hidden sizes that are
        multiples of 32, every model's here; a GPU orders a reduction's sums by its shape, so there a mean may differ
        from the per-group one in the last bit)."""
        B, L, D = hidden.shape
        dev = hidden.device
        n_keep, n_centres, n_pool = sent[0, :, None], sent[1, :, None], sent[2, :, None]
        p = torch.arange(P, device=dev)
        pool = order.gather(1, (n_keep + p) % L)  # [B, P] distinct columns; those past a row's pool are not members
        member = p < n_pool  # [B, P]
        centre = torch.arange(C, device=dev) < n_centres  # [B, C]
        states = hidden.gather(1, pool[..., None].expand(-1, -1, D))  # [B, P, D]
        feats = torch.nn.functional.normalize(states.float(), dim=-1)
        sims = (feats @ feats[:, :C].transpose(1, 2)).masked_fill(~centre[:, None], float("-inf"))
        assign = sims.argmax(dim=2)  # [B, P] -> centre
        assign[:, :C] = torch.where(centre, torch.arange(C, device=dev), assign[:, :C])
        members = (assign[..., None] == torch.arange(C, device=dev)) & member[..., None]  # [B, P, C]
        slot = (members.long().cumsum(1) - 1).gather(2, assign[..., None])[..., 0]  # [B, P] place in its group
        # a non-member goes to a group of its own past the centres (C), never summed
        group = torch.where(member, assign, C)
        groups = hidden.new_zeros(B, C + 1, M, D)
        batch = torch.arange(B, device=dev)[:, None].expand(B, P)
        groups[batch, group, slot.clamp(min=0, max=M - 1)] = states
        half = hidden.dtype in (torch.float16, torch.bfloat16)  # mean's own float32 sum for these
        total = groups[:, :C].sum(dim=2, dtype=torch.float32 if half else None)  # [B, C, D]
        means = (total / members.sum(1)[..., None]).to(hidden.dtype)
        target = pool[:, :C]  # the centres (and, past a row's centres, pool columns left as they are)
        means = torch.where(centre[..., None], means, states[:, :C])
        hidden.scatter_(1, target[..., None].expand(-1, -1, D), means)
        absolute = self.keep.gather(1, target)  # relative -> absolute columns
        self.merged.scatter_(1, absolute, self.merged.gather(1, absolute) | centre)

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LLM's final norm applied to ``hidden`` (DART compares tokens on these states), on ``hidden``'s device."""
        norm = self.model.model.language_model.norm
        return norm(hidden.to(norm.weight.device)).float().to(hidden.device)

    def _dart_kept(self, stage, hidden, vis_alive, text, n_cand, n_text, n_keep) -> torch.Tensor:
        """``[B, L]`` bool: DART's kept visual columns, :func:`dart_keep`'s rule on every row at once (each pivot
        step one set of batched ops; each row's counts are host arithmetic on the counts read once)."""
        B = vis_alive.shape[0]
        unit = torch.nn.functional.normalize(self._final_norm(hidden), dim=-1)  # [B, L, D]
        n_img, n_txt = stage.pivots
        img_k = [min(n_img, k, n) for k, n in zip(n_keep, n_cand)]
        txt_k = [min(n_txt, t) for t in n_text]
        img, txt = _top(stage.keys, vis_alive, img_k), _top(stage.keys, text, txt_k)
        pivots = true_positions(img | txt, max(1, n_img + n_txt))  # [B, P] each row's pivots in column order
        kept, left = img.clone(), vis_alive & ~img
        need = [k - i for k, i in zip(n_keep, img_k)]
        n_left = [n - i for n, i in zip(n_cand, img_k)]
        n_piv = [i + t for i, t in zip(img_k, txt_k)]
        for p in range(n_img + n_txt):  # as many steps as the most pivots a row can have, whatever the batch
            share = [need[b] // n_piv[b] + (1 if p < need[b] % n_piv[b] else 0) if p < n_piv[b] else 0
                     for b in range(B)]
            take = [min(s, n) for s, n in zip(share, n_left)]
            n_left = [n - t for n, t in zip(n_left, take)]
            pivot = unit.gather(1, pivots[:, p, None, None].expand(-1, 1, unit.shape[-1]))  # [B, 1, D]
            sims = (unit @ pivot.transpose(1, 2))[..., 0]  # [B, L]
            took = _top(-sims, left, take)  # each row's least similar remaining candidates
            kept |= took
            left &= ~took
        return kept

    # ---- masks and rotary embeddings ------------------------------------------------------------------
    def _as_mask(self, allowed: torch.Tensor, dtype) -> torch.Tensor:
        """Boolean ``allowed [B, 1, q, kv]`` in the attention implementation's format."""
        if not self.eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    def _gone(self) -> torch.Tensor:
        """``[B, L_prompt]`` bool: the non-padding prompt columns pruned so far."""
        gone = self.mask2d[:, :self.prompt_len].clone()
        alive = torch.zeros_like(gone)
        alive.scatter_(1, self.keep, self.alive)  # dead fillers are gone too
        return gone & ~alive

    def _removed(self) -> torch.Tensor:
        """``[B, L_prompt]`` long: how many pruned prompt columns precede each column."""
        gone = self._gone().long()
        return gone.cumsum(1) - gone

    def _rope(self, kwargs, hidden, idx: int):
        """Rotary ``(cos, sin)`` of the current columns at layer ``idx``: their original positions, or (``compact``)
        renumbered contiguously, as PyramidDrop's released code does."""
        cos, sin = kwargs["position_embeddings"]  # [B or 1, L, hd] for the full prompt
        if self.compact:
            pos = kwargs["position_ids"].expand(self.keep.shape[0], -1).gather(1, self.keep)  # [B, L_cur]
            pos = pos - self._removed().gather(1, self.keep)
            return self._rotary(hidden, pos, idx)
        idx = self.keep[..., None].expand(-1, -1, cos.shape[-1])
        return (cos.expand(self.keep.shape[0], -1, -1).gather(1, idx),
                sin.expand(self.keep.shape[0], -1, -1).gather(1, idx))

    def _rotary(self, hidden, pos, idx: int):
        """The LLM's rotary embedding at positions ``pos`` for layer ``idx`` (Gemma 4's differs by layer type)."""
        rotary = self.model.model.language_model.rotary_emb
        if self.layer_types and "layer_type" in inspect.signature(rotary.forward).parameters:
            return rotary(hidden, pos, self.layer_types[idx])
        return rotary(hidden, position_ids=pos)

    def _sliding(self, idx: int) -> bool:
        return self.window is not None and self.layer_types[idx] in SLIDING_LAYER_TYPES

    def _prefill_allowed(self, idx: int) -> torch.Tensor:
        """``[B, q, kv]`` bool over the current columns at layer ``idx``: causal in the original column order, live keys
        only; on a sliding-window layer (Gemma 4) also within the window, counted in live columns (the pruned sequence
        is the sequence these layers hold, as their KV cache does), and each vision run bidirectional within it."""
        allowed = self.keep[:, None, :] <= self.keep[:, :, None]  # [B, q, kv] causal
        if self._sliding(idx):
            if self.blocks is not None:
                run = self.blocks.to(self.keep.device).gather(1, self.keep)  # [B, L_cur]
                allowed = allowed | ((run[:, :, None] == run[:, None, :]) & (run[:, :, None] >= 0))
            rank = self.alive.long().cumsum(1) - 1  # [B, L_cur] place among the live columns
            allowed = allowed & (rank[:, None, :] > rank[:, :, None] - self.window)
        return self.alive[:, None, :] & allowed

    def _prefill_kwargs(self, kwargs, hidden, idx: int):
        if self.recurrent is not None and self.recurrent[idx]:  # linear attention: the 2D mask of live columns
            kwargs["attention_mask"] = self.alive.to(hidden.dtype)  # all ones: x * 1 is x (no read to skip it)
            return kwargs
        allowed = self._prefill_allowed(idx)  # [B, q, kv]
        kwargs["attention_mask"] = self._as_mask(allowed[:, None], hidden.dtype)
        kwargs["position_embeddings"] = self._rope(kwargs, hidden, idx)
        pos = kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.shape[-1] == self.q_len:
            kwargs["position_ids"] = pos.expand(self.keep.shape[0], -1).gather(1, self.keep)
        return kwargs

    def _decode_kwargs(self, idx, kwargs, hidden):
        if self.recurrent is not None and self.recurrent[idx]:  # new tokens only: transformers' recurrent mask holds
            return kwargs
        keep, alive, removed = self.layer_cols[idx]
        if self.compact:  # generated tokens continue the renumbered sequence of this layer
            pos = kwargs["position_ids"].expand(hidden.shape[0], -1) - removed[:, None]
            kwargs["position_embeddings"] = self._rotary(hidden, pos, idx)
        B, q = hidden.shape[:2]
        past_new = self.mask2d.shape[1] - self.prompt_len  # generated tokens incl. this step's
        new_cols = torch.arange(self.prompt_len, self.prompt_len + past_new, device=hidden.device)
        key_ok = torch.cat([alive, self.mask2d[:, self.prompt_len:]], dim=1)  # [B, kv]
        q_pos = new_cols[-q:]  # this step's query columns
        causal = torch.cat([torch.zeros(q, keep.shape[1], dtype=torch.bool, device=hidden.device),
                            new_cols[None, :] > q_pos[:, None]], dim=1)  # [q, kv] True = future
        allowed = key_ok[:, None, :] & ~causal[None]
        if self._sliding(idx):  # the window over live columns: the layer's kept prompt columns, then generated ones
            rank = key_ok.long().cumsum(1) - 1  # [B, kv]
            allowed = allowed & (rank[:, None, :] > rank[:, -q:, None] - self.window)
        kwargs["attention_mask"] = self._as_mask(allowed[:, None], hidden.dtype)
        return kwargs

    # ---- results -------------------------------------------------------------------------------------
    def stats(self, items) -> list[dict]:
        """Per-row Generation fields after the last pruning layer, and the visual tokens each decoder layer ran on
        (``layer_visual_tokens``: every one before the first hooked layer, then the row's live visual columns).
        Worked out on the host from one read of the batch's counts and masks (`transfer.to_host`), whatever the
        batch size (none per row or layer)."""
        import numpy as np

        from .transfer import to_host

        out = []
        hooked = sorted(self.layer_cols)
        final_keep, final_alive, _ = self.layer_cols[hooked[-1]]
        live = torch.stack([(alive & self.vis.gather(1, keep)).sum(1) for keep, alive, _ in
                            (self.layer_cols[i] for i in hooked)])  # [hooked layers, B]
        kept = torch.zeros_like(self.vis).scatter_(1, final_keep, final_alive & self.vis.gather(1, final_keep))
        live, full, visual, kept, merged = to_host([live, self.visual.sum(1), self.visual, kept, self.merged & kept])
        live = dict(zip(hooked, live))
        for b, host in enumerate(host_index(items)):
            run = np.flatnonzero(visual[b])
            kept_cols = np.flatnonzero(kept[b])  # the live visual columns, ascending
            grid_of_run = np.full(run.shape[0], -1, dtype=np.int64)
            grid_of_run[host.run_pos] = host.grid_index
            grid = grid_of_run[np.searchsorted(run, kept_cols)]
            out.append(dict(visual_tokens=int(kept_cols.shape[0]),
                            saliency_count=int(kept_cols.shape[0]) - int(merged[b].sum()),
                            entropy=None,
                            kept=sorted(grid[grid >= 0].tolist()),
                            layer_visual_tokens=[int(live[i][b]) if i in live else int(full[b])
                                                 for i in range(len(self.layers))]))
        return out
