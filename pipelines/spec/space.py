"""What one option of a spec's `grid` ranges over: checked, counted, sampled (no Ray, no Tune).

A grid value is one of

- a scalar: fixed, in every trial;
- a list: a grid axis (``tune.search: grid``), or an equally likely choice among its values (``random``,
  ``optuna``);
- a distribution, searched by ``random`` and ``optuna`` only: ``{uniform: [lo, hi]}``, ``{loguniform: [lo, hi]}``
  (0 < lo), ``{randint: [lo, hi]}`` (integers, both ends included), ``{choice: [a, b, ...]}``.

A sampled float keeps `SIGNIFICANT` significant digits (a bound where rounding would cross it), so that a trial's id
is readable and the trial runs exactly the value its id names (``promprune-b16-mu=0.2431-tau=0.01873``).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

DISTRIBUTIONS = ("uniform", "loguniform", "randint", "choice")
# four significant digits: a readable id, and finer than any benchmark resolves (mu moves an image across the split
# only when it crosses the image's entropy; 1e-4 of it moves no image of a few thousand)
SIGNIFICANT = 4
FIXED, AXIS = "value", "list"  # the two kinds that are not distributions


@dataclass(frozen=True)
class Space:
    """One grid value, parsed: ``kind`` is `FIXED`, `AXIS` or one of `DISTRIBUTIONS`; ``args`` its values or
    bounds."""

    kind: str
    args: tuple

    @property
    def searched(self) -> bool:
        """A distribution (random and optuna only)."""
        return self.kind in DISTRIBUTIONS

    @property
    def finite(self) -> list | None:
        """Every value it can take, in order (randint: lo..hi), or None for a continuous range."""
        if self.kind == FIXED:
            return [self.args[0]]
        if self.kind in (AXIS, "choice"):
            return list(self.args)
        if self.kind == "randint":
            return list(range(self.args[0], self.args[1] + 1))
        return None

    @property
    def size(self) -> float:
        """How many values it can take (``inf`` for a continuous range)."""
        if self.kind == "randint":
            return self.args[1] - self.args[0] + 1
        values = self.finite
        return math.inf if values is None else len(values)

    @property
    def corners(self) -> list:
        """The values a spec check tries (every value of a list or choice, the bounds of a range): an option value
        the method refuses at a bound is refused before anything runs."""
        if self.kind in ("uniform", "loguniform", "randint"):
            return list(self.args)
        return self.finite

    @property
    def middle(self) -> Any:
        """A value inside the space (a range's middle, on the log scale for loguniform; a list's first): the spec
        check tries it with the corners, and the other options take it while one option's values are checked, unless
        the method refuses it there (`trials._corner_problems`)."""
        if self.kind == "uniform":
            return rounded((self.args[0] + self.args[1]) / 2, *self.args)
        if self.kind == "loguniform":
            return rounded(math.sqrt(self.args[0] * self.args[1]), *self.args)
        return self.corners[0]

    def sample(self, rng: random.Random) -> Any:
        """One value drawn with ``rng`` (a float rounded to `SIGNIFICANT` digits, within the range: `rounded`)."""
        if self.kind == FIXED:
            return self.args[0]
        if self.kind in (AXIS, "choice"):
            return self.args[rng.randrange(len(self.args))]
        lo, hi = self.args
        if self.kind == "randint":
            return rng.randint(lo, hi)
        if self.kind == "uniform":
            return rounded(rng.uniform(lo, hi), lo, hi)
        return rounded(math.exp(rng.uniform(math.log(lo), math.log(hi))), lo, hi)

    def describe(self) -> str:
        """``uniform[0.2, 0.3]``, ``choice of 3``, ``[0.1, 0.2]``."""
        if self.kind == FIXED:
            return repr(self.args[0])
        if self.kind == AXIS:
            return repr(list(self.args))
        if self.kind == "choice":
            return f"choice{list(self.args)!r}"
        return f"{self.kind}[{self.args[0]:g}, {self.args[1]:g}]"


def rounded(x: float, lo: float | None = None, hi: float | None = None) -> float:
    """``x`` to `SIGNIFICANT` significant digits (0.243117 -> 0.2431), kept within ``[lo, hi]`` when given (a
    range's value): one rounded past a bound is that bound (``uniform: [0.12341, 0.12349]``: 0.123412 -> 0.12341, not
    0.1234, which is outside the range)."""
    value = float(f"{x:.{SIGNIFICANT}g}")
    return value if lo is None else min(max(value, lo), hi)


def is_distribution(value: Any) -> bool:
    """A mapping in a grid is a distribution (`problem` says whether it is a valid one)."""
    return isinstance(value, dict)


def parse(value: Any) -> Space:
    """A grid value as a `Space` (``value`` must have passed `problem`)."""
    if isinstance(value, list):
        return Space(AXIS, tuple(value))
    if isinstance(value, dict):
        ((kind, args),) = value.items()
        return Space(kind, tuple(args))
    return Space(FIXED, (value,))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def problem(value: Any) -> str | None:
    """What is wrong with a grid value, in the spec's words (None: nothing). Lists and scalars are checked by the
    methods' option checks; here, the shape and bounds of a distribution."""
    if not isinstance(value, dict):
        return None
    if len(value) != 1 or next(iter(value)) not in DISTRIBUTIONS:
        return (f"expected a value, a list, or one of {{uniform: [lo, hi]}}, {{loguniform: [lo, hi]}}, "
                f"{{randint: [lo, hi]}}, {{choice: [...]}}, got {value!r}")
    ((kind, args),) = value.items()
    if kind == "choice":
        return None if isinstance(args, list) and args else f"choice: expected a non-empty list, got {args!r}"
    if not (isinstance(args, list) and len(args) == 2):
        return f"{kind}: expected [lo, hi], got {args!r}"
    lo, hi = args
    if kind == "randint":
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in args) or lo > hi:
            return f"randint: expected two ints lo <= hi (both included), got {args!r}"
        return None
    if not (_number(lo) and _number(hi)) or lo >= hi:
        return f"{kind}: expected two finite numbers lo < hi, got {args!r}"
    if kind == "loguniform" and lo <= 0:
        return f"loguniform: expected 0 < lo < hi, got {args!r}"
    return None
