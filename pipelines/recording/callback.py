"""The Tune callback that hands a sweep's trial events to the driver's recorder (`RecorderHook`), and `attached`,
the block within which it does.

Tune pickles its callbacks with the experiment (``tuner.pkl``) and `Tuner.restore` (``--resume``) unpickles them:
Ray 2.60 takes no callbacks on restore and gives no public handle on the restored ones (ray-project/ray#41364). So
the hook carries nothing (an MLflow client cannot be pickled, and a restored hook must reach the new driver's
recorder): it hands each event to the recorder the sweep attached around Tune's run (``with attached(recorder):
tuner.fit()``), held in a context variable of the thread that runs Tune's loop, where Tune calls its callbacks."""
from __future__ import annotations

import collections
import contextlib
import contextvars
import json
from pathlib import Path

from ray import tune

from pipelines import timeline
from pipelines.run import search

_attached: contextvars.ContextVar = contextvars.ContextVar("promprune_recorder", default=None)


@contextlib.contextmanager
def attached(recorder):
    """Within this block (in this thread), `RecorderHook` hands Tune's trial events to ``recorder`` (a
    `pipelines.recording.recorder.SweepRecorder`)."""
    token = _attached.set(recorder)
    try:
        yield recorder
    finally:
        _attached.reset(token)


@contextlib.contextmanager
def callbacks_counted_without_integrations():
    """Within this block, Tune's usage tag of the callbacks a run is given (``ray.air._internal.usage.tag_callbacks``,
    called by ``tune.run`` whether or not usage stats are on) is recorded without importing Ray's logger integrations.

    To tell its built-in callbacks from a user's, Ray imports every integration it has, W&B's among them, which
    imports ``wandb`` when it is installed (lmms-eval brings it): 3.8 s of a 2-core machine's CPU in the sweep's
    driver, on the way to the first trial. The sweep's callbacks are all its own (none is a built-in, and their names
    are not a built-in's), so the counts are Ray's without those imports: each ``LoggerCallback`` a
    "CustomLoggerCallback", each other callback a "CustomCallback", recorded as Ray records them
    (`tests/pipelines/test_units.py` compares with Ray's own function). Any other callback list goes to Ray's."""
    from ray.air._internal import usage as air_usage
    from ray.tune.logger import LoggerCallback

    original = air_usage.tag_callbacks

    def tag(callbacks):
        if not callbacks or not all(isinstance(c, tune.Callback) and type(c).__module__.startswith("pipelines.")
                                    for c in callbacks):
            return original(callbacks)
        counts = collections.Counter("CustomLoggerCallback" if isinstance(c, LoggerCallback) else "CustomCallback"
                                     for c in callbacks)
        air_usage.record_extra_usage_tag(air_usage.TagKey.AIR_CALLBACKS, json.dumps(dict(counts)))
        return True

    air_usage.tag_callbacks = tag
    try:
        yield
    finally:
        air_usage.tag_callbacks = original


class RecorderHook(tune.Callback):
    """Tune's trial events to the attached recorder: a trial started, reported a result, completed (finished with
    its checkpoint, or stopped by a scheduler), or failed; and each step of Tune's loop to its console (`tick`)."""

    @staticmethod
    def _recorder():
        recorder = _attached.get()
        if recorder is None:
            raise RuntimeError("RecorderHook got a Tune event outside `with pipelines.recording.callback.attached("
                               "recorder):`; run Tune's fit (and Tuner.restore) inside that block, in the same thread")
        return recorder

    def on_step_begin(self, iteration: int, trials: list, **info):
        self._recorder().console.tick()  # trials silent for a while: the console says what they wait for

    def on_trial_start(self, iteration: int, trials: list, trial, **info):
        config = search.trial_of(trial.config).to_dict()  # the recorder's view of the trial
        timeline.mark("trial_start", "driver", trial=config["trial_id"])
        self._recorder().started(config, trial.trial_id)

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info):
        self._recorder().progress(search.trial_of(trial.config).trial_id, result)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info):
        """A trial finished (its final report carries its checkpoint) or a scheduler stopped it (no checkpoint; its
        last result is the rung it was stopped at)."""
        config = search.trial_of(trial.config).to_dict()
        if trial.checkpoint is None and search.stopped_by_scheduler(trial.last_result):
            self._recorder().record_stopped(config, trial.last_result, trial.trial_id)
        else:
            self._recorder().record(config, trial.checkpoint, trial.trial_id)
        timeline.mark("trial_recorded", "driver", trial=config["trial_id"])

    def on_trial_error(self, iteration: int, trials: list, trial, **info):
        self._recorder().record_error(search.trial_of(trial.config).to_dict(), error_text(trial),
                                        trial.trial_id)


def error_text(trial) -> str:
    """What a failed trial's error file (Tune's, every failure of the trial in turn) says: the exception that ended
    its last try, as the traceback ends with it, and where the file is kept (the trial's directory under the sweep's
    Tune storage; Tune reads a staged copy); the file's end when it holds no traceback."""
    path = getattr(trial, "error_file", None)
    if not path:
        return "trial failed"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return f"trial failed (see {path})"
    message = last_exception(text)
    kept = f"{trial.path}/{Path(path).name}" if isinstance(getattr(trial, "path", None), str) else path
    return f"{message} (traceback: {kept})" if message else text[-2000:]


def last_exception(text: str) -> str | None:
    """The exception a Python traceback ends with (the lines after its last frame: frames and their code are
    indented), at most its last 2,000 characters; None when ``text`` holds no traceback frame."""
    lines = text.rstrip().splitlines()
    if not any(line.startswith('  File "') for line in lines):
        return None
    tail = []
    for line in reversed(lines):
        if line.startswith((" ", "\t")):
            break
        tail.append(line)
    return "\n".join(reversed(tail)).strip()[-2000:] or None
