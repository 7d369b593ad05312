"""The certified split's Lanczos recurrence (``certified.lanczos_steps``) in one launch a step (fused, small
batches) or three (a cuBLAS product and two kernels) instead of seven, and its matrix from the tokens' Gram
(``density_from_gram``) in two launches instead of eleven (one where the steps fuse: ``opening_from_gram``, whose
first step makes the matrix where it reads it).

A step of the recurrence on ``rho [B, n, n]`` (float64) is one batched product and, in torch, six small kernels around
it (the Frobenius dot as a product and a sum, two updates, the residual's norm, its division): at batch 1 each costs
the host a launch (~25-35 us on the H100 of 2026-11-26) for a few us of device work, and each reads or writes a whole
``[B, n, n]`` state. Unfused, a step here is the product and two Triton kernels over ``(parts, B)`` programs, each
program ``chunk`` entries of a view (``layout``), taken `TILE` at a time:

- ``_dot_kernel``: each program's share of ``<u, rho u>`` (``DOT [B, parts]``);
- ``_update_kernel``: each program sums its view's shares (the dot, and the previous step's squared norm), so every
  program of a view holds the same alpha and beta, forms the next residual in place of the product, writes the basis
  matrix it was made from, normalized, in place of the unnormalized one, and its share of the new residual's squared
  norm; its view's first program records alpha (and the previous beta) in the packed coefficients.

Fused (``_fused_kernel``, up to `FUSED_UP_TO`: ``fuses``), a program per 64 x 64 block of the next product does a
step's update and the next step's product at once: it reads the step's coefficients from the shares, forms the
residual block by block as the product's operand (float64 MMA) without storing it first, and in its epilogue stores
its block of that residual, of the basis matrix, of the product, and its shares of the next dot and of the residual's
squared norm. A stage of ``k`` steps is then ``k + 1`` launches from the start (``k - 1`` fused, the last update, the
finish) and ``k + 2`` from a state (its first product fused with its dot), against ``3 k`` and ``3 k + 1``.

So the residual is never divided on its own: the next product takes it unnormalized (``rho u = beta rho v``) and the
update divides by beta where it reads it anyway; ``_finish_kernel`` normalizes the last one and records the last
beta. The start ``I / sqrt(n)`` is never formed either (``IDENT``, ``VP_IDENT``): its product with ``rho`` is ``rho /
sqrt(n)``, which the first step's kernels read from ``rho`` itself, so the first step launches no product. Every sum
runs in a fixed order (a program's tiles, then its view's shares): the same bits on every run. The values are the
torch loop's up to float64 rounding in the order of the sums (``tests/selection/triton_cases.py``, its ``lanczos/``,
``lanczos-fused/``, ``opening-fused/``, ``split/`` and ``split-fused/`` cases, checks the coefficients and the
split's decisions under ``TRITON_INTERPRET=1``). Reads and writes per unfused step: five states read and two written
(torch: nine and four). Breakdown (a zero residual) gives NaN from there on, as the torch loop does.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from . import accel
from .kernels import start_basis

TILE = 1024  # entries a program's loop takes at once (float64 at 8 warps: four a thread per state)
TARGET_PROGRAMS = 512  # programs a launch aims at (a few per SM of an H100/H200): the chunk per program follows
MAX_PARTS = 1024  # programs per view at most (each update program sums its view's shares)
# ``certified.refusal_trace(1, torch.float32)`` (``certified.FLOOR_PER_ROW``), the literal ``_centering`` compares a
# float32 Gram's centered trace with (per row)
REFUSE_PER_ROW = 0.0009765625
WARPS = 8


@triton.jit
def _dot_kernel(U, W, DOT, N2, PARTS, CHUNK, N, TILE: tl.constexpr, IDENT: tl.constexpr):
    """``DOT[b, p]``: the share of program ``p`` (entries ``p CHUNK`` on) in ``<U[b], W[b]>``. ``IDENT`` (the start):
    ``U`` is ``I / sqrt(N)`` and ``W`` is ``rho`` for ``rho I / sqrt(N)``, unread off the diagonal."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([TILE], tl.float64)
    if IDENT:
        rs = 1.0 / tl.sqrt(N.to(tl.float64))
    for t0 in range(0, CHUNK, TILE):
        offs = p * CHUNK + t0 + tl.arange(0, TILE)
        inb = offs < N2
        if IDENT:
            on = inb & (offs % (N + 1) == 0)  # the diagonal
            acc += tl.where(on, rs * (tl.load(W + b * N2 + offs, mask=on, other=0.0) * rs), 0.0)
        else:
            acc += (tl.load(U + b * N2 + offs, mask=inb, other=0.0)
                    * tl.load(W + b * N2 + offs, mask=inb, other=0.0))
    tl.store(DOT + b * PARTS + p, tl.sum(acc, axis=0))


