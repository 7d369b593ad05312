"""Find a sweep in the MLflow store and load its trials (params, metrics) and per-sample predictions.

The schema is `pipelines.mlflow_layout`, the one `pipelines/sweep.py` writes through `pipelines.recording`.
"""
from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from pipelines import mlflow_layout
from pipelines.mlflow_layout import BASELINE_METHOD, PREDICTIONS_ARTIFACT, tracking_uri  # noqa: F401 - re-exported



@dataclass
class Sweep:
    """One sweep: its parent run and its trials, one row per trial (index = trial run id)."""

    run_id: str
    name: str
    tags: dict
    trials: pd.DataFrame  # columns: trial, method, budget (float, NaN for the baseline), status, + option columns
    metrics: pd.DataFrame  # same index; columns are metric keys (`pope/pope_f1_score`, `rel`, ...)
    option_names: list = field(default_factory=list)  # option columns present in `trials`
    parent_metrics: dict = field(default_factory=dict)  # the parent run's metrics (samples/generated, trials/*)
    status: str = "FINISHED"  # the parent run's: RUNNING while its driver runs (or after it was killed), KILLED, ...
    planned: int | None = None  # the trials the sweep set out to run (its `trials` param; None in older stores)
    bootstrap: int | None = None  # the spec's `bootstrap` resamples (its param; 0: none set; None in older stores)
    sweep_tasks: list = field(default_factory=list)  # the spec's tasks (the parent's `tasks` param), in its order
    experiment_id: str | None = None  # the parent run's experiment (an earlier sweep's calibration is read there)
    # after `mean_over_repeats`: per row that is the mean of several runs, those runs' own metrics
    repeat_metrics: dict = field(default_factory=dict)
    # {task: (metric, ...)}: the metric each task of one's own was scored by (the parent's `PRIMARY_PARAM`; in older
    # stores `_recorded_primary`; {} where every task is one promprune.eval names), which its column shows
    primary: dict = field(default_factory=dict)

    def unfinished(self) -> str | None:
        """What a report of an unfinished sweep lacks, in one sentence (None: the sweep finished)."""
        return unfinished_note(self.status, self.planned, len(self.trials),
                               int((self.trials["status"] == "FINISHED").sum()))

    @property
    def stopped(self) -> pd.Series:
        """Per trial: whether a scheduler stopped it early (tag `promprune.stopped`; its scores are running ones,
        under `running/`)."""
        return self.trials["stopped"] if "stopped" in self.trials else pd.Series(False, index=self.trials.index)

    def ran_to_end(self) -> "Sweep":
        """The sweep without the trials a scheduler stopped early: what every table and figure of finished trials
        reads, so a stopped trial is never taken for a finished one."""
        keep = ~self.stopped
        return replace(self, trials=self.trials[keep], metrics=self.metrics[keep])

    def mean_over_repeats(self) -> "Sweep":
        """One row per configuration: the runs of a configuration that a grid with ``tune.num_samples`` > 1 ran
        several times (param ``repeat``) become one row, under the run id, trial id and status of its first FINISHED
        repeat (the lowest ``repeat`` among them; its predictions are the row's, what the paired intervals and the
        figures read, and its id the one the CSV tables give), whose metrics are the mean over its FINISHED runs (NaN
        skipped); ``repeat_metrics`` keeps those runs' own metrics (the tables' spread and count: a repeat that
        failed is not counted). A configuration none of whose runs finished stays a row that is not FINISHED, under
        its lowest repeat (its metrics the mean of what its runs logged: no scores, so dashes and no paired
        interval). A trial a scheduler stopped stays a row of its own."""
        if "repeat" not in self.trials or not (self.trials["repeat"] > 0).any():
            return self
        config = [c for c in self.trials.columns if c not in ("trial", "status", "stopped", "repeat")]
        keys = pd.Series(["\x1f".join(map(str, row)) for row in self.trials[config].itertuples(index=False)],
                         index=self.trials.index)
        keys = keys.where(~self.stopped.astype(bool), "\x1e" + self.trials.index.to_series())
        finished = self.trials["status"] == "FINISHED"
        first = self.trials.assign(_unfinished=~finished).sort_values(["_unfinished", "repeat"], kind="stable").index
        row = keys.loc[first].drop_duplicates()  # per configuration: its first finished repeat, else its lowest
        row_of = keys.map(pd.Series(row.index, index=row.to_numpy()))  # each run -> its configuration's row
        keep = self.trials.index[self.trials.index.isin(row.index)]  # in the sweep's order
        counted = finished | ~finished.groupby(row_of).transform("any")  # a configuration's finished runs, if any
        kept = self.metrics[counted]
        groups = kept.groupby(row_of[counted], sort=False)
        metrics = groups.mean().reindex(keep)
        at = groups.indices  # each row -> its counted runs' positions, in the sweep's order: one pass over the runs
        runs = row_of.value_counts()
        repeats = {rid: kept.iloc[at[rid]] for rid in keep if runs[rid] > 1}
        return replace(self, trials=self.trials.loc[keep], metrics=metrics, repeat_metrics=repeats)

    @property
    def baseline_id(self) -> str | None:
        ids = self.trials.index[self.trials["method"] == BASELINE_METHOD]
        return ids[0] if len(ids) else None

    def tasks(self) -> list[str]:
        """Benchmarks in the spec's order: the parent run's `tasks` param, then any other a trial's `tasks` param
        names (an explicit trial may run on a subset: Table 4's fixed splits, one benchmark each), oldest trial first;
        without `tasks` params, every `<task>/` metric prefix."""
        logged = list(self.sweep_tasks)
        if "tasks" in self.trials.columns:
            for value in self.trials["tasks"].dropna().iloc[::-1]:  # rows come newest first
                logged += parse_task_list(value)
        if logged:
            return list(dict.fromkeys(logged))
        prefixes = [c.split("/", 1)[0] for c in self.metrics.columns if "/" in c]
        return list(dict.fromkeys(p for p in prefixes if p not in mlflow_layout.NON_TASK_PREFIXES))


