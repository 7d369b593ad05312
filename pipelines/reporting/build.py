"""Assemble a sweep's report: tables (markdown + CSV), figures (PNG), `report.md`; log them to the parent run.

`build_report(sweep, out_dir)` decides what applies from the trials themselves (several budgets: trade-off
curves; a fixed-ratio grid: the saliency-ratio figure and Table 4's matched split, and beside any other trial at its
budget the split headroom (`headroom_section`); a mu x tau grid: the heatmap;
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

from pipelines import calibration, mlflow_layout
from pipelines.mlflow_layout import MU_TAU

from . import figures, ground_truth, headroom_figure, headroom_section, overlay, paired, side_by_side, tables
from .published import PAPER_DIR, load_published, published_name
from .store import BASELINE_METHOD, Sweep, load_predictions, parse_task_list

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
    calibration: dict = field(default_factory=dict)  # metrics for the parent run: calibration/chosen_mu


def build_report(sweep: Sweep, out_dir: Path, *, published_root: Path = PAPER_DIR,
                 image_source: ImageSource | None = None,
                 truth_source: ground_truth.TruthSource | None = None, grid: Sweep | None = None) -> Report:
    """Write every table and figure that applies to `sweep` under `out_dir`; return what was written. ``grid``: a
    grid sweep over the same (mu, tau) to draw beside a search and compare it with."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir)
    preds = _PredictionCache()
    runs = sweep
    # one row per configuration: a grid's repeats (tune.num_samples > 1) as the mean of their runs
    searched = sweep.mean_over_repeats()
    grid = None if grid is None else grid.mean_over_repeats()
    sweep = searched.ran_to_end()  # tables and figures of finished trials never see a stopped one
    table = tables.build_score_table(sweep)
    full_tokens = _full_tokens(sweep, preds)
    sections = [_header(runs, table)]
    published = load_published(sweep.name, published_root)
    comparison = None if published is None else tables.compare_published(
        sweep, table, published, lambda rid: _t_sal_by_task(preds, rid))
    sections.append(_scores_section(table, full_tokens, comparison, out_dir, report))
    sections.append(_paired_section(sweep, table, preds))
    sections.append(_search_section(searched, table, preds, out_dir, report, grid))
    sections.append(_efficiency_section(sweep, table, out_dir, report))
    sections.append(_published_section(sweep, table, published, comparison, out_dir, report,
                                       published_name(sweep.name, published_root)))
    sections.append(_matched_split_section(sweep, table, preds, out_dir, report))
    sections.append(_headroom_section(sweep, table, preds, out_dir, report, truth_source or ground_truth.testbed_truth))
    entropy_id = _entropy_trial(table, preds)
    sections.append(_calibration_section(sweep, table, report))
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
    """Log the files the report wrote (``report.files``, in their folders under ``out_dir``) as artifacts of the
    sweep's parent run (and calibration results); return their URI. Only those: the whole folder took in what else
    lay there (another run's figures in the shared ``reports/<sweep>/``; with ``--out .`` the MLflow store itself,
    copied into its own artifacts until the path was too long)."""
    client = client or MlflowClient()
    root = Path(report.out_dir).resolve()
    for path in dict.fromkeys(Path(p).resolve() for p in report.files):
        folder = path.parent.relative_to(root).as_posix()
        client.log_artifact(sweep.run_id, str(path), ARTIFACT_DIR if folder == "." else f"{ARTIFACT_DIR}/{folder}")
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
    unfinished = sweep.unfinished()
    lines = [f"# Report: {sweep.name}", "", *([f"**Unfinished.** {unfinished}", ""] if unfinished else []),
             f"- parent run: `{sweep.run_id}`, spec version {sweep.tags.get(mlflow_layout.VERSION, '?')}",
             f"- model: `{model}`; trials: {len(sweep.trials)}; benchmarks: "
             + ", ".join(f"{c.label} (`{c.task}`: {'+'.join(c.metrics) or 'no metric logged'})" for c in table.columns),
             f"- failed samples over all trials: {failed:.0f}"]
    stopped = sweep.stopped
    unfinished = sweep.trials[(sweep.trials["status"] != "FINISHED") & ~stopped]
    if len(unfinished):
        lines.append(f"- trials not FINISHED (their numbers may be missing): {', '.join(unfinished['trial'])}")
    if stopped.any():
        lines.append(f"- trials stopped early by the search's scheduler (ASHA): {int(stopped.sum())}; they are in no "
                     "table, and drawn with their running Rel. in the search figure")
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
    if any(col.endswith(tables.RUNS) for col in table.frame.columns):
        note += (" ± sd, n: a configuration the sweep ran n times (`tune.num_samples`; n counts the runs that "
                 "finished with that score): the row is the mean of its finished runs, ± their standard deviation; "
                 "its Rel. is the mean scores over the unpruned row's (itself the mean of its finished runs), ± the "
                 "sd of each run's Rel.")
    if comparison is not None and not comparison.empty:
        note += " Rows marked ↳ paper: the published numbers, with our delta."
    return f"## Scores\n\n{note}\n\n{tables.score_table_markdown(table, full_tokens, comparison)}"


