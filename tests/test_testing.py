"""`promprune.testing.check_method` catches each broken invariant: a method written to break exactly one of them
fails exactly that check, with a message saying what was seen; a correct method passes every check."""
from __future__ import annotations

import pytest
import torch

import promprune
from promprune.selection import registry
from promprune.selection.registry import Selection
from promprune.testing import CHECKS, CUDA_ONLY, check_method


def _norm_top(tokens, budget: int) -> torch.Tensor:
    """The reference behaviour the broken methods start from: the ``budget`` tokens of largest norm ``[B, T]``."""
    return tokens.x.norm(dim=-1).argsort(dim=1, descending=True, stable=True)[:, :budget]


def _selection(idx: torch.Tensor, **kw) -> Selection:
    B, T = idx.shape
    return Selection(idx, torch.zeros(B, dtype=torch.long, device=idx.device),
                     salient=torch.zeros(B, T, dtype=torch.bool, device=idx.device), **kw)


def good(tokens, budget):
    """Correct."""
    return _selection(_norm_top(tokens, budget))


def repeats(tokens, budget):
    """Keeps the top token twice."""
    idx = _norm_top(tokens, budget)
    if budget > 1:
        idx[:, 1] = idx[:, 0]
    return _selection(idx)


def one_short(tokens, budget):
    """Keeps one token fewer than asked (unless asked for one)."""
    return _selection(_norm_top(tokens, max(1, budget - 1)))


def batch_scaled(tokens, budget):
    """Scores each token against the batch's largest norm, and keeps the small ones when that is large: an image's
    choice depends on the others."""
    norms = tokens.x.norm(dim=-1)
    flip = norms.max() > 50  # the mixed batch holds a 3x image; alone the others do not cross it
    idx = norms.argsort(dim=1, descending=not bool(flip), stable=True)[:, :budget]
    return _selection(idx)


def unseeded(tokens, budget):
    """A fresh random permutation on every call."""
    idx = torch.stack([torch.randperm(tokens.n, device=tokens.x.device)[:budget] for _ in range(tokens.batch)])
    return _selection(idx)


def half_aware(tokens, budget):
    """Looks at the input's own dtype: half inputs keep the smallest tokens."""
    low = tokens.source.dtype in (torch.float16, torch.bfloat16)
    idx = tokens.x.norm(dim=-1).argsort(dim=1, descending=not low, stable=True)[:, :budget]
    return _selection(idx)


def needs_scores(tokens, budget):
    """Reads saliency without declaring it."""
    s = tokens.require_saliency("needs_scores")
    return _selection(s.argsort(dim=1, descending=True, stable=True)[:, :budget])


def nan_entropy(tokens, budget):
    """Reports an entropy that is NaN when some token is all zero (no epsilon)."""
    norms = tokens.x.norm(dim=-1, keepdim=True)
    p = (tokens.x / norms).abs().sum(dim=-1)  # 0/0 for a zero token
    return _selection(_norm_top(tokens, budget), entropy=p.sum(dim=1))


def doubles(tokens, budget):
    """Merges: returns each kept token's features doubled, even when it keeps every token."""
    idx = _norm_top(tokens, budget)
    return _selection(idx, features=2 * tokens.x.gather(1, idx[..., None].expand(-1, -1, tokens.dim)))


def miscounts(tokens, budget):
    """Says it kept salient tokens but marks none."""
    idx = _norm_top(tokens, budget)
    return Selection(idx, torch.ones(tokens.batch, dtype=torch.long), salient=torch.zeros_like(idx, dtype=torch.bool))


BROKEN = {  # method -> (function, registration flags, the one check it must fail)
    "t_repeats": (repeats, {}, "unique_in_range"),
    "t_one_short": (one_short, {}, "exact_budget"),
    "t_batch_scaled": (batch_scaled, {}, "batch_equals_single"),
    "t_unseeded": (unseeded, {}, "deterministic"),
    "t_half_aware": (half_aware, {}, "dtype_and_device"),
    "t_needs_scores": (needs_scores, {}, "saliency_when_declared"),
    "t_nan_entropy": (nan_entropy, {}, "degenerate_tokens"),
    "t_doubles": (doubles, {"merges": True}, "budget_at_least_n"),
    "t_miscounts": (miscounts, {}, "exact_budget"),
}


@pytest.fixture(scope="module")
def registered():
    """The methods above, registered for this module only."""
    names = {"t_good": (good, {}, None), **BROKEN}
    for name, (fn, flags, _) in names.items():
        promprune.register_method(name, **flags)(fn)
    yield names
    for name in names:
        registry._REGISTRY.pop(name, None)


def test_a_correct_method_passes_every_check(registered):
    expected = [c for c in CHECKS if c not in CUDA_ONLY or torch.cuda.is_available()]
    assert check_method("t_good") == expected


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_broken_method_fails_its_invariant(registered, name):
    """Each fails its own check, in the full listing (other checks may fail as a consequence) and alone."""
    _, _, check = BROKEN[name]
    listing = rf"method '{name}': \d+ of \d+ invariant\(s\) fail:\n(.*\n)*  - {check}: "
    with pytest.raises(AssertionError, match=listing):
        check_method(name)
    with pytest.raises(AssertionError, match=f"  - {check}: "):
        check_method(name, only=[check])


def test_failures_say_what_was_seen(registered):
    with pytest.raises(AssertionError, match=r"budget 7: indices have shape \(3, 6\), want \[B, T\] = \(3, 7\)"):
        check_method("t_one_short", only=["exact_budget"])
    with pytest.raises(AssertionError, match="declare needs_saliency=True"):
        check_method("t_needs_scores", only=["saliency_when_declared"])
    with pytest.raises(AssertionError, match="repeated indices"):
        check_method("t_repeats", only=["unique_in_range"])


def test_options_and_bad_calls():
    assert check_method("promprune", options={"diversity": "fps"}, only=["deterministic"]) == ["deterministic"]
    with pytest.raises(ValueError, match="did you mean 'tau'"):
        check_method("promprune", options={"tua": 0.1})
    with pytest.raises(ValueError, match="did you mean 'promprune'"):
        check_method("promprun")
    with pytest.raises(ValueError, match="prunes inside the LLM"):
        check_method("fastv")
    with pytest.raises(ValueError, match="unknown check"):
        check_method("promprune", only=["exact_budgets"])
