"""One evaluation on Ray: (model, method, budget, options, tasks) -> predictions, scores, metrics.

    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 \
        --tasks easyvqa_yesno easyvqa_open --limit 8

Setup -> run -> cleanup:

1. rows: `promprune.eval.build_requests(tasks, limit=...)` (`promprune.records.Request`: task, doc_id, prompt,
   PNG bytes, image key, gen_kwargs), on the driver for small evaluations or in parallel shards as Ray tasks for
   large ones, stored once in the object store as Arrow blocks (`arrow_schema(Request)`) in which the questions
   about one image sit together and its PNG is stored once (`promprune.eval.requests.pack_requests`).
2. A `PredictorPool`: actors that each load the model once (one GPU each when the cluster has GPUs, CPU
   otherwise) and turn a block of requests into a block of `promprune.records.Prediction`s under
   `torch.inference_mode()`, taking each call's method, budget and options. A sweep starts one pool for all its
   trials and passes it to `evaluate(..., pool=)`; a single evaluation starts its own. A pool that cannot be
   scheduled fails within `actor_wait_s` instead of hanging; an actor lost with its node restarts and its blocks go
   to the others; the output is checked to hold every sample exactly once (nothing is de-duplicated silently).
3. Central scoring: `promprune.eval.score(predictions)` aggregates once over all shards.

Run as a script it also logs one MLflow run (role `evaluation`) with the same metrics and artifacts as a sweep
trial. `pipelines/sweep.py` calls `evaluate()` inside each Ray Tune trial.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import ray

from promprune.records import Prediction, Request, arrow_schema, from_arrow, to_arrow

from pipelines import timeline, tracking
from pipelines.config import Resources
from pipelines.console import say
from pipelines.weights import ModelSource

REPO = Path(__file__).resolve().parents[1]
QUIET_ENV = {"LOGURU_LEVEL": "WARNING"}  # lmms-eval logs every request build at DEBUG through loguru
BYTES_PER_MB = 2 ** 20  # the paper's Table 6 reports KV cache in MiB (1440.0 MB = 2880 tokens x 0.5 MiB)
FLOPS_PER_TFLOP = 1e12
MB_PER_GB = 1024  # peak memory: the allocator's MiB as the paper's GB (GiB)


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
    resources: Resources = field(default_factory=Resources)  # actors, GPUs and CPUs per actor, batch size, wait
    progress_bars: bool = True  # kept for callers; the pool prints no bars (sweeps print one line per trial)
    bootstrap: int = 0  # resamples for 95% CIs of each task's primary metrics (<metric>_ci_low/_ci_high); 0: none


@dataclass
class EvalResult:
    predictions: list[Prediction]  # one per request
    scores: dict  # {task: {metric: value}}
    metrics: dict  # flat MLflow metrics: <task>/<metric>, samples/*, efficiency/*, entropy/*, t_sal/*


# ----------------------------------------------------------------------------------------------------------------
# rows


def build_rows(tasks: list[str], limit: int | None, generation: dict,
               shard: tuple[int, int] | None = None, contiguous: bool = False) -> list[Request]:
    """Requests from the eval bridge, with the spec's generation kwargs laid over each task's own.

    shard=(i, k): every k-th document from the i-th, or with `contiguous` the i-th of k consecutive runs (the union
    of the k shards is the full set either way)."""
    from promprune.eval import build_requests

    rows = build_requests(tasks, limit=limit, shard=shard, contiguous=contiguous)
    for row in rows:
        row.gen_kwargs = {**row.gen_kwargs, **generation}
    return rows


@dataclass
class Requests:
    """An evaluation's requests in the object store, built once per sweep and shared by all its trials: Arrow blocks
    with `arrow_schema(Request)` made by `promprune.eval.requests.pack_requests` (each block holds whole groups of
    questions about one image and stores each image once), plus every key a prediction must come back for."""

    blocks: list = field(repr=False)  # ObjectRefs of pyarrow Tables, one block per actor call
    keys: list[str] = field(repr=False)

    def __repr__(self) -> str:
        return f"Requests({len(self.keys)} rows in {len(self.blocks)} blocks)"

    @property
    def dataset(self):
        """The blocks as a Ray dataset (block for block)."""
        return ray.data.from_arrow_refs(self.blocks)

    def only(self, tasks) -> "Requests":
        """The requests of ``tasks`` alone (an explicit trial that runs on a subset of the sweep's tasks)."""
        wanted = sorted(set(tasks))
        keys = [k for k in self.keys if k.rsplit("/", 1)[0] in wanted]
        calls = [_only_tasks.remote(block, wanted) for block in self.blocks]
        sizes = ray.get([n for n, _ in calls])
        return Requests([ref for n, (_, ref) in zip(sizes, calls) if n], keys)

    def nbytes(self) -> int:
        """Bytes the blocks take in the object store (Arrow buffers)."""
        return int(sum(ray.get([_nbytes.remote(block) for block in self.blocks])))


@ray.remote(num_cpus=0, num_returns=2)
def _only_tasks(block: pa.Table, tasks: list[str]) -> tuple[int, pa.Table]:
    """(rows kept, the filtered block): the block's rows of ``tasks``, each image stored once again (the row that
    carried an image may belong to another task). Two returns, so the block is owned by the caller."""
    from promprune.eval.requests import pack_requests, share_images

    rows = [r for r in share_images(from_arrow(block, Request)) if r.task in tasks]
    return len(rows), to_arrow([r for b in pack_requests(rows, max(1, len(rows))) for r in b], Request)


@ray.remote(num_cpus=0)
def _nbytes(block: pa.Table) -> int:
    return block.nbytes


DRIVER_BUILD_MAX_ROWS = 2000  # up to this many rows the driver builds them itself (distinct images, PNG, in memory)


def request_blocks(rows: list[Request], batch_size: int) -> list[pa.Table]:
    """Requests -> Arrow blocks of about `batch_size` rows, each image stored once per block (`pack_requests`);
    a duplicated (task, doc_id) is an error."""
    from promprune.eval.requests import pack_requests

    keys = [r.key for r in rows]
    if len(set(keys)) != len(keys):
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"requests: duplicate (task, doc_id): {dupes[:5]}")
    return [to_arrow(block, Request) for block in pack_requests(rows, batch_size)]


