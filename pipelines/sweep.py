"""Run a sweep spec on Ray Tune; the trials share the sweep's warm model workers; results go to MLflow.

    python pipelines/sweep.py                                   # sweeps/quickstart.yaml, offline, local Ray
    python pipelines/sweep.py --config sweeps/table1_llava15.yaml --set limit=20
    python pipelines/sweep.py --config sweeps/quickstart.yaml --resume          # finish an interrupted sweep
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python pipelines/sweep.py --config sweeps/nightly.yaml \
        --regression-threshold 0.02

Setup -> run -> cleanup:

1. setup: validate the spec completely (no model load), connect to Ray (MLflow's store is opened meanwhile), plan
   the resources (`pipelines/run/resources.py`: GPU or CPU, how many workers a trial uses and the pool holds, trials
   at once) and ask the autoscaler for them, build the request rows once on the driver, wait for the first GPU node
   when the spec wants GPUs (exit 2 after `resources.actor_wait_s`), publish the model weights to the object store
   once (see pipelines/weights.py) and start the sweep's model workers (`pipelines/run/workers.py`: they load while
   the rest is set up), open the MLflow parent run, calibrate mu when a trial asks.
2. run: Ray Tune runs one trial per grid point (`tune.grid_search` over the expanded trial list), or searches
   (`pipelines/run/search.py`: seeded random draws, optuna's TPE, ASHA stopping weak trials at rungs of samples;
   then the baseline and explicit trials run first, as an experiment of their own), `plan.trials_at_once` at a
   time, retrying failed trials (`FailureConfig`; a scoring error that is the same on every try is not retried, and
   scored again only by `--resume`, nor is a trial the workers could not serve, their model not loaded
   (`engine.WorkersFailed`): `trial.run_trial`, `trial.NotRetried`).
   A trial (`pipelines/run/trial.py`) is a light coordinator (`pipelines/run/engine.py`): it takes its `Trial` from
   Tune's config and sends its blocks to the idle workers the sweep's pool grants (the pool grows with what trials
   lease; pending workers are the autoscaler's demand), predictions streamed back and saved block by block beside
   the Tune experiment (`pipelines/run/checkpoints.py`),
   progress (samples done, running scores) reported to Tune as they come; a retried or resumed trial generates only
   the blocks it has not saved. Its `TrialResult` (one parquet file: predictions, scores, metrics) is its final Tune
   checkpoint; the driver (and only the driver) logs each finished trial as an MLflow child run, uploading that file
   as it is.
3. cleanup: Rel. against the unpruned baseline, the optional nightly regression check, a summary table (with each
   method's paired difference to the best other, and per (mu, tau) search, among trials alike in all else, the line
   `best rel <v> at mu=<m> tau=<t>; <S> samples generated`) and the command that opens the MLflow UI; the workers
   end (their GPUs free) and the autoscaler request is withdrawn.

`--resume` restores the Tune experiment(s): finished trials are not run again, unfinished and errored ones continue
from their saved blocks, a search keeps its searcher's and its scheduler's state, and the same MLflow parent run
continues; a `--resume` of a sweep that finished (every trial finished, nothing waiting for the store) says so and
exits 0 without starting Ray (`finished_run`). One driver per sweep: `main` takes the run's `DriverLock`
(pipelines/run/state.py) before Ray starts, so
a `--resume` of a run whose driver is alive exits 2 naming it; a new run gets its own experiment name
(`<sweep>-<UTC time>`, `-2` ... within the same second) and log (`outputs/logs/<experiment>.log`).

A sweep run as a Ray job keeps nothing in Ray's per-job copy of the working directory: with no MLflow store or Tune
storage named, it uses `~/promprune/` on the head (`pipelines/paths.py`) and says so in one line.

The parts live in `pipelines/run/` (its `__init__` lists them); a trial reads trial.py (the trial in its Tune
actor) -> engine.py (its blocks to the workers) -> workers.py (the sweep's pool of model workers) -> result.py
(TrialResult) -> `pipelines/recording/` (the driver's MLflow logging and the console's summary). This file is the
driver: setup, the Tune run, the summary, the CLI.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # run from a checkout: its packages first, whichever checkout pip installed (an editable install of another clone
    # would otherwise run its `pipelines` and `promprune` under this file); not from site-packages, which would then
    # come before the standard library
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(_root, "pyproject.toml")):
        sys.path.insert(0, _root)
    # run as a script: refused in about a second, before the imports below load Ray and torch (10 s and more): a
    # spec file too large to be one or that cannot be read, a --resume whose run's driver is alive
    # (pipelines/frontdoor.py)
    from pipelines.frontdoor import not_started_on_interrupt, refuse_early

    not_started_on_interrupt()  # a Ctrl-C during these checks and the imports: NOT_STARTED, exit 130 (a traceback)
    refuse_early(sys.argv[1:])

import argparse
import contextlib
import dataclasses
import functools
import math
import pickle
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import ray
from ray import tune

from promprune.records import Request, key_task

from pipelines import calibration, mlflow_layout, paths, plugins, preflight
from pipelines.frontdoor import EXIT_INTERRUPTED, NOT_STARTED, add_spec_args
from pipelines.console import progress, quiet, say
from pipelines import spec as specs
from pipelines.spec import space
from pipelines import timeline
from pipelines.run import disk, pool_watch, search, trial
from pipelines.run import resources as planning
from pipelines.recording import tracking
from pipelines.recording.callback import RecorderHook, attached, callbacks_counted_without_integrations
from pipelines.recording.console import (SweepConsole, best_line, best_metrics, best_trials, paired_lines, parent_best,
                                         summary_table)
from pipelines.recording.recorder import SweepRecorder
from pipelines.recording.view import SweepView
from pipelines.run import checkpoints
from pipelines.run.checkpoints import sweep_dir
from pipelines.run.ray_connect import QUIET_ENV, RayUnreachable, client_address_problem, connect
from pipelines.run.requests import Requests, build_requests_dataset, built_on_driver, requests_dataset
from pipelines.run.state import TUNE_STATE, DriverLock, check_tune_state, driver_lock, fingerprint, launch_command, \
    load_state, outbox_dir, restore_options, resume_command, resumed_state, save_state, spec_fingerprint, \
    storage_root, unreadable_tune_state, weights_sha256
from pipelines.run.workers import Failover, WorkerPool
from pipelines.weights import prepare_model, share

# exit codes: 1 some trial failed, 2 bad input (spec, model, tasks, store, Ray address, disk space) or the worker
# pool lost (stopped, resumable), 3 a nightly
# regression, 4 every trial ran but some are not in MLflow yet (the store did not answer), 130 interrupted (Ctrl-C)
EXIT_TRIALS_FAILED, EXIT_BAD_INPUT, EXIT_REGRESSION, EXIT_UNLOGGED = 1, 2, 3, 4  # EXIT_INTERRUPTED: frontdoor's

# ----------------------------------------------------------------------------------------------------------------
# setup


def _threshold(text: str) -> float:
    """``--regression-threshold``: a finite number >= 0 (NaN turned the check off, a negative one flagged every
    trial)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (a drop in Rel., e.g. 0.02 = 2 points), got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = add_spec_args(argparse.ArgumentParser(description="Run a sweep spec on Ray Tune and log it to MLflow."))
    p.add_argument("--address", default=None,
                   help="Ray address (default: RAY_ADDRESS, else a local Ray; a --resume without it keeps the run's)")
    p.add_argument("--regression-threshold", type=_threshold, default=None,
                   help="nightly: fail (exit 3) and tag the run when a trial's Rel. drops more than this "
                        "below the previous finished run of the same resolved spec (a --resume without it keeps the "
                        "run's)")
    p.add_argument("--validate-only", action="store_true", help="check the spec and list its trials, run nothing")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray, Tune and lmms-eval output here instead of in outputs/logs/<experiment>.log")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# run


