"""Request rows out of lmms-eval tasks (on the driver) and generation over them (in each actor).

A request row is a plain dict that survives Arrow / parquet / Ray:

    task      str    lmms-eval task name
    doc_id    int    the document's index in the task's evaluation split (how scoring finds the doc again)
    n_docs    int    how many documents of this task the evaluation covers (doc_ids 0..n_docs-1; lets scoring
                     notice a missing one)
    prompt    str    the question text the model gets (the task's doc_to_text, lmms-eval's prompt kwargs)
    image     bytes  PNG of the task's image, or None when it could not be produced (then ``error`` says why)
    gen_kwargs dict  the task's generation_kwargs (lmms-eval's, ``until`` included)
    error     str | None

A prediction row is the request row without ``image``, plus ``RESULT_FIELDS``: prediction, error, entropy,
saliency_count, visual_tokens, kept, vision_ms, select_ms, prefill_ms, decode_ms, peak_mem_mb.
"""

from __future__ import annotations

import logging
import warnings

from promprune.eval.generation import Item, decode_image, generate_items, image_to_png
from promprune.eval.scoring import failed
from promprune.eval.tasks import judge_skip_reason, load_task

log = logging.getLogger(__name__)

REQUEST_FIELDS = ("task", "doc_id", "n_docs", "prompt", "image", "gen_kwargs", "error")


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


def _task_rows(name: str, limit: int | None, include_path, shard: tuple[int, int]) -> list[dict]:
    task = load_task(name, include_path)
    task.build_all_requests(limit=limit, rank=0, world_size=1)  # prompts only: cheap; images are encoded below
    instances = task.instances
    index, count = shard
    rows = []
    for inst in instances[index::count]:
        context, gen_kwargs, doc_to_visual, doc_id, task_name, split = inst.args
        doc = task.dataset[split][doc_id]
        image, error = _image_of(doc_to_visual, doc, f"{task_name} doc {doc_id}")
        rows.append(
            {
                "task": task_name,
                "doc_id": int(doc_id),
                "n_docs": len(instances),
                "prompt": context,
                "image": image,
                "gen_kwargs": dict(gen_kwargs),
                "error": error,
            }
        )
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
) -> list[dict]:
    """Request rows for the first ``limit`` documents (all when None) of each task, in task then doc order.

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
    rows: list[dict] = []
    for name in tasks:
        reason = judge_skip_reason(name)
        if reason:
            warnings.warn(reason, stacklevel=2)
            log.warning(reason)
            continue
        rows.extend(_task_rows(name, limit, include_path, shard))
    return rows


def _item(row: dict, index: int) -> Item:
    """A request row -> Item; a missing field is a ValueError naming it, an unreadable image a failed item."""
    missing = [k for k in ("task", "doc_id", "prompt", "image", "gen_kwargs") if k not in row]
    if missing:
        raise ValueError(f"request row {index} lacks field(s) {missing}")
    name = f"{row['task']} doc {row['doc_id']}"
    if failed(row):
        return Item(row["prompt"], None, row["gen_kwargs"] or {}, error=row["error"])
    try:
        image = decode_image(row["image"], name)
    except ValueError as exc:
        return Item(row["prompt"], None, row["gen_kwargs"] or {}, error=str(exc))
    return Item(row["prompt"], image, row["gen_kwargs"] or {})


def run_requests(vlm, rows: list[dict], *, batch_size: int = 8) -> list[dict]:
    """Generate an answer for every request row with ``vlm`` (a ``PrunedVLM``): one prediction row per input row.

    Output rows keep the request's fields (all but the image bytes) and add ``RESULT_FIELDS``. A corrupt image or a
    failing generation gives ``prediction=""`` and ``error`` set; the other rows of its batch are unaffected.
    """
    items = [_item(row, i) for i, row in enumerate(rows)]
    results = generate_items(vlm, items, batch_size=batch_size)
    out = []
    for row, result in zip(rows, results):
        merged = {k: v for k, v in row.items() if k != "image"}
        merged.update(result)
        out.append(merged)
    return out
