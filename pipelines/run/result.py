"""A trial's result, one record from the actors' blocks to MLflow: `TrialResult`.

    actors' Arrow blocks -> assemble_predictions (every sample exactly once, sorted) -> TrialResult.scored
    (lmms-eval scoring once, central; the flat metrics) -> TrialResult.write: one parquet file, the Tune checkpoint
    -> the driver reads it (TrialResult.read) and uploads the same file as the run's `predictions.parquet`.

The file is the predictions table (`arrow_schema(Prediction)`, one row per sample, sorted by (task, doc_id)) with
the per-task scores and the flat metrics as JSON in its schema metadata (`SCORES_KEY`, `METRICS_KEY`), so the
predictions are never re-encoded between the trial and the MLflow artifact.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from promprune.records import Prediction, arrow_schema, table_keys, to_arrow

PREDICTION_SCHEMA = arrow_schema(Prediction)
SCORES_KEY, METRICS_KEY = b"promprune.scores", b"promprune.metrics"  # the file's schema metadata (JSON)
SCORED_COLUMNS = ["task", "doc_id", "n_docs", "prediction", "error"]  # what `promprune.eval.score` reads
BYTES_PER_MB = 2 ** 20  # the paper's Table 6 reports KV cache in MiB (1440.0 MB = 2880 tokens x 0.5 MiB)
FLOPS_PER_TFLOP = 1e12
MB_PER_GB = 1024  # peak memory: the allocator's MiB as the paper's GB (GiB)


@dataclass
class TrialResult:
    """One evaluation's outcome: what a trial checkpoints, what the driver logs, what `evaluate()` returns."""

    predictions: pa.Table  # PREDICTION_SCHEMA, one row per request, sorted by (task, doc_id)
    scores: dict  # {task: {metric: value}} (lmms-eval's metrics, n_samples, n_failed)
    metrics: dict  # flat MLflow metrics: <task>/<metric>, samples/*, efficiency/*, entropy/*, t_sal/*, trial/*

    @classmethod
    def scored(cls, predictions: pa.Table, score_fn: Callable | None = None, bootstrap: int = 0) -> "TrialResult":
        """Score the assembled predictions once, centrally (`promprune.eval.score` by default), and summarize."""
        scores = score_table(predictions, score_fn, bootstrap=bootstrap)
        return cls(predictions, scores, summarize(predictions, scores))

    def to_arrow(self) -> pa.Table:
        """The predictions with the scores and metrics in the schema metadata (NaN kept: "not measured")."""
        meta = {SCORES_KEY: json.dumps(self.scores, default=float).encode(),
                METRICS_KEY: json.dumps(self.metrics, default=float).encode()}
        return self.predictions.replace_schema_metadata(meta)

    @classmethod
    def from_arrow(cls, table: pa.Table, where: str = "the table") -> "TrialResult":
        meta = table.schema.metadata or {}
        missing = [k.decode() for k in (SCORES_KEY, METRICS_KEY) if k not in meta]
        if missing:
            raise ValueError(f"{where} holds predictions but no trial result: schema metadata {missing} missing "
                             "(written by TrialResult.write)")
        return cls(table.replace_schema_metadata(None), json.loads(meta[SCORES_KEY]), json.loads(meta[METRICS_KEY]))

    def write(self, path: str | Path) -> Path:
        pq.write_table(self.to_arrow(), path)
        return Path(path)

    @classmethod
    def read(cls, path: str | Path) -> "TrialResult":
        return cls.from_arrow(pq.read_table(path), str(path))


def score_table(predictions: pa.Table, score_fn: Callable | None = None, *, partial: bool = False,
                bootstrap: int = 0, only: set[str] | None = None) -> dict:
    """lmms-eval's scores (``{task: {metric: value}}``, `promprune.eval.score` unless ``score_fn``) of a predictions
    table; ``partial``: a running score over the samples answered so far; ``only``: over these sample keys alone."""
    if score_fn is None:
        from promprune.eval import score as score_fn
    if only is not None:
        predictions = predictions.filter(pa.array([k in only for k in table_keys(predictions)], pa.bool_()))
    rows = predictions.select(SCORED_COLUMNS).to_pylist()
    kwargs = {**({"partial": True} if partial else {}), **({"bootstrap": bootstrap} if bootstrap else {})}
    return score_fn(rows, **kwargs)


