"""The MLflow schema of the pipeline, in one place: tracking writes through it, reporting reads through it.

- **Store.** `MLFLOW_TRACKING_URI`, else `sqlite:///<cwd>/mlflow.db` (what `mlflow ui` opens in that directory; a
  Ray job's is `~/promprune/mlflow.db`, `pipelines.paths`), its artifacts in `mlruns/` beside the database file;
  experiment `promprune`, or `MLFLOW_EXPERIMENT_NAME`.
- **Parent run per sweep:** run name = spec name; tags `promprune.role=sweep`, `promprune.sweep=<name>`,
  `promprune.spec_version=<version>`, `promprune.spec_fingerprint` (the hash of the resolved spec: the nightly
  regression check compares runs of the same one only, `pipelines.run.state.spec_fingerprint`, or of it before the
  code gained fields now at their defaults, read from `spec.yaml`); artifact `spec.yaml` (the resolved spec); the
  report under `report/`; after a regression check `promprune.regression` (`true`, `false` or `no-previous`,
  `incomplete`) with `.previous_run`, `.threshold`, `.detail` and `.note` (what it compared with,
  or why with nothing; `false` only when some trial was compared); a run tagged `true` is no later run's baseline
  (set it to `accepted` to make it one), nor is one with failed trials or whose finished trials have no Rel. at all
- **Child run per trial** (role `trial`; a standalone `pipelines/evaluate.py` run has role `evaluation` and no
  parent), created when the trial starts (RUNNING, then FINISHED / KILLED / FAILED): tags `mlflow.parentRunId`,
  `promprune.sweep`, `promprune.trial=<id>`, `mlflow.note.content` (the spec's description); params model, method
  (`none` = unpruned), budget, tasks, every option of the trial, and `dtype`, `attn_implementation` and
  `model_options` as on the parent run (`pipelines.recording.tracking.model_params`); while it runs `samples/done` and
  `running/<task>/<metric>` (step: the samples they cover); metrics `<task>/<metric>`, `rel`, `samples/*`,
  `efficiency/*`, `entropy/*`, `t_sal/*`; artifact `predictions.parquet` (schema:
  `promprune.records.arrow_schema(Prediction)`, `pipelines.run.result.PREDICTION_SCHEMA`; the file is the trial's
  `TrialResult` as its Tune checkpoint held it: per-task scores and metrics as JSON in the schema metadata).
  A trial a scheduler stopped early is a KILLED run with tag `promprune.stopped` (where and why), metrics
  `samples/done` (answered when stopped), `samples/scored`, `samples/total` and its running scores as
  `running/<task>/<metric>` and `running/rel` (over the first `samples/scored` samples), and no predictions.
- **The parent run** also holds params model, tasks, limit, trials, bootstrap, `dtype` (what the workers run in:
  `dtype: auto` resolved for the plan's device, bfloat16 on GPU, float32 on CPU; the regression check compares
  runs of one dtype only) and `attn_implementation`, the search's params (`search`, `scheduler`, `space.<field>`),
  the driver's `system/...` metrics, and for a sweep whose trials make exactly one (mu, tau) search (`search_key`:
  trials alike in all else) its best trial (`promprune.best_trial`, `best/<metric>` with `_ci_low` / `_ci_high`,
  `best/mu`, `best/tau`); a sweep of several searches has none (each one's best is a line of its description).
- **A saved view per run of a sweep** (experiment tag `mlflow.sharedViewState.promprune-<sweep>-<parent run id>`,
  the runs page's "Views" menu, named `<sweep> <started, UTC> <id's first 8>`; each sweep's latest 10 kept
  (`pipelines.recording.view.VIEWS_KEPT`) and those of its running runs; a `--resume` saves its run's again): the
  parent run above its trials (rows of runs tagged `promprune.sweep_run` = the parent's id), columns run name,
  Rel. (a search's running value too), visual tokens, params method, budget and the varied options, each task's
  primary metric; line charts against `samples/scored`; `ui_url` links to it (`save_sweep_view` in
  pipelines/recording/view.py says what MLflow 3.17's UI can and cannot keep in a view).
- **Rel.** is a fraction everywhere data is stored or compared (1.0 = the unpruned model's scores; the nightly
  regression threshold is in the same unit); tables and figures show it as a percent through `rel_percent`.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Hashable, Iterable, Mapping, NamedTuple

from pipelines.paths import default_tracking_uri

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
DEFAULT_EXPERIMENT = "promprune"  # one experiment for every sweep; the sweep tag tells them apart

# tags
PARENT = "mlflow.parentRunId"
RUN_NAME = "mlflow.runName"
ROLE, SWEEP, TRIAL, VERSION = "promprune.role", "promprune.sweep", "promprune.trial", "promprune.spec_version"
SPEC_FINGERPRINT = "promprune.spec_fingerprint"  # on a parent run: the hash of its resolved spec
# params of a parent run and of each of its trial runs (`pipelines.recording.tracking.model_params`): the dtype the
# workers run in (`dtype: auto` resolved for the plan's device), the attention and the spec's adapter options
# (`model.options`, JSON with sorted keys)
DTYPE_PARAM, ATTENTION_PARAM, MODEL_OPTIONS_PARAM = "dtype", "attn_implementation", "model_options"
SWEEP_RUN = "promprune.sweep_run"  # the parent run's id, on the parent and on each of its trials: one run of a sweep
ERROR = "promprune.error"
NOTE = "mlflow.note.content"  # a run's description in the UI: the spec's description; the parent's, what it found
BEST_TRIAL = "promprune.best_trial"  # on a parent run of one (mu, tau) search: its best finished trial's id
INTERRUPTED = "promprune.interrupted"  # on a parent run whose driver died: what happened, how to resume
STARTED_AT, FINISHED_AT = "promprune.started_at", "promprune.finished_at"  # ISO 8601 UTC, as tags (not metrics)
EXPERIMENT_KIND, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"  # what the experiment is;
# MLflow 3.17's UI ignores it when choosing the page (checked in a fresh Chromium profile): the sidebar's GenAI /
# Model training switch decides, default GenAI, whose overview has no runs; a link's `workflowType=machine_learning`
# sets it, so `ui_url` opens the runs table in any browser
SAVED_VIEW = "mlflow.sharedViewState."  # experiment tag prefix of the runs page's saved views (its "Views" menu)
REGRESSION = "promprune.regression"
TRIALS_TOTAL = "trials/total"  # parent metric: the distinct trials the sweep ran (its param `trials` too)
TRIALS_PROPOSED = "trials/proposed"  # parent metric of an optuna search: its proposals (num_samples once it ended)
TRIALS_REPEATED = "trials/repeated"  # ... those naming a trial the sweep had run or was running: none run again
TRIALS_FAILED = "trials/failed"  # parent metric: its trials that failed (a run with any is no baseline of a later one)
STOPPED = "promprune.stopped"  # on a trial run a scheduler stopped early (status KILLED): where, and why
CALIBRATED_MU = "promprune.calibrated_mu"
ROLE_SWEEP, ROLE_TRIAL, ROLE_EVALUATION = "sweep", "trial", "evaluation"

# params
BASELINE_METHOD = "none"  # the `method` param of the unpruned trial
# a trial run's params that are not method options (`pipelines.recording.tracking.trial_params`; `mu_source` says
# where a calibrated mu came from); every other param is one of its method's options, whichever module registered it
MU_TAU = ("mu", "tau")  # the split's options a search varies: the console's best line, the report's (mu, tau) views
NON_OPTION_PARAMS = ("model", "method", "budget", "tasks", "repeat", "mu_source", DTYPE_PARAM, ATTENTION_PARAM,
                     MODEL_OPTIONS_PARAM)


class SearchKey(NamedTuple):
    """What a trial's search metric depends on besides mu and tau (`search_key`): two trials are points of one
    (mu, tau) search only when their keys are equal. ``budget``, ``tasks`` and the option values as `option_text`
    writes them (``tasks`` joined by commas; None where unknown); ``options``: (name, value) pairs, by name."""

    method: str
    budget: str | None
    tasks: str | None
    options: tuple

    def parts(self) -> dict[str, str | None]:
        """``{method, budget, tasks, <option>: value}``: what tells one search from another (`search_labels`)."""
        return {"method": self.method, "budget": self.budget, "tasks": self.tasks, **dict(self.options)}


def option_text(value) -> str:
    """A param's value as one text, the same for the spec's value and for its logged param read back
    (`pipelines.reporting.store.parse_param`): 64 and 64.0 -> ``64``, 0.9818 -> ``0.9818``, a list or dict as its
    logged JSON (`pipelines.recording.tracking.trial_params`), anything else as ``str`` writes it."""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _unset(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _value(options: Mapping, defaults: dict, name: str) -> str | None:
    """Option ``name`` of a trial as `option_text` writes it: its own value, else (unset, or NaN as a frame of
    params holds an unset one) the method's default, else None."""
    value = options.get(name)
    value = defaults.get(name) if _unset(value) else value
    return None if _unset(value) else option_text(value)


