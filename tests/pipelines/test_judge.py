"""The Fig. 2 judge (pipelines/judge.py, the openai SDK) against a Chat Completions server on loopback: ratings, the
cache, the SDK's retries, key errors; and MM-Vet's judge endpoint and probe (promprune.eval.tasks, preflight)."""
from __future__ import annotations

import hashlib
import io
import json

import pytest
from PIL import Image

from pipelines import judge as judging
from promprune.eval.tasks import JUDGE_TASKS, api_key_env, judge_skip_reason
from tests.pipelines.fake_openai import FakeOpenAI, rating_of

# sha256 of the paper's Fig. B1 prompt box as plain text (\textbf unwrapped, \vspace a blank line, `--` as `-`),
# computed once from the paper's LaTeX source: the judge must send exactly the paper's prompt
PAPER_PROMPT_SHA256 = "f3e3c4279be6a8ff415755b4d76aa2ff93cce9437f37b3a34396afe764f997fc"
KEYS = ("OPENAI_API_KEY", "AZURE_API_KEY", "API_TYPE", "OPENAI_BASE_URL", "OPENAI_API_URL", "AZURE_ENDPOINT")


def png(color=(200, 30, 30), size=(24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def env(monkeypatch):
    """No key or endpoint from the machine; returns monkeypatch to set them. Each variable is registered with
    monkeypatch (set, then deleted), so what the code under test writes into os.environ itself (the endpoint
    alignment) is undone afterwards too."""
    for name in KEYS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def server(env):
    with FakeOpenAI(key="test-key", model="gpt-4o") as fake:
        env.setenv("OPENAI_API_KEY", "test-key")
        env.setenv("OPENAI_BASE_URL", fake.base_url)
        yield fake


def make_judge(**options) -> judging.ConcentrationJudge:
    return judging.ConcentrationJudge.from_env(**options)


FAST_RETRY = {"retry-after-ms": "10"}  # the server's own wait, which the SDK honours: failing tests stay quick


def test_the_prompt_is_the_papers_fig_b1():
    assert judging.PROMPT.startswith("Task Description:\nRate semantic concentration in the image")
    assert judging.PROMPT.endswith("Output format:\nOutput only one integer (1-5).")
    assert hashlib.sha256(judging.PROMPT.encode()).hexdigest() == PAPER_PROMPT_SHA256


@pytest.mark.parametrize("reply,rating", [
    ("4", 4), ("4.", 4), ("**2**", 2), ("Score: 5", 5), ("I would rate it 3/5.", 3), ("1 out of 5", 1),
    ("Many units spread out (more than 10). Score: 1", 1), ("0", None), ("7", None), ("3.5", None),
    ("3 or 4", None), ("", None), ("I cannot see the image.", None),
    # a reply repeating the prompt's rubric line of its score (a probe's cases: "rate" inside "Concentrated" and
    # "moderate" was read as the score keyword, and "-3" as 3)
    ("5 = Highly Concentrated: 1 main semantic unit occupying a small region.", 5),
    ("4 = Mostly Concentrated: 1-2 units", 4), ("3 - Balanced (moderate: 2 units)", 3), ("-3", None),
    ("**4 = Mostly Concentrated**: 1-2 units with little surrounding information.", 4),
    ("1 = Highly Distributed: complex natural scene with many objects/interactions spread across the entire image.",
     1),
    ("The image is moderately concentrated. Score: 4", 4), ("Concentrated: 5 = Highly Concentrated (1 unit)", 5),
    ("4 = Highly Concentrated: 1 unit", None),  # the number and the label disagree
    (judging.PROMPT, None), (judging.PROMPT + "\nAnswer: 2", 2),  # the whole rubric is no answer; a marked one is
])
def test_ratings_are_parsed_or_none(reply, rating):
    assert judging.parse_rating(reply) == rating


def test_the_rubric_labels_are_the_prompts():
    assert judging.RUBRIC == {"highly concentrated": 5, "mostly concentrated": 4, "balanced": 3, "distributed": 2,
                              "highly distributed": 1}


def test_a_cached_reply_is_parsed_again_so_a_parser_fix_mends_an_old_cache(server, tmp_path):
    """The cache stored the rating the parser of its day read (1, from "rate" inside "Concentrated"); a hit parses
    the stored reply again, asks nothing, and the saved cache carries the corrected rating."""
    judge, image = make_judge(), png((7, 7, 7))
    reply = "5 = Highly Concentrated: 1 main semantic unit occupying a small region."
    old = judging.Rating("pope", 0, 1, reply, judge.model, judge.prompt_sha, judging.image_sha(image), "gpt-4o-x")
    judging.RatingCache([old.entry()]).save(tmp_path / "old.json")
    cache = judging.RatingCache.load(tmp_path / "old.json")
    [rating] = judging.rate_images(judge, cache, [("pope", 0, image)])
    [same] = judging.rate_images(judge, cache, [("gqa", 3, image)])  # the same image under another document
    assert rating.rating == same.rating == 5 and rating.cached and same.cached and server.count == 0
    cache.save(tmp_path / "new.json")
    assert {e["rating"] for e in judging.RatingCache.load(tmp_path / "new.json").entries.values()} == {5}


def test_a_rating_comes_back_and_the_request_is_what_the_api_expects(server):
    judge = make_judge()
    image = png()
    reply = judge.ask(image)
    assert reply.rating == rating_of(image) and reply.text == str(rating_of(image))
    assert reply.model == "gpt-4o-2024-11-20" and reply.attempts == 1
    sent = server.requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["headers"]["authorization"] == "Bearer test-key"
    body = json.loads(sent["body"])
    assert body["temperature"] == 0 and body["model"] == "gpt-4o"
    assert body["messages"][0]["content"][0] == {"type": "text", "text": judging.PROMPT}


def test_the_cache_saves_a_second_request_and_survives_a_file(server, tmp_path):
    judge, cache = make_judge(), judging.RatingCache()
    items = [("pope", 3, png((1, 2, 3))), ("mme", 7, png((9, 9, 9)))]
    first = judging.rate_images(judge, cache, items)
    assert server.count == 2 and [r.cached for r in first] == [False, False]
    cache.save(tmp_path / "ratings.json")
    again = judging.rate_images(make_judge(), judging.RatingCache.load(tmp_path / "ratings.json"), items)
    assert server.count == 2  # nothing asked
    assert [r.rating for r in again] == [r.rating for r in first] and all(r.cached for r in again)
    # another prompt or model is another key; a changed image is not a hit
    judging.rate_images(make_judge(prompt=judging.PROMPT + " "), cache, items[:1])
    judging.rate_images(judge, cache, [("pope", 3, png((4, 5, 6)))])
    assert server.count == 4


def test_one_request_per_distinct_image(server):
    same = png((50, 60, 70))
    ratings = judging.rate_images(make_judge(), judging.RatingCache(), [("pope", 0, same), ("pope", 1, same),
                                                                        ("gqa", 5, png((0, 0, 0)))])
    assert server.count == 2 and ratings[0].rating == ratings[1].rating == rating_of(same)


def test_429_and_503_are_retried_after_backoff(server):
    server.script = [(429, "Rate limit reached for gpt-4o", {"Retry-After": "1.5"}), (503, "overloaded", {})]
    judge = make_judge()
    reply = judge.ask(png())
    assert reply.rating == rating_of(png()) and reply.attempts == 3 and server.count == 3 == judge.requests_sent
    t = [r["time"] for r in server.requests]
    # Retry-After honoured (the SDK's own first wait is at most 0.5 s), then its schedule: 1 s less up to 25 % jitter
    assert t[1] - t[0] >= 1.5 and t[2] - t[1] >= 0.75


def test_a_persistent_failure_is_recorded_not_cached_and_many_stop_the_run(server):
    server.script = [(500, "boom", FAST_RETRY)] * 3
    cache = judging.RatingCache()
    [rating] = judging.rate_images(make_judge(max_retries=2), cache, [("pope", 0, png())])
    assert rating.rating is None and "HTTP 500 after 3 attempts: boom" in rating.error and len(cache) == 0
    server.script = [(500, "boom", FAST_RETRY)] * 20
    items = [("pope", i, png((i, i, i))) for i in range(4)]
    with pytest.raises(judging.JudgeError, match="2 judge requests in a row failed"):
        judging.rate_images(make_judge(max_retries=1), cache, items, workers=1, max_consecutive_failures=2)


def test_a_request_the_server_rejects_is_not_retried(server):
    judge = make_judge(model="gpt-5")  # the server has no such model: 404, which no retry fixes
    with pytest.raises(judging.JudgeError, match="answered HTTP 404: The model `gpt-5` does not exist") as err:
        judge.ask(png())
    assert err.value.status == 404 and server.count == 1 and "attempts" not in str(err.value)


def test_a_dead_endpoint_is_retried_then_named(env):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.setenv("OPENAI_API_KEY", "k")
    judge = make_judge(base_url=f"http://127.0.0.1:{port}/v1", max_retries=1)
    with pytest.raises(judging.JudgeError, match=f"127.0.0.1:{port}/v1/chat/completions could not be reached "
                                                 "after 2 attempts"):
        judge.ask(png())
    assert judge.requests_sent == 2


def test_401_names_the_key_variable(server, env):
    env.setenv("OPENAI_API_KEY", "wrong")
    with pytest.raises(judging.JudgeAuthError) as err:
        judging.rate_images(make_judge(), judging.RatingCache(), [("pope", i, png((i, 0, 0))) for i in range(3)],
                            workers=1)
    message = str(err.value)
    assert "HTTP 401" in message and "OPENAI_API_KEY" in message and "OPENAI_BASE_URL" in message
    assert "sk-abc123" not in message and "wrong" not in message
    assert server.count == 1  # a bad key stops at the first answer


def test_azure_sends_its_key_header_and_names_its_variable(env):
    with FakeOpenAI(key="az-key", model="gpt-4o", azure=True) as fake:
        env.setenv("API_TYPE", "azure")
        env.setenv("AZURE_API_KEY", "az-key")
        assert make_judge(base_url=fake.base_url).ask(png()).rating == rating_of(png())
        sent = fake.requests[0]  # the SDK's Azure scheme under the given root: the deployment in the path
        assert sent["path"] == f"/v1/deployments/gpt-4o/chat/completions?api-version={judging.AZURE_API_VERSION}"
        assert sent["headers"]["api-key"] == "az-key" and "authorization" not in sent["headers"]
        env.setenv("AZURE_API_KEY", "bad")
        with pytest.raises(judging.JudgeAuthError, match="AZURE_API_KEY"):
            make_judge(base_url=fake.base_url).ask(png())
    env.setenv("AZURE_ENDPOINT", "https://res.openai.azure.com/")
    assert make_judge().url == ("https://res.openai.azure.com/openai/deployments/gpt-4o/chat/completions"
                                f"?api-version={judging.AZURE_API_VERSION}")


def test_unparsable_replies_are_recorded_as_none(server):
    server.reply = lambda image: "The image shows several things; it is hard to say."
    cache = judging.RatingCache()
    [rating] = judging.rate_images(make_judge(), cache, [("mmvet", 0, png())])
    assert rating.rating is None and rating.error is None and rating.reply.startswith("The image shows")
    assert len(cache) == 1  # temperature 0: asking again would get the same text


@pytest.mark.parametrize("api_type", [None, "openai", "azure", "azure_openai"])
def test_missing_key_matches_mmvets_rule(env, api_type):
    if api_type:
        env.setenv("API_TYPE", api_type)
    key = api_key_env()
    assert key in judge_skip_reason(JUDGE_TASKS[0])  # the variable MM-Vet's skip names
    with pytest.raises(judging.JudgeAuthError, match=key):
        judging.ConcentrationJudge.from_env()
    env.setenv(key, "x")
    assert judge_skip_reason(JUDGE_TASKS[0]) is None and judging.missing_key_message() is None


def test_endpoint_from_the_environment(env):
    env.setenv("OPENAI_API_KEY", "k")
    assert make_judge().url == "https://api.openai.com/v1/chat/completions"
    env.setenv("OPENAI_API_URL", "http://lmms:1/v1/")  # lmms-eval's name
    assert make_judge().url == "http://lmms:1/v1/chat/completions"
    env.setenv("OPENAI_BASE_URL", "http://sdk:2/v1")  # the OpenAI SDK's name wins
    assert make_judge().url == "http://sdk:2/v1/chat/completions"
    assert make_judge(base_url="http://arg:3/v1").url == "http://arg:3/v1/chat/completions"


# ----------------------------------------------------------------------------------------------------------------
# MM-Vet's judge (lmms-eval's own client): one endpoint setting, probed before any generation (issue 21)


def test_one_endpoint_setting_reaches_both_judges(env):
    from promprune.eval.tasks import align_judge_endpoint

    env.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    assert align_judge_endpoint() is None
    import os

    assert os.environ["OPENAI_API_URL"] == "http://127.0.0.1:9/v1"  # what lmms-eval 0.7's MM-Vet reads
    env.delenv("OPENAI_BASE_URL")
    env.setenv("OPENAI_API_URL", "http://127.0.0.1:8/v1")
    assert align_judge_endpoint() is None and os.environ["OPENAI_BASE_URL"] == "http://127.0.0.1:8/v1"
    env.setenv("OPENAI_BASE_URL", "http://127.0.0.1:7/v1")
    problem = align_judge_endpoint()
    assert "OPENAI_BASE_URL" in problem and "OPENAI_API_URL" in problem


def test_the_mmvet_judge_is_probed_once_through_lmms_evals_client(env):
    from pipelines.preflight import check_judges

    with FakeOpenAI(key="test-key", model="gpt-4o-2024-11-20", require_image=False) as fake:
        env.setenv("OPENAI_API_KEY", "test-key")
        env.setenv("OPENAI_BASE_URL", fake.base_url)  # the SDK's name: must reach lmms-eval's judge too
        assert check_judges(["mmvet", "pope"]) == []
        assert fake.count == 1
        assert check_judges(["pope"]) == [] and fake.count == 1  # no judge-scored task: no request


def test_a_wrong_judge_key_or_a_dead_endpoint_stops_in_seconds_naming_the_variables(env):
    import socket
    import time

    from pipelines.preflight import check_judges

    with FakeOpenAI(key="right-key", model="gpt-4o-2024-11-20", require_image=False) as fake:
        env.setenv("OPENAI_API_KEY", "wrong-key")
        env.setenv("OPENAI_BASE_URL", fake.base_url)
        (error,) = check_judges(["mmvet"])
        assert "mmvet" in error and "OPENAI_API_KEY" in error and "AuthenticationError" in error
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.setenv("OPENAI_API_KEY", "k")
    env.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{port}/v1")
    start = time.perf_counter()
    (error,) = check_judges(["mmvet"])
    assert time.perf_counter() - start < 20
    assert f"127.0.0.1:{port}" in error and "OPENAI_BASE_URL" in error


def test_a_skipped_judge_task_is_said_on_the_console(env):
    from pipelines.preflight import check_judges, judge_notes

    (note,) = judge_notes(["mmvet", "pope"])
    assert note.startswith("note:") and "OPENAI_API_KEY" in note and "mmvet" in note
    assert check_judges(["mmvet"]) == []  # skipped, so nothing to probe


@pytest.mark.parametrize("where,url", [("--judge-base-url", "localhost:8000"), ("OPENAI_BASE_URL", "localhost:8000"),
                                       ("OPENAI_API_URL", "127.0.0.1:8000/v1"), ("--judge-base-url", "ftp://h/v1"),
                                       ("AZURE_ENDPOINT", "res.openai.azure.com")])
def test_an_endpoint_without_http_is_refused_by_its_setting(env, where, url):
    """A URL without http(s) (the SDK retried one it can never reach for a minute) is refused when the judge is
    built, naming the flag or variable that set it; nothing is sent."""
    env.setenv("OPENAI_API_KEY", "k")
    if where.startswith("AZURE"):
        env.setenv("API_TYPE", "azure")
        env.setenv("AZURE_API_KEY", "k")
    if not where.startswith("--"):
        env.setenv(where, url)
    with pytest.raises(judging.JudgeError) as err:
        make_judge(**({"base_url": url} if where.startswith("--") else {}))
    assert str(err.value).startswith(f"{where} {url!r} is not an http(s) URL: give the judge endpoint's API root "
                                     "with its scheme, e.g. http://127.0.0.1:8000/v1")


def test_the_probe_asks_once_without_retries_and_is_not_counted(server):
    judge = make_judge(max_retries=6)
    assert judge.probe(timeout=5) is None
    assert server.count == 1 and judge.requests_sent == 0  # the probe's request is not one of the ratings'
    server.script = [(500, "overloaded", FAST_RETRY)]
    error = judge.probe(timeout=5)
    assert "answered HTTP 500: overloaded" in str(error) and server.count == 2  # no retry
    server.script = [(401, "no", {})]
    assert isinstance(judge.probe(timeout=5), judging.JudgeAuthError)


# ----------------------------------------------------------------------------------------------------------------
# a 200 whose body is not JSON; the cache file shared by two processes


BROKEN_JSON = (200, b'{"choices": [', {})  # HTTP 200, application/json, cut short


def test_a_body_that_is_not_json_is_a_failed_request_not_a_crash(server):
    """A probe's case: one truncated JSON body escaped ``ask`` as json.JSONDecodeError and ended the whole run. It
    is a JudgeError (``ask``'s docstring): that image gets rating None with the error, the others are asked."""
    server.script = [(200, "4", {}), BROKEN_JSON]
    items = [("pope", i, png((i, 9, 9))) for i in range(3)]
    cache = judging.RatingCache()
    ratings = judging.rate_images(make_judge(), cache, items, workers=1)
    assert [r.rating for r in ratings] == [4, None, rating_of(items[2][2])] and server.count == 3
    assert "did not return a Chat Completion (its body is not valid JSON: JSONDecodeError" in ratings[1].error
    assert ratings[0].error is None and len(cache) == 2  # the failed one is not cached: a rerun asks again
    server.script = [BROKEN_JSON] * 3
    with pytest.raises(judging.JudgeError, match="2 judge requests in a row failed; the last: .*not valid JSON"):
        judging.rate_images(make_judge(), judging.RatingCache(), items, workers=1, max_consecutive_failures=2)


def test_the_preflight_probe_reports_a_body_that_is_not_json(server):
    from pipelines.preflight import check_concentration_judge

    server.script = [BROKEN_JSON]
    (problem,) = check_concentration_judge(make_judge())
    assert problem.startswith("judge: a test request failed: the judge endpoint") and "not valid JSON" in problem


SAVER = """
import sys
from pipelines import judge as judging
path, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
cache = judging.RatingCache()
for i in range(n):
    cache.put({"task": who, "doc_id": i, "rating": 3, "reply": "3", "model": "m", "prompt_sha": "p",
               "image_sha": f"{who}{i}"})
    cache.save(path)
"""


def test_two_processes_saving_one_cache_keep_each_others_ratings(tmp_path):
    """Two Fig. 2 runs with different --tasks share outputs/fig2_concentration/judge_ratings.json and save after
    every rating; each save wrote its own cache whole, so the last writer dropped the other's paid ratings."""
    import os
    import subprocess
    import sys

    path, n = tmp_path / "judge_ratings.json", 25
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, str(path), who, str(n)], env=env) for who in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    entries = judging.RatingCache.load(path).entries.values()
    assert sorted((e["task"], e["doc_id"]) for e in entries) == sorted((w, i) for w in "ab" for i in range(n))