@triton.jit
def _coefficients(DOT, NORM_IN, BPREV, BPREV_STRIDE, b, PARTS_IN, FIRST: tl.constexpr, HAS_PREV: tl.constexpr,
                  PARTS_P2: tl.constexpr):
    """A step's ``(alpha, beta)`` from its view's shares (``PARTS_IN`` of them): ``FIRST`` (the call's first step, its
    basis matrix normalized): alpha the dot, beta ``BPREV[b]`` (0 without ``HAS_PREV``); else beta the root of the
    last residual's squared norm and alpha the dot over beta squared (the product was of the unnormalized residual).
    Every sum in a fixed order: every program of a view holds the same two values."""
    ps = tl.arange(0, PARTS_P2)
    dot = tl.sum(tl.load(DOT + b * PARTS_IN + ps, mask=ps < PARTS_IN, other=0.0), axis=0)
    if FIRST:
        alpha = dot
        beta = dot * 0.0
        if HAS_PREV:
            beta = tl.load(BPREV + b * BPREV_STRIDE)
    else:
        beta = tl.sqrt(tl.sum(tl.load(NORM_IN + b * PARTS_IN + ps, mask=ps < PARTS_IN, other=0.0), axis=0))
        alpha = dot / (beta * beta)
    return alpha, beta


@triton.jit
def _residual(w, u, vp, alpha, beta, FIRST: tl.constexpr, HAS_PREV: tl.constexpr):
    """``(new, v)``: a step's next residual from ``w = rho u``, and the basis matrix ``v`` it was made from (``u``
    itself when ``FIRST``, else ``u / beta``): the one expression both the update and the fused step evaluate."""
    if FIRST:
        v = u
        new = w - alpha * u
        if HAS_PREV:
            new = new - beta * vp
    else:
        v = u / beta
        new = w / beta - alpha * v - beta * vp
    return new, v


