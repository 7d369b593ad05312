"""The paper's Fig. 2: mean normalized entropy of each prominence metric per judged concentration rating.

Input: one row per image with ``task, doc_id, rating`` (1 = highly distributed ... 5 = highly concentrated, None
when the judge gave none) and the three normalized entropies ``spectral, feature_norm, attention`` (each in [0, 1],
divided by its maximum possible value, as App. B says). ``pipelines/fig2_concentration.py`` produces it.

- :func:`summary`: per rating, the image count and each metric's mean and standard error.
- :func:`correlations`: Spearman's rho between rating and each metric (the paper's claim: spectral entropy falls
  monotonically as concentration rises; the other two do not).
- :func:`figure`: one panel per metric (their ranges differ too much to share an axis: feature-norm entropy sits
  near 1 on CLIP features), mean +- s.e. per rating, the count of images under each rating.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from promprune.selection.two_stage import METRICS  # the prominence metrics, named once

from .ground_truth import spearman
from .tables import markdown_table

LABELS = {"spectral": "Spectral", "feature_norm": "Norm", "attention": "Attn"}  # the paper's legend
RATINGS = (1, 2, 3, 4, 5)
DPI = 120


def rated(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows with a 1-5 rating, rating as int."""
    ok = frame[pd.to_numeric(frame["rating"], errors="coerce").isin(RATINGS)].copy()
    ok["rating"] = ok["rating"].astype(int)
    return ok


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows = ratings 1..5 (all five, count 0 where none); columns ``n`` and ``<metric>_mean``, ``<metric>_se``."""
    ok = rated(frame)
    groups = ok.groupby("rating")
    out = pd.DataFrame(index=pd.Index(RATINGS, name="rating"))
    out["n"] = groups.size().reindex(RATINGS, fill_value=0).astype(int)
    for m in METRICS:
        out[f"{m}_mean"] = groups[m].mean().reindex(RATINGS)
        out[f"{m}_se"] = (groups[m].std(ddof=1) / np.sqrt(groups[m].count())).reindex(RATINGS)
    return out


def correlations(frame: pd.DataFrame) -> dict[str, float]:
    """Spearman's rho of rating vs each metric over the rated images (NaN with fewer than 3 or no variation)."""
    ok = rated(frame)
    out = {}
    for m in METRICS:
        out[m] = spearman(ok["rating"], ok[m])
    return out


def figure(frame: pd.DataFrame, path: Path, title: str = "") -> Path | None:
    """Draw Fig. 2 as a PNG at ``path``; None when no image has a rating."""
    table = summary(frame)
    if table["n"].sum() == 0:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rho = correlations(frame)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(11, 3.6), sharex=True)
    ticks = [f"{r}\nn={table.loc[r, 'n']}" for r in RATINGS]
    for ax, m, marker in zip(axes, METRICS, "os^"):
        have = table[table["n"] > 0]
        ax.errorbar(have.index, have[f"{m}_mean"], yerr=have[f"{m}_se"].fillna(0), marker=marker, capsize=3)
        ax.set_title(f"{LABELS[m]} (Spearman rho = {rho[m]:+.2f})" if np.isfinite(rho[m]) else LABELS[m],
                     fontsize=10)
        ax.set_xticks(list(RATINGS), ticks)
        ax.set_xlim(0.5, 5.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean normalized entropy")
    fig.supxlabel("semantic concentration rating (1 = highly distributed, 5 = highly concentrated)", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def markdown(frame: pd.DataFrame, image: str | None, *, model: str, judge: str, tasks: list[str]) -> str:
    """A short report section: what was measured, the table, the correlations, the figure."""
    table = summary(frame)
    rho = correlations(frame)
    unrated = len(frame) - int(table["n"].sum())
    lines = [
        "## Fig. 2: entropy metrics vs judged semantic concentration", "",
        (f"{len(frame)} images ({', '.join(tasks)}), rated 1-5 by {judge} with the paper's Fig. B1 prompt "
         f"({unrated} without a usable rating); normalized entropies from {model}."), "",
        markdown_table(["rating", "n"] + [LABELS[m] for m in METRICS],
                       [[r, table.loc[r, "n"]] + [f"{table.loc[r, f'{m}_mean']:.4f}" if table.loc[r, "n"] else "-"
                                                  for m in METRICS] for r in RATINGS]).rstrip("\n"),
    ]
    lines += ["", "Spearman rho (rating vs entropy): " +
              ", ".join(f"{LABELS[m]} {rho[m]:+.3f}" for m in METRICS) +
              ". The paper: spectral entropy falls as concentration rises; Norm and Attn show no consistent trend."]
    if image:
        lines += ["", f"![Fig. 2]({image})"]
    return "\n".join(lines) + "\n"
