"""The environment variables PromPrune reads, and what each takes, checked before any work (``check_environment``).

A value the code does not take was found only where it was read: ``PROMPRUNE_ENTROPY=exakt`` failed every PromPrune
sample of a sweep inside its workers, and the sweep exited 0; ``PROMPRUNE_STORE_WAIT_S=abc`` stopped a whole sweep at
its end. A name one edit away from one of these (``PROMPRUNE_ENTROPHY``) is a typo the code would ignore, so it is
refused with the name meant; any other unknown ``PROMPRUNE_*`` name is said once as a note.
"""
from __future__ import annotations

import math
import os
from typing import Callable

from promprune.env import ENTROPY_MODES
from promprune.suggest import closest


def _seconds(value: str) -> bool:
    try:
        return math.isfinite(float(value)) and float(value) >= 0
    except ValueError:
        return False


def _one_of(*values: str, fold: bool = False) -> tuple[str, Callable[[str], bool]]:
    """``values`` exactly as the code compares them (``fold``: it strips and lowercases first)."""
    return " or ".join(repr(v) for v in values if v), \
        lambda value: (value.strip().lower() if fold else value) in values


PREFIX = "PROMPRUNE_"
_FLAG = _one_of("0", "1")
_SECONDS = ("seconds (a number >= 0)", _seconds)
_ANY = None
# name -> None (any value: a path, a list of paths, a URI checked where the spec's storage is) or (what it takes,
# whether a value is one of them)
VARIABLES: dict[str, tuple[str, Callable[[str], bool]] | None] = {
    "PROMPRUNE_ACCEL": _FLAG,  # the selection's GPU fast path (promprune.selection.accel)
    "PROMPRUNE_ENTROPY": _one_of(*ENTROPY_MODES),  # how PromPrune's split reads the entropy
    "PROMPRUNE_GRAPHS": _FLAG,  # the selection as CUDA graphs
    "PROMPRUNE_STORE_WAIT_S": _SECONDS,  # the end of a sweep's wait for MLflow
    "PROMPRUNE_RAY_START_WAIT_S": _SECONDS,  # a local Ray node's registration
    "PROMPRUNE_TESTBED_RETRAIN": _one_of("0", "1", "true", "false", "yes", "no", "", fold=True),
    "PROMPRUNE_MLFLOW_TEMPLATE": _FLAG,  # the new MLflow store copied from a template
    "PROMPRUNE_TESTBED_WEIGHTS": _ANY,
    "PROMPRUNE_CACHE": _ANY,
    "PROMPRUNE_HOME": _ANY,
    "PROMPRUNE_STORAGE": _ANY,
    "PROMPRUNE_PLUGINS": _ANY,
    "PROMPRUNE_INCLUDE_PATH": _ANY,
    "PROMPRUNE_TIMELINE": _ANY,
    # the scripts' (scripts/canary.sh, .ci/run)
    "PROMPRUNE_CANARY_REUSE": _ANY,
    "PROMPRUNE_CANARY_PYTHON": _ANY,
    "PROMPRUNE_CANARY_VENV": _ANY,
    "PROMPRUNE_CI_VENV": _ANY,
}
SCRIPTS_ONLY = frozenset(name for name in VARIABLES if name.startswith(("PROMPRUNE_CANARY_", "PROMPRUNE_CI_")))
# beyond PROMPRUNE_*: MLflow's store and experiment, read by `pipelines.mlflow_layout`
MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")
# where the Hugging Face hub, datasets and transformers (and lmms-eval's dataset cache) find their files, and whether
# they may go online: an offline cluster's jobs set them (docs/pipeline.md), and a resume without them went online
# or looked in ~/.cache. Switches and folders only: a token (HF_TOKEN) is never one of them.
OFFLINE_VARIABLES = ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
                     "LMMS_EVAL_DATASETS_CACHE")


# The variables whose value changes what a sweep's trials compute or record, each with what the code takes when it is
# unset: a `--resume` is refused when one differs from the value its run started with (`result_changes`), since the
# finished trials and the resumed ones would be two experiments under one parent run (the state's calibrated mu, too,
# was measured on the first run's model). PROMPRUNE_TESTBED_WEIGHTS, PROMPRUNE_TESTBED_RETRAIN: which weights
# testbed:llava loads; PROMPRUNE_ENTROPY: the entropy each PromPrune sample records (the counts are the same on every
# route); PROMPRUNE_ACCEL: on CUDA the entropy's route and the rounding of fp16/bf16 Grams; PROMPRUNE_PLUGINS,
# PROMPRUNE_INCLUDE_PATH: what a method's or a task's name runs. The others change where files are (STORAGE, HOME,
# CACHE, TIMELINE), how long to wait (STORE_WAIT_S, RAY_START_WAIT_S), how a store is made (MLFLOW_TEMPLATE) or how
# fast the same selection runs (GRAPHS: CUDA graphs of the eager computation), and may differ on a resume.
RESULT_VARIABLES: dict[str, str] = {
    "PROMPRUNE_TESTBED_WEIGHTS": "",
    "PROMPRUNE_TESTBED_RETRAIN": "",
    "PROMPRUNE_ENTROPY": "auto",
    "PROMPRUNE_ACCEL": "1",
    "PROMPRUNE_PLUGINS": "",
    "PROMPRUNE_INCLUDE_PATH": "",
}


