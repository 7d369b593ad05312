"""Vision once: an image asked several questions is preprocessed, encoded and selected once.

A benchmark asks several questions about each image (VQAv2 ~5, POPE 18, GQA ~30). When what enters the LLM does not
depend on the question (``PrunedVLM.shares_vision``: unpruned, an in-LLM method, which prunes inside the LLM, or a
pre-LLM method that is not question dependent), the rows of a batch that share an image key need one run of the image
processor, the vision tower and the selection; an :class:`ImageCache` keeps the result (:class:`SharedImage`) for the
image's questions in later batches.

Each row's prompt is then built without the image processor: the processor's output for the image's first question
holds the image's expanded placeholder *segment* (the tokens that replace the one placeholder of the chat template:
LLaVA's run of ``<image>`` tokens, InternVL's ``<img> <IMG_CONTEXT>... </img>``, ...), and every other question's
prompt is its own tokenized conversation with that segment spliced in at the placeholder. Special tokens split the
text around them, so the text on either side tokenizes the same with one placeholder as with the expanded run, and
the rows equal the processor's own (``tests/models/test_sharing.py`` checks every adapter). A template the splice
does not fit (the placeholder missing or repeated, a prefix that does not match) falls back to the processor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# per-token processor outputs other than input_ids / attention_mask (padded with 0, as the processors pad them)
_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")


@dataclass
class SharedImage:
    """One image's vision-once results: ``fed`` (a :class:`promprune.models.vlm.Fed`: the LLM's features of the
    image and the sample stats), ``item`` (the adapter's :class:`VisualItem`), ``segment`` (per-token processor key ->
    ``[P]`` the expanded placeholder segment's values; ``input_ids`` always), ``per_image`` (processor outputs with
    one row per image, such as Qwen's ``image_grid_thw``: key -> ``[1, ...]``), both on the host, as the processor
    made them; ``segment`` None: the splice does not fit this model's template (rows go through the processor)."""

    fed: object
    item: object
    segment: dict[str, torch.Tensor] | None
    per_image: dict[str, torch.Tensor]


@dataclass
class ImageCache:
    """Per-image results reused across batches: ``images`` (key -> :class:`SharedImage`) and ``prefixes`` (key ->
    the prompt prefixes prefilled for that image, :class:`promprune.models.prefix.Prefix`). ``release(key)`` frees
    an image once its last question is answered (``promprune.eval.generation.generate_items`` does).

    What a key holds was made by one wrapper (``owners``: key -> its ``PrunedVLM.cache_owner``): the selection, the
    features and the prefixes depend on the model, the method, the budget and every option, not on the image alone.
    A wrapper that asks for a key another wrapper filled (``claim``) drops that one's results and makes its own, so
    its answers with any cache are those with a fresh one; a cache passed around between wrappers is correct, and
    saves work only while one wrapper answers an image's questions."""

    images: dict = field(default_factory=dict)
    prefixes: dict = field(default_factory=dict)
    owners: dict = field(default_factory=dict)

    def claim(self, keys, owner) -> None:
        """Make what ``keys`` hold ``owner``'s: the results another wrapper left under them are dropped."""
        for key in keys:
            if self.owners.get(key, owner) != owner or (key not in self.owners and self._holds(key)):
                self.release(key)  # a key no wrapper filled is not released: release is the free of a last question
            self.owners[key] = owner

    def _holds(self, key) -> bool:
        return key in self.images or key in self.prefixes

    def release(self, key) -> None:
        self.images.pop(key, None)
        self.prefixes.pop(key, None)
        self.owners.pop(key, None)

    def __len__(self) -> int:
        return len(self.images)


class Unkeyed:
    """The key of a row whose key is None (an image without an identity, as ``Request.image_key`` may be): equal to
    no other key, so the row's image is its own, and kept in no cache past the call (``forget_unkeyed``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no key>"


def forget_unkeyed(cache: ImageCache, keys) -> None:
    """Drop what ``cache`` holds under the rows' :class:`Unkeyed` keys (no later call can ask for it)."""
    for key in keys:
        if isinstance(key, Unkeyed):
            cache.release(key)


def prepare(vlm, images, prompts: list[str], keys: list, cache: ImageCache) -> dict:
    """:meth:`PrunedVLM.prepare` with each distinct key's image encoded and selected once (those in ``cache`` not
    at all; a None key is no key: that row's image is its own, :class:`Unkeyed`). Returns the fields of a
    ``Prepared`` whose model kwargs equal the unshared path's (``PrunedVLM`` builds it, so this module never imports
    ``vlm``)."""
    from .options import is_in_llm

    if len(keys) != len(prompts) or len(images) != len(prompts):
        raise ValueError(f"keys, images and prompts must have one entry per row: {len(keys)} keys, {len(images)} "
                         f"images, {len(prompts)} prompts")
    keys = [Unkeyed() if key is None else key for key in keys]
    cache.claim(keys, vlm.cache_owner)  # another wrapper's results for these images are not this one's
    first = {}
    for row, key in enumerate(keys):
        first.setdefault(key, row)
    missing = [key for key in first if key not in cache.images]
    vision = selecting = 0.0
    if missing:
        rows = [first[k] for k in missing]
        host = vlm.processed([images[r] for r in rows], [prompts[r] for r in rows])
        items, candidates, plan, vision, selecting = vlm._encode_select(vlm.on_device(host),
                                                                           [prompts[r] for r in rows],
                                                                           [images[r] for r in rows])
        for j, (key, fed) in enumerate(zip(missing, vlm._fed(items, candidates, plan))):
            cache.images[key] = SharedImage(fed=fed, item=items[j],
                                            segment=_segment(vlm, host, j, prompts[rows[j]]),
                                            per_image=_per_image(host, j, len(missing)))
    shared = [cache.images[k] for k in keys]
    for key in keys:  # an unkeyed row's image: no later call can ask for it
        if isinstance(key, Unkeyed):
            cache.images.pop(key, None)
    host = _rows(vlm, prompts, shared)  # built on the host, as the processor builds them
    if host is None:  # the template does not fit the splice: the processor builds the rows (images again)
        host = vlm.processed(images, prompts)
    fed = [s.fed for s in shared]
    kwargs = vlm._llm_inputs(vlm.on_device(host), fed, pruned=vlm.method is not None and not is_in_llm(vlm.method),
                             host=host)
    return dict(model_kwargs=kwargs, stats=[dict(f.stats) for f in fed], items=[s.item for s in shared],
                vision_time=vision, select_time=selecting, fed=fed, keys=list(keys))


def placeholder_id(vlm) -> int:
    """The chat template's image placeholder token (what the processor expands into the image's segment)."""
    config = vlm.model.config
    for name in ("image_token_id", "image_token_index"):
        if getattr(config, name, None) is not None:
            return int(getattr(config, name))
    raise ValueError(f"{type(vlm.model).__name__} names no image placeholder token")


def _tokenized(vlm, prompt: str) -> list[int]:
    """The conversation of ``prompt`` tokenized as the processor tokenizes it, its placeholder unexpanded."""
    return vlm.processor.tokenizer(vlm.conversation(prompt))["input_ids"]


def _segment(vlm, batch, j: int, prompt: str) -> dict[str, torch.Tensor] | None:
    """Row ``j`` of a processed batch -> its expanded placeholder segment (per-token key -> ``[P]``), or None where
    the row is not ``head + segment + tail`` of its unexpanded tokens ``head + [placeholder] + tail`` with every
    other per-token value 0."""
    ids = _tokenized(vlm, prompt)
    placeholder = placeholder_id(vlm)
    if ids.count(placeholder) != 1:
        return None
    at = ids.index(placeholder)
    head, tail = ids[:at], ids[at + 1:]
    real = batch["attention_mask"][j].bool()
    row = batch["input_ids"][j][real]
    end = row.shape[0] - len(tail)
    if end < len(head) or row[:len(head)].tolist() != head or row[end:].tolist() != tail:
        return None
    segment = {"input_ids": row[len(head):end]}
    for key in _TOKEN_KEYS:
        if key in batch:
            values = batch[key][j][real]
            if bool(values[:len(head)].any()) or bool(values[end:].any()):
                return None
            segment[key] = values[len(head):end]
    return segment


def _per_image(batch, j: int, n: int) -> dict[str, torch.Tensor]:
    """Processor outputs with one row per image (``image_sizes``, ``image_grid_thw``, ...; pixels excluded): row j."""
    skip = ("input_ids", "attention_mask", *_TOKEN_KEYS)
    return {k: v[j:j + 1] for k, v in batch.items()
            if k not in skip and not k.startswith("pixel_values") and isinstance(v, torch.Tensor) and v.dim() >= 1
            and v.shape[0] == n}


def _rows(vlm, prompts: list[str], shared: list[SharedImage]) -> dict | None:
    """The processed rows without the image processor: each prompt's tokens with its image's segment spliced in
    at the placeholder, left-padded as the processor pads (None where a segment or a prompt does not fit)."""
    if any(s.segment is None for s in shared):
        return None
    placeholder = placeholder_id(vlm)
    keys = [k for k in _TOKEN_KEYS if k in shared[0].segment]
    rows = []
    for prompt, s in zip(prompts, shared):
        ids = _tokenized(vlm, prompt)
        if ids.count(placeholder) != 1:
            return None
        at = ids.index(placeholder)
        seg = s.segment["input_ids"]
        head = torch.tensor(ids[:at], dtype=seg.dtype, device=seg.device)
        tail = torch.tensor(ids[at + 1:], dtype=seg.dtype, device=seg.device)
        row = {"input_ids": torch.cat([head, seg, tail])}
        for key in keys:
            row[key] = torch.cat([torch.zeros_like(head), s.segment[key], torch.zeros_like(tail)])
        rows.append(row)
    width = max(r["input_ids"].shape[0] for r in rows)
    device = shared[0].segment["input_ids"].device
    pad = vlm.processor.tokenizer.pad_token_id
    out = {"input_ids": torch.full((len(rows), width), pad, dtype=torch.long, device=device),
           "attention_mask": torch.zeros((len(rows), width), dtype=torch.long, device=device)}
    out.update({k: torch.zeros((len(rows), width), dtype=torch.long, device=device) for k in keys})
    for b, row in enumerate(rows):
        n = row["input_ids"].shape[0]
        out["attention_mask"][b, width - n:] = 1
        for key, values in row.items():
            out[key][b, width - n:] = values
    for key in shared[0].per_image:
        out[key] = torch.cat([s.per_image[key] for s in shared])
    return out
