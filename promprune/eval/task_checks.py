"""Whether lmms-eval can load a task here, found in seconds and said in one paragraph: task YAML files it cannot read,
``!function`` references that do not import, data that is not where lmms-eval and ``datasets`` will look, and a
split the task evaluates that its local data files do not have.

What lmms-eval 0.7.3 does, which these checks follow:

- **Indexing.** ``TaskManager`` reads every ``*.yaml`` under each task directory (``os.walk``, skipping
  ``__pycache__`` and ``.ipynb_checkpoints``) with ``lmms_eval.utils.load_yaml_config(mode="simple")``; one file it
  cannot parse stops the index, so every task of that directory, not only the broken one.
- **Local data.** For a task whose ``dataset_path`` is one of ``datasets``' generic builders (`LOCAL_BUILDERS`),
  ``load_yaml_config`` rewrites each relative ``dataset_kwargs.data_files`` path to the path beside the YAML file
  that declares it, then beside each YAML that includes that file, when a file exists there (``os.path.isfile``:
  a glob pattern is never rewritten). A path left relative is read by ``datasets.load_dataset`` from the working
  directory of the process that loads the task. Anything else in ``dataset_path`` is a local directory when one
  exists there (relative: from the working directory), else a hub dataset.
- **Splits.** ``datasets`` names the splits of ``data_files`` after its keys (a single path or a list: one split,
  ``train``); lmms-eval evaluates ``test_split`` when it is set, else ``validation_split``, and reads it as
  ``dataset[split]`` (a ``KeyError`` when the data has no such split).
- **Hub data.** ``datasets`` offline (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE``) reads only its own cache,
  ``<datasets cache>/<org>___<snake_case name>``; lmms-eval's datasets cache is ``$LMMS_EVAL_DATASETS_CACHE``, else
  ``$HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``.
"""
from __future__ import annotations

import functools
import glob
import os
import re
from pathlib import Path

# lmms-eval 0.7.3's `lmms_eval.utils._LOCAL_BUILDERS`: the dataset_path values whose data_files it resolves
LOCAL_BUILDERS = ("csv", "json", "parquet", "text", "pandas", "arrow")
IGNORED_DIRS = ("__pycache__", ".ipynb_checkpoints")  # lmms-eval's indexer skips these
_URL = ("http://", "https://", "s3://", "gs://", "ftp://", "ftps://", "hf://")


class NotOnThisMachine(str):
    """A problem of this machine, not of what was asked for: data (or a model) that is not here, and that the machine
    which runs the sweep (a cluster with the data) may have. A sweep refuses it like any problem; `--validate-only`,
    a check of the spec, names it as a warning."""


class TaskFileError(ValueError):
    """Task YAML files lmms-eval cannot index, one problem (one paragraph) per file."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(problems))


# ----------------------------------------------------------------------------------------------------------------
# files lmms-eval cannot index


def broken_task_files(dirs: list[str]) -> list[str]:
    """One problem per YAML file under ``dirs`` that lmms-eval's indexer cannot read (read with its own loader)."""
    from lmms_eval.utils import load_yaml_config

    problems = []
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if s not in IGNORED_DIRS)
            for name in sorted(f for f in files if f.endswith(".yaml")):
                path = Path(root) / name
                try:
                    load_yaml_config(str(path), mode="simple")
                except Exception as exc:  # noqa: BLE001 - whatever stops lmms-eval's index is the user's to fix
                    problems.append(_unreadable(path, d, exc))
    return problems


def _unreadable(path: Path, directory: str, exc: Exception) -> str:
    import yaml

    task = _task_named_in(path)
    who = f"task {task!r}: its YAML {path}" if task else f"the task YAML {path}"
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        where = "" if mark.name in (str(path), "<file>") else f" (in {mark.name}, which it includes)"
        what = f"is not valid YAML at line {mark.line + 1}, column {mark.column + 1}{where}: {exc.problem}"
        start = exc.context_mark
        if exc.context and start is not None and start.name == mark.name:
            what += f" ({exc.context} that starts at line {start.line + 1}, column {start.column + 1})"
        fix = "fix the YAML there (a bracket, quote or colon missing, or the indentation)"
    elif isinstance(exc, FileNotFoundError):
        what = f"includes {exc.filename}, which does not exist"
        fix = "fix its `include:` (a relative path is from the including file's folder)"
    else:
        what = f"cannot be read ({type(exc).__name__}: {_first_line(exc)})"
        fix = "fix the file"
    return (f"{who} {what}. lmms-eval reads every .yaml file of a task directory ({directory}) when it looks for "
            f"tasks, so this file stops every task there; {fix}, or move the file out of the directory")


