"""The paper's Fig. E1: saliency-only, coverage-only and PromPrune (and a fixed split) on the same images.

One row per document, one panel per method: the image as the encoder saw it (see `overlay`), each method's kept
tokens on it (red: saliency stage, cyan: coverage stage, yellow: kept with the stage not recorded) and the dropped
tokens dimmed. Panel titles: the method, its T_sal/T on that image and the image's prominence entropy.

Which trials: those of `COMPARE_METHODS` at one budget, one trial per method (the first in paper order), when at
least two methods have predictions there (the budget with the most such methods; ties: the smaller budget).
Which documents (deterministic): those every chosen trial has kept tokens for, ranked by how far PromPrune's
split lies from the closest other method's (then by how different its kept tokens are), or without PromPrune by
how different the methods' kept tokens are; taken round-robin over tasks so the rows cover different benchmarks,
skipping an image an earlier row already shows.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colors as mcolors
from matplotlib.patches import Patch

from . import overlay
from .overlay import plt

COMPARE_METHODS = ("saliency_only", "coverage_only", "fixed_ratio", "promprune")
ADAPTIVE = "promprune"
FILENAME = "figE1_overlays.png"
MAX_ROWS = 3  # documents drawn
MAX_TRIES = 12  # candidate documents whose images are loaded before giving up on finding distinct ones
DROPPED_COLOR, DROPPED_ALPHA = "black", 0.6  # dropped tokens: the image dimmed under them
PANEL_IN = 2.6  # inches per panel


@dataclass
class Panel:
    label: str  # the method as the score table names it
    salient: list  # kept token indices of the saliency stage (all kept ones when the split is unknown)
    coverage: list | None  # of the coverage stage; None: the predictions do not say which stage chose what
    entropy: float | None  # the trial's recorded prominence entropy for this image (PromPrune records it)

    @property
    def kept(self) -> int:
        return len(self.salient) + len(self.coverage or [])

    @property
    def split(self) -> float:
        """T_sal / T on this image (NaN when unknown or nothing is kept)."""
        return len(self.salient) / self.kept if self.coverage is not None and self.kept else math.nan


def comparison_trials(frame: pd.DataFrame, has_tokens: Callable[[str], bool]) -> tuple[float, dict] | None:
    """(budget, {method: run id}) of the trials to compare, or None when no budget has two of `COMPARE_METHODS`
    with kept tokens recorded. frame: the score table's (paper order; method, budget); has_tokens(run id)."""
    groups = {}
    rows = frame[frame["method"].isin(COMPARE_METHODS) & frame["budget"].notna()]
    for budget, group in rows.groupby("budget", sort=True):
        chosen = {}
        for rid, row in group.iterrows():
            if row["method"] not in chosen and has_tokens(rid):
                chosen[row["method"]] = rid
        if len(chosen) >= 2:
            groups[float(budget)] = {m: chosen[m] for m in COMPARE_METHODS if m in chosen}
    if not groups:
        return None
    budget = min(groups, key=lambda b: (-len(groups[b]), b))
    return budget, groups[budget]


def panels_by_document(frames: dict[str, pd.DataFrame], labels: dict[str, str]) -> dict[tuple, dict[str, Panel]]:
    """{(task, doc_id): {method: Panel}} for the documents every method's frame has kept tokens for.
    frames: method -> its successful predictions (task, doc_id, kept, salient[, entropy])."""
    per_method = {}
    for method, frame in frames.items():
        docs = {}
        for _, row in frame.iterrows():
            kept = row.get("kept")
            if kept is None or len(kept) == 0:
                continue
            salient, coverage = overlay.token_roles(row)
            entropy = row.get("entropy")
            entropy = None if entropy is None or pd.isna(entropy) else float(entropy)
            docs[(str(row["task"]), str(row["doc_id"]))] = Panel(labels[method], salient, coverage, entropy)
        per_method[method] = docs
    common = set.intersection(*(set(d) for d in per_method.values())) if per_method else set()
    return {key: {m: per_method[m][key] for m in frames} for key in common}


def _jaccard_distance(a: Panel, b: Panel) -> float:
    sa, sb = set(a.salient) | set(a.coverage or []), set(b.salient) | set(b.coverage or [])
    union = sa | sb
    return 1.0 - len(sa & sb) / len(union) if union else 0.0


def document_score(panels: dict[str, Panel]) -> tuple[float, float]:
    """(PromPrune's split distance to the closest other method's split, mean kept-set distance): larger first.
    Without PromPrune (or its split unknown): (0, mean pairwise kept-set distance)."""
    methods = list(panels)
    if ADAPTIVE in panels:
        ours, others = panels[ADAPTIVE], [panels[m] for m in methods if m != ADAPTIVE]
        gaps = [abs(ours.split - o.split) for o in others if not math.isnan(o.split)]
        gap = min(gaps) if gaps and not math.isnan(ours.split) else 0.0
        return gap, float(np.mean([_jaccard_distance(ours, o) for o in others]))
    pairs = [(a, b) for i, a in enumerate(methods) for b in methods[i + 1:]]
    return 0.0, float(np.mean([_jaccard_distance(panels[a], panels[b]) for a, b in pairs]))


