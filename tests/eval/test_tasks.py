"""Offline easy-vqa tasks and request rows, checked against the easy-vqa package read directly."""

import io
import json
from pathlib import Path

import easy_vqa
import numpy as np
import pytest
from PIL import Image

from promprune.eval.tasks import TESTBED_TASKS
from promprune.eval import EASYVQA_TASKS, build_requests, judge_skip_reason, prepare_offline_tasks
from promprune.eval.tasks import load_task

POST_PROMPT = "\nAnswer the question using a single word or phrase."


@pytest.fixture(scope="module")
def easyvqa_questions():
    """(question, answer, image_id) of the test split, read from the package's JSON without its helpers."""
    root = Path(easy_vqa.__file__).parent / "data" / "test"
    return json.loads((root / "questions.json").read_text()), root / "images"


def test_prepare_is_idempotent_and_writes_both_tasks():
    from promprune.eval.tasks import offline_data_dir

    first = prepare_offline_tasks()
    data = offline_data_dir("easyvqa")
    stamps = {p: p.stat().st_mtime_ns for folder in (first, data) for p in folder.iterdir()}
    assert prepare_offline_tasks() == first
    assert {p: p.stat().st_mtime_ns for folder in (first, data) for p in folder.iterdir()} == stamps  # none rewritten
    assert {f"{t}.yaml" for t in EASYVQA_TASKS} <= {p.name for p in first.iterdir()}
    assert {f"{t}.parquet" for t in EASYVQA_TASKS} <= {p.name for p in data.iterdir()}
    assert first.parent == data.parent and first.name.startswith(f"{data.name}-")  # easyvqa_v1-<hash>
    testbed = prepare_offline_tasks("testbed")
    assert testbed != first and {f"{t}.yaml" for t in TESTBED_TASKS} <= {p.name for p in testbed.iterdir()}
    with pytest.raises(ValueError, match="unknown offline task suite 'nope'; valid: easyvqa, testbed"):
        prepare_offline_tasks("nope")


