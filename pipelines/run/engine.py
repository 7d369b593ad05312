"""The evaluation engine, a trial's side: its blocks sent to the sweep's model workers (`pipelines/run/workers.py`),
their predictions streamed back block by block.

    requests (sealed blocks in the object store, `requests.py`) -> a lease on the sweep's `Pool` (as many workers as
    the trial has blocks, at most `Plan.max_actors`) -> idle workers granted by the pool, one block each
    (`Worker.answer(trial, block)`) -> (block id, predictions) as each comes back -> `run`: every sample exactly once

A trial is a light coordinator: the workers hold the model and outlive it; it only dispatches, and takes workers as
they come up (a GPU node the autoscaler adds mid-trial). What happens when a worker dies or hangs is the workers'
(`workers.py`: Ray restarts it and resends the call, the pool counts a block's attempts, the last one returns failed
samples); what is left here is a worker that is gone for good (retired by the pool, its pool ended), whose block goes
to another worker, uncharged, and the pool itself dead, which the driver's `pool_watch` turns into a stopped, resumable
sweep: the trial waits for that stop instead of failing. When the trial ends, however it ends (a scheduler stopping it
raises out of its next progress report), the blocks it queued and no worker started are cancelled and its lease
released: a stopped trial sends no more work.
"""
from __future__ import annotations

import collections
import contextlib
import time
import uuid
from typing import Callable, Iterator

import pyarrow as pa
import ray

from promprune.records import table_keys

from pipelines import timeline
from pipelines.run.checkpoints import BlockStore
from pipelines.run.requests import Requests, block_id
from pipelines.spec.trials import Trial

POLL_S = 0.25  # how often a trial with blocks left and no worker free asks the pool again
FROZEN_MARGIN_S = 30.0  # past resources.block_timeout_s plus this, a block's worker is killed from here (`stream`)
POOL_LOST_WAIT_S = 60.0  # how long a trial that found the sweep's pool dead waits for the driver to stop the sweep
HEARTBEAT_S = 10.0  # a trial tells the pool it is alive at least this often (`pool.HOLDER_TIMEOUT_S`)


class WorkersFailed(RuntimeError):
    """The sweep's workers could not start (their model did not load): no trial can run, nor a retry of one (the
    pool keeps its error): `run_trial` says so to the driver first, which gives the trial no Tune retry
    (`trial.WORKERS_FAILED`, `trial.NotRetried`)."""


def stream(requests: Requests, trial: Trial, pool, max_workers: int,
           skip: set[str] | frozenset = frozenset(), block_timeout_s: float | None = None
           ) -> Iterator[tuple[str, pa.Table]]:
    """Answer every block of ``requests`` with a sample not in ``skip`` on the workers of ``pool`` (a `Pool` actor),
    at most ``max_workers`` at once, each granted by the pool for one block; yields ``(block id, predictions)`` as
    blocks come back, in no particular order. Close it (`run` does) to cancel what is still queued. A worker whose
    block came back is sent its next one before the block is yielded, so it answers that one while the trial saves
    the block, reports to Tune or computes a running score (one that outlasts the worker's block still leaves the
    worker waiting for the rest of it: one block per worker at a time).

    ``block_timeout_s`` (`resources.block_timeout_s`): a block outstanding longer than it plus `FROZEN_MARGIN_S`,
    counted from when it was sent or its worker was last ready to work (its model loaded again after Ray restarted
    it; not while it loads, for up to `resources.load_timeout_s`: `_kill_frozen`), gets its worker killed from here
    (Ray restarts it and sends the block again; the pool counts the attempt): the worker's own watchdog cannot end a
    frozen process (SIGSTOP, a stopped container), a thread of it. A worker that hangs in its first load has no
    block in flight: the pool ends it and `acquire` says why (`Pool._judge_loads`), raised here as `WorkersFailed`."""
    todo = collections.deque((ref, keys) for ref, keys in zip(requests.blocks, requests.block_keys)
                             if not set(keys) <= skip)
    evaluation = uuid.uuid4().hex  # this run's attempts in the pool (a retried trial starts afresh)
    holder, leased = f"{trial.trial_id}/{evaluation}", min(len(todo), max_workers)
    pool.lease.remote(holder, leased)
    inflight: dict = {}  # call -> (block ref, keys, worker id, worker, when sent or its worker last killed)
    asked = heard = 0.0

    def dispatch(now: float, answered: bool = False) -> None:
        """Ask the pool for idle workers, as many as there are blocks to send (within ``max_workers``), and send each
        its block. ``answered``: blocks came back that the trial has not read yet: a dead pool or workers that cannot
        start are left to the loop's next ask, after the trial has saved them (they were lost with the trial)."""
        nonlocal asked, heard
        wanted = min(len(todo), max_workers - len(inflight))
        if wanted <= 0:
            return
        try:
            granted, error = ray.get(pool.acquire.remote(holder, wanted))
        except ray.exceptions.RayActorError as e:  # the pool died: the driver stops the sweep (`pool_watch`)
            if answered:
                return
            _await_stop(e)
        if error:
            if answered:
                return
            raise WorkersFailed(f"the sweep's model workers could not start, so no trial can run: {error}")
        asked = heard = now
        for wid, worker in granted:
            ref, keys = todo.popleft()
            inflight[worker.answer.remote(trial, ref, evaluation)] = (ref, keys, wid, worker, now)

    try:
        while todo or inflight:
            now = time.monotonic()
            if min(len(todo), max_workers - len(inflight)) > 0 and now - asked >= POLL_S:
                dispatch(now)
            elif now - heard >= HEARTBEAT_S:
                pool.lease.remote(holder, leased)
                heard = now
            if not inflight:  # no worker free yet
                time.sleep(POLL_S)
                continue
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=POLL_S)
            answered = []
            for call in ready:
                ref, keys, wid, _, _ = inflight.pop(call)
                pool.free.remote(holder, wid)
                try:
                    table = ray.get(call)
                except ray.exceptions.RayActorError:  # the worker is gone for good: another one takes the block
                    todo.appendleft((ref, keys))
                    continue
                answered.append((block_id(keys), table))
            if ready:  # a worker is free: it takes its next block before the trial reads this one (saves it,
                dispatch(time.monotonic(), answered=bool(answered))  # reports to Tune, a running score): it works
            yield from answered
            if block_timeout_s is not None:
                _kill_frozen(inflight, trial, block_timeout_s + FROZEN_MARGIN_S, pool)
            if min(len(todo) + len(inflight), max_workers) < leased:  # the other workers may go to other trials
                leased = min(len(todo) + len(inflight), max_workers)
                pool.lease.remote(holder, leased)
    finally:
        for call in inflight:
            ray.cancel(call)  # queued at a worker: dropped; already running: finishes, unread
        pool.release.remote(holder)


