"""Sweep-shape-specific parts: Table 4's matched split, Fig. 1a's ratio curves, Fig. 5's heatmap, mu calibration,
Table 6 against the shipped published numbers."""
from __future__ import annotations

import pandas as pd
import pytest

from pipelines.reporting.build import build_report, choose_mu, log_report
from pipelines.reporting.published import PAPER_DIR
from pipelines.reporting.store import load_sweep

from .conftest import log_sweep, trial


def grey_image(task, doc_id):
    import numpy as np

    return np.full((32, 32, 3), 128, dtype=np.uint8), ""


def pred(task, doc, entropy, n_sal):
    return {"task": task, "doc_id": str(doc), "prediction": "yes", "error": None, "entropy": entropy,
            "saliency_count": float(n_sal), "visual_tokens": 64.0, "kept": list(range(64)), "timings": "{}"}


def test_table4_matched_split_interpolates_at_each_benchmarks_mean_t_sal(store, tmp_path, monkeypatch):
    from pipelines.reporting import figures

    drawn, save = {}, figures._save

    def stars_then_save(fig, path):  # each figure's star markers' x positions, by file name
        drawn[path.name] = [line.get_xdata()[0] for ax in fig.axes for line in ax.get_lines()
                            if line.get_marker() == "*"]
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", stars_then_save)
    client, exp = store
    fixed = {0.25: (0.70, 0.50), 0.5: (0.80, 0.60), 0.75: (0.78, 0.58)}  # ratio -> (pope F1, gqa EM)
    trials = [trial("fixed_ratio", 64, {"pope/pope_f1_score": p, "gqa/exact_match": g},
                    options={"saliency_ratio": r}) for r, (p, g) in fixed.items()]
    # adaptive: pope T_sal 40 and 24 -> mean 32 -> ratio 0.5 (a grid point); gqa 20, 20 -> ratio 0.3125
    trials.append(trial("promprune", 64, {"pope/pope_f1_score": 0.81, "gqa/exact_match": 0.56, "t_sal/mean": 26},
                        predictions=[pred("pope", 0, 0.4, 40), pred("pope", 1, 0.4, 24),
                                     pred("gqa", 0, 0.5, 20), pred("gqa", 1, 0.5, 20)]))
    parent = log_sweep(client, exp, "table4_demo", trials, tasks=["pope", "gqa"], tmp=tmp_path)
    report = build_report(load_sweep(parent), tmp_path / "out", image_source=grey_image)
    matched = pd.read_csv(tmp_path / "out" / "matched_split_b64.csv").set_index("task")
    assert matched.loc["pope", "ratio"] == pytest.approx(0.5)
    assert matched.loc["pope", "fixed_interp"] == pytest.approx(80.0)
    assert matched.loc["pope", "delta"] == pytest.approx(1.0)
    # gqa: 0.3125 is a quarter of the way from 0.25 (50.0) to 0.5 (60.0): 52.5; nearest grid ratio 0.25
    assert matched.loc["gqa", "ratio"] == pytest.approx(0.3125)
    assert matched.loc["gqa", "fixed_interp"] == pytest.approx(52.5)
    assert matched.loc["gqa", "nearest_ratio"] == pytest.approx(0.25)
    assert matched.loc["gqa", "delta"] == pytest.approx(56.0 - 52.5)
    assert not matched["clamped"].any() and "outside the grid" not in report.markdown
    # a matched ratio past the grid (0.9 > 0.75): held at its end, and the table says so
    from pipelines.reporting import tables

    sweep = load_sweep(parent)
    table = tables.build_score_table(sweep)
    frame = table.frame.join(sweep.trials[["saliency_ratio"]])
    aid = frame.index[frame["method"] == "promprune"][0]
    beyond = tables.matched_split_table(table, aid, frame[frame["method"] == "fixed_ratio"], {"pope": 57.6, "gqa": 20},
                                        64)
    assert beyond.set_index("task").loc["pope", "clamped"]
    assert "(outside the grid: its end, 0.75)" in tables.matched_split_markdown(beyond)
    assert "saliency_ratio.png" in {p.name for p in report.files}
    # Fig. 1a's stars: each benchmark at its own mean T_sal / T (all sat at the pooled t_sal/mean, 26 / 64)
    assert sorted(drawn["saliency_ratio.png"]) == [pytest.approx(0.3125), pytest.approx(0.5)]
    assert "Fixed split (saliency_ratio=0.25)" in report.markdown  # rows named by the varying option


