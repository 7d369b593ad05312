"""Prompting and scoring shared by the offline lmms-eval tasks (easy-vqa, the prominence testbed).

The tasks' ``utils.py`` files (which lmms-eval imports by path, through ``!function utils.<name>``) take these by
absolute import. Docs have at least the columns question and image (decoded to PIL by ``datasets``) and answer.
A prediction with no word in it (the empty one, or ``scoring.FAILED_ANSWER``, what a failed sample is replayed as)
never matches an answer, so it counts as wrong (the yes/no tasks' precision, as POPE's, counts only "yes" answers).
"""

import re

_WORD = re.compile(r"[a-z0-9]+")
_ARTICLES = {"a", "an", "the"}


def doc_to_visual(doc):
    """The document's image as RGB, fully decoded: a 16-bit or float image scaled to 8 bits first (PIL's own
    ``convert("RGB")`` clips it, a 16-bit photo nearly all white), a cut-off one an error (one failed sample)."""
    from promprune.models.images import load_image

    return [load_image(doc["image"], 0)]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question'].strip()}{kwargs.get('post_prompt', '')}"


def normalize_yesno(text):
    """'Yes.' / ' yes, it is' -> 'yes'; 'No' -> 'no'; anything else (empty included) -> 'other'."""
    words = _WORD.findall(str(text).lower())
    first = words[0] if words else ""
    return first if first in ("yes", "no") else "other"


def normalize_open(text):
    """Lower-case words without punctuation or articles: 'A Circle.' -> 'circle'."""
    return " ".join(w for w in _WORD.findall(str(text).lower()) if w not in _ARTICLES)


# ---- yes/no: POPE-style metrics, "yes" is the positive class ----


def yesno_process_results(doc, results):
    record = {
        "question_id": doc["question_id"],
        "prediction": normalize_yesno(results[0]),
        "answer": doc["answer"].strip().lower(),
    }
    return {name: record for name in ("accuracy", "precision", "recall", "f1", "yes_ratio")}


def _counts(records):
    """(true positives, false positives, false negatives) of yes, in one pass."""
    tp = fp = fn = 0
    for r in records:
        said_yes, is_yes = r["prediction"] == "yes", r["answer"] == "yes"
        tp += said_yes and is_yes
        fp += said_yes and r["answer"] == "no"
        fn += not said_yes and is_yes
    return tp, fp, fn


def yesno_accuracy(records):
    return sum(r["prediction"] == r["answer"] for r in records) / len(records)


def _precision(tp, fp):
    return tp / (tp + fp) if tp + fp else 0.0


def _recall(tp, fn):
    return tp / (tp + fn) if tp + fn else 0.0


def yesno_precision(records):
    tp, fp, _ = _counts(records)
    return _precision(tp, fp)


def yesno_recall(records):
    """An 'other' answer to a yes-question is a miss (a false negative), as a wrong answer should be."""
    tp, _, fn = _counts(records)
    return _recall(tp, fn)


def yesno_f1(records):
    tp, fp, fn = _counts(records)
    p, r = _precision(tp, fp), _recall(tp, fn)
    return 2 * p * r / (p + r) if p + r else 0.0


def yesno_yes_ratio(records):
    """Share of predictions that say yes (the POPE paper's yes-ratio)."""
    return sum(r["prediction"] == "yes" for r in records) / len(records)


# ---- open answers ----


def open_process_results(doc, results):
    return {"exact_match": float(normalize_open(results[0]) == normalize_open(doc["answer"]))}
