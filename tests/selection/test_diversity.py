"""Coverage selectors against naive reference computations (log-determinants, brute-force objectives)."""
import numpy as np
import pytest
import torch

import promprune
from promprune.selection.diversity import dpp_greedy, facility_location, farthest_point


def cosine(x: torch.Tensor) -> torch.Tensor:
    xn = x / x.norm(dim=-1, keepdim=True)
    return xn @ xn.transpose(-1, -2)


def naive_dpp(L: np.ndarray, candidates, k: int, given=()):
    """Greedy MAP by recomputing log det(L[S, S]) for every candidate (float64); ``given`` is conditioned on."""
    chosen = list(given)
    picks = []
    for _ in range(k):
        best, best_val = None, -np.inf
        for j in candidates:
            if j in chosen:
                continue
            idx = chosen + [j]
            sign, val = np.linalg.slogdet(L[np.ix_(idx, idx)])
            val = val if sign > 0 else -np.inf
            if val > best_val + 1e-9:
                best, best_val = j, val
        picks.append(best)
        chosen.append(best)
    return picks


@pytest.mark.parametrize("seed", range(5))
def test_dpp_matches_naive_logdet_greedy(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 14, 20, generator=g, dtype=torch.float64)  # d > N: full-rank kernel
    L = cosine(x)
    avail = torch.ones(2, 14, dtype=torch.bool)
    counts = torch.tensor([6, 4])
    picks = dpp_greedy(L.float(), avail, counts)
    for b in range(2):
        want = naive_dpp(L[b].numpy(), range(14), int(counts[b]))
        got = picks[b, : counts[b]].tolist()
        assert got == want
    assert picks[1, 4:].tolist() == [-1, -1]


@pytest.mark.parametrize("seed", range(4))
def test_conditional_dpp_is_greedy_on_the_schur_complement(seed):
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(1, 12, 24, generator=g, dtype=torch.float64)
    L = cosine(x)
    anchor = torch.zeros(1, 12, dtype=torch.bool)
    anchor[0, [2, 7, 9]] = True
    picks = dpp_greedy(L.float(), ~anchor, torch.tensor([5]), anchor=anchor, conditional=True)
    # log det(L[A+S]) = log det(L[A]) + log det(Schur complement on S): greedy on the joint determinant.
    want = naive_dpp(L[0].numpy(), [j for j in range(12) if not anchor[0, j]], 5, given=[2, 7, 9])
    assert picks[0].tolist() == want


def test_dpp_first_pick_rule_with_anchor():
    # 2-D unit tokens at angles; anchor = token at 0 deg. The available token least similar to the anchor is at
    # 180 deg (index 3); afterwards the largest gain.
    ang = torch.tensor([0.0, 30.0, 90.0, 180.0, 200.0, 270.0]) * torch.pi / 180
    x = torch.stack([ang.cos(), ang.sin()], dim=-1)[None].double()
    anchor = torch.zeros(1, 6, dtype=torch.bool)
    anchor[0, 0] = True
    picks = dpp_greedy(cosine(x).float(), ~anchor, torch.tensor([2]), anchor=anchor)
    assert picks[0, 0].item() == 3
    # second pick: largest residual gain given {3} = the token most orthogonal to 180 deg among the rest: 90 or 270
    # (equal gains, first index wins) -> index 2
    assert picks[0, 1].item() == 2


def test_dpp_beyond_rank_fills_by_fallback_without_repeats():
    # 10 tokens in a 3-d space: the kernel has rank 3, so after 3 picks every gain is 0.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 10, 3, generator=g)
    fallback = torch.arange(10, dtype=torch.float32)[None]  # prefer high index
    picks = dpp_greedy(cosine(x), torch.ones(1, 10, dtype=torch.bool), torch.tensor([8]), fallback=fallback)[0]
    assert len(set(picks.tolist())) == 8
    first3 = picks[:3].tolist()
    rest = [j for j in range(9, -1, -1) if j not in first3][:5]
    assert picks[3:].tolist() == rest


