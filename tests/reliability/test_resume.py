"""Resuming, interruptions and failures never mix or lose results (reliability scenarios 1, 3, 5 and the SIGKILL
case): a changed spec is refused on --resume, the printed resume command reproduces the original, a failed trial is
logged once, an interrupted Tune result without a config does not crash, a dead driver's run is marked KILLED."""
from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import ray
import yaml

from pipelines import mlflow_layout, sweep
from pipelines.recording import tracking
from pipelines.run import ray_connect, state as states
from pipelines.recording.console import SweepConsole
from pipelines.recording.recorder import SweepRecorder
from pipelines import spec as specs

from .conftest import assert_clean_error


def _state_for(spec: specs.SweepSpec, storage, experiment: str, parent_id: str = "run0", **extra) -> dict:
    state = {"parent_run_id": parent_id, "storage_path": str(storage), "experiment": experiment,
             "fingerprint": states.fingerprint(spec), "spec_yaml": specs.dump_resolved(spec),
             "command": {"config": "sweeps/rel.yaml", "overrides": ["limit=4", "grid.budget=[8]"]}, **extra}
    states.save_state(str(storage), state)
    return state


def test_resume_refuses_a_changed_spec_and_names_the_changes(scratch, tmp_path, run_main):
    path = scratch()
    original = specs.load(path)
    _state_for(original, tmp_path / "outputs" / "tune", "rel-20261122-000000")
    proc, _ = run_main("--config", str(path), "--set", "limit=6", "--set", "tasks=[easyvqa_open]",
                       "--resume", "rel-20261122-000000")
    assert_clean_error(proc, "the spec differs from the one that run started with: 2 problem(s)", "limit: 4 -> 6",
                       "tasks: ['easyvqa_yesno'] -> ['easyvqa_open']",
                       "resume the original with: python pipelines/sweep.py --config sweeps/rel.yaml "
                       "--set limit=4 --set 'grid.budget=[8]' --resume rel-20261122-000000")
    assert not (tmp_path / "mlflow.db").exists()  # refused before any MLflow run was touched


def test_a_resume_whose_parent_run_is_not_in_the_store_is_refused_before_ray(scratch, tmp_path, run_main):
    """The store deleted (or another MLFLOW_TRACKING_URI than the run's): MLflow's "Run ... not found" came as a
    traceback after ~30 s of Ray's start, exit 1. Now exit 2 before Ray, naming the store the run was started with."""
    path = scratch()
    spec = specs.load(path)
    _state_for(spec, tmp_path / "outputs" / "tune", "rel-20261122-000001", parent_id="0" * 32,
               tracking_uri="sqlite:///elsewhere/mlflow.db")
    proc, _ = run_main("--config", str(path), "--resume", "rel-20261122-000001")
    assert_clean_error(proc, f"its MLflow parent run {'0' * 32} is not in the store sqlite:///{tmp_path / 'mlflow.db'} "
                             "(the run was started with the store sqlite:///elsewhere/mlflow.db)",
                       "MLFLOW_TRACKING_URI")
    assert not (tmp_path / "mlflow.db").exists()  # not made by the check
    tracking.client()  # the store exists now, without that run
    proc, _ = run_main("--config", str(path), "--resume", "rel-20261122-000001")
    assert_clean_error(proc, f"its MLflow parent run {'0' * 32} is not in the store", "without --resume")
    from pipelines import preflight

    parent = tracking.start_sweep(tracking.client(), spec.name, spec.version, specs.dump_resolved(spec), {})
    assert preflight.check_resumed_run({"parent_run_id": parent, "experiment": "rel-20261122-000001"}) == []


def test_a_resume_of_a_sweep_that_finished_says_so_and_runs_nothing(scratch, tmp_path, run_main, monkeypatch):
    """A probe's case: `--resume` of a sweep that finished cleanly restarted Ray, replayed every trial without
    saying the sweep had finished, appended a second samples/generated and trials/* to the parent run and moved its
    end. Now it says so and exits 0, nothing started or written; one whose trials failed (docs: a resume runs them
    again), or that ended unfinished, still resumes."""
    from pipelines import preflight

    path = scratch()
    spec = specs.load(path)
    client = tracking.client()
    parent = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec), {})
    tracking.log_metrics(client, parent, {"trials/total": 2, mlflow_layout.TRIALS_FAILED: 0, "samples/generated": 8})
    tracking.finish(client, parent)
    ended = client.get_run(parent)
    storage = tmp_path / "outputs" / "tune"
    _state_for(spec, storage, "rel-20261122-000002", parent_id=parent)
    started = []
    monkeypatch.setattr(sweep, "connect", lambda *a, **k: started.append("ray") or (_ for _ in ()).throw(
        RuntimeError("Ray started")))
    monkeypatch.setattr(preflight, "check_or_raise", lambda *a, **k: [])  # the spec's model and data: not needed
    proc, _ = run_main("--config", str(path), "--resume", "rel-20261122-000002")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"--resume rel-20261122-000002: the sweep finished at "
                                  f"{ended.data.tags[mlflow_layout.FINISHED_AT]} (MLflow parent run {parent} "
                                  "FINISHED, 2 trials all finished): nothing to resume"), proc.stdout
    assert "leave out --resume" in proc.stdout and "mlflow ui --backend-store-uri" in proc.stdout
    assert started == []
    after = client.get_run(parent)
    assert after.info.end_time == ended.info.end_time and after.info.status == "FINISHED"
    assert [len(client.get_metric_history(parent, k)) for k in ("trials/total", "samples/generated")] == [1, 1]
    # failed trials: the resume goes on to run them again (here: as far as Ray's start)
    tracking.log_metrics(client, parent, {mlflow_layout.TRIALS_FAILED: 1})
    with pytest.raises(RuntimeError, match="Ray started"):
        run_main("--config", str(path), "--resume", "rel-20261122-000002")
    assert started == ["ray"]


