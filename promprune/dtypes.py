"""The one dtype vocabulary of the project: the names specs, CLI flags, lmms-eval model_args and benchmarks accept.

Importing it does not import torch (the sweep's spec and pool processes read the names only); the functions that
return or take torch dtypes import it when called."""
from __future__ import annotations

from typing import TYPE_CHECKING

from promprune.suggest import did_you_mean

if TYPE_CHECKING:
    import torch


# dtype names a user may write (specs, CLI flags, lmms-eval model_args, benchmarks) -> the torch dtype's name
DTYPES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}
CANONICAL_DTYPES = ("float32", "float16", "bfloat16", "float64")  # what specs and docs spell
AUTO = "auto"  # the checkpoint's own dtype (from_pretrained); pipelines: bfloat16 on GPU, float32 on CPU


def canonical_dtype(name, *, allow_auto: bool = False) -> str:
    """The canonical name (:data:`CANONICAL_DTYPES`) of a name in ``DTYPES`` (``"torch.float16"`` too, any case), or
    "auto" for None / "auto" when ``allow_auto``; no torch import (specs, CLI flags). An unknown name is a ValueError
    with a did-you-mean, listing the valid ones. :func:`parse_dtype` reads names through it."""
    if allow_auto and name in (None, AUTO):
        return AUTO
    key = str(name).lower().removeprefix("torch.")
    if isinstance(name, bool) or key not in DTYPES:
        valid = ([AUTO] if allow_auto else []) + sorted(DTYPES)
        raise ValueError(f"unknown dtype {name!r}{did_you_mean(key, DTYPES)}; use one of {', '.join(valid)}")
    return DTYPES[key]


def dtype_problem(dtype) -> str | None:
    """Why ``dtype`` (a name, a torch dtype; None / "auto": the checkpoint's own) cannot be a model's dtype, as
    :func:`canonical_dtype` words it (naming the valid ones), or None. No torch import: a torch dtype is read by its
    name (``torch.int8``: none of :data:`CANONICAL_DTYPES`, refused; it failed in torch once the model was built)."""
    try:
        canonical_dtype(dtype, allow_auto=True)
    except ValueError as exc:
        return str(exc)
    return None


def parse_dtype(name, *, allow_auto: bool = False):
    """A torch dtype from a dtype or a name in ``DTYPES`` (``"torch.float16"`` too); ``None``/``"auto"`` stay as they
    are when ``allow_auto``. An unknown name is a ValueError listing the valid ones."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if allow_auto and name in (None, AUTO):
        return name
    return getattr(torch, canonical_dtype(name))


def dtype_name(dtype) -> str:
    """The canonical name (float32 / float16 / bfloat16 / float64) of a dtype or any accepted alias."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the library computes in for tensors of ``dtype``: float64 for float64 (a float64 model keeps its
    precision end to end: the testbed's CPU-independent runs), float32 for everything else (fp16 / bf16 upcast)."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`compute_dtype` (float32, or float64 when it is float64)."""
    return t.to(compute_dtype(t.dtype))
