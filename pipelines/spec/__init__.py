"""Sweep specs: load a `sweeps/*.yaml` file, validate it completely, expand it into trials.

A spec is YAML (see sweeps/README.md for every field). Loading is three steps:

1. `load_raw(path)` (`loading.py`): read the file, resolve `include:` (deep merge, the including file wins), apply
   `--set` overrides (`key.sub=value`, the value parsed as YAML).
2. `parse(raw)`: import the spec's `plugins` (`pipelines/plugins.py`), then check every field against the schema
   (`schema.py`, pydantic); unknown or mistyped fields, bad types and bad method names/options are collected and
   raised together as one `SpecError` (`errors.py`, with "did you mean" hints). No model is loaded and no GPU is
   needed: methods and their options are checked through `promprune`'s registry.
3. `expand(spec)` (`trials.py`): the cartesian product of every list in `grid` (or, for `tune.search: random`,
   seeded draws from its lists and distributions, `space.py`), plus the explicit `trials`, plus the unpruned
   baseline, as `Trial`s with stable, human-readable ids (the same config gives the same id every night). An
   optuna search chooses its trials while it runs (`pipelines/run/search.py`).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from pipelines import plugins
from pipelines.config import AUTO
from pipelines.spec.errors import SpecError
from pipelines.spec.loading import deep_merge, load_raw
from pipelines.spec.schema import COMMANDS, GENERATION_KEYS, SCHEDULERS, SEARCHES, SECTIONS, TOP_LEVEL, SweepSpec, \
    TuneSpec, validate
from pipelines.spec.trials import MethodCatalog, SearchSpaceError, Trial, check_trials, expand, metric_in_trials, \
    parts, search_corners, trial_id
from pipelines.weights import ATTN_IMPLEMENTATIONS, DTYPES

__all__ = ["ATTN_IMPLEMENTATIONS", "AUTO", "COMMANDS", "DTYPES", "GENERATION_KEYS", "SCHEDULERS", "SEARCHES",
           "SECTIONS", "TOP_LEVEL", "MethodCatalog", "SearchSpaceError", "SpecError", "SweepSpec", "Trial", "TuneSpec",
           "check_command", "check_trials", "deep_merge", "dump_resolved", "expand", "load", "load_raw",
           "metric_in_trials", "parse", "parts", "search_corners", "trial_id"]


def load(path: str | Path, overrides: list[str] | None = None, *, check_methods: bool = True) -> SweepSpec:
    """Read, merge, override and validate a spec file; raises SpecError listing every problem."""
    return parse(load_raw(path, overrides), source=str(path), check_methods=check_methods)


def parse(raw: dict, *, source: str = "sweep spec", check_methods: bool = True) -> SweepSpec:
    """Validate a raw spec mapping (after include/overrides) into a SweepSpec; all errors at once. The spec's
    `plugins` are imported first (the methods they register are checked like ours); one that fails to import is
    the only problem reported, since the methods cannot be checked without it."""
    entries = [raw["plugins"]] if isinstance(raw.get("plugins"), str) else raw.get("plugins")
    if check_methods and isinstance(entries, list) and all(isinstance(p, str) for p in entries):
        problems = plugins.load(entries)  # other shapes: the schema reports them
        if problems:
            raise SpecError(problems, source)
    catalog = MethodCatalog() if check_methods else None
    spec, errors = validate(raw, catalog)
    if spec is not None:  # the checks of a whole spec, reported with the fields' problems, not after they are fixed
        # a grid or trials that `validate` set aside for a problem it reported is not empty: nothing more said of it
        grid_empty = not spec.grid and not any(e.startswith("grid") for e in errors)
        if grid_empty and not spec.trials and not spec.baseline and not any(e.startswith("trials") for e in errors):
            errors.append("grid/trials: the spec runs nothing (empty grid, no trials, baseline: false)")
        else:
            if grid_empty and spec.tune.search != "grid":
                errors.append(f"tune.search: {spec.tune.search} draws its trials from the grid, and the grid is empty "
                              "(give grid: a method, a budget and the values or ranges to search, or set tune.search: "
                              "grid to run the baseline and the listed trials as they are)")
            if catalog is not None:  # a field left at its default by `validate` was reported already
                reported = {e.split(": ", 1)[0] for e in errors}
                errors += [e for e in check_trials(spec, catalog) if e.split(": ", 1)[0] not in reported]
    if errors:
        raise SpecError(errors, source)
    return spec


def check_command(spec: SweepSpec, command: str, source: str) -> None:
    """Raises SpecError when the spec is written for another entry point than ``command`` (its `command` field): a
    spec for pipelines/fig2_concentration.py run as a sweep would spend hours on the wrong thing without a word, and a
    sweep's spec run by fig2_concentration.py drew a figure of nothing (Spearman nan)."""
    if spec.command != command:
        raise SpecError([f"command: {spec.command}: this spec is for {COMMANDS[spec.command]}, not "
                         f"{COMMANDS[command]}"], source,
                        fix=f"run it with: python {COMMANDS[spec.command]} --config {source}")


def dump_resolved(spec: SweepSpec) -> str:
    """The fully resolved spec (includes merged, overrides applied, defaults filled) as YAML."""
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)
