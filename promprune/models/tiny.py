"""Tiny, offline, seeded VLMs built from the real transformers classes.

`tiny_vlm(arch)` returns `(model, processor)` for arch in `ARCHS` ({"llava", "llava_next", "qwen2_5_vl", ...}):
the genuine `LlavaForConditionalGeneration` / `LlavaNextForConditionalGeneration` /
`Qwen2_5_VLForConditionalGeneration` with random weights (seed 0), and a processor whose tokenizer,
image processor and chat template are constructed from code (no hub access).

The structure is the paper's, the sizes are not:

- LLaVA-1.5: CLIP ViT with a CLS token, `vision_feature_layer=-2`, "default" strategy (CLS dropped);
  48 px images, 8 px patches -> a 6x6 grid = 36 visual tokens (the real model: 24x24 = 576).
- LLaVA-NeXT: anyres with base view + crops, `image_newline`, unpadding; 32 px views, 8 px patches ->
  4x4 = 16 tokens per view, grid pinpoints up to 64x64 (2x2 crops).
- Qwen2.5-VL: 4 px patches, temporal patch 2, 2x2 merger, windowed attention with full-attention
  blocks 1 and 3; images resized to multiples of 8 px between 16x16 and 48x48 px.
- Qwen3-VL: the same patching and pixel range, full attention in every block, a 4x4 learned position grid
  and DeepStack features from vision blocks 0-2 added after LLM layers 0-2.
- LLaVA-OneVision: SigLIP without CLS (all patches fed, "full" strategy, the last layer's output), 32 px views of
  8 px patches (16 tokens), anyres crops up to 2x2 with newlines, and anyres_max_2, so a 2x2 crop grid is resized
  down to 5x5 tokens (the released model: anyres_max_9 over 384 px views, up to 6x6 crops).
- Qwen3.5: Qwen3-VL's vision tower without DeepStack (the same patching and pixel range), and a hybrid LLM of 8
  layers alternating Gated DeltaNet linear attention and gated full attention (``layer_types``: layers 1, 3, 5, 7
  full; the released 4B: every 4th of 32), partial rotary (a quarter of the 32-wide heads) with interleaved M-RoPE.
- InternVL3: InternViT with a CLS token (dropped, "default" strategy; the last layer's output), 32 px tiles of 4 px
  patches (8x8) pixel-shuffled to 4x4 = 16 tokens per tile, the released tiling (up to 12 tiles plus a thumbnail;
  the released model: 448 px tiles of 14 px patches, 256 tokens per tile), a Qwen2 LLM.
- Gemma 4: its variable-resolution encoder (no CLS) on 4 px patches, each image resized keeping its aspect ratio to at
  most 70 x 9 patches (the smallest released soft-token budget, 70) and pooled 3x3 into up to 70 soft tokens (the
  released model: 16 px patches, 280 tokens by default); an LLM of 6 layers alternating sliding-window (160 tokens:
  wider than the test prompts, as the 31B's 1024 is for a 280-token image; tests narrow it to make it cut) and full
  attention, the full layers with their own head width, one KV head, keys as values (``attention_k_eq_v``) and
  partial RoPE, vision tokens attending bidirectionally in the sliding layers (the 31B: 5 sliding to 1 full).

The tokenizer is byte-level BPE without merges (one token per byte) plus the architecture's special
tokens, so any text round-trips and nothing is ever unknown.
"""
from __future__ import annotations

import copy
import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    CLIPImageProcessor,
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    GotOcr2ImageProcessor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    InternVLVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
    SiglipVisionConfig,
)

from .factories import place

ARCHS = ("llava", "llava_next", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "internvl",
         "qwen3_5", "gemma4")
SEED = 0  # fixed so every process builds bit-identical tiny models

