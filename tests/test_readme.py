"""The README's quickstart block is what a fresh clone prints: `python pipelines/sweep.py` run here, its summary
table and its paired-difference lines, held against the README's byte for byte.

The quickstart runs the testbed in float64 end to end (sweeps/quickstart.yaml), so its answers do not depend on the
CPU's kernels (docs/testbed.md, "The same numbers on every CPU"): no allowance for a flipped answer."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_block() -> tuple[list[str], list[str]]:
    """The quickstart's table lines and its paired-difference lines (the ```text block), as the README shows them."""
    quick = (REPO / "README.md").read_text().split("## Quickstart", 1)[1]
    lines = quick.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| trial |"))
    table = [line for line in _run_of(lines[start:], lambda line: line.startswith("|"))]
    paired = quick.split("```text", 1)[1].split("```", 1)[0].strip("\n").splitlines()
    return table, paired


def console_block(out: str) -> tuple[list[str], list[str]]:
    """The sweep's summary table lines and its paired-difference lines (header and indented lines)."""
    lines = out.split("finished in", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| trial |"))
    table = _run_of(lines[start:], lambda line: line.startswith("|"))
    head = next(i for i, line in enumerate(lines) if line.startswith("Rel. differences"))
    paired = [lines[head]] + _run_of(lines[head + 1:], lambda line: re.match(r"\s+\d+ tokens: ", line) is not None)
    return table, paired


def _run_of(lines: list[str], keep) -> list[str]:
    """The leading lines for which ``keep`` holds."""
    out = []
    for line in lines:
        if not keep(line):
            break
        out.append(line)
    return out


def test_the_readme_block_parses():
    """The README holds a table with the four quickstart trials and three paired lines under their header."""
    table, paired = readme_block()
    assert [row.split("|")[1].strip() for row in table[2:]] == [
        "baseline", "divprune-b16", "vispruner-b16", "promprune-b16-mu=calibrate-tau=0.03"]
    assert paired[0].startswith("Rel. differences") and len(paired) == 4


@pytest.mark.slow
def test_the_readme_shows_what_the_quickstart_prints(tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "sweep.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = proc.stdout + proc.stderr
    table, paired = console_block(out)
    shown_table, shown_paired = readme_block()
    assert table == shown_table, "\n".join(table)
    assert paired == shown_paired, "\n".join(paired)
    mu = re.search(r"mu calibrated: ([0-9.]+)", "\n".join(table)).group(1)
    assert re.search(rf"spectral median {mu}\b", out), "the table's mu is the calibration's"