def naive_fps(D: np.ndarray, k: int, avail, anchor=()):
    avail = list(avail)
    if anchor:
        first = max(avail, key=lambda j: (min(D[j, a] for a in anchor), -j))
    else:
        first = max(avail, key=lambda j: (min(D[j, i] for i in avail if i != j), -j))
    picks = [first]
    while len(picks) < k:
        nxt = max((j for j in avail if j not in picks), key=lambda j: (min(D[j, p] for p in picks), -j))
        picks.append(nxt)
    return picks


@pytest.mark.parametrize("seed", range(4))
def test_farthest_point_matches_naive(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 15, 6, generator=g, dtype=torch.float64)
    D = (1 - cosine(x))[0]
    got = farthest_point(D[None].float(), torch.ones(1, 15, dtype=torch.bool), torch.tensor([6]))[0].tolist()
    assert got == naive_fps(D.numpy(), 6, range(15))
    anchor = torch.zeros(1, 15, dtype=torch.bool)
    anchor[0, [0, 4]] = True
    got = farthest_point(D[None].float(), ~anchor, torch.tensor([5]), anchor=anchor)[0].tolist()
    assert got == naive_fps(D.numpy(), 5, [j for j in range(15) if j not in (0, 4)], anchor=(0, 4))


@pytest.mark.parametrize("seed", range(4))
def test_facility_location_is_greedy_on_the_objective(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 12, 5, generator=g, dtype=torch.float64)
    S = ((cosine(x) + 1) / 2).clamp(0, 1)[0].numpy()

    def objective(sel):
        return S[:, sel].max(axis=1).sum() if sel else 0.0

    chosen = []
    for _ in range(5):
        chosen.append(max((j for j in range(12) if j not in chosen), key=lambda j: (objective(chosen + [j]), -j)))
    got = facility_location(torch.tensor(S)[None].float(), torch.ones(1, 12, dtype=torch.bool), torch.tensor([5]))
    assert got[0].tolist() == chosen


