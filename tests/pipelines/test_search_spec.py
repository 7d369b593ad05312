"""Search spaces in a spec: their checks (one problem per field, named, with the fix), random search without
replacement and seeded, optuna's param space, ASHA's rungs against Ray's own scheduler, the trial a sampled config
runs, the prefix of answered samples a rung is scored on, and a trial's reports at every rung, in order, judged by
Tune's ASHA (no Ray cluster, no model)."""
from __future__ import annotations

import math

import pyarrow as pa
import pytest

from pipelines import spec as specs
from pipelines.run import search
from pipelines.spec import space

GRID = {"method": ["promprune"], "budget": [16], "mu": {"uniform": [0.2, 0.3]}, "tau": {"loguniform": [0.005, 0.08]}}


def parse(grid=None, **tune):
    return specs.parse({"name": "s", "version": 1, "grid": GRID if grid is None else grid,
                        "tune": {"search": "random", "num_samples": 5, **tune}})


def problems(grid=None, **tune) -> list[str]:
    with pytest.raises(specs.SpecError) as info:
        parse(grid, **tune)
    return info.value.errors


# ---------------------------------------------------------------------------------------------------------------
# checks


@pytest.mark.parametrize("value,expected", [
    ({"uniform": [0.3, 0.2]}, "grid.mu: uniform: expected two finite numbers lo < hi, got [0.3, 0.2]"),
    ({"uniform": [0.2]}, "grid.mu: uniform: expected [lo, hi], got [0.2]"),
    ({"loguniform": [0, 0.1]}, "grid.mu: loguniform: expected 0 < lo < hi, got [0, 0.1]"),
    ({"randint": [1.5, 3]}, "grid.mu: randint: expected two ints lo <= hi (both included), got [1.5, 3]"),
    ({"choice": []}, "grid.mu: choice: expected a non-empty list, got []"),
    ({"unifrom": [0.2, 0.3]}, "grid.mu: expected a value, a list, or one of {uniform: [lo, hi]}"),
    ({"uniform": [0.2, 0.3], "choice": [1]}, "grid.mu: expected a value, a list, or one of"),
])
def test_a_bad_space_is_one_problem_naming_the_field(value, expected):
    found = problems({**GRID, "mu": value})
    assert len(found) == 1 and found[0].startswith(expected), found


def test_a_method_is_chosen_never_drawn_and_choices_are_checked_names():
    assert problems({**GRID, "method": {"uniform": [0, 1]}}) == [
        "grid.method: a method is chosen from a list or {choice: [...]}, not drawn from {'uniform': [0, 1]}"]
    (found,) = problems({**GRID, "method": {"choice": ["promprune", "divprne"]}})
    assert found.startswith("grid.method: unknown method 'divprne' (did you mean 'divprune'?)")


def test_a_range_whose_bound_the_method_refuses_is_named_with_its_option():
    assert problems({**GRID, "tau": {"uniform": [0, 0.1]}}) == [
        "grid.tau: 0 of uniform[0, 0.1]: option 'tau' must be in (0, inf), got 0"]


def test_a_float_range_on_an_int_option_is_one_problem_under_its_own_field():
    # FastV's layer takes ints; uniform[1, 3] draws floats (its bounds, ints as written, pass; its middle 2.0 does
    # not): the problem was filed under grid.mu and grid.tau, whose corners were tried with layer at 2.0, 4 times
    grid = {"method": ["fastv", "promprune"], "budget": [8], "layer": {"uniform": [1, 3]},
            "mu": {"uniform": [0.2, 0.3]}, "tau": {"loguniform": [0.01, 0.1]}}
    (found,) = problems(grid, num_samples=2)
    assert found.startswith("grid.layer: uniform[1, 3] draws floats (here 2.0), and the method takes ints: option "
                            "'layer' of fastv must be None") and found.endswith(
        "got 2.0; search it with {randint: [1, 3]} or {choice: [...]} of ints"), found
    assert problems({**grid, "layer": {"randint": [1, 3]}, "mu": {"uniform": [0.2, 1.3]}}, num_samples=2) == [
        f"grid.mu: 1.3 of uniform[0.2, 1.3]: option 'mu' is 1.3, outside [0, 1], {MU_OUTSIDE}"]


MU_OUTSIDE = ("where every prominence metric lies (a normalized entropy), so every image would get the same split; mu "
              "is the metric's value where the split is even (0.42 for CLIP encoders, 0.5744 for Qwen2.5-VL's; "
              "`calibrate` measures it); a fixed split is method fixed_ratio")


@pytest.fixture
def int_option_method():
    """A method of one's own, ``t_first``, whose option ``k`` takes ints (its default 1); gone after the test."""
    import promprune
    from promprune.selection import registry

    @promprune.register_method("t_first", options={"k": 1})
    def first(tokens, budget, *, k):
        """The first tokens."""
        raise AssertionError("a spec check runs no method")

    yield "t_first"
    registry._REGISTRY.pop("t_first")


