"""What every architecture's adapter shares: the candidate tokens of one image and the adapter interface.

Each adapter (one per family, :mod:`promprune.models.families`) runs the model's own ``get_image_features`` (so the
projected tokens are exactly the ones the unmodified model would consume) with a saliency hook on one vision layer,
and describes the tokens as a :class:`VisualItem` per image. Pruning then keeps a subset of the candidates; the
placeholder run in the prompt shrinks to match (``sequence.py``) and the kept features go to ``generate`` as
``mm_encoder_outputs``. An adapter that also answers about clips defines ``video_kwargs``, ``encode_video`` and
``video_encoder_outputs`` (:mod:`promprune.models.video`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .registry import family_of, find_family


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
    - ``full`` (NeXT only): the same image with every view's whole grid as candidates, padding included.
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

    def packed(self) -> VisualItem:
        """The same image with every run position a candidate, newline tokens included (no saliency, no vision
        features): ``budget_mode="packed"``."""
        P = self.run.shape[0]
        pos = torch.arange(P, device=self.run.device)
        grid = torch.full((P,), -1, dtype=torch.long, device=self.run.device)
        grid[self.run_pos] = self.grid_index
        return VisualItem(run=self.run, features=self.run, run_pos=pos, grid_index=grid, saliency=None,
                          groups=torch.zeros_like(pos), row_of_run=self.row_of_run, newline=self.newline,
                          grid_shape=self.grid_shape, key=self.key)

    def assemble(self, kept: torch.Tensor, merged: torch.Tensor | None = None, newline: str = "drop",
                 prefix: torch.Tensor | None = None):
        """LLM features for candidates ``kept [M]`` in that order: ``(features [M', d], run positions [M'])``.

        ``merged [M, d]`` replaces the kept candidates' features (token-merging methods). ``newline`` "rows": the
        newline of every row holding a kept token is inserted at its place; "all": every newline (M' >= M).
        ``prefix [K, d]``: tokens fed first that have no place in the run (VisionZip's CLS tokens); each takes a
        run position no kept token uses, which only sets the placeholder count (LLaVA numbers the sequence itself).
        """
        pos = self.run_pos[kept]
        if bool((pos < 0).any()):
            raise ValueError("kept tokens the model's unpadding drops cannot be fed")
        feats = self.run.clone()
        if merged is not None:
            feats[pos] = merged.to(feats.dtype)
        if newline != "drop" and self.newline is not None:
            if newline == "rows":
                rows = self.row_of_run[pos].unique()
                extra = (self.newline & torch.isin(self.row_of_run, rows)).nonzero().flatten()
            else:  # "all"
                extra = self.newline.nonzero().flatten()
            pos = torch.cat([pos, extra]).unique()  # ascending
        out = feats[pos]
        if prefix is not None and prefix.shape[0]:
            free = torch.ones(self.run.shape[0], dtype=torch.bool, device=pos.device)
            free[pos] = False
            slots = free.nonzero().flatten()[:prefix.shape[0]]
            if slots.numel() < prefix.shape[0]:
                raise ValueError(f"{prefix.shape[0]} CLS tokens need as many placeholder slots beside the "
                                 f"{pos.numel()} kept tokens; the run has {self.run.shape[0]}: lower the budget")
            out = torch.cat([prefix.to(out.dtype), out])
            pos = torch.cat([slots, pos])
        return out, pos


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


class Adapter:
    """Base: the conversation, processor call and generate kwargs shared by the architectures.

    ``encoder``: the vision encoder's kind, "clip" where CDPruner can use CLIP's text tower (else the LLM's input
    embeddings); ``contiguous_run``: one image's placeholders form one run (else several, split by the processor's
    markers, as MiniCPM-V's slices); ``family``: the registered :class:`~promprune.models.registry.Family`."""

    encoder = "clip"
    contiguous_run = True

    def __init__(self, model, processor, options: dict):
        self.model, self.processor, self.options = model, processor, options
        self.family = family_of(model.config)

    @property
    def default_mu(self) -> float:
        return self.family.default_mu

    def prepare_images(self, images):
        return images

    def saliency_layer(self, depth: int, default: int, unit: str = "layer of the vision encoder") -> int:
        """The vision layer (0 .. ``depth`` - 1) whose attention gives saliency: the adapter option ``saliency_block``,
        else ``default``; anything else is a ValueError naming the valid range (``unit``: what a layer is called)."""
        block = self.options.get("saliency_block")
        if block is None:
            return default
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < depth:
            raise ValueError(f"saliency_block must be a {unit} (0 .. {depth - 1}), got {block!r}")
        return block

    def max_views(self) -> int:
        """The most views (crops, tiles) one image gives under this model and processor: ``view_quota``'s divisor."""
        return self.family.max_views(self.model.config)

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

    def instruction_source(self, option: str) -> str:
        """CDPruner's text source for option ``text_source``: "released" is "clip" on CLIP-based models (LLaVA,
        LLaVA-NeXT), "llm" else (Qwen2.5-VL, Qwen3-VL; LLaVA-OneVision, whose checkpoints ship no SigLIP text
        tower); "clip" on a non-CLIP model is a ValueError at construction."""
        if option == "released":
            return "clip" if self.encoder == "clip" else "llm"
        if option == "clip" and self.encoder != "clip":
            raise ValueError(f"text_source 'clip' needs a CLIP vision tower; this {self.encoder} model has none: "
                             "use text_source 'llm' (or 'released')")
        return option

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

    def _clip(self):
        """CDPruner's CLIP text tower, loaded once (adapter option ``clip_text``; None: the model's own setting,
        else the released openai/clip-vit-large-patch14-336)."""
        if getattr(self, "_clip_text", None) is None:
            from . import clip_text

            name = self.options.get("clip_text") or getattr(self.model.config, "promprune_clip_text", None) \
                or clip_text.RELEASED_CLIP
            tower = self.model.model.vision_tower
            param = next(tower.parameters())
            self._clip_text = clip_text.load(name, self.model.config.vision_config).to(param.device, param.dtype)
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
    supported ones."""
    return family_of(model.config).adapter(model, processor, options)


def max_views(config) -> int:
    """The most views (crops, tiles) one image gives under ``config``'s family (1 for an unregistered type)."""
    found = find_family(config)
    return 1 if found is None else found.max_views(config)


def visual_token_capacity(config, adapter_options: dict | None = None) -> int | None:
    """The most visual tokens one image gives the LLM under this config (what a budget must stay below to prune), as
    its family counts them (LLaVA-1.5: the patch grid; LLaVA-NeXT: that per view times the most views; Qwen: the
    ``image_tokens`` option, else None: it depends on the image; ...); None for an unregistered type."""
    found = find_family(config)
    return None if found is None else found.capacity(config, adapter_options or {})
