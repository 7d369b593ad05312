"""Matplotlib figures (PNG) from the score table and the per-sample predictions.

Each function takes plain frames, writes one PNG and returns its path, or returns None when the sweep does not
have what the figure needs (e.g. a single budget for a trade-off curve).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; report machines have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from pipelines.mlflow_layout import MU_TAU  # noqa: E402

from .columns import AS_LOGGED  # noqa: E402
from .store import BASELINE_METHOD  # noqa: E402
from .tables import METHOD_LABELS, ScoreTable  # noqa: E402

DPI = 120  # readable in the MLflow UI's artifact viewer without multi-MB files
MAX_BARS = 12  # more variants than this in one panel are unreadable as bars
MAX_PANELS = 4  # budgets drawn side by side before a figure gets too wide
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")  # each line its own shape: ties stay visible
DODGE = 0.035  # tied lines are shifted sideways by this fraction of a budget doubling, so none hides another


def _pruned(table: ScoreTable) -> pd.DataFrame:
    return table.frame[table.frame["method"] != BASELINE_METHOD]


def scored_rows(table: ScoreTable) -> pd.DataFrame:
    """The pruned trials with a number to draw: a benchmark's score or Rel. (a trial that failed or never finished
    has neither: its cells in the table are dashes)."""
    pruned = _pruned(table)
    return pruned[pruned[[c.task for c in table.columns] + ["rel"]].notna().any(axis=1)]


def _baseline_row(table: ScoreTable) -> pd.Series | None:
    rows = table.frame[table.frame["method"] == BASELINE_METHOD]
    return rows.iloc[0] if len(rows) else None


def _relative(table: ScoreTable, rows: pd.DataFrame, task: str) -> tuple[pd.Series, str]:
    """A task's scores as % of the unpruned model's when it ran, else in the paper's unit."""
    base = _baseline_row(table)
    if base is not None and base[task] and not np.isnan(base[task]):
        return rows[task] / base[task] * 100.0, "% of unpruned"
    return table.display(task, 1.0) * rows[task], "score"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def cross_benchmark_mean(table: ScoreTable, rows: pd.DataFrame) -> tuple[pd.Series, str] | None:
    """Without Rel. (no unpruned trial): the mean over benchmarks of each row's scores in the paper's units (each
    column times its scale, as the tables show them) and its axis label, when every benchmark is in one unit; None
    when they mix units (MME's points beside percentages: their mean is no score of anything) or one is not known (a
    task of one's own shown as logged, a 0-10 rating say)."""
    units = {c.unit for c in table.columns}
    if len(units) != 1 or AS_LOGGED in units:  # (a task of one's own shown as logged: its unit is not known)
        return None
    scaled = pd.DataFrame({c.task: rows[c.task] * c.scale for c in table.columns}, index=rows.index)
    return scaled.mean(axis=1), f"mean score over {len(table.columns)} benchmarks ({units.pop()}; no unpruned trial)"


REL_TITLE = "Rel. (mean over benchmarks of score / unpruned score)"  # the paper's Rel., as the tables compute it


