"""Resource planning: how many actors per trial, how many trials at once, on the GPUs the cluster has."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipelines import spec as specs

QUEUED_TRIALS = 2  # trials running beyond those the actors serve at once: their batches fill the others' gaps


@dataclass
class Plan:
    """How many actors per evaluation and trials at once.

    The sweep starts `workers x concurrency` actors once (`PredictorPool`) and its trials share them; Tune runs
    `in_flight` trials at once, more than `concurrency` by the trials queued behind them, so that while a trial
    scores, checkpoints and is logged, the next one's batches keep the actors busy."""

    workers: int
    concurrency: int
    gpus_per_worker: float
    cluster_gpus: float
    in_flight: int = 1

    @property
    def actors(self) -> int:
        return self.workers * self.concurrency


def makespan(n_trials: int, slots: int, workers: int, max_concurrent: int | None = None) -> float:
    """Time to run ``n_trials`` equal trials on ``slots`` GPU actors with ``workers`` actors per trial, in units of
    one trial on one actor: whole trials run in waves of ``slots // workers`` (or fewer, ``max_concurrent``), and a
    trial's samples are shared by its actors (Ray Data)."""
    at_once = max(1, slots // workers)
    if max_concurrent is not None:
        at_once = min(at_once, max_concurrent)
    return math.ceil(n_trials / at_once) / workers


def plan_resources(spec: specs.SweepSpec, n_trials: int, cluster_gpus: float) -> Plan:
    """auto workers: the actors per trial that finish the sweep soonest when its trials cost about the same.

    Whole trials run in waves, so 19 trials on 8 GPUs with one actor each take 3 waves with 3 GPUs busy in the
    last (79% of ideal); with all 8 actors on each trial, one trial after the other, nothing idles. Ties go to
    fewer actors per trial. auto concurrency: as many trials as the actors allow. With no GPU: one actor and one
    trial at a time (the actors would only fight over the cores). The actors are the sweep's, loaded once
    (`PredictorPool`); on GPUs `in_flight` adds QUEUED_TRIALS trials behind the running ones (a set cap bounds it).
    """
    r, t = spec.resources, spec.tune
    if cluster_gpus > 0 and r.gpus_per_worker > 0:
        slots = max(1, int(cluster_gpus // r.gpus_per_worker))  # actors that fit on the cluster at once
        cap = None if t.max_concurrent_trials == specs.AUTO else t.max_concurrent_trials
        workers = r.workers if r.workers != specs.AUTO else min(
            range(1, slots + 1), key=lambda w: (makespan(n_trials, slots, w, cap), w))
        concurrency = max(1, slots // workers)  # trials whose actors fit at once; a set cap lowers it
        if cap is not None:
            concurrency = min(concurrency, cap)
    else:
        workers = r.workers if r.workers != specs.AUTO else 1
        concurrency = t.max_concurrent_trials if t.max_concurrent_trials != specs.AUTO else 1
    concurrency = max(1, min(concurrency, n_trials))
    in_flight = concurrency + (QUEUED_TRIALS if cluster_gpus > 0 else 0)  # CPU: the trials would fight for cores
    if t.max_concurrent_trials != specs.AUTO:
        in_flight = min(in_flight, t.max_concurrent_trials)
    return Plan(workers=workers, concurrency=concurrency, gpus_per_worker=r.gpus_per_worker,
                cluster_gpus=cluster_gpus, in_flight=max(1, min(in_flight, n_trials)))

