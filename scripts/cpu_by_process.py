"""Run a command and say where its CPU went, process by process (the command and everything it starts: Ray's
services and workers, servers, subprocesses), grouped by what each process was.

    python scripts/cpu_by_process.py -- python pipelines/sweep.py
    python scripts/cpu_by_process.py --top 40 -- python -m pytest -q -p no:cacheprovider -n 2

Every `--every` seconds (default 0.3) it reads the user+system CPU time of each live process in the command's tree
(psutil) and keeps the last reading per process: a process that lives shorter than one interval is missed, and the
CPU a process spent after the last reading is not counted, so the totals are a slight undercount. Processes that leave
the tree (daemonized) are not followed. The command's own output goes to its usual place; the table to stderr.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import time

import psutil


def kind(proc: psutil.Process, root: int) -> str:
    """What a process was: Ray's name for its workers (`ray::Worker`), else the script or module it ran."""
    if proc.pid == root:
        return "(the command)"
    name = proc.name()
    if name.startswith("ray::"):
        return name.split(".")[0]  # ray::Worker.answer -> ray::Worker
    try:
        args = proc.cmdline()
    except psutil.Error:
        return name
    joined = " ".join(args[1:4])
    found = re.search(r"-m (\S+)|(\S+\.py)\b", joined)
    if found:
        return f"{name} {found.group(1) or found.group(2).rsplit('/', 1)[-1]}"
    return name


def sample(command: list[str], every: float) -> tuple[float, dict[int, tuple[str, float]]]:
    """(wall seconds, {pid: (kind, CPU seconds)}) of ``command`` run to its end."""
    t0 = time.monotonic()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    seen: dict[int, tuple[str, float]] = {}
    while child.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for proc in tree:
            try:
                times = proc.cpu_times()
                label = seen[proc.pid][0] if proc.pid in seen else kind(proc, child.pid)
                seen[proc.pid] = (label, times.user + times.system)
            except psutil.Error:
                continue
        time.sleep(every)
    return time.monotonic() - t0, seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--every", type=float, default=0.3, help="seconds between readings")
    ap.add_argument("--top", type=int, default=25, help="rows of the table")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    wall, seen = sample(command, args.every)
    total, count = collections.Counter(), collections.Counter()
    for label, cpu in seen.values():
        total[label] += cpu
        count[label] += 1
    whole = sum(total.values())
    print(f"\n{whole:.1f} CPU-s in {wall:.1f} s wall, {len(seen)} processes\n", file=sys.stderr)
    print("| process | count | CPU s | share |\n|---|---:|---:|---:|", file=sys.stderr)
    for label, cpu in total.most_common(args.top):
        print(f"| {label} | {count[label]} | {cpu:.1f} | {100 * cpu / max(whole, 1e-9):.1f}% |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
