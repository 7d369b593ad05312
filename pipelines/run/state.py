"""A sweep's state beside Tune's experiments (which MLflow parent run each experiment logs to, the resolved spec,
the command that started it, the calibrated mu) and `--resume`: find the run, refuse untrusted or changed state,
find the runs whose driver died; and `DriverLock`, one driver per sweep experiment."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import shlex
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from pipelines import paths
from pipelines import spec as specs
from pipelines.frontdoor import LOCK_SUFFIX, REPO, STATE_DIR, busy_message, idle_earlier_runs, local_holder, \
    parse_holder, runs_of
from pipelines.paths import STORAGE_ENV


def storage_root(spec: specs.SweepSpec) -> str:
    """Tune's storage: the spec's tune.storage_path, else $PROMPRUNE_STORAGE, else ./outputs/tune (a Ray job's:
    ~/promprune/outputs/tune, `pipelines.paths`). A relative local path (refused in a Ray job) is made absolute against
    the working directory here: pyarrow, which opens the sweep's state, takes no relative path."""
    return paths.absolute_storage(spec.tune.storage_path or os.environ.get(STORAGE_ENV) or paths.default_storage())


def outbox_dir(storage: str, experiment: str) -> Path:
    """Where a sweep's MLflow writes wait while the store does not answer (`pipelines.recording.outbox`): beside Tune's
    experiments on local storage; under ./outputs/outbox on remote storage (the driver uploads from local files)."""
    local = paths.local_storage(storage)
    return paths.outputs_dir() / "outbox" / experiment if local is None else local / STATE_DIR / f"{experiment}.outbox"


def _state_fs(storage: str):
    """(pyarrow filesystem, directory) of the sweep state records: local paths, s3://, gs://, ... alike."""
    import pyarrow
    import pyarrow.fs

    try:
        fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    except pyarrow.ArrowInvalid as exc:  # a scheme pyarrow has no filesystem for (s4://, ftp://): a traceback before
        raise specs.SpecError([f"the Tune storage {storage} is not a path or a URI pyarrow can open ({exc}); set "
                               f"tune.storage_path (or ${STORAGE_ENV}) to a local path or to s3://, gs:// or "
                               "hdfs:// storage every node reaches"], "tune.storage_path") from None
    return fs, f"{root.rstrip('/')}/{STATE_DIR}"


