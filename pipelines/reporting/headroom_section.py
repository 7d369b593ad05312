"""The report's "split headroom" section: per task and budget, the best fixed saliency ratio, the per-sample oracle, a
cross-validated entropy rule and each other trial at the budget, from the trials' per-sample answers; and its figure.

A sweep qualifies when, at some budget, `fixed_ratio` trials ran at two or more saliency ratios beside at least one
other pruned trial (PromPrune, or any method of a plugin). Every trial at that budget answered the same documents,
so each document (or, for MME, each question pair) gets a score under every ratio: the table the numbers of
`pipelines.reporting.headroom` are computed from.

**Per-sample scores** (`unit_scores`): lmms-eval's own ``process_results`` items of the task's primary metric
(`promprune.eval.scoring.sample_items`, failed samples replayed as `FAILED_ANSWER`, a wrong answer), turned into one
number per unit in the benchmark's unit (percent, MME points):

- a metric that averages its items (exact match, accuracy, ANLS, ...): the document's item;
- a yes/no F1 (POPE, the testbed's existence): whether the answer is right (1 / 0). F1 does not split into
  samples; right answers are what it counts (a wrong one is a false positive or a false negative), so the
  section's numbers for these tasks are accuracies;
- a task scored by groups (MME's question pairs, MMBench's circular copies): the group is the unit, scored by the
  task's own aggregation over it (an MME pair: acc + acc+ of its two answers, 0, 50 or 200 points; the benchmark
  sums its subtasks' means of these).
"""
from __future__ import annotations

import copy
import numbers
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from . import headroom as hr
from .columns import KNOWN_COLUMNS, column_for
from .paired import ITERS, SEED
from .store import BASELINE_METHOD, Sweep
from .tables import ScoreTable, fmt_value, markdown_table

FIXED = "fixed_ratio"
RATIO = "saliency_ratio"
POOLED = "pooled"  # the panel that pools every task whose per-sample score is a percentage
FOLD_SEED = 0
MAX_PANELS = 6  # columns of one budget's figure
TRUTH = "num_objects"  # the testbed's ground-truth concentration (objects in the scene)

PredsOf = Callable[[str], "pd.DataFrame | None"]  # trial run id -> its predictions.parquet frame
ItemsOf = Callable[[str], "dict | None"]  # trial run id -> {task: TaskItems}
TruthOf = Callable[[str], "pd.DataFrame | None"]  # task -> ground truth by doc_id, or None


# ---------------------------------------------------------------------------------------------------------------
# per-sample scores


SCORE_KINDS = {  # kind -> what the report says the per-sample score is
    "item": "the document's own item, which the metric averages",
    "correct": "1 if the yes/no answer is right, else 0 (F1 does not split into samples; the numbers are accuracies)",
    "group": "the task's own aggregation over a group of documents scored together (MME: a question pair, acc + acc+, "
             "0 / 50 / 200 points; MMBench: a question with its circular copies)",
    "one": "the task's own aggregation over the one document (not a mean of items)",
}
RATIO_METRICS = ("f1", "precision", "recall")  # metrics over records that do not split into samples


def _correct(item: dict) -> float:
    if "score" in item:  # lmms-eval's POPE records carry their own correctness
        return float(item["score"])
    truth = item.get("answer", item.get("ground_truth"))
    return float(str(item.get("prediction")).strip().lower() == str(truth).strip().lower())


def score_kind(task_items, metric: str) -> str:
    """Which per-sample score a task's primary metric takes (a key of SCORE_KINDS)."""
    from promprune.eval.scoring import aggregate_is_mean

    if task_items.grouping is not None:
        return "group"
    first = next(iter(task_items.items[metric].values()))
    if isinstance(first, numbers.Real) and not isinstance(first, bool):
        return "item" if aggregate_is_mean(task_items.aggregations[metric]) else "one"
    if isinstance(first, dict) and any(m in metric.lower() for m in RATIO_METRICS) and "prediction" in first:
        return "correct"
    return "one"


