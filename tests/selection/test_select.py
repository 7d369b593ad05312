"""Invariants every registered method must satisfy (`promprune.testing.check_method`, parametrized over the registry,
so new methods are covered), and `select`'s own behaviour."""
import pytest
import torch

import promprune
from promprune.testing import CHECKS, CUDA_ONLY, check_method, inputs

METHODS = promprune.methods()


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


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("method", METHODS)
def test_invariants(method, check):
    """The invariants of `promprune.testing.check_method` (what a method from outside is tested with), one by one."""
    if check in CUDA_ONLY and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert check_method(method, only=[check]) == [check]


@pytest.mark.parametrize("method", METHODS)
def test_builtin_methods_return_what_select_asks_of_a_method_of_ones_own(method):
    """``select`` checks the outputs of methods from outside only (``registry._check_output``: indices, counts in
    [0, T], bool ``salient`` of the indices' shape, which the GPU's ascending order needs, entropy ``[B]``, merged
    features ``[B, T, d]`` from a method declaring ``merges``, ``cls [B, d]``, all finite); its own methods, with their
    variants, pass the same check, on degenerate images too (zero and repeated tokens, an image of zeros) and with
    the vision tower's features (VisionZip's CLS)."""
    from promprune.selection.registry import _check_output

    spec = promprune.method_spec(method)
    x, s = inputs()
    degenerate = x.clone()
    degenerate[0, :5] = 0.0
    degenerate[1] = degenerate[1, :1]
    degenerate[2] = 0.0
    g = torch.Generator().manual_seed(3)
    hidden, keys, cls = torch.randn(3, 48, 10, generator=g), torch.randn(3, 48, 6, generator=g), torch.randn(3, 10)
    weight = torch.randn(10, x.shape[2], generator=g)
    vision = promprune.VisionFeatures(hidden, keys, cls, project=lambda h: h @ weight)
    variants = {"promprune": [{}, {"conditional": True}, {"diversity": "fps"}, {"diversity": "facility_location"}]}
    seen = [{}, {"vision": vision}] if spec.reads_vision else [{}]
    for options in variants.get(method, [{}]):
        for extra in seen:
            for feats in (x, degenerate):
                for budget in (1, 7, 16):
                    sel = select(feats, s, budget=budget, method=method, order="selection", **options, **extra)
                    _check_output(spec, sel, *x.shape, budget)
    if method == "visionzip":  # the CLS path was taken: indices T - 1, cls [B, d]
        assert select(x, s, budget=7, method=method, vision=vision).cls.shape == (3, x.shape[2])


def test_promprune_split_differs_per_image_in_a_batch():
    x, s = inputs(B=2, seed=2)
    x[1] = x[1, :1] + 0.01 * torch.randn_like(x[1])  # nearly one direction: concentrated meaning
    sel = select(x, s, budget=16, mu=0.5)
    assert sel.saliency_count[0] != sel.saliency_count[1]


def test_saliency_reaches_only_the_methods_that_declare_it():
    # coverage_only's DPP breaks its first pick's tie (every gain is 1) by saliency when it has some: given scores
    # it would start from the most salient token, which the model adapters never pass it; select passes none either
    x, s = inputs()
    given = select(x, s, budget=6, method="coverage_only", order="selection")
    assert given.indices[:, 0].tolist() == [0, 0, 0]  # the raster-order tie break, as without saliency
    assert s.argmax(dim=1).tolist() != [0, 0, 0]
    assert torch.equal(given.indices, select(x, None, budget=6, method="coverage_only", order="selection").indices)


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


# select()'s named arguments, by hand (a test below pins them to its signature): an option of a method named like one
# of them would be bound to select()'s argument and never reach the method
SELECT_ARGUMENTS = ("features", "saliency", "budget", "method", "vision", "instruction", "grid", "keys", "checked",
                    "entropy_bounds")