def tradeoff_curves(table: ScoreTable, path: Path) -> Path | None:
    """Rel. against the token budget, one line per method/variant (Tables 1-3 at a glance). Without an unpruned
    trial (no Rel.): the mean score over benchmarks in the paper's units where they share one, else one panel per
    benchmark in its own unit (a mean of MME's points and percentages would be MME's alone, halved)."""
    pruned = _pruned(table).dropna(subset=["budget"])
    if pruned["budget"].nunique() < 2:
        return None
    use_rel = pruned["rel"].notna().any()
    mean = None if use_rel else cross_benchmark_mean(table, pruned)
    if use_rel:
        panels = [(pruned["rel"], "Rel. (%)", REL_TITLE)]
    elif mean is not None:
        panels = [(mean[0], mean[1], "mean benchmark score")]
    else:
        panels = [(pruned[c.task] * c.scale, f"{c.label} ({c.unit})", f"{c.label}, no unpruned trial for Rel.")
                  for c in table.columns]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), squeeze=False)
    budgets = sorted(pruned["budget"].unique())
    for ax, (y_all, ylabel, what) in zip(axes[0], panels):
        groups = list(pruned.assign(_y=y_all).groupby(["method", "variant"], sort=False))
        for k, ((method, variant), rows) in enumerate(groups):
            rows = rows.sort_values("budget")
            name = METHOD_LABELS.get(method, method) + (f" ({variant})" if variant else "")
            style = {"lw": 2.4, "zorder": 3} if method == "promprune" else {"lw": 1.4}
            shift = 2 ** ((k - (len(groups) - 1) / 2) * DODGE)  # multiplicative: the x axis is log2
            ax.plot(rows["budget"] * shift, rows["_y"], marker=MARKERS[k % len(MARKERS)], ms=7, mfc="none",
                    label=name, **style)
        if use_rel:
            ax.axhline(100.0, color="grey", ls=":", lw=1, label="unpruned")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [f"{b:.0f}" for b in budgets])
        ax.set_xlabel("visual tokens kept")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{what} against the token budget", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, title="markers offset slightly so ties stay visible", title_fontsize=7)
    return _save(fig, path)


