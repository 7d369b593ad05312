"""Which logged metric stands for each benchmark in a table, and how it is shown.

The pipeline logs every lmms-eval metric as `<task>/<metric>`. A paper table shows one number per benchmark,
in the paper's unit: MME as its perception score (points, up to 2000), the rest in percent. Rel. divides by
the unpruned model's number, so the unit cancels there. Every task this project ships has its entry (label, scale,
decimals) in `_DISPLAY`, where its scale is read off lmms-eval's aggregation (MMBench, MM-Vet and MVBench already
report percent); a task of one's own falls back to `column_for`'s rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from promprune.eval.scoring import CI_SUFFIXES, NAN_SUFFIX, is_count  # how scoring names a metric's bounds, counts
from promprune.eval.tasks import PRIMARY_METRICS


@dataclass(frozen=True)
class TaskColumn:
    task: str  # lmms-eval task name, as in the spec's `tasks`
    label: str  # the paper's column header
    metrics: tuple  # logged metric names (without the task prefix), summed (one for every paper benchmark)
    scale: float = 100.0  # to the paper's unit: lmms-eval reports fractions for most tasks, the paper percent
    decimals: int = 1
    unit: str = "%"  # the paper's unit once scaled: percent, or MME's points (a mean over both means nothing)


# the unit of a task of one's own shown as logged (`column_for`): not known, so never averaged with another's
AS_LOGGED = "as logged"


# The paper's column header, unit scale and decimals per benchmark (lmms-eval 0.7 names, and the offline ones).
# Which metric stands for a benchmark comes from promprune.eval's PRIMARY_METRICS, the same choice its Rel. uses.
_DISPLAY = {
    "mme": ("MME", 1.0, 1, "points"),  # the paper prints one decimal (1507.0); perception points, up to 2000
    "pope": ("POPE", 100.0, 1),
    "mmbench_en_dev_static": ("MMB", 1.0, 1),  # aggregation already in %
    "mmbench_en_dev": ("MMB", 1.0, 1),
    "textvqa_val": ("TextVQA", 100.0, 1),
    "scienceqa_img": ("SQA", 100.0, 1),
    "gqa": ("GQA", 100.0, 1),
    "vqav2_val": ("VQAv2", 100.0, 1),
    "vizwiz_vqa_val": ("VizWiz", 100.0, 1),
    "mmvet": ("MM-Vet", 1.0, 1),  # aggregation already in %
    "easyvqa_yesno": ("EasyVQA yes/no", 100.0, 1),  # POPE-style: F1
    "easyvqa_open": ("EasyVQA open", 100.0, 1),
    # the prominence testbed (promprune.testbed): existence by F1, relations by accuracy, the others by exact match
    "testbed_exist": ("Exist", 100.0, 1),
    "testbed_count": ("Count", 100.0, 1),
    "testbed_attribute": ("Attribute", 100.0, 1),
    "testbed_relation": ("Relation", 100.0, 1),
    "testbed_exist_concentrated": ("Exist (1-3 obj.)", 100.0, 1),
    "testbed_exist_spread": ("Exist (9-12 obj.)", 100.0, 1),
    "testbed_count_concentrated": ("Count (1-3 obj.)", 100.0, 1),
    "testbed_count_spread": ("Count (9-12 obj.)", 100.0, 1),
    # held-out benchmarks (sweeps/mu_calibration_grid.yaml): lmms-eval's exact match, a fraction
    "ok_vqa_val2014": ("OK-VQA", 100.0, 1),
    "realworldqa": ("RealWorldQA", 100.0, 1),
    # video: lmms-eval's MVBench aggregation (mvbench_aggregate_results), on its tasks and the offline stand-in,
    # already in %
    "testbed_video_direction": ("Direction (video)", 1.0, 1),
    "mvbench_moving_direction": ("MVBench moving direction", 1.0, 1),
    "mvbench_action_sequence": ("MVBench action sequence", 1.0, 1),
    "mvbench_object_interaction": ("MVBench object interaction", 1.0, 1),
}
KNOWN_COLUMNS = {task: TaskColumn(task, label, PRIMARY_METRICS[task], scale=shown[0], decimals=shown[1],
                                  unit=(shown[2:] or ("%",))[0])
                 for task, (label, *shown) in _DISPLAY.items()}

# for a task we do not know: the first of these that was logged (accuracy-like first), with its scale: lmms-eval's
# shared metrics of these names are means of 0/1 (fractions, shown in percent); gpt_eval_score's unit is each task's
# own (MMBench and MM-Vet percent, others a 0-5 or 0-10 rating), shown as logged
FALLBACK_METRICS = (("accuracy", 100.0), ("exact_match", 100.0), ("f1", 100.0), ("anls", 100.0),
                    ("relaxed_overall", 100.0), ("gpt_eval_score", 1.0))


def column_for(task: str, logged_metrics: list[str], primary: tuple[str, ...] | None = None) -> TaskColumn:
    """The column of `task`; `logged_metrics` are the metric names seen for it (without the `task/` prefix). A task
    without a `_DISPLAY` entry (every task this project ships has one) is shown by ``primary`` where the store has
    it (`Sweep.primary`: the sweep's `mlflow_layout.PRIMARY_PARAM`, or for an older run the task resolved through
    the `include_path` its `spec.yaml` records: the metric its own YAML lists first, which the sweep's Rel. used; a
    report that took accuracy where the task listed f1 first disagreed with the sweep's Rel.), scaled as
    `FALLBACK_METRICS` scales that name; else by `FALLBACK_METRICS`, else by the first of its logged metrics (not a
    count or a bound) as logged: its unit is not known here, and a wrong scale would print a number x100 off (Rel. is
    a ratio, the same either way).

    A metric that no trial logged a number for still names the column when its ``<metric>_n_nan`` count was logged
    and no other metric of the task has a number (it was NaN in every trial: MLflow keeps no NaN, so only the count
    is there), and the cells are NaN (the table
    says how many samples were NaN). A task none of whose metrics was logged (every trial failed) gets a column of
    no metric, all NaN: shown as dashes, as a task this project ships is in that case."""
    known = KNOWN_COLUMNS.get(task)
    if known is not None:
        return known
    if primary:
        scale = dict(FALLBACK_METRICS).get(primary[0], 1.0) if len(primary) == 1 else 1.0
        return TaskColumn(task, task, tuple(primary), scale=scale, unit="%" if scale == 100.0 else AS_LOGGED)
    # a metric known only by its NaN count names the column only where no metric has a number: an always-NaN metric
    # beside a scored one would take the column (accuracy first) and turn the row's Rel. into a partial one
    names = {m for m in logged_metrics if not is_count(m)} or {
        m[:-len(NAN_SUFFIX)] for m in logged_metrics if m.endswith(NAN_SUFFIX)}
    for name, scale in FALLBACK_METRICS:
        if name in names:
            return TaskColumn(task, task, (name,), scale=scale, unit="%" if scale == 100.0 else AS_LOGGED)
    return TaskColumn(task, task, tuple(sorted(names))[:1], scale=1.0, unit=AS_LOGGED)


def nan_samples(metrics: pd.DataFrame, column: TaskColumn) -> pd.Series:
    """Per trial, how many samples the task's process_results returned NaN for, over the column's metrics
    (``<task>/<metric>_n_nan``; 0 where none was logged): a NaN cell with a count was scored NaN, one without was
    not scored."""
    cols = [f"{column.task}/{m}{NAN_SUFFIX}" for m in column.metrics if f"{column.task}/{m}{NAN_SUFFIX}" in metrics]
    return metrics[cols].fillna(0).sum(axis=1) if cols else pd.Series(0.0, index=metrics.index)


def task_interval(metrics: pd.DataFrame, column: TaskColumn) -> tuple[pd.Series, pd.Series] | None:
    """Per-trial (low, high) 95% bootstrap bounds of a one-metric column, raw units; None when none were logged."""
    if len(column.metrics) != 1:
        return None
    cols = [f"{column.task}/{column.metrics[0]}{suffix}" for suffix in CI_SUFFIXES]
    if not all(c in metrics.columns for c in cols):
        return None
    return metrics[cols[0]], metrics[cols[1]]


def task_score(metrics: pd.DataFrame, column: TaskColumn) -> pd.Series:
    """Per-trial raw score of one benchmark: the sum of its metrics; NaN where any is missing (or it has none).

    metrics: one row per trial, columns `<task>/<metric>`.
    """
    cols = [f"{column.task}/{m}" for m in column.metrics]
    present = [c for c in cols if c in metrics.columns]
    if not cols or len(present) < len(cols):  # (no metric: a task none of whose metrics was logged)
        return pd.Series(np.nan, index=metrics.index)
    return metrics[present].sum(axis=1, skipna=False)
