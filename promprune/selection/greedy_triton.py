"""The greedy selectors (and VisPruner's duplicate removal) as Triton kernels: one program per view runs every pick
(every round) of a call, no launch per step. Beside them, kernels that do in one launch what a dozen torch ops do
around them: the tokens' unit Gram and the cosine kernel the selectors read (``scaled_gram``), PromPrune's saliency
stage before its DPP (``salient_front``), DivPrune's set-up with its loop (``divprune_picks``), and the selection's
ascending order at the end (``ascending``).

The torch loops of ``diversity`` issue ~20-30 small kernels per pick; on a GPU they are launch-bound (2,333 launches
per LLaVA-1.5 call). Here one launch does the whole greedy loop of every view in the batch; counts, masks and
fallback orders are read on the device, so the host never waits. Each kernel follows its torch counterpart step for
step (the same masked argmax, tie rule, GAIN_EPS test and fallback), in float32, with IEEE division and square root
and no fused multiply-add, so float32 selections match the CPU reference; what can differ is the summation order of
the long sums (the DPP's dot products, facility location's gains), which moves a pick only at a near-tie. Those add a
tile of rows a step, as few as 2 past 4096 tokens (``_blocks``), so they are compensated (``_add_compensated``): as
close to the exact sums as torch's (plainly summed, facility location's gains at 4100 tokens were 10x further and
moved a pick past ``FL_TIE_EPS``).

Callers (``diversity``) prepare the inputs in torch (the first pick's scores, the fallback order) and pass host-known
widths, so nothing here syncs. Tested on the CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import accel

# Registers per program: a [BLOCK_S, BLOCK_N] tile of Cholesky rows is read at once.
_TILE_ELEMENTS = 16384


@dataclass(frozen=True)
class VisTiles:
    """The block sizes of VisPruner's kernel. ``tile``: elements of its ranking's ``[BLOCK_E, BLOCK_P]`` tiles (evens
    by matches compared at once); ``evens`` by ``chunk``: its scan down the sorted rows (evens at once, entries of their
    rows at once: half the candidates are odd in the first rounds, so one chunk decides nearly every even there, ~3%
    in the last at Qwen2.5-VL's 1232, ~30 entries down); ``warps``: None for 8 from rows of 256, else 4; ``rank``:
    "tiles" counts each even's better matches pairwise (E^2 comparisons a round), "sort" sorts (match, place) keys
    once a round (``tl.sort``, a bitonic network over the next power of 2 of the first round's evens, up to
    `VIS_SORT_MAX`; past it, tiles), "wide" runs the other kernel (``_vispruner_wide_kernel``: a round's evens all at
    once, in a scan tile of ``scan`` elements, then one sort sized to the round; ``warps`` None for 16; ``tile``,
    ``evens``, ``chunk`` unused; picks checked against the loop in the interpreter, compiled for sm_90 without spills
    at its defaults, not yet timed on a GPU).
    ``benchmarks/vispruner_tiles.py`` times others on a GPU."""
    tile: int = 8192
    evens: int = 64
    chunk: int = 32
    warps: int | None = None
    rank: str = "tiles"
    scan: int = 4096


VIS_TILES = VisTiles()
VIS_SORT_MAX = 4096  # keys one program sorts at once (int64: 32 registers a thread at 8 warps)


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
def _add_compensated(total, comp, x):
    """One step of Neumaier's compensated sum: ``total + x`` and the running correction ``comp`` (the low bits each
    addition rounded off; the sum is ``total + comp`` at the end). The kernels' long sums add a few rows a step at
    large N (``_blocks``: 2 rows at 8192 lanes), thousands of float32 additions in a row: plainly summed, that was
    10x torch's rounding error (its reductions are cascaded) on facility location's gains at 4100 tokens;
    compensated, it is below torch's (tests/selection/triton_cases.py, "long-sum")."""
    t = total + x
    comp += tl.where(tl.abs(total) >= tl.abs(x), (total - t) + x, (x - t) + total)
    return t, comp


@triton.jit
def _descending(value):
    """The high half of int64 sort keys that an ascending ``tl.sort`` puts in the descending order of the float32
    ``value`` (the low half: what breaks ties, lower first); -0.0 ties +0.0, as the comparisons say."""
    bits = tl.where(value == 0.0, 0.0, value).to(tl.int32, bitcast=True)
    ascending = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # ordered as the floats are, as signed integers
    return (~ascending).to(tl.int64) << 32


