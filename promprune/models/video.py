"""Video through the adapters: the families whose adapter handles clips (``Family.video``: LLaVA-OneVision,
Qwen2.5-VL, Qwen3-VL, Qwen3.5) answer about a clip, its visual tokens pruned.

A clip is one :class:`~promprune.models.adapters.VisualItem` whose views are its frames, so the selection code is the
images' (``select_items`` over views). What a frame is, how the clip is dated in the prompt and how its features reach
the LLM are the adapter's (``video_kwargs``, ``encode_video``, ``video_encoder_outputs``; each family's module says):
a LLaVA-OneVision frame is one SigLIP view pooled 2x, a Qwen frame one temporal patch of 2 frames whose tokens keep
their 3D M-RoPE positions (computed on the unpruned sequence with ``video_grid_thw``, gathered at the kept columns).
A Qwen clip is dated at its own rate (one ``VideoMetadata`` per clip: Qwen2.5-VL's temporal position step, Qwen3-VL's
timestamps), so a batch's clips may differ in rate; OneVision's clips carry no time.
The placeholders of a clip may come in several runs (Qwen3-VL's processor writes a timestamp before each temporal
patch's run). A clip has one frame or more (a Qwen 1-frame clip: one temporal patch of that frame twice); a batch's
clips may differ in frame count (OneVision's, whose processor stacks them, are processed by frame count). A video
file cut off (its decoded frames stopping materially short of its stated duration, or failing after its first frame)
is refused, not answered on what decodes (:func:`decode_video`).

Budget over a clip (adapter options ``video_budget`` / ``video_split``;
:data:`promprune.models.options.ADAPTER_OPTIONS`): ``per_frame`` splits the budget evenly over the frames (largest
remainder), ``clip`` selects once over all frames, ``adaptive_frames`` shares it by each frame's spectral entropy.
PromPrune's entropy and split follow the selection unit (``video_split="unit"``), or ``"clip"``: the clip's prominence
gives one saliency ratio, applied to every frame's share (``fixed_ratio`` per frame, counts rounded half to even); or
``"per_frame"`` under ``video_budget="clip"``: each frame's entropy splits its even share, and one two-stage selection
over the clip keeps the sum of those saliency counts.
"""
from __future__ import annotations

import hashlib
import io
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

import promprune
from promprune.efficiency import Stopwatch
from promprune.selection.budget import saliency_ratio
from promprune.selection.budget import split_budget as split_count
from promprune.selection.registry import TokenSet
from promprune.selection.two_stage import prominence

from .adapters import VisualItem, attach_keys, host_index
from .batched_select import select_items
from .batched_select import split_budget as split_shares
from .images import batch_lists, eight_bit, load_image
from .registry import families, family, find_family
from .sequence import shrink_placeholders
# video_budget -> the batched_select.py budget mode over views (a clip's frames are its views)
FRAME_MODES = {"per_frame": "per_crop", "clip": "global", "adaptive_frames": "adaptive_views"}
DEFAULT_FRAMES = 8  # frames sampled uniformly from a video file (lmms-eval's video models default to 8-32)
DEFAULT_FPS = 1.0  # the sampled frames' rate when the caller gives none (Qwen's timestamps / temporal positions)
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".m4v", ".mpg", ".mpeg", ".gif")


@dataclass
class Clip:
    """Decoded frames ``[F, H, W, 3]`` (uint8; other pixel types are converted as :func:`load_clip` says) and their
    rate in frames per second (None: unknown); a rate that is not a finite number above 0 is refused
    (:func:`check_fps`)."""

    frames: np.ndarray
    fps: float | None = None

    def __post_init__(self):
        self.fps = check_fps(self.fps, "Clip.fps")

    def to_bytes(self) -> bytes:
        """Lossless bytes (an ``.npz`` of the frames and the rate): what a request row carries across Ray."""
        buffer = io.BytesIO()
        np.savez_compressed(buffer, frames=self.frames, fps=np.float64(np.nan if self.fps is None else self.fps))
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Clip":
        with np.load(io.BytesIO(bytes(data))) as npz:
            fps = float(npz["fps"])
            return cls(frames=npz["frames"], fps=None if math.isnan(fps) else fps)


