"""An in-LLM method of one's own (``register_in_llm_method(name, score=fn, layers=...)``): the hooks keep the visual
tokens ``fn`` scores highest at its layers, with the built-ins' masks, positions, KV cache and batching.

References, each independent of the hooks: the kept set worked out from a plain transformers forward's hidden states
(the input of layer K, ``output_hidden_states``), and the answer of a naive loop that runs layers K.. on the kept
columns alone with their original positions and no cache (``conftest.naive_greedy``, Qwen3.5's reference, here on a
LLaVA (1D RoPE) and a Qwen2.5-VL (M-RoPE)); the schedule's counts worked by hand; each batch row against itself
alone."""
from types import SimpleNamespace

import pytest
import torch

import promprune
from promprune.models import PrunedVLM, llm_hooks
from promprune.models.options import validate_method
from promprune.models.tiny import tiny_vlm
from promprune.selection import registry

from .conftest import lm_inputs, naive_greedy
from .test_in_llm_syncs import _hook_reads, counted_generate, next_rows

BUDGET = 5


def hidden_norm(inputs, *, p: float = 2.0):
    """Keep the visual tokens of largest hidden-state norm at the layer."""
    return inputs.hidden.float().norm(p=p, dim=-1)


def attention_and_keys(inputs, *, weight: float = 0.5):
    """The layer's own last-token attention plus a share of its key norms (each scaled to its row's largest)."""
    att, keys = inputs.attention(), inputs.key_norms()
    return att / att.amax(1, keepdim=True) + weight * keys / keys.amax(1, keepdim=True)


@pytest.fixture
def own():
    """Registers methods of one's own for a test (``own(name, score, **registration)``) and removes them after."""
    names = []

    def register(name, score, **kwargs):
        registry.register_in_llm_method(name, score=score, **kwargs)
        names.append(name)
        return name

    yield register
    for name in names:
        registry._REGISTRY.pop(name, None)


