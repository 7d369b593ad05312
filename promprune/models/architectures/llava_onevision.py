"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): SigLIP views (base + anyres crops), anyres-max.

SigLIP has no CLS token (the "full" strategy feeds every patch), so saliency is the no-CLS rule of Qwen2.5-VL: the
mean attention each patch receives within its view at the layer the projector reads. The candidates are the packed
tokens after unpadding and anyres-max resizing; the budget modes are LLaVA-NeXT's over the views. Clips
(:mod:`promprune.models.video`): every frame is one SigLIP view, its patch grid bilinearly pooled to
``ceil(side / 2)^2`` tokens by the model's own ``apply_pooling`` (the released model: 27 x 27 -> 14 x 14 = 196 per
frame), one ``image_newline`` closing the clip; a frame's saliency is its patches' received attention pooled the same
way. Its processor stacks a batch's frames, so a batch of clips with different frame counts is processed and encoded
one frame count at a time (``uniform_clips``), each clip getting what it gets alone. The most candidates an image
gives (the capacity), the most and fewest placeholders with the newlines (``Family.most`` / ``fewest``) follow
transformers' own pinpoint pick and unpadding (:func:`onevision_counts`): released 7B 8667, 8765 and 757.

Tiny (``tiny:llava_onevision``): 32 px SigLIP views of 8 px patches (16 tokens), crops up to 2 x 2 with newlines and
anyres_max_2, so a 2 x 2 crop grid is resized down to 5 x 5 tokens (the released model: anyres_max_9 over 384 px
views, up to 6 x 6 crops). Shape: ``shape:llava_onevision_7b``.
"""
from __future__ import annotations

import contextlib
import functools
import math
from fractions import Fraction
from types import SimpleNamespace

import torch
from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    Qwen2Config,
    SiglipVisionConfig,
)
from transformers.image_processing_utils import select_best_resolution
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .. import saliency as sal
from ..adapters import Adapter, VisualItem, token_rows
from ..registry import register_family
from ..shapes import section
from ..tiny import byte_level_tokenizer, seeded, text_sizes
from .llava import view_tokens
from .llava_next import anyres_views

ONEVISION_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
ONEVISION_TEMPLATE = (  # ChatML with LLaVA's <image> placeholder, as llava-onevision-qwen2's template
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% elif c['type'] == 'video' %}<video>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def onevision_tokenizer():
    """The byte-level tokenizer with Qwen2's chat tokens and LLaVA-OneVision's image / video placeholders."""
    tok = byte_level_tokenizer(ONEVISION_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.image_token, tok.video_token = "<image>", "<video>"
    return tok


def onevision_processor(tok, view: int, patch: int, pinpoints, aspect: str, mean, std):
    """A LLaVA-OneVision processor around ``tok``: ``view`` px SigLIP views, anyres ``pinpoints``, ``aspect`` (the
    anyres-max rule: crop grids above max x 1.1^2 views' worth of tokens are resized down)."""
    kwargs = dict(size={"height": view, "width": view}, image_grid_pinpoints=pinpoints, do_pad=True,
                  image_mean=mean, image_std=std)
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(**kwargs), tokenizer=tok,
        video_processor=LlavaOnevisionVideoProcessor(size={"height": view, "width": view}, image_mean=mean,
                                                     image_std=std),
        num_image_tokens=(view // patch) ** 2, vision_feature_select_strategy="full", chat_template=ONEVISION_TEMPLATE,
        vision_aspect_ratio=aspect)


def tiny_llava_onevision():
    tok = onevision_tokenizer()
    view, patch = 32, 8
    pinpoints = [[view, 2 * view], [2 * view, view], [2 * view, 2 * view]]  # 1x2, 2x1, 2x2 crops
    aspect = "anyres_max_2"  # a 2x2 crop grid (64 tokens) is resized to 5x5 = 25 (> 2 x 16 x 1.21 tokens)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                image_size=view, patch_size=patch, vision_use_head=False)
    text = Qwen2Config(**text_sizes(len(tok)), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    config = LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"), vision_feature_layer=-1,
        vision_feature_select_strategy="full", image_grid_pinpoints=pinpoints, vision_aspect_ratio=aspect,
        pad_token_id=tok.pad_token_id,
    )
    model = seeded(lambda: LlavaOnevisionForConditionalGeneration(config))
    return model, onevision_processor(tok, view, patch, pinpoints, aspect, [0.5] * 3, [0.5] * 3)


def shape_llava_onevision(spec: dict, text_layers, vision_layers):
    tok = onevision_tokenizer()
    vision = section(spec, "vision_config", vision_layers)
    vision.pop("model_type")
    text = section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    text.pop("model_type")
    pinpoints = spec["image_grid_pinpoints"]
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**vision), text_config=Qwen2Config(**text),
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=spec["vision_feature_layer"],
        vision_feature_select_strategy=spec["vision_feature_select_strategy"],
        projector_hidden_act=spec["projector_hidden_act"], image_grid_pinpoints=pinpoints,
        vision_aspect_ratio=spec["vision_aspect_ratio"], tie_word_embeddings=spec["tie_word_embeddings"],
        pad_token_id=tok.pad_token_id)
    norm = spec["processor"]
    processor = onevision_processor(tok, spec["image_size"], vision["patch_size"], pinpoints,
                                    spec["vision_aspect_ratio"], norm["image_mean"], norm["image_std"])
    return LlavaOnevisionForConditionalGeneration, config, processor


