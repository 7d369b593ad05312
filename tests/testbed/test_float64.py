"""testbed:llava in float64 (what the quickstart runs): transformers' model bit for bit in float32; in float64 the
Llama norms and RoPE compute in float64 (checked against numpy), and the CPU's kernels move the logits only in
float64's last bits (a subprocess on ATen's portable kernels against this process's vectorized ones)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from promprune.models import PrunedVLM
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes, shipped

pytestmark = pytest.mark.skipif(not shipped.available(), reason="no shipped weights in promprune/testbed/weights")

PROMPT = "USER: <image>\nIs there a red circle in the image? Answer with yes or no. ASSISTANT:"


def _inputs(processor, dtype, n=3):
    images = [scenes.render(scenes.make_scene("test", i)) for i in range(n)]
    batch = processor(images=images, text=[PROMPT] * n, return_tensors="pt", padding=True)
    batch["pixel_values"] = batch["pixel_values"].to(dtype)
    return batch


def test_widened_model_is_transformers_model_bit_for_bit_in_float32():
    plain = shipped.load()
    wide = testbed_model.widen(shipped.load())
    assert type(wide) is testbed_model.TestbedLlava and type(plain).__name__ == "LlavaForConditionalGeneration"
    assert {type(m) for m in wide.modules()} >= {testbed_model.WideRMSNorm, testbed_model.WideRotaryEmbedding}
    batch = _inputs(testbed_model.processor(), torch.float32)
    with torch.inference_mode():
        assert torch.equal(plain(**batch).logits, wide(**batch).logits)


def test_a_model_rebuilt_from_its_class_and_config_is_widened():
    wide = testbed_model.widen(shipped.load())
    with torch.device("meta"):
        rebuilt = type(wide)(wide.config)  # what the sweep's published weights are restored into
    assert sum(isinstance(m, testbed_model.WideRMSNorm) for m in rebuilt.modules()) == \
        sum(isinstance(m, LlamaRMSNorm) for m in wide.modules()) == 2 * wide.config.text_config.num_hidden_layers + 1


def test_float64_norm_and_rope_against_numpy():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-6)
    norm.weight.data = torch.rand(96) + 0.5
    norm = norm.double()
    x = torch.randn(2, 5, 96, dtype=torch.float64) * 3
    xs, w = x.numpy(), norm.weight.detach().numpy()
    want = w * (xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + 1e-6))
    transformers_err = np.abs(norm(x).detach().numpy() - want).max()
    norm.__class__ = testbed_model.WideRMSNorm
    assert np.abs(norm(x).detach().numpy() - want).max() < 1e-13 < transformers_err  # transformers': float32

    config = testbed_model.config().text_config
    rope = testbed_model.WideRotaryEmbedding(config)
    positions = torch.arange(300)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float64), positions)
    dim = config.hidden_size // config.num_attention_heads
    angle = np.arange(300)[:, None] / config.rope_parameters["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    angle = np.concatenate([angle, angle], axis=1)
    assert cos.dtype == torch.float64 and np.abs(cos[0].numpy() - np.cos(angle)).max() < 1e-12
    assert np.abs(sin[0].numpy() - np.sin(angle)).max() < 1e-12


_LOGITS = """
import json, sys, torch
from promprune.models import PrunedVLM
from tests.testbed.test_float64 import _inputs
vlm = PrunedVLM.from_pretrained("testbed:llava", method=None, dtype="float64")
with torch.inference_mode():
    logits = vlm.model(**_inputs(vlm.processor, torch.float64)).logits[:, -1]
json.dump({"capability": torch.backends.cpu.get_cpu_capability(), "logits": logits.tolist()}, sys.stdout)
"""


def test_float64_logits_move_only_in_their_last_bits_between_cpu_kernels():
    """ATen's portable kernels (``ATEN_CPU_CAPABILITY=default``: other reduction orders, glibc's exp) against the
    best this CPU has, in this process: the same greedy token, the logits within 1e-11 (float32 moves them ~1e-5)."""
    vlm = PrunedVLM.from_pretrained("testbed:llava", method=None, dtype="float64")
    with torch.inference_mode():
        here = vlm.model(**_inputs(vlm.processor, torch.float64)).logits[:, -1]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": os.pathsep.join(
        [str(shipped.WEIGHTS_DIR.parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _LOGITS], env=env, capture_output=True, text=True, timeout=300,
                          cwd=shipped.WEIGHTS_DIR.parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = json.loads(proc.stdout.strip().splitlines()[-1])
    assert other["capability"] == "DEFAULT"
    there = torch.tensor(other["logits"], dtype=torch.float64)
    assert torch.equal(here.argmax(-1), there.argmax(-1))
    assert (here - there).abs().max() < 1e-11
