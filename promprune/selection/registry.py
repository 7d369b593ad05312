"""The method registry (every pruning method, wherever it prunes) and ``select``, the pre-LLM entry point.

A pre-LLM method is a function ``fn(tokens: TokenSet, budget: int, **options) -> Selection`` registered with
``@register_method(name, needs_saliency=..., options={...defaults}, choices=..., check=...)``. An in-LLM method
(``stage="in_llm"``) registers its options and checks with ``register_in_llm_method``; the hooks that prune inside the
language model are ``promprune.models.llm_hooks``'s: the built-ins' (FastV, SparseVLM, DART, PyramidDrop:
:data:`IN_LLM_HOOKED`), and one of your own that scores the visual tokens at its layers and keeps the top ones
(``register_in_llm_method(name, score=fn, layers=...)``; any other in-LLM name is refused as it registers).
The tests parametrize over ``methods()``. Methods registered outside this package (a ``promprune.methods`` entry
point, ``$PROMPRUNE_PLUGINS``: ``promprune.plugins``) are imported the first time the registry is asked.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..dtypes import upcast
from ..suggest import did_you_mean
from . import accel
from .entropy import cancels, entropy_of_matrix, spectral_matrix
from .kernels import (
    ENTROPY_EPS,
    KERNEL_EPS,
    batch_free,
    cosine_from_unit_gram,
    exactly_symmetric,
    nonfinite,
    token_norms,
    unit_gram_from_product,
    unit_tokens,
)


@dataclass
class Selection:
    """Which visual tokens a VLM keeps.

    - ``indices [B, T]`` long: kept token indices, ascending (raster order) unless ``order="selection"``.
    - ``saliency_count [B]`` long: how many came from the saliency stage (0 for pure-diversity methods).
    - ``entropy [B]`` or None: the prominence metric used for the budget split.
    - ``features [B, T, d]`` or None: merged features aligned with ``indices`` (VisionZip), else None.
    - ``salient [B, T]`` bool: which kept tokens the saliency stage chose (for overlays: red vs. cyan).
    - ``cls [B, d]`` or None: a kept token that is none of the ``N`` (VisionZip keeps the vision tower's CLS token,
      projected into the features' space); it counts in the budget, so ``indices`` then holds ``T - 1`` tokens.
    - ``entropy_halfwidth [B]`` (on the host) or None: how far ``entropy`` may lie from the exact metric.
      PromPrune's certified split reports its bracket's midpoint, within half the bracket's width plus
      ``certified.decision_margin`` of its size (the float32 matrix's rounding, which the bracket does not hold; 0
      where the exact eigensolve ran); where the caller's interval decided (``select(..., entropy_bounds=)``,
      ``certified.known_counts``) its midpoint, within half its width plus that margin; None: ``entropy`` is exact
      (or there is none).
    """

    indices: torch.Tensor
    saliency_count: torch.Tensor
    entropy: torch.Tensor | None = None
    features: torch.Tensor | None = None
    salient: torch.Tensor | None = None
    cls: torch.Tensor | None = None
    entropy_halfwidth: torch.Tensor | None = None


@dataclass
class VisionFeatures:
    """What the vision tower computed for the same ``N`` tokens before the projector mapped them into the LLM's
    space (``promprune.models`` adapters pass it for LLaVA / LLaVA-NeXT). Methods whose released code reads the
    tower's own features use it: VisPruner removes duplicates on ``hidden``; VisionZip merges ``hidden`` by the
    similarity of ``keys`` and keeps ``cls``. Methods that do not read it ignore it.

    - ``hidden [B, N, dv]``: the tower's hidden states of the tokens at the layer the projector reads.
    - ``keys [B, N, dk]`` or None: the attention keys of that layer (its ``k_proj``), mean over heads.
    - ``cls [B, dv]`` or None: the CLS token's hidden state at that layer (None: the tower has none, or it is one
      of the ``N``).
    - ``project``: the model's projector, ``[..., dv] -> [..., d]`` (float32 in and out; float64 for float64), which
      brings merged tokens and the CLS into the space of ``features``; None when no method needs it.
    """

    hidden: torch.Tensor
    keys: torch.Tensor | None = None
    cls: torch.Tensor | None = None
    project: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class Instruction:
    """The instruction of the question and the visual tokens in one embedding space (CDPruner's relevance).

    - ``query [B, c]``: the instruction's embedding; with several text segments (CLIP's 77-token windows), the mean
      of the segments' unit embeddings, so that ``unit(token) . query`` is the mean cosine over segments.
    - ``tokens [B, N, c]``: the same ``N`` visual tokens in that space.
    - ``source``: where the embeddings come from: "clip" (CLIP's text tower vs. the vision tower's tokens in CLIP's
      joint space, CDPruner's released code) or "llm" (the LLM's input embeddings vs. the projected tokens).
    """

    query: torch.Tensor
    tokens: torch.Tensor
    source: str = "clip"


class TokenSet:
    """Validated float32 inputs of one ``select`` call (float64 when the features are float64) plus the derived
    quantities, each computed once.

    ``x [B, N, d]``; ``saliency [B, N]`` or None; ``vision``: the vision tower's view of the same tokens
    (:class:`VisionFeatures`, in ``x``'s dtype) or None; ``instruction``: :class:`Instruction` or None; ``grid``:
    ``(rows, cols)`` of the tokens in raster order (None: the most square factorization of N). The cosine Gram is shared
    by the spectral entropy and the diversity kernels: one ``[B, N, d] x [B, d, N]`` product per call. ``source``: the
    features as given (any float dtype); on the GPU fast path the Gram of fp16/bf16 tokens is formed from them with fp32
    accumulation (``unit_gram``). ``keys``: one int per row naming what the row's tokens come from (an image, or one
    view of it; ``select(..., keys=...)``), or None; methods that draw at random seed each row's draw from it.
    ``entropy_bounds``: ``[B, 2]`` float64 host intervals, each holding its row's exact spectral entropy as
    ``promprune.spectral_entropy`` computes it (``select(..., entropy_bounds=...)``), or None; PromPrune's certified
    split takes the rows they decide without a bracket of its own (``certified.known_counts``).
    """

    def __init__(self, x: torch.Tensor, saliency: torch.Tensor | None, vision: VisionFeatures | None = None,
                 instruction: Instruction | None = None, grid: tuple[int, int] | None = None,
                 source: torch.Tensor | None = None, keys: tuple[int, ...] | None = None,
                 entropy_bounds=None):
        self.x = x
        self.keys = keys
        self.entropy_bounds = entropy_bounds
        self.saliency = saliency
        self.vision = vision
        self.instruction = instruction
        self.source = source
        self.batch, self.n, self.dim = x.shape
        self.grid = grid if grid is not None else squarest_grid(self.n)

    @cached_property
    def norms(self) -> torch.Tensor:
        """The tokens' L2 norms ``[B, N]`` (:func:`~promprune.selection.kernels.token_norms`: finite at any scale of
        ``x`` whose norms fit its dtype, ``x.norm``'s bit for bit where its sum of squares does not overflow)."""
        return token_norms(self.x)

    @property
    def half_source(self) -> torch.Tensor | None:
        """The features as given where they are fp16 / bf16 (on the fast path the Gram is formed from them), else
        None."""
        half = self.source is not None and self.source.dtype in (torch.float16, torch.bfloat16)
        return self.source if half else None

    @cached_property
    def unit_gram(self) -> torch.Tensor:
        """Gram ``[B, N, N]`` of tokens normalized with the entropy's eps (1e-8), exactly symmetric.

        On the GPU fast path the Gram of fp16 / bf16 tokens is their raw product (tensor cores, fp32 accumulation)
        scaled by the inverse norms. Its products overflow only for tokens whose squares overflow float32 (bf16 spans
        float32's range; fp16's are at most ``65504^2 d``), and those never take the fast path (``select``)."""
        if self.half_source is not None and accel.active(self.x):  # tensor cores on the half tokens, fp32 accumulation
            raw = torch.bmm(self.source, self.source.transpose(1, 2), out_dtype=torch.float32)  # [B, N, N]
            if accel.fused(self.x):  # one launch for the six below, the same bits (``greedy_triton.scaled_gram``)
                from . import greedy_triton

                fused = accel.kernel("gram", lambda: greedy_triton.scaled_gram(raw, self.norms, ENTROPY_EPS))
                if fused is not None:
                    return fused
            return unit_gram_from_product(raw, self.norms, ENTROPY_EPS)
        xn = self.x / self.norms[..., None].clamp_min(ENTROPY_EPS)
        return exactly_symmetric(batch_free(lambda t: t @ t.transpose(1, 2), xn))  # an image's bits whatever the batch

    @cached_property
    def cosine(self) -> torch.Tensor:
        """Cosine-similarity kernel ``[B, N, N]`` (tokens normalized with eps 1e-6).

        The diagonal is set to its exact value (1 for every token with norm >= eps): rounding noise there would
        otherwise decide the first pick of a diversity selector, which differs between attention backends and
        devices. The kernel is exactly symmetric (:func:`~promprune.selection.kernels.exactly_symmetric`). On the
        fast path (float32) one Triton launch makes the same bits (``greedy_triton.scaled_gram``).
        """
        if accel.fused(self.x) and self.unit_gram.dtype == torch.float32:
            from . import greedy_triton

            fused = accel.kernel("cosine", lambda: greedy_triton.scaled_gram(self.unit_gram, self.norms, KERNEL_EPS,
                                                                             eps_num=ENTROPY_EPS))
            if fused is not None:  # None: Triton could not build it here; the ops below make the same matrix
                return fused
        return cosine_from_unit_gram(self.unit_gram, self.norms, ENTROPY_EPS, KERNEL_EPS)

    @cached_property
    def vision_cosine(self) -> torch.Tensor:
        """Cosine similarity ``[B, N, N]`` of the vision tower's hidden states (``vision.hidden``), exactly
        symmetric."""
        unit = unit_tokens(self.vision.hidden)
        return exactly_symmetric(unit @ unit.transpose(1, 2))

    @cached_property
    def spectral_matrix(self) -> torch.Tensor:
        """The matrix ``[B, K, K]`` (K = min(N, d)) whose spectrum the spectral entropy reads
        (``entropy.spectral_matrix``), from the shared Gram when N <= d (its rows that cancel found with the norms
        already here)."""
        if self.n > self.dim:
            return spectral_matrix(self.x)
        return spectral_matrix(self.x, self.unit_gram, cancels(self.x, self.norms))

    @cached_property
    def spectral_entropy(self) -> torch.Tensor:  # [B], exact
        return entropy_of_matrix(self.spectral_matrix)

    def require_instruction(self, method: str) -> Instruction:
        if self.instruction is None:
            raise ValueError(f"method {method!r} weighs tokens by their relevance to the instruction: pass "
                             "instruction=promprune.Instruction(query [B, c], tokens [B, N, c])")
        return self.instruction

    def require_saliency(self, method: str) -> torch.Tensor:
        if self.saliency is None:
            raise ValueError(f"method {method!r} needs saliency scores [B, N]; got saliency=None")
        return self.saliency


