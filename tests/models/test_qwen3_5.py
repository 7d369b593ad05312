"""Qwen3.5 (issue 46): Qwen3-VL's vision tower without DeepStack and a hybrid LLM (Gated DeltaNet linear attention
between gated full-attention layers), through every pre-LLM and in-LLM method.

References, each independent of the code under test: eager attention weights recorded by a custom attention function,
Qwen2-VL's M-RoPE rule worked by hand, a naive greedy loop that runs each stretch of decoder layers on its kept columns
alone with no cache (the in-LLM methods), a linear-attention layer scanning the kept tokens by itself, a plain forward
of the whole prompt (prefix once), the layer mapping worked by hand on the 4B's published layer types, and the FLOPs /
KV / state bytes worked by hand and measured on a real cache.
"""
import contextlib
import copy
import inspect

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35_mod

import promprune
from promprune.efficiency import (
    MIB,
    kv_cache_bytes,
    layer_prefill_flops,
    prefill_flops,
    recurrent_state_bytes,
    text_shape,
)
from promprune.models import PrunedVLM, prefix
from promprune.models.llm_hooks import cache_argument, cache_length_layer, hybrid_stages, stage_layers
from promprune.models.options import all_methods, is_in_llm
from promprune.models.shapes import shape_spec
from promprune.models.shapes import _config as shape_config
from promprune.models.sharing import ImageCache
from promprune.models.tiny import tiny_vlm
from promprune.selection import registry

from .conftest import lm_inputs, make_image, naive_greedy, sdpa_keys
from .test_qwen_positions import hand_positions

PRE_LLM = [m for m in all_methods() if not is_in_llm(m)]
IN_LLM = [m for m in all_methods() if is_in_llm(m)]
TINY_TYPES = ["linear_attention", "full_attention"] * 4  # tiny:qwen3_5's 8 layers
FOUR_B_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 8  # Qwen3.5-4B's 32 layers


def cache_name(layer) -> str:
    """The linear-attention forward's cache argument: ``cache_params`` up to transformers 5.23, ``cache`` from 5.24."""
    return "cache" if "cache" in inspect.signature(layer.linear_attn.forward).parameters else "cache_params"


def tiny():
    return tiny_vlm("qwen3_5")


def vlm_for(method=None, budget=None, **options):
    model, processor = tiny()
    return PrunedVLM(model, processor, method=method, budget=budget, **options)


# a scored in-LLM method of one's own (the hidden states' norm), registered by the tests that run it: its default
# layer 2 of 32 ranks at the layer it cuts before, like PyramidDrop
OWN = "own_hidden_norm"


@contextlib.contextmanager
def registered(method):
    """``method`` registered while active when it is :data:`OWN` (the built-ins always are)."""
    if method != OWN:
        yield
        return
    registry.register_in_llm_method(OWN, score=lambda inputs: inputs.hidden.float().norm(dim=-1))
    try:
        yield
    finally:
        registry._REGISTRY.pop(OWN, None)


def in_llm_options(method):
    """Recycling merges hidden states, which a naive keep-the-columns reference does not: off where compared."""
    return {"recycle_ratio": 0.0} if method == "sparsevlm" else {}


def run_pruned(vlm, prep, **forward):
    """One forward (prefill) under the method's hooks; returns ``(pruner, output)``."""
    pruner = vlm.pruning(prep)
    with torch.inference_mode(), pruner:
        out = vlm.model(**prep.model_kwargs, **forward)
    return pruner, out


# ---- the model -----------------------------------------------------------------------------------------------------


def test_tiny_is_the_real_hybrid_class():
    model, processor = tiny()
    text = model.config.text_config
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration" and model.config.model_type == "qwen3_5"
    assert text.layer_types == TINY_TYPES
    layers = model.model.language_model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [t == "linear_attention" for t in TINY_TYPES]
    attn = layers[1].self_attn
    assert attn.q_proj.out_features == 2 * text.num_attention_heads * attn.head_dim  # query and output gate
    assert not hasattr(model.model.visual, "deepstack_merger_list")
    assert type(processor).__name__ == "Qwen3VLProcessor"  # what transformers maps qwen3_5 to