def check_fps(fps, name: str = "fps") -> float | None:
    """``fps`` as a float, None as None (unknown: the decoded file's rate, else :data:`DEFAULT_FPS`); a ValueError
    naming ``name`` unless it is a finite number above 0. The rate dates a clip's frames (Qwen2.5-VL's temporal M-RoPE
    step ``2 / fps``, Qwen3-VL's timestamps): a negative, infinite or NaN one gave negative, zero or NaN positions and
    an answer, with no error; 0 was taken as 1, silently."""
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"{name} must be a frame rate in frames per second, a finite number above 0 (or None: "
                         f"unknown), got {fps!r}")
    return float(fps)


def is_video_path(value) -> bool:
    """Whether ``value`` names a video file (by its suffix): what lmms-eval's video tasks' ``doc_to_visual`` gives."""
    return isinstance(value, (str, os.PathLike)) and os.fspath(value).lower().endswith(VIDEO_SUFFIXES)


# ---- clips -------------------------------------------------------------------------------------------------------


def decode_video(path, frames: int = DEFAULT_FRAMES) -> tuple[np.ndarray, float]:
    """``(frames [F, H, W, 3] uint8, fps of the sampled frames)``: ``frames`` frames at uniformly spaced indices
    (first to last, rounded down: ``np.linspace(..., dtype=int)``, lmms-eval's own sampling in its video loader and
    its LLaVA-OneVision and Qwen2.5-VL models) of a video file, decoded with PyAV. The picks are those of the frames
    that decode, and only picked frames are ever converted to RGB and held (at most ``frames`` at once, whatever the
    clip's length): one pass keeps the picks of the count the stream states (else, Matroska / WebM stating none, of
    its stated duration times its rate); where what decodes is another count whose picks that pass did not keep, a
    second pass decodes again and keeps the missing ones (a pass that kept every frame held a 10-minute 1080p WebM
    whole, ~110 GB).

    A cut-off file is refused (:class:`TruncatedVideo`, a ValueError; the request path records it as one failed
    sample, as it records an image's truncated bytes) rather than answered on what decodes: a decode error after
    the first frame, or decoded frames that stop short of the stream's stated end by more than :func:`time_slack`
    (the larger of 2 frame intervals and 5% of the stated duration). The decoded frames' end is the last one's
    timestamp plus its duration (one frame interval where the container gives none); the stated end is the video
    stream's start plus its duration, else its Matroska / WebM ``DURATION`` tag, else the container's duration
    where the video is its only stream (a container's duration spans its audio too). A cut-off file loses the time
    its lost bytes held (the probe's faststart mp4 cut at 60% of its bytes: 1 frame, ending at 0.125 of its 5 s);
    a whole file's frames reach its end however many they are. The frame count a container states is not what tells
    them apart: it counts the frames an mp4 cut by stream copy holds but its edit list hides (70 of 100 decode,
    0-2.8 s of the stream's 2.8 s) and an AVI's dropped (empty) frames (40 of 59 decode, to its end).

    The slack: where a container leaves the last frame's display duration implicit (AVI, or a variable rate) it is
    taken as one average interval, which may be off by about one, and timestamps are rounded; the 5% keeps a long
    clip from being refused over a short tail, the uniform picks of what remains lying within 5% of the clip of the
    whole file's (8 picks are 14% apart). A file stating no duration, or one whose duration ffmpeg estimates from
    the file itself (MPEG-TS / PS: from the last timestamps there are, which a cut moves), is refused only on a
    decode error, never on how many frames decoded. (A file that lost under the slack decodes, its picks spread
    over what remains.)

    The rate is the stream's average rate over the picks' spacing (``rate * (picks - 1) / (last - first)``), or
    :data:`DEFAULT_FPS` where one frame is picked or the stream states no positive rate (PyAV reports a rate of 0, or
    0/0, as none; a negative or non-finite one is taken as none too), so a file never dates its frames at 0, NaN or a
    negative rate. A file without a video stream (audio only) is a ValueError saying so."""
    got = _decode(path, frames)
    short = _short_by(got)
    if short is not None:
        of = f" of {got.stated}" if got.stated > 0 else ""
        raise TruncatedVideo(f"{path}: truncated video: {got.count}{of} frames decoded, ending at {got.end:.3f} s of "
                             f"the {got.stated_end:.3f} s the stream states ({short:.3f} s short; at most "
                             f"{time_slack(got.stated_end - got.start, got.interval):.3f} s, the larger of 2 frame "
                             "intervals and 5%, is taken as a sound file's)")
    kept, count, rate = got.kept, got.count, got.rate
    if not count:
        raise ValueError(f"{path}: no video frames decoded")
    picks = frame_picks(count, frames)
    if not set(picks.tolist()) <= kept.keys():  # the count that decodes is not the one picked from: pick again
        reuse = {i: kept[i] for i in picks.tolist() if i in kept}
        del got, kept  # the first pass's other frames, freed before the second (at most `frames` held at once)
        kept = _decode(path, frames, total=count, reuse=reuse).kept
        if not set(picks.tolist()) <= kept.keys():
            raise ValueError(f"{path}: {count} frames decoded, then fewer on a second pass over the file")
    fps = DEFAULT_FPS if rate is None or len(picks) < 2 else rate * (len(picks) - 1) / max(picks[-1] - picks[0], 1)
    return np.stack([kept[i] for i in picks]), fps


