"""The switch for the GPU fast path of the selection (issue 22), and what it may use.

On a CUDA tensor, with the switch on (the default), the selection takes the launch-free path: the greedy selectors
run as one Triton kernel per call (``greedy_triton``), the spectral entropy's eigensolve as one batched cuSOLVER call
(``eigensolve``, when nvmath-python is installed), the Gram of fp16/bf16 tokens is formed in their dtype with fp32
accumulation, and the host never waits on the device between the stages (no ``.item()``, no ``int(t.max())``).
On the CPU nothing changes. ``PROMPRUNE_ACCEL=0`` in the environment, or ``with accel.disabled():``, restores the
plain torch path on CUDA too (the benchmark times both).
"""
from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from functools import cache

import torch

_STATE = {"on": os.environ.get("PROMPRUNE_ACCEL", "1") != "0"}


def active(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the fast path: a CUDA tensor with the switch on."""
    return t.is_cuda and _STATE["on"]


@contextmanager
def disabled():
    """Run the plain torch path on CUDA inside the block (for comparisons)."""
    before = _STATE["on"]
    _STATE["on"] = False
    try:
        yield
    finally:
        _STATE["on"] = before


@cache
def has_triton() -> bool:
    """Triton is importable (the CUDA builds of torch ship it)."""
    return importlib.util.find_spec("triton") is not None
