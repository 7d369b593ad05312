"""The paper's nine hub tasks through lmms-eval's own task code, on local stand-ins of their hub datasets.

The stand-ins (promprune.eval.standins) sit where ``datasets`` looks offline; nothing here names a file: lmms-eval's
task YAMLs name the repositories, its ``download()`` loads them, its utils build prompts and score.
"""
import collections
import io
import json

import pytest
from PIL import Image

from promprune.eval import build_requests, run_requests, score
from promprune.eval.standins import STANDIN_TASKS, serving
from promprune.eval.tasks import PAPER_TASKS, PRIMARY_METRICS, load_task
from tests.conftest import STANDIN_DOCS

# MME's ten perception subtasks (Fu et al., 2023); the other four are cognition
MME_PERCEPTION = {"existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark", "artwork",
                  "OCR"}


# The hub datasets' fields, as their dataset cards give them (lmms-lab/<name>; lmms-eval 0.7.3 reads the
# lmms-lab-encoder/ copies): (dataset_path, dataset_name or None, split) -> "field:type ..."
HUB_SCHEMAS = {
    ("lmms-lab-encoder/MME", None, "test"): "question_id:string image:image question:string answer:string "
                                            "category:string",
    ("lmms-lab-encoder/POPE", None, "test"): "id:string question_id:string question:string answer:string "
                                             "image_source:string image:image category:string",
    ("lmms-lab-encoder/MMBench", "en", "dev"): "index:int64 question:string hint:string answer:string A:string "
                                               "B:string C:string D:string category:string image:image "
                                               "source:string L2-category:string comment:string split:string",
    ("lmms-lab-encoder/textvqa", None, "validation"): "image_id:string question_id:int32 question:string "
                                                      "question_tokens:[string] image:image image_width:int32 "
                                                      "image_height:int32 flickr_original_url:string "
                                                      "flickr_300k_url:string answers:[string] "
                                                      "image_classes:[string] set_name:string ocr_tokens:[string]",
    ("lmms-lab-encoder/ScienceQA", "ScienceQA-IMG", "test"): "image:image question:string choices:[string] "
                                                             "answer:int8 hint:string task:string grade:string "
                                                             "subject:string topic:string category:string "
                                                             "skill:string lecture:string solution:string",
    ("lmms-lab-encoder/GQA", "testdev_balanced_instructions", "testdev"):
        "id:string imageId:string question:string answer:string fullAnswer:string isBalanced:bool "
        "groups:{global:string,local:string} entailed:string equivalent:string "
        "types:{structural:string,semantic:string,detailed:string} "
        "annotations:{answer:string,question:string,fullAnswer:string} "
        "semantic:[{operation:string,argument:string,dependencies:[int32]}] semanticStr:string",
    ("lmms-lab-encoder/GQA", "testdev_balanced_images", "testdev"): "id:string image:image",
    ("lmms-lab-encoder/VQAv2", None, "validation"): "question_type:string multiple_choice_answer:string "
                                                    "answers:[{answer:string,answer_confidence:string,"
                                                    "answer_id:int64}] image_id:int64 answer_type:string "
                                                    "question_id:int64 question:string image:image",
    ("lmms-lab-encoder/VizWiz-VQA", None, "val"): "question_id:string image:image question:string "
                                                  "answers:[string] category:string",
    ("lmms-lab-encoder/MMVet", None, "test"): "question_id:string image:image question:string answer:string "
                                              "image_source:string capability:string",
}


