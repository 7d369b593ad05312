"""Central scoring of predictions gathered from many shards, with lmms-eval's own evaluation loop, and Rel.

``score`` validates the prediction rows (every (task, doc_id) exactly once, none missing), then, per task, runs
lmms-eval's ``evaluator.evaluate`` with a replay model that answers each request with the recorded prediction. So
filters, ``process_results`` and the aggregations are exactly lmms-eval's (MME pairs both answers of a question
inside its aggregation; reasoning blocks stripped first, as its command line does), and everything is aggregated once,
over all shards together. A partial score (``partial``) aggregates the answered documents only, by whole groups where
a task scores groups (MME's pairs, MMBench's circular copies).

Failed samples (``error`` set) are replayed as :data:`FAILED_ANSWER` ("∅", the empty-set sign) and never dropped:
every accuracy metric of the tasks this project ships or runs (exact match, MME, MMBench, MVBench, the offline
tasks, POPE's accuracy) counts it wrong. lmms-eval's POPE precision, recall and F1 (and the offline yes/no tasks'
precision) count only answers that are yes or no, as they leave out a model's "maybe", so there a failed sample
drops out of the ratio instead. Each task's result therefore carries ``n_samples`` and ``n_failed`` (which every
score shown to a person prints beside it). Why not the empty answer, nor a correction by the failed count: see
:data:`FAILED_ANSWER`.

Two things lmms-eval's own loop would turn into a lost trial or a silent number are handled here:

- a spreadsheet writer (MMBench's xlsx submission) refusing an answer's control character: the answers the writer
  cannot hold are cleaned of those characters, the task is scored again, and ``n_cleaned`` counts them;
- an LLM judge (MM-Vet) that gave no grade: lmms-eval records 0.0 (no reply, or its loop giving up on replies it
  cannot read) or asks forever (a number outside [0, 1]); here the judge is asked at most `JUDGE_CALLS` times per
  answer, the sample counts as failed (``n_judge_failed``, included in ``n_failed``) and the task's metrics are
  aggregated over the graded samples only.

Three mistakes in a task's own scoring end its scoring with a `ScoringError` naming the task and the cause, where
lmms-eval's loop would hide them (or end in a long traceback through its own code):

- ``process_results`` raising: lmms-eval retries it 5 times, 2 s apart, and ends in a ``tenacity.RetryError`` that
  names only the exception's type. Here it is called once (lmms-eval's own tasks keep the retries: their
  ``process_results`` may call an LLM judge over the network), and the error says the exception, its message and
  the line of the task's code that raised it;
- a ``metric_list`` metric that ``process_results`` never returns while it returns keys no metric declares (a
  misnamed metric): lmms-eval aggregates only the declared metrics that came back, so the task would have no score;
- an aggregation raising (lmms-eval's ``mean`` over a metric process_results returned as a string, or the task's
  own aggregation): the error names the metric, the aggregation, the exception with its line, and the types of the
  values process_results returned for the metric.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import io
import logging
import math
import numbers
import os
import re
import tempfile
import traceback
from typing import Any

from promprune.eval.tasks import JUDGE_GRADES, load_task, primary_metrics, single_process
from promprune.records import Prediction, values

log = logging.getLogger(__name__)

# characters openpyxl refuses in a cell (C0 controls except tab, newline, carriage return): openpyxl's own rule
SPREADSHEET_ILLEGAL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
# the reasoning blocks lmms-eval's command line strips from every answer before its filters (its --reasoning_tags
# default): an answer "<think>...</think>Yes" scores as "Yes" here as there
LMMS_EVAL_REASONING_TAGS = '[["<think>", "</think>"], ["<analysis>", "</analysis>"]]'


class ScoringError(RuntimeError):
    """A task's own scoring failed, the same way on every try: its ``process_results`` raised, or returned none of
    a metric its ``metric_list`` declares, or an aggregation of its metrics raised. The message names the task and
    the cause."""


def _lmms_eval_code(fn) -> bool:
    """Whether ``fn`` is lmms-eval's own code (a task it ships)."""
    import lmms_eval

    code = getattr(fn, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(os.path.dirname(lmms_eval.__file__))


@contextlib.contextmanager
def _watched(task, name: str):
    """``task.process_results`` while lmms-eval scores: called once (lmms-eval's retries kept for its own tasks'
    code), an exception it raises turned into a `ScoringError` that names it (`_raised`); yields the set that
    collects the keys it returned and the count of the documents it returned NaN for, by key. The aggregations of a
    task of one's own likewise: one that raises (lmms-eval's ``mean`` over a metric whose process_results returned
    strings) is a `ScoringError` naming the task, the metric and the function (`_aggregation_raised`)."""
    import tenacity

    method = type(task).process_results
    user = getattr(task.config, "process_results", None)
    once = method if _lmms_eval_code(user) else getattr(method, "__wrapped__", method)  # tenacity keeps the function
    judge = _JudgeWatch.of(name, user)
    returned: set[str] = set()
    nans: collections.Counter = collections.Counter()

    def process_results(doc, results, **kwargs):
        try:
            out = once(task, doc, results, **kwargs) if judge is None else judge.grade(once, task, doc, results,
                                                                                     **kwargs)
        except Exception as exc:  # noqa: BLE001 - the task's code: any error is named, with where it was raised
            if isinstance(exc, tenacity.RetryError) and exc.last_attempt.failed:
                exc = exc.last_attempt.exception()
            raise ScoringError(_raised(name, user, exc)) from exc
        if isinstance(out, dict):
            returned.update(out)
            nans.update(k for k, v in out.items() if _is_nan(v))
        return out

    aggregations = {metric: fn if _lmms_eval_code(fn) and _lmms_eval_code(user)  # a task lmms-eval ships
                    else _aggregation_watched(name, metric, fn, user) for metric, fn in task.aggregation().items()}
    own = {k: task.__dict__[k] for k in ("process_results", "aggregation") if k in task.__dict__}  # put back after
    task.process_results = process_results  # the instance's: lmms-eval calls task.process_results(doc, results)
    task.aggregation = lambda: aggregations  # and task.aggregation()[metric](items)
    try:
        with judge or contextlib.nullcontext():
            yield returned, nans
    finally:
        del task.process_results, task.aggregation
        task.__dict__.update(own)


JUDGE_CALLS = 8  # judge calls per answer: as many as lmms-eval's MM-Vet makes before it gives up on unparsable replies


class _JudgeWatch:
    """An LLM-judged task's judge while it scores (lmms-eval's MM-Vet: ``get_chat_response`` in its utils, looked
    up when its ``process_results`` runs): each document's replies seen, and at most `JUDGE_CALLS` calls per
    document. lmms-eval's grading loop asks again, without end, while the judge replies with a number outside
    [0, 1], and after 8 unparsable replies records 0.0 with the judge's model named: neither is a grade. Past the
    bound the judge "gives no answer" ("", as a silent judge: lmms-eval records 0.0 and no ``eval_model``), and a
    document whose judge gave no grade gets its record's ``eval_model`` emptied, so `_judge_failures` counts it
    failed, not as 0."""

    def __init__(self, grade: str, module: dict, ask):
        import threading

        self.metric, self.module, self.ask = grade, module, ask
        self.local = threading.local()  # this document's replies: (text, temperature)

    @classmethod
    def of(cls, name: str, user) -> "_JudgeWatch | None":
        """The watch of task ``name`` (``user``: its process_results), None for a task no judge grades."""
        module = getattr(user, "__globals__", None)
        grade = JUDGE_GRADES.get(name)
        if grade is None or module is None or not callable(module.get("get_chat_response")):
            return None
        return cls(grade, module, module["get_chat_response"])

    def __enter__(self):
        self.module["get_chat_response"] = self._bounded
        return self

    def __exit__(self, *exc):
        self.module["get_chat_response"] = self.ask

    def _bounded(self, prompt, *args, **kwargs):
        replies = self.local.replies
        if len(replies) >= JUDGE_CALLS:
            return "", ""  # lmms-eval's "the judge gave no answer": its loop ends
        content, model = self.ask(prompt, *args, **kwargs)
        replies.append((content, kwargs.get("temperature", args[1] if len(args) > 1 else 0.0)))
        return content, model

    def grade(self, process_results, *args, **kwargs):
        """``process_results(*args, **kwargs)``, its grade record's ``eval_model`` emptied when the judge's last
        reply was no grade lmms-eval takes: its loop ends on a grade it parsed (the reply's first word, a number in
        [0, 1]), on an empty reply, or, giving up, right after a reply asked for at temperature 2."""
        self.local.replies = []
        out = process_results(*args, **kwargs)
        record = out.get(self.metric) if isinstance(out, dict) else None
        last = self.local.replies[-1] if self.local.replies else ("", 0.0)
        if isinstance(record, dict) and record.get("eval_model") and (_judge_grade(last[0]) is None or last[1] >= 2):
            out = {**out, self.metric: {**record, "eval_model": ""}}
        return out


def _judge_grade(reply: str) -> float | None:
    """The grade in an MM-Vet judge's reply as lmms-eval's loop reads it (its first word, a number in [0, 1])."""
    try:
        grade = float(reply.split(" ")[0].strip())
    except ValueError:
        return None
    return grade if 0.0 <= grade <= 1.0 else None


def _is_nan(value: Any) -> bool:
    """A real number that is NaN (a float, numpy's floats; not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isnan(value)


def _aggregation_watched(name: str, metric: str, aggregate, user):
    """``aggregate`` (metric ``metric``'s aggregation) as lmms-eval calls it, an exception it raises a `ScoringError`
    (`_aggregation_raised`; a spreadsheet writer's refusal passes, for `_evaluate_answers`); its signature is the
    function's (lmms-eval passes ``args=`` to one that takes it). A task lmms-eval ships keeps its own."""

    from openpyxl.utils.exceptions import IllegalCharacterError

    @functools.wraps(aggregate)
    def watched(items, *args, **kwargs):
        try:
            return aggregate(items, *args, **kwargs)
        except IllegalCharacterError:  # a spreadsheet writer's: `_evaluate_answers` cleans the answers, scores again
            raise
        except Exception as exc:  # noqa: BLE001 - the task's code, or lmms-eval's over the task's values: named
            raise ScoringError(_aggregation_raised(name, metric, aggregate, user, items, exc)) from exc

    return watched


def _raised(name: str, user, exc: BaseException) -> str:
    """The error of a task whose ``process_results`` (``user``: the task's function) raised ``exc``: its type,
    message and the line that raised it (`_where`)."""
    return (f"task {name!r}: its process_results raised {type(exc).__name__}: {exc}{_where(user, exc)}. Fix the "
            "task's code there")


def _where(fn, exc: BaseException) -> str:
    """``, at <file>, line <n>: <code>``: the line that raised ``exc`` (the last frame in ``fn``'s file, else the
    last frame); empty without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    at = ([f for f in frames if f.filename == own] or frames or [None])[-1]
    return "" if at is None else f", at {at.filename}, line {at.lineno}" + (f": {at.line}" if at.line else "")


def _aggregation_raised(name: str, metric: str, aggregate, user, items: list, exc: BaseException) -> str:
    """The error of a task whose aggregation ``aggregate`` of ``metric`` raised ``exc`` over ``items`` (what its
    process_results, ``user``, returned for the metric): the function, the exception and its line, and the values'
    types, with one value that is not a number (the usual cause: lmms-eval's mean over strings)."""
    fn = getattr(aggregate, "__qualname__", repr(aggregate))
    whose = "lmms-eval's " if _lmms_eval_code(aggregate) else ""
    types = sorted({type(v).__name__ for v in items})
    odd = next((v for v in items if not isinstance(v, (int, float)) or isinstance(v, bool)), None)
    code = getattr(user, "__code__", None)
    source = "" if code is None else f" ({code.co_filename}, line {code.co_firstlineno})"
    returned = (f"; its process_results{source} returned {', '.join(types)} values for {metric!r}"
                + (f" (e.g. {odd!r})" if odd is not None else ""))
    return (f"task {name!r}: the aggregation of metric {metric!r}, {whose}{fn}, raised {type(exc).__name__}: "
            f"{exc}{_where(aggregate, exc)}{returned}. Fix process_results to return what the aggregation takes "
            "(numbers, for mean), or the metric's aggregation in the task's metric_list")


def _check_metrics(task, name: str, returned: set[str]) -> None:
    """A `ScoringError` when a metric of the task's ``metric_list`` came back from no document while
    ``process_results`` returned keys no metric declares (or none it declares): lmms-eval would aggregate nothing
    for it. (A declared metric that is absent alone is not an error: MME's cognition score has no document among
    the first perception questions.)"""
    declared = list(task.aggregation())
    missing = [m for m in declared if m not in returned]
    undeclared = sorted(returned - set(declared))
    if missing and (undeclared or len(missing) == len(declared)):
        raise ScoringError(
            f"task {name!r}: its metric_list declares {missing}, which its process_results returned for no "
            f"document (it returned {sorted(returned) or 'no metric'}); name in metric_list the keys "
            f"process_results returns (the first metric is the task's headline score)")


def _replay_model(predictions: dict[tuple[str, int], str]):
    """An lmms-eval model that returns the recorded prediction for each request's (task, doc_id)."""
    from lmms_eval.api.model import lmms

    class Replay(lmms):
        def generate_until(self, requests):
            return [predictions[(req.task_name, int(req.doc_id))] for req in requests]

        def loglikelihood(self, requests):
            raise NotImplementedError("replayed predictions are generations; loglikelihood tasks are not supported")

        def generate_until_multi_round(self, requests):
            raise NotImplementedError("multi-round tasks are not supported")

        def clean(self):
            """Nothing to free: a replay holds no model. (lmms-eval's own clean, run after every evaluation, calls
            gc.collect: ~0.4 s per task scored in a process as large as a sweep's driver or trial.)"""

    return Replay()


def _check_row(row: Any, index: int) -> tuple[str, int]:
    if not isinstance(row, dict):
        raise ValueError(f"prediction {index} must be a dict, got {type(row).__name__}")
    missing = [k for k in ("task", "doc_id", "n_docs", "prediction") if k not in row]
    if missing:
        raise ValueError(f"prediction {index} lacks field(s) {missing}")
    if not isinstance(row["task"], str):
        raise ValueError(f"prediction {index}: task must be a str, got {row['task']!r}")
    try:
        return row["task"], int(row["doc_id"])
    except (TypeError, ValueError):
        raise ValueError(f"prediction {index}: doc_id must be an int, got {row['doc_id']!r}") from None


def _group(predictions: list[dict], partial: bool = False) -> dict[str, dict[int, dict]]:
    """{task: {doc_id: row}}; raises on a duplicate (task, doc_id), a missing doc (unless ``partial``) or
    inconsistent n_docs."""
    by_task: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for i, row in enumerate(predictions):
        task, doc_id = _check_row(row, i)
        if doc_id in by_task[task]:
            raise ValueError(f"({task!r}, doc_id={doc_id}) appears twice in the predictions (rows scored once only)")
        by_task[task][doc_id] = row
    for task, rows in by_task.items():
        sizes = {int(r["n_docs"]) for r in rows.values()}
        if len(sizes) != 1:
            raise ValueError(f"task {task!r}: predictions disagree on n_docs ({sorted(sizes)})")
        (n_docs,) = sizes
        missing = [] if partial else sorted(set(range(n_docs)) - set(rows))
        extra = sorted(set(rows) - set(range(n_docs)))
        if missing or extra:
            raise ValueError(
                f"task {task!r}: expected doc_ids 0..{n_docs - 1}; missing {missing[:20]}"
                f"{' ...' if len(missing) > 20 else ''}{f', out of range {extra[:20]}' if extra else ''}"
            )
    return by_task


def failed(row: dict) -> bool:
    """A row failed when ``error`` holds a message (None, "" and a pandas NaN for a null all mean it did not)."""
    error = row.get("error")
    return isinstance(error, str) and error != ""


# What a failed sample is replayed as. Not "": that is lmms-eval's "no answer given", and some aggregations leave
# such rows out of their denominator (MVBench's, on its tasks and the offline stand-in: 100 x right / answers other
# than "", so 2 right and 2 failed of 4 scored 100.0, not 50.0). Not a correction of the aggregate by the failed
# count either: that needs each aggregation's formula (a rate over the answered, MME's pairs, MMBench's circular
# groups) and a rule written per task, which a task of one's own would lack. A replayed answer instead goes through
# each task's own process_results and aggregation, which score it as any unusable answer: wrong. The empty-set sign
# is not empty after stripping, and holds no letter, digit, word or punctuation that a task's parser reads as an
# answer (a yes / no, an option letter, a number, an option's text), so it is right on none of the shipped tasks
# (tests/eval/test_failed_samples.py pins it on each). The lmms-eval plugin answers a failed request with it too.
FAILED_ANSWER = "\u2205"


def _answer(row: dict) -> str:
    """The text scored for a row: its prediction, or :data:`FAILED_ANSWER` (a wrong answer) when it failed."""
    prediction = row["prediction"]
    return FAILED_ANSWER if failed(row) or not isinstance(prediction, str) else prediction


def _metrics(task_results: dict) -> dict[str, float]:
    """lmms-eval's result entry -> {metric: float}: drop stderr and non-numeric entries, the ',none' filter suffix."""
    out = {}
    for key, value in task_results.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or "_stderr" in key:
            continue
        metric, _, filter_key = key.partition(",")
        out[metric if filter_key in ("", "none") else key] = float(value)
    return out


CI_LEVEL = 0.95
CI_SUFFIXES = ("_ci_low", "_ci_high")
COUNTS = ("n_samples", "n_failed", "n_judge_failed", "n_cleaned")  # what `score` adds beside a task's metrics
NAN_SUFFIX = "_n_nan"  # <metric>_n_nan: the documents process_results returned NaN for (`_nan_counts`)


def is_count(name: str) -> bool:
    """Whether a task's score ``name`` is one of `score`'s sample counts (a metric's NaN documents included) or a
    bound of an interval, not a metric."""
    return name in COUNTS or name.endswith(CI_SUFFIXES + (NAN_SUFFIX,))


def aggregate_with(aggregate, items: list, args=None) -> float:
    """``aggregate(items)`` as lmms-eval calls a task's aggregation: with ``args=`` when its signature takes it
    (MMBench's aggregations write a submission file under ``args.output_path``). Their console prints are muted."""
    with contextlib.redirect_stdout(io.StringIO()):
        if _takes_args(aggregate):
            return aggregate(items, args=args)
        return aggregate(items)


@functools.lru_cache(maxsize=None)
def _takes_args(aggregate) -> bool:
    """Whether a task's aggregation takes ``args=`` (asked once per function: a bootstrap calls it thousands of
    times)."""
    return "args" in inspect.signature(aggregate).parameters


DRAWS_AT_ONCE = 2 ** 20  # document indices a bootstrap draws and holds at once (`bootstrap_ci`): 8 MB


def bootstrap_ci(items: list, aggregate, iters: int, *, seed: int = 0, level: float = CI_LEVEL,
                 args=None) -> tuple[float, float]:
    """Percentile bootstrap interval of ``aggregate(items)``: ``iters`` resamples of the documents with replacement.

    ``items`` are the per-document values lmms-eval's ``process_results`` produced and ``aggregate`` the task's own
    aggregation (a mean, or e.g. POPE-style F1 over records), so any task's metric gets an interval. ``args``: the
    task's ``args`` (lmms-eval's CLI namespace), passed to aggregations that take it.
    """
    import numpy as np

    if not items:
        raise ValueError("no items to resample")
    rng = np.random.default_rng(seed)
    n = len(items)
    means = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items) and aggregate_is_mean(aggregate)
    values = np.asarray(items, dtype=float) if means else None
    stats = []
    # the resamples drawn a chunk of rows at a time (the same draws as all at once: the generator's stream continues
    # across calls), so memory holds ~DRAWS_AT_ONCE indices, not iters x n of them (and as many values gathered for
    # a mean): at 1,000 resamples 200 MB for GQA's 12,578 documents, 3.4 GB for VQAv2-val's 214k, in the trial
    rows = max(1, DRAWS_AT_ONCE // n)
    for start in range(0, iters, rows):
        draws = rng.integers(0, n, size=(min(rows, iters - start), n))
        if means:
            stats.extend(values[draws].mean(axis=1))
        else:
            stats.extend(float(aggregate_with(aggregate, [items[i] for i in row], args)) for row in draws)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(low), float(high)


def aggregate_is_mean(fn) -> bool:
    from lmms_eval.api.metrics import mean

    return fn is mean


def _intervals(task, samples: list[dict], metrics: dict[str, float], iters: int,
               include_path: str | list[str] | None = None) -> dict[str, float]:
    """``<metric>_ci_low`` / ``_ci_high`` for every primary metric of the task (``primary_metrics``; a task of one's
    own found on ``include_path``), resampling the documents that carry it (MME: perception documents only), and for
    tasks scored by groups whole groups (`_grouping`: MME's question pairs, MMBench's circular copies)."""
    out = {}
    aggregations = task.aggregation()
    grouping = _grouping(task)
    for metric in primary_metrics(task.config.task, include_path):
        items = [s[metric] for s in samples if metric in s]
        if metric not in aggregations or metric not in metrics or not items:
            continue
        if grouping:
            low, high = _grouped_bootstrap(items, aggregations[metric], iters, *grouping,
                                           args=getattr(task, "args", None))
        else:
            low, high = bootstrap_ci(items, aggregations[metric], iters, args=getattr(task, "args", None))
        out[metric + CI_SUFFIXES[0]], out[metric + CI_SUFFIXES[1]] = low, high
    return out


def _grouped_bootstrap(records: list[dict], aggregate, iters: int, group_of, relabel, stratum_of, *, args=None,
                       seed: int = 0, level: float = CI_LEVEL) -> tuple[float, float]:
    """An interval for aggregations that score groups of documents together: each resample draws whole groups
    (``group_of(record)``) within each stratum (``stratum_of(record)``), as many as the stratum has, and a group
    drawn twice enters under two labels (``relabel(record, k)``), so the aggregation sees two groups, not one
    group of four."""
    import numpy as np

    strata: dict = {}
    for record in records:
        strata.setdefault(stratum_of(record), {}).setdefault(group_of(record), []).append(record)
    rng = np.random.default_rng(seed)
    stats = []
    for _ in range(iters):
        drawn, k = [], 0
        for groups in strata.values():
            units = list(groups.values())
            for i in rng.integers(0, len(units), size=len(units)):
                drawn += [relabel(r, k) for r in units[i]]
                k += 1
        stats.append(float(aggregate_with(aggregate, drawn, args)))
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(low), float(high)


_CIRCULAR = 1_000_000  # MMBench: the circular copies of question i have index i + c * 1e6
# (group of a record, relabel a record for its k-th draw, stratum of a record)
_MME_GROUPS = (  # MME: the two questions about one image (shared question_id), within each subtask (its score sums
    lambda r: r["question_id"], lambda r, k: {**r, "question_id": f"{r['question_id']}#{k}"},  # subtasks)
    lambda r: r["category"])
_MMBENCH_GROUPS = (  # MMBench: a question with its circular copies (scored together), one stratum
    lambda r: int(r["index"]) % _CIRCULAR, lambda r, k: {**r, "index": k + int(r["index"]) // _CIRCULAR * _CIRCULAR},
    lambda r: 0)
# lmms-eval's process_results (its file under lmms_eval/tasks, its name) whose records a task scores by groups: the
# record shapes the functions above read. By the function, not the task's name: lmms-eval's mme_cc, mme_sci or
# mme_cot_* (other records) and a task of one's own named mme_* are scored document by document; a copy of MME's
# or MMBench's YAML under another name (its process_results lmms-eval's) is grouped
_GROUPED = {
    ("mme/utils.py", "mme_process_results"): _MME_GROUPS,
    **{(f"mmbench/{lang}_utils.py", "mmbench_process_results"): _MMBENCH_GROUPS for lang in ("en", "cn", "ru", "ko")},
}


def _grouping(task):
    """``_GROUPED``'s entry of ``task`` (a loaded lmms-eval task) by its ``process_results``, or None."""
    import lmms_eval

    fn = getattr(task.config, "process_results", None)
    if not _lmms_eval_code(fn):
        return None
    tasks_dir = os.path.join(os.path.dirname(os.path.abspath(lmms_eval.__file__)), "tasks")
    where = os.path.relpath(os.path.abspath(fn.__code__.co_filename), tasks_dir).replace(os.sep, "/")
    return _GROUPED.get((where, fn.__code__.co_name))


def _run_lmms_eval(task, name: str, answers: dict, limit: int | None, output_dir: str,
                   log_samples: bool) -> tuple[dict, collections.Counter]:
    """(lmms-eval's ``evaluate`` over one task, the replay model answering ``answers`` ({(task, doc_id): text}); the
    documents process_results returned NaN for, by metric); a `ScoringError` when the task's ``process_results`` or
    an aggregation raises, or process_results returns none of a metric it declares."""
    from lmms_eval.evaluator import evaluate

    cli_args = argparse.Namespace(process_with_media=False, output_path=output_dir,
                                  reasoning_tags=LMMS_EVAL_REASONING_TAGS)
    with single_process(), _watched(task, name) as (returned, nans):
        results = evaluate(
            lm=_replay_model(answers),
            task_dict={name: task},
            limit=limit,
            bootstrap_iters=0,  # lmms-eval's stderr is not reported; intervals are ours (bootstrap_ci), on request
            log_samples=log_samples,
            distributed_executor_backend="torchrun",  # single process: no accelerate state to set up
            cli_args=cli_args,
            process_docs_parallel=1,
            verbosity="WARNING",
        )
    _check_metrics(task, name, returned)
    return results, nans


def _evaluate_answers(task, name: str, answers: dict, limit, output_dir: str,
                      log_samples: bool) -> tuple[dict, int, collections.Counter]:
    """(lmms-eval's results, answers cleaned, NaN documents by metric: `_run_lmms_eval`): when the task's
    spreadsheet writer refuses a control character, the answers holding one lose those characters and the task is
    scored again (one stray byte costs at most its own sample, never the trial)."""
    from openpyxl.utils.exceptions import IllegalCharacterError  # lmms-eval's xlsx writer (MMBench) uses openpyxl

    try:
        results, nans = _run_lmms_eval(task, name, answers, limit, output_dir, log_samples)
        return results, 0, nans
    except IllegalCharacterError:
        pass
    dirty = {key for key, text in answers.items() if SPREADSHEET_ILLEGAL.search(text)}
    log.warning("%s: the task's spreadsheet writer refused control characters in %d answer(s); scoring them "
                "without those characters", name, len(dirty))
    cleaned = {key: SPREADSHEET_ILLEGAL.sub("", text) if key in dirty else text for key, text in answers.items()}
    results, nans = _run_lmms_eval(task, name, cleaned, limit, output_dir, log_samples)
    return results, len(dirty), nans


def _judge_failures(name: str, samples: list[dict]) -> set[int]:
    """doc_ids whose LLM-judge grade is missing: lmms-eval's MM-Vet records score 0.0 with no ``eval_model`` when
    its judge never answered (and `_JudgeWatch` empties it where the judge gave no grade)."""
    grade = JUDGE_GRADES.get(name)
    if grade is None:
        return set()
    return {int(s["doc_id"]) for s in samples if isinstance(s.get(grade), dict) and not s[grade].get("eval_model")}


def _kept(task, samples: list[dict], skip: set[int]) -> list[dict]:
    """The samples not in ``skip``; for a task scored by groups of documents (`_grouping`: MME's question pairs,
    MMBench's circular copies), less every group with a skipped member: its aggregation scores whole groups only
    (MME's asserts pairs)."""
    kept = [s for s in samples if int(s["doc_id"]) not in skip]
    grouping = _grouping(task)
    if grouping is None:
        return kept
    group_of, _, stratum_of = grouping
    metrics = list(task.aggregation())

    def groups(sample: dict) -> set:
        return {(m, stratum_of(sample[m]), group_of(sample[m])) for m in metrics if m in sample}

    broken = set().union(*(groups(s) for s in samples if int(s["doc_id"]) in skip))
    return [s for s in kept if not groups(s) & broken]


def _aggregate_over(task, kept: list[dict], metrics: dict[str, float]) -> dict[str, float]:
    """The task's metrics aggregated again over ``kept`` (the samples `_kept` leaves), each over those that carry it
    (MME: a perception or a cognition score per document), NaN when none is left."""
    out = dict(metrics)
    for metric, aggregate in task.aggregation().items():
        if metric not in out:
            continue
        values = [s[metric] for s in kept if metric in s]
        out[metric] = float(aggregate_with(aggregate, values, getattr(task, "args", None))) if values \
            else float("nan")
    return out


def _score_task(name: str, rows: dict[int, dict], include_path, output_dir: str,
                bootstrap: int = 0) -> dict[str, float]:
    task = load_task(name, include_path)
    n_docs = len(task.eval_docs)
    covered = int(next(iter(rows.values()))["n_docs"])  # build_requests took the first n_docs documents
    if covered > n_docs:
        raise ValueError(f"task {name!r} has {n_docs} documents, the predictions cover {covered}")
    limit = None if covered == n_docs else covered
    absent = set(range(covered)) - set(rows)  # a partial score: the documents not answered yet
    answers = {(name, doc_id): _answer(rows[doc_id]) if doc_id in rows else "" for doc_id in range(covered)}
    judged = name in JUDGE_GRADES
    results, n_cleaned, nans = _evaluate_answers(task, name, answers, limit, output_dir,
                                                 bootstrap > 0 or judged or bool(absent))
    metrics = _metrics(results["results"][name])
    samples = results.get("samples", {}).get(name, [])
    if absent:
        samples = _kept(task, samples, absent)  # (the intervals resample what the point estimate aggregates)
        metrics = _aggregate_over(task, samples, metrics)
    unjudged = _judge_failures(name, samples) - {d for d, r in rows.items() if failed(r)}
    if unjudged:
        log.warning("%s: the LLM judge gave no grade for %d sample(s); they count as failed, not as 0", name,
                    len(unjudged))
        samples = _kept(task, samples, unjudged)
        metrics = _aggregate_over(task, samples, metrics)
    if bootstrap and samples:
        metrics.update(_intervals(task, samples, metrics, bootstrap, include_path))
    metrics["n_samples"] = len(rows)
    metrics["n_failed"] = sum(failed(r) for r in rows.values()) + len(unjudged)
    if judged:
        metrics["n_judge_failed"] = len(unjudged)
    if n_cleaned:
        metrics["n_cleaned"] = n_cleaned
    if not absent:  # (a running score replays the documents not answered yet as "": their NaNs are not counted)
        metrics.update(_nan_counts(name, nans, task.aggregation(), len(rows)))
    return metrics


def _nan_counts(name: str, nans: collections.Counter, declared, n: int) -> dict[str, int]:
    """``<metric>_n_nan``: how many of the ``n`` documents the task's process_results returned NaN for, for each
    metric of its ``metric_list`` (``declared``) it did, each said in a warning. The metric stays what its
    aggregation makes of them (lmms-eval's mean: NaN), as lmms-eval reports it; the count says why."""
    out = {}
    for metric in declared:
        if nans[metric]:
            log.warning("%s: process_results returned NaN for metric %r on %d of %d sample(s); its score is what the "
                        "aggregation makes of them (a mean: NaN), so check the task's process_results", name, metric,
                        nans[metric], n)
            out[metric + NAN_SUFFIX] = nans[metric]
    return out


def score(
    predictions: list[dict], *, include_path: str | list[str] | None = None, output_dir: str | None = None,
    bootstrap: int = 0, partial: bool = False,
) -> dict[str, dict[str, float]]:
    """Score prediction rows (from any number of shards, in any order): {task: {metric: value, n_samples, n_failed}}.

    Each row is a :class:`promprune.records.Prediction` or a dict with ``task``, ``doc_id``, ``n_docs`` (as
    ``build_requests`` made them), ``prediction`` and optionally ``error``. A (task, doc_id) given twice, a doc_id
    missing from 0..n_docs-1, or a malformed row is a ValueError.
    Metrics are lmms-eval's names without the ',none' filter suffix (e.g. ``pope_f1_score``, ``exact_match``).
    ``output_dir``: where tasks that write submission files (MMBench) put them; a temporary directory by default.
    ``bootstrap``: resamples for 95% percentile-bootstrap intervals of each task's primary metrics (added as
    ``<metric>_ci_low`` / ``<metric>_ci_high``); 0 (default): point estimates only.
    ``partial``: score the documents answered so far (a running score while an evaluation streams in): documents
    missing from 0..n_docs-1 are left out of every aggregation instead of being an error; ``n_samples`` counts the
    answered ones.
    """
    if not isinstance(predictions, list) or not predictions:
        raise ValueError("predictions must be a non-empty list of prediction rows")
    by_task = _group([values(p) if isinstance(p, Prediction) else p for p in predictions], partial)
    with tempfile.TemporaryDirectory(prefix="promprune-score-") as tmp:
        return {name: _score_task(name, rows, include_path, output_dir or tmp, bootstrap)
                for name, rows in by_task.items()}


def primary_score(task: str, metrics: dict[str, float], primary: dict | None = None, *,
                  include_path: str | list[str] | None = None) -> float:
    """The number a paper table shows for ``task``: the sum of its primary metrics (``primary``, else
    ``promprune.eval.tasks.primary_metrics``: one metric for every paper task, MME its perception score; a task of
    one's own, the first metric of its ``metric_list``, found on ``include_path`` as `score` found it)."""
    names = primary.get(task) if primary else (primary_metrics(task, include_path) or None)
    if names is None:
        raise ValueError(f"no primary metric known for task {task!r}; pass primary={{{task!r}: (metric,)}}")
    names = (names,) if isinstance(names, str) else tuple(names)
    missing = [m for m in names if m not in metrics]
    if missing:
        raise ValueError(f"task {task!r}: metric(s) {missing} not in its scores {sorted(metrics)}")
    return float(sum(metrics[m] for m in names))


def relative_score(
    scores: dict[str, dict[str, float]], baseline_scores: dict[str, dict[str, float]], *, primary: dict | None = None,
    include_path: str | list[str] | None = None,
) -> float:
    """Rel. as the paper computes it: per task, primary score / the unpruned baseline's, averaged over tasks.

    Returns a fraction (1.0 = the baseline's accuracy; the paper prints it x100 as a percentage). Every task in
    ``scores`` must be in ``baseline_scores``; a ValueError names a task whose ratio is undefined (a primary score
    NaN on either side, e.g. a partial MME score before any whole question pair, or the baseline's 0) instead of
    averaging over the others. ``primary`` overrides ``primary_metrics`` ({task: (metric, ...)}); ``include_path``:
    where a task of one's own is found (as `score` took it).
    """
    if not scores:
        raise ValueError("scores is empty")
    missing = sorted(set(scores) - set(baseline_scores))
    if missing:
        raise ValueError(f"baseline_scores lacks task(s) {missing}")
    ours = {task: primary_score(task, metrics, primary, include_path=include_path) for task, metrics in scores.items()}
    base = {task: primary_score(task, baseline_scores[task], primary, include_path=include_path) for task in scores}
    for task in scores:
        for whose, value in (("the scores'", ours[task]), ("the baseline's", base[task])):
            if value != value:
                raise ValueError(f"task {task!r}: {whose} primary score is NaN (no document it could aggregate), Rel. "
                                 "is undefined")
    zero = [task for task, value in base.items() if value == 0]
    if zero:
        raise ValueError(f"task {zero[0]!r}: the baseline's primary score is 0, Rel. is undefined")
    return mean_ratio(ours, base)


def mean_ratio(ours: dict[str, float], base: dict[str, float]) -> float:
    """The mean over the tasks of ``ours`` of ``ours[task] / base[task]``; NaN when any of these ratios is undefined
    (`ratio_tasks`: a score absent or NaN, the baseline's 0) or ``ours`` is empty: a task is never left out of the
    average silently. The one rule of Rel.: ``relative_score`` checks its inputs first and raises instead; the
    report's tables average a row over its `ratio_tasks` explicitly and say how many (``rel_counts``)."""
    if not ours or len(ratio_tasks(ours, base)) < len(ours):
        return float("nan")
    return sum(ours[t] / base[t] for t in ours) / len(ours)


def ratio_tasks(ours: dict[str, float], base: dict[str, float]) -> list[str]:
    """The tasks of ``ours`` whose ratio to ``base`` is defined: both scores present and not NaN, the baseline's not
    0 (:func:`mean_ratio` is NaN unless every task of ``ours`` is among them)."""
    return [t for t in ours if t in base and base[t] == base[t] and ours[t] == ours[t] and base[t] != 0]


# ---------------------------------------------------------------------------------------------------------------
# paired differences: several trials and the baseline on the same resamples of the documents


class TaskItems:
    """One task's per-document items (what lmms-eval's ``process_results`` produced) for its primary metrics, with
    the task's own aggregations: what a paired bootstrap resamples. Built by `sample_items`."""

    def __init__(self, name: str, items: dict[str, dict[int, Any]], aggregations: dict, args=None, grouping=None):
        """``grouping``: the task's `_grouping` (None: each document scored alone)."""
        self.name, self.items, self.aggregations, self.args = name, items, aggregations, args
        self.grouping = grouping

    @property
    def doc_ids(self) -> list[int]:
        return sorted(set().union(*[set(d) for d in self.items.values()])) if self.items else []

    def units(self) -> list[list[list[int]]]:
        """The resampling units by stratum: each a list of doc ids scored together (one document, or for MME and
        MMBench a question pair / a question with its circular copies, within its subtask)."""
        if self.grouping is None:
            return [[[d] for d in self.doc_ids]]
        group_of, _, stratum_of = self.grouping
        metric = next(iter(self.items))
        strata: dict = {}
        for doc, record in sorted(self.items[metric].items()):
            strata.setdefault(stratum_of(record), {}).setdefault(group_of(record), []).append(doc)
        return [list(groups.values()) for groups in strata.values()]

    def draw(self, picks: list, units: list | None = None) -> list[tuple[int, int]]:
        """The documents of the units ``picks[i]`` (indices into stratum i's `units`; ``units``: those, when already
        at hand) as `score` takes them: each ``(doc id, k)``, k numbering the units drawn (a group drawn twice enters
        as two groups; every unit drawn once, as the task's own groups)."""
        drawn, k = [], 0
        for stratum, chosen in zip(self.units() if units is None else units, picks):
            for i in chosen:
                drawn += [(d, k) for d in stratum[i]]
                k += 1
        return drawn

    def score(self, drawn: list[tuple[int, int]]) -> float:
        """The task's primary score (the sum of its primary metrics, as `primary_score`) over the drawn documents
        (`draw`): ``(doc id, k)``, k numbering the units drawn, by which a grouped task's records are relabelled."""
        total = 0.0
        for metric, by_doc in self.items.items():
            if self.grouping is None:
                values = [by_doc[d] for d, _ in drawn]
            else:
                relabel = self.grouping[1]
                values = [relabel(by_doc[d], k) for d, k in drawn]
            total += float(aggregate_with(self.aggregations[metric], values, self.args))
        return total


def sample_items(predictions: list[dict], *, include_path: str | list[str] | None = None,
                 output_dir: str | None = None) -> dict[str, TaskItems]:
    """Per task, the per-document items of its primary metrics (lmms-eval's own ``process_results`` over the
    predictions, as `score` replays them; failed samples as :data:`FAILED_ANSWER`). Rows as `score` takes them."""
    if not isinstance(predictions, list) or not predictions:
        raise ValueError("predictions must be a non-empty list of prediction rows")
    by_task = _group([values(p) if isinstance(p, Prediction) else p for p in predictions], partial=True)
    out = {}
    with tempfile.TemporaryDirectory(prefix="promprune-items-") as tmp:
        for name, rows in by_task.items():
            task = load_task(name, include_path)
            covered = int(next(iter(rows.values()))["n_docs"])
            limit = None if covered == len(task.eval_docs) else covered
            answers = {(name, d): _answer(rows[d]) if d in rows else "" for d in range(covered)}
            results, _, _ = _evaluate_answers(task, name, answers, limit, output_dir or tmp, True)
            samples = [s for s in results.get("samples", {}).get(name, []) if int(s["doc_id"]) in rows]
            aggregations = task.aggregation()
            items = {m: {int(s["doc_id"]): s[m] for s in samples if m in s}
                     for m in primary_metrics(name, include_path) if m in aggregations}
            out[name] = TaskItems(name, {m: v for m, v in items.items() if v}, aggregations,
                                  getattr(task, "args", None), _grouping(task))
    return out


class PairedBootstrap:
    """Rel. of several trials on the same resamples: each resample draws the documents of every task (whole groups
    for MME and MMBench, within their strata) with replacement, once, and every trial and the baseline are scored
    on that same draw. So a difference between two trials is resampled as a difference (paired): documents both
    answer alike cancel, and the interval says whether a gap is noise. Rel. per resample is `mean_ratio` of each
    task's primary score over the baseline's (NaN on a resample where a ratio is undefined, e.g. the baseline's F1
    0 on a draw without a "yes" question; the percentiles leave such resamples out). On all the documents it is
    `relative_score` of the same predictions; a task whose baseline score is 0 or NaN there is a ValueError.

    ``items``: {trial: `sample_items`(its predictions)}, every trial on the same documents; ``baseline``: the key of
    the unpruned trial. `rel` / `difference` give (point, low, high) as fractions of the baseline (x100: points)."""

    def __init__(self, items: dict[str, dict[str, TaskItems]], baseline: str, iters: int, *, seed: int = 0,
                 level: float = CI_LEVEL):
        import numpy as np

        if baseline not in items:
            raise ValueError(f"baseline {baseline!r} is not among the trials {sorted(items)}")
        tasks = sorted(items[baseline])
        for trial, by_task in items.items():
            for task in tasks:
                if task not in by_task or by_task[task].doc_ids != items[baseline][task].doc_ids:
                    raise ValueError(f"trial {trial!r} did not answer the documents of {task!r} the baseline did: a "
                                     "paired bootstrap needs the same documents")
        self.items, self.baseline, self.level, self.tasks = items, baseline, level, tasks
        rng = np.random.default_rng(seed)
        units = {t: items[baseline][t].units() for t in tasks}
        sizes = {t: [len(stratum) for stratum in units[t]] for t in tasks}
        # all the documents: every unit once, numbered as a resample numbers its draws (a grouped task's records are
        # relabelled by that number: MMBench's index, so one number for all would make its questions one group)
        full = {t: items[baseline][t].draw([range(n) for n in sizes[t]], units[t]) for t in tasks}
        base = {t: items[baseline][t].score(full[t]) for t in tasks}
        undefined = [t for t in tasks if t not in ratio_tasks(base, base)]
        if undefined:  # as `relative_score`: Rel. over the other tasks would be another number than the sweep's
            raise ValueError(f"task {undefined[0]!r}: the baseline's primary score on all the documents is "
                             f"{base[undefined[0]]}, Rel. is undefined")
        self.point = self._rels(full)
        # each resample scored as it is drawn, and let go: the draws of every resample held at once took ~100 MB per
        # 1,000 documents (1,000 resamples of (doc id, k) tuples), ~1.3 GB for GQA's 12,578 in the driver and the
        # report; the same draws in the same order, so the same intervals
        per_draw = []
        for _ in range(iters):
            drawn = {t: items[baseline][t].draw([rng.integers(0, n, size=n) for n in sizes[t]], units[t])
                     for t in tasks}
            per_draw.append(self._rels(drawn))
        self.samples = {trial: np.array([rels[trial] for rels in per_draw]) for trial in items}

    def _rels(self, drawn: dict[str, list]) -> dict[str, float]:
        """Every trial's Rel. on one draw of the documents."""
        scores = {trial: {t: self.items[trial][t].score(drawn[t]) for t in self.tasks} for trial in self.items}
        return {trial: mean_ratio(scores[trial], scores[self.baseline]) for trial in self.items}

    def _interval(self, values) -> tuple[float, float]:
        import numpy as np

        tail = (1 - self.level) / 2 * 100
        low, high = np.nanpercentile(values, [tail, 100 - tail])
        return float(low), float(high)

    def rel(self, trial: str) -> tuple[float, float, float]:
        """(Rel. on all the documents, the interval's low, high)."""
        return (self.point[trial], *self._interval(self.samples[trial]))

    def difference(self, a: str, b: str) -> tuple[float, float, float]:
        """(Rel. of ``a`` - Rel. of ``b`` on all the documents, the paired interval's low, high)."""
        return (self.point[a] - self.point[b], *self._interval(self.samples[a] - self.samples[b]))
