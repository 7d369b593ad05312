"""The published shapes without their weights: random-weight VLMs at the paper's real sizes (and newer models').

``shape_vlm(name)`` builds LLaVA-1.5-7B, LLaVA-NeXT-7B (Vicuna), Qwen2.5-VL-7B, Qwen3-VL-8B, LLaVA-OneVision-7B,
InternVL3-8B, InternVL3.5-8B, Qwen3.5-4B, Gemma 4 31B or Gemma 4 E2B from the sizes in this folder's JSON files (copied
from the checkpoints' ``config.json``; each file's ``_source`` says where from) with random weights, and an offline
processor with the checkpoint's image settings (336 px CLIP views and anyres pinpoints; Qwen2.5-VL's 14 px patches and
2x2 merge; Qwen3-VL's 16 px patches, 2x2 merge, 0.5 mean / std; OneVision's 384 px SigLIP views, 6x6 pinpoints and
anyres_max_9; InternVL3's 448 px tiles, up to 12 plus a thumbnail, as InternVL3.5's; Qwen3.5's, which is Qwen3-VL's;
Gemma 4's 16 px patches pooled 3x3, at most 280 soft tokens per image). Latency, memory, FLOPs and token counts do not
depend on weight values, so these stand in for the checkpoints wherever those cannot be downloaded
(``PrunedVLM.from_pretrained("shape:llava_next_7b")``). The text is byte-level tokenized (one token per byte), so a
prompt has more text tokens than under the real tokenizer; the vocabulary size, and so the embedding and LM-head shapes,
stay the published ones.

``text_layers`` / ``vision_layers`` shorten the stacks at full width (tests build one or two layers on CPU; a
shortened Gemma 4 keeps the first layers' types, its last layer full attention, and no KV sharing);
``width_divisor`` narrows both towers by one factor (hidden and MLP widths, attention heads; the head width stays),
so that a CPU can run a LLaVA-1.5 whose towers are shrunk alike (benchmarks/throughput.py: 1/8 of the layers and
1/4 of the widths, the vision-to-LLM cost ratio near the 7B's).
"""
from __future__ import annotations

import json
from importlib import resources

import torch
from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLVisionConfig,
    Qwen2Config,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3Config,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    SiglipVisionConfig,
)

from promprune.dtypes import AUTO, parse_dtype

from .. import tiny
from ..factories import place

SEED = 0


def shapes() -> list[str]:
    """Names of the shipped shapes (the JSON files of this folder)."""
    return sorted(p.name.removesuffix(".json") for p in resources.files(__package__).iterdir()
                  if p.name.endswith(".json"))


def shape_spec(name: str) -> dict:
    """The published sizes of ``name`` as a dict (``model_type``, ``text_config``, ``vision_config``, ...)."""
    if name not in shapes():
        raise ValueError(f"unknown shape {name!r}; shipped shapes: {', '.join(shapes())}")
    return json.loads(resources.files(__package__).joinpath(f"{name}.json").read_text())


def _section(spec: dict, name: str, layers: int | None, key: str = "num_hidden_layers", **extra) -> dict:
    """A copy of ``spec[name]`` (a sub-config) with ``extra`` over it, shrunk to ``layers`` when given."""
    section = dict(spec[name], **extra)
    if layers is not None:
        section[key] = layers
    return section


def _llava(spec: dict, text_layers, vision_layers):
    tok = tiny.llava_tokenizer()
    vision = _section(spec, "vision_config", vision_layers)
    text = _section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id)
    common = dict(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                  vision_feature_layer=spec["vision_feature_layer"], pad_token_id=tok.pad_token_id,
                  vision_feature_select_strategy=spec["vision_feature_select_strategy"],
                  projector_hidden_act=spec["projector_hidden_act"])
    size, patch = spec["image_size"], vision["patch_size"]
    if spec["model_type"] == "llava":
        config = LlavaConfig(**common)
        processor = tiny.llava_processor(LlavaProcessor, tok, size, patch, tiny.LLAVA_TEMPLATE)
        return LlavaForConditionalGeneration, config, processor
    pinpoints = spec["image_grid_pinpoints"]
    config = LlavaNextConfig(**common, image_grid_pinpoints=pinpoints)
    # the Vicuna NeXT checkpoint chats like LLaVA-1.5 ("USER: <image>\n... ASSISTANT:")
    processor = tiny.llava_processor(LlavaNextProcessor, tok, size, patch, tiny.LLAVA_TEMPLATE,
                                     image_grid_pinpoints=pinpoints, do_pad=True)
    return LlavaNextForConditionalGeneration, config, processor