def saliency_ratio_curves(table: ScoreTable, ratios: pd.Series, t_sal_mean: pd.DataFrame, path: Path) -> Path | None:
    """Fig. 1a / A1: each benchmark's score against the fixed saliency ratio, one panel per budget.

    ratios: saliency_ratio per trial (NaN for trials without one); t_sal_mean: the mean T_sal of each adaptive trial
    (rows: run ids) on each benchmark (columns: tasks). The adaptive PromPrune trial at the same budget is a dashed
    line per benchmark, and a star at its mean T_sal / T on that benchmark on the x axis (each benchmark's own: it
    splits concentrated images toward saliency, spread-out ones toward coverage).
    """
    frame = _pruned(table).assign(_ratio=ratios.reindex(table.frame.index))
    fixed = frame[(frame["method"] == "fixed_ratio") & frame["_ratio"].notna()]
    if fixed["_ratio"].nunique() < 2:
        return None
    budgets = sorted(fixed["budget"].dropna().unique(), reverse=True)[:MAX_PANELS]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 4.0), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, budget in zip(axes[0], budgets):
        rows = fixed[fixed["budget"] == budget].sort_values("_ratio")
        adaptive = frame[(frame["method"] == "promprune") & (frame["budget"] == budget)]
        for i, col in enumerate(table.columns):
            color = colors[i % len(colors)]
            y, unit = _relative(table, rows, col.task)
            ax.plot(rows["_ratio"], y, marker="o", color=color, label=col.label)
            if len(adaptive):
                ya, _ = _relative(table, adaptive.iloc[:1], col.task)
                ax.axhline(float(ya.iloc[0]), color=color, ls="--", lw=1)
                rid = adaptive.index[0]
                x_star = (t_sal_mean.at[rid, col.task] if rid in t_sal_mean.index and col.task in t_sal_mean
                          else np.nan) / budget
                if not np.isnan(x_star):
                    ax.plot([x_star], [float(ya.iloc[0])], marker="*", ms=12, color=color)
        ax.set_xlabel("saliency ratio T_sal / T (fixed split)")
        ax.set_ylabel(unit)
        ax.set_title(f"{budget:.0f} tokens (dashed, star: adaptive PromPrune)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def mu_tau_heatmap(table: ScoreTable, options: pd.DataFrame, path: Path) -> Path | None:
    """Fig. 5: PromPrune over the mu x tau grid, VisPruner at the same budget as reference: one row of panels per
    budget, the first Rel. (without an unpruned trial: `cross_benchmark_mean`, none where the benchmarks mix
    units), then one per benchmark (the paper's figure shows SQA, POPE and GQA
    each, and says the method beats VisPruner on all of them), each task as % of the unpruned model where it ran.

    options: `mu` and `tau` per trial (index: run id). Cells that beat the reference on that panel's measure are
    outlined; a budget whose trials form no grid (`is_grid`) gets no row.
    """
    if not set(MU_TAU) <= set(options.columns):
        return None
    frame = _pruned(table).join(options[list(MU_TAU)])
    grid = frame[(frame["method"] == "promprune") & frame["mu"].notna() & frame["tau"].notna()]
    if grid["mu"].nunique() < 2 or grid["tau"].nunique() < 2:
        return None
    use_rel = grid["rel"].notna().any()
    mean = None if use_rel else cross_benchmark_mean(table, frame)
    measures = [("Rel. (%)", frame["rel"])] if use_rel else [] if mean is None else [(mean[1], mean[0])]
    if len(table.columns) > 1 or not use_rel:  # one benchmark's panel would repeat the Rel. panel
        for col in table.columns:
            values, unit = _relative(table, frame, col.task)
            measures.append((f"{col.label} ({unit if use_rel else col.unit})", values))
    budgets = []
    for b in sorted(grid["budget"].dropna().unique(), reverse=True):
        rows = grid.index[grid["budget"] == b]
        if is_grid(_mu_tau_pivot(frame.loc[rows], measures[0][1].loc[rows])):  # a search's scatter is no grid
            budgets.append(b)
    budgets = budgets[:MAX_PANELS]
    if not budgets:
        return None
    fig, axes = plt.subplots(len(budgets), len(measures), figsize=(5.0 * len(measures), 4.2 * len(budgets)),
                             squeeze=False)
    for row, budget in zip(axes, budgets):
        rows = grid.index[grid["budget"] == budget]
        ref_rows = frame.index[(frame["method"] == "vispruner") & (frame["budget"] == budget)]
        for ax, (label, values) in zip(row, measures):
            ref_value = float(values.loc[ref_rows[0]]) if len(ref_rows) else np.nan
            _heatmap_panel(fig, ax, _mu_tau_pivot(frame.loc[rows], values.loc[rows]), ref_value, label)
            ref_text = f"VisPruner {ref_value:.1f} (red: better)" if not np.isnan(ref_value) else "no VisPruner trial"
            ax.set_title(f"{budget:.0f} tokens, {label}; {ref_text}", fontsize=8)
    return _save(fig, path)


def _mu_tau_pivot(rows: pd.DataFrame, values: pd.Series) -> pd.DataFrame:
    """mu (rows) x tau (columns) of ``values`` over PromPrune's trials ``rows`` (the mean where a cell repeats)."""
    return rows.assign(_y=values).pivot_table(index="mu", columns="tau", values="_y", aggfunc="mean")


def _heatmap_panel(fig, ax, pivot: pd.DataFrame, ref_value: float, label: str) -> None:
    """One mu x tau heatmap, each cell's value written in it, cells above ``ref_value`` outlined in red."""
    image = ax.imshow(pivot.to_numpy(), cmap="viridis", aspect="auto", origin="lower")
    fig.colorbar(image, ax=ax, label=label)
    ax.set_xticks(range(pivot.shape[1]), [f"{t:g}" for t in pivot.columns])
    ax.set_yticks(range(pivot.shape[0]), [f"{m:g}" for m in pivot.index])
    for (i, j), value in np.ndenumerate(pivot.to_numpy()):
        if np.isnan(value):
            continue
        ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7, color="white")
        if not np.isnan(ref_value) and value > ref_value:
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=1.5))
    ax.set_xlabel("tau")
    ax.set_ylabel("mu")


