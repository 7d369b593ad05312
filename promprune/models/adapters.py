"""Per-architecture glue: encode images into candidate visual tokens with saliency, and rebuild LLM inputs.

Each adapter runs the model's own ``get_image_features`` (so the projected tokens are exactly the ones the
unmodified model would consume) with a saliency hook on one vision layer, and describes the tokens as a
:class:`VisualItem` per image. Pruning then keeps a subset of the candidates; the placeholder run in the prompt
shrinks to match (``sequence.py``) and the kept features go to ``generate`` as ``mm_encoder_outputs``.

LLaVA-NeXT ``image_newline`` treatment: the newline tokens are no candidates (they carry no image content) except
under ``budget_mode="packed"`` (DivPrune's released code selects over the whole packed sequence). With
``image_newline="drop"`` (default) a pruned sequence has no newline tokens, so the LLM receives exactly the budget;
with ``"rows"`` a row's newline is kept when any token of that row is kept, which restores the unpruned sequence at
full budget; ``"all"`` keeps every newline token (VisPruner's released code). Unpruned (``method=None``) the model's
own packed sequence is used unchanged.

The vision tower's own features (``need_vision``; LLaVA and LLaVA-NeXT): the hidden states the projector reads,
the attention keys of that layer (head mean) and the CLS token's hidden state, for the methods whose released code
reads them (``promprune.VisionFeatures``). The projector brings what such a method builds in that space (VisionZip's
merged tokens, its CLS token) into the LLM's. The CLS reaches the LLM only through VisionZip: the "default"
feature-select strategy drops it from the placeholder run, so a kept CLS is projected by the model's own
``multi_modal_projector`` and fed first, in a slot the pruning freed (LLaVA numbers the sequence itself, so the
slot carries no position of its own).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..dtypes import upcast
from . import saliency as sal
from .options import DEFAULT_MU


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
    """Base: the conversation, processor call and generate kwargs shared by the architectures."""

    encoder = "clip"

    def __init__(self, model, processor, options: dict):
        self.model, self.processor, self.options = model, processor, options

    @property
    def default_mu(self) -> float:
        return DEFAULT_MU[self.encoder]

    def prepare_images(self, images):
        return images

    def max_views(self) -> int:
        """The most views (crops, tiles) one image gives under this model and processor: ``view_quota``'s divisor."""
        return max_views(self.model.config)

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


