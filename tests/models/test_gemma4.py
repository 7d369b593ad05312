"""Gemma 4: soft tokens pooled 3x3, received-attention saliency, budgets per image, in-LLM methods on an LLM that mixes
sliding-window and full attention, the refused E2B / E4B, vision once and prefix once.

References are independent of the adapter and the hooks: an eager twin's attention weights (summed over each 3 x 3
patch block by reshaping the patch grid, not through the model's pooler), plain ``get_image_features``, the soft-token
grids worked by hand from the processor's resize rule, the layer maps worked by hand from the published layer types,
and the tiny model's own layers run on the kept sequence with the masks transformers builds for that sequence.
"""
import copy

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import create_masks_for_vision_model, get_block_sequence_ids_for_mask

import promprune
from promprune.models import PrunedVLM, prefix
from promprune.models.adapters import visual_token_capacity
from promprune.models.llm_hooks import stage_layers, unsupported
from promprune.models.sharing import ImageCache
from promprune.models.tiny import tiny_vlm

from .conftest import plain_generate, sdpa_keys
from .test_identity import unpruned_logits

# soft-token grids of the conftest images, by hand from the processor's rule (4 px patches, at most 70 x 9 patches,
# sides multiples of 3 patches): 40 x 56 px scaled by sqrt(630 * 16 / 2240) = 2.12 -> 84.9 x 118.8 px, floored to
# multiples of 12 px -> 84 x 108 = 21 x 27 patches = 7 x 9 soft tokens; 64 x 30 px by 2.29 -> 144 x 60 px = 12 x 5
GRIDS = [(7, 9), (12, 5)]
PRE_LLM = promprune.methods()
IN_LLM = promprune.methods(promprune.IN_LLM)


def tiny(window: int | None = None, impl: str | None = None):
    """A private copy of tiny:gemma4, its sliding window narrowed to ``window`` tokens (the tests' prompts are ~100
    tokens: 24 makes every sliding layer cut) and its attention set to ``impl``."""
    model, processor = tiny_vlm("gemma4")
    model = copy.deepcopy(model)
    if window is not None:
        model.config.text_config.sliding_window = window
    if impl is not None:
        model.set_attn_implementation(impl)
    return model, processor


def eager_saliency(model, batch, layer: int = -1) -> list[torch.Tensor]:
    """Per image ``[rows * cols]``: the attention each patch receives in an eager twin's encoder layer ``layer`` (mean
    over heads and the image's patches as queries; the processor puts the padding last), summed over each 3 x 3 block
    of the patch grid, in raster order of the blocks."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        out = twin.model.vision_tower(batch["pixel_values"], batch["image_position_ids"], output_attentions=True)
    att = out.attentions[layer]  # [B, H, S, S]
    scores = []
    for b, (rows, cols) in enumerate(GRIDS):
        n = rows * 3 * cols * 3
        received = att[b, :, :n, :n].mean(dim=(0, 1))  # [n]: its patches' rows sum to one over its patches
        scores.append(received.view(rows, 3, cols, 3).sum(dim=(1, 3)).flatten())
    return scores


# ---- the adapter ----------------------------------------------------------------------------------------------------


def test_tiny_has_the_31bs_structure():
    model, processor = tiny_vlm("gemma4")
    text = model.config.text_config
    assert text.layer_types == ["sliding_attention", "full_attention"] * 3
    assert text.use_bidirectional_attention == "vision" and text.attention_k_eq_v
    assert text.num_kv_shared_layers == 0 and not text.hidden_size_per_layer_input
    assert model.config.vision_config.pooling_kernel_size == 3 and processor.image_processor.max_soft_tokens == 70
    assert visual_token_capacity(model.config) == 70


def test_soft_tokens_vary_with_the_aspect_ratio(images, prompts):
    """Each image gives its own grid of soft tokens, the model's own features in the pooler's order."""
    model, processor = tiny_vlm("gemma4")
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=4)
    batch = vlm.inputs(images, prompts)
    with torch.inference_mode():
        items = vlm.adapter.encode(batch, need_saliency=False)
    with torch.inference_mode():
        plain = model.model.get_image_features(batch["pixel_values"], batch["image_position_ids"]).pooler_output
    for item, grid, feats in zip(items, GRIDS, plain):
        assert item.grid_shape == grid and item.run.shape[0] == grid[0] * grid[1]
        assert torch.equal(item.run, feats)
    assert (batch["input_ids"] == model.config.image_token_id).sum(1).tolist() == [63, 60]


def test_an_image_three_patches_thin_fits_the_position_table(prompts):
    """The processor gives an image 3 patches thin a side of up to 70 * 9 / 3 = 210 patches; the tiny tower's position
    table of 64 failed there with an IndexError inside transformers (the released model's holds 10240)."""
    from PIL import Image

    model, processor = tiny_vlm("gemma4")
    vlm = PrunedVLM(model, processor, method="promprune", budget=4)
    for size in [(12, 2000), (2000, 12)]:
        out = vlm.generate([Image.new("RGB", size, (200, 30, 30))], prompts[:1], max_new_tokens=2)
        assert out[0].visual_tokens == 4


@pytest.mark.parametrize("block", [None, 0])
def test_saliency_is_the_received_attention_of_each_tokens_patches(block, images, prompts):
    model, processor = tiny_vlm("gemma4")
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=4, saliency_block=block)
    batch = vlm.inputs(images, prompts)
    with torch.inference_mode():
        items = vlm.adapter.encode(batch, need_saliency=True)
    assert model.config.vision_config._attn_implementation == "sdpa"  # the hook did not force eager
    for item, ref in zip(items, eager_saliency(model, batch, -1 if block is None else block)):
        torch.testing.assert_close(item.saliency, ref, atol=1e-6, rtol=1e-5)
    assert abs(float(items[0].saliency.sum()) - 1.0) < 1e-5  # a distribution over the image's patches


