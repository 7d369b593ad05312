"""Sweep scheduling efficiency on a simulated GPU cluster: the pipeline against a shell loop of lmms-eval runs.

    python benchmarks/sweep_scaling.py                    # 1, 4 and 8 GPUs; ~33 minutes on a 2-core machine
    python benchmarks/sweep_scaling.py --gpus 8 --sample-s 0.25

A Table-1-shaped sweep (6 methods x 3 budgets + the baseline = 19 trials) runs through the real pipeline
(`pipelines.sweep.run_sweep`: Ray Tune trials, the sweep's model workers, central lmms-eval scoring, MLflow) on a
multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, one node per GPU, each declaring one GPU). The
model is a stand-in whose costs are injected, the same way the fault tests inject them, with no CPU burnt while it
"computes": loading sleeps `--load-s`, each sample sleeps `--sample-s` (a 7B model on an A100 answers a short VQA
question in about 0.15 s and loads in about 30 s; a real trial runs tens of thousands of samples, so the load is a
rounding error there, and here it is scaled down with the work). Every sample still goes through the workers, the
exactly-once check, scoring and MLflow.

Printed per GPU count: wall time, ideal time (sum of sample costs / GPUs + one model load), efficiency =
ideal / wall, model loads, rows built; and the shell loop under the same costs, run for real (`--shell measured`,
the default): one `lmms-eval --model promprune` process per (method, budget), `gpus` of them at a time, each
importing lmms-eval, loading the tasks' data and the model again, answering with the same injected costs and
scoring (the budgets as the same share of the stand-in's visual tokens; `--shell arithmetic` only computes it,
charging `--startup-s` per process), with the answers each process's results file says it scored: a process that
logs an error, answers fewer samples or fails one stops the script (lmms-eval exits 0 after an error it logs, so its
output is read, not its exit status). Process starts, imports and
scheduling are real for both while the work is scaled down, and up to 8 simulated GPU nodes share this machine's
cores, so the measured efficiency is a lower bound of a real cluster's. Last line: `efficiency <value> at <max>
GPUs` (measured, on this machine).

Then Table 1 at full size, a *projection*: arithmetic on assumed A100 costs (`A100_SAMPLE_S`, `A100_LOAD_S`,
`SHELL_STARTUP_S`: nothing here measures them) and the per-trial overhead measured above; its efficiencies (about
1.00 for the pipeline at 8 GPUs) are what those constants imply, not a measurement. A measurement of the scaling
needs cores for the simulated nodes: `bash scripts/gpu_checklist.sh scaling` on the GPU machine's 16 cores.

`--timeline PATH` (.csv or .json) records every process's events (trial start/end, actor start/ready, first request,
last answer: `pipelines/timeline.py`) and prints where each run's time went; `--smoke` is a quick check of this
script (1 GPU, the baseline alone, 4 samples per task, a few ms per sample; the shell loop's one lmms-eval process
run and its answers counted, unless `--shell arithmetic`).

`--autoscale [MAX_NODES]` runs the sweep on Ray's fake autoscaler instead (GPU worker nodes from none up to MAX_NODES,
default 3; `pipelines/run/fake_cluster.py`) and ends with the line `autoscaled to N of M GPU nodes; predictions from K
nodes; every sample once`; `--autoscale --smoke` is its minutes-long check.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import Flags, pythonpath  # noqa: E402
from pipelines import timeline  # noqa: E402

METHODS = ["promprune", "fastv", "sparsevlm", "visionzip", "vispruner", "divprune"]
BUDGETS = [128, 64, 32]
TASKS = ["easyvqa_yesno", "easyvqa_open"]  # offline; the pipeline and the shell loop run the same


@dataclass
class Costs:
    load_s: float
    sample_s: float


def stand_in_source(costs: Costs, counter: str):
    """A ModelSource whose load sleeps `load_s` and counts itself (a file per load: actors live in processes)."""
    from pipelines.weights import ModelSource

    @dataclass
    class SlowSource(ModelSource):
        load_s: float = 0.0
        counter: str = ""

        def load(self, **kwargs):
            time.sleep(self.load_s)
            Path(self.counter, f"{os.getpid()}-{time.monotonic_ns()}").touch()
            return super().load(**kwargs)

    return SlowSource("tiny:llava", load_s=costs.load_s, counter=counter)


def stand_in_run(vlm, rows, batch_size, *, sample_s: float):
    """Answers after `sample_s` per sample, without computing (the stand-in model's generate)."""
    from promprune.records import Answer, Prediction

    time.sleep(sample_s * len(rows))
    return [Prediction.answering(r, Answer(prediction="yes", visual_tokens=8, saliency_count=4, entropy=0.4,
                                           kept=list(range(8)), vision_ms=1.0, select_ms=1.0, prefill_ms=1.0,
                                           decode_ms=1.0, peak_mem_mb=1.0)) for r in rows]


def table1_spec(samples_per_task: int, batch_size: int, methods: list[str] = METHODS, budgets: list[int] = BUDGETS):
    from pipelines import spec as specs

    return specs.parse({
        "name": "sweep_scaling", "version": 1, "model": {"pretrained": "tiny:llava"},
        "tasks": TASKS, "limit": samples_per_task, "baseline": True,
        **({"grid": {"method": methods, "budget": budgets}} if methods else {"trials": []}),  # none: the baseline
        "generation": {"max_new_tokens": 1},
        "resources": {"workers": "auto", "gpus_per_worker": 1, "batch_size": batch_size, "actor_wait_s": 900},
        "tune": {"max_failures": 0}})


def run_pipeline(gpus: int, costs: Costs, samples_per_task: int, batch_size: int, workdir: Path,
                 timeline_dir: Path | None = None, grid: tuple[list[str], list[int]] = (METHODS, BUDGETS)) -> dict:
    import functools

    from pipelines import sweep
    from pipelines.run import resources as planning
    from pipelines.run.ray_connect import patient_start, worker_env
    from pipelines.run.requests import build_requests_dataset

    env = worker_env()
    if timeline_dir is not None:  # before the nodes start, so that their processes inherit it too
        timeline_dir.mkdir(parents=True)
        os.environ[timeline.ENV] = str(timeline_dir)
        env["env_vars"][timeline.ENV] = str(timeline_dir)
    with patient_start():  # each node's registration, on a busy machine, is waited for
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": 2, "num_gpus": 0, "object_store_memory": 200 * 2**20})
        for _ in range(gpus):
            cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    counter = workdir / f"loads-{gpus}"
    counter.mkdir()
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    try:
        spec = table1_spec(samples_per_task, batch_size, *grid)
        spec.model = stand_in_source(costs, str(counter))
        spec.tune.storage_path = str(workdir / f"tune-{gpus}")
        rows = build_requests_dataset(spec.tasks, spec.limit, spec.generation, batch_size)
        start = time.perf_counter()
        outcome = sweep.run_sweep(spec, rows=rows,
                                  run_fn=functools.partial(stand_in_run, sample_s=costs.sample_s))
        wall = time.perf_counter() - start
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop(timeline.ENV, None)
    n_trials = len(outcome.records)
    n_rows = len(rows.keys)
    work = n_trials * n_rows * costs.sample_s
    ideal = work / gpus + costs.load_s
    plan = planning.plan(spec.resources, n_trials, len(rows.blocks), cluster={"GPU": gpus})
    return {"wall": wall, "ideal": ideal, "loads": len(list(counter.iterdir())), "rows": n_rows,
            "trials": n_trials, "failed": len(outcome.failed), "workers": min(plan.max_actors, gpus),
            "at_once": plan.trials_at_once}


def shell_loop(gpus: int, trials: int, samples: int, costs: Costs, startup_s: float) -> dict:
    """The shell loop in arithmetic: one lmms-eval process per trial, `gpus` at a time (all trials equal here): each
    pays `startup_s` for the process and its data, the model load, then its samples. (`--shell measured` runs the
    processes instead.)"""
    per_trial = startup_s + costs.load_s + samples * costs.sample_s
    waves = math.ceil(trials / gpus)
    ideal = trials * samples * costs.sample_s / gpus + costs.load_s
    return {"wall": waves * per_trial, "ideal": ideal, "loads": trials, "rows": trials * samples}


def shell_trial(method: str, budget: str, tasks: str, limit: int, batch_size: int, load_s: float, sample_s: float,
                include_path: str, output_path: str) -> None:
    """One trial of the shell loop, as a user would run it: the `lmms-eval` command line with this package's plugin
    (`--model promprune`; the baseline `method=none`), which imports lmms-eval, indexes and loads the tasks' data,
    loads the model, answers and scores. The stand-in costs are injected as in the pipeline: the model load sleeps
    `load_s` before loading the tiny model, and the loaded model's own `generate` is replaced by one that sleeps
    `sample_s` per sample and answers "yes" without computing. Everything around it is the plugin's own (its
    `generate_items` with whatever options it passes, each document read and decoded as its batch forms), so the
    stand-in cannot fall out of step with the plugin's calls. Exits nonzero where lmms-eval's command line does;
    lmms-eval also exits 0 after an error it logs, which :func:`run_shell_trial` catches from its output."""
    from lmms_eval.cli.dispatch import main as lmms_eval_main
    from lmms_eval.models import get_model  # noqa: F401 - lmms-eval finds the plugin first; then it is patched

    from promprune.models import PrunedVLM
    from promprune.models.vlm import Generation

    load = PrunedVLM.from_pretrained.__func__

    def answer(images, prompts, **_):  # PrunedVLM.generate's (and generate_video's) two positional arguments
        time.sleep(sample_s * len(prompts))
        return [Generation(text="yes", visual_tokens=8, saliency_count=4, entropy=0.4, kept=list(range(8)),
                           vision_ms=1.0, select_ms=1.0, prefill_ms=1.0, decode_ms=1.0) for _ in prompts]

    def slow_load(cls, *args, **kwargs):
        time.sleep(load_s)
        vlm = load(cls, *args, **kwargs)
        vlm.generate = vlm.generate_video = answer  # this instance only: the stand-in model's answers
        return vlm

    PrunedVLM.from_pretrained = classmethod(slow_load)
    model_args = f"pretrained=tiny:llava,method={method}" + ("" if method == "none" else f",budget={budget}")
    sys.argv = ["lmms-eval", "--model", "promprune", "--model_args", model_args, "--tasks", tasks,
                "--include_path", include_path, "--limit", str(limit), "--batch_size", str(batch_size),
                "--output_path", output_path]
    code = lmms_eval_main()
    if code:
        raise SystemExit(code)


def shell_budget(method: str, budget: int) -> int:
    """Table 1's ``budget`` of LLaVA-1.5's 576 visual tokens, as the same share of the tokens the stand-in model
    (tiny:llava) gives an image, at least 1: the plugin refuses a budget that keeps them all (128 of its 36 would
    run unpruned), and the stand-in's costs do not depend on it."""
    from promprune.models.adapters import model_capacity
    from promprune.models.options import is_in_llm

    capacity = model_capacity("tiny:llava", {}, in_llm=is_in_llm(method))
    return max(1, budget * capacity // LLAVA_TOKENS)


def run_shell_trial(method: str, budget: str, samples_per_task: int, batch_size: int, costs: Costs, include: str,
                    out: Path) -> int:
    """One shell-loop trial (:func:`shell_trial`) in a process of its own, as the loop runs it; the samples its
    results file says it answered and scored. A process that exits nonzero, or whose output shows that it did not
    answer and score every sample of every task (lmms-eval exits 0 after an error it logs:
    `benchmarks.lmms_eval_problem`), is a RuntimeError naming the trial, the problem and the log's tail."""
    import subprocess

    from benchmarks import lmms_eval_answered, lmms_eval_problem, lmms_eval_results

    root = Path(__file__).resolve().parent.parent
    code = (f"from benchmarks.sweep_scaling import shell_trial; shell_trial({method!r}, {budget!r}, "
            f"{','.join(TASKS)!r}, {samples_per_task}, {batch_size}, {costs.load_s}, {costs.sample_s}, "
            f"{include!r}, {str(out)!r})")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": pythonpath(root)})
    log = run.stdout + run.stderr
    problem = f"exit {run.returncode}" if run.returncode else lmms_eval_problem(out, log, TASKS, samples_per_task)
    if problem:
        raise RuntimeError(f"shell-loop trial {method}-{budget} failed ({problem}):\n{log[-3000:]}")
    return sum(lmms_eval_answered(lmms_eval_results(out), task) for task in TASKS)


def shell_loop_measured(gpus: int, samples_per_task: int, batch_size: int, costs: Costs, workdir: Path,
                        grid: tuple[list[str], list[int]] = (METHODS, BUDGETS)) -> dict:
    """The shell loop run for real on this machine: `gpus` lanes, each running its trials' `lmms-eval` processes one
    after another (a GPU each: :func:`run_shell_trial`, which refuses a trial that did not answer and score every
    sample), trials dealt round-robin (all are equal; budgets as :func:`shell_budget`). Wall time from the first
    process start to the last exit; ``answered``: the samples the processes' results files say they scored."""
    from concurrent.futures import ThreadPoolExecutor

    from promprune.eval import prepare_offline_tasks

    include = str(prepare_offline_tasks())
    trials = [("none", "0")] + [(m, str(shell_budget(m, b))) for m in grid[0] for b in grid[1]]

    def lane(index: int) -> tuple[int, int]:
        done = answered = 0
        for method, budget in trials[index::gpus]:
            answered += run_shell_trial(method, budget, samples_per_task, batch_size, costs, include,
                                        workdir / f"shell-{gpus}-{method}-{budget}")
            done += 1
        return done, answered

    start = time.perf_counter()
    with ThreadPoolExecutor(gpus) as pool:
        lanes = list(pool.map(lane, range(gpus)))
    wall = time.perf_counter() - start
    ran = sum(done for done, _ in lanes)
    samples = len(TASKS) * samples_per_task
    ideal = ran * samples * costs.sample_s / gpus + costs.load_s
    return {"wall": wall, "ideal": ideal, "loads": ran, "rows": ran * samples,
            "answered": sum(answered for _, answered in lanes)}


# Table 1 at full size: documents per benchmark (lmms-eval's splits) -> samples per trial on LLaVA-1.5-7B
TABLE1_SAMPLES = {"mme": 2374, "pope": 9000, "mmbench_en_dev_static": 4329, "textvqa_val": 5000,
                  "scienceqa_img": 2017, "gqa": 12578, "vqav2_val": 214354, "vizwiz_vqa_val": 4319, "mmvet": 218}
# The projection's assumed costs (not measured here: no A100 was at hand), so its efficiencies are arithmetic on them
A100_SAMPLE_S = 0.15  # LLaVA-1.5-7B, bf16, batch 8, short answers: ~1.2 s per batch
A100_LOAD_S = 30.0  # a 7B checkpoint from local disk; from the object store about a third of that
SHELL_STARTUP_S = 60.0  # one lmms-eval process: imports, task indexing, dataset preparation
SMOKE_GRID = ([], [])  # --smoke: the baseline alone
LLAVA_TOKENS = 576  # visual tokens LLaVA-1.5 gives an image, which Table 1's budgets are of


def projection(gpus: int, trials: int, overhead_s: float) -> tuple[float, float, float, int]:
    """(pipeline wall, shell-loop wall, ideal, actors per trial) of Table 1 at full size, in hours. The pipeline
    runs the plan `pipelines.run.resources.plan` makes for a spec with ``max_gpus: gpus``: every trial asks for an
    actor per GPU (its blocks outnumber them), and the next trial's actors start when the last one's release their
    GPUs, each loading the weights from the object store; per trial it pays that load and `overhead_s` (measured
    here). The shell loop runs one process per trial per GPU in waves and pays a process start and a disk load per
    trial."""
    from pipelines.config import Resources
    from pipelines.run import resources as planning

    work = sum(TABLE1_SAMPLES.values()) * A100_SAMPLE_S
    blocks = math.ceil(sum(TABLE1_SAMPLES.values()) / 8)
    plan = planning.plan(Resources(max_gpus=gpus), trials, blocks, cluster={"GPU": gpus})
    pipeline = trials * (work / plan.max_actors + overhead_s + A100_LOAD_S / 3)
    shell = math.ceil(trials / gpus) * (work + SHELL_STARTUP_S + A100_LOAD_S)
    ideal = trials * work / gpus + A100_LOAD_S / 3
    return pipeline / 3600, shell / 3600, ideal / 3600, plan.max_actors


def run_autoscaled(max_nodes: int, costs: Costs, samples_per_task: int, batch_size: int, workdir: Path,
                   methods: list[str], budgets: list[int]) -> dict:
    """The sweep on Ray's fake autoscaler (`pipelines.run.fake_cluster`): GPU worker nodes of {"CPU": 1, "GPU": 1},
    min 0, max ``max_nodes``, none up at the start. Returns the most worker nodes seen at once, the nodes the
    predictions name, whether every sample came back once per trial, and how long the nodes took to leave after."""
    import functools
    import threading

    from pipelines import spec as specs
    from pipelines import sweep
    from pipelines.run.fake_cluster import FakeAutoscalingCluster, worker_nodes
    from pipelines.run.ray_connect import worker_env

    counter = workdir / "loads-autoscale"
    counter.mkdir()
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
    with FakeAutoscalingCluster(workdir / "cluster", max_workers=max_nodes, idle_timeout_s=2) as cluster:
        ray.init(address=cluster.address, runtime_env=worker_env(), log_to_driver=False)
        seen, stop = [0], threading.Event()

        def watch():
            while not stop.is_set():
                seen[0] = max(seen[0], len(worker_nodes()))
                stop.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            spec = specs.parse({
                "name": "sweep_scaling_autoscale", "version": 1, "model": {"pretrained": "tiny:llava"},
                "tasks": TASKS, "limit": samples_per_task, "baseline": False,
                "grid": {"method": methods, "budget": budgets}, "generation": {"max_new_tokens": 1},
                "resources": {"batch_size": batch_size, "actor_wait_s": 600}, "tune": {"max_failures": 0}})
            spec.model = stand_in_source(costs, str(counter))
            spec.tune.storage_path = str(workdir / "tune-autoscale")
            start = time.perf_counter()
            outcome = sweep.run_sweep(spec, run_fn=functools.partial(stand_in_run, sample_s=costs.sample_s))
            wall = time.perf_counter() - start
            nodes, once = set(), not outcome.failed
            for rec in outcome.records.values():
                frame = rec["predictions"].to_pandas()
                nodes |= set(frame["node"].dropna())
                once &= not frame.duplicated(["task", "doc_id"]).any() and len(frame) == len(TASKS) * samples_per_task
            t0 = time.monotonic()
            while worker_nodes() and time.monotonic() - t0 < 120:  # nothing pending: idle nodes leave
                time.sleep(1)
            released = None if worker_nodes() else time.monotonic() - t0
        finally:
            stop.set()
            watcher.join()
            ray.shutdown()
    return {"max_nodes": seen[0], "nodes": len(nodes), "once": once, "wall": wall, "released_s": released,
            "trials": len(outcome.records)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--samples-per-task", type=int, default=32,
                    help="samples per task (every trial runs each of TASKS)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=0.25, help="stand-in cost per sample (scaled)")
    ap.add_argument("--load-s", type=float, default=1.0, help="stand-in model load (scaled)")
    ap.add_argument("--startup-s", type=float, default=1.0,
                    help="arithmetic shell loop: process start + data load (scaled)")
    ap.add_argument("--shell", choices=["measured", "arithmetic"], default="measured",
                    help="run the shell loop's lmms-eval processes on this machine (default), or only compute it")
    ap.add_argument("--timeline", metavar="PATH", help="write every run's events here (.csv or .json) and print "
                    "where the time went")
    ap.add_argument("--smoke", action="store_true", help="a quick check of this script: 1 GPU, 1 trial (the baseline), "
                    "4 samples per task, 0.02 s per sample, 0.1 s per load; the shell loop as --shell says (its one "
                    "lmms-eval process by default)")
    ap.add_argument("--autoscale", type=int, nargs="?", const=3, default=None, metavar="MAX_NODES",
                    help="instead: the sweep on Ray's fake autoscaler, GPU nodes from 0 up to MAX_NODES (default 3)")
    args = ap.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--gpus", args.gpus, 1, "simulated GPUs of each run", 4)
    flags.at_least("--samples-per-task", args.samples_per_task, 1, "samples per task", 32)
    flags.at_least("--batch-size", args.batch_size, 1, "rows per block", 8)
    flags.at_least("--sample-s", args.sample_s, 0, "seconds", 0.25)
    flags.at_least("--load-s", args.load_s, 0, "seconds", 1.0)
    flags.at_least("--startup-s", args.startup_s, 0, "seconds", 1.0)
    flags.at_least("--autoscale", args.autoscale, 1, "most GPU nodes", 3)
    flags.writable("--timeline", args.timeline)
    flags.refuse()
    if args.autoscale is not None:
        autoscale_main(args)
        return
    grid = (METHODS, BUDGETS)
    if args.smoke:
        args.gpus, args.samples_per_task, args.sample_s, args.load_s = [1], 4, 0.02, 0.1
        grid = SMOKE_GRID
    costs = Costs(args.load_s, args.sample_s)
    print(f"{'Table-1-shaped' if grid == (METHODS, BUDGETS) else 'A'} sweep: {len(grid[0]) * len(grid[1]) + 1} "
          f"trials x {len(TASKS) * args.samples_per_task} samples; "
          f"stand-in model: {args.sample_s:g} s per sample, {args.load_s:g} s per load (a 7B model on an A100, "
          "scaled: real trials run far more samples per load); shell loop: "
          + ("lmms-eval processes run on this machine under the same injected costs" if args.shell == "measured"
             else f"+{args.startup_s:g} s per process") + ". Ray's and the processes' own overheads are real "
          "(process starts, imports, data loading, scoring), on a 2-core machine for up to 8 simulated GPUs.\n")
    print("| GPUs | actors per trial | pipeline wall s | ideal s | efficiency | model loads | rows built | "
          "shell-loop wall s | shell-loop efficiency | shell-loop loads | shell-loop answers scored |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    last, events, where = None, [], []
    with tempfile.TemporaryDirectory(prefix="sweep-scaling-") as tmp:
        for gpus in args.gpus:
            folder = Path(tmp, f"timeline-{gpus}") if args.timeline else None
            r = run_pipeline(gpus, costs, args.samples_per_task, args.batch_size, Path(tmp), folder, grid)
            if folder is not None:
                run = [{"run": gpus, **e} for e in timeline.read(folder)]
                events += run
                where += [f"{gpus} GPU(s): " + line for line in timeline.summary(run)]
            if args.shell == "measured":
                s = shell_loop_measured(gpus, args.samples_per_task, args.batch_size, costs, Path(tmp), grid)
            else:
                s = shell_loop(gpus, r["trials"], r["rows"], costs, args.startup_s)
            eff = r["ideal"] / r["wall"]
            print(f"| {gpus} | {r['workers']} | {r['wall']:.1f} | {r['ideal']:.1f} | {eff:.2f} | {r['loads']} | "
                  f"{r['rows']} | "
                  f"{s['wall']:.1f} | {s['ideal'] / s['wall']:.2f} | {s['loads']} | {s.get('answered', '-')} |",
                  flush=True)
            last = (gpus, eff)
            if gpus == min(args.gpus):  # per trial, beyond its samples (trials overlap: the sweep's wall time)
                overhead = (r["wall"] - r["trials"] * r["rows"] * costs.sample_s / gpus) / r["trials"]
    if args.timeline:
        timeline.write(events, args.timeline)
        print("\n" + "\n".join(where) + f"\n({len(events)} events in {args.timeline})")
    print(f"\nmeasured per-trial overhead of the pipeline here (trial start, actor pool start, scoring, MLflow): "
          f"{overhead:.1f} s\n")
    print(f"Table 1 at full size, a projection (arithmetic, not a measurement): {sum(TABLE1_SAMPLES.values())} samples "
          f"per trial at an assumed {A100_SAMPLE_S} s each on an A100, {A100_LOAD_S:g} s per model load from disk, "
          f"{SHELL_STARTUP_S:g} s per lmms-eval process start, and the overhead measured above:\n")
    print("| GPUs | actors per trial | pipeline h | shell loop h | ideal h | pipeline efficiency | "
          "shell-loop efficiency |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for gpus in args.gpus:
        p, s, i, w = projection(gpus, len(METHODS) * len(BUDGETS) + 1, overhead)
        print(f"| {gpus} | {w} | {p:.2f} | {s:.2f} | {i:.2f} | {i / p:.2f} | {i / s:.2f} |")
    print("\n(the shell loop runs whole trials in waves: 19 trials on 8 GPUs take 3, the last with 3 GPUs busy; the "
          "pipeline gives each trial an actor per GPU, one trial after the other)")
    print(f"\nefficiency {last[1]:.2f} at {last[0]} GPUs")


def autoscale_main(args) -> None:
    """`--autoscale`: the grow-and-release check (with `--smoke`: 6 trials of 2 x 4 samples, 0.5 s per sample)."""
    methods, budgets = (METHODS[:3], BUDGETS[:2]) if args.smoke else (METHODS, BUDGETS)
    samples = 4 if args.smoke else args.samples_per_task
    sample_s = 0.5 if args.smoke else args.sample_s
    print(f"{len(methods) * len(budgets)} trials x {len(TASKS) * samples} samples on Ray's fake autoscaler: GPU "
          f"nodes from 0 up to {args.autoscale}; stand-in model: {sample_s:g} s per sample")
    with tempfile.TemporaryDirectory(prefix="sweep-autoscale-") as tmp:
        r = run_autoscaled(args.autoscale, Costs(0.0, sample_s), samples, 1 if args.smoke else args.batch_size,
                           Path(tmp), methods, budgets)
    released = "never" if r["released_s"] is None else f"{r['released_s']:.0f} s after the sweep"
    print(f"wall {r['wall']:.1f} s for {r['trials']} trials; worker nodes released {released}")
    print(f"autoscaled to {r['max_nodes']} of {args.autoscale} GPU nodes; predictions from {r['nodes']} nodes; "
          + ("every sample once" if r["once"] else "NOT every sample once"))


if __name__ == "__main__":
    main()
