"""Resource planning for an elastic cluster: where the actors run (GPU or CPU), how far each evaluation's actor pool
may grow, how many trials run at once, what the sweep asks the autoscaler for, and waiting for the first GPU.

Nothing here is sized from the cluster as it is at the start: a sweep on `cluster.yaml` starts with the one GPU
node `min_workers` keeps (or none) and grows to what its work can use, up to `resources.max_gpus`. Each
evaluation's pool starts with one actor and adds actors while blocks are waiting and the cluster has room (Ray
Data's actor autoscaling); the sweep's standing request (`Demand`) makes the autoscaler add the nodes for them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ray

from pipelines.config import AUTO, Resources

# Trials a sweep runs at once when `tune.max_concurrent_trials` is auto, at most: each is a process on the head
# holding lmms-eval's scorers and its predictions (~0.5 GB); beyond this their pools' actors are what matters.
MAX_AUTO_TRIALS = 8
# The most actors a sweep asks the autoscaler for with `max_gpus: auto`: beyond any cluster we expect (the
# autoscaler launches up to its own max_workers anyway); a larger cluster sets resources.max_gpus.
MAX_DEMAND = 256


class NoCapacity(RuntimeError):
    """The spec wants GPUs and the cluster gave none within `resources.actor_wait_s` (a user-facing paragraph)."""


@dataclass
class Plan:
    """How a sweep (or one evaluation) uses the cluster.

    - ``device``: "gpu" or "cpu"; ``gpus`` / ``cpus``: per actor (``gpus`` 0 on CPU).
    - ``max_actors``: the most actors one evaluation's pool grows to (it starts with one).
    - ``trials_at_once``: trials Tune runs together; ``demand``: actors the sweep asks the autoscaler for.
    - ``note``: why this device, when it was chosen automatically.
    """

    device: str
    gpus: float
    cpus: float
    max_actors: int
    trials_at_once: int
    demand: int
    note: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.device == "gpu"

    def bundle(self) -> dict:
        """One actor's resources, as the autoscaler reads them."""
        return {"GPU": self.gpus, "CPU": self.cpus} if self.on_gpu else {"CPU": max(self.cpus, 1e-3)}


def started_here() -> bool:
    """Whether this process started the Ray it is connected to (a local Ray), rather than joining a cluster."""
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(node is not None and node.head)


def choose_device(resources: Resources, local: bool, cluster_gpus: float) -> tuple[str, str]:
    """(device, note). ``auto``: GPUs when the Ray is a cluster the sweep joined (whose GPU nodes may not have
    joined yet) or has GPUs; the CPU on a local Ray without GPUs, said in the note."""
    if resources.device != AUTO:
        return resources.device, ""
    if cluster_gpus > 0 or not local:
        return "gpu", ""
    return "cpu", ("note: no GPU on this machine's Ray: the actors run on the CPU (resources.device: gpu makes a "
                   "sweep wait for GPUs instead)")


