"""A sweep's methods and benchmarks from outside the repository: ``plugins:`` (modules that register methods with
``promprune.register_method``) and ``include_path:`` (lmms-eval task directories).

Where each piece is used:

- `resolve_paths(raw, base)`: relative paths in a spec file are relative to that file's directory
  (`pipelines/spec/loading.py`, per file of an ``include:`` chain; ``--set`` values: the working directory).
- `load(entries)`: import the plugins (and the ``promprune.methods`` entry points) on the driver before the spec's
  methods are checked, each failure one problem naming the plugin and its error (`pipelines/spec/__init__.py`
  `parse`; `pipelines/evaluate.py`'s ``--plugin``).
- `activate(plugins, include_path)`: this process and every Ray worker it starts see them, through
  ``$PROMPRUNE_PLUGINS`` and ``$PROMPRUNE_INCLUDE_PATH``, which promprune reads in every process (its method
  registry imports the plugins when first asked; its task manager adds the directories), so a trial, a predictor
  actor or a Ray task that builds requests or scores needs no call of its own (`pipelines/sweep.py`, `evaluate.py`).
- `runtime_env(base)`: Ray's runtime environment for the workers carries those variables and ships each plugin
  file or package directory and each task directory as ``py_modules``, so a node without the driver's filesystem
  gets them too (`pipelines/run/ray_connect.py`).
"""
from __future__ import annotations

import os
from pathlib import Path

from promprune import plugins as library
from promprune.eval.tasks import INCLUDE_PATH_ENV

PATH_FIELDS = ("plugins", "include_path")


def resolve_paths(raw: dict, base: Path) -> dict:
    """``raw`` with the relative paths of ``plugins`` (the entries that are paths, not module names) and
    ``include_path`` made absolute against ``base``; values of another shape are left for validation to report."""
    out = dict(raw)
    for key in PATH_FIELDS:
        value = raw.get(key)
        entries = [value] if isinstance(value, str) else value
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            continue
        out[key] = [_absolute(e, base) if key == "include_path" or library.is_path(e) or _beside(e, base) else e
                    for e in entries]
    return out


def _beside(entry: str, base: Path) -> bool:
    """A bare name (``plugins: [pkg]``) that is a package directory beside the spec: a path, as the docs say a plugin
    may be, not a module name to import (it was refused with a hint to write ``pkg.py``)."""
    return (base / entry / "__init__.py").is_file()


def _absolute(entry: str, base: Path) -> str:
    path = Path(entry).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def load(entries: list[str] | None) -> list[str]:
    """Import the ``promprune.methods`` entry points, what ``$PROMPRUNE_PLUGINS`` names and every plugin of
    ``entries`` here; returns one problem per failure (a plugin that fails to import names itself and the error;
    empty: all imported)."""
    problems = []
    try:
        library.load_entry_points()
    except library.PluginError as exc:
        problems.append(f"plugins: {exc}")
    for entry in library.env_entries():
        try:
            library.import_plugin(entry)
        except library.PluginError as exc:
            problems.append(f"${library.ENV}: {exc}")
    for i, entry in enumerate(entries or []):
        try:
            library.import_plugin(entry)
        except library.PluginError as exc:
            hint = ""
            if not library.is_path(entry) and isinstance(exc.__cause__, ModuleNotFoundError):
                hint = ("; a module name must be importable here (installed, or on PYTHONPATH); name a file or "
                        f"package directory by its path instead, e.g. plugins: [{entry.split('.')[-1]}.py]")
            problems.append(f"plugins[{i}]: {exc}{hint}")
    return problems


def _merged(variable: str, entries: list[str]) -> str:
    """``$variable``'s entries followed by ``entries``, each once."""
    old = [e for e in os.environ.get(variable, "").split(os.pathsep) if e]
    return os.pathsep.join(dict.fromkeys([*old, *entries]))


def activate(plugins: list[str], include_path: list[str]) -> None:
    """This process and the Ray workers it starts from now on (`runtime_env`) import ``plugins`` and find tasks in
    ``include_path`` (absolute paths; appended to what the environment already names)."""
    if plugins:
        os.environ[library.ENV] = _merged(library.ENV, plugins)
    if include_path:
        os.environ[INCLUDE_PATH_ENV] = _merged(INCLUDE_PATH_ENV, include_path)


def runtime_env(base: dict) -> dict:
    """``base`` (a Ray runtime_env) plus what this process activated: the two variables for the workers and
    ``py_modules`` shipping every plugin file or package directory and every task directory (a module name is
    imported as installed on each node)."""
    found = {var: [e for e in os.environ.get(var, "").split(os.pathsep) if e]
             for var in (library.ENV, INCLUDE_PATH_ENV)}
    if not any(found.values()):
        return base
    ship = [e for e in found[library.ENV] if library.is_path(e)] + found[INCLUDE_PATH_ENV]
    out = {**base, "env_vars": {**base.get("env_vars", {}),
                                **{var: os.pathsep.join(entries) for var, entries in found.items() if entries}}}
    if ship:
        out["py_modules"] = list(dict.fromkeys([*base.get("py_modules", []), *ship]))
    return out
