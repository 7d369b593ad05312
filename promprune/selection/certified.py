"""PromPrune's budget split without a full eigendecomposition: certified bounds on the spectral entropy.

PromPrune reads the spectral entropy H only through ``t_sal = round(T * ratio(H))``, a non-increasing step function of
H. If H is known to lie in ``[lo, hi]`` and both ends give the same count, that count is the exact algorithm's. The
bounds come from Gauss quadrature (Golub and Meurant, "Matrices, Moments and Quadrature"; Bai, Fahey and Golub 1996):

- ``rho = C / tr(C)`` (``C``: the centered Gram, or the covariance when N > d; the matrix whose eigenvalues the exact
  entropy reads) has eigenvalues ``l_i >= 0`` summing to 1, and ``H log(n) = -sum l_i log l_i = n * int f dmu`` with
  ``f(x) = -x log x`` and ``mu`` the uniform measure on the eigenvalues.
- Lanczos on the operator ``V -> rho V`` over n x n matrices with the Frobenius inner product, started from
  ``I / sqrt(n)``, yields the Jacobi matrix of exactly that measure (``<I, g(rho) I> / n = int g dmu``), with no random
  probe: k steps cost k batched n x n products.
- ``f``'s even derivatives are negative and its odd ones (from the third) positive on x > 0, so the k-node Gauss rule
  overestimates ``int f dmu`` and the (k + 1)-node Gauss-Radau rule with a node fixed at 0 (below every eigenvalue)
  underestimates it: ``lo <= H <= hi``.

The exact route clamps ``C``'s eigenvalues at the absolute ``entropy.EIGEN_FLOOR`` (1e-12, the released code's and
mu's), which ``rho``'s measure does not see: ``density`` refuses a ``C`` whose trace is at most ``refusal_trace``
(``n`` `FLOOR_PER_ROW`: tokens nearly alike, where the floor moves H by more than the bounds' width; those rows take the
eigensolve), and ``split`` widens every bracket by ``floor_allowance(n)`` (a bound on the floor's move above that
trace, ``floor_shift``: ~1e-8), so a bracket holds the exact route's H.

``split`` runs the first stage's steps for every image (``schedule``: `STEPS`, after a `LEAD`-step stage where the
batch's steps cost the device or the host more than a stage costs the host), decides every image whose bracket
(widened by ``decision_margin``) gives one count, continues the rest to the next stage, decides again, and so on, and
computes the exact entropy (``entropy.entropy_of_matrix``, the reference) only for what is still undecided, and for
images whose bounds a stage refuses (a Krylov space that ran out: spectra of few distinct values) or which no later
stage can decide (``judge``: a bracket within the margin of a count boundary, where even a bracket of width 0 widened
by the margin straddles it) without running the later stages; where no image goes on, no later stage runs. In "auto"
a stage runs only where its float64 products cost the device at most half the eigensolve they may save
(``stage_pays``): on GPUs whose float64 runs at 1/64 rate the views still undecided go to the eigensolve early. The
device work is enqueued without waiting; the host reads the recurrence coefficients once per stage (``host_read``:
one sync for a batch the first stage decides). The small tridiagonal eigenproblems are solved on the host in float64.

``settle`` runs the same stages for a caller whose decision reads several entropies at once (``adaptive_views``'
shares over an image's views, ``batched_select.certain_shares``): views of several sizes, one read a stage for all,
the caller saying after each stage which views it needs no more (and, optionally, which no later stage can settle:
they take the eigensolve at once), the eigensolve for the rest. PromPrune's split then reuses such a caller's
intervals (``known_counts``, ``select(..., entropy_bounds=)``): a view whose interval, widened by the margin once more
for the other matrix PromPrune's exact route eigensolves, gives one count runs no stage of its own.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import accel, graphed
from .entropy import (EIGEN_FLOOR, cancels, centered_gram, centered_unit_gram, entropy_of_matrix, noise_trace,
                      spectral_matrix)
from .kernels import start_basis

# Lanczos steps by the end of each stage: every image runs the first; an image whose bracket still straddles a count
# boundary continues to the next. Measured on synthetic spectra at n = 576 / 1296 (benchmarks/entropy_bounds.py): 16
# steps bracket H within 1e-5 to 2e-3, 48 steps within 1e-7 to 2e-4, while t_sal's boundaries lie >= 1.25e-3 apart at
# T = 64 (tau = 0.02). Each step costs the device a float64 n x n product per image (the batch-8 cost on an H100) and
# the host a few launches (the batch-1 cost: seven in the torch loop, three on the fast path), so the schedule
# minimizes steps run: over the split table's 48 images per shape (mu within +-2 tau, the hardest place),
# (12, 24, 32, 48) runs 24% fewer steps than (16, 48) at LLaVA's 576 x 4096 and 13% fewer at Qwen2.5-VL's 1296 x 3584,
# for at most two host reads more per call, with the same images left to the eigensolve
# (`python benchmarks/selection.py --tables schedules --split-images 48`, RESULTS 2026-11-26 evening).
STEPS = (12, 24, 32, 48)
# A leading stage of LEAD steps, before STEPS, where one step of the whole batch costs the device more than a stage
# costs the host (one read, the bounds: ~0.2 ms), i.e. from LEAD_FROM = views x n^3 (two views of 576 tokens: LLaVA-1.5
# at batch 1 keeps STEPS; LLaVA-NeXT's five views, Qwen2.5-VL's 1296 tokens and any batch take the lead). A view that
# decides there runs half the steps of STEPS' first stage (at LLaVA-NeXT batch 8, 40 views of 576: ~1.1 ms a step on
# the H100 of 2026-11-26); one that does not pays one host read more and no extra step (the recurrence goes on from the
# lead's state). Six, not four: the benchmark's 576-token views decide at 4 steps but its 1296-token view (H 0.49 at
# mu 0.42) only at 6, and of the split table's 48 images near mu (`--tables schedules`) 6 decide at 6 at 576 tokens,
# none at 4: (6, 12, 24, 32, 48) runs 932 steps and 123 reads there against 968 and 129 for a lead of 4.
# Since 2026-11-29 the lead also opens every call whose steps are launched one by one (no CUDA graph replays the
# stage: PROMPRUNE_GRAPHS off, the default, and the CPU): there a step costs the host its three launches (~84 us at the
# cost model's 28 us each) whatever the views, as much as a step of the two views at LEAD_FROM costs the device, so
# LLaVA-1.5 at batch 1 stops being the one eager call without it. A view far from mu then decides after 6 steps instead
# of 12 (18 launches fewer: 53 -> 35 a call at LLaVA-1.5 in the cost model); over the split table's 48 images near mu
# the lead runs 36 steps fewer and 42 reads more (932 / 123 against 968 / 81): at 84 us a step and ~0.15 ms a read,
# ~0.07 ms more per image there, against ~0.5 ms less for each image that decides at 6.
# With the fused step (``lanczos_triton.FUSED_UP_TO``: LLaVA-1.5 and LLaVA-NeXT at batch 1, since the second stop of
# 2026-11-29) an eager step costs the host one launch (~28 us), not three: the lead saves an image that decides at 6
# ~0.17 ms (six launches) and costs one that goes on a read (~0.15-0.2 ms) and a launch; over the split table's 48
# images near mu, ~0.15 ms more per image. Kept: whether the benchmark's images mostly decide at 6 (the cost model's
# inputs do) is for a GPU's ``boundary`` rows and Table 6 to say.
LEAD = 6
LEAD_FROM = 2 * 576 ** 3


def schedule(views: int, n: int, eager: bool = True) -> tuple[int, ...]:
    """The Lanczos steps by the end of each stage for ``views`` matrices of size ``n`` (`STEPS`, after a `LEAD`-step
    stage from `LEAD_FROM`, or whenever the steps are launched ``eager``ly: no CUDA graph replays the stage)."""
    return (LEAD, *STEPS) if eager or views * n ** 3 >= LEAD_FROM else STEPS


# The bracket is widened by this much (normalized H) before it decides: it covers the exact algorithm's own float32
# rounding (its eigenvalues near 0 carry ~1e-8 absolute error; measured <= 1.6e-6 on near-low-rank inputs at n = 1296)
# and the float64 Lanczos' (~1e-12); an image within it of a boundary goes to the exact eigensolve. It also covers
# what the bracket itself misses: a float32 spectral matrix of near-low-rank tokens has negative rounding eigenvalues
# (their sum 1.7-3.1e-6 of the trace at n = 1296), where the Gauss-Radau rule's node at 0 no longer lies below the
# spectrum, and the exact route clamps them: brackets of ~1e-7 missed the float64 entropy of their own float32 matrix
# by up to 9e-6 at n = 1296 (5.9e-6 at 256; a probe of 2026-12-07, adversarial near-low-rank inputs), growing with the
# negative mass (~2.8x its share of the trace). So ``split`` reports it in the half-width. The miss grows with the
# matrix's size, slowly (~n^0.4): the worst distance from a decided bracket to the exact route's entropy over 40
# adversarial inputs per size (benchmarks/margin_by_size.py, d = 4096, 2026-12-07) was 6.2e-6 at n = 576, 8.5e-6 at
# 1296, 1.07e-5 at 2304, 1.27e-5 at 3600 (the float64 entropy's slightly less), so the margin grows as sqrt(n /
# MARGIN_FROM) above MARGIN_FROM (``decision_margin``): 2e-5 up to the paper's largest view, 2.67e-5 at 2304 and
# 3.33e-5 at 3600, a headroom of 3.2x / 2.3x / 2.5x / 2.6x, where a fixed 2e-5 left 1.9x at 2304 and 1.6x at 3600.
DECISION_MARGIN = 2e-5
MARGIN_FROM = 1296


def decision_margin(n: int) -> float:
    """The margin (normalized H) by which a bracket of an ``n x n`` spectral matrix is widened before it decides and
    which its reported half-width includes: ``DECISION_MARGIN`` up to ``MARGIN_FROM``, growing as ``sqrt(n /
    MARGIN_FROM)`` above (the float32 matrix's rounding the bracket does not hold grows with n)."""
    return DECISION_MARGIN * max(1.0, n / MARGIN_FROM) ** 0.5
# The exact route clamps C's eigenvalues at the absolute ``entropy.EIGEN_FLOOR`` (1e-12, as the released code does and
# as mu was calibrated); the bounds read rho = C / tr(C), where the floor is EIGEN_FLOOR / tr(C) and moves H by up to
# ``floor_shift(n, tr(C))``: ~1e-11 for ordinary tokens (tr(C) = N x spread, O(N)), more than DECISION_MARGIN for a
# tr(C) below ~1e-5 (float64 tokens nearly alike). ``density`` refuses (NaN rho: the eigensolve) a C whose trace is
# at most this per row (``refusal_trace``; for unit tokens a spread 1 - |mean unit token|^2 below ~1e-3 when N <= d,
# a mean cosine above ~0.999), and ``split`` widens every bracket by ``floor_allowance(n)`` (the shift at half that
# trace: 8.8e-9 at n = 576, 8.1e-9 at 1296, below 1e-7 at any n), so the bracket holds the exact route's H. A power
# of 2, so that the Triton centering's literal (``lanczos_triton.REFUSE_PER_ROW``) is the same number; above
# float32's noise per row (``entropy.noise_trace``: 7.6e-6), which it therefore includes.
FLOOR_PER_ROW = 2.0 ** -10
# A residual norm below this fraction of the largest recurrence coefficient means the Krylov space ran out (a spectrum
# of few distinct eigenvalues: numerically low-rank tokens). There the exact algorithm's float32 eigenvalues near 0 are
# rounding noise that moves its entropy by up to ~1e-5, so such images go to the exact eigensolve.
BREAKDOWN = 1e-7
# Below this matrix size the exact eigensolve is cheap on any device: "auto" does not try the bracket.
MIN_SIZE = 64
# The exact float32 eigensolve of one view on a GPU (cuSOLVER's syevd through torch.linalg.eigvalsh, H100,
# 2026-11-26): 5.46 ms at n = 576, 13.91 ms at n = 1296, i.e. ~5.46 (n / 576)^1.153 ms, linear in the views. It is
# latency-bound (float64 took 5.58 / 14.59 ms, the host's LAPACK 12.4 / 56.4 ms), so it stands for any GPU's in
# ``stage_pays``, against a stage's float64 products at the device's own measured rate.
EIGENSOLVE_MS_AT_576 = 5.46
EIGENSOLVE_EXPONENT = 1.153
# The chance a stage of the bracket is taken to decide a view it runs, in pricing it ("auto", ``stage_pays``): a stage
# runs where its float64 products cost the device at most this share of the eigensolve it may save, since a view it
# leaves undecided pays both. A prior, not a measurement of real images: far from mu every view decides at the lead;
# of the split table's 48 images of 576 tokens within 2 tau of mu (`python benchmarks/selection.py --tables split
# --split-images 48`) 6 decide at its 6 steps and 18 of the other 42 by 12; of Table 6's five views on the H200
# (2026-11-28) 2 at the lead and 1 at 12. Where float64 runs at full rate (H100: 0.05 ms for the lead at n = 576)
# every stage runs whatever this is; `--tables routes` prices the routes at six float64 rates over those images.
STAGE_DECIDES = 0.5


@dataclass
class SplitReport:
    """How one ``split`` call decided: images per stage (``decided[i]`` by stage i's bounds) and by the exact eigensolve
    (``exact``; ``refused`` of them sent there at the stage whose bounds refused them: a recurrence that ran out or
    failed, or a trace at most ``refusal_trace`` (``density``), which no later stage mends; ``costly`` of them,
    undecided, sent there instead of a later stage whose float64 products would cost the device more than it may save,
    ``stage_pays``; ``hopeless`` of them sent there at a stage before the last because no later stage could decide
    them, ``judge``: their bracket lies within the margin of a count boundary, ``settle``'s ``hopeless``), and the
    bracket widths (normalized H, widened by ``floor_allowance``) the decided images had. ``cancelled``: images whose
    tokens are so alike that their centering in Gram space cancels (``entropy.cancels``), split again from the first
    stage on their tokens centered first; their stages and eigensolve are counted with the others'. ``known``: images
    decided by the intervals their caller handed in (``known_counts``: ``adaptive_views``' brackets of the shares), no
    stage or eigensolve run for them (not counted in ``decided``)."""

    decided: list[int] = field(default_factory=list)
    exact: int = 0
    refused: int = 0
    cancelled: int = 0
    costly: int = 0
    widths: list[float] = field(default_factory=list)
    hopeless: int = 0
    known: int = 0

    def merge(self, other: "SplitReport") -> None:
        """Add ``other``'s images (a split of some of this call's images on their own) to this report's."""
        self.decided = [a + b for a, b in itertools.zip_longest(self.decided, other.decided, fillvalue=0)]
        self.exact, self.refused, self.costly = self.exact + other.exact, self.refused + other.refused, \
            self.costly + other.costly
        self.cancelled += other.cancelled
        self.hopeless += other.hopeless
        self.known += other.known
        self.widths += other.widths

    @classmethod
    def total(cls, reports: list["SplitReport"]) -> "SplitReport | None":
        """One report of ``reports`` merged (None: there are none)."""
        if not reports:
            return None
        out = cls()
        for one in reports:
            out.merge(one)
        return out

    @property
    def exact_note(self) -> str:
        """``exact`` for a benchmark's line, with how many of them a costlier stage sent there and how many went
        there early, no later stage able to decide them (``hopeless``), if any, how many images were split on
        their tokens centered first (``cancelled``), and how many their caller's intervals decided (``known``: in
        neither ``decided`` nor ``exact``)."""
        why = [f"{self.costly} instead of a costlier stage"] * bool(self.costly) \
            + [f"{self.hopeless} early: no later stage could decide"] * bool(self.hopeless)
        alike = f"; {self.cancelled} split on their centered tokens (alike)" if self.cancelled else ""
        known = f"; {self.known} decided by the caller's intervals" if self.known else ""
        return f"{self.exact}" + (f" ({', '.join(why)})" if why else "") + alike + known


LAST_REPORT: list[SplitReport] = []  # the newest call's report (benchmarks read it); one entry, replaced per call
_SINKS: list[list[SplitReport]] = []  # the open `collected` blocks


@contextlib.contextmanager
def collected():
    """Every ``split`` call's report inside the block, in a list (``SplitReport.total`` merges them): a model's
    selection of one batch may split several times (one ``select`` per budget bucket: LLaVA-NeXT's views under
    ``per_crop`` when the budget does not divide evenly, views of different counts), and `LAST_REPORT` holds only the
    newest call's."""
    sink: list[SplitReport] = []
    _SINKS.append(sink)
    try:
        yield sink
    finally:
        _SINKS.remove(sink)


@dataclass
class Lanczos:
    """The state of the matrix Lanczos recurrence on ``rho [B, n, n]`` (float64, on the device): the last two basis
    matrices ``v``, ``v_prev`` (None before the first step), the last residual norm ``b_prev [B]`` (None before the
    first step), and ``history``: each stage's coefficients packed as ``[B, 2k]`` (its k alphas, then its k betas;
    ``beta[:, j]`` the norm of the residual after step j). ``alpha`` / ``beta`` join them ``[B, steps]``."""

    rho: torch.Tensor
    v: torch.Tensor
    v_prev: torch.Tensor | None = None
    b_prev: torch.Tensor | None = None
    history: tuple[torch.Tensor, ...] = ()

    @classmethod
    def start(cls, rho: torch.Tensor) -> "Lanczos":
        """Before the first step: ``v = I / sqrt(n)``."""
        return cls(rho, start_basis(rho))

    @classmethod
    def open(cls, fn: Callable[..., tuple[torch.Tensor, ...]], args: tuple[torch.Tensor | None, ...],
             steps: int, size: int, tokens: torch.Tensor | None = None) -> tuple["Lanczos", torch.Tensor | None]:
        """The first stage, ``fn(*args, steps) -> (packed, rho, v, v_prev)`` (``opening`` of the spectral matrix,
        ``opening_from_gram`` of the unit Gram, or a caller's own from the tokens): with ``accel.graphs()`` on and its
        ``[B, n, n]`` matrices of at most ``graphed.MAX_ELEMENTS`` (``size``) elements (``graphed.fits``), all of it
        replays as one CUDA graph, and the state's matrices are then the graph's own buffers (borrowed), valid until
        its next replay. ``split`` reads them before that: the next stage's replay copies them into its own graph's
        inputs first (an input that is one of that graph's own buffers among them too, ``graphed._Capture``), an eager
        stage reads them as they are, and where some images decided, ``rows`` copies the others'.

        With ``tokens [B, N, d]``, the same call (the same graph) also gives what ``split`` reads of it (else None):
        the coefficients with ``entropy.cancels`` of the tokens as a last column ``[B, 2 steps + 1]``, 1.0 where a
        row's centering in Gram space cancels."""
        if tokens is None:
            packed, rho, v, v_prev = graphed.run(fn, args, steps, size, fresh=(0,))
            flags = None
        else:
            at = next((i for i, a in enumerate(args) if a is tokens), None)  # tokens already an input: not twice
            packed, rho, v, v_prev, flags = graphed.run(_flagged, args if at is not None else (*args, tokens),
                                                        (fn, steps, at), size, fresh=(0,))  # flags: read at once
        return cls(rho, v, v_prev, packed[:, -1], (packed,)), flags

    def run(self, steps: int, borrow: bool = False) -> "Lanczos":
        """``steps`` more steps (each: one batched product and a few fused updates; nothing waits), replayed as one
        CUDA graph where ``graphed.fits``; ``borrow`` as in ``open``."""
        if steps == 0:
            return self
        args = (self.rho, self.v, self.v_prev, self.b_prev)
        packed, v, v_prev = graphed.run(lanczos_steps, args, steps, self.rho.numel(), fresh=(0,) if borrow else None)
        return Lanczos(self.rho, v, v_prev, packed[:, -1], self.history + (packed,))

    @property
    def alpha(self) -> torch.Tensor:  # [B, steps]
        return self._joined(0)

    @property
    def beta(self) -> torch.Tensor:  # [B, steps]
        return self._joined(1)

    def _joined(self, half: int) -> torch.Tensor:
        parts = [h.view(h.shape[0], 2, -1)[:, half] for h in self.history]
        return torch.cat(parts, 1) if parts else self.rho.new_zeros(self.rho.shape[0], 0)

    def rows(self, index: torch.Tensor) -> "Lanczos":
        """The recurrence of the images ``index`` only, copied (to continue it for them); the past coefficients stay
        behind (``split`` holds them on the host)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return Lanczos(pick(self.rho), pick(self.v), pick(self.v_prev), pick(self.b_prev))

    def going(self, going: np.ndarray) -> "Lanczos":
        """The recurrence of the images where ``going [R]`` (host bool) is true, the state's first ``R`` rows (those
        past them are padding, below): a copy of their rows (``rows``; the indices sent without a wait), or, when all
        go on, the state as it is (four launches fewer a stage: the next stage reads its borrowed buffers before a
        replay could overwrite them, ``open``). Where the next stage replays as a CUDA graph, the copy is padded to
        ``graphed.bucket``'s size (a power of two, at most the state's rows, and no further than the rows' own kernel
        goes: ``lanczos_triton.fuses``) with copies of its last row, so that the graph's key, which holds the rows,
        repeats over calls whose undecided views differ in number (one capture per bucket, not per count:
        ``graphed``); a padding row runs the steps of the row it copies, each row on its own (the batched product
        and the per-row sums: on the CPU the rows' bits are the unpadded call's, ``tests/selection/test_graphed.py``;
        a GPU's batched product may pick another kernel for another batch, which would move the coefficients' last
        bits, ~1e-15 against a decision margin of 2e-5: not measured), and is never read (``split`` and ``settle``
        read the first ``R`` rows). A state already padded stays as it is where all its ``R`` rows go on and ``R``
        pads to its size."""
        index = np.flatnonzero(going)
        size = min(graphed.bucket(len(index), self.rho, self.rho[0].numel()), self.rho.shape[0])  # never grows
        while size > len(index) and _fused_steps(size, self.rho) != _fused_steps(len(index), self.rho):
            size -= 1  # the padding keeps the rows' kernel (``lanczos_steps``: fused up to a size): their bits
        if len(index) == len(going) and self.rho.shape[0] in (len(going), size):
            return self
        index = np.concatenate([index, np.full(size - len(index), index[-1])])
        return self.rows(torch.from_numpy(index).to(self.rho.device, non_blocking=True))


def _fused_steps(rows: int, rho: torch.Tensor) -> bool:
    """Whether ``lanczos_steps`` runs ``rows`` views of ``rho``'s size fused (``lanczos_triton.fuses``; on the fast
    path, Triton there): ``Lanczos.going`` pads a sub-batch only within the kernel its rows take."""
    if not (accel.active(rho) and accel.has_triton() and "lanczos" not in accel.broken_kernels()):
        return False
    from . import lanczos_triton

    return lanczos_triton.fuses(rows, rho.shape[-1], rho.device)


def _flagged(*args) -> tuple[torch.Tensor, ...]:
    """``Lanczos.open``'s first stage with the rows' ``cancels`` flags: ``args`` are the stage's inputs (the tokens
    last, unless ``at`` says which they are) and ``(fn, steps, at)``; ``fn``'s four outputs, then its coefficients
    with the flags as a last column (joined inside the graph: the split reads them in one read, no launch of its
    own)."""
    *inputs, (fn, steps, at) = args
    tokens = inputs[at] if at is not None else inputs.pop()
    packed, rho, v, v_prev = fn(*inputs, steps)
    return packed, rho, v, v_prev, torch.cat([packed, cancels(tokens).to(packed.dtype)[:, None]], 1)


def opening(matrix: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
    """The first stage from the spectral matrix ``[B, n, n]``: ``(packed [B, 2 steps], rho, v, v_prev)``
    (``density``, ``lanczos_steps`` from ``start_basis``). Only tensor operations, no host read: one CUDA graph."""
    return _opened(density(matrix), steps)


def _opened(rho: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
    """``(packed, rho, v, v_prev)``: the first ``steps`` steps on ``rho`` from the start, ``I / sqrt(n)``."""
    packed, v, v_prev = lanczos_steps(rho, None, None, None, steps)
    return packed, rho, v, v_prev


def opening_from_gram(gram: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
    """``opening`` of the centered ``gram`` (``entropy.centered_gram``: the spectral matrix when N <= d), the
    centering inside the same graph. On the CUDA fast path a float32 Gram (``TokenSet.unit_gram``, exactly
    symmetric) is centered and normalized by ``lanczos_triton.density_from_gram``: two launches instead of eleven;
    where the steps fuse (``lanczos_triton.fuses``, two or more), by the row means and the first fused step, which
    makes rho where it reads it (``lanczos_triton.opening_from_gram``: one launch fewer, the same rho)."""
    if gram.dtype == torch.float32 and accel.active(gram) and accel.has_triton() \
            and "lanczos" not in accel.broken_kernels():
        from . import lanczos_triton

        if steps >= 2 and lanczos_triton.fuses(gram.shape[0], gram.shape[1], gram.device):
            opened = accel.kernel("lanczos_fused", lambda: lanczos_triton.opening_from_gram(gram, steps))
            if opened is not None:  # None: Triton could not build it here; the density and the steps below
                return opened
        rho = accel.kernel("lanczos", lambda: lanczos_triton.density_from_gram(gram))
        if rho is not None:  # None: Triton could not build it here; the torch ops below make the same matrix
            return _opened(rho, steps)
    return opening(centered_gram(gram), steps)


def lanczos_steps(rho: torch.Tensor, v: torch.Tensor | None, v_prev: torch.Tensor | None,
                  b_prev: torch.Tensor | None, steps: int) -> tuple[torch.Tensor, ...]:
    """``steps`` steps of the recurrence from the basis matrices ``v, v_prev [B, n, n]`` and the last residual norm
    ``b_prev [B]`` (both None before the first step: ``v_prev`` is 0 there; ``v`` None: the start, ``start_basis``,
    which the fast path never forms) -> ``(packed [B, 2 steps], v, v_prev)``, packed = the steps' alphas, then their
    betas. Only tensor operations, no host read: a CUDA graph can capture it (``graphed``). On the CUDA fast path the
    steps run as ``lanczos_triton.steps`` (the same values up to float64 rounding): up to
    ``lanczos_triton.FUSED_UP_TO`` a launch a step (``_fused_kernel``, "lanczos_fused" to ``accel``; where Triton
    cannot build it, the next way), else three (cuBLAS' product, the dot, the update) instead of seven; this loop is
    the reference, the CPU's and the fallback."""
    if accel.active(rho) and accel.has_triton() and "lanczos" not in accel.broken_kernels():  # the fast path
        from . import lanczos_triton

        out = None
        if lanczos_triton.fuses(rho.shape[0], rho.shape[1], rho.device):
            out = accel.kernel("lanczos_fused", lambda: lanczos_triton.steps(rho, v, v_prev, b_prev, steps, True))
        if out is None:
            out = accel.kernel("lanczos", lambda: lanczos_triton.steps(rho, v, v_prev, b_prev, steps, False))
        if out is not None:  # None: Triton could not build it here; the loop below gives the same values
            return out
    if v is None:
        v = start_basis(rho)
    B, n, _ = rho.shape
    alpha, beta = [], []  # [B, 1, 1] each: the shape the updates broadcast (no views made per step)
    b_prev = None if b_prev is None else b_prev.view(B, 1, 1)
    for _ in range(steps):  # seven launches a step (six for the first)
        w = torch.bmm(rho, v)  # [B, n, n]
        # <V, rho V>_F [B, 1, 1] as a product and a sum: as a [1, n^2] x [n^2, 1] bmm, cuBLAS ran it as one gemv of
        # ~250 us (5 x 576^2 in float64, H200, 2026-11-28): three quarters of the split's device time
        a = (v * w).sum(dim=(1, 2), keepdim=True)
        w.addcmul_(a, v, value=-1)
        if v_prev is not None:
            w.addcmul_(b_prev, v_prev, value=-1)
        b = torch.linalg.vector_norm(w, dim=(1, 2), keepdim=True)  # [B, 1, 1]
        # b = 0 (the Krylov space ran out) gives NaN from here on: such rows fail bounds' checks (exact branch)
        v_prev, v = v, w.div_(b)
        alpha.append(a)
        beta.append(b)
        b_prev = b
    return torch.cat(alpha + beta, 1).view(B, 2 * steps), v, v_prev


def density(matrix: torch.Tensor) -> torch.Tensor:
    """``rho = C / tr(C)`` in float64 for the symmetric PSD ``matrix [B, n, n]`` whose spectrum the entropy reads; NaN
    for a ``C`` whose trace is at most ``refusal_trace``: rounding noise (``entropy.degenerate``: its trace at most
    ``noise_trace``) or a trace so small that the exact route's eigenvalue floor moves H by more than
    ``floor_allowance`` (``floor_shift``). ``bounds`` refuses such rows, so they reach the exact path's eigensolve
    and its rule (no host read: the threshold is folded into the division)."""
    c = matrix.double()
    trace = c.diagonal(dim1=1, dim2=2).sum(-1)
    trace = torch.where(trace > refusal_trace(c.shape[-1], matrix.dtype), trace, math.nan)
    return c / trace[:, None, None]


def refusal_trace(n: int, dtype: torch.dtype) -> float:
    """The largest trace of an ``n x n`` spectral matrix of ``dtype`` whose bounds ``density`` refuses: ``n``
    `FLOOR_PER_ROW`, or its rounding noise (``entropy.noise_trace``) where that is larger (float16)."""
    return max(noise_trace(n, dtype), n * FLOOR_PER_ROW)


def floor_shift(n: int, trace: float) -> float:
    """An upper bound on how far the exact route's floor moves the normalized entropy of an ``n x n`` matrix ``C``
    whose eigenvalues ``l_i`` (as computed, negatives from rounding included) have positive parts summing to at least
    ``trace``: ``|H_F - H_0| <= floor_shift``, ``H_F`` the entropy of ``max(l_i, F) / sum`` (``F =
    entropy.EIGEN_FLOOR``, the exact route's) and ``H_0`` that of ``max(l_i, 0) / sum`` (zero and negative
    eigenvalues count 0, as in the bounds' measure, which divides by the trace instead: with negative eigenvalues the
    two differ by their rounding, which ``DECISION_MARGIN`` covers). inf where ``F / trace > 1 / e``.

    With ``x_i = max(l_i, 0) / A`` (``A`` the positive parts' sum, ``A >= trace``), ``s = F / A``, the ``k <= n``
    eigenvalues with ``x_i < s`` raised to ``s`` (``y_i = max(x_i, s)``), ``D = sum (y_i - x_i) <= k s`` and ``b = 1 +
    D`` the raised sum, ``f(x) = -x log x``: ``H_F log n = sum f(y_i) / b + log b``, so ``(H_F - H_0) log n = -(D / b)
    Phi + (k / b) f(s) - sum_{x_i < s} f(x_i) + log b`` with ``0 <= Phi = sum_{x_i >= s} f(x_i) <= log n``. For
    ``s <= 1 / e`` (where ``f`` increases, so ``f(x_i) <= f(s)``): at most ``k f(s) + D <= k (f(s) + s)``, and at
    least ``-D log n - k f(s) D / b >= -k s (log n + k f(s))``. Both grow with ``s`` and ``k``, so ``k = n`` and
    ``s = F / trace`` bound them: ``n max(f(s) + s, s (log n + n f(s))) / log n``."""
    s = EIGEN_FLOOR / trace
    if not s <= 1 / math.e or n < 2:
        return math.inf if n >= 2 else 0.0
    f = -s * math.log(s)
    return n * max(f + s, s * (math.log(n) + n * f)) / math.log(n)


def floor_allowance(n: int) -> float:
    """How much ``split`` widens each bracket of an ``n x n`` spectral matrix for the exact route's eigenvalue floor:
    ``floor_shift`` at half the smallest trace ``density`` does not refuse (``n`` `FLOOR_PER_ROW`; the half covers
    the computed eigenvalues' sum against the float64 trace, which differ by rounding, ~n eps relative). ~1e-8 at the
    models' sizes (8.8e-9 at n = 576), 1e-11 for ordinary tokens' own traces (not known on the host)."""
    return floor_shift(n, n * FLOOR_PER_ROW / 2)


def _f(x: np.ndarray) -> np.ndarray:
    """``-x log x`` with ``f(0) = 0``; negative nodes (rounding) count as 0."""
    x = np.clip(x, 0.0, None)
    return -x * np.log(np.where(x > 0, x, 1.0))


def bounds(alpha: np.ndarray, beta: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Certified ``(lower, upper)`` normalized entropies ``[B]`` from ``k`` Lanczos steps (``alpha, beta [B, k]``).

    Upper: the k-node Gauss rule. Lower: the (k + 1)-node Gauss-Radau rule with a node at 0, whose last diagonal entry
    is ``beta_k^2 [(J_k)^{-1}]_{kk}`` (Golub and Meurant, ch. 6). Rows where the rules are not finite or not ordered
    (a rounding failure), or where the recurrence broke down (``BREAKDOWN``), get ``(-inf, inf)``: they go to the
    exact eigensolve.
    """
    B, k = alpha.shape
    coeffs = np.concatenate([alpha, beta], 1)
    finite = np.isfinite(coeffs).all(1)  # NaN: a breakdown's 0 / 0
    alpha, beta = np.where(finite[:, None], alpha, 1.0), np.where(finite[:, None], beta, 0.0)  # stand-ins, refused
    # one tridiagonal [B, k + 1, k + 1]: its leading k x k block is J_k (Gauss), with its last diagonal entry set, the
    # Gauss-Radau matrix
    jacobi = np.zeros((B, k + 1, k + 1))
    i = np.arange(k)
    jacobi[:, i, i] = alpha
    jacobi[:, i, i + 1] = beta
    jacobi[:, i + 1, i] = beta
    theta, q = np.linalg.eigh(jacobi[:, :k, :k])  # Ritz values [B, k], vectors [B, k, k]
    upper = (q[:, 0, :] ** 2 * _f(theta)).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        last = beta[:, -1] ** 2 * (q[:, -1, :] ** 2 / theta).sum(1)  # beta_k^2 [(J_k - 0 I)^{-1}]_kk
        ok = finite & np.isfinite(last) & (theta > 0).all(1)
        jacobi[:, k, k] = np.where(ok, last, 0.0)
        jacobi[~ok] = 0.0
        theta_r, q_r = np.linalg.eigh(jacobi)
    lower = (q_r[:, 0, :] ** 2 * _f(theta_r)).sum(1)
    scale = n / math.log(n)
    lower, upper = lower * scale, upper * scale
    ok &= np.isfinite(lower) & np.isfinite(upper) & (lower <= upper + 1e-12)
    ok &= (beta > BREAKDOWN * np.abs(coeffs).max(1, keepdims=True)).all(1)
    return np.where(ok, lower, -np.inf), np.where(ok, upper, np.inf)


def floored_bounds(alpha: np.ndarray, beta: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``bounds`` widened by ``floor_allowance(n)``: a bracket that holds the exact route's entropy, its eigenvalue
    floor included (the float32 matrix's rounding aside, which ``decision_margin`` covers)."""
    lo, hi = bounds(alpha, beta, n)
    allowance = floor_allowance(n)
    return lo - allowance, hi + allowance


def host_read(t: torch.Tensor) -> np.ndarray:
    """The one way this module reads device values on the host (a sync on CUDA; ``accel.count_sync`` counts it)."""
    accel.count_sync()
    return t.detach().cpu().numpy()


def decide(lo: np.ndarray, hi: np.ndarray, count: Callable[[torch.Tensor], torch.Tensor],
           margin: float = DECISION_MARGIN) -> tuple[np.ndarray, ...]:
    """``(decided [B] bool, t_sal [B])`` where the bracket widened by ``margin`` (``decision_margin`` of the matrices'
    size) gives one count (``count`` is non-increasing)."""
    decided, t_sal, _hopeless = judge(lo, hi, count, margin)
    return decided, t_sal


def judge(lo: np.ndarray, hi: np.ndarray, count: Callable[[torch.Tensor], torch.Tensor],
          margin: float = DECISION_MARGIN) -> tuple[np.ndarray, ...]:
    """``decide``'s ``(decided, t_sal)`` and ``hopeless [B] bool``: the undecided images whose bracket no later
    stage's can decide, in one ``count`` call (its four points per image).

    A later stage's bracket ``[lo', hi']`` shares a point ``x`` with this one ``[lo, hi]`` (both hold the entropy of
    rho's measure; in exact arithmetic Gauss and Gauss-Radau bounds are nested, and at 6 / 12 / 24 / 32 / 48 steps on
    the test families, n = 96 and 257, and on ``benchmarks/margin_by_size.py``'s near-low-rank tokens at n = 128 to 576,
    those not refused, later brackets never reached outside earlier ones by more than 3e-15), so its widened bracket
    ``[lo' - margin, hi' + margin]`` holds ``[x - margin, x + margin]``. Where ``hi - lo <= 2 margin`` every such
    interval holds the core ``[hi - margin, lo + margin]``, and where ``count`` differs at the core's ends (it is
    non-increasing: a count boundary lies in the core) it differs at the ends of every bracket a later stage can give,
    which then decides nothing: the image is hopeless, and the eigensolve (exact) is all that can decide it. ``lo``,
    ``hi`` as ``decide`` takes them (``floored_bounds``: the floor's allowance in them), the margin applied as there
    (the widened ends decide, the core's ends give up). A bracket wider than ``2 margin`` is never hopeless (a later one
    may end on either side of a boundary), nor one refused (not finite)."""
    finite = np.isfinite(lo) & np.isfinite(hi)
    # [4, B]: the widened ends decide, the core's ends give up; all four in one call
    ends = np.where(finite, np.stack([hi + margin, lo - margin, hi - margin, lo + margin]), 0.0)
    top, bottom, core_top, core_bottom = count(torch.from_numpy(ends.reshape(-1))).numpy().reshape(4, -1)
    decided = finite & (top == bottom)  # top: fewest salient tokens, bottom: most
    with np.errstate(invalid="ignore"):  # -inf, inf: refused rows, not finite
        core = finite & (hi - lo <= 2 * margin)
    return decided, top, core & ~decided & (core_top != core_bottom)


def split(matrix: torch.Tensor | Callable[[], torch.Tensor], count: Callable[[torch.Tensor], torch.Tensor],
          steps: tuple[int, ...] | None = None, tokens: torch.Tensor | None = None,
          opening_with: tuple[Callable, tuple] | None = None,
          known: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact algorithm's ``count(H)`` for every image of ``matrix [B, n, n]`` and an entropy estimate.

    ``matrix``: the spectral matrix (``entropy.spectral_matrix``), or with ``tokens [B, N, d]`` (N <= d) their unit
    Gram, whose centered form (``entropy.centered_gram``) is the spectral matrix: it is then centered inside the
    first stage (one CUDA graph with it, ``Lanczos.open``) and, for the images the bounds leave undecided, again as
    the exact path centers it (``entropy.spectral_matrix`` of their rows). The images whose centering in Gram space
    cancels (``entropy.cancels``: tokens nearly alike, where the float32 Gram's rounding moves H and the bounds'
    argument fails) are split again on their own, on their tokens centered before the product
    (``entropy.centered_unit_gram``, the exact path's matrix for them): the flags come with the first stage's read
    (no read of their own), and only such a batch pays the second split's stages (not an eigensolve).
    ``opening_with``: ``(fn, args)``, the first stage computed as ``fn(*args, k)`` (the outputs of ``opening``)
    instead of from ``matrix``, e.g. from the tokens with their Gram formed inside the same graph; ``matrix`` may
    then be a function that makes it, called only if the exact eigensolve runs. ``steps``: the Lanczos steps by the
    end of each stage (None: ``schedule`` for the batch's size, eager or replayed as CUDA graphs).

    ``count``: maps normalized entropies ``[B]`` (float64, CPU) to ``t_sal [B]`` (long, CPU), non-increasing in H
    (``budget.split_budget`` with its options). Returns ``(t_sal [B] long, entropy [B] float32, halfwidth [B]
    float32)`` on the CPU: the entropy is exact where the eigensolve ran (half-width 0), else its bracket's midpoint,
    within the half-width of the exact entropy: half the bracket's width (widened by ``floor_allowance`` for the exact
    route's eigenvalue floor) plus ``decision_margin(n)``, which covers what the bracket does not hold, the float32
    matrix's rounding (a bracket of 3e-8 missed the float64 entropy of its own float32 matrix by 5.9e-6).
    ``known``: how many images of the caller's batch its intervals decided (``known_counts``), for the report: these
    are the others."""
    t_sal, entropy, halfwidth, report = _split(matrix, count, steps, tokens, opening_with)
    report.known = known
    publish(report)
    return t_sal, entropy, halfwidth


def publish(report: SplitReport) -> None:
    """``report`` as the newest split's (`LAST_REPORT`) and in every open `collected` block: ``split``'s, or one of
    images all decided by their caller's intervals (``known_counts``), where no split ran."""
    LAST_REPORT[:] = [report]
    for sink in _SINKS:
        sink.append(report)


def known_counts(bounds: np.ndarray, count: Callable[[torch.Tensor], torch.Tensor],
                 n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PromPrune's split of the images whose entropy a caller already bracketed: ``(decided [B] bool, t_sal [B],
    entropy [B], halfwidth [B])`` (host arrays; the last three read only where ``decided``) from ``bounds [B, 2]``, each
    row an interval holding the exact route's entropy of its tokens as ``promprune.spectral_entropy`` computes it
    (``entropy.spectral_matrix(features)``: the tokens centered before their product for N <= d, else their
    covariance; ``batched_select``'s ``adaptive_views`` shares, ``settle``'s intervals: brackets widened by
    ``decision_margin(n)``, or the eigensolve's points), ``n x n`` the spectral matrices' size (``min(N, d)``).

    PromPrune's exact route eigensolves another float32 matrix of the same tokens (``TokenSet.spectral_matrix``): for
    N <= d the shared unit Gram centered in Gram space (``entropy.centered_gram``) where the centering does not
    cancel, formed on the GPU from fp16 / bf16 tokens' raw product (``TokenSet.unit_gram``), and in its own batch
    (the select call's bucket, where products' bits depend on the batch off the CPU); float64 features' in float64.
    The two are roundings of one matrix, not the same bits, and their exact entropies differ: on the CPU by up to
    5.2e-6 (a probe of 2026-12-07, n = 576, d = 4096, 48 near-low-rank inputs of rank 2-16 at spreads 0.05-0.79; 0 on
    the rows that cancel, where both center first; most just above ``entropy.SPREAD_FLOOR``, since centering in Gram
    space loses ~2e-6 / spread against float64, at most ~8e-6 at the floor), a distance the margin in the interval
    does not hold: it covers the interval's own miss of its matrix's entropy (up to 6.2e-6 at n = 576,
    ``benchmarks/margin_by_size.py``), and the two together (up to ~1.4e-5) would leave it 1.4x. So an interval
    decides only widened by ``decision_margin(n)`` once more (2.8x): ``[lo - m, hi + m]`` holds the method's exact
    entropy wherever the interval holds the view's and the two matrices' entropies lie within ``m`` of each other,
    and an image decides where ``count`` is the same at both ends (it is non-increasing: then at every point
    between), the exact route's ``t_sal`` (the fp16 / bf16 Gram of the GPU's fast path was not measured: no GPU).
    Its entropy is the widened interval's midpoint, within its half-width (``halfwidth``: half the interval's width
    plus ``m``; an eigensolved view's point too gets ``m``, the distance between the matrices) of the method's exact
    entropy. A row not finite, or reversed, decides nothing. One ``count`` call; no device work, no read."""
    bounds = np.asarray(bounds, dtype=np.float64).reshape(-1, 2)
    margin = decision_margin(n)
    lo, hi = bounds[:, 0] - margin, bounds[:, 1] + margin
    with np.errstate(invalid="ignore"):
        usable = np.isfinite(lo) & np.isfinite(hi) & (lo <= hi)
    lo, hi = np.where(usable, lo, 0.0), np.where(usable, hi, 0.0)
    top, bottom = count(torch.from_numpy(np.concatenate([hi, lo]))).numpy().reshape(2, -1)
    return usable & (top == bottom), top, (lo + hi) / 2, (hi - lo) / 2


def _split(matrix, count, steps, tokens, opening_with) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SplitReport]:
    """``split``'s work, and its report (``split`` publishes it: a split of some of its images again, the cancelled
    rows', merges its report into its caller's instead)."""
    gram = tokens is not None
    if opening_with is None:
        opening_with = (opening_from_gram if gram else opening, (matrix,))
    views, n = _views(opening_with[1])
    steps = steps or schedule(views, n, eager=not graphed.replays(opening_with[1], views * n * n))  # as ``open`` runs
    state, with_flags = Lanczos.open(*opening_with, steps[0], views * n * n, tokens)  # read at stage 0
    B, n, _ = state.rho.shape
    device = state.rho.device
    t_sal = np.zeros(B, dtype=np.int64)
    entropy = np.zeros(B)
    halfwidth = np.zeros(B)  # 0 where the eigensolve ran
    todo = np.arange(B)
    to_exact: list[int] = []  # images whose bounds were refused (``bounds``), for the eigensolve
    gave_up: list[int] = []  # images no later stage can decide (``judge``), for the eigensolve
    cancelled = np.zeros(0, dtype=np.int64)  # images whose centering in Gram space cancels: a split of their own
    report = SplitReport()
    margin = decision_margin(n)
    alpha, beta = np.zeros((B, 0)), np.zeros((B, 0))  # the recurrence's coefficients of the rows in todo, on the host
    done_steps = 0
    tflops = accel.float64_tflops(device) if accel.entropy_mode() == "auto" else math.inf  # "certified": every stage
    for stage, stage_steps in enumerate(steps):
        k = stage_steps - done_steps
        if stage:
            if not stage_pays(k, n, tflops):  # a slow float64 device: the eigensolve costs the views less (projected)
                report.costly = len(todo)
                break
            state = state.run(k, borrow=True)
        done_steps = stage_steps
        # one read per stage: this stage's [len(todo), 2k] (NaN-free rows decide), the first with the rows' flags
        coeffs = host_read(state.history[-1] if with_flags is None or stage else with_flags)[:len(todo)]  # no pad
        flagged = np.zeros(len(todo), dtype=bool)
        if coeffs.shape[1] > 2 * k:  # the first stage's read carries the rows whose centering cancels (below)
            flagged, coeffs = coeffs[:, -1] > 0, coeffs[:, :-1]
            cancelled = todo[flagged]
            report.cancelled = len(cancelled)
        alpha, beta = np.concatenate([alpha, coeffs[:, :k]], 1), np.concatenate([beta, coeffs[:, k:]], 1)
        lo, hi = floored_bounds(alpha, beta, n)
        decided, counts, hopeless = judge(lo, hi, count, margin)
        decided &= ~flagged
        # undecided images no later stage can decide (their bracket within the margin of a count boundary): the
        # eigensolve now, not the remaining stages (at the last stage every undecided image takes it anyway)
        hopeless &= ~flagged & (stage < len(steps) - 1)
        t_sal[todo[decided]] = counts[decided]
        entropy[todo[decided]] = (lo[decided] + hi[decided]) / 2
        # how far the exact metric may lie: the bracket's half-width and the margin its decision took for what the
        # bracket does not hold (``decision_margin``: the float32 matrix's rounding, up to 9e-6 at n = 1296)
        halfwidth[todo[decided]] = (hi[decided] - lo[decided]) / 2 + margin
        report.decided.append(int(decided.sum()))
        report.widths += (hi - lo)[decided].tolist()
        # refused bounds (a recurrence that ran out: its betas stay below BREAKDOWN; or NaN: a trace ``density``
        # refuses) stay refused at every later stage: such images go to the eigensolve now instead of running the
        # remaining stages' steps
        refused = ~(np.isfinite(lo) & np.isfinite(hi)) & ~flagged
        to_exact += todo[refused].tolist()
        gave_up += todo[hopeless].tolist()
        going = ~decided & ~refused & ~flagged & ~hopeless
        todo, alpha, beta = todo[going], alpha[going], beta[going]
        if not len(todo):
            break
        state = state.going(going)
    report.refused, report.hopeless = len(to_exact), len(gave_up)
    exact_rows = np.array(sorted(to_exact + gave_up + todo.tolist()), dtype=np.int64)
    if len(exact_rows):
        rows = torch.from_numpy(exact_rows).to(device, non_blocking=True)  # no wait: the copy is staged at once
        spectral = (matrix() if callable(matrix) else matrix)[rows]
        if gram:  # as the exact path makes it (no row here cancels: those split on their own, below)
            spectral = spectral_matrix(tokens[rows], spectral, np.zeros(len(exact_rows), dtype=bool))
        exact = host_read(entropy_of_matrix(spectral).double())
        t_sal[exact_rows] = count(torch.from_numpy(exact)).numpy()
        entropy[exact_rows] = exact
        report.exact = len(exact_rows)
    if len(cancelled):  # their spectral matrix made from the tokens centered first (the exact path's for them), split
        # as any: its own stages, and the eigensolve for what they leave undecided (one read a stage more)
        rows = torch.from_numpy(cancelled).to(device, non_blocking=True)
        *own, theirs = _split(centered_unit_gram(tokens[rows]), count, None, None, None)
        t_sal[cancelled], entropy[cancelled], halfwidth[cancelled] = (t.numpy() for t in own)
        report.merge(theirs)
    return torch.from_numpy(t_sal), torch.from_numpy(entropy).float(), torch.from_numpy(halfwidth).float(), report


def settle(matrices: list[torch.Tensor], settled: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
           steps: tuple[int, ...] | None = None, hopeless: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, SplitReport]:
    """Intervals that hold the exact route's entropy (``entropy_of_matrix``) of every matrix of ``matrices`` (spectral
    matrices ``[B_g, n_g, n_g]``, one tensor per size, else a ValueError; their rows numbered in order over the list,
    ``R`` in all), narrowed stage by stage as ``split`` narrows its brackets until ``settled`` needs no more of them,
    for a caller whose decision reads several entropies at once (``batched_select``'s ``adaptive_views`` shares: every
    view of an image), where ``split`` decides each matrix by its own.

    The matrices of a size the bounds do not take (``applies``: in "auto" below `MIN_SIZE`, off the CUDA fast path or
    where their float64 products cost more than the eigensolve; "exact"; a 1 x 1 matrix) are eigensolved at once and
    read with the first stage. The others run ``split``'s stages (``schedule`` for all their views at the largest size,
    one ``Lanczos`` per size, the stage's coefficients of every size in one read; in "auto" a size whose next stage does
    not pay, ``stage_pays``, keeps its brackets as they are from then on). After each stage ``settled(lo, hi)`` sees
    every row's interval ``[lo, hi]`` (``[R]`` each): a point where the eigensolve gave it, else the bracket
    (``floored_bounds``) widened by ``decision_margin(n)`` (what it may miss of the float32 matrix's rounding), or
    ``(-inf, inf)`` where the stage's bounds were refused (a recurrence that ran out, a trace ``density`` refuses);
    it returns ``(done, exact) [R]`` bool: the rows whose entropy it needs no more, and those it wants eigensolved
    (no more steps for them). A refused row not done is eigensolved too. After the last stage every row not done is
    eigensolved (one batched eigensolve per size, one read); nothing else is.

    ``hopeless`` (optional; after every stage but the last): ``hopeless(core_lo, core_hi) -> [R] bool``, the rows the
    caller gives up on: those not done are eigensolved, no more steps for them (where none goes on, no later stage
    runs). It sees each row's core, the interval every later stage's interval holds (NaN where there is none):
    a point where eigensolved; a size that stopped narrowing (``stage_pays``) keeps its interval; a bracket still
    narrowing gives, if its width before the margin is at most ``2 decision_margin(n)``, ``[hi - 2 m, lo + 2 m]``
    (``lo``, ``hi`` as ``settled`` sees them, ``m`` the margin: a later bracket shares a point with this one,
    ``judge``, so its widened interval holds this core), else NaN; NaN also where refused or stopped. A caller whose
    test passes on any box holding one where it passes (``batched_select.certain_shares``) can give up on the rows
    whose test fails on their cores: no later stage would settle them. Only cost moves: a row given up on takes the
    eigensolve, the exact route's value, so a caller's decision is the same either way.

    Returns ``(lo, hi, eigensolved [R] bool, report)``: the last intervals (points where ``eigensolved``) and how the
    rows went (``decided[i]``: rows first done at stage i without an eigensolve, ``widths`` their intervals' widths;
    ``exact``: rows eigensolved, ``refused`` of them for refused bounds, ``hopeless`` of them given up on before the
    last stage, ``costly``: rows whose size stopped narrowing, ``stage_pays``). Reads: one per stage, one more for
    the eigensolve where it runs."""
    sizes = [int(m.shape[-1]) for m in matrices]
    if len(set(sizes)) < len(sizes):  # two states of one shape replay one CUDA graph: the second's replay overwrites
        # the first's borrowed buffers before the stage's read (``Lanczos.open``)
        raise ValueError(f"settle takes one tensor per matrix size, got sizes {sizes}")
    starts = np.cumsum([0] + [int(m.shape[0]) for m in matrices])
    R = int(starts[-1])
    lo, hi = np.full(R, -np.inf), np.full(R, np.inf)
    point = np.zeros(R, dtype=bool)  # the eigensolve's value
    done, stopped = np.zeros(R, dtype=bool), np.zeros(R, dtype=bool)  # settled; no more steps (going to eigensolve)
    report = SplitReport()
    rows = {g: np.arange(starts[g], starts[g + 1]) for g, m in enumerate(matrices)
            if m.shape[0] and applies(sizes[g], m)}  # each bracketed size's rows still stepping
    margins = np.zeros(R)  # each row's decision margin (0: eigensolved)
    for g in rows:
        margins[rows[g]] = decision_margin(sizes[g])
    early = [g for g, m in enumerate(matrices) if m.shape[0] and g not in rows] if rows else []
    first = [entropy_of_matrix(matrices[g]) for g in early]  # enqueued; read with the first stage
    states: dict[int, Lanczos] = {}
    coeffs: dict[int, tuple[np.ndarray, np.ndarray]] = {g: (np.zeros((len(r), 0)),) * 2 for g, r in rows.items()}
    if rows:
        device = matrices[next(iter(rows))].device
        views, n = sum(len(r) for r in rows.values()), max(sizes[g] for g in rows)
        eager = not all(graphed.replays((matrices[g],), matrices[g].numel()) for g in rows)
        steps = steps or schedule(views, n, eager=eager)
        tflops = accel.float64_tflops(device) if accel.entropy_mode() == "auto" else math.inf
        states = {g: Lanczos.open(opening, (matrices[g],), steps[0], matrices[g].numel())[0] for g in rows}
        done_steps = 0
        for stage, stage_steps in enumerate(steps):
            k = stage_steps - done_steps
            if stage:
                for g in list(states):
                    if not stage_pays(k, sizes[g], tflops):  # a slow float64 device: these brackets stay as they are
                        report.costly += len(rows[g])
                        del states[g]
                    else:
                        states[g] = states[g].run(k, borrow=True)
                if not states:
                    break
            done_steps = stage_steps
            # one read a stage: every size's coefficients [B_g, 2k], the first with the early eigensolves' values
            read = _read_joined([states[g].history[-1] for g in states] + (first if not stage else []))
            for g, stage_coeffs in zip(states, read):
                stage_coeffs = stage_coeffs[:len(rows[g])]  # the padding's rows (``Lanczos.going``) left
                alpha, beta = (np.concatenate([c, part], 1) for c, part in zip(coeffs[g], np.split(stage_coeffs, 2, 1)))
                coeffs[g] = alpha, beta
                low, high = floored_bounds(alpha, beta, sizes[g])
                margin = decision_margin(sizes[g])
                lo[rows[g]], hi[rows[g]] = low - margin, high + margin
            for g, values in zip(early if not stage else (), read[len(states):]):
                lo[starts[g]:starts[g + 1]] = hi[starts[g]:starts[g + 1]] = values
                point[starts[g]:starts[g + 1]] = True
            refused = ~(np.isfinite(lo) & np.isfinite(hi)) & ~point & ~stopped
            now_done, exact = settled(lo.copy(), hi.copy())
            first_done = now_done & ~done & ~point
            report.decided.append(int(first_done.sum()))
            report.widths += (hi - lo)[first_done].tolist()
            done |= now_done
            report.refused += int((refused & ~done).sum())
            stopped |= (exact | refused) & ~done
            if hopeless is not None and stage < len(steps) - 1:  # after the last stage the rest is eigensolved anyway
                stepping = np.zeros(R, dtype=bool)
                for g in states:
                    stepping[rows[g]] = True
                gave_up = hopeless(*_cores(lo, hi, margins, stepping, stopped)) & ~done & ~stopped & ~point
                report.hopeless += int(gave_up.sum())
                stopped |= gave_up
            for g in list(states):
                going = ~done[rows[g]] & ~stopped[rows[g]]
                if not going.any():
                    del states[g]
                    continue
                states[g] = states[g].going(going)
                rows[g], coeffs[g] = rows[g][going], (coeffs[g][0][going], coeffs[g][1][going])
            if not states:
                break
    need = ~done & ~point  # what the stages left: one batched eigensolve per size, one read
    groups = [g for g in range(len(matrices)) if need[starts[g]:starts[g + 1]].any()]
    if groups:
        picked = [np.flatnonzero(need[starts[g]:starts[g + 1]]) for g in groups]
        device = matrices[groups[0]].device
        exact = [entropy_of_matrix(matrices[g][torch.from_numpy(p).to(device, non_blocking=True)])
                 for g, p in zip(groups, picked)]
        for g, p, values in zip(groups, picked, _read_joined(exact)):
            lo[starts[g] + p] = hi[starts[g] + p] = values
            point[starts[g] + p] = True
    report.exact = int(point.sum())
    return lo, hi, point, report


def _cores(lo: np.ndarray, hi: np.ndarray, margins: np.ndarray, stepping: np.ndarray,
           stopped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``settle``'s cores ``(core_lo, core_hi) [R]``: the interval every later stage's interval of a row holds, NaN
    where there is none. ``lo``, ``hi``: the intervals ``settled`` saw (brackets widened by ``margins``); ``stepping``:
    the rows whose brackets narrow on; ``stopped``: rows going to the eigensolve."""
    with np.errstate(invalid="ignore"):  # -inf, inf: refused
        narrow = hi - lo <= 4 * margins  # the bracket before the margin at most 2 margins wide
    core_lo = np.where(stepping, hi - 2 * margins, lo)
    core_hi = np.where(stepping, lo + 2 * margins, hi)
    known = np.isfinite(lo) & np.isfinite(hi) & ~stopped & (narrow | ~stepping)
    return np.where(known, core_lo, np.nan), np.where(known, core_hi, np.nan)


def _read_joined(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """``tensors`` (one device) read in one ``host_read``, as float64 arrays of their shapes."""
    if not tensors:
        return []
    flat = host_read(torch.cat([t.detach().reshape(-1).double() for t in tensors]))
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()].reshape(tuple(t.shape)))
        start += t.numel()
    return out


def _views(args: tuple[torch.Tensor | None, ...]) -> tuple[int, int]:
    """``(B, n)`` of the ``[B, n, n]`` matrices of a first stage from ``args`` (a matrix ``[B, n, n]``, or tokens
    ``[B, N, d]`` whose Gram is ``[B, N, N]``)."""
    first = next(a for a in args if a is not None)
    return first.shape[0], first.shape[1]


def step_ms(n: int, tflops: float) -> float:
    """Projected ms of one Lanczos step of a view of size ``n`` on the device: one float64 ``n x n`` product,
    ``2 n^3`` FLOP at ``tflops`` (launches and the host's reads left out). A projection, not a measurement."""
    return 2 * n ** 3 / (tflops * 1e9)


def eigensolve_ms(n: int) -> float:
    """Projected ms of the exact eigensolve of a view of size ``n`` (``EIGENSOLVE_MS_AT_576``'s fit to the H100)."""
    return EIGENSOLVE_MS_AT_576 * (n / 576) ** EIGENSOLVE_EXPONENT


def projected_ms(n: int, tflops: float) -> tuple[float, float]:
    """``(bracket, eigensolve)``: projected ms a view of size ``n`` costs the device in the certified split's first
    stage (`LEAD` steps, ``step_ms``) and in the exact eigensolve (``eigensolve_ms``). A projection."""
    return LEAD * step_ms(n, tflops), eigensolve_ms(n)


def stage_pays(steps: int, n: int, tflops: float) -> bool:
    """Whether "auto" runs a stage of ``steps`` Lanczos steps on views of size ``n`` at a float64 rate of ``tflops``:
    its products cost the device at most `STAGE_DECIDES` of the eigensolve they may save (a view the stage leaves
    undecided pays both). Else the views go to the eigensolve instead: at the first stage the whole call
    (``bracket_pays``), at a later one the views still undecided (``split``)."""
    return steps * step_ms(n, tflops) <= STAGE_DECIDES * eigensolve_ms(n)


def bracket_pays(n: int, device: torch.device | str) -> bool:
    """Whether "auto" takes the bounds for views of size ``n`` on ``device``: the first stage (`LEAD` float64
    products at the device's measured rate, ``accel.float64_tflops``) ``stage_pays``. On an H100 / H200 (~50
    TFLOP/s) at every size of the paper's models (n = 1296: 0.52 ms against 13.9); where float64 runs at 1/64 of
    float32's rate (A40, the paper's GPU: ~0.58 TFLOP/s) at none of them (n = 576: 3.95 ms against half of 5.46);
    at 1 TFLOP/s (an H800) up to n = 633. Priced at the lead's steps: a call replayed as CUDA graphs below
    `LEAD_FROM` opens with `STEPS`' first 12 instead (``schedule``), where the rule is optimistic by that factor
    (graphs are off by default)."""
    return stage_pays(LEAD, n, accel.float64_tflops(device))


def describe_route(device: torch.device | str, sizes: tuple[int, ...]) -> str:
    """One line for a benchmark's header: the device's measured float64 rate and, per view size, the route "auto"
    takes there with the projected ms of its first stage and of the eigensolve (``bracket_pays``)."""
    tflops = accel.float64_tflops(device)
    routes = []
    for n in sizes:
        bracket, eigensolve = projected_ms(n, tflops)
        routes.append(f"n = {n}: {'bounds' if stage_pays(LEAD, n, tflops) else 'eigensolve'} "
                      f"(projected {bracket:.2f} against {eigensolve:.2f} ms)")
    rate = f"float64 {tflops:.3g} TFLOP/s measured" if math.isfinite(tflops) else "float64 rate not measured (no GPU)"
    return f"{rate}; auto's entropy at " + ", ".join(routes) + f" (bounds where at most {STAGE_DECIDES:g} of it)"


def applies(matrix_size: int, device_tensor: torch.Tensor) -> bool:
    """Whether the split takes the bounds rather than the exact eigensolve (``accel.entropy_mode``): "auto" on the
    CUDA fast path for matrices of ``MIN_SIZE`` or more where the bounds pay on the device (``bracket_pays``),
    "certified" always (small matrices then mostly end in the eigensolve: their Krylov space runs out), "exact"
    never."""
    mode = accel.entropy_mode()
    if matrix_size < 2:  # one eigenvalue: H is 0 by definition (the exact path's rule)
        return False
    if mode == "auto":
        return matrix_size >= MIN_SIZE and accel.active(device_tensor) and \
            bracket_pays(matrix_size, device_tensor.device)
    return mode == "certified"
