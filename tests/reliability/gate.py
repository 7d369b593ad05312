"""A driver for the killed-driver scenario: the sweep of `pipelines.sweep.run_sweep` with the unpruned model held
at a gate, so that a pruned trial finishes (and is in MLflow) while the baseline is still running.

    python -m tests.reliability.gate SPEC GATE     # run from the repository root's checkout, in the sweep's cwd
"""
from __future__ import annotations

import functools
import os
import sys
import time


def gated_run(vlm, rows, batch_size, *, gate: str):
    """The model's answers (`promprune.eval.run_requests`); the unpruned model's wait for the file ``gate``."""
    from promprune.eval import run_requests

    deadline = time.monotonic() + 600
    while vlm.method is None and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.2)
    return run_requests(vlm, rows, batch_size=batch_size)


def main(spec_path: str, gate: str) -> None:
    from pipelines import spec as specs, sweep
    from pipelines.run.ray_connect import init_local

    spec = specs.load(spec_path)
    init_local(num_cpus=2, include_dashboard=False)
    sweep.run_sweep(spec, run_fn=functools.partial(gated_run, gate=gate),
                    command={"config": spec_path, "overrides": []})


if __name__ == "__main__":
    main(*sys.argv[1:3])
