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

from .conftest import assert_clean_error

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


class _Planted:
    """A pickle that, unpickled, creates ``marker`` (standing for any code an attacker would run)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


RUN = "rel-20261125-090000"
# every folder `--resume` of RUN reads: the storage, its state folder, the run's outbox, its two Tune experiments
# (the grid's and the search's), a trial folder in each, its saved blocks
READ_FOLDERS = ["", "_promprune_state", f"_promprune_state/{RUN}.outbox", RUN, f"{RUN}-search",
                f"{RUN}/run_trial_0_baseline", f"{RUN}-search/run_trial_0_promprune", f"_promprune_blocks/{RUN}"]


def _saved_run(scratch, tmp_path):
    """A saved run of the scratch spec, as a sweep leaves it, with every folder `--resume` reads."""
    spec = specs.load(scratch())
    storage = tmp_path / "outputs" / "tune"
    state.save_state(str(storage), {"experiment": RUN, "parent_run_id": "r0", "storage_path": str(storage),
                                    "fingerprint": state.fingerprint(spec), "spec_yaml": specs.dump_resolved(spec),
                                    "command": {"config": "spec.yaml", "overrides": []}})
    for folder in READ_FOLDERS:
        (storage / folder).mkdir(parents=True, exist_ok=True)
    return spec, storage


@pytest.mark.parametrize("folder", READ_FOLDERS, ids=[f or "storage" for f in READ_FOLDERS])
def test_resume_checks_every_folder_and_file_it_reads(scratch, tmp_path, folder):
    """Issue 57 item 1: the trust check looked at the storage, its state folder and `<exp>` only, and a `tuner.pkl`
    planted in an other-writable `<exp>-search` ran its code on `--resume`. A pickle planted in each folder the
    resume reads is refused, whether the folder or the file is writable by others or the file is another user's
    (the storage and its state folder hold no file the resume reads: they must be private themselves)."""
    import pickle

    spec, storage = _saved_run(scratch, tmp_path)
    state.resumed_state(spec, "latest")  # a private run resumes
    target, marker = storage / folder, tmp_path / "planted-code-ran"
    planted = target / "tuner.pkl"
    planted.write_bytes(pickle.dumps(_Planted(marker)))
    os.chmod(target, 0o777)
    with pytest.raises(specs.SpecError, match=f"{target} is owned by another user or writable by others"):
        state.resumed_state(spec, "latest")
    os.chmod(target, 0o755)
    if folder in ("", "_promprune_state"):  # a file directly there is not read: the folder is what must be private
        return
    os.chmod(planted, 0o666)
    with pytest.raises(specs.SpecError, match=f"{planted} is owned by another user or writable by others"):
        state.resumed_state(spec, "latest")
    os.chmod(planted, 0o644)
    if os.getuid() == 0:  # only root can give a file away
        os.chown(planted, 65534, 65534)
        with pytest.raises(specs.SpecError, match=f"{planted} is owned by another user"):
            state.resumed_state(spec, "latest")
        os.chown(planted, 0, 0)
    state.resumed_state(spec, "latest")
    assert not marker.exists()


def test_a_planted_search_state_never_runs(scratch, tmp_path, run_main):
    """The issue's scenario through the command line: `--resume` with a `tuner.pkl` planted in an other-writable
    `<exp>-search` exits 2 naming the folder, before Ray starts, and the pickle is never loaded."""
    import pickle

    _, storage = _saved_run(scratch, tmp_path)
    marker = tmp_path / "planted-code-ran"
    (storage / f"{RUN}-search" / "tuner.pkl").write_bytes(pickle.dumps(_Planted(marker)))
    os.chmod(storage / f"{RUN}-search", 0o777)
    proc, _ = run_main("--config", str(tmp_path / "spec.yaml"), "--resume")
    assert_clean_error(proc, f"{storage / f'{RUN}-search'} is owned by another user or writable by others",
                       f"chmod go-w {storage / f'{RUN}-search'}")
    assert not marker.exists()