def _crop_grid_counter(size: int, side: int, pinpoints: tuple, aspect: str):
    """``count(h, w, pinpoint=None) -> (candidates, newlines)`` of an ``h x w`` image's crop grid, by transformers' own
    code: ``select_best_resolution`` picks the pinpoint (unless one is given) and
    ``LlavaOnevisionProcessor._get_unpadded_features`` unpads / resizes its stitched grid (the count the processor
    writes ``<image>`` placeholders for, the base view's aside, and ``pack_image_features`` packs)."""
    features = functools.partial(LlavaOnevisionProcessor._get_unpadded_features,
                                 SimpleNamespace(vision_aspect_ratio=aspect))

    def count(h: int, w: int, pinpoint=None) -> tuple[int, int]:
        height, width = pinpoint or select_best_resolution([h, w], [list(p) for p in pinpoints])
        return features(h, w, side, side, height // size, width // size)

    return count


# An image's unpadded extent is set by int(round(x * B, 7)) (transformers' unpadding): the class n of a ratio x holds
# x * B in [n - 5e-8, n + 1 - 5e-8); these points lie just inside its ends.
_CLASS_LOW, _CLASS_HIGH = Fraction(4, 10**8), Fraction(6, 10**8)


def _class_is_reached(count, cls: tuple, size: int, side: int, pinpoints: tuple) -> bool:
    """Whether some image gives the crop-grid count of ``cls = (counts, pinpoint, wide, n)``: the images that
    ``pinpoint`` unpads to the same extent (see :func:`onevision_counts`), tried where they can pick it.

    In the frame where the image is wider than the pinpoint (``wide``; else transposed: the rule is symmetric), an
    ``h x w`` image is of class ``n`` when ``int(round(h / w * B, 7)) == n``, ``B`` the pinpoint's patch columns.
    ``select_best_resolution`` picks, among the pinpoints that contain the image, the first of least area; where none
    contains it, the one of most ``int(w s) x int(h s)``, ``s = min(W / w, H / h)``, which depends on ``h / w`` alone.
    So (a) an image inside the pinpoint: the largest of its class, ``w = W`` and the tallest ``h`` (it fits in no
    pinpoint the others of the class inside the pinpoint do not, so if one of them picks the pinpoint, so does it);
    (b) one no pinpoint contains: the ratios ``h / w`` of the class where a pinpoint's ``floor(W h / w)`` or
    ``floor(H w / h)`` steps or its limiting side changes, and one ratio between each two, which cover every pick
    (floating-point ties aside), each as an image wider than every pinpoint."""
    counts, pinpoint, wide, n = cls
    frame = [tuple(p) if wide else tuple(p[::-1]) for p in pinpoints]
    height, width = pinpoint if wide else pinpoint[::-1]
    cols = width // size * side

    def gives(h, w) -> bool:
        return (count(h, w) if wide else count(w, h)) == counts

    h = min(height, math.ceil((n + 1) * width / cols))  # (a): the tallest h of class n at w = W
    while h > 0 and int(round(h * (cols / width), 7)) > n:
        h -= 1
    if h > 0 and gives(h, width):
        return True
    rows = height // size * side
    low = max(Fraction(0), (n - _CLASS_LOW) / cols)
    high = Fraction(rows, cols) if n == rows else (n + 1 - _CLASS_HIGH) / cols
    points = {high} | ({low} if low > 0 else set())
    for h_q, w_q in frame:  # (b): where a pinpoint's pick score steps inside the class
        points.update(Fraction(k, w_q) for k in range(max(1, math.ceil(low * w_q)),
                                                      min(h_q, math.floor(high * w_q)) + 1))
        points.update(Fraction(h_q, k) for k in range(max(1, math.ceil(h_q / high)), w_q + 1)
                      if Fraction(h_q, k) >= low)
        if low <= Fraction(h_q, w_q) <= high:
            points.add(Fraction(h_q, w_q))
    points = sorted(points)
    biggest = max(max(p) for p in pinpoints)
    for x in points + [(a + b) / 2 for a, b in zip([low, *points], points)]:
        if x > 0:
            scale = biggest // x.denominator + 1  # wider than every pinpoint: none contains it
            if gives(x.numerator * scale, x.denominator * scale):
                return True
    return False


@functools.lru_cache(maxsize=None)
def onevision_counts(size: int, patch: int, pinpoints: tuple, aspect: str) -> tuple[int, int, int]:
    """``(most candidates, most placeholders, fewest placeholders)`` one image's crop grid gives (the base view's
    ``(size // patch)^2`` aside; placeholders count the ``image_newline`` tokens), exact for these processor
    settings: the image sizes are not swept. transformers' count depends on the pinpoint ``select_best_resolution``
    picks and on the extent the unpadding keeps of its grid, which depends on the image's aspect ratio alone: per
    pinpoint and direction, ``n`` rows (an image wider than it) or columns (taller) of its grid, kept as the
    pinpoint's own count when ``n`` has its parity (the padding is cut evenly off both sides), then resized by
    anyres-max. Each extent's count is transformers' own (:func:`_crop_grid_counter`, on an image of that extent);
    the extents are tried in order of the count sought, and the first one an image reaches
    (:func:`_class_is_reached`: some image picks that pinpoint, or another giving the same count) is the answer. So a
    pinpoint's grid that no image is given counts for nothing, where every extent of every grid over-counts: the
    released 7B's 8829 placeholders (a 6 x 2 crop grid unpadded to 162 x 49, which even cuts to 162 x 50 and resizes
    down), or its capacity at anyres_max_8, 729 + 7047 (3 x 4 crops unpadded to 81 x 87: 81 x 86 or 88 are kept)."""
    side = size // patch
    count = _crop_grid_counter(size, side, pinpoints, aspect)
    classes = []
    for pinpoint in pinpoints:
        rows, cols = pinpoint[0] // size * side, pinpoint[1] // size * side
        for wide in (True, False):
            along, across = (rows, cols) if wide else (cols, rows)
            for n in range(along + 1):  # an image of class n: ratio (2n + 1) / (2 across), or the pinpoint's own
                h, w = (2 * n + 1, 2 * across) if n < along else (along, across)
                classes.append((count(*((h, w) if wide else (w, h)), pinpoint), tuple(pinpoint), wide, n))

    def first(key, descending: bool) -> int:
        for cls in sorted(classes, key=lambda c: key(c[0]), reverse=descending):
            if _class_is_reached(count, cls, size, side, pinpoints):
                return key(cls[0])
        raise AssertionError("no image size gives any of the grid's counts")  # the pinpoint's own aspect always does

    return first(lambda c: c[0], True), first(sum, True), first(sum, False)  # sum: candidates + newlines


def _counts(config) -> tuple[int, int, int]:
    vision = config.vision_config
    return onevision_counts(vision.image_size, vision.patch_size,
                            tuple(tuple(p) for p in config.image_grid_pinpoints), config.vision_aspect_ratio)


def onevision_capacity(config, options: dict) -> int:
    """The most visual tokens an image gives, newlines not counted (the candidates, as LLaVA-NeXT's): the base view's
    patches plus the most non-newline tokens transformers' processor and ``pack_image_features`` give any image's
    crop grid after its pinpoint's unpadding and anyres-max resizing (:func:`onevision_counts`). The released 7B
    config (27 x 27 patches, anyres_max_9): 729 + 7938 = 8667 (3 x 4 crops, 81 x 108 unpadded to 81 x 98, just under
    the 9 x 729 x 1.1^2 tokens anyres-max resizes above; an 1100 x 1331 image), where one view's patches times the 37
    views (26973) counted the crops before resizing. Tiny: 16 + 32 = 48."""
    return view_tokens(config) + _counts(config)[0]


def onevision_most(config, options: dict) -> int:
    """The most placeholders an image gives in the prompt, ``image_newline`` tokens included (what the in-LLM methods
    prune): the base view plus the most a crop grid gives with one newline per kept (or resized) row
    (:func:`onevision_counts`). Released 7B: 729 + 7938 + 98 = 8765 (4 x 3 crops, 108 x 81 unpadded to 98 x 81; a
    1200 x 988 image); tiny: 16 + 32 + 8 = 56 (a 64 x 30 image)."""
    return view_tokens(config) + _counts(config)[1]


def onevision_fewest(config, options: dict) -> int:
    """The fewest placeholders any image gives, newlines included: the base view plus the fewest a crop grid keeps
    (:func:`onevision_counts`). A very wide image keeps no row of a grid of an even number of patch rows but one of an
    odd number (a very tall one keeps no column, but each row's newline): the released 7B (27 patches a crop) picks
    a one-crop-high pinpoint for it, so 729 + 27 + 1 newline = 757 (a 14 x 384 image), where its base view counted
    729; tiny (4 patches a crop, a 1 x 2 crop pinpoint): the base view's 16 (a 7 x 64 image)."""
    return view_tokens(config) + _counts(config)[2]


# mu 0.42: borrowed from CLIP, uncalibrated for SigLIP
@register_family("llava_onevision", model_class="LlavaOnevisionForConditionalGeneration", default_mu=0.42,
                 tiny=tiny_llava_onevision, shape=shape_llava_onevision, capacity=onevision_capacity,
                 fewest=onevision_fewest, most=onevision_most, max_views=anyres_views)
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

    # ---- clips (promprune.models.video) -------------------------------------------------------------------------

    uniform_clips = True  # the processor stacks a batch's frames [B, F, C, H, W]: one frame count per call

    def video_kwargs(self, frames: list, rates: list[float]) -> dict:
        """No processor kwargs: OneVision's prompt carries no timestamps."""
        return {}

    def encode_video(self, batch, need_saliency: bool) -> list[VisualItem]:
        """One item per clip: each frame a view (``groups``) of ``ceil(side / 2)^2`` pooled tokens, the closing
        ``image_newline`` no candidate."""
        core, cfg = self.model.model, self.model.config
        pv = batch["pixel_values_videos"]  # [B, F, C, H, W]
        B, F = pv.shape[:2]
        sink: list = []
        ctx = sal.capture(self._attn_module(), sink, sal.view_received_attention) if need_saliency \
            else contextlib.nullcontext()
        with ctx:
            runs = core.get_video_features(pv, return_dict=True).pooler_output  # [B, F * p + 1, d]: frames, newline
        side = cfg.vision_config.image_size // cfg.vision_config.patch_size
        pooled = math.ceil(side / 2)
        p = pooled * pooled  # tokens per frame
        scores = None
        if need_saliency:  # [B * F, side^2] -> the model's own bilinear pooling -> [B, F * p]
            scores = core.apply_pooling(sink[0].view(B * F, side * side, 1)).reshape(B, F * p)
        return [self._clip_item(runs[b], F, p, pooled, None if scores is None else scores[b]) for b in range(B)]

    @staticmethod
    def _clip_item(run, F: int, p: int, pooled: int, scores) -> VisualItem:
        """One clip's item: ``run [F * p + 1, d]`` (frames, then the newline), ``scores [F * p]`` or None."""
        idx = torch.arange(F * p, device=run.device)
        newline = torch.zeros(F * p + 1, dtype=torch.bool, device=run.device)
        newline[-1] = True
        return VisualItem(run=run, features=run[:F * p], run_pos=idx, grid_index=idx,
                          saliency=None if scores is None else scores.float(), groups=idx // p,
                          row_of_run=torch.zeros_like(newline, dtype=torch.long), newline=newline,
                          grid_shape=(pooled, pooled))

    def video_encoder_outputs(self, items, feats, run_pos) -> dict:
        """One tensor under the "video" key (`token_rows`), which OneVision's forward flattens."""
        return {"video": BaseModelOutputWithPooling(pooler_output=token_rows(feats))}
