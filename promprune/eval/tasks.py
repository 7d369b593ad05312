"""lmms-eval tasks: the offline easy-vqa tasks, the paper's benchmarks by their lmms-eval names, task loading.

Offline tasks. The task definitions ship in this package (``lmms_tasks/easyvqa/``: YAML and ``utils.py``); the data
is the ``easy-vqa`` package's test split (1,000 images of coloured shapes, 9,673 questions), converted once into
parquet under the cache directory (``$PROMPRUNE_CACHE``, default ``~/.cache/promprune``:
``lmms_tasks/<suite>_<version>/``). Beside it, a folder named by a hash of what it holds
(``lmms_tasks/<suite>_<version>-<hash>/``) holds a copy of the packaged definitions and two small YAML files that
``include:`` that copy and name the parquet: checkouts (or versions) whose definitions differ each get their own, so
none overwrites another's. That folder is what lmms-eval's ``include_path`` gets, so the same tasks also work with
the ``lmms-eval`` command line::

    python -m promprune.eval prepare          # prints the include path
    lmms-eval --model promprune --model_args pretrained=tiny:llava --tasks easyvqa_yesno --include_path <it>

Hub tasks (MME, POPE, ...) are lmms-eval's own definitions, unchanged; their data comes from the Hugging Face hub.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from promprune.atomic import atomic_path, locked
from promprune.env import cache_dir, temporary_env

log = logging.getLogger(__name__)

EASYVQA_TASKS = ("easyvqa_yesno", "easyvqa_open")
# the prominence testbed (promprune.testbed): procedural scenes with known semantic prominence
TESTBED_TASKS = ("testbed_exist", "testbed_count", "testbed_attribute", "testbed_relation",
                 "testbed_exist_concentrated", "testbed_exist_spread", "testbed_count_concentrated",
                 "testbed_count_spread")
# short-video multiple choice on procedural clips (promprune.testbed.video_tasks): MVBench's moving_direction offline
VIDEO_TASKS = ("testbed_video_direction",)
OFFLINE_TASKS = EASYVQA_TASKS + TESTBED_TASKS + VIDEO_TASKS
# lmms-eval tasks whose doc_to_visual gives a video's frames, a list of PIL images, instead of the file's path (each
# read in lmms-eval 0.7.3): such a list is answered as one clip (``frames_are_clips``). Nothing in a task's YAML tells
# them apart from a multi-image task: lmms-eval's ``dataset_kwargs.video`` is set as well by tasks whose documents
# are several still images (megabench_*, mix_evals_image2text_*, site_bench_image), which stay refused
FRAME_TASKS = ("osi_bench_frames", "vsibench_multiimage", "vsibench_debiased_multiimage",
               "site_bench_video_multiimage", "neptune_full_i", "neptune_mma_i", "neptune_mmh_i")
# every MVBench task is a video task (mvbench_frames_doc_to_visual gives a clip's frames, mvbench_doc_to_visual its
# path)
FRAME_TASK_PREFIXES = ("mvbench_",)
_LMMS_TASKS = Path(__file__).parent / "lmms_tasks"
# suite -> (its tasks, cache version: bump when the data changes, so stale caches are rebuilt instead of reused)
SUITES = {"easyvqa": (EASYVQA_TASKS, "v1"), "testbed": (TESTBED_TASKS, "v2"), "testbed_video": (VIDEO_TASKS, "v2")}
_YESNO = ("yes", "no")

# The paper's benchmarks -> lmms-eval task names, and the metric each one reports (Rel. averages their ratios).
# MMBench: the regex-scored `_static` dev variant (the plain one needs a GPT judge). POPE: F1, as LLaVA-1.5 and the
# token-pruning papers report it (85.9 for LLaVA-1.5-7B). MME: the perception score, as the paper's tables print it
# (LLaVA-1.5-7B: 1507.0); cognition is logged beside it but is not part of the table or of Rel.
PAPER_TASKS = {
    "MME": "mme",
    "POPE": "pope",
    "MMB": "mmbench_en_dev_static",
    "TextVQA": "textvqa_val",
    "SQA": "scienceqa_img",
    "GQA": "gqa",
    "VQAv2": "vqav2_val",
    "VizWiz": "vizwiz_vqa_val",
    "MM-Vet": "mmvet",
}
PRIMARY_METRICS: dict[str, tuple[str, ...]] = {
    "mme": ("mme_perception_score",),
    "pope": ("pope_f1_score",),
    "mmbench_en_dev_static": ("gpt_eval_score",),
    "mmbench_en_dev": ("gpt_eval_score",),
    "textvqa_val": ("exact_match",),
    "scienceqa_img": ("exact_match",),
    "gqa": ("exact_match",),
    "vqav2_val": ("exact_match",),
    "vizwiz_vqa_val": ("exact_match",),
    "mmvet": ("gpt_eval_score",),
    # held-out benchmarks none of the paper's tables report: where sweeps/mu_calibration_grid.yaml scores its grid
    "ok_vqa_val2014": ("exact_match",),
    "realworldqa": ("exact_match",),
    "easyvqa_yesno": ("f1",),
    "easyvqa_open": ("exact_match",),
    # the testbed: existence by F1 (POPE's headline), relations (balanced yes/no) by accuracy, the rest exact match
    **{t: ("f1",) if t.startswith("testbed_exist") else ("accuracy",) if t == "testbed_relation" else ("exact_match",)
       for t in TESTBED_TASKS},
    # video (issue 26): MVBench's accuracy (%), on its tasks and on the offline stand-in
    **{t: ("mvbench_accuracy",) for t in ("testbed_video_direction", "mvbench_moving_direction",
                                          "mvbench_action_sequence", "mvbench_object_interaction")},
}
# tasks whose scoring calls an LLM judge: the environment variable that must hold its key (lmms-eval's API_TYPE
# picks the provider: openai -> OPENAI_API_KEY, azure -> AZURE_API_KEY)
JUDGE_TASKS = ("mmvet",)
# judge-scored task -> its per-document grade record (lmms-eval leaves ``eval_model`` empty when the judge never
# answered and records 0.0, and scoring empties it where the judge's replies held no grade: scoring counts such a
# sample as failed instead)
JUDGE_GRADES = {"mmvet": "gpt_eval_score"}
# tasks whose aggregation needs both documents of each question pair (MME: the "+" accuracy of each image)
PAIRED_TASKS = ("mme",)


class TaskUnavailableError(RuntimeError):
    """A task whose data cannot be loaded here (no network, no cache), with the reason."""


def _easyvqa_tables():
    """The easy-vqa test split as two column dicts: yes/no questions and open questions (in the package's order)."""
    import easy_vqa

    texts, answers, image_ids = easy_vqa.get_test_questions()
    paths = easy_vqa.get_test_image_paths()
    tables = {name: {"question_id": [], "image_id": [], "question": [], "answer": [], "image": []}
              for name in EASYVQA_TASKS}
    for qid, (text, answer, image_id) in enumerate(zip(texts, answers, image_ids)):
        table = tables["easyvqa_yesno" if answer in _YESNO else "easyvqa_open"]
        table["question_id"].append(qid)
        table["image_id"].append(int(image_id))
        table["question"].append(text)
        table["answer"].append(answer)
        table["image"].append({"bytes": Path(paths[image_id]).read_bytes(), "path": None})
    return tables


def _write_parquet(columns: dict, path: Path) -> None:
    """Columns -> parquet: ``image`` as a datasets Image, ints as int64, floats as float64, the rest strings."""
    import datasets

    def feature(name, values):
        if name == "image":
            return datasets.Image()
        if all(isinstance(v, int) for v in values):
            return datasets.Value("int64")
        if all(isinstance(v, (int, float)) for v in values):
            return datasets.Value("float64")
        return datasets.Value("string")

    features = datasets.Features({name: feature(name, values) for name, values in columns.items()})
    quiet = not datasets.are_progress_bars_disabled()
    if quiet:  # a few ms of writing: its "Creating parquet" bars would lead the sweep's console, before its own lines
        datasets.disable_progress_bars()
    try:
        with atomic_path(path) as tmp:  # concurrent preparers never see half a file
            datasets.Dataset.from_dict(columns, features=features).to_parquet(str(tmp))
    finally:
        if quiet:
            datasets.enable_progress_bars()


def _task_yaml(task: str, parquet: Path) -> str:
    return (
        "# Generated by promprune.eval.tasks.prepare_offline_tasks(); the definition is the included file, copied\n"
        "# here from the package (promprune/eval/lmms_tasks/) so that this folder holds every file it needs.\n"
        f"include: _{task}_yaml\n"
        f"task: {task}\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {parquet}\n"
    )


def _tables(suite: str, root: Path) -> dict:
    if suite == "easyvqa":
        return _easyvqa_tables()
    if suite == "testbed_video":  # the clips are files next to the parquet (the documents name their paths)
        from promprune.testbed.video_tasks import tables as video_tables

        return video_tables(root)
    from promprune.testbed.tasks import tables

    return tables()


def prepare_offline_tasks(suite: str = "easyvqa") -> Path:
    """Build a suite's parquet files once (`offline_data_dir`) and its task folder once per content: the task YAMLs
    and the packaged definitions they include, in a folder named by their hash; returns that folder, the suite's
    lmms-eval include path, which holds every file its tasks load but the data (named by absolute path) and none in
    this checkout.

    Each checkout (or version) whose definitions differ prepares its own folder, and a folder, once written, never
    changes: what one checkout loads is never overwritten by another's preparing (the last to prepare won, for all
    of them, when the suite had one folder). Both are written under a lock, the folder whole at once
    (`promprune.atomic`): a concurrent preparer waits, then finds it there."""
    if suite not in SUITES:
        raise ValueError(f"unknown offline task suite {suite!r}; valid: {', '.join(SUITES)}")
    tasks = SUITES[suite][0]
    data = offline_data_dir(suite)
    parquets = {task: data / f"{task}.parquet" for task in tasks}
    if not all(p.exists() for p in parquets.values()):
        with locked(data.parent / f".{data.name}.lock"):
            if not all(p.exists() for p in parquets.values()):  # another preparer's, while this one waited
                log.info("writing the %s tasks' data as parquet under %s (once)", suite, data)
                data.mkdir(parents=True, exist_ok=True)
                for task, columns in _tables(suite, data).items():
                    _write_parquet(columns, parquets[task])
    files = _task_files(suite, parquets)
    digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:12]
    root = data.parent / f"{data.name}-{digest}"
    if not _holds(root, files):  # (a file deleted by hand: written again)
        with locked(data.parent / f".{root.name}.lock"):
            if not _holds(root, files):
                with atomic_path(root) as tmp:
                    tmp.mkdir()
                    for name, text in files.items():
                        (tmp / name).write_text(text)
    return root


