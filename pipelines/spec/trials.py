"""A spec's trials: expansion of the grid and the explicit trials into `Trial`s with stable ids, and the check of
every trial's method options and values against promprune's registry (no model load)."""
from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

from pipelines.calibration import CALIBRATE, metrics_to_calibrate
from pipelines.spec.errors import unknown
from pipelines.spec.schema import SweepSpec


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
    """Budgets and option values of every trial the spec expands to, and the calibration they need (all errors).
    Method and option names were checked by the schema."""
    catalog = catalog or MethodCatalog()
    adapter_options, errors = catalog.check_adapter_options(spec.model.options)
    trials = expand(spec, catalog=catalog)
    for trial in [t for t in trials if t.repeat == 0]:  # a repeat has its first run's config
        if trial.method is not None and (not isinstance(trial.budget, int) or isinstance(trial.budget, bool)
                                         or trial.budget < 1):
            errors.append(f"budget: expected an int >= 1, got {trial.budget!r} (trial {trial.trial_id})")
            continue
        options = dict(trial.options)
        if options.get("mu") == CALIBRATE:  # a number after calibration: check the rest with a stand-in
            options["mu"] = 0.5
        problem = catalog.validate(trial.method, trial.budget, options, adapter_options)
        if problem:
            errors.append(f"trial {trial.trial_id}: {problem}")
    if metrics_to_calibrate(trials) and not spec.calibration.images:
        errors.append("calibration.images: required when a trial sets mu: calibrate (a folder of images, or "
                      "hf:<dataset id>)")
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
