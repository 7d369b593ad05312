"""Scoring: lmms-eval's own POPE / MME / easy-vqa scoring, fed from shards, against hand-worked values."""

import io
import math
import random
from pathlib import Path

import datasets
import lmms_eval
import pytest
from PIL import Image

from promprune.eval import build_requests, relative_score, score
from promprune.records import Answer, Prediction
from promprune.eval.tasks import load_task
from tests.own_task import write_task

LMMS_TASKS = Path(lmms_eval.__file__).parent / "tasks"


def _png() -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def _local_copy(root: Path, name: str, base_yaml: Path, docs: dict, split: str = "test") -> None:
    """lmms-eval's own task YAML, unchanged but for its data: hand-made docs in a local parquet."""
    docs = {**docs, "image": [_png() for _ in next(iter(docs.values()))]}
    kind = lambda values: "int64" if isinstance(values[0], int) else "string"  # noqa: E731
    features = datasets.Features({k: datasets.Value(kind(v)) for k, v in docs.items() if k != "image"}
                                 | {"image": datasets.Image()})
    datasets.Dataset.from_dict(docs, features=features).to_parquet(str(root / f"{name}.parquet"))
    (root / f"{name}.yaml").write_text(
        f"include: {base_yaml}\ntask: {name}\ndataset_path: parquet\n"
        f"dataset_kwargs:\n  data_files:\n    {split}: {root / f'{name}.parquet'}\n"
    )


# POPE: ground truth and predictions; the last one is a failed sample on a "no" question: its text would be right,
# but a failed sample is scored as scoring.FAILED_ANSWER, i.e. wrong
POPE_GT = ["yes", "yes", "yes", "no", "no", "no"]
POPE_PRED = ["yes", "Yes", "no", "yes", "no", "no"]
# MME: (question_id, category, answer, prediction); each image has a yes and a no question
MME = [
    ("existence/1.jpg", "existence", "Yes", "Yes"),  # pair 1: both right -> acc 100 + acc+ 100 = 200
    ("existence/1.jpg", "existence", "No", "No"),
    ("existence/2.jpg", "existence", "Yes", "Yes"),  # pair 2: one right -> acc 50 + acc+ 0 = 50
    ("existence/2.jpg", "existence", "No", "yes"),
    ("code/1.png", "code_reasoning", "Yes", "no"),  # cognition pair: one right -> 50
    ("code/1.png", "code_reasoning", "No", "No"),
]


@pytest.fixture(scope="module")
def handmade_tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmms_tasks")
    n = len(POPE_GT)
    _local_copy(root, "pope_handmade", LMMS_TASKS / "pope" / "pope.yaml", {
        "question_id": [str(i) for i in range(n)], "question": [f"Is there a thing {i}?" for i in range(n)],
        "answer": POPE_GT, "category": ["adversarial"] * n,
    })
    _local_copy(root, "mme_handmade", LMMS_TASKS / "mme" / "mme.yaml", {
        "question_id": [m[0] for m in MME], "question": ["Is it? Please answer yes or no." for _ in MME],
        "answer": [m[2] for m in MME], "category": [m[1] for m in MME],
    })
    _local_copy(root, "mmbench_handmade", LMMS_TASKS / "mmbench" / "mmbench_en_dev_static.yaml", {
        "index": list(range(4)), "question": ["Which colour is the shape?"] * 4, "hint": ["nan"] * 4,
        "A": ["red"] * 4, "B": ["green"] * 4, "C": ["blue"] * 4, "D": ["yellow"] * 4, "answer": list("ABCD"),
        "category": ["attribute_recognition"] * 4, "L2-category": ["finegrained_perception"] * 4,
        "source": ["handmade"] * 4, "split": ["dev"] * 4,
    }, split="dev")
    return str(root)


def _rows(task, predictions, errors=None):
    errors = errors or [None] * len(predictions)
    return [
        {"task": task, "doc_id": i, "n_docs": len(predictions), "prediction": p, "error": e}
        for i, (p, e) in enumerate(zip(predictions, errors))
    ]


