"""Methods from outside this package: the ``promprune.methods`` entry points and the modules ``$PROMPRUNE_PLUGINS``
names, imported once per process the first time the method registry is asked (``promprune.methods()``,
``promprune.method_spec``, ``promprune.select``).

A plugin is a module that registers methods when it is imported (``@promprune.register_method``). It is found by

- an installed package's entry point in the group ``promprune.methods`` (``pyproject.toml``:
  ``[project.entry-points."promprune.methods"] my_methods = "my_package.methods"``; the value names the module);
- ``$PROMPRUNE_PLUGINS``: entries separated by ``os.pathsep``, each a module name (``my_package.methods``), a
  ``.py`` file or a package directory (absolute paths). A file or directory is imported under its own name
  (``largest_norm.py`` -> module ``largest_norm``): by that name when it is importable (a copy Ray's runtime
  environment shipped to this node), else from the path. A sweep's ``plugins:`` reach every Ray worker this way
  (``pipelines/plugins.py``).

A plugin that fails to import (raises, or calls ``sys.exit()``) is a :class:`PluginError` naming the plugin and the
error.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

GROUP = "promprune.methods"
ENV = "PROMPRUNE_PLUGINS"


class PluginError(ImportError):
    """A plugin that could not be imported: which one, and why (the error's last frame in the plugin's code)."""


def env_entries() -> list[str]:
    """The entries of ``$PROMPRUNE_PLUGINS`` (empty when unset)."""
    return [e for e in os.environ.get(ENV, "").split(os.pathsep) if e.strip()]


def is_path(entry: str) -> bool:
    """A file or directory rather than a module name: ends with ``.py``, or names a path (a separator, ``~``)."""
    return entry.endswith(".py") or "/" in entry or os.sep in entry or entry.startswith("~")


def module_name(entry: str) -> str:
    """The name a plugin is imported under: the module name itself, or a file's / package directory's name."""
    if not is_path(entry):
        return entry
    path = Path(entry.rstrip("/").rstrip(os.sep))
    return path.stem if path.suffix == ".py" else path.name


def import_plugin(entry: str) -> ModuleType:
    """Import one plugin (a module name, or an absolute path to a ``.py`` file or a package directory); importing
    it again returns the module already imported. PluginError when it cannot be imported."""
    name = module_name(entry)
    if not is_path(entry):
        return _guarded(entry, lambda: importlib.import_module(entry))
    path = Path(entry).expanduser()
    if not name.isidentifier():
        raise PluginError(f"plugin {entry!r}: {name!r} is not a valid Python module name (letters, digits and "
                          "underscores, not starting with a digit); rename the file or directory")
    loaded = sys.modules.get(name)
    if loaded is not None:
        if path.exists() and not _same_file(getattr(loaded, "__file__", None), path):
            raise PluginError(f"plugin {entry!r}: a different module named {name!r} is already imported "
                              f"(from {getattr(loaded, '__file__', None) or 'a built-in'}); rename the plugin")
        return loaded
    if not path.exists():  # not here: a copy Ray's runtime environment shipped, importable by its name
        if importlib.util.find_spec(name) is None:
            raise PluginError(f"plugin {entry!r}: no such file or directory (and no module {name!r} to import)")
        return _guarded(entry, lambda: importlib.import_module(name))
    return _guarded(entry, lambda: _import_path(name, path))


def _same_file(source: str | None, path: Path) -> bool:
    """Whether the module file ``source`` is plugin ``path`` (a file, or a package's ``__init__.py``) or a copy of
    it (same bytes: Ray's shipped copy)."""
    if source is None:
        return False
    here = path / "__init__.py" if path.is_dir() else path
    try:
        return Path(source).resolve() == here.resolve() or Path(source).read_bytes() == here.read_bytes()
    except OSError:
        return False


def _import_path(name: str, path: Path) -> ModuleType:
    """Import ``path`` (a ``.py`` file, or a directory holding ``__init__.py``) as module ``name``: by name when a
    copy is importable (shipped by Ray), else from the path itself, without adding its directory to ``sys.path``
    (a plugin's other files travel only as a package, so importing them must fail here as it would on a worker)."""
    found = importlib.util.find_spec(name)
    if found is not None and _same_file(found.origin, path):
        return importlib.import_module(name)
    if found is not None and found.origin not in (None, "built-in", "frozen"):
        raise PluginError(f"plugin {str(path)!r}: its name {name!r} is also the name of another module "
                          f"({found.origin}); rename the plugin")
    if found is not None:
        raise PluginError(f"plugin {str(path)!r}: its name {name!r} is also the name of a built-in module; "
                          "rename the plugin")
    if path.is_dir():
        init = path / "__init__.py"
        if not init.is_file():
            raise PluginError(f"plugin {str(path)!r}: a directory plugin is a package and needs an __init__.py")
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _guarded(entry: str, load):
    try:
        return load()
    except PluginError:
        raise
    # any failure of the plugin's own code is reported with its cause, a sys.exit() too (it ended the sweep
    # silently, with the plugin's exit code); a Ctrl-C stays one
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise PluginError(f"plugin {entry!r} could not be imported: {describe(exc)}") from exc


def describe(exc: BaseException) -> str:
    """``ErrorType: message (file:line)`` with the innermost frame of the failing code (a SyntaxError: its line)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, SyntaxError):
        return text
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if "importlib" not in f.filename and f.filename != __file__]
    text = f"{text} ({own[-1].filename}:{own[-1].lineno})" if own else text
    if isinstance(exc, SystemExit):
        text += ("; a plugin is imported into the process that uses it (a sweep's driver, its workers) and must not "
                 "end it: remove the sys.exit() / exit() call, or raise an exception that says what is wrong")
    return text


def load_entry_points() -> list[str]:
    """Import every module of the ``promprune.methods`` entry-point group; returns their names. PluginError naming
    the entry point and its package when one fails."""
    names = []
    for ep in entry_points(group=GROUP):
        package = getattr(ep.dist, "name", None) or "?"
        try:
            ep.load()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported with its cause and where it comes from
            raise PluginError(f"entry point {ep.name!r} = {ep.value!r} (group {GROUP}, package {package!r}) could "
                              f"not be imported: {describe(exc)}; fix or uninstall {package!r}") from exc
        names.append(ep.value.split(":")[0])
    return names


_state = {"entry_points": False, "loading": False}
_seen_env: set[str] = set()


def ensure_loaded() -> None:
    """Import the entry-point plugins (once per process) and any ``$PROMPRUNE_PLUGINS`` entry not yet imported.
    Cheap when nothing changed; re-entrant calls (a plugin asking the registry while it is imported) do nothing."""
    if _state["loading"]:
        return
    entries = [e for e in env_entries() if e not in _seen_env]
    if _state["entry_points"] and not entries:
        return
    _state["loading"] = True
    try:
        if not _state["entry_points"]:
            load_entry_points()
            _state["entry_points"] = True
        for entry in entries:
            import_plugin(entry)
            _seen_env.add(entry)  # after success: a plugin that failed fails every call, never silently
    finally:
        _state["loading"] = False
