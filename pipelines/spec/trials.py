"""Sweep specs: load a `sweeps/*.yaml` file, validate it completely, expand it into trials.

A spec is YAML (see sweeps/README.md for every field). Loading is three steps:

1. `load_raw(path)`: read the file, resolve `include:` (deep merge, the including file wins), apply `--set`
   overrides (`key.sub=value`, the value parsed as YAML).
2. `parse(raw)`: check every field against the schema below; unknown or mistyped fields, bad types and bad method
   names/options are collected and raised together as one `SpecError` (with "did you mean" hints). No model is
   loaded and no GPU is needed: methods and their options are checked through `promprune`'s registry.
3. `expand(spec)`: the cartesian product of every list in `grid`, plus the explicit `trials`, plus the unpruned
   baseline, as `Trial`s with stable, human-readable ids (the same config gives the same id every night).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from promprune.naming import AUTO as AUTO_DTYPE
from promprune.naming import CANONICAL_DTYPES, did_you_mean

from pipelines.calibration import CALIBRATE, Calibration, metrics_to_calibrate
from pipelines.config import AUTO, Resources
from pipelines.weights import ModelSource

DTYPES = (AUTO_DTYPE, *CANONICAL_DTYPES)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
SEARCHES = ("grid", "random")
# generate() kwargs a spec may set; a typo such as `max_new_token` must fail before any model loads
GENERATION_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "num_beams", "repetition_penalty")


class SpecError(ValueError):
    """Every problem found in a spec, one per line, each naming the offending field."""

    def __init__(self, errors: list[str], source: str = "sweep spec"):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{source}: {len(self.errors)} problem(s):\n{lines}")


# ----------------------------------------------------------------------------------------------------------------
# schema


@dataclass
class TuneSpec:
    search: str = "grid"  # grid: every combination; random: num_samples seeded draws from the grid
    num_samples: int = 1  # grid: repeats of every trial; random: number of draws
    max_concurrent_trials: int | str = AUTO  # auto: as many as the GPUs allow (1 on a CPU machine)
    max_failures: int = 2  # Tune retries of a failed trial (node loss, OOM) before the trial counts as errored
    seed: int = 0  # random search draws
    storage_path: str | None = None  # Tune's experiment dir; None: ./outputs/tune (needs shared storage on clusters)


@dataclass
class SweepSpec:
    name: str
    version: int
    description: str = ""
    model: ModelSource = field(default_factory=ModelSource)  # the loader itself: pretrained, dtype, attention, options
    tasks: list = field(default_factory=lambda: ["easyvqa_yesno", "easyvqa_open"])  # the offline benchmarks
    limit: int | None = None  # per-task sample cap; None: the full benchmark
    baseline: bool = True  # also run the unpruned model once: Rel. divides by it
    bootstrap: int = 0  # resamples for 95% confidence intervals of each task's primary metrics; 0: none
    grid: dict = field(default_factory=dict)
    trials: list = field(default_factory=list)
    generation: dict = field(default_factory=dict)  # generate() kwargs over each task's own; {}: lmms-eval's per task
    resources: Resources = field(default_factory=Resources)
    calibration: Calibration = field(default_factory=Calibration)  # images for trials with mu: calibrate
    tune: TuneSpec = field(default_factory=TuneSpec)

    def to_dict(self) -> dict:
        """The spec as plain data (what `dump_resolved` writes): component fields that are not spec fields, such as
        a ModelSource's published weights, are left out."""
        out = dataclasses.asdict(self)
        for section, cls in SECTIONS.items():
            for f in dataclasses.fields(cls):
                if not f.metadata.get("spec", True):
                    out[section].pop(f.name, None)
        return out


SECTIONS = {"model": ModelSource, "resources": Resources, "tune": TuneSpec, "calibration": Calibration}
TOP_LEVEL = [f.name for f in dataclasses.fields(SweepSpec)] + ["include"]
REQUIRED = ("name", "version")


@dataclass(frozen=True)
class Trial:
    """One evaluation of the sweep: method None is the unpruned baseline."""

    method: str | None
    budget: int | None
    options: dict = field(default_factory=dict)
    repeat: int = 0  # grid search with num_samples > 1 runs each trial several times
    tasks: tuple | None = None  # an explicit trial may run on a subset of the spec's tasks (Table 4); None: all

    @property
    def trial_id(self) -> str:
        return trial_id(self.method, self.budget, self.options, self.repeat, self.tasks)

    def to_dict(self) -> dict:
        return {"method": self.method, "budget": self.budget, "options": dict(self.options), "repeat": self.repeat,
                "tasks": None if self.tasks is None else list(self.tasks), "trial_id": self.trial_id}

    @staticmethod
    def from_dict(d: dict) -> "Trial":
        tasks = d.get("tasks")
        return Trial(d["method"], d["budget"], dict(d.get("options") or {}), int(d.get("repeat", 0)),
                     None if tasks is None else tuple(tasks))


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


