"""`tune.max_concurrent_trials: auto` is what sweeps/README.md says it is (issue 49: the README said 1 on a CPU
machine while the plan ran one trial per core): the documented CPU rule and its example, held against `plan()`."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelines.config import Resources
from pipelines.run import resources as planning

README = Path(__file__).resolve().parents[2] / "sweeps" / "README.md"


def documented() -> tuple[int, int, int]:
    """(trials at once, cores) of the README's CPU example, and its cap, from the spec reference's comment."""
    text = README.read_text()
    found = re.search(r"max_concurrent_trials: auto\s+# GPUs: .*?; CPUs: one per core \((\d+) on a (\d+)-core\s+"
                      r"#?\s*machine\); at most (\d+) either way", text, re.DOTALL)
    assert found, "sweeps/README.md no longer states the CPU rule of max_concurrent_trials: auto"
    assert "one trial per core (per `resources.cpus_per_worker` cores)" in text  # the rule's own paragraph
    return tuple(int(g) for g in found.groups())


def test_the_documented_cpu_example_is_the_plan():
    at_once, cores, cap = documented()
    plan = planning.plan(Resources(), 9, 100, cluster={"CPU": cores}, can_add_gpus=False)
    assert (plan.device, plan.trials_at_once, plan.pool_size) == ("cpu", at_once, cores)  # one worker per core
    assert cap == planning.MAX_AUTO_TRIALS


@pytest.mark.parametrize("cores, cpus_per_worker", [(1, 1), (2, 1), (4, 1), (4, 2), (16, 1), (32, 2), (64, 1)])
def test_one_trial_per_core_at_most_the_cap(cores, cpus_per_worker):
    _, _, cap = documented()
    plan = planning.plan(Resources(cpus_per_worker=cpus_per_worker), 200, 1000, cluster={"CPU": cores},
                         can_add_gpus=False)
    per_core = cores // cpus_per_worker
    assert plan.trials_at_once == min(per_core, cap)
    assert plan.pool_size == plan.max_actors == per_core  # one worker per core, each trial free to use them all
    alone = planning.plan(Resources(cpus_per_worker=cpus_per_worker), 1, 1000, cluster={"CPU": cores},
                          can_add_gpus=False)
    assert alone.max_actors == per_core  # a trial alone: every core