@dataclass
class SweepOutcome:
    parent_run_id: str
    records: dict  # trial id -> {trial, metrics, scores, predictions (pa.Table), error, stopped}
    regressions: list
    experiment_path: str
    generated: int = 0  # samples answered by every trial, those a scheduler stopped included
    paired: list = field(default_factory=list)  # console lines: methods' Rel. differences with paired intervals
    unlogged: list = field(default_factory=list)  # trials whose writes are not in MLflow yet (the store is down)
    resume: str = ""  # the command that continues the sweep (and sends what is not in MLflow yet)
    best: str | None = None  # the console's last line(s): each (mu, tau) search's best (`best_line`)
    regression_note: str | None = None  # what the regression check compared with, or why with nothing (None: no check)

    @property
    def failed(self) -> list[str]:
        return [tid for tid, r in self.records.items() if r["error"] is not None]


def run_sweep(spec: specs.SweepSpec, *, resume: str | dict | None = None, run_fn: Callable | None = None,
              regression_threshold: float | None = None, rows: Requests | list[Request] | None = None,
              command: dict | None = None, lock: DriverLock | None = None) -> SweepOutcome:
    """Setup -> Tune -> MLflow; Ray must already be initialized. `run_fn`/`rows` replace the model call/rows.

    `command`: the command line the sweep was started (or is resumed) with, as `state.launch_command` keeps it (the
    spec file, --set overrides, --regression-threshold, --address: what the printed resume command repeats).
    `resume`: the run to continue, as the state `pipelines.run.state.resumed_state` loaded and checked (what `main`
    passes), or its experiment name / 'latest' (checked here: it must resolve to exactly the spec it
    started with, SpecError otherwise). `lock`: the run's `DriverLock`, held by the caller (`main` takes it before
    Ray starts); without one, the sweep takes it here (SpecError when the run's driver is alive)."""
    began = time.time()  # the parent run spans the whole sweep, setup (rows, weights, first-use training) included
    timeline.mark("sweep_begin", "driver", t=began)
    try:
        state = resumed_state(spec, resume) if isinstance(resume, str) else resume  # before any expensive work
        with contextlib.ExitStack() as held:
            lock = lock or held.enter_context(driver_lock(spec, state))  # one driver per sweep experiment
            return _run_sweep(spec, began, resume=state, run_fn=run_fn, regression_threshold=regression_threshold,
                              rows=rows, command=command, experiment=lock.experiment)
    finally:
        timeline.mark("sweep_end", "driver")


def _run_sweep(spec: specs.SweepSpec, began: float, *, resume, run_fn, regression_threshold, rows,
               command, experiment: str) -> SweepOutcome:
    storage = storage_root(spec)
    state = resume  # the run's saved state (None: a new run)
    trials = specs.expand(spec)
    n_trials = planned_trials(spec, trials)
    # the device is known before the blocks: a GPU node the autoscaler must add boots while the rows are built
    # (raises NoCapacity here, in seconds, for a 7B-class model on a cluster that has and can add no GPU)
    first = planning.plan(spec.resources, n_trials, 1, spec.tune.max_concurrent_trials, model=spec.model.pretrained)
    capacity = planning.Capacity(first)
    if capacity.plan.note:
        say(capacity.plan.note)
    # where an actor fits now (the CPUs, a GPU node up) and the driver builds the rows itself, the workers start
    # before the rows are built: their imports and model loading (~10 s on 2 cores, the quickstart's longest chain)
    # overlap the build. Rows built in Ray tasks need the CPUs the workers would hold (a deadlock on a small
    # cluster), and a GPU node still to boot is waited for after the build, which its boot overlaps: both keep the
    # order rows, then workers
    early = capacity.probe is None and (rows is not None or built_on_driver(spec.tasks, spec.limit))
    pool = _start_workers(spec, first, run_fn, experiment) if early else None
    try:
        t0 = time.perf_counter()
        rows = rows if rows is not None else build_requests_dataset(spec.tasks, spec.limit, spec.generation,
                                                                    spec.resources.batch_size,
                                                                    video_frames=spec.video_frames)
        if not isinstance(rows, Requests):
            rows = requests_dataset(rows, spec.resources.batch_size)
        say(f"{len(rows.keys)} request rows in {len(rows.blocks)} blocks, built once for all trials "
            f"({time.perf_counter() - t0:.1f}s)")
        timeline.mark("rows_built", "driver")
        problem = search.check_rungs(spec, len(rows.keys))
        if problem:
            raise specs.SpecError([problem], spec.name)
        short = disk.check_free(_writes_to(spec), len(rows.keys), n_trials)  # the samples are known now
        if short:
            raise disk.DiskFull(short)
        plan = planning.plan(dataclasses.replace(spec.resources, device=first.device), n_trials, len(rows.blocks),
                             spec.tune.max_concurrent_trials)
        say(f"sweep {spec.name} v{spec.version}: {_trials_line(spec, len(trials), len(rows.keys))}, "
            f"{plan.trials_at_once} at a time, each asking for {plan.max_actors} actor(s) "
            + (f"of {plan.gpus:g} GPU" if plan.on_gpu else "on the CPU"))
        waited = capacity.wait(spec.resources.actor_wait_s)
        if waited >= 1:
            say(f"the first GPU node joined after {waited:.0f}s")
        if pool is None:
            pool = _start_workers(spec, plan, run_fn, experiment)
        else:
            pool.replan(plan)  # the pool's size for the blocks there are
        with pool_watch.Watch(experiment, pool.handle):  # its death stops the sweep, resumable (calibration, Tune)
            return _run_tune(spec, began, trials, rows, plan, storage, state, resume, pool, regression_threshold,
                             command, experiment)
    finally:
        if pool is not None:
            pool.close()  # the workers end with the sweep: their GPUs are free, nothing asks the autoscaler for more
        capacity.release()


