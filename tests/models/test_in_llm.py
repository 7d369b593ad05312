"""FastV / SparseVLM inside the LLM: the right tokens, dropped at the right layer."""
import copy
import inspect

import pytest
import torch
import transformers

import promprune
from promprune.models import PrunedVLM, llm_hooks
from promprune.models.llm_hooks import CACHE_ARGUMENTS, fastv_layer, sparsevlm_layers
from promprune.models.tiny import tiny_vlm

K = 1  # FastV's default pruning layer on the tiny 4-layer LLMs: the paper's 2 of 32, scaled
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


@pytest.mark.parametrize("method, options", [("fastv", {}), ("fastv", {"layer": 2}), ("sparsevlm", {})])
def test_layers_after_pruning_see_fewer_tokens(method, options, images, prompts):
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
        PrunedVLM(model, processor, method=method, budget=BUDGET, **options).generate(images[:1], prompts[:1],
                                                                                      max_new_tokens=2)
    finally:
        for h in hooks:
            h.remove()
    full = seen[0]
    n_visual = 36
    at = [options.get("layer", K)] if method == "fastv" else sparsevlm_layers(len(layers))
    assert all(seen[i] == full for i in range(at[0]))
    assert all(seen[i] == full - n_visual + BUDGET for i in range(at[-1], len(layers)))
    lengths = [seen[i] for i in range(len(layers))]
    assert lengths == sorted(lengths, reverse=True)  # stages only ever drop tokens


def test_fastv_layer_scales_with_depth():
    """K = 2 of 32 as a fraction of the depth, rounded half to even: 2 on the 7B LLMs (LLaMA 32, Qwen2 28, Qwen3 36)
    and LLaVA-1.5-13B's 40 (2.5 -> 2), 1 on the tiny and testbed 4-layer LLMs."""
    assert [fastv_layer(d) for d in (32, 28, 36, 40, 24, 16, 4, 2)] == [2, 2, 2, 2, 2, 1, 1, 1]


def test_fastv_explicit_layer_is_absolute(images, prompts):
    model, processor = tiny_vlm("llava")
    default = PrunedVLM(model, processor, method="fastv", budget=BUDGET)
    explicit = PrunedVLM(model, processor, method="fastv", budget=BUDGET, layer=2)
    for vlm, layer in ((default, K), (explicit, 2)):
        assert vlm.pruning(vlm.prepare(images[:1], prompts[:1])).stages[0].layer == layer
    with pytest.raises(ValueError, match=r"fastv option 'layer' must be in \[1, 3\], got 4"):
        PrunedVLM(model, processor, method="fastv", budget=BUDGET, layer=4).generate(images[:1], prompts[:1],
                                                                                    max_new_tokens=1)


def test_sparsevlm_layers_scale_with_depth():
    """The layers cut before: the released code (Gumpest/SparseVLMs@26a5f48, pruning_loc [2, 6, 15]) runs each of its
    pruning layers on every token, ranks with that layer's own attention and prunes its output."""
    assert sparsevlm_layers(32) == [3, 7, 16]
    assert sparsevlm_layers(4) == [2, 3]  # ranks 0.25, 0.75, 1.875 -> 1, 1, 2
    assert sparsevlm_layers(28) == [3, 6, 14]  # ranks 1.75, 5.25, 13.1 -> 2, 5, 13
    assert sparsevlm_layers(2) == [1]  # a layer must follow the ranking layer


@pytest.mark.parametrize("method", ["sparsevlm", "pyramiddrop"])
def test_layers_must_be_ascending_and_distinct(method):
    """Option 'layers' names one stage per layer: [3, 2] ran as [2, 3] and [2, 2] collapsed two stages into one cut,
    without a word. Refused as [0, 1] and [1.5] are, with the ascending list it may have meant."""
    spec = promprune.method_spec(method)
    for layers, hint in (([3, 2], r"\[2, 3\]"), ([2, 2], r"\[2\]"), ((2, 4, 3), r"\[2, 3, 4\]")):
        with pytest.raises(ValueError, match=rf"option 'layers' of {method} must list each pruning layer once in "
                                             rf"ascending order .* got \[.*\]; did you mean {hint}\?"):
            spec.resolve({"layers": layers}, budget=8)
    for layers in ([0, 1], [1.5]):
        with pytest.raises(ValueError, match=f"option 'layers' of {method} must be None or a list of ints >= 1"):
            spec.resolve({"layers": layers}, budget=8)
    _, at, _, layer_map = llm_hooks.schedule(method, 8, 8, {"layers": [2, 5]})  # an 8-layer LLM
    assert at == [2, 5] and layer_map == [(2, 2), (5, 5)]
    assert llm_hooks.schedule(method, 4, 8, {})[1] == sorted(set(llm_hooks.schedule(method, 4, 8, {})[1]))


