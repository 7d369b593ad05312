"""Model factories: names like ``tiny:llava`` that build a VLM in code instead of loading a checkpoint.

``PrunedVLM.from_pretrained("<prefix>:<name>")`` looks ``prefix`` up here; anything else loads the ordinary way
(``from_pretrained`` of the checkpoint). A factory is ``fn(name, *, dtype, device_map, attn_implementation) ->
(model, processor, adapter_defaults)``. Factories are found through the ``promprune.model_factories`` entry-point
group (this package declares ``tiny``, ``tiny-easyvqa`` and ``shape`` in ``pyproject.toml``, so the adapters never
import the modules that build or train them) and through :func:`register_model_factory` at run time.
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

import torch

from promprune.naming import did_you_mean, parse_dtype

GROUP = "promprune.model_factories"
Factory = Callable[..., tuple]

_RUNTIME: dict[str, Factory] = {}


def register_model_factory(prefix: str, factory: Factory) -> None:
    """Make ``"<prefix>:<name>"`` build models with ``factory`` in this process (a duplicate prefix is an error)."""
    if prefix in _RUNTIME or prefix in _declared():
        raise ValueError(f"model factory {prefix!r} is already registered")
    _RUNTIME[prefix] = factory


def _declared() -> dict:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def model_factories() -> list[str]:
    """Every registered prefix."""
    return sorted(set(_declared()) | set(_RUNTIME))


def find_model_factory(name_or_path: str) -> tuple[Factory, str] | None:
    """``(factory, name)`` for ``"<prefix>:<name>"`` with a registered prefix; None for checkpoints and paths."""
    prefix, sep, name = str(name_or_path).partition(":")
    if not sep:
        return None
    if prefix in _RUNTIME:
        return _RUNTIME[prefix], name
    declared = _declared()
    if prefix in declared:
        return declared[prefix].load(), name
    if "/" not in prefix and "\\" not in prefix:  # looks like a factory name, not a path or URL
        raise ValueError(f"unknown model factory {prefix!r} in {name_or_path!r}{did_you_mean(prefix, model_factories())}"
                         f"; registered: {', '.join(model_factories())} (or give a checkpoint name or path)")
    return None


def place(model, *, dtype=None, device_map=None, attn_implementation=None):
    """Cast, move and configure a freshly built model as ``from_pretrained`` would (``"auto"`` keeps its dtype;
    ``device_map="auto"`` means CUDA when available)."""
    dtype = parse_dtype(dtype, allow_auto=True)
    if dtype not in (None, "auto"):
        model = model.to(dtype)
    if device_map == "auto":
        device_map = "cuda" if torch.cuda.is_available() else "cpu"
    if device_map is not None:
        model = model.to(device_map)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model.eval()
