"""scripts/under_load.sh: a test rerun beside busy loops, and a run past --dump-after leaves the processes' state."""
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_slow_run_is_reported_and_its_processes_dumped(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("import time\n\ndef test_sleeps():\n    time.sleep(3)\n\ndef test_other():\n    assert False\n")
    out = tmp_path / "logs"
    done = subprocess.run(["bash", str(REPO / "scripts/under_load.sh"), str(probe), "-k", "sleeps", "--runs", "2",
                           "--loops", "1", "--dump-after", "1", "--timeout", "60"],
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = (out / "summary.log").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["run 1", "run 2"]
    assert all("exit 0 after" in line and "stalled: dump_" in line for line in lines), lines  # only test_sleeps ran
    dump = (out / "dump_1.log").read_text()
    assert dump.startswith("# run 1 at 1s")
    if shutil.which("ps"):  # procps: every process with its niceness
        assert "python -m pytest" in dump and " NI " in dump.splitlines()[1]  # ps's header: the niceness column
    assert "1 passed, 1 deselected" in (out / "run_2.log").read_text()
