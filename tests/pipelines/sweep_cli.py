"""The sweep's command line as a user runs it, for the tests that interrupt and resume it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def spawn_sweep(spec_path: Path, cwd: Path, *extra: str, ray_address: str | None = None) -> subprocess.Popen:
    """``python pipelines/sweep.py --config spec_path *extra`` in ``cwd`` with its own MLflow store there;
    ``ray_address``: RAY_ADDRESS for it (None: unset, the sweep starts its own local Ray)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.Popen([sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", str(spec_path),
                             *extra], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, marker: str | re.Pattern, timeout: float) -> str:
    """The process's output up to the first line containing ``marker`` (a string, or a pattern searched in each
    line; killed, AssertionError if not seen)."""
    out, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        out.append(line)
        if (marker.search(line) if isinstance(marker, re.Pattern) else marker in line):
            return "".join(out)
    proc.kill()
    raise AssertionError(f"{marker!r} not seen:\n{''.join(out)[-3000:]}")


# a plugin method (a file the spec's `plugins` names) that keeps the first tokens once the test opens the gate: a
# trial held running for as long as a test needs
GATED = '''
import os, time
import torch
import promprune

@promprune.register_method("gated")
def gated(tokens, budget):
    """The first ``budget`` tokens, once the test opens the gate (the file {gate} exists)."""
    deadline = time.time() + 300
    while not os.path.exists({gate!r}) and time.time() < deadline:
        time.sleep(0.2)
    kept = torch.arange(budget, device=tokens.x.device).expand(tokens.batch, budget)  # [B, T]
    return promprune.Selection(kept, torch.zeros(tokens.batch, dtype=torch.long),
                               salient=torch.zeros_like(kept, dtype=torch.bool))
'''