def unfinished_note(status: str, planned: int | None, started: int, finished: int) -> str | None:
    """``status``: the parent run's; ``planned``: the trials the sweep set out to run; ``started``: trials with a
    run; ``finished``: runs FINISHED."""
    if status == "FINISHED":
        return None
    why = {"RUNNING": "its parent run is still RUNNING: the sweep is running, or its driver was killed",
           "KILLED": "it was interrupted (parent run KILLED)", "FAILED": "its driver failed (parent run FAILED)"}
    never = "" if planned is None else f"; {max(planned - started, 0)} of its {planned} trials never started"
    return (f"the sweep is unfinished ({why.get(status, f'parent run {status}')}): {started} trial(s) have a run, "
            f"{finished} finished{never}. Its tables show dashes for what is missing; `python pipelines/sweep.py "
            "--config <its spec> --resume` finishes it")


def parse_task_list(value) -> list[str]:
    """`tasks` param as logged: "['mme', 'pope']", "mme,pope" or a list."""
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    text = str(value).strip().strip("[]")
    return [t.strip().strip("'\"") for t in text.split(",") if t.strip().strip("'\"")]


def find_sweep_run(ref: str | None = None, flag: str = "--sweep") -> pd.Series:
    """The parent run of sweep `ref` (a run id, or a sweep name: its latest run), or the latest sweep, in the sweeps'
    experiment (`mlflow_layout.experiment_name`: ``promprune``, or ``MLFLOW_EXPERIMENT_NAME``), where the sweep
    wrote it; ``flag``: the option that gave `ref` (``--sweep``, ``--grid``), named when no sweep matches. A sweep of
    another experiment is never taken: when only another has one, the refusal names that experiment and how to
    select it."""
    experiment = mlflow_layout.experiment_name()
    exp = MlflowClient().get_experiment_by_name(experiment)
    runs = _sweep_runs([exp.experiment_id] if exp is not None else [])
    found = _match(runs, ref)
    if found is not None:
        return found
    how = (f"{mlflow_layout.EXPERIMENT_ENV}" if os.environ.get(mlflow_layout.EXPERIMENT_ENV) is not None else
           f"the default; {mlflow_layout.EXPERIMENT_ENV} selects another")
    where = f"experiment {experiment!r} ({how}) of the MLflow store {mlflow.get_tracking_uri()}"
    if ref is None:
        what = f"no sweep runs (tag {mlflow_layout.ROLE}={mlflow_layout.ROLE_SWEEP}) in {where}"
    else:
        known = ", ".join(_names(runs).dropna().drop_duplicates().sort_values()) or "none"
        what = f"{flag} {ref!r}: no sweep run with that name or run id in {where} (its sweeps: {known})"
    others = _elsewhere(ref, exp.experiment_id if exp is not None else None)
    if not others:
        raise LookupError(what + ("; run `python pipelines/sweep.py` first" if ref is None else ""))
    shown = ", ".join(repr(name) for name in others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    has = ("s " + shown + " have") if len(others) > 1 else (" " + shown + " has")
    raise LookupError(f"{what}; experiment{has} {'one' if ref is None else 'it'}: to read it, select that "
                      f"experiment with `{mlflow_layout.EXPERIMENT_ENV}={shlex.quote(others[0])}` in front of "
                      "the command (the report reads, and logs to, the one experiment the sweeps write to)")


def _sweep_runs(experiment_ids: list[str] | None) -> pd.DataFrame:
    """The sweeps' parent runs, newest first, in these experiments (None: every experiment)."""
    if experiment_ids is not None and not experiment_ids:
        return pd.DataFrame(columns=["run_id", "experiment_id"])
    return mlflow.search_runs(experiment_ids=experiment_ids, search_all_experiments=experiment_ids is None,
                              filter_string=mlflow_layout.tag_filter(mlflow_layout.ROLE, mlflow_layout.ROLE_SWEEP),
                              order_by=["attributes.start_time DESC"], output_format="pandas")


def _names(runs: pd.DataFrame) -> pd.Series:
    """Each run's sweep name: its sweep tag, else its run name."""
    names = pd.Series(pd.NA, index=runs.index, dtype=object)
    for tag in (mlflow_layout.tag_column(mlflow_layout.SWEEP), mlflow_layout.tag_column(mlflow_layout.RUN_NAME)):
        if tag in runs.columns:
            names = names.fillna(runs[tag])
    return names


def _match(runs: pd.DataFrame, ref: str | None) -> pd.Series | None:
    """The run of ``runs`` (newest first) that ``ref`` names (a run id, else a sweep name: its newest run; None: the
    newest run), None when none does."""
    if runs.empty:
        return None
    if ref is None:
        return runs.iloc[0]
    for matches in (runs["run_id"] == ref, _names(runs) == ref):
        matches = matches.fillna(False).astype(bool)
        if matches.any():
            return runs[matches].iloc[0]
    return None


def _elsewhere(ref: str | None, experiment_id: str | None) -> list[str]:
    """The names of the other experiments holding the sweep ``ref`` (None: any sweep), the one with the newest such
    run first."""
    runs = _sweep_runs(None)
    if runs.empty:
        return []
    runs = runs[runs["experiment_id"] != experiment_id]
    if ref is not None:
        runs = runs[(runs["run_id"] == ref) | (_names(runs) == ref).fillna(False).astype(bool)]
    client = MlflowClient()
    return [client.get_experiment(e).name for e in dict.fromkeys(runs["experiment_id"])]


def load_sweep(ref: str | None = None, flag: str = "--sweep") -> Sweep:
    """The sweep `ref` (see `find_sweep_run`; ``flag``: the option that gave it) with its trials; a retried trial
    counts once (its latest finished run)."""
    parent = find_sweep_run(ref, flag)
    runs = mlflow.search_runs(experiment_ids=[parent["experiment_id"]],
                              filter_string=mlflow_layout.tag_filter(mlflow_layout.PARENT, parent["run_id"]),
                              order_by=["attributes.start_time DESC"], output_format="pandas")
    role = mlflow_layout.tag_column(mlflow_layout.ROLE)
    if role in runs.columns:
        runs = runs[runs[role].fillna(mlflow_layout.ROLE_TRIAL) == mlflow_layout.ROLE_TRIAL]
    runs = _latest_per_trial(runs)
    planned = pd.to_numeric(pd.Series([parent.get("params.trials")]), errors="coerce").iloc[0]
    planned = None if pd.isna(planned) else int(planned)
    if runs.empty:
        note = unfinished_note(parent["status"], planned, 0, 0) or "the sweep finished without trials"
        raise LookupError(f"sweep run {parent['run_id']} has no trial runs: {note}")
    tags = {k[len("tags."):]: v for k, v in parent.items() if k.startswith("tags.") and isinstance(v, str)}
    name = tags.get(mlflow_layout.SWEEP) or tags.get(mlflow_layout.RUN_NAME) or parent["run_id"]
    trials, metrics, options = _split_columns(runs)
    parent_metrics = {k[len("metrics."):]: float(v) for k, v in parent.items()
                      if k.startswith("metrics.") and v is not None and v == v}
    bootstrap = pd.to_numeric(pd.Series([parent.get("params.bootstrap")]), errors="coerce").iloc[0]
    sweep = Sweep(parent["run_id"], name, tags, trials, metrics, options, parent_metrics, parent["status"], planned,
                  None if pd.isna(bootstrap) else int(bootstrap), _parent_tasks(parent), parent["experiment_id"],
                  primary=_parent_primary(parent))
    if not isinstance(parent.get(f"params.{mlflow_layout.PRIMARY_PARAM}"), str):  # a run recorded before the param
        sweep = replace(sweep, primary=_recorded_primary(parent["run_id"], sweep.tasks()))
    return sweep


def _parent_primary(parent: pd.Series) -> dict[str, tuple[str, ...]]:
    """The parent's `mlflow_layout.PRIMARY_PARAM` ({} where it has none, or one this code cannot read)."""
    value = parent.get(f"params.{mlflow_layout.PRIMARY_PARAM}")
    try:
        loaded = json.loads(value) if isinstance(value, str) else {}
    except ValueError:
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {task: tuple(m for m in metrics if isinstance(m, str)) for task, metrics in loaded.items()
            if isinstance(task, str) and isinstance(metrics, list) and metrics}


def _recorded_primary(run_id: str, tasks: list[str]) -> dict[str, tuple[str, ...]]:
    """For a parent run recorded without `mlflow_layout.PRIMARY_PARAM` (before 2026-12-08): the metric each of
    ``tasks`` that promprune.eval does not name was scored by, resolved as the sweep resolved it
    (`promprune.eval.tasks.own_primary_metrics`) through the task folders its `spec.yaml` records (`include_path`)
    where they are still here; {} where it records none, none is here or its spec cannot be read (the columns then
    take `columns.FALLBACK_METRICS`)."""
    from promprune.eval.tasks import PRIMARY_METRICS, own_primary_metrics

    own = [task for task in tasks if task not in PRIMARY_METRICS]
    if not own:
        return {}
    import yaml

    text = mlflow_layout.spec_text(MlflowClient(), run_id)
    try:
        recorded = yaml.safe_load(text) if text is not None else None
    except yaml.YAMLError:
        return {}
    paths = recorded.get("include_path") if isinstance(recorded, dict) else None
    paths = [paths] if isinstance(paths, str) else paths if isinstance(paths, list) else []
    paths = [p for p in paths if isinstance(p, str) and Path(p).is_dir()]
    if not paths:
        return {}
    try:
        return own_primary_metrics(own, paths)
    except (ValueError, OSError):  # a task folder lmms-eval cannot index (any more): the fallback list
        return {}


def _parent_tasks(parent: pd.Series) -> list[str]:
    """The sweep's tasks as its parent run logged them (none in a store without the param)."""
    value = parent.get("params.tasks")
    return parse_task_list(value) if isinstance(value, str) else []


def _latest_per_trial(runs: pd.DataFrame) -> pd.DataFrame:
    """One run per `promprune.trial` tag: the newest FINISHED one, else the newest (runs come newest first; a
    trial a scheduler stopped is KILLED)."""
    trial = mlflow_layout.tag_column(mlflow_layout.TRIAL)
    if runs.empty or trial not in runs.columns:
        return runs
    runs = runs.assign(_finished=(runs["status"] == "FINISHED").astype(int))
    runs = runs.sort_values(["_finished", "start_time"], ascending=[False, False], kind="stable")
    trial_key = runs[trial].fillna(runs["run_id"])
    return runs[~trial_key.duplicated()].drop(columns="_finished")


def _split_columns(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list]:
    """search_runs' flat frame -> (trials: ids, method, budget, options; metrics: `metrics.` prefix removed)."""
    runs = runs.set_index("run_id")
    params = {c[len("params."):]: runs[c] for c in runs.columns if c.startswith("params.")}
    metrics = pd.DataFrame({c[len("metrics."):]: runs[c].astype(float)
                            for c in runs.columns if c.startswith("metrics.")}, index=runs.index)
    if "method" not in params:
        raise ValueError("trial runs have no `method` param: is this store written by pipelines/sweep.py?")
    trials = pd.DataFrame(index=runs.index)
    trials["trial"] = runs.get(mlflow_layout.tag_column(mlflow_layout.TRIAL), pd.Series(runs.index, index=runs.index))
    trials["status"] = runs["status"]
    stopped = mlflow_layout.tag_column(mlflow_layout.STOPPED)
    trials["stopped"] = runs[stopped].notna() if stopped in runs.columns else False
    trials["method"] = params["method"].fillna(BASELINE_METHOD)
    trials["budget"] = pd.to_numeric(params.get("budget", pd.Series(np.nan, index=runs.index)), errors="coerce")
    repeat = pd.to_numeric(params.get("repeat", pd.Series(np.nan, index=runs.index)), errors="coerce")
    trials["repeat"] = repeat.fillna(0).astype(int)  # a grid's num_samples > 1: the same configuration run again
    for key in ("model", "tasks"):
        if key in params:
            trials[key] = params[key]
    # params that describe a method's behaviour (shown in labels when they vary): every param but the model, tasks,
    # ids and such, so the options of a method registered outside promprune (a sweep's plugins) count too
    options = sorted(k for k in params if k not in mlflow_layout.NON_OPTION_PARAMS)
    for key in options:
        trials[key] = params[key].map(parse_param)
    return trials, metrics, options


def parse_param(value):
    """MLflow params are strings: numbers back to float, "None"/"" to None, True/False to bool, else the string."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    text = str(value).strip()
    if text in ("", "None", "null"):
        return None
    if text in ("True", "true", "False", "false"):
        return text in ("True", "true")
    try:
        return float(text)
    except ValueError:
        return text


def load_predictions(run_id: str) -> pd.DataFrame | None:
    """The trial's `predictions.parquet` artifact, or None when it has none."""
    client = MlflowClient()
    names = {a.path for a in client.list_artifacts(run_id)}
    if PREDICTIONS_ARTIFACT not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=PREDICTIONS_ARTIFACT, dst_path=tmp)
        return pd.read_parquet(path)
