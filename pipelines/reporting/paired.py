"""Which gaps between methods are noise: each method's Rel. difference to the best other method at its budget, with a
paired bootstrap interval, and a trial's Rel. with its interval (`promprune.eval.scoring.PairedBootstrap`: the
documents of every task resampled once per resample, every trial and the baseline scored on that same draw).

Used by the report (trials and predictions from MLflow) and by the sweep's console summary (its records), so both
read alike: ``PromPrune - DivPrune: -0.4 [-2.1, +1.3] points`` (points of Rel., percent of the unpruned model).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from .headroom import points
from .store import BASELINE_METHOD
from .tables import METHOD_LABELS, METHOD_ORDER

ITERS = 1000  # resamples when a spec sets no `bootstrap`: the 2.5th / 97.5th percentiles settle to ~0.1 points
SEED = 0  # the same resamples every time: a report regenerated gives the same intervals

RowsOf = Callable[[str], list[dict] | None]  # trial id -> its prediction rows (task, doc_id, n_docs, prediction, error)


@dataclass
class Difference:
    """Rel.(a) - Rel.(b) at one budget, in points of Rel., with its paired 95% interval."""

    budget: float
    a: str  # the trials' names: their labels (`PromPrune (mu=0.3, tau=0.03)`) or their methods' labels
    b: str
    a_id: str  # trial ids
    b_id: str
    value: float
    low: float
    high: float

    def text(self) -> str:
        return (f"{self.a} - {self.b}: {points(self.value)} [{points(self.low)}, {points(self.high)}] points")

    @property
    def resolved(self) -> bool:
        """The interval excludes 0: the gap is not resampling noise."""
        return self.low > 0 or self.high < 0


def label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


# Rel. compared at this many decimals (of a fraction): the console's (scoring's) and the report's (from the table's
# scores) may differ in the last bits, and a tie must be one in both
REL_DECIMALS = 12


def paper_rank(method: str) -> tuple[int, str]:
    """Ties of Rel. between methods go to the first in the paper's order (`tables.METHOD_ORDER`; other methods after
    it, by name): one rule for the console and the report, whatever order their rows come in."""
    return (METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER), method)


def best_per_method(frame: pd.DataFrame) -> dict[float, dict[str, str]]:
    """{budget: {method: row of its best Rel.}} over budgets where at least two methods ran. ``frame``: one
    row per finished trial (index: trial id, or the report's run id) with ``method``, ``budget``, ``rel`` (NaN:
    undefined) and optionally ``trial`` (the trial id, where the index is not). A method's trials tied for its best
    go to the least trial id: the same trial whatever order the rows come in."""
    pruned = frame[(frame["method"] != BASELINE_METHOD) & frame["rel"].notna()]
    ids = pruned["trial"] if "trial" in pruned else pd.Series(pruned.index, index=pruned.index)
    rel = pruned["rel"].round(REL_DECIMALS)
    out = {}
    for budget, rows in pruned.groupby("budget"):
        best = {}
        for method, g in rows.groupby("method", sort=False):
            top = g.index[rel[g.index] == rel[g.index].max()]
            best[method] = min(top, key=lambda row: str(ids[row]))
        if len(best) >= 2:
            out[budget] = best
    return out


def bootstrap(trial_ids: list[str], baseline_id: str, rows_of: RowsOf, iters: int = ITERS, seed: int = SEED):
    """The `PairedBootstrap` of ``trial_ids`` and the baseline (each trial's items from lmms-eval, once); None when
    a trial's predictions are missing or its tasks' data cannot be loaded here (a hub task offline). Trials on
    other documents than the baseline's, or a task whose baseline score is 0, are a ValueError."""
    from promprune.eval.scoring import PairedBootstrap, sample_items
    from promprune.eval.tasks import TaskUnavailableError

    items = {}
    for tid in dict.fromkeys([baseline_id, *trial_ids]):
        rows = rows_of(tid)
        if not rows:
            return None
        try:
            items[tid] = sample_items(rows)
        except TaskUnavailableError:
            return None
    return PairedBootstrap(items, baseline_id, iters, seed=seed)


def differences(frame: pd.DataFrame, baseline_id: str, rows_of: RowsOf, iters: int = ITERS,
                seed: int = SEED) -> list[Difference]:
    """Each method's difference to the best other method at the same budget (the methods' best trials), with paired
    intervals; budgets descending, methods in the order they come. Empty without two methods at a budget. Other
    methods tied for the best Rel. go to the first in the paper's order (`paper_rank`), so the console (rows in the
    spec's order) and the report (in the paper's) name the same one.
    ``frame`` as `best_per_method` takes it; with a ``label`` column (a trial's label in the report's tables) the
    trials are named by it, else by their method's label."""
    names = frame["label"] if "label" in frame else frame["method"].map(label)
    out = []
    for budget, best in sorted(best_per_method(frame).items(), key=lambda kv: -kv[0]):
        try:
            boot = bootstrap(list(best.values()), baseline_id, rows_of, iters, seed)
        except ValueError:  # trials on different documents (a subset of the tasks): no pairing; or Rel. undefined
            continue
        if boot is None:
            continue
        for method, tid in best.items():
            others = sorted((m for m in best if m != method), key=paper_rank)  # max: the first of those tied
            other = max(others, key=lambda m: round(frame.loc[best[m], "rel"], REL_DECIMALS))
            value, low, high = (100 * x for x in boot.difference(tid, best[other]))
            out.append(Difference(budget, names[tid], names[best[other]], tid, best[other], value, low, high))
    return out


def rows_from(predictions) -> list[dict] | None:
    """Prediction rows as `promprune.eval.score` takes them, from a predictions table (pyarrow) or frame (pandas)."""
    columns = ["task", "doc_id", "n_docs", "prediction", "error"]
    names = getattr(predictions, "column_names", None) or list(getattr(predictions, "columns", []))
    if predictions is None or not set(columns) <= set(names):
        return None  # no predictions, or not the pipeline's (an old or hand-made table without n_docs)
    if hasattr(predictions, "select") and hasattr(predictions, "to_pylist"):
        return predictions.select(columns).to_pylist()
    return predictions[columns].to_dict("records")


def markdown(diffs: list[Difference]) -> str:
    """The differences as a list a reader takes in at once, each trial by its name."""
    lines = []
    for d in diffs:
        lines.append(f"- {d.budget:.0f} tokens: {d.text()} ({'resolved' if d.resolved else 'within noise'})")
    return "\n".join(lines) + "\n"
