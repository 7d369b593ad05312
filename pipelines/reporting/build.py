"""Assemble a sweep's report: tables (markdown + CSV), figures (PNG), `report.md`; log them to the parent run.

`build_report(sweep, out_dir)` decides what applies from the trials themselves (several budgets: trade-off
curves; a fixed-ratio grid: the saliency-ratio figure and Table 4's matched split; a mu x tau grid: the heatmap;
per-sample entropies: the histograms and overlays; published numbers shipped for the sweep: the deltas), so
every spec in `sweeps/` gets its paper table or figure without per-spec code.
"""
from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from pipelines import mlflow_layout

from . import figures, ground_truth, overlay, side_by_side, tables
from .published import PAPER_DIR, load_published
from .store import BASELINE_METHOD, Sweep, load_predictions

ARTIFACT_DIR = mlflow_layout.REPORT_DIR  # the report's folder among the parent run's artifacts
MAX_OVERLAYS = 4  # token-selection overlays per report: one per benchmark, at most this many
MAX_ENTROPY_CANDIDATES = 3  # PromPrune trials whose predictions are tried for the histograms before giving up
CALIBRATION_MARK = "calibration"  # sweeps whose name contains this get the mu-calibration section

ImageSource = Callable[[str, str], tuple[np.ndarray, str]]  # (task, doc_id) -> (image [H, W, 3] uint8, note)


@dataclass
class Report:
    out_dir: Path
    files: list = field(default_factory=list)  # every file written, report.md first
    markdown: str = ""
    calibration: dict = field(default_factory=dict)  # metrics for the parent run: calibration/median_entropy, ...


def build_report(sweep: Sweep, out_dir: Path, *, published_root: Path = PAPER_DIR,
                 image_source: ImageSource | None = None,
                 truth_source: ground_truth.TruthSource | None = None) -> Report:
    """Write every table and figure that applies to `sweep` under `out_dir`; return what was written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir)
    preds = _PredictionCache()
    table = tables.build_score_table(sweep)
    full_tokens = _full_tokens(sweep, preds)
    sections = [_header(sweep, table)]
    published = load_published(sweep.name, published_root)
    comparison = None if published is None else tables.compare_published(sweep, table, published)
    sections.append(_scores_section(table, full_tokens, comparison, out_dir, report))
    sections.append(_efficiency_section(sweep, table, out_dir, report))
    sections.append(_published_section(sweep, table, published, comparison, out_dir, report))
    sections.append(_matched_split_section(sweep, table, preds, out_dir, report))
    entropy_id = _entropy_trial(table, preds)
    sections.append(_calibration_section(sweep, table, preds, entropy_id, report))
    sections.append(_figures_section(sweep, table, preds, entropy_id, full_tokens, out_dir, report,
                                     image_source or task_image))
    sections.append(_side_by_side_section(sweep, table, preds, full_tokens, out_dir, report,
                                          image_source or task_image))
    sections.append(_prominence_section(sweep, table, preds, out_dir, report,
                                        truth_source or ground_truth.testbed_truth))
    report.markdown = "\n".join(s for s in sections if s)
    md_path = out_dir / "report.md"
    md_path.write_text(report.markdown)
    html_path = out_dir / "report.html"
    html_path.write_text(render_html(report.markdown, out_dir, title=f"Report: {sweep.name}"))
    report.files[:0] = [md_path, html_path]
    return report


def render_html(markdown: str, out_dir: Path, title: str) -> str:
    """The report as one self-contained HTML page (MLflow 3.17's artifact viewer renders .md but shows its relative
    images as ``[name](file.png)`` text; it renders .html whole): tables rendered, every figure of ``out_dir``
    inlined as a data URI."""
    import base64
    import html

    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(markdown)

    def inline(match: re.Match) -> str:
        path = out_dir / match.group(1)
        if not path.is_file() or path.suffix.lower() != ".png":
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"'

    body = re.sub(r'src="([^"/]+)"', inline, body)
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;"
             "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{body}</body></html>")


def log_report(sweep: Sweep, report: Report, client: MlflowClient | None = None) -> str:
    """Log the report folder as artifacts of the sweep's parent run (and calibration results); return its URI."""
    client = client or MlflowClient()
    client.log_artifacts(sweep.run_id, str(report.out_dir), artifact_path=ARTIFACT_DIR)
    for key, value in report.calibration.items():
        client.log_metric(sweep.run_id, key, float(value))
    if "calibration/chosen_mu" in report.calibration:
        client.set_tag(sweep.run_id, mlflow_layout.CALIBRATED_MU, f"{report.calibration['calibration/chosen_mu']:g}")
    return f"{client.get_run(sweep.run_id).info.artifact_uri}/{ARTIFACT_DIR}"


