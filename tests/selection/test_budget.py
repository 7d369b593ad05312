"""The budget split at hand-worked values."""
import math

import pytest
import torch

import promprune
from promprune.selection.budget import split_budget

MU, TAU = 0.42, 0.02


def h(values):
    return torch.tensor(values, dtype=torch.float32)


def test_split_at_hand_worked_values():
    # H = mu -> sigmoid 0.5 -> ratio 0.5; H = mu + tau ln 3 -> sigmoid 0.75 -> ratio 0.25;
    # H = mu - tau ln 3 -> ratio 0.75; far above / below mu -> saturate at 0 / T.
    ent = h([MU, MU + TAU * math.log(3), MU - TAU * math.log(3), 0.99, 0.0])
    assert split_budget(ent, 64, mu=MU, tau=TAU).tolist() == [32, 16, 48, 0, 64]


def test_half_even_rounding_versus_floor():
    # T = 10, ratio 0.25 -> 2.5 -> round-half-even 2 (T_cov 8); floor mode: T_cov = floor(10 * 0.75) = 7 -> T_sal 3.
    ent = h([MU + TAU * math.log(3)])
    assert split_budget(ent, 10, mu=MU, tau=TAU).tolist() == [2]
    assert split_budget(ent, 10, mu=MU, tau=TAU, rounding="floor").tolist() == [3]
    # ratio 0.75 -> 7.5 -> half-even 8
    assert split_budget(h([MU - TAU * math.log(3)]), 10, mu=MU, tau=TAU).tolist() == [8]


def test_saliency_ratio_range():
    # kr in (0.2, 0.8) at H = mu: 0.2 + 0.5 * 0.6 = 0.5 -> 32 of 64; saturated low H -> 0.8 * 64 = 51.2 -> 51
    ent = h([MU, 0.0, 1.0])
    assert split_budget(ent, 64, mu=MU, tau=TAU, ratio_range=(0.2, 0.8)).tolist() == [32, 51, 13]


def test_select_reports_split_and_entropy():
    x = torch.randn(3, 40, 16)
    s = torch.rand(3, 40)
    sel = promprune.select(x, s, budget=12, method="promprune")
    ent = promprune.spectral_entropy(x)
    assert torch.allclose(sel.entropy, ent, atol=1e-5)
    assert sel.saliency_count.tolist() == split_budget(ent, 12, mu=MU, tau=TAU).tolist()
    # mu far above the entropy -> all salient; far below -> all coverage
    assert promprune.select(x, s, budget=12, mu=5.0).saliency_count.tolist() == [12] * 3
    assert promprune.select(x, s, budget=12, mu=-5.0).saliency_count.tolist() == [0] * 3


def test_fixed_ratio_split():
    x, s = torch.randn(2, 30, 8), torch.rand(2, 30)
    low = promprune.select(x, s, budget=10, method="fixed_ratio", saliency_ratio=0.25)
    high = promprune.select(x, s, budget=10, method="fixed_ratio", saliency_ratio=0.35)
    assert low.saliency_count.tolist() == [2, 2]
    assert high.saliency_count.tolist() == [4, 4]
    with pytest.raises(ValueError, match="saliency_ratio"):
        promprune.select(x, s, budget=10, method="fixed_ratio", saliency_ratio=1.5)
