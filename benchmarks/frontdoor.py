"""How long the command line takes to refuse what it must refuse: each case run as a user runs it, a fresh process,
its whole wall time from start to exit.

    python benchmarks/frontdoor.py [--runs 5]

Cases (issue 57 item 4, with the bound each must stay under on a 2-core machine):

- ``sweep.py --resume`` of a run whose driver is alive (another process holds its lock): refused before Ray and
  torch load (`pipelines/frontdoor.py`), under 3 s;
- ``sweep.py --config`` a 50 MB file: refused by its size, unread, under 3 s;
- ``report.py`` against a tracking server that refuses the connection (none listening), and against one that accepts
  it and never answers (a socket that listens and never replies): said within 10 s.

Each case must exit 2 with its one-paragraph message (checked); the table gives min / median / max wall seconds of
``--runs`` runs. The last line: ``refusals (median s): busy resume A, 50 MB spec B, report refused C, report silent
D``.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPEC = "name: frontdoor\nversion: 1\nmodel: {pretrained: 'tiny:llava'}\ntasks: [easyvqa_yesno]\nlimit: 4\n" \
       "grid: {method: [promprune], budget: [8]}\n"
HOLD = """
import sys, time
from pipelines.run.state import DriverLock
lock = DriverLock.resume(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(3600)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases(work: Path) -> tuple[list[tuple[str, list[str], str, float]], list]:
    """(name, command, what its stderr must say, bound in s) of each case, and what to end afterwards."""
    from pipelines import spec as specs
    from pipelines.run import state

    (work / "spec.yaml").write_text(SPEC)
    storage, spec = work / "outputs" / "tune", specs.load(work / "spec.yaml")
    state.save_state(str(storage), {"experiment": "frontdoor-20261126-120000", "parent_run_id": "r0",
                                    "storage_path": str(storage), "fingerprint": state.fingerprint(spec),
                                    "spec_yaml": specs.dump_resolved(spec), "command": {"config": "spec.yaml"}})
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(storage), "frontdoor-20261126-120000"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    huge = work / "huge.yaml"
    with open(huge, "w") as f:
        f.write("name: huge\nversion: 1\ndescription: |\n")
        f.writelines("  " + "x" * 1022 + "\n" for _ in range(50_000))
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers one
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    sweep, report = str(REPO / "pipelines" / "sweep.py"), str(REPO / "pipelines" / "report.py")
    return [
        ("sweep.py --resume, its driver alive", [sweep, "--config", str(work / "spec.yaml"), "--resume"],
         "is being run by a live driver", 3.0),
        ("sweep.py --config a 50 MB file", [sweep, "--config", str(huge)], "a sweep spec is a few KB of YAML", 3.0),
        ("report.py, server refuses the connection", [report, "--tracking-uri", f"http://127.0.0.1:{_free_port()}"],
         "does not answer", 10.0),
        ("report.py, server never answers", [report, "--tracking-uri", f"http://127.0.0.1:{silent.getsockname()[1]}"],
         "does not answer", 10.0),
    ], [holder, silent]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    from benchmarks import Flags

    flags = Flags(__file__)
    flags.at_least("--runs", args.runs, 1, "runs of each case", 5)
    flags.refuse()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)}
    with tempfile.TemporaryDirectory(prefix="frontdoor-") as tmp:
        work = Path(tmp)
        todo, ends = cases(work)
        medians = []
        try:
            print("| case | exit | min s | median s | max s | bound s |\n|---|---:|---:|---:|---:|---:|")
            for name, command, says, bound in todo:
                walls = []
                for _ in range(args.runs):
                    t0 = time.monotonic()
                    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=work,
                                          env=env, timeout=600)
                    walls.append(time.monotonic() - t0)
                    if proc.returncode != 2 or says not in proc.stderr or "Traceback" in proc.stderr:
                        raise SystemExit(f"{name}: exit {proc.returncode}, expected 2 saying {says!r}:\n"
                                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                medians.append(statistics.median(walls))
                print(f"| {name} | 2 | {min(walls):.2f} | {medians[-1]:.2f} | {max(walls):.2f} | {bound:g} |",
                      flush=True)
        finally:
            for thing in ends:
                if isinstance(thing, subprocess.Popen):
                    thing.kill()
                    thing.communicate()
                else:
                    thing.close()
    print(f"\nrefusals (median s): busy resume {medians[0]:.2f}, 50 MB spec {medians[1]:.2f}, report refused "
          f"{medians[2]:.2f}, report silent {medians[3]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
