"""A spec's trials: expansion of the grid and the explicit trials into `Trial`s with stable ids, and the check of
every trial's method options and values against promprune's registry (no model load)."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import math
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from pipelines.calibration import CALIBRATE, metrics_to_calibrate
from pipelines.calibration import apply as apply_calibration
from pipelines.spec import space
from promprune.suggest import did_you_mean
from pipelines.spec.errors import unknown
from pipelines.spec.schema import SweepSpec


@dataclass(frozen=True)
class Trial:
    """One evaluation of the sweep, the one record of it from the spec to the model workers: expanded from the spec
    (`expand`), carried by Tune in its config as it is (`pipelines.run.search.param_space`; a trial optuna samples
    becomes one at the Tune boundary, `search.trial_of`), run by a trial's coordinator and received by the workers,
    which wrap their model for it (`pipelines.run.workers.Worker`). What a sweep's trials share (the model, tasks,
    limit, generation, resources) is the sweep's spec, not the trial's. Method None is the unpruned baseline."""

    method: str | None
    budget: int | None
    options: dict = field(default_factory=dict)  # the method's options as the spec gives them (mu: calibrate)
    repeat: int = 0  # grid search with num_samples > 1 runs each trial several times
    tasks: tuple | None = None  # an explicit trial may run on a subset of the spec's tasks (Table 4); None: all
    # options the sweep measured before its trials ran, over `options` (`mu: calibrate` -> {"mu": the median}; see
    # `with_calibration`); the id stays the spec's
    calibrated: dict = field(default_factory=dict)

    @property
    def trial_id(self) -> str:
        return trial_id(self.method, self.budget, self.options, self.repeat, self.tasks)

    @property
    def run_options(self) -> dict:
        """The method's options as the trial runs them: the spec's, with calibrated values in place."""
        return {**self.options, **self.calibrated}

    def __str__(self) -> str:  # Tune names a trial's folder after its config values
        return self.trial_id

    def with_calibration(self, calibrated: dict[str, float]) -> "Trial":
        """This trial with ``mu: calibrate`` replaced by the sweep's measured median of its metric
        (``calibrated``: metric -> median, `calibration.apply`); itself when it calibrates nothing."""
        used = apply_calibration(self.options, calibrated)
        if used is self.options:
            return self
        return dataclasses.replace(self, calibrated={k: v for k, v in used.items() if self.options.get(k) != v})

    def to_dict(self) -> dict:
        """The trial as recorded (the recorder's MLflow params, `pipelines/recording/`): its fields, the options
        as it ran them, its id, and ``mu_source: calibration`` when a value was calibrated."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "calibrated"}
        out.update(options=self.run_options, tasks=None if self.tasks is None else list(self.tasks),
                   trial_id=self.trial_id)
        return out | ({"mu_source": "calibration"} if self.calibrated else {})


def trial_id(method: str | None, budget: int | None, options: dict, repeat: int = 0,
             tasks: tuple | None = None) -> str:
    """Stable readable id, e.g. `promprune-b16-mu=0.4-tau=0.02`; `baseline` for the unpruned model.

    The same configuration gets the same id in every sweep, so nightly runs can be compared trial by trial.
    Over-long ids (many options) are shortened with a hash of the full configuration.
    """
    if method is None:
        parts = ["baseline"]
    else:
        parts = [method, f"b{budget}"] + [f"{k}={_short(v)}" for k, v in sorted(options.items())]
    if tasks:
        parts.append(f"on={'+'.join(tasks)}")
    if repeat:
        parts.append(f"r{repeat}")
    tid = "-".join(parts)
    max_len = 80  # MLflow tag values are fine with more, but run names and Tune dirs stay readable
    if len(tid) > max_len:
        key = [method, budget, options, repeat] + ([list(tasks)] if tasks else [])
        digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode())
        tid = f"{tid[:max_len - 9]}-{digest.hexdigest()[:8]}"
    return tid


