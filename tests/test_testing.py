"""`promprune.testing.check_method` catches each broken invariant: a method written to break exactly one of them
fails exactly that check, with a message saying what was seen; a correct method passes every check."""
from __future__ import annotations

import contextlib

import pytest
import torch

import promprune
from promprune.selection import registry
from promprune.selection.registry import Selection
from promprune.testing import CHECKS, CUDA_ONLY, check_method
from tests.selection.triton_cases import _fast


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


def edits_in_place(tokens, budget):
    """Whitens the tokens in place before ranking them: the caller's float32 features change."""
    tokens.x.sub_(tokens.x.mean(dim=1, keepdim=True))
    return _selection(_norm_top(tokens, budget))


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
    "t_edits_in_place": (edits_in_place, {}, "inputs_unchanged"),
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
    # select itself refuses the outputs it cannot use from a method of one's own (its message, as check_method lists it)
    with pytest.raises(AssertionError, match=r"exact_budget: raised ValueError: method 't_one_short' returned indices "
                                             r"of shape \(3, 6\) where the budget of 7 makes it \(3, 7\)"):
        check_method("t_one_short", only=["exact_budget"])
    with pytest.raises(AssertionError, match="declare needs_saliency=True"):
        check_method("t_needs_scores", only=["saliency_when_declared"])
    with pytest.raises(AssertionError, match=r"method 't_repeats' returned a token twice in a row of indices"):
        check_method("t_repeats", only=["unique_in_range"])


def _wraps_around(tokens, budget):
    """Ends every row with index -1 (Python's last token)."""
    idx = _norm_top(tokens, budget).clone()
    idx[:, -1] = -1
    return _selection(idx)


def _flagged(kind, extra: int = 0):
    """A method whose ``salient`` flags are ``kind`` (a dtype, or ``list``), ``extra`` columns wider than its indices;
    the first two tokens of each row salient."""
    def method(tokens, budget):
        idx = _norm_top(tokens, budget)
        flags = torch.arange(budget + extra).expand(tokens.batch, -1) < 2
        return Selection(idx, torch.full((tokens.batch,), min(2, budget)),
                         salient=flags.tolist() if kind is list else flags.to(kind))
    return method


@pytest.mark.parametrize("fn,message", [
    (_wraps_around, r"returned an index out of \[0, 24\) \(-1\)"),  # it wrapped to the last token, silently
    (one_short, r"returned indices of shape \(2, 7\) where the budget of 8 makes it \(2, 8\)"),  # ran on 7
    (lambda tokens, budget: _selection(_norm_top(tokens, budget).float()), "returned indices of dtype torch.float32"),
    (lambda tokens, budget: _norm_top(tokens, budget), "returned a Tensor, not a promprune.Selection"),
    # flags not bool: the GPU's ascending order read them a byte each and returned unwritten memory, the CPU gathered
    (_flagged(torch.long), "returned salient of dtype torch.int64, not torch.bool"),
    (_flagged(torch.float32), "returned salient of dtype torch.float32, not torch.bool"),
    (_flagged(list), "returned salient of dtype list, not torch.bool"),
    (_flagged(torch.bool, 1), r"returned salient of shape \(2, 9\), not the indices' \(2, 8\)"),
])
def test_select_refuses_what_a_method_of_ones_own_returns_wrong(fn, message):
    """A negative index wrapped to the last token and a short row ran a trial on fewer tokens than its budget, both
    without a word; a duplicate or an index past N failed deep in the model without the method's name."""
    promprune.register_method("t_wrong", replace=True)(fn)
    try:
        with pytest.raises(ValueError, match=f"method 't_wrong' {message}"):
            promprune.select(torch.randn(2, 24, 8), budget=8, method="t_wrong")
        with _fast("cpu"), pytest.raises(ValueError, match=f"method 't_wrong' {message}"):  # the GPU's path
            promprune.select(torch.randn(2, 24, 8), budget=8, method="t_wrong")
    finally:
        registry._REGISTRY.pop("t_wrong", None)
    narrow = lambda tokens, budget: _selection(_norm_top(tokens, budget).int())  # noqa: E731 - int32: taken as long
    promprune.register_method("t_int32")(narrow)
    try:
        assert promprune.select(torch.randn(2, 24, 8), budget=8, method="t_int32").indices.dtype == torch.long
    finally:
        registry._REGISTRY.pop("t_int32", None)
    promprune.register_method("t_bool_flags")(_flagged(torch.bool))
    try:
        sel = promprune.select(torch.randn(2, 24, 8), budget=8, method="t_bool_flags", order="selection")
        assert sel.salient.tolist() == [[True, True] + [False] * 6] * 2
    finally:
        registry._REGISTRY.pop("t_bool_flags", None)


def _returning(**fields):
    """A method keeping the 8 tokens of largest norm (of 24, 8 channels, batch 2) whose Selection's ``fields`` are
    replaced: each a value, or a function of ``(tokens, kept indices)``."""
    def method(tokens, budget):
        sel = _selection(_norm_top(tokens, budget))
        for key, value in fields.items():
            setattr(sel, key, value(tokens, sel.indices) if callable(value) else value)
        return sel
    return method


