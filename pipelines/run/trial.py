"""One trial: a `Trial` (method, budget, options) over the sweep's requests -> its `TrialResult`.

    sweep.py (the driver, the CLI) -> run/trial.py (this: the trial, a light coordinator in a Tune trial actor) ->
    run/engine.py (its blocks to the sweep's model workers, run/workers.py) -> run/result.py (TrialResult) ->
    recording/recorder.py (MLflow, on the driver)

A sweep builds one `Shared` (the requests in the object store, the plan, the handle of its pool of model workers,
where trials save their blocks) and hands it, with the spec, to every trial; `run_trial` is the Tune function: it
takes its `Trial` from Tune's config, evaluates it on the pool's workers, saving each answered block as it comes back
and resuming from the saved ones, reports its progress to Tune (`TrialProgress`), and ends with its metrics and the
`TrialResult` file as its checkpoint. `pipelines/evaluate.py` runs the same `evaluate` on a `Shared` of its own
(`alone`: a one-trial spec), without Tune.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
from ray import tune

from promprune.eval.scoring import ScoringError
from promprune.records import Request

from pipelines import mlflow_layout, timeline
from pipelines import spec as specs
from pipelines.console import say
from pipelines.run import engine, search
from pipelines.run import resources as planning
from pipelines.run.checkpoints import BlockStore, trial_dir
from pipelines.run.requests import Requests, build_requests_dataset, requests_dataset
from pipelines.run.result import TrialResult, score_table
from pipelines.run.workers import Failover, WorkerPool

# a trial only dispatches blocks and scores: it reserves no core, so that the workers have the machine's (the plan's
# trials_at_once, Tune's max_concurrent_trials, bounds how many run), only memory for lmms-eval and its predictions
TRIAL_RESOURCES = {"cpu": 0, "memory": 256 * 2 ** 20}
# a running score (lmms-eval over the samples answered so far) at most this often, besides the scheduler's milestones
SCORE_EVERY_S = 30.0
# ... and at most this share of the trial's time: each running score scores every sample answered so far, so it takes
# longer as they grow (0.3 s at 2,000 samples, 1 s at 8,000, 2.4 s at 16,000 on a 2-core machine), and the trial
# sends a worker no further block while it scores (`engine.stream`: one block per worker at a time)
SCORE_SHARE = 0.05
# a trial's last report before it raises a `ScoringError`: the driver gives it no retry (`NotRetried`)
SCORING_FAILED = "trial/scoring_failed"
# the same before it raises `engine.WorkersFailed` (the sweep's workers cannot load the model: no try can run)
WORKERS_FAILED = "trial/workers_failed"
NOT_RETRIED = (SCORING_FAILED, WORKERS_FAILED)  # the reports that end a trial's retries (`NotRetried`)


@dataclass
class Shared:
    """What every trial of a sweep shares, built once by the driver: the requests (sealed blocks in the object store),
    the plan (device, workers per trial), the handle of the sweep's pool of model workers (`pool.Pool`), where
    trials save their answered blocks (`checkpoints.sweep_dir`; None: nowhere), and the driver's session (a new one
    per start or `--resume`: what a trial's note of a deterministic scoring error is kept for, `run_trial`)."""

    rows: Requests
    plan: planning.Plan
    pool: object
    blocks: str | None = None
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    block_timeout_s: float | None = None  # resources.block_timeout_s: the engine's deadline for a frozen worker

    def store(self, trial_id: str) -> BlockStore | None:
        """The saved blocks of one trial (None when this evaluation saves none)."""
        return None if self.blocks is None else BlockStore(trial_dir(self.blocks, trial_id))

    def only(self, tasks) -> "Shared":
        """The same, on the requests of ``tasks`` alone (an explicit trial on a subset of the sweep's tasks)."""
        return dataclasses.replace(self, rows=self.rows.only(tasks))


# ----------------------------------------------------------------------------------------------------------------
# one evaluation


def predict(trial: specs.Trial, shared: Shared, *, store: BlockStore | None = None,
            on_block: Callable | None = None) -> pa.Table:
    """The trial's blocks through the engine: the predictions table (`PREDICTION_SCHEMA`), one row per request,
    sorted by (task, doc_id). ``store`` / ``on_block``: see `engine.run`."""
    timeline.mark("first_request", "trial")
    return engine.run(shared.rows, trial, shared.pool, shared.plan.max_actors, store=store, on_block=on_block,
                      block_timeout_s=shared.block_timeout_s)


