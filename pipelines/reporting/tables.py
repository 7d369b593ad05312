"""Paper-style tables from a loaded sweep: scores with Rel. (best per budget in bold), efficiency, Table 4's
matched split, the calibration summary, and our numbers against the published ones with deltas.

Every table is a pandas DataFrame (written as CSV) plus a markdown rendering.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from pipelines import mlflow_layout

from .columns import column_for, nan_samples, task_interval, task_score
from .store import BASELINE_METHOD, Sweep, parse_task_list

METHOD_LABELS = {
    "none": "Upper bound", "promprune": "PromPrune", "fastv": "FastV", "sparsevlm": "SparseVLM",
    "visionzip": "VisionZip", "vispruner": "VisPruner", "divprune": "DivPrune", "fixed_ratio": "Fixed split",
    "saliency_only": "Saliency only", "coverage_only": "Coverage only", "random": "Random",
    "downsample": "Downsample", "pyramiddrop": "PyramidDrop", "dart": "DART", "cdpruner": "CDPruner",
}
# the paper's row order: the unpruned model, the baselines (the extended ones beside their kind: in-LLM after FastV,
# before the LLM after DivPrune), the ablations, ours last; every built-in method (`promprune.methods(None)`) is here
METHOD_ORDER = ["none", "random", "downsample", "fastv", "pyramiddrop", "sparsevlm", "dart", "visionzip",
                "vispruner", "divprune", "cdpruner", "saliency_only", "coverage_only", "fixed_ratio", "promprune"]

EFFICIENCY_COLUMNS = [  # (metric key, header, decimals, lower is better)
    ("efficiency/visual_tokens", "Visual tokens", 0),
    ("efficiency/prefill_tflops", "Prefill TFLOPs", 2),
    ("efficiency/kv_cache_mb", "KV cache (MB)", 1),
    ("efficiency/prefill_ms", "Prefill (ms, vision + selection + LLM)", 1),
    ("efficiency/peak_mem_gb", "Peak memory (GB)", 2),
]


CI_LOW, CI_HIGH = ":ci_low", ":ci_high"  # ScoreTable.frame columns of a task's bootstrap bounds (raw units)
FAILED = ":n_failed"  # ScoreTable.frame column of a task's failed samples (scored as wrong answers)
NAN_SAMPLES = ":n_nan"  # ScoreTable.frame column: a task's samples its process_results returned NaN for (if any)
REL_OF = ":rel_of"  # ScoreTable.frame column: how many benchmarks a row's Rel. averages (NaN: all, or not known)
SD, RUNS = ":sd", ":n"  # ScoreTable.frame columns of a repeated configuration: per task and `rel`, sd and run count


@dataclass
class ScoreTable:
    """One row per trial in paper order; raw task scores (lmms-eval units), `rel` in percent."""

    frame: pd.DataFrame  # index: trial run id; columns: method, budget, variant, label, <task>..., rel
    columns: list  # TaskColumn per task column, in order

    def display(self, task: str, raw: float) -> float:
        """A raw score in the paper's unit."""
        col = next(c for c in self.columns if c.task == task)
        return raw * col.scale


# ---------------------------------------------------------------------------------------------------------------
# labels and order


def varying_options(sweep: Sweep) -> dict[str, list[str]]:
    """Per method, the options that take more than one value among its trials (they name its rows); a trial that
    leaves an option at its default counts as one more value (``fastv`` beside ``fastv, layer: 2``)."""
    out = {}
    for method, rows in sweep.trials.groupby("method"):
        out[method] = [o for o in sweep.option_names
                       if rows[o].map(lambda v: "" if v is None or _isnan(v) else str(v)).nunique() > 1]
    return out


fmt_value = mlflow_layout.option_text  # an option's value in a label: 64 (not 64.0), 0.9818


