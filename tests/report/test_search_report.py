"""The report of a search, from a real SQLite MLflow store: trials in the (mu, tau) plane with the stopped ones
marked and never taken for finished ones, the best point with its bootstrap interval, the grid beside it, and each
method's paired difference to the best other (hand-worked on easy-vqa's exact match)."""
from __future__ import annotations

import re

import matplotlib.colors
import pandas as pd
import pytest
from PIL import Image

from pipelines import mlflow_layout
from pipelines.reporting import figures
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


def test_each_method_against_the_best_other_with_a_paired_interval(searched, tmp_path, monkeypatch):
    """PromPrune's best is wrong on documents 0-5, DivPrune on 0-9, the baseline on none: PromPrune - DivPrune =
    +4/30 = +13.3 points, and on every resample PromPrune scores at least as DivPrune (lower bound >= 0)."""
    md = build_report(searched, tmp_path / "out").markdown
    lines = section(md, "Paired differences").strip().splitlines()
    pairs = [line for line in lines if line.startswith("- 16 tokens:")]
    assert len(pairs) == 2
    # each trial by its label (PromPrune's best of four: mu=0.3, tau=0.03), never by its 32-character run id
    ours = next(p for p in pairs if p.startswith("- 16 tokens: PromPrune (mu=0.3, tau=0.03) - DivPrune: +13.3 ["))
    theirs = next(p for p in pairs if p.startswith("- 16 tokens: DivPrune - PromPrune (mu=0.3, tau=0.03): -13.3 ["))
    assert ours.endswith("points (resolved)")
    low = float(ours.split("[")[1].split(",")[0])
    assert low >= 0
    assert not re.search(r"[0-9a-f]{32}", section(md, "Paired differences"))
    assert theirs
    assert "resampled 1000 times" in md  # a sweep that logged no `bootstrap` param: the report's own count


    # the spec's `bootstrap` (a param of the parent run): the resamples of the intervals the console printed and the
    # parent run's best/* metrics hold (the report drew 1000 whatever the spec said)
    import dataclasses
    import inspect

    from pipelines.reporting import paired

    drawn, real = [], paired.bootstrap

    def counted(*args, **kwargs):  # every interval's resamples (positional from `differences`, named from the plane)
        drawn.append(inspect.signature(real).bind(*args, **kwargs).arguments.get("iters"))
        return real(*args, **kwargs)

    monkeypatch.setattr(paired, "bootstrap", counted)
    md = build_report(dataclasses.replace(searched, bootstrap=200), tmp_path / "b200").markdown
    assert "resampled 200 times" in md and "200 resamples" in section(md, "The (mu, tau) plane")
    assert len(drawn) >= 2 and set(drawn) == {200}


def _figures_made(monkeypatch) -> dict:
    """{file name: matplotlib figure} of every figure the report saves (saved as well)."""
    made, save = {}, figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, path: made.setdefault(path.name, fig) and save(fig, path))
    return made


def test_stopped_trials_are_hollow_grey_and_off_the_colour_scale(searched, tmp_path, monkeypatch):
    """The stopped trial's running Rel. (99%) would top the scale: it is drawn apart, hollow and grey, and the
    colour scale spans the finished trials' Rel. only: 20/30 = 66.7% to 24/30 = 80.0% (the grid beside it too)."""
    made = _figures_made(monkeypatch)
    md = build_report(searched, tmp_path / "out").markdown
    assert "1 stopped early by ASHA (hollow grey circles, off the colour scale" in md
    fig = made["mu_tau_search.png"]
    plane, heat = fig.axes[0], fig.axes[1]  # (then their colour bars)
    finished, stopped = plane.collections[0], plane.collections[1]
    assert sorted(finished.get_array()) == pytest.approx([200 / 3, 70.0, 220 / 3, 80.0])
    assert (finished.norm.vmin, finished.norm.vmax) == pytest.approx((200 / 3, 80.0))
    assert stopped.get_array() is None and stopped.get_offsets().tolist() == [[0.02, 0.25]]
    assert stopped.get_facecolors().size == 0 or stopped.get_facecolors()[0][3] == 0  # hollow
    assert matplotlib.colors.to_hex(stopped.get_edgecolors()[0]) == matplotlib.colors.to_hex(figures.STOPPED_GREY)
    assert (heat.images[0].norm.vmin, heat.images[0].norm.vmax) == pytest.approx((200 / 3, 80.0))