def evaluate(trial: specs.Trial, spec: specs.SweepSpec, shared: Shared, *, store: BlockStore | None = None,
             on_block: Callable | None = None, score_fn: Callable | None = None) -> TrialResult:
    """Predictions from the engine -> scores (once, centrally; ``spec.bootstrap`` resamples) -> metrics: one
    `TrialResult`."""
    predictions = predict(trial, shared, store=store, on_block=on_block)
    result = TrialResult.scored(predictions, score_fn, bootstrap=spec.bootstrap)
    timeline.mark("trial_scored", "trial")
    return result


@contextlib.contextmanager
def alone(spec: specs.SweepSpec, rows: list[Request] | Requests | None = None,
          run_fn: Callable | None = None) -> Iterator[Shared]:
    """A `Shared` for one evaluation of ``spec`` outside a sweep (Ray connected): its requests (built here unless
    given), its own plan and pool of workers (ended on exit), and the first GPU waited for up to
    ``resources.actor_wait_s`` when it wants GPUs (`planning.NoCapacity` otherwise). ``run_fn`` replaces the model
    call (`workers.Worker`: tests)."""
    first = planning.plan(spec.resources, 1, 1, model=spec.model.pretrained)  # before the rows: a refusal is at once
    if first.note:
        say(first.note)
    if rows is None:
        rows = build_requests_dataset(spec.tasks, spec.limit, spec.generation, spec.resources.batch_size,
                                      video_frames=spec.video_frames)
    elif not isinstance(rows, Requests):
        rows = requests_dataset(rows, spec.resources.batch_size)
    plan = planning.plan(dataclasses.replace(spec.resources, device=first.device), 1, len(rows.blocks))
    capacity = planning.Capacity(plan)
    pool = None
    try:
        capacity.wait(spec.resources.actor_wait_s)
        pool = WorkerPool(spec.model, plan, spec.resources.batch_size, Failover.of(spec.resources), run_fn)
        yield Shared(rows, plan, pool.handle, block_timeout_s=spec.resources.block_timeout_s)
    finally:
        if pool is not None:
            pool.close()
        capacity.release()


# ----------------------------------------------------------------------------------------------------------------
# the trial in Tune


class TrialProgress:
    """What a running trial reports to Tune after each block: ``samples/done`` (of ``samples/total``), and running
    scores (``<task>/<metric>`` over the samples answered so far, the same keys as the final report) when the
    samples reach one of ``score_at`` or `SCORE_EVERY_S` has passed since the last, and the last one's duration
    over `SCORE_SHARE` (scoring then takes at most that share of the trial's time, however many samples it has).
    ``clock``: seconds, monotonic; ``report``: where the reports go (Tune's).

    A searched trial (``objective``: `search.Objective`) scores itself instead at each rung ``r`` of the scheduler,
    once the first ``r`` samples of the sweep's block order are all answered, and reports the search's metric over
    exactly those samples with ``samples/scored = r`` (the scheduler's time attribute): one report per rung, in
    order, also when one block completes the prefix of several (blocks come back in any order), so the scheduler
    judges the trial at every rung and a stop at the first ends it there, whatever the order of the blocks. Between
    rungs its reports carry the last value (NaN before the first), which Tune requires of every result."""

    def __init__(self, total: int, score_at: list[int] | None = None, score_every_s: float = SCORE_EVERY_S,
                 objective: search.Objective | None = None, clock: Callable[[], float] = time.monotonic,
                 report: Callable[[dict], None] | None = None):
        self.total, self.score_at = total, sorted(score_at or [])
        self.clock, self._report = clock, report
        self.base_every = self.every = score_every_s
        self.last = clock()
        self.objective, self.value = objective, math.nan
        self.rungs = sorted(objective.rungs) if objective is not None else []
        self.prefix = search.AnsweredPrefix(objective.keys) if objective is not None else None

    def __call__(self, done: int, tables: list) -> None:
        metrics = {"samples/done": float(done), "samples/total": float(self.total)}
        if self.objective is not None:
            for at_rung in self._at_rungs(tables):  # each a report of its own: Tune's scheduler judges each
                self.send({**metrics, **at_rung})
            return
        due = [m for m in self.score_at if m <= done]
        if done < self.total and (due or self.clock() - self.last >= self.every):
            self.score_at = [m for m in self.score_at if m > done]
            began = self.clock()
            metrics.update(running_scores(tables))
            self.last = self.clock()
            self.every = max(self.base_every, (self.last - began) / SCORE_SHARE)
        self.send(metrics)

    def send(self, metrics: dict) -> None:
        """One report (to Tune unless ``report`` was given)."""
        (self._report or tune.report)(metrics)

    def _at_rungs(self, tables: list) -> list[dict]:
        """The search's metric: fresh (with ``samples/scored``) at each rung not yet scored that the answered prefix
        has reached, lowest first, each over exactly that rung's samples; else the last value (one report)."""
        answered = self.prefix.update(tables)
        due = [r for r in self.rungs if r <= answered]
        if not due:
            return [{self.objective.metric: self.value}]
        self.rungs = [r for r in self.rungs if r > answered]
        predictions, reports = pa.concat_tables(tables), []
        for rung in due:
            scores = score_table(predictions, partial=True, only=set(self.objective.keys[:rung]))
            self.value = self.objective.value(scores, rung)
            reports.append({**flat_scores(scores), self.objective.metric: self.value, search.TIME_ATTR: float(rung)})
        return reports


    def report_not_retried(self, marker: str) -> None:
        """The trial's last report, just before it raises an error that no retry would mend (`NOT_RETRIED`, what the
        driver's `NotRetried` looks for): its `ScoringError` (``marker``: `SCORING_FAILED`) or
        `engine.WorkersFailed` (`WORKERS_FAILED`). The report holds the marker (no ``samples/done``: nothing for the
        recorder's progress), with the search's last value where there is one (Tune requires the searcher's metric in
        every result; the scheduler skips a report without ``samples/scored``)."""
        report = {marker: 1.0}
        if self.objective is not None:
            report[self.objective.metric] = self.value
        self.send(report)


