"""Central scoring of predictions gathered from many shards, with lmms-eval's own evaluation loop, and Rel.

``score`` validates the prediction rows (every (task, doc_id) exactly once, none missing), then, per task, runs
lmms-eval's ``evaluator.evaluate`` with a replay model that answers each request with the recorded prediction. So
filters, ``process_results`` and the aggregations are exactly lmms-eval's (MME pairs both answers of a question
inside its aggregation), and everything is aggregated once, over all shards together.

Failed samples (``error`` set) are scored as the empty answer "", which every supported task scores as wrong: they
lower the score like any wrong answer and are never dropped. Each task's result also reports ``n_samples`` and
``n_failed``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import tempfile
from typing import Any

from promprune.eval.tasks import PRIMARY_METRICS, load_task, single_process
from promprune.records import Prediction, values

log = logging.getLogger(__name__)

COUNT_KEYS = ("n_samples", "n_failed")


def _replay_model(predictions: dict[tuple[str, int], str]):
    """An lmms-eval model that returns the recorded prediction for each request's (task, doc_id)."""
    from lmms_eval.api.model import lmms

    class Replay(lmms):
        def generate_until(self, requests):
            return [predictions[(req.task_name, int(req.doc_id))] for req in requests]

        def loglikelihood(self, requests):
            raise NotImplementedError("replayed predictions are generations; loglikelihood tasks are not supported")

        def generate_until_multi_round(self, requests):
            raise NotImplementedError("multi-round tasks are not supported")

    return Replay()


def _check_row(row: Any, index: int) -> tuple[str, int]:
    if not isinstance(row, dict):
        raise ValueError(f"prediction {index} must be a dict, got {type(row).__name__}")
    missing = [k for k in ("task", "doc_id", "n_docs", "prediction") if k not in row]
    if missing:
        raise ValueError(f"prediction {index} lacks field(s) {missing}")
    if not isinstance(row["task"], str):
        raise ValueError(f"prediction {index}: task must be a str, got {row['task']!r}")
    try:
        return row["task"], int(row["doc_id"])
    except (TypeError, ValueError):
        raise ValueError(f"prediction {index}: doc_id must be an int, got {row['doc_id']!r}") from None


def _group(predictions: list[dict]) -> dict[str, dict[int, dict]]:
    """{task: {doc_id: row}}; raises on a duplicate (task, doc_id), a missing doc or inconsistent n_docs."""
    by_task: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for i, row in enumerate(predictions):
        task, doc_id = _check_row(row, i)
        if doc_id in by_task[task]:
            raise ValueError(f"({task!r}, doc_id={doc_id}) appears twice in the predictions (rows scored once only)")
        by_task[task][doc_id] = row
    for task, rows in by_task.items():
        sizes = {int(r["n_docs"]) for r in rows.values()}
        if len(sizes) != 1:
            raise ValueError(f"task {task!r}: predictions disagree on n_docs ({sorted(sizes)})")
        (n_docs,) = sizes
        missing = sorted(set(range(n_docs)) - set(rows))
        extra = sorted(set(rows) - set(range(n_docs)))
        if missing or extra:
            raise ValueError(
                f"task {task!r}: expected doc_ids 0..{n_docs - 1}; missing {missing[:20]}"
                f"{' ...' if len(missing) > 20 else ''}{f', out of range {extra[:20]}' if extra else ''}"
            )
    return by_task


def failed(row: dict) -> bool:
    """A row failed when ``error`` holds a message (None, "" and a pandas NaN for a null all mean it did not)."""
    error = row.get("error")
    return isinstance(error, str) and error != ""


def _answer(row: dict) -> str:
    """The text scored for a row: its prediction, or "" (a wrong answer) when it failed."""
    prediction = row["prediction"]
    return "" if failed(row) or not isinstance(prediction, str) else prediction


def _metrics(task_results: dict) -> dict[str, float]:
    """lmms-eval's result entry -> {metric: float}: drop stderr and non-numeric entries, the ',none' filter suffix."""
    out = {}
    for key, value in task_results.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or "_stderr" in key:
            continue
        metric, _, filter_key = key.partition(",")
        out[metric if filter_key in ("", "none") else key] = float(value)
    return out


CI_LEVEL = 0.95
CI_SUFFIXES = ("_ci_low", "_ci_high")


