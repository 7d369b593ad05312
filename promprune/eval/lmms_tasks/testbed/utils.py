"""Prompting and scoring of the prominence testbed's tasks (loaded by lmms-eval through `!function utils.<name>`).

lmms-eval imports this file by path; the functions live in promprune.eval.offline_metrics. Docs: see
promprune.testbed.tasks (question, answer, image, family, category and the scene's ground truth).
"""

from promprune.eval.offline_metrics import (  # noqa: F401 - re-exported for the task YAMLs
    doc_to_text,
    doc_to_visual,
    open_process_results,
    yesno_accuracy,
    yesno_f1,
    yesno_precision,
    yesno_process_results,
    yesno_recall,
    yesno_yes_ratio,
)
