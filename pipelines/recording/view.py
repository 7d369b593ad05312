"""A sweep's saved view of the MLflow runs page (`SweepView`, `save_sweep_view`): which columns, widths and charts
the UI opens on for the runs of one run of a sweep; `pipelines.recording.tracking.start_sweep` saves it with the
parent run (`tracking.reopen` again on a resume), one view per parent run, so two runs of a sweep at once (the
nightly and a manual run) each keep their own; `prune_views` keeps the latest `VIEWS_KEPT` of a sweep."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from pipelines import mlflow_layout
from pipelines.mlflow_layout import ROLE
from pipelines.spec import space


def primary_metrics(tasks: list[str]) -> list[str]:
    """Each task's primary metric(s) (what Rel. uses), as MLflow metric keys."""
    from promprune.eval.tasks import primary_metrics as of_task

    return [f"{t}/{m}" for t in tasks for m in of_task(t)]


VISUAL_TOKENS = "efficiency/visual_tokens"
NAME_COLUMN, CREATED_COLUMN, DURATION_COLUMN = "attributes.`Run Name`", "runDateAndNestInfo", "duration"
CHAR_PX, CELL_PX = 8, 24  # MLflow's table: up to 8 px a character of its 13 px font, and a cell's padding
NAME_CHAR_PX = 6.5  # a run name's characters (mostly narrow ones: digits, '-', '='), beside its colour dot
MAX_OPTION_COLUMNS = 8  # options shown as columns (mu and tau first); more make the table unreadable
SEARCHED_VALUE_CHARS = space.SIGNIFICANT + 3  # a sampled float in a trial name, e.g. 0.06509 (its id's digits)
VIEWS_KEPT = 10  # a sweep's saved views kept (its latest runs'; a running run's is never removed): a nightly's
# one-a-day views would fill the "Views" menu


@dataclass
class SweepView:
    """What a sweep's saved view shows: its tasks' headline metrics, Rel. and visual tokens, and

    - ``options``: the method options its trials set or its search varies (params, as columns after method and
      budget; mu and tau first);
    - ``running``: a scheduler's metric, whose running value (``running/<metric>``) stopped trials carry;
    - ``best``: the metric whose best trial the parent holds (``best/<metric>``: a sweep's only (mu, tau) search);
    - ``name_chars``: the longest trial name expected (the run-name column is sized to show it whole)."""

    tasks: list[str]
    options: list[str] = field(default_factory=list)
    running: str | None = None
    best: str | None = None
    name_chars: int = 40

    @classmethod
    def of(cls, spec, trials: list) -> "SweepView":
        """The view of ``spec``'s sweep; ``trials``: the trials known before it starts (`pipelines.spec.expand`)."""
        searched = [k for k in spec.grid if k not in ("method", "budget")] if spec.tune.search != "grid" else []
        seen = list(dict.fromkeys([k for t in trials for k in t.options] + searched))
        options = ([k for k in mlflow_layout.MU_TAU if k in seen] + [k for k in seen if k not in mlflow_layout.MU_TAU])
        longest = max([len(t.trial_id) for t in trials] + [0])
        if searched:  # a trial optuna chose: method-b<budget>-<option>=<sampled value>...
            listed = spec.grid.get("method")
            methods = [m for m in listed if isinstance(m, str)] if isinstance(listed, list) else []
            methods = methods or ["promprune"]
            longest = max(longest, max(map(len, methods)) + 5 + sum(len(k) + 2 + SEARCHED_VALUE_CHARS
                                                                     for k in searched))
        # the parent's best (`console.parent_best`): a sweep's only (mu, tau) search, among trials alike in all else
        # (Fig. 4's per-metric calibrated mus are none), or one optuna searches
        one_search = len(mlflow_layout.trial_searches({i: (t.method, t.budget, t.tasks or spec.tasks, t.options)
                                                       for i, t in enumerate(trials)})) == 1
        varies_split = one_search or any(k in mlflow_layout.MU_TAU for k in searched)
        return cls(list(spec.tasks), options[:MAX_OPTION_COLUMNS],
                   running=spec.tune.metric if spec.tune.scheduler != "none" else None,
                   best=spec.tune.metric if varies_split else None, name_chars=min(longest, 80))


def _width(header: str, lo: int, hi: int = 220) -> int:
    """A column wide enough for its header, within [lo, hi] (a metric shows all its digits, cut at the column's
    edge, the whole value in its tooltip: ``lo`` keeps 4 or 5 of them)."""
    return max(lo, min(hi, CHAR_PX * len(header) + CELL_PX))