def test_a_sparse_search_gets_no_heatmap(store, tmp_path, monkeypatch):
    """Three finished points in an L, (0.2, 0.01), (0.3, 0.01), (0.3, 0.03), make no grid: the plane alone, and no
    Fig. 5 heatmap of three cells."""
    client, exp = store
    sparse = [SEARCH[0], pp(0.2, 0.01, 20), pp(0.3, 0.01, 21), pp(0.3, 0.03, 24), SEARCH[5]]
    log_sweep(client, exp, "sparse_demo", sparse, tasks=[TASK], tmp=tmp_path)
    made = _figures_made(monkeypatch)
    report = build_report(load_sweep("sparse_demo"), tmp_path / "out")
    assert len(made["mu_tau_search.png"].axes) == 2  # the plane and its colour bar
    assert "mu_tau_heatmap.png" not in made and "beside it" not in report.markdown
    assert "- best (mu, tau): **mu=0.3, tau=0.03**, Rel. 80.0%" in report.markdown


def test_a_search_without_an_unpruned_trial_says_why_it_has_no_plane(store, tmp_path):
    """`baseline: false` over a (mu, tau) grid: no Rel. to place the points by; the section was silently missing."""
    client, exp = store
    log_sweep(client, exp, "no_base", [pp(0.2, 0.01, 20), pp(0.3, 0.01, 21), pp(0.3, 0.03, 24)], tasks=[TASK],
              tmp=tmp_path)
    md = build_report(load_sweep("no_base"), tmp_path / "out").markdown
    assert "Not drawn: the sweep has no unpruned trial (`baseline: false`)" in section(md, "The (mu, tau) plane")


def test_a_grid_needs_two_mu_and_two_tau_with_all_four_cells():
    nan = float("nan")
    grid = pd.DataFrame([[1.0, 2.0, nan], [3.0, 4.0, nan]], index=[0.2, 0.3], columns=[0.01, 0.02, 0.03])
    ell = pd.DataFrame([[1.0, nan], [3.0, 4.0]], index=[0.2, 0.3], columns=[0.01, 0.03])
    diagonal = pd.DataFrame([[1.0, nan, nan], [nan, 2.0, nan], [nan, nan, 3.0]])
    assert figures.is_grid(grid)
    assert not figures.is_grid(ell) and not figures.is_grid(diagonal) and not figures.is_grid(None)
    assert not figures.is_grid(pd.DataFrame([[1.0, 2.0, 3.0]]))  # one mu