def variant_of(row: pd.Series, options: list[str]) -> str:
    """`diversity=fps, mu=0.4` from the row's varying options (missing ones skipped)."""
    parts = [f"{o}={fmt_value(row[o])}" for o in options if row.get(o) is not None and not _isnan(row.get(o))]
    return ", ".join(parts)


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def ordered_trials(sweep: Sweep) -> pd.DataFrame:
    """Trials with `variant` and `label`, baseline first, then budgets descending, then the paper's method order."""
    vary = varying_options(sweep)
    trials = sweep.trials.copy()
    trials["variant"] = [variant_of(row, vary.get(row["method"], [])) for _, row in trials.iterrows()]
    names = trials["method"].map(lambda m: METHOD_LABELS.get(m, m))
    trials["label"] = [f"{n} ({v})" if v else n for n, v in zip(names, trials["variant"])]
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    trials["_is_base"] = (trials["method"] != BASELINE_METHOD).astype(int)
    trials["_budget"] = -trials["budget"].fillna(np.inf)
    trials["_rank"] = trials["method"].map(lambda m: rank.get(m, len(rank)))
    spoken: dict[str, int] = {}  # a word option's values (Table 5's `diversity`) in the order the sweep ran them
    for option in sorted({o for opts in vary.values() for o in opts if o in trials}):
        for value in trials[option].iloc[::-1]:  # rows come newest first
            if isinstance(value, str):
                spoken.setdefault(value, len(spoken))
    trials["_opts"] = [tuple(_sort_key(row[o], spoken) for o in vary.get(row["method"], []))
                       for _, row in trials.iterrows()]
    trials = trials.sort_values(["_is_base", "_budget", "_rank", "_opts", "label"], kind="stable")
    return trials.drop(columns=["_is_base", "_budget", "_rank", "_opts"])


def _sort_key(v, spoken: dict | None = None):
    """Unset first, then numbers ascending, then words in ``spoken``'s order (else alphabetical)."""
    if v is None or _isnan(v):
        return (0, 0.0, "")
    if isinstance(v, (int, float)):
        return (1, v, "")
    return (2, float((spoken or {}).get(v, len(spoken or {}))), str(v))


# ---------------------------------------------------------------------------------------------------------------
# scores and Rel.


def build_score_table(sweep: Sweep) -> ScoreTable:
    trials = ordered_trials(sweep)
    metrics = sweep.metrics.loc[trials.index]
    columns = []
    for task in sweep.tasks():
        logged = [c.split("/", 1)[1] for c in metrics.columns if c.startswith(f"{task}/")]
        columns.append(column_for(task, logged, sweep.primary.get(task)))
    frame = trials[["method", "budget", "variant", "label"]].copy()
    for col in columns:
        frame[col.task] = task_score(metrics, col)
        failed = metrics.get(f"{col.task}/n_failed")
        if failed is not None:
            frame[f"{col.task}{FAILED}"] = failed.fillna(0)
        nans = nan_samples(metrics, col)
        if nans.any():
            frame[f"{col.task}{NAN_SAMPLES}"] = nans
        interval = task_interval(metrics, col)
        if interval is not None:
            frame[f"{col.task}{CI_LOW}"], frame[f"{col.task}{CI_HIGH}"] = interval
    frame["rel"] = relative_scores(frame[[c.task for c in columns]], sweep.baseline_id, metrics.get("rel"))
    frame[REL_OF] = rel_counts(frame[[c.task for c in columns]], sweep.baseline_id)
    _add_spread(frame, columns, sweep)
    return ScoreTable(frame, columns)


def _add_spread(frame: pd.DataFrame, columns: list, sweep: Sweep) -> None:
    """For each row that is the mean of repeated runs (`Sweep.mean_over_repeats`): per task and for Rel., the
    standard deviation over the runs (raw units; Rel. in points, each run's against the unpruned row, the mean of
    its runs) and how many ran it. Such a row's bootstrap bounds are dropped where two or more runs scored the task:
    the mean of the runs' bounds is no interval of their mean (one run's are its own)."""
    tasks = [c.task for c in columns]
    bid = sweep.baseline_id
    base = frame.loc[bid, tasks].to_dict() if bid is not None and bid in frame.index else None
    for rid, runs in sweep.repeat_metrics.items():
        if rid not in frame.index:
            continue
        per_run = pd.DataFrame({c.task: task_score(runs, c) for c in columns}, index=runs.index)
        for task in tasks:
            values = per_run[task].dropna()
            frame.loc[rid, [f"{task}{SD}", f"{task}{RUNS}"]] = [values.std() if len(values) > 1 else np.nan,
                                                                 len(values)]
            if len(values) > 1:
                frame.loc[rid, [f"{task}{CI_LOW}", f"{task}{CI_HIGH}"]] = np.nan
        if base is not None:
            rel = pd.Series([defined_rel(scores, base) for scores in per_run.to_dict("records")], index=per_run.index)
        else:
            rel = runs.get("rel", pd.Series(np.nan, index=runs.index))
        rel = mlflow_layout.rel_percent(rel).dropna()
        frame.loc[rid, [f"rel{SD}", f"rel{RUNS}"]] = [rel.std() if len(rel) > 1 else np.nan, len(rel)]