# Chat templates in the style of the real checkpoints (LLaVA-1.5 "USER: <image>\n... ASSISTANT:",
# NeXT-Mistral "[INST] <image>\n... [/INST]", Qwen ChatML with vision start/end markers).
LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %} {% else %}ASSISTANT: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
_NEXT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %} [/INST]{% else %} {% for c in m['content'] %}{{ c['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}"
)
_ONEVISION_TEMPLATE = (  # ChatML with LLaVA's <image> placeholder, as llava-onevision-qwen2's template
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% elif c['type'] == 'video' %}<video>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_INTERNVL_TEMPLATE = (  # ChatML with InternVL's <IMG_CONTEXT> placeholder, as the -hf checkpoints' template (less
    # its default system prompt)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<IMG_CONTEXT>\n{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3.5's generation prompt opens a reasoning block unless enable_thinking is false (then an empty one), as the
# released Qwen3.5-4B template does
_QWEN3_5_TEMPLATE = _QWEN_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


def _byte_level_tokenizer(special_tokens: list[str], **named) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: 256 byte tokens, then `special_tokens` (ids 256, 257, ...)."""
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(special_tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **named)


def _text_sizes(vocab_size: int) -> dict:
    """A 4-layer LLM: deep enough for FastV at layer 2 and SparseVLM's several pruning layers."""
    return dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )


def llava_tokenizer():
    """The byte-level tokenizer of both tiny LLaVAs, with LLaVA's special tokens."""
    tok = _byte_level_tokenizer(["<s>", "</s>", "<pad>", "<image>"], bos_token="<s>", eos_token="</s>",
                                pad_token="<pad>")
    tok.image_token = "<image>"
    return tok


def _llama_text(tok) -> LlamaConfig:
    """The tiny Llama text config, wired to ``tok``'s special tokens."""
    return LlamaConfig(**_text_sizes(len(tok)), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)


def _clip_vision(image_size: int) -> CLIPVisionConfig:
    """CLIP ViT with CLS token: 3 layers so `vision_feature_layer=-2` is a middle layer."""
    return CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=image_size, patch_size=8, projection_dim=32,
    )


def _clip_image_processor(cls, size: int, **extra):
    return cls(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, do_center_crop=True,
        do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
        **extra,
    )


def _seeded(build):
    torch.manual_seed(SEED)
    return build().eval()


def llava_processor(cls, tok, image_size: int, patch: int, template: str, **image_extra):
    """A LLaVA / LLaVA-NeXT processor around ``tok`` with a CLIP image processor of ``image_size`` px views."""
    image_cls = LlavaNextImageProcessor if cls is LlavaNextProcessor else CLIPImageProcessor
    return cls(
        image_processor=_clip_image_processor(image_cls, image_size, **image_extra), tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy="default", chat_template=template, image_token="<image>",
        num_additional_image_tokens=1,
    )


def tiny_clip_text(vision_config):
    """``(tokenizer, text model, visual projection)``: a seeded random CLIP text tower matching ``vision_config``
    (CDPruner on the tiny LLaVAs; :func:`promprune.models.clip_text.load` with "tiny"): byte-level tokens between
    CLIP's start / end markers, 16-token windows (so long questions take several)."""
    tok = _byte_level_tokenizer(["<|startoftext|>", "<|endoftext|>"], bos_token="<|startoftext|>",
                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)])
    config = CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=16,
                            projection_dim=vision_config.projection_dim,
                            bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(SEED)
    text = CLIPTextModelWithProjection(config).eval()
    projection = torch.nn.Linear(vision_config.hidden_size, vision_config.projection_dim, bias=False)
    return tok, text, projection


def _tiny_llava():
    tok = llava_tokenizer()
    image_size = 48
    config = LlavaConfig(
        vision_config=_clip_vision(image_size), text_config=_llama_text(tok),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id,
    )
    config.promprune_clip_text = "tiny"  # CDPruner's CLIP text tower: tiny_clip_text (promprune.models.clip_text)
    model = _seeded(lambda: LlavaForConditionalGeneration(config))
    return model, llava_processor(LlavaProcessor, tok, image_size, 8, LLAVA_TEMPLATE)


