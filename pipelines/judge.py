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

Configuration, by environment variable as for lmms-eval's judge-scored tasks (MM-Vet; the key rule is
``promprune.eval.tasks.api_key_env``):

- ``API_TYPE`` (default ``openai``): ``openai`` -> key in ``OPENAI_API_KEY``, an ``openai.OpenAI`` client;
  ``azure...`` -> key in ``AZURE_API_KEY``, an ``openai.AzureOpenAI`` client on ``$AZURE_ENDPOINT`` with
  ``api_version=$API_VERSION`` (as lmms-eval's Azure provider builds it): requests go to
  ``<endpoint>/openai/deployments/<model>/chat/completions?api-version=...``.
- ``OPENAI_BASE_URL`` (the OpenAI SDK's name; lmms-eval's ``OPENAI_API_URL`` is read too): the API root, default
  ``https://api.openai.com/v1``; requests go to ``<root>/chat/completions``. The SDK's other settings
  (``OPENAI_ORG_ID``, ``OPENAI_PROJECT_ID``, proxies through ``HTTPS_PROXY``) apply as usual.

The client is the ``openai`` SDK's. One request per image: the prompt as a text part, the image as a
``data:image/png;base64,...`` ``image_url`` part, temperature 0. The SDK retries 408, 409, 429, 5xx, timeouts and
dropped connections ``max_retries`` times with its exponential backoff (0.5 s doubling to 8 s, jittered; a
server's ``Retry-After`` / ``retry-after-ms`` up to 2 minutes honoured); 401/403 raise :class:`JudgeAuthError`,
whose message names the environment variable the key came from; a reply without a parsable 1-5 rating is recorded
with rating None and its text, never raised.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import openai

from promprune.atomic import atomic_path, locked
from promprune.eval.tasks import ENDPOINT_ENVS, api_key_env, api_type, is_azure

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
AZURE_API_VERSION = "2024-02-15-preview"  # lmms-eval's default for API_VERSION
CACHE_FORMAT = "promprune.judge.ratings/1"  # the name when this module lived in promprune/; kept: caches stay valid


def prompt_sha(prompt: str = PROMPT) -> str:
    """The prompt's identity in cache keys: sha256 of its UTF-8 text, hex."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def image_sha(png: bytes) -> str:
    return hashlib.sha256(png).hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# key and endpoint (the rule of promprune.eval.tasks.judge_skip_reason: lmms-eval's API_TYPE picks the provider)


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


def endpoint_setting() -> tuple[str | None, str]:
    """(the environment variable that names the endpoint's API root, its value); (None, the default) when none
    does."""
    for name in ENDPOINT_ENVS:  # the OpenAI SDK's name first, then lmms-eval's
        if os.environ.get(name):
            return name, os.environ[name]
    return None, DEFAULT_BASE_URL


def url_problem(url: str, where: str) -> str | None:
    """Why ``url``, set by ``where`` (a flag or an environment variable), cannot be the judge's endpoint, or None.
    Without a scheme (``localhost:8000``) the SDK would retry a URL it can never reach for a minute."""
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https") and parsed.netloc:
        return None
    return (f"{where} {url!r} is not an http(s) URL: give the judge endpoint's API root with its scheme, e.g. "
            "http://127.0.0.1:8000/v1 for a local vLLM or SGLang server (--judge-base-url, else OPENAI_BASE_URL, "
            "names it; neither: https://api.openai.com/v1)")


# ----------------------------------------------------------------------------------------------------------------
# the reply


_SCORE_PATTERNS = (  # an explicit score in a longer reply; the last match wins (a conclusion follows reasoning)
    # whole words: "rate" inside "Concentrated" or "moderate" is no score keyword
    re.compile(r"\b(?:score|rating|rated|rate|answer)\b\s*(?:is|of|=|:)?\s*\**\s*([1-5])(?![\d.])", re.IGNORECASE),
    re.compile(r"(?<![\d.])([1-5])\s*(?:/\s*5|out of 5)(?![\d.])", re.IGNORECASE),
)
# the prompt's rubric lines ("5 = Highly Concentrated: ..."): label -> its score, read from PROMPT itself
RUBRIC = {label.lower(): int(score) for score, label in re.findall(r"(?m)^([1-5]) = ([^:\n]+):", PROMPT)}
_RUBRIC_LINE = re.compile(  # a score, then a rubric label: "5 = Highly Concentrated", "3 - Balanced", "**4**: ..."
    r"(?<![\w.])([1-5])\**\s*(?:=|:|-|\u2013|\u2014|\.|\))\s*\**\s*("
    + "|".join(re.escape(label) for label in sorted(RUBRIC, key=len, reverse=True)) + r")(?![a-z])", re.IGNORECASE)
# a number, a leading minus sign its part ("-3"; the "-" of a range "1-2" is not)
_NUMBER = re.compile(r"(?<![\d.])(?:(?<![\w.])-)?\d+(?:\.\d+)?(?![\d.])")


def parse_rating(text: str | None) -> int | None:
    """The 1-5 rating in a judge's reply, or None when there is none or it is ambiguous.

    ``"4"``, ``"4."``, ``"**4**"``, ``"Score: 4"``, ``"I'd rate it 2/5"`` give the number; ``"0"``, ``"7"``, ``"-3"``,
    ``"3.5"``, ``"3 or 4"``, ``""`` and prose without a number give None. Formatting is ignored; a reply that lists
    several numbers counts only when one of them is marked as the score ("score: 3", "3/5", "3 out of 5"), or when
    it repeats the rubric line of one score (``"4 = Mostly Concentrated: 1-2 units ..."``, ``"3 - Balanced"``:
    the number with its label in :data:`PROMPT`); rubric lines of different scores, or a number beside another
    score's label, give None unless a marked score follows."""
    if not text:
        return None
    clean = text.strip().strip("*_`'\" \n").strip()
    if re.fullmatch(r"[1-5]\.?", clean):
        return int(clean[0])
    numbers = _NUMBER.findall(text)
    if len(numbers) == 1 and numbers[0] in ("1", "2", "3", "4", "5"):
        return int(numbers[0])
    for pattern in _SCORE_PATTERNS:
        found = pattern.findall(text)
        if found:
            return int(found[-1])
    said = {int(score) for score, _ in _RUBRIC_LINE.findall(text)}
    said |= {RUBRIC[label.lower()] for _, label in _RUBRIC_LINE.findall(text)}
    return said.pop() if len(said) == 1 else None


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
    """An ``openai`` SDK client asking :data:`PROMPT` about one image at a time (temperature 0).

    ``base_url``: the API root (``.../v1``; for Azure, the SDK's ``.../openai`` root) or None for
    ``azure_endpoint``; :meth:`from_env` fills both as lmms-eval does. ``timeout`` and ``max_retries`` are the
    SDK's (module docstring). ``requests_sent`` counts HTTP requests, retries included."""

    api_key: str
    base_url: str | None = None
    key_env: str = "OPENAI_API_KEY"  # named in errors: where the key came from
    model: str = DEFAULT_MODEL  # for Azure: the deployment
    prompt: str = PROMPT
    azure: bool = False  # an AzureOpenAI client: the key as `api-key`, the deployment in the path
    azure_endpoint: str | None = None  # Azure: the resource root (https://<resource>.openai.azure.com)
    api_version: str = AZURE_API_VERSION  # Azure only
    timeout: float = 60.0  # seconds per request
    max_retries: int = 6  # more attempts after the first, by the SDK
    max_tokens: int | None = None  # None: not sent (the prompt asks for one integer; some models reject the field)
    requests_sent: int = field(default=0, init=False)
    client: openai.OpenAI = field(init=False, repr=False)

    def __post_init__(self):
        self._lock, self._local = threading.Lock(), threading.local()
        http = openai.DefaultHttpxClient(event_hooks={"request": [self._count]})  # sees every retry too
        common = {"api_key": self.api_key, "timeout": self.timeout, "max_retries": self.max_retries,
                  "http_client": http}
        if self.azure:
            self.client = openai.AzureOpenAI(api_version=self.api_version, base_url=self.base_url,
                                             azure_endpoint=None if self.base_url else self.azure_endpoint, **common)
        else:
            self.client = openai.OpenAI(base_url=self.base_url or DEFAULT_BASE_URL, **common)

    def _count(self, request) -> None:
        with self._lock:
            self.requests_sent += 1
        self._local.attempts = getattr(self._local, "attempts", 0) + 1  # this thread's current ask()

    @classmethod
    def from_env(cls, *, model: str = DEFAULT_MODEL, base_url: str | None = None, **options) -> ConcentrationJudge:
        """The judge as the environment configures it (module docstring); ``base_url`` overrides the endpoint's
        API root (with Azure, the SDK's ``.../openai`` root, under which it adds ``deployments/<model>/...``).
        Raises :class:`JudgeAuthError` with :func:`missing_key_message` when the key is not set, :class:`JudgeError`
        when the endpoint is not an http(s) URL (:func:`url_problem`, naming ``base_url`` as ``--judge-base-url``)."""
        problem = missing_key_message()
        if problem:
            raise JudgeAuthError(problem)
        env, azure = api_key_env(), is_azure()
        endpoint, where = None, "--judge-base-url"
        if azure and not base_url:
            endpoint, where = os.environ.get("AZURE_ENDPOINT", "").rstrip("/"), "AZURE_ENDPOINT"
            if not endpoint:
                raise JudgeError("API_TYPE selects Azure OpenAI but AZURE_ENDPOINT is not set (e.g. "
                                 "https://<resource>.openai.azure.com); set it, or pass the API root as base_url")
            options.setdefault("api_version", os.environ.get("API_VERSION", AZURE_API_VERSION))
        elif not azure and not base_url:
            where, base_url = endpoint_setting()
        problem = None if where is None else url_problem(endpoint or base_url, where)
        if problem:
            raise JudgeError(problem)
        return cls(api_key=os.environ[env], base_url=base_url, key_env=env, model=model, azure=azure,
                   azure_endpoint=endpoint, **options)

    @property
    def url(self) -> str:
        """Where the requests go (for messages and the run's params)."""
        root = str(self.client.base_url).rstrip("/")
        if self.azure:
            return f"{root}/deployments/{self.model}/chat/completions?api-version={self.api_version}"
        return f"{root}/chat/completions"

    @property
    def prompt_sha(self) -> str:
        return prompt_sha(self.prompt)

    def body(self, png: bytes) -> dict:
        """The request's arguments for one image (``chat.completions.create(**body)``)."""
        data_url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        content = [{"type": "text", "text": self.prompt}, {"type": "image_url", "image_url": {"url": data_url}}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    def ask(self, png: bytes) -> Reply:
        """Rate one PNG image. Raises :class:`JudgeAuthError` (401/403) or :class:`JudgeError` (any other failure
        that the SDK's retries did not fix, or a response that is not a Chat Completion)."""
        self._local.attempts = 0
        try:
            completion = self.client.chat.completions.create(**self.body(png))
        except openai.APIStatusError as exc:
            status, detail, attempts = exc.status_code, _error_detail(exc), self._local.attempts
            if status in (401, 403):
                raise JudgeAuthError(self._auth_message(status, detail), status) from None
            raise JudgeError(f"the judge endpoint {self.url} answered HTTP {status}"
                             f"{' after ' + str(attempts) + ' attempts' if attempts > 1 else ''}: {detail}",
                             status) from None
        except openai.APIConnectionError as exc:  # timeouts included
            reason, attempts = exc.__cause__ or exc, self._local.attempts
            raise JudgeError(f"the judge endpoint {self.url} could not be reached after {attempts} "
                             f"attempt{'s' if attempts != 1 else ''} ({type(reason).__name__}: {reason})") from None
        except openai.APIError as exc:  # a 2xx body the SDK could not read
            raise JudgeError(f"the judge endpoint {self.url} did not return a Chat Completion: {exc}") from None
        except ValueError as exc:  # a 2xx JSON body cut short or malformed: the SDK's json.loads raises it as is
            raise JudgeError(f"the judge endpoint {self.url} did not return a Chat Completion (its body is not "
                             f"valid JSON: {type(exc).__name__}: {exc})") from None
        text, answered_by = _completion_text(completion, self.url)
        return Reply(text=text, rating=parse_rating(text), model=answered_by or self.model,
                     attempts=self._local.attempts)

    def probe(self, timeout: float) -> JudgeError | None:
        """Ask about one small grey image once, through a copy of this judge with no retries and ``timeout`` seconds
        (its request is not counted in ``requests_sent``): None when the endpoint answered, whatever the reply,
        else why not (:class:`JudgeAuthError` for a refused key)."""
        quick = replace(self, timeout=timeout, max_retries=0)
        try:
            quick.ask(probe_png())
        except JudgeError as exc:
            return exc
        return None

    def _auth_message(self, status: int, detail: str) -> str:
        what = "refused the API key" if status == 401 else "does not let this API key use the model"
        return (f"the judge endpoint {self.url} {what} (HTTP {status}: {detail}). The key is read from "
                f"{self.key_env} (API_TYPE={api_type()!r} selects {self.key_env}, as for MM-Vet's judge): set it to "
                f"a valid key for this endpoint{'' if status == 401 else ' with access to model ' + repr(self.model)}"
                ". The endpoint comes from OPENAI_BASE_URL (or --judge-base-url); check it points where the key "
                "belongs.")


def probe_png() -> bytes:
    """A 64x64 grey PNG: small, and above the smallest side vision processors take (Qwen2-VL's 28 pixels)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (128, 128, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


def _error_detail(exc: openai.APIStatusError) -> str:
    """The server's error message (OpenAI: ``{"error": {"message": ...}}``, which the SDK unwraps into ``body``),
    short, without echoing a key."""
    body = exc.body
    message = body.get("message") if isinstance(body, dict) else body
    message = re.sub(r"sk-[A-Za-z0-9_-]{6,}", "sk-***", str(message or "")).strip()
    return message[:300] or exc.response.reason_phrase or "no detail"


def _completion_text(completion, url: str) -> tuple[str, str | None]:
    """(reply text, answering model) of a Chat Completion; JudgeError when it is not one (the SDK builds its
    response objects without validating them)."""
    try:
        content = completion.choices[0].message.content
    except (AttributeError, IndexError, KeyError, TypeError):
        shown = str(completion)[:200]
        raise JudgeError(f"the judge endpoint {url} did not return a Chat Completion: {shown}") from None
    if isinstance(content, list):  # some servers answer with content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return (content or "").strip(), getattr(completion, "model", None)


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
    again); unparsable replies are (temperature 0: asking again would give the same text), with rating None. Each
    entry keeps the reply's text, which :func:`rate_images` parses again on every hit (the stored rating is what the
    parser of its day read). Several processes may share one file: :meth:`save` merges with what is there."""

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
        """Write atomically (a temporary file, then a rename): a kill never leaves half a cache. What the file holds
        already is merged in first, under a lock beside it (``.<name>.lock``): two runs sharing the file (Fig. 2 with
        different ``--tasks``) keep each other's ratings; for a key both hold, this cache's entry wins."""
        path = Path(path)
        with locked(path.with_name(f".{path.name}.lock")):
            if path.exists():
                self.merge(RatingCache.load(path))
            with atomic_path(path) as tmp:
                tmp.write_text(self.to_json(), encoding="utf-8")
        return path


# ----------------------------------------------------------------------------------------------------------------
# many images


def uncached(judge: ConcentrationJudge, cache: RatingCache, items: Iterable[tuple[str, int, bytes]]) -> int:
    """How many of the ``(task, doc_id, png)`` items :func:`rate_images` would ask ``judge`` about (``cache`` holds
    neither the item nor its image under the judge's model and prompt)."""
    model, p_sha = judge.model, judge.prompt_sha
    return sum(1 for task, doc_id, png in items
               if cache.get(task, doc_id, model, p_sha, i_sha := image_sha(png)) is None
               and cache.same_image(model, p_sha, i_sha) is None)


def rate_images(judge: ConcentrationJudge, cache: RatingCache, items: Iterable[tuple[str, int, bytes]], *,
                workers: int = 4, max_consecutive_failures: int = 5,
                on_new: Callable[[Rating], None] | None = None) -> list[Rating]:
    """A :class:`Rating` per ``(task, doc_id, png)`` item, in order: from ``cache`` when it holds one (or holds the
    same image under the same model and prompt), else from ``judge`` (``workers`` requests at a time); each new
    rating goes into ``cache`` and to ``on_new`` (e.g. to save the cache as it grows). A cached rating is the
    cached reply parsed again (:func:`parse_rating`), so a cache written by an older parser gives today's rating
    (and ``cache`` is corrected).

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
            # the stored reply read again: a parser fix mends an old cache (an entry without its reply keeps its rating)
            rating = hit["rating"] if hit.get("reply") is None else parse_rating(hit["reply"])
            if rating != hit["rating"]:
                cache.put({**hit, "rating": rating})
            out[i] = Rating(task, int(doc_id), rating, hit["reply"], model, p_sha, i_sha,
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
