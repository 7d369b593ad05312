"""Where a sweep keeps its records (issue 56 item 1): a local run in its working directory, as the README says; a Ray
job on the head, in ``$PROMPRUNE_HOME`` (default ``~/promprune``), never in Ray's package copy of the checkout. The
end-to-end check (a job on a loopback head, the head stopped, its temp dir deleted, every run still there) is
`scripts/job_submit_smoke.sh`, run by tests/pipelines/test_deploy.py."""
from __future__ import annotations

import shlex

import pytest

from pipelines import mlflow_layout, paths
from pipelines.run import state


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory standing for Ray's package copy, a home of its own, no store or storage named."""
    (tmp_path / "pkg").mkdir()
    monkeypatch.chdir(tmp_path / "pkg")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in (paths.HOME_ENV, paths.JOB_ENV, paths.TRACKING_URI_ENV, paths.STORAGE_ENV):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_a_local_run_keeps_its_records_in_its_working_directory(elsewhere):
    assert paths.records_root() == elsewhere / "pkg"
    assert mlflow_layout.tracking_uri() == f"sqlite:///{elsewhere / 'pkg' / 'mlflow.db'}"
    assert paths.default_storage() == str(elsewhere / "pkg" / "outputs" / "tune")
    assert paths.job_defaults_line() is None


def test_a_ray_job_keeps_its_records_in_promprune_home(elsewhere, monkeypatch):
    monkeypatch.setenv(paths.JOB_ENV, "{}")  # what `ray job submit` sets in the entrypoint's environment
    home = elsewhere / "home" / "promprune"
    assert mlflow_layout.tracking_uri() == f"sqlite:///{home / 'mlflow.db'}"
    assert mlflow_layout.ui_command() == f"mlflow ui --backend-store-uri sqlite:///{home / 'mlflow.db'}"
    assert paths.default_storage() == str(home / "outputs" / "tune")
    assert paths.outputs_dir() == home / "outputs"
    line = paths.job_defaults_line()
    assert line.startswith(f"a Ray job keeps nothing in its package copy: MLflow store sqlite:///{home / 'mlflow.db'}")
    assert str(elsewhere / "pkg") not in line
    monkeypatch.setenv(paths.HOME_ENV, str(elsewhere / "records"))
    assert paths.records_root() == elsewhere / "records"
    monkeypatch.setenv(paths.TRACKING_URI_ENV, "http://127.0.0.1:5000")  # named: kept
    monkeypatch.setenv(paths.STORAGE_ENV, "s3://bucket/tune")
    assert mlflow_layout.tracking_uri() == "http://127.0.0.1:5000" and paths.job_defaults_line() is None


def test_a_sqlite_stores_artifacts_sit_beside_it_wherever_the_process_runs(elsewhere):
    """MLflow's own default is ./mlruns of the process's directory: a job's package copy."""
    uri = f"sqlite:///{elsewhere / 'store' / 'mlflow.db'}"
    assert mlflow_layout.artifact_location(uri) == str(elsewhere / "store" / "mlruns" / "promprune")
    assert mlflow_layout.artifact_location("http://127.0.0.1:5000") is None  # a server has its own


def test_a_jobs_resume_command_is_a_submit_command():
    """A job's state lives on the head: its resume is a job too, with the token the CLI needs."""
    job = {"experiment": "q-1", "command": {"config": "sweeps/quickstart.yaml", "overrides": [], "ray_job": True}}
    assert state.resume_command(job) == ("RAY_AUTH_MODE=token ray job submit --working-dir . -- python "
                                         "pipelines/sweep.py --config sweeps/quickstart.yaml --resume q-1")
    local = {**job, "command": {**job["command"], "ray_job": False}}
    assert state.resume_command(local) == "python pipelines/sweep.py --config sweeps/quickstart.yaml --resume q-1"