def rel_counts(scores: pd.DataFrame, baseline_id: str | None) -> pd.Series:
    """How many benchmarks each row's Rel. averages, where that is fewer than the table's (a trial run on a subset
    of the tasks; every row where the baseline scored 0 on a benchmark, whose ratio is undefined: the sweep's own Rel.
    is undefined then, and logged for no trial); NaN where it is all of them, or where Rel. was not computed here (no
    baseline trial)."""
    if baseline_id is None or scores.empty:
        return pd.Series(np.nan, index=scores.index)
    from promprune.eval.scoring import ratio_tasks

    base = scores.loc[baseline_id].to_dict()
    full = scores.shape[1]  # the table's benchmarks: those the baseline's ratio leaves out are not "all" of them
    counts = scores.apply(lambda row: len(ratio_tasks(row.to_dict(), base)), axis=1).astype(float)
    return counts.where(counts < full)


def defined_rel(scores: dict, base: dict) -> float:
    """Rel. (a fraction) of one row's ``scores`` over the benchmarks whose ratio to ``base`` is defined
    (``scoring.ratio_tasks``; `rel_counts` says how many where that is fewer than the table's): the table's rule, for
    a row and for each run of a repeated row alike."""
    from promprune.eval.scoring import mean_ratio, ratio_tasks

    return mean_ratio({t: scores[t] for t in ratio_tasks(scores, base)}, base)


def relative_scores(scores: pd.DataFrame, baseline_id: str | None, logged_rel: pd.Series | None) -> pd.Series:
    """Rel. in percent: each benchmark's score over the unpruned model's, averaged over benchmarks (the paper's).

    scores: [trials x tasks] raw scores. Without a baseline trial in the sweep, the pipeline's logged `rel` (a
    fraction, see `pipelines.mlflow_layout`).
    Benchmarks the baseline or the trial lacks (or where the baseline scored 0) are left out of that trial's
    average, and `rel_counts` says so beside it.
    """
    if baseline_id is not None and not scores.empty:
        base = scores.loc[baseline_id].to_dict()
        rel = scores.apply(lambda row: defined_rel(row.to_dict(), base), axis=1)
        return mlflow_layout.rel_percent(rel)
    if logged_rel is None:
        return pd.Series(np.nan, index=scores.index)
    return mlflow_layout.rel_percent(logged_rel)


def best_per_budget(table: ScoreTable, decimals: dict[str, int]) -> set[tuple[str, str]]:
    """(run id, column) cells that are the best (highest, at display precision) among their budget's trials.

    The baseline is not a competitor; a budget with a single trial, or where all trials tie, has no best; ties
    for the best among different values are all best. A Rel. over fewer benchmarks than the table's (a trial on a
    subset of the tasks) is not compared with the others' (the paper's Rel. is over the table's benchmarks).
    """
    frame = table.frame[table.frame["method"] != BASELINE_METHOD]
    best = set()
    for _, group in frame.groupby("budget", dropna=False):
        if len(group) < 2:
            continue
        for col, dec in decimals.items():
            rows = group if col != "rel" or REL_OF not in group else group[group[REL_OF].isna()]
            shown = _display_series(table, rows, col).round(dec)
            if shown.notna().sum() < 2 or shown.nunique() < 2:
                continue  # one value, or all equal: nothing stands out
            best |= {(rid, col) for rid in shown.index[shown == shown.max()]}
    return best


def _display_series(table: ScoreTable, rows: pd.DataFrame, col: str) -> pd.Series:
    return rows[col] if col == "rel" else rows[col] * table.display(col, 1.0)