def _task_named_in(path: Path) -> str | None:
    """The ``task:`` a (possibly unparsable) YAML file names on a line of its own, if any."""
    try:
        found = re.search(r"^task:\s*['\"]?([\w.\-]+)", path.read_text(errors="replace"), re.MULTILINE)
    except OSError:
        return None
    return found.group(1) if found else None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


# ----------------------------------------------------------------------------------------------------------------
# each task: its code imports, its data is where it will be read


def task_problems(manager, tasks: list[str], own_dirs: list[str]) -> list[str]:
    """One problem per task of ``tasks`` (indexed by ``manager``, a TaskManager) that would fail to load: its data
    not found (`data_problem`), the split it evaluates not among its local data files' (`split_problem`), or, for a
    task in one of ``own_dirs`` (the user's task directories), a ``!function`` that does not import."""
    problems = []
    for task in tasks:
        path = manager.task_index.get(task, {}).get("yaml_path")
        if not isinstance(path, str):
            continue  # a group or tag: the bridge says so when it loads it
        problem = data_problem(task, path) or split_problem(task, path)
        if problem is None and any(_under(path, d) for d in own_dirs):
            problem = function_problem(task, path)
        if problem:
            problems.append(problem)
    return problems


def _under(path: str, directory: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


def function_problem(task: str, yaml_path: str) -> str | None:
    """Why the task's YAML does not load with its ``!function`` references imported (lmms-eval's full load)."""
    from lmms_eval.utils import load_yaml_config

    try:
        load_yaml_config(yaml_path, mode="full")
    except Exception as exc:  # noqa: BLE001 - an import error of the user's code, reported with its root cause
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        where = f" ({root.filename}, line {root.lineno})" if isinstance(root, SyntaxError) and root.filename else ""
        return (f"task {task!r} ({yaml_path}) does not load: {_first_line(exc)} ({type(root).__name__}: "
                f"{_first_line(root)}{where}); fix the `!function` it names or the module beside the YAML")
    return None


def data_problem(task: str, yaml_path: str) -> str | None:
    """Why the task's data would not be found when lmms-eval loads it here (None: found, or on a hub that answers)."""
    from lmms_eval.utils import load_yaml_config

    config = load_yaml_config(yaml_path, mode="simple")  # data_files resolved exactly as lmms-eval resolves them
    source = config.get("dataset_path")
    kwargs = config.get("dataset_kwargs") or {}
    if not isinstance(source, str) or not isinstance(kwargs, dict):
        return None
    if source in LOCAL_BUILDERS:
        return _missing_files(task, yaml_path, kwargs.get("data_files"))
    if kwargs.get("load_from_disk") or source.startswith(("/", "./", "../", "~")) or Path(source).is_dir():
        path = Path(source).expanduser()
        if path.is_dir():
            return None
        return NotOnThisMachine(
            f"task {task!r} ({yaml_path}) reads its data from the directory dataset_path: {source}, which does not "
            f"exist (tried {path.absolute()}; `datasets` reads a relative dataset_path from the working directory); "
            "fix dataset_path or create the dataset there")
    return hub_problem(task, yaml_path, source)


def split_problem(task: str, yaml_path: str) -> str | None:
    """Why the split the task evaluates (``test_split``, else ``validation_split``) is not one its local data files
    have (``dataset_path`` a generic builder: the splits are ``data_files``' keys); None when it is, or when the
    splits are only known once the data is loaded (a hub dataset, a directory)."""
    from lmms_eval.utils import load_yaml_config

    config = load_yaml_config(yaml_path, mode="simple")
    kwargs = config.get("dataset_kwargs") or {}
    field = "test_split" if config.get("test_split") is not None else "validation_split"
    split = config.get(field)
    if config.get("dataset_path") not in LOCAL_BUILDERS or not isinstance(kwargs, dict) or "split" in kwargs \
            or kwargs.get("data_files") is None or split is None:
        return None
    data_files = kwargs["data_files"]
    splits = [str(k) for k in data_files] if isinstance(data_files, dict) else ["train"]  # datasets' naming
    if str(split) in splits:
        return None
    named = (f"its dataset_kwargs.data_files names the split(s) {splits}" if isinstance(data_files, dict) else
             "its dataset_kwargs.data_files is not keyed by split, so `datasets` names its one split 'train'")
    return (f"task {task!r} ({yaml_path}) evaluates {field}: {split}, a split its data does not have: {named}. "
            f"Set {field} to one of {splits}, or key the data file by {str(split)!r} in dataset_kwargs.data_files")


def _missing_files(task: str, yaml_path: str, data_files) -> str | None:
    missing = [(label, value) for label, value in _entries(data_files) if not _found(value)]
    if not missing:
        return None
    lines = [_missing_line(label, value, yaml_path) for label, value in missing]
    return NotOnThisMachine(f"task {task!r} ({yaml_path}): {'; '.join(lines)}. Put the data there, or give its "
                            "absolute path in the task YAML's dataset_kwargs.data_files")


def _entries(data_files, label: str = "dataset_kwargs.data_files"):
    """(``data_files.<split>`` / ``data_files[i]``, path) for every path of a data_files value."""
    if isinstance(data_files, str):
        yield label, data_files
    elif isinstance(data_files, dict):
        for key, value in data_files.items():
            yield from _entries(value, f"{label}.{key}")
    elif isinstance(data_files, list):
        for i, value in enumerate(data_files):
            yield from _entries(value, f"{label}[{i}]")


def _found(value: str) -> bool:
    if value.startswith(_URL):
        return True  # read by datasets from there; not checked here
    path = Path(value).expanduser()
    if glob.has_magic(value):
        return bool(glob.glob(str(path)))  # relative: from the working directory, as datasets reads it
    return path.is_file()


def _missing_line(label: str, value: str, yaml_path: str) -> str:
    path = Path(value).expanduser()
    if path.is_absolute():
        return f"{label} {value} does not exist"
    beside = Path(yaml_path).parent / value
    if glob.has_magic(value):
        return (f"{label} {value!r} matches no file in the working directory ({Path.cwd() / value}): a pattern is "
                "read by `datasets` from there (lmms-eval resolves only plain paths against the task's folder)")
    return (f"{label} {value!r} was not found: lmms-eval looks for a relative path beside the task's YAML ({beside}), "
            f"and `datasets` then reads it from the working directory ({Path.cwd() / value}); neither exists")


def hub_problem(task: str, yaml_path: str, repo: str) -> str | None:
    """A task's hub dataset that cannot be had here: not in the datasets cache, and offline or the hub not
    reachable."""
    return hub_dataset_problem(
        repo, f"task {task!r} ({yaml_path}) reads", "point HF_HOME (or LMMS_EVAL_DATASETS_CACHE) at a cache that "
        "holds it (`python -m promprune.eval standins` writes local stand-ins of the paper's benchmarks), or use an "
        "offline task (easyvqa_yesno, easyvqa_open, the testbed_* tasks: promprune.eval.OFFLINE_TASKS)")


def hub_dataset_problem(repo: str, reader: str, elsewise: str) -> str | None:
    """A hub dataset ``repo`` that cannot be had here (not in the datasets cache, and offline or the hub not
    reachable), as a paragraph: ``reader`` says who reads it ("task 'pope' (...) reads"), ``elsewise`` the other
    ways out."""
    from promprune.models.factories import hub_endpoint, hub_offline

    cache = datasets_cache()
    if repo.count("/") != 1 or _cached(repo, cache):
        return None
    offline = hub_offline() or os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes")
    if not offline and _hub_answers():
        return None
    why = ("HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set" if offline else
           f"the hub ({hub_endpoint()}) is not reachable from here")
    return NotOnThisMachine(
        f"{reader} the Hugging Face hub dataset {repo!r}, which is not in this machine's datasets cache ({cache}), "
        f"and {why}. Download it once where there is network access with the same HF_HOME "
        f"(python -c \"import datasets; datasets.load_dataset('{repo}')\"), {elsewise}")


@functools.cache
def _hub_answers() -> bool:
    """Whether the hub takes a connection (asked once per process: up to 3 s when it does not answer)."""
    from promprune.models.factories import hub_reachable

    return hub_reachable()


def datasets_cache() -> Path:
    """The datasets cache lmms-eval loads through (its `_resolve_hf_datasets_cache_dir`, without creating it)."""
    explicit = os.environ.get("LMMS_EVAL_DATASETS_CACHE", "").strip()
    hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    chosen = explicit or os.environ.get("HF_DATASETS_CACHE") or os.path.join(hf_home, "datasets")
    return Path(os.path.expandvars(chosen)).expanduser()


def _cached(repo: str, cache: Path) -> bool:
    """The dataset is in datasets' own cache (what offline reads) or in the hub's download cache."""
    from datasets.naming import camelcase_to_snakecase

    org, name = repo.split("/")
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    return (cache / f"{org}___{camelcase_to_snakecase(name)}").is_dir() or \
        (hub.expanduser() / f"datasets--{org}--{name}").is_dir()