def test_each_entry_is_tried_with_the_others_at_values_the_method_takes(int_option_method):
    # one mistake (a float range on an int option) was 10 problems, 6 of them under the other entries, whose
    # corners were tried with k at its middle 1.5
    grid = {"method": [int_option_method, "promprune"], "budget": {"randint": [8, 16]}, "k": {"uniform": [0.5, 2.5]},
            "mu": {"uniform": [0.2, 0.3]}, "tau": {"loguniform": [0.01, 0.1]}}
    assert problems(grid, num_samples=1, seed=1) == [
        "grid.k: uniform[0.5, 2.5] draws floats (here 1.5), and the method takes ints: option 'k' of method "
        "'t_first' must be an int, got 1.5; search it with {randint: [1, 2]} or {choice: [...]} of ints"]
    # no int inside the range: no randint to suggest
    (found,) = problems({**grid, "k": {"uniform": [0.2, 0.4]}}, num_samples=1, seed=1)
    assert found.startswith("grid.k: uniform[0.2, 0.4] draws floats (here 0.3)") and found.endswith(
        "got 0.3; search it with {choice: [...]} of ints"), found
    # two entries wrong at once: each under its own field, tried with the other at a value the method takes
    found = problems({**grid, "k": {"uniform": [0.5, 2.5]}, "mu": {"uniform": [0.5, 1.5]}}, num_samples=1, seed=1)
    assert [p.split(": ")[0] for p in found] == ["grid.k", "grid.mu"], found
    assert found[1] == f"grid.mu: 1.5 of uniform[0.5, 1.5]: option 'mu' is 1.5, outside [0, 1], {MU_OUTSIDE}"


def test_the_search_settings_are_checked_against_the_grid_and_the_spec():
    assert problems(search="grid") == [
        "grid.mu: uniform[0.2, 0.3] is a search space, and tune.search: grid runs the grid's lists only (set "
        "tune.search: random or optuna, or give a list)",
        "grid.tau: loguniform[0.005, 0.08] is a search space, and tune.search: grid runs the grid's lists only (set "
        "tune.search: random or optuna, or give a list)"]
    found = problems(search="optuna", metric="pope/f1", mode="up")
    assert "tune.mode: 'up' is not one of max, min" in found
    assert "tune.metric: 'pope/f1' names no task of the spec's ['easyvqa_yesno', 'easyvqa_open'] (write " \
           "'<task>/<metric>', or rel)" in found
    assert problems(metric="f1") == ["tune.metric: expected 'rel' or a task metric '<task>/<metric>' (e.g. "
                                     "pope/pope_f1_score), got 'f1'"]
    with pytest.raises(specs.SpecError, match="tune.metric: rel divides by the unpruned model's scores, and "
                                              "baseline is false"):
        specs.parse({"name": "s", "version": 1, "baseline": False, "grid": GRID,
                     "tune": {"search": "random", "num_samples": 2, "scheduler": "asha"}})
    found = problems({**GRID, "saliency_ratio_range": [[0.1, 0.9], [0.2, 0.8]]}, search="optuna")
    assert any(p.startswith("grid.saliency_ratio_range: optuna chooses among numbers, strings, bools and null, "
                            "not [0.1, 0.9]") for p in found), found


EMPTY_GRID = ("tune.search: {} draws its trials from the grid, and the grid is empty (give grid: a method, a budget "
              "and the values or ranges to search, or set tune.search: grid to run the baseline and the listed trials "
              "as they are)")


def test_a_search_without_a_grid_is_refused_once_naming_the_fix():
    """A search draws its trials from the grid: with none (a spec of explicit trials set to tune.search: random) it
    is refused, naming the field and both ways on; also without the method check (`check_methods=False`), which
    skipped it. A grid that `validate` set aside for its own problem is not called empty: that problem alone."""
    assert problems({}, search="random") == [EMPTY_GRID.format("random")]
    trials = {"name": "t", "version": 1, "trials": [{"method": "promprune", "budget": 8}],
              "tune": {"search": "optuna", "num_samples": 2}}
    for check_methods in (True, False):
        with pytest.raises(specs.SpecError) as info:
            specs.parse(trials, check_methods=check_methods)
        assert info.value.errors == [EMPTY_GRID.format("optuna")]
    for grid in ({"method": ["nosuch"], "budget": [8]}, {"budget": [8]}, ["promprune"]):
        found = problems(grid, search="random")
        assert len(found) == 1 and found[0].startswith("grid") and "grid is empty" not in found[0], found
    assert specs.parse({**trials, "tune": {"search": "grid"}}).trials  # the first way on: the trials as listed


# ---------------------------------------------------------------------------------------------------------------
# random search


def _grid_ids(grid: dict) -> set[str]:
    """Every distinct trial of the grid, as a plain grid search expands it (the independent reference)."""
    spec = specs.parse({"name": "g", "version": 1, "baseline": False, "grid": grid})
    return {t.trial_id for t in specs.expand(spec)}


def test_random_search_draws_exactly_num_samples_distinct_trials_from_a_finite_grid():
    grid = {"method": ["promprune", "divprune"], "budget": [16, 8], "mu": [0.2, 0.3, 0.4]}
    # divprune takes no mu: its three mu values are one trial, so the grid holds 2 x 3 + 2 = 8 distinct trials
    assert len(_grid_ids(grid)) == 8
    drawn = [t.trial_id for t in specs.expand(parse(grid, num_samples=8, seed=4)) if t.method]
    assert len(drawn) == 8 and set(drawn) == _grid_ids(grid)  # all of them, none twice
    some = [t.trial_id for t in specs.expand(parse(grid, num_samples=5, seed=4)) if t.method]
    assert len(set(some)) == 5 and set(some) <= _grid_ids(grid)
    assert problems(grid, num_samples=9) == [
        "tune.num_samples: 9 trials asked, and the grid holds 8 distinct ones (a random search draws without "
        "replacement; use num_samples <= 8, or tune.search: grid to run them all)"]