def option_defaults(method: str | None) -> dict:
    """The registered option defaults of ``method`` (empty for the baseline and for a method this process does not
    know: a plugin's)."""
    if method in (None, BASELINE_METHOD):
        return {}
    from promprune.selection.registry import method_spec

    try:
        return dict(method_spec(method).options)
    except ValueError:
        return {}


def search_key(method: str | None, budget, tasks, options: Mapping, option_names: Iterable[str] = ()) -> SearchKey:
    """A trial's `SearchKey`: its method, budget, tasks (a sequence of names) and every other option than mu and tau
    among ``option_names`` (the options any trial of the sweep sets) and its own, an unset option read as the
    method's registered default (trials set, and log, only the options their spec gives: the grid's
    ``metric: [spectral]`` beside a trial that leaves it unset is one metric). The one definition of "trials alike in
    all else" that the report's (mu, tau) planes (`pipelines.reporting.build`) and the console's best lines with the
    parent run's ``best/*`` (`pipelines.recording.console`) both group by: a mu calibrated for feature-norm entropy
    is on another scale than attention entropy's, and one searched at 64 tokens is no point of a search at 128."""
    defaults = option_defaults(method)
    values = {name: _value(options, defaults, name) for name in sorted(set(option_names) | set(options))
              if name not in MU_TAU}
    return SearchKey(method or BASELINE_METHOD, None if _unset(budget) else option_text(budget),
                     None if tasks is None else ",".join(map(str, tasks)),
                     tuple((n, v) for n, v in values.items() if v is not None))


