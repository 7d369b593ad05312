"""Generation for evaluation items: batching, lmms-eval generation kwargs, and failure isolation.

Both the Ray path (``run_requests`` on ``Request``s) and the lmms-eval plugin (``PromPruneLMM.generate_until``) turn
their inputs into ``Item``s and call ``generate_items`` (the plugin with ``load``: each item's picture read only as its
batch is formed, as lmms-eval hands over a whole run's requests at once). Every item yields exactly one ``Answer``, in
input order: a batch that raises is retried item by item, so one corrupt image or one failing generation becomes one
failed answer with its error message, never a crash and never a dropped sample; so does a row whose logits went
non-finite (NaN: ``Generation.error``), which would otherwise pass as an empty answer.

Two options share the work of an image's questions (items with one ``key``) where the method allows:
``vision_once`` preprocesses, encodes and selects each image once (``PrunedVLM.shares_vision``: all but CDPruner, which
selects per question), ``prefix_cache`` also prefills the prompt up to the end of its visual tokens once
(``PrunedVLM.shares_prefix``: not the question-dependent methods, the in-LLM ones and CDPruner); see
``promprune.models.sharing`` and ``promprune.models.prefix``. They are arguments, and an item's generation kwargs may
set them (a sweep spec's ``generation.vision_once`` / ``generation.prefix_cache``); they never reach ``generate``.

Sampled generation (``do_sample: true``): with a ``seed`` (``generate_items``; the sweep's workers pass the trial's
id) or a ``seed`` generation kwarg (a spec's ``generation.seed``), each item samples from its own random stream,
seeded from them and the item's identity (:func:`sample_seeds`; ``PrunedVLM.generate``'s ``sample_seeds``,
:mod:`promprune.models.sampling`): an item's answer depends on the seeds and the item, not on the batch size, the
items beside it in its batch, their order, or what the process ran before, and the process's RNG is never touched.
The lmms-eval plugin passes lmms-eval's torch seed (``PromPruneLMM``) and each request's identity. Without either
seed (``generate_items`` called without one, items without a ``seed`` kwarg), and for sampled beam search,
transformers samples each batch from the process's RNG, so answers then depend on the batches. Greedy batches never
draw.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from promprune.efficiency import peak_memory_mb, reset_peak_memory
from promprune.models.images import as_rgb, opened, pixel_key, strict_decoding
from promprune.models.sharing import ImageCache
from promprune.records import Answer, SampleStats, values

log = logging.getLogger(__name__)

# lmms-eval generation_kwargs keys that map onto transformers' generate(); anything else (e.g. llava's
# image_aspect_ratio) is a model-specific hint our adapters do not take, and is ignored.
_SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int}  # passed when do_sample is true
# a task that sets no max_new_tokens (TextVQA, VizWiz) gets what lmms-eval's own HF LLaVA model gives it, not
# transformers' default of 20 (which would cut long answers)
DEFAULT_MAX_NEW_TOKENS = 1024
# generation kwargs that choose how an image's questions share work (see the module docstring), not generate()'s
SHARING_KEYS = ("vision_once", "prefix_cache")
# the generation kwarg (a spec's generation.seed) that seeds sampled items with generate_items' own seed (see the
# module docstring); never passed to generate()
SEED_KEY = "seed"
# the stop string lmms-eval gives every task whose YAML sets no `until` (its few-shot delimiter, api/task.py): a blank
# line. lmms-eval's own models never stop there: qwen2_5_vl, qwen3_vl and gemma4 drop it from `until` ("to prevent
# truncation"), llava and llava_hf never apply `until`. Cutting there lost MM-Vet's step-by-step conclusions.
BLANK_LINE = "\n\n"


@dataclass
class Item:
    """One question about one image, or (``video`` set, ``image`` None) about one clip
    (:class:`promprune.models.video.Clip`). ``error`` set means the input could not be prepared; it is not generated."""

    prompt: str
    image: Image.Image | None
    gen_kwargs: dict = field(default_factory=dict)
    error: str | None = None
    video: Any = None
    key: str | None = None  # the image's identity (``Request.image_key``): items with one key share their image
    id: str | None = None  # the sample's identity (``Request.key``): what a sampled item's seed is drawn from


def decode_image(data: Any, name: str) -> Image.Image:
    """PNG/JPEG bytes (or a PIL image) -> RGB PIL image, fully decoded; ValueError naming ``name`` if unreadable.
    The same conversion as the library's ``load_image`` (``as_rgb``: transparency onto white as the processors do,
    16-bit scaled, not clipped; bytes turned upright by their EXIF orientation, as ``datasets`` decodes them)."""
    if not isinstance(data, (Image.Image, bytes, bytearray, memoryview)):
        raise ValueError(f"{name}: image must be PNG/JPEG bytes or a PIL image, got {type(data).__name__}")
    try:
        with strict_decoding():  # a lazily opened image decodes here: a cut-off file fails
            if isinstance(data, Image.Image):
                data.load()
                return as_rgb(data)
            return as_rgb(opened(data))  # decoded now: a truncated file fails here, not inside the model
    except Exception as exc:  # noqa: BLE001 - PIL raises several types for bad data
        raise ValueError(f"{name}: unreadable image ({type(exc).__name__}: {exc})") from exc


def image_to_png(image: Image.Image) -> bytes:
    """Lossless PNG bytes of an image (what request rows carry across Ray), converted as ``decode_image`` does."""
    buffer = io.BytesIO()
    as_rgb(image).save(buffer, format="PNG")
    return buffer.getvalue()


def generate_kwargs(gen_kwargs: dict) -> tuple[dict, list[str]]:
    """lmms-eval generation_kwargs -> (kwargs for ``vlm.generate``, stop strings).

    Greedy unless ``do_sample`` is true (then temperature / top_p / top_k pass through; a temperature alone does not
    sample, whereas lmms-eval's llava / llava_hf / qwen models sample whenever temperature > 0; do_sample with a
    temperature of 0 is :func:`sampling_problem`'s); ``repetition_penalty`` passes either way; ``max_new_tokens``
    defaults to lmms-eval's (:data:`DEFAULT_MAX_NEW_TOKENS`) when the task sets none. The stop strings are
    lmms-eval's ``until`` without the blank line ``"\\n\\n"`` (:data:`BLANK_LINE`, the default lmms-eval gives a
    task that sets none), dropped as lmms-eval's qwen2_5_vl / qwen3_vl / gemma4 models drop it, so an answer is never
    cut at its first blank line; the others cut the decoded text at their first occurrence (:func:`cut_at_stop`),
    as those models do. Keys whose value is None are ignored (rows read back from Arrow carry None for keys another
    task had).
    """
    gen_kwargs = {k: v for k, v in gen_kwargs.items() if v is not None}
    kwargs: dict[str, Any] = {"max_new_tokens": int(gen_kwargs.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))}
    if "num_beams" in gen_kwargs:
        kwargs["num_beams"] = int(gen_kwargs["num_beams"])
    if "repetition_penalty" in gen_kwargs:  # greedy or sampled alike
        kwargs["repetition_penalty"] = float(gen_kwargs["repetition_penalty"])
    kwargs["do_sample"] = read_flag("do_sample", gen_kwargs.get("do_sample", False))
    if kwargs["do_sample"]:
        kwargs.update({k: kind(gen_kwargs[k]) for k, kind in _SAMPLING_KEYS.items() if k in gen_kwargs})
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    return kwargs, [stop for stop in until if stop != BLANK_LINE]


_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")


def read_flag(name: str, value) -> bool:
    """A generation flag (``do_sample``) as a bool: a bool, 0 / 1, or a word ("true" / "false", "yes" / "no", "1" /
    "0", any case: a spec or command line may quote it); anything else a ValueError naming ``name`` (``bool()`` read
    the string "false" as true, so a quoted ``"false"`` sampled)."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}")