def test_optuna_is_refused_more_samples_than_a_finite_grid_holds_as_random_is():
    """A probe's case: optuna with num_samples 5 over a grid of 2 distinct trials ran 2, the other proposals
    repeats (the counts disagreeing), and --validate-only accepted num_samples 50 over 4."""
    grid = {"method": ["fastv"], "budget": [16], "layer": {"randint": [1, 2]}}
    assert problems(grid, search="optuna", num_samples=5) == [
        "tune.num_samples: 5 trials asked, and the grid holds 2 distinct ones (optuna proposes a trial per sample, "
        "and a trial proposed again is not run again; use num_samples <= 2, or tune.search: grid to run them all)"]
    assert search.searched_trials(parse(grid, search="optuna", num_samples=2)) == 2
    # options a method does not take are dropped before counting: divprune's two mus are one trial (3 in all)
    assert "holds 3 distinct" in problems({"method": ["promprune", "divprune"], "budget": [16], "mu": [0.2, 0.3]},
                                          search="optuna", num_samples=4)[0]
    parse(GRID, search="optuna", num_samples=500)  # a continuous range: no bound


def test_an_optuna_specs_trials_are_listed_without_its_grid(monkeypatch):
    """Whether num_samples fits a finite grid is checked once, as the spec is parsed: `parts` (a sweep calls it a
    dozen times, through `expand`, `search.phases` and the console) lists no combination of the grid, which it
    did on every call (0.87 s each for 97,200 combinations)."""
    from pipelines.spec import trials as spec_trials

    spec = parse({"method": ["fastv"], "budget": [16, 8], "layer": {"randint": [1, 3]}}, search="optuna",
                 num_samples=6)

    def listed(*args, **kwargs):
        raise AssertionError("the grid was listed again")

    monkeypatch.setattr(spec_trials, "distinct_trials", listed)
    assert specs.parts(spec) == ([specs.Trial(None, None, {})], [], [])
    assert [t.trial_id for t in specs.expand(spec)] == ["baseline"]
    assert [p.suffix for p in search.phases(spec)] == ["", search.SEARCH_SUFFIX]
    with pytest.raises(AssertionError, match="listed again"):  # the spec's check is what lists it
        specs.check_trials(spec)


def _reference_listing(grid: dict) -> list[str]:
    """A finite grid's distinct trials, worked out independently of `pipelines.spec.trials`: every combination in
    the grid's order (its keys as given, each list's values as given, a randint's ints ascending), options a method
    does not take (promprune's registry) dropped, each distinct trial once."""
    import itertools

    import promprune

    def values(v):
        if isinstance(v, dict):
            ((kind, arg),) = v.items()
            return list(range(arg[0], arg[1] + 1)) if kind == "randint" else list(arg)
        return v if isinstance(v, list) else [v]

    keys, listed, seen = list(grid), [], set()
    for combo in itertools.product(*(values(grid[k]) for k in keys)):
        combo = dict(zip(keys, combo))
        method, budget = combo.pop("method"), combo.pop("budget")
        accepted = set(promprune.method_spec(method).options)
        tid = specs.Trial(method, budget, {k: v for k, v in combo.items() if k in accepted}).trial_id
        if tid not in seen:
            seen.add(tid)
            listed.append(tid)
    return listed


def _reference_draws(grid: dict, n: int, seed: int) -> list[str]:
    """A random search's draws from a finite grid: ``random.Random(seed).sample`` of `_reference_listing`."""
    import random

    return random.Random(seed).sample(_reference_listing(grid), n)


def _random_grid(rng) -> dict:
    methods = rng.sample(["promprune", "divprune", "fastv", "random"], rng.randint(1, 4))
    grid = {"method": methods if rng.random() < 0.7 else {"choice": methods},
            "budget": rng.sample([4, 8, 16, 32, 64], rng.randint(1, 3))}
    if "promprune" in methods:
        grid["mu"] = rng.sample([0, 1] if rng.random() < 0.2 else [0.2, 0.31, 0.4, 0.55, 0.7], rng.randint(1, 3))
        grid["tau"] = rng.sample([0.005, 0.01, 0.02, 0.04], rng.randint(1, 3))
    if "fastv" in methods:
        grid["layer"] = {"randint": [1, rng.randint(1, 4)]} if rng.random() < 0.5 else rng.sample([1, 2, 3], 2)
    if "random" in methods:
        grid["seed"] = rng.sample([0, 7, 11], rng.randint(1, 2))
    keys = list(grid)
    rng.shuffle(keys)  # the keys' order is the listing's, and so the draws'
    return {k: grid[k] for k in keys}


