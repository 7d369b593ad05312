"""Reliability on a real multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`): a CPU head and three
worker nodes declaring one GPU each (scheduling only; the tiny model runs on their CPUs).

- A worker node killed mid-evaluation: the sweep still finishes, every sample scored exactly once.
- Actors that cannot be placed anywhere fail after `actor_wait_s`, naming the resources, instead of hanging.
- An evaluation starts on its first loaded actor; the others join as they finish loading.
"""
from __future__ import annotations

import dataclasses
import functools
import socket
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from pipelines import spec as specs
from pipelines import sweep
from pipelines.recording import tracking
from pipelines.run.trial import alone, evaluate, predict
from pipelines.run import resources as planning
from pipelines.run.ray_connect import patient_start, worker_env
from pipelines.run.requests import build_requests_dataset, build_rows
from pipelines.config import Resources
from pipelines.weights import ModelSource

pytestmark = pytest.mark.slow

NODE_OBJECT_STORE = 150 * 2 ** 20  # four object stores on one machine: keep each small
SAMPLES = 10  # one per block, 2 s each: enough blocks that the kill lands mid-run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_until(done, *leases, timeout_s: float = 300) -> bool:
    """Whether ``done()`` came true within ``timeout_s`` while each ``(pool, holder, workers)`` lease was renewed as a
    live trial renews it (`engine.HEARTBEAT_S`): a pool drops a holder it has not heard from in
    `pool.HOLDER_TIMEOUT_S` (60 s), which a busy machine's worker start can outlast."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pool, holder, workers in leases:
            ray.get(pool.handle.lease.remote(holder, workers))
        renew = min(deadline, time.monotonic() + 10)
        while time.monotonic() < renew:
            if done():
                return True
            time.sleep(0.5)
    return done()


@pytest.fixture(scope="module")
def cluster():
    # the state API (list_actors) needs the dashboard; a free port keeps it clear of any other Ray on the machine
    with patient_start():  # each node's registration, on a busy machine, is waited for
        c = Cluster(initialize_head=True, connect=False,
                    head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": NODE_OBJECT_STORE,
                                    "dashboard_port": _free_port()})
        for _ in range(3):
            c.add_node(num_cpus=1, num_gpus=1, object_store_memory=NODE_OBJECT_STORE)
    c.wait_for_nodes(300)
    ray.init(address=c.address, runtime_env=worker_env())
    yield c
    ray.shutdown()
    c.shutdown()


def slow_run(vlm, rows, batch_size, *, marker_dir: str):
    """The real run_requests, slowed so the test can kill a node while batches are in flight; leaves a marker."""
    from promprune.eval import run_requests

    time.sleep(2.0)
    preds = run_requests(vlm, rows, batch_size=batch_size)
    for p in preds:
        (Path(marker_dir) / f"{p.task}-{p.doc_id}-{time.time_ns()}").touch()
    return preds


def _actors(class_fragment: str) -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if class_fragment in a.class_name]


def test_killing_a_worker_node_mid_evaluation(cluster, tmp_path, monkeypatch, mlflow_db):
    monkeypatch.chdir(tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    spec = specs.parse({
        "name": "nodekill", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": SAMPLES, "baseline": False, "grid": {"method": ["promprune"], "budget": [8]},
        "generation": {"max_new_tokens": 2},
        "resources": {"workers": 2, "gpus_per_worker": 1, "batch_size": 1, "actor_wait_s": 180},
        "tune": {"max_failures": 2}})
    outcome = {}
    run_fn = functools.partial(slow_run, marker_dir=str(markers))
    # rows without image keys: one request per block (batch_size 1), so the kill lands between blocks; with keys,
    # easy-vqa's questions about one image would share a block
    rows = [dataclasses.replace(r, image_key=None) for r in build_rows(["easyvqa_yesno"], SAMPLES, spec.generation)]
    driver = threading.Thread(target=lambda: outcome.setdefault("r", sweep.run_sweep(spec, run_fn=run_fn, rows=rows)))
    driver.start()

    # the sweep's workers holding the model: both up, one on a node without the trial's coordinator
    victims, deadline = [], time.time() + 300
    while not victims and time.time() < deadline:
        trial_nodes = {a.node_id for a in _actors("ImplicitFunc")}
        victims = [a.node_id for a in _actors("Worker") if a.node_id not in trial_nodes]
        time.sleep(0.2)
    assert victims, "no actor on a node without the trial driver"
    while time.time() < deadline and not any(markers.iterdir()):
        time.sleep(0.2)
    done_before_kill = len(list(markers.iterdir()))
    assert 0 < done_before_kill < SAMPLES, "the kill must land mid-evaluation"
    node = next(n for n in cluster.worker_nodes if n.node_id == victims[0])
    cluster.remove_node(node, allow_graceful=False)

    driver.join(timeout=400)
    assert not driver.is_alive(), "the sweep did not finish after losing a node"
    result = outcome["r"]
    assert result.failed == []
    frame = result.records["promprune-b8"]["predictions"].to_pandas()
    assert len(frame) == SAMPLES and not frame.duplicated(["task", "doc_id"]).any()
    assert sorted(frame["doc_id"]) == list(range(SAMPLES))
    assert frame["error"].isna().all()
    run = tracking.trial_runs(tracking.client(), result.parent_run_id)["promprune-b8"]
    assert run.data.metrics["samples/total"] == SAMPLES and run.data.metrics["samples/failed"] == 0

    with patient_start():  # back to 3 GPU nodes; on a busy machine the node's registration is waited for
        cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=NODE_OBJECT_STORE)
    cluster.wait_for_nodes(300)


def test_a_pool_that_dies_during_the_calibration_stops_the_sweep_resumable(cluster, tmp_path, monkeypatch, mlflow_db):
    """mu: calibrate on a cluster this process joined runs on one of the sweep's workers, which the driver asks the
    pool for. The pool's actor killed as the calibration starts: the sweep stops with the pool's paragraph and the
    resume command (`PoolLost`: exit 2 from the CLI), its parent run KILLED, not FAILED; the resume calibrates and
    finishes. (The calibration's call raised Ray's "actor died" error out of the sweep: exit 1, a traceback, the
    parent run FAILED, nothing saved to resume.)"""
    from pipelines import calibration
    from pipelines.run.pool_watch import PoolLost

    monkeypatch.chdir(tmp_path)
    spec = specs.parse({
        "name": "calpool", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 2, "baseline": False, "grid": {}, "trials": [{"method": "promprune", "budget": 8, "mu": "calibrate"}],
        "calibration": {"images": "testbed:train", "n": 4}, "generation": {"max_new_tokens": 1},
        "resources": {"workers": 1, "gpus_per_worker": 1, "batch_size": 1, "actor_wait_s": 180},
        "tune": {"max_failures": 0}})
    shipped = calibration.shipped_results

    def killing_the_pool(*args, **kwargs):  # the calibration stage begins: the pool's actor dies
        (name,) = [n for n in ray.util.list_named_actors() if n.startswith("promprune-pool/")]
        ray.kill(ray.get_actor(name))
        return shipped(*args, **kwargs)

    monkeypatch.setattr(calibration, "shipped_results", killing_the_pool)
    with pytest.raises(PoolLost) as lost:
        sweep.run_sweep(spec)
    text = str(lost.value)
    assert "worker pool lost: the sweep's Pool actor" in text and "--resume" in text, text
    c = tracking.client()
    (parent,) = c.search_runs([tracking.experiment_id(c)], "tags.`promprune.sweep` = 'calpool'")
    assert parent.info.status == "KILLED"

    monkeypatch.setattr(calibration, "shipped_results", shipped)
    outcome = sweep.run_sweep(spec, resume="latest")
    assert outcome.failed == [] and outcome.parent_run_id == parent.info.run_id
    assert "calibration/median_spectral" in c.get_run(parent.info.run_id).data.metrics


@pytest.mark.parametrize("prebuilt", [False, True], ids=["rows", "sweep-dataset"])
def test_unplaceable_actors_fail_instead_of_hanging(cluster, prebuilt):
    """Also when the rows arrive as the sweep's prebuilt dataset."""
    rows = build_rows(["easyvqa_yesno"], 1, {"max_new_tokens": 1})
    if prebuilt:
        rows = build_requests_dataset(["easyvqa_yesno"], 1, {"max_new_tokens": 1}, batch_size=1)
    resources = Resources(workers=1, gpus_per_worker=2, batch_size=1, actor_wait_s=5)  # no node has 2 GPUs
    spec = specs.SweepSpec(name="unplaceable", version=1, model=ModelSource("tiny:llava"), resources=resources)
    start = time.time()
    with pytest.raises(planning.NoCapacity, match=r"actor_wait_s=5s.*at most 1 GPU\(s\) and [0-9.]+ CPU"):
        with alone(spec, rows) as shared:
            evaluate(specs.Trial(None, None), spec, shared)
    assert time.time() - start < 60
    assert not [a for a in _actors("_probe")], "the probe's demand outlived the wait"


