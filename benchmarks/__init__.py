"""Benchmarks: each script prints its table; benchmarks/RESULTS.md records them with their commands."""
from __future__ import annotations

import os


def pythonpath(first) -> str:
    """PYTHONPATH for a child process: ``first`` (a checkout) ahead of what this process was given, which keeps
    packages installed beside the environment reachable (the GPU machine's wheel batches, `pip --target` folders)."""
    return os.pathsep.join(dict.fromkeys(p for p in (str(first), *os.environ.get("PYTHONPATH", "").split(os.pathsep))
                                         if p))
