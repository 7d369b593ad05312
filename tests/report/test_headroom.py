"""The split-headroom section against tables worked by hand: best fixed ratio, per-sample oracle, the cross-validated
step rule, the captured fraction, the per-sample scores lmms-eval's items give, the bootstrap against a naive
resampling loop, and the section in a report built from a real SQLite MLflow store."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from pipelines.reporting import headroom as hr
from pipelines.reporting import headroom_section as hs
from pipelines.reporting.build import build_report
from pipelines.reporting.store import load_sweep
from tests.eval.test_scoring import MME, POPE_PRED, _rows, handmade_tasks  # noqa: F401 - the fixture, reused

from .conftest import log_sweep, trial

# Eight samples (one image each), sorted by spectral entropy; three fixed ratios. Low entropy answers right with
# saliency (ratio 1), high entropy with coverage (ratio 0). FOLDS: the halves folds_by_cluster draws for 8 images
# with seed 0 (pinned below), so the same table works by hand for the report built from MLflow.
RATIOS = [0.0, 0.5, 1.0]
ENTROPY = np.array([0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.40, 0.45])
SCORES = np.array([  # [sample, ratio]: 1 = answered right
    [0, 0, 1],  # s0 .10  fold 1
    [0, 1, 1],  # s1 .15  fold 0
    [0, 0, 1],  # s2 .20  fold 0
    [1, 1, 0],  # s3 .25  fold 0
    [1, 1, 0],  # s4 .30  fold 1
    [1, 0, 0],  # s5 .35  fold 0
    [0, 0, 0],  # s6 .40  fold 1
    [1, 1, 0],  # s7 .45  fold 1
], dtype=float)
FOLDS = np.array([1, 0, 0, 0, 1, 0, 1, 1])
PROMPRUNE = np.array([1, 1, 0, 1, 1, 0, 0, 1], dtype=float)  # 5 of 8 right


def test_best_fixed_ratio_and_oracle_by_hand():
    # column sums: ratio 0: s3 s4 s5 s7 = 4; ratio 0.5: s1 s3 s4 s7 = 4; ratio 1: s0 s1 s2 = 3. The tie between 0
    # and 0.5 goes to the smaller ratio.
    assert hr.best_fixed(SCORES) == 0
    assert hr.best_fixed(SCORES[:, ::-1]) == 1  # the same tie, columns reversed: still the first of the two
    # every sample but s6 has a ratio that answers it: 7 / 8
    assert hr.oracle(SCORES).mean() == 7 / 8
    assert hr.best_set(SCORES)[6].all() and hr.best_set(SCORES)[0].tolist() == [False, False, True]


def test_the_step_rule_fit_by_hand():
    """Fold 0 (s1 .15, s2 .20, s3 .25, s5 .35): every ratio totals 2, so the prior is ratio 0 (the first). Cuts at
    the deciles ('lower'): .15 (nothing below: skipped), .20 (s1 below: ratios 0.5 and 1 tie at 1, 0.5 nearer the
    prior; above: ratio 0 with 2; total 3), .25 (s1 s2 below: ratio 1 with 2; above s3 s5: ratio 0 with 2; total 4).
    The cut at .25 wins: below it ratio 1, else ratio 0."""
    rule = hr.fit_step_rule(ENTROPY[FOLDS == 0], SCORES[FOLDS == 0])
    assert rule == hr.StepRule(0.25, below=2, above=0, fallback=0)
    assert rule.choose(np.array([0.1, 0.25, np.nan])).tolist() == [2, 0, 0]
    # a table where no cut beats one ratio for all keeps one ratio (strictly better or nothing)
    flat = hr.fit_step_rule(np.array([0.1, 0.2, 0.3, 0.4]), np.array([[1, 0], [1, 0], [0, 1], [1, 0]], float))
    assert flat == hr.StepRule(None, below=0, above=0, fallback=0)


def test_cross_validated_rule_by_hand():
    """Fit on fold 1 (s0 .10, s4 .30, s6 .40, s7 .45; totals 2, 2, 1: prior ratio 0): the cut at .30 puts s0 on
    ratio 1 (1) and the rest on ratio 0 (2): 3 > 2; the cut at .40 scores 2. Applied to fold 0: s1, s2, s3 (< .30) on
    ratio 1 score 1, 1, 0; s5 on ratio 0 scores 1. Fit on fold 0 (above): < .25 ratio 1, else 0; applied to fold 1:
    s0 1, s4 1, s6 0, s7 1. Held out: 6 of 8 = 0.75, against the best fixed ratio's 4 / 8."""
    held, rules = hr.cross_validated(ENTROPY, SCORES, FOLDS)
    assert held.tolist() == [1, 1, 1, 0, 1, 1, 0, 1]
    assert rules == [hr.StepRule(0.30, 2, 0, 0), hr.StepRule(0.25, 2, 0, 0)]
    assert held.mean() - SCORES[:, hr.best_fixed(SCORES)].mean() == 0.25


