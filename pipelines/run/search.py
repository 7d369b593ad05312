"""Ray Tune as a search: which trials a sweep searches, in which order it runs them, and the Tune pieces that search
(a searcher, a scheduler, what a searched trial computes while it runs).

A sweep runs one or two Tune experiments under its state (`pipelines/run/state.py`):

1. the *fixed* trials: the baseline and the explicit `trials:` (and, when nothing needs the search's metric inside
   the trials, the grid's trials too: the plain grid of every sweep before searches existed, one experiment);
2. the *search* (`<experiment>-search`), when a trial must know the search's metric while it runs: a scheduler
   (`tune.scheduler: asha`) stops weak trials at rungs of samples seen, and optuna (`tune.search: optuna`) learns
   from each trial's final value. With `tune.metric: rel` a trial divides by the baseline's scores, so the baseline
   finishes first (experiment 1) and each searched trial gets its answers.

Each experiment is restored by `--resume` on its own (Tune keeps optuna's state; `SchedulerState` keeps ASHA's,
which Tune does not).

**Running values at rungs, paired.** A searched trial scores itself when the first ``r`` samples of the sweep's
block order (`Requests.keys`: interleaved over the tasks, so every prefix covers every task) are all answered, for
each rung ``r`` of the scheduler, and reports the value with ``samples/scored = r``: the scheduler's time attribute.
Every trial is thus compared at a rung on the same ``r`` samples, and Rel. divides by the baseline's scores on those
same samples (`Objective`): the comparison is paired, and the value at a rung is the same however the blocks were
scheduled. Reports between rungs carry the last value and no ``samples/scored``, so the scheduler skips them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ray import tune

from promprune.records import table_keys

from pipelines import mlflow_layout
from pipelines import spec as specs
from pipelines.spec import space

TIME_ATTR = mlflow_layout.SCORED  # the samples a reported running value was computed over: ASHA's time attribute
SEARCH_SUFFIX = "-search"  # the search experiment's name: <the sweep's experiment><SEARCH_SUFFIX>
BASELINE_ID = specs.trial_id(None, None, {})  # the unpruned trial whose scores Rel. divides by


@dataclass
class Phase:
    """One Tune experiment of a sweep: its name suffix, the trials known before it starts (a grid's or a random
    search's; empty for optuna), and whether it is the search (a searcher, a scheduler, an `Objective`)."""

    suffix: str
    trials: list
    searched: bool = False


def phases(spec: specs.SweepSpec) -> list[Phase]:
    """The experiments a sweep runs, in order (`pipelines.spec.parts` decides which trial is which)."""
    baseline, searched, explicit = specs.parts(spec)
    if not specs.metric_in_trials(spec):
        return [Phase("", specs.expand(spec))]
    ids = {t.trial_id for t in searched}
    fixed = baseline + [t for t in explicit if t.trial_id not in ids]
    return ([Phase("", fixed)] if fixed else []) + [Phase(SEARCH_SUFFIX, searched, searched=True)]


def searched_trials(spec: specs.SweepSpec) -> int:
    """How many trials the search runs (optuna: num_samples; the others: the trials drawn or listed)."""
    if spec.tune.search == "optuna":
        return spec.tune.num_samples
    return sum(len(p.trials) for p in phases(spec) if p.searched)


# ----------------------------------------------------------------------------------------------------------------
# a trial in Tune's config


_CATALOG = None


def _catalog() -> specs.MethodCatalog:
    global _CATALOG
    if _CATALOG is None:
        _CATALOG = specs.MethodCatalog()
    return _CATALOG


def trial_of(config: dict) -> specs.Trial:
    """The trial a Tune config runs: ``config["trial"]`` as the sweep listed it (`param_space`), or, for a trial
    optuna chose, the one conversion at the Tune boundary: its sampled grid values (``config["sampled"]``: floats to
    `space.SIGNIFICANT` digits, options only for the method that takes them) as a `Trial` with the sweep's calibrated
    values, so its id names what it runs, on the driver and in the trial alike."""
    if "trial" in config:
        return config["trial"]
    sampled = {k: space.rounded(v) if isinstance(v, float) else v for k, v in config["sampled"].items()}
    method, budget = sampled.pop("method"), sampled.pop("budget")
    accepted = _catalog().options(method)
    options = {k: v for k, v in sampled.items() if accepted is None or k in accepted}
    return specs.Trial(method, budget, options).with_calibration(config.get("calibrated") or {})


# ----------------------------------------------------------------------------------------------------------------
# the Tune pieces


def rungs(spec: specs.SweepSpec, total: int) -> list[int]:
    """ASHA's milestones below ``total`` samples (a trial's): grace_period x reduction_factor^k, as Ray's
    `AsyncHyperBandScheduler` (one bracket) places them. Empty without a scheduler."""
    if spec.tune.scheduler == "none":
        return []
    grace, rf = grace_period(spec, total), spec.tune.reduction_factor
    count = int(math.log(total / grace) / math.log(rf) + 1)  # Ray's MAX_RUNGS for bracket 0
    return sorted({int(grace * rf ** k) for k in range(count) if grace * rf ** k < total})


def grace_period(spec: specs.SweepSpec, total: int) -> int:
    """The first rung in samples: the spec's, or with ``auto`` a trial's samples / reduction_factor^2 rounded up (so
    two rungs come before the end: ASHA keeps 1/rf of the trials at each; rounded down, a third rung would fall just
    short of the end, e.g. 66, 198 and 594 of 600, where stopping saves nothing)."""
    if spec.tune.grace_period != specs.AUTO:
        return int(spec.tune.grace_period)
    return max(1, math.ceil(total / spec.tune.reduction_factor ** 2))


def check_rungs(spec: specs.SweepSpec, total: int) -> str | None:
    """A problem with the scheduler for trials of ``total`` samples (None: fine)."""
    if spec.tune.scheduler == "asha" and grace_period(spec, total) >= total:
        return (f"tune.grace_period: {spec.tune.grace_period} samples is not below a trial's {total}, so ASHA "
                "could never stop a trial (lower it, or leave it auto)")
    return None


def stopped_by_scheduler(result: dict) -> bool:
    """Whether a trial's last result is the one the scheduler stopped it on: marked done, at a rung short of all its
    samples (a finished trial's last result carries its checkpoint and every sample)."""
    return bool(result.get("done")) and TIME_ATTR in result and result[TIME_ATTR] < result.get("samples/total", 0)


def scheduler(spec: specs.SweepSpec, total: int):
    """Tune's ASHA over samples scored (`TIME_ATTR`), or None."""
    if spec.tune.scheduler == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr=TIME_ATTR, metric=spec.tune.metric, mode=spec.tune.mode, max_t=total,
                         grace_period=grace_period(spec, total), reduction_factor=spec.tune.reduction_factor)