class LlavaAdapter(Adapter):
    """LLaVA-1.5: CLS + patch grid; saliency = CLS attention at the layer ``vision_feature_layer`` reads."""

    def _attn_module(self):
        layer = self.model.config.vision_feature_layer
        if not isinstance(layer, int):
            layer = layer[-1]  # several feature layers: the deepest one's attention ranks the tokens
        return sal.clip_attention_module(self.model.model.vision_tower, layer)

    def _cls_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """CLS attention rows ``[V, S]`` -> per-token saliency ``[V, n]`` (drops the CLS column when it is dropped)."""
        return rows[:, 1:] if self.model.config.vision_feature_select_strategy == "default" else rows

    @contextlib.contextmanager
    def _captures(self, need_saliency: bool, need_vision: bool):
        """``(saliency sink, keys sink)`` filled by hooks on the saliency layer's attention during the block."""
        attn, sink, keys = self._attn_module(), [], []
        with contextlib.ExitStack() as stack:
            if need_saliency:
                stack.enter_context(sal.capture_cls_attention(attn, sink))
            if need_vision:
                stack.enter_context(sal.capture_keys(attn, keys))
            yield sink, keys

    def _vision(self, out, keys: list):
        """``(hidden [V, n, dv], keys [V, n, dk], cls [V, dv] or None)`` of every view: the hidden states the
        projector reads (several feature layers concatenated, as ``get_image_features`` does) and the CLS, which
        the "default" strategy drops (with "full" it is one of the tokens)."""
        cfg = self.model.config
        if out.hidden_states is None:
            raise RuntimeError("the vision tower returned no hidden states")
        layers = [cfg.vision_feature_layer] if isinstance(cfg.vision_feature_layer, int) else cfg.vision_feature_layer
        hidden = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)  # [V, S, dv]
        if cfg.vision_feature_select_strategy == "default":
            return hidden[:, 1:], keys[0][:, 1:], hidden[:, 0]
        return hidden, keys[0], None

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's projector on vision-space rows ``[..., dv]`` -> ``[..., d]`` float32 (float64 for a float64
        model)."""
        proj = self.model.model.multi_modal_projector
        return upcast(proj(hidden.to(next(proj.parameters()).dtype)))

    def encode(self, inputs, need_saliency, need_vision=False):
        with self._captures(need_saliency, need_vision) as (sink, keys):
            out = self.model.model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True)
        feats = list(out.pooler_output)  # B x [n, d]
        scores = self._cls_rows(sink[0]) if need_saliency else None  # [B, n]
        hidden, key, cls = self._vision(out, keys) if need_vision else (None, None, None)
        items = []
        for b, f in enumerate(feats):
            n = f.shape[0]
            idx = torch.arange(n, device=f.device)
            items.append(VisualItem(run=f, features=f, run_pos=idx, grid_index=idx,
                                    saliency=None if scores is None else scores[b],
                                    groups=torch.zeros_like(idx), vision=None if hidden is None else hidden[b],
                                    keys=None if key is None else key[b],
                                    cls=None if cls is None else cls[b:b + 1],
                                    project=self.project if need_vision else None, grid_shape=self._grid_shape()))
        return items

    def _grid_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one view's patch grid."""
        vc = self.model.config.vision_config
        side = vc.image_size // vc.patch_size
        return side, side


