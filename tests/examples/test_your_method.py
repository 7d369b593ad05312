"""examples/your_method, as a researcher uses it: copied outside the repository, its method passes its one-line
`check_method` test, and from that directory `pipelines/sweep.py --config my_spec.yaml` runs the outside method and
the outside benchmark through Ray's actors into MLflow and the console summary; a misspelled option of the outside
method is refused before Ray starts."""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import promprune
from pipelines import mlflow_layout
from pipelines import spec as specs
from promprune.testing import check_method

from ..pipelines.test_plugins import isolated  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "your_method"
# a few samples of one testbed task and of the example's own, one budget, the outside method and PromPrune: three
# trials (with the baseline) in well under a minute on 2 cores (DivPrune and VisPruner run like PromPrune)
QUICK = ["--set", "limit=2", "--set", "grid.budget=[16]", "--set", "grid.method=[largest_norm, promprune]",
         "--set", "tasks=[testbed_exist_concentrated, my_exist_medium]"]


def test_the_example_spec_validates_and_its_method_passes_check_method(isolated):  # noqa: F811
    spec = specs.load(EXAMPLE / "my_spec.yaml")
    assert spec.plugins == [str(EXAMPLE / "largest_norm.py")] and spec.include_path == [str(EXAMPLE / "my_tasks")]
    assert "largest_norm" in promprune.methods()
    assert {"largest_norm-b32", "promprune-b16-mu=0.242-tau=0.03", "divprune-b8", "vispruner-b16"} <= {
        t.trial_id for t in specs.expand(spec)}
    check_method("largest_norm")
    check_method("largest_norm", options={"p": 1.0})


def _run(args: list[str], cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.long  # the long tier (pyproject's markers): plugins shipped to Ray's workers run
# in CI (tests/pipelines/test_plugins_ray.py)
@pytest.mark.slow
def test_a_sweep_of_an_outside_method_and_benchmark_from_outside_the_repository(tmp_path):
    work = tmp_path / "your_method"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("outputs", "reports", "mlflow.db", "__pycache__"))
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "RAY_TMPDIR": ray_dir,
           "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_EXPERIMENT_NAME", None)
    sweep = [sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", "my_spec.yaml"]
    try:
        own = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_largest_norm.py"], work, env,
                   timeout=120)
        assert own.returncode == 0 and "1 passed" in own.stdout, own.stdout + own.stderr

        proc = _run(sweep + QUICK, work, env, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        after = out[out.index("| trial |"):].splitlines()
        summary = list(itertools.takewhile(lambda line: line.startswith("|"), after))  # the markdown summary table
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in summary]
        rows = {row[0]: dict(zip(cells[0], row)) for row in cells[2:]}
        row = rows["largest_norm-b16"]
        assert row["method"] == "largest_norm" and row["visual tokens"] == "16.0" and row["failed"] == "0", summary
        assert set(rows) == {"baseline", "largest_norm-b16", "promprune-b16-mu=0.242-tau=0.03"}

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        experiment = client.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT)
        runs = {r.data.tags.get(mlflow_layout.TRIAL): r for r in client.search_runs([experiment.experiment_id])}
        trial = runs["largest_norm-b16"]
        assert trial.info.status == "FINISHED"
        assert trial.data.params["method"] == "largest_norm" and trial.data.params["budget"] == "16"
        assert trial.data.metrics["efficiency/visual_tokens"] == 16.0
        assert "my_exist_medium/accuracy" in trial.data.metrics  # the benchmark from outside, scored
        assert "testbed_exist_concentrated/f1" in trial.data.metrics and "rel" in trial.data.metrics

        typo = _run(sweep + QUICK + ["--set", "trials=[{method: largest_norm, budget: 16, pp: 1.0}]"], work, env,
                    timeout=120)
        assert typo.returncode == 2, typo.stdout + typo.stderr
        assert "largest_norm takes no option 'pp' (did you mean 'p'?)" in typo.stderr
        assert "Traceback" not in typo.stderr and "Ray" not in typo.stdout + typo.stderr  # refused before Ray starts
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
