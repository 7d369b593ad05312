"""The switch for the GPU fast path of the selection (issue 22), and what it may use.

On a CUDA tensor, with the switch on (the default), the selection takes the launch-free path: the greedy selectors
run as one Triton kernel per call (``greedy_triton``), PromPrune's split reads the spectral entropy through certified
bounds instead of an eigendecomposition (``certified``), the Gram of fp16/bf16 tokens is formed in their dtype with
fp32 accumulation, and the host waits on the device only where a stage needs a value (``count_sync`` counts those).
On the CPU nothing changes. ``PROMPRUNE_ACCEL=0`` in the environment, or ``with accel.disabled():``, restores the
plain torch path on CUDA too (the benchmark times both).

``PROMPRUNE_ENTROPY`` (or ``with accel.entropy("...")``) picks how PromPrune's split (and ``adaptive_views``' shares
over an image's views, ``batched_select._view_shares``) reads the spectral entropy:
``auto`` (default: certified bounds on the CUDA fast path where their float64 products cost the device at most half
the eigensolve they may save, ``certified.bracket_pays`` and per stage ``certified.stage_pays``; the exact
eigensolve elsewhere), ``certified`` (bounds on every device and every stage; the tests use it on the CPU) or
``exact`` (the eigensolve everywhere, e.g. to record exact entropies).

``PROMPRUNE_GRAPHS=1`` (or ``with accel.graphs():``) runs PromPrune's selection on that path as CUDA graphs
(``graphed``): the split's first stage from the tokens, each later stage, and the two picking stages after the split,
one graph each: at batch 1 the selection is bound by the host's launches (H100, 2026-11-26: ~4 ms of host time for
~1 ms of device work in the split alone). Off by default: an H200 run (2026-11-28) checked it against the eager call
and timed it ahead at every batch-1 shape of the selection benchmark, but not yet inside the model path
(docs/methods.md).
"""
from __future__ import annotations

import importlib.util
import math
import os
import time
import traceback
import warnings
from contextlib import contextmanager
from functools import cache

import torch

from ..env import ENTROPY_MODES  # the one vocabulary, kept where no torch is imported

_STATE = {"on": os.environ.get("PROMPRUNE_ACCEL", "1") != "0", "entropy": os.environ.get("PROMPRUNE_ENTROPY", "auto"),
          "graphs": os.environ.get("PROMPRUNE_GRAPHS", "0") == "1", "syncs": 0}
_BROKEN: dict[str, str] = {}  # kernel name -> why Triton could not build it on this machine (this process)


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


# The matrix-product backends whose float32 products a process may have set to run at reduced precision (TF32 on
# NVIDIA GPUs: `torch.backends.cuda.matmul.allow_tf32 = True`, `torch.set_float32_matmul_precision("high")`, common in
# training scripts; oneDNN's bf16 or TF32 on the CPU), as ``torch.backends`` names them.
REDUCED_FLOAT32 = ("cuda", "mkldnn")
_MATMULS = tuple(m for m in (getattr(getattr(torch.backends, name, None), "matmul", None) for name in REDUCED_FLOAT32)
                 if hasattr(m, "fp32_precision"))  # looked up once: a select's host time counts at batch 1


@contextmanager
def full_float32():
    """The block's float32 matrix products at full (IEEE) precision, whatever the process set, then its setting back.

    TF32 keeps 10 of float32's 23 mantissa bits: it moves the unit Gram's cosines by up to ~5e-5, enough to change
    near-tie picks (VisPruner's near-duplicate ranking most: 85-92% of its diverse tokens, emulated on the CPU by
    ``benchmarks/tf32_picks.py``), so the same call would keep other tokens in a process that turned TF32 on. Read
    and set through each backend's own ``fp32_precision`` (torch >= 2.9): the effective setting, whichever API the
    process used, and only where it is reduced, so a process that never asked for TF32 is not touched and one that
    did reads its setting back as it wrote it (the legacy ``allow_tf32`` and ``get_float32_matmul_precision``
    included)."""
    changed = []
    for matmul in _MATMULS:
        before = matmul.fp32_precision
        if before not in ("none", "ieee"):
            matmul.fp32_precision = "ieee"
            changed.append((matmul, before))
    try:
        yield
    finally:
        for matmul, before in changed:
            matmul.fp32_precision = before


