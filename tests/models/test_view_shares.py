"""``adaptive_views``' shares from certified entropy brackets (``batched_select.certain_shares`` over
``certified.settle``'s stages): the exact route's integer shares for every image, also where a view's entropy sits
next to a share's rounding boundary, a tie of remainders or a cap on purpose, with the eigensolve only for the images
the brackets leave undecided."""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch

from promprune.models.batched_select import (LAST_SHARES, _exact_entropies, certain_shares, shares_by_entropy,
                                             split_budget)
from promprune.selection import accel, certified
from promprune.selection.entropy import entropy_of_matrix, spectral_matrix

from ..selection.test_certified import entropy_of


def points_of(lo: list[float], hi: list[float], rng: np.random.Generator, sweep: int = 40) -> list[list[float]]:
    """Weight vectors of the box ``[lo, hi]``: its corners, random points, and each weight swept across its interval
    with the others at a random point."""
    out = [list(c) for c in itertools.product(*zip(lo, hi))]
    out += [list(rng.uniform(lo, hi)) for _ in range(40)]
    for j in range(len(lo)):
        base = rng.uniform(lo, hi)
        for x in np.linspace(lo[j], hi[j], sweep):
            out.append([*base[:j], x, *base[j + 1:]])
    return out


def random_case(rng, case: int):
    """A random share problem: (views, counts, budget, weights), every 5th with a tie of remainders (the first view
    wins it), every 7th with a view of weight 0."""
    views = int(rng.integers(2, 6))
    counts = [int(c) for c in rng.choice([3, 8, 40, 576], views)]
    budget = int(rng.integers(1, 200))
    w = rng.uniform(0.2, 0.9, views)
    if case % 5 == 0:
        w[1] = w[0]
    if case % 7 == 0:
        w[-1] = 0.0
    return views, counts, budget, w


def test_certain_shares_are_split_budgets_at_every_point_of_their_box():
    """Boxes of every width around random weights, ties of equal weights, zero weights and small counts (the capping
    rounds): where ``certain_shares`` decides, ``split_budget`` gives its shares at every point tried; where the box
    holds points of two shares it does not decide; and it decides most narrow boxes (not those reaching weight 0,
    where a quota may sit at an integer: entropies of real views lie far above 0)."""
    rng = np.random.default_rng(0)
    decided = undecided = narrow = narrow_decided = 0
    for case in range(400):
        views, counts, budget, w = random_case(rng, case)
        width = [0.0, 1e-7, 1e-5, 1e-3, 3e-2][case % 5]
        lo = list(w - rng.uniform(0, width, views))
        hi = list(w + rng.uniform(0, width, views))
        if case % 3 == 0:  # some views known exactly (eigensolved)
            lo[0] = hi[0] = w[0]
        got = certain_shares(budget, counts, lo, hi)
        seen = {tuple(split_budget(budget, counts, p)) for p in points_of(lo, hi, rng)}
        if got is None:
            undecided += 1
        else:
            decided += 1
            assert seen == {tuple(got)}, (budget, counts, lo, hi, got, seen)
        if len(seen) > 1:
            assert got is None
        if width <= 1e-5 and case % 5 != 0 and case % 7 != 0:  # neither a tie nor a weight whose interval reaches 0
            narrow += 1
            narrow_decided += got is not None
    assert decided > 150 and undecided > 50, (decided, undecided)
    assert narrow_decided > 0.9 * narrow, (narrow_decided, narrow)


