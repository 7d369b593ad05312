"""Requests out of lmms-eval tasks (on the driver) and generation over them (in each actor).

A request is a :class:`promprune.records.Request` (task, doc_id, n_docs, prompt, PNG image, gen_kwargs, error); its
answer is a :class:`promprune.records.Prediction` (the request without the image, plus the answer and its stats).
Both are plain records with an Arrow schema, so they survive Arrow / parquet / Ray Data unchanged.
"""

from __future__ import annotations

import logging
import warnings

from promprune.eval.generation import Item, decode_image, generate_items, image_to_png
from promprune.eval.tasks import check_limit, judge_skip_reason, load_task
from promprune.records import Prediction, Request

log = logging.getLogger(__name__)

def _image_of(doc_to_visual, doc, name: str) -> tuple[bytes | None, str | None]:
    """PNG bytes of the doc's single image, or (None, reason)."""
    try:
        visuals = doc_to_visual(doc)
    except Exception as exc:  # noqa: BLE001 - a broken doc becomes a failed sample, reported
        return None, f"{name}: doc_to_visual failed ({type(exc).__name__}: {exc})"
    if len(visuals) != 1:
        return None, f"{name}: expected exactly one image, the task gives {len(visuals)}"
    try:
        return image_to_png(decode_image(visuals[0], name)), None
    except ValueError as exc:
        return None, str(exc)


def _task_rows(name: str, limit: int | None, include_path, shard: tuple[int, int]) -> list[Request]:
    task = load_task(name, include_path)
    task.build_all_requests(limit=limit, rank=0, world_size=1)  # prompts only: cheap; images are encoded below
    instances = task.instances
    index, count = shard
    rows = []
    for inst in instances[index::count]:
        context, gen_kwargs, doc_to_visual, doc_id, task_name, split = inst.args
        doc = task.dataset[split][doc_id]
        image, error = _image_of(doc_to_visual, doc, f"{task_name} doc {doc_id}")
        rows.append(Request(task=task_name, doc_id=int(doc_id), n_docs=len(instances), prompt=context, image=image,
                            gen_kwargs=dict(gen_kwargs), error=error))
    return rows


def _check_shard(shard) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    try:
        index, count = (int(v) for v in shard)
    except (TypeError, ValueError):
        raise ValueError(f"shard must be (index, count), got {shard!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard must satisfy 0 <= index < count, got {shard!r}")
    return index, count


def build_requests(
    tasks: list[str],
    *,
    limit: int | None = None,
    include_path: str | list[str] | None = None,
    shard: tuple[int, int] | None = None,
) -> list[Request]:
    """Requests for the first ``limit`` documents (all when None) of each task, in task then doc order.

    ``tasks`` are lmms-eval task names: the offline ``easyvqa_yesno`` / ``easyvqa_open``, or hub tasks (``mme``,
    ``pope``, ...), which need network access (here they raise TaskUnavailableError saying so). Judge-scored tasks
    without an API key (MM-Vet) are skipped with a warning. ``include_path``: extra lmms-eval task directories.
    ``shard=(i, k)``: only every k-th document starting at the i-th (rows keep the evaluation's full ``n_docs``), so
    large benchmarks (VQAv2-val: 214k images) can be built in parallel pieces instead of all in driver memory; the
    union of the k shards is exactly the unsharded result.
    """
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks lists a task twice: {tasks}")
    shard = _check_shard(shard)
    problems = [p for p in (check_limit(t, limit) for t in tasks) if p]
    if problems:
        raise ValueError("; ".join(problems))
    rows: list[Request] = []
    for name in tasks:
        reason = judge_skip_reason(name)
        if reason:
            warnings.warn(reason, stacklevel=2)
            log.warning(reason)
            continue
        rows.extend(_task_rows(name, limit, include_path, shard))
    return rows


def _item(request: Request) -> Item:
    """A request -> Item; an unreadable image or a request that arrived failed becomes a failed item."""
    if request.error:
        return Item(request.prompt, None, request.gen_kwargs, error=request.error)
    try:
        image = decode_image(request.image, f"{request.task} doc {request.doc_id}")
    except ValueError as exc:
        return Item(request.prompt, None, request.gen_kwargs, error=str(exc))
    return Item(request.prompt, image, request.gen_kwargs)


def run_requests(vlm, requests: list[Request], *, batch_size: int = 8) -> list[Prediction]:
    """Answer every request with ``vlm`` (a ``PrunedVLM``): one prediction per request, in order.

    A corrupt image or a failing generation gives ``prediction=""`` and ``error`` set; the other requests of its
    batch are unaffected.
    """
    bad = [i for i, r in enumerate(requests) if not isinstance(r, Request)]
    if bad:
        raise TypeError(f"run_requests takes promprune.records.Request objects; item {bad[0]} is "
                        f"{type(requests[bad[0]]).__name__}")
    answers = generate_items(vlm, [_item(r) for r in requests], batch_size=batch_size)
    return [Prediction.answering(r, a) for r, a in zip(requests, answers)]
