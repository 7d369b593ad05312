"""Invariants every registered method must satisfy; parametrized over the registry, so new methods are covered."""
import pytest
import torch

import promprune

METHODS = promprune.methods()


def inputs(B=3, N=48, d=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, 4, generator=g) @ torch.randn(B, 4, d, generator=g) + 0.5 * torch.randn(B, N, d, generator=g)
    return x, torch.rand(B, N, generator=g)


def select(x, s, **kw):
    """``promprune.select``, with an instruction made from the features for the methods that need one."""
    if promprune.method_spec(kw.get("method", "promprune")).needs_instruction and "instruction" not in kw:
        kw["instruction"] = promprune.Instruction(query=x[:, 0].float(), tokens=x)
    return promprune.select(x, s, **kw)


def test_select_refuses_in_llm_methods_by_name():
    x, s = inputs()
    with pytest.raises(ValueError, match="'fastv' prunes inside the LLM.*PrunedVLM"):
        promprune.select(x, s, budget=4, method="fastv")


def test_registry_lists_the_paper_methods():
    assert set(METHODS) >= {"promprune", "fixed_ratio", "saliency_only", "coverage_only", "divprune", "vispruner",
                            "visionzip", "random"}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_indices_are_unique_in_range_and_ascending(method, budget):
    x, s = inputs()
    sel = select(x, s, budget=budget, method=method)
    assert sel.indices.shape == (3, budget) and sel.indices.dtype == torch.long
    for row in sel.indices.tolist():
        assert len(set(row)) == budget and all(0 <= i < 48 for i in row) and row == sorted(row)
    assert sel.saliency_count.shape == (3,)
    assert bool(((sel.saliency_count >= 0) & (sel.saliency_count <= budget)).all())
    assert torch.equal(sel.salient.sum(dim=1), sel.saliency_count)
    spec = promprune.method_spec(method)
    assert (sel.features is not None) == spec.merges
    if sel.features is not None:
        assert sel.features.shape == (3, budget, 24)


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_per_image_and_is_deterministic(method):
    x, s = inputs(B=4, seed=1)
    # scale images differently so the adaptive split differs per image (per-image T_sal, shared T)
    x = x * torch.tensor([1.0, 0.1, 3.0, 1.0])[:, None, None]
    x[3] = x[3, :1] + 0.01 * x[3]  # a concentrated image: low entropy
    batched = select(x, s, budget=12, method=method)
    again = select(x, s, budget=12, method=method)
    assert torch.equal(batched.indices, again.indices)
    for b in range(4):
        one = select(x[b:b + 1], s[b:b + 1], budget=12, method=method)
        assert torch.equal(one.indices[0], batched.indices[b]), b
        assert one.saliency_count.item() == batched.saliency_count[b].item()
        if one.features is not None:
            torch.testing.assert_close(one.features[0], batched.features[b])


def test_promprune_split_differs_per_image_in_a_batch():
    x, s = inputs(B=2, seed=2)
    x[1] = x[1, :1] + 0.01 * torch.randn_like(x[1])  # nearly one direction: concentrated meaning
    sel = select(x, s, budget=16, mu=0.5)
    assert sel.saliency_count[0] != sel.saliency_count[1]


@pytest.mark.parametrize("method", METHODS)
def test_budget_at_least_n_keeps_every_token(method):
    x, s = inputs(B=2, N=10)
    for budget in (10, 25):
        sel = select(x, s, budget=budget, method=method)
        assert sel.indices.tolist() == [list(range(10))] * 2
        if sel.features is not None:
            torch.testing.assert_close(sel.features, x)


@pytest.mark.parametrize("method", METHODS)
def test_selection_order_is_a_permutation_of_the_ascending_result(method):
    x, s = inputs()
    asc = select(x, s, budget=9, method=method)
    raw = select(x, s, budget=9, method=method, order="selection")
    assert torch.equal(raw.indices.sort(dim=1).values, asc.indices)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", METHODS)
