"""A sweep's trials as MLflow child runs, from their start to their end (`SweepRecorder`), written from the driver
(Tune's callbacks run there: `pipelines.recording.callback`) through one `Outbox`, the only MLflow writer, which never
blocks Tune and loses nothing when the store is down:

- a trial starts: its run is created RUNNING, with its params (the resolved dtype, attention and adapter options as
  on the parent run among them), tags, the spec's description and its tasks as dataset inputs (a trial Tune retries,
  or `--resume` continues, keeps its run; one made before trial runs carried those three params gets them);
- its blocks come back: ``samples/done`` and its running scores (``running/<task>/<metric>``, the search's
  ``running/<metric>`` at each rung) with step = the samples they were computed over;
- it ends: FINISHED (final metrics, the `TrialResult` file as ``predictions.parquet``, at the trial's own end), KILLED
  (a scheduler stopped it: its running scores at the rung, tag `promprune.stopped`) or FAILED (tag `promprune.error`);
- Rel. as soon as the baseline is known (`pipelines.recording.results`), the console's lines as trials start and end
  (`pipelines.recording.console`), the parent run's writes.

A resumed sweep continues the runs its earlier driver made, writing no final metric a run already has with the same
value (read once per run as the recorder starts): a run that ended (FINISHED, or KILLED by a scheduler) is
written again only for what it lacks (its Rel.: a trial that finished before the baseline, its driver killed before
the baseline did); one left RUNNING, FAILED, or marked KILLED by `pipelines.recording.tracking.mark_dead_runs` is
opened again, without its `promprune.interrupted` tag."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from pipelines import mlflow_layout
from pipelines import spec as specs
from pipelines.console import say
from pipelines.mlflow_layout import INTERRUPTED, REL
from pipelines.recording import tracking
from pipelines.recording.console import SweepConsole
from pipelines.recording.outbox import PARENT, Outbox
from pipelines.recording.results import SweepResults, is_score
from pipelines.recording.system_metrics import DriverMetrics
from pipelines.run import search
from pipelines.run.result import TrialResult


class SweepRecorder:
    """``SweepRecorder(sweep, parent_id, console, model_params=...)``: the Tune callback's ``started``, ``progress``,
    ``record``, ``record_stopped`` and ``record_error``; the driver's ``finalize_rel``, ``count_generated``,
    ``parent``, ``end_parent``, ``unlogged`` and ``close``. ``model_params``: what the workers run
    (`tracking.model_params`: dtype, attention, adapter options), the parent run's params, logged on each trial run
    too; ``outbox``: the folder where writes wait while the store does not answer (`pipelines.run.state.outbox_dir`);
    ``datasets``: the tasks as MLflow dataset inputs of each trial run."""

    def __init__(self, sweep: specs.SweepSpec, parent_id: str, console: SweepConsole, *, model_params: dict,
                 outbox: str | Path | None = None, datasets: list[dict] | None = None):
        self.sweep, self.parent_id, self.console = sweep, parent_id, console
        self.model_params = dict(model_params)
        self.results = SweepResults(sweep.tasks, sweep.tune.metric)
        self.datasets = datasets or []
        self.client = tracking.client()
        self.experiment_id = self.client.get_run(parent_id).info.experiment_id
        earlier = tracking.latest_trial_runs(self.client, parent_id)  # a resumed sweep's runs
        self.out = Outbox(self.client, outbox or tempfile.mkdtemp(prefix="promprune-outbox-"), say,
                          {PARENT: parent_id, **{tid: r.info.run_id for tid, r in earlier.items()}})
        kept = self.out.pending_ops()  # writes an earlier driver kept for a store that did not answer
        self.ended = {tid for tid, r in earlier.items() if _ended(r)} | {op["key"] for op in kept if op["op"] == "end"}
        self.has_rel = {tid for tid, r in earlier.items() if REL in r.data.metrics} | {
            op["key"] for op in kept if op["op"] == "metrics" and REL in op["metrics"]}
        # each run's latest metrics as an earlier driver left them (in MLflow, or kept for it): a final metric a run
        # already has with the same value is not written again (the outbox stamps each write when made, so MLflow
        # never takes the second for the first: a resume doubled every final metric of a run left RUNNING)
        self.logged = {PARENT: dict(self.client.get_run(parent_id).data.metrics),
                       **{tid: dict(r.data.metrics) for tid, r in earlier.items()}}
        for op in kept:
            if op["op"] == "metrics":
                self.logged.setdefault(op["key"], {}).update(op["metrics"])
        self.interrupted = {tid for tid, r in earlier.items() if INTERRUPTED in r.data.tags}
        self.errored = {tid for tid, r in earlier.items() if mlflow_layout.ERROR in r.data.tags}  # FAILED before
        # the model params each earlier run lacks (one made before trial runs carried them): given when it reopens
        self.lacking = {tid: missing for tid, r in earlier.items()
                        if (missing := {k: v for k, v in self.model_params.items() if k not in r.data.params})}
        self.began: dict[str, float] = {}  # trial id -> when it (last) started, epoch seconds
        self.tune_ids: dict[str, str] = {}  # trial id -> the Tune trial that first ran it under this driver
        self.repeats: set[str] = set()  # Tune trials of a trial another Tune trial ran: optuna's repeated proposals
        self.system = DriverMetrics(self.out)  # the driver's CPU and memory on the parent run

    @property
    def records(self) -> dict[str, dict]:
        return self.results.records

    @property
    def stopped(self) -> list[str]:
        return self.results.stopped

    @property
    def generated(self) -> int:
        return self.results.generated

    # ------------------------------------------------------------------------------------------------------------
    # a trial's run from its start

    def repeated(self, tid: str, tune_id: str | None) -> bool:
        """Whether Tune trial ``tune_id`` runs trial ``tid``, which another Tune trial ran or runs under this driver:
        a proposal optuna repeated (the same values after rounding, or options the method drops), said once (the
        console's `SweepConsole.repeated`), counted in `repeats`, its run and record left as the first made them."""
        if tune_id is None:
            return False
        first = self.tune_ids.setdefault(tid, tune_id)
        if first == tune_id:
            return False
        if tune_id not in self.repeats:
            self.repeats.add(tune_id)
            self.console.repeated(tid, self.records.get(tid), len(self.records))
        return True

    def started(self, trial: dict, tune_id: str | None = None) -> None:
        """A trial (re)started: its run opened (created, or an earlier attempt's run RUNNING again) and its line; a
        repeated proposal (`repeated`): its line only."""
        tid = trial["trial_id"]
        if self.repeated(tid, tune_id):
            return
        self.began[tid] = time.time()
        if tid not in self.ended:
            self._open(trial)
        self.console.started(tid)

    def _open(self, trial: dict, start: float | None = None) -> None:
        """Create the trial's run (RUNNING), or mark the run an earlier attempt or driver left RUNNING again."""
        tid = trial["trial_id"]
        if self.out.knows(tid):
            self.out.submit("update", tid, status="RUNNING")
            if tid in self.interrupted:  # marked as its driver stopped, or by a later start while it was dead
                self.out.submit("untag", tid, tag=INTERRUPTED)
                self.interrupted.discard(tid)
            if tid in self.errored:  # an earlier attempt's error: this one starts clean (a pass kept it)
                self.out.submit("untag", tid, tag=mlflow_layout.ERROR)
                self.errored.discard(tid)
            if tid in self.lacking:
                self.out.submit("params", tid, params=self.lacking.pop(tid))
            return
        start = time.time() if start is None else start
        tags = {mlflow_layout.PARENT: self.parent_id, mlflow_layout.SWEEP_RUN: self.parent_id,
                mlflow_layout.ROLE: mlflow_layout.ROLE_TRIAL,
                mlflow_layout.SWEEP: self.sweep.name, mlflow_layout.TRIAL: tid,
                mlflow_layout.VERSION: str(self.sweep.version), mlflow_layout.STARTED_AT: tracking.iso(start)}
        if self.sweep.description:
            tags[mlflow_layout.NOTE] = self.sweep.description
        self.out.submit("create", tid, experiment_id=self.experiment_id, name=tid, tags=tags,
                        params=trial_run_params(self.sweep, trial, self.model_params), start_ms=int(start * 1000))
        wanted = trial.get("tasks") or self.sweep.tasks
        datasets = [d for d in self.datasets if d["name"] in wanted]
        if datasets:
            self.out.submit("inputs", tid, datasets=datasets)

    def progress(self, tid: str, result: dict) -> None:
        """A trial's report to Tune after a block: samples done and its running scores into its run (step: the
        samples they were computed over), the bar moved."""
        if "samples/done" not in result:
            return
        done = int(result["samples/done"])
        self.console.advanced(tid, done)
        if "trial/wall_s" in result or tid in self.ended:  # the final report: `record` logs it
            return
        self.out.submit("metrics", tid, metrics={"samples/done": done}, step=done)
        scores = {f"{mlflow_layout.RUNNING}/{k}": v for k, v in result.items() if is_score(k, self.sweep.tasks)}
        metric = self.sweep.tune.metric
        if search.TIME_ATTR in result:  # a searched trial at a rung: its values over the first `scored` samples
            scored = int(result[search.TIME_ATTR])
            if metric in result and scored < int(result.get("samples/total", 0)):
                scores[f"{mlflow_layout.RUNNING}/{metric}"] = result[metric]
            self.out.submit("metrics", tid, metrics={**scores, mlflow_layout.SCORED: scored}, step=scored)
        elif scores:  # (samples/scored beside them: the saved view's charts draw running values against it)
            self.out.submit("metrics", tid, metrics={**scores, mlflow_layout.SCORED: done}, step=done)

    # ------------------------------------------------------------------------------------------------------------
    # a trial's end

    def record(self, trial: dict, checkpoint, tune_id: str | None = None) -> dict:
        """A finished trial from its checkpoint: the `TrialResult` file read for the metrics and scores, its run
        given them and the same file as `predictions.parquet`, then ended FINISHED (at the trial's own end)."""
        tid = trial["trial_id"]
        self.repeated(tid, tune_id)  # (a repeated proposal: said once; its first run's record stands, below)
        if tid in self.records:
            return self.records[tid]
        with checkpoint.as_directory() as d:
            path = Path(d) / mlflow_layout.PREDICTIONS_ARTIFACT
            result = TrialResult.read(path)
            started = float(result.metrics.get("trial/started_at", self.began.get(tid, time.time())))
            rec = self.results.finished(trial, result)
            metrics = rec["metrics"]
            if tid not in self.ended:
                if tid not in self.began:  # finished before an interruption, restored by --resume: never opened
                    self._open(trial, start=started)
                # step: the samples they were computed over, as the running values' (all of them, at the end)
                self._final(tid, metrics, step=int(metrics.get("samples/total", 0)))
                self.out.submit("artifact", tid, path=str(path))
                self._end(tid, "FINISHED", started + float(metrics.get("trial/wall_s", 0)))
                if REL in metrics:
                    self.has_rel.add(tid)
            elif REL in metrics:
                self._log_rel(tid, metrics[REL])
        self.console.finished(rec, len(self.records), self.sweep.tasks)
        return rec

    def record_stopped(self, trial: dict, result: dict, tune_id: str | None = None) -> dict:
        """A trial a scheduler stopped (once): its run ended KILLED now (its true duration), tagged
        `promprune.stopped`, with the samples it had answered and its running scores at the rung it was stopped on,
        under `running/` (never a finished trial's keys), and no predictions. (A repeated proposal of a trial ASHA
        stopped is ended so without starting: said here, `repeated`.)"""
        tid = trial["trial_id"]
        self.repeated(tid, tune_id)  # (a repeated proposal: said once; its first run's record stands, below)
        if tid in self.records:
            return self.records[tid]
        rec = self.results.stopped_early(trial, result)
        stop = rec["stopped"]
        if tid not in self.ended:
            if tid not in self.began:
                self._open(trial)
            self.out.submit("metrics", tid, metrics={"samples/done": stop["done"], search.TIME_ATTR: stop["scored"],
                                                     "samples/total": stop["total"]}, step=stop["done"])
            self.out.submit("metrics", tid, metrics={f"{mlflow_layout.RUNNING}/{k}": v
                                                     for k, v in stop["running"].items()}, step=stop["scored"])
            self._end(tid, "KILLED", tags={mlflow_layout.STOPPED: stop["why"]})
        self.console.stopped(rec, len(self.records))
        return rec

    def record_error(self, trial: dict, error: str, tune_id: str | None = None) -> None:
        """A failed trial: its run ended FAILED with the error (once: the Tune callback and the final reconcile both
        report a failure). A repeated proposal (`repeated`) that fails leaves a trial that finished as it was."""
        tid = trial["trial_id"]
        if self.repeated(tid, tune_id) and tid in self.records and self.records[tid]["error"] is None:
            say(f"[trial failed] {tid}, proposed again by optuna: {error} (the result of its first run stands)")
            return
        self.results.failed(trial, error)
        self.console.ended(tid)
        if tid not in self.ended:
            if tid not in self.began:
                self._open(trial)
            self._end(tid, "FAILED", tags={mlflow_layout.ERROR: error[:4000]})  # MLflow caps tag values
            say(f"[trial failed] {tid}: {error}")

    def finalize_rel(self) -> None:
        """Rel. for trials that finished before the baseline did."""
        for tid, value in self.results.late_rel().items():
            self._log_rel(tid, value)

    def count_generated(self) -> int:
        """Samples answered by every trial, those a scheduler stopped included (`SweepResults.count_generated`)."""
        return self.results.count_generated(self.console.saved)

    def _log_rel(self, tid: str, value: float) -> None:
        if tid not in self.has_rel:
            self._final(tid, {REL: value})
            self.has_rel.add(tid)

    def _final(self, key: str, metrics: dict, step: int = 0) -> None:
        """A run's final metrics (a trial's, or `PARENT`'s), less those it already has with the same value (an
        earlier driver's, before a resume): each written once."""
        had = self.logged.setdefault(key, {})
        new = {k: v for k, v in metrics.items() if not _same(had.get(k), v)}
        if new:
            self.out.submit("metrics", key, metrics=new, step=step)
            had.update(new)

    def _end(self, tid: str, status: str, at: float | None = None, tags: dict | None = None) -> None:
        self._close(tid, status, at, tags)
        self.ended.add(tid)

    def _close(self, key: str, status: str, at: float | None = None, tags: dict | None = None) -> None:
        """End run ``key`` (a trial's, or `PARENT`) with ``status`` at ``at`` (default now), its finish tag set."""
        at = time.time() if at is None else at
        self.out.submit("tags", key, tags={mlflow_layout.FINISHED_AT: tracking.iso(at), **(tags or {})})
        self.out.submit("end", key, status=status, end_ms=int(at * 1000))

    # ------------------------------------------------------------------------------------------------------------
    # the parent run, and the end

    def parent(self, *, metrics: dict | None = None, tags: dict | None = None, params: dict | None = None) -> None:
        """Writes to the sweep's parent run, through the same outbox."""
        if params:
            self.out.submit("params", PARENT, params=params)
        if metrics:
            self._final(PARENT, metrics)
        if tags:
            self.out.submit("tags", PARENT, tags=tags)

    def end_parent(self, status: str) -> None:
        self._close(PARENT, status)

    def end_interrupted(self, resume: str | None) -> None:
        """The sweep stops before its end (Ctrl-C, SIGTERM, a full disk, an error): the parent and every trial run it
        left open end KILLED, tagged with the command that resumes them (they stayed RUNNING for ever, and no later
        start marked them); a ``--resume`` opens them again, untagged, as after a dead driver."""
        tags = {INTERRUPTED: tracking.interrupted_note(resume)} if resume else {}
        for tid in self.began:
            if tid not in self.ended:
                self._close(tid, "KILLED", tags=tags)  # not ended: a resume continues it
                self.interrupted.add(tid)
        self._close(PARENT, "KILLED", tags=tags)

    def unlogged(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` for every write to reach MLflow; the trials (and "the sweep's parent run") whose
        writes are still pending."""
        return _named(self.out.flush(timeout_s))

    def close(self) -> list[str]:
        """Stop writing; the trials (and "the sweep's parent run") whose writes are still pending once the write in
        flight, if any, has landed or failed (kept in the outbox folder for `--resume`)."""
        self.system.stop()
        return _named(self.out.close())


def trial_run_params(sweep: specs.SweepSpec, trial: dict, model_params: dict) -> dict:
    """A trial run's params: the trial's options as it ran them (a calibrated mu, with `mu_source`, see
    `Trial.to_dict`) and ``model_params``, what the workers ran (`tracking.model_params`, as on the parent run)."""
    if "mu_source" in trial:
        trial = {**trial, "options": {**trial["options"], "mu_source": trial["mu_source"]}}
    return tracking.trial_params(sweep.model.pretrained, trial, trial.get("tasks") or sweep.tasks, model_params)


def _ended(run) -> bool:
    """A run this sweep ended: FINISHED, or KILLED by a scheduler (not by `mark_dead_runs`: that one continues)."""
    return run.info.status == "FINISHED" or (run.info.status == "KILLED" and mlflow_layout.STOPPED in run.data.tags)


def _same(had, value) -> bool:
    """Whether a run's logged value ``had`` (None: none) is ``value`` as MLflow keeps it (a float)."""
    try:
        return had is not None and float(had) == float(value)
    except (TypeError, ValueError):
        return False


def _named(keys: list[str]) -> list[str]:
    return [("the sweep's parent run" if k == PARENT else k) for k in keys]
