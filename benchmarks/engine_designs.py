"""What an evaluation engine costs besides the model's own work: the designs issue 36 names, measured side by side.

    python benchmarks/engine_designs.py                     # the in-process designs on a local Ray (CPU)
    python benchmarks/engine_designs.py --cli-repo ../old   # also the sweep CLI of another checkout (the old engine)
    python benchmarks/engine_designs.py --trials 2          # a check of the script (about a minute on 2 cores)

In-process, on the same request blocks (`testbed:llava`, 16 samples of one testbed task per trial: a few seconds of
model work, so the fixed costs show), `--trials` trials one after the other:

- **data**: the engine as shipped (`pipelines/run/engine.py`): per trial one Ray Data execution, `map_batches` over
  an actor pool that loads the model (from the object store) and answers sealed blocks.
- **serve**: model replicas kept across trials by Ray Serve (a deployment of one replica holding the model, the
  idiomatic Ray way to keep replicas alive), each trial a Ray Data execution whose map tasks (tasks, not actors: no
  process to start) call the deployment.
  Needs `ray[serve]`'s extra packages (the `bench` extra installs them); its row says so without them.

Printed: the one-time cost (Ray Data / Serve start, the first model load) and the cost per trial beyond the model's
work (wall time minus the summed actor-side generate time), medians over the trials after the first.

`--cli-repo PATH`: the sweep command line (`python pipelines/sweep.py`) of the checkout at PATH and of this one, on
specs of 1 and of `--trials` trials (the unpruned model and `divprune` at several budgets, 8 samples each): wall
time per sweep and the slope per trial. That compares the whole pipeline, Tune and MLflow included, across engines.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import pythonpath  # noqa: E402

TASK = "testbed_exist_concentrated"
MODEL = "testbed:llava"


def timed_run(vlm, rows, batch_size, *, log: str):
    """The real `run_requests`, its generate time appended to ``log`` (one line per block)."""
    from promprune.eval import run_requests

    t0 = time.perf_counter()
    preds = run_requests(vlm, rows, batch_size=batch_size)
    with open(log, "a") as f:
        f.write(f"{time.perf_counter() - t0}\n")
    return preds


def _work(log: str) -> float:
    path = Path(log)
    total = sum(float(x) for x in path.read_text().split()) if path.exists() else 0.0
    path.unlink(missing_ok=True)
    return total


def data_design(rows, budgets: list[int], log: str) -> tuple[float, list[float]]:
    """(one-time seconds, per-trial overhead seconds) of the shipped engine."""
    import functools

    from pipelines.config import Resources
    from pipelines.run import engine
    from pipelines.run import resources as planning
    from pipelines.weights import ModelSource, share

    t0 = time.perf_counter()
    source = share(ModelSource(MODEL), on_gpu=False)
    setup = time.perf_counter() - t0
    plan = planning.plan(Resources(), len(budgets), len(rows.blocks))
    overheads = []
    for budget in budgets:
        job = engine.Job(source, "divprune", budget, {}, 16, functools.partial(timed_run, log=log))
        t0 = time.perf_counter()
        engine.run(rows, job, plan, engine.Failover())
        overheads.append(time.perf_counter() - t0 - _work(log))
    return setup, overheads


class _Served:
    """The Serve replica: the model loaded once, wrapped per (method, budget) like the old shared pool did."""

    def __init__(self, source, log: str):
        self.base = source.load(method=None, budget=None)
        self.log = log

    def predict(self, method: str, budget: int, envelope):
        from promprune.eval.requests import share_images
        from promprune.models import PrunedVLM
        from promprune.records import Prediction, Request, from_arrow, to_arrow

        from pipelines.run.requests import unseal

        vlm = PrunedVLM(self.base.model, self.base.processor, method=method, budget=budget)
        out = []
        for _, block in unseal(envelope):
            out += timed_run(vlm, share_images(from_arrow(block, Request)), 16, log=self.log)
        return to_arrow(out, Prediction)


def _call(envelope, *, handle, budget: int):
    """A trial's map task: its block answered by the Serve deployment."""
    return handle.predict.remote("divprune", budget, envelope).result()


