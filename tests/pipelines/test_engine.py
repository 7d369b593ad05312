"""The evaluation engine at cluster scale, on real Ray: a sweep that grows with an autoscaling cluster, a block that
kills its actor or hangs, and a driver killed mid-trial whose sweep resumes without losing finished blocks."""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from pipelines import spec as specs
from pipelines import sweep, timeline
from pipelines.config import Resources
from pipelines.recording import tracking
from pipelines.run import resources as planning
from pipelines.run.fake_cluster import FakeAutoscalingCluster, worker_nodes
from pipelines.run.ray_connect import init_local, worker_env
from pipelines.run.requests import build_rows

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture
def workdir(tmp_path, monkeypatch, mlflow_db):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return tmp_path


# ----------------------------------------------------------------------------------------------------------------
# elastic: the sweep grows with the cluster


def test_a_sweep_grows_with_an_autoscaling_cluster(workdir, monkeypatch):
    """Ray's fake autoscaler: GPU worker nodes ({"CPU": 1, "GPU": 1}), min 0, max 3, none up at the start. Six trials
    of six blocks lease the sweep's workers; pending workers are the demand; the cluster grows to three nodes, the
    workers on the late nodes take blocks as they come up, every sample comes back once, and once the sweep is done
    nothing asks for nodes any more: the idle nodes go."""
    from benchmarks.sweep_scaling import Costs, stand_in_run, stand_in_source

    cluster = FakeAutoscalingCluster(workdir / "cluster", max_workers=3, idle_timeout_s=2)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)  # a driver on the head's machine finds it in the head's dir
    with cluster:
        ray.init(address=cluster.address, runtime_env=worker_env(), log_to_driver=False)
        try:
            assert worker_nodes() == []
            assert planning.autoscaler_offers_gpus() is True  # no GPU yet, but its node types offer them: device gpu
            (workdir / "loads").mkdir()
            spec = specs.parse({
                "name": "elastic", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
                "limit": 6, "baseline": False, "grid": {"method": ["promprune", "divprune", "vispruner"],
                                                         "budget": [8, 4]},
                "generation": {"max_new_tokens": 1},
                "resources": {"batch_size": 1, "actor_wait_s": 300}, "tune": {"max_failures": 0}})
            spec.model = stand_in_source(Costs(load_s=0.0, sample_s=1.0), str(workdir / "loads"))
            # without image keys each question is a block of its own (easy-vqa asks several about one image)
            rows = [dataclasses.replace(r, image_key=None) for r in build_rows(spec.tasks, spec.limit, spec.generation)]
            outcome = sweep.run_sweep(spec, rows=rows, run_fn=functools.partial(stand_in_run, sample_s=1.0))
            assert outcome.failed == [] and len(outcome.records) == 6
            nodes = set()
            for rec in outcome.records.values():
                frame = rec["predictions"].to_pandas()
                assert sorted(frame["doc_id"]) == list(range(6))  # every sample once (assemble checks it too)
                nodes |= set(frame["node"])
            assert len(nodes) >= 3, f"predictions came from {len(nodes)} node(s)"
            deadline = time.monotonic() + 90  # idle nodes leave once nothing is pending
            while worker_nodes() and time.monotonic() < deadline:
                time.sleep(1)
            assert worker_nodes() == [], "worker nodes stayed up: some demand outlived the sweep"
        finally:
            ray.shutdown()


# ----------------------------------------------------------------------------------------------------------------
# failover: a block that kills its actor, a block that hangs


@pytest.fixture(scope="module")
def local_ray():
    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def deadly_run(vlm, rows, batch_size, *, poison: int, marker_dir: str, how: str):
    """The real model, except that the request with doc_id ``poison`` kills its actor (``how`` "exit": a segfault or
    an exhausted host; "hang": a deadlock) and leaves a marker per attempt."""
    from promprune.eval import run_requests

    if any(r.doc_id == poison for r in rows):
        Path(marker_dir, f"attempt-{time.monotonic_ns()}").touch()
        if how == "exit":
            os._exit(11)
        time.sleep(3600)
    return run_requests(vlm, rows, batch_size=batch_size)


def test_a_ray_this_process_started_has_no_autoscaler_to_ask(local_ray, monkeypatch):
    """`ray.init`'s own head takes no autoscaling config, so the planner does not run a task on the head to read its
    monitor (the fake autoscaler's cluster, joined at an address, is asked: test above)."""
    def no_task(*args, **kwargs):
        raise AssertionError("a task was sent to read the monitor of a Ray this process started")

    monkeypatch.setattr(planning.ray, "remote", no_task)
    assert planning.started_here() and planning.autoscaler_offers_gpus() is False


