"""One evaluation on Ray, without Tune: (model, method, budget, options, tasks) -> predictions, scores, metrics, and
one MLflow run (role `evaluation`, the same metrics and artifacts as a sweep trial).

    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 \
        --tasks easyvqa_yesno easyvqa_open --limit 8

A thin CLI over the trial a sweep runs (`pipelines/run/trial.py`): the same requests (sealed blocks in the object
store), the same engine (Ray Data over actors that hold the pruned VLM), the same `TrialResult`; what differs is only
that the evaluation plans for itself (`trial.alone`) and is logged from here instead of a sweep's driver.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pipelines.recording import tracking
from pipelines.config import Resources
from pipelines.run import resources as planning
from pipelines.run import trial
from pipelines.run.ray_connect import QUIET_ENV, RayUnreachable, connect
from pipelines.weights import ModelSource


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

    preflight.random_weights_note(args.model)
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
    cfg = trial.EvalConfig(model=ModelSource(pretrained=args.model, dtype=args.dtype), method=args.method,
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
        with trial.alone(cfg) as shared:
            result = trial.evaluate(cfg, shared)
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