def ablation_bars(table: ScoreTable, path: Path) -> Path | None:
    """Grouped bars per benchmark (and Rel.), one bar per trial, one panel per budget (Fig. 4, Tables 4-6). A trial
    with no number (no score, no Rel.: it failed, or never finished) has no bar; a budget with fewer than two trials
    that have one gets no panel, and without a panel there is no figure (None)."""
    pruned = scored_rows(table)
    budgets = [b for b, rows in pruned.groupby("budget") if 2 <= len(rows) <= MAX_BARS]
    budgets = sorted(budgets, reverse=True)[:MAX_PANELS]
    if not budgets:
        return None
    fig, axes = plt.subplots(1, len(budgets), figsize=(max(6.0, 1.2 * (len(table.columns) + 1)) * len(budgets), 4.2),
                             squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        rows = pruned[pruned["budget"] == budget]
        groups = [c.label for c in table.columns] + (["Rel."] if rows["rel"].notna().any() else [])
        width = 0.8 / len(rows)
        unit, highest = "score", 0.0
        for k, (rid, row) in enumerate(rows.iterrows()):
            values = []
            for col in table.columns:
                v, unit = _relative(table, rows.loc[[rid]], col.task)
                values.append(float(v.iloc[0]))
            if len(groups) > len(table.columns):
                values.append(row["rel"])
            x = np.arange(len(groups)) + (k - (len(rows) - 1) / 2) * width
            ax.bar(x, values, width=width, label=row["label"])
            if not np.all(np.isnan(values)):
                highest = max(highest, float(np.nanmax(values)))
        # honest bars start at zero; the values are printed on them, above the bar, so leave room for the labels
        ax.set_ylim(0, highest * 1.15 if highest > 0 else 1.0)
        for container in ax.containers:
            ax.bar_label(container, fmt="%.1f", fontsize=6, rotation=90, padding=2)
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"{budget:.0f} tokens: each benchmark ({unit}) and Rel.", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def entropy_halfwidth(preds: pd.DataFrame) -> float:
    """The largest ``entropy_halfwidth`` of the samples: how far their recorded entropies may lie from the exact ones
    (0: all exact, or a run recorded before the column existed)."""
    if "entropy_halfwidth" not in preds:
        return 0.0
    widest = preds["entropy_halfwidth"].max(skipna=True)
    return 0.0 if pd.isna(widest) else float(widest)


def entropy_histograms(preds: pd.DataFrame, path: Path, mu: float | None, title: str) -> Path | None:
    """Fig. C1: per benchmark, the spectral entropy histogram (mu and the median marked) and the saliency ratio.

    preds: one row per sample with `task`, `entropy`, `saliency_count`, `visual_tokens` (failed samples removed), and
    `entropy_halfwidth` where the run recorded it: where any is above 0 (the certified split's bracket midpoints, a
    GPU's), the title says how far from the exact entropies they may lie.
    """
    preds = preds.dropna(subset=["entropy"])
    if preds.empty:
        return None
    widest = entropy_halfwidth(preds)
    if widest:
        title += (f"\nentropies: certified bracket midpoints, within {widest:.1e} of the exact ones "
                  "(exact: PROMPRUNE_ENTROPY=exact)")
    tasks = list(dict.fromkeys(preds["task"]))
    fig, axes = plt.subplots(2, len(tasks), figsize=(3.6 * len(tasks), 5.6), squeeze=False)
    for j, task in enumerate(tasks):
        rows = preds[preds["task"] == task]
        top, bottom = axes[0][j], axes[1][j]
        top.hist(rows["entropy"], bins=20, color="tab:blue", alpha=0.8)
        top.axvline(rows["entropy"].median(), color="black", ls=":", label=f"median {rows['entropy'].median():.3f}")
        if mu is not None:
            top.axvline(mu, color="tab:red", ls="--", label=f"mu {mu:g}")
        else:
            top.plot([], [], " ", label="mu: adapter default (not logged)")
        top.set_title(task, fontsize=9)
        top.set_xlabel("spectral entropy")
        top.legend(fontsize=7)
        ratio = rows["saliency_count"] / rows["visual_tokens"].where(rows["visual_tokens"] > 0)
        bottom.hist(ratio.dropna(), bins=20, range=(0, 1), color="tab:red", alpha=0.8)
        bottom.set_xlabel("saliency ratio T_sal / T")
    axes[0][0].set_ylabel("questions")  # a row per question: an image asked several counts several times
    axes[1][0].set_ylabel("questions")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


TAU_TICKS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # readable tau labels on a log axis


def is_grid(pivot: pd.DataFrame | None) -> bool:
    """Whether a mu x tau pivot (NaN: no finished trial there) is a grid worth a heatmap: two mu values and two tau
    values whose four cells all hold a value. A search's scattered points make a pivot of mostly empty cells (three
    points in an L are no grid)."""
    if pivot is None or pivot.shape[0] < 2 or pivot.shape[1] < 2:
        return False
    filled = pivot.notna().to_numpy()  # [mu, tau]
    return any((filled[i] & filled[j]).sum() >= 2 for i in range(len(filled)) for j in range(i + 1, len(filled)))


def search_plane(points: pd.DataFrame, best: str | None, grid: pd.DataFrame | None, path: Path,
                 grid_title: str = "the grid") -> Path | None:
    """A search over mu and tau, `plane_figure` saved to ``path``; None with fewer than two trials to draw."""
    points = points.dropna(subset=["mu", "tau", "value"])
    if len(points) < 2:
        return None
    return _save(plane_figure(points, best, grid, grid_title), path)


def plane_figure(points: pd.DataFrame, best: str | None, grid: pd.DataFrame | None, grid_title: str = "the grid"):
    """Each trial at its (tau, mu): a finished one filled, coloured by its Rel. (%); one a scheduler stopped drawn
    apart, hollow and grey, never on the colour scale (its running Rel. is over its first samples only, and a high
    one would pass for the best); the best finished trial starred. Beside it, when ``grid`` (a mu x tau pivot of
    Rel., %) `is_grid`, its heatmap on the finished trials' colour scale.

    points: one row per trial (index: trial id) with ``mu``, ``tau``, ``value`` (Rel., %) and ``stopped`` (bool)."""
    grid = grid if is_grid(grid) else None
    panels = 2 if grid is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.8 * panels, 4.8), squeeze=False)
    ax = axes[0][0]
    done, stopped = points[~points["stopped"]], points[points["stopped"]]
    scale = pd.concat([done["value"], grid.stack()]) if grid is not None else done["value"]
    norm = matplotlib.colors.Normalize(float(scale.min()), float(scale.max())) if len(scale) else None
    if len(done):
        image = ax.scatter(done["tau"], done["mu"], c=done["value"], cmap="viridis", norm=norm, s=60,
                           edgecolors="black", linewidths=0.5, label=f"ran to the end ({len(done)})", zorder=3)
        fig.colorbar(image, ax=ax, label="Rel. (%), finished trials")
    if len(stopped):
        ax.scatter(stopped["tau"], stopped["mu"], s=50, facecolors="none", edgecolors=STOPPED_GREY, linewidths=1.2,
                   zorder=2, label=f"stopped early ({len(stopped)}): running Rel. over its first samples, off the "
                                   "scale")
    if best is not None and best in done.index:
        ax.scatter([done.loc[best, "tau"]], [done.loc[best, "mu"]], marker="*", s=380, facecolors="none",
                   edgecolors="red", linewidths=1.6, zorder=4, label=f"best: {done.loc[best, 'value']:.1f}%")
    _tau_axis(ax, points["tau"])
    ax.set_ylabel("mu")
    ax.set_title(f"{len(points)} trials in the (mu, tau) plane", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    ax.grid(alpha=0.3)
    if grid is not None:
        _grid_panel(fig, axes[0][1], grid, norm, grid_title)
    return fig


STOPPED_GREY = "0.55"  # matplotlib's grey level: stopped trials, apart from the colour scale


def _tau_axis(ax, taus: pd.Series) -> None:
    ax.set_xscale("log")
    lo, hi = float(taus.min()), float(taus.max())
    ticks = [t for t in TAU_TICKS if lo / 1.5 <= t <= hi * 1.5] or [lo, hi]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("tau (log scale)")


def _grid_panel(fig, gx, grid: pd.DataFrame, norm, title: str) -> None:
    shown = gx.imshow(grid.to_numpy(), cmap="viridis", norm=norm, aspect="auto", origin="lower")
    gx.set_xticks(range(grid.shape[1]), [f"{t:g}" for t in grid.columns])
    gx.set_yticks(range(grid.shape[0]), [f"{m:g}" for m in grid.index])
    for (i, j), value in np.ndenumerate(grid.to_numpy()):
        if not np.isnan(value):
            gx.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7, color="white")
    gx.set_xlabel("tau")
    gx.set_ylabel("mu")
    gx.set_title(f"{title}: Rel. (%) per grid point", fontsize=9)
    fig.colorbar(shown, ax=gx, label="Rel. (%)")