def score_table_csv(table: ScoreTable) -> pd.DataFrame:
    """The score table in the paper's units (MME points, percent), unrounded, with the run ids (a row that is the mean
    of repeated runs: its first finished run's id, and each column's sd over the runs and their count)."""
    out = table.frame[["method", "budget", "variant", "label"]].copy()
    for col in table.columns:
        out[col.label] = table.frame[col.task] * col.scale
        for suffix, name in ((CI_LOW, "CI low"), (CI_HIGH, "CI high")):
            if f"{col.task}{suffix}" in table.frame:
                out[f"{col.label} {name}"] = table.frame[f"{col.task}{suffix}"] * col.scale
        if f"{col.task}{FAILED}" in table.frame:
            out[f"{col.label} failed samples"] = table.frame[f"{col.task}{FAILED}"]
        if f"{col.task}{NAN_SAMPLES}" in table.frame:
            out[f"{col.label} NaN samples"] = table.frame[f"{col.task}{NAN_SAMPLES}"]
        if f"{col.task}{RUNS}" in table.frame:
            out[f"{col.label} sd over runs"] = table.frame[f"{col.task}{SD}"] * col.scale
            out[f"{col.label} runs"] = table.frame[f"{col.task}{RUNS}"]
    out["Rel. (%)"] = table.frame["rel"]
    if f"rel{RUNS}" in table.frame:
        out["Rel. sd over runs"], out["Rel. runs"] = table.frame[f"rel{SD}"], table.frame[f"rel{RUNS}"]
    if REL_OF in table.frame and table.frame[REL_OF].notna().any():
        out["Rel. over benchmarks"] = table.frame[REL_OF]  # set where fewer than the table's
    out.index.name = "run_id"
    return out.reset_index()


def score_table_markdown(table: ScoreTable, full_tokens: float | None = None,
                         comparison: pd.DataFrame | None = None) -> str:
    """The paper-style table; with `comparison` (from `compare_published`), a "paper (Δ)" row under each of our
    rows that has published numbers."""
    decimals = {c.task: c.decimals for c in table.columns} | {"rel": 1}
    best = best_per_budget(table, decimals)
    header = ["Method", "Tokens"] + [c.label for c in table.columns] + ["Rel."]
    rows = []
    for rid, row in table.frame.iterrows():
        tokens = _tokens_cell(row, full_tokens)
        cells = [row["label"], tokens]
        for col in table.columns:
            nans = row.get(f"{col.task}{NAN_SAMPLES}")
            cell = _cell(row[col.task] * col.scale, col.decimals, (rid, col.task) in best,
                         nan="NaN" if nans is not None and nans > 0 else "–")
            low, high = row.get(f"{col.task}{CI_LOW}"), row.get(f"{col.task}{CI_HIGH}")
            if low is not None and high is not None and not _isnan(low) and not _isnan(high):
                cell += f" ({low * col.scale:.{col.decimals}f}–{high * col.scale:.{col.decimals}f})"
            cell += spread_note(row, col.task, col.scale, col.decimals) + failed_note(row.get(f"{col.task}{FAILED}"))
            cell += nan_note(nans)
            cells.append(cell)
        rel_of = row.get(REL_OF)
        over = "" if rel_of is None or _isnan(rel_of) or _isnan(float(row["rel"])) else \
            f" (over {int(rel_of)} of {len(table.columns)} benchmarks)"
        cells.append(_cell(row["rel"], 1, (rid, "rel") in best, suffix="%") + spread_note(row, "rel", 1.0, 1) + over)
        rows.append(cells)
        paper = _paper_row(table, rid, comparison, decimals)
        if paper:
            rows.append(["↳ paper (Δ ours − paper)", tokens] + paper)
    return markdown_table(header, rows)


