"""Prompting and scoring of the offline easy-vqa tasks (loaded by lmms-eval through `!function utils.<name>`).

lmms-eval imports this file by path; the functions live in promprune.eval.offline_metrics (shared with the
prominence testbed's tasks). Docs have the columns question_id, image_id, question, answer and image.
"""

from promprune.eval.offline_metrics import (  # noqa: F401 - re-exported for the task YAMLs
    doc_to_text as easyvqa_doc_to_text,
    doc_to_visual as easyvqa_doc_to_visual,
    normalize_open,
    normalize_yesno,
    open_process_results,
    yesno_accuracy,
    yesno_f1,
    yesno_precision,
    yesno_process_results,
    yesno_recall,
    yesno_yes_ratio,
)