def test_a_random_search_draws_as_before_however_often_its_trials_are_asked_for():
    """The listing a random search draws from is made once per grid (`distinct_trials`); the draws are those of
    ``random.Random(seed).sample`` over the distinct trials in the grid's order, every call, on random grids (the
    same grid with its keys in another order: other draws, each its own)."""
    import random

    from pipelines.spec import trials as spec_trials

    rng = random.Random(20261207)
    for _ in range(40):
        grid = _random_grid(rng)
        n, seed = rng.randint(1, len(_reference_listing(grid))), rng.randint(0, 10**6)
        expected = _reference_draws(grid, n, seed)
        spec = parse(grid, num_samples=n, seed=seed)
        for _ in range(3):
            assert [t.trial_id for t in specs.parts(spec)[1]] == expected, grid
        reordered = dict(reversed(list(grid.items())))
        assert [t.trial_id for t in specs.parts(parse(reordered, num_samples=n, seed=seed))[1]] == \
            _reference_draws(reordered, n, seed), reordered
        assert [t.trial_id for t in spec_trials.draws(grid, n, seed, specs.MethodCatalog())] == expected
    # an int and a float are other ids (mu=1, mu=1.0): each grid its own listing
    ints, floats = parse({**GRID, "mu": [0, 1], "tau": [0.01]}, num_samples=2, seed=1), \
        parse({**GRID, "mu": [0.0, 1.0], "tau": [0.01]}, num_samples=2, seed=1)
    assert sorted(t.trial_id for t in specs.parts(ints)[1]) == ["promprune-b16-mu=0-tau=0.01",
                                                                  "promprune-b16-mu=1-tau=0.01"]
    assert sorted(t.trial_id for t in specs.parts(floats)[1]) == ["promprune-b16-mu=0.0-tau=0.01",
                                                                    "promprune-b16-mu=1.0-tau=0.01"]


def test_a_random_searchs_grid_is_listed_once_however_often_its_trials_are_asked_for(monkeypatch):
    """A review's case: `parts` (a sweep calls it about a dozen times: `expand` on the driver, `search.phases`, the
    console's lines) listed a random search's whole finite grid on every call (up to `MAX_ENUMERATED` combinations,
    ~1 s each). Now once per grid and catalog; a grid listed `LISTINGS_KEPT` other grids ago is listed again."""
    import collections
    import math

    from pipelines.spec import trials as spec_trials

    monkeypatch.setattr(spec_trials, "_LISTINGS", collections.OrderedDict())  # none listed yet
    listings, trials_of = [], spec_trials._trials_of

    def counted(combos, *args, **kwargs):
        listings.append((len(combos), combos[0].get("mu") if combos else None))
        return trials_of(combos, *args, **kwargs)

    monkeypatch.setattr(spec_trials, "_trials_of", counted)

    def grid_of(mu0: float) -> dict:
        return {"method": ["promprune", "divprune"], "budget": [8, 16, 32],
                "mu": [round(mu0 + i / 100, 2) for i in range(20)], "tau": [0.005, 0.01, 0.02, 0.04]}

    def times_listed(grid) -> int:
        return sum(combos == (math.prod(len(v) for v in grid.values()), grid["mu"][0]) for combos in listings)

    grid = grid_of(0.1)
    spec = parse(grid, num_samples=7, seed=3)  # the spec's check draws them: the one listing
    first = specs.parts(spec)
    for _ in range(10):
        assert specs.parts(spec) == first
    specs.expand(spec)
    search.phases(spec)
    search.searched_trials(spec)
    assert times_listed(grid) == 1  # 16 on the old code
    others = [grid_of(0.3 + i / 10) for i in range(spec_trials.LISTINGS_KEPT)]
    for other in others[:-1]:
        specs.parts(parse(other, num_samples=2))
    specs.parts(spec)
    assert times_listed(grid) == 1  # kept: fewer than LISTINGS_KEPT others since
    for other in others:
        specs.parts(parse(other, num_samples=2))
    assert specs.parts(spec) == first and times_listed(grid) == 2  # the least recent of LISTINGS_KEPT + 1: listed again


def test_a_method_registered_anew_is_another_listing(int_option_method):
    """The listing's key holds what it reads of promprune's registry (each method's option names), not the
    `MethodCatalog` object (each `parts` call makes its own): a method registered again with other options (a
    plugin's) lists the grid again."""
    import promprune

    from pipelines.spec import trials as spec_trials

    grid = {"method": [int_option_method], "budget": [8], "k": [1, 2]}
    assert len(spec_trials.distinct_trials(grid, specs.MethodCatalog())) == 2
    assert len(spec_trials.distinct_trials(grid, specs.MethodCatalog())) == 2

    @promprune.register_method(int_option_method, replace=True)
    def first(tokens, budget):
        """The first tokens, no option."""
        raise AssertionError("a spec check runs no method")

    assert len(spec_trials.distinct_trials(grid, specs.MethodCatalog())) == 1  # k dropped: one trial


