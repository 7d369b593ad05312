"""Efficiency formulas against the paper's Table 6 and against independent counts on a real transformers model."""

import os
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaModel

from promprune.efficiency import (
    MIB,
    Stopwatch,
    decode_flops,
    dtype_bytes,
    kv_cache_bytes,
    layer_prefill_flops,
    lm_head_flops,
    measure_ms,
    peak_memory_mb,
    prefill_flops,
    reset_peak_memory,
    text_shape,
    vision_flops,
)

# Vicuna-7B, the text model of LLaVA-NeXT-7B (Table 6)
VICUNA_7B = LlamaConfig(
    hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32, vocab_size=32000
)
# the paper states no text-token count; 62 is derived: the one count whose FLOPs round to both published numbers
# (test_table6_text_tokens_are_derived_from_both_published_flops)
TABLE6_TEXT_TOKENS = 62


@pytest.mark.parametrize("visual_tokens, tflops", [(2880, 42.6), (320, 5.02)])
def test_prefill_flops_reproduce_table6(visual_tokens, tflops):
    flops = prefill_flops(VICUNA_7B, visual_tokens + TABLE6_TEXT_TOKENS)
    assert float(f"{flops / 1e12:.3g}") == tflops


def test_table6_text_tokens_are_derived_from_both_published_flops():
    """62 is not in the paper: of 0-500 text tokens, 57-62 give 42.6 T at 2880 visual tokens, 62 alone 5.02 T at 320."""
    def rounds_to(visual_tokens, tflops):
        return {t for t in range(501) if float(f"{prefill_flops(VICUNA_7B, visual_tokens + t) / 1e12:.3g}") == tflops}

    assert rounds_to(2880, 42.6) == set(range(57, 63))
    assert rounds_to(320, 5.02) == {TABLE6_TEXT_TOKENS}


def test_prefill_flops_hand_worked_vicuna():
    # 2L(4nd^2 + 2n^2 d + 3ndm) written out for n = 2942
    n, d, m, L = 2942, 4096, 11008, 32
    assert prefill_flops(VICUNA_7B, n) == 2 * L * (4 * n * d * d + 2 * n * n * d + 3 * n * d * m)


@pytest.mark.parametrize("visual_tokens, mb", [(2880, 1440.0), (320, 160.0)])
def test_kv_cache_reproduces_table6(visual_tokens, mb):
    assert kv_cache_bytes(VICUNA_7B, visual_tokens, torch.float16) / MIB == mb
    assert kv_cache_bytes(VICUNA_7B, visual_tokens, "fp16") == 2880 * 2 * 32 * 4096 * 2 * visual_tokens // 2880


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_prefill_flops_equal_torch_flop_counter_on_real_llama(kv_heads):
    """torch's FlopCounterMode on a real (tiny) LlamaModel forward counts the same FLOPs, GQA included.

    Eager attention: its two attention products are plain matmuls, which every torch release counts; whether the
    counter sees inside a fused SDPA kernel depends on the torch release and the backend (CPU SDPA counted 0 in some).
    """
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=100,
    )
    assert prefill_flops(cfg, 37) == eager_flops(LlamaModel(cfg), 37)


