"""The evaluation engine, a trial's side: its blocks sent to the sweep's model workers (`pipelines/run/workers.py`),
their predictions streamed back block by block.

    requests (sealed blocks in the object store, `requests.py`) -> a lease on the sweep's `Pool` (as many workers as
    the trial has blocks, at most `Plan.max_actors`) -> one block in flight per worker that is up
    (`Worker.answer(trial, block)`) -> (block id, predictions) as each comes back -> `run`: every sample exactly once

A trial is a light coordinator: the workers hold the model and outlive it; it only dispatches, and takes workers as
they come up (a GPU node the autoscaler adds mid-trial). What happens when a worker dies or hangs is the workers'
(`workers.py`: Ray restarts it and resends the call, the pool counts a block's attempts, the last one returns failed
samples); what is left here is a worker that is gone for good (retired by the pool, its pool ended), whose block goes
to another worker, uncharged. When the trial ends, however it ends (a scheduler stopping it raises out of its next
progress report), the blocks it queued and no worker started are cancelled and its lease released: a stopped trial
sends no more work.
"""
from __future__ import annotations

import collections
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

ROSTER_EVERY_S = 1.0  # how often a trial with blocks left asks the pool which workers are up


class WorkersFailed(RuntimeError):
    """The sweep's workers could not start (their model did not load): no trial can run."""


def stream(requests: Requests, trial: Trial, pool, max_workers: int,
           skip: set[str] | frozenset = frozenset()) -> Iterator[tuple[str, pa.Table]]:
    """Answer every block of ``requests`` with a sample not in ``skip`` on the workers of ``pool`` (a `Pool` actor),
    at most ``max_workers`` at once; yields ``(block id, predictions)`` as blocks come back, in no particular order."""
    todo = collections.deque((ref, keys) for ref, keys in zip(requests.blocks, requests.block_keys)
                             if not set(keys) <= skip)
    evaluation = uuid.uuid4().hex  # this run's attempts in the pool (a retried trial starts afresh)
    holder, leased = f"{trial.trial_id}/{evaluation}", min(len(todo), max_workers)
    pool.lease.remote(holder, leased)
    inflight: dict = {}  # call -> (block ref, keys, worker id)
    members, version, polled = {}, -1, 0.0
    try:
        while todo or inflight:
            if todo and time.monotonic() - polled >= ROSTER_EVERY_S:
                version, members, polled = *_roster(pool, version, members), time.monotonic()
            busy = {wid for _, _, wid in inflight.values()}
            for wid in [w for w in members if w not in busy][:max(0, max_workers - len(inflight))]:
                if todo:
                    ref, keys = todo.popleft()
                    inflight[members[wid].answer.remote(trial, ref, evaluation)] = (ref, keys, wid)
            if not inflight:  # no worker up yet: wait for the roster
                time.sleep(ROSTER_EVERY_S / 4)
                continue
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=ROSTER_EVERY_S)
            for call in ready:
                ref, keys, wid = inflight.pop(call)
                try:
                    table = ray.get(call)
                except ray.exceptions.RayActorError:  # the worker is gone for good: another one takes the block
                    members.pop(wid, None)
                    todo.appendleft((ref, keys))
                    continue
                yield block_id(keys), table
            left = min(len(todo) + len(inflight), max_workers)
            if left < leased:  # fewer blocks left than workers leased: the others may go to other trials
                leased = left
                pool.lease.remote(holder, leased)
    finally:
        for call in inflight:
            ray.cancel(call)  # queued at a worker: dropped; already running: finishes, unread
        pool.release.remote(holder)


def _roster(pool, version: int, members: dict) -> tuple[int, dict]:
    """The pool's workers that are up, as {worker id: handle} (``members`` when unchanged since ``version``)."""
    version, listed, error = ray.get(pool.roster.remote(version))
    if error:
        raise WorkersFailed(f"the sweep's model workers could not start, so no trial can run: {error}")
    return version, members if listed is None else dict(listed)


def run(requests: Requests, trial: Trial, pool, max_workers: int, store: BlockStore | None = None,
        on_block: Callable[[int, list[pa.Table]], None] | None = None) -> pa.Table:
    """One trial's evaluation: every block answered, as one predictions table (sorted, each sample exactly once).

    ``store``: the trial's saved blocks; blocks already there are not generated again, and each new block is saved
    as it comes back. ``on_block(samples done, all predictions so far)`` runs after each block (progress reports).
    """
    from pipelines.run.result import assemble_predictions

    started = time.perf_counter()
    wanted = set(requests.keys)
    tables = [] if store is None else [_only(store.load(), wanted)]
    done = sum(t.num_rows for t in tables)
    for bid, table in stream(requests, trial, pool, max_workers, skip=_keys_of(tables)):
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
