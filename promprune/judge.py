"""The semantic-concentration judge of the paper's Fig. 2: an image in, a 1-5 rating out, from any endpoint that
speaks OpenAI's Chat Completions API (OpenAI, Azure OpenAI, vLLM, SGLang, a proxy).

The paper (Sec. 3.2 and App. B) sampled 100 images from each of seven benchmarks, had GPT-4o rate each one's
semantic concentration on a 1-5 scale with the prompt of its Fig. B1 (:data:`PROMPT`), and plotted the mean
normalized entropy of each prominence metric per rating. This module is the judge and its cache; the experiment is
``pipelines/fig2_concentration.py``.

    judge = ConcentrationJudge.from_env()               # key and endpoint as lmms-eval's MM-Vet judge finds them
    cache = RatingCache.load("ratings.json")            # ratings keyed by (task, doc_id, model, prompt hash)
    ratings = rate_images(judge, cache, [("pope", 0, png_bytes), ...])
    cache.save("ratings.json")

Configuration, by environment variable as for lmms-eval's judge-scored tasks (MM-Vet):

- ``API_TYPE`` (default ``openai``): ``openai`` -> key in ``OPENAI_API_KEY``, sent as ``Authorization: Bearer``;
  ``azure...`` -> key in ``AZURE_API_KEY``, sent as ``api-key``, to ``$AZURE_ENDPOINT/openai/deployments/<model>/
  chat/completions?api-version=$API_VERSION`` (lmms-eval's URL scheme).
- ``OPENAI_BASE_URL`` (the OpenAI SDK's name; lmms-eval's ``OPENAI_API_URL`` is read too): the API root, default
  ``https://api.openai.com/v1``; requests go to ``<root>/chat/completions``.

Only the standard library is used (``urllib``). One request per image: the prompt as a text part, the image as a
``data:image/png;base64,...`` ``image_url`` part, temperature 0. 429, 5xx, timeouts and dropped connections are
retried with exponential backoff (``Retry-After`` honoured); 401/403 raise :class:`JudgeAuthError`, whose message
names the environment variable the key came from; a reply without a parsable 1-5 rating is recorded with rating
None and its text, never raised.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The prompt of the paper's Fig. B1 ("Prompt Used for GPT-4o-based Semantic Prominence Annotation"), word for word.
# The paper typesets it in a box; rendered to plain text here: bold headings and line breaks as plain lines, a blank
# line where the box leaves vertical space, LaTeX's en-dash ranges ("1--5") as ASCII hyphens ("1-5").
PROMPT = """\
Task Description:
Rate semantic concentration in the image: how concentrated or spread the meaningful visual information is.

Definition of a 'semantic unit' (independently meaningful entity or region):
- a distinct object (person, car, animal, tool, etc.)
- a readable text block
- a meaningful object part needed for understanding an action (hands, faces, instruments)
- diagram elements, icons, or labeled regions

Do NOT count:
- uniform background (sky, wall, road)
- repeated texture without distinct objects (grass, sand, water ripples, bricks)

Important rule:
If many different objects, people, or scene elements appear across the image, the information is considered \
BROADLY DISTRIBUTED even if each object is small.

Examples of BROAD distribution (low scores):
- street scenes with many cars and people
- markets, crowds, sports games
- indoor scenes with many objects across the room
- natural landscapes with multiple meaningful elements (trees, buildings, animals, people)

Examples of CONCENTRATED information (high scores):
- a single object on a plain background
- a document or sign where the key information lies in one small area
- a close-up of a single person or object

Decision procedure:
1) Estimate the number of semantic units in the scene.
2) Estimate how widely they are spatially distributed.
3) If many independent objects appear across the scene, treat the image as distributed.

Score (1-5):
5 = Highly Concentrated: 1 main semantic unit occupying a small region.
4 = Mostly Concentrated: 1-2 units with little surrounding information.
3 = Balanced: several units but not covering the whole scene.
2 = Distributed: many objects or meaningful regions across the image.
1 = Highly Distributed: complex natural scene with many objects/interactions spread across the entire image.

