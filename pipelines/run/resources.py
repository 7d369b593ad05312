"""Resource planning for an elastic cluster: where the model workers run (GPU or CPU), how many one trial uses and
the sweep's pool holds, how many trials run at once, and waiting for the first GPU.

Nothing here is sized from the cluster as it is at the start: a sweep on `cluster.yaml` starts with the one GPU
node `min_workers` keeps (or none) and grows to what its work can use, up to `resources.max_gpus`. Each trial leases
every worker it can use (one per block, at most `max_actors`) from the sweep's pool (`pipelines/run/workers.py`),
which creates them as leases ask (at most `pool_size`); the ones the cluster cannot place yet are pending, and
pending workers are what the autoscaler adds nodes for. A trial starts on the first worker that is up, and the
others join as their nodes do. Workers no lease needs any more are retired, and the pool ends with the sweep: nothing
is left asking the autoscaler for anything.
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

    - ``device``: "gpu" or "cpu"; ``gpus`` / ``cpus``: per worker (``gpus`` 0 on CPU).
    - ``max_actors``: the workers one trial uses at once (its lease on the sweep's pool).
    - ``trials_at_once``: trials Tune runs together.
    - ``pool_size``: the most workers the sweep's pool holds (those the cluster cannot place yet are pending: the
      autoscaler's demand).
    - ``note``: why this device, when it was chosen automatically.
    """

    device: str
    gpus: float
    cpus: float
    max_actors: int
    trials_at_once: int
    pool_size: int = 1
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


# The largest model `device: auto` runs on CPUs (8 GB of weights in fp32): the tiny, testbed and easy-vqa models answer
# in well under a second there, while a 7B-class model takes about 28 GB and minutes per answer, so without a GPU it is
# refused at once rather than run silently on the CPUs (`resources.device: cpu` runs it there on purpose).
CPU_MAX_PARAMS = 2 * 10 ** 9


def choose_device(resources: Resources, cluster_gpus: float, can_add_gpus: bool | None,
                  model_params: int | None = None, model: str = "the model") -> tuple[str, str]:
    """(device, note) for ``resources.device``; ``auto`` decides from what the cluster has and can add:

    - GPUs now (``cluster_gpus``): GPU;
    - none yet, but its autoscaler can add GPU nodes (``can_add_gpus`` True, `autoscaler_offers_gpus`) or an
      autoscaler runs whose node types cannot be read from here (None): GPU, and the sweep waits for the first;
    - neither: the CPUs, said in the note, for a model of at most `CPU_MAX_PARAMS` parameters (``model_params``;
      None: not known, a factory's small model); a larger one raises NoCapacity at once."""
    if resources.device != AUTO:
        return resources.device, ""
    if cluster_gpus > 0:
        return "gpu", ""
    if can_add_gpus is not False:
        how = "its autoscaler can add GPU nodes" if can_add_gpus else "an autoscaler runs whose node types are unknown"
        return "gpu", f"note: no GPU in the Ray cluster yet, and {how}: the sweep waits for the first GPU node"
    if model_params is not None and model_params > CPU_MAX_PARAMS:
        raise NoCapacity(f"{model} has {model_params / 1e9:.1f}B parameters, and the Ray cluster has no GPU and no "
                         "autoscaler that can add GPU nodes, so resources.device: auto has nowhere to run it: on CPUs "
                         f"(models up to {CPU_MAX_PARAMS / 1e9:g}B run there) it would take minutes per answer. "
                         "Connect to a cluster with GPUs (--address, RAY_ADDRESS; cluster.yaml's gpu_worker type), or "
                         "set resources.device: cpu to run it on the CPUs anyway.")
    return "cpu", ("note: no GPU in the Ray cluster and no autoscaler that can add one: the actors run on the CPUs "
                   "(resources.device: gpu makes a sweep wait for GPUs instead)")