def _qwen_parts(spec: dict, text_layers, vision_layers, blocks_key: str):
    """(tokenizer, token ids, text config, vision config) of a Qwen shape, shrunk to the layer counts asked for;
    ``blocks_key`` names the vision blocks the model reads specially (Qwen2.5-VL's full-attention blocks, Qwen3-VL's
    DeepStack blocks): those that still exist are kept, at least the last block."""
    tok = tiny.qwen_tokenizer()
    ids = tiny.qwen_token_ids(tok)
    text = _section(spec, "text_config", text_layers, **ids.pop("text"))
    vision = _section(spec, "vision_config", vision_layers, key="depth")
    if vision_layers is not None:
        vision[blocks_key] = [b for b in vision[blocks_key] if b < vision_layers] or [vision_layers - 1]
    return tok, ids, text, vision


def _qwen(spec: dict, text_layers, vision_layers):
    tok, ids, text, vision = _qwen_parts(spec, text_layers, vision_layers, "fullatt_block_indexes")
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    factor = vision["patch_size"] * vision["spatial_merge_size"]
    # the released processor's pixel range (4 .. 16384 merged tokens); the adapter's image_tokens pins 1296
    processor = tiny.qwen_processor(tok, vision["patch_size"], vision["spatial_merge_size"],
                                    min_pixels=4 * factor**2, max_pixels=16384 * factor**2)
    return Qwen2_5_VLForConditionalGeneration, config, processor


def _qwen3(spec: dict, text_layers, vision_layers):
    tok, ids, text, vision = _qwen_parts(spec, text_layers, vision_layers, "deepstack_visual_indexes")
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec["tie_word_embeddings"],
                           **ids)
    pixels = spec["processor"]
    processor = tiny.qwen_processor(tok, vision["patch_size"], vision["spatial_merge_size"],
                                    min_pixels=pixels["min_pixels"], max_pixels=pixels["max_pixels"],
                                    family="qwen3_vl")
    return Qwen3VLForConditionalGeneration, config, processor


def _qwen35(spec: dict, text_layers, vision_layers):
    """Qwen3.5: Qwen3-VL's processor and vision tower without DeepStack; a shrunk LLM keeps its first layers' types."""
    tok = tiny.qwen_tokenizer()
    ids = tiny.qwen_token_ids(tok)
    text = _section(spec, "text_config", text_layers, **ids.pop("text"))
    text["layer_types"] = text["layer_types"][:text["num_hidden_layers"]]
    vision = _section(spec, "vision_config", vision_layers, key="depth")
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=spec["tie_word_embeddings"],
                           **ids)
    pixels = spec["processor"]
    processor = tiny.qwen_processor(tok, vision["patch_size"], vision["spatial_merge_size"],
                                    min_pixels=pixels["min_pixels"], max_pixels=pixels["max_pixels"],
                                    family="qwen3_vl", template=tiny._QWEN3_5_TEMPLATE)  # with the think switch
    return Qwen3_5ForConditionalGeneration, config, processor


def _onevision(spec: dict, text_layers, vision_layers):
    tok = tiny.onevision_tokenizer()
    vision = _section(spec, "vision_config", vision_layers)
    vision.pop("model_type")
    text = _section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
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
    processor = tiny.onevision_processor(tok, spec["image_size"], vision["patch_size"], pinpoints,
                                         spec["vision_aspect_ratio"], norm["image_mean"], norm["image_std"])
    return LlavaOnevisionForConditionalGeneration, config, processor


# InternVL's LLM by the text config's model_type: Qwen2.5 (InternVL3), Qwen3 (InternVL3.5)
_INTERNVL_TEXT = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}


def _internvl(spec: dict, text_layers, vision_layers):
    tok = tiny.internvl_tokenizer()
    vision = _section(spec, "vision_config", vision_layers)
    text = _section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                    bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    text_cls = _INTERNVL_TEXT[text.pop("model_type", "qwen2")]
    config = InternVLConfig(
        vision_config=InternVLVisionConfig(**vision), text_config=text_cls(**text),
        image_token_id=tok.context_image_token_id, image_seq_length=spec["image_seq_length"],
        downsample_ratio=spec["downsample_ratio"], vision_feature_layer=spec["vision_feature_layer"],
        vision_feature_select_strategy=spec["vision_feature_select_strategy"],
        projector_hidden_act=spec["projector_hidden_act"], tie_word_embeddings=spec["tie_word_embeddings"])
    p = spec["processor"]
    processor = tiny.internvl_processor(tok, p["tile"], spec["image_seq_length"], p["max_patches"],
                                        p["image_mean"], p["image_std"])
    return InternVLForConditionalGeneration, config, processor


