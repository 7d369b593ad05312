"""One sweep over the paper's nine hub benchmarks (their local stand-ins), with bootstrap intervals: every task
builds, is answered by the sweep's actors, scored by lmms-eval's own code in the trial, and logged (issue 21)."""
from __future__ import annotations

import pytest
import ray

from pipelines import spec as specs
from pipelines import sweep
from pipelines.recording import tracking
from pipelines.run.ray_connect import init_local
from promprune.eval.standins import STANDIN_TASKS, serving, standin_env
from tests.conftest import STANDIN_DOCS
from tests.eval.test_hub_standins import LoopbackJudge

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judge():
    with LoopbackJudge() as server:
        yield server


@pytest.fixture(scope="module")
def hub_ray(hub_standins, judge):
    """A local Ray whose workers see the stand-ins and MM-Vet's loopback judge, as a cluster's would see the hub."""
    env = {**standin_env(hub_standins), "API_TYPE": "openai", "OPENAI_API_KEY": "sk-test",
           "OPENAI_BASE_URL": judge.url, "OPENAI_API_URL": judge.url}
    with serving(hub_standins), pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        init_local(num_cpus=2, include_dashboard=False)  # as a sweep's local Ray: its workers inherit `env` too
        try:
            yield
        finally:
            ray.shutdown()


@pytest.mark.long  # the long tier (pyproject's markers): each benchmark's build, generation and
# scoring run in CI (tests/eval/test_hub_standins.py)
def test_one_sweep_over_the_nine_benchmarks_with_bootstrap(hub_ray, judge, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = specs.parse({"name": "hub9", "version": 1, "model": {"pretrained": "tiny:llava"},
                        "tasks": list(STANDIN_TASKS), "baseline": True, "bootstrap": 100,
                        "grid": {"method": ["promprune"], "budget": [8]},
                        "generation": {"max_new_tokens": 3}, "resources": {"batch_size": 4}})
    outcome = sweep.run_sweep(spec)
    assert outcome.failed == []
    runs = tracking.trial_runs(tracking.client(), outcome.parent_run_id)
    assert sorted(runs) == ["baseline", "promprune-b8"]
    for run in runs.values():
        metrics = run.data.metrics
        assert metrics["samples/total"] == len(STANDIN_TASKS) * STANDIN_DOCS and metrics["samples/failed"] == 0
        for task in STANDIN_TASKS:
            assert metrics[f"{task}/n_samples"] == STANDIN_DOCS and metrics[f"{task}/n_failed"] == 0, task
            primary = {"mme": "mme_perception_score", "pope": "pope_f1_score", "mmvet": "gpt_eval_score",
                       "mmbench_en_dev_static": "gpt_eval_score"}.get(task, "exact_match")
            low, high = metrics[f"{task}/{primary}_ci_low"], metrics[f"{task}/{primary}_ci_high"]
            assert low <= metrics[f"{task}/{primary}"] <= high, task
    assert judge.requests >= 2 * STANDIN_DOCS  # MM-Vet graded every answer of both trials