def test_saliency_block_must_be_an_encoder_layer():
    model, processor = tiny_vlm("gemma4")
    with pytest.raises(ValueError, match=r"saliency_block must be a layer of the vision encoder \(0 \.\. 1\)"):
        PrunedVLM(model, processor, budget=4, saliency_block=2)


def test_mu_borrows_clips():
    model, processor = tiny_vlm("gemma4")
    assert PrunedVLM(model, processor, budget=4).method_options["mu"] == 0.42  # uncalibrated for Gemma 4


@pytest.mark.parametrize("method", PRE_LLM)
@pytest.mark.parametrize("budget", [1, 17, 59])
def test_every_pre_llm_method_keeps_exactly_its_budget(method, budget, images, prompts):
    """Per image, whatever its token count (63 and 60): the LLM's placeholders and the fed features."""
    model, processor = tiny_vlm("gemma4")
    prep = PrunedVLM(model, processor, method=method, budget=budget).prepare(images, prompts)
    ids, mask = prep.model_kwargs["input_ids"], prep.model_kwargs["attention_mask"].bool()
    assert ((ids == model.config.image_token_id) & mask).sum(1).tolist() == [budget, budget]
    assert [f.shape[0] for f in prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output] == [budget, budget]
    assert [s["visual_tokens"] for s in prep.stats] == [budget, budget]
    assert all(len(set(s["kept"])) == len(s["kept"]) == budget for s in prep.stats)
    # the bidirectional runs of the LLM's sliding layers: exactly the kept placeholders
    assert torch.equal(prep.model_kwargs["mm_token_type_ids"].bool(), ids == model.config.image_token_id)


@pytest.mark.parametrize("method", ["downsample", "cdpruner", "visionzip", "dart", "pyramiddrop"])
def test_images_of_two_sizes_in_one_batch_equal_each_alone(method, images, prompts):
    model, processor = tiny_vlm("gemma4")
    vlm = PrunedVLM(model, processor, method=method, budget=7)
    batched = vlm.generate(images, prompts, max_new_tokens=4)
    alone = [vlm.generate([image], [prompt], max_new_tokens=4)[0] for image, prompt in zip(images, prompts)]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    assert [g.kept for g in batched] == [g.kept for g in alone]
    assert [g.visual_tokens for g in batched] == [7, 7]


def test_downsample_pools_each_images_own_grid(images, prompts):
    from promprune.selection.controls import pooling_matrix

    model, processor = tiny_vlm("gemma4")
    vlm = PrunedVLM(model, processor, method="downsample", budget=6)
    prep = vlm.prepare(images, prompts)
    for b, grid in enumerate(GRIDS):
        weights, centres = pooling_matrix(*grid, 6)
        fed = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output[b]
        torch.testing.assert_close(fed.float(), weights @ prep.items[b].run.float(), atol=1e-6, rtol=1e-5)
        assert prep.stats[b]["kept"] == centres.tolist()


