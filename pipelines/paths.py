"""Where a sweep keeps its records when nothing says where: the MLflow store, Tune's storage, the logs.

Run from a checkout (``python pipelines/sweep.py``), everything is relative to the working directory, as the README
says: ``./mlflow.db`` (what ``mlflow ui`` opens there), ``./outputs/tune``, ``./outputs/logs``.

Run as a Ray job (``ray job submit --working-dir . -- python pipelines/sweep.py``), the working directory is Ray's
per-job copy of the package (``<ray temp>/session_*/runtime_resources/working_dir_files/_ray_pkg_*``), which Ray
deletes with the session or when it trims its package cache: nothing may be kept there. A job's records go to one
durable directory on the head instead, ``$PROMPRUNE_HOME`` (default ``~/promprune``): ``mlflow.db`` (its artifacts
beside it, ``mlruns/``), ``outputs/tune``, ``outputs/logs``. ``MLFLOW_TRACKING_URI`` (the server ``cluster.yaml``
starts, for one), ``PROMPRUNE_STORAGE`` and the spec's ``tune.storage_path`` still win; a job names them, and
``PROMPRUNE_HOME``, by absolute path (a relative one is refused: the variables by `relative_in_job`, the spec's
field by `relative_storage_in_job`).

Imports nothing heavy: the front door (`pipelines.frontdoor`) reads it before Ray and torch load.
"""
from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

HOME_ENV = "PROMPRUNE_HOME"  # a Ray job's records when nothing else names a place (default ~/promprune)
JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray in the entrypoint of `ray job submit`
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
STORAGE_ENV = "PROMPRUNE_STORAGE"  # Tune storage every node reaches (s3://..., NFS) when the spec sets none
STORAGE_EXAMPLE = "/<folder every node reaches> or s3://<bucket>/<prefix>"  # a Tune storage a job may name


def in_ray_job() -> bool:
    """Whether this process is the entrypoint of a Ray job (its working directory is Ray's package copy)."""
    return bool(os.environ.get(JOB_ENV))


def records_root() -> Path:
    """The directory relative records live in: the working directory, or for a Ray job ``$PROMPRUNE_HOME``
    (default ``~/promprune``), absolute."""
    if in_ray_job():
        return Path(os.environ.get(HOME_ENV) or "~/promprune").expanduser().resolve()
    return Path.cwd().resolve()


def default_tracking_uri() -> str:
    """The MLflow store when ``MLFLOW_TRACKING_URI`` is unset: ``mlflow.db`` in `records_root`."""
    return f"sqlite:///{records_root() / 'mlflow.db'}"


def default_storage() -> str:
    """Tune's storage when neither the spec nor ``PROMPRUNE_STORAGE`` names one: ``outputs/tune`` in `records_root`."""
    return str(records_root() / "outputs" / "tune")


def outputs_dir() -> Path:
    """``outputs/`` in `records_root`: the logs (``outputs/logs``) and, for remote storage, the outbox."""
    return records_root() / "outputs"


def logs_problem() -> str | None:
    """Why the sweep's log folder (``outputs/logs`` in `records_root`) cannot be written, as one paragraph; None when
    it can. Asked before Ray starts: a read-only working directory was a traceback once the spec had passed."""
    import tempfile

    logs = outputs_dir() / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=logs):
            pass
    except OSError as exc:
        fix = (f"set {HOME_ENV} in the job's --runtime-env-json to an absolute folder the head can write (a Ray "
               "job's records go there: outputs/, mlflow.db)") if in_ray_job() else \
            "run it from a folder you can write (its records go under the working directory: outputs/, mlflow.db)"
        return (f"the sweep writes its log to {logs}, which cannot be written here ({type(exc).__name__}: "
                f"{exc.strerror or exc}); {fix}")
    return None


def job_defaults_line() -> str | None:
    """For a Ray job that names no store and no Tune storage, the one line saying where its records go (None
    otherwise: a local run's places are the README's, and a job that names them chose them)."""
    if not in_ray_job():
        return None
    chosen = [name for name in (TRACKING_URI_ENV, STORAGE_ENV) if os.environ.get(name)]
    if len(chosen) == 2:
        return None
    return (f"a Ray job keeps nothing in its package copy: MLflow store "
            f"{os.environ.get(TRACKING_URI_ENV) or default_tracking_uri()}, Tune storage "
            f"{os.environ.get(STORAGE_ENV) or default_storage()} (unless the spec sets tune.storage_path), logs in "
            f"{outputs_dir() / 'logs'} (${HOME_ENV}, default ~/promprune; set {TRACKING_URI_ENV} / {STORAGE_ENV} to "
            "choose others)")