def _prefill_and_generate(vlm, prep, steps):
    """``(pruner, logits [B, steps, V])`` of ``generate`` under the method's hooks."""
    pruner = vlm.pruning(prep)
    with torch.inference_mode(), pruner:
        out = vlm.model.generate(**prep.model_kwargs, max_new_tokens=steps, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    return pruner, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("K", [1, 2])
def test_the_top_scored_tokens_at_layer_k_are_the_model_run_without_the_others(arch, K, own, images, prompts):
    """Layers 0..K-1 see every token; the kept ones are the BUDGET image columns of largest L2 norm of a plain
    forward's input of layer K (``hidden_states[K]``); ``generate`` under the hooks (KV cache, masks, the original
    1D / M-RoPE positions) gives, step by step, the logits of the naive loop running layers K.. on the text and those
    columns alone, and ``PrunedVLM.generate`` its greedy tokens and kept grid indices."""
    name = own("hidden_norm", hidden_norm, options={"p": 2.0})
    model, processor = tiny_vlm(arch)
    depth = len(model.model.language_model.layers)
    vlm = PrunedVLM(model, processor, method=name, budget=BUDGET, layers=[K])
    steps = 3
    for i in range(2):  # each image alone: two visual counts on Qwen2.5-VL
        prep = vlm.prepare(images[i:i + 1], prompts[i:i + 1])
        kw = prep.model_kwargs
        pruner, got = _prefill_and_generate(vlm, prep, steps)
        ids = kw["input_ids"][0]
        L = ids.shape[0]
        run = (ids == model.config.image_token_id).nonzero().flatten().tolist()
        with torch.inference_mode():
            states = model(**kw, output_hidden_states=True).hidden_states[K][0]  # [L, D]: the input of layer K
        norms = [states[c].float().norm().item() for c in run]
        kept = sorted(sorted(run, key=lambda c: (-norms[run.index(c)], c))[:BUDGET])
        keep, alive, _ = pruner.layer_cols[K]
        assert sorted(c for c in keep[0][alive[0]].tolist() if c in run) == kept
        cols = torch.tensor(sorted(set(range(L)) - set(run) | set(kept)))
        pos = kw["position_ids"][1:, 0] if "position_ids" in kw else torch.arange(L)[None]  # M-RoPE's, or 1D
        with torch.inference_mode():
            want = naive_greedy(model, lm_inputs(model, kw)["inputs_embeds"][0], pos,
                                [(0, K, torch.arange(L)), (K, depth, cols)], steps)
        torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
        out = vlm.generate(images[i:i + 1], prompts[i:i + 1], max_new_tokens=steps)[0]
        assert out.token_ids == want.argmax(-1).tolist()
        assert out.kept == sorted(run.index(c) for c in kept)  # one image: its grid is its run, in order
        assert out.layer_visual_tokens == [len(run)] * K + [BUDGET] * (depth - K)


def test_the_default_layer_is_the_registered_one_scaled_and_stages_keep_a_geometric_schedule(own, images, prompts):
    """``layers=(2,)`` (the default) of 32 scales to layer 1 of the tiny LLaVA's 4; ``layers=(8, 24)`` of 32 to 1 and
    3, which keep round(36 (5/36)^(1/2)) = 13, then the budget."""
    model, processor = tiny_vlm("llava")
    one = own("norm_one", hidden_norm)
    two = own("norm_two", hidden_norm, layers=(8, 24))
    got = PrunedVLM(model, processor, method=one, budget=BUDGET).generate(images[:1], prompts[:1],
                                                                          max_new_tokens=1)[0]
    assert got.layer_visual_tokens == [36, 5, 5, 5]
    got = PrunedVLM(model, processor, method=two, budget=BUDGET).generate(images[:1], prompts[:1],
                                                                          max_new_tokens=1)[0]
    assert got.layer_visual_tokens == [36, 13, 13, 5]
    assert llm_hooks.schedule(two, 4, BUDGET, {})[1] == [1, 3]
    assert llm_hooks.schedule(two, 4, BUDGET, {"layers": [2]})[1] == [2]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava_next"])
def test_a_batch_of_different_visual_counts_gives_each_row_what_it_gets_alone(arch, own, images, prompts):
    """Two stages (the layers' own attention and key norms) on rows of different visual token counts: dead filler
    columns and left padding change no row's tokens, kept set or per-layer counts."""
    name = own("att_keys", attention_and_keys, options={"weight": 0.5}, layers=(8, 24))
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method=name, budget=6)
    full = PrunedVLM(model, processor, method=None).prepare(images, prompts)
    assert full.stats[0]["visual_tokens"] != full.stats[1]["visual_tokens"]
    batched = vlm.generate(images, prompts, max_new_tokens=4)
    singles = [vlm.generate([img], [p], max_new_tokens=4)[0] for img, p in zip(images, prompts)]
    for got, alone in zip(batched, singles):
        assert (got.token_ids, got.kept, got.layer_visual_tokens) == \
               (alone.token_ids, alone.kept, alone.layer_visual_tokens)
        assert got.visual_tokens == 6


def test_the_stage_reads_the_device_once_at_any_batch_size_and_the_hooks_nowhere_else(own, monkeypatch):
    """The scored stage runs within the built-ins' discipline: its cut reads the device once (the candidates' counts
    and the score's non-finite count together), the score's own attention no time, at batch 1 as at 4; the per-layer
    hooks, the score included, read nothing more."""
    name = own("att_keys", attention_and_keys, options={"weight": 0.5})
    model, processor = tiny_vlm("llava_next")
    images, prompts = next_rows()
    vlm = PrunedVLM(model, processor, method=name, budget=12)
    for batch in (1, 4):
        counts, got = counted_generate(monkeypatch, vlm, batch)
        assert all(g.visual_tokens == 12 for g in got)
        assert counts["calls _prune"] == 1 and counts["_prune"] == 1, counts
        assert counts["calls _received"] == 1 and counts["_received"] == 0, counts
        hooks = _hook_reads(monkeypatch, vlm, images[:batch], prompts[:batch])
        assert hooks["stages"] == 1 and hooks["hooks"] == 1, hooks