def _holds(folder: Path, files: dict[str, str]) -> bool:
    return all((folder / name).is_file() for name in files)


def offline_data_dir(suite: str) -> Path:
    """Where a suite's data lives (parquet files; the video suite's clips): one folder per suite and data version
    (`SUITES`), shared by every checkout using this cache."""
    version = SUITES[suite][1]
    return cache_dir() / "lmms_tasks" / f"{suite}_{version}"


def _task_files(suite: str, parquets: dict[str, Path]) -> dict[str, str]:
    """{file name: text} of a suite's task folder: the packaged definitions (`_<task>_yaml`, their common part,
    utils.py), copied so the folder needs no checkout (one deleted, or another's, never loads here), and each task's
    YAML, which includes its definition by relative name and names its parquet."""
    files = {source.name: source.read_text() for source in sorted((_LMMS_TASKS / suite).iterdir())
             if source.is_file() and (source.name.endswith("_yaml") or source.suffix == ".py")}
    files.update({f"{task}.yaml": _task_yaml(task, parquet) for task, parquet in parquets.items()})
    return files


@functools.lru_cache(maxsize=8)  # an index without lmms-eval's own tasks and one with them, per set of paths
def _task_manager(include_paths: tuple[str, ...], include_defaults: bool):
    from lmms_eval.tasks import TaskManager

    # model_name picks each task's lmms_eval_specific_kwargs; "promprune" has no entry, so tasks use "default"
    return TaskManager("WARNING", include_path=list(include_paths), include_defaults=include_defaults,
                       model_name="promprune")


