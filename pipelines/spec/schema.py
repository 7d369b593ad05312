"""The sweep spec's schema: every field, its type, its rule and its default, declared once (pydantic).

`SweepSpec` and `TuneSpec` are plain dataclasses like the sections they hold (`ModelSource`, `Resources`,
`Calibration`: the components' own config objects, whose fields carry their rules the same way). `validate` runs
pydantic over a raw spec mapping and returns the problems in our words (`errors.reword`). Method names in `grid`
and `trials` are checked through promprune's registry (the `catalog` in pydantic's validation context); option
values need the expanded trials and are checked afterwards (`trials.check_trials`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, StrictInt, StrictStr, TypeAdapter, \
    ValidationError, ValidationInfo, WrapValidator, with_config
from pydantic_core import InitErrorDetails
from typing_extensions import NotRequired, TypedDict

from promprune.eval.tasks import EASYVQA_TASKS
from promprune.suggest import closest, did_you_mean

from pipelines.calibration import Calibration
from pipelines.config import AUTO, SECTION, Number, PositiveOrAuto, Resources, expect, one_of, problem
from pipelines.spec import space
from pipelines.spec.errors import reword, unknown
from pipelines.weights import ModelSource

SEARCHES = ("grid", "random", "optuna")
SCHEDULERS = ("none", "asha")
MODES = ("max", "min")
DEFAULT_TASKS = EASYVQA_TASKS  # the offline benchmarks (a spec's and `pipelines/evaluate.py`'s default)


def mapping(what: str = "a mapping", kind: type = dict) -> WrapValidator:
    """A section must be a mapping (``expected <what>, got ...``); its own fields report their own problems."""
    def check(value: Any, handler):
        if not isinstance(value, kind):
            raise problem(f"expected {what}, got {value!r}")
        return handler(value)

    return WrapValidator(check)


def _as_written(value: Any, handler) -> Any:
    handler(value)  # checked; kept in the order and form the user wrote it (dump_resolved, trial configs)
    return value


def _no_duplicates(tasks: list[str]) -> list[str]:
    dupes = sorted({t for t in tasks if tasks.count(t) > 1})
    if dupes:
        raise problem(f"listed more than once: {', '.join(dupes)}")
    return tasks


def _bootstrap(n: int) -> int:
    if 0 < n < 100:
        raise ValueError(n)
    return n


class Generation(TypedDict, total=False):
    """generate() kwargs a spec may set over each task's own: a typo such as `max_new_token` must fail before any
    model loads (only max_new_tokens and seed have a rule here; generate() checks the rest). Beside them, how an image's
    questions share work (promprune.eval.generation; never passed to generate()): `vision_once` encodes and selects
    each image once, `prefix_cache` also prefills its prompt prefix once; both default to true (accuracy sweeps),
    efficiency trials set both false (Table 6 measures each sample's own latency). `seed` (default 0) seeds sampled
    generation (do_sample: true) with the trial's id and each sample's key, one stream per sample whatever its batch
    (promprune.eval.generation.sample_seeds); greedy decoding draws nothing."""

    __pydantic_config__ = SECTION
    max_new_tokens: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")]
    do_sample: Any
    temperature: Any
    top_p: Any
    top_k: Any
    num_beams: Any
    repetition_penalty: Any
    vision_once: Annotated[bool, Field(strict=True), expect("true or false")]
    prefix_cache: Annotated[bool, Field(strict=True), expect("true or false")]
    seed: Annotated[StrictInt, expect("an int")]


def _prefix_needs_vision(generation: dict) -> dict:
    if generation.get("prefix_cache", True) and generation.get("vision_once", True) is False:
        raise problem("prefix_cache continues each image's shared encoding, so it needs vision_once: with "
                      "vision_once: false set prefix_cache: false too")
    return generation


GENERATION_KEYS = tuple(Generation.__annotations__)


Search = one_of(*SEARCHES)


def _metric_name(name: str) -> str:
    if name != "rel" and (name.count("/") != 1 or not all(name.split("/"))):
        raise ValueError(name)
    return name


@with_config(SECTION)
@dataclass
class TuneSpec:
    # grid: every combination of the grid's lists; random: num_samples seeded draws from the grid's lists and
    # distributions, without replacement where they are finite; optuna: num_samples trials chosen by Optuna's TPE
    search: Search = "grid"
    # grid: repeats of every trial; random, optuna: trials searched
    num_samples: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")] = 1
    # what optuna and the scheduler optimize: rel (needs the baseline), or a task metric '<task>/<metric>'
    metric: Annotated[StrictStr, AfterValidator(_metric_name),
                      expect("'rel' or a task metric '<task>/<metric>' (e.g. pope/pope_f1_score)")] = "rel"
    mode: one_of(*MODES) = "max"  # max: higher is better (scores, Rel.)
    # asha: Tune's ASHA stops weak trials at rungs of samples seen (grace_period, x reduction_factor, ...)
    scheduler: one_of(*SCHEDULERS) = "none"
    # samples a trial answers before ASHA may stop it (its first rung); auto: a trial's samples / reduction_factor^2
    # rounded up, so there are two rungs before the end
    grace_period: PositiveOrAuto = AUTO
    # ASHA keeps the best 1/reduction_factor of the trials at each rung; 3 is ASHA's own recommendation
    reduction_factor: Annotated[Number, Field(gt=1), expect("a number > 1")] = 3
    max_concurrent_trials: PositiveOrAuto = AUTO  # auto: enough for the GPUs, or one per core on a CPU (at most 8)
    # Tune retries of a failed trial (node loss, OOM) before the trial counts as errored; a `ScoringError` (the same
    # on every try) is not retried, only scored again by a --resume (pipelines/run/trial.py `run_trial`)
    max_failures: Annotated[StrictInt, Field(ge=-1), expect("an int >= 0 (or -1: unlimited)")] = 2
    seed: Annotated[StrictInt, expect("an int")] = 0  # random draws and optuna's sampler
    # Tune's experiment dir; None: $PROMPRUNE_STORAGE, else ./outputs/tune (needs shared storage on clusters); a Ray
    # job names it by absolute path or URI (a relative one is refused: `pipelines.paths.relative_storage_in_job`)
    storage_path: Annotated[StrictStr | None, expect("a path or URI string")] = None


# ----------------------------------------------------------------------------------------------------------------
# grid and explicit trials: open mappings (method options), checked as a whole, each problem at its own path


def _raise(problems: list[tuple[tuple, str, Any]], title: str) -> None:
    """Several problems of one field at once, each at its own location under it."""
    if problems:
        raise ValidationError.from_exception_data(title, [
            InitErrorDetails(type=problem(text), loc=loc, input=value) for loc, text, value in problems])


def _method_problem(method: Any, catalog) -> str | None:
    if catalog is None or method in catalog.names:
        return None
    return f"unknown method {method!r}{unknown(method, catalog.names)}"


def _space_problem(key: str, value: Any) -> str | None:
    """A distribution's shape and bounds; method names take no range (a list or a choice of them)."""
    text = space.problem(value)
    if text is None and key == "method" and space.is_distribution(value) and "choice" not in value:
        text = f"a method is chosen from a list or {{choice: [...]}}, not drawn from {value!r}"
    return text


def _option_hint(key: str, theirs: list[str], catalog) -> str:
    """What to say of a grid option the grid's methods do not take: which methods take it, else the closest of
    theirs (or of another method's, naming that method), and what theirs are."""
    def owners(option: str) -> str:
        return ", ".join(sorted(m for m in catalog.names if option in catalog.options(m)))

    if taken_by := owners(key):
        return f"; it is an option of {taken_by} (add one to grid.method, or move it to trials:)"
    hint = did_you_mean(key, theirs)
    if not hint and (other := closest(key, set().union(*[catalog.options(m) for m in catalog.names]))):
        hint = f" (did you mean {other!r}, an option of {owners(other)}?)"
    return f"{hint}; valid: {', '.join(theirs) if theirs else '(none besides budget)'}"


def _check_grid(grid: dict, info: ValidationInfo) -> dict:
    catalog = (info.context or {}).get("catalog")
    problems = [((key,), "empty list", value) for key, value in grid.items() if isinstance(value, list) and not value]
    problems += [((key,), text, value) for key, value in grid.items() if (text := _space_problem(key, value))]
    if grid and "method" not in grid:
        problems.append((("method",), "required when grid is set (a method name or a list of them)", None))
    if grid and "budget" not in grid:
        problems.append((("budget",), "required when grid is set (an int or a list of them)", None))
    budgets = grid.get("budget")
    listed = budgets if isinstance(budgets, list) else [] if space.is_distribution(budgets) else [budgets]
    bad = [b for b in listed if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1)]
    if bad:  # here, not once per trial the grid expands to
        problems.append((("budget",), f"expected an int >= 1 or a list of them, got {bad[0]!r}", budgets))
    methods = grid.get("method", [])
    methods = methods["choice"] if isinstance(methods, dict) and isinstance(methods.get("choice"), list) \
        else methods if isinstance(methods, list) else [methods] if not isinstance(methods, dict) else []
    problems += [(("method",), text, m) for m in methods if (text := _method_problem(m, catalog))]
    known = [m for m in methods if catalog is not None and m in catalog.names]
    if known:
        theirs = sorted(set().union(*[catalog.options(m) for m in known]))  # what the grid's methods accept
        for key in grid:
            if key in ("method", "budget") or key in theirs:
                continue
            if (near := did_you_mean(key, ["method", "budget"])) and not did_you_mean(key, theirs):
                problems.append(((key,), f"unknown field{near}; valid: method, budget and the options of the grid's "
                                 f"methods ({', '.join(theirs) if theirs else 'none'})", grid[key]))
            else:
                problems.append(((key,), f"no method in grid.method ({', '.join(map(str, known))}) accepts this "
                                 f"option{_option_hint(key, theirs, catalog)}", grid[key]))
    _raise(problems, "grid")
    return grid