class NotRetried(tune.Callback):
    """On the driver: a trial whose report says it failed the way that fails on every try is not retried by Tune:
    its scoring (`SCORING_FAILED`, `run_trial`'s last report before it raises the `ScoringError`), or the sweep's
    model workers, which could not load the model (`WORKERS_FAILED`, before `engine.WorkersFailed`: the pool keeps
    its error, so every try of every trial fails on it, after a new trial actor started for nothing).

    Ray Tune 2.60 has no retry rule per exception: `FailureConfig(max_failures)` counts every error of a trial alike
    (the trial's exception reaches the driver as a `RayTaskError`; `Trial.handle_error` counts it and
    `Trial.should_recover` compares the count with the trial's `max_failures`), raising no exception type skips that,
    and a callback hears of an error only once the retry is decided (`on_trial_recover`, after the trial is requeued).
    A function trainable's report waits until the driver has taken it, so the report arrives before the error: this
    callback then sets that trial's `max_failures` (the public attribute of Tune's `Trial` that `should_recover`
    reads) to 0, the error ends the trial at once (ERROR: `on_trial_error`, its MLflow run FAILED and the summary's
    failed trials, as after the retries before), and there the trial's own `max_failures` is put back, so the state
    Tune saves (and a `--resume` restores) keeps the spec's retries for the trial's next session (a resume starts a
    new pool of workers, whose loads are tried again). No trial actor is started for it again."""

    def __init__(self):
        self._kept: dict[str, int] = {}  # trial id -> its max_failures, while its error is on its way

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info):
        if any(result.get(m) for m in NOT_RETRIED) and trial.trial_id not in self._kept:
            self._kept[trial.trial_id] = trial.max_failures
            trial.max_failures = 0

    def on_trial_error(self, iteration: int, trials: list, trial, **info):
        if trial.trial_id in self._kept:
            trial.max_failures = self._kept.pop(trial.trial_id)


# its name before 2026-12-08: Tune pickles a run's callbacks in its tuner.pkl, so a run started before the rename is
# resumed (`Tuner.restore`, `pipelines.run.state.check_tune_state`) only while this name unpickles
ScoringErrorsNotRetried = NotRetried


def running_scores(tables: list) -> dict[str, float]:
    """lmms-eval's metrics over the predictions so far, flat (``<task>/<metric>``)."""
    return flat_scores(score_table(pa.concat_tables(tables), partial=True))