def eager_flops(model, n: int) -> int:
    """What torch's FLOP counter counts in one eager forward of ``model`` (a text model of vocabulary 100) on ``n``
    random tokens."""
    model.eval().set_attn_implementation("eager")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 100, (1, n)))
    return counter.get_total_flops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_equal_real_cache(dtype):
    """The bytes held by a real DynamicCache after a prefill equal the formula (GQA: 2 of 4 heads)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100,
    )
    model = LlamaModel(cfg).to(dtype).eval()
    n = 11
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, n)), use_cache=True).past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv_cache_bytes(cfg, n, dtype) == held


def test_full_vlm_config_uses_its_text_config():
    class VLMConfig:
        text_config = VICUNA_7B

    assert prefill_flops(VLMConfig(), 100) == prefill_flops(VICUNA_7B, 100)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="intermediate_size"):
        text_shape({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="n_tokens"):
        prefill_flops(VICUNA_7B, -1)
    with pytest.raises(ValueError, match="n_tokens"):
        kv_cache_bytes(VICUNA_7B, 2.5)
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("fp12")
    assert dtype_bytes("bf16") == 2 and dtype_bytes(torch.float32) == 4


def test_stopwatch_and_measure_on_cpu():
    with Stopwatch("cpu") as sw:
        time.sleep(0.02)
    assert 15 <= sw.ms < 2000
    calls = []
    times = measure_ms(lambda: calls.append(1), device="cpu", warmup=2, repeats=3)
    assert len(times) == 3 and len(calls) == 5 and all(t >= 0 for t in times)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_cpu_peak_memory_is_the_windows_not_the_processs_lifetime_high_water_mark():
    """On CPU the peak was the process's ru_maxrss, which reset_peak_memory could not reset: on a warm worker every
    later trial's peak_mem_gb was the high-water mark of the model load and of the hungriest trial before it. Now a
    window after a 512 MiB array was freed reports less than the window that held it (the array's pages, touched:
    resident), and both at least what the process holds now."""
    reset_peak_memory("cpu")
    held = bytearray(512 * MIB)
    held[::4096] = b"\1" * len(held[::4096])  # every page touched: resident
    hungry = peak_memory_mb("cpu")
    del held
    reset_peak_memory("cpu")
    light = peak_memory_mb("cpu")
    assert hungry >= light + 400 and light > 10  # torch loaded: far more than 10 MiB resident


def test_cpu_peak_memory_is_none_without_a_window(monkeypatch):
    """Where the peak cannot be reset (not Linux, /proc/self/clear_refs not writable) there is no CPU peak to give:
    None, not the process's lifetime high-water mark."""
    from promprune import efficiency

    monkeypatch.setattr(efficiency, "CLEAR_REFS", "/nonexistent/clear_refs")
    reset_peak_memory("cpu")
    assert peak_memory_mb("cpu") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stopwatch_and_peak_memory_on_cuda():
    reset_peak_memory("cuda")
    with Stopwatch("cuda") as sw:
        x = torch.empty(256 * MIB // 4, device="cuda")
        x.fill_(1.0)
    assert sw.ms > 0
    assert peak_memory_mb("cuda") >= 256


def test_a_cached_past_adds_only_its_attention_columns():
    # n new tokens over `past` cached ones: 2L * 2 * n * past * d more than the same n alone
    n, past, d, L = 30, 580, 4096, 32
    assert prefill_flops(VICUNA_7B, n, past) - prefill_flops(VICUNA_7B, n) == 2 * L * 2 * n * past * d
    assert prefill_flops(VICUNA_7B, n, 0) == prefill_flops(VICUNA_7B, n)


def test_decode_flops_hand_worked():
    # N new tokens after a prompt of c: the prefill yields the first, N - 1 one-token forwards follow, step t over
    # c + t + 1 keys: 2L * sum_t (4d^2 + 3dm + 2(c + t + 1)d)
    c, N, d, m, L = 600, 4, 4096, 11008, 32
    expected = 2 * L * sum(4 * d * d + 3 * d * m + 2 * (c + t + 1) * d for t in range(N - 1))
    assert decode_flops(VICUNA_7B, c, N) == expected
    assert decode_flops(VICUNA_7B, c, 1) == 0  # the prefill's forward made the only token
    assert lm_head_flops(VICUNA_7B, 3) == 2 * 3 * d * 32000


def test_vision_flops_hand_worked_llava15():
    """CLIP ViT-L/14 at 336 px (24 layers, 577 tokens with the CLS, width 1024, MLP 4096) and LLaVA-1.5's two-layer
    projector into 4096: 406 GFLOP per image, a twentieth of the LLM's prefill of 600 tokens."""
    from promprune.models.shapes import shape_vlm

    config = shape_vlm("llava_1_5_7b", device="meta")[0].config
    n, dv, mv, layers, d = 577, 1024, 4096, 24, 4096
    per_layer = n * dv * 3 * dv + n * dv * dv + 2 * n * n * dv + 2 * n * dv * mv
    macs = 576 * 3 * 14 * 14 * dv + layers * per_layer + 576 * (dv * d + d * d)
    assert vision_flops(config) == 2 * macs
    assert round(vision_flops(config) / 1e9) == 406
    assert vision_flops(config, views=5) == 5 * vision_flops(config)
    qwen = shape_vlm("qwen2_5_vl_7b", device="meta")[0].config
    with pytest.raises(ValueError, match="modelled for the LLaVA family's CLIP / SigLIP towers"):
        vision_flops(qwen)


# ---- LLMs whose layers differ: Gemma 4's sliding-window and full-attention layers ------------------------------------

def _gemma4_text(**overrides):
    """A small Gemma 4 text config: layers S F S F, the full ones with 2 x wider heads, one KV head, keys as values."""
    from transformers import Gemma4TextConfig

    fields = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                  attention_k_eq_v=True, sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
                  hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    return Gemma4TextConfig(**{**fields, **overrides})


def test_windowed_layers_hand_worked():
    """Two layers, d = 8, 2 heads; sliding: head 4, 1 KV head, window 4; full: head 8, 1 KV head, keys as values;
    MLP 16; n = 6. Sliding MACs: 6*8*(8 + 2*4) + 6*8*8 + 2*6*4*8 + 3*6*8*16 = 768 + 384 + 384 + 2304 = 3840; full:
    6*8*(16 + 8) + 6*16*8 + 2*6*6*16 + 2304 = 1152 + 768 + 1152 + 2304 = 5376. KV (2 bytes): the sliding layer keeps
    window - 1 = 3 tokens: 2*3*4*2 = 48; the full one 6: 2*6*8*2 = 192."""
    config = dict(hidden_size=8, num_hidden_layers=2, intermediate_size=16, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=4, global_head_dim=8, num_global_key_value_heads=1,
                  attention_k_eq_v=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert prefill_flops(config, 6) == 2 * (3840 + 5376)
    assert kv_cache_bytes(config, 6, torch.float16) == 48 + 192
    with pytest.raises(ValueError, match="pass layer=<index>"):
        layer_prefill_flops(config, 6)
    assert layer_prefill_flops(config, 6, layer=0) == 2 * 3840


@pytest.mark.parametrize("visual_tokens, mib", [(280, 240.625), (1120, 886.71875)])
def test_gemma4_31b_kv_cache_hand_worked(visual_tokens, mib):
    """bf16. 50 sliding layers of 16 KV heads x 256, 10 full of 4 x 512: 280 tokens: 50 * 2*280*16*256*2 +
    10 * 2*280*4*512*2 = 229,376,000 + 22,937,600 bytes; 1120 tokens: the sliding layers hold 1023 (the window,
    1024, less one): 50 * 2*1023*16*256*2 + 10 * 2*1120*4*512*2 = 838,041,600 + 91,750,400."""
    from promprune.models.shapes import load, shape_spec

    assert kv_cache_bytes(load.config("gemma4_31b"), visual_tokens, torch.bfloat16) / MIB == mib
    text = shape_spec("gemma4_31b")["text_config"]  # the config.json fields, as a dict
    text = {**text, "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(60)]}
    assert kv_cache_bytes(text, visual_tokens, "bf16") / MIB == mib


def test_gemma4_31b_prefill_hand_worked():
    """280 visual + 62 text tokens (all inside the 1024 window). Sliding: q 32 x 256, k / v 16 x 256; full: q 32 x 512,
    k 4 x 512, no v; MLP 21504 (GeGLU, three matrices)."""
    from promprune.models.shapes import load

    n, d, m = 342, 5376, 21504
    sliding = n * d * (8192 + 2 * 4096) + n * 8192 * d + 2 * n * n * 8192 + 3 * n * d * m
    full = n * d * (16384 + 2048) + n * 16384 * d + 2 * n * n * 16384 + 3 * n * d * m
    assert prefill_flops(load.config("gemma4_31b"), n) == 2 * (50 * sliding + 10 * full)


def test_gemma4_e2b_counts_no_cache_for_its_shared_layers():
    """E2B, 280 tokens, bf16: only layers 0-14 cache (the last 20 borrow theirs): 12 sliding of 1 x 256 and 3 full of
    1 x 512 (keys not values there): 12 * 2*280*256*2 + 3 * 2*280*512*2 = 3,440,640 + 1,720,320 bytes."""
    from promprune.models.shapes import load

    assert kv_cache_bytes(load.config("gemma4_e2b"), 280, torch.bfloat16) == 3_440_640 + 1_720_320


def test_windowed_kv_cache_bytes_equal_a_real_gemma4_cache():
    """A real Gemma4TextModel's DynamicCache after a prefill of 11 tokens with an 8-token window: the sliding layers
    hold 7, the full ones 11, each its own width."""
    from transformers import Gemma4TextModel

    torch.manual_seed(0)
    cfg = _gemma4_text(sliding_window=8)
    model = Gemma4TextModel(cfg).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, 11)), use_cache=True).past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv_cache_bytes(cfg, 11, torch.float32) == held