def test_pope_hand_worked(handmade_tasks):
    rows = _rows("pope_handmade", POPE_PRED, [None] * 5 + ["ValueError: corrupt image"])
    random.Random(0).shuffle(rows)  # shards arrive in any order
    result = score(rows, include_path=handmade_tasks)["pope_handmade"]
    # lmms-eval's POPE: exact (lower-cased) match; tp=2 ("yes","Yes"), fp=1, fn=1; the failed sample is wrong
    assert result["pope_accuracy"] == pytest.approx(3 / 6)
    assert result["pope_precision"] == pytest.approx(2 / 3)
    assert result["pope_recall"] == pytest.approx(2 / 3)
    assert result["pope_f1_score"] == pytest.approx(2 / 3)
    assert result["pope_yes_ratio"] == pytest.approx(3 / 6)  # lmms-eval's is the ground truth's yes share
    assert result["n_samples"] == 6 and result["n_failed"] == 1


def test_mme_pairs_both_answers_across_shards(handmade_tasks):
    rows = _rows("mme_handmade", [m[3] for m in MME])
    shards = [rows[1::2], rows[0::2]]  # each question's two answers land in different shards
    result = score(shards[0] + shards[1], include_path=handmade_tasks)["mme_handmade"]
    assert result["mme_perception_score"] == pytest.approx((200 + 50) / 2)
    assert result["mme_cognition_score"] == pytest.approx(50)
    assert result["n_failed"] == 0


def test_mmbench_static_regex_scoring_writes_its_files_to_output_dir(handmade_tasks, tmp_path):
    # the letter (hit), a wrong letter, the option's text (hit: lmms-eval matches it to C), a failed sample
    rows = _rows("mmbench_handmade", ["A", "C", "The shape is blue.", "D"], [None, None, None, "OSError: truncated"])
    result = score(rows, include_path=handmade_tasks, output_dir=str(tmp_path))["mmbench_handmade"]
    assert result["gpt_eval_score"] == pytest.approx(50.0)  # lmms-eval reports MMBench in percent
    assert result["n_failed"] == 1
    assert (tmp_path / "submissions" / "mmbench_en_dev_static_results.json").exists()


def test_duplicates_missing_and_malformed_rows_raise(handmade_tasks):
    rows = _rows("pope_handmade", ["yes"] * 6)
    with pytest.raises(ValueError, match=r"'pope_handmade', doc_id=2\) appears twice"):
        score(rows + [rows[2]], include_path=handmade_tasks)
    with pytest.raises(ValueError, match=r"missing \[4\]"):
        score(rows[:4] + rows[5:], include_path=handmade_tasks)
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['prediction'\]"):
        score([{k: v for k, v in rows[0].items() if k != "prediction"}], include_path=handmade_tasks)
    with pytest.raises(ValueError, match="n_docs"):
        score([rows[0], {**rows[1], "n_docs": 7}], include_path=handmade_tasks)


def test_easyvqa_scores_against_naive_count():
    requests = build_requests(["easyvqa_yesno", "easyvqa_open"], limit=12)
    yesno_gt = load_task("easyvqa_yesno").eval_docs_no_media["answer"][:12]
    open_gt = load_task("easyvqa_open").eval_docs_no_media["answer"][:12]
    rng = random.Random(1)
    yesno_pred = [rng.choice(["Yes.", "no", "maybe", " NO,"]) for _ in yesno_gt]
    open_pred = [a.upper() + "." if rng.random() < 0.5 else "square" for a in open_gt]
    preds = {("easyvqa_yesno", i): p for i, p in enumerate(yesno_pred)}
    preds.update({("easyvqa_open", i): p for i, p in enumerate(open_pred)})
    rows = [Prediction.answering(r, Answer(prediction=preds[r.task, r.doc_id])) for r in requests]
    rows[3].error = "RuntimeError: generation failed"  # a failed yes/no sample counts as wrong
    result = score(rows[::-1])

    norm = ["yes" if p.strip().lower().startswith("yes") else "no" if p.strip().lower().startswith("no") else "other"
            for p in yesno_pred]
    norm[3] = "other"
    tp = sum(p == g == "yes" for p, g in zip(norm, yesno_gt))
    fp = sum(p == "yes" and g == "no" for p, g in zip(norm, yesno_gt))
    fn = sum(p != "yes" and g == "yes" for p, g in zip(norm, yesno_gt))
    yesno = result["easyvqa_yesno"]
    assert yesno["accuracy"] == pytest.approx(sum(p == g for p, g in zip(norm, yesno_gt)) / 12)
    assert yesno["precision"] == pytest.approx(tp / (tp + fp))
    assert yesno["recall"] == pytest.approx(tp / (tp + fn))
    assert yesno["yes_ratio"] == pytest.approx(norm.count("yes") / 12)
    assert yesno["n_failed"] == 1 and yesno["n_samples"] == 12
    assert result["easyvqa_open"]["exact_match"] == pytest.approx(
        sum(p.rstrip(".").lower() == g for p, g in zip(open_pred, open_gt)) / 12
    )


