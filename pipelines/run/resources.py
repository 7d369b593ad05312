"""Resource planning for an elastic cluster: where the actors run (GPU or CPU), how many actors each evaluation
asks for, how many trials run at once, and waiting for the first GPU.

Nothing here is sized from the cluster as it is at the start: a sweep on `cluster.yaml` starts with the one GPU
node `min_workers` keeps (or none) and grows to what its work can use, up to `resources.max_gpus`. Each
evaluation asks for every actor it can use at once (one per block, at most `max_actors`); the ones the cluster
cannot place yet are pending, and pending actors are what the autoscaler adds nodes for. The evaluation starts on
the first actor that is up, and the others join as their nodes do. When the evaluation ends its actors go, and
with them the demand: nothing is left asking the autoscaler for anything.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ray

from pipelines.config import AUTO, Resources
from pipelines.console import say

# Trials a sweep runs at once when `tune.max_concurrent_trials` is auto, at most (GPUs and CPUs alike): each is a
# process on the head holding lmms-eval's scorers and its predictions (~0.5 GB); beyond this their pools' actors are
# what matters.
MAX_AUTO_TRIALS = 8
# The most actors one evaluation asks for with `max_gpus: auto`: beyond any cluster we expect (the autoscaler
# launches up to its own max_workers anyway; the rest stay pending); a larger cluster sets resources.max_gpus.
MAX_ACTORS = 256


class NoCapacity(RuntimeError):
    """The spec wants GPUs and the cluster gave none within `resources.actor_wait_s` (a user-facing paragraph)."""


@dataclass
class Plan:
    """How a sweep (or one evaluation) uses the cluster.

    - ``device``: "gpu" or "cpu"; ``gpus`` / ``cpus``: per actor (``gpus`` 0 on CPU).
    - ``max_actors``: the actors one evaluation asks for (those the cluster cannot place yet are pending: the
      autoscaler's demand).
    - ``trials_at_once``: trials Tune runs together.
    - ``note``: why this device, when it was chosen automatically.
    """

    device: str
    gpus: float
    cpus: float
    max_actors: int
    trials_at_once: int
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
         local: bool | None = None, cluster: dict | None = None) -> Plan:
    """The plan for ``n_trials`` evaluations of ``blocks_per_trial`` blocks each (``local``: the Ray was started
    here, `started_here`; ``cluster``: its resources now, ``ray.cluster_resources()``; both read from Ray if None).

    A pool never has more actors than blocks (``workers`` caps it further, and on GPUs so does ``max_gpus``). On
    GPUs, enough trials run at once that their pools can fill every GPU the sweep may use, plus one so that a
    trial's last blocks and the next trial's first overlap (at most `MAX_AUTO_TRIALS`). On CPUs the cores are shared
    out (``cpus_per_worker`` each): one trial per core (at most `MAX_AUTO_TRIALS`, the cores split among them), so 2
    at a time on a 2-core machine, each with one actor, or one trial's actors on all of them when it runs alone. Why
    not one trial at a time on a CPU: a trial pays ~9 s before its first answer (its actor is scheduled, imports
    torch, Ray Data and transformers, loads the model: benchmarks/RESULTS.md, "Where a trial's fixed cost goes"),
    and with one trial per core another trial computes meanwhile; sweeps/README.md documents this and the
    quickstart's measured wall time (55 s) is with it. A set ``max_concurrent`` (the spec's
    ``tune.max_concurrent_trials``; 1 for a reproducible optuna search) decides the trials at once.
    """
    local = started_here() if local is None else local
    cluster = ray.cluster_resources() if cluster is None else cluster
    device, note = choose_device(resources, local, float(cluster.get("GPU", 0)))
    per_trial = max(1, blocks_per_trial)
    if resources.actors is not None:
        per_trial = min(per_trial, resources.actors)
    if device == "gpu":
        cap = MAX_ACTORS if resources.max_gpus == AUTO else max(1, int(resources.max_gpus // resources.gpus_per_worker))
        per_trial = min(per_trial, cap)
        at_once = min(math.ceil(cap / per_trial) + 1, MAX_AUTO_TRIALS)
    else:  # one actor per core (cpus_per_worker each), a trial per actor: one trial's start hides under another's work
        slots = max(1, int(float(cluster.get("CPU", 1)) // max(resources.cpus_per_worker, 1)))
        at_once = min(slots, MAX_AUTO_TRIALS) if max_concurrent == AUTO else int(max_concurrent)
        per_trial = min(per_trial, max(1, slots // max(1, min(at_once, n_trials))))
    if max_concurrent != AUTO:
        at_once = int(max_concurrent)
    at_once = max(1, min(at_once, n_trials))
    return Plan(device=device, gpus=resources.gpus_per_worker if device == "gpu" else 0.0,
                cpus=resources.cpus_per_worker, max_actors=per_trial, trials_at_once=at_once, note=note)


# ----------------------------------------------------------------------------------------------------------------
# waiting for the first GPU


def fits(plan: Plan) -> bool:
    """Whether some node of the cluster can hold one actor now (by its total resources)."""
    need = plan.bundle()
    for node in ray.nodes():
        if node.get("Alive") and all(node.get("Resources", {}).get(k, 0) >= v for k, v in need.items()):
            return True
    return False


class Capacity:
    """Waiting for the first place one actor fits (``plan.on_gpu``: a GPU node). Created early, it submits a probe
    task asking for one actor's resources, which is pending work an autoscaler adds a node for, so the node boots
    while the sweep builds its requests; `wait` then blocks until the probe ran (or it fits already)."""

    def __init__(self, plan: Plan):
        self.plan, self.start = plan, time.monotonic()
        self.probe, self.held = None, False
        if plan.on_gpu and not fits(plan):
            self.probe = ray.remote(_probe).options(num_gpus=plan.gpus, num_cpus=plan.cpus, max_retries=0).remote()

    def wait(self, wait_s: float) -> float:
        """Seconds waited since the probe started (0 when an actor fitted at once). Raises NoCapacity after
        ``wait_s`` in all, with the paragraph a user needs; the probe is cancelled, so no demand is left behind."""
        if self.probe is None:
            return 0.0
        left = max(0.0, wait_s - (time.monotonic() - self.start))
        ready, _ = ray.wait([self.probe], timeout=min(left, 1.0))
        if not ready:
            say(f"no node of the cluster can hold a GPU actor yet: waiting up to {wait_s:g}s for one "
                "(resources.actor_wait_s; resources.device: cpu runs the actors on the CPUs instead)")
            ready, _ = ray.wait([self.probe], timeout=max(0.0, left - 1.0))
        if not ready:
            ray.cancel(self.probe, force=True)
            raise NoCapacity(_no_capacity_message(self.plan, wait_s))
        self._hold()
        return time.monotonic() - self.start

    def _hold(self) -> None:
        """Keep asking the autoscaler for the node the probe brought up (`request_resources`) until `release`: the
        probe has finished, and an idle node may be taken down before the trials' actors ask for it."""
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[self.plan.bundle()])
        self.held = True

    def release(self) -> None:
        """Withdraw the request `wait` made (a no-op when it made none): nothing of the sweep's asks for nodes."""
        if self.held:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[])
            self.held = False


def _probe() -> str:
    return ray.get_runtime_context().get_node_id()


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
