"""The GPU plan passes the benchmarks' flag checks (`benchmarks.Flags`) on a machine that has a CUDA GPU: a command
line the plan sends to a lent machine (scripts/gpu_checklist.sh's stages) must not be refused there, where a refusal
costs a device call out of a 15-minute budget. This machine has no GPU, so each command runs with CUDA faked for the
checks (``torch.cuda.is_available() -> True``, one device) and stops where `Flags.refuse` finds nothing to refuse,
before any work: a ``sitecustomize`` put first on the child's path does both.

The command lines are the checklist's own: each stage runs as ``bash scripts/gpu_checklist.sh --stage-only STAGE``
with a stand-in ``python3`` on PATH that records its arguments and runs nothing, so the stage's variables, loops and
defaults expand as on the machine. The stage-name check the script makes before installing anything is run on the
invocations its plan and the rehearsal give."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.helpers import REPO

CHECKLIST = REPO / "scripts" / "gpu_checklist.sh"

SITECUSTOMIZE = '''
import os

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3 (faked for the flag checks)"
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.is_bf16_supported = lambda *a, **k: True

import benchmarks

_refuse = benchmarks.Flags.refuse


def refuse(self):
    _refuse(self)  # exit 2 with the problems, as on the machine
    print("FLAGS OK", flush=True)
    os._exit(0)


benchmarks.Flags.refuse = refuse
'''

# a stand-in python3: records each call's arguments (unit- and record-separated), runs nothing
STUB = """#!/usr/bin/env bash
{ printf '%s\\x1f' "$@"; printf '\\x1e'; } >> "$PYTHON3_CALLS"
[ "${1:-}" = - ] && cat > /dev/null
exit 0
"""


def _stages() -> dict[str, str]:
    """Each stage of the checklist's ``stage()`` function and the text of its case arm."""
    text = CHECKLIST.read_text()
    body = text[text.index("\nstage() {"):]
    body = body[:body.index("\n  esac")]
    arms = list(re.finditer(r"^    ([a-z0-9|-]+)\)", body, re.M))
    return {m[1]: body[m.end():(arms[i + 1].start() if i + 1 < len(arms) else len(body))]
            for i, m in enumerate(arms) if m[1] != "*"}


def _known_stages() -> set[str]:
    text = CHECKLIST.read_text()
    return set("|".join(re.findall(r'^KNOWN_STAGES\+?="([^"]*)"', text, re.M)).split("|")) - {""}


BENCHMARK_STAGES = sorted(name for name, arm in _stages().items() if re.search(r"benchmarks[/.]", arm))

# the environments the plan and the rehearsal run a stage in (scripts/gpu_checklist.sh's PLAN, device_rehearsal.sh)
STAGE_ENVS = {name: [{}] for name in BENCHMARK_STAGES}
STAGE_ENVS.get("scaling", []).extend([
    {"SCALING_GPUS": "1", "SCALING_SHELL": "arithmetic"},
    {"SCALING_GPUS": "2", "SCALING_ARGS": "--samples-per-task 4 --sample-s 0.02 --load-s 0.1"},
])


def test_the_stages_are_found():
    """The parse above sees every stage the script knows, and the benchmark stages among them."""
    assert set(_stages()) == _known_stages()
    assert {"selection", "lanczos", "vispruner-tiles", "speed", "table6", "shapes", "gemma4", "scaling"} \
        <= set(BENCHMARK_STAGES)


def _benchmark_calls(stage: str, env: dict, tmp_path: Path) -> list[list[str]]:
    """The ``python3`` calls of ``stage`` that run a benchmark script, as the checklist makes them."""
    stub = tmp_path / "stub"
    stub.mkdir(exist_ok=True)
    (stub / "python3").write_text(STUB)
    (stub / "python3").chmod(0o755)
    calls = tmp_path / f"calls-{stage}"
    calls.write_text("")
    out = tmp_path / "out"
    run_env = {**os.environ, **env, "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}", "PYTHON3_CALLS": str(calls),
               "OUT": str(out)}
    proc = subprocess.run(["bash", str(CHECKLIST), "--stage-only", stage], cwd=REPO, env=run_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stage {stage} with the stand-in python3 exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    argvs = [record.split("\x1f")[:-1] for record in calls.read_text().split("\x1e")[:-1]]
    return [a for a in argvs if a and (a[0].startswith("benchmarks/")
                                       or (a[0] == "-m" and len(a) > 1 and a[1].startswith("benchmarks.")))]


@pytest.mark.slow  # a fresh interpreter per command; the shapes build their configs (~1 min in all on 2 cores)
@pytest.mark.parametrize("stage", BENCHMARK_STAGES)
def test_a_gpu_stage_passes_the_flag_checks_where_cuda_is(stage, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    refused = []
    checked = 0
    for env in STAGE_ENVS[stage]:
        argvs = _benchmark_calls(stage, env, tmp_path)
        assert argvs, f"stage {stage} ran no benchmark (its arm names one)"
        for argv in argvs:
            child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
            proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=child_env, capture_output=True, text=True,
                                  timeout=300)
            checked += 1
            if proc.returncode != 0 or "FLAGS OK" not in proc.stdout:
                prefix = "".join(f"{k}={v!r} " for k, v in env.items())
                refused.append(f"{prefix}python3 {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-1500:]}")
    assert not refused, f"{len(refused)} of {checked} command(s) of stage {stage} refused with a GPU:\n" + \
        "\n".join(refused)


def _planned_invocations() -> list[str]:
    """The arguments of every ``bash scripts/gpu_checklist.sh ...`` the checklist's plan writes out, and the
    rehearsal's (every batch, its default stages)."""
    text = CHECKLIST.read_text()
    plan = text[:text.index("\nset -uo pipefail")]
    found = {" ".join(m[1].split()) for m in re.finditer(r"bash scripts/gpu_checklist\.sh ((?:--install-batch \d+ |"
                                                         r"[a-z0-9-]+ ?)+)", plan)}
    rehearsal = (REPO / "scripts" / "device_rehearsal.sh").read_text()
    default = re.search(r"STAGES=\(([a-z0-9 -]+)\)", rehearsal)[1]
    found.add("--install-batch 1 --install-batch 2 --install-batch 3 " + default)
    return sorted(found)


@pytest.mark.parametrize("args", _planned_invocations())
def test_the_checklist_accepts_its_planned_stage_names(args, tmp_path):
    """Past the stage-name check, which runs before any install: with no time left in the call every stage is then
    skipped with a note, exit 0. A copy of the script runs, so that no batch of this checkout installs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(CHECKLIST, tmp_path / "scripts" / "gpu_checklist.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "CALL_BUDGET_S": "0"}
    proc = subprocess.run(["bash", "scripts/gpu_checklist.sh", *args.split()], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    stages = [a for a in args.split() if not a.isdigit() and a != "--install-batch" and a != "install"]
    assert proc.returncode == 0 and "unknown stage" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("SKIPPED ") == len(stages), proc.stdout


def test_the_checklist_refuses_an_unknown_stage_first(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(CHECKLIST, tmp_path / "scripts" / "gpu_checklist.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", "scripts/gpu_checklist.sh", "--install-batch", "1", "selection", "selectoin"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout.startswith("unknown stage selectoin"), proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "install.log").exists()