def unreadable_generation(gen_kwargs: dict) -> dict[str, str]:
    """The fields of ``gen_kwargs`` that :func:`generate_kwargs` cannot read, each with the error reading it gives
    (``{}``: it reads them all), so every sample asking them would fail. Each field is read by :func:`generate_kwargs`
    itself, alone beside ``do_sample`` (the sampling keys are read only when it is true), so this is its rule, not
    a copy of it: the pipeline's preflight and the lmms-eval plugin refuse what it names before any work."""
    gen_kwargs = {k: v for k, v in gen_kwargs.items() if v is not None}
    found = {}
    with_sampling = {}
    if "do_sample" in gen_kwargs:
        try:
            generate_kwargs({"do_sample": gen_kwargs["do_sample"]})
            with_sampling = {"do_sample": gen_kwargs["do_sample"]}
        except (TypeError, ValueError, OverflowError) as exc:
            found["do_sample"] = f"{type(exc).__name__}: {exc}"
    for key, value in gen_kwargs.items():
        if key == "do_sample":
            continue
        try:
            generate_kwargs({**with_sampling, key: value})
        except (TypeError, ValueError, OverflowError) as exc:
            found[key] = f"{type(exc).__name__}: {exc}"
    if not found:  # each field read alone; should they fail only together, all of them
        try:
            generate_kwargs(gen_kwargs)
        except (TypeError, ValueError, OverflowError) as exc:
            found[", ".join(gen_kwargs)] = f"{type(exc).__name__}: {exc}"
    return found


