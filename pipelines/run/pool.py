"""The roster of a sweep's model workers (`pipelines/run/workers.py`): a small named Ray actor on the driver's node,
kept light (it imports Ray and nothing of the model: the workers' arguments reach it pickled, opened only when it
must start a worker itself).
"""
from __future__ import annotations

import io
import pickle
import threading
import time

import ray

KEEP_S = 20.0  # a worker no lease needs is retired after this long (the next trial's lease comes within seconds)
TRIM_EVERY_S = 1.0  # how often the pool compares its workers with what its leases need
# a holder not heard from for this long (its trial's process died without releasing) loses its lease and grants; a
# live trial is heard from at least every `engine.HEARTBEAT_S`
HOLDER_TIMEOUT_S = 60.0
# how long a worker's model load may last (the default of `resources.load_timeout_s`): a first load that lasts longer
# ends the worker and fails the sweep's trials (`Pool._judge_loads`); a reload after Ray restarted a worker mid-block
# counts toward its block's frozen-worker clock past it (`Pool.ready_for`): a slow load is not taken for a frozen
# worker, a load that hangs (a stuck file system, a worker frozen while loading) is
LOAD_ALLOWANCE_S = 1800.0
WARM = "__warm__"  # the driver's lease while it sets the sweep up: dropped when the first trial leases


def pack_spawn(fn) -> tuple[bytes, list]:
    """``(bytes, refs)``: ``fn`` pickled for the pool with the Ray object references it holds (a published model's
    weights) left out of the bytes and listed in ``refs``, to travel as Ray arguments. Pickled into the bytes, a
    reference loses its owner: the pool could not hand it on to a worker it starts ("a Ray object whose owner is
    unknown"), and its owner would not know the pool still needs the object."""
    import cloudpickle

    refs: list = []

    class _Pickler(cloudpickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, ray.ObjectRef):
                refs.append(obj)
                return len(refs) - 1
            return None

    buffer = io.BytesIO()
    _Pickler(buffer).dump(fn)
    return buffer.getvalue(), refs


def unpack_spawn(data: bytes, refs: list):
    """`pack_spawn`'s function, its object references the ones Ray delivered in ``refs``."""

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, index):
            return refs[index]

    return _Unpickler(io.BytesIO(data)).load()