def requests_dataset(rows: list[Request], batch_size: int) -> Requests:
    """Requests -> blocks in the object store (idle actors take work block by block)."""
    return Requests([ray.put(b) for b in request_blocks(rows, batch_size)], [r.key for r in rows])


def build_requests_dataset(tasks: list[str], limit: int | None, generation: dict, batch_size: int,
                           shards: int | None = None) -> Requests:
    """Rows built on the driver (small evaluations) or in `shards` parallel Ray tasks (large benchmarks: VQAv2's
    214k questions never sit in driver memory); either way stored once in the object store, each distinct image
    once per block.

    shards None: the driver builds when `limit` caps the rows at DRIVER_BUILD_MAX_ROWS, else one shard per CPU.
    Shards take consecutive runs of documents, so the questions about one image (neighbours in the benchmarks'
    order) are built, and stored, together.
    """
    if shards is None:
        small = limit is not None and limit * len(tasks) <= DRIVER_BUILD_MAX_ROWS
        shards = 1 if small else max(2, int(ray.cluster_resources().get("CPU", 2)))
    if shards == 1:
        return requests_dataset(build_rows(tasks, limit, generation), batch_size)
    calls = [_build_shard.remote(tasks, limit, generation, (i, shards), batch_size) for i in range(shards)]
    streamed = [list(call) for call in calls]  # streamed blocks are owned here: they outlive their task
    blocks = [ref for refs in streamed for ref in refs[:-1]]
    keys = [k for ks in ray.get([refs[-1] for refs in streamed]) for k in ks]  # each shard's last item: its keys
    if len(set(keys)) != len(keys):
        raise ValueError("request shards overlap: a (task, doc_id) was built twice")
    return Requests(blocks, keys)


@ray.remote(num_returns="streaming")
def _build_shard(tasks: list[str], limit: int | None, generation: dict, shard: tuple[int, int], batch_size: int):
    """One shard's requests, yielded block by block, then the list of their keys."""
    rows = build_rows(tasks, limit, generation, shard=shard, contiguous=True)
    for block in request_blocks(rows, batch_size):
        yield block  # (not `yield from`: Ray's streaming generator sends into it)
    yield [r.key for r in rows]


