"""MLflow runs in the schema of `pipelines.mlflow_layout` (pipelines/report.py reads exactly that), written directly
(the client, the parent run, a whole run at once, a standalone evaluation's run) and read back (a sweep's trial runs,
the nightly regression check). A sweep's trial runs are written through `pipelines.recording.recorder` instead.

Only the driver process writes; trials hand their results back through Ray Tune.
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from pipelines import mlflow_layout
from pipelines.mlflow_layout import (  # noqa: F401 - re-exported
    ROLE, SWEEP, TRIAL, VERSION, client, tracking_uri, ui_command)
from pipelines.recording.view import SweepView, save_sweep_view
from pipelines.run.state import dead_runs, resume_command, spec_changes, spec_fingerprint, without_gained_defaults




def experiment_id(c) -> str:
    """The experiment's id (created on first use, a SQLite store's with its artifacts beside the database file),
    marked as a model-development experiment so MLflow 3's UI opens it on its runs rather than on the GenAI
    overview."""
    from mlflow.exceptions import MlflowException

    name = mlflow_layout.experiment_name()
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        exp_id = exp.experiment_id
    else:
        try:
            exp_id = c.create_experiment(name, artifact_location=mlflow_layout.artifact_location(c.tracking_uri))
        except MlflowException:  # another run made it since the lookup (two starting at once on a new store)
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
            exp_id = exp.experiment_id
    if exp is None or exp.tags.get(mlflow_layout.EXPERIMENT_KIND) != mlflow_layout.MODEL_DEVELOPMENT:
        c.set_experiment_tag(exp_id, mlflow_layout.EXPERIMENT_KIND, mlflow_layout.MODEL_DEVELOPMENT)
    return exp_id


# ----------------------------------------------------------------------------------------------------------------
# parent runs


def start_sweep(c, name: str, version: int, resolved_yaml: str, params: dict, started: float | None = None,
                view: SweepView | None = None) -> str:
    """The sweep's parent run and its own saved view (``view``: what the view shows beyond the headline metrics);
    ``started`` (epoch seconds): when the sweep began (setup included). Tagged with the resolved spec's fingerprint
    (`spec_fingerprint`), which the nightly regression check matches."""
    run = c.create_run(experiment_id(c), run_name=name, start_time=_ms(started),
                       tags={ROLE: mlflow_layout.ROLE_SWEEP, SWEEP: name, VERSION: str(version),
                             mlflow_layout.SPEC_FINGERPRINT: spec_fingerprint(resolved_yaml),
                             mlflow_layout.STARTED_AT: iso(started or time.time())})
    run_id = run.info.run_id
    c.set_tag(run_id, mlflow_layout.SWEEP_RUN, run_id)  # the saved view's filter: this run and its trials
    c.log_text(run_id, resolved_yaml, mlflow_layout.SPEC_ARTIFACT)
    for key, value in params.items():
        c.log_param(run_id, key, _param(value))
    tasks = params.get("tasks", [])
    view = view or SweepView(tasks.split(",") if isinstance(tasks, str) else list(tasks))
    save_sweep_view(c, run.info.experiment_id, name, run_id, view)
    return run_id


def ui_url(sweep: str | None = None, run_id: str | None = None) -> str | None:
    """The page to open in `mlflow ui`: the experiment's runs (``run_id``'s experiment, else `experiment_name`'s; the
    saved view of the run ``run_id``, a parent run, of sweep ``sweep`` when both are given and the view is there: not
    another run's of the same sweep); None when the store has no such experiment or run (or does not answer)."""
    from mlflow.exceptions import MlflowException

    try:
        c = client()
        # the run's own experiment (a --resume under another MLFLOW_EXPERIMENT_NAME continues the run where it is)
        exp = (c.get_experiment(c.get_run(run_id).info.experiment_id) if run_id else
               c.get_experiment_by_name(mlflow_layout.experiment_name()))
    except (MlflowException, OSError):  # a hint to print, never a reason to fail
        return None
    if exp is None:
        return None
    key = mlflow_layout.view_key(sweep, run_id) if sweep and run_id else None
    return mlflow_layout.ui_url(exp.experiment_id, key if key and mlflow_layout.SAVED_VIEW + key in exp.tags else None)


