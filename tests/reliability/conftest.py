"""Helpers for the reliability scenarios: run the sweep CLI as a user would, in a scratch directory."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SPEC = """
name: rel
version: 1
model: {pretrained: "tiny:llava"}
tasks: [easyvqa_yesno]
limit: 4
grid: {method: [promprune], budget: [8]}
"""


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory with its own MLflow store and Ray temp dir; returns a spec writer."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def write(text: str = SPEC, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


def run_cli(*args: str, env: dict | None = None, timeout: int = 180) -> tuple[subprocess.CompletedProcess, float]:
    """`python pipelines/sweep.py ARGS` in the current directory; returns the process and its wall time.

    A fresh interpreter per call costs ~10 s of imports: the scenarios call `main` in-process (`run_main`) and keep
    this for what only a real process shows."""
    full_env = {**os.environ, **(env or {})}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "sweep.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
    return proc, time.monotonic() - start


@pytest.fixture
def run_main(capsys, monkeypatch):
    """`pipelines.sweep.main(ARGS)` in this process, as the CLI would run it: returns (completed, seconds)."""
    from pipelines import sweep

    def run(*args: str, env: dict | None = None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        start = time.monotonic()
        try:
            code = sweep.main(list(args))
        except SystemExit as exit_:  # argparse
            code = exit_.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err), time.monotonic() - start

    return run


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, every needle in stderr, no traceback, and Ray never started."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert "Started a local Ray instance" not in out, out
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
