"""The driver's watch on the sweep's `Pool` actor (`pipelines/run/pool.py`): the one process that grants the model
workers to the trials. Ray does not restart it (its roster, leases and block attempts would need rebuilding), so when
it dies (its process killed, a crash) no trial can get a worker.

The watch is a thread of the driver (`Watch`), running from the mu calibration to the end of Tune: it asks the pool
for its state every `CHECK_EVERY_S`, and once the pool is dead it stops the Tune experiment running as a full disk
does (`disk.interrupt_tune`: Tune's state saved with the unfinished trials unfinished; sent again each check, so an
experiment that starts after the death is stopped too), and the driver ends with one paragraph (`PoolLost`) and the
command that resumes the sweep. Being no Tune callback, it watches a resumed sweep whatever callbacks Tune restored
from its saved state (`Tuner.restore` takes no callbacks: a sweep started before the watch existed restores none).
The calibration, which runs before Tune, stops the same way when its call to the pool or to a worker finds the pool
dead (`sweep._run_tune`, `dead`). A trial that finds the pool dead waits for that stop (`engine.stream`) instead of
failing, so no trial is charged with the pool's death and its saved blocks are kept for the resume.

What the watch found lives in this process (`lost`, by ``key``), never in Tune's pickle of its callbacks, so a
resumed sweep starts unstopped."""
from __future__ import annotations

import threading

import ray
from ray import tune

from pipelines.run import disk

CHECK_EVERY_S = 1.0
PING_TIMEOUT_S = 30.0  # `dead`: how long a pool that neither answers nor is known dead is waited for
_LOST: dict[str, str] = {}  # key (the sweep's experiment) -> what died, once the watch found it dead
_SIGNALLED: set[str] = set()  # keys whose watch reached Tune's stop handler (`PoolWatch`'s fallback not needed)


class PoolLost(RuntimeError):
    """The sweep's `Pool` actor died: the sweep stopped, resumable (`message`)."""


def lost(key: str) -> str | None:
    """What the watch of ``key`` found dead in this process (None: the pool is alive, or not watched)."""
    return _LOST.get(key)


def message(what: str, resume: str) -> str:
    """The paragraph a sweep stopped by its pool's death ends with."""
    return (f"worker pool lost: {what}. The sweep stopped there: its finished trials are in MLflow, its state is "
            "saved, and no trial was charged with the failure (the unfinished ones stay unfinished, their saved "
            "blocks kept). Finish it with:\n  " + resume)


def _what(error: Exception) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return f"the sweep's Pool actor, which grants the model workers to the trials, died ({first})"


def dead(key: str, handle, timeout_s: float = PING_TIMEOUT_S) -> str | None:
    """What died if the pool (``handle``) of ``key`` is dead, asked now and recorded as the watch records it (`lost`);
    None while it answers (or has not answered within ``timeout_s``: not known dead)."""
    if key in _LOST:
        return _LOST[key]
    try:
        ray.get(handle.state.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError as e:
        _LOST[key] = _what(e)
        return _LOST[key]
    except ray.exceptions.GetTimeoutError:
        return None
    return None


class Watch:
    """``with Watch(key, handle):`` a thread of the driver asking the pool (``handle``: `WorkerPool.handle`) for its
    state every `CHECK_EVERY_S`; once it is dead, `lost` says what died and Tune's experiment running (or the next to
    start) is stopped as Ctrl-C stops it (see the module's docstring)."""

    def __init__(self, key: str, handle, every_s: float = CHECK_EVERY_S):
        self.key, self.handle, self.every_s = key, handle, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pool-watch-{key}", daemon=True)

    def __enter__(self) -> "Watch":
        _LOST.pop(self.key, None)
        _SIGNALLED.discard(self.key)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._done.set()
        self._thread.join(timeout=5.0)
        return False

    def _run(self) -> None:
        ping = None
        while not self._done.wait(self.every_s):
            if self.key in _LOST:
                self._stop_tune()  # again: a Tune experiment started since (or Tune's handler installed since)
                continue
            if ping is None:
                ping = self.handle.state.remote()
            ready, _ = ray.wait([ping], timeout=0)
            if not ready:
                continue
            ping, answered = None, ping
            try:
                ray.get(answered)
            except ray.exceptions.RayActorError as e:
                self._stop_tune()  # before `lost` says so: `PoolWatch`'s stopper stops Tune only where this did not
                _LOST[self.key] = _what(e)

    def _stop_tune(self) -> None:
        if disk.interrupt_tune():
            _SIGNALLED.add(self.key)


class PoolWatch(tune.Callback, tune.Stopper):
    """The watch's fallback inside Tune (in the callbacks and stoppers of a sweep's experiments): it stops the
    experiment with a stopper's ``stop_all`` once `Watch` found the pool dead, only where Tune's stop handler could not
    be reached (Tune not run in the main thread). The watching is `Watch`'s; an experiment saved by a sweep started
    before the watch existed restores none of this, and is watched all the same."""

    def __init__(self, key: str):
        self.key = key

    def __getstate__(self):
        return {"key": self.key}

    # tune.Stopper
    def __call__(self, trial_id, result) -> bool:
        return self.stop_all()

    def stop_all(self) -> bool:
        return self.key in _LOST and self.key not in _SIGNALLED