def test_relative_score_hand_worked():
    ours = {"mme": {"mme_perception_score": 125.0, "mme_cognition_score": 50.0}, "pope": {"pope_f1_score": 0.8}}
    base = {"mme": {"mme_perception_score": 150.0, "mme_cognition_score": 100.0}, "pope": {"pope_f1_score": 0.9}}
    assert relative_score(ours, base) == pytest.approx((125 / 150 + 0.8 / 0.9) / 2)  # MME: perception only
    assert relative_score(base, base) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"lacks task\(s\) \['pope'\]"):
        relative_score(ours, {"mme": base["mme"]})
    with pytest.raises(ValueError, match="no primary metric"):
        relative_score({"mystery": {"x": 1.0}}, {"mystery": {"x": 1.0}})
    assert relative_score({"mystery": {"x": 1.0}}, {"mystery": {"x": 2.0}}, primary={"mystery": ("x",)}) == 0.5


def test_rows_read_back_from_parquet_score_the_same(handmade_tasks, tmp_path):
    """Prediction rows go through Arrow/pandas in the pipeline: nulls come back as None or NaN, ints as numpy."""
    import pandas as pd

    rows = _rows("pope_handmade", POPE_PRED, [None] * 5 + ["ValueError: corrupt image"])
    pd.DataFrame(rows).to_parquet(tmp_path / "preds.parquet")
    frame = pd.read_parquet(tmp_path / "preds.parquet")
    frame.loc[0, "error"] = float("nan")  # a null as pandas may hand it over
    back = frame.to_dict("records")
    assert score(back, include_path=handmade_tasks) == score(rows, include_path=handmade_tasks)


def _naive_percentile_bootstrap(values, statistic, iters=3000, seed=7):
    """Resample with Python's own RNG (independent of the code under test), 2.5th and 97.5th percentiles."""
    rng = random.Random(seed)
    stats = sorted(statistic([values[rng.randrange(len(values))] for _ in values]) for _ in range(iters))
    return stats[int(0.025 * iters)], stats[int(0.975 * iters) - 1]


