"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``): anyres views (base view + crops), unpadding, ``image_newline``.

An image is the base view plus a grid of crops (the pinpoint nearest its aspect ratio), each a CLIP view with LLaVA's
CLS-attention saliency; the model unpads the stitched crop grid to the image's aspect ratio and ends every row with an
``image_newline`` token (llava-v1.6 at 336 px: 576 + 4 x 576 unpadded, 2880 tokens and up to 48 newlines, so up to
2928 placeholders in the prompt: ``anyres_most``). Candidates are the packed tokens that are not newlines, laid out
by running the model's own ``pack_image_features`` on index tensors; ``full`` holds every view's whole grid, padding
included (``budget_mode="view_quota"``), and ``full.spatial()`` feeds them as LLaVA's "spatial" merge without
unpadding does (``unpad=False``: VisPruner's, CDPruner's and VisionZip's released layout; the base view, then the crops'
stitched grid in raster order, padding included, no newline; VisionZip's token order "stages" then feeds its released
order, the crops' CLS and contextual tokens after their stitched dominant ones: ``batched_select._combine``).

``image_newline`` treatment: the newline tokens are no candidates (they carry no image content) except under
``budget_mode="packed"`` (DivPrune's released code selects over the whole packed sequence). With
``image_newline="drop"`` (default) a pruned sequence has no newline tokens, so the LLM receives exactly the budget;
with ``"rows"`` a row's newline is kept when any token of that row is kept, which restores the unpruned sequence at
full budget; ``"all"`` keeps every newline token. Unpruned (``method=None``) the model's
own packed sequence is used unchanged. The vision-tower features and VisionZip's CLS are LLaVA-1.5's, per view.

Tiny (``tiny:llava_next``): 32 px views of 8 px patches (16 tokens), pinpoints up to 2 x 2 crops. Shape:
``shape:llava_next_7b`` (Vicuna, which chats like LLaVA-1.5).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor, LlavaNextProcessor

from ..adapters import HostIndex, VisualItem
from ..registry import register_family
from ..tiny import seeded
from ..transfer import to_device
from .llava import (
    LLAVA_TEMPLATE,
    LlavaAdapter,
    clip_vision,
    llama_text,
    llava_config_parts,
    llava_processor,
    llava_tokenizer,
    view_tokens,
)

# NeXT-Mistral's conversation ("[INST] <image>\n... [/INST]")
NEXT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %} [/INST]{% else %} {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}"
)


def tiny_llava_next():
    tok = llava_tokenizer()
    view = 32
    pinpoints = [[view, 2 * view], [2 * view, view], [2 * view, 2 * view]]  # 1x2, 2x1, 2x2 crops
    config = LlavaNextConfig(
        vision_config=clip_vision(view), text_config=llama_text(tok),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_grid_pinpoints=pinpoints, pad_token_id=tok.pad_token_id,
    )
    config.promprune_clip_text = "tiny"  # CDPruner's CLIP text tower: tiny_clip_text (promprune.models.clip_text)
    model = seeded(lambda: LlavaNextForConditionalGeneration(config))
    return model, llava_processor(LlavaNextProcessor, tok, view, 8, NEXT_TEMPLATE, image_cls=LlavaNextImageProcessor,
                                  image_grid_pinpoints=pinpoints, do_pad=True)


def shape_llava_next(spec: dict, text_layers, vision_layers):
    tok, common = llava_config_parts(spec, text_layers, vision_layers)
    pinpoints = spec["image_grid_pinpoints"]
    # the Vicuna NeXT checkpoint chats like LLaVA-1.5 ("USER: <image>\n... ASSISTANT:")
    processor = llava_processor(LlavaNextProcessor, tok, spec["image_size"], common["vision_config"]["patch_size"],
                                LLAVA_TEMPLATE, image_cls=LlavaNextImageProcessor, image_grid_pinpoints=pinpoints,
                                do_pad=True)
    return LlavaNextForConditionalGeneration, LlavaNextConfig(**common, image_grid_pinpoints=pinpoints), processor


