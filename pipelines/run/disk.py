"""A sweep and a full disk: enough free space checked before it starts, a watch that stops it while a reserve is
left (or at the first "No space left on device"), and Tune's files written whole or not at all.

What fills up: Tune's storage (each trial's saved blocks and its result, Tune's experiment state), the MLflow store
(a SQLite file and its artifacts: each trial's predictions once more) and the sweep's log. Before this, a sweep on a
nearly full disk retried every trial on ENOSPC for minutes, then died on a truncated Tune error file, and its
truncated experiment state made `--resume` fail even after space was freed.

- `check_free`: before Ray starts (`RESERVE_BYTES` plus what the known samples will take) and again once the
  requests are built (their number known): refused with the bytes needed, where, and how much is free.
- `DiskWatch`: a Tune callback in the driver. It stops the sweep (as Ctrl-C does: its unfinished trials stay
  unfinished) when a watched file system has less than `RESERVE_BYTES` free, or when a trial fails on ENOSPC (the
  first time, not after its retries); the sweep then ends with one paragraph (`DiskFull`) and the command that
  resumes it once space is freed. A place that became unwritable (EPERM, EACCES, EROFS: its permissions changed, an
  immutable flag, a file system remounted read-only) is a full disk's twin: every trial failed on it after its
  retries. A trial that fails on such an error stops the sweep the same way when one of the watched places (or the
  path its error names) refuses a test write, and the paragraph names that path and says to make it writable.
- `tune_storage`: Tune's storage through `AtomicLocalFiles`, a local file system whose files are written under a
  temporary name and moved into place when complete, so a write cut short by a full disk leaves the previous file
  (Tune's experiment state, its searcher's, a trial's result or error) whole. Remote storage (s3://, gs://) writes
  an object only when its upload completes.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path

import pyarrow
import pyarrow.fs
from ray import tune

from pipelines import mlflow_layout, paths
from pipelines.paths import existing_parent, refuses_writes  # noqa: F401 - re-exported

RESERVE_BYTES = 64 << 20  # the watch stops a sweep below this: room for Tune's last state, the log and MLflow's writes
BYTES_PER_SAMPLE = 1024  # one trial's prediction of one sample, kept three times (saved block, Tune's result, MLflow
# artifact); the quickstart's take ~75 bytes a copy (16 kept token ids, short answers): room for 576-token ids and
# long answers
CHECK_EVERY_S = 1.0


class DiskFull(RuntimeError):
    """The sweep stopped (or could not start) for want of disk space: the message says where, how much, and how to
    go on."""


FULL_TEXTS = ("No space left on device", "Disk quota exceeded")  # ENOSPC's and EDQUOT's text, as errors carry it
# EPERM's, EACCES's and EROFS's text (pyarrow's errors carry it lower-case after "[errno N]")
UNWRITABLE_TEXTS = ("operation not permitted", "permission denied", "read-only file system")
FULL, UNWRITABLE = "full", "unwritable"  # why the watch stopped a sweep (`full_message`)


def _says_full(text: str) -> bool:
    return any(full in text for full in FULL_TEXTS)


def _says_unwritable(text: str) -> bool:
    return any(refusal in text.lower() for refusal in UNWRITABLE_TEXTS)


def _errors(error: BaseException | None):
    """``error`` and what caused it."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it, or the text of a Ray-wrapped one) is "No space left on device"."""
    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or _says_full(str(e))
               for e in _errors(error))


