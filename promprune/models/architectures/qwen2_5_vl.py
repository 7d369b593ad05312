"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): native resolution, 2x2 merged tokens, 3D M-RoPE positions.

The processor resizes each image to multiples of 28 px (14 px patches, 2 x 2 merge) within a pixel range; the tower
attends in windows except at its full-attention blocks (``fullatt_block_indexes``) and its merger joins each 2 x 2
group of patches into one LLM token, so an image gives (H / 28) x (W / 28) tokens (adapter option ``image_tokens``
fixes the count: the paper's 1296 = 36 x 36). No CLS token: saliency is the attention each patch receives at a
full-attention block (``saliency_block``, default the last), queries and heads averaged within its image, pooled over
each 2 x 2 group the merger joins (undoing the window order the tower works in). The LLM numbers the visual tokens
with 3D M-RoPE positions; the kept tokens keep theirs (computed on the unpruned sequence by the model's own
``get_rope_index`` and gathered), and the in-LLM methods never renumber them. No vision-tower features: VisPruner /
VisionZip / CDPruner work on the projected tokens (CDPruner's instruction: the LLM's input embeddings).

Clips (:mod:`promprune.models.video`): the tower joins 2 frames per temporal patch; a "frame" is one temporal patch
(its merged grid), encoded by the image path (``get_video_features`` is ``get_image_features`` on the clip's patches),
its tokens keeping their 3D positions; each clip dated at its own frame rate (``video_metadata``: the processor's
``second_per_grid_ts``, the temporal position step), so a batch's clips may differ in rate.

This module also holds what the Qwen families share: the tokenizer with Qwen's special tokens, the ChatML template
with vision markers and the processor builder. Tiny (``tiny:qwen2_5_vl``): 4 px patches, windowed attention with
full-attention blocks 1 and 3, images of 2 x 2 .. 6 x 6 merged tokens. Shape: ``shape:qwen2_5_vl_7b``.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.video_utils import VideoMetadata

from .. import saliency as sal
from ..adapters import Adapter, VisualItem
from ..options import OptionError
from ..registry import register_family
from ..shapes import section
from ..tiny import byte_level_tokenizer, seeded, text_sizes

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
# ChatML with Qwen's vision start / end markers around the image (or clip) placeholder
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CLIP_NORM = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])  # Qwen2.5-VL's processor


