"""Whether lmms-eval can load a task here (`promprune.eval.task_checks`), checked against lmms-eval itself: where
the check finds a task's data, lmms-eval loads the task from that file; where it does not, it names the paths that
lmms-eval and `datasets` would try; an unreadable task YAML is named with its line (issue 49)."""
from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from promprune.eval import task_checks, tasks
from tests.own_task import task_yaml, write_documents, write_task


def task_dir(root: Path, name: str, data: str, utils: str | None = None) -> Path:
    d = root / name
    write_task(d, name, data=data, utils=utils)
    return d


parquet = write_documents


def problems(name: str, d: Path) -> list[str]:
    manager = tasks.task_manager([name], [str(d)])
    return task_checks.task_problems(manager, [name], [str(d)])


def test_relative_data_is_found_where_lmms_eval_and_datasets_read_it(tmp_path, monkeypatch):
    """Beside the YAML (lmms-eval's rewrite) or, failing that, in the working directory (`datasets`): the check
    and lmms-eval's own loader agree on which file holds the documents."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    beside = task_dir(tmp_path, "own_beside", "data/q.parquet")
    parquet(beside / "data" / "q.parquet", ["beside 1", "beside 2"])
    parquet(work / "data" / "q.parquet", ["cwd"])
    assert problems("own_beside", beside) == []
    docs = tasks.load_task("own_beside", [str(beside)]).test_docs()
    assert [d["question"] for d in docs] == ["beside 1", "beside 2"]  # the folder's file wins over the cwd's

    in_cwd = task_dir(tmp_path, "own_in_cwd", "data/q.parquet")  # nothing beside this YAML
    assert problems("own_in_cwd", in_cwd) == []
    assert [d["question"] for d in tasks.load_task("own_in_cwd", [str(in_cwd)]).test_docs()] == ["cwd"]

    missing = task_dir(tmp_path, "own_missing", "data/nope.parquet")
    (problem,) = problems("own_missing", missing)
    assert problem.startswith(f"task 'own_missing' ({missing / 'own_missing.yaml'}): dataset_kwargs.data_files.test "
                              "'data/nope.parquet' was not found")
    assert f"beside the task's YAML ({missing / 'data' / 'nope.parquet'})" in problem
    assert f"from the working directory ({work / 'data' / 'nope.parquet'}); neither exists" in problem


def test_absolute_and_pattern_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    absent = task_dir(tmp_path, "own_absolute", str(tmp_path / "gone.parquet"))
    (problem,) = problems("own_absolute", absent)
    assert f"dataset_kwargs.data_files.test {tmp_path / 'gone.parquet'} does not exist" in problem
    pattern = task_dir(tmp_path, "own_pattern", "'shards/*.parquet'")
    (problem,) = problems("own_pattern", pattern)
    assert f"matches no file in the working directory ({tmp_path / 'shards' / '*.parquet'})" in problem
    parquet(tmp_path / "shards" / "a.parquet", ["a"])
    assert problems("own_pattern", pattern) == []


def test_a_task_whose_code_does_not_import_is_named(tmp_path):
    broken = task_dir(tmp_path, "own_code", str(tmp_path / "q.parquet"), utils="def doc_to_visual(doc:\n")
    parquet(tmp_path / "q.parquet", ["q"])
    (problem,) = problems("own_code", broken)
    assert problem.startswith(f"task 'own_code' ({broken / 'own_code.yaml'}) does not load: ")
    assert "SyntaxError" in problem and f"({broken / 'utils.py'}, line 1)" in problem


def test_an_unreadable_task_file_is_named_with_its_line(tmp_path):
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "good.yaml").write_text(task_yaml("own_good", data="q.parquet"))
    (d / "bad.yaml").write_text("task: own_bad\ndataset_kwargs: {data_files: {test: q.parquet}\ntest_split: test\n")
    (d / "half.yaml").write_text("include: _missing_template.yaml\ntask: own_half\n")
    with pytest.raises(task_checks.TaskFileError) as raised:
        tasks.task_manager(["own_good"], [str(d)])  # a good task of the directory: lmms-eval reads every file
    bad, half = raised.value.problems
    assert bad.startswith(f"task 'own_bad': its YAML {d / 'bad.yaml'} is not valid YAML at line 3, column 1: "
                          "expected ',' or '}'")
    assert "(while parsing a flow mapping that starts at line 2, column 17)" in bad
    assert bad.endswith("so this file stops every task there; fix the YAML there (a bracket, quote or colon "
                        "missing, or the indentation), or move the file out of the directory")
    assert half.startswith(f"task 'own_half': its YAML {d / 'half.yaml'} includes ") and \
        "_missing_template.yaml, which does not exist" in half


def test_a_hub_dataset_not_cached_offline_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    problem = task_checks.hub_problem("pope", "pope.yaml", "lmms-lab-encoder/POPE")
    assert problem.startswith("task 'pope' (pope.yaml) reads the Hugging Face hub dataset 'lmms-lab-encoder/POPE', "
                              f"which is not in this machine's datasets cache ({tmp_path / 'cache'}), and "
                              "HF_HUB_OFFLINE")
    (tmp_path / "cache" / "lmms-lab-encoder___pope").mkdir(parents=True)  # datasets' own cache layout
    assert task_checks.hub_problem("pope", "pope.yaml", "lmms-lab-encoder/POPE") is None


def test_a_split_the_data_does_not_have_is_named_before_loading_and_when_loading(tmp_path, monkeypatch):
    """``test_split: validation`` while ``data_files`` has only ``test``: lmms-eval's loader fails on
    ``dataset['validation']``; the check names the split and the data's splits before anything loads, and a load
    that fails on it says so (no word of the hub's network)."""
    wrong = task_dir(tmp_path, "own_split", "q.parquet")
    yaml_path = wrong / "own_split.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("test_split: test", "test_split: validation"))
    parquet(wrong / "q.parquet", ["q"])
    with pytest.raises(KeyError, match="validation"):  # lmms-eval itself, the check out of the way
        from lmms_eval.tasks import get_task_dict

        get_task_dict(["own_split"], tasks.task_manager(["own_split"], [str(wrong)]))
    (problem,) = problems("own_split", wrong)
    assert problem == (f"task 'own_split' ({yaml_path}) evaluates test_split: validation, a split its data does not "
                       "have: its dataset_kwargs.data_files names the split(s) ['test']. Set test_split to one of "
                       "['test'], or key the data file by 'validation' in dataset_kwargs.data_files")

    one = task_dir(tmp_path, "own_one_file", "q.parquet")
    one_yaml = one / "own_one_file.yaml"  # data_files: one path (absolute: lmms-eval resolves only keyed ones)
    one_yaml.write_text(one_yaml.read_text().replace("{test: q.parquet}", str(one / "q.parquet")))
    parquet(one / "q.parquet", ["q"])
    assert list(datasets.load_dataset("parquet", data_files=str(one / "q.parquet"))) == ["train"]
    (problem,) = problems("own_one_file", one)
    assert "dataset_kwargs.data_files is not keyed by split, so `datasets` names its one split 'train'" in problem
    right = task_dir(tmp_path, "own_right", "q.parquet")
    parquet(right / "q.parquet", ["q"])
    assert problems("own_right", right) == []

    monkeypatch.setattr(task_checks, "split_problem", lambda task, path: None)  # as a load finds it at run time
    with pytest.raises(tasks.TaskUnavailableError) as raised:
        tasks.load_task("own_split", [str(wrong)])
    assert str(raised.value) == (f"task 'own_split' ({yaml_path}) evaluates test_split: validation, a split its "
                                 "data does not have (its data has the split(s) ['test']); set test_split to a "
                                 "split of the dataset")
