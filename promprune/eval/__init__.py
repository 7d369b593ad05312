"""The lmms-eval bridge: request rows out of lmms-eval tasks, generation over them, scoring back with lmms-eval.

    requests = build_requests(["easyvqa_yesno", "easyvqa_open"], limit=64)   # driver: promprune.records.Request
    predictions = run_requests(vlm, requests, batch_size=8)                 # actors (any sharding): Prediction
    scores = score(predictions)                                         # driver: {task: {metric: value}}
    rel = relative_score(scores, baseline_scores)                       # Rel., as the paper

Submodules import lmms-eval lazily, so importing this package (as lmms-eval's plugin loader does) is cheap.
"""

import importlib

from promprune.eval import deferred

deferred.defer()  # lmms-eval's top-level `import evaluate` (one optional path) costs 3-4 s per process: on first use

_EXPORTS = {
    "build_requests": "promprune.eval.requests",
    "run_requests": "promprune.eval.requests",
    "score": "promprune.eval.scoring",
    "relative_score": "promprune.eval.scoring",
    "primary_score": "promprune.eval.scoring",
    "OFFLINE_TASKS": "promprune.eval.tasks",
    "EASYVQA_TASKS": "promprune.eval.tasks",
    "TESTBED_TASKS": "promprune.eval.tasks",
    "PAPER_TASKS": "promprune.eval.tasks",
    "PRIMARY_METRICS": "promprune.eval.tasks",
    "TaskUnavailableError": "promprune.eval.tasks",
    "prepare_offline_tasks": "promprune.eval.tasks",
    "judge_skip_reason": "promprune.eval.tasks",
    "PromPruneLMM": "promprune.eval.lmms_plugin",
    "build_standins": "promprune.eval.standins",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'promprune.eval' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
