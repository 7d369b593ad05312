"""Methods and benchmarks from outside the repository (`pipelines/plugins.py`, `promprune/plugins.py`): paths in a
spec resolve against its file, plugins are imported before the spec's methods are checked and fail as one problem
naming themselves, the runtime environment ships them, and promprune itself finds them in a fresh process through
`$PROMPRUNE_PLUGINS`, the `promprune.methods` entry points and `$PROMPRUNE_INCLUDE_PATH`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipelines import plugins
from pipelines import spec as specs
from promprune import plugins as library
from promprune.eval import tasks
from promprune.selection import registry
from tests.own_task import task_yaml, write_task

REPO = Path(__file__).resolve().parents[2]

METHOD = '''
import torch
import promprune

@promprune.register_method("{name}", options={{"p": 2.0}})
def fn(tokens, budget, *, p):
    """Largest norm."""
    kept = tokens.x.norm(p=p, dim=-1).argsort(dim=1, descending=True, stable=True)[:, :budget]
    return promprune.Selection(kept, torch.zeros(tokens.batch, dtype=torch.long),
                               salient=torch.zeros_like(kept, dtype=torch.bool))
'''

HITS = "    return {'hits': 1.0, 'accuracy': 1.0}"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def own_task(directory: Path, name: str) -> Path:
    """A task directory whose task loads: its YAML, its utils.py and its data (data.parquet beside the YAML)."""
    return write_task(directory, name, yaml_name="own_task.yaml", metrics=("hits", "accuracy"),
                      process_results=HITS, questions=["Is it red?"])


@pytest.fixture
def isolated(monkeypatch):
    """Methods and modules (new top-level ones) a test registers or imports are gone afterwards; the plugin variables
    are restored."""
    names, modules = set(registry._REGISTRY), set(sys.modules)
    for variable in (library.ENV, tasks.INCLUDE_PATH_ENV):  # set, then unset: restored after the test either way
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    yield
    for name in set(registry._REGISTRY) - names:
        registry._REGISTRY.pop(name)
    tops = {name.partition(".")[0] for name in modules}
    for name in set(sys.modules) - modules:  # the plugins' own modules; a package imported before keeps the
        if name.partition(".")[0] not in tops:  # submodules imported meanwhile (torch._dynamo's, imported lazily:
            sys.modules.pop(name)  # popped, its next import registered its torch library twice and failed)


def spec_text(name: str, method: str, extra: str = "") -> str:
    return f"""
    name: {name}
    version: 1
    grid: {{method: [{method}], budget: [8]}}
    baseline: false
    {extra}
    """


# ----------------------------------------------------------------------------------------------------------------
# paths


def test_relative_paths_resolve_against_the_file_that_names_them(tmp_path, monkeypatch):
    base = write(tmp_path / "shared" / "base.yaml", """
        name: base
        version: 1
        plugins: [methods/a.py, some_package.methods]
        include_path: [tasks]
        """)
    top = write(tmp_path / "exp" / "top.yaml", f"""
        include: {base}
        name: top
        """)
    raw = specs.load_raw(top)
    assert raw["plugins"] == [str(tmp_path / "shared" / "methods" / "a.py"), "some_package.methods"]  # a module
    assert raw["include_path"] == [str(tmp_path / "shared" / "tasks")]                                # name stays
    monkeypatch.chdir(tmp_path)  # --set values: relative to where the command runs
    raw = specs.load_raw(top, ["include_path=[here, /abs/there]", "plugins=b.py"])
    assert raw["include_path"] == [str(tmp_path / "here"), "/abs/there"] and raw["plugins"] == [str(tmp_path / "b.py")]


def test_path_fields_are_validated(tmp_path):
    with pytest.raises(specs.SpecError) as err:
        specs.parse({"name": "t", "version": 1, "include_path": [3], "plugins": {"a": 1}})
    assert err.value.errors == [
        "plugins: expected a list of module names, .py files or package directories, got {'a': 1}",
        "include_path: expected a list of task directories, got [3]"]


# ----------------------------------------------------------------------------------------------------------------
# loading on the driver


def test_a_plugins_method_is_checked_like_ours(tmp_path, isolated):
    write(tmp_path / "norm_a.py", METHOD.format(name="norm_a"))
    spec = specs.load(write(tmp_path / "s.yaml", spec_text("s", "norm_a", "plugins: [norm_a.py]")))
    assert [t.trial_id for t in specs.expand(spec)] == ["norm_a-b8"]
    assert spec.plugins == [str(tmp_path / "norm_a.py")]
    bad = write(tmp_path / "bad.yaml", spec_text("s", "norm_a", "plugins: [norm_a.py]"))
    bad.write_text(bad.read_text() + "trials: [{method: norm_a, budget: 8, pp: 1.0}]\n")
    with pytest.raises(specs.SpecError, match=r"trials\[0\]\.pp: norm_a takes no option 'pp' \(did you mean 'p'\?\)"):
        specs.load(bad)
    with pytest.raises(specs.SpecError, match="unknown method 'norm_b'"):
        specs.load(write(tmp_path / "c.yaml", spec_text("s", "norm_b")))


IN_LLM_EXAMPLE = REPO / "examples" / "your_method" / "hidden_norm.py"  # an in-LLM method of one's own (a score)


def in_llm_spec(trials: str) -> str:
    return f"""
    name: s
    version: 1
    model: {{pretrained: "tiny:llava"}}
    plugins: [hidden_norm.py]
    baseline: false
    tasks: [testbed_exist_concentrated]
    grid: {{method: [hidden_norm, fastv], budget: [8]}}
    trials: {trials}
    """


def test_a_plugins_in_llm_method_is_checked_like_ours(tmp_path, isolated):
    """A plugin registering an in-LLM score (``register_in_llm_method(name, score=...)``): the spec takes it and its
    options (its own and the hooks' ``layers``) as it takes FastV's, refuses a misspelled or bad one as it refuses a
    built-in's, and the preflight checks its layers against the model's depth."""
    from pipelines import preflight

    shutil.copy(IN_LLM_EXAMPLE, tmp_path / "hidden_norm.py")
    trials = "[{method: hidden_norm, budget: 8, layers: [2], p: 1.0}]"
    spec = specs.load(write(tmp_path / "s.yaml", in_llm_spec(trials)))
    assert {t.trial_id: (t.method, t.options) for t in specs.expand(spec)} == {
        "hidden_norm-b8": ("hidden_norm", {}), "fastv-b8": ("fastv", {}),
        "hidden_norm-b8-layers=2-p=1.0": ("hidden_norm", {"layers": [2], "p": 1.0})}
    assert preflight.check_in_llm_layers(spec) == []
    for trial, needle in [
        ("{method: hidden_norm, budget: 8, pp: 1.0}", r"trials\[0\]\.pp: hidden_norm takes no option 'pp' \(did you "
                                                     r"mean 'p'\?\)"),
        ("{method: hidden_norm, budget: 8, p: 0.5}", r"trial hidden_norm-b8-p=0.5: option 'p' of hidden_norm must be "
                                                    r">= 1"),
        ("{method: hidden_norm, budget: 8, layers: [3, 2]}", r"option 'layers' of hidden_norm must list each pruning "
                                                            r"layer once in ascending order"),
    ]:
        with pytest.raises(specs.SpecError, match=needle):
            specs.load(write(tmp_path / "bad.yaml", in_llm_spec(f"[{trial}]")))
    deep = specs.load(write(tmp_path / "deep.yaml", in_llm_spec("[{method: hidden_norm, budget: 8, layers: [4]}]")))
    assert preflight.check_in_llm_layers(deep) == [
        "hidden_norm option 'layers' must be < 4 (LLM depth), got [4] (trial hidden_norm-b8-layers=4)"]


def test_a_fresh_process_runs_a_plugins_in_llm_method(tmp_path):
    """What a Ray worker does with the spec's plugin: ``$PROMPRUNE_PLUGINS`` names it, and PrunedVLM prunes with it
    inside the LLM (the default K = 2 of 32 is layer 1 of the testbed's 4)."""
    code = """
        from PIL import Image
        from promprune.models import PrunedVLM
        vlm = PrunedVLM.from_pretrained("tiny:llava", method="hidden_norm", budget=5, p=1.0)
        print(vlm.generate([Image.new("RGB", (40, 56), "red")], ["Colour?"], max_new_tokens=1)[0].layer_visual_tokens)
        """
    proc = _python(code, {library.ENV: str(IN_LLM_EXAMPLE), "HF_HUB_OFFLINE": "1"}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[36, 5, 5, 5]"


@pytest.mark.parametrize("source,needle", [
    ("import not_a_module_anywhere\n", "ModuleNotFoundError: No module named 'not_a_module_anywhere' ("),
    ("def broken(:\n", "SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here ("),
    # sys.exit() ended the sweep silently with the plugin's code (3: a nightly regression's)
    ("import sys\nsys.exit(3)\n", "SystemExit: 3 ("),
    ("exit('bye')\n", "SystemExit: bye ("),
])
def test_a_plugin_that_fails_to_import_is_the_one_problem(tmp_path, isolated, source, needle):
    write(tmp_path / "failing.py", source)
    with pytest.raises(specs.SpecError) as err:
        specs.load(write(tmp_path / "s.yaml", spec_text("s", "norm_x", "plugins: [failing.py]")))
    assert err.value.errors == [err.value.errors[0]] and err.value.errors[0].startswith(
        f"plugins[0]: plugin '{tmp_path / 'failing.py'}' could not be imported: ")
    assert needle in err.value.errors[0]
    assert "failing" not in sys.modules  # a failed import leaves nothing half-imported behind


@pytest.mark.parametrize("make,needle", [
    (lambda d: write(d / "json.py", "X = 1\n"), "a different module named 'json' is already imported"),
    (lambda d: write(d / "elsewhere" / "t_taken.py", "X = 1\n") and write(d / "t_taken.py", "X = 2\n"),
     "its name 't_taken' is also the name of another module"),
    (lambda d: write(d / "my-method.py", "X = 1\n"), "not a valid Python module name"),
    (lambda d: d / "absent.py", "no such file or directory"),
    (lambda d: (d / "pkg").mkdir() or d / "pkg", "needs an __init__.py"),
])
def test_plugin_names_that_cannot_work_are_refused(tmp_path, isolated, monkeypatch, make, needle):
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))  # where an importable module of the same name lives
    path = make(tmp_path)
    problems = plugins.load([str(path)])
    assert len(problems) == 1 and needle in problems[0], problems


def test_a_broken_plugin_named_by_the_environment_is_a_problem_too(tmp_path, isolated, monkeypatch):
    monkeypatch.setenv(library.ENV, str(write(tmp_path / "env_broken.py", "1/0\n")))
    problems = plugins.load([])
    assert problems == [f"$PROMPRUNE_PLUGINS: plugin '{tmp_path / 'env_broken.py'}' could not be imported: "
                        f"ZeroDivisionError: division by zero ({tmp_path / 'env_broken.py'}:1)"]


def test_an_entry_point_that_calls_sys_exit_is_a_problem_not_the_end(monkeypatch):
    """An installed package's ``promprune.methods`` entry point whose module calls sys.exit() at import: one problem
    naming the entry point and its package, as one that raises (the process ended with its exit code)."""
    from types import SimpleNamespace

    def load():
        raise SystemExit(3)

    ep = SimpleNamespace(name="norm", value="exiting.methods", dist=SimpleNamespace(name="exiting"), load=load)
    monkeypatch.setattr(library, "entry_points", lambda group: [ep])
    assert plugins.load([]) == ["plugins: entry point 'norm' = 'exiting.methods' (group promprune.methods, package "
                                "'exiting') could not be imported: SystemExit: 3 (" + __file__ + ":" +
                                str(load.__code__.co_firstlineno + 1) + "); a plugin is imported into the process "
                                "that uses it (a sweep's driver, its workers) and must not end it: remove the "
                                "sys.exit() / exit() call, or raise an exception that says what is wrong; fix or "
                                "uninstall 'exiting'"]


def test_a_module_name_that_is_not_importable_says_how_to_name_a_file(isolated):
    problems = plugins.load(["largest_nrm"])
    assert "name a file or package directory by its path instead, e.g. plugins: [largest_nrm.py]" in problems[0]


def test_a_package_directory_plugin_imports_its_own_modules(tmp_path, isolated):
    write(tmp_path / "normpkg" / "__init__.py", "from . import methods  # noqa\n")
    write(tmp_path / "normpkg" / "methods.py", METHOD.format(name="norm_pkg"))
    assert plugins.load([str(tmp_path / "normpkg")]) == []
    import promprune

    assert "norm_pkg" in promprune.methods()
    assert plugins.load([str(tmp_path / "normpkg")]) == []  # again: the module already imported
    # a spec beside it may name it bare (`plugins: [normpkg]`): a package directory beside the spec, not a module name
    assert plugins.resolve_paths({"plugins": ["normpkg", "some_module"]}, tmp_path)["plugins"] == [
        str(tmp_path / "normpkg"), "some_module"]


# ----------------------------------------------------------------------------------------------------------------
# the workers' side


def test_runtime_env_ships_what_was_activated(tmp_path, isolated):
    base = {"env_vars": {"PYTHONPATH": "/repo"}}
    assert plugins.runtime_env(base) == base  # nothing activated: unchanged
    plugin, task_dir = write(tmp_path / "m.py", "X = 1\n"), tmp_path / "tasks"
    plugins.activate([str(plugin), "installed.module"], [str(task_dir)])
    env = plugins.runtime_env(base)
    assert env["py_modules"] == [str(plugin), str(task_dir)]  # files and directories; a module name is installed
    assert env["env_vars"] == {"PYTHONPATH": "/repo", library.ENV: os.pathsep.join([str(plugin), "installed.module"]),
                               tasks.INCLUDE_PATH_ENV: str(task_dir)}
    plugins.activate([str(plugin)], [])  # again: each entry once
    assert os.environ[library.ENV] == os.pathsep.join([str(plugin), "installed.module"])


def _python(code: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=cwd, capture_output=True,
                           text=True, timeout=120)


def test_a_fresh_process_finds_plugins_and_entry_points(tmp_path):
    """What a Ray worker does: nothing but `promprune.methods()`, with the variable the sweep set, and an installed
    package's entry point (a dist-info directory on sys.path, as pip writes it)."""
    write(tmp_path / "plug" / "norm_env.py", METHOD.format(name="norm_env"))
    site = tmp_path / "site"
    write(site / "normdist" / "__init__.py", METHOD.format(name="norm_ep"))
    write(site / "normdist-1.0.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: normdist\nVersion: 1.0\n")
    write(site / "normdist-1.0.dist-info" / "entry_points.txt", "[promprune.methods]\nnorm = normdist\n")
    code = f"""
        import sys; sys.path.append({str(site)!r})
        import promprune
        print(sorted(set(promprune.methods()) - {{'cdpruner', 'coverage_only', 'divprune', 'downsample',
              'fixed_ratio', 'promprune', 'random', 'saliency_only', 'visionzip', 'vispruner'}}))
        """
    proc = _python(code, {library.ENV: str(tmp_path / "plug" / "norm_env.py")}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['norm_env', 'norm_ep']"
    write(site / "normdist" / "__init__.py", "import not_installed_dependency\n")
    proc = _python(code, {}, tmp_path)
    assert "PluginError: entry point 'norm' = 'normdist' (group promprune.methods, package 'normdist') could not be " \
           "imported: ModuleNotFoundError: No module named 'not_installed_dependency'" in proc.stderr


def test_a_shipped_copy_is_imported_by_its_name_when_the_path_is_not_here(tmp_path):
    """A node without the driver's filesystem: the path in $PROMPRUNE_PLUGINS does not exist, Ray's copy (a
    directory on sys.path) does."""
    write(tmp_path / "copy" / "norm_far.py", METHOD.format(name="norm_far"))
    code = f"""
        import sys; sys.path.append({str(tmp_path / 'copy')!r})
        import promprune
        print('norm_far' in promprune.methods(), sys.modules['norm_far'].__file__)
        """
    proc = _python(code, {library.ENV: "/driver/only/norm_far.py"}, tmp_path)
    assert proc.stdout.split() == ["True", str(tmp_path / "copy" / "norm_far.py")], proc.stderr


def test_include_path_variable_finds_tasks_and_their_shipped_copies(tmp_path, monkeypatch):
    write_task(tmp_path / "mine", "own_task_a", yaml_name="own_task.yaml", metrics=("hits", "accuracy"),
               process_results=HITS)
    with pytest.raises(ValueError, match="unknown lmms-eval task"):
        tasks.task_manager(["own_task_a"])
    monkeypatch.setenv(tasks.INCLUDE_PATH_ENV, str(tmp_path / "mine"))
    assert "own_task_a" in tasks.task_manager(["own_task_a"]).all_tasks
    assert tasks.primary_metrics("own_task_a") == ("hits",)  # a task of one's own: its first metric
    assert tasks.primary_metrics("pope") == ("pope_f1_score",)
    # the driver's path is not on this node; Ray's copy of the directory is on sys.path
    write(tmp_path / "shipped" / "theirs" / "own_task.yaml", task_yaml("own_task_b", metrics=("hits", "accuracy")))
    monkeypatch.setenv(tasks.INCLUDE_PATH_ENV, "/driver/only/theirs")
    with pytest.raises(ValueError, match="'/driver/only/theirs' .* is not on this machine"):
        tasks.task_manager(["own_task_b"])
    monkeypatch.syspath_prepend(str(tmp_path / "shipped"))
    assert tasks.env_include_paths() == [str(tmp_path / "shipped" / "theirs")]
    assert "own_task_b" in tasks.task_manager(["own_task_b"]).all_tasks


def test_preflight_looks_for_tasks_in_the_include_path(tmp_path):
    from pipelines import preflight

    own_task(tmp_path / "mine", "own_task_c")
    assert preflight.check_tasks(["own_task_c"], 2, [str(tmp_path / "mine")]) == []
    problems = preflight.check_tasks(["own_task_cc"], 2, [str(tmp_path / "mine")])
    assert problems[0].startswith("tasks: unknown lmms-eval task(s) ['own_task_cc'] (did you mean 'own_task_c' for "
                                  "'own_task_cc'?). Offline tasks: [")
    # a name close to none: no guess is offered (it read "did you mean {'zzqx_plain_nothing': []}?")
    (problem,) = preflight.check_tasks(["zzqx_plain_nothing"], 2, [str(tmp_path / "mine")])
    assert problem.startswith("tasks: unknown lmms-eval task(s) ['zzqx_plain_nothing']. Offline tasks: [")
    # a typo of an offline suite no other task names (only the asked suites are indexed): a guess all the same
    (problem,) = preflight.check_tasks(["testbed_exist_concentratd"], 2)
    assert "(did you mean 'testbed_exist_concentrated' for 'testbed_exist_concentratd'?)" in problem
    assert preflight.check_tasks(["own_task_c"], 2, [str(tmp_path / "nope")]) == [
        f"include_path: {tmp_path / 'nope'} is not a directory (relative paths in a spec are from its directory)"]


def test_evaluate_takes_plugins_and_task_directories(tmp_path, isolated, monkeypatch, capsys):
    """`pipelines/evaluate.py --plugin --include-path` (a one-trial spec): the plugin's method and its options and the
    directory's task are checked before Ray starts (a bad --video-frames is the only problem found, so nothing
    starts); a plugin that fails to import is the one problem."""
    from pipelines import evaluate

    write(tmp_path / "norm_e.py", METHOD.format(name="norm_e"))
    write(tmp_path / "broken.py", "raise RuntimeError('broken on purpose')\n")
    own_task(tmp_path / "mine", "own_task_e")
    monkeypatch.chdir(tmp_path)  # relative paths on the command line: from the working directory
    args = ["--include-path", "mine", "--method", "norm_e", "--budget", "8", "--tasks", "own_task_e",
            "--model", "tiny:llava", "--no-mlflow", "--video-frames", "0"]
    assert evaluate.main(["--plugin", "norm_e.py", "--option", "p=1.0", *args]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == ["  - --video-frames: expected an int >= 1, got 0"]
    assert evaluate.main(["--plugin", "norm_e.py", "--option", "pp=1.0", *args]) == 2
    # the spec's own check of an explicit trial's options, named by the flag that set it
    assert "  - --option pp: norm_e takes no option 'pp' (did you mean 'p'?)" in capsys.readouterr().err
    assert evaluate.main(["--plugin", "norm_e.py", "--plugin", "broken.py", *args]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [  # named by the flag as typed, not the spec's plugins[1]
        f"  - --plugin broken.py: plugin '{tmp_path / 'broken.py'}' could not be imported: RuntimeError: broken on "
        f"purpose ({tmp_path / 'broken.py'}:1)"]


def test_evaluate_names_a_missing_plugin_and_task_directory_as_typed(tmp_path, isolated, monkeypatch, capsys):
    """`pipelines/evaluate.py`'s --plugin and --include-path problems name the flag and the entry as typed (not the
    spec's `plugins[0]`), and say what the command line does: a relative path is from the working directory (a spec's
    are from its file's directory)."""
    from pipelines import evaluate

    monkeypatch.chdir(tmp_path)
    args = ["--model", "tiny:llava", "--tasks", "easyvqa_yesno", "--no-mlflow"]
    assert evaluate.main(["--plugin", "nope.py", *args]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [
        f"  - --plugin nope.py: plugin '{tmp_path / 'nope.py'}': no such file or directory (and no module 'nope' "
        "to import)"]
    assert evaluate.main(["--plugin", "no_such_module_e", *args]) == 2
    err = capsys.readouterr().err
    assert "  - --plugin no_such_module_e: plugin 'no_such_module_e' could not be imported" in err
    assert err.rstrip().endswith("e.g. --plugin no_such_module_e.py") and "plugins" not in err
    assert evaluate.main(["--include-path", "nodir", *args]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [
        f"  - --include-path nodir: {tmp_path / 'nodir'} is not a directory (a relative path is from the working "
        "directory)"]
