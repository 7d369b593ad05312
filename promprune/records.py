"""The per-sample records of an evaluation, each declared once, with the Arrow schema derived from the declaration.

    SampleStats   what the model reports about one sample: visual tokens, split, entropy, kept tokens, timings
    Generation    SampleStats + the generated text and token ids (``PrunedVLM.generate``; promprune.models)
    Answer        SampleStats + the answer as scored (stop strings applied) or the error, and the batch's peak memory
    Request       one question of one benchmark document, image as PNG bytes and its key, or a video task's
                  clip as frame bytes (driver -> actors)
    Prediction    Answer + the request it answers (minus the image) + per-sample efficiency (actors -> driver ->
                  MLflow's ``predictions.parquet``)

Every field is a plain value (str, int, float, bytes, list of int, or a dict stored as JSON), so records cross Ray
Data as typed Arrow columns and land in parquet with ``arrow_schema(Prediction)``. Nothing is pickled.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class SampleStats:
    """What the model reports about one sample. Timings are milliseconds of the whole batch the sample ran in."""

    visual_tokens: int | None = None  # visual tokens the LLM received (in-LLM methods: after their last layer)
    # in-LLM methods: the visual tokens each decoder layer ran on (and cached), first layer first; None where every
    # layer ran on ``visual_tokens``
    layer_visual_tokens: list[int] | None = None
    saliency_count: int | None = None  # of those, chosen by a saliency stage (0 unpruned / pure-diversity methods)
    entropy: float | None = None  # prominence metric of the split (NeXT per-view modes: mean over views)
    # how far ``entropy`` may lie from the exact metric: PromPrune's certified split on a GPU reports its bracket's
    # midpoint, within this (per-view modes: the views' mean); 0 where the exact eigensolve ran; None: exact (the CPU,
    # PROMPRUNE_ENTROPY=exact, other metrics) or no entropy
    entropy_halfwidth: float | None = None
    # kept indices into the full visual token grid, in the LLM's input order (LLaVA-NeXT in raster order: the packed
    # sequence's layout, the base view first, then the crops row by row)
    kept: list[int] | None = None
    salient: list[int] | None = None  # the subset of ``kept`` the saliency stage chose (overlays)
    vision_ms: float | None = None  # vision tower + projector (+ saliency hook)
    select_ms: float | None = None  # token selection before the LLM
    prefill_ms: float | None = None  # first LLM forward
    decode_ms: float | None = None  # the rest of generate
    # prompt tokens the LLM read other than the visual placeholders (the chat template, the question, and what the
    # processor inserts around images and frames, such as Qwen3-VL's per-frame timestamps)
    text_tokens: int | None = None


@dataclass(kw_only=True)
class Answer(SampleStats):
    """One generated answer as it is scored, or the error that replaced it."""

    prediction: str = ""  # the text after lmms-eval's stop strings; "" when the sample failed
    error: str | None = None  # why the sample failed (unreadable image, failed generation); None when it did not
    # peak memory of the sample's batch: the CUDA allocator's, or on CPU the process's peak resident set during the
    # batch (Linux; None elsewhere): promprune.efficiency.peak_memory_mb
    peak_mem_mb: float | None = None

    @property
    def failed(self) -> bool:
        return bool(self.error)


@dataclass(kw_only=True)
class Request:
    """One question about one document of an lmms-eval task."""

    task: str  # lmms-eval task name
    doc_id: int  # the document's index in the task's evaluation split (how scoring finds it again)
    n_docs: int  # documents of this task the evaluation covers (doc_ids 0..n_docs-1: scoring notices a gap)
    prompt: str  # the question as the model gets it (the task's doc_to_text with lmms-eval's prompt kwargs)
    image: bytes | None = None  # PNG of the document's image; None when it could not be produced (see error) or
    # when another request of the same block carries it (same image_key: see promprune.eval.requests.pack_requests)
    image_key: str | None = None  # the image's identity (a hash of its pixels): requests about one image share it
    gen_kwargs: dict = field(default_factory=dict)  # the task's generation_kwargs (``until`` included)
    error: str | None = None  # why the request cannot be answered; then the sample fails without generating
    video: bytes | None = None  # a video task's clip instead of an image: its sampled frames and their rate
    # (promprune.models.video.Clip.to_bytes); None for image tasks

    @property
    def key(self) -> str:
        return sample_key(self.task, self.doc_id)


@dataclass(kw_only=True)
class Prediction(Answer):
    """One answered request: what ``predictions.parquet`` holds per sample."""

    task: str
    doc_id: int
    n_docs: int
    prompt: str
    gen_kwargs: dict = field(default_factory=dict)
    prefill_flops: float | None = None  # whole prefill (visual + text tokens), Table 6's convention
    kv_cache_bytes: float | None = None  # K and V of the visual tokens, Table 6's convention
    node: str | None = None  # where it was answered (the pipeline's actors: their Ray node id); None elsewhere
    # the request's ``image_key``: the report groups the questions about one image by it (their entropies may differ
    # in the last digits on a GPU, where batch composition moves features and the certified split reports midpoints)
    image_key: str | None = None

    @property
    def key(self) -> str:
        return sample_key(self.task, self.doc_id)

    @classmethod
    def answering(cls, request: Request, answer: Answer, **extra) -> "Prediction":
        """The prediction for ``request``: its fields (not the image) plus every field of ``answer``."""
        own = {f.name: getattr(request, f.name) for f in dataclasses.fields(Request)
               if f.name not in ("image", "error", "video")}
        return cls(**own, **values(answer), **extra)


def sample_key(task: str, doc_id: int) -> str:
    """A sample's key, ``<task>/<doc_id>``: the one spelling of it everywhere (blocks, checkpoints, scoring)."""
    return f"{task}/{doc_id}"


