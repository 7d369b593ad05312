"""Fig. 2 of the paper: do the entropy metrics track how concentrated an image's meaning is?

The paper sampled 100 images from each of GQA, SQA, POPE, MME, MM-Vet, MMBench and TextVQA (700 in all), had
GPT-4o rate each image's semantic concentration from 1 (highly distributed) to 5 (highly concentrated) with the
prompt of its Fig. B1, and plotted, per rating, the mean of three normalized entropies of LLaVA-1.5-7B's projected
visual tokens: spectral (the method's), feature-norm and attention entropy. This script does the same:

1. setup: the spec (``sweeps/fig2_concentration.yaml``; one whose ``command`` is not ``fig2_concentration``, a
   sweep's, is refused naming the command that runs it), the judge's key and endpoint (a missing key or a URL
   without http(s) exits 2 in seconds, nothing loaded), ``--cache``, ``--out`` (a folder the files can go in) and
   ``--judge-workers``, and what a sweep's preflight checks of what this script runs
   (``pipelines.preflight.preflight`` with ``evaluates=False``: the ``PROMPRUNE_*`` environment, the tasks, the
   model and its budget, what its construction with PromPrune and the spec's adapter options would refuse, the
   MLflow store and experiment name); the ratings cached by earlier runs (the latest ``fig2_concentration`` run's
   ``judge/ratings.json`` artifact, plus the local ``--cache`` file);
2. images: ``limit`` documents of each task, every k-th from a seeded start (``calibration.seed``), so they span
   the whole benchmark (POPE's three splits, MME's subtasks) and only they are decoded (``build_requests``); where
   the cache lacks a rating of one, the judge answers one test request about a small image, no retries (a refused
   key, an unknown model or an endpoint that does not answer exits 2 in seconds, the model not loaded, no MLflow
   run made);
3. ratings: one Chat Completions request per image not in the cache (``pipelines/judge.py``), the cache saved after
   each; so a rerun asks the judge nothing (it may be offline); no image rated (every request failed, or no reply
   held a score): the run fails here;
4. entropies: the three metrics per image with the spec's model (``pipelines.calibration.image_entropies``: the vision
   encoder and the split only, no generation);
5. MLflow: a parent run (tags ``promprune.role=figure``, ``promprune.sweep=<spec name>``) with the resolved spec,
   ``judge/ratings.json`` (the cache), ``fig2_concentration.csv`` (task, doc_id, rating, spectral, feature_norm,
   attention, the judge's reply), and ``report/`` (the figure, per-rating means, report.md); metrics
   ``fig2/<metric>/rating_<r>``, ``fig2/n/rating_<r>``, ``fig2/spearman/<metric>``, ``judge/requests``. The same
   files go to ``--out`` (default ``reports/<spec name>/``): built aside and logged from there, then copied in whole
   under the folder's lock, so two runs at once each log their own (`log_outputs`).

    python pipelines/fig2_concentration.py                       # the paper's setting (needs OPENAI_API_KEY, a GPU)
    RAY_AUTH_MODE=token ray job submit --entrypoint-num-gpus 1 --working-dir . -- python pipelines/fig2_concentration.py
    # offline try-out against any OpenAI-compatible server (e.g. a local vLLM serving a vision model):
    python pipelines/fig2_concentration.py --model tiny-easyvqa:llava --tasks easyvqa_yesno --n 8 \\
        --judge-base-url http://127.0.0.1:8000/v1 --judge-model Qwen/Qwen2.5-VL-7B-Instruct

Key and endpoint as for MM-Vet's judge: ``API_TYPE`` (openai | azure...) picks ``OPENAI_API_KEY`` or
``AZURE_API_KEY``; ``OPENAI_BASE_URL`` (or ``--judge-base-url``) the endpoint (``pipelines/judge.py``).
Exit codes: 0 done; 1 the judge failed for good midway, or rated no image (what was rated is cached); 2 bad input
(no key, a key the endpoint refuses, an endpoint that does not answer, a bad ``--cache``, ``--out`` or
``--judge-workers``, a spec for another command, a bad spec, task, model or store).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and (Path(__file__).resolve().parents[1] / "pyproject.toml").is_file():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: its packages first

from pipelines import judge as judging
from pipelines import mlflow_layout, paths, plugins, preflight
from pipelines import spec as specs
from promprune.selection.two_stage import METRICS  # the prominence metrics, named once

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "sweeps" / "fig2_concentration.yaml"
EXIT_JUDGE_FAILED, EXIT_BAD_INPUT = 1, 2
ROLE_FIGURE = "figure"  # promprune.role of this script's runs: never mistaken for a sweep by pipelines/report.py
CACHE_ARTIFACT_DIR, CACHE_NAME = "judge", "ratings.json"
TABLE_NAME, FIGURE_NAME, SUMMARY_NAME = "fig2_concentration.csv", "fig2_concentration.png", "fig2_by_rating.csv"
QUIET_ENV = {"LOGURU_LEVEL": "WARNING"}  # as pipelines/evaluate.py: lmms-eval logs every request build at DEBUG
FALLBACK_BUDGET_SHARE = 2  # a spec budget the model cannot prune to becomes capacity // 2 (entropy ignores it)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="spec (default: sweeps/fig2_concentration.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a spec field, value parsed as YAML (repeatable)")
    p.add_argument("--model", help="model.pretrained, e.g. tiny-easyvqa:llava")
    p.add_argument("--tasks", nargs="+", metavar="TASK", help="lmms-eval tasks, space- or comma-separated (as "
                   "pipelines/evaluate.py takes them), e.g. easyvqa_yesno")
    p.add_argument("--n", type=int, help="images per task (the spec's limit; the paper: 100)")
    p.add_argument("--seed", type=int, help="which documents (the spec's calibration.seed)")
    p.add_argument("--judge-model", default=judging.DEFAULT_MODEL, help="model name sent to the endpoint "
                   "(default gpt-4o, the paper's; for Azure: the deployment)")
    p.add_argument("--judge-base-url", default=None, help="API root of an OpenAI-compatible endpoint "
                   "(default: $OPENAI_BASE_URL, else https://api.openai.com/v1)")
    p.add_argument("--judge-workers", type=int, default=4, help="requests in flight at once")
    p.add_argument("--cache", default=None, help="local rating cache, saved after every new rating "
                   "(default: outputs/<spec name>/judge_ratings.json); merged with the latest run's artifact")
    p.add_argument("--out", default=None, help="folder for the CSV, figure and report (default reports/<spec name>)")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    """The shortcuts as spec overrides (JSON is YAML), after the explicit ``--set`` ones."""
    extra = []
    if args.model:
        extra.append(f"model.pretrained={json.dumps(args.model)}")
    if args.tasks:
        extra.append(f"tasks={json.dumps(preflight.task_names(args.tasks))}")
    if args.n is not None:
        extra.append(f"limit={args.n}")
    if args.seed is not None:
        extra.append(f"calibration.seed={args.seed}")
    return list(args.overrides) + extra


# ----------------------------------------------------------------------------------------------------------------
# setup


def setup(args: argparse.Namespace):
    """(spec, judge, budget), or raises SpecError listing every problem found, the judge's with the spec's; nothing
    is loaded."""
    from promprune.models.factories import loads_once

    judge, problems = None, []
    if args.judge_workers < 1:
        problems.append(f"--judge-workers: expected an int >= 1 (judge requests in flight at once), got "
                        f"{args.judge_workers}")
    try:
        judge = judging.ConcentrationJudge.from_env(model=args.judge_model, base_url=args.judge_base_url)
    except judging.JudgeError as exc:
        problems.append(f"judge: {exc}")
    if args.cache:
        problems += check_cache(Path(args.cache), f"--cache {args.cache}")
    try:
        spec = specs.load(args.config, overrides(args))
    except specs.SpecError as exc:
        raise specs.SpecError(problems + exc.errors, args.config) from None
    # a sweep's spec (sweeps/quickstart.yaml) ran here silently, a figure of nothing; refused naming its command
    specs.check_command(spec, "fig2_concentration", args.config)
    if not args.cache:
        default = rating_cache_path(args, spec)
        problems += check_cache(default, f"the rating cache {default} (the default of --cache)")
    # the files are written after the judge was paid and the model ran: a folder they cannot go in was an OSError then
    problems += [p for p in [paths.out_problem(out_dir(args, spec), "the figure", default=not args.out)] if p]
    plugins.activate(spec.plugins, spec.include_path)  # here and in every Ray worker started after this
    if not spec.limit or spec.limit < 1:
        problems.append("limit: images per task; must be a positive int (the paper: 100)")
    with loads_once():  # the model's config: once for pick_budget and every check
        budget, note = pick_budget(spec)
        problems += [note] if note else []
        # the sweep's checks of what this script runs (the model, its construction with the promprune trial, the
        # tasks, the store, the environment), not those of scoring (`preflight.preflight`'s ``evaluates``)
        problems += preflight.preflight(spec, trials=[specs.Trial("promprune", budget, {})],
                                        budgets_of={"fig2": budget}, evaluates=False)
    if problems:
        raise specs.SpecError(problems, args.config)
    return spec, judge, budget


def out_dir(args: argparse.Namespace, spec) -> Path:
    """``--out``, else ``reports/<spec name>``."""
    return Path(args.out or Path("reports") / spec.name)


def rating_cache_path(args: argparse.Namespace, spec) -> Path:
    """``--cache``, else ``outputs/<spec name>/judge_ratings.json``."""
    return Path(args.cache or Path("outputs") / spec.name / "judge_ratings.json")


def check_cache(path: Path, named: str) -> list[str]:
    """The local rating cache can be read (when it exists) and written: a directory, a file that is no rating cache
    or a folder that cannot be written would fail after the judge was paid."""
    fix = "delete it or pass another --cache path (a file; it is created when missing)"
    if path.is_dir():
        return [f"{named} is a directory, and the rating cache is a JSON file: pass a file path, e.g. "
                f"--cache {path / 'judge_ratings.json'}"]
    if path.exists():
        try:
            judging.RatingCache.load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable, not JSON or UTF-8, not our format
            why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            return [f"{named} is not a readable rating cache ({type(exc).__name__}: {why}); {fix}"]
    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
    if path.exists() and paths.refuses_file_writes(path):  # test writes: os.access says yes to root
        return [f"{named} is not writable, and every new rating is saved to it; pass another --cache path"]
    if not folder.is_dir() or paths.refuses_writes(folder):
        return [f"{named} cannot be created: {folder} is not a writable folder; pass another --cache path"]
    return []


def pick_budget(spec) -> tuple[int, str | None]:
    """PromPrune's budget for the model that measures the entropies: the spec's (the split needs one; the entropies
    do not depend on it), halved to fit a model with fewer visual tokens (the tiny test models)."""
    from promprune.models.adapters import visual_token_capacity
    from promprune.models.factories import model_config

    budgets = [t.budget for t in specs.expand(spec) if t.method == "promprune"]
    if not budgets:
        return 0, "grid: needs method promprune (its entropies are what Fig. 2 measures)"
    try:
        capacity = visual_token_capacity(model_config(spec.model.pretrained), spec.model.options)
    except (ValueError, AttributeError):
        capacity = None  # preflight.check_model names the problem
    budget = budgets[0]
    if capacity is not None and budget >= capacity:
        budget = max(1, capacity // FALLBACK_BUDGET_SHARE)
    return budget, None


def previous_cache(client, experiment: str, name: str) -> tuple[judging.RatingCache, str | None]:
    """The rating cache of the latest run of this figure that logged one (every run logs the union of what it
    found and what it added, so the latest is the most complete), and that run's id."""
    from mlflow.exceptions import MlflowException

    runs = client.search_runs([experiment], filter_string=f"tags.`{mlflow_layout.ROLE}` = '{ROLE_FIGURE}' and "
                                                          f"tags.`{mlflow_layout.SWEEP}` = '{name}'",
                              order_by=["attributes.start_time DESC"], max_results=20)
    for run in runs:
        with tempfile.TemporaryDirectory(prefix="fig2-cache-") as d:
            try:
                path = client.download_artifacts(run.info.run_id, f"{CACHE_ARTIFACT_DIR}/{CACHE_NAME}", d)
            except (MlflowException, OSError) as exc:  # a run killed before logging its cache: try the one before
                print(f"(run {run.info.run_id} has no rating cache: {type(exc).__name__})", file=sys.stderr)
                continue
            return judging.RatingCache.load(path), run.info.run_id
    return judging.RatingCache(), None