def _start_workers(spec: specs.SweepSpec, plan: planning.Plan, run_fn: Callable | None,
                   experiment: str) -> WorkerPool:
    """The sweep's pool of model workers (`pipelines/run/workers.py`), its first workers started now: they import and
    load the model (the weights published to the object store once) while the driver builds the rows (where an actor
    fits at once) and sets up MLflow and Tune."""
    source = spec.model
    if spec.resources.share_weights:
        t0 = time.perf_counter()
        source = share(source, on_gpu=plan.on_gpu, in_process=planning.started_here())
        say(f"weights published to the object store once ({time.perf_counter() - t0:.1f}s)")
        timeline.mark("weights_published", "driver")
    pool = WorkerPool(source, plan, spec.resources.batch_size, Failover.of(spec.resources), run_fn, sweep=experiment)
    pool.warm(plan.pool_size)
    return pool


def planned_trials(spec: specs.SweepSpec, listed: list | None = None) -> int:
    """The trials a sweep runs: its listed ones (``listed``: `specs.expand` already called), and for an optuna search
    its proposals (``num_samples``): the most it runs, as a proposal of a trial already run runs none."""
    listed = specs.expand(spec) if listed is None else listed
    return len(listed) + (spec.tune.num_samples if spec.tune.search == "optuna" else 0)


def trial_counts(spec: specs.SweepSpec, listed: int, ran: int, proposed: int) -> dict[str, int]:
    """The parent run's trial counts: ``trials/total``, the distinct trials the sweep ran (``ran``: its records, the
    param ``trials`` and the console's ``[k/N]`` count the same), and for an optuna search ``trials/proposed``, its
    proposals (``proposed``; ``num_samples`` once it ended), and ``trials/repeated``, those that named a trial the
    sweep already ran or was running (the same values after rounding, or options the method drops: none run again),
    so that ``trials/total`` = the ``listed`` trials + ``trials/proposed`` - ``trials/repeated``."""
    counts = {mlflow_layout.TRIALS_TOTAL: ran}
    if spec.tune.search == "optuna":
        counts.update({mlflow_layout.TRIALS_PROPOSED: proposed,
                       mlflow_layout.TRIALS_REPEATED: max(0, listed + proposed - ran)})
    return counts


def repeats_line(counts: dict[str, int]) -> str:
    """The console's (and the parent run's description's) line on an optuna search's repeated proposals."""
    repeated, proposed = counts[mlflow_layout.TRIALS_REPEATED], counts[mlflow_layout.TRIALS_PROPOSED]
    return (f"optuna proposed {proposed} trial(s), {repeated} of them one the sweep had already run (the same values "
            "after rounding, or options the method drops): not run again (each said above). The sweep ran "
            f"{counts[mlflow_layout.TRIALS_TOTAL]} distinct trial(s) (the parent run's trials/total and param trials; "
            "trials/proposed and trials/repeated beside them)")


def _writes_to(spec: specs.SweepSpec) -> list[str]:
    """Where a sweep writes: Tune's storage, the MLflow store, the log's folder (`disk.check_free`, `DiskWatch`)."""
    return [storage_root(spec), tracking.tracking_uri(), str(paths.outputs_dir())]


def _trials_line(spec: specs.SweepSpec, known: int, samples: int) -> str:
    """``12 trials`` or, for a search, what it searches and how (the console's first line about the sweep)."""
    tune_spec = spec.tune
    if not specs.metric_in_trials(spec) and tune_spec.search == "grid":
        return f"{known} trials"
    searched = search.searched_trials(spec)
    what = "proposal(s)" if tune_spec.search == "optuna" else "trial(s)"  # (a repeated proposal runs no trial)
    how = f"{tune_spec.search} search of {searched} {what} for the {tune_spec.mode} {tune_spec.metric}"
    rungs = search.rungs(spec, samples)
    if rungs:
        how += (f", ASHA stopping the weakest at {', '.join(map(str, rungs))} of {samples} samples "
                f"(reduction factor {tune_spec.reduction_factor:g})")
    fixed = known - (0 if tune_spec.search == "optuna" else searched)
    return how + (f", after {fixed} fixed trial(s)" if fixed else "")


