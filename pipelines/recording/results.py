"""What a sweep's trials found, as the driver learns it (`SweepResults`): one record per trial that ran to its end,
was stopped by a scheduler, or failed (the record's keys: `pipelines.recording.console`), Rel. against the baseline
as soon as the baseline is known, and the samples every trial generated."""
from __future__ import annotations

import math
from typing import Callable

from pipelines.console import say
from pipelines.mlflow_layout import REL
from pipelines.run import search
from pipelines.run.result import TrialResult, rel


class SweepResults:
    """``records`` (trial id -> record), ``stopped`` (the trials a scheduler stopped, in order) and ``generated``
    (`count_generated`) of one sweep; ``tasks`` and ``metric``: the spec's tasks and its search's metric."""

    def __init__(self, tasks: list[str], metric: str):
        self.tasks, self.metric = tasks, metric
        self.records: dict[str, dict] = {}
        self.stopped: list[str] = []
        self.generated = 0
        self.baseline_scores: dict | None = None  # the unpruned trial's scores, which Rel. divides by
        self.rel_warned = False

    def finished(self, trial: dict, result: TrialResult) -> dict:
        """A trial that ran to its end, from its `TrialResult`: its record, with Rel. when the baseline is known
        (the baseline's own is 1)."""
        metrics = dict(result.metrics)
        metrics.pop("trial/started_at", None)
        rec = {"trial": trial, "metrics": metrics, "scores": result.scores, "predictions": result.predictions,
               "error": None}
        if trial["method"] is None and trial.get("repeat", 0) == 0:
            self.baseline_scores = result.scores
        self._add_rel(rec)
        self.records[trial["trial_id"]] = rec
        return rec

    def stopped_early(self, trial: dict, result: dict) -> dict:
        """A trial a scheduler stopped, from its last result: where (``scored`` of ``total`` samples, ``done``
        answered), its running scores there (``running``: the tasks' scores and the search's metric) and ``why``."""
        scored, total = int(result.get(search.TIME_ATTR, 0)), int(result.get("samples/total", 0))
        running = {k: float(v) for k, v in result.items() if is_score(k, self.tasks) or k == self.metric}
        value = running.get(self.metric, math.nan)
        why = (f"stopped by ASHA at {scored} of {total} samples: running {self.metric} {value:.4f} over the first "
               f"{scored} was below the rung's cutoff")
        rec = {"trial": trial, "metrics": {}, "scores": {}, "predictions": None, "error": None,
               "stopped": {"scored": scored, "done": int(result.get("samples/done", scored)), "total": total,
                           "running": running, "why": why}}
        self.records[trial["trial_id"]] = rec
        self.stopped.append(trial["trial_id"])
        return rec

    def failed(self, trial: dict, error: str) -> dict:
        rec = {"trial": trial, "metrics": {}, "scores": {}, "predictions": None, "error": error}
        self.records[trial["trial_id"]] = rec
        return rec

    def late_rel(self) -> dict[str, float]:
        """Rel. of the trials that finished before the baseline did (added to their records): trial id -> Rel."""
        out = {}
        for tid, rec in self.records.items():
            if not rec.get("stopped") and rec["error"] is None and REL not in rec["metrics"] and self._add_rel(rec):
                out[tid] = rec["metrics"][REL]
        return out

    def count_generated(self, saved: Callable[[str], int]) -> int:
        """Samples answered by every trial of the sweep, those a scheduler stopped included: a finished trial's
        samples, a stopped one's saved blocks (``saved``: what it had answered, blocks in flight when it stopped
        included)."""
        total = 0
        for tid, rec in self.records.items():
            if rec.get("stopped"):
                total += max(rec["stopped"]["done"], saved(tid))
            elif rec["error"] is None:
                total += int(rec["metrics"].get("samples/total", 0))
            else:
                total += saved(tid)
        self.generated = total
        return total

    def _add_rel(self, rec: dict) -> bool:
        """Rel. vs the baseline; undefined (not logged, said once) when a baseline score is 0 or a score NaN."""
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


def is_score(key: str, tasks: list[str]) -> bool:
    """A running score's key: ``<task>/<metric>`` of one of ``tasks``."""
    return "/" in key and key.split("/", 1)[0] in tasks
