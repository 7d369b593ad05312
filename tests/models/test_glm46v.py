"""GLM-4.6V: the real class, hook saliency == eager attention, the kept tokens' 3D positions worked by hand, the in-LLM
methods ranking by the model's own (half-rotary) attention and keys, clips refused, and the published shape offline.

The family also runs every test that parametrizes over the registered families (``tests/models/conftest.py``
``ARCHS``): unpruned == plain ``generate``, every method at its budget, batching, vision and prefix once.
"""
import copy

import pytest
import torch
from PIL import Image
from transformers import AttentionInterface
from transformers.models.glm4v import modeling_glm4v as glm_mod

from promprune.models import PrunedVLM
from promprune.models.llm_hooks import make
from promprune.models.shapes import default_options, shape_vlm
from promprune.models.tiny import tiny_vlm

from .conftest import sdpa_keys
from .test_qwen_positions import hand_positions


def vlm_for(method="promprune", budget=6, **options):
    model, processor = tiny_vlm("glm46v")
    return PrunedVLM(model, processor, method=method, budget=budget, **options)


def test_tiny_is_the_real_class_with_markers_around_each_image(images, prompts):
    vlm = vlm_for()
    model = vlm.model
    assert type(model).__name__ == "Glm46VForConditionalGeneration" and model.config.model_type == "glm46v"
    batch = vlm.inputs(images, prompts)
    grid = batch["image_grid_thw"]  # [B, 3]: 40 x 56 px -> 10 x 14 patches, 64 x 32 -> 16 x 8
    assert grid[:, 1:].tolist() == [[10, 14], [16, 8]]
    for ids, (_t, h, w) in zip(batch["input_ids"], grid.tolist()):
        run = (ids == model.config.image_token_id).nonzero().flatten()
        assert run.numel() == (h // 2) * (w // 2)  # one token per 2 x 2 merge group
        assert ids[run[0] - 1] == model.config.image_start_token_id
        assert ids[run[-1] + 1] == model.config.image_end_token_id


@pytest.mark.parametrize("block", [None, 0])
def test_received_attention_matches_eager(block, images, prompts):
    """Saliency: an eager twin's attention weights at the block, averaged over heads and queries, then over each merged
    token's 4 consecutive patches."""
    vlm = vlm_for("saliency_only", 4, **({} if block is None else {"saliency_block": block}))
    batch = vlm.inputs(images, prompts)
    items = vlm.adapter.encode(batch, need_saliency=True)
    assert vlm.model.config.vision_config._attn_implementation == "sdpa"  # the hook did not force eager
    twin = copy.deepcopy(vlm.model)
    target = twin.model.visual.blocks[-1 if block is None else block].attn
    recorded = []

    def recording_eager(module, *args, **kwargs):
        out, weights = glm_mod.eager_attention_forward(module, *args, **kwargs)
        if module is target:
            recorded.append(weights[0])  # [H, n, n]: one image per call outside flash attention
        return out, weights

    AttentionInterface.register("recording_eager_glm46v", recording_eager)
    twin.model.visual.config._attn_implementation = "recording_eager_glm46v"
    with torch.inference_mode():
        twin.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    assert len(recorded) == len(images)
    for item, weights in zip(items, recorded):
        per_token = weights.mean(dim=(0, 1)).view(-1, 4).mean(dim=1)  # [n]: the merge groups, raster order
        torch.testing.assert_close(item.saliency, per_token, atol=1e-6, rtol=1e-5)


def test_saliency_block_must_be_a_vision_block():
    with pytest.raises(ValueError, match=r"saliency_block must be a block of the vision tower \(0 \.\. 2\)"):
        vlm_for(saliency_block=3)


def test_mu_defaults_to_the_borrowed_qwen_value():
    assert vlm_for().method_options["mu"] == 0.5744 and vlm_for(mu=0.3).method_options["mu"] == 0.3


@pytest.mark.parametrize("order", ["raster", "selection"])
def test_kept_tokens_keep_their_own_3d_positions(order, images, prompts):
    """GLM's get_rope_index is Qwen2-VL's rule (text before the image at s, token k of an H x W grid at (s, s + k // W,
    s + k % W), text after at s + max(H, W)): the kept tokens' positions, worked by hand."""
    vlm = vlm_for("promprune", 7, token_order=order)
    prep = vlm.prepare(images, prompts)
    kw = prep.model_kwargs
    grid = vlm.inputs(images, prompts)["image_grid_thw"]
    for b, stats in enumerate(prep.stats):
        valid = kw["attention_mask"][b].bool()
        expected = hand_positions(kw["input_ids"][b], kw["attention_mask"][b], vlm.model.config.image_token_id,
                                  (int(grid[b, 1]) // 2, int(grid[b, 2]) // 2), stats["kept"])
        torch.testing.assert_close(kw["position_ids"][1:, b][:, valid], expected)


def test_image_tokens_pins_the_grid(images, prompts):
    """GLM's resize bounds count an image's temporal patch (2 frames): the adapter's pinned size accounts for it."""
    vlm = vlm_for(image_tokens=16)
    assert vlm.inputs(images, prompts)["image_grid_thw"][:, 1:].tolist() == [[8, 8], [8, 8]]
    assert [s["visual_tokens"] for s in vlm.prepare(images, prompts).stats] == [6, 6]


def test_fastv_ranks_by_the_models_own_attention(images, prompts):
    """FastV's scores at layer K - 1 == an eager forward's last-token attention (head mean): the hooks apply GLM's
    half, interleaved rotary embedding as the model does."""
    vlm = vlm_for("fastv", 5, layer=2)
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner = vlm.pruning(prep)
    with torch.inference_mode(), pruner:
        vlm.model(**prep.model_kwargs)
    twin = copy.deepcopy(vlm.model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        att = twin(**vlm.inputs(images[:1], prompts[:1]), output_attentions=True).attentions
    torch.testing.assert_close(pruner.stages[0].scores[0], att[1][0, :, -1].mean(0).float(), atol=1e-5, rtol=1e-4)


def test_dart_key_norms_are_the_models_own_keys(images, prompts):
    vlm = vlm_for("dart", 6, pivot_image=2, pivot_text=2)
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner = vlm.pruning(prep)
    with torch.inference_mode(), pruner:
        vlm.model(**prep.model_kwargs)
    keys = sdpa_keys(vlm.model, pruner.stages[0].layer - 1, prep.model_kwargs)  # [1, Hkv, L, hd]
    torch.testing.assert_close(pruner.stages[0].keys[0], keys[0].float().abs().sum(dim=(0, 2)), atol=1e-4, rtol=1e-4)


def test_pyramiddrop_keeps_the_3d_positions():
    model, _ = tiny_vlm("glm46v")
    ids = torch.full((1, 40), 5)
    ids[0, 3:23] = model.config.image_token_id
    assert make("pyramiddrop", model, ids, 5, {}).compact is False  # M-RoPE: never renumbered


def test_clips_are_refused_by_name(images, prompts):
    with pytest.raises(ValueError, match="video needs one of llava_onevision, .*; this model is 'glm46v'"):
        vlm_for().prepare_video([[images[0]] * 2], prompts[:1])


def test_the_flash_shape_offline():
    """shape:glm46v_flash on the meta device: a 640 x 480 photo resized to multiples of 28 px (476 x 644) is 17 x 23 =
    391 merged tokens; image_tokens (the shape's default, 1296) pins a 36 x 36 grid whatever the photo."""
    model, processor = shape_vlm("glm46v_flash", device="meta")
    photo = Image.new("RGB", (640, 480))
    free = PrunedVLM(model, processor, method="promprune", budget=64)
    batch = free.processed([photo], ["Describe the image."])
    assert batch["image_grid_thw"].tolist() == [[1, 34, 46]]
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 17 * 23
    pinned = PrunedVLM(model, processor, method="promprune", budget=64, **default_options("glm46v_flash"))
    batch = pinned.processed([photo], ["Describe the image."])
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 1296
    assert model.config.text_config.num_hidden_layers == 40 and model.config.vision_config.depth == 24