def test_mu_tau_heatmap_and_calibration_logged_on_the_parent(store, tmp_path):
    client, exp = store
    # Rel. per (mu, tau): the best, 100 %, is reached at mu 0.40 and 0.44; the calibration images' median (logged by
    # an earlier mu_calibration sweep on the same model) is 0.43, so 0.44 wins. The benchmark documents' median
    # entropy, 0.41, which the tie-break used to take, would pick 0.40.
    calibrated = log_sweep(client, exp, "mu_calibration", [trial("promprune", 64, {"pope/pope_f1_score": 0.8},
                                                                  options={"mu": 0.43})], tasks=["pope"], tmp=tmp_path,
                           parent_metrics={"calibration/median_spectral": 0.43, "calibration/images": 1000})
    other = log_sweep(client, exp, "mu_calibration", [trial("promprune", 64, {"pope/pope_f1_score": 0.8},
                                                             options={"mu": 0.39})], tasks=["pope"], tmp=tmp_path,
                      model="another:model", parent_metrics={"calibration/median_spectral": 0.39})
    client.log_param(calibrated, "model", "tiny:llava")
    client.log_param(other, "model", "another:model")  # the latest, but another model's encoder
    # the latest on this model, but calibrated on another token grid (adapter options differ): passed over
    regridded = log_sweep(client, exp, "mu_calibration", [trial("promprune", 64, {"pope/pope_f1_score": 0.8},
                                                                 options={"mu": 0.41})], tasks=["pope"], tmp=tmp_path,
                          parent_metrics={"calibration/median_spectral": 0.41})
    client.log_param(regridded, "model", "tiny:llava")
    client.log_param(regridded, "model_options", '{"image_tokens": 64}')
    client.log_param(calibrated, "model_options", "{}")
    rel = {(0.40, 0.01): 1.00, (0.40, 0.02): 0.90, (0.42, 0.01): 0.95, (0.42, 0.02): 0.95,
           (0.44, 0.01): 0.90, (0.44, 0.02): 1.00}
    trials = [trial("none", None, {"pope/pope_f1_score": 0.80})]
    for (mu, tau), r in rel.items():
        preds = [pred("pope", d, e, 30) for d, e in enumerate([0.39, 0.41, 0.43])]
        trials.append(trial("promprune", 64, {"pope/pope_f1_score": 0.80 * r},
                            options={"mu": mu, "tau": tau}, predictions=preds))
    trials.append(trial("vispruner", 64, {"pope/pope_f1_score": 0.76}))  # Rel. 95 %: the heatmap's reference
    parent = log_sweep(client, exp, "mu_calibration_grid", trials, tasks=["pope"], tmp=tmp_path)
    client.log_param(parent, "model_options", "{}")  # as the sweep logs it on its parent run
    sweep = load_sweep(parent)
    report = build_report(sweep, tmp_path / "out", image_source=grey_image)
    assert {"mu_tau_heatmap.png", "entropy_histograms.png"} <= {p.name for p in report.files}
    assert report.calibration == {"calibration/chosen_mu": pytest.approx(0.44)}  # no median of its own to log
    assert (f"- median spectral entropy over the calibration images (1000): **0.4300** (`calibration/median_spectral`"
            f", measured by sweep mu_calibration, run {calibrated}, on the same model and adapter options)") \
        in report.markdown
    log_report(sweep, report, client)
    run = client.get_run(parent)
    assert run.data.metrics["calibration/chosen_mu"] == pytest.approx(0.44)
    assert run.data.tags["promprune.calibrated_mu"] == "0.44"
    assert "calibration/median_entropy" not in run.data.metrics


def test_the_calibration_median_is_the_calibration_images_not_the_benchmark_documents(store, tmp_path):
    """A probe's case: a `mu: calibrate` sweep's report gave "median spectral entropy over the calibration images:
    0.1712", the median over the benchmark documents a PromPrune trial answered; the calibration images' median, the
    mu the trials ran with, was the parent run's calibration/median_spectral, 0.2419. An old store's
    calibration/median_entropy (what reports logged) is not read."""
    client, exp = store
    trials = [trial("none", None, {"pope/pope_f1_score": 0.80})]
    for budget in (16, 32):
        preds = [pred("pope", d, e, 30) for d, e in enumerate([0.15, 0.1712, 0.20])]
        trials.append(trial("promprune", budget, {"pope/pope_f1_score": 0.80}, options={"mu": 0.2419},
                            predictions=preds))
    parent = log_sweep(client, exp, "probe_calibration", trials, tasks=["pope"], tmp=tmp_path,
                       parent_metrics={"calibration/median_spectral": 0.2419, "calibration/images": 3,
                                       "calibration/median_entropy": 0.1712})
    report = build_report(load_sweep(parent), tmp_path / "out", image_source=grey_image)
    section = report.markdown.split("## mu calibration")[1].split("##")[0]
    assert section.strip() == ("- median spectral entropy over the calibration images (3): **0.2419** "
                               "(`calibration/median_spectral`, measured by this sweep's `mu: calibrate`)")
    assert report.calibration == {}  # nothing to log: the medians are the sweep's own