class TruncatedVideo(ValueError):
    """A video file whose decoded frames stop materially short of its stated end, or fail after its first frame."""


def time_slack(duration: float, interval: float) -> float:
    """How many seconds short of a stream's stated end its decoded frames may stop before the file is taken as cut
    off: the larger of 2 frame intervals and 5% of the stated ``duration``; :func:`decode_video` says why."""
    return max(2 * interval, 0.05 * duration)


def _short_by(got: "_Decoded") -> float | None:
    """Seconds by which the decoded frames stop short of the stated end, where that is more than :func:`time_slack`;
    else None (also where the stream states no duration or its frames no timestamps)."""
    if got.end is None or got.stated_end is None:
        return None
    short = got.stated_end - got.end
    return short if short > time_slack(got.stated_end - got.start, got.interval) + 1e-6 else None


def frame_picks(total: int, frames: int) -> np.ndarray:
    """``min(frames, total)`` uniformly spaced frame indices of ``total``, first to last, rounded down as lmms-eval."""
    return np.linspace(0, total - 1, min(frames, total), dtype=int)


class _Decoded(NamedTuple):
    """What one pass over a video file gives (:func:`_decode`)."""

    kept: dict  # {index: [H, W, 3] uint8}: the picks the pass kept
    count: int  # frames decoded
    stated: int  # frame count the stream states (0: none)
    rate: float | None  # the stream's average rate
    end: float | None  # seconds: the last decoded frame's timestamp plus its duration (None: no timestamps)
    start: float  # seconds: where the stated span starts
    stated_end: float | None  # seconds: start plus the stated duration (None: none stated)
    interval: float  # seconds: one frame interval (0: unknown)