def test_max_soft_tokens_option(images, prompts):
    """140 soft tokens per image at most: 40 x 56 px -> 126.0 x 176.4 px -> 10 x 14 tokens; the capacity a budget
    must stay below follows the option, and a value the processor refuses is refused up front."""
    model, processor = tiny_vlm("gemma4")
    vlm = PrunedVLM(model, processor, method=None, max_soft_tokens=140)
    assert vlm.prepare(images[:1], prompts[:1]).stats[0]["visual_tokens"] == 140
    assert vlm.adapter.max_soft_tokens() == 140
    assert visual_token_capacity(model.config, {"max_soft_tokens": 140}) == 140
    assert visual_token_capacity(model.config) == 70 and visual_token_capacity(model.config, {}) == 70
    with pytest.raises(ValueError, match=r"'max_soft_tokens' must be one of \[70, 140, 280, 560, 1120\]"):
        PrunedVLM(model, processor, method=None, max_soft_tokens=100)


# ---- in-LLM methods on sliding-window + full-attention layers -------------------------------------------------------


def test_stage_layers_on_the_tiny_llm():
    """Layers S F S F S F. FastV's scaled K = 1 ranks at layer 0 (sliding) -> full layer 1, K = 2; SparseVLM's scaled
    ranks 1, 3 (2, 6, 15 of 32) are full: cuts before 2 and 4, as requested; PyramidDrop's 2, 3, 4 rank at themselves
    -> 3, then 5 (after 3), then none after 5 is left: the third stage joins the second, [3, 5]; DART ranks by key
    norms: its K = 1 stays."""
    config = tiny_vlm("gemma4")[0].config
    opts = {m: promprune.method_spec(m).resolve({}, budget=8) for m in IN_LLM}
    assert {m: stage_layers(config, m, opts[m]) for m in IN_LLM} == \
        {"fastv": ([2], [(1, 2)]), "sparsevlm": ([2, 4], [(2, 2), (4, 4)]),
         "pyramiddrop": ([3, 5], [(2, 3), (3, 5), (4, 5)]), "dart": ([1], [(1, 1)])}


def test_stage_layers_on_the_31b():
    """60 layers, full attention at 5, 11, ..., 59. FastV 2/32 -> 4, rank 3 -> 5: K = 6; SparseVLM's ranks 2, 6, 15 of
    32 -> 4, 11, 28 (cuts 5, 12, 29) -> full 5, 11, 29: K = 6, 12, 30; PyramidDrop 8, 16, 24 of 32 -> 15, 30, 45 -> 17,
    35, 47; DART's K = 4 stays."""
    from promprune.models.shapes import load

    config = load.config("gemma4_31b")
    assert [i for i, t in enumerate(config.text_config.layer_types) if t == "full_attention"] == list(range(5, 60, 6))
    opts = {m: promprune.method_spec(m).resolve({}, budget=64) for m in IN_LLM}
    assert {m: stage_layers(config, m, opts[m])[0] for m in IN_LLM} == \
        {"fastv": [6], "sparsevlm": [6, 12, 30], "pyramiddrop": [17, 35, 47], "dart": [4]}


@pytest.mark.parametrize("method,options,usable", [("fastv", {"layer": 1}, "[2, 4]"),
                                                    ("sparsevlm", {"layers": [2, 3]}, "[2, 4]"),
                                                    ("pyramiddrop", {"layers": [2, 3]}, "[1, 3, 5]")])
def test_an_explicit_layer_ranking_on_a_sliding_layer_is_refused_before_any_work(method, options, usable):
    import re

    model, processor = tiny_vlm("gemma4")
    with pytest.raises(ValueError, match=rf"in-LLM method '{method}' on Gemma4ForConditionalGeneration \(model type "
                                         rf"'gemma4'\).* option 'layers?' gives layer \d, which ranks .* a "
                                         rf"sliding-window layer .* Give 'layers?' from " + re.escape(usable)):
        PrunedVLM(model, processor, method=method, budget=5, **options)
    PrunedVLM(model, processor, method="dart", budget=5, layer=1)  # DART ranks by key norms: any layer


def _variant(**text):
    """tiny:gemma4's architecture with text config fields changed, freshly built (random weights)."""
    from transformers import Gemma4ForConditionalGeneration

    model, processor = tiny_vlm("gemma4")
    config = copy.deepcopy(model.config)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    torch.manual_seed(0)
    return Gemma4ForConditionalGeneration(config).eval(), processor