def key_task(key: str) -> str:
    """The task of a sample key (`sample_key`'s inverse, first half; a task name may hold ``/``, a doc id never)."""
    return key.rsplit("/", 1)[0]


def table_keys(table) -> list[str]:
    """The sample keys of an Arrow table of records (its ``task`` and ``doc_id`` columns), in row order."""
    return [sample_key(t, d) for t, d in zip(table.column("task").to_pylist(), table.column("doc_id").to_pylist())]


def values(record, cls=None) -> dict:
    """The fields of ``cls`` (default: the record's own class) as a dict, shallow (no deep copies)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(cls or type(record))}


# ---------------------------------------------------------------------------------------------------------------
# Arrow: the schema comes from the dataclass declaration

LEADING = ("task", "doc_id")  # columns first in every table, for people reading the parquet


def _arrow_type(hint: Any):
    import pyarrow as pa

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = args  # Optional[X] -> X; every column is nullable anyway
        args = [a for a in typing.get_args(hint)]
    if typing.get_origin(hint) is list:
        return pa.list_(_arrow_type(args[0]))
    simple = {str: pa.string(), int: pa.int64(), float: pa.float64(), bytes: pa.binary(), bool: pa.bool_(),
              dict: pa.string()}  # dicts travel as JSON text: their keys differ between tasks
    if hint not in simple:
        raise TypeError(f"no Arrow type for field type {hint!r}")
    return simple[hint]


def _ordered_fields(cls) -> list:
    fields = dataclasses.fields(cls)
    lead = [f for name in LEADING for f in fields if f.name == name]
    return lead + [f for f in fields if f.name not in LEADING]


def arrow_schema(cls):
    """The Arrow schema of a record class: one nullable column per field, in declaration order (task, doc_id first)."""
    import pyarrow as pa

    hints = typing.get_type_hints(cls)
    return pa.schema([pa.field(f.name, _arrow_type(hints[f.name])) for f in _ordered_fields(cls)])


def _json_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] is dict]


def to_arrow(records: list, cls):
    """Records -> a ``pyarrow.Table`` with ``arrow_schema(cls)`` (dict fields as JSON text)."""
    import pyarrow as pa

    as_json = _json_fields(cls)
    rows = []
    for r in records:
        row = values(r, cls)
        for name in as_json:
            row[name] = json.dumps(row[name], sort_keys=True, default=str)
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=arrow_schema(cls))


def from_arrow(table, cls) -> list:
    """A table with ``cls``'s columns (extra columns ignored) -> records."""
    names = [f.name for f in dataclasses.fields(cls)]
    as_json = _json_fields(cls)
    out = []
    for row in table.select(names).to_pylist():
        for name in as_json:
            row[name] = json.loads(row[name]) if row[name] else {}
        out.append(cls(**row))
    return out