def rel(scores: dict, baseline: dict, on_undefined: Callable[[ValueError], None] | None = None) -> float:
    """The paper's Rel. of ``scores`` against the unpruned ``baseline`` (`promprune.eval.relative_score`, a fraction);
    NaN where it is undefined (a baseline score of 0, a task's score NaN), after telling ``on_undefined`` why."""
    from promprune.eval import relative_score

    try:
        return float(relative_score(scores, baseline))
    except ValueError as e:
        if on_undefined is not None:
            on_undefined(e)
        return math.nan


def assemble_predictions(keys: list[str], tables: list[pa.Table]) -> pa.Table:
    """The actors' output blocks as one table sorted by (task, doc_id), checked to hold exactly one prediction per
    request key: the one place a (task, doc_id) is checked for being unique (nothing is de-duplicated silently)."""
    table = pa.concat_tables(tables) if tables else PREDICTION_SCHEMA.empty_table()
    check_exactly_once(keys, table)
    return _sorted(table)


def check_exactly_once(keys: list[str], predictions: pa.Table) -> None:
    """Every request key (`task/doc_id`) has exactly one prediction: raise naming the duplicated or missing
    samples."""
    want = set(keys)
    seen: set[str] = set()
    got = table_keys(predictions)
    dupes = sorted({k for k in got if k in seen or seen.add(k)})
    missing = sorted(want - seen)
    extra = sorted(seen - want)
    if dupes or missing or extra:
        raise RuntimeError(f"predictions are not one per sample: duplicated {dupes[:5]} ({len(dupes)}), "
                           f"missing {missing[:5]} ({len(missing)}), unexpected {extra[:5]} ({len(extra)})")


def predictions_table(preds: list[Prediction]) -> pa.Table:
    """Prediction records -> the predictions table: `PREDICTION_SCHEMA`, sorted by (task, doc_id)."""
    return _sorted(to_arrow(preds, Prediction))


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([("task", "ascending"), ("doc_id", "ascending")])


# ----------------------------------------------------------------------------------------------------------------
# the flat metrics


def _finite(values: list) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def _mean(values: list) -> float:
    values = _finite(values)
    return statistics.fmean(values) if values else float("nan")


def _median(values: list) -> float:
    values = _finite(values)
    return statistics.median(values) if values else float("nan")


def _total_prefill(vision: list, select: list, prefill: list) -> list[float | None]:
    """Per sample: vision + selection + the LLM's first forward; None where a part was not measured."""
    return [None if None in parts else float(sum(parts)) for parts in zip(vision, select, prefill)]


def summarize(predictions: pa.Table, scores: dict) -> dict[str, float]:
    """Flat metrics of one evaluation (the MLflow schema); means over the samples that did not fail."""
    error = predictions.column("error")
    ok = predictions.filter(pc.or_kleene(pc.is_null(error), pc.equal(error, "")))  # failed: an error message

    def col(name: str) -> list:
        return ok.column(name).to_pylist()

    metrics = {f"{task}/{name}": float(v) for task, ms in scores.items() for name, v in ms.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({
        "samples/total": float(predictions.num_rows),
        "samples/failed": float(predictions.num_rows - ok.num_rows),
        "efficiency/prefill_tflops": _mean(col("prefill_flops")) / FLOPS_PER_TFLOP,
        "efficiency/kv_cache_mb": _mean(col("kv_cache_bytes")) / BYTES_PER_MB,
        # Table 6's prefill latency: vision encoding + token selection + the LLM's first forward, per sample (batch 1)
        "efficiency/prefill_ms": _mean(_total_prefill(col("vision_ms"), col("select_ms"), col("prefill_ms"))),
        "efficiency/vision_ms": _mean(col("vision_ms")),
        "efficiency/select_ms": _mean(col("select_ms")),
        "efficiency/llm_prefill_ms": _mean(col("prefill_ms")),
        "efficiency/peak_mem_gb": max(_finite(col("peak_mem_mb")), default=float("nan")) / MB_PER_GB,
        "efficiency/visual_tokens": _mean(col("visual_tokens")),
        "entropy/mean": _mean(col("entropy")),
        "entropy/median": _median(col("entropy")),
        "t_sal/mean": _mean(col("saliency_count")),
        "t_sal/median": _median(col("saliency_count")),
    })
    return metrics
