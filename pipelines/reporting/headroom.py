"""Split headroom, the numbers: how much a per-sample saliency/coverage split could gain over the best fixed one, and
how much of that an adaptive rule takes.

The input is one score matrix per task and budget: ``scores [n, K]``, each of ``n`` samples (units) scored under each
of ``K`` fixed saliency ratios (the same answers `fixed_ratio` trials gave), in points (see `headroom_section` for the
per-sample score of each kind of task). From it:

- **best fixed**: the ratio of the highest mean score (`best_fixed`; ties: the smaller ratio);
- **oracle**: each sample answered by its own best ratio (`oracle`): an upper bound that flatters itself, since it
  picks the luckiest of K noisy answers per sample;
- **cross-validated rule** (`cross_validated`): a step rule on one per-sample feature (spectral entropy; on the
  testbed also the scene's object count), fit on one half of the samples and scored on the other, then the reverse,
  so each sample is scored by a rule that never saw it: what the feature can honestly buy;
- **paired bootstrap** (`resampled_means`, `interval`, `captured`): every comparison is a mean of per-sample
  differences against the best fixed ratio, resampled by image (the samples that share an image are drawn together),
  and "captures X% of the headroom" is (method - best fixed) / (rule - best fixed) on the same draws.

Everything here is numpy on plain arrays, so each number can be checked against a table worked by hand
(tests/report/test_headroom.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

THRESHOLD_QUANTILES = tuple(q / 10 for q in range(1, 10))  # a step rule's candidate cuts: deciles of the fit half
LEVEL = 0.95  # two-sided bootstrap intervals
CLUSTER_TOL = 1e-6  # samples whose entropies agree this closely show one image (entropy is a function of the image)


# ---------------------------------------------------------------------------------------------------------------
# fixed ratios and the oracle


def best_fixed(scores: np.ndarray) -> int:
    """The column (ratio) of the highest mean score of ``scores [n, K]``; ties go to the first (smaller ratio)."""
    return int(np.argmax(scores.mean(axis=0)))


def oracle(scores: np.ndarray) -> np.ndarray:
    """``[n]``: each sample's best score over the K ratios."""
    return scores.max(axis=1)


