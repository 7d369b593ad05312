"""``Selection.entropy_halfwidth`` holds the exact metric: the certified bracket of a float32 spectral matrix with
negative rounding eigenvalues misses that matrix's float64 entropy by more than the bracket's own half-width, which
``certified.DECISION_MARGIN`` covers and the reported half-width now includes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import promprune
from promprune.selection import accel, certified
from promprune.selection.registry import TokenSet


def float64_entropy(matrix: np.ndarray) -> float:
    """The entropy of ``matrix``'s spectrum by numpy's float64 eigensolve (clamped at 1e-12, as the reference)."""
    lam = np.maximum(np.linalg.eigvalsh(matrix.astype(np.float64)), 1e-12)
    p = lam / lam.sum()
    return float(-(p * np.log(p)).sum() / math.log(len(lam)))


def test_the_halfwidth_holds_the_float64_entropy_of_a_near_low_rank_float32_matrix():
    rng = np.random.default_rng(3)
    n, d, rank = 256, 512, 4
    tokens = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, d)) / math.sqrt(d) * 0.6 \
        + 1.7 * rng.standard_normal(d) / math.sqrt(d) + 1e-4 * rng.standard_normal((n, d)) / math.sqrt(d)
    x = torch.tensor(tokens, dtype=torch.float32)[None]
    with accel.entropy("certified"):
        sel = promprune.select(x, torch.rand(1, n, generator=torch.Generator().manual_seed(0)), budget=64,
                               method="promprune", mu=0.9)
    assert certified.LAST_REPORT[0].exact == 0  # the bracket decided it
    bracket = certified.LAST_REPORT[0].widths[0] / 2
    miss = abs(float64_entropy(TokenSet(x, None).spectral_matrix[0].numpy()) - float(sel.entropy[0]))
    assert miss > 10 * bracket  # 5.9e-6 against a bracket of 3e-8: the float32 matrix's rounding
    assert miss <= float(sel.entropy_halfwidth[0])
    assert float(sel.entropy_halfwidth[0]) == pytest.approx(bracket + certified.DECISION_MARGIN, rel=1e-6)  # float32


def test_the_margin_grows_with_the_matrix_above_the_papers_largest_view():
    # the float32 matrix's rounding the bracket misses grows with n (~n^0.4; benchmarks/margin_by_size.py): 2e-5 up
    # to 1296, sqrt(n / 1296) times that above, by hand
    assert certified.decision_margin(576) == certified.decision_margin(1296) == 2e-5
    assert certified.decision_margin(5184) == pytest.approx(4e-5)
    n = 1600  # margin 2e-5 * sqrt(1600 / 1296) = 2.222e-5
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.arange(1, n + 1) ** -1.3
    rho = torch.tensor((q * (n * lam / lam.sum())) @ q.T, dtype=torch.float32)[None]  # trace n: no refusal
    with accel.entropy("certified"):
        _, mid, half = certified.split(rho, lambda h: torch.zeros(h.shape, dtype=torch.long), steps=(24,))
        assert certified.LAST_REPORT[0].exact == 0
        bracket = certified.LAST_REPORT[0].widths[0] / 2
        assert float(half[0]) == pytest.approx(bracket + 2e-5 * (n / 1296) ** 0.5, rel=1e-6)
        # a count boundary 2.1e-5 above the bracket: outside the fixed 2e-5, inside this size's margin: the
        # exact eigensolve decides
        boundary = float(mid[0]) + bracket + 2.1e-5
        certified.split(rho, lambda h: (h < boundary).long(), steps=(24,))  # the same one stage
        assert certified.LAST_REPORT[0].exact == 1