def _one_value(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise problem(f"explicit trials take one value, got {value!r} (use grid: for lists)")
    return value


def _known_method(method: Any, info: ValidationInfo) -> Any:
    if text := _method_problem(method, (info.context or {}).get("catalog")):
        raise problem(text)
    return method


def _in_the_spec(tasks: list[str], info: ValidationInfo) -> list[str]:
    spec_tasks = (info.context or {}).get("tasks")  # None when the spec's own tasks are invalid (reported there)
    if spec_tasks is not None and (extra := [t for t in tasks if t not in spec_tasks]):
        raise problem(f"{extra} not in the spec's tasks {spec_tasks} (a trial runs on a subset of them)")
    return tasks


class ExplicitTrial(TypedDict):
    """One entry of `trials:`: a method, a budget, the method's options, and optionally a subset of the tasks."""

    __pydantic_config__ = ConfigDict(extra="allow")  # the method's options (their values: `check_trials`)
    method: Annotated[Any, AfterValidator(_one_value), AfterValidator(_known_method)]
    budget: Annotated[Any, AfterValidator(_one_value)]
    tasks: NotRequired[Annotated[list[StrictStr], Field(min_length=1),
                                 expect("a non-empty list of the spec's task names"), AfterValidator(_in_the_spec)]]


def _accepted_options(trial: dict, info: ValidationInfo) -> dict:
    """An explicit trial's options must be its method's: one it does not take is refused (the grid drops them, since
    a grid crosses methods; a trial names one). Adapter options (`video_budget`, `budget_mode`, ...) belong in
    `model.options`, which applies to every trial."""
    catalog = (info.context or {}).get("catalog")
    method = trial.get("method")
    if catalog is None or method not in catalog.names:
        return trial
    accepted = catalog.options(method)
    adapter = catalog.adapter_option_names
    problems = []
    for key in trial:
        if key in ("method", "budget", "tasks") or key in accepted:
            continue
        hint = (" (an adapter option: set it in model.options, or in a spec of its own)" if key in adapter
                else unknown(key, sorted(accepted)))
        problems.append(((key,), f"{method} takes no option {key!r}{hint}", trial[key]))
    _raise(problems, "trial")
    return trial


TaskList = Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1),
                     BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
                     expect("a non-empty list of lmms-eval task names"), AfterValidator(_no_duplicates)]