@pytest.mark.parametrize("halfwidths", [(None, None, None), (0.0, 4e-4, 1.5e-3)], ids=["exact", "bracketed"])
def test_the_widest_entropy_bracket_of_a_trial(halfwidths):
    from pipelines.reporting import figures

    frame = pd.DataFrame({"entropy_halfwidth": list(halfwidths)}, dtype=float)
    assert figures.entropy_halfwidth(frame) == (halfwidths[-1] or 0.0)  # the widest, NaN (exact) as 0
    assert figures.entropy_halfwidth(pd.DataFrame({"entropy": [0.4]})) == 0.0  # a run before the column


def test_choose_mu_tie_break_without_a_median_takes_the_smaller():
    frame = pd.DataFrame({"method": ["promprune"] * 3, "mu": [0.44, 0.40, 0.42], "rel": [99.0, 99.0, 90.0]})
    assert choose_mu(frame, float("nan")) == pytest.approx(0.40)
    assert choose_mu(frame, 0.445) == pytest.approx(0.44)
    assert choose_mu(frame.iloc[:1], 0.4) is None  # one mu: nothing was searched


def test_table6_against_the_shipped_published_numbers(store, tmp_path):
    client, exp = store

    def eff(n, tf, kv, ms):
        return {"efficiency/visual_tokens": n, "efficiency/prefill_tflops": tf, "efficiency/kv_cache_mb": kv,
                "efficiency/prefill_ms": ms}

    trials = [trial("none", None, {"pope/pope_f1_score": 0.86} | eff(2880, 42.6, 1440.0, 200.0)),
              trial("promprune", 320, {"pope/pope_f1_score": 0.85} | eff(320, 5.10, 160.0, 150.0))]
    parent = log_sweep(client, exp, "table6_efficiency", trials, tasks=["pope"], tmp=tmp_path)
    report = build_report(load_sweep(parent), tmp_path / "out", published_root=PAPER_DIR, image_source=grey_image)
    assert "5.10 (−88.0%)" in report.markdown  # 1 - 5.10 / 42.6 = 0.8803
    eff = pd.read_csv(tmp_path / "out" / "efficiency.csv").set_index("method")
    assert "rel" not in eff and eff.loc["promprune", "Rel. (%)"] == pytest.approx(100 * 0.85 / 0.86)  # a percent
    comp = pd.read_csv(tmp_path / "out" / "published_comparison.csv")
    got = {(r.method, r.column): (r.ours, r.paper, r.delta) for r in comp.itertuples()}
    assert got[("none", "efficiency/prefill_tflops")] == pytest.approx((42.6, 42.6, 0.0))
    assert got[("promprune", "efficiency/prefill_tflops")] == pytest.approx((5.10, 5.02, 0.08))
    assert got[("promprune", "efficiency/kv_cache_mb")] == pytest.approx((160.0, 160.0, 0.0))
    assert not [k for k in got if k[0] == "fastv"]  # the paper's FastV cells were not found: nothing to compare


def test_categorical_ablation_rows_are_named_and_compared_per_budget(store, tmp_path):
    """Table 5's shape: one method, a string option varying, several budgets."""
    client, exp = store
    f1 = {("dpp", 64): 0.80, ("fps", 64): 0.78, ("facility_location", 64): 0.79,
          ("dpp", 32): 0.74, ("fps", 32): 0.75, ("facility_location", 32): 0.70}
    trials = [trial("none", None, {"pope/pope_f1_score": 0.85})]
    trials += [trial("promprune", b, {"pope/pope_f1_score": v}, options={"diversity": d}) for (d, b), v in f1.items()]
    parent = log_sweep(client, exp, "table5_demo", trials, tasks=["pope"], tmp=tmp_path)
    report = build_report(load_sweep(parent), tmp_path / "out", image_source=grey_image)
    assert "| PromPrune (diversity=dpp) | 64 | **80.0** | **94.1%** |" in report.markdown  # 0.80 / 0.85
    assert "| PromPrune (diversity=fps) | 32 | **75.0** | **88.2%** |" in report.markdown
    assert "| PromPrune (diversity=fps) | 64 | 78.0 | 91.8% |" in report.markdown
    assert {"tradeoff.png", "ablation_bars.png"} <= {p.name for p in report.files}