def test_certain_shares_hand_worked():
    # 6 tokens over weights 0.75 / 0.25 (split_budget's own hand case): quotas 4.5 / 1.5, a tie the first view wins
    assert certain_shares(6, [16, 16], [0.75, 0.25], [0.75, 0.25]) == [5, 1]  # points: as split_budget computes
    # around it, the first view's quota 6 w0 / (w0 + w1) moves across 4.5 either way: undecided
    assert certain_shares(6, [16, 16], [0.7499, 0.25], [0.7501, 0.25]) is None
    # quotas 4.8 / 1.2 at most +-0.0004: floors 4 / 1, the first's remainder (>= 0.7996) above the second's: 5 / 1
    assert certain_shares(6, [16, 16], [0.7999, 0.1999], [0.8001, 0.2001]) == [5, 1]
    # the same with the first view capped at 2 tokens: the 3 it cannot take go to the second (one view open: all)
    assert certain_shares(6, [2, 16], [0.7999, 0.1999], [0.8001, 0.2001]) == [2, 4]
    # all weights possibly 0: an even split there, proportional elsewhere
    assert certain_shares(6, [16, 16], [0.0, 0.0], [0.1, 0.1]) is None
    assert certain_shares(6, [16, 16], [0.0, 0.0], [0.0, 0.0]) == [3, 3]
    # views of weight 0 exactly (one token: H = 0): quota 0; quotas 3.125 / 1.875 +-0.0004 for the others
    assert certain_shares(5, [16, 16, 1, 1], [0.5, 0.3, 0.0, 0.0], [0.5001, 0.3001, 0.0, 0.0]) == [3, 2, 0, 0]
    assert certain_shares(3, [1, 16, 16], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]) == split_budget(3, [1, 16, 16], [0, 0, 0])
    assert certain_shares(5, [16, 16], [-0.1, 0.5], [math.inf, 0.6]) is None


def power_with_entropy(n: int, target: float) -> np.ndarray:
    """Eigenvalues ``[n]`` of a power law ``i^-a`` whose normalized entropy is ``target`` (bisection on ``a``)."""
    i = np.arange(1, n + 1, dtype=np.float64)
    low, high = 0.0, 8.0
    for _ in range(80):
        a = (low + high) / 2
        lam = i ** -a
        if entropy_of(lam / lam.sum()) > target:
            low = a
        else:
            high = a
    lam = i ** -((low + high) / 2)
    return lam / lam.sum()