def test_received_attention_matches_eager(images, prompts):
    """No CLS: each patch's received attention at the last vision block (queries and heads averaged), pooled over its
    2x2 merge group, equals an eager forward's weights; the tower keeps SDPA."""
    model, processor = tiny()
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=4)
    batch = vlm.inputs(images, prompts)
    items = vlm.adapter.encode(batch, need_saliency=True)
    assert model.config.vision_config._attn_implementation == "sdpa"
    twin = copy.deepcopy(model)
    target = twin.model.visual.blocks[-1].attn
    recorded = []

    def recording_eager(module, *args, **kwargs):
        out, weights = qwen35_mod.eager_attention_forward(module, *args, **kwargs)
        if module is target:
            recorded.append(weights[0])  # [H, n, n]: one image per call
        return out, weights

    AttentionInterface.register("recording_eager_qwen3_5", recording_eager)
    twin.model.visual.config._attn_implementation = "recording_eager_qwen3_5"
    with torch.inference_mode():
        twin.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    assert len(recorded) == len(images)
    for item, weights in zip(items, recorded):
        per_token = weights.mean(dim=(0, 1)).view(-1, 4).mean(dim=1)  # merge groups are consecutive patches
        torch.testing.assert_close(item.saliency, per_token, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block", [0, 2])
def test_saliency_block_is_any_vision_block(block, images, prompts):
    """Every block attends over the whole image: ``saliency_block`` picks one; out of range is refused."""
    vlm = vlm_for("saliency_only", 4, saliency_block=block)
    assert vlm.adapter.block == block
    with pytest.raises(ValueError, match="saliency_block must be a block of the vision tower"):
        vlm_for("saliency_only", 4, saliency_block=4)


def test_mu_defaults_to_the_borrowed_qwen_value():
    vlm = vlm_for("promprune", 8)
    assert vlm.adapter.encoder == "qwen3_5" and vlm.method_options["mu"] == 0.5744
    assert vlm_for("promprune", 8, mu=0.6).method_options["mu"] == 0.6


@pytest.mark.parametrize("order", ["raster", "selection"])
def test_kept_tokens_keep_their_own_3d_positions(order, images, prompts):
    """M-RoPE on the unpruned sequence, gathered at the kept columns: Qwen2-VL's rule by hand."""
    model, processor = tiny()
    vlm = PrunedVLM(model, processor, method="promprune", budget=7, token_order=order)
    prep = vlm.prepare(images, prompts)
    kw = prep.model_kwargs
    grid = vlm.inputs(images, prompts)["image_grid_thw"]
    for b, stats in enumerate(prep.stats):
        valid = kw["attention_mask"][b].bool()
        kept = prep.items[b].grid_index[prep.fed[b].run_pos].tolist()  # grid index of each fed column, in order
        assert kept == stats["kept"] and (order == "selection") is (kept != sorted(kept))
        expected = hand_positions(kw["input_ids"][b], kw["attention_mask"][b], model.config.image_token_id,
                                  (int(grid[b, 1]) // 2, int(grid[b, 2]) // 2), kept)
        torch.testing.assert_close(kw["position_ids"][1:, b][:, valid], expected)


def test_positions_are_qwen35s_own_rope_index(images, prompts):
    """Unpruned, the gathered positions are transformers' own ``get_rope_index`` of the processor's sequence."""
    model, processor = tiny()
    vlm = PrunedVLM(model, processor, method=None)
    batch = vlm.inputs(images, prompts)
    full, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                         image_grid_thw=batch["image_grid_thw"],
                                         attention_mask=batch["attention_mask"])
    got = vlm.prepare(images, prompts).model_kwargs["position_ids"]
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[1:][:, mask], full[:, mask])


# ---- pre-LLM methods: exactly the budget ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 7, 20])
@pytest.mark.parametrize("method", PRE_LLM)
def test_every_pre_llm_method_keeps_exactly_its_budget(method, budget, images, prompts):
    """The LLM reads ``budget`` visual tokens per image: placeholders, fed features and the stats agree, each a
    distinct grid token of the image (35 and 32 candidates here)."""
    vlm = vlm_for(method, budget)
    prep = vlm.prepare(images, prompts)
    image_id = vlm.model.config.image_token_id
    assert (prep.model_kwargs["input_ids"] == image_id).sum(1).tolist() == [budget, budget]
    fed = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output
    assert [f.shape[0] for f in fed] == [budget, budget]
    for stats, item in zip(prep.stats, prep.items):
        assert stats["visual_tokens"] == budget == len(set(stats["kept"]))
        assert set(stats["kept"]) <= set(item.grid_index.tolist())


@pytest.mark.parametrize("method", ["promprune", "divprune", "cdpruner", "visionzip"])
def test_generation_reports_the_budget(method, images, prompts):
    out = vlm_for(method, 6).generate(images, prompts, max_new_tokens=2)
    assert [g.visual_tokens for g in out] == [6, 6] and all(len(g.token_ids) == 2 for g in out)


@pytest.mark.parametrize("method", ["dart", "pyramiddrop", "cdpruner", "random"])
def test_full_budget_equals_unpruned_logits(method, images, prompts):
    """Keeping every token through the pruning path (in-LLM: the hooks, masks and column order of a hybrid LLM) gives
    the unpruned logits."""
    base = vlm_for()
    prep = base.prepare(images, prompts)
    with torch.inference_mode():
        ref = base.model(**prep.model_kwargs).logits
    vlm = vlm_for(method, 10_000)
    prep = vlm.prepare(images, prompts)
    with torch.inference_mode(), vlm.pruning(prep):
        got = vlm.model(**prep.model_kwargs).logits
    valid = prep.model_kwargs["attention_mask"].bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=0)