def relative_in_job(environ=None) -> list[str]:
    """Inside a Ray job, each of ``MLFLOW_TRACKING_URI`` (a ``sqlite:///`` file), ``PROMPRUNE_HOME`` and
    ``PROMPRUNE_STORAGE`` (a local path) that names a relative path, as one paragraph naming the variable and the fix
    (an absolute path); [] outside a job. The job's working directory is Ray's package copy, which Ray deletes: a
    relative store or home landed there silently (and the closing `mlflow ui` line named it relatively), and a
    relative Tune storage was refused as "not a path"."""
    environ = os.environ if environ is None else environ
    if not environ.get(JOB_ENV):
        return []
    relative = []
    uri = environ.get(TRACKING_URI_ENV, "")
    # no expanduser: neither MLflow nor SQLAlchemy expands "~" (sqlite:///~/mlflow.db is ./~/mlflow.db)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_absolute():
        relative.append((TRACKING_URI_ENV, uri, "sqlite:////<absolute folder>/mlflow.db (four slashes)"))
    home = environ.get(HOME_ENV)
    if home and not Path(home).expanduser().is_absolute():
        relative.append((HOME_ENV, home, "/<absolute folder> or ~/<folder>"))
    storage = environ.get(STORAGE_ENV)
    if _relative_storage(storage):
        relative.append((STORAGE_ENV, storage, STORAGE_EXAMPLE))
    return [_in_package_copy(f"environment variable {name}={value}") + " Set it in the job's --runtime-env-json to an "
            f"absolute path, e.g. {example}" + ("" if name == STORAGE_ENV else ", or leave it unset (the job's "
                                                f"records then go to ${HOME_ENV}, default ~/promprune)")
            for name, value, example in relative]


def relative_storage_in_job(storage_path: str | None, environ=None) -> list[str]:
    """Inside a Ray job, the spec's ``tune.storage_path`` (from its file or ``--set``) when it names a relative local
    path, as one paragraph naming the field and the fix; [] outside a job (a local run's is its working directory's).
    A job's Tune storage, like its variables' (`relative_in_job`), would be Ray's package copy: Tune's results and the
    sweep's state kept there vanish with Ray's session."""
    environ = os.environ if environ is None else environ
    if not environ.get(JOB_ENV) or not _relative_storage(storage_path):
        return []
    return [_in_package_copy(f"tune.storage_path: {storage_path}") + " Set tune.storage_path (in the spec, or "
            f"--set tune.storage_path=...) to an absolute path, e.g. {STORAGE_EXAMPLE}, or leave it unset (the job's "
            f"Tune storage is then ${STORAGE_ENV}, else outputs/tune in ${HOME_ENV}, default ~/promprune)"]


def absolute_storage(storage: str) -> str:
    """``storage`` with a relative local path (``outputs/tune``, ``./tune``; not ``file://`` or a remote URI) made
    absolute against `records_root` (outside a Ray job the working directory), ``~`` expanded; anything else as
    given."""
    local = None if "://" in storage else local_storage(storage)  # local_storage: the one parse of a storage
    return storage if local is None else str(local if local.is_absolute() else records_root() / local)


def _relative_storage(storage: str | None) -> bool:
    """Whether ``storage`` (a Tune storage: a path, file:// or a remote URI) is a local path that is relative."""
    local = local_storage(storage) if storage else None
    return local is not None and not local.is_absolute()


def _in_package_copy(what: str) -> str:
    """The refusal's first sentence: ``what`` (``<name>=<value>``) is relative, so in a job it is Ray's package copy."""
    return (f"{what} is a relative path, which in a Ray job is relative to Ray's copy of the working directory "
            "(<ray temp>/session_*/runtime_resources/working_dir_files/_ray_pkg_*), deleted by Ray with the session: "
            "nothing kept there lasts.")


def home_problem() -> str | None:
    """Inside a Ray job, why its records folder (`records_root`: ``$PROMPRUNE_HOME``, default ``~/promprune``) cannot
    be made or written, as one paragraph naming the variable; None when it can, or outside a job (the working
    directory is `logs_problem`'s to check). An uncreatable one (``PROMPRUNE_HOME=/proc/pp``) was a traceback."""
    if not in_ray_job():
        return None
    root = records_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
    else:
        why = refuses_writes(root)
    if why is None:
        return None
    named = f"${HOME_ENV}={os.environ[HOME_ENV]}" if os.environ.get(HOME_ENV) else f"${HOME_ENV} unset: ~/promprune"
    return (f"a Ray job keeps its records (logs; MLflow store and Tune state unless named elsewhere) in {root} "
            f"({named}), which cannot be made or written on this node ({why}); set {HOME_ENV} in the job's "
            "--runtime-env-json to an absolute folder the head can write (`--runtime-env-json '{\"env_vars\": "
            "{\"PROMPRUNE_HOME\": \"/<absolute folder>\"}}'`)")


AUTH_MODE_ENV = "RAY_AUTH_MODE"  # `token` where the head enforces Ray's token; its CLI sends the token only then


def token_auth(environ=None) -> bool:
    """Whether the Ray head of this job enforces its token: a job's entrypoint inherits the head's ``RAY_AUTH_MODE``
    (``token`` once Ray turned token auth on, explicitly or by itself because ``~/.ray/auth_token`` existed when the
    head started; ``disabled`` or unset otherwise)."""
    environ = os.environ if environ is None else environ
    return environ.get(AUTH_MODE_ENV, "").strip().lower() == "token"