# ----------------------------------------------------------------------------------------------------------------
# the actor


def default_run_requests(vlm, rows: list[Request], batch_size: int) -> list[Prediction]:
    from promprune.eval import run_requests

    return run_requests(vlm, rows, batch_size=batch_size)


class VLMPredictor:
    """An actor's model: loads a PrunedVLM once, then answers Arrow blocks of requests.

    `run_fn(vlm, requests, batch_size) -> predictions` is injectable (tests slow it down to kill nodes mid-run);
    the default is `promprune.eval.run_requests`.
    """

    def __init__(self, source: ModelSource, method: str | None, budget: int | None, options: dict,
                 batch_size: int, run_fn: Callable | None = None):
        import torch

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.vlm = source.load(method=method, budget=budget, options=options)
        self.batch_size = batch_size
        self.run_fn = run_fn or default_run_requests

    def __call__(self, batch: pa.Table) -> pa.Table:
        """batch: `arrow_schema(Request)` -> `arrow_schema(Prediction)`, one row per request."""
        import torch

        from promprune.eval.requests import share_images

        rows = share_images(from_arrow(batch, Request))  # a block stores each image once: every row gets its own
        with torch.inference_mode():
            preds = self.run_fn(self.vlm, rows, self.batch_size)
        if len(preds) != len(rows):
            raise RuntimeError(f"run_requests returned {len(preds)} predictions for {len(rows)} rows")
        return to_arrow([add_efficiency(self.vlm, p) for p in preds], Prediction)


class PooledPredictor(VLMPredictor):
    """One actor of a sweep's shared pool (`PredictorPool`): loads the model once, unpruned, and serves every trial
    of the sweep; each call names its trial's method, budget and options, and the actor wraps the loaded model in a
    `PrunedVLM` for them (pruning never changes the weights, so the same tensors serve all trials)."""

    def __init__(self, source: ModelSource, batch_size: int, run_fn: Callable | None = None):
        if timeline.enabled():
            timeline.tag(node=ray.get_runtime_context().get_node_id()[:8])
            timeline.mark("actor_process", "actor", t=timeline.process_started())
            timeline.mark("actor_init", "actor")
        super().__init__(source, None, None, {}, batch_size, run_fn)
        timeline.mark("actor_ready", "actor")
        self.base = self.vlm
        self.wrapped: dict[str, Any] = {}  # (method, budget, options) -> PrunedVLM around self.base's model

    def ready(self) -> bool:
        return True

    def predict(self, method: str | None, budget: int | None, options: dict, batch: pa.Table) -> pa.Table:
        import json

        from promprune.models import PrunedVLM

        key = json.dumps([method, budget, options], sort_keys=True, default=str)
        if key not in self.wrapped:
            if len(self.wrapped) >= 16:  # a few trials at once per actor; wrappers are small, the model is shared
                self.wrapped.clear()
            self.wrapped[key] = self.base if method is None and not options else PrunedVLM(
                self.base.model, self.base.processor, method=method, budget=budget,
                **{**self.base.adapter.options, **options})
        self.vlm = self.wrapped[key]
        call = f"{method}/{budget}"
        timeline.mark("predict_start", "actor", call=call, rows=batch.num_rows)
        out = self(batch)
        timeline.mark("predict_end", "actor", call=call, rows=batch.num_rows)
        return out