def test_bootstrap_intervals_match_a_naive_resampler():
    n = 40
    requests = build_requests(["easyvqa_yesno", "easyvqa_open"], limit=n)
    yesno_gt = load_task("easyvqa_yesno").eval_docs_no_media["answer"][:n]
    open_gt = load_task("easyvqa_open").eval_docs_no_media["answer"][:n]
    rng = random.Random(3)
    yesno_pred = [g if rng.random() < 0.7 else rng.choice(["yes", "no"]) for g in yesno_gt]
    open_pred = [g if rng.random() < 0.5 else "circle" for g in open_gt]
    preds = {("easyvqa_yesno", i): p for i, p in enumerate(yesno_pred)}
    preds.update({("easyvqa_open", i): p for i, p in enumerate(open_pred)})
    rows = [Prediction.answering(r, Answer(prediction=preds[r.task, r.doc_id])) for r in requests]
    result = score(rows, bootstrap=2000)

    hits = [float(p == g) for p, g in zip(open_pred, open_gt)]
    low, high = _naive_percentile_bootstrap(hits, lambda v: sum(v) / len(v))
    em = result["easyvqa_open"]
    assert em["exact_match_ci_low"] <= em["exact_match"] <= em["exact_match_ci_high"]
    assert em["exact_match_ci_low"] == pytest.approx(low, abs=0.04)
    assert em["exact_match_ci_high"] == pytest.approx(high, abs=0.04)

    def f1(pairs):  # "yes" is the positive class
        tp = sum(p == g == "yes" for p, g in pairs)
        fp = sum(p == "yes" and g == "no" for p, g in pairs)
        fn = sum(p != "yes" and g == "yes" for p, g in pairs)
        return 2 * tp / (2 * tp + fp + fn) if tp else 0.0

    low, high = _naive_percentile_bootstrap(list(zip(yesno_pred, yesno_gt)), f1)
    yn = result["easyvqa_yesno"]
    assert yn["f1"] == pytest.approx(f1(list(zip(yesno_pred, yesno_gt))))
    assert yn["f1_ci_low"] == pytest.approx(low, abs=0.04) and yn["f1_ci_high"] == pytest.approx(high, abs=0.04)
    assert "accuracy_ci_low" not in yn  # intervals for the primary metric only
    assert "f1_ci_low" not in score(rows)["easyvqa_yesno"]  # off by default


def test_bootstrap_of_a_constant_is_a_point():
    from lmms_eval.api.metrics import mean

    from promprune.eval.scoring import bootstrap_ci

    assert bootstrap_ci([1.0] * 30, mean, 500) == (1.0, 1.0)
    low, high = bootstrap_ci([0.0, 1.0] * 200, mean, 4000)  # p = 0.5, n = 400: +-1.96 * 0.025
    assert low == pytest.approx(0.5 - 0.049, abs=0.006) and high == pytest.approx(0.5 + 0.049, abs=0.006)


# a benchmark of one's own whose scoring code is wrong (issue: a misnamed metric scored nothing, an exception in
# process_results was lost in tenacity's RetryError after 5 tries)
COUNT_CALL = """    with open(Path(__file__).with_name("calls"), "a") as calls:
        calls.write("x")
"""


def _own_task(root: Path, name: str, metrics: list[str], body: str) -> str:
    """A task directory of one's own with 3 documents; ``body``: process_results' code after it counts its call."""
    write_task(root / name, name, metrics=tuple(metrics), process_results=COUNT_CALL + body,
               questions=["q0", "q1", "q2"], answers=["yes", "no", "yes"])
    return str(root / name)


def test_an_exception_in_process_results_is_named_with_its_line_and_not_retried(tmp_path):
    from promprune.eval.scoring import ScoringError

    d = _own_task(tmp_path, "own_raises", ["accuracy"], "    return {'accuracy': results[0].nope}")
    with pytest.raises(ScoringError) as raised:
        score(_rows("own_raises", ["yes", "no", "no"]), include_path=d)
    line = next(i for i, text in enumerate((Path(d) / "utils.py").read_text().splitlines(), 1) if ".nope" in text)
    assert str(raised.value) == (
        f"task 'own_raises': its process_results raised AttributeError: 'str' object has no attribute 'nope', at "
        f"{d}/utils.py, line {line}: return {{'accuracy': results[0].nope}}. Fix the task's code there")
    assert isinstance(raised.value.__cause__, AttributeError)  # the user's exception, with its traceback
    assert (Path(d) / "calls").read_text() == "x"  # called once: lmms-eval's tenacity retries it 5 times, 2 s apart