class LoopbackJudge:
    """MM-Vet's judge on loopback: an OpenAI-compatible Chat Completions endpoint that grades lmms-eval's MM-Vet
    prompt (its last row: ``question | ground truth | prediction |``) 1.0 when the prediction holds every
    ``<AND>`` part of the ground truth, else 0.0. Counts its requests."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        judge = self
        self.requests = 0
        self.silent = set()  # predictions it gives no grade (an empty reply), as a failing judge does

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests += 1
                prompt = body["messages"][-1]["content"]
                silent = any(f"| {p} |" in prompt for p in judge.silent)
                grade = "" if silent else judge.grade(prompt)
                reply = {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": grade}}]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def grade(prompt: str) -> str:
        last_row = prompt.split("| 1.0\n")[-1].strip()  # after the template's last worked example
        _, truth, prediction = last_row.removesuffix("|").split(" | ", 2)
        parts = [p.strip().lower() for p in truth.split("<AND>")]
        return "1.0" if all(p in prediction.lower() for p in parts) else "0.0"


@pytest.fixture(scope="module")
def judge():
    with LoopbackJudge() as server:
        yield server


@pytest.fixture
def judged(judge, monkeypatch):
    """MM-Vet's judge settings (lmms-eval 0.7.3's openai provider reads OPENAI_API_URL) pointing at ``judge``."""
    for name, value in {"API_TYPE": "openai", "OPENAI_API_KEY": "sk-test", "OPENAI_API_URL": judge.url,
                        "OPENAI_BASE_URL": judge.url}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MODEL_VERSION", raising=False)
    judge.requests = 0
    judge.silent = set()
    return judge


@pytest.fixture(scope="module", autouse=True)
def hub(hub_standins):
    with serving(hub_standins):
        yield hub_standins


def _schema(feature) -> str:
    """datasets features -> the compact notation of HUB_SCHEMAS."""
    import datasets

    if isinstance(feature, (dict, datasets.Features)):
        return "{" + ",".join(f"{k}:{_schema(v)}" for k, v in feature.items()) + "}"
    if isinstance(feature, datasets.List):
        return f"[{_schema(feature.feature)}]"
    if isinstance(feature, datasets.Image):
        return "image"
    return feature.dtype


def test_the_paper_tasks_are_the_standins():
    assert set(STANDIN_TASKS) == set(PAPER_TASKS.values())


def test_datasets_loads_each_standin_where_the_task_yaml_points_with_the_hubs_schema():
    """Each (dataset_path, dataset_name, split) lmms-eval's YAMLs name loads offline, with the hub card's fields;
    images come as the hub stores them: JPEG and PNG, modes RGB, L, RGBA and P."""
    import datasets

    seen = set()
    for (path, name, split), expected in HUB_SCHEMAS.items():
        ds = datasets.load_dataset(path, name, split=split, token=True)
        assert " ".join(f"{k}:{_schema(v)}" for k, v in ds.features.items()) == expected, (path, name)
        assert len(ds) > 0, (path, name)
        if "image" in ds.features:
            seen |= {(row["image"].format, row["image"].mode) for row in ds}
    assert {("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGB"), ("PNG", "L"), ("PNG", "RGBA"), ("PNG", "P")} <= seen


def test_the_yamls_name_these_repositories(monkeypatch):
    """HUB_SCHEMAS' keys are what lmms-eval's task objects load (their dataset_path, dataset_name, test_split)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # lmms-eval's mmvet utils build their judge client at import
    gqa_images = ("lmms-lab-encoder/GQA", "testdev_balanced_images", "testdev")  # loaded inside gqa's utils.py
    named = {(t.DATASET_PATH, t.DATASET_NAME, t.config.test_split) for t in map(load_task, STANDIN_TASKS)}
    assert named | {gqa_images} == set(HUB_SCHEMAS)