def autoscaler_offers_gpus() -> bool | None:
    """Whether the connected cluster's autoscaler can add nodes with GPUs. Read from the cluster config the autoscaler
    reports to the GCS (autoscaler v2, KubeRay with it), else from the v1 monitor's ``--autoscaling-config`` file on
    the head node (`ray up`'s ``~/ray_bootstrap_config.yaml``, `fake_cluster`'s); False when no autoscaler can add
    nodes (a local Ray, this process's or a plain `ray start --head`, whose monitor only mirrors the nodes); None when
    an autoscaler runs whose node types cannot be read from here (its monitor in another container, as KubeRay's v1
    sidecar)."""
    import json

    from ray._private import ray_constants
    from ray._private.state import state
    from ray.experimental import internal_kv

    if started_here():  # `ray.init`'s own head takes no autoscaling config: asking its monitor costs ~2 s of a sweep
        return False
    most = state.get_max_resources_from_cluster_config()
    if most is not None:
        return most.get("GPU", 0) > 0
    status = internal_kv._internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    if not status:
        return False
    head = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})]
    if not head:
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(_monitor_node_types).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(head[0], soft=False))
    types = ray.get(read.remote(int(json.loads(status)["monitor_pid"])), timeout=60)
    if types is None:
        return None
    return any(float(t["resources"].get("GPU", 0)) > 0 and int(t["max_workers"]) > 0 for t in types)