def unit_scores(task_items, scale: float) -> tuple[list[tuple[int, ...]], np.ndarray, str]:
    """(units: the doc ids of each unit, ``[n]`` scores in the benchmark's unit (raw x ``scale``), the score kind)."""
    units = [tuple(group) for stratum in task_items.units() for group in stratum]
    total, kinds = np.zeros(len(units)), []
    with tempfile.TemporaryDirectory(prefix="promprune-headroom-") as tmp:
        args = copy.copy(task_items.args)  # aggregations that write files (MMBench's) write them under tmp
        if args is not None:
            args.output_path = tmp
        for metric, by_doc in task_items.items.items():
            kinds.append(score_kind(task_items, metric))
            total += [_unit_value(task_items, metric, kinds[-1], [by_doc[d] for d in docs], args) for docs in units]
    return units, total * scale, "+".join(dict.fromkeys(kinds))


def _unit_value(task_items, metric: str, kind: str, items: list, args) -> float:
    """One unit's score from its documents' items (raw units)."""
    from promprune.eval.scoring import aggregate_with

    if kind == "group":
        relabel = task_items.grouping[1]
        return float(aggregate_with(task_items.aggregations[metric], [relabel(x, 0) for x in items], args))
    if kind == "item":
        return float(items[0])
    if kind == "correct":
        return _correct(items[0])
    return float(aggregate_with(task_items.aggregations[metric], items[:1], args))


# ---------------------------------------------------------------------------------------------------------------
# panels: one task (or the pooled tasks) at one budget


@dataclass
class Panel:
    task: str  # task name, or POOLED
    label: str
    budget: float
    kind: str  # score kind(s)
    units: pd.DataFrame  # per unit: task, docs, entropy, image (key), cluster, fold, (num_objects)
    ratios: list  # the fixed ratios, ascending
    shares: np.ndarray  # [K] realised saliency share T_sal / T of each ratio
    fixed: np.ndarray  # [n, K] scores
    methods: dict = field(default_factory=dict)  # label -> [n] scores
    method_shares: dict = field(default_factory=dict)  # label -> [n] realised T_sal / T (NaN: not recorded)
    sigmoids: dict = field(default_factory=dict)  # label -> (mu, tau, kr_min, kr_max) of a PromPrune trial

    @property
    def has_truth(self) -> bool:
        return TRUTH in self.units and self.units[TRUTH].notna().any()


