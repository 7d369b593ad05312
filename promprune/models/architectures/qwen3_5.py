"""Qwen3.5 (``Qwen3_5ForConditionalGeneration``): Qwen3-VL's vision tower without DeepStack, and a hybrid LLM.

The vision side and its processor are Qwen3-VL's (transformers maps ``qwen3_5`` to ``Qwen3VLProcessor``), so the
adapter is Qwen3-VL's without the DeepStack rows: saliency is the received attention at one vision block, pooled per
2 x 2 merge group, the kept tokens keep the 3D M-RoPE positions of Qwen3.5's own ``get_rope_index``. The LLM
interleaves Gated DeltaNet linear-attention layers (a recurrent state of constant size, no attention map) with gated
full-attention layers (``config.text_config.layer_types``; every 4th of the 4B's 32): pre-LLM methods shorten what
every layer reads, the in-LLM methods rank at full-attention layers only (``llm_hooks.py``). The chat template's
reasoning switch is the adapter option ``enable_thinking``.

Tiny (``tiny:qwen3_5``): Qwen3-VL's patching, an 8-layer LLM alternating linear and full attention. Shape:
``shape:qwen3_5_4b``.
"""
from __future__ import annotations

from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from ..adapters import as_encoder_outputs
from ..registry import register_family
from ..shapes import section
from ..tiny import seeded, text_sizes
from .qwen2_5_vl import QWEN_TEMPLATE, fixed_tokens, qwen_processor, qwen_token_ids, qwen_tokenizer
from .qwen3_vl import QWEN3_CLASSES, QWEN3_NORM, Qwen3Adapter

# Qwen3.5's generation prompt opens a reasoning block unless enable_thinking is false (then an empty one), as the
# released Qwen3.5-4B template does
QWEN3_5_TEMPLATE = QWEN_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
QWEN3_5_LAYERS = 8  # deep enough for SparseVLM's and PyramidDrop's three stages at distinct full-attention layers


def tiny_qwen3_5():
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    patch, merge = 4, 2
    # full attention every 2nd layer (the released models: every 4th), so each in-LLM stage finds a full-attention
    # layer to rank at and linear-attention layers after it; 32-wide heads with a quarter rotary (the released
    # 256-wide heads: 64 rotary dims, mrope_section [11, 11, 10]) -> 8 rotary dims, sections [2, 1, 1]
    text = dict(**text_sizes(len(tok)), **ids.pop("text"))
    text.update(num_hidden_layers=QWEN3_5_LAYERS, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention"] * (QWEN3_5_LAYERS // 2),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                  spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    model = seeded(lambda: Qwen3_5ForConditionalGeneration(config))
    factor = patch * merge
    # Qwen3-VL's processor: the same pixel ranges
    return model, qwen_processor(tok, patch, merge, min_pixels=(2 * factor) ** 2, max_pixels=(6 * factor) ** 2,
                                 norm=QWEN3_NORM, classes=QWEN3_CLASSES,
                                 video_size={"shortest_edge": (2 * factor) ** 2, "longest_edge": 8 * (6 * factor) ** 2},
                                 template=QWEN3_5_TEMPLATE)


def shape_qwen3_5(spec: dict, text_layers, vision_layers):
    """Qwen3.5: Qwen3-VL's processor and vision tower without DeepStack; a shrunk LLM keeps its first layers' types."""
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    text = section(spec, "text_config", text_layers, **ids.pop("text"))
    text["layer_types"] = text["layer_types"][:text["num_hidden_layers"]]
    vision = section(spec, "vision_config", vision_layers, key="depth")
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=spec["tie_word_embeddings"],
                           **ids)
    pixels = spec["processor"]
    processor = qwen_processor(tok, vision["patch_size"], vision["spatial_merge_size"],
                               min_pixels=pixels["min_pixels"], max_pixels=pixels["max_pixels"], norm=QWEN3_NORM,
                               classes=QWEN3_CLASSES, template=QWEN3_5_TEMPLATE)  # with the think switch
    return Qwen3_5ForConditionalGeneration, config, processor


# mu 0.5744: borrowed from Qwen2.5-VL (the same merged-token design), uncalibrated; sweeps/mu_tau_search_qwen35.yaml
# searches its own
@register_family("qwen3_5", model_class="Qwen3_5ForConditionalGeneration", default_mu=0.5744, tiny=tiny_qwen3_5,
                 shape=shape_qwen3_5, capacity=fixed_tokens, fewest=fixed_tokens,
                 mrope=True)
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
