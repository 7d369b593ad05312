"""The README's quickstart block is what a fresh clone prints: `python pipelines/sweep.py` run here, its summary
table's scores, Rel. and visual tokens, the calibrated mu and the paired-difference lines held against the README.

The answers are the shipped weights' greedy ones; a CPU unlike this project's may flip one at a near-tie (the last bits
of a logit), so a number may move by one answer's worth (`FLIP`), never more; rows and lines must come in the README's
order, with its labels."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the README's row labels -> trial ids (the spec's order: baseline, grid, explicit trials)
ROWS = {"unpruned": "baseline", "DivPrune, 16 tokens": "divprune-b16", "VisPruner, 16 tokens": "vispruner-b16",
        "PromPrune, 16 tokens": "promprune-b16-mu=calibrate-tau=0.03"}
COLUMNS = ("testbed_exist_concentrated", "testbed_exist_spread")
# one answer flipped on 100 questions: F1 moves by at most ~0.01, Rel. by ~0.005, a difference by ~0.5 points
FLIP = {"f1": 0.0151, "rel": 0.0061, "points": 0.61}


def readme_block() -> tuple[list[list[str]], list[str]]:
    """The quickstart's table rows (cells) and the paired-difference lines, as the README shows them."""
    text = (REPO / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in quick.splitlines()
            if line.startswith("| ") and not line.startswith("| trial")][:len(ROWS)]
    lines = quick.split("```text", 1)[1].split("```", 1)[0].strip("\n").splitlines()
    return rows, lines


def console_table(out: str) -> dict[str, dict[str, str]]:
    """The sweep's summary table (pandas' text) as {trial id: {column: cell}}."""
    lines = out.split("finished in", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["trial"])
    header = lines[start].replace("prefill ms", "prefill_ms").split()
    table = {}
    for line in lines[start + 1:]:
        cells = line.split()
        if len(cells) != len(header):
            break
        table[cells[0]] = dict(zip(header, cells))
    return table


@pytest.mark.slow
def test_the_readme_shows_what_the_quickstart_prints(tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "sweep.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = proc.stdout + proc.stderr
    rows, lines = readme_block()
    table = console_table(out)
    assert [ROWS[re.sub(r"\s*\(mu calibrated: [0-9.]+\)", "", r[0])] for r in rows] == list(table)  # same order
    for cells in rows:
        tid = ROWS[re.sub(r"\s*\(mu calibrated: [0-9.]+\)", "", cells[0])]
        got = table[tid]
        f1 = [float(got[k]) for c in COLUMNS for k in got if k.startswith(c + "/")]
        assert [float(c) for c in cells[1:3]] == pytest.approx(f1, abs=FLIP["f1"]), (tid, got)
        assert float(cells[3]) == pytest.approx(float(got["rel"]), abs=FLIP["rel"]), (tid, got)
        assert cells[4] == f"{float(got['vis.tok']):.0f}", (tid, got)
        mu = re.search(r"mu calibrated: ([0-9.]+)", cells[0])
        if mu:
            assert re.search(rf"spectral median {mu.group(1)}\b", out), "the README's calibrated mu"
    printed = [line for line in out.splitlines() if re.match(r"\s+\d+ tokens: ", line)]
    assert [_pair(line)[0] for line in printed] == [_pair(line)[0] for line in lines]  # the same pairs, in order
    for got, shown in zip(printed, lines):
        assert _pair(got)[1] == pytest.approx(_pair(shown)[1], abs=FLIP["points"]), (got, shown)


def _pair(line: str) -> tuple[str, list[float]]:
    """``16 tokens: A - B: +0.4 [-1.7, +2.5] points`` -> ("16 tokens: A - B", [0.4, -1.7, 2.5])."""
    head, _, numbers = line.strip().rpartition(": ")
    return head, [float(x) for x in re.findall(r"[-+]?\d+\.\d+", numbers)]
