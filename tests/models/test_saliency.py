"""Hook-captured saliency equals the attention weights of an eager run of the same vision tower."""
import copy

import torch
from transformers import AttentionInterface
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen_mod
from transformers.vision_utils import get_vision_window_index

from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm


def eager_copy(model):
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin


def encoded(arch, images, prompts):
    """``(model, processor batch, adapter items with hook saliency)`` for a tiny model of ``arch``."""
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=4)
    batch = vlm.inputs(images, prompts)
    return model, batch, vlm.adapter.encode(batch, need_saliency=True)


def test_llava_cls_attention_matches_eager(images, prompts):
    model, batch, items = encoded("llava", images, prompts)
    assert model.config.vision_config._attn_implementation == "sdpa"  # the hook did not force eager
    with torch.inference_mode():
        out = eager_copy(model).model.vision_tower(batch["pixel_values"], output_attentions=True)
    # vision_feature_layer = -2 reads hidden_states[-2], the output of encoder layer L-2 = attentions[-2]
    ref = out.attentions[-2][:, :, 0, 1:].mean(dim=1)  # [B, 36]: CLS row, head mean, CLS column dropped
    for b, item in enumerate(items):
        torch.testing.assert_close(item.saliency, ref[b], atol=1e-6, rtol=1e-5)


def test_llava_next_views_match_eager(images, prompts):
    model, batch, items = encoded("llava_next", images, prompts)
    twin = eager_copy(model)
    for b, item in enumerate(items):
        views = int(item.groups.max()) + 1
        with torch.inference_mode():
            out = twin.model.vision_tower(batch["pixel_values"][b, :views], output_attentions=True)
        ref = out.attentions[-2][:, :, 0, 1:].mean(dim=1).flatten()  # [views * 16], view-major
        torch.testing.assert_close(item.saliency, ref[item.grid_index], atol=1e-6, rtol=1e-5)
        # candidates are exactly the packed tokens that are not image_newline
        assert item.features.shape[0] + int(item.newline.sum()) == item.run.shape[0]


def test_qwen_received_attention_matches_eager(images, prompts):
    model, batch, items = encoded("qwen2_5_vl", images, prompts)

    twin = eager_copy(model)
    target = twin.model.visual.blocks[twin.config.vision_config.fullatt_block_indexes[-1]].attn
    recorded = []

    def recording_eager(module, *args, **kwargs):
        out, weights = qwen_mod.eager_attention_forward(module, *args, **kwargs)
        if module is target:
            recorded.append(weights[0])  # [H, n, n] for one image (full attention is per image)
        return out, weights

    AttentionInterface.register("recording_eager", recording_eager)
    twin.model.visual.config._attn_implementation = "recording_eager"
    with torch.inference_mode():
        twin.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    vc = model.config.vision_config
    window_index, _ = get_vision_window_index(batch["image_grid_thw"], vc.spatial_merge_size, vc.window_size,
                                              vc.patch_size)
    received = torch.cat([w.mean(dim=(0, 1)) for w in recorded])  # [S], window-permuted patch order
    per_group = received.view(-1, vc.spatial_merge_size ** 2).mean(dim=1)  # group at window slot i
    raster = torch.empty_like(per_group)
    raster[window_index] = per_group  # slot i holds merged token window_index[i]
    got = torch.cat([it.saliency for it in items])
    torch.testing.assert_close(got, raster, atol=1e-6, rtol=1e-5)