def _decode(path, frames: int, total: int | None = None, reuse: dict | None = None) -> _Decoded:
    """One pass over a video file's frames (:class:`_Decoded`), converting to RGB and keeping only the ``frames``
    picks of ``total`` frames (None: the count the stream states, else its stated duration times its average rate,
    else none); ``reuse``: frames ``{index: [H, W, 3]}`` a previous pass kept, taken where they are picks."""
    import av

    with av.open(os.fspath(path)) as container:
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise ValueError(f"{path}: no video stream (its streams: {', '.join(kinds)})")
        stream = container.streams.video[0]
        stated = int(stream.frames or 0)
        rate = float(stream.average_rate) if stream.average_rate else None
        rate = rate if rate is not None and math.isfinite(rate) and rate > 0 else None  # none stated: DEFAULT_FPS
        guessed = rate or (float(stream.guessed_rate) if stream.guessed_rate else None)
        interval = 1.0 / guessed if guessed else 0.0
        start, stated_end = _stated_span(container, stream)
        if total is None:
            total = stated or (round((stated_end - start) * rate) if stated_end is not None and rate else 0)
        wanted = set(frame_picks(total, frames).tolist()) if total > 0 else set()
        kept = {i: array for i, array in (reuse or {}).items() if i in wanted}
        count, last = 0, None
        try:
            for i, frame in enumerate(container.decode(stream)):
                count, last = i + 1, frame
                if i in wanted and i not in kept:
                    kept[i] = frame.to_ndarray(format="rgb24")
        except av.error.FFmpegError as err:
            if not count:
                raise  # nothing decoded: the file's own error (unreadable), as before
            of = f" of {stated}" if stated > 0 else ""
            raise TruncatedVideo(f"{path}: truncated video: {count}{of} frames decoded, then "
                                 f"{type(err).__name__}: {err}") from err
        end = None
        if last is not None and last.time is not None:
            time_base = last.time_base or stream.time_base
            own = float(last.duration * time_base) if last.duration and time_base else 0.0
            end = float(last.time) + (own or interval)
    return _Decoded(kept, count, stated, rate, end, start, stated_end, interval)


def _stated_span(container, stream) -> tuple[float, float | None]:
    """``(start, end)`` in seconds of what a video stream states it spans (end None: no duration stated): its own
    duration, else its ``DURATION`` tag (Matroska / WebM state one per track), else the container's where the video
    is its only stream."""
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
    if stream.duration and stream.time_base:
        return start, start + float(stream.duration * stream.time_base)
    tag = (stream.metadata or {}).get("DURATION") or (stream.metadata or {}).get("duration")
    match = re.fullmatch(r"(\d+):(\d+):(\d+(?:\.\d*)?)", tag.strip()) if isinstance(tag, str) else None
    if match:
        return start, start + int(match[1]) * 3600 + int(match[2]) * 60 + float(match[3])
    if container.duration and len(container.streams) == 1:
        start = container.start_time / 1e6 if container.start_time is not None else 0.0
        return start, start + container.duration / 1e6
    return start, None


def load_clip(clip, index: int, frames: int = DEFAULT_FRAMES) -> tuple[np.ndarray, float | None]:
    """One clip as ``(frames [F, H, W, 3] uint8, fps or None)``: a :class:`Clip`, a video file's path (``frames``
    sampled), an array ``[F, H, W, 3]``, or a sequence of frames (PIL images, paths, encoded bytes, ``[H, W, 3]``
    arrays) of one size and pixel type. Pixels that are not uint8 become 8 bits by the images' one rule
    (:func:`promprune.models.images.eight_bit`, judged over the whole clip): floats in [0, 1] scaled by 255, 16-bit
    values by 1/257, anything else clipped to [0, 255] (a cast made a float clip in [0, 1] all black and wrapped 16-bit
    values). A clip that cannot be read is a ValueError naming batch item ``index``: a corrupt frame by its place in
    the clip (``"clip 3: frame 2 is corrupt ..."``), a video file with no video stream, frames of size 0 (``"clip 3
    is empty"``, as an image is), and a :class:`Clip`'s rate that is not a finite number above 0
    (:func:`check_fps`)."""
    if isinstance(clip, Clip):
        array, _ = load_clip(clip.frames, index, frames)
        return array, check_fps(clip.fps, f"clip {index}'s fps")
    try:
        if isinstance(clip, (str, os.PathLike)):
            return decode_video(clip, frames)
        array = clip if isinstance(clip, np.ndarray) else _stacked([_frame(f, k, index) for k, f in enumerate(clip)],
                                                                   index)
    except BadClip:
        raise
    except Exception as err:  # PyAV / PIL / numpy raise many types for bad data
        raise ValueError(f"clip {index} is unreadable: {type(err).__name__}: {err}") from err
    if array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] < 1:
        raise ValueError(f"clip {index}: expected frames [F, H, W, 3] (RGB, F >= 1), got shape {tuple(array.shape)}")
    if min(array.shape[1:3]) < 1:
        raise ValueError(f"clip {index} is empty (frames of size {_size(array.shape[1:])})")
    try:
        return eight_bit(array), None
    except TypeError as err:
        raise ValueError(f"clip {index}: {err}") from err