Output format:
Output only one integer (1-5)."""

RATINGS = (1, 2, 3, 4, 5)  # 1 = highly distributed ... 5 = highly concentrated (Fig. B1)
DEFAULT_MODEL = "gpt-4o"  # the paper's annotator; a dated snapshot (gpt-4o-2024-11-20) pins it further
DEFAULT_BASE_URL = "https://api.openai.com/v1"
BASE_URL_ENVS = ("OPENAI_BASE_URL", "OPENAI_API_URL")  # the OpenAI SDK's name first, then lmms-eval's
AZURE_API_VERSION = "2024-02-15-preview"  # lmms-eval's default for API_VERSION
RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504)  # worth another try; any other 5xx is retried too
CACHE_FORMAT = "promprune.judge.ratings/1"


def prompt_sha(prompt: str = PROMPT) -> str:
    """The prompt's identity in cache keys: sha256 of its UTF-8 text, hex."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def image_sha(png: bytes) -> str:
    return hashlib.sha256(png).hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# key and endpoint (the rule of promprune.eval.tasks.judge_skip_reason: lmms-eval's API_TYPE picks the provider)


def api_type() -> str:
    return os.environ.get("API_TYPE", "openai")


def is_azure() -> bool:
    return api_type().startswith("azure")


def api_key_env() -> str:
    """The environment variable holding the judge's key: ``AZURE_API_KEY`` when API_TYPE starts with ``azure``,
    else ``OPENAI_API_KEY``: the variable ``judge_skip_reason`` checks for MM-Vet (a test keeps the two in step)."""
    return "AZURE_API_KEY" if is_azure() else "OPENAI_API_KEY"


def missing_key_message() -> str | None:
    """What to set when the judge has no key (None when it has one): one paragraph for a person to act on."""
    env = api_key_env()
    if os.environ.get(env):
        return None
    return (f"the semantic-concentration judge (the paper's GPT-4o rating of Fig. 2) needs an API key, and {env} is "
            f"not set (API_TYPE={api_type()!r} selects {env}, as for MM-Vet's judge). Set {env} to your key; for "
            "another OpenAI-compatible server (vLLM, SGLang, a proxy) also set OPENAI_BASE_URL (or pass "
            "--judge-base-url) to its API root, e.g. http://host:8000/v1, and set the key to whatever it expects "
            "(any non-empty value when it checks none).")


def base_url_from_env() -> str:
    for name in BASE_URL_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return DEFAULT_BASE_URL


# ----------------------------------------------------------------------------------------------------------------
# the reply


_SCORE_PATTERNS = (  # an explicit score in a longer reply; the last match wins (a conclusion follows reasoning)
    re.compile(r"(?:score|rating|rated|rate|answer)\s*(?:is|of|=|:)?\s*\**\s*([1-5])(?![\d.])", re.IGNORECASE),
    re.compile(r"(?<![\d.])([1-5])\s*(?:/\s*5|out of 5)(?![\d.])", re.IGNORECASE),
)


def parse_rating(text: str | None) -> int | None:
    """The 1-5 rating in a judge's reply, or None when there is none or it is ambiguous.

    ``"4"``, ``"4."``, ``"**4**"``, ``"Score: 4"``, ``"I'd rate it 2/5"`` give the number; ``"0"``, ``"7"``,
    ``"3.5"``, ``"3 or 4"``, ``""`` and prose without a number give None. Formatting is ignored; a reply that lists
    several numbers counts only when one of them is marked as the score ("score: 3", "3/5", "3 out of 5")."""
    if not text:
        return None
    clean = text.strip().strip("*_`'\" \n").strip()
    if re.fullmatch(r"[1-5]\.?", clean):
        return int(clean[0])
    numbers = re.findall(r"(?<![\d.])\d+(?:\.\d+)?(?![\d.])", text)
    if len(numbers) == 1 and numbers[0] in ("1", "2", "3", "4", "5"):
        return int(numbers[0])
    for pattern in _SCORE_PATTERNS:
        found = pattern.findall(text)
        if found:
            return int(found[-1])
    return None


# ----------------------------------------------------------------------------------------------------------------
# the client