def submit_command(entrypoint: str, env: dict[str, str] | None = None, token: bool = True) -> str:
    """``entrypoint`` (``python pipelines/sweep.py ...``) as a Ray job from the checkout, with ``env`` (variables the
    job's runtime env sets: its MLflow store, its Tune storage) in ``--runtime-env-json``, and ``RAY_AUTH_MODE=token``
    in front when ``token`` (`token_auth`): Ray 2.60 enforces its token once ``~/.ray/auth_token`` exists (any local
    ``ray.init()`` writes one), and its CLI sends it only with that; where there is no token, the CLI refuses to
    start with it."""
    import json
    import shlex

    runtime_env = f"--runtime-env-json {shlex.quote(json.dumps({'env_vars': env}))} " if env else ""
    prefix = f"{AUTH_MODE_ENV}=token " if token else ""
    return f"{prefix}ray job submit --working-dir . {runtime_env}-- {entrypoint}"


def local_storage(storage: str) -> Path | None:
    """The local folder behind a storage path or ``file://`` URI, ``~`` expanded as pyarrow expands it for the
    sweep's state (Tune's experiments, the outbox and the free-space check use this; ``~/tune`` was ``./~/tune`` for
    them, in a Ray job Ray's package copy); None for remote storage (s3://, gs://, ...)."""
    if "://" in storage and not storage.startswith("file://"):
        return None
    return Path(storage.removeprefix("file://")).expanduser()


# ----------------------------------------------------------------------------------------------------------------
# whether a place takes writes: a real write, not os.access (which says yes to root whatever the mode bits, and
# cannot tell a read-only mount's or a network file system's refusal ahead)

REFUSED_ERRNOS = (errno.EPERM, errno.EACCES, errno.EROFS)


def existing_parent(path: Path) -> Path:
    """``path``, or its nearest parent that exists."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def refuses_writes(place: str | Path) -> str | None:
    """Why a test write in the folder ``place`` (or, before it exists, its nearest existing parent; a file's folder)
    fails for want of permission (``"Operation not permitted"``, ...): a file created and removed there. None when it
    succeeds or fails otherwise."""
    folder = existing_parent(Path(place).absolute())
    if not folder.is_dir():
        folder = folder.parent
    probe = folder / f".promprune-write-test.{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb"):
            pass
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno in REFUSED_ERRNOS else None
    with contextlib.suppress(OSError):
        os.remove(probe)
    return None


def refuses_file_writes(path: str | Path) -> str | None:
    """Why the existing file ``path`` cannot be opened for writing for want of permission (opened to append, nothing
    written); None when it can, or fails otherwise."""
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno in REFUSED_ERRNOS else None
    return None


def out_problem(out: Path, writer: str, *, default: bool = False) -> str | None:
    """Why ``out`` cannot be the ``--out`` folder ``writer`` (``"the report"``) writes into, as one paragraph naming
    --out and the fix (None: a folder it can write, or one it can make): it is a file, a file stands where one of its
    parents would be, or the folder it would go in refuses a test write (`refuses_writes`). Checked without leaving
    anything; ``default``: ``out`` is the default, not one given as --out."""
    name = f"{'the default ' if default else ''}--out {out}"
    fix = "give --out a folder you can write (it is made with its parents if missing)"
    existing = out.absolute()
    while not (existing.exists() or existing.is_symlink()):
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == out.absolute() else f"cannot be made: {existing} is a file"
        return f"{name} {what}, not a folder; {fix}"
    if refuses_writes(existing):
        where = "" if existing == out.absolute() else f" in {existing}"
        return f"{name}: {writer} cannot write{where} (permission denied); {fix}"
    return None


# ----------------------------------------------------------------------------------------------------------------
# an output folder several runs may write at once (reports/<sweep name>/: two reports of a sweep name, two runs of
# fig2_concentration.py): each builds aside, logs from there, then publishes its files whole under the folder's lock

OUT_LOCK = ".report.lock"  # in the --out folder: writers publishing there take turns


@contextlib.contextmanager
def staging_folder(out: Path):
    """A fresh hidden folder in ``out`` (``.building-<pid>-<random>``, ``out`` made if missing) that this process
    alone writes, removed on the way out. Written in ``out`` directly, two runs' files of the same names replaced each
    other's between one's writing and its logging, so a run's MLflow artifacts held another run's tables."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(files, staging: Path, out: Path) -> list[Path]:
    """Copy ``files`` (paths under ``staging``) to the same places under ``out``, each replaced whole
    (`promprune.atomic.atomic_path`), while holding ``out``'s lock (`OUT_LOCK`: a writer publishing there at the same
    time waits its turn, so the folder holds one writer's files, not a mix); returns their paths under ``out``.
    Files there that this writer does not write stay as they were."""
    import shutil

    from promprune.atomic import atomic_path, locked

    placed = []
    with locked(out / OUT_LOCK):
        for path in files:
            target = out / Path(path).relative_to(staging)
            with atomic_path(target) as tmp:
                shutil.copyfile(path, tmp)
            placed.append(target)
    return placed