def _isnum(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def budgets_with_grid(sweep: Sweep, table: ScoreTable) -> dict[float, dict]:
    """{budget: {"fixed": {ratio: run id}, "others": [run ids]}} where a fixed-ratio grid (>= 2 ratios) ran beside
    another pruned trial, budgets descending (as the tables). A ratio run twice (another variant) counts once: the
    first in report order."""
    if RATIO not in sweep.option_names:
        return {}
    frame = table.frame.join(sweep.trials[[RATIO]])
    out = {}
    for budget, rows in sorted(frame[frame["method"] != BASELINE_METHOD].groupby("budget"), key=lambda g: -g[0]):
        fixed = {}
        for rid, row in rows[(rows["method"] == FIXED)].iterrows():
            if _isnum(row[RATIO]):
                fixed.setdefault(float(row[RATIO]), rid)
        others = list(rows.index[rows["method"] != FIXED])
        if len(fixed) >= 2 and others:
            out[float(budget)] = {"fixed": dict(sorted(fixed.items())), "others": others}
    return out


def _per_doc(preds_of: PredsOf, run_ids: list[str], column: str, dtype) -> pd.Series:
    """``column`` per (task, doc_id) from the first of ``run_ids`` whose predictions carry it (a value not all null);
    empty where none does."""
    for rid in run_ids:
        frame = preds_of(rid)
        if frame is not None and column in frame and frame[column].notna().any():
            keys = zip(frame["task"], frame["doc_id"].astype(int))
            return pd.Series(frame[column].astype(dtype).to_numpy(), index=pd.MultiIndex.from_tuples(list(keys)))
    return pd.Series(dtype=dtype)


def _entropies(preds_of: PredsOf, run_ids: list[str]) -> pd.Series:
    """Spectral entropy per (task, doc_id) from the first of ``run_ids`` whose predictions carry it."""
    return _per_doc(preds_of, run_ids, "entropy", float)


def _image_keys(preds_of: PredsOf, run_ids: list[str]) -> pd.Series:
    """The image key (``Prediction.image_key``) per (task, doc_id) from the first of ``run_ids`` whose predictions
    carry it (empty when none does: records from before the column)."""
    return _per_doc(preds_of, run_ids, "image_key", object)


def _unit_keys(keys: pd.Series, task: str, units: list[tuple]) -> list:
    """Each unit's image key: its first document's that has one (None where none has)."""
    found = ([keys.get((task, d)) for d in docs] for docs in units)
    return [next((k for k in known if isinstance(k, str) and k), None) for known in found]


def _shares(frame: pd.DataFrame | None, budget: float) -> pd.Series:
    """Realised saliency share T_sal / T per (task, doc_id) (empty without a saliency_count column)."""
    if frame is None or "saliency_count" not in frame:
        return pd.Series(dtype=float)
    keys = pd.MultiIndex.from_tuples(list(zip(frame["task"], frame["doc_id"].astype(int))))
    return pd.Series(frame["saliency_count"].astype(float).to_numpy() / budget, index=keys)


def _per_unit(values: pd.Series, task: str, units: list[tuple]) -> np.ndarray:
    """The mean of ``values`` (indexed by (task, doc_id)) over each unit's documents (NaN where none is known)."""
    out = np.full(len(units), np.nan)
    for i, docs in enumerate(units):
        known = [values.get((task, d), np.nan) for d in docs]
        known = [v for v in known if v == v]
        out[i] = np.mean(known) if known else np.nan
    return out


def _sigmoid_of(sweep: Sweep, rid: str) -> tuple | None:
    """(mu, tau, kr_min, kr_max) of a PromPrune trial on spectral entropy, when its mu and tau were logged."""
    row = sweep.trials.loc[rid]
    if row["method"] != "promprune" or str(row.get("metric") or "spectral") != "spectral":
        return None
    mu, tau = row.get("mu"), row.get("tau")
    if not (_isnum(mu) and _isnum(tau)):
        return None
    kr = row.get("saliency_ratio_range")
    try:
        kr_min, kr_max = (float(v) for v in str(kr).strip("()[] ").split(",")) if kr else (0.0, 1.0)
    except ValueError:
        kr_min, kr_max = 0.0, 1.0
    return float(mu), float(tau), kr_min, kr_max


@dataclass
class _Budget:
    """What every task's panel at one budget reads."""

    sweep: Sweep
    budget: float
    fixed: dict  # ratio -> trial id
    others: list  # trial ids
    items: dict  # trial id -> {task: TaskItems} or None
    entropy: pd.Series  # by (task, doc_id)
    images: pd.Series  # image key by (task, doc_id)
    preds_of: PredsOf
    truth_of: TruthOf
    labels: pd.Series  # trial id -> its label in the tables
    notes: list


def build_panels(sweep: Sweep, table: ScoreTable, preds_of: PredsOf, items_of: ItemsOf,
                 truth_of: TruthOf) -> tuple[list[Panel], list[str]]:
    """Every (task, budget) panel of the sweep, plus a pooled panel per budget; and notes on what was left out."""
    panels, notes = [], []
    for budget, arms in budgets_with_grid(sweep, table).items():
        ids = list(arms["fixed"].values()) + arms["others"]
        order = arms["others"] + list(arms["fixed"].values()) + list(sweep.trials.index)
        ctx = _Budget(sweep, budget, arms["fixed"], arms["others"], {rid: items_of(rid) for rid in ids},
                      _entropies(preds_of, order), _image_keys(preds_of, order), preds_of, truth_of,
                      table.frame["label"], notes)
        per_task = [p for p in (_task_panel(ctx, task) for task in sweep.tasks()) if p is not None]
        pooled = _pooled(per_task)
        panels += per_task + ([pooled] if pooled is not None else [])
    return panels, notes


def _task_panel(ctx: _Budget, task: str) -> Panel | None:
    """One task at one budget: the fixed ratios that answered its documents (the first's), >= 2 of them."""
    arms = {r: (ctx.items[rid] or {}).get(task) for r, rid in ctx.fixed.items()}
    first = next((a for a in arms.values() if a is not None and a.items), None)
    if first is None:
        return None
    same = {r: rid for r, rid in ctx.fixed.items() if arms[r] is not None and arms[r].doc_ids == first.doc_ids}
    if len(same) < 2:
        ctx.notes.append(f"{task} at {ctx.budget:.0f} tokens: fewer than two fixed ratios answered its documents "
                         "(or their per-sample items could not be had here)")
        return None
    column = KNOWN_COLUMNS.get(task) or column_for(task, _logged(ctx.sweep, task), ctx.sweep.primary.get(task))
    units, _, kind = unit_scores(first, column.scale)
    fixed = np.column_stack([unit_scores(arms[r], column.scale)[1] for r in same])  # [n, K]
    shares = np.array([_fixed_share(ctx.preds_of(rid), r, ctx.budget) for r, rid in same.items()])
    frame = pd.DataFrame({"task": task, "docs": units, "entropy": _per_unit(ctx.entropy, task, units),
                          "image": _unit_keys(ctx.images, task, units)})
    truth = ctx.truth_of(task)
    if truth is not None and TRUTH in truth:
        keys = pd.MultiIndex.from_tuples([(task, int(d)) for d in truth.index])
        frame[TRUTH] = _per_unit(pd.Series(truth[TRUTH].astype(float).to_numpy(), index=keys), task, units)
    panel = Panel(task, column.label, ctx.budget, kind, frame, list(same), shares, fixed)
    for rid in ctx.others:
        _add_trial(ctx, panel, rid, first, column.scale)
    _group_images(panel)
    return panel


def _logged(sweep: Sweep, task: str) -> list[str]:
    return [c.split("/", 1)[1] for c in sweep.metrics.columns if c.startswith(f"{task}/")] or ["score"]


def _fixed_share(frame: pd.DataFrame | None, ratio: float, budget: float) -> float:
    """A fixed ratio's realised T_sal / T: its predictions' median, else round-half-even(ratio x T) / T."""
    realised = _shares(frame, budget).dropna()
    return float(realised.median()) if len(realised) else min(max(round(ratio * budget), 0), budget) / budget


def _add_trial(ctx: _Budget, panel: Panel, rid: str, first, scale: float) -> None:
    """Another trial at the budget, when it answered the same documents."""
    label = ctx.labels[rid]
    theirs = (ctx.items.get(rid) or {}).get(panel.task)
    if theirs is None or theirs.doc_ids != first.doc_ids:
        ctx.notes.append(f"{label} at {ctx.budget:.0f} tokens left out of {panel.task}: not the documents the "
                         "fixed ratios answered, or no per-sample items")
        return
    panel.methods[label] = unit_scores(theirs, scale)[1]
    panel.method_shares[label] = _per_unit(_shares(ctx.preds_of(rid), ctx.budget), panel.task,
                                           list(panel.units["docs"]))
    sigmoid = _sigmoid_of(ctx.sweep, rid)
    if sigmoid is not None:
        panel.sigmoids[label] = sigmoid


def _group_images(panel: Panel) -> None:
    """Image groups (bootstrap clusters) and the two halves of the cross-validation."""
    panel.units["cluster"] = hr.clusters_by_image(panel.units["image"].tolist(), panel.units["entropy"].to_numpy())
    panel.units["fold"] = hr.folds_by_cluster(panel.units["cluster"].to_numpy(), FOLD_SEED)


def _pooled(panels: list[Panel]) -> Panel | None:
    """The tasks whose per-sample score is a percentage, pooled (a population of mixed images, the premise's case),
    over the fixed ratios every one of them answered (>= 2, else no pooled panel)."""
    parts = [p for p in panels if p.kind in ("item", "correct")
             and (KNOWN_COLUMNS.get(p.task) is None or KNOWN_COLUMNS[p.task].scale == 100.0)]
    if len(parts) < 2:
        return None
    # the ratios every task answered (a trial on a subset of the tasks gives one task a ratio the others lack)
    ratios = [r for r in parts[0].ratios if all(r in p.ratios for p in parts)]
    if len(ratios) < 2:
        return None
    columns = [[p.ratios.index(r) for r in ratios] for p in parts]
    methods = [m for m in parts[0].methods if all(m in p.methods for p in parts)]
    units = pd.concat([p.units.drop(columns=["cluster", "fold"]) for p in parts], ignore_index=True)
    panel = Panel(POOLED, f"pooled: {len(parts)} tasks", parts[0].budget,
                  "+".join(dict.fromkeys(p.kind for p in parts)), units, ratios,
                  np.mean([p.shares[c] for p, c in zip(parts, columns)], axis=0),
                  np.vstack([p.fixed[:, c] for p, c in zip(parts, columns)]))
    for m in methods:
        panel.methods[m] = np.concatenate([p.methods[m] for p in parts])
        panel.method_shares[m] = np.concatenate([p.method_shares[m] for p in parts])
        if m in parts[0].sigmoids:
            panel.sigmoids[m] = parts[0].sigmoids[m]
    _group_images(panel)
    return panel


# ---------------------------------------------------------------------------------------------------------------
# the numbers of one panel


@dataclass
class Analysis:
    panel: Panel
    best: int  # column of the best fixed ratio
    rows: list  # (name, mean score, Estimate against the best fixed or None, note)
    rules: dict  # feature name -> [rule scoring fold 0, rule scoring fold 1]
    captured: dict  # method label -> hr.Captured (of the entropy rule's headroom)
    sensitive: int = 0  # samples whose score depends on the ratio (not every ratio alike)
    rho: dict = field(default_factory=dict)  # feature -> Spearman rho of those samples' best share with it


FEATURES = {"entropy": "spectral entropy", TRUTH: "objects in the scene (ground truth)"}


def analyse(panel: Panel, iters: int = ITERS, seed: int = SEED) -> Analysis:
    scores, units = panel.fixed, panel.units
    clusters, folds = units["cluster"].to_numpy(), units["fold"].to_numpy()
    draws = hr.cluster_draws(len(np.unique(clusters)), iters, seed)
    best = hr.best_fixed(scores)
    reference = scores[:, best]
    rows = [(f"Best fixed ratio: {fmt_value(panel.ratios[best])}", reference.mean(), None,
             f"T_sal/T {panel.shares[best]:.3f}")]
    top = hr.oracle(scores)
    rows.append((f"Oracle: each sample's best of {scores.shape[1]} ratios", top.mean(),
                 hr.difference(top, reference, clusters, draws), "an upper bound that picks among noisy answers"))
    rules, held = {}, {}
    for feature, name in FEATURES.items():
        if feature not in units or units[feature].isna().all():
            continue
        held[feature], rules[feature] = hr.cross_validated(units[feature].to_numpy(), scores, folds)
        rows.append((f"Cross-validated rule on {name}", held[feature].mean(),
                     hr.difference(held[feature], reference, clusters, draws), _rule_text(rules[feature], panel)))
    captured = {}
    for label, column in panel.methods.items():
        rows.append((label, column.mean(), hr.difference(column, reference, clusters, draws),
                     _share_text(panel.method_shares.get(label))))
        if "entropy" in held:
            captured[label] = hr.captured(column, held["entropy"], reference, clusters, draws)
    return Analysis(panel, best, rows, rules, captured, *_predictability(panel))


def _predictability(panel: Panel) -> tuple[int, dict]:
    """(ratio-dependent samples, {feature: Spearman rho of their best share (the mean T_sal / T of the ratios that
    reach their best score) with the feature})."""
    from .ground_truth import spearman

    best = hr.best_set(panel.fixed)
    sensitive = ~best.all(axis=1)
    share = (best * panel.shares).sum(axis=1) / best.sum(axis=1)
    rho = {f: spearman(pd.Series(share[sensitive]), panel.units[f][sensitive].reset_index(drop=True))
           for f in FEATURES if f in panel.units and panel.units[f].notna().any()}
    return int(sensitive.sum()), rho


def _rule_text(rules: list, panel: Panel) -> str:
    def one(rule):
        if rule.threshold is None:
            return f"{fmt_value(panel.ratios[rule.above])} for all"
        return (f"< {rule.threshold:.4g}: {fmt_value(panel.ratios[rule.below])}, else "
                f"{fmt_value(panel.ratios[rule.above])}")
    return f"fit on half B, scores A: {one(rules[0])}; fit on A, scores B: {one(rules[1])}"


def _share_text(shares) -> str:
    if shares is None or np.isnan(shares).all():
        return ""
    return f"mean T_sal/T {np.nanmean(shares):.3f}"


# ---------------------------------------------------------------------------------------------------------------
# markdown and CSV


INTRO = (
    "Per task and budget, the fixed-ratio trials answer the same samples at each saliency ratio, so each sample has"
    " a score under every ratio. **Best fixed ratio**: the ratio of the highest mean (ties: the smaller). "
    "**Oracle**: each sample answered by its own best ratio, an upper bound that flatters itself (it picks the "
    "luckiest of the ratios' answers). **Cross-validated rule**: a step rule (one cut of the feature at a decile, "
    "each side its best ratio; no cut unless it scores strictly higher) fit on one half of the images and scored on"
    " the other, then the reverse: what the feature honestly buys. Then each other trial at the budget. Every "
    "difference is against the best fixed ratio, in points, with a 95% paired bootstrap interval: the images "
    "resampled {iters} times (the questions about one image drawn together), every arm scored on the same draw. The"
    ' best fixed ratio is chosen on these same samples, which flatters it, not the rules. "captures X%": (method - '
    "best fixed) / (entropy rule - best fixed) on the same draws; resamples on which the rule gains nothing are "
    "left out of its interval, and their share is given.")


def markdown(analyses: list[Analysis], notes: list[str], iters: int = ITERS) -> str:
    if not analyses:
        return ""
    lines = ["## Split headroom: a per-sample split against the best fixed one", "", INTRO.format(iters=iters), "",
             "Per-sample score of each task:", ""]
    for a in analyses:
        if a.panel.task != POOLED and a.panel.budget == analyses[0].panel.budget:
            kinds = " + ".join(SCORE_KINDS[k] for k in a.panel.kind.split("+"))
            lines.append(f"- {a.panel.label} (`{a.panel.task}`): {kinds}")
    lines.append("")
    for budget in dict.fromkeys(a.panel.budget for a in analyses):
        lines += [f"### {budget:.0f} tokens", ""]
        for a in (x for x in analyses if x.panel.budget == budget):
            lines += _panel_markdown(a)
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _panel_markdown(a: Analysis) -> list[str]:
    p = a.panel
    n, images = len(p.units), p.units["cluster"].nunique()
    rows = [[name, f"{score:.1f}", "-" if est is None else est.text(), note] for name, score, est, note in a.rows]
    rho = "; ".join(f"Spearman rho of their best share with {FEATURES[f]} {r:+.2f}" for f, r in a.rho.items())
    pooled = " (" + ", ".join(sorted(set(p.units["task"]), key=list(p.units["task"]).index)) + ")"
    head = f"**{p.label}**" + (pooled if p.task == POOLED else "") + f": {n} samples, {images} images"
    head += f"; {a.sensitive} samples' scores depend on the ratio" + (f" ({rho})" if rho else "")
    out = [head, "",
           markdown_table(["arm", "score", "vs best fixed, points [95%]", "note"], rows).rstrip("\n"), ""]
    for label, c in a.captured.items():
        out.append(f"- {captured_line(label, c)}")
    return out + [""]


def captured_line(label: str, c: hr.Captured) -> str:
    if not c.headroom > 0:
        return (f"{label} captures -: the cross-validated rule gains nothing over the best fixed ratio here "
                f"({c.headroom:+.1f} points), so there is no headroom to take a share of")
    line = f"{label} captures {c.value:.0f}% [{c.low:.0f}, {c.high:.0f}] of the cross-validated headroom"
    line += f" ({c.headroom:+.1f} points)"
    if c.undefined > 0:
        line += f"; the rule gained nothing on {100 * c.undefined:.0f}% of the resamples (left out)"
    return line


def csv_frame(analyses: list[Analysis]) -> pd.DataFrame:
    rows = []
    for a in analyses:
        for name, score, est, note in a.rows:
            rows.append({"budget": a.panel.budget, "task": a.panel.task, "arm": name, "score": score,
                         "diff": np.nan if est is None else est.value, "diff_low": np.nan if est is None else est.low,
                         "diff_high": np.nan if est is None else est.high, "note": note,
                         "samples": len(a.panel.units), "images": a.panel.units["cluster"].nunique()})
        for label, c in a.captured.items():
            rows.append({"budget": a.panel.budget, "task": a.panel.task, "arm": f"captured: {label}",
                         "score": c.value, "diff_low": c.low, "diff_high": c.high,
                         "note": f"headroom {c.headroom:+.2f}; undefined share {c.undefined:.3f}"})
    return pd.DataFrame(rows)
