"""Running a benchmark script as RESULTS.md runs it: ``python benchmarks/<script> ...`` from the repository root, in a
fresh interpreter (the scripts set threads, patch modules and start Ray; none of it may leak into the suite)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout: float = 600) -> str:
    """stdout of ``python benchmarks/<script> <args>`` (this checkout first on the path, Ray's files in a temp dir of
    its own, short enough for Ray's socket paths); fails with the output's tail when it exits non-zero. The script runs
    in a process group of its own, ended afterwards (whatever it left behind, such as Ray's daemons)."""
    code, out, err = _run(script, args, timeout)
    assert code == 0, f"benchmarks/{script} {' '.join(args)} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def refused(script: str, *args: str, timeout: float = 600, unset: tuple[str, ...] = ()) -> str:
    """stderr of ``python benchmarks/<script> <args>``, run as `run_benchmark` runs it (without the environment
    variables ``unset``), which must refuse the command line as the entry points refuse a user's mistake: exit 2, no
    traceback, nothing on stdout (refused before the script's work); fails with the output's tail otherwise."""
    code, out, err = _run(script, args, timeout, unset)
    said = f"benchmarks/{script} {' '.join(args)} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    assert code == 2 and "Traceback" not in out + err and not out.strip(), said
    return err


def _run(script: str, args, timeout: float, unset: tuple[str, ...] = ()) -> tuple[int, str, str]:
    ray_tmp = tempfile.mkdtemp(prefix="pb-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    for name in unset:
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, str(Path("benchmarks", script)), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"benchmarks/{script} {' '.join(args)} ran past {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return proc.returncode, out, err


def figure(out: str, pattern: str) -> re.Match:
    """The line of ``out`` that matches ``pattern`` whole (the figure line RESULTS.md quotes); fails showing the
    output when there is none."""
    found = re.search(f"^{pattern}$", out, re.M)
    assert found, f"no line matching {pattern!r} in:\n{out[-3000:]}"
    return found


def table_rows(out: str, first_cell: str) -> list[list[str]]:
    """The cells of every markdown table row of ``out`` whose first cell matches ``first_cell``."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("|")]
    return [r for r in rows if re.fullmatch(first_cell, r[0])]