def sampling_problem(gen_kwargs: dict) -> str | None:
    """Why ``generate`` cannot sample with these generation kwargs (a task's own with a spec's ``generation`` over
    them), or None: ``do_sample`` true with a temperature of 0 or below, lmms-eval's greedy setting (its own models
    decode greedily at temperature 0 whatever do_sample says; transformers refuses the pair, so every sample failed),
    or with ``num_beams`` over 1 (seeded sampling draws one sequence per sample from its own seed:
    :mod:`promprune.models.sampling` refuses beams, so every sample would fail)."""
    try:  # as generate_kwargs reads it (what it cannot read fails there)
        if not read_flag("do_sample", gen_kwargs.get("do_sample") or False):
            return None
    except ValueError:
        return None
    try:  # as generate_kwargs reads it (what it cannot read fails there)
        beams = int(gen_kwargs.get("num_beams") or 1)
    except (TypeError, ValueError, OverflowError):
        beams = 1
    if beams > 1:
        return (f"do_sample: true with num_beams {beams}: a sampled answer is drawn as one sequence from its own "
                "seed, so sampled beam search is refused: set num_beams 1 to sample, or leave do_sample out for "
                "beam search")
    temperature = gen_kwargs.get("temperature")
    if temperature is None:
        return None
    try:
        value = float(temperature)
    except (TypeError, ValueError, OverflowError):
        return f"temperature {temperature!r} is not a number: give a number above 0 (e.g. 0.7) to sample"
    if value <= 0:
        return (f"do_sample: true with temperature {temperature} (lmms-eval's greedy setting; transformers samples "
                "only at a temperature above 0): set generation.temperature above 0 (e.g. 0.7) to sample, or leave "
                "do_sample out for greedy answers")
    return None


def cut_at_stop(text: str, until: list[str]) -> str:
    """Text up to the first occurrence of any stop string."""
    for stop in until:
        if stop and stop in text:
            text = text.split(stop, 1)[0]
    return text


