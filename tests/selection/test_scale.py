"""Selections do not depend on an overall scale of the features, up to float32's finite range.

Tokens are L2-normalized before any method compares them, so features multiplied by a positive constant must keep
the same tokens. A float32 sum of squares overflows from entries of ~1e19 (float16 from ~256), which once gave norms
of inf, unit tokens of 0 and repeated picks (``[0, 0, 0, ...]``) or an index past N (DivPrune). Each case compares
a method's picks on scaled features with its picks on the same features unscaled (the reference), on the CPU and,
where there is one, on a CUDA GPU (where such features leave the fast path: ``select``'s finiteness check).
"""
from __future__ import annotations

import pytest
import torch

import promprune
from promprune.dtypes import upcast
from promprune.selection import accel
from promprune.selection.registry import TokenSet

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
SHAPES = {"N>d": (2, 48, 24), "N<=d": (2, 16, 32)}  # the covariance and the Gram paths of the spectral entropy
BUDGET = 8
KEYS = (11, 12)  # one per image: `random` draws from its seed and these, whatever the features' scale

# Every registered pre-LLM method, with its defaults, plus the options that take other paths through the kernels.
VARIANTS = [(m, {}) for m in promprune.methods()] + [
    ("promprune", {"diversity": "fps"}), ("promprune", {"diversity": "facility_location"}),
    ("promprune", {"conditional": True}), ("promprune", {"metric": "feature_norm"}),
    ("coverage_only", {"diversity": "fps"}), ("coverage_only", {"diversity": "facility_location"}),
    ("cdpruner", {"text_source": "clip"}), ("cdpruner", {"theta": 0.9}),
]
# (dtype, scale): float32 far past where its squares overflow (1e20) and near the top of its range; half dtypes by
# a power of two, which scales them exactly: float16 past 256 (its squares overflow), bfloat16 past 2^64; float64 past
# 1e154 (it repeated token 0 or picked an index past N).
SCALES = [pytest.param(torch.float32, 1e20, id="float32-1e20"),
          pytest.param(torch.float32, 1e35, id="float32-1e35"),
          pytest.param(torch.float16, 2.0 ** 9, id="float16-2^9"),
          pytest.param(torch.bfloat16, 2.0 ** 66, id="bf16-2^66"),
          pytest.param(torch.float64, 1e160, id="float64-1e160")]  # float64's squares overflow: no wider type


def _inputs(shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, d = shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, N, 4, generator=g) @ torch.randn(B, 4, d, generator=g) + 0.5 * torch.randn(B, N, d, generator=g)
    return x, torch.rand(B, N, generator=g)


def _select(method: str, options: dict, x: torch.Tensor, s: torch.Tensor, query: torch.Tensor,
            vision: bool) -> promprune.Selection:
    """``select`` with everything a method may read: saliency, keys, an instruction whose visual tokens are ``x``
    itself ("llm") or its negation ("clip": another space, the same scale), and ``x`` as the vision tower's view."""
    spec = promprune.method_spec(method)
    kw = {"budget": BUDGET, "method": method, **options}
    if spec.needs_instruction:
        clip = options.get("text_source") == "clip"
        kw["instruction"] = promprune.Instruction(query=query, tokens=-x if clip else x,
                                                  source="clip" if clip else "llm")
    if spec.draws_at_random:
        kw["keys"] = KEYS
    if vision and spec.reads_vision:
        kw["vision"] = promprune.VisionFeatures(hidden=x, keys=x.flip(-1), project=lambda h: h.float())
    return promprune.select(x, s if spec.needs_saliency else None, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,scale", SCALES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method,options", VARIANTS, ids=lambda v: str(v))
def test_scaled_features_keep_the_same_tokens(method, options, shape, dtype, scale, device):
    x, s = _inputs(SHAPES[shape])
    x, s = x.to(device, dtype), s.to(device)
    query = torch.randn(x.shape[0], x.shape[-1], generator=torch.Generator().manual_seed(5)).to(device)
    big = x * scale
    assert bool(torch.isfinite(big).all())
    for vision in (False, True) if promprune.method_spec(method).reads_vision else (False,):
        ref = _select(method, options, x, s, query, vision)
        sel = _select(method, options, big, s, query, vision)
        N = x.shape[1]
        for row in sel.indices.tolist():
            assert len(set(row)) == len(row) == BUDGET, f"repeated picks at scale {scale:g}: {row}"
            assert all(0 <= i < N for i in row), f"picks outside [0, {N}) at scale {scale:g}: {row}"
        assert sel.indices.tolist() == ref.indices.tolist(), f"scale {scale:g} (vision={vision})"
        assert sel.saliency_count.tolist() == ref.saliency_count.tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,scale", SCALES)