def test_captured_fraction_by_hand():
    """PromPrune 5/8 against the best fixed 4/8 and the rule's 6/8: (0.625 - 0.5) / (0.75 - 0.5) = 50%."""
    held, _ = hr.cross_validated(ENTROPY, SCORES, FOLDS)
    clusters = np.arange(8)
    got = hr.captured(PROMPRUNE, held, SCORES[:, 0], clusters, hr.cluster_draws(8, 500, seed=0))
    assert got.value == pytest.approx(50.0) and got.headroom == pytest.approx(0.25)
    assert got.low <= 50.0 <= got.high
    none = hr.captured(PROMPRUNE, SCORES[:, 0], SCORES[:, 0], clusters, hr.cluster_draws(8, 50))
    assert np.isnan(none.value) and none.undefined == 1.0  # no headroom on any draw: no fraction
    assert "captures -" in hs.captured_line("PromPrune", none)


def test_images_and_halves():
    # the two questions about an image share its entropy (to float noise): one group; a sample without one is alone
    groups = hr.clusters_by_entropy(np.array([0.3, 0.1, 0.1000005, np.nan, 0.2, 0.3]))
    assert groups.tolist() == [2, 0, 0, 3, 1, 2]
    assert hr.folds_by_cluster(np.arange(8), seed=0).tolist() == FOLDS.tolist()
    folds = hr.folds_by_cluster(np.repeat(np.arange(5), 2), seed=3)
    assert (folds[::2] == folds[1::2]).all() and abs(int(folds.sum()) - 5) <= 2  # images whole, halves balanced


def test_images_by_key_before_entropy():
    """A GPU's batches move one image's entropies apart (features' last bits; the certified split's midpoints): the
    image key groups its questions; samples without a key fall back to entropy, among themselves."""
    keys = ["b", "a", "a", None, "c", None, None]
    entropy = np.array([0.3, 0.1, 0.1001, 0.2, 0.25, 0.2, np.nan])
    # groups by lowest entropy: a (0.1), the keyless pair at 0.2, c (0.25), b (0.3), the keyless NaN last
    assert hr.clusters_by_image(keys, entropy).tolist() == [3, 0, 0, 1, 2, 1, 4]
    by_entropy = hr.clusters_by_entropy(entropy)
    assert by_entropy[1] != by_entropy[2]  # 1e-4 apart: two images by entropy alone
    # without keys (records from before the column), the entropy's grouping and numbering, so the same halves
    old = np.array([0.3, 0.1, 0.1000005, np.nan, 0.2, 0.3])
    assert hr.clusters_by_image([None] * 6, old).tolist() == hr.clusters_by_entropy(old).tolist() == [2, 0, 0, 3, 1, 2]
    # keys that group as the entropies do number as they do
    assert hr.clusters_by_image(["x", "y", "y", "z", "w", "x"], old).tolist() == [2, 0, 0, 3, 1, 2]
    with pytest.raises(ValueError, match="3 keys for 2 entropies"):
        hr.clusters_by_image(["a", "b", "c"], np.zeros(2))