def test_a_resume_whose_tune_state_is_cut_short_is_refused_before_ray(scratch, tmp_path, run_main):
    """The probe's case: a `tuner.pkl` cut short (Tune's experiment state) ended the resume in
    `_pickle.UnpicklingError: pickle data was truncated`, a traceback after Ray started. Now exit 2 before Ray,
    naming the file and the way on (the sweep afresh, without --resume), and the file is left as it was."""
    import pickle

    path = scratch()
    spec = specs.load(path)
    parent = tracking.start_sweep(tracking.client(), spec.name, spec.version, specs.dump_resolved(spec), {})
    storage = tmp_path / "outputs" / "tune"
    _state_for(spec, storage, "rel-20261122-000002", parent_id=parent)
    whole = pickle.dumps({"__trainable_name": "trial",
                          "trials": [{"id": n, "config": {"budget": 8}} for n in range(20)]})
    tuner = storage / "rel-20261122-000002" / "tuner.pkl"
    tuner.parent.mkdir(parents=True)
    tuner.write_bytes(whole)
    (storage / "rel-20261122-000002-search").mkdir()  # the search's experiment, its state cut short
    cut = storage / "rel-20261122-000002-search" / "tuner.pkl"
    cut.write_bytes(whole[:100])
    (storage / "rel-20261122-000002-2").mkdir()  # another run's: not read
    (storage / "rel-20261122-000002-2" / "tuner.pkl").write_bytes(b"")
    proc, _ = run_main("--config", str(path), "--resume", "rel-20261122-000002")
    assert_clean_error(proc, f"Tune's experiment state {cut} cannot be read (ValueError: ", "100 bytes",
                       "the run cannot be resumed", "the same command without --resume",
                       f"stay in MLflow under its parent run {parent}")
    assert str(tuner) not in proc.stderr and cut.read_bytes() == whole[:100]
    cut.write_bytes(whole)  # whole again: the check passes
    saved = states.load_state(str(storage), "rel", "rel-20261122-000002")
    assert states.check_tune_state(saved) == []
    # whole pickles that are not Tune's state failed at Tune.restore, after Ray started: a class that is gone (the
    # state of another Ray version), another object
    import sys
    import types

    gone = types.ModuleType("promprune_gone_module")
    gone.Thing = type("Thing", (), {"__module__": "promprune_gone_module"})
    sys.modules["promprune_gone_module"] = gone
    try:
        cut.write_bytes(pickle.dumps({"__trainable_name": "trial", "_tune_config": gone.Thing()}))
    finally:
        del sys.modules["promprune_gone_module"]
    [problem] = states.check_tune_state(saved)
    assert f"{cut} cannot be read (ModuleNotFoundError: No module named 'promprune_gone_module'" in problem
    for other, what in (([1, 2], "a list"), ({"trials": []}, "a dict without the __trainable_name Tune writes")):
        cut.write_bytes(pickle.dumps(other))
        [problem] = states.check_tune_state(saved)
        assert f"{cut} cannot be read (not Tune's saved state: {what}" in problem and "without --resume" in problem


def test_the_same_spec_resumes(scratch, tmp_path):
    spec = specs.load(scratch())
    state = _state_for(spec, tmp_path / "store", "rel-1")
    states.check_resume(spec, state)  # no error
    changed = specs.load(scratch(), ["grid.mu=[0.3]"])
    with pytest.raises(specs.SpecError, match=r"grid.mu: '\(unset\)' -> \[0.3\]"):
        states.check_resume(changed, state)


def test_a_failed_trial_is_logged_once(scratch):
    spec = specs.load(scratch())
    client = tracking.client()
    parent = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec), {})
    recorder = SweepRecorder(spec, parent, SweepConsole(1), model_params=tracking.model_params(spec, on_gpu=False))
    trial = specs.expand(spec)[1].to_dict()
    recorder.record_error(trial, "RuntimeError: boom")  # Tune's callback ...
    recorder.record_error(trial, "RuntimeError: boom")  # ... and the final reconcile
    assert recorder.unlogged(60) == []
    assert recorder.close() == []
    runs = client.search_runs([client.get_run(parent).info.experiment_id],
                              filter_string=mlflow_layout.tag_filter(mlflow_layout.PARENT, parent))
    assert [r.info.status for r in runs] == ["FAILED"]


def test_reconcile_skips_results_tune_never_started():
    """Ctrl-C under load once ended in TypeError: 'NoneType' object is not subscriptable."""
    recorder = SimpleNamespace(records={})
    grid = [SimpleNamespace(config=None, error=None, checkpoint=None),
            SimpleNamespace(config={}, error=None, checkpoint=None)]
    with pytest.raises(sweep.SweepInterrupted, match="1 trial\\(s\\) did not finish: baseline"):
        sweep._reconcile(recorder, grid, [specs.Trial(None, None)])