@pytest.mark.parametrize("resources,fix", [
    (Resources(device="gpu"), r"set resources.device: cpu or auto \(with resources.cpus_per_worker at most 2\)"),
    (Resources(device="cpu", cpus_per_worker=64), r"lower resources.cpus_per_worker to at most 2"),
])
def test_an_actor_the_ray_started_here_cannot_hold_is_refused_at_once(local_ray, resources, fix):
    """No node joins the Ray this process started: a GPU actor on a machine without one waited actor_wait_s (600 s)
    for nothing, an actor of 64 CPUs hung without a word; both are NoCapacity at once, naming the fix."""
    start = time.monotonic()
    plan = planning.plan(resources, 1, 1)
    with pytest.raises(planning.NoCapacity, match=r"the Ray this sweep started on this machine has 0 GPU\(s\) and "
                                                  r"2 CPU\(s\), where no other node will join it: " + fix):
        planning.Capacity(plan)
    assert time.monotonic() - start < 10
    assert planning.Capacity(planning.plan(Resources(device="cpu"), 1, 1)).probe is None  # it fits: nothing asked


def test_a_pool_started_before_the_blocks_takes_the_plan_made_with_them(local_ray):
    """The sweep starts its workers from the plan made before its blocks are built (`_run_sweep`) and hands the pool
    the plan made with them: the pool's size follows it; a plan placing workers otherwise is refused, naming both."""
    from pipelines.config import Resources
    from pipelines.run.workers import Failover, WorkerPool
    from pipelines.weights import ModelSource

    before = planning.plan(Resources(), 4, 1, 1, cluster={"CPU": 4}, can_add_gpus=False)
    after = planning.plan(Resources(), 4, 6, 2, cluster={"CPU": 4}, can_add_gpus=False)
    assert (before.pool_size, after.pool_size) == (1, 4)
    pool = WorkerPool(ModelSource("tiny:llava"), before, 1, Failover())
    try:
        assert pool.state()["pool_size"] == 1
        pool.replan(after)
        assert pool.state()["pool_size"] == 4 and pool.plan == after
        with pytest.raises(ValueError, match=r"cpu:1 workers cannot take a plan of cpu:2"):
            pool.replan(dataclasses.replace(after, cpus=2.0))
    finally:
        pool.close()


# "hang" (the watchdog's path) is in the long tier (pyproject's markers): "exit" runs the same recording of failed
# samples in CI
@pytest.mark.parametrize("how", ["exit", pytest.param("hang", marks=pytest.mark.long)])
def test_a_block_that_kills_or_hangs_its_actor_becomes_failed_samples(local_ray, workdir, how):
    markers = workdir / "markers"
    markers.mkdir()
    spec = specs.parse({
        "name": f"poison-{how}", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 4, "baseline": False, "grid": {"method": ["divprune"], "budget": [4]},
        "generation": {"max_new_tokens": 1},
        # the watchdog's 8 s only where a hang is what it ends: a busy machine's healthy first block can take longer
        "resources": {"batch_size": 1, "block_attempts": 2, "block_timeout_s": 8 if how == "hang" else 300}})
    # without image keys every request is a block of its own (easy-vqa asks several questions about one image,
    # and the questions about one image share a block)
    rows = [dataclasses.replace(r, image_key=None) for r in build_rows(spec.tasks, spec.limit, spec.generation)]
    poison = 2
    started = time.monotonic()
    outcome = sweep.run_sweep(spec, rows=rows, run_fn=functools.partial(
        deadly_run, poison=poison, marker_dir=str(markers), how=how))
    assert time.monotonic() - started < 600  # the sweep ends
    assert len(list(markers.iterdir())) == 2  # block_attempts tries of the poison block, no more
    assert outcome.failed == []  # the trial finished
    frame = outcome.records["divprune-b4"]["predictions"].to_pandas().set_index("doc_id")
    assert sorted(frame.index) == [0, 1, 2, 3]
    assert "died or hung" in frame.loc[poison, "error"] and "resources.block_attempts" in frame.loc[poison, "error"]
    assert frame.drop(index=poison)["error"].isna().all()  # the other blocks were not charged for it
    run = tracking.trial_runs(tracking.client(), outcome.parent_run_id)["divprune-b4"]
    assert run.data.metrics["samples/failed"] == 1