# ----------------------------------------------------------------------------------------------------------------
# run


def sample_requests(task: str, n: int, seed: int) -> list:
    """``n`` documents of ``task`` about ``n`` distinct images (App. B rates images: a benchmark asks several questions
    about one image, and a repeated one was rated and averaged again): every k-th document (k = documents // n) from
    a start drawn with ``seed``, in doc order, the first of each image kept; where that leaves fewer than ``n``
    images, k is halved until it does not (or every document is read).

    A one-document shard tells the task's size without decoding its images; the next calls decode only the chosen
    ones. The paper's sample was "random" with no seed or list published, so the exact 700 cannot be matched; a
    systematic sample spans each benchmark's parts evenly."""
    from promprune.eval import build_requests
    from promprune.eval.tasks import lmms_eval_silenced

    with lmms_eval_silenced():
        probe = build_requests([task], shard=(0, 2 ** 31))
        if not probe:
            return []
        k = max(1, probe[0].n_docs // n)
        start = random.Random(f"{seed}/{task}").randrange(k)
        while True:
            chosen = distinct_images(build_requests([task], shard=(start, k)))
            if len(chosen) >= n or k == 1:
                return chosen[:n]
            k //= 2
            start %= k


def distinct_images(requests: list) -> list:
    """The first request about each image (its ``image_key``; a request without one counts as its own image)."""
    seen, out = set(), []
    for r in requests:
        key = r.image_key or (r.task, r.doc_id)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def entropies(spec, budget: int, images: list) -> dict[str, list[float]]:
    """The three normalized entropies of every image with the spec's model (loaded once, on CUDA when here)."""
    from pipelines.calibration import image_entropies
    from promprune.models import PrunedVLM

    base = spec.model.load(method=None, budget=None)

    def factory(metric):
        return PrunedVLM(base.model, base.processor, method="promprune", budget=budget, metric=metric,
                         **spec.model.options)

    return image_entropies(factory, list(METRICS), images, spec.resources.batch_size)


def table(requests: list, ratings: list, values: dict[str, list[float]]):
    import pandas as pd

    rows = [{"task": q.task, "doc_id": q.doc_id, "rating": r.rating,
             **{m: values[m][i] for m in METRICS},
             "judge_reply": r.reply, "judge_error": r.error, "answered_by": r.answered_by, "image_sha": r.image_sha}
            for i, (q, r) in enumerate(zip(requests, ratings))]
    frame = pd.DataFrame(rows)
    frame["rating"] = frame["rating"].astype("Int64")
    return frame


def no_rating_message(ratings: list) -> str:
    """Why no image has a rating: the failed requests (the last one's error) and the replies without a score."""
    failed = [r for r in ratings if r.error is not None]
    unparsable = [r for r in ratings if r.error is None]
    parts = [f"{len(failed)} judge request(s) failed (the last: {failed[-1].error})"] if failed else []
    parts += [f"{len(unparsable)} repl{'y' if len(unparsable) == 1 else 'ies'} held no 1-5 score (e.g. "
              f"{(unparsable[0].reply or '')[:80]!r}: is --judge-model a vision model that follows the prompt?)"] \
        if unparsable else []
    return f"none of the {len(ratings)} images got a rating, so there is no figure to draw: {'; '.join(parts)}"


def log_outputs(client, run_id: str, frame, out: Path, spec, judge) -> tuple[Path | None, str]:
    """CSV, per-rating table, figure and report.md into ``out`` and onto the run; the metrics. Returns the figure's
    path in ``out`` (None: no figure) and report.md's text. Written first into a staging folder of this run's own
    (`paths.staging_folder`) and logged from there, then copied into ``out`` (`paths.publish`): two runs sharing the
    default ``reports/<spec name>/`` each log their own files (one logged the other's per-rating table and report)."""
    from pipelines.recording import tracking
    from pipelines.reporting import concentration

    with paths.staging_folder(out) as staging:
        frame.to_csv(staging / TABLE_NAME, index=False)
        summary = concentration.summary(frame)
        summary.to_csv(staging / SUMMARY_NAME)
        figure = concentration.figure(frame, staging / FIGURE_NAME,
                                      title=f"{spec.model.pretrained}, judge {judge.model}, {len(frame)} images")
        text = concentration.markdown(frame, FIGURE_NAME if figure else None, model=spec.model.pretrained,
                                      judge=judge.model, tasks=list(spec.tasks))
        (staging / "report.md").write_text(text)
        client.log_artifact(run_id, str(staging / TABLE_NAME))
        report = [SUMMARY_NAME, "report.md"] + ([FIGURE_NAME] if figure else [])
        for name in report:
            client.log_artifact(run_id, str(staging / name), mlflow_layout.REPORT_DIR)
        paths.publish([staging / name for name in [TABLE_NAME, *report]], staging, out)
    metrics = {f"fig2/spearman/{m}": v for m, v in concentration.correlations(frame).items()}
    for r in summary.index:
        metrics[f"fig2/n/rating_{r}"] = float(summary.loc[r, "n"])  # plain floats: numpy scalars are not logged
        metrics.update({f"fig2/{m}/rating_{r}": float(summary.loc[r, f"{m}_mean"]) for m in METRICS})
    tracking.log_metrics(client, run_id, metrics)
    return (out / FIGURE_NAME if figure else None), text


def run(spec, judge, budget: int, args: argparse.Namespace) -> int:
    from pipelines.recording import tracking
    from promprune.eval.generation import decode_image

    client = tracking.client()
    experiment = tracking.experiment_id(client)
    cache_path = rating_cache_path(args, spec)
    found, source_run = previous_cache(client, experiment, spec.name)
    cache = judging.RatingCache.load(cache_path).merge(found)
    print(f"rating cache: {len(cache)} ratings ({cache_path}"
          f"{', and run ' + source_run + ' in MLflow' if source_run else ''})", flush=True)

    requests = [q for task in spec.tasks for q in sample_requests(task, spec.limit, spec.calibration.seed)]
    broken = [q for q in requests if q.error]
    requests = [q for q in requests if not q.error]
    for q in broken:
        print(f"skipped {q.task} doc {q.doc_id}: {q.error}", file=sys.stderr)
    items = [(q.task, q.doc_id, q.image) for q in requests]
    if judging.uncached(judge, cache, items):  # the judge is asked, so it must answer (a cached rerun asks nothing)
        problems = preflight.check_concentration_judge(judge)
        if problems:
            print(f"error: {specs.SpecError(problems, args.config)}", file=sys.stderr)
            return EXIT_BAD_INPUT
    started = time.time()
    run_id = client.create_run(experiment, run_name=spec.name, tags={
        mlflow_layout.ROLE: ROLE_FIGURE, mlflow_layout.SWEEP: spec.name, mlflow_layout.VERSION: str(spec.version),
        mlflow_layout.STARTED_AT: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}).info.run_id
    client.log_text(run_id, specs.dump_resolved(spec), mlflow_layout.SPEC_ARTIFACT)
    params = {"model": spec.model.pretrained, "tasks": ",".join(spec.tasks), "n_per_task": spec.limit,
              "seed": spec.calibration.seed, "budget": budget, "judge_model": judge.model,
              "judge_url": judge.url.split("?")[0], "prompt_sha256": judge.prompt_sha, "cache_from_run": source_run}
    for key, value in params.items():
        client.log_param(run_id, key, str(value))
    status, code = "FAILED", EXIT_JUDGE_FAILED
    try:
        print(f"rating {len(requests)} images with {judge.model} at {judge.url.split('?')[0]}", flush=True)
        ratings = judging.rate_images(judge, cache, items,
                                      workers=args.judge_workers, on_new=lambda _: cache.save(cache_path))
        if ratings and all(r.rating is None for r in ratings):  # nothing to plot: not a figure, a failure
            raise judging.JudgeError(no_rating_message(ratings))
        print(f"measuring the entropies with {spec.model.pretrained}", flush=True)
        images = [decode_image(q.image, f"{q.task} doc {q.doc_id}") for q in requests]
        values = entropies(spec, budget, images)
        frame = table(requests, ratings, values)
        out = out_dir(args, spec)
        figure, text = log_outputs(client, run_id, frame, out, spec, judge)
        counts = {"judge/cached": sum(r.cached for r in ratings),
                  "judge/unparsable": sum(r.rating is None and r.error is None for r in ratings),
                  "judge/failed": sum(r.error is not None for r in ratings), "samples/images": len(requests),
                  "samples/skipped": len(broken)}
        tracking.log_metrics(client, run_id, counts)
        print(text)  # this run's (another run may have written the folder since)
        print(f"judge requests: {judge.requests_sent} ({counts['judge/cached']} of {len(requests)} ratings from the "
              f"cache); files in {out.resolve()}{' (figure: ' + str(figure) + ')' if figure else ''}; "
              f"MLflow run {run_id}")
        status, code = "FINISHED", 0
    except judging.JudgeAuthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        client.set_tag(run_id, mlflow_layout.ERROR, str(exc)[:4000])
        code = EXIT_BAD_INPUT
    except judging.JudgeError as exc:
        print(f"error: {exc}\n(the ratings made so far are cached: rerun to continue)", file=sys.stderr)
        client.set_tag(run_id, mlflow_layout.ERROR, str(exc)[:4000])
    finally:  # the cache goes up whatever happened: what was paid for is never asked again
        cache.save(cache_path)
        with tempfile.TemporaryDirectory() as d:
            client.log_artifact(run_id, str(cache.save(Path(d) / CACHE_NAME)), CACHE_ARTIFACT_DIR)
        tracking.log_metrics(client, run_id, {"judge/requests": judge.requests_sent})
        client.set_terminated(run_id, status=status)
    return code


def main(argv: list[str] | None = None) -> int:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    try:
        spec, judge, budget = setup(args)
    except specs.SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run(spec, judge, budget, args)


if __name__ == "__main__":
    sys.exit(main())