def test_mu_tau_heatmap_has_a_panel_per_benchmark(store, tmp_path, monkeypatch):
    """Fig. 5 shows each benchmark (the paper: SQA, POPE, GQA, and PromPrune above VisPruner on all of them), not only
    the mean: a cell can beat VisPruner on Rel. and lose on one benchmark, or the reverse. Scores as % of unpruned
    (pope 0.80, gqa 0.60); VisPruner 95 % on both, so Rel. 95."""
    from matplotlib.patches import Rectangle

    from pipelines.reporting import figures

    panels, save = {}, figures._save

    def outlines_then_save(fig, path):  # each titled panel: its title and how many cells it outlines
        panels[path.name] = [(ax.get_title(), sum(isinstance(p, Rectangle) for p in ax.patches))
                             for ax in fig.axes if ax.get_title()]
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", outlines_then_save)
    client, exp = store
    cells = {(0.40, 0.01): (0.80, 0.51), (0.40, 0.02): (0.68, 0.60),  # pope 100 / gqa 85; pope 85 / gqa 100
             (0.44, 0.01): (0.80, 0.60), (0.44, 0.02): (0.70, 0.51)}  # both 100 (Rel. 100); 87.5 / 85
    trials = [trial("none", None, {"pope/pope_f1_score": 0.80, "gqa/exact_match": 0.60}),
              trial("vispruner", 64, {"pope/pope_f1_score": 0.76, "gqa/exact_match": 0.57})]
    trials += [trial("promprune", 64, {"pope/pope_f1_score": p, "gqa/exact_match": g}, options={"mu": mu, "tau": tau})
               for (mu, tau), (p, g) in cells.items()]
    parent = log_sweep(client, exp, "fig5_demo", trials, tasks=["pope", "gqa"], tmp=tmp_path)
    report = build_report(load_sweep(parent), tmp_path / "out", image_source=grey_image)
    assert "mu_tau_heatmap.png" in {p.name for p in report.files}
    drawn = panels["mu_tau_heatmap.png"]
    assert [n for _, n in drawn] == [1, 2, 2]  # Rel.: only (0.44, 0.01); POPE: 2 cells at 100; GQA: 2 cells at 100
    assert "Rel. (%)" in drawn[0][0] and all("% of unpruned" in t for t, _ in drawn[1:])
    assert all("VisPruner 95.0" in t for t, _ in drawn)


def test_a_paired_interval_that_excludes_0_never_prints_as_holding_it():
    """The quickstart's DivPrune - PromPrune: lower bound +0.0488 points, resolved; printed at one decimal it read
    "[+0.0, +3.0] (resolved)", and on the console (no verdict there) as holding 0. Bounds that round to 0 but are not
    0 get two significant digits; other values stay at one decimal; an exact 0 is +0.0."""
    from pipelines.reporting.paired import Difference

    d = Difference(16, "DivPrune", "PromPrune", "a", "b", 1.5, 0.0488, 3.0)
    assert d.resolved and d.text() == "DivPrune - PromPrune: +1.5 [+0.049, +3.0] points"
    d = Difference(16, "PromPrune", "DivPrune", "b", "a", -1.5, -3.0, -0.0488)
    assert d.resolved and d.text() == "PromPrune - DivPrune: -1.5 [-3.0, -0.049] points"
    d = Difference(16, "A", "B", "a", "b", -3.1, -6.3, 0.0)
    assert not d.resolved and d.text() == "A - B: -3.1 [-6.3, +0.0] points"


def test_a_headroom_interval_that_excludes_0_never_prints_as_holding_it():
    """The headroom table's intervals share the paired differences' rule (`headroom.points`)."""
    from pipelines.reporting.headroom import Estimate

    assert Estimate(1.2, 0.04, 2.5).text(" points") == "+1.2 points [+0.04, +2.5]"
    assert Estimate(40.0, 0.04, 71.0).text("%", signed=False) == "40.0% [0.04, 71.0]"
    assert Estimate(-1.0, -2.0, 0.0).text() == "-1.0 [-2.0, +0.0]"