def _tiny_llava_next():
    tok = llava_tokenizer()
    view = 32
    pinpoints = [[view, 2 * view], [2 * view, view], [2 * view, 2 * view]]  # 1x2, 2x1, 2x2 crops
    config = LlavaNextConfig(
        vision_config=_clip_vision(view), text_config=_llama_text(tok),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_grid_pinpoints=pinpoints, pad_token_id=tok.pad_token_id,
    )
    config.promprune_clip_text = "tiny"  # CDPruner's CLIP text tower: tiny_clip_text (promprune.models.clip_text)
    model = _seeded(lambda: LlavaNextForConditionalGeneration(config))
    return model, llava_processor(LlavaNextProcessor, tok, view, 8, _NEXT_TEMPLATE, image_grid_pinpoints=pinpoints,
                                  do_pad=True)


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]


def qwen_tokenizer():
    """The byte-level tokenizer with Qwen's special tokens."""
    return _byte_level_tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def qwen_token_ids(tok) -> dict:
    """Config fields that name ``tok``'s special tokens (top level and text config)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                text=dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                          pad_token_id=ids["<|endoftext|>"]))


# the released processors' normalisation: Qwen2.5-VL CLIP's mean / std, Qwen3-VL 0.5 / 0.5
_QWEN_NORM = {"qwen2_5_vl": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
              "qwen3_vl": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])}


def qwen_processor(tok, patch: int, merge: int, min_pixels: int, max_pixels: int, family: str = "qwen2_5_vl",
                   video_size: dict | None = None, template: str = _QWEN_TEMPLATE):
    """A Qwen2.5-VL (or, ``family="qwen3_vl"``, Qwen3-VL) processor around ``tok`` with the released processor's
    normalisation, and its video processor (clips, ``promprune.models.video``): ``video_size`` its pixel range
    (``{"shortest_edge", "longest_edge"}``; None: the released video processor's); ``template`` its chat template."""
    mean, std = _QWEN_NORM[family]
    image_processor = Qwen2VLImageProcessor(
        patch_size=patch, merge_size=merge, temporal_patch_size=2, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=mean, image_std=std,
    )
    processor_cls, video_cls = ((Qwen2_5_VLProcessor, Qwen2VLVideoProcessor) if family == "qwen2_5_vl" else
                                (Qwen3VLProcessor, Qwen3VLVideoProcessor))
    sized = {} if video_size is None else {"size": video_size}
    video_processor = video_cls(patch_size=patch, merge_size=merge, temporal_patch_size=2, image_mean=mean,
                                image_std=std, **sized)
    return processor_cls(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                         chat_template=template)


def _tiny_qwen2_5_vl():
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    patch, merge = 4, 2
    config = Qwen2_5_VLConfig(
        text_config=dict(**_text_sizes(len(tok)), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 3, 3]}, **ids.pop("text")),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                           spatial_merge_size=merge, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3]),
        **ids,
    )
    model = _seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))
    factor = patch * merge
    # 2x2 .. 6x6 merged tokens' worth of pixels (per image, and per video frame)
    return model, qwen_processor(tok, patch, merge, min_pixels=(2 * factor) ** 2, max_pixels=(6 * factor) ** 2,
                                 video_size={"shortest_edge": (2 * factor) ** 2, "longest_edge": (6 * factor) ** 2})


def _tiny_qwen3_vl():
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    patch, merge = 4, 2
    text = dict(**_text_sizes(len(tok)), head_dim=16, **ids.pop("text"),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    # DeepStack: blocks 0, 1, 2 feed LLM layers 0, 1, 2 (the released model: blocks 8, 16, 24 of 27), so FastV
    # (layer 2) and SparseVLM (layers 1, 2) prune before some DeepStack additions
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                  spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1, 2])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    model = _seeded(lambda: Qwen3VLForConditionalGeneration(config))
    factor = patch * merge
    # a clip's pixels are bounded as a whole (Qwen3-VL's video processor): up to 8 frames of 6x6 merged tokens
    return model, qwen_processor(tok, patch, merge, min_pixels=(2 * factor) ** 2, max_pixels=(6 * factor) ** 2,
                                 family="qwen3_vl",
                                 video_size={"shortest_edge": (2 * factor) ** 2, "longest_edge": 8 * (6 * factor) ** 2})


QWEN3_5_LAYERS = 8  # deep enough for SparseVLM's and PyramidDrop's three stages at distinct full-attention layers