def _gemma4(spec: dict, text_layers, vision_layers):
    tok = tiny.gemma4_tokenizer()
    p = spec["processor"]
    processor = tiny.gemma4_processor(tok, p["patch_size"], p["max_soft_tokens"], p["pooling_kernel_size"])
    text = _section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                    bos_token_id=tok.bos_token_id)
    if text_layers is not None:  # the first layers' types (the last forced full, as transformers does), no sharing
        types = text.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                            for i in range(spec["text_config"]["num_hidden_layers"])]
        text["layer_types"] = [*types[:text_layers - 1], "full_attention"]
        text["num_kv_shared_layers"] = 0
    config = Gemma4Config(text_config=text, vision_config=_section(spec, "vision_config", vision_layers),
                          audio_config=spec.get("audio_config"), tie_word_embeddings=spec["tie_word_embeddings"],
                          vision_soft_tokens_per_image=spec["vision_soft_tokens_per_image"],
                          **tiny.gemma4_token_ids(tok))
    return Gemma4ForConditionalGeneration, config, processor


_BUILDERS = {"qwen2_5_vl": _qwen, "qwen3_vl": _qwen3, "llava_onevision": _onevision, "internvl": _internvl,
             "qwen3_5": _qwen35, "gemma4": _gemma4}


def _builder(spec: dict):
    return _BUILDERS.get(spec["model_type"], _llava)


# the width fields of each tower's config that ``width_divisor`` divides (head_dim, where given, stays)
_WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "projection_dim",
           "out_hidden_size", "num_heads")


def narrowed(spec: dict, divisor: int) -> dict:
    """``spec`` with both towers' widths divided by ``divisor`` (each must divide evenly: heads stay whole)."""
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"width_divisor must be a positive int, got {divisor!r}")
    out = dict(spec)
    for tower in ("vision_config", "text_config"):
        section = dict(spec[tower])
        for key in _WIDTHS:
            if key in section:
                if section[key] % divisor:
                    raise ValueError(f"width_divisor {divisor} does not divide {tower}.{key} = {section[key]}")
                section[key] //= divisor
        out[tower] = section
    return out


def shape_vlm(name: str, *, dtype=torch.float16, device="cpu", text_layers: int | None = None,
              vision_layers: int | None = None, width_divisor: int = 1):
    """``(model, processor)``: ``name``'s published architecture with seeded random weights on ``device``.

    The weights are created directly on ``device`` in ``dtype`` (a 7B model in fp16 needs ~14 GB there);
    ``device="meta"`` builds the module tree without memory (shapes, configs, placeholder counts).
    """
    spec = narrowed(shape_spec(name), width_divisor)
    model_cls, config, processor = _builder(spec)(spec, text_layers, vision_layers)
    torch.manual_seed(SEED)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype)
    return model.eval(), processor


def load(name: str, *, dtype=None, device_map=None, attn_implementation=None, max_memory=None):
    """The ``shape:<name>`` model factory: random weights built directly on the device (fp16 unless ``dtype``
    says otherwise), with the paper's adapter options for that model. A device map over several GPUs ("balanced",
    ...: a model too big for one) builds it on the CPU and spreads it (:mod:`promprune.models.placement`)."""
    from ..placement import is_multi_gpu

    dtype = parse_dtype(dtype, allow_auto=True)
    device = device_map or "cpu"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    spread = is_multi_gpu(device)
    model, processor = shape_vlm(name, dtype=torch.float16 if dtype in (None, AUTO) else dtype,
                                 device="cpu" if spread else device)
    model = place(model, attn_implementation=attn_implementation, device_map=device if spread else None,
                  max_memory=max_memory)
    return model, processor, default_options(name)


def _config(name: str):
    spec = shape_spec(name)
    return _builder(spec)(spec, None, None)[1]


load.config = _config


def default_options(name: str) -> dict:
    """Adapter options the paper used with this shape (Qwen2.5-VL: a fixed 1296-token grid; Qwen3-VL and Qwen3.5: the
    same, our choice)."""
    spec = shape_spec(name)
    return {"image_tokens": spec["image_tokens"]} if "image_tokens" in spec else {}
