"""The adapters on a CUDA device in fp16 / bf16 / fp32, against plain transformers and against the CPU.

Skipped without CUDA (the suite never needs a GPU); run on a GPU machine with ``pytest -k cuda``.
"""
import copy

import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm

from .conftest import ARCHS, plain_generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = 6
HALF = [torch.float16, torch.bfloat16]


def on_cuda(arch, dtype):
    model, processor = tiny_vlm(arch)
    return copy.deepcopy(model).to("cuda", dtype), processor


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_unpruned_generates_plain_tokens(arch, dtype, images, prompts):
    model, processor = on_cuda(arch, dtype)
    expected, _ = plain_generate(model, processor, images, prompts, NEW_TOKENS)
    got = PrunedVLM(model, processor, method=None).generate(images, prompts, max_new_tokens=NEW_TOKENS)
    assert [g.token_ids for g in got] == expected


@pytest.mark.parametrize("method", ["promprune", "divprune", "vispruner"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_full_budget_generates_unpruned_tokens(arch, dtype, method, images, prompts):
    model, processor = on_cuda(arch, dtype)
    expected, _ = plain_generate(model, processor, images, prompts, NEW_TOKENS)
    got = PrunedVLM(model, processor, method=method, budget=10_000, image_newline="rows").generate(
        images, prompts, max_new_tokens=NEW_TOKENS)
    assert [g.token_ids for g in got] == expected


def kept_sets(model, processor, method, images, prompts, budget=8):
    gens = PrunedVLM(model, processor, method=method, budget=budget).generate(images, prompts, max_new_tokens=2)
    return [set(g.kept) for g in gens], gens


@pytest.fixture
def no_tf32():
    """float32 that is float32: cuDNN runs float32 convolutions in TF32 by default (10-bit mantissa), and the patch
    embeddings of Qwen2.5-VL, Qwen3-VL and GLM-4.6V are convolutions. On an H100 (2026-11-26) one kept token of
    glm46v's PromPrune differed from the CPU's with TF32 on; TF32's ~1e-3 error moving a near-tie is the suspected
    cause, which the next `gpu_checklist.sh parity` confirms or refutes."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("method", ["promprune", "divprune", "vispruner"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_float32_selects_what_the_cpu_selects(arch, method, images, prompts, no_tf32):
    cpu_model, processor = tiny_vlm(arch)
    want, _ = kept_sets(cpu_model, processor, method, images, prompts)
    model, _ = on_cuda(arch, torch.float32)
    got, gens = kept_sets(model, processor, method, images, prompts)
    assert got == want
    assert all(g.visual_tokens == 8 for g in gens) or arch == "llava_next"  # NeXT: budget split over views


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_half_precision_selection_stays_close_to_float32(arch, dtype, images, prompts):
    """Half-precision features perturb near-ties only: most kept tokens agree with the float32 CPU run."""
    cpu_model, processor = tiny_vlm(arch)
    want, _ = kept_sets(cpu_model, processor, "promprune", images, prompts)
    model, _ = on_cuda(arch, dtype)
    got, gens = kept_sets(model, processor, "promprune", images, prompts)
    for g, w in zip(got, want):
        assert len(g) == len(w)
        assert len(g & w) / len(w) >= 0.6, (sorted(g), sorted(w))
    assert all(0.0 <= g.entropy <= 1.0 for g in gens)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_promprune_keeps_the_same_tokens_with_graphs(arch, dtype, images, prompts):
    """PromPrune's selection as CUDA graphs inside the model path (``PROMPRUNE_GRAPHS=1``; the split's bounds forced,
    as the tiny views are below the size "auto" takes them at): called until every shape's captures have replayed, the
    kept tokens and the split's counts are the eager call's."""
    from promprune.selection import accel, graphed

    model, processor = on_cuda(arch, dtype)
    with accel.entropy("certified"):
        want, gens = kept_sets(model, processor, "promprune", images, prompts)
        graphed.clear()
        try:
            with accel.graphs(True):
                for _ in range(graphed.SIGHTINGS + 1):  # eager, the captures and their first replays, replays
                    got, got_gens = kept_sets(model, processor, "promprune", images, prompts)
                    assert got == want
                    assert [g.saliency_count for g in got_gens] == [g.saliency_count for g in gens]
            assert graphed._CAPTURES and not graphed._FAILED
        finally:
            graphed.clear()


@pytest.mark.parametrize("arch", ["llava", "llava_next"])
def test_cuda_certified_entropies_lie_within_their_half_widths(arch, images, prompts, no_tf32):
    """On the GPU's route (the bounds, forced: the tiny views are below the size "auto" takes them at) each sample's
    entropy lies within its recorded half-width of the exact one on the same device, with the same kept tokens."""
    from promprune.selection import accel, certified

    model, processor = on_cuda(arch, torch.float32)
    with accel.entropy("exact"):
        _, exact = kept_sets(model, processor, "promprune", images, prompts)
    with accel.entropy("certified"):
        _, bounded = kept_sets(model, processor, "promprune", images, prompts)
    for e, b in zip(exact, bounded):
        assert e.entropy_halfwidth is None and b.kept == e.kept
        assert b.entropy_halfwidth is not None
        # the half-width, plus the exact algorithm's own float32 rounding (which the decisions' margin covers too)
        assert abs(b.entropy - e.entropy) <= b.entropy_halfwidth + certified.DECISION_MARGIN
