"""A trial's answered blocks, saved as they come back, so that nothing finished is lost.

Every block of predictions an evaluation streams back is written at once to the sweep's storage (the Tune storage:
a local folder, NFS, s3://, gs://; the same `pyarrow.fs` paths the sweep state uses), one parquet file per block,
named by the block's id (a hash of its sample keys):

    <storage>/_promprune_blocks/<experiment>/<trial id>/<block id>.parquet

A trial that Tune retries, or that `--resume` restarts after the driver died, reads them back and generates only the
blocks that have no file. Files are written under a temporary name and moved into place, so a file that exists is
whole; writing the same block twice writes the same name (a block is never counted twice).

A block file that cannot be read back (damaged on disk, cut short by hand) is set aside, renamed
``<block id>.parquet.unreadable`` (never deleted: kept for a look, also when the sweep removes its blocks), with one
line naming it; its samples count as not answered, so the trial answers them again.

A trial whose scoring failed the way that fails on every try (`promprune.eval.scoring.ScoringError`) leaves a note
beside its blocks (`FAILED`: the driver's session and the error); a retry of it by Tune in the same session raises the
noted error at once instead of scoring again (an LLM judge's requests sent again, for the same error). A `--resume`
is another session: it scores the trial again.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Callable

import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq

from pipelines.run.result import PREDICTION_SCHEMA

BLOCKS_DIR = "_promprune_blocks"
UNREADABLE = ".unreadable"  # the suffix of a block file set aside because it could not be read
FAILED = "scoring_failed.json"  # a trial's note of its deterministic scoring error (`BlockStore.note_failure`)


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
    """Delete a folder of blocks (a trial's, or a whole sweep's), if it exists; block files set aside as unreadable
    (and the folders that hold them) are kept."""
    fs, root = pyarrow.fs.FileSystem.from_uri(uri)
    if fs.get_file_info(root).type != pyarrow.fs.FileType.Directory:
        return
    found = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    if not any(info.path.endswith(UNREADABLE) for info in found):
        fs.delete_dir(root)
        return
    for info in found:
        if info.type == pyarrow.fs.FileType.File and not info.path.endswith(UNREADABLE):
            fs.delete_file(info.path)


class BlockStore:
    """The answered blocks of one trial (``uri``: `trial_dir`)."""

    def __init__(self, uri: str, say: Callable[[str], None] | None = None):
        self.fs, self.root = pyarrow.fs.FileSystem.from_uri(uri)
        self.uri = uri
        self.say = say  # where the line about a block set aside goes (None: `pipelines.console.say`)

    def _files(self) -> list[str]:
        selector = pyarrow.fs.FileSelector(self.root, allow_not_found=True)
        return sorted(info.path for info in self.fs.get_file_info(selector)
                      if info.type == pyarrow.fs.FileType.File and info.path.endswith(".parquet"))

    def load(self) -> pa.Table:
        """Every saved prediction (`arrow_schema(Prediction)`); an empty table when nothing is saved."""
        tables = [table for table in map(self._read, self._files()) if table is not None]
        return pa.concat_tables(tables) if tables else PREDICTION_SCHEMA.empty_table()

    def _read(self, path: str) -> pa.Table | None:
        """One block file; None when it cannot be read (it is then set aside: `_set_aside`)."""
        try:
            return pq.read_table(path, filesystem=self.fs, schema=PREDICTION_SCHEMA)
        except FileNotFoundError:  # set aside meanwhile by another reader (the driver's console, the trial)
            return None
        except (pa.ArrowException, OSError) as exc:  # not parquet, cut short, damaged, another schema
            if isinstance(exc, OSError) and exc.errno is not None:  # the file system's error, not the file's content
                raise
            self._set_aside(path, exc)
            return None

    def _set_aside(self, path: str, exc: Exception) -> None:
        """Rename an unreadable block file ``<name>.unreadable`` (``<name>.<n>.unreadable`` if taken) and say so."""
        aside = f"{path}{UNREADABLE}"
        n = 1
        while self.fs.get_file_info(aside).type != pyarrow.fs.FileType.NotFound:
            aside, n = f"{path}.{n}{UNREADABLE}", n + 1
        try:
            self.fs.move(path, aside)
        except FileNotFoundError:  # another reader set it aside first, and said so
            return
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = reason.split(f"{path}': ", 1)[-1][:200]  # (pyarrow's "Could not open ... '<path>': " said once)
        say = self.say
        if say is None:
            from pipelines.console import say
        say(f"note: the saved block {path} could not be read ({type(exc).__name__}: {reason}); it is set aside as "
            f"{aside} and its samples are answered again")

    def save(self, block_id: str, predictions: pa.Table) -> None:
        """Write one block's predictions (atomically: a temporary file moved into place)."""
        self.fs.create_dir(self.root, recursive=True)
        final = f"{self.root}/{block_id}.parquet"
        partial = f"{self.root}/.{block_id}.{uuid.uuid4().hex[:8]}.tmp"
        pq.write_table(predictions.cast(PREDICTION_SCHEMA), partial, filesystem=self.fs)
        self.fs.move(partial, final)

    def note_failure(self, session: str, error: str) -> None:
        """Note that the trial's scoring failed with ``error`` in the driver's ``session`` (`Shared.session`)."""
        self.fs.create_dir(self.root, recursive=True)
        with self.fs.open_output_stream(f"{self.root}/{FAILED}") as out:
            out.write(json.dumps({"session": session, "error": error}).encode())

    def failure(self, session: str) -> str | None:
        """The error `note_failure` noted in ``session``; None when none was (or in another session: a `--resume`)."""
        try:
            with self.fs.open_input_stream(f"{self.root}/{FAILED}") as f:
                noted = json.loads(f.read())
        except (FileNotFoundError, ValueError):
            return None
        return noted.get("error") if noted.get("session") == session else None