@pytest.mark.parametrize("method", IN_LLM)
def test_kv_sharing_and_per_layer_embeddings_are_refused_before_any_work(method, images, prompts):
    """As Gemma 4 E2B / E4B: the last layers borrow keys and values, every layer gets per-layer token embeddings."""
    vocab = tiny_vlm("gemma4")[0].config.text_config.vocab_size
    model, processor = _variant(num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab)
    with pytest.raises(ValueError, match=rf"in-LLM method '{method}' cannot run on Gemma4ForConditionalGeneration: "
                                         r"its language model reuses an earlier layer's keys and values in its last 2 "
                                         r"layers \(num_kv_shared_layers\) and adds per-layer token embeddings"):
        PrunedVLM(model, processor, method=method, budget=5)
    out = PrunedVLM(model, processor, method="promprune", budget=5).generate(images, prompts, max_new_tokens=2)
    assert [g.visual_tokens for g in out] == [5, 5]  # pre-LLM methods run on it


def test_e2b_is_refused_from_its_config():
    from promprune.models.shapes import load

    message = unsupported(load.config("gemma4_e2b"), "fastv", "shape:gemma4_e2b")
    assert "in-LLM method 'fastv' cannot run on shape:gemma4_e2b" in message
    assert "last 20 layers (num_kv_shared_layers)" in message and "hidden_size_per_layer_input 256" in message
    assert unsupported(load.config("gemma4_31b"), "fastv") is None


def _prefill(vlm, prep):
    pruner = vlm.pruning(prep)
    with torch.inference_mode(), pruner:
        logits = vlm.model(**prep.model_kwargs).logits
    return pruner, logits


@pytest.mark.parametrize("method,impl", [(m, "sdpa") for m in IN_LLM] + [("fastv", "eager"), ("pyramiddrop", "eager")])
def test_full_budget_is_the_unpruned_model_with_cutting_windows(method, impl, images, prompts):
    """A 24-token window cuts every sliding layer of the ~100-token prompts: the hooks' masks (window over the live
    columns, bidirectional vision runs) give the model's own logits and greedy tokens when nothing is pruned."""
    model, processor = tiny(window=24, impl=impl)
    ref, valid = unpruned_logits(model, processor, images, prompts)
    expected, _ = plain_generate(model, processor, images, prompts, 3)
    vlm = PrunedVLM(model, processor, method=method, budget=10_000)
    _, got = _prefill(vlm, vlm.prepare(images, prompts))
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=0)
    assert [g.token_ids for g in vlm.generate(images, prompts, max_new_tokens=3)] == expected


@pytest.mark.parametrize("method", IN_LLM)
@pytest.mark.parametrize("budget", [5, 20])
def test_in_llm_methods_prune_to_the_budget(method, budget, images, prompts):
    model, processor = tiny(window=24)
    vlm = PrunedVLM(model, processor, method=method, budget=budget)
    prep = vlm.prepare(images, prompts)
    pruner, _ = _prefill(vlm, prep)
    last = max(s.layer for s in pruner.stages)
    for idx in range(last, len(model.model.language_model.layers)):  # every layer after the last stage
        keep, alive, _ = pruner.layer_cols[idx]
        assert (pruner.vis.gather(1, keep) & alive).sum(1).tolist() == [budget, budget]
    out = vlm.generate(images, prompts, max_new_tokens=3)
    assert [g.visual_tokens for g in out] == [budget, budget]


def test_fastv_and_pyramiddrop_rank_with_a_full_attention_layers_own_attention(images, prompts):
    """The last token's attention the hooks recompute equals the eager forward's ``attentions`` at the full-attention
    layer the rank moved to (FastV: layer K - 1 = 1; PyramidDrop's first stage: layer 3 itself)."""
    model, processor = tiny(window=24)
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    inputs = PrunedVLM(model, processor, method=None).inputs(images, prompts)
    with torch.inference_mode():
        att = twin(**inputs, output_attentions=True).attentions
    for method, rank in (("fastv", 1), ("pyramiddrop", 3)):
        vlm = PrunedVLM(model, processor, method=method, budget=5)
        pruner, _ = _prefill(vlm, vlm.prepare(images, prompts))
        torch.testing.assert_close(pruner.stages[0].scores, att[rank][:, :, -1].mean(1).float(), atol=1e-5,
                                   rtol=1e-4)