@cache
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids and block counts on the host: plain integers. Triton's own ``triton.cdiv`` and
    ``triton.next_power_of_2`` are ``ConstexprFunction``s that cost ~5 us a call from Python (Triton 3.6-3.9, this
    VM): ~20 calls a PromPrune select, ~0.1 ms of the host's time that bounds it at batch 1."""
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    """The smallest power of 2 that is ``>= n`` (1 for ``n <= 1``): ``triton.next_power_of_2`` on plain integers."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Compute capabilities whose tensor cores multiply float64 matrices (``mma.sync ... f64``, DMMA): A100 / A30 (8.0),
# H100 / H200 (9.0), B200 / GB200 (10.0). Elsewhere (A40, A6000, L40, RTX cards: 8.6, 8.9, 12.0; B300's 10.3) float64
# runs on scalar FMA units at 1/32-1/64 of the float32 rate, and Triton's float64 ``tl.dot`` is a loop of scalar FMAs
# (their PTX for sm_86 and sm_89: ``fma.rn.f64``, no MMA; tests/selection/test_greedy_triton.py).
FLOAT64_MMA = frozenset({(8, 0), (9, 0), (10, 0)})


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_index(device: torch.device | str) -> int:
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def float64_mma(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies float64 matrices on tensor cores (`FLOAT64_MMA`), where a Triton kernel's float64
    product runs at about cuBLAS' rate. Not a CUDA device (the CPU standing for the fast path: the cost model, the
    interpreted corpus): True, the H100 / H200 they model."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return _capability(_device_index(device)) in FLOAT64_MMA


# The float64 product timed once per CUDA device (``float64_tflops``): PROBE_REPEATS products of PROBE_N x PROBE_N, each
# timed alone, after one untimed (cuBLAS' handle and kernel choice); the fastest counts, so a stall of the machine
# (another process's kernels on the same GPU) lowers the rate only if it lasts through all of them. ~0.3 ms on an
# H100 / H200, ~15 ms where float64 runs at 1/64 of float32's rate (A40: ~0.6 TFLOP/s), once per process.
PROBE_N = 1024
PROBE_REPEATS = 3


def measure_float64_tflops(device: torch.device | str, clock=time.perf_counter) -> float:
    """The rate (TFLOP/s) of the fastest of ``PROBE_REPEATS`` float64 ``PROBE_N x PROBE_N`` products on ``device``,
    each timed alone, after one untimed (any device; on CUDA the clock reads after a synchronize). ``clock``: seconds,
    monotonic."""
    device = torch.device(device)
    a = torch.full((PROBE_N, PROBE_N), 0.5, dtype=torch.float64, device=device)  # no draw: the RNGs stay as they were
    out = torch.mm(a, a)  # untimed: library start-up, kernel choice, workspace

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    wait()
    fastest = math.inf
    for _ in range(PROBE_REPEATS):
        start = clock()
        torch.mm(a, a, out=out)
        wait()
        fastest = min(fastest, clock() - start)
    return 2 * PROBE_N ** 3 / max(fastest, 1e-9) / 1e12


_FLOAT64_TFLOPS: dict[int, float] = {}  # CUDA device index -> its measured float64 rate (this process)


def float64_tflops(device: torch.device | str) -> float:
    """The float64 matrix-product rate of ``device`` in TFLOP/s, measured once per CUDA device and process
    (``measure_float64_tflops``: the capability does not tell it: an H800 is sm_90 like an H100, but its spec sheet
    gives float64 at 1 TFLOP/s against the H100's 67). Not a CUDA device (the CPU standing for the fast path: the cost
    model, the interpreted corpus): ``inf``, the H100 / H200 they model. Inside a CUDA graph capture, where nothing
    can be timed: the rate measured before, or ``inf``."""
    device = torch.device(device)
    if device.type != "cuda":
        return math.inf
    index = _device_index(device)
    if index not in _FLOAT64_TFLOPS:
        if torch.cuda.is_current_stream_capturing():
            return math.inf
        _FLOAT64_TFLOPS[index] = measure_float64_tflops(torch.device("cuda", index))
    return _FLOAT64_TFLOPS[index]


def has_triton() -> bool:
    """Triton is importable (the CUDA builds of torch ship it)."""
    return importlib.util.find_spec("triton") is not None


def fused(t: torch.Tensor) -> bool:
    """Whether the greedy selectors run their Triton kernel for ``t``: the fast path (``active``), Triton importable,
    and not float64 (the kernels are float32; float64 tokens take the torch loop)."""
    return active(t) and has_triton() and t.dtype != torch.float64


def _raised_in_triton(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside Triton's own code (its compiler or its backends), not by a CUDA call of ours
    (an out-of-memory or a device error passes through)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{os.sep}triton{os.sep}" in frames[-1].filename


def kernel(name: str, launch):
    """``launch()`` (one Triton kernel's launch), or None when Triton cannot compile that kernel on this machine.

    A compiler failure (H100 with Triton 3.x once asserted in a pass on one of ours) is said once per kernel in a
    warning and remembered for the process: the caller then takes its torch path, which picks the same tokens,
    slower. Any other error (CUDA out of memory, a device fault) is raised as it is.
    """
    if name in _BROKEN:
        return None
    try:
        return launch()
    except Exception as exc:  # noqa: BLE001 - only Triton's own failures are kept, the rest re-raised
        if not _raised_in_triton(exc):
            raise
        first_line = (str(exc).strip().splitlines() or [""])[0]
        _BROKEN[name] = f"{type(exc).__name__}: {first_line}"
        warnings.warn(f"Triton could not compile the selection's {name} kernel on this GPU ({_BROKEN[name]}); "
                      f"{name} takes its torch path for the rest of this process (the same tokens, slower). "
                      "Please report it with `python -c 'import triton, torch; print(triton.__version__, "
                      "torch.__version__)'` and the GPU's name.", RuntimeWarning, stacklevel=2)
        return None


@contextmanager
def without_kernel(name: str):
    """Inside the block the ``name`` kernel's callers take their torch path, as if Triton could not build it (a
    benchmark's comparison: e.g. "lanczos", the certified split's matrix and recurrence)."""
    before = _BROKEN.get(name)
    _BROKEN[name] = "switched off (accel.without_kernel)"
    try:
        yield
    finally:
        if before is None:
            del _BROKEN[name]
        else:
            _BROKEN[name] = before


def broken_kernels() -> dict[str, str]:
    """The kernels Triton could not compile in this process, with why (``kernel``)."""
    return dict(_BROKEN)


def graphs_on() -> bool:
    """Whether PromPrune's selection on the fast path (its split's stages, its picking stages) replays as CUDA graphs
    (``graphed``): off unless ``PROMPRUNE_GRAPHS=1`` or ``with accel.graphs(True):``; docs/methods.md says why it is
    not yet the default."""
    return _STATE["graphs"]


@contextmanager
def graphs(on: bool = True):
    """Replay (or not) PromPrune's selection as CUDA graphs inside the block (``graphs_on``)."""
    before = _STATE["graphs"]
    _STATE["graphs"] = bool(on)
    try:
        yield
    finally:
        _STATE["graphs"] = before


def entropy_mode() -> str:
    """How PromPrune's split reads the spectral entropy: "auto", "certified" or "exact" (module docstring)."""
    mode = _STATE["entropy"]
    if mode not in ENTROPY_MODES:
        raise ValueError(f"PROMPRUNE_ENTROPY must be one of {', '.join(ENTROPY_MODES)}, got {mode!r}")
    return mode


@contextmanager
def entropy(mode: str):
    """Read the spectral entropy by ``mode`` inside the block."""
    if mode not in ENTROPY_MODES:
        raise ValueError(f"entropy mode must be one of {', '.join(ENTROPY_MODES)}, got {mode!r}")
    before = _STATE["entropy"]
    _STATE["entropy"] = mode
    try:
        yield
    finally:
        _STATE["entropy"] = before


def count_sync() -> None:
    """Note one read of device values by the host (the selection's deliberate syncs; ``syncs()`` returns the count)."""
    _STATE["syncs"] += 1


def syncs() -> int:
    """Deliberate host reads of device values since the process started (``benchmarks/selection.py``'s cost model)."""
    return _STATE["syncs"]