def save_state(storage: str, state: dict) -> None:
    """Write the run's state whole or not at all: into a temporary file moved into place, so a full disk leaves the
    last state written (remote stores write an object only once its upload completes)."""
    fs, d = _state_fs(storage)
    fs.create_dir(d, recursive=True)
    final = f"{d}/{state['experiment']}.json"
    tmp = f"{d}/.{state['experiment']}.json.{os.getpid()}.part"  # a dot first: never taken for a run's state
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(json.dumps(state, indent=2).encode())
        fs.move(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.delete_file(tmp)
        raise


def _state_names(storage: str, name: str, suffix: str = ".json") -> list[str]:
    """The experiments of spec `name` with a `suffix` file in the state directory (`frontdoor.runs_of`), oldest
    first."""
    import pyarrow.fs

    fs, d = _state_fs(storage)
    return runs_of(name, [f.base_name for f in fs.get_file_info(pyarrow.fs.FileSelector(d, allow_not_found=True))],
                   suffix)


def _read_state(storage: str, experiment: str) -> dict:
    fs, d = _state_fs(storage)
    with fs.open_input_stream(f"{d}/{experiment}.json") as f:
        raw = f.read()
    try:
        return json.loads(raw.decode())
    except ValueError:  # cut short by a full disk before states were written whole
        raise specs.SpecError([f"the state of run {experiment} ({d}/{experiment}.json, {len(raw)} bytes) is not "
                               "whole JSON (a write cut short, e.g. by a full disk); it cannot be resumed: start the "
                               "sweep anew"], "--resume") from None


def load_state(storage: str, name: str, resume: str, origin: str | None = None,
               spec: specs.SweepSpec | None = None) -> dict:
    """The saved state of run `resume` (an experiment name like quickstart-20261121-080000), or with 'latest' the
    newest run of spec `name`; given ``spec``, the newest run started with that resolved spec (`spec_matches`),
    passing over newer runs of another spec that finished, so that a quick ``--set limit=1`` check run after an
    interrupted run of the same spec file does not hide it (when none matches: `no_matching_run`); a newer run of
    another spec that did not finish is returned (`check_resume` refuses it, naming the fields and the command that
    resumes it: a bare ``--resume`` that left out the interrupted run's ``--set``). Kept beside Tune's state, so a
    resumed `ray job` finds it too. 'latest' while
    a newer run of the spec is still setting up (its driver holds its lock, it has saved no state yet) is that run:
    refused as busy (SpecError), never the older one; so is a run 'latest' found whose driver is alive, the refusal
    naming the spec's earlier runs no driver holds (`frontdoor.busy_message`: the one meant may be among them).
    ``origin``: what chose ``storage`` (`storage_origin`), for the refusal of a run not there."""
    found = _state_names(storage, name)
    if resume == "latest":
        for experiment in _state_names(storage, name, LOCK_SUFFIX):
            if not found or experiment > found[-1]:
                _refuse_if_live(storage, found, experiment)
        if found:
            state = _latest_of_spec(storage, spec, found) if spec is not None else _read_state(storage, found[-1])
            _refuse_if_live(storage, found, state["experiment"])  # naming the runs a bare --resume cannot reach
            return state
    experiment = resume
    if experiment not in found:
        raise specs.SpecError([missing_run(storage, name, None if resume == "latest" else resume, found, origin)],
                              "--resume")
    return _read_state(storage, experiment)


def _latest_of_spec(storage: str, spec: specs.SweepSpec, found: list[str]) -> dict:
    """The newest of the runs ``found`` (oldest first) started with ``spec``, or a newer run of another spec that did
    not finish (`run_unfinished`: the caller's `check_resume` refuses it by its differing fields, with its resume
    command; passed over, a bare ``--resume`` that left out that run's ``--set`` took an older finished run of
    ``spec`` and said there was nothing to resume); SpecError (`no_matching_run`) when none was. A state that cannot
    be read is passed over, unless it is the newest and no run matches (its own refusal, as before)."""
    states, damaged = [], None
    for experiment in reversed(found):
        try:
            state = _read_state(storage, experiment)
        except specs.SpecError as exc:
            damaged = damaged or (exc if experiment == found[-1] else None)
            continue
        if spec_matches(spec, state) or run_unfinished(state):
            return state
        states.append(state)
    if damaged is not None:
        raise damaged
    raise no_matching_run(spec, states)


def no_matching_run(spec: specs.SweepSpec, states: list[dict]) -> specs.SpecError:
    """The refusal of a bare ``--resume`` (latest) when no run of the spec's name was started with ``spec`` and every
    one finished (``states``: its runs, newest first; an unfinished one `_latest_of_spec` returns, for
    `check_resume` to refuse with its own resume command): the fields the newest differs in."""
    changed = spec_changes(states[0].get("spec_yaml"), specs.dump_resolved(spec))
    return specs.SpecError(changed, f"--resume: no run of sweep {spec.name!r} was started with this spec; the newest, "
                           f"{states[0]['experiment']}, differs",
                           fix="every run of this sweep finished (or was started with another spec and cannot be "
                               "told); to run this spec, leave out --resume")


def run_unfinished(state: dict) -> bool:
    """Whether the run of ``state`` may have something to resume: writes waiting in its outbox, or its MLflow parent
    run not FINISHED with every trial finished (`pipelines.sweep.finished_run` says what a resume of a finished
    one prints); a store that does not answer cannot tell: True."""
    from mlflow.exceptions import MlflowException

    from pipelines import mlflow_layout

    if (outbox_dir(state["storage_path"], state["experiment"]) / "outbox.json").is_file():
        return True
    try:
        run = mlflow_layout.client().get_run(state["parent_run_id"])
    except (MlflowException, OSError, KeyError):
        return True
    failed = run.data.metrics.get(mlflow_layout.TRIALS_FAILED)
    return run.info.status != "FINISHED" or failed is None or failed > 0


def storage_origin(spec: specs.SweepSpec) -> str:
    """What chose the sweep's Tune storage (`storage_root`), in words."""
    if spec.tune.storage_path:
        return "the spec's tune.storage_path"
    if os.environ.get(STORAGE_ENV):
        return f"${STORAGE_ENV}"
    if paths.in_ray_job():
        return f"a Ray job's default: outputs/tune in ${paths.HOME_ENV}, default ~/promprune"
    return "the default: outputs/tune in the working directory"


def missing_run(storage: str, name: str, experiment: str | None, found: list[str], origin: str | None) -> str:
    """The refusal of a `--resume` whose run has no state in ``storage`` (``experiment`` None: 'latest'). Nothing
    here can tell where the run's state is, if anywhere: a run started with another Tune storage keeps it there, so
    say where this one looked and which settings move it. Starting without --resume, the one fix it used to give,
    runs the whole sweep again and leaves the interrupted run unfinished."""
    what = f"no run {experiment!r}" if experiment else "no run"
    chosen = f", chosen by {origin}" if origin else ""
    return (f"{what} of sweep {name!r} in the Tune storage {storage}{chosen} (its runs' states are in "
            f"{storage}/{STATE_DIR}; found: {', '.join(found) or 'none'}). A run keeps its state in the storage it "
            f"started with: one started with ${STORAGE_ENV} or tune.storage_path set otherwise (for a Ray job, in "
            f"its --runtime-env-json's env_vars), from another working directory, or as a Ray job with another "
            f"${paths.HOME_ENV}, resumes only with the same setting, so give it as that run had it (a stopped Ray "
            "job printed its resume command with them); to run the sweep anew instead, leave out --resume")


def check_trusted_storage(storage: str, experiment: str) -> None:
    """`--resume` unpickles Tune's saved state (``tuner.pkl``, the searcher's and the scheduler's state, the trials'
    results and errors), so whoever can write it can run code in this driver. On a local file system refuse the run
    when anything it reads (`resume_reads`: every folder and file) is owned by another user or writable by others;
    remote stores (s3://, gs://) must be writable by you alone (bucket policy), which cannot be checked from here."""
    import stat

    local = paths.local_storage(storage)
    if local is None:
        return
    for path in resume_reads(local, experiment):
        try:
            info = path.stat()
        except OSError:  # gone meanwhile, or a dangling link: nothing there to unpickle
            continue
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            fix = f"chmod go-w {path}" if info.st_uid == os.getuid() else f"chown {os.getuid()} {path}"
            raise specs.SpecError([f"{path} is owned by another user or writable by others, and resuming reads and "
                                   "unpickles the Tune state kept there (whoever can write it can run code in this "
                                   f"process); fix its ownership/permissions ({fix}) or start a new sweep"],
                                  "--resume")


def resume_reads(root: Path, experiment: str):
    """Every folder and file under the Tune storage ``root`` that resuming ``experiment`` reads: the storage and
    its state folder themselves, the run's state files and outbox, each Tune experiment of the run
    (``<experiment>``, and ``<experiment>-<word>`` such as the search's ``-search``; ``-2`` is another run) and the
    run's saved blocks, each with everything below it."""
    from pipelines.run.checkpoints import BLOCKS_DIR

    state_dir, blocks = root / STATE_DIR, root / BLOCKS_DIR
    yield from (root, state_dir, blocks)
    trees = [state_dir / f"{experiment}{suffix}" for suffix in (".json", LOCK_SUFFIX, ".outbox")]
    trees.append(blocks / experiment)
    if root.is_dir():
        trees += sorted(entry for entry in root.iterdir() if entry.name == experiment or (
            entry.name.startswith(f"{experiment}-") and not entry.name[len(experiment) + 1:][:1].isdigit()))
    for tree in trees:
        if tree.exists() or tree.is_symlink():
            yield tree
        for folder, dirs, files in os.walk(tree):
            yield from (Path(folder) / name for name in sorted(dirs + files))


TUNE_STATE = "tuner.pkl"  # Tune's experiment state in each of its experiment folders: what `Tuner.restore` reads


def tune_experiments(storage: str, experiment: str) -> list[str]:
    """The Tune experiment folders of run ``experiment`` in ``storage`` (``<experiment>`` and the search's
    ``<experiment>-<word>``; ``-2`` is another run), as the storage's file system names them."""
    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    return sorted(info.path for info in fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
                  if info.type == pyarrow.fs.FileType.Directory and (info.base_name == experiment or (
                      info.base_name.startswith(f"{experiment}-")
                      and not info.base_name[len(experiment) + 1:][:1].isdigit())))


def unreadable_tune_state(path: str, size: int | None, why: str, state: dict) -> str:
    """The paragraph refusing the resume of a run whose Tune state ``path`` cannot be read."""
    bytes_ = f", {size} bytes" if size is not None else ""
    return (f"--resume {state['experiment']}: Tune's experiment state {path} cannot be read ({why}{bytes_}: a write "
            "cut short or the file damaged), so Tune cannot restore the run's trials and the run cannot be resumed. "
            "Run the sweep afresh: the same command without --resume (a new run answers every trial again: this "
            f"run's saved blocks are not reused); the trials this run finished stay in MLflow under its parent run "
            f"{state['parent_run_id']}")


def check_tune_state(state: dict) -> list[str]:
    """Each of the run's Tune experiments has a `tuner.pkl` that is a whole pickle (`pickletools` walks its opcodes
    to the final STOP) and loads as Tune's saved state (a mapping with the `__trainable_name` Tune writes), else one
    refusal naming the file: Tune's restore ended in "pickle data was truncated", or a class it could not find,
    as a traceback after Ray started. Loading runs after `check_trusted_storage` (a pickle runs code), as Tune's
    own restore would; it imports the Tune classes the state names, not Ray's runtime. A folder without the file is
    left to Tune (it starts that experiment anew)."""
    import pickle
    import pickletools

    import pyarrow.fs

    storage = state["storage_path"]
    fs, _ = pyarrow.fs.FileSystem.from_uri(storage)
    for folder in tune_experiments(storage, state["experiment"]):
        path = f"{folder}/{TUNE_STATE}"
        try:
            with fs.open_input_stream(path) as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        try:
            for _ in pickletools.genops(raw):
                pass
            saved = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways: ValueError, EOF, unknown ops,
            # a class that moved or is gone (ModuleNotFoundError, AttributeError)
            return [unreadable_tune_state(path, len(raw), f"{type(exc).__name__}: {exc}", state)]
        if not isinstance(saved, dict) or "__trainable_name" not in saved:
            what = f"a {type(saved).__name__}" + (" without the __trainable_name Tune writes"
                                                  if isinstance(saved, dict) else "")
            return [unreadable_tune_state(path, len(raw), f"not Tune's saved state: {what}", state)]
    return []


def resumed_state(spec: specs.SweepSpec, resume: str, environ=None) -> dict:
    """The saved state of the run `--resume` names ('latest': the newest started with this spec, `load_state`),
    checked once: the storage is trusted (`check_trusted_storage`) and the spec and the result-changing variables of
    ``environ`` (default ``os.environ``; the sweep passes its environment as started, before the spec's plugins are
    added to it) are the ones the run started with (`check_resume`). Raises SpecError otherwise, before anything
    expensive starts."""
    storage = storage_root(spec)
    state = load_state(storage, spec.name, resume, storage_origin(spec), spec)
    check_trusted_storage(storage, state["experiment"])
    check_resume(spec, state, environ)
    return state


def fingerprint(spec: specs.SweepSpec) -> str:
    """What a resumed sweep must match: the hash of the fully resolved spec."""
    return hashlib.sha256(specs.dump_resolved(spec).encode()).hexdigest()


def spec_fingerprint(resolved_yaml: str) -> str:
    """What the nightly regression check compares runs by (tag `promprune.spec_fingerprint` on a sweep's parent run,
    `pipelines.recording.tracking.previous_sweep`): the hash of the resolved spec (``specs.dump_resolved``), its
    `plugins` and `include_path` under the working directory named relative to it (`relative_path`), since a Ray
    job's working directory is a new package copy of the checkout whenever a file of it changed. The same as
    `fingerprint` for a spec naming neither."""
    data = yaml.safe_load(resolved_yaml) or {}
    for key in ("plugins", "include_path"):
        if isinstance(data.get(key), list):
            data[key] = [relative_path(p) if isinstance(p, str) and os.path.isabs(p) else p for p in data[key]]
    return hashlib.sha256(yaml.safe_dump(data, sort_keys=False).encode()).hexdigest()


def spec_changes(before_yaml: str | None, now_yaml: str | None) -> list[str]:
    """Each field two resolved specs (YAML) set differently, as ``field: before -> now``, sorted by field."""
    before, now = _flat(yaml.safe_load(before_yaml or "{}")), _flat(yaml.safe_load(now_yaml or "{}"))
    return [f"{k}: {before.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
            for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]


def check_resume(spec: specs.SweepSpec, state: dict, environ=None) -> None:
    """A resumed sweep must be the sweep it resumes: any difference in the resolved spec would mix two experiments
    in one parent run. Raises SpecError naming every changed field and the command that resumes the original. A field
    the code has gained since the run started (absent from its saved spec) that holds its default is no difference:
    a new field's default is what the code did before it (a run started before ``resources.load_timeout_s`` existed
    resumes). So too the variables that change results (`pipelines.environment.RESULT_VARIABLES`: the testbed's
    weights, the entropy's route, plugins, task directories): ``environ`` (default ``os.environ``) must give each the
    value the run's state recorded (`check_environment_unchanged`), and testbed:llava's weights must be those the
    run recorded (`check_weights_unchanged`)."""
    check_environment_unchanged(state, environ, spec)
    check_weights_unchanged(spec, state)
    if spec_matches(spec, state):
        return
    changed = spec_changes(state.get("spec_yaml"), specs.dump_resolved(spec))
    raise specs.SpecError(changed, f"--resume {state['experiment']}: the spec differs from the one that run started "
                          "with", fix=f"resume the original with: {resume_command(state)}")


def spec_matches(spec: specs.SweepSpec, state: dict) -> bool:
    """Whether the run of ``state`` was started with ``spec``: the same resolved spec, or one that differs only by
    fields the code has gained since, each at its default (`check_resume`)."""
    if state.get("fingerprint") == fingerprint(spec):
        return True
    before = _flat(yaml.safe_load(state.get("spec_yaml") or "{}"))
    now = _flat(yaml.safe_load(specs.dump_resolved(spec)))
    return all(key not in before and _new_at_default(spec, key) for key in set(before) | set(now)
               if before.get(key) != now.get(key))


TESTBED_MODEL = "testbed:llava"  # the model whose weights a state records by their sha256 (`weights_sha256`)


def weights_sha256(spec: specs.SweepSpec) -> str | None:
    """The sha256 of the weights the spec's model loads here, where there is a cheap handle on it: for
    ``testbed:llava`` its manifest's (`promprune.testbed.zoo.weights_sha256`); None otherwise (a hub model: its
    revision is the spec's)."""
    if spec.model.pretrained != TESTBED_MODEL:
        return None
    from promprune.testbed import zoo

    return zoo.weights_sha256()


def check_weights_unchanged(spec: specs.SweepSpec, state: dict) -> None:
    """SpecError when the run of ``state`` recorded the sha256 of its model's weights (``weights_sha256``, with the
    mu it calibrated on them) and the spec's model loads other weights here (the shipped weights changed since, or a
    ``$PROMPRUNE_TESTBED_WEIGHTS`` folder rewritten in place): the finished trials and the resumed ones would be two
    models under one parent run."""
    recorded = state.get("weights_sha256")
    if recorded is None:
        return
    now = weights_sha256(spec)
    if now != recorded:
        other = f"weights with sha256 {now}" if now else "other weights"
        raise specs.SpecError(
            [f"the run started on {spec.model.pretrained} weights with sha256 {recorded}, and its finished trials and "
             f"calibrated mu are theirs; this resume would load {other} (the shipped weights changed since, or the "
             "folder of $PROMPRUNE_TESTBED_WEIGHTS was rewritten). Put "
             "those weights back to resume it, or run the sweep afresh without --resume"],
            f"--resume {state['experiment']}")


def check_environment_unchanged(state: dict, environ=None, spec: specs.SweepSpec | None = None) -> None:
    """SpecError, one paragraph, when a variable that changes results (`pipelines.environment.result_changes`) has
    another value in ``environ`` (default ``os.environ``) than in the environment the run of ``state`` recorded
    (``command.env``, `launch_command`): each named with both values, and the command that resumes with the
    recorded ones. A bare ``--resume`` from a shell without ``PROMPRUNE_TESTBED_WEIGHTS`` ran the rest of the trials
    on the shipped weights with the mu calibrated on the other ones, exit 0, and saved the state's command without
    the variable. Task directories (``PROMPRUNE_INCLUDE_PATH``) are compared as the directories they name, a relative
    one against the working directory the state recorded (``command.cwd``; where it recorded none, only with another
    relative one, both from here). A state that recorded no environment (one saved by `pipelines.sweep.run_sweep`
    called without a command, or an empty one for a run not submitted as a ray job, as code of 2026-12-06 / 07
    recorded whatever the run had set) cannot be checked. ``spec``: its own plugins and include_path are no
    difference (`pipelines.plugins.activate` adds them to the environment of the process that checks)."""
    from pipelines.environment import result_changes

    command = state.get("command") or {}
    recorded = command.get("env")
    # code of 2026-12-06/07 recorded {} for a run not submitted as a ray job, whatever it had set: not recorded
    if recorded is None or not recorded and not command.get("ray_job"):
        return
    own = {} if spec is None else {"PROMPRUNE_PLUGINS": spec.plugins, "PROMPRUNE_INCLUDE_PATH": spec.include_path}
    # the spec's own plugins: in the environment once activated; relative task directories: against the run's cwd
    changes = result_changes(recorded, environ, own, command.get("cwd"))
    if not changes:
        return
    here = os.getcwd()
    shown = "; ".join(f"{name} was {_shown(was)}{_relative_to(name, was, command.get('cwd'))}, now {_shown(now)}"
                      f"{_relative_to(name, now, here)}" for name, was, now in changes)
    drop = [name for name, was, now in changes if was is None]
    unset = f"unset {' '.join(drop)}, then " if drop else ""
    raise specs.SpecError(
        [f"the run started with other values of variables that change its results ({shown}): its finished trials "
         "ran with the recorded values (its calibrated mu was measured with them), so trials resumed with these "
         "would mix two experiments in one parent run. Resume with the recorded values: "
         f"{unset}{resume_command(state)}"], f"--resume {state['experiment']}")


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def _relative_to(name: str, value: str | None, cwd: str | None) -> str:
    """Where a task directory list's relative entries are relative to, shown beside it (``./tasks`` from two folders
    names two directories), when it has one and ``cwd`` is known."""
    if name != "PROMPRUNE_INCLUDE_PATH" or not value or cwd is None:
        return ""
    relative = [e for e in value.split(os.pathsep) if e.strip() and not os.path.isabs(os.path.expanduser(e))]
    return f" (in {cwd})" if relative else ""


def _new_at_default(spec, key: str) -> bool:
    """Whether field ``key`` (dotted, as `_flat` names it) of ``spec`` is a declared field of one of its sections
    (dataclasses: `Resources`, `ModelSource`, ...) holding its declared default; False for keys of free mappings
    (``grid``, options), whose absence is no default."""
    *parents, name = key.split(".")
    section = spec
    for part in parents:
        section = getattr(section, part, None) if dataclasses.is_dataclass(section) else None
    if not dataclasses.is_dataclass(section):
        return False
    for declared in dataclasses.fields(section):
        if declared.name == name:
            if declared.default is not dataclasses.MISSING:
                return getattr(section, name) == declared.default
            if declared.default_factory is not dataclasses.MISSING:
                return getattr(section, name) == declared.default_factory()
    return False


def without_gained_defaults(spec, before_yaml: str | None) -> tuple[str, list[str]] | None:
    """``spec`` resolved (``specs.dump_resolved``) as the code resolved it when an earlier run saved ``before_yaml``
    (that run's resolved spec), with the fields the code has gained since: the YAML without them, and their dotted
    names. Only when there are such fields (absent from ``before_yaml``) and each is a declared field holding its
    declared default (`_new_at_default`, as `check_resume` decides: a new field's default is what the code did before
    it, so the run is the same experiment; a free mapping's new key, ``grid.mu``, is no default). None otherwise.
    The nightly regression check hashes the YAML (`spec_fingerprint`) to find a night recorded before a field
    existed (`pipelines.recording.tracking.previous_sweep`); every other field must match for the hashes to."""
    before = _flat(yaml.safe_load(before_yaml or "{}"))
    now = yaml.safe_load(specs.dump_resolved(spec))
    gained = [key for key in _flat(now) if key not in before]
    if not gained or not all(_new_at_default(spec, key) for key in gained):
        return None
    for key in gained:  # a section that is new as a whole goes too; one the earlier spec had stays, even emptied
        *parents, name = key.split(".")
        sections = [now]
        for part in parents:
            sections.append(sections[-1][part])
        del sections[-1][name]
        for depth in range(len(parents), 0, -1):
            if sections[depth] or ".".join(parents[:depth]) in before:
                break
            del sections[depth - 1][parents[depth - 1]]
    return yaml.safe_dump(now, sort_keys=False), gained


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for key, value in (d or {}).items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# the options of pipelines/sweep.py that change what a run does beyond its spec, as (option, the state's key): the
# state keeps them and `--resume` restores them (a resumed nightly without its threshold exited 0 unchecked and, ending
# FINISHED, became the next night's baseline). --verbose and --validate-only change only what is shown.
RUN_OPTIONS = (("--address", "address"), ("--regression-threshold", "regression_threshold"))


SWEEP_SCRIPT = "pipelines/sweep.py"  # the driver, from the checkout's root (a Ray job's working directory)


def launch_command(config: str, overrides: list[str], *, regression_threshold: float | None = None,
                   address: str | None = None, environ=None) -> dict:
    """What a run's state keeps of the command that started (or last resumed) it: the spec file and the sweep's
    script (each relative to the working directory when it lies under it, `relative_path`), the --set overrides, the
    `RUN_OPTIONS` given, whether it ran as a Ray job, and then whether its head enforced Ray's token
    (`pipelines.paths.token_auth`) and the variables of ``environ`` (default ``os.environ``, as the process started:
    before the spec's plugins are added to it) the run depends on (`pipelines.environment.run_settings`: its
    runtime env's MLflow store and Tune storage, which a resumed run needs again: a job's and a local run's, whose
    command may be typed in another shell), and outside a Ray job the working directory (``cwd``: what a relative
    ``PROMPRUNE_INCLUDE_PATH`` entry is relative to, `check_environment_unchanged`). `resume_command` prints it back;
    `restore_options` gives a `--resume` the options it leaves out."""
    from pipelines.environment import run_settings

    environ = os.environ if environ is None else environ
    ray_job = bool(environ.get(paths.JOB_ENV))
    # relative: a Ray job's default spec was the absolute path of Ray's package copy of the checkout
    # (<ray temp>/session_*/.../_ray_pkg_*/sweeps/quickstart.yaml), which a resumed job's new copy is not
    # the script as this folder reaches it: a sweep started from elsewhere (`python <clone>/pipelines/sweep.py`) was
    # told to resume with `python pipelines/sweep.py`, which no folder holding its records could run
    script = SWEEP_SCRIPT if ray_job else relative_path(str(REPO / SWEEP_SCRIPT))
    # the working directory a relative task directory of the environment names a folder of (a Ray job's is Ray's
    # package copy of the checkout, which a resumed job gets anew, elsewhere: not kept, its relative entries are
    # compared as relative ones, `pipelines.environment.result_changes`)
    return {"config": relative_path(config), "overrides": list(overrides), "ray_job": ray_job, "script": script,
            "regression_threshold": regression_threshold, "address": address,
            "env": run_settings(environ), "token_auth": ray_job and paths.token_auth(environ),
            "cwd": None if ray_job else os.getcwd()}


def relative_path(path: str) -> str:
    """``path`` relative to the working directory when it lies under it (directly or through links), else as
    given."""
    here = os.getcwd()
    for full, root in ((Path(os.path.abspath(path)), Path(here)), (Path(path).resolve(), Path(here).resolve())):
        if full.is_relative_to(root):
            return str(full.relative_to(root))
    return path


def restore_options(args, state: dict) -> list[str]:
    """Give ``args`` (the sweep's parsed command line) the `RUN_OPTIONS` the run of ``state`` started with that the
    `--resume` leaves out; returns one note per option restored or given otherwise."""
    saved = state.get("command") or {}
    notes = []
    for option, key in RUN_OPTIONS:
        was, now = saved.get(key), getattr(args, key)
        if was is None or now == was:
            continue
        if now is None:
            setattr(args, key, was)
            notes.append(f"note: --resume {state['experiment']}: the run started with {option} {was}, which applies "
                         f"again (give {option} to change it)")
        else:
            notes.append(f"note: --resume {state['experiment']}: the run started with {option} {was}; this resume "
                         f"uses {option} {now}")
    return notes


def resume_command(state: dict) -> str:
    """The command that resumes the run of `state`: the spec file, every --set override and every `RUN_OPTIONS` it
    started with, and the variables it depended on (`pipelines.environment.run_settings`): as a Ray job when it ran
    as one, its state being on the head, with them in its runtime env (`pipelines.paths.submit_command`); else with
    them set in front (``PROMPRUNE_STORAGE=/x python ...``: without it a resume in another shell looked for the run's
    state elsewhere and was refused)."""
    cmd = state.get("command") or {}
    parts = ["python", cmd.get("script", SWEEP_SCRIPT), "--config", cmd.get("config", "<spec.yaml>")]
    for item in cmd.get("overrides", []):
        parts += ["--set", item]
    for option, key in RUN_OPTIONS:
        if cmd.get(key) is not None:
            parts += [option, str(cmd[key])]
    command = " ".join(shlex.quote(p) for p in parts + ["--resume", state["experiment"]])
    if not cmd.get("ray_job"):
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (cmd.get("env") or {}).items()), command])
    return paths.submit_command(command, cmd.get("env"), token=cmd.get("token_auth", True))  # older states: token