def interrupted_note(resume: str) -> str:
    """The `mlflow_layout.INTERRUPTED` tag of a run the sweep left unfinished when it stopped before its end."""
    return f"the sweep stopped before its end; resume with: {resume}"


def finish(c, run_id: str, status: str = "FINISHED") -> None:
    c.set_tag(run_id, mlflow_layout.FINISHED_AT, iso(time.time()))
    c.set_terminated(run_id, status=status)


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


def iso(seconds: float) -> str:
    from datetime import datetime, timezone

    # milliseconds: a trial shorter than a second still has its start before its end
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")


def reopen(c, run_id: str, sweep: str | None = None, view: SweepView | None = None) -> None:
    """A resumed sweep keeps its parent run: mark it running again, without the `promprune.interrupted` tag that the
    start of another run of the sweep may have set while its driver was dead (`mark_dead_runs`); with ``sweep`` and
    ``view``, save its view again (`save_sweep_view`: the same key, back if later runs of the sweep removed it, and
    there for a run started before views were saved per run)."""
    c.update_run(run_id, status="RUNNING")
    run = c.get_run(run_id)
    if mlflow_layout.INTERRUPTED in run.data.tags:
        c.delete_tag(run_id, mlflow_layout.INTERRUPTED)
    if sweep is not None and view is not None:
        save_sweep_view(c, run.info.experiment_id, sweep, run_id, view)


def mark_dead_runs(client, storage: str, name: str, keep: str | None = None) -> list[str]:
    """Parent runs of sweep `name` still RUNNING in MLflow although their driver died (`pipelines.run.state.dead_runs`):
    mark them, and the trial runs they left RUNNING, KILLED with a tag saying so, so the MLflow UI does not show them
    as live (a `--resume` of that run opens its unfinished trials' runs again). ``keep``: the experiment being resumed
    (its runs are continued, not marked). Returns their experiments."""
    from mlflow.exceptions import MlflowException

    marked = []
    for experiment, state in dead_runs(storage, name, keep):
        try:
            run = client.get_run(state["parent_run_id"])
        except MlflowException:  # a run deleted from the store, another store: nothing to mark
            continue
        if run.info.status == "RUNNING":
            why = (f"driver pid {state['driver']['pid']} on {state['driver']['host']} died without finishing; "
                   f"resume with: {resume_command(state)}")
            children = [r for r in latest_trial_runs(client, run.info.run_id).values() if r.info.status == "RUNNING"]
            for r in [run, *children]:
                client.set_tag(r.info.run_id, mlflow_layout.INTERRUPTED, why)
                finish(client, r.info.run_id, status="KILLED")
            marked.append(experiment)
    return marked


# ----------------------------------------------------------------------------------------------------------------
# child runs


def trial_runs(c, parent_id: str) -> dict[str, Any]:
    """{trial id: latest FINISHED child run} of a parent run."""
    runs = c.search_runs([c.get_run(parent_id).info.experiment_id],
                         filter_string=mlflow_layout.tag_filter(mlflow_layout.PARENT, parent_id), max_results=5000,
                         order_by=["attributes.start_time ASC"])
    return {r.data.tags.get(TRIAL): r for r in runs if r.info.status == "FINISHED"}


def latest_trial_runs(c, parent_id: str) -> dict[str, Any]:
    """{trial id: its latest child run of a parent run, whatever its status} (a resumed sweep continues the runs its
    unfinished trials left)."""
    runs = c.search_runs([c.get_run(parent_id).info.experiment_id],
                         filter_string=mlflow_layout.tag_filter(mlflow_layout.PARENT, parent_id), max_results=5000,
                         order_by=["attributes.start_time ASC"])
    return {r.data.tags.get(TRIAL): r for r in runs}


def own_primary_metrics(spec) -> dict[str, str]:
    """The parent param `mlflow_layout.PRIMARY_PARAM` of ``spec`` (a `SweepSpec`): the metric each of its tasks that
    `promprune.eval.tasks.PRIMARY_METRICS` does not name is scored by (its YAML's first), which the report's columns
    use; {} where every task is named there."""
    from promprune.eval.tasks import own_primary_metrics as of_tasks

    own = {task: list(metrics) for task, metrics in of_tasks(spec.tasks, spec.include_path).items()}
    return {mlflow_layout.PRIMARY_PARAM: json.dumps(own, sort_keys=True)} if own else {}


