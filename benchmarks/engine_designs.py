"""What an evaluation engine costs besides the model's own work: model workers kept across trials as named actors
(shipped), by Ray Serve, or an actor pool per trial (the engine before), measured side by side; and the whole sweep
command's per-trial fixed cost.

    python benchmarks/engine_designs.py                     # the in-process designs on a local Ray (CPU)
    python benchmarks/engine_designs.py --trials 2          # a check of the script (~100 s on 2 cores; with
                                                            # --designs pool, the shipped design alone, about half)
    python benchmarks/engine_designs.py --designs --cli 20  # the sweep command: 1 trial, then 20 trials x 8 samples
    python benchmarks/engine_designs.py --designs --cli 20 --cli-repo ../main   # the same for another checkout

In-process, on the same request blocks (`testbed:llava`, 16 samples of one testbed task per trial: a few seconds of
model work, so the fixed costs show), `--trials` trials one after the other:

- **pool** (shipped, `pipelines/run/workers.py` and `engine.py`): the sweep's pool of named-actor workers, started
  once, each holding the model (from the object store); each trial leases them and sends its blocks.
- **serve**: model replicas kept across trials by Ray Serve (a deployment of one replica holding the model, the
  idiomatic Ray way to keep replicas alive), each trial a Ray Data execution whose map tasks (tasks, not actors: no
  process to start) call the deployment. Needs `ray[serve]`'s extra packages (the `bench` extra installs them); its
  row says so without them.
- **data**: the engine before this one: per trial one Ray Data execution, `map_batches` over an actor pool of its
  own that loads the model (from the object store) and answers sealed blocks (the same `Worker` code, in-process).

Printed: the one-time cost (the pool or Serve started, the first model load) and the cost per trial beyond the
model's work (wall time minus the summed generate time), medians over the trials after the first.

`--cli N`: `python pipelines/sweep.py` of this checkout (and of `--cli-repo`) on specs of 1 and of N trials (the
unpruned model and `divprune` at budgets 1..N-1, `--samples` each, no calibration, no bootstrap), each in a fresh
directory with its own MLflow store and Ray: the wall time of each; the slope, (wall(N) - wall(1)) / (N - 1), what
one more trial adds; and the per-trial fixed cost, the slope minus the model's work per trial spread over the workers
(the workers' summed generate time over the sweep / N / the workers), read from the sweep's timeline
(`PROMPRUNE_TIMELINE`).
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
import uuid
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import Flags, pythonpath  # noqa: E402

TASK = "testbed_exist_concentrated"
BUDGETS = (64, 48, 32, 16, 8, 4, 2)  # the in-process trials' budgets, one a trial
DESIGNS = ("pool", "serve", "data")
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


def _trial(budget: int):
    from pipelines.spec import Trial

    return Trial("divprune", budget)


def pool_design(rows, budgets: list[int], log: str) -> tuple[float, list[float]]:
    """(one-time seconds, per-trial overhead seconds) of the shipped engine: one pool for every trial."""
    import functools

    from pipelines.config import Resources
    from pipelines.run import engine
    from pipelines.run import resources as planning
    from pipelines.run.workers import Failover, WorkerPool
    from pipelines.weights import ModelSource, share

    t0 = time.perf_counter()
    plan = planning.plan(Resources(), len(budgets), len(rows.blocks))
    pool = WorkerPool(share(ModelSource(MODEL), on_gpu=False), plan, 16, Failover(),
                      functools.partial(timed_run, log=log))
    pool.warm(plan.pool_size)
    pool.first_worker()
    setup = time.perf_counter() - t0
    overheads = []
    for budget in budgets:
        t0 = time.perf_counter()
        engine.run(rows, _trial(budget), pool.handle, plan.max_actors)
        overheads.append(time.perf_counter() - t0 - _work(log))
    pool.close()
    return setup, overheads


class _PerTrialPool:
    """The engine before: a Ray Data actor holding the model, for one evaluation (the shipped worker's code)."""

    def __init__(self, source, log: str, budget: int):
        from pipelines.run.workers import Failover, Worker

        self.worker = Worker(source, 16, Failover(), run_fn=lambda *a: timed_run(*a, log=log))
        self.trial, self.evaluation = _trial(budget), uuid.uuid4().hex

    def __call__(self, envelope):
        return self.worker.answer(self.trial, envelope, self.evaluation)


def data_design(rows, budgets: list[int], log: str) -> tuple[float, list[float]]:
    """(one-time seconds, per-trial overhead seconds) of an actor pool per trial (Ray Data per evaluation)."""
    from ray.data import ActorPoolStrategy, DataContext

    from pipelines.config import Resources
    from pipelines.run import resources as planning
    from pipelines.weights import ModelSource, share

    DataContext.get_current().enable_progress_bars = False
    t0 = time.perf_counter()
    source = share(ModelSource(MODEL), on_gpu=False)
    plan = planning.plan(Resources(), 1, len(rows.blocks))
    setup = time.perf_counter() - t0
    overheads = []
    for budget in budgets:
        t0 = time.perf_counter()
        blocks = ray.data.from_arrow_refs(rows.blocks)  # one sealed block per row
        ds = blocks.map_batches(_PerTrialPool, fn_constructor_kwargs={"source": source, "log": log, "budget": budget},
                                batch_size=1, batch_format="pyarrow", num_cpus=plan.cpus,
                                compute=ActorPoolStrategy(size=plan.max_actors))
        n = sum(b.num_rows for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"))
        assert n == len(rows.keys)
        overheads.append(time.perf_counter() - t0 - _work(log))
    return setup, overheads


class _Served:
    """The Serve replica: the model loaded once, wrapped per trial (the shipped worker's code)."""

    def __init__(self, source, log: str):
        from pipelines.run.workers import Failover, Worker

        self.worker = Worker(source, 16, Failover(), run_fn=lambda *a: timed_run(*a, log=log))

    def predict(self, budget: int, envelope):
        return self.worker.answer(_trial(budget), envelope, "serve")


def _call(envelope, *, handle, budget: int):
    """A trial's map task: its block answered by the Serve deployment."""
    return handle.predict.remote(budget, envelope).result()


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
        blocks = ray.data.from_arrow_refs(rows.blocks)  # one sealed block per row
        ds = blocks.map_batches(_call, fn_kwargs={"handle": handle, "budget": budget}, batch_size=1,
                                batch_format="pyarrow", num_cpus=0.1)  # tasks: no process to start
        n = sum(b.num_rows for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"))
        assert n == len(rows.keys)
        overheads.append(time.perf_counter() - t0 - _work(log))
    serve.shutdown()
    return setup, overheads


def in_process(trials: int, designs: list[str]) -> None:
    from pipelines.run.ray_connect import patient_start, worker_env
    from pipelines.run.requests import build_requests_dataset

    ray_tmp = tempfile.mkdtemp(prefix="promprune-ray-")  # Ray's files apart from any other Ray on the machine
    with patient_start():  # a busy machine's slow node registration is waited for (Ray alone gives it 30 s)
        ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=worker_env(), log_to_driver=False,
                 _temp_dir=ray_tmp)
    rows = build_requests_dataset([TASK], 16, {"max_new_tokens": 4}, 16)
    budgets = list(BUDGETS[:trials])
    log = tempfile.mktemp(prefix="engine-work-")
    print(f"{trials} trials of {len(rows.keys)} samples ({len(rows.blocks)} blocks) of {TASK} on {MODEL}, "
          "local Ray on this machine's CPU\n")
    print("| design | one-time s | per-trial overhead s (median, after the first) | first trial s |")
    print("|---|---:|---:|---:|")
    for design in designs:
        fn = {"pool": pool_design, "data": data_design, "serve": serve_design}[design]
        got = fn(rows, budgets, log)
        if got is None:
            print(f"| {design} | (ray[serve] not installed) | | |")
            continue
        setup, overheads = got
        print(f"| {design} | {setup:.1f} | {statistics.median(overheads[1:]):.2f} | {overheads[0]:.1f} |", flush=True)
    ray.shutdown()
    shutil.rmtree(ray_tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# the sweep command


def cli_sweep(repo: Path, n_trials: int, workdir: Path, samples: int) -> tuple[float, dict[int, float]]:
    """(wall seconds, each worker's seconds inside blocks) of `python pipelines/sweep.py` in ``repo`` on a spec of
    ``n_trials`` trials of ``samples`` samples each, in a fresh folder under ``workdir``."""
    import yaml

    run = workdir / f"{repo.name}-{n_trials}-{uuid.uuid4().hex[:6]}"
    run.mkdir()
    spec = {"name": f"cost{n_trials}", "version": 1, "model": {"pretrained": MODEL}, "tasks": [TASK],
            "limit": samples, "baseline": True, "generation": {"max_new_tokens": 4}}
    if n_trials > 1:
        spec["grid"] = {"method": ["divprune"], "budget": list(range(1, n_trials))}
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": pythonpath(repo), "MLFLOW_TRACKING_URI": f"sqlite:///{run / 'mlflow.db'}",
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="ec-", dir="/tmp"), "PROMPRUNE_TIMELINE": str(run / "timeline")}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(repo / "pipelines" / "sweep.py"), "--config", "spec.yaml"], cwd=run,
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{repo}: sweep failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wall, _busy(run / "timeline")