def _resamples(sweep: Sweep) -> int:
    """The resamples of the report's bootstrap intervals: the spec's `bootstrap` (as the console's and the parent
    run's `best/*` intervals), else `paired.ITERS`."""
    return sweep.bootstrap or paired.ITERS


def _paired_section(sweep, table, preds) -> str:
    """Each method's Rel. difference to the best other method at its budget, with a paired bootstrap interval."""
    bid = sweep.baseline_id
    if bid is None:
        return ""
    frame = table.frame[["method", "budget", "label"]].assign(rel=table.frame["rel"] / 100)  # label: the trial's
    frame["trial"] = sweep.trials["trial"].reindex(frame.index)  # its id: ties go to the least, as on the console
    frame = frame[table.frame[tables.REL_OF].isna()]  # a trial on a subset of the tasks pairs with no other
    diffs = paired.differences(frame, bid, lambda rid: paired.rows_from(preds.get(rid)), iters=_resamples(sweep))
    if not diffs:
        return ""
    return ("## Paired differences\n\nEach method's best trial against the best other method at its budget, in "
            "points of Rel., with a 95% paired bootstrap interval: the documents of every benchmark resampled "
            f"{_resamples(sweep)} times, both trials and the unpruned baseline scored on the same resample (an "
            "interval that holds 0 is a gap the benchmarks cannot tell from noise)."
            + (" A configuration run several times is paired by the answers of its first finished run."
               if sweep.repeat_metrics else "") + "\n\n" + paired.markdown(diffs))




def _plane_points(sweep: Sweep, table: tables.ScoreTable | None = None) -> pd.DataFrame:
    """The trials that set mu or tau: their (mu, tau), Rel. in % (a stopped trial's running Rel.), stopped."""
    if not any(o in sweep.option_names for o in MU_TAU):
        # typed: an object "stopped" of no trial, as a mask, was read as a list of column names (a --grid of no
        # (mu, tau) trial raised KeyError)
        return pd.DataFrame({"mu": [], "tau": [], "value": [], "stopped": []}).astype(
            {"mu": float, "tau": float, "value": float, "stopped": bool})
    trials = sweep.trials
    opts = pd.DataFrame({o: pd.to_numeric(trials[o], errors="coerce") if o in trials else np.nan for o in MU_TAU},
                        index=trials.index)
    stopped = sweep.stopped.reindex(opts.index).fillna(False).astype(bool)
    frame = opts[opts.notna().any(axis=1)].assign(stopped=stopped)
    running = sweep.metrics.get(f"{mlflow_layout.RUNNING}/{mlflow_layout.REL}",
                                pd.Series(np.nan, index=trials.index))
    final = table.frame["rel"] if table is not None else mlflow_layout.rel_percent(
        sweep.metrics.get(mlflow_layout.REL, pd.Series(np.nan, index=trials.index)))
    frame["value"] = [mlflow_layout.rel_percent(running.get(i, np.nan)) if frame.loc[i, "stopped"]
                      else final.get(i, np.nan) for i in frame.index]
    return frame