def rank_documents(docs: dict[tuple, dict[str, Panel]]) -> list[tuple]:
    """Document keys, best first, round-robin over tasks (the task whose best document scores highest first)."""
    def key(doc):
        gap, dist = document_score(docs[doc])
        return (-round(gap, 9), -round(dist, 9), doc[0], _doc_order(doc[1]))

    by_task: dict[str, list] = {}
    for doc in sorted(docs, key=key):
        by_task.setdefault(doc[0], []).append(doc)
    queues = list(by_task.values())  # tasks in order of their best document
    ranked = []
    for depth in range(max((len(q) for q in queues), default=0)):
        ranked += [q[depth] for q in queues if depth < len(q)]
    return ranked


def _doc_order(doc_id: str):
    return (0, int(doc_id), "") if doc_id.isdigit() else (1, 0, doc_id)


def pick_rows(docs, image_source, n=MAX_ROWS, tries=MAX_TRIES) -> list[tuple[tuple, np.ndarray, str]]:
    """Up to n (doc key, image, note) in `rank_documents` order, each showing an image no earlier row shows."""
    rows, seen = [], set()
    for doc in rank_documents(docs)[:tries]:
        image, note = image_source(*doc)
        digest = hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        rows.append((doc, image, note))
        if len(rows) == n:
            break
    return rows


def entropy_of(panels: dict[str, Panel]) -> float | None:
    """The image's entropy: PromPrune's record, else any method's."""
    order = [ADAPTIVE] + [m for m in panels if m != ADAPTIVE]
    return next((panels[m].entropy for m in order if m in panels and panels[m].entropy is not None), None)


def _token_layer(side: int, panel: Panel) -> np.ndarray:
    """[side, side, 4] RGBA over the grid: dropped cells dimmed, kept cells in their stage's colour."""
    layer = np.zeros((side * side, 4))
    layer[:] = mcolors.to_rgba(DROPPED_COLOR, DROPPED_ALPHA)
    salient_color = overlay.SALIENT_COLOR if panel.coverage is not None else overlay.UNKNOWN_COLOR
    layer[list(panel.salient)] = mcolors.to_rgba(salient_color, overlay.ALPHA)
    layer[list(panel.coverage or [])] = mcolors.to_rgba(overlay.COVERAGE_COLOR, overlay.ALPHA)
    return layer.reshape(side, side, 4)


def draw(rows: list[tuple[tuple, np.ndarray, str]], docs: dict, n_tokens: int, path: Path,
         fit: str = "crop") -> Path | None:
    """Write the figure: rows of (doc key, image, note); docs: `panels_by_document`'s. None for a non-square grid."""
    if fit not in ("crop", "stretch"):
        raise ValueError(f"fit must be 'crop' or 'stretch', got {fit!r}")
    side = overlay.grid_side(n_tokens)
    if side is None or not rows:
        return None
    methods = list(docs[rows[0][0]])
    bad = [i for doc, _, _ in rows for p in docs[doc].values() for i in p.salient + (p.coverage or [])
           if not 0 <= i < n_tokens]
    if bad:
        raise ValueError(f"kept token indices {bad[:5]} are outside the {n_tokens}-token grid")
    ncol = 4 if len(methods) >= 3 else 2  # legend entries per line
    strip = 0.3 if ncol == 4 else 0.55  # the legend's strip (inches)
    height = (PANEL_IN + 0.5) * len(rows) + strip
    fig, axes = plt.subplots(len(rows), len(methods), squeeze=False,
                             figsize=(PANEL_IN * len(methods) + 0.4, height))
    unknown = False
    for r, (doc, image, note) in enumerate(rows):
        square = overlay.square_crop(np.asarray(image)) if fit == "crop" else np.asarray(image)
        entropy = entropy_of(docs[doc])
        h = "–" if entropy is None else f"{entropy:.3f}"
        for c, method in enumerate(methods):
            ax, panel = axes[r, c], docs[doc][method]
            ax.imshow(square, extent=(0, side, side, 0), aspect="equal")
            ax.imshow(_token_layer(side, panel), extent=(0, side, side, 0), aspect="equal", interpolation="nearest")
            ax.set_axis_off()
            t_sal = f"{len(panel.salient)}/{panel.kept}" if panel.coverage is not None else "?"
            ax.set_title(f"{panel.label}\nT_sal/T = {t_sal}, H = {h}", fontsize=8)
            unknown |= panel.coverage is None
        axes[r, 0].text(-0.04, 0.5, f"{doc[0]} doc {doc[1]}{note}", transform=axes[r, 0].transAxes, rotation=90,
                        ha="right", va="center", fontsize=7)
    handles = [Patch(color=overlay.SALIENT_COLOR, alpha=overlay.ALPHA, label="saliency stage"),
               Patch(color=overlay.COVERAGE_COLOR, alpha=overlay.ALPHA, label="coverage stage"),
               Patch(color=DROPPED_COLOR, alpha=DROPPED_ALPHA, label="dropped (dimmed)")]
    if unknown:
        handles.insert(2, Patch(color=overlay.UNKNOWN_COLOR, alpha=overlay.ALPHA, label="kept, stage not recorded"))
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0.03, strip / height, 1, 1))
    fig.savefig(path, dpi=overlay.DPI)
    plt.close(fig)
    return path