@triton.jit
def _dpp_extend(Kb, Fb, gains, offs, inb, j, upd, step, N, GAIN_EPS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Add token ``j``'s row ``e = (K_j - c_j^T F) / sqrt(d2_j)`` to the Cholesky rows ``Fb`` (when ``upd``) and
    lower the residual gains ``d2 -= e^2``. Returns ``(gains, step)``; rows that would be zero are not kept."""
    acc = tl.zeros_like(gains)
    comp = tl.zeros_like(gains)  # compensated: `step` terms, BLOCK_S at a time (2 at 8192 lanes)
    for s0 in range(0, step, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        live = rows < step
        tile = tl.load(Fb + rows[:, None] * N + offs[None, :], mask=live[:, None] & inb[None, :], other=0.0)
        c_j = tl.load(Fb + rows * N + j, mask=live, other=0.0)  # column j of the rows so far
        acc, comp = _add_compensated(acc, comp, tl.sum(c_j[:, None] * tile, axis=0))
    acc += comp
    k_j = tl.load(Kb + j * N + offs, mask=inb, other=0.0)
    d2_j = tl.maximum(_at(gains, offs, j), GAIN_EPS)
    e = tl.div_rn(k_j - acc, tl.sqrt_rn(d2_j))
    e = tl.where(upd, e, 0.0)
    tl.store(Fb + step * N + offs, e, mask=inb)
    tl.debug_barrier()  # the row is read back by every thread of the program at the next step
    gains = tl.maximum(gains - e * e, 0.0)
    return gains, step + upd.to(tl.int32)


@triton.jit
def _dpp_kernel(K, avail, anchor, order, first, counts, F, out, N, OUT_W, S_ROWS, OUT_AT,
                GAIN_EPS: tl.constexpr, CONDITIONAL: tl.constexpr, USE_FIRST: tl.constexpr, AT: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """One view of ``diversity.dpp_greedy``: ``K [B, N, N]``, ``avail/anchor [B, N]`` int8, ``order [B, N]`` the
    fallback score, ``first [B]`` the first pick (-1: none), ``counts [B]``, scratch ``F [B, S_ROWS, N]``, ``out [B,
    OUT_W]`` prefilled with -1. With ``AT``: the picks go to ``out[b, OUT_AT[b]:]``, as many as fill the row
    (``counts`` unread): a selection's salient tokens are before them (``_front_kernel``)."""
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
    if AT:
        at = tl.load(OUT_AT + b).to(tl.int32)
        count = OUT_W - at
    else:
        count = tl.minimum(tl.load(counts + b), OUT_W)
        at = count * 0
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
        tl.store(out + b * OUT_W + at + k, j.to(tl.int64))
        free = free & (offs != j)
        gains, step = _dpp_extend(Kb, Fb, gains, offs, inb, j, best > GAIN_EPS, step, N, GAIN_EPS, BLOCK_S)


@triton.jit
def _front_kernel(S, T_SAL, K, out, salient, anchor, free, first, N, T, FIRST: tl.constexpr, BLOCK_N: tl.constexpr,
                  ROWS: tl.constexpr, GAIN_EPS: tl.constexpr):
    """One view of ``two_stage``'s saliency stage, before its DPP (``_dpp_kernel`` with ``AT``): the saliency ``S [B,
    N]`` min-max normalized as ``two_stage.minmax`` does (float32, IEEE division), its stable descending order (ties:
    the lower index) by one sort of (value, index) keys, and the first ``T_SAL[b]`` tokens of that order written to
    ``out[b, :T_SAL[b]]`` (``[B, T]`` int64, the rest -1, T <= N) and flagged in ``anchor`` (``[B, N]`` int8; ``free``
    its complement) and ``salient`` (``[B, T]`` int8: the ranks below ``T_SAL[b]``). ``FIRST``: ``first [B]`` gets the
    unconditional DPP's first pick (``diversity._first_from_anchor``) on ``K [B, N, N]``, exactly symmetric (as
    ``TokenSet.cosine`` is), so that each token's largest similarity to an anchor token is the running max of the
    anchor tokens' rows (``ROWS`` at a time): the free token where that is smallest, the lowest index on ties, among
    those whose diagonal passes ``GAIN_EPS`` where any does; -1 without anchor tokens."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    s = tl.load(S + b * N + offs, mask=inb, other=0.0)
    lo = tl.min(tl.where(inb, s, float("inf")), axis=0)
    hi = tl.max(tl.where(inb, s, float("-inf")), axis=0)
    v = tl.div_rn(s - lo, tl.maximum(hi - lo, 1.1754943508222875e-38))  # clamp_min(finfo(float32).tiny)
    key = tl.where(inb, _descending(v) | offs.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    order = (tl.sort(key) & 0xFFFFFFFF).to(tl.int32)  # lane r: the token at rank r
    t = tl.load(T_SAL + b).to(tl.int32)
    taken = offs < t  # by rank
    head = offs < T
    tl.store(out + b * T + offs, tl.where(taken, order.to(tl.int64), -1), mask=head)
    tl.store(salient + b * T + offs, taken.to(tl.int8), mask=head)
    tl.store(anchor + b * N + order, taken.to(tl.int8), mask=inb)  # by token
    tl.debug_barrier()  # every thread reads the flags (and the anchor tokens) back
    held = tl.load(anchor + b * N + offs, mask=inb, other=0) != 0
    tl.store(free + b * N + offs, tl.where(held, 0, 1).to(tl.int8), mask=inb)
    if FIRST:
        near = tl.full([BLOCK_N], float("-inf"), tl.float32)  # each token's largest similarity to an anchor token
        for r0 in range(0, t, ROWS):  # ROWS anchor rows at once: their loads in flight together
            rs = r0 + tl.arange(0, ROWS)
            live = rs < t
            js = tl.load(out + b * T + rs, mask=live, other=0)
            rows = tl.load(K + b * N * N + js[:, None] * N + offs[None, :], mask=live[:, None] & inb[None, :],
                           other=float("-inf"))
            near = tl.maximum(near, tl.max(rows, axis=0))
        # a token with no gain to give (its diagonal at most GAIN_EPS) ranks below every other free token
        diag = tl.load(K + b * N * N + offs * N + offs, mask=inb, other=0.0)
        near = tl.where(diag > GAIN_EPS, near, 3.4028234663852886e38)  # float32's largest finite value
        score = tl.where(inb & (held == 0), -near, float("-inf"))
        top = tl.max(score, axis=0)
        pick = tl.min(tl.where(score == top, offs, BLOCK_N), axis=0)
        tl.store(first + b, tl.where(t > 0, pick, -1).to(tl.int64))


@triton.jit
def _ascending_kernel(IDX, SAL, out_idx, out_sal, T, HAS_SAL: tl.constexpr, BLOCK_T: tl.constexpr):
    """One row of a selection put in ascending order, its salient flags carried along: ``IDX [B, T]`` int64 (distinct
    per row but for -1, no pick, which is never salient) and ``SAL [B, T]`` uint8 (``HAS_SAL``) into ``out_idx`` /
    ``out_sal``, by one sort of ``2 index + flag`` keys (what ``indices.sort(dim=1)`` and a gather of the flags by its
    permutation give)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    inb = offs < T
    key = tl.load(IDX + b * T + offs, mask=inb, other=0) * 2
    if HAS_SAL:
        key += tl.load(SAL + b * T + offs, mask=inb, other=0).to(tl.int64)
    key = tl.sort(tl.where(inb, key, 0x7FFFFFFFFFFFFFFF))
    tl.store(out_idx + b * T + offs, key >> 1, mask=inb)  # arithmetic: -1 (no pick) stays -1
    if HAS_SAL:
        tl.store(out_sal + b * T + offs, (key & 1).to(tl.uint8), mask=inb)


@triton.jit
def _scaled_gram_kernel(G, norms, out, N, EPS_NUM, EPS, RATIO: tl.constexpr, DIAG: tl.constexpr,
                        BLOCK: tl.constexpr):
    """A ``[BLOCK, BLOCK]`` tile of ``exactly_symmetric(G * a[:, :, None] * a[:, None, :])`` for ``G [B, N, N]`` and a
    per-token factor from the ``norms [B, N]``: ``a = max(n, EPS_NUM) / max(n, EPS)`` with ``RATIO`` (the cosine from
    the unit Gram, ``kernels.rescale_gram``; ``DIAG``: its diagonal set to ``(n / max(n, EPS))^2``, as
    ``TokenSet.cosine`` sets it), else ``a = 1 / max(n, EPS)`` (the unit Gram from the half tokens' raw product,
    ``TokenSet.unit_gram``): the float32 operations of those torch ops in their order, so the same bits."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ni = tl.load(norms + b * N + i, mask=i < N, other=1.0)
    nj = tl.load(norms + b * N + j, mask=j < N, other=1.0)
    if RATIO:
        ai = tl.div_rn(tl.maximum(ni, EPS_NUM), tl.maximum(ni, EPS))
        aj = tl.div_rn(tl.maximum(nj, EPS_NUM), tl.maximum(nj, EPS))
    else:
        ai = tl.div_rn(tl.full([BLOCK], 1.0, tl.float32), tl.maximum(ni, EPS))
        aj = tl.div_rn(tl.full([BLOCK], 1.0, tl.float32), tl.maximum(nj, EPS))
    here = (i < N)[:, None] & (j < N)[None, :]
    Gb = G + b * N * N
    g = tl.load(Gb + i[:, None] * N + j[None, :], mask=here, other=0.0)
    gt = tl.load(Gb + j[None, :] * N + i[:, None], mask=here, other=0.0)  # G[j, i]
    k = 0.5 * ((g * ai[:, None]) * aj[None, :] + (gt * aj[None, :]) * ai[:, None])
    if DIAG:
        di = tl.div_rn(ni, tl.maximum(ni, EPS))
        k = tl.where(i[:, None] == j[None, :], (di * di)[:, None], k)
    tl.store(out + b * N * N + i[:, None] * N + j[None, :], k, mask=here)


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
    _fps_picks(D, first, near, free, count, out, b, offs, inb, N, OUT_W, TOL, BLOCK_N, False)


@triton.jit
def _fps_picks(D, first, near, free, count, out, b, offs, inb, N, OUT_W, TOL: tl.constexpr, BLOCK_N: tl.constexpr,
               COSINE: tl.constexpr):
    """The farthest point sampling loop of one view: ``count`` picks into ``out[b]``, each the free token whose
    distance to the picked set is largest (``first`` scores the first pick); each pick's row of the distance lowers
    ``near``. ``COSINE``: ``D`` is the cosine and its rows become distances as they are read (``max(1 - c, 0)``)."""
    for k in range(count):
        j = _near_tie_argmax(tl.where(k == 0, first, near), free, offs, TOL, BLOCK_N)
        tl.store(out + b * OUT_W + k, j.to(tl.int64))
        free = free & (offs != j)
        row = tl.load(D + b * N * N + j * N + offs, mask=inb, other=float("-inf"))
        if COSINE:
            row = tl.where(inb, tl.maximum(1.0 - row, 0.0), float("-inf"))
        near = tl.minimum(near, row)


@triton.jit
def _divprune_kernel(C, out, N, OUT_W, TOL: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """One view of ``baselines.divprune``: farthest point sampling of ``OUT_W`` tokens on the distance ``max(1 - C,
    0)`` of the cosine ``C [B, N, N]`` (``diversity.farthest_point`` on it, no anchor), read from ``C`` as it goes.
    The first pick's score, each token's distance to its nearest other token, is the running min of the distance's
    rows ``ROWS`` at a time: ``C`` is exactly symmetric (``TokenSet.cosine``), so that is the min of its own row."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    first = tl.full([BLOCK_N], float("inf"), tl.float32)
    for r0 in range(0, N, ROWS):
        rs = r0 + tl.arange(0, ROWS)
        live = rs < N
        c = tl.load(C + b * N * N + rs[:, None] * N + offs[None, :], mask=live[:, None] & inb[None, :], other=0.0)
        d = tl.where(live[:, None] & (rs[:, None] != offs[None, :]), tl.maximum(1.0 - c, 0.0), float("inf"))
        first = tl.minimum(first, tl.min(d, axis=0))
    near = tl.full([BLOCK_N], float("inf"), tl.float32)
    _fps_picks(C, first, near, inb, OUT_W, out, b, offs, inb, N, OUT_W, TOL, BLOCK_N, True)


@triton.jit
def _fl_gains(Sb, Cb, offs, inb, N, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    """Facility location's gains ``[BLOCK_N]``, column j: ``sum_i max(0, s_ij - cover_i)`` over the ``N`` rows of
    ``Sb`` and ``cover`` ``Cb``, BLOCK_I rows a step (2 at 8192 lanes), compensated (``_add_compensated``)."""
    gain = tl.zeros([BLOCK_N], dtype=tl.float32)
    comp = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i0 in range(0, N, BLOCK_I):
        rows = i0 + tl.arange(0, BLOCK_I)
        live = rows < N
        tile = tl.load(Sb + rows[:, None] * N + offs[None, :], mask=live[:, None] & inb[None, :], other=0.0)
        c = tl.load(Cb + rows, mask=live, other=0.0)
        gain, comp = _add_compensated(gain, comp, tl.sum(tl.maximum(tile - c[:, None], 0.0), axis=0))
    return gain + comp


@triton.jit
def _fl_kernel(S, cover, avail, order, counts, out, N, OUT_W, TIE: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_I: tl.constexpr):
    """One view of ``diversity.facility_location``: ``S [B, N, N]`` in [0, 1], ``cover [B, N]`` (updated in place),
    ``avail [B, N]`` int8, fallback ``order [B, N]``, ``counts [B]``, ``out`` (-1); gains within ``TIE`` of the best
    (relative, of 1 below 1) tie, the lowest index winning."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    Sb = S + b * N * N
    Cb = cover + b * N
    free = tl.load(avail + b * N + offs, mask=inb, other=0) != 0
    fb = tl.load(order + b * N + offs, mask=inb, other=float("-inf"))
    count = tl.minimum(tl.load(counts + b), OUT_W)
    for k in range(count):
        gain = _fl_gains(Sb, Cb, offs, inb, N, BLOCK_N, BLOCK_I)
        masked = tl.where(free, gain, float("-inf"))
        best = tl.max(masked, axis=0)
        j = tl.min(tl.where(masked >= best - TIE * tl.maximum(best, 1.0), offs, BLOCK_N), axis=0)
        j_fb, _fb = _masked_argmax(fb, free, offs, BLOCK_N)
        j = tl.where(best <= 0, j_fb, j)
        tl.store(out + b * OUT_W + k, j.to(tl.int64))
        free = free & (offs != j)
        row = tl.load(Sb + j * N + offs, mask=inb, other=0.0)
        tl.store(Cb + offs, tl.maximum(tl.load(Cb + offs, mask=inb, other=0.0), row), mask=inb)
        tl.debug_barrier()  # cover is read back by rows at the next step


@triton.jit
def _vispruner_kernel(C, SI, lists, odd, match, out, R0, KEEP, ROUNDS, ROUND: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SORT_N: tl.constexpr):
    """One row of ``baselines.vispruner_diverse``: ``C [B, R0, R0]`` the similarity of the candidates in their given
    order, scratch ``lists [B, 2, R0]`` int32 (the current order and the next), ``odd [B, R0]`` int32 (the last round
    each candidate was at an odd place in: a candidate is odd in round r when it holds r + 1, so no round clears
    them) and ``match [B, R0]``, ``out [B, KEEP]``: the kept candidates' positions
    in the given order, in their final order. Every round runs here: evens matched to their most similar odd, the
    ``min(ROUND, R - KEEP)`` best-matched evens dropped (ties: the lower place first, a stable descending order), the
    rest followed by the odds.

    ``C`` holds each row of the similarity sorted in descending order and ``SI [B, R0, R0]`` int32 the column each
    entry came from, so an even's match is the first entry down its row whose column is an odd candidate of this
    round: the rows are read ``CHUNK`` entries at a time (``BLOCK_M`` evens together) until every even has met one,
    about ``R0 / odds`` entries a row (the same float32 values as the row's, so the same max). Reading each even's whole
    row every round instead (contiguous tiles, the odd columns unmasked) read ~110M elements from one program per
    view at Qwen2.5-VL's 1232 candidates and 146 rounds: 16.4 ms on an H100 (2026-11-26), 14.4 ms on an H200
    (2026-11-28), ~10x DivPrune; a gather of only the odd columns was slower still (every element its own memory
    transaction). The evens are taken a block at a time, so a round's work follows its own size, not the first
    round's. ``SORT_N`` > 0 (``VisTiles.rank`` "sort"): the survivors' order from one sort of ``SORT_N`` keys a round
    instead of the pairwise ranking's tiles."""
    b = tl.program_id(0).to(tl.int64)
    Cb = C + b * R0 * R0
    SIb = SI + b * R0 * R0
    Lb = lists + b * 2 * R0
    Ob = odd + b * R0
    Mb = match + b * R0
    es = tl.arange(0, BLOCK_E)
    ps = tl.arange(0, BLOCK_P)
    for p0 in range(0, R0, BLOCK_P):  # the given order: places 0 .. R0 - 1, and no candidate odd in any round yet
        tl.store(Lb + p0 + ps, p0 + ps, mask=p0 + ps < R0)
        tl.store(Ob + p0 + ps, tl.zeros([BLOCK_P], tl.int32), mask=p0 + ps < R0)
    tl.debug_barrier()
    R = tl.program_id(0) * 0 + R0  # an int32 tensor: the list's length
    for r in range(ROUNDS):
        cur = Lb + (r % 2) * R0
        nxt = Lb + ((r + 1) % 2) * R0
        E = (R + 1) // 2  # evens
        n_odd = R // 2
        drop = tl.minimum(tl.minimum(R - KEEP, ROUND), E)
        stamp = r + 1  # the candidates at the odd places of this round's order are stamped with it (no reset)
        for h0 in range(0, n_odd, BLOCK_P):
            hs = h0 + ps
            od = tl.load(cur + 2 * hs + 1, mask=hs < n_odd, other=0)
            tl.store(Ob + od, tl.zeros([BLOCK_P], tl.int32) + stamp, mask=hs < n_odd)
        tl.debug_barrier()
        # each even's best match among the odds: the first odd column down its sorted row
        ms = tl.arange(0, BLOCK_M)
        cs = tl.arange(0, CHUNK)
        for e0 in range(0, E, BLOCK_M):
            i = e0 + ms
            live = i < E
            ev = tl.load(cur + 2 * i, mask=live, other=0).to(tl.int64)
            best = tl.full([BLOCK_M], float("-inf"), tl.float32)
            pending = live
            waiting = tl.sum(pending.to(tl.int32), axis=0)
            c0 = tl.program_id(0) * 0  # an int32 tensor, as the loop carries it
            while waiting > 0:
                cols = c0 + cs
                here = pending[:, None] & (cols < R0)[None, :]
                at = ev[:, None] * R0 + cols[None, :]
                col = tl.load(SIb + at, mask=here, other=0)
                hit = here & (tl.load(Ob + col, mask=here, other=0) == stamp)
                value = tl.max(tl.where(hit, tl.load(Cb + at, mask=here, other=float("-inf")), float("-inf")),
                               axis=1)
                found = tl.sum(hit.to(tl.int32), axis=1) > 0
                best = tl.where(found, value, best)
                pending = pending & (found == 0)
                c0 += CHUNK
                # past the rows' end, none waits: that test stays scalar, out of the masks (Triton's interpreter
                # splats a scalar comparison with its operands' int32, and 3.9's refuses a load mask not bool)
                waiting = tl.where(c0 < R0, tl.sum(pending.to(tl.int32), axis=0), 0)
            tl.store(Mb + i, best, mask=live)
        tl.debug_barrier()  # every even's match is read below
        if SORT_N > 0:  # the stable descending order of the matches as one sort of (match, place) keys
            ks = tl.arange(0, SORT_N)
            mk = tl.load(Mb + ks, mask=ks < E, other=0.0)
            key = _descending(mk) | ks.to(tl.int64)  # the best match first, then the lower place
            key = tl.where(ks < E, key, 0x7FFFFFFFFFFFFFFF)
            place = (tl.sort(key) & 0xFFFFFFFF).to(tl.int32)  # the evens in their new order
            ev = tl.load(cur + 2 * place, mask=ks < E, other=0)
            tl.store(nxt + ks - drop, ev, mask=(ks >= drop) & (ks < E))  # survivors, best match first
        else:
            for e0 in range(0, E, BLOCK_E):  # place in the stable descending order of the matches
                i = e0 + es
                live = i < E
                mine = tl.load(Mb + i, mask=live, other=float("-inf"))
                ahead_n = tl.zeros([BLOCK_E, BLOCK_P], dtype=tl.int32)
                for k0 in range(0, E, BLOCK_P):
                    ks = k0 + ps
                    mk = tl.load(Mb + ks, mask=ks < E, other=float("-inf"))
                    ahead = (mk[None, :] > mine[:, None]) | ((mk[None, :] == mine[:, None])
                                                             & (ks[None, :] < i[:, None]))
                    ahead_n += (ahead & (ks < E)[None, :]).to(tl.int32)
                rank = tl.sum(ahead_n, axis=1)
                ev = tl.load(cur + 2 * i, mask=live, other=0)
                tl.store(nxt + rank - drop, ev, mask=live & (rank >= drop))  # survivors, best match first
        for h0 in range(0, n_odd, BLOCK_P):  # then the odds in order
            hs = h0 + ps
            tl.store(nxt + (E - drop) + hs, tl.load(cur + 2 * hs + 1, mask=hs < n_odd, other=0), mask=hs < n_odd)
        tl.debug_barrier()  # the next round reads the new order (and overwrites the flags, this order, the matches)
        R = R - drop
    final = Lb + (ROUNDS % 2) * R0
    for k0 in range(0, KEEP, BLOCK_P):
        ks = k0 + ps
        tl.store(out + b * KEEP + ks, tl.load(final + ks, mask=ks < KEEP, other=0).to(tl.int64), mask=ks < KEEP)


@triton.jit(noinline=True)
def _vis_wide_round(Cb, SIb, Ob, cur, nxt, R0, E, drop, stamp, M: tl.constexpr, CH: tl.constexpr):
    """One round's ``E <= M`` evens in ``_vispruner_wide_kernel``: every even's match by a scan down its sorted row,
    ``[M, CH]`` entries at a time until every even has met an odd candidate of this round (stamped ``stamp``); then
    one sort of (match, place, candidate) keys puts them in the stable descending order of their matches, and the
    survivors go to ``nxt`` (from place 0), stamped ``stamp + 1`` where their place there is odd."""
    ms = tl.arange(0, M)
    cs = tl.arange(0, CH)
    live = ms < E
    ev = tl.load(cur + 2 * ms, mask=live, other=0)
    row = ev * R0  # int32: R0^2 < 2^31 where this kernel runs (R0 <= 2 VIS_SORT_MAX)
    best = tl.full([M], float("-inf"), tl.float32)
    pending = live
    waiting = tl.sum(pending.to(tl.int32), axis=0)
    c0 = E * 0  # an int32 tensor, as the loop carries it
    while waiting > 0:
        cols = c0 + cs
        here = pending[:, None] & (cols < R0)[None, :]
        at = row[:, None] + cols[None, :]
        col = tl.load(SIb + at, mask=here, other=0)
        value = tl.load(Cb + at, mask=here, other=float("-inf"))
        hit = here & (tl.load(Ob + col, mask=here, other=0) == stamp)
        found = tl.sum(hit.to(tl.int32), axis=1) > 0
        best = tl.where(found, tl.max(tl.where(hit, value, float("-inf")), axis=1), best)
        pending = pending & (found == 0)
        c0 += CH
        waiting = tl.where(c0 < R0, tl.sum(pending.to(tl.int32), axis=0), 0)  # as `_vispruner_kernel`'s scan
    # the best match first, then the lower place; the candidate rides in the low bits (places < 2^15, R0 <= 2^16)
    key = _descending(best) | (ms.to(tl.int64) << 16) | ev.to(tl.int64)
    key = tl.where(live, key, 0x7FFFFFFFFFFFFFFF)
    cand = (tl.sort(key) & 0xFFFF).to(tl.int32)  # the evens in their new order (ms: the place in it)
    tl.debug_barrier()  # every scan has read this round's stamps before the next round's are written
    place = ms - drop
    kept = live & (ms >= drop)
    tl.store(nxt + place, cand, mask=kept)  # survivors, best match first
    tl.store(Ob + cand, tl.zeros([M], tl.int32) + stamp + 1, mask=kept & (place % 2 == 1))


@triton.jit
def _vispruner_wide_kernel(C, SI, lists, odd, out, R0, KEEP, ROUNDS, ROUND: tl.constexpr, BLOCK_W: tl.constexpr,
                           SCAN: tl.constexpr, LEVELS: tl.constexpr):
    """``_vispruner_kernel``'s rounds (the same inputs, no ``match`` buffer) with every step of a round over all its
    evens at once, so a round is a short chain (the scan's few iterations, one sort, the stores) instead of blocks of
    evens in sequence: ``BLOCK_W`` (a power of 2, >= the first round's evens and ``R0 / 2``) sets the vectors; a round
    of ``E`` evens runs at the level ``M`` = the next power of 2 of ``E`` (at least ``BLOCK_W >> (LEVELS - 1)``), its
    scan ``[M, SCAN / M]`` entries at a time (as the evens thin out, the odd candidates are fewer and lie deeper in
    each row: the tile grows down the rows as it shrinks across them) and its sort ``M`` keys. A round's odd
    candidates are stamped with ``r + 1`` by the round before, where it writes them (at the start for round 0), so no
    round marks them on its own."""
    b = tl.program_id(0).to(tl.int64)
    Cb = C + b * R0 * R0
    SIb = SI + b * R0 * R0
    Lb = lists + b * 2 * R0
    Ob = odd + b * R0
    ws = tl.arange(0, BLOCK_W)
    for h in tl.static_range(2):  # the given order (R0 <= 2 BLOCK_W), its odd places stamped for round 0
        p = h * BLOCK_W + ws
        tl.store(Lb + p, p, mask=p < R0)
        tl.store(Ob + p, p % 2, mask=p < R0)
    tl.debug_barrier()
    R = tl.program_id(0) * 0 + R0  # an int32 tensor: the list's length
    for r in range(ROUNDS):
        cur = Lb + (r % 2) * R0
        nxt = Lb + ((r + 1) % 2) * R0
        E = (R + 1) // 2
        n_odd = R // 2
        drop = tl.minimum(tl.minimum(R - KEEP, ROUND), E)
        stamp = r + 1
        odds = tl.load(cur + 2 * ws + 1, mask=ws < n_odd, other=0)
        for k in tl.static_range(LEVELS):  # the one level whose size holds E and whose half does not (the last: any E)
            if (E <= (BLOCK_W >> k)) & (E > (BLOCK_W >> (k + 1)) * (k < LEVELS - 1)):
                _vis_wide_round(Cb, SIb, Ob, cur, nxt, R0, E, drop, stamp, BLOCK_W >> k, SCAN // (BLOCK_W >> k))
        place = E - drop + ws  # then the odds in order
        tl.store(nxt + place, odds, mask=ws < n_odd)
        tl.store(Ob + odds, tl.zeros([BLOCK_W], tl.int32) + stamp + 1, mask=(ws < n_odd) & (place % 2 == 1))
        tl.debug_barrier()  # the next round reads the new order and its stamps
        R = R - drop
    final = Lb + (ROUNDS % 2) * R0
    for k0 in range(0, KEEP, BLOCK_W):
        ks = k0 + ws
        tl.store(out + b * KEEP + ks, tl.load(final + ks, mask=ks < KEEP, other=0).to(tl.int64), mask=ks < KEEP)


def _blocks(N: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_S, num_warps)`` for N tokens per view."""
    block_n = accel.pow2_at_least(max(N, 16))
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
    free = _flags(available)
    out = _picks(kernel.shape[0], width, kernel.device)
    _dpp_launch(kernel, free, _flags(anchor) if anchor is not None else None, order, first,
                counts.to(torch.int32).contiguous(), out, None, gain_eps)
    return out


def _dpp_launch(kernel, free, anchor, order, first, counts, out, at, gain_eps) -> None:
    """``_dpp_kernel`` on the int8 flags ``free`` and ``anchor`` (None: unconditional), into ``out [B, W]`` (from
    column ``at[b]`` when given, else from 0, ``counts[b]`` picks)."""
    B, N, _ = kernel.shape
    width = out.shape[1]
    block_n, block_s, warps = _blocks(N)
    rows = min(N, width + (N if anchor is not None else 0)) + 1  # kept Cholesky rows: distinct tokens, plus a spare
    factor = kernel.new_empty(B, rows, N)
    spare = counts if at is None else at  # stands in for the absent arguments, which the kernel never reads
    _dpp_kernel[(B,)](kernel.contiguous(), free, free if anchor is None else anchor, order.float().contiguous(),
                      (spare if first is None else first).contiguous(), spare, factor, out, N, width, rows, spare,
                      GAIN_EPS=gain_eps, CONDITIONAL=anchor is not None, USE_FIRST=first is not None,
                      AT=at is not None, BLOCK_N=block_n, BLOCK_S=block_s, num_warps=warps, enable_fp_fusion=False)


GRAM_BLOCK = 64


def scaled_gram(gram: torch.Tensor, norms: torch.Tensor, eps: float, eps_num: float | None = None) -> torch.Tensor:
    """One launch (``_scaled_gram_kernel``) for what takes the torch ops six to eleven: with ``eps_num``,
    ``TokenSet.cosine`` from the unit Gram ``gram [B, N, N]`` (tokens normalized with ``eps_num``) rescaled to ``eps``,
    exactly symmetric, its diagonal exact; without, ``TokenSet.unit_gram`` from the half tokens' raw float32 product
    ``gram`` (each entry over both tokens' norms floored at ``eps``), exactly symmetric."""
    B, N, _ = gram.shape
    out = torch.empty_like(gram)
    tiles = accel.cdiv(N, GRAM_BLOCK)
    ratio = eps_num is not None
    _scaled_gram_kernel[(B, tiles, tiles)](gram.contiguous(), norms.float().contiguous(), out, N,
                                           eps_num if ratio else eps, eps, RATIO=ratio, DIAG=ratio, BLOCK=GRAM_BLOCK,
                                           num_warps=4, enable_fp_fusion=False)
    return out


ASCENDING_MAX = VIS_SORT_MAX  # kept tokens one program sorts at once (``ascending``)


def ascending(indices: torch.Tensor, salient: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``registry._sorted``'s reorder in one launch (``_ascending_kernel``) instead of a sort and a gather: the kept
    ``indices [B, T]`` (int64, distinct per row but for -1; T <= `ASCENDING_MAX`) in ascending order and the
    ``salient [B, T]`` bool flags (or None) in the same order. Flags of another dtype or shape are a TypeError (the
    kernel reads them as one byte each: int64 flags came back mostly unwritten); ``select`` refuses them from a
    method of one's own (``registry._check_output``)."""
    B, T = indices.shape
    if salient is not None and (salient.dtype != torch.bool or salient.shape != indices.shape):
        raise TypeError(f"ascending: salient must be a bool tensor of the indices' shape {tuple(indices.shape)}, got "
                        f"{salient.dtype} {tuple(salient.shape)}")
    idx = indices.contiguous()
    out_idx = torch.empty_like(idx)
    flags = None if salient is None else salient.contiguous()
    out_sal = None if flags is None else torch.empty_like(flags)
    # without flags the indices stand in for the flag pointers, which the kernel never reads
    sal, sal_out = (idx, out_idx) if flags is None else (flags.view(torch.uint8), out_sal.view(torch.uint8))
    _ascending_kernel[(B,)](idx, sal, out_idx, sal_out, T, HAS_SAL=flags is not None,
                            BLOCK_T=accel.pow2_at_least(max(T, 16)), num_warps=8 if T > 1024 else 4)
    return out_idx, out_sal


FRONT_MAX = VIS_SORT_MAX  # tokens one program sorts at once (``salient_front``)


def salient_front(saliency: torch.Tensor, t_sal: torch.Tensor, budget: int,
                  kernel: torch.Tensor | None, gain_eps: float) -> tuple[torch.Tensor, ...]:
    """``two_stage``'s saliency stage in one launch (``_front_kernel``), for its DPP to follow (``dpp_after_front``):
    ``saliency [B, N]`` float32, ``t_sal [B]`` long on the device, ``budget`` <= N <= `FRONT_MAX`; ``kernel [B, N,
    N]``: the unconditional DPP's, exactly symmetric (``TokenSet.cosine``), whose first pick is found here (None:
    conditional or no coverage stage, no first pick), the first pick among the tokens whose diagonal passes
    ``gain_eps`` (``diversity.GAIN_EPS``) where any does. Returns ``(indices [B, budget] long, salient [B, budget] bool,
    anchor [B, N] int8, free [B, N] int8, first [B] or None)``: ``indices`` holds the salient tokens, then -1 where
    the DPP's picks go."""
    B, N = saliency.shape
    block_n = accel.pow2_at_least(max(N, 16))
    device = saliency.device
    indices = torch.empty(B, budget, dtype=torch.long, device=device)
    salient = torch.empty(B, budget, dtype=torch.int8, device=device)
    anchor = torch.empty(B, N, dtype=torch.int8, device=device)
    free = torch.empty(B, N, dtype=torch.int8, device=device)
    first = torch.empty(B, dtype=torch.long, device=device)
    _front_kernel[(B,)](saliency.contiguous(), t_sal.contiguous(), saliency if kernel is None else kernel.contiguous(),
                        indices, salient, anchor, free, first, N, budget, FIRST=kernel is not None, BLOCK_N=block_n,
                        ROWS=max(1, _TILE_ELEMENTS // block_n), GAIN_EPS=gain_eps, num_warps=8 if block_n >= 1024
                        else 4, enable_fp_fusion=False)
    return indices, salient.view(torch.bool), anchor, free, first if kernel is not None else None


def dpp_after_front(kernel: torch.Tensor, front: tuple[torch.Tensor, ...], t_sal: torch.Tensor, order: torch.Tensor,
                    conditional: bool, gain_eps: float) -> torch.Tensor:
    """The coverage stage's DPP in one launch after ``salient_front``: its picks fill ``front``'s indices from column
    ``t_sal[b]`` to the budget, in place. Returns those indices."""
    indices, _salient, anchor, free, first = front
    _dpp_launch(kernel, free, anchor if conditional else None, order, first, None, indices, t_sal, gain_eps)
    return indices


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


def divprune_picks(cosine: torch.Tensor, budget: int, tie_eps: float) -> torch.Tensor:
    """``baselines.divprune``'s picks in one launch (``_divprune_kernel``) from the exactly symmetric ``cosine [B, N,
    N]`` float32: its distance, the first pick's scores and the loop, where the torch ops and the FPS kernel took ~15
    launches. Returns picks ``[B, budget]``."""
    B, N, _ = cosine.shape
    block_n, _, warps = _blocks(N)
    out = torch.empty(B, budget, dtype=torch.long, device=cosine.device)
    _divprune_kernel[(B,)](cosine.contiguous(), out, N, budget, TOL=tie_eps, BLOCK_N=block_n,
                           ROWS=max(1, _TILE_ELEMENTS // block_n), num_warps=warps, enable_fp_fusion=False)
    return out


def facility_location(similarity: torch.Tensor, available: torch.Tensor, counts: torch.Tensor, cover: torch.Tensor,
                      order: torch.Tensor, width: int, tie_eps: float) -> torch.Tensor:
    """``diversity.facility_location``'s loop in one launch: ``similarity [B, N, N]`` in [0, 1], the initial
    ``cover [B, N]``, fallback ``order [B, N]``; ``width`` >= counts.max(); gains within ``tie_eps`` of the best
    (relative, of 1 below 1) tie. Returns picks ``[B, width]``."""
    B, N, _ = similarity.shape
    block_n, block_i, warps = _blocks(N)
    out = _picks(B, width, similarity.device)
    _fl_kernel[(B,)](similarity.contiguous(), cover.float().clone().contiguous(), _flags(available),
                     order.float().contiguous(), counts.to(torch.int32).contiguous(), out, N, width,
                     TIE=tie_eps, BLOCK_N=block_n, BLOCK_I=block_i, num_warps=warps, enable_fp_fusion=False)
    return out


def vispruner_blocks(R0: int, tiles: VisTiles = VIS_TILES) -> tuple[int, int, int]:
    """``(BLOCK_E, BLOCK_P, num_warps)`` of VisPruner's kernel for ``R0`` candidates: its ranking's tiles of BLOCK_E
    evens by BLOCK_P matches (at most ``tiles.tile`` elements), BLOCK_P a whole row up to 256."""
    block_p = accel.pow2_at_least(max(min(R0, 256), 16))
    warps = tiles.warps or (8 if block_p >= 256 else 4)
    return max(1, tiles.tile // block_p), block_p, warps


def vispruner_sort_keys(R0: int, tiles: VisTiles = VIS_TILES) -> int:
    """The keys of the tiles kernel's one sort a round for ``R0`` candidates (``tiles.rank`` "sort": the next power of
    2 of the first round's evens, up to `VIS_SORT_MAX`), 0 where it ranks by tiles."""
    keys = accel.pow2_at_least(max((R0 + 1) // 2, 16))
    return keys if tiles.rank == "sort" and keys <= VIS_SORT_MAX else 0


VIS_WIDE_MIN = 16  # the smallest level of the wide kernel: rounds of fewer evens run at this size
# The wide kernel's vectors for every candidate count up to twice this: one compile serves the paper's shapes (the
# rounds' levels follow each round's evens at run time, so a wider vector costs only masked lanes).
VIS_WIDE_BLOCK = 2048


def vispruner_wide_blocks(R0: int, tiles: VisTiles = VIS_TILES) -> tuple[int, int, int, int] | None:
    """``(BLOCK_W, SCAN, LEVELS, num_warps)`` of the wide kernel for ``R0`` candidates (``_vispruner_wide_kernel``),
    or None where the first round's evens pass `VIS_SORT_MAX` (then R0 < 2^16 too, as the keys need)."""
    block_w = max(accel.pow2_at_least((R0 + 1) // 2), VIS_WIDE_BLOCK)
    if block_w > VIS_SORT_MAX:
        return None
    levels = block_w.bit_length() - VIS_WIDE_MIN.bit_length() + 1  # BLOCK_W, BLOCK_W / 2, ..., VIS_WIDE_MIN
    return block_w, max(tiles.scan, block_w), levels, tiles.warps or 16


def vispruner_rounds(similarity: torch.Tensor, keep: int, rounds: int, round_size: int,
                     tiles: VisTiles | None = None) -> torch.Tensor:
    """``baselines.vispruner_diverse``'s rounds in one launch: ``similarity [B, R0, R0]`` float32 among the candidates
    in their given order, ``keep`` < R0 of them after ``rounds`` rounds (host-known: they follow from R0 and keep
    alone) of at most ``round_size`` drops. Returns the kept positions ``[B, keep]`` in their final order. Each row is
    sorted first (one ``torch.sort``), for the kernel's scan down it. ``tiles``: `VIS_TILES` (read at the call) unless
    given; ``tiles.rank`` "wide": the other kernel (``_vispruner_wide_kernel``), where a round's evens fit one sort
    (`VIS_SORT_MAX`); past it, tiles."""
    tiles = VIS_TILES if tiles is None else tiles
    B, R0, _ = similarity.shape
    device = similarity.device
    lists = torch.empty(B, 2, R0, dtype=torch.int32, device=device)
    odd = torch.empty(B, R0, dtype=torch.int32, device=device)  # set by the kernel at its start, stamped per round
    out = _picks(B, keep, device)
    values, columns = torch.sort(similarity, dim=2, descending=True)
    values, columns = values.contiguous(), columns.to(torch.int32).contiguous()
    wide = vispruner_wide_blocks(R0, tiles) if tiles.rank == "wide" else None
    if wide is not None:
        block_w, scan, levels, warps = wide
        _vispruner_wide_kernel[(B,)](values, columns, lists, odd, out, R0, keep, rounds, ROUND=round_size,
                                     BLOCK_W=block_w, SCAN=scan, LEVELS=levels, num_warps=warps,
                                     enable_fp_fusion=False)
        return out
    match = torch.empty(B, R0, dtype=torch.float32, device=device)
    block_e, block_p, warps = vispruner_blocks(R0, tiles)
    _vispruner_kernel[(B,)](values, columns, lists, odd, match, out, R0, keep, rounds, ROUND=round_size,
                            BLOCK_E=block_e, BLOCK_P=block_p, BLOCK_M=tiles.evens, CHUNK=tiles.chunk,
                            SORT_N=vispruner_sort_keys(R0, tiles), num_warps=warps, enable_fp_fusion=False)
    return out
