"""A trial's answered blocks, saved as they come back, so that nothing finished is lost.

Every block of predictions an evaluation streams back is written at once to the sweep's storage (the Tune storage:
a local folder, NFS, s3://, gs://; the same `pyarrow.fs` paths the sweep state uses), one parquet file per block,
named by the block's id (a hash of its sample keys):

    <storage>/_promprune_blocks/<experiment>/<trial id>/<block id>.parquet

A trial that Tune retries, or that `--resume` restarts after the driver died, reads them back and generates only the
blocks that have no file. Files are written under a temporary name and moved into place, so a file that exists is
whole; writing the same block twice writes the same name (a block is never counted twice).
"""
from __future__ import annotations

import re
import uuid

import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq

from pipelines.run.result import PREDICTION_SCHEMA

BLOCKS_DIR = "_promprune_blocks"


def sweep_dir(storage: str, experiment: str) -> str:
    """Where the blocks of a sweep's trials live (``storage``: the Tune storage, a path or URI)."""
    return f"{storage.rstrip('/')}/{BLOCKS_DIR}/{experiment}"


def trial_dir(sweep: str, trial_id: str) -> str:
    """Where one trial's blocks live (``sweep``: `sweep_dir`)."""
    return f"{sweep}/{re.sub(r'[^A-Za-z0-9_.=+-]', '_', trial_id)}"


def saved_samples(sweep: str, trial_id: str) -> int:
    """How many samples of a trial are saved (answered before a retry, a resume, or a scheduler's stop)."""
    return BlockStore(trial_dir(sweep, trial_id)).load().num_rows


def remove(uri: str) -> None:
    """Delete a folder of blocks (a trial's, or a whole sweep's), if it exists."""
    fs, root = pyarrow.fs.FileSystem.from_uri(uri)
    if fs.get_file_info(root).type == pyarrow.fs.FileType.Directory:
        fs.delete_dir(root)


class BlockStore:
    """The answered blocks of one trial (``uri``: `trial_dir`)."""

    def __init__(self, uri: str):
        self.fs, self.root = pyarrow.fs.FileSystem.from_uri(uri)
        self.uri = uri

    def _files(self) -> list[str]:
        selector = pyarrow.fs.FileSelector(self.root, allow_not_found=True)
        return sorted(info.path for info in self.fs.get_file_info(selector)
                      if info.type == pyarrow.fs.FileType.File and info.path.endswith(".parquet"))

    def load(self) -> pa.Table:
        """Every saved prediction (`arrow_schema(Prediction)`); an empty table when nothing is saved."""
        tables = [pq.read_table(path, filesystem=self.fs, schema=PREDICTION_SCHEMA) for path in self._files()]
        return pa.concat_tables(tables) if tables else PREDICTION_SCHEMA.empty_table()

    def save(self, block_id: str, predictions: pa.Table) -> None:
        """Write one block's predictions (atomically: a temporary file moved into place)."""
        self.fs.create_dir(self.root, recursive=True)
        final = f"{self.root}/{block_id}.parquet"
        partial = f"{self.root}/.{block_id}.{uuid.uuid4().hex[:8]}.tmp"
        pq.write_table(predictions.cast(PREDICTION_SCHEMA), partial, filesystem=self.fs)
        self.fs.move(partial, final)
