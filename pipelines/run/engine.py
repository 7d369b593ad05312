"""The evaluation engine: Ray Data shards an evaluation's blocks over a pool of actors that each hold the pruned VLM,
and streams the predictions back as they are answered.

    requests (sealed blocks, `requests.py`) -> ray.data.from_arrow_refs -> map_batches(Predictor, one block per
    call, ActorPoolStrategy(size=plan.max_actors)) -> iter_batches: one block of predictions at a time

Scheduling, placement, restarting a lost actor and resending its block are Ray's; what Ray 2.60 does not do is ours,
and docs/pipeline.md ("What is Ray's, and what is ours") says why for each piece:

- *Elastic.* The pool has a fixed size: every actor the evaluation can use (`resources.Plan.max_actors`: one per
  block, at most `max_gpus`); it starts on the first that is up, and the ones the cluster cannot place yet are
  pending, which is what an autoscaler adds nodes for (the cluster grows; the pool does not). GPU nodes that join
  mid-evaluation take their pending actors. When the evaluation ends its actors go, and with them the demand.
- *Failover.* An actor that dies (its node lost, a segfault, host memory exhausted by one odd image) is restarted
  by Ray (`max_restarts=-1`) and the block it held is sent again (`max_task_retries=-1`). Ours: a `Ledger` (one per
  sweep) counts the attempts that started, and the attempt after `resources.block_attempts` returns the block's
  requests as failed samples, named, instead of running it; one block in flight per actor, so a block that kills
  its actor is the only one charged. A `Watchdog` makes an actor whose block hangs past `resources.block_timeout_s`
  exit, which is the same case. Should Ray Data give a block up anyway (an actor lost with its node can fail its
  task instead of resending it), its error budget (`max_errored_blocks`) drops it, and `run` starts a new pass for
  the blocks that did not come back (at most `block_attempts` passes; the Ledger keeps counting).
- A sample that fails by itself (an unreadable image, a failed generation) is a failed prediction from the model's
  own isolation (`promprune.eval.generation`); an exception out of a whole block is retried in the actor, then
  becomes failed predictions with its message. Nothing is dropped silently: `assemble` checks every sample is there
  exactly once.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import pyarrow as pa
import ray

from promprune.records import Prediction, Request, from_arrow, table_keys, to_arrow

from pipelines import timeline
from pipelines.run.checkpoints import BlockStore
from pipelines.run.requests import Requests, unseal
from pipelines.run.resources import Plan
from pipelines.weights import ModelSource

EXIT_HUNG = 70  # the exit status of an actor whose watchdog fired (a block past block_timeout_s)


@dataclass
class Job:
    """What the actors compute: the model, the method and its options, and the generation batch size.
    ``run_fn(vlm, requests, batch_size) -> predictions`` replaces `promprune.eval.run_requests` (benchmarks inject a
    stand-in model's costs; tests slow it down to kill nodes mid-run)."""

    source: ModelSource
    method: str | None
    budget: int | None
    options: dict
    batch_size: int
    run_fn: Callable | None = None


@dataclass
class Failover:
    """A block's attempts (its actor died or hung on it) and the time after which a block counts as hung."""

    attempts: int = 3
    timeout_s: float = 1800.0


def default_run_requests(vlm, rows: list[Request], batch_size: int) -> list[Prediction]:
    from promprune.eval import run_requests

    return run_requests(vlm, rows, batch_size=batch_size)


class Watchdog:
    """Ends this process if the block it guards takes longer than ``timeout_s`` (``with Watchdog(...)``): a hung
    generation (a deadlocked kernel, a stuck collective) cannot be interrupted from inside, so the actor exits and
    Ray restarts it and retries the block (`Failover`)."""

    def __init__(self, timeout_s: float, what: str):
        self.timeout_s, self.what = timeout_s, what
        self.timer: threading.Timer | None = None

    def _fire(self) -> None:
        print(f"promprune: {self.what} ran past block_timeout_s={self.timeout_s:g}s; this actor exits so that Ray "
              "restarts it and retries the block", flush=True)
        os._exit(EXIT_HUNG)

    def __enter__(self) -> "Watchdog":
        self.timer = threading.Timer(self.timeout_s, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.timer.cancel()
        return False


class Ledger:
    """How many times each block of each evaluation has been started, over every actor (one small Ray actor per
    sweep, or per evaluation run alone): an actor that restarts after dying on a block, wherever Ray restarts it,
    sees that block's earlier attempts and gives it up after `Failover.attempts`."""

    def __init__(self):
        self.started: dict[str, int] = {}

    def begin(self, key: str) -> int:
        """Count one more attempt of ``key`` (evaluation/block); returns its number (1 for the first)."""
        self.started[key] = self.started.get(key, 0) + 1
        return self.started[key]


def new_ledger():
    """A `Ledger` actor (no CPU reserved) on this process's node (the driver's: a worker node lost must not take the
    counts with it), restarted (empty) should that node go too; it lives as long as its owner."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(Ledger).options(num_cpus=0, scheduling_strategy=here, max_restarts=-1,
                                      max_task_retries=-1).remote()


class Predictor:
    """A Ray Data actor: loads the PrunedVLM once (`ModelSource.load`: from the weights a sweep published to the
    object store, or `from_pretrained`), then answers one sealed block per call under `torch.inference_mode()`.
    A block that has already been started `Failover.attempts` times (its actor died or hung on it each time, see
    `Ledger`) is not run again: its requests become failed samples saying so."""

    def __init__(self, job: Job, failover: Failover, ledger=None, evaluation: str = ""):
        import torch

        if timeline.enabled():
            timeline.tag(node=ray.get_runtime_context().get_node_id()[:8])
            timeline.mark("actor_process", "actor", t=timeline.process_started())
            timeline.mark("actor_init", "actor")
        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.job, self.failover, self.ledger, self.evaluation = job, failover, ledger, evaluation
        self.vlm = job.source.load(method=job.method, budget=job.budget, options=job.options)
        self.run_fn = job.run_fn or default_run_requests
        self.node = ray.get_runtime_context().get_node_id()
        timeline.mark("actor_ready", "actor")

    def __call__(self, envelopes: pa.Table) -> pa.Table:
        """Envelope rows (`requests.ENVELOPE`) -> their predictions (`arrow_schema(Prediction)`)."""
        out = []
        for bid, block in unseal(envelopes):
            attempt = self._attempt(bid)
            if attempt > self.failover.attempts:
                out += failed(from_arrow(block, Request), lost_reason(self.failover), self.node)
                continue
            timeline.mark("predict_start", "actor", call=bid, rows=block.num_rows)
            with Watchdog(self.failover.timeout_s, f"block {bid} ({block.num_rows} requests)"):
                out += self.answer(block)
            timeline.mark("predict_end", "actor", call=bid, rows=block.num_rows)
        return to_arrow(out, Prediction)

    def _attempt(self, bid: str) -> int:
        """This block's attempt number from the Ledger (1 without one, or when the Ledger is out of reach)."""
        if self.ledger is None:
            return 1
        try:
            return ray.get(self.ledger.begin.remote(f"{self.evaluation}/{bid}"))
        except ray.exceptions.RayActorError:  # the ledger's node is gone: run the block uncounted
            return 1

    def answer(self, block: pa.Table) -> list[Prediction]:
        """One block's predictions, one per request. The model isolates failing samples itself; an exception out of
        the whole block (an out-of-memory error, say) is retried here, up to `Failover.attempts` tries in all, and
        then fails the block's requests with its message."""
        import torch

        from promprune.eval.requests import share_images

        rows = share_images(from_arrow(block, Request))  # a block stores each image once: every row gets its own
        for attempt in range(1, self.failover.attempts + 1):
            try:
                with torch.inference_mode():
                    preds = self.run_fn(self.vlm, rows, self.job.batch_size)
                if len(preds) != len(rows):
                    raise RuntimeError(f"run_requests returned {len(preds)} predictions for {len(rows)} rows")
                return [dataclasses.replace(add_efficiency(self.vlm, p), node=self.node) for p in preds]
            except Exception as exc:  # noqa: BLE001 - retried, then recorded on every request of the block
                error = f"the block failed as a whole, {attempt} time(s): {type(exc).__name__}: {exc}"
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return failed(rows, error, self.node)


def failed(rows: list[Request], error: str, node: str | None = None) -> list[Prediction]:
    """Failed predictions for ``rows`` (scored as the empty answer, counted in ``n_failed``)."""
    from promprune.records import Answer

    return [Prediction.answering(r, Answer(error=error), node=node) for r in rows]


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


# ----------------------------------------------------------------------------------------------------------------
# one evaluation's stream


def configure_data_context(wait_s: float) -> None:
    """This process's Ray Data settings for evaluations (the trial process runs the Ray Data executor):

    - blocks out of attempts are dropped by the error budget and recorded as failed samples (`stream`), instead
      of failing the evaluation;
    - no progress bars or execution banners (the sweep prints its own lines)."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.max_errored_blocks = -1
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.wait_for_min_actors_s = -1 if wait_s is None else wait_s
    # a trial may wait for actors behind other trials' for hours; a hung block is the watchdog's (Failover)
    ctx.execution_no_progress_timeout_s = -1


def stream(requests: Requests, job: Job, plan: Plan, failover: Failover,
           skip: set[str] | frozenset = frozenset(), wait_s: float | None = None,
           ledger=None, evaluation: str | None = None) -> Iterator[tuple[str, pa.Table]]:
    """Answer every block with a sample not in ``skip``; yields ``(block id, predictions)`` as blocks come back,
    in no particular order. ``wait_s``: how long the pool may wait for its first actor (None: as long as it takes,
    e.g. behind other trials' actors). ``ledger``: a sweep's `Ledger` (None: one for this evaluation), counting
    attempts under ``evaluation`` (None: a new id, attempts start afresh)."""

    from ray.data import ActorPoolStrategy

    from pipelines.run.requests import block_id

    configure_data_context(wait_s)  # before the dataset exists: a dataset keeps the context it was created under
    ds = requests.dataset(skip)
    if ds is None:
        return
    ledger = new_ledger() if ledger is None else ledger
    evaluation = evaluation or uuid.uuid4().hex
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_restarts / max_task_retries go through ray_remote_args (2.60: no names)
        ds = ds.map_batches(
            Predictor, fn_constructor_kwargs={"job": job, "failover": failover, "ledger": ledger,
                                              "evaluation": evaluation},
            batch_size=1, batch_format="pyarrow", zero_copy_batch=True,
            # a fixed size: the actors that do not fit yet are pending (the autoscaler's demand), never given up
            compute=ActorPoolStrategy(size=plan.max_actors, max_tasks_in_flight_per_actor=1),
            # Ray restarts a lost actor and resends its block for as long as it takes (a node lost is no reason to
            # give a block up); the Ledger counts the attempts that actually started
            num_gpus=plan.gpus if plan.on_gpu else None, num_cpus=plan.cpus, max_restarts=-1, max_task_retries=-1)
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        if batch.num_rows:
            yield block_id(table_keys(batch)), batch


def lost_reason(failover: Failover) -> str:
    return (f"lost: the actor answering this sample's block died or hung (block_timeout_s={failover.timeout_s:g}s) "
            f"on it {failover.attempts} time(s) (resources.block_attempts); the Ray logs of the actors say why")


def lost(requests: Requests, missing: set[str], failover: Failover) -> list[Prediction]:
    """Failed predictions for samples no block brought back (Ray Data gave their block up: it counts as lost)."""
    return failed(requests.requests_of(missing), lost_reason(failover))


def run(requests: Requests, job: Job, plan: Plan, failover: Failover, wait_s: float | None = None,
        store: BlockStore | None = None, on_block: Callable[[int, pa.Table], None] | None = None,
        ledger=None) -> pa.Table:
    """One evaluation: every block answered (or recorded as lost), as one predictions table.

    ``store``: the trial's saved blocks; blocks already there are not generated again, and each new block is saved
    as it comes back. ``on_block(samples done, all predictions so far)`` runs after each block (progress reports).
    """
    from pipelines.run.result import assemble_predictions

    started = time.perf_counter()
    wanted = set(requests.keys)
    tables = [] if store is None else [_only(store.load(), wanted)]
    done = sum(t.num_rows for t in tables)
    ledger = new_ledger() if ledger is None else ledger
    evaluation = uuid.uuid4().hex  # this run's attempts in the ledger (a retried trial starts afresh)
    for _ in range(failover.attempts):  # a pass again for blocks Ray Data gave up (an actor lost with its node)
        for bid, table in stream(requests, job, plan, failover, skip=_keys_of(tables), wait_s=wait_s,
                                 ledger=ledger, evaluation=evaluation):
            if store is not None:
                store.save(bid, table)
            tables.append(table)
            done += table.num_rows
            if on_block is not None:
                on_block(done, tables)
        missing = wanted - _keys_of(tables)
        if not missing:
            break
    if missing:  # each pass started them again: the Ledger fails them once they are out of attempts
        tables.append(to_arrow(lost(requests, missing, failover), Prediction))
    timeline.mark("last_answer", "trial", s=time.perf_counter() - started)
    return assemble_predictions(requests.keys, tables)


def _keys_of(tables: list[pa.Table]) -> set[str]:
    return {k for table in tables for k in table_keys(table)}


def _only(table: pa.Table, keys: set[str]) -> pa.Table:
    """The rows of ``table`` whose sample key is in ``keys`` (a store may hold a block of another task subset)."""
    import pyarrow.compute as pc

    joined = pc.binary_join_element_wise(table.column("task"), pc.cast(table.column("doc_id"), pa.string()), "/")
    return table.filter(pc.is_in(joined, value_set=pa.array(sorted(keys), pa.string())))