def _grid_pivot(points: pd.DataFrame) -> pd.DataFrame | None:
    """Rel. (%) as a mu x tau grid, when the finished trials form one (`figures.is_grid`: two mu and two tau values
    with all four cells finished)."""
    done = points[~points["stopped"]].dropna(subset=["mu", "tau", "value"])
    pivot = done.pivot_table(index="mu", columns="tau", values="value", aggfunc="mean")
    return pivot if figures.is_grid(pivot) else None


def _generated(sweep: Sweep) -> float:
    """Samples the sweep's trials generated (the parent's `samples/generated`; older sweeps: their trials' own)."""
    if mlflow_layout.GENERATED in sweep.parent_metrics:
        return sweep.parent_metrics[mlflow_layout.GENERATED]
    done = sweep.metrics.get("samples/total", pd.Series(0.0, index=sweep.trials.index)).where(~sweep.stopped, 0)
    return float(done.fillna(0).sum() + sweep.metrics.get("samples/done", pd.Series(0.0)).where(
        sweep.stopped, 0).fillna(0).sum())


def _best_with_interval(sweep: Sweep, points: pd.DataFrame, preds) -> tuple[str | None, tuple | None]:
    """The finished trial of the best Rel. and its (Rel., low, high) in %, paired with the sweep's baseline."""
    done = points[~points["stopped"]].dropna(subset=["value"])
    if done.empty:
        return None, None
    ids = sweep.trials["trial"].reindex(done.index).fillna("")
    best = done.assign(_id=ids).sort_values(["value", "_id"], ascending=[False, True], kind="stable").index[0]
    if sweep.baseline_id is None:  # (a tie goes to the first trial id, as on the console)
        return best, None
    try:
        boot = paired.bootstrap([best], sweep.baseline_id, lambda rid: paired.rows_from(preds.get(rid)),
                                iters=_resamples(sweep))
    except ValueError:  # the best trial ran on other documents than the baseline (a subset of the tasks), or a
        # baseline score of 0 makes Rel. undefined
        return best, None
    return best, None if boot is None else tuple(100 * x for x in boot.rel(best))


def _where(points: pd.DataFrame, rid: str) -> str:
    """``mu=0.2, tau=0.03`` of a trial (the options it sets)."""
    return ", ".join(f"{o}={tables.fmt_value(points.loc[rid, o])}" for o in MU_TAU
                     if points.loc[rid, o] == points.loc[rid, o])


def _search_key(sweep: Sweep, rid: str) -> mlflow_layout.SearchKey:
    """A trial's `mlflow_layout.search_key` (what its Rel. depends on besides mu and tau, an unset option read as its
    method's default), from its logged params."""
    row = sweep.trials.loc[rid]
    tasks = row.get("tasks") if "tasks" in sweep.trials else None
    return mlflow_layout.search_key(row["method"], row["budget"],
                                    parse_task_list(tasks) if isinstance(tasks, str) else None,
                                    {name: row.get(name) for name in sweep.option_names})


def _describe_key(key: mlflow_layout.SearchKey) -> str:
    """``PromPrune, 64 tokens, metric=attention`` from a `_search_key`."""
    parts = [tables.METHOD_LABELS.get(key.method, key.method)] + ([f"{key.budget} tokens"] if key.budget else [])
    return ", ".join(parts + [f"{name}={value}" for name, value in key.options])


def _searches(points: pd.DataFrame, keys: dict, scored: bool = True) -> list[tuple[mlflow_layout.SearchKey,
                                                                                  pd.DataFrame]]:
    """The (mu, tau) searches among ``points`` (`mlflow_layout.mu_tau_searches`; ``keys``: each point's
    `_search_key`): the points of trials alike in all else, where they score (``scored``; else: set) two or more
    distinct (mu, tau); in the trials' order."""
    counted = points.dropna(subset=["value"]) if scored else points
    options = {rid: points.loc[rid, list(MU_TAU)].to_dict() for rid in counted.index}
    return [(key, points.loc[rids]) for key, rids in mlflow_layout.mu_tau_searches(keys, options)]