@pytest.mark.parametrize("score, needle", [
    (lambda inputs: inputs.hidden.float().norm(dim=-1)[:, 1:],
     r"its score returned a torch.float32 tensor of shape \(1, \d+\) at layer 1; a score is a float tensor \[B, L\]"),
    (lambda inputs: inputs.columns, r"its score returned a torch.int64 tensor of shape"),
    (lambda inputs: inputs.hidden.float().norm(dim=-1).tolist(), r"its score returned a list at layer 1"),
    (lambda inputs: inputs.hidden.float().norm(dim=-1).masked_fill(inputs.visual & (inputs.columns % 2 == 0),
                                                                   float("nan")),
     r"its score gave NaN or infinite values to visual tokens at layer 1 \(batch rows \[0\]: \[18\] tokens\)"),
    (lambda inputs: inputs.hidden.float().norm(dim=-1).masked_fill(inputs.visual, float("-inf")),
     r"its score gave NaN or infinite values to visual tokens at layer 1 \(batch rows \[0\]: \[36\] tokens\)"),
])
def test_a_score_of_the_wrong_shape_or_not_finite_is_an_error_naming_the_method(score, needle, own, images, prompts):
    name = own("broken", score)
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method=name, budget=BUDGET)
    with pytest.raises(ValueError, match=r"in-LLM method 'broken': " + needle):
        vlm.generate(images[:1], prompts[:1], max_new_tokens=1)


def test_a_score_not_finite_where_no_visual_token_is_is_not_read(own, images, prompts):
    name = own("nan_text", lambda inputs: hidden_norm(inputs).masked_fill(~inputs.visual, float("nan")))
    model, processor = tiny_vlm("llava")
    got = PrunedVLM(model, processor, method=name, budget=BUDGET).generate(images[:1], prompts[:1],
                                                                           max_new_tokens=1)[0]
    assert got.visual_tokens == BUDGET


# ---- registration and options, model-free -------------------------------------------------------------------------


def test_a_scored_method_registers_its_options_beside_the_hooks_layers(own):
    name = own("hidden_norm", hidden_norm, options={"p": 2.0})
    spec = promprune.method_spec(name)
    assert spec.stage == promprune.IN_LLM and spec.options == {"layers": None, "p": 2.0}
    assert spec.description == "Keep the visual tokens of largest hidden-state norm at the layer."
    assert name in promprune.methods("in_llm") and llm_hooks.hooks_problem(name) is None
    assert validate_method(name, 8, p=1.0, layers=[2]) == ({"p": 1.0, "layers": [2]}, validate_method(None)[1])
    with pytest.raises(ValueError, match=r"unknown option\(s\) for method 'hidden_norm': 'pp' \(did you mean 'p'\?\)"):
        validate_method(name, 8, pp=1.0)
    with pytest.raises(ValueError, match=r"option 'layers' of hidden_norm must list each pruning layer once in "
                                         r"ascending order .* did you mean \[2, 3\]\?"):
        validate_method(name, 8, layers=[3, 2])
    with pytest.raises(ValueError, match="option 'p' of method 'hidden_norm' must be a finite number"):
        validate_method(name, 8, p="two")
    with pytest.raises(ValueError, match=r"hidden_norm option 'layers' must be < 4 \(LLM depth\), got \[4\]"):
        llm_hooks.stage_layers(SimpleNamespace(num_hidden_layers=4, model_type="llama"), name,
                               {"layers": [4], "p": 2.0})