@dataclass
class PredictorPool:
    """A sweep's actors, started once and shared by all its trials (instead of an actor pool per trial): a trial no
    longer pays actor processes starting and models loading, and while one trial scores and logs, the next one's
    batches keep the actors busy. An actor lost with its node restarts where resources allow; its unfinished
    batches go to the other actors meanwhile."""

    actors: list = field(repr=False)
    ready_refs: list = field(repr=False)  # each actor's first `ready()` call: resolved once its model is loaded

    IN_FLIGHT_PER_ACTOR = 2  # calls one trial keeps queued on an actor: the next batch is there when one ends

    @classmethod
    def start(cls, source: ModelSource, size: int, resources: Resources, on_gpu: bool,
              run_fn: Callable | None = None) -> "PredictorPool":
        """Start `size` actors and return once the first has loaded the model; the others join the trials' work as
        they finish loading (a slow node, a model load that takes longer on one disk, an autoscaler bringing GPU nodes
        up one by one: the work starts with what is there). No actor up within `resources.actor_wait_s`: the pool
        cannot be scheduled, and this fails instead of hanging."""
        actor = ray.remote(PooledPredictor).options(
            num_gpus=resources.gpus_per_worker if on_gpu else 0, num_cpus=resources.cpus_per_worker,
            max_restarts=-1, max_task_retries=0)  # map() sends a lost actor's blocks to the others
        actors = [actor.remote(source, resources.batch_size, run_fn) for _ in range(max(1, size))]
        pool = cls(actors, [a.ready.remote() for a in actors])
        try:
            started = pool.wait_first(resources.actor_wait_s)
        except BaseException:
            pool.shutdown()
            raise
        if not started:
            pool.shutdown()
            raise RuntimeError(f"none of the sweep's {size} predictor actor(s) started within "
                               f"actor_wait_s={resources.actor_wait_s:g}s: the cluster lacks the resources "
                               f"({resources.gpus_per_worker:g} GPU, {resources.cpus_per_worker:g} CPU per actor)")
        return pool

    def wait_first(self, timeout_s: float) -> bool:
        """Whether an actor answered `ready` within `timeout_s`. An actor whose model failed to load raises its
        error here when every actor failed; one failure among others only loses that actor."""
        deadline, pending = time.perf_counter() + timeout_s, list(self.ready_refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.perf_counter()))
            if not done:
                return False
            try:
                ray.get(done[0])
                return True
            except ray.exceptions.RayActorError:
                if not pending:
                    raise
        return False

    def loaded(self) -> set[int]:
        """Indices of the actors that have answered `ready` so far (a non-blocking look)."""
        done, _ = ray.wait(list(self.ready_refs), num_returns=len(self.ready_refs), timeout=0)
        return {i for i, ref in enumerate(self.ready_refs) if ref in done}

    def ready_count(self) -> int:
        return len(self.loaded())

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except (ray.exceptions.RayError, ValueError):  # already gone (Ray shut down, its node lost)
                pass

    def map(self, cfg: "EvalConfig", blocks: list) -> list[pa.Table]:
        """Every block through the pool, least-loaded actor first; returns the output tables.

        Actors still loading the model take work as soon as they answer. An actor lost with its node: its
        unfinished blocks go to the other actors at once (its calls are not retried on it), and it takes work again
        when its restart answers (Ray restarts it where resources allow).
        With no actor left for `actor_wait_s`, this fails instead of hanging."""
        import random
        from collections import deque

        pending, queued = deque(blocks), [0] * len(self.actors)
        # ties (actors equally loaded by this call) go round from a random actor: the trials run in separate
        # processes and each counts only its own calls, so breaking ties by index sent every trial's first block to
        # actor 0 (a trial of one block never reached the others)
        first = random.randrange(len(self.actors))
        alive = self.loaded()  # the others are still loading: their `ready` refs are probed like a restart's
        running: dict = {}  # output ref -> (actor index, input block)
        probes: dict = {ref: i for i, ref in enumerate(self.ready_refs) if i not in alive}
        tables: list = []
        while pending or running:
            while pending and alive:
                i = min(alive, key=lambda j: (queued[j], (j - first) % len(self.actors)))
                if queued[i] >= self.IN_FLIGHT_PER_ACTOR:
                    break
                block = pending.popleft()
                ref = self.actors[i].predict.remote(cfg.method, cfg.budget, cfg.options, block)
                running[ref], queued[i] = (i, block), queued[i] + 1
            wait_s = None if alive else cfg.resources.actor_wait_s
            ready, _ = ray.wait(list(running) + list(probes), num_returns=1, timeout=wait_s)
            if not ready:
                raise RuntimeError(f"no predictor actor answered for actor_wait_s={wait_s:g}s after losing them all")
            for ref in ready:
                if ref in probes:
                    i = probes.pop(ref)
                    try:
                        ray.get(ref)
                        alive.add(i)
                    except ray.exceptions.RayActorError:
                        probes[self.actors[i].ready.remote()] = i
                    continue
                i, block = running.pop(ref)
                queued[i] -= 1
                try:
                    tables.append(ray.get(ref))
                except ray.exceptions.RayActorError:  # the actor died (its node, say): the block goes elsewhere
                    pending.appendleft(block)
                    if i in alive:
                        alive.discard(i)
                        probes[self.actors[i].ready.remote()] = i
        return tables