def test_random_search_is_seeded_and_draws_inside_the_ranges():
    ids = lambda seed: [t.trial_id for t in specs.expand(parse(num_samples=40, seed=seed))]  # noqa: E731
    assert ids(7) == ids(7) and ids(7) != ids(8)
    trials = [t for t in specs.expand(parse(num_samples=200, seed=3)) if t.method]
    mus, taus = [t.options["mu"] for t in trials], [t.options["tau"] for t in trials]
    assert all(0.2 <= m <= 0.3 for m in mus) and all(0.005 <= t <= 0.08 for t in taus)
    assert all(float(f"{v:.4g}") == v for v in mus + taus)  # the values the ids name
    # log-uniform: the median sits at the geometric mean of the bounds (0.02), not the arithmetic one (0.0425)
    median = sorted(taus)[len(taus) // 2]
    assert math.log(median) == pytest.approx(math.log(0.02), abs=0.35)
    assert sum(m < 0.25 for m in mus) == pytest.approx(100, abs=25)  # uniform: half below the middle


def test_an_optuna_search_lists_only_the_fixed_trials_and_its_budgets_are_checked():
    from pipelines import preflight

    spec = parse(search="optuna", num_samples=12)
    assert [t.trial_id for t in specs.expand(spec)] == ["baseline"]
    assert search.searched_trials(spec) == 12
    assert preflight.budgets(spec) == {"grid.budget=16": 16}
    assert preflight.check_model("tiny:llava", {}, {"grid.budget=40": 40}) == [
        "budget: trial grid.budget=40 keeps 40 of the 36 visual tokens tiny:llava gives an image, so it would run "
        "unpruned; use budgets below 36"]
    # one problem per budget, naming every trial that asks for it
    assert preflight.check_model("tiny:llava", {}, {"divprune-b40": 40, "vispruner-b40": 40, "divprune-b8": 8,
                                                    "divprune-b36": 36}) == [
        "budget: trials divprune-b40, vispruner-b40 keep 40 of the 36 visual tokens tiny:llava gives an image, so they "
        "would run unpruned; use budgets below 36",
        "budget: trial divprune-b36 keeps 36 of the 36 visual tokens tiny:llava gives an image, so it would run "
        "unpruned; use budgets below 36"]


# ---------------------------------------------------------------------------------------------------------------
# the Tune side


@pytest.mark.parametrize("total,grace,rf", [(1566, "auto", 3), (96, 16, 2), (600, "auto", 3), (100, 7, 3.5),
                                            (50, 49, 2)])
def test_rungs_are_where_rays_asha_records(total, grace, rf):
    from ray.tune.schedulers import ASHAScheduler

    spec = parse(scheduler="asha", grace_period=grace, reduction_factor=rf)
    asha = ASHAScheduler(time_attr="t", metric="m", mode="max", max_t=total,
                         grace_period=search.grace_period(spec, total), reduction_factor=rf)
    milestones = sorted(m for m, _ in asha._brackets[0]._rungs if m < total)
    assert search.rungs(spec, total) == [int(m) for m in milestones]
    assert search.rungs(parse(), total) == []  # no scheduler, no rungs


@pytest.mark.parametrize("total,rf", [(600, 3), (1566, 3), (300, 3), (100, 2), (1000, 3.5), (601, 3)])
def test_auto_places_two_rungs_before_the_end(total, rf):
    # what the search specs promise ("rungs at 67 and 201 of 600 questions"): two, read from Ray's own ASHA, and the
    # first of them total / rf^2 rounded up (600 rounded down gave a third rung at 594, which stops nothing)
    from ray.tune.schedulers import ASHAScheduler

    grace = search.grace_period(parse(scheduler="asha", reduction_factor=rf), total)
    asha = ASHAScheduler(time_attr="t", metric="m", mode="max", max_t=total, grace_period=grace, reduction_factor=rf)
    assert sorted(int(m) for m, _ in asha._brackets[0]._rungs if m < total) == [grace, int(grace * rf)]
    assert grace == -(-total // rf ** 2)
    if total == 600:
        assert search.rungs(parse(scheduler="asha"), total) == [67, 201]


def test_the_first_rung_must_come_before_the_end():
    spec = parse(scheduler="asha", grace_period=200)
    assert search.check_rungs(spec, 200).startswith("tune.grace_period: 200 samples is not below a trial's 200")
    assert search.check_rungs(spec, 201) is None


def test_the_sweeps_first_line_counts_the_drawn_trials_with_or_without_a_scheduler():
    """A probe's case: a random search with no scheduler (one Tune experiment) said "random search of 0 trial(s)
    for the max rel, after 4 fixed trial(s)" for 3 draws and the baseline."""
    from pipelines import sweep

    for scheduler in ("none", "asha"):
        spec = parse(num_samples=3, seed=3, scheduler=scheduler)
        assert search.searched_trials(spec) == 3
        line = sweep._trials_line(spec, len(specs.expand(spec)), 40)
        assert line.startswith("random search of 3 trial(s) for the max rel") and line.endswith(
            ", after 1 fixed trial(s)"), line


def test_a_sampled_config_runs_the_rounded_values_its_id_names():
    config = {"sampled": {"method": "divprune", "budget": 16, "mu": 0.243117, "tau": 0.0187349}, "calibrated": {}}
    assert search.trial_of(config).trial_id == "divprune-b16"  # divprune takes neither option
    config["sampled"]["method"] = "promprune"
    trial = search.trial_of(config)
    assert trial.trial_id == "promprune-b16-mu=0.2431-tau=0.01873"
    assert trial.run_options == {"mu": 0.2431, "tau": 0.01873}
    listed = specs.Trial("promprune", 8, {"mu": 0.4})
    assert search.trial_of({"trial": listed}) is listed  # a listed trial crosses Tune as it is


def test_a_value_rounded_past_its_ranges_bound_is_the_bound_in_random_and_optuna_alike():
    """A probe's case: four significant digits put a draw of ``uniform: [0.12341, 0.12349]`` at 0.1234, below the
    range (random's draws, optuna's trials and a range's middle alike). A value rounded past a bound is now the
    bound; a float optuna chose from a list is the listed value, unrounded."""
    lo, hi = 0.12341, 0.12349
    narrow = {**GRID, "mu": {"uniform": [lo, hi]}}
    mus = [t.options["mu"] for t in specs.expand(parse(narrow, num_samples=30, seed=1)) if t.method]
    assert mus and all(lo <= m <= hi for m in mus)
    assert space.parse({"uniform": [0.123449, 0.12346]}).middle == 0.12346  # 0.1234545 rounds to 0.1235 > hi
    assert space.parse({"loguniform": [lo, hi]}).sample(__import__("random").Random(0)) in (lo, hi)
    spec = parse({"method": ["promprune"], "budget": [16], "mu": {"uniform": [lo, hi]}, "tau": [0.12341, 0.2]},
                 search="optuna")
    config = search.param_space(spec, search.Phase("-search", [], searched=True), {})
    assert config["ranges"] == {"mu": [lo, hi]}
    config["sampled"] = {"method": "promprune", "budget": 16, "mu": 0.1234123, "tau": 0.12341}
    assert search.trial_of(config).run_options == {"mu": lo, "tau": 0.12341}  # (was mu 0.1234, tau 0.1234)


def test_optunas_param_space_is_the_grids_spaces_as_tunes_domains():
    from ray.tune.search.sample import Categorical, Float, Integer

    spec = parse({"method": ["fastv"], "budget": [16, 8], "layer": {"randint": [1, 3]}}, search="optuna")
    layer = search.param_space(spec, search.Phase("-search", [], searched=True), {})["sampled"]["layer"]
    assert isinstance(layer, Integer) and (layer.lower, layer.upper) == (1, 4)  # the spec's hi included, Tune's not
    spec = parse({"method": ["promprune"], "budget": [16, 8], "mu": {"uniform": [0.2, 0.3]},
                  "tau": {"loguniform": [0.005, 0.08]}}, search="optuna")
    sampled = search.param_space(spec, search.Phase("-search", [], searched=True), {"x": 1})["sampled"]
    assert sampled["method"] == "promprune"  # a one-value list is fixed
    assert isinstance(sampled["budget"], Categorical) and sampled["budget"].categories == [16, 8]
    assert isinstance(sampled["mu"], Float) and (sampled["mu"].lower, sampled["mu"].upper) == (0.2, 0.3)
    assert type(sampled["tau"].get_sampler()).__name__.endswith("LogUniform")


def test_phases_run_the_baseline_before_a_search_that_needs_it():
    plain = specs.parse({"name": "s", "version": 1, "grid": {"method": ["promprune"], "budget": [8, 16]}})
    (only,) = search.phases(plain)
    assert only.suffix == "" and [t.trial_id for t in only.trials] == ["baseline", "promprune-b8", "promprune-b16"]
    spec = specs.parse({"name": "s", "version": 1, "grid": {"method": ["promprune"], "budget": [8, 16]},
                        "trials": [{"method": "divprune", "budget": 8}], "tune": {"scheduler": "asha"}})
    fixed, searched = search.phases(spec)
    assert [t.trial_id for t in fixed.trials] == ["baseline", "divprune-b8"] and not fixed.searched
    assert [t.trial_id for t in searched.trials] == ["promprune-b8", "promprune-b16"] and searched.searched
    no_baseline = specs.parse({"name": "s", "version": 1, "baseline": False, "grid": GRID,
                               "tune": {"search": "optuna", "metric": "easyvqa_open/exact_match"}})
    (alone,) = search.phases(no_baseline)
    assert alone.searched and alone.trials == []


def test_the_objective_is_rel_on_the_same_samples_or_a_task_metric():
    base = {8: {"pope": {"pope_f1_score": 0.8}, "mme": {"mme_perception_score": 1000.0}},
            16: {"pope": {"pope_f1_score": 0.5}, "mme": {"mme_perception_score": 0.0}}}
    ours = {"pope": {"pope_f1_score": 0.6}, "mme": {"mme_perception_score": 800.0}}
    rel = search.Objective("rel", ["k"] * 16, [8], base)
    assert rel.value(ours, 8) == pytest.approx((0.6 / 0.8 + 800 / 1000) / 2)  # against the baseline's first 8
    assert math.isnan(rel.value(ours, 16))  # a baseline score of 0: Rel. undefined there, not an error
    assert search.Objective("pope/pope_f1_score", []).value(ours, 8) == 0.6


def test_the_answered_prefix_follows_blocks_back_in_any_order():
    keys = [f"t/{i}" for i in range(6)]
    block = lambda *ids: pa.table({"task": ["t"] * len(ids), "doc_id": list(ids)})  # noqa: E731
    prefix, tables = search.AnsweredPrefix(keys), []
    for ids, expected in [((2, 3), 0), ((0,), 1), ((1,), 4), ((5,), 4), ((4,), 6)]:
        tables.append(block(*ids))
        assert prefix.update(tables) == expected, ids


def test_a_scheduler_stop_is_told_from_a_finished_or_interrupted_trial():
    assert search.stopped_by_scheduler({"done": True, "samples/scored": 174.0, "samples/total": 1566.0})
    assert not search.stopped_by_scheduler({"done": True, "samples/scored": 1566.0, "samples/total": 1566.0})
    assert not search.stopped_by_scheduler({"done": False, "samples/scored": 174.0, "samples/total": 1566.0})
    assert not search.stopped_by_scheduler({"done": True, "samples/done": 20.0, "samples/total": 1566.0})


def test_space_helpers():
    assert space.rounded(0.243117) == 0.2431 and space.rounded(123456.0) == 123500.0
    assert space.parse({"randint": [1, 3]}).finite == [1, 2, 3] and space.parse([1, 2]).size == 2
    assert space.parse({"uniform": [0.1, 0.3]}).middle == 0.2
    assert space.parse({"loguniform": [0.01, 1.0]}).middle == 0.1
    assert space.parse({"loguniform": [0.01, 1.0]}).size == math.inf


# ---------------------------------------------------------------------------------------------------------------
# a searched trial's reports at the rungs, as blocks come back in any order

KEYS = [f"t/{i}" for i in range(9)]  # a trial's 9 samples in the sweep's block order
RIGHT = {2, 3, 4, 5}  # the samples it answers right: 0 of the first 2, 4 of the first 6


def _rung_reports(monkeypatch, order: list[tuple]) -> list[dict]:
    """What `TrialProgress` reports to Tune for blocks coming back in ``order``, rungs at 2 and 6 of 9 samples; the
    score of a set of samples: the fraction of them in RIGHT (a stand-in for lmms-eval)."""
    from promprune.records import table_keys
    from pipelines.run import trial

    def score(predictions, partial=False, only=None):
        ids = [int(k.split("/")[1]) for k in table_keys(predictions) if only is None or k in only]
        return {"t": {"m": sum(i in RIGHT for i in ids) / len(ids)}}

    reports = []
    monkeypatch.setattr(trial, "score_table", score)
    monkeypatch.setattr(trial.tune, "report", lambda metrics, **kw: reports.append(dict(metrics)))
    progress = trial.TrialProgress(len(KEYS), objective=search.Objective("t/m", KEYS, [2, 6]))
    tables, done = [], 0
    for ids in order:
        tables.append(pa.table({"task": ["t"] * len(ids), "doc_id": list(ids)}))
        done += len(ids)
        progress(done, tables)
    return [r for r in reports if search.TIME_ATTR in r]


def test_a_trial_reports_every_rung_in_order_whatever_order_its_blocks_come_back(monkeypatch):
    # hand-worked: rung 2 holds samples 0 and 1 (none right), rung 6 samples 0-5 (4 of 6 right)
    expected = [(2.0, 0.0), (6.0, 4 / 6)]
    in_order = _rung_reports(monkeypatch, [(0, 1, 2), (3, 4, 5), (6, 7, 8)])
    assert [(r[search.TIME_ATTR], r["t/m"]) for r in in_order] == expected
    # the first block comes back last: both rungs come due with it, and each is still reported, lowest first, over
    # exactly its own samples (the old code reported the highest alone, so ASHA never judged the trial at 2)
    jumped = _rung_reports(monkeypatch, [(3, 4, 5), (6, 7, 8), (0, 1, 2)])
    assert [(r[search.TIME_ATTR], r["t/m"]) for r in jumped] == expected
    assert [r["samples/done"] for r in in_order] == [3.0, 6.0] and [r["samples/done"] for r in jumped] == [9.0] * 2


def test_tunes_asha_stops_a_trial_at_the_first_rung_it_fails_though_the_next_came_due_at_once(monkeypatch):
    """Tune's own ASHA, given the reports of a trial under the cutoff at rung 2 and above it at rung 6 whose blocks
    made both rungs due at once, as Tune's controller hands them over (one at a time, none after a STOP: a function
    trainable's report waits for the next step, `TuneController._process_trial_results` drops what follows a STOP):
    it stops the trial at rung 2, and rung 6 never records it."""
    from types import SimpleNamespace

    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    asha = ASHAScheduler(time_attr=search.TIME_ATTR, metric="t/m", mode="max", max_t=len(KEYS), grace_period=2,
                         reduction_factor=3)
    assert sorted(m for m, _ in asha._brackets[0]._rungs) == [2, 6]  # the rungs `_rung_reports` scores at
    for tid, (at2, at6) in {"a": (0.5, 0.1), "b": (0.5, 0.2), "c": (1.0, 0.3)}.items():  # the trials before it
        before = SimpleNamespace(trial_id=tid)
        asha.on_trial_add(None, before)
        for rung, value in [(2, at2), (6, at6)]:
            assert asha.on_trial_result(None, before, {search.TIME_ATTR: rung, "t/m": value}) == TrialScheduler.CONTINUE
    late = SimpleNamespace(trial_id="late")
    asha.on_trial_add(None, late)
    decisions = []
    for report in _rung_reports(monkeypatch, [(3, 4, 5), (6, 7, 8), (0, 1, 2)]):
        decisions.append((report[search.TIME_ATTR], asha.on_trial_result(None, late, report)))
        if decisions[-1][1] == TrialScheduler.STOP:
            break
    assert decisions == [(2.0, TrialScheduler.STOP)]
    rungs = dict(asha._brackets[0]._rungs)
    assert rungs[2]["late"] == 0.0 and "late" not in rungs[6]


def test_an_in_llm_budget_is_checked_against_the_placeholders_it_prunes():
    """FastV / DART prune LLaVA-NeXT's newline tokens too: tiny:llava_next gives 80 candidate tokens and 88
    placeholders (one newline per row of the unpadded 2 x 2 grid's 8 rows), so FastV at 84 prunes (the library runs
    it on 84 of 88: layer_visual_tokens [88, 84, 84, 84]) and was refused as 'keeps 84 of 80'; DivPrune at 84 keeps
    every candidate and is refused; FastV at 88 keeps every placeholder and is refused."""
    from pipelines import preflight
    from pipelines.spec import parse

    spec = parse({"name": "nl", "version": 1, "model": {"pretrained": "tiny:llava_next"}, "tasks": ["easyvqa_yesno"],
                  "baseline": False, "grid": {"method": ["fastv", "divprune"], "budget": [84, 88]}})
    in_llm = preflight.in_llm_budgets(spec)
    assert in_llm == {"fastv-b84", "fastv-b88"}
    assert preflight.check_model("tiny:llava_next", {}, preflight.budgets(spec), in_llm=in_llm) == [
        "budget: trial fastv-b88 keeps 88 of the 88 visual tokens tiny:llava_next gives an image (its 8 newline tokens "
        "included: in-LLM methods prune them too), so it would run unpruned; use budgets below 88",
        "budget: trial divprune-b84 keeps 84 of the 80 visual tokens tiny:llava_next gives an image, so it would run "
        "unpruned; use budgets below 80",
        "budget: trial divprune-b88 keeps 88 of the 80 visual tokens tiny:llava_next gives an image, so it would run "
        "unpruned; use budgets below 80"]


def test_the_library_warns_of_a_full_budget_by_what_the_method_prunes():
    """The same counts at construction: FastV at 84 on tiny:llava_next prunes (no FullBudgetWarning; it said 'images
    run unpruned'), at 88 it does not; DivPrune at 80 does not."""
    import warnings

    from promprune.models import PrunedVLM
    from promprune.models.vlm import FullBudgetWarning

    def warned(method, budget):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PrunedVLM.from_pretrained("tiny:llava_next", method=method, budget=budget, dtype="float32")
        return any(issubclass(w.category, FullBudgetWarning) for w in caught)

    assert (warned("fastv", 84), warned("fastv", 88), warned("divprune", 80)) == (False, True, True)


def test_the_lmms_eval_plugin_checks_a_budget_by_what_the_method_prunes():
    """The plugin's refusal before the weights load counts as the spec check does: FastV at 84 on tiny:llava_next
    prunes (84 of its 88 placeholders), DivPrune at 84 keeps all 80 candidates."""
    from promprune.eval.lmms_plugin import _check_capacity

    _check_capacity("tiny:llava_next", 84, {}, method="fastv")
    with pytest.raises(ValueError, match="keeps all 80 visual tokens"):
        _check_capacity("tiny:llava_next", 84, {}, method="divprune")
    with pytest.raises(ValueError, match="keeps all 88 visual tokens"):
        _check_capacity("tiny:llava_next", 88, {}, method="fastv")


def test_a_float_option_out_of_range_is_not_taken_for_an_int_option():
    # mu's middle 1.3 is refused and mu = 1 is not, but mu takes floats (0.2 is accepted): the range's bound 2.4 is
    # what is wrong, and a randint[1, 2] would draw the refused mu = 2 (it said "the method takes ints")
    found = problems({**GRID, "mu": {"uniform": [0.2, 2.4]}})
    assert [p.split(": option")[0] for p in found] == ["grid.mu: 1.3 of uniform[0.2, 2.4]",
                                                       "grid.mu: 2.4 of uniform[0.2, 2.4]"], found
    found = problems({"method": ["fixed_ratio"], "budget": [16], "saliency_ratio": {"uniform": [0.5, 2.0]}})
    assert found == ["grid.saliency_ratio: 1.25 of uniform[0.5, 2]: option 'saliency_ratio' must be in [0, 1], got "
                     "1.25", "grid.saliency_ratio: 2.0 of uniform[0.5, 2]: option 'saliency_ratio' must be in [0, 1], "
                     "got 2.0"]


def test_an_int_options_range_with_a_refused_bound_names_the_bound_and_suggests_no_refused_randint():
    # layer >= 1: uniform[0, 3] draws floats and its bound 0 is refused as an int too; randint[0, 3] would draw 0
    found = problems({"method": ["fastv"], "budget": [16], "layer": {"uniform": [0, 3]}})
    assert len(found) == 2, found
    assert found[0].startswith("grid.layer: uniform[0, 3] draws floats (here 1.5), and the method takes ints: ")
    assert found[0].endswith("got 1.5; search it with {choice: [...]} of ints"), found[0]
    assert found[1].startswith("grid.layer: 0 of uniform[0, 3]: option 'layer' of fastv must be None") \
        and found[1].endswith("got 0"), found[1]
