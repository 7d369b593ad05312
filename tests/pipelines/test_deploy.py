"""Deployment files: cluster.yaml against Ray's own schema, the nightly cron line and KubeRay manifest point at a
valid spec and a command sweep.py accepts, and `ray job submit` against a loopback head lands runs in MLflow."""
from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pipelines import spec as specs
from pipelines import sweep
from pipelines.run.state import STORAGE_ENV

REPO = Path(__file__).resolve().parents[2]


def _cluster() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_passes_rays_validator():
    config = _cluster()
    validate_config(prepare_config(copy.deepcopy(config)))  # Ray's schema (ray-schema.json) plus its own checks
    nodes = config["available_node_types"]
    head, gpu = nodes[config["head_node_type"]], nodes["gpu_worker"]
    assert head["resources"].get("GPU") == 0  # the head drives and serves MLflow; no model runs there
    assert gpu["min_workers"] >= 1 and gpu["max_workers"] >= gpu["min_workers"]
    setup = " ".join(config["setup_commands"])
    assert "[pipeline]" in setup  # the pipeline extra brings ray[default] (the job server)
    assert '-c "$HOME/promprune/constraints.txt"' in setup  # the pinned set: nights differ by code, not by releases
    assert any("mlflow server" in cmd for cmd in config["head_start_ray_commands"])



def test_the_heads_mlflow_line_starts_the_server_from_rays_runner():
    """Ray's command runner (2.60) runs each start command as ``bash --login -c -i 'source ~/.bashrc; export ... &&
    (<command>)'``: that shell's own command line holds the command's text, so a guard `pgrep -f "mlflow server"`
    always found the shell itself and never started the server (a probe ran the line so: no process, no log). The
    guard's pattern (pgrep -f: an extended regex over each process's whole command line) must miss that shell and
    find a running server (its python running the venv's mlflow script); and the server alone goes to the background
    (``A || B > log &`` put the whole list there, holding the runner's output open)."""
    line = next(cmd for cmd in _cluster()["head_start_ray_commands"] if "mlflow server" in cmd)
    pattern = re.search(r'pgrep -f "([^"]+)"', line).group(1)
    runner = f"bash --login -c -i source ~/.bashrc; export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore && ({line})"
    server = ("/home/ubuntu/venv/bin/python3.11 /home/ubuntu/venv/bin/mlflow server --host 127.0.0.1 --port 5000 "
              "--backend-store-uri sqlite:////home/ubuntu/mlflow/mlflow.db")
    assert not re.search(pattern, runner), "the guard finds the runner's own shell: the server never starts"
    assert re.search(pattern, server), "the guard misses a running server: a second start would start another"
    assert re.search(r"\|\| \(nohup [^()]*&\)$", line), "only the server goes to the background"

# python3 of each Ubuntu release (packages.ubuntu.com, package python3): an image's system Python
UBUNTU_PYTHON3 = {"20.04": "3.8", "22.04": "3.10", "24.04": "3.12"}
VENV = re.compile(r'uv"? venv (?:--seed )?--python (\d+\.\d+) "?([^"\s]+)"?')


def _install_python(config: dict, text: str) -> tuple[str, str]:
    """(the X.Y of the Python that cluster.yaml's setup_commands install the project with, how that is known): a
    virtualenv's, from the `uv venv --python X.Y` that makes it; the image's python3, from the Ubuntu release its
    ImageId comment names (every image of the config must name one, and the same one)."""
    install = next(cmd for cmd in config["setup_commands"] if "[pipeline]" in cmd)
    interpreter = shlex.split(install)[0]
    for cmd in config["setup_commands"]:
        made = VENV.search(cmd)
        if made and interpreter.startswith(made.group(2).rstrip("/") + "/bin/"):
            return made.group(1), f"the virtualenv {made.group(2)}"
    assert interpreter in ("python3", "python"), f"{interpreter}: neither the image's python3 nor a uv virtualenv"
    images = {n["node_config"]["ImageId"] for n in config["available_node_types"].values()}
    releases = {release for image in images for release in re.findall(
        rf"ImageId: {image}\s+#[^\n]*Ubuntu (\d\d\.\d\d)", text)}
    assert len(releases) == 1, f"the images {images} name no one Ubuntu release in their comments: {releases}"
    (release,) = releases
    return UBUNTU_PYTHON3[release], f"the image's python3 (Ubuntu {release})"


