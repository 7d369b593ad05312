"""Driver-side logging of a sweep's trials (a Tune callback runs in the driver process: the only MLflow writer):
each finished trial's checkpoint (a `TrialResult` file) becomes an MLflow child run, its file uploaded as it is;
a trial a scheduler stopped becomes a KILLED run with its running scores; Rel. follows as soon as the baseline is
known; one progress line per trial and, at the end, the summary table, each method's paired difference to the best
other, and the best (mu, tau) with the samples generated."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from ray import tune

from pipelines import mlflow_layout, timeline, tracking
from pipelines import spec as specs
from pipelines.console import say
from pipelines.run import search
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
        config = search.trial_of(trial.config)
        timeline.mark("trial_start", "driver", trial=config["trial_id"])
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None:
            recorder.started(config)
        else:
            say(f"[start] {config['trial_id']}")

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info):
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None and "samples/done" in result:
            tid = search.trial_of(trial.config)["trial_id"]
            recorder.advanced(tid, int(result["samples/done"]))
            if search.TIME_ATTR in result:
                recorder.at_rung(tid, result)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info):
        """A trial finished (its final report carries its checkpoint) or a scheduler stopped it (no checkpoint; its
        last result is the rung it was stopped at)."""
        config = search.trial_of(trial.config)
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None and trial.checkpoint is None and search.stopped_by_scheduler(trial.last_result):
            recorder.record_stopped(config, trial.last_result)
        elif recorder is not None:
            recorder.record(config, trial.checkpoint)
        timeline.mark("trial_recorded", "driver", trial=config["trial_id"])

    def on_trial_error(self, iteration: int, trials: list, trial, **info):
        recorder = _LIVE_RECORDERS.get(self.parent_id)
        if recorder is not None:
            recorder.record_error(search.trial_of(trial.config), _error_text(trial))


def _error_text(trial) -> str:
    path = getattr(trial, "error_file", None)
    try:
        return Path(path).read_text()[-2000:] if path else "trial failed"
    except OSError:
        return f"trial failed (see {path})"


class SweepRecorder:
    """Logs each finished trial as an MLflow child run (once), with Rel. as soon as the baseline is known."""

    def __init__(self, sweep: specs.SweepSpec, parent_id: str, n_trials: int, samples: dict[str, int] | None = None,
                 blocks: str | None = None, per_trial: int | None = None):
        self.sweep, self.parent_id, self.n_trials = sweep, parent_id, n_trials
        self.bar = None  # the sweep's progress bar, in samples (set while Tune runs)
        self.samples_of = samples or {}  # trial id -> its samples
        self.per_trial = per_trial  # the samples of a trial on all the sweep's tasks (a searched one's)
        self.stopped: list[str] = []  # trials a scheduler stopped, in order
        self.rungs: dict[str, dict[int, float]] = {}  # trial id -> {samples scored: the search's metric there}
        self.generated = 0  # samples every trial answered (`count_generated`)
        self.blocks = blocks  # where trials save their answered blocks (checkpoints.sweep_dir)
        self.shown: dict[str, int] = {}  # trial id -> samples counted on the bar
        self.client = tracking.client()
        self.logged: dict[str, str] = {tid: r.info.run_id for tid, r in tracking.trial_runs(self.client,
                                                                                            parent_id).items()}
        self.records: dict[str, dict] = {}
        self.baseline_scores: dict | None = None
        self.rel_warned = False

    def started(self, trial: dict) -> None:
        """A trial (re)started: one line, saying how much of it was already done (saved blocks of an earlier run or
        attempt), which it does not generate again."""
        tid = trial["trial_id"]
        done = self._saved(tid)
        if done:
            say(f"[resume] {tid}: {done} of {self.total_of(tid)} samples already done")
            self.advanced(tid, done)
        else:
            say(f"[start] {tid}")

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

    def record(self, trial: dict, checkpoint) -> dict:
        """Log a finished trial from its checkpoint: the `TrialResult` file is read for the metrics and scores and
        uploaded as it is as the run's `predictions.parquet`."""
        tid = trial["trial_id"]
        if tid in self.records:
            return self.records[tid]
        with checkpoint.as_directory() as d:
            path = Path(d) / mlflow_layout.PREDICTIONS_ARTIFACT
            result = TrialResult.read(path)
            metrics = dict(result.metrics)
            started = metrics.pop("trial/started_at", None)
            span = None if started is None else (float(started), float(started) + float(metrics.get("trial/wall_s", 0)))
            rec = {"trial": trial, "metrics": metrics, "scores": result.scores, "predictions": result.predictions,
                   "error": None}
            if trial["method"] is None and trial.get("repeat", 0) == 0:
                self.baseline_scores = result.scores
            self._add_rel(rec)
            self.records[tid] = rec
            if tid not in self.logged:
                self.logged[tid] = tracking.log_trial(
                    self.client, self.parent_id, self.sweep.name, self.sweep.version, trial, self._params(trial),
                    rec["metrics"], path, span=span)
                self._log_rungs(tid)
            elif REL in rec["metrics"]:
                tracking.log_metrics(self.client, self.logged[tid], {REL: rec["metrics"][REL]})
        self._progress(rec)
        return rec

    def record_stopped(self, trial: dict, result: dict) -> dict:
        """Log a trial a scheduler stopped (once): a KILLED run tagged `promprune.stopped`, with the samples it had
        answered and its running scores at the rung it was stopped on, under `running/` (never a finished trial's
        keys), and no predictions."""
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
        self.records[tid] = rec
        self.stopped.append(tid)
        if tid not in self.logged:
            self.rungs.setdefault(tid, {})[scored] = value
            metrics = {"samples/done": rec["stopped"]["done"], search.TIME_ATTR: scored, "samples/total": total}
            self.logged[tid] = tracking.log_trial(self.client, self.parent_id, self.sweep.name, self.sweep.version,
                                                  trial, self._params(trial), metrics, None, status="KILLED",
                                                  tags={mlflow_layout.STOPPED: why})
            tracking.log_metrics(self.client, self.logged[tid],
                                 {f"{mlflow_layout.RUNNING}/{k}": v for k, v in running.items() if k != metric},
                                 step=scored)
            self._log_rungs(tid)
        say(f"[{len(self.records)}/{self.n_trials}] {tid}: {why}")
        self.advanced(tid, rec["stopped"]["done"])
        if self.bar is not None and total > rec["stopped"]["done"]:
            self.bar.total -= total - max(rec["stopped"]["done"], self.shown.get(tid, 0))  # never to be generated
            self.bar.refresh()
        return rec

    def at_rung(self, tid: str, result: dict) -> None:
        """A searched trial's value at a rung (`search.TIME_ATTR`), kept for its run's metric history."""
        metric = self.sweep.tune.metric
        if metric in result and int(result[search.TIME_ATTR]) < int(result.get("samples/total", 0)):
            self.rungs.setdefault(tid, {})[int(result[search.TIME_ATTR])] = float(result[metric])

    def _log_rungs(self, tid: str) -> None:
        """The trial's values at the scheduler's rungs as the history of `running/<metric>` (step: samples scored),
        which the MLflow UI plots against samples."""
        key = f"{mlflow_layout.RUNNING}/{self.sweep.tune.metric}"
        for scored, value in sorted(self.rungs.get(tid, {}).items()):
            tracking.log_metrics(self.client, self.logged[tid], {key: value}, step=scored)

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

    def record_error(self, trial: dict, error: str) -> None:
        tid = trial["trial_id"]
        self.records[tid] = {"trial": trial, "metrics": {}, "scores": {}, "predictions": None, "error": error}
        if tid not in self.logged:  # once: the Tune callback and the final reconcile both report a failure
            self.logged[tid] = tracking.log_trial(self.client, self.parent_id, self.sweep.name, self.sweep.version,
                                                  trial, self._params(trial), {}, None, status="FAILED", error=error)
            say(f"[trial failed] {tid}: {error}")

    def finalize_rel(self) -> None:
        """Rel. for trials that finished before the baseline did."""
        for tid, rec in self.records.items():
            if rec.get("stopped") or rec["error"] is not None:
                continue
            if REL not in rec["metrics"] and self._add_rel(rec) and tid in self.logged:
                tracking.log_metrics(self.client, self.logged[tid], {REL: rec["metrics"][REL]})

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


