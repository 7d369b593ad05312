"""What every architecture's adapter shares: the candidate tokens of one image and the adapter interface.

Each adapter (one per family, :mod:`promprune.models.architectures`) runs the model's own ``get_image_features`` (so the
projected tokens are exactly the ones the unmodified model would consume) with a saliency hook on one vision layer,
and describes the tokens as a :class:`VisualItem` per image. Pruning then keeps a subset of the candidates; the
placeholder run in the prompt shrinks to match (``sequence.py``) and the kept features go to ``generate`` as
``mm_encoder_outputs``. An adapter that also answers about clips defines ``video_kwargs``, ``encode_video`` and
``video_encoder_outputs`` (and, where its processor needs them, ``prepare_clips`` / ``uniform_clips``;
:mod:`promprune.models.video`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .options import OptionError
from .registry import family_of, find_family
from .transfer import to_device, to_host


@dataclass
class HostIndex:
    """Host copies (numpy) of a :class:`VisualItem`'s index tensors, what the host plans the selection and the LLM's
    input with: ``run_pos`` / ``grid_index`` / ``groups`` ``[N]`` int64, ``cells`` ``[N, 2]`` or None, ``newline``
    ``[P]`` bool / ``row_of_run`` ``[P]`` int64 or None, ``spatial_pos`` ``[N]`` int64 or None."""

    run_pos: np.ndarray
    grid_index: np.ndarray
    groups: np.ndarray
    cells: np.ndarray | None = None
    newline: np.ndarray | None = None
    row_of_run: np.ndarray | None = None
    spatial_pos: np.ndarray | None = None

    @classmethod
    def identity(cls, n: int) -> "HostIndex":
        """One view of ``n`` tokens, each a candidate at its own run position and grid place."""
        idx = np.arange(n, dtype=np.int64)
        return cls(run_pos=idx, grid_index=idx, groups=np.zeros(n, dtype=np.int64))


_HOST_FIELDS = ("run_pos", "grid_index", "groups", "cells", "newline", "row_of_run", "spatial_pos")


@dataclass
class VisualItem:
    """The visual tokens of one image.

    - ``run [P, d]``: the complete unpruned placeholder run as the model builds it (NeXT: with newlines).
    - ``features [N, d]``: the candidates (run tokens that may be selected), in run order; ``run_pos [N]`` their
      positions in ``run`` (-1: a token the model's unpadding drops, in ``full`` only); ``grid_index [N]`` their
      index in the full visual token grid (NeXT: view * n + patch; -1: a newline token, in ``packed()`` only).
    - ``saliency [N]`` or None; ``groups [N]``: view of each candidate (all 0 except LLaVA-NeXT).
    - ``row_of_run [P]`` / ``newline [P]`` (NeXT only): row id of each run position (-1: no row) and newline flags.
    - ``vision [N, dv]`` / ``keys [N, dk]`` or None: the vision tower's hidden states of the candidates before the
      projector, and the attention keys (head mean) of that layer; ``cls [V, dv]`` or None: each view's CLS hidden
      state; ``project``: the model's projector (vision space -> ``d``, float32 out).
    - ``full`` (NeXT only): the same image with every view's whole grid as candidates, padding included; its
      ``spatial_pos [N]``: each candidate's place in LLaVA's "spatial" packing without unpadding (the base view, then
      the crops' stitched grid in raster order, no newline), what :meth:`spatial` feeds; ``stitched``: True on what
      :meth:`spatial` returns (its views are the base view and the crops of one stitched grid).
    - ``grid_shape``: ``(rows, cols)`` of one view's whole token grid (Qwen2.5-VL / Qwen3-VL: the merged-patch
      grid); a candidate's place in it is ``grid_index % (rows * cols)`` in raster order.
    - ``cells [N, 2]`` or None: each candidate's (row, col) in the grid its view is FED as, where that is not its
      source grid (LLaVA-OneVision: the base view's own grid, or the crops' stitched grid after unpadding and
      anyres-max resizing); when set, it places the candidates for grid methods instead of ``grid_shape``.
    - ``text_query [c]`` / ``text_tokens [N, c]`` or None: the instruction's embedding and the candidates in its
      space (CDPruner; :meth:`Adapter.attach_instruction`), ``text_source`` "clip" or "llm".
    - ``deepstack`` (Qwen3-VL only): per DeepStack layer, the features ``[P, d]`` added to the hidden state of each
      run position at that LLM layer; pruning feeds the rows of the kept run positions.
    - ``key`` or None: the image's identity, a hash of its pixels (:func:`promprune.models.images.pixel_key`; a clip:
      of its frames), set by :func:`attach_keys`; methods that draw at random seed the draw from it.
    - ``host`` or None: the index tensors' host copies (:class:`HostIndex`), set by the adapter where it builds them
      on the host, else by :func:`host_index` (one read of a whole batch); they must agree with the tensors.
    """

    run: torch.Tensor
    features: torch.Tensor
    run_pos: torch.Tensor
    grid_index: torch.Tensor
    saliency: torch.Tensor | None
    groups: torch.Tensor
    row_of_run: torch.Tensor | None = None
    newline: torch.Tensor | None = None
    vision: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    cls: torch.Tensor | None = None
    project: Callable[[torch.Tensor], torch.Tensor] | None = None
    full: VisualItem | None = None
    grid_shape: tuple[int, int] | None = None
    cells: torch.Tensor | None = None
    text_query: torch.Tensor | None = None
    text_tokens: torch.Tensor | None = None
    text_source: str | None = None
    deepstack: list[torch.Tensor] | None = None
    key: int | None = None
    host: HostIndex | None = None
    spatial_pos: torch.Tensor | None = None
    stitched: bool = False

    def spatial(self) -> VisualItem:
        """The same candidates (LLaVA-NeXT's ``full``: every view's whole grid) fed as LLaVA's "spatial" merge
        without "_unpad" packs them (adapter option ``unpad=False``): the run is every candidate at its
        ``spatial_pos`` (the base view, then the crops' stitched grid in raster order, padding included, no newline
        token), so every pick is fed, in that order; ``stitched`` set (token order "stages" then follows
        VisionZip's released NeXT layout: ``batched_select.select_items``)."""
        if self.spatial_pos is None:
            raise ValueError("this item has no spatial packing: only LLaVA-NeXT's whole view grids (VisualItem.full) "
                             "have one")
        run = torch.empty_like(self.features)
        run[self.spatial_pos] = self.features
        host = None
        if self.host is not None:
            host = replace(self.host, run_pos=self.host.spatial_pos, newline=None, row_of_run=None)
        return replace(self, run=run, run_pos=self.spatial_pos, row_of_run=None, newline=None, host=host,
                       stitched=True)

    def packed(self) -> VisualItem:
        """The same image with every run position a candidate, newline tokens included (no saliency, no vision
        features): ``budget_mode="packed"``."""
        P = self.run.shape[0]
        pos = torch.arange(P, device=self.run.device)
        grid = torch.full((P,), -1, dtype=torch.long, device=self.run.device)
        grid[self.run_pos] = self.grid_index
        host = None
        if self.host is not None:  # the same on the host, no read
            host_grid = np.full(P, -1, dtype=np.int64)
            host_grid[self.host.run_pos] = self.host.grid_index
            host = HostIndex(run_pos=np.arange(P, dtype=np.int64), grid_index=host_grid,
                             groups=np.zeros(P, dtype=np.int64), newline=self.host.newline,
                             row_of_run=self.host.row_of_run)
        return VisualItem(run=self.run, features=self.run, run_pos=pos, grid_index=grid, saliency=None,
                          groups=torch.zeros_like(pos), row_of_run=self.row_of_run, newline=self.newline,
                          grid_shape=self.grid_shape, key=self.key, host=host)

    def assemble(self, kept, merged: torch.Tensor | None = None, newline: str = "drop",
                 prefix: torch.Tensor | None = None, prefix_at=None):
        """LLM features for candidates ``kept [M]`` in that order: ``(features [M', d], run positions [M'])``.

        ``merged [M, d]`` replaces the kept candidates' features (token-merging methods). ``newline`` "rows": the
        newline of every row holding a kept token, and of every row holding no token at all, is inserted at its
        place; "all": every newline (M' >= M).
        ``prefix [K, d]``: tokens that have no place in the run (VisionZip's CLS tokens), fed first, or (``prefix_at
        [K]``, host, non-decreasing) each after that many of the kept tokens; each takes a run position no kept token
        uses, which only sets the placeholder count (LLaVA numbers the sequence itself).
        One image's :func:`assemble_all`: ``kept`` on the host (a CPU tensor or an array) or read from the device.
        """
        kept = kept.cpu().numpy() if isinstance(kept, torch.Tensor) else np.asarray(kept)
        feats, pos, _ = assemble_all([self], [kept], [merged], [prefix], newline, [prefix_at])[0]
        return feats, pos

    def layout(self, kept: np.ndarray, newline: str = "drop", prefix: int = 0, prefix_at=None):
        """The host's plan of :meth:`assemble` (numpy, no device values): ``(gather [G]`` run positions of the
        kept tokens (and newlines) in the order fed, ``where [M]`` the place in ``gather`` of each kept candidate,
        ``pos [prefix + G]`` every fed token's run position, ``at [prefix]`` where each prefix token goes among
        ``gather`` (before its ``at``-th entry; 0: first, as without ``prefix_at``))."""
        host = host_index([self])[0]
        pos = host.run_pos[kept]  # [M]
        if (pos < 0).any():
            raise ValueError("kept tokens the model's unpadding drops cannot be fed")
        gather, where = pos, np.arange(pos.shape[0])
        if newline != "drop" and host.newline is not None:
            if newline == "rows":  # a row of no token at all (the unpadding left it no column) keeps its own
                rows = np.isin(host.row_of_run, host.row_of_run[pos]) | ~np.isin(host.row_of_run,
                                                                                 host.row_of_run[~host.newline])
                extra = np.flatnonzero(host.newline & rows)
            else:  # "all"
                extra = np.flatnonzero(host.newline)
            gather = np.unique(np.concatenate([pos, extra]))  # ascending
            where = np.searchsorted(gather, pos)
        slots = np.zeros(0, dtype=np.int64)
        if prefix:
            free = np.ones(self.run.shape[0], dtype=bool)
            free[gather] = False
            slots = np.flatnonzero(free)[:prefix]
            if slots.shape[0] < prefix:
                raise ValueError(f"{prefix} CLS tokens need as many placeholder slots beside the "
                                 f"{gather.shape[0]} kept tokens; the run has {self.run.shape[0]}: lower the budget")
        at = np.zeros(slots.shape[0], dtype=np.int64)
        if prefix_at is not None and prefix:  # after that many kept tokens: before the next one's place in gather
            after = np.asarray(prefix_at, dtype=np.int64)
            at = np.append(where, gather.shape[0])[after]
        return gather, where, np.insert(gather, at, slots), at


def host_index(items: list[VisualItem]) -> list[HostIndex]:
    """Every item's :class:`HostIndex`, set on the items that lack one with one read of their index tensors for
    the whole list (none when every item has one)."""
    missing = [it for it in items if it.host is None]
    tensors = [getattr(it, name) for it in missing for name in _HOST_FIELDS if getattr(it, name) is not None]
    arrays = iter(to_host(tensors))
    for it in missing:
        it.host = HostIndex(**{name: next(arrays) if getattr(it, name) is not None else None
                               for name in _HOST_FIELDS})
    return [it.host for it in items]


def assemble_all(items: list[VisualItem], kept: list[np.ndarray], merged: list, prefix: list, newline: str = "drop",
                 prefix_at: list | None = None):
    """:meth:`VisualItem.assemble` of every item with one copy of the batch's indices to the device: per item
    ``(features [M', d], run positions [M'] on the device, the same [M'] on the host)``. ``kept[i]`` host indices,
    ``merged[i]`` ``[M, d]`` or None, ``prefix[i]`` ``[K, d]`` or None, ``prefix_at[i]`` ``[K]`` (host) or None:
    how many kept tokens go before each prefix token (None: the prefix first)."""
    host_index(items)  # one read for the items whose adapter left none
    prefix_at = prefix_at if prefix_at is not None else [None] * len(items)
    plans = [it.layout(k, newline, 0 if p is None else p.shape[0], a)
             for it, k, p, a in zip(items, kept, prefix, prefix_at)]
    moved: dict[int, list[torch.Tensor]] = {}
    for device in dict.fromkeys(it.run.device for it in items):  # one copy per device (one in practice)
        members = [i for i, it in enumerate(items) if it.run.device == device]
        arrays = [a for i in members for a in plans[i][:3]]
        for i, three in zip(members, zip(*[iter(to_device(arrays, device))] * 3)):
            moved[i] = list(three)
    out = []
    for i, it in enumerate(items):
        gather, where, pos = moved[i]
        feats = it.run[gather]  # [G, d]
        if merged[i] is not None:
            feats[where] = merged[i].to(feats.dtype)
        if prefix[i] is not None and prefix[i].shape[0]:
            feats = _interleave(feats, prefix[i].to(feats.dtype), plans[i][3])
        out.append((feats, pos, plans[i][2]))
    return out


def _interleave(rows: torch.Tensor, extra: torch.Tensor, at: np.ndarray) -> torch.Tensor:
    """``rows [G, d]`` with ``extra[k]`` placed before ``rows[at[k]]`` (``at`` host, non-decreasing; ``G``: after
    them all): slices of both, no index on the device."""
    pieces, prev = [], 0
    cuts = np.flatnonzero(np.diff(at, prepend=-1))  # first extra row of each run of equal places
    for lo, hi in zip(cuts, np.append(cuts[1:], at.shape[0])):
        place = int(at[lo])
        pieces += [rows[prev:place], extra[lo:hi]]
        prev = place
    pieces.append(rows[prev:])
    return torch.cat(pieces)


def attach_keys(items: list[VisualItem], keys: list[int]) -> list[VisualItem]:
    """Give each item (and its LLaVA-NeXT ``full`` twin) its image's key, in place; returns ``items``."""
    if len(keys) != len(items):
        raise ValueError(f"{len(keys)} image keys for {len(items)} items: one key per image")
    for item, key in zip(items, keys):
        item.key = int(key)
        if item.full is not None:
            item.full.key = int(key)
    return items


def as_encoder_outputs(features: list[torch.Tensor]) -> dict:
    """``mm_encoder_outputs`` for ``generate``: per-image visual features ``[M_i, d]`` of the LLM's input."""
    return {"image": BaseModelOutputWithPooling(pooler_output=tuple(features))}


def token_rows(features: list[torch.Tensor]) -> torch.Tensor:
    """Every image's fed features ``[M_i, d]`` as one tensor ``[sum M_i, 1, d]``, for a model whose forward scatters
    one tensor into the placeholders (InternVL; OneVision's clips). One token per leading row, because beam search
    (``generate``'s ``_expand_multimodal_outputs``) regroups the leading rows by each prompt's placeholder count and
    repeats each prompt's group per beam; ``[1, sum M_i, d]`` was one group, repeated whole, which fed row 0's beams
    and row 1's each other's images."""
    return torch.cat(features)[:, None, :]


def saliency_layer(options: dict, depth: int, default: int, unit: str = "layer of the vision encoder") -> int:
    """The vision layer (0 .. ``depth`` - 1) whose attention gives saliency: the adapter option ``saliency_block``,
    else ``default``; anything else is an OptionError naming the valid range (``unit``: what a layer is called)."""
    block = options.get("saliency_block")
    if block is None:
        return default
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < depth:
        raise OptionError("saliency_block", f"saliency_block must be a {unit} (0 .. {depth - 1}), got {block!r}")
    return block


class Adapter:
    """Base: the conversation, processor call and generate kwargs shared by the architectures.

    ``encoder``: the vision encoder's kind, "clip" where CDPruner can use CLIP's text tower (else the LLM's input
    embeddings); ``contiguous_run``: one image's placeholders form one run (else several, split by the processor's
    markers, as MiniCPM-V's slices); ``family``: the registered :class:`~promprune.models.registry.Family`;
    ``host_inputs``: processor outputs that stay on the host, where the model only reads their values (LLaVA-NeXT's
    ``image_sizes``: on the device each read would be a sync); ``uniform_clips``: the processor stacks a batch's
    clips into one tensor, so one call takes clips of one frame count only (LLaVA-OneVision's; the video path
    processes and encodes each frame count as its own sub-batch)."""

    encoder = "clip"
    contiguous_run = True
    host_inputs: tuple[str, ...] = ()  # processor outputs the model reads on the host only (PrunedVLM.on_device)
    uniform_clips = False

    def __init__(self, model, processor, options: dict):
        self.model, self.processor, self.options = model, processor, options
        self.family = family_of(model.config)  # check_config: a config of the family this adapter cannot run
        self.check_options(model.config, options)  # options it cannot run this config with: fail at construction

    @classmethod
    def check_config(cls, config) -> None:
        """ValueError when ``config``, of this adapter's family, is one the adapter cannot run (LLaVA: a vision tower
        without CLIP's CLS token), from the config alone: :func:`~promprune.models.registry.family_of` calls it, so
        construction, loading and the pipeline's preflight all refuse it. Default: every config of the family."""

    @property
    def default_mu(self) -> float:
        return self.family.default_mu

    def prepare_images(self, images):
        return images

    def prepare_clips(self, clips: list) -> list:
        """A batch's clips (``[F, H, W, 3]`` arrays) as the processor takes them; after ``video_kwargs`` has read
        them (Qwen3-VL pads a clip shorter than one temporal patch)."""
        return clips

    @classmethod
    def check_options(cls, config, options: dict) -> None:
        """ValueError (an :class:`~promprune.models.options.OptionError` naming the option) when the adapter
        ``options`` (defaults filled in) are ones this adapter cannot run ``config`` with, from the config alone (no
        weights): the constructor calls it, and so does the pipeline's preflight (``vlm.construction_problems``).
        Default: the ``saliency_block`` (:meth:`saliency_index`)."""
        cls.saliency_index(config, options)

    @classmethod
    def saliency_index(cls, config, options: dict) -> int | None:
        """The vision layer (block) whose attention gives saliency under ``config``: the adapter option
        ``saliency_block`` where the family reads it (:func:`saliency_layer`), else the family's default; an
        invalid one is an OptionError naming the valid ones. Default (LLaVA, LLaVA-NeXT, LLaVA-OneVision): None, the
        family reads saliency at a layer of its own (LLaVA's: the one ``vision_feature_layer`` names, whose output
        the projector reads, the paper's protocol; VisPruner and VisionZip read that layer's keys too), so a
        ``saliency_block`` set is an OptionError (it was ignored, and the run measured another layer than asked)."""
        block = options.get("saliency_block")
        if block is not None:
            kind = getattr(config, "model_type", "?")
            layer = getattr(config, "vision_feature_layer", None)
            at = "a layer of its own" if layer is None else \
                f"the vision layer whose output the projector reads (vision_feature_layer, {layer})"
            raise OptionError("saliency_block", f"saliency_block {block!r} is not taken by a {kind} model: its "
                              f"adapter reads saliency at {at}, as the paper's protocol does, and would ignore it; "
                              "remove saliency_block from the adapter options")
        return None

    @classmethod
    def instruction_source(cls, option: str) -> str:
        """CDPruner's text source for option ``text_source``: "released" is "clip" on CLIP-based models (LLaVA,
        LLaVA-NeXT), "llm" else (Qwen2.5-VL, Qwen3-VL; LLaVA-OneVision, whose checkpoints ship no SigLIP text
        tower); "clip" on a non-CLIP model is an OptionError, at construction (``PrunedVLM``) and in the pipeline's
        preflight (``vlm.construction_problems``)."""
        if option == "released":
            return "clip" if cls.encoder == "clip" else "llm"
        if option == "clip" and cls.encoder != "clip":
            raise OptionError("text_source", f"text_source 'clip' needs a CLIP vision tower; this {cls.encoder} model "
                              "has none: use text_source 'llm' (or 'released')")
        return option

    def max_views(self) -> int:
        """The most views (crops, tiles) one image gives under this model and processor: ``view_quota``'s divisor."""
        return self.views(self.model.config, self.processor)

    @classmethod
    def views(cls, config, processor=None) -> int | None:
        """The most views one image gives under ``config`` and ``processor`` (None: not at hand, as for a factory's
        model in the pipeline's preflight). Default: the family's ``max_views(config)``; a family whose count is its
        processor's (InternVL's ``max_patches``, MiniCPM-V's ``max_slice_nums``) reads it, None without one."""
        return family_of(config).max_views(config)

    def processor_kwargs(self) -> dict:
        return {}

    def chat_template_kwargs(self) -> dict:
        """Extra variables for the chat template: ``enable_thinking`` when the adapter option sets it and the template
        reads it (Qwen3.5's reasoning switch; other templates have none, so the option does nothing there)."""
        thinking = self.options.get("enable_thinking")
        template = getattr(self.processor, "chat_template", None) or ""
        if thinking is None or "enable_thinking" not in str(template):
            return {}
        return {"enable_thinking": bool(thinking)}

    def encode(self, inputs, need_saliency: bool, need_vision: bool = False) -> list[VisualItem]:
        """Candidate tokens of every image; ``need_vision``: with the vision tower's own features where the
        architecture has them (``VisualItem.vision``)."""
        raise NotImplementedError

    def attach_instruction(self, items: list[VisualItem], prompts: list[str], source: str) -> None:
        """Set ``text_query`` / ``text_tokens`` of every item (and its ``full`` twin) from its prompt's question.

        "clip": CLIP's text embedding of the question vs. the vision tower's hidden states of the candidates through
        ``post_layernorm`` and CLIP's ``visual_projection`` (needs ``VisualItem.vision``); "llm": the mean of the
        LLM's input embeddings of the question's tokens vs. the candidates' projected features.
        """
        from .clip_text import question_text

        for item, prompt in zip(items, prompts):
            text = question_text(prompt)
            query = self._clip().embed(text) if source == "clip" else self._llm_query(text)
            for it in (item, item.full) if item.full is not None else (item,):
                if source == "clip":
                    it.text_tokens = self._clip().project(it.vision, self.model.model.vision_tower.post_layernorm)
                else:
                    it.text_tokens = it.features.float()
                it.text_query, it.text_source = query.to(it.text_tokens.device), source

    def load_instruction(self, source: str | None) -> None:
        """Load now what :meth:`attach_instruction` needs for ``source`` ("clip": CDPruner's CLIP text tower, a
        checkpoint load that would otherwise fall in the first sample's timed vision stage); ``PrunedVLM`` calls it
        at construction. None or "llm": nothing to load."""
        if source == "clip":
            self._clip()

    def extras(self) -> dict:
        """What this adapter holds beside the model's weights, by name: ``clip_text``, CDPruner's CLIP text tower
        (:class:`~promprune.models.clip_text.ClipText`), once loaded."""
        return {} if getattr(self, "_clip_text", None) is None else {"clip_text": self._clip_text}

    def device_extras(self) -> list[str]:
        """The names of the :meth:`extras` that sit on the model's device now (none after :meth:`release_extras`)."""
        return [] if getattr(self, "_extras_released", False) else list(self.extras())

    def release_extras(self) -> None:
        """Move the :meth:`extras` to host memory, freeing their device memory (the model's weights, which every
        wrapper of the model shares, stay): a worker does so for the wrappers it keeps but does not serve, so that
        a trial's peak memory holds only its own method's. :meth:`restore_extras`, or the next instruction that needs
        them, brings them back."""
        for extra in self.extras().values():
            extra.to("cpu")
        self._extras_released = True

    def restore_extras(self) -> None:
        """Move the :meth:`extras` back to the model's device (undoes :meth:`release_extras`; else nothing)."""
        if getattr(self, "_extras_released", False):
            for extra in self.extras().values():
                extra.to(*self._extras_home())
        self._extras_released = False

    def _extras_home(self) -> tuple:
        """(device, dtype) the extras run on: the vision tower's."""
        param = next(self.model.model.vision_tower.parameters())
        return param.device, param.dtype

    def _clip(self):
        """CDPruner's CLIP text tower, loaded once (adapter option ``clip_text``; None: the model's own setting,
        else the released openai/clip-vit-large-patch14-336); back on the model's device if released. A tower that
        does not load is an OptionError naming ``clip_text`` and the ways out."""
        if getattr(self, "_clip_text", None) is None:
            from . import clip_text

            name = self.options.get("clip_text") or getattr(self.model.config, "promprune_clip_text", None) \
                or clip_text.RELEASED_CLIP
            try:
                tower = clip_text.load(name, self.model.config.vision_config)
            except (OSError, ValueError) as exc:
                raise OptionError("clip_text", f"CDPruner's CLIP text tower {name!r} (adapter option clip_text) does "
                                  f"not load: {exc}. Download it once (`hf download {name}`), set clip_text to a CLIP "
                                  "checkpoint this machine has, or embed the question with the LLM (text_source "
                                  "'llm')") from exc
            self._clip_text = tower.to(*self._extras_home())
            self._extras_released = False
        self.restore_extras()
        return self._clip_text

    @torch.inference_mode()
    def _llm_query(self, text: str) -> torch.Tensor:
        """``[d]``: the mean of the LLM's input embeddings of ``text``'s tokens (no special tokens)."""
        ids = self.processor.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        embed = self.model.get_input_embeddings()
        return embed(ids.to(embed.weight.device))[0].float().mean(dim=0)

    def encoder_outputs(self, items: list[VisualItem], feats: list[torch.Tensor], run_pos: list[torch.Tensor]):
        """``mm_encoder_outputs`` for ``generate``: the fed features ``feats[i] [M_i, d]`` of each image, which sit
        at run positions ``run_pos[i] [M_i]`` of ``items[i]`` (Qwen3-VL also gathers its DeepStack rows there)."""
        return as_encoder_outputs(feats)

    def generate_kwargs(self, inputs, new_ids, new_mask, col_map) -> dict:
        """Extra kwargs for ``generate`` on the rebuilt sequence (Qwen: 3D positions).

        ``col_map [B, L']``: the old column of each new column (-1: new padding).
        """
        return {}


def adapter_for(model, processor, options) -> Adapter:
    """The adapter of ``model``'s family (by ``config.model_type``); an unsupported type is a ValueError naming the
    supported ones, as is a processor of another family or one without a chat template (:func:`check_processor`)."""
    found = family_of(model.config)
    check_processor(found, processor)
    return found.adapter(model, processor, options)


def check_processor(family, processor) -> None:
    """ValueError unless ``processor`` is of the class ``family``'s checkpoints ship (``Family.processor_class``, or
    a subclass) and has a chat template (``PrunedVLM.conversation`` builds every prompt with it): another family's
    processor (a LLaVA model with LLaVA-NeXT's, a Qwen model with LLaVA's) made every sample fail deep in the model's
    code, and the run exited 0."""
    expected = family.processor_class
    names = [cls.__name__ for cls in type(processor).__mro__]
    have = type(processor).__name__
    if expected is not None and expected not in names:
        raise ValueError(f"the processor is of class {have}, but a {family.name} model takes its {expected} (their "
                         "placeholders, image preprocessing and prompts differ, so every sample would fail): load the "
                         "processor saved with the checkpoint (AutoProcessor.from_pretrained on the checkpoint, or "
                         "processor.save_pretrained(<dir>) beside the weights)")
    template = getattr(processor, "chat_template", None)
    if not (isinstance(template, str) and template.strip()
            or isinstance(template, dict) and template.get("default")):
        raise ValueError(f"the processor ({have}) has no chat template, and every prompt is built with it "
                         "(apply_chat_template): save the processor with its chat template (chat_template.jinja "
                         "beside the weights) or set processor.chat_template")


def checkpoint_processor(name_or_path: str, config):
    """The processor saved with a checkpoint (``factories.model_processor``), checked against ``config``'s family
    (:func:`check_processor`): what ``PrunedVLM.from_pretrained`` loads, and what the pipeline's preflight checks
    before Ray starts. ValueError (NotCachedError: not on this machine) naming the checkpoint."""
    from .factories import model_processor

    found = family_of(config)
    processor = model_processor(name_or_path)
    try:
        check_processor(found, processor)
    except ValueError as exc:
        raise ValueError(f"model {name_or_path!r}: {exc}") from None
    return processor


def max_views(config) -> int:
    """The most views (crops, tiles) one image gives under ``config``'s family (1 for an unregistered type)."""
    found = find_family(config)
    return 1 if found is None else found.max_views(config)


def model_capacity(pretrained: str, adapter_options: dict | None = None, in_llm: bool = False) -> int | None:
    """:func:`visual_token_capacity` of a model by name (a factory name, hub id or path), from its config alone:
    no weights load; ``in_llm``: :func:`visual_token_ceiling` instead (the tokens an in-LLM method counts). Raises
    what :func:`model_capacities` raises."""
    config = _family_config(pretrained)
    count = visual_token_ceiling if in_llm else visual_token_capacity
    return None if config is None else count(config, adapter_options)


def model_capacities(pretrained: str, adapter_options: dict | None = None) -> tuple[int | None, int | None]:
    """``(visual_token_capacity, visual_token_ceiling)`` of a model by name (a factory name, hub id or path), from one
    load of its config: no weights load. Raises what ``factories.model_config`` raises (NotCachedError: not on this
    machine; ValueError: a name that names nothing, a config that does not load), and ValueError for a config no
    registered family runs (``registry.family_of``: an unsupported model type, a LLaVA whose vision tower is not
    CLIP)."""
    config = _family_config(pretrained)
    if config is None:
        return None, None
    return visual_token_capacity(config, adapter_options), visual_token_ceiling(config, adapter_options)


def _family_config(pretrained: str):
    """The config of ``pretrained`` (None where its factory has none), checked to be a registered family's."""
    from .factories import model_config

    config = model_config(pretrained)
    if config is not None:
        try:
            family_of(config)
        except ValueError as exc:
            raise ValueError(f"model {pretrained!r}: {exc}") from None
    return config


def visual_token_capacity(config, adapter_options: dict | None = None) -> int | None:
    """The most visual tokens one image gives the LLM under this config (what a budget must stay below to prune), as
    its family counts them (LLaVA-1.5: the patch grid; LLaVA-NeXT: that per view times the most views; Qwen: the
    ``image_tokens`` option, else None: it depends on the image; ...); None for an unregistered type."""
    found = find_family(config)
    return None if found is None else found.capacity(config, adapter_options or {})


def visual_token_ceiling(config, adapter_options: dict | None = None) -> int | None:
    """The most visual tokens one image gives the LLM under this config, counted as the in-LLM methods count them (the
    prompt's image placeholders, ``image_newline`` included): the family's ``most`` where the prompt holds tokens that
    are no candidates (LLaVA-NeXT / LLaVA-OneVision: one newline per row of the unpadded, or anyres-max resized, crop
    grid), else its :func:`visual_token_capacity`; None where it depends on the image (no fixed most) or for an
    unregistered type."""
    found = find_family(config)
    if found is None:
        return None
    options = adapter_options or {}
    return (found.capacity if found.most is None else found.most)(config, options)


def visual_token_floor(config, adapter_options: dict | None = None) -> int | None:
    """At most the fewest visual tokens any image gives the LLM under this config, counted as the in-LLM methods count
    them (the prompt's image placeholders, ``image_newline`` included): the family's ``fewest`` (LLaVA-1.5 and a Qwen
    with ``image_tokens``: every image's count; LLaVA-NeXT: the base view; LLaVA-OneVision: the fewest placeholders
    any image gives, its crop grid's newlines included; InternVL: one tile; Gemma 4:
    the fewest soft tokens any aspect ratio gives; MiniCPM-V 4.6: an ultra-wide image's one token per view); None
    when none is known or for an unregistered type."""
    found = find_family(config)
    return None if found is None else found.fewest(config, adapter_options or {})