@pytest.mark.parametrize("kwargs, needle", [
    (dict(name="fastv", score=hidden_norm), "method 'fastv' is already registered (one of promprune's own methods)"),
    (dict(name="divprune", score=hidden_norm), "method 'divprune' is already registered (one of promprune's own"),
    (dict(name="None", score=hidden_norm), "register_in_llm_method: 'None' names the unpruned model"),
    (dict(name="m", score=hidden_norm, options={"layers": [2]}), "option(s) ['layers'], which are taken before the "
                                                                 "method sees them ('layers': the layers it cuts"),
    # taken by PrunedVLM before the score: the adapter's options and the wrapper's arguments (the score got its own
    # default, silently), and the names the docs reserve for every method
    (dict(name="m", score=hidden_norm, options={"pad_to_square": False}), "names option(s) ['pad_to_square'], which "
                                                                          "are taken before the method sees them"),
    (dict(name="m", score=hidden_norm, options={"image_newline": "x"}), "('image_newline': an adapter option"),
    (dict(name="m", score=hidden_norm, options={"dtype": None}), "('dtype': an argument of PrunedVLM"),
    (dict(name="m", score=hidden_norm, options={"budget": 1}), "names option(s) ['budget']"),
    (dict(name="m", score=hidden_norm, options={"order": "a"}, choices={"order": ("a",)}),
     "names option(s) ['order']"),
    (dict(name="m", score=hidden_norm, options={"tokens": 1}), "names option(s) ['tokens']"),
    # a case variant of a registered name: the report labelled both "FastV"
    (dict(name="FastV", score=hidden_norm), "method 'FastV' differs only in case from 'fastv' (one of promprune's"),
    (dict(name="PromPrune", score=hidden_norm), "method 'PromPrune' differs only in case from 'promprune'"),
    (dict(name="m", score=hidden_norm, options={"q": 1.0}), "hidden_norm takes no parameter for option(s) ['q']"),
    (dict(name="m", score=hidden_norm, layers=(0,)), "argument 'layers' of register_in_llm_method must be None or a"),
    (dict(name="m", score=hidden_norm, layers=(2, 40)), "layers of method 'm' are given for a 32-layer LLM"),
    (dict(name="m", score=hidden_norm, layers=None), "layers of method 'm' are given for a 32-layer LLM"),
    (dict(name="m", score="hidden_norm"), "score of method 'm' must be a function"),
])
def test_a_registration_the_hooks_cannot_run_is_refused_as_it_registers(kwargs, needle):
    with pytest.raises(ValueError) as info:
        registry.register_in_llm_method(kwargs.pop("name"), **kwargs)
    assert needle in str(info.value)
    assert "m" not in registry._REGISTRY


def test_a_name_of_ones_own_again_needs_replace(own):
    own("again", hidden_norm)
    with pytest.raises(ValueError, match="pass replace=True to register_in_llm_method"):
        registry.register_in_llm_method("again", score=hidden_norm)
    registry.register_in_llm_method("again", score=attention_and_keys, options={"weight": 1.0}, replace=True)
    assert promprune.method_spec("again").score is attention_and_keys


def test_hybrid_layers_are_ruled_as_pyramiddrops():
    """A scored method ranks at the layer it cuts before: on Qwen3.5's linear / full layers its default moves to the
    first full-attention layer at or after it, and an explicit linear one is refused naming option 'layers'."""
    registry.register_in_llm_method("hybrid_norm", score=hidden_norm, layers=(8,))
    try:
        config = SimpleNamespace(num_hidden_layers=8, model_type="qwen3_5",
                                 layer_types=["linear_attention", "full_attention"] * 4)
        assert llm_hooks.stage_layers(config, "hybrid_norm", {"layers": None}) == ([3], [(2, 3)])
        with pytest.raises(ValueError, match=r"option 'layers' gives layer 2, which ranks the visual tokens at layer "
                                             r"2, a linear-attention layer .* Give 'layers' from \[3, 5, 7\]"):
            llm_hooks.stage_layers(config, "hybrid_norm", {"layers": [2]}, "m")
    finally:
        registry._REGISTRY.pop("hybrid_norm")