# ----------------------------------------------------------------------------------------------------------------
# loading: include + overrides


def load_raw(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The spec file as a dict, `include:` chains merged (this file wins), `--set` overrides applied."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([f"spec file not found: {path}"], str(path))
    raw = _load_with_includes(path, seen=())
    for item in overrides or []:
        _apply_override(raw, item, str(path))
    return raw


def _load_with_includes(path: Path, seen: tuple) -> dict:
    if path.resolve() in seen:
        raise SpecError([f"include cycle: {' -> '.join(str(p) for p in seen + (path,))}"], str(path))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise SpecError([f"not UTF-8 text (byte {exc.start}: {exc.reason}); save the spec as UTF-8"], str(path)) \
            from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f"line {where.line + 1}, column {where.column + 1}: " if where is not None else ""
        raise SpecError([f"malformed YAML: {line}{getattr(exc, 'problem', None) or exc}"], str(path)) from None
    except OSError as exc:
        raise SpecError([f"cannot read the spec ({exc.strerror})"], str(path)) from None
    if not isinstance(data, dict):
        raise SpecError([f"top level must be a mapping, got {type(data).__name__}"], str(path))
    include = data.pop("include", None)
    if include is None:
        return data
    if not isinstance(include, str):
        raise SpecError([f"include: must be a file path string, got {include!r}"], str(path))
    base_path = (path.parent / include)
    if not base_path.is_file():
        raise SpecError([f"include: file not found: {base_path}"], str(path))
    base = _load_with_includes(base_path, seen + (path.resolve(),))
    return deep_merge(base, data)


def deep_merge(base: dict, top: dict) -> dict:
    """Recursive merge of mappings; `top` wins; lists and scalars are replaced, not concatenated."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _apply_override(raw: dict, item: str, source: str) -> None:
    """`grid.budget=[8,4]` sets raw["grid"]["budget"] = [8, 4] (value parsed as YAML)."""
    if "=" not in item:
        raise SpecError([f"override {item!r}: expected key=value, e.g. limit=8 or grid.budget=[8,4]"], source)
    key, value = item.split("=", 1)
    keys = key.strip().split(".")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        raise SpecError([f"override {item!r}: the value is not valid YAML; quote strings with special characters"],
                        source) from None
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise SpecError([f"override {item!r}: {k} is not a mapping"], source)
    node[keys[-1]] = parsed


# ----------------------------------------------------------------------------------------------------------------
# validation


def load(path: str | Path, overrides: list[str] | None = None, *, check_methods: bool = True) -> SweepSpec:
    """Read, merge, override and validate a spec file; raises SpecError listing every problem."""
    return parse(load_raw(path, overrides), source=str(path), check_methods=check_methods)


def parse(raw: dict, *, source: str = "sweep spec", check_methods: bool = True) -> SweepSpec:
    """Validate a raw spec mapping (after include/overrides) into a SweepSpec; all errors at once."""
    errors: list[str] = []
    raw = dict(raw)
    raw.pop("include", None)
    _check_keys(raw, TOP_LEVEL, "", errors)
    for key in REQUIRED:
        if key not in raw:
            errors.append(f"{key}: required field missing")
    spec = SweepSpec(name="?", version=0)
    _set_scalar(spec, raw, "name", str, errors, check=lambda v: bool(v.strip()) and "/" not in v,
                why="a non-empty name without '/'")
    _set_scalar(spec, raw, "version", int, errors, check=lambda v: v >= 1, why="an int >= 1")
    _set_scalar(spec, raw, "description", str, errors)
    _set_scalar(spec, raw, "baseline", bool, errors)
    _set_scalar(spec, raw, "bootstrap", int, errors, check=lambda v: v == 0 or 100 <= v <= 100_000,
                why="0 (no confidence intervals) or a number of resamples in 100..100000")
    if "limit" in raw and raw["limit"] is not None:
        _set_scalar(spec, raw, "limit", int, errors, check=lambda v: v >= 1, why="an int >= 1 or null")
    _parse_tasks(spec, raw, errors)
    for section, cls in SECTIONS.items():
        if section in raw:
            setattr(spec, section, _parse_section(raw[section], cls, section, errors))
    _check_model(spec.model, errors)
    _check_resources(spec.resources, errors)
    n_before_tune = len(errors)
    _check_tune(spec.tune, errors)
    tune_ok = len(errors) == n_before_tune
    _parse_generation(spec, raw, errors)
    n_before_grid = len(errors)
    _parse_grid(spec, raw, errors)
    _parse_trials(spec, raw, errors)
    grid_ok = len(errors) == n_before_grid
    if grid_ok and not spec.grid and not spec.trials and not spec.baseline:
        errors.append("grid/trials: the spec runs nothing (empty grid, no trials, baseline: false)")
    if grid_ok and check_methods:  # reported with the other sections' problems, not after they are fixed
        checked = spec if tune_ok else dataclasses.replace(spec, tune=TuneSpec())
        if not isinstance(checked.model.options, dict):
            checked = dataclasses.replace(checked, model=dataclasses.replace(checked.model, options={}))
        errors.extend(check_trials(checked))
    if errors:
        raise SpecError(errors, source)
    return spec


def _did_you_mean(key: str, valid: list[str]) -> str:
    return f"{did_you_mean(key, valid)}; valid: {', '.join(sorted(valid))}"


def _check_keys(mapping: dict, valid: list[str], prefix: str, errors: list[str]) -> None:
    for key in mapping:
        if key not in valid:
            errors.append(f"{prefix}{key}: unknown field{_did_you_mean(str(key), list(valid))}")


def _type_ok(value: Any, typ: type) -> bool:
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)


def _set_scalar(obj, raw: dict, key: str, typ: type, errors: list[str], prefix: str = "", check=None, why=""):
    if key not in raw:
        return
    value = raw[key]
    if not _type_ok(value, typ) or (check is not None and not check(value)):
        errors.append(f"{prefix}{key}: expected {why or typ.__name__}, got {value!r}")
        return
    setattr(obj, key, value)


def _parse_section(value: Any, cls: type, name: str, errors: list[str]):
    obj = cls()
    if not isinstance(value, dict):
        errors.append(f"{name}: expected a mapping, got {value!r}")
        return obj
    fields = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("spec", True)}
    _check_keys(value, list(fields), f"{name}.", errors)
    for key, v in value.items():
        if key in fields:
            setattr(obj, key, v)  # types are checked per section below, with the field's own rules
    return obj


def _check_model(m: ModelSource, errors: list[str]) -> None:
    if not isinstance(m.pretrained, str) or not m.pretrained.strip():
        errors.append(f"model.pretrained: expected a checkpoint name or path, got {m.pretrained!r}")
    if m.dtype not in DTYPES:
        errors.append(f"model.dtype: {m.dtype!r} is not one of {', '.join(DTYPES)}")
    if m.attn_implementation not in ATTN_IMPLEMENTATIONS:
        errors.append(f"model.attn_implementation: {m.attn_implementation!r} is not one of "
                      f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    if not isinstance(m.options, dict):
        errors.append(f"model.options: expected a mapping of adapter kwargs, got {m.options!r}")


def _auto_or_positive(value: Any, typ: type) -> bool:
    return value == AUTO or (_type_ok(value, typ) and value >= 1)


def _check_resources(r: Resources, errors: list[str]) -> None:
    if not _auto_or_positive(r.workers, int):
        errors.append(f"resources.workers: expected an int >= 1 or 'auto', got {r.workers!r}")
    for key in ("gpus_per_worker", "cpus_per_worker"):
        v = getattr(r, key)
        if not _type_ok(v, float) or v < 0:
            errors.append(f"resources.{key}: expected a number >= 0, got {v!r}")
    if not _type_ok(r.batch_size, int) or r.batch_size < 1:
        errors.append(f"resources.batch_size: expected an int >= 1, got {r.batch_size!r}")
    if not _type_ok(r.actor_wait_s, float) or r.actor_wait_s <= 0:
        errors.append(f"resources.actor_wait_s: expected a number of seconds > 0 (finite), got {r.actor_wait_s!r}")
    if not isinstance(r.share_weights, bool):
        errors.append(f"resources.share_weights: expected true/false, got {r.share_weights!r}")


def _check_tune(t: TuneSpec, errors: list[str]) -> None:
    if t.search not in SEARCHES:
        errors.append(f"tune.search: {t.search!r} is not one of {', '.join(SEARCHES)}")
    if not _type_ok(t.num_samples, int) or t.num_samples < 1:
        errors.append(f"tune.num_samples: expected an int >= 1, got {t.num_samples!r}")
    if not _auto_or_positive(t.max_concurrent_trials, int):
        errors.append(f"tune.max_concurrent_trials: expected an int >= 1 or 'auto', got {t.max_concurrent_trials!r}")
    if not _type_ok(t.max_failures, int) or t.max_failures < -1:
        errors.append(f"tune.max_failures: expected an int >= 0 (or -1: unlimited), got {t.max_failures!r}")
    if not _type_ok(t.seed, int):
        errors.append(f"tune.seed: expected an int, got {t.seed!r}")
    if t.storage_path is not None and not isinstance(t.storage_path, str):
        errors.append(f"tune.storage_path: expected a path or URI string, got {t.storage_path!r}")


def _parse_tasks(spec: SweepSpec, raw: dict, errors: list[str]) -> None:
    if "tasks" not in raw:
        return
    tasks = raw["tasks"]
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) and t for t in tasks):
        errors.append(f"tasks: expected a non-empty list of lmms-eval task names, got {raw['tasks']!r}")
        return
    dupes = sorted({t for t in tasks if tasks.count(t) > 1})
    if dupes:
        errors.append(f"tasks: listed more than once: {', '.join(dupes)}")
    spec.tasks = tasks


def _parse_generation(spec: SweepSpec, raw: dict, errors: list[str]) -> None:
    if "generation" not in raw:
        return
    gen = raw["generation"]
    if not isinstance(gen, dict):
        errors.append(f"generation: expected a mapping of generate() kwargs, got {gen!r}")
        return
    _check_keys(gen, list(GENERATION_KEYS), "generation.", errors)
    mnt = gen.get("max_new_tokens", 1)
    if not _type_ok(mnt, int) or mnt < 1:
        errors.append(f"generation.max_new_tokens: expected an int >= 1, got {mnt!r}")
    spec.generation = dict(gen)


def _parse_grid(spec: SweepSpec, raw: dict, errors: list[str]) -> None:
    grid = raw.get("grid")
    if grid is None:
        return
    if not isinstance(grid, dict):
        errors.append(f"grid: expected a mapping of field -> value or list of values, got {grid!r}")
        return
    for key, value in grid.items():
        if isinstance(value, list) and not value:
            errors.append(f"grid.{key}: empty list")
    if grid and "method" not in grid:
        errors.append("grid.method: required when grid is set (a method name or a list of them)")
    if grid and "budget" not in grid:
        errors.append("grid.budget: required when grid is set (an int or a list of them)")
    spec.grid = dict(grid)


def _parse_trials(spec: SweepSpec, raw: dict, errors: list[str]) -> None:
    trials = raw.get("trials")
    if trials is None:
        return
    if not isinstance(trials, list):
        errors.append("trials: expected a list of mappings like {method: fastv, budget: 64, layer: 2}, "
                      f"got {trials!r}")
        return
    for i, t in enumerate(trials):
        if not isinstance(t, dict):
            errors.append(f"trials[{i}]: expected a mapping, got {t!r}")
            continue
        for key in ("method", "budget"):
            if key not in t:
                errors.append(f"trials[{i}].{key}: required field missing")
        for key in ("method", "budget"):
            if isinstance(t.get(key), (list, dict)):
                errors.append(f"trials[{i}].{key}: explicit trials take one value, got {t[key]!r} "
                              "(use grid: for lists)")
        if "tasks" in t:
            sub_tasks = t["tasks"]
            if not isinstance(sub_tasks, list) or not sub_tasks or not all(isinstance(x, str) for x in sub_tasks):
                errors.append(f"trials[{i}].tasks: expected a non-empty list of the spec's task names, "
                              f"got {sub_tasks!r}")
            else:
                extra = [x for x in sub_tasks if x not in spec.tasks]
                if extra:
                    errors.append(f"trials[{i}].tasks: {extra} not in the spec's tasks {spec.tasks} (a trial runs on "
                                  "a subset of them)")
    spec.trials = list(trials)


# ----------------------------------------------------------------------------------------------------------------
# method registry checks (through promprune; no model load)


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

    def check_adapter_options(self, options: dict) -> tuple[dict, list[str]]:
        """(the known adapter options, errors naming unknown ones and bad values)."""
        known = self._models.ADAPTER_OPTIONS
        errors = [f"model.options.{k}: unknown adapter option{_did_you_mean(str(k), list(known))}"
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


def check_trials(spec: SweepSpec) -> list[str]:
    """Method names, option names and values of every grid combination and explicit trial (all errors)."""
    catalog = MethodCatalog()
    errors: list[str] = []
    grid_methods = _as_list(spec.grid.get("method", []))
    for m in grid_methods:
        if m not in catalog.names:
            errors.append(f"grid.method: unknown method {m!r}{_did_you_mean(str(m), catalog.names)}")
    option_keys = [k for k in spec.grid if k not in ("method", "budget")]
    known_methods = [m for m in grid_methods if m in catalog.names]
    all_options = sorted(set().union(*[catalog.options(m) or set() for m in catalog.names]))
    for key in option_keys:
        takers = [m for m in known_methods if key in (catalog.options(m) or {key})]
        if known_methods and not takers:
            errors.append(f"grid.{key}: no method in grid.method accepts this option{_did_you_mean(key, all_options)}")
    for i, t in enumerate(spec.trials):
        m = t.get("method")
        if m not in catalog.names:
            errors.append(f"trials[{i}].method: unknown method {m!r}{_did_you_mean(str(m), catalog.names)}")
    if errors:
        return errors
    adapter_options, problems = catalog.check_adapter_options(spec.model.options)
    errors.extend(problems)
    for trial in expand(spec, catalog=catalog):
        if trial.method is not None and (not _type_ok(trial.budget, int) or trial.budget < 1):
            errors.append(f"budget: expected an int >= 1, got {trial.budget!r} (trial {trial.trial_id})")
            continue
        options = dict(trial.options)
        if options.get("mu") == CALIBRATE:  # a number after calibration: check the rest with a stand-in
            options["mu"] = 0.5
        problem = catalog.validate(trial.method, trial.budget, options, adapter_options)
        if problem:
            errors.append(f"trial {trial.trial_id}: {problem}")
    if metrics_to_calibrate(expand(spec, catalog=catalog)):
        cal = spec.calibration
        if not cal.images or not isinstance(cal.images, str):
            errors.append("calibration.images: required when a trial sets mu: calibrate (a folder of images, or "
                          "hf:<dataset id>)")
        if not isinstance(cal.n, int) or isinstance(cal.n, bool) or cal.n < 1:
            errors.append(f"calibration.n: expected an int >= 1, got {cal.n!r}")
    return list(dict.fromkeys(errors))  # one adapter-option problem repeats in every trial: report it once


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, list) else [v]


# ----------------------------------------------------------------------------------------------------------------
# expansion


def expand(spec: SweepSpec, *, catalog: MethodCatalog | None = None) -> list[Trial]:
    """Every trial the sweep runs: baseline first, then the grid (or random draws from it), then `trials`.

    Grid options only go to methods that accept them (`mu` is dropped for `divprune`), and the combinations that
    become identical are run once. Random search: `tune.num_samples` seeded draws from the grid.
    """
    catalog = catalog or MethodCatalog()
    combos = _grid_combos(spec.grid)
    if spec.tune.search == "random" and combos:
        rng = random.Random(spec.tune.seed)
        combos = [rng.choice(combos) for _ in range(spec.tune.num_samples)]
    out: list[Trial] = []
    seen: set[str] = set()
    repeats = spec.tune.num_samples if spec.tune.search == "grid" else 1
    candidates = [dict(c) for c in combos] + [dict(t) for t in spec.trials]
    for combo in candidates:
        method, budget = combo.pop("method"), combo.pop("budget")
        tasks = combo.pop("tasks", None)
        accepted = catalog.options(method)
        options = {k: v for k, v in combo.items() if accepted is None or k in accepted}
        for r in range(repeats):
            trial = Trial(method, budget, options, r, None if tasks is None else tuple(tasks))
            if trial.trial_id not in seen:
                seen.add(trial.trial_id)
                out.append(trial)
    baseline = [Trial(None, None, {}, r) for r in range(repeats)] if spec.baseline else []
    return baseline + out


def _grid_combos(grid: dict) -> list[dict]:
    if not grid:
        return []
    keys = list(grid)
    axes = [_as_list(grid[k]) for k in keys]
    return [dict(zip(keys, values)) for values in itertools.product(*axes)]


def dump_resolved(spec: SweepSpec) -> str:
    """The fully resolved spec (includes merged, overrides applied, defaults filled) as YAML."""
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)