def _run_tune(spec, began, trials, rows, plan, storage, state, resume, pool: WorkerPool, regression_threshold,
              command, experiment: str) -> SweepOutcome:
    client = tracking.client()
    keep = None if resume is None else state["experiment"]
    for dead in tracking.mark_dead_runs(client, storage, spec.name, keep=keep):
        say(f"note: the earlier run {dead} of this sweep died without finishing; its MLflow parent run is "
            "now marked KILLED")
    driver = {"host": socket.gethostname(), "pid": os.getpid()}
    n_trials = planned_trials(spec, trials)
    optuna = spec.tune.search == "optuna"  # its distinct trials are known at its end: the param `trials` then
    resolved = tracking.model_params(spec, plan.on_gpu)  # what the workers run: on the parent and on every trial run
    if resume is None:
        parent_id = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec),
                                         {"model": spec.model.pretrained, "tasks": ",".join(spec.tasks),
                                          "limit": spec.limit, **({} if optuna else {"trials": n_trials}),
                                          "bootstrap": spec.bootstrap, **resolved,
                                          **tracking.own_primary_metrics(spec)},
                                         started=began,
                                         view=SweepView.of(spec, trials))
        state = {"parent_run_id": parent_id, "storage_path": storage, "experiment": experiment,
                 "fingerprint": fingerprint(spec), "spec_yaml": specs.dump_resolved(spec),
                 "command": command or {}, "tracking_uri": tracking.tracking_uri()}
        if (sha := weights_sha256(spec)) is not None:  # testbed:llava's: its calibrated mu is tied to them
            state["weights_sha256"] = sha
    else:
        parent_id = state["parent_run_id"]
        tracking.reopen(client, parent_id, spec.name, SweepView.of(spec, trials))  # its own view, saved again
        if command:  # how this attempt was started (its spec checked to be the run's): what a later resume repeats
            state = {**state, "command": command}
    if "calibrated" not in state:  # mu: calibrate trials: measured once per sweep (a resume reuses the values)
        try:
            state["calibrated"] = calibrate(spec, trials, pool, client, parent_id)
        except ray.exceptions.RayActorError as e:
            dead = pool_watch.dead(experiment, pool.handle)
            if not dead:
                if resume is None:
                    tracking.finish(client, parent_id, "FAILED")
                raise
            # the pool died: the state saved without `calibrated`, so that the resume calibrates again
            save_state(storage, {**state, "driver": driver})
            stopped = pool_watch.message(dead, resume_command(state))
            client.set_tag(parent_id, mlflow_layout.INTERRUPTED, tracking.interrupted_note(resume_command(state)))
            tracking.finish(client, parent_id, "KILLED")
            raise pool_watch.PoolLost(stopped) from e
        except BaseException:  # nothing saved yet to resume: the parent run ends FAILED, not RUNNING for ever
            if resume is None:
                tracking.finish(client, parent_id, "FAILED")
            raise
    save_state(storage, {**state, "driver": driver})
    blocks = sweep_dir(state["storage_path"], state["experiment"])
    per_trial = len(rows.keys)
    console = SweepConsole(n_trials, _samples_per_trial(rows, trials), per_trial,
                           saved=lambda tid: checkpoints.saved_samples(blocks, tid),
                           workers=lambda: pool.state(timeout_s=5.0))
    recorder = SweepRecorder(spec, parent_id, console, model_params=resolved,
                             outbox=outbox_dir(storage, state["experiment"]), datasets=task_datasets(spec, rows.keys))
    exp_path = f"{state['storage_path']}/{state['experiment']}"
    recorder.parent(params=search_params(spec))
    try:
        # what every trial shares: the requests, the plan, the pool of model workers (both experiments)
        shared = trial.Shared(rows, plan, pool.handle, blocks, block_timeout_s=spec.resources.block_timeout_s)
        # Tune's callbacks (RecorderHook) hand the trials' events to this recorder; Tune's usage tag of those
        # callbacks is recorded without importing Ray's logger integrations (wandb: seconds)
        proposed = 0  # optuna's proposals this driver saw end (a resumed search: those of the earlier drivers too)
        with progress(sum(console.samples_of.values()) + per_trial * (n_trials - len(trials)), spec.name) as bar, \
                attached(recorder), callbacks_counted_without_integrations():
            console.bar = bar
            timeline.mark("tune_start", "driver")
            _INTERRUPTED.clear()  # (a test's earlier sweep in this process may have had one)
            for phase in search.phases(spec):
                _stop_if_signalled(phase, state)  # a stop during the experiment before: not the next one
                dead = pool_watch.lost(experiment)  # (the calibration ran while it died, or the experiment before)
                if dead:
                    raise pool_watch.PoolLost(pool_watch.message(dead, resume_command(state)))
                objective = _objective(spec, phase, rows, recorder)
                if phase.searched and objective is None:
                    break  # the baseline failed: said, and the sweep exits 1
                trainable = trial.trainable(spec, shared, objective)
                pool.hold(plan.pool_size)  # the workers wait for this experiment's first trial
                tuner = _tuner(trainable, spec, phase, plan, state, recorder, resume=resume is not None)
                try:
                    with handlers_kept():  # Tune's SIGINT handler ends with its experiment (and its records'
                        grid = tuner.fit()  # reconciling): a later Ctrl-C stops at once
                        seen = _reconcile(recorder, grid, phase.trials,
                                          spec.tune.num_samples if not phase.trials else None)
                    proposed += len(seen) if phase.searched and optuna else 0
                except SweepInterrupted as e:
                    dead = pool_watch.lost(experiment)
                    if dead:
                        raise pool_watch.PoolLost(pool_watch.message(dead, resume_command(state))) from None
                    full = disk.tripped(state["experiment"])  # the watch stopped it: a disk ran low, or unwritable
                    if full:
                        raise disk.DiskFull(disk.full_message(full, resume_command(state),
                                                              disk.tripped_cause(state["experiment"]))) from None
                    raise SweepInterrupted(str(e), resume_command(state)) from None
            _stop_if_signalled(None, state)  # during the last experiment, its trials all finished
            timeline.mark("tune_end", "driver")
        recorder.finalize_rel()
        recorder.count_generated()
        paired = paired_lines(spec, recorder.records)  # here: lmms-eval's output goes to the log
        bests = best_trials(spec, recorder.records)  # one per (mu, tau) search
        best = parent_best(bests)  # the parent's best/*: a sweep's only search's
        regressions, regression_note = [], None
        unlogged = recorder.unlogged(store_wait_s())  # the trials' runs in before the regression check reads them
        if regression_threshold is not None and not unlogged:  # against the previous run of this resolved spec
            regressions, regression_note = tracking.regression_check(
                client, parent_id, spec.name, spec.version, regression_threshold,
                spec_fingerprint(specs.dump_resolved(spec)), spec)
        summary = [line for line in [best_line(spec, recorder.records, recorder.generated, bests)] if line]
        counts = trial_counts(spec, len(trials), len(recorder.records), proposed)
        repeats = [repeats_line(counts)] if counts.get(mlflow_layout.TRIALS_REPEATED) else []
        for line in repeats:
            say(line)
        recorder.parent(params={"trials": len(recorder.records)} if optuna else None,
                        metrics={**counts,
                                 mlflow_layout.TRIALS_FAILED: sum(r["error"] is not None
                                                                  for r in recorder.records.values()),
                                 "trials/stopped": len(recorder.stopped), mlflow_layout.GENERATED: recorder.generated,
                                 **best_metrics(best)},
                        tags={mlflow_layout.NOTE: "\n\n".join([spec.description, *paired, *summary,
                                                                *repeats]).strip(),
                              **({mlflow_layout.BEST_TRIAL: best["trial_id"]} if best else {})})
        recorder.end_parent("FINISHED")
        recorder.unlogged(store_wait_s())
    except BaseException:
        recorder.end_interrupted(resume_command(state))
        recorder.unlogged(5.0)
        raise
    finally:
        unlogged = recorder.close()  # what is not in MLflow once the write in flight, if any, has ended
    if not unlogged and not any(r["error"] is not None for r in recorder.records.values()):
        checkpoints.remove(blocks)  # every trial finished, in MLflow and in its Tune checkpoint: a failed trial's
        # blocks are kept, so that `--resume` runs it again from them (generating only the blocks with no file)
    return SweepOutcome(parent_id, recorder.records, regressions, exp_path, recorder.generated, paired,
                        unlogged=unlogged, resume=resume_command(state), best=summary[0] if summary else None,
                        regression_note=regression_note)


