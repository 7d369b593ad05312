"""A sweep's state beside Tune's experiments (which MLflow parent run each experiment logs to, the resolved spec,
the command that started it, the calibrated mu) and `--resume`: find the run, refuse untrusted or changed state,
mark the runs of drivers that died."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
from pathlib import Path

import yaml

from pipelines import mlflow_layout, tracking
from pipelines import spec as specs

STATE_DIR = "_promprune_state"  # beside Tune's experiments: which MLflow parent run each experiment logs to
STORAGE_ENV = "PROMPRUNE_STORAGE"  # Tune storage every node reaches (s3://..., NFS) when the spec sets none


def storage_root(spec: specs.SweepSpec) -> str:
    """Tune's storage: the spec's tune.storage_path, else $PROMPRUNE_STORAGE, else ./outputs/tune (local runs)."""
    return spec.tune.storage_path or os.environ.get(STORAGE_ENV) or str((Path.cwd() / "outputs" / "tune").resolve())


def outbox_dir(storage: str, experiment: str) -> Path:
    """Where a sweep's MLflow writes wait while the store does not answer (`pipelines.run.outbox`): beside Tune's
    experiments on local storage; under ./outputs/outbox on remote storage (the driver uploads from local files)."""
    if "://" in storage and not storage.startswith("file://"):
        return Path.cwd() / "outputs" / "outbox" / experiment
    return Path(storage.removeprefix("file://")) / STATE_DIR / f"{experiment}.outbox"


def _state_fs(storage: str):
    """(pyarrow filesystem, directory) of the sweep state records: local paths, s3://, gs://, ... alike."""
    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    return fs, f"{root.rstrip('/')}/{STATE_DIR}"


def save_state(storage: str, state: dict) -> None:
    fs, d = _state_fs(storage)
    fs.create_dir(d, recursive=True)
    with fs.open_output_stream(f"{d}/{state['experiment']}.json") as f:
        f.write(json.dumps(state, indent=2).encode())


def _state_names(storage: str, name: str) -> list[str]:
    import pyarrow.fs

    fs, d = _state_fs(storage)
    return sorted(info.base_name[:-len(".json")] for info in fs.get_file_info(pyarrow.fs.FileSelector(
        d, allow_not_found=True)) if info.base_name.startswith(f"{name}-") and info.base_name.endswith(".json"))


def _read_state(storage: str, experiment: str) -> dict:
    fs, d = _state_fs(storage)
    with fs.open_input_stream(f"{d}/{experiment}.json") as f:
        return json.loads(f.read().decode())


def load_state(storage: str, name: str, resume: str) -> dict:
    """The saved state of run `resume` (an experiment name like quickstart-20261121-080000), or with 'latest' the
    newest run of spec `name`. Kept beside Tune's state, so a resumed `ray job` finds it too."""
    found = _state_names(storage, name)
    experiment = found[-1] if resume == "latest" and found else resume
    if experiment not in found:
        raise specs.SpecError([f"no run {experiment!r} of sweep {name!r} under {storage}/{STATE_DIR} (found: "
                               f"{', '.join(found) or 'none'}); start it without --resume"], "--resume")
    return _read_state(storage, experiment)


def check_trusted_storage(storage: str, experiment: str) -> None:
    """`--resume` unpickles Tune's saved state, so whoever can write it can run code in this driver. On a local
    file system refuse state that another user owns or that others may write; remote stores (s3://, gs://) must be
    writable by you alone (bucket policy), which cannot be checked from here."""
    import stat

    if "://" in storage and not storage.startswith("file://"):
        return
    root = Path(storage.removeprefix("file://"))
    for path in (root, root / STATE_DIR, root / experiment):
        if not path.exists():
            continue
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise specs.SpecError([f"{path} is owned by another user or writable by others, and resuming unpickles "
                                   "the Tune state kept there (whoever can write it can run code in this process); "
                                   f"fix its ownership/permissions (chmod go-w {path}) or start a new sweep"],
                                  "--resume")


def resumed_state(spec: specs.SweepSpec, resume: str) -> dict:
    """The saved state of the run `--resume` names ('latest': the newest of this spec), checked once: the storage
    is trusted (`check_trusted_storage`) and the spec is the one the run started with (`check_resume`). Raises
    SpecError otherwise, before anything expensive starts."""
    storage = storage_root(spec)
    state = load_state(storage, spec.name, resume)
    check_trusted_storage(storage, state["experiment"])
    check_resume(spec, state)
    return state


def fingerprint(spec: specs.SweepSpec) -> str:
    """What a resumed sweep must match: the hash of the fully resolved spec."""
    return hashlib.sha256(specs.dump_resolved(spec).encode()).hexdigest()


def check_resume(spec: specs.SweepSpec, state: dict) -> None:
    """A resumed sweep must be the sweep it resumes: any difference in the resolved spec would mix two experiments
    in one parent run. Raises SpecError naming every changed field and the command that resumes the original."""
    if state.get("fingerprint") == fingerprint(spec):
        return
    before = _flat(yaml.safe_load(state.get("spec_yaml") or "{}"))
    now = _flat(yaml.safe_load(specs.dump_resolved(spec)))
    changed = [f"{k}: {before.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
               for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    raise specs.SpecError(changed + [f"resume the original with: {resume_command(state)}"],
                          f"--resume {state['experiment']}: the spec differs from the one that run started with")


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for key, value in (d or {}).items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_command(state: dict) -> str:
    """The command that resumes the run of `state`, with the spec file and every --set override it started with."""
    cmd = state.get("command") or {}
    parts = ["python", "pipelines/sweep.py", "--config", cmd.get("config", "<spec.yaml>")]
    for item in cmd.get("overrides", []):
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts + ["--resume", state["experiment"]])


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


def mark_dead_runs(client, storage: str, name: str) -> list[str]:
    """Parent runs of sweep `name` still RUNNING in MLflow although their driver died (SIGKILL, a lost node): mark
    them, and the trial runs they left RUNNING, KILLED with a tag saying so, so the MLflow UI does not show them as
    live (a `--resume` of that run opens its unfinished trials' runs again). Returns their experiments."""
    from mlflow.exceptions import MlflowException

    marked = []
    for experiment in _state_names(storage, name):
        state = _read_state(storage, experiment)
        if _driver_alive(state.get("driver")) is not False:
            continue
        if (outbox_dir(storage, experiment) / "outbox.json").is_file():
            continue  # it ended with its writes kept for a store that did not answer: `--resume` sends them
        try:
            run = client.get_run(state["parent_run_id"])
        except MlflowException:  # a run deleted from the store, another store: nothing to mark
            continue
        if run.info.status == "RUNNING":
            why = (f"driver pid {state['driver']['pid']} on {state['driver']['host']} died without finishing; "
                   f"resume with: {resume_command(state)}")
            children = [r for r in tracking.latest_trial_runs(client, run.info.run_id).values()
                        if r.info.status == "RUNNING"]
            for r in [run, *children]:
                client.set_tag(r.info.run_id, mlflow_layout.INTERRUPTED, why)
                tracking.finish(client, r.info.run_id, status="KILLED")
            marked.append(experiment)
    return marked
