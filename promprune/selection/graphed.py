"""Device work of a fixed shape, captured once as a CUDA graph and replayed: one launch instead of many.

PromPrune's selection on the CUDA fast path is a fixed sequence of small launches around one host read: the certified
split's first stage (the tokens' unit Gram, its centering, the density, the start and 6 or 12 Lanczos steps), each
later stage (6 to 16 more steps, one launch a step fused or three not, ``lanczos_triton``), and after the split the
two stages that pick the tokens (the cosine kernel, the saliency order, the DPP). At batch 1 the host spends ~25-35
us per launch on them while the device needs a few (H100, 2026-11-26: PromPrune's split 4.0 ms at LLaVA-1.5's shape
for ~1 ms of device work). A graph replays the same kernels on the same buffers with one launch.

``replay(fn, args, static)`` runs ``fn(*args, static)`` (tensors or None in, tensors out, no host read; ``static``: a
hashable the work's shape depends on, e.g. a step count or a budget and options) eagerly the first time a shape comes
and captures it the second time (``SIGHTINGS``: a shape that comes once never pays for a capture): static copies of
``args`` are allocated, ``fn`` runs once on a side stream (warm-up: cuBLAS picks its kernels and workspace, Triton
compiles), then once under capture (``thread_local``: other threads' CUDA work goes on). The first replay is checked
against the warm-up (the same call, eager, on the same inputs). Each later call copies ``args`` into those buffers,
replays, and returns clones of the outputs (the next replay overwrites them), or, for the outputs not in ``fresh``,
the buffers themselves (borrowed: the caller copies what it keeps before the next replay). The device runs exactly the
kernels of the eager call, in the same order, on the same values: the results are bit-identical
(``tests/selection/test_graphed.py`` on a GPU). At most ``KEEP`` captures are kept (least recently used first out); a
capture that fails, or whose first replay differs from its warm-up, is said once in a warning and the eager call is
used for the rest of the process. The captures are the process's: one thread replays at a time (a Ray actor's
default), as two threads replaying one graph would share its buffers.

A key holds its arguments' shapes, so work whose batch varies call to call makes a capture per size: the certified
split's later stages run on the views the stage before left undecided (any number of a call's), so
``certified.Lanczos.going`` pads them to ``bucket``'s sizes (powers of two, at most the state's rows; ``PAD``) with
copies of a row, never read: a key per bucket, not per count. Over a stream of 300 LLaVA-NeXT images at batch 8
counted on the CPU (`python benchmarks/selection.py --tables captures`, 2026-12-08; 40 views a call: the first stage
too large to replay, a later one replays from 12 undecided views down), unpadded, the split's and picking stages'
keys were 25, their captures 18 (2 evicted, 5 never replayed) for 56 replays; padded, 14 keys, 11 captures (none
evicted or unused), 74 replays. Not mended: where the caller's own batch varies, the first stage's and the picking
stages' keys vary with it (Qwen2.5-VL at batch 8 over four image sizes, one select per size of 1 to 8 images: 54
keys, 107 captures of which 60 re-captures of evicted keys, 47 never replayed, for 120 replays; a ``KEEP`` of 64
held them all: 47 captures, 253 replays).

Only where it pays and fits: ``fits`` asks for the switch (``accel.graphs()``), a CUDA tensor on the fast path, and at
most ``MAX_ELEMENTS`` elements per ``[B, n, n]`` matrix of the work. A Lanczos stage's capture holds about six such
float64 states (its inputs, outputs and the graph's pool); the first stage and the picking stages also hold a copy of
the tokens (float32, and their fp16 form where given). Estimated from those sizes, not measured: at LLaVA-1.5's shape
(batch 1, d = 4096) the first stage's and the picking stages' captures hold ~50 MiB, ~100 MiB with all three later
stages; five times that at LLaVA-NeXT's five views. ``clear()`` gives it back.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Hashable

import torch

from . import accel

# Captures kept per process (keys: function, shapes, dtype, device, static). A shape of PromPrune's takes the first
# stage, the picking stages (one per budget) and, for views near a count boundary, a later stage (three or four per
# schedule) per bucket of undecided views (``bucket``: up to four at LLaVA-NeXT's five views, 1 / 2 / 4 / 5).
KEEP = 16
# A shape is captured when it comes for the SIGHTINGS-th time (the calls before run eagerly): a capture costs about two
# eager calls, so shapes that come once (Qwen2.5-VL's native resolutions: a token count per image size) never pay it.
SIGHTINGS = 2
SEEN_KEEP = 256  # shapes remembered as seen (least recently seen first out)
# The first replay of a capture must give what its warm-up (the same call, eager) gave, to this tolerance relative to
# each output's largest finite magnitude (float64 state; the kernels are the same, so they agree bit for bit unless
# the capture changed them: a stale input or a baked-in host value shows as a gross difference; a library that picks
# another algorithm under capture moves the last bits, also of entries near zero, and is accepted).
AGREE_RTOL = 1e-9
# Elements of one [B, n, n] float64 state a capture may hold (32 MiB): batch 1 at n = 1296 (1.7M) and LLaVA-NeXT's five
# views of 576 (1.7M) fit, batch 8 at 1296 (13M) does not, and that is device-bound anyway.
MAX_ELEMENTS = 2**22

# A sub-batch whose rows vary call to call (the certified split's views still undecided after a stage, some of the
# call's: ``certified.Lanczos.going``) is padded to ``bucket``'s size where it replays: a key per bucket, not per count.
PAD = True

_CAPTURES: OrderedDict[tuple, "_Capture"] = OrderedDict()
_SEEN: OrderedDict[tuple, int] = OrderedDict()  # sightings of shapes not captured yet
_FAILED: list[str] = []  # why capture failed (then never tried again in this process)
# What ``replay`` did in this process: shapes captured, replays of a kept capture, eager calls (a shape's first
# sightings, or every call after a failure). A benchmark reads the difference around its timed calls (``tally``).
_TALLY = {"captures": 0, "replays": 0, "eager": 0}


class _Capture:
    """One captured call: its static inputs, its graph, its outputs (in the graph's memory pool), and until its first
    replay is checked, the outputs of its warm-up (``eager``: the same call run eagerly on the same inputs)."""

    def __init__(self, fn: Callable, args: tuple[torch.Tensor | None, ...], static: Hashable):
        device = next(a for a in args if a is not None).device
        self.inputs = tuple(None if a is None else a.detach().clone() for a in args)  # real values: a sane warm-up
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.eager = fn(*self.inputs, static)  # warm-up outside the capture (kernel selection, cuBLAS workspace)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of the process's other threads goes on (and is not captured) meanwhile
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs, static)

    def __call__(self, args: tuple[torch.Tensor | None, ...],
                 fresh: tuple[int, ...] | None) -> tuple[torch.Tensor, ...]:
        # an argument that is another slot's static input (a borrowed output of this graph's last replay: one step's
        # v_prev is its input v) would be overwritten by that slot's copy before its own: such arguments are copied
        # first; one that is its own slot's static input needs no copy
        held = {t.data_ptr(): i for i, t in enumerate(self.inputs) if t is not None}
        args = tuple(value.clone() if value is not None and held.get(value.data_ptr(), i) != i else value
                     for i, value in enumerate(args))
        for static, value in zip(self.inputs, args):
            if static is not None and (value.data_ptr(), value.stride()) != (static.data_ptr(), static.stride()):
                static.copy_(value)
        return tuple(out.clone() if fresh is None or i in fresh else out for i, out in enumerate(self._replay()))

    def _replay(self) -> tuple[torch.Tensor, ...]:
        """Run the captured work on the static inputs; its outputs (the graph's own buffers)."""
        self.graph.replay()
        return self.outputs


def _key(fn: Callable, args: tuple[torch.Tensor | None, ...], static: Hashable) -> tuple:
    return (fn.__module__, fn.__qualname__, static,
            *(None if a is None else (tuple(a.shape), a.dtype, str(a.device)) for a in args))


def fits(device_tensor: torch.Tensor, elements: int) -> bool:
    """Whether work on ``device_tensor``'s device whose largest ``[B, n, n]`` matrix has ``elements`` elements replays
    as a graph: the switch on, the CUDA fast path, at most ``MAX_ELEMENTS``, and no earlier capture failure in this
    process."""
    return accel.graphs_on() and accel.active(device_tensor) and elements <= MAX_ELEMENTS and not _FAILED


def bucket(rows: int, device_tensor: torch.Tensor, per_row: int) -> int:
    """The rows a sub-batch of ``rows`` rows of ``per_row`` elements each (of its ``[B, n, n]`` matrix) is padded to
    (``PAD``) so that its graph's key repeats: the next power of two, at most the rows ``MAX_ELEMENTS`` takes (``rows``
    itself where more), where the padded work replays as a graph (``fits``); else ``rows``, unpadded."""
    if not PAD or rows < 1:
        return rows
    padded = min(1 << (rows - 1).bit_length(), max(rows, MAX_ELEMENTS // per_row))
    return padded if fits(device_tensor, padded * per_row) else rows


def replays(args: tuple[torch.Tensor | None, ...], elements: int) -> bool:
    """Whether ``run`` with these ``args`` (tensors, or None) and ``elements`` replays a graph: the work ``fits`` on
    the device of the first tensor among them."""
    return fits(next(a for a in args if a is not None), elements)


def run(fn: Callable, args: tuple[torch.Tensor | None, ...], static: Hashable, elements: int,
        fresh: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """``fn(*args, static)``: through its graph (``replay``, ``fresh`` as there) where the work ``fits`` (its largest
    ``[B, n, n]`` matrix has ``elements`` elements), else eagerly."""
    return replay(fn, args, static, fresh) if replays(args, elements) else fn(*args, static)


def usable(state: torch.Tensor, steps: int) -> bool:
    """Whether ``steps`` Lanczos steps on ``state [B, n, n]`` replay as a graph (``fits``, and a step to run)."""
    return steps > 0 and fits(state, state.numel())


def _agree(replayed: tuple[torch.Tensor, ...], eager: tuple[torch.Tensor, ...]) -> bool:
    """Whether a capture's first replay gave its warm-up's outputs: floats to ``AGREE_RTOL`` of each output's largest
    finite magnitude (NaN where they had NaN: a breakdown's rows), indices and masks exactly."""
    def same(r: torch.Tensor, e: torch.Tensor) -> bool:
        if r.shape != e.shape or r.dtype != e.dtype:
            return False
        if r.is_floating_point():
            scale = float(torch.nan_to_num(e.abs(), nan=0.0, posinf=0.0).amax()) if e.numel() else 0.0
            return torch.allclose(r, e, rtol=0.0, atol=AGREE_RTOL * scale, equal_nan=True)
        return torch.equal(r, e)

    return len(replayed) == len(eager) and all(same(r, e) for r, e in zip(replayed, eager))


def replay(fn: Callable, args: tuple[torch.Tensor | None, ...], static: Hashable,
           fresh: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """``fn(*args, static)`` through its captured graph; the eager call for a shape's first ``SIGHTINGS - 1`` calls
    and for the rest of the process once a capture has failed or its first replay disagreed with its warm-up (said
    once). ``args``: tensors, or None where ``fn`` takes none (part of the capture's key). ``fresh``: the outputs
    returned as copies (default: all); the others are the graph's own buffers, which its next replay overwrites: a
    caller that borrows them copies what it keeps before then (one launch saved per output)."""
    if _FAILED:
        return _eager(fn, args, static)
    key = _key(fn, args, static)
    capture = _CAPTURES.get(key)
    if capture is None:
        seen = _SEEN.pop(key, 0) + 1
        if seen < SIGHTINGS:
            _SEEN[key] = seen
            while len(_SEEN) > SEEN_KEEP:
                _SEEN.popitem(last=False)
            return _eager(fn, args, static)
        try:
            capture = _Capture(fn, args, static)
            first = capture(args, None)  # copies of every output: the caller may keep them all
            if not _agree(first, capture.eager):
                raise RuntimeError("its first replay differs from the same call run eagerly")
        except Exception as exc:  # noqa: BLE001 - any capture failure: the eager call gives the same values
            _FAILED.append(f"{type(exc).__name__}: {exc}")
            warnings.warn(f"CUDA graph capture of {fn.__qualname__} failed ({_FAILED[-1]}); PromPrune's selection "
                          "runs its device work eagerly for the rest of this process (the same values, more host "
                          "time).", RuntimeWarning, stacklevel=2)
            return _eager(fn, args, static)
        _TALLY["captures"] += 1
        capture.eager = None
        _CAPTURES[key] = capture
        while len(_CAPTURES) > KEEP:
            _CAPTURES.popitem(last=False)
        return first
    _CAPTURES.move_to_end(key)
    _TALLY["replays"] += 1
    return capture(args, fresh)


def _eager(fn: Callable, args: tuple[torch.Tensor | None, ...], static: Hashable) -> tuple[torch.Tensor, ...]:
    """``fn(*args, static)`` run eagerly by ``replay``, counted in the tally."""
    _TALLY["eager"] += 1
    return fn(*args, static)


def tally() -> dict[str, int]:
    """What ``replay`` did in this process so far: ``captures`` (shapes captured), ``replays`` (of kept captures),
    ``eager`` (calls run eagerly: a shape's first sightings, a failed capture and every call after it)."""
    return dict(_TALLY)


def clear() -> None:
    """Drop every capture (their memory goes back to the allocator), the shapes seen, and a failure."""
    _CAPTURES.clear()
    _SEEN.clear()
    _FAILED.clear()