@functools.cache
def basis(n: int, seed: int) -> np.ndarray:
    """A random orthonormal basis ``[n, n]`` (one QR per size and seed: the boundary batches' views share it)."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return q


def matrix_with(lam: np.ndarray, q: np.ndarray) -> torch.Tensor:
    """The symmetric matrix ``[n, n]`` with eigenvalues ``lam`` in the basis ``q`` (float64)."""
    return torch.from_numpy((q * lam) @ q.T)


OFFSETS = (0.0, 1e-7, -1e-7, 1e-6, -1e-6, 1e-5, -1e-5, 3e-5, -3e-5, 1e-4, -1e-3)


def boundary_batch(seed: int, budget: int):
    """Images of 3-5 views (spectral matrices of 48 or 64 rows, float32), each with its first view's entropy placed
    at an offset of `OFFSETS` from a boundary of the shares: a quota at an integer, or a tie with the second view's
    entropy (and eight images placed nowhere in particular); some views with few tokens (the capping rounds); one
    image with a view of one token (H = 0, no bracket: its eigensolve runs with the first stage), one with a
    spectrum of three distinct values (its bounds refused). Returns ``(matrices, rows, counts)`` as
    ``shares_by_entropy`` takes them."""
    rng = np.random.default_rng(seed)
    views: list[tuple[np.ndarray, int]] = []  # (eigenvalues, token count) of every view
    rows: dict[int, list[int]] = {}
    image = 0
    for offset in OFFSETS + (None,) * 4:  # None: an image placed nowhere in particular
        for kind in ("floor", "tie"):
            count = int(rng.integers(3, 6))
            sizes = [int(rng.choice([48, 64])) for _ in range(count)]
            tokens = [int(rng.choice([5, 200])) if j > 1 and rng.random() < 0.3 else 200 for j in range(count)]
            others = [power_with_entropy(n, rng.uniform(0.35, 0.85)) for n in sizes[1:]]
            h = [float(entropy_of_matrix(matrix_with(lam, basis(len(lam), seed))[None].float())[0]) for lam in others]
            left = min(budget, sum(tokens))
            if kind == "floor":  # the first view's quota left h0 / (h0 + S) at an integer k
                k = int(rng.integers(1, max(2, left // count)))
                target = k * sum(h) / (left - k)
            else:  # equal to the second view's: their remainders tie
                target = h[0]
            target = min(max(target + offset, 0.05), 0.97) if offset is not None else rng.uniform(0.35, 0.85)
            lams = [power_with_entropy(sizes[0], target), *others]
            rows[image] = list(range(len(views), len(views) + count))
            views += list(zip(lams, tokens))
            image += 1
    rows[image] = list(range(len(views), len(views) + 3))  # a view of one token among two
    views += [(power_with_entropy(64, 0.6), 200), (np.ones(1), 1), (power_with_entropy(48, 0.5), 200)]
    image += 1
    rows[image] = list(range(len(views), len(views) + 2))  # a spectrum of few values: the bounds refused
    views += [(np.repeat([0.5, 0.3, 0.2], 16) / 16, 200), (power_with_entropy(64, 0.7), 200)]
    return _stacked(views, rows, seed)


def _stacked(views, rows, seed):
    """The views' matrices stacked by size (as ``_view_matrices`` stacks them), the images' rows renumbered."""
    by_size: dict[int, list[int]] = {}
    for v, (lam, _t) in enumerate(views):
        by_size.setdefault(len(lam), []).append(v)
    order = [v for group in by_size.values() for v in group]
    place = {v: r for r, v in enumerate(order)}
    matrices = [torch.stack([matrix_with(views[v][0], basis(n, seed)) for v in group]).float()
                for n, group in by_size.items()]
    counts = {b: [views[v][1] for v in group] for b, group in rows.items()}
    return matrices, {b: [place[v] for v in group] for b, group in rows.items()}, counts


@pytest.mark.parametrize("seed,budget", [(0, 64), (1, 320), (2, 23)])
def test_shares_equal_the_exact_routes_next_to_share_boundaries(seed, budget):
    matrices, rows, counts = boundary_batch(seed, budget)
    weights = _exact_entropies(matrices, rows)  # the exact route's entropies
    want = {b: split_budget(budget, counts[b], weights[b]) for b in rows}
    with accel.entropy("exact"):
        assert shares_by_entropy(matrices, rows, counts, budget) == want and LAST_SHARES == []
    before = accel.syncs()
    with accel.entropy("certified"):
        got = shares_by_entropy(matrices, rows, counts, budget)
    reads = accel.syncs() - before
    assert got == want
    report = LAST_SHARES[0]
    views = sum(len(group) for group in rows.values())
    assert sum(report.decided) + report.exact == views  # every view decided by its image's brackets or eigensolved
    assert sum(report.decided) > views / 2, report  # most images decide without an eigensolve
    assert report.exact > 1 + 2 and report.refused == 1  # some near a boundary: eigensolved; the one-token view
    assert reads == len(report.decided) + 1  # one read a stage (the one-token view's eigensolve with the first), one
    # for the eigensolve of what the stages left


def test_shares_with_graphs_padded_or_not_are_the_exact_routes(monkeypatch):
    """``settle`` under CUDA graphs (``benchmarks.launches``' stub for each capture, on the CPU) with each size's
    later stages padded to ``graphed.bucket``'s rows (``Lanczos.going``) and unpadded: the exact route's shares, and
    the same views decided at each stage with the same intervals' widths; the padding did run (other rows)."""
    from benchmarks.launches import fast_path_on_cpu
    from promprune.selection import graphed

    matrices, rows, counts = boundary_batch(0, 64)
    weights = _exact_entropies(matrices, rows)
    want = {b: split_budget(64, counts[b], weights[b]) for b in rows}
    got, stages = {}, {}
    for pad in (True, False):
        monkeypatch.setattr(graphed, "PAD", pad)
        with fast_path_on_cpu(graphs=True), accel.entropy("certified"):
            got[pad] = shares_by_entropy(matrices, rows, counts, 64), LAST_SHARES[0]
            stages[pad] = {key[3][0][0] for key in graphed._CAPTURES if key[1] == "lanczos_steps"}
    (padded, report), (unpadded, plain) = got[True], got[False]
    assert padded == unpadded == want
    assert (report.decided, report.exact, report.widths) == (plain.decided, plain.exact, plain.widths)
    assert stages[True] != stages[False], stages


def test_far_from_boundaries_no_eigensolve():
    """Images whose shares lie far from a boundary decide by their brackets: no eigensolve, one read a stage."""
    views, rows = [], {}
    for b, hs in enumerate([(0.4, 0.6, 0.8), (0.5, 0.7), (0.45, 0.55, 0.65, 0.75)]):
        rows[b] = list(range(len(views), len(views) + len(hs)))
        views += [(power_with_entropy(96, h), 200) for h in hs]
    matrices, rows, counts = _stacked(views, rows, 3)
    # budget 91, quotas 91 h_j / sum h: 20.22 / 30.33 / 40.44 (one more: the third), 37.92 / 53.08 (the first),
    # 17.06 / 20.85 / 24.65 / 28.44 (two: the second and third); a bracket's 4e-5 moves a quota by ~2e-3
    weights = _exact_entropies(matrices, rows)
    want = {0: [20, 30, 41], 1: [38, 53], 2: [17, 21, 25, 28]}
    assert {b: split_budget(91, counts[b], weights[b]) for b in rows} == want
    before = accel.syncs()
    with accel.entropy("certified"):
        got = shares_by_entropy(matrices, rows, counts, 91)
    assert got == want
    report = LAST_SHARES[0]
    assert sum(report.decided) == 9 and report.exact == 0, report  # no eigensolve at all
    assert accel.syncs() - before == len(report.decided)  # one read a stage


def test_auto_takes_the_eigensolve_on_the_cpu():
    """``auto`` on the CPU (no fast path): the exact route, as PromPrune's split there."""
    matrices, rows, counts = _stacked([(power_with_entropy(96, 0.5), 200), (power_with_entropy(96, 0.6), 200)],
                                      {0: [0, 1]}, 4)
    assert not certified.applies(96, matrices[0])
    LAST_SHARES[:] = ["stale"]
    with accel.entropy("auto"):
        shares_by_entropy(matrices, rows, counts, 64)
    assert LAST_SHARES == []


def test_views_of_more_tokens_than_dimensions_are_one_stack_per_matrix_size():
    """Views of 20 and 24 tokens of 16 dimensions both give 16 x 16 covariances: ``_view_matrices`` stacks them as
    one tensor, ``settle``'s contract (two tensors of one size, one view each, are two Lanczos states of one shape:
    under CUDA graphs one capture, whose replay for the second overwrote the first's borrowed coefficients before the
    stage's read), and ``settle`` refuses two. The rows still name each item's views in order, and the shares are the
    exact route's."""
    from promprune.models import batched_select
    from promprune.models.adapters import HostIndex, VisualItem

    g = torch.Generator().manual_seed(5)
    items = []
    for counts in ([20, 24, 12], [24, 9]):
        n = sum(counts)
        x = torch.randn(n, 16, generator=g) * torch.rand(n, 1, generator=g)
        idx, groups = np.arange(n), np.repeat(np.arange(len(counts)), counts)
        items.append(VisualItem(run=x, features=x, run_pos=torch.from_numpy(idx), grid_index=torch.from_numpy(idx),
                                saliency=None, groups=torch.from_numpy(groups),
                                host=HostIndex(run_pos=idx, grid_index=idx, groups=groups)))
    per_view: dict = {}
    for unit in batched_select._units(items, [it.host for it in items], 40, "per_crop"):
        per_view.setdefault(unit.item, []).append(unit)
    matrices, rows = batched_select._view_matrices(items, per_view)
    assert sorted(m.shape[-1] for m in matrices) == [9, 12, 16]  # one tensor per size (was [9, 12, 16, 16])
    flat = [m for stack in matrices for m in stack]  # the rows numbered over the stacks in order
    for b, group in rows.items():  # each row is its view's own spectral matrix
        for unit, r in zip(per_view[b], group):
            view = items[b].features[torch.from_numpy(unit.idx)][None]
            assert torch.equal(flat[r], torch.nan_to_num(spectral_matrix(view.float()))[0]), (b, unit.view)
    counts = {b: [u.idx.shape[0] for u in group] for b, group in per_view.items()}
    weights = _exact_entropies(matrices, rows)
    want = {b: split_budget(40, counts[b], weights[b]) for b in rows}
    with accel.entropy("certified"):
        assert shares_by_entropy(matrices, rows, counts, 40) == want
    big = next(m for m in matrices if m.shape[-1] == 16)
    with pytest.raises(ValueError, match="one tensor per matrix size"):
        certified.settle([big[:1], big[1:]], lambda lo, hi: (np.ones(lo.shape, bool), np.zeros(lo.shape, bool)))


def test_certain_shares_fails_on_every_box_holding_one_where_it_fails():
    """What ``settle``'s ``hopeless`` rests on: where ``certain_shares`` fails on a box, it fails on every box holding
    it (boxes around random weights, some views points, ties, zero weights, small counts; each box grown by random
    amounts on either side). Where it decides the grown box, it decides the box inside it, with the same shares."""
    rng = np.random.default_rng(3)
    failed = 0
    for case in range(600):
        views, counts, budget, w = random_case(rng, case)
        width = [0.0, 1e-6, 1e-5, 1e-4, 1e-3][case % 5]
        lo, hi = w - rng.uniform(0, width, views), w + rng.uniform(0, width, views)
        if case % 3 == 0:
            lo[0] = hi[0] = w[0]  # a view known exactly stays a point in the larger box
        inner = certain_shares(budget, counts, lo, hi)
        grow = [0.0, 1e-6, 1e-5, 1e-4][case % 4]
        outer_lo, outer_hi = lo - rng.uniform(0, grow, views), hi + rng.uniform(0, grow, views)
        if case % 3 == 0:
            outer_lo[0], outer_hi[0] = lo[0], hi[0]
        outer = certain_shares(budget, counts, outer_lo, outer_hi)
        failed += inner is None
        assert outer is None or outer == inner, (budget, counts, lo, hi, outer_lo, outer_hi, inner, outer)
    assert 50 < failed < 550, failed


def test_an_image_whose_quota_sits_on_an_integer_gives_up_before_the_last_stage():
    """An image whose first view's quota is an integer to 1e-7 (and 2e-5, 7e-5 off: within the margins' reach of
    the integer): no brackets, however narrow, prove its shares, and once its views' brackets are at most twice
    their margin wide (at 24 of the schedule's 48 steps here) its views take the eigensolve: three stages and the
    eigensolve's read, where before it ran all five stages and then the eigensolve. Its shares are the exact
    route's."""
    budget = 64
    others = [power_with_entropy(96, h) for h in (0.55, 0.7)]
    h = [float(entropy_of_matrix(matrix_with(lam, basis(96, 5))[None].float())[0]) for lam in others]
    target = 20 * sum(h) / (budget - 20)  # the first view's quota 64 h0 / (h0 + h1 + h2) at 20
    for offset in (0.0, 1e-6, -3e-6):
        views = [(power_with_entropy(96, target + offset), 200)] + [(lam, 200) for lam in others]
        matrices, rows, counts = _stacked(views, {0: [0, 1, 2]}, 5)
        weights = _exact_entropies(matrices, rows)
        assert abs(budget * weights[0][0] / sum(weights[0]) - 20) < 1e-4
        before = accel.syncs()
        with accel.entropy("certified"):
            got = shares_by_entropy(matrices, rows, counts, budget)
        reads, report = accel.syncs() - before, LAST_SHARES[0]
        assert got == {0: split_budget(budget, counts[0], weights[0])}
        schedule = certified.schedule(3, 96)
        assert len(schedule) == 5 and len(report.decided) == 3, report
        assert (sum(report.decided), report.exact, report.hopeless, report.refused) == (0, 3, 3, 0), report
        assert reads == len(report.decided) + 1


@pytest.mark.parametrize("seed,budget", [(0, 64), (1, 320), (2, 23)])
def test_giving_up_on_shares_changes_none_and_saves_stages(seed, budget, monkeypatch):
    """The boundary batches (views placed on purpose at and around share boundaries and ties): the shares with
    ``hopeless`` and without it (``settle`` as before) are the same, the exact route's, with the same views
    eigensolved and the same views decided at each stage (the items given up on are ones no stage settled), and
    giving up saves stages and reads."""
    matrices, rows, counts = boundary_batch(seed, budget)
    weights = _exact_entropies(matrices, rows)
    want = {b: split_budget(budget, counts[b], weights[b]) for b in rows}
    before = accel.syncs()
    with accel.entropy("certified"):
        got = shares_by_entropy(matrices, rows, counts, budget)
    reads, report = accel.syncs() - before, LAST_SHARES[0]
    real = certified.settle
    monkeypatch.setattr(certified, "settle", lambda m, settled, hopeless=None: real(m, settled))
    before = accel.syncs()
    with accel.entropy("certified"):
        old = shares_by_entropy(matrices, rows, counts, budget)
    old_reads, old_report = accel.syncs() - before, LAST_SHARES[0]
    assert got == old == want
    assert report.exact == old_report.exact and report.refused == old_report.refused and old_report.hopeless == 0
    assert report.decided == old_report.decided[:len(report.decided)]
    assert not any(old_report.decided[len(report.decided):])  # the stages skipped settled nothing
    assert report.hopeless > report.exact / 2, report  # most eigensolved views were given up on early
    assert len(report.decided) < len(old_report.decided) and reads == old_reads - (len(old_report.decided)
                                                                                    - len(report.decided))


# PromPrune's split under ``adaptive_views`` reads the shares' certified intervals (``Unit.bounds``,
# ``select(..., entropy_bounds=)``, ``two_stage.known_split``): the views whose interval decides t_sal run no bracket
# of their own; the kept tokens and t_sal stay the exact route's.

def promprune_items(views: int, n: int, d: int, batch: int, seed: int = 0):
    """``benchmarks/view_shares.items_for``' multi-view items (views of one image with noise of their own scale), with a
    random saliency per candidate."""
    import dataclasses

    from benchmarks.view_shares import items_for

    g = torch.Generator().manual_seed(seed)
    return [dataclasses.replace(item, saliency=torch.rand(item.features.shape[0], generator=g))
            for item in items_for(views, n, d, batch, "cpu", torch.float32, detail=1.0, seed=seed)]


def both_routes(items, budget: int, options: dict):
    """``select_items`` under ``adaptive_views`` on the exact route and the certified one (forced): each route's
    selections and the certified route's split reports, merged (``certified.collected``)."""
    from promprune.models.batched_select import select_items

    out = {}
    for route in ("exact", "certified"):
        with accel.entropy(route), certified.collected() as reports:
            out[route] = select_items(items, budget, "promprune", options, mode="adaptive_views")
        out[route + " report"] = certified.SplitReport.total(reports)
    return out


def assert_same_selection(got, want):
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.kept, b.kept) and torch.equal(a.salient, b.salient)
        assert a.saliency_count == b.saliency_count