@pytest.mark.parametrize("task", STANDIN_TASKS)
def test_each_task_builds_one_request_per_document_with_its_image(task, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # MM-Vet's requests are built only where a judge key is set
    docs = load_task(task).eval_docs
    rows = build_requests([task])
    assert [r.doc_id for r in rows] == list(range(len(docs))) and len(docs) >= STANDIN_DOCS
    for row, doc in zip(rows, docs):
        assert row.error is None and row.n_docs == len(docs)
        image = Image.open(io.BytesIO(row.image))
        assert image.format == "PNG" and image.mode == "RGB"
        assert image.size == doc["image"].size  # the document's own image, whole
        assert doc["question"].split("?")[0].lower() in row.prompt.lower()



@pytest.mark.parametrize("task", ["gqa", "mme"])  # GQA joins two datasets in process_docs; MME shares images
def test_shards_build_the_same_requests(task):
    whole = build_requests([task])
    shards = [r for i in range(3) for r in build_requests([task], shard=(i, 3))]
    assert sorted((r.doc_id, r.prompt, r.image) for r in shards) == [(r.doc_id, r.prompt, r.image) for r in whole]


def _correct(task: str, doc: dict) -> str:
    """The answer a perfect model gives, read from the document as each benchmark defines its ground truth."""
    if task == "scienceqa_img":
        return "ABCDE"[doc["answer"]]  # an index into choices; the prompt lists them as A., B., ...
    if task in ("textvqa_val", "vizwiz_vqa_val"):
        return collections.Counter(doc["answers"]).most_common(1)[0][0]  # the ten annotators' majority
    if task == "vqav2_val":
        return collections.Counter(a["answer"] for a in doc["answers"]).most_common(1)[0][0]
    if task == "mmvet":
        return doc["answer"].replace("<AND>", " and ")  # every part of the ground truth, in words
    return doc["answer"]  # MME Yes/No, POPE yes/no, MMBench's letter, GQA's word


def _maximum(task: str, docs) -> dict[str, float]:
    """Each primary metric's best value on these documents (lmms-eval's scales: fractions, MMBench and MM-Vet percent,
    MME points: 100 accuracy + 100 accuracy+ per subtask, summed over the perception subtasks present)."""
    if task == "mme":
        return {"mme_perception_score": 200.0 * len({d["category"] for d in docs} & MME_PERCEPTION)}
    return {metric: 100.0 if task.startswith(("mmbench", "mmvet")) else 1.0 for metric in PRIMARY_METRICS[task]}


def _replayed(task: str):
    docs = load_task(task).eval_docs
    rows = [{"task": task, "doc_id": i, "n_docs": len(docs), "prediction": _correct(task, d)}
            for i, d in enumerate(docs)]
    return docs, rows


@pytest.mark.parametrize("task", STANDIN_TASKS)
def test_correct_answers_reach_each_metrics_maximum(task, judged):
    docs, rows = _replayed(task)
    result = score(rows, bootstrap=20)[task]  # MMBench's aggregation gets its args (issue 21 item 3)
    assert judged.requests == (len(docs) if task == "mmvet" else 0)  # MM-Vet: one judge call per answer
    best = _maximum(task, docs)
    assert {m: result[m] for m in best} == best
    assert result["n_samples"] == len(docs) and result["n_failed"] == 0
    for metric, value in best.items():  # a perfect run's interval is a point (MME: resampled by question pair)
        assert result[metric + "_ci_low"] == result[metric + "_ci_high"] == value


def test_an_answer_the_spreadsheet_writer_refuses_costs_only_itself():
    """MMBench's aggregation writes an xlsx file, and openpyxl refuses control characters: a stray byte in one
    answer is cleaned and counted instead of losing the trial (issue 21 item 2)."""
    task = "mmbench_en_dev_static"
    docs, rows = _replayed(task)
    rows[0]["prediction"] = rows[0]["prediction"] + "\x07\x1b"  # BEL and ESC after a correct letter
    rows[1]["prediction"] = "\x00"  # nothing but a NUL: wrong after cleaning
    result = score(rows)[task]
    assert result["n_cleaned"] == 2 and result["n_failed"] == 0
    n = len({int(d["index"]) % 1_000_000 for d in docs})  # MMBench scores a question with its circular copies
    assert result["gpt_eval_score"] < 100.0 and result["gpt_eval_score"] >= 100.0 * (n - 1) / n - 1e-9


def test_a_sample_the_judge_never_grades_fails_instead_of_scoring_zero(judged):
    """lmms-eval's MM-Vet records 0.0 when its judge gives no grade; that is a failed sample, and the score is the
    graded samples' (issue 21 item 5)."""
    docs, rows = _replayed("mmvet")
    judged.silent = {rows[0]["prediction"]}
    result = score(rows)["mmvet"]
    assert result["n_judge_failed"] == 1 and result["n_failed"] == 1
    assert result["gpt_eval_score"] == 100.0  # every graded answer is right; the ungraded one is not a 0


def test_failed_pope_samples_are_counted_where_f1_cannot_see_them():
    """A failed sample replays as the empty answer: POPE's accuracy counts it wrong, its F1 leaves it out, and the
    count says so (issue 21 item 6)."""
    docs, rows = _replayed("pope")
    yes = [r for r, d in zip(rows, docs) if d["answer"].lower() == "yes"]
    for row in yes[1:]:
        row["error"] = "pope doc: generation failed"
    result = score(rows)["pope"]
    assert result["n_failed"] == len(yes) - 1
    assert result["pope_accuracy"] == pytest.approx(1 - (len(yes) - 1) / len(rows))
    assert result["pope_f1_score"] == 1.0  # lmms-eval's rule: only yes/no answers enter precision and recall


@pytest.mark.parametrize("task", ["vqav2_val", "mmvet"])
def test_a_wrong_answer_costs_its_share(task, judged):
    """The maximum is no constant: one wrong answer of n lowers VQAv2's exact match, and the judge's MM-Vet score,
    by 1/n of the maximum."""
    docs, rows = _replayed(task)
    rows[0]["prediction"] = "zebra"
    best = _maximum(task, docs)
    (metric,) = best
    assert score(rows)[task][metric] == pytest.approx(best[metric] * (1 - 1 / len(docs)))


@pytest.fixture(scope="module")
def vlm():
    from promprune.models import PrunedVLM

    return PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8)


