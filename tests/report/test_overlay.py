"""Token overlays: the cells land where the raster index says, in Fig. E1's colours."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from pipelines.reporting import overlay


def _pixel(path, fx, fy):
    """RGB at a fraction (fx, fy) of the drawn image's axes box (the figure's white margins excluded)."""
    img = np.asarray(Image.open(path).convert("RGB")).astype(int)
    non_white = np.argwhere((img < 250).any(axis=2))
    (top, left), (bottom, right) = non_white.min(axis=0), non_white.max(axis=0)
    # the title is text above the image: the image box is the lowest square block of the non-white area
    side = right - left
    top = bottom - side
    return img[int(top + fy * side), int(left + fx * side)]


def test_cells_follow_raster_order_and_colours(tmp_path):
    grey = np.full((40, 40, 3), 128, dtype=np.uint8)
    # 2 x 2 grid: token 0 = top-left (salient, red), token 3 = bottom-right (coverage, cyan), 1 and 2 dropped
    path = overlay.draw_overlay(grey, 4, [0], [3], tmp_path / "o.png", "t")
    tl, tr, bl, br = (_pixel(path, 0.25, 0.25), _pixel(path, 0.75, 0.25), _pixel(path, 0.25, 0.75),
                      _pixel(path, 0.75, 0.75))
    assert tl[0] > tl[1] + 40 and tl[0] > tl[2] + 40  # reddish
    assert br[1] > br[0] + 40 and br[2] > br[0] + 40  # cyan-ish
    for px in (tr, bl):
        assert abs(px[0] - 128) < 6 and abs(px[1] - 128) < 6 and abs(px[2] - 128) < 6  # untouched grey


def test_roles_from_salient_column():
    row = pd.Series({"kept": [1, 5, 7, 9], "salient": [7, 1], "saliency_count": 2.0})
    assert overlay.token_roles(row) == ([1, 7], [5, 9])
    row = pd.Series({"kept": [1, 5], "salient": None, "saliency_count": 1.0})
    assert overlay.token_roles(row) == ([1, 5], None)  # split not recorded


def test_non_square_grid_is_skipped_and_bad_indices_named(tmp_path):
    grey = np.zeros((8, 8, 3), dtype=np.uint8)
    assert overlay.draw_overlay(grey, 2880, [0], [1], tmp_path / "x.png", "t") is None  # LLaVA-NeXT's 5 views
    with pytest.raises(ValueError, match=r"\[16\].*16-token grid"):
        overlay.draw_overlay(grey, 16, [16], [], tmp_path / "y.png", "t")


def test_square_crop_keeps_the_centre():
    img = np.arange(6 * 10).reshape(6, 10, 1)
    assert overlay.square_crop(img).shape == (6, 6, 1)
    assert overlay.square_crop(img)[0, 0, 0] == 2  # (10 - 6) / 2 columns cut on the left


def test_stretch_fit_covers_the_whole_image(tmp_path):
    """Qwen at a fixed token count squeezes the whole (non-square) image onto the grid. A 40 x 80 image in three
    bands, grey 50 | black | grey 200 (columns 0-20, 20-60, 60-80): stretched, the outer bands reach the edges of
    the drawing; a centre crop (columns 20-60) would show black at both edges."""
    img = np.zeros((40, 80, 3), dtype=np.uint8)
    img[:, :20], img[:, 60:] = 50, 200
    for fit, left, right in (("stretch", 50, 200), ("crop", 0, 0)):
        path = overlay.draw_overlay(img, 4, [], [1], tmp_path / f"{fit}.png", "t", fit=fit)
        assert np.abs(_pixel(path, 0.05, 0.75) - left).max() < 6, fit
        assert np.abs(_pixel(path, 0.95, 0.75) - right).max() < 6, fit
    with pytest.raises(ValueError, match="fit"):
        overlay.draw_overlay(img, 4, [], [], tmp_path / "x.png", "t", fit="pad")
    assert overlay.fit_for("Qwen/Qwen2.5-VL-7B-Instruct") == "stretch" and overlay.fit_for("tiny:llava") == "crop"
