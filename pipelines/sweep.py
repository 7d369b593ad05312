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
   logging never leaves the actors idle; a trial hands predictions back as a Tune checkpoint. The driver (and
   only the driver) logs each finished trial as an MLflow child run.
3. cleanup: Rel. against the unpruned baseline, the optional nightly regression check, a summary table and the
   command that opens the MLflow UI.

`--resume` restores the Tune experiment: finished trials are not run again, unfinished and errored ones are,
and the same MLflow parent run continues.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pyarrow.parquet as pq
import ray
import yaml
from ray import tune

from promprune.records import Request

from pipelines import calibration, preflight, schema
from pipelines.console import progress, quiet, say
from pipelines import spec as specs
from pipelines import timeline, tracking
from pipelines.schema import REL
from pipelines.evaluate import (  # noqa: F401 - worker_env: re-exported for tests and scripts
    QUIET_ENV, EvalConfig, PredictorPool, RayUnreachable, Requests, build_requests_dataset, connect, evaluate,
    predictions_table, random_weights_note, worker_env)
from pipelines.weights import ModelSource, share

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "sweeps" / "quickstart.yaml"
STATE_DIR = "_promprune_state"  # beside Tune's experiments: which MLflow parent run each experiment logs to
TRIAL_CPUS = 0.25  # a trial only drives Ray Data and scores; its actors reserve the real cores and GPUs
QUEUED_TRIALS = 2  # trials running beyond those the actors serve at once: their batches fill the others' gaps
# exit codes: 1 some trial failed, 2 bad input (spec, model, tasks, store, Ray address), 3 a nightly regression,
# 130 interrupted (the shell's code for Ctrl-C)
EXIT_TRIALS_FAILED, EXIT_BAD_INPUT, EXIT_REGRESSION, EXIT_INTERRUPTED = 1, 2, 3, 130
STORAGE_ENV = "PROMPRUNE_STORAGE"  # Tune storage every node reaches (s3://..., NFS) when the spec sets none


@dataclass
class Plan:
    """How many actors per evaluation and trials at once.

    The sweep starts `workers x concurrency` actors once (`PredictorPool`) and its trials share them; Tune runs
    `in_flight` trials at once, more than `concurrency` by the trials queued behind them, so that while a trial
    scores, checkpoints and is logged, the next one's batches keep the actors busy."""

    workers: int
    concurrency: int
    gpus_per_worker: float
    cluster_gpus: float
    in_flight: int = 1

    @property
    def actors(self) -> int:
        return self.workers * self.concurrency


