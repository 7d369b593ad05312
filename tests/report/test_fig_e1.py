"""Fig. E1: saliency-only, coverage-only and PromPrune side by side, on sweeps logged to a real SQLite MLflow store.

A 4 x 4 token grid (16 tokens) at a budget of 4 keeps the cells big enough to read colours back from the PNG.
"""
from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image
from scipy import ndimage

from pipelines.reporting import side_by_side, tables
from pipelines.reporting.build import build_report
from pipelines.reporting.store import load_sweep

from .conftest import log_sweep, trial

TASKS = ["pope", "gqa"]
GRID = 16  # 4 x 4
SIDE = 4


def scores(pope, gqa):
    return {"pope/pope_f1_score": pope, "gqa/exact_match": gqa}


def preds(docs, entropy=None):
    """docs: {(task, doc): (salient, coverage)}; kept = salient + coverage."""
    return [{"task": task, "doc_id": str(doc), "prediction": "yes", "error": None,
             "entropy": None if entropy is None else entropy[(task, doc)], "saliency_count": float(len(sal)),
             "visual_tokens": float(len(sal) + len(cov)), "kept": sorted(sal + cov), "salient": sorted(sal),
             "timings": "{}"} for (task, doc), (sal, cov) in docs.items()]


DOCS = [("pope", 0), ("pope", 1), ("gqa", 0), ("gqa", 1)]
SALIENCY = {d: ([0, 1, 4, 5], []) for d in DOCS}  # the top-left block, all from the saliency stage
COVERAGE = {d: ([], [0, 3, 12, 15]) for d in DOCS}  # the corners, all from the coverage stage
# PromPrune's split T_sal/T: pope 0 -> 1/4, pope 1 -> 2/4, gqa 0 -> 3/4, gqa 1 -> 0/4. Its distance to the closest
# other split (1 and 0): .25, .5, .25, 0. Ranked, round-robin over tasks: pope 1, gqa 0, pope 0 (gqa 1 last).
PROMPRUNE = {("pope", 0): ([5], [0, 10, 15]), ("pope", 1): ([5, 6], [0, 15]), ("gqa", 0): ([5, 6, 9], [15]),
             ("gqa", 1): ([], [0, 3, 12, 15])}
ENTROPY = {("pope", 0): 0.41, ("pope", 1): 0.43, ("gqa", 0): 0.39, ("gqa", 1): 0.47}
BASELINE = trial("none", None, scores(0.8, 0.6) | {"efficiency/visual_tokens": GRID})


def image_of(task, doc_id):
    """A distinct flat grey per document (the figure skips an image an earlier row shows)."""
    level = 120 + 5 * TASKS.index(task) + int(doc_id)
    return np.full((48, 64, 3), level, dtype=np.uint8), ""


def panels(path):
    """Panel boxes (top, left, bottom, right) of the PNG, row by row, left to right: the large non-white blocks."""
    img = np.asarray(Image.open(path).convert("RGB")).astype(int)
    labels, _ = ndimage.label((img < 245).any(axis=2))
    boxes = [(s[0].start, s[1].start, s[0].stop, s[1].stop) for s in ndimage.find_objects(labels)]
    big = max((b[2] - b[0]) * (b[3] - b[1]) for b in boxes)
    boxes = sorted(b for b in boxes if (b[2] - b[0]) * (b[3] - b[1]) > big / 2)
    return img, boxes


def cell(img, box, index):
    top, left, bottom, right = box
    r, c = divmod(index, SIDE)
    return img[int(top + (r + 0.5) * (bottom - top) / SIDE), int(left + (c + 0.5) * (right - left) / SIDE)]


def colour(px) -> str:
    r, g, b = px
    if r > g + 40 and r > b + 40:
        return "red"
    if g > r + 40 and b > r + 40:
        return "cyan"
    if max(px) < 80 and max(px) - min(px) < 8:
        return "dim"
    return f"other{tuple(px)}"