def flat_scores(scores: dict) -> dict[str, float]:
    """``{task: {metric: v}}`` -> ``{"task/metric": v}``, numbers only (what Tune and MLflow take)."""
    return {f"{task}/{name}": float(v) for task, ms in scores.items() for name, v in ms.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_trial(config: dict, *, spec: specs.SweepSpec, shared: Shared,
              objective: search.Objective | None = None) -> None:
    """The Tune function: evaluate the trial Tune's config carries (`search.trial_of`), saving its blocks
    (`Shared.store`) and resuming from them, reporting progress (a searched trial: the search's metric at each rung,
    ``objective``), and finally its metrics with the `TrialResult` file as the checkpoint.

    A `ScoringError` (a task's scoring that fails the same way on every try) is not retried by Tune: the trial says
    so in a last report (`SCORING_FAILED`) before it raises, and the driver's `NotRetried` takes the
    trial's retries away, so the error ends it at once (ERROR, recorded as every failed trial is). It is also noted
    beside the trial's blocks for the driver's session (`Shared.session`): a retry that happens all the same (an
    experiment restored from a Tune state saved without that callback) raises it again at once, neither scoring
    again nor sending an LLM judge's requests again; a `--resume` scores it again. `engine.WorkersFailed` (the
    sweep's workers could not load the model: the pool's error, the same for every try of every trial) is not retried
    either (`WORKERS_FAILED`, the same way, not noted: a `--resume` starts new workers). Other failures (a lost
    worker or node, the trial's process killed) are retried as they come (`tune.max_failures`)."""
    trial = search.trial_of(config)
    tid = trial.trial_id
    store = shared.store(tid)
    noted = None if store is None else store.failure(shared.session)
    if noted is not None:  # this trial's scoring failed so in this session already: the same error, not retried
        raise ScoringError(noted)
    warm_scoring()
    if trial.tasks:  # an explicit trial on a subset of the sweep's tasks
        shared = shared.only(trial.tasks)
    started = time.time()
    timeline.tag(trial=tid)
    timeline.mark("trial_begin", "trial")
    progress = TrialProgress(len(shared.rows.keys), objective=objective)
    try:
        result = evaluate(trial, spec, shared, store=store, on_block=progress)
    except ScoringError as exc:
        if store is not None:
            store.note_failure(shared.session, str(exc))
        progress.report_not_retried(SCORING_FAILED)  # the driver takes its retries away before the error comes
        raise
    except engine.WorkersFailed:
        progress.report_not_retried(WORKERS_FAILED)  # no try can run (the pool keeps its error): no retry either
        raise
    result.metrics.update({"trial/started_at": started, "trial/wall_s": time.time() - started,
                           "samples/done": float(result.predictions.num_rows)})
    final = dict(result.metrics)
    if objective is not None:  # the search's metric over every sample: what the scheduler and optuna see last
        final.update({objective.metric: objective.value(result.scores, len(objective.keys)),
                      search.TIME_ATTR: float(len(objective.keys))})
    with tempfile.TemporaryDirectory() as d:
        result.write(Path(d) / mlflow_layout.PREDICTIONS_ARTIFACT)
        tune.report(final, checkpoint=tune.Checkpoint.from_directory(d))
    timeline.mark("trial_reported", "trial")
    timeline.tag(trial=None)


_SCORING_WARMED = threading.Event()


def warm_scoring() -> None:
    """Import lmms-eval's scoring in the background, once per trial process, while the first blocks are answered
    (Tune reuses a trial's process for the next trials: only the first pays it)."""
    if not _SCORING_WARMED.is_set():
        _SCORING_WARMED.set()
        threading.Thread(target=_import_scoring, daemon=True).start()


def _import_scoring() -> None:
    import promprune.eval  # noqa: F401 - first: it defers lmms-eval's optional `import evaluate` (eval.deferred)
    import lmms_eval.api.model  # noqa: F401 - what `promprune.eval.score` imports first
    import lmms_eval.evaluator  # noqa: F401


def trainable(spec: specs.SweepSpec, shared: Shared, objective: search.Objective | None = None):
    """`run_trial` as Tune runs it: the sweep's spec and shared parts bound, no core reserved."""
    fn = tune.with_parameters(run_trial, spec=spec, shared=shared, objective=objective)
    return tune.with_resources(fn, TRIAL_RESOURCES)
