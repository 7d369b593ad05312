"""The paired bootstrap of Rel. (`PairedBootstrap`): the documents resampled once for every trial and the baseline,
against cases worked by hand, on lmms-eval's own task code (easy-vqa's exact match and F1, MME's question pairs)."""
from __future__ import annotations

import weakref

import pytest

from promprune.eval.scoring import PairedBootstrap, TaskItems, sample_items
from promprune.eval.tasks import load_task

from tests.eval.test_scoring import MME, handmade_tasks  # noqa: F401 - the fixture, reused

ITERS = 4000  # enough that every percentile lands well inside one value's mass below


def _rows(task: str, answers: list[str]) -> list[dict]:
    return [{"task": task, "doc_id": i, "n_docs": len(answers), "prediction": a, "error": None}
            for i, a in enumerate(answers)]


def _truth(task: str, n: int) -> list[str]:
    return list(load_task(task).eval_docs_no_media["answer"][:n])


def test_a_difference_in_one_document_is_that_document_resampled():
    """4 documents; the baseline answers all, A the first 3, B the first 2. On every resample the baseline scores
    1, so Rel.(A) - Rel.(B) = k/4 where k ~ Binomial(4, 1/4) counts draws of document 2: P(k <= 2) = 0.949 and
    P(k <= 3) = 0.996, so the 95% interval is [0, 0.75]. Rel.(A) = j/4, j ~ Binomial(4, 3/4): P(j <= 0) = 0.004,
    P(j <= 1) = 0.051, so its interval is [0.25, 1]."""
    truth = _truth("easyvqa_open", 4)
    wrong = ["zzz"] * 4
    items = {"base": sample_items(_rows("easyvqa_open", truth)),
             "A": sample_items(_rows("easyvqa_open", truth[:3] + wrong[3:])),
             "B": sample_items(_rows("easyvqa_open", truth[:2] + wrong[2:]))}
    boot = PairedBootstrap(items, "base", ITERS, seed=1)
    assert boot.difference("A", "B") == pytest.approx((0.25, 0.0, 0.75))
    assert boot.rel("A") == pytest.approx((0.75, 0.25, 1.0))
    assert boot.rel("base") == (1.0, 1.0, 1.0)
    # the same samples unpaired would be far wider: [0.25, 1] against B's [0, 1] (j/4, j ~ Binomial(4, 1/2))
    low, high = boot.rel("B")[1:]
    assert (low, high) == pytest.approx((0.0, 1.0))


def test_identical_answers_differ_by_exactly_nothing_whatever_the_resample():
    truth = _truth("easyvqa_open", 30)
    mixed = [t if i % 3 else "zzz" for i, t in enumerate(truth)]
    items = {"base": sample_items(_rows("easyvqa_open", truth)), "A": sample_items(_rows("easyvqa_open", mixed)),
             "B": sample_items(_rows("easyvqa_open", list(mixed)))}
    boot = PairedBootstrap(items, "base", 500)
    assert boot.difference("A", "B") == (0.0, 0.0, 0.0)
    point, low, high = boot.rel("A")
    assert point == pytest.approx(20 / 30) and low < point < high  # each alone is uncertain


def test_a_yes_found_where_the_other_says_no_never_lowers_f1():
    """Yes/no by F1 (the task's own aggregation over records): A and B differ on one yes-question, A right. On every
    resample A has one more true positive where B has a false negative, so its F1 is never lower."""
    truth = _truth("easyvqa_yesno", 24)
    first_yes = truth.index("yes")
    b = list(truth)
    b[first_yes] = "no"
    items = {"base": sample_items(_rows("easyvqa_yesno", truth)),
             "A": sample_items(_rows("easyvqa_yesno", truth)), "B": sample_items(_rows("easyvqa_yesno", b))}
    boot = PairedBootstrap(items, "base", 1000)
    point, low, high = boot.difference("A", "B")
    assert point > 0 and low >= 0 and high > 0
    assert boot.rel("A") == (1.0, 1.0, 1.0)


def test_mme_resamples_question_pairs_within_subtasks(handmade_tasks):  # noqa: F811
    answers = [m[3] for m in MME]
    rows = _rows("mme_handmade", answers)
    items = sample_items(rows, include_path=handmade_tasks)
    (task,) = items.values()
    # the two image pairs of perception, each resampled whole; the cognition pair carries no item of the primary
    # score (perception, the paper's MME)
    assert task.units() == [[[0, 1], [2, 3]]]
    both = {"base": items, "A": sample_items(rows, include_path=handmade_tasks)}
    boot = PairedBootstrap(both, "base", 200)
    assert boot.rel("A") == (1.0, 1.0, 1.0)


def test_trials_on_other_documents_cannot_be_paired():
    truth = _truth("easyvqa_open", 6)
    items = {"base": sample_items(_rows("easyvqa_open", truth)),
             "short": sample_items(_rows("easyvqa_open", truth)[:4])}
    with pytest.raises(ValueError, match="did not answer the documents of 'easyvqa_open' the baseline did"):
        PairedBootstrap(items, "base", 10)
    with pytest.raises(ValueError, match="baseline 'nobody' is not among the trials"):
        PairedBootstrap(items, "nobody", 10)


class _Drawn(list):
    """A resample's draw that a test can watch (a plain list cannot be weakly referenced)."""


def test_one_resample_is_held_at_a_time():
    """Each resample is scored as it is drawn and let go: at most the draw of all the documents, the last resample
    and the one being drawn are alive at once, however many resamples (holding every resample's draw took ~100 MB
    per 1,000 documents: 1.3 GB for GQA's 12,578, in the driver's summary and in the report). The intervals are the
    same as without the watch."""
    live, most = [0], [0]

    def gone():
        live[0] -= 1

    class Watched(TaskItems):
        def draw(self, picks, units=None):
            drawn = _Drawn(super().draw(picks, units))
            live[0] += 1
            weakref.finalize(drawn, gone)
            most[0] = max(most[0], live[0])
            return drawn

    truth = _truth("easyvqa_open", 30)
    mixed = [t if i % 3 else "zzz" for i, t in enumerate(truth)]
    plain = {"base": sample_items(_rows("easyvqa_open", truth)), "A": sample_items(_rows("easyvqa_open", mixed))}
    watched = {trial: {name: Watched(t.name, t.items, t.aggregations, t.args, t.grouping) for name, t in by.items()}
               for trial, by in plain.items()}
    boot = PairedBootstrap(watched, "base", 200, seed=3)
    assert most[0] <= 3
    assert boot.rel("A") == PairedBootstrap(plain, "base", 200, seed=3).rel("A")
