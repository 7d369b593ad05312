"""Driver-side logging of a sweep's trials (a Tune callback runs in the driver process: the only MLflow writer, through
one `pipelines.run.outbox.Outbox` that never blocks Tune and loses nothing when the store is down): each trial's
MLflow child run from its start (RUNNING, its progress as blocks come back) to its end (FINISHED with the `TrialResult`
file uploaded as it is, KILLED when a scheduler stopped it, FAILED); Rel. follows as soon as the baseline is known;
one progress line per trial and, at the end, the summary table, each method's paired difference to the best other,
and the best (mu, tau) with the samples generated."""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
from ray import tune

from pipelines import mlflow_layout, timeline, tracking
from pipelines import spec as specs
from pipelines.console import say
from pipelines.run import search
from pipelines.run.outbox import PARENT, Outbox
from pipelines.run.result import TrialResult, rel
from pipelines.mlflow_layout import MU_TAU, REL

_LIVE_RECORDERS: dict[str, "SweepRecorder"] = {}  # parent run id -> this driver's recorder


class RecorderHook(tune.Callback):
    """The Tune callback: a picklable forwarder to the driver's live SweepRecorder.

    Tune pickles its callbacks with the experiment state and unpickles them on `--resume`; the hook carries only
    the parent run id and finds the (new) driver's recorder by it, so MLflow clients never get pickled.
    """

    def __init__(self, parent_id: str):
        self.parent_id = parent_id

    def on_trial_start(self, iteration: int, trials: list, trial, **info):
        config = search.trial_of(trial.config).to_dict()
        timeline.mark("trial_start", "driver", trial=config["trial_id"])
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None:
            recorder.started(config)
        else:
            say(f"[start] {config['trial_id']}")

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info):
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None:
            recorder.progress(search.trial_of(trial.config).trial_id, result)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info):
        """A trial finished (its final report carries its checkpoint) or a scheduler stopped it (no checkpoint; its
        last result is the rung it was stopped at)."""
        config = search.trial_of(trial.config).to_dict()
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None and trial.checkpoint is None and search.stopped_by_scheduler(trial.last_result):
            recorder.record_stopped(config, trial.last_result)
        elif recorder is not None:
            recorder.record(config, trial.checkpoint)
        timeline.mark("trial_recorded", "driver", trial=config["trial_id"])

    def on_trial_error(self, iteration: int, trials: list, trial, **info):
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None:
            recorder.record_error(search.trial_of(trial.config).to_dict(), _error_text(trial))


def _error_text(trial) -> str:
    path = getattr(trial, "error_file", None)
    try:
        return Path(path).read_text()[-2000:] if path else "trial failed"
    except OSError:
        return f"trial failed (see {path})"


