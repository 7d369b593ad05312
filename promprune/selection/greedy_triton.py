"""The greedy selectors (and VisPruner's duplicate removal) as Triton kernels: one program per view runs every pick
(every round) of a call, no launch per step.

The torch loops of ``diversity`` issue ~20-30 small kernels per pick; on a GPU they are launch-bound (2,333 launches
per LLaVA-1.5 call). Here one launch does the whole greedy loop of every view in the batch; counts, masks and
fallback orders are read on the device, so the host never waits. Each kernel follows its torch counterpart step for
step (the same masked argmax, tie rule, GAIN_EPS test and fallback), in float32, with IEEE division and square root
and no fused multiply-add, so float32 selections match the CPU reference; what can differ is the summation order of
the DPP's dot products (ulps), which moves a pick only at a near-tie.

Callers (``diversity``) prepare the inputs in torch (the first pick's scores, the fallback order) and pass host-known
widths, so nothing here syncs. Tested on the CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Registers per program: a [BLOCK_S, BLOCK_N] tile of Cholesky rows is read at once.
_TILE_ELEMENTS = 16384


@triton.jit
def _masked_argmax(score, mask, offs, BLOCK_N: tl.constexpr):
    """``masked_argmax``: first index of the max of ``score`` over ``mask`` (index 0 when the mask is empty)."""
    masked = tl.where(mask, score, float("-inf"))
    best = tl.max(masked, axis=0)
    return tl.min(tl.where(masked == best, offs, BLOCK_N), axis=0), best


@triton.jit
def _near_tie_argmax(score, mask, offs, TOL: tl.constexpr, BLOCK_N: tl.constexpr):
    """``kernels.near_tie_argmax``: the lowest index whose score is within ``TOL`` of the max over ``mask``."""
    masked = tl.where(mask, score, float("-inf"))
    best = tl.max(masked, axis=0)
    return tl.min(tl.where(masked >= best - TOL, offs, BLOCK_N), axis=0)


@triton.jit
def _at(vec, offs, j):
    """``vec[j]`` of a register vector (exact: one nonzero term)."""
    return tl.sum(tl.where(offs == j, vec, 0.0), axis=0)


@triton.jit
def _dpp_extend(Kb, Fb, gains, offs, inb, j, upd, step, N, GAIN_EPS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Add token ``j``'s row ``e = (K_j - c_j^T F) / sqrt(d2_j)`` to the Cholesky rows ``Fb`` (when ``upd``) and
    lower the residual gains ``d2 -= e^2``. Returns ``(gains, step)``; rows that would be zero are not kept."""
    acc = tl.zeros_like(gains)
    for s0 in range(0, step, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        live = rows < step
        tile = tl.load(Fb + rows[:, None] * N + offs[None, :], mask=live[:, None] & inb[None, :], other=0.0)
        c_j = tl.load(Fb + rows * N + j, mask=live, other=0.0)  # column j of the rows so far
        acc += tl.sum(c_j[:, None] * tile, axis=0)
    k_j = tl.load(Kb + j * N + offs, mask=inb, other=0.0)
    d2_j = tl.maximum(_at(gains, offs, j), GAIN_EPS)
    e = tl.div_rn(k_j - acc, tl.sqrt_rn(d2_j))
    e = tl.where(upd, e, 0.0)
    tl.store(Fb + step * N + offs, e, mask=inb)
    tl.debug_barrier()  # the row is read back by every thread of the program at the next step
    gains = tl.maximum(gains - e * e, 0.0)
    return gains, step + upd.to(tl.int32)


@triton.jit
def _dpp_kernel(K, avail, anchor, order, first, counts, F, out, N, OUT_W, S_ROWS,
                GAIN_EPS: tl.constexpr, CONDITIONAL: tl.constexpr, USE_FIRST: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """One view of ``diversity.dpp_greedy``: ``K [B, N, N]``, ``avail/anchor [B, N]`` int8, ``order [B, N]`` the
    fallback score, ``first [B]`` the first pick (-1: none), ``counts [B]``, scratch ``F [B, S_ROWS, N]``, ``out [B,
    OUT_W]`` prefilled with -1."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    Kb = K + b * N * N
    Fb = F + b * S_ROWS * N
    gains = tl.load(Kb + offs * (N + 1), mask=inb, other=0.0)  # the diagonal: residual gains d2
    free = tl.load(avail + b * N + offs, mask=inb, other=0) != 0
    fb = tl.load(order + b * N + offs, mask=inb, other=float("-inf"))
    step = tl.program_id(0) * 0  # an int32 tensor 0: rows of F kept so far
    if CONDITIONAL:  # the anchor tokens enter the factor first, in raster order
        left = tl.load(anchor + b * N + offs, mask=inb, other=0) != 0
        for _t in range(tl.sum(left.to(tl.int32), axis=0)):
            j = tl.min(tl.where(left, offs, BLOCK_N), axis=0)
            left = left & (offs != j)
            gains, step = _dpp_extend(Kb, Fb, gains, offs, inb, j, _at(gains, offs, j) > GAIN_EPS, step, N,
                                      GAIN_EPS, BLOCK_S)
    count = tl.minimum(tl.load(counts + b), OUT_W)
    for k in range(count):
        j, best = _masked_argmax(gains, free, offs, BLOCK_N)
        tied = free & (gains == best)
        j, _tie = _masked_argmax(fb, tied, offs, BLOCK_N)  # exact ties: highest fallback order, then lowest index
        if USE_FIRST:
            f = tl.load(first + b)
            use = (k == 0) & (f >= 0)
            j = tl.where(use, f, j)
            best = tl.where(use, _at(gains, offs, j), best)
        exhausted = best <= GAIN_EPS
        j_fb, _fb = _masked_argmax(fb, free, offs, BLOCK_N)
        j = tl.where(exhausted, j_fb, j)
        tl.store(out + b * OUT_W + k, j.to(tl.int64))
        free = free & (offs != j)
        gains, step = _dpp_extend(Kb, Fb, gains, offs, inb, j, best > GAIN_EPS, step, N, GAIN_EPS, BLOCK_S)


@triton.jit
def _fps_kernel(D, first_score, nearest, avail, counts, out, N, OUT_W, TOL: tl.constexpr, BLOCK_N: tl.constexpr):
    """One view of ``diversity.farthest_point``: ``D [B, N, N]``, the first pick's ``first_score [B, N]``, the
    initial distance to the picked set ``nearest [B, N]``, ``avail [B, N]`` int8, ``counts [B]``, ``out`` (-1)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    free = tl.load(avail + b * N + offs, mask=inb, other=0) != 0
    first = tl.load(first_score + b * N + offs, mask=inb, other=float("-inf"))
    near = tl.load(nearest + b * N + offs, mask=inb, other=float("-inf"))
    count = tl.minimum(tl.load(counts + b), OUT_W)
    for k in range(count):
        j = _near_tie_argmax(tl.where(k == 0, first, near), free, offs, TOL, BLOCK_N)
        tl.store(out + b * OUT_W + k, j.to(tl.int64))
        free = free & (offs != j)
        row = tl.load(D + b * N * N + j * N + offs, mask=inb, other=float("-inf"))
        near = tl.minimum(near, row)


@triton.jit
def _fl_kernel(S, cover, avail, order, counts, out, N, OUT_W, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    """One view of ``diversity.facility_location``: ``S [B, N, N]`` in [0, 1], ``cover [B, N]`` (updated in place),
    ``avail [B, N]`` int8, fallback ``order [B, N]``, ``counts [B]``, ``out`` (-1)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    Sb = S + b * N * N
    Cb = cover + b * N
    free = tl.load(avail + b * N + offs, mask=inb, other=0) != 0
    fb = tl.load(order + b * N + offs, mask=inb, other=float("-inf"))
    count = tl.minimum(tl.load(counts + b), OUT_W)
    for k in range(count):
        gain = tl.zeros([BLOCK_N], dtype=tl.float32)  # column j: sum_i max(0, s_ij - cover_i)
        for i0 in range(0, N, BLOCK_I):
            rows = i0 + tl.arange(0, BLOCK_I)
            live = rows < N
            tile = tl.load(Sb + rows[:, None] * N + offs[None, :], mask=live[:, None] & inb[None, :], other=0.0)
            c = tl.load(Cb + rows, mask=live, other=0.0)
            gain += tl.sum(tl.maximum(tile - c[:, None], 0.0), axis=0)
        j, best = _masked_argmax(gain, free, offs, BLOCK_N)
        j_fb, _fb = _masked_argmax(fb, free, offs, BLOCK_N)
        j = tl.where(best <= 0, j_fb, j)
        tl.store(out + b * OUT_W + k, j.to(tl.int64))
        free = free & (offs != j)
        row = tl.load(Sb + j * N + offs, mask=inb, other=0.0)
        tl.store(Cb + offs, tl.maximum(tl.load(Cb + offs, mask=inb, other=0.0), row), mask=inb)
        tl.debug_barrier()  # cover is read back by rows at the next step


@triton.jit
def _vispruner_kernel(C, lists, match, out, R0, KEEP, ROUNDS, ROUND: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_J: tl.constexpr):
    """One row of ``baselines.vispruner_diverse``: ``C [B, R0, R0]`` the similarity of the candidates in their given
    order, scratch ``lists [B, 2, 2 * BLOCK_H]`` int32 (the current order and the next) and ``match [B, BLOCK_H]``,
    ``out [B, KEEP]``: the kept candidates' positions in the given order, in their final order. Every round runs
    here: evens matched to their most similar odd, the ``min(ROUND, R - KEEP)`` best-matched evens dropped (ties:
    the lower position first, a stable descending order), the rest followed by the odds."""
    b = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = 2 * BLOCK_H
    Cb = C + b * R0 * R0
    Lb = lists + b * 2 * W
    Mb = match + b * BLOCK_H
    offs = tl.arange(0, W)
    tl.store(Lb + offs, offs, mask=offs < R0)  # the given order: positions 0 .. R0 - 1
    tl.debug_barrier()
    hs = tl.arange(0, BLOCK_H)
    R = tl.program_id(0) * 0 + R0  # an int32 tensor: the list's length
    for r in range(ROUNDS):
        cur = Lb + (r % 2) * W
        nxt = Lb + ((r + 1) % 2) * W
        E = (R + 1) // 2  # evens
        n_odd = R // 2
        drop = tl.minimum(tl.minimum(R - KEEP, ROUND), E)
        live_e = hs < E
        ev = tl.load(cur + 2 * hs, mask=live_e, other=0).to(tl.int64)  # [BLOCK_H] the even positions' candidates
        # the loops below carry whole tiles and reduce once after them: a reduction carried through a loop and read
        # more than once after it trips Triton 3.x's OptimizeThreadLocality pass on sm_90 (an assertion, H100)
        tiles = tl.full([BLOCK_H, BLOCK_J], float("-inf"), tl.float32)
        for j0 in range(0, n_odd, BLOCK_J):  # each even's best match among the odds, a tile of odds at a time
            js = j0 + tl.arange(0, BLOCK_J)
            od = tl.load(cur + 2 * js + 1, mask=js < n_odd, other=0).to(tl.int64)
            tile = tl.load(Cb + ev[:, None] * R0 + od[None, :], mask=live_e[:, None] & (js < n_odd)[None, :],
                           other=float("-inf"))
            tiles = tl.maximum(tiles, tile)
        best = tl.max(tiles, axis=1)
        tl.store(Mb + hs, best, mask=live_e)
        tl.debug_barrier()  # every thread reads every even's match below
        ahead_n = tl.zeros([BLOCK_H, BLOCK_J], dtype=tl.int32)  # place in the stable descending order of the matches
        for k0 in range(0, E, BLOCK_J):
            ks = k0 + tl.arange(0, BLOCK_J)
            mk = tl.load(Mb + ks, mask=ks < E, other=float("-inf"))
            ahead = (mk[None, :] > best[:, None]) | ((mk[None, :] == best[:, None]) & (ks[None, :] < hs[:, None]))
            ahead_n += (ahead & (ks < E)[None, :]).to(tl.int32)
        rank = tl.sum(ahead_n, axis=1)
        tl.store(nxt + rank - drop, ev.to(tl.int32), mask=live_e & (rank >= drop))  # survivors, best match first
        odd = tl.load(cur + 2 * hs + 1, mask=hs < n_odd, other=0)
        tl.store(nxt + (E - drop) + hs, odd, mask=hs < n_odd)  # then the odds in order
        tl.debug_barrier()  # the next round reads the new order (and overwrites this one and the matches)
        R = R - drop
    final = Lb + (ROUNDS % 2) * W
    tl.store(out + b * KEEP + offs, tl.load(final + offs, mask=offs < KEEP, other=0).to(tl.int64), mask=offs < KEEP)


def _blocks(N: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_S, num_warps)`` for N tokens per view."""
    block_n = triton.next_power_of_2(max(N, 16))
    return block_n, max(1, _TILE_ELEMENTS // block_n), 8 if block_n >= 1024 else 4


def _picks(B: int, width: int, device) -> torch.Tensor:
    return torch.full((B, width), -1, dtype=torch.long, device=device)


def _flags(mask: torch.Tensor) -> torch.Tensor:
    return mask.to(torch.int8).contiguous()


def dpp_greedy(kernel: torch.Tensor, available: torch.Tensor, counts: torch.Tensor, order: torch.Tensor,
               first: torch.Tensor | None, anchor: torch.Tensor | None, width: int, gain_eps: float) -> torch.Tensor:
    """``diversity.dpp_greedy`` in one launch: ``kernel [B, N, N]`` float32, ``available [B, N]`` bool, ``counts
    [B]``, fallback ``order [B, N]`` float32, ``first [B]`` long (-1: argmax of the gains) or None, ``anchor [B, N]``
    bool for the conditional DPP or None; ``width`` >= counts.max() (host-known). Returns picks ``[B, width]``."""
    B, N, _ = kernel.shape
    block_n, block_s, warps = _blocks(N)
    rows = min(N, width + (N if anchor is not None else 0)) + 1  # kept Cholesky rows: distinct tokens, plus a spare
    factor = kernel.new_empty(B, rows, N)
    out = _picks(B, width, kernel.device)
    anchor_flags = _flags(anchor) if anchor is not None else _flags(available)  # unread unless conditional
    first_idx = first if first is not None else counts  # unread unless USE_FIRST
    _dpp_kernel[(B,)](kernel.contiguous(), _flags(available), anchor_flags, order.float().contiguous(),
                      first_idx.contiguous(), counts.to(torch.int32).contiguous(), factor, out, N, width, rows,
                      GAIN_EPS=gain_eps, CONDITIONAL=anchor is not None, USE_FIRST=first is not None,
                      BLOCK_N=block_n, BLOCK_S=block_s, num_warps=warps, enable_fp_fusion=False)
    return out


def farthest_point(distance: torch.Tensor, available: torch.Tensor, counts: torch.Tensor, first_score: torch.Tensor,
                   nearest: torch.Tensor, width: int, tie_eps: float) -> torch.Tensor:
    """``diversity.farthest_point``'s loop in one launch: ``distance [B, N, N]``, the first pick's ``first_score``
    and the initial ``nearest`` distances ``[B, N]``; ``width`` >= counts.max(); scores within ``tie_eps`` of the
    best tie (lowest index). Returns picks ``[B, width]``."""
    B, N, _ = distance.shape
    block_n, _, warps = _blocks(N)
    out = _picks(B, width, distance.device)
    _fps_kernel[(B,)](distance.contiguous(), first_score.float().contiguous(), nearest.float().contiguous(),
                      _flags(available), counts.to(torch.int32).contiguous(), out, N, width,
                      TOL=tie_eps, BLOCK_N=block_n, num_warps=warps, enable_fp_fusion=False)
    return out


def facility_location(similarity: torch.Tensor, available: torch.Tensor, counts: torch.Tensor, cover: torch.Tensor,
                      order: torch.Tensor, width: int) -> torch.Tensor:
    """``diversity.facility_location``'s loop in one launch: ``similarity [B, N, N]`` in [0, 1], the initial
    ``cover [B, N]``, fallback ``order [B, N]``; ``width`` >= counts.max(). Returns picks ``[B, width]``."""
    B, N, _ = similarity.shape
    block_n, block_i, warps = _blocks(N)
    out = _picks(B, width, similarity.device)
    _fl_kernel[(B,)](similarity.contiguous(), cover.float().clone().contiguous(), _flags(available),
                     order.float().contiguous(), counts.to(torch.int32).contiguous(), out, N, width,
                     BLOCK_N=block_n, BLOCK_I=block_i, num_warps=warps, enable_fp_fusion=False)
    return out


def vispruner_rounds(similarity: torch.Tensor, keep: int, rounds: int, round_size: int) -> torch.Tensor:
    """``baselines.vispruner_diverse``'s rounds in one launch: ``similarity [B, R0, R0]`` float32 among the candidates
    in their given order, ``keep`` < R0 of them after ``rounds`` rounds (host-known: they follow from R0 and keep
    alone) of at most ``round_size`` drops. Returns the kept positions ``[B, keep]`` in their final order."""
    B, R0, _ = similarity.shape
    block_h = triton.next_power_of_2(max((R0 + 1) // 2, 16))
    lists = torch.empty(B, 2, 2 * block_h, dtype=torch.int32, device=similarity.device)
    match = torch.empty(B, block_h, dtype=torch.float32, device=similarity.device)
    out = _picks(B, keep, similarity.device)
    _vispruner_kernel[(B,)](similarity.contiguous(), lists, match, out, R0, keep, rounds, ROUND=round_size,
                            BLOCK_H=block_h, BLOCK_J=max(1, _TILE_ELEMENTS // block_h),
                            num_warps=8 if block_h >= 512 else 4, enable_fp_fusion=False)
    return out
