"""One driver per sweep (issue 49): a second driver of a running sweep is refused before Ray starts, naming the
first; a killed driver's lock does not block its resume; two sweeps started in the same second get distinct
experiments (and so distinct logs)."""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from datetime import datetime

import pyarrow.fs
import pytest
import yaml

from pipelines import mlflow_layout
from pipelines import spec as specs
from pipelines.run import state as states
from tests.pipelines.sweep_cli import GATED, REPO, read_until, spawn_sweep

from .conftest import assert_clean_error

HOLD = """
import sys, time
from pipelines.run.state import DriverLock
lock = DriverLock.resume(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


def _holder(storage, experiment: str) -> subprocess.Popen:
    """Another process holding the lock of ``experiment`` (until killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(storage), experiment], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "held"
    return proc


class _Frozen(datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 11, 25, 10, 0, 0, tzinfo=tz)


def test_sweeps_started_in_the_same_second_get_distinct_experiments(tmp_path, monkeypatch):
    monkeypatch.setattr(states, "datetime", _Frozen)
    first = states.DriverLock.new(str(tmp_path), "rel")
    second = states.DriverLock.new(str(tmp_path), "rel")
    first.release()
    third = states.DriverLock.new(str(tmp_path), "rel")  # a released name is never given out again
    assert [first.experiment, second.experiment, third.experiment] == \
        ["rel-20261125-100000", "rel-20261125-100000-2", "rel-20261125-100000-3"]
    second.release(), third.release()


def test_a_live_driver_is_named_and_a_killed_ones_lock_is_taken_over(tmp_path):
    storage = str(tmp_path)
    holder = _holder(storage, "rel-1")
    try:
        with pytest.raises(specs.SpecError) as refused:
            states.DriverLock.resume(storage, "rel-1")
        message = str(refused.value)
        assert f"pid {holder.pid} on {socket.gethostname()}, since 20" in message and "UTC" in message
        assert f"`kill -INT {holder.pid}` on {socket.gethostname()}" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with states.DriverLock.resume(storage, "rel-1") as lock:  # the kernel dropped the dead driver's lock
        assert lock.experiment == "rel-1"
        with pytest.raises(specs.SpecError, match=f"pid {lock.info['pid']} "):
            states.DriverLock.resume(storage, "rel-1")  # held by this process now
    states.DriverLock.resume(storage, "rel-1").release()  # and released


def test_latest_is_the_run_still_setting_up(scratch, tmp_path):
    """`--resume` (latest) while the newest run has saved no state yet is that run, refused; not the older one."""
    spec = specs.load(scratch())
    storage = str(tmp_path / "outputs" / "tune")
    states.save_state(storage, {"experiment": "rel-20261125-090000", "parent_run_id": "r0", "storage_path": storage,
                                "fingerprint": states.fingerprint(spec)})
    with states.DriverLock.resume(storage, "rel-20261125-100000") as setting_up:  # (this process holds it)
        with pytest.raises(specs.SpecError, match=f"sweep rel-20261125-100000 is being run by a live driver "
                                                  f"\\(pid {setting_up.info['pid']} "):
            states.resumed_state(spec, "latest")
    assert states.resumed_state(spec, "latest")["experiment"] == "rel-20261125-090000"  # it ended in setup
    with states.DriverLock.new(storage, "rel-b"):  # another spec whose name starts like this one's
        assert states.resumed_state(spec, "latest")["experiment"] == "rel-20261125-090000"


def test_remote_storage_goes_by_pid_here_and_by_heartbeat_elsewhere(tmp_path, monkeypatch):
    """s3:// and gs:// have no kernel lock: the same rules on a filesystem that is not the local one."""
    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
    monkeypatch.setattr(states, "_state_fs", lambda storage: (remote, states.STATE_DIR))
    lock = states.DriverLock("s3://bucket/tune", "rel-1")

    def holder(**info):
        lock._fs.create_dir(states.STATE_DIR)
        with remote.open_output_stream(lock.path) as f:
            f.write(json.dumps({"since": "then", **info}).encode())  # as a driver writes it

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    for info, refused in [({"host": "other", "pid": 1, "beat": now - 10}, True),
                          ({"host": "other", "pid": 1, "beat": now - states.STALE_AFTER_S - 1}, False),
                          ({"host": socket.gethostname(), "pid": 1, "beat": now - 1e6}, True),  # pid 1 runs
                          ({"host": socket.gethostname(), "pid": dead.pid, "beat": now}, False)]:
        holder(**info)
        if refused:
            with pytest.raises(specs.SpecError, match=f"pid {info['pid']} on {info['host']}"):
                states.DriverLock.resume("s3://bucket/tune", "rel-1")
            continue
        taken = states.DriverLock.resume("s3://bucket/tune", "rel-1")
        with remote.open_input_stream(lock.path) as f:
            assert json.loads(f.read())["pid"] == taken.info["pid"]
        taken.release()
        assert remote.get_file_info(lock.path).type == pyarrow.fs.FileType.NotFound  # its lock is gone


