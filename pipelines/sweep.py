"""Run a sweep spec on Ray Tune; every trial is one Ray Data evaluation; results go to MLflow.

    python pipelines/sweep.py                                   # sweeps/quickstart.yaml, offline, local Ray
    python pipelines/sweep.py --config sweeps/table1_llava15.yaml --set limit=20
    python pipelines/sweep.py --config sweeps/quickstart.yaml --resume          # finish an interrupted sweep
    ray job submit --working-dir . -- python pipelines/sweep.py --config sweeps/nightly.yaml \
        --regression-threshold 0.02

Setup -> run -> cleanup:

1. setup: validate the spec completely (no model load), connect to Ray, build the request rows once on the driver,
   publish the model weights to the object store once (see pipelines/weights.py), open the MLflow parent run.
2. run: Ray Tune runs one trial per grid point (`tune.grid_search` over the expanded trial list; random search
   draws from the grid with a seed), at most as many at once as the GPUs allow, retrying failed trials
   (`FailureConfig`). The sweep starts its actors once (`PredictorPool`: each loads the model once) and every
   trial sends its batches to them, a trial or two queued behind the running ones so that one trial's scoring and
   logging never leaves the actors idle; a trial hands its `TrialResult` (one parquet file: predictions, scores,
   metrics) back as its Tune checkpoint. The driver (and only the driver) logs each finished trial as an MLflow
   child run, uploading that file as it is.
3. cleanup: Rel. against the unpruned baseline, the optional nightly regression check, a summary table and the
   command that opens the MLflow UI.

`--resume` restores the Tune experiment: finished trials are not run again, unfinished and errored ones are,
and the same MLflow parent run continues.

The parts live in `pipelines/run/`: requests.py (the requests in the object store), pool.py (the actors),
result.py (TrialResult), ray_connect.py, resources.py (actors and trials at once), state.py (sweep state and
--resume), recorder.py (the driver's MLflow logging); this file is the trial, the Tune run and the CLI.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import ray
from ray import tune

from promprune.records import Request

from pipelines import calibration, mlflow_layout, plugins, preflight
from pipelines.console import progress, quiet, say
from pipelines import spec as specs
from pipelines import timeline, tracking
from pipelines.evaluate import EvalConfig, evaluate, random_weights_note
from pipelines.run.pool import PredictorPool
from pipelines.run.ray_connect import QUIET_ENV, RayUnreachable, connect
from pipelines.run.recorder import _LIVE_RECORDERS, RecorderHook, SweepRecorder, summary_table
from pipelines.run.requests import Requests, build_requests_dataset
from pipelines.run.resources import Plan, plan_resources
from pipelines.run.state import fingerprint, mark_dead_runs, resume_command, resumed_state, save_state, storage_root
from pipelines.weights import ModelSource, share

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "sweeps" / "quickstart.yaml"
TRIAL_CPUS = 0.25  # a trial only drives Ray Data and scores; its actors reserve the real cores and GPUs
# exit codes: 1 some trial failed, 2 bad input (spec, model, tasks, store, Ray address), 3 a nightly regression,
# 130 interrupted (the shell's code for Ctrl-C)
EXIT_TRIALS_FAILED, EXIT_BAD_INPUT, EXIT_REGRESSION, EXIT_INTERRUPTED = 1, 2, 3, 130

# ----------------------------------------------------------------------------------------------------------------
# the trial (runs in a Tune trial actor)


def tune_trial(trial: specs.Trial, calibrated: dict) -> dict:
    """A trial as Tune's config holds it (`Trial.to_dict`), its options as the trial runs them: ``mu: calibrate``
    replaced here, once per trial, by the sweep's measured median (`calibration.apply`), with ``mu_source`` saying
    so. The trial id stays the spec's."""
    config = trial.to_dict()
    used = calibration.apply(trial.options, calibrated)
    if used is not trial.options:
        config["options"], config["mu_source"] = dict(used), "calibration"
    return config