def best_line(spec: specs.SweepSpec, records: dict, generated: int) -> str | None:
    """``best rel <v> at mu=<m> tau=<t>; <S> samples generated`` (the search's metric, among the trials that ran to
    their end; a tie goes to the first trial id, whatever order the trials finished in), for a sweep whose trials
    vary mu or tau (None otherwise). S counts every sample any trial generated, those of trials a scheduler stopped
    included."""
    points = {tuple(rec["trial"]["options"].get(k) for k in MU_TAU) for rec in records.values()
              if any(k in rec["trial"]["options"] for k in MU_TAU)}
    if len(points) < 2:
        return None
    metric, sign = spec.tune.metric, (1 if spec.tune.mode == "max" else -1)
    done = [rec for rec in records.values() if not rec.get("stopped") and rec["error"] is None
            and any(k in rec["trial"]["options"] for k in MU_TAU) and metric in rec["metrics"]]
    if not done:
        return f"no trial varying mu or tau finished with {metric}; {generated} samples generated"
    best = min(done, key=lambda rec: (-sign * rec["metrics"][metric], rec["trial"]["trial_id"]))  # ties: by id
    where = " ".join(f"{k}={best['trial']['options'].get(k, 'default')}" for k in MU_TAU)
    return f"best {metric} {best['metrics'][metric]:.4f} at {where}; {generated} samples generated"


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
