"""One evaluation on Ray, without Tune: (model, method, budget, options, tasks) -> predictions, scores, metrics, and
one MLflow run (role `evaluation`, the same metrics and artifacts as a sweep trial).

    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 \
        --tasks easyvqa_yesno easyvqa_open --limit 8

A one-trial sweep spec run through the trial a sweep runs (`pipelines/run/trial.py`): the command line becomes a spec
(`spec_of`), checked as a sweep's is (`pipelines.spec.parse`, then `pipelines/preflight.py`), and its one `Trial`
goes through the same requests (sealed blocks in the object store), the same engine (model workers that hold the
pruned VLM) and the same `TrialResult`; what differs is only that the evaluation plans for itself (`trial.alone`)
and is logged from here instead of a sweep's driver. Problems are named by their flags (`--budget`, `--option mu`).
A task whose own scoring code fails (`promprune.eval.scoring.ScoringError`: its process_results or an aggregation
raising) is one paragraph naming the task, exit 2, as a problem of the command line is.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from pathlib import Path

if __name__ == "__main__" and (Path(__file__).resolve().parents[1] / "pyproject.toml").is_file():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: its packages first

from pipelines import mlflow_layout, plugins, preflight
from pipelines import spec as specs
from pipelines.recording import tracking
from pipelines.recording.console import nan_note
from pipelines.run import resources as planning
from pipelines.run import trial as trials
from pipelines.run.ray_connect import QUIET_ENV, RayUnreachable, check_address, connect
from pipelines.spec.schema import DEFAULT_TASKS
from pipelines.weights import prepare_model
from promprune.eval.scoring import ScoringError

SOURCE = "pipelines/evaluate.py"
# a spec field -> the flag that sets it (how a problem is named on this command line)
FLAGS = {"model.pretrained": "--model", "model.dtype": "--dtype", "model.options": "--option", "tasks": "--tasks",
         "limit": "--limit", "video_frames": "--video-frames", "generation.max_new_tokens": "--max-new-tokens",
         "resources.workers": "--workers", "resources.batch_size": "--batch-size", "include_path": "--include-path",
         "plugins": "--plugin", "trials[0].method": "--method", "trials[0].budget": "--budget", "budget": "--budget"}


# ----------------------------------------------------------------------------------------------------------------
# CLI

def int_or(words: dict, shown: str):
    """An argparse type: an int (the spec checks it is >= 1), or one of ``words`` (lowercase word -> the spec's
    value); otherwise an argparse error that names the forms as ``shown``."""
    def parse(text: str):
        if text.strip().lower() in words:
            return words[text.strip().lower()]
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= 1 or {shown}, got {text!r}") from None
    return parse


# --limit: all (or null) is the spec's ``limit: null``, every sample of each task; --workers: auto, as many as the
# blocks and the cluster allow
limit_value = int_or({"all": None, "null": None}, "all (null)")
workers_value = int_or({"auto": "auto"}, "'auto'")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-easyvqa:llava",
                   help="checkpoint name/path, or a factory name: tiny-easyvqa:llava (default; trained on easy-vqa, "
                        "so its scores mean something), tiny:<arch> (random weights), shape:<name>")
    p.add_argument("--method", default=None, help="pruning method; omit for the unpruned model")
    p.add_argument("--budget", type=int, default=None, help="visual tokens kept (required with --method)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a method option (with --method) or a model adapter option, value parsed as YAML "
                        "(repeatable), e.g. --option mu=0.4")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), metavar="TASK",
                   help="lmms-eval tasks, space- or comma-separated (default: " + " ".join(DEFAULT_TASKS) + ")")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="an lmms-eval task directory of your own, searched for --tasks (repeatable; a relative "
                        "path is from the working directory)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_PATH",
                   help="a module, .py file or package directory that registers methods (repeatable; a relative "
                        "path is from the working directory)")
    p.add_argument("--limit", type=limit_value, default=8, help="samples per task, or all (also: null) for the full "
                   "benchmark (default 8: a smoke run)")
    p.add_argument("--video-frames", type=int, default=8,
                   help="frames sampled uniformly from each clip of a video task (default 8)")
    p.add_argument("--workers", type=workers_value, default="auto", help="most workers, or auto (default: as many "
                   "as the blocks and the cluster allow)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated tokens (default: each task's own, as lmms-eval runs it)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--no-mlflow", action="store_true", help="print the results only")
    args = p.parse_args(argv)
    args.tasks = preflight.task_names(args.tasks)
    return args


def spec_of(args: argparse.Namespace) -> dict:
    """The command line as a raw one-trial sweep spec: the method's options as the trial's, adapter options
    (`promprune.models.ADAPTER_OPTIONS`) as the model's; no method: the unpruned model (the spec's baseline).
    Relative paths are from the working directory. A command line that makes no such spec (an ``--option`` that is
    not KEY=VALUE or whose value is not YAML; ``--budget`` or a method's option without ``--method``, which the
    unpruned model would ignore; ``--method`` without ``--budget``; ``--option mu=calibrate``, which needs a sweep
    spec's calibration images; an ``--include-path`` that is not a directory) raises SpecError naming every such
    flag as typed, before anything is imported or checked."""
    import yaml

    from pipelines.calibration import CALIBRATE
    from promprune.models import ADAPTER_OPTIONS

    options, problems = {}, []
    for item in args.option:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            problems.append(f"--option {shlex.quote(item)}: expected KEY=VALUE, e.g. --option mu=0.4")
            continue
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            why = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            problems.append(f"--option {shlex.quote(item)}: the value is not valid YAML ({why}); quote strings with "
                            "special characters")
    adapter = {k: v for k, v in options.items() if k in ADAPTER_OPTIONS}
    method = {k: v for k, v in options.items() if k not in ADAPTER_OPTIONS}
    if args.method is not None and args.budget is None:
        problems.append(f"--budget: required with --method {args.method} (the visual tokens it keeps of each image), "
                        "e.g. --budget 64")
    if args.method is not None and method.get("mu") == CALIBRATE:
        problems.append("--option mu=calibrate: evaluate.py cannot calibrate mu (calibrating needs calibration.images, "
                        "which only a sweep spec sets); pass a number, e.g. --option mu=0.42 (CLIP encoders' value), "
                        "or run a sweep spec with calibration.images and the trial (sweeps/quickstart.yaml calibrates "
                        "on testbed:train: python pipelines/sweep.py --config sweeps/quickstart.yaml)")
    if args.method is None:
        unused = ([f"--budget {args.budget}"] if args.budget is not None else []) + [f"--option {k}" for k in method]
        problems += [f"{flag}: needs --method (without one the unpruned model runs, keeping every visual token); add "
                     f"a method, e.g. --method promprune, or drop {flag}" for flag in unused]
    resolved = plugins.resolve_paths({"include_path": args.include_path}, Path.cwd())["include_path"]
    problems += [f"--include-path {shlex.quote(typed)}: {path} is not a directory (a relative path is from the working "
                 "directory)" for typed, path in zip(args.include_path, resolved) if not Path(path).is_dir()]
    if problems:
        raise specs.SpecError(problems, SOURCE)
    raw = {"name": "evaluate", "version": 1, "tasks": args.tasks, "limit": args.limit,
           "model": {"pretrained": args.model, "dtype": args.dtype, "options": adapter},
           "video_frames": args.video_frames, "plugins": args.plugin, "include_path": args.include_path,
           "generation": {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens},
           "resources": {"workers": args.workers, "batch_size": args.batch_size},
           "baseline": args.method is None,
           "trials": [] if args.method is None else [{"method": args.method, "budget": args.budget, **method}]}
    return plugins.resolve_paths(raw, Path.cwd())


def in_flags(message: str, args: argparse.Namespace | None = None) -> str:
    """A spec problem named by the flag that sets its field (``video_frames: ...`` -> ``--video-frames: ...``,
    ``trials[0].mu: ...`` -> ``--option mu: ...``; with ``args``, ``plugins[1]: ...`` -> ``--plugin x.py: ...``, and
    a module name's hint in the command line's words)."""
    typed_plugins = list(args.plugin) if args else []

    def flag(match: re.Match) -> str:
        field = match.group(2)
        plugin = re.fullmatch(r"plugins\[(\d+)\]", field)
        if plugin and int(plugin.group(1)) < len(typed_plugins):
            return f"{match.group(1)}--plugin {shlex.quote(typed_plugins[int(plugin.group(1))])}:"
        if field in FLAGS:
            return match.group(1) + FLAGS[field] + ":"
        option = field.removeprefix("trials[0].")
        return match.group(1) + (f"--option {option}:" if option != field else f"{field}:")

    message = re.sub(r"^(  - )([\w.\[\]]+):", flag, message, flags=re.MULTILINE)
    return re.sub(r"e\.g\. plugins: \[([^\]]*)\]", r"e.g. --plugin \1", message)  # a module name's hint


def checked_spec(args: argparse.Namespace) -> specs.SweepSpec:
    """The one-trial spec, checked as a sweep's: the spec itself, then what it names (SpecError: every problem)."""
    spec = specs.parse(spec_of(args), source=SOURCE)  # imports the plugins first
    plugins.activate(spec.plugins, spec.include_path)  # here and in every Ray worker started after this
    preflight.check_or_raise(spec, SOURCE, store=not args.no_mlflow)
    return spec


def main(argv: list[str] | None = None) -> int:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    preflight.random_weights_note(args.model)
    try:
        spec = checked_spec(args)
    except specs.SpecError as exc:
        print(f"error: {in_flags(str(exc), args)}", file=sys.stderr)
        return 2
    for note in preflight.judge_notes(spec.tasks):
        print(note)
    (trial,) = specs.expand(spec)
    try:
        check_address(args.address)  # before the model's first-use work: refused in seconds, nothing loaded
        prepare_model(spec.model.pretrained)  # first-use work (training tiny-easyvqa:llava) here, with its bar
        connect(args.address)
    except RayUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        with trials.alone(spec) as shared:
            result = trials.evaluate(trial, spec, shared)
            on_gpu = shared.plan.on_gpu  # the dtype `dtype: auto` resolved to, for its run's params
    except (planning.NoCapacity, ScoringError) as exc:  # a ScoringError: the task's own scoring code, named
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"evaluated {result.predictions.num_rows} samples in {time.perf_counter() - t0:.1f}s")
    for key, value in sorted(result.metrics.items()):
        print(f"  {key:32s} {value:.4g}")
    if note := nan_note(result.metrics):
        print(f"note:{note}")
    if not args.no_mlflow:
        run_id = tracking.log_evaluation(spec, trial, result, on_gpu)
        print(f"MLflow run {run_id}. " + mlflow_layout.open_results())
    return 0


if __name__ == "__main__":
    from pipelines.evaluate import main as _main  # pickled classes must live in an importable module, not __main__

    sys.exit(_main())
