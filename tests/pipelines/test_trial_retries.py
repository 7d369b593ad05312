"""Tune's retries of a failed trial (`tune.max_failures`) on a local Ray: a scoring error that is the same on every
try (`ScoringError`: a task's process_results raising, as an LLM-judged task's does when its judge cannot grade) is
not retried within the sweep (Tune starts the trial once), so the judge's requests are not sent again; a trial whose
process died is retried; a `--resume` scores the failed trial again."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import ray

from pipelines import mlflow_layout, sweep
from pipelines import spec as specs
from pipelines.recording import tracking
from pipelines.run import checkpoints
from pipelines.run.state import storage_root
from pipelines.run.ray_connect import init_local
from promprune.eval.tasks import INCLUDE_PATH_ENV
from tests.own_task import write_task

pytestmark = pytest.mark.slow

# process_results of a judged task whose judge cannot grade: one "request" counted per call, then the same error
JUDGED = """    with open({calls!r}, "a") as calls:
        calls.write("x")
    raise ValueError("the judge gave no grade")
"""
# process_results that kills its process (the trial's) the first time: a lost process, which a retry fixes
CRASH_ONCE = """    import os
    if not os.path.exists({crashed!r}):
        open({crashed!r}, "w").close()
        os._exit(1)
    return {{'accuracy': 1.0}}
"""


def tries(experiment_path: str, text: str) -> int:
    """How many times Tune ran the trial whose error file (Tune's, one "Failure # n" entry per failed try, kept
    across a --resume) holds ``text``."""
    [found] = [f for f in Path(experiment_path).rglob("error.txt") if text in f.read_text()]
    return found.read_text().count("Failure # ")


def counted_run(vlm, rows, batch_size, *, log: str):
    """The real model, writing one line per sample it generates (its task): what each session generated."""
    from promprune.eval import run_requests

    with open(log, "a") as f:
        f.writelines(f"{r.task}\n" for r in rows)
    return run_requests(vlm, rows, batch_size=batch_size)


@pytest.fixture(scope="module")
def tasks_ray(tmp_path_factory):
    """A local Ray whose workers find the two tasks (as a sweep's local Ray: its workers inherit the environment)."""
    root = tmp_path_factory.mktemp("retry_tasks")
    write_task(root / "judged", "own_judged", questions=["q0", "q1"],
               process_results=JUDGED.format(calls=str(root / "judge_calls")))
    write_task(root / "crash", "own_crash", questions=["q0", "q1"],
               process_results=CRASH_ONCE.format(crashed=str(root / "crashed")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(INCLUDE_PATH_ENV, f"{root / 'judged'}:{root / 'crash'}")
        init_local(num_cpus=2, include_dashboard=False)
        try:
            yield root
        finally:
            ray.shutdown()


def test_a_deterministic_scoring_error_is_not_retried_but_a_lost_process_is_and_resume_scores_again(
        tasks_ray, tmp_path, monkeypatch, mlflow_db):
    monkeypatch.chdir(tmp_path)
    calls = tasks_ray / "judge_calls"
    spec = specs.parse({
        "name": "retries", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["own_judged", "own_crash"],
        "limit": 2, "baseline": False, "grid": {},
        "trials": [{"method": "divprune", "budget": 4, "tasks": ["own_judged"]},
                   {"method": "divprune", "budget": 4, "tasks": ["own_crash"]}],
        "generation": {"max_new_tokens": 2}, "resources": {"batch_size": 2},
        "tune": {"max_failures": 2, "max_concurrent_trials": 1}})
    judged, crash = "divprune-b4-on=own_judged", "divprune-b4-on=own_crash"
    generated = tmp_path / "generated"
    run_fn = functools.partial(counted_run, log=str(generated))
    outcome = sweep.run_sweep(spec, run_fn=run_fn)
    assert sorted(generated.read_text().split()) == ["own_crash"] * 2 + ["own_judged"] * 2
    assert (tasks_ray / "crashed").exists() and crash not in outcome.failed  # the lost process: retried, finished
    assert outcome.failed == [judged]
    assert calls.read_text() == "x"  # scored once
    assert tries(outcome.experiment_path, "the judge gave no grade") == 1  # not retried (was 3: 2 retries, each
    # raising the noted error at once in a freshly started trial)
    error = outcome.records[judged]["error"]
    assert "ScoringError: task 'own_judged': its process_results raised ValueError: the judge gave no grade" in error
    run = tracking.latest_trial_runs(tracking.client(), outcome.parent_run_id)[judged]
    assert run.info.status == "FAILED" and "the judge gave no grade" in run.data.tags[mlflow_layout.ERROR]

    # the failed trial's saved blocks are kept (the sweep exits 1): its resume generates only blocks with no file
    blocks = checkpoints.sweep_dir(storage_root(spec), Path(outcome.experiment_path).name)
    assert checkpoints.saved_samples(blocks, judged) == 2

    generated.unlink()
    resumed = sweep.run_sweep(spec, resume="latest", run_fn=run_fn)  # another session: the failed trial scored again
    assert not generated.exists()  # nothing generated again: its blocks were read back
    assert checkpoints.saved_samples(blocks, judged) == 2  # still failed: still kept
    assert resumed.failed == [judged] and resumed.parent_run_id == outcome.parent_run_id
    assert calls.read_text() == "xx"  # once more, and again not retried within the resumed session
    assert tries(outcome.experiment_path, "the judge gave no grade") == 2
    assert "the judge gave no grade" in resumed.records[judged]["error"]
