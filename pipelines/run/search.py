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
which Tune does not). ASHA's decisions are kept as it makes them (`KeptASHA`): Tune saves its experiment every so
often, so a driver killed after a stop was decided (and logged) would otherwise resume that trial as unfinished and
run it again.

**Running values at rungs, paired.** A searched trial scores itself when the first ``r`` samples of the sweep's
block order (`Requests.keys`: interleaved over the tasks, so every prefix covers every task) are all answered, for
each rung ``r`` of the scheduler, and reports the value with ``samples/scored = r``: the scheduler's time attribute.
Every trial is thus compared at a rung on the same ``r`` samples, and Rel. divides by the baseline's scores on those
same samples (`Objective`): the comparison is paired, and the value at a rung is the same however the blocks were
scheduled. Reports between rungs carry the last value and no ``samples/scored``, so the scheduler skips them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import pyarrow.fs
from ray import tune
from ray.tune.experiment import Trial
from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

from promprune.records import table_keys

from pipelines import mlflow_layout
from pipelines import spec as specs
from pipelines.spec import space

TIME_ATTR = mlflow_layout.SCORED  # the samples a reported running value was computed over: ASHA's time attribute
SEARCH_SUFFIX = "-search"  # the search experiment's name: <the sweep's experiment><SEARCH_SUFFIX>
JOURNAL = "_asha"  # ASHA's decisions as it makes them (`KeptASHA`): <the sweep's blocks folder>/_asha<suffix>.json
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
    """How many trials the search runs (optuna: num_samples; the others: the grid's trials, drawn or listed, whether
    they run as an experiment of their own or, with no scheduler, in one with the fixed trials)."""
    if spec.tune.search == "optuna":
        return spec.tune.num_samples
    return len(specs.parts(spec)[1])


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
    optuna chose, the one conversion at the Tune boundary: its sampled grid values (``config["sampled"]``: a float
    range's values to `space.SIGNIFICANT` digits within its bounds, ``config["ranges"]``; options only for the method
    that takes them) as a `Trial` with the sweep's calibrated values, so its id names what it runs, on the driver and
    in the trial alike. (A config saved before ``ranges`` existed has every float rounded, unbounded.)"""
    if "trial" in config:
        return config["trial"]
    ranges = config.get("ranges")
    sampled = {k: (space.rounded(v) if ranges is None else space.rounded(v, *ranges[k]) if k in ranges else v)
               if isinstance(v, float) else v for k, v in config["sampled"].items()}
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


def scheduler(spec: specs.SweepSpec, total: int, journal: str | None = None):
    """Tune's ASHA over samples scored (`TIME_ATTR`), its decisions kept in the file ``journal`` (`KeptASHA`), or
    None."""
    if spec.tune.scheduler == "none":
        return None
    return KeptASHA(time_attr=TIME_ATTR, metric=spec.tune.metric, mode=spec.tune.mode, max_t=total,
                    grace_period=grace_period(spec, total), reduction_factor=spec.tune.reduction_factor,
                    journal=journal)


def searcher(spec: specs.SweepSpec):
    """Optuna's TPE, seeded (``tune.seed``), or None (the trials are listed: a grid, or random draws)."""
    if spec.tune.search != "optuna":
        return None
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(metric=spec.tune.metric, mode=spec.tune.mode, seed=spec.tune.seed)


def param_space(spec: specs.SweepSpec, phase: Phase, calibrated: dict) -> dict:
    """Tune's param_space for an experiment: its listed `Trial`s (with the calibrated values) as a grid, or, for the
    search of ``tune.search: optuna``, the grid's spaces as Tune's domains (a list: a choice; a one-value list:
    fixed) with the calibrated mu a sampled trial needs and the bounds of its float ranges (`trial_of`)."""
    if phase.searched and spec.tune.search == "optuna":
        spaces = {k: space.parse(v) for k, v in spec.grid.items()}
        return {"sampled": {k: _domain(s) for k, s in spaces.items()}, "calibrated": calibrated,
                "ranges": {k: list(s.args) for k, s in spaces.items() if s.kind in ("uniform", "loguniform")}}
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
    restored callback holds the restored scheduler, and sets its rungs before the trials are added back, with what
    the scheduler's journal (`KeptASHA`) holds beyond them: the experiment's state is saved every so often, the
    journal at each decision."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def get_state(self) -> dict:
        return {"rungs": rung_values(self.scheduler)}

    def set_state(self, state: dict) -> None:
        for bracket, rungs in zip(self.scheduler._brackets, state["rungs"]):
            bracket._rungs = [(m, dict(recorded)) for m, recorded in rungs]
        if isinstance(self.scheduler, KeptASHA):  # (an ASHAScheduler in a state saved before KeptASHA: no journal)
            self.scheduler.load()