def finished_run(state: dict) -> str | None:
    """What a ``--resume`` of a run that finished says (None: there is something to resume): its MLflow parent run
    FINISHED with every trial finished (`trials/failed` 0) and no write waiting for the store (an outbox). A resume
    runs again a finished sweep's failed trials only, and sends what its outbox kept; one that finished cleanly
    restarted Ray and appended its trial counts to the parent run a second time."""
    from mlflow.exceptions import MlflowException

    if (outbox_dir(state["storage_path"], state["experiment"]) / "outbox.json").is_file():
        return None
    try:
        run = tracking.client().get_run(state["parent_run_id"])
    except (MlflowException, OSError):  # a store that does not answer: the resume sends what it can
        return None
    failed = run.data.metrics.get(mlflow_layout.TRIALS_FAILED)
    if run.info.status != "FINISHED" or failed is None or failed > 0:
        return None
    total = run.data.metrics.get(mlflow_layout.TRIALS_TOTAL)
    when = run.data.tags.get(mlflow_layout.FINISHED_AT, "")
    url = tracking.ui_url(run.data.tags.get(mlflow_layout.SWEEP), run.info.run_id)
    return (f"--resume {state['experiment']}: the sweep finished{f' at {when}' if when else ''} (MLflow parent run "
            f"{run.info.run_id} FINISHED, {'its' if total is None else f'{total:.0f}'} trials all finished): "
            "nothing to resume, nothing run or written. To run the sweep again, leave out --resume.\n\n"
            + mlflow_layout.open_results(url))


def failed_note(outcome: SweepOutcome) -> str:
    """What the console says of the trials that failed: which, and the command that runs them again (a resumed
    sweep runs its errored trials again, its finished ones not: a worker or the pool killed, a node lost)."""
    failed = outcome.failed
    return (f"{len(failed)} trial(s) failed: {', '.join(failed)} (the error of each above, and in MLflow). Once the "
            f"cause is fixed, run them again, the finished trials kept, with:\n  {outcome.resume}")


def store_wait_s() -> float:
    """How long the end of a sweep waits for a store that does not answer before it says which trials are not in
    MLflow yet (``PROMPRUNE_STORE_WAIT_S``, default 60 s; the writes stay in the outbox for `--resume`)."""
    return float(os.environ.get("PROMPRUNE_STORE_WAIT_S", "60"))


def task_datasets(spec: specs.SweepSpec, keys: list[str]) -> list[dict]:
    """Each task as an MLflow dataset input: its name, a digest of the documents the sweep uses, their number."""
    import hashlib

    by_task: dict[str, list[str]] = {}
    for key in keys:
        by_task.setdefault(key_task(key), []).append(key)
    return [{"name": task, "digest": hashlib.sha256("\n".join(sorted(ks)).encode()).hexdigest()[:16],
             "source": {"task": task, "limit": spec.limit, "harness": "lmms-eval"},
             "profile": {"num_rows": len(ks)}} for task, ks in by_task.items()]


def search_params(spec: specs.SweepSpec) -> dict[str, str]:
    """The parent run's params saying how the trials were chosen: searcher, scheduler, metric and each searched
    field's space."""
    out = {"search": spec.tune.search, "scheduler": spec.tune.scheduler}
    if spec.tune.search != "grid" or spec.tune.scheduler != "none":
        out.update({"search_metric": f"{spec.tune.mode} {spec.tune.metric}", "search_samples": spec.tune.num_samples})
    out.update({f"space.{k}": space.parse(v).describe() for k, v in spec.grid.items()})
    return {k: str(v)[:500] for k, v in out.items()}


def _objective(spec: specs.SweepSpec, phase: search.Phase, rows: Requests,
               recorder: SweepRecorder) -> search.Objective | None:
    """What the search's trials compute while they run (None for fixed trials, and when the search cannot run:
    Rel. without the baseline's answers)."""
    if not phase.searched:
        return None
    keys = rows.keys
    rungs = search.rungs(spec, len(keys))
    if spec.tune.metric != mlflow_layout.REL:
        return search.Objective(spec.tune.metric, keys, rungs)
    base = recorder.records.get(search.BASELINE_ID)
    if base is None or base["predictions"] is None:
        say(f"[search skipped] the search optimizes {mlflow_layout.REL}, which divides by the baseline's scores, and "
            "the baseline trial did not finish")
        return None
    return search.Objective(spec.tune.metric, keys, rungs, search.baseline_scores(keys, rungs, base["predictions"]))


def _samples_per_trial(rows: Requests, trials: list) -> dict[str, int]:
    """Each trial's samples (an explicit trial may run on a subset of the tasks)."""
    per_task: dict[str, int] = {}
    for key in rows.keys:
        per_task[key_task(key)] = per_task.get(key_task(key), 0) + 1
    return {t.trial_id: sum(n for task, n in per_task.items() if not t.tasks or task in t.tasks) for t in trials}


def calibrate(spec: specs.SweepSpec, trials: list, pool: WorkerPool, client, parent_id: str) -> dict:
    """The median of each prominence metric that a `mu: calibrate` trial needs, measured with the sweep's model on
    the calibration images (on one of the sweep's model workers, which holds the model already); logged on the
    parent run."""
    metrics = calibration.metrics_to_calibrate(trials)
    if not metrics:
        return {}
    t0 = time.perf_counter()
    budget = calibration.budget_of(trials)
    found = calibration.shipped_results(calibration.settings(pool.source, spec.calibration, metrics, budget,
                                                             pool.plan.on_gpu))
    origin = "measured" if found is None else "shipped"
    if found is None:
        found = pool.calibrate(spec.calibration, metrics, budget)
    medians = {m: round(float(r["median"]), 4) for m, r in found.items()}
    used = found[metrics[0]]["n"]  # the images measured: all of a folder holding fewer than calibration.n
    tracking.log_metrics(client, parent_id, {**{calibration.MEDIAN_PREFIX + m: v for m, v in medians.items()},
                                             calibration.IMAGES_METRIC: used})
    asked = "" if used == spec.calibration.n else f" of calibration.n={spec.calibration.n}"
    client.log_param(parent_id, "calibration_images", f"{spec.calibration.images} (n={used}{asked}, "
                                                      f"seed={spec.calibration.seed})")
    client.log_param(parent_id, "calibration_source", origin)
    client.log_dict(parent_id, {m: r["values"] for m, r in found.items()}, "calibration_values.json")
    how = (f"{time.perf_counter() - t0:.1f}s" if origin == "measured" else
           f"read from {calibration.SHIPPED.name}: measured once with these weights and settings")
    say(f"mu calibrated on {used} images ({how}): "
        + ", ".join(f"{m} median {v:.4f}" for m, v in medians.items()))
    return medians


