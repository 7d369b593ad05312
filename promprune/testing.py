"""``check_method(name)``: the invariants every pre-LLM method of this package satisfies, checked on any registered
method. The test suite runs them on every registered method (``tests/selection/test_select.py``); a method of
one's own is tested with one line::

    from promprune.testing import check_method

    def test_my_method():
        check_method("my_method")            # or check_method("my_method", options={"p": 1.0})

The invariants (``CHECKS``, each a function of a :class:`Case`), all through ``promprune.select``:

- ``exact_budget``: ``budget`` tokens per image for several budgets: ``indices [B, T]`` long, ``saliency_count [B]``
  in [0, T], ``salient [B, T]`` marking that many (or None and a count of 0), merged ``features [B, T, d]`` exactly
  when the method declares ``merges``.
- ``unique_in_range``: the kept indices of an image are distinct, in [0, N), ascending by default, and
  ``order="selection"`` returns the same set in the method's own order.
- ``budget_at_least_n``: a budget of N or more keeps every token (a merging method's features are the tokens).
- ``batch_equals_single``: an image selects the same tokens in a batch as alone (images of different scales and a
  concentrated one, so an adaptive split differs per image).
- ``deterministic``: the same call twice gives the same selection.
- ``dtype_and_device``: float16 / bfloat16 features select what their float32 upcast selects and merged features
  come back in the input's dtype; outputs stay on the input's device; on a CUDA machine the GPU selects what the
  CPU selects.
- ``degenerate_tokens``: all-zero and duplicated tokens, and images of one token repeated or of zeros only, still
  give T distinct tokens and finite outputs.
- ``inputs_unchanged``: the call leaves its inputs as they were (features, saliency, an instruction's tensors): a
  method that edits ``tokens.x`` in place would change the caller's float32 features, which ``select`` does not copy.
- ``saliency_when_declared``: a method that does not declare ``needs_saliency`` runs without saliency scores and
  its selection does not depend on them (the model adapters pass saliency only to methods that declare it).

In-LLM methods (``stage="in_llm"``) prune inside the language model; they are checked through ``PrunedVLM``
(``tests/models/test_in_llm.py``), not here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import promprune

B, N, D = 3, 48, 24  # a small batch of N tokens in d dimensions: N > d, as on every real encoder
BUDGETS = (1, 7, 16)  # one token, an odd count, a third of N


def inputs(B: int = B, N: int = N, d: int = D, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [B, N, d], saliency [B, N])``, seeded: rank-4 structure plus noise (a spectrum with a few large
    directions, like projected visual tokens) and uniform saliency."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, 4, generator=g) @ torch.randn(B, 4, d, generator=g) + 0.5 * torch.randn(B, N, d, generator=g)
    return x, torch.rand(B, N, generator=g)


@dataclass
class Case:
    """One method under check: its registry entry, the options it runs with, and the device of the inputs."""

    method: str
    options: dict = field(default_factory=dict)
    device: str = "cpu"

    @property
    def spec(self) -> promprune.MethodSpec:
        return promprune.method_spec(self.method)

    def select(self, x: torch.Tensor, s: torch.Tensor | None, budget: int, **kw) -> promprune.Selection:
        """``promprune.select`` on ``self.device`` with the case's options; an instruction made from the features
        for methods that need one."""
        x = x.to(self.device)
        s = None if s is None else s.to(self.device)
        if self.spec.needs_instruction and "instruction" not in kw:
            kw["instruction"] = promprune.Instruction(query=x[:, 0].float(), tokens=x)
        return promprune.select(x, s, budget=budget, method=self.method, **{**self.options, **kw})


CHECKS: dict[str, Callable[[Case], None]] = {}
CUDA_ONLY = {"cuda_matches_cpu"}


def _check(fn: Callable[[Case], None]) -> Callable[[Case], None]:
    CHECKS[fn.__name__] = fn
    return fn


def _expect(ok: bool, text: str) -> None:
    if not ok:
        raise AssertionError(text)


@_check
def exact_budget(case: Case) -> None:
    x, s = inputs()
    for budget in BUDGETS:
        sel = case.select(x, s, budget)
        at = f"budget {budget}"
        _expect(tuple(sel.indices.shape) == (B, budget), f"{at}: indices have shape {tuple(sel.indices.shape)}, "
                                                         f"want [B, T] = {(B, budget)}")
        _expect(sel.indices.dtype == torch.long, f"{at}: indices are {sel.indices.dtype}, want torch.long")
        counts = sel.saliency_count
        _expect(tuple(counts.shape) == (B,), f"{at}: saliency_count has shape {tuple(counts.shape)}, want ({B},)")
        _expect(bool(((counts >= 0) & (counts <= budget)).all()), f"{at}: saliency_count {counts.tolist()} outside "
                                                                  f"[0, {budget}]")
        if sel.salient is None:
            _expect(bool((counts == 0).all()), f"{at}: salient is None but saliency_count is {counts.tolist()}")
        else:
            _expect(tuple(sel.salient.shape) == (B, budget) and sel.salient.dtype == torch.bool,
                    f"{at}: salient must be a bool tensor [B, T] = {(B, budget)}, got {sel.salient.dtype} "
                    f"{tuple(sel.salient.shape)}")
            _expect(torch.equal(sel.salient.sum(dim=1).cpu(), counts.cpu()),
                    f"{at}: salient marks {sel.salient.sum(dim=1).tolist()} tokens, saliency_count says "
                    f"{counts.tolist()}")
        merges = case.spec.merges
        _expect((sel.features is not None) == merges,
                f"{at}: the method {'declares' if merges else 'does not declare'} merges=True but returns "
                f"{'no ' if sel.features is None else ''}merged features")
        if sel.features is not None:
            _expect(tuple(sel.features.shape) == (B, budget, D), f"{at}: features have shape "
                                                                 f"{tuple(sel.features.shape)}, want {(B, budget, D)}")


@_check
def unique_in_range(case: Case) -> None:
    x, s = inputs()
    for budget in BUDGETS:
        asc = case.select(x, s, budget)
        for b, row in enumerate(asc.indices.tolist()):
            _expect(len(set(row)) == len(row), f"budget {budget}, image {b}: repeated indices {row}")
            _expect(all(0 <= i < N for i in row), f"budget {budget}, image {b}: indices outside [0, {N}): {row}")
            _expect(row == sorted(row), f"budget {budget}, image {b}: indices not ascending: {row}")
        raw = case.select(x, s, budget, order="selection")
        _expect(torch.equal(raw.indices.sort(dim=1).values, asc.indices),
                f"budget {budget}: order='selection' keeps other tokens than the default order")


@_check
def budget_at_least_n(case: Case) -> None:
    x, s = inputs(B=2, N=10)
    for budget in (10, 25):
        sel = case.select(x, s, budget)
        _expect(sel.indices.tolist() == [list(range(10))] * 2,
                f"budget {budget} >= N = 10 keeps {sel.indices.tolist()}, want every token")
        if sel.features is not None:
            _expect(torch.allclose(sel.features.cpu(), x), f"budget {budget} >= N: merged features are not the "
                                                           "tokens themselves")


def _mixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four images of different scales, the last concentrated in one direction (low entropy)."""
    x, s = inputs(B=4, seed=1)
    x = x * torch.tensor([1.0, 0.1, 3.0, 1.0])[:, None, None]
    x[3] = x[3, :1] + 0.01 * x[3]
    return x, s