def anyres_views(config) -> int:
    """The most views one image gives: 1 + the most crops of any grid pinpoint (5 on llava-v1.6, 37 on
    llava-onevision)."""
    size = config.vision_config.image_size
    return 1 + max(h // size * (w // size) for h, w in config.image_grid_pinpoints)


def anyres_capacity(config, options: dict) -> int:
    """The most visual tokens an image gives: one view's patches times :func:`anyres_views`, newlines not counted
    (LLaVA-OneVision's anyres-max resizing counts its own from transformers' pinpoint pick and unpadding:
    ``llava_onevision.onevision_counts``)."""
    return view_tokens(config) * anyres_views(config)


def anyres_most(config, options: dict) -> int:
    """The most visual tokens an image gives counted as the prompt holds them, newlines included (what the in-LLM
    methods prune): the base view's patches plus, over the grid pinpoints, the most a pinpoint's stitched crop grid of
    ``rows x cols`` patches gives with one ``image_newline`` per row, ``rows x cols + rows`` (an image of the
    pinpoint's own aspect ratio selects it and is unpadded to the whole grid; unpadding only removes rows or columns).
    llava-v1.6 at 336 px: 576 + 4 x 576 + 48 = 2928 (a 672 x 672 image), where :func:`anyres_capacity` counts 2880."""
    size = config.vision_config.image_size
    side = size // config.vision_config.patch_size  # patch rows of one crop
    crop = view_tokens(config)
    return crop + max(h // size * (w // size) * crop + h // size * side for h, w in config.image_grid_pinpoints)


def base_view_floor(config, options: dict) -> int:
    """A floor on the visual tokens every image gives: its base view's patches (an image much wider or taller than
    every pinpoint unpads its crop grid to almost nothing)."""
    return view_tokens(config)


# mu 0.42: CLIP ViT-L/14's, as LLaVA-1.5 (the same tower)
@register_family("llava_next", model_class="LlavaNextForConditionalGeneration", default_mu=0.42,
                 tiny=tiny_llava_next, shape=shape_llava_next, capacity=anyres_capacity, fewest=base_view_floor,
                 most=anyres_most, max_views=anyres_views)
class LlavaNextAdapter(LlavaAdapter):
    """LLaVA-NeXT anyres: base view + crops, unpadding and ``image_newline`` (see the module docstring)."""

    host_inputs = ("image_sizes",)  # get_image_features reads them with .tolist(): no sync on the host
    pads_to_square = False  # anyres views, not a padded square (LLaVA's own image_aspect_ratio: anyres)

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
        crops = self._crop_grids(inputs["image_sizes"])
        plans, offset = [], 0
        for ids, views, crop_grid in zip(layouts, num_views, crops):
            plans.append(_host_layout(ids, n, views, offset, crop_grid))
            offset += views * n  # scores hold every view's full grid, unpadding or not
        device = out.pooler_output[0].device
        moved = iter(to_device([a for plan in plans for a in plan.values()], device))  # one copy for the batch
        items, first = [], 0
        for run, plan, views in zip(out.pooler_output, plans, num_views):
            dev = {name: next(moved) for name in plan}
            items.append(self._item(run, plan, dev, n, views, flat, scores, vision, first))
            first += views
        return items

    def _packed_layout(self, image_sizes, run_lengths, n) -> tuple[list[np.ndarray], list[int]]:
        """For each image, ``ids [P]`` (host): which (view * n + patch) each packed position holds, -1 for a newline;
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
        layouts = [p[:, 0].round().long().numpy() for p in packed]
        for lay, length in zip(layouts, run_lengths):
            assert lay.shape[0] == length, "packed layout does not match the model's packed features"
        return layouts, num_views

    def _crop_grids(self, image_sizes) -> list[tuple[int, int]]:
        """Each image's crop grid ``(rows, cols)``: transformers' pick of the grid pinpoint (the grid its
        ``pack_image_features`` stitches the crops into)."""
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

        cfg = self.model.config
        return [get_anyres_image_grid_shape(s, cfg.image_grid_pinpoints, cfg.vision_config.image_size)
                for s in image_sizes.tolist()]

    def _item(self, run, plan: dict, dev: dict, n, views, flat, scores, vision, first) -> VisualItem:
        """One image's item from its packed layout, ``plan`` on the host (:func:`_host_layout`) and ``dev`` the same
        on the device; ``flat`` / ``scores`` / ``vision`` hold every view's whole grid (views from ``first``);
        ``full``: the same with the whole grids as candidates."""
        hidden, key, cls = vision
        newline = dev["newline"].bool()

        def at(t, index):
            return None if t is None else t[index]

        def span(t):  # this image's whole grids: a view of the tensor, no copy
            return None if t is None else t[first * n:(first + views) * n]

        shared = dict(run=run, row_of_run=dev["row"], newline=newline,
                      cls=None if cls is None else cls[first:first + views],
                      project=self.project if hidden is not None else None, grid_shape=self._grid_shape())
        full = VisualItem(features=span(flat), run_pos=dev["run_of_grid"], grid_index=dev["whole"],
                          saliency=span(scores), groups=dev["whole_groups"], vision=span(hidden), keys=span(key),
                          spatial_pos=dev["spatial"],
                          host=HostIndex(run_pos=plan["run_of_grid"], grid_index=plan["whole"],
                                         groups=plan["whole_groups"], newline=plan["newline"] != 0,
                                         row_of_run=plan["row"], spatial_pos=plan["spatial"]), **shared)
        return VisualItem(features=run[dev["run_pos"]], run_pos=dev["run_pos"], grid_index=dev["grid"],
                          saliency=at(scores, dev["flat_grid"]), groups=dev["groups"],
                          vision=at(hidden, dev["flat_grid"]), keys=at(key, dev["flat_grid"]), full=full,
                          host=HostIndex(run_pos=plan["run_pos"], grid_index=plan["grid"], groups=plan["groups"],
                                         newline=plan["newline"] != 0, row_of_run=plan["row"]), **shared)


def _host_layout(ids: np.ndarray, n: int, views: int, offset: int, crop_grid: tuple[int, int]) -> dict[str, np.ndarray]:
    """An image's index arrays (int64, on the host) from its packed layout ``ids [P]`` (view * n + patch, -1 for a
    newline): candidates' ``run_pos`` / ``grid`` / ``groups`` and ``flat_grid`` (their rows in the batch's flattened
    grids, from ``offset``), ``newline`` (0/1) and ``row`` per run position, the whole grids' ``whole`` /
    ``whole_groups`` / ``run_of_grid`` (-1: dropped by the model's unpadding), and ``spatial``: each whole-grid token's
    place in LLaVA's "spatial" packing without unpadding (:func:`spatial_positions`; ``crop_grid``: the crops'
    ``(rows, cols)``)."""
    newline = ids < 0
    run_pos = np.flatnonzero(~newline)
    grid = ids[run_pos]
    row = np.cumsum(newline) - newline  # newlines strictly before each position
    if grid.max() >= n:  # several views: the base view (first n positions) has no newline rows
        row[:n] = -1
    whole = np.arange(views * n)
    run_of_grid = np.full(views * n, -1, dtype=np.int64)
    run_of_grid[grid] = run_pos
    return dict(run_pos=run_pos, grid=grid, groups=grid // n, flat_grid=offset + grid,
                newline=newline.astype(np.int64), row=row.astype(np.int64), whole=whole, whole_groups=whole // n,
                run_of_grid=run_of_grid, spatial=spatial_positions(n, views, crop_grid))


def spatial_positions(n: int, views: int, crop_grid: tuple[int, int]) -> np.ndarray:
    """``[views * n]``: where each whole-grid token (view * n + patch) sits in LLaVA's "spatial" packing without
    "_unpad" (``mm_patch_merge_type`` with "_unpad" stripped, as VisPruner's / CDPruner's released code run llava-v1.6;
    VisionZip's ``restore_image_features_sorted`` stitches its crops' dominant tokens the same way): the base view's
    n patches first, then the ``rows x cols`` crops (view 1 + i * cols + j) stitched into one grid of ``rows * side``
    x ``cols * side`` patches read in raster order; padding kept, no newline."""
    if views == 1:
        return np.arange(n, dtype=np.int64)
    rows, cols = crop_grid
    side = math.isqrt(n)
    if rows * cols != views - 1 or side * side != n:
        raise ValueError(f"{views - 1} crops of {n} patches do not fill a {rows} x {cols} grid of square views")
    i, j, r, c = np.meshgrid(np.arange(rows), np.arange(cols), np.arange(side), np.arange(side), indexing="ij")
    stitched = (i * side + r) * (cols * side) + j * side + c  # [rows, cols, side, side]: crop (i, j), patch (r, c)
    return np.concatenate([np.arange(n), n + stitched.reshape(-1)]).astype(np.int64)