def model_params(spec, on_gpu: bool) -> dict[str, str]:
    """What the workers of ``spec`` (a `SweepSpec`) run, as params: the dtype (``dtype: auto`` resolved as the workers
    resolve it for the plan's device, `weights.resolve_dtype`), the LLM attention and the spec's adapter options
    (``model.options``, JSON with sorted keys: the report matches an earlier sweep's mu calibration on them). The
    same values on a sweep's parent run and on each of its trial runs (`trial_params`)."""
    from pipelines.weights import resolve_dtype

    return {mlflow_layout.DTYPE_PARAM: resolve_dtype(spec.model.dtype, on_gpu),
            mlflow_layout.ATTENTION_PARAM: spec.model.attn_implementation,
            mlflow_layout.MODEL_OPTIONS_PARAM: json.dumps(spec.model.options, sort_keys=True)}


def trial_params(model: str, trial: dict, tasks: list[str], resolved: dict[str, str]) -> dict[str, str]:
    """A trial run's params: the model, method (`none` = unpruned), budget, tasks, repeat, every option of the trial
    and ``resolved``, what the workers ran (`model_params`: dtype, attention, adapter options)."""
    params = {"model": model, "method": trial["method"] or mlflow_layout.BASELINE_METHOD,
              "budget": "none" if trial["budget"] is None else trial["budget"], "tasks": ",".join(tasks),
              "repeat": trial.get("repeat", 0)}
    params.update(trial.get("options") or {})
    params.update(resolved)
    return {k: _param(v) for k, v in params.items()}


def log_trial(c, parent_id: str, sweep: str, version: int, trial: dict, params: dict, metrics: dict,
              predictions: str | Path | None, status: str = "FINISHED", error: str | None = None,
              span: tuple[float, float] | None = None, tags: dict | None = None) -> str:
    """One child run of a sweep: tags, params, finite metrics, the predictions.parquet file; returns its run id.

    ``span``: the trial's (start, end) in epoch seconds, so the run shows the trial's real duration. ``tags``: more
    tags (a stopped trial's `promprune.stopped`)."""
    tags = {mlflow_layout.PARENT: parent_id, mlflow_layout.SWEEP_RUN: parent_id, ROLE: mlflow_layout.ROLE_TRIAL,
            SWEEP: sweep, TRIAL: trial["trial_id"], VERSION: str(version), **(tags or {})}
    if error:
        tags[mlflow_layout.ERROR] = error[:4000]  # MLflow caps tag values; the full trace is in Ray's logs
    return log_run(c, c.get_run(parent_id).info.experiment_id, trial["trial_id"], tags, params, metrics,
                   predictions, status, span)


def log_run(c, experiment: str, name: str, tags: dict, params: dict, metrics: dict,
            predictions: str | Path | None, status: str = "FINISHED", span: tuple[float, float] | None = None) -> str:
    """Create a run with its tags, params, finite metrics and predictions artifact, then end it (at ``span``'s
    start and end when given, else now).

    ``predictions``: a file named `predictions.parquet` (a trial's `TrialResult` file, its Tune checkpoint),
    uploaded as it is."""
    if predictions is not None and Path(predictions).name != mlflow_layout.PREDICTIONS_ARTIFACT:
        raise ValueError(f"predictions: {predictions} must be named {mlflow_layout.PREDICTIONS_ARTIFACT} (the artifact "
                         "name the reports read)")
    if span is not None:
        tags = {**tags, mlflow_layout.STARTED_AT: iso(span[0]), mlflow_layout.FINISHED_AT: iso(span[1])}
    run_id = c.create_run(experiment, run_name=name, tags=tags, start_time=_ms(span and span[0])).info.run_id
    for key, value in params.items():
        c.log_param(run_id, key, value)
    log_metrics(c, run_id, metrics)
    if predictions is not None:
        c.log_artifact(run_id, str(predictions))
    c.set_terminated(run_id, status=status, end_time=_ms(span and span[1]))
    return run_id