def _short(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(_short(x) for x in v)
    return str(v)


class MethodCatalog:
    """What promprune's one method registry knows: names, accepted options, value checks (no model load).

    Methods (pre-LLM and in-LLM alike): `promprune.methods(None)` / `promprune.method_spec(name)`; adapter options
    and the combined check: `promprune.models` (`ADAPTER_OPTIONS`, `validate_method`).
    """

    def __init__(self):
        import promprune
        import promprune.models as models

        self._pp, self._models = promprune, models
        self.names = promprune.methods(None)

    def options(self, method: str) -> set[str] | None:
        """Option names `method` accepts, or None for an unknown method (validate() reports it)."""
        return set(self._pp.method_spec(method).options) if method in self.names else None

    @property
    def adapter_option_names(self) -> set[str]:
        return set(self._models.ADAPTER_OPTIONS)

    def check_adapter_options(self, options: dict) -> tuple[dict, list[str]]:
        """(the known adapter options, errors naming unknown ones and bad values)."""
        known = self._models.ADAPTER_OPTIONS
        errors = [f"model.options.{k}: unknown adapter option{unknown(k, list(known))}"
                  for k in options if k not in known]
        valid = {k: v for k, v in options.items() if k in known}
        problem = self.validate(None, None, {}, valid)
        if problem:
            errors.append(f"model.options: {problem}")
        return valid, errors

    def validate(self, method: str | None, budget: int | None, options: dict, adapter_options: dict) -> str | None:
        """None if promprune accepts the combination, else its error message."""
        try:
            self._models.validate_method(method, budget, **options, **adapter_options)
        except (ValueError, TypeError) as e:
            return str(e)
        return None


def check_trials(spec: SweepSpec, catalog: MethodCatalog | None = None) -> list[str]:
    """Budgets and option values of every trial the spec expands to (and of the grid's search spaces: the middle and
    bounds of each range, every value of a choice, each problem under its own entry, `_corner_problems`; a drawn
    trial refused for such a problem alone is not reported again), the search's settings, and the calibration the
    trials need (all errors). Method and option names were checked by the schema."""
    catalog = catalog or MethodCatalog()
    adapter_options, errors = catalog.check_adapter_options(spec.model.options)
    said = catalog.validate(None, None, {}, adapter_options)  # the adapter options' own problem: once, as model.options
    errors += check_search(spec)
    try:
        check_optuna_space(spec, catalog)
        baseline, searched, explicit = parts(spec, catalog=catalog)
    except SearchSpaceError as e:
        errors.append(str(e))
        baseline, searched, explicit = [], [], []
    ids = {t.trial_id for t in searched}
    trials = baseline + searched + [t for t in explicit if t.trial_id not in ids]  # as `expand`
    corner_errors, culprits = _corner_problems(spec, catalog, adapter_options, said)
    for trial in [t for t in trials if t.repeat == 0]:  # a repeat has its first run's config
        problem = _trial_problem(trial, catalog, adapter_options)
        if problem == said or (problem and trial.trial_id in ids
                               and _explained(trial, culprits, catalog, adapter_options, said)):
            continue
        if problem and problem.startswith("budget: "):
            errors.append(f"{problem} (trial {trial.trial_id})")
        elif problem:
            errors.append(f"trial {trial.trial_id}: {problem}")
    errors += corner_errors
    if metrics_to_calibrate(trials) and not spec.calibration.images:
        errors.append("calibration.images: required when a trial sets mu: calibrate (a folder of images, or "
                      "hf:<dataset id>)")
    return list(dict.fromkeys(errors))  # a problem repeated word for word (a budget's of several trials): once


def check_search(spec: SweepSpec) -> list[str]:
    """The search's settings against the grid and the rest of the spec (`tune.search`, `tune.metric`); a search with
    no grid at all is refused with the spec's other emptiness check (`pipelines.spec.parse`)."""
    tune, errors = spec.tune, []
    drawn = [k for k, v in spec.grid.items() if space.is_distribution(v)]
    if tune.search == "grid" and drawn:
        errors += [f"grid.{k}: {space.parse(spec.grid[k]).describe()} is a search space, and tune.search: grid runs "
                   "the grid's lists only (set tune.search: random or optuna, or give a list)" for k in drawn]
    if tune.search == "optuna":
        errors += [f"grid.{k}: optuna chooses among numbers, strings, bools and null, not {v!r} (make it a fixed "
                   "value, or search it with tune.search: random)"
                   for k, values in _choices(spec.grid).items() if len(values) > 1
                   for v in values if not isinstance(v, (int, float, str, bool, type(None)))]
    if tune.metric != "rel" and tune.metric.split("/")[0] not in spec.tasks:
        errors.append(f"tune.metric: {tune.metric!r} names no task of the spec's {spec.tasks} (write "
                      "'<task>/<metric>', or rel)")
    if tune.metric == "rel" and not spec.baseline and metric_in_trials(spec):
        errors.append("tune.metric: rel divides by the unpruned model's scores, and baseline is false (set "
                      "baseline: true, or optimize a task metric such as '<task>/<metric>')")
    return errors


def metric_in_trials(spec: SweepSpec) -> bool:
    """Whether trials compute the search's metric while they run (for a scheduler's rungs, or optuna's
    objective), which for Rel. needs the baseline's answers first."""
    return spec.tune.scheduler != "none" or spec.tune.search == "optuna"


def _choices(grid: dict) -> dict[str, list]:
    """The listed values of every finite grid entry (lists, choices)."""
    return {k: space.parse(v).finite for k, v in grid.items() if space.parse(v).kind in (space.AXIS, "choice")}


def _corner_problems(spec: SweepSpec, catalog: MethodCatalog, adapter_options: dict,
                     said: str | None = None) -> tuple[list[str], dict[str, dict]]:
    """Each search space's values worth a check (its middle, a range's bounds, every value of a choice), for every
    method of the grid that takes the option, so that a value a method refuses is named, with its option, before
    anything runs (``said``: a problem already reported, which is left out).

    A value is tried with the grid's other entries at a reference the method accepts (`_reference`: values of their
    own, an option with none the method accepts left at its default), so that each problem is filed once, under the
    entry that causes it, and not under every other entry's corners. A float range on an option that takes ints
    (``layer: {uniform: [1, 3]}``: its middle 2.0 refused, 2 accepted) is one problem saying to draw ints.

    Also returns, for each method, the entries with a problem here, each with the value the method takes in the
    reference (`_explained`: a drawn trial refused for them alone is not another problem)."""
    spaces = {k: space.parse(v) for k, v in spec.grid.items()}
    methods = spaces["method"].finite if "method" in spaces and "budget" in spaces else None
    errors, culprits = [], {}
    for method in methods or []:
        accepted = catalog.options(method) if isinstance(method, str) else None
        if accepted is None:  # not a method: the schema says so
            continue
        found, culprits[method] = _method_corner_problems(method, spaces, accepted, catalog, adapter_options, said)
        errors += found
    return errors, culprits


def _method_corner_problems(method: str, spaces: dict[str, space.Space], accepted: set[str],
                            catalog: MethodCatalog, adapter_options: dict,
                            said: str | None) -> tuple[list[str], dict]:
    """`_corner_problems` for one method of the grid (``accepted``: its options)."""
    keys = [k for k in spaces if k == "budget" or k in accepted]
    rest = {k: s.middle for k, s in spaces.items() if k not in keys} | {"method": method}

    def problem(combo: dict) -> str | None:
        values = {k: v for k, v in combo.items() if v is not _DEFAULT}
        (trial,) = _trials_of([rest | values], catalog)
        found = _trial_problem(trial, catalog, adapter_options)
        return None if found == said else found

    candidates = {k: _distinct([spaces[k].middle, *spaces[k].corners]) + ([] if k == "budget" else [_DEFAULT])
                  for k in keys}
    reference = _reference(candidates, problem)
    if reference is None:  # nothing in the grid runs with this method: the trials' checks say why
        return [], {}
    errors, culprits = [], {}
    for key in keys:
        if spaces[key].searched:
            found = _space_problems(key, spaces[key], lambda v, key=key: problem(reference | {key: v}))
            if found:
                errors += found
                culprits[key] = reference[key]
    return errors, culprits


def _explained(trial: Trial, culprits: dict[str, dict], catalog: MethodCatalog, adapter_options: dict,
               said: str | None) -> bool:
    """Whether a trial drawn from the grid is refused only for entries whose problem `_corner_problems` names (it is
    accepted with them at their reference values): then it is that problem again, not one of its own."""
    references = {k: v for k, v in culprits.get(trial.method, {}).items()
                  if k in trial.options or (k == "budget" and v != trial.budget)}
    if not references:
        return False
    budget = references.pop("budget", trial.budget)
    options = {k: v for k, v in (trial.options | references).items() if v is not _DEFAULT}
    return _trial_problem(dataclasses.replace(trial, budget=budget, options=options), catalog,
                          adapter_options) in (None, said)


_DEFAULT = object()  # an option left out of a reference combination: the method's default
MAX_REFERENCE_TRIES = 1000  # combinations `_reference` tries before giving up


def _distinct(values: list) -> list:
    """``values`` without repeats, in order (1 and 1.0 kept apart: a float range's middle is not its int bound)."""
    out = []
    for v in values:
        if not any(type(v) is type(w) and v == w for w in out):
            out.append(v)
    return out


def _reference(candidates: dict[str, list], problem) -> dict | None:
    """A combination of the candidates (each entry's first, its middle, unless the method refuses it) for which
    ``problem`` finds nothing, moving as few entries off their first candidate as it can; None if there is none in
    `MAX_REFERENCE_TRIES` tries."""
    first = {k: c[0] for k, c in candidates.items()}
    tries = 0
    for n in range(len(candidates) + 1):
        for moved in itertools.combinations(candidates, n):
            for others in itertools.product(*(candidates[k][1:] for k in moved)):
                combo = first | dict(zip(moved, others))
                if problem(combo) is None:
                    return combo
                tries += 1
                if tries >= MAX_REFERENCE_TRIES:
                    return None
    return None


def _space_problems(key: str, searched: space.Space, problem) -> list[str]:
    """What the method refuses among a search space's middle and corners, each with the value (``problem``: that of
    the reference with ``key`` at a value); a float range given for an int option is one problem, with those of its
    values refused for more than being floats."""
    described, middle = searched.describe(), searched.middle
    tried = [(v, problem(v)) for v in _distinct([middle, *searched.corners])]
    found = [(v, p) for v, p in tried if p]
    if not found:
        return []
    # the method takes ints here when the range's middle is refused and its int is not, and no value off the ints
    # that was tried is accepted (mu: uniform[0.2, 2.4] is refused at 1.3 and not at 1, but 0.2 is accepted)
    if searched.kind in ("uniform", "loguniform") and found[0][0] is middle and problem(round(middle)) is None \
            and not any(isinstance(v, float) and v != round(v) and not p for v, p in tried):
        lo, hi = math.ceil(searched.args[0]), math.floor(searched.args[1])
        ints = f"{{randint: [{lo}, {hi}]}} or " if lo <= hi and problem(lo) is None and problem(hi) is None else ""
        # the values refused for more than being floats (a bound outside what the method takes) are named too
        others = [(v, p) for v, p in found[1:] if not isinstance(v, float) or problem(round(v)) is not None]
        return [f"grid.{key}: {described} draws floats (here {middle!r}), and the method takes ints: {found[0][1]}; "
                f"search it with {ints}{{choice: [...]}} of ints"] + [f"grid.{key}: {v!r} of {described}: {p}"
                                                                    for v, p in others]
    return [f"grid.{key}: {v!r} of {described}: {p}" for v, p in found]


def _trial_problem(trial: Trial, catalog: MethodCatalog, adapter_options: dict) -> str | None:
    """What promprune refuses in a trial's budget or options (None: nothing)."""
    if trial.method is not None and (not isinstance(trial.budget, int) or isinstance(trial.budget, bool)
                                     or trial.budget < 1):
        return f"budget: expected an int >= 1, got {trial.budget!r}"
    options = dict(trial.options)
    if options.get("mu") == CALIBRATE:  # a number after calibration: check the rest with a stand-in
        options["mu"] = 0.5
    problem = catalog.validate(trial.method, trial.budget, options, adapter_options)
    mu = options.get("mu")
    if problem is None and isinstance(mu, (int, float)) and not isinstance(mu, bool) and not 0 <= mu <= 1:
        # the library takes any mu (a test pins a split with mu -5); in a spec it is a slip, e.g. 42 for 0.42
        return (f"option 'mu' is {mu!r}, outside [0, 1], where every prominence metric lies (a normalized entropy), "
                "so every image would get the same split; mu is the metric's value where the split is even (0.42 for "
                "CLIP encoders, 0.5744 for Qwen2.5-VL's; `calibrate` measures it); a fixed split is method "
                "fixed_ratio")
    if problem and isinstance(mu, str) and did_you_mean(mu, [CALIBRATE]):  # mu: calibrat
        problem = f"{problem} (did you mean {CALIBRATE!r}, which measures mu on calibration.images?)"
    return problem


def _trials_of(combos: list[dict], catalog: MethodCatalog, repeats: int = 1) -> list[Trial]:
    """Grid combinations as trials: options only for the methods that take them (`mu` is dropped for divprune),
    each distinct trial once, in order."""
    out: list[Trial] = []
    seen: set[str] = set()
    takes: dict[str, set[str] | None] = {}  # each method's options, asked once (the registry's lookup: ~10 us)
    for combo in combos:
        combo = dict(combo)
        method, budget = combo.pop("method"), combo.pop("budget")
        tasks = combo.pop("tasks", None)
        if not isinstance(method, str):
            accepted = catalog.options(method)
        elif method in takes:
            accepted = takes[method]
        else:
            accepted = takes[method] = catalog.options(method)
        options = {k: v for k, v in combo.items() if accepted is None or k in accepted}
        for r in range(repeats):
            trial = Trial(method, budget, options, r, None if tasks is None else tuple(tasks))
            if trial.trial_id not in seen:
                seen.add(trial.trial_id)
                out.append(trial)
    return out


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, list) else [v]