# ---- in-LLM methods on the hybrid LLM ------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("method", IN_LLM + [OWN])
def test_in_llm_generation_is_the_kept_columns_run_alone(method, rows, images, prompts):
    """``generate`` under the hooks (SDPA masks, the linear layers' 2D masks and recurrent / conv states, the KV caches
    of the kept columns) gives, step by step, the logits of a naive loop that runs the layers after each cut on the
    kept columns only. Two rows: different visual token counts, so one row carries dead filler columns. A scored
    method of one's own at its default layer cuts before layer 3 (it cut before 1, the cache's first layer with
    keys, and the first decoding step failed)."""
    with registered(method):
        _generation_is_the_kept_columns_run_alone(method, rows, images, prompts)


def _generation_is_the_kept_columns_run_alone(method, rows, images, prompts):
    steps = 3
    vlm = vlm_for(method, 5, **in_llm_options(method))
    prep = vlm.prepare(images[:rows], prompts[:rows])
    kw = prep.model_kwargs
    pruner = vlm.pruning(prep)
    with torch.inference_mode(), pruner:
        out = vlm.model.generate(**kw, max_new_tokens=steps, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    got = torch.stack(out.logits, dim=1)  # [B, steps, V]
    embeds = lm_inputs(vlm.model, kw)["inputs_embeds"]
    depth = len(vlm.model.model.language_model.layers)
    for b in range(rows):
        real = kw["attention_mask"][b].bool()
        columns = real.nonzero().flatten()
        segments, lo, cols = [], 0, torch.arange(int(real.sum()))
        for stage in pruner.stages:
            segments.append((lo, stage.layer, cols))
            keep, alive, _ = pruner.layer_cols[stage.layer]
            cols, lo = torch.searchsorted(columns, keep[b][alive[b]].sort().values), stage.layer
        segments.append((lo, depth, cols))
        with torch.inference_mode():
            want = naive_greedy(vlm.model, embeds[b][real], kw["position_ids"][1:, b][:, real], segments, steps)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
        assert len(cols) == int(real.sum()) - int((kw["input_ids"][b] == vlm.model.config.image_token_id).sum()) + 5


@pytest.mark.parametrize("method", IN_LLM)
def test_linear_layers_after_a_cut_scan_only_the_kept_tokens(method, images, prompts):
    """Every linear-attention layer after the first cut runs on the kept columns: the tokens it reads that its mask
    lets in are the prompt's text and exactly the budget's visual tokens, and its cached recurrent and conv states
    equal those of the same layer scanning only those tokens by itself."""
    budget = 5
    vlm = vlm_for(method, budget)
    prep = vlm.prepare(images, prompts)
    layers = vlm.model.model.language_model.layers
    seen = {}

    def recorder(i):
        def hook(module, args, kwargs):
            seen[i] = (kwargs["hidden_states"].clone(), kwargs.get("attention_mask"))
        return hook

    hooks = [layer.linear_attn.register_forward_pre_hook(recorder(i), with_kwargs=True)
             for i, layer in enumerate(layers) if hasattr(layer, "linear_attn")]
    try:
        pruner, out = run_pruned(vlm, prep, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    cache = out.past_key_values
    ids, mask = prep.model_kwargs["input_ids"], prep.model_kwargs["attention_mask"]
    text = (mask.bool() & (ids != vlm.model.config.image_token_id)).sum(1)  # [B]
    after = [i for i in seen if i >= pruner.first]
    assert after
    assert [s["visual_tokens"] for s in pruner.stats(prep.items)] == [budget, budget]
    for i in after:
        hidden, layer_mask = seen[i]
        live = layer_mask.bool() if layer_mask is not None else torch.ones(hidden.shape[:2], dtype=torch.bool)
        final = i >= pruner.stages[-1].layer
        if final:  # after the last cut: the text and the budget
            assert live.sum(1).tolist() == (text + budget).tolist()
        for b in range(live.shape[0]):
            assert bool(live[b, live[b].nonzero().min():].all())  # dead columns all precede the live ones
            alone = DynamicCache(config=vlm.model.config)
            with torch.inference_mode():
                layers[i].linear_attn(hidden[b:b + 1, live[b]], attention_mask=None, **{cache_name(layers[i]): alone})
            mine, ref = cache.layers[i], alone.layers[i]
            torch.testing.assert_close(mine.recurrent_states[0][b], ref.recurrent_states[0][0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.conv_states[0][b], ref.conv_states[0][0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", IN_LLM)
def test_every_in_llm_method_prunes_to_its_budget(method, images, prompts):
    out = vlm_for(method, 6).generate(images, prompts, max_new_tokens=2)
    assert [g.visual_tokens for g in out] == [6, 6] and all(len(set(g.kept)) == 6 for g in out)


# the stage layers (requested, used) worked by hand: a stage ranks at the layer before its cut (PyramidDrop: at the
# cut's own layer), which must be full attention: tiny 1, 3, 5, 7; Qwen3.5-4B 3, 7, ..., 31
LAYER_MAPS = {
    ("tiny", "fastv"): [(1, 2)], ("tiny", "dart"): [(1, 2)],
    ("tiny", "sparsevlm"): [(2, 2), (3, 4), (5, 6)],  # cuts 2, 3, 5 (ranks 1, 2, 4 scaled, + 1) rank at 1, 3, 5
    ("tiny", "pyramiddrop"): [(2, 3), (4, 5), (6, 7)],
    ("4b", "fastv"): [(2, 4)], ("4b", "dart"): [(2, 4)],
    ("4b", "sparsevlm"): [(3, 4), (7, 8), (16, 16)],  # released ranks 2, 6, 15 (cuts 3, 7, 16) -> ranks 3, 7, 15
    ("4b", "pyramiddrop"): [(8, 11), (16, 19), (24, 27)],
    # ranked at the cut layer, which must follow the cache's first layer with keys (tiny 1, 4B 3): 1 -> 3, 2 -> 7
    ("tiny", OWN): [(1, 3)], ("4b", OWN): [(2, 7)],
}


@pytest.mark.parametrize("model,method", sorted(LAYER_MAPS))
def test_stage_layers_move_to_full_attention(model, method):
    config = tiny()[0].config if model == "tiny" else shape_config("qwen3_5_4b")
    with registered(method):
        at, mapping = stage_layers(config, method, promprune.method_spec(method).resolve({}, budget=64))
    assert mapping == LAYER_MAPS[(model, method)] and at == [used for _, used in mapping]
    types = config.text_config.layer_types
    for layer in at:
        assert types[layer if method in ("pyramiddrop", OWN) else layer - 1] == "full_attention"
        assert layer > types.index("full_attention")  # every cut after the cache's first layer with keys


def test_the_cache_length_layer_is_the_one_transformers_measures(images, prompts):
    """``cache_length_layer`` names the layer whose length ``Cache.get_seq_length()`` reports on transformers 5.23 (its
    first attention layer: 1 on tiny:qwen3_5, 3 on the 4B's every-4th pattern, 0 where no layer is linear): after a
    prefill with the layers' caches cut short by hand, the cache's length is that layer's. From 5.25 a linear layer
    counts its own tokens and the length is layer 0's: cutting every layer after ``cache_length_layer`` (what the
    stages do) leaves it the prompt's on both."""
    assert (cache_length_layer(TINY_TYPES), cache_length_layer(FOUR_B_TYPES)) == (1, 3)
    assert cache_length_layer(["sliding_attention", "full_attention"]) == 0
    vlm = vlm_for()
    prep = vlm.prepare(images[:1], prompts[:1])
    cache = DynamicCache(config=vlm.model.config)
    with torch.inference_mode():
        vlm.model(**prep.model_kwargs, **{cache_argument(vlm.model): cache})
    L = prep.model_kwargs["input_ids"].shape[1]
    assert cache.get_seq_length() == L
    first = cache_length_layer(TINY_TYPES)
    for i, layer in enumerate(cache.layers):
        if i > first and getattr(layer, "keys", None) is not None:
            layer.keys = layer.keys[..., : L - 1 - i, :]
    assert cache.get_seq_length() == L  # what every stage cuts leaves the length decoding reads whole
    if hasattr(cache.layers[0], "cumulative_length_linear"):  # transformers >= 5.25: layer 0 counts its own tokens
        assert not hasattr(cache.layers[0], "keys") and int(cache.get_seq_length()) == L
        return
    cache.layers[first].keys = cache.layers[first].keys[..., : L - 1 - first, :]
    assert cache.get_seq_length() == L - 1 - first  # the length is that layer's, and no earlier layer's


@pytest.mark.parametrize("method,options", [("pyramiddrop", {"layers": [1, 3]}), (OWN, {"layers": [1]})])
def test_a_cut_at_the_cache_length_layer_is_refused_before_any_work(method, options):
    """PyramidDrop and a scored method rank at the layer they cut before: layer 1 ranks at a full-attention layer but
    cuts before the cache's first layer with keys, whose length the decoding steps read (the first one failed with
    "upper bound and lower bound inconsistent with step sign"). Refused naming the valid layers, 1 not among them."""
    model, processor = tiny()
    with registered(method), pytest.raises(ValueError, match=rf"in-LLM method '{method}' on .*model type 'qwen3_5'.*"
                                           r"option 'layers' gives layer 1, which cuts before layer 1, the first with "
                                           r"a KV cache.* Give 'layers' from \[3, 5, 7\]") as e:
        PrunedVLM(model, processor, method=method, budget=5, **options)
    assert "attends in full only at layers [1, 3, 5, 7]" in str(e.value)


@pytest.mark.parametrize("method", IN_LLM)
def test_the_pruner_records_the_mapping(method, images, prompts):
    vlm = vlm_for(method, 6)
    pruner = vlm.pruning(vlm.prepare(images[:1], prompts[:1]))
    assert pruner.layer_map == LAYER_MAPS[("tiny", method)]
    assert [s.layer for s in pruner.stages] == [used for _, used in LAYER_MAPS[("tiny", method)]]


# explicit layers: (method, options) that rank at a linear layer (refused) or at a full one (used as given)
REFUSED = [("fastv", {"layer": 1}), ("dart", {"layer": 3}), ("sparsevlm", {"layers": [1, 4, 6]}),
           ("pyramiddrop", {"layers": [2]})]
ACCEPTED = [("fastv", {"layer": 4}), ("dart", {"layer": 2}), ("sparsevlm", {"layers": [2, 6]}),
            ("pyramiddrop", {"layers": [3, 7]})]


@pytest.mark.parametrize("method,options", REFUSED)
def test_an_explicit_layer_ranking_at_a_linear_layer_is_refused_before_any_work(method, options):
    model, processor = tiny()
    refusal = rf"in-LLM method '{method}' on .* \(model type 'qwen3_5'\).*linear attention"
    with pytest.raises(ValueError, match=refusal) as e:
        PrunedVLM(model, processor, method=method, budget=5, **options)
    assert "attends in full only at layers [1, 3, 5, 7]" in str(e.value)


@pytest.mark.parametrize("method,options", ACCEPTED)
def test_an_explicit_layer_ranking_at_full_attention_is_used(method, options, images, prompts):
    vlm = vlm_for(method, 5, **options)
    pruner = vlm.pruning(vlm.prepare(images[:1], prompts[:1]))
    given = options.get("layers") or [options["layer"]]
    assert [s.layer for s in pruner.stages] == given and pruner.layer_map == list(zip(given, given))
    out = vlm.generate(images[:1], prompts[:1], max_new_tokens=1)
    assert out[0].visual_tokens == 5


def test_a_method_without_an_attention_layer_left_is_refused():
    """A stage needs a full-attention layer to rank at with a layer after it to prune before, and (PyramidDrop) one
    after the cache's first layer with keys."""
    types = ["linear_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="finds no full-attention layer at or after layer 0.*so fastv is refused"):
        hybrid_stages(types, "fastv", [1], explicit=False, model="toy")
    with pytest.raises(ValueError, match="finds no full-attention layer at or after layer 1.*so pyramiddrop is "
                                         "refused.*Give option 'layers' from \\[\\]"):
        hybrid_stages(types, "pyramiddrop", [1], explicit=False, model="toy")  # 2 would cut before the cache's layer
    assert hybrid_stages(types + types[1:], "pyramiddrop", [1], explicit=False, model="toy") == [4]
    assert hybrid_stages(FOUR_B_TYPES, "sparsevlm", [1, 2, 3], explicit=False, model="toy") == [4, 8, 12]


def test_plain_transformers_keep_their_layers():
    """An LLM without linear-attention layers keeps the scaled layers as they were."""
    config = tiny_vlm("qwen3_vl")[0].config
    assert stage_layers(config, "sparsevlm", promprune.method_spec("sparsevlm").resolve({}, budget=8))[1] == \
        [(2, 2), (3, 3)]  # 4 layers: ranks 1, 2 (2, 6, 15 of 32, left a layer after them), cuts before 2, 3


def test_fastv_ranks_by_the_gated_attentions_own_weights(images, prompts):
    """The hooks' last-token attention at the mapped layer (queries from the first half of each head's q_proj, the
    rest being the output gate; a quarter of each head rotated) equals an eager forward's weights there; so does
    PyramidDrop's, with its own layer's projections."""
    vlm = vlm_for("fastv", 5)
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner, _ = run_pruned(vlm, prep)
    twin = copy.deepcopy(vlm.model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        att = twin(**prep.model_kwargs, output_attentions=True).attentions  # the full-attention layers' weights
    full = [i for i, t in enumerate(TINY_TYPES) if t == "full_attention"]
    weights = dict(zip(full, att))
    rank = pruner.stages[0].layer - 1
    torch.testing.assert_close(pruner.stages[0].scores[0], weights[rank][0, :, -1].mean(0).float(), atol=1e-5,
                               rtol=1e-4)
    pdrop = vlm_for("pyramiddrop", 5)
    pruner, _ = run_pruned(pdrop, pdrop.prepare(images[:1], prompts[:1]))
    first = pruner.stages[0]  # ranked at layer 3 on the unpruned sequence, with layer 3's projections
    torch.testing.assert_close(first.scores[0], weights[first.layer][0, :, -1].mean(0).float(), atol=1e-5,
                               rtol=1e-4)


def test_dart_key_norms_are_the_gated_attentions_own_keys(images, prompts):
    vlm = vlm_for("dart", 6, pivot_image=2, pivot_text=2)
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner, _ = run_pruned(vlm, prep)
    keys = sdpa_keys(vlm.model, pruner.stages[0].layer - 1, prep.model_kwargs)  # [1, Hkv, L, hd]
    torch.testing.assert_close(pruner.stages[0].keys[0], keys[0].float().abs().sum(dim=(0, 2)), atol=1e-4, rtol=1e-4)


# ---- vision once, prefix once --------------------------------------------------------------------------------------

KEYS = ["a", "a", "b", "a", "b"]
SHARED_PROMPTS = ["What is it?", "Colour of the big thing here?", "Count?", "Is there a dog in the image?", "Where?"]


@pytest.fixture(scope="module")
def rows():
    pictures = {"a": make_image(40, 56, 0), "b": make_image(64, 30, 1)}
    return [pictures[k] for k in KEYS]


@pytest.mark.parametrize("method,budget", [(None, None), ("promprune", 8), ("fastv", 6)])
def test_vision_once_gives_the_unshared_answers(method, budget, rows):
    vlm = vlm_for(method, budget)
    shared = vlm.generate(rows, SHARED_PROMPTS, keys=KEYS, cache=ImageCache(), max_new_tokens=4)
    plain = vlm.generate(rows, SHARED_PROMPTS, max_new_tokens=4)
    assert [g.token_ids for g in shared] == [g.token_ids for g in plain]
    assert [g.visual_tokens for g in shared] == [g.visual_tokens for g in plain]


def test_the_cached_prefix_continues_the_whole_prompt_only_row_by_row(rows):
    """The first answer token through the cached prefix (linear layers continuing each row's stored state over its
    own suffix) equals a plain forward of the whole prompt; run as one padded batch instead, the suffixes' left
    padding would reach the linear layers' states, and the logits differ."""
    vlm = vlm_for("promprune", 8)
    prep = vlm.prepare(rows, SHARED_PROMPTS, keys=KEYS)
    with torch.inference_mode():
        whole = vlm.model(**prep.model_kwargs).logits[:, -1]

        def continued(rowwise: bool):
            cached = prefix.inputs(vlm, prep, ImageCache())
            length = cached[cache_argument(vlm.model)].get_seq_length()
            suffix = {k: v[..., length:] if k in ("input_ids", "position_ids") else v for k, v in cached.items()}
            with prefix.continuing(vlm.model) if rowwise else contextlib.nullcontext():
                return vlm.model(**suffix).logits[:, -1]

        torch.testing.assert_close(continued(True), whole, rtol=1e-4, atol=1e-4)
        assert (continued(False) - whole).abs().max() > 1e-3


def test_each_question_gets_its_own_copy_of_the_prefix_state(rows):
    """The stored prefix states stay as prefilled after their questions are answered (decoding updates the cache's
    states in place), and no cache tensor shares memory with them."""
    vlm = vlm_for("divprune", 6)
    cache = ImageCache()
    vlm.generate(rows[:3], SHARED_PROMPTS[:3], keys=KEYS[:3], cache=cache, prefix_cache=True, max_new_tokens=1)
    stored = {k: [copy.deepcopy(p.layers) for p in v] for k, v in cache.prefixes.items()}
    linear = [i for i, t in enumerate(TINY_TYPES) if t == "linear_attention"]
    state = cache.prefixes["a"][0].layers[linear[0]]
    assert isinstance(state, prefix.RecurrentState) and state.recurrent[0].shape[0] == 1
    prep = vlm.prepare(rows[3:], SHARED_PROMPTS[3:], keys=KEYS[3:], cache=cache)
    kwargs = prefix.inputs(vlm, prep, cache)
    live = kwargs[cache_argument(vlm.model)]
    ptrs = {t.data_ptr() for p in sum(cache.prefixes.values(), []) for i in linear
            for t in (*p.layers[i].conv, *p.layers[i].recurrent)}
    assert not ptrs & {live.layers[i].recurrent_states[0].data_ptr() for i in linear}
    assert not ptrs & {live.layers[i].conv_states[0].data_ptr() for i in linear}
    vlm.generate(rows[3:], SHARED_PROMPTS[3:], keys=KEYS[3:], cache=cache, prefix_cache=True, max_new_tokens=4)
    for key, prefixes in cache.prefixes.items():
        for before, p in zip(stored[key], prefixes):
            for i in linear:
                assert all(torch.equal(a, b) for a, b in zip(before[i].recurrent, p.layers[i].recurrent))
                assert all(torch.equal(a, b) for a, b in zip(before[i].conv, p.layers[i].conv))


# ---- the chat format -----------------------------------------------------------------------------------------------


def test_enable_thinking_switches_the_generation_prompt_and_strips_the_reasoning():
    default, off, on = vlm_for(), vlm_for(enable_thinking=False), vlm_for(enable_thinking=True)
    assert default.conversation("Q").endswith("<|im_start|>assistant\n<think>\n") and default.thinks
    assert on.conversation("Q") == default.conversation("Q") and on.thinks
    assert off.conversation("Q").endswith("<think>\n\n</think>\n\n") and not off.thinks
    assert on.answer_text("so: red.</think>\n\nRed ") == "Red" and on.answer_text("still thinking") == ""
    assert off.answer_text(" Red\n") == "Red"
    qwen3 = PrunedVLM(*tiny_vlm("qwen3_vl"), method=None, enable_thinking=False)  # no switch: the prompt as it was
    assert qwen3.conversation("Q") == PrunedVLM(*tiny_vlm("qwen3_vl"), method=None).conversation("Q")


# ---- efficiency: the hybrid LLM as it is ---------------------------------------------------------------------------


def test_flops_kv_and_state_of_qwen35_4b_by_hand():
    """Qwen3.5-4B (d 2560, MLP 9216, 16 query / 4 KV heads of 256, 8 gated full-attention layers; 24 Gated DeltaNet
    layers of 16 key / 32 value heads of 128, kernel 4), worked by hand."""
    text = shape_spec("qwen3_5_4b")["text_config"]
    d, m = 2560, 9216
    full = lambda n: n * d * (2 * 4096 + 2 * 1024) + n * 4096 * d + 2 * n * n * 4096 + 3 * n * d * m  # noqa: E731
    conv = 2 * 16 * 128 + 32 * 128  # q, k, v channels: 8192
    linear = lambda n: n * (d * (conv + 4096 + 2 * 32) + conv * 4 + 3 * 32 * 128 * 128 + 4096 * d + 3 * d * m)  # noqa: E731
    n = 1296 + 62
    assert prefill_flops(text, n) == 2 * (8 * full(n) + 24 * linear(n))
    assert float(f"{prefill_flops(text, n) / 1e12:.4g}") == 10.04
    assert layer_prefill_flops(text, n, layer=3) == 2 * full(n)
    assert layer_prefill_flops(text, n, 100, layer=0) == layer_prefill_flops(text, n, layer=0) == 2 * linear(n)
    with pytest.raises(ValueError, match="pass layer="):
        layer_prefill_flops(text, n)
    assert kv_cache_bytes(text, 1296, torch.float16) == 2 * 8 * 1296 * 4 * 256 * 2  # 40.5 MiB, full layers only
    assert kv_cache_bytes(text, 1296, "fp16") / MIB == 40.5
    assert recurrent_state_bytes(text, torch.bfloat16) == 24 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)  # 49.5 MiB
    assert recurrent_state_bytes(tiny_vlm("qwen3_vl")[0].config) == 0


def test_kv_and_state_bytes_are_what_the_cache_holds(images, prompts):
    """After a prefill of L columns, the real cache holds kv_cache_bytes(L) in its full-attention layers and
    recurrent_state_bytes per row in its linear ones, whatever L."""
    vlm = vlm_for()
    config = vlm.model.config
    assert text_shape(config).gated and text_shape(config).attention_layers == 4
    for count in (1, 2):
        prep = vlm.prepare(images[:count], prompts[:count])
        with torch.inference_mode():
            cache = vlm.model(**prep.model_kwargs, use_cache=True).past_key_values
        L = prep.model_kwargs["input_ids"].shape[1]
        kv = sum(t.numel() * t.element_size() for layer in cache.layers if hasattr(layer, "keys")
                 and layer.keys is not None for t in (layer.keys, layer.values))
        state = sum(t.numel() * t.element_size() for layer in cache.layers if hasattr(layer, "recurrent_states")
                    for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None)
        assert kv == count * kv_cache_bytes(config, L, torch.float32)
        assert state == count * recurrent_state_bytes(config, torch.float32)