def _search_section(sweep, table, preds, out_dir, report, grid: Sweep | None) -> str:
    """A sweep whose trials vary mu or tau, among trials alike in everything else (`_search_key`: the same method,
    budget, tasks and other options): per such search, the trials in the (mu, tau) plane (stopped ones hollow and
    grey, off the colour scale; the best starred), a heatmap beside it where the grid sweep or the finished trials
    form a grid, the best (mu, tau) with its interval and the samples generated; with a grid sweep to compare with,
    whether the best lies in the grid best's interval and the share of its samples. Trials that set mu or tau with
    different other options (Fig. 4's per-metric calibrated mu) are no search: their mu values are on different
    metrics' scales."""
    points = _plane_points(sweep, table)
    keys = {rid: _search_key(sweep, rid) for rid in points.index}
    searches = _searches(points, keys)
    if not searches and sweep.baseline_id is None and _searches(points, keys, scored=False):
        return ("## The (mu, tau) plane\n\nNot drawn: the sweep has no unpruned trial (`baseline: false`), so no "
                "Rel. to place its (mu, tau) points by; their scores are in the table above.\n")
    if not searches:
        if grid is None:
            return ""
        scored = len(points.dropna(subset=["value"]).groupby(list(MU_TAU), dropna=False))
        why = (f"{scored} scored (mu, tau) point(s)" if scored < 2 else
               f"its {scored} scored (mu, tau) points differ in more than mu and tau")
        return (f"Note: --grid `{grid.name}` was not drawn: sweep `{sweep.name}` is not a (mu, tau) search ({why}; "
                "the grid is drawn beside a search of two or more).\n")
    grid_planes = None if grid is None else _GridPlanes.of_grid(grid)  # once, whatever the number of searches
    parts = []
    for k, (key, group) in enumerate(searches):
        title = "## The (mu, tau) plane" + (f": {_describe_key(key)}" if len(searches) > 1 else "")
        name = "mu_tau_search" if len(searches) == 1 else f"mu_tau_search_{k + 1}"
        left_out = len(points) - len(group)
        scope = (f"- among {_describe_key(key)}: {left_out} other trial(s) that set mu or tau with other options "
                 "are not in this plane (their mu is not on its scale)") if left_out else None
        parts.append(_one_search(sweep, group, key, title, name, scope, preds, out_dir, report, grid_planes))
    return "\n".join(parts)


@dataclass
class _GridPlanes:
    """A grid sweep's (mu, tau) points per search key, computed once for all of a sweep's searches (its score table,
    each trial's `_search_key`): ``of(key)`` is the points of the grid's finished trials with that key, in its
    trials' order."""

    sweep: Sweep  # the grid sweep, as given (its samples generated: `_generated`)
    ran: Sweep  # its trials that ran to their end
    points: pd.DataFrame  # `_plane_points` of ``ran``
    at: dict  # SearchKey -> positions in ``points``

    @classmethod
    def of_grid(cls, grid: Sweep) -> "_GridPlanes":
        ran = grid.ran_to_end()
        points = _plane_points(ran, tables.build_score_table(ran))
        at: dict = {}
        for i, rid in enumerate(points.index):
            at.setdefault(_search_key(ran, rid), []).append(i)
        return cls(grid, ran, points, at)

    def of(self, key: mlflow_layout.SearchKey) -> pd.DataFrame:
        return self.points.iloc[self.at.get(key, [])]


def _one_search(sweep, points, key, title, name, scope, preds, out_dir, report, planes: _GridPlanes | None) -> str:
    best, interval = _best_with_interval(sweep, points, preds)
    grid = None if planes is None else planes.sweep
    grid_points = None if planes is None else planes.of(key)
    pivot = _grid_pivot(grid_points if grid_points is not None else points)
    path = figures.search_plane(points, best, pivot, out_dir / f"{name}.png",
                                f"grid `{grid.name}`" if grid else "this sweep's grid")
    generated = _generated(sweep)
    lines = [title, ""] + ([scope] if scope else [])
    n_stopped = int(points["stopped"].sum())
    lines.append(f"- trials: {len(points)}" + (f", {n_stopped} stopped early by ASHA (hollow grey circles, off the "
                                                "colour scale: their running Rel. at the rung that stopped them is "
                                                "over the sweep's first samples only, comparable with each other, not "
                                                "with a finished trial's Rel. over all)" if n_stopped else ""))
    if pivot is not None and path is not None:
        lines.append(f"- beside it, {'the grid' if grid else 'the finished trials as a grid'}: Rel. per (mu, tau), on "
                     "the finished trials' colour scale")
    if best is not None:
        text = f"- best (mu, tau): **{_where(points, best)}**, Rel. {points.loc[best, 'value']:.1f}%"
        if interval is not None:
            text += (f" [{interval[1]:.1f}, {interval[2]:.1f}] (95% bootstrap over the documents, {_resamples(sweep)} "
                     "resamples, paired with the baseline)")
        lines.append(text + f" (`{sweep.trials.loc[best, 'trial']}`)")
    lines.append(f"- samples generated: {generated:.0f}")
    if grid is not None:
        lines += _against_grid(planes, grid_points, points, best, generated, preds)
    if path is not None:
        report.files.append(path)
        lines += ["", f"![{name}]({path.name})"]
    return "\n".join(lines) + "\n"