def run_trial(config: dict, *, source: ModelSource, rows: Requests | list[dict], settings: dict,
              run_fn: Callable | None = None, pool: PredictorPool | None = None) -> None:
    """Evaluate one trial (``config["trial"]``: `tune_trial`) on the sweep's actors (`pool`; None: a pool of its
    own) and report its metrics, with the `TrialResult` file as the checkpoint."""
    tid = config["trial"]["trial_id"]
    trial = specs.Trial.from_dict(config["trial"])
    if trial.tasks:  # an explicit trial on a subset of the sweep's tasks
        rows = rows.only(trial.tasks) if isinstance(rows, Requests) else [r for r in rows if r.task in trial.tasks]
    started = time.time()
    timeline.tag(trial=tid)
    timeline.mark("trial_begin", "trial")
    cfg = EvalConfig(model=source, method=trial.method, budget=trial.budget, options=trial.options, **settings)
    result = evaluate(cfg, rows, run_fn=run_fn, pool=pool)
    result.metrics.update({"trial/started_at": started, "trial/wall_s": time.time() - started})
    with tempfile.TemporaryDirectory() as d:
        result.write(Path(d) / mlflow_layout.PREDICTIONS_ARTIFACT)
        tune.report(result.metrics, checkpoint=tune.Checkpoint.from_directory(d))
    timeline.mark("trial_reported", "trial")
    timeline.tag(trial=None)


# ----------------------------------------------------------------------------------------------------------------
# setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run a sweep spec on Ray Tune and log it to MLflow.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="sweep spec (default: sweeps/quickstart.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a spec field, value parsed as YAML (repeatable): --set limit=8 "
                        "--set grid.budget=[16,8]")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="EXPERIMENT",
                   help="resume the latest run of this spec (or the named one, e.g. quickstart-20261121-080000): "
                        "finished trials are kept, the same MLflow parent run continues")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--regression-threshold", type=float, default=None,
                   help="nightly: fail (exit 3) and tag the run when a trial's Rel. drops more than this "
                        "below the previous finished run of the same spec")
    p.add_argument("--validate-only", action="store_true", help="check the spec and list its trials, run nothing")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray, Tune and lmms-eval output here instead of in outputs/logs/<sweep>-<time>.log")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# run


@dataclass
class SweepOutcome:
    parent_run_id: str
    records: dict  # trial id -> {trial, metrics, scores, predictions (pa.Table), error}
    regressions: list
    experiment_path: str

    @property
    def failed(self) -> list[str]:
        return [tid for tid, r in self.records.items() if r["error"] is not None]


def run_sweep(spec: specs.SweepSpec, *, resume: str | dict | None = None, run_fn: Callable | None = None,
              regression_threshold: float | None = None, rows: Requests | list[Request] | None = None,
              command: dict | None = None) -> SweepOutcome:
    """Setup -> Tune -> MLflow; Ray must already be initialized. `run_fn`/`rows` replace the model call/rows.

    `command`: the spec file and --set overrides the sweep was started with (what the printed resume command
    repeats). `resume`: the run to continue, as the state `pipelines.run.state.resumed_state` loaded and checked
    (what `main` passes), or its experiment name / 'latest' (checked here: it must resolve to exactly the spec it
    started with, SpecError otherwise)."""
    began = time.time()  # the parent run spans the whole sweep, setup (rows, weights, first-use training) included
    timeline.mark("sweep_begin", "driver", t=began)
    try:
        return _run_sweep(spec, began, resume=resume, run_fn=run_fn, regression_threshold=regression_threshold,
                          rows=rows, command=command)
    finally:
        timeline.mark("sweep_end", "driver")