def _paths(what: str):
    """A list of non-empty strings (one string is a list of one), each once: `plugins`, `include_path`."""
    return Annotated[list[Annotated[StrictStr, Field(min_length=1)]],
                     BeforeValidator(lambda v: [v] if isinstance(v, str) else v), expect(what),
                     AfterValidator(_no_duplicates)]


MAX_NAME = 100  # characters: with a run's timestamp and suffixes, a file name of 255 bytes holds an ASCII one
# the entry points a spec can be written for (its `command`), each with the script that runs it
COMMANDS = {"sweep": "pipelines/sweep.py", "fig2_concentration": "pipelines/fig2_concentration.py"}


@with_config(SECTION)
@dataclass
class SweepSpec:
    """A whole spec, validated (`validate`); `name` and `version` are required, everything else has a default."""

    # the name becomes directory, file and MLflow names: no '/', no control characters (NUL, newline, tab, ...), and
    # short enough for a file name (255 bytes) with the run's timestamp and suffixes beside it
    name: Annotated[StrictStr, Field(pattern=r"^[^/\x00-\x1f\x7f]*[^/\s\x00-\x1f\x7f][^/\x00-\x1f\x7f]*$",
                                     max_length=MAX_NAME),
                    expect(f"a non-empty name of at most {MAX_NAME} characters, without '/' or control characters "
                           "(NUL, newline, tab)")]
    version: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")]
    description: Annotated[StrictStr, expect("str")] = ""
    # the entry point the spec is written for (`COMMANDS`): each refuses a spec for another one. Not part of the
    # resolved spec (`to_dict`): it names who runs the spec, not what a run does, so a run's fingerprint is unchanged
    command: one_of(*COMMANDS) = "sweep"
    # modules that register methods (promprune.register_method, promprune.register_in_llm_method), imported before the
    # methods are checked and in every Ray worker: module names, .py files or package directories (relative paths:
    # from the spec's directory)
    plugins: _paths("a list of module names, .py files or package directories") = field(default_factory=list)
    # lmms-eval task directories of one's own, searched for `tasks` here and in every Ray worker (relative paths:
    # from the spec's directory)
    include_path: _paths("a list of task directories") = field(default_factory=list)
    # the loader itself: pretrained, dtype, attention, options
    model: ModelSource = field(default_factory=ModelSource)
    # the offline benchmarks
    tasks: TaskList = field(default_factory=lambda: list(DEFAULT_TASKS))
    # per-task sample cap; None: the full benchmark
    limit: Annotated[Annotated[StrictInt, Field(ge=1)] | None, expect("an int >= 1 or null")] = None
    baseline: Annotated[bool, Field(strict=True), expect("bool")] = True  # also run the unpruned model once
    # frames sampled uniformly from each clip of a video task (image tasks ignore it; promprune.models.video's
    # DEFAULT_FRAMES, written out so validating a spec imports no torch)
    video_frames: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")] = 8
    # resamples for 95% confidence intervals of each task's primary metrics; 0: none
    bootstrap: Annotated[StrictInt, Field(ge=0, le=100_000), AfterValidator(_bootstrap),
                         expect("0 (no confidence intervals) or a number of resamples in 100..100000")] = 0
    grid: Annotated[dict, mapping("a mapping of field -> value or list of values"),
                    AfterValidator(_check_grid)] = field(default_factory=dict)
    trials: Annotated[list[Annotated[ExplicitTrial, AfterValidator(_accepted_options)]], WrapValidator(_as_written),
                      mapping("a list of mappings like {method: fastv, budget: 64, layer: 2}", list)] = field(
        default_factory=list)
    # generate() kwargs over each task's own; {}: lmms-eval's per task
    generation: Annotated[Generation, mapping("a mapping of generate() kwargs"), AfterValidator(_prefix_needs_vision),
                          WrapValidator(_as_written)] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    # images for trials with mu: calibrate
    calibration: Calibration = field(default_factory=Calibration)
    tune: TuneSpec = field(default_factory=TuneSpec)

    def to_dict(self) -> dict:
        """The spec as plain data (what `dump_resolved` writes): component fields that are not spec fields, such as
        a ModelSource's published weights, are left out, and so is `command`."""
        out = dataclasses.asdict(self)
        out.pop("command")
        for section, cls in SECTIONS.items():
            for f in dataclasses.fields(cls):
                if not f.metadata.get("spec", True):
                    out[section].pop(f.name, None)
        return out