def _merged(tokens, idx):
    return tokens.x.gather(1, idx[..., None].expand(-1, -1, tokens.dim))


def _with_cls(width):
    """Keeps budget - 1 tokens and a CLS of ``width`` channels."""
    def method(tokens, budget):
        return _selection(_norm_top(tokens, budget - 1), cls=torch.zeros(tokens.batch, width))
    return method


@pytest.mark.parametrize("fn,merges,message", [
    # merged features of another shape: the ascending order's gather cut them to the indices' (silently)
    (_returning(features=lambda t, i: torch.cat([_merged(t, i), t.x.new_zeros(t.batch, 3, t.dim)], 1)), True,
     r"returned features of shape \(2, 11, 8\) and dtype torch.float32, not floats \(2, 8, 8\)"),
    (_returning(features=lambda t, i: _merged(t, i)[..., :-1]), True, r"returned features of shape \(2, 8, 7\)"),
    (_returning(features=lambda t, i: _merged(t, i).long()), True,
     r"returned features of shape \(2, 8, 8\) and dtype torch.int64, not floats"),
    (_returning(features=lambda t, i: torch.full_like(_merged(t, i), float("nan"))), True,
     "returned a NaN or infinite value in features"),
    (_returning(features=_merged), False, "returned merged features, but it was registered without merges=True"),
    (_with_cls(13), False, r"returned cls of shape \(2, 13\) and dtype torch.float32, not floats \(2, 8\)"),
    (_with_cls(8), False, None),  # the shape VisionZip returns: [B, d], the indices one fewer
    # a count past T, or fractional: recorded as the trial's saliency_count and t_sal metrics (silently)
    (_returning(saliency_count=torch.full((2,), 80)), False, r"returned saliency_count 80, outside \[0, 8\]"),
    (_returning(saliency_count=torch.tensor([2, -1])), False, r"returned saliency_count -1, outside \[0, 8\]"),
    (_returning(saliency_count=torch.zeros(2)), False, "returned saliency_count of dtype torch.float32, not integers"),
    (_returning(saliency_count=torch.zeros(2, dtype=torch.bool)), False, "returned saliency_count of dtype torch.bool"),
    # an entropy of another shape: every sample then failed in PrunedVLM with a TypeError not naming the method
    (_returning(entropy=torch.zeros(3, 7)), False, r"returned entropy of shape \(3, 7\) and dtype torch.float32, "
                                                   r"not floats \(2,\)"),
    (_returning(entropy=torch.zeros(2, dtype=torch.long)), False, "returned entropy of shape .* dtype torch.int64"),
    (_returning(entropy=torch.tensor([0.5, float("inf")])), False, "returned a NaN or infinite value in entropy"),
])
def test_select_refuses_the_fields_a_method_of_ones_own_returns_wrong(fn, merges, message):
    """Merged features, the CLS, the count and the entropy are checked as returned, before the ascending order
    reorders them, naming the method and the field; on the GPU's path too. None: the selection is fine."""
    promprune.register_method("t_wrong", merges=merges, replace=True)(fn)
    try:
        if message is None:
            assert promprune.select(torch.randn(2, 24, 8), budget=8, method="t_wrong").cls.shape == (2, 8)
            return
        for path in (contextlib.nullcontext(), _fast("cpu")):
            with path, pytest.raises(ValueError, match=f"method 't_wrong' {message}"):
                promprune.select(torch.randn(2, 24, 8), budget=8, method="t_wrong")
    finally:
        registry._REGISTRY.pop("t_wrong", None)


def test_check_method_refuses_merged_features_and_an_entropy_of_another_shape():
    """check_method's "merged features [B, T, d] exactly" held for features with 3 rows too many: the ascending order
    cut them before the check saw them; an entropy [3, 7] for 3 images passed every check."""
    long = _returning(features=lambda t, i: torch.cat([_merged(t, i), t.x.new_zeros(t.batch, 3, t.dim)], 1))
    promprune.register_method("t_long_features", merges=True)(long)
    promprune.register_method("t_entropy_2d")(_returning(entropy=lambda t, i: torch.zeros(t.batch, 7)))
    try:
        with pytest.raises(AssertionError, match=r"exact_budget: raised ValueError: method 't_long_features' "
                                                 r"returned features of shape \(3, 4, 24\)"):
            check_method("t_long_features", only=["exact_budget"])
        with pytest.raises(AssertionError, match=r"exact_budget: raised ValueError: method 't_entropy_2d' "
                                                 r"returned entropy of shape \(3, 7\)"):
            check_method("t_entropy_2d", only=["exact_budget"])
    finally:
        registry._REGISTRY.pop("t_long_features", None)
        registry._REGISTRY.pop("t_entropy_2d", None)


ORDER_TAKEN = r"names option\(s\) \['order'\], which are taken before the method sees them \('order': every pre-LLM"


