"""``PrunedVLM``: a transformers VLM that keeps ``budget`` visual tokens, and ``Generation``, one answer."""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import re
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessorList

import promprune
from promprune.efficiency import Stopwatch
from promprune.dtypes import dtype_problem, parse_dtype
from promprune.records import SampleStats

from . import llm_hooks
from .attention import device_problem, in_llm_attention_problem, model_attention_problems, precision_problem
from .adapters import (
    adapter_for,
    assemble_all,
    attach_keys,
    host_index,
    visual_token_capacity,
    visual_token_ceiling,
    visual_token_floor,
)
from .factories import find_model_factory
from .images import as_batch, batch_lists, load_images, pixel_key
from .prefix import no_repeat_ngram
from .options import OptionError, is_in_llm, next_layout, token_order, validate_method
from .registry import family_of
from .sampling import generation_value as _generation_value
from .batched_select import select_items
from .sequence import shrink_placeholders
from .transfer import to_device, to_host


@dataclass(kw_only=True)
class Generation(SampleStats):
    """One answer: the sample's stats (:class:`promprune.records.SampleStats`), the text and the token ids."""

    text: str
    token_ids: list[int] = field(default_factory=list)  # generated token ids (padding after EOS included)
    # why the answer is no answer: the row's next-token logits held a NaN or +inf at some step (``NonFiniteLogits``);
    # None when they did not. ``eval.generation`` records such a sample as failed with this reason
    error: str | None = None


_WRAPPERS = itertools.count()  # each PrunedVLM's `cache_owner`: never reused in a process

NONFINITE = ("generation produced non-finite logits (NaN or +inf) for this sample, so its answer is meaningless: the "
             "model's computation overflowed or divided by zero (float16 overflow, a fully masked attention row)")


def nonfinite_flagger():
    """A transformers ``LogitsProcessor`` that marks, on the device, the rows whose next-token logits hold a NaN or
    +inf at any step (``.rows``, a bool tensor, None before the first step): no host sync per step; ``PrunedVLM``
    reads it once after ``generate``. It runs after transformers' own processors (custom ones come last), whose
    ``-inf`` (a suppressed token) it leaves alone."""
    from transformers import LogitsProcessor

    class NonFiniteLogits(LogitsProcessor):
        rows = None

        def __call__(self, input_ids, scores):
            bad = (torch.isnan(scores) | torch.isposinf(scores)).any(-1)
            self.rows = bad if self.rows is None else self.rows | bad
            return scores

    return NonFiniteLogits()


@dataclass
class Fed:
    """What the LLM is fed of one image: ``features [M, d]`` at run positions ``run_pos [M]`` (on the device;
    ``host_pos``: the same on the host) of ``item`` (the :class:`~promprune.models.adapters.VisualItem` the adapter's
    ``encoder_outputs`` reads), and the sample's stats."""

    item: object
    features: torch.Tensor
    run_pos: torch.Tensor
    stats: dict
    host_pos: np.ndarray | None = None


@dataclass
class Prepared:
    """A batch ready for the LLM: ``model_kwargs`` for ``generate`` / forward, per-item stats and timings.

    ``fed`` (per row, images only) and ``keys`` (per row, when the rows' images were shared: ``vision_once``) are
    what the prefix cache (:mod:`promprune.models.prefix`) needs to prefill each image's prompt prefix once.
    ``vision_time`` / ``select_time``: the stages' :class:`~promprune.efficiency.Stopwatch` (or a float of ms where
    nothing ran), read by ``vision_ms`` / ``select_ms``: on CUDA the first read waits for the stage's end on the
    device, so ``prepare`` itself never waits to time."""

    model_kwargs: dict
    stats: list[dict]
    items: list
    vision_time: Stopwatch | float
    select_time: Stopwatch | float
    fed: list[Fed] | None = None
    keys: list | None = None

    @property
    def vision_ms(self) -> float:
        return _ms(self.vision_time)

    @property
    def select_ms(self) -> float:
        return _ms(self.select_time)


def _ms(timed: Stopwatch | float) -> float:
    return timed.ms if isinstance(timed, Stopwatch) else float(timed)


class FullBudgetWarning(UserWarning):
    """A :class:`PrunedVLM` whose budget keeps every visual token of an image."""


def _warn_full_budget(config, adapter_options: dict, method: str | None, budget: int | None) -> None:
    if method is None or budget is None:
        return
    # an in-LLM method prunes the prompt's image placeholders, LLaVA-NeXT's / OneVision's newline tokens included
    capacity = (visual_token_ceiling if is_in_llm(method) else visual_token_capacity)(config, adapter_options)
    if capacity is not None and budget >= capacity:
        warnings.warn(f"budget {budget} keeps all {capacity} visual tokens this model gives an image, so images run "
                      f"unpruned under method {method!r} (clips of several frames still prune); use a budget below "
                      f"{capacity} to prune images", FullBudgetWarning, stacklevel=3)


def view_budget(budget: int, views: int) -> int:
    """Each view's tokens under budget_mode 'view_quota': ``budget // views``, ``views`` the most one image gives;
    an OptionError (of ``budget``) when that is none."""
    if budget // views < 1:
        raise OptionError("budget", f"budget_mode 'view_quota' gives each of up to {views} views budget // {views} "
                          f"tokens: budget {budget} gives none; use a budget of at least {views}")
    return budget // views