def staggered_source(claim: str, slow_s: float) -> ModelSource:
    """tiny:llava, loaded at once by the first actor to claim the file `claim` and after `slow_s` by the others
    (a slow disk, a node the autoscaler brings up late). Defined here so cloudpickle ships it by value."""
    from dataclasses import dataclass

    @dataclass
    class Staggered(ModelSource):
        claim: str = ""
        slow_s: float = 0.0

        def load(self, **kwargs):
            import os

            try:
                os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                time.sleep(self.slow_s)
            return super().load(**kwargs)

    return Staggered("tiny:llava", claim=claim, slow_s=slow_s)


def pid_run(vlm, rows, batch_size, *, marker_dir: str, sleep_s: float = 0.0):
    """The real run_requests (after ``sleep_s``: a bigger model); leaves a marker naming the actor process that
    answered, and when."""
    import os

    from promprune.eval import run_requests

    time.sleep(sleep_s)
    preds = run_requests(vlm, rows, batch_size=batch_size)
    for p in preds:
        Path(marker_dir, f"{p.doc_id}-{os.getpid()}-{time.monotonic_ns()}").touch()
    return preds


@pytest.mark.long  # the long tier (pyproject's markers): a cluster's actors run in CI
# (test_killing_a_worker_node_mid_evaluation)
def test_work_starts_on_the_first_loaded_actor_and_the_others_join(cluster, tmp_path):
    """Three actors asked for, one loads at once and two after 20 s: the first answers blocks while the others load,
    and the late ones take blocks once they are up (nodes that join mid-evaluation are used). 24 blocks of 2 s: 48 s
    of work for one actor."""
    slow_s = 20.0
    markers = tmp_path / "markers"
    markers.mkdir()
    resources = Resources(workers=3, gpus_per_worker=1, batch_size=1, actor_wait_s=180)
    spec = specs.SweepSpec(name="staggered", version=1, model=staggered_source(str(tmp_path / "claim"), slow_s),
                           resources=resources)
    rows = [dataclasses.replace(r, image_key=None) for r in build_rows(["easyvqa_yesno"], 24, {"max_new_tokens": 8})]
    with alone(spec, rows, run_fn=functools.partial(pid_run, marker_dir=str(markers), sleep_s=2.0)) as shared:
        preds = predict(specs.Trial("promprune", 8), shared)
    assert preds.column("doc_id").to_pylist() == list(range(24)) and not any(preds.column("error").to_pylist())
    answered = sorted((int(m.name.split("-")[2]), m.name.split("-")[1]) for m in markers.iterdir())  # monotonic ns
    first_t, first_pid = answered[0]
    early = {pid for t, pid in answered if t - first_t < slow_s * 1e9 / 2}
    assert early == {first_pid}, "only the actor that had loaded can have answered at first"
    assert len({pid for _, pid in answered}) >= 2, "the actors that loaded late never took work"