class BadClip(ValueError):
    """A clip refused with a message that names it (and its frame)."""


class ClipFramesDiffer(BadClip):
    """A clip given as frames of different sizes or pixel types."""


def _frame(frame, k: int, index: int) -> np.ndarray:
    """Frame ``k`` of clip ``index`` as an array: an array as it is, else an RGB image (:func:`load_image`, whose
    error names the clip and the frame)."""
    if isinstance(frame, np.ndarray):
        return frame
    try:
        return np.asarray(load_image(frame, k, name=f"clip {index}: frame"))
    except ValueError as err:
        raise BadClip(str(err)) from err.__cause__


def _stacked(frames: list[np.ndarray], index: int) -> np.ndarray:
    """The frames of clip ``index`` as one array; `ClipFramesDiffer` naming the first frame of another size or pixel
    type (stacked, a float frame in [0, 1] among uint8 ones would be read on their scale: black)."""
    odd = next((k for k, f in enumerate(frames) if f.shape != frames[0].shape), None)
    if odd is not None:
        raise ClipFramesDiffer(f"clip {index}: its frames differ in size (frame 0 is {_size(frames[0].shape)}, frame "
                               f"{odd} is {_size(frames[odd].shape)}); a clip's frames share one size: resize them "
                               "to one before passing the clip")
    odd = next((k for k, f in enumerate(frames) if f.dtype != frames[0].dtype), None)
    if odd is not None:
        raise ClipFramesDiffer(f"clip {index}: its frames differ in pixel type (frame 0 is {frames[0].dtype}, frame "
                               f"{odd} is {frames[odd].dtype}); a clip's frames share one: convert them to one before "
                               "passing the clip")
    return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)


def _size(shape: tuple) -> str:
    """A frame's size as width x height (and its channels when not RGB)."""
    if len(shape) not in (2, 3):
        return f"an array of shape {tuple(shape)}"
    channels = shape[2] if len(shape) == 3 else 1
    return f"{shape[1]}x{shape[0]}" + (f" with {channels} channel(s)" if channels != 3 else "")