def construction_problems(config, method: str | None, budget: int | None, method_options: dict,
                          adapter_options: dict, views: int | None) -> list[ValueError]:
    """What constructing a :class:`PrunedVLM` of ``config`` with this method, budget and (validated:
    ``options.validate_method``) options refuses, from the config alone (no weights, no processor), one
    :class:`~promprune.models.options.OptionError` per problem, naming its option: adapter options the family cannot
    run this config with (``Adapter.check_options``: a ``saliency_block`` outside the tower), a text source the
    model has no tower for (``Adapter.instruction_source``), a ``view_quota`` budget that gives a view nothing
    (:func:`view_budget`; ``views``: the most views one image gives, ``Adapter.views``; None, not known without the
    processor: unchecked), an in-LLM method's budget its schedule cannot prune any of the model's images with
    (``llm_hooks.plan_problem`` at the fewest visual tokens every image gives, ``adapters.visual_token_floor``:
    PyramidDrop's released budget semantics below the layer-averaged floor, which only rises with the token count, so
    a budget that fails there fails on every image). A budget that fails only on larger images (LLaVA-NeXT's, InternVL's
    many tiles, Gemma 4's) is not refused here: the run refuses each such image, one failed sample
    (``eval.generation``'s isolation), and the rest run; so is every failing image where no floor is known (None).
    ``PrunedVLM`` refuses the first; the pipeline's preflight names them all, before Ray starts.
    ValueError for a config no registered family runs (``registry.family_of``)."""
    found = family_of(config)
    problems: list[ValueError] = []
    try:
        found.adapter.check_options(config, adapter_options)
    except ValueError as exc:
        problems.append(exc)
    if method is None:
        return problems
    if is_in_llm(method):
        fewest = visual_token_floor(config, adapter_options)
        if budget is not None and fewest is not None:
            problem = llm_hooks.plan_problem(config, method, int(budget), method_options, fewest)
            if problem is not None:
                problems.append(OptionError("budget", f"no image can run: each gives this model at least {fewest} "
                                                      f"visual tokens, and {problem}"))
        return problems
    if promprune.method_spec(method).needs_instruction:
        try:
            found.adapter.instruction_source(method_options.get("text_source", "released"))
        except ValueError as exc:
            problems.append(exc)
    mode = next_layout(method, adapter_options["budget_mode"], adapter_options["image_newline"]).budget_mode
    if mode == "view_quota" and budget is not None and views is not None:
        try:
            view_budget(int(budget), views)
        except ValueError as exc:
            problems.append(exc)
    return problems


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def larger_images_problem(config, method: str | None, budget: int | None, method_options: dict,
                          adapter_options: dict) -> str | None:
    """Why an in-LLM ``budget`` that some images can run (``construction_problems`` passes it) fails on the larger
    ones, or None: ``llm_hooks.plan_problem`` fails at the most visual tokens one image gives, counted as the in-LLM
    methods count them (``adapters.visual_token_ceiling``: LLaVA-NeXT's / OneVision's newline tokens included), but
    not at the fewest (``adapters.visual_token_floor``). Such images are each a failed sample at run time;
    ``PrunedVLM`` warns at construction and the pipeline's preflight says it once, with the first token count that
    fails (the refusal only rises with the count: found by bisection). None too where the most depends on the image
    without a fixed bound (a Qwen without ``image_tokens``, MiniCPM-V 4.6): its failing images are only failed
    samples."""
    if not is_in_llm(method) or budget is None:
        return None
    capacity = visual_token_ceiling(config, adapter_options)
    if capacity is None or llm_hooks.plan_problem(config, method, int(budget), method_options, capacity) is None:
        return None
    runs = visual_token_floor(config, adapter_options) or 0  # the most tokens known to run (0: none known)
    if runs and llm_hooks.plan_problem(config, method, int(budget), method_options, runs) is not None:
        return None  # no image runs it: construction_problems refuses it
    fails = capacity
    while fails - runs > 1:
        mid = (runs + fails) // 2
        if llm_hooks.plan_problem(config, method, int(budget), method_options, mid) is None:
            runs = mid
        else:
            fails = mid
    return (f"{method} at budget {budget} cannot prune an image of {fails} or more visual tokens (this model gives "
            f"one up to {capacity}): each such image is a failed sample, the others run. "
            f"{llm_hooks.plan_problem(config, method, int(budget), method_options, capacity)}")