# ---------------------------------------------------------------------------------------------------------------
# sections


def _header(sweep: Sweep, table: tables.ScoreTable) -> str:
    models = sweep.trials["model"].dropna() if "model" in sweep.trials else pd.Series(dtype=str)
    model = models.iloc[0] if len(models) else "?"
    failed = sweep.metrics.get("samples/failed", pd.Series(dtype=float)).fillna(0).sum()
    lines = [f"# Report: {sweep.name}", "",
             f"- parent run: `{sweep.run_id}`, spec version {sweep.tags.get(mlflow_layout.VERSION, '?')}",
             f"- model: `{model}`; trials: {len(sweep.trials)}; benchmarks: "
             + ", ".join(f"{c.label} (`{c.task}`: {'+'.join(c.metrics)})" for c in table.columns),
             f"- failed samples over all trials: {failed:.0f}"]
    unfinished = sweep.trials[sweep.trials["status"] != "FINISHED"]
    if len(unfinished):
        lines.append(f"- trials not FINISHED (their numbers may be missing): {', '.join(unfinished['trial'])}")
    return "\n".join(lines) + "\n"


def _scores_section(table, full_tokens, comparison, out_dir, report) -> str:
    _write_csv(tables.score_table_csv(table), out_dir / "scores.csv", report)
    note = "Rel.: each benchmark's score over the unpruned model's, averaged over benchmarks."
    decimals = {c.task: c.decimals for c in table.columns} | {"rel": 1}
    if tables.best_per_budget(table, decimals):
        note += " Bold: best per token budget."
    has_mme = any(c.task == "mme" for c in table.columns)
    note += " Units: MME points (perception), the rest percent." if has_mme else " Units: percent."
    if any(col.endswith(tables.CI_LOW) for col in table.frame.columns):
        note += (" In parentheses: the 95% percentile-bootstrap interval over the benchmark's documents"
                 " (the spec's `bootstrap` resamples).")
    if comparison is not None and not comparison.empty:
        note += " Rows marked ↳ paper: the published numbers, with our delta."
    return f"## Scores\n\n{note}\n\n{tables.score_table_markdown(table, full_tokens, comparison)}"


def _efficiency_section(sweep, table, out_dir, report) -> str:
    eff = tables.efficiency_table(sweep, table)
    if eff is None:
        return ""
    _write_csv(eff.reset_index(names="run_id"), out_dir / "efficiency.csv", report)
    return f"## Efficiency\n\n{tables.efficiency_markdown(eff, sweep.baseline_id)}"


def _published_section(sweep, table, published, comp, out_dir, report) -> str:
    if published is None:
        return (f"## Against the published numbers\n\nNo published numbers are shipped for `{sweep.name}` "
                f"(see `pipelines/paper_results/README.md`).\n")
    if comp.empty:
        return (f"## Against the published numbers\n\n`{sweep.name}.csv` ships the paper's table structure, but "
                "none of its numbers could be found (see `pipelines/paper_results/README.md`).\n")
    _write_csv(comp, out_dir / "published_comparison.csv", report)
    return f"## Against the published numbers\n\n{tables.comparison_markdown(comp, table)}"


def _matched_split_section(sweep, table, preds, out_dir, report) -> str:
    """Table 4, when the sweep has a fixed-ratio grid and an adaptive PromPrune trial at the same budget."""
    if "saliency_ratio" not in sweep.option_names:
        return ""
    frame = table.frame.join(sweep.trials[["saliency_ratio"]])
    parts = []
    for budget, rows in frame[frame["method"] != BASELINE_METHOD].groupby("budget"):
        fixed = rows[(rows["method"] == "fixed_ratio") & rows["saliency_ratio"].notna()]
        adaptive = rows[rows["method"] == "promprune"]
        if fixed["saliency_ratio"].nunique() < 2 or adaptive.empty:
            continue
        aid = adaptive.index[0]
        t_sal, how = _mean_t_sal_per_task(sweep, table, preds, aid)
        matched = tables.matched_split_table(table, aid, fixed, t_sal, budget)
        if matched.empty:
            continue
        _write_csv(matched, out_dir / f"matched_split_b{budget:.0f}.csv", report)
        parts.append(f"### {budget:.0f} tokens\n\nmean T_sal from {how}.\n\n{tables.matched_split_markdown(matched)}")
    if not parts:
        return ""
    return "## Adaptive vs fixed split at each benchmark's mean T_sal (Table 4)\n\n" + "\n".join(parts)


