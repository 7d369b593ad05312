"""Reliability on a real multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`): a CPU head and three
worker nodes declaring one GPU each (scheduling only; the tiny model runs on their CPUs).

- A worker node killed mid-evaluation: the sweep still finishes, every sample scored exactly once.
- An actor pool that cannot be scheduled fails after `actor_wait_s` instead of hanging.
- A sweep's shared pool starts work when its first actor has loaded; the others join as they finish loading.
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
from pipelines import sweep, tracking
from pipelines.evaluate import EvalConfig, evaluate, predict
from pipelines.run.pool import PredictorPool
from pipelines.run.ray_connect import worker_env
from pipelines.run.requests import build_requests_dataset, build_rows
from pipelines.config import Resources
from pipelines.weights import ModelSource

pytestmark = pytest.mark.slow

NODE_OBJECT_STORE = 150 * 2 ** 20  # four object stores on one machine: keep each small
SAMPLES = 6  # one per batch: enough batches that the kill lands mid-run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    # the state API (list_actors) needs the dashboard; a free port keeps it clear of any other Ray on the machine
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 1, "num_gpus": 0, "object_store_memory": NODE_OBJECT_STORE,
                                "dashboard_port": _free_port()})
    for _ in range(3):
        c.add_node(num_cpus=1, num_gpus=1, object_store_memory=NODE_OBJECT_STORE)
    c.wait_for_nodes()
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


def test_killing_a_worker_node_mid_evaluation(cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
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

    deadline = time.time() + 300
    while time.time() < deadline and not any(markers.iterdir()):
        time.sleep(0.5)
    done_before_kill = len(list(markers.iterdir()))
    assert 0 < done_before_kill < SAMPLES, "the kill must land mid-evaluation"
    trial_nodes = {a.node_id for a in _actors("ImplicitFunc")}
    # the sweep's shared predictor actors (PredictorPool)
    victims = [a.node_id for a in _actors("PooledPredictor") if a.node_id not in trial_nodes]
    assert victims, "no actor on a node without the trial driver"
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

    cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=NODE_OBJECT_STORE)  # back to 3 GPU nodes
    cluster.wait_for_nodes()


@pytest.mark.parametrize("prebuilt", [False, True], ids=["rows", "sweep-dataset"])
def test_unschedulable_pool_fails_instead_of_hanging(cluster, prebuilt):
    """Also when the rows arrive as the sweep's prebuilt dataset (built before the wait was configured)."""
    rows = build_rows(["easyvqa_yesno"], 1, {"max_new_tokens": 1})
    if prebuilt:
        rows = build_requests_dataset(["easyvqa_yesno"], 1, {"max_new_tokens": 1}, batch_size=1)
    cfg = EvalConfig(model=ModelSource("tiny:llava"), progress_bars=False,
                     resources=Resources(workers=1, gpus_per_worker=2, batch_size=1, actor_wait_s=5))  # no 2-GPU node
    start = time.time()
    with pytest.raises(Exception, match="(?i)actor"):
        evaluate(cfg, rows)
    assert time.time() - start < 120


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


def pid_run(vlm, rows, batch_size, *, marker_dir: str):
    """The real run_requests; leaves a marker naming the actor process that answered."""
    import os

    from promprune.eval import run_requests

    preds = run_requests(vlm, rows, batch_size=batch_size)
    for p in preds:
        Path(marker_dir, f"{p.doc_id}-{os.getpid()}-{time.monotonic_ns()}").touch()
    return preds


def test_pool_starts_work_before_every_actor_has_loaded(cluster, tmp_path):
    slow_s = 25.0
    markers = tmp_path / "markers"
    markers.mkdir()
    resources = Resources(workers=3, gpus_per_worker=1, batch_size=1, actor_wait_s=180)
    t0 = time.monotonic()
    pool = PredictorPool.start(staggered_source(str(tmp_path / "claim"), slow_s), 3, resources, on_gpu=True,
                               run_fn=functools.partial(pid_run, marker_dir=str(markers)))
    try:
        waited = time.monotonic() - t0
        assert pool.ready_count() < 3, f"start() waited for every actor ({waited:.1f}s)"
        cfg = EvalConfig(model=ModelSource("tiny:llava"), method="promprune", budget=8, progress_bars=False,
                         resources=resources)
        rows = build_requests_dataset(["easyvqa_yesno"], 4, {"max_new_tokens": 1}, batch_size=1)
        preds = predict(cfg, rows, pool=pool)  # exactly once per request, checked inside; sorted
        assert preds.column("doc_id").to_pylist() == [0, 1, 2, 3] and not any(preds.column("error").to_pylist())
        early = {m.name.split("-")[1] for m in markers.iterdir()}
        assert len(early) == 1, "only the actor that had loaded can have answered so far"

        deadline = time.monotonic() + 120
        while pool.ready_count() < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pool.ready_count() == 3, "the slow actors never finished loading"
        for m in markers.iterdir():
            m.unlink()
        rows = build_requests_dataset(["easyvqa_yesno"], 12, {"max_new_tokens": 1}, batch_size=1)
        preds = predict(cfg, rows, pool=pool)
        assert preds.column("doc_id").to_pylist() == list(range(12))
        late = {m.name.split("-")[1] for m in markers.iterdir()}
        assert len(late) >= 2, "the actors that loaded late never took work"
    finally:
        pool.shutdown()


def test_trials_of_one_block_are_spread_over_the_pool(cluster, tmp_path):
    """Each trial counts only its own calls, so equally loaded actors are a tie on every trial's first block; ties
    broken by index sent every one-block trial to actor 0 (the 2-GPU sweep_scaling smoke: 19 of 19 calls on one
    actor). 12 one-block calls on 3 loaded actors all landing on one: (1/3)^11 if ties are spread at random."""
    markers = tmp_path / "markers"
    markers.mkdir()
    resources = Resources(workers=3, gpus_per_worker=1, batch_size=1, actor_wait_s=180)
    pool = PredictorPool.start(ModelSource("tiny:llava"), 3, resources, on_gpu=True,
                               run_fn=functools.partial(pid_run, marker_dir=str(markers)))
    try:
        deadline = time.monotonic() + 120
        while pool.ready_count() < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pool.ready_count() == 3
        cfg = EvalConfig(model=ModelSource("tiny:llava"), method="promprune", budget=8, progress_bars=False,
                         resources=resources)
        rows = build_requests_dataset(["easyvqa_yesno"], 1, {"max_new_tokens": 1}, batch_size=1)
        for _ in range(12):
            assert predict(cfg, rows, pool=pool).num_rows == 1
        answered = {m.name.split("-")[1] for m in markers.iterdir()}
        assert len(answered) >= 2, "every one-block call went to the same actor"
    finally:
        pool.shutdown()


def test_pool_that_cannot_be_scheduled_fails_with_the_resources_named(cluster):
    resources = Resources(workers=1, gpus_per_worker=2, batch_size=1, actor_wait_s=5)  # no 2-GPU node
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"actor_wait_s=5s.*2 GPU"):
        PredictorPool.start(ModelSource("tiny:llava"), 2, resources, on_gpu=True)
    assert time.monotonic() - start < 60