def save_sweep_view(c, exp_id: str, sweep: str, run_id: str, view: SweepView) -> str:
    """Save the runs-page view of one run of a sweep, its parent run ``run_id``, in the experiment (MLflow 3's
    "Views" menu, named ``<sweep> <run's start, UTC> <run id's first 8>``; ``ui_url`` opens it), then remove the
    sweep's views beyond its latest `VIEWS_KEPT` (`prune_views`). Returns the view's key (`mlflow_layout.view_key`:
    the sweep's name and ``run_id``, so another run of the sweep saving its own at the same time leaves this one as
    it is). Saving it again (a resume) keeps its creation time, which orders the pruning. Rows: the parent run
    ``run_id`` first, then its trials, newest first. Columns: run name (wide enough for the trials' ids) and created
    (with the run's status), then Rel., visual tokens, method, budget and the options (all on a 1400 px screen for
    ids up to ~40 characters), the scheduler's running value, the parent's best, each task's primary metric,
    duration. Line charts: against ``samples/scored`` (the samples a running value was computed over), so the axis
    says so instead of MLflow's "Step".

    What MLflow 3.17's UI allows, read from its bundle (`mlflow/server/js/build`): the state holds the search facets
    and the table's columns, order and widths, grouping and chart settings, not expanded rows (a nested parent
    would hide its trials) and no number format (metrics show all their digits). Sorting by the role tag instead of
    the start time keeps the rows flat: the parent (role `sweep`) sorts before its trials (role `trial`), which
    MLflow orders newest first."""
    params = ["method", "budget"] + [o for o in view.options if o not in ("method", "budget")]
    trailing = ([f"{mlflow_layout.RUNNING}/{view.running}"] if view.running else []) + \
        ([f"best/{view.best}"] if view.best else []) + primary_metrics(view.tasks)  # (best: the parent's)
    widths = {NAME_COLUMN: max(200, min(600, int(NAME_CHAR_PX * view.name_chars) + 60))}
    widths |= {f"metrics.`{mlflow_layout.REL}`": 90, f"metrics.`{VISUAL_TOKENS}`": 150}
    widths |= {f"params.`{p}`": _width(p, 100 if p == "method" else 80, 160) for p in params}
    widths |= {f"metrics.`{m}`": _width(m, 90) for m in trailing} | {CREATED_COLUMN: 130, DURATION_COLUMN: 80}
    columns = [col for col in widths if col.startswith(("metrics.", "params."))]
    state = {"searchFilter": mlflow_layout.tag_filter(mlflow_layout.SWEEP_RUN, run_id),
             "orderByKey": f"tags.`{ROLE}`", "orderByAsc": True, "startTime": "ALL",
             "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
             "selectedColumns": columns, "columnOrder": list(widths), "columnWidths": widths,
             "groupBy": None, "groupsExpanded": {},
             "globalLineChartConfig": {"xAxisKey": "metric", "selectedXAxisMetricKey": mlflow_layout.SCORED,
                                       "lineSmoothness": 0}}
    key = mlflow_layout.view_key(sweep, run_id)
    now = int(time.time() * 1000)
    created = _envelope(c.get_experiment(exp_id).tags.get(mlflow_layout.SAVED_VIEW + key)).get("createdAt", now)
    started = c.get_run(run_id).info.start_time or now
    name = f"{sweep} {time.strftime('%Y-%m-%d %H:%M', time.gmtime(started / 1000))} {run_id[:8]}"
    c.set_experiment_tag(exp_id, mlflow_layout.SAVED_VIEW + key, json.dumps(
        {"name": name, "createdAt": created, "updatedAt": now, "state": json.dumps(state)}))
    prune_views(c, exp_id, sweep, keep=run_id)
    return key


def sweep_views(tags: dict, sweep: str) -> dict[str, str]:
    """{parent run id: view key} of the saved views of sweep ``sweep`` among an experiment's ``tags`` (one per run;
    not the one key per sweep of earlier versions, nor another sweep's: a run id is MLflow's 32 hex digits, so the
    per-sweep key of a sweep named ``<sweep>-gpu`` is not read as run "gpu" of ``sweep``)."""
    own = re.compile(re.escape(mlflow_layout.SAVED_VIEW + mlflow_layout.view_key(sweep)) + r"-([0-9a-f]{32})")
    return {m[1]: tag[len(mlflow_layout.SAVED_VIEW):] for tag in tags if (m := own.fullmatch(tag))}


def prune_views(c, exp_id: str, sweep: str, keep: str | None = None, kept: int = VIEWS_KEPT) -> list[str]:
    """Remove the saved views of sweep ``sweep`` beyond its ``kept`` latest (by when first saved), except those of
    runs still RUNNING and of ``keep`` (a parent run id); returns the keys removed. A link printed by a run whose view
    was removed names a view no longer there; a resume of that run saves its view again."""
    from mlflow.exceptions import MlflowException

    tags = c.get_experiment(exp_id).tags
    views = sweep_views(tags, sweep)
    newest = sorted(views, key=lambda r: _envelope(tags[mlflow_layout.SAVED_VIEW + views[r]]).get("createdAt", 0),
                    reverse=True)
    removed = []
    for run_id in newest[kept:]:
        if run_id == keep:
            continue
        try:
            if c.get_run(run_id).info.status == "RUNNING":
                continue
        except MlflowException:  # the run was deleted from the store: its view shows nothing
            pass
        try:
            c.delete_experiment_tag(exp_id, mlflow_layout.SAVED_VIEW + views[run_id])
        except MlflowException:  # another run of the sweep pruning at the same time removed it first
            continue
        removed.append(views[run_id])
    return removed


def _envelope(value: str | None) -> dict:
    """A saved view's tag value as a dict ({} when absent or not MLflow's JSON)."""
    try:
        envelope = json.loads(value) if value else {}
    except ValueError:
        return {}
    return envelope if isinstance(envelope, dict) else {}
