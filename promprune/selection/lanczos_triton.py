"""The certified split's Lanczos recurrence (``certified.lanczos_steps``) in three launches a step instead of seven.

A step of the recurrence on ``rho [B, n, n]`` (float64) is one batched product and, in torch, six small kernels around
it (the Frobenius dot as a product and a sum, two updates, the residual's norm, its division): at batch 1 each costs
the host a launch (~25-35 us on the H100 of 2026-11-26) for a few us of device work, and each reads or writes a whole
``[B, n, n]`` state. Here a step is the product and two Triton kernels over ``(parts, B)`` programs, each program
``block`` entries of a view:

- ``_dot_kernel``: each program's share of ``<u, rho u>`` (``DOT [B, parts]``);
- ``_update_kernel``: each program sums its view's shares (the dot, and the previous step's squared norm), so every
  program of a view holds the same alpha and beta, forms the next residual in place of the product, writes the basis
  matrix it was made from, normalized, in place of the unnormalized one, and its share of the new residual's squared
  norm; its view's first program records alpha (and the previous beta) in the packed coefficients.

So the residual is never divided on its own: the next product takes it unnormalized (``rho u = beta rho v``) and the
update divides by beta where it reads it anyway; ``_finish_kernel`` normalizes the last one and records the last beta.
Every sum is a fixed tree (a program's block, then its view's shares in order): the same bits on every run. The values
are the torch loop's up to float64 rounding in the order of the sums (``tests/selection/lanczos_cases.py`` checks the
coefficients and the split's decisions under ``TRITON_INTERPRET=1``). Reads and writes per step: five states read and
two written (torch: nine and four). Breakdown (a zero residual) gives NaN from there on, as the torch loop does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 1024  # entries a program's loop takes at once (float64 at 8 warps: four a thread per state)
TARGET_PROGRAMS = 512  # programs a launch aims at (a few per SM of an H100/H200): the chunk per program follows
MAX_PARTS = 1024  # programs per view at most (each update program sums its view's shares)
WARPS = 8


@triton.jit
def _dot_kernel(U, W, DOT, N2, PARTS, CHUNK, TILE: tl.constexpr):
    """``DOT[b, p]``: the share of program ``p`` (entries ``p CHUNK`` on) in ``<U[b], W[b]>``."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([TILE], tl.float64)
    for t0 in range(0, CHUNK, TILE):
        offs = p * CHUNK + t0 + tl.arange(0, TILE)
        inb = offs < N2
        acc += tl.load(U + b * N2 + offs, mask=inb, other=0.0) * tl.load(W + b * N2 + offs, mask=inb, other=0.0)
    tl.store(DOT + b * PARTS + p, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["STEPS", "j"])