def pool_killing_run(vlm, rows, batch_size, *, marker: str, log: str, doc: int | None = 1):
    """The real model, writing one line per sample it generates; the block with doc_id ``doc`` (None: the first
    block) kills the sweep's `Pool` actor (`ray.kill` on its named handle), once (``marker``), after answering."""
    from promprune.eval import run_requests

    preds = run_requests(vlm, rows, batch_size=batch_size)
    with open(log, "a") as f:
        f.writelines(f"{r.doc_id}\n" for r in rows)
    if (doc is None or any(r.doc_id == doc for r in rows)) and not os.path.exists(marker):
        Path(marker).touch()
        pools = [n for n in ray.util.list_named_actors() if n.startswith("promprune-pool/")]
        assert len(pools) == 1, pools
        ray.kill(ray.get_actor(pools[0]))
    return preds


def test_a_dead_pool_stops_the_sweep_resumable_and_charges_no_trial(local_ray, workdir):
    """The sweep's `Pool` actor killed mid-trial: the sweep stops with one paragraph naming it and the resume command
    (`PoolLost`: exit 2 from the CLI), the trial is not failed (no FAILED run in MLflow, its saved blocks kept), and
    the resume answers only the samples with no saved block. (It failed every remaining trial and retry with Ray's
    generic "The actor is dead" error, exit 1.)"""
    from pipelines.run import checkpoints
    from pipelines.run.pool_watch import PoolLost
    from pipelines.run.state import load_state, storage_root

    spec, rows = _one_divprune_trial("poolkill")
    log = workdir / "generated"
    run_fn = functools.partial(pool_killing_run, marker=str(workdir / "killed"), log=str(log))
    with pytest.raises(PoolLost) as stopped:
        sweep.run_sweep(spec, rows=rows, run_fn=run_fn)
    text = str(stopped.value)
    assert "worker pool lost: the sweep's Pool actor" in text and "died" in text, text
    assert "no trial was charged" in text and "--resume" in text, text
    first = [int(x) for x in log.read_text().split()]
    assert 1 in first and len(first) < 6  # killed mid-trial: some blocks were never asked for
    state = load_state(storage_root(spec), spec.name, "latest")
    runs = tracking.latest_trial_runs(tracking.client(), state["parent_run_id"])
    assert {tid: r.info.status for tid, r in runs.items()} in ({}, {"divprune-b4": "KILLED"})  # not FAILED
    experiment = state["experiment"]
    assert checkpoints.saved_samples(checkpoints.sweep_dir(storage_root(spec), experiment), "divprune-b4") > 0

    log.unlink()
    outcome = sweep.run_sweep(spec, rows=rows, run_fn=run_fn, resume="latest")
    assert outcome.failed == []
    frame = outcome.records["divprune-b4"]["predictions"].to_pandas()
    assert sorted(frame["doc_id"]) == list(range(6)) and frame["error"].isna().all()
    again = [int(x) for x in log.read_text().split()]
    assert len(first) + len(again) <= 6 + 2  # at most the blocks in flight at the kill (two workers) answered twice
    assert set(first) | set(again) == set(range(6))


def stalling_run(vlm, rows, batch_size, *, marker: str):
    """The real model for doc_ids 0 and 1; a block with a later one leaves ``marker`` and never answers (the test
    stops the sweep meanwhile, so that it stops with blocks saved and blocks to do)."""
    from promprune.eval import run_requests

    if any(r.doc_id >= 2 for r in rows):
        Path(marker).touch()
        time.sleep(3600)
    return run_requests(vlm, rows, batch_size=batch_size)


def _as_saved_before_the_watch(storage: Path) -> None:
    """Rewrite each Tune experiment's saved state under ``storage`` as a sweep started before the pool watch existed
    saved it: its callbacks and stopper without `pool_watch.PoolWatch` (`Tuner.restore` takes its callbacks from
    there)."""
    import pickle

    from pipelines.run.disk import DiskWatch
    from pipelines.run.pool_watch import PoolWatch

    pickles = list(storage.rglob("tuner.pkl"))
    assert pickles
    for path in pickles:
        state = pickle.loads(path.read_bytes())
        config = state["_run_config"]
        assert any(isinstance(s, PoolWatch) for s in config.stop._stoppers)
        config.callbacks = [c for c in config.callbacks if not isinstance(c, PoolWatch)]
        config.stop = next(c for c in config.callbacks if isinstance(c, DiskWatch))
        path.write_bytes(pickle.dumps(state))