def _tuner(trainable, spec: specs.SweepSpec, phase: search.Phase, plan: planning.Plan, state: dict, recorder,
           resume: bool):
    """One experiment of the sweep (`search.phases`): its listed trials as a grid, or optuna's search; the
    scheduler when it is the search. A resumed sweep restores the experiment as it was (trials, searcher, the
    scheduler's rungs) when it had started."""
    storage, name = state["storage_path"], state["experiment"] + phase.suffix
    path, files = disk.tune_storage(storage)  # a local storage's files written whole (a full disk leaves the old)
    if resume and tune.Tuner.can_restore(f"{path}/{name}", storage_filesystem=files):
        say(f"resuming {storage}/{name}: finished trials are kept, the others continue from their saved blocks")
        # the same param_space: Tune keeps the `Trial`s of its config as placeholders, resolved from it
        space = search.param_space(spec, phase, state["calibrated"])
        restore = functools.partial(tune.Tuner.restore, f"{path}/{name}", trainable, resume_unfinished=True,
                                    resume_errored=True, storage_filesystem=files)
        try:
            try:
                return restore(param_space=space)
            except ValueError as exc:  # an optuna search saved before its config carried its ranges' bounds
                if "ranges" not in space or "param_space" not in str(exc):
                    raise
                return restore(param_space={k: v for k, v in space.items() if k != "ranges"})
        except (pickle.UnpicklingError, EOFError) as exc:  # (a pickle cut short is refused before Ray starts)
            raise specs.SpecError([unreadable_tune_state(f"{storage}/{name}/{TUNE_STATE}", None,
                                                         f"{type(exc).__name__}: {exc}", state)], "--resume") from None
    watch = disk.DiskWatch(state["experiment"], _writes_to(spec))
    # the sweep's Pool actor dead: stopped as a full disk stops it (by `pool_watch.Watch`, a thread of the driver,
    # which also watches a restored experiment; this stopper is its fallback where Tune's stop handler is not installed)
    lost = pool_watch.PoolWatch(state["experiment"])
    # a ScoringError or WorkersFailed: no Tune retry; a Ctrl-C marked (Tune takes it, `StopMarker`)
    callbacks = [RecorderHook(), watch, lost, trial.NotRetried(), StopMarker()]
    journal = f"{sweep_dir(storage, state['experiment'])}/{search.JOURNAL}{phase.suffix}.json"
    scheduler = search.scheduler(spec, recorder.console.per_trial, journal) if phase.searched else None
    if scheduler is not None:
        callbacks.append(search.SchedulerState(scheduler))
    run_config = tune.RunConfig(
        name=name, storage_path=path, storage_filesystem=files, callbacks=callbacks,
        stop=tune.stopper.CombinedStopper(watch, lost),
        verbose=0,  # Tune's tables are wide; RecorderHook prints one line per trial start and end instead
        failure_config=tune.FailureConfig(max_failures=spec.tune.max_failures),
    )
    searcher = search.searcher(spec) if phase.searched else None
    tune_config = tune.TuneConfig(
        # a trial is a light coordinator (the model lives in the pool's workers): its process serves the next one
        max_concurrent_trials=plan.trials_at_once, reuse_actors=True, scheduler=scheduler,
        search_alg=searcher, num_samples=spec.tune.num_samples if searcher is not None else 1)
    return tune.Tuner(trainable, param_space=search.param_space(spec, phase, state["calibrated"]),
                      tune_config=tune_config, run_config=run_config)


class SweepInterrupted(RuntimeError):
    """Tune stopped before every trial finished (Ctrl-C, SIGTERM): the state is saved, `--resume` continues."""

    def __init__(self, message: str, resume: str = ""):
        super().__init__(message)
        self.resume = resume  # the command that finishes the sweep


def _reconcile(recorder: SweepRecorder, grid, trials: list, searched: int | None = None) -> list[str]:
    """Log any trial the callback did not see (finished before an interruption, restored by --resume): from its
    checkpoint, its error, or, stopped by the scheduler, its last result. Returns the trial id of each Tune trial
    that ended (for an optuna search: one per proposal, a repeated proposal's id again).

    A trial without a result (never started, or stopped without error, checkpoint or the scheduler's stop) means
    Tune was interrupted. ``trials``: the experiment's listed trials; ``searched``: for an optuna search, how many
    trials it must have run.
    """
    seen = []
    for result in grid:
        if not result.config or ("trial" not in result.config and "sampled" not in result.config):
            continue  # a trial Tune never started (interrupted early)
        trial = search.trial_of(result.config).to_dict()  # the recorder's view of the trial
        record = recorder.records.get(trial["trial_id"])
        if record is not None and record["error"] is None:
            seen.append(trial["trial_id"])
            continue
        if result.error is not None:
            recorder.record_error(trial, str(result.error))
        elif result.checkpoint is not None:
            recorder.record(trial, result.checkpoint)
        elif search.stopped_by_scheduler(result.metrics):
            recorder.record_stopped(trial, result.metrics)
        else:
            continue
        seen.append(trial["trial_id"])
    unfinished = [t.trial_id for t in trials if t.trial_id not in recorder.records]
    if searched is not None and len(seen) < searched:
        unfinished.append(f"{searched - len(seen)} searched trial(s)")
    if unfinished:
        raise SweepInterrupted(f"{len(unfinished)} trial(s) did not finish: {', '.join(unfinished)}")
    return seen


# ----------------------------------------------------------------------------------------------------------------
# the CLI


