"""Deployment files: cluster.yaml against Ray's own schema, the nightly cron line and KubeRay manifest point at a
valid spec and a command sweep.py accepts, and `ray job submit` against a loopback head lands runs in MLflow."""
from __future__ import annotations

import copy
import os
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
    # cron runs /bin/sh with PATH=/usr/bin:/bin; a user-level pip install puts `ray` in ~/.local/bin
    assert command.startswith('export PATH="$HOME/.local/bin:') and command.index("export PATH") < command.index("ray ")
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