SECTIONS = {"model": ModelSource, "resources": Resources, "tune": TuneSpec, "calibration": Calibration}
TOP_LEVEL = [f.name for f in dataclasses.fields(SweepSpec)] + ["include"]
# the names a user may write in each mapping, for "unknown field" problems
VALID_KEYS = {(): TOP_LEVEL, ("generation",): list(GENERATION_KEYS)} | {
    (section,): [f.name for f in dataclasses.fields(cls) if f.metadata.get("spec", True)]
    for section, cls in SECTIONS.items()}
SCHEMA = TypeAdapter(SweepSpec)
TASKS = TypeAdapter(TaskList)
PLACEHOLDERS = {"name": "?", "version": 1}  # stand in for a missing or bad required field in `validate`'s repair


def _spec_tasks(raw: dict) -> list[str] | None:
    """The spec's tasks, for the explicit trials' subsets (validated first); None if they are invalid."""
    try:
        return TASKS.validate_python(raw["tasks"]) if "tasks" in raw else list(DEFAULT_TASKS)
    except ValidationError:
        return None


def validate(raw: dict, catalog=None) -> tuple[SweepSpec | None, list[str]]:
    """(the spec, every schema problem in our words). With problems, the spec is the raw one with each bad field
    left at its default (a bad grid axis dropped, the whole grid where its method or budget is bad, a bad trial
    dropped), so the checks that need a whole spec (option values) still run on what is left and report with the
    others; None when no repair validates."""
    raw = {k: v for k, v in raw.items() if k != "include"}
    context = {"catalog": catalog, "tasks": _spec_tasks(raw)}
    try:
        return SCHEMA.validate_python(raw, context=context), []
    except ValidationError as exc:
        errors = reword(exc, VALID_KEYS)
        bad = [tuple(e["loc"]) for e in exc.errors()]
    repaired = dict(raw)
    bad_trials = {loc[1] for loc in bad if loc[0] == "trials" and len(loc) > 1 and isinstance(loc[1], int)}
    for loc in bad:
        section = repaired.get(loc[0])
        if loc[0] == "grid" and (len(loc) < 2 or loc[1] in ("method", "budget")):
            repaired.pop("grid", None)  # nothing left to expand; the trials are still checked
        elif loc[0] == "trials" and len(loc) > 1 and isinstance(loc[1], int) and isinstance(section, list):
            continue  # the bad trials leave together, below, so the indices stay those of the file
        elif len(loc) > 1 and isinstance(section, dict):
            repaired[loc[0]] = {k: v for k, v in section.items() if k != loc[1]}
        else:
            repaired.pop(loc[0], None)
    if bad_trials and isinstance(repaired.get("trials"), list):
        repaired["trials"] = [t for i, t in enumerate(repaired["trials"]) if i not in bad_trials]
    repaired = {**PLACEHOLDERS, **repaired}
    try:
        return SCHEMA.validate_python(repaired, context=context), errors
    except ValidationError:  # a problem the repair does not remove: report what we have
        return None, errors
