"""Kept visual tokens drawn on the image, saliency tokens red and coverage tokens cyan (the paper's Fig. E1).

A token index i of a square g x g grid covers row i // g, column i % g of the image as the encoder saw it.
CLIP-style processors (LLaVA-1.5) resize the shortest side and center-crop a square, so the grid is laid over
the image's central square (fit "crop"); Qwen2.5-VL at a fixed token count resizes the whole image to a square
(fit "stretch"). Non-square grids (LLaVA-NeXT's several views) are not drawn.

Which kept tokens came from the saliency stage: the `salient` column (list of kept indices) of the predictions.
Where it is null (the in-LLM methods do not record it) the split is unknown and every kept token is drawn in one
neutral colour, said in the title.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

SALIENT_COLOR = "red"  # Fig. E1's colours
COVERAGE_COLOR = "cyan"
UNKNOWN_COLOR = "yellow"  # kept, stage unknown
ALPHA = 0.45  # token fill opacity: the image stays readable under the cells
DPI = 120


def grid_side(n_tokens: int) -> int | None:
    """g for a g x g token grid, or None when n_tokens is not a perfect square."""
    side = math.isqrt(int(n_tokens))
    return side if side * side == int(n_tokens) and side > 0 else None


def token_roles(row: pd.Series) -> tuple[list[int], list[int] | None]:
    """(salient, coverage) kept indices; coverage is None when the predictions do not say which stage chose what."""
    kept = [int(i) for i in row["kept"]]
    salient = row.get("salient")
    if salient is not None and not (isinstance(salient, float) and math.isnan(salient)):
        chosen = {int(i) for i in salient}
        return sorted(chosen), [i for i in kept if i not in chosen]
    return kept, None


def square_crop(image: np.ndarray) -> np.ndarray:
    """The central square of an [H, W, C] image (what a CLIP processor's center crop keeps)."""
    h, w = image.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return image[top:top + side, left:left + side]


def fit_for(model: str | None) -> str:
    """How the model's processor maps the image onto its square token grid: "stretch" for Qwen, else "crop"."""
    return "stretch" if model and "qwen" in model.lower() else "crop"


def draw_overlay(image: np.ndarray, n_tokens: int, salient: list[int], coverage: list[int] | None,
                 path: Path, title: str, fit: str = "crop") -> Path | None:
    """Write the overlay PNG. image: [H, W, 3] uint8; n_tokens: the full grid's token count (g * g);
    fit: "crop" (central square, CLIP) or "stretch" (the whole image squeezed to a square, Qwen fixed tokens)."""
    if fit not in ("crop", "stretch"):
        raise ValueError(f"fit must be 'crop' or 'stretch', got {fit!r}")
    side = grid_side(n_tokens)
    if side is None:
        return None
    bad = [i for i in list(salient) + list(coverage or []) if not 0 <= i < n_tokens]
    if bad:
        raise ValueError(f"kept token indices {bad[:5]} are outside the {n_tokens}-token grid")
    square = square_crop(np.asarray(image)) if fit == "crop" else np.asarray(image)
    cell = 1.0  # draw in token units: the image is stretched over the g x g extent
    fig, ax = plt.subplots(figsize=(4.6, 4.9))
    ax.imshow(square, extent=(0, side, side, 0), aspect="auto")
    groups = [(salient, SALIENT_COLOR if coverage is not None else UNKNOWN_COLOR), (coverage or [], COVERAGE_COLOR)]
    for indices, color in groups:
        for i in indices:
            r, c = divmod(i, side)
            ax.add_patch(plt.Rectangle((c * cell, r * cell), cell, cell, color=color, alpha=ALPHA, lw=0))
    ax.set_axis_off()
    dropped = n_tokens - len(salient) - len(coverage or [])
    if coverage is None:
        legend = f"yellow: {len(salient)} kept (saliency/coverage split not recorded), plain: {dropped} dropped"
    else:
        legend = f"red: {len(salient)} saliency, cyan: {len(coverage)} coverage, plain: {dropped} dropped"
    ax.set_title(f"{title}\n{legend}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def stand_in_image() -> np.ndarray:
    """scikit-image's bundled astronaut photo: used when the task's own image cannot be found offline."""
    from skimage import data

    return data.astronaut()