@pytest.mark.slow
@pytest.mark.long  # the long tier (pyproject's markers): in CI the refusal runs with a live holder (the tests above and
# below) and a killed driver's sweep resumes (test_engine's, tests/reliability/test_resume.py's)
def test_a_second_driver_is_refused_and_a_killed_drivers_sweep_resumes(tmp_path, monkeypatch):
    """The issue's scenario with real processes: sweep A runs (its trial held at a gate); `--resume` in a second
    terminal is refused at once, exit 2, naming A's pid; A is SIGKILLed; `--resume` then finishes the sweep into
    the same MLflow parent run, the trial logged once."""
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    monkeypatch.setenv("RAY_TMPDIR", ray_dir)
    try:
        _second_driver_scenario(tmp_path)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def _second_driver_scenario(tmp_path) -> None:
    gate = tmp_path / "gate"
    (tmp_path / "gated.py").write_text(textwrap.dedent(GATED.format(gate=str(gate))))
    spec_path = tmp_path / "gated.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "gated", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 2, "baseline": False, "plugins": ["gated.py"], "grid": {"method": ["gated"], "budget": [8]},
        "generation": {"max_new_tokens": 2}}))
    first = spawn_sweep(spec_path, tmp_path, ray_address="local")
    head = read_until(first, "output goes to", timeout=300)  # it holds the sweep's lock from here on
    log = head.splitlines()[-1].split(" goes to ")[1].split()[0]

    second = spawn_sweep(spec_path, tmp_path, "--resume", ray_address="local")  # while the first sets up or runs
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 2, out
    assert f"is being run by a live driver (pid {first.pid} on {socket.gethostname()}" in out, out
    assert "Traceback" not in out and "Started a local Ray instance" not in out and "output goes to" not in out
    assert first.poll() is None  # the first driver was left alone
    read_until(first, "[start] gated-b8", timeout=300)  # its state is saved and its trial runs, held at the gate

    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    gate.touch()
    third = spawn_sweep(spec_path, tmp_path, "--resume", ray_address="local")
    out, _ = third.communicate(timeout=400)
    assert third.returncode == 0, out[-3000:]
    experiment = Path(log).name.removesuffix(".log")  # the log's path: absolute (`pipelines.paths.outputs_dir`)
    assert f"resuming {tmp_path / 'outputs' / 'tune'}/{experiment}:" in out, out[-3000:]
    assert f"output goes to {log} " in out  # a resume appends to its run's log

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parents = c.search_runs([c.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT).experiment_id],
                            filter_string="tags.`promprune.role` = 'sweep'")
    assert [p.info.status for p in parents] == ["FINISHED"]  # the same parent run continued
    children = c.search_runs([parents[0].info.experiment_id],
                             filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    assert [r.data.tags[mlflow_layout.TRIAL] for r in children] == ["gated-b8"]


def test_storage_that_cannot_hold_the_lock_is_a_clean_error(scratch, tmp_path, run_main):
    (tmp_path / "a_file").write_text("")  # a storage path below a file: no one, root included, can write there
    proc, _ = run_main("--config", str(scratch()), "--set", f"tune.storage_path={tmp_path / 'a_file' / 'tune'}")
    assert_clean_error(proc, f"the Tune storage {tmp_path / 'a_file' / 'tune'} cannot hold the sweep's state "
                             "(NotADirectoryError")


@pytest.mark.parametrize("where", ["set", "env"])
def test_a_storage_scheme_pyarrow_cannot_open_is_a_clean_error(scratch, run_main, monkeypatch, where):
    """s4:// (a typo) or ftp:// gave pyarrow's ArrowInvalid as a traceback; the --resume path reads the same state."""
    args = ["--set", "tune.storage_path=s4://bucket/x"] if where == "set" else []
    if where == "env":
        monkeypatch.setenv("PROMPRUNE_STORAGE", "ftp://host/x")
    for resume in ([], ["--resume"]):
        proc, _ = run_main("--config", str(scratch()), *args, *resume)
        assert_clean_error(proc, f"the Tune storage {'s4://bucket/x' if where == 'set' else 'ftp://host/x'} is not "
                                 "a path or a URI pyarrow can open", "tune.storage_path")


def test_a_resume_whose_driver_lives_is_refused_before_ray_and_torch_load(scratch, tmp_path):
    """Issue 57 item 4: the refusal came after 24-30 s of imports and checks (Ray, torch, lmms-eval's task index);
    the script now checks the lock before its imports. `-X importtime` lists every module the refused process
    imported: neither torch nor ray. Both the named run and `latest` are refused, with the full check's message.
    (Its time: benchmarks/frontdoor.py.)"""
    spec = scratch()
    storage = tmp_path / "outputs" / "tune"
    states.save_state(str(storage), {"experiment": "rel-20261125-090000", "parent_run_id": "r0",
                                     "storage_path": str(storage)})
    holder = _holder(storage, "rel-20261125-090000")
    try:
        for resume in (["--resume"], ["--resume", "rel-20261125-090000"]):
            proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "pipelines" / "sweep.py"),
                                   "--config", str(spec), *resume], capture_output=True, text=True, cwd=tmp_path,
                                  timeout=120)
            imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
                        if line.startswith("import time:")}
            refusal = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
            assert proc.returncode == 2, proc.stdout + refusal
            assert f"--resume rel-20261125-090000: 1 problem(s):\n  - sweep rel-20261125-090000 is being run by a " \
                   f"live driver (pid {holder.pid} on {socket.gethostname()}" in refusal, refusal
            assert "Traceback" not in refusal
            assert not {"torch", "ray", "mlflow", "lmms_eval"} & imported, sorted(imported)
    finally:
        holder.kill()
        holder.communicate()