def test_the_section_reads_each_units_image_key():
    frames = {"old": pd.DataFrame({"task": [TASK] * 2, "doc_id": [0, 1], "entropy": [0.1, 0.2]}),
              "new": pd.DataFrame({"task": [TASK] * 3, "doc_id": [0, 1, 2], "image_key": ["k0", None, "k2"]})}
    keys = hs._image_keys(frames.get, ["missing", "old", "new"])  # the first run whose predictions carry keys
    assert hs._unit_keys(keys, TASK, [(0,), (1, 2), (1,), (5,)]) == ["k0", "k2", None, None]
    assert hs._image_keys(frames.get, ["old"]).empty


def _naive(values_by_name: dict, clusters: np.ndarray, draws: np.ndarray) -> dict:
    """The resampling written out: per draw, the samples of each drawn image, then plain means."""
    ids = list(np.unique(clusters))
    out = {name: [] for name in values_by_name}
    for row in draws:
        picked = [i for c in row for i in range(len(clusters)) if clusters[i] == ids[c]]
        for name, values in values_by_name.items():
            out[name].append(float(np.mean([values[i] for i in picked])))
    return {name: np.array(v) for name, v in out.items()}


def test_the_bootstrap_is_a_naive_resampling_loop():
    rng = np.random.default_rng(7)
    clusters = np.repeat(rng.permutation(12) * 3 + 5, 2)[:23]  # 12 images of 2 questions (one of 1), odd ids
    a, b, c = (rng.integers(0, 2, size=23).astype(float) for _ in range(3))
    draws = hr.cluster_draws(12, 300, seed=4)
    naive = _naive({"d": a - c, "room": b - c}, clusters, draws)
    assert np.allclose(hr.resampled_means(a - c, clusters, draws), naive["d"])
    est = hr.difference(a, c, clusters, draws)
    assert est.value == pytest.approx((a - c).mean())
    assert (est.low, est.high) == pytest.approx(tuple(np.percentile(naive["d"], [2.5, 97.5])))
    got = hr.captured(a, b, c, clusters, draws)
    fractions = [100 * d / r for d, r in zip(naive["d"], naive["room"]) if r > 0]
    assert (got.low, got.high) == pytest.approx(tuple(np.percentile(fractions, [2.5, 97.5])))
    assert got.undefined == pytest.approx(np.mean(naive["room"] <= 0))
    assert hr.difference(a, a, clusters, draws).text() == "+0.0 [+0.0, +0.0]"


# ---------------------------------------------------------------------------------------------------------------
# per-sample scores from lmms-eval's own items


