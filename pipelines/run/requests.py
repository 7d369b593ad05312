"""An evaluation's requests in Ray's object store, one sealed block per object: built once (on the driver, or in
parallel shards as Ray tasks for large benchmarks) and shared by every trial of a sweep.

A *block* is a group of requests answered by one worker call: `promprune.eval.requests.pack_requests` puts the
questions about one image together and stores its PNG once, so a block must never be split (an image would be
separated from the questions that refer to it by key). Each block travels *sealed*: a one-row Arrow table, an
"envelope" holding the block's Arrow IPC bytes, its id and its size (`ENVELOPE`); a worker unseals it
(`pipelines/run/workers.py`). Envelopes are ordered round-robin over the tasks, so the first blocks a trial answers
cover every task (a running score over them means something).

A block's id is a hash of its sample keys: the same spec builds the same blocks, which is how a resumed or retried
trial finds the blocks it has already answered (`pipelines/run/checkpoints.py`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pyarrow as pa
import ray

from promprune.records import Request, from_arrow, key_task, table_keys, to_arrow

ENVELOPE = pa.schema([("block_id", pa.string()), ("n_rows", pa.int64()), ("requests", pa.binary())])


def block_id(keys: list[str]) -> str:
    """A block's id: 16 hex digits of the sha256 of its sample keys (order-independent)."""
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:16]


