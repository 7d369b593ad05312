"""An evaluation's requests in Ray's object store: built once (on the driver, or in parallel shards as Ray tasks for
large benchmarks) and stored as Arrow blocks (`arrow_schema(Request)`) in which the questions about one image sit
together and its PNG is stored once (`promprune.eval.requests.pack_requests`). A sweep builds them once for all its
trials."""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import ray

from promprune.records import Request, from_arrow, to_arrow

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
    """Requests -> Arrow blocks of about `batch_size` rows, each image stored once per block (`pack_requests`).
    (A (task, doc_id) built twice is caught once, where the predictions are assembled: `check_exactly_once`.)"""
    from promprune.eval.requests import pack_requests

    return [to_arrow(block, Request) for block in pack_requests(rows, batch_size)]


def requests_dataset(rows: list[Request], batch_size: int) -> Requests:
    """Requests -> blocks in the object store (idle actors take work block by block)."""
    return Requests([ray.put(b) for b in request_blocks(rows, batch_size)], [r.key for r in rows])


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
        small = limit is not None and limit * len(tasks) <= DRIVER_BUILD_MAX_ROWS
        shards = 1 if small else max(2, int(ray.cluster_resources().get("CPU", 2)))
    if shards == 1:
        return requests_dataset(build_rows(tasks, limit, generation, video_frames=video_frames), batch_size)
    calls = [_build_shard.remote(tasks, limit, generation, (i, shards), batch_size, video_frames)
             for i in range(shards)]
    streamed = [list(call) for call in calls]  # streamed blocks are owned here: they outlive their task
    blocks = [ref for refs in streamed for ref in refs[:-1]]
    keys = [k for ks in ray.get([refs[-1] for refs in streamed]) for k in ks]  # each shard's last item: its keys
    return Requests(blocks, keys)


@ray.remote(num_returns="streaming")
def _build_shard(tasks: list[str], limit: int | None, generation: dict, shard: tuple[int, int], batch_size: int,
                 video_frames: int | None):
    """One shard's requests, yielded block by block, then the list of their keys."""
    rows = build_rows(tasks, limit, generation, shard=shard, contiguous=True, video_frames=video_frames)
    for block in request_blocks(rows, batch_size):
        yield block  # (not `yield from`: Ray's streaming generator sends into it)
    yield [r.key for r in rows]

