"""Qwen3-VL: hook saliency == eager attention, kept tokens keep their 3D positions, DeepStack rows follow the kept
tokens (pre-LLM methods and FastV / SparseVLM inside the LLM), each checked against plain transformers outputs."""
import copy

import pytest
import torch
from transformers import AttentionInterface
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_mod

from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm

from .test_qwen_positions import hand_positions


def plain_image_features(model, batch):
    """``get_image_features`` of plain transformers: per image ``[N, d]`` and per DeepStack layer ``[N, d]``."""
    with torch.inference_mode():
        out = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"], return_dict=True)
    return list(out.pooler_output), [list(layer) for layer in out.deepstack_features]


def test_received_attention_matches_eager(images, prompts):
    model, processor = tiny_vlm("qwen3_vl")
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=4)
    batch = vlm.inputs(images, prompts)
    items = vlm.adapter.encode(batch, need_saliency=True)
    assert model.config.vision_config._attn_implementation == "sdpa"  # the hook did not force eager

    twin = copy.deepcopy(model)
    target = twin.model.visual.blocks[-1].attn
    recorded = []

    def recording_eager(module, *args, **kwargs):
        out, weights = qwen3_mod.eager_attention_forward(module, *args, **kwargs)
        if module is target:
            recorded.append(weights[0])  # [H, n, n]: one image per call outside flash attention
        return out, weights

    AttentionInterface.register("recording_eager_qwen3", recording_eager)
    twin.model.visual.config._attn_implementation = "recording_eager_qwen3"
    with torch.inference_mode():
        twin.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    assert len(recorded) == len(images)
    for item, weights in zip(items, recorded):
        received = weights.mean(dim=(0, 1))  # [S]: mean over heads and queries, patch order
        per_token = received.view(-1, 4).mean(dim=1)  # 2x2 merge groups are consecutive patches, raster order
        torch.testing.assert_close(item.saliency, per_token, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("order", ["raster", "selection"])
def test_positions_are_the_kept_tokens_own(order, images, prompts):
    model, processor = tiny_vlm("qwen3_vl")
    vlm = PrunedVLM(model, processor, method="promprune", budget=7, token_order=order)
    prep = vlm.prepare(images, prompts)
    kw = prep.model_kwargs
    grid = vlm.inputs(images, prompts)["image_grid_thw"]
    for b, stats in enumerate(prep.stats):
        valid = kw["attention_mask"][b].bool()
        expected = hand_positions(kw["input_ids"][b], kw["attention_mask"][b], model.config.image_token_id,
                                  (int(grid[b, 1]) // 2, int(grid[b, 2]) // 2), stats["kept"])
        torch.testing.assert_close(kw["position_ids"][1:, b][:, valid], expected)


@pytest.mark.parametrize("order", ["raster", "selection"])
def test_deepstack_rows_are_the_kept_tokens(order, images, prompts):
    """The language model receives, at every DeepStack layer, plain transformers' rows of exactly the kept tokens,
    in the order their features fill the placeholders."""
    model, processor = tiny_vlm("qwen3_vl")
    vlm = PrunedVLM(model, processor, method="promprune", budget=6, token_order=order)
    prep = vlm.prepare(images, prompts)
    seen = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(masks=kw["visual_pos_masks"], embeds=kw["deepstack_visual_embeds"]),
        with_kwargs=True)
    try:
        with torch.inference_mode():
            model(**prep.model_kwargs)
    finally:
        hook.remove()
    _, deepstack = plain_image_features(model, vlm.inputs(images, prompts))
    assert len(seen["embeds"]) == 3
    assert seen["masks"].sum(1).tolist() == [6, 6]
    for layer, got in zip(deepstack, seen["embeds"]):
        expected = torch.cat([layer[b][stats["kept"]] for b, stats in enumerate(prep.stats)])  # row-major
        torch.testing.assert_close(got, expected)


def recording_deepstack(model, calls: list) -> None:
    """Inside a pruner's ``with``: record each DeepStack addition the pruner makes on ``model`` as ``(columns,
    added [B, L_cur] bool, rows [added, d])``: the columns whose states it changed and what it added to them (the
    pruner's wrapper is an instance attribute, removed with the pruner's hooks, and so is this one over it)."""
    lm = model.model.language_model
    inner = lm._deepstack_process

    def recording(hidden, masks, embeds):
        out = inner(hidden, masks, embeds)
        added = (out != hidden).any(-1)
        calls.append((hidden.shape[1], added, (out - hidden)[added]))
        return out

    lm._deepstack_process = recording


@pytest.mark.parametrize("method", ["fastv", "sparsevlm"])
def test_in_llm_deepstack_goes_to_the_kept_columns(method, images, prompts):
    """After an in-LLM pruning layer, each DeepStack addition lands on the surviving image columns with their own
    rows (recorded around the pruner's addition, ``recording_deepstack``; compared with plain
    ``get_image_features``)."""
    model, processor = tiny_vlm("qwen3_vl")
    # SparseVLM cut before layers 1 and 2: DeepStack's last addition (after layer 2) then meets the final 5 tokens
    vlm = PrunedVLM(model, processor, method=method, budget=5, recycle_ratio=0.0, layers=[1, 2]) \
        if method == "sparsevlm" else PrunedVLM(model, processor, method=method, budget=5)
    prep = vlm.prepare(images, prompts)
    pruner, calls = vlm.pruning(prep), []
    with torch.inference_mode(), pruner:
        recording_deepstack(model, calls)
        model(**prep.model_kwargs)
    _, deepstack = plain_image_features(model, vlm.inputs(images, prompts))
    full_len = prep.model_kwargs["input_ids"].shape[1]
    assert len(calls) == 3 and calls[0][0] == full_len and calls[-1][0] < full_len  # the last after pruning
    stats = pruner.stats(prep.items)
    _, masks, embeds = calls[-1]
    assert masks.sum(1).tolist() == [s["visual_tokens"] for s in stats] == [5, 5]
    expected = torch.cat([deepstack[2][b][s["kept"]] for b, s in enumerate(stats)])  # kept columns ascending
    torch.testing.assert_close(embeds, expected)