def test_a_dead_drivers_run_is_marked_killed_on_the_next_start(scratch, tmp_path):
    spec = specs.load(scratch())
    client = tracking.client()
    parent = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec), {})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free again: a driver that was SIGKILLed
    storage = tmp_path / "store"
    _state_for(spec, storage, "rel-1", parent, driver={"host": socket.gethostname(), "pid": dead.pid})
    alive_parent = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec), {})
    _state_for(spec, storage, "rel-2", alive_parent, driver={"host": socket.gethostname(), "pid": 1})

    assert tracking.mark_dead_runs(client, str(storage), spec.name) == ["rel-1"]
    run = client.get_run(parent)
    assert run.info.status == "KILLED"
    assert "died without finishing" in run.data.tags[mlflow_layout.INTERRUPTED]
    assert "--resume rel-1" in run.data.tags[mlflow_layout.INTERRUPTED]
    assert client.get_run(alive_parent).info.status == "RUNNING"  # pid 1 is alive: left alone
    assert tracking.mark_dead_runs(client, str(storage), spec.name) == []  # once


def test_a_run_being_resumed_is_not_marked_dead_by_another_start(scratch, tmp_path):
    """A killed run's state names its dead driver until its resume, setting up (Ray, the weights: tens of seconds),
    saves its own. A new run of the spec starting meanwhile marked that run KILLED, "driver died ... resume with",
    while the resume held its lock and went on running it. The lock, not the pid in the state, says who runs it."""
    spec = specs.load(scratch())
    client = tracking.client()
    parent = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec), {})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    storage = tmp_path / "store"
    _state_for(spec, storage, "rel-1", parent, driver={"host": socket.gethostname(), "pid": dead.pid})
    with states.DriverLock.resume(str(storage), "rel-1"):  # its resume, still setting up
        assert tracking.mark_dead_runs(client, str(storage), spec.name) == []
        assert client.get_run(parent).info.status == "RUNNING"
        assert mlflow_layout.INTERRUPTED not in client.get_run(parent).data.tags
    assert tracking.mark_dead_runs(client, str(storage), spec.name) == ["rel-1"]  # the resume died too: marked


def test_state_records_what_resume_needs(scratch, tmp_path):
    spec = specs.load(scratch())
    state = _state_for(spec, tmp_path / "store", "rel-9")
    saved = json.loads((tmp_path / "store" / states.STATE_DIR / "rel-9.json").read_text())
    assert saved["fingerprint"] == states.fingerprint(spec) and saved["command"] == state["command"]
    assert states.resume_command(saved).endswith("--resume rel-9")


def test_an_address_where_a_web_server_answers_fails_in_seconds(monkeypatch):
    """The dashboard's port (8265) instead of the GCS's: the TCP check passed, and Ray waited for minutes, silent."""
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        start = time.monotonic()
        with pytest.raises(ray_connect.RayUnreachable, match=rf"something answers at {address} \(--address\), but "
                                                             r"not a Ray head's GCS: .*not the dashboard's port"):
            ray_connect.connect(address)
        assert time.monotonic() - start < 20
        assert not ray.is_initialized()
    finally:
        server.shutdown()


def test_stale_ray_address_fails_in_seconds(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ray_connect.RayUnreachable, match="127.0.0.1:1 \\(RAY_ADDRESS\\) does not answer"):
        ray_connect.connect(None)
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    assert ray_connect._recorded_head() == "127.0.0.1:1" and not ray_connect._answers("127.0.0.1:1")


