"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP ViT with a CLS token, one view, CLS-attention saliency.

The released model reads CLIP ViT-L/14-336's penultimate layer (``vision_feature_layer`` -2) with the CLS dropped
("default" strategy): 24 x 24 = 576 visual tokens, projected by a 2-layer MLP. Saliency is the CLS query's attention
row (head mean) at the layer the projector reads, computed by a hook that forms that one row itself, so the tower
keeps SDPA. The vision tower's own features (``need_vision``): the hidden states the projector reads, that layer's
attention keys (head mean) and the CLS token's hidden state, for the methods whose released code reads them
(``promprune.VisionFeatures``: VisPruner, VisionZip); the projector brings what such a method builds in that space
(VisionZip's merged tokens, its CLS token) into the LLM's. The CLS reaches the LLM only through VisionZip: the
"default" strategy drops it from the placeholder run, so a kept CLS is projected by the model's own
``multi_modal_projector`` and fed first, in a slot the pruning freed (LLaVA numbers the sequence itself, so the slot
carries no position of its own). CDPruner's instruction: CLIP's text tower (``clip_text``). A LLaVA checkpoint with
another tower (SigLIP, as llava-hf/llava-interleave-qwen-*; Pixtral) has no CLS token and is refused
(``LlavaAdapter.check_config``), from its config alone, as is one whose ``vision_feature_select_strategy`` is not
"default" ("full" feeds the CLS too, one token more than the patch grid).

Tiny (``tiny:llava``): the same structure at 48 px, 8 px patches (6 x 6 = 36 tokens), a 3-layer CLIP (so -2 is a
middle layer) and a 4-layer Llama. Shape: ``shape:llava_1_5_7b``.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from ...dtypes import upcast
from .. import saliency as sal
from ..adapters import Adapter, HostIndex, VisualItem
from ..registry import register_family
from ..shapes import section
from ..tiny import byte_level_tokenizer, seeded, text_sizes

# LLaVA-1.5's conversation ("USER: <image>\n... ASSISTANT:"); a system turn is its text and a space, no role, as
# llava-hf's template renders it (so "<system> USER: <image>\n... ASSISTANT:" is LLaVA's vicuna_v1 conversation)
LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %} "
    "{% elif m['role'] == 'user' %}USER: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %} {% else %}ASSISTANT: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
# LLaVA's vicuna_v1 system prompt (haotian-liu/LLaVA, llava/conversation.py): what lmms-eval's llava model sends with
# conv_template=vicuna_v1, as the paper's released evaluation script runs LLaVA-1.5 (sweeps/base_llava15.yaml)
VICUNA_V1_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                    "helpful, detailed, and polite answers to the user's questions.")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def pad_to_square(image, colour: tuple):
    """``image`` centred on a square canvas of ``colour`` whose side is its longer side (the offset floored); a
    square image as it is."""
    from PIL import Image

    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), colour)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


def llava_tokenizer():
    """The byte-level tokenizer of both tiny LLaVAs, with LLaVA's special tokens."""
    tok = byte_level_tokenizer(["<s>", "</s>", "<pad>", "<image>"], bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>")
    tok.image_token = "<image>"
    return tok


def llama_text(tok) -> LlamaConfig:
    """The tiny Llama text config, wired to ``tok``'s special tokens."""
    return LlamaConfig(**text_sizes(len(tok)), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)


def clip_vision(image_size: int) -> CLIPVisionConfig:
    """CLIP ViT with CLS token: 3 layers so `vision_feature_layer=-2` is a middle layer."""
    return CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=image_size, patch_size=8, projection_dim=32,
    )


def clip_image_processor(cls, size: int, **extra):
    """A CLIP image processor class ``cls`` at ``size`` px views (resize, centre crop, CLIP's mean / std)."""
    return cls(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, do_center_crop=True,
        do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, image_mean=CLIP_MEAN,
        image_std=CLIP_STD, **extra,
    )


def llava_processor(cls, tok, image_size: int, patch: int, template: str, image_cls=CLIPImageProcessor,
                    **image_extra):
    """A LLaVA-style processor ``cls`` around ``tok`` with an ``image_cls`` image processor of ``image_size`` px."""
    return cls(
        image_processor=clip_image_processor(image_cls, image_size, **image_extra), tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy="default", chat_template=template, image_token="<image>",
        num_additional_image_tokens=1,
    )


def tiny_llava():
    tok = llava_tokenizer()
    image_size = 48
    config = LlavaConfig(
        vision_config=clip_vision(image_size), text_config=llama_text(tok),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id,
    )
    config.promprune_clip_text = "tiny"  # CDPruner's CLIP text tower: tiny_clip_text (promprune.models.clip_text)
    model = seeded(lambda: LlavaForConditionalGeneration(config))
    return model, llava_processor(LlavaProcessor, tok, image_size, 8, LLAVA_TEMPLATE)