def _busy(folder: Path) -> dict[int, float]:
    """Each worker's (by pid) time inside blocks (predict_start -> predict_end), from a sweep's timeline."""
    from pipelines import timeline

    return timeline.actor_busy(timeline.read(folder)) if folder.exists() else {}


def cli(repos: list[Path], trials: int, samples: int) -> None:
    print(f"\nthe sweep command, specs of 1 and {trials} trials x {samples} samples ({TASK}, {MODEL}):\n")
    print(f"| checkout | 1 trial s | {trials} trials s | slope per trial s | model work per trial s "
          "| fixed cost per trial s |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="engine-cli-") as tmp:
        for repo in repos:
            one, _ = cli_sweep(repo, 1, Path(tmp), samples)
            many, busy = cli_sweep(repo, trials, Path(tmp), samples)
            # the work's share of the wall: each trial's generate time, its blocks spread over the workers
            slope, work = (many - one) / (trials - 1), sum(busy.values()) / trials
            fixed = slope - work / max(1, len(busy))
            print(f"| {repo} | {one:.1f} | {many:.1f} | {slope:.2f} | {work:.2f} | {fixed:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="trials per design, at least 2 (the first is reported apart)")
    ap.add_argument("--designs", nargs="*", default=["pool", "serve", "data"],
                    help="in-process designs to measure (none: only --cli)")
    ap.add_argument("--cli", type=int, default=0, metavar="N", help="also time the sweep command on 1 and N trials")
    ap.add_argument("--samples", type=int, default=8, help="samples per trial of --cli's specs")
    ap.add_argument("--cli-repo", type=Path, default=None, help="another checkout whose sweep command to time as well")
    args = ap.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--trials", args.trials, 2, "the per-trial cost is measured beyond the first trial", 5)
    if args.trials > len(BUDGETS):
        flags.add(f"--trials {args.trials}", f"at most {len(BUDGETS)} (one budget a trial: "
                  f"{', '.join(map(str, BUDGETS))}), e.g. --trials 5")
    flags.choice("--designs", args.designs, DESIGNS, "design")
    if args.cli:
        flags.at_least("--cli", args.cli, 2, "the slope is measured from 1 trial to N; 0: no sweep command", 20)
        flags.at_least("--samples", args.samples, 1, "samples per trial", 8)
        flags.existing("--cli-repo", args.cli_repo, "directory", inside="pipelines/sweep.py")
    elif args.cli_repo is not None:
        flags.add(f"--cli-repo {args.cli_repo}", "needs --cli N (the sweep command is timed only with it), e.g. "
                  "--cli 20")
    flags.refuse()
    if args.designs:
        in_process(args.trials, args.designs)
    if args.cli:
        repos = [REPO] + ([args.cli_repo.resolve()] if args.cli_repo else [])
        cli(repos, args.cli, args.samples)


if __name__ == "__main__":
    main()