def plan(resources: Resources, n_trials: int, blocks_per_trial: int, max_concurrent: int | str = AUTO,
         local: bool | None = None, cluster_gpus: float | None = None) -> Plan:
    """The plan for ``n_trials`` evaluations of ``blocks_per_trial`` blocks each.

    A pool never has more actors than blocks (``workers`` caps it further, and on GPUs so does ``max_gpus``). On
    GPUs, enough trials run at once that their pools can fill every GPU the sweep may use, plus one so that a
    trial's last blocks and the next trial's first overlap; the demand is what those pools can use. On a CPU
    machine one trial runs at a time, its pool on the cores (``cpus_per_worker`` each), unless the spec says more.
    """
    local = started_here() if local is None else local
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0)) if cluster_gpus is None else cluster_gpus
    device, note = choose_device(resources, local, cluster_gpus)
    per_trial, cap = max(1, blocks_per_trial), 0
    if resources.actors is not None:
        per_trial = min(per_trial, resources.actors)
    if device == "gpu":
        cap = MAX_DEMAND if resources.max_gpus == AUTO else max(1, int(resources.max_gpus // resources.gpus_per_worker))
        per_trial = min(per_trial, cap)
        at_once = min(n_trials, math.ceil(cap / per_trial) + 1, MAX_AUTO_TRIALS)
    else:
        cpus = float(ray.cluster_resources().get("CPU", 1))
        per_trial = min(per_trial, max(1, int(cpus // max(resources.cpus_per_worker, 1))))
        at_once = 1
    if max_concurrent != AUTO:
        at_once = int(max_concurrent)
    at_once = max(1, min(at_once, n_trials))
    demand = min(at_once * per_trial, cap)  # 0 on CPU: nothing to ask the autoscaler for
    return Plan(device=device, gpus=resources.gpus_per_worker if device == "gpu" else 0.0,
                cpus=resources.cpus_per_worker, max_actors=per_trial, trials_at_once=at_once, demand=demand,
                note=note)


# ----------------------------------------------------------------------------------------------------------------
# the autoscaler


class Demand:
    """The sweep's standing request to the autoscaler (`ray.autoscaler.sdk.request_resources`): ``plan.demand``
    actors' resources while the sweep runs, nothing once it ends (``with Demand(plan): ...``). Harmless without an
    autoscaler."""

    def __init__(self, plan: Plan):
        self.plan, self.requested = plan, False

    def _ask(self, plan: Plan) -> None:
        if plan.demand > 0 or self.requested:
            _request([plan.bundle()] * plan.demand)
            self.requested = plan.demand > 0

    def __enter__(self) -> "Demand":
        self._ask(self.plan)
        return self

    def update(self, plan: Plan) -> Plan:
        """Replace the request with ``plan``'s (once the blocks are known); returns ``plan``."""
        if plan.demand != self.plan.demand or plan.bundle() != self.plan.bundle():
            self._ask(plan)
        self.plan = plan
        return plan

    def __exit__(self, *exc) -> bool:
        if self.requested:
            _request([])
            self.requested = False
        return False


def _request(bundles: list[dict]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


def fits(plan: Plan) -> bool:
    """Whether some node of the cluster can hold one actor now (by its total resources)."""
    need = plan.bundle()
    for node in ray.nodes():
        if node.get("Alive") and all(node.get("Resources", {}).get(k, 0) >= v for k, v in need.items()):
            return True
    return False


def wait_for_capacity(plan: Plan, wait_s: float, poll_s: float = 1.0) -> float:
    """Block until a node can hold one actor (the autoscaler, asked by `Demand`, may be adding it); returns the
    seconds waited. Raises NoCapacity after ``wait_s`` with the paragraph a user needs."""
    start = time.monotonic()
    while not fits(plan):
        if time.monotonic() - start >= wait_s:
            raise NoCapacity(_no_capacity_message(plan, wait_s))
        time.sleep(poll_s)
    return time.monotonic() - start


def _no_capacity_message(plan: Plan, wait_s: float) -> str:
    have = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    biggest = max((n.get("GPU", 0) for n in nodes), default=0)
    what = (f"{plan.gpus:g} GPU and {plan.cpus:g} CPU per actor" if plan.on_gpu
            else f"{plan.cpus:g} CPU per actor")
    return (f"the sweep's actors need {what} (resources.gpus_per_worker / resources.cpus_per_worker), and no node "
            f"of the Ray cluster could hold one within resources.actor_wait_s={wait_s:g}s: the cluster has "
            f"{have.get('GPU', 0):g} GPU(s) and {have.get('CPU', 0):g} CPU(s) on {len(nodes)} node(s), at most "
            f"{biggest:g} GPU(s) on one node. Start GPU workers (cluster.yaml's gpu_worker type; check the "
            "autoscaler's log with `ray monitor`), lower resources.gpus_per_worker, raise resources.actor_wait_s, "
            "or set resources.device: cpu to run on the CPUs.")