class Pool:
    """The roster of a sweep's workers, the leases of the trials using them, which worker answers which trial's
    block, and the attempts of every block (a Ray actor, named after the sweep and its `PoolKey`, that owns the
    workers it starts: when it goes, they go).

    - A lease is ``holder -> workers it can use`` (a holder: one run of a trial); the pool keeps
      ``min(plan.pool_size, sum of leases)`` workers, creating them as leases ask and retiring the surplus once it
      has lasted `KEEP_S` (a background thread checks every `TRIM_EVERY_S`).
    - A grant is one block's worth of a worker: `acquire` grants idle workers (up, no block of any trial on them),
      `free` ends a grant. So each worker has at most one block in flight, whichever trial sent it: a block never
      waits at a busy worker while another is idle, and a block that kills its worker is the only one charged.
    - A holder that stops calling (its process died) loses its lease and grants after `HOLDER_TIMEOUT_S`.
    - A worker whose first model load lasts longer than ``load_allowance_s`` (`resources.load_timeout_s`, counted from
      its last `load_began`) is killed and every trial fails with `error` (`_judge_loads`): no block is in flight on
      it, so no trial's frozen-worker clock (`engine._kill_frozen`) would ever end it, and the sweep waited for ever."""

    load_allowance_s = LOAD_ALLOWANCE_S  # (an instance's own: the constructor's argument)

    def __init__(self, pool_size: int, spawn: bytes, keep_s: float = KEEP_S, refs: list | None = None,
                 load_allowance_s: float = LOAD_ALLOWANCE_S):
        self.pool_size, self.spawn, self.keep_s, self.refs = pool_size, spawn, keep_s, refs or []
        self.load_allowance_s = float(load_allowance_s)
        self._spawn_fn = None  # `spawn` unpickled (`_new_worker`)
        self.lock = threading.Lock()
        self.workers: dict[int, object] = {}  # worker id -> handle
        self.loading: dict[int, ray.ObjectRef] = {}  # worker id -> its `ready` call, until it answers
        self.up: set[int] = set()  # ids of the workers whose model is loaded
        self.leases: dict[str, int] = {}  # holder -> workers it can use
        self.heard: dict[str, float] = {}  # holder -> when it last called
        self.grants: dict[int, str] = {}  # worker id -> the holder whose block it answers
        self.started: dict[str, int] = {}  # block key (evaluation/block) -> attempts started
        self.ids: dict[int, str] = {}  # worker id -> its Ray actor id (what its `ready` answered)
        self.loads: dict[str, tuple[float, float | None]] = {}  # actor id -> (its last load began, ended or None)
        self.next_id, self.surplus_since = 0, None
        self.error: str | None = None  # why a worker could not start (its model did not load): every trial fails
        self.me = ray.get_runtime_context().current_actor
        threading.Thread(target=self._trim_loop, daemon=True).start()

    def adopt(self, workers: list) -> None:
        """Take workers the driver started (`WorkerPool.warm`) onto the roster once they are up; they count as the
        pool's from now on (retired like its own; they end with the driver, not with the pool)."""
        with self.lock:
            for worker in workers:
                wid, self.next_id = self.next_id, self.next_id + 1
                self.workers[wid], self.loading[wid] = worker, worker.ready.remote()

    def lease(self, holder: str, workers: int) -> None:
        """``holder`` (a trial's run) can use ``workers`` workers from now on (the warm-up lease ends at the first)."""
        with self.lock:
            if holder != WARM:
                self.leases.pop(WARM, None)
            self.leases[holder], self.heard[holder] = max(0, int(workers)), time.monotonic()
            self._grow()

    def resize(self, pool_size: int) -> None:
        """At most ``pool_size`` workers from now on (the sweep's plan once its blocks are known: workers started
        before that were sized by the plan made without them)."""
        with self.lock:
            self.pool_size = int(pool_size)
            self._grow()

    def release(self, holder: str) -> None:
        """``holder`` is done: its lease ends and the workers answering its blocks are free."""
        with self.lock:
            self._drop(holder)

    def acquire(self, holder: str, wanted: int) -> tuple[list, str | None]:
        """([(worker id, handle)] of up to ``wanted`` idle workers, now granted to ``holder``; why workers fail to
        start, or None)."""
        with self.lock:
            self._poll()
            self.heard[holder] = time.monotonic()
            idle = [w for w in sorted(self.up) if w not in self.grants][:max(0, wanted)]
            self.grants.update({w: holder for w in idle})
            return [(w, self.workers[w]) for w in idle], self.error

    def free(self, holder: str, wid: int) -> None:
        """``holder``'s block on worker ``wid`` came back (or the worker is gone)."""
        with self.lock:
            if self.grants.get(wid) == holder:
                del self.grants[wid]

    def roster(self) -> tuple[list, str | None]:
        """([(worker id, handle)] of the workers up, granted or not; why workers fail to start, or None)."""
        with self.lock:
            self._poll()
            return [(i, self.workers[i]) for i in sorted(self.up)], self.error

    def begin(self, key: str) -> int:
        """Count one more attempt of ``key`` (evaluation/block); returns its number (1 for the first)."""
        self.started[key] = self.started.get(key, 0) + 1
        return self.started[key]

    def load_began(self, actor: str) -> None:
        """The worker of Ray actor id ``actor`` begins loading its model (its process started, or restarted by Ray)."""
        self.loads[actor] = (time.monotonic(), None)

    def load_ended(self, actor: str) -> None:
        """The worker of Ray actor id ``actor`` has its model loaded: ready to answer blocks."""
        began = self.loads.get(actor, (time.monotonic(), None))[0]
        self.loads[actor] = (began, time.monotonic())

    def ready_for(self, wid: int, load_allowance_s: float | None = None) -> float | None:
        """Seconds since worker ``wid`` last finished loading its model (its first start or Ray's last restart of
        it), None where it never said (`engine._kill_frozen`: a block's clock counts only the time its worker was
        ready to work). While it loads: 0.0 for its first ``load_allowance_s`` (None: the pool's,
        `resources.load_timeout_s`), then the time past them, so a reload that hangs reaches the frozen-worker limit
        too (its trial kills it once that time passes `resources.block_timeout_s` + `engine.FROZEN_MARGIN_S`: about
        ``load_allowance_s`` + block_timeout_s + 30 s after the reload began). A worker's first load is judged by the
        pool itself (`_judge_loads`)."""
        load = self.loads.get(self.ids.get(wid, ""))
        if load is None:
            return None
        allowance = self.load_allowance_s if load_allowance_s is None else load_allowance_s
        now = time.monotonic()
        return max(0.0, now - load[0] - allowance) if load[1] is None else now - load[1]

    def state(self) -> dict:
        """What the pool holds now: workers alive, up, granted, and the leases (for tests and the console)."""
        with self.lock:
            self._poll()
            return {"workers": len(self.workers), "up": len(self.up), "granted": len(self.grants),
                    "leases": dict(self.leases), "pool_size": self.pool_size}

    def _drop(self, holder: str) -> None:
        self.leases.pop(holder, None)
        self.heard.pop(holder, None)
        self.grants = {w: h for w, h in self.grants.items() if h != holder}

    def _need(self) -> int:
        return min(self.pool_size, sum(self.leases.values()))

    def _grow(self) -> None:
        while self.error is None and len(self.workers) < self._need():
            try:
                worker = self._new_worker()
            except Exception as exc:  # noqa: BLE001 - said to every trial (`acquire`), which then fails, not waits
                self.error = f"the pool could not start a worker: {type(exc).__name__}: {exc}"
                return
            wid, self.next_id = self.next_id, self.next_id + 1
            self.workers[wid], self.loading[wid] = worker, worker.ready.remote()

    def _new_worker(self):
        """A worker of the sweep's kind (``spawn``: `workers.new_worker` with its arguments, pickled, called with this
        pool's handle); the first call imports what they need (torch, the model's classes), which the pool's process
        is spared as long as the driver's warm workers suffice."""
        if self._spawn_fn is None:  # unpickled once, at the first worker the pool itself starts
            self._spawn_fn = unpack_spawn(self.spawn, self.refs)
        return self._spawn_fn(self.me)

    def _poll(self) -> None:
        """Move the workers whose model has loaded onto the roster; a worker that died loading is an error."""
        if not self.loading:
            return
        done, _ = ray.wait(list(self.loading.values()), num_returns=len(self.loading), timeout=0)
        for wid in [w for w, ref in self.loading.items() if ref in done]:
            ref = self.loading.pop(wid)
            try:
                self.ids[wid] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self.error = self.error or f"{type(exc).__name__}: {exc}"[:4000]
                self.workers.pop(wid, None)
                continue
            self.up.add(wid)

    def _trim_loop(self) -> None:
        while True:
            time.sleep(TRIM_EVERY_S)
            with self.lock:
                now = time.monotonic()
                for holder in [h for h, t in self.heard.items() if h != WARM and now - t > HOLDER_TIMEOUT_S]:
                    self._drop(holder)  # its trial's process died without releasing
                self._poll()
                self._judge_loads()
                self._trim()

    def _judge_loads(self) -> None:
        """End a worker whose first model load (its `ready` call unanswered) has lasted more than ``load_allowance_s``
        since it last said it began (`load_began`: its process started, or Ray restarted it), and fail every trial
        with a paragraph saying why (`error`). A worker that has not said so yet is waiting for a node (pending: the
        autoscaler's demand, which `_trim` retires when no lease needs it) or starting its process, and is not
        judged; nor is one that said it has loaded (its `ready` answers at once)."""
        now = time.monotonic()
        for wid in list(self.loading):
            worker = self.workers[wid]
            began, ended = self.loads.get(worker._actor_id.hex(), (None, None))
            if began is None or ended is not None or now - began <= self.load_allowance_s:
                continue
            self.loading.pop(wid)
            self.workers.pop(wid)
            ray.kill(worker, no_restart=True)
            self.error = self.error or (
                f"model worker {wid} has been loading its model for {now - began:.0f}s, past "
                f"resources.load_timeout_s={self.load_allowance_s:g}s, and was ended: its load is stuck (a file "
                "system or model hub that does not answer, or is very slow: a network mount, a full or failing disk, "
                "a download that stalled) or frozen (a deadlock in the model's loading code). Check that the model "
                "path and its storage can be read from the worker's node (its Ray log says where the load stopped); "
                "if this checkpoint really takes longer to load, raise resources.load_timeout_s.")

    def _trim(self) -> None:
        """Retire the workers beyond what the leases need once the surplus has lasted `keep_s`: pending ones first
        (they hold no GPU yet, only the autoscaler's demand), then idle ones, never one answering a block."""
        surplus = len(self.workers) - self._need()
        if surplus <= 0:
            self.surplus_since = None
            return
        now = time.monotonic()
        self.surplus_since = self.surplus_since or now
        if now - self.surplus_since < self.keep_s:
            return
        idle = sorted((w for w in self.workers if w not in self.grants), key=lambda w: (w in self.up, -w))
        for wid in idle[:surplus]:
            worker = self.workers.pop(wid)
            if wid in self.up:
                self.up.discard(wid)
                worker.retire.options(max_task_retries=0).remote()  # (an exit is not a failure to retry)
            else:
                self.loading.pop(wid, None)
                ray.kill(worker)
        self.surplus_since = None