def mu_tau_point(key: SearchKey, options: Mapping) -> tuple:
    """A trial's (mu, tau) as `option_text` writes them, an unset one read as its method's default."""
    defaults = option_defaults(key.method)
    return tuple(_value(options, defaults, name) for name in MU_TAU)


def mu_tau_searches(keys: Mapping[Hashable, SearchKey], options: Mapping[Hashable, Mapping]
                    ) -> list[tuple[SearchKey, list]]:
    """The (mu, tau) searches among trials that set mu or tau: per `SearchKey` (``keys``: trial -> its key), in the
    order the keys first come, the trials alike in all else, where the trials among them in ``options`` (trial -> its
    options: the ones that count, e.g. those with a score) hold two or more distinct (mu, tau) (`mu_tau_point`).
    Trials that set mu or tau with different other options (Fig. 4's per-metric calibrated mu) are no search."""
    groups: dict[SearchKey, list] = {}
    for trial, key in keys.items():
        groups.setdefault(key, []).append(trial)
    return [(key, trials) for key, trials in groups.items()
            if len({mu_tau_point(key, options[t]) for t in trials if t in options}) >= 2]


def trial_searches(trials: Mapping[Hashable, tuple]) -> list[tuple[SearchKey, list]]:
    """`mu_tau_searches` among trials as a sweep configures them, every one counted (what the console's best lines
    and the saved view's best column go by): ``trials``: trial -> (method, budget, tasks, options)."""
    names = {name for *_, options in trials.values() for name in options}
    setting = {t: config for t, config in trials.items() if any(k in config[3] for k in MU_TAU)}
    return mu_tau_searches({t: search_key(*config, names) for t, config in setting.items()},
                           {t: config[3] for t, config in setting.items()})


def search_labels(keys: list[SearchKey]) -> list[str]:
    """What tells each of several searches from the others: ``budget=128, metric=attention`` (the key's parts whose
    values differ among ``keys``; ``<name> unset`` where a key lacks one); empty for a single search."""
    parts = [key.parts() for key in keys]
    names = list(dict.fromkeys(n for p in parts for n in p))
    differ = [n for n in names if len({p.get(n) for p in parts}) > 1]
    return [", ".join(f"{n}={p[n]}" if p.get(n) is not None else f"{n} unset" for n in differ) for p in parts]


# artifacts
SPEC_ARTIFACT = "spec.yaml"
PREDICTIONS_ARTIFACT = "predictions.parquet"
REPORT_DIR = "report"

# metrics
REL = "rel"  # a fraction: 1.0 = the unpruned model
# parent param: JSON {task: [metric, ...]} for the sweep's tasks promprune.eval has no choice for (a task of one's own:
# the first metric of its own YAML, `promprune.eval.tasks.primary_metrics`), what its Rel. was computed on; the
# report takes its columns from it (the task folders, `include_path`, may not be where it runs; a run recorded
# without it: `reporting.store._recorded_primary` resolves them through its `spec.yaml`'s include_path, if still there)
PRIMARY_PARAM = "primary_metrics"
# a trial a scheduler stopped: its running scores (and Rel.) over the samples it had answered, under this prefix
# (`running/rel`, `running/<task>/<metric>`), never under a finished trial's keys
RUNNING = "running"
GENERATED = "samples/generated"  # on a sweep's parent run: samples answered by all its trials, stopped ones included
SCORED = "samples/scored"  # samples a running value was computed over (the scheduler's rungs), logged at step =
# itself beside every running value: the saved view's line charts take it as their x axis (MLflow calls a step "Step")
NON_TASK_PREFIXES = ("efficiency", "entropy", "t_sal", "samples", "trial", "calibration", RUNNING, "trials")