INCLUDE_PATH_ENV = "PROMPRUNE_INCLUDE_PATH"


def env_include_paths() -> list[str]:
    """The task directories ``$PROMPRUNE_INCLUDE_PATH`` names (``os.pathsep``-separated; how a sweep's
    ``include_path:`` reaches its Ray workers), each as found here: the path itself, else a directory of the same
    name on ``sys.path`` (the copy Ray's runtime environment shipped to a node that lacks the path). ValueError
    naming a directory found neither way."""
    import sys

    found = []
    for entry in [e for e in os.environ.get(INCLUDE_PATH_ENV, "").split(os.pathsep) if e.strip()]:
        path = Path(entry).expanduser()
        copies = [Path(p) / path.name for p in sys.path if p and (Path(p) / path.name).is_dir()]
        if not path.is_dir() and not copies:
            raise ValueError(f"task directory {entry!r} (${INCLUDE_PATH_ENV}) is not on this machine, and no copy "
                             "of it is on sys.path; put it on a filesystem every node sees, or ship it with Ray's "
                             "runtime environment (a sweep's include_path does)")
        found.append(str(path if path.is_dir() else copies[0]))
    return found


def task_manager(tasks: list[str], include_path: str | list[str] | None = None):
    """A (cached) lmms-eval TaskManager that knows the offline tasks, ``include_path`` and ``$PROMPRUNE_INCLUDE_PATH``
    (task directories of one's own), and lmms-eval's own tasks.

    Indexing lmms-eval's ~2,000 task files takes seconds, so it is skipped when the offline tasks and the include
    paths hold every task asked for.
    """
    extra = [include_path] if isinstance(include_path, str) else list(include_path or [])
    extra = list(dict.fromkeys([str(Path(p).expanduser()) for p in extra] + env_include_paths()))
    suites = [name for name, (members, _) in SUITES.items() if set(members) & set(tasks)] or ["easyvqa"]
    paths = tuple(str(p) for p in [*(prepare_offline_tasks(name) for name in suites), *extra])
    manager = _indexed(paths, False, extra)
    if not set(tasks) <= set(manager.all_tasks):
        manager = _indexed(paths, True, extra)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        from promprune.suggest import closest

        known = [*manager.all_tasks, *OFFLINE_TASKS]  # every offline suite, indexed here or not (only asked ones are)
        hints = [f"{close!r} for {t!r}" for t, close in ((t, closest(t, known)) for t in unknown) if close]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        where = f" Task directories searched besides lmms-eval's own: {extra}." if extra else ""
        raise ValueError(f"unknown lmms-eval task(s) {unknown}{hint}. Offline tasks: {list(OFFLINE_TASKS)}.{where}")
    return manager