def _plain(value: Any) -> Any:
    """Plain Python values for records that travel through Arrow/parquet: tensors -> numbers or lists."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 and value.dim() == 0 else value.tolist()
    return value


def _model_device(vlm) -> torch.device:
    model = getattr(vlm, "model", None)
    device = getattr(model, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def sharing_options(gen_kwargs: dict, vision_once: bool, prefix_cache: bool) -> tuple[bool, bool]:
    """``(vision_once, prefix_cache)`` for items with these generation kwargs: their own ``vision_once`` /
    ``prefix_cache`` where set (None: unset), else the arguments. The prefix cache continues from the shared
    encodings, so it needs ``vision_once``: asking for it without is a ValueError."""
    chosen = []
    for name, default in zip(SHARING_KEYS, (vision_once, prefix_cache)):
        value = gen_kwargs.get(name)
        value = default if value is None else value
        if not isinstance(value, bool):
            raise ValueError(f"generation kwarg {name} must be true or false, got {value!r}")
        chosen.append(value)
    if chosen[1] and not chosen[0]:
        raise ValueError("prefix_cache continues each image's cached prompt prefix, which needs vision_once: set "
                         "vision_once true (or prefix_cache false)")
    return chosen[0], chosen[1]


def sample_seeds(seed: Any, items: list[Item]) -> list[int | None]:
    """Each item's sampling seed, that of its own random stream (``PrunedVLM.generate``'s ``sample_seeds``): a hash
    of ``seed`` (the caller's: a sweep's trial id), the item's ``seed`` generation kwarg (a spec's
    ``generation.seed``, 0 unset), its identity (its ``id``; an item without one: its image key and prompt, the
    image's or clip's pixels standing for a key it lacks: :func:`_content`) and its repeat, how many seeded items
    before it in ``items`` have that identity (a request asked twice, as lmms-eval asks a task's repeats, draws
    twice). None for an item with neither seed: transformers samples its batch from the process's RNG as it stands.
    Greedy items ignore theirs."""
    seen: Counter = Counter()
    seeds: list[int | None] = []
    for item in items:
        own = item.gen_kwargs.get(SEED_KEY)
        if seed is None and own is None:  # (no identity: an item without a key is hashed only when it is seeded)
            seeds.append(None)
            continue
        identity = json.dumps(item.id if item.id is not None else
                              [item.key if item.key is not None else _content(item), item.prompt], default=str)
        repeat, seen[identity] = seen[identity], seen[identity] + 1
        text = json.dumps([seed, 0 if own is None else own, identity, repeat], default=str)
        seeds.append(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1)  # torch takes < 2**63
    return seeds


def _content(item: Item) -> str | None:
    """What stands for the key of an item that has neither ``id`` nor ``key`` in its :func:`sample_seeds` identity:
    a hash of its clip's frames and rate, or of its image's pixels (``pixel_key``), so that two such items with one
    prompt about different pictures are two items, not one asked twice whose draws would follow their order. None
    where the picture cannot be read (the item fails in its batch, as it would have)."""
    try:
        if item.video is not None:
            frames = np.ascontiguousarray(np.asarray(getattr(item.video, "frames", item.video)))
            digest = hashlib.blake2b(f"{frames.dtype}:{frames.shape}:{getattr(item.video, 'fps', None)}:".encode(),
                                     digest_size=8)
            digest.update(frames.tobytes())
            return f"clip:{digest.hexdigest()}"
        return None if item.image is None else f"pixels:{pixel_key(item.image)}"
    except Exception:  # noqa: BLE001 - an unreadable picture fails where it is generated, item by item
        return None


_BEAMS_WARNED: list = []  # whether _run_batch has warned of unseeded sampled beam search (once per process)


def _run_batch(vlm, items: list[Item], gen_kwargs: dict, cache: ImageCache | None = None,
               prefix_cache: bool = False, keys: list | None = None, seeds: list | None = None) -> list[Answer]:
    """Generate one batch (raises on failure); results carry the batch's peak memory. ``cache``: the images'
    shared work (vision once; ``keys`` their keys), ``prefix_cache``: their prefixes too. ``seeds``: the items'
    :func:`sample_seeds`; a sampled batch whose items have them samples each from its own (``sample_seeds`` of
    ``vlm.generate``), except with beams (``num_beams`` over 1, which :func:`sampling_problem` refuses in a spec and
    an lmms-eval task may ask): transformers samples those from the process's RNG, with a warning."""
    kwargs, until = generate_kwargs(gen_kwargs)
    if kwargs["do_sample"] and seeds is not None and all(s is not None for s in seeds):
        if int(kwargs.get("num_beams", 1)) == 1:
            kwargs["sample_seeds"] = list(seeds)
        elif not _BEAMS_WARNED:  # sampling_problem refuses it in a spec: lmms-eval's tasks may still ask it
            _BEAMS_WARNED.append(True)
            log.warning("sampled beam search (num_beams %s) cannot draw per sample: transformers samples each batch "
                        "from the process's RNG, so these answers depend on the batches", kwargs["num_beams"])
    device = _model_device(vlm)
    reset_peak_memory(device)
    prompts = [it.prompt for it in items]
    with torch.inference_mode():
        if items[0].video is not None:  # generate_items never mixes clips and images in a batch
            generations = vlm.generate_video([it.video for it in items], prompts, **kwargs)
        elif cache is not None:
            generations = vlm.generate([it.image for it in items], prompts, keys=keys, cache=cache,
                                       prefix_cache=prefix_cache, **kwargs)
        else:
            generations = vlm.generate([it.image for it in items], prompts, **kwargs)
    if len(generations) != len(items):
        raise RuntimeError(f"vlm.generate returned {len(generations)} generations for {len(items)} items")
    peak = peak_memory_mb(device)
    for gen in generations:
        if getattr(gen, "error", None):  # non-finite logits (PrunedVLM's NONFINITE): a failed sample, not ""
            log.warning("generation failed: %s", gen.error)
    return [Answer(**{k: _plain(v) for k, v in values(gen, SampleStats).items()},
                   prediction="" if getattr(gen, "error", None) else cut_at_stop(gen.text, until),
                   error=getattr(gen, "error", None), peak_mem_mb=peak) for gen in generations]