# ----------------------------------------------------------------------------------------------------------------
# expansion


class SearchSpaceError(ValueError):
    """A random or optuna search asks for more distinct trials than its space holds."""


def expand(spec: SweepSpec, *, catalog: MethodCatalog | None = None) -> list[Trial]:
    """Every trial the sweep runs that is known before it starts: the baseline first, then the grid's trials (every
    combination, or `tune.num_samples` random draws), then `trials`; a trial listed twice runs once. With
    ``tune.search: optuna`` the grid's trials are chosen while the sweep runs, so only the others are here."""
    catalog = catalog or MethodCatalog()
    baseline, searched, explicit = parts(spec, catalog=catalog)
    ids = {t.trial_id for t in searched}
    return baseline + searched + [t for t in explicit if t.trial_id not in ids]


def check_optuna_space(spec: SweepSpec, catalog: MethodCatalog | None = None) -> None:
    """`SearchSpaceError` when an optuna search asks for more samples than its finite grid holds distinct trials: the
    spec's check (`check_trials`, once as the spec is parsed), not `parts`'s, which a sweep calls a dozen times and
    for optuna lists no grid trial (a grid of up to `MAX_ENUMERATED` combinations was listed on every call)."""
    if spec.tune.search == "optuna" and spec.grid:
        _check_distinct(distinct_trials(spec.grid, catalog or MethodCatalog()), spec.tune.num_samples,
                        "optuna proposes a trial per sample, and a trial proposed again is not run again")