def _run_sweep(spec: specs.SweepSpec, began: float, *, resume, run_fn, regression_threshold, rows,
               command) -> SweepOutcome:
    storage = storage_root(spec)
    state = resumed_state(spec, resume) if isinstance(resume, str) else resume  # before any expensive work
    trials = specs.expand(spec)
    plan = plan_resources(spec, len(trials), float(ray.cluster_resources().get("GPU", 0)))
    say(f"sweep {spec.name} v{spec.version}: {len(trials)} trials, {plan.actors} actor(s) shared by up to "
        f"{plan.in_flight} trial(s) at once ({plan.workers} per trial), {plan.cluster_gpus:g} GPU(s)")
    t0 = time.perf_counter()
    rows = rows if rows is not None else build_requests_dataset(spec.tasks, spec.limit, spec.generation,
                                                                spec.resources.batch_size,
                                                                video_frames=spec.video_frames)
    n_rows = len(rows.keys) if isinstance(rows, Requests) else len(rows)
    say(f"{n_rows} request rows built once for all trials ({time.perf_counter() - t0:.1f}s)")
    timeline.mark("rows_built", "driver")
    source = spec.model
    if spec.resources.share_weights:
        t0 = time.perf_counter()
        source = share(source, on_gpu=plan.cluster_gpus > 0)
        say(f"weights published to the object store once ({time.perf_counter() - t0:.1f}s)")
        timeline.mark("weights_published", "driver")
    client = tracking.client()
    for experiment in mark_dead_runs(client, storage, spec.name):
        say(f"note: the earlier run {experiment} of this sweep died without finishing; its MLflow parent run is "
            "now marked KILLED")
    driver = {"host": socket.gethostname(), "pid": os.getpid()}
    if resume is None:
        parent_id = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec),
                                         {"model": spec.model.pretrained, "tasks": ",".join(spec.tasks),
                                          "limit": spec.limit, "trials": len(trials)}, started=began)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        state = {"parent_run_id": parent_id, "storage_path": storage, "experiment": f"{spec.name}-{stamp}",
                 "fingerprint": fingerprint(spec), "spec_yaml": specs.dump_resolved(spec),
                 "command": command or {}}
    else:
        parent_id = state["parent_run_id"]
        tracking.reopen(client, parent_id)
    if "calibrated" not in state:  # mu: calibrate trials: measured once per sweep (a resume reuses the values)
        state["calibrated"] = calibrate(spec, trials, source, plan, client, parent_id)
    save_state(storage, {**state, "driver": driver})
    recorder = SweepRecorder(spec, parent_id, len(trials))
    _LIVE_RECORDERS[parent_id] = recorder
    exp_path = f"{state['storage_path']}/{state['experiment']}"
    pool = None
    try:
        t0 = time.perf_counter()  # after calibration, whose task needs a GPU the actors would hold
        timeline.mark("pool_start", "driver")
        pool = PredictorPool.start(source, plan.actors, spec.resources, on_gpu=plan.cluster_gpus > 0, run_fn=run_fn)
        waited = time.perf_counter() - t0
        timeline.mark("pool_first_ready", "driver")
        say(f"1 actor loaded the model once for all trials ({waited:.1f}s)" if plan.actors == 1 else
            f"{plan.actors} actors load the model once for all trials: the first was ready after {waited:.1f}s; "
            "trials start now and the others join as they finish loading")
        trainable = _trainable(source, rows, spec, plan, run_fn, pool)
        tuner = _tuner(trainable, spec, [tune_trial(t, state["calibrated"]) for t in trials], plan, state, recorder,
                       resume=resume is not None)
        with progress(len(trials), spec.name) as bar:
            recorder.bar = bar
            timeline.mark("tune_start", "driver")
            grid = tuner.fit()
            timeline.mark("tune_end", "driver")
        try:
            _reconcile(recorder, grid, trials)
        except SweepInterrupted as e:
            raise SweepInterrupted(str(e), resume_command(state)) from None
        recorder.finalize_rel()
        regressions = []
        if regression_threshold is not None:
            regressions = tracking.regression_check(client, parent_id, spec.name, spec.version, regression_threshold)
        tracking.log_metrics(client, parent_id, {"trials/total": len(trials),
                                                 "trials/failed": sum(r["error"] is not None
                                                                      for r in recorder.records.values())})
        tracking.finish(client, parent_id)
    except BaseException:
        tracking.finish(client, parent_id, status="KILLED")
        raise
    finally:
        _LIVE_RECORDERS.pop(parent_id, None)
        if pool is not None:
            pool.shutdown()
    return SweepOutcome(parent_id, recorder.records, regressions, exp_path)