def _kill_frozen(inflight: dict, trial: Trial, limit_s: float, pool) -> None:
    """Kill the worker of each call of ``inflight`` that has worked longer than ``limit_s`` without an answer (Ray
    restarts it and sends the call again), with a line saying so; its clock starts again.

    A call's clock runs from when it was sent (or its worker last killed from here), and only while its worker is
    ready to work: past ``limit_s`` on that clock, the pool says how long ago the worker last finished loading its
    model (`Pool.ready_for`: 0 while it loads, after Ray restarted it, for up to `resources.load_timeout_s`, then the
    time past it), and the shorter of the two is what counts. A worker that died on its own (its watchdog, a
    segfault) and reloads its model within that allowance, however slowly, is not mistaken for a frozen one, while a
    reload that hangs past it is killed as a frozen block is: since the pool is asked only once a call's clock passes
    ``limit_s``, and a load's time counts only past the allowance, that is about load_timeout_s + ``limit_s``
    (block_timeout_s + `FROZEN_MARGIN_S`) after the reload began. A worker the pool knows nothing of (the pool out of
    reach) is judged on the call's clock alone."""
    from pipelines.console import say

    now = time.monotonic()
    for call, (ref, keys, wid, worker, since) in list(inflight.items()):
        if now - since <= limit_s:
            continue
        try:
            ready = ray.get(pool.ready_for.remote(wid), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ready = None
        worked = now - since if ready is None else min(now - since, ready)
        if worked <= limit_s:  # loading, or ready again since: its clock starts when it was
            inflight[call] = (ref, keys, wid, worker, now - worked)
            continue
        say(f"[hung] {trial.trial_id}: block {block_id(keys)} has had no answer for {worked:.0f}s of its worker's work "
            f"(past resources.block_timeout_s + {FROZEN_MARGIN_S:g}s: its worker frozen or stuck); its worker {wid} is "
            "killed, so that Ray restarts it and sends the block again")
        ray.kill(worker, no_restart=False)
        inflight[call] = (ref, keys, wid, worker, now)


def _await_stop(error: Exception) -> None:
    """The sweep's pool died: wait for the driver's `pool_watch.Watch` to stop the sweep (Tune ends this trial
    unfinished, uncharged, its saved blocks kept for `--resume`); past `POOL_LOST_WAIT_S` (no driver watching: an
    evaluation alone), raise `pool_watch.PoolLost`."""
    from pipelines.run.pool_watch import PoolLost

    time.sleep(POOL_LOST_WAIT_S)
    raise PoolLost(f"the sweep's worker pool died, so no model worker can be granted: {error}")


def run(requests: Requests, trial: Trial, pool, max_workers: int, store: BlockStore | None = None,
        on_block: Callable[[int, list[pa.Table]], None] | None = None, block_timeout_s: float | None = None
        ) -> pa.Table:
    """One trial's evaluation: every block answered, as one predictions table (sorted, each sample exactly once).

    ``store``: the trial's saved blocks; blocks already there are not generated again, and each new block is saved
    as it comes back. ``on_block(samples done, all predictions so far)`` runs after each block (progress reports).
    ``block_timeout_s``: see `stream`.
    """
    from pipelines.run.result import assemble_predictions

    started = time.perf_counter()
    wanted = set(requests.keys)
    tables = [] if store is None else [_only(store.load(), wanted)]
    done = sum(t.num_rows for t in tables)
    with contextlib.closing(stream(requests, trial, pool, max_workers, skip=_keys_of(tables),
                                           block_timeout_s=block_timeout_s)) as blocks:
        for bid, table in blocks:  # (closed however this ends: a scheduler's stop raises out of `on_block`)
            if store is not None:
                store.save(bid, table)
            tables.append(table)
            done += table.num_rows
            if on_block is not None:
                on_block(done, tables)
    timeline.mark("last_answer", "trial", s=time.perf_counter() - started)
    return assemble_predictions(requests.keys, tables)


def _keys_of(tables: list[pa.Table]) -> set[str]:
    return {k for table in tables for k in table_keys(table)}


def _only(table: pa.Table, keys: set[str]) -> pa.Table:
    """The rows of ``table`` whose sample key is in ``keys`` (a store may hold a block of another task subset)."""
    return table.filter(pa.array([k in keys for k in table_keys(table)], pa.bool_()))
