"""The report of a search, from a real SQLite MLflow store: trials in the (mu, tau) plane with the stopped ones
marked and never taken for finished ones, the best point with its bootstrap interval, the grid beside it, and each
method's paired difference to the best other (hand-worked on easy-vqa's exact match)."""
from __future__ import annotations

import pytest
from PIL import Image

from pipelines import mlflow_layout
from pipelines.reporting.build import build_report
from pipelines.reporting.store import load_sweep
from promprune.eval.tasks import load_task

from .conftest import log_sweep, trial

TASK = "easyvqa_open"
N = 30
TRUTH = list(load_task(TASK).eval_docs_no_media["answer"][:N])


def answers(wrong: int) -> list[dict]:
    """Predictions of all N documents, the first ``wrong`` of them answered wrongly."""
    return [{"task": TASK, "doc_id": i, "n_docs": N, "prediction": "zzz" if i < wrong else TRUTH[i], "error": None}
            for i in range(N)]


def pp(mu, tau, right: int, **kw):
    return trial("promprune", 16, {f"{TASK}/exact_match": right / N, "samples/total": N},
                 options={"mu": mu, "tau": tau}, **kw)


STOPPED = {mlflow_layout.STOPPED: "stopped by ASHA at 10 of 30 samples"}
# Rel. = exact match / the baseline's 1.0. The stopped trial's running Rel. (99%) beats every finished one: the
# report must still name mu=0.3, tau=0.03 (24 of 30 right, 80%) the best.
SEARCH = [
    trial("none", None, {f"{TASK}/exact_match": 1.0, "samples/total": N}, predictions=answers(0)),
    pp(0.2, 0.01, 20), pp(0.2, 0.03, 22), pp(0.3, 0.01, 21), pp(0.3, 0.03, 24, predictions=answers(6)),
    pp(0.25, 0.02, 0, status="KILLED", tags=STOPPED, tid="promprune-b16-mu=0.25-tau=0.02") | {
        "metrics": {f"{mlflow_layout.RUNNING}/rel": 0.99, "samples/done": 10, "samples/scored": 10,
                    "samples/total": N}},
    trial("divprune", 16, {f"{TASK}/exact_match": 20 / N, "samples/total": N}, predictions=answers(10)),
]


@pytest.fixture
def searched(store, tmp_path):
    client, exp = store
    log_sweep(client, exp, "search_demo", SEARCH, tasks=[TASK], tmp=tmp_path,
              parent_metrics={mlflow_layout.GENERATED: 150})
    return load_sweep("search_demo")


def section(markdown: str, title: str) -> str:
    return markdown.split(f"## {title}")[1].split("\n## ")[0]


def test_stopped_trials_are_drawn_not_tabled_and_never_the_best(searched, tmp_path):
    report = build_report(searched, tmp_path / "out")
    md = report.markdown
    assert "trials stopped early by the search's scheduler (ASHA): 1" in md
    scores = section(md, "Scores")
    assert "mu=0.25" not in scores and scores.count("PromPrune (") == 4  # the four finished ones only
    found = section(md, "The (mu, tau) plane")
    assert "- trials: 5, 1 stopped early by ASHA" in found
    assert "- best (mu, tau): **mu=0.3, tau=0.03**, Rel. 80.0% [" in found
    assert "(`promprune-b16-mu=0.3-tau=0.03`)" in found and "- samples generated: 150" in found
    # the interval: Rel. = (30 - wrong answers drawn among documents 0-5) / 30 per resample; it holds 80%
    low, high = (float(x) for x in found.split("80.0% [")[1].split("]")[0].split(", "))
    assert 60 < low < 80 < high < 95
    png = tmp_path / "out" / "mu_tau_search.png"
    assert png in report.files and png.read_bytes().startswith(b"\x89PNG")
    one_panel = 5.8 * 120  # inches x DPI
    assert Image.open(png).size[0] > 1.5 * one_panel  # the four finished trials form a 2 x 2 grid: its heatmap too

    # with a grid sweep to compare with: its heatmap beside the plane, and the verdict
    client = __import__("mlflow").tracking.MlflowClient()
    grid = [trial("none", None, {f"{TASK}/exact_match": 1.0, "samples/total": N}, predictions=answers(0))] + [
        pp(mu, tau, right, predictions=answers(N - right) if right == 25 else None)
        for (mu, tau), right in {(0.2, 0.01): 19, (0.2, 0.03): 25, (0.3, 0.01): 23, (0.3, 0.03): 18}.items()]
    exp = client.get_experiment_by_name("promprune").experiment_id
    log_sweep(client, exp, "grid_demo", grid, tasks=[TASK], tmp=tmp_path)
    both = build_report(searched, tmp_path / "vs", grid=load_sweep("grid_demo"))
    versus = section(both.markdown, "The (mu, tau) plane")
    assert "- grid `grid_demo`: best **mu=0.2, tau=0.03**, Rel. 83.3% [" in versus
    assert "; 150 samples generated" in versus  # the grid's own: 5 trials x 30
    assert "lies **inside** the grid best's interval" in versus and "with 150 samples: 100% of the grid's 150" in \
        versus
    assert Image.open(tmp_path / "vs" / "mu_tau_search.png").size[0] > 1.5 * one_panel  # the grid's heatmap


def test_each_method_against_the_best_other_with_a_paired_interval(searched, tmp_path):
    """PromPrune's best is wrong on documents 0-5, DivPrune on 0-9, the baseline on none: PromPrune - DivPrune =
    +4/30 = +13.3 points, and on every resample PromPrune scores at least as DivPrune (lower bound >= 0)."""
    md = build_report(searched, tmp_path / "out").markdown
    lines = section(md, "Paired differences").strip().splitlines()
    pairs = [line for line in lines if line.startswith("- 16 tokens:")]
    assert len(pairs) == 2
    ours = next(p for p in pairs if "PromPrune - DivPrune" in p)
    theirs = next(p for p in pairs if "DivPrune - PromPrune" in p)
    assert "PromPrune - DivPrune: +13.3 [" in ours and "(resolved;" in ours
    low = float(ours.split("[")[1].split(",")[0])
    assert low >= 0
    assert "DivPrune - PromPrune: -13.3 [" in theirs