def clip_key(frames: np.ndarray) -> int:
    """A 63-bit identity of a clip: blake2b of its frames' shape and bytes (``[F, H, W, 3]`` uint8), the same on every
    machine, device and dtype (:func:`promprune.models.images.pixel_key` for a clip)."""
    digest = hashlib.blake2b(f"clip:{'x'.join(map(str, frames.shape))}:".encode(), digest_size=8)
    digest.update(np.ascontiguousarray(frames).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


def conversation(vlm, prompt: str) -> str:
    """The chat-templated text of one user turn with one clip (:meth:`PrunedVLM.conversation`'s system turn and
    template switches included)."""
    return vlm.conversation(prompt, media="video")


def _batch(clips, prompts) -> tuple[list, list]:
    """``(clips, prompts)`` as lists of one length (at least one); a bare clip (a path, a :class:`Clip`) or prompt
    string is refused naming the argument (:func:`~promprune.models.images.batch_lists`)."""
    clips, prompts = batch_lists(clips, prompts, "clips", "clip", (str, os.PathLike, Clip))
    if len(clips) != len(prompts) or not clips:
        raise ValueError(f"got {len(clips)} clips and {len(prompts)} prompts; pass one clip per prompt (at least one)")
    return clips, prompts


def processed(vlm, clips, prompts, fps: float | None = None):
    """Processor outputs for a batch of clips (unpruned placeholders), on the CPU. The frames are fed as given (no
    resampling; the adapter's ``prepare_clips`` pads a clip the processor takes no shorter: Qwen3-VL's 1-frame clip);
    ``fps`` (else the decoded file's, else 1) dates them for Qwen's timestamps / temporal positions. One processor
    call: on an adapter with ``uniform_clips`` (OneVision) the clips need one frame count (:func:`frame_groups`). A
    rate that is not a finite number above 0 is refused (:func:`check_fps`)."""
    check_video_model(vlm.model)
    fps = check_fps(fps)
    clips, prompts = _batch(clips, prompts)
    loaded = [load_clip(c, i) for i, c in enumerate(clips)]
    arrays = [a for a, _ in loaded]
    rates = [fps if fps is not None else rate if rate is not None else DEFAULT_FPS for _, rate in loaded]
    kwargs = {"do_sample_frames": False, **vlm.adapter.video_kwargs(arrays, rates)}  # how the family dates frames
    texts = [conversation(vlm, p) for p in prompts]
    return vlm.processor(text=texts, videos=vlm.adapter.prepare_clips(arrays), return_tensors="pt", padding=True,
                         **kwargs)


def inputs(vlm, clips, prompts, fps: float | None = None):
    batch = processed(vlm, clips, prompts, fps).to(vlm.device)
    if batch["pixel_values_videos"].is_floating_point():
        batch["pixel_values_videos"] = batch["pixel_values_videos"].to(vlm.model.dtype)
    return batch


def frame_groups(vlm, clips: list[Clip]) -> list[list[int]]:
    """The batch's rows by processor call: all in one, or on an adapter with ``uniform_clips`` (OneVision, whose
    processor stacks a batch's frames into one tensor) one call per frame count, rows ascending within each."""
    if not vlm.adapter.uniform_clips:
        return [list(range(len(clips)))]
    rows: dict[int, list[int]] = {}
    for i, clip in enumerate(clips):
        rows.setdefault(len(clip.frames), []).append(i)
    return list(rows.values())


def _join_rows(batches, groups: list[list[int]], pad_id: int) -> dict:
    """``input_ids`` / ``attention_mask`` of sub-batches (``batches[k]`` holding rows ``groups[k]``) as one batch in
    row order, each sub-batch left-padded to the longest (the processor pads on the left)."""
    width = max(b["input_ids"].shape[1] for b in batches)
    ids, mask = [], []
    for b in batches:
        extra = width - b["input_ids"].shape[1]
        ids.append(torch.nn.functional.pad(b["input_ids"], (extra, 0), value=pad_id))
        mask.append(torch.nn.functional.pad(b["attention_mask"], (extra, 0), value=0))
    order = torch.argsort(torch.tensor([row for rows in groups for row in rows], device=ids[0].device))
    return {"input_ids": torch.cat(ids)[order], "attention_mask": torch.cat(mask)[order]}


def video_families() -> list[str]:
    """The registered families whose adapter handles clips."""
    return [name for name in families() if family(name).video]


def check_video_model(model) -> None:
    """A ValueError naming the families that handle clips unless ``model``'s does (:func:`check_video_config`)."""
    check_video_config(model.config)


def check_video_config(config) -> None:
    """A ValueError naming the families that handle clips unless ``config``'s family does: what a model refuses a
    clip with, and what the pipeline's preflight refuses a video task on a model with (from the config alone)."""
    found = find_family(config)
    if found is None or not found.video:
        raise ValueError(f"video needs one of {', '.join(video_families())}; this model is "
                         f"{getattr(config, 'model_type', None)!r}")


# ---- candidates ----------------------------------------------------------------------------------------------------


def encode(adapter, batch, need_saliency: bool) -> list[VisualItem]:
    """One item per clip: its frames are its views (``groups``), each frame's tokens a raster grid (``grid_shape``)."""
    return adapter.encode_video(batch, need_saliency)


def encoder_outputs(adapter, items, feats, run_pos) -> dict:
    """``mm_encoder_outputs`` for ``generate``: the fed features ``feats[i]`` of each clip (at run positions
    ``run_pos[i]``) under the "video" key, as the family's model reads them."""
    return adapter.video_encoder_outputs(items, feats, run_pos)


# ---- budget over a clip --------------------------------------------------------------------------------------------


def plan(vlm, items: list[VisualItem], budget_option: str, split: str):
    """Selections of every clip (pre-LLM methods)."""
    mode = FRAME_MODES[budget_option]
    natural = split == "unit" or (split == "clip") == (budget_option == "clip")
    if natural:  # the method's own entropy / split on each selection unit
        return select_items(items, vlm.budget, vlm.method, vlm.method_options, mode=mode, order=vlm.token_order,
                            media="clip")
    return [_split_across(vlm, item, mode, split) for item in items]


def _prominence(item: VisualItem, idx: torch.Tensor, metric: str) -> torch.Tensor:
    """PromPrune's prominence metric of the tokens ``idx`` of ``item``: a 0-d tensor."""
    s = None if item.saliency is None else item.saliency[idx][None].float()
    return prominence(TokenSet(item.features[idx][None].float(), s), metric)[0]


def _split_across(vlm, item: VisualItem, mode: str, split: str):
    """PromPrune with the split computed at the other scale than the selection: ``fixed_ratio`` runs the stages."""
    opts = promprune.method_spec("promprune").resolve(vlm.method_options, budget=vlm.budget)
    stage = {"diversity": opts["diversity"], "conditional": opts["conditional"]}
    curve = dict(mu=opts["mu"], tau=opts["tau"], ratio_range=tuple(opts["saliency_ratio_range"]))
    every = torch.arange(item.features.shape[0], device=item.features.device)
    if split == "clip":  # the clip's ratio on every frame's share
        h = _prominence(item, every, opts["metric"])
        ratio = float(saliency_ratio(h[None], **curve)[0])
        sel = select_items([item], vlm.budget, "fixed_ratio", {"saliency_ratio": ratio, **stage}, mode=mode,
                           order=vlm.token_order)[0]
        sel.entropy = float(h)
        return sel
    frames = [(item.groups == g).nonzero().flatten() for g in item.groups.unique().tolist()]
    shares = split_shares(vlm.budget, [f.numel() for f in frames])
    ents = [_prominence(item, f, opts["metric"]) for f in frames]
    t_sal = sum(int(split_count(h[None], s, rounding=opts["rounding"], **curve)[0]) for h, s in zip(ents, shares))
    total = min(vlm.budget, every.numel())
    sel = select_items([item], total, "fixed_ratio", {"saliency_ratio": t_sal / total, **stage}, mode="global",
                       order=vlm.token_order)[0]
    sel.entropy = float(torch.stack(ents).mean())
    return sel


# ---- the LLM's inputs ----------------------------------------------------------------------------------------------


def _stats(feats, items, plan_=None) -> list[dict]:
    hosts = host_index(items)  # the grid indices on the host: one read for the batch at most
    if plan_ is None:
        return [dict(visual_tokens=int(f.shape[0]), saliency_count=0, entropy=None,
                     kept=sorted(h.grid_index.tolist()), salient=[]) for f, h in zip(feats, hosts)]
    return [dict(visual_tokens=int(f.shape[0]), saliency_count=p.saliency_count, entropy=p.entropy,
                 entropy_halfwidth=p.entropy_halfwidth, kept=sorted(h.grid_index[p.kept.numpy()].tolist()),
                 salient=sorted(h.grid_index[p.salient.numpy()].tolist()))
            for f, p, h in zip(feats, plan_, hosts)]


def _llm_inputs(vlm, batch, items, plan_):
    """``(input_ids, attention_mask, mm_encoder_outputs, extra generate kwargs, per-clip stats)``: every token
    (``plan_`` None) or the kept ones, the placeholder runs shrunk to match."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if plan_ is None:
        feats = [it.run for it in items]
        run_pos = [torch.arange(f.shape[0], device=f.device) for f in feats]
        col_map = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # every column stays
    else:
        newline = vlm.adapter.options["image_newline"]  # OneVision's closing newline; Qwen has none
        assembled = [it.assemble(p.kept, p.merged, newline=newline, prefix=p.cls, prefix_at=p.cls_at)
                     for it, p in zip(items, plan_)]
        feats, run_pos = [a[0] for a in assembled], [a[1] for a in assembled]
        ids, mask, col_map = shrink_placeholders(ids, mask, vlm.model.config.video_token_id, run_pos,
                                                 vlm.processor.tokenizer.pad_token_id,
                                                 keep_order=vlm.token_order != "raster", contiguous=False)
    extra = vlm.adapter.generate_kwargs(batch, ids, mask, col_map)
    return ids, mask, encoder_outputs(vlm.adapter, items, feats, run_pos), extra, _stats(feats, items, plan_)


@torch.inference_mode()
def prepare(vlm, clips, prompts, fps: float | None = None):
    """:meth:`PrunedVLM.prepare` for clips: encode, select per ``video_budget`` / ``video_split``, rebuild.

    A model whose family has no clips is refused before any clip is decoded. On an adapter with ``uniform_clips``
    (OneVision) each frame count is processed and encoded as its own sub-batch (:func:`frame_groups`), the rows joined
    for the LLM: every clip is fed what it is fed alone.

    Returns the fields of a ``Prepared`` (model kwargs, stats, items, vision and selection ms); ``PrunedVLM``
    builds it, so this module never imports ``vlm``."""
    from .options import is_in_llm

    check_video_model(vlm.model)  # before decoding: a family without clips is refused as such, whatever the clip
    check_fps(fps)  # and a rate no clip can be dated at
    clips, prompts = _batch(clips, prompts)
    clips = [Clip(*load_clip(c, i)) for i, c in enumerate(clips)]  # decoded once: the processor and the keys
    groups = frame_groups(vlm, clips)
    batches = [inputs(vlm, [clips[i] for i in rows], [prompts[i] for i in rows], fps) for rows in groups]
    batch = batches[0] if len(batches) == 1 else _join_rows(batches, groups, vlm.processor.tokenizer.pad_token_id)
    pre_llm = vlm.method is not None and not is_in_llm(vlm.method)
    # video_split other than "unit" is PromPrune's only: options.validate_method refused it for other methods
    budget_option, split = vlm.adapter.options["video_budget"], vlm.adapter.options["video_split"]
    text_source = vlm._text_source() if pre_llm else None
    with Stopwatch(vlm.device) as vision:
        items: list = [None] * len(clips)
        for rows, sub in zip(groups, batches):  # each sub-batch encoded as a batch of those clips alone would be
            for row, item in zip(rows, encode(vlm.adapter, sub, need_saliency=pre_llm and vlm.spec.needs_saliency)):
                items[row] = item
        if text_source is not None:
            vlm.adapter.attach_instruction(items, prompts, text_source)
    if pre_llm and vlm.spec.draws_at_random:  # random draws per clip and frame: hash the frames (host)
        attach_keys(items, [clip_key(clip.frames) for clip in clips])
    with Stopwatch(vlm.device) as selecting:
        chosen = plan(vlm, items, budget_option, split) if pre_llm else None
    ids, mask, encoded, extra, stats = _llm_inputs(vlm, batch, items, chosen)
    kwargs = dict(input_ids=ids, attention_mask=mask, mm_encoder_outputs=encoded, **extra)
    return dict(model_kwargs=kwargs, stats=stats, items=items, vision_time=vision, select_time=selecting)