# ----------------------------------------------------------------------------------------------------------------
# the sweep's pool of workers: GPUs held while a trial needs them, given back when none does


def _gpus_free(expected: float, timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("GPU", 0) == expected:
            return True
        time.sleep(0.5)
    return False


def test_workers_give_their_gpus_back_when_no_trial_needs_them(cluster):
    """A lease of two workers holds two of the cluster's three GPUs; once no lease needs them (and `keep_s` has
    passed) the workers are retired and the GPUs are free; a new lease brings workers back, and closing the pool
    frees them at once. The model is published to the object store first, as a sweep's is: the workers the pool
    starts itself get its weights by reference (pickled into the pool's bytes, the reference lost its owner and every
    worker the pool started failed: "a Ray object whose owner is unknown")."""
    from pipelines.run.workers import Failover, WorkerPool
    from pipelines.weights import share

    plan = planning.plan(Resources(max_gpus=2, batch_size=1), 1, 2, cluster={"GPU": 3}, can_add_gpus=False)
    assert (plan.device, plan.pool_size) == ("gpu", 2)
    source = share(ModelSource("tiny:llava"), on_gpu=plan.on_gpu)
    assert isinstance(source.shared, ray.ObjectRef)
    pool = WorkerPool(source, plan, 1, Failover(), keep_s=2.0)
    try:
        assert held_until(lambda: pool.state()["up"] >= 2, (pool, "trial-a", 2))
        assert pool.state()["up"] == 2 and _gpus_free(1), "two workers up, two GPUs held"
        ray.get(pool.handle.release.remote("trial-a"))
        assert _gpus_free(3), "the workers kept their GPUs with no lease left"
        assert pool.state()["workers"] == 0 and not _actors("Worker")
        assert held_until(lambda: pool.state()["up"] >= 1, (pool, "trial-b", 1))
        assert pool.first_worker(timeout_s=60) is not None and _gpus_free(2)
    finally:
        pool.close()
    assert _gpus_free(3), "closing the pool left a worker holding its GPU"


def test_two_sweeps_never_share_a_worker_holding_another_model(cluster):
    """Two sweeps' pools on one cluster, their models loaded in different dtypes, leased at once: each pool's workers
    are its own (disjoint rosters, names carrying the sweep and what the workers hold), and every worker holds its own
    pool's model; the same model in another sweep is still another pool (pools are the sweep's)."""
    from pipelines.run.workers import Failover, PoolKey, WorkerPool

    plan = planning.plan(Resources(max_gpus=1, batch_size=1), 1, 1, cluster={"GPU": 3}, can_add_gpus=False)
    sources = {"a": ModelSource("tiny:llava", dtype="float32"), "b": ModelSource("tiny:llava", dtype="bfloat16")}
    assert PoolKey.of(sources["a"], plan) != PoolKey.of(sources["b"], plan)
    assert PoolKey.of(sources["a"], plan) == PoolKey.of(ModelSource("tiny:llava", dtype="float32"), plan)
    pools = {name: WorkerPool(source, plan, 1, Failover(), sweep=f"sweep-{name}") for name, source in sources.items()}
    try:
        assert held_until(lambda: all(pool.state()["up"] >= 1 for pool in pools.values()),
                          *((pool, "t", 1) for pool in pools.values()))
        held = {name: ray.get(pool.first_worker(timeout_s=60).holds.remote()) for name, pool in pools.items()}
        assert held == {"a": ("tiny:llava", "float32"), "b": ("tiny:llava", "bfloat16")}
        rosters = {name: {w for _, w in ray.get(pool.handle.roster.remote())[0]}  # handles compare by actor
                   for name, pool in pools.items()}
        assert rosters["a"] and rosters["b"] and not rosters["a"] & rosters["b"]
        assert pools["a"].name != pools["b"].name and "sweep-a" in pools["a"].name
    finally:
        for pool in pools.values():
            pool.close()


def test_a_worker_the_pool_cannot_start_fails_its_trials_instead_of_hanging(cluster):
    """Starting a worker raises in the pool (before: the lease call raised inside the pool, unread, and a trial's
    `acquire` found no worker and no error, forever): every trial's `acquire` gets the reason."""
    from pipelines.run.pool import Pool, pack_spawn

    def spawn(pool):
        raise RuntimeError("no such model")

    data, refs = pack_spawn(spawn)
    pool = ray.remote(Pool).options(num_cpus=0).remote(1, data, 1.0, refs)
    try:
        ray.get(pool.lease.remote("trial-a", 1))
        granted, error = ray.get(pool.acquire.remote("trial-a", 1))
        assert granted == [] and "could not start a worker: RuntimeError: no such model" in error
    finally:
        ray.kill(pool)