def searcher(spec: specs.SweepSpec):
    """Optuna's TPE, seeded (``tune.seed``), or None (the trials are listed: a grid, or random draws)."""
    if spec.tune.search != "optuna":
        return None
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(metric=spec.tune.metric, mode=spec.tune.mode, seed=spec.tune.seed)


def param_space(spec: specs.SweepSpec, phase: Phase, calibrated: dict) -> dict:
    """Tune's param_space for an experiment: its listed `Trial`s (with the calibrated values) as a grid, or, for the
    search of ``tune.search: optuna``, the grid's spaces as Tune's domains (a list: a choice; a one-value list:
    fixed) with the calibrated mu a sampled trial needs (`trial_of`)."""
    if phase.searched and spec.tune.search == "optuna":
        return {"sampled": {k: _domain(space.parse(v)) for k, v in spec.grid.items()}, "calibrated": calibrated}
    return {"trial": tune.grid_search([t.with_calibration(calibrated) for t in phase.trials])}


def _domain(s: space.Space):
    values = s.finite
    if s.kind in (space.FIXED, space.AXIS, "choice") and len(values) == 1:
        return values[0]
    if s.kind in (space.AXIS, "choice"):
        return tune.choice(values)
    lo, hi = s.args
    if s.kind == "randint":
        return tune.randint(lo, hi + 1)  # Tune's upper bound is excluded, the spec's included
    return tune.uniform(lo, hi) if s.kind == "uniform" else tune.loguniform(lo, hi)


class SchedulerState(tune.Callback):
    """Keeps ASHA's rungs (the values recorded at each) with the experiment's state: Tune saves its callbacks' states
    and its searcher's, not its scheduler's, so a resumed search would start ASHA with empty rungs and let run what
    it would have stopped. The scheduler and this callback are pickled together in Tune's ``tuner.pkl``, so the
    restored callback holds the restored scheduler, and sets its rungs before the trials are added back."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def get_state(self) -> dict:
        return {"rungs": [[(m, dict(recorded)) for m, recorded in bracket._rungs]
                          for bracket in self.scheduler._brackets]}

    def set_state(self, state: dict) -> None:
        for bracket, rungs in zip(self.scheduler._brackets, state["rungs"]):
            bracket._rungs = [(m, dict(recorded)) for m, recorded in rungs]


# ----------------------------------------------------------------------------------------------------------------
# what a searched trial computes while it runs


@dataclass
class Objective:
    """The search's metric inside a trial: ``metric`` (``rel`` or ``<task>/<metric>``) over the first ``r`` samples of
    ``keys`` (the sweep's block order) at each rung ``r``, and over all at the end. For Rel. the baseline's scores on
    the same samples (``baseline``: {r: scores}, the end under ``len(keys)``), computed once on the driver."""

    metric: str
    keys: list
    rungs: list = field(default_factory=list)
    baseline: dict | None = None

    def value(self, scores: dict, at: int) -> float:
        """The metric from a trial's scores over the first ``at`` samples (NaN when undefined)."""
        if self.metric != "rel":
            task, name = self.metric.split("/")
            return float(scores.get(task, {}).get(name, math.nan))
        from pipelines.run.result import rel

        return rel(scores, self.baseline[at])  # NaN: a baseline score of 0 on these samples


def baseline_scores(keys: list[str], rungs: list[int], predictions) -> dict[int, dict]:
    """The baseline's lmms-eval scores on the first ``r`` samples of ``keys`` for each rung, and on all of them
    (``predictions``: its predictions table)."""
    from pipelines.run.result import score_table

    return {r: score_table(predictions, partial=r < len(keys), only=set(keys[:r]))
            for r in sorted(set(rungs) | {len(keys)})}


class AnsweredPrefix:
    """How many of the first samples of ``keys`` (the sweep's block order) are all answered, as blocks come back in
    any order: the samples a rung's running value may be computed over."""

    def __init__(self, keys: list[str]):
        self.keys, self.length = keys, 0
        self.answered: set[str] = set()
        self.seen = 0  # tables already read

    def update(self, tables: list) -> int:
        """Read the tables not seen yet (each a block of predictions with ``task`` and ``doc_id``); the prefix."""
        for table in tables[self.seen:]:
            self.answered.update(table_keys(table))
        self.seen = len(tables)
        while self.length < len(self.keys) and self.keys[self.length] in self.answered:
            self.length += 1
        return self.length