class JudgeError(RuntimeError):
    """A request that failed for good (after retries, or a status that no retry fixes)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class JudgeAuthError(JudgeError):
    """The endpoint refused the key (401) or the key may not use the model (403): every request will fail."""


@dataclass
class Reply:
    """One answer: the reply text, its rating (None: unparsable), the model that answered, attempts used."""

    text: str
    rating: int | None
    model: str
    attempts: int


@dataclass
class ConcentrationJudge:
    """A Chat Completions client asking :data:`PROMPT` about one image at a time (temperature 0).

    ``url`` is the full ``.../chat/completions`` address; :meth:`from_env` builds it as lmms-eval does. Retries:
    ``max_retries`` more attempts after the first on 429 / 5xx / timeouts / dropped connections, sleeping
    ``backoff * 2**attempt`` seconds (capped at ``max_backoff``, jittered, or the server's ``Retry-After``).
    """

    url: str
    api_key: str
    key_env: str = "OPENAI_API_KEY"  # named in errors: where the key came from
    model: str = DEFAULT_MODEL
    prompt: str = PROMPT
    azure: bool = False  # send the key as `api-key` instead of `Authorization: Bearer`
    timeout: float = 60.0  # seconds per request
    max_retries: int = 6
    backoff: float = 2.0
    max_backoff: float = 60.0
    max_tokens: int | None = None  # None: not sent (the prompt asks for one integer; some models reject the field)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)  # tests pass a no-op
    requests_sent: int = field(default=0, init=False)  # HTTP requests, retries included
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def from_env(cls, *, model: str = DEFAULT_MODEL, base_url: str | None = None, **options) -> ConcentrationJudge:
        """The judge as the environment configures it (module docstring); ``base_url`` overrides the endpoint's
        API root. Raises :class:`JudgeAuthError` with :func:`missing_key_message` when the key is not set."""
        problem = missing_key_message()
        if problem:
            raise JudgeAuthError(problem)
        env, azure = api_key_env(), is_azure()
        if base_url:
            url = base_url.rstrip("/") + "/chat/completions"
        elif azure:
            endpoint = os.environ.get("AZURE_ENDPOINT", "").rstrip("/")
            if not endpoint:
                raise JudgeError("API_TYPE selects Azure OpenAI but AZURE_ENDPOINT is not set (e.g. "
                                 "https://<resource>.openai.azure.com); set it, or pass the API root as base_url")
            version = os.environ.get("API_VERSION", AZURE_API_VERSION)
            url = f"{endpoint}/openai/deployments/{model}/chat/completions?api-version={version}"
        else:
            url = base_url_from_env().rstrip("/") + "/chat/completions"
        return cls(url=url, api_key=os.environ[env], key_env=env, model=model, azure=azure, **options)

    @property
    def prompt_sha(self) -> str:
        return prompt_sha(self.prompt)

    def body(self, png: bytes) -> dict:
        """The request body for one image."""
        data_url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        content = [{"type": "text", "text": self.prompt}, {"type": "image_url", "image_url": {"url": data_url}}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    def ask(self, png: bytes) -> Reply:
        """Rate one PNG image. Raises :class:`JudgeAuthError` (401/403) or :class:`JudgeError` (any other failure
        that retrying did not fix, or a response that is not a Chat Completion)."""
        data = json.dumps(self.body(png)).encode("utf-8")
        headers = {"Content-Type": "application/json",
                   **({"api-key": self.api_key} if self.azure else {"Authorization": f"Bearer {self.api_key}"})}
        for attempt in range(self.max_retries + 1):
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            with self._lock:
                self.requests_sent += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = response.read()
            except urllib.error.HTTPError as exc:
                detail = _error_detail(exc)
                if exc.code in (401, 403):
                    raise JudgeAuthError(self._auth_message(exc.code, detail), exc.code) from None
                if (exc.code in RETRY_STATUS or exc.code >= 500) and attempt < self.max_retries:
                    self.sleep(self._delay(attempt, exc.headers.get("Retry-After")))
                    continue
                raise JudgeError(f"the judge endpoint {self.url} answered HTTP {exc.code}"
                                 f"{' after ' + str(attempt + 1) + ' attempts' if attempt else ''}: {detail}",
                                 exc.code) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt < self.max_retries:
                    self.sleep(self._delay(attempt, None))
                    continue
                reason = getattr(exc, "reason", exc)
                raise JudgeError(f"the judge endpoint {self.url} could not be reached after {attempt + 1} attempts "
                                 f"({type(exc).__name__}: {reason})") from None
            text, model = _completion_text(payload, self.url)
            return Reply(text=text, rating=parse_rating(text), model=model or self.model, attempts=attempt + 1)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        try:
            if retry_after is not None:
                return min(float(retry_after), self.max_backoff)
        except ValueError:
            pass  # an HTTP date: use the exponential schedule instead
        return min(self.backoff * 2 ** attempt, self.max_backoff) * (0.5 + random.random() / 2)

    def _auth_message(self, status: int, detail: str) -> str:
        what = "refused the API key" if status == 401 else "does not let this API key use the model"
        return (f"the judge endpoint {self.url} {what} (HTTP {status}: {detail}). The key is read from "
                f"{self.key_env} (API_TYPE={api_type()!r} selects {self.key_env}, as for MM-Vet's judge): set it to "
                f"a valid key for this endpoint{'' if status == 401 else ' with access to model ' + repr(self.model)}"
                ". The endpoint comes from OPENAI_BASE_URL (or --judge-base-url); check it points where the key "
                "belongs.")


def _error_detail(exc: urllib.error.HTTPError) -> str:
    """The server's error message (OpenAI: ``{"error": {"message": ...}}``), short, without echoing a key."""
    try:
        raw = exc.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the status alone still says enough
        return exc.reason or "no detail"
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw
    message = re.sub(r"sk-[A-Za-z0-9_-]{6,}", "sk-***", str(message)).strip()
    return message[:300] or str(exc.reason)


def _completion_text(payload: bytes, url: str) -> tuple[str, str | None]:
    """(reply text, answering model) of a Chat Completions response; JudgeError when it is not one."""
    try:
        data = json.loads(payload)
        content = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError(f"the judge endpoint {url} did not return a Chat Completion: {payload[:200]!r}") from None
    if isinstance(content, list):  # some servers answer with content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return (content or "").strip(), data.get("model")


# ----------------------------------------------------------------------------------------------------------------
# the cache


@dataclass
class Rating:
    """One image's rating: ``rating`` None means the reply held no 1-5 score (``reply`` says what it held) or the
    request failed (``error``); ``cached``: no request was made for it in this call."""

    task: str
    doc_id: int
    rating: int | None
    reply: str | None
    model: str
    prompt_sha: str
    image_sha: str
    answered_by: str | None = None  # the model name in the response (e.g. a dated snapshot)
    error: str | None = None
    cached: bool = False

    def entry(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("error", "cached")}


def cache_key(task: str, doc_id: int, model: str, prompt_hash: str) -> str:
    return f"{task}|{int(doc_id)}|{model}|{prompt_hash}"


class RatingCache:
    """Ratings by (task, doc_id, model, prompt hash), in a JSON file; an entry also keeps its image's sha256, and
    one whose image changed (the dataset moved on) is not a hit. Failed requests are never stored (a rerun asks
    again); unparsable replies are (temperature 0: asking again would give the same text), with rating None."""

    def __init__(self, entries: Iterable[dict] = ()):
        self.entries: dict[str, dict] = {}
        self._by_image: dict[tuple, dict] = {}
        for entry in entries:
            self.put(entry)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, task: str, doc_id: int, model: str, prompt_hash: str, image_hash: str | None = None) -> dict | None:
        entry = self.entries.get(cache_key(task, doc_id, model, prompt_hash))
        if entry is not None and image_hash is not None and entry.get("image_sha") != image_hash:
            return None
        return entry

    def same_image(self, model: str, prompt_hash: str, image_hash: str) -> dict | None:
        """A rating of the same image under the same model and prompt (benchmarks ask several questions about
        one image: POPE, MME, GQA), or None."""
        return self._by_image.get((model, prompt_hash, image_hash))

    def put(self, entry: dict) -> None:
        key = cache_key(entry["task"], entry["doc_id"], entry["model"], entry["prompt_sha"])
        self.entries[key] = dict(entry)
        self._by_image[(entry["model"], entry["prompt_sha"], entry["image_sha"])] = self.entries[key]

    def merge(self, other: RatingCache) -> RatingCache:
        for entry in other.entries.values():
            if cache_key(entry["task"], entry["doc_id"], entry["model"], entry["prompt_sha"]) not in self.entries:
                self.put(entry)
        return self

    def to_json(self) -> str:
        entries = sorted(self.entries.values(), key=lambda e: (e["task"], e["doc_id"], e["model"], e["prompt_sha"]))
        return json.dumps({"format": CACHE_FORMAT, "entries": entries}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> RatingCache:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            raise ValueError(f"not a rating cache (expected format {CACHE_FORMAT!r})")
        return cls(data["entries"])

    @classmethod
    def load(cls, path: str | Path) -> RatingCache:
        """The cache in ``path``; empty when the file does not exist."""
        path = Path(path)
        return cls.from_json(path.read_text(encoding="utf-8")) if path.exists() else cls()

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary file, then a rename): a kill never leaves half a cache."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        os.replace(tmp, path)
        return path


