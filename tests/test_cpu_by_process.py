"""scripts/cpu_by_process.py counts the CPU of the processes a command starts, not only its own."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5:\n    pass\n"


def test_a_childs_cpu_is_counted_under_its_own_row():
    command = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BUSY!r}])"]
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "cpu_by_process.py"), "--every", "0.1", "--",
                          *command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m.group(1): (int(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^\| (.+?) \| (\d+) \| ([\d.]+) \|", out.stderr, re.M)}
    assert rows["(the command)"][0] == 1 and rows["(the command)"][1] < 1.0, out.stderr
    child = [cpu for label, (count, cpu) in rows.items() if label != "(the command)"]
    assert len(child) == 1 and 1.2 <= child[0] <= 2.5, out.stderr  # the child's 1.5 s busy loop, by its own clock
