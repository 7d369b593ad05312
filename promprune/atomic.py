"""Atomic writes: a reader (another process, a Ray actor) sees the old file or directory or the whole new one,
never half of one, and a writer killed midway leaves the target as it was.

    with atomic_path(path) as tmp:      # tmp: a fresh sibling name; nothing exists there yet
        tmp.write_text(text)            # or: model.save_pretrained(tmp), frame.to_parquet(tmp), ...

Used by the library (offline task data, trained-model caches) and the pipeline (the judge's rating cache).
:func:`locked` serializes writers that read what is there first (a read-merge-replace), across processes.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` (``.<name>.<pid>-<random>.tmp``: same directory, so the same file
    system, and unique per writer); write a file or a directory there. On a clean exit it takes ``target``'s
    place with one ``os.replace``; on an exception it is removed and ``target`` is untouched.

    A directory cannot be renamed over a non-empty one, so an existing ``target`` directory is removed just
    before the rename: for that instant a reader finds no directory (never a half-written one)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if tmp.is_dir() and target.is_dir():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def locked(path: str | Path) -> FileLock:
    """An exclusive lock on ``path`` across processes and threads (``filelock``: ``flock`` on POSIX, ``msvcrt`` on
    Windows); use as ``with locked(path):``. Waits as long as the holder needs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
