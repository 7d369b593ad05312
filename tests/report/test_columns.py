"""Which logged metric stands for a benchmark in the report's tables, and in which unit (`pipelines.reporting.columns`),
against lmms-eval's own aggregations."""
from __future__ import annotations

import pandas as pd

from pipelines.reporting.columns import KNOWN_COLUMNS, column_for
from pipelines.reporting.store import Sweep
from pipelines.reporting.tables import build_score_table, score_table_markdown
from promprune.eval.tasks import OFFLINE_TASKS, PAPER_TASKS, PRIMARY_METRICS


def test_every_shipped_task_has_its_column_and_unit():
    """A task this project ships or names (PRIMARY_METRICS, the offline tasks, the paper's) without an entry would
    fall back to a guessed unit: the new task's entry is part of adding it."""
    shipped = set(PRIMARY_METRICS) | set(OFFLINE_TASKS) | set(PAPER_TASKS.values())
    assert sorted(shipped - set(KNOWN_COLUMNS)) == []
    for task, column in KNOWN_COLUMNS.items():
        assert column.metrics == PRIMARY_METRICS[task]


def _mvbench_percent(right: int, n: int) -> float:
    """lmms-eval's MVBench aggregation over n answered records, ``right`` of them right."""
    from lmms_eval.tasks.mvbench.utils import mvbench_aggregate_results

    return mvbench_aggregate_results([{"pred_answer": "(A)", "score": int(i < right)} for i in range(n)])


def test_mvbench_is_shown_in_the_percent_its_aggregation_reports():
    """lmms-eval's MVBench reports percent (2 of 4 right: 50.0); the table printed 5000.0 (x100 again)."""
    assert _mvbench_percent(2, 4) == 50.0
    for task in ("mvbench_moving_direction", "testbed_video_direction"):
        trials = pd.DataFrame({"trial": ["t0", "t1"], "method": ["none", "promprune"], "budget": [float("nan"), 196.0],
                               "status": ["FINISHED"] * 2}, index=["r0", "r1"])
        metrics = pd.DataFrame({f"{task}/mvbench_accuracy": [_mvbench_percent(2, 4), _mvbench_percent(3, 4)],
                                f"{task}/mvbench_accuracy_ci_low": [25.0, 50.0],
                                f"{task}/mvbench_accuracy_ci_high": [75.0, 100.0],
                                f"{task}/n_samples": [4, 4], f"{task}/n_failed": [0, 0]}, index=["r0", "r1"])
        table = score_table_markdown(build_score_table(Sweep("p", "video", {}, trials, metrics, sweep_tasks=[task])))
        assert "| 50.0" in table and "| 75.0" in table and "5000" not in table and "7500" not in table
        assert column_for(task, ["mvbench_accuracy"]).scale == 1.0


def test_a_task_of_ones_own_is_shown_as_logged_unless_its_metric_is_a_known_fraction():
    """Its unit is not known: a fraction-valued metric of lmms-eval's (exact match, accuracy) in percent, anything
    else as logged (gpt_eval_score is MMBench's percent or a 0-10 rating elsewhere); never a count (the old rule took
    the alphabetically first logged name: n_failed)."""
    assert column_for("own", ["exact_match", "n_samples"]).scale == 100.0
    gpt = column_for("own", ["gpt_eval_score", "n_failed"])
    assert (gpt.metrics, gpt.scale) == (("gpt_eval_score",), 1.0)
    other = column_for("own", ["n_failed", "n_samples", "zz_score", "zz_score_ci_low"])
    assert (other.metrics, other.scale) == (("zz_score",), 1.0)


def test_a_metric_nan_in_every_trial_names_the_column_only_where_no_other_has_a_number():
    """Reviewer's case: a task of one's own logging exact_match, with accuracy NaN on one document in every trial
    (only ``accuracy_n_nan`` in MLflow), was shown by accuracy (first of the fallbacks): NaN cells, a partial Rel.
    over the other benchmarks, and no paired differences. The scored metric names it; the NaN one only where no
    metric has a number."""
    scored = column_for("own", ["exact_match", "accuracy_n_nan", "n_samples"])
    assert (scored.metrics, scored.scale) == (("exact_match",), 100.0)
    assert column_for("own", ["score", "bleu_n_nan"]).metrics == ("score",)
    assert column_for("own", ["accuracy_n_nan", "n_samples"]).metrics == ("accuracy",)


def test_a_task_shown_as_logged_is_never_averaged_with_another_without_rel():
    """Without an unpruned trial the figures average benchmarks only in one known unit: a 0-10 judge rating of a task
    of one's own (shown as logged) beside POPE's percent averaged to (80 + 7.5) / 2 = 43.75 "%"; now no mean (one
    panel per benchmark). Two fraction metrics of one's own tasks, both shown in percent, still average."""
    from pipelines.reporting import figures
    from pipelines.reporting.tables import ScoreTable

    rating = column_for("my_llava_bench", ["gpt_eval_score", "n_failed"])
    assert rating.unit != "%" and column_for("own", ["zz_score"]).unit != "%"
    frame = pd.DataFrame({"pope": [0.80, 0.70], "my_llava_bench": [7.5, 6.0]})
    assert figures.cross_benchmark_mean(ScoreTable(frame, [KNOWN_COLUMNS["pope"], rating]), frame) is None
    both = pd.DataFrame({"pope": [0.80, 0.70], "own": [0.5, 0.3]})
    mean, label = figures.cross_benchmark_mean(
        ScoreTable(both, [KNOWN_COLUMNS["pope"], column_for("own", ["exact_match"])]), both)
    assert mean.tolist() == [65.0, 50.0] and "(%;" in label