class PrunedVLM:
    """A transformers VLM of a registered family (:func:`promprune.models.registry.families`: LLaVA, LLaVA-NeXT,
    Qwen2.5-VL, ...) that prunes visual tokens with a registered method.

    ``method=None`` runs the model unpruned. Pre-LLM methods (``promprune.methods()``) select ``budget`` tokens of each
    image before the LLM; ``fastv`` / ``sparsevlm`` / ``dart`` / ``pyramiddrop`` prune inside it. ``method_options`` are
    the method's options plus the adapter options of :data:`promprune.models.options.ADAPTER_OPTIONS`. ``mu`` defaults
    per family (0.42 CLIP, 0.5744 Qwen2.5-VL; ``Family.default_mu``) unless given.

    A budget at or above the visual tokens the model gives one image (``adapters.visual_token_capacity``, where the
    family fixes it; for an in-LLM method ``adapters.visual_token_ceiling``, the newline tokens it also prunes
    included) keeps every token of every image: the model then runs images unpruned under the method's name.
    The pipeline's entry points refuse such a budget; here it is a :class:`FullBudgetWarning` at construction, since
    a clip of several frames has more tokens than an image and such a budget still prunes it.
    """

    def __init__(self, model, processor, method: str | None = "promprune", budget: int | None = None,
                 **method_options):
        self.method_options, adapter_options = validate_method(method, budget, **method_options)
        self.model, self.processor = model.eval(), processor
        # what this wrapper's results in an ImageCache are filed under (never another wrapper's: `ImageCache.claim`)
        self.cache_owner = next(_WRAPPERS)
        self.method, self.budget = method, (None if budget is None else int(budget))  # numpy's ints as Python's
        self.adapter = adapter_for(model, processor, adapter_options)
        self.token_order = token_order(method, adapter_options["token_order"])  # "released" resolved per method
        # LLaVA-NeXT: how the budget meets the views, the newline tokens and the padding ("released" resolved per
        # method)
        self.budget_mode, self.image_newline, self.unpad = next_layout(
            method, adapter_options["budget_mode"], adapter_options["image_newline"], adapter_options["unpad"])
        self.view_budget = None
        # fail now on a dtype the LLM's attention computes wrongly (float64 under eager) or an in-LLM method under an
        # attention whose masks its hooks cannot write (flash_attention_2, flex_attention)
        attention = model_attention_problems(model, method)
        if attention:
            raise ValueError(attention[0])
        _warn_full_budget(model.config, adapter_options, method, self.budget)
        if is_in_llm(method):
            llm_hooks.check_llm(self.model, method)  # fail now on a transformers release whose LLM the hooks misread
            # fail now on layers this LLM cannot rank or prune at (a linear-attention or sliding-window layer), or an
            # LLM the hooks cannot prune (llm_hooks.unsupported)
            llm_hooks.stage_layers(self.model.config, method,
                                   promprune.method_spec(method).resolve(dict(self.method_options), budget=budget),
                                   llm_hooks.model_name(self.model))
        # fail now on a text source the model has no tower for, a view_quota budget that gives a view nothing, an
        # in-LLM budget its schedule cannot prune this model's images with (the same checks as the pipeline's
        # preflight, from this adapter's own processor's most views)
        problems = construction_problems(model.config, method, self.budget, self.method_options, adapter_options,
                                         views=self.adapter.max_views())
        if problems:
            raise problems[0]
        larger = larger_images_problem(model.config, method, self.budget, self.method_options, adapter_options)
        if larger is not None:
            warnings.warn(larger, UserWarning, stacklevel=2)
        if method is not None and not is_in_llm(method):
            self.spec = promprune.method_spec(method)
            if "mu" in self.spec.options and "mu" not in self.method_options:
                self.method_options["mu"] = self.adapter.default_mu
            if self.budget_mode == "view_quota":
                self.view_budget = view_budget(self.budget, self.adapter.max_views())
            # CDPruner's CLIP text tower loaded now: no sample's timed vision stage pays a checkpoint load
            self.adapter.load_instruction(self._text_source())
        self.processor.tokenizer.padding_side = "left"  # batched generation appends on the right

    @classmethod
    def from_pretrained(cls, name_or_path: str, method: str | None = "promprune", budget: int | None = None, *,
                        dtype=None, device_map=None, attn_implementation=None, max_memory=None, **method_options):
        """Load checkpoint and processor the ordinary way (``AutoProcessor`` + the model class), or build a model
        by factory name (:mod:`promprune.models.factories`):

        - ``"tiny:<arch>"`` (arch in :func:`promprune.models.tiny.archs`: every registered family): the offline
          random-weight tiny models of :mod:`promprune.models.tiny` (a private copy, cast to ``dtype``);
        - ``"tiny-easyvqa:llava"``: the same tiny LLaVA trained on easy-vqa's train split
          (:mod:`promprune.training.easyvqa`; trained into ``$PROMPRUNE_CACHE`` on first use, ~3 minutes on 2 CPU cores,
          loaded from there afterwards);
        - ``"shape:<name>"``: a published architecture with random weights (:mod:`promprune.models.shapes`; for
          latency / memory benchmarks, fp16 unless ``dtype`` says otherwise).

        A factory may bring default adapter options (the paper's settings of that model); given options win.
        ``device_map`` "balanced" (or "balanced_low_0", "sequential", an explicit mapping) with ``max_memory`` (GPU
        index -> bytes) spreads one model over several GPUs (:mod:`promprune.models.placement`).

        Refused before anything loads (:mod:`promprune.models.attention`), and checked again on the built model:
        ``dtype`` float64 with ``attn_implementation="eager"`` (NaN in left-padded rows), an in-LLM method with an
        attention other than "sdpa" / "eager", and a ``device_map`` this machine has no such device for ("cuda"
        or a GPU index without a GPU, "mps", a typo). Refused before anything loads too: a ``dtype`` that is none of
        :data:`promprune.dtypes.DTYPES` (a typo, ``torch.int8``).
        """
        validate_method(method, budget, **dict(method_options))  # fail before loading anything
        problem = dtype_problem(dtype) or precision_problem(dtype, attn_implementation) or \
            device_problem(device_map) or in_llm_attention_problem(method, attn_implementation)
        if problem is not None:
            raise ValueError(problem)
        found = find_model_factory(name_or_path)
        if found is not None:
            factory, name = found
            spread = {} if max_memory is None else {"max_memory": max_memory}  # factories of other packages may not
            model, processor, defaults = factory(name, dtype=dtype, device_map=device_map,  # take max_memory
                                                 attn_implementation=attn_implementation, **spread)
            method_options = {**defaults, **method_options}
        else:
            model, processor = _load(name_or_path, dtype, device_map, attn_implementation, max_memory)
        return cls(model, processor, method=method, budget=budget, **method_options)

    def release_extras(self) -> None:
        """Free the device memory of what this wrapper holds beside the model's weights (CDPruner's CLIP text tower,
        moved to host memory; ``Adapter.release_extras``); the model, which other wrappers may share, stays. A worker
        does so for the wrappers it keeps but does not serve, so that a trial's peak memory is its own method's.
        :meth:`restore_extras` (or the next sample that needs them) moves them back."""
        self.adapter.release_extras()

    def restore_extras(self) -> None:
        """Move what :meth:`release_extras` moved back to the model's device (nothing if it was not released)."""
        self.adapter.restore_extras()

    @property
    def device(self):
        return self.model.device

    def conversation(self, prompt: str, media: str = "image") -> str:
        """The chat-templated text of one user turn with one image (``media="video"``: one clip), after the adapter
        option ``system_prompt``'s system turn when set, ready for generation (with the adapter option
        ``enable_thinking`` where set: Qwen3.5's template switch).

        ``<image>`` tags in ``prompt`` (lmms-eval contexts that place the image themselves: the ``egothink_*`` tasks'
        ``USER: <image>\\n...``) are removed, and in a clip's prompt ``<video>`` tags too (``osi_bench`` appends
        ``"\\n<video>"`` for models without ``doc_to_messages``; ``mmsi_video`` writes ``<image>`` per frame), each with
        the newline or space after it, or the tags that end the prompt with the one before them (``"Q\\n<video>"`` and
        ``osi_bench_frames``' ``"Q\\n<image><image>..."`` are ``"Q"``, the prompt those tasks give a model that places
        the media itself), in every family: the image or clip goes where the family's chat template puts it, once.
        lmms-eval's qwen2_5_vl / qwen3_vl / gemma4 models remove the image tag too; on the LLaVA families it was a
        second image placeholder, and on LLaVA-OneVision (whose video token is ``<video>``) a ``<video>`` tag a second
        clip placeholder: every such request failed. An image's prompt keeps a ``<video>`` tag: no lmms-eval image
        task writes one, so there it is the user's text (plain text to most families; LLaVA-OneVision's processor
        refuses it, "Found 1 <video> tokens in the text but no videos were passed", one failed sample that names it)."""
        prompt = strip_media_tags(prompt, media)
        conv = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": prompt}]}]
        system = self.adapter.options.get("system_prompt")
        if system:
            conv.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
        return self.processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False,
                                                  **self.adapter.chat_template_kwargs())

    @property
    def thinks(self) -> bool:
        """Whether the generation prompt opens a reasoning block the answer closes (``<think>`` without its
        ``</think>``: Qwen3.5-4B's template by default, or ``enable_thinking=True``); then the answer text is what
        follows ``</think>`` (empty while the reasoning never closed), as lmms-eval's qwen3_5 model strips it."""
        if getattr(self, "_thinks", None) is None:
            tail = self.conversation("?").rpartition("?")[2]
            self._thinks = "<think>" in tail and "</think>" not in tail
        return self._thinks

    def answer_text(self, decoded: str) -> str:
        """The answer of a decoded generation: stripped, its reasoning block dropped when :attr:`thinks`."""
        if self.thinks:
            decoded = decoded.partition("</think>")[2]
        return decoded.strip()

    def processed(self, images, prompts):
        """Processor outputs for a batch (unpruned placeholders), on the CPU: no model weights involved."""
        images = self.adapter.prepare_images(load_images(images, prompts))
        texts = [self.conversation(p) for p in prompts]
        return self.processor(images=images, text=texts, return_tensors="pt", padding=True,
                              **self.adapter.processor_kwargs())

    def inputs(self, images, prompts):
        """Processor outputs for a batch (unpruned placeholders), on the model's device."""
        return self.on_device(self.processed(images, prompts))

    def on_device(self, host):
        """A copy of processor outputs ``host`` on the model's device (non-blocking copies: the host does not wait
        for the device; the adapter's ``host_inputs`` stay on the host), pixel values in the model's dtype; ``host``
        stays as it is."""
        moved = {k: v.to(self.device, non_blocking=True)
                 if isinstance(v, torch.Tensor) and k not in self.adapter.host_inputs else v for k, v in host.items()}
        if isinstance(host, dict):
            batch = moved
        else:  # the processor's BatchFeature / BatchEncoding
            batch = copy.copy(host)
            batch.data = moved
        if "pixel_values" in batch and batch["pixel_values"].is_floating_point():
            batch["pixel_values"] = batch["pixel_values"].to(self.model.dtype)
        return batch

    @property
    def shares_vision(self) -> bool:
        """Whether one encoding of an image (and its selection) serves all its questions (vision once): unpruned, an
        in-LLM method (the LLM gets the whole image; it prunes inside, per question), or a pre-LLM method that is not
        question dependent (``promprune.method_spec(m).question_dependent``: CDPruner is, it selects per question)."""
        return self.method is None or is_in_llm(self.method) or not self.spec.question_dependent

    @property
    def shares_prefix(self) -> bool:
        """Whether the prompt up to the end of an image's visual tokens is the same for all its questions (prefix
        once): unpruned, or a method that is not question dependent (the in-LLM methods and CDPruner are)."""
        return self.method is None or not promprune.method_spec(self.method).question_dependent

    @torch.inference_mode()
    def prepare(self, images, prompts, *, keys=None, cache=None) -> "Prepared":
        """Encode, select and rebuild the LLM inputs of a batch, without running the LLM.

        ``Prepared.model_kwargs`` are the kwargs for ``model.generate`` or a plain ``model(...)`` forward:
        ``input_ids`` / ``attention_mask`` with shrunk placeholder runs, ``mm_encoder_outputs`` holding the kept
        features, and the adapter's extra kwargs (Qwen's gathered 3D ``position_ids``). Where the adapter gives no
        ``position_ids``, ``generate`` numbers a left-padded row from its mask; a plain forward of a padded batch
        should pass ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)`` the same way (without them the
        model numbers padding too, which DART's key norms after the rotary embedding see).

        ``keys`` (one per row: the image's identity, e.g. ``Request.image_key``; None: a row without one, whose image
        is its own): rows with one key are one image, and
        when :attr:`shares_vision` it is preprocessed, encoded and selected once (vision once), its results kept in
        ``cache`` (a :class:`promprune.models.sharing.ImageCache`; None: for this call only) for later calls of this
        wrapper. The model kwargs are the same as without keys (:mod:`promprune.models.sharing`). A cache holds one
        wrapper's results per image: given results another wrapper (another method, budget, option or model) left
        under a key, this one drops them and makes its own (``ImageCache.claim``), never reads them.
        """
        images, prompts = batch_lists(images, prompts)
        images = load_images(images, prompts)  # decoded once: the processor and the images' keys read these pixels
        if keys is not None and self.shares_vision:
            from . import sharing

            return Prepared(**sharing.prepare(self, images, prompts, list(keys), cache if cache is not None
                                              else sharing.ImageCache()))
        host = self.processed(images, prompts)
        batch = self.on_device(host)
        items, candidates, plan, vision, selecting = self._encode_select(batch, prompts, images)
        fed = self._fed(items, candidates, plan)
        return Prepared(model_kwargs=self._llm_inputs(batch, fed, pruned=plan is not None, host=host),
                        stats=[f.stats for f in fed], items=items, vision_time=vision, select_time=selecting, fed=fed)

    def _encode_select(self, batch, prompts, images):
        """``(items, candidates, plan, vision, selection)`` of a processed batch (of decoded ``images``): the
        adapter's items, what the budget mode selects among, the selections (None: unpruned or an in-LLM method),
        and the two stages' stopwatches (read after the LLM: reading one on CUDA waits for the device)."""
        pre_llm = self.method is not None and not is_in_llm(self.method)
        text_source = self._text_source() if pre_llm else None
        with Stopwatch(self.device) as vision:
            items = self.adapter.encode(batch, need_saliency=pre_llm and self.spec.needs_saliency,
                                        need_vision=pre_llm and (self.spec.reads_vision or text_source == "clip"))
            if text_source is not None:  # one selection per question: the instruction's embedding
                self.adapter.attach_instruction(items, prompts, text_source)
        if pre_llm and self.spec.draws_at_random:  # random draws per image, not per float: hash the pixels (host)
            attach_keys(items, [pixel_key(image) for image in images])
        with Stopwatch(self.device) as selecting:
            candidates = [self._candidates(it) for it in items] if pre_llm else None
            plan = self._plan(candidates) if pre_llm else None
        return items, candidates, plan, vision, selecting

    def _text_source(self) -> str | None:
        """Where the instruction's embedding comes from ("clip" / "llm"), for methods that need one, else None."""
        if not self.spec.needs_instruction:
            return None
        return self.adapter.instruction_source(self.method_options.get("text_source", "released"))

    def pruning(self, prepared: "Prepared"):
        """Context manager active around the LLM call: the in-LLM method's hooks, or nothing."""
        if not is_in_llm(self.method):
            return contextlib.nullcontext()
        return llm_hooks.make(self.method, self.model, prepared.model_kwargs["input_ids"], self.budget,
                              self.method_options)

    @torch.inference_mode()
    def generate(self, images, prompts, *, keys=None, cache=None, prefix_cache: bool = False,
                 sample_seeds=None, **generation_kwargs) -> list[Generation]:
        """Answer ``prompts[i]`` about ``images[i]``; greedy unless ``generation_kwargs`` say otherwise (an in-LLM
        method refuses beam search, ``use_cache=False`` and a static ``cache_implementation``, every method the
        "paged" one, before anything runs: :func:`check_generation_kwargs`). ``generation_kwargs`` are ``generate``'s:
        its settings as kwargs and / or a ``generation_config``, merged as transformers merges them (the config over
        the model's own generation config, a kwarg over both where one is passed); where neither sets ``do_sample`` /
        ``num_beams``, greedy with one beam (:func:`_greedy_by_default`), whatever the model's config says.
        ``no_repeat_ngram_size`` bans what transformers' does on each row alone: not the batch's padding
        (:func:`promprune.models.prefix.no_repeat_ngram`; transformers' own read pad ids as the row's tokens).

        ``sample_seeds`` (one int per row; None: none): with ``do_sample`` (a kwarg's or the config's), row ``i``
        samples from its own random stream seeded from ``sample_seeds[i]`` (:mod:`promprune.models.sampling`: the
        distribution ``generate(do_sample=True)`` samples, drawn per row), so its answer does not depend on the other
        rows of the batch; without them, transformers samples every row from the process's RNG. Greedy decoding
        ignores them.

        ``keys`` / ``cache``: each image encoded and selected once (:meth:`prepare`). ``prefix_cache`` (with keys,
        :attr:`shares_prefix`, one beam and the default KV cache: no ``use_cache=False`` nor ``cache_implementation``
        given): the prompt up to the end of an image's visual tokens is prefilled once and its KV cache reused by every
        question about that image, here and in later calls of this wrapper with the same ``cache``
        (:mod:`promprune.models.prefix`); otherwise ignored. What another wrapper left in ``cache`` is never read: the
        answers with any cache are those with a fresh one.
        """
        check_generation_kwargs(self.method, generation_kwargs)
        _check_seeds(sample_seeds, prompts)
        prep = self.prepare(images, prompts, keys=keys, cache=cache)
        out = self._generate(prep, generation_kwargs, cache=cache if prefix_cache else None, prefix_cache=prefix_cache,
                             sample_seeds=sample_seeds)
        if cache is not None and prep.keys is not None:  # the prefixes of rows without a key: no later call asks
            from .sharing import forget_unkeyed

            forget_unkeyed(cache, prep.keys)
        return out

    @torch.inference_mode()
    def prepare_video(self, clips, prompts, fps: float | None = None) -> "Prepared":
        """:meth:`prepare` for clips (families whose adapter handles clips: :mod:`promprune.models.video`): each clip
        a video file's path or its frames; the adapter options ``video_budget`` / ``video_split`` spread the budget."""
        from . import video

        return Prepared(**video.prepare(self, clips, prompts, fps))

    @torch.inference_mode()
    def generate_video(self, clips, prompts, fps: float | None = None, sample_seeds=None,
                       **generation_kwargs) -> list[Generation]:
        """Answer ``prompts[i]`` about clip ``clips[i]`` (see :meth:`prepare_video`); greedy unless told otherwise
        (``sample_seeds``: as :meth:`generate`'s)."""
        check_generation_kwargs(self.method, generation_kwargs)
        _check_seeds(sample_seeds, prompts)
        return self._generate(self.prepare_video(clips, prompts, fps), generation_kwargs, sample_seeds=sample_seeds)

    def _generate(self, prep: "Prepared", generation_kwargs: dict, cache=None,
                  prefix_cache: bool = False, sample_seeds=None) -> list[Generation]:
        kwargs = _greedy_by_default(generation_kwargs)
        sampling = []  # per-row sampling's warpers and noise, after the caller's processors and the NaN flag
        if sample_seeds is not None and _generation_value(kwargs, "do_sample"):
            from .sampling import per_row_sampling

            kwargs, sampling = per_row_sampling(self.model, kwargs, sample_seeds)
        inputs, prefix_time, continuing = prep.model_kwargs, 0.0, contextlib.nullcontext()
        penalty = []  # the prefix layout's repetition penalty (prefix.repetition_penalty), before the caller's
        if prefix_cache and self.shares_prefix and prep.keys is not None \
                and int(_generation_value(kwargs, "num_beams") or 1) == 1 and _default_cache(kwargs):
            from . import prefix, sharing

            with Stopwatch(self.device) as prefilling:
                cached = prefix.inputs(self, prep, cache if cache is not None else sharing.ImageCache(),
                                       new_tokens=_generation_value(kwargs, "max_new_tokens"))
            if cached is not None:  # else a prompt the prefix cannot split off (see prefix.split): the usual way
                inputs, prefix_time = cached, prefilling  # read after generate: no wait here
                continuing = prefix.continuing(self.model)  # hybrid LLMs: each row's state meets its own suffix
                # the repetition penalty over each row's own tokens, not the padding inside its layout
                kwargs, penalty = prefix.repetition_penalty(self.model, kwargs, inputs["attention_mask"])
        # the no-repeat-n-gram ban over each row's own tokens, not the padding of the batch (either layout)
        kwargs, ngrams = no_repeat_ngram(self.model, kwargs, inputs["attention_mask"])
        pruner = self.pruning(prep)
        flag = nonfinite_flagger()
        kwargs["logits_processor"] = LogitsProcessorList([*penalty, *ngrams, *(kwargs.get("logits_processor") or []),
                                                          flag, *sampling])
        with _Timer(self.model, self.device) as timer, pruner, continuing:
            out = self.model.generate(**inputs, **kwargs)
        stats = pruner.stats(prep.items) if isinstance(pruner, llm_hooks.InLLMPruner) else prep.stats
        new = out[:, inputs["input_ids"].shape[1]:]
        flagged = [] if flag.rows is None else [flag.rows.view(len(new), -1).any(-1)]
        # one read of the answers, their text tokens and their flags
        new, text_tokens, *flagged = to_host([new, self._text_tokens(prep.model_kwargs), *flagged])
        stats = [{**s, "text_tokens": int(n)} for s, n in zip(stats, text_tokens)]
        bad = flagged[0] if flagged else [False] * len(new)
        texts = self.processor.batch_decode(new, skip_special_tokens=True)
        times = dict(vision_ms=prep.vision_ms, select_ms=prep.select_ms, prefill_ms=_ms(prefix_time) + timer.prefill_ms,
                     decode_ms=timer.decode_ms)
        return [Generation(text=self.answer_text(t), **s, **times, token_ids=row.tolist(),
                           error=NONFINITE if nan else None)
                for t, s, row, nan in zip(texts, stats, new, bad)]

    def _text_tokens(self, model_kwargs: dict) -> torch.Tensor:
        """Per row ``[B]`` (on the device, unread), the prompt tokens the LLM reads that are not visual placeholders:
        what the processor built (chat template, question, and anything it inserts around images or frames), padding
        excluded."""
        ids, mask = model_kwargs["input_ids"], model_kwargs["attention_mask"]
        config = self.model.config
        placeholders = {getattr(config, name, None)
                        for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index")}
        visual = torch.zeros_like(ids, dtype=torch.bool)
        for p in sorted(p for p in placeholders if p is not None):  # compared as scalars: no copy of them over
            visual |= ids == p
        return (mask.bool() & ~visual).sum(dim=1)

    def _candidates(self, item):
        """The tokens the budget mode selects among: LLaVA-NeXT's whole view grids ("view_quota"; with ``unpad``
        False fed as LLaVA's "spatial" merge without unpadding, padding included: ``VisualItem.spatial``), its packed
        sequence with the newline tokens ("packed"), else the item's own candidates."""
        if self.budget_mode == "view_quota" and item.full is not None:
            return item.full if self.unpad else item.full.spatial()
        if self.budget_mode == "packed":
            return item.packed()
        return item

    def _plan(self, items):
        """Selections of every item (pre-LLM methods)."""
        return select_items(items, self.budget, self.method, self.method_options, mode=self.budget_mode,
                            order=self.token_order, view_budget=self.view_budget)

    def _fed(self, items, candidates, plan) -> list[Fed]:
        """What the LLM is fed of every image: all of its run (``plan`` None: unpruned, or an in-LLM method, which
        prunes later) or the kept candidates of ``plan`` (their indices on the host; one copy to the device)."""
        if plan is None:
            return [Fed(it, it.run, torch.arange(it.run.shape[0], device=it.run.device),
                        dict(visual_tokens=int(it.run.shape[0]), saliency_count=0, entropy=None,
                             kept=sorted(host.grid_index.tolist()), salient=[]),
                        host_pos=np.arange(it.run.shape[0])) for it, host in zip(items, host_index(items))]
        newline = "drop" if self.budget_mode == "packed" else self.image_newline  # packed: newlines were candidates
        built = assemble_all(candidates, [p.kept.numpy() for p in plan], [p.merged for p in plan],
                             [p.cls for p in plan], newline=newline, prefix_at=[p.cls_at for p in plan])
        fed = []
        for it, p, (feats, run_pos, host_pos) in zip(candidates, plan, built):
            grid = it.host.grid_index
            fed.append(Fed(it, feats, run_pos, dict(
                visual_tokens=int(feats.shape[0]), saliency_count=p.saliency_count, entropy=p.entropy,
                entropy_halfwidth=p.entropy_halfwidth,
                kept=[g for g in grid[p.kept.numpy()].tolist() if g >= 0],  # newline tokens have no grid index
                salient=sorted(grid[p.salient.numpy()].tolist())), host_pos=host_pos))
        return fed

    def _llm_inputs(self, batch, fed: list[Fed], pruned: bool, host=None) -> dict:
        """Model kwargs of a processed batch (unpruned placeholders) whose row ``i`` is fed ``fed[i]``: ``input_ids``
        / ``attention_mask`` (placeholder runs shrunk to the kept tokens when ``pruned``), ``mm_encoder_outputs`` and
        the adapter's extra generate kwargs. ``host``: the batch's processor outputs on the host, where the shrinking
        runs (None: ``input_ids`` / ``attention_mask`` are read from the device once); its result goes to the
        device in one copy."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if pruned:
            host_ids, host_mask = (host["input_ids"], host["attention_mask"]) if host is not None else \
                [torch.from_numpy(a) for a in to_host([ids, mask])]
            host_pos = [torch.from_numpy(f.host_pos) if f.host_pos is not None else f.run_pos.cpu() for f in fed]
            shrunk = shrink_placeholders(host_ids, host_mask, self.model.config.image_token_id, host_pos,
                                         self.processor.tokenizer.pad_token_id, keep_order=self.token_order != "raster",
                                         contiguous=self.adapter.contiguous_run)
            ids, new_mask, col_map = to_device([t.numpy() for t in shrunk], ids.device)
            mask = new_mask.to(mask.dtype)
        else:
            col_map = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # every column stays
        extra = self.adapter.generate_kwargs(batch, ids, mask, col_map)
        encoded = self.adapter.encoder_outputs([f.item for f in fed], [f.features for f in fed],
                                               [f.run_pos for f in fed])
        return dict(input_ids=ids, attention_mask=mask, mm_encoder_outputs=encoded, **extra)


def _check_seeds(sample_seeds, prompts) -> None:
    """``sample_seeds``: None, or one int per prompt (row)."""
    if sample_seeds is None:
        return
    rows = len(as_batch(prompts, "prompts", "prompt", (str, bytes, bytearray)))
    if isinstance(sample_seeds, (str, bytes)) or not hasattr(sample_seeds, "__len__") or len(sample_seeds) != rows \
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in sample_seeds):
        raise ValueError(f"sample_seeds must be one int per row ({rows}), got {sample_seeds!r}")


# what PrunedVLM.generate decodes with where the caller sets neither (as a kwarg or in a generation_config): greedy,
# one beam, whatever the model's own generation config says (a released Qwen2.5-VL's asks to sample)
GREEDY_DEFAULTS = (("do_sample", False), ("num_beams", 1))


def _greedy_by_default(generation_kwargs: dict) -> dict:
    """``generation_kwargs`` with :data:`GREEDY_DEFAULTS` where the caller set neither the kwarg nor the field of a
    ``generation_config`` kwarg: in (a copy of) that config when one is given, else as kwargs. A caller's
    ``generation_config`` is thus merged as transformers' ``generate`` merges it (over the model's generation config;
    a kwarg wins only where the caller passes one): its ``do_sample=True`` samples, where a default ``do_sample=False``
    kwarg used to override it and decode greedily."""
    kwargs = dict(generation_kwargs)
    config = kwargs.get("generation_config")
    unset = [(name, value) for name, value in GREEDY_DEFAULTS if _generation_value(kwargs, name) is None]
    if config is not None and unset:
        config = kwargs["generation_config"] = copy.deepcopy(config)
    for name, value in unset:
        if config is not None and name not in kwargs:
            setattr(config, name, value)
        else:
            kwargs[name] = value
    return kwargs


def _default_cache(generation_kwargs: dict) -> bool:
    """Whether ``generate`` runs with transformers' default KV cache: neither ``use_cache=False`` nor a
    ``cache_implementation`` given. The prefix cache (:mod:`promprune.models.prefix`) hands ``generate`` a filled
    dynamic cache, so it runs only then: with use_cache=False generate read none of it (wrong answers, silently), with
    a cache_implementation transformers refused the pair."""
    use_cache = _generation_value(generation_kwargs, "use_cache")
    return (use_cache is None or bool(use_cache)) and _generation_value(generation_kwargs,
                                                                        "cache_implementation") is None


# The placeholder tags a prompt may carry that stand for the request's own media (:meth:`PrunedVLM.conversation`).
MEDIA_TAGS = {"image": ("<image>",), "video": ("<image>", "<video>")}


def strip_media_tags(prompt: str, media: str = "image") -> str:
    """``prompt`` without the tags that stand for its ``media`` (:data:`MEDIA_TAGS`), every one of them: each tag
    with the newline or space after it, and the tags that end the prompt (one or several, each after the last with
    at most a newline or space between: a task's one tag per frame, ``osi_bench_frames``' ``"Q\\n" + "<image>" *
    32``) with the newline or space before them, so the prompt is the one the task gives a model that places the
    media itself (``"Q"``; lmms-eval's ``include_visual_token=False``)."""
    tag = "|".join(MEDIA_TAGS[media])
    tags = rf"(?:{tag})(?:(?:\r?\n| )?(?:{tag}))*"
    prompt = re.sub(rf"(?:\r?\n| )?{tags}\Z", "", prompt)
    return re.sub(rf"(?:{tag})(?:\r?\n| )?", "", prompt)


# The KV caches an in-LLM method's hooks run with: transformers' dynamic ones, where each layer's cache grows by what
# the layer is given, so a layer after a cut holds its kept columns only (None: transformers' default, dynamic;
# "hybrid": transformers 5.23 runs it as the default). The static ones ("static", "sliding_window", ...) preallocate
# every layer at the unpruned length.
IN_LLM_CACHES = (None, "dynamic", "offloaded", "quantized", "hybrid")
# The caches that make transformers' generate run continuous batching on the token ids alone (no pixel values, no
# encoder outputs): refused for every method (:func:`check_generation_kwargs`).
TEXT_ONLY_CACHES = ("paged",)


def check_generation_kwargs(method: str | None, generation_kwargs: dict) -> None:
    """Refuse, before anything runs, ``generate`` kwargs the run would fail on, each naming the kwarg (given as
    itself or in a ``generation_config`` kwarg): ``num_return_sequences`` other than 1 (one Generation per item), and
    with an in-LLM method (``llm_hooks``) beam search, ``use_cache=False`` and a ``cache_implementation`` other than
    a dynamic one (:data:`IN_LLM_CACHES`). The hooks read the KV
    cache to tell the prefill from a decoding step and leave each layer after a cut its kept columns only: without a
    cache every step reruns the whole sequence (which the hooks took for a prefill of the wrong length, "ran N new
    tokens without a cache the hooks can read"), and a static cache failed with a bare size mismatch in the
    attention. Pre-LLM methods and the unpruned model run with either.

    ``cache_implementation="paged"`` is refused for every method, the unpruned model included
    (:data:`TEXT_ONLY_CACHES`): transformers' ``generate`` then hands the prompt to continuous batching
    (``generate_batch``), which reads only the token ids, so no image's features (pruned or not) would reach the LLM;
    it returned no tokens, silently. In a ``generation_config`` transformers ignores it (the dynamic cache runs, not
    the paged one asked for): refused the same way.

    The sweep's preflight applies this rule to each trial's method on the kwargs each task will generate with
    (``pipelines.preflight.check_generation``), so a spec that breaks it is refused before any work."""
    if int(generation_kwargs.get("num_return_sequences") or 1) != 1:
        raise ValueError("generate returns one Generation per item: num_return_sequences must be 1, got "
                         f"{generation_kwargs['num_return_sequences']!r}")
    given = functools.partial(_generation_value, generation_kwargs)
    if given("cache_implementation") in TEXT_ONLY_CACHES:
        raise ValueError(f"cache_implementation={given('cache_implementation')!r} is refused: transformers' generate "
                         "then switches to continuous batching (generate_batch), which reads only the prompt's token "
                         "ids, so the image's visual tokens (pruned or not) would never reach the language model (in a "
                         "generation_config it is ignored and the dynamic cache runs instead). Leave "
                         "cache_implementation unset (the dynamic KV cache) or name another cache")
    if not is_in_llm(method):
        return
    where = f"in-LLM method {method!r} prunes inside the language model and"
    if int(given("num_beams") or 1) != 1:
        raise ValueError(f"{where} runs one sequence per prompt: num_beams must be 1, got {given('num_beams')!r} "
                         "(use num_beams=1 and num_return_sequences=1)")
    if given("use_cache") is not None and not given("use_cache"):
        raise ValueError(f"{where} reads the KV cache to tell the prefill from each decoding step: use_cache="
                         f"{given('use_cache')!r} is refused (without a cache every step reruns the whole sequence); "
                         "leave use_cache unset or True, or run a pre-LLM method")
    cache = given("cache_implementation")
    if cache not in IN_LLM_CACHES:
        raise ValueError(f"{where} needs a dynamic KV cache (each layer after its cut caches its kept tokens only): "
                         f"cache_implementation={cache!r} is refused (a static cache preallocates every layer at the "
                         f"unpruned length); leave cache_implementation unset or use one of "
                         f"{[c for c in IN_LLM_CACHES if c]}, or run a pre-LLM method")


class _Timer:
    """Prefill = the first forward of ``generate``; decode = the rest of ``generate``'s wall time."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.calls, self.prefill_ms, self.decode_ms = 0, 0.0, 0.0

    def _pre(self, module, args, kwargs):
        if self.calls == 0:
            _sync(self.device)
            self.t_first = time.perf_counter()

    def _post(self, module, args, kwargs, out):
        if self.calls == 0:
            _sync(self.device)
            self.prefill_ms = (time.perf_counter() - self.t_first) * 1e3
        self.calls += 1

    def __enter__(self):
        self.handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        self.model.register_forward_hook(self._post, with_kwargs=True)]
        _sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync(self.device)
        total = (time.perf_counter() - self.t0) * 1e3
        for h in self.handles:
            h.remove()
        self.decode_ms = max(total - self.prefill_ms, 0.0)
        return False


def _dtype(dtype):
    """A torch dtype for a name; None / "auto" stay (the checkpoint's own dtype)."""
    return parse_dtype(dtype, allow_auto=True)


def _load(name_or_path, dtype, device_map, attn_implementation, max_memory=None):
    from .adapters import checkpoint_processor
    from .factories import model_config

    config = model_config(name_or_path)  # not cached while offline, a missing path: a message saying what to do
    try:
        model_cls = family_of(config).transformers_class()
    except ValueError as err:
        raise ValueError(f"{name_or_path}: {err}") from None
    processor = checkpoint_processor(name_or_path, config)  # a missing or wrong processor: before the weights load
    kwargs = {k: v for k, v in dict(dtype=_dtype(dtype), device_map=device_map, max_memory=max_memory,
                                    attn_implementation=attn_implementation).items() if v is not None}
    return model_cls.from_pretrained(name_or_path, **kwargs), processor