def best_set(scores: np.ndarray) -> np.ndarray:
    """``[n, K]`` bool: the ratios that reach each sample's best score (for 0/1 scores of a sample some ratio answers:
    the ratios that answer it correctly; for a sample every ratio scores alike: all of them)."""
    return scores == scores.max(axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------------------------
# the cross-validated step rule


@dataclass(frozen=True)
class StepRule:
    """Ratio column ``below`` for samples whose feature is < ``threshold``, ``above`` for the rest; without a threshold
    one column for all (the fit half's best fixed ratio). A sample without the feature (NaN) gets ``fallback``."""

    threshold: float | None
    below: int
    above: int
    fallback: int

    def choose(self, feature: np.ndarray) -> np.ndarray:
        """``[n]`` column per sample."""
        feature = np.asarray(feature, dtype=float)
        if self.threshold is None:
            cols = np.full(len(feature), self.above)
        else:
            cols = np.where(feature < self.threshold, self.below, self.above)
        return np.where(np.isnan(feature), self.fallback, cols)


def _best_near(totals: np.ndarray, prior: int) -> int:
    """The column of the highest total; among ties the one nearest ``prior``, then the smaller."""
    tied = np.flatnonzero(totals == totals.max())
    return int(min(tied, key=lambda k: (abs(k - prior), k)))


def fit_step_rule(feature: np.ndarray, scores: np.ndarray) -> StepRule:
    """The step rule of the highest total score on these samples (``feature [n]``, ``scores [n, K]``).

    Candidates: no cut (the best fixed ratio, ``prior``), and a cut at each decile of the feature (the observed value
    at or below it) that leaves samples on both sides, each side taking its own best ratio (ties: the one nearest
    ``prior``, then the smaller). A cut must beat every rule before it strictly (no cut first, then cuts ascending).
    Samples without the feature (NaN) take no part in the fit."""
    known = ~np.isnan(np.asarray(feature, dtype=float))
    prior = best_fixed(scores)
    rule = StepRule(None, prior, prior, prior)
    if not known.any():
        return rule
    f, s = np.asarray(feature, dtype=float)[known], scores[known]
    best_total = s[:, prior].sum()
    for cut in np.unique(np.quantile(f, THRESHOLD_QUANTILES, method="lower")):
        low = f < cut
        if not low.any() or low.all():
            continue
        below, above = _best_near(s[low].sum(axis=0), prior), _best_near(s[~low].sum(axis=0), prior)
        total = s[low, below].sum() + s[~low, above].sum()
        if total > best_total:
            rule, best_total = StepRule(float(cut), below, above, prior), total
    return rule


def cross_validated(feature: np.ndarray, scores: np.ndarray, folds: np.ndarray) -> tuple[np.ndarray, list[StepRule]]:
    """Each sample's score under the rule fit on the other fold: (``[n]`` held-out scores, the rule fit on fold 1
    (scores fold 0), the rule fit on fold 0 (scores fold 1)). ``folds [n]``: 0 or 1 per sample."""
    folds = np.asarray(folds)
    held_out = np.empty(len(scores))
    rules = []
    for scored in (0, 1):
        test = folds == scored
        rule = fit_step_rule(np.asarray(feature)[~test], scores[~test])
        cols = rule.choose(np.asarray(feature)[test])
        held_out[test] = scores[test][np.arange(test.sum()), cols]
        rules.append(rule)
    return held_out, rules


def clusters_by_entropy(entropy: np.ndarray, tol: float = CLUSTER_TOL) -> np.ndarray:
    """``[n]`` image group per sample: samples whose entropies lie within ``tol`` of the previous one (in sorted order)
    share a group (the questions about one image); a sample without an entropy is a group of its own."""
    entropy = np.asarray(entropy, dtype=float)
    groups = np.empty(len(entropy), dtype=int)
    order = np.argsort(entropy, kind="stable")  # NaN last
    current, previous = -1, None
    for i in order:
        h = entropy[i]
        if np.isnan(h) or previous is None or h - previous > tol:
            current += 1
        groups[i], previous = current, (None if np.isnan(h) else h)
    return groups


def clusters_by_image(keys, entropy: np.ndarray, tol: float = CLUSTER_TOL) -> np.ndarray:
    """``[n]`` image group per sample: the samples with one image key (``Prediction.image_key``, a hash of the pixels)
    share a group; those without one (records written before predictions carried it, or a request whose image could
    not be read) are grouped among themselves by entropy (`clusters_by_entropy`). Groups are numbered as
    `clusters_by_entropy` numbers them (ascending by their lowest entropy, NaN last, ties by first sample), so where
    both groupings agree they give the same numbers, and the same halves.

    The key is what identifies an image: on a GPU the entropies of one image's questions can differ past ``tol`` when
    they ran in different batches (the batch moves the features' last bits; the certified split reports its bracket's
    midpoint, which moves with the batch's Lanczos steps)."""
    entropy = np.asarray(entropy, dtype=float)
    keys = [k if isinstance(k, str) and k else None for k in keys]
    if len(keys) != len(entropy):
        raise ValueError(f"clusters_by_image: {len(keys)} keys for {len(entropy)} entropies")
    keyless = np.array([k is None for k in keys], dtype=bool)
    by_entropy = np.full(len(entropy), -1)
    by_entropy[keyless] = clusters_by_entropy(entropy[keyless], tol)
    labels = [("key", k) if k is not None else ("entropy", int(g)) for k, g in zip(keys, by_entropy)]
    first: dict = {}
    for i, label in enumerate(labels):
        h = np.inf if np.isnan(entropy[i]) else entropy[i]
        low, at = first.get(label, (np.inf, i))
        first[label] = (min(low, h), min(at, i))
    number = {label: g for g, label in enumerate(sorted(first, key=first.__getitem__))}
    return np.array([number[label] for label in labels], dtype=int)


def folds_by_cluster(clusters: np.ndarray, seed: int = 0) -> np.ndarray:
    """``[n]`` fold 0 / 1 per sample: the image groups in a seeded random order, alternately 0 and 1, so both
    questions about an image land in one half and the halves hold as many images (one more at most)."""
    ids = np.unique(clusters)
    order = np.random.default_rng(seed).permutation(ids)
    fold_of = {int(c): i % 2 for i, c in enumerate(order)}
    return np.array([fold_of[int(c)] for c in clusters])


# ---------------------------------------------------------------------------------------------------------------
# the paired bootstrap over image groups


def cluster_draws(n_clusters: int, iters: int, seed: int = 0) -> np.ndarray:
    """``[iters, n_clusters]`` indices: each row one resample of the image groups with replacement."""
    return np.random.default_rng(seed).integers(0, n_clusters, size=(iters, n_clusters))


def resampled_means(values: np.ndarray, clusters: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The mean over samples of ``values [n]`` on each resample (``draws`` from `cluster_draws`, over the groups
    0..C-1 of ``clusters``): a group drawn twice counts its samples twice. ``[iters]``."""
    codes = np.unique(clusters, return_inverse=True)[1]
    n_clusters = codes.max() + 1
    sums = np.bincount(codes, weights=np.asarray(values, dtype=float), minlength=n_clusters)  # [C]
    counts = np.bincount(codes, minlength=n_clusters).astype(float)  # [C]
    times = np.stack([np.bincount(row, minlength=n_clusters) for row in draws])  # [iters, C]
    return (times @ sums) / (times @ counts)


def interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of the resampled statistic (NaN resamples left out; NaN when none is left)."""
    samples = np.asarray(samples, dtype=float)
    if np.isnan(samples).all():
        return float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    low, high = np.nanpercentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def points(x: float, signed: bool = True) -> str:
    """An interval's number at one decimal; one that is not 0 but rounds to it gets two significant digits, so an
    interval that excludes 0 (``resolved``) never reads as one that holds it ("[+0.0, +3.0]")."""
    sign = "+" if signed else ""
    text = f"{x:{sign}.1f}"
    return f"{x:{sign}.2g}" if x != 0 and float(text) == 0 else text


@dataclass
class Estimate:
    """A point value with its paired 95% interval."""

    value: float
    low: float
    high: float

    def text(self, unit: str = "", signed: bool = True) -> str:
        return (f"{points(self.value, signed)}{unit} [{points(self.low, signed)}, {points(self.high, signed)}]")

    @property
    def resolved(self) -> bool:
        """The interval excludes 0."""
        return self.low > 0 or self.high < 0


def difference(column: np.ndarray, reference: np.ndarray, clusters: np.ndarray, draws: np.ndarray) -> Estimate:
    """mean(column) - mean(reference) over the samples, with its paired interval over ``draws``."""
    diff = np.asarray(column, dtype=float) - np.asarray(reference, dtype=float)
    return Estimate(float(diff.mean()), *interval(resampled_means(diff, clusters, draws)))


@dataclass
class Captured(Estimate):
    """(method - best fixed) / (rule - best fixed) in percent; ``undefined``: the share of resamples on which the
    rule's headroom was not positive (the fraction is left out of the interval there)."""

    undefined: float = 0.0
    headroom: float = float("nan")  # the rule's point headroom, points


def captured(method: np.ndarray, rule: np.ndarray, reference: np.ndarray, clusters: np.ndarray,
             draws: np.ndarray) -> Captured:
    """How much of the rule's headroom over ``reference`` the method takes, in percent, on the same resamples."""
    gain = np.asarray(method, dtype=float) - reference
    room = np.asarray(rule, dtype=float) - reference
    gains, rooms = resampled_means(gain, clusters, draws), resampled_means(room, clusters, draws)
    with np.errstate(divide="ignore", invalid="ignore"):
        fractions = np.where(rooms > 0, 100 * gains / rooms, np.nan)
    point = 100 * gain.mean() / room.mean() if room.mean() > 0 else float("nan")
    low, high = interval(fractions)
    return Captured(float(point), low, high, float(np.mean(~(rooms > 0))), float(room.mean()))