def _indexed(paths: tuple[str, ...], include_defaults: bool, own: list[str]):
    """`_task_manager`; when lmms-eval cannot index, a TaskFileError (a ValueError) naming each file of the task
    directories ``own`` that stops it (`promprune.eval.task_checks.broken_task_files`), instead of its traceback."""
    try:
        return _task_manager(paths, include_defaults)
    except Exception:
        from promprune.eval.task_checks import TaskFileError, broken_task_files

        problems = broken_task_files(own)
        if problems:
            raise TaskFileError(problems) from None
        raise


def _yaml_config(path: Path) -> dict:
    """A task YAML as plain data, its ``include:`` files merged under it; ``!function`` tags read as None (importing
    a task's utils can need an API key or network, and the keys read here never name functions)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load(path.read_text(), Loader=Loader) or {}
    include = config.pop("include", None)
    if include is None:
        return config
    base = _yaml_config(path.parent / include if not Path(include).is_absolute() else Path(include))
    return {**base, **config}


def task_config(name: str, include_path: str | list[str] | None = None) -> dict:
    """The task's YAML configuration (data source, splits, ``generation_kwargs``), read without loading its code
    or data: what a validation can show in seconds."""
    manager = task_manager([name], include_path)
    entry = manager._task_index.get(name) or {}
    path = entry.get("yaml_path")
    if not path or path == -1:
        raise ValueError(f"task {name!r} has no YAML definition lmms-eval indexed")
    return _yaml_config(Path(path))


def video_task_kind(name: str, include_path: str | list[str] | None = None,
                    _seen: frozenset = frozenset()) -> str | None:
    """What ``name``'s YAML alone (no data, no code) says of whether its documents are clips: ``"clips"`` for an
    offline video task (``VIDEO_TASKS``, whose documents are clips), a task whose list of images is a clip's frames
    (``frames_are_clips``: MVBench's tasks give a clip's path or its frames, ``FRAME_TASKS`` their frames; answered
    as clips either way) or a group with one; ``"flagged"`` for a task
    whose ``dataset_kwargs`` set ``video`` (or a group with one), which may give clips or images: in lmms-eval
    the flag only makes the loader download and unpack the dataset's archives. MVBench and Video-MME set it and give
    clips; MixEval-X's image2text tasks (``mix_evals_image2text_mc``) and ``site_bench_image`` set it and give PIL
    images. None otherwise. ValueError for a task lmms-eval does not know here.

    Only ``"clips"`` is certain. The request builder decides at run time, for each document from its own visual
    (``requests.document_visual``); loading a flagged task's data to look would run that archive download and
    extraction (gigabytes for a video benchmark), so the preflight does not do it. The same holds for a task of one's
    own that gives clips without the flag."""
    if name in VIDEO_TASKS:
        return "clips"
    config = task_config(name, include_path)  # (an unknown name is refused here, whatever frames_are_clips says)
    if frames_are_clips(name):
        return "clips"
    kwargs = config.get("dataset_kwargs")
    kind = "flagged" if isinstance(kwargs, dict) and kwargs.get("video") else None
    members = config.get("task") if "group" in config else None
    members = [members] if isinstance(members, str) else members if isinstance(members, list) else []
    names = [m if isinstance(m, str) else m.get("task") if isinstance(m, dict) else None for m in members]
    for member in (m for m in names if isinstance(m, str) and m not in _seen and m != name):
        try:
            found = video_task_kind(member, include_path, _seen | {name})
        except ValueError:  # a member lmms-eval does not index by itself (defined inline in the group)
            continue
        if found == "clips":
            return "clips"
        kind = kind or found
    return kind


def frames_are_clips(task: str) -> bool:
    """Whether a list of images that ``task``'s ``doc_to_visual`` gives is one clip's frames (answered as a clip,
    ``requests.document_visual``): an offline video task (``VIDEO_TASKS``), an MVBench task (``mvbench_*``) or one of
    ``FRAME_TASKS``. Any other task's list of several images is a multi-image document, refused per document: the
    decision goes by name because no signal in a task tells a video's frames from several still images (see
    ``FRAME_TASKS``; ``video_task_kind``'s "flagged" holds for both), and a multi-view task answered as a video would
    be scored silently, where a refused one shows its failed samples."""
    return task in VIDEO_TASKS or task in FRAME_TASKS or task.startswith(FRAME_TASK_PREFIXES)


def primary_metrics(task: str, include_path: str | list[str] | None = None) -> tuple[str, ...]:
    """What ``task`` is compared by (Rel., the headline columns, bootstrap intervals): ``PRIMARY_METRICS``'s choice,
    else the first metric of the task's own ``metric_list`` (a benchmark of one's own); () when there is none."""
    if task in PRIMARY_METRICS:
        return PRIMARY_METRICS[task]
    try:
        listed = task_config(task, include_path).get("metric_list") or []
    except ValueError:  # not a task lmms-eval knows here
        return ()
    first = listed[0].get("metric") if isinstance(listed, list) and listed and isinstance(listed[0], dict) else None
    return (first,) if isinstance(first, str) else ()


def own_primary_metrics(tasks: list[str], include_path: str | list[str] | None = None) -> dict[str, tuple[str, ...]]:
    """``primary_metrics`` of each of ``tasks`` that ``PRIMARY_METRICS`` does not name (a task of one's own: its
    YAML's first metric), those that have one: what the sweep's Rel. of such a task used. The sweep logs it on its
    parent run (``pipelines.recording.tracking.own_primary_metrics``) and the report shows the same metric from it,
    or, for a run recorded without it, from its recorded ``include_path`` (``pipelines.reporting.store``)."""
    own = {task: primary_metrics(task, include_path) for task in tasks if task not in PRIMARY_METRICS}
    return {task: metrics for task, metrics in own.items() if metrics}


def check_limit(task: str, limit: int | None) -> str | None:
    """Why ``limit`` cannot score ``task`` (None when it can): MME scores question pairs (two questions per image,
    consecutive documents), so an odd limit would cut the last pair and fail only after everything is generated."""
    if task in PAIRED_TASKS and limit is not None and limit % 2:
        return (f"task {task!r} scores question pairs (two questions per image) and limit {limit} would cut the last "
                f"pair; use an even limit such as {limit + 1}")
    return None


# where a judge's OpenAI-compatible endpoint is named: the OpenAI SDK's variable, and the one lmms-eval's judges read
ENDPOINT_ENVS = ("OPENAI_BASE_URL", "OPENAI_API_URL")


# The key rule every LLM judge shares (MM-Vet's in lmms-eval's worker, the Fig. 2 judge in pipelines/judge.py):
# lmms-eval's API_TYPE picks the provider, and with it the variable that holds the key.


def api_type() -> str:
    return os.environ.get("API_TYPE", "openai")


def is_azure() -> bool:
    return api_type().startswith("azure")


def api_key_env() -> str:
    """The environment variable holding a judge's key: ``AZURE_API_KEY`` when API_TYPE starts with ``azure``, else
    ``OPENAI_API_KEY`` (lmms-eval's providers read the same)."""
    return "AZURE_API_KEY" if is_azure() else "OPENAI_API_KEY"


def align_judge_endpoint() -> str | None:
    """Make one endpoint setting reach every judge: lmms-eval 0.7's MM-Vet reads ``OPENAI_API_URL``, the OpenAI SDK
    (and our README) ``OPENAI_BASE_URL``; whichever is set is copied to the other, so MM-Vet never falls back to the
    public endpoint while the user's server was named. Returns a problem when both are set and disagree."""
    sdk, lmms = (os.environ.get(name) or None for name in ENDPOINT_ENVS)
    if sdk and lmms and sdk.rstrip("/") != lmms.rstrip("/"):
        return (f"OPENAI_BASE_URL={sdk!r} and OPENAI_API_URL={lmms!r} name different judge endpoints; set one of them "
                "(both judges read either)")
    if sdk or lmms:
        for name in ENDPOINT_ENVS:
            os.environ[name] = sdk or lmms
    return None


def judge_skip_reason(task: str) -> str | None:
    """Why ``task`` must be skipped here (its LLM judge has no API key), or None when it can run."""
    if task not in JUDGE_TASKS:
        return None
    key = api_key_env()
    if os.environ.get(key):
        return None
    return (f"task {task!r} is scored by an LLM judge (lmms-eval API_TYPE={api_type()!r}) and {key} is not set; "
            "skipping it")


def single_process():
    """lmms-eval reads RANK / WORLD_SIZE from the environment and shards documents by them; the bridge always wants
    every document (sharding is Ray's job), so pin a single-process view while lmms-eval runs."""
    return temporary_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


@contextlib.contextmanager
def lmms_eval_silenced():
    """lmms-eval's loguru messages off while tasks build (with LOGURU_LEVEL unset it logs a traceback at DEBUG for
    every request cache miss, which reads like a crash); its exceptions still propagate."""
    try:
        from loguru import logger
    except ImportError:  # lmms-eval without loguru: nothing to silence
        yield
        return
    logger.disable("lmms_eval")
    try:
        yield
    finally:
        logger.enable("lmms_eval")


_LENIENT = threading.local()  # set inside `first_document_undecoded`, on the thread that entered it
_LENIENT_INSTALL = threading.Lock()


@contextlib.contextmanager
def first_document_undecoded():
    """While lmms-eval builds a task it reads the task's first document as a test (``ConfigurableTask.__init__``:
    ``task_docs[0]``, its text, target and choices), and ``datasets`` decodes that row's images: one unreadable image
    there failed the whole task, and a sweep with it, where the same image at any other document is one failed sample.
    Inside this block an image that does not decode reads as a 1 x 1 placeholder; the rows themselves are read later
    with strict decoding (``promprune.eval.requests``), so that document is one failed sample too.

    Only the thread inside the block decodes leniently: ``datasets``' image decoder is wrapped once per process, and
    the wrapper substitutes the placeholder only where the calling thread set the flag, so another thread decoding
    at the same time (a worker's requests while a task is built beside them) still fails on a bad image, and blocks
    entered by several threads at once neither undo each other nor leave the decoder lenient behind them."""
    _install_lenient_decode()
    depth = getattr(_LENIENT, "depth", 0)
    _LENIENT.depth = depth + 1
    try:
        yield
    finally:
        _LENIENT.depth = depth


def _install_lenient_decode() -> None:
    """Wraps ``datasets``' ``Image.decode_example`` once: a thread inside `first_document_undecoded` gets a 1 x 1
    placeholder for an image that does not decode, every other caller the decoder's own behaviour."""
    from datasets.features import Image as ImageFeature
    from PIL import Image

    with _LENIENT_INSTALL:
        original = ImageFeature.decode_example
        if getattr(original, "_promprune_lenient", False):
            return

        def decode(self, value, token_per_repo_id=None):
            try:
                return original(self, value, token_per_repo_id=token_per_repo_id)
            except Exception:  # noqa: BLE001 - PIL and datasets raise many types for bad bytes; read strictly later
                if getattr(_LENIENT, "depth", 0) > 0:
                    return Image.new("RGB", (1, 1))
                raise

        decode._promprune_lenient = True
        ImageFeature.decode_example = decode


def load_task(name: str, include_path: str | list[str] | None = None):
    """The lmms-eval Task object for ``name`` with its data loaded; TaskUnavailableError when the data is not here."""
    from lmms_eval.tasks import get_task_dict

    manager = task_manager([name], include_path)
    if name in JUDGE_TASKS:
        problem = align_judge_endpoint() or judge_skip_reason(name)  # the judge is built when its module is imported
        if problem:
            raise TaskUnavailableError(problem)
    try:
        with single_process(), first_document_undecoded():
            task_dict = get_task_dict([name], manager)
    except Exception as exc:  # noqa: BLE001 - any loader failure is reported with its cause
        raise TaskUnavailableError(_load_failure(name, manager._task_index.get(name, {}).get("yaml_path"), exc)
                                   ) from exc
    task = _leaf_task(task_dict, name)
    if task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)  # as lmms-eval's simple_evaluate does
    if task.OUTPUT_TYPE != "generate_until":
        raise ValueError(f"task {name!r} has output_type {task.OUTPUT_TYPE!r}; the bridge supports generate_until only")
    return task


def _load_failure(name: str, source, exc: Exception) -> str:
    """Why the task did not load: its data not found, or the split it evaluates not among its data's
    (`promprune.eval.task_checks`), else the loader's error, with the hub's needs when the data is not local."""
    from promprune.eval.task_checks import LOCAL_BUILDERS, data_problem, split_problem

    readable = isinstance(source, str) and os.path.isfile(source)
    found = readable and (data_problem(name, source) or split_problem(name, source) or
                          _missing_split(name, source, exc))
    if found:
        return found
    local = readable and _yaml_config(Path(source)).get("dataset_path") in LOCAL_BUILDERS
    hub = "" if local else (" Hub tasks download from the Hugging Face hub and need network access (or a populated "
                            f"HF cache); offline, use {list(OFFLINE_TASKS)}.")
    return (f"task {name!r} could not load its data ({type(exc).__name__}: {str(exc)[:300]}).{hub} Task definition: "
            f"{source or '?'}")


def _missing_split(name: str, yaml_path: str, exc: Exception) -> str | None:
    """The loader's ``KeyError`` when the task's data has no split named by the one it evaluates (lmms-eval reads
    ``dataset[test_split]``, else ``dataset[validation_split]``), as a problem naming that split and the data's own
    (read off the dataset the failing lookup was made on); None for any other failure."""
    import traceback

    import datasets

    config = _yaml_config(Path(yaml_path))
    field = "test_split" if config.get("test_split") is not None else "validation_split"
    if not isinstance(exc, KeyError) or not exc.args or exc.args[0] != config.get(field):
        return None
    splits = [list(frame.f_locals["self"]) for frame, _ in traceback.walk_tb(exc.__traceback__)
              if isinstance(frame.f_locals.get("self"), datasets.DatasetDict)]
    has = f"its data has the split(s) {splits[-1]}" if splits else "its data has no such split"
    return (f"task {name!r} ({yaml_path}) evaluates {field}: {exc.args[0]}, a split its data does not have ({has}); "
            f"set {field} to a split of the dataset")


def _leaf_task(task_dict: dict, name: str):
    """get_task_dict returns {name: Task} for a task, {group: {...}} for a group; the bridge takes tasks only."""
    task = task_dict.get(name)
    if task is None or isinstance(task, dict):
        raise ValueError(f"{name!r} is a group of tasks in lmms-eval; name its member tasks instead")
    return task