def _other_checkout(tmp_path, monkeypatch, name: str, post_prompt: str | None = None) -> Path:
    """This cache's easy-vqa data copied under ``tmp_path / "cache"`` (the data is the same: only the definitions'
    source differs) and a copy of the package's task folder at ``tmp_path / name`` in use, its prompt's suffix
    changed to ``post_prompt`` when given: another checkout, of another version of the definitions."""
    import shutil

    import yaml

    from promprune.eval import tasks as tasks_module

    named = yaml.safe_load((prepare_offline_tasks() / "easyvqa_yesno.yaml").read_text())
    ours = Path(named["dataset_kwargs"]["data_files"]["test"]).parent  # where this cache's data is
    checkout = tmp_path / name / "lmms_tasks"
    shutil.copytree(Path(tasks_module.__file__).parent / "lmms_tasks", checkout)  # the package's own
    if post_prompt is not None:
        common = checkout / "easyvqa" / "_easyvqa_common_yaml"
        text = common.read_text()
        assert POST_PROMPT.replace("\n", "\\n") in text
        common.write_text(text.replace(POST_PROMPT.replace("\n", "\\n"), post_prompt.replace("\n", "\\n")))
    monkeypatch.setenv("PROMPRUNE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "cache" / "lmms_tasks" / ours.name
    if not data.exists():
        data.mkdir(parents=True)
        for parquet in ours.glob("*.parquet"):
            shutil.copy(parquet, data / parquet.name)
    monkeypatch.setattr(tasks_module, "_LMMS_TASKS", checkout)
    return checkout


def _loaded(root: Path) -> tuple[str, str]:
    """(the post prompt, the answer read from "Yes, it is.") of easyvqa_yesno as lmms-eval loads it from ``root``
    alone."""
    from lmms_eval.tasks import TaskManager, get_task_dict

    from promprune.eval import tasks as tasks_module

    manager = TaskManager("WARNING", include_path=[str(root)], include_defaults=False)
    with tasks_module.single_process():
        task = get_task_dict(["easyvqa_yesno"], manager)["easyvqa_yesno"]
    doc = task.test_docs()[0]
    assert task.config.generation_kwargs["max_new_tokens"] > 0
    prompt = task.config.lmms_eval_specific_kwargs["default"]["post_prompt"]
    return prompt, task.process_results(doc, ["Yes, it is."])["accuracy"]["prediction"]


def test_the_prepared_folder_holds_its_definitions_and_outlives_the_checkout(tmp_path, monkeypatch):
    """The task folder copies the packaged definitions it includes: prepared by another checkout (a copy of the
    package's task folder) that is then deleted, lmms-eval still loads its tasks, with no path into that checkout.
    Before, each YAML said ``include: <that checkout>/...`` and loading failed with FileNotFoundError."""
    import shutil

    ours = prepare_offline_tasks()
    checkout = _other_checkout(tmp_path, monkeypatch, "other_checkout")
    root = prepare_offline_tasks()
    assert root.parent == tmp_path / "cache" / "lmms_tasks"
    shutil.rmtree(checkout)
    written = [p for p in root.iterdir() if p.is_file() and p.suffix != ".parquet"]
    names = {p.name for p in written}
    assert {"easyvqa_yesno.yaml", "_easyvqa_yesno_yaml", "_easyvqa_common_yaml", "utils.py"} <= names
    assert not [p.name for p in written if str(checkout) in p.read_text()]
    assert _loaded(root) == (POST_PROMPT, "yes")
    monkeypatch.undo()  # this checkout prepares its own cache as before
    assert prepare_offline_tasks() == ours


def test_two_versions_of_the_definitions_prepared_in_turn_each_keep_their_own_folder(tmp_path, monkeypatch):
    """Two checkouts (or versions of the task definitions) share a machine's cache: each prepared the one folder of
    the suite, and the last to prepare won: the first then loaded the second's definitions. Now each content gets
    its own folder (named by its hash), and preparing one never changes the other's."""
    _other_checkout(tmp_path, monkeypatch, "a")
    a = prepare_offline_tasks()
    a_files = {p.name: p.read_bytes() for p in a.iterdir()}
    asked = "\nAnswer yes or no."
    _other_checkout(tmp_path, monkeypatch, "b", post_prompt=asked)
    b = prepare_offline_tasks()
    assert b != a and b.parent == a.parent
    assert {p.name: p.read_bytes() for p in a.iterdir()} == a_files  # the first's folder as it wrote it
    assert _loaded(a) == (POST_PROMPT, "yes") and _loaded(b) == (asked, "yes")
    _other_checkout(tmp_path, monkeypatch, "a2")  # the first version again (another copy of it): its own folder
    assert prepare_offline_tasks() == a


def test_tasks_partition_the_test_split(easyvqa_questions):
    questions, _ = easyvqa_questions
    yesno, open_ = load_task("easyvqa_yesno"), load_task("easyvqa_open")
    n_yes_no = sum(a in ("yes", "no") for _, a, _ in questions)
    assert len(yesno.eval_docs) == n_yes_no
    assert len(open_.eval_docs) == len(questions) - n_yes_no
    assert set(yesno.eval_docs_no_media["answer"]) == {"yes", "no"}
    assert not set(open_.eval_docs_no_media["answer"]) & {"yes", "no"}


def test_request_rows_match_the_source(easyvqa_questions):
    questions, image_dir = easyvqa_questions
    rows = build_requests(["easyvqa_yesno", "easyvqa_open"], limit=5)
    assert [(r.task, r.doc_id) for r in rows] == [("easyvqa_yesno", i) for i in range(5)] + [
        ("easyvqa_open", i) for i in range(5)
    ]
    yesno_source = [q for q in questions if q[1] in ("yes", "no")]
    open_source = [q for q in questions if q[1] not in ("yes", "no")]
    for row in rows:
        question, _, image_id = (yesno_source if row.task == "easyvqa_yesno" else open_source)[row.doc_id]
        assert row.prompt == question + POST_PROMPT
        assert row.n_docs == 5 and row.error is None
        assert row.gen_kwargs["max_new_tokens"] == 16 and row.gen_kwargs["do_sample"] is False
        ours = np.asarray(Image.open(io.BytesIO(row.image)).convert("RGB"))
        source = np.asarray(Image.open(image_dir / f"{image_id}.png").convert("RGB"))
        np.testing.assert_array_equal(ours, source)


def test_shards_partition_the_rows():
    full = build_requests(["easyvqa_yesno", "easyvqa_open"], limit=7)
    shards = [build_requests(["easyvqa_yesno", "easyvqa_open"], limit=7, shard=(i, 3)) for i in range(3)]
    key = lambda r: (r.task, r.doc_id)  # noqa: E731
    assert sorted(map(key, (r for s in shards for r in s))) == sorted(map(key, full))
    assert sum(map(len, shards)) == len(full) == 14
    assert all(r.n_docs == 7 for s in shards for r in s)
    by_key = {key(r): r for r in full}
    assert all(r == by_key[key(r)] for s in shards for r in s)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="limit"):
        build_requests(["easyvqa_open"], limit=0)
    with pytest.raises(ValueError, match="tasks"):
        build_requests("easyvqa_open")
    with pytest.raises(ValueError, match="shard"):
        build_requests(["easyvqa_open"], shard=(3, 3))
    with pytest.raises(ValueError, match="twice"):
        build_requests(["easyvqa_open", "easyvqa_open"])
    with pytest.raises(ValueError, match="easyvqa_yesno"):  # the suggestion names the near miss
        build_requests(["easyvqa_yesnoo"], limit=1)