def test_a_grid_beside_a_sweep_that_is_no_search_is_a_note(store, tmp_path, capsys):
    """--grid with a sweep of fewer than two (mu, tau) points (a method comparison): one line in report.md and on
    the console of pipelines/report.py saying the grid was not drawn, and why (it was silently ignored)."""
    from pipelines import report as report_cli

    client, exp = store
    log_sweep(client, exp, "methods_demo", [SEARCH[0], SEARCH[6]], tasks=[TASK], tmp=tmp_path)
    log_sweep(client, exp, "grid_demo", [SEARCH[0], pp(0.2, 0.01, 20), pp(0.3, 0.03, 24)], tasks=[TASK],
              tmp=tmp_path)
    note = ("Note: --grid `grid_demo` was not drawn: sweep `methods_demo` is not a (mu, tau) search (0 scored (mu, "
            "tau) point(s); the grid is drawn beside a search of two or more).")
    assert report_cli.main(["--sweep", "methods_demo", "--grid", "grid_demo", "--no-log",
                            "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines().count(note) == 1
    assert (tmp_path / "out" / "report.md").read_text().splitlines().count(note) == 1
    assert not (tmp_path / "out" / "mu_tau_search.png").exists()
    assert note not in build_report(load_sweep("methods_demo"), tmp_path / "alone").markdown  # no --grid: no note


def arm(metric, mu, right: int, tau=None):
    options = {"metric": metric} | ({} if mu is None else {"mu": mu}) | ({} if tau is None else {"tau": tau})
    return trial("promprune", 16, {f"{TASK}/exact_match": right / N, "samples/total": N}, options=options)


def test_per_metric_calibrated_mus_are_no_search(store, tmp_path):
    """Fig. 4: one trial per prominence metric, each with its own calibrated mu (feature-norm 0.9978, attention
    0.9818; spectral at its default). Those mus lie on different metrics' scales: no (mu, tau) plane and no "best
    (mu, tau)" (the report named attention's mu the best against feature-norm's)."""
    client, exp = store
    log_sweep(client, exp, "fig4_demo", [SEARCH[0], arm("spectral", None, 24), arm("feature_norm", 0.9978, 20),
                                         arm("attention", 0.9818, 22)], tasks=[TASK], tmp=tmp_path)
    report = build_report(load_sweep("fig4_demo"), tmp_path / "out")
    assert "(mu, tau) plane" not in report.markdown and "best (mu, tau)" not in report.markdown
    assert not (tmp_path / "out" / "mu_tau_search.png").exists()
    log_sweep(client, exp, "grid_demo", [SEARCH[0], pp(0.2, 0.01, 20), pp(0.3, 0.03, 24)], tasks=[TASK], tmp=tmp_path)
    noted = build_report(load_sweep("fig4_demo"), tmp_path / "vs", grid=load_sweep("grid_demo")).markdown
    assert ("Note: --grid `grid_demo` was not drawn: sweep `fig4_demo` is not a (mu, tau) search (its 2 scored "
            "(mu, tau) points differ in more than mu and tau;") in noted


def test_a_search_per_metric_and_an_unset_metric_is_the_default(store, tmp_path):
    """Two metrics each searched over two mu: one plane each, its best among its own metric's trials. A trial that
    leaves `metric` unset runs the default (spectral) and is a point of the spectral search. By hand: spectral best
    mu=0.4 (24/30 = 80.0%), attention best mu=0.9 (27/30 = 90.0%)."""
    client, exp = store
    log_sweep(client, exp, "two_searches", [
        SEARCH[0], arm("spectral", 0.3, 21, tau=0.02), pp(0.4, 0.02, 24), arm("attention", 0.8, 20, tau=0.02),
        arm("attention", 0.9, 27, tau=0.02)], tasks=[TASK], tmp=tmp_path)
    md = build_report(load_sweep("two_searches"), tmp_path / "out").markdown
    spectral = section(md, "The (mu, tau) plane: PromPrune, 16 tokens, metric=spectral")
    attention = section(md, "The (mu, tau) plane: PromPrune, 16 tokens, metric=attention")
    assert "- best (mu, tau): **mu=0.4, tau=0.02**, Rel. 80.0%" in spectral and "- trials: 2" in spectral
    assert "- best (mu, tau): **mu=0.9, tau=0.02**, Rel. 90.0%" in attention and "- trials: 2" in attention
    assert "2 other trial(s) that set mu or tau with other options are not in this plane" in spectral
    assert (tmp_path / "out" / "mu_tau_search_1.png").exists() and (tmp_path / "out" / "mu_tau_search_2.png").exists()


def _repeat(method, budget, right: int | None, r: int, status="FINISHED", **kw):
    """Run ``r`` of a configuration a grid ran twice (param ``repeat``): ``right`` of N right (None: no score, as a
    run that failed logs), its answers the first ``N - right`` wrong."""
    tid = ("baseline" if method == "none" else f"{method}-b{budget}") + (f"-r{r}" if r else "")
    metrics = {"samples/done": 10} if right is None else {f"{TASK}/exact_match": right / N, "samples/total": N}
    preds = None if right is None else answers(N - right)
    return trial(method, budget, metrics, options={"repeat": r}, tid=tid, status=status, predictions=preds, **kw)


def test_a_repeated_configuration_is_its_first_finished_run_when_an_earlier_repeat_failed(store, tmp_path):
    """A grid run twice (`tune.num_samples: 2`). PromPrune@16: repeat 0 FAILED (no score, no predictions, 10 samples
    done), repeat 1 finished 24 of 30 right. Its row is repeat 1's: its id, status and answers, so the paired
    interval pairs by them (PromPrune wrong on documents 0-5, DivPrune on 0-9 in both its runs: +4/30 = +13.3
    points, as in the search above); its numbers are the mean of its finished runs only (80.0, n=1; not the failed
    run's samples/done). DivPrune@8 failed both times: a row not FINISHED, dashes, and no paired interval at 8."""
    client, exp = store
    run = _repeat
    log_sweep(client, exp, "repeat_failed", [
        run("none", None, N, 0), run("none", None, N, 1),
        run("promprune", 16, None, 0, status="FAILED"), run("promprune", 16, 24, 1),
        run("divprune", 16, 20, 0), run("divprune", 16, 20, 1),
        run("promprune", 8, 15, 0), run("promprune", 8, 15, 1),
        run("divprune", 8, None, 0, status="FAILED"), run("divprune", 8, None, 1, status="FAILED")],
        tasks=[TASK], tmp=tmp_path)
    ids = {r.data.tags["promprune.trial"]: r.info.run_id for r in client.search_runs([exp])
           if "promprune.trial" in r.data.tags}
    sweep = load_sweep("repeat_failed")
    merged = sweep.mean_over_repeats()
    rows = merged.trials.set_index("trial")
    assert sorted(rows.index) == ["baseline", "divprune-b16", "divprune-b8", "promprune-b16-r1", "promprune-b8"]
    assert merged.trials.loc[ids["promprune-b16-r1"], "status"] == "FINISHED"
    assert merged.trials.loc[ids["divprune-b8"], "status"] == "FAILED"  # none finished: its lowest repeat
    assert merged.metrics.loc[ids["promprune-b16-r1"], f"{TASK}/exact_match"] == pytest.approx(0.8)
    assert pd.isna(merged.metrics.loc[ids["promprune-b16-r1"], "samples/done"])  # the failed run's not averaged in
    assert list(merged.repeat_metrics[ids["promprune-b16-r1"]].index) == [ids["promprune-b16-r1"]]

    out = tmp_path / "out"
    md = build_report(sweep, out).markdown
    pairs = [line for line in section(md, "Paired differences").splitlines() if line.startswith("- ")]
    assert len(pairs) == 2 and all(p.startswith("- 16 tokens: ") for p in pairs)  # nothing at 8: DivPrune failed
    ours = next(p for p in pairs if p.startswith("- 16 tokens: PromPrune - DivPrune: +13.3 ["))
    assert 0 <= float(ours.split("[")[1].split(",")[0]) and ours.endswith("(resolved)")
    assert "paired by the answers of its first finished run" in md
    scores = section(md, "Scores")
    assert "| PromPrune | 16 | **80.0**, n=1 | **80.0%**, n=1 |" in scores, scores
    assert "| DivPrune | 8 | – | – |" in scores, scores
    csv = pd.read_csv(out / "scores.csv").set_index("run_id")
    assert ids["promprune-b16-r1"] in csv.index and ids["promprune-b16"] not in csv.index
    assert ids["divprune-b8"] in csv.index


def wrong_on(docs: range) -> list[dict]:
    """Predictions of all N documents, those in ``docs`` answered wrongly."""
    return [row | {"prediction": "zzz"} if row["doc_id"] in docs else row for row in answers(0)]


def test_ties_go_to_the_same_trials_on_the_console_and_in_the_report(store, tmp_path):
    """Probe Q: with every Rel. tied, the console (rows in the spec's order) said "PromPrune - DivPrune" and the
    report (the paper's order) "PromPrune - VisPruner": the best other was the first row of those tied. Ties go to
    the first method in the paper's order, and a method's tied trials to the least trial id, in both."""
    from pipelines import spec as specs
    from pipelines.recording.console import paired_lines

    exact = {f"{TASK}/exact_match": 24 / N, "samples/total": N}
    # each wrong on 6 documents (Rel. 80% for all), different ones: which trial is paired changes the interval
    logged = {"divprune-b16": wrong_on(range(0, 6)), "vispruner-b16": wrong_on(range(6, 12)),
              "promprune-b16-mu=0.4": wrong_on(range(12, 18)), "promprune-b16-mu=0.3": wrong_on(range(18, 24))}
    trials = [trial("none", None, {f"{TASK}/exact_match": 1.0, "samples/total": N}, predictions=answers(0))]
    for tid, rows in logged.items():
        method, mu = tid.split("-")[0], (float(tid.split("=")[1]) if "mu=" in tid else None)
        trials.append(trial(method, 16, exact, options={"mu": mu} if mu else None, predictions=rows, tid=tid))
    client, exp = store
    log_sweep(client, exp, "ties_demo", trials, tasks=[TASK], tmp=tmp_path)
    report = section(build_report(load_sweep("ties_demo"), tmp_path / "out").markdown, "Paired differences")
    shown = [line.removeprefix("- 16 tokens: ").replace(" (mu=0.3)", "").split(" points")[0]
             for line in report.splitlines() if line.startswith("- 16 tokens:")]
    assert [line.split(":")[0] for line in shown] == [
        "VisPruner - DivPrune", "DivPrune - VisPruner", "PromPrune - VisPruner"]
    assert "(mu=0.3) - VisPruner" in report  # PromPrune's trials tie: the least id, not the first in the table

    # the console's lines, from the records in the spec's order (DivPrune first, mu=0.4 first); the report's resamples
    spec = specs.parse({"name": "ties_demo", "version": 1, "tasks": [TASK], "bootstrap": 1000, "trials": [
        {"method": "divprune", "budget": 16}, {"method": "vispruner", "budget": 16},
        {"method": "promprune", "budget": 16, "mu": 0.4}, {"method": "promprune", "budget": 16, "mu": 0.3}]})
    records = {tid: {"trial": {"method": tid.split("-")[0], "budget": 16}, "error": None,
                     "metrics": {"rel": 0.8}, "predictions": pd.DataFrame(rows)} for tid, rows in logged.items()}
    records["baseline"] = {"trial": {"method": None, "budget": None}, "error": None, "metrics": {"rel": 1.0},
                           "predictions": pd.DataFrame(answers(0))}
    console = [line.removeprefix("  16 tokens: ").split(" points")[0] for line in paired_lines(spec, records)[1:]]
    assert [line.split(":")[0] for line in console] == [
        "DivPrune - VisPruner", "VisPruner - DivPrune", "PromPrune - VisPruner"]
    assert sorted(console) == sorted(shown)  # the same pairs, so the same intervals (mu=0.3's, not mu=0.4's)