def _against_grid(planes: _GridPlanes, grid_points: pd.DataFrame, points: pd.DataFrame, best: str | None,
                  generated: float, preds) -> list[str]:
    """The search against a full grid: the grid's best with its interval, whether the search's best lies in it,
    how many grid points do, and the samples each generated."""
    grid = planes.sweep
    gbest, ginterval = _best_with_interval(planes.ran, grid_points, preds)
    if gbest is None:
        return [f"- grid `{grid.name}`: no finished trial with Rel."]
    gen = _generated(grid)
    lines = [f"- grid `{grid.name}`: best **{_where(grid_points, gbest)}**, Rel. {grid_points.loc[gbest, 'value']:.1f}%"
             + (f" [{ginterval[1]:.1f}, {ginterval[2]:.1f}]" if ginterval else "") + f"; {gen:.0f} samples generated"]
    if best is not None and ginterval is not None:
        value = points.loc[best, "value"]
        inside = ginterval[1] <= value <= ginterval[2]
        n_in = int(grid_points["value"].between(ginterval[1], ginterval[2]).sum())
        lines.append(f"- the search's best Rel. {value:.1f}% lies **{'inside' if inside else 'outside'}** the grid "
                     f"best's interval ({n_in} of {len(grid_points)} grid points do), with {generated:.0f} samples: "
                     f"{100 * generated / gen:.0f}% of the grid's {gen:.0f}")
    return lines


def _efficiency_section(sweep, table, out_dir, report) -> str:
    eff = tables.efficiency_table(sweep, table)
    if eff is None:
        return ""
    # Rel. in percent, headed as scores.csv heads it (the metric `rel` is a fraction)
    _write_csv(eff.rename(columns={"rel": "Rel. (%)"}).reset_index(names="run_id"), out_dir / "efficiency.csv", report)
    return f"## Efficiency\n\n{tables.efficiency_markdown(eff, sweep.baseline_id)}"


def _published_section(sweep, table, published, comp, out_dir, report, name: str | None) -> str:
    """``name``: the CSV the published numbers came from (`published.published_name`)."""
    if published is None:
        return (f"## Against the published numbers\n\nNo published numbers are shipped for `{sweep.name}` "
                f"(see `pipelines/paper_results/README.md`).\n")
    if comp.empty:
        return (f"## Against the published numbers\n\n`{name}.csv` ships the paper's table structure, but "
                "none of its numbers could be found (see `pipelines/paper_results/README.md`).\n")
    _write_csv(comp, out_dir / "published_comparison.csv", report)
    wider = "" if name == sweep.name else (
        f"`{sweep.name}` widens the paper's `{name}`: the paper's rows (`pipelines/paper_results/{name}.csv`) "
        "against our trials of the same method and budget; the trials the paper does not have are not compared.\n\n")
    return f"## Against the published numbers\n\n{wider}{tables.comparison_markdown(comp, table)}"


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