def parts(spec: SweepSpec, *, catalog: MethodCatalog | None = None) -> tuple[list[Trial], list[Trial], list[Trial]]:
    """(the baseline's trials, the grid's trials, the explicit `trials`), each as `expand` runs them: grid options
    only go to methods that accept them, and combinations that become identical run once. The grid's trials are
    empty for optuna, which chooses them while the sweep runs (whether its num_samples fit a finite grid is the
    spec's check, `check_optuna_space`)."""
    catalog = catalog or MethodCatalog()
    repeats = spec.tune.num_samples if spec.tune.search == "grid" else 1
    if spec.tune.search == "random" and spec.grid:
        searched = draws(spec.grid, spec.tune.num_samples, spec.tune.seed, catalog)
    elif spec.tune.search == "grid" and not any(space.is_distribution(v) for v in spec.grid.values()):
        searched = _trials_of(_grid_combos(spec.grid), catalog, repeats)  # (distributions: `check_search` says)
    else:
        searched = []
    explicit = _trials_of([dict(t) for t in spec.trials], catalog, repeats)
    baseline = [Trial(None, None, {}, r) for r in range(repeats)] if spec.baseline else []
    return baseline, searched, explicit


def search_corners(spec: SweepSpec, *, catalog: MethodCatalog | None = None) -> list[Trial]:
    """With ``tune.search: optuna``, the trials at the corners of the grid's spaces, crossed (every value of a list or
    choice, both ends of a range, as `Space.corners`): what a check of the trials optuna may sample while the sweep
    runs tries before it (`expand` lists none of them). A problem that only grows as a value moves one way (a budget
    too small to give each view a token, below an in-LLM schedule's floor; too large to prune) is at a range's end if
    it is anywhere in the range, so the corners find it exactly. Empty for the other searches: `expand` lists the
    trials they run."""
    if spec.tune.search != "optuna" or not spec.grid:
        return []
    corners = {k: space.parse(v).corners for k, v in spec.grid.items()}
    return _trials_of(_grid_combos(corners), catalog or MethodCatalog())


