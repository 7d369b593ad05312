"""The issue-25 methods (CDPruner, downsample, DART, PyramidDrop) on the issue-26 models (Qwen3-VL, LLaVA-OneVision,
InternVL3),
each checked against an independent computation: plain transformers attention / keys, torch's adaptive pooling
geometry worked by hand, the LLM's own input embeddings."""
import copy

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import promprune
from promprune.models import PrunedVLM
from promprune.models.llm_hooks import make
from promprune.models.batched_select import split_budget
from promprune.models.tiny import tiny_vlm
from promprune.selection.controls import pooling_matrix

from .conftest import make_image
from .test_qwen3_vl import plain_image_features, recording_deepstack

ONEVISION_SIDE = 4  # tiny LLaVA-OneVision: 4 x 4 tokens per view


def _run(vlm, prep):
    """One prefill forward under the method's pruning hooks; returns the pruner."""
    pruner = vlm.pruning(prep)
    with torch.inference_mode(), pruner:
        vlm.model(**prep.model_kwargs)
    return pruner


@pytest.mark.parametrize("arch", ["qwen3_vl", "llava_onevision", "internvl"])
def test_fastv_and_pyramiddrop_rank_by_the_models_own_attention(arch, images, prompts):
    """The last token's attention the in-LLM hooks recompute equals the eager forward's ``attentions`` (Qwen3-VL's
    attention normalizes queries and keys per head before RoPE: ``q_norm`` / ``k_norm``)."""
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method="fastv", budget=5, layer=2)  # the released absolute K
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner = _run(vlm, prep)
    assert pruner.stages[0].layer == 2
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        att = twin(**vlm.inputs(images[:1], prompts[:1]), output_attentions=True).attentions  # per layer [1,H,L,L]
    torch.testing.assert_close(pruner.stages[0].scores[0], att[1][0, :, -1].mean(0).float(), atol=1e-5, rtol=1e-4)
    pdrop = PrunedVLM(model, processor, method="pyramiddrop", budget=5)
    pruner = _run(pdrop, pdrop.prepare(images[:1], prompts[:1]))
    first = pruner.stages[0]  # ranked before layer 1 on the unpruned sequence, with layer 1's projections
    assert first.layer == 1
    torch.testing.assert_close(first.scores[0], att[1][0, :, -1].mean(0).float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_vl", "llava_onevision", "internvl"])
def test_dart_key_norms_are_the_models_own_keys(arch, images, prompts):
    """DART's L1 key norms at layer K - 1 equal those of the keys the model's attention receives (recorded through a
    custom attention function, after Qwen3-VL's ``k_norm`` and the rotary embedding)."""
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method="dart", budget=6, pivot_image=2, pivot_text=2)
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner = _run(vlm, prep)
    twin = copy.deepcopy(model)
    target = twin.model.language_model.layers[pruner.stages[0].layer - 1].self_attn  # layer K - 1
    keys = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        if module is target:
            keys.append(key)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(f"recording_keys_{arch}", recording)
    AttentionMaskInterface.register(f"recording_keys_{arch}", sdpa_mask)
    twin.model.language_model.config._attn_implementation = f"recording_keys_{arch}"
    with torch.inference_mode():
        twin(**prep.model_kwargs)
    torch.testing.assert_close(pruner.stages[0].keys[0], keys[0][0].float().abs().sum(dim=(0, 2)), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("method", ["dart", "pyramiddrop"])
def test_in_llm_deepstack_follows_the_surviving_columns(method, images, prompts):
    """DART / PyramidDrop on Qwen3-VL: every DeepStack addition lands on the image columns alive at that layer, each
    with its own rows of plain ``get_image_features`` (recorded around the pruner's addition,
    ``recording_deepstack``)."""
    model, processor = tiny_vlm("qwen3_vl")
    vlm = PrunedVLM(model, processor, method=method, budget=5)
    prep = vlm.prepare(images, prompts)
    pruner, calls = vlm.pruning(prep), []
    with torch.inference_mode(), pruner:
        recording_deepstack(model, calls)
        model(**prep.model_kwargs)
    _, deepstack = plain_image_features(model, vlm.inputs(images, prompts))
    ids = prep.model_kwargs["input_ids"]
    runs = [(row == model.config.image_token_id).nonzero().flatten() for row in ids]
    assert len(calls) == 3 and calls[-1][0] < ids.shape[1]  # the last addition (after layer 2) follows a pruning
    for layer, (_length, masks, embeds) in enumerate(calls):
        keep, alive, _ = pruner.layer_cols.get(layer, (None, None, None)) if layer >= pruner.first else (None,) * 3
        expected = []
        for b, run in enumerate(runs):
            cols = run if keep is None else keep[b][alive[b] & torch.isin(keep[b], run)]
            expected.append(deepstack[layer][b][torch.searchsorted(run, cols)])  # alive image columns, ascending
        assert masks.sum(1).tolist() == [e.shape[0] for e in expected]
        torch.testing.assert_close(embeds, torch.cat(expected))
    assert [s["visual_tokens"] for s in pruner.stats(prep.items)] == [5, 5]


def test_pyramiddrop_keeps_qwen3s_3d_positions(images, prompts):
    """No contiguous renumbering on M-RoPE (Qwen2.5-VL and Qwen3-VL); the 1D-RoPE LLM of LLaVA-OneVision renumbers as
    the released code does."""
    for arch, compact in (("qwen3_vl", False), ("qwen2_5_vl", False), ("llava_onevision", True), ("internvl", True)):
        model, _ = tiny_vlm(arch)
        ids = torch.full((1, 40), 5)
        ids[0, 3:23] = model.config.image_token_id
        assert make("pyramiddrop", model, ids, 5, {}).compact is compact, arch
    model, processor = tiny_vlm("qwen3_vl")
    vlm = PrunedVLM(model, processor, method="pyramiddrop", budget=5)
    prep = vlm.prepare(images[:1], prompts[:1])
    layers = model.model.language_model.layers
    seen = {}

    def recorder(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, kwargs["position_embeddings"][0])  # [1, L_i, hd] cos, prefill
        return hook

    hooks = [layers[i].self_attn.register_forward_pre_hook(recorder(i), with_kwargs=True) for i in range(len(layers))]
    try:
        pruner = _run(vlm, prep)
    finally:
        for h in hooks:
            h.remove()
    full = seen[0]  # [1, L, hd]: the unpruned sequence's 3D rotary embedding
    for i in range(1, len(layers)):
        keep, alive, _ = pruner.layer_cols[i]
        torch.testing.assert_close(seen[i][0, alive[0]], full[0, keep[0][alive[0]]])


def test_downsample_pools_qwen3s_merged_grid(images, prompts):
    model, processor = tiny_vlm("qwen3_vl")
    vlm = PrunedVLM(model, processor, method="downsample", budget=4)
    for image, prompt in zip(images, prompts):
        prep = vlm.prepare([image], [prompt])
        _, h, w = vlm.inputs([image], [prompt])["image_grid_thw"][0].tolist()
        weights, centres = pooling_matrix(h // 2, w // 2, 4)
        assert prep.stats[0]["kept"] == centres.tolist() and prep.stats[0]["visual_tokens"] == 4
        feats, deepstack = plain_image_features(model, vlm.inputs([image], [prompt]))
        fed = prep.model_kwargs["mm_encoder_outputs"]["image"]
        torch.testing.assert_close(fed.pooler_output[0], weights @ feats[0])  # the pooled cells
        for got, layer in zip(fed.deepstack_features, deepstack):  # DeepStack: the bin centres' own rows
            torch.testing.assert_close(got[0], layer[0][centres])


def onevision_fed_grid(item):
    """By hand from the packed sequence: ``{view: (rows, cols)}`` of each view's rectangle in the grid the LLM is fed
    (base view: 4 x 4; crops: the stitched grid's rows are the runs between newline tokens)."""
    n = ONEVISION_SIDE ** 2
    shapes = {0: (ONEVISION_SIDE, ONEVISION_SIDE)}
    nl = item.newline.nonzero().flatten().tolist()
    starts = [n] + [p + 1 for p in nl[:-1]]
    grid_rows = [list(range(s, e)) for s, e in zip(starts, nl)]  # run positions of each fed crop row
    view_of = dict(zip(item.run_pos.tolist(), item.groups.tolist()))
    for v in range(1, int(item.groups.max()) + 1):
        rows = [r for r in grid_rows if any(view_of[p] == v for p in r)]
        cols = {sum(view_of[p] == v for p in r) for r in rows}
        assert len(cols) == 1  # a rectangle
        shapes[v] = (len(rows), cols.pop())
    return shapes


@pytest.mark.parametrize("image", [make_image(40, 56, 0), make_image(64, 30, 1), make_image(64, 64, 2)])
def test_downsample_pools_each_onevision_view_as_fed(image):
    """Per view (``per_crop``), each view's fed rectangle is pooled: the crops of a resized grid (64 x 64: 8 x 8
    resized to 5 x 5) on the grid after anyres-max resizing, not their source patches'."""
    model, processor = tiny_vlm("llava_onevision")
    budget = 7
    vlm = PrunedVLM(model, processor, method="downsample", budget=budget)
    prep = vlm.prepare([image], ["q"])
    item = prep.items[0]
    shapes = onevision_fed_grid(item)
    counts = [shapes[v][0] * shapes[v][1] for v in sorted(shapes)]
    shares = split_budget(budget, counts)
    feats = item.features.float()
    expected_feats, expected_pos = [], []
    for v, share in zip(sorted(shapes), shares):
        if share == 0:
            continue
        members = (item.groups == v).nonzero().flatten()  # run order = raster order of the fed rectangle
        weights, centres = pooling_matrix(*shapes[v], share)
        expected_feats.append(weights @ feats[members])
        expected_pos.append(item.run_pos[members[centres]])
    fed = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output[0]
    assert fed.shape[0] == budget == prep.stats[0]["visual_tokens"]
    order = torch.cat(expected_pos).argsort()
    torch.testing.assert_close(fed.float(), torch.cat(expected_feats)[order], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="one rectangle of one view"):
        PrunedVLM(model, processor, method="downsample", budget=budget, budget_mode="global").prepare([image], ["q"])


@pytest.mark.parametrize("arch", ["qwen3_vl", "llava_onevision", "internvl"])
def test_cdpruner_uses_the_llms_input_embeddings(arch, images, prompts):
    """No CLIP text tower (Qwen3-VL; llava-onevision checkpoints ship only SigLIP's vision tower): the question's
    mean LLM input embedding vs. the projected tokens; ``text_source: clip`` is refused at construction."""
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method="cdpruner", budget=5, budget_mode="global") \
        if arch in ("llava_onevision", "internvl") else PrunedVLM(model, processor, method="cdpruner", budget=5)
    prep = vlm.prepare(images[:1], prompts[:1])
    feats = prep.items[0].features.float()
    with torch.inference_mode():
        ids = processor.tokenizer(prompts[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
        query = model.get_input_embeddings()(ids)[0].float().mean(0)
    want = promprune.select(feats[None], budget=5, method="cdpruner",
                            instruction=promprune.Instruction(query[None], feats[None], source="llm"))
    assert prep.stats[0]["kept"] == sorted(prep.items[0].grid_index[want.indices[0]].tolist())
    with pytest.raises(ValueError, match=f"text_source 'clip' needs a CLIP vision tower; this {vlm.adapter.encoder}"):
        PrunedVLM(model, processor, method="cdpruner", budget=5, text_source="clip")