def _headroom_section(sweep, table, preds, out_dir, report, truth_source) -> str:
    """Split headroom: best fixed ratio, per-sample oracle, cross-validated entropy rule and each other trial, per task
    and budget, when a fixed-ratio grid ran beside another pruned trial (`headroom_section`)."""
    if not headroom_section.budgets_with_grid(sweep, table):
        return ""
    items = _ItemsCache(preds)
    panels, notes = headroom_section.build_panels(sweep, table, preds.get, items.get, truth_source)
    iters = _resamples(sweep)  # the spec's `bootstrap`, as every other interval of the report
    analyses = [headroom_section.analyse(p, iters=iters) for p in panels]
    if not analyses:
        return "## Split headroom\n\n" + "".join(f"- {n}\n" for n in notes or ["no task had per-sample scores"])
    _write_csv(headroom_section.csv_frame(analyses), out_dir / "split_headroom.csv", report)
    figures_md = []
    for budget in dict.fromkeys(p.budget for p in panels):
        path = headroom_figure.figure([p for p in panels if p.budget == budget],
                                      out_dir / f"split_headroom_b{budget:.0f}.png")
        if path is not None:
            report.files.append(path)
            figures_md.append(f"![split headroom, {budget:.0f} tokens]({path.name})\n")
    return (headroom_section.markdown(analyses, notes, iters=iters) + "\n" + headroom_figure.NOTE + "\n\n"
            + "\n".join(figures_md))


def _calibration_section(sweep, table, report) -> str:
    """mu calibration: the median of each prominence metric over the calibration images (the parent run's
    ``calibration/median_<metric>``, the mu its ``mu: calibrate`` trials used), and (with a mu grid) the mu of the
    best Rel., ties going to the mu closest to the spectral median."""
    if CALIBRATION_MARK not in sweep.name:
        return ""
    medians, images, where = calibration_medians(sweep)
    lines = ["## mu calibration", ""]
    for metric, median in medians.items():
        lines.append(f"- median {metric.replace('_', '-')} entropy over the calibration images"
                     f"{'' if images is None else f' ({images:.0f})'}: **{median:.4f}** "
                     f"(`{calibration.MEDIAN_PREFIX}{metric}`, {where})")
    if not medians:
        lines.append("- no calibration median: neither this sweep (no `mu: calibrate` trial) nor an earlier sweep on "
                     "its model measured one (run `sweeps/mu_calibration.yaml`)")
    median = medians.get(calibration.DEFAULT_METRIC, np.nan)
    chosen = choose_mu(table.frame.join(sweep.trials[["mu"]]) if "mu" in sweep.option_names else None, median)
    if chosen is not None:
        report.calibration["calibration/chosen_mu"] = chosen
        lines.append(f"- mu with the best Rel. on the local grid: **{chosen:g}** (the paper: 0.42 for CLIP encoders; "
                     + ("ties: the mu closest to the spectral median)" if medians else "ties: the smaller mu)"))
    return "\n".join(lines) + "\n"


# what reports before 2026-12-08 logged on the parent run: the median entropy of a PromPrune trial's benchmark
# documents, not of the calibration images; never read
REPORTED_MEDIAN = "calibration/median_entropy"