def _paper_row(table: ScoreTable, rid: str, comparison: pd.DataFrame | None, decimals: dict) -> list | None:
    """Cells "81.5 (−1.5)" for the published numbers of our row (``rid``: its trial), or None when the paper has
    none for it."""
    if comparison is None or comparison.empty:
        return None
    same = comparison[comparison["run_id"] == rid]
    values = {r["column"]: r for _, r in same.iterrows()}
    keys = [c.task for c in table.columns] + ["rel"]
    if not any(k in values for k in keys):
        return None
    cells = []
    for key in keys:
        if key not in values:
            cells.append("")
            continue
        r, dec = values[key], decimals[key]
        delta = "" if _isnan(r["delta"]) else f" ({r['delta']:+.{dec}f})"
        cells.append(f"{r['paper']:.{dec}f}{'%' if key == 'rel' else ''}{delta}")
    return cells


def _tokens_cell(row: pd.Series, full_tokens: float | None) -> str:
    if row["method"] == BASELINE_METHOD:
        return f"all ({full_tokens:.0f})" if full_tokens and not _isnan(full_tokens) else "all"
    return "" if _isnan(row["budget"]) else f"{row['budget']:.0f}"


def spread_note(row: pd.Series, key: str, scale: float, decimals: int) -> str:
    """" ± 1.4, n=2" after the mean of a configuration's repeated runs (``key``: a task or ``rel``): their standard
    deviation in the cell's unit and their count (only the count where one run has the number)."""
    n = row.get(f"{key}{RUNS}")
    if n is None or _isnan(float(n)) or int(n) == 0:
        return ""
    sd = row.get(f"{key}{SD}")
    spread = "" if sd is None or _isnan(float(sd)) else f" ± {sd * scale:.{decimals}f},"
    return f"{spread} n={int(n)}" if spread else f", n={int(n)}"


def failed_note(count) -> str:
    """" [3 failed]" after a score some of whose samples failed (they were scored as wrong answers)."""
    if count is None or _isnan(float(count)) or int(count) == 0:
        return ""
    return f" [{int(count)} failed]"


def nan_note(count) -> str:
    """" [2 NaN sample(s)]" after a score some of whose samples the task's process_results returned NaN for (its
    mean is NaN: the cell says "NaN", where a dash is a score that was not had at all)."""
    if count is None or _isnan(float(count)) or int(count) == 0:
        return ""
    return f" [{int(count)} NaN sample(s)]"