def test_a_resumed_sweep_saved_without_the_watch_is_watched(local_ray, workdir):
    """A sweep whose saved Tune state has no pool watch among its callbacks (started before the watch existed;
    `Tuner.restore` restores the saved callbacks, and takes none) is resumed, and its `Pool` actor is killed
    mid-trial: the resume stops as a fresh sweep does (`PoolLost`, the resume command), the trial not failed. (The
    resumed sweep ran unwatched: the trial waited for a stop that never came, then failed on the dead pool.)"""
    import threading

    from pipelines.run import disk
    from pipelines.run.pool_watch import PoolLost
    from pipelines.run.state import load_state, storage_root

    spec, rows = _one_divprune_trial("poolresume")
    stalled = workdir / "stalled"

    def stop_tune():  # Ctrl-C's stop, once a block stalls (Tune's handler, in this process's main thread)
        while not stalled.exists():
            time.sleep(0.2)
        while not disk.interrupt_tune():
            time.sleep(0.2)

    stopper = threading.Thread(target=stop_tune, daemon=True)
    stopper.start()
    with pytest.raises(sweep.SweepInterrupted):
        sweep.run_sweep(spec, rows=rows, run_fn=functools.partial(stalling_run, marker=str(stalled)))
    stopper.join(timeout=10)
    _as_saved_before_the_watch(Path(storage_root(spec)))

    log = workdir / "generated"
    run_fn = functools.partial(pool_killing_run, marker=str(workdir / "killed"), log=str(log), doc=None)
    started = time.monotonic()
    with pytest.raises(PoolLost) as lost:
        sweep.run_sweep(spec, rows=rows, run_fn=run_fn, resume="latest")
    assert time.monotonic() - started < 300
    text = str(lost.value)
    assert "worker pool lost: the sweep's Pool actor" in text and "--resume" in text, text
    state = load_state(storage_root(spec), spec.name, "latest")
    runs = tracking.latest_trial_runs(tracking.client(), state["parent_run_id"])
    assert {tid: r.info.status for tid, r in runs.items()} in ({}, {"divprune-b4": "KILLED"})  # not FAILED


def freezing_run(vlm, rows, batch_size, *, poison: int, marker: str):
    """The real model, except that the request with doc_id ``poison`` freezes its worker (SIGSTOP: its watchdog
    thread frozen with it), once (``marker``)."""
    from promprune.eval import run_requests

    if any(r.doc_id == poison for r in rows) and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGSTOP)
    return run_requests(vlm, rows, batch_size=batch_size)


def test_a_frozen_worker_is_killed_by_the_trial_and_its_block_retried(local_ray, workdir):
    """A worker frozen mid-block (SIGSTOP) cannot end itself: its watchdog is a thread of it. The trial kills it
    once the block is outstanding past resources.block_timeout_s plus `engine.FROZEN_MARGIN_S`, with a line saying
    so; Ray restarts it and sends the block again, and the trial finishes with every sample answered (it hung for
    ever)."""
    from pipelines.run.engine import FROZEN_MARGIN_S

    marker = workdir / "frozen"
    spec = specs.parse({
        "name": "frozen", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 3, "baseline": False, "grid": {"method": ["divprune"], "budget": [4]},
        "generation": {"max_new_tokens": 1}, "resources": {"batch_size": 1, "block_timeout_s": 8}})
    rows = [dataclasses.replace(r, image_key=None) for r in build_rows(spec.tasks, spec.limit, spec.generation)]
    started = time.monotonic()
    outcome = sweep.run_sweep(spec, rows=rows, run_fn=functools.partial(freezing_run, poison=1, marker=str(marker)))
    assert marker.exists()  # the worker did freeze
    assert time.monotonic() - started > 8 + FROZEN_MARGIN_S  # ended by the trial's deadline, not before
    assert outcome.failed == []
    frame = outcome.records["divprune-b4"]["predictions"].to_pandas()
    assert sorted(frame["doc_id"]) == [0, 1, 2] and frame["error"].isna().all()
    # the line is the trial's output: the sweep's log (the console with --verbose); here, Ray's log of the trial
    logs = Path(ray._private.worker._global_node.get_session_dir_path(), "logs")
    said = "".join(p.read_text(errors="replace") for p in logs.glob("worker-*.out"))
    assert "[hung] divprune-b4: block " in said and "its worker frozen or stuck" in said


def slow_reload_source(loads: str, slow_s: float):
    """tiny:llava, each load leaving a file in ``loads``; the first two (the pool's first workers) load at once, the
    next two (Ray's restarts of them) after ``slow_s`` (a 7B model read again from a slow disk), any later at once.
    Defined here so cloudpickle ships it by value."""
    from dataclasses import dataclass

    from pipelines.weights import ModelSource

    @dataclass
    class SlowReload(ModelSource):
        loads: str = ""
        slow_s: float = 0.0

        def load(self, **kwargs):
            n = len(os.listdir(self.loads)) + 1
            Path(self.loads, f"{n}-{os.getpid()}").touch()
            if n in (3, 4):
                time.sleep(self.slow_s)
            return super().load(**kwargs)

    return SlowReload("tiny:llava", loads=loads, slow_s=slow_s)


