"""The report's cost in the number of runs: a grid repeated (`Sweep.mean_over_repeats`) groups its runs in one pass,
and a search sweep beside a grid (``--grid``) reads the grid once however many (mu, tau) searches it holds; each
against a naive reference computation on randomized sweeps (ties, NaN, single runs, missing metrics, stopped
trials). In-memory sweeps: these functions take a loaded `Sweep`, the store is not what is measured."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipelines.reporting import build, figures, tables
from pipelines.reporting.store import Sweep

CONFIG_SKIP = ("trial", "status", "stopped", "repeat")
METRICS = ["pope/pope_f1_score", "gqa/exact_match", "rel"]


def repeated_sweep(seed: int, configs: int = 40) -> Sweep:
    """``configs`` configurations run 1-4 times each (param ``repeat``), the runs in a shuffled order (a lowest
    repeat is not always first), some failed, some stopped, metric values drawn from few (ties), NaN, one metric
    missing from whole configurations."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(configs):
        for r in range(int(rng.integers(1, 5))):
            status = "FAILED" if rng.random() < 0.25 else "FINISHED"  # some configurations' every repeat
            rows.append({"trial": f"c{c}-r{r}", "status": status, "stopped": bool(rng.random() < 0.1),
                         "method": str(rng.choice(["promprune", "divprune"])) if c % 7 == 0 else "promprune",
                         "budget": float(16 * (1 + c % 3)), "repeat": r, "model": "tiny:llava", "tasks": "pope,gqa",
                         "mu": [0.2, 0.3, None][c % 3], "tau": float(c // 3) / 100})
    trials = pd.DataFrame(rows)
    trials = trials.iloc[rng.permutation(len(trials))]
    trials.index = [f"run{i:04d}" for i in range(len(trials))]
    n = len(trials)
    metrics = pd.DataFrame({m: rng.choice([0.25, 0.5, 0.75, np.nan], n) for m in METRICS}, index=trials.index)
    lacking = trials["tau"].isin([0.01, 0.05])  # configurations that never logged GQA
    metrics.loc[lacking, "gqa/exact_match"] = np.nan
    return Sweep("parent", "repeats", {}, trials, metrics, ["mu", "tau"])


def naive_mean_over_repeats(sweep: Sweep) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The docstring's rule, one configuration at a time: (trials, metrics, repeat_metrics)."""
    trials, metrics = sweep.trials, sweep.metrics
    config = [c for c in trials.columns if c not in CONFIG_SKIP]
    groups: dict = {}
    for rid, row in trials.iterrows():
        key = ("stopped", rid) if row["stopped"] else tuple(str(row[c]) for c in config)
        groups.setdefault(key, []).append(rid)
    row_of, counted = {}, {}
    for runs in groups.values():
        done = [rid for rid in runs if trials.loc[rid, "status"] == "FINISHED"]
        first = min(done or runs, key=lambda rid: (trials.loc[rid, "repeat"], trials.index.get_loc(rid)))
        row_of[first], counted[first] = runs, done or runs
    keep = [rid for rid in trials.index if rid in row_of]
    means = pd.DataFrame([metrics.loc[counted[rid]].mean() for rid in keep], index=keep)
    repeats = {rid: metrics.loc[counted[rid]] for rid in keep if len(row_of[rid]) > 1}
    return trials.loc[keep], means, repeats


def mixed_rows(sweep: Sweep) -> list:
    """The configurations with a failed and a finished repeat (by their trial names' configuration)."""
    config = sweep.trials["trial"].str.rsplit("-r", n=1).str[0]
    status = sweep.trials.groupby(config)["status"].agg(set)
    return [c for c, seen in status.items() if seen == {"FAILED", "FINISHED"}]


@pytest.mark.parametrize("seed", range(6))
def test_mean_over_repeats_is_the_naive_grouping(seed):
    sweep = repeated_sweep(seed)
    got = sweep.mean_over_repeats()
    trials, means, repeats = naive_mean_over_repeats(sweep)
    pd.testing.assert_frame_equal(got.trials, trials)
    pd.testing.assert_frame_equal(got.metrics, means, rtol=1e-12)
    assert list(got.repeat_metrics) == list(repeats)  # the rows' order
    for rid, runs in repeats.items():  # each row's runs, exactly, in the sweep's order
        pd.testing.assert_frame_equal(got.repeat_metrics[rid], runs, check_exact=True)
    # the input has what the rule must get right: single runs and stopped ones beside repeated rows, all-NaN means
    assert repeats and len(repeats) < len(trials) and sweep.trials["stopped"].any()
    assert (got.trials["status"] == "FAILED").any()  # a configuration none of whose repeats finished
    assert mixed_rows(sweep)  # and a row whose failed repeat sits beside finished ones (its mean leaves it out)
    assert means["gqa/exact_match"].isna().any() and means["gqa/exact_match"].notna().any()


def test_mean_over_repeats_compares_no_run_key_per_configuration(monkeypatch):
    """The runs are grouped in one pass: the Series comparisons it makes do not grow with the configurations (it
    compared every run's key with each configuration's, twice: 0.58 s for 2,000 runs, 10.5 s for 16,000)."""
    counted = []
    equals = pd.Series.__eq__

    def counting(self, other):
        counted.append(1)
        return equals(self, other)

    monkeypatch.setattr(pd.Series, "__eq__", counting)
    made = []
    for configs in (20, 200):
        sweep = repeated_sweep(0, configs)
        counted.clear()
        assert len(sweep.mean_over_repeats().repeat_metrics) > configs // 3
        made.append(len(counted))
    assert made[0] == made[1], made


# ---------------------------------------------------------------------------------------------------------------
# a search beside a grid


def plane_sweep(name: str, rows: list[dict], seed: int) -> Sweep:
    """A sweep without a baseline (its logged Rel. is the table's): ``rows`` of method, budget, metric, mu, tau."""
    rng = np.random.default_rng(seed)
    ids = [f"{name}{i:04d}" for i in range(len(rows))]
    trials = pd.DataFrame(rows, index=ids)
    trials.insert(0, "trial", [f"{name}-t{i}" for i in range(len(rows))])
    trials.insert(1, "status", "FINISHED")
    trials.insert(2, "stopped", rng.random(len(rows)) < 0.15)
    trials["repeat"], trials["model"], trials["tasks"] = 0, "tiny:llava", "pope,gqa"
    metrics = pd.DataFrame({m: rng.choice([0.5, 0.6, 0.7, np.nan], len(rows), p=[.3, .3, .3, .1]) for m in METRICS},
                           index=ids)
    metrics["running/rel"] = rng.random(len(rows))
    return Sweep(f"p-{name}", name, {}, trials, metrics, ["metric", "mu", "tau"])


KEYS = [(16, "spectral"), (16, "attention"), (32, "spectral"), (64, None)]  # None: metric unset (its default)


def grid_and_search(seed: int) -> tuple[Sweep, Sweep]:
    """A grid over three of `KEYS` and one more key no search has; a search over all four (one the grid lacks)."""
    rng = np.random.default_rng(seed)
    grid_keys = KEYS[:3] + [(128, "spectral")]
    grid = plane_sweep("g", [{"method": "promprune", "budget": float(b), "metric": m, "mu": mu, "tau": tau}
                             for b, m in grid_keys for mu in (0.2, 0.3) for tau in (0.01, 0.02)], seed)
    search = plane_sweep("s", [{"method": "promprune", "budget": float(b), "metric": m,
                                "mu": float(rng.choice([0.2, 0.25, 0.3])), "tau": float(rng.choice([0.01, 0.02]))}
                               for b, m in KEYS for _ in range(4)], seed + 100)
    return grid, search


def naive_grid_points(grid: Sweep, key) -> pd.DataFrame:
    """A search's grid points as the report took them per search: the grid's whole table and every key again."""
    ran = grid.ran_to_end()
    every = build._plane_points(ran, tables.build_score_table(ran))
    return every[[build._search_key(ran, rid) == key for rid in every.index]]


@pytest.mark.parametrize("seed", range(4))
def test_the_grid_points_of_each_search_are_the_per_search_filter(seed):
    grid, search = grid_and_search(seed)
    planes = build._GridPlanes.of_grid(grid)
    keys = {build._search_key(s, rid) for s in (grid, search) for rid in s.trials.index}
    assert len(keys) == 5
    for key in keys:
        pd.testing.assert_frame_equal(planes.of(key), naive_grid_points(grid, key), check_exact=True)


def test_a_grid_beside_several_searches_is_read_once(monkeypatch, tmp_path):
    """Four searches beside a grid: the grid's score table is built once and each trial's search key computed once
    (they were built again per search: 9.2 s for 20 searches beside a grid of 2,000 trials, 0.9 s now)."""
    grid, search = grid_and_search(0)
    tables_built, keyed = [], []
    build_table, key_of = tables.build_score_table, build._search_key
    monkeypatch.setattr(tables, "build_score_table",
                        lambda sweep: tables_built.append(sweep.name) or build_table(sweep))
    monkeypatch.setattr(build, "_search_key", lambda sweep, rid: keyed.append(rid) or key_of(sweep, rid))
    monkeypatch.setattr(figures, "search_plane", lambda *args, **kwargs: None)  # the text is what is read here
    md = build._search_section(search, build_table(search.ran_to_end()), build._PredictionCache(), tmp_path,
                               build.Report(tmp_path), grid)
    assert md.count("## The (mu, tau) plane: ") == 4 and md.count("- grid `g`") == 4
    assert "- grid `g`: no finished trial with Rel." in md  # the search at 64 tokens: the grid has none
    assert tables_built == ["g"]
    assert sorted(keyed) == sorted(list(search.trials.index) + list(grid.ran_to_end().trials.index))


def test_a_grid_whose_trials_set_neither_mu_nor_tau_has_no_point_in_any_plane(monkeypatch, tmp_path):
    """A --grid of other trials (a method comparison) beside a search: each plane says the grid has none of its
    points, as for a grid of other searches (it raised KeyError 'stopped': the per-search filter of no grid trial
    kept no column)."""
    grid, search = grid_and_search(1)
    grid.trials = grid.trials.drop(columns=["mu", "tau"])
    grid.option_names = ["metric"]
    monkeypatch.setattr(figures, "search_plane", lambda *args, **kwargs: None)
    md = build._search_section(search, tables.build_score_table(search.ran_to_end()), build._PredictionCache(),
                               tmp_path, build.Report(tmp_path), grid)
    assert md.count("- grid `g`: no finished trial with Rel.") == 4
