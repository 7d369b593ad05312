"""Requests out of lmms-eval tasks (on the driver) and generation over them (in each actor).

A request is a :class:`promprune.records.Request` (task, doc_id, n_docs, prompt, PNG image or a video task's clip,
gen_kwargs, error); its answer is a :class:`promprune.records.Prediction` (the request without the image, plus the
answer and its stats).
Both are plain records with an Arrow schema, so they survive Arrow / parquet / Ray Data unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings

from promprune.eval.generation import Item, decode_image, generate_items, image_to_png
from promprune.eval.tasks import check_limit, frames_are_clips, judge_skip_reason, load_task
from promprune.models.images import strict_decoding
from promprune.models.video import DEFAULT_FRAMES
from promprune.records import Prediction, Request

log = logging.getLogger(__name__)

def _image_of(visual, name: str, pngs: dict[str, bytes]) -> tuple[bytes | None, str | None, str | None]:
    """(PNG bytes, image key, None) of a doc's image (its ``visual``), or (None, None, reason).

    ``pngs`` maps image keys to the PNG already encoded: a benchmark asks several questions about one image
    (VQAv2 ~5, POPE 18, GQA ~30), and each distinct image is encoded, and later stored, once."""
    try:
        image = decode_image(visual, name)
    except ValueError as exc:
        return None, None, str(exc)
    key = image_key(image)
    if key not in pngs:
        pngs[key] = image_to_png(image)
    return pngs[key], key, None


def _document(task, split: str, doc_id, name: str) -> tuple[dict | None, str | None]:
    """(the document, None), or (None, reason) when it cannot be read. `datasets` decodes a document's image columns
    as it reads the row, and under lmms-eval's process-wide ``LOAD_TRUNCATED_IMAGES`` a cut-off file would decode
    partly grey: the row is read with strict decoding, so undecodable or truncated bytes fail here, as one sample."""
    try:
        with strict_decoding():
            return task.dataset[split][doc_id], None
    except Exception as exc:  # noqa: BLE001 - PIL and datasets raise many types for bad bytes
        return None, f"{name}: unreadable document ({type(exc).__name__}: {exc})"


def document_visual(doc_to_visual, doc, name: str, frames: bool = False) -> tuple[object, bool, str | None]:
    """(the doc's visual, whether it is a clip, None), or (None, False, reason): what a request is built from,
    decided for each document by itself (here and in the lmms-eval plugin, ``PromPruneLMM``). A clip is a visual
    that names a video file (``is_video_path``: lmms-eval's video tasks give the file's path), or, where ``frames``
    (the task's: ``tasks.frames_are_clips``), a list of images of one size, the video's frames as the task gave
    them (lmms-eval's ``mvbench_frames_doc_to_visual``, ``osi_bench_frames``; the visual is then that list); anything
    else is taken as an image, one per document. So a document whose ``doc_to_visual`` raises, or gives no usable
    visual, is one failed sample, and the task's other documents are answered as what they are. Several images in
    another task are refused, the message naming both readings (a multi-image document, or frames of a task not
    known to give them)."""
    from PIL import Image

    from promprune.models.video import is_video_path

    try:
        with strict_decoding():  # a task's doc_to_visual may decode a lazily opened image (``convert``)
            visuals = doc_to_visual(doc)
    except Exception as exc:  # noqa: BLE001 - a broken doc becomes a failed sample, reported
        return None, False, f"{name}: doc_to_visual failed ({type(exc).__name__}: {exc})"
    try:
        count = len(visuals)
    except TypeError:
        return None, False, f"{name}: doc_to_visual must give a list of one image, got {type(visuals).__name__}"
    images = count > 0 and all(isinstance(v, Image.Image) for v in visuals)
    if frames and images:
        sizes = [v.size for v in visuals]
        odd = next((k for k, size in enumerate(sizes) if size != sizes[0]), None)
        if odd is not None:
            return None, False, (f"{name}: the task gives a clip as {count} frames of different sizes (frame 0 is "
                                 f"{sizes[0][0]}x{sizes[0][1]}, frame {odd} is {sizes[odd][0]}x{sizes[odd][1]}); a "
                                 "clip's frames share one size")
        return list(visuals), True, None
    if count != 1:
        what = (f"{count} images: several images of one document are not answered (one image or one clip per "
                "request), and only the tasks of promprune.eval.tasks.frames_are_clips are taken to give a clip's "
                "frames" if images and count > 1 else f"{count}")
        return None, False, f"{name}: expected exactly one image, the task gives {what}"
    return visuals[0], is_video_path(visuals[0]), None


def read_clip(visual, name: str, frames: int = DEFAULT_FRAMES):
    """A document's clip (:func:`document_visual`'s visual where it is a clip) as a
    :class:`~promprune.models.video.Clip`: a video file's ``frames`` frames sampled uniformly (``decode_video``), or
    of the frames the task gave (a list of images), ``frames`` picked the same way (first to last, the indices
    rounded down; all of them where the task gives fewer), converted as images are (``decode_image``), the rate
    unknown. ValueError naming ``name`` where it cannot be read."""
    import numpy as np

    from promprune.models.video import Clip, frame_picks, decode_video

    if not isinstance(visual, list):
        try:
            return Clip(*decode_video(visual, frames))
        except Exception as exc:  # noqa: BLE001 - PyAV raises many types for missing / broken files
            raise ValueError(f"{name}: unreadable video {visual} ({type(exc).__name__}: {exc})") from exc
    picks = frame_picks(len(visual), frames).tolist()
    return Clip(np.stack([np.asarray(decode_image(visual[k], f"{name} frame {k}")) for k in picks]), None)


def _clip_of(visual, name: str, frames: int) -> tuple[bytes | None, str | None]:
    """(the clip's bytes, None) of a doc's clip (:func:`read_clip`), or (None, reason)."""
    try:
        return read_clip(visual, name, frames).to_bytes(), None
    except ValueError as exc:
        return None, str(exc)


def image_key(image) -> str:
    """An RGB image's identity: a hash of its size and pixels (equal pictures from different files share it)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.size[0]}x{image.size[1]}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _task_rows(name: str, limit: int | None, include_path, shard: tuple[int, int], contiguous: bool,
               pngs: dict[str, bytes], video_frames: int) -> list[Request]:
    task = load_task(name, include_path)
    task.build_all_requests(limit=limit, rank=0, world_size=1)  # prompts only: cheap; images are encoded below
    instances = task.instances
    index, count = shard
    if contiguous:  # the index-th of count consecutive runs: the questions of one image usually stay together
        mine = instances[len(instances) * index // count: len(instances) * (index + 1) // count]
    else:
        mine = instances[index::count]
    rows = []
    for inst in mine:
        context, gen_kwargs, doc_to_visual, doc_id, task_name, split = inst.args
        name = f"{task_name} doc {doc_id}"
        clip, image, key, video = None, None, None, False
        doc, error = _document(task, split, doc_id, name)
        if not error:  # clip or image: this document's own visual says (document_visual)
            visual, video, error = document_visual(doc_to_visual, doc, name, frames_are_clips(task_name))
        if not error and video:  # the sampled frames travel in the row (each clip once: no shared key)
            clip, error = _clip_of(visual, name, video_frames)
        elif not error:
            image, key, error = _image_of(visual, name, pngs)
        rows.append(Request(task=task_name, doc_id=int(doc_id), n_docs=len(instances), prompt=context, image=image,
                            image_key=key, gen_kwargs=dict(gen_kwargs), error=error, video=clip))
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
    contiguous: bool = False,
    video_frames: int = DEFAULT_FRAMES,
) -> list[Request]:
    """Requests for the first ``limit`` documents (all when None) of each task, in task then doc order.

    ``tasks`` are lmms-eval task names: the offline ``easyvqa_yesno`` / ``easyvqa_open``, or hub tasks (``mme``,
    ``pope``, ...), which need network access (here they raise TaskUnavailableError saying so). Judge-scored tasks
    without an API key (MM-Vet) are skipped with a warning. ``include_path``: extra lmms-eval task directories.
    ``shard=(i, k)``: only every k-th document starting at the i-th (rows keep the evaluation's full ``n_docs``), so
    large benchmarks (VQAv2-val: 214k questions) can be built in parallel pieces instead of all in driver memory;
    the union of the k shards is exactly the unsharded result. ``contiguous=True``: the i-th of k consecutive runs of
    documents instead (the questions of one image, usually neighbours, then land in one shard).
    ``video_frames``: frames sampled uniformly from each clip of a video task (MVBench, ...), or picked the same way
    from the frames a task gives as its clip (``tasks.frames_are_clips``); image tasks ignore it.

    Each distinct image is encoded once: requests about the same picture share its PNG bytes (the same object) and
    its ``image_key``, which :func:`pack_requests` uses to store it once per block.
    """
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if isinstance(video_frames, bool) or not isinstance(video_frames, int) or video_frames < 1:
        raise ValueError(f"video_frames must be a positive int, got {video_frames!r}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks lists a task twice: {tasks}")
    shard = _check_shard(shard)
    problems = [p for p in (check_limit(t, limit) for t in tasks) if p]
    if problems:
        raise ValueError("; ".join(problems))
    rows: list[Request] = []
    pngs: dict[str, bytes] = {}  # image key -> PNG, shared by the tasks (POPE and others reuse COCO images)
    for name in tasks:
        reason = judge_skip_reason(name)
        if reason:
            warnings.warn(reason, stacklevel=2)
            log.warning(reason)
            continue
        rows.extend(_task_rows(name, limit, include_path, shard, contiguous, pngs, video_frames))
    return rows


def pack_requests(rows: list[Request], batch_size: int) -> list[list[Request]]:
    """Requests -> blocks of about ``batch_size`` rows in which every image is stored once.

    The questions about one image (same ``image_key``, in any task) go into one block, together; only the first of
    them keeps the PNG bytes, the others refer to it by key (:func:`share_images` restores them where the block is
    answered). A group never spans two blocks, so a block is always complete by itself; a group larger than
    ``batch_size`` (GQA asks ~30 questions per image) is one block of its own size. Rows without a key keep their
    bytes.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    groups: dict[tuple, list[Request]] = {}
    for i, row in enumerate(rows):
        key = row.image_key or i
        groups.setdefault(key, []).append(row)
    blocks: list[list[Request]] = [[]]
    for group in groups.values():
        if blocks[-1] and len(blocks[-1]) + len(group) > batch_size:
            blocks.append([])
        first, *rest = group
        blocks[-1].append(first)
        blocks[-1].extend(dataclasses.replace(r, image=None) if r.image_key else r for r in rest)
    return [b for b in blocks if b]


def share_images(rows: list[Request]) -> list[Request]:
    """The rows of one block with every image restored from the row of the same ``image_key`` that carries it
    (:func:`pack_requests` stores each once). A row whose image is in no row of the block fails, named."""
    carried = {r.image_key: r.image for r in rows if r.image_key and r.image is not None}
    out = []
    for r in rows:
        if r.image is not None or not r.image_key or r.error:
            out.append(r)
        elif r.image_key in carried:
            out.append(dataclasses.replace(r, image=carried[r.image_key]))
        else:
            out.append(dataclasses.replace(r, error=f"{r.task} doc {r.doc_id}: its image {r.image_key} is in no "
                                           "request of its block (blocks must come from pack_requests)"))
    return out


def _item(request: Request, last: dict) -> Item:
    """A request -> Item; an unreadable image or clip or a request that arrived failed becomes a failed item.
    ``last``: the previous request's decoded image by key (the questions about one image are neighbours in a packed
    block, so each image is decoded once while memory holds one decoded image at a time)."""
    if request.error:
        return Item(request.prompt, None, request.gen_kwargs, error=request.error, id=request.key)
    if request.video is not None:
        from promprune.models.video import Clip

        try:
            clip = Clip.from_bytes(request.video)
        except Exception as exc:  # noqa: BLE001 - bytes numpy cannot read, a rate Clip refuses: one failed sample
            return Item(request.prompt, None, request.gen_kwargs, id=request.key,
                        error=f"{request.task} doc {request.doc_id}: unreadable clip ({type(exc).__name__}: {exc})")
        return Item(request.prompt, None, request.gen_kwargs, video=clip, id=request.key)
    key = request.image_key
    try:
        image = last[key] if key and key in last else decode_image(request.image,
                                                                   f"{request.task} doc {request.doc_id}")
    except ValueError as exc:
        return Item(request.prompt, None, request.gen_kwargs, error=str(exc), id=request.key)
    if key and key not in last:
        last.clear()
        last[key] = image
    return Item(request.prompt, image, request.gen_kwargs, key=key, id=request.key)


def run_requests(vlm, requests: list[Request], *, batch_size: int = 8, vision_once: bool = True,
                 prefix_cache: bool | None = None, seed=None) -> list[Prediction]:
    """Answer every request with ``vlm`` (a ``PrunedVLM``): one prediction per request, in order.

    A corrupt image or a failing generation gives ``prediction=""`` and ``error`` set; the other requests of its
    batch are unaffected. Requests packed by :func:`pack_requests` (an image stored once per block) are answered
    as they are.

    The questions about one image (one ``image_key``) share its work where the method allows
    (``PrunedVLM.shares_vision`` / ``shares_prefix``): ``vision_once`` encodes and selects it once, ``prefix_cache``
    also prefills its prompt prefix once (:func:`promprune.eval.generation.generate_items`). Both are on, as in
    accuracy sweeps (``prefix_cache`` None: as ``vision_once``, which it needs); a request's ``gen_kwargs`` may set
    either (a sweep spec's ``generation``: efficiency trials measure each sample's own latency with both off).

    ``seed`` (None: none) and the requests' ``seed`` generation kwarg seed each sampled request from its key
    (:func:`promprune.eval.generation.sample_seeds`): a request's sampled answer depends on the seeds and the
    request, not on ``batch_size``, the other requests or their order, nor on what the process ran before. The
    sweep's workers pass the trial's id.
    """
    bad = [i for i, r in enumerate(requests) if not isinstance(r, Request)]
    if bad:
        raise TypeError(f"run_requests takes promprune.records.Request objects; item {bad[0]} is "
                        f"{type(requests[bad[0]]).__name__}")
    last: dict = {}
    prefix_cache = vision_once if prefix_cache is None else prefix_cache
    answers = generate_items(vlm, [_item(r, last) for r in share_images(requests)], batch_size=batch_size,
                             vision_once=vision_once, prefix_cache=prefix_cache, seed=seed)
    return [Prediction.answering(r, a) for r, a in zip(requests, answers)]