def calibration_medians(sweep: Sweep) -> tuple[dict[str, float], float | None, str]:
    """(``{metric: median}`` over the calibration images, how many images, where they come from): the sweep's own
    parent run when a ``mu: calibrate`` trial measured them; else (a grid given its mu, as ``mu_calibration_grid``)
    the latest other sweep of its experiment on the same model and adapter options (parent param ``model_options``;
    a sweep that did not record them is taken, saying so) that measured them (``mu_calibration``); ``({}, None, "")``
    when none did."""
    def medians_of(metrics: dict) -> dict[str, float]:
        return {k[len(calibration.MEDIAN_PREFIX):]: float(v) for k, v in sorted(metrics.items())
                if k.startswith(calibration.MEDIAN_PREFIX) and k != REPORTED_MEDIAN and not pd.isna(v)}

    own = medians_of(sweep.parent_metrics)
    if own:
        return own, sweep.parent_metrics.get(calibration.IMAGES_METRIC), "measured by this sweep's `mu: calibrate`"
    models = sweep.trials["model"].dropna().unique() if "model" in sweep.trials else []
    if len(models) != 1:
        return {}, None, ""
    import mlflow

    # the sweep's own experiment: a sweep of another (another MLFLOW_EXPERIMENT_NAME) is not this one's history
    experiments = [sweep.experiment_id] if sweep.experiment_id is not None else None
    runs = mlflow.search_runs(experiment_ids=experiments, search_all_experiments=experiments is None,
                              order_by=["attributes.start_time DESC"],
                              filter_string=mlflow_layout.tag_filter(mlflow_layout.ROLE, mlflow_layout.ROLE_SWEEP)
                              + f" and params.model = '{models[0]}'", output_format="pandas")
    key = f"metrics.{calibration.MEDIAN_PREFIX}{calibration.DEFAULT_METRIC}"
    if runs.empty or key not in runs:
        return {}, None, ""
    column = f"params.{mlflow_layout.MODEL_OPTIONS_PARAM}"
    mine = MlflowClient().get_run(sweep.run_id).data.params.get(mlflow_layout.MODEL_OPTIONS_PARAM)
    for _, run in runs[(runs["run_id"] != sweep.run_id) & runs[key].notna()].iterrows():
        theirs = run.get(column)
        theirs = theirs if isinstance(theirs, str) else None
        if mine is not None and theirs is not None and theirs != mine:
            continue  # calibrated with other adapter options (another image_tokens: another token grid)
        metrics = {c[len("metrics."):]: v for c, v in run.items() if c.startswith("metrics.")}
        name = run.get(mlflow_layout.tag_column(mlflow_layout.SWEEP)) or run["run_id"]
        images = metrics.get(calibration.IMAGES_METRIC)
        same = "on the same model and adapter options" if mine is not None and theirs is not None else \
            "on the same model (adapter options not recorded by one of the two sweeps: check they match)"
        return (medians_of(metrics), None if pd.isna(images) else images,
                f"measured by sweep {name}, run {run['run_id']}, {same}")
    return {}, None, ""


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
    made, notes = [], []
    options = sweep.trials[sweep.option_names]
    if figures.scored_rows(table).empty:  # every pruned trial failed or never finished: axes with nothing on them
        notes.append("Score figures skipped: no pruned trial has a score or a Rel. to draw (none ran, or their cells "
                     "above are dashes or NaN).")
    else:
        made.append(figures.tradeoff_curves(table, out_dir / "tradeoff.png"))
        if "saliency_ratio" in options:
            adaptive = table.frame.index[table.frame["method"] == "promprune"]
            t_sal_by_task = pd.DataFrame({rid: _mean_t_sal_per_task(sweep, table, preds, rid)[0]
                                          for rid in adaptive}).T
            made.append(figures.saliency_ratio_curves(table, options["saliency_ratio"].astype(float), t_sal_by_task,
                                                      out_dir / "saliency_ratio.png"))
        made.append(figures.mu_tau_heatmap(table, options, out_dir / "mu_tau_heatmap.png"))
        made.append(figures.ablation_bars(table, out_dir / "ablation_bars.png"))
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


class _ItemsCache:
    """Per trial, lmms-eval's per-document items of each task (`promprune.eval.scoring.sample_items`), computed once;
    None when the trial has no predictions or its tasks' data cannot be loaded here (a hub task offline)."""

    def __init__(self, preds: _PredictionCache):
        self._preds, self._items = preds, {}

    def get(self, run_id: str):
        if run_id not in self._items:
            from promprune.eval.scoring import sample_items
            from promprune.eval.tasks import TaskUnavailableError

            rows = paired.rows_from(self._preds.get(run_id))
            try:
                self._items[run_id] = sample_items(rows) if rows else None
            except TaskUnavailableError:
                self._items[run_id] = None
        return self._items[run_id]


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


def _t_sal_by_task(preds, run_id) -> dict:
    """``{task: mean T_sal}`` over the trial's answered samples (empty without per-sample saliency counts)."""
    frame = _ok(preds.get(run_id))
    if "saliency_count" in frame and frame["saliency_count"].notna().any():
        return frame.groupby("task")["saliency_count"].mean().to_dict()
    return {}


def _mean_t_sal_per_task(sweep, table, preds, run_id) -> tuple[dict, str]:
    by_task = _t_sal_by_task(preds, run_id)
    if by_task:
        return by_task, "the adaptive trial's per-sample predictions"
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