@pytest.mark.parametrize("method", [None, "fastv"])
def test_kv_cache_bytes_equal_what_a_gemma4_generate_holds(method):
    """A probe's case: under an in-LLM method the sliding-window layers' caches are plain DynamicLayers that keep every
    kept column (the hooks' ``_full_cache``), so a sliding layer's window no longer caps what it holds, and the logged
    KV bytes under-reported once a layer held more than the window (103936 bytes held, 81920 counted here). Measured:
    the key and value tensors transformers' cache holds after ``generate`` on the tiny Gemma 4 with a 40-token window
    (the prompt: 39 text tokens and 64 visual; 3 new tokens, the last never fed back, so 2 more cached)."""
    import copy

    import numpy as np
    from PIL import Image

    from pipelines.run.workers import add_efficiency
    from promprune.models import PrunedVLM
    from promprune.models.tiny import tiny_vlm
    from promprune.records import Prediction

    model, processor = tiny_vlm("gemma4")
    model = copy.deepcopy(model)
    model.config.text_config.sliding_window = 40
    vlm = PrunedVLM(model, processor, method=method, budget=8 if method else None)
    image = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
    caches = []  # the cache each forward of the LLM returns: after generate, the last one holds the whole run
    hook = model.model.language_model.register_forward_hook(lambda m, a, out: caches.append(out.past_key_values))
    try:
        g = vlm.generate([image], ["What is in the image?"], max_new_tokens=3)[0]
    finally:
        hook.remove()
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in caches[-1].layers)
    config = model.config.get_text_config()
    n_layers = config.num_hidden_layers
    visual = g.layer_visual_tokens or [g.visual_tokens] * n_layers
    cached = [layer.keys.shape[-2] for layer in caches[-1].layers]
    if method is None:  # transformers' own sliding layers keep the last window - 1 tokens
        assert cached == [39, 105] * 3 and g.visual_tokens == 64
        assert kv_cache_bytes(config, g.visual_tokens + g.text_tokens + 2, model.dtype) == held
    else:  # every column each layer kept: FastV cuts after layer 2
        assert [n - g.text_tokens - 2 for n in cached] == visual == [64, 64, 8, 8, 8, 8]
        assert kv_cache_bytes(config, [v + g.text_tokens + 2 for v in visual], model.dtype, windowed=False) == held
        assert kv_cache_bytes(config, [v + g.text_tokens + 2 for v in visual], model.dtype) < held  # the old count
    # the pipeline's per-sample count, the visual columns only (Table 6): each layer's visual tokens at its width in
    # the cache above; an unpruned sliding layer at most window - 1 = 39 of them, FastV's layer 0 all 64
    pred = add_efficiency(vlm, Prediction(task="t", doc_id=0, n_docs=1, prompt="q", visual_tokens=g.visual_tokens,
                                          text_tokens=g.text_tokens, layer_visual_tokens=g.layer_visual_tokens))
    widths = [2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size() for layer in caches[-1].layers]
    kept = [v if method or i % 2 else min(v, 39) for i, v in enumerate(visual)]
    assert pred.kv_cache_bytes == sum(k * w for k, w in zip(kept, widths))


