"""A real SQLite MLflow store in a temp dir, and a logger that writes sweeps in the pipeline's schema.

The runs are written with MLflow's own client (the real component), independently of `pipelines/recording/tracking.py`,
so these tests pin the schema the report reads rather than whatever the pipeline happens to write.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

_clock = itertools.count()  # strictly increasing start times: "latest sweep" must not depend on timer resolution


@pytest.fixture
def store(tmp_path, monkeypatch, mlflow_db):
    """(client, experiment id) on a fresh sqlite store (`mlflow_db`); MLFLOW_TRACKING_URI points at it."""
    uri = mlflow_db
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    exp = client.create_experiment("promprune", artifact_location=(tmp_path / "artifacts").as_uri())
    yield client, exp
    mlflow.set_tracking_uri(None)


def trial(method, budget, metrics, *, options=None, predictions=None, status="FINISHED", tid=None, tags=None):
    """One trial to log: method "none" is the unpruned baseline (budget None); ``tags``: more run tags."""
    options = dict(options or {})
    if tid is None:
        tid = "baseline" if method == "none" else "-".join([method, f"b{budget}"] +
                                                             [f"{k}={v}" for k, v in sorted(options.items())])
    return {"method": method, "budget": budget, "options": options, "metrics": metrics,
            "predictions": predictions, "status": status, "id": tid, "tags": dict(tags or {})}


def log_sweep(client, exp, name, trials, *, tasks, model="tiny:llava", version=1, tmp: Path,
              parent_metrics: dict | None = None, parent_tasks: bool = True) -> str:
    """Parent run + one child run per trial, as the pipeline's schema says; returns the parent run id. A trial's own
    ``tasks`` (an explicit trial on a subset) is its `tasks` param; ``parent_tasks``: log the sweep's on the parent
    (stores written before 2026-12-06 lack it)."""
    now = int(time.time() * 1000)
    parent = client.create_run(exp, run_name=name, start_time=now + next(_clock),
                               tags={"promprune.role": "sweep", "promprune.sweep": name,
                                     "promprune.spec_version": str(version)}).info.run_id
    client.log_text(parent, f"name: {name}\nversion: {version}\n", "spec.yaml")
    if parent_tasks:
        client.log_param(parent, "tasks", ",".join(tasks))
    for t in trials:
        run = client.create_run(exp, run_name=t["id"], start_time=now + next(_clock),
                                tags={"mlflow.parentRunId": parent, "promprune.role": "trial",
                                      "promprune.sweep": name, "promprune.trial": t["id"],
                                      **t.get("tags", {})}).info.run_id
        params = {"model": model, "method": t["method"], "budget": "none" if t["budget"] is None else t["budget"],
                  "tasks": ",".join(t.get("tasks") or tasks), **t["options"]}
        for key, value in params.items():
            client.log_param(run, key, str(value))
        client.log_batch(run, metrics=[Metric(k, float(v), now, 0) for k, v in t["metrics"].items()])
        if t["predictions"] is not None:
            path = tmp / "predictions.parquet"
            pd.DataFrame(t["predictions"]).to_parquet(path, index=False)
            client.log_artifact(run, str(path))
        client.set_terminated(run, status=t["status"])
    for key, value in (parent_metrics or {}).items():
        client.log_metric(parent, key, value)
    client.set_terminated(parent)
    return parent