def generation_plan(spec: specs.SweepSpec) -> str:
    """What each task will generate with: its lmms-eval generation_kwargs, the spec's `generation` laid over them,
    and the bridge's default for what neither sets (what --validate-only shows)."""
    from promprune.eval.generation import generate_kwargs

    lines = ["generation per task (the task's lmms-eval generation_kwargs, the spec's `generation` over them):"]
    for task in spec.tasks:
        kwargs, until = generate_kwargs(preflight.task_generation(spec, task))
        shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        lines.append(f"  {task}: {shown}" + (f", stop at {until}" if until else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    timeline.mark("process_start", "driver", t=timeline.process_started())
    _TERMINATED.clear()  # (a test's earlier sweep in this process may have had one)
    stop_on_sigterm()  # from the start: a SIGTERM while the spec is checked stops as Ctrl-C does, exit 130
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    environ = dict(os.environ)  # as started: the spec's plugins are added to it below (a resume adds them itself)
    args = parse_args(argv)
    try:  # everything a user can get wrong, in seconds, before Ray starts and before any MLflow run exists
        # a Ray job: its records go where they outlive Ray's package copy of the checkout, named by absolute paths
        if problems := paths.relative_in_job() or [p for p in [paths.home_problem()] if p]:
            raise specs.SpecError(problems, "the Ray job's environment")
        if where := paths.job_defaults_line():
            print(where, flush=True)
        spec = specs.load(args.config, args.overrides)  # imports the spec's plugins (their methods are checked)
        if problems := paths.relative_storage_in_job(spec.tune.storage_path):  # a job's, from its file or --set
            raise specs.SpecError(problems, args.config)
        specs.check_command(spec, "sweep", args.config)  # a spec for another entry point (fig2_concentration.py)
        plugins.activate(spec.plugins, spec.include_path)  # here and in every Ray worker started after this
        # --validate-only checks the spec: what this machine lacks (data, a model) is a warning there, not a refusal
        lacking = preflight.check_or_raise(spec, args.config, spec_only=args.validate_only)
        resumed = None if args.resume is None else resumed_state(spec, args.resume, environ)  # the one resume check
        if resumed is not None and (problems := preflight.check_resumed_run(resumed) or check_tune_state(resumed)):
            raise specs.SpecError(problems, f"--resume {resumed['experiment']}")
        restored = [] if resumed is None else restore_options(args, resumed)  # its --regression-threshold, ...
        if not args.validate_only and (problem := client_address_problem(args.address)):  # the run's, restored
            raise RayUnreachable(problem)  # ray://: Tune under Ray Client never reports to this driver
        if not args.validate_only and (problem := paths.logs_problem()):
            raise specs.SpecError([problem], "outputs")
        lock = None if args.validate_only else driver_lock(spec, resumed)  # refused while its driver is alive
    except (specs.SpecError, RayUnreachable) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) while the spec was checked (it was a traceback and exit 1)
        print(f"\n{NOT_STARTED}", file=sys.stderr)
        return EXIT_INTERRUPTED
    # on the console, not only in the log: the options a resume restored, a task left out of every trial
    for note in [*restored, *preflight.judge_notes(spec.tasks)]:
        print(note, flush=True)
    for problem in lacking:
        print(f"warning: {problem} (not on this machine: a run here refuses it; where it is, the spec runs)",
              file=sys.stderr, flush=True)
    if args.validate_only:
        print("\n".join(t.trial_id for t in specs.expand(spec)))
        if spec.tune.search == "optuna":
            print(f"+ {spec.tune.num_samples} trial(s) chosen by optuna while the sweep runs, over "
                  + ", ".join(f"{k}={space.parse(v).describe()}" for k, v in spec.grid.items()))
        print(generation_plan(spec))
        return 0
    timeline.mark("spec_checked", "driver")
    t0 = time.perf_counter()
    log_path = paths.outputs_dir() / "logs" / f"{lock.experiment}.log"  # a resume appends to its run's log
    with lock:  # held until the sweep ends; the kernel drops it if this process is killed
        done = None if resumed is None else finished_run(resumed)
        if done:  # nothing to resume: Ray not started, no trial replayed, the parent run not written again
            print(done)
            return 0
        preflight.random_weights_note(spec.model.pretrained)
        try:
            short = disk.check_free(_writes_to(spec), spec.limit and spec.limit * len(spec.tasks),
                                    planned_trials(spec))
            if short:
                print(f"error: {short}", file=sys.stderr)
                return EXIT_BAD_INPUT
            prepare_model(spec.model.pretrained)  # first-use work (training the tiny-easyvqa model) with its own bar
        except KeyboardInterrupt:
            print(f"\n{NOT_STARTED}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if not args.verbose:
            print(f"Ray, Tune and lmms-eval output goes to {log_path} (--verbose shows it here)", flush=True)
        with contextlib.nullcontext() if args.verbose else quiet(log_path):
            command = launch_command(args.config, args.overrides, regression_threshold=args.regression_threshold,
                                     address=args.address, environ=environ)
            try:
                stop_on_sigterm()  # again: an earlier import may have set another (a SIGTERM marked while the spec
                # was checked, `_TERMINATED`, interrupts the wait for the store below)
                store = threading.Thread(target=tracking.client, name="mlflow-store", daemon=True)
                store.start()  # a new store's tables (MLflow's migrations: seconds) are made while Ray starts
                with keeping_our_sigterm():  # ray.init sets its own (sys.exit: exit 15, or a hang; no resume line)
                    connect(args.address, log_to_driver=args.verbose)
                stop_on_sigterm()  # after ray.init, in case it set its own anyway
                wait_interruptibly(store)
                timeline.mark("ray_up", "driver")
                outcome = run_sweep(spec, resume=resumed, regression_threshold=args.regression_threshold,
                                    command=command, lock=lock)
            except (RayUnreachable, planning.NoCapacity, specs.SpecError, disk.DiskFull, pool_watch.PoolLost) as e:
                say(f"error: {e}")
                return EXIT_BAD_INPUT
            except SweepInterrupted as e:
                say(f"\ninterrupted: {e}\nfinish it with:\n  {e.resume}")
                return EXIT_INTERRUPTED
            except KeyboardInterrupt:  # before Tune took the signal (Ray starting, the calibration) or a second one
                try:
                    load_state(storage_root(spec), spec.name, lock.experiment)
                except specs.SpecError:  # stopped before the run saved its state: nothing to resume
                    say(f"\n{NOT_STARTED}")
                else:
                    say("\ninterrupted; finish it with:\n  "
                        + resume_command({"experiment": lock.experiment, "command": command}))
                return EXIT_INTERRUPTED
            except Exception as e:  # a write the watch did not see coming (the driver's own, Tune's) met a full disk
                # or a place that refuses writes
                full = disk.is_disk_full(e)
                refused = None if full or not disk.is_unwritable(e) else disk.unwritable_place(_writes_to(spec), str(e))
                if not full and refused is None:
                    raise
                resume = resume_command({"experiment": lock.experiment, "command": command})
                where = f"a write to {refused[0]}" if refused else "a write"
                say("error: " + disk.full_message(f"{where} failed ({type(e).__name__}: {e})", resume,
                                                  disk.UNWRITABLE if refused else disk.FULL))
                return EXIT_BAD_INPUT
    print(f"\nsweep {spec.name} finished in {time.perf_counter() - t0:.0f}s "
          f"(MLflow parent run {outcome.parent_run_id})\n")
    print(summary_table(spec, outcome.records))
    best = outcome.best  # drawn with the sweep, its output in the log (drawn again here, lmms-eval's bars showed)
    if outcome.paired or best:
        print("\n" + "\n".join(outcome.paired + ([best] if best else [])))  # the last line: the best (mu, tau)
    if outcome.unlogged:
        print(f"\nNOT IN MLFLOW YET: the store at {tracking.tracking_uri()} did not answer, so "
              f"{', '.join(outcome.unlogged)} {'is' if len(outcome.unlogged) == 1 else 'are'} not in it; their "
              f"results are kept (the Tune checkpoints and the outbox beside them). Once the store answers, send them "
              f"with:\n  {outcome.resume}")
        return EXIT_UNLOGGED
    if outcome.failed:
        print("\n" + failed_note(outcome))
    url = tracking.ui_url(spec.name, outcome.parent_run_id)  # this run's view, not a concurrent run's of the spec
    print("\n" + mlflow_layout.open_results(url))
    if outcome.regression_note:
        print(f"\nregression check: {outcome.regression_note}")
    if outcome.regressions:
        print("\nREGRESSION (Rel. fell beyond the threshold):\n  " + "\n  ".join(outcome.regressions))
        return EXIT_REGRESSION
    return EXIT_TRIALS_FAILED if outcome.failed else 0


_TERMINATED = threading.Event()  # a SIGTERM came (stop_on_sigterm): waits that its interruption may miss look here
_INTERRUPTED = threading.Event()  # a Ctrl-C came while Tune's handler held SIGINT (`StopMarker`)


class StopMarker(tune.Callback):
    """Marks a Ctrl-C (`_INTERRUPTED`) that Tune's own SIGINT handler takes: Tune installs it as each experiment
    starts, and it only ends that experiment's run (its state saved); ``tuner.fit()`` returns as after a finished run,
    and a sweep of two experiments started the search anyway when the signal came after the fixed trials had all
    finished (a SIGTERM is marked by `stop_on_sigterm`). Set up by Tune after its handler, this callback wraps it:
    the handler runs as before, and `_stop_if_signalled` ends the sweep before the next experiment. Both handlers
    end with the experiment (`handlers_kept`)."""

    def setup(self, **info):
        import signal

        if threading.current_thread() is not threading.main_thread():
            return
        tunes = signal.getsignal(signal.SIGINT)

        def marked(signum, frame):
            _INTERRUPTED.set()
            if callable(tunes):
                tunes(signum, frame)
            elif tunes != signal.SIG_IGN:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, marked)


@contextlib.contextmanager
def handlers_kept():
    """Inside the block (``tuner.fit()``) Tune sets its own SIGINT (and SIGUSR1) handler, which `StopMarker` wraps;
    after it the handlers are again those from before. Tune leaves its handler installed once ``fit()`` returns, so
    a Ctrl-C or SIGTERM in the summary, the report or the paired bootstrap that follow was only marked, once, where
    nothing looked any more (and the next experiment's Tune handler kept the last one's as the one it restores):
    now it stops the sweep at once, as a Ctrl-C before Tune started does (KeyboardInterrupt: the parent run ends
    KILLED with the resume command, exit 130). Only the main thread sets handlers; elsewhere nothing changes."""
    import signal

    kept = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name)]
    main_thread = threading.current_thread() is threading.main_thread()
    before = {signum: signal.getsignal(signum) for signum in kept} if main_thread else {}
    try:
        yield
    finally:
        for signum, handler in before.items():
            if handler is not None:  # (None: a handler set outside Python, which cannot be put back)
                signal.signal(signum, handler)


