"""One evaluation on Ray Data: (model, method, budget, options, tasks) -> predictions, scores, metrics.

    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 \
        --tasks easyvqa_yesno easyvqa_open --limit 8

Setup -> run -> cleanup:

1. rows: `promprune.eval.build_requests(tasks, limit=...)` (task, doc_id, prompt, image bytes, gen_kwargs), on the
   driver for small evaluations or in parallel shards as Ray tasks for large ones, materialized once in the object
   store; each row is pickled into one `payload` cell so any row schema travels unchanged.
2. `dataset.map_batches(VLMPredictor, compute=ActorPoolStrategy(size=workers), num_gpus=...,
   batch_size=...)`: every actor loads a `PrunedVLM` once in `__init__` (one GPU each when the cluster has GPUs,
   CPU otherwise) and answers batches under `torch.inference_mode()`. `DataContext.wait_for_min_actors_s` is
   finite, so a pool that cannot be scheduled fails instead of hanging. Actors restart and their tasks retry
   when a node dies; the output is checked to hold every sample exactly once (nothing is de-duplicated silently).
3. Central scoring: `promprune.eval.score(predictions)` aggregates once over all shards.

Run as a script it also logs one MLflow run (role `evaluation`) with the same metrics and artifacts as a sweep
trial. `pipelines/sweep.py` calls `evaluate()` inside each Ray Tune trial.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import ray

from pipelines import tracking
from pipelines.weights import ModelSource

# The prediction columns kept in predictions.parquet (the MLflow schema; pipelines/report.py reads them).
PREDICTION_COLUMNS = ("task", "doc_id", "prediction", "error", "entropy", "saliency_count", "visual_tokens", "kept",
                      "salient", "timings", "text_tokens", "prefill_flops", "kv_cache_bytes", "peak_mem_mb")
TIMING_FIELDS = ("vision_ms", "select_ms", "prefill_ms", "decode_ms")  # per-sample ms (of the sample's batch)
REPO = Path(__file__).resolve().parents[1]
QUIET_ENV = {"LOGURU_LEVEL": "WARNING"}  # lmms-eval logs every request build at DEBUG through loguru
BYTES_PER_MB = 2 ** 20  # the paper's Table 6 reports KV cache in MiB (1440.0 MB = 2880 tokens x 0.5 MiB)
FLOPS_PER_TFLOP = 1e12


@dataclass
class EvalConfig:
    """One evaluation: what to run and on how many actors."""

    model: ModelSource = field(default_factory=ModelSource)
    method: str | None = None  # None: the unpruned model
    budget: int | None = None
    options: dict = field(default_factory=dict)  # method options (mu, tau, diversity, ...)
    tasks: list = field(default_factory=lambda: ["easyvqa_yesno", "easyvqa_open"])  # the offline benchmarks
    limit: int | None = None  # per-task sample cap
    generation: dict = field(default_factory=dict)  # generate() kwargs over each task's own; {}: the task's own
    workers: int = 1  # actors in the pool
    gpus_per_worker: float = 1  # used only when the cluster declares GPUs
    cpus_per_worker: float = 1  # one core per actor: the processor and image decoding are light
    batch_size: int = 8  # rows per actor call and per generate()
    actor_wait_s: float = 600  # finite: an unschedulable pool fails after this long instead of hanging
    progress_bars: bool = True  # Ray Data's bars; sweeps turn them off and print one line per trial instead


@dataclass
class EvalResult:
    predictions: list[dict]  # one per request row
    scores: dict  # {task: {metric: value}}
    metrics: dict  # flat MLflow metrics: <task>/<metric>, samples/*, efficiency/*, entropy/*, t_sal/*


# ----------------------------------------------------------------------------------------------------------------
# rows


def build_rows(tasks: list[str], limit: int | None, generation: dict,
               shard: tuple[int, int] | None = None) -> list[dict]:
    """Request rows from the eval bridge, with the spec's generation kwargs laid over each task's own.

    shard=(i, k): every k-th document from the i-th (the union of the k shards is the full set)."""
    from promprune.eval import build_requests

    rows = build_requests(tasks, limit=limit, shard=shard)
    for row in rows:
        row["gen_kwargs"] = {**(row.get("gen_kwargs") or {}), **generation}
    return rows


@dataclass
class Requests:
    """An evaluation's request rows as a materialized Ray dataset of {key, payload} (payload = pickled row),
    plus every key a prediction must come back for. Built once per sweep, shared by all its trials."""

    dataset: Any = field(repr=False)  # ray.data.MaterializedDataset, one block per batch (its repr reads blocks)
    keys: list[str] = field(repr=False)

    def __repr__(self) -> str:
        return f"Requests({len(self.keys)} rows)"


DRIVER_BUILD_MAX_ROWS = 2000  # up to this many rows the driver builds them itself (a few hundred MB of PNGs)


def build_requests_dataset(tasks: list[str], limit: int | None, generation: dict, batch_size: int,
                           shards: int | None = None) -> Requests:
    """Rows built on the driver (small evaluations) or in `shards` parallel Ray tasks (large benchmarks: VQAv2's
    214k images never sit in driver memory); either way materialized once in the object store.

    shards None: the driver builds when `limit` caps the rows at DRIVER_BUILD_MAX_ROWS, else one shard per CPU.
    """
    if shards is None:
        small = limit is not None and limit * len(tasks) <= DRIVER_BUILD_MAX_ROWS
        shards = 1 if small else max(2, int(ray.cluster_resources().get("CPU", 2)))
    if shards == 1:
        items = encode_rows(build_rows(tasks, limit, generation))
        ds = ray.data.from_items(items, override_num_blocks=max(1, math.ceil(len(items) / batch_size)))
        return Requests(ds.materialize(), [it["key"] for it in items])
    seeds = ray.data.from_items([{"shard": i} for i in range(shards)], override_num_blocks=shards)
    built = seeds.flat_map(_build_shard, fn_kwargs=dict(tasks=tasks, limit=limit, generation=generation,
                                                        shards=shards)).materialize()
    keys = [r["key"] for r in built.select_columns(["key"]).take_all()]
    if len(set(keys)) != len(keys):
        raise ValueError("request shards overlap: a (task, doc_id) was built twice")
    ds = built.repartition(max(1, math.ceil(len(keys) / batch_size)))  # one block per batch: actors share work
    return Requests(ds.materialize(), keys)


def _build_shard(seed: dict, *, tasks: list[str], limit: int | None, generation: dict, shards: int) -> list[dict]:
    return encode_rows(build_rows(tasks, limit, generation, shard=(int(seed["shard"]), shards)))


def sample_key(row: dict) -> str:
    return f"{row['task']}/{row['doc_id']}"


def encode_rows(rows: list[dict]) -> list[dict]:
    """Rows -> Ray Data items {key, payload}; the payload is the pickled row (bytes survive Arrow intact)."""
    keys = [sample_key(r) for r in rows]
    dupes = sorted({k for k in keys if keys.count(k) > 1}) if len(set(keys)) != len(keys) else []
    if dupes:
        raise ValueError(f"request rows: duplicate (task, doc_id): {dupes[:5]}")
    return [{"key": k, "payload": pickle.dumps(r)} for k, r in zip(keys, rows)]


def decode_predictions(records: list[dict]) -> list[dict]:
    return [pickle.loads(rec["payload"]) for rec in records]


# ----------------------------------------------------------------------------------------------------------------
# the actor


def default_run_requests(vlm, rows: list[dict], batch_size: int) -> list[dict]:
    from promprune.eval import run_requests

    return run_requests(vlm, rows, batch_size=batch_size)


class VLMPredictor:
    """Ray Data callable class: loads a PrunedVLM once, then answers batches of pickled request rows.

    `run_fn(vlm, rows, batch_size) -> predictions` is injectable (tests slow it down to kill nodes mid-run);
    the default is `promprune.eval.run_requests`.
    """

    def __init__(self, source: ModelSource, method: str | None, budget: int | None, options: dict,
                 batch_size: int, run_fn: Callable | None = None):
        import torch

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.vlm = source.load(method=method, budget=budget, options=options)
        self.batch_size = batch_size
        self.run_fn = run_fn or default_run_requests

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        """batch: DataFrame[key, payload (pickled row)] -> DataFrame[key, payload (pickled prediction)]."""
        import torch

        rows = [pickle.loads(p) for p in batch["payload"]]
        with torch.inference_mode():
            preds = self.run_fn(self.vlm, rows, self.batch_size)
        if len(preds) != len(rows):
            raise RuntimeError(f"run_requests returned {len(preds)} predictions for {len(rows)} rows")
        preds = [add_efficiency(self.vlm, p) for p in preds]
        return pd.DataFrame({"key": [sample_key(p) for p in preds], "payload": [pickle.dumps(p) for p in preds]})


def add_efficiency(vlm, pred: dict) -> dict:
    """Per-sample prefill FLOPs and visual KV-cache bytes, under the paper's Table 6 convention.

    FLOPs count the whole prefill: the visual tokens the LLM received plus the prompt's text tokens (the chat
    template tokenized, image placeholders not counted). The KV cache counts the visual tokens only, as Table 6
    does (1440.0 MB for LLaVA-NeXT-7B's 2880 tokens in fp16).
    """
    from promprune import efficiency

    visual = pred.get("visual_tokens")
    if visual is None or pred.get("error"):
        return {**pred, "text_tokens": None, "prefill_flops": None, "kv_cache_bytes": None}
    text_config = vlm.model.config.get_text_config()
    text = text_tokens(vlm, pred["prompt"])
    return {**pred, "text_tokens": text,
            "prefill_flops": float(efficiency.prefill_flops(text_config, int(visual) + text)),
            "kv_cache_bytes": float(efficiency.kv_cache_bytes(text_config, int(visual), vlm.model.dtype))}


def text_tokens(vlm, prompt: str) -> int:
    """Tokens of the chat-templated prompt other than image placeholders (which become the visual tokens)."""
    ids = vlm.processor.tokenizer(vlm.conversation(prompt), add_special_tokens=False)["input_ids"]
    config = vlm.model.config
    image_id = getattr(config, "image_token_id", None)
    if image_id is None:
        image_id = getattr(config, "image_token_index", None)
    return sum(1 for i in ids if i != image_id)


# ----------------------------------------------------------------------------------------------------------------
# Ray Data


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0))


def predict(cfg: EvalConfig, rows: list[dict] | Requests, *, run_fn: Callable | None = None) -> list[dict]:
    """Shard the rows over an actor pool holding the model; one prediction per row, in no particular order."""
    from ray.data import ActorPoolStrategy

    if not isinstance(rows, Requests):
        items = encode_rows(rows)
        n_blocks = max(1, math.ceil(len(items) / cfg.batch_size))  # one block per batch: idle actors take work
        rows = Requests(ray.data.from_items(items, override_num_blocks=n_blocks), [it["key"] for it in items])
    num_gpus = cfg.gpus_per_worker if cluster_gpus() > 0 else 0
    out = rows.dataset.map_batches(
        VLMPredictor,
        fn_constructor_kwargs=dict(source=cfg.model, method=cfg.method, budget=cfg.budget, options=cfg.options,
                                   batch_size=cfg.batch_size, run_fn=run_fn),
        compute=ActorPoolStrategy(size=cfg.workers),
        batch_size=cfg.batch_size,
        batch_format="pandas",
        num_gpus=num_gpus,
        num_cpus=cfg.cpus_per_worker,
        # Ray Data's actor defaults (max_restarts=-1, max_task_retries=-1) restart an actor lost with its node
        # elsewhere and retry its unfinished batches there; check_exactly_once() below verifies the outcome.
    )
    _configure(out.context, cfg)  # a dataset runs with the DataContext captured when it was created
    preds = decode_predictions(out.take_all())
    check_exactly_once(rows.keys, preds)
    return preds


def _configure(ctx, cfg: EvalConfig) -> None:
    """Finite wait for the actor pool (an unschedulable pool fails instead of hanging), progress bars on/off."""
    ctx.wait_for_min_actors_s = cfg.actor_wait_s
    ctx.enable_progress_bars = cfg.progress_bars
    ctx.enable_operator_progress_bars = cfg.progress_bars


def check_exactly_once(keys: list[str] | list[dict], preds: list[dict]) -> None:
    """Every request (a key `task/doc_id` or a row) has exactly one prediction: raise naming the duplicated or
    missing samples."""
    want = {k if isinstance(k, str) else sample_key(k) for k in keys}
    got = [sample_key(p) for p in preds]
    seen: set[str] = set()
    dupes = sorted({k for k in got if k in seen or seen.add(k)})
    missing = sorted(want - seen)
    extra = sorted(seen - want)
    if dupes or missing or extra:
        raise RuntimeError(f"predictions are not one per sample: duplicated {dupes[:5]} ({len(dupes)}), "
                           f"missing {missing[:5]} ({len(missing)}), unexpected {extra[:5]} ({len(extra)})")


# ----------------------------------------------------------------------------------------------------------------
# scoring and summaries


def evaluate(cfg: EvalConfig, rows: list[dict] | Requests | None = None, *, run_fn: Callable | None = None,
             score_fn: Callable | None = None) -> EvalResult:
    """Rows (built here unless given) -> predictions on Ray Data -> scores (once, centrally) -> metrics."""
    if rows is None:
        rows = build_requests_dataset(cfg.tasks, cfg.limit, cfg.generation, cfg.batch_size)
    preds = predict(cfg, rows, run_fn=run_fn)
    if score_fn is None:
        from promprune.eval import score as score_fn
    scores = score_fn(preds)
    return EvalResult(predictions=preds, scores=scores, metrics=summarize(preds, scores))


def _mean(values: list) -> float:
    values = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(values) if values else float("nan")


def _median(values: list) -> float:
    values = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else float("nan")


def summarize(preds: list[dict], scores: dict) -> dict[str, float]:
    """Flat metrics of one evaluation (the MLflow schema); means over the samples that did not fail."""
    ok = [p for p in preds if not p.get("error")]
    metrics = {f"{task}/{name}": float(v) for task, ms in scores.items() for name, v in ms.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({
        "samples/total": float(len(preds)),
        "samples/failed": float(len(preds) - len(ok)),
        "efficiency/prefill_tflops": _mean([p.get("prefill_flops") for p in ok]) / FLOPS_PER_TFLOP,
        "efficiency/kv_cache_mb": _mean([p.get("kv_cache_bytes") for p in ok]) / BYTES_PER_MB,
        "efficiency/prefill_ms": _mean([p.get("prefill_ms") for p in ok]),
        "efficiency/peak_mem_mb": max([float(p["peak_mem_mb"]) for p in ok if p.get("peak_mem_mb") is not None],
                                      default=float("nan")),
        "efficiency/visual_tokens": _mean([p.get("visual_tokens") for p in ok]),
        "entropy/mean": _mean([p.get("entropy") for p in ok]),
        "entropy/median": _median([p.get("entropy") for p in ok]),
        "t_sal/mean": _mean([p.get("saliency_count") for p in ok]),
        "t_sal/median": _median([p.get("saliency_count") for p in ok]),
    })
    return metrics


def predictions_frame(preds: list[dict]) -> pd.DataFrame:
    """One row per sample with the PREDICTION_COLUMNS; timings {vision,select,prefill,decode}_ms as a JSON string,
    kept (kept token indices) and salient (those the saliency stage chose) as int lists; sorted by (task, doc_id).
    """
    def one(p: dict) -> dict:
        kept = p.get("kept")
        if kept is not None and hasattr(kept, "tolist"):
            kept = kept.tolist()
        return {"task": p["task"], "doc_id": p["doc_id"], "prediction": p.get("prediction"),
                "error": p.get("error"), "entropy": _opt_float(p.get("entropy")),
                "saliency_count": _opt_float(p.get("saliency_count")),
                "visual_tokens": _opt_float(p.get("visual_tokens")), "kept": _flat_ints(kept),
                "salient": _flat_ints(p.get("salient")),
                "timings": json.dumps({k: p.get(k) for k in TIMING_FIELDS}, sort_keys=True, default=float),
                "text_tokens": _opt_float(p.get("text_tokens")), "prefill_flops": _opt_float(p.get("prefill_flops")),
                "kv_cache_bytes": _opt_float(p.get("kv_cache_bytes")),
                "peak_mem_mb": _opt_float(p.get("peak_mem_mb"))}

    frame = pd.DataFrame([one(p) for p in preds], columns=list(PREDICTION_COLUMNS))
    return frame.sort_values(["task", "doc_id"], kind="stable").reset_index(drop=True)


def _opt_float(v: Any) -> float | None:
    if v is None:
        return None
    return float(v.item() if hasattr(v, "item") else v)


def _flat_ints(kept: Any) -> list[int] | None:
    """kept indices as a flat int list (per-crop nesting of LLaVA-NeXT is flattened in order)."""
    if kept is None:
        return None
    out: list[int] = []
    stack = [kept]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        else:
            out.append(int(x))
    return out


# ----------------------------------------------------------------------------------------------------------------
# connecting to Ray


def worker_env() -> dict:
    """runtime_env that lets Ray workers import `pipelines` and `promprune` from this checkout.

    Needed for a local Ray or a cluster sharing this filesystem (tests); `ray job submit --working-dir .` puts the
    uploaded checkout on the workers' path itself, and cluster.yaml installs the project on every node.
    """

    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **QUIET_ENV}}


def connect(address: str | None) -> None:
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR  # set by `ray job submit`

    if ray.is_initialized():
        return
    if os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR):  # inside `ray job submit`: keep the job's runtime_env
        ray.init(address=address)
    elif address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, runtime_env=worker_env())
    else:  # a local Ray: no dashboard needed (faster start on a laptop)
        ray.init(include_dashboard=False, runtime_env=worker_env())


# ----------------------------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny:llava", help="checkpoint name/path or tiny:<arch> (default: tiny:llava)")
    p.add_argument("--method", default=None, help="pruning method; omit for the unpruned model")
    p.add_argument("--budget", type=int, default=None, help="visual tokens kept")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, value parsed as YAML (repeatable), e.g. --option mu=0.4")
    p.add_argument("--tasks", nargs="+", default=["easyvqa_yesno", "easyvqa_open"])
    p.add_argument("--limit", type=int, default=8, help="samples per task (default 8: a smoke run)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--no-mlflow", action="store_true", help="print the results only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import yaml

    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = yaml.safe_load(value)
    if args.method is not None:
        from promprune.models import validate_method

        validate_method(args.method, args.budget, **options)
    cfg = EvalConfig(model=ModelSource(pretrained=args.model, dtype=args.dtype), method=args.method,
                     budget=args.budget, options=options, tasks=args.tasks, limit=args.limit,
                     generation={"max_new_tokens": args.max_new_tokens}, workers=args.workers,
                     batch_size=args.batch_size)
    connect(args.address)
    t0 = time.perf_counter()
    result = evaluate(cfg)
    print(f"evaluated {len(result.predictions)} samples in {time.perf_counter() - t0:.1f}s")
    for key, value in sorted(result.metrics.items()):
        print(f"  {key:32s} {value:.4g}")
    if not args.no_mlflow:
        run_id = tracking.log_evaluation(cfg, result, predictions_frame(result.predictions))
        print(f"MLflow run {run_id}; open the UI with:\n  {tracking.ui_command()}")
    return 0


if __name__ == "__main__":
    from pipelines.evaluate import main as _main  # pickled classes must live in `pipelines.evaluate`, not __main__

    sys.exit(_main())
