"""The split-headroom figure: which fixed saliency ratios answer each sample best, against its spectral entropy (and,
on the testbed, its scene's object count), binned, with the adaptive trials' realised saliency share and PromPrune's
sigmoid drawn over it. One PNG per budget, one column per task (and the pooled tasks); `NOTE` says how to read it.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

from . import headroom as hr
from .headroom_section import MAX_PANELS, TRUTH, Panel

NOTE = (
    "The figures (one per budget; columns: the tasks, then the pooled tasks; top row against spectral entropy in "
    "quantile bins, bottom row, on the testbed, against the scene's object count): each cell is, among the bin's "
    "samples whose answers depend on the ratio (not every ratio scoring alike), the share for which that ratio "
    "(placed at its realised T_sal / T) is among the best, i.e. for right/wrong scores answers correctly (pale: "
    "no such sample in the bin). Black "
    "line: the bin's mean of those samples' best share (the mean of their best ratios). Coloured lines: each other "
    "trial's mean realised T_sal / T in the bin; dashed: PromPrune's split, kr_min + (1 - sigmoid((H - mu) / tau)) "
    "(kr_max - kr_min), from its logged mu and tau.")
NO_SAMPLE = "#f6e7d8"  # a bin without ratio-dependent samples: no preference to show
MAX_BINS = 8  # entropy bins per panel
MIN_PER_BIN = 25  # fewer bins when a panel has fewer samples than MAX_BINS x this
DPI = 120


def _edges(values: np.ndarray, discrete: bool) -> np.ndarray:
    """Bin edges: midpoints between the distinct values (discrete), else quantiles of the values."""
    known = np.unique(values[~np.isnan(values)])
    if discrete or len(known) <= 2:
        mids = (known[1:] + known[:-1]) / 2
        gap = (known[1] - known[0]) / 2 if len(known) > 1 else 0.5
        return np.concatenate([[known[0] - gap], mids, [known[-1] + gap]])
    bins = int(np.clip(len(values) // MIN_PER_BIN, 2, MAX_BINS))
    return np.unique(np.quantile(known if len(known) < bins else values[~np.isnan(values)],
                                 np.linspace(0, 1, bins + 1)))


def _bin_of(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``[n]`` bin index (-1: no value)."""
    idx = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(edges) - 2)
    return np.where(np.isnan(values), -1, idx)


def preference(panel: Panel, feature: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(``[U, B]`` share of each bin's split-sensitive samples with each distinct realised share among their best,
    ``[U]`` the distinct shares, ``[B]`` the bin mean of those samples' mean best share); NaN where a bin has none."""
    best = hr.best_set(panel.fixed)  # [n, K]
    sensitive = ~best.all(axis=1)
    levels = np.unique(panel.shares)
    member = np.stack([best[:, panel.shares == u].any(axis=1) for u in levels], axis=1)  # [n, U]
    best_share = (best * panel.shares).sum(axis=1) / best.sum(axis=1)  # [n]
    bins = _bin_of(feature, edges)
    heat = np.full((len(levels), len(edges) - 1), np.nan)
    line = np.full(len(edges) - 1, np.nan)
    for b in range(len(edges) - 1):
        here = sensitive & (bins == b)
        if here.any():
            heat[:, b] = member[here].mean(axis=0)
            line[b] = best_share[here].mean()
    return heat, levels, line


def _level_edges(levels: np.ndarray) -> np.ndarray:
    """Band edges on the share axis: midway between neighbouring shares, the outer bands clipped to [0, 1]."""
    if len(levels) == 1:
        return np.array([0.0, 1.0])
    mids = (levels[1:] + levels[:-1]) / 2
    low, high = max(0.0, 2 * levels[0] - mids[0]), min(1.0, 2 * levels[-1] - mids[-1])
    return np.concatenate([[low], mids, [high]])


def _draw(ax, panel: Panel, feature: np.ndarray, discrete: bool, xlabel: str):
    edges = _edges(feature, discrete)
    heat, levels, line = preference(panel, feature, edges)
    cmap = matplotlib.colormaps["Greys"].with_extremes(bad=NO_SAMPLE)
    image = ax.pcolormesh(edges, _level_edges(levels), heat, cmap=cmap, vmin=0, vmax=1, shading="flat")
    bins = _bin_of(feature, edges)
    centres = np.array([np.nanmedian(feature[bins == b]) if (bins == b).any() else np.nan
                        for b in range(len(edges) - 1)])
    ax.plot(centres, line, color="black", marker="o", ms=4, lw=1.6, label="best share (bin mean)")
    for i, (label, shares) in enumerate(panel.method_shares.items()):
        if shares is None or np.isnan(shares).all():
            continue
        means = [np.nanmean(shares[bins == b]) if (bins == b).any() else np.nan for b in range(len(edges) - 1)]
        ax.plot(centres, means, marker="s", ms=4, lw=1.4, color=f"C{i + 1}", label=f"{label}: realised T_sal/T")
    if not discrete:
        for i, (label, (mu, tau, kr_min, kr_max)) in enumerate(panel.sigmoids.items()):
            x = np.linspace(edges[0], edges[-1], 200)
            z = np.clip((x - mu) / tau, -20, 20)
            ax.plot(x, kr_min + (1 - 1 / (1 + np.exp(-z))) * (kr_max - kr_min), ls="--", color=f"C{i + 1}",
                    lw=1.2, label=f"{label}: sigmoid (mu {mu:.3g}, tau {tau:.3g})")
    ax.set(xlabel=xlabel, ylabel="saliency share T_sal / T", ylim=(0, 1), xlim=(edges[0], edges[-1]))
    return image


def figure(panels: list[Panel], path: Path) -> Path | None:
    """One budget's panels (tasks, then the pooled one) as a PNG at ``path``; None without panels."""
    panels = panels[:MAX_PANELS]
    if not panels:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    truth = any(p.has_truth for p in panels)
    rows = 2 if truth else 1
    fig, axes = plt.subplots(rows, len(panels), figsize=(4.6 * len(panels), 4.0 * rows + 0.8), squeeze=False)
    image = None
    for j, panel in enumerate(panels):
        sensitive = int((~hr.best_set(panel.fixed).all(axis=1)).sum())
        entropy = panel.units["entropy"].to_numpy(dtype=float)
        if not np.isnan(entropy).all():
            image = _draw(axes[0][j], panel, entropy, False, "spectral entropy (bins: quantiles)")
        axes[0][j].set_title(f"{panel.label}\n{sensitive} of {len(panel.units)} samples depend on the ratio",
                             fontsize=9)
        if truth:
            if panel.has_truth:
                image = _draw(axes[1][j], panel, panel.units[TRUTH].to_numpy(dtype=float), True,
                              "objects in the scene (ground truth)")
            else:
                axes[1][j].set_axis_off()
    axes[0][0].legend(fontsize=6, loc="upper right")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01,
                     label="share of the bin's ratio-dependent samples best served by this ratio")
    fig.suptitle(f"Each sample's best fixed split against its prominence, {panels[0].budget:.0f} tokens", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path