def test_auto_a_ray_client_address_and_a_dashboard_url_are_refused_in_seconds(monkeypatch, tmp_path):
    """A probe's cases: `--address auto` with no Ray running and `ray://` at a port that does not answer ended in
    Ray's ConnectionError traceback, exit 1 (the Ray Client one after ~40 s); the dashboard's URL, which `ray job
    submit` users keep in RAY_ADDRESS, was called "does not answer"."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def no_ray_running(address=None, **kwargs):  # Ray's own words when auto finds no cluster (whether one runs
        # here depends on the other tests: the suite's Ray clusters)
        if address != "auto":
            raise AssertionError(f"ray.init({address!r}) reached: the address should have been refused before")
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    monkeypatch.setattr(ray, "init", no_ray_running)
    cases = [("auto", r"no running Ray cluster was found on this machine \(--address=auto: Could not find any "),
             ("ray://127.0.0.1:1", r"--address=ray://127.0.0.1:1 is a Ray Client address, which PromPrune does "
                                   r"not run through"),
             ("http://127.0.0.1:8265", r"http://127.0.0.1:8265 \(--address\) is a Ray dashboard's URL, which `ray "
                                       r"job submit` takes")]
    for address, message in cases:
        start = time.monotonic()
        with pytest.raises(ray_connect.RayUnreachable, match=message):
            ray_connect.connect(address)
        assert time.monotonic() - start < 20 and not ray.is_initialized()


def test_a_ray_client_address_is_refused_before_any_work_with_the_job_to_submit(monkeypatch, tmp_path, capsys):
    """A probe's case: RAY_ADDRESS=ray://host:10001, which Ray's own error messages here recommended, was accepted;
    the sweep then crashed: the pool's state API called before ray.init, and Tune's fit ran in a remote task under
    Ray Client, so its events reached the recorder outside the sweep. It is refused before Ray starts (exit 2, one
    paragraph, no traceback) with the `ray job submit` that runs the sweep; evaluate.py refuses it too."""
    from pipelines import evaluate, sweep

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init reached: a Ray Client address should have been refused before")

    monkeypatch.setattr(ray, "init", no_ray)
    from pipelines.frontdoor import DEFAULT_CONFIG

    spec = str(DEFAULT_CONFIG)
    for env, argv in (("ray://10.0.0.5:10001", []), (None, ["--address", "ray://10.0.0.5:10001"])):
        if env:
            monkeypatch.setenv("RAY_ADDRESS", env)
        else:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        assert sweep.main(["--config", spec, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "is a Ray Client address, which PromPrune does not run through" in err
        assert "ray job submit --address http://10.0.0.5:8265 --working-dir ." in err
        assert ("RAY_ADDRESS=ray://" if env else "--address=ray://") in err
        assert not (tmp_path / "mlflow.db").exists()  # refused before the store was made
    assert sweep.main(["--config", spec, "--address", "ray://10.0.0.5:10001", "--validate-only"]) == 0  # no Ray
    capsys.readouterr()
    assert evaluate.main(["--method", "promprune", "--budget", "8", "--limit", "2", "--no-mlflow", "--address",
                          "ray://10.0.0.5:10001"]) == 2
    assert "is a Ray Client address" in capsys.readouterr().err


def test_no_message_recommends_a_ray_client_address():
    """The refusals of a dashboard URL, a port that is not a GCS, a failed join pointed users at ray://host:10001,
    which is refused."""
    import inspect

    source = inspect.getsource(ray_connect)
    assert "ray://host" not in source.replace(ray_connect.client_address_problem.__doc__, "")


KILLED = {"name": "killed", "version": 1, "model": {"pretrained": "testbed:llava"},
          "tasks": ["testbed_exist_concentrated"], "limit": 2, "baseline": True,
          "grid": {"method": ["divprune"], "budget": [8]},
          "generation": {"max_new_tokens": 2}, "tune": {"max_concurrent_trials": 2, "max_failures": 0}}


@pytest.mark.slow
def test_a_driver_killed_after_a_trial_finished_resumes_with_every_metric(tmp_path, monkeypatch):
    """Issue 57's pid-only kill: the driver (not its process group) is SIGKILLed once a pruned trial's run is
    FINISHED in MLflow while the baseline still runs, so the pruned trial's Rel. is still to be written; the next
    start of the sweep marks the dead driver's runs KILLED; `--resume` then finishes the sweep with every trial's
    run FINISHED once, Rel. on each (what the nightly regression check reads), no stale `promprune.interrupted`
    tag, and no write refused or dropped on the way."""
    import os
    import signal
    import shutil
    import tempfile
    import time

    import yaml
    from mlflow.tracking import MlflowClient

    from tests.pipelines.sweep_cli import REPO, spawn_sweep

    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    monkeypatch.setenv("RAY_TMPDIR", ray_dir)
    spec_path = tmp_path / "killed.yaml"
    spec_path.write_text(yaml.safe_dump(KILLED))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, "-m", "tests.reliability.gate", str(spec_path), str(tmp_path / "gate")],
                             cwd=tmp_path, env={**env, "PYTHONPATH": os.pathsep.join([str(REPO), env.get(
                                 "PYTHONPATH", "")])}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        c, deadline = MlflowClient(uri), time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None:
            exp = c.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT)
            runs = [] if exp is None else c.search_runs(
                [exp.experiment_id], filter_string=mlflow_layout.tag_filter(mlflow_layout.TRIAL, "divprune-b8"))
            if runs and runs[0].info.status == "FINISHED":
                break
            time.sleep(0.2)
        else:
            raise AssertionError((tmp_path / "first.log").read_text()[-3000:])
        os.kill(first.pid, signal.SIGKILL)  # the driver's pid, not its group: Ray's processes it started live on
        first.wait(timeout=60)
        storage = str(tmp_path / "outputs" / "tune")
        assert tracking.mark_dead_runs(c, storage, "killed") != []  # what the next start of the sweep does first

        second = spawn_sweep(spec_path, tmp_path, "--resume", ray_address="local")
        out, _ = second.communicate(timeout=400)
        (tmp_path / "second.log").write_text(out)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # what the killed driver left (its Ray)
        log.close()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert second.returncode == 0, out[-3000:]
    assert "refused" not in out and "dropped" not in out, out[-3000:]
    parents = c.search_runs([c.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT).experiment_id],
                            filter_string=mlflow_layout.tag_filter(mlflow_layout.ROLE, mlflow_layout.ROLE_SWEEP))
    assert [p.info.status for p in parents] == ["FINISHED"]
    children = c.search_runs([parents[0].info.experiment_id],
                             filter_string=mlflow_layout.tag_filter(mlflow_layout.PARENT, parents[0].info.run_id))
    assert sorted(r.data.tags[mlflow_layout.TRIAL] for r in children) == ["baseline", "divprune-b8"]  # once each
    for run in [*parents, *children]:
        assert mlflow_layout.INTERRUPTED not in run.data.tags, (run.info.run_name, run.data.tags)
    assert all(r.info.status == "FINISHED" for r in children)
    assert sorted(tracking.rel_by_trial(c, parents[0].info.run_id)) == ["baseline", "divprune-b8"]


# ----------------------------------------------------------------------------------------------------------------
# the options beyond the spec: kept in the state, repeated by the resume command, restored by --resume


def _command(printed: str) -> list[str]:
    """The words of a printed resume command after the variables set in front of it (the run's MLflow store here:
    ``pipelines.environment.run_settings``), which must be the test process's own."""
    from pipelines.environment import run_settings

    words = shlex.split(printed)
    n = len(run_settings())
    assert dict(w.split("=", 1) for w in words[:n]) == run_settings()
    return words[n:]