@pytest.mark.parametrize("option", SELECT_ARGUMENTS)
def test_registering_an_option_named_like_selects_own_argument_is_refused(option):
    """`keys`, `grid`, `checked`, `vision`, `instruction`, `features`, `saliency` and `method` were registered as a
    method's options: `select(..., keys=...)` then took the value as its own argument and the method got its
    default, silently. Every one of select's named arguments is refused as the method registers, naming it."""
    import inspect

    from promprune.selection import registry

    params = inspect.signature(promprune.select).parameters
    assert set(SELECT_ARGUMENTS) == {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}

    def fn(tokens, budget, **options):
        return promprune.Selection(indices=torch.arange(budget).expand(tokens.batch, budget),
                                   saliency_count=torch.zeros(tokens.batch, dtype=torch.long))

    with pytest.raises(ValueError, match=rf"register_method: method 't_shadow' names option\(s\) \['{option}'\], "
                                         rf"which are taken before the method sees them \('{option}': .*select\(\)'s"):
        promprune.register_method("t_shadow", options={option: 0})(fn)
    with pytest.raises(ValueError, match=rf"register_in_llm_method: method 't_shadow' names option\(s\) "
                                         rf"\['{option}'\]"):
        promprune.register_in_llm_method("t_shadow", score=lambda inputs, **options: None, options={option: 0})
    assert "t_shadow" not in promprune.methods(None)
    assert set(registry._SELECT_ARGUMENTS) == set(SELECT_ARGUMENTS)  # each one described in the refusal


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
    odd = s.clone()
    odd[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^saliency contains NaN values \(batch items \[2\]\)$"):
        select(x, odd, budget=8)
    # a method that never gets saliency (select passes it on only where declared) does not judge it either
    assert torch.equal(select(x, odd, budget=8, method="divprune").indices,
                       select(x, None, budget=8, method="divprune").indices)
    # saliency is min-max normalized: scores of 1e38 (whose squares overflow) pick what the same scores scaled down do
    assert torch.equal(select(x, s * 1e38, budget=8).indices, select(x, s, budget=8).indices)
    huge = x.double().clone()
    huge[0] = 1e300  # finite, but any sum of their squares overflows: the check goes the long way and passes
    assert select(huge, s, budget=8, method="saliency_only").indices.shape == (3, 8)
    huge[2, 5, 1] = float("nan")
    with pytest.raises(ValueError, match=r"features contain NaN.*\[2\]"):
        select(huge, s, budget=8, method="saliency_only")
    with pytest.raises(ValueError, match="saliency must have shape"):
        select(x, s[:, :10], budget=8)
    with pytest.raises(ValueError, match="needs saliency"):
        select(x, None, budget=8, method="promprune")
    with pytest.raises(ValueError, match=r"\[B, N, d\]"):
        select(x[0], s, budget=8)
    with pytest.raises(ValueError, match=r"features have no images \(B = 0\)"):
        select(x[:0], s[:0], budget=8)
    with pytest.raises(ValueError, match=r"features have no tokens \(N = 0\)"):
        select(x[:, :0], s[:, :0], budget=8)
    for method in ("promprune", "divprune", "saliency_only"):  # d = 0 gave entropy 0 and every token by saliency
        with pytest.raises(ValueError, match=r"features have no feature channels \(d = 0\)"):
            select(x[..., :0], s, budget=8, method=method)
    with pytest.raises(ValueError, match="tau"):
        select(x, s, budget=8, tau=0.0)
    # methods that need no saliency accept None
    assert select(x, None, budget=8, method="divprune").indices.shape == (3, 8)


def test_numpy_numbers_count_as_python_numbers():
    # a grid from np.linspace / np.arange: numpy's float32 and int64 are not Python float / int subclasses
    np = pytest.importorskip("numpy")
    from promprune.models import validate_method

    x, s = inputs()
    got = select(x, s, budget=np.int64(8), mu=np.float32(0.25), tau=np.float64(0.02))
    want = select(x, s, budget=8, mu=float(np.float32(0.25)), tau=0.02)
    assert torch.equal(got.indices, want.indices)
    assert select(x, s, budget=8, method="random", seed=np.int64(3)).indices.tolist() == \
        select(x, s, budget=8, method="random", seed=3).indices.tolist()
    options, _ = validate_method("promprune", np.int64(8), mu=np.float32(0.5))
    assert type(options["mu"]) is float
    with pytest.raises(ValueError, match="budget must be a positive int"):
        select(x, s, budget=np.float64(8.0))
    with pytest.raises(ValueError, match="budget must be a positive int"):
        select(x, s, budget=np.int64(0))
    # numpy's bool_ as a flag (e.g. from a comparison), and keys as a numpy array or a list of its ints
    assert torch.equal(select(x, s, budget=8, conditional=np.bool_(True)).indices,
                       select(x, s, budget=8, conditional=True).indices)
    for keys in (np.arange(3) + 5, [np.int64(5), np.int64(6), np.int64(7)]):
        assert torch.equal(select(x, s, budget=8, method="random", keys=keys).indices,
                           select(x, s, budget=8, method="random", keys=[5, 6, 7]).indices)


@pytest.mark.parametrize("method", METHODS)
def test_float64_tokens_are_selected_in_float64(method):
    """Every method takes float64 tokens and keeps budget distinct tokens; and the precision is kept: saliency
    that differs only below float32's resolution ranks in float64 (float32 would tie it and keep raster order)."""
    x, s = inputs()
    sel = select(x.double(), s.double(), budget=4, method=method)
    assert sel.indices.shape == (x.shape[0], 4)
    assert all(len(set(row.tolist())) == 4 for row in sel.indices)

    s64 = 0.5 + 1e-12 * torch.arange(16, dtype=torch.float64).expand(2, 16)  # ascending, equal in float32
    x64 = torch.randn(2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    top = promprune.select(x64, s64, budget=4, method="saliency_only").indices
    assert top.tolist() == [[12, 13, 14, 15]] * 2
    assert promprune.select(x64.float(), s64.float(), budget=4, method="saliency_only").indices.tolist() == \
        [[0, 1, 2, 3]] * 2


def test_exactly_symmetric_averages_the_two_triangles():
    from promprune.selection.kernels import exactly_symmetric

    g = torch.rand(2, 5, 5, dtype=torch.float64)
    s = exactly_symmetric(g)
    assert torch.equal(s, s.transpose(1, 2)) and torch.allclose(s, (g + g.transpose(1, 2)) / 2, rtol=0, atol=1e-16)
    sym = s.clone()
    assert torch.equal(exactly_symmetric(sym), sym)  # a symmetric Gram keeps its values


_ASYMMETRIC = """
import torch
from promprune.selection.registry import TokenSet, VisionFeatures
x = torch.randn(4, 145, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
xn = x / x.norm(dim=-1, keepdim=True)
raw = xn @ xn.transpose(1, 2)
tokens = TokenSet(x, None, VisionFeatures(x, None, None, None))
print(int((raw != raw.transpose(1, 2)).sum()), int((tokens.cosine != tokens.cosine.transpose(1, 2)).sum()),
      int((tokens.vision_cosine != tokens.vision_cosine.transpose(1, 2)).sum()))
"""


def test_the_kernels_are_symmetric_bit_for_bit_where_the_blas_product_is_not():
    """MKL's AVX2 path sums (i, j) and (j, i) of some products in different orders; the kernels the selectors
    read are symmetric anyway, so mutual nearest neighbours tie exactly and break by index on every CPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out = subprocess.run([sys.executable, "-c", _ASYMMETRIC], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    raw, cosine, vision = map(int, out.stdout.split())
    assert cosine == vision == 0
    if raw == 0:
        pytest.skip("this CPU's BLAS gives a symmetric product here: nothing for the symmetrization to show")


PRECISION_PROBE = """
import sys, torch, promprune
from promprune.selection import entropy, registry
cuda, dnn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
how = sys.argv[1]
if how == "legacy":
    cuda.allow_tf32 = True
elif how == "global":
    torch.set_float32_matmul_precision("high")
elif how == "backend":
    cuda.fp32_precision, dnn.fp32_precision = "tf32", "bf16"
seen = []
@promprune.register_method("t_probe", needs_saliency=True)
def probe(tokens, budget):
    seen.append((cuda.fp32_precision, dnn.fp32_precision))
    return registry.method_spec("saliency_only").fn(tokens, budget)
exact = entropy.entropy_of_matrix
def recording(mat):
    seen.append((cuda.fp32_precision, dnn.fp32_precision))
    return exact(mat)
entropy.entropy_of_matrix = recording
x = torch.randn(2, 16, 8)
promprune.select(x, torch.rand(2, 16), budget=4, method="t_probe")
entropy.spectral_entropy(x)
after = [cuda.fp32_precision, dnn.fp32_precision]
if how in ("legacy", "global"):  # the process's own API reads its setting back, no mix of APIs refused
    after += [cuda.allow_tf32, torch.get_float32_matmul_precision()]
print(seen, after)
"""


@pytest.mark.parametrize("how,inside,after", [
    ("none", ("none", "none"), ["none", "none"]),  # never asked for TF32: not touched
    ("legacy", ("ieee", "none"), ["tf32", "none", True, "high"]),
    ("global", ("ieee", "ieee"), ["tf32", "tf32", True, "high"]),  # torch's global precision reaches oneDNN too
    ("backend", ("ieee", "ieee"), ["tf32", "bf16"]),
])
def test_float32_products_run_at_full_precision_whatever_the_process_set(how, inside, after):
    """A process that turned TF32 on (torch's legacy flag, its global precision, or each backend's own setting, and
    oneDNN's bf16 on the CPU): ``select``'s method and ``spectral_entropy``'s eigensolve run with IEEE float32
    products, and the process reads its setting back afterwards as it wrote it. In a child process: torch refuses
    some reads once the APIs have been mixed, which would reach the other tests of this worker."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PRECISION_PROBE, how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{[inside, inside]} {after}"