def seal(block: pa.Table) -> pa.Table:
    """A request block (`arrow_schema(Request)`) -> its one-row envelope (`ENVELOPE`)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, block.schema) as writer:
        writer.write_table(block)
    keys = table_keys(block)
    return pa.table({"block_id": [block_id(keys)], "n_rows": [block.num_rows],
                     "requests": [sink.getvalue().to_pybytes()]}, schema=ENVELOPE)


def unseal(envelope: pa.Table) -> list[tuple[str, pa.Table]]:
    """Envelope rows -> [(block id, request block)]."""
    out = []
    for bid, data in zip(envelope.column("block_id").to_pylist(), envelope.column("requests").to_pylist()):
        with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
            out.append((bid, reader.read_all()))
    return out


# ---------------------------------------------------------------------------------------------------------------
# rows


def build_rows(tasks: list[str], limit: int | None, generation: dict,
               shard: tuple[int, int] | None = None, contiguous: bool = False,
               video_frames: int | None = None) -> list[Request]:
    """Requests from the eval bridge, with the spec's generation kwargs laid over each task's own; a video task's
    clips sampled to `video_frames` frames (None: the bridge's default).

    shard=(i, k): every k-th document from the i-th, or with `contiguous` the i-th of k consecutive runs (the union
    of the k shards is the full set either way)."""
    from promprune.eval import build_requests

    frames = {} if video_frames is None else {"video_frames": video_frames}
    rows = build_requests(tasks, limit=limit, shard=shard, contiguous=contiguous, **frames)
    for row in rows:
        row.gen_kwargs = {**row.gen_kwargs, **generation}
    return rows


@dataclass
class Requests:
    """An evaluation's sealed blocks in the object store (ObjectRefs of one-row `ENVELOPE` tables), each block's
    sample keys, in the order the engine sends them (round-robin over tasks). Built once per sweep, shared by all its
    trials."""

    blocks: list = field(repr=False)
    block_keys: list[list[str]] = field(repr=False)

    def __post_init__(self):
        if len(self.blocks) != len(self.block_keys):
            raise ValueError(f"{len(self.blocks)} blocks but {len(self.block_keys)} key lists")

    def __repr__(self) -> str:
        return f"Requests({len(self.keys)} rows in {len(self.blocks)} blocks)"

    @property
    def keys(self) -> list[str]:
        """Every sample key, once, in block order."""
        return [k for keys in self.block_keys for k in keys]

    def requests_of(self, keys: set[str]) -> list[Request]:
        """The requests of ``keys`` (read back from their blocks; for samples that must be recorded as failed)."""
        wanted = [ref for ref, ks in zip(self.blocks, self.block_keys) if keys & set(ks)]
        rows = [r for env in ray.get(wanted) for _, block in unseal(env) for r in from_arrow(block, Request)]
        return [r for r in rows if r.key in keys]

    def only(self, tasks) -> "Requests":
        """The requests of ``tasks`` alone (an explicit trial that runs on a subset of the sweep's tasks)."""
        wanted = sorted(set(tasks))
        calls = [_only_tasks.remote(block, wanted) for block, keys in zip(self.blocks, self.block_keys)
                 if any(key_task(k) in wanted for k in keys)]
        found = ray.get([keys for keys, _ in calls])
        return Requests([ref for ks, (_, ref) in zip(found, calls) if ks], [ks for ks in found if ks])


@ray.remote(num_cpus=0, num_returns=2)
def _only_tasks(envelope: pa.Table, tasks: list[str]) -> tuple[list[str], pa.Table]:
    """(keys kept, the filtered envelope): the block's rows of ``tasks``, each image stored once again (the row that
    carried an image may belong to another task). Two returns, so the envelope is owned by the caller."""
    from promprune.eval.requests import pack_requests, share_images

    rows = [r for _, block in unseal(envelope) for r in share_images(from_arrow(block, Request)) if r.task in tasks]
    packed = to_arrow([r for b in pack_requests(rows, max(1, len(rows))) for r in b], Request)
    return [r.key for r in rows], seal(packed)


DRIVER_BUILD_MAX_ROWS = 2000  # up to this many rows the driver builds them itself (distinct images, PNG, in memory)


def request_blocks(rows: list[Request], batch_size: int) -> list[pa.Table]:
    """Requests -> Arrow blocks of about `batch_size` rows, each image stored once per block (`pack_requests`).
    (A (task, doc_id) built twice is caught once, where the predictions are assembled: `check_exactly_once`.)"""
    from promprune.eval.requests import pack_requests

    return [to_arrow(block, Request) for block in pack_requests(rows, batch_size)]


def interleaved(envelopes: list, block_keys: list[list[str]]) -> tuple[list, list[list[str]]]:
    """The blocks interleaved over their tasks (a block's task: its first sample's) in proportion to each task's
    blocks, each task's blocks in their own order: any prefix of the work covers every task in proportion."""
    by_task: dict[str, list[int]] = {}
    for i, keys in enumerate(block_keys):
        by_task.setdefault(key_task(keys[0]) if keys else "", []).append(i)
    # the j-th of a task's n blocks sits at (j + 0.5) / n of the way through the work
    placed = sorted(((j + 0.5) / len(q), t, i) for t, q in enumerate(by_task.values()) for j, i in enumerate(q))
    order = [i for _, _, i in placed]
    return [envelopes[i] for i in order], [block_keys[i] for i in order]


def requests_dataset(rows: list[Request], batch_size: int) -> Requests:
    """Requests -> sealed blocks in the object store, interleaved over tasks."""
    blocks = request_blocks(rows, batch_size)
    refs, keys = interleaved([ray.put(seal(b)) for b in blocks], [table_keys(b) for b in blocks])
    return Requests(refs, keys)


def built_on_driver(tasks: list[str], limit: int | None) -> bool:
    """Whether `build_requests_dataset` builds these rows on the driver (``limit`` caps them at
    DRIVER_BUILD_MAX_ROWS) rather than in Ray tasks, which need the cluster's CPUs."""
    return limit is not None and limit * len(tasks) <= DRIVER_BUILD_MAX_ROWS


def build_requests_dataset(tasks: list[str], limit: int | None, generation: dict, batch_size: int,
                           shards: int | None = None, video_frames: int | None = None) -> Requests:
    """Rows built on the driver (small evaluations) or in `shards` parallel Ray tasks (large benchmarks: VQAv2's
    214k questions never sit in driver memory); either way stored once in the object store, each distinct image
    once per block.

    shards None: the driver builds when `limit` caps the rows at DRIVER_BUILD_MAX_ROWS, else one shard per CPU.
    Shards take consecutive runs of documents, so the questions about one image (neighbours in the benchmarks'
    order) are built, and stored, together.
    """
    if shards is None:
        shards = 1 if built_on_driver(tasks, limit) else max(2, int(ray.cluster_resources().get("CPU", 2)))
    if shards == 1:
        return requests_dataset(build_rows(tasks, limit, generation, video_frames=video_frames), batch_size)
    calls = [_build_shard.remote(tasks, limit, generation, (i, shards), batch_size, video_frames)
             for i in range(shards)]
    streamed = [list(call) for call in calls]  # streamed blocks are owned here: they outlive their task
    blocks = [ref for refs in streamed for ref in refs[:-1]]
    keys = [ks for shard_keys in ray.get([refs[-1] for refs in streamed]) for ks in shard_keys]  # per block
    return Requests(*interleaved(blocks, keys))


@ray.remote(num_returns="streaming")
def _build_shard(tasks: list[str], limit: int | None, generation: dict, shard: tuple[int, int], batch_size: int,
                 video_frames: int | None):
    """One shard's sealed blocks, yielded one by one, then the list of each block's keys."""
    rows = build_rows(tasks, limit, generation, shard=shard, contiguous=True, video_frames=video_frames)
    keys = []
    for block in request_blocks(rows, batch_size):
        keys.append(table_keys(block))
        yield seal(block)  # (not `yield from`: Ray's streaming generator sends into it)
    yield keys
