"""Prominence metrics against independent numpy computations."""
import math

import numpy as np
import pytest
import torch

import promprune


def numpy_spectral_entropy(x: np.ndarray) -> float:
    """Reference: SVD of the centered, L2-normalized tokens (float64)."""
    x = x.astype(np.float64)
    xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)
    xc = xn - xn.mean(axis=0, keepdims=True)
    sv = np.linalg.svd(xc, compute_uv=False)  # min(N, d) singular values
    lam = np.maximum(sv ** 2, 1e-12)
    p = lam / lam.sum()
    return float(-(p * np.log(p)).sum() / math.log(min(x.shape)))


@pytest.mark.parametrize("N,d", [(40, 64), (64, 40), (30, 30)])
def test_spectral_entropy_matches_numpy_svd(N, d):
    g = torch.Generator().manual_seed(N * d)
    low_rank = torch.randn(3, N, 4, generator=g) @ torch.randn(3, 4, d, generator=g)
    x = low_rank + 0.3 * torch.randn(3, N, d, generator=g)
    got = promprune.spectral_entropy(x)
    want = [numpy_spectral_entropy(x[b].numpy()) for b in range(3)]
    assert got.shape == (3,)
    np.testing.assert_allclose(got.numpy(), want, atol=2e-4)


def test_spectral_entropy_extremes_and_dtype():
    # Tokens along two orthogonal directions, half each: centered rank 1 -> entropy 0.
    x = torch.zeros(1, 8, 16)
    x[0, :4, 0] = 1.0
    x[0, 4:, 1] = 1.0
    assert promprune.spectral_entropy(x).item() == pytest.approx(0.0, abs=1e-4)
    iso = torch.eye(16)[None]  # 16 orthonormal tokens: flat spectrum over 15 of 16 eigenvalues
    assert 0.9 < promprune.spectral_entropy(iso).item() <= 1.0
    # bf16 input computes in float32
    y = torch.randn(2, 20, 32)
    np.testing.assert_allclose(promprune.spectral_entropy(y.bfloat16()).numpy(),
                               promprune.spectral_entropy(y.bfloat16().float()).numpy(), atol=1e-6)


def test_feature_norm_entropy_hand_values():
    x = torch.zeros(2, 4, 3)
    x[0, :, 0] = 2.0  # equal norms -> uniform -> 1
    x[1, 0, 0] = 1.0  # one nonzero token -> 0
    x[1, 1:, 0] = 0.0
    got = promprune.feature_norm_entropy(x)
    assert got[0].item() == pytest.approx(1.0, abs=1e-6)
    assert got[1].item() == pytest.approx(0.0, abs=1e-6)
    norms = np.array([1.0, 2.0, 3.0, 4.0])
    p = norms / norms.sum()
    z = torch.zeros(1, 4, 2)
    z[0, :, 1] = torch.tensor(norms, dtype=torch.float32)
    assert promprune.feature_norm_entropy(z).item() == pytest.approx(-(p * np.log(p)).sum() / math.log(4), abs=1e-6)


def test_attention_entropy_hand_values():
    s = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.5, 0.3, 0.2, 0.0]])
    got = promprune.attention_entropy(s)
    p = np.array([0.5, 0.3, 0.2])
    assert got.tolist()[:2] == pytest.approx([1.0, 0.0], abs=1e-6)
    assert got[2].item() == pytest.approx(-(p * np.log(p)).sum() / math.log(4), abs=1e-6)


def test_the_public_entropies_say_they_take_a_batch():
    x = torch.randn(6, 4)  # one image's tokens, no batch dimension
    for fn in (promprune.spectral_entropy, promprune.feature_norm_entropy):
        with pytest.raises(ValueError, match=r"a batch \[B, N, d\], got \(6, 4\) \(one image: features\[None\]\)"):
            fn(x)
        assert fn(x[None]).shape == (1,)
    with pytest.raises(ValueError, match=r"attention_entropy takes a batch \[B, N\], got \(6,\)"):
        promprune.attention_entropy(torch.rand(6))


def test_the_public_entropies_refuse_nan_and_inf_naming_the_rows():
    """A NaN made LAPACK fail inside spectral_entropy, feature_norm_entropy said 1.0 and attention_entropy NaN."""
    x = torch.randn(3, 8, 4)
    x[1, 2, 0] = float("nan")
    for fn in (promprune.spectral_entropy, promprune.feature_norm_entropy):
        with pytest.raises(ValueError, match=rf"{fn.__name__}: features contain NaN values \(batch items \[1\]\)"):
            fn(x)
    s = torch.rand(2, 5)
    s[0, 1] = float("inf")
    with pytest.raises(ValueError, match=r"attention_entropy: saliency contains Inf values \(batch items \[0\]\)"):
        promprune.attention_entropy(s)


@pytest.mark.parametrize("N,d", [(36, 16), (80, 96), (576, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_one_token_repeated_has_the_entropy_of_a_zero_spectrum_and_keeps_valid_tokens(N, d, dtype):
    """Every token the same (or every token zero): centered, nothing is left, and the reference's clamp makes every
    eigenvalue 1e-12, so H = 1 (the numpy SVD says so). Computed in float32, the centered Gram was rounding noise whose
    eigensolve gave NaN, a LAPACK failure, or an arbitrary H (36 x 16: seeds 0 and 1 failed), and NaN became -1
    indices. Now: H = 1 on the exact path, the certified split refuses the noise and reaches the same rule, and
    PromPrune keeps the count H = 1 gives, distinct tokens in range, in a batch beside an ordinary image."""
    for seed in range(4 if N < 100 else 1):
        g = torch.Generator().manual_seed(seed)
        same = torch.randn(1, 1, d, generator=g).expand(1, N, d)
        x = torch.cat([same, torch.zeros(1, N, d), torch.randn(1, N, d, generator=g)]).to(dtype)
        assert numpy_spectral_entropy(x[0].double().numpy()) == pytest.approx(1.0, abs=1e-9)
        h = promprune.spectral_entropy(x)
        assert h[:2].tolist() == [1.0, 1.0] and 0.0 < h[2] < 1.0
        s = torch.rand(3, N, generator=g)
        want = promprune.selection.budget.split_budget(torch.tensor([1.0]), 16, mu=0.42, tau=0.02)
        for mode in ("exact", "certified"):
            with promprune.selection.accel.entropy(mode):
                sel = promprune.select(x, s, budget=16)
            assert sel.saliency_count[:2].tolist() == [int(want)] * 2, mode
            assert sel.entropy[:2].tolist() == [1.0, 1.0], mode
            for row in sel.indices.tolist():
                assert len(set(row)) == 16 and all(0 <= i < N for i in row), (mode, row)


def test_the_kernels_refusal_threshold_is_the_torch_paths():
    """The Triton centering (``lanczos_triton._centering``) compares with a literal, which must be
    ``certified.density``'s threshold per row (``refusal_trace``): at least the exact path's ``noise_trace``, or the
    certified split and the eigensolve would disagree on near-identical tokens, and the trace the bracket's
    allowance for the eigenvalue floor (``certified.floor_allowance``) assumes, or a row below it would decide by a
    bracket that misses the exact H."""
    pytest.importorskip("triton")
    import inspect

    from promprune.selection import certified, entropy, lanczos_triton

    assert lanczos_triton.REFUSE_PER_ROW == certified.refusal_trace(1, torch.float32) >= entropy.noise_trace(
        1, torch.float32)
    assert repr(lanczos_triton.REFUSE_PER_ROW) in inspect.getsource(lanczos_triton._centering.fn)