def test_registration_refuses_what_would_fail_every_call():
    """A name taken, an option named like select's own arguments or one the function does not take, a name that is
    no string: refused as the method registers (they failed at every later call, or broke promprune.methods())."""
    with pytest.raises(ValueError, match=r"'divprune' is already registered \(one of promprune's own methods\): pick"):
        promprune.register_method("divprune")(good)
    promprune.register_method("t_twice")(good)
    try:
        with pytest.raises(ValueError, match=r"'t_twice' is already registered \(registered by .*good\).*replace=True"):
            promprune.register_method("t_twice")(good)
        promprune.register_method("t_twice", replace=True)(one_short)  # a notebook cell run again
        assert registry._REGISTRY["t_twice"].fn is one_short
    finally:
        registry._REGISTRY.pop("t_twice", None)
    with pytest.raises(ValueError, match=ORDER_TAKEN):
        promprune.register_method("t_order", options={"order": "x"})(lambda tokens, budget, *, order: None)
    with pytest.raises(ValueError, match=r"takes no parameter for option\(s\) \['p'\]"):
        promprune.register_method("t_p", options={"p": 2.0})(good)
    with pytest.raises(ValueError, match="must be a non-empty string"):
        promprune.register_method(None)(good)
    assert "t_order" not in promprune.methods() and "t_p" not in promprune.methods()
    # an adapter option or PrunedVLM's argument: PrunedVLM(..., pad_to_square=True) padded the image and the method
    # got its own default, silently; a case variant of a name: the report labelled both "PromPrune"
    for option, taker in (("pad_to_square", "an adapter option of promprune.models"), ("video_split", "an adapter"),
                          ("dtype", "an argument of PrunedVLM"), ("budget", "the budget")):
        with pytest.raises(ValueError, match=rf"register_method: method 't_a' names option\(s\) \['{option}'\], "
                                             rf"which are taken before the method sees them \('{option}': {taker}"):
            promprune.register_method("t_a", options={option: False})(lambda tokens, budget, **options: None)
    for name in ("PromPrune", "DIVPRUNE", "Random"):
        with pytest.raises(ValueError, match=rf"register_method: method '{name}' differs only in case from "
                                             rf"'{name.lower()}' \(one of promprune's own methods\)"):
            promprune.register_method(name)(good)
    promprune.register_method("t_Mine")(good)
    try:
        with pytest.raises(ValueError, match=r"'t_mine' differs only in case from 't_Mine' \(a method of one's own"):
            promprune.register_method("t_mine", replace=True)(good)
    finally:
        registry._REGISTRY.pop("t_Mine", None)
    assert not {"t_a", "PromPrune", "DIVPRUNE", "Random", "t_mine"} & set(promprune.methods())
    assert promprune.testing.check_method is check_method  # `import promprune` is enough for the docs' one-liner


def test_registration_refuses_choices_that_fail_every_call_and_names_meaning_unpruned():
    """Choices of an option that does not exist made every later select a bare KeyError; a default outside its own
    choices made every call leaving the option out a ValueError; a method named "none", "null" or "unpruned" (any
    case) was one the lmms-eval plugin's method= and the sweeps' baseline read as the unpruned model. All refused as
    the method registers, naming the option or the name."""
    def fn(tokens, budget, *, p=1.0):
        return good(tokens, budget)

    with pytest.raises(ValueError, match=r"method 't_z': choices name option 'z', which options does not declare"):
        promprune.register_method("t_z", options={"p": 1.0}, choices={"z": (1,)})(fn)
    with pytest.raises(ValueError, match=r"the default of option 'p', 1.0, is not one of its choices \[2.0, 3.0\]"):
        promprune.register_method("t_d", options={"p": 1.0}, choices={"p": (2.0, 3.0)})(fn)
    with pytest.raises(ValueError, match=r"choices of option 'p' must be a tuple"):
        promprune.register_method("t_s", options={"p": 1.0}, choices={"p": 1.0})(fn)
    with pytest.raises(ValueError, match=ORDER_TAKEN):
        promprune.register_method("t_o", choices={"order": ("selection",)})(good)
    for name in ("none", "null", "unpruned", "None", "NULL", "Unpruned"):
        with pytest.raises(ValueError, match=f"{name!r} names the unpruned model.*pick another name"):
            promprune.register_method(name)(good)
    assert not {"t_z", "t_d", "t_s", "t_o", "none", "None"} & set(promprune.methods())
    promprune.register_method("t_c", options={"p": 1.0}, choices={"p": (1.0, 2.0)})(fn)  # the default among them
    try:
        assert promprune.select(torch.randn(1, 5, 4), budget=2, method="t_c").indices.shape == (1, 2)
    finally:
        registry._REGISTRY.pop("t_c", None)
    from pipelines import mlflow_layout

    assert mlflow_layout.BASELINE_METHOD in registry.UNPRUNED_NAMES  # the sweeps' unpruned trial


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