def squarest_grid(n: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == n`` and rows the largest divisor of n not above sqrt(n)."""
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return rows, n // rows


PRE_LLM, IN_LLM = "pre_llm", "in_llm"


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its function, where it prunes, whether it needs saliency / merges tokens / reads the
    vision tower's own features (:class:`VisionFeatures`, when given), its option defaults, the allowed values of
    some options, and a check of the resolved options (raises ValueError)."""

    name: str
    fn: Callable[..., Any] | None  # the pre-LLM selection function; None for in-LLM methods (see promprune.models)
    needs_saliency: bool = False
    merges: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    choices: Mapping[str, tuple] = field(default_factory=dict)
    description: str = ""
    stage: str = PRE_LLM  # PRE_LLM: select() before the LLM; IN_LLM: hooks inside the LLM (promprune.models)
    check: Callable[[dict, int | None], None] | None = None  # check(resolved options, budget or None)
    reads_vision: bool = False  # uses select(..., vision=VisionFeatures) when given (VisPruner, VisionZip)
    needs_instruction: bool = False  # needs select(..., instruction=Instruction) (CDPruner): one selection per question
    needs_grid: bool = False  # reads select(..., grid=(rows, cols)): the tokens must form one raster grid (downsample)
    draws_at_random: bool = False  # seeds its draw from select(..., keys=...): PrunedVLM hashes the images only then
    # an in-LLM method of one's own (register_in_llm_method(score=...)): score(inputs, **options) -> [B, L] per current
    # column at each layer it cuts before (llm_hooks.ScoreInputs), and those layers' defaults on a 32-layer LLM
    score: Callable[..., Any] | None = None
    score_layers: tuple[int, ...] = ()

    @property
    def question_dependent(self) -> bool:
        """Whether the tokens the LLM keeps depend on the question: an in-LLM method ranks by the text tokens'
        attention (a score of one's own ranks in the prompt's prefill, where it may read them), a pre-LLM method by
        the instruction it declares it needs (``needs_instruction``; CDPruner). The rest keep the same tokens of an
        image whatever it is asked, so ``PrunedVLM`` encodes, selects and prefills an image once for all its questions
        (``vision_once`` / ``prefix_cache``). A pre-LLM method sees nothing of the question but
        ``select(..., instruction=)``, so declaring ``needs_instruction`` is declaring this."""
        return self.stage == IN_LLM or self.needs_instruction

    def resolve(self, given: Mapping[str, Any], *, also_valid=(), budget: int | None = None) -> dict[str, Any]:
        """Defaults overlaid with ``given``; an unknown option, a value outside its choices or one the method's
        check refuses is a ValueError. ``also_valid``: other option names the caller accepts (listed in the
        message of an unknown option, e.g. the adapter options)."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            valid = sorted(set(self.options) | set(also_valid))
            hints = [f"{u!r}" + did_you_mean(u, valid) for u in unknown]
            raise ValueError(f"unknown option(s) for method {self.name!r}: {', '.join(hints)}; "
                             f"valid options: {', '.join(valid)}")
        given = {key: plain(value) for key, value in given.items()}  # numpy's scalars as Python's
        resolved = {**self.options, **given}
        for key, value in given.items():
            _check_type(self.name, key, self.options[key], value)
        for key, allowed in self.choices.items():
            if resolved[key] not in allowed:
                raise ValueError(f"option {key!r} of method {self.name!r} must be one of {list(allowed)}, "
                                 f"got {resolved[key]!r}")
        if self.check is not None:
            self.check(resolved, budget)
        return resolved


def plain(value):
    """A number of another library (numpy's ``float32(0.4)``, ``int64(8)``, e.g. from ``np.linspace``) as Python's
    float or int, elementwise in a list or tuple, and numpy's ``bool_`` as Python's bool; anything else (bools,
    strings, None, tensors) as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if not isinstance(value, torch.Tensor) and getattr(value, "shape", None) == () and \
            getattr(getattr(value, "dtype", None), "kind", None) == "b":  # numpy's bool_ (e.g. from an array's test)
        return bool(value)
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def as_budget(budget, method: str | None = None) -> int:
    """``budget`` as a Python int (numpy's ints too); anything but a positive integer is a ValueError."""
    budget = plain(budget)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        of = f" for method {method!r}" if method else ""
        raise ValueError(f"budget must be a positive int{of}, got {budget!r}")
    return budget


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_type(method: str, key: str, default, value) -> None:
    """A given option value must have its default's type: numbers for numbers (finite; an int where an int is
    expected), true/false for flags, a same-length sequence of numbers for pairs. A None default takes anything
    (the method's check decides)."""
    if default is None:
        return
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an int"
    elif isinstance(default, float):
        ok, want = _is_number(value), "a finite number"
    elif isinstance(default, (tuple, list)):
        ok = isinstance(value, (tuple, list)) and len(value) == len(default) and all(map(_is_number, value))
        want = f"a list of {len(default)} numbers"
    else:
        ok, want = isinstance(value, type(default)), type(default).__name__
    if not ok:
        raise ValueError(f"option {key!r} of method {method!r} must be {want}, got {value!r}")


def in_range(key: str, low: float, high: float, *, low_open: bool = False):
    """A ``check`` that option ``key`` lies in [low, high] ((low, high] with ``low_open``)."""
    def check(opts: dict, budget: int | None = None) -> None:
        value = opts[key]
        if not (low < value <= high if low_open else low <= value <= high):
            bracket, close = "(" if low_open else "[", ")" if math.isinf(high) else "]"  # no option takes inf
            raise ValueError(f"option {key!r} must be in {bracket}{low:g}, {high:g}{close}, got {value!r}")
    return check


# Options every pre-LLM method accepts.
COMMON_OPTIONS = {"order": "ascending"}
COMMON_CHOICES = {"order": ("ascending", "selection")}

# Method names that mean "no pruning" wherever a method is named as text (compared lowercased): the lmms-eval plugin's
# ``method=`` model_arg, the pipeline's baseline trial (``mlflow_layout.BASELINE_METHOD``). No method is registered
# under one of them, or that text would name two things.
UNPRUNED_NAMES = frozenset({"", "none", "null", "unpruned"})

# Names a method's option may not take because ``promprune.models`` takes them first from the keyword arguments of
# ``PrunedVLM(...)`` / ``PrunedVLM.from_pretrained(...)``, where a method's options are given too: the adapter options
# (``promprune.models.options.ADAPTER_OPTIONS``, valid with every method) and the wrapper's own arguments. Listed here,
# not imported, so registering needs no ``promprune.models`` (transformers); ``tests/models/test_methods.py`` pins
# both equal to theirs.
ADAPTER_OPTION_NAMES = frozenset({
    "budget_mode", "image_newline", "unpad", "saliency_block", "clip_text", "image_tokens", "token_order",
    "video_budget", "video_split", "enable_thinking", "max_soft_tokens", "system_prompt", "pad_to_square"})
WRAPPER_ARGUMENTS = frozenset({"model", "processor", "name_or_path", "method", "budget", "dtype", "device_map",
                               "attn_implementation", "max_memory"})

_REGISTRY: dict[str, MethodSpec] = {}


def _own_function(spec: MethodSpec) -> Callable[..., Any] | None:
    """The function a method registered: its selection (pre-LLM) or its score (an in-LLM method of one's own); None
    for the built-in in-LLM methods (their hooks are ``llm_hooks``')."""
    return spec.fn if spec.fn is not None else spec.score


def _builtin(spec: MethodSpec) -> bool:
    """A method of this package's own (its outputs are pinned by its tests; another's are checked as they come)."""
    fn = _own_function(spec)
    return fn is None or getattr(fn, "__module__", "").startswith("promprune.")


def _check_choices(name: str, options: Mapping[str, Any], choices: Mapping[str, Any]) -> None:
    """A method's ``choices`` as ``resolve`` can use them: each names one of its ``options`` (else every call failed
    with a bare KeyError), lists its values in a tuple, list or set, and holds the option's default (else every call
    leaving the option out was refused)."""
    for key, allowed in choices.items():
        if key not in options:
            raise ValueError(f"method {name!r}: choices name option {key!r}, which options does not declare "
                             f"(options: {', '.join(map(repr, options)) or 'none'}); add {key!r} with its default to "
                             "options, or drop it from choices")
        if not isinstance(allowed, (tuple, list, set, frozenset)):
            raise ValueError(f"method {name!r}: choices of option {key!r} must be a tuple of its allowed values, got "
                             f"{allowed!r}")
        if options[key] not in allowed:
            raise ValueError(f"method {name!r}: the default of option {key!r}, {options[key]!r}, is not one of its "
                             f"choices {list(allowed)}; every call leaving {key!r} out would be refused. Make the "
                             "default one of the choices, or add it to them")


# what each of ``select``'s own arguments is, for the message refusing an option named like one
# (:func:`_reserved_options` reads the names from ``select``'s signature: one it gains is reserved with it)
_SELECT_ARGUMENTS = {
    "features": "the tokens' features, select()'s first argument",
    "saliency": "the tokens' saliency, select()'s second argument (it reaches the methods that declare "
                "needs_saliency)",
    "budget": "the budget, select()'s and PrunedVLM's own argument",
    "method": "the method's name, select()'s and PrunedVLM's own argument",
    "vision": "select()'s own argument, the vision tower's own features (promprune.VisionFeatures)",
    "instruction": "select()'s own argument, the instruction's features (promprune.Instruction)",
    "grid": "select()'s own argument, the tokens' grid (rows, cols)",
    "keys": "select()'s own argument, the ints naming each row's image",
    "checked": "select()'s own argument, that the caller found the inputs finite",
    "entropy_bounds": "select()'s own argument, a caller's intervals of the rows' spectral entropies",
}


def _select_arguments() -> dict[str, str]:
    """``select``'s named arguments (its signature's, ``**options`` aside), each with what it is: an option of that
    name would be bound to the argument by ``select`` and never reach the method."""
    import inspect

    params = inspect.signature(select).parameters.values()
    return {p.name: _SELECT_ARGUMENTS.get(p.name, "select()'s own argument") for p in params
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _reserved_options(caller: str) -> dict[str, str]:
    """The option names a method registered by ``caller`` may not take, each with what takes it: ``select``'s own
    arguments, read from its signature (every method's, as the docs promise), the first argument of a pre-LLM
    method's function and their common option ``order``, the hooks' (an in-LLM method of one's own), the adapter
    options and ``PrunedVLM``'s arguments (:data:`ADAPTER_OPTION_NAMES`, :data:`WRAPPER_ARGUMENTS`)."""
    names = {key: "an adapter option of promprune.models (ADAPTER_OPTIONS), valid with every method and taken by the "
                  "adapter" for key in ADAPTER_OPTION_NAMES}
    names |= {key: "an argument of PrunedVLM / PrunedVLM.from_pretrained" for key in WRAPPER_ARGUMENTS}
    names |= _select_arguments()
    names |= {"tokens": "a pre-LLM method's first argument, the TokenSet",
              "order": "every pre-LLM method's option, the kept tokens' order"}
    if caller == "register_in_llm_method":
        names |= {"layers": "the layers it cuts before, which every in-LLM method of one's own takes, its default the "
                            "registration's layers=",
                  "inputs": "the score function's first argument"}
    return names


def _check_registration(name, fn: Callable[..., Any], options: Mapping[str, Any], replace: bool,
                        choices: Mapping[str, Any] | None = None, caller: str = "register_method") -> None:
    """What ``register_method`` (or ``caller``: ``register_in_llm_method`` for a score of one's own) refuses at once,
    where it used to fail at every later call (or break ``methods()``): a name that is no string, one taken (a
    built-in always; another unless ``replace``), one that differs from a registered one only in case (the report would
    label both alike), one that means "unpruned" (:data:`UNPRUNED_NAMES`), an option named like ``select``'s own
    arguments, an adapter option or ``PrunedVLM``'s (an in-LLM one also like the hooks' option 'layers':
    :func:`_reserved_options`; the adapter took such an option silently), an option ``fn`` does not take, choices of an
    option not declared or not holding its default (:func:`_check_choices`)."""
    import inspect

    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"{caller}: the method's name must be a non-empty string without surrounding "
                         f"spaces, got {name!r}")
    if name.lower() in UNPRUNED_NAMES:
        raise ValueError(f"{caller}: {name!r} names the unpruned model (the lmms-eval plugin's method= and "
                         f"the sweeps' baseline read {', '.join(repr(n) for n in sorted(UNPRUNED_NAMES) if n)} as "
                         "no pruning): pick another name")
    twin = next((n for n in _REGISTRY if n.lower() == name.lower() and n != name), None)
    if twin is not None:  # one name in the report's tables, the sweeps' specs and MLflow's params would name two
        whose = "one of promprune's own methods" if _builtin(_REGISTRY[twin]) else "a method of one's own"
        raise ValueError(f"{caller}: method {name!r} differs only in case from {twin!r} ({whose}), and the report "
                         f"labels both alike: pick a name no registered method has in any case (methods(None) lists "
                         "them)")
    taken = _REGISTRY.get(name)
    if taken is not None and (_builtin(taken) or not replace):
        own = _own_function(taken)
        whose = "one of promprune's own methods" if _builtin(taken) else \
            f"registered by {getattr(own, '__module__', '?')}.{getattr(own, '__qualname__', '?')}"
        fix = "pick another name" if _builtin(taken) else (f"pick another name, or pass replace=True to {caller} "
                                                           "(e.g. a notebook cell run again)")
        raise ValueError(f"method {name!r} is already registered ({whose}): {fix}")
    taken_options = _reserved_options(caller)
    reserved = sorted((set(options) | set(choices or {})) & set(taken_options))
    if reserved:
        whose = "; ".join(f"{key!r}: {taken_options[key]}" for key in reserved)
        raise ValueError(f"{caller}: method {name!r} names option(s) {reserved}, which are taken before the method "
                         f"sees them ({whose}): name them otherwise")
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        taken_by_fn = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        missing = sorted(set(options) - taken_by_fn)
        if missing:
            raise ValueError(f"method {name!r}: {fn.__qualname__} takes no parameter for option(s) {missing}; add "
                             "them as keyword parameters (e.g. `*, p: float`) or drop them from options")
    _check_choices(name, options, choices or {})


def register_method(name: str, *, needs_saliency: bool = False, merges: bool = False,
                    options: Mapping[str, Any] | None = None, choices: Mapping[str, tuple] | None = None,
                    check: Callable[[dict, int], None] | None = None, reads_vision: bool = False,
                    needs_instruction: bool = False, needs_grid: bool = False, draws_at_random: bool = False,
                    replace: bool = False):
    """Decorator registering the pre-LLM method ``fn(tokens, budget, **options) -> Selection`` under ``name``.
    ``check(options, budget)`` may raise ValueError for a combination it refuses; ``replace``: take over a name a
    method of one's own already holds (a module imported again), never one of this package's."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _check_registration(name, fn, options or {}, replace, choices)
        _REGISTRY[name] = MethodSpec(
            name=name, fn=fn, needs_saliency=needs_saliency, merges=merges,
            options={**COMMON_OPTIONS, **(options or {})}, choices={**COMMON_CHOICES, **(choices or {})},
            description=(fn.__doc__ or "").strip().split("\n")[0], check=check, reads_vision=reads_vision,
            needs_instruction=needs_instruction, needs_grid=needs_grid, draws_at_random=draws_at_random)
        return fn

    return wrap


# The in-LLM methods whose decoder-layer hooks ``promprune.models.llm_hooks`` implements by name (its ``STAGE_KINDS``, a
# test pins the two equal). ``register_in_llm_method`` takes these names without a score; any other in-LLM method is
# one of one's own, registered with a ``score`` the hooks rank by.
IN_LLM_HOOKED = ("fastv", "sparsevlm", "dart", "pyramiddrop")
# The layers an in-LLM method of one's own cuts before by default, given for a 32-layer LLM and scaled to the depth
# (FastV's K = 2 of 32: layers 0 and 1 see every token; 1 on the testbed's 4 layers, 2 on every 7B LLM here).
SCORE_LAYERS_OF_32 = (2,)


def in_llm_hooks_problem(name: str, hooked=IN_LLM_HOOKED) -> str | None:
    """Why no model can run the in-LLM method ``name`` (``hooked``: the methods the hooks implement by name; one
    registered with a ``score`` runs on the hooks' scored stages), or None."""
    if name in hooked:
        return None
    _load_plugins()
    spec = _REGISTRY.get(name)
    if spec is not None and spec.score is not None:
        return None
    return (f"in-LLM method {name!r} has no hooks to prune with: the hooks that prune inside the language model, "
            f"promprune.models.llm_hooks's, implement {', '.join(hooked)} by name, and any other in-LLM method by the "
            "score it registers. Register yours with register_in_llm_method(name, score=fn, layers=..., options=...): "
            "fn(inputs, **options) returns a score [B, L] for each column of the layer's input, and the hooks keep the "
            "top-scored visual tokens before each of its layers, with the built-ins' masks, positions, KV cache and "
            "batching (docs/methods.md, 'Adding your own method'); a method that picks the kept tokens before the LLM "
            "registers with promprune.register_method instead")


def check_layers(method: str, layers, what: str | None = None) -> None:
    """Option 'layers' of SparseVLM, PyramidDrop and an in-LLM method of one's own (:func:`register_in_llm_method`):
    None (the default layers scaled to the LLM's depth) or the layers cut before, ints >= 1 in ascending order, each
    once: a stage per layer (``[3, 2]`` ran as [2, 3] and ``[2, 2]`` as one cut, without a word). ``what``: how errors
    name the value (default: the option of ``method``)."""
    if layers is None:
        return
    what = what or f"option 'layers' of {method}"
    if (not isinstance(layers, (list, tuple)) or not layers
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in layers)):
        raise ValueError(f"{what} must be None or a list of ints >= 1, got {layers!r}")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ValueError(f"{what} must list each pruning layer once in ascending order (one "
                         f"stage per layer), got {list(layers)!r}; did you mean {sorted(set(layers))!r}?")


def register_in_llm_method(name: str, *, description: str = "", options: Mapping[str, Any] | None = None,
                           choices: Mapping[str, tuple] | None = None,
                           check: Callable[[dict, int | None], None] | None = None,
                           score: Callable[..., Any] | None = None, layers=SCORE_LAYERS_OF_32,
                           replace: bool = False) -> None:
    """Register an in-LLM method: its options, their choices and ``check(options, budget)``.

    Without ``score``: one of the built-ins whose hooks ``promprune.models.llm_hooks`` implements by name
    (:data:`IN_LLM_HOOKED`); any other name is refused (:func:`in_llm_hooks_problem`): no model could run it.

    With ``score``, an in-LLM method of one's own: before each of its layers the hooks call ``score(inputs,
    **options)`` once for the batch (``inputs``: ``llm_hooks.ScoreInputs``, what the layer's pre-hook has: its input
    hidden states ``[B, L, D]``, the candidate visual columns ``[B, L]``, and on demand the layer's own last-token
    attention and key norms) and keep each row's top-scored visual tokens (ties to the earlier column), as FastV /
    PyramidDrop keep theirs, with every rule the built-ins' hooks follow (masks, original positions, KV cache, dead
    filler columns, batching, hybrid layer types). A score is a float tensor ``[B, L]``, one value per column of the
    layer's input, finite at every candidate (only those are read); the hooks refuse another shape or a NaN / inf one
    naming the method. ``layers``: the layers it cuts before (and scores at), ascending ints in [1, 31] given for a
    32-layer LLM and scaled to the depth (default :data:`SCORE_LAYERS_OF_32`: FastV's K = 2); the method takes option
    ``layers`` (absolute layers; None: the scaled default) besides its own ``options``, each of which ``score`` takes
    as a keyword. One stage keeps the budget; several keep a geometric schedule from all the visual tokens to the
    budget after the last (``llm_hooks.geometric``). ``replace``: take over a name a method of one's own already
    holds, never one of this package's. ``description``: default the first line of ``score``'s docstring."""
    if score is None:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is already registered")
        problem = in_llm_hooks_problem(name)
        if problem is not None:
            raise ValueError(problem)
        _check_choices(name, options or {}, choices or {})
        _REGISTRY[name] = MethodSpec(name=name, fn=None, options=dict(options or {}), choices=dict(choices or {}),
                                     description=description, stage=IN_LLM, check=check)
        return
    if not callable(score):
        raise ValueError(f"register_in_llm_method: score of method {name!r} must be a function "
                         f"score(inputs, **options) -> [B, L] scores, got {type(score).__name__}")
    if name in IN_LLM_HOOKED:  # (whether or not the built-ins' module registered them yet)
        raise ValueError(f"method {name!r} is already registered (one of promprune's own methods): pick another name")
    _check_registration(name, score, options or {}, replace, choices, caller="register_in_llm_method")
    given = list(layers) if isinstance(layers, (list, tuple)) else layers
    check_layers(name, given, what="argument 'layers' of register_in_llm_method")
    if given is None or max(given) > 31:
        raise ValueError(f"register_in_llm_method: layers of method {name!r} are given for a 32-layer LLM (scaled to "
                         f"the depth), ints in [1, 31], got {layers!r}")

    def checked(opts: dict, budget: int | None = None) -> None:
        check_layers(name, opts["layers"])
        if check is not None:
            check(opts, budget)

    _REGISTRY[name] = MethodSpec(
        name=name, fn=None, options={"layers": None, **(options or {})}, choices=dict(choices or {}),
        description=description or (score.__doc__ or "").strip().split("\n")[0], stage=IN_LLM, check=checked,
        score=score, score_layers=tuple(given))


def _load_plugins() -> None:
    """Methods from outside the package: the ``promprune.methods`` entry points and ``$PROMPRUNE_PLUGINS``
    (``promprune.plugins``), imported the first time the registry is asked."""
    from promprune import plugins

    plugins.ensure_loaded()


def methods(stage: str | None = PRE_LLM) -> list[str]:
    """Names of the registered methods of ``stage`` (default: the pre-LLM ones ``select`` runs; None: all), sorted."""
    _load_plugins()
    return sorted(name for name, spec in _REGISTRY.items() if stage is None or spec.stage == stage)


def method_spec(name: str) -> MethodSpec:
    """The registered spec of ``name``; an unknown name is a ValueError listing the valid ones."""
    _load_plugins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}{did_you_mean(name, _REGISTRY)}; "
                         f"registered methods: {', '.join(methods(None))}")
    return _REGISTRY[name]