def test_per_sample_scores_of_f1_mme_and_mmbench(handmade_tasks):  # noqa: F811
    from promprune.eval.scoring import sample_items

    from promprune.eval.scoring import TaskItems

    pope = sample_items(_rows("pope_handmade", POPE_PRED, [None] * 5 + ["OSError"]), include_path=handmade_tasks)
    units, scores, kind = hs.unit_scores(pope["pope_handmade"], 100.0)
    # truth yes yes yes no no no; answers yes Yes no yes no (failed: "", wrong). A task of one's own is compared by
    # its first metric, here POPE's accuracy: the task's aggregation over each record alone
    assert (units, scores.tolist(), kind) == ([(i,) for i in range(6)], [100, 100, 0, 0, 100, 0], "one")
    # POPE proper is compared by F1 (the same records): right or wrong per record
    records = pope["pope_handmade"]
    as_f1 = TaskItems("pope", {"pope_f1_score": records.items["pope_accuracy"]}, records.aggregations, records.args)
    _, scores, kind = hs.unit_scores(as_f1, 100.0)
    assert (scores.tolist(), kind) == ([100, 100, 0, 0, 100, 0], "correct")
    mme = sample_items(_rows("mme_handmade", [m[3] for m in MME]), include_path=handmade_tasks)
    units, scores, kind = hs.unit_scores(mme["mme_handmade"], 1.0)
    # perception pairs: both right -> acc 100 + acc+ 100; one right -> 50 + 0 (the cognition pair is not perception)
    assert (units, scores.tolist(), kind) == ([(0, 1), (2, 3)], [200.0, 50.0], "group")
    mmb = sample_items(_rows("mmbench_handmade", ["A", "C", "The shape is blue.", "D"], [None] * 3 + ["OSError"]),
                       include_path=handmade_tasks)
    assert hs.unit_scores(mmb["mmbench_handmade"], 1.0)[1].tolist() == [100.0, 0.0, 100.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------
# the section in a report read back from MLflow

TASK = "testbed_exist_concentrated"


def _answers(correct: np.ndarray) -> list[str]:
    from promprune.eval.tasks import load_task

    truth = list(load_task(TASK).eval_docs_no_media["answer"][:len(correct)])
    return [t if ok else ("no" if t == "yes" else "yes") for t, ok in zip(truth, correct)]


def _predictions(correct, *, saliency: list[int], entropy=None) -> list[dict]:
    return [{"task": TASK, "doc_id": i, "n_docs": len(correct), "prediction": answer, "error": None,
             "entropy": None if entropy is None else float(entropy[i]), "saliency_count": float(saliency[i]),
             "visual_tokens": 8.0} for i, answer in enumerate(_answers(correct))]


def test_the_report_section_from_mlflow(store, tmp_path):
    client, exp = store
    n = len(ENTROPY)
    metrics = {f"{TASK}/f1": 0.5}
    trials = [trial("none", None, {f"{TASK}/f1": 1.0}, predictions=_predictions(np.ones(n), saliency=[0] * n))]
    for k, ratio in enumerate(RATIOS):
        trials.append(trial("fixed_ratio", 8, metrics, options={"saliency_ratio": ratio},
                            predictions=_predictions(SCORES[:, k], saliency=[round(8 * ratio)] * n)))
    split = [8, 8, 7, 6, 4, 3, 1, 0]  # PromPrune's T_sal per sample, falling with entropy
    trials.append(trial("promprune", 8, metrics, options={"mu": 0.3, "tau": 0.05},
                        predictions=_predictions(PROMPRUNE, saliency=split, entropy=ENTROPY)))
    log_sweep(client, exp, "headroom_demo", trials, tasks=[TASK], tmp=tmp_path)
    report = build_report(load_sweep("headroom_demo"), tmp_path / "out", truth_source=lambda task: None)
    text = report.markdown
    assert "## Split headroom" in text and f"`{TASK}`): 1 if the yes/no answer is right" in text
    assert "| Best fixed ratio: 0 | 50.0 | - |" in text
    assert "| Oracle: each sample's best of 3 ratios | 87.5 | +37.5 [" in text
    assert "| Cross-validated rule on spectral entropy | 75.0 | +25.0 [" in text
    assert "fit on half B, scores A: < 0.3: 1, else 0; fit on A, scores B: < 0.25: 1, else 0" in text
    assert "| PromPrune | 62.5 | +12.5 [" in text and "mean T_sal/T 0.578" in text
    # every sample but s6 depends on the ratio; their best shares (the mean T_sal / T of their best ratios: 0, 0.5,
    # 1) are 1, .75, 1, .25, .25, 0, .25 at entropies .10 .15 .20 .25 .30 .35 .45
    from scipy.stats import spearmanr

    rho = spearmanr([1, .75, 1, .25, .25, 0, .25], [.10, .15, .20, .25, .30, .35, .45]).statistic
    assert f"7 samples' scores depend on the ratio (Spearman rho of their best share with spectral entropy " \
           f"{rho:+.2f})" in text
    assert "PromPrune captures 50% [" in text and "of the cross-validated headroom (+25.0 points)" in text
    csv = pd.read_csv(tmp_path / "out" / "split_headroom.csv")
    assert csv.loc[csv["arm"].str.startswith("Oracle"), "diff"].item() == pytest.approx(37.5)
    figure = tmp_path / "out" / "split_headroom_b8.png"
    assert figure in report.files and figure.read_bytes()[:4] == b"\x89PNG"
    assert "resampled 1000 times" in text  # no `bootstrap` param logged: the report's own count
    # the spec's `bootstrap` (a param of the parent run) sets the section's resamples, as the other intervals'
    drawn, real = [], hr.cluster_draws
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hr, "cluster_draws", lambda n, iters, seed=0: drawn.append(iters) or real(n, iters, seed))
        text = build_report(dataclasses.replace(load_sweep("headroom_demo"), bootstrap=200),
                            tmp_path / "b200", truth_source=lambda task: None).markdown
    assert "resampled 200 times" in text and drawn and set(drawn) == {200}


