"""The one did-you-mean helper for names users type (methods, options, spec fields, dtypes, models)."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word, options: Iterable) -> str | None:
    """The closest of ``options`` to ``word``, or None when nothing is close."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word, options: Iterable) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options`` to ``word``, or "" when nothing is close."""
    close = closest(word, options)
    return f" (did you mean {close!r}?)" if close else ""
