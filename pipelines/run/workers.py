"""A sweep's model workers: Ray actors that load the model once and answer the blocks of every trial of the sweep.

    WorkerPool (the driver's: started once per sweep, closed at its end)
      -> Pool (`pool.py`: a named Ray actor on the driver's node: the roster of workers, the leases of the trials that
         use them, which worker answers which trial's block, the attempts of every block)
      -> Worker x n (Ray actors holding the model: the published weights mapped once, imports warm; each call wraps
         the model for the calling trial's `Trial` and answers one sealed block)

Workers outlive trials: a trial is a light coordinator (`pipelines/run/engine.py`) that leases workers from the
pool, sends them its blocks, and releases them when it ends. What a worker holds is its pool's `PoolKey` (the model
with its loading options, the dtype it runs in, its placement); a pool is scoped to one sweep (its name carries the
sweep's experiment), so two sweeps never share a worker, and nothing of one model is ever asked of another.

- *Elastic.* The pool holds as many workers as its leases can use (each trial: one per block it has left, at most
  `Plan.max_actors`; all together at most `Plan.pool_size`), created as leases ask; the workers the cluster cannot
  place yet are pending, which is what an autoscaler adds nodes for. Trials send blocks to the workers that are up
  and take the others as they come up: the pool grants idle workers, one block each, whichever trial asks
  (`Pool.acquire`). Workers the leases no longer need for `KEEP_S` are retired (pending ones first, never one
  answering a block), so their GPUs and the autoscaler's demand go when no trial needs them; the rest go when the
  sweep ends (`WorkerPool.close`).
- *Failover.* A worker that dies (its node lost, a segfault, host memory exhausted) is restarted by Ray
  (`max_restarts=-1`) and the call it was answering is sent again (`max_task_retries=-1`). The pool counts the
  attempts of each block that actually started (`Pool.begin`), over every worker; the attempt after
  `resources.block_attempts` returns the block's requests as failed samples, named, instead of running it. One
  block per call, so a block that kills its worker is the only one charged. A `Watchdog` makes a worker whose block
  hangs past `resources.block_timeout_s` exit, which is the same case; a worker frozen whole (SIGSTOP: its watchdog
  thread frozen with it) is killed by its trial past that plus `engine.FROZEN_MARGIN_S` of work (the time a
  restarted worker spends loading its model is not counted, up to `resources.load_timeout_s`: `Pool.ready_for`; a
  reload that hangs is killed about block_timeout_s + `engine.FROZEN_MARGIN_S` after that allowance ran out). A
  block whose call raises as a whole is retried in the worker, then recorded with its error (`Worker.answer`).
- *A first load that hangs.* A worker whose first model load lasts longer than `resources.load_timeout_s` (a stuck
  file system, a deadlocked load: no block is in flight on it, so no trial's clock judges it) is ended by the pool,
  and every trial fails with one paragraph saying why and what to check (`Pool._judge_loads`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import ray

from promprune.records import Prediction, Request, from_arrow, to_arrow

from pipelines import timeline
from pipelines.run.pool import KEEP_S, LOAD_ALLOWANCE_S, WARM, Pool, pack_spawn
from pipelines.run.requests import unseal
from pipelines.run.resources import Plan
from pipelines.spec.trials import Trial
from pipelines.weights import ModelSource, resolve_dtype

EXIT_HUNG = 70  # the exit status of a worker whose watchdog fired (a block past block_timeout_s)
WRAPPED_PER_WORKER = 8  # trials' wrappers a worker keeps (a PrunedVLM over the shared model: cheap to rebuild; the
# ones not serving hold nothing on the device: `Worker._vlm`)


@dataclass
class Failover:
    """A block's attempts (its worker died or hung on it), the time after which a block counts as hung, and how long
    a worker's model load may last (`Pool`: past it a first load ends the worker and fails the trials)."""

    attempts: int = 3
    timeout_s: float = 1800.0
    load_timeout_s: float = LOAD_ALLOWANCE_S

    @classmethod
    def of(cls, resources) -> "Failover":
        """A spec's ``resources.block_attempts``, ``resources.block_timeout_s`` and ``resources.load_timeout_s``."""
        return cls(resources.block_attempts, resources.block_timeout_s, resources.load_timeout_s)


@dataclass(frozen=True)
class PoolKey:
    """What a pool's workers hold: the model (checkpoint, attention implementation, adapter options), the dtype
    they run it in (resolved: ``auto`` is float32 on CPUs, bfloat16 on GPUs) and their placement (device, GPUs and
    CPUs per worker). Its ``digest`` names the pool."""

    model: str
    dtype: str
    placement: str

    @classmethod
    def of(cls, source: ModelSource, plan: Plan) -> "PoolKey":
        model = json.dumps([source.pretrained, source.attn_implementation, source.options], sort_keys=True,
                           default=str)
        place = f"gpu:{plan.gpus:g}+cpu:{plan.cpus:g}" if plan.on_gpu else f"cpu:{plan.cpus:g}"
        return cls(model, resolve_dtype(source.dtype, plan.on_gpu), place)

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.model}|{self.dtype}|{self.placement}".encode()).hexdigest()[:12]