def rung_values(asha) -> list:
    """ASHA's rungs, each bracket's ``[(milestone, {trial id: value recorded there})]`` (copies)."""
    return [[(m, dict(recorded)) for m, recorded in bracket._rungs] for bracket in asha._brackets]


class KeptASHA(AsyncHyperBandScheduler):
    """Tune's ASHA whose decisions outlive its driver: each time it records a trial at a rung, it writes its rungs
    and the trials it stopped (each with the result it stopped it on) to ``journal`` (a file in the sweep's storage,
    written whole), before Tune acts on the decision, so before the console and MLflow say it. Tune saves its
    experiment only every so often: a driver killed after a stop, before that save, left the trial unfinished in
    Tune's state (or, optuna's state restored from before it, not there at all) and the rungs without it, and
    ``--resume`` ran it again and judged it anew.

    Its trials are known by the sweep's trial ids (`trial_of`), not Tune's: a trial optuna proposes again after a
    resume (its state restored from before the proposal) is a new Tune trial of the same config. Resumed
    (`SchedulerState.set_state` calls `load`), it has the rungs as they were at the last decision, and a trial it
    had stopped is not run again: it ends as Tune ends a trial it stops (`stop_trial` with the result it was stopped
    on: the scheduler, the searcher and the callbacks are told, as then), before Tune picks a trial to run."""

    def __init__(self, *args, journal: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.journal = journal
        self.stopped: dict[str, dict] = {}  # trial id -> the result this scheduler stopped it on

    def on_trial_add(self, tune_controller, trial) -> None:
        super().on_trial_add(tune_controller, _Named(trial))

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        named, before = _Named(trial), _recorded(self)
        action = super().on_trial_result(tune_controller, named, result)
        stopped = action == TrialScheduler.STOP and result.get(TIME_ATTR, math.inf) < self._max_t  # not its end
        if stopped:
            self.stopped[named.trial_id] = _json_result({**result, "done": True})
        if stopped or _recorded(self) != before:
            self.save()
        return action

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        super().on_trial_complete(tune_controller, _Named(trial), result)

    def on_trial_remove(self, tune_controller, trial) -> None:
        super().on_trial_remove(tune_controller, _Named(trial))

    def choose_trial_to_run(self, tune_controller):
        for trial in tune_controller.get_trials():
            result = self.stopped.get(_Named(trial).trial_id) if trial.status == Trial.PENDING else None
            if result is not None:  # stopped before the driver died
                trial.init_local_path()  # its folder, as Tune makes it for a trial it starts (the results read it)
                trial.update_last_result({**result, "config": trial.config})  # (a result carries its config)
                tune_controller._set_trial_status(trial, Trial.RUNNING)  # stop_trial's path for a trial it stops
                tune_controller.stop_trial(trial)
        return super().choose_trial_to_run(tune_controller)

    def save(self) -> None:
        """The journal, written whole (a temporary file moved into place)."""
        if self.journal is None:
            return
        fs, path = pyarrow.fs.FileSystem.from_uri(self.journal)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        tmp = f"{path}.{os.getpid()}.part"
        with fs.open_output_stream(tmp) as f:
            f.write(json.dumps({"rungs": rung_values(self), "stopped": self.stopped}).encode())
        fs.move(tmp, path)

    def load(self) -> None:
        """The journal's rungs and stopped trials added to what this scheduler holds (nothing when there is none)."""
        if self.journal is None:
            return
        fs, path = pyarrow.fs.FileSystem.from_uri(self.journal)
        if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
            return
        with fs.open_input_stream(path) as f:
            kept = json.loads(f.read())
        for bracket, rungs in zip(self._brackets, kept["rungs"]):
            for (milestone, recorded), (kept_milestone, values) in zip(bracket._rungs, rungs):
                if milestone == kept_milestone:
                    recorded.update(values)
        self.stopped.update(kept["stopped"])


class _Named:
    """What ASHA reads of a Tune trial (its ``trial_id``), as the sweep's trial id."""

    __slots__ = ("trial_id",)

    def __init__(self, trial):
        self.trial_id = trial_of(trial.config).trial_id


def _recorded(asha) -> int:
    return sum(len(recorded) for bracket in asha._brackets for _, recorded in bracket._rungs)


def _json_result(result: dict) -> dict:
    """A Tune result's numbers and strings (what `stopped_by_scheduler` and the recorder read), not its config."""
    return {k: v for k, v in result.items()
            if not k.startswith("config/") and k != "config" and isinstance(v, (int, float, str, bool, type(None)))}


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

        return rel(scores, self.baseline[at])  # NaN: a baseline score of 0 or NaN on these samples


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
