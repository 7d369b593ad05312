"""A benchmark of one's own, as a user writes it for lmms-eval: a task directory with its YAML (parquet documents,
a ``generate_until`` task scored by ``utils.process_results``) and its ``utils.py``. The tests of task loading,
scoring, plugins and the front door's refusals build their tasks here."""
from __future__ import annotations

from pathlib import Path

TASK_YAML = """task: {name}
dataset_path: parquet
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
process_results: !function utils.process_results
metric_list:
{metrics}
"""

UTILS_HEAD = """from pathlib import Path
def doc_to_visual(doc):
    return []
def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]
"""

SCORES_ONE = "    return {'accuracy': 1.0}"  # process_results' body: every document right


def task_yaml(name: str, *, data: str = "data.parquet", metrics: tuple[str, ...] = ("accuracy",)) -> str:
    """The YAML of task ``name``: documents in ``data`` (relative to the YAML, or absolute), ``metrics`` averaged."""
    listed = "\n".join(f"  - {{metric: {m}, aggregation: mean, higher_is_better: true}}" for m in metrics)
    return TASK_YAML.format(name=name, data=data, metrics=listed)


def utils_py(process_results: str = SCORES_ONE) -> str:
    """``utils.py``: no images, the question as the prompt, and ``process_results(doc, results)`` whose body is
    ``process_results`` (indented code)."""
    return UTILS_HEAD + "def process_results(doc, results):\n" + process_results.rstrip("\n") + "\n"


def write_task(directory: Path, name: str, *, yaml_name: str | None = None, data: str = "data.parquet",
               metrics: tuple[str, ...] = ("accuracy",), process_results: str = SCORES_ONE,
               utils: str | None = None, questions: list[str] | None = None,
               answers: list[str] | None = None) -> Path:
    """Write the task directory ``directory`` (created) for task ``name``: its YAML (``yaml_name``, default
    ``<name>.yaml``), ``utils.py`` (``utils`` whole, else `utils_py` of ``process_results``) and, when
    ``questions`` are given, its documents at ``data`` (answers ``answers``, default "yes"). Returns the YAML's
    path."""
    directory.mkdir(parents=True, exist_ok=True)
    yaml = directory / (yaml_name or f"{name}.yaml")
    yaml.write_text(task_yaml(name, data=data, metrics=metrics))
    (directory / "utils.py").write_text(utils if utils is not None else utils_py(process_results))
    if questions is not None:
        write_documents(directory / data, questions, answers)
    return yaml


def write_documents(path: Path, questions: list[str], answers: list[str] | None = None) -> None:
    """A task's documents: a parquet file of ``question`` and ``answer`` (default "yes") columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"question": questions, "answer": answers or ["yes"] * len(questions)}), path)
