"""One evaluation on Ray: (model, method, budget, options, tasks) -> predictions, scores, metrics.

    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 \
        --tasks easyvqa_yesno easyvqa_open --limit 8

Setup -> run -> cleanup:

1. rows (`pipelines/run/requests.py`): `promprune.eval.build_requests(tasks, limit=...)` (`promprune.records.Request`:
   task, doc_id, prompt, PNG bytes, image key, gen_kwargs), on the driver for small evaluations or in parallel
   shards as Ray tasks for large ones, stored once in the object store as sealed blocks (the questions about one
   image together, its PNG once), one row of a Ray Dataset each.
2. The engine (`pipelines/run/engine.py`): Ray Data maps the blocks over an autoscaling pool of actors that each load
   the model once (on GPUs, or on CPUs on a machine without them: `pipelines/run/resources.py`) and stream the
   predictions back; Ray restarts lost actors and retries their blocks (`resources.block_attempts`), a hung block is
   retried after `resources.block_timeout_s`, and a block out of attempts becomes failed samples.
3. The result (`pipelines/run/result.py`): the blocks assembled into one predictions table, checked to hold every
   sample exactly once (nothing is de-duplicated silently), scored once centrally (`promprune.eval.score`) and
   summarized: a `TrialResult`.

Run as a script it also logs one MLflow run (role `evaluation`) with the same metrics and artifacts as a sweep
trial. `pipelines/sweep.py` calls `evaluate()` inside each Ray Tune trial, with the sweep's plan and the trial's
saved blocks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa

from promprune.records import Request

from pipelines import timeline, tracking
from pipelines.config import Resources
from pipelines.console import say
from pipelines.run import engine
from pipelines.run import resources as planning
from pipelines.run.checkpoints import BlockStore
from pipelines.run.ray_connect import QUIET_ENV, RayUnreachable, connect
from pipelines.run.requests import Requests, build_requests_dataset, requests_dataset
from pipelines.run.result import TrialResult
from pipelines.weights import ModelSource


@dataclass
class EvalConfig:
    """One evaluation: what to run and on how many actors."""

    model: ModelSource = field(default_factory=ModelSource)
    method: str | None = None  # None: the unpruned model
    budget: int | None = None
    options: dict = field(default_factory=dict)  # method options (mu, tau, diversity, ...)
    tasks: list = field(default_factory=lambda: ["easyvqa_yesno", "easyvqa_open"])  # the offline benchmarks
    limit: int | None = None  # per-task sample cap
    video_frames: int = 8  # frames sampled from each clip of a video task (promprune.models.video.DEFAULT_FRAMES)
    generation: dict = field(default_factory=dict)  # generate() kwargs over each task's own; {}: the task's own
    resources: Resources = field(default_factory=Resources)  # actors, GPUs and CPUs per actor, batch size, failover
    progress_bars: bool = True  # kept for callers; the engine prints no bars (sweeps print one line per trial)
    bootstrap: int = 0  # resamples for 95% CIs of each task's primary metrics (<metric>_ci_low/_ci_high); 0: none

    def job(self, run_fn: Callable | None = None) -> engine.Job:
        return engine.Job(self.model, self.method, self.budget, self.options, self.resources.batch_size, run_fn)

    def failover(self) -> engine.Failover:
        return engine.Failover(self.resources.block_attempts, self.resources.block_timeout_s)


def predict(cfg: EvalConfig, rows: list[Request] | Requests, *, run_fn: Callable | None = None,
            plan: planning.Plan | None = None, store: BlockStore | None = None,
            on_block: Callable | None = None, ledger=None) -> pa.Table:
    """The blocks through the engine: the predictions table (`PREDICTION_SCHEMA`), one row per request, sorted by
    (task, doc_id). ``plan``: a sweep's (its driver waited for the first GPU); None: this evaluation plans for
    itself and waits up to ``resources.actor_wait_s`` for the first GPU when it wants GPUs (`planning.NoCapacity`
    otherwise). ``store`` / ``on_block``: see `engine.run`."""
    if not isinstance(rows, Requests):
        rows = requests_dataset(rows, cfg.resources.batch_size)
    timeline.mark("first_request", "trial")
    if plan is not None:
        return engine.run(rows, cfg.job(run_fn), plan, cfg.failover(), store=store, on_block=on_block,
                          ledger=ledger)
    plan = planning.plan(cfg.resources, 1, len(rows.blocks))
    if plan.note:
        say(plan.note)
    capacity = planning.Capacity(plan)
    capacity.wait(cfg.resources.actor_wait_s)
    try:
        return engine.run(rows, cfg.job(run_fn), plan, cfg.failover(), store=store, on_block=on_block,
                          ledger=ledger)
    finally:
        capacity.release()


def evaluate(cfg: EvalConfig, rows: list[Request] | Requests | None = None, *, run_fn: Callable | None = None,
             score_fn: Callable | None = None, plan: planning.Plan | None = None, store: BlockStore | None = None,
             on_block: Callable | None = None, ledger=None) -> TrialResult:
    """Requests (built here unless given) -> predictions from the engine -> scores (once, centrally) -> metrics:
    one `TrialResult`."""
    if rows is None:
        rows = build_requests_dataset(cfg.tasks, cfg.limit, cfg.generation, cfg.resources.batch_size,
                                      video_frames=cfg.video_frames)
    predictions = predict(cfg, rows, run_fn=run_fn, plan=plan, store=store, on_block=on_block, ledger=ledger)
    result = TrialResult.scored(predictions, score_fn, bootstrap=cfg.bootstrap)
    timeline.mark("trial_scored", "trial")
    return result


# ----------------------------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-easyvqa:llava",
                   help="checkpoint name/path, or a factory name: tiny-easyvqa:llava (default; trained on easy-vqa, "
                        "so its scores mean something), tiny:<arch> (random weights), shape:<name>")
    p.add_argument("--method", default=None, help="pruning method; omit for the unpruned model")
    p.add_argument("--budget", type=int, default=None, help="visual tokens kept")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, value parsed as YAML (repeatable), e.g. --option mu=0.4")
    p.add_argument("--tasks", nargs="+", default=["easyvqa_yesno", "easyvqa_open"])
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="an lmms-eval task directory of your own, searched for --tasks (repeatable)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_PATH",
                   help="a module, .py file or package directory that registers methods (repeatable)")
    p.add_argument("--limit", type=int, default=8, help="samples per task (default 8: a smoke run)")
    p.add_argument("--video-frames", type=int, default=8,
                   help="frames sampled uniformly from each clip of a video task (default 8)")
    p.add_argument("--workers", type=int, default=None, help="most actors (default: as many as the blocks and the "
                   "cluster allow)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated tokens (default: each task's own, as lmms-eval runs it)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--no-mlflow", action="store_true", help="print the results only")
    return p.parse_args(argv)


def random_weights_note(model: str) -> None:
    """Say so when a model has random weights: its scores are noise (0 on the offline tasks), by construction."""
    if model.startswith(("tiny:", "shape:")):
        say(f"note: {model} has random weights, so its answers and scores are noise (tiny-easyvqa:llava is trained "
            "offline and answers the easy-vqa tasks)")


def main(argv: list[str] | None = None) -> int:
    import yaml

    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = yaml.safe_load(value)
    from pipelines import plugins, preflight
    from promprune.models import validate_method

    random_weights_note(args.model)
    given = plugins.resolve_paths({"plugins": args.plugin, "include_path": args.include_path}, Path.cwd())
    errors = plugins.load(given["plugins"])  # a user's mistakes: one message listing all of them, before Ray starts
    if errors:  # without its plugins the method cannot be checked: these are the problems
        print("error: " + "\n  - ".join(["pipelines/evaluate.py:", *errors]), file=sys.stderr)
        return 2
    plugins.activate(given["plugins"], given["include_path"])  # here and in every Ray worker started after this
    try:
        validate_method(args.method, args.budget, **options)
    except ValueError as exc:
        errors.append(f"method: {exc}")
    errors += preflight.check_tasks(args.tasks, args.limit, given["include_path"])
    if args.video_frames < 1:
        errors.append(f"--video-frames: expected an int >= 1, got {args.video_frames}")
    errors += preflight.check_judges(args.tasks)
    errors += preflight.check_model(args.model, {}, {"this evaluation": args.budget} if args.budget else {})
    if not args.no_mlflow:
        errors += preflight.check_store(tracking.tracking_uri())
    if errors:
        print("error: " + "\n  - ".join(["pipelines/evaluate.py:", *errors]), file=sys.stderr)
        return 2
    for note in preflight.judge_notes(args.tasks):
        print(note)
    cfg = EvalConfig(model=ModelSource(pretrained=args.model, dtype=args.dtype), method=args.method,
                     budget=args.budget, options=options, tasks=args.tasks, limit=args.limit,
                     video_frames=args.video_frames,
                     generation={} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens},
                     resources=Resources(workers="auto" if args.workers is None else args.workers,
                                         batch_size=args.batch_size))
    try:
        connect(args.address)
    except RayUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        result = evaluate(cfg)
    except planning.NoCapacity as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"evaluated {result.predictions.num_rows} samples in {time.perf_counter() - t0:.1f}s")
    for key, value in sorted(result.metrics.items()):
        print(f"  {key:32s} {value:.4g}")
    if not args.no_mlflow:
        run_id = tracking.log_evaluation(cfg, result)
        print(f"MLflow run {run_id}; open the UI with:\n  {tracking.ui_command()}")
    return 0


if __name__ == "__main__":
    from pipelines.evaluate import main as _main  # pickled classes must live in an importable module, not __main__

    sys.exit(_main())