def test_the_resume_command_repeats_the_options_that_change_the_run(scratch, tmp_path):
    """The printed command held only the spec file and the overrides: a nightly stopped by SIGTERM and resumed with it
    ran without its regression check, and (ending FINISHED) became the next night's baseline. Read back by the CLI's
    own parser, the command gives the run's options again."""
    spec = specs.load(scratch())
    command = states.launch_command("sweeps/nightly.yaml", ["limit=20"], regression_threshold=0.02,
                                    address="10.0.0.5:6379")
    _state_for(spec, tmp_path / "store", "rel-7", command=command)
    saved = states.load_state(str(tmp_path / "store"), "rel", "rel-7")
    printed = _command(states.resume_command(saved))
    assert printed[0] == "python" and printed[1] == command["script"] and printed[1].endswith("pipelines/sweep.py")
    args = sweep.parse_args(printed[2:])
    assert (args.config, args.overrides, args.resume) == ("sweeps/nightly.yaml", ["limit=20"], "rel-7")
    assert (args.regression_threshold, args.address) == (0.02, "10.0.0.5:6379")
    plain = states.launch_command("sweeps/nightly.yaml", [])  # none given: none printed
    assert _command(states.resume_command({"experiment": "rel-7", "command": plain})) == \
        ["python", plain["script"], "--config", "sweeps/nightly.yaml", "--resume", "rel-7"]


def test_a_sweep_started_outside_the_checkout_is_told_its_own_script(tmp_path, monkeypatch):
    """A probe's case: `python <clone>/pipelines/sweep.py` run in another folder (its records there) printed
    `python pipelines/sweep.py ... --resume`, which that folder cannot run. The script now as that folder reaches
    it; a state written before kept no script and prints the checkout's relative path, as before."""
    from pathlib import Path

    from pipelines.frontdoor import REPO

    monkeypatch.chdir(tmp_path)
    command = states.launch_command(str(tmp_path / "my.yaml"), ["limit=3"])
    printed = _command(states.resume_command({"experiment": "q-1", "command": command}))
    assert printed[:2] == ["python", str(REPO / "pipelines" / "sweep.py")] and Path(printed[1]).is_file()
    assert printed[2:] == ["--config", "my.yaml", "--set", "limit=3", "--resume", "q-1"]
    old = {k: v for k, v in command.items() if k != "script"}
    assert _command(states.resume_command({"experiment": "q-1", "command": old}))[:2] == ["python",
                                                                                       "pipelines/sweep.py"]


def test_a_resume_restores_the_options_the_run_started_with():
    """`--resume` alone (the command a user retypes, or an older printed one) gets the run's threshold and address
    back, with a note; an option given anew wins, also with a note."""
    state = {"experiment": "nightly-1", "command": states.launch_command(
        "sweeps/nightly.yaml", [], regression_threshold=0.02, address="10.0.0.5:6379")}
    args = sweep.parse_args(["--config", "sweeps/nightly.yaml", "--resume"])
    notes = states.restore_options(args, state)
    assert (args.regression_threshold, args.address) == (0.02, "10.0.0.5:6379")
    assert notes == ["note: --resume nightly-1: the run started with --address 10.0.0.5:6379, which applies again "
                     "(give --address to change it)",
                     "note: --resume nightly-1: the run started with --regression-threshold 0.02, which applies "
                     "again (give --regression-threshold to change it)"]
    args = sweep.parse_args(["--config", "sweeps/nightly.yaml", "--resume", "--regression-threshold", "0.05"])
    notes = states.restore_options(args, state)
    assert args.regression_threshold == 0.05 and args.address == "10.0.0.5:6379"
    assert notes[1] == ("note: --resume nightly-1: the run started with --regression-threshold 0.02; this resume "
                        "uses --regression-threshold 0.05")
    old = {"experiment": "nightly-0", "command": {"config": "sweeps/nightly.yaml", "overrides": []}}  # before this
    args = sweep.parse_args(["--config", "sweeps/nightly.yaml", "--resume"])
    assert states.restore_options(args, old) == [] and args.regression_threshold is None


def test_the_cli_restores_a_runs_threshold_on_resume(scratch, tmp_path, run_main):
    """Through `main`: the note is printed before anything runs (here --validate-only, which stops after it)."""
    path = scratch()
    spec = specs.load(path)
    parent = tracking.start_sweep(tracking.client(), spec.name, spec.version, specs.dump_resolved(spec), {})
    _state_for(spec, tmp_path / "outputs" / "tune", "rel-20261122-000002", parent,
               command=states.launch_command(str(path), [], regression_threshold=0.02))
    proc, _ = run_main("--config", str(path), "--resume", "rel-20261122-000002", "--validate-only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("note: --resume rel-20261122-000002: the run started with --regression-threshold 0.02, which applies "
            "again") in proc.stdout