def test_an_aggregation_that_raises_is_named_with_the_task_metric_and_values(tmp_path):
    # lmms-eval's mean over a metric process_results returns as a string: a TypeError traceback through lmms-eval's
    # metrics.mean, naming neither the task nor the metric (issue)
    from promprune.eval.scoring import ScoringError

    d = _own_task(tmp_path, "own_str", ["accuracy", "length"],
                  "    return {'accuracy': float(results[0] == doc['answer']), 'length': 'long'}")
    with pytest.raises(ScoringError) as raised:
        score(_rows("own_str", ["yes", "no", "no"]), include_path=d)
    first = next(i for i, text in enumerate((Path(d) / "utils.py").read_text().splitlines(), 1)
                 if "def process_results" in text)
    message = str(raised.value)
    assert message.startswith("task 'own_str': the aggregation of metric 'length', lmms-eval's mean, raised "
                              "TypeError: unsupported operand type(s) for +: 'int' and 'str', at "
                              f"{Path(lmms_eval.__file__).parent}/api/metrics.py, line "), message
    assert message.endswith(f"; its process_results ({d}/utils.py, line {first}) returned str values for 'length' "
                            "(e.g. 'long'). Fix process_results to return what the aggregation takes (numbers, for "
                            "mean), or the metric's aggregation in the task's metric_list"), message
    assert isinstance(raised.value.__cause__, TypeError)
    # the task's own aggregation: the line of its code that raised
    utils = (Path(d) / "utils.py").read_text() + "def agg_first(items):\n    return items[0] / 0\n"
    (Path(d) / "utils.py").write_text(utils.replace("'length': 'long'", "'length': 1.0"))
    yaml = Path(d) / "own_str.yaml"
    yaml.write_text(yaml.read_text().replace("{metric: length, aggregation: mean",
                                             "{metric: length, aggregation: !function utils.agg_first"))
    with pytest.raises(ScoringError) as raised:
        score(_rows("own_str", ["yes", "no", "no"]), include_path=d)
    line = len(utils.splitlines())
    assert str(raised.value) == (
        f"task 'own_str': the aggregation of metric 'length', agg_first, raised ZeroDivisionError: float division by "
        f"zero, at {d}/utils.py, line {line}: return items[0] / 0; its process_results ({d}/utils.py, line {first}) "
        "returned float values for 'length'. Fix process_results to return what the aggregation takes (numbers, for "
        "mean), or the metric's aggregation in the task's metric_list")


def test_nan_scores_are_counted_and_said_and_the_score_is_left_as_it_is(tmp_path, caplog):
    # a process_results returning NaN for some documents gave a silent NaN headline, n_failed 0 (issue)
    from pipelines.recording.console import headline_keys, nan_note

    d = _own_task(tmp_path, "own_nan", ["accuracy", "length"],
                  "    return {'accuracy': float('nan') if doc['answer'] == 'yes' else 1.0, 'length': 2.0}")
    with caplog.at_level("WARNING", logger="promprune.eval.scoring"):
        scores = score(_rows("own_nan", ["yes", "no", "no"]), include_path=d)["own_nan"]
    assert math.isnan(scores.pop("accuracy"))  # lmms-eval's mean over [nan, 1.0, nan]: the number is not changed
    assert scores == {"length": 2.0, "accuracy_n_nan": 2, "n_samples": 3, "n_failed": 0}  # documents 0 and 2
    assert [r.getMessage() for r in caplog.records] == [
        "own_nan: process_results returned NaN for metric 'accuracy' on 2 of 3 sample(s); its score is what the "
        "aggregation makes of them (a mean: NaN), so check the task's process_results"]
    flat = {f"own_nan/{k}": v for k, v in scores.items()} | {"own_nan/accuracy": math.nan}
    assert nan_note(flat) == " NaN SCORES: own_nan/accuracy on 2 sample(s) (the task's process_results returned NaN)"
    assert nan_note({"own_nan/accuracy": 0.5, "own_nan/n_failed": 0}) == ""
    assert headline_keys(["own_nan"], {"own_nan/accuracy_n_nan": 2.0, "own_nan/length": 2.0}) == ["own_nan/length"]
    # a running score (documents not answered yet, replayed as "") counts nothing
    partial = score(_rows("own_nan", ["yes", "no", "no"])[1:], include_path=d, partial=True)["own_nan"]
    assert "accuracy_n_nan" not in partial