def test_low_precision_inputs_compute_in_float32(method, dtype):
    x, s = inputs()
    xl = x.to(dtype)
    sel = select(xl, s, budget=8, method=method)
    ref = select(xl.float(), s, budget=8, method=method)
    assert torch.equal(sel.indices, ref.indices)
    if sel.features is not None:
        assert sel.features.dtype == dtype


def test_stage_one_takes_the_most_salient_tokens():
    x, s = inputs()
    sel = select(x, s, budget=16, method="fixed_ratio", saliency_ratio=0.5, order="selection")
    top = s.argsort(dim=1, descending=True)[:, :8]
    assert torch.equal(sel.indices[:, :8], top)


@pytest.mark.parametrize("diversity", ["dpp", "fps", "facility_location"])
@pytest.mark.parametrize("conditional", [False, True])
def test_promprune_diversity_variants(diversity, conditional):
    x, s = inputs()
    sel = select(x, s, budget=16, mu=0.5, diversity=diversity, conditional=conditional)
    assert all(len(set(r)) == 16 for r in sel.indices.tolist())


@pytest.mark.parametrize("metric", ["spectral", "feature_norm", "attention"])
def test_promprune_metric_variants_report_their_entropy(metric):
    x, s = inputs()
    sel = select(x, s, budget=16, metric=metric)
    want = {"spectral": promprune.spectral_entropy(x), "feature_norm": promprune.feature_norm_entropy(x),
            "attention": promprune.attention_entropy(s)}[metric]
    torch.testing.assert_close(sel.entropy, want)


def test_errors_name_the_problem():
    x, s = inputs()
    with pytest.raises(ValueError, match="did you mean 'promprune'"):
        select(x, s, budget=8, method="promprun")
    with pytest.raises(ValueError, match=r"unknown option.*'tua'.*did you mean 'tau'.*valid options"):
        select(x, s, budget=8, tua=0.1)
    with pytest.raises(ValueError, match="diversity"):
        select(x, s, budget=8, diversity="kmeans")
    with pytest.raises(ValueError, match="budget"):
        select(x, s, budget=0)
    with pytest.raises(ValueError, match="budget"):
        select(x, s, budget=2.5)
    bad = x.clone()
    bad[1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"features contain NaN.*\[1\]"):
        select(bad, s, budget=8)
    bad[1, 3, 0] = float("inf")
    with pytest.raises(ValueError, match="features contain Inf"):
        select(bad, s, budget=8)
    with pytest.raises(ValueError, match="saliency must have shape"):
        select(x, s[:, :10], budget=8)
    with pytest.raises(ValueError, match="needs saliency"):
        select(x, None, budget=8, method="promprune")
    with pytest.raises(ValueError, match=r"\[B, N, d\]"):
        select(x[0], s, budget=8)
    with pytest.raises(ValueError, match="tau"):
        select(x, s, budget=8, tau=0.0)
    # methods that need no saliency accept None
    assert select(x, None, budget=8, method="divprune").indices.shape == (3, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_matches_cpu(method):
    x, s = inputs()
    cpu = select(x, s, budget=12, method=method)
    gpu = select(x.cuda(), s.cuda(), budget=12, method=method)
    assert torch.equal(gpu.indices.cpu(), cpu.indices)


@pytest.mark.parametrize("method", METHODS)
def test_zero_and_duplicate_tokens_are_handled(method):
    # padding-like all-zero tokens and exact duplicates: no NaN, still T unique tokens
    x, s = inputs(B=2, N=20)
    x[:, :5] = 0.0
    x[:, 5:10] = x[:, 10:11]
    sel = select(x, s, budget=15, method=method)
    assert all(len(set(r)) == 15 for r in sel.indices.tolist())
    if sel.features is not None:
        assert torch.isfinite(sel.features).all()
    if sel.entropy is not None:
        assert torch.isfinite(sel.entropy).all()