def _cell(value, decimals: int, bold: bool = False, suffix: str = "", nan: str = "–") -> str:
    """A number at ``decimals``; ``nan`` (a dash: no number) where there is none."""
    if value is None or _isnan(float(value)):
        return nan
    tiny = value != 0 and abs(value) < 0.5 * 10 ** -decimals  # e.g. a tiny test model's TFLOPs: 2 significant digits
    text = f"{value:.2g}{suffix}" if tiny else f"{value:.{decimals}f}{suffix}"
    return f"**{text}**" if bold else text


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-style pipe table of already formatted cells, unpadded (``| a | b |``), every report's one writer.
    Not ``DataFrame.to_markdown``: that needs ``tabulate`` (here only through lmms-eval's sacrebleu) and pads
    every column to its widest cell."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# efficiency (Table 6)


def efficiency_table(sweep: Sweep, table: ScoreTable) -> pd.DataFrame | None:
    """Efficiency metrics per trial (paper order), with Rel.; None when no trial logged any."""
    keys = [k for k, _, _ in EFFICIENCY_COLUMNS if k in sweep.metrics.columns]
    if not [k for k in keys if k != "efficiency/visual_tokens"]:
        return None  # token counts alone are in the score table already
    out = table.frame[["method", "budget", "variant", "label"]].copy()
    for key in keys:
        out[key] = sweep.metrics.loc[out.index, key]
    out["rel"] = table.frame["rel"]
    return out


def efficiency_markdown(eff: pd.DataFrame, baseline_id: str | None) -> str:
    """Efficiency table; TFLOPs and KV cache also as the reduction from the unpruned model when it ran."""
    cols = [(k, h, d) for k, h, d in EFFICIENCY_COLUMNS if k in eff.columns]
    header = ["Method", "Tokens"] + [h for _, h, _ in cols] + ["Rel."]
    rows = []
    for rid, row in eff.iterrows():
        cells = [row["label"], _tokens_cell(row, None)]
        for key, _, dec in cols:
            text = _cell(row[key], dec)
            if baseline_id is not None and rid != baseline_id and key in ("efficiency/prefill_tflops",
                                                                          "efficiency/kv_cache_mb"):
                base = eff.loc[baseline_id, key]
                if base and not _isnan(base) and not _isnan(row[key]):
                    text += f" (−{(1 - row[key] / base) * 100:.1f}%)"
            cells.append(text)
        cells.append(_cell(row["rel"], 1, suffix="%"))
        rows.append(cells)
    return markdown_table(header, rows)


# ---------------------------------------------------------------------------------------------------------------
# ours against the published numbers


T_SAL_PREFIX = "t_sal/"  # a published mean T_sal per benchmark (Table 4): `t_sal/<task>`


def compare_published(sweep: Sweep, table: ScoreTable, published: pd.DataFrame,
                      t_sal_of: Callable[[str], dict] | None = None) -> pd.DataFrame:
    """Long table: one row per published cell that has a number: ours, paper, delta (ours - paper), source, and
    ``run_id``, the trial our number comes from.

    Matching is on (method, budget, variant); the baseline matches on method "none" alone; a published row without
    a variant matches the one trial of its method and budget when there is one (Table 1's SparseVLM rows: their
    trials vary `schedule`). A published row no trial matches, whose method ran at its budget as one trial per
    benchmark (Table 4's fixed split), takes each benchmark's number from that benchmark's trial and, as Rel., the
    mean of those trials' Rel. Our value is in the paper's unit: a task column's score x its scale, `rel` in
    percent, `t_sal/<task>` the trial's mean T_sal on that task (``t_sal_of(run_id)``: per task, from its
    predictions), any other column the logged metric. A published row whose trial did not run keeps ours and delta
    empty.
    """
    from .published import value_columns

    records = []
    for _, prow in published.iterrows():
        rid = _match_trial(table.frame, prow)
        parts = {} if rid is not None else _per_task_trials(sweep, table.frame, prow)
        for col in value_columns(published):
            paper = prow[col]
            if _isnan(float(paper)):
                continue
            cell_rid, ours = rid, np.nan
            if rid is not None:
                ours = _our_value(sweep, table, rid, col, t_sal_of)
            elif col in parts:
                cell_rid = parts[col]
                ours = _our_value(sweep, table, cell_rid, col, t_sal_of)
            elif col == "rel" and parts:
                ours = float(np.mean([table.frame.loc[r, "rel"] for r in parts.values()]))
            records.append({"method": prow["method"], "budget": prow["budget"], "variant": prow["variant"],
                            "column": col, "ours": ours, "paper": float(paper), "delta": ours - float(paper),
                            "source": prow["source"], "run_id": cell_rid})
    return pd.DataFrame(records, columns=["method", "budget", "variant", "column", "ours", "paper", "delta",
                                          "source", "run_id"])


def _match_trial(frame: pd.DataFrame, prow: pd.Series) -> str | None:
    if prow["method"] == BASELINE_METHOD:
        hits = frame.index[frame["method"] == BASELINE_METHOD]
        return hits[0] if len(hits) else None
    same = frame[(frame["method"] == prow["method"]) & (frame["budget"] == prow["budget"])]
    hits = same.index[same["variant"] == prow["variant"]]
    if len(hits):
        return hits[0]
    return same.index[0] if not prow["variant"] and len(same) == 1 else None


def _per_task_trials(sweep: Sweep, frame: pd.DataFrame, prow: pd.Series) -> dict[str, str]:
    """``{task: run id}`` when the published row's method ran at its budget as one trial per benchmark (each trial
    on one benchmark of its own, at least two); else empty."""
    if prow["method"] == BASELINE_METHOD or "tasks" not in sweep.trials.columns:
        return {}
    hits = frame.index[(frame["method"] == prow["method"]) & (frame["budget"] == prow["budget"])]
    by_task: dict[str, str] = {}
    for rid in hits:
        value = sweep.trials.loc[rid, "tasks"]
        tasks = parse_task_list(value) if isinstance(value, str) else []
        if len(tasks) != 1 or tasks[0] in by_task:
            return {}
        by_task[tasks[0]] = rid
    return by_task if len(by_task) >= 2 else {}


def _our_value(sweep: Sweep, table: ScoreTable, rid: str, col: str,
               t_sal_of: Callable[[str], dict] | None = None) -> float:
    if col == "rel":
        return float(table.frame.loc[rid, "rel"])
    if col in table.frame.columns and col not in ("method", "budget", "variant", "label"):
        return float(table.display(col, table.frame.loc[rid, col]))
    if col in sweep.metrics.columns:
        return float(sweep.metrics.loc[rid, col])
    if col.startswith(T_SAL_PREFIX) and t_sal_of is not None:
        return float(t_sal_of(rid).get(col[len(T_SAL_PREFIX):], np.nan))
    return np.nan


def comparison_markdown(comp: pd.DataFrame, table: ScoreTable) -> str:
    labels = {c.task: c.label for c in table.columns} | {"rel": "Rel. (%)"}
    labels |= {k: h for k, h, _ in EFFICIENCY_COLUMNS}
    rows = []
    for _, r in comp.iterrows():
        budget = "all" if r["method"] == BASELINE_METHOD else f"{r['budget']:.0f}"
        name = METHOD_LABELS.get(r["method"], r["method"]) + (f" ({r['variant']})" if r["variant"] else "")
        delta = "–" if _isnan(r["delta"]) else f"{r['delta']:+.2f}"
        rows.append([name, budget, labels.get(r["column"], r["column"]), _cell(r["ours"], 2),
                     f"{r['paper']:.2f}", delta, r["source"]])
    return markdown_table(["Method", "Tokens", "Metric", "Ours", "Paper", "Δ (ours − paper)", "Source"], rows)


# ---------------------------------------------------------------------------------------------------------------
# Table 4: the adaptive split against a fixed split at each benchmark's mean T_sal


def matched_split_table(table: ScoreTable, adaptive_id: str, fixed: pd.DataFrame,
                        mean_t_sal: dict[str, float], budget: float) -> pd.DataFrame:
    """Per benchmark: adaptive score vs the fixed split's score at ratio mean(T_sal) / budget.

    fixed: rows of `table.frame` for the fixed-ratio trials at `budget`, with a `saliency_ratio` column.
    The fixed score at the matched ratio is linearly interpolated between the two neighbouring grid ratios
    (clamped at the grid's ends: ``clamped``, said in the markdown); the nearest grid ratio and its score are given
    beside it.
    """
    fixed = fixed.sort_values("saliency_ratio")
    ratios = fixed["saliency_ratio"].to_numpy(dtype=float)
    records = []
    for col in table.columns:
        t_sal = mean_t_sal.get(col.task, np.nan)
        adaptive = table.frame.loc[adaptive_id, col.task] * col.scale
        scores = fixed[col.task].to_numpy(dtype=float) * col.scale
        ok = ~np.isnan(scores)
        if _isnan(t_sal) or not ok.any():
            continue
        ratio = t_sal / budget
        interp = float(np.interp(ratio, ratios[ok], scores[ok]))
        nearest = int(np.argmin(np.abs(ratios[ok] - ratio)))
        records.append({"task": col.task, "benchmark": col.label, "mean_t_sal": t_sal, "ratio": ratio,
                        "adaptive": adaptive, "fixed_interp": interp, "nearest_ratio": ratios[ok][nearest],
                        "fixed_nearest": scores[ok][nearest], "delta": adaptive - interp,
                        "clamped": not ratios[ok].min() <= ratio <= ratios[ok].max()})  # held at a grid end
    return pd.DataFrame(records)


def matched_split_markdown(frame: pd.DataFrame) -> str:
    rows = [[r["benchmark"], f"{r['mean_t_sal']:.1f}", f"{r['ratio']:.3f}", f"{r['adaptive']:.2f}",
             f"{r['fixed_interp']:.2f}" + (f" (outside the grid: its end, {r['nearest_ratio']:g})"
                                           if r.get("clamped") else ""),
             f"{r['fixed_nearest']:.2f} @ {r['nearest_ratio']:g}", f"{r['delta']:+.2f}"]
            for _, r in frame.iterrows()]
    return markdown_table(["Benchmark", "mean T_sal", "ratio", "Adaptive", "Fixed (matched)",
                           "Fixed (nearest grid)", "Δ adaptive − fixed"], rows)
