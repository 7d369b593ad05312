"""FastV / SparseVLM inside the LLM: the right tokens, dropped at the right layer."""
import copy

import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.llm_hooks import sparsevlm_layers
from promprune.models.tiny import tiny_vlm

K = 2  # FastV's default pruning layer
BUDGET = 5


def test_fastv_keeps_top_tokens_by_last_token_attention(images, prompts):
    """Kept = top-budget visual tokens by layer K-1's last-token attention (head mean) of an eager forward."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="fastv", budget=BUDGET)
    got = vlm.generate(images[:1], prompts[:1], max_new_tokens=1)[0]
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    inputs = vlm.inputs(images[:1], prompts[:1])
    with torch.inference_mode():
        att = twin(**inputs, output_attentions=True).attentions[K - 1]  # [1, H, L, L]
    run = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    scores = att[0, :, -1, run].mean(0)  # [N]
    assert got.kept == sorted(scores.topk(BUDGET).indices.tolist())


@pytest.mark.parametrize("method", ["fastv", "sparsevlm"])
def test_layers_after_pruning_see_fewer_tokens(method, images, prompts):
    model, processor = tiny_vlm("llava")
    layers = model.model.language_model.layers
    seen = {}

    def recorder(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, kwargs["hidden_states"].shape[1])  # first call = prefill
        return hook

    hooks = [layers[i].self_attn.register_forward_pre_hook(recorder(i), with_kwargs=True)
             for i in range(len(layers))]
    try:
        PrunedVLM(model, processor, method=method, budget=BUDGET).generate(images[:1], prompts[:1],
                                                                           max_new_tokens=2)
    finally:
        for h in hooks:
            h.remove()
    full = seen[0]
    n_visual = 36
    at = [K] if method == "fastv" else sparsevlm_layers(len(layers))
    assert all(seen[i] == full for i in range(at[0]))
    assert all(seen[i] == full - n_visual + BUDGET for i in range(at[-1], len(layers)))
    lengths = [seen[i] for i in range(len(layers))]
    assert lengths == sorted(lengths, reverse=True)  # stages only ever drop tokens


def test_sparsevlm_layers_scale_with_depth():
    assert sparsevlm_layers(32) == [2, 6, 15]
    assert sparsevlm_layers(4) == [1, 2]
    assert sparsevlm_layers(28) == [2, 5, 13]


def test_in_llm_rejects_flash_attention():
    vlm = PrunedVLM.from_pretrained("tiny:llava", method="fastv", budget=4)
    vlm.model.config.text_config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa' or 'eager'"):
        vlm.pruning(vlm.prepare([__import__("PIL.Image").Image.new("RGB", (8, 8))], ["q"]))


def test_in_llm_rejects_beam_search(images, prompts):
    model, processor = tiny_vlm("llava")
    with pytest.raises(ValueError, match="num_beams=1"):
        PrunedVLM(model, processor, method="fastv", budget=4).generate(images, prompts, max_new_tokens=2,
                                                                       num_beams=2)


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("method", ["fastv", "sparsevlm"])
def test_eager_llm_full_budget_and_pruned_match_sdpa(arch, method, images, prompts):
    """The masks handed to later layers work for eager (additive float) as for SDPA (boolean)."""
    sdpa = PrunedVLM.from_pretrained(f"tiny:{arch}", method=method, budget=BUDGET)
    eager = PrunedVLM.from_pretrained(f"tiny:{arch}", method=method, budget=BUDGET, attn_implementation="eager")
    logits = []
    for vlm in (sdpa, eager):
        prep = vlm.prepare(images, prompts)
        with torch.inference_mode(), vlm.pruning(prep):
            logits.append(vlm.model(**prep.model_kwargs).logits[:, -1])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-4)
    a = sdpa.generate(images, prompts, max_new_tokens=4)
    b = eager.generate(images, prompts, max_new_tokens=4)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_sparsevlm_released_schedule_keeps_the_released_counts(images, prompts):
    """64 -> 66 / 30 / 17 tokens after SparseVLM's three pruning layers (its score.py); the tiny LLaVA has 36."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="sparsevlm", budget=64, schedule="released", layers=[1, 2, 3],
                    recycle_ratio=0.0)
    out = vlm.generate(images, prompts, max_new_tokens=2)
    assert [g.visual_tokens for g in out] == [17, 17]
    with pytest.raises(ValueError, match="released schedule has budgets \\[64, 96, 128, 192\\], not 32"):
        PrunedVLM(model, processor, method="sparsevlm", budget=32, schedule="released",
                  layers=[1, 2, 3]).generate(images, prompts, max_new_tokens=1)
