"""Prefix once: the KV cache of an image's prompt prefix, prefilled once and shared by every question about it.

Every chat template we support puts the image before the question, so the prompts of one image's questions share
their beginning up to the end of its visual tokens (LLaVA-1.5: ``USER: `` and the kept visual tokens, 70-95% of the
prompt). When the kept tokens do not depend on the question (``PrunedVLM.shares_prefix``), that *prefix* is
prefilled once per image, its KV cache kept in the :class:`~promprune.models.sharing.ImageCache`, and each batch
of questions prefills only its *suffixes* (the question and the template's tail) on top of it, then decodes.

Layout of a batch. Rows have prefixes of different lengths (images of different sizes) and suffixes of different
lengths (questions), so a row is laid out as ``[pad][prefix][pad][suffix]``: the prefix KV caches are left-padded
to the batch's longest, the suffixes left-padded to theirs, and the attention mask covers both; ``generate`` numbers
the tokens from the mask (cumsum), so every real token keeps the position it has in the unpadded prompt; Qwen's 3D
M-RoPE positions (computed on the whole prompt as without the cache) are moved with their columns; a repetition
penalty counts a row's tokens, not the padding inside its layout (:func:`repetition_penalty`), and the
no-repeat-n-gram ban sees a row's tokens only, in this layout as in a left-padded one (:func:`no_repeat_ngram`).
The prefixes missing from the cache are prefilled together, left-padded, in one forward of the language model (with
the image features; Qwen3-VL's DeepStack rows enter there), and stored unpadded per image until its last question is
answered (``ImageCache.release``). Memory: the stored prefixes of a batch's images beside the batch's own cache,
which holds what the unshared path's does; a batch of images asked once each, none cached, runs the unshared way.

Sliding-window attention (Gemma 4's sliding layers) counts the window in columns, and the padding between a row's
prefix and its suffix would widen it: the prefix cache is used only when every row's span in this layout, the tokens
to generate included, stays inside the window (:func:`fits_window`), so no layer's window cuts anything in either
path; otherwise the batch runs the unshared way. Gemma 4's vision tokens attend to each other both ways in those layers
(``mm_token_type_ids``), which the prefix's prefill is given; the suffixes hold no vision token.

The greedy answers are those of the unshared path up to floating-point rounding: the prefix's keys and values are
the same function of the same tokens and positions, computed in another batch shape (tests/models: the same tokens on
the tiny fp32 models; half precision: benchmarks/RESULTS.md).

A hybrid LLM (Qwen3.5: Gated DeltaNet linear-attention layers between full-attention ones) keeps, per linear layer,
a recurrent state and the last inputs of its short convolution instead of keys and values: a prefix stores each
(:class:`RecurrentState`, one row), and each question's cache gets its own copy (the cache's update copies into its
own tensors; decoding then updates those in place, never the stored prefix). The suffixes' left padding would sit
between a row's prefix state and its suffix, where a linear layer's scan would decay the state and its convolution
read zeros; so while a batch continues (:func:`continuing`), each linear layer scans every row's real suffix tokens
only, from that row's own state (rows of one suffix length together), through transformers' own cache layer.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from promprune.models.llm_hooks import cache_argument, cache_in
from promprune.models.sampling import merged_config


@dataclass
class RecurrentState:
    """A linear-attention layer's cache for one row, per state index: ``conv [1, C, K]`` (the last K inputs of its
    causal convolution) and ``recurrent [1, H, dk, dv]`` (the delta rule's state): constant sizes, whatever the
    prefix's length."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]


@dataclass
class Prefix:
    """One image's prefilled prompt prefix: ``ids [P]`` its tokens and ``layers`` per layer its ``(keys, values)``,
    each ``[1, H, P, D]``, or (a linear-attention layer of a hybrid LLM) its :class:`RecurrentState`."""

    ids: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor] | RecurrentState]

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class Split:
    """Where each row's prompt divides: ``prefix[b]`` / ``suffix[b]`` the row's columns before and after the end of
    its visual tokens (padding excluded)."""

    prefix: list[torch.Tensor]
    suffix: list[torch.Tensor]