def _calibration_section(sweep, table, preds, entropy_id, report) -> str:
    """mu calibration: the median spectral entropy, and (with a mu grid) the mu of the best Rel."""
    if CALIBRATION_MARK not in sweep.name:
        return ""
    median = np.nan
    if entropy_id is not None:
        median = float(_ok(preds.get(entropy_id))["entropy"].median())
    elif "entropy/median" in sweep.metrics:
        median = float(sweep.metrics["entropy/median"].dropna().median())
    lines = ["## mu calibration", ""]
    if not np.isnan(median):
        report.calibration["calibration/median_entropy"] = median
        lines.append(f"- median spectral entropy over the calibration images: **{median:.4f}**")
    chosen = choose_mu(table.frame.join(sweep.trials[["mu"]]) if "mu" in sweep.option_names else None, median)
    if chosen is not None:
        report.calibration["calibration/chosen_mu"] = chosen
        lines.append(f"- mu with the best Rel. on the local grid: **{chosen:g}** (the paper: 0.42 for CLIP encoders)")
    return "\n".join(lines) + "\n"


def choose_mu(frame: pd.DataFrame | None, median: float) -> float | None:
    """The PromPrune trial's mu with the highest Rel.; ties go to the mu closest to `median` (then the smaller)."""
    if frame is None:
        return None
    rows = frame[(frame["method"] == "promprune") & frame["mu"].notna() & frame["rel"].notna()]
    if rows["mu"].nunique() < 2:
        return None
    best = rows[rows["rel"] == rows["rel"].max()]["mu"].astype(float).sort_values().to_numpy()
    if np.isnan(median):
        return float(best[0])
    return float(best[np.abs(best - median).argmin()])  # argmin: the first, i.e. smaller, mu on a tie


def _figures_section(sweep, table, preds, entropy_id, full_tokens, out_dir, report, image_source) -> str:
    made = []
    t_sal = sweep.metrics.get("t_sal/mean", pd.Series(np.nan, index=sweep.metrics.index))
    options = sweep.trials[sweep.option_names]
    made.append(figures.tradeoff_curves(table, out_dir / "tradeoff.png"))
    if "saliency_ratio" in options:
        made.append(figures.saliency_ratio_curves(table, options["saliency_ratio"].astype(float), t_sal,
                                                  out_dir / "saliency_ratio.png"))
    made.append(figures.mu_tau_heatmap(table, options, out_dir / "mu_tau_heatmap.png"))
    made.append(figures.ablation_bars(table, out_dir / "ablation_bars.png"))
    notes = []
    if entropy_id is not None:
        row = table.frame.loc[entropy_id]
        ok = _ok(preds.get(entropy_id))
        mu = sweep.trials.loc[entropy_id].get("mu") if "mu" in sweep.option_names else None
        mu = None if mu is None or (isinstance(mu, float) and np.isnan(mu)) else float(mu)
        made.append(figures.entropy_histograms(ok, out_dir / "entropy_histograms.png", mu,
                                               f"{row['label']}, {row['budget']:.0f} tokens"))
        model = sweep.trials.loc[entropy_id].get("model") if "model" in sweep.trials else None
        overlays, note = _overlays(ok, full_tokens, out_dir, image_source, row["label"], overlay.fit_for(model))
        made += overlays
        notes += note
    made = [p for p in made if p is not None]
    report.files += made
    where = ["PNG files beside this report; `report.html` shows them inline (MLflow's viewer of `report.md` shows "
             "only their names).", ""] if made else []
    lines = ["## Figures", ""] + where + [f"![{p.stem}]({p.name})\n" for p in made] + (notes if notes else [])
    return "\n".join(lines) + "\n"


def _overlays(ok: pd.DataFrame, full_tokens, out_dir, image_source, label, fit) -> tuple[list, list]:
    if full_tokens is None or overlay.grid_side(full_tokens) is None:
        return [], [f"Overlays skipped: the full visual token grid ({full_tokens}) is not one square view."]
    made, notes = [], []
    for sample, (image, note) in _overlay_samples(ok, image_source)[:MAX_OVERLAYS]:
        salient, coverage = overlay.token_roles(sample)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{sample['task']}_{sample['doc_id']}")
        path = overlay.draw_overlay(image, int(full_tokens), salient, coverage, out_dir / f"overlay_{safe}.png",
                                    f"{label}: {sample['task']} doc {sample['doc_id']}{note}", fit)
        if path is not None:
            made.append(path)
        if coverage is None and not notes:
            notes.append("Overlays: the predictions do not record which kept tokens the saliency stage chose "
                         "(a `salient` column), so kept tokens are drawn in one colour.")
    return made, notes