@pytest.mark.slow
@pytest.mark.parametrize("task", STANDIN_TASKS)
def test_each_task_builds_generates_and_scores_on_a_tiny_model(task, vlm, judged):
    docs = load_task(task).eval_docs
    rows = build_requests([task])
    for row in rows:  # a random model rarely stops by itself; a short answer keeps the test quick
        row.gen_kwargs["max_new_tokens"] = 12
    predictions = run_requests(vlm, rows, batch_size=4)
    assert sorted(p.doc_id for p in predictions) == list(range(len(rows)))
    assert all(p.error is None for p in predictions)
    result = score(predictions)[task]
    assert result["n_samples"] == len(rows) and result["n_failed"] == 0  # no sample dropped
    for metric, best in _maximum(task, docs).items():
        assert 0.0 <= result[metric] <= best



def _arrow_rows(hf_home, repo_dir: str) -> list:
    import pyarrow as pa

    (arrow,) = (hf_home / "datasets" / repo_dir).glob("*/*/*/*.arrow")
    with pa.OSFile(str(arrow)) as f:
        return pa.ipc.open_stream(f).read_all().to_pylist()


def test_builds_are_deterministic_per_seed_and_task(tmp_path):
    from promprune.eval.standins import build_standins

    one = build_standins(tmp_path / "one", tasks=["pope"], docs_per_task=4, seed=3)
    two = build_standins(tmp_path / "two", tasks=["vqav2_val", "pope"], docs_per_task=4, seed=3)  # other tasks too
    other = build_standins(tmp_path / "other", tasks=["pope"], docs_per_task=4, seed=4)
    rows = _arrow_rows(one, "lmms-lab-encoder___pope")
    assert rows == _arrow_rows(two, "lmms-lab-encoder___pope") and len(rows) == 4
    assert [r["image"] for r in rows] != [r["image"] for r in _arrow_rows(other, "lmms-lab-encoder___pope")]


def test_pope_can_ask_eighteen_questions_per_image_as_the_real_one(tmp_path):
    """POPE's shape (18 questions of each image, half yes) without changing the default stand-in's documents."""
    from promprune.eval.standins import build_standins

    plain = _arrow_rows(build_standins(tmp_path / "plain", tasks=["pope"], docs_per_task=4), "lmms-lab-encoder___pope")
    rows = _arrow_rows(build_standins(tmp_path / "shaped", tasks=["pope"], docs_per_task=36, per_image={"pope": 18}),
                       "lmms-lab-encoder___pope")
    by_image = collections.defaultdict(list)
    for r in rows:
        by_image[r["image_source"]].append(r)
    assert [len(v) for v in by_image.values()] == [18, 18]
    for asked in by_image.values():
        assert [r["answer"] for r in asked].count("yes") == 9 and len({r["image"]["bytes"] for r in asked}) == 1
        assert len({r["question"] for r in asked}) > 9 and all(r["question"].startswith("Is there a") for r in asked)
    first = by_image[rows[0]["image_source"]]
    assert [(r["question"], r["answer"]) for r in first[:2]] == [(r["question"], r["answer"]) for r in plain[:2]]
    assert first[0]["image"] == plain[0]["image"]  # the same scene: the extra questions draw nothing
    with pytest.raises(ValueError, match=r"per_image sets questions per image \(an int >= 2\) of \['pope'\]"):
        build_standins(tmp_path / "bad", tasks=["gqa"], per_image={"gqa": 30})


