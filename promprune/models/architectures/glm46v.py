"""GLM-4.6V (``Glm46VForConditionalGeneration``, ``zai-org/GLM-4.6V-Flash``): native resolution, 2x2 merged, 3D M-RoPE.

GLM-4.6V is GLM-4.1V-Thinking's architecture (transformers' ``Glm4vModel`` under its own ``glm46v`` type): the
processor resizes each image to multiples of 28 px (14 px patches, 2 x 2 merge) within a pixel range, as Qwen2.5-VL's
does and with the same patch layout (each 2 x 2 group of patches consecutive, in the merged tokens' raster order); the
tower (24 blocks on the Flash 9B) attends over the whole image in every block with a 2D rotary embedding plus an
interpolated learned position grid, and ends in a 2 x 2 convolution that merges each group into one token, then an MLP
merger into the LLM's width: an image gives (H / 28) x (W / 28) tokens between ``<|begin_of_image|>`` and
``<|end_of_image|>``. The LLM (GLM-4-9B on the Flash; a GLM-4.5-Air MoE on the 106B GLM-4.6V) numbers the visual tokens
with 3D M-RoPE positions from the model's own ``get_rope_index``.

So the adapter is Qwen3-VL's without DeepStack: no CLS token, saliency is the attention each patch receives at one
vision block (``saliency_block``, default the last, whose output the merger reads), queries and heads averaged within
its image (recomputed by a hook with the block's own fused ``qkv`` and 2D rotary embedding, SDPA stays on), averaged
over the 2 x 2 group the convolution merges; the kept tokens keep their 3D positions (computed on the unpruned sequence,
gathered at the kept columns), and the in-LLM methods rank with the LLM's own partial rotary embedding and never
renumber. ``image_tokens`` fixes the token count as on Qwen. No vision-tower features: VisPruner / VisionZip / CDPruner
work on the projected tokens (CDPruner's instruction: the LLM's input embeddings). Clips are not adapted: GLM-4.6V's
processor writes a video's frames as image placeholder runs, each followed by its timestamp, which the video path does
not read (``generate_video`` refuses this family).

Tiny (``tiny:glm46v``): 4 px patches merged 2 x 2 (images of 2 x 2 .. 6 x 6 merged tokens), a 3-block tower, the 4-layer
LLM with half-rotary heads. Shape: ``shape:glm46v_flash`` (GLM-4.6V-Flash, 9B).
"""
from __future__ import annotations

from transformers import (
    Glm46VConfig,
    Glm46VForConditionalGeneration,
    Glm46VImageProcessor,
    Glm46VProcessor,
    Glm46VVideoProcessor,
)

from ..adapters import as_encoder_outputs
from ..registry import register_family
from ..shapes import section
from ..tiny import byte_level_tokenizer, seeded, text_sizes
from .qwen2_5_vl import fixed_tokens
from .qwen3_vl import Qwen3Adapter

GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
                "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"]
# GLM's conversation: "[gMASK]<sop>", then each turn "<|role|>\n..." (the image as its placeholder between its markers)
# and the assistant's turn opened, as the GLM-4.1V / 4.6V template renders a turn without thinking
GLM_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif c['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def glm_tokenizer():
    """The byte-level tokenizer with GLM's chat, image and video tokens."""
    return byte_level_tokenizer(GLM_SPECIALS, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def glm_token_ids(tok) -> dict:
    """Glm46VConfig's token-id fields wired to ``tok``."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in GLM_SPECIALS}
    return dict(image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])


def glm_processor(tok, patch: int, merge: int, min_pixels: int, max_pixels: int):
    """A Glm46VProcessor around ``tok``: ``patch`` px patches merged ``merge`` x ``merge``, images resized so that
    their pixels times the temporal patch's 2 frames fall in ``min_pixels .. max_pixels`` (GLM's ``smart_resize``
    counts an image as the 2 frames of its temporal patch); CLIP's mean / std, the processor's default; the video
    processor its constructor takes."""
    sizes = dict(patch_size=patch, merge_size=merge, temporal_patch_size=2)
    image = Glm46VImageProcessor(**sizes, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    return Glm46VProcessor(image_processor=image, tokenizer=tok, video_processor=Glm46VVideoProcessor(**sizes),
                           chat_template=GLM_TEMPLATE)


def tiny_glm46v():
    tok = glm_tokenizer()
    patch, merge = 4, 2
    # 16-wide heads, half of each rotary (as the released 128-wide heads: 64 rotary dims, mrope_section [8, 12, 12])
    # -> 4 rotary frequencies, sections [2, 1, 1]
    text = dict(**text_sizes(len(tok)), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1]})
    # a 16 px learned position grid (4 x 4), interpolated to each image's patch grid as the released 336 px one
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch, image_size=16,
                  spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=64)
    config = Glm46VConfig(text_config=text, vision_config=vision, **glm_token_ids(tok))
    model = seeded(lambda: Glm46VForConditionalGeneration(config))
    factor = patch * merge  # 2x2 .. 6x6 merged tokens' worth of pixels, times the temporal patch's 2 frames
    return model, glm_processor(tok, patch, merge, min_pixels=2 * (2 * factor) ** 2, max_pixels=2 * (6 * factor) ** 2)


def shape_glm46v(spec: dict, text_layers, vision_layers):
    tok = glm_tokenizer()
    text = section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    vision = section(spec, "vision_config", vision_layers, key="depth")
    config = Glm46VConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec["tie_word_embeddings"],
                          **glm_token_ids(tok))
    pixels = spec["processor"]
    processor = glm_processor(tok, vision["patch_size"], vision["spatial_merge_size"], pixels["min_pixels"],
                              pixels["max_pixels"])
    return Glm46VForConditionalGeneration, config, processor


# mu 0.5744: borrowed from Qwen2.5-VL (the same native-resolution, 2x2-merged token design), uncalibrated: recalibrate
# with sweeps/mu_calibration.yaml on the real checkpoint before reading PromPrune's numbers there
@register_family("glm46v", model_class="Glm46VForConditionalGeneration", default_mu=0.5744, tiny=tiny_glm46v,
                 shape=shape_glm46v, capacity=fixed_tokens, fewest=fixed_tokens,
                 mrope=True)
class Glm46VAdapter(Qwen3Adapter):
    """GLM-4.6V: 2x2 merged tokens, 3D M-RoPE positions; saliency = received attention at one vision block, pooled
    per merge group (see the module docstring)."""

    encoder = "glm46v"
    encode_video = None  # clips not adapted (see the module docstring): generate_video refuses this family

    def processor_kwargs(self) -> dict:
        """``image_tokens``: GLM's pixel bounds count an image as its temporal patch's frames, so the pinned size is
        the grid's pixels times ``temporal_patch_size``."""
        n = self.options.get("image_tokens")
        if n is None:
            return {}
        pixels = n * self._factor() ** 2 * self.model.config.vision_config.temporal_patch_size
        return {"size": {"shortest_edge": pixels, "longest_edge": pixels}}

    def _item_extras(self, out, i: int) -> dict:
        return {}  # no DeepStack rows

    def encoder_outputs(self, items, feats, run_pos):
        return as_encoder_outputs(feats)
