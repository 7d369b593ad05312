"""InternVL3 (``InternVLForConditionalGeneration``): dynamic tiles plus a thumbnail, pixel shuffle, CLS saliency.

The processor cuts an image into a grid of ``1 .. max_patches`` tiles (the grid whose aspect ratio is closest to the
image's) and, when there is more than one, adds a thumbnail of the whole image as the last tile; each tile is one
448 px InternViT view (1024 patches of 14 px and a CLS token). The model drops the CLS ("default" strategy), reads
the layer ``vision_feature_layer`` names (-1: the last of 24), pixel-shuffles each 2x2 block of patches into one
token (``downsample_ratio`` 0.5: 256 tokens per tile) and projects it. The prompt holds ``<img>``, 256 x tiles
``<IMG_CONTEXT>`` placeholders and ``</img>``; the LLM (Qwen2.5) numbers the sequence itself (1D positions), so a
pruned run is numbered as LLaVA's.

Saliency: InternViT keeps a CLS token, so as on LLaVA it is the CLS query's attention row (softmax over the tile's
CLS and patches, head mean) at the layer whose output the projector reads, captured by a hook on that layer's
attention (SDPA / flash attention stay on); ``saliency_block`` picks another encoder layer. An LLM token's saliency
is the SUM of the CLS attention of the 2x2 patches the pixel shuffle merges into it (the attention mass of its
region; the same ranking as their mean, since every token merges 4 patches). Each tile has its own CLS, so a
token's saliency is relative to its own tile (the thumbnail included).

Budget over tiles (``budget_mode``, the LLaVA-NeXT modes with a tile as a view; group 0 is the first tile, the
thumbnail the last group): ``per_crop`` (default) splits the budget evenly over the image's tiles, thumbnail
included; ``global`` selects once over every tile's tokens; ``adaptive_views`` gives each tile a share proportional
to its spectral entropy; ``view_quota`` gives every tile ``budget // (1 + max_patches)`` whatever the image's tile
count. No newline tokens, so ``packed`` is ``global`` for the methods it admits. No vision-tower features
(``need_vision``): VisPruner / VisionZip / CDPruner work on the projected tokens (the pixel-shuffled rows have no
CLS counterpart for VisionZip to feed), as on Qwen and LLaVA-OneVision; CDPruner's instruction is the LLM's input
embeddings of the question.

InternVL3.5 (``OpenGVLab/InternVL3_5-8B-HF``) is the same class with a Qwen3 LLM: this adapter covers it unchanged.
Tiny (``tiny:internvl``): InternViT with a CLS token, 32 px tiles of 4 px patches (8 x 8) pixel-shuffled to 4 x 4 = 16
tokens per tile, the released tiling (up to 12 tiles plus a thumbnail), a Qwen2 LLM. Shapes: ``shape:internvl3_8b``,
``shape:internvl3_5_8b``.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import (
    GotOcr2ImageProcessor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    InternVLVisionConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .. import saliency as sal
from ..adapters import Adapter, VisualItem, saliency_layer, token_rows
from ..registry import register_family
from ..shapes import section
from ..tiny import byte_level_tokenizer, seeded, text_sizes

INTERNVL_MAX_TILES = 12  # InternVL3's released preprocessor: max_patches 12 (GotOcr2ImageProcessor's default too)
INTERNVL_SPECIALS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                     "video_token": "<video>"}
INTERNVL_TEMPLATE = (  # ChatML with InternVL's <IMG_CONTEXT> placeholder, as the -hf checkpoints' template (less
    # its default system prompt)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<IMG_CONTEXT>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # InternVL's normalisation
# InternVL's LLM by the text config's model_type: Qwen2.5 (InternVL3), Qwen3 (InternVL3.5)
INTERNVL_TEXT = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}


def internvl_tokenizer():
    """The byte-level tokenizer with Qwen2's chat tokens and InternVL's image tokens, named as the processor reads
    them (``start_image_token``, ``context_image_token``, ...)."""
    return byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *INTERNVL_SPECIALS.values()],
                                eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                extra_special_tokens=dict(INTERNVL_SPECIALS))


def internvl_processor(tok, tile: int, tokens_per_tile: int, max_tiles: int, mean, std):
    """An InternVL processor around ``tok``: ``tile`` px tiles, up to ``max_tiles`` of them plus a thumbnail (the
    processor's own ``crop_to_patches``), ``tokens_per_tile`` placeholders per tile."""
    size = {"height": tile, "width": tile}
    image_processor = GotOcr2ImageProcessor(size=size, crop_to_patches=False, min_patches=1, max_patches=max_tiles,
                                            image_mean=mean, image_std=std)
    return InternVLProcessor(image_processor=image_processor, tokenizer=tok,
                             video_processor=InternVLVideoProcessor(size=size, image_mean=mean, image_std=std),
                             image_seq_length=tokens_per_tile, chat_template=INTERNVL_TEMPLATE)


def tiny_internvl():
    tok = internvl_tokenizer()
    tile, patch = 32, 4  # 8x8 patches + CLS per tile; the 2x2 pixel shuffle -> 16 tokens
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  image_size=tile, patch_size=patch, attention_bias=True)
    text = Qwen2Config(**text_sizes(len(tok)), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    config = InternVLConfig(vision_config=vision, text_config=text, image_token_id=tok.context_image_token_id,
                            image_seq_length=16, downsample_ratio=0.5, vision_feature_layer=-1,
                            vision_feature_select_strategy="default", tie_word_embeddings=False)
    model = seeded(lambda: InternVLForConditionalGeneration(config))
    return model, internvl_processor(tok, tile, 16, INTERNVL_MAX_TILES, IMAGENET_MEAN, IMAGENET_STD)


def shape_internvl(spec: dict, text_layers, vision_layers):
    tok = internvl_tokenizer()
    vision = section(spec, "vision_config", vision_layers)
    text = section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    text_cls = INTERNVL_TEXT[text.pop("model_type", "qwen2")]
    config = InternVLConfig(
        vision_config=InternVLVisionConfig(**vision), text_config=text_cls(**text),
        image_token_id=tok.context_image_token_id, image_seq_length=spec["image_seq_length"],
        downsample_ratio=spec["downsample_ratio"], vision_feature_layer=spec["vision_feature_layer"],
        vision_feature_select_strategy=spec["vision_feature_select_strategy"],
        projector_hidden_act=spec["projector_hidden_act"], tie_word_embeddings=spec["tie_word_embeddings"])
    p = spec["processor"]
    processor = internvl_processor(tok, p["tile"], spec["image_seq_length"], p["max_patches"], p["image_mean"],
                                   p["image_std"])
    return InternVLForConditionalGeneration, config, processor


def released_tiles(config) -> int:
    """The most views one image gives: the released processor's 12 tiles plus the thumbnail (the adapter reads its
    own processor's ``max_patches``)."""
    return 1 + INTERNVL_MAX_TILES


def tiled_capacity(config, options: dict) -> int:
    """The most visual tokens an image gives: ``image_seq_length`` (256) per tile times 13 tiles (the released
    tiling)."""
    return config.image_seq_length * released_tiles(config)


def one_tile(config, options: dict) -> int:
    """The fewest visual tokens an image gives: one tile's ``image_seq_length`` (a one-tile image has no thumbnail)."""
    return config.image_seq_length


def cls_attention(attn: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """CLS-to-all attention of an ``InternVLVisionAttention`` (its q / k norms applied), head mean:
    ``hidden [T, S, C] -> [T, S]`` float32, one row per tile."""
    T, S, _ = hidden.shape
    H, hd = attn.num_heads, attn.head_dim
    q = attn.q_norm(attn.q_proj(hidden[:, :1])).float().view(T, 1, H, hd).transpose(1, 2)  # [T, H, 1, hd]
    k = attn.k_norm(attn.k_proj(hidden)).float().view(T, S, H, hd).transpose(1, 2)  # [T, H, S, hd]
    probs = torch.softmax((q @ k.transpose(-1, -2)) * attn.scale, dim=-1)  # [T, H, 1, S]
    return probs[:, :, 0].mean(dim=1)  # [T, S]


# mu 0.42: borrowed from CLIP, uncalibrated for InternViT
@register_family("internvl", model_class="InternVLForConditionalGeneration", default_mu=0.42, tiny=tiny_internvl,
                 shape=shape_internvl, capacity=tiled_capacity, fewest=one_tile,
                 max_views=released_tiles)
class InternVLAdapter(Adapter):
    """InternVL3: tiles + thumbnail, 2x2 pixel shuffle; saliency = CLS attention summed over each token's 4 patches
    (see the module docstring)."""

    encoder = "internvit"

    def __init__(self, model, processor, options: dict):
        super().__init__(model, processor, options)
        cfg = model.config
        if cfg.vision_feature_select_strategy != "default":
            raise ValueError("the InternVL adapter needs vision_feature_select_strategy 'default' (the CLS dropped, "
                             f"as the released checkpoints); got {cfg.vision_feature_select_strategy!r}")
        self.layer = self.saliency_index(cfg, options)  # checked at construction (check_options)
        self.members = self._shuffle_members()  # [n, 4]: the patches merged into each token

    @classmethod
    def saliency_index(cls, config, options: dict) -> int:
        """Index of the encoder layer whose attention gives saliency: ``saliency_block``, else the one whose output
        ``vision_feature_layer`` reads (several: the deepest)."""
        depth = config.vision_config.num_hidden_layers
        layer = config.vision_feature_layer
        layer = layer if isinstance(layer, int) else layer[-1]
        read = (layer if layer >= 0 else layer + depth + 1) - 1  # hidden_states[h] is layer h - 1's output
        return saliency_layer(options, depth, read, "layer of the vision tower")

    def _side(self) -> int:
        """Patches per side of one tile."""
        vc = self.model.config.vision_config
        size, patch = vc.image_size, vc.patch_size
        size = size[0] if isinstance(size, (list, tuple)) else size
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        return size // patch

    def _shuffle_members(self) -> torch.Tensor:
        """``[n, k]``: the raster indices of the ``k`` patches the model's own ``pixel_shuffle`` merges into each of a
        tile's ``n`` tokens (run on an index grid, so the layout is transformers', not a copy of it)."""
        side = self._side()
        grid = torch.arange(side * side, dtype=torch.float64).view(1, side, side, 1)
        shuffled = self.model.model.pixel_shuffle(grid, scale_factor=self.model.config.downsample_ratio)
        return shuffled.reshape(-1, shuffled.shape[-1]).round().long()

    @classmethod
    def views(cls, config, processor=None) -> int | None:
        """The most tiles one image gives: ``max_patches`` of the processor's tiling plus the thumbnail."""
        if processor is None:
            return None
        return 1 + int(getattr(processor.image_processor, "max_patches", INTERNVL_MAX_TILES))

    def encode(self, inputs, need_saliency, need_vision=False):
        """One item per image: all its tiles' tokens, tile by tile (``groups``: the tile; thumbnail last)."""
        core = self.model.model
        sink: list = []
        attn = core.vision_tower.encoder.layer[self.layer].attention
        with sal.capture(attn, sink, cls_attention) if need_saliency else contextlib.nullcontext():
            out = core.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True)
        tiles = out.pooler_output  # [T, n, d]: every image's tiles, image after image
        T, n, d = tiles.shape
        per_image = (inputs["input_ids"] == self.model.config.image_token_id).sum(1) // n  # [B] tiles
        if int(per_image.sum()) != T:
            raise ValueError(f"the prompts hold placeholders for {int(per_image.sum())} tiles of {n} tokens, the "
                             f"images gave {T} tiles")
        scores = None
        if need_saliency:
            members = self.members.to(sink[0].device)
            scores = sink[0][:, 1:][:, members].sum(dim=-1)  # [T, n]: CLS column dropped, summed per token
        items, first = [], 0
        grid = (self._side() * self.model.config.downsample_ratio,) * 2
        for count in per_image.tolist():
            run = tiles[first:first + count].reshape(-1, d)  # [count * n, d]
            idx = torch.arange(run.shape[0], device=run.device)
            s = None if scores is None else scores[first:first + count].reshape(-1)
            items.append(VisualItem(run=run, features=run, run_pos=idx, grid_index=idx, saliency=s, groups=idx // n,
                                    grid_shape=tuple(int(g) for g in grid)))
            first += count
        return items

    def encoder_outputs(self, items, feats, run_pos):
        """InternVL scatters one tensor into the placeholders (no per-image tuple): `token_rows`."""
        return {"image": BaseModelOutputWithPooling(pooler_output=token_rows(feats))}

