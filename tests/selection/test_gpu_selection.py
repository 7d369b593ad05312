"""The GPU fast path of whole ``select`` calls (issue 22) against the CPU reference; every test needs a CUDA GPU.

- float32: the same indices as the CPU at the paper's shapes (``benchmarks/selection.py``'s inputs).
- fp16: the Gram comes from the half tokens with fp32 accumulation; kept sets overlap the CPU's on the same fp16
  inputs by at least ``FP16_MIN_OVERLAP`` on average.
- PromPrune's certified split reads the device once per batch when its first stage decides every image; a fixed
  split never waits on the device (``torch.cuda.set_sync_debug_mode("error")``) and can be captured in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

import promprune
from benchmarks.selection import SHAPES, make_inputs
from promprune.selection import accel, certified
from promprune.selection.registry import TokenSet, method_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

METHODS = [("promprune", {}), ("promprune", {"conditional": True}), ("promprune", {"diversity": "fps"}),
           ("promprune", {"diversity": "facility_location"}), ("coverage_only", {}), ("fixed_ratio", {}),
           ("divprune", {})]
# The fp16 Gram (half products, fp32 accumulation) differs from the CPU's (upcast, normalized, then multiplied)
# by rounding only, so kept sets should differ only at near-ties. Not yet measured on a GPU: confirm there.
FP16_MIN_OVERLAP = 0.95


def _both(method, options, x, s, budget):
    kw = {"budget": budget, "method": method, **options}
    return promprune.select(x.cuda(), s.cuda(), **kw), promprune.select(x.cpu(), s.cpu(), **kw)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method,options", METHODS, ids=lambda v: str(v))
def test_cuda_float32_selects_what_the_cpu_selects(shape, method, options):
    B, N, d, T = SHAPES[shape]
    x, s = make_inputs(B, N, d, "cpu")
    gpu, cpu = _both(method, options, x, s, T)
    assert torch.equal(gpu.indices.cpu(), cpu.indices), f"{method} {options} at {shape}"
    assert torch.equal(gpu.saliency_count.cpu(), cpu.saliency_count)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_fp16_overlaps_the_cpu(shape):
    B, N, d, T = SHAPES[shape]
    x, s = make_inputs(B * 2, N, d, "cpu", dtype=torch.float16)
    gpu, cpu = _both("promprune", {}, x, s, T)
    overlap = [len(set(g.tolist()) & set(c.tolist())) / T for g, c in zip(gpu.indices.cpu(), cpu.indices)]
    print(f"{shape}: fp16 overlap with the CPU per image {overlap}")
    assert sum(overlap) / len(overlap) >= FP16_MIN_OVERLAP


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method,options", [("promprune", {}), ("promprune", {"conditional": True}),
                                            ("fixed_ratio", {}), ("saliency_only", {}), ("divprune", {})],
                         ids=lambda v: str(v))
def test_cuda_fp16_kernels_select_what_their_torch_ops_select(shape, method, options):
    """On the same GPU and fp16 inputs (the real models' dtype), the one-launch kernels (the half tokens' unit Gram and
    the cosine, ``greedy_triton.scaled_gram``; the saliency stage, ``salient_front``; DivPrune, ``divprune_picks``)
    keep exactly what their torch ops keep: they make the same bits."""
    from contextlib import ExitStack

    B, N, d, T = SHAPES[shape]
    x, s = (t.cuda() for t in make_inputs(B * 2, N, d, "cpu", dtype=torch.float16))
    kw = {"budget": T, "method": method, **options}
    fused = promprune.select(x, s, **kw)
    with ExitStack() as stack:
        for name in ("gram", "cosine", "front", "divprune"):
            stack.enter_context(accel.without_kernel(name))
        ops = promprune.select(x, s, **kw)
    assert torch.equal(fused.indices, ops.indices), f"{method} {options} at {shape}"
    assert torch.equal(fused.saliency_count, ops.saliency_count) and torch.equal(fused.salient, ops.salient)


def _fast(method: str, x: torch.Tensor, s: torch.Tensor, budget: int, **options) -> torch.Tensor:
    """The registered function on validated inputs (``select`` validates with one host sync)."""
    spec = method_spec(method)
    opts = spec.resolve(options)
    opts.pop("order")
    return spec.fn(TokenSet(x.float(), s, source=x), budget, **opts).indices


def test_cuda_promprune_reads_the_device_once_per_batch():
    B, N, d, T = SHAPES["llava-next"]
    x, s = make_inputs(B, N, d, "cuda", dtype=torch.float16)
    _fast("promprune", x, s, T, mu=0.9)  # warm-up: Triton compiles
    before = accel.syncs()
    _fast("promprune", x, s, T, mu=0.9)  # every entropy far from mu: the first stage decides
    assert certified.LAST_REPORT[0].decided[0] == B and accel.syncs() - before == 1


@pytest.mark.parametrize("method", ["fixed_ratio", "divprune", "coverage_only"])
def test_cuda_fixed_splits_never_wait_on_the_device(method):
    B, N, d, T = SHAPES["llava-next"]
    x, s = make_inputs(B, N, d, "cuda", dtype=torch.float16)
    _fast(method, x, s, T)  # warm-up: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fast(method, x, s, T)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_fixed_split_can_be_captured_in_a_graph():
    B, N, d, T = SHAPES["llava-1.5"]
    x, s = make_inputs(B, N, d, "cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _fast("fixed_ratio", x, s, T)  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = _fast("fixed_ratio", x, s, T)
    x2, s2 = make_inputs(B, N, d, "cuda", seed=1, dtype=torch.float16)
    x.copy_(x2)
    s.copy_(s2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _fast("fixed_ratio", x2, s2, T))


@pytest.mark.parametrize("method,options", METHODS, ids=lambda v: str(v))
def test_cuda_tf32_turned_on_by_the_process_changes_no_pick(method, options):
    """A process that turned TF32 on (``torch.backends.cuda.matmul.allow_tf32 = True``, common in training scripts)
    keeps the same tokens on float32 features: the selection's products run at full precision
    (``accel.full_float32``); TF32 would move the Gram's cosines by up to ~5e-5 (``benchmarks/tf32_picks.py``)."""
    B, N, d, T = SHAPES["llava-next"]
    x, s = make_inputs(B, N, d, "cuda")
    kw = {"budget": T, "method": method, **options}
    reference = promprune.select(x, s, **kw)
    matmul = torch.backends.cuda.matmul
    matmul.allow_tf32 = True
    try:
        picked = promprune.select(x, s, **kw)
        assert matmul.allow_tf32  # the process's setting, read back as it wrote it
    finally:
        matmul.allow_tf32 = False
    assert torch.equal(picked.indices, reference.indices) and torch.equal(picked.salient, reference.salient)


@pytest.mark.parametrize("method", ["downsample", "visionzip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_merges_the_cpus_bits_alone_and_in_a_batch(method, dtype):
    """The merges' sums run in a fixed order (``kernels.segment_sums``: one loop a run, from 0, in raster order; the
    products before them elementwise), so the GPU's merged features are the CPU's bit for bit, and an image's the
    same alone as among eight images of LLaVA-NeXT's five views (40 views a call). Not yet run on a GPU."""
    _, N, d, T = SHAPES["llava-next"]
    x, s = make_inputs(40, N, d, "cpu", dtype=dtype)
    cpu = promprune.select(x, s, budget=T, method=method)
    gpu = promprune.select(x.cuda(), s.cuda(), budget=T, method=method)
    assert torch.equal(gpu.indices.cpu(), cpu.indices)
    assert torch.equal(gpu.features.cpu(), cpu.features)
    for lo, hi in ((0, 1), (17, 18), (5, 10)):
        alone = promprune.select(x[lo:hi].cuda(), s[lo:hi].cuda(), budget=T, method=method)
        assert torch.equal(alone.features, gpu.features[lo:hi])