def test_judge_task_without_key_is_skipped(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("API_TYPE", raising=False)
    assert "OPENAI_API_KEY" in judge_skip_reason("mmvet")
    assert judge_skip_reason("pope") is None
    import lmms_eval.tasks  # noqa: F401 - importing lmms-eval resets warning filters: do it before pytest.warns

    with pytest.warns(UserWarning, match="mmvet.*OPENAI_API_KEY"):
        rows = build_requests(["easyvqa_open", "mmvet"], limit=2)
    assert {r.task for r in rows} == {"easyvqa_open"}
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert judge_skip_reason("mmvet") is None


@pytest.mark.slow
def test_hub_task_without_network_fails_clearly(monkeypatch):
    """Hub benchmarks load unchanged from lmms-eval; with no network the error says what and what to do instead."""
    from promprune.eval import TaskUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(TaskUnavailableError, match=r"'pope'.*Hugging Face hub.*easyvqa_yesno"):
        build_requests(["pope"], limit=1)


def test_every_testbed_tasks_primary_metric_is_one_its_yaml_declares():
    """The report's column for a testbed task reads PRIMARY_METRICS; a name the task never logs shows as "-"
    (testbed_relation logged accuracy while the table asked for exact_match)."""
    import re
    from pathlib import Path

    from promprune.eval.tasks import PRIMARY_METRICS, TESTBED_TASKS

    folder = Path(__file__).resolve().parents[2] / "promprune" / "eval" / "lmms_tasks" / "testbed"
    for task in TESTBED_TASKS:
        declared = set(re.findall(r"- metric: (\w+)", (folder / f"_{task}_yaml").read_text()))
        assert set(PRIMARY_METRICS[task]) <= declared, (task, PRIMARY_METRICS[task], declared)
    assert PRIMARY_METRICS["testbed_relation"] == ("accuracy",)


def test_writing_a_task_file_prints_no_progress_bar(tmp_path, capsys):
    """A fresh machine's first sweep writes the offline tasks' parquet files before its console starts: datasets'
    "Creating parquet from Arrow format" bars led the documented output. The caller's setting is kept."""
    import datasets

    from promprune.eval.tasks import _write_parquet

    _write_parquet({"question": ["q"], "answer": ["a"]}, tmp_path / "t.parquet")
    captured = capsys.readouterr()
    assert "Creating parquet" not in captured.err + captured.out and (tmp_path / "t.parquet").is_file()
    assert not datasets.are_progress_bars_disabled()  # enabled before, enabled after


def test_first_document_placeholder_is_scoped_to_the_thread_inside_the_block():
    """Only the thread building a task decodes a bad image as a placeholder: another thread decoding at the same time
    still gets the decoder's error, blocks on two threads at once do not undo each other, and after every block the
    decoder is strict again (the old code swapped ``datasets``' class method for the whole process)."""
    import threading

    from datasets.features import Image as ImageFeature

    from promprune.eval.tasks import first_document_undecoded

    feature = ImageFeature()
    bad = {"bytes": b"not an image", "path": None}

    def strict_fails() -> bool:
        try:
            feature.decode_example(bad)
        except Exception:  # noqa: BLE001 - PIL's own error type
            return True
        return False

    inside, release, outcome = threading.Event(), threading.Event(), {}

    def builder():
        with first_document_undecoded():
            outcome["builder"] = feature.decode_example(bad).size
            inside.set()
            release.wait(10)
            outcome["builder_after_other"] = feature.decode_example(bad).size

    t = threading.Thread(target=builder)
    t.start()
    assert inside.wait(10)
    outcome["other_thread_strict"] = strict_fails()  # this thread is outside any block
    with first_document_undecoded():  # a second block, entered and left while the first is still open
        outcome["second_block"] = feature.decode_example(bad).size
    release.set()
    t.join(10)
    assert outcome == {"builder": (1, 1), "other_thread_strict": True, "second_block": (1, 1),
                       "builder_after_other": (1, 1)}
    assert strict_fails()  # every block left: strict again
    with first_document_undecoded(), first_document_undecoded():
        pass
    assert strict_fails()
