"""Calling ``promprune.select`` for a batch of images whose token counts and views differ.

Each image (or, for LLaVA-NeXT per-view modes, each view) is one *unit*; units with equal token count and
budget are stacked into one batched ``select`` call.

LLaVA-NeXT budget modes (``promprune.models.options.ADAPTER_OPTIONS``): ``per_crop`` splits the budget evenly over the
image's views; ``global`` selects once over all views; ``adaptive_views`` gives each view a share proportional to its
spectral entropy (spread-out views get more tokens), then selects per view: the exact entropies' shares on every route,
from certified entropy brackets where the bounds apply and prove them (``_view_shares``). In these three a view never
gets more than it has; what it cannot take goes to the others, so every image keeps ``min(budget, N)`` tokens.
``view_quota`` gives every view the same ``view_budget`` whatever the image's view count, and the adapter passes
each view's whole grid (``VisualItem.full``): picks the model's unpadding drops are not fed; with the adapter option
``unpad=False`` the whole grids come packed without unpadding (``VisualItem.spatial``), so every pick is. ``packed`` is
``global`` over ``VisualItem.packed()``, newline tokens included.

On a GPU the host plans: it reads the batch's index tensors once (``adapters.host_index``; none where the adapter built
them on the host), forms the units and buckets from host arrays, sends every unit's candidate indices to the device in
one copy, checks all buckets' inputs for NaN / Inf with one read (``select(..., checked=True)`` then skips its own),
runs the buckets' ``select`` calls back to back, and reads all their results in one copy: what the host waits for does
not grow with views, units or tokens (the methods' own reads aside: PromPrune's certified split reads its bounds once
per stage of a call; ``adaptive_views``' shares, where they take certified brackets, read them once per Lanczos stage,
and once more where an eigensolve decides what the brackets leave undecided, and hand each view's last interval to
its bucket's ``select`` call, whose PromPrune split then brackets none of the views whose ``t_sal`` the intervals
decide: ``_view_shares``). ``ItemSelection.kept`` / ``salient`` are host tensors; ``merged`` / ``cls`` stay on the
device.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

import promprune
from promprune.selection import accel, certified
from promprune.selection.entropy import entropy_of_matrix, spectral_matrix
from promprune.selection.registry import checked_inputs, finite_total

from .adapters import HostIndex, VisualItem, host_index
from .transfer import to_device, to_host


@dataclass
class ItemSelection:
    """``kept [M]`` candidate indices (in the LLM's order; a host tensor), ``merged [M, d]`` or None,
    ``saliency_count``, ``entropy``, ``salient [S]`` (host): the kept candidates the saliency stage chose (ascending;
    ``S == saliency_count``); ``cls [K, d]`` or None: kept tokens that are no candidate (VisionZip's CLS, one per
    view), fed first, or (``cls_at [K]``, host) each after that many of the ``kept`` tokens (VisionZip's released
    LLaVA-NeXT layout: :func:`_combine`). ``merged`` and ``cls`` live on the features' device.
    ``entropy_halfwidth``: how far ``entropy`` may lie from the exact metric (``Selection.entropy_halfwidth``; the
    mean over views where the entropy is), None where it is exact."""

    kept: torch.Tensor
    merged: torch.Tensor | None
    saliency_count: int
    entropy: float | None
    salient: torch.Tensor | None = None
    cls: torch.Tensor | None = None
    entropy_halfwidth: float | None = None
    cls_at: np.ndarray | None = None


def split_budget(budget: int, counts: list[int], weights: list[float] | None = None) -> list[int]:
    """Integer shares of ``budget`` over views with ``counts`` tokens, proportional to ``weights`` (even if None).

    Largest-remainder rounding; shares are capped at the counts and the excess is re-split over the rest.
    Sums to ``min(budget, sum(counts))``.
    """
    shares = [0] * len(counts)
    open_ = [i for i, c in enumerate(counts) if c > 0]
    left = min(budget, sum(counts))
    while left > 0 and open_:
        give = _largest_remainder(left, [max(float(weights[i]), 0.0) if weights is not None else 1.0 for i in open_])
        left = _take(give, open_, counts, shares, left)
        open_ = [i for i in open_ if shares[i] < counts[i]]
    return shares


def _largest_remainder(left: int, w: list[float]) -> list[int]:
    """One round of ``split_budget``: ``left`` tokens over the open views' weights ``w`` (>= 0; all 0: even), each
    the floor of its quota, then one more for the largest remainders (ties: the first view)."""
    w = w if sum(w) > 0 else [1.0] * len(w)
    total = sum(w)
    exact = [left * wi / total for wi in w]
    give = [int(e) for e in exact]
    order = sorted(range(len(w)), key=lambda j: (-(exact[j] - give[j]), j))
    for j in order[:left - sum(give)]:
        give[j] += 1
    return give


def _take(give: list[int], open_: list[int], counts: list[int], shares: list[int], left: int) -> int:
    """Add a round's ``give`` to the open views' ``shares`` (in place), capped at their ``counts``: what is left."""
    for j, i in enumerate(open_):
        take = min(give[j], counts[i] - shares[i])
        shares[i] += take
        left -= take
    return left


# How far (in tokens, per token left to split) a quota's every possible value must stay from a rounding boundary, and
# two remainders apart, for ``certain_shares`` to decide: it covers ``split_budget``'s float arithmetic (a few ulps of
# the quotas, ~1e-15 per token) with room to spare; a box that comes nearer goes to the eigensolve.
SHARE_SLACK = 1e-9


def certain_shares(budget: int, counts: list[int], lo, hi) -> list[int] | None:
    """``split_budget(budget, counts, w)``'s shares where they are the same for every ``w`` with ``lo <= w <= hi``
    (each view's interval: a point, ``lo == hi``, where the weight is known), else None: a sufficient condition, so
    None also where they may be the same but the intervals cannot show it.

    Each round of ``split_budget`` is followed with the weights as intervals (``max(w, 0)`` of their ends): each
    open view's quota ``left w_j / sum w`` grows with ``w_j`` and shrinks with the others, so it lies between its
    value at its own lowest weight with the others at their highest and the reverse. The round is certain where every
    quota's range keeps one floor, at least ``SHARE_SLACK`` per token left from its ends (a view whose weight is 0
    at both ends has quota 0 exactly), and the views that get one more by their remainders are the same at every
    point: each of them has a remainder above every other's by ``SHARE_SLACK`` (or both are exactly 0 and it comes
    first: the exact ties' order). Then the round's shares, its capping at the counts and the next round's open views
    are the exact weights' too. A round whose open weights are all points, or which has one open view, is computed
    as ``split_budget`` computes it; one whose total weight may be 0 (``split_budget`` then splits evenly) is not
    certain.

    Where it fails on a box it fails on every box that holds it (its quotas' and remainders' ranges only widen, and
    a partition of the remainders that separates them on the larger box separates them on the smaller one too),
    which ``_view_shares`` relies on to give up on an item early (``certified.settle``'s ``hopeless``)."""
    lo = [max(float(x), 0.0) for x in lo]
    hi = [max(float(x), 0.0) for x in hi]
    if not all(math.isfinite(a) and math.isfinite(b) and a <= b for a, b in zip(lo, hi)):
        return None
    shares = [0] * len(counts)
    open_ = [i for i, c in enumerate(counts) if c > 0]
    left = min(budget, sum(counts))
    while left > 0 and open_:
        low, high = [lo[i] for i in open_], [hi[i] for i in open_]
        if len(open_) == 1 or low == high:  # one view takes all that is left whatever its weight; points: as exact
            give = _largest_remainder(left, low)
        else:
            give = _certain_round(left, low, high)
            if give is None:
                return None
        left = _take(give, open_, counts, shares, left)
        open_ = [i for i in open_ if shares[i] < counts[i]]
    return shares


def _certain_round(left: int, low: list[float], high: list[float]) -> list[int] | None:
    """``_largest_remainder(left, w)`` if it is the same for every ``w`` between ``low`` and ``high`` (>= 0, not all
    points), else None (``certain_shares``)."""
    views = len(low)
    if not sum(low) > 0:  # the total may be 0 at the low ends: an even split there, proportional elsewhere
        return None
    slack = SHARE_SLACK * max(left, 1)
    zero = [b == 0.0 for b in high]  # weight 0 at every point: quota 0 exactly, remainder 0
    quota_lo, quota_hi = [], []
    for j in range(views):
        others_hi = math.fsum(high[:j] + high[j + 1:])
        others_lo = math.fsum(low[:j] + low[j + 1:])
        if not (low[j] + others_hi > 0 and high[j] + others_lo > 0):
            return None
        quota_lo.append(left * low[j] / (low[j] + others_hi))
        quota_hi.append(left * high[j] / (high[j] + others_lo))
    floor = [math.floor(q) for q in quota_lo]
    for j in range(views):
        # a float quota is never below 0: a floor of 0 needs no room below
        if not zero[j] and (math.floor(quota_hi[j]) != floor[j] or floor[j] > 0 and quota_lo[j] - floor[j] < slack
                            or floor[j] + 1 - quota_hi[j] < slack):
            return None
    extra = left - sum(floor)
    if not 0 <= extra <= views:
        return None
    rem_lo = [0.0 if zero[j] else quota_lo[j] - floor[j] for j in range(views)]
    rem_hi = [0.0 if zero[j] else quota_hi[j] - floor[j] for j in range(views)]
    order = sorted(range(views), key=lambda j: (-(rem_lo[j] + rem_hi[j]), j))
    more, rest = order[:extra], order[extra:]
    if not all(rem_lo[j] - rem_hi[k] > slack or (zero[j] and zero[k] and j < k) for j in more for k in rest):
        return None
    return [f + (j in more) for j, f in enumerate(floor)]


@dataclass
class Unit:
    """One selection unit: candidates ``idx [n]`` (host) of item ``item`` with ``budget`` tokens to keep; ``view``: its
    view (None: the several views of a global mode); ``whole``: ``idx`` is every candidate in order (the item's
    tensors serve as they are); ``dev``: ``idx`` on the device (None when whole); ``bounds``: an interval holding
    its exact spectral entropy where ``adaptive_views``' shares bracketed it (``_view_shares``), else None."""

    item: int
    idx: np.ndarray
    budget: int
    view: int | None
    whole: bool
    dev: torch.Tensor | None = None
    bounds: tuple[float, float] | None = None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The unit's rows of an item's per-candidate tensor ``t [N, ...]`` -> ``[n, ...]``."""
        return t if self.whole else t[self.dev]


def _units(items: list[VisualItem], hosts: list[HostIndex], budget: int, mode: str,
           view_budget: int | None = None) -> list[Unit]:
    """Every selection unit, in item order and then view order; partial units' indices placed on the device."""
    per_view: dict[int, list[Unit]] = {}
    whole: dict[int, Unit] = {}
    for b, host in enumerate(hosts):
        n = host.groups.shape[0]
        views = np.unique(host.groups)  # ascending
        if mode in ("global", "packed") or len(views) == 1 and mode != "view_quota":
            whole[b] = Unit(b, np.arange(n), budget, int(views[0]) if len(views) == 1 else None, whole=True)
            continue
        members = [np.flatnonzero(host.groups == v) for v in views]
        per_view[b] = [Unit(b, m, 0, int(v), whole=m.shape[0] == n) for v, m in zip(views, members)]
    _place(items, [u for units in per_view.values() for u in units])
    by_entropy = _view_shares(items, per_view, budget) if mode == "adaptive_views" else {}
    out = []
    for b in range(len(items)):
        if b in whole:
            out.append(whole[b])
            continue
        counts = [u.idx.shape[0] for u in per_view[b]]
        if mode == "view_quota":
            shares = [min(view_budget if view_budget is not None else budget, c) for c in counts]
        else:
            shares = by_entropy[b] if b in by_entropy else split_budget(budget, counts)
        for unit, share in zip(per_view[b], shares):
            if share > 0:
                unit.budget = share
                out.append(unit)
    return out


def _place(items: list[VisualItem], units: list[Unit]) -> None:
    """Set ``dev`` of the partial ``units``: one copy of their indices per device."""
    partial = [u for u in units if not u.whole]
    for device in dict.fromkeys(items[u.item].features.device for u in partial):
        group = [u for u in partial if items[u.item].features.device == device]
        for unit, moved in zip(group, to_device([u.idx for u in group], device)):
            unit.dev = moved


def _view_matrices(items: list[VisualItem], per_view: dict[int, list[Unit]]) -> tuple[list[torch.Tensor],
                                                                                 dict[int, list[int]]]:
    """Every view's spectral matrix, stacked by matrix size (``[V_s, n_s, n_s]`` each, one tensor per size, as
    ``certified.settle`` takes them: views of more tokens than feature dimensions, whatever their token count, all
    give ``d x d`` covariances, stacked together; NaN / Inf set to 0: such a view gets some weight here and the
    buckets' one finiteness check refuses it after), and each item's views' rows (numbered over the stacks in order).
    Full float32 products (``accel.full_float32``)."""
    units = [(b, u) for b, group in per_view.items() for u in group]
    by_tokens: dict[int, list[int]] = {}
    for i, (_b, u) in enumerate(units):
        by_tokens.setdefault(u.idx.shape[0], []).append(i)
    with accel.full_float32():
        made = [(group, torch.nan_to_num(spectral_matrix(
            torch.stack([units[i][1].take(items[units[i][0]].features) for i in group]).float()), 0.0, 0.0, 0.0))
            for group in by_tokens.values()]
    by_size: dict[int, list[tuple[list[int], torch.Tensor]]] = {}
    for group, matrix in made:
        by_size.setdefault(matrix.shape[-1], []).append((group, matrix))
    # two stacks of one size (``settle`` refuses them): two Lanczos states that, with as many views, are one CUDA
    # graph's capture under ``accel.graphs()``, whose replay for the second overwrites the first's borrowed state
    groups = [[i for group, _m in parts for i in group] for parts in by_size.values()]
    matrices = [parts[0][1] if len(parts) == 1 else torch.cat([m for _g, m in parts]) for parts in by_size.values()]
    row = {i: r for r, i in enumerate(i for group in groups for i in group)}
    numbered = iter(range(len(units)))
    return matrices, {b: [row[next(numbered)] for _ in group] for b, group in per_view.items()}


def _view_entropies(items: list[VisualItem], per_view: dict[int, list[Unit]]) -> dict[int, list[float]]:
    """Each view's exact spectral entropy (``adaptive_views``' weights on the exact route), item -> [V] floats: one
    batched eigensolve per matrix size (``promprune.spectral_entropy``'s, without its finiteness read per call:
    ``_view_matrices``) and one read for the batch."""
    return _exact_entropies(*_view_matrices(items, per_view))


def _exact_entropies(matrices: list[torch.Tensor], rows: dict[int, list[int]]) -> dict[int, list[float]]:
    """``_view_entropies`` of ``_view_matrices``' outputs."""
    with accel.full_float32():
        entropies = [entropy_of_matrix(m) for m in matrices]
    values = np.concatenate([np.zeros(0)] + [r.reshape(-1) for r in to_host(entropies)])
    return {b: [float(values[r]) for r in group] for b, group in rows.items()}


# The newest ``adaptive_views`` call's report where its shares took certified brackets (``certified.settle``: views
# decided at each stage without an eigensolve, views eigensolved), one entry, replaced per call; emptied by a call on
# the exact route.
LAST_SHARES: list[certified.SplitReport] = []


def _view_shares(items: list[VisualItem], per_view: dict[int, list[Unit]], budget: int) -> dict[int, list[int]]:
    """``adaptive_views``' shares, item -> [V]: ``split_budget`` of ``budget`` over each item's views, weighed by
    their exact spectral entropies (``_view_entropies``), the exact route's shares on every route.

    Where the certified bounds apply (``accel.entropy_mode``, ``certified.applies`` per view size, as PromPrune's
    split takes them) the entropies are bracketed instead (``certified.settle``: ``split``'s Lanczos stages, one read
    a stage): an item whose brackets prove its shares (``certain_shares``: the same integer shares for every
    entropy in them, the largest-remainder rounding's ties and capping included) takes them after that stage, its
    views no more steps; an item with a view whose bounds are refused, or undecided after the last stage, takes its
    views' exact entropies (one eigensolve for all of them, one read), and so, without the remaining stages, does an
    item whose shares ``certain_shares`` cannot prove even on its views' cores (``certified.settle``'s ``hopeless``:
    the box every later stage's intervals hold; a quota within the margin's reach of an integer): a rule that moves
    only cost, never the shares. ``LAST_SHARES`` says how they went.

    Where the brackets ran, each view's unit keeps its last interval (``Unit.bounds``: ``settle``'s, a bracket widened
    by the margin or the eigensolve's point, holding the view's exact entropy as ``promprune.spectral_entropy`` gives
    it), and ``select_items`` hands the intervals of a bucket's units to its ``select`` call (``entropy_bounds``):
    PromPrune's split (metric "spectral") takes the ``t_sal`` of every view whose interval decides it from there,
    with no second bracket and no eigensolve of that view (``two_stage.known_split``, ``certified.known_counts``: the
    exact route's ``t_sal``), and brackets only the others; no read more here."""
    counts = {b: [u.idx.shape[0] for u in group] for b, group in per_view.items()}
    shares, intervals = _shares_and_intervals(*_view_matrices(items, per_view), counts, budget)
    if intervals is not None:
        for b, group in per_view.items():
            for unit, bounds in zip(group, intervals[b]):
                unit.bounds = bounds
    return shares


def shares_by_entropy(matrices: list[torch.Tensor], rows: dict[int, list[int]], counts: dict[int, list[int]],
                      budget: int) -> dict[int, list[int]]:
    """``_view_shares`` from the views' spectral matrices (``_view_matrices``: stacks by size, each item's rows) and
    each item's views' token ``counts``."""
    return _shares_and_intervals(matrices, rows, counts, budget)[0]


def _shares_and_intervals(matrices: list[torch.Tensor], rows: dict[int, list[int]], counts: dict[int, list[int]],
                          budget: int) -> tuple[dict[int, list[int]], dict[int, list[tuple[float, float]]] | None]:
    """``shares_by_entropy``'s shares and, where ``certified.settle`` ran, each item's views' last intervals
    (``(lo, hi)``, each holding the view's exact entropy: ``Unit.bounds``); None on the exact route."""
    with accel.full_float32():
        if not any(certified.applies(m.shape[-1], m) for m in matrices if m.shape[0]):
            LAST_SHARES.clear()
            weights = _exact_entropies(matrices, rows)
            return {b: split_budget(budget, counts[b], weights[b]) for b in rows}, None
        decided: dict[int, list[int]] = {}

        def settled(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            done, exact = np.zeros(lo.shape, dtype=bool), np.zeros(lo.shape, dtype=bool)
            for b, group in rows.items():
                if b not in decided:
                    if not (np.isfinite(lo[group]).all() and np.isfinite(hi[group]).all()):
                        exact[group] = True  # a refused bracket: the item's views take the eigensolve
                        continue
                    shares = certain_shares(budget, counts[b], lo[group], hi[group])
                    if shares is None:
                        continue
                    decided[b] = shares
                done[group] = True
            return done, exact

        def hopeless(core_lo: np.ndarray, core_hi: np.ndarray) -> np.ndarray:
            # an item whose shares ``certain_shares`` cannot prove on its views' cores (the box every later stage's
            # intervals hold) goes to the eigensolve now: it fails on every box holding one where it fails, so no
            # later stage would prove them (only cost moves: the eigensolve gives the exact route's shares)
            out = np.zeros(core_lo.shape, dtype=bool)
            for b, group in rows.items():
                if b not in decided and np.isfinite(core_lo[group]).all() and np.isfinite(core_hi[group]).all():
                    out[group] = certain_shares(budget, counts[b], core_lo[group], core_hi[group]) is None
            return out

        lo, hi, _point, report = certified.settle(matrices, settled, hopeless=hopeless)
    LAST_SHARES[:] = [report]
    for b, group in rows.items():
        if b not in decided:  # every view eigensolved (``certified.settle``): the exact route's weights
            decided[b] = split_budget(budget, counts[b], lo[group].tolist())
    return decided, {b: [(float(lo[r]), float(hi[r])) for r in group] for b, group in rows.items()}


def _vision(items: list[VisualItem], group: list[Unit]) -> promprune.VisionFeatures | None:
    """The vision tower's features of a bucket of units (None when the adapter has none). A unit of one view gets
    that view's CLS; a unit of several (global modes) the base view's, the whole image's."""
    first = items[group[0].item]
    if first.vision is None:
        return None
    hidden = torch.stack([u.take(items[u.item].vision) for u in group])  # [U, n, dv]
    keys = None if first.keys is None else torch.stack([u.take(items[u.item].keys) for u in group])
    cls = None
    if first.cls is not None:
        cls = torch.stack([items[u.item].cls[0 if u.view is None else u.view] for u in group])  # [U, dv]
    return promprune.VisionFeatures(hidden=hidden, keys=keys, cls=cls, project=first.project)


def _instruction(items: list[VisualItem], group: list[Unit]) -> promprune.Instruction:
    """The instruction of a bucket of units: each unit's question embedding and its candidates in that space."""
    first = items[group[0].item]
    if first.text_tokens is None:
        raise ValueError("this method weighs tokens by the instruction: the adapter attaches it "
                         "(Adapter.attach_instruction), which was not called")
    query = torch.stack([items[u.item].text_query for u in group])  # [U, c]
    tokens = torch.stack([u.take(items[u.item].text_tokens) for u in group])  # [U, n, c]
    return promprune.Instruction(query=query, tokens=tokens, source=first.text_source)


def unit_key(key: int | None, view: int | None) -> int | None:
    """The key of one selection unit: the image's key (a unit of the whole image, ``view`` None), or it combined
    with the view's index (blake2b), so that each view of an image draws on its own."""
    if key is None or view is None:
        return key
    digest = hashlib.blake2b(f"{key}:view{view}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _keys(items: list[VisualItem], group: list[Unit]) -> list[int] | None:
    """The units' keys of a bucket (None when an item has no key: ``select`` then fingerprints the features)."""
    keys = [unit_key(items[u.item].key, u.view) for u in group]
    return None if any(k is None for k in keys) else keys


NOT_A_RECTANGLE = ("this method pools one view's token grid: the candidates of a selection unit must fill one "
                   "rectangle of one view ")
# what makes each selection unit one view, by what the items are (an image's views; a clip's views are its frames)
RECTANGLE_FIX = {"image": "(LLaVA-NeXT / LLaVA-OneVision: use budget_mode 'per_crop', 'adaptive_views' or "
                          "'view_quota', not 'global' or 'packed')",
                 "clip": "(a clip's frames: use video_budget 'per_frame' or 'adaptive_frames', each frame its own "
                         "selection, not 'clip', one selection over every frame's tokens)"}


def not_a_rectangle(media: str = "image") -> str:
    """Why a grid method cannot run on a unit that is no one view's rectangle, and the option that fixes it for
    ``media`` ("image": ``budget_mode``; "clip": ``video_budget``)."""
    return NOT_A_RECTANGLE + RECTANGLE_FIX[media]


def unit_grid(item: VisualItem, idx, media: str = "image") -> tuple[int, int]:
    """``(rows, cols)`` of the candidates ``idx`` (host indices) of one unit, which must fill a rectangle of one view's
    grid in raster order (LLaVA's image, a LLaVA-NeXT view after unpadding, Qwen2.5-VL's / Qwen3-VL's merged grid, a
    LLaVA-OneVision view as fed: ``VisualItem.cells``; a clip's frame). Reads the item's host index
    (:func:`host_index`). Otherwise a ValueError naming the option that fixes it for ``media``
    (:func:`not_a_rectangle`)."""
    host = host_index([item])[0]
    idx = np.asarray(idx)
    grid = host.grid_index[idx]
    if not (grid >= 0).all():  # newline tokens (packed) have no place in a view
        raise ValueError(not_a_rectangle(media))
    if host.cells is not None:  # (row, col) in the grid the view is fed as
        r, c = host.cells[idx, 0], host.cells[idx, 1]
        same_view = bool((host.groups[idx] == host.groups[idx[0]]).all())
    elif item.grid_shape is not None:
        rows, cols = item.grid_shape
        cell = grid % (rows * cols)
        r, c = cell // cols, cell % cols
        same_view = bool((grid // (rows * cols) == grid[0] // (rows * cols)).all())
    else:
        raise ValueError("this method pools a token grid: the adapter gives no grid for these tokens")
    height, width = int(r.max() - r.min()) + 1, int(c.max() - c.min()) + 1
    raster = (r - r.min()) * width + (c - c.min())
    if not same_view or height * width != idx.shape[0] or not np.array_equal(raster, np.arange(idx.shape[0])):
        raise ValueError(not_a_rectangle(media))
    return height, width


@dataclass
class _Part:
    """One unit's result on the host: ``kept`` candidate indices, ``rows`` their rows in the bucket's merged
    features (flattened over units), ``count``, ``entropy``, ``salient`` indices, ``cls [1, d]`` or None,
    ``halfwidth``: the entropy's (None: exact)."""

    kept: np.ndarray
    rows: np.ndarray
    count: int
    entropy: float | None
    salient: np.ndarray
    cls: torch.Tensor | None
    halfwidth: float | None = None


def select_items(items: list[VisualItem], budget: int, method: str, options: dict,
                 mode: str = "per_crop", order: str = "raster", view_budget: int | None = None,
                 media: str = "image") -> list[ItemSelection]:
    """Run ``method`` on every image; returns one :class:`ItemSelection` per item, its ``kept`` in ``order``
    ("raster": ascending; "selection": as picked; "stages": salient ascending, then the rest ascending; the views
    of LLaVA-NeXT follow each other in view order, each view's CLS first, except on a ``stitched`` item with
    "stages": VisionZip's released NeXT layout, :func:`_combine`). ``view_budget``: each view's tokens under
    "view_quota". Kept candidates outside the run (``run_pos < 0``: padding the model's unpadding drops) are left
    out. ``media`` ("image" or "clip": the items' views are a clip's frames) picks the option a grid method's refusal
    names."""
    spec = promprune.method_spec(method)
    options = {**options, "order": "ascending" if order == "raster" else "selection"}
    hosts = host_index(items)
    buckets: dict[tuple, list[Unit]] = {}
    for unit in _units(items, hosts, budget, mode, view_budget):
        grid = unit_grid(items[unit.item], unit.idx, media) if spec.needs_grid else None
        buckets.setdefault((unit.idx.shape[0], unit.budget, grid), []).append(unit)
    calls = [_inputs(items, group, spec) for group in buckets.values()]
    checked = _all_finite([t for call in calls for t in checked_inputs(call["features"], call["saliency"],
                                                                        call["vision"], call["instruction"]).values()])
    sels = [promprune.select(call.pop("features"), call.pop("saliency"), budget=share, method=method, grid=grid,
                             checked=checked, **call, **options)
            for (_n, share, grid), call in zip(buckets, calls)]
    parts = _parts(items, hosts, list(buckets.values()), sels, order)
    combined = [_combine(parts[b], hosts[b].run_pos, keep_order=order != "raster",
                         stitched=order == "stages" and items[b].stitched) for b in range(len(items))]
    return _attach_merged(combined, sels)


def _inputs(items: list[VisualItem], group: list[Unit], spec) -> dict:
    """``select``'s tensor arguments for a bucket of units: features ``[U, n, d]``, saliency, vision, instruction,
    keys, the units' entropy intervals (``_bounds``)."""
    feats = torch.stack([u.take(items[u.item].features) for u in group])  # [U, n, d]
    sal = torch.stack([u.take(items[u.item].saliency) for u in group]) if spec.needs_saliency else None  # [U, n]
    return dict(features=feats, saliency=sal, vision=_vision(items, group) if spec.reads_vision else None,
                instruction=_instruction(items, group) if spec.needs_instruction else None, keys=_keys(items, group),
                entropy_bounds=_bounds(group))


def _bounds(group: list[Unit]) -> np.ndarray | None:
    """The units' entropy intervals ``[U, 2]`` (host; ``Unit.bounds``, ``(-inf, inf)`` for a unit without one), or
    None where none has one."""
    if all(u.bounds is None for u in group):
        return None
    return np.array([u.bounds if u.bounds is not None else (-math.inf, math.inf) for u in group], dtype=np.float64)


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is finite: one read for all (False: ``select`` checks each and names the bad one, or
    finds none when huge finite values overflowed the total)."""
    return math.isfinite(float(to_host([finite_total(tensors)])[0]))


def _parts(items, hosts, groups: list[list[Unit]], sels, order: str) -> dict[int, list[_Part]]:
    """Every unit's result on the host, per item in view order (the buckets' order depends on the batch: which image
    made each bucket first): one read of all buckets' indices, stage flags, saliency counts and entropies (their
    half-widths, where not exact, are host values already)."""
    fields = []
    for sel in sels:
        fields += [sel.indices, sel.salient if sel.salient is not None else torch.zeros_like(sel.indices, dtype=bool),
                   sel.saliency_count]
        fields += [sel.entropy] if sel.entropy is not None else []
    read = iter(to_host(fields))
    parts: dict[int, list[tuple[int, _Part]]] = {b: [] for b in range(len(items))}
    offset = 0  # the bucket's first row among all buckets' merged rows (flattened over units)
    for group, sel in zip(groups, sels):
        indices, salient, counts = next(read), next(read), next(read)
        entropy = next(read) if sel.entropy is not None else None
        halfwidth = None if sel.entropy_halfwidth is None else sel.entropy_halfwidth.tolist()  # host values
        width = indices.shape[1]
        for u, unit in enumerate(group):
            parts[unit.item].append((-1 if unit.view is None else unit.view, _part(
                unit, hosts[unit.item], indices[u], salient[u], int(counts[u]),
                None if entropy is None else float(entropy[u]), offset + u * width, order,
                None if sel.cls is None else sel.cls[u][None], None if halfwidth is None else halfwidth[u])))
        offset += indices.size
    return {b: [part for _, part in sorted(units, key=lambda vp: vp[0])] for b, units in parts.items()}


def _part(unit: Unit, host: HostIndex, chosen: np.ndarray, is_salient: np.ndarray, count: int,
          entropy: float | None, row0: int, order: str, cls, halfwidth: float | None = None) -> _Part:
    """One unit's picks ``chosen [k]`` (positions in ``unit.idx``) after dropping what the model's unpadding drops and
    ordering by stage; ``entropy`` and its ``halfwidth`` (None: exact) as they came."""
    rows = row0 + np.arange(chosen.shape[0])
    fed = host.run_pos[unit.idx[chosen]] >= 0
    if not fed.all():  # picks in the padding: the model's unpadding drops them
        count -= int((is_salient & ~fed).sum())
        chosen, is_salient, rows = chosen[fed], is_salient[fed], rows[fed]
    if order == "stages":  # salient ascending, then the rest ascending (VisionZip's released order)
        rank = chosen + (~is_salient).astype(np.int64) * (int(chosen.max()) + 1 if chosen.shape[0] else 0)
        perm = np.argsort(rank, kind="stable")
        chosen, is_salient, rows = chosen[perm], is_salient[perm], rows[perm]
    return _Part(kept=unit.idx[chosen], rows=rows, count=count, entropy=entropy,
                 salient=unit.idx[chosen[is_salient]], cls=cls, halfwidth=halfwidth)


def _combine(parts: list[_Part], run_pos: np.ndarray, keep_order: bool = False,
             stitched: bool = False) -> tuple[ItemSelection, np.ndarray]:
    """Merge the units of one image into one kept list: in run order (the sequence the model packs), or
    (``keep_order``) the units' own orders one after the other (entropy: mean over views; CLS tokens in view
    order, fed first). ``stitched`` (units: the base view, then the crops of a stitched grid, ``run_pos`` their
    places in it; "stages" order) feeds VisionZip's released LLaVA-NeXT layout (``restore_image_features_sorted``):
    the base view's CLS, salient and other tokens, then every crop's salient tokens in the stitched grid's raster
    order, the crops' CLS tokens in view order, and each crop's other tokens, crop after crop. Returns the
    selection (``merged`` not yet set) and the merged rows of its kept tokens, in its order."""
    kept = np.concatenate([p.kept for p in parts])
    order = np.arange(kept.shape[0]) if keep_order else np.argsort(run_pos[kept], kind="stable")
    ents = [p.entropy for p in parts if p.entropy is not None]
    # the mean of values each within its half-width of the exact one is within the mean half-width of the exact mean
    widths = [p.halfwidth for p in parts if p.entropy is not None]  # None: exact
    # the CLS of each unit that has one: a unit whose share is all its tokens keeps them as they are, without one
    # (torch.cat met its None when the others had one; a first unit without one dropped the others')
    carried = [p.cls for p in parts if p.cls is not None]
    cls = torch.cat(carried) if carried else None
    cls_at = None
    if stitched and len(parts) > 1:
        order, cls_at = _stitched_order(parts, run_pos)
    sel = ItemSelection(kept=torch.from_numpy(kept[order]), merged=None, saliency_count=sum(p.count for p in parts),
                        entropy=sum(ents) / len(ents) if ents else None,
                        salient=torch.from_numpy(np.sort(np.concatenate([p.salient for p in parts]))), cls=cls,
                        entropy_halfwidth=(sum(w or 0.0 for w in widths) / len(widths)
                                           if any(w is not None for w in widths) else None), cls_at=cls_at)
    return sel, np.concatenate([p.rows for p in parts])[order]


def _stitched_order(parts: list[_Part], run_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """VisionZip's released LLaVA-NeXT order over the units' concatenated kept tokens (each unit in "stages" order,
    its salient tokens first): ``(order``, ``cls_at [K]``: how many of the ordered tokens precede each carried CLS;
    None without one). The base view (``parts[0]``) as it is, its CLS first; then the crops' salient tokens sorted
    by ``run_pos`` (their places in the stitched grid), the crops' CLS tokens, the crops' other tokens unit by
    unit."""
    starts = np.cumsum([0] + [p.kept.shape[0] for p in parts])
    n_salient = [p.salient.shape[0] for p in parts]  # "stages": a unit's salient tokens lead its kept list
    kept = np.concatenate([p.kept for p in parts])
    crop_salient = np.concatenate([np.arange(starts[u], starts[u] + n_salient[u]) for u in range(1, len(parts))])
    crop_salient = crop_salient[np.argsort(run_pos[kept[crop_salient]], kind="stable")]
    crop_rest = [np.arange(starts[u] + n_salient[u], starts[u + 1]) for u in range(1, len(parts))]
    order = np.concatenate([np.arange(starts[1]), crop_salient, *crop_rest]).astype(np.int64)
    has_cls = [p.cls is not None for p in parts]
    if not any(has_cls):
        return order, None
    at = [0] if has_cls[0] else []
    at += [starts[1] + crop_salient.shape[0]] * sum(has_cls[1:])
    return order, np.asarray(at, dtype=np.int64)


def _attach_merged(combined: list[tuple[ItemSelection, np.ndarray]], sels) -> list[ItemSelection]:
    """Set each selection's ``merged`` (token-merging methods) from the buckets' merged features, flattened over
    units and stacked: one copy of every item's row indices to the device."""
    out = [sel for sel, _ in combined]
    if not sels or sels[0].features is None:
        return out
    pool = torch.cat([sel.features.flatten(0, 1) for sel in sels])  # [sum over buckets of U * k, d]
    for sel, rows in zip(out, to_device([rows for _, rows in combined], pool.device)):
        sel.merged = pool[rows]
    return out