@pytest.mark.parametrize("seed", range(4))
def test_facility_location_covers_the_candidate_set_only(seed):
    """The paper's objective F(S) = sum_{i in R} max_{j in S} s_ij over the candidate set R (the tokens stage 1
    left): a token outside R is no client. Counting every token of the image as one picked other tokens (12 of 32
    coverage picks at 576 tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 4, generator=g, dtype=torch.float64)
    S = ((cosine(x) + 1) / 2).clamp(0, 1)[0].numpy()
    R = [i for i in range(16) if i % 3 != 0]  # stage 1 took every third token

    def objective(sel):
        return S[np.ix_(R, sel)].max(axis=1).sum() if sel else 0.0

    chosen = []
    for _ in range(5):
        chosen.append(max((j for j in R if j not in chosen), key=lambda j: (objective(chosen + [j]), -j)))
    available = torch.tensor([[i in R for i in range(16)]])
    got = facility_location(torch.tensor(S)[None].float(), available, torch.tensor([5]))
    assert got[0].tolist() == chosen


def test_divprune_hand_example():
    # Unit 2-D tokens at angles (deg). Nearest-neighbour cosine distances: the token at 180 deg is the most
    # isolated (its nearest neighbours are 60+ deg away) -> first pick. Then the token farthest from it: 0 or 10 deg
    # (0 deg is farther: 180 vs 170) -> index 0. Then max-min to {180, 0}: 90 deg (index 3, 90 from both).
    ang = torch.tensor([0.0, 10.0, 20.0, 90.0, 100.0, 180.0]) * torch.pi / 180
    x = torch.stack([ang.cos(), ang.sin()], dim=-1)[None]
    sel = promprune.select(x, budget=3, method="divprune", order="selection")
    assert sel.indices[0].tolist() == [5, 0, 3]
    assert sel.saliency_count.tolist() == [0]


def test_coverage_only_fps_equals_divprune():
    x = torch.randn(2, 30, 12)
    a = promprune.select(x, budget=9, method="coverage_only", diversity="fps").indices
    b = promprune.select(x, budget=9, method="divprune").indices
    assert torch.equal(a, b)


def test_dpp_without_anchor_starts_from_the_most_salient_token():
    # Every token's initial gain is exactly 1 (the cosine kernel's diagonal): the tie goes to saliency, not to
    # rounding noise, so attention backends and devices agree.
    x, s = torch.randn(3, 40, 16), torch.rand(3, 40)
    sel = promprune.select(x, s, budget=6, method="promprune", mu=-5.0, order="selection")  # T_sal = 0
    assert sel.saliency_count.tolist() == [0, 0, 0]
    assert sel.indices[:, 0].tolist() == s.argmax(dim=1).tolist()
    # without saliency: the lowest index
    assert promprune.select(x, budget=6, method="coverage_only", order="selection").indices[:, 0].tolist() == [0] * 3


def test_facility_location_picks_the_same_in_float32_and_float64():
    """Once two clients remain under-covered, their gains agree mathematically (1 + s_ab - c_a - c_b) and differ in
    the last bits, so float32 and float64 picked differently in 23 of 600 random cases (a probe's count). Near ties
    (FL_TIE_EPS) go to the lowest index in both."""
    differ = 0
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 10, 8, generator=g, dtype=torch.float64)
        if seed % 3 == 0:
            x[0, 5] = x[0, 2] * 3.0  # a scaled duplicate: the same cosine row
        S = ((cosine(x) + 1) / 2).clamp(0, 1)
        for budget in (3, 5):
            args = (torch.ones(1, 10, dtype=torch.bool), torch.tensor([budget]))
            differ += facility_location(S, *args).tolist() != facility_location(S.float(), *args).tolist()
    assert differ == 0


def test_facility_location_breaks_an_exact_tie_by_the_lowest_index():
    """Hand-worked: two identical candidates (columns 1 and 2 equal) after token 0 is picked; the next gain is the same
    for both up to rounding: index 1 is taken in either order of its rounding."""
    S = torch.tensor([[1.0, 0.2, 0.2], [0.2, 1.0, 1.0], [0.2, 1.0, 1.0]], dtype=torch.float64)
    for nudge in (1e-15, -1e-15):  # column 2's gain a hair above, then below, column 1's
        T = S.clone()
        T[1, 2] += nudge
        got = facility_location(T[None], torch.ones(1, 3, dtype=torch.bool), torch.tensor([2]))
        assert got[0].tolist() == [1, 0]  # first: a duplicate pair's gain 1 + 1 + .2 = 2.2 beats token 0's 1.4


def test_dpp_first_pick_skips_a_token_with_no_gain():
    """An fp16 feature that underflowed to zero has cosine 0 to everything: least similar to the anchor, it was the
    first pick, whose zero gain sent the step to the fallback (the most salient token) while the other gains were
    positive. methods.md: the fallback only once every residual gain is 0. By hand: anchor at 0 deg; the nonzero
    token least similar to it is at 80 deg (index 3, cosine 0.17: above the zero token's 0)."""
    ang = torch.tensor([0.0, 30.0, 60.0, 80.0, 0.0]) * torch.pi / 180
    x = torch.stack([ang.cos(), ang.sin()], dim=-1)[None].double()
    x[0, 4] = 0.0  # the zero token
    norms = x.norm(dim=-1, keepdim=True)
    K = (x / norms.clamp_min(1e-12)) @ (x / norms.clamp_min(1e-12)).transpose(1, 2)
    anchor = torch.zeros(1, 5, dtype=torch.bool)
    anchor[0, 0] = True
    saliency = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    picks = dpp_greedy(K.float(), ~anchor, torch.tensor([1]), anchor=anchor, fallback=saliency)
    assert picks[0, 0].item() == 3  # not 4 (the zero token), nor 1 (the fallback's most salient free token)
