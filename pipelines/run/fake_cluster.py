"""An autoscaling Ray cluster on one machine, for tests and `benchmarks/sweep_scaling.py --autoscale`: a CPU-only
head whose autoscaler launches worker nodes declaring fake resources (e.g. ``{"CPU": 1, "GPU": 1}``), up to
``max_workers``, when there is demand, and removes them when they idle (Ray's fake multi-node provider).

Ray's own `ray.cluster_utils.AutoscalingCluster` does the same but starts and stops with `ray stop --force`, which
ends every Ray process on the machine, and reads a config its wheel does not ship. Here the head runs as
`ray start --head --block` (through `pipelines.run.patient_ray`: a busy machine's slow start is waited for) in a
process group of its own under a private temp dir, and stopping kills that group (the worker nodes the autoscaler
started belong to it).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipelines.run.ray_connect import checkout_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeAutoscalingCluster:
    """``with FakeAutoscalingCluster(tmp, max_workers=3) as cluster: ray.init(address=cluster.address)``."""

    def __init__(self, tmp: str | Path, *, max_workers: int = 3, worker: dict | None = None, head_cpus: int = 2,
                 idle_timeout_s: float = 3.0, object_store_mb: int = 200):
        self.tmp = Path(tmp)
        self.max_workers = max_workers
        self.worker = dict(worker or {"CPU": 1, "GPU": 1})
        self.head_cpus, self.idle_timeout_s, self.object_store_mb = head_cpus, idle_timeout_s, object_store_mb
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.ray_tmp: str | None = None  # Ray's temp dir: short, AF_UNIX socket paths must stay under 108 bytes

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def config(self) -> dict:
        """The autoscaler's cluster config: the head node type and one worker node type."""
        return {
            "cluster_name": "fake", "max_workers": self.max_workers, "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_s / 60,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": self.address},
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": self.head_cpus}, "max_workers": 0, "node_config": {}},
                "worker": {"resources": self.worker, "min_workers": 0, "max_workers": self.max_workers,
                           "node_config": {}}},
            "head_node_type": "ray.head.default", "docker": {}, "auth": {"ssh_user": "ray"}, "file_mounts": {},
            "cluster_synced_files": [], "file_mounts_sync_continuously": False, "initialization_commands": [],
            "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
            "head_start_ray_commands": [], "worker_start_ray_commands": []}

    def env(self) -> dict:
        """The head's environment beyond this process's: Ray 2.60 turns token auth on for a head once
        ``~/.ray/auth_token`` exists (any local ``ray.init()`` writes one), and a process that imported Ray before
        could not join it; this loopback-only test cluster runs without, unless this process has token auth on
        already (a local ``ray.init()`` sets ``RAY_AUTH_MODE=token`` in its environment): then its own server
        rejects the head's unauthenticated calls, the head takes the driver for dead and destroys every actor it
        owns, so the head runs with the same token instead."""
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
            return {}
        return {"RAY_AUTH_MODE": "disabled"}

    def start(self, timeout_s: float = 240) -> "FakeAutoscalingCluster":
        self.tmp.mkdir(parents=True, exist_ok=True)
        path = self.tmp / "autoscaler.yaml"
        path.write_text(yaml.safe_dump(self.config()))
        env = {**os.environ, **self.env(), "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
               "PYTHONPATH": checkout_path()}
        self.ray_tmp = tempfile.mkdtemp(prefix="rfc-", dir="/tmp")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.run.patient_ray", "start", "--head", "--block", f"--port={self.port}",
             f"--autoscaling-config={path}",
             f"--num-cpus={self.head_cpus}", "--num-gpus=0", f"--temp-dir={self.ray_tmp}",
             "--include-dashboard=false", f"--object-store-memory={self.object_store_mb * 2 ** 20}"],
            env=env, start_new_session=True, stdout=open(self.tmp / "head.log", "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the fake cluster's head exited: {(self.tmp / 'head.log').read_text()[-2000:]}")
            if "Ray runtime started" in (self.tmp / "head.log").read_text():  # `ray start` says so when it is up
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the fake cluster's head did not listen on {self.address} within {timeout_s:g}s")

    def stop(self) -> None:
        """Kill the head's process group (the head, its autoscaler and the worker nodes it started)."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
        if self.ray_tmp is not None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
            self.ray_tmp = None

    def __enter__(self) -> "FakeAutoscalingCluster":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


def worker_nodes() -> list[str]:
    """Ids of the connected cluster's alive worker nodes (nodes declaring a GPU; the fake head declares none)."""
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