def makespan(n_trials: int, slots: int, workers: int, max_concurrent: int | None = None) -> float:
    """Time to run ``n_trials`` equal trials on ``slots`` GPU actors with ``workers`` actors per trial, in units of
    one trial on one actor: whole trials run in waves of ``slots // workers`` (or fewer, ``max_concurrent``), and a
    trial's samples are shared by its actors (Ray Data)."""
    at_once = max(1, slots // workers)
    if max_concurrent is not None:
        at_once = min(at_once, max_concurrent)
    return math.ceil(n_trials / at_once) / workers


def plan_resources(spec: specs.SweepSpec, n_trials: int, cluster_gpus: float) -> Plan:
    """auto workers: the actors per trial that finish the sweep soonest when its trials cost about the same.

    Whole trials run in waves, so 19 trials on 8 GPUs with one actor each take 3 waves with 3 GPUs busy in the
    last (79% of ideal); with all 8 actors on each trial, one trial after the other, nothing idles. Ties go to
    fewer actors per trial. auto concurrency: as many trials as the actors allow. With no GPU: one actor and one
    trial at a time (the actors would only fight over the cores). The actors are the sweep's, loaded once
    (`PredictorPool`); on GPUs `in_flight` adds QUEUED_TRIALS trials behind the running ones (a set cap bounds it).
    """
    r, t = spec.resources, spec.tune
    if cluster_gpus > 0 and r.gpus_per_worker > 0:
        slots = max(1, int(cluster_gpus // r.gpus_per_worker))  # actors that fit on the cluster at once
        cap = None if t.max_concurrent_trials == specs.AUTO else t.max_concurrent_trials
        workers = r.workers if r.workers != specs.AUTO else min(
            range(1, slots + 1), key=lambda w: (makespan(n_trials, slots, w, cap), w))
        concurrency = max(1, slots // workers)  # trials whose actors fit at once; a set cap lowers it
        if cap is not None:
            concurrency = min(concurrency, cap)
    else:
        workers = r.workers if r.workers != specs.AUTO else 1
        concurrency = t.max_concurrent_trials if t.max_concurrent_trials != specs.AUTO else 1
    concurrency = max(1, min(concurrency, n_trials))
    in_flight = concurrency + (QUEUED_TRIALS if cluster_gpus > 0 else 0)  # CPU: the trials would fight for cores
    if t.max_concurrent_trials != specs.AUTO:
        in_flight = min(in_flight, t.max_concurrent_trials)
    return Plan(workers=workers, concurrency=concurrency, gpus_per_worker=r.gpus_per_worker,
                cluster_gpus=cluster_gpus, in_flight=max(1, min(in_flight, n_trials)))


# ----------------------------------------------------------------------------------------------------------------
# the trial (runs in a Tune trial actor)


def run_trial(config: dict, *, source: ModelSource, rows: Requests | list[dict], settings: dict,
              run_fn: Callable | None = None, calibrated: dict | None = None,
              pool: PredictorPool | None = None) -> None:
    """Evaluate one trial on the sweep's actors (`pool`; None: a Ray Data actor pool of its own) and report metrics
    plus a checkpoint holding predictions and scores."""
    trial = specs.Trial.from_dict(config["trial"])
    trial = dataclasses.replace(trial, options=calibration.apply(trial.options, calibrated or {}))
    if trial.tasks:  # an explicit trial on a subset of the sweep's tasks
        rows = rows.only(trial.tasks) if isinstance(rows, Requests) else [r for r in rows if r.task in trial.tasks]
    started = time.time()
    timeline.tag(trial=trial.trial_id)
    timeline.mark("trial_begin", "trial")
    cfg = EvalConfig(model=source, method=trial.method, budget=trial.budget, options=trial.options, **settings)
    result = evaluate(cfg, rows, run_fn=run_fn, pool=pool)
    with tempfile.TemporaryDirectory() as d:
        pq.write_table(predictions_table(result.predictions), Path(d) / schema.PREDICTIONS_ARTIFACT)
        (Path(d) / schema.SCORES_ARTIFACT).write_text(json.dumps(result.scores, default=float))
        metrics = {**result.metrics, "trial/started_at": started, "trial/wall_s": time.time() - started}
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
    timeline.mark("trial_reported", "trial")
    timeline.tag(trial=None)


# ----------------------------------------------------------------------------------------------------------------
# driver-side logging (a Tune callback runs in the driver process: the only MLflow writer)


_LIVE_RECORDERS: dict[str, "SweepRecorder"] = {}  # parent run id -> this driver's recorder


class RecorderHook(tune.Callback):
    """The Tune callback: a picklable forwarder to the driver's live SweepRecorder.

    Tune pickles its callbacks with the experiment state and unpickles them on `--resume`; the hook carries only
    the parent run id and finds the (new) driver's recorder by it, so MLflow clients never get pickled.
    """

    def __init__(self, parent_id: str):
        self.parent_id = parent_id

    def on_trial_start(self, iteration: int, trials: list, trial, **info):
        timeline.mark("trial_start", "driver", trial=trial.config["trial"]["trial_id"])
        say(f"[start] {trial.config['trial']['trial_id']}")

    def on_trial_complete(self, iteration: int, trials: list, trial, **info):
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None:
            recorder.record(trial.config["trial"], trial.last_result, trial.checkpoint)
        timeline.mark("trial_recorded", "driver", trial=trial.config["trial"]["trial_id"])

    def on_trial_error(self, iteration: int, trials: list, trial, **info):
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None:
            recorder.record_error(trial.config["trial"], _error_text(trial))


def _error_text(trial) -> str:
    path = getattr(trial, "error_file", None)
    try:
        return Path(path).read_text()[-2000:] if path else "trial failed"
    except OSError:
        return f"trial failed (see {path})"


class SweepRecorder:
    """Logs each finished trial as an MLflow child run (once), with Rel. as soon as the baseline is known."""

    def __init__(self, sweep: specs.SweepSpec, parent_id: str, n_trials: int, calibrated: dict | None = None):
        self.sweep, self.parent_id, self.n_trials = sweep, parent_id, n_trials
        self.calibrated = calibrated or {}
        self.bar, self.samples = None, 0  # the sweep's progress bar (set while Tune runs)
        self.client = tracking.client()
        self.logged: dict[str, str] = {tid: r.info.run_id for tid, r in tracking.trial_runs(self.client,
                                                                                            parent_id).items()}
        self.records: dict[str, dict] = {}
        self.baseline_scores: dict | None = None
        self.rel_warned = False

    def record(self, trial: dict, metrics: dict, checkpoint) -> dict:
        tid = trial["trial_id"]
        if tid in self.records:
            return self.records[tid]
        with checkpoint.as_directory() as d:
            table = pq.read_table(Path(d) / schema.PREDICTIONS_ARTIFACT)
            scores = json.loads((Path(d) / schema.SCORES_ARTIFACT).read_text())
        started = metrics.get("trial/started_at")
        span = None if started is None else (float(started), float(started) + float(metrics.get("trial/wall_s", 0)))
        rec = {"trial": trial, "metrics": {k: v for k, v in metrics.items()
                                           if _is_metric(k, v) and k != "trial/started_at"},
               "scores": scores, "frame": table.to_pandas(), "error": None}
        if trial["method"] is None and trial.get("repeat", 0) == 0:
            self.baseline_scores = scores
        self._add_rel(rec)
        self.records[tid] = rec
        if tid not in self.logged:
            self.logged[tid] = tracking.log_trial(
                self.client, self.parent_id, self.sweep.name, self.sweep.version, trial, self._params(trial),
                rec["metrics"], table, span=span)
        elif REL in rec["metrics"]:
            tracking.log_metrics(self.client, self.logged[tid], {REL: rec["metrics"][REL]})
        self._progress(rec)
        return rec

    def record_error(self, trial: dict, error: str) -> None:
        tid = trial["trial_id"]
        self.records[tid] = {"trial": trial, "metrics": {}, "scores": {}, "frame": None, "error": error}
        if tid not in self.logged:  # once: the Tune callback and the final reconcile both report a failure
            self.logged[tid] = tracking.log_trial(self.client, self.parent_id, self.sweep.name, self.sweep.version,
                                                  trial, self._params(trial), {}, None, status="FAILED", error=error)
            say(f"[trial failed] {tid}: {error}")

    def finalize_rel(self) -> None:
        """Rel. for trials that finished before the baseline did."""
        for tid, rec in self.records.items():
            if rec["error"] is None and REL not in rec["metrics"] and self._add_rel(rec) and tid in self.logged:
                tracking.log_metrics(self.client, self.logged[tid], {REL: rec["metrics"][REL]})

    def _add_rel(self, rec: dict) -> bool:
        """Rel. vs the baseline; undefined (not logged, said once) when a baseline score is 0."""
        if self.baseline_scores is None:
            return False
        from promprune.eval import relative_score

        try:
            rec["metrics"][REL] = float(relative_score(rec["scores"], self.baseline_scores))
        except ValueError as e:
            if not self.rel_warned:
                say(f"note: Rel. is not defined for this sweep: {e}")
                self.rel_warned = True
            return False
        return True

    def _params(self, trial: dict) -> dict:
        options = trial.get("options") or {}
        used = calibration.apply(options, self.calibrated)
        if used is not options:  # the mu the trial actually used, and where it came from
            trial = {**trial, "options": {**used, "mu_source": "calibration"}}
        return tracking.trial_params(self.sweep.model.pretrained, trial, trial.get("tasks") or self.sweep.tasks,
                                     self.sweep.model.options)

    def _progress(self, rec: dict) -> None:
        done = len(self.records)
        m = rec["metrics"]
        shown = " ".join(f"{k}={m[k]:.3f}" for k in _headline_keys(self.sweep.tasks, m) + [REL] if k in m)
        failed = int(m.get("samples/failed", 0))
        shown += f" FAILED SAMPLES={failed} (scored as the empty answer)" if failed else ""
        say(f"[{done}/{self.n_trials}] {rec['trial']['trial_id']}: {shown} "
            f"({m.get('trial/wall_s', float('nan')):.1f}s)")
        if self.bar is not None:
            self.samples += int(m.get("samples/total", 0))
            self.bar.set_postfix_str(f"{self.samples} samples", refresh=False)
            self.bar.update(1)


def _is_metric(key: str, value: Any) -> bool:
    return "/" in key and isinstance(value, (int, float)) and not isinstance(value, bool)


def _headline_keys(tasks: list[str], metrics: dict) -> list[str]:
    """Each task's primary metric(s) (`promprune.eval.PRIMARY_METRICS`, what Rel. uses), else its first metric."""
    from promprune.eval import PRIMARY_METRICS

    keys = []
    for task in tasks:
        primary = [f"{task}/{m}" for m in PRIMARY_METRICS.get(task, ())]
        keys += [k for k in primary if k in metrics] or [k for k in metrics if k.startswith(f"{task}/")][:1]
    return keys


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


def storage_root(spec: specs.SweepSpec) -> str:
    """Tune's storage: the spec's tune.storage_path, else $PROMPRUNE_STORAGE, else ./outputs/tune (local runs)."""
    return spec.tune.storage_path or os.environ.get(STORAGE_ENV) or str((Path.cwd() / "outputs" / "tune").resolve())


def _state_fs(storage: str):
    """(pyarrow filesystem, directory) of the sweep state records: local paths, s3://, gs://, ... alike."""
    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    return fs, f"{root.rstrip('/')}/{STATE_DIR}"


def save_state(storage: str, state: dict) -> None:
    fs, d = _state_fs(storage)
    fs.create_dir(d, recursive=True)
    with fs.open_output_stream(f"{d}/{state['experiment']}.json") as f:
        f.write(json.dumps(state, indent=2).encode())


def _state_names(storage: str, name: str) -> list[str]:
    import pyarrow.fs

    fs, d = _state_fs(storage)
    return sorted(info.base_name[:-len(".json")] for info in fs.get_file_info(pyarrow.fs.FileSelector(
        d, allow_not_found=True)) if info.base_name.startswith(f"{name}-") and info.base_name.endswith(".json"))


def _read_state(storage: str, experiment: str) -> dict:
    fs, d = _state_fs(storage)
    with fs.open_input_stream(f"{d}/{experiment}.json") as f:
        return json.loads(f.read().decode())


def load_state(storage: str, name: str, resume: str) -> dict:
    """The saved state of run `resume` (an experiment name like quickstart-20261121-080000), or with 'latest' the
    newest run of spec `name`. Kept beside Tune's state, so a resumed `ray job` finds it too."""
    found = _state_names(storage, name)
    experiment = found[-1] if resume == "latest" and found else resume
    if experiment not in found:
        raise specs.SpecError([f"no run {experiment!r} of sweep {name!r} under {storage}/{STATE_DIR} (found: "
                               f"{', '.join(found) or 'none'}); start it without --resume"], "--resume")
    return _read_state(storage, experiment)


def check_trusted_storage(storage: str, experiment: str) -> None:
    """`--resume` unpickles Tune's saved state, so whoever can write it can run code in this driver. On a local
    file system refuse state that another user owns or that others may write; remote stores (s3://, gs://) must be
    writable by you alone (bucket policy), which cannot be checked from here."""
    import stat

    if "://" in storage and not storage.startswith("file://"):
        return
    root = Path(storage.removeprefix("file://"))
    for path in (root, root / STATE_DIR, root / experiment):
        if not path.exists():
            continue
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise specs.SpecError([f"{path} is owned by another user or writable by others, and resuming unpickles "
                                   "the Tune state kept there (whoever can write it can run code in this process); "
                                   f"fix its ownership/permissions (chmod go-w {path}) or start a new sweep"],
                                  "--resume")


def fingerprint(spec: specs.SweepSpec) -> str:
    """What a resumed sweep must match: the hash of the fully resolved spec."""
    return hashlib.sha256(specs.dump_resolved(spec).encode()).hexdigest()


def check_resume(spec: specs.SweepSpec, state: dict) -> None:
    """A resumed sweep must be the sweep it resumes: any difference in the resolved spec would mix two experiments
    in one parent run. Raises SpecError naming every changed field and the command that resumes the original."""
    if state.get("fingerprint") == fingerprint(spec):
        return
    before = _flat(yaml.safe_load(state.get("spec_yaml") or "{}"))
    now = _flat(yaml.safe_load(specs.dump_resolved(spec)))
    changed = [f"{k}: {before.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
               for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    raise specs.SpecError(changed + [f"resume the original with: {resume_command(state)}"],
                          f"--resume {state['experiment']}: the spec differs from the one that run started with")


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for key, value in (d or {}).items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_command(state: dict) -> str:
    """The command that resumes the run of `state`, with the spec file and every --set override it started with."""
    cmd = state.get("command") or {}
    parts = ["python", "pipelines/sweep.py", "--config", cmd.get("config", "<spec.yaml>")]
    for item in cmd.get("overrides", []):
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts + ["--resume", state["experiment"]])


def _driver_alive(driver: dict | None) -> bool | None:
    """Whether the driver process that wrote a state is alive (None: not this host, cannot tell)."""
    if not driver or driver.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(driver["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def mark_dead_runs(client, storage: str, name: str) -> list[str]:
    """Parent runs of sweep `name` still RUNNING in MLflow although their driver died (SIGKILL, a lost node): mark
    them KILLED with a tag saying so, so the MLflow UI does not show them as live. Returns their experiments."""
    from mlflow.exceptions import MlflowException

    marked = []
    for experiment in _state_names(storage, name):
        state = _read_state(storage, experiment)
        if _driver_alive(state.get("driver")) is not False:
            continue
        try:
            run = client.get_run(state["parent_run_id"])
        except MlflowException:  # a run deleted from the store, another store: nothing to mark
            continue
        if run.info.status == "RUNNING":
            client.set_tag(run.info.run_id, schema.INTERRUPTED,
                           f"driver pid {state['driver']['pid']} on {state['driver']['host']} died without "
                           f"finishing; resume with: {resume_command(state)}")
            tracking.finish(client, run.info.run_id, status="KILLED")
            marked.append(experiment)
    return marked


# ----------------------------------------------------------------------------------------------------------------
# run


@dataclass
class SweepOutcome:
    parent_run_id: str
    records: dict  # trial id -> {trial, metrics, scores, frame, error}
    regressions: list
    experiment_path: str

    @property
    def failed(self) -> list[str]:
        return [tid for tid, r in self.records.items() if r["error"] is not None]


def run_sweep(spec: specs.SweepSpec, *, resume: str | None = None, run_fn: Callable | None = None,
              regression_threshold: float | None = None, rows: Requests | list[Request] | None = None,
              command: dict | None = None) -> SweepOutcome:
    """Setup -> Tune -> MLflow; Ray must already be initialized. `run_fn`/`rows` replace the model call/rows.

    `command`: the spec file and --set overrides the sweep was started with (what the printed resume command
    repeats). A resumed sweep must resolve to exactly the spec it started with (SpecError otherwise)."""
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
    state = None
    if resume is not None:  # before any expensive work: a changed spec is refused at once
        state = load_state(storage, spec.name, resume)
        check_trusted_storage(storage, state["experiment"])
        check_resume(spec, state)
    trials = specs.expand(spec)
    plan = plan_resources(spec, len(trials), float(ray.cluster_resources().get("GPU", 0)))
    say(f"sweep {spec.name} v{spec.version}: {len(trials)} trials, {plan.actors} actor(s) shared by up to "
        f"{plan.in_flight} trial(s) at once ({plan.workers} per trial), {plan.cluster_gpus:g} GPU(s)")
    t0 = time.perf_counter()
    rows = rows if rows is not None else build_requests_dataset(spec.tasks, spec.limit, spec.generation,
                                                                spec.resources.batch_size)
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
    recorder = SweepRecorder(spec, parent_id, len(trials), calibrated=state["calibrated"])
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
        trainable = _trainable(source, rows, spec, plan, run_fn, state["calibrated"], pool)
        tuner = _tuner(trainable, spec, trials, plan, state, recorder, resume=resume is not None)
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
               calibrated: dict, pool: PredictorPool | None = None):
    settings = dict(tasks=spec.tasks, limit=spec.limit, generation=spec.generation, progress_bars=False,
                    bootstrap=spec.bootstrap,
                    resources=dataclasses.replace(spec.resources, workers=plan.workers))
    fn = tune.with_parameters(run_trial, source=source, rows=rows, settings=settings, run_fn=run_fn,
                              calibrated=calibrated, pool=pool)
    return tune.with_resources(fn, {"cpu": TRIAL_CPUS})


def _tuner(trainable, spec: specs.SweepSpec, trials: list, plan: Plan, state: dict, recorder, resume: bool):
    storage, name = state["storage_path"], state["experiment"]
    if resume and tune.Tuner.can_restore(f"{storage}/{name}"):
        say(f"resuming {storage}/{name}: finished trials are kept")
        return tune.Tuner.restore(f"{storage}/{name}", trainable, resume_unfinished=True, resume_errored=True)
    run_config = tune.RunConfig(
        name=name, storage_path=storage, callbacks=[RecorderHook(recorder.parent_id)],
        verbose=0,  # Tune's tables are wide; RecorderHook prints one line per trial start and end instead
        failure_config=tune.FailureConfig(max_failures=spec.tune.max_failures),
    )
    return tune.Tuner(trainable, param_space={"trial": tune.grid_search([t.to_dict() for t in trials])},
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
            recorder.record(trial, result.metrics, result.checkpoint)
    unfinished = [t.trial_id for t in trials if t.trial_id not in recorder.records]
    if unfinished:
        raise SweepInterrupted(f"{len(unfinished)} trial(s) did not finish: {', '.join(unfinished)}")


# ----------------------------------------------------------------------------------------------------------------
# cleanup


def summary_table(spec: specs.SweepSpec, records: dict) -> str:
    """Plain-text table: one row per trial, the headline metric per task, Rel., efficiency."""
    rows = []
    for tid, rec in records.items():
        m, t = rec["metrics"], rec["trial"]
        row = {"trial": tid, "method": t["method"] or "none", "budget": t["budget"] if t["budget"] else "-"}
        for key in _headline_keys(spec.tasks, m):
            row[key] = round(m[key], 4)
        row["rel"] = round(m[REL], 4) if REL in m else "-"
        row["vis.tok"] = _fmt(m.get("efficiency/visual_tokens"))
        row["prefill ms"] = _fmt(m.get("efficiency/prefill_ms"))
        row["failed"] = "ERROR" if rec["error"] else int(m.get("samples/failed", 0))
        rows.append(row)
    return pd.DataFrame(rows).fillna("-").to_string(index=False) if rows else "(no trials)"


def _fmt(v: Any) -> Any:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 1)


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
        spec = specs.load(args.config, args.overrides)
        preflight.check_or_raise(spec, args.config)
        if args.resume is not None:
            state = load_state(storage_root(spec), spec.name, args.resume)
            check_trusted_storage(storage_root(spec), state["experiment"])
            check_resume(spec, state)
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
            outcome = run_sweep(spec, resume=args.resume, regression_threshold=args.regression_threshold,
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