@triton.jit(do_not_specialize=["STEPS", "j"])
def _update_kernel(W, U, VP, OUT, DOT, NORM_IN, NORM_OUT, COEF, BPREV, BPREV_STRIDE, N2, PARTS, PARTS_IN, CHUNK, N,
                   STEPS, j, FIRST: tl.constexpr, HAS_PREV: tl.constexpr, IDENT: tl.constexpr,
                   VP_IDENT: tl.constexpr, TILE: tl.constexpr, PARTS_P2: tl.constexpr):
    """Step ``j``: ``W = rho U`` in, the next residual out (into ``OUT``: ``W`` itself but at the start). ``FIRST``
    (the call's first step): ``U`` is the normalized basis matrix and ``BPREV [B]`` (stride ``BPREV_STRIDE``) its
    coupling to ``VP`` (read only with ``HAS_PREV``); else ``U`` is the last residual, its squared norm in
    ``NORM_IN``'s shares, and ``U`` is normalized in place. ``IDENT`` (the start's step): ``U = I / sqrt(N)`` and ``W``
    is ``rho`` (read only), so ``rho U`` is ``W / sqrt(N)``; ``VP_IDENT`` (the step after it): ``VP = I / sqrt(N)``.
    ``DOT`` and ``NORM_IN`` hold ``PARTS_IN`` shares a view (their writer's programs); ``NORM_OUT`` gets this launch's
    ``PARTS``."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    alpha, beta = _coefficients(DOT, NORM_IN, BPREV, BPREV_STRIDE, b, PARTS_IN, FIRST, HAS_PREV, PARTS_P2)
    rs = 1.0 / tl.sqrt(N.to(tl.float64))  # I / sqrt(N)'s diagonal, as torch.eye(N) / math.sqrt(N) has it
    acc = tl.zeros([TILE], tl.float64)
    for t0 in range(0, CHUNK, TILE):
        offs = p * CHUNK + t0 + tl.arange(0, TILE)
        inb = offs < N2
        diag = inb & (offs % (N + 1) == 0)
        w = tl.load(W + b * N2 + offs, mask=inb, other=0.0)
        if IDENT:
            w = w * rs
            u = tl.where(diag, rs, 0.0)
        else:
            u = tl.load(U + b * N2 + offs, mask=inb, other=0.0)
        if VP_IDENT:
            vp = tl.where(diag, rs, 0.0)
        elif HAS_PREV:
            vp = tl.load(VP + b * N2 + offs, mask=inb, other=0.0)
        else:  # no previous basis matrix (the very first step): unread
            vp = tl.zeros([TILE], tl.float64)
        new, v = _residual(w, u, vp, alpha, beta, FIRST, HAS_PREV)
        if not FIRST:
            tl.store(U + b * N2 + offs, v, mask=inb)
        tl.store(OUT + b * N2 + offs, new, mask=inb)
        acc += new * new
    tl.store(NORM_OUT + b * PARTS + p, tl.sum(acc, axis=0))
    if p == 0:
        tl.store(COEF + b * 2 * STEPS + j, alpha)
        if not FIRST:
            tl.store(COEF + b * 2 * STEPS + STEPS + j - 1, beta)


@triton.jit
def _rho_block(G, R, base, rbase, N, r, c, g, trace):
    """The ``[len(r), len(c)]`` block of ``rho = C / tr(C)`` (float64) from the float32 Gram ``G`` and its row means
    ``R``, as ``_density_kernel`` makes each entry (``C = G - (r_i + r_j) + g`` in float32); 0 outside the view."""
    inb = (r < N)[:, None] & (c < N)[None, :]
    ri = tl.load(R + rbase + r, mask=r < N, other=0.0)
    rj = tl.load(R + rbase + c, mask=c < N, other=0.0)
    gram = tl.load(G + base + r[:, None] * N + c[None, :], mask=inb, other=0.0)
    return tl.where(inb, _density_entry(gram, ri[:, None], rj[None, :], g, trace), 0.0)


@triton.jit
def _operand(W, U, VP, base, N, r, c, alpha, beta, rs, G, R, rbase, g, trace, UPDATE: tl.constexpr,
             FIRST: tl.constexpr, HAS_PREV: tl.constexpr, IDENT: tl.constexpr, VP_IDENT: tl.constexpr,
             GRAM: tl.constexpr):
    """The fused step's ``[len(r), len(c)]`` block (rows ``r``, columns ``c`` of a view at ``base``) of the matrix
    it multiplies, and of the basis matrix: ``UPDATE``, the residual ``_residual`` makes there from ``W``, ``U`` and
    ``VP`` (``IDENT`` / ``VP_IDENT`` as in ``_update_kernel``; ``GRAM``: the start's ``W``, rho, made from the Gram,
    ``_rho_block``); else ``U`` itself (a normalized basis matrix). 0 outside the view."""
    inb = (r < N)[:, None] & (c < N)[None, :]
    offs = base + r[:, None] * N + c[None, :]
    if UPDATE:
        diag = inb & (r[:, None] == c[None, :])
        if GRAM:
            w = _rho_block(G, R, base, rbase, N, r, c, g, trace)
        else:
            w = tl.load(W + offs, mask=inb, other=0.0)
        if IDENT:
            w = w * rs
            u = tl.where(diag, rs, 0.0)
        else:
            u = tl.load(U + offs, mask=inb, other=0.0)
        if VP_IDENT:
            vp = tl.where(diag, rs, 0.0)
        elif HAS_PREV:
            vp = tl.load(VP + offs, mask=inb, other=0.0)
        else:
            vp = w * 0.0
        new, v = _residual(w, u, vp, alpha, beta, FIRST, HAS_PREV)
    else:
        new = tl.load(U + offs, mask=inb, other=0.0)
        v = new
    return new, v


@triton.jit(do_not_specialize=["STEPS", "j"])
def _fused_kernel(RHO, W, U, VP, NEW, VOUT, WOUT, DOT, NORM_IN, DOT_OUT, NORM_OUT, COEF, BPREV, BPREV_STRIDE, G, R,
                  DG, N, PARTS_IN, STEPS, j, UPDATE: tl.constexpr, FIRST: tl.constexpr, HAS_PREV: tl.constexpr,
                  IDENT: tl.constexpr, VP_IDENT: tl.constexpr, GRAM: tl.constexpr, PARTS_P2: tl.constexpr,
                  DIAG: tl.constexpr, N_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Step ``j``'s update and the next step's product in one launch, a program per ``BM x BN`` block of a view's
    product. ``UPDATE``: the block's operand is step ``j``'s residual (``_operand``, formed again for every block that
    reads it, never stored before the product), whose coefficients the program reads from the shares
    (``_coefficients``; ``IDENT``, the start's step: alpha is ``tr(rho) / N`` from the diagonal, ``DIAG`` entries at
    a time); the program stores its block of that residual (``NEW``), of the basis matrix it came from (``VOUT``,
    unless ``FIRST``: that is ``U`` itself), of the product (``WOUT``), and its shares of the next dot ``<new, rho
    new>`` and of ``|new|^2`` (``DOT_OUT``, ``NORM_OUT``: one a program); a view's first program records alpha (and
    the previous beta). Not ``UPDATE``: the product of the normalized ``U`` and its dot's shares only (a stage's first
    step from a state). ``GRAM`` (with ``IDENT``: the first stage from the tokens' float32 Gram ``G``, its row means
    ``R`` and diagonal ``DG``, ``_row_means_kernel``'s): rho is made where it is read, as ``_density_kernel`` makes
    it (``N_P2`` entries of the trace at once), and each program stores its block of it into ``RHO``: no launch of
    its own."""
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tiles = tl.num_programs(0)
    across = tl.cdiv(N, BN)
    r = (t // across) * BM + tl.arange(0, BM)
    c = (t % across) * BN + tl.arange(0, BN)
    base = b * N * N
    rbase = b * N
    rs = 1.0 / tl.sqrt(N.to(tl.float64))
    alpha = rs * 0.0
    beta = rs * 0.0
    g = 0.0
    trace = rs * 0.0
    if GRAM:  # the centering's mean and rho's trace, as _density_kernel computes them
        g, c_diag, trace = _centering(R, DG, rbase, N, N_P2)
        # <I / sqrt(N), rho I / sqrt(N)>: rho's diagonal, each entry as _dot_kernel takes it
        ks_all = tl.arange(0, N_P2)
        alpha = tl.sum(tl.where(ks_all < N, rs * ((c_diag.to(tl.float64) / trace) * rs), 0.0), axis=0)
    elif UPDATE:
        if IDENT:  # <I / sqrt(N), rho I / sqrt(N)>: the diagonal, each entry as _dot_kernel takes it
            acc_d = tl.zeros([DIAG], tl.float64)
            for d0 in range(0, N, DIAG):
                ds = d0 + tl.arange(0, DIAG)
                acc_d += tl.where(ds < N, rs * (tl.load(W + base + ds * (N + 1), mask=ds < N, other=0.0) * rs), 0.0)
            alpha = tl.sum(acc_d, axis=0)
        else:
            alpha, beta = _coefficients(DOT, NORM_IN, BPREV, BPREV_STRIDE, b, PARTS_IN, FIRST, HAS_PREV, PARTS_P2)
    acc = tl.zeros([BM, BN], tl.float64)
    for k0 in range(0, N, BK):
        ks = k0 + tl.arange(0, BK)
        if GRAM:
            a = _rho_block(G, R, base, rbase, N, r, ks, g, trace)
        else:
            a = tl.load(RHO + base + r[:, None] * N + ks[None, :], mask=(r < N)[:, None] & (ks < N)[None, :],
                        other=0.0)
        x, _ = _operand(W, U, VP, base, N, ks, c, alpha, beta, rs, G, R, rbase, g, trace, UPDATE, FIRST, HAS_PREV,
                        IDENT, VP_IDENT, GRAM)
        acc = tl.dot(a, x, acc, out_dtype=tl.float64)  # (Triton 3.6 takes float32 unless told)
    x, v = _operand(W, U, VP, base, N, r, c, alpha, beta, rs, G, R, rbase, g, trace, UPDATE, FIRST, HAS_PREV, IDENT,
                    VP_IDENT, GRAM)
    inb = (r < N)[:, None] & (c < N)[None, :]
    offs = base + r[:, None] * N + c[None, :]
    if GRAM:  # this program's block of rho, for the launches after it
        tl.store(RHO + offs, _rho_block(G, R, base, rbase, N, r, c, g, trace), mask=inb)
    tl.store(WOUT + offs, acc, mask=inb)
    tl.store(DOT_OUT + b * tiles + t, tl.sum(tl.sum(x * acc, axis=1), axis=0))
    if UPDATE:
        tl.store(NEW + offs, x, mask=inb)
        tl.store(NORM_OUT + b * tiles + t, tl.sum(tl.sum(x * x, axis=1), axis=0))
        if not FIRST:
            tl.store(VOUT + offs, v, mask=inb)
        if t == 0:
            tl.store(COEF + b * 2 * STEPS + j, alpha)
            if not FIRST:
                tl.store(COEF + b * 2 * STEPS + STEPS + j - 1, beta)


@triton.jit(do_not_specialize=["STEPS"])
def _finish_kernel(W, NORM_IN, COEF, N2, PARTS, CHUNK, STEPS, TILE: tl.constexpr, PARTS_P2: tl.constexpr):
    """The last residual ``W`` normalized in place; its norm recorded as the call's last beta."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ps = tl.arange(0, PARTS_P2)
    beta = tl.sqrt(tl.sum(tl.load(NORM_IN + b * PARTS + ps, mask=ps < PARTS, other=0.0), axis=0))
    for t0 in range(0, CHUNK, TILE):
        offs = p * CHUNK + t0 + tl.arange(0, TILE)
        inb = offs < N2
        tl.store(W + b * N2 + offs, tl.load(W + b * N2 + offs, mask=inb, other=0.0) / beta, mask=inb)
    if p == 0:
        tl.store(COEF + b * 2 * STEPS + 2 * STEPS - 1, beta)


@triton.jit
def _row_means_kernel(G, R, DG, N, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``R[b, i]``: the mean of row ``i`` of the float32 Gram ``G[b]`` (float32, as ``gram.mean(dim=2)``), and
    ``DG[b, i]`` its diagonal entry, for ``ROWS`` rows a program."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1).to(tl.int64)
    live = i < N
    acc = tl.zeros([ROWS, COLS], tl.float32)
    for c0 in range(0, N, COLS):
        cols = c0 + tl.arange(0, COLS)
        at = b * N * N + i[:, None] * N + cols[None, :]
        acc += tl.load(G + at, mask=live[:, None] & (cols < N)[None, :], other=0.0)
    tl.store(R + b * N + i, tl.sum(acc, axis=1) / N, mask=live)
    tl.store(DG + b * N + i, tl.load(G + b * N * N + i * (N + 1), mask=live, other=0.0), mask=live)


@triton.jit
def _centering(R, DG, rbase, N, N_P2: tl.constexpr):
    """``(g, diagonal, trace)`` of a view's centered Gram ``C = G - (r_i + r_j) + g`` from its row means ``R`` and
    ``G``'s diagonal ``DG`` (``N_P2`` entries at once): ``g`` the means' mean (float32), ``C``'s diagonal (float32),
    its trace summed in float64 as ``certified.density`` does, NaN where ``density`` refuses it (at most
    ``certified.refusal_trace(N, torch.float32)``: ``REFUSE_PER_ROW`` a row; rounding noise, or a trace where the
    exact route's eigenvalue floor moves H), as there."""
    ks = tl.arange(0, N_P2)
    r_all = tl.load(R + rbase + ks, mask=ks < N, other=0.0)
    g = tl.sum(r_all, axis=0) / N
    c_diag = (tl.load(DG + rbase + ks, mask=ks < N, other=0.0) - (r_all + r_all)) + g
    trace = tl.sum(tl.where(ks < N, c_diag.to(tl.float64), 0.0), axis=0)
    return g, c_diag, tl.where(trace > N.to(tl.float64) * 0.0009765625, trace, float("nan"))  # REFUSE_PER_ROW


@triton.jit
def _density_entry(gram, ri, rj, g, trace):
    """rho's entries ``C / tr(C)`` (float64) from the float32 Gram's entries and their rows' and columns' means: one
    expression for ``_density_kernel`` and the fused step (the same bits)."""
    return ((gram - (ri + rj)) + g).to(tl.float64) / trace


@triton.jit
def _density_kernel(G, R, DG, RHO, N, N2, CHUNK, TILE: tl.constexpr, N_P2: tl.constexpr):
    """``RHO[b] = C / tr(C)`` in float64, ``C = G - (r_i + r_j) + g`` the centered Gram in float32 (``r``: the row
    means, ``g`` their mean): ``r_i + r_j`` is the same float both ways round, so ``C`` is exactly symmetric where
    ``G`` is. ``tr(C)`` sums ``C``'s diagonal in float64, as ``certified.density`` does, NaN where that refuses it
    (``_centering``)."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    g, _, trace = _centering(R, DG, b * N, N, N_P2)
    for t0 in range(0, CHUNK, TILE):
        offs = p * CHUNK + t0 + tl.arange(0, TILE)
        inb = offs < N2
        ri = tl.load(R + b * N + offs // N, mask=inb, other=0.0)
        rj = tl.load(R + b * N + offs % N, mask=inb, other=0.0)
        entry = _density_entry(tl.load(G + b * N2 + offs, mask=inb, other=0.0), ri, rj, g, trace)
        tl.store(RHO + b * N2 + offs, entry, mask=inb)


def _row_means(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(means [B, n], diagonal [B, n])`` of a contiguous float32 Gram: one launch (``_row_means_kernel``)."""
    B, n, _ = gram.shape
    rows, cols = 16, 128
    means, diag = gram.new_empty(B, n), gram.new_empty(B, n)
    _row_means_kernel[(accel.cdiv(n, rows), B)](gram, means, diag, n, ROWS=rows, COLS=cols, num_warps=4)
    return means, diag


def density_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """``certified.density(entropy.centered_gram(gram))`` for an exactly symmetric float32 Gram ``[B, n, n]``
    (``TokenSet.unit_gram``) in two launches instead of eleven: the row means, then rho. The centered Gram is the
    same float32 arithmetic up to the order of the row sums and of ``r_i + r_j`` (rounding, which the split's
    ``DECISION_MARGIN`` covers), and exactly symmetric without a transpose."""
    B, n, _ = gram.shape
    gram = gram.contiguous()
    means, diag = _row_means(gram)
    rho = torch.empty(B, n, n, dtype=torch.float64, device=gram.device)
    chunk, parts, _ = layout(B, n)
    _density_kernel[(parts, B)](gram, means, diag, rho, n, n * n, chunk, TILE=TILE,
                                N_P2=accel.pow2_at_least(n), num_warps=WARPS, enable_fp_fusion=False)
    return rho


def layout(B: int, n: int) -> tuple[int, int, int]:
    """``(chunk, parts, parts_p2)`` for ``B`` views of ``n x n``: entries per program (a multiple of `TILE`, enough
    that the launch has about `TARGET_PROGRAMS` programs and a view at most `MAX_PARTS`), programs per view, and the
    next power of 2 of the parts (what an update program sums)."""
    n2 = n * n
    chunk = max(TILE, accel.pow2_at_least(accel.cdiv(B * n2, TARGET_PROGRAMS)),
                accel.pow2_at_least(accel.cdiv(n2, MAX_PARTS)))
    parts = accel.cdiv(n2, chunk)
    return chunk, parts, accel.pow2_at_least(parts)


def opening_from_gram(gram: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """``certified.opening_from_gram``'s first stage, ``(packed [B, 2 count], rho, v, v_prev)``, fused from an exactly
    symmetric float32 Gram ``[B, n, n]``: the row means (one launch), then ``count >= 2`` steps whose first launch
    makes rho where it reads it and stores it (``_fused_kernel`` with ``GRAM``): ``count + 2`` launches, one fewer
    than ``density_from_gram`` and ``steps``. rho is ``density_from_gram``'s, bit for bit."""
    if count < 2:
        raise ValueError(f"lanczos_triton.opening_from_gram: {count} steps; the fused opening takes 2 or more")
    B, n, _ = gram.shape
    gram = gram.contiguous()
    means, diag = _row_means(gram)
    rho = torch.empty(B, n, n, dtype=torch.float64, device=gram.device)
    packed, v, v_prev = steps(rho, None, None, None, count, fused=True, gram=(gram, means, diag))
    return packed, rho, v, v_prev


def fuses(B: int, n: int, device: torch.device | str) -> bool:
    """Whether ``steps`` runs its recurrence fused (``_fused_kernel``: a launch a step) for ``B`` views of ``n x n`` on
    ``device``: up to `FUSED_UP_TO`, on a device with float64 tensor cores (``accel.float64_mma``). Without them (A40,
    L40, RTX cards) the fused product would be Triton's loop of scalar float64 FMAs, each ~0.6 ms at 576 tokens on
    those devices' 1/64-rate units, where the two launches a step it saves are ~56 us: cuBLAS' product instead."""
    if _FORCED[0] is not None:
        return _FORCED[0]
    return B * n ** 3 <= FUSED_UP_TO and accel.float64_mma(device)


_FORCED: list[bool | None] = [None]  # ``fusing``'s way, at every size and on every device


@contextmanager
def fusing(fused: bool | None):
    """Inside the block ``steps`` takes one way at every size and on every device: ``fused`` True (a launch a step),
    False (a product, the dot and the update), None (its own, ``fuses``): a benchmark's or a test's comparison."""
    saved = _FORCED[0]
    _FORCED[0] = fused
    try:
        yield
    finally:
        _FORCED[0] = saved


def steps(rho: torch.Tensor, v: torch.Tensor | None, v_prev: torch.Tensor | None, b_prev: torch.Tensor | None,
          count: int, fused: bool | None = None,
          gram: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """``certified.lanczos_steps(rho, v, v_prev, b_prev, count)`` (the same arguments and outputs: ``(packed [B,
    2 count], v, v_prev)``). ``v`` None: the start, ``I / sqrt(n)``, never formed: its product with ``rho`` is
    ``rho / sqrt(n)``, read where the first update reads it (``IDENT``): no product and no basis matrix to make.
    ``fused`` (None: ``fuses``): each step's update and the next step's product in one launch (``_fused_kernel``),
    ``count + 1`` launches from the start and ``count + 2`` from a state; else a cuBLAS product, the dot and the
    update a step, ``3 count`` and ``3 count + 1``. ``rho``, ``v`` and ``v_prev`` are read only; the outputs are
    buffers of its own that rotate (a step never writes a matrix it or another program of its launch still reads).
    ``gram``: ``opening_from_gram``'s (the Gram, its row means and diagonal; fused, from the start, two steps or
    more): ``rho`` is then an empty buffer the first launch fills."""
    B, n, _ = rho.shape
    chunk, parts, parts_p2 = layout(B, n)
    start = v is None
    rho = rho.contiguous()
    v = None if start else v.contiguous()
    v_prev = None if v_prev is None else v_prev.contiguous()
    has_prev = v_prev is not None
    if has_prev and b_prev is None:
        raise ValueError("lanczos_triton.steps: v_prev needs b_prev, its coupling to v")
    if start and has_prev:
        raise ValueError("lanczos_triton.steps: the start (v None) has no v_prev")
    coef = rho.new_empty(B, 2 * count)
    norms = (rho.new_empty(B, parts), rho.new_empty(B, parts))
    bprev = b_prev if b_prev is not None else coef  # unread without v_prev

    def update(j, w, u, vp, out, dot, norm_in, parts_in):  # step j's update (its product w = rho u and dot made)
        ident = start and j == 0
        _update_kernel[(parts, B)](w, w if ident else u, w if vp is None else vp, out, dot, norm_in, norms[j % 2],
                                   coef, bprev, bprev.stride(0), n * n, parts, parts_in, chunk, n, count, j,
                                   FIRST=j == 0, HAS_PREV=j > 0 or has_prev, IDENT=ident, VP_IDENT=start and j == 1,
                                   TILE=TILE, PARTS_P2=accel.pow2_at_least(parts_in), num_warps=WARPS,
                                   enable_fp_fusion=False)
        return out, (None if ident else u)  # the next u (unnormalized) and vp (normalized in place)

    if fused is None:
        fused = fuses(B, n, rho.device)
    if gram is not None and not (fused and start and count >= 2):
        raise ValueError("lanczos_triton.steps: rho from the Gram needs the fused path from the start, 2 steps or more")
    if fused and not (start and count == 1):
        u, vp = _fused(rho, v, v_prev, count, coef, bprev, update, gram)
    else:
        dot = rho.new_empty(B, parts)
        owned: list[torch.Tensor | None] = [None, None, None]
        u, vp = v, v_prev
        for j in range(count):
            if owned[j % 3] is None:
                owned[j % 3] = torch.empty_like(rho)
            ident = start and j == 0
            if ident:  # rho I / sqrt(n) is rho / sqrt(n): no product; the residual goes to a buffer of its own
                w, out = rho, owned[0]
            else:  # never u or vp: they are the last two of the rotation (or the caller's)
                w = out = torch.bmm(rho, u, out=owned[j % 3])
            _dot_kernel[(parts, B)](w if ident else u, w, dot, n * n, parts, chunk, n, TILE=TILE, IDENT=ident,
                                    num_warps=WARPS)
            u, vp = update(j, w, u, vp, out, dot, norms[(j + 1) % 2], parts)
    _finish_kernel[(parts, B)](u, norms[(count - 1) % 2], coef, n * n, parts, chunk, count, TILE=TILE,
                               PARTS_P2=parts_p2, num_warps=WARPS, enable_fp_fusion=False)
    if vp is None:  # one step from the start: its v_prev is the start itself
        vp = start_basis(rho)
    return coef, u, vp


# The fused step's blocks: a 64 x 64 block of the product a program (81 a view of 576 tokens, 441 of 1296), its sum
# over 16 columns of rho at a time (float64 MMA on sm_80 and later: mma.sync ...f64 in its PTX for sm_90)
BLOCK, BLOCK_K, FUSED_WARPS = 64, 16, 4
# ``fuses``' bound on views x n^3, a projection until a GPU measures it (benchmarks/lanczos_steps.py): a fused step
# costs the host one launch instead of three (~56 us less at the cost model's 28 us a launch) and its product runs in
# Triton's float64 MMA instead of cuBLAS'. At batch 1 the host's launches set a step's time (five 576 x 576 float64
# products take the device ~50 us at 40 TFLOP/s, three launches the host ~84 us), so the launches saved win while
# the device's product stays under the host's three launches even at half cuBLAS' rate: up to ~4-5 views of 576.
# LLaVA-1.5 and LLaVA-NeXT at batch 1 fuse; Qwen2.5-VL's 1296 tokens (11 x 576^3) and batches of several images keep
# cuBLAS' product, where the device's work sets the time. Only on float64 tensor cores (``fuses``).
FUSED_UP_TO = 5 * 576 ** 3


def _fused(rho, v, v_prev, count, coef, bprev, update, gram=None):
    """``steps``' recurrence fused (``count >= 2`` from the start, any from a state): the first product (from a state:
    a launch of ``_fused_kernel`` without its update; from the start: none), a fused launch per step but the last,
    then the last step's update (``update``, in place) -> the last ``(u, vp)`` for ``_finish_kernel``. ``gram``:
    ``(G, R, DG)``, the float32 Gram, its row means and diagonal: the start's launch makes ``rho`` from them (``GRAM``)
    and fills it."""
    B, n, _ = rho.shape
    start = v is None
    tiles = accel.cdiv(n, BLOCK) ** 2
    tiles_p2 = accel.pow2_at_least(tiles)
    grid = (tiles, B)
    dots = (rho.new_empty(B, tiles), rho.new_empty(B, tiles))
    sq = (rho.new_empty(B, tiles), rho.new_empty(B, tiles))
    owned: list[list[torch.Tensor | None]] = [[None, None, None], [None, None, None]]  # two sets: (w, new, v)

    def buffer(s: int, i: int) -> torch.Tensor:
        if owned[s][i] is None:
            owned[s][i] = torch.empty_like(rho)
        return owned[s][i]

    def launch(j, w, u, vp, s, do_update, first):
        ident = start and j == 0
        from_gram = ident and gram is not None
        out_w, new = buffer(s, 0), buffer(s, 1) if do_update else rho
        vout = buffer(s, 2) if do_update and not first else rho  # unwritten when FIRST or not updating
        g, means, diag = gram if from_gram else (rho, rho, rho)  # unread unless GRAM
        _fused_kernel[grid](rho, w, w if u is None else u, w if vp is None else vp, new, vout, out_w,
                            dots[(s + 1) % 2], sq[(s + 1) % 2], dots[s], sq[s], coef, bprev, bprev.stride(0), g,
                            means, diag, n, tiles, count, j, UPDATE=do_update, FIRST=first,
                            HAS_PREV=j > 0 or v_prev is not None, IDENT=ident, VP_IDENT=start and j == 1,
                            GRAM=from_gram, PARTS_P2=tiles_p2, DIAG=1024,
                            N_P2=accel.pow2_at_least(n) if from_gram else 1, BM=BLOCK, BN=BLOCK, BK=BLOCK_K,
                            num_warps=FUSED_WARPS, enable_fp_fusion=False)
        return out_w, new, vout

    s = 0
    if start:
        w, u, vp = rho, None, None
    else:  # the first step's product and its dot
        w, _, _ = launch(0, rho, v, None, s, False, True)
        u, vp = v, v_prev
        s = 1
    for j in range(count - 1):  # step j's update, step j + 1's product
        first = j == 0
        w, new, vout = launch(j, w, u, vp, s, True, first)
        u, vp = new, (None if start and j == 0 else u if first else vout)
        s = 1 - s
    return update(count - 1, w, u, vp, w, dots[(s + 1) % 2], sq[(s + 1) % 2], tiles)