MAX_DRAWS_PER_TRIAL = 100  # a random search gives up on distinct draws after this many draws per trial asked for


def draws(grid: dict, n: int, seed: int, catalog: MethodCatalog) -> list[Trial]:
    """``n`` distinct trials drawn from the grid's lists and distributions with ``random.Random(seed)``.

    A finite space (lists, choices, randints) is drawn without replacement from its distinct trials (options a
    method does not take dropped first, so `divprune` with `mu: [0.4, 0.5]` is one trial, not two; listed once per
    grid, `distinct_trials`); asking for more than it holds is a `SearchSpaceError`. A space with a continuous range
    is drawn one combination at a time, a trial already drawn drawn again (`MAX_DRAWS_PER_TRIAL` draws per trial at
    most)."""
    rng = random.Random(seed)
    spaces = {k: space.parse(v) for k, v in grid.items()}
    distinct = distinct_trials(grid, catalog)
    if distinct is not None:
        _check_distinct(distinct, n, "a random search draws without replacement")
        return rng.sample(distinct, n)
    out: list[Trial] = []
    seen: set[str] = set()
    for _ in range(MAX_DRAWS_PER_TRIAL * n):
        (trial,) = _trials_of([{k: s.sample(rng) for k, s in spaces.items()}], catalog)
        if trial.trial_id not in seen:
            seen.add(trial.trial_id)
            out.append(trial)
            if len(out) == n:
                return out
    raise SearchSpaceError(f"tune.num_samples: {len(out)} distinct trials found in {MAX_DRAWS_PER_TRIAL * n} random "
                           f"draws, {n} asked (the ranges are too narrow for {space.SIGNIFICANT} significant digits, "
                           "or the lists too short)")


