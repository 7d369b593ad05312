"""Prompting and scoring of the offline video task (loaded by lmms-eval through `!function utils.<name>`).

MVBench's own functions (lmms-eval's ``mvbench`` task utils) on documents whose ``candidates`` are stored
``|``-joined (parquet holds scalars); the visual is the clip's mp4 path, as MVBench's.
"""

from lmms_eval.tasks.mvbench.utils import mvbench_aggregate_results, mvbench_doc_to_text, mvbench_process_results


def _mvbench_doc(doc):
    return {**doc, "candidates": doc["candidates"].split("|")}


def doc_to_visual(doc, lmms_eval_specific_kwargs=None):
    return [doc["video"]]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return mvbench_doc_to_text(_mvbench_doc(doc), lmms_eval_specific_kwargs)


def process_results(doc, results):
    return mvbench_process_results(_mvbench_doc(doc), results)


def aggregate_results(results):
    return mvbench_aggregate_results(results)