@pytest.mark.parametrize("method, layers_32, kept_32", [
    ("fastv", [2], [64]),  # FastV's K = 2 of LLaMA's 32 layers, then the budget
    ("dart", [2], [64]),  # DART prunes where FastV does; budget_semantics "exact"
    ("sparsevlm", [3, 7, 16], [66, 30, 17]),  # cut after the released layers 2, 6, 15; its counts for 64
    ("pyramiddrop", [8, 16, 24], [256, 128, 64]),  # 64 / 0.5^(3 - s), "exact"
])
def test_schedule_at_32_layers_and_make_agree(method, layers_32, kept_32, images, prompts):
    """llm_hooks.schedule without a model: the released layers and kept counts on a 32-layer LLM (576 visual
    tokens, budget 64); on a real model the pruner make() builds prunes before exactly the layers schedule gives."""
    from promprune.models import llm_hooks

    options = {"schedule": "released"} if method == "sparsevlm" else {}
    _, at, plan, _ = llm_hooks.schedule(method, 32, 64, options)
    assert (at, plan(576)) == (layers_32, kept_32)
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method=method, budget=BUDGET)
    stages = vlm.pruning(vlm.prepare(images[:1], prompts[:1])).stages
    assert [stage.layer for stage in stages] == llm_hooks.schedule(method, 4, BUDGET, {})[1]


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