MAX_ENUMERATED = 100_000  # a finite space larger than this is drawn like a continuous one (no full listing)
# the grids whose distinct trials a process keeps listed (`distinct_trials`), the latest used: a driver has one
# spec; a listing holds ~0.4 KB a trial (13 MB for the 32,408 distinct trials of 97,200 combinations)
LISTINGS_KEPT = 2


def distinct_trials(grid: dict, catalog: MethodCatalog) -> list[Trial] | None:
    """Every distinct trial of a finite grid (lists, choices, randints; options a method does not take dropped
    first), or None for a space with a continuous range or larger than `MAX_ENUMERATED`.

    Listed once per grid and catalog in a process (the `LISTINGS_KEPT` latest kept): a random search's `parts`,
    which a sweep calls about a dozen times (`expand` on the driver, `search.phases`, the console's lines), listed
    up to `MAX_ENUMERATED` combinations, a `Trial` and its id each, on every call (~1 s each). The key is the
    grid's content, keys in order (the listing's order, which the seeded draws depend on), types kept (``1`` and
    ``1.0`` are other ids), and what the listing reads of the catalog: each registered method's option names (a
    sweep's every call makes its own `MethodCatalog`; a plugin's method registered later is another key). A grid
    holding a value of another type is listed every time. The `Trial`s are shared between calls (frozen: never
    change their option dicts); the list is the caller's."""
    key = _listing_key(grid, catalog)
    with _LISTINGS_LOCK:
        listed = _LISTINGS.get(key, _UNLISTED) if key is not None else _UNLISTED
        if listed is not _UNLISTED:
            _LISTINGS.move_to_end(key)
    if listed is _UNLISTED:
        listed = _listed(grid, catalog)
        if key is not None:
            with _LISTINGS_LOCK:
                _LISTINGS[key] = listed
                while len(_LISTINGS) > LISTINGS_KEPT:
                    _LISTINGS.popitem(last=False)
    return None if listed is None else list(listed)