def add_efficiency(vlm, pred: Prediction) -> Prediction:
    """Per-sample prefill FLOPs and visual KV-cache bytes, under the paper's Table 6 convention.

    FLOPs count the whole prefill: the visual tokens the LLM received plus the prompt's text tokens (the chat
    template tokenized, image placeholders not counted). The KV cache counts the visual tokens only, as Table 6
    does (1440.0 MB for LLaVA-NeXT-7B's 2880 tokens in fp16).
    """
    from promprune import efficiency

    if pred.visual_tokens is None or pred.failed:
        return pred
    text_config = vlm.model.config.get_text_config()
    text = text_tokens(vlm, pred.prompt)
    return dataclasses.replace(
        pred, text_tokens=text,
        prefill_flops=float(efficiency.prefill_flops(text_config, int(pred.visual_tokens) + text)),
        kv_cache_bytes=float(efficiency.kv_cache_bytes(text_config, int(pred.visual_tokens), vlm.model.dtype)))


def text_tokens(vlm, prompt: str) -> int:
    """Tokens of the chat-templated prompt other than image placeholders (which become the visual tokens)."""
    ids = vlm.processor.tokenizer(vlm.conversation(prompt), add_special_tokens=False)["input_ids"]
    config = vlm.model.config
    image_id = getattr(config, "image_token_id", None)
    if image_id is None:
        image_id = getattr(config, "image_token_index", None)
    return sum(1 for i in ids if i != image_id)


# ----------------------------------------------------------------------------------------------------------------
# predicting on the actors


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0))


def predict(cfg: EvalConfig, rows: list[Request] | Requests, *, run_fn: Callable | None = None,
            pool: PredictorPool | None = None) -> list[Prediction]:
    """Share the request blocks out over actors holding the model; one prediction per request, in no particular
    order. pool: a sweep's shared actors (they carry their own run_fn); None: a pool started for this call alone
    (`resources.actors` actors, one GPU each when the cluster has GPUs) and shut down after it: one inference path
    for sweeps and single evaluations."""
    if not isinstance(rows, Requests):
        rows = requests_dataset(rows, cfg.resources.batch_size)
    own = pool is None
    if own:
        pool = PredictorPool.start(cfg.model, cfg.resources.actors, cfg.resources, on_gpu=cluster_gpus() > 0,
                                   run_fn=run_fn)
    try:
        timeline.mark("first_request", "trial")
        tables = pool.map(cfg, rows.blocks)
        timeline.mark("last_answer", "trial")
    finally:
        if own:
            pool.shutdown()
    preds = [p for t in tables for p in from_arrow(t, Prediction)]
    check_exactly_once(rows.keys, preds)
    return preds


def check_exactly_once(keys: list[str], preds: list[Prediction]) -> None:
    """Every request key (`task/doc_id`) has exactly one prediction: raise naming the duplicated or missing
    samples."""
    want = set(keys)
    seen: set[str] = set()
    dupes = sorted({p.key for p in preds if p.key in seen or seen.add(p.key)})
    missing = sorted(want - seen)
    extra = sorted(seen - want)
    if dupes or missing or extra:
        raise RuntimeError(f"predictions are not one per sample: duplicated {dupes[:5]} ({len(dupes)}), "
                           f"missing {missing[:5]} ({len(missing)}), unexpected {extra[:5]} ({len(extra)})")


# ----------------------------------------------------------------------------------------------------------------
# scoring and summaries


def evaluate(cfg: EvalConfig, rows: list[Request] | Requests | None = None, *, run_fn: Callable | None = None,
             score_fn: Callable | None = None, pool: PredictorPool | None = None) -> EvalResult:
    """Requests (built here unless given) -> predictions on a pool of actors (a sweep's `pool`, or one of its
    own) -> scores (once, centrally) -> metrics."""
    if rows is None:
        rows = build_requests_dataset(cfg.tasks, cfg.limit, cfg.generation, cfg.resources.batch_size)
    preds = predict(cfg, rows, run_fn=run_fn, pool=pool)
    if score_fn is None:
        from promprune.eval import score as score_fn
    scores = score_fn(preds, bootstrap=cfg.bootstrap) if cfg.bootstrap else score_fn(preds)
    timeline.mark("trial_scored", "trial")
    return EvalResult(predictions=preds, scores=scores, metrics=summarize(preds, scores))