def _tiny_qwen3_5():
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    patch, merge = 4, 2
    # full attention every 2nd layer (the released models: every 4th), so each in-LLM stage finds a full-attention
    # layer to rank at and linear-attention layers after it; 32-wide heads with a quarter rotary (the released
    # 256-wide heads: 64 rotary dims, mrope_section [11, 11, 10]) -> 8 rotary dims, sections [2, 1, 1]
    text = dict(**_text_sizes(len(tok)), **ids.pop("text"))
    text.update(num_hidden_layers=QWEN3_5_LAYERS, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention"] * (QWEN3_5_LAYERS // 2),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                  spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    model = _seeded(lambda: Qwen3_5ForConditionalGeneration(config))
    factor = patch * merge
    # Qwen3.5 ships Qwen3-VL's processor (transformers maps qwen3_5 to Qwen3VLProcessor): the same pixel ranges
    return model, qwen_processor(tok, patch, merge, min_pixels=(2 * factor) ** 2, max_pixels=(6 * factor) ** 2,
                                 family="qwen3_vl",
                                 video_size={"shortest_edge": (2 * factor) ** 2, "longest_edge": 8 * (6 * factor) ** 2},
                                 template=_QWEN3_5_TEMPLATE)


ONEVISION_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]


def onevision_tokenizer():
    """The byte-level tokenizer with Qwen2's chat tokens and LLaVA-OneVision's image / video placeholders."""
    tok = _byte_level_tokenizer(ONEVISION_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
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
        num_image_tokens=(view // patch) ** 2, vision_feature_select_strategy="full", chat_template=_ONEVISION_TEMPLATE,
        vision_aspect_ratio=aspect)


def _tiny_llava_onevision():
    tok = onevision_tokenizer()
    view, patch = 32, 8
    pinpoints = [[view, 2 * view], [2 * view, view], [2 * view, 2 * view]]  # 1x2, 2x1, 2x2 crops
    aspect = "anyres_max_2"  # a 2x2 crop grid (64 tokens) is resized to 5x5 = 25 (> 2 x 16 x 1.21 tokens)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                image_size=view, patch_size=patch, vision_use_head=False)
    text = Qwen2Config(**_text_sizes(len(tok)), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    config = LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"), vision_feature_layer=-1,
        vision_feature_select_strategy="full", image_grid_pinpoints=pinpoints, vision_aspect_ratio=aspect,
        pad_token_id=tok.pad_token_id,
    )
    model = _seeded(lambda: LlavaOnevisionForConditionalGeneration(config))
    return model, onevision_processor(tok, view, patch, pinpoints, aspect, [0.5] * 3, [0.5] * 3)


INTERNVL_SPECIALS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                     "video_token": "<video>"}


def internvl_tokenizer():
    """The byte-level tokenizer with Qwen2's chat tokens and InternVL's image tokens, named as the processor reads
    them (``start_image_token``, ``context_image_token``, ...)."""
    return _byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *INTERNVL_SPECIALS.values()],
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
                             image_seq_length=tokens_per_tile, chat_template=_INTERNVL_TEMPLATE)


IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # InternVL's normalisation


def _tiny_internvl():
    tok = internvl_tokenizer()
    tile, patch = 32, 4  # 8x8 patches + CLS per tile; the 2x2 pixel shuffle -> 16 tokens
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  image_size=tile, patch_size=patch, attention_bias=True)
    text = Qwen2Config(**_text_sizes(len(tok)), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    config = InternVLConfig(vision_config=vision, text_config=text, image_token_id=tok.context_image_token_id,
                            image_seq_length=16, downsample_ratio=0.5, vision_feature_layer=-1,
                            vision_feature_select_strategy="default", tie_word_embeddings=False)
    model = _seeded(lambda: InternVLForConditionalGeneration(config))
    return model, internvl_processor(tok, tile, 16, 12, IMAGENET_MEAN, IMAGENET_STD)


GEMMA4_SPECIALS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                   "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
# Gemma 4's turns (``<|turn>role ... <turn|>``, the model's role named "model"), the image as its ``<|image|>``
# placeholder before the text, as the -it checkpoints' template renders a user turn without thinking
_GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def gemma4_tokenizer():
    """The byte-level tokenizer with Gemma's pad / eos / bos, its turn markers and its image and audio tokens, named
    as Gemma4Processor reads them (``image_token``, ``boi_token``, ...)."""
    return _byte_level_tokenizer(["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", *GEMMA4_SPECIALS.values()],
                                 bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                 extra_special_tokens=dict(GEMMA4_SPECIALS))


def gemma4_token_ids(tok) -> dict:
    """Gemma4Config's token-id fields wired to ``tok`` (the processor adds ``<|video|>`` to it)."""
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in GEMMA4_SPECIALS.items()}
    return dict(image_token_id=ids["image_token"], boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
                audio_token_id=ids["audio_token"], boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"],
                video_token_id=tok.convert_tokens_to_ids("<|video|>"))