def unit_entropies(items, budget: int):
    """Each ``adaptive_views`` unit's share and the exact entropy PromPrune's exact route reads for it
    (``TokenSet.spectral_entropy``: the unit Gram centered in Gram space, N <= d), in ``_units``' order."""
    from promprune.models.adapters import host_index
    from promprune.models.batched_select import _units
    from promprune.selection.registry import TokenSet

    with accel.entropy("exact"):
        units = _units(items, host_index(items), budget, "adaptive_views")
        return [(u.budget, float(TokenSet(u.take(items[u.item].features)[None], None).spectral_entropy[0]))
                for u in units]


def boundary_mu(share: int, entropy: float, offset: float, tau: float = 0.02) -> float:
    """The mu that puts ``entropy`` ``offset`` above the entropy where PromPrune's t_sal of a ``share`` steps from
    ``share // 2`` to ``share // 2 - 1`` (half-even rounding, the default range: ratio ``1 - sigmoid((H - mu) /
    tau)`` crosses ``(share // 2 - 0.5) / share``)."""
    p = 1.0 - (share // 2 - 0.5) / share  # sigmoid((H_b - mu) / tau)
    return entropy - offset - tau * math.log(p / (1.0 - p))


@pytest.mark.parametrize("n,d", [(64, 128), (48, 24)])  # N <= d: the unit Gram; N > d: the covariance
def test_promprune_reuses_the_shares_intervals_and_keeps_the_exact_routes_tokens(n, d):
    """Five views per image, two images: at mu far from every entropy each unit's interval decides its t_sal (no
    split stage, no eigensolve in the method); at mu placing one unit's entropy 1e-7, 1e-5 or 3e-5 from a count
    boundary (either side: inside the intervals' widening, where they must not decide) and at 1e-3, and at a few
    plain mu, the kept tokens, stage flags and counts are the exact route's."""
    items = promprune_items(5, n, d, 2)
    budget = 40
    units = unit_entropies(items, budget)
    for mu in (-5.0, 5.0):  # every entropy's t_sal the same far into the sigmoid's tails: every interval decides
        got = both_routes(items, budget, {"mu": mu})
        assert_same_selection(got["certified"], got["exact"])
        report = got["certified report"]
        assert sum(report.decided) == 0 and report.exact == 0, report  # no split stage, no eigensolve in the method
        assert report.known == len(units), report
    share, entropy = max(units)  # the largest share: count boundaries closest together
    for offset in (1e-7, -1e-7, 1e-5, -1e-5, 3e-5, -3e-5, 1e-3):
        mu = boundary_mu(share, entropy, offset)
        got = both_routes(items, budget, {"mu": mu})
        assert_same_selection(got["certified"], got["exact"])
        report = got["certified report"]
        if abs(offset) < 4 * certified.decision_margin(min(n, d)):  # within the interval's two margins: no decision
            assert report.known < len(units) and sum(report.decided) + report.exact >= 1, (offset, report)
    for mu, rounding in ((0.3, "half_even"), (0.42, "floor"), (0.6, "half_even")):
        got = both_routes(items, budget, {"mu": mu, "rounding": rounding})
        assert_same_selection(got["certified"], got["exact"])


@pytest.mark.parametrize("arch", ["llava_next", "internvl", "llava_onevision"])
def test_promprune_under_adaptive_views_keeps_the_exact_routes_tokens_on_the_tiny_models(arch):
    """LLaVA-NeXT's, InternVL's and LLaVA-OneVision's views (tiny models, two images), PromPrune under
    ``adaptive_views`` at several mu: the certified route (forced) feeds the exact route's kept tokens and t_sal,
    and its split takes views' t_sal from the shares' intervals."""
    from benchmarks.model_path import images
    from promprune.models import PrunedVLM

    shots = images(2)
    known = 0
    for mu in (0.3, 0.42, 0.5, 0.6):
        vlm = PrunedVLM.from_pretrained(f"tiny:{arch}", method="promprune", budget=12, budget_mode="adaptive_views",
                                        mu=mu)
        got = {}
        for route in ("exact", "certified"):
            with accel.entropy(route), certified.collected() as reports:
                stats = vlm.prepare(shots, ["What is in the picture?"] * 2).stats
            got[route] = [(s["kept"], s["saliency_count"]) for s in stats]
        assert got["certified"] == got["exact"], (arch, mu)
        report = certified.SplitReport.total(reports)
        known += report.known if report is not None else 0
    assert known > 0


def test_promprune_under_adaptive_frames_keeps_the_exact_routes_tokens():
    """A clip's frames (``video_budget="adaptive_frames"``, which selects as ``adaptive_views``; tiny Qwen2.5-VL):
    the certified route's kept tokens and t_sal are the exact route's, its split taking the frames' intervals."""
    from promprune.models import PrunedVLM
    from promprune.testbed.clips import scene_clip

    clips = [scene_clip(index=3, frames=4), scene_clip(index=8, frames=4)]
    for mu in (0.42, 0.6):
        vlm = PrunedVLM.from_pretrained("tiny:qwen2_5_vl", method="promprune", budget=12,
                                        video_budget="adaptive_frames", mu=mu)
        got = {}
        for route in ("exact", "certified"):
            with accel.entropy(route), certified.collected() as reports:
                stats = vlm.prepare_video(clips, ["What moves?", "How many?"]).stats
            got[route] = [(s["kept"], s["saliency_count"]) for s in stats]
        assert got["certified"] == got["exact"], mu
        assert certified.SplitReport.total(reports).known > 0