class LlavaNextAdapter(LlavaAdapter):
    """LLaVA-NeXT anyres: base view + crops, unpadding and ``image_newline`` (see the module docstring)."""

    def encode(self, inputs, need_saliency, need_vision=False):
        core = self.model.model
        grids: list = []
        hook = core.multi_modal_projector.register_forward_hook(lambda m, a, out: grids.append(out))
        try:
            with self._captures(need_saliency, need_vision) as (sink, keys):
                out = core.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                                              return_dict=True)
        finally:
            hook.remove()
        n = grids[0].shape[1]  # tokens per view
        flat = grids[0].reshape(-1, grids[0].shape[-1])  # [sum V_i * n, d]: every view's whole grid, projected
        scores = self._cls_rows(sink[0]).reshape(-1) if need_saliency else None  # [sum V_i * n]
        vision = (None, None, None)
        if need_vision:
            hidden, key, cls = self._vision(out, keys)
            vision = (hidden.reshape(-1, hidden.shape[-1]), key.reshape(-1, key.shape[-1]), cls)
        layouts, num_views = self._packed_layout(inputs["image_sizes"], [p.shape[0] for p in out.pooler_output], n)
        items, offset, first = [], 0, 0
        for run, ids, views in zip(out.pooler_output, layouts, num_views):
            items.append(self._item(run, ids.to(run.device), n, views, flat, scores, vision, offset, first))
            offset += views * n  # scores hold every view's full grid, unpadding or not
            first += views
        return items

    def _packed_layout(self, image_sizes, run_lengths, n) -> tuple[list[torch.Tensor], list[int]]:
        """For each image, ``ids [P]``: which (view * n + patch) each packed position holds, -1 for a newline;
        and the number of views of each image.

        Obtained by running the model's own ``pack_image_features`` on index tensors, so the unpad / newline
        rules are transformers' and not a copy of them.
        """
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        cfg = self.model.config
        num_views = [image_size_to_num_patches(s, cfg.image_grid_pinpoints, cfg.vision_config.image_size)
                     for s in image_sizes]
        ids = [torch.arange(v * n, dtype=torch.float64).view(v, n, 1) for v in num_views]
        packed, _ = self.model.model.pack_image_features(
            ids, image_sizes.cpu(), cfg.vision_feature_select_strategy,
            image_newline=torch.tensor([-1.0], dtype=torch.float64))
        layouts = [p[:, 0].round().long() for p in packed]
        for lay, length in zip(layouts, run_lengths):
            assert lay.numel() == length, "packed layout does not match the model's packed features"
        return layouts, num_views

    def _item(self, run, ids, n, views, flat, scores, vision, offset, first) -> VisualItem:
        """One image's item from its packed layout ``ids``; ``flat`` / ``scores`` / ``vision`` hold every view's
        whole grid from ``offset`` (views from ``first``); ``full``: the same with the whole grids as candidates."""
        newline = ids < 0
        run_pos = (~newline).nonzero().flatten()
        grid = ids[run_pos]
        row = newline.long().cumsum(0) - newline.long()  # newlines strictly before each position
        if int(grid.max()) >= n:  # several views: the base view (first n positions) has no newline rows
            row[:n] = -1
        hidden, key, cls = vision
        whole = torch.arange(views * n, device=run.device)
        run_of_grid = torch.full_like(whole, -1)
        run_of_grid[grid] = run_pos  # -1: dropped by the model's unpadding

        def at(t, index):
            return None if t is None else t[offset + index]

        def span(t):  # this image's whole grids: a view of the tensor, no copy
            return None if t is None else t[offset:offset + views * n]

        shared = dict(run=run, row_of_run=row, newline=newline, cls=None if cls is None else cls[first:first + views],
                      project=self.project if hidden is not None else None, grid_shape=self._grid_shape())
        full = VisualItem(features=span(flat), run_pos=run_of_grid, grid_index=whole, saliency=span(scores),
                          groups=whole // n, vision=span(hidden), keys=span(key), **shared)
        return VisualItem(features=run[run_pos], run_pos=run_pos, grid_index=grid, saliency=at(scores, grid),
                          groups=grid // n, vision=at(hidden, grid), keys=at(key, grid), full=full, **shared)


class QwenAdapter(Adapter):
    """Qwen2.5-VL: merged 2x2 tokens; saliency = received attention at a full-attention block, pooled per group."""

    encoder = "qwen2_5_vl"

    def __init__(self, model, processor, options: dict):
        super().__init__(model, processor, options)
        self.block = self._block()  # fail at construction, not at the first batch

    def _block(self) -> int:
        vc = self.model.config.vision_config
        full = list(vc.fullatt_block_indexes)
        block = self.options.get("saliency_block")
        block = full[-1] if block is None else block
        if block not in full:
            raise ValueError(f"saliency_block must be a full-attention block of the vision tower {full}, got {block}")
        return block

    def prepare_images(self, images):
        n = self.options.get("image_tokens")
        if n is None:
            return images
        side = int(round(n ** 0.5)) * self._factor()
        return [img.resize((side, side)) for img in images]

    def processor_kwargs(self) -> dict:
        n = self.options.get("image_tokens")
        if n is None:
            return {}
        pixels = n * self._factor() ** 2  # pin smart_resize to exactly the requested grid
        return {"size": {"shortest_edge": pixels, "longest_edge": pixels}}  # min = max pixels

    def _factor(self) -> int:
        vc = self.model.config.vision_config
        return vc.patch_size * vc.spatial_merge_size

    def encode(self, inputs, need_saliency, need_vision=False):
        """No ``vision`` for Qwen2.5-VL: no released VisPruner / VisionZip path for it to follow."""
        core, grid = self.model.model, inputs["image_grid_thw"]
        sink: list = []
        attn = core.visual.blocks[self.block].attn
        with sal.capture_received_attention(attn, sink) if need_saliency else contextlib.nullcontext():
            out = core.get_image_features(inputs["pixel_values"], grid, return_dict=True)
        scores = self._merged_saliency(sink[0], grid) if need_saliency else None
        items, offset = [], 0
        merge = self.model.config.vision_config.spatial_merge_size
        for i, (f, (t, h, w)) in enumerate(zip(out.pooler_output, grid.tolist())):
            idx = torch.arange(f.shape[0], device=f.device)
            s = None if scores is None else scores[offset:offset + f.shape[0]]
            items.append(VisualItem(run=f, features=f, run_pos=idx, grid_index=idx, saliency=s,
                                    groups=torch.zeros_like(idx), grid_shape=(t * h // merge, w // merge),
                                    **self._item_extras(out, i)))
            offset += f.shape[0]
        return items

    def _merged_saliency(self, received, grid):
        """Attention each merged token received (the chosen block's rows pooled over its 2x2 group)."""
        return sal.pool_to_merged(received, grid, self.model.config.vision_config)

    def _item_extras(self, out, i: int) -> dict:
        """Further ``VisualItem`` fields of image ``i`` from the tower's output (none for Qwen2.5-VL)."""
        return {}

    def generate_kwargs(self, inputs, new_ids, new_mask, col_map):
        """3D M-RoPE positions computed on the unpruned sequence, gathered at the kept columns.

        Returns ``position_ids [4, B, L']``: row 0 the text positions of the new sequence (used by transformers
        only for mask construction), rows 1-3 the original (t, h, w) positions of every kept column. ``generate``
        continues each row with ``last + 1``, which is the unpruned model's ``rope_deltas`` rule; we also set
        ``model.model.rope_deltas`` to the pruned sequence's deltas for callers that decode without positions.
        """
        core = self.model.model
        grids = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in inputs}
        full, _ = core.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], **grids,
                                      attention_mask=inputs["attention_mask"])  # [3, B, L]
        cols = col_map.clamp_min(0).to(full.device)  # [B, L']
        spatial = full.gather(2, cols[None].expand(3, -1, -1))  # [3, B, L']
        spatial = spatial.masked_fill((col_map < 0).to(full.device)[None], 0)  # pads: 0, as transformers
        text = (new_mask.long().cumsum(-1) - 1).masked_fill(new_mask == 0, 0)  # as generate builds it
        valid = new_mask.bool()
        top = spatial.masked_fill(~valid[None], -1).amax(dim=(0, 2))  # [B]
        core.rope_deltas = (top + 1 - valid.sum(-1)).unsqueeze(1)
        return {"position_ids": torch.cat([text[None].to(spatial), spatial], dim=0)}