def dying_or_freezing_run(vlm, rows, batch_size, *, markers: str):
    """The real model, except that on its first attempt the block of doc_id 1 exits its worker (a segfault) and the
    block of doc_id 2 freezes it (SIGSTOP)."""
    from promprune.eval import run_requests

    for doc, how in ((1, "exit"), (2, "stop")):
        marker = Path(markers, how)
        if any(r.doc_id == doc for r in rows) and not marker.exists():
            marker.touch()
            if how == "exit":
                os._exit(11)
            os.kill(os.getpid(), signal.SIGSTOP)
    return run_requests(vlm, rows, batch_size=batch_size)


def test_a_restarted_worker_loading_slowly_is_not_taken_for_a_frozen_one(local_ray, workdir, monkeypatch):
    """The trial's frozen-worker clock (block_timeout_s + `engine.FROZEN_MARGIN_S`, here 20 + 2 s) counts only the
    time a worker is ready to work. A worker that died on a block (doc 1) and whose restart loads its model for 40 s is
    left to load, and so is the restart of the worker frozen on doc 2 (SIGSTOP), which is killed once, past 22 s: four
    loads in all (two workers, two restarts), every sample answered. (The clock counted the reloads: each slow restart
    was killed mid-load as frozen and loaded again, six loads.)"""
    from pipelines.run import engine
    from pipelines.run.trial import alone, predict

    monkeypatch.setattr(engine, "FROZEN_MARGIN_S", 2.0)  # the trial's loop runs here, in this process
    loads, markers = workdir / "loads", workdir / "markers"
    loads.mkdir()
    markers.mkdir()
    spec = specs.parse({
        "name": "reload", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 3, "baseline": False, "grid": {"method": ["divprune"], "budget": [4]},
        "generation": {"max_new_tokens": 1}, "resources": {"batch_size": 1, "block_timeout_s": 20}})
    spec.model = slow_reload_source(str(loads), slow_s=40.0)
    rows = [dataclasses.replace(r, image_key=None) for r in build_rows(spec.tasks, spec.limit, spec.generation)]
    with alone(spec, rows, run_fn=functools.partial(dying_or_freezing_run, markers=str(markers))) as shared:
        assert shared.plan.max_actors == 2
        preds = predict(specs.Trial("divprune", 4), shared).to_pandas()
    assert sorted(os.listdir(markers)) == ["exit", "stop"]  # the worker did die, and the other froze
    assert sorted(preds["doc_id"]) == [0, 1, 2] and preds["error"].isna().all()
    assert len(os.listdir(loads)) == 4, sorted(os.listdir(loads))


# ----------------------------------------------------------------------------------------------------------------
# nothing finished is lost: SIGKILL of the driver, then --resume


def _answered(folder: Path) -> int:
    """Samples the actors generated, over every run that wrote this timeline folder."""
    return sum(e.get("rows", 0) for e in timeline.read(folder) if e["event"] == "predict_end")


