"""The report reads what the pipeline's own MLflow writer (`pipelines/recording/tracking.py`) and predictions frame
write.

The other tests log runs by hand from the schema; this one goes through the pipeline's functions, so a drift
between writer and reader (param spelling, the baseline's budget, list columns in parquet) fails here.
"""
from __future__ import annotations

import numpy as np

from promprune.records import Prediction

from pipelines.recording import tracking
from pipelines.run import result

from pipelines.reporting.build import build_report
from pipelines.reporting.store import load_sweep

TASKS = ["easyvqa_yesno", "easyvqa_open"]
GRID = 36  # the tiny LLaVA's 6 x 6 visual tokens


def preds(n_sal, folder):
    """The trial's `TrialResult` file, as its Tune checkpoint holds it and the driver uploads it."""
    table = result.predictions_table([
        Prediction(task=task, doc_id=doc, n_docs=3, prompt="q?", prediction="yes", entropy=0.2 + 0.01 * doc,
                   saliency_count=n_sal, visual_tokens=16, kept=list(range(0, 32, 2)), prefill_ms=1.0)
        for task in TASKS for doc in range(3)])
    folder.mkdir()
    return result.TrialResult(table, {}, {}).write(folder / "predictions.parquet")


def test_report_on_runs_written_by_the_pipeline(store, tmp_path):
    del store  # only its MLFLOW_TRACKING_URI matters: the pipeline's writer reads it
    c = tracking.client()
    parent = tracking.start_sweep(c, "pipe_demo", 2, "name: pipe_demo\nversion: 2\n", {})
    runs = [({"method": None, "budget": None, "options": {}, "trial_id": "baseline"},
             {"easyvqa_yesno/f1": 0.5, "easyvqa_open/exact_match": 0.25, "efficiency/visual_tokens": GRID}, None),
            ({"method": "promprune", "budget": 16, "options": {"mu": 0.42, "tau": 0.02}, "trial_id": "promprune-b16"},
             {"easyvqa_yesno/f1": 0.4, "easyvqa_open/exact_match": 0.25, "efficiency/visual_tokens": 16},
             preds(10, tmp_path / "trial"))]
    for trial, metrics, frame in runs:
        params = tracking.trial_params("tiny:llava", trial, TASKS, {})
        tracking.log_trial(c, parent, "pipe_demo", 2, trial, params, metrics, frame)
    tracking.finish(c, parent)

    sweep = load_sweep()  # the latest sweep: this one
    assert sweep.name == "pipe_demo" and sweep.tags["promprune.spec_version"] == "2"
    assert sweep.tasks() == TASKS
    base = sweep.trials.loc[sweep.baseline_id]
    assert base["method"] == "none" and np.isnan(base["budget"])
    report = build_report(sweep, tmp_path / "out", image_source=lambda t, d: (np.zeros((24, 24, 3), np.uint8), ""))
    assert "| PromPrune | 16 | 40.0 | 25.0 | 90.0% |" in report.markdown  # Rel. = (0.4/0.5 + 0.25/0.25) / 2
    names = {p.name for p in report.files}
    assert {"entropy_histograms.png", "overlay_easyvqa_yesno_0.png", "overlay_easyvqa_open_0.png"} <= names


def test_trials_on_a_subset_of_the_tasks_leave_every_task_in_the_report(store, tmp_path):
    """Table 4's layout: explicit trials each on one benchmark, logged after the trials on all of them. The report's
    benchmarks are the sweep's (its parent's `tasks` param, in the spec's order), not the newest trial's one; a store
    without that param takes every trial's, oldest first."""
    del store
    c = tracking.client()
    parent = tracking.start_sweep(c, "subset_demo", 1, "name: subset_demo\nversion: 1\n",
                                  {"tasks": ",".join(TASKS)})
    runs = [({"method": None, "budget": None, "options": {}, "trial_id": "baseline"}, TASKS,
             {"easyvqa_yesno/f1": 0.5, "easyvqa_open/exact_match": 0.25}),
            ({"method": "promprune", "budget": 16, "options": {"mu": 0.42}, "trial_id": "promprune-b16"}, TASKS,
             {"easyvqa_yesno/f1": 0.4, "easyvqa_open/exact_match": 0.25}),
            ({"method": "fixed_ratio", "budget": 16, "options": {"saliency_ratio": 0.5}, "trial_id": "fixed-open",
              "tasks": ["easyvqa_open"]}, ["easyvqa_open"], {"easyvqa_open/exact_match": 0.2})]
    for trial, tasks, metrics in runs:
        tracking.log_trial(c, parent, "subset_demo", 1, trial, tracking.trial_params("tiny:llava", trial, tasks, {}),
                           metrics, None)
    tracking.finish(c, parent)
    sweep = load_sweep("subset_demo")
    assert sweep.trials.loc[sweep.trials["trial"] == "fixed-open", "tasks"].map(str).str.contains("open").all()
    assert sweep.tasks() == TASKS
    table = build_report(sweep, tmp_path / "out").markdown
    # both benchmarks' columns; a Rel. over one of them is marked and not compared with one over both (no best)
    assert "| PromPrune | 16 | 40.0 | **25.0** | 90.0% |" in table
    assert "| Fixed split | 16 | – | 20.0 | 80.0% (over 1 of 2 benchmarks) |" in table
    older = load_sweep("subset_demo")
    older.sweep_tasks = []  # a store written before the parent logged its tasks
    assert older.tasks() == TASKS