def test_a_rebuild_replaces_standins_but_never_a_real_cache(tmp_path):
    from promprune.eval.standins import build_standins

    build_standins(tmp_path, tasks=["pope"], docs_per_task=2)
    build_standins(tmp_path, tasks=["pope"], docs_per_task=4)
    assert len(list((tmp_path / "datasets" / "lmms-lab-encoder___pope").glob("*/*/*"))) == 1
    assert len(_arrow_rows(tmp_path, "lmms-lab-encoder___pope")) == 4
    (tmp_path / "datasets" / "lmms-lab-encoder___mme").mkdir()  # as if the real MME had been downloaded here
    with pytest.raises(FileExistsError, match="lmms-lab-encoder___mme.*not written by build_standins"):
        build_standins(tmp_path, tasks=["mme"])
    with pytest.raises(ValueError, match="unknown"):
        build_standins(tmp_path, tasks=["mme", "mmmu"])


def test_the_command_line_writes_them_and_a_fresh_process_loads_them(tmp_path):
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "promprune.eval", "standins", "--out", str(tmp_path), "--tasks",
                          "scienceqa_img", "--docs", "3"], capture_output=True, text=True, check=True).stdout
    env = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines() if line.startswith("export "))
    assert env["HF_HOME"] == str(tmp_path) and env["HF_DATASETS_OFFLINE"] == "1"
    load = ("import datasets; "
            "print(len(datasets.load_dataset('lmms-lab-encoder/ScienceQA', 'ScienceQA-IMG', split='test')))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LMMS_EVAL"))}
    got = subprocess.run([sys.executable, "-c", load], env={**clean, **env}, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "3"


def test_a_documents_unreadable_or_cut_off_image_is_one_failed_request(tmp_path, monkeypatch):
    """A hub document whose image bytes do not decode (it crashed the whole build; at the first document the task's
    own build, which reads it as a test) or stop a third of the way (under
    lmms-eval's LOAD_TRUNCATED_IMAGES it decoded partly grey and was answered) is one request with its error, beside
    the others, as lmms-eval's own command line records it."""
    from promprune.eval import standins

    def corrupted(painter, n, **kw):
        (table,) = standins.pope(painter, n, **kw)
        images = table.columns["image"]
        images[0] = {"bytes": b"", "path": None}  # lmms-eval decodes the first document while it builds the task
        images[2] = {"bytes": b"not an image at all", "path": None}
        images[4] = {"bytes": images[4]["bytes"][: len(images[4]["bytes"]) // 3], "path": None}
        return [table]

    monkeypatch.setitem(standins.TASK_BUILDERS, "pope", corrupted)
    with serving(standins.build_standins(tmp_path / "hf", tasks=["pope"], docs_per_task=6)):
        rows = build_requests(["pope"])
    assert [r.doc_id for r in rows] == list(range(6))
    assert [r.doc_id for r in rows if r.error] == [0, 2, 4]
    assert rows[0].error.startswith("pope doc 0: unreadable document (UnidentifiedImageError: ")
    assert rows[2].error.startswith("pope doc 2: unreadable document (UnidentifiedImageError: ")
    assert rows[4].error.startswith("pope doc 4: unreadable document (OSError: ") and "truncated" in rows[4].error
    assert all(r.image is None for r in rows if r.error) and all(r.image for r in rows if not r.error)


@pytest.mark.parametrize("answered", [[0, 1, 2, 4, 5], [0, 4, 5], [0, 1, 2]])
def test_a_partial_mme_score_aggregates_the_answered_pairs_as_lmms_eval_does(answered):
    """Running scores and a search's rungs score the documents answered so far (``partial``): MME's perception and
    cognition scores are lmms-eval's own aggregation over the whole pairs among them (a half-answered pair waits for
    its partner). They came back NaN once both kinds were answered, and a half pair alone raised MME's pairwise
    assert. The stand-in's pairs: existence (0, 1), color (2, 3), commonsense reasoning (4, 5: cognition)."""
    import importlib

    mme = importlib.import_module("lmms_eval.tasks.mme.utils")
    docs, rows = _replayed("mme")
    assert [d["category"] for d in docs] == ["existence"] * 2 + ["color"] * 2 + ["commonsense_reasoning"] * 2
    whole = [i for i in answered if i ^ 1 in answered]
    results = [mme.mme_process_results(docs[i], [rows[i]["prediction"]]) for i in whole]
    expected = {m: mme.mme_aggregate_results([x[m] for x in results if m in x])
                for m in ("mme_perception_score", "mme_cognition_score") if any(m in x for x in results)}
    got = score([rows[i] for i in answered], partial=True)["mme"]
    assert {m: got[m] for m in expected} == expected and got["n_samples"] == len(answered)


def test_reasoning_blocks_are_stripped_as_lmms_evals_command_line_does(monkeypatch):
    """lmms-eval's command line strips <think> / <analysis> blocks before its filters (``--reasoning_tags``, its
    default); the pipeline's scoring scored "<think>...</think>Yes" as wrong."""
    import sys

    from promprune.eval.scoring import LMMS_EVAL_REASONING_TAGS

    monkeypatch.setattr(sys, "argv", ["lmms-eval"])
    from lmms_eval.__main__ import parse_eval_args

    assert parse_eval_args()[1].reasoning_tags == LMMS_EVAL_REASONING_TAGS
    _, rows = _replayed("pope")
    plain = score(rows)["pope"]
    for row in rows:
        row["prediction"] = "<think>Something round, near the top.</think>" + row["prediction"]
    assert score(rows)["pope"] == plain and plain["pope_f1_score"] == 1.0


@pytest.mark.parametrize("argv, named", [
    (["prepare", "--out", "x", "--docs", "3"], "--out, --docs"),
    (["prepare", "--tasks", "pope"], "--tasks"),
    (["prepare", "--seed", "1"], "--seed"),
])
def test_cli_prepare_rejects_standins_flags(argv, named, monkeypatch, capsys):
    """A flag only `standins` reads, given to `prepare`: an argparse error (exit 2) naming it, nothing prepared (it
    was silently ignored)."""
    from promprune.eval import __main__ as cli

    monkeypatch.setattr(cli, "_prepare", lambda: pytest.fail("prepare ran"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert f"error: {named}: only for standins" in capsys.readouterr().err


@pytest.mark.parametrize("docs", ["0", "-2", "x"])
def test_cli_standins_docs_must_be_positive(docs, tmp_path, monkeypatch, capsys):
    """--docs below 1 (which build_standins refuses with a ValueError) is an argparse error, exit 2, no traceback."""
    from promprune.eval import __main__ as cli
    from promprune.eval.standins import build_standins

    if docs != "x":
        with pytest.raises(ValueError, match="docs_per_task"):
            build_standins(tmp_path / "hf", tasks=["pope"], docs_per_task=int(docs))
    monkeypatch.setattr(cli, "_standins", lambda *a: pytest.fail("standins ran"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["standins", "--out", str(tmp_path / "s"), "--tasks", "pope", "--docs", docs])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --docs: expected an int >= 1" in err and "Traceback" not in err


def test_cli_standins_defaults(tmp_path, monkeypatch):
    """Without --tasks/--docs/--seed, standins writes every stand-in task, 8 documents each, seed 0; prepare alone
    still prepares."""
    from promprune.eval import __main__ as cli
    from promprune.eval.standins import STANDIN_TASKS

    calls = []
    monkeypatch.setattr(cli, "_standins", lambda *a: calls.append(a))
    monkeypatch.setattr(cli, "_prepare", lambda: calls.append("prepare"))
    cli.main(["standins", "--out", str(tmp_path)])
    cli.main(["standins", "--out", str(tmp_path), "--tasks", "pope", "--docs", "3", "--seed", "5"])
    cli.main(["prepare"])
    assert calls == [(tmp_path, list(STANDIN_TASKS), 8, 0), (tmp_path, ["pope"], 3, 5), "prepare"]


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_prepare_to_a_reader_that_stops_reading_exits_quietly(unbuffered):
    """`python -m promprune.eval prepare | head -1` (docs/pipeline.md) printed a BrokenPipeError traceback once head
    had its line (or "Exception ignored ... BrokenPipeError" when stdout was flushed at exit): here the reader closes
    the pipe before the first line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    proc = subprocess.Popen([sys.executable, "-m", "promprune.eval", "prepare"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0 and "BrokenPipe" not in err and "Traceback" not in err, err


def test_the_paired_bootstrap_on_all_documents_is_rel_of_the_same_predictions():
    """`PairedBootstrap`'s point (the report's paired differences, the best trial's Rel. with its interval) is
    `relative_score` of the same predictions, MMBench included: on all the documents its circular groups are numbered
    as a resample numbers them (all had one number: one group, the baseline's score 0, MMBench left out)."""
    from promprune.eval.scoring import PairedBootstrap, relative_score, sample_items

    base, pruned = [], []
    for name in ("pope", "mmbench_en_dev_static"):
        docs, rows = _replayed(name)
        base += rows
        wrong = {"yes": "no", "no": "yes"}.get(rows[0]["prediction"], "D" if rows[0]["prediction"] != "D" else "A")
        pruned += [{**rows[0], "prediction": wrong}] + [dict(r) for r in rows[1:]]
    scores, baseline = score(pruned), score(base)
    items = {"base": sample_items(base), "pruned": sample_items(pruned)}
    boot = PairedBootstrap(items, "base", 50)
    assert boot.rel("pruned")[0] == pytest.approx(relative_score(scores, baseline))
    mmbench = items["pruned"]["mmbench_en_dev_static"]
    every = mmbench.draw([range(len(stratum)) for stratum in mmbench.units()])
    assert mmbench.score(every) == pytest.approx(scores["mmbench_en_dev_static"]["gpt_eval_score"])
    assert scores["mmbench_en_dev_static"]["gpt_eval_score"] < 100.0  # the wrong answer costs its circular group


class StubJudge:
    """MM-Vet's judge replaced where lmms-eval's utils call it (``get_chat_response``): ``reply`` for the answers
    in ``odd`` (by their text in the prompt), a right grade ("1.0") for the rest. Counts the calls per answer, and
    raises past ``limit`` calls for one answer (lmms-eval's loop asks forever for a number outside [0, 1])."""

    def __init__(self, odd: set[str], reply: str, limit: int = 50):
        self.odd, self.reply, self.limit = odd, reply, limit
        self.calls = collections.Counter()

    def __call__(self, prompt, model=None, temperature=0.0, **kwargs):
        answer = next((a for a in self.odd if f"| {a} |" in prompt), None)
        self.calls[answer] += 1
        if self.calls[answer] > self.limit:
            raise RuntimeError(f"the judge was asked {self.calls[answer]} times about {answer!r}")
        return (self.reply if answer is not None else "1.0"), "judge-model"


@pytest.fixture
def stub_judge(monkeypatch):
    """Install a `StubJudge` (the fixture's function takes it) in lmms-eval's MM-Vet utils as scoring loads them (a
    fresh module per load), their 5 s sleeps between retries skipped."""
    import types

    from promprune.eval import scoring

    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy")  # lmms-eval's mmvet utils build their client at import
    load = scoring.load_task

    def install(judge: StubJudge) -> StubJudge:
        def load_task(name, include_path=None):
            task = load(name, include_path)
            module = task.config.process_results.__globals__
            module["get_chat_response"], module["time"] = judge, types.SimpleNamespace(sleep=lambda s: None)
            return task

        monkeypatch.setattr(scoring, "load_task", load_task)
        return judge

    return install


@pytest.mark.parametrize("reply", ["Score: 0.5", "2"])
def test_a_judge_reply_that_is_no_grade_fails_the_sample(reply, stub_judge):
    """lmms-eval's MM-Vet gives up after 8 unparsable replies ("Score: 0.5": its first word is no number) and records
    0.0 with the judge's model named; a number outside [0, 1] ("2") makes it ask again without end. Either way the
    sample has no grade: failed (n_judge_failed), the judge asked at most 8 times, the score the graded ones'."""
    from promprune.eval.scoring import JUDGE_CALLS

    docs, rows = _replayed("mmvet")
    rows[0]["prediction"] = "a reply the judge cannot grade"
    judge = stub_judge(StubJudge({rows[0]["prediction"]}, reply))
    result = score(rows)["mmvet"]
    assert result["n_judge_failed"] == 1 and result["n_failed"] == 1
    assert result["gpt_eval_score"] == 100.0  # every graded answer right; the ungraded one is not a 0
    assert judge.calls[rows[0]["prediction"]] == JUDGE_CALLS == 8
    assert judge.calls[None] == len(docs) - 1  # one call per graded answer
