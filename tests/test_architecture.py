"""The layering the design card promises, checked on the source: no import cycles (function-local imports count),
the library never imports the pipeline, and Ray / MLflow stay in the pipeline layer."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("promprune", "pipelines")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Project modules that ``name`` imports anywhere in its file (module level or inside functions) -> line."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule; `from mod import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _without_package_inits(graph):
    """A package's ``__init__`` re-exporting its own submodules is not a cycle with them: drop the edges from a
    package to modules inside it, keep everything else."""
    return {v: {w: line for w, line in edges.items() if not w.startswith(v + ".")} for v, edges in graph.items()}


def test_no_import_cycles():
    cycles = _cycles(_without_package_inits(_graph()))
    assert cycles == [], f"import cycles (function-local imports included): {cycles}"


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "p": {"p.x": 1}, "p.x": {"p": 1}}
    assert _cycles(graph) == [["a", "b", "c"], ["p", "p.x"]]
    assert _cycles(_without_package_inits(graph)) == [["a", "b", "c"]]


def test_the_library_never_imports_the_pipeline_or_ray_or_mlflow():
    offenders = []
    for path in (ROOT / "promprune").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in ("pipelines", "ray", "mlflow")]
    assert offenders == []


def test_the_run_parts_never_import_the_clis():
    """A trial reads sweep.py (driver, CLI) -> run/trial.py -> run/engine.py -> run/result.py -> recording/recorder.py:
    nothing under pipelines/run/ reaches back up into the two CLIs."""
    graph = _graph()
    upward = [f"{name} -> {target} (line {line})" for name, edges in graph.items() if name.startswith("pipelines.run")
              for target, line in edges.items() if target in ("pipelines.sweep", "pipelines.evaluate")]
    assert upward == []
    assert "pipelines.run.trial" in graph["pipelines.sweep"] and "pipelines.run.trial" in graph["pipelines.evaluate"]


def test_no_private_name_is_imported_across_packages():
    """A module takes only public names from another package's modules (issue 55: the sweep imported the recorder's
    `_LIVE_RECORDERS` registry by its private name); `from pipelines.sweep import main as _main` renames a public
    one, which is fine."""
    modules, offenders = _modules(), []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in modules:
                continue
            source = node.module if modules[node.module].name == "__init__.py" else node.module.rpartition(".")[0]
            offenders += [f"{name}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__") and source != package]
    assert offenders == []


def test_the_pool_and_a_trial_start_without_torch():
    """Ray makes the sweep's pool actor import the module of the workers it is handed (`pipelines.run.workers`), and a
    trial's process imports `pipelines.run.trial`: neither imports torch (seconds of CPU on the way to the first
    answer); the library's names still resolve on first use (`promprune.select`)."""
    import subprocess
    import sys

    probe = ("import sys, pipelines.run.workers, pipelines.run.trial, promprune.records; "
             "print('torch' in sys.modules); import promprune; promprune.select; print('torch' in sys.modules, "
             "callable(promprune.select), 'select' in dir(promprune))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True", "True"]


def test_a_new_sqlite_store_is_checked_without_importing_mlflow(tmp_path):
    """The preflight's store check of a SQLite file not made yet reads the directory only: MLflow's import (~1 s of
    the driver's single-threaded setup) waits for the store's opening, which runs while Ray starts. A store that
    exists is opened by MLflow there and then."""
    import subprocess
    import sys

    probe = ("import sys; from pipelines.preflight import check_store; "
             f"print(check_store('sqlite:///{tmp_path}/new.db'), 'mlflow' in sys.modules); "
             f"print(bool(check_store('sqlite:///{tmp_path}/nodir/new.db')), 'mlflow' in sys.modules); "
             f"open('{tmp_path}/old.db', 'w').close(); print(check_store('sqlite:///{tmp_path}/old.db'), "
             "'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["[] False", "True False", "[] True"], out.stdout + out.stderr[-2000:]