def llava_config_parts(spec: dict, text_layers, vision_layers) -> tuple:
    """``(tokenizer, config kwargs)`` shared by the LLaVA-1.5 and LLaVA-NeXT shapes, shrunk to the layers asked."""
    tok = llava_tokenizer()
    vision = section(spec, "vision_config", vision_layers)
    text = section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id)
    common = dict(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                  vision_feature_layer=spec["vision_feature_layer"], pad_token_id=tok.pad_token_id,
                  vision_feature_select_strategy=spec["vision_feature_select_strategy"],
                  projector_hidden_act=spec["projector_hidden_act"])
    return tok, common


def shape_llava(spec: dict, text_layers, vision_layers):
    tok, common = llava_config_parts(spec, text_layers, vision_layers)
    processor = llava_processor(LlavaProcessor, tok, spec["image_size"], common["vision_config"]["patch_size"],
                                LLAVA_TEMPLATE)
    return LlavaForConditionalGeneration, LlavaConfig(**common), processor


def view_tokens(config) -> int:
    """Patch tokens of one CLIP view, (image_size / patch_size)^2 (the CLS dropped)."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2


def llava_capacity(config, options: dict) -> int:
    """The most visual tokens an image gives: one view's patches."""
    return view_tokens(config)


# mu 0.42: the paper's threshold, calibrated on CLIP ViT-L/14 features
@register_family("llava", model_class="LlavaForConditionalGeneration", default_mu=0.42, tiny=tiny_llava,
                 shape=shape_llava, capacity=llava_capacity, fewest=llava_capacity)
class LlavaAdapter(Adapter):
    """LLaVA-1.5: CLS + patch grid; saliency = CLS attention at the layer ``vision_feature_layer`` reads."""

    pads_to_square = True  # the adapter option pad_to_square applies (LLaVA-NeXT's anyres does not pad)
    towers = ("clip_vision_model",)  # vision_config.model_type of the towers with a CLS token it reads

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse a tower other than CLIP's (SigLIP: llava-hf/llava-interleave-qwen-*; Pixtral): saliency is the CLS
        query's attention row and the "default" strategy drops token 0 as the CLS, so on a tower without one the
        saliency was patch 0's attention row, silently. Refuse a ``vision_feature_select_strategy`` other than
        "default" (every released LLaVA-1.5 / LLaVA-NeXT checkpoint's): "full" feeds the CLS as one more token of
        each view, which the capacity, the token grid and the grid methods do not count (the tiny model: 37 tokens,
        a 6 x 6 grid; VisPruner picked index 36, off the grid)."""
        tower = getattr(getattr(config, "vision_config", None), "model_type", None)
        kind = getattr(config, "model_type", "?")
        if isinstance(tower, str) and tower not in cls.towers:
            raise ValueError(f"a {kind} checkpoint with a {tower!r} vision tower (vision_config.model_type) is not "
                             f"supported: the {kind} adapter ranks tokens by the CLS token's attention of a CLIP tower "
                             f"({', '.join(repr(t) for t in cls.towers)}), and a {tower} tower has no CLS token. "
                             "Supported: LLaVA-1.5 (llava) and LLaVA-NeXT (llava_next) with their CLIP tower; for a "
                             "SigLIP tower, LLaVA-OneVision checkpoints (model_type llava_onevision, e.g. "
                             "llava-hf/llava-onevision-qwen2-7b-ov-hf)")
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ValueError(f"a {kind} checkpoint with vision_feature_select_strategy {strategy!r} is not supported: "
                             f"the {kind} adapter counts, places and ranks each view's patch tokens with the CLS "
                             f"dropped ('default', as every released {kind} checkpoint), and {strategy!r} feeds the "
                             "CLS as one more token, off the patch grid. Set vision_feature_select_strategy "
                             "'default' in its config")

    def prepare_images(self, images):
        """With the adapter option ``pad_to_square``, each image centred on a square of the image processor's mean
        colour (its longer side; LLaVA's ``expand2square``), so the processor's centre crop keeps all of it."""
        if not (self.pads_to_square and self.options.get("pad_to_square")):
            return images
        colour = tuple(int(x * 255) for x in self.processor.image_processor.image_mean)
        return [pad_to_square(image, colour) for image in images]

    def _attn_module(self):
        layer = self.model.config.vision_feature_layer
        if not isinstance(layer, int):
            layer = layer[-1]  # several feature layers: the deepest one's attention ranks the tokens
        return sal.clip_attention_module(self.model.model.vision_tower, layer)

    def _cls_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """CLS attention rows ``[V, S]`` -> per-token saliency ``[V, n]``: the CLS column dropped, as the "default"
        strategy (``check_config``) drops the CLS."""
        return rows[:, 1:]

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
        the "default" strategy (``check_config``) drops."""
        cfg = self.model.config
        if out.hidden_states is None:
            raise RuntimeError("the vision tower returned no hidden states")
        layers = [cfg.vision_feature_layer] if isinstance(cfg.vision_feature_layer, int) else cfg.vision_feature_layer
        hidden = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)  # [V, S, dv]
        return hidden[:, 1:], keys[0][:, 1:], hidden[:, 0]

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
                                    project=self.project if need_vision else None, grid_shape=self._grid_shape(),
                                    host=HostIndex.identity(n)))
        return items

    def _grid_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of one view's patch grid."""
        vc = self.model.config.vision_config
        side = vc.image_size // vc.patch_size
        return side, side