def test_dart_key_norms_are_the_models_own_keys(images, prompts):
    """DART at its unmoved K = 1 reads layer 0's keys (a sliding layer: key norms do not depend on the window)."""
    model, processor = tiny(window=24)
    vlm = PrunedVLM(model, processor, method="dart", budget=6, pivot_image=2, pivot_text=2)
    prep = vlm.prepare(images, prompts)
    pruner, _ = _prefill(vlm, prep)
    keys = sdpa_keys(model, pruner.stages[0].layer - 1, prep.model_kwargs)  # [B, Hkv, L, hd]
    torch.testing.assert_close(pruner.stages[0].keys, keys.float().abs().sum(dim=(1, 3)), atol=1e-4, rtol=1e-4)


def kept_sequence_greedy(model, inputs, kept: torch.Tensor, K: int, new_tokens: int) -> list[int]:
    """Reference greedy tokens of one row pruned before layer K: every step runs the plain model on the prompt and the
    tokens so far (no cache), takes the input of layer K at the kept prompt columns and the generated ones, and runs
    layers K.. on that shorter sequence with the masks transformers builds for it as a sequence of its own (sliding
    window, bidirectional vision runs) and the rotary embedding of the original positions."""
    lm, text = model.model.language_model, model.config.text_config
    ids, types = inputs["input_ids"], inputs["mm_token_type_ids"]
    out = []
    for _ in range(new_tokens):
        L = ids.shape[1]
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                           pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"],
                           output_hidden_states=True).hidden_states[K]  # [1, L, D]: the input of layer K
            cols = torch.cat([kept, torch.arange(inputs["input_ids"].shape[1], L)])
            h = hidden[:, cols]
            # no cache, passed by position: transformers 5.24 renamed the argument past_key_values -> cache
            masks = create_masks_for_vision_model(
                text, h, torch.ones(1, cols.numel(), dtype=torch.long), None, None,
                block_sequence_ids=get_block_sequence_ids_for_mask(types[:, cols], h.device))
            rope = {t: lm.rotary_emb(h, cols[None], t) for t in set(text.layer_types)}
            for i in range(K, text.num_hidden_layers):
                kind = text.layer_types[i]
                h = lm.layers[i](h, None, shared_kv_states={}, position_embeddings=rope[kind],
                                 attention_mask=masks[kind], position_ids=cols[None])
            logits = model.lm_head(lm.norm(h[:, -1]))
        token = int(logits.argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        types = torch.cat([types, torch.zeros(1, 1, dtype=types.dtype)], dim=1)
    return out


@pytest.mark.parametrize("method,window", [("fastv", 24), ("dart", 24), ("fastv", 160)])
def test_pruned_layers_are_the_model_on_the_kept_sequence(method, window, images, prompts):
    """FastV / DART (one stage) with windows that cut and that do not: prefill and decoding through the hooks (full
    caches for the sliding layers, the hooks' masks) give the greedy tokens of the model run on the kept sequence."""
    model, processor = tiny(window=window)
    vlm = PrunedVLM(model, processor, method=method, budget=6)
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner, _ = _prefill(vlm, prep)
    K = pruner.stages[0].layer
    keep, alive, _ = pruner.layer_cols[K]
    got = vlm.generate(images[:1], prompts[:1], max_new_tokens=4)[0].token_ids
    inputs = PrunedVLM(model, processor, method=None).inputs(images[:1], prompts[:1])
    assert got == kept_sequence_greedy(model, inputs, keep[0][alive[0]], K, 4)


# ---- vision once, prefix once ---------------------------------------------------------------------------------------


def test_a_window_the_layout_would_exceed_falls_back_to_the_unshared_path(images, prompts):
    """With a 24-token window the prefix cache would widen what the window sees: it is not used, answers unchanged."""
    model, processor = tiny(window=24)
    vlm = PrunedVLM(model, processor, method="promprune", budget=8)
    keys, rows, questions = ["a", "a", "b"], [images[0], images[0], images[1]], [prompts[0], prompts[1], prompts[1]]
    cache = ImageCache()
    shared = vlm.generate(rows, questions, keys=keys, cache=cache, prefix_cache=True, max_new_tokens=4)
    assert not cache.prefixes and sorted(cache.images) == ["a", "b"]  # vision once still applies
    assert [g.token_ids for g in shared] == [g.token_ids for g in vlm.generate(rows, questions, max_new_tokens=4)]


def test_fits_window_by_hand():
    """Prefixes of 70 and 68 columns, suffixes of 21 and 16: the widest row spans 70 + 21 + new tokens."""
    parts = prefix.Split([torch.arange(70), torch.arange(68)], [torch.arange(21), torch.arange(16)])
    assert prefix.fits_window(parts, 160, 68)  # 159 <= 159
    assert not prefix.fits_window(parts, 160, 69)
    assert prefix.sliding_window(tiny_vlm("gemma4")[0].config) == 160
    assert prefix.sliding_window(tiny_vlm("llava")[0].config) is None


# ---- lmms-eval's gemma4 conversation --------------------------------------------------------------------------------

LMMS_GEMMA4_SYSTEM = "You are a helpful assistant."  # lmms-eval 0.7.3's gemma4 model's default system_prompt


def test_system_prompt_gives_lmms_evals_gemma4_conversation(images, prompts):
    """With ``system_prompt`` the prompt is the one lmms-eval's gemma4 model renders (a system turn with its text, then
    the user's image and question, through the processor's chat template), and the unpruned answer is plain
    transformers' on that prompt."""
    model, processor = tiny_vlm("gemma4")
    vlm = PrunedVLM(model, processor, method=None, system_prompt=LMMS_GEMMA4_SYSTEM)
    messages = [[{"role": "system", "content": [{"type": "text", "text": LMMS_GEMMA4_SYSTEM}]},
                 {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}] for p in prompts]
    texts = [processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    assert [vlm.conversation(p) for p in prompts] == texts
    assert texts[0].startswith("<bos><|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\n<|image|>")
    inputs = processor(images=[[i] for i in images], text=texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        plain = model.generate(**inputs, max_new_tokens=4, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    assert [g.token_ids for g in vlm.generate(images, prompts, max_new_tokens=4)] == plain.tolist()
    with pytest.raises(ValueError, match="'system_prompt' must be a non-empty string or None"):
        PrunedVLM(model, processor, method=None, system_prompt=" ")


def test_the_floor_is_the_fewest_soft_tokens_the_processor_gives_any_image_whatever_its_size():
    """Gemma 4 had no floor, so a PyramidDrop released budget no image can run was not refused. The count depends on
    the aspect ratio alone (save for the float rounding of a side that lands exactly on a whole cell): the
    processor's own placeholder counts for one shape at two sizes agree; the fewest is
    an image 17.5 times wider than tall (34 x 595 px: ``a`` = 2 exactly, floored on both sides to 1 x 34), which no
    other aspect ratio of a dense sweep beats (the processor's own resize rule); released 280: 139 (17 x 1190)."""
    from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

    from promprune.models.adapters import visual_token_floor
    from promprune.models.factories import model_config
    from promprune.models.options import validate_method
    from promprune.models.vlm import construction_problems

    from .conftest import make_image

    model, processor = tiny_vlm("gemma4")
    token = model.config.image_token_id

    def placeholders(h, w):
        ids = processor(images=[[make_image(h, w, 0)]], text=["<|image|>"], return_tensors="pt")["input_ids"]
        return int((ids == token).sum())

    assert placeholders(34, 595) == placeholders(68, 1190) == 34 and placeholders(340, 5950) == 70  # float, on the edge
    assert placeholders(40, 56) == placeholders(400, 560) == 63 and placeholders(8, 8) == placeholders(800, 800) == 64
    assert visual_token_floor(model.config) == 34

    def fewest(patch, most):
        counts = []
        for h in range(1, 60):
            for w in range(1, 4500):
                for a, b in ((h, w), (w, h)):
                    th, tw = get_aspect_ratio_preserving_size(a, b, patch, most * 9, 3)
                    counts.append(th // (3 * patch) * (tw // (3 * patch)))
        return min(counts)

    assert fewest(4, 70) == 34
    assert fewest(16, 280) == 139 == visual_token_floor(model_config("shape:gemma4_31b"))
    # a released PyramidDrop budget below 34 x 3 / 6 (first stage at layer 3 of 6) = 17 runs no image: refused now
    refused = construction_problems(model.config, "pyramiddrop", 16,
                                    *validate_method("pyramiddrop", 16, budget_semantics="released"), views=1)
    assert [str(p) for p in refused][0].startswith("no image can run: each gives this model at least 34 visual tokens")
    assert not construction_problems(model.config, "pyramiddrop", 17,
                                     *validate_method("pyramiddrop", 17, budget_semantics="released"), views=1)