def test_windowed_prefill_flops_equal_torch_flop_counter_on_a_real_gemma4():
    """Eager Gemma 4 text layers (window wider than the prompt: the eager kernel computes every score it masks)."""
    from transformers import Gemma4TextModel

    cfg = _gemma4_text()
    assert prefill_flops(cfg, 37) == eager_flops(Gemma4TextModel(cfg), 37)


@pytest.mark.parametrize("method", ["fastv", "pyramiddrop"])
def test_an_in_llm_methods_flops_and_cache_count_each_layer_on_its_own_tokens(method):
    """A probe's case: FastV's trials logged the FLOPs and KV cache of a pre-LLM pruner at its budget, though its
    first layers run on (and cache) every visual token: its "(-x%)" against unpruned was inflated. Each layer's
    visual tokens, seen by a hook on the layer's MLP (one row: the cut columns leave the sequence), are what the
    generation reports and what the worker's accounting sums layer by layer."""
    import numpy as np
    from PIL import Image

    from pipelines.run.workers import add_efficiency
    from promprune.models import PrunedVLM
    from promprune.records import Prediction

    image = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
    vlm = PrunedVLM.from_pretrained("tiny:llava", method=method, budget=4)
    layers = vlm.model.model.language_model.layers
    seen = []
    # the MLP's input: the sequence the layer ran on, after the pruner's own hook on the layer cut it
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])) for layer in layers]
    try:
        g = vlm.generate([image], ["What is in the image?"], max_new_tokens=1)[0]
    finally:
        for h in hooks:
            h.remove()
    observed = [n - g.text_tokens for n in seen[:len(layers)]]  # the prefill's pass
    assert g.layer_visual_tokens == observed and observed[0] > observed[-1] == g.visual_tokens == 4
    config = vlm.model.config.get_text_config()
    pred = add_efficiency(vlm, Prediction(task="t", doc_id=0, n_docs=1, prompt="q", visual_tokens=g.visual_tokens,
                                          text_tokens=g.text_tokens, layer_visual_tokens=g.layer_visual_tokens))
    per_layer = [prefill_flops(config, n) / len(layers) for n in seen[:len(layers)]]  # every layer the same shape
    assert pred.prefill_flops == pytest.approx(sum(per_layer), rel=1e-12)
    assert pred.prefill_flops > prefill_flops(config, g.visual_tokens + g.text_tokens)  # what it logged before
    assert pred.kv_cache_bytes == sum(kv_cache_bytes(config, n, vlm.model.dtype) for n in observed) / len(layers)


