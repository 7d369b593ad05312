"""Prominence metrics against known ground truth: the offline counterpart of the paper's Fig. 2.

The paper asks GPT-4o to rate how concentrated each image's meaning is and plots the mean normalized entropy per
rating. The testbed (``promprune.testbed``) knows the answer: each document carries its scene's number of objects
(semantic units) and their spatial spread. For every PromPrune trial whose predictions carry per-sample entropies
(one per prominence metric: spectral, feature-norm, attention), this module joins them with that ground truth and
reports Spearman correlations, plus a figure of the mean entropy and the saliency share T_sal / T per object count.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

TRUTH_COLUMNS = ("num_objects", "spread")
DEFAULT_METRIC = "spectral"

TruthSource = Callable[[str], "pd.DataFrame | None"]  # task -> ground truth indexed by doc_id, or None


def testbed_truth(task: str) -> pd.DataFrame | None:
    """Ground truth of a testbed task's documents (index doc_id), or None for any other task."""
    from promprune.eval.tasks import TESTBED_TASKS, load_task

    if task not in TESTBED_TASKS:
        return None
    docs = load_task(task).eval_docs_no_media.to_pandas()
    return docs[list(TRUTH_COLUMNS)].rename_axis("doc_id")


def joined(preds: pd.DataFrame, truth_source: TruthSource) -> pd.DataFrame:
    """The samples of ``preds`` with an entropy and ground truth: task, doc_id, entropy, t_sal_share, truth."""
    if preds is None or preds.empty or "entropy" not in preds or not preds["entropy"].notna().any():
        return pd.DataFrame()
    parts = []
    for task, rows in preds[preds["entropy"].notna()].groupby("task"):
        truth = truth_source(task)
        if truth is None:
            continue
        rows = rows.join(truth, on="doc_id", how="inner")
        rows = rows.assign(t_sal_share=rows["saliency_count"] / rows["visual_tokens"])
        parts.append(rows[["task", "doc_id", "entropy", "t_sal_share", *TRUTH_COLUMNS]])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def spearman(x: pd.Series, y: pd.Series) -> float:
    """Spearman's rank correlation (scipy's: average ranks for ties) over the pairs where both are present; NaN
    with fewer than 3 pairs or when either side is constant."""
    import warnings

    from scipy.stats import spearmanr

    pair = pd.concat([pd.Series(x).reset_index(drop=True), pd.Series(y).reset_index(drop=True)], axis=1).dropna()
    if len(pair) < 3 or pair.iloc[:, 0].nunique() < 2 or pair.iloc[:, 1].nunique() < 2:
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(spearmanr(pair.iloc[:, 0], pair.iloc[:, 1]).statistic)


def correlation_table(arms: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per arm (label -> joined samples): n, Spearman of the entropy with each ground truth, and of T_sal."""
    rows = []
    for label, frame in arms.items():
        if frame.empty:
            continue
        row = {"arm": label, "samples": len(frame)}
        for col in TRUTH_COLUMNS:
            row[f"rho_entropy_{col}"] = spearman(frame["entropy"], frame[col])
        row["rho_t_sal_share_num_objects"] = spearman(frame["t_sal_share"], frame["num_objects"])
        rows.append(row)
    return pd.DataFrame(rows)


def figure(arms: dict[str, pd.DataFrame], path: Path) -> Path | None:
    """Mean entropy (left) and mean saliency share T_sal / T (right) per number of objects, one line per arm."""
    arms = {k: v for k, v in arms.items() if not v.empty}
    if not arms:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    markers = "osD^v<>"
    for i, (label, frame) in enumerate(arms.items()):
        # each metric lives on its own scale (spectral ~0.05, feature-norm ~0.98 on the testbed model): its
        # percentile rank among the arm's samples puts them on one axis, and is what Spearman's rho correlates
        frame = frame.assign(entropy_rank=frame["entropy"].rank(pct=True))
        by_k = frame.groupby("num_objects")
        short = label.split(" (")[0]
        axes[0].plot(by_k["entropy_rank"].mean(), marker=markers[i % len(markers)], label=short)
        axes[1].plot(by_k["t_sal_share"].mean(), marker=markers[i % len(markers)], label=short)
    axes[0].set(xlabel="objects in the scene (semantic units)", ylabel="mean percentile rank of the metric",
                title="Prominence metric vs ground truth", ylim=(0, 1.02))
    axes[1].set(xlabel="objects in the scene (semantic units)", ylabel="mean T_sal / T",
                title="Saliency share of the budget", ylim=(0, 1.02))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
