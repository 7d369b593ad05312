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