def gemma4_processor(tok, patch: int, max_soft_tokens: int, pooling: int = 3):
    """A Gemma4Processor around ``tok``: ``patch`` px patches, at most ``max_soft_tokens`` soft tokens per image (one of
    the released budgets 70 / 140 / 280 / 560 / 1120), ``pooling`` x ``pooling`` patches per soft token; the audio
    feature extractor and video processor its constructor requires."""
    sizes = dict(patch_size=patch, max_soft_tokens=max_soft_tokens, pooling_kernel_size=pooling)
    return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                           image_processor=Gemma4ImageProcessor(**sizes), tokenizer=tok,
                           video_processor=Gemma4VideoProcessor(**sizes), chat_template=_GEMMA4_TEMPLATE,
                           image_seq_length=max_soft_tokens)


def _tiny_gemma4():
    tok = gemma4_tokenizer()
    processor = gemma4_processor(tok, patch=4, max_soft_tokens=70)  # adds <|video|> to tok: build it first
    text = dict(**_text_sizes(len(tok)), head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                attention_k_eq_v=True, sliding_window=160, final_logit_softcapping=30.0,
                layer_types=["sliding_attention", "full_attention"] * 3, use_bidirectional_attention="vision",
                hidden_size_per_layer_input=0, num_kv_shared_layers=0, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    text["num_hidden_layers"] = 6  # three sliding / full pairs: in-LLM ranks land on full layers (llm_hooks.py)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, patch_size=4, pooling_kernel_size=3,
                  position_embedding_size=64, standardize=True)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, vision_soft_tokens_per_image=70,
                          **gemma4_token_ids(tok))
    model = _seeded(lambda: Gemma4ForConditionalGeneration(config))
    return model, processor


_BUILDERS = {"llava": _tiny_llava, "llava_next": _tiny_llava_next, "qwen2_5_vl": _tiny_qwen2_5_vl,
             "qwen3_vl": _tiny_qwen3_vl, "llava_onevision": _tiny_llava_onevision, "internvl": _tiny_internvl,
             "qwen3_5": _tiny_qwen3_5, "gemma4": _tiny_gemma4}


@functools.lru_cache(maxsize=None)
def _cached(arch: str):
    return _BUILDERS[arch]()


def load(arch: str, *, dtype=None, device_map=None, attn_implementation=None, max_memory=None):
    """The ``tiny:<arch>`` model factory: a private copy of ``tiny_vlm(arch)``, placed like ``from_pretrained``."""
    model, processor = tiny_vlm(arch)
    model = place(copy.deepcopy(model), dtype=dtype, device_map=device_map, attn_implementation=attn_implementation,
                  max_memory=max_memory)
    return model, copy.deepcopy(processor), {}


load.config = lambda arch: tiny_vlm(arch)[0].config  # noqa: E731 - the factory's config, for validation


def tiny_vlm(arch: str):
    """`(model, processor)` for a tiny seeded random-weight VLM of architecture `arch`.

    Built once per process and cached: callers must not mutate the weights (dtype changes included,
    use `copy.deepcopy(model)` first).
    """
    if arch not in _BUILDERS:
        raise ValueError(f"unknown tiny arch {arch!r}; valid: {', '.join(ARCHS)}")
    return _cached(arch)
