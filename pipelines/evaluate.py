"""One evaluation on Ray: (model, method, budget, options, tasks) -> predictions, scores, metrics.

    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 \
        --tasks easyvqa_yesno easyvqa_open --limit 8

Setup -> run -> cleanup:

1. rows (`pipelines/run/requests.py`): `promprune.eval.build_requests(tasks, limit=...)` (`promprune.records.Request`:
   task, doc_id, prompt, PNG bytes, image key, gen_kwargs), on the driver for small evaluations or in parallel
   shards as Ray tasks for large ones, stored once in the object store as Arrow blocks (`arrow_schema(Request)`) in
   which the questions about one image sit together and its PNG is stored once
   (`promprune.eval.requests.pack_requests`).
2. A `PredictorPool` (`pipelines/run/pool.py`): actors that each load the model once (one GPU each when the cluster
   has GPUs, CPU otherwise) and turn a block of requests into a block of `promprune.records.Prediction`s under
   `torch.inference_mode()`, taking each call's method, budget and options. A sweep starts one pool for all its
   trials and passes it to `evaluate(..., pool=)`; a single evaluation starts its own. A pool that cannot be
   scheduled fails within `actor_wait_s` instead of hanging; an actor lost with its node restarts and its blocks go
   to the others.
3. The result (`pipelines/run/result.py`): the blocks assembled into one predictions table, checked to hold every
   sample exactly once (nothing is de-duplicated silently), scored once centrally (`promprune.eval.score`) and
   summarized: a `TrialResult`.

Run as a script it also logs one MLflow run (role `evaluation`) with the same metrics and artifacts as a sweep
trial. `pipelines/sweep.py` calls `evaluate()` inside each Ray Tune trial.
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
from pipelines.run.pool import PredictorPool, cluster_gpus
from pipelines.run.ray_connect import QUIET_ENV, RayUnreachable, connect
from pipelines.run.requests import Requests, build_requests_dataset, requests_dataset
from pipelines.run.result import TrialResult, assemble_predictions
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
    resources: Resources = field(default_factory=Resources)  # actors, GPUs and CPUs per actor, batch size, wait
    progress_bars: bool = True  # kept for callers; the pool prints no bars (sweeps print one line per trial)
    bootstrap: int = 0  # resamples for 95% CIs of each task's primary metrics (<metric>_ci_low/_ci_high); 0: none


def predict(cfg: EvalConfig, rows: list[Request] | Requests, *, run_fn: Callable | None = None,
            pool: PredictorPool | None = None) -> pa.Table:
    """Share the request blocks out over actors holding the model: the predictions table (`PREDICTION_SCHEMA`),
    one row per request, sorted by (task, doc_id). pool: a sweep's shared actors (they carry their own run_fn);
    None: a pool started for this call alone (`resources.actors` actors, one GPU each when the cluster has GPUs)
    and shut down after it: one inference path for sweeps and single evaluations."""
    if not isinstance(rows, Requests):
        rows = requests_dataset(rows, cfg.resources.batch_size)
    own = pool is None
    if own:
        pool = PredictorPool.start(cfg.model, cfg.resources.actors, cfg.resources, on_gpu=cluster_gpus() > 0,
                                   run_fn=run_fn)
    try:
        timeline.mark("first_request", "trial")
        tables = pool.map(rows.blocks, cfg.method, cfg.budget, cfg.options, cfg.resources.actor_wait_s)
        timeline.mark("last_answer", "trial")
    finally:
        if own:
            pool.shutdown()
    return assemble_predictions(rows.keys, tables)


def evaluate(cfg: EvalConfig, rows: list[Request] | Requests | None = None, *, run_fn: Callable | None = None,
             score_fn: Callable | None = None, pool: PredictorPool | None = None) -> TrialResult:
    """Requests (built here unless given) -> predictions on a pool of actors (a sweep's `pool`, or one of its
    own) -> scores (once, centrally) -> metrics: one `TrialResult`."""
    if rows is None:
        rows = build_requests_dataset(cfg.tasks, cfg.limit, cfg.generation, cfg.resources.batch_size,
                                      video_frames=cfg.video_frames)
    result = TrialResult.scored(predict(cfg, rows, run_fn=run_fn, pool=pool), score_fn, bootstrap=cfg.bootstrap)
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
    p.add_argument("--workers", type=int, default=1)
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
                     resources=Resources(workers=args.workers, batch_size=args.batch_size))
    try:
        connect(args.address)
    except RayUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = evaluate(cfg)
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
