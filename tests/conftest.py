"""Shared test setup: offline, deterministic, gentle on a 2-core machine."""
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray runs its workers at nice 15 (its `worker_niceness`), below everything else on the machine. Under pytest-xdist the
# other worker's test runs at nice 0, and on 2 cores a test's Ray workers then get a few % of a core: in CI (the
# submission of 2026-11-28's sixth stop) a sweep's test timed out at 900 s. Reproduced here beside two nice-0 busy
# loops (`scripts/under_load.sh`), its worker was still importing torch after 200 s and the test unfinished after
# 300 s; with this line it passed in 80 s. Equal niceness shares the cores.
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray's temp dir, one per test process: `ray start` and `ray.cluster_utils.Cluster` record their head in it
# (`ray_current_cluster`) and a sweep started with no address joins the head recorded there (`ray_connect.connect`, as a
# user's would). Shared between pytest-xdist's workers, a sweep under test on one worker joined the other worker's
# test cluster and failed when that test killed a node. A test that wants a dir of its own still sets its own.
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"ray-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-", dir="/tmp")

# Threads per test process: the cores shared among pytest-xdist's workers, at most 2. Two workers of two threads each
# on 2 cores wait on each other's threads: tests/selection at -n 2 took 185 CPU-s and 102 s, with one thread each 145
# CPU-s and 79 s. The processes a test starts (sweeps, benchmarks, Ray's workers) inherit OMP_NUM_THREADS unless the
# caller set it.
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# what `pipelines.plugins.activate` sets in the process running a sweep or an evaluation (`sweep.main`,
# `evaluate.main`, called in-process by many tests): kept from leaking into later tests, where the resume's check of
# result-changing variables (`pipelines.environment`) took another test's task folder for the current environment
_ACTIVATED = ("PROMPRUNE_PLUGINS", "PROMPRUNE_INCLUDE_PATH")


@pytest.fixture(autouse=True)
def _activated_environment_restored():
    kept = {name: os.environ.get(name) for name in _ACTIVATED}
    yield
    for name, value in kept.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


STANDIN_DOCS = 6  # documents per hub-task stand-in: even (MME pairs), a few batches, quick on a 2-core CPU


@pytest.fixture(scope="session")
def hub_standins(tmp_path_factory):
    """An HF_HOME holding stand-ins of the paper's nine hub datasets (built once per session). It changes no
    environment by itself: use ``with promprune.eval.standins.serving(hub_standins):`` where the tasks should load."""
    from promprune.eval.standins import build_standins

    return build_standins(tmp_path_factory.mktemp("hf_home"), docs_per_task=STANDIN_DOCS, seed=0)


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An empty MLflow SQLite store whose tables exist, made once per session: MLflow builds a new store through its
    ~70 schema migrations (seconds on 2 cores), which every test on a store of its own would pay again. `mlflow_db`
    copies it; the sweep's own path to a new store is what `tests/test_readme.py`'s quickstart and the CLI tests
    take."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path.parent)  # the Default experiment's artifact folder is under the template's, not the repo's
        MlflowClient(f"sqlite:///{path}").search_experiments(max_results=1)
    return path


@pytest.fixture
def mlflow_db(tmp_path, mlflow_template, monkeypatch) -> str:
    """``tmp_path/mlflow.db``, a copy of `mlflow_template`, as ``MLFLOW_TRACKING_URI``; returns the URI."""
    import shutil

    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def read_only():
    """``read_only(path)``: make the folder or file ``path`` refuse writes for real, as this user: its mode bits
    (0o500 / 0o400) for a user they bind, the immutable flag (`chattr +i`) for root, whom mode bits do not stop; undone
    at the end of the test. Skips where neither works (root on a file system without the flag)."""
    import subprocess

    undo = []

    def lock(path):
        path = Path(path)
        if os.geteuid() != 0:
            mode = path.stat().st_mode & 0o777
            path.chmod(0o500 if path.is_dir() else 0o400)
            undo.append(lambda: path.chmod(mode))
        elif subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
            undo.append(lambda: subprocess.run(["chattr", "-i", str(path)], check=True))
        else:
            pytest.skip("root, on a file system without chattr's immutable flag: nothing here refuses root's writes")
        return path

    yield lock
    for step in reversed(undo):
        step()