def _finite(values: list) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def _mean(values: list) -> float:
    values = _finite(values)
    return statistics.fmean(values) if values else float("nan")


def _median(values: list) -> float:
    values = _finite(values)
    return statistics.median(values) if values else float("nan")


def _total_prefill(p: Prediction) -> float | None:
    parts = (p.vision_ms, p.select_ms, p.prefill_ms)
    return None if any(v is None for v in parts) else float(sum(parts))


def summarize(preds: list[Prediction], scores: dict) -> dict[str, float]:
    """Flat metrics of one evaluation (the MLflow schema); means over the samples that did not fail."""
    ok = [p for p in preds if not p.failed]
    metrics = {f"{task}/{name}": float(v) for task, ms in scores.items() for name, v in ms.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({
        "samples/total": float(len(preds)),
        "samples/failed": float(len(preds) - len(ok)),
        "efficiency/prefill_tflops": _mean([p.prefill_flops for p in ok]) / FLOPS_PER_TFLOP,
        "efficiency/kv_cache_mb": _mean([p.kv_cache_bytes for p in ok]) / BYTES_PER_MB,
        # Table 6's prefill latency: vision encoding + token selection + the LLM's first forward, per sample (batch 1)
        "efficiency/prefill_ms": _mean([_total_prefill(p) for p in ok]),
        "efficiency/vision_ms": _mean([p.vision_ms for p in ok]),
        "efficiency/select_ms": _mean([p.select_ms for p in ok]),
        "efficiency/llm_prefill_ms": _mean([p.prefill_ms for p in ok]),
        "efficiency/peak_mem_gb": max(_finite([p.peak_mem_mb for p in ok]), default=float("nan")) / MB_PER_GB,
        "efficiency/visual_tokens": _mean([p.visual_tokens for p in ok]),
        "entropy/mean": _mean([p.entropy for p in ok]),
        "entropy/median": _median([p.entropy for p in ok]),
        "t_sal/mean": _mean([p.saliency_count for p in ok]),
        "t_sal/median": _median([p.saliency_count for p in ok]),
    })
    return metrics


def predictions_table(preds: list[Prediction]) -> pa.Table:
    """The `predictions.parquet` artifact: `arrow_schema(Prediction)`, one row per sample, sorted by (task, doc_id)."""
    return to_arrow(sorted(preds, key=lambda p: (p.task, p.doc_id)), Prediction)


PREDICTION_SCHEMA = arrow_schema(Prediction)


# ----------------------------------------------------------------------------------------------------------------
# connecting to Ray


def worker_env() -> dict:
    """runtime_env that lets Ray workers import `pipelines` and `promprune` from this checkout.

    Needed for a local Ray or a cluster sharing this filesystem (tests); `ray job submit --working-dir .` puts the
    uploaded checkout on the workers' path itself, and cluster.yaml installs the project on every node.
    """

    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **QUIET_ENV}}


class RayUnreachable(RuntimeError):
    """The Ray cluster the user named does not answer."""


def _answers(address: str, timeout_s: float = 3.0) -> bool:
    """Whether a Ray head's GCS accepts a TCP connection at ``host:port`` within a few seconds."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _recorded_head() -> str | None:
    """The head a plain ``ray.init()`` would join: the address `ray start` recorded in Ray's temp dir."""
    from ray._common.utils import get_ray_address_file

    try:
        return Path(get_ray_address_file(None)).read_text().strip() or None
    except OSError:
        return None