def _as_read(name: str, value: str | None, own=(), base: str | None = None):
    """``value`` of variable ``name`` (None: unset) as the code reads it, so that values it takes alike compare
    equal (unset and its default, ``RETRAIN=no`` and unset, a path list's empty entries; ``own``: the entries of a
    path list the spec adds itself, `pipelines.plugins.activate`). ``PROMPRUNE_INCLUDE_PATH``'s entries are the
    directories they name (`_directory`, a relative one against ``base``), so that ``./tasks``, ``tasks/``,
    ``a/../tasks`` and its absolute path are one. ``PROMPRUNE_PLUGINS``'s stay as written: an entry may be a module
    name, which is no path (`promprune.plugins.is_path`)."""
    value = RESULT_VARIABLES[name] if value is None else value
    if name == "PROMPRUNE_TESTBED_RETRAIN":
        return value.strip().lower() in ("1", "true", "yes")
    if name == "PROMPRUNE_ACCEL":
        return value != "0"
    if name == "PROMPRUNE_PLUGINS":
        return [entry for entry in value.split(os.pathsep) if entry.strip() and entry not in own]
    if name == "PROMPRUNE_INCLUDE_PATH":
        owned = {_directory(entry, None) for entry in own}  # the spec's: absolute (`pipelines.plugins`)
        named = [_directory(entry, base) for entry in value.split(os.pathsep) if entry.strip()]
        return [entry for entry in named if entry not in owned]
    return value


def _directory(entry: str, base: str | None) -> tuple[bool, str]:
    """The directory a task-directory entry names, as ``(anchored, real path)``: an absolute entry (after ``~``),
    or a relative one where ``base`` (the working directory it was given in) is known, by its real path (links
    resolved, ``..`` and a trailing slash gone: `os.path.realpath`), anchored. A relative one without ``base`` is
    resolved against this process's working directory but not anchored: it is one with another relative entry that
    names the same directory from here (the same working directory, as an equal string always was), never with an
    absolute one, since the working directory it was given in is not known."""
    path = os.path.expanduser(entry)
    if os.path.isabs(path) or base is not None:
        return True, os.path.realpath(os.path.join(base or "", path))
    return False, os.path.realpath(path)


def result_changes(recorded: dict[str, str], environ=None, own: dict[str, list[str]] | None = None,
                   cwd: str | None = None) -> list[tuple[str, str | None, str | None]]:
    """The `RESULT_VARIABLES` whose value in ``environ`` (default ``os.environ``) the code reads otherwise than the
    value in ``recorded`` (a run's `run_settings`): ``(name, recorded value, current value)``, None for unset.
    ``own``: per variable, the entries the spec itself adds (its plugins, its include_path), which the spec's own
    check covers and a process that activated them already holds. ``cwd``: the working directory ``recorded`` was
    read in (`pipelines.run.state.launch_command`; None: not recorded), what a relative task directory of it is
    relative to, as one of ``environ`` is to this process's (`_directory`)."""
    environ = os.environ if environ is None else environ
    own = own or {}
    here = None if cwd is None else os.getcwd()
    return [(name, recorded.get(name), environ.get(name)) for name in RESULT_VARIABLES
            if _as_read(name, recorded.get(name), own.get(name, ()), cwd)
            != _as_read(name, environ.get(name), own.get(name, ()), here)]


def run_settings(environ=None) -> dict[str, str]:
    """The variables set in ``environ`` (default ``os.environ``) that a sweep's run depends on: MLflow's store and
    experiment, each ``PROMPRUNE_*`` variable the pipeline reads (`VARIABLES`, the scripts' left out) and where the
    hub's files are and whether it may go online (`OFFLINE_VARIABLES`: an offline cluster's ``HF_HOME``,
    ``HF_HUB_OFFLINE``, ...). A Ray job
    that stopped passes them again in its resume command's ``--runtime-env-json`` (`pipelines.run.state`): without
    its ``PROMPRUNE_STORAGE`` the resume looked for the run's state elsewhere and was refused. Names and values
    only; nothing here holds a secret (an API key's variable is not one of them, nor ``HF_TOKEN``)."""
    environ = os.environ if environ is None else environ
    names = [*MLFLOW_VARIABLES, *sorted(n for n in VARIABLES if n not in SCRIPTS_ONLY), *OFFLINE_VARIABLES]
    return {name: environ[name] for name in names if name in environ}


def check_environment(environ=None) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of the ``PROMPRUNE_*`` variables in ``environ`` (default ``os.environ``): a value a
    variable does not take, or an unknown name close to a known one (a problem, naming the one meant); any other
    unknown name (a note)."""
    environ = os.environ if environ is None else environ
    problems, notes = [], []
    for name in sorted(n for n in environ if n.startswith(PREFIX)):
        value = environ[name]
        if name in VARIABLES:
            rule = VARIABLES[name]
            if rule is not None:
                takes, ok = rule
                if not ok(value):
                    problems.append(f"environment variable {name}={value!r}: it takes {takes}; set such a value "
                                    "or unset it (docs/pipeline.md, \"Environment variables\")")
            continue
        meant = closest(name[len(PREFIX):], [known[len(PREFIX):] for known in VARIABLES])  # the prefix matches all
        if meant is not None:
            meant = PREFIX + meant
            problems.append(f"environment variable {name} is not one PromPrune reads: did you mean {meant}? Rename "
                            "it (as it is, nothing reads it and the default applies)")
        else:
            notes.append(f"note: environment variable {name} is not one PromPrune reads; it is ignored")
    return problems, notes