def qwen_tokenizer():
    """The byte-level tokenizer with Qwen's special tokens."""
    return byte_level_tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def qwen_token_ids(tok) -> dict:
    """Config fields that name ``tok``'s special tokens (top level and text config)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                text=dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                          pad_token_id=ids["<|endoftext|>"]))


def qwen_processor(tok, patch: int, merge: int, min_pixels: int, max_pixels: int, *, norm=CLIP_NORM,
                   classes=(Qwen2_5_VLProcessor, Qwen2VLVideoProcessor), video_size: dict | None = None,
                   template: str = QWEN_TEMPLATE):
    """A Qwen processor (``classes``: the processor and video processor classes; Qwen2.5-VL's by default) around
    ``tok`` with the released processor's normalisation ``norm`` (mean, std), and its video processor (clips):
    ``video_size`` its pixel range (``{"shortest_edge", "longest_edge"}``; None: the released video processor's);
    ``template`` its chat template."""
    mean, std = norm
    image_processor = Qwen2VLImageProcessor(
        patch_size=patch, merge_size=merge, temporal_patch_size=2, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=mean, image_std=std,
    )
    processor_cls, video_cls = classes
    sized = {} if video_size is None else {"size": video_size}
    video_processor = video_cls(patch_size=patch, merge_size=merge, temporal_patch_size=2, image_mean=mean,
                                image_std=std, **sized)
    return processor_cls(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                         chat_template=template)


def tiny_qwen2_5_vl():
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    patch, merge = 4, 2
    config = Qwen2_5_VLConfig(
        text_config=dict(**text_sizes(len(tok)), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "mrope_section": [2, 3, 3]}, **ids.pop("text")),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                           spatial_merge_size=merge, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3]),
        **ids,
    )
    model = seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))
    factor = patch * merge
    # 2x2 .. 6x6 merged tokens' worth of pixels (per image, and per video frame)
    return model, qwen_processor(tok, patch, merge, min_pixels=(2 * factor) ** 2, max_pixels=(6 * factor) ** 2,
                                 video_size={"shortest_edge": (2 * factor) ** 2, "longest_edge": (6 * factor) ** 2})


def qwen_parts(spec: dict, text_layers, vision_layers, blocks_key: str | None):
    """(tokenizer, token ids, text config, vision config) of a Qwen shape, shrunk to the layer counts asked for;
    ``blocks_key`` names the vision blocks the model reads specially (Qwen2.5-VL's full-attention blocks, Qwen3-VL's
    DeepStack blocks): those that still exist are kept, at least the last block."""
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    text = section(spec, "text_config", text_layers, **ids.pop("text"))
    vision = section(spec, "vision_config", vision_layers, key="depth")
    if vision_layers is not None and blocks_key is not None:
        vision[blocks_key] = [b for b in vision[blocks_key] if b < vision_layers] or [vision_layers - 1]
    return tok, ids, text, vision


def shape_qwen2_5_vl(spec: dict, text_layers, vision_layers):
    tok, ids, text, vision = qwen_parts(spec, text_layers, vision_layers, "fullatt_block_indexes")
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    factor = vision["patch_size"] * vision["spatial_merge_size"]
    # the released processor's pixel range (4 .. 16384 merged tokens); the adapter's image_tokens pins 1296
    processor = qwen_processor(tok, vision["patch_size"], vision["spatial_merge_size"],
                               min_pixels=4 * factor**2, max_pixels=16384 * factor**2)
    return Qwen2_5_VLForConditionalGeneration, config, processor


def fixed_tokens(config, options: dict) -> int | None:
    """The most (and fewest: the adapter resizes every image to that grid) visual tokens an image gives: the adapter
    option ``image_tokens`` when set, else None (it depends on the image's resolution)."""
    return options.get("image_tokens")


# mu 0.5744: the paper's threshold calibrated on Qwen2.5-VL's encoder
@register_family("qwen2_5_vl", model_class="Qwen2_5_VLForConditionalGeneration", default_mu=0.5744,
                 tiny=tiny_qwen2_5_vl, shape=shape_qwen2_5_vl, capacity=fixed_tokens, fewest=fixed_tokens,
                 mrope=True)
class QwenAdapter(Adapter):
    """Qwen2.5-VL: merged 2x2 tokens; saliency = received attention at a full-attention block, pooled per group."""

    encoder = "qwen2_5_vl"

    def __init__(self, model, processor, options: dict):
        super().__init__(model, processor, options)
        self.block = self.saliency_index(model.config, options)  # checked at construction (check_options)

    @classmethod
    def saliency_index(cls, config, options: dict) -> int:
        """A full-attention block of the vision tower: ``saliency_block``, default the last."""
        full = list(config.vision_config.fullatt_block_indexes)
        block = options.get("saliency_block")
        block = full[-1] if block is None else block
        if isinstance(block, bool) or block not in full:
            raise OptionError("saliency_block", f"saliency_block must be a full-attention block of the vision tower "
                              f"{full}, got {block!r}")
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

    # ---- clips (promprune.models.video) -------------------------------------------------------------------------

    def video_kwargs(self, frames: list, rates: list[float]) -> dict:
        """Processor kwargs dating clips of ``frames`` (``[F, H, W, 3]`` each) at ``rates``: one ``VideoMetadata`` per
        clip (its frame indices and rate), as transformers dates frames it does not sample itself. Qwen2.5-VL's
        processor reads each clip's ``sampled_fps`` for its ``second_per_grid_ts = temporal_patch_size / fps`` (the
        temporal M-RoPE step); without metadata it assumes 24 fps whatever the clip's rate, and a bare ``fps=`` kwarg
        is not read when frames are fed as given. Qwen3-VL's processor writes the timestamps of the same indices into
        the prompt. Per clip, so a batch's clips may differ in rate. A clip shorter than :meth:`_clip_frames` is dated
        as :meth:`prepare_clips` pads it, its repeated frame at its own index (as the processor dates the frame it
        repeats to fill an odd count's last patch)."""
        metadata = []
        for f, rate in zip(frames, rates):
            indices = list(range(len(f)))
            indices += indices[-1:] * (self._clip_frames() - len(indices))  # nothing unless shorter than the minimum
            metadata.append(VideoMetadata(total_num_frames=len(indices), fps=rate, frames_indices=indices))
        return {"video_metadata": metadata}

    def _clip_frames(self) -> int:
        """The fewest frames the video processor takes in a clip: 1 (Qwen2.5-VL's repeats a lone frame to a patch)."""
        return 1

    def encode_video(self, batch, need_saliency: bool) -> list[VisualItem]:
        """One item per clip: the image path on the clip's patches (``get_video_features`` is ``get_image_features``
        on them); each temporal patch is a view (``groups``) of ``h/m x w/m`` merged tokens (``grid_shape``)."""
        grid = batch["video_grid_thw"]  # [B, 3]: (temporal patches, patch rows, patch cols)
        items = self.encode({"pixel_values": batch["pixel_values_videos"], "image_grid_thw": grid}, need_saliency)
        merge = self.model.config.vision_config.spatial_merge_size
        for it, (_t, h, w) in zip(items, grid.tolist()):
            it.grid_shape = (h // merge, w // merge)
            it.groups = it.grid_index // (it.grid_shape[0] * it.grid_shape[1])
        return items

    def video_encoder_outputs(self, items, feats, run_pos) -> dict:
        """The image path's ``mm_encoder_outputs`` under the "video" key."""
        return {"video": self.encoder_outputs(items, feats, run_pos)["image"]}