def bootstrap_ci(items: list, aggregate, iters: int, *, seed: int = 0, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of ``aggregate(items)``: ``iters`` resamples of the documents with replacement.

    ``items`` are the per-document values lmms-eval's ``process_results`` produced and ``aggregate`` the task's own
    aggregation (a mean, or e.g. POPE-style F1 over records), so any task's metric gets an interval.
    """
    import numpy as np

    if not items:
        raise ValueError("no items to resample")
    rng = np.random.default_rng(seed)
    n = len(items)
    draws = rng.integers(0, n, size=(iters, n))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items) and aggregate_is_mean(aggregate):
        stats = np.asarray(items, dtype=float)[draws].mean(axis=1)
    else:
        stats = np.array([float(aggregate([items[i] for i in row])) for row in draws])
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(low), float(high)


def aggregate_is_mean(fn) -> bool:
    from lmms_eval.api.metrics import mean

    return fn is mean


def _intervals(task, samples: list[dict], metrics: dict[str, float], iters: int) -> dict[str, float]:
    """``<metric>_ci_low`` / ``_ci_high`` for every metric of the task's PRIMARY_METRICS with per-document values."""
    out = {}
    aggregations = task.aggregation()
    for metric in PRIMARY_METRICS.get(task.config.task, ()):
        if metric not in aggregations or metric not in metrics or not all(metric in s for s in samples):
            continue  # e.g. MME's perception score is aggregated from another per-document field
        low, high = bootstrap_ci([s[metric] for s in samples], aggregations[metric], iters)
        out[metric + CI_SUFFIXES[0]], out[metric + CI_SUFFIXES[1]] = low, high
    return out


def _score_task(name: str, rows: dict[int, dict], include_path, output_dir: str, bootstrap: int = 0) -> dict[str, float]:
    from lmms_eval.evaluator import evaluate

    task = load_task(name, include_path)
    n_docs = len(task.eval_docs)
    if len(rows) > n_docs:
        raise ValueError(f"task {name!r} has {n_docs} documents, the predictions cover {len(rows)}")
    limit = None if len(rows) == n_docs else len(rows)  # build_requests took the first n_docs documents
    replay = _replay_model({(name, doc_id): _answer(row) for doc_id, row in rows.items()})
    cli_args = argparse.Namespace(process_with_media=False, output_path=output_dir)
    with single_process():
        results = evaluate(
            lm=replay,
            task_dict={name: task},
            limit=limit,
            bootstrap_iters=0,  # lmms-eval's stderr is not reported; intervals are ours (bootstrap_ci), on request
            log_samples=bootstrap > 0,
            distributed_executor_backend="torchrun",  # single process: no accelerate state to set up
            cli_args=cli_args,
            process_docs_parallel=1,
            verbosity="WARNING",
        )
    metrics = _metrics(results["results"][name])
    if bootstrap:
        metrics.update(_intervals(task, results["samples"][name], metrics, bootstrap))
    metrics["n_samples"] = len(rows)
    metrics["n_failed"] = sum(failed(r) for r in rows.values())
    return metrics


def score(
    predictions: list[dict], *, include_path: str | list[str] | None = None, output_dir: str | None = None,
    bootstrap: int = 0,
) -> dict[str, dict[str, float]]:
    """Score prediction rows (from any number of shards, in any order): {task: {metric: value, n_samples, n_failed}}.

    Each row is a :class:`promprune.records.Prediction` or a dict with ``task``, ``doc_id``, ``n_docs`` (as
    ``build_requests`` made them), ``prediction`` and optionally ``error``. A (task, doc_id) given twice, a doc_id missing from 0..n_docs-1, or a malformed row is a ValueError.
    Metrics are lmms-eval's names without the ',none' filter suffix (e.g. ``pope_f1_score``, ``exact_match``).
    ``output_dir``: where tasks that write submission files (MMBench) put them; a temporary directory by default.
    ``bootstrap``: resamples for 95% percentile-bootstrap intervals of each task's primary metrics (added as
    ``<metric>_ci_low`` / ``<metric>_ci_high``); 0 (default): point estimates only.
    """
    if not isinstance(predictions, list) or not predictions:
        raise ValueError("predictions must be a non-empty list of prediction rows")
    by_task = _group([values(p) if isinstance(p, Prediction) else p for p in predictions])
    with tempfile.TemporaryDirectory(prefix="promprune-score-") as tmp:
        return {name: _score_task(name, rows, include_path, output_dir or tmp, bootstrap)
                for name, rows in by_task.items()}


def primary_score(task: str, metrics: dict[str, float], primary: dict | None = None) -> float:
    """The number a paper table shows for ``task``: the sum of its primary metrics (one metric for every paper task;
    MME is its perception score)."""
    names = (primary or PRIMARY_METRICS).get(task)
    if names is None:
        raise ValueError(f"no primary metric known for task {task!r}; pass primary={{{task!r}: (metric,)}}")
    names = (names,) if isinstance(names, str) else tuple(names)
    missing = [m for m in names if m not in metrics]
    if missing:
        raise ValueError(f"task {task!r}: metric(s) {missing} not in its scores {sorted(metrics)}")
    return float(sum(metrics[m] for m in names))


def relative_score(
    scores: dict[str, dict[str, float]], baseline_scores: dict[str, dict[str, float]], *, primary: dict | None = None
) -> float:
    """Rel. as the paper computes it: per task, primary score / the unpruned baseline's, averaged over tasks.

    Returns a fraction (1.0 = the baseline's accuracy; the paper prints it x100 as a percentage). Every task in
    ``scores`` must be in ``baseline_scores``. ``primary`` overrides ``PRIMARY_METRICS`` ({task: (metric, ...)}).
    """
    if not scores:
        raise ValueError("scores is empty")
    missing = sorted(set(scores) - set(baseline_scores))
    if missing:
        raise ValueError(f"baseline_scores lacks task(s) {missing}")
    ratios = []
    for task, metrics in scores.items():
        base = primary_score(task, baseline_scores[task], primary)
        if base == 0:
            raise ValueError(f"task {task!r}: the baseline's primary score is 0, Rel. is undefined")
        ratios.append(primary_score(task, metrics, primary) / base)
    return sum(ratios) / len(ratios)