def test_fixed_trials_on_different_benchmarks_make_no_panel(store, tmp_path):
    """Table 4's layout (each fixed split on its own benchmark): no benchmark has two ratios, and the section says
    so instead of comparing answers to different questions."""
    client, exp = store
    n, other = 4, "testbed_exist_spread"
    spread = [{**row, "task": other} for row in _predictions(np.ones(n), saliency=[0] * n)]
    trials = [trial("fixed_ratio", 8, {}, options={"saliency_ratio": 0.0},
                    predictions=_predictions(np.ones(n), saliency=[0] * n)),
              trial("fixed_ratio", 8, {}, options={"saliency_ratio": 1.0}, predictions=spread),
              trial("promprune", 8, {}, predictions=_predictions(np.ones(n), saliency=[4] * n, entropy=ENTROPY))]
    log_sweep(client, exp, "table4_like", trials, tasks=[TASK, other], tmp=tmp_path)
    text = build_report(load_sweep("table4_like"), tmp_path / "out", truth_source=lambda task: None).markdown
    assert f"## Split headroom\n\n- {TASK} at 8 tokens: fewer than two fixed ratios answered its documents" in text
    assert "Oracle" not in text and not (tmp_path / "out" / "split_headroom.csv").exists()


def test_pooling_keeps_the_ratios_every_task_answered():
    """A fixed ratio run on one task only (a trial with `tasks:`) gave that task three ratios and the other two, and
    the pooled panel's mean over the tasks' shares raised "inhomogeneous shape": the report was not written. The
    pool now keeps the ratios both answered, columns matched by ratio (worked by hand)."""
    def panel(task, ratios, shares, fixed):
        n = len(fixed)
        units = pd.DataFrame({"task": [task] * n, "docs": [(d,) for d in range(n)], "entropy": np.linspace(.1, .4, n),
                              "image": [f"{task}{d}" for d in range(n)], "cluster": 0, "fold": 0})
        return hs.Panel(task, task, 8.0, "correct", units, ratios, np.array(shares), np.array(fixed, dtype=float),
                        methods={"PromPrune": np.ones(n)}, method_shares={"PromPrune": np.full(n, .5)})

    a = panel("a", [0.0, 0.5, 1.0], [0.0, 0.5, 1.0], [[1, 0, 0], [0, 1, 1]])
    b = panel("b", [0.0, 1.0], [0.1, 0.9], [[0, 1], [1, 1], [1, 0]])
    pooled = hs._pooled([a, b])
    assert pooled.ratios == [0.0, 1.0]
    np.testing.assert_allclose(pooled.shares, [0.05, 0.95])
    np.testing.assert_array_equal(pooled.fixed, [[1, 0], [0, 1], [0, 1], [1, 1], [1, 0]])
    assert pooled.methods["PromPrune"].shape == (5,) and len(pooled.units) == 5
    c = panel("c", [0.5, 1.0], [0.5, 1.0], [[1, 0]])
    assert hs._pooled([b, c]) is None  # one ratio in common: nothing to compare