def _run_isolated(vlm, items: list[Item], gen_kwargs: dict, cache: ImageCache | None = None,
                  prefix_cache: bool = False, keys: list | None = None, seeds: list | None = None) -> list[Answer]:
    """Run a batch; if it fails, run its items one by one so only the failing ones fail."""
    try:
        return _run_batch(vlm, items, gen_kwargs, cache, prefix_cache, keys, seeds)
    except Exception as exc:  # noqa: BLE001 - isolation: the failure is recorded per item below
        if len(items) == 1:
            log.warning("generation failed: %s: %s", type(exc).__name__, exc)
            return [Answer(error=f"{type(exc).__name__}: {exc}")]
        log.warning("batch of %d failed (%s: %s); retrying item by item", len(items), type(exc).__name__, exc)
        return [result for i, item in enumerate(items)
                for result in _run_isolated(vlm, [item], gen_kwargs, cache, prefix_cache,
                                            None if keys is None else [keys[i]], None if seeds is None else [seeds[i]])]


def _by_image(indices: list[int], keys: list) -> list[int]:
    """``indices`` with the questions of one image together (in the order the images first appear, each image's
    questions in their own order): packed blocks already are; the lmms-eval plugin's task order may not be."""
    first: dict = {}
    for i in indices:
        first.setdefault(keys[i], len(first))
    return sorted(indices, key=lambda i: first[keys[i]])  # stable


def _loaded(load, i: int, stand_in: Item) -> Item:
    """Item ``i`` read by ``load`` (see :func:`generate_items`): an error there, or an item of another kind (clip or
    image) than its stand-in said, is a failed item."""
    try:
        item = load(i)
    except Exception as exc:  # noqa: BLE001 - an unreadable item is one failed answer, as in a batch
        return dataclasses.replace(stand_in, image=None, video=None, error=f"{type(exc).__name__}: {exc}")
    if item.error is None and (item.video is None) != (stand_in.video is None):
        said, read = ("a clip", "an image") if stand_in.video is not None else ("an image", "a clip")
        return dataclasses.replace(stand_in, image=None, video=None,
                                   error=f"item {i} was {said} when planned and is {read} when read")
    return item


