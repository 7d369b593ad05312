"""Find a sweep in the MLflow store and load its trials (params, metrics) and per-sample predictions.

The schema is `pipelines.mlflow_layout`, the one `pipelines/sweep.py` writes through `pipelines.recording`.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace

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
    """The parent run of sweep `ref` (a run id, or a sweep name: its latest run), or the latest sweep; ``flag``: the
    option that gave `ref` (``--sweep``, ``--grid``), named when no sweep matches."""
    runs = mlflow.search_runs(search_all_experiments=True,
                              filter_string=mlflow_layout.tag_filter(mlflow_layout.ROLE, mlflow_layout.ROLE_SWEEP),
                              order_by=["attributes.start_time DESC"], output_format="pandas")
    if runs.empty:
        raise LookupError(f"no sweep runs (tag {mlflow_layout.ROLE}={mlflow_layout.ROLE_SWEEP}) in the MLflow store "
                          f"{mlflow.get_tracking_uri()}; "
                          "run `python pipelines/sweep.py` first")
    if ref is None:
        return runs.iloc[0]
    by_id = runs[runs["run_id"] == ref]
    if len(by_id):
        return by_id.iloc[0]
    names = pd.Series(pd.NA, index=runs.index, dtype=object)
    # the sweep tag, else the name
    for tag in (mlflow_layout.tag_column(mlflow_layout.SWEEP), mlflow_layout.tag_column(mlflow_layout.RUN_NAME)):
        if tag in runs.columns:
            names = names.fillna(runs[tag])
    by_name = runs[names == ref]
    if len(by_name):
        return by_name.iloc[0]
    known = ", ".join(sorted(set(names.dropna())))
    raise LookupError(f"{flag} {ref!r}: no sweep run with that name or run id; sweeps in the store: {known}")


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
    return Sweep(parent["run_id"], name, tags, trials, metrics, options, parent_metrics, parent["status"], planned,
                 None if pd.isna(bootstrap) else int(bootstrap), _parent_tasks(parent))


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