# ----------------------------------------------------------------------------------------------------------------
# many images


def rate_images(judge: ConcentrationJudge, cache: RatingCache, items: Iterable[tuple[str, int, bytes]], *,
                workers: int = 4, max_consecutive_failures: int = 5,
                on_new: Callable[[Rating], None] | None = None) -> list[Rating]:
    """A :class:`Rating` per ``(task, doc_id, png)`` item, in order: from ``cache`` when it holds one (or holds the
    same image under the same model and prompt), else from ``judge`` (``workers`` requests at a time); each new
    rating goes into ``cache`` and to ``on_new`` (e.g. to save the cache as it grows).

    A request that fails for good gives rating None with ``error`` set, and is not cached; ``max_consecutive_failures``
    of them in a row stop the run with :class:`JudgeError` (the endpoint is down: no point asking 700 times).
    :class:`JudgeAuthError` (a bad key) stops it at once.
    """
    items = list(items)
    model, p_sha = judge.model, judge.prompt_sha
    out: list[Rating | None] = [None] * len(items)
    todo: dict[str, list[int]] = {}  # image sha -> the items waiting for it (one request per distinct image)
    for i, (task, doc_id, png) in enumerate(items):
        i_sha = image_sha(png)
        hit = cache.get(task, doc_id, model, p_sha, i_sha) or cache.same_image(model, p_sha, i_sha)
        if hit is not None:
            out[i] = Rating(task, int(doc_id), hit["rating"], hit["reply"], model, p_sha, i_sha,
                            hit.get("answered_by"), cached=True)
            if cache.get(task, doc_id, model, p_sha, i_sha) is None:
                cache.put(out[i].entry())
        else:
            todo.setdefault(i_sha, []).append(i)
    failures, queue = 0, iter(todo.items())
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        pending: dict = {}

        def submit_more():  # at most `workers` in flight: a bad key or a dead endpoint stops after few requests
            for i_sha, waiting in queue:
                pending[pool.submit(judge.ask, items[waiting[0]][2])] = (i_sha, waiting)
                if len(pending) >= max(1, workers):
                    return

        submit_more()
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                i_sha, waiting = pending.pop(future)
                try:
                    reply, error = future.result(), None
                except JudgeAuthError:
                    raise
                except JudgeError as exc:
                    reply, error = None, str(exc)
                failures = failures + 1 if error else 0
                for i in waiting:
                    task, doc_id, _ = items[i]
                    if reply is None:
                        rating = Rating(task, int(doc_id), None, None, model, p_sha, i_sha, error=error)
                    else:
                        rating = Rating(task, int(doc_id), reply.rating, reply.text, model, p_sha, i_sha,
                                        reply.model)
                    out[i] = rating
                    if error is None:
                        cache.put(rating.entry())
                        if on_new is not None:
                            on_new(rating)
                if failures >= max_consecutive_failures:
                    raise JudgeError(f"{failures} judge requests in a row failed; the last: {error}")
            submit_more()
    return out  # type: ignore[return-value] - every slot is filled above