def log_metrics(c, run_id: str, metrics: dict, step: int = 0) -> None:
    """Finite numeric metrics only (NaN means "not measured", e.g. no entropy for the unpruned model); ``step``:
    where in a metric's history they go (a search's running values: the samples they were computed over)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, int(step)) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
    if batch:
        c.log_batch(run_id, metrics=batch)


def _param(v: Any) -> str:
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, sort_keys=True)
    return str(v)


# ----------------------------------------------------------------------------------------------------------------
# nightly regression check


def previous_sweep(c, name: str, version: int, current_id: str, fingerprint: str, spec=None):
    """The latest FINISHED parent run of sweep ``name`` started before ``current_id`` that ran the same resolved spec
    (its `promprune.spec_fingerprint` tag is ``fingerprint``; or, given the current ``spec``, its `spec.yaml` is
    ``spec`` as the code resolved it before gaining fields that ``spec`` holds at their defaults,
    `state.without_gained_defaults`: a night recorded before ``resources.load_timeout_s`` existed, said in the line;
    any other difference is another spec), whose trials all finished (no `trials/failed`) and that did not regress
    (its `promprune.regression` tag is not ``true``: the baseline stays the last good night) and some finished trial
    of which has a Rel. (`rel_by_trial`: a night whose task scored NaN, or whose baseline scored 0, has none logged,
    and as a baseline it compared nothing; a night where only some trials lack one stays a baseline for the others,
    so that a trial that never gets a Rel. does not turn the check off for every trial), or None; with the line
    saying what the check compares with, or why it compares with nothing. Matching the name and
    version alone made a ``--set limit=20`` quick check (which sweeps/nightly.yaml suggests) the baseline of the next
    500-question night: false regressions, or masked ones. A parent run logged before runs carried the tag does not
    match (said in the line). Nor does one that ran in another dtype (param ``dtype``: ``dtype: auto`` resolved,
    float32 on CPU workers, bfloat16 on GPU ones, under the same fingerprint), said in the line too."""
    current = c.get_run(current_id)
    same = [mlflow_layout.tag_filter(ROLE, mlflow_layout.ROLE_SWEEP), mlflow_layout.tag_filter(SWEEP, name),
            mlflow_layout.tag_filter(VERSION, str(version)), "attributes.status = 'FINISHED'",
            f"attributes.start_time < {current.info.start_time}"]
    exp = [current.info.experiment_id]
    earlier = c.search_runs(exp, " and ".join(same), order_by=["attributes.start_time DESC"], max_results=1000)
    # fingerprint -> the fields the code gained since, at their defaults in this run: the same experiment
    gained = {fingerprint: []} | (_gained_since(c, spec, earlier, fingerprint) if spec is not None else {})
    found = [r for r in earlier if r.data.tags.get(mlflow_layout.SPEC_FINGERPRINT) in gained]
    # `dtype: auto` resolves by device (bfloat16 on GPU, float32 on CPU) under one fingerprint: a run in another
    # dtype is no baseline (a run that did not record its dtype, logged before parent runs did, is not told apart)
    dtype = current.data.params.get(mlflow_layout.DTYPE_PARAM)
    other_dtype = [r for r in found
                   if dtype is not None and r.data.params.get(mlflow_layout.DTYPE_PARAM, dtype) != dtype]
    found = [r for r in found if r not in other_dtype]
    others = f"{', '.join(sorted({r.data.params[mlflow_layout.DTYPE_PARAM] for r in other_dtype}))}, this one {dtype}"
    in_other = f"; {len(other_dtype)} run(s) of it ran in another dtype ({others}) and are not compared with" \
        if other_dtype else ""
    # a run whose trials failed ends FINISHED too (exit 1), without their Rel.: as the next one's baseline, it
    # compared nothing for them (a failed night let the following night's regression pass). A run that regressed
    # (exit 3, tagged promprune.regression=true) is no baseline either: as one, its fallen Rel. let the next night
    # pass, so a regression failed one night only. Its tag set to anything else (`accepted`) makes it one again.
    # A run none of whose trials has a Rel. (a task's score NaN, a baseline score of 0: Rel. undefined, not logged)
    # is no baseline either: as one, it compared no trial, and the next night was tagged false. One with a Rel. for
    # some trials is (the others are not compared, and said: `regression_check`). Looked at (one search per run) only
    # until the baseline is found.
    failed, regressed, unscored, prev = [], [], [], None
    for r in found:
        if r.data.metrics.get(mlflow_layout.TRIALS_FAILED):
            failed.append(r)
        elif r.data.tags.get(mlflow_layout.REGRESSION) == "true":
            regressed.append(r)
        elif not rel_by_trial(c, r.info.run_id):
            unscored.append(r)
        else:
            prev = r
            break
    passed = [(runs, why) for runs, why in ((failed, "had failed trials"),
                                            (regressed, f"regressed (tag {mlflow_layout.REGRESSION}=true)"),
                                            (unscored, "had no trial with a Rel. (a score NaN, or a baseline score "
                                                       "of 0)")) if runs]
    if prev is not None:
        over = "".join(f"; {len(runs)} later run(s) of it {why} and are not compared with" for runs, why in passed)
        over += in_other
        since = gained[prev.data.tags[mlflow_layout.SPEC_FINGERPRINT]]
        if since:
            over += (f"; it was recorded before the code had {', '.join(since)}, which this run holds at the default "
                     "(what the code did before)")
        return prev, (f"compared with {prev.info.run_id} (started {iso(prev.info.start_time / 1000)}), the latest "
                      f"earlier FINISHED run of the same resolved spec of sweep {name} v{version} whose trials all "
                      f"finished{' with a Rel. for some' if unscored else ''}"
                      f"{' and that did not regress' if regressed else ''}"
                      f"{over}")
    if found:
        return None, (f"the {len(found)} earlier FINISHED run(s) of the same resolved spec of sweep {name} "
                      f"v{version} all {' or '.join(why for _, why in passed)}: nothing to compare with{in_other}")
    if other_dtype:
        return None, (f"the {len(other_dtype)} earlier FINISHED run(s) of the same resolved spec of sweep {name} "
                      f"v{version} ran in another dtype ({others}; dtype auto resolves by the device the workers run "
                      "on): nothing to compare with")
    if not earlier:
        return None, f"no earlier FINISHED run of sweep {name} v{version} in this experiment"
    untagged = [r for r in earlier if mlflow_layout.SPEC_FINGERPRINT not in r.data.tags]
    other = [r for r in earlier if mlflow_layout.SPEC_FINGERPRINT in r.data.tags]
    parts = []
    if other:
        changes = _spec_changes(c, other[0].info.run_id, current_id)
        parts.append(f"{len(other)} ran another resolved spec (the latest, {other[0].info.run_id}"
                     + (f": {'; '.join(changes[:3])}{' ...' if len(changes) > 3 else ''}" if changes else "") + ")")
    if untagged:
        parts.append(f"{len(untagged)} logged before parent runs recorded their spec's fingerprint, so they cannot "
                     "be told to be the same spec")
    return None, (f"none of the {len(earlier)} earlier FINISHED run(s) of sweep {name} v{version} ran this resolved "
                  f"spec: {'; '.join(parts)}")


def _gained_since(c, spec, runs: list, fingerprint: str) -> dict[str, list[str]]:
    """The fingerprints of ``runs`` (parent runs) other than ``fingerprint`` under which ``spec`` ran before the code
    gained fields it holds at their defaults (`without_gained_defaults`), each with those fields. One `spec.yaml` read
    per fingerprint (its latest run's); one that cannot be read matches nothing."""
    out = {}
    for tag in dict.fromkeys(r.data.tags.get(mlflow_layout.SPEC_FINGERPRINT) for r in runs):
        if tag is None or tag == fingerprint:
            continue
        run = next(r for r in runs if r.data.tags.get(mlflow_layout.SPEC_FINGERPRINT) == tag)
        text = mlflow_layout.spec_text(c, run.info.run_id)
        older = without_gained_defaults(spec, text) if text is not None else None
        if older is not None and spec_fingerprint(older[0]) == tag:
            out[tag] = older[1]
    return out


def _spec_changes(c, before_id: str, now_id: str) -> list[str]:
    """The fields in which two parent runs' resolved specs (their `spec.yaml` artifacts) differ; [] when either
    cannot be read (the line then only says that they differ)."""
    texts = [mlflow_layout.spec_text(c, run_id) for run_id in (before_id, now_id)]
    return [] if None in texts else spec_changes(*texts)


def rel_by_trial(c, parent_id: str) -> dict[str, float]:
    """Each finished trial's Rel. by trial id, of the trials that logged one (a NaN one is not logged)."""
    return _rels(trial_runs(c, parent_id))


def _rels(runs: dict) -> dict[str, float]:
    return {tid: r.data.metrics[mlflow_layout.REL] for tid, r in runs.items() if mlflow_layout.REL in r.data.metrics}


def regression_check(c, parent_id: str, name: str, version: int, threshold: float,
                     fingerprint: str, spec=None) -> tuple[list[str], str]:
    """Compare every trial's Rel. with the previous night's run of the same resolved spec (``fingerprint``; given
    ``spec``, also one recorded before the code gained fields ``spec`` holds at their defaults: `previous_sweep`); tag
    the parent run; return the regressions and the line saying what was compared with (or why nothing was).

    A regression is a trial whose Rel. fell by more than `threshold` (absolute, e.g. 0.02 = 2 points of Rel.).
    Tags: promprune.regression = true/false/no-previous, or incomplete (no regression among the trials compared, and
    some trial has a Rel. in one of the two runs and not in the other: not compared, and named in the line; so a
    check that compared no trial is this, never false; a trial finished in both with a Rel. in neither is named in the
    line too, and leaves the tag to the others), promprune.regression.previous_run, ...threshold,
    ...detail (the regressions), ...note (the line); the parent's promprune.spec_fingerprint when it had none (a run
    started before runs carried it, resumed).
    """
    c.set_tag(parent_id, mlflow_layout.SPEC_FINGERPRINT, fingerprint)
    prev, note = previous_sweep(c, name, version, parent_id, fingerprint, spec)
    c.set_tag(parent_id, f"{mlflow_layout.REGRESSION}.note", note[:4000])
    c.set_tag(parent_id, f"{mlflow_layout.REGRESSION}.threshold", str(threshold))
    if prev is None:
        c.set_tag(parent_id, mlflow_layout.REGRESSION, "no-previous")
        return [], note
    runs_now, runs_before = trial_runs(c, parent_id), trial_runs(c, prev.info.run_id)
    now, before = _rels(runs_now), _rels(runs_before)
    found = [f"{tid}: rel {before[tid]:.4f} -> {now[tid]:.4f} ({now[tid] - before[tid]:+.4f})"
             for tid in sorted(set(now) & set(before)) if before[tid] - now[tid] > threshold]
    lost = sorted(set(before) - set(now))  # failed (or not run, or NaN) this time: not compared, and said
    gained = sorted(set(now) - set(before))  # without a Rel. in the baseline: not compared either
    # finished in both runs with a Rel. in neither (a score NaN both nights): not compared, and said; the tag stays
    # what the others' comparison makes it (such a trial would otherwise keep every night `incomplete`)
    neither = sorted((set(runs_now) & set(runs_before)) - set(now) - set(before))
    for trials, how in ((lost, "of that run have no Rel. in this one"),
                        (gained, "of this run had no Rel. in that one"),
                        (neither, "have a Rel. in neither run")):
        if trials:
            note += (f"; {len(trials)} trial(s) {how}, so were not compared: "
                     f"{', '.join(trials[:5])}{' ...' if len(trials) > 5 else ''}")
    if lost or gained or neither:
        c.set_tag(parent_id, f"{mlflow_layout.REGRESSION}.note", note[:4000])
    c.set_tag(parent_id, f"{mlflow_layout.REGRESSION}.previous_run", prev.info.run_id)
    c.set_tag(parent_id, mlflow_layout.REGRESSION, "true" if found else "incomplete" if lost or gained else "false")
    if found:
        c.set_tag(parent_id, f"{mlflow_layout.REGRESSION}.detail", "; ".join(found)[:4000])
    return found, note


# ----------------------------------------------------------------------------------------------------------------
# standalone evaluations (pipelines/evaluate.py)


def log_evaluation(spec, trial, result, on_gpu: bool) -> str:
    """One run (role `evaluation`, no parent) for a single `pipelines/evaluate.py` call: ``trial`` (the one `Trial` of
    its one-trial ``spec``) and its `TrialResult`, written to `predictions.parquet` once and uploaded; ``on_gpu``:
    whether its workers ran on GPUs (the dtype `dtype: auto` resolved to, `model_params`)."""
    c = client()
    tid = trial.trial_id
    params = trial_params(spec.model.pretrained, trial.to_dict(), spec.tasks, model_params(spec, on_gpu))
    with tempfile.TemporaryDirectory() as d:
        path = result.write(Path(d) / mlflow_layout.PREDICTIONS_ARTIFACT)
        return log_run(c, experiment_id(c), tid, {ROLE: mlflow_layout.ROLE_EVALUATION, TRIAL: tid}, params,
                       result.metrics, path)