def test_a_bare_resume_that_finds_a_live_run_names_the_earlier_runs_it_could_mean(scratch, tmp_path):
    """An interrupted run of a spec, then a colleague's new run of it (live): `--resume` alone finds the live one and
    is refused. The refusal named only that run and said to stop it and resume then: followed, it stopped the
    colleague's sweep. It now names the earlier runs no driver holds and the --resume that takes the newest of them;
    both the early check (before Ray and torch) and the full one say so."""
    from pipelines import frontdoor

    spec_path = scratch()
    spec = specs.load(spec_path)
    storage = str(tmp_path / "outputs" / "tune")
    for experiment in ("rel-20261125-080000", "rel-20261125-090000", "rel-20261125-100000"):
        states.save_state(storage, {"experiment": experiment, "parent_run_id": "r0", "storage_path": storage,
                                    "fingerprint": states.fingerprint(spec), "spec_yaml": specs.dump_resolved(spec)})
    with states.DriverLock.resume(storage, "rel-20261125-100000") as live, \
            states.DriverLock.resume(storage, "rel-20261125-080000"):  # (this process holds both)
        early = frontdoor.early_problem(["--config", str(spec_path), "--resume"])
        with pytest.raises(specs.SpecError) as full:
            states.resumed_state(spec, "latest")
        for message in (early, str(full.value)):
            assert message is not None and f"rel-20261125-100000 is being run by a live driver (pid " \
                                           f"{live.info['pid']} " in message
            assert "`--resume rel-20261125-090000`" in message, message  # the newest no driver holds
            assert "newest first: rel-20261125-090000;" in message  # 080000 is held too: not offered
        # a named run is the user's choice: no other run offered
        named = frontdoor.early_problem(["--config", str(spec_path), "--resume", "rel-20261125-100000"])
        assert "is being run by a live driver" in named and "earlier run" not in named
    assert states.resumed_state(spec, "latest")["experiment"] == "rel-20261125-100000"  # its driver ended