def serve_design(rows, budgets: list[int], log: str) -> tuple[float, list[float]] | None:
    try:
        from ray import serve
    except ImportError:
        return None
    from pipelines.weights import ModelSource, share

    t0 = time.perf_counter()
    source = share(ModelSource(MODEL), on_gpu=False)
    serve.start(http_options={"location": "NoServer"})
    handle = serve.run(serve.deployment(_Served, ray_actor_options={"num_cpus": 1}).bind(source, log),
                       name="promprune-bench")
    setup = time.perf_counter() - t0
    overheads = []
    for budget in budgets:
        t0 = time.perf_counter()
        ds = rows.dataset().map_batches(_call, fn_kwargs={"handle": handle, "budget": budget}, batch_size=1,
                                        batch_format="pyarrow", num_cpus=0.1)  # tasks: no process to start
        n = sum(b.num_rows for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"))
        assert n == len(rows.keys)
        overheads.append(time.perf_counter() - t0 - _work(log))
    serve.shutdown()
    return setup, overheads


def cli_sweep(repo: Path, n_trials: int, workdir: Path) -> float:
    """Wall seconds of `python pipelines/sweep.py` in ``repo`` on a spec of ``n_trials`` trials."""
    import yaml

    budgets = [64, 48, 32, 16, 8, 4][:max(0, n_trials - 1)]
    spec = {"name": f"cost{n_trials}", "version": 1, "model": {"pretrained": MODEL}, "tasks": [TASK], "limit": 8,
            "baseline": True, "generation": {"max_new_tokens": 4}}
    if budgets:
        spec["grid"] = {"method": ["divprune"], "budget": budgets}
    else:
        spec["trials"] = []
    path = workdir / f"cost{n_trials}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": pythonpath(repo), "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="ec-", dir="/tmp")}
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, str(repo / "pipelines" / "sweep.py"), "--config", str(path)], cwd=workdir,
                         env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise RuntimeError(f"{repo}: sweep failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="trials per design, at least 2 (the first is reported apart)")
    ap.add_argument("--cli-repo", type=Path, default=None, help="another checkout whose sweep CLI to time as well")
    ap.add_argument("--designs", nargs="+", default=["data", "serve"])
    args = ap.parse_args(argv)
    if args.trials < 2:
        ap.error("--trials must be at least 2: the per-trial overhead is the median over the trials after the first")
    from pipelines.run.ray_connect import worker_env
    from pipelines.run.requests import build_requests_dataset

    ray_tmp = tempfile.mkdtemp(prefix="promprune-ray-")  # Ray's files apart from any other Ray on the machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=worker_env(), log_to_driver=False,
             _temp_dir=ray_tmp)
    rows = build_requests_dataset([TASK], 16, {"max_new_tokens": 4}, 16)
    budgets = [64, 48, 32, 16, 8, 4, 2][:args.trials]
    log = tempfile.mktemp(prefix="engine-work-")
    print(f"{args.trials} trials of {len(rows.keys)} samples ({len(rows.blocks)} blocks) of {TASK} on {MODEL}, "
          "local Ray on this machine's CPU\n")
    print("| design | one-time s | per-trial overhead s (median, after the first) | first trial s |")
    print("|---|---:|---:|---:|")
    for design in args.designs:
        fn = {"data": data_design, "serve": serve_design}[design]
        got = fn(rows, budgets, log)
        if got is None:
            print(f"| {design} | (ray[serve] not installed) | | |")
            continue
        setup, overheads = got
        print(f"| {design} | {setup:.1f} | {statistics.median(overheads[1:]):.2f} | {overheads[0]:.1f} |", flush=True)
    ray.shutdown()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    if args.cli_repo is not None:
        print("\n| checkout | 1 trial s | %d trials s | per trial s |" % args.trials)
        print("|---|---:|---:|---:|")
        with tempfile.TemporaryDirectory(prefix="engine-cli-") as tmp:
            for repo in (args.cli_repo.resolve(), REPO):
                one, many = cli_sweep(repo, 1, Path(tmp)), cli_sweep(repo, args.trials, Path(tmp))
                print(f"| {repo} | {one:.1f} | {many:.1f} | {(many - one) / (args.trials - 1):.1f} |", flush=True)


if __name__ == "__main__":
    main()