def calibrate(spec: specs.SweepSpec, trials: list, source: ModelSource, plan: Plan, client, parent_id: str) -> dict:
    """The median of each prominence metric that a `mu: calibrate` trial needs, measured with the sweep's model on
    the calibration images (one Ray task, on a GPU when the cluster has one); logged on the parent run."""
    metrics = calibration.metrics_to_calibrate(trials)
    if not metrics:
        return {}
    t0 = time.perf_counter()
    budget = min(t.budget for t in trials if t.options.get("mu") == calibration.CALIBRATE)
    task = ray.remote(num_cpus=1, num_gpus=plan.gpus_per_worker if plan.cluster_gpus > 0 else 0)(calibration.run)
    found = ray.get(task.remote(source, spec.calibration, metrics, budget))
    medians = {m: round(float(r["median"]), 4) for m, r in found.items()}
    tracking.log_metrics(client, parent_id, {f"calibration/median_{m}": v for m, v in medians.items()})
    client.log_param(parent_id, "calibration_images", f"{spec.calibration.images} (n={spec.calibration.n}, "
                                                      f"seed={spec.calibration.seed})")
    client.log_dict(parent_id, {m: r["values"] for m, r in found.items()}, "calibration_values.json")
    say(f"mu calibrated on {found[metrics[0]]['n']} images ({time.perf_counter() - t0:.1f}s): "
        + ", ".join(f"{m} median {v:.4f}" for m, v in medians.items()))
    return medians


def _trainable(source: ModelSource, rows: Requests | list[dict], spec: specs.SweepSpec, plan: Plan, run_fn,
               pool: PredictorPool | None = None):
    settings = dict(tasks=spec.tasks, limit=spec.limit, video_frames=spec.video_frames,
                    generation=spec.generation, progress_bars=False,
                    bootstrap=spec.bootstrap,
                    resources=dataclasses.replace(spec.resources, workers=plan.workers))
    fn = tune.with_parameters(run_trial, source=source, rows=rows, settings=settings, run_fn=run_fn, pool=pool)
    return tune.with_resources(fn, {"cpu": TRIAL_CPUS})


def _tuner(trainable, spec: specs.SweepSpec, trials: list[dict], plan: Plan, state: dict, recorder, resume: bool):
    """trials: Tune's configs (`tune_trial`); a resumed experiment keeps the ones it started with."""
    storage, name = state["storage_path"], state["experiment"]
    if resume and tune.Tuner.can_restore(f"{storage}/{name}"):
        say(f"resuming {storage}/{name}: finished trials are kept")
        return tune.Tuner.restore(f"{storage}/{name}", trainable, resume_unfinished=True, resume_errored=True)
    run_config = tune.RunConfig(
        name=name, storage_path=storage, callbacks=[RecorderHook(recorder.parent_id)],
        verbose=0,  # Tune's tables are wide; RecorderHook prints one line per trial start and end instead
        failure_config=tune.FailureConfig(max_failures=spec.tune.max_failures),
    )
    return tune.Tuner(trainable, param_space={"trial": tune.grid_search(trials)},
                      tune_config=tune.TuneConfig(max_concurrent_trials=plan.in_flight, num_samples=1,
                                                  reuse_actors=True),
                      run_config=run_config)


class SweepInterrupted(RuntimeError):
    """Tune stopped before every trial finished (Ctrl-C, SIGTERM): the state is saved, `--resume` continues."""

    def __init__(self, message: str, resume: str = ""):
        super().__init__(message)
        self.resume = resume  # the command that finishes the sweep


def _reconcile(recorder: SweepRecorder, grid, trials: list) -> None:
    """Log any trial the callback did not see (finished before an interruption, restored by --resume).

    A trial without a result (never started, or stopped without error or checkpoint) means Tune was interrupted.
    """
    for result in grid:
        if not result.config or "trial" not in result.config:  # a trial Tune never started (interrupted early)
            continue
        trial = result.config["trial"]
        if trial["trial_id"] in recorder.records and recorder.records[trial["trial_id"]]["error"] is None:
            continue
        if result.error is not None:
            recorder.record_error(trial, str(result.error))
        elif result.checkpoint is not None:
            recorder.record(trial, result.checkpoint)
    unfinished = [t.trial_id for t in trials if t.trial_id not in recorder.records]
    if unfinished:
        raise SweepInterrupted(f"{len(unfinished)} trial(s) did not finish: {', '.join(unfinished)}")