def _side_by_side_section(sweep, table, preds, full_tokens, out_dir, report, image_source) -> str:
    """Fig. E1: saliency-only, coverage-only, fixed split and PromPrune on the same documents at one budget."""
    def has_tokens(rid):
        frame = _ok(preds.get(rid))
        return "kept" in frame and bool(frame["kept"].map(lambda k: k is not None and len(k) > 0).any())

    picked = side_by_side.comparison_trials(table.frame, has_tokens)
    if picked is None:
        return ""
    budget, trials = picked
    head = f"## Token selections side by side (Fig. E1), {budget:.0f} tokens\n\n"
    if full_tokens is None or overlay.grid_side(full_tokens) is None:
        return head + f"Skipped: the full visual token grid ({full_tokens}) is not one square view.\n"
    docs = side_by_side.panels_by_document({m: _ok(preds.get(rid)) for m, rid in trials.items()},
                                           {m: table.frame.loc[rid, "label"] for m, rid in trials.items()})
    rows = side_by_side.pick_rows(docs, image_source)
    model = sweep.trials.loc[next(iter(trials.values()))].get("model") if "model" in sweep.trials else None
    path = side_by_side.draw(rows, docs, int(full_tokens), out_dir / side_by_side.FILENAME, overlay.fit_for(model))
    if path is None:
        return head + "Skipped: no document has kept tokens recorded by every compared trial.\n"
    report.files.append(path)
    why = ("the documents where PromPrune's split differs most from the others'" if "promprune" in trials
           else "the documents where the methods' kept tokens differ most")
    return (head + f"The same images under {', '.join(table.frame.loc[r, 'label'] for r in trials.values())}: red = "
            "saliency stage, cyan = coverage stage, dimmed = dropped; titles give each method's T_sal/T on the image "
            f"and the image's prominence entropy H. Rows: {why}, one per benchmark first.\n\n"
            f"![figE1_overlays]({path.name})\n")


OVERLAY_TRIES = 6  # candidates per task looked at for an image no earlier overlay shows


def _overlay_samples(ok: pd.DataFrame, image_source) -> list[tuple[pd.Series, tuple]]:
    """One (sample, (image, note)) per task: one that shows both stages when any does (0 < T_sal < kept), and an
    image no other task's overlay already shows (tasks built from one dataset share images)."""
    import hashlib

    has_kept = ok["kept"].map(lambda k: k is not None and len(k) > 0)
    both = ok["saliency_count"].between(1, ok["visual_tokens"] - 1, inclusive="both")
    chosen, seen = [], set()
    for _, rows in ok[has_kept].groupby("task", sort=False):
        ranked = pd.concat([rows[both.loc[rows.index]], rows[~both.loc[rows.index]]])
        first = None
        for _, sample in ranked.head(OVERLAY_TRIES).iterrows():
            loaded = image_source(sample["task"], str(sample["doc_id"]))
            digest = hashlib.sha1(np.ascontiguousarray(loaded[0]).tobytes()).hexdigest()
            first = first or (sample, loaded, digest)
            if digest not in seen:
                first = (sample, loaded, digest)
                break
        seen.add(first[2])
        chosen.append(first[:2])
    return chosen


# ---------------------------------------------------------------------------------------------------------------
# helpers


class _PredictionCache:
    """predictions.parquet per trial run, downloaded once."""

    def __init__(self):
        self._frames: dict[str, pd.DataFrame | None] = {}

    def get(self, run_id: str) -> pd.DataFrame | None:
        if run_id not in self._frames:
            self._frames[run_id] = load_predictions(run_id)
        return self._frames[run_id]


MAX_PROMINENCE_ARMS = 6