@_check
def batch_equals_single(case: Case) -> None:
    x, s = _mixed_batch()
    batched = case.select(x, s, 12)
    for b in range(x.shape[0]):
        one = case.select(x[b:b + 1], s[b:b + 1], 12)
        _expect(torch.equal(one.indices[0].cpu(), batched.indices[b].cpu()),
                f"image {b} keeps {one.indices[0].tolist()} alone but {batched.indices[b].tolist()} in a batch")
        _expect(int(one.saliency_count[0]) == int(batched.saliency_count[b]),
                f"image {b}: saliency_count {int(one.saliency_count[0])} alone, {int(batched.saliency_count[b])} in "
                "a batch")
        if one.features is not None:
            _expect(torch.allclose(one.features[0], batched.features[b], rtol=1.3e-6, atol=1e-5),
                    f"image {b}: merged features differ between alone and in a batch")


@_check
def deterministic(case: Case) -> None:
    x, s = _mixed_batch()
    first, again = case.select(x, s, 12), case.select(x, s, 12)
    _expect(torch.equal(first.indices, again.indices), "the same call twice keeps different tokens")
    _expect(torch.equal(first.saliency_count, again.saliency_count), "the same call twice splits differently")
    if first.features is not None:
        _expect(torch.equal(first.features, again.features), "the same call twice merges differently")


@_check
def dtype_and_device(case: Case) -> None:
    x, s = inputs()
    for dtype in (torch.float16, torch.bfloat16):
        low = x.to(dtype)
        sel, ref = case.select(low, s, 8), case.select(low.float(), s, 8)
        _expect(torch.equal(sel.indices, ref.indices), f"{dtype} features keep {sel.indices.tolist()}, their float32 "
                                                       f"upcast {ref.indices.tolist()} (compute in float32)")
        for name in ("indices", "saliency_count", "salient", "features", "entropy"):
            t = getattr(sel, name)
            _expect(t is None or t.device.type == torch.device(case.device).type,
                    f"{name} is on {None if t is None else t.device}, the features on {case.device}")
        if sel.features is not None:
            _expect(sel.features.dtype == dtype, f"merged features are {sel.features.dtype}, the input {dtype}")