class Qwen3Adapter(QwenAdapter):
    """Qwen3-VL: merged 2x2 tokens plus DeepStack features; saliency = received attention at one vision block.

    No CLS token, so saliency is the Qwen2.5-VL rule: the mean attention each patch receives (queries and heads
    averaged, within its image), pooled over the 2x2 group the merger joins. Every block attends over the whole
    image; ``saliency_block`` picks one (default: the last, whose output the main merger projects).
    DeepStack: the vision blocks of ``deepstack_visual_indexes`` feed their own mergers, whose tokens are added to
    the hidden states of the image positions after the first LLM layers; a pruned image feeds the DeepStack rows
    of its kept tokens, in the order of the kept tokens (a merging method's merged token takes its kept token's
    DeepStack rows unmerged; ``downsample``: its bin centre's rows). The 3D M-RoPE positions of the kept tokens
    are gathered as for Qwen2.5-VL. In-LLM methods (FastV, SparseVLM, DART, PyramidDrop) rank with the attention's
    own ``q_norm`` / ``k_norm``, keep the original 3D positions (PyramidDrop does not renumber on M-RoPE) and add
    the DeepStack rows to the surviving image columns only (``llm_hooks.py``).
    """

    encoder = "qwen3_vl"

    def _block(self) -> int:
        depth = self.model.config.vision_config.depth
        block = self.options.get("saliency_block")
        block = depth - 1 if block is None else block
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < depth:
            raise ValueError(f"saliency_block must be a block of the vision tower (0 .. {depth - 1}), got {block!r}")
        return block

    # encode: QwenAdapter's; no ``vision`` for Qwen3-VL either, and every item carries its DeepStack features

    def _merged_saliency(self, received, grid):
        return sal.pool_groups(received, self.model.config.vision_config)

    def _item_extras(self, out, i: int) -> dict:
        return {"deepstack": [layer[i] for layer in out.deepstack_features]}

    def encoder_outputs(self, items, feats, run_pos):
        """Image features and, per DeepStack layer, each image's rows at the fed run positions."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        layers = len(items[0].deepstack)
        deepstack = [tuple(it.deepstack[layer][pos.to(it.deepstack[layer].device)] for it, pos in zip(items, run_pos))
                     for layer in range(layers)]
        return {"image": BaseModelOutputWithDeepstackFeatures(pooler_output=tuple(feats),
                                                              deepstack_features=deepstack)}


class Qwen35Adapter(Qwen3Adapter):
    """Qwen3.5: Qwen3-VL's vision tower without DeepStack, a hybrid LLM; saliency = received attention at one block.

    No CLS token, so saliency is the Qwen2.5-VL / Qwen3-VL rule: the mean attention each patch receives (queries and
    heads averaged, within its image) at one vision block (``saliency_block``, default the last, whose output the
    merger projects), pooled over the 2x2 group the merger joins; every block attends over the whole image. The
    merged tokens are all the LLM gets of an image (no DeepStack rows), their 3D M-RoPE positions computed on the
    unpruned sequence (Qwen3.5's own ``get_rope_index``) and gathered at the kept columns. The LLM interleaves Gated
    DeltaNet linear-attention layers (a recurrent state of constant size) with full-attention layers
    (``config.text_config.layer_types``); pre-LLM methods shorten what every layer reads, and the in-LLM methods rank
    at full-attention layers only (``llm_hooks.py``).
    """

    encoder = "qwen3_5"

    def _item_extras(self, out, i: int) -> dict:
        return {}

    def encoder_outputs(self, items, feats, run_pos):
        return as_encoder_outputs(feats)


class OnevisionAdapter(Adapter):
    """LLaVA-OneVision (images): SigLIP views (base + anyres crops), unpadding, anyres-max resizing, newlines.

    SigLIP has no CLS token (the "full" strategy feeds every patch), so saliency is the no-CLS rule of Qwen2.5-VL:
    the mean attention each patch receives (queries and heads averaged, within its view) at the layer whose output
    the projector reads (``vision_feature_layer``, -1 on the released model, whose tower the conversion cut to 26
    layers). The candidates are the packed tokens that are not ``image_newline``; where anyres-max resizes the crop
    grid (bilinear, ``vision_aspect_ratio``), a candidate is the resized token the LLM would see, its saliency the
    same bilinear blend of the patch saliencies, its grid index / view those of the patch nearest its sampling point.
    The budget modes are LLaVA-NeXT's over the views (base view = group 0, crop k = group k); ``view_quota`` gives
    each view ``budget // (1 + the most crops of any pinpoint)`` of its fed tokens (no padding is ever a candidate).
    No vision-tower features (``need_vision``): VisPruner / VisionZip work on the projected features, as on Qwen.
    Grid methods (``downsample``) pool each view's FED grid (``VisualItem.cells``): the base view's, and each crop's
    rectangle of the stitched crop grid after unpadding and anyres-max resizing (under ``per_crop`` /
    ``adaptive_views`` / ``view_quota``). CDPruner's instruction: real SigLIP checkpoints have a text tower, but the
    llava-onevision checkpoints ship only the vision tower, so ``text_source`` "released" (default) is "llm" here
    (the LLM's input embeddings of the question vs. the projected tokens); "clip" is refused.
    """

    encoder = "siglip"

    def _attn_module(self):
        layer = self.model.config.vision_feature_layer
        layer = layer if isinstance(layer, int) else layer[-1]
        return sal.clip_attention_module(self.model.model.vision_tower, layer)

    def encode(self, inputs, need_saliency, need_vision=False):
        core, cfg = self.model.model, self.model.config
        sink: list = []
        ctx = sal.capture(self._attn_module(), sink, sal.view_received_attention) if need_saliency \
            else contextlib.nullcontext()
        with ctx:
            out = core.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                                          batch_num_images=inputs.get("batch_num_images"), return_dict=True)
        side = cfg.vision_config.image_size // cfg.vision_config.patch_size
        scores = sink[0] if need_saliency else None  # [sum V_i, side * side]
        items, first = [], 0
        for run, size in zip(out.pooler_output, inputs["image_sizes"]):
            views, rows, cols = self._views(size)
            sal_views = None if scores is None else scores[first:first + views]
            items.append(self._item(run, size, views, rows, cols, side, sal_views))
            first += views
        return items

    def _views(self, size) -> tuple[int, int, int]:
        """``(views, crop rows, crop cols)`` of an image of ``size`` (H, W): base view + rows x cols crops."""
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            get_anyres_image_grid_shape,
            image_size_to_num_patches,
        )

        cfg = self.model.config
        views = image_size_to_num_patches(size, cfg.image_grid_pinpoints, cfg.vision_config.image_size)
        rows, cols = get_anyres_image_grid_shape(size, cfg.image_grid_pinpoints, cfg.vision_config.image_size)
        return views, rows, cols

    def _layout(self, size, views, cols, side, saliency) -> torch.Tensor:
        """The model's own ``pack_image_features`` run on ``(row, col, saliency)`` per patch: ``[P, 3]`` float64 with
        each packed position's (fractional, after anyres-max resizing) source row / column in its grid (the base
        view's own, or the stitched crops') and its saliency; newline positions are all -1."""
        v = torch.arange(views, dtype=torch.float64)[:, None, None]  # [V, 1, 1]
        r = torch.arange(side, dtype=torch.float64)[None, :, None].expand(views, side, side)
        c = torch.arange(side, dtype=torch.float64)[None, None, :].expand(views, side, side)
        crop = (v - 1).clamp_min(0)  # crop k (view k + 1) sits at row k // cols, column k % cols of the crop grid
        gr = torch.where(v > 0, (crop // cols) * side + r, r)
        gc = torch.where(v > 0, (crop % cols) * side + c, c)
        s = torch.zeros(views, side, side, dtype=torch.float64) if saliency is None else \
            saliency.detach().double().cpu().view(views, side, side)
        coords = torch.stack([gr, gc, s], dim=-1).view(views, side * side, 3)
        packed, _ = self.model.model.pack_image_features(
            [coords], size[None].cpu(), image_newline=torch.full((3,), -1.0, dtype=torch.float64),
            vision_aspect_ratio=self.model.config.vision_aspect_ratio)
        return packed[0]

    def _item(self, run, size, views, rows, cols, side, saliency) -> VisualItem:
        n = side * side
        lay = self._layout(size, views, cols, side, saliency).to(run.device)
        assert lay.shape[0] == run.shape[0], "packed layout does not match the model's packed features"
        newline = lay[:, 0] < 0
        run_pos = (~newline).nonzero().flatten()
        r, c = lay[run_pos, 0].round().long(), lay[run_pos, 1].round().long()
        view = torch.zeros_like(r)
        if views > 1:  # positions from n on are crop tokens: view from their source crop
            view[n:] = 1 + (r[n:] // side) * cols + c[n:] // side
        grid = view * n + (r % side) * side + c % side
        assert grid.unique().numel() == grid.numel(), "two packed tokens map to one source patch"
        row = newline.long().cumsum(0) - newline.long()  # newlines strictly before each position
        if views > 1:
            row[:n] = -1  # the base view has no newline rows
        return VisualItem(run=run, features=run[run_pos], run_pos=run_pos, grid_index=grid,
                          saliency=None if saliency is None else lay[run_pos, 2].float(), groups=view,
                          row_of_run=row, newline=newline, cells=self._fed_cells(run_pos, row, n, side))

    @staticmethod
    def _fed_cells(run_pos, row, n, side) -> torch.Tensor:
        """``[N, 2]``: each candidate's (row, col) in the grid the LLM is fed: the base view's ``side x side`` grid
        (its first ``n`` positions), else the crops' stitched grid after unpadding and anyres-max resizing, whose
        rows are the runs between ``image_newline`` tokens (``row [P]``: newlines before each position)."""
        cells = torch.stack([run_pos // side, run_pos % side], dim=-1)  # [N, 2] base view (and a single view)
        crop = run_pos >= n
        if bool(crop.any()):
            r = row[run_pos[crop]]  # [Nc] fed row, non-decreasing
            counts = torch.bincount(r)
            start = counts.cumsum(0) - counts  # first candidate of each fed row
            cells[crop] = torch.stack([r, torch.arange(r.numel(), device=r.device) - start[r]], dim=-1)
        return cells


ADAPTERS = {"llava": LlavaAdapter, "llava_next": LlavaNextAdapter, "qwen2_5_vl": QwenAdapter,
            "qwen3_vl": Qwen3Adapter, "llava_onevision": OnevisionAdapter,
            "qwen3_5": Qwen35Adapter}


def adapter_for(model, processor, options) -> Adapter:
    """The adapter of ``model``'s architecture (by ``config.model_type``)."""
    kind = model.config.model_type
    if kind not in ADAPTERS:
        raise ValueError(f"unsupported model type {kind!r}; supported: {', '.join(ADAPTERS)}")
    return ADAPTERS[kind](model, processor, options)


INTERNVL_MAX_TILES = 12  # InternVL3's released preprocessor: max_patches 12 (GotOcr2ImageProcessor's default too)


def max_views(config) -> int:
    """The most views one image gives: LLaVA-NeXT / LLaVA-OneVision 1 + the most crops of any grid pinpoint (5 on
    llava-v1.6, 37 on llava-onevision); InternVL 1 + the released processor's 12 tiles (the thumbnail; the adapter
    reads its own processor's ``max_patches``); else 1."""
    kind = getattr(config, "model_type", None)
    if kind == "internvl":
        return 1 + INTERNVL_MAX_TILES
    if kind not in ("llava_next", "llava_onevision"):
        return 1
    size = config.vision_config.image_size
    return 1 + max(h // size * (w // size) for h, w in config.image_grid_pinpoints)


def visual_token_capacity(config, adapter_options: dict | None = None) -> int | None:
    """The most visual tokens one image gives the LLM under this config (what a budget must stay below to prune):
    LLaVA-1.5 (image_size / patch)^2 (CLS dropped); LLaVA-NeXT that per view times (1 + the most crops of any grid
    pinpoint), newlines not counted (LLaVA-OneVision: the same, an upper bound as anyres-max resizes large crop grids
    down); Qwen2.5-VL / Qwen3-VL / Qwen3.5 the fixed ``image_tokens`` when set, else None (it depends on the
    image's resolution); InternVL ``image_seq_length`` (256) per tile times 13 tiles (the released tiling); Gemma 4 the
    adapter option ``max_soft_tokens``, else the config's ``vision_soft_tokens_per_image`` (the released 280)."""
    options = adapter_options or {}
    kind = getattr(config, "model_type", None)
    if kind == "gemma4":
        return options.get("max_soft_tokens") or getattr(config, "vision_soft_tokens_per_image", None) or 280
    if kind == "internvl":
        return config.image_seq_length * max_views(config)
    if kind in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        return options.get("image_tokens")
    if kind not in ("llava", "llava_next", "llava_onevision"):
        return None
    vision = config.vision_config
    per_view = (vision.image_size // vision.patch_size) ** 2
    if kind == "llava":
        return per_view
    return per_view * max_views(config)