def test_a_script_in_pipelines_does_not_shadow_top_level_packages():
    """`python pipelines/<script>.py` puts pipelines/ first on sys.path; once the package is imported, a bare
    `import evaluate` (lmms-eval's, for Hugging Face's) no longer finds pipelines/evaluate.py."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = ("import sys; sys.path.insert(0, 'pipelines'); import importlib.util as u; "
            "ours = lambda: u.find_spec('evaluate').origin.endswith('pipelines/evaluate.py'); "
            "before = ours(); import pipelines; print(before, ours())")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]  # shadowed by the directory entry, then not


@pytest.mark.parametrize("script", ["sweep", "evaluate", "report", "fig2_concentration"])
def test_a_script_run_by_path_imports_its_own_checkout(tmp_path, script):
    """`python <clone>/pipelines/<script>.py` runs that clone's `pipelines`, even where another checkout's packages
    come first on the path (an editable install of another clone, here PYTHONPATH naming this one): the script and
    the package it imports are one checkout's. The clone's package says where it was imported from. A folder
    without pyproject.toml is no checkout (site-packages of a plain install): it is not put first."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    clone = tmp_path / "clone"
    shutil.copytree(repo / "pipelines", clone / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "promprune").symlink_to(repo / "promprune")
    shutil.copy(repo / "pyproject.toml", clone / "pyproject.toml")
    with open(clone / "pipelines" / "__init__.py", "a") as init:
        init.write("\n_sys.stderr.write(f'pipelines imported from {__file__}\\n')\n")
    env = {**os.environ, "PYTHONPATH": str(repo)}  # the other checkout first on the path
    said = f"pipelines imported from {clone / 'pipelines' / '__init__.py'}"
    for checkout in (True, False):
        if not checkout:
            (clone / "pyproject.toml").unlink()
        out = subprocess.run([sys.executable, str(clone / "pipelines" / f"{script}.py"), "--help"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert (said in out.stderr) == checkout, out.stderr


def test_a_tracking_server_is_opened_at_its_own_address(monkeypatch):
    """`mlflow ui --backend-store-uri http://...` fails (no registry store for http); a server serves its own UI, so
    the closing advice is its page, at its host and port, not `mlflow ui`'s default 127.0.0.1:5000."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.mlflow.svc:5077/")
    assert mlflow_layout.ui_command() is None
    assert mlflow_layout.ui_url("3", "promprune-x") == ("http://mlflow.mlflow.svc:5077/#/experiments/3/runs"
                                                        "?workflowType=machine_learning&viewStateShareKey=promprune-x")
    text = mlflow_layout.open_results(mlflow_layout.ui_url("3"))
    assert "mlflow ui" not in text and "http://mlflow.mlflow.svc:5077/#/experiments/3/runs" in text
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/x/mlflow.db")
    assert mlflow_layout.open_results("http://127.0.0.1:5000/#/e") == (
        "Open the results:\n  mlflow ui --backend-store-uri sqlite:////tmp/x/mlflow.db\n  then http://127.0.0.1:5000/#/e")


def test_the_ui_command_pastes_as_one_argument_for_a_store_whose_path_has_a_space(monkeypatch):
    """`mlflow ui --backend-store-uri sqlite:////tmp/x y/mlflow.db`, printed unquoted, failed when pasted (the shell
    split the URI at the space); the shell now reads back the URI whole."""
    import shlex

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/x y/mlflow.db")
    command = mlflow_layout.ui_command()
    assert shlex.split(command) == ["mlflow", "ui", "--backend-store-uri", "sqlite:////tmp/x y/mlflow.db"]
    assert command in mlflow_layout.open_results()


def _submitted(command: str) -> tuple[dict, list[str]]:
    """A printed ``ray job submit`` command as Ray's own CLI reads it: (its options, the entrypoint's words)."""
    import shlex

    from ray.dashboard.modules.job.cli import submit

    words = shlex.split(command)
    prefix = [w for w in words[:words.index("ray")] if "=" in w]  # VAR=value before the command
    params = submit.make_context("submit", words[words.index("submit") + 1:]).params
    return {"env": dict(p.split("=", 1) for p in prefix), **params}, list(params["entrypoint"])


def test_a_jobs_resume_command_carries_the_variables_its_run_depended_on():
    """deploy/nightly.cron submits with --runtime-env-json naming the MLflow server and an s3:// Tune storage; the
    printed resume command dropped them, and running it looked for the run's state in ~/promprune and refused it.
    Read by Ray's CLI, the command sets them again: the store, the experiment and each PROMPRUNE_* variable the
    pipeline reads, not the scripts' variables nor anything else of the environment (an API key)."""
    import json

    from pipelines import sweep

    environ = {paths.JOB_ENV: "{}", "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000", "MLFLOW_EXPERIMENT_NAME": "n",
               "PROMPRUNE_STORAGE": "s3://bucket/promprune/tune", "PROMPRUNE_ENTROPY": "exact",
               "PROMPRUNE_CANARY_VENV": "/venv", "OPENAI_API_KEY": "sk-secret", "PATH": "/usr/bin", "HOME": "/root"}
    command = state.launch_command("sweeps/nightly.yaml", [], regression_threshold=0.02, environ=environ)
    options, entrypoint = _submitted(state.resume_command({"experiment": "nightly-1", "command": command}))
    assert json.loads(options["runtime_env_json"]) == {"env_vars": {
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000", "MLFLOW_EXPERIMENT_NAME": "n",
        "PROMPRUNE_STORAGE": "s3://bucket/promprune/tune", "PROMPRUNE_ENTROPY": "exact"}}
    assert options["working_dir"] == "."
    args = sweep.parse_args(entrypoint[2:])
    assert entrypoint[:2] == ["python", "pipelines/sweep.py"] and args.resume == "nightly-1"
    assert args.config == "sweeps/nightly.yaml" and args.regression_threshold == 0.02
    local = state.launch_command("sweeps/nightly.yaml", [], environ={k: v for k, v in environ.items()
                                                                     if k != paths.JOB_ENV})
    assert not local["ray_job"]
    # a local run's command may be typed in another shell: the variables go in front of it (its state was looked
    # for in ~/promprune without PROMPRUNE_STORAGE, and the resume refused)
    printed = state.resume_command({"experiment": "nightly-1", "command": local})
    assert printed.startswith("MLFLOW_TRACKING_URI=http://127.0.0.1:5000 MLFLOW_EXPERIMENT_NAME=n "
                              "PROMPRUNE_ENTROPY=exact PROMPRUNE_STORAGE=s3://bucket/promprune/tune python ")
    assert "sk-secret" not in printed and "CANARY" not in printed
    words = shlex.split(printed)
    assert sweep.parse_args(words[6:]).resume == "nightly-1" and words[4:6] == ["python", "pipelines/sweep.py"]


def test_a_jobs_resume_command_keeps_an_offline_clusters_hub_settings():
    """docs/pipeline.md has an offline cluster's jobs set HF_HOME and the *_OFFLINE switches; the resume printed after
    `ray job stop` dropped them, so the resumed job went online (or looked in ~/.cache) for its model and data. They
    come back in its runtime env; a token (HF_TOKEN) does not."""
    import json

    offline = {"HF_HOME": "/data/hf", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "LMMS_EVAL_DATASETS_CACHE": "/data/lmms"}
    environ = {paths.JOB_ENV: "{}", "PROMPRUNE_STORAGE": "/shared/tune", **offline, "HF_TOKEN": "hf_secret",
               "HUGGING_FACE_HUB_TOKEN": "hf_secret2"}
    command = state.launch_command("sweeps/nightly.yaml", [], environ=environ)
    printed = state.resume_command({"experiment": "nightly-1", "command": command})
    options, _ = _submitted(printed)
    assert json.loads(options["runtime_env_json"]) == {"env_vars": {"PROMPRUNE_STORAGE": "/shared/tune", **offline}}
    assert "hf_secret" not in printed


def test_a_resume_that_finds_no_state_says_where_it_looked_and_what_moves_it(tmp_path, monkeypatch):
    """A run started with PROMPRUNE_STORAGE (a job's runtime env), resumed without it: the refusal said "start it
    without --resume", which reruns the whole sweep. It names the storage it looked in, what chose it, and that the
    run's setting is needed; with that setting the same resume finds the run."""
    from pipelines import spec as specs

    monkeypatch.chdir(tmp_path)
    for name in (paths.JOB_ENV, paths.STORAGE_ENV):
        monkeypatch.delenv(name, raising=False)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text("name: rel\nversion: 1\nmodel: {pretrained: 'tiny:llava'}\ntasks: [easyvqa_yesno]\n"
                         "grid: {method: [promprune], budget: [8]}\n")
    spec = specs.load(spec_path)
    elsewhere = tmp_path / "shared" / "tune"
    state.save_state(str(elsewhere), {"experiment": "rel-20261122-000000", "parent_run_id": "r0",
                                      "storage_path": str(elsewhere), "fingerprint": state.fingerprint(spec),
                                      "spec_yaml": specs.dump_resolved(spec), "command": {}})
    for resume, what in (("rel-20261122-000000", "no run 'rel-20261122-000000'"), ("latest", "no run")):
        with pytest.raises(specs.SpecError) as refused:
            state.resumed_state(spec, resume)
        message = str(refused.value)
        assert f"{what} of sweep 'rel' in the Tune storage {tmp_path / 'outputs' / 'tune'}, chosen by the default: " \
               "outputs/tune in the working directory" in message, message
        assert "$PROMPRUNE_STORAGE" in message and "--runtime-env-json" in message and "$PROMPRUNE_HOME" in message
        assert "to run the sweep anew instead, leave out --resume" in message
    monkeypatch.setenv(paths.JOB_ENV, "{}")  # a Ray job looks in $PROMPRUNE_HOME, and says so
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(specs.SpecError, match=r"chosen by a Ray job's default: outputs/tune in \$PROMPRUNE_HOME"):
        state.resumed_state(spec, "latest")
    monkeypatch.setenv(paths.STORAGE_ENV, str(elsewhere))  # the run's setting: found
    assert state.resumed_state(spec, "latest")["experiment"] == "rel-20261122-000000"


def test_the_resume_command_names_the_spec_relative_to_the_working_directory(tmp_path, monkeypatch):
    """A Ray job run with the default spec printed --config <ray temp>/session_*/.../_ray_pkg_*/sweeps/quickstart.yaml:
    Ray's package copy of the checkout, which the resumed job's upload does not recreate there. A spec under the
    working directory (the package copy, the checkout) is named relative to it, as `--working-dir .` uploads it; one
    elsewhere keeps the path it was given."""
    from pipelines import frontdoor

    package = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    (package / "sweeps").mkdir(parents=True)
    monkeypatch.chdir(package)
    monkeypatch.setenv(paths.JOB_ENV, "{}")
    command = state.launch_command(str(package / "sweeps" / "quickstart.yaml"), [])
    assert command["config"] == "sweeps/quickstart.yaml"
    assert "--config sweeps/quickstart.yaml --resume" in state.resume_command({"experiment": "q-1", "command": command})
    (tmp_path / "link").symlink_to(package)  # a working directory reached through a link
    monkeypatch.chdir(tmp_path / "link")
    assert state.launch_command(str(package / "sweeps" / "quickstart.yaml"), [])["config"] == "sweeps/quickstart.yaml"
    assert state.launch_command("./sweeps/nightly.yaml", [])["config"] == "sweeps/nightly.yaml"
    assert state.launch_command("../elsewhere.yaml", [])["config"] == "../elsewhere.yaml"  # not under it: as given
    monkeypatch.chdir(frontdoor.REPO)  # the checkout, the default spec as the CLI fills it in
    assert state.launch_command(str(frontdoor.DEFAULT_CONFIG), [])["config"] == "sweeps/quickstart.yaml"
    monkeypatch.chdir(tmp_path)  # a local run elsewhere: the checkout's spec by its absolute path
    assert state.launch_command(str(frontdoor.DEFAULT_CONFIG), [])["config"] == str(frontdoor.DEFAULT_CONFIG)


@pytest.mark.parametrize("mode, token", [("token", True), ("TOKEN", True), ("disabled", False), (None, False)])
def test_a_jobs_resume_command_sends_the_token_only_where_its_head_enforces_one(mode, token):
    """The printed job command always began with RAY_AUTH_MODE=token, with which Ray's CLI refuses to start where it
    finds no token (a head without token auth). A job's entrypoint inherits its head's RAY_AUTH_MODE (checked on
    Ray 2.60: `token` for a head started with it or with ~/.ray/auth_token present, `disabled` for one started
    so), and the command sets it exactly then. A state from before this says nothing: the prefix stays."""
    environ = {paths.JOB_ENV: "{}", **({paths.AUTH_MODE_ENV: mode} if mode else {})}
    command = state.launch_command("sweeps/quickstart.yaml", [], environ=environ)
    options, _ = _submitted(state.resume_command({"experiment": "q-1", "command": command}))
    assert options["env"] == ({"RAY_AUTH_MODE": "token"} if token else {})
    older = {k: v for k, v in command.items() if k != "token_auth"}
    assert _submitted(state.resume_command({"experiment": "q-1", "command": older}))[0]["env"] == \
        {"RAY_AUTH_MODE": "token"}


# ----------------------------------------------------------------------------------------------------------------
# places a Ray job names: absolute, or refused before any work (its working directory is Ray's package copy)


@pytest.mark.parametrize("name, value", [
    ("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"),
    ("MLFLOW_TRACKING_URI", "sqlite:///~/mlflow.db"),  # SQLAlchemy does not expand "~": ./~/mlflow.db
    ("PROMPRUNE_HOME", "records"),
    ("PROMPRUNE_STORAGE", "outputs/tune"),
    ("PROMPRUNE_STORAGE", "file://outputs/tune"),
])
def test_a_ray_job_refuses_a_relative_store_home_or_storage(elsewhere, monkeypatch, capsys, name, value):
    """A probe's case: in `ray job submit --working-dir .`, MLFLOW_TRACKING_URI=sqlite:///mlflow.db and a relative
    PROMPRUNE_HOME landed silently in Ray's package copy (deleted by Ray), the closing `mlflow ui` line naming a
    relative path; a relative PROMPRUNE_STORAGE was refused as "not a path". Each is refused before Ray starts, in
    one paragraph naming the variable and the fix (an absolute path); the same value outside a job is left alone."""
    monkeypatch.setenv(name, value)
    assert paths.relative_in_job() == []  # a local run: relative to the working directory, as the README says
    monkeypatch.setenv(paths.JOB_ENV, "{}")
    (problem,) = paths.relative_in_job()
    assert problem.startswith(f"environment variable {name}={value} is a relative path, which in a Ray job is "
                              "relative to Ray's copy of the working directory")
    assert "--runtime-env-json to an absolute path" in problem and "\n" not in problem
    from pipelines import sweep

    assert sweep.main(["--config", "sweeps/none.yaml"]) == 2  # refused before the spec is read
    err = capsys.readouterr().err
    assert err == f"error: the Ray job's environment: 1 problem(s):\n  - {problem}\n"
    assert not any((elsewhere / "pkg").iterdir())  # nothing made in the package copy


@pytest.mark.parametrize("absolute", [
    {"MLFLOW_TRACKING_URI": "sqlite:////data/mlflow.db"}, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"},
    {"PROMPRUNE_HOME": "~/records"}, {"PROMPRUNE_HOME": "/data/records"},
    {"PROMPRUNE_STORAGE": "s3://bucket/tune"}, {"PROMPRUNE_STORAGE": "/shared/tune"},
    {"PROMPRUNE_STORAGE": "file:///shared/tune"}])
def test_a_ray_job_takes_absolute_places(elsewhere, monkeypatch, absolute):
    monkeypatch.setenv(paths.JOB_ENV, "{}")
    for name, value in absolute.items():
        monkeypatch.setenv(name, value)
    assert paths.relative_in_job() == []


@pytest.mark.parametrize("storage", ["outputs/tune", "./tune", "file://outputs/tune"])
@pytest.mark.parametrize("given", ["spec", "set"])
def test_a_ray_job_refuses_a_relative_tune_storage_path(elsewhere, monkeypatch, capsys, storage, given):
    """A probe's case: the env variables were refused relative in a job, the spec's tune.storage_path (its file or
    --set) was not, so Tune's results went to Ray's package copy (deleted by Ray). Refused like the variables, in
    one paragraph naming the field and the fix, exit 2, before the spec's plugins, the preflight or Ray; outside a
    job the helper says nothing (a local run's is its working directory's)."""
    from pipelines import sweep

    spec = elsewhere / "pkg" / "q.yaml"
    tune = f"tune:\n  storage_path: {storage}\n" if given == "spec" else ""
    spec.write_text(f"name: q\nversion: 1\n{tune}")
    overrides = ["--set", f"tune.storage_path={storage}"] if given == "set" else []
    assert paths.relative_storage_in_job(storage) == []
    monkeypatch.setenv(paths.JOB_ENV, "{}")
    (problem,) = paths.relative_storage_in_job(storage)
    assert problem == (
        f"tune.storage_path: {storage} is a relative path, which in a Ray job is relative to Ray's copy of the working "
        "directory (<ray temp>/session_*/runtime_resources/working_dir_files/_ray_pkg_*), deleted by Ray with the "
        "session: nothing kept there lasts. Set tune.storage_path (in the spec, or --set tune.storage_path=...) to an "
        "absolute path, e.g. /<folder every node reaches> or s3://<bucket>/<prefix>, or leave it unset (the job's Tune "
        "storage is then $PROMPRUNE_STORAGE, else outputs/tune in $PROMPRUNE_HOME, default ~/promprune)")
    assert sweep.main(["--config", "q.yaml", *overrides]) == 2
    out, err = capsys.readouterr()
    assert err == f"error: q.yaml: 1 problem(s):\n  - {problem}\n" and "Traceback" not in out + err
    assert sorted(p.name for p in (elsewhere / "pkg").iterdir()) == ["q.yaml"]  # nothing made in the package copy


@pytest.mark.parametrize("storage", ["/shared/tune", "file:///shared/tune", "~/tune", "s3://bucket/tune", None])
def test_a_ray_job_takes_an_absolute_or_remote_tune_storage_path(elsewhere, monkeypatch, storage):
    monkeypatch.setenv(paths.JOB_ENV, "{}")
    assert paths.relative_storage_in_job(storage) == []


def test_a_home_relative_tune_storage_is_the_home_folder_everywhere(elsewhere, monkeypatch):
    """tune.storage_path: ~/tune put the sweep's state in ~/tune (pyarrow expands "~") but Tune's experiments, the
    outbox and the free-space check in ./~/tune: in a Ray job, Ray's package copy, deleted with its session."""
    from pipelines.run import disk

    home = elsewhere / "home"
    for job in (False, True):
        if job:
            monkeypatch.setenv(paths.JOB_ENV, "{}")
        assert disk.tune_storage("~/tune")[0] == str(home / "tune")
        assert disk.local_dir("~/tune") == home / "tune"  # (the free-space check)
        assert state.outbox_dir("~/tune", "q-1") == home / "tune" / "_promprune_state" / "q-1.outbox"
        assert state._state_fs("~/tune")[1] == f"{home / 'tune'}/_promprune_state"  # where the state always was


def test_an_uncreatable_promprune_home_is_one_paragraph_and_exit_2(elsewhere, monkeypatch, capsys):
    """A probe's case: PROMPRUNE_HOME=/proc/pp in a job was a FileNotFoundError traceback, exit 1 (the records folder
    was made before the checks that turn problems into exit-2 messages)."""
    from pipelines import sweep

    monkeypatch.setenv(paths.JOB_ENV, "{}")
    monkeypatch.setenv(paths.HOME_ENV, "/proc/pp")
    assert sweep.main(["--config", "sweeps/none.yaml"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 2, err
    assert "a Ray job keeps its records (logs; MLflow store and Tune state unless named elsewhere) in /proc/pp " \
           "($PROMPRUNE_HOME=/proc/pp), which cannot be made or written on this node (No such file or directory); " \
           "set PROMPRUNE_HOME in the job's --runtime-env-json to an absolute folder the head can write" in err
    monkeypatch.delenv(paths.JOB_ENV)  # a local run does not use it
    assert paths.home_problem() is None


def test_a_jobs_unwritable_store_is_told_the_absolute_fix(elsewhere, monkeypatch):
    """The refusal of a store that cannot be written suggested sqlite:///mlflow.db, which in a job lands in Ray's
    package copy; in a job it gives an absolute path, or the job's default."""
    from pipelines import preflight

    uri = f"sqlite:///{elsewhere / 'missing' / 'mlflow.db'}"
    assert "sqlite:///mlflow.db in a writable directory" in preflight.check_store(uri)[0]
    monkeypatch.setenv(paths.JOB_ENV, "{}")
    (problem,) = preflight.check_store(uri)
    assert "sqlite:///mlflow.db" not in problem and "sqlite:////<absolute folder>/mlflow.db" in problem
    assert "or leave it unset (mlflow.db in $PROMPRUNE_HOME" in problem


def test_a_spec_not_found_in_a_ray_job_says_where_paths_resolve(elsewhere, monkeypatch):
    """Inside a job, "spec file not found: quickstart.yaml" said nothing of where the job looked: Ray's copy of the
    working directory. The message says so, and names sweeps/<file> where the copy has it."""
    from pipelines import spec as specs

    (elsewhere / "pkg" / "sweeps").mkdir()
    (elsewhere / "pkg" / "sweeps" / "quickstart.yaml").write_text("name: q\nversion: 1\n")
    with pytest.raises(specs.SpecError) as local:
        specs.load("quickstart.yaml")
    assert str(local.value).endswith("spec file not found: quickstart.yaml")
    monkeypatch.setenv(paths.JOB_ENV, "{}")
    with pytest.raises(specs.SpecError) as job:
        specs.load("quickstart.yaml")
    assert str(job.value).endswith(
        f"spec file not found: quickstart.yaml (in a Ray job, a relative path is relative to Ray's copy of the "
        f"--working-dir it uploaded, {elsewhere / 'pkg'}: name the spec as it lies in that folder; did you mean "
        "sweeps/quickstart.yaml?)")
    with pytest.raises(specs.SpecError, match=r"e\.g\. sweeps/<spec>\.yaml, and submit from the checkout's root\)$"):
        specs.load("nowhere.yaml")


@pytest.mark.parametrize("storage", ["outputs/tune", "./tune", "~/tune"])
def test_a_local_run_takes_a_relative_tune_storage_path_in_its_working_directory(elsewhere, storage):
    """Outside a job a relative tune.storage_path is the working directory's: the sweep's state opened with pyarrow,
    which takes no relative path, so a run with ``storage_path: outputs/tune`` stopped at its driver lock with "not a
    path or a URI pyarrow can open" (exit 2)."""
    from pipelines import spec as specs

    spec_path = elsewhere / "pkg" / "spec.yaml"
    spec_path.write_text("name: rel\nversion: 1\nmodel: {pretrained: 'tiny:llava'}\ntasks: [easyvqa_yesno]\n"
                         f"grid: {{method: [promprune], budget: [8]}}\ntune: {{storage_path: '{storage}'}}\n")
    spec = specs.load(spec_path)
    expected = {"outputs/tune": elsewhere / "pkg" / "outputs" / "tune", "./tune": elsewhere / "pkg" / "tune",
                "~/tune": elsewhere / "home" / "tune"}[storage]
    root = state.storage_root(spec)
    assert root == str(expected)
    state.save_state(root, {"experiment": "rel-20261122-000000", "parent_run_id": "r0", "storage_path": root})
    assert (expected / "_promprune_state").is_dir()
    assert state.load_state(root, "rel", "latest")["parent_run_id"] == "r0"