def _update_kernel(W, U, VP, DOT, NORM_IN, NORM_OUT, COEF, BPREV, BPREV_STRIDE, N2, PARTS, CHUNK, STEPS, j,
                   FIRST: tl.constexpr, HAS_PREV: tl.constexpr, TILE: tl.constexpr, PARTS_P2: tl.constexpr):
    """Step ``j``: ``W = rho U`` in, the next residual out (in place). ``FIRST`` (the call's first step): ``U`` is the
    normalized basis matrix and ``BPREV [B]`` (stride ``BPREV_STRIDE``) its coupling to ``VP`` (read only with
    ``HAS_PREV``); else ``U`` is the last residual, its squared norm in ``NORM_IN``'s shares, and ``U`` is normalized in
    place. ``NORM_OUT``: the new residual's shares."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ps = tl.arange(0, PARTS_P2)
    dot = tl.sum(tl.load(DOT + b * PARTS + ps, mask=ps < PARTS, other=0.0), axis=0)
    if FIRST:
        alpha = dot
        if HAS_PREV:
            beta = tl.load(BPREV + b * BPREV_STRIDE)
    else:
        beta = tl.sqrt(tl.sum(tl.load(NORM_IN + b * PARTS + ps, mask=ps < PARTS, other=0.0), axis=0))
        alpha = dot / (beta * beta)
    acc = tl.zeros([TILE], tl.float64)
    for t0 in range(0, CHUNK, TILE):
        offs = p * CHUNK + t0 + tl.arange(0, TILE)
        inb = offs < N2
        w = tl.load(W + b * N2 + offs, mask=inb, other=0.0)
        u = tl.load(U + b * N2 + offs, mask=inb, other=0.0)
        if FIRST:
            new = w - alpha * u
            if HAS_PREV:
                new = new - beta * tl.load(VP + b * N2 + offs, mask=inb, other=0.0)
        else:
            v = u / beta
            new = w / beta - alpha * v - beta * tl.load(VP + b * N2 + offs, mask=inb, other=0.0)
            tl.store(U + b * N2 + offs, v, mask=inb)
        tl.store(W + b * N2 + offs, new, mask=inb)
        acc += new * new
    tl.store(NORM_OUT + b * PARTS + p, tl.sum(acc, axis=0))
    if p == 0:
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


def layout(B: int, n: int) -> tuple[int, int, int]:
    """``(chunk, parts, parts_p2)`` for ``B`` views of ``n x n``: entries per program (a multiple of `TILE`, enough
    that the launch has about `TARGET_PROGRAMS` programs and a view at most `MAX_PARTS`), programs per view, and the
    next power of 2 of the parts (what an update program sums)."""
    n2 = n * n
    chunk = max(TILE, triton.next_power_of_2(triton.cdiv(B * n2, TARGET_PROGRAMS)),
                triton.next_power_of_2(triton.cdiv(n2, MAX_PARTS)))
    parts = triton.cdiv(n2, chunk)
    return chunk, parts, triton.next_power_of_2(parts)


def steps(rho: torch.Tensor, v: torch.Tensor, v_prev: torch.Tensor | None, b_prev: torch.Tensor | None,
          count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``certified.lanczos_steps(rho, v, v_prev, b_prev, count)`` (the same arguments and outputs: ``(packed [B,
    2 count], v, v_prev)``) in ``3 count + 1`` launches. ``rho``, ``v`` and ``v_prev`` are read only; the outputs are
    three buffers of its own that rotate (a step's product never lands on the two matrices it still reads)."""
    B, n, _ = rho.shape
    n2 = n * n
    chunk, parts, parts_p2 = layout(B, n)
    rho, v = rho.contiguous(), v.contiguous()
    v_prev = None if v_prev is None else v_prev.contiguous()
    coef = rho.new_empty(B, 2 * count)
    dot = rho.new_empty(B, parts)
    norms = (rho.new_empty(B, parts), rho.new_empty(B, parts))
    owned: list[torch.Tensor | None] = [None, None, None]
    grid = (parts, B)
    has_prev = v_prev is not None
    if has_prev and b_prev is None:
        raise ValueError("lanczos_triton.steps: v_prev needs b_prev, its coupling to v")
    bprev = b_prev if b_prev is not None else coef  # unread without v_prev
    u, vp = v, v_prev
    for j in range(count):
        if owned[j % 3] is None:
            owned[j % 3] = torch.empty_like(rho)
        w = torch.bmm(rho, u, out=owned[j % 3])  # never u or vp: they are the last two of the rotation (or inputs)
        _dot_kernel[grid](u, w, dot, n2, parts, chunk, TILE=TILE, num_warps=WARPS)
        _update_kernel[grid](w, u, vp if vp is not None else w, dot, norms[(j + 1) % 2], norms[j % 2], coef, bprev,
                             bprev.stride(0), n2, parts, chunk, count, j, FIRST=j == 0, HAS_PREV=j > 0 or has_prev,
                             TILE=TILE, PARTS_P2=parts_p2, num_warps=WARPS, enable_fp_fusion=False)
        u, vp = w, u
    _finish_kernel[grid](u, norms[(count - 1) % 2], coef, n2, parts, chunk, count, TILE=TILE, PARTS_P2=parts_p2,
                         num_warps=WARPS, enable_fp_fusion=False)
    return coef, u, vp
