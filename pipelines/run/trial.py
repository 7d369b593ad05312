"""One trial: (model, method, budget, options) over the sweep's requests -> its `TrialResult`.

    sweep.py (the driver, the CLI) -> run/trial.py (this: the trial, in a Tune trial actor) -> run/engine.py (Ray
    Data over the actors) -> run/result.py (TrialResult) -> recording/recorder.py (MLflow, on the driver)

A sweep builds one `Shared` (the requests in the object store, the plan, the sweep's ledger, where trials save
their blocks) and hands it to every trial; `run_trial` is the Tune function: it evaluates the trial, saving each
answered block as it comes back and resuming from the saved ones, reports its progress to Tune (`TrialProgress`),
and ends with its metrics and the `TrialResult` file as its checkpoint. `pipelines/evaluate.py` runs the same
`evaluate` on a `Shared` of its own (`alone`), without Tune.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
from ray import tune

from promprune.records import Request

from pipelines import mlflow_layout, timeline
from pipelines import spec as specs
from pipelines.config import Resources
from pipelines.console import say
from pipelines.run import engine, search
from pipelines.run import resources as planning
from pipelines.run.checkpoints import BlockStore, trial_dir
from pipelines.run.requests import Requests, build_requests_dataset, requests_dataset
from pipelines.run.result import TrialResult, score_table
from pipelines.weights import ModelSource

# a trial only drives Ray Data and scores: it reserves no core, so that its actors have the machine's (the plan's
# trials_at_once, Tune's max_concurrent_trials, bounds how many run), only memory for lmms-eval and its predictions
TRIAL_RESOURCES = {"cpu": 0, "memory": 256 * 2 ** 20}
# a running score (lmms-eval over the samples answered so far) at most this often, besides the scheduler's milestones
SCORE_EVERY_S = 30.0


@dataclass
class EvalConfig:
    """One evaluation: what to run and on how many actors."""

    model: ModelSource = field(default_factory=ModelSource)
    method: str | None = None  # None: the unpruned model
    budget: int | None = None
    options: dict = field(default_factory=dict)  # method options (mu, tau, diversity, ...)
    tasks: list = field(default_factory=lambda: ["easyvqa_yesno", "easyvqa_open"])  # the offline benchmarks
    limit: int | None = None  # per-task sample cap
    video_frames: int = 8  # frames sampled from each clip of a video task (promprune.models.video.DEFAULT_FRAMES)
    generation: dict = field(default_factory=dict)  # generate() kwargs over each task's own; {}: the task's own
    resources: Resources = field(default_factory=Resources)  # actors, GPUs and CPUs per actor, batch size, failover
    bootstrap: int = 0  # resamples for 95% CIs of each task's primary metrics (<metric>_ci_low/_ci_high); 0: none

    def job(self, run_fn: Callable | None = None) -> engine.Job:
        return engine.Job(self.model, self.method, self.budget, self.options, self.resources.batch_size, run_fn)

    def failover(self) -> engine.Failover:
        return engine.Failover(self.resources.block_attempts, self.resources.block_timeout_s)


@dataclass
class Shared:
    """What every trial of a sweep shares, built once by the driver: the requests (sealed blocks in the object store),
    the plan (device, actors per trial), the sweep's `engine.Ledger` (None: one per evaluation), where trials save
    their answered blocks (`checkpoints.sweep_dir`; None: nowhere), and ``run_fn`` replacing the model call
    (`engine.Job`: benchmarks and tests)."""

    rows: Requests
    plan: planning.Plan
    ledger: object = None
    blocks: str | None = None
    run_fn: Callable | None = None

    def store(self, trial_id: str) -> BlockStore | None:
        """The saved blocks of one trial (None when this evaluation saves none)."""
        return None if self.blocks is None else BlockStore(trial_dir(self.blocks, trial_id))


# ----------------------------------------------------------------------------------------------------------------
# one evaluation


def predict(cfg: EvalConfig, shared: Shared, *, store: BlockStore | None = None,
            on_block: Callable | None = None) -> pa.Table:
    """The blocks through the engine: the predictions table (`PREDICTION_SCHEMA`), one row per request, sorted by
    (task, doc_id). ``store`` / ``on_block``: see `engine.run`."""
    timeline.mark("first_request", "trial")
    return engine.run(shared.rows, cfg.job(shared.run_fn), shared.plan, cfg.failover(), store=store,
                      on_block=on_block, ledger=shared.ledger)


def evaluate(cfg: EvalConfig, shared: Shared, *, store: BlockStore | None = None, on_block: Callable | None = None,
             score_fn: Callable | None = None) -> TrialResult:
    """Predictions from the engine -> scores (once, centrally) -> metrics: one `TrialResult`."""
    predictions = predict(cfg, shared, store=store, on_block=on_block)
    result = TrialResult.scored(predictions, score_fn, bootstrap=cfg.bootstrap)
    timeline.mark("trial_scored", "trial")
    return result


@contextlib.contextmanager
def alone(cfg: EvalConfig, rows: list[Request] | Requests | None = None,
          run_fn: Callable | None = None) -> Iterator[Shared]:
    """A `Shared` for one evaluation outside a sweep (Ray connected): its requests (built here unless given), its own
    plan, and the first GPU waited for up to ``resources.actor_wait_s`` when it wants GPUs (`planning.NoCapacity`
    otherwise); the autoscaler request is withdrawn on exit."""
    first = planning.plan(cfg.resources, 1, 1, model=cfg.model.pretrained)  # before the rows: a refusal is at once
    if first.note:
        say(first.note)
    if rows is None:
        rows = build_requests_dataset(cfg.tasks, cfg.limit, cfg.generation, cfg.resources.batch_size,
                                      video_frames=cfg.video_frames)
    elif not isinstance(rows, Requests):
        rows = requests_dataset(rows, cfg.resources.batch_size)
    plan = planning.plan(dataclasses.replace(cfg.resources, device=first.device), 1, len(rows.blocks))
    capacity = planning.Capacity(plan)
    try:
        capacity.wait(cfg.resources.actor_wait_s)
        yield Shared(rows, plan, run_fn=run_fn)
    finally:
        capacity.release()


# ----------------------------------------------------------------------------------------------------------------
# the trial in Tune


class TrialProgress:
    """What a running trial reports to Tune after each block: ``samples/done`` (of ``samples/total``), and running
    scores (``<task>/<metric>`` over the samples answered so far, the same keys as the final report) when the
    samples reach one of ``score_at`` or `SCORE_EVERY_S` has passed since the last.

    A searched trial (``objective``: `search.Objective`) scores itself instead at each rung ``r`` of the scheduler,
    once the first ``r`` samples of the sweep's block order are all answered, and reports the search's metric over
    exactly those samples with ``samples/scored = r`` (the scheduler's time attribute); between rungs its reports
    carry the last value (NaN before the first), which Tune requires of every result."""

    def __init__(self, total: int, score_at: list[int] | None = None, score_every_s: float = SCORE_EVERY_S,
                 objective: search.Objective | None = None):
        self.total, self.score_at = total, sorted(score_at or [])
        self.every, self.last = score_every_s, time.monotonic()
        self.objective, self.value = objective, math.nan
        self.rungs = sorted(objective.rungs) if objective is not None else []
        self.prefix = search.AnsweredPrefix(objective.keys) if objective is not None else None

    def __call__(self, done: int, tables: list) -> None:
        metrics = {"samples/done": float(done), "samples/total": float(self.total)}
        if self.objective is not None:
            metrics.update(self._at_rung(tables))
        else:
            due = [m for m in self.score_at if m <= done]
            if done < self.total and (due or time.monotonic() - self.last >= self.every):
                self.score_at = [m for m in self.score_at if m > done]
                metrics.update(running_scores(tables))
                self.last = time.monotonic()
        tune.report(metrics)

    def _at_rung(self, tables: list) -> dict:
        """The search's metric: fresh (with ``samples/scored``) when the answered prefix has reached a rung not yet
        scored (the highest such), else the last value."""
        answered = self.prefix.update(tables)
        due = [r for r in self.rungs if r <= answered]
        if not due:
            return {self.objective.metric: self.value}
        rung = due[-1]
        self.rungs = [r for r in self.rungs if r > rung]
        scores = score_table(pa.concat_tables(tables), partial=True, only=set(self.objective.keys[:rung]))
        self.value = self.objective.value(scores, rung)
        return {**flat_scores(scores), self.objective.metric: self.value, search.TIME_ATTR: float(rung)}


def running_scores(tables: list) -> dict[str, float]:
    """lmms-eval's metrics over the predictions so far, flat (``<task>/<metric>``)."""
    return flat_scores(score_table(pa.concat_tables(tables), partial=True))


def flat_scores(scores: dict) -> dict[str, float]:
    """``{task: {metric: v}}`` -> ``{"task/metric": v}``, numbers only (what Tune and MLflow take)."""
    return {f"{task}/{name}": float(v) for task, ms in scores.items() for name, v in ms.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_trial(config: dict, *, source: ModelSource, shared: Shared, settings: dict,
              objective: search.Objective | None = None) -> None:
    """The Tune function: evaluate one trial (`search.trial_of(config)`), saving its blocks (`Shared.store`) and
    resuming from them, reporting progress (a searched trial: the search's metric at each rung, ``objective``), and
    finally its metrics with the `TrialResult` file as the checkpoint. ``settings``: the sweep's `EvalConfig` fields
    other than the trial's own."""
    trial_dict = search.trial_of(config)
    tid = trial_dict["trial_id"]
    trial = specs.Trial.from_dict(trial_dict)
    if trial.tasks:  # an explicit trial on a subset of the sweep's tasks
        shared = Shared(shared.rows.only(trial.tasks), shared.plan, shared.ledger, shared.blocks, shared.run_fn)
    started = time.time()
    timeline.tag(trial=tid)
    timeline.mark("trial_begin", "trial")
    cfg = EvalConfig(model=source, method=trial.method, budget=trial.budget, options=trial.options, **settings)
    progress = TrialProgress(len(shared.rows.keys), config.get("score_at"), objective=objective)
    result = evaluate(cfg, shared, store=shared.store(tid), on_block=progress)
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


def trainable(spec: specs.SweepSpec, source: ModelSource, shared: Shared, objective: search.Objective | None = None):
    """`run_trial` as Tune runs it: the sweep's settings and shared parts bound, no core reserved."""
    settings = dict(tasks=spec.tasks, limit=spec.limit, video_frames=spec.video_frames, generation=spec.generation,
                    bootstrap=spec.bootstrap, resources=spec.resources)
    fn = tune.with_parameters(run_trial, source=source, shared=shared, settings=settings, objective=objective)
    return tune.with_resources(fn, TRIAL_RESOURCES)