def _prominence_section(sweep, table, preds, out_dir, report, truth_source) -> str:
    """Entropy vs the testbed's ground truth, per PromPrune trial (one per metric when several were run)."""
    arms, seen = {}, set()
    options = sweep.trials[sweep.option_names] if sweep.option_names else pd.DataFrame(index=sweep.trials.index)
    for rid, row in table.frame[table.frame["method"] == "promprune"].iterrows():
        metric = options.loc[rid].get("metric") if "metric" in options else None
        metric = ground_truth.DEFAULT_METRIC if metric is None or (isinstance(metric, float) and np.isnan(metric)) \
            else str(metric)
        if metric in seen or len(arms) >= MAX_PROMINENCE_ARMS:
            continue  # one arm per metric: the first in paper order
        frame = ground_truth.joined(_ok(preds.get(rid)), truth_source)
        if not frame.empty:
            seen.add(metric)
            arms[f"{metric} entropy ({row['label']}, {row['budget']:.0f} tokens)"] = frame
    if not arms:
        return ""
    corr = ground_truth.correlation_table(arms)
    _write_csv(corr, out_dir / "prominence.csv", report)
    path = ground_truth.figure(arms, out_dir / "prominence.png")
    if path is not None:
        report.files.append(path)
    rows = [[r["arm"], f"{r['samples']:.0f}", f"{r['rho_entropy_num_objects']:+.2f}", f"{r['rho_entropy_spread']:+.2f}",
             f"{r['rho_t_sal_share_num_objects']:+.2f}"] for _, r in corr.iterrows()]
    text = tables.markdown_table(["Metric (trial)", "Samples", "ρ(entropy, objects)", "ρ(entropy, spread)",
                                  "ρ(T_sal/T, objects)"], rows)
    figure = "\n![prominence](prominence.png)\n" if path is not None else ""
    return ("## Prominence against ground truth\n\nSpearman correlations over the testbed's documents, whose scenes "
            "know their number of objects and their spread (the offline counterpart of the paper's Fig. 2). A "
            "metric that tracks how spread out the meaning is correlates positively with both; PromPrune's split "
            "then gives spread-out scenes fewer saliency tokens (negative ρ for T_sal/T).\n\n" + text + figure)


def _ok(frame: pd.DataFrame | None) -> pd.DataFrame:
    """Successful samples only (failed ones carry an error and no answer)."""
    if frame is None:
        return pd.DataFrame(columns=["task", "doc_id", "entropy", "saliency_count", "visual_tokens", "kept"])
    if "error" not in frame:
        return frame
    return frame[frame["error"].isna() | (frame["error"].astype(str) == "")]


def _entropy_trial(table: tables.ScoreTable, preds: _PredictionCache) -> str | None:
    """The first PromPrune trial (paper order) whose predictions carry per-sample entropies."""
    candidates = table.frame.index[table.frame["method"] == "promprune"][:MAX_ENTROPY_CANDIDATES]
    for rid in candidates:
        frame = _ok(preds.get(rid))
        if "entropy" in frame and frame["entropy"].notna().any():
            return rid
    return None


def _full_tokens(sweep: Sweep, preds: _PredictionCache) -> float | None:
    """Visual tokens of the unpruned model (its `efficiency/visual_tokens`, else its predictions' maximum)."""
    bid = sweep.baseline_id
    if bid is None:
        return None
    value = sweep.metrics.loc[bid].get("efficiency/visual_tokens", np.nan)
    if not np.isnan(value):
        return float(value)
    frame = _ok(preds.get(bid))
    if "visual_tokens" in frame and frame["visual_tokens"].notna().any():
        return float(frame["visual_tokens"].max())
    return None


def _mean_t_sal_per_task(sweep, table, preds, run_id) -> tuple[dict, str]:
    frame = _ok(preds.get(run_id))
    if "saliency_count" in frame and frame["saliency_count"].notna().any():
        return frame.groupby("task")["saliency_count"].mean().to_dict(), "the adaptive trial's per-sample predictions"
    overall = sweep.metrics.loc[run_id].get("t_sal/mean", np.nan)
    return {c.task: overall for c in table.columns}, "the adaptive trial's `t_sal/mean` (all benchmarks pooled)"


def _write_csv(frame: pd.DataFrame, path: Path, report: Report) -> None:
    frame.to_csv(path, index=False)
    report.files.append(path)


def task_image(task: str, doc_id: str) -> tuple[np.ndarray, str]:
    """The task's own image for doc `doc_id` via `promprune.eval` (offline tasks load locally), else a labelled
    stand-in when the task's data cannot be had here (a hub task offline, a doc the task does not have)."""
    from PIL import Image

    from promprune.eval.requests import build_requests
    from promprune.eval.tasks import OFFLINE_TASKS, TaskUnavailableError

    if os.environ.get("HF_HUB_OFFLINE") == "1" and task not in OFFLINE_TASKS:
        return overlay.stand_in_image(), f" (stand-in image: {task} is a hub task and HF_HUB_OFFLINE=1)"
    try:
        rows = build_requests([task], limit=int(doc_id) + 1)
    except (TaskUnavailableError, ValueError) as exc:  # data not here, an unknown task or doc id
        return overlay.stand_in_image(), f" (stand-in image: task image unavailable, {type(exc).__name__})"
    row = next((r for r in rows if r.doc_id == int(doc_id) and r.image is not None), None)
    if row is None:
        return overlay.stand_in_image(), f" (stand-in image: {task} doc {doc_id} has no readable image)"
    return np.asarray(Image.open(io.BytesIO(row.image)).convert("RGB")), ""