def test_a_sweep_with_failed_trials_names_them_and_the_command_that_runs_them_again():
    """A trial that failed (its pool or worker killed, a node lost) ended the sweep with exit 1 and no resume line,
    though --resume runs the errored trials again and keeps the finished ones."""
    records = {"baseline": {"error": None}, "promprune-b8": {"error": "RuntimeError: the actor died"},
               "random-b8": {"error": "RuntimeError: the actor died"}}
    outcome = sweep.SweepOutcome("run0", records, [], "/tmp/x", resume="python pipelines/sweep.py --config "
                                                                      "sweeps/rel.yaml --resume rel-1")
    assert sweep.failed_note(outcome) == (
        "2 trial(s) failed: promprune-b8, random-b8 (the error of each above, and in MLflow). Once the cause is fixed, "
        "run them again, the finished trials kept, with:\n  python pipelines/sweep.py --config sweeps/rel.yaml "
        "--resume rel-1")


def test_a_run_from_before_a_new_field_resumes_at_its_default(scratch, tmp_path):
    """A field the code gained since the run started (resources.load_timeout_s) is absent from the run's saved spec:
    at its default it is no change (the resume was refused, '(unset) -> 1800'); set otherwise it is one."""
    spec = specs.load(scratch())
    state = _state_for(spec, tmp_path / "store", "rel-1")
    old = yaml.safe_load(state["spec_yaml"])
    del old["resources"]["load_timeout_s"]  # the spec as the code before the field resolved it
    state["spec_yaml"] = yaml.safe_dump(old, sort_keys=False)
    state["fingerprint"] = hashlib.sha256(state["spec_yaml"].encode()).hexdigest()
    states.check_resume(spec, state)  # no error
    changed = specs.load(scratch(), ["resources.load_timeout_s=600"])
    with pytest.raises(specs.SpecError, match=r"resources.load_timeout_s: '\(unset\)' -> 600"):
        states.check_resume(changed, state)
    with pytest.raises(specs.SpecError, match=r"grid.mu: '\(unset\)' -> \[0.3\]"):  # a free mapping's key: a change
        states.check_resume(specs.load(scratch(), ["grid.mu=[0.3]"]), state)