def _stop_if_signalled(phase: search.Phase | None, state: dict) -> None:
    """End the sweep as Ctrl-C does (`SweepInterrupted`: exit 130 and the command that resumes it) when a Ctrl-C or a
    SIGTERM came while Tune ran an experiment (its handler took it; after ``tuner.fit()`` the handlers from before
    are back, `handlers_kept`): before ``phase`` (None: after the last)."""
    if not (_TERMINATED.is_set() or _INTERRUPTED.is_set()):
        return
    where = (f"before the experiment {state['experiment']}{phase.suffix} started" if phase is not None else
             "after the last experiment, before the summary")
    raise SweepInterrupted(f"stopped (Ctrl-C or SIGTERM) {where}", resume_command(state))


def stop_on_sigterm() -> None:
    """SIGTERM (``ray job stop``, a scheduler's preemption, ``kill``) stops the sweep as Ctrl-C does: the handler of
    SIGINT at that moment runs (Tune's while trials run: it saves the experiment and stops; else KeyboardInterrupt),
    so the sweep ends with exit 130 and the command that resumes it. Ray's own handler (``sys.exit`` inside the
    driver) ended it with an abort, exit 134, and no resume line.

    A signal's handler runs between two bytecodes of the main thread, wherever it is: inside importlib's
    module-lock bookkeeping an exception is swallowed ("Exception ignored") and the lock is left held, so the store's
    thread, importing MLflow meanwhile, waited on it forever and the driver with it. There the handler only marks
    the signal (`_TERMINATED`), which `wait_interruptibly` turns into the interruption once out of it."""
    import signal

    def interrupt(signum, frame):
        _TERMINATED.set()
        if frame is not None and "importlib" in frame.f_code.co_filename:
            return  # not here: see above
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def wait_interruptibly(thread: threading.Thread, poll_s: float = 0.2) -> None:
    """Join ``thread``; a SIGTERM that came meanwhile (its KeyboardInterrupt swallowed where it landed, or only
    marked) ends the wait as a KeyboardInterrupt."""
    while not _TERMINATED.is_set():
        if not thread.is_alive():
            return
        thread.join(poll_s)
    raise KeyboardInterrupt


@contextlib.contextmanager
def keeping_our_sigterm():
    """Inside the block, Ray's ``ray.init`` leaves the SIGTERM handler as it is (`stop_on_sigterm`'s) instead of
    setting its own, which ends the driver with ``sys.exit`` (exit 15 and no resume line, or, landing inside an import
    as the store's thread imports MLflow, a driver that never ends). Ray sets it through one function of its utils; a
    Ray without it is left as it is."""
    from ray._private import utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def exit_now(code: int) -> None:
    """End the CLI: its output flushed, Ray shut down and the exit handlers run, then the process exits without
    Python's teardown of its modules (~2.5 s of freeing torch's and Ray's objects on 2 cores, nothing the sweep
    needs: its MLflow writes are done and its lock is the kernel's). Ray is shut down here rather than by its own
    exit handler, which first sleeps 0.5 s for workers' last log lines: the sweep's workers ended before its
    summary was printed."""
    import atexit

    import ray

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ray.shutdown()
    except KeyboardInterrupt:  # a Ctrl-C more while it ends: the sweep has said how it ended
        pass
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    from pipelines.sweep import exit_now, main as _main  # classes pickled by Tune must live in `pipelines.sweep`

    not_started_on_interrupt(False)  # the imports are done: Ctrl-C is main's to handle
    exit_now(_main())