def connect(address: str | None, *, log_to_driver: bool = True) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``), else the head `ray start` recorded, else start a
    local Ray. A named head that does not answer is a RayUnreachable in seconds (Ray itself would wait for
    minutes); a recorded head that died without `ray stop` is skipped with a note."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR  # set by `ray job submit`

    if ray.is_initialized():
        return
    if os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR):  # inside `ray job submit`: keep the job's runtime_env
        ray.init(address=address, log_to_driver=log_to_driver)
        return
    named = address or os.environ.get("RAY_ADDRESS")
    if named and named not in ("auto", "local") and not named.startswith("ray://"):
        if not _answers(named):
            source = "--address" if address else "RAY_ADDRESS"
            raise RayUnreachable(f"the Ray cluster at {named} ({source}) does not answer. Start it (`ray start "
                                 f"--head`), point {source} at a live head, or leave it unset to run a local Ray")
        ray.init(address=named, runtime_env=worker_env(), log_to_driver=log_to_driver)
    elif named:
        ray.init(address=named, runtime_env=worker_env(), log_to_driver=log_to_driver)
    else:
        recorded = _recorded_head()
        if recorded and _answers(recorded):
            ray.init(runtime_env=worker_env(), log_to_driver=log_to_driver)  # the head `ray start` left running
            return
        if recorded:
            say(f"note: the Ray head recorded at {recorded} (a `ray start` that ended without `ray stop`) does not "
                "answer; starting a local Ray instead (`ray stop --force` clears the record)")
        # a local Ray: no dashboard needed (faster start on a laptop)
        ray.init(address="local", include_dashboard=False, runtime_env=worker_env(), log_to_driver=log_to_driver)


# ----------------------------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-easyvqa:llava",
                   help="checkpoint name/path, or a factory name: tiny-easyvqa:llava (default; trained on easy-vqa, "
                        "so its scores mean something), tiny:<arch> (random weights), shape:<name>")
    p.add_argument("--method", default=None, help="pruning method; omit for the unpruned model")
    p.add_argument("--budget", type=int, default=None, help="visual tokens kept")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, value parsed as YAML (repeatable), e.g. --option mu=0.4")
    p.add_argument("--tasks", nargs="+", default=["easyvqa_yesno", "easyvqa_open"])
    p.add_argument("--limit", type=int, default=8, help="samples per task (default 8: a smoke run)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated tokens (default: each task's own, as lmms-eval runs it)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--no-mlflow", action="store_true", help="print the results only")
    return p.parse_args(argv)


def random_weights_note(model: str) -> None:
    """Say so when a model has random weights: its scores are noise (0 on the offline tasks), by construction."""
    if model.startswith(("tiny:", "shape:")):
        say(f"note: {model} has random weights, so its answers and scores are noise (tiny-easyvqa:llava is trained "
            "offline and answers the easy-vqa tasks)")


def main(argv: list[str] | None = None) -> int:
    import yaml

    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = yaml.safe_load(value)
    from pipelines import preflight
    from promprune.models import validate_method

    random_weights_note(args.model)
    errors = []  # a user's mistakes: one message listing all of them, no traceback, before Ray starts
    try:
        validate_method(args.method, args.budget, **options)
    except ValueError as exc:
        errors.append(f"method: {exc}")
    errors += preflight.check_tasks(args.tasks, args.limit)
    errors += preflight.check_judges(args.tasks)
    errors += preflight.check_model(args.model, {}, {"this evaluation": args.budget} if args.budget else {})
    if not args.no_mlflow:
        errors += preflight.check_store(tracking.tracking_uri())
    if errors:
        print("error: " + "\n  - ".join(["pipelines/evaluate.py:", *errors]), file=sys.stderr)
        return 2
    for note in preflight.judge_notes(args.tasks):
        print(note)
    cfg = EvalConfig(model=ModelSource(pretrained=args.model, dtype=args.dtype), method=args.method,
                     budget=args.budget, options=options, tasks=args.tasks, limit=args.limit,
                     generation={} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens},
                     resources=Resources(workers=args.workers, batch_size=args.batch_size))
    try:
        connect(args.address)
    except RayUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = evaluate(cfg)
    print(f"evaluated {len(result.predictions)} samples in {time.perf_counter() - t0:.1f}s")
    for key, value in sorted(result.metrics.items()):
        print(f"  {key:32s} {value:.4g}")
    if not args.no_mlflow:
        run_id = tracking.log_evaluation(cfg, result, predictions_table(result.predictions))
        print(f"MLflow run {run_id}; open the UI with:\n  {tracking.ui_command()}")
    return 0


if __name__ == "__main__":
    from pipelines.evaluate import main as _main  # pickled classes must live in `pipelines.evaluate`, not __main__

    sys.exit(_main())