def _monitor_node_types(pid: int) -> list[dict] | None:
    """On the head node: the node types of the autoscaling config the v1 monitor ``pid`` was started with ([] for a
    monitor without one: it only mirrors the cluster; None when its command line or config cannot be read)."""
    from pathlib import Path

    import yaml

    try:
        args = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return None
    flag = "--autoscaling-config"
    paths = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    paths += [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    if not paths:
        return []
    try:
        config = yaml.safe_load(Path(paths[0]).expanduser().read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    cap = config.get("max_workers", 0)
    return [{"resources": dict(t.get("resources") or {}), "max_workers": t.get("max_workers", cap)}
            for t in (config.get("available_node_types") or {}).values()]


def plan(resources: Resources, n_trials: int, blocks_per_trial: int, max_concurrent: int | str = AUTO,
         cluster: dict | None = None, can_add_gpus: bool | None | str = "ask", model: str | None = None) -> Plan:
    """The plan for ``n_trials`` evaluations of ``blocks_per_trial`` blocks each of ``model`` (a name or path;
    None: a small model). ``cluster``: the cluster's resources now (``ray.cluster_resources()`` if None);
    ``can_add_gpus``: `autoscaler_offers_gpus` (asked of the cluster when needed, with "ask"). Raises NoCapacity
    for a model too large for CPUs on a cluster that has and can add no GPU (`choose_device`).

    A trial never uses more workers than it has blocks (``workers`` caps it further, and on GPUs so does
    ``max_gpus``). On GPUs, enough trials run at once that they can fill every GPU the sweep may use, plus one so that
    a trial's last blocks and the next trial's first overlap (at most `MAX_AUTO_TRIALS`). On CPUs the pool has one
    worker per core (``cpus_per_worker`` cores each), and one trial per worker runs at once (at most
    `MAX_AUTO_TRIALS`), so 2 at a time on a 2-core machine, each free to send its blocks to both workers: while one
    trial scores its answers (in its own process) or starts, the other's blocks keep the workers busy. A set
    ``max_concurrent`` (the spec's ``tune.max_concurrent_trials``; 1 for a reproducible optuna search) decides the
    trials at once. The pool holds what the trials at once can use, at most the GPUs (or cores) the sweep may use.
    """
    cluster = ray.cluster_resources() if cluster is None else cluster
    gpus = float(cluster.get("GPU", 0))
    auto = resources.device == AUTO and gpus == 0
    if can_add_gpus == "ask":
        can_add_gpus = autoscaler_offers_gpus() if auto else False
    params = None
    if auto and can_add_gpus is False and model is not None:
        from promprune.models.factories import parameter_count

        params = parameter_count(model)
    device, note = choose_device(resources, gpus, can_add_gpus, params, model or "the model")
    per_trial = max(1, blocks_per_trial)
    if resources.actors is not None:
        per_trial = min(per_trial, resources.actors)
    if device == "gpu":
        cap = MAX_ACTORS if resources.max_gpus == AUTO else max(1, int(resources.max_gpus // resources.gpus_per_worker))
        per_trial = min(per_trial, cap)
        at_once = min(math.ceil(cap / per_trial) + 1, MAX_AUTO_TRIALS)
    else:  # one worker per core (cpus_per_worker each), a trial per worker
        cap = max(1, int(float(cluster.get("CPU", 1)) // max(resources.cpus_per_worker, 1)))
        per_trial = min(per_trial, cap)
        at_once = min(cap, MAX_AUTO_TRIALS)
    if max_concurrent != AUTO:
        at_once = int(max_concurrent)
    at_once = max(1, min(at_once, n_trials))
    return Plan(device=device, gpus=resources.gpus_per_worker if device == "gpu" else 0.0,
                cpus=resources.cpus_per_worker, max_actors=per_trial, trials_at_once=at_once,
                pool_size=min(cap, per_trial * at_once), note=note)


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
    """Waiting for the first place one actor fits (a GPU node, or a node with ``cpus_per_worker`` cores). Created
    early, it submits a probe task asking for one actor's resources, which is pending work an autoscaler adds a node
    for, so the node boots while the sweep builds its requests; `wait` then blocks until the probe ran (or it fits
    already). On the Ray this process started itself no node will ever join: an actor that does not fit there is
    NoCapacity at once (a GPU asked of a machine without one waited `actor_wait_s`, 10 minutes by default; too many
    cores per worker hung)."""

    def __init__(self, plan: Plan):
        self.plan, self.start = plan, time.monotonic()
        self.probe, self.held = None, False
        if fits(plan):
            return
        if started_here():
            raise NoCapacity(_no_capacity_message(plan, None))
        self.probe = ray.remote(_probe).options(num_gpus=plan.gpus, num_cpus=plan.cpus, max_retries=0).remote()

    def wait(self, wait_s: float) -> float:
        """Seconds waited since the probe started (0 when an actor fitted at once). Raises NoCapacity after
        ``wait_s`` in all, with the paragraph a user needs; the probe is cancelled, so no demand is left behind."""
        if self.probe is None:
            return 0.0
        left = max(0.0, wait_s - (time.monotonic() - self.start))
        ready, _ = ray.wait([self.probe], timeout=min(left, 1.0))
        if not ready:
            what, instead = (("a GPU actor", "resources.device: cpu runs the actors on the CPUs instead")
                             if self.plan.on_gpu else (f"an actor of {self.plan.cpus:g} CPUs",
                                                       "a lower resources.cpus_per_worker fits smaller nodes"))
            say(f"no node of the cluster can hold {what} yet: waiting up to {wait_s:g}s for one "
                f"(resources.actor_wait_s; {instead})")
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


def _no_capacity_message(plan: Plan, wait_s: float | None) -> str:
    """Why no actor could be placed; ``wait_s`` None: on the Ray this process started, which no node will join."""
    have = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    biggest = max((n.get("GPU", 0) for n in nodes), default=0)
    most_cpus = max((n.get("CPU", 0) for n in nodes), default=0)
    what = (f"{plan.gpus:g} GPU and {plan.cpus:g} CPU per actor" if plan.on_gpu
            else f"{plan.cpus:g} CPU per actor")
    need = f"the sweep's actors need {what} (resources.gpus_per_worker / resources.cpus_per_worker)"
    if wait_s is None:
        fix = (f"set resources.device: cpu or auto (with resources.cpus_per_worker at most {most_cpus:g}) to run on "
               "this machine's CPUs, or connect to a cluster with GPUs (--address, RAY_ADDRESS)" if plan.on_gpu else
               f"lower resources.cpus_per_worker to at most {most_cpus:g}, or connect to a cluster with larger nodes "
               "(--address, RAY_ADDRESS)")
        return (f"{need}, and the Ray this sweep started on this machine has {have.get('GPU', 0):g} GPU(s) and "
                f"{have.get('CPU', 0):g} CPU(s), where no other node will join it: {fix}.")
    return (f"{need}, and no node of the Ray cluster could hold one within resources.actor_wait_s={wait_s:g}s: the "
            f"cluster has {have.get('GPU', 0):g} GPU(s) and {have.get('CPU', 0):g} CPU(s) on {len(nodes)} node(s), "
            f"at most {biggest:g} GPU(s) and {most_cpus:g} CPU(s) on one node. Start GPU workers (cluster.yaml's "
            "gpu_worker type; check the autoscaler's log with `ray monitor`), lower resources.gpus_per_worker or "
            "resources.cpus_per_worker, raise resources.actor_wait_s, or set resources.device: cpu to run on the "
            "CPUs.")
