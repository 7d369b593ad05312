"""The local Ray a sweep starts: its workers see this checkout and the quiet logging through the environment they
inherit, so the job's runtime_env is empty and the workers Ray starts ahead of need serve the first actors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from pipelines.run.ray_connect import QUIET_ENV, REPO

PROBE = """
import json, os, sys, time
import psutil, ray
from pipelines.run.ray_connect import connect

connect(None, log_to_driver=False)
driver_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "LOGURU_LEVEL")}
deadline = time.monotonic() + 180
while time.monotonic() < deadline:  # the job's first workers, started ahead of need (one per CPU)
    idle = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "ray::IDLE"}
    if len(idle) >= 2:
        break
    time.sleep(0.2)

@ray.remote(num_cpus=1)
class Probe:
    def look(self):
        return os.getpid(), os.environ.get("PYTHONPATH", ""), os.environ.get("LOGURU_LEVEL"), sys.path

pid, pythonpath, loguru, path = ray.get(Probe.remote().look.remote())
print(json.dumps({"idle": sorted(idle), "pid": pid, "pythonpath": pythonpath, "loguru": loguru, "path": path,
                  "runtime_env": ray.get_runtime_context().runtime_env, "driver_env": driver_env}))
"""


def run_driver(script: str, address: str | None = None) -> tuple[dict, str]:
    """(the JSON ``script``'s last line prints, all it printed), run as a driver of its own: Ray's files in a short
    temp dir of their own (Ray's socket paths have a length limit), ``RAY_ADDRESS`` as given, no LOGURU_LEVEL."""
    ray_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_dir}
    for key in ("RAY_ADDRESS", "LOGURU_LEVEL"):
        env.pop(key, None)
    if address:
        env["RAY_ADDRESS"] = address
    try:
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr


@pytest.mark.parametrize("address", [None, "local"])  # no address (loopback only), RAY_ADDRESS=local
def test_a_local_rays_first_workers_serve_the_sweeps_actors_with_its_environment(address):
    got, _ = run_driver(PROBE, address)
    assert len(got["idle"]) >= 2, got
    assert got["pid"] in got["idle"], got  # the actor took a worker Ray had started ahead of need
    assert str(REPO) in got["pythonpath"].split(os.pathsep) and str(REPO) in got["path"]
    assert got["loguru"] == QUIET_ENV["LOGURU_LEVEL"]
    assert not got["runtime_env"].get("env_vars")  # the job's runtime_env carries no variables
    assert got["driver_env"]["LOGURU_LEVEL"] is None  # the driver's own environment is as it was


# Ray's own failure planted once: the first `ray.init` leaves what a node that did not register leaves (processes
# this driver started: a stand-in whose command line names Ray, and another thread's `sleep`), then raises Ray's
# error; the second is Ray's real start
TIMED_OUT = """
import json, subprocess, sys
import psutil, ray
from pipelines.run import ray_connect

real, left = ray.init, {}

def first_call_times_out(*args, **kwargs):
    ray.init = real
    left["ray"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "raylet-stand-in"])
    left["other"] = subprocess.Popen(["sleep", "300"])
    raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")

ray.init = first_call_times_out
ray_connect.init_local(num_cpus=1, include_dashboard=False, log_to_driver=False)
alive = {name: proc.poll() is None for name, proc in left.items()}
print(json.dumps({"alive": alive, "cpus": ray.cluster_resources().get("CPU")}))
left["other"].kill()
ray.shutdown()
"""


def test_a_local_ray_that_timed_out_at_startup_is_ended_and_started_once_more():
    got, printed = run_driver(TIMED_OUT)
    assert got == {"alive": {"ray": False, "other": True}, "cpus": 1.0}, got  # Ray's left ended, not the other
    assert "did not start in time" in printed and "ended what it had started (1 process(es))" in printed


def test_another_error_at_startup_is_not_retried(monkeypatch):
    import ray

    from pipelines.run import ray_connect

    calls = []

    def refuses(*args, **kwargs):
        calls.append(1)
        raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")

    monkeypatch.setattr(ray, "init", refuses)
    with pytest.raises(ValueError, match="existing cluster"):
        ray_connect.init_local(num_cpus=1)
    assert calls == [1]


# Ray's GCS planted busy: its first three answers to the node's registration poll are the "Deadline Exceeded" a
# loaded machine gave (CI, 2026-11-28); Ray's own loop logs each failed poll it sees ("Failed to get node info")
BUSY_GCS = """
import json
import ray
from ray._private import services
from pipelines.run import ray_connect

real, failed = services.get_node, []

def busy(*args, **kwargs):
    if len(failed) < 3:
        failed.append(1)
        raise RuntimeError("b'RPC error: Deadline Exceeded'")
    return real(*args, **kwargs)

services.get_node = busy
ray_connect.init_local(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="INFO")
print(json.dumps({"failed": len(failed), "cpus": ray.cluster_resources().get("CPU"),
                  "restored": services.get_node is busy}))
ray.shutdown()
"""


def test_a_local_ray_whose_gcs_is_busy_is_waited_for_not_failed():
    got, printed = run_driver(BUSY_GCS)
    assert got == {"failed": 3, "cpus": 1.0, "restored": True}, got
    assert "Failed to get node info" not in printed  # Ray's loop never saw a failed poll: the wait took them
    assert "did not start in time" not in printed


def test_the_wait_for_a_busy_gcs_ends_at_its_deadline(monkeypatch, capsys):
    """Ray 2.60's node start polls `services.get_node` (the hook `patient_start` widens); a poll that keeps failing
    says once, when Ray's own wait would have ended, that it waits longer, and is Ray's error once the wait's time is
    up, not an endless wait."""
    import inspect
    import time

    import ray._private.node
    from ray._private import services

    from pipelines.run import ray_connect

    assert "services.get_node(" in inspect.getsource(ray._private.node.Node.__init__)
    assert ray_connect.GCS_PORT_WAIT_ENV in inspect.getsource(ray._private.node)  # the GCS port's wait, widened too
    calls = []

    def never(*args, **kwargs):
        calls.append(time.monotonic())
        raise RuntimeError("b'RPC error: Deadline Exceeded'")

    monkeypatch.setattr(services, "get_node", never)
    monkeypatch.setattr(ray_connect, "RAY_OWN_WAIT_S", 0.4)
    monkeypatch.delenv(ray_connect.GCS_PORT_WAIT_ENV, raising=False)
    start = time.monotonic()
    with ray_connect.patient_start(1.2):
        assert os.environ[ray_connect.GCS_PORT_WAIT_ENV] == "2"
        with pytest.raises(RuntimeError, match="Deadline Exceeded"):
            services.get_node("127.0.0.1:1", "n")
    assert 1.2 <= time.monotonic() - start < 10 and len(calls) >= 3
    assert services.get_node is never and ray_connect.GCS_PORT_WAIT_ENV not in os.environ
    said = capsys.readouterr()
    assert (said.out + said.err).count("has not registered after 0 s (a busy machine?); waiting up to 1 s") == 1