def takes_seed(run_fn: Callable) -> bool:
    """Whether ``run_fn`` takes a ``seed`` keyword (a ``seed`` parameter or ``**kwargs``)."""
    params = inspect.signature(run_fn).parameters.values()
    return any(p.name == "seed" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def default_run_requests(vlm, rows: list[Request], batch_size: int, seed: str | None = None) -> list[Prediction]:
    """`run_requests`, ``seed`` the trial's id: with the spec's ``generation.seed`` and each sample's key,
    it seeds the trial's sampled answers, one stream per sample. A sweep's ``run_fn`` (tests) replaces it, called with
    ``(vlm, rows, batch_size)``, and ``seed=`` too where its signature takes it (`takes_seed`)."""
    from promprune.eval import run_requests

    return run_requests(vlm, rows, batch_size=batch_size, seed=seed)


class Watchdog:
    """Ends this process if the block it guards takes longer than ``timeout_s`` (``with Watchdog(...)``): a hung
    generation (a deadlocked kernel, a stuck collective) cannot be interrupted from inside, so the worker exits and
    Ray restarts it and sends the block again (`Failover`)."""

    def __init__(self, timeout_s: float, what: str):
        self.timeout_s, self.what = timeout_s, what
        self.timer: threading.Timer | None = None

    def _fire(self) -> None:
        print(f"promprune: {self.what} ran past block_timeout_s={self.timeout_s:g}s; this worker exits so that Ray "
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


# ----------------------------------------------------------------------------------------------------------------
# a worker


class Worker:
    """A Ray actor holding the sweep's model: loads it once (`ModelSource.load`, unpruned: from the weights the sweep
    published to the object store, or `from_pretrained`), then answers one sealed block per call for whichever trial
    sends it, its model wrapped in a `PrunedVLM` for that trial's method, budget and options, under
    `torch.inference_mode()`. A block already started `Failover.attempts` times (its worker died or hung on it each
    time; `Pool.begin` counts) is not run again: its requests become failed samples saying so."""

    def __init__(self, source: ModelSource, batch_size: int, failover: Failover, pool=None,
                 run_fn: Callable | None = None):
        me = ray.get_runtime_context().get_actor_id()
        if pool is not None:  # (again at each restart by Ray: the trials' clock of a block skips the load)
            pool.load_began.remote(me)
        import torch

        if timeline.enabled():
            timeline.tag(node=ray.get_runtime_context().get_node_id()[:8])
            timeline.mark("actor_process", "actor", t=timeline.process_started())
            timeline.mark("actor_init", "actor")
        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.source, self.batch_size, self.failover, self.pool = source, batch_size, failover, pool
        self.base = source.load(method=None, budget=None)  # the model, unpruned; each trial wraps it (`_vlm`)
        self.wrapped: dict[str, object] = {}
        self.run_fn = run_fn or default_run_requests
        self.seeds = takes_seed(self.run_fn)
        self.node, self.actor = ray.get_runtime_context().get_node_id(), me
        if pool is not None:
            pool.load_ended.remote(me)
        timeline.mark("actor_ready", "actor")

    def ready(self) -> str:
        """This worker's Ray actor id (answered once the model is loaded: `Pool.ready_for` keys its loads by it)."""
        return self.actor

    def holds(self) -> tuple[str, str]:
        """(the checkpoint, the dtype its weights are in) of the model this worker holds."""
        return self.source.pretrained, str(self.base.model.dtype).removeprefix("torch.")

    def answer(self, trial: Trial, envelopes: pa.Table, evaluation: str) -> pa.Table:
        """Envelope rows (`requests.ENVELOPE`) of ``trial`` -> their predictions (`arrow_schema(Prediction)`);
        ``evaluation``: the run of the trial whose attempts `Pool.begin` counts."""
        out = []
        for bid, block in unseal(envelopes):
            if self._attempt(f"{evaluation}/{bid}") > self.failover.attempts:
                out += failed(from_arrow(block, Request), lost_reason(self.failover), self.node)
                continue
            timeline.mark("predict_start", "actor", call=bid, rows=block.num_rows, trial=trial.trial_id)
            with Watchdog(self.failover.timeout_s, f"block {bid} ({block.num_rows} requests)"):
                out += self._answer(self._vlm(trial), block, trial.trial_id)
            timeline.mark("predict_end", "actor", call=bid, rows=block.num_rows, trial=trial.trial_id)
        return to_arrow(out, Prediction)

    def calibrate(self, cal, metrics: list[str], budget: int) -> dict:
        """`pipelines.calibration.measure` with this worker's model (the sweep's `mu: calibrate` trials)."""
        from pipelines import calibration

        return calibration.measure(self.base, self.source.options, cal, metrics, budget)

    def retire(self) -> None:
        """End this worker (after the calls sent before this one): the pool no longer needs it."""
        ray.actor.exit_actor()

    def _vlm(self, trial: Trial):
        """The model wrapped for ``trial`` (kept for the next blocks of the same trial). The wrappers kept for other
        trials release what they hold on the device beside the shared model (CDPruner's CLIP text tower:
        `PrunedVLM.release_extras`) before this one is built or served, so the peak memory of ``trial``'s samples
        holds its own method's only; this one's come back first (not in a timed sample)."""
        from promprune.models import PrunedVLM

        key = json.dumps([trial.method, trial.budget, trial.run_options], sort_keys=True, default=str)
        for other, vlm in self.wrapped.items():
            if other != key:
                vlm.release_extras()
        if key not in self.wrapped:
            if len(self.wrapped) >= WRAPPED_PER_WORKER:
                self.wrapped.pop(next(iter(self.wrapped)))
            self.wrapped[key] = PrunedVLM(self.base.model, self.base.processor, method=trial.method,
                                          budget=trial.budget, **self.source.options, **trial.run_options)
        self.wrapped[key].restore_extras()
        return self.wrapped[key]

    def _attempt(self, key: str) -> int:
        """This block's attempt number from the pool (1 without one, or when the pool is out of reach)."""
        if self.pool is None:
            return 1
        try:
            return ray.get(self.pool.begin.remote(key))
        except ray.exceptions.RayActorError:  # the pool's node is gone: run the block uncounted
            return 1

    def _answer(self, vlm, block: pa.Table, seed: str | None = None) -> list[Prediction]:
        """One block's predictions, one per request. The model isolates failing samples itself; an exception out of
        the whole block (an out-of-memory error, say) is retried here, up to `Failover.attempts` tries in all, and
        then fails the block's requests with its message. ``seed`` (the trial's id) seeds the block's sampled
        answers (`promprune.eval.generation.sample_seeds`), so that a trial's sampled answers never depend on the
        blocks, of its own or of other trials, this worker answered before, nor on the batches."""
        import torch

        from promprune.eval.requests import share_images

        rows = share_images(from_arrow(block, Request))  # a block stores each image once: every row gets its own
        for attempt in range(1, self.failover.attempts + 1):
            try:
                with torch.inference_mode():
                    preds = self.run_fn(vlm, rows, self.batch_size, **({"seed": seed} if self.seeds else {}))
                if len(preds) != len(rows):
                    raise RuntimeError(f"run_requests returned {len(preds)} predictions for {len(rows)} rows")
                return [dataclasses.replace(add_efficiency(vlm, p), node=self.node) for p in preds]
            except Exception as exc:  # noqa: BLE001 - retried, then recorded on every request of the block
                error = f"the block failed as a whole, {attempt} time(s): {type(exc).__name__}: {exc}"
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return failed(rows, error, self.node)


def failed(rows: list[Request], error: str, node: str | None = None) -> list[Prediction]:
    """Failed predictions for ``rows`` (scored as wrong answers, counted in ``n_failed``)."""
    from promprune.records import Answer

    return [Prediction.answering(r, Answer(error=error), node=node) for r in rows]


def lost_reason(failover: Failover) -> str:
    return (f"lost: the worker answering this sample's block died or hung (block_timeout_s={failover.timeout_s:g}s) "
            f"on it {failover.attempts} time(s) (resources.block_attempts); the Ray logs of the workers say why")


def add_efficiency(vlm, pred: Prediction) -> Prediction:
    """Per-sample prefill FLOPs and visual KV-cache bytes, under the paper's Table 6 convention.

    FLOPs count the whole prefill: the visual tokens the LLM received plus the prompt's text tokens as the model
    read them (``Prediction.text_tokens``: the processor's prompt without its visual placeholders, so a video's
    per-frame timestamps count). The KV cache counts the visual tokens only, as Table 6 does (1440.0 MB for
    LLaVA-NeXT-7B's 2880 tokens in fp16). An in-LLM method's layers each count the visual tokens they ran on and
    cached (``layer_visual_tokens``: every one before its cut), not the count after its last cut, and a sliding-window
    layer's cache as the in-LLM hooks hold it (every kept column). ``promprune.efficiency.generation_cost``, which
    ``benchmarks/efficiency.py`` prints too.
    """
    from promprune.efficiency import generation_cost

    if pred.visual_tokens is None or pred.text_tokens is None or pred.failed:
        return pred
    flops, kv = generation_cost(vlm.model.config.get_text_config(), pred.visual_tokens, pred.text_tokens,
                                pred.layer_visual_tokens, vlm.model.dtype)
    return dataclasses.replace(pred, prefill_flops=float(flops), kv_cache_bytes=float(kv))


def new_worker(source: ModelSource, plan: Plan, batch_size: int, failover: Failover, run_fn: Callable | None, pool):
    """One `Worker` actor with the plan's resources, restarted by Ray for as long as it takes (its calls sent again)."""
    return ray.remote(Worker).options(
        num_gpus=plan.gpus if plan.on_gpu else None, num_cpus=plan.cpus, max_restarts=-1, max_task_retries=-1,
    ).remote(source, batch_size, failover, pool, run_fn)


class WorkerPool:
    """The driver's side of a sweep's `Pool`: started once per sweep (or per evaluation run alone), closed at its end,
    which ends every worker (GPU memory freed, no demand left for the autoscaler). ``handle`` is what trials get."""

    def __init__(self, source: ModelSource, plan: Plan, batch_size: int, failover: Failover,
                 run_fn: Callable | None = None, sweep: str | None = None, keep_s: float = KEEP_S):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.key, self.args = PoolKey.of(source, plan), (source, plan, batch_size, failover, run_fn)
        self.adopted = []
        self.name = f"promprune-pool/{sweep or uuid.uuid4().hex[:8]}/{self.key.digest}"
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # on the driver's node, no CPU: a worker node lost takes neither the roster nor the attempts with it, and a
        # lost driver's node takes the sweep anyway (its workers die with the pool; --resume continues from the saved
        # blocks)
        spawn, refs = pack_spawn(functools.partial(new_worker, *self.args))
        # the references in a list: Ray hands them to the pool as references (borrowed, kept alive while it holds
        # them), not as their values
        self.handle = ray.remote(Pool).options(name=self.name, num_cpus=0, scheduling_strategy=here,
                                               max_concurrency=1).remote(plan.pool_size, spawn, keep_s, refs,
                                                                         failover.load_timeout_s)

    @property
    def source(self) -> ModelSource:
        """The model the pool's workers hold."""
        return self.args[0]

    @property
    def plan(self) -> Plan:
        """The pool's placement plan (device, workers, GPUs and CPUs per worker)."""
        return self.args[1]

    def replan(self, plan: Plan) -> None:
        """The sweep's plan made once its blocks are known (the pool was started with the one made before: its workers
        load while the blocks are built); the workers' placement must be the same, only the pool's size changes."""
        other = PoolKey.of(self.source, plan)
        if other != self.key:
            raise ValueError(f"a pool of {self.key.placement} workers cannot take a plan of {other.placement}")
        self.args = (self.source, plan, *self.args[2:])
        self.handle.resize.remote(plan.pool_size)

    def warm(self, workers: int) -> None:
        """Start ``workers`` workers now, from here (the pool's own process need not be up first), before any trial
        leases them: their imports and loading overlap the rest of the sweep's setup. The pool adopts them, and the
        first trial's lease takes over from this one."""
        started = [new_worker(*self.args, self.handle) for _ in range(workers)]
        self.adopted += started
        self.handle.adopt.remote(started)
        self.hold(workers)

    def hold(self, workers: int) -> None:
        """Keep ``workers`` workers (starting them again if the pool retired them) until the next trial leases: what
        the driver asks while Tune starts an experiment, so that no worker is retired before its first trial."""
        self.handle.lease.remote(WARM, workers)

    def first_worker(self, timeout_s: float | None = None):
        """A worker whose model is loaded (waits for one; RuntimeError when workers fail to start)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            members, error = ray.get(self.handle.roster.remote())
            if error:
                raise RuntimeError(f"the sweep's model workers could not start: {error}")
            if members:
                return members[0][1]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no model worker was up after {timeout_s:g}s")
            time.sleep(0.2)

    def calibrate(self, cal, metrics: list[str], budget: int) -> dict:
        """`pipelines.calibration.measure` with the sweep's model: here, when the workers run on the CPUs of a Ray this
        process started (it has the libraries imported and maps the published weights as a worker would, and need not
        wait for one to load), else on the first worker up (call `warm` first: before the first trial no lease asks
        for workers)."""
        from pipelines import calibration
        from pipelines.run.resources import started_here

        if not self.plan.on_gpu and started_here():
            return calibration.run(self.source, cal, metrics, budget)
        return ray.get(self.first_worker().calibrate.remote(cal, metrics, budget))

    def state(self, timeout_s: float | None = None) -> dict:
        """`Pool.state` (raises ``ray.exceptions.GetTimeoutError`` past ``timeout_s``)."""
        return ray.get(self.handle.state.remote(), timeout=timeout_s)

    def close(self) -> None:
        """End the pool and its workers (its own die with it; those started here are ended here)."""
        for worker in [self.handle, *self.adopted]:
            ray.kill(worker)