def test_stopwatch_on_cuda_waits_only_when_read(monkeypatch):
    """On CUDA the region's end is an event recorded without a wait (``PrunedVLM.prepare`` times its vision and
    selection stages this way: a wait there stalled the host twice a batch); ``ms`` waits for it at its first read
    (after ``generate``, which ends in a wait anyway). Played without a GPU by events that log what the host does."""
    import promprune.efficiency as efficiency

    log = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            log.append("record")

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, end):
            log.append("elapsed")
            return 2.5

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(efficiency, "_is_cuda", lambda device: True)
    with Stopwatch("cuda") as sw:
        pass
    assert log == ["record", "record"]  # no wait when the region ends
    assert sw.ms == 2.5 and sw.ms == 2.5 and log == ["record", "record", "wait", "elapsed"]  # one wait, at the read


def test_prepare_never_waits_to_time_its_stages(monkeypatch):
    """``PrunedVLM.prepare`` on a CUDA device (played: events that log) records its stages' ends and waits for none;
    ``generate`` reads them after the LLM."""
    import promprune.efficiency as efficiency
    from promprune.models import PrunedVLM
    from promprune.models import vlm as vlm_module

    waits = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            waits.append(len(generated))

        def elapsed_time(self, end):
            return 1.0

    generated = []
    model = PrunedVLM.from_pretrained("tiny:llava", method="divprune", budget=8)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(efficiency, "_is_cuda", lambda device: True)
    real_generate = model.model.generate
    monkeypatch.setattr(model.model, "generate", lambda *a, **k: generated.append(1) or real_generate(*a, **k))
    monkeypatch.setattr(vlm_module, "_sync", lambda device: None)
    from PIL import Image

    image = Image.new("RGB", (32, 32), (200, 30, 30))
    prepared = model.prepare([image], ["What?"])
    assert waits == []  # prepare timed vision and selection without a wait
    assert prepared.vision_ms == 1.0 and prepared.select_ms == 1.0 and waits == [0, 0]
    waits.clear()
    out = model.generate([image], ["What?"], max_new_tokens=2)
    assert out[0].vision_ms == 1.0 and out[0].select_ms == 1.0
    assert waits == [1, 1]  # read after the LLM
