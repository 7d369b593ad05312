"""Ray's command line (``ray start ...``) with `ray_connect.patient_start`'s wait for a new node's registration:
what the fake cluster's head and `scripts/job_submit_smoke.sh`'s head run, so that a busy machine's slow start is
waited for, not failed at Ray's 30 s.

    python -m pipelines.run.patient_ray start --head --block ...
"""
from __future__ import annotations

import sys

from pipelines.run.ray_connect import patient_start


def main() -> None:
    from ray.scripts.scripts import main as ray_main  # the `ray` console script's entry point

    sys.argv[0] = "ray"
    with patient_start():
        ray_main()


if __name__ == "__main__":
    main()
