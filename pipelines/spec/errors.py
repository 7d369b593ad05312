"""`SpecError`: every problem of a spec in one message, and pydantic's validation errors reworded into it.

The schema's own checks already speak our words (`pipelines.config.expect` / `one_of` / `problem` raise a
``spec`` error whose message is final); what is left to reword is pydantic's: an unknown field (with a did-you-mean
and the valid names), a missing field, a section that is not a mapping. Each problem names its field by its dotted
path: ``tune.max_failures``, ``trials[2].budget``.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from promprune.suggest import did_you_mean

UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")  # a TypedDict's extra key; a dataclass's
NOT_A_MAPPING = ("dataclass_type", "dict_type", "model_type")


class SpecError(ValueError):
    """Every problem found in a spec, one per line, each naming the offending field."""

    def __init__(self, errors: list[str], source: str = "sweep spec", fix: str | None = None):
        """``fix``: one line after the list, saying what to do (not counted as a problem)."""
        self.errors = [_capped(e) for e in errors]
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{source}: {len(self.errors)} problem(s):\n{lines}" + (f"\n{fix}" if fix else ""))


MAX_PROBLEM_CHARS = 2000  # a problem that echoes a huge value (a YAML alias chain: 5 MB) is cut to this


def _capped(text) -> str:
    """``text`` (a problem; kept as it is, a ``NotOnThisMachine`` too, where short) cut to `MAX_PROBLEM_CHARS`."""
    if len(text) <= MAX_PROBLEM_CHARS:
        return text
    return f"{text[:MAX_PROBLEM_CHARS]} ... ({len(text) - MAX_PROBLEM_CHARS} more characters)"


def path(loc: tuple) -> str:
    """('trials', 2, 'method') -> 'trials[2].method'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def unknown(key: Any, valid: list[str]) -> str:
    """`` (did you mean 'x'?); valid: a, b`` for a name that is not one of ``valid``."""
    return f"{did_you_mean(key, valid)}; valid: {', '.join(sorted(valid))}"


def reword(exc: ValidationError, valid_keys: dict[tuple, list[str]]) -> list[str]:
    """Pydantic's errors as our problems, in its order, each once. ``valid_keys``: the field names of the mapping at
    each location (for unknown fields)."""
    out = []
    for err in exc.errors():
        loc, kind = tuple(err["loc"]), err["type"]
        if kind == "spec":
            text = err["msg"]
        elif kind in UNKNOWN:
            valid = valid_keys.get(loc[:-1])
            text = "unknown field" + (unknown(loc[-1], valid) if valid else "")
        elif kind == "missing":
            text = "required field missing"
        elif kind in NOT_A_MAPPING:
            text = f"expected a mapping, got {err['input']!r}"
        else:  # a rule without our words yet: pydantic's, with the value
            text = f"{err['msg']}, got {err['input']!r}"
        out.append(f"{path(loc)}: {text}")
    return list(dict.fromkeys(out))
