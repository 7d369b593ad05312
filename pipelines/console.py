"""What a sweep prints: its own lines and one progress bar on the terminal, everything else in a log file.

Ray, Tune, lmms-eval, datasets and MLflow write a great deal to stdout/stderr (C++ core-worker lines, Tune's
tables, per-task progress bars). `quiet(log_path)` points the process's file descriptors 1 and 2 at a log file for
the duration of the sweep, while `say` (and the progress bar) keep writing to the terminal. Ray workers' output is
not forwarded to the driver in quiet mode (`ray.init(log_to_driver=False)`): it stays in Ray's session logs.
`--verbose` keeps everything on the terminal.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

_terminal = None  # the real stdout while `quiet` is active
_bar = None  # the active progress bar, if any


def terminal():
    """The stream the user reads: the terminal (stdout outside `quiet`)."""
    return _terminal or sys.stdout


def say(message: str) -> None:
    """One line for the user, above the progress bar when there is one."""
    if _bar is not None:
        _bar.write(message, file=terminal())
    else:
        print(message, file=terminal(), flush=True)


@contextlib.contextmanager
def quiet(log_path: Path):
    """Send everything written to fds 1 and 2 (Python and C++ alike) to ``log_path``; `say` still reaches the
    terminal. Restores both on exit."""
    global _terminal
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    _terminal = os.fdopen(os.dup(saved_out), "w", buffering=1)
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield log_path
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            _terminal.close()
            _terminal = None


@contextlib.contextmanager
def progress(total: int, description: str):
    """The sweep's one progress bar (samples answered over all trials, trials done, ETA) on the terminal; a no-op
    when not a terminal."""
    global _bar
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=description, unit="sample", file=terminal(), dynamic_ncols=True,
               disable=not terminal().isatty())
    _bar = None if bar.disable else bar
    try:
        yield bar
    finally:
        _bar = None
        bar.close()
