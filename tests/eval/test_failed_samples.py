"""A failed sample counts as a wrong answer in every shipped task's own aggregation (lmms-eval's, no stand-in
scoring), and a document that gives no usable visual is one failed sample of its task, not all of them."""
import contextlib

import pytest

from promprune.eval import build_requests, score
from promprune.eval.scoring import FAILED_ANSWER
from promprune.eval.standins import STANDIN_TASKS, serving
from promprune.eval.tasks import OFFLINE_TASKS, PRIMARY_METRICS, VIDEO_TASKS, load_task
from tests.eval.test_hub_standins import LoopbackJudge, _correct

VIDEO = VIDEO_TASKS[0]
LETTERS = "ABCDE"


def _letter(doc: dict) -> str:
    """The option letter of an MVBench-shaped document's answer (its candidates stored ``|``-joined)."""
    return LETTERS[doc["candidates"].split("|").index(doc["answer"])]


def _rows(task: str, answers: list[str], failed: set[int] = frozenset()) -> list[dict]:
    return [{"task": task, "doc_id": i, "n_docs": len(answers), "prediction": "" if i in failed else answer,
             "error": "unreadable video" if i in failed else None} for i, answer in enumerate(answers)]


def test_two_right_and_two_failed_of_four_is_fifty_percent():
    """MVBench's accuracy (lmms-eval's ``mvbench_aggregate_results``, which the offline video task uses as it is)
    counts only answers other than "": a failed sample replayed as "" left its denominator, and 2 right + 2 failed
    of 4 scored 100.0. Replayed as FAILED_ANSWER it is a wrong answer: 2 / 4 = 50.0."""
    from lmms_eval.tasks.mvbench.utils import mvbench_aggregate_results, mvbench_process_results

    docs = [dict(d, candidates=d["candidates"].split("|")) for d in load_task(VIDEO).dataset["test"].select(range(4))]
    right = [LETTERS[d["candidates"].index(d["answer"])] for d in docs]
    items = [mvbench_process_results(d, [a])["mvbench_accuracy"] for d, a in zip(docs, right[:2] + ["", ""])]
    assert mvbench_aggregate_results(items) == 100.0  # lmms-eval's rule, which the empty answer fell through
    result = score(_rows(VIDEO, right, failed={2, 3}))[VIDEO]
    assert result["mvbench_accuracy"] == 50.0
    assert result["n_samples"] == 4 and result["n_failed"] == 2


# yes/no tasks scored POPE-style: their F1 counts only yes/no answers (the documented exception), their accuracy
# every answer; elsewhere the task's primary metric
YES_NO_ACCURACY = {"pope": "pope_accuracy", "easyvqa_yesno": "accuracy",
                   **{t: "accuracy" for t in OFFLINE_TASKS if t.startswith("testbed_exist")}}


def _answers(task: str, doc: dict) -> tuple[str, str]:
    """(a right answer, a wrong one) to ``doc``, as each task defines its ground truth."""
    if task == VIDEO:
        right = _letter(doc)
        return right, LETTERS[(LETTERS.index(right) + 1) % len(doc["candidates"].split("|"))]
    if task in STANDIN_TASKS:
        right = _correct(task, doc)
        if task == "scienceqa_img":
            return right, "ABCDE"[(doc["answer"] + 1) % len(doc["choices"])]
        if task == "mmbench_en_dev_static":
            return right, "B" if right == "A" else "A"
        if task in ("mme", "pope"):
            return right, {"yes": "no", "no": "yes"}[right.lower()]
        return right, "zebra"  # open answers: no stand-in's answer is an animal
    right = doc["answer"]
    return right, {"yes": "no", "no": "yes"}.get(right, "zebra")


@pytest.fixture(scope="module")
def judge():
    with LoopbackJudge() as server:
        yield server


@pytest.mark.parametrize("task", STANDIN_TASKS + OFFLINE_TASKS)
def test_a_failed_sample_scores_as_a_wrong_answer_in_each_shipped_task(task, hub_standins, judge, monkeypatch):
    """On every shipped task (the paper's nine on their stand-ins, the offline ones): the first two documents failed
    score exactly as those two answered wrong, and below the all-right score. (MME: the two are one question
    pair.)"""
    for name, value in {"API_TYPE": "openai", "OPENAI_API_KEY": "sk-test", "OPENAI_API_URL": judge.url,
                        "OPENAI_BASE_URL": judge.url}.items():  # MM-Vet's judge, on loopback
        monkeypatch.setenv(name, value)
    metric = YES_NO_ACCURACY.get(task, PRIMARY_METRICS[task][0])
    with serving(hub_standins) if task in STANDIN_TASKS else contextlib.nullcontext():
        docs = load_task(task).eval_docs
        docs = [docs[i] for i in range(min(len(docs), 8))]
        right, wrong = zip(*(_answers(task, d) for d in docs))
        best = score(_rows(task, list(right)))[task][metric]
        answered_wrong = score(_rows(task, list(wrong[:2]) + list(right[2:])))[task][metric]
        failed = score(_rows(task, list(right), failed={0, 1}))[task]
    assert failed["n_failed"] == 2
    assert failed[metric] == pytest.approx(answered_wrong) and answered_wrong < best


def test_a_document_without_a_usable_visual_is_one_failed_request_of_a_video_task(monkeypatch):
    """The request builder takes each document as a clip or an image by its own visual: a first document whose
    doc_to_visual raises (its video column missing) failed every document of the shard, the others as images ('got
    str'). It is one failed request; the others carry their clips."""
    from promprune.eval import requests

    read = requests._document

    def document(task, split, doc_id, name):  # document 0 lacks its video (a broken row)
        doc, error = read(task, split, doc_id, name)
        return ({k: v for k, v in doc.items() if k != "video"} if doc is not None and doc_id == 0 else doc), error

    monkeypatch.setattr(requests, "_document", document)
    rows = build_requests([VIDEO], limit=4)
    assert rows[0].error == f"{VIDEO} doc 0: doc_to_visual failed (KeyError: 'video')" and rows[0].video is None
    assert all(r.error is None and r.video and r.image is None for r in rows[1:])


def test_the_plugin_takes_each_document_by_itself_and_answers_a_failed_one_wrong():
    """lmms-eval's path (PromPruneLMM) decides clip or image per document through the same helper, and answers a
    failed request with FAILED_ANSWER, which MVBench's own aggregation counts in its denominator."""
    from lmms_eval.tasks.mvbench.utils import mvbench_aggregate_results, mvbench_process_results

    from promprune.eval import PromPruneLMM
    from promprune.models import PrunedVLM

    task = load_task(VIDEO)
    task.build_all_requests(limit=4, rank=0, world_size=1)
    lm = PromPruneLMM(vlm=PrunedVLM.from_pretrained("tiny:qwen2_5_vl", method="promprune", budget=8), batch_size=2)
    docs = [dict(d) for d in task.dataset["test"]]
    del docs[0]["video"]
    lm.task_dict[VIDEO] = {"test": docs}
    answers = lm.generate_until(task.instances)
    assert answers[0] == FAILED_ANSWER and FAILED_ANSWER not in answers[1:]
    assert lm.failures == [(VIDEO, 0, f"{VIDEO} doc 0: doc_to_visual failed (KeyError: 'video')")]
    mvbench = [dict(d, candidates=d["candidates"].split("|")) for d in docs[:4]]
    items = [mvbench_process_results(d, [a])["mvbench_accuracy"] for d, a in zip(mvbench, answers)]
    assert mvbench_aggregate_results(items) == 100 * sum(i["score"] for i in items) / 4