# ----------------------------------------------------------------------------------------------------------------
# the CLI


def generation_plan(spec: specs.SweepSpec) -> str:
    """What each task will generate with: its lmms-eval generation_kwargs, the spec's `generation` laid over them,
    and the bridge's default for what neither sets (what --validate-only shows)."""
    from promprune.eval.generation import generate_kwargs
    from promprune.eval.tasks import task_config

    lines = ["generation per task (the task's lmms-eval generation_kwargs, the spec's `generation` over them):"]
    for task in spec.tasks:
        own = task_config(task).get("generation_kwargs") or {}
        kwargs, until = generate_kwargs({**own, **spec.generation})
        shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        lines.append(f"  {task}: {shown}" + (f", stop at {until}" if until else ""))
    return "\n".join(lines)


def prepare_model(name: str) -> None:
    """First-use work of a factory-built model (e.g. training tiny-easyvqa:llava), here in the driver with its
    progress bar on the terminal, before Ray starts; nothing for checkpoints."""
    from promprune.models.factories import find_model_factory

    found = find_model_factory(name)
    if found is not None and hasattr(found[0], "prepare"):
        found[0].prepare(found[1])


def main(argv: list[str] | None = None) -> int:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    try:  # everything a user can get wrong, in seconds, before Ray starts and before any MLflow run exists
        spec = specs.load(args.config, args.overrides)  # imports the spec's plugins (their methods are checked)
        plugins.activate(spec.plugins, spec.include_path)  # here and in every Ray worker started after this
        preflight.check_or_raise(spec, args.config)
        resumed = None if args.resume is None else resumed_state(spec, args.resume)  # the one resume check
    except specs.SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in preflight.judge_notes(spec.tasks):
        print(note, flush=True)  # on the console, not only in the log: the task is left out of every trial
    if args.validate_only:
        print("\n".join(t.trial_id for t in specs.expand(spec)))
        print(generation_plan(spec))
        return 0
    t0 = time.perf_counter()
    random_weights_note(spec.model.pretrained)
    prepare_model(spec.model.pretrained)  # first-use work (training the tiny-easyvqa model) with its own bar
    log_path = Path("outputs") / "logs" / f"{spec.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.log"
    if not args.verbose:
        print(f"Ray, Tune and lmms-eval output goes to {log_path} (--verbose shows it here)", flush=True)
    with contextlib.nullcontext() if args.verbose else quiet(log_path):
        try:
            connect(args.address, log_to_driver=args.verbose)
            outcome = run_sweep(spec, resume=resumed, regression_threshold=args.regression_threshold,
                                command={"config": args.config, "overrides": args.overrides})
        except RayUnreachable as e:
            say(f"error: {e}")
            return EXIT_BAD_INPUT
        except SweepInterrupted as e:
            say(f"\ninterrupted: {e}\nfinish it with:\n  {e.resume}")
            return EXIT_INTERRUPTED
    print(f"\nsweep {spec.name} finished in {time.perf_counter() - t0:.0f}s "
          f"(MLflow parent run {outcome.parent_run_id})\n")
    print(summary_table(spec, outcome.records))
    url = tracking.ui_url(spec.name)
    print(f"\nOpen the results:\n  {tracking.ui_command()}" + (f"\n  then {url}" if url else ""))
    if outcome.regressions:
        print("\nREGRESSION (Rel. fell beyond the threshold):\n  " + "\n  ".join(outcome.regressions))
        return EXIT_REGRESSION
    return EXIT_TRIALS_FAILED if outcome.failed else 0


if __name__ == "__main__":
    from pipelines.sweep import main as _main  # classes pickled by Tune must live in `pipelines.sweep`, not __main__

    sys.exit(_main())