def visual_ids(config) -> torch.Tensor:
    """The placeholder token ids the LLM's visual tokens sit at (images and videos)."""
    ids = {getattr(config, name, None)
           for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index")}
    return torch.tensor(sorted(i for i in ids if i is not None))


def split(ids: torch.Tensor, mask: torch.Tensor, visual: torch.Tensor) -> Split | None:
    """``ids / mask [B, L]`` -> each row's prefix (through its last visual token) and suffix columns; None when a
    row has no visual token or nothing after it (no suffix to prefill)."""
    is_visual = torch.isin(ids, visual.to(ids.device))
    prefix, suffix = [], []
    for b in range(ids.shape[0]):
        real = mask[b].nonzero().flatten()
        cols = is_visual[b].nonzero().flatten()
        if cols.numel() == 0:
            return None
        end = int(cols[-1]) + 1
        prefix.append(real[real < end])
        suffix.append(real[real >= end])
        if suffix[-1].numel() == 0:
            return None
    return Split(prefix, suffix)


def sliding_window(config) -> int | None:
    """The LLM's sliding window when some of its layers attend through one (``layer_types``), else None."""
    text = config.get_text_config()
    return text.sliding_window if "sliding_attention" in (getattr(text, "layer_types", None) or []) else None


def fits_window(parts: Split, window: int, new_tokens: int) -> bool:
    """Whether every row of the ``[pad][prefix][pad][suffix]`` layout, ``new_tokens`` generated tokens included, spans
    fewer than ``window`` columns (then the window cuts nothing in this layout, nor in the unshared one, which is
    shorter), and every prefix fits the window's cache (``window - 1`` columns)."""
    suffix = max(s.numel() for s in parts.suffix)
    return max(p.numel() for p in parts.prefix) + suffix + new_tokens <= window - 1


def _new_tokens(vlm, new_tokens: int | None) -> int:
    """The most tokens ``generate`` may add: ``new_tokens`` (its ``max_new_tokens``), else the generation config's."""
    config = vlm.model.generation_config
    return int(new_tokens if new_tokens is not None else config.max_new_tokens or config.max_length)


def inputs(vlm, prep, cache, new_tokens: int | None = None) -> dict | None:
    """``generate`` kwargs that continue each row of ``prep`` from its image's cached prefix (prefilling the missing
    ones into ``cache.prefixes``): ``input_ids`` / ``attention_mask`` laid out ``[pad][prefix][pad][suffix]``,
    ``past_key_values`` holding the prefixes, and the moved ``position_ids`` where the adapter gives them. None
    when a row cannot be split (:func:`split`), or when every row is about another image and none is cached (one
    question per image, as VizWiz or ScienceQA: a stored prefix would only double the batch's KV memory), or when a
    sliding window could cut the layout (:func:`fits_window`; ``new_tokens``: ``generate``'s ``max_new_tokens``):
    then the batch runs without the prefix cache. Prefixes another wrapper left in ``cache`` under ``prep``'s keys
    are dropped (``ImageCache.claim``; a no-op where ``sharing.prepare`` claimed them in the same cache), never
    continued: ``prep`` may have been prepared with another cache, or none."""
    kwargs = prep.model_kwargs
    cache.claim(prep.keys, vlm.cache_owner)  # another wrapper's prefixes for these images are not this one's
    if len(set(prep.keys)) == len(prep.keys) and not any(k in cache.prefixes for k in prep.keys):
        return None  # every image asked once here and none cached: a prefix would be prefilled for nothing
    ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
    parts = split(ids, mask, visual_ids(vlm.model.config))
    if parts is None:
        return None
    window = sliding_window(vlm.model.config)
    if window is not None and not fits_window(parts, window, _new_tokens(vlm, new_tokens)):
        return None
    rows = [_find(cache, key, ids[b, parts.prefix[b]]) for b, key in enumerate(prep.keys)]
    missing = {}  # the first row of every prefix not yet cached
    for b, (key, found) in enumerate(zip(prep.keys, rows)):
        if found is None and not any(k == key and torch.equal(ids[r, parts.prefix[r]], ids[b, parts.prefix[b]])
                                     for r, k in missing.items()):
            missing[b] = key
    if missing:
        _prefill(vlm, prep, parts, list(missing), cache)
        rows = [_find(cache, key, ids[b, parts.prefix[b]]) for b, key in enumerate(prep.keys)]
    return _continuation(vlm, kwargs, parts, rows)


class AttendedRepetitionPenalty(LogitsProcessor):
    """transformers' repetition penalty (its own ``RepetitionPenaltyLogitsProcessor``, so its arithmetic) over the
    tokens each row attends to: the prompt's columns the attention mask leaves out are not counted. transformers
    leaves out only a row's leading padding (``prompt_ignore_length``), which is all of it in the unshared layout;
    in the ``[pad][prefix][pad][suffix]`` one it counted the padding between a row's prefix and its suffix, whose
    width its batch mates decide, so a row's pad token was penalised or not by the batch it was in (Qwen's pad,
    ``<|endoftext|>``, is one of its end tokens)."""

    def __init__(self, penalty: float, attention_mask: torch.Tensor):
        self.penalty = RepetitionPenaltyLogitsProcessor(float(penalty))
        self.ignored = attention_mask == 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ignored = torch.nn.functional.pad(self.ignored.to(input_ids.device),
                                          (0, input_ids.shape[1] - self.ignored.shape[1]), value=False)
        # an id of the vocabulary's size is clamped to transformers' dropped extra column: never penalised
        return self.penalty(input_ids.masked_fill(ignored, scores.shape[-1]), scores)


# generate's processors that run between its repetition penalty and the caller's processors and do not commute with
# the penalty (the others there only set scores to -inf, or to 0 beside -inf, which it leaves as they are)
_NOT_COMMUTING = ("exponential_decay_length_penalty", "remove_invalid_values")


def repetition_penalty(model, generation_kwargs: dict, attention_mask: torch.Tensor) -> tuple[dict, list]:
    """``(kwargs, processors)`` for a batch laid out with padding inside its rows (the prefix layout): where the
    repetition penalty ``generate`` would apply (``generation_kwargs`` over the model's generation config) is on,
    ``repetition_penalty=1.0`` in ``kwargs`` (in a copy of the caller's ``generation_config`` where one is passed;
    generate builds none) and :class:`AttendedRepetitionPenalty` to put
    first among the caller's processors (after generate's own, as its penalty's only followers there only mask:
    the same scores). Else, or where the caller passes a penalty processor of its own (which replaces generate's),
    or sets a knob of :data:`_NOT_COMMUTING`: ``generation_kwargs`` as they are and no processor."""
    merged = merged_config(model, generation_kwargs)
    penalty = merged.repetition_penalty
    own = any(isinstance(p, RepetitionPenaltyLogitsProcessor) for p in generation_kwargs.get("logits_processor") or ())
    if penalty is None or penalty == 1.0 or own or any(getattr(merged, k, None) for k in _NOT_COMMUTING):
        return generation_kwargs, []
    started = attention_mask.cumsum(-1) > 0
    if not bool(((attention_mask == 0) & started).any()):  # padding only in front: transformers' own leaves it out
        return generation_kwargs, []
    processors = [AttendedRepetitionPenalty(penalty, attention_mask)]
    # 1.0 set, not None: the model's own config does not fill it in
    return _switched_off(generation_kwargs, "repetition_penalty", 1.0), processors


def _switched_off(generation_kwargs: dict, name: str, value) -> dict:
    """``generation_kwargs`` with ``generate``'s setting ``name`` at ``value``: in a copy of the caller's
    ``generation_config`` where one is passed and ``name`` is no kwarg (not a kwarg beside a config: deprecated, and a
    later transformers would apply the config's setting too), else as a kwarg."""
    if generation_kwargs.get("generation_config") is not None and name not in generation_kwargs:
        config = copy.deepcopy(generation_kwargs["generation_config"])
        setattr(config, name, value)
        return {**generation_kwargs, "generation_config": config}
    return {**generation_kwargs, name: value}


class AttendedNoRepeatNGram(LogitsProcessor):
    """transformers' no-repeat-n-gram ban (its own ``NoRepeatNGramLogitsProcessor``, so its matching) over the tokens
    each row attends to: the prompt's columns the attention mask leaves out are dropped, so each row's n-grams are
    those of its unpadded prompt and its answer, as a batch of one sees them. transformers' reads every column,
    padding included: n-grams of pad ids (``no_repeat_ngram_size=1`` banned the pad token in every padded batch) and
    n-grams across a padding run (its pad ids in place of the neighbours the row has unpadded) banned tokens or
    failed to, with the padding the row's batch mates decide.

    Each row's attended prompt tokens are packed once (at the first step) to the right of a fill id that no token
    has (past the vocabulary and every prompt id): a window holding fill matches no row's last tokens unless it is
    those tokens' own window, which transformers never counts, and a banned fill (every token is, at size 1) lands in
    transformers' dropped extra column; the generated tokens follow. ``attention_mask`` ``[B, L]``: the prompt's; a
    batch of ``B * k`` rows (``k`` beams each) repeats each row's ``k`` times, as ``generate`` expands the prompt."""

    def __init__(self, ngram_size: int, attention_mask: torch.Tensor):
        self.ngrams = NoRepeatNGramLogitsProcessor(int(ngram_size))
        self.mask = attention_mask != 0
        self.prompt: torch.Tensor | None = None  # [rows, W]: the packed prompts

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        width = self.mask.shape[1]
        if self.prompt is None:
            keep = self.mask.to(input_ids.device).repeat_interleave(input_ids.shape[0] // self.mask.shape[0], 0)
            fill = max(scores.shape[-1], int(input_ids[:, :width].max()) + 1)
            self.prompt = _packed(input_ids[:, :width], keep, fill)
        return self.ngrams(torch.cat([self.prompt, input_ids[:, width:]], dim=1), scores)


def _packed(ids: torch.Tensor, keep: torch.Tensor, fill: int) -> torch.Tensor:
    """``ids [R, L]`` -> ``[R, W]``: each row's kept tokens in order, right-aligned, ``fill`` before them (``W``: the
    most any row keeps)."""
    count = keep.sum(1)
    width = int(count.max())
    cols = keep.long().cumsum(1) - 1 + (width - count)[:, None]
    out = ids.new_full((ids.shape[0], width + 1), fill)  # column ``width``: where the dropped columns land
    out.scatter_(1, torch.where(keep, cols, width), ids)
    return out[:, :width]


# generate's processors that run between its no-repeat-n-gram ban and the caller's processors and do not commute with
# the ban (it sets scores to -inf; forcing a token, turning -inf finite or adding to -inf, a ban after them differs)
_NOT_COMMUTING_WITH_BAN = ("forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
                           "exponential_decay_length_penalty")


def no_repeat_ngram(model, generation_kwargs: dict, attention_mask: torch.Tensor) -> tuple[dict, list]:
    """``(kwargs, processors)`` for a padded batch (the prefix layout, or rows left-padded to one length): where the
    no-repeat-n-gram ban ``generate`` would apply (``no_repeat_ngram_size`` of ``generation_kwargs`` over the model's
    generation config) is on and some row is padded, ``no_repeat_ngram_size=0`` in ``kwargs`` (in a copy of the
    caller's ``generation_config`` where one is passed) and :class:`AttendedNoRepeatNGram` to put first among the
    caller's processors (after :func:`repetition_penalty`'s, as generate's ban follows its penalty; the processors of
    generate's between them only mask: the same scores). Else, or where the caller passes an n-gram processor of its
    own (which replaces generate's), or sets a knob of :data:`_NOT_COMMUTING_WITH_BAN`: ``generation_kwargs`` as they
    are and no processor."""
    merged = merged_config(model, generation_kwargs)
    size = merged.no_repeat_ngram_size
    own = any(isinstance(p, NoRepeatNGramLogitsProcessor) for p in generation_kwargs.get("logits_processor") or ())
    blocked = [getattr(merged, k, None) for k in _NOT_COMMUTING_WITH_BAN]  # a token id 0 sets its knob
    if not size or size <= 0 or own or any(v is not None and v is not False for v in blocked):
        return generation_kwargs, []
    if bool(attention_mask.all()):  # no padding: transformers' own sees each row's tokens
        return generation_kwargs, []
    return _switched_off(generation_kwargs, "no_repeat_ngram_size", 0), [AttendedNoRepeatNGram(size, attention_mask)]


def _find(cache, key, ids: torch.Tensor) -> Prefix | None:
    """The cached prefix of image ``key`` whose tokens are ``ids`` (an image's questions share it)."""
    for prefix in cache.prefixes.get(key, ()):
        if prefix.length == ids.shape[0] and torch.equal(prefix.ids, ids):
            return prefix
    return None


def _left_padded(rows: list[torch.Tensor], fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Column index lists ``B x [n_b]`` -> ``(cols [B, max n], real [B, max n])``, right-aligned; ``fill`` in the
    padding."""
    width = max(r.numel() for r in rows)
    cols = torch.full((len(rows), width), fill, dtype=torch.long, device=rows[0].device)
    for b, r in enumerate(rows):
        cols[b, width - r.numel():] = r
    return cols, cols >= 0


def _gather(kwargs: dict, cols: torch.Tensor, real: torch.Tensor, pad_id: int) -> dict:
    """``input_ids`` / ``attention_mask`` (and ``position_ids`` when given) at columns ``cols [B, L']`` of the
    prepared rows; padding where ``real`` is False (pad token, mask 0, position 0)."""
    src = cols.clamp_min(0)
    out = {"input_ids": kwargs["input_ids"].gather(1, src).masked_fill(~real, pad_id),
           "attention_mask": real.to(kwargs["attention_mask"].dtype)}
    if kwargs.get("mm_token_type_ids") is not None:  # Gemma 4: its vision tokens' bidirectional runs
        out["mm_token_type_ids"] = kwargs["mm_token_type_ids"].gather(1, src).masked_fill(~real, 0)
    if kwargs.get("position_ids") is not None:
        pos = kwargs["position_ids"]  # [K, B, L] (Qwen: text row + 3D M-RoPE rows)
        index = src.to(pos.device)[None].expand(pos.shape[0], -1, -1)
        out["position_ids"] = pos.gather(2, index).masked_fill(~real.to(pos.device)[None], 0)
    return out


@torch.inference_mode()
def _prefill(vlm, prep, parts: Split, rows: list[int], cache) -> None:
    """Prefill the prefixes of ``rows`` (one per image) in one left-padded forward of the language model with their
    image features, and store each unpadded in ``cache.prefixes``."""
    pad_id = vlm.processor.tokenizer.pad_token_id
    cols, real = _left_padded([parts.prefix[b] for b in rows], -1)
    sub = {k: v[rows] for k, v in prep.model_kwargs.items()
           if k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if prep.model_kwargs.get("position_ids") is not None:
        sub["position_ids"] = prep.model_kwargs["position_ids"][:, rows]
    inputs = _gather(sub, cols, real, pad_id)
    if "position_ids" not in inputs:  # numbered from the mask as generate numbers a left-padded prompt (else the
        mask = inputs["attention_mask"].long()  # padding would shift the prefix against the suffix)
        inputs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    fed = [prep.fed[b] for b in rows]
    encoded = vlm.adapter.encoder_outputs([f.item for f in fed], [f.features for f in fed], [f.run_pos for f in fed])
    out = vlm.model.model(**inputs, mm_encoder_outputs=encoded, use_cache=True)
    width = cols.shape[1]
    for i, b in enumerate(rows):
        n = parts.prefix[b].numel()
        layers = [_row_state(layer, i) if _recurrent(layer) else
                  (layer.keys[i:i + 1, :, width - n:].clone(), layer.values[i:i + 1, :, width - n:].clone())
                  for layer in cache_in(out).layers]
        ids = prep.model_kwargs["input_ids"][b, parts.prefix[b]]
        cache.prefixes.setdefault(prep.keys[b], []).append(Prefix(ids=ids, layers=layers))


def _recurrent(layer) -> bool:
    """Whether a cache layer holds a linear-attention layer's states (and no keys / values)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _row_state(layer, i: int) -> RecurrentState:
    """Row ``i`` of a linear-attention cache layer, copied (the left padding before a prefix leaves the state
    zero: its inputs are masked to zero)."""
    states = range(layer.number_of_states)
    return RecurrentState(conv=[layer.conv_states[s][i:i + 1].clone() for s in states],
                          recurrent=[layer.recurrent_states[s][i:i + 1].clone() for s in states])


def _rows_of(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-row ``[1, H, P_b, D]`` -> ``[B, H, width, D]``, each row right-aligned (zeros before: masked padding)."""
    first = tensors[0]
    out = first.new_zeros((len(tensors), first.shape[1], width, first.shape[3]))
    for b, t in enumerate(tensors):
        out[b, :, width - t.shape[2]:] = t[0]
    return out


def _continuation(vlm, kwargs: dict, parts: Split, prefixes: list[Prefix]) -> dict:
    """The batch's ``generate`` kwargs on top of its rows' cached prefixes (see the module docstring)."""
    from transformers import DynamicCache

    B = len(prefixes)
    width = max(p.length for p in prefixes)
    cache = DynamicCache(config=vlm.model.config)
    one = all(p is prefixes[0] for p in prefixes)  # one image's questions (POPE, GQA): views, no copy before update
    for layer in range(len(prefixes[0].layers)):
        if isinstance(prefixes[0].layers[layer], RecurrentState):
            _restore(cache, layer, [p.layers[layer] for p in prefixes])
            _count(cache.layers[layer], width, add=False)
            continue
        if one:
            keys, values = (t.expand(B, -1, -1, -1) for t in prefixes[0].layers[layer])
        else:
            keys, values = (_rows_of([p.layers[layer][i] for p in prefixes], width) for i in (0, 1))
        cache.update(keys, values, layer)  # the cache copies them into its own tensors
    pre_cols, pre_real = _left_padded(parts.prefix, -1)
    suf_cols, suf_real = _left_padded(parts.suffix, -1)
    cols, real = torch.cat([pre_cols, suf_cols], dim=1), torch.cat([pre_real, suf_real], dim=1)
    out = _gather(kwargs, cols, real, vlm.processor.tokenizer.pad_token_id)
    out.pop("mm_token_type_ids", None)  # the suffixes are text: no vision run to attend within
    return {**out, cache_argument(vlm.model): cache}


def _restore(cache, layer: int, states: list[RecurrentState]) -> None:
    """Layer ``layer`` of ``cache`` (a linear-attention layer) holding each row's prefix state. The cache copies them
    into tensors of its own (transformers' first update of a layer is its prefill), so no question's decoding
    touches another's state or the stored prefix."""
    for s in range(len(states[0].conv)):
        cache.update_conv_state(torch.cat([st.conv[s] for st in states]), layer, state_idx=s,
                                conv_kernel_size=states[0].conv[s].shape[-1])
        cache.update_recurrent_state(torch.cat([st.recurrent[s] for st in states]), layer, state_idx=s)


def _count(layer, tokens: int, add: bool = True) -> None:
    """Set (or advance) the tokens a linear-attention cache layer says it has seen, where it counts them
    (transformers >= 5.25: ``cumulative_length_linear``, which ``get_seq_length`` reports for a cache whose first layer
    is one, and generate then feeds only the uncached tokens). Its restore counts the conv window's width instead
    (4), so generate fed the whole prompt again over the cached prefix."""
    counter = getattr(layer, "cumulative_length_linear", None)
    if not isinstance(counter, torch.Tensor):
        return
    if add:
        counter.add_(tokens)
    else:
        counter.fill_(tokens)


def _mixers(model) -> list:
    """The linear-attention token mixers of ``model``'s LLM (Qwen3.5's Gated DeltaNet: ``layer.linear_attn``)."""
    return [layer.linear_attn for layer in model.model.language_model.layers if hasattr(layer, "linear_attn")]


@contextlib.contextmanager
def continuing(model):
    """While active (around ``generate`` on :func:`inputs`' kwargs), a linear-attention layer that continues cached
    states over a left-padded segment scans each row's real tokens only, from its own state: padding between a
    prefix and its suffix would decay the state and feed the convolution zeros. No-op for LLMs without such layers."""
    mixers = _mixers(model)
    for mixer in mixers:
        mixer.forward = _rowwise(mixer.forward, mixer.layer_idx)
    try:
        yield
    finally:
        for mixer in mixers:
            mixer.__dict__.pop("forward", None)  # the class's forward again


def _rowwise(forward, idx: int):
    """``forward`` of linear-attention layer ``idx``, run per suffix length on a cache continuation with padding."""
    # the cache's argument: ``cache_params`` up to transformers 5.23, ``cache`` from 5.24
    name = "cache" if "cache" in inspect.signature(forward).parameters else "cache_params"

    def run(hidden_states, attention_mask=None, **kwargs):
        cache = kwargs.pop(name, None)
        if (cache is None or attention_mask is None or hidden_states.shape[1] == 1
                or bool(attention_mask.all()) or not cache.has_previous_state(idx)):
            return forward(hidden_states, attention_mask=attention_mask, **{name: cache}, **kwargs)
        real = attention_mask.bool().sum(1)  # [B]: the segment is left-padded, so a row's real tokens are its last
        if not bool((attention_mask.bool() == (torch.arange(attention_mask.shape[1], device=real.device)
                                                >= attention_mask.shape[1] - real[:, None])).all()):
            raise ValueError("a cached continuation's padding must precede each row's tokens (left padding)")
        layer = cache.layers[idx]
        out = torch.zeros_like(hidden_states)  # [B, q, D]; padding stays zero
        for n in real.unique().tolist():
            rows = (real == n).nonzero().flatten()
            if n == 0:
                continue
            part = _subset(layer, rows)
            out[rows, -n:] = forward(hidden_states[rows, -n:], **{name: _as_cache(part, idx)}, **kwargs)
            for s in range(layer.number_of_states):  # in place: the cache's tensors keep their addresses
                layer.conv_states[s][rows] = part.conv_states[s]
                layer.recurrent_states[s][rows] = part.recurrent_states[s]
        _count(layer, hidden_states.shape[1])  # the segment, as the layer's own update would count it
        return out

    return run


def _subset(layer, rows: torch.Tensor):
    """A transformers ``LinearAttentionLayer`` holding rows ``rows`` of ``layer``'s states (copies)."""
    from transformers.cache_utils import LinearAttentionLayer

    part = LinearAttentionLayer(number_of_states=layer.number_of_states)
    for s in range(layer.number_of_states):
        part.update_conv_state(layer.conv_states[s][rows], s, conv_kernel_size=layer.conv_kernel_size[s])
        part.update_recurrent_state(layer.recurrent_states[s][rows], s)
    return part


def _as_cache(part, idx: int):
    """A ``Cache`` whose layer ``idx`` is ``part`` (the only layer the linear-attention forward reads)."""
    from transformers.cache_utils import Cache

    return Cache(layers=[part] * (idx + 1))
