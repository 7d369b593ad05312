"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen2.5-VL's design with full attention everywhere and DeepStack.

16 px patches merged 2 x 2, every vision block attending over the whole image (no windows, so the patches stay in the
merged tokens' raster order), a learned position grid, and DeepStack: the vision blocks of
``deepstack_visual_indexes`` feed their own mergers, whose tokens are added to the hidden states of the image positions
after the first LLM layers. Saliency, positions and clips are Qwen2.5-VL's (received attention at one block,
``saliency_block`` any block, default the last; 3D M-RoPE positions kept); a pruned image feeds the DeepStack rows of
its kept tokens, and the in-LLM methods add them to the surviving image columns only (``llm_hooks.py``). Its
processor dates a clip's frames with timestamps in the prompt (one placeholder run per temporal patch); a 1-frame clip
is that frame repeated to one temporal patch (its processor refuses fewer frames than a patch).

Tiny (``tiny:qwen3_vl``): Qwen2.5-VL's patching, DeepStack from vision blocks 0-2 into LLM layers 0-2, q / k norms in
the LLM. Shape: ``shape:qwen3_vl_8b``.
"""
from __future__ import annotations

import numpy as np
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

from .. import saliency as sal
from ..adapters import saliency_layer
from ..registry import register_family
from ..tiny import seeded, text_sizes
from .qwen2_5_vl import QwenAdapter, fixed_tokens, qwen_parts, qwen_processor, qwen_token_ids, qwen_tokenizer

QWEN3_NORM = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])  # the released processor's mean / std
QWEN3_CLASSES = (Qwen3VLProcessor, Qwen3VLVideoProcessor)


def tiny_qwen3_vl():
    tok = qwen_tokenizer()
    ids = qwen_token_ids(tok)
    patch, merge = 4, 2
    text = dict(**text_sizes(len(tok)), head_dim=16, **ids.pop("text"),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    # DeepStack: blocks 0, 1, 2 feed LLM layers 0, 1, 2 (the released model: blocks 8, 16, 24 of 27), so FastV
    # (layer 2) and SparseVLM (layers 1, 2) prune before some DeepStack additions
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                  spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1, 2])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    model = seeded(lambda: Qwen3VLForConditionalGeneration(config))
    factor = patch * merge
    # a clip's pixels are bounded as a whole (Qwen3-VL's video processor): up to 8 frames of 6x6 merged tokens
    return model, qwen_processor(tok, patch, merge, min_pixels=(2 * factor) ** 2, max_pixels=(6 * factor) ** 2,
                                 norm=QWEN3_NORM, classes=QWEN3_CLASSES,
                                 video_size={"shortest_edge": (2 * factor) ** 2, "longest_edge": 8 * (6 * factor) ** 2})


def shape_qwen3_vl(spec: dict, text_layers, vision_layers):
    tok, ids, text, vision = qwen_parts(spec, text_layers, vision_layers, "deepstack_visual_indexes")
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec["tie_word_embeddings"],
                           **ids)
    pixels = spec["processor"]
    processor = qwen_processor(tok, vision["patch_size"], vision["spatial_merge_size"],
                               min_pixels=pixels["min_pixels"], max_pixels=pixels["max_pixels"], norm=QWEN3_NORM,
                               classes=QWEN3_CLASSES)
    return Qwen3VLForConditionalGeneration, config, processor


# mu 0.5744: borrowed from Qwen2.5-VL (the same merged-token design), uncalibrated; sweeps/mu_tau_search_qwen3vl.yaml
# searches its own (recalibrate with sweeps/mu_calibration.yaml on the real checkpoint before reading PromPrune there)
@register_family("qwen3_vl", model_class="Qwen3VLForConditionalGeneration", default_mu=0.5744, tiny=tiny_qwen3_vl,
                 shape=shape_qwen3_vl, capacity=fixed_tokens, fewest=fixed_tokens,
                 mrope=True)
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

    @classmethod
    def saliency_index(cls, config, options: dict) -> int:
        depth = config.vision_config.depth  # default: the last block, whose output the merger projects
        return saliency_layer(options, depth, depth - 1, "block of the vision tower")

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

    # video_kwargs: QwenAdapter's (each clip's frame indices and rate; its processor writes a timestamp before each
    # temporal patch's placeholder run), a clip shorter than a temporal patch dated as prepare_clips pads it

    def prepare_clips(self, clips: list) -> list:
        """Each clip at least one temporal patch (2 frames) long: a shorter one (a single frame) repeats its last
        frame. Qwen3-VL's video processor refuses fewer frames than a patch (its ``smart_resize``), yet pads any
        longer clip's last patch with its last frame, as Qwen2.5-VL's processor pads a 1-frame clip; so a 1-frame clip
        is one temporal patch of that frame twice, what Qwen's image path feeds for an image. Its pixel limit is then
        that of one temporal patch, 2 frames: the processor's ``smart_resize`` counts a clip's frames rounded to whole
        patches (``t_bar``) against ``max_pixels``, so a 3-frame clip's limit is also that of 2."""
        need = self._clip_frames()
        return [np.concatenate([c, np.repeat(c[-1:], need - len(c), axis=0)]) if len(c) < need else c for c in clips]

    def _clip_frames(self) -> int:
        """The fewest frames the video processor takes in a clip: one temporal patch's."""
        return int(self.processor.video_processor.temporal_patch_size)