class SweepRecorder:
    """A sweep's trials in MLflow, from their start (an `Outbox` writes, on the driver, never blocking Tune):

    - a trial starts: its run is created RUNNING, with its params, tags, the spec's description and its tasks as
      dataset inputs (a trial Tune retries, or `--resume` continues, keeps its run);
    - its blocks come back: ``samples/done`` and its running scores (``running/<task>/<metric>``, the search's
      ``running/<metric>`` at each rung) with step = the samples they were computed over;
    - it ends: FINISHED (final metrics, the `TrialResult` file as ``predictions.parquet``), KILLED (a scheduler
      stopped it: its running scores at the rung, its true start and end) or FAILED (the error);
    - Rel. as soon as the baseline is known; one console line per trial."""

    def __init__(self, sweep: specs.SweepSpec, parent_id: str, n_trials: int, samples: dict[str, int] | None = None,
                 blocks: str | None = None, per_trial: int | None = None, outbox: str | Path | None = None,
                 datasets: list[dict] | None = None):
        import tempfile

        self.sweep, self.parent_id, self.n_trials = sweep, parent_id, n_trials
        self.bar = None  # the sweep's progress bar, in samples (set while Tune runs)
        self.samples_of = samples or {}  # trial id -> its samples
        self.per_trial = per_trial  # the samples of a trial on all the sweep's tasks (a searched one's)
        self.stopped: list[str] = []  # trials a scheduler stopped, in order
        self.rungs: dict[str, dict[int, float]] = {}  # trial id -> {samples scored: the search's metric there}
        self.generated = 0  # samples every trial answered (`count_generated`)
        self.blocks = blocks  # where trials save their answered blocks (checkpoints.sweep_dir)
        self.shown: dict[str, int] = {}  # trial id -> samples counted on the bar
        self.datasets = datasets or []  # the tasks as MLflow dataset inputs of each trial run
        self.client = tracking.client()
        self.experiment_id = self.client.get_run(parent_id).info.experiment_id
        earlier = tracking.latest_trial_runs(self.client, parent_id)  # a resumed sweep's runs
        self.finished = {tid for tid, r in earlier.items() if r.info.status == "FINISHED"}
        ids = {tid: r.info.run_id for tid, r in earlier.items() if tid not in self.finished}
        self.out = Outbox(self.client, outbox or tempfile.mkdtemp(prefix="promprune-outbox-"), say,
                          {PARENT: parent_id, **ids})
        self.finished |= {op["key"] for op in self.out.queue if op["op"] == "end"}  # kept by an earlier driver
        self.began: dict[str, float] = {}  # trial id -> when it (last) started, epoch seconds
        self.system = DriverMetrics(self.out)  # the driver's CPU and memory on the parent run, through the outbox
        self.records: dict[str, dict] = {}
        self.baseline_scores: dict | None = None
        self.rel_warned = False

    # ------------------------------------------------------------------------------------------------------------
    # a trial's run from its start

    def started(self, trial: dict) -> None:
        """A trial (re)started: its run opened (created, or a run of an earlier attempt RUNNING again), and one line
        saying how much of it was already done (saved blocks of an earlier run or attempt), which it does not
        generate again."""
        tid = trial["trial_id"]
        self.began[tid] = time.time()
        if tid not in self.finished:
            self._open(trial)
        done = self._saved(tid)
        if done:
            say(f"[resume] {tid}: {done} of {self.total_of(tid)} samples already done")
            self.advanced(tid, done)
        else:
            say(f"[start] {tid}")

    def _open(self, trial: dict, start: float | None = None) -> None:
        """Create the trial's run (RUNNING), or mark the run an earlier attempt left RUNNING again."""
        tid = trial["trial_id"]
        if self.out.run_id(tid) is not None or any(op["key"] == tid for op in self.out.queue):
            self.out.submit("update", tid, status="RUNNING")
            return
        start = time.time() if start is None else start
        tags = {mlflow_layout.PARENT: self.parent_id, mlflow_layout.SWEEP_RUN: self.parent_id,
                mlflow_layout.ROLE: mlflow_layout.ROLE_TRIAL,
                mlflow_layout.SWEEP: self.sweep.name, mlflow_layout.TRIAL: tid,
                mlflow_layout.VERSION: str(self.sweep.version), mlflow_layout.STARTED_AT: tracking.iso(start)}
        if self.sweep.description:
            tags[mlflow_layout.NOTE] = self.sweep.description
        self.out.submit("create", tid, experiment_id=self.experiment_id, name=tid, tags=tags,
                        params=self._params(trial), start_ms=int(start * 1000))
        wanted = trial.get("tasks") or self.sweep.tasks
        datasets = [d for d in self.datasets if d["name"] in wanted]
        if datasets:
            self.out.submit("inputs", tid, datasets=datasets)

    def progress(self, tid: str, result: dict) -> None:
        """A trial's report to Tune after a block: samples done and its running scores into its run (step: the
        samples they were computed over), the bar moved; a searched trial's value at a rung kept."""
        if "samples/done" not in result:
            return
        done = int(result["samples/done"])
        self.advanced(tid, done)
        if "trial/wall_s" in result or tid in self.finished:  # the final report: `record` logs it
            return
        self.out.submit("metrics", tid, metrics={"samples/done": done}, step=done)
        scores = {f"{mlflow_layout.RUNNING}/{k}": v for k, v in result.items() if _is_score(k, self.sweep.tasks)}
        metric = self.sweep.tune.metric
        if search.TIME_ATTR in result:  # a searched trial at a rung: its values over the first `scored` samples
            scored = int(result[search.TIME_ATTR])
            if metric in result and scored < int(result.get("samples/total", 0)):
                self.rungs.setdefault(tid, {})[scored] = float(result[metric])
                scores[f"{mlflow_layout.RUNNING}/{metric}"] = result[metric]
            self.out.submit("metrics", tid, metrics={**scores, mlflow_layout.SCORED: scored}, step=scored)
        elif scores:  # (samples/scored beside them: the saved view's charts draw running values against it)
            self.out.submit("metrics", tid, metrics={**scores, mlflow_layout.SCORED: done}, step=done)

    def total_of(self, tid: str) -> int | str:
        """A trial's samples (a trial optuna chose runs on every task)."""
        return self.samples_of.get(tid, self.per_trial or "?")

    def _saved(self, tid: str) -> int:
        if self.blocks is None:
            return 0
        from pipelines.run.checkpoints import BlockStore, trial_dir

        return BlockStore(trial_dir(self.blocks, tid)).load().num_rows

    def advanced(self, tid: str, done: int) -> None:
        """A trial's samples done so far (its progress reports): the bar moves by the new ones."""
        new = done - self.shown.get(tid, 0)
        if new > 0:
            self.shown[tid] = done
            if self.bar is not None:
                self.bar.update(new)

    def clear_blocks(self) -> None:
        """Remove the sweep's saved blocks (every trial's result is in its checkpoint and in MLflow)."""
        if self.blocks is not None:
            from pipelines.run.checkpoints import remove

            remove(self.blocks)

    # ------------------------------------------------------------------------------------------------------------
    # a trial's end

    def record(self, trial: dict, checkpoint) -> dict:
        """A finished trial from its checkpoint: the `TrialResult` file read for the metrics and scores, its run
        given them and the same file as `predictions.parquet`, then ended FINISHED (at the trial's own end)."""
        tid = trial["trial_id"]
        if tid in self.records:
            return self.records[tid]
        with checkpoint.as_directory() as d:
            path = Path(d) / mlflow_layout.PREDICTIONS_ARTIFACT
            result = TrialResult.read(path)
            metrics = dict(result.metrics)
            started = float(metrics.pop("trial/started_at", self.began.get(tid, time.time())))
            ended = started + float(metrics.get("trial/wall_s", 0))
            rec = {"trial": trial, "metrics": metrics, "scores": result.scores, "predictions": result.predictions,
                   "error": None}
            if trial["method"] is None and trial.get("repeat", 0) == 0:
                self.baseline_scores = result.scores
            self._add_rel(rec)
            if tid not in self.finished:
                if tid not in self.began:  # finished before an interruption, restored by --resume: never opened
                    self._open(trial, start=started)
                # step: the samples they were computed over, as the running values' (all of them, at the end)
                self.out.submit("metrics", tid, metrics=rec["metrics"], step=int(metrics.get("samples/total", 0)))
                self.out.submit("artifact", tid, path=str(path))
                self._end(tid, "FINISHED", ended)
            elif REL in rec["metrics"]:
                self.out.submit("metrics", tid, metrics={REL: rec["metrics"][REL]})
        self.records[tid] = rec
        self._progress(rec)
        return rec

    def _end(self, tid: str, status: str, at: float | None = None, tags: dict | None = None) -> None:
        self._close(tid, status, at, tags)
        self.finished.add(tid)

    def _close(self, key: str, status: str, at: float | None = None, tags: dict | None = None) -> None:
        """End run ``key`` (a trial's, or `PARENT`) with ``status`` at ``at`` (default now), its finish tag set."""
        at = time.time() if at is None else at
        self.out.submit("tags", key, tags={mlflow_layout.FINISHED_AT: tracking.iso(at), **(tags or {})})
        self.out.submit("end", key, status=status, end_ms=int(at * 1000))

    def record_stopped(self, trial: dict, result: dict) -> dict:
        """A trial a scheduler stopped (once): its run ended KILLED now (its true duration), tagged
        `promprune.stopped`, with the samples it had answered and its running scores at the rung it was stopped on,
        under `running/` (never a finished trial's keys), and no predictions."""
        tid = trial["trial_id"]
        if tid in self.records:
            return self.records[tid]
        scored, total = int(result.get(search.TIME_ATTR, 0)), int(result.get("samples/total", 0))
        metric = self.sweep.tune.metric
        running = {k: float(v) for k, v in result.items() if _is_score(k, self.sweep.tasks) or k == metric}
        value = running.get(metric, math.nan)
        why = (f"stopped by ASHA at {scored} of {total} samples: running {metric} {value:.4f} over the first "
               f"{scored} was below the rung's cutoff")
        rec = {"trial": trial, "metrics": {}, "scores": {}, "predictions": None, "error": None,
               "stopped": {"scored": scored, "done": int(result.get("samples/done", scored)), "total": total,
                           "running": running, "why": why}}
        if tid not in self.finished:
            self.rungs.setdefault(tid, {})[scored] = value
            if tid not in self.began:
                self._open(trial)
            self.out.submit("metrics", tid, metrics={"samples/done": rec["stopped"]["done"], search.TIME_ATTR: scored,
                                                     "samples/total": total}, step=rec["stopped"]["done"])
            self.out.submit("metrics", tid, metrics={f"{mlflow_layout.RUNNING}/{k}": v for k, v in running.items()},
                            step=scored)
            self._end(tid, "KILLED", tags={mlflow_layout.STOPPED: why})
        self.records[tid] = rec
        self.stopped.append(tid)
        say(f"[{len(self.records)}/{self.n_trials}] {tid}: {why}")
        self.advanced(tid, rec["stopped"]["done"])
        if self.bar is not None and total > rec["stopped"]["done"]:
            self.bar.total -= total - max(rec["stopped"]["done"], self.shown.get(tid, 0))  # never to be generated
            self.bar.refresh()
        return rec

    def record_error(self, trial: dict, error: str) -> None:
        """A failed trial: its run ended FAILED with the error (once: the Tune callback and the final reconcile both
        report a failure)."""
        tid = trial["trial_id"]
        self.records[tid] = {"trial": trial, "metrics": {}, "scores": {}, "predictions": None, "error": error}
        if tid not in self.finished:
            if tid not in self.began:
                self._open(trial)
            self._end(tid, "FAILED", tags={mlflow_layout.ERROR: error[:4000]})  # MLflow caps tag values
            say(f"[trial failed] {tid}: {error}")

    def count_generated(self) -> int:
        """Samples answered by every trial of the sweep, those a scheduler stopped included: a finished trial's
        samples, a stopped one's saved blocks (what it had answered, blocks in flight when it stopped included)."""
        total = 0
        for tid, rec in self.records.items():
            if rec.get("stopped"):
                total += max(rec["stopped"]["done"], self._saved(tid))
            elif rec["error"] is None:
                total += int(rec["metrics"].get("samples/total", 0))
            else:
                total += self._saved(tid)
        self.generated = total
        return total

    def finalize_rel(self) -> None:
        """Rel. for trials that finished before the baseline did."""
        for tid, rec in self.records.items():
            if rec.get("stopped") or rec["error"] is not None:
                continue
            if REL not in rec["metrics"] and self._add_rel(rec):
                self.out.submit("metrics", tid, metrics={REL: rec["metrics"][REL]})

    def _add_rel(self, rec: dict) -> bool:
        """Rel. vs the baseline; undefined (not logged, said once) when a baseline score is 0."""
        if self.baseline_scores is None:
            return False
        value = rel(rec["scores"], self.baseline_scores, self._rel_undefined)
        if math.isnan(value):
            return False
        rec["metrics"][REL] = value
        return True

    def _rel_undefined(self, why: ValueError) -> None:
        if not self.rel_warned:
            say(f"note: Rel. is not defined for this sweep: {why}")
            self.rel_warned = True

    def _params(self, trial: dict) -> dict:
        """The run's params: the trial's options as it ran them (a calibrated mu, with `mu_source`, see
        `search.trial_config`)."""
        if "mu_source" in trial:
            trial = {**trial, "options": {**trial["options"], "mu_source": trial["mu_source"]}}
        return tracking.trial_params(self.sweep.model.pretrained, trial, trial.get("tasks") or self.sweep.tasks,
                                     self.sweep.model.options)

    def _progress(self, rec: dict) -> None:
        done = len(self.records)
        m = rec["metrics"]
        shown = " ".join(f"{k}={m[k]:.3f}" for k in headline_keys(self.sweep.tasks, m) + [REL] if k in m)
        failed = int(m.get("samples/failed", 0))
        shown += f" FAILED SAMPLES={failed} (scored as the empty answer)" if failed else ""
        say(f"[{done}/{self.n_trials}] {rec['trial']['trial_id']}: {shown} "
            f"({m.get('trial/wall_s', float('nan')):.1f}s)")
        self.advanced(rec["trial"]["trial_id"], int(m.get("samples/total", 0)))
        if self.bar is not None:
            self.bar.set_postfix_str(f"{done}/{self.n_trials} trials", refresh=True)

    # ------------------------------------------------------------------------------------------------------------
    # the parent run, and the end

    def parent(self, *, metrics: dict | None = None, tags: dict | None = None, params: dict | None = None) -> None:
        """Writes to the sweep's parent run, through the same outbox."""
        if params:
            self.out.submit("params", PARENT, params=params)
        if metrics:
            self.out.submit("metrics", PARENT, metrics=metrics)
        if tags:
            self.out.submit("tags", PARENT, tags=tags)

    def end_parent(self, status: str) -> None:
        self._close(PARENT, status)

    def unlogged(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` for every write to reach MLflow; the trials (and "the sweep's parent run") whose
        writes are still pending."""
        return [("the sweep's parent run" if k == PARENT else k) for k in self.out.flush(timeout_s)]

    def close(self) -> None:
        self.system.stop()
        self.out.close()


class DriverMetrics:
    """The driver's system metrics on the parent run (MLflow's own collectors and names, ``system/...``, so the UI's
    system-metrics charts show them), sampled every `SAMPLE_S` and logged every `LOG_S` through the outbox: the one
    writer, where MLflow's `SystemMetricsMonitor` would be a second one. The actors' GPU utilisation is Ray's (the Ray
    dashboard's node metrics, `ray_node_gpus_utilization`), not repeated here."""

    SAMPLE_S, LOG_S = 10.0, 60.0

    def __init__(self, out):
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor

        self.out, self.key, self.monitor = out, PARENT, CPUMonitor()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="driver-metrics", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        step, last = 0, time.monotonic()
        while not self.done.wait(self.SAMPLE_S):
            self.monitor.collect_metrics()
            if time.monotonic() - last >= self.LOG_S:
                self._log(step)
                step, last = step + 1, time.monotonic()

    def _log(self, step: int) -> None:
        values = self.monitor.aggregate_metrics()
        self.monitor.clear_metrics()
        self.out.submit("metrics", self.key, metrics={f"system/{k}": v for k, v in values.items()}, step=step)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def _is_score(key: str, tasks: list[str]) -> bool:
    """A running score's key: ``<task>/<metric>`` of one of ``tasks``."""
    return "/" in key and key.split("/", 1)[0] in tasks


def headline_keys(tasks: list[str], metrics: dict) -> list[str]:
    """Each task's primary metric(s) (`promprune.eval.tasks.primary_metrics`, what Rel. uses), else its first
    metric."""
    from promprune.eval.tasks import primary_metrics

    keys = []
    for task in tasks:
        primary = [f"{task}/{m}" for m in primary_metrics(task)]
        keys += [k for k in primary if k in metrics] or [k for k in metrics if k.startswith(f"{task}/")][:1]
    return keys



def in_spec_order(spec: specs.SweepSpec, records: dict) -> dict:
    """``records`` in the spec's trial order (baseline, grid, explicit trials; trials a searcher chose after them, by
    id), not in the order the trials finished: the console prints the same table on every run."""
    order = {t.trial_id: i for i, t in enumerate(specs.expand(spec))}
    return {tid: records[tid] for tid in sorted(records, key=lambda t: (order.get(t, len(order)), t))}


def summary_table(spec: specs.SweepSpec, records: dict) -> str:
    """Plain-text table: one row per trial that ran to its end (or failed), the headline metric per task, Rel.,
    efficiency; trials a scheduler stopped are counted below it, not shown as rows."""
    rows = []
    stopped = [tid for tid, rec in records.items() if rec.get("stopped")]
    for tid, rec in in_spec_order(spec, records).items():
        if rec.get("stopped"):
            continue
        m, t = rec["metrics"], rec["trial"]
        row = {"trial": tid, "method": t["method"] or "none", "budget": t["budget"] if t["budget"] else "-"}
        for key in headline_keys(spec.tasks, m):
            row[key] = round(m[key], 4)
        row["rel"] = round(m[REL], 4) if REL in m else "-"
        row["vis.tok"] = _fmt(m.get("efficiency/visual_tokens"))
        row["prefill ms"] = _fmt(m.get("efficiency/prefill_ms"))
        row["failed"] = "ERROR" if rec["error"] else int(m.get("samples/failed", 0))
        rows.append(row)
    table = pd.DataFrame(rows).fillna("-").to_string(index=False) if rows else "(no trials)"
    if stopped:
        table += (f"\n{len(stopped)} more trial(s) stopped early by ASHA, not in the table (MLflow: status KILLED, tag "
                  f"{mlflow_layout.STOPPED}, running scores under {mlflow_layout.RUNNING}/)")
    return table


def best_trial(spec: specs.SweepSpec, records: dict) -> dict | None:
    """For a sweep whose trials vary mu or tau, the finished trial of the best search metric (a tie goes to the first
    trial id, whatever order the trials finished in): ``{trial_id, metric, value, mu, tau}``, and for Rel. its 95%
    paired bootstrap interval (``low``, ``high``: the documents resampled, the baseline on the same draw; the spec's
    `bootstrap` resamples, else `pipelines.reporting.paired.ITERS`). None without mu / tau varied or a finished
    trial."""
    if not mlflow_layout.varies_mu_tau(rec["trial"]["options"] for rec in records.values()):
        return None
    metric, sign = spec.tune.metric, (1 if spec.tune.mode == "max" else -1)
    done = [rec for rec in records.values() if not rec.get("stopped") and rec["error"] is None
            and any(k in rec["trial"]["options"] for k in MU_TAU) and metric in rec["metrics"]]
    if not done:
        return None
    rec = min(done, key=lambda r: (-sign * r["metrics"][metric], r["trial"]["trial_id"]))
    tid = rec["trial"]["trial_id"]
    best = {"trial_id": tid, "metric": metric, "value": float(rec["metrics"][metric]),
            **{k: rec["trial"]["options"].get(k) for k in MU_TAU}}
    base = records.get(search.BASELINE_ID)
    if metric == REL and base is not None and base.get("predictions") is not None and rec["predictions"] is not None:
        from pipelines.reporting import paired

        rows = {tid: rec["predictions"], search.BASELINE_ID: base["predictions"]}
        try:
            boot = paired.bootstrap([tid], search.BASELINE_ID, lambda t: paired.rows_from(rows[t]),
                                    iters=spec.bootstrap or paired.ITERS)
        except ValueError:  # the best trial ran on other documents than the baseline
            boot = None
        if boot is not None:
            _, best["low"], best["high"] = (float(x) for x in boot.rel(tid))
    return best


def best_metrics(best: dict | None) -> dict[str, float]:
    """The parent run's metrics of the best trial: ``best/<metric>`` (with ``_ci_low`` / ``_ci_high``), ``best/mu``,
    ``best/tau`` (the options it sets)."""
    if best is None:
        return {}
    name = f"best/{best['metric']}"
    out = {name: best["value"]}
    out.update({f"{name}_ci_{side}": best[side] for side in ("low", "high") if side in best})
    out.update({f"best/{k}": float(best[k]) for k in MU_TAU if isinstance(best.get(k), (int, float))})
    return out


def best_line(spec: specs.SweepSpec, records: dict, generated: int, best: dict | None = None) -> str | None:
    """``best rel <v> at mu=<m> tau=<t>; <S> samples generated`` (`best_trial`), for a sweep whose trials vary mu or
    tau (None otherwise). S counts every sample any trial generated, those of trials a scheduler stopped
    included."""
    if not mlflow_layout.varies_mu_tau(rec["trial"]["options"] for rec in records.values()):
        return None
    best = best if best is not None else best_trial(spec, records)
    if best is None:
        return f"no trial varying mu or tau finished with {spec.tune.metric}; {generated} samples generated"
    value = records[best["trial_id"]]["metrics"][best["metric"]]  # the trial's own value (the interval's centre too)
    where = " ".join(f"{k}={best.get(k) if best.get(k) is not None else 'default'}" for k in MU_TAU)
    return f"best {best['metric']} {value:.4f} at {where}; {generated} samples generated"


def _fmt(v: Any) -> Any:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 1)



def paired_lines(spec: specs.SweepSpec, records: dict) -> list[str]:
    """Each method's Rel. difference to the best other method at its budget with a paired bootstrap interval
    (`pipelines.reporting.paired`; the spec's `bootstrap` resamples), for the console below the summary table: which
    gaps in it are noise. Budgets descending, then the spec's trial order (the same lines in the same order on every
    run, whichever trial finished first). Empty without `bootstrap`, a finished baseline, or two methods at a
    budget."""
    base = records.get(search.BASELINE_ID)
    if not spec.bootstrap or base is None or base["predictions"] is None:
        return []
    from pipelines.reporting import paired

    done = {tid: rec for tid, rec in in_spec_order(spec, records).items()
            if rec["error"] is None and not rec.get("stopped") and rec["predictions"] is not None}
    frame = pd.DataFrame({"method": [rec["trial"]["method"] or mlflow_layout.BASELINE_METHOD for rec in done.values()],
                          "budget": [rec["trial"]["budget"] for rec in done.values()],
                          "rel": [rec["metrics"].get(REL, math.nan) for rec in done.values()]}, index=list(done))
    diffs = paired.differences(frame, search.BASELINE_ID, lambda tid: paired.rows_from(done[tid]["predictions"]),
                               iters=spec.bootstrap)
    if not diffs:
        return []
    return ([f"Rel. differences, each method against the best other at its budget (95% paired bootstrap over the "
             f"documents, {spec.bootstrap} resamples; [interval] holding 0: not told apart):"]
            + [f"  {d.budget:.0f} tokens: {d.text()}" for d in diffs])
