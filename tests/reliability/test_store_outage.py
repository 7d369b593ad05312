"""MLflow as a researcher watches a sweep: a trial's run exists from its start, and a tracking store that goes down
mid-sweep loses nothing (a real `mlflow server`, stopped and started again, and the sweep's real command line)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time

import pytest
import ray
import yaml
from mlflow.tracking import MlflowClient

from pipelines import mlflow_layout, spec as specs, sweep
from pipelines.recording import tracking
from pipelines.run.ray_connect import init_local
from tests.pipelines.mlflow_server import MlflowServer
from tests.pipelines.sweep_cli import REPO, read_until

pytestmark = pytest.mark.slow

SPEC = {"name": "outage", "version": 1, "description": "a store outage, watched",
        "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 2, "baseline": True, "grid": {"method": ["promprune", "divprune"], "budget": [8]},
        "generation": {"max_new_tokens": 2}, "tune": {"max_concurrent_trials": 1, "max_failures": 0},
        # one worker on two cores: a second would load the model (seconds of CPU) for a few blocks of two samples
        "resources": {"batch_size": 1, "cpus_per_worker": 2}}


def slow_run(vlm, rows, batch_size, *, sleep_s: float):
    """The model's answers, each block `sleep_s` late (a trial long enough to be watched while it runs)."""
    from promprune.eval import run_requests

    time.sleep(sleep_s)
    return run_requests(vlm, rows, batch_size=batch_size)


def _trial_runs(c: MlflowClient) -> list:
    exp = c.get_experiment_by_name(mlflow_layout.experiment_name())
    if exp is None:
        return []
    return c.search_runs([exp.experiment_id], filter_string=mlflow_layout.tag_filter(mlflow_layout.ROLE, "trial"))


def test_a_running_trial_has_its_run_with_params_and_progress(tmp_path, monkeypatch, capsys):
    """While the second trial runs, MLflow holds its RUNNING run with its params and a running metric; at the end
    every trial has one FINISHED run whose start is the trial's start. The console, told that 1 s without a report is
    quiet, says what the pool's workers do (blocks take 1.5 s here)."""
    from pipelines.recording import console as sweep_console

    monkeypatch.setattr(sweep_console, "QUIET_S", 1.0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(mlflow_layout.TRACKING_URI_ENV, f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = specs.parse({**SPEC, "model": {"pretrained": "testbed:llava"}, "tasks": ["testbed_exist_concentrated"],
                        "limit": 8})  # 4 blocks (two questions per scene): progress before the end
    init_local(num_cpus=2, include_dashboard=False)
    try:
        outcome = {}
        driver = threading.Thread(target=lambda: outcome.setdefault("r", sweep.run_sweep(
            spec, run_fn=functools.partial(slow_run, sleep_s=1.5))))
        driver.start()
        c, seen, deadline = tracking.client(), None, time.monotonic() + 600
        while driver.is_alive() and time.monotonic() < deadline and seen is None:
            runs = {r.data.tags[mlflow_layout.TRIAL]: r for r in _trial_runs(c)}
            finished = [t for t, r in runs.items() if r.info.status == "FINISHED"]
            for tid, run in runs.items():
                if finished and run.info.status == "RUNNING" and "samples/done" in run.data.metrics:
                    seen = (tid, run)
            time.sleep(0.5)
        driver.join(timeout=600)
    finally:
        ray.shutdown()
    assert seen is not None, "no trial's RUNNING run with a running metric was seen after the first trial finished"
    tid, run = seen
    assert run.data.params["method"] == tid.split("-")[0] and run.data.params["budget"] == "8"
    assert run.data.tags[mlflow_layout.NOTE] == spec.description
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["testbed_exist_concentrated"]
    assert outcome["r"].failed == [] and outcome["r"].unlogged == []
    final = {r.data.tags[mlflow_layout.TRIAL]: r for r in _trial_runs(c)}
    assert sorted(final) == ["baseline", "divprune-b8", "promprune-b8"]
    assert all(r.info.status == "FINISHED" for r in final.values())
    later = final[tid]
    assert later.info.run_id == run.info.run_id and later.info.start_time == run.info.start_time  # the same run
    steps = [m.step for m in c.get_metric_history(run.info.run_id, "samples/done")]
    assert steps == sorted(steps) and steps[-1] == 8
    quiet = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no trial has reported for")]
    assert any("model worker(s)" in line for line in quiet), quiet  # the pool's state, read through Ray


def _cli(spec_path, cwd, uri: str, wait_s: str = "120") -> subprocess.Popen:
    env = {**os.environ, mlflow_layout.TRACKING_URI_ENV: uri, "PYTHONUNBUFFERED": "1",
           "PROMPRUNE_STORE_WAIT_S": wait_s}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", str(spec_path)],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.long  # the long tier (pyproject's markers): in CI a store that goes down and comes back runs under the
# outbox (tests/pipelines/test_outbox.py, a real server) and a sweep's outage end to end below
def test_a_store_down_mid_sweep_loses_nothing(tmp_path):
    """The store stops after the first trial and comes back: the console says so within seconds, the sweep goes on
    and exits 0, and every trial is in MLflow exactly once."""
    spec_path = tmp_path / "outage.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    with MlflowServer(tmp_path / "server") as server:
        proc = _cli(spec_path, tmp_path, server.uri)
        out = read_until(proc, "[1/3]", timeout=600)
        server.stop()
        stopped = time.monotonic()
        out += read_until(proc, "does not answer", timeout=300)
        assert time.monotonic() - stopped < 120
        server.start()
        rest, _ = proc.communicate(timeout=600)
        out += rest
        assert proc.returncode == 0, out[-4000:]
        assert "answers again" in out
        runs = _trial_runs(MlflowClient(server.uri))
    assert sorted(r.data.tags[mlflow_layout.TRIAL] for r in runs) == ["baseline", "divprune-b8", "promprune-b8"]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_a_store_that_never_comes_back_fails_the_sweep_naming_the_trials(tmp_path):
    """Exit 4 naming the trials not in MLflow and the command that sends them; that command, once the store is back,
    finishes the job: every trial once."""
    spec_path = tmp_path / "outage.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    server = MlflowServer(tmp_path / "server").start()
    try:
        proc = _cli(spec_path, tmp_path, server.uri, wait_s="5")
        out = read_until(proc, "[1/3]", timeout=600)
        server.stop()
        rest, _ = proc.communicate(timeout=600)
        out += rest
        assert proc.returncode == sweep.EXIT_UNLOGGED, out[-4000:]
        tail = out.split("NOT IN MLFLOW YET", 1)[1]
        assert "divprune-b8" in tail and "promprune-b8" in tail and "--resume" in tail
        assert "Traceback" not in out
        words = tail.split("send them with:\n", 1)[1].split("\n")[0].split()
        at = next(i for i, w in enumerate(words) if w == "python")  # after the variables the run depended on
        assert f"{mlflow_layout.TRACKING_URI_ENV}={server.uri}" in words[:at] and "PROMPRUNE_STORE_WAIT_S=5" in words
        command = words[at:]
        server.start()
        env = {**os.environ, mlflow_layout.TRACKING_URI_ENV: server.uri}
        assert command[1] == str(REPO / "pipelines" / "sweep.py")  # run in tmp_path: the script as reached from there
        again = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        runs = _trial_runs(MlflowClient(server.uri))
    finally:
        server.stop()
    assert sorted(r.data.tags[mlflow_layout.TRIAL] for r in runs) == ["baseline", "divprune-b8", "promprune-b8"]
    assert all(r.info.status == "FINISHED" for r in runs)