def test_cluster_yaml_installs_with_a_python_the_project_and_its_pins_take():
    """A probe's case: cluster.yaml booted the Ubuntu 22.04 Deep Learning AMI, whose python3 is 3.10, and pip-installed
    the project into it: pyproject requires Python >= 3.11 and constraints.txt (resolved on 3.11) pins numpy 2.4.6,
    which needs 3.11, so `ray up` never started Ray. The Python the setup commands install with must satisfy
    requires-python and be the one the pins were resolved on; Ray and MLflow start from it, and the nightly cron
    finds its `ray`."""
    import tomllib

    from packaging.specifiers import SpecifierSet

    text = (REPO / "cluster.yaml").read_text()
    config = yaml.safe_load(text)
    version, what = _install_python(config, text)
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert version in SpecifierSet(requires), f"{what} is Python {version}; pyproject requires {requires}"
    resolved = re.search(r"resolved on \S+ \(Python (\d+\.\d+)\.\d+", (REPO / "constraints.txt").read_text())
    assert resolved and resolved.group(1) == version, \
        f"{what} is Python {version}; constraints.txt was resolved on {resolved and resolved.group(1)}"
    venv = VENV.search(" ".join(config["setup_commands"])).group(2)
    for cmd in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        unquoted = re.sub(r'"[^"]*"', '""', cmd)  # not pgrep's pattern
        for tool in ("ray", "mlflow"):
            for word in re.findall(rf"(?:^|\s)([^\s\"]*\b{tool}) (?:start|stop|server)", unquoted):
                assert word == f"{venv}/bin/{tool}", (word, cmd)
    cron = (REPO / "deploy" / "nightly.cron").read_text()
    assert f'export PATH="{venv}/bin:' in cron


@pytest.mark.parametrize("mutate", [
    lambda c: c.update(max_worker=3),  # a typo
    lambda c: c["available_node_types"]["gpu_worker"].update(min_worker=1),
    lambda c: c.update(max_workers="many"),
])
def test_rays_validator_rejects_broken_variants(mutate):
    """The check above can fail: a mistyped field is caught by the same validator."""
    config = _cluster()
    mutate(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate_config(prepare_config(config))


def _sweep_args(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index("pipelines/sweep.py") + 1:]


def test_nightly_cron_line():
    lines = [ln for ln in (REPO / "deploy" / "nightly.cron").read_text().splitlines()
             if ln and not ln.startswith("#") and "=" not in ln.split()[0]]
    assert len(lines) == 1
    fields = lines[0].split(maxsplit=5)
    assert len(fields) == 6 and all(f.replace("*", "").replace(",", "").isdigit() or f == "*" for f in fields[:5])
    command = fields[5]
    # cron runs /bin/sh with PATH=/usr/bin:/bin; cluster.yaml puts `ray` in ~/venv/bin, a user-level pip install in
    # ~/.local/bin
    assert command.startswith('export PATH="$HOME/venv/bin:$HOME/.local/bin:')
    assert command.index("export PATH") < command.index("ray ")
    assert "ray job submit --no-wait --submission-id nightly-$(date +\\%F)" in command  # % escaped for cron
    args = sweep.parse_args(_sweep_args(command.split(">>")[0]))
    assert args.regression_threshold is not None and args.regression_threshold > 0
    spec = specs.load(REPO / args.config)
    assert spec.name == "nightly" and spec.baseline  # Rel. needs the unpruned run


def test_kuberay_manifest():
    docs = list(yaml.safe_load_all((REPO / "deploy" / "kuberay-nightly.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert {"CronJob", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"} <= set(kinds)
    rayjob = yaml.safe_load(kinds["ConfigMap"]["data"]["rayjob.yaml"])
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    args = sweep.parse_args(_sweep_args(rayjob["spec"]["entrypoint"]))
    assert specs.load(REPO / args.config).name == "nightly" and args.regression_threshold > 0
    workers = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and workers["minReplicas"] <= workers["maxReplicas"]
    env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
    assert "MLFLOW_TRACKING_URI" in env and STORAGE_ENV in env
    text = (REPO / "deploy" / "kuberay-nightly.yaml").read_text()
    assert "authOptions" not in rayjob["spec"]["rayClusterSpec"] or "operator >= 1.5.1" in text.splitlines()[0]
    assert "RUN pip install -c /home/ray/promprune/constraints.txt" in text
    cron = kinds["CronJob"]["spec"]
    assert len(cron["schedule"].split()) == 5 and cron["concurrencyPolicy"] == "Forbid"


@pytest.mark.slow
def test_ray_job_submit_against_a_loopback_head():
    """scripts/job_submit_smoke.sh: its own head on loopback, `ray job submit --working-dir .`, MLflow checked."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "job_submit_smoke.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "smoke OK" in proc.stdout