def test_a_declared_metric_process_results_never_returns_is_an_error(tmp_path):
    from promprune.eval.scoring import ScoringError

    typo = _own_task(tmp_path, "own_typo", ["acc_typo"], "    return {'accuracy': float(results[0] == doc['answer'])}")
    with pytest.raises(ScoringError) as raised:
        score(_rows("own_typo", ["yes", "no", "no"]), include_path=typo)
    assert str(raised.value) == (
        "task 'own_typo': its metric_list declares ['acc_typo'], which its process_results returned for no document "
        "(it returned ['accuracy']); name in metric_list the keys process_results returns (the first metric is the "
        "task's headline score)")
    # a declared metric no document has, beside the ones returned (MME's cognition score on perception questions
    # only), scores what came back
    some = _own_task(tmp_path, "own_some", ["accuracy", "rare"], "    return {'accuracy': float(results[0] == "
                                                                 "doc['answer'])}")
    scores = score(_rows("own_some", ["yes", "no", "no"]), include_path=some)["own_some"]
    assert scores == {"accuracy": 2 / 3, "n_samples": 3, "n_failed": 0}


# ---------------------------------------------------------------------------------------------------------------
# which tasks are scored by groups, a task of one's own on an include path, a partial paired score's interval

EXACT = "    return {'accuracy': float(results[0].strip().lower() == doc['answer'])}"


def _exact_task(root: Path, name: str) -> str:
    """A task of one's own scored by exact match, 4 documents (answers yes, no, yes, yes), in its own directory."""
    write_task(root / name, name, process_results=EXACT, questions=["q0", "q1", "q2", "q3"],
               answers=["yes", "no", "yes", "yes"])
    return str(root / name)


def test_a_task_of_ones_own_named_mme_is_scored_by_its_own_records(tmp_path):
    """Grouping (MME's question pairs) follows lmms-eval's MME process_results, not the name: a task ``mme_*`` of
    one's own is scored as its twin under another name (it raised TypeError: its records are numbers). Predictions
    yes, no, no, yes: 3 of 4 right; the first 3 answered: 2 of 3."""
    dirs = [_exact_task(tmp_path, "mme_own"), _exact_task(tmp_path, "plain_own")]
    got = {}
    for name in ("mme_own", "plain_own"):
        rows = _rows(name, ["yes", "no", "no", "yes"])
        got[name] = (score(rows, include_path=dirs, bootstrap=40)[name],
                     score(rows[:3], include_path=dirs, partial=True)[name])
    assert got["mme_own"] == got["plain_own"]
    whole, partial = got["mme_own"]
    assert whole["accuracy"] == 0.75 and partial["accuracy"] == pytest.approx(2 / 3)


def test_only_lmms_evals_mme_and_mmbench_records_are_grouped():
    """lmms-eval's other mme_* tasks (mme_cc, mme_sci: other records) are scored document by document."""
    import importlib
    from types import SimpleNamespace

    from promprune.eval.scoring import _grouping

    def grouping(module: str, fn: str):
        task = SimpleNamespace(config=SimpleNamespace(process_results=getattr(importlib.import_module(module), fn)))
        return _grouping(task)

    assert grouping("lmms_eval.tasks.mme_cc.utils", "mme_cc_process_results") is None
    assert grouping("lmms_eval.tasks.mme_sci.utils", "process_results") is None
    mme = grouping("lmms_eval.tasks.mme.utils", "mme_process_results")
    assert mme[0]({"question_id": "a.jpg", "category": "color"}) == "a.jpg"
    mmbench = grouping("lmms_eval.tasks.mmbench.en_utils", "mmbench_process_results")
    assert mmbench[0]({"index": 2_000_007}) == 7  # a question with its circular copies


def test_a_task_of_ones_own_on_the_include_path_gets_intervals_and_its_primary_score(tmp_path):
    """``include_path`` reaches the primary metric (the first of the task's metric_list) everywhere: the bootstrap
    intervals (none came back) and `primary_score` / `relative_score` (no primary metric was known)."""
    from promprune.eval.scoring import primary_score

    d = _exact_task(tmp_path, "own_exact")
    ours = score(_rows("own_exact", ["yes", "no", "no", "yes"]), include_path=d, bootstrap=200)
    base = score(_rows("own_exact", ["yes", "no", "yes", "yes"]), include_path=d)
    result = ours["own_exact"]
    assert result["accuracy_ci_low"] <= 0.75 <= result["accuracy_ci_high"]
    assert result["accuracy_ci_low"] < result["accuracy_ci_high"]
    assert primary_score("own_exact", result, include_path=d) == 0.75
    assert relative_score(ours, base, include_path=d) == 0.75


