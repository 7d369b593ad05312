"""pipelines/fig2_concentration.py end to end: tiny:llava, easyvqa_yesno, a Chat Completions server on loopback,
a fresh SQLite MLflow store; the ratings cache makes a rerun free; a missing or refused key fails fast."""
from __future__ import annotations

import pandas as pd
import pytest

from pipelines import fig2_concentration as fig2
from pipelines import mlflow_layout
from pipelines.weights import ModelSource
from tests.pipelines.fake_openai import FakeOpenAI, rating_of
from tests.reliability.conftest import assert_clean_error
from tests.report.conftest import store  # noqa: F401 - the fixture: a fresh SQLite store, MLFLOW_TRACKING_URI set

ENV = ("OPENAI_API_KEY", "AZURE_API_KEY", "API_TYPE", "OPENAI_BASE_URL", "OPENAI_API_URL", "MLFLOW_EXPERIMENT_NAME")


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``run(*args)`` -> CompletedProcess-like (returncode, stdout, stderr) of ``main`` in this process, in a scratch
    directory (tests that reach MLflow also take ``store``)."""
    import subprocess

    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args):
        code = fig2.main(["--model", "tiny:llava", "--tasks", "easyvqa_yesno", "--n", "4",
                          "--cache", str(tmp_path / "cache.json"), "--out", str(tmp_path / "out"), *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def figure_runs(client, exp):
    return client.search_runs([exp], filter_string=f"tags.`{mlflow_layout.ROLE}` = 'figure'",
                              order_by=["attributes.start_time ASC"])


@pytest.mark.slow
def test_figure_artifacts_and_a_free_rerun(cli, store, tmp_path, monkeypatch):  # noqa: F811
    client, exp = store
    with FakeOpenAI(key="test-key") as server:
        monkeypatch.setenv("OPENAI_API_KEY", "test-key")
        first = cli("--judge-base-url", server.base_url)
        assert first.returncode == 0, first.stderr
        assert server.count == 5  # the test request, then the four images
        (tmp_path / "cache.json").unlink()  # the MLflow artifact alone must make the rerun free
        second = cli("--judge-base-url", server.base_url)
        assert second.returncode == 0, second.stderr
        assert server.count == 5, "the rerun asked the judge (an image again, or the test request)"
    runs = figure_runs(client, exp)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    run = runs[1]
    assert run.data.tags[mlflow_layout.SWEEP] == "fig2_concentration" and run.data.params["judge_model"] == "gpt-4o"
    assert run.data.metrics["judge/requests"] == 0 and run.data.metrics["judge/cached"] == 4
    assert runs[0].data.metrics["judge/requests"] == 4
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    names |= {a.path for folder in ("judge", "report") for a in client.list_artifacts(run.info.run_id, folder)}
    assert {"spec.yaml", "fig2_concentration.csv", "judge/ratings.json", "report/fig2_concentration.png",
            "report/fig2_by_rating.csv", "report/report.md"} <= names
    frame = pd.read_csv(client.download_artifacts(run.info.run_id, "fig2_concentration.csv", str(tmp_path)))
    assert list(frame.columns[:6]) == ["task", "doc_id", "rating", "spectral", "feature_norm", "attention"]
    assert len(frame) == 4 and frame["rating"].between(1, 5).all()
    assert frame[["spectral", "feature_norm", "attention"]].apply(lambda c: c.between(0, 1)).all().all()
    assert (tmp_path / "out" / "fig2_concentration.png").stat().st_size > 1000
    assert sum(run.data.metrics[f"fig2/n/rating_{r}"] for r in range(1, 6)) == 4


def test_a_missing_key_fails_before_anything_loads(cli, monkeypatch):
    monkeypatch.setattr(ModelSource, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    proc = cli("--judge-base-url", "http://127.0.0.1:9/v1")
    assert_clean_error(proc, "OPENAI_API_KEY is not set")
    monkeypatch.setenv("API_TYPE", "azure")
    assert_clean_error(cli(), "AZURE_API_KEY is not set")


def test_the_judges_problem_comes_with_the_specs(cli, monkeypatch):
    """No key and a spec that does not load (no images asked for), or no key and a task that does not exist: both in
    one refusal (the key's problem alone came first)."""
    monkeypatch.setattr(ModelSource, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    for args, needle in ((("--n", "0"), "limit: expected an int >= 1 or null, got 0"),
                         (("--tasks", "easyvqa_yesnoo"), "tasks: unknown lmms-eval task(s) ['easyvqa_yesnoo']")):
        proc = cli(*args)
        assert_clean_error(proc, "2 problem(s)", "  - judge: ", "OPENAI_API_KEY is not set", f"  - {needle}")


def nothing_loaded(monkeypatch):
    """Fail the test if the model is loaded (the judge's test request comes once the images are read: only where one
    is not in the cache is the judge asked at all)."""
    monkeypatch.setattr(ModelSource, "load", lambda *a, **k: pytest.fail("the model was loaded"))


def test_a_refused_key_fails_before_anything_loads(cli, store, monkeypatch):  # noqa: F811
    nothing_loaded(monkeypatch)
    with FakeOpenAI(key="right") as server:
        monkeypatch.setenv("OPENAI_API_KEY", "wrong")
        proc = cli("--judge-base-url", server.base_url, "--judge-workers", "1")
        assert server.count == 1  # the test request
    assert_clean_error(proc, "HTTP 401", "OPENAI_API_KEY")
    assert figure_runs(*store) == []  # refused before the run: no MLflow run


def test_an_endpoint_that_does_not_answer_is_refused_in_seconds(cli, monkeypatch):
    """A dead endpoint, or a URL without http(s) from the flag or OPENAI_BASE_URL: refused after one test
    request without retries (it used to retry every image for ~40-60 s, then finish with an empty table or exit 1)."""
    import socket
    import time

    nothing_loaded(monkeypatch)
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert_clean_error(cli("--judge-base-url", f"http://127.0.0.1:{port}/v1"), "1 problem(s)",
                       f"judge: a test request failed: the judge endpoint http://127.0.0.1:{port}/v1/chat/completions "
                       "could not be reached after 1 attempt (ConnectError",
                       "Point --judge-base-url (else OPENAI_BASE_URL) at the API root of a live OpenAI-compatible "
                       "server that serves the judge model 'gpt-4o' (--judge-model)")
    assert time.monotonic() - started < 30  # no retries (the SDK's 6 took ~40 s); the rest is loading the spec
    assert_clean_error(cli("--judge-base-url", "localhost:8000"),
                       "judge: --judge-base-url 'localhost:8000' is not an http(s) URL")
    monkeypatch.setenv("OPENAI_BASE_URL", "localhost:8000")
    assert_clean_error(cli(), "judge: OPENAI_BASE_URL 'localhost:8000' is not an http(s) URL")


@pytest.mark.parametrize("args, env, needle", [
    (("--model", "tiny:qwen2_5_vl", "--set", "model.options.saliency_block=0"), {},
     "model.options.saliency_block: saliency_block must be a full-attention block of the vision tower [1, 3], got 0"),
    (("--model", "tiny:llava", "--set", "model.options.saliency_block=0"), {},
     "model.options.saliency_block: saliency_block 0 is not taken by a llava model"),
    (("--model", "tiny:llava_next", "--set", "model.options.budget_mode=view_quota", "--set", "grid.budget=[3]"), {},
     "budget: budget_mode 'view_quota' gives each of up to 5 views budget // 5 tokens: budget 3 gives none; use a "
     "budget of at least 5"),
    ((), {"PROMPRUNE_ENTROPY": "exakt"}, "environment variable PROMPRUNE_ENTROPY='exakt': it takes"),
    ((), {"MLFLOW_EXPERIMENT_NAME": "  "}, "MLFLOW_EXPERIMENT_NAME='  ': MLflow takes an experiment name of 1 to 500"),
], ids=["construction", "llava-saliency-block", "view-quota", "environment", "experiment-name"])
def test_the_sweeps_checks_of_what_the_figure_runs_refuse_it_in_setup(cli, monkeypatch, args, env, needle):
    """The script ran only part of a sweep's preflight (the tasks, the model's capacity, the store): what PrunedVLM
    refuses of the spec's adapter options with PromPrune (built after the judge was paid and the model loaded), a
    PROMPRUNE_* value the code does not take, an experiment name MLflow refuses passed setup. Now it runs the same
    `preflight.preflight`, less what scoring needs: exit 2 in setup, the model not loaded, the judge not asked."""
    nothing_loaded(monkeypatch)
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_clean_error(cli("--judge-base-url", "http://127.0.0.1:9/v1", *args), "1 problem(s)", f"  - {needle}")


def test_a_bad_cache_or_worker_count_is_refused_up_front(cli, tmp_path, monkeypatch):
    """``--cache`` a directory or a file that is no rating cache, ``--judge-workers`` below 1: refused in setup (they
    were a traceback after the judge was paid, and silently taken)."""
    nothing_loaded(monkeypatch)
    (tmp_path / "folder").mkdir()
    (tmp_path / "corrupt.json").write_text('{"format": "promprune.judge.ratings/1", "entries": [')
    (tmp_path / "other.json").write_text('{"some": "json"}')
    with FakeOpenAI(key="k") as server:
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        url = ("--judge-base-url", server.base_url)
        assert_clean_error(cli(*url, "--cache", str(tmp_path / "folder")), "1 problem(s)",
                           f"--cache {tmp_path / 'folder'} is a directory, and the rating cache is a JSON file: pass "
                           f"a file path, e.g. --cache {tmp_path / 'folder' / 'judge_ratings.json'}")
        for name, why in (("corrupt.json", "JSONDecodeError"), ("other.json", "ValueError: not a rating cache")):
            assert_clean_error(cli(*url, "--cache", str(tmp_path / name)),
                               f"--cache {tmp_path / name} is not a readable rating cache ({why}",
                               "delete it or pass another --cache path")
        for workers in ("0", "-3"):
            assert_clean_error(cli(*url, "--judge-workers", workers), "1 problem(s)",
                               f"--judge-workers: expected an int >= 1 (judge requests in flight at once), got "
                               f"{workers}")


def test_an_out_folder_that_cannot_be_written_is_refused_up_front(cli, tmp_path, monkeypatch, read_only):
    """``--out`` a file, below a file, or in a folder that refuses writes: refused in setup, exit 2, before the judge
    is asked or the model loads (it was an OSError traceback from ``out.mkdir``, exit 1, after both). The default
    (``reports/<spec name>`` in the working directory) is checked the same way."""
    nothing_loaded(monkeypatch)
    afile = tmp_path / "afile"
    afile.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    read_only(locked)
    with FakeOpenAI(key="k") as server:
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        for out, said in [(afile, f"--out {afile} is a file, not a folder"),
                          (afile / "sub", f"--out {afile / 'sub'} cannot be made: {afile} is a file, not a folder"),
                          (locked / "sub", f"--out {locked / 'sub'}: the figure cannot write in {locked} (permission "
                                           "denied); give --out a folder you can write")]:
            assert_clean_error(cli("--judge-base-url", server.base_url, "--out", str(out)), "1 problem(s)", said)
        monkeypatch.chdir(locked)  # the default, reports/fig2_concentration, in a working directory that refuses it
        code = fig2.main(["--model", "tiny:llava", "--tasks", "easyvqa_yesno", "--n", "4", "--cache",
                          str(tmp_path / "cache.json"), "--judge-base-url", server.base_url])
        assert code == 2
        assert server.count == 0  # the judge was not asked


def test_a_spec_for_another_command_is_refused_naming_it(cli, monkeypatch):
    """A sweep's spec (``command: sweep``, the default) given to this script ran silently: exit 0, a figure of the
    sweep's tasks, Spearman nan. Refused as sweep.py refuses this script's spec (`specs.check_command`), naming the
    command that runs it, before the judge or the model."""
    nothing_loaded(monkeypatch)
    quickstart = str(fig2.REPO / "sweeps" / "quickstart.yaml")
    proc = cli("--config", quickstart, "--judge-base-url", "http://127.0.0.1:9/v1")
    assert_clean_error(proc, "1 problem(s)",
                       "command: sweep: this spec is for pipelines/sweep.py, not pipelines/fig2_concentration.py",
                       f"run it with: python pipelines/sweep.py --config {quickstart}")


@pytest.mark.parametrize("answer,needle", [
    ((400, "the image could not be read", {}), "4 judge request(s) failed (the last: the judge endpoint"),
    ((200, "It is hard to say.", {}), "4 replies held no 1-5 score (e.g. 'It is hard to say.'"),
    # HTTP 200 with JSON cut short: a failed request each (it escaped as json.JSONDecodeError, a traceback, exit 1)
    ((200, b'{"choices": [', {}), "4 judge request(s) failed (the last: the judge endpoint")])
def test_no_image_rated_fails_the_run_before_the_model_loads(cli, store, monkeypatch, answer, needle):  # noqa: F811
    """The endpoint answers the test request but rates no image (every request fails, or no reply holds a score):
    exit 1 and a FAILED run before the model loads (it used to exit 0 with an empty table, rho nan)."""
    monkeypatch.setattr(ModelSource, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with FakeOpenAI(key="k") as server:
        server.script = [(200, "3", {})] + [answer] * 4  # the test request, then the four images
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        proc = cli("--judge-base-url", server.base_url)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "none of the 4 images got a rating, so there is no figure to draw" in proc.stderr and needle in proc.stderr
    [run] = figure_runs(*store)
    assert run.info.status == "FAILED" and "none of the 4 images" in run.data.tags[mlflow_layout.ERROR]


def test_unparsable_ratings_are_left_out_of_the_figure_not_fatal(tmp_path):
    from pipelines.reporting import concentration

    frame = pd.DataFrame({"task": ["a"] * 5, "doc_id": range(5), "rating": pd.array([1, 2, None, 5, 5], "Int64"),
                          "spectral": [0.9, 0.7, 0.5, 0.2, 0.3], "feature_norm": [0.99] * 5,
                          "attention": [0.8, 0.9, 0.7, 0.85, 0.8]})
    table = concentration.summary(frame)
    assert table["n"].tolist() == [1, 1, 0, 0, 2] and table.loc[5, "spectral_mean"] == pytest.approx(0.25)
    assert concentration.correlations(frame)["spectral"] < -0.9
    assert concentration.figure(frame, tmp_path / "f.png").stat().st_size > 1000
    assert "| 3 | 0 | - | - | - |" in concentration.markdown(frame, "f.png", model="m", judge="j", tasks=["a"])


def test_samples_span_the_task_and_follow_the_seed():
    a = fig2.sample_requests("easyvqa_yesno", 4, seed=0)
    c = fig2.sample_requests("easyvqa_yesno", 4, seed=1)
    ids = [q.doc_id for q in a]
    assert ids != [q.doc_id for q in c] and len(set(ids)) == 4 and ids == sorted(ids)
    assert ids[-1] > a[0].n_docs // 2  # spread over the task, not its first documents
    assert rating_of(a[0].image) in range(1, 6)


def test_samples_are_distinct_images(monkeypatch):
    """A probe's case: 30 documents of a 60-document task over 20 images rated and averaged some images twice; App. B
    rates images. Here (by hand) 12 documents ask 3 questions each about 4 images (doc d shows image d // 3): every
    3rd document from start 0 would be docs 0, 3, 6, 9 (four images); asked for 6, k halves to 1 and the first
    question of each image is kept, only 4 exist."""
    from types import SimpleNamespace

    from promprune.eval import requests as eval_requests

    docs = [SimpleNamespace(task="t", doc_id=d, n_docs=12, image_key=f"img{d // 3}") for d in range(12)]
    monkeypatch.setattr(eval_requests, "build_requests",
                        lambda tasks, shard: [q for q in docs if q.doc_id % shard[1] == shard[0]][:1]
                        if shard[1] == 2 ** 31 else [q for q in docs if q.doc_id % shard[1] == shard[0]])
    import promprune.eval

    monkeypatch.setattr(promprune.eval, "build_requests", eval_requests.build_requests)
    monkeypatch.setattr(fig2.random, "Random", lambda seed: SimpleNamespace(randrange=lambda k: 0))
    got = fig2.sample_requests("t", 3, seed=0)  # k = 12 // 3 = 4: docs 0, 4, 8 (images 0, 1, 2)
    assert [q.doc_id for q in got] == [0, 4, 8]
    got = fig2.sample_requests("t", 6, seed=0)  # k = 2: docs 0, 2, 4, .. (images 0, 0, 1, 2, 2, 3): 4 < 6 -> k = 1
    assert [q.doc_id for q in got] == [0, 3, 6, 9]


def test_two_runs_writing_one_out_folder_each_log_their_own_files(store, tmp_path, monkeypatch):  # noqa: F811
    """Two runs of fig2_concentration.py share the default reports/fig2_concentration/: run A finishing its files
    while run B draws its figure made B log A's per-rating table and report.md (B wrote them, A replaced them, B
    logged what lay there)."""
    from types import SimpleNamespace

    from pipelines.reporting import concentration

    client, exp = store
    spec, judge = SimpleNamespace(model=SimpleNamespace(pretrained="m"), tasks=["a"]), SimpleNamespace(model="j")

    def frame(n):
        return pd.DataFrame({"task": ["a"] * n, "doc_id": range(n), "rating": pd.array([1 + i % 5 for i in range(n)],
                                                                                        "Int64"),
                             "spectral": [0.1 * (i % 9) for i in range(n)], "feature_norm": [0.9] * n,
                             "attention": [0.5] * n})

    runs = {n: client.create_run(exp).info.run_id for n in (4, 7)}  # A: 4 images, B: 7
    out, real, other = tmp_path / "reports" / "fig2_concentration", concentration.figure, []

    def figure_after_the_other_run(frame_, path, **kw):
        if len(frame_) == 7 and not other:  # B's figure: meanwhile A writes and logs everything
            other.append(fig2.log_outputs(client, runs[4], frame(4), out, spec, judge))
            assert pd.read_csv(out / fig2.SUMMARY_NAME)["n"].sum() == 4  # A's, whole, in the folder meanwhile
        return real(frame_, path, **kw)

    monkeypatch.setattr(concentration, "figure", figure_after_the_other_run)
    fig2.log_outputs(client, runs[7], frame(7), out, spec, judge)
    for n, run in runs.items():
        summary = pd.read_csv(client.download_artifacts(run, f"report/{fig2.SUMMARY_NAME}", str(tmp_path / f"{n}")))
        assert summary["n"].sum() == n, f"the run of {n} images logged another run's per-rating table"
        table = pd.read_csv(client.download_artifacts(run, fig2.TABLE_NAME, str(tmp_path / f"{n}t")))
        assert len(table) == n
    assert pd.read_csv(out / fig2.SUMMARY_NAME)["n"].sum() == 7  # the folder: the last to finish, whole