def is_unwritable(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it, or the text of a Ray-wrapped one) is a write refused for want of
    permission: EPERM, EACCES or EROFS (an error that says so; where the refusal was is `unwritable_place`'s
    question)."""
    return any((isinstance(e, OSError) and e.errno in paths.REFUSED_ERRNOS)
               or _says_unwritable(str(e)) for e in _errors(error))


def unwritable_place(places: list[str], text: str = "") -> tuple[str, str] | None:
    """(path, why) of the first place a write is refused for want of permission: the paths named in ``text`` (an
    error's, quoted) under one of the local ``places`` (paths or URIs, as `local_dir` reads them), then the places
    themselves; None when each takes a test
    write (the error was about something else, e.g. a file the trial reads)."""
    roots = [p.absolute() for p in map(local_dir, places) if p is not None]
    named = [Path(m) for m in re.findall(r"'(/[^']+)'", text)]
    candidates = [p for p in named if any(p == r or r in p.parents for r in roots)] + roots
    for place in dict.fromkeys(candidates):
        why = refuses_writes(place)
        if why:
            return str(place), why
    return None


def local_dir(place: str | None) -> Path | None:
    """The local directory behind ``place`` (a path, a file:// or sqlite:/// URI, a file in it), None when it is
    remote (s3://, http://) or None."""
    if not place:
        return None
    database = mlflow_layout.sqlite_path(place)
    return database.parent if database is not None else paths.local_storage(place)


def free_bytes(path: Path) -> int:
    """Free bytes for this user on the file system that holds ``path`` (or, before it exists, its nearest existing
    parent)."""
    return shutil.disk_usage(existing_parent(Path(path).absolute())).free


def _by_device(places: list[Path]) -> list[Path]:
    """One place per file system (the first named), so that one shortage is said once."""
    seen, out = set(), []
    for place in places:
        device = existing_parent(place).stat().st_dev
        if device not in seen:
            seen.add(device)
            out.append(place)
    return out


def needed_bytes(samples: int | None, trials: int) -> int:
    """What a sweep of ``trials`` trials over ``samples`` samples (None: not known yet) needs free to start."""
    return RESERVE_BYTES + (samples or 0) * trials * BYTES_PER_SAMPLE


def check_free(places: list[str | None], samples: int | None, trials: int) -> str | None:
    """Why the sweep cannot start for want of space (None: it can). ``places``: where it writes (Tune's storage, the
    MLflow store, the log's folder); all needs are counted against each file system, as they may be one."""
    need = needed_bytes(samples, trials)
    for place in _by_device([p for p in map(local_dir, places) if p is not None]):
        free = free_bytes(place)
        if free < need:
            size = f" ({trials} trial(s) x {samples} samples x {BYTES_PER_SAMPLE} B, plus" if samples else " (the"
            return (f"not enough disk space: the sweep needs about {need / 1e6:,.0f} MB free at {place}{size} "
                    f"{RESERVE_BYTES >> 20} MiB kept for Tune's state, MLflow and the log), and it has "
                    f"{free / 1e6:,.0f} MB. Free space there, or put Tune's storage (tune.storage_path, "
                    "$PROMPRUNE_STORAGE) and the MLflow store (MLFLOW_TRACKING_URI) on a file system that has it")
    return None


# ----------------------------------------------------------------------------------------------------------------
# the watch

_TRIPPED: dict[str, tuple[str, str]] = {}  # the watch's key -> (FULL or UNWRITABLE, why it stopped the sweep) (this
# driver process only)


class DiskWatch(tune.Callback, tune.Stopper):
    """Stops the Tune experiment when a watched file system runs low or a trial fails for want of space.

    It stops Tune as Ctrl-C does (Tune's own SIGUSR1 handler, installed while `Tuner.fit` runs in the main thread):
    Tune saves its state one last time with the unfinished trials still unfinished, so `--resume` runs them. (A
    stopper's `stop_all` would end them as TERMINATED, which a resume takes for done; it is the fallback where Tune
    could not install its handler.) Tune pickles its callbacks and stopper with the experiment and restores them on
    `--resume`: what the watch found lives in this process (`tripped`, by ``key``), never in the pickle, so a resumed
    sweep starts unstopped."""

    def __init__(self, key: str, places: list[str | None]):
        self.key = key
        # one place per file system: places on one disk have the same free space
        self.places = [str(p) for p in _by_device([p for p in map(local_dir, places) if p is not None])]
        self._last = 0.0
        self._stop = False

    def __getstate__(self):
        return {"key": self.key, "places": self.places, "_last": 0.0, "_stop": False}

    def _trip(self, why: str, cause: str = FULL) -> None:
        if self.key in _TRIPPED:
            return
        _TRIPPED[self.key] = (cause, why)
        if not interrupt_tune():
            self._stop = True

    def _look(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < CHECK_EVERY_S:
            return
        self._last = now
        for place in self.places:
            free = free_bytes(Path(place))
            if free < RESERVE_BYTES:
                self._trip(f"{place} has {free / 1e6:,.1f} MB free, below the {RESERVE_BYTES >> 20} MiB the sweep "
                           "keeps so that Tune's state, MLflow and the log are written whole")
                return

    # tune.Callback
    def on_step_begin(self, iteration, trials, **info):
        self._look()

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._failed(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._failed(trial)

    def _failed(self, trial) -> None:
        text = ""
        try:
            if trial.error_file:
                text = Path(trial.error_file).read_text(errors="replace")[-20000:]
        except OSError:
            pass
        if _says_full(text):
            self._trip(f"a trial ({trial}) failed writing its results: No space left on device")
            return
        if _says_unwritable(text):
            refused = unwritable_place(self.places, text)
            if refused:
                self._trip(f"a trial ({trial}) failed writing to {refused[0]}: {refused[1]}", UNWRITABLE)
                return
        self._look(force=True)

    # tune.Stopper
    def __call__(self, trial_id, result) -> bool:
        return self._stop

    def stop_all(self) -> bool:
        return self._stop


def interrupt_tune() -> bool:
    """Stop the Tune experiment running in this process as Ctrl-C does (Tune's own SIGUSR1 handler, installed while
    `Tuner.fit` runs in the main thread: its state saved with the unfinished trials unfinished, so `--resume` runs
    them); False where that handler is not installed (the caller's stopper is the fallback)."""
    handler = signal.getsignal(signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else None
    if getattr(handler, "__qualname__", "").endswith("signal_interrupt_tune_run"):
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's "stop signal received": state saved, trials unfinished
        return True
    return False


def tripped(key: str) -> str | None:
    """Why the watch of ``key`` stopped the sweep in this process (None: it did not)."""
    found = _TRIPPED.get(key)
    return None if found is None else found[1]


def tripped_cause(key: str) -> str | None:
    """`FULL` or `UNWRITABLE`: what the watch of ``key`` found (None: it did not stop the sweep)."""
    found = _TRIPPED.get(key)
    return None if found is None else found[0]


def full_message(why: str, resume: str, cause: str = FULL) -> str:
    """The one paragraph a sweep stopped by a full disk (``cause`` `FULL`) or by a place that refuses writes
    (`UNWRITABLE`) ends with."""
    if cause == UNWRITABLE:
        return (f"storage not writable: {why}. The sweep stopped there: its finished trials are in MLflow, its state "
                "is the last one written whole (a write that failed leaves the previous file), and no trial was "
                "retried into the path that refuses writes. Make that path writable again (its owner and "
                "permissions, an immutable flag: chattr -i, a file system remounted read-only), then finish it "
                f"with:\n  {resume}")
    return (f"disk full: {why}. The sweep stopped there: its finished trials are in MLflow and its state is saved "
            "(written whole: a temporary file moved into place), and no trial was retried into the full disk. Free "
            f"space there, then finish it with:\n  {resume}")


# ----------------------------------------------------------------------------------------------------------------
# Tune's files, whole or not at all


class _WholeFile:
    """A file written under a temporary name beside its place and moved there by `close` once every write went
    through. A failed write (a full disk) removes the temporary file at once (the caller may never close it) and
    leaves the old file in place."""

    def __init__(self, path: str):
        self.path = path
        self.tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.part")
        self._f = open(self.tmp, "wb")
        self.closed = False

    def _abandon(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(OSError):
            os.remove(self.tmp)

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except BaseException:
            self._abandon()
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except BaseException:
            self._abandon()
            raise

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._f.close()  # flushes: a full disk may say so only here
        except BaseException:
            self._abandon()
            raise
        self.closed = True
        os.replace(self.tmp, self.path)


class AtomicLocalFiles(pyarrow.fs.FileSystemHandler):
    """pyarrow's local file system, every output stream a `_WholeFile` (Tune writes its files through it)."""

    def __init__(self):
        self.local = pyarrow.fs.LocalFileSystem()

    def __reduce__(self):  # Tune ships its storage to the trials' actors
        return AtomicLocalFiles, ()

    def get_type_name(self):
        return "local-atomic"

    def equals(self, other):
        return isinstance(other, AtomicLocalFiles)

    def normalize_path(self, path):
        return self.local.normalize_path(path)

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("refusing to delete the root directory's contents")

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        with self.local.open_input_stream(src) as source:
            stream = self.open_output_stream(dest, None)
            try:
                while chunk := source.read(1 << 24):
                    stream.write(chunk)
            finally:
                stream.close()

    def open_input_stream(self, path):
        return self.local.open_input_stream(path)

    def open_input_file(self, path):
        return self.local.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return pyarrow.PythonFile(_WholeFile(path), mode="w")

    def open_append_stream(self, path, metadata):
        return self.local.open_append_stream(path)


def tune_storage(storage: str) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """(path, file system) for Tune's ``storage_path`` / ``storage_filesystem``: a local storage through
    `AtomicLocalFiles`; a remote one as it is (None: Tune resolves it)."""
    where = local_dir(storage)
    if where is None:
        return storage, None
    return str(where.absolute()), pyarrow.fs.PyFileSystem(AtomicLocalFiles())
