"""Optional imports of lmms-eval deferred to their first use: Hugging Face's ``evaluate``.

lmms-eval's ``api/registry.py`` imports ``evaluate`` at its top for one path (``get_metric(name,
hf_evaluate_metric=True)``, metrics loaded by name from the Hub), and ``evaluate`` imports transformers' pipelines,
torchvision and torch's compiler: 3-4 s of CPU in every process that scores (the sweep's driver and each trial process;
RESULTS, 2026-11-26), for a module none of our tasks uses. ``defer()`` puts a stand-in module under that name in
``sys.modules``: ``import evaluate`` returns it at no cost, and the first attribute read on it (``evaluate.load``)
imports the real module, which then replaces the stand-in everywhere it is looked up by name (the stand-in forwards
to it for whoever kept a reference). Nothing is mocked: whoever uses ``evaluate`` gets the real one.

``importlib.util.LazyLoader`` cannot do this on Python 3.11: the import system reads the module's ``__spec__`` on
every later ``import evaluate``, which makes a lazy module load itself. The stand-in carries a real ``__spec__``
and ``__file__``, and a read of any other double-underscore name (``hasattr(module, "__wrapped__")``, as ``inspect``
and torch's registration code do over every module in ``sys.modules``) answers AttributeError without loading.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types

DEFERRED = ("evaluate",)
_LOCK = threading.RLock()


class _StandIn(types.ModuleType):
    """A module not imported yet: the first read of a public attribute imports it."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(real_module(self.__name__), name)


def real_module(name: str) -> types.ModuleType:
    """The real module ``name``, imported now if only its stand-in is there."""
    with _LOCK:
        current = sys.modules.get(name)
        if isinstance(current, _StandIn):
            del sys.modules[name]
            try:
                real = importlib.import_module(name)
            except BaseException:
                sys.modules[name] = current  # the stand-in stays; the error is the real import's
                raise
            current.__dict__.update({k: v for k, v in vars(real).items() if k not in ("__class__", "__dict__")})
            return real
        return current if current is not None else importlib.import_module(name)


def defer(names: tuple[str, ...] = DEFERRED) -> None:
    """Stand-ins for ``names`` not imported yet (installed ones only; idempotent)."""
    with _LOCK:
        for name in names:
            if name in sys.modules:
                continue
            spec = importlib.util.find_spec(name)
            if spec is None:
                continue
            stand_in = _StandIn(name)
            stand_in.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=spec.origin)
            stand_in.__file__ = spec.origin
            sys.modules[name] = stand_in


def is_deferred(name: str) -> bool:
    """Whether ``name`` is still a stand-in (its real module not imported)."""
    return isinstance(sys.modules.get(name), _StandIn)