_LISTINGS: collections.OrderedDict = collections.OrderedDict()  # `_listing_key` -> `_listed`, least recent first
_LISTINGS_LOCK = threading.Lock()
_UNLISTED = object()


def _listed(grid: dict, catalog: MethodCatalog) -> tuple[Trial, ...] | None:
    spaces = {k: space.parse(v) for k, v in grid.items()}
    if any(s.finite is None for s in spaces.values()) or math.prod(s.size for s in spaces.values()) > MAX_ENUMERATED:
        return None
    return tuple(_trials_of(_grid_combos({k: s.finite for k, s in spaces.items()}), catalog))


def _listing_key(grid: dict, catalog: MethodCatalog) -> tuple | None:
    """What `_listed` depends on, hashable (None: a value `_frozen` does not know, or a catalog without names)."""
    try:
        names = sorted(catalog.names)
        return _frozen(grid), tuple((m, tuple(sorted(catalog.options(m)))) for m in names)
    except (TypeError, AttributeError):
        return None


def _frozen(value: Any) -> tuple:
    """``value`` (a spec's grid: dicts, lists, scalars) as a hashable key that tells apart what `_trials_of` tells
    apart: the order of a dict's keys and of a list's items, a value's type (``1``, ``1.0``, ``True``), ``-0.0``.
    TypeError for anything else."""
    if isinstance(value, dict):
        return "dict", tuple((_frozen(k), _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_frozen(v) for v in value)
    if value is None or type(value) in (bool, int, float, str):
        return type(value).__name__, repr(value)
    raise TypeError(f"{type(value).__name__} in a grid")


def _check_distinct(distinct: list[Trial] | None, n: int, why: str) -> None:
    """`SearchSpaceError` when a search asks for ``n`` trials of a finite grid holding fewer distinct ones."""
    if distinct is not None and n > len(distinct):
        raise SearchSpaceError(f"tune.num_samples: {n} trials asked, and the grid holds {len(distinct)} distinct ones "
                               f"({why}; use num_samples <= {len(distinct)}, or tune.search: grid to run them all)")


def _grid_combos(grid: dict) -> list[dict]:
    if not grid:
        return []
    keys = list(grid)
    axes = [_as_list(grid[k]) for k in keys]
    return [dict(zip(keys, values)) for values in itertools.product(*axes)]