FIXED = {d: ([0, 1], [14, 15]) for d in DOCS}
SWEEPS = {  # one store for all three (a store takes seconds to create)
    # Fig. E1's three methods at budget 4 (DivPrune is not one of them)
    "figE1_demo": [BASELINE, trial("promprune", 4, scores(0.8, 0.6), predictions=preds(PROMPRUNE, ENTROPY)),
                   trial("saliency_only", 4, scores(0.7, 0.5), predictions=preds(SALIENCY)),
                   trial("coverage_only", 4, scores(0.7, 0.5), predictions=preds(COVERAGE)),
                   trial("divprune", 4, scores(0.7, 0.5))],
    # two of them at budget 4 (no entropies recorded: the title says H = –); saliency-only alone at budget 8
    "figE1_pair": [BASELINE, trial("fixed_ratio", 4, scores(0.7, 0.5), options={"saliency_ratio": 0.5},
                                   predictions=preds(FIXED)),
                   trial("promprune", 4, scores(0.8, 0.6), predictions=preds(PROMPRUNE)),
                   trial("saliency_only", 8, scores(0.7, 0.5), predictions=preds(SALIENCY))],
    # never two at one budget with predictions: coverage-only at 4 logged none
    "figE1_none": [BASELINE, trial("promprune", 4, scores(0.8, 0.6), predictions=preds(PROMPRUNE)),
                   trial("saliency_only", 8, scores(0.7, 0.5), predictions=preds(SALIENCY)),
                   trial("coverage_only", 4, scores(0.7, 0.5))],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{sweep name: (sweep, report)} built from one real SQLite MLflow store."""
    tmp = tmp_path_factory.mktemp("figE1")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        try:
            client = MlflowClient(uri)
            exp = client.create_experiment("promprune", artifact_location=(tmp / "artifacts").as_uri())
            out = {}
            for name, trials in SWEEPS.items():
                sweep = load_sweep(log_sweep(client, exp, name, trials, tasks=TASKS, tmp=tmp))
                out[name] = sweep, build_report(sweep, tmp / name, image_source=image_of)
        finally:
            mlflow.set_tracking_uri(None)
    return out


def test_side_by_side_rows_panels_and_colours(reports):
    _, report = reports["figE1_demo"]
    path = report.out_dir / side_by_side.FILENAME
    assert path in report.files and f"![figE1_overlays]({side_by_side.FILENAME})" in report.markdown
    assert "## Token selections side by side (Fig. E1), 4 tokens" in report.markdown
    assert "Saliency only, Coverage only, PromPrune:" in report.markdown
    img, boxes = panels(path)
    assert len(boxes) == 3 * 3  # 3 documents x 3 methods
    rows = [sorted(boxes[i:i + 3], key=lambda b: b[1]) for i in range(0, 9, 3)]
    for row, doc in zip(rows, [("pope", 1), ("gqa", 0), ("pope", 0)]):  # the ranking below
        for box, method in zip(row, [SALIENCY, COVERAGE, PROMPRUNE]):  # the paper's left-to-right order
            salient, coverage = method[doc]
            want = ["red" if i in salient else "cyan" if i in coverage else "dim" for i in range(GRID)]
            assert [colour(cell(img, box, i)) for i in range(GRID)] == want, (doc, method is PROMPRUNE)


def test_ranking_and_entropy():
    frames = {m: pd.DataFrame(preds(d, ENTROPY if m == "promprune" else None))
              for m, d in [("saliency_only", SALIENCY), ("coverage_only", COVERAGE), ("promprune", PROMPRUNE)]}
    docs = side_by_side.panels_by_document(frames, {m: m for m in frames})
    assert side_by_side.rank_documents(docs) == [("pope", "1"), ("gqa", "0"), ("pope", "0"), ("gqa", "1")]
    assert side_by_side.entropy_of(docs[("gqa", "0")]) == 0.39  # PromPrune's record; the others have none
    assert docs[("pope", "1")]["promprune"].split == 0.5 and docs[("pope", "1")]["coverage_only"].split == 0.0
    # without PromPrune: by how different the kept tokens are (identical everywhere here: task, then doc order)
    docs = side_by_side.panels_by_document({m: frames[m] for m in ("saliency_only", "coverage_only")},
                                           {"saliency_only": "s", "coverage_only": "c"})
    assert side_by_side.rank_documents(docs) == [("gqa", "0"), ("pope", "0"), ("gqa", "1"), ("pope", "1")]


def test_two_methods_at_one_budget_give_two_panels(reports):
    _, report = reports["figE1_pair"]
    img, boxes = panels(report.out_dir / side_by_side.FILENAME)
    assert len(boxes) == 3 * 2
    first = min(boxes, key=lambda b: (b[0] // 20, b[1]))  # top-left panel: the fixed split
    assert [colour(cell(img, first, i)) for i in (0, 1, 5, 14, 15)] == ["red", "red", "dim", "cyan", "cyan"]
    assert "Fixed split, PromPrune:" in report.markdown


def test_no_figure_without_two_methods_at_one_budget(reports):
    sweep, report = reports["figE1_none"]
    assert not (report.out_dir / side_by_side.FILENAME).exists() and "Fig. E1" not in report.markdown
    table = tables.build_score_table(sweep)
    with_tokens = {rid for rid in table.frame.index if table.frame.loc[rid, "method"] != "coverage_only"}
    assert side_by_side.comparison_trials(table.frame, with_tokens.__contains__) is None
    with_tokens = set(table.frame.index)  # had coverage-only logged predictions, it and PromPrune would qualify
    budget, trials = side_by_side.comparison_trials(table.frame, with_tokens.__contains__)
    assert budget == 4 and list(trials) == ["coverage_only", "promprune"]