@pytest.mark.parametrize("kwargs, needle", [
    ({"use_cache": False}, "use_cache=False is refused"),
    ({"cache_implementation": "static"}, "cache_implementation='static' is refused"),
    ({"cache_implementation": "sliding_window"}, "cache_implementation='sliding_window' is refused"),
    ({"generation_config": transformers.GenerationConfig(use_cache=False)}, "use_cache=False is refused"),
    ({"num_beams": 2}, "num_beams must be 1, got 2"),
])
def test_in_llm_refuses_generate_without_a_dynamic_cache_up_front(kwargs, needle, images, prompts, monkeypatch):
    """use_cache=False failed at the first decoding step with a misleading "ran 56 new tokens without a cache the
    hooks can read ... passed under a name other than cache or past_key_values", a static cache with a bare "The
    size of tensor a (58) must match the size of tensor b (27)". Now a plain refusal naming the kwarg, before the
    images are even prepared. Pre-LLM methods and the unpruned model answer the same with either."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="fastv", budget=4)
    monkeypatch.setattr(vlm, "prepare", lambda *a, **k: pytest.fail("prepared before the refusal"))
    with pytest.raises(ValueError, match=rf"in-LLM method 'fastv' prunes inside the language model .*{needle}"):
        vlm.generate(images, prompts, max_new_tokens=2, **kwargs)
    monkeypatch.undo()
    assert [g.visual_tokens for g in vlm.generate(images, prompts, max_new_tokens=2,
                                                  cache_implementation="dynamic")] == [4, 4]
    if "num_beams" in kwargs or "generation_config" in kwargs:
        return
    for method, budget in [("divprune", 4), (None, None)]:
        plain = PrunedVLM(model, processor, method=method, budget=budget)
        want = [g.token_ids for g in plain.generate(images, prompts, max_new_tokens=3)]
        assert [g.token_ids for g in plain.generate(images, prompts, max_new_tokens=3, **kwargs)] == want


@pytest.mark.parametrize("method, budget", [("divprune", 4), (None, None), ("fastv", 4)])
@pytest.mark.parametrize("given", ["kwarg", "generation_config"])
def test_a_paged_cache_is_refused_by_name_for_every_method(method, budget, given, images, prompts, monkeypatch):
    """cache_implementation="paged" makes transformers' generate switch to continuous batching (generate_batch),
    which takes the prompts' token ids only: pixel values and the pruned encoder outputs never reached the LLM, and
    the tiny model's run returned no token at all (an inference-mode error logged by the batching thread), so a
    pre-LLM method or the unpruned model answered "" silently (in a generation_config transformers ignores it and
    runs the dynamic cache: not the cache asked for). Refused by name now, either way, before the images are
    prepared, by the one check every method shares (an in-LLM method was refused as if paged were a static cache)."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method=method, budget=budget)
    kwargs = {"cache_implementation": "paged"} if given == "kwarg" else \
        {"generation_config": transformers.GenerationConfig(cache_implementation="paged", max_new_tokens=2)}
    monkeypatch.setattr(vlm, "prepare", lambda *a, **k: pytest.fail("prepared before the refusal"))
    with pytest.raises(ValueError, match=r"^cache_implementation='paged' is refused: .*continuous batching "
                                         r"\(generate_batch\), which reads only the prompt's token ids"):
        vlm.generate(images, prompts, max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
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


# ---- the LLM's cache argument: past_key_values (transformers <= 5.23) or cache (5.24 on) ---------------------------


def _renamer(dst: str):
    """A forward pre-hook passing the LLM's KV cache on under the name ``dst``, whatever name it came under."""
    def hook(module, args, kwargs):
        for name in [*CACHE_ARGUMENTS, "kv_cache"]:
            if name in kwargs and name != dst:
                kwargs[dst] = kwargs.pop(name)
        return args, kwargs
    return hook


def _generate_with_cache_named(vlm, prep, name: str, new_tokens: int):
    """``generate`` with the pruning hooks seeing the cache under ``name`` (as a transformers release that passes it
    so would call them); the LLM's own forward gets it back under the name its signature takes."""
    lm = vlm.model.model.language_model
    own = next(n for n in CACHE_ARGUMENTS if n in inspect.signature(lm.forward).parameters)
    pruner = vlm.pruning(prep)
    before = lm.register_forward_pre_hook(_renamer(name), with_kwargs=True)  # runs before the pruner's hook
    try:
        with torch.inference_mode(), pruner:
            after = lm.register_forward_pre_hook(_renamer(own), with_kwargs=True)
            try:
                out = vlm.model.generate(**prep.model_kwargs, max_new_tokens=new_tokens, do_sample=False)
            finally:
                after.remove()
    finally:
        before.remove()
    return pruner.stats(prep.items), out[:, prep.model_kwargs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("name", CACHE_ARGUMENTS)
@pytest.mark.parametrize("method", ["fastv", "sparsevlm", "dart", "pyramiddrop"])
def test_hooks_read_the_cache_under_either_name(name, method, images, prompts):
    """transformers 5.24 passes the LLM's cache as ``cache``, 5.23 as ``past_key_values``: the kept tokens, their
    count and the answer are the same under both (5.24 under the old hook: visual_tokens 0 / a crash in SparseVLM)."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method=method, budget=BUDGET)
    want = vlm.generate(images, prompts, max_new_tokens=3)
    stats, tokens = _generate_with_cache_named(vlm, vlm.prepare(images, prompts), name, 3)
    assert [s["visual_tokens"] for s in stats] == [g.visual_tokens for g in want] == [BUDGET, BUDGET]
    assert [s["kept"] for s in stats] == [g.kept for g in want]
    assert tokens == [g.token_ids for g in want]


def test_a_cache_under_an_unknown_name_fails_at_the_first_decoding_step(images, prompts):
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="fastv", budget=BUDGET)
    with pytest.raises(RuntimeError, match="1 new tokens without a cache the hooks can read"):
        _generate_with_cache_named(vlm, vlm.prepare(images, prompts), "kv_cache", 2)


def test_an_llm_forward_without_a_known_cache_argument_is_refused_at_once(images, prompts, monkeypatch):
    """A release whose LLM forward takes neither name: PrunedVLM, make() and entering the hooks refuse it in one
    paragraph naming the transformers version, the class and the argument."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="fastv", budget=BUDGET)
    prep = vlm.prepare(images[:1], prompts[:1])
    pruner = vlm.pruning(prep)
    lm = model.model.language_model

    def forward(inputs_embeds=None, attention_mask=None, kv_state=None, **kwargs):  # a future signature
        raise AssertionError("never called")

    monkeypatch.setattr(lm, "forward", forward)
    want = (rf"in-LLM method 'fastv' cannot hook this language model: LlamaModel.forward \(transformers "
            rf"{transformers.__version__}\) takes no argument 'cache' / 'past_key_values'")
    with pytest.raises(ValueError, match=want):
        PrunedVLM(model, processor, method="fastv", budget=BUDGET)
    with pytest.raises(ValueError, match=want):
        vlm.pruning(prep)
    with pytest.raises(ValueError, match="kv_state"):  # its arguments are listed
        pruner.__enter__()
    assert not pruner.handles
    PrunedVLM(model, processor, method="divprune", budget=BUDGET)  # pre-LLM methods do not hook the LLM


IN_LLM_PRECISION_PROBE = """
import sys, torch
from PIL import Image
from promprune.models import PrunedVLM, llm_hooks
torch.backends.cuda.matmul.allow_tf32 = True  # the process asks for TF32
seen = []
def watch(name):
    static = isinstance(llm_hooks.InLLMPruner.__dict__[name], staticmethod)
    original = getattr(llm_hooks.InLLMPruner, name)
    def wrapped(*args, **kwargs):
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return original(*args, **kwargs)
    setattr(llm_hooks.InLLMPruner, name, staticmethod(wrapped) if static else wrapped)
for name in ("_received", "_key_norms", "_prune"):
    watch(name)
vlm = PrunedVLM.from_pretrained("tiny:llava", method=sys.argv[1], budget=4)
vlm.generate([Image.new("RGB", (64, 48), (90, 30, 10))], ["What is it?"], max_new_tokens=2)
print(sorted(set(seen)), len(seen) > 0, torch.backends.cuda.matmul.allow_tf32)
"""


@pytest.mark.parametrize("method", ["fastv", "sparsevlm", "pyramiddrop", "dart"])
def test_in_llm_scores_run_at_full_precision_where_the_process_turned_tf32_on(method):
    """The in-LLM methods' own float32 products (FastV / SparseVLM / PyramidDrop's attention recomputed in float32,
    DART's key norms and similarities) run at full precision in a process that asked for TF32, as ``select``'s do
    (``accel.full_float32``); the process reads its setting back afterwards. In a child process (torch's precision
    APIs, once mixed, refuse some reads)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", IN_LLM_PRECISION_PROBE, method], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['ieee'] True True"
