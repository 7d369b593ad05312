"""The driver's watch on the sweep's `Pool` actor (`pipelines/run/pool.py`): the one process that grants the model
workers to the trials. Ray does not restart it (its roster, leases and block attempts would need rebuilding), so when
it dies (its process killed, a crash) no trial can get a worker. The watch asks the pool for its state every
`CHECK_EVERY_S` from Tune's loop; once the pool is dead it stops the sweep as a full disk does (`disk.interrupt_tune`:
Tune's state saved with the unfinished trials unfinished), and the driver ends with one paragraph (`PoolLost`) and
the command that resumes the sweep. A trial that finds the pool dead waits for that stop (`engine.stream`) instead of
failing, so no trial is charged with the pool's death and its saved blocks are kept for the resume.

What the watch found lives in this process (`lost`, by ``key``), never in Tune's pickle of its callbacks, so a
resumed sweep starts unstopped."""
from __future__ import annotations

import time

import ray
from ray import tune

from pipelines.run import disk

CHECK_EVERY_S = 1.0
_WATCHED: dict[str, object] = {}  # key (the sweep's experiment) -> its pool's handle
_LOST: dict[str, str] = {}  # key -> what died, once the watch found it dead


class PoolLost(RuntimeError):
    """The sweep's `Pool` actor died: the sweep stopped, resumable (`message`)."""


def watch(key: str, handle) -> None:
    """The pool (``handle``: `WorkerPool.handle`) the `PoolWatch` of ``key`` watches in this process."""
    _WATCHED[key] = handle
    _LOST.pop(key, None)


def lost(key: str) -> str | None:
    """What the watch of ``key`` found dead in this process (None: the pool is alive, or not watched)."""
    return _LOST.get(key)


def message(what: str, resume: str) -> str:
    """The paragraph a sweep stopped by its pool's death ends with."""
    return (f"worker pool lost: {what}. The sweep stopped there: its finished trials are in MLflow, its state is "
            "saved, and no trial was charged with the failure (the unfinished ones stay unfinished, their saved "
            "blocks kept). Finish it with:\n  " + resume)


class PoolWatch(tune.Callback, tune.Stopper):
    """Stops the Tune experiment when the watched pool's actor is dead (see the module's docstring)."""

    def __init__(self, key: str):
        self.key = key
        self._ping = None  # the pool's `state` call in flight
        self._last = 0.0
        self._stop = False

    def __getstate__(self):
        return {"key": self.key, "_ping": None, "_last": 0.0, "_stop": False}

    def on_step_begin(self, iteration, trials, **info):
        self._look()

    def _look(self) -> None:
        handle = _WATCHED.get(self.key)
        if handle is None or self.key in _LOST:
            return
        now = time.monotonic()
        if self._ping is None:
            if now - self._last >= CHECK_EVERY_S:
                self._ping, self._last = handle.state.remote(), now
            return
        ready, _ = ray.wait([self._ping], timeout=0)
        if not ready:
            return
        ping, self._ping = self._ping, None
        try:
            ray.get(ping)
        except ray.exceptions.RayActorError as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            _LOST[self.key] = (f"the sweep's Pool actor, which grants the model workers to the trials, died "
                               f"({first})")
            if not disk.interrupt_tune():
                self._stop = True

    # tune.Stopper
    def __call__(self, trial_id, result) -> bool:
        return self._stop

    def stop_all(self) -> bool:
        return self._stop