def client():
    """A client of the sweep's store (`tracking_uri`); a new SQLite store starts as a copy of MLflow's empty schema
    (`pipelines.recording.empty_store.seed`: no migrations to run). Here, not in `pipelines.recording.tracking`
    (which re-exports it), so that `pipelines.run.state` reads a run's status without importing the module that
    imports it."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from pipelines.recording import empty_store

    uri = tracking_uri()
    empty_store.seed(sqlite_path(uri))
    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def spec_text(c, run_id: str) -> str | None:
    """A parent run's resolved spec (its `SPEC_ARTIFACT`) through client ``c``; None when it cannot be read."""
    import tempfile

    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as d:
        try:
            return Path(c.download_artifacts(run_id, SPEC_ARTIFACT, d)).read_text()
        except (MlflowException, OSError):
            return None


def tracking_uri(uri: str | None = None) -> str:
    """The store to use: ``uri``, else ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db`` of the working directory (of
    ``$PROMPRUNE_HOME`` in a Ray job: `pipelines.paths`)."""
    return uri or os.environ.get(TRACKING_URI_ENV) or default_tracking_uri()


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store URI (relative to the working directory, or absolute with a fourth
    slash), None for any other URI."""
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def artifact_location(uri: str | None = None) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: ``mlruns/<experiment>`` beside the database file,
    not MLflow's default ``./mlruns`` of whatever directory the process runs in (a Ray job's package copy, deleted
    with it); None for a server, which has its own artifact root."""
    database = sqlite_path(tracking_uri(uri))
    if database is None:
        return None
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", experiment_name()).lstrip(".") or "experiment"
    return str(database.resolve().parent / "mlruns" / name)


def is_server(uri: str | None = None) -> bool:
    """Whether the store is a tracking server (``http(s)://``): it serves the UI itself."""
    return tracking_uri(uri).lower().startswith(("http://", "https://"))


def ui_command(uri: str | None = None) -> str | None:
    """The command that serves the UI over a local store, the URI shell-quoted (a path with a space pastes as one
    argument); None for a tracking server (it serves its own: `ui_base`)."""
    return None if is_server(uri) else f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri(uri))}"


def ui_base(uri: str | None = None) -> str:
    """Where the UI answers: a tracking server's own address, else `mlflow ui`'s default."""
    return tracking_uri(uri).rstrip("/") if is_server(uri) else "http://127.0.0.1:5000"


def open_results(url: str | None = None, uri: str | None = None) -> str:
    """How to open the results: `mlflow ui` over a local store, then ``url``; a tracking server's page directly."""
    command = ui_command(uri)
    if command is None:
        return f"Open the results (the MLflow server serves its UI):\n  {url or ui_base(uri)}"
    return f"Open the results:\n  {command}" + (f"\n  then {url}" if url else "")


def view_key(sweep: str, run_id: str | None = None) -> str:
    """The id of the saved runs-page view of one run of a sweep, its parent run ``run_id`` (tag ``SAVED_VIEW + key``,
    URL parameter ``viewStateShareKey``): ``promprune-<sweep>-<run_id>``. Without ``run_id``: the one key per sweep
    that earlier versions saved (two runs of a sweep at once overwrote each other's view there)."""
    key = "promprune-" + (re.sub(r"[^A-Za-z0-9_.-]+", "_", sweep)[:100] or "sweep")
    return key if run_id is None else f"{key}-{run_id}"


def ui_url(experiment_id: str, view: str | None = None, base: str | None = None) -> str:
    """The experiment's runs in the UI (``base``, else `ui_base`: the server's address, or `mlflow ui`'s default): the
    Model-training side of MLflow 3's UI, and the saved view ``view`` (a ``view_key``) when given."""
    base = base or ui_base()
    url = f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    return url + (f"&viewStateShareKey={view}" if view else "")


def experiment_name() -> str:
    return os.environ.get(EXPERIMENT_ENV, DEFAULT_EXPERIMENT)


def rel_percent(fraction):
    """Rel. for display: a fraction (1.0 = unpruned) as a percent (100.0). Works on floats and pandas objects."""
    return fraction * 100.0


def tag_filter(tag: str, value: str) -> str:
    """An MLflow search filter on one tag (backquoted: our tag names contain dots)."""
    return f"tags.`{tag}` = '{value}'"


def tag_column(tag: str) -> str:
    """The column of ``tag`` in ``mlflow.search_runs``'s frame."""
    return f"tags.{tag}"
