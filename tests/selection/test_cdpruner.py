"""CDPruner: relevance weighting of the DPP kernel, worked by hand and against a naive log-det greedy."""
import math

import pytest
import torch

import promprune
from promprune.selection.cdpruner import relevance
from promprune.selection.diversity import GAIN_EPS
from promprune.selection.registry import Instruction, TokenSet


def instruction(cosines, source):
    """Three visual tokens whose embeddings have the given cosines with a unit query e0."""
    tokens = torch.tensor([[c, math.sqrt(1 - c * c)] for c in cosines])[None]  # [1, 3, 2], unit rows
    return Instruction(query=torch.tensor([[1.0, 0.0]]), tokens=tokens, source=source)


COS = [0.9, 0.1, -0.5]


def test_clip_relevance_is_the_negated_cosine_min_max_normalized():
    x = torch.eye(3)[None]
    r = relevance(TokenSet(x, None, instruction=instruction(COS, "clip")), negate=None, theta=None)
    # negated: -0.9, -0.1, 0.5; (r - min + 1e-6) / (max - min) with min -0.9, max 0.5
    torch.testing.assert_close(r[0], torch.tensor([1e-6, 0.8 + 1e-6, 1.4 + 1e-6]) / 1.4)
    r_llm = relevance(TokenSet(x, None, instruction=instruction(COS, "llm")), negate=None, theta=None)
    torch.testing.assert_close(r_llm[0], torch.tensor([1.4 + 1e-6, 0.6 + 1e-6, 1e-6]) / 1.4)
    theta = relevance(TokenSet(x, None, instruction=instruction(COS, "llm")), negate=None, theta=0.5)
    # alpha = 0.5 / (2 * 0.5); exp(alpha r) divided by its largest (a factor the greedy's picks do not see)
    torch.testing.assert_close(theta, torch.exp(0.5 * r_llm) / torch.exp(0.5 * r_llm).max())


@pytest.mark.parametrize("source,first,second", [("clip", 2, 1), ("llm", 0, 1)])
def test_orthogonal_tokens_are_taken_by_relevance(source, first, second):
    # S = I, so the kernel is diag(r^2) and the greedy MAP takes tokens by relevance
    x = torch.eye(3)[None]
    sel = promprune.select(x, budget=2, method="cdpruner", instruction=instruction(COS, source), order="selection")
    assert sel.indices.tolist() == [[first, second]]
    assert sel.saliency_count.tolist() == [0]


def test_relevance_trades_off_against_similarity():
    # tokens 0 and 1 are near duplicates (cos 0.99), token 2 is orthogonal to both
    x = torch.tensor([[1.0, 0.0], [0.99, 0.141], [0.0, 1.0]])[None]
    text = instruction([0.9, 0.85, 0.8], "llm")  # r = [1, 0.5, 1e-5]
    # gains after token 0: token 1: 0.5^2 (1 - 0.99^2) = 0.005 > token 2: (1e-5)^2: the relevant duplicate wins
    sel = promprune.select(x, budget=2, method="cdpruner", instruction=text, order="selection")
    assert sel.indices.tolist() == [[0, 1]]
    # theta 0.5: weights exp(0.5 r) = [1.65, 1.28, 1.0]; gains 1.28^2 * 0.02 = 0.033 < 1.0: the orthogonal token
    sel = promprune.select(x, budget=2, method="cdpruner", instruction=text, theta=0.5, order="selection")
    assert sel.indices.tolist() == [[0, 2]]


def naive_greedy(kernel, budget, eps=None):
    """Greedy MAP by brute force: add the token maximizing log det of the kernel on the chosen set. With ``eps``, the
    documented fill (``dpp_greedy``): once no gain det(K[S + j]) / det(K[S]) exceeds ``eps``, the lowest free index."""
    chosen = []
    for _ in range(budget):
        base = torch.logdet(kernel[chosen][:, chosen].double()).item() if chosen else 0.0
        logdets = {j: torch.logdet(kernel[chosen + [j]][:, chosen + [j]].double()).item()
                   for j in range(kernel.shape[0]) if j not in chosen}
        best = max(logdets, key=logdets.get)
        filled = eps is not None and not math.exp(logdets[best] - base) > eps
        chosen.append(min(logdets) if filled else best)
    return chosen


def test_matches_a_naive_log_det_greedy_on_the_relevance_weighted_kernel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, 16, generator=g)
    text = Instruction(query=torch.randn(1, 8, generator=g), tokens=torch.randn(1, 12, 8, generator=g))
    sel = promprune.select(x, budget=5, method="cdpruner", instruction=text, order="selection")
    r = relevance(TokenSet(x, None, instruction=text), negate=None, theta=None)[0]
    xn = torch.nn.functional.normalize(x[0], dim=-1)
    kernel = r[:, None] * (xn @ xn.T) * r[None, :]
    assert sel.indices[0].tolist() == naive_greedy(kernel, 5)


@pytest.mark.parametrize("theta", [0.5, 0.9, 0.99])
def test_theta_matches_the_naive_greedy_on_the_float64_kernel(theta):
    # the weights exp(alpha r) in float64, divided by the largest; at theta 0.99 (alpha 49.5) their unscaled float32
    # kernel overflowed (e^99) and the selection repeated token 0 seven times. There the weights span e^49.5, so after
    # the few most relevant tokens every gain is below GAIN_EPS and the rest are filled in raster order
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 40, 16, generator=g)
    text = Instruction(query=x[:, 0], tokens=x)
    sel = promprune.select(x, budget=8, method="cdpruner", instruction=text, theta=theta, order="selection")
    r = relevance(TokenSet(x, None, instruction=text), negate=None, theta=None)[0].double()
    w = torch.exp(theta / (2 * (1 - theta)) * r)
    w = w / w.max()
    xn = torch.nn.functional.normalize(x[0].double(), dim=-1)
    assert sel.indices[0].tolist() == naive_greedy(w[:, None] * (xn @ xn.T) * w[None, :], 8, GAIN_EPS)


def test_theta_near_one_still_keeps_distinct_tokens():
    x = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(0))
    sel = promprune.select(x, budget=8, method="cdpruner", instruction=Instruction(query=x[:, 0], tokens=x),
                           theta=0.9999)
    assert all(len(set(row)) == 8 for row in sel.indices.tolist())


def test_one_selection_per_question():
    x = torch.randn(1, 10, 6, generator=torch.Generator().manual_seed(1))
    picks = {tuple(promprune.select(x, budget=3, method="cdpruner",
                                    instruction=Instruction(query=q[None], tokens=x)).indices[0].tolist())
             for q in x[0]}
    assert len(picks) > 1  # the same image, different questions: different tokens


def test_needs_an_instruction():
    with pytest.raises(ValueError, match="relevance to the instruction"):
        promprune.select(torch.randn(1, 4, 3), budget=2, method="cdpruner")
    with pytest.raises(ValueError, match="instruction.tokens must be a tensor"):
        promprune.select(torch.randn(1, 4, 3), budget=2, method="cdpruner",
                         instruction=Instruction(torch.randn(1, 5), torch.randn(1, 3, 5)))
    with pytest.raises(ValueError, match="'theta'"):
        promprune.select(torch.randn(1, 4, 3), budget=2, method="cdpruner", theta=1.0,
                         instruction=Instruction(torch.randn(1, 5), torch.randn(1, 4, 5)))

