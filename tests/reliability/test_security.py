"""The cluster is closed and no input writes or runs where it should not (reliability scenario 8)."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import yaml

from pipelines import report
from pipelines.run import state
from pipelines import spec as specs

REPO = Path(__file__).resolve().parents[2]


def _cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def _commands(config: dict) -> list[str]:
    return [c for key in ("head_start_ray_commands", "worker_start_ray_commands", "setup_commands")
            for c in config[key]]


def test_nothing_listens_on_every_interface():
    for command in _commands(_cluster()):
        assert "0.0.0.0" not in command, command
    head = " ".join(_cluster()["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head  # the Jobs API runs arbitrary code: loopback + SSH tunnel only
    assert "mlflow server --host 127.0.0.1" in " ".join(head.split())


def test_every_ray_node_requires_the_token():
    config = _cluster()
    starts = [c for c in _commands(config) if "ray start" in c]
    assert len(starts) == 2 and all(shlex.split(c)[0] == "RAY_AUTH_MODE=token" for c in starts)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_a_security_group_admits_ssh_from_one_range_only():
    group = _cluster()["provider"]["security_group"]
    rules = group["IpPermissions"]
    assert [(r["FromPort"], r["ToPort"]) for r in rules] == [(22, 22)]
    assert all(ip["CidrIp"] != "0.0.0.0/0" for r in rules for ip in r["IpRanges"])


@pytest.mark.parametrize("name, expected", [
    ("../../x", "_.._x"), ("/etc/passwd", "_etc_passwd"), ("..", "sweep"), ("table1_llava15", "table1_llava15"),
    ("a b/c", "a_b_c"),
])
def test_report_folder_stays_inside_reports(name, expected, tmp_path):
    cleaned = report.safe_dir_name(name)
    assert cleaned == expected
    target = (tmp_path / "reports" / cleaned).resolve()
    assert target.parent == (tmp_path / "reports").resolve()


def test_resume_refuses_state_others_can_write(tmp_path):
    storage = tmp_path / "tune"
    (storage / state.STATE_DIR).mkdir(parents=True)
    state.check_trusted_storage(str(storage), "rel-1")  # private: fine
    os.chmod(storage, 0o777)
    with pytest.raises(specs.SpecError, match="writable by others.*unpickles"):
        state.check_trusted_storage(str(storage), "rel-1")
    state.check_trusted_storage("s3://bucket/tune", "rel-1")  # remote: the bucket policy's job (README)


LISTENERS = """
import psutil, ray
from pipelines.run.ray_connect import connect

connect(None, log_to_driver=False)
ray.get(ray.remote(lambda: 1).remote())  # a worker is up too
tree = {p.pid for p in psutil.Process().children(recursive=True)} | {psutil.Process().pid}
for c in psutil.net_connections("inet"):
    if c.status == psutil.CONN_LISTEN and c.pid in tree:
        print("LISTEN", psutil.Process(c.pid).name(), c.laddr.ip, c.laddr.port)
ray.shutdown()
"""


@pytest.mark.slow
def test_a_local_sweeps_ray_listens_on_loopback_only(tmp_path):
    """Issue 56 item 6: the local Ray a sweep starts (GCS, raylet, workers, agents) listened on `::` / 0.0.0.0;
    now on 127.0.0.1 alone, so nothing beyond this machine reaches it."""
    import shutil
    import subprocess
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="pp-lo-")  # short: Ray's unix sockets live under it
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=300,
                              env=env, cwd=tmp_path)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    listeners = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("LISTEN ")]
    assert proc.returncode == 0 and listeners, proc.stdout + proc.stderr[-3000:]
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names, listeners
    wide = [(name, ip, port) for name, ip, port in listeners if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not wide, f"listening beyond loopback: {wide}"