def _validate(features, saliency, spec: MethodSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(features, torch.Tensor) or features.dim() != 3:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise ValueError(f"features must be a tensor [B, N, d], got {shape}")
    if not features.is_floating_point():
        raise ValueError(f"features must be a float tensor, got dtype {features.dtype}")
    x = upcast(features)  # float32; float64 stays float64
    B, N, d = x.shape
    if N == 0 or B == 0 or d == 0:
        empty = "tokens (N = 0)" if N == 0 else "images (B = 0)" if B == 0 else \
            "feature channels (d = 0): every token needs a feature vector"
        raise ValueError(f"features have no {empty}")
    if saliency is None:
        if spec.needs_saliency:
            raise ValueError(f"method {spec.name!r} needs saliency scores [B, N] = [{B}, {N}]; got saliency=None")
        return x, None
    if not isinstance(saliency, torch.Tensor) or tuple(saliency.shape) != (B, N):
        shape = tuple(saliency.shape) if isinstance(saliency, torch.Tensor) else type(saliency).__name__
        raise ValueError(f"saliency must have shape [B, N] = [{B}, {N}] to match features, got {shape}")
    return x, saliency.to(device=x.device, dtype=x.dtype)


def _validate_vision(vision, x: torch.Tensor) -> VisionFeatures | None:
    """``vision`` checked against ``x [B, N, d]`` and copied to ``x``'s dtype (float32 or float64) and device."""
    if vision is None:
        return None
    if not isinstance(vision, VisionFeatures):
        raise ValueError(f"vision must be a promprune.VisionFeatures or None, got {type(vision).__name__}")
    B, N, _ = x.shape
    out = {}
    for name, want in (("hidden", 3), ("keys", 3), ("cls", 2)):
        t = getattr(vision, name)
        if t is None:
            if name == "hidden":
                raise ValueError("vision.hidden is required: the vision tower's features [B, N, dv]")
            out[name] = None
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != want \
                or tuple(t.shape[:want - 1]) != (B, N)[:want - 1]:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            need = "[B, N, ...]" if want == 3 else "[B, dv]"
            raise ValueError(f"vision.{name} must be a float tensor {need} matching features [{B}, {N}, d], "
                             f"got {shape}")
        out[name] = t.to(device=x.device, dtype=x.dtype)
    if vision.project is not None and not callable(vision.project):
        raise ValueError(f"vision.project must be callable, got {type(vision.project).__name__}")
    return VisionFeatures(out["hidden"], out["keys"], out["cls"], vision.project)


def _validate_instruction(instruction, x: torch.Tensor, method: str) -> Instruction | None:
    """``instruction`` checked against ``x [B, N, d]`` and copied to ``x``'s dtype and device."""
    if instruction is None:
        return None
    if not isinstance(instruction, Instruction):
        raise ValueError(f"instruction must be a promprune.Instruction or None, got {type(instruction).__name__}")
    B, N, _ = x.shape
    q, t = instruction.query, instruction.tokens
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.shape[0] != B:
        raise ValueError(f"instruction.query must be a tensor [B, c] with B = {B}, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[:2]) != (B, N) or t.shape[2] != q.shape[1]:
        raise ValueError(f"instruction.tokens must be a tensor [B, N, c] = [{B}, {N}, {q.shape[1]}] (c of the "
                         f"query) for method {method!r}, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return Instruction(q.to(device=x.device, dtype=x.dtype), t.to(device=x.device, dtype=x.dtype),
                       instruction.source)


def _validate_grid(grid, n: int) -> tuple[int, int] | None:
    if grid is None:
        return None
    if (not isinstance(grid, (tuple, list)) or len(grid) != 2 or any(isinstance(g, bool) or not isinstance(g, int)
                                                                     or g < 1 for g in grid)
            or grid[0] * grid[1] != n):
        raise ValueError(f"grid must be (rows, cols) of positive ints with rows * cols = N = {n}, got {grid!r}")
    return int(grid[0]), int(grid[1])


def _validate_entropy_bounds(bounds, batch: int):
    """``entropy_bounds``: None, or ``[B, 2]`` numbers on the host (``select``) -> a float64 numpy array. A tensor on
    another device is refused (reading it would wait on the device), as is another shape."""
    if bounds is None:
        return None
    if isinstance(bounds, torch.Tensor):
        if bounds.device.type != "cpu" or bounds.is_complex():
            raise ValueError(f"entropy_bounds must be real numbers on the host [B, 2] = [{batch}, 2], got a tensor of "
                             f"dtype {bounds.dtype} on {bounds.device}")
        bounds = bounds.detach().numpy()
    try:
        out = np.asarray(bounds, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"entropy_bounds must be [B, 2] = [{batch}, 2] numbers, got {type(bounds).__name__}") from None
    if out.shape != (batch, 2):
        raise ValueError(f"entropy_bounds must be [B, 2] = [{batch}, 2] intervals (one per batch row), got shape "
                         f"{out.shape}")
    return out


def _validate_keys(keys, batch: int) -> tuple[int, ...] | None:
    """``keys``: None, or one int per batch row (a sequence of ints or a 1-D integer tensor)."""
    if keys is None:
        return None
    if isinstance(keys, torch.Tensor):
        if keys.dim() != 1 or keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool:
            raise ValueError(f"keys must be one int per batch row ([B] = [{batch}] integer tensor), got a tensor of "
                             f"shape {tuple(keys.shape)} and dtype {keys.dtype}")
        keys = keys.tolist()
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
        raise ValueError(f"keys must be a sequence of {batch} ints (one per batch row), got {type(keys).__name__}")
    keys = tuple(plain(k) for k in keys)  # numpy's ints as Python's
    if len(keys) != batch or any(isinstance(k, bool) or not isinstance(k, int) for k in keys):
        raise ValueError(f"keys must be {batch} ints (one per batch row of features), got {list(keys)!r}")
    return keys


def checked_inputs(features: torch.Tensor, saliency: torch.Tensor | None, vision: VisionFeatures | None,
                   instruction: Instruction | None) -> dict[str, torch.Tensor]:
    """The inputs ``select`` checks for NaN / Inf, by the names its errors give them (those present)."""
    named = {"features": features, "saliency": saliency}
    if vision is not None:
        named |= {"vision.hidden": vision.hidden, "vision.keys": vision.keys, "vision.cls": vision.cls}
    if instruction is not None:
        named |= {"instruction.query": instruction.query, "instruction.tokens": instruction.tokens}
    return {k: t for k, t in named.items() if t is not None}


def finite_total(tensors) -> torch.Tensor:
    """A 0-d tensor that is finite when every one of ``tensors`` is finite and none is so large that its squares
    overflow (their L2 norms, added up), computed on their device without a read.

    A norm is NaN or infinite when one of its terms is, so one pass over each tensor tells (``isfinite(t).all()`` took
    four passes and launches: 36-58 ms of a LLaVA-NeXT select on 2 CPU cores, RESULTS 2026-11-27). Norms accumulate in
    float32 at least (float64 tensors in float64). Finite values whose squares overflow (entries of ~1e15 and more in
    a whole view) also give a non-finite total: "check each", and ``select`` then runs such features on the plain path,
    whose norms are measured in float64 where float32's overflow (``kernels.token_norms``)."""
    parts = [torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors]
    if len({part.dtype for part in parts}) == 1:
        return torch.stack(parts).sum()  # two launches for any number of parts
    return sum(parts[1:], parts[0]) if parts else torch.zeros(())  # mixed float32 / float64: promoted pairwise


def _check_finite(named: dict[str, torch.Tensor]) -> bool:
    """Every given tensor ``[B, ...]`` is finite; one read of the device for all of them (``finite_total``); the error
    path, or a total overflowing on huge finite terms, checks tensor by tensor. Returns whether the tensors are finite
    but so large that their squares overflow (``select`` then takes the plain path)."""
    if math.isfinite(float(finite_total(named.values()))):
        return False
    for name, t in named.items():
        if (problem := nonfinite(name, t)) is not None:
            raise ValueError(problem)
    for name, t in named.items():  # finite, but huge: a token whose norm itself passes its compute dtype's range
        if t.dim() >= 2 and name != "saliency":  # saliency: scores, min-max normalized
            wide = t.dtype == torch.float64
            top = torch.finfo(torch.float64 if wide else torch.float32).max
            norm = float(token_norms(t).max()) if wide else float(torch.linalg.vector_norm(t.double(), dim=-1).max())
            if norm > top:
                kind = "float64" if wide else "float32"
                raise ValueError(f"{name} hold a token of norm {norm:.3g}, past {kind}'s range ({top:.3g}): its "
                                 f"direction cannot be compared in {kind}. Divide the features by a constant (every "
                                 "method's picks are scale-free)" + ("." if wide else " or pass them as float64."))
    return True


def select(features: torch.Tensor, saliency: torch.Tensor | None = None, *, budget: int,
           method: str = "promprune", vision: VisionFeatures | None = None, instruction: Instruction | None = None,
           grid: tuple[int, int] | None = None, keys=None, checked: bool = False, entropy_bounds=None,
           **options) -> Selection:
    """Choose ``budget`` of the ``N`` visual tokens of each image.

    ``features [B, N, d]`` (any float dtype; computed in float32, float64 ones in float64), ``saliency [B, N]`` or None
    for methods that do not use it, ``budget`` T shared by the batch (T >= N keeps every token). ``vision``: the vision
    tower's own features of the same tokens (:class:`VisionFeatures`), read by the methods whose released code reads
    them (VisPruner, VisionZip; ``method_spec(m).reads_vision``); without it they use ``features``. ``saliency`` reaches
    only the methods that declare ``needs_saliency`` (the others get None, as in the model adapters). ``keys``: one int
    per batch row naming the image (or view) the row comes from, e.g. a hash of its pixels; ``random`` draws each row's
    tokens from ``seed`` and its key, so the draw does not depend on the last bits of the features (None: from a coarse
    fingerprint of the features; docs/methods.md). Returns a :class:`Selection`. ``promprune.methods()`` lists the
    methods; an unknown method or option is a ValueError naming the valid ones. ``checked``: the caller has found
    ``finite_total`` of every input tensor finite (``PrunedVLM`` checks a batch's buckets with one read), so the call
    does not read the device for it; by default NaN / Inf inputs are a ValueError naming the batch rows, and finite
    features whose squares overflow float32 (entries of ~1e15 and more) run on the plain torch path, not the GPU fast
    path (the same tokens as at a normal scale); a float32 token whose norm itself passes float32's range is a
    ValueError naming the tensor. ``entropy_bounds``: ``[B, 2]`` intervals on the host (a numpy array, a list or a CPU
    tensor), each holding its row's exact ``promprune.spectral_entropy``, from a caller that bracketed it already
    (``PrunedVLM``'s ``adaptive_views`` shares, ``certified.settle``): where PromPrune's certified split takes its
    bounds, the rows whose interval decides ``t_sal`` run no bracket of their own (``certified.known_counts``); a row
    of ``(-inf, inf)`` decides nothing. Trusted as ``checked`` is: an interval that misses its row's entropy can give
    another split than the exact route. Other methods and routes ignore it.
    """
    spec = method_spec(method)
    if spec.stage != PRE_LLM:
        raise ValueError(f"method {method!r} prunes inside the LLM; run it through promprune.models.PrunedVLM, "
                         f"select() runs the pre-LLM methods: {', '.join(methods())}")
    budget = as_budget(budget)
    opts = spec.resolve(options, budget=budget)
    order = opts.pop("order")
    x, s = _validate(features, saliency, spec)
    if spec.needs_instruction and instruction is None:
        raise ValueError(f"method {method!r} weighs tokens by their relevance to the instruction: pass "
                         "instruction=promprune.Instruction(query [B, c], tokens [B, N, c])")
    text = _validate_instruction(instruction, x, method) if spec.needs_instruction else None
    # saliency reaches only the methods that declare it, as in the model adapters: a selection never depends on
    # scores the method may not get (coverage_only broke the DPP's first-pick tie by them when given)
    seen = _validate_vision(vision, x) if spec.reads_vision else None
    huge = False if checked else _check_finite(checked_inputs(x, s if spec.needs_saliency else None, seen, text))
    tokens = TokenSet(x, s if spec.needs_saliency else None, seen, text, _validate_grid(grid, x.shape[1]),
                      source=features, keys=_validate_keys(keys, x.shape[0]),
                      entropy_bounds=_validate_entropy_bounds(entropy_bounds, x.shape[0]))
    # features whose squares overflow float32: the plain path, whose norms do not overflow (``kernels.token_norms``);
    # float32 products at full precision where the process turned TF32 on (``accel.full_float32``)
    with accel.disabled() if huge else contextlib.nullcontext(), accel.full_float32():
        sel = spec.fn(tokens, min(budget, tokens.n), **opts)
    if not _builtin(spec):
        _check_output(spec, sel, tokens.batch, tokens.n, tokens.dim, min(budget, tokens.n))
    if sel.features is not None:
        sel.features = sel.features.to(features.dtype)
    if sel.cls is not None:
        sel.cls = sel.cls.to(features.dtype)
    return _sorted(sel) if order == "ascending" else sel


def _check_output(spec: MethodSpec, sel, batch: int, n: int, dim: int, budget: int) -> None:
    """A method of one's own returned a selection ``select`` can use, as it returned it (before any reordering): a
    :class:`Selection` whose ``indices`` are ``[B, T]`` integers, distinct in each row and in ``[0, N)`` (``T`` = the
    budget, one less with a ``cls``), its ``saliency_count`` ``[B]`` integers in ``[0, T]``, its ``salient`` None or a
    bool tensor of the indices' shape, its ``entropy`` None or ``[B]`` finite floats, its ``features`` None or finite
    floats ``[B, T, d]`` aligned with the indices (``d`` the tokens'; only from a method registered with
    ``merges=True``), its ``cls`` None or finite floats ``[B, d]``. A negative index wrapped to the last tokens, a short
    row ran a trial on fewer tokens than its budget, merged features of another shape were cut to the indices' by the
    ascending order's gather, a count past T or an entropy of another shape were recorded as the trial's metrics, all
    silently; a duplicate or an index past N failed deep in the model without the method's name; integer or float flags
    came back from the GPU fast path's ascending order (``greedy_triton.ascending``, which carries bool flags) as
    unwritten memory, where the CPU gathered them. One read of the device (``promprune.testing.check_method`` checks
    more, once)."""
    name = spec.name

    def refuse(what: str) -> None:
        raise ValueError(f"method {name!r} returned {what}; a method returns promprune.Selection(indices [B, T] "
                         "long: distinct token indices in [0, N) per image, saliency_count [B] integers in [0, T], "
                         "salient [B, T] bool or None, entropy [B] finite floats or None, features [B, T, d] floats "
                         "(merged, with merges=True) or None, cls [B, d] floats or None) "
                         "(promprune.testing.check_method(name) checks a method's outputs and more)")

    def shape(t) -> str:
        return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__

    def is_float(t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point()

    if not isinstance(sel, Selection):
        refuse(f"a {type(sel).__name__}, not a promprune.Selection")
    idx = sel.indices
    if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        refuse(f"indices of dtype {getattr(idx, 'dtype', type(idx).__name__)}, not integers")
    want = budget - (1 if sel.cls is not None else 0)
    if tuple(idx.shape) != (batch, want):
        refuse(f"indices of shape {tuple(idx.shape)} where the budget of {budget} makes it ({batch}, {want})")
    count = sel.saliency_count
    if not isinstance(count, torch.Tensor) or tuple(count.shape) != (batch,):
        refuse(f"saliency_count of shape {shape(count)}, not ({batch},)")
    if count.is_floating_point() or count.is_complex() or count.dtype == torch.bool:
        refuse(f"saliency_count of dtype {count.dtype}, not integers (how many kept tokens the saliency stage chose)")
    flags = sel.salient
    if flags is not None:
        if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool:
            refuse(f"salient of dtype {getattr(flags, 'dtype', type(flags).__name__)}, not torch.bool")
        if flags.shape != idx.shape:
            refuse(f"salient of shape {tuple(flags.shape)}, not the indices' {tuple(idx.shape)}")
    if sel.entropy is not None and (not is_float(sel.entropy) or tuple(sel.entropy.shape) != (batch,)):
        refuse(f"entropy of shape {shape(sel.entropy)} and dtype {getattr(sel.entropy, 'dtype', None)}, not floats "
               f"({batch},): one prominence value per image")
    if sel.features is not None:
        if not spec.merges:
            refuse("merged features, but it was registered without merges=True (the model would feed them in place "
                   "of the kept tokens): declare merges=True in register_method, or return features=None")
        if not is_float(sel.features) or tuple(sel.features.shape) != (batch, want, dim):
            refuse(f"features of shape {shape(sel.features)} and dtype {getattr(sel.features, 'dtype', None)}, not "
                   f"floats ({batch}, {want}, {dim}): one merged token of the tokens' {dim} channels per kept index")
    if sel.cls is not None and (not is_float(sel.cls) or tuple(sel.cls.shape) != (batch, dim)):
        refuse(f"cls of shape {shape(sel.cls)} and dtype {getattr(sel.cls, 'dtype', None)}, not floats ({batch}, "
               f"{dim}): one token of the tokens' {dim} channels per image")
    stats = [count.min(), count.max()]  # [low, high, repeated] of the indices follow; then one flag per float field
    if want:
        ordered = idx.sort(dim=1).values
        stats += [ordered[:, 0].min(), ordered[:, -1].max(), (ordered[:, 1:] == ordered[:, :-1]).sum()]
    floats = {key: t for key, t in (("entropy", sel.entropy), ("features", sel.features), ("cls", sel.cls))
              if t is not None}
    stats += [torch.isfinite(t).all() for t in floats.values()]
    read = [int(v) for v in torch.stack([v.to(device=idx.device, dtype=torch.long) for v in stats]).cpu()]
    if read[0] < 0 or read[1] > budget:
        refuse(f"saliency_count {read[0] if read[0] < 0 else read[1]}, outside [0, {budget}] (the kept tokens "
               "the saliency stage chose, 0 for none)")
    if want:
        low, high, repeated = read[2:5]
        if low < 0 or high >= n:
            refuse(f"an index out of [0, {n}) ({low if low < 0 else high})")
        if repeated:
            refuse(f"a token twice in a row of indices ({repeated} repeat(s))")
    for key, finite in zip(floats, read[-len(floats):] if floats else []):
        if not finite:
            refuse(f"a NaN or infinite value in {key}")
    if idx.dtype != torch.long:
        sel.indices = idx.long()


def _sorted(sel: Selection) -> Selection:
    """Reorder a selection (and its aligned per-token fields) into ascending raster order. On the CUDA fast path
    without merged features, one Triton launch (``greedy_triton.ascending``) instead of the sort and the gather."""
    if sel.features is None and sel.indices.numel() and accel.fused(sel.indices):
        from . import greedy_triton

        fused = (accel.kernel("ascending", lambda: greedy_triton.ascending(sel.indices, sel.salient))
                 if sel.indices.shape[1] <= greedy_triton.ASCENDING_MAX else None)
        if fused is not None:  # None: Triton could not build it here; the torch ops below give the same order
            return dataclasses.replace(sel, indices=fused[0], salient=fused[1])
    indices, perm = sel.indices.sort(dim=1)
    feats = None
    if sel.features is not None:
        feats = sel.features.gather(1, perm[..., None].expand(-1, -1, sel.features.shape[-1]))
    salient = sel.salient.gather(1, perm) if sel.salient is not None else None
    return dataclasses.replace(sel, indices=indices, features=feats, salient=salient)