@_check
def cuda_matches_cpu(case: Case) -> None:
    """(A CUDA machine only.) The GPU keeps what the CPU keeps."""
    x, s = inputs()
    gpu = Case(case.method, case.options, "cuda").select(x, s, 12)
    cpu = Case(case.method, case.options, "cpu").select(x, s, 12)
    _expect(torch.equal(gpu.indices.cpu(), cpu.indices), f"CUDA keeps {gpu.indices.tolist()}, the CPU "
                                                         f"{cpu.indices.tolist()}")


@_check
def degenerate_tokens(case: Case) -> None:
    x, s = inputs(B=4, N=20)
    x[:2, :5] = 0.0  # padding-like tokens
    x[:2, 5:10] = x[:2, 10:11]  # exact duplicates
    x[2] = x[2, :1]  # one token repeated: every token the same
    x[3] = 0.0  # no token at all
    sel = case.select(x, s, 15)
    for b, row in enumerate(sel.indices.tolist()):
        _expect(len(set(row)) == 15 and all(0 <= i < 20 for i in row),
                f"zero and duplicate tokens: image {b} keeps {row}, not 15 distinct tokens of 20")
    for name in ("features", "entropy"):
        t = getattr(sel, name)
        _expect(t is None or bool(torch.isfinite(t).all()), f"zero and duplicate tokens: {name} not finite")


@_check
def inputs_unchanged(case: Case) -> None:
    x, s = inputs()
    query, tokens = x[:, 0].clone(), x.clone()
    kw = {}
    if case.spec.needs_instruction:
        kw["instruction"] = promprune.Instruction(query=query, tokens=tokens)
    before = [t.clone() for t in (x, s, query, tokens)]
    case.select(x, s, 12, **kw)
    for name, was, now in zip(("features", "saliency", "instruction.query", "instruction.tokens"), before,
                              (x, s, query, tokens)):
        _expect(torch.equal(was, now), f"select changed its input {name} in place (the caller's tensor); work on a "
                                       "copy (e.g. tokens.x.clone()) before editing it")


@_check
def saliency_when_declared(case: Case) -> None:
    if case.spec.needs_saliency:
        return  # declared: select refuses saliency=None itself, and the adapters always pass it
    x, s = inputs()
    other = torch.rand(s.shape, generator=torch.Generator().manual_seed(7))
    try:
        without = case.select(x, None, 12)
    except ValueError as exc:
        raise AssertionError(f"runs only with saliency scores ({exc}); declare needs_saliency=True") from None
    for scores, what in ((s, "saliency scores"), (other, "other saliency scores")):
        given = case.select(x, scores, 12)
        _expect(torch.equal(given.indices, without.indices),
                f"keeps other tokens with {what} than without, but does not declare needs_saliency=True (the model "
                "adapters pass saliency only to methods that declare it)")


def check_method(name: str, *, options: dict | None = None, only: list[str] | None = None,
                 device: str = "cpu") -> list[str]:
    """Check the registered pre-LLM method ``name`` (run with ``options`` over its defaults, on ``device``) against
    ``CHECKS`` (``only``: a subset, by name). Returns the names of the checks run (``cuda_matches_cpu`` needs CUDA);
    AssertionError listing every invariant that fails, each with what was seen."""
    spec = promprune.method_spec(name)  # an unknown name: ValueError with did-you-mean
    if spec.stage != promprune.PRE_LLM:
        raise ValueError(f"method {name!r} prunes inside the LLM; check_method checks pre-LLM methods (select). "
                         "Check an in-LLM method through promprune.models.PrunedVLM")
    unknown = sorted(set(only or []) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; checks: {', '.join(CHECKS)}")
    spec.resolve(options or {})  # a bad option: ValueError naming it, before any check runs
    case = Case(name, dict(options or {}), device)
    ran, failed = [], []
    for check, fn in CHECKS.items():
        if (only is not None and check not in only) or (check in CUDA_ONLY and not torch.cuda.is_available()):
            continue
        ran.append(check)
        try:
            fn(case)
        except AssertionError as exc:
            failed.append(f"{check}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a method that raises fails the invariant; reported with its cause
            failed.append(f"{check}: raised {type(exc).__name__}: {exc}")
    if failed:
        lines = "\n".join(f"  - {f}" for f in failed)
        raise AssertionError(f"method {name!r}: {len(failed)} of {len(ran)} invariant(s) fail:\n{lines}")
    return ran