def _driver_alive(driver: dict | None) -> bool | None:
    """Whether the driver process that wrote a state is alive (None: not this host, cannot tell)."""
    if not driver or driver.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(driver["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def dead_runs(storage: str, name: str, keep: str | None = None) -> list[tuple[str, dict]]:
    """The runs of sweep `name` whose driver on this host died (SIGKILL, a lost node) without finishing and left no
    writes waiting for the store (an outbox: `--resume` sends them): (experiment, its state), oldest first. ``keep``:
    the experiment being resumed, left out. A damaged state says nothing about its driver and is left out too, and
    so is a run whose lock a live driver holds: its resume, setting up, has not yet saved its own pid in the state
    (a new run of the spec starting meanwhile marked the run it was resuming KILLED).
    `pipelines.recording.tracking.mark_dead_runs` marks their MLflow runs."""
    dead = []
    for experiment in _state_names(storage, name):
        if experiment == keep:
            continue
        try:
            state = _read_state(storage, experiment)
        except specs.SpecError:
            continue
        if _driver_alive(state.get("driver")) is not False:
            continue
        if DriverLock(storage, experiment)._holder() is not None:
            continue
        if (outbox_dir(storage, experiment) / "outbox.json").is_file():
            continue
        dead.append((experiment, state))
    return dead


# ----------------------------------------------------------------------------------------------------------------
# one driver per sweep

# remote storage (s3://, gs://) has no kernel lock: its driver rewrites the lock file this often, and a lock whose
# driver is on another host counts as dead once it has not been rewritten for STALE_AFTER_S (four beats missed, as
# an object store's write can stall for a beat or two)
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0


class DriverLock:
    """One driver per sweep experiment: ``<storage>/_promprune_state/<experiment>.lock``, beside the experiment's
    state, naming the driver that holds it (host, pid, since when). A context manager; `release` lets it go.

    On a local path (and NFS, where Linux maps ``flock`` onto NFS locks) the file carries a kernel lock (``flock``)
    while its driver runs. The kernel drops it when the process ends however it ends (SIGKILL, out of memory), so a
    killed driver's lock never blocks its resume, and two drivers never hold it at once. Remote storage (s3://,
    gs://) has no such lock, and there it is best effort: the driver rewrites the file every `HEARTBEAT_S`; the lock
    is live while its pid runs (a driver on this host) or while its last rewrite is younger than `STALE_AFTER_S`
    (another host), and taken over otherwise; taking it is a write and a read back, so two drivers that start within
    the same moment could both pass.
    """

    def __init__(self, storage: str, experiment: str):
        import pyarrow.fs

        self.storage, self.experiment = storage, experiment
        self._fs, state_dir = _state_fs(storage)
        self._local = isinstance(self._fs, pyarrow.fs.LocalFileSystem)
        self._state_dir, self.path = state_dir, f"{state_dir}/{experiment}{LOCK_SUFFIX}"
        self.info = {"host": socket.gethostname(), "pid": os.getpid(),
                     "since": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "experiment": experiment}
        self._fd: int | None = None
        self._stop: threading.Event | None = None

    @classmethod
    def new(cls, storage: str, name: str) -> DriverLock:
        """The lock of a new experiment, ``<name>-<UTC time to the second>``, or ``...-2``, ``-3``, ... when another
        sweep of the spec took that name (started in the same second)."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        for n in itertools.count(1):
            lock = cls(storage, f"{name}-{stamp}" + (f"-{n}" if n > 1 else ""))
            if lock._claim(new=True) is None:
                return lock
        raise AssertionError("unreachable")

    @classmethod
    def resume(cls, storage: str, experiment: str) -> DriverLock:
        """The lock of an experiment to resume; SpecError naming its driver when a live one holds it."""
        lock = cls(storage, experiment)
        holder = lock._claim(new=False)
        if holder is not None:
            raise busy_error(experiment, holder)
        return lock

    def raise_if_held(self) -> None:
        """SpecError naming the driver when a live one holds this lock (the lock is not taken)."""
        holder = self._holder()
        if holder is not None:
            raise busy_error(self.experiment, holder)

    # the two kinds of storage ----------------------------------------------------------------------------------

    def _claim(self, new: bool) -> dict | None:
        """Take the lock (``new``: only if the name was never used); None when taken, else what holds it."""
        self._fs.create_dir(self._state_dir, recursive=True)
        if new and self._exists(f"{self._state_dir}/{self.experiment}.json"):
            return {"experiment": self.experiment}  # a run of this name exists (started before locks did)
        return self._claim_local(new) if self._local else self._claim_remote(new)

    def _claim_local(self, new: bool) -> dict | None:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (os.O_EXCL if new else 0), 0o644)
        except FileExistsError:
            return {"experiment": self.experiment}
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = parse_holder(os.pread(fd, 1 << 16, 0))
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.info).encode(), 0)
        self._fd = fd
        return None

    def _claim_remote(self, new: bool) -> dict | None:
        holder = self._read()
        if holder is not None and (new or _holder_alive(holder)):
            return holder
        self._write()
        back = self._read()
        if not _same_driver(back, self.info):  # another driver wrote after us: it holds the lock
            return back
        self._stop = threading.Event()
        threading.Thread(target=self._beat, args=(self._stop,), daemon=True, name="driver-lock-heartbeat").start()
        return None

    def _holder(self) -> dict | None:
        """What holds the lock now (None: nobody alive), without taking it."""
        if self._local:
            return local_holder(self.path)
        holder = self._read()
        return holder if holder is not None and _holder_alive(holder) else None

    def _exists(self, path: str) -> bool:
        import pyarrow.fs

        return self._fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound

    def _read(self) -> dict | None:
        try:
            with self._fs.open_input_stream(self.path) as f:
                return parse_holder(f.read())
        except FileNotFoundError:
            return None

    def _write(self) -> None:
        with self._fs.open_output_stream(self.path) as f:
            f.write(json.dumps({**self.info, "beat": time.time()}).encode())

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat is retried at the next; STALE_AFTER_S allows four
                self._write()

    # -------------------------------------------------------------------------------------------------------------

    def release(self) -> None:
        """Let the lock go (a no-op when not held): the kernel lock, or the heartbeat and the remote file."""
        if self._fd is not None:
            os.close(self._fd)  # drops the flock; the file stays, so its name is never given to a new experiment
            self._fd = None
        if self._stop is not None:
            self._stop.set()
            self._stop = None
            if _same_driver(self._read(), self.info):
                with contextlib.suppress(FileNotFoundError):
                    self._fs.delete_file(self.path)

    def __enter__(self) -> DriverLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def driver_lock(spec: specs.SweepSpec, state: dict | None) -> DriverLock:
    """The lock of the run `state` resumes (SpecError when its driver is alive), or of a new run of ``spec``."""
    storage = storage_root(spec)
    try:
        return DriverLock.new(storage, spec.name) if state is None else DriverLock.resume(storage, state["experiment"])
    except OSError as exc:  # a storage this user cannot write: said before Ray starts, not as a traceback
        raise specs.SpecError([f"the Tune storage {storage} cannot hold the sweep's state ({type(exc).__name__}: "
                               f"{exc}); set tune.storage_path (or ${STORAGE_ENV}) to a place you can write"],
                              "tune.storage_path") from None


def _same_driver(a: dict | None, b: dict) -> bool:
    return a is not None and all(a.get(k) == b[k] for k in ("host", "pid", "since"))


def _holder_alive(holder: dict) -> bool:
    """A remote lock's driver is alive: by its pid on this host, by its last heartbeat on another."""
    alive = _driver_alive(holder)
    if alive is not None:
        return alive
    return time.time() - float(holder.get("beat") or 0) < STALE_AFTER_S


def busy_error(experiment: str, holder: dict, earlier: list[str] | None = None) -> specs.SpecError:
    """The refusal of a second driver (`frontdoor.busy_message`: who runs the sweep, since when, how to stop it;
    ``earlier``: the spec's earlier runs no driver holds, for a bare --resume)."""
    return specs.SpecError([busy_message(experiment, holder, earlier)], f"--resume {experiment}")


def _refuse_if_live(storage: str, found: list[str], experiment: str) -> None:
    """For a bare ``--resume`` that found ``experiment``: SpecError when a live driver holds it, naming the runs in
    ``found`` older than it that none holds, newest first (`frontdoor.idle_earlier_runs`)."""
    holder = DriverLock(storage, experiment)._holder()
    if holder is not None:
        held = lambda run: DriverLock(storage, run)._holder() is not None  # noqa: E731
        raise busy_error(experiment, holder, idle_earlier_runs(experiment, found, held))