def test_a_resume_whose_result_changing_variables_differ_is_refused_naming_them(scratch, tmp_path, run_main,
                                                                                monkeypatch):
    """A probe's case: a sweep started with PROMPRUNE_TESTBED_WEIGHTS (other weights of testbed:llava), then a bare
    `--resume` from a shell without it, exit 0, no note: the resumed trials ran the shipped weights with the mu
    calibrated on the other ones, and the state's command lost the variable. Now refused before any work, each
    variable named with both values and the command that resumes with the recorded ones; the state is not
    rewritten. Variables that change no result (PROMPRUNE_GRAPHS, a wait) and values the code reads alike
    (RETRAIN=no and unset) resume."""
    path = scratch()
    spec = specs.load(path)
    for name in ("PROMPRUNE_TESTBED_WEIGHTS", "PROMPRUNE_ENTROPY", "PROMPRUNE_TESTBED_RETRAIN", "PROMPRUNE_GRAPHS"):
        monkeypatch.delenv(name, raising=False)
    storage = tmp_path / "outputs" / "tune"
    started = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PROMPRUNE_TESTBED_WEIGHTS": "/x/w2",
               "PROMPRUNE_TESTBED_RETRAIN": "no"}
    parent = tracking.start_sweep(tracking.client(), spec.name, spec.version, specs.dump_resolved(spec), {})
    _state_for(spec, storage, "rel-20261122-000003", parent,
               command=states.launch_command(str(path), [], environ=started))
    saved = (storage / states.STATE_DIR / "rel-20261122-000003.json").read_bytes()
    proc, _ = run_main("--config", str(path), "--resume")
    assert_clean_error(proc, "--resume rel-20261122-000003: 1 problem(s)",
                       "PROMPRUNE_TESTBED_WEIGHTS was '/x/w2', now unset",
                       "Resume with the recorded values: MLFLOW_TRACKING_URI=",
                       "PROMPRUNE_TESTBED_RETRAIN=no PROMPRUNE_TESTBED_WEIGHTS=/x/w2 python ")
    assert "PROMPRUNE_TESTBED_RETRAIN was" not in proc.stderr  # 'no' and unset: the shipped weights alike
    assert (storage / states.STATE_DIR / "rel-20261122-000003.json").read_bytes() == saved
    proc, _ = run_main("--config", str(path), "--resume", env={"PROMPRUNE_ENTROPY": "exact"})
    assert_clean_error(proc, "PROMPRUNE_TESTBED_WEIGHTS was '/x/w2', now unset; PROMPRUNE_ENTROPY was unset, now "
                             "'exact'", "Resume with the recorded values: unset PROMPRUNE_ENTROPY, then ")
    monkeypatch.delenv("PROMPRUNE_ENTROPY")
    proc, _ = run_main("--config", str(path), "--resume", "--validate-only",
                       env={"PROMPRUNE_TESTBED_WEIGHTS": "/x/w2", "PROMPRUNE_GRAPHS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (storage / states.STATE_DIR / "rel-20261122-000003.json").read_bytes() == saved
    # code of 2026-12-06 / 07 recorded env {} for a run not submitted as a ray job, whatever it had set: not
    # recorded (a reviewer's case: refused, with advice to unset the run's own weights), unlike a ray job's {}
    old = {"experiment": "rel-1", "command": {"argv": ["python"], "env": {}, "ray_job": False}}
    states.check_environment_unchanged(old, {"PROMPRUNE_TESTBED_WEIGHTS": "/x/w2"})
    with pytest.raises(specs.SpecError, match="PROMPRUNE_TESTBED_WEIGHTS was unset, now '/x/w2'"):
        states.check_environment_unchanged({**old, "command": {**old["command"], "ray_job": True}},
                                           {"PROMPRUNE_TESTBED_WEIGHTS": "/x/w2"})
    from pipelines import environment

    # the spec's own plugins, which `plugins.activate` adds to the checking process's environment, are no difference
    assert environment.result_changes({"PROMPRUNE_PLUGINS": "/a"}, {"PROMPRUNE_PLUGINS": "/a:/s/p.py"},
                                      {"PROMPRUNE_PLUGINS": ["/s/p.py"]}) == []
    assert environment.result_changes({}, {"PROMPRUNE_PLUGINS": "/b", "PROMPRUNE_ACCEL": "1"}) == [
        ("PROMPRUNE_PLUGINS", None, "/b")]


def test_a_resume_compares_task_directories_as_the_directories_they_name(tmp_path, monkeypatch):
    """A probe's case: a run started with PROMPRUNE_INCLUDE_PATH=./tasks was refused on a --resume that named the
    same directory otherwise (its absolute path, a trailing slash, a/../tasks): the values were compared as strings.
    Now each entry is the directory it names (os.path.realpath), a relative one against the working directory the
    run's state records (`launch_command`'s ``cwd``, not kept for a Ray job, whose working directory is Ray's package
    copy); a state that recorded none compares a relative entry only with another relative one, from here. Another
    directory, or ./tasks from another folder, is still refused. PROMPRUNE_PLUGINS stays as written: its entries may be
    module names."""
    from pipelines import environment, paths

    name = "PROMPRUNE_INCLUDE_PATH"
    (tmp_path / "tasks").mkdir()
    (tmp_path / "a" / "tasks").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)
    for key in environment.RESULT_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    tasks = str(tmp_path / "tasks")

    # through the run's state (refused on the old code: the strings differ); the command keeps the working directory
    # outside a Ray job, not in one
    started = states.launch_command("sweeps/quickstart.yaml", [], environ={name: "./tasks"})
    state = {"experiment": "rel-1", "command": started}
    states.check_environment_unchanged(state, {name: tasks + "/"})
    states.check_environment_unchanged(state, {name: "a/../tasks"})
    assert started["cwd"] == str(tmp_path)
    assert states.launch_command("sweeps/quickstart.yaml", [], environ={paths.JOB_ENV: "{}"})["cwd"] is None
    monkeypatch.chdir(tmp_path / "a")
    states.check_environment_unchanged(state, {name: "../tasks"})
    with pytest.raises(specs.SpecError) as refused:  # ./tasks there and ./tasks here: two directories, named
        states.check_environment_unchanged(state, {name: "./tasks"})
    assert f"{name} was './tasks' (in {tmp_path}), now './tasks' (in {tmp_path / 'a'})" in str(refused.value)
    monkeypatch.chdir(tmp_path)

    def changes(was, now, cwd, own=None):
        return environment.result_changes({name: was}, {name: now}, own, cwd)

    for now in (tasks, tasks + "/", "tasks/", "./a/../tasks", "link", f"{tmp_path}/a/../tasks", f"::{tasks}:"):
        assert changes("./tasks", now, str(tmp_path)) == [], now
    for now in (tasks + "/", f"{tmp_path}/a/../tasks", f"{tmp_path}/link", f"::{tasks}:"):  # absolute: no cwd needed
        assert changes(tasks, now, None) == [], now
    for now in ("a/tasks", str(tmp_path / "a" / "tasks"), f"{tasks}:{tmp_path / 'a' / 'tasks'}"):
        assert changes("./tasks", now, str(tmp_path)) == [(name, "./tasks", now)], now
    assert changes(f"{tasks}:a/tasks", f"a/tasks:{tasks}", str(tmp_path))  # lmms-eval's order: a difference
    # no cwd recorded (a Ray job's, or a state of earlier code): relative ones alike from here, never an absolute one
    assert changes("./tasks", "tasks/", None) == [] and changes("tasks", "a/../link", None) == []
    assert changes("./tasks", tasks, None) == [(name, "./tasks", tasks)]
    assert changes(tasks, "./tasks", None) == [(name, tasks, "./tasks")]
    assert changes(tasks + "/", f"{tmp_path}/link", None) == []
    # the spec's own include_path (absolute, `pipelines.plugins.activate` adds it): no difference, however written
    own = {name: [str(tmp_path / "a" / "tasks")]}
    assert changes("./tasks", f"tasks:{tmp_path}/a/tasks/", str(tmp_path), own) == []
    # the run's cwd elsewhere: ./tasks there is another directory than ./tasks here
    monkeypatch.chdir(tmp_path / "a")
    assert changes("./tasks", "./tasks", str(tmp_path)) == [(name, "./tasks", "./tasks")]
    assert changes("./tasks", "../tasks", str(tmp_path)) == [] and changes("./tasks", tasks, str(tmp_path)) == []
    monkeypatch.chdir(tmp_path)
    # PROMPRUNE_PLUGINS: module names or paths, compared as written
    assert environment.result_changes({"PROMPRUNE_PLUGINS": "./p.py"}, {"PROMPRUNE_PLUGINS": str(tmp_path / "p.py")},
                                      None, str(tmp_path)) == [("PROMPRUNE_PLUGINS", "./p.py", str(tmp_path / "p.py"))]


def test_latest_is_the_newest_run_of_this_spec_not_a_quick_check_of_its_file(scratch, tmp_path, run_main):
    """A probe's case: a `--set limit=40` run interrupted, then a `--set limit=1` quick check of the same spec file
    finished, then `--set limit=40 --resume` was refused ("limit: 1 -> 40") with the command resuming the finished
    quick check, the interrupted run never named. Now 'latest' is the newest run started with this resolved spec,
    passing over newer finished runs of another; a newer unfinished one is refused with its resume command."""
    path = scratch()
    storage = tmp_path / "outputs" / "tune"
    client = tracking.client()
    ran = {}
    for experiment, limit, finished in [("rel-20261122-000010", 40, False), ("rel-20261122-000011", 1, True)]:
        spec = specs.load(path, [f"limit={limit}"])
        parent = tracking.start_sweep(client, spec.name, spec.version, specs.dump_resolved(spec), {})
        if finished:
            client.log_metric(parent, mlflow_layout.TRIALS_FAILED, 0)
            tracking.finish(client, parent)
        ran[limit] = _state_for(spec, storage, experiment, parent,
                                command=states.launch_command(str(path), [f"limit={limit}"], environ={}))
    assert states.resumed_state(specs.load(path, ["limit=40"]), "latest")["experiment"] == "rel-20261122-000010"
    assert states.resumed_state(specs.load(path, ["limit=1"]), "latest")["experiment"] == "rel-20261122-000011"
    # a resume that left out the interrupted run's --set (a reviewer's case: the first fix passed over the newer
    # unfinished run and took an older finished one, "nothing to resume") is refused naming it and its command
    proc, _ = run_main("--config", str(path), "--set", "limit=30", "--resume")
    assert_clean_error(proc, "--resume rel-20261122-000010", "limit: 40 -> 30",
                       "sweep.py --config spec.yaml --set limit=40 --resume rel-20261122-000010")
    assert "rel-20261122-000011" not in proc.stderr  # it finished: nothing to resume there
    proc, _ = run_main("--config", str(path), "--set", "limit=40", "--resume", "--validate-only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client.log_metric(ran[40]["parent_run_id"], mlflow_layout.TRIALS_FAILED, 0)
    tracking.finish(client, ran[40]["parent_run_id"])  # every run finished, none of this spec: the newest differs
    proc, _ = run_main("--config", str(path), "--set", "limit=30", "--resume")
    assert_clean_error(proc, "--resume: no run of sweep 'rel' was started with this spec; the newest, "
                             "rel-20261122-000011, differs: 1 problem(s)", "limit: 1 -> 30",
                       "every run of this sweep finished")


def test_a_resume_on_other_testbed_weights_than_the_runs_is_refused(scratch, tmp_path, monkeypatch):
    """The state keeps the sha256 of testbed:llava's weights (their manifest's) beside the mu it calibrated on them: a
    resume that would load other weights (the shipped ones changed by a pull, a $PROMPRUNE_TESTBED_WEIGHTS folder
    rewritten in place; the variable's own change is `check_environment_unchanged`'s) is refused, naming both."""
    monkeypatch.delenv("PROMPRUNE_TESTBED_WEIGHTS", raising=False)
    monkeypatch.delenv("PROMPRUNE_TESTBED_RETRAIN", raising=False)
    spec = specs.load(scratch(), ["model.pretrained=testbed:llava"])
    shipped_dir = states.REPO / "promprune" / "testbed" / "weights"
    shipped_sha = json.loads((shipped_dir / "testbed-llava.json").read_text())["sha256"]
    assert states.weights_sha256(spec) == shipped_sha
    assert states.weights_sha256(specs.load(scratch())) is None  # tiny:llava: no cheap handle, nothing recorded
    state = _state_for(spec, tmp_path / "store", "rel-7", weights_sha256=shipped_sha)
    states.check_resume(spec, state)  # the same weights
    other = tmp_path / "w2"
    other.mkdir()
    (other / "testbed-llava.json").write_text(json.dumps({"sha256": "f" * 64}))  # the manifest is what is read
    monkeypatch.setenv("PROMPRUNE_TESTBED_WEIGHTS", str(other))  # (the state recorded no environment: not that check)
    with pytest.raises(specs.SpecError, match=f"testbed:llava weights with sha256 {shipped_sha}, .* this resume "
                                              f"would load weights with sha256 {'f' * 64}"):
        states.check_resume(spec, state)