def test_promprune_certified_split_is_scale_free(dtype, scale, device):
    """The certified split (the GPU's, here forced) reads the unit Gram: the same split and picks at any scale."""
    x, s = _inputs(SHAPES["N<=d"])
    x, s = x.to(device, dtype), s.to(device)
    with accel.entropy("certified"):
        ref = promprune.select(x, s, budget=BUDGET)
        sel = promprune.select(x * scale, s, budget=BUDGET)
    assert sel.indices.tolist() == ref.indices.tolist()
    assert sel.saliency_count.tolist() == ref.saliency_count.tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,scale", SCALES)
def test_norms_and_unit_gram_are_finite_and_scale_free(dtype, scale, device):
    x, _ = _inputs(SHAPES["N<=d"])
    x = x.to(device, dtype)
    small, big = (TokenSet(upcast(t), None, source=t) for t in (x, x * scale))
    assert bool(torch.isfinite(big.norms).all())
    torch.testing.assert_close(big.norms / scale, small.norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(big.unit_gram, small.unit_gram, rtol=0, atol=1e-6)
    torch.testing.assert_close(big.cosine, small.cosine, rtol=0, atol=1e-6)


def test_norms_of_normal_magnitudes_are_torch_norms_bit_for_bit():
    """The scale-safe norms change nothing where the float32 sum of squares does not overflow."""
    x, _ = _inputs((3, 64, 48))
    for t in (x, x * 1e15, x * 1e-15):
        assert torch.equal(TokenSet(t, None).norms, t.norm(dim=-1))


# fp16 stays: fp32 norms fit; float64 never takes the fast path
@pytest.mark.parametrize("dtype,scale", [p for p in SCALES if p.id not in ("float16-2^9", "float64-1e160")])
def test_features_whose_squares_overflow_leave_the_fast_path(dtype, scale, monkeypatch):
    """On the GPU fast path (emulated on the CPU: ``benchmarks.launches.fast_path_on_cpu``, its Triton kernels
    stubbed and counted, and the half tokens' ``bmm(out_dtype=float32)``, CUDA's only, as a float32 product) features
    of a normal scale launch the method's kernel; features whose squares overflow are found by ``select``'s finiteness
    check (a sum of squares) and run on the plain path, which launches none of the method's and keeps the tokens the
    plain path keeps at a normal scale (the reference)."""
    from benchmarks.launches import count, fast_path_on_cpu

    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b, *, out_dtype=None: bmm(a.float(), b.float()) if out_dtype else
                        bmm(a, b))
    x, s = _inputs(SHAPES["N<=d"])
    x = x.to(dtype)
    want = promprune.select(x, s, budget=BUDGET, method="divprune")
    with fast_path_on_cpu():
        normal = count(promprune.select, x, s, budget=BUDGET, method="divprune")
        huge = count(promprune.select, x * scale, s, budget=BUDGET, method="divprune")
        got = promprune.select(x * scale, s, budget=BUDGET, method="divprune")
    kernels = lambda c: sum(n for op, n in c.ops.items() if op.startswith("triton:"))  # noqa: E731
    # the cosine's kernel and DivPrune's (and the unit Gram's from half tokens); none; and in both the ascending order's
    # at the end (integers: the scale does not reach it)
    assert (kernels(normal), kernels(huge)) == (3 + (dtype != torch.float32), 1)
    assert got.indices.tolist() == want.indices.tolist()


def test_tokens_whose_norm_passes_float32s_range_are_a_clear_error():
    """Entries of 1e37 in 4096 dimensions: every entry is a float32, the norm (6.4e38) is not; no float32 direction
    exists to compare, so ``select`` names the tensor and the fix instead of picking from zeros."""
    x, s = torch.randn(1, 16, 4096), torch.rand(1, 16)
    big = torch.sign(x) * 1e37  # every entry 1e37 in size: the norm is 1e37 * 64
    assert bool(torch.isfinite(big).all())
    for method in ("divprune", "promprune"):
        with pytest.raises(ValueError, match=r"features hold a token of norm .*past float32's range.*scale-free"):
            promprune.select(big, s, budget=4, method=method)
    assert promprune.select(big.double(), s, budget=4, method="divprune").indices.shape == (1, 4)  # float64 holds it
    huge = torch.sign(x).double() * 1e307  # float64's turn: the norm (6.4e308) passes its range
    with pytest.raises(ValueError, match=r"features hold a token of norm inf, past float64's range.*scale-free\)\.$"):
        promprune.select(huge, s.double(), budget=4, method="divprune")