def generate_items(vlm, items: list[Item], *, batch_size: int = 8, vision_once: bool = False,
                   prefix_cache: bool = False, seed: Any = None, load=None) -> list[Answer]:
    """One :class:`~promprune.records.Answer` per item, in input order.

    Items are batched with others of identical generation kwargs (lmms-eval tasks may differ) and of the same kind
    (image or clip), ``batch_size`` at a time. Items that arrive with an error are not generated; their result
    carries that error. ``vision_once`` / ``prefix_cache`` (an item's generation kwargs may override them:
    :func:`sharing_options`): image items are batched by their ``key`` (an item without one is an image of its own)
    and each image's shared work is kept until its last question is answered.

    ``seed`` (any JSON-able value; None: none): with the items' own ``seed`` generation kwarg and each item's
    identity, what each sampled item's own random stream is seeded from (:func:`sample_seeds`): an item's sampled
    answer depends on the seeds and the item (on the same hardware and software), not on ``batch_size``, the order
    of ``items``, the items batched with it, or whatever ran before in the process.

    ``load`` (None: ``items`` are the items): each item's picture is read only as its batch is formed, so memory
    holds at most ``batch_size`` read items, however many ``items`` there are (the lmms-eval plugin: lmms-eval hands
    over every request of a run at once). ``items`` are then stand-ins, each as its item will be but without its
    picture: its prompt, generation kwargs, ``key``, ``id`` (or ``key``: a stand-in has no pixels to stand for its
    identity, :func:`sample_seeds`), ``error`` where it is known to fail, and ``video`` set (to anything, e.g.
    True) for a clip; ``load(i)`` returns item ``i`` itself. The batches are those the read items would get: an
    item that fails as it is read (``load`` raises, or gives an item with ``error`` or of the other kind) is one
    failed answer and takes no place in a batch.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    results: list[Answer | None] = [None] * len(items)
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        if item.error is not None:
            results[i] = Answer(error=item.error)
        else:
            kind = json.dumps([item.video is not None, item.gen_kwargs], sort_keys=True, default=str)
            groups.setdefault(kind, []).append(i)
    if load is not None:
        nameless = next((i for indices in groups.values() for i in indices
                         if items[i].id is None and items[i].key is None), None)
        if nameless is not None:
            raise ValueError(f"item {nameless} is a stand-in (load given) with neither id nor key: its sampling seed "
                             "would have no identity to be drawn from")
    keys = [item.key if item.key is not None else ("item", i) for i, item in enumerate(items)]
    plans = []
    for indices in groups.values():
        share, prefix = sharing_options(items[indices[0]].gen_kwargs, vision_once, prefix_cache)
        share = share and items[indices[0]].video is None  # a clip is asked once: nothing to share
        plans.append((_by_image(indices, keys) if share else indices, share, prefix))
    seeds = sample_seeds(seed, items)
    cache = ImageCache()
    left = Counter(keys[i] for indices, share, _ in plans if share for i in indices)  # questions still to answer

    def answered(i: int, share: bool) -> None:
        if share:
            left[keys[i]] -= 1
            if not left[keys[i]]:
                cache.release(keys[i])

    for indices, share, prefix in plans:
        gen_kwargs = items[indices[0]].gen_kwargs
        batch: list[tuple[int, Item]] = []  # (index, item) read and waiting for its batch to fill
        for n, i in enumerate(indices):
            item = items[i] if load is None else _loaded(load, i, items[i])
            if item.error is not None:  # (only a read item: the others were not grouped)
                results[i] = Answer(error=item.error)
                answered(i, share)
            else:
                batch.append((i, item))
            if batch and (len(batch) == batch_size or n == len(indices) - 1):
                chunk = [j for j, _ in batch]
                answers = _run_isolated(vlm, [it for _, it in batch], gen_kwargs, cache if share else None, prefix,
                                        [keys[j] for j in chunk] if share else None, [seeds[j] for j in chunk])
                batch = []  # the read items go with their batch
                for j, result in zip(chunk, answers):
                    results[j] = result
                    answered(j, share)
    return results  # type: ignore[return-value]
