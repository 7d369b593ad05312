"""The actors: each loads the model once and turns Arrow blocks of requests into Arrow blocks of predictions.

`PredictorPool` is a sweep's actors, started once and shared by all its trials (a single evaluation starts its own):
least-loaded dispatch, actors that join as they finish loading, a lost actor's blocks sent to the others, and a
pool that cannot be scheduled failing within `actor_wait_s` instead of hanging.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa
import ray

from promprune.records import Prediction, Request, from_arrow, to_arrow

from pipelines import timeline
from pipelines.config import Resources
from pipelines.weights import ModelSource


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

    def map(self, blocks: list, method: str | None, budget: int | None, options: dict,
            wait_s: float) -> list[pa.Table]:
        """Every block through the pool for one trial (its method, budget and options), least-loaded actor first;
        returns the output tables (`arrow_schema(Prediction)`), in no particular order.

        Actors still loading the model take work as soon as they answer. An actor lost with its node: its
        unfinished blocks go to the other actors at once (its calls are not retried on it), and it takes work again
        when its restart answers (Ray restarts it where resources allow).
        With no actor left for `wait_s` (the spec's `actor_wait_s`), this fails instead of hanging."""
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
                ref = self.actors[i].predict.remote(method, budget, options, block)
                running[ref], queued[i] = (i, block), queued[i] + 1
            timeout = None if alive else wait_s
            ready, _ = ray.wait(list(running) + list(probes), num_returns=1, timeout=timeout)
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

    FLOPs count the whole prefill: the visual tokens the LLM received plus the prompt's text tokens as the model
    read them (``Prediction.text_tokens``: the processor's prompt without its visual placeholders, so a video's
    per-frame timestamps count). The KV cache counts the visual tokens only, as Table 6 does (1440.0 MB for
    LLaVA-NeXT-7B's 2880 tokens in fp16).
    """
    from promprune import efficiency

    if pred.visual_tokens is None or pred.text_tokens is None or pred.failed:
        return pred
    text_config = vlm.model.config.get_text_config()
    return dataclasses.replace(
        pred, prefill_flops=float(efficiency.prefill_flops(text_config, int(pred.visual_tokens) + pred.text_tokens)),
        kv_cache_bytes=float(efficiency.kv_cache_bytes(text_config, int(pred.visual_tokens), vlm.model.dtype)))


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0))