def test_a_killed_driver_resumes_from_its_saved_blocks(workdir):
    """The driver's whole process group (the driver, its local Ray, the trial and the actors) killed with SIGKILL
    mid-trial; `--resume` then generates only the blocks that were not saved: over both runs, at most the samples
    plus one block per actor (the blocks in flight at the kill), one MLflow run for the trial, every sample once."""
    import tempfile

    limit = 64
    spec_path = workdir / "kill.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "kill", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": limit, "baseline": False, "grid": {"method": ["divprune"], "budget": [4]},
        "generation": {"max_new_tokens": 16}, "resources": {"batch_size": 1}}))
    events = workdir / "events"
    events.mkdir()
    raytmp = tempfile.mkdtemp(prefix="rk-", dir="/tmp")  # AF_UNIX socket paths must stay under 108 bytes
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}", timeline.ENV: str(events),
           "RAY_TMPDIR": raytmp, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", str(spec_path)]
    first = subprocess.Popen(cmd, cwd=workdir, env=env, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    saved = str(workdir / "outputs" / "tune" / "_promprune_blocks" / "kill-*" / "*" / "*.parquet")
    deadline = time.monotonic() + 300
    while len(glob.glob(saved)) < 3 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.1)
    if first.poll() is not None:
        pytest.fail(f"the sweep ended before the kill:\n{first.stdout.read()[-3000:]}")
    os.killpg(first.pid, signal.SIGKILL)  # the driver and everything it started: no cleanup, no Ctrl-C
    first.wait(timeout=60)
    time.sleep(5)  # Ray's worker processes (the trial, the actors) outlive their raylet by a moment
    import pyarrow.parquet as pq

    done_before = sum(pq.read_metadata(p).num_rows for p in glob.glob(saved))
    assert 0 < done_before < limit, f"the kill must land mid-trial ({done_before} of {limit} samples saved)"
    resumed_events = workdir / "events-resumed"
    resumed_events.mkdir()
    env[timeline.ENV] = str(resumed_events)
    second = subprocess.run(cmd + ["--resume"], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert f"[resume] divprune-b4: {done_before} of {limit} samples already done" in out, out[-3000:]
    block = max(e.get("rows", 0) for e in timeline.read(events) if e["event"] == "predict_end")
    generated = _answered(events) + _answered(resumed_events)
    actors = 2  # the CPU plan on this machine's two cores
    assert generated <= limit + actors * block, f"{generated} samples generated for {limit}"
    assert _answered(resumed_events) == limit - done_before  # the resumed run redid nothing it had saved

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    parents = c.search_runs([c.get_experiment_by_name("promprune").experiment_id],
                            filter_string="tags.`promprune.role` = 'sweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = tracking.trial_runs(c, parents[0].info.run_id)
    assert list(children) == ["divprune-b4"]  # one run for the trial
    artifact = Path(c.download_artifacts(children["divprune-b4"].info.run_id, "predictions.parquet", str(workdir)))
    import pandas as pd

    frame = pd.read_parquet(artifact)
    assert sorted(frame["doc_id"]) == list(range(limit)) and frame["error"].isna().all()  # every sample once


def test_a_load_that_hangs_past_the_allowance_counts_toward_the_frozen_clock():
    """`Pool.ready_for` hides a worker's model load from the frozen-worker clock only for `LOAD_ALLOWANCE_S`: a worker
    100 s into its load with a 60 s allowance has been 'ready' 40 s (so a load stuck for good is killed in the end);
    within the allowance it reads 0; once loaded, the time since. The plain class, no actor: the arithmetic alone."""
    import time

    from pipelines.run import pool as pool_module

    pool = pool_module.Pool.__new__(pool_module.Pool)
    pool.ids, pool.loads = {0: "actor-a", 1: "actor-b"}, {}
    pool.loads["actor-a"] = (time.monotonic() - 100.0, None)  # loading for 100 s
    assert pool.ready_for(0, load_allowance_s=60.0) == pytest.approx(40.0, abs=1.0)
    assert pool.ready_for(0, load_allowance_s=1800.0) == 0.0
    assert pool.ready_for(0) == 0.0 and pool_module.LOAD_ALLOWANCE_S >= 600  # a real checkpoint's load fits
    pool.load_allowance_s = 60.0  # resources.load_timeout_s, the pool's own allowance: what a trial's call gets
    assert pool.ready_for(0) == pytest.approx(40.0, abs=1.0)
    pool.load_ended("actor-a")
    assert pool.ready_for(0, load_allowance_s=60.0) == pytest.approx(0.0, abs=1.0)
    assert pool.ready_for(1) is None and pool.ready_for(7) is None  # never said: the block's own clock decides


class _Handle:
    """A stand-in for a worker's actor handle: its Ray actor id is what `Pool.load_began` keys a load by."""

    def __init__(self, actor: str):
        self._actor_id = type("ActorID", (), {"hex": lambda _: actor})()


def test_a_first_load_is_judged_from_when_it_began_and_only_while_it_lasts(monkeypatch):
    """`Pool._judge_loads` on the plain class (no actor, the arithmetic alone), allowance 60 s: a worker 100 s into
    its first load is killed (no restart) and the pool's error names it, how long, the causes and
    resources.load_timeout_s; one 30 s in, one that said it has loaded (its `ready` not read yet) and one that never
    said it began (waiting for a node: the autoscaler's demand) are kept."""
    from pipelines.run import pool as pool_module

    killed = []
    monkeypatch.setattr(pool_module.ray, "kill", lambda worker, no_restart=True: killed.append((worker, no_restart)))
    pool = pool_module.Pool.__new__(pool_module.Pool)
    pool.load_allowance_s, pool.error, pool.loads = 60.0, None, {}
    pool.workers = {w: _Handle(f"actor-{w}") for w in range(4)}
    pool.loading = {w: f"ready-{w}" for w in range(4)}
    now = time.monotonic()
    pool.loads["actor-0"] = (now - 100.0, None)  # stuck
    pool.loads["actor-1"] = (now - 30.0, None)  # loading, within the allowance
    pool.loads["actor-2"] = (now - 100.0, now - 1.0)  # loaded slowly, its `ready` on its way
    # actor-3: pending, never began
    stuck = pool.workers[0]
    pool._judge_loads()
    assert killed == [(stuck, True)]
    assert sorted(pool.workers) == sorted(pool.loading) == [1, 2, 3]
    assert pool.error.startswith("model worker 0 has been loading its model for 100s, past "
                                 "resources.load_timeout_s=60s"), pool.error
    assert "file system" in pool.error and "raise resources.load_timeout_s" in pool.error
    pool.loads["actor-1"] = (now - 61.0, None)  # a second stuck one: killed, the first reason kept
    pool._judge_loads()
    assert len(killed) == 2 and sorted(pool.workers) == [2, 3] and pool.error.startswith("model worker 0 ")


def stuck_load_source(load_s: float):
    """tiny:llava whose load first sleeps ``load_s`` (a stuck file system: for ever, in effect; a slow disk: a
    while). Defined here so cloudpickle ships it by value."""
    from dataclasses import dataclass

    from pipelines.weights import ModelSource

    @dataclass
    class Stuck(ModelSource):
        load_s: float = 0.0

        def load(self, **kwargs):
            time.sleep(self.load_s)
            return super().load(**kwargs)

    return Stuck("tiny:llava", load_s=load_s)


def _stuck_spec(name: str, load_timeout_s: float, tune: dict | None = None, **resources):
    spec = specs.parse({
        "name": name, "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 2, "baseline": False, "grid": {"method": ["divprune"], "budget": [4]},
        "generation": {"max_new_tokens": 1}, "tune": tune or {},
        "resources": {"batch_size": 1, "workers": 1, "load_timeout_s": load_timeout_s, **resources}})
    return spec, [dataclasses.replace(r, image_key=None) for r in build_rows(spec.tasks, spec.limit, spec.generation)]


def test_a_worker_stuck_in_its_first_load_fails_the_trial_instead_of_hanging(local_ray, workdir):
    """A worker whose first model load never ends (a stuck file system) with resources.load_timeout_s: 3: the pool
    ends it once its load has lasted 3 s and the trial fails with the pool's paragraph (`engine.WorkersFailed`),
    within seconds. (Before: the worker stayed in the pool's loading set, no worker was granted and no block was in
    flight for the trial's frozen-worker clock: the trial waited for ever.)"""
    from pipelines.run.engine import WorkersFailed
    from pipelines.run.trial import alone, predict

    spec, rows = _stuck_spec("stuck", 3)
    spec.model = stuck_load_source(3600.0)  # (3 s may end it still importing torch: loading, as far as it said)
    outcome: dict = {}

    def trial():
        try:
            with alone(spec, rows) as shared:
                outcome["shared"] = shared
                predict(specs.Trial("divprune", 4), shared)
        except Exception as e:  # noqa: BLE001 - what the trial raised, read below
            outcome["error"] = e

    import threading

    started = time.monotonic()
    thread = threading.Thread(target=trial, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the trial still waits for a worker stuck in its first load"
    error = outcome.get("error")
    assert isinstance(error, WorkersFailed), repr(error)
    assert "model worker 0 has been loading its model for " in str(error), str(error)
    assert "resources.load_timeout_s=3s" in str(error) and "raise resources.load_timeout_s" in str(error)
    assert time.monotonic() - started < 60


def test_a_sweep_whose_workers_cannot_load_fails_each_trial_once_without_tune_retries(local_ray, workdir, capsys):
    """The same stuck first load in a sweep with tune.max_failures: 2: the trial fails with the pool's paragraph
    (`engine.WorkersFailed`), which says no trial can run, so Tune does not start it again (`run_trial` reports
    `WORKERS_FAILED` first and the driver's `NotRetried` takes its retries away). Before: Tune started
    it 3 times (a new trial actor each time, each failing on the pool's same error), 3 "Failure # n" entries in
    Tune's error file; the paragraph still reaches the record, MLflow and the console."""
    from pipelines import mlflow_layout

    spec, rows = _stuck_spec("stuck_sweep", 3, share_weights=False,  # (the driver would load published weights)
                             tune={"max_failures": 2, "max_concurrent_trials": 1})
    spec.model = stuck_load_source(3600.0)
    started = time.monotonic()
    outcome = sweep.run_sweep(spec, rows=rows)
    [tid] = outcome.failed
    error = outcome.records[tid]["error"]
    assert "WorkersFailed: the sweep's model workers could not start, so no trial can run" in error, error
    assert "resources.load_timeout_s=3s" in error, error
    [errors] = list(Path(outcome.experiment_path).rglob("error.txt"))
    assert errors.read_text().count("Failure # ") == 1  # started once: no retry (was 3)
    run = tracking.latest_trial_runs(tracking.client(), outcome.parent_run_id)[tid]
    assert run.info.status == "FAILED" and "resources.load_timeout_s=3s" in run.data.tags[mlflow_layout.ERROR]
    assert f"[trial failed] {tid}: " in capsys.readouterr().out
    assert time.monotonic() - started < 240


def test_a_warm_worker_loading_slowly_within_the_allowance_is_kept(local_ray):
    """The driver's warm worker (`WorkerPool.warm`, adopted by the pool) whose load takes 8 s, with an allowance of
    40 s: it comes up and the pool reports no error; the same worker stuck (allowance 3 s) is ended and the pool says
    why (the adopted path of `Pool._judge_loads`)."""
    from pipelines.run.workers import Failover, WorkerPool

    plan = planning.plan(Resources(device="cpu", workers=1, batch_size=1), 1, 1)
    for load_s, allowance, up in ((8.0, 40.0, True), (3600.0, 3.0, False)):
        pool = WorkerPool(stuck_load_source(load_s), plan, 1, Failover(load_timeout_s=allowance))
        try:
            pool.warm(1)
            deadline, members, error = time.monotonic() + 60, [], None
            while time.monotonic() < deadline and not members and not error:
                members, error = ray.get(pool.handle.roster.remote())
                time.sleep(0.5)
            if up:
                assert len(members) == 1 and error is None, error
                assert ray.get(members[0][1].holds.remote())[0] == "tiny:llava"
            else:
                assert members == [] and error and f"resources.load_timeout_s={allowance:g}s" in error, error
                assert pool.state()["workers"] == 0
        finally:
            pool.close()


def _one_divprune_trial(name: str):
    """A one-trial sweep (DivPrune at 4 tokens, 6 easy-vqa questions, one token each, no retries) and its rows."""
    spec = specs.parse({
        "name": name, "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 6, "baseline": False, "grid": {"method": ["divprune"], "budget": [4]},
        "generation": {"max_new_tokens": 1}, "resources": {"batch_size": 1}, "tune": {"max_failures": 0}})
    return spec, [dataclasses.replace(r, image_key=None) for r in build_rows(spec.tasks, spec.limit, spec.generation)]


# ----------------------------------------------------------------------------------------------------------------
# a worker never waits on the trial's bookkeeping


def marking_run(vlm, rows, batch_size, *, folder: str):
    """Answers at once (the stand-in model), leaving a file per block it starts, named by the block's first doc."""
    from benchmarks.sweep_scaling import stand_in_run

    Path(folder, str(rows[0].doc_id)).touch()
    return stand_in_run(vlm, rows, batch_size, sample_s=0.0)


def test_a_freed_worker_takes_its_next_block_before_the_trial_reads_the_last(local_ray, workdir):
    """One worker, three blocks. When a block comes back, the worker is sent the next one before the trial gets the
    answer: while the trial saves it, reports to Tune and maybe scores (a second or more at 10k samples, every 30 s),
    the worker answers the next block. It sat idle through all of that, for every block: in a sweep of 2,000
    samples (tiny:llava, 16 per block, on 2 busy cores) its gaps between blocks were 50-173 ms on average, up to 5.7 s
    while the trial scored, 4.9-7.1% of its time; 24-26 ms, at most 0.5 s, 2.4-3.6% since (at 8,000 samples a
    running score outlasts a block, and the worker still waits for the rest of it)."""
    from pipelines.run import engine
    from pipelines.run.trial import alone

    markers = workdir / "markers"
    markers.mkdir()
    spec = specs.parse({
        "name": "eager", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 3, "baseline": False, "grid": {"method": ["divprune"], "budget": [4]},
        "generation": {"max_new_tokens": 1}, "resources": {"batch_size": 1, "workers": 1}})
    rows = [dataclasses.replace(r, image_key=None) for r in build_rows(spec.tasks, spec.limit, spec.generation)]
    with alone(spec, rows, run_fn=functools.partial(marking_run, folder=str(markers))) as shared:
        assert shared.plan.max_actors == 1
        blocks = engine.stream(shared.rows, specs.Trial("divprune", 4), shared.pool, 1)
        try:
            next(blocks)  # the first block's answer, held here as a trial holds it while it saves and reports
            deadline = time.monotonic() + 60
            while len(os.listdir(markers)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(os.listdir(markers)) == 2, "the worker waited for the trial before its next block"
            assert len(list(blocks)) == 2  # the rest, each once
        finally:
            blocks.close()