def test_a_partial_mme_score_with_intervals_resamples_the_whole_pairs_only(handmade_tasks):
    """Document 3 not answered yet: its pair (existence/2) waits, and the interval resamples what the point
    estimate aggregated (it raised MME's 'pairwise evaluation' assert): perception is pair 1 alone, acc 100 +
    acc+ 100 = 200 on every resample; cognition 50 (the code pair, one of two right)."""
    rows = _rows("mme_handmade", [m[3] for m in MME])
    got = score(rows[:3] + rows[4:], include_path=handmade_tasks, partial=True, bootstrap=30)["mme_handmade"]
    assert got["mme_perception_score"] == 200.0
    assert (got["mme_perception_score_ci_low"], got["mme_perception_score_ci_high"]) == (200.0, 200.0)
    assert got["mme_cognition_score"] == 50.0 and got["n_samples"] == 5


def test_an_undefined_ratio_is_never_averaged_away():
    """`mean_ratio` is NaN when a task's ratio is undefined (it averaged over the others, silently); `relative_score`
    names the task."""
    from promprune.eval.scoring import mean_ratio

    assert mean_ratio({"a": 0.9, "b": 0.5}, {"a": 1.0, "b": 1.0}) == pytest.approx(0.7)
    for ours, base in (({"a": 0.9, "b": math.nan}, {"a": 1.0, "b": 1.0}), ({"a": 0.9, "b": 0.5}, {"a": 1.0}),
                       ({"a": 0.9, "b": 0.5}, {"a": 1.0, "b": 0.0})):
        assert math.isnan(mean_ratio(ours, base))
    scores = {"mme": {"mme_perception_score": math.nan}, "pope": {"pope_f1_score": 0.8}}
    base = {"mme": {"mme_perception_score": 150.0}, "pope": {"pope_f1_score": 0.9}}
    with pytest.raises(ValueError, match="task 'mme': the scores' primary score is NaN"):
        relative_score(scores, base)
    with pytest.raises(ValueError, match="task 'mme': the baseline's primary score is NaN"):
        relative_score(base, scores)


@pytest.mark.parametrize("kind", ["mean", "records"])
def test_a_bootstrap_holds_a_chunk_of_its_draws_not_all_of_them(kind, monkeypatch):
    """The resamples are drawn a chunk of rows at a time: memory stays near `DRAWS_AT_ONCE` indices whatever the
    documents and resamples (all iters x n at once were 8 bytes each, twice over for a mean: 3.4 GB for VQAv2-val's
    214k questions at 1,000 resamples), and the interval is the one of every draw made at once (numpy's generator
    continues its stream across calls), computed here the plain way."""
    import tracemalloc

    import numpy as np
    from lmms_eval.api.metrics import mean

    from promprune.eval import scoring
    from promprune.eval.offline_metrics import yesno_accuracy

    monkeypatch.setattr(scoring, "DRAWS_AT_ONCE", 20_000, raising=False)  # (the old code had none)
    rng = random.Random(5)
    n, iters = 4_000, 300
    if kind == "mean":
        items, aggregate = [float(rng.random() < 0.6) for _ in range(n)], mean
    else:
        items = [{"prediction": rng.choice(["yes", "no"]), "answer": rng.choice(["yes", "no"])} for _ in range(n)]
        aggregate = yesno_accuracy
    draws = np.random.default_rng(0).integers(0, n, size=(iters, n))  # every draw at once: the plain way
    stats = [aggregate([items[i] for i in row]) for row in draws]
    expected = tuple(float(x) for x in np.percentile(stats, [2.5, 97.5]))
    del draws
    tracemalloc.start()
    try:
        got = scoring.bootstrap_ci(items, aggregate, iters)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == pytest.approx(expected, abs=1e-12)
    assert peak < 2_000_000, f"{peak / 1e6:.1f} MB traced (all draws at once: {iters * n * 8 / 1e6:.1f} MB)"
