"""Video through the adapters (every family whose adapter handles clips: LLaVA-OneVision, Qwen2.5-VL, Qwen3-VL,
Qwen3.5) on a procedural clip.

References: plain transformers ``generate`` on the clip (the processor and model as their docs use them), the unpruned
logits, hand-worked per-frame shares, a numpy SVD spectral entropy with the split formula written out, and
transformers' own ``get_rope_index`` / ``get_video_features``.
"""
import copy
import importlib.util
import math
import weakref

import numpy as np
import pytest
import torch

import promprune
from promprune.models import PrunedVLM
from promprune.models.options import all_methods, is_in_llm, validate_method
from promprune.models.tiny import tiny_vlm
from promprune.models.video import decode_video
from promprune.models.video import inputs as video_inputs
from promprune.models.video import video_families
from promprune.testbed.clips import scene_clip, velocities
from promprune.testbed.scenes import make_scene

VIDEO_ARCHS = tuple(video_families())  # a new video family needs its hand-worked counts below
FRAMES = 4
# tokens per "frame" (OneVision: a 32 px view's 4x4 patches pooled to 2x2; Qwen: one temporal patch of 2 frames, the
# 96 px frames resized to 48 px (Qwen2.5-VL: 6x6 merged) or, the clip's pixels bounded, 64 px (Qwen3-VL and Qwen3.5,
# which uses Qwen3-VL's video processor: 8x8))
PER_FRAME = {"llava_onevision": 4, "qwen2_5_vl": 36, "qwen3_vl": 64, "qwen3_5": 64}
VIEWS = {"llava_onevision": FRAMES, "qwen2_5_vl": FRAMES // 2, "qwen3_vl": FRAMES // 2, "qwen3_5": FRAMES // 2}
TIMESTAMPED = ("qwen3_vl", "qwen3_5")  # processors that write each temporal patch's timestamp into the prompt
DATED = ("qwen2_5_vl", *TIMESTAMPED)  # processors that date frames (Qwen2.5-VL: its temporal M-RoPE positions)


def dated(videos, rates):
    """transformers' way of dating frames it does not sample: per clip a ``VideoMetadata`` of every frame's index at
    its rate (lmms-eval's Qwen chat models pass the same from their decoder's metadata)."""
    from transformers.video_utils import VideoMetadata

    return [VideoMetadata(total_num_frames=len(v), fps=rate, frames_indices=list(range(len(v))))
            for v, rate in zip(videos, rates)]


@pytest.fixture(scope="module")
def clips():
    return [scene_clip(index=3, frames=FRAMES), scene_clip(index=8, frames=FRAMES)]


PROMPTS = ["What moves?", "How many objects?"]


def plain_generate(arch, clips, prompts, new_tokens):
    """Reference: the processor and ``model.generate`` as transformers' docs use them, frames fed as given."""
    model, processor = tiny_vlm(arch)
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                         {"type": "text", "text": p}]}],
                                           add_generation_prompt=True, tokenize=False) for p in prompts]
    videos = [np.stack([np.asarray(f) for f in clip]) for clip in clips]
    kwargs = {"do_sample_frames": False}
    if arch in DATED:  # frames fed as given are dated by their metadata (a bare fps= is not read: 24 fps assumed)
        kwargs["video_metadata"] = dated(videos, [1.0] * len(videos))
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, videos=videos, return_tensors="pt", padding=True, **kwargs)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[:, inputs["input_ids"].shape[1]:].tolist(), inputs


def vlm_for(arch, method=None, budget=None, **options):
    model, processor = tiny_vlm(arch)
    return PrunedVLM(model, processor, method=method, budget=budget, **options)


def last_logits(vlm, prep):
    with torch.inference_mode(), vlm.pruning(prep):
        return vlm.model(**prep.model_kwargs).logits[:, -1]


def spectral_entropy_np(x: np.ndarray) -> float:
    """Normalized spectral entropy by numpy SVD: rows L2-normalized and centred, squared singular values (floored at
    1e-12) as a distribution, entropy / log(min(N, d))."""
    x = x.astype(np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)
    x = x - x.mean(axis=0, keepdims=True)
    lam = np.maximum(np.linalg.svd(x, compute_uv=False) ** 2, 1e-12)
    p = lam / lam.sum()
    return float(-(p * np.log(p)).sum() / math.log(min(x.shape)))


def salient_count(h: float, share: int, mu: float, tau: float) -> int:
    """PromPrune's saliency count (released rounding): round_half_even((1 - sigmoid((H - mu) / tau)) * T)."""
    return round((1.0 - 1.0 / (1.0 + math.exp(-(h - mu) / tau))) * share)


# ---- the clip ------------------------------------------------------------------------------------------------------


def test_procedural_clip_moves_its_objects():
    """Frames differ only where objects moved: frame t is the scene with every object shifted t times its velocity."""
    clip = scene_clip(index=3, frames=FRAMES, step=2, background="plain")
    arrays = [np.asarray(f, dtype=np.int16) for f in clip]
    assert len(clip) == FRAMES and clip[0].size == (96, 96)
    assert any(v != (0, 0) for v in velocities(make_scene("test", 3), 2))
    assert all(np.abs(b - a).sum() > 0 for a, b in zip(arrays, arrays[1:]))
    still = scene_clip(index=3, frames=3, step=0, background="plain")
    assert all(np.array_equal(np.asarray(still[0]), np.asarray(f)) for f in still)
    assert np.array_equal(np.asarray(still[0]), arrays[0])  # frame 0 is the scene itself


def test_decode_video_samples_frames_uniformly(tmp_path):
    """A clip written to an mp4 file decodes back to uniformly sampled frames, close to the originals (lossy)."""
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")

    clip = scene_clip(index=3, frames=8, step=3)
    path = write_mp4(av, clip, tmp_path / "clip.mp4")
    frames, fps = decode_video(path, frames=4)
    picks = [0, 2, 4, 7]  # linspace(0, 7, 4) = 0, 2.33, 4.67, 7 rounded down, as lmms-eval samples (dtype=int)
    assert frames.shape == (4, 96, 96, 3)
    assert fps == pytest.approx(8 * 3 / 7)
    for got, i in zip(frames, picks):
        error = {j: np.abs(got.astype(float) - np.asarray(clip[j], dtype=float)).mean() for j in range(8)}
        assert error[i] < 12 and min(error, key=error.get) == i  # the frame it is, not a neighbour


def write_mp4(av, clip, path, **options):
    """``clip`` (PIL frames) as an 8 fps mpeg4 mp4 at ``path`` (muxer ``options``, e.g. ``movflags=faststart``)."""
    with av.open(str(path), "w", options=options) as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = clip[0].size[0], clip[0].size[1], "yuv420p"
        for img in clip:
            for packet in stream.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


class CountingDecoder:
    """``av.open`` wrapped to count the frames a decode converts to arrays (``to_ndarray``) and the most of those
    arrays alive at once (weak references): what a decode holds, whatever its wall clock or the process's RSS."""

    def __init__(self, av, monkeypatch):
        self.converted, self.most, self._alive, real_open = 0, 0, [], av.open
        counter = self

        class Frame:
            def __init__(self, frame):
                self._frame = frame

            def __getattr__(self, name):
                return getattr(self._frame, name)

            def to_ndarray(self, *args, **kwargs):
                array = self._frame.to_ndarray(*args, **kwargs)
                counter.converted += 1
                counter._alive = [r for r in counter._alive if r() is not None] + [weakref.ref(array)]
                counter.most = max(counter.most, len(counter._alive))
                return array

        class Container:
            def __init__(self, container):
                self._container = container

            def __getattr__(self, name):
                return getattr(self._container, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self._container.__exit__(*exc)

            def decode(self, *args, **kwargs):
                return (Frame(f) for f in self._container.decode(*args, **kwargs))

        monkeypatch.setattr(av, "open", lambda *args, **kwargs: Container(real_open(*args, **kwargs)))


def test_decode_video_holds_only_the_picked_frames_of_a_long_mkv(tmp_path, monkeypatch):
    """A Matroska file states no frame count: every decoded frame was converted to RGB and held (a 3000-frame
    320x240 mkv peaked at 1357 MB against its mp4's 559 MB; a 10-minute 1080p WebM would need ~110 GB). Only the 8
    picks are converted and held, the picks those of the frames that decode (600: linspace(0, 599, 8) rounded down),
    also where the file decodes to another count than its duration gives (its last frame cut: 599, a second pass)."""
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")
    path = tmp_path / "long.mkv"
    with av.open(str(path), "w", format="matroska") as out:
        stream = out.add_stream("mpeg4", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(600):
            image = np.random.RandomState(i).randint(0, 255, (48, 64, 3), dtype=np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        out.mux(stream.encode())
    with av.open(str(path)) as src:
        assert src.streams.video[0].frames == 0  # no stated count
        every = [f.to_ndarray(format="rgb24") for f in src.decode(video=0)]
    with av.open(str(path)) as src:
        starts = [p.pos for p in src.demux(video=0) if p.size]
    assert len(every) == 600
    cut = tmp_path / "cut.mkv"  # the last frame's packet lost: 599 decode, within the slack of its stated 24 s
    cut.write_bytes(path.read_bytes()[:starts[-1]])
    for file, picks in [(path, [0, 85, 171, 256, 342, 427, 513, 599]), (cut, [0, 85, 170, 256, 341, 427, 512, 598])]:
        counter = CountingDecoder(av, monkeypatch)
        frames, fps = decode_video(file, frames=8)
        assert np.array_equal(frames, np.stack([every[i] for i in picks]))
        assert fps == pytest.approx(25 * 7 / picks[-1])
        assert counter.most <= 8 and counter.converted <= 16, (file.name, counter.most, counter.converted)
        monkeypatch.undo()


def test_decode_video_refuses_a_cut_off_file(tmp_path):
    """A file cut off (a faststart mp4, its index first as streamed files are, losing the last 40% of its bytes:
    the stream still states 40 frames, 1 decodes) or corrupt past its first frame is a TruncatedVideo naming how
    many frames decoded, not a clip sampled from what decoded (it was 1 frame, answered at 1 fps)."""
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")
    from promprune.models.video import TruncatedVideo, _decode, load_clip

    whole = write_mp4(av, scene_clip(index=3, frames=40, step=1), tmp_path / "whole.mp4", movflags="faststart")
    data = whole.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    assert _decode(cut, 8)[1:3] == (1, 40)  # the probe's file: 1 of the 40 stated frames decodes
    with pytest.raises(TruncatedVideo, match=r"cut\.mp4: truncated video: 1 of 40 frames decoded, ending at 0\.125 s "
                                             r"of the 5\.000 s the stream states"):
        decode_video(cut)
    with pytest.raises(ValueError, match=r"clip 0 is unreadable: TruncatedVideo: .*truncated video: 1 of 40"):
        load_clip(cut, 0)
    third = len(data) // 3  # the middle third zeroed: a decode error after the first frame(s)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(data[:third] + bytes(third) + data[2 * third:])
    with pytest.raises(TruncatedVideo, match=r"truncated video: \d+ of 40 frames decoded, then InvalidDataError"):
        decode_video(broken)
    assert decode_video(whole)[0].shape == (8, 96, 96, 3)


@pytest.mark.parametrize("stated", [30, 38, 41, 44, 80])
def test_decode_video_takes_a_frame_count_off_what_decodes(tmp_path, stated):
    """A container whose stated count is off what decodes (an mp4's time-to-sample table rewritten to state
    ``stated`` of its 40 frames; edit lists and dropped AVI frames do the same) is decoded, its picks made from the
    frames decoded: the clip of the exact file. The count is not what tells a cut-off file: its 40 frames reach the
    end of the duration the stream states (5 s, or 3.75 s where the table states 30), so no count is refused (the
    earlier rule refused 44, 4 over its slack of 3)."""
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")
    import struct

    from promprune.models.video import _decode

    exact = write_mp4(av, scene_clip(index=3, frames=40, step=1), tmp_path / "exact.mp4")
    data = bytearray(exact.read_bytes())
    at = data.index(b"stts") + 4  # version / flags, entry count, then (sample count, delta): one entry, 40 frames
    assert struct.unpack(">III", data[at:at + 12]) == (0, 1, 40)
    data[at + 8:at + 12] = struct.pack(">I", stated)
    off = tmp_path / "off.mp4"
    off.write_bytes(bytes(data))
    got = _decode(off, 8)
    assert got[1:3] == (40, stated) and got.end == 5.0 and got.stated_end == min(5.0, stated / 8)
    (got, got_fps), (ref, ref_fps) = decode_video(off), decode_video(exact)
    assert np.array_equal(got, ref) and got_fps == pytest.approx(ref_fps)


def test_decode_video_takes_an_mp4_cut_by_stream_copy(tmp_path):
    """An mp4 cut by stream copy (``ffmpeg -ss 1.2 -c copy``: the packets from the keyframe before the cut, an edit
    list hiding the frames before it) states the 100 frames it holds and decodes the 70 it shows, 0-2.76 s of its
    2.8 s: a whole file, decoded (it was refused as '70 of 100 frames decoded'), its picks those of the source's
    frames 30-99."""
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")
    try:
        av.codec.Codec("libx264", "w")
    except Exception:
        pytest.skip("this PyAV has no libx264 encoder")
    from promprune.models.video import _decode, frame_picks

    source = tmp_path / "source.mp4"
    with av.open(str(source), "w") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        stream.options = {"g": "50", "keyint_min": "50", "sc_threshold": "0", "bf": "0"}  # keyframes at 0 and 2 s
        for i in range(100):
            image = np.random.RandomState(i).randint(0, 255, (64, 64, 3), dtype=np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        out.mux(stream.encode())
    cut = tmp_path / "cut.mp4"
    with av.open(str(source)) as src, av.open(str(cut), "w") as out:
        copy_stream = out.add_stream_from_template(src.streams.video[0])
        shift = int(1.2 / src.streams.video[0].time_base)
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is None:
                continue
            packet.pts -= shift
            packet.dts -= shift
            packet.stream = copy_stream
            out.mux(packet)
    got = _decode(cut, 8)
    assert got[1:3] == (70, 100) and got.end == pytest.approx(2.8) and got.stated_end == pytest.approx(2.8)
    frames, fps = decode_video(cut)
    with av.open(str(source)) as src:
        whole = [f.to_ndarray(format="rgb24") for f in src.decode(video=0)]
    assert np.array_equal(frames, np.stack([whole[30 + i] for i in frame_picks(70, 8)]))
    assert fps == pytest.approx(25 * 7 / 69)


def test_decode_video_takes_an_avi_with_dropped_frames(tmp_path):
    """An AVI muxed from frames with timestamp gaps (a capture's dropped frames: the muxer writes an empty chunk for
    each missing frame) states 59 frames and decodes its 40, 0-7.375 s of the 7.375 s stated: a whole file, decoded
    (it was refused as '40 of 59 frames decoded'), its picks those of the 40."""
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")
    from fractions import Fraction

    from promprune.models.video import _decode, frame_picks

    clip = scene_clip(index=3, frames=40, step=1)
    path = tmp_path / "gaps.avi"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 96, "yuv420p"
        for i, image in enumerate(clip):
            frame = av.VideoFrame.from_image(image)
            frame.pts, frame.time_base = i + i // 2, Fraction(1, 8)  # a frame dropped after every second one
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    got = _decode(path, 8)
    assert got[1:3] == (40, 59) and got.end == got.stated_end == 59 / 8
    with av.open(str(path)) as src:
        decoded = [f.to_ndarray(format="rgb24") for f in src.decode(video=0)]
    assert np.array_equal(decode_video(path)[0], np.stack([decoded[i] for i in frame_picks(40, 8)]))


def test_decode_video_refuses_frames_stopping_short_of_the_stated_end(tmp_path):
    """The slack: a Matroska file (its video's duration a DURATION tag, 5 s) cut before its last 1 or 2 frames'
    packets ends 0.125 / 0.25 s short, within the larger of 2 frame intervals (0.25 s) and 5% (0.25 s), and decodes;
    cut before its last 3 it is 0.375 s short, refused."""
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")
    from promprune.models.video import TruncatedVideo, _decode, time_slack

    whole = tmp_path / "whole.mkv"
    with av.open(str(whole), "w") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 96, "yuv420p"
        for image in scene_clip(index=3, frames=40, step=1):
            out.mux(stream.encode(av.VideoFrame.from_image(image)))
        out.mux(stream.encode())
    with av.open(str(whole)) as src:
        starts = [p.pos for p in src.demux(video=0) if p.size]
    data = whole.read_bytes()
    assert len(starts) == 40 and _decode(whole, 8)[1:3] == (40, 0)  # no stated count
    for lost in (1, 2, 3):
        cut = tmp_path / f"lost{lost}.mkv"
        cut.write_bytes(data[:starts[-lost]])
        got = _decode(cut, 8)
        assert got.count == 40 - lost and got.end == 5 - lost / 8 and got.stated_end == 5.0
        if lost < 3:
            assert decode_video(cut)[0].shape == (8, 96, 96, 3)
            continue
        with pytest.raises(TruncatedVideo, match=r"lost3\.mkv: truncated video: 37 frames decoded, ending at "
                                                 r"4\.625 s of the 5\.000 s the stream states \(0\.375 s short"):
            decode_video(cut)
    assert time_slack(5.0, 1 / 8) == 0.25 and time_slack(100.0, 1 / 8) == 5.0 and time_slack(1.0, 1 / 25) == 0.08


# ---- unpruned and full budget --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", VIDEO_ARCHS)
def test_unpruned_matches_plain_generate(arch, clips):
    ref, inputs = plain_generate(arch, clips, PROMPTS, 4)
    got = vlm_for(arch).generate_video(clips, PROMPTS, max_new_tokens=4)
    assert [g.token_ids for g in got] == ref
    video_id = tiny_vlm(arch)[0].config.video_token_id
    assert [g.visual_tokens for g in got] == (inputs["input_ids"] == video_id).sum(1).tolist()
    # text tokens: what the processor built, minus the placeholders and padding (Qwen3-VL: with its timestamps)
    text = ((inputs["attention_mask"] == 1) & (inputs["input_ids"] != video_id)).sum(1).tolist()
    assert [g.text_tokens for g in got] == text


@pytest.mark.parametrize("arch", TIMESTAMPED)
def test_qwen3_video_text_tokens_count_the_frame_timestamps(arch, clips):
    """Qwen3-VL's processor writes a timestamp before every temporal patch: the text the LLM reads is longer than
    the image conversation's template (which the pipeline once counted, so a video's prefill FLOPs missed them)."""
    vlm = vlm_for(arch)
    got = vlm.generate_video(clips, PROMPTS, max_new_tokens=1)
    tok, image_id = vlm.processor.tokenizer, vlm.model.config.image_token_id
    template = [sum(i != image_id for i in tok(vlm.conversation(p), add_special_tokens=False)["input_ids"])
                for p in PROMPTS]
    assert all(g.text_tokens > t for g, t in zip(got, template))


@pytest.mark.parametrize("arch", VIDEO_ARCHS)
@pytest.mark.parametrize("video_budget", ["per_frame", "clip"])
def test_full_budget_equals_unpruned_logits(arch, video_budget, clips):
    """Keeping every candidate in raster order (OneVision: the closing newline restored by image_newline="rows")
    rebuilds the unpruned sequence: identical logits (Qwen: identical 3D positions; Qwen3-VL: DeepStack rows)."""
    n = PER_FRAME[arch] * VIEWS[arch]
    base = vlm_for(arch)
    ref = last_logits(base, base.prepare_video(clips, PROMPTS))
    vlm = vlm_for(arch, "promprune", n, video_budget=video_budget, image_newline="rows", token_order="raster")
    prep = vlm.prepare_video(clips, PROMPTS)
    assert [s["visual_tokens"] for s in prep.stats] == [n + (arch == "llava_onevision")] * 2
    torch.testing.assert_close(last_logits(vlm, prep), ref, atol=1e-5, rtol=1e-5)


# ---- budget modes --------------------------------------------------------------------------------------------------


# budget 10 over the frames: OneVision 4 frames of 4 tokens -> 3, 3, 2, 2; Qwen 2 temporal patches -> 5, 5
SHARES = {"llava_onevision": [3, 3, 2, 2], "qwen2_5_vl": [5, 5], "qwen3_vl": [5, 5], "qwen3_5": [5, 5]}


@pytest.mark.parametrize("arch", VIDEO_ARCHS)
@pytest.mark.parametrize("video_budget", ["per_frame", "clip", "adaptive_frames"])
@pytest.mark.parametrize("method", ["promprune", "divprune", "random"])
def test_exact_visual_token_counts(arch, video_budget, method, clips):
    vlm = vlm_for(arch, method, 10, video_budget=video_budget)
    out = vlm.generate_video(clips, PROMPTS, max_new_tokens=1)
    assert [g.visual_tokens for g in out] == [10, 10]
    unpruned = vlm_for(arch).generate_video(clips, PROMPTS, max_new_tokens=1)
    assert [g.text_tokens for g in out] == [g.text_tokens for g in unpruned]  # pruning removes visual tokens only
    prep = vlm.prepare_video(clips, PROMPTS)
    video_id = vlm.model.config.video_token_id
    assert (prep.model_kwargs["input_ids"] == video_id).sum(1).tolist() == [10, 10]
    for stats in prep.stats:
        per_frame = np.bincount(np.array(stats["kept"]) // PER_FRAME[arch], minlength=VIEWS[arch]).tolist()
        assert sum(per_frame) == 10
        if video_budget == "per_frame":
            assert per_frame == SHARES[arch]


def test_onevision_newline_rows_and_all_add_the_clip_newline(clips):
    for newline, extra in [("drop", 0), ("rows", 1), ("all", 1)]:
        vlm = vlm_for("llava_onevision", "divprune", 6, image_newline=newline)
        assert [g["visual_tokens"] for g in vlm.prepare_video(clips, PROMPTS).stats] == [6 + extra] * 2


def _entropies(arch, clips):
    """Each clip's tokens by frame (grid order) from the unpruned encoder; numpy entropies of the clip / frames."""
    vlm = vlm_for(arch, "promprune", 8)
    items = vlm.prepare_video(clips, PROMPTS).items
    p = PER_FRAME[arch]
    out = []
    for it in items:
        x = it.features.float().numpy()
        out.append((spectral_entropy_np(x), [spectral_entropy_np(x[f * p:(f + 1) * p]) for f in range(VIEWS[arch])]))
    return out


@pytest.mark.parametrize("arch", ["llava_onevision", "qwen2_5_vl"])
def test_video_split_clip_and_per_frame(arch, clips):
    """The three PromPrune splits, each against the formula on numpy entropies: per frame on each frame's share; the
    clip's ratio on every frame's share; each frame's split of its share summed, selected over the clip."""
    budget, tau = 10, 0.1
    (h_clip, h_frames), _ = _entropies(arch, clips)
    mu = (h_clip + float(np.mean(h_frames))) / 2  # between the clip's and the frames' entropies: no count saturates
    shares = SHARES[arch]
    opts = dict(mu=mu, tau=tau)

    per = vlm_for(arch, "promprune", budget, video_budget="per_frame", **opts).prepare_video(clips, PROMPTS).stats[0]
    expected = [salient_count(h, s, mu, tau) for h, s in zip(h_frames, shares)]
    salient = np.bincount(np.array(per["salient"], dtype=int) // PER_FRAME[arch], minlength=len(shares)).tolist()
    assert salient == expected and per["saliency_count"] == sum(expected)
    assert per["entropy"] == pytest.approx(np.mean(h_frames), abs=1e-4)

    clip_ratio = 1.0 - 1.0 / (1.0 + math.exp(-(h_clip - mu) / tau))
    got = vlm_for(arch, "promprune", budget, video_budget="per_frame", video_split="clip",
                  **opts).prepare_video(clips, PROMPTS).stats[0]
    assert got["saliency_count"] == sum(round(clip_ratio * s) for s in shares)
    assert got["entropy"] == pytest.approx(h_clip, abs=1e-4) and got["visual_tokens"] == budget
    salient = np.bincount(np.array(got["salient"], dtype=int) // PER_FRAME[arch], minlength=len(shares)).tolist()
    assert salient == [round(clip_ratio * s) for s in shares]
    assert 0 < sum(salient) < budget and 0 < sum(expected) < budget  # the splits are not all-saliency / all-coverage

    got = vlm_for(arch, "promprune", budget, video_budget="clip", video_split="per_frame",
                  **opts).prepare_video(clips, PROMPTS).stats[0]
    assert got["saliency_count"] == sum(expected) and got["visual_tokens"] == budget
    assert got["entropy"] == pytest.approx(np.mean(h_frames), abs=1e-4)

    whole = vlm_for(arch, "promprune", budget, video_budget="clip", **opts).prepare_video(clips, PROMPTS).stats[0]
    assert whole["saliency_count"] == salient_count(h_clip, budget, mu, tau)
    assert whole["entropy"] == pytest.approx(h_clip, abs=1e-4)


@pytest.mark.parametrize("method", ["divprune", "fastv", "sparsevlm", "pyramiddrop", "dart"])
@pytest.mark.parametrize("split", ["clip", "per_frame"])
def test_video_split_needs_promprune(method, split):
    """Any method but PromPrune, pre-LLM or in-LLM, refuses a video_split other than "unit" when built (and when a
    spec is checked, without a model), before any clip; unpruned ignores it."""
    match = f"video_split='{split}'.*'{method}'.*video_split='unit'"
    with pytest.raises(ValueError, match=match):
        vlm_for("qwen2_5_vl", method, 6, video_split=split)
    with pytest.raises(ValueError, match=match):
        validate_method(method, 6, video_split=split)
    assert vlm_for("qwen2_5_vl", "promprune", 6, video_split=split).adapter.options["video_split"] == split
    unpruned = vlm_for("qwen2_5_vl", video_split=split).generate_video([scene_clip(frames=2)], ["q"], max_new_tokens=1)
    assert unpruned[0].visual_tokens == PER_FRAME["qwen2_5_vl"]
    with pytest.raises(ValueError, match="video_budget"):
        vlm_for("qwen2_5_vl", "divprune", 6, video_budget="frames")


GRID_METHODS = [m for m in all_methods() if promprune.method_spec(m).needs_grid]  # methods that pool a view's grid


@pytest.mark.parametrize("method", GRID_METHODS)
def test_grid_method_refuses_a_clip_budget(method):
    """A grid method (``needs_grid``: downsample) pools one view's token grid, and video_budget "clip" selects over
    every frame at once: every clip failed at run time (the sweep exited 0 with every sample failed). Refused when
    built and when options are checked (no model), naming the option and its fix; per-frame budgets run."""
    match = (f"video_budget='clip'.*{method!r} pools one view's token grid.*video_budget='per_frame'.*"
             "'adaptive_frames'")
    with pytest.raises(ValueError, match=match) as refused:
        validate_method(method, 8, video_budget="clip")
    assert getattr(refused.value, "option", None) == "video_budget"
    with pytest.raises(ValueError, match=match):
        vlm_for("llava_onevision", method, 8, video_budget="clip")
    clip = [scene_clip(index=3, frames=FRAMES)]
    for video_budget in ("per_frame", "adaptive_frames"):
        out = vlm_for("llava_onevision", method, 8, video_budget=video_budget).generate_video(clip, ["q"],
                                                                                              max_new_tokens=1)
        assert out[0].visual_tokens == 8


def test_grid_method_runtime_refusal_names_the_clip_option():
    """Past the up-front check (options changed after building), a clip whose selection is no one frame's rectangle
    is refused naming video_budget, a clip's option (it named the image option budget_mode, which a clip ignores)."""
    vlm = vlm_for("llava_onevision", "downsample", 8)
    vlm.adapter.options["video_budget"] = "clip"
    with pytest.raises(ValueError, match=r"use video_budget 'per_frame' or 'adaptive_frames'.*not 'clip'") as refused:
        vlm.prepare_video([scene_clip(index=3, frames=FRAMES)], ["q"])
    assert "budget_mode" not in str(refused.value)


def test_video_needs_a_video_model(tmp_path):
    with pytest.raises(ValueError, match="video needs one of llava_onevision"):
        vlm_for("llava").prepare_video([scene_clip(frames=2)], ["q"])
    bad = tmp_path / "bad.mp4"  # refused as a model without clips, not decoded first (which named the file unreadable)
    bad.write_bytes(b"not a video" * 10)
    with pytest.raises(ValueError, match="video needs one of llava_onevision.*'llava'"):
        vlm_for("llava").generate_video([bad], ["q"])
    with pytest.raises(ValueError, match="clip 0 is unreadable"):  # the same file on a video family
        vlm_for("qwen2_5_vl").generate_video([bad], ["q"])


def test_a_bare_clip_or_prompt_is_refused_naming_the_argument(tmp_path):
    """A clip's path or a prompt string passed bare was iterated a character at a time (a clip per character, or
    "got 1 clips and 5 prompts"); refused naming the argument, before any clip is decoded."""
    from promprune.models.video import Clip

    vlm = vlm_for("qwen2_5_vl")
    clip = scene_clip(frames=2)
    for call in (vlm.prepare_video, vlm.generate_video):
        with pytest.raises(ValueError, match=r"^prompts must be a list with one prompt per batch row .*got str "
                                             r"'hello': wrap a single prompt in a list$"):
            call([clip], "hello")
        for bare, kind in ((str(tmp_path / "a.mp4"), "str"), (tmp_path / "a.mp4", "PosixPath"),
                           (Clip(np.zeros((2, 8, 8, 3), np.uint8), None), "Clip")):
            with pytest.raises(ValueError, match=rf"^clips must be a list with one clip per batch row \(e\.g\. "
                                                 rf"\[clip\]\), got {kind} .*: wrap a single clip in a list$"):
                call(bare, ["hello"])
    with pytest.raises(ValueError, match="got 1 clips and 2 prompts"):
        vlm.prepare_video([clip], ["a", "b"])


def test_frames_of_different_sizes_are_named():
    """A clip given as frames of different sizes says which frame and both sizes (numpy's stack error was reported
    as an unreadable clip); an empty frame list says what a clip must hold."""
    from promprune.models.video import load_clip

    frame = np.zeros((48, 64, 3), np.uint8)
    with pytest.raises(ValueError, match=r"clip 1: its frames differ in size \(frame 0 is 64x48, frame 2 is 32x48\)"):
        load_clip([frame, frame, frame[:, :32]], 1)
    with pytest.raises(ValueError, match=r"frame 1 is 64x48 with 1 channel\(s\)"):
        load_clip([frame, frame[..., 0]], 0)
    with pytest.raises(ValueError, match=r"clip 0: expected frames \[F, H, W, 3\] \(RGB, F >= 1\)"):
        load_clip([], 0)
    assert load_clip([frame, frame + 1], 0)[0].shape == (2, 48, 64, 3)


def test_bad_clips_are_named_by_what_is_wrong(tmp_path):
    """A corrupt frame k of clip i was "image i is corrupt" (the clip's index passed as the frame's); a video file
    with no video stream (audio only) failed as "IndexError: tuple index out of range"; a clip of zero-size frames
    passed load_clip and failed in the processor with a ZeroDivisionError (an image of size 0 is refused as empty)."""
    from PIL import Image

    from promprune.models.video import load_clip

    good = Image.new("RGB", (16, 16), (9, 9, 9))
    with pytest.raises(ValueError, match=r"^clip 3: frame 2 is corrupt or unreadable: UnidentifiedImageError"):
        load_clip([good, good, b"not an image"], 3)
    with pytest.raises(ValueError, match=r"^clip 1: frame 0 is empty \(size \(0, 5\)\)$"):
        load_clip([Image.new("RGB", (0, 5))], 1)
    vlm = vlm_for("qwen2_5_vl")
    for empty in (np.zeros((2, 0, 8, 3), np.uint8), np.zeros((2, 8, 0, 3), np.uint8)):
        with pytest.raises(ValueError, match=r"^clip 0 is empty \(frames of size (8x0|0x8)\)$"):
            vlm.generate_video([empty], ["q"], max_new_tokens=1)
    av = pytest.importorskip("av", reason="PyAV writes the clip (the GPU machine's batches leave it out)")
    audio = tmp_path / "audio_only.mp4"
    with av.open(str(audio), "w") as out:
        stream = out.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    with pytest.raises(ValueError, match=r"no video stream \(its streams: audio\)$"):
        decode_video(audio)
    with pytest.raises(ValueError, match=r"^clip 0 is unreadable: ValueError: .*audio_only\.mp4: no video stream"):
        load_clip(audio, 0)


def test_clip_frames_take_the_images_8_bit_rule():
    """Frames that are not uint8 were cast (``astype(np.uint8)``): a float clip in [0, 1] came out all black, 16-bit
    values wrapped to their low byte, -1 became 255. They take the images' one rule (``images.eight_bit``), judged
    over the clip: hand-worked values, and each float frame as ``load_image`` converts it as a float ("F") image; the
    model reads a float clip as its 8-bit conversion, not as a black clip."""
    from PIL import Image

    from promprune.models.images import load_image
    from promprune.models.video import Clip, load_clip

    unit = np.random.default_rng(0).random((4, 32, 32, 3)).astype(np.float32)  # [F, H, W, 3] in [0, 1]
    eight = np.round(unit.astype(np.float64) * 255).astype(np.uint8)
    for given in (unit, list(unit), Clip(unit, 2.0)):
        got, _ = load_clip(given, 0)
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, eight)
    for k in range(2):  # every frame in [0, 1]: the clip's scale is each frame's, as an image is scaled alone
        as_image = np.asarray(load_image(Image.fromarray(unit[k, ..., 1], mode="F"), 0))[..., 0]
        np.testing.assert_array_equal(as_image, eight[k, ..., 1])
    u16 = np.array([0, 257, 1000, 65535], np.uint16).repeat(3).reshape(1, 2, 2, 3)
    assert load_clip(u16, 0)[0][0, ..., 0].tolist() == [[0, 1], [4, 255]]  # v / 257, rounded
    i16 = np.array([-1, 0, 128, 255], np.int16).repeat(3).reshape(1, 2, 2, 3)
    assert load_clip(i16, 0)[0][0, ..., 0].tolist() == [[0, 0], [128, 255]]  # 8-bit values: -1 clipped, not 255
    wide = np.array([-5.0, 0.5, 200.4, 300.0], np.float32).repeat(3).reshape(1, 2, 2, 3)
    assert load_clip(wide, 0)[0][0, ..., 0].tolist() == [[0, 0], [200, 255]]  # not in [0, 1]: clipped to [0, 255]
    with pytest.raises(ValueError, match=r"^clip 2: its frames differ in pixel type \(frame 0 is uint8, frame 1 is "
                                         r"float32\)"):
        load_clip([eight[0], unit[1]], 2)  # stacked, the float frame would be read on the uint8 scale: black
    vlm = vlm_for("qwen2_5_vl", method="promprune", budget=8)
    features = [vlm.prepare_video([c], ["q"]).items[0].features for c in (unit, eight, np.zeros_like(eight))]
    assert torch.equal(features[0], features[1]) and not torch.equal(features[0], features[2])


def _eight_bit_before(pixels):
    """``images.eight_bit`` as it was before it converted in chunks (a float64 copy of the whole array), verbatim:
    the values the chunked one must keep."""
    a = np.asarray(pixels)
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.bool_:
        return a.astype(np.uint8) * np.uint8(255)
    sixteen_bit, is_float = a.dtype.kind == "u" and a.dtype.itemsize == 2, a.dtype.kind == "f"
    a = a.astype(np.float64)
    finite = a[np.isfinite(a)]
    top = float(finite.max()) if finite.size else 0.0
    if is_float:
        a = a * 255.0 if finite.size and float(finite.min()) >= 0.0 and top <= 1.0 else a
    elif sixteen_bit or top > 255:
        a = a / 257.0
    return np.clip(np.nan_to_num(a), 0, 255).round().astype(np.uint8)


def _pixel_cases():
    rng = np.random.default_rng(7)
    unit, wide = rng.random((6, 5, 7, 3)), rng.random((6, 5, 7, 3)) * 255
    halves = (np.arange(6 * 5 * 7 * 3) % 511 / 510.0).reshape(6, 5, 7, 3)  # k / 510: every .5 step of 255 * v
    for dtype in (np.float16, np.float32, np.float64):
        yield unit.astype(dtype)
        yield wide.astype(dtype)
        yield (halves * 255).astype(dtype)  # [0, 255] on the halves: round half to even
        yield halves.astype(dtype)
        late = unit.astype(dtype)
        late[-1, -1, -1, -1] = 1.5  # one value past 1 in the last frame: the whole clip is read as [0, 255]
        yield late
        odd = wide.astype(dtype)
        odd[0, 0, 0] = [np.nan, np.inf, -np.inf]
        odd[3, 2, 1] = [-3.0, 300.0, 254.5]
        yield odd
        edge = unit.astype(dtype)
        edge[2, 0, 0] = [np.nan, np.inf, 0.0]  # non-finite values do not count towards [0, 1]
        yield edge
        yield np.full((3, 2, 2, 3), np.nan, dtype)
    yield rng.integers(-300, 300, (6, 5, 7, 3)).astype(np.int16)
    yield rng.integers(-1, 256, (6, 5, 7, 3)).astype(np.int16)  # 8-bit values (-1 clipped)
    yield rng.integers(0, 65536, (6, 5, 7, 3)).astype(np.uint16)
    yield rng.integers(0, 256, (6, 5, 7, 3)).astype(np.uint16)  # 16-bit range all the same
    yield (np.arange(6 * 5 * 7 * 3) % 255).astype(np.uint16).reshape(6, 5, 7, 3) * 257 + 128  # v / 257: k + .498
    yield rng.random((5, 7)).astype(np.float32)  # an image's one channel
    yield np.float32(0.5), np.zeros((0, 4, 4, 3), np.float32)


@pytest.mark.parametrize("chunk", [1, 37, 105, 2 ** 20])
def test_eight_bit_in_chunks_gives_the_whole_arrays_values(chunk, monkeypatch):
    """``images.eight_bit`` converts ``EIGHT_BIT_CHUNK`` elements (whole rows of the first axis) at a time instead of
    a float64 copy of the whole clip: its output is the old function's (kept verbatim above), value for value and
    uint8, on float16 / float32 / float64 / int16 / uint16 pixels in [0, 1] and in [0, 255], with NaN, infinities,
    values out of range and a range that only the clip's last frame decides; chunks of 1 (a row of a frame at a
    time), 37, 105 (one frame: 5 x 7 x 3) and the default."""
    from promprune.models import images

    monkeypatch.setattr(images, "EIGHT_BIT_CHUNK", chunk)
    for case in _pixel_cases():
        for pixels in case if isinstance(case, tuple) else (case,):
            got, want = images.eight_bit(pixels), _eight_bit_before(pixels)
            assert got.dtype == np.uint8 and np.shape(got) == np.shape(want), (pixels.dtype, np.shape(pixels))
            np.testing.assert_array_equal(got, want, err_msg=f"{pixels.dtype} {np.shape(pixels)}")


def test_eight_bit_of_a_float_clip_makes_no_whole_float64_copy():
    """A 64 x 336 x 336 x 3 float32 clip (82.7 MiB): the old conversion's float64 copies (the clip, its finite values,
    the product by 255) peaked at 661.5 MiB under tracemalloc, ~8x the clip; in chunks the peak is the uint8 output
    (20.7 MiB) and a few chunks' copies (38.8 MiB), below the clip's own size. The values are the old ones."""
    import tracemalloc

    from promprune.models.images import eight_bit

    clip = np.random.default_rng(0).random((64, 336, 336, 3), dtype=np.float32)
    tracemalloc.start()
    try:
        got = eight_bit(clip)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < clip.nbytes, f"peak {peak / 2 ** 20:.1f} MiB for a {clip.nbytes / 2 ** 20:.1f} MiB clip"
    np.testing.assert_array_equal(got[::7], _eight_bit_before(clip[::7]))


def test_a_clip_rate_that_dates_nothing_is_refused():
    """``fps`` (``generate_video`` / ``prepare_video``) and ``Clip.fps`` were never checked: on Qwen2.5-VL a negative
    rate gave decreasing temporal positions (7, 3, -1, -5), an infinite one a constant position, NaN int64's minimum,
    each answered; 0 was taken as 1. Refused by name, before any clip is read; a Clip's rate changed after it was
    made is refused naming the batch item."""
    from promprune.models.video import Clip, check_fps

    frames = np.stack([np.asarray(f) for f in scene_clip(index=3, frames=4)])
    vlm = vlm_for("qwen2_5_vl")
    rule = r"must be a frame rate in frames per second, a finite number above 0 \(or None: unknown\), got "
    for bad in (0, 0.0, -2.0, math.inf, math.nan, True, "8"):
        with pytest.raises(ValueError, match=r"^fps " + rule):
            vlm.generate_video([Clip(frames)], ["q"], fps=bad, max_new_tokens=1)
        with pytest.raises(ValueError, match=r"^fps " + rule):
            vlm.prepare_video(["/nonexistent.mp4"], ["q"], fps=bad)  # before the file is read
        with pytest.raises(ValueError, match=r"^Clip\.fps " + rule):
            Clip(frames, bad)
    clip = Clip(frames, 2.0)
    clip.fps = -1.0
    with pytest.raises(ValueError, match=r"^clip 1's fps " + rule + r"-1\.0$"):
        vlm.prepare_video([Clip(frames), clip], ["q", "q"])
    assert check_fps(np.float32(0.5)) == 0.5 and check_fps(None) is None and check_fps(24) == 24.0


@pytest.mark.parametrize("arch", ["llava_onevision", "qwen2_5_vl"])
def test_a_prompt_holding_the_video_tag_is_answered_as_the_plain_question(arch, clips):
    """lmms-eval's osi_bench appends "\\n<video>" to its prompt for models without doc_to_messages (mmsi_video writes
    "<image>" per frame): on LLaVA-OneVision, whose video token is "<video>", the tag was a second clip placeholder
    and every such request failed ("Found total 2 <video> tokens and 1 videos"); Qwen read it as text. Removed as
    the "<image>" tag is (with the newline after it, or before it at the prompt's end): the answers are the plain
    questions', plain transformers' (``plain_generate``). An image's prompt keeps the tag: the user's text there."""
    vlm = vlm_for(arch)
    tagged = [PROMPTS[0] + "\n<video>", "<video>\n" + PROMPTS[1]]
    ref, _ = plain_generate(arch, clips, PROMPTS, 4)
    assert [g.token_ids for g in vlm.generate_video(clips, tagged, max_new_tokens=4)] == ref
    for prompt in (*tagged, "What <video> moves?", "What moves?<image><image>"):
        plain = prompt.replace("<video>", "").replace("<image>", "").replace("\n", "").replace("  ", " ")
        assert vlm.conversation(prompt, media="video") == vlm.conversation(plain, media="video")
    assert "What moves?\n<video>" in vlm.conversation("What moves?\n<video>")  # media="image"


@pytest.mark.parametrize("visual_first", [False, True])
@pytest.mark.parametrize("category", ["absolute_distance", "relative_distance", "absolute_speed"])
def test_a_frame_tasks_tags_are_all_removed_as_lmms_eval_leaves_them_out(category, visual_first):
    """lmms-eval's osi_bench_frames (a clip given as frames, ``tasks.FRAME_TASKS``) writes one "<image>" per frame
    for models without doc_to_messages: by default ``"Q\\n" + "<image>" * 32`` at the prompt's end. Only the last
    tag took the newline before it with it ("Q\\n<image>\\n<image>" left "Q\\n"), so the clip's prompt was the
    task's own plus a trailing newline. Now all of them do: the prompt is the one lmms-eval's own function builds
    for a model that places the frames itself (``include_visual_token=False``), and the hand-worked cases."""
    from lmms_eval.tasks.osi_bench.utils import osi_bench_doc_to_text_frames

    from promprune.models.vlm import strip_media_tags

    doc = {"question": "Which object is nearer?", "category": category, "video_length": 12.5,
           "options": ["A. the cup", "B. the chair"]}
    kwargs = {"default": {"num_frames": 32, "visual_first": visual_first}}
    tagged = osi_bench_doc_to_text_frames(doc, kwargs)
    assert tagged.count("<image>") == 32
    assert strip_media_tags(tagged, "video") == osi_bench_doc_to_text_frames(doc, kwargs, include_visual_token=False)
    for prompt, plain in [("Q\n<image>\n<image>", "Q"), ("Q <image> <video>", "Q"), ("Q\r\n<image><image>", "Q"),
                          ("Q\n<image>", "Q"), ("<image><image>\nQ", "Q"), ("A\n<image><image>\nB", "A\nB"),
                          ("A <image> B\n<image><image>", "A B"), ("<image>\n<image>", "")]:
        assert strip_media_tags(prompt, "video") == plain, prompt
    assert strip_media_tags("Q\n<image>\n<image>") == "Q"  # an image's prompt: its "<image>" tags the same way
    assert strip_media_tags("Q\n<video>\n<video>") == "Q\n<video>\n<video>"  # the user's text there


# ---- clips of one frame, batches of different frame counts ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_qwen_one_frame_clip_is_its_image(arch, tmp_path):
    """A 1-frame clip is one temporal patch of that frame twice (Qwen2.5-VL's processor repeats it; Qwen3-VL's
    refuses it, so the adapter repeats it first): the image path's tokens and saliency of the frame, and on
    Qwen3-VL / Qwen3.5 the processor's own inputs for the 2-frame clip dated at frame 0 twice (the date its
    processor gives the frame it repeats to fill an odd clip's last patch)."""
    image = scene_clip(index=5, frames=1)[0].resize((48, 48))
    vlm = vlm_for(arch, "saliency_only", 4)
    image_item = vlm.prepare([image], ["q"]).items[0]
    clip_item = vlm.prepare_video([[image]], ["q"]).items[0]
    torch.testing.assert_close(clip_item.features, image_item.features)
    torch.testing.assert_close(clip_item.saliency, image_item.saliency)
    assert clip_item.groups.unique().tolist() == [0]
    got = vlm_for(arch).generate_video([[image]], ["q"], max_new_tokens=3)[0]
    assert got.visual_tokens == 36  # one 6 x 6 merged grid
    if arch in TIMESTAMPED:
        from transformers.video_utils import VideoMetadata

        model, processor = tiny_vlm(arch)
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                           {"type": "text", "text": "q"}]}],
                                             add_generation_prompt=True, tokenize=False)
        ref = processor(text=[text], videos=[np.stack([np.asarray(image)] * 2)], return_tensors="pt",
                        do_sample_frames=False,
                        video_metadata=[VideoMetadata(total_num_frames=2, fps=1.0, frames_indices=[0, 0])])
        ours = video_inputs(vlm, [[image]], ["q"])
        for key in ("input_ids", "pixel_values_videos", "video_grid_thw"):
            assert torch.equal(ours[key], ref[key]), key
        assert "<0.0 seconds>" in processor.decode(ref["input_ids"][0])
        with torch.inference_mode():
            out = model.generate(**ref, max_new_tokens=3, do_sample=False)
        assert got.token_ids == out[0, ref["input_ids"].shape[1]:].tolist()
    if importlib.util.find_spec("av") is None:  # the GPU machine's batches leave PyAV out: the file part needs it
        return
    gif = tmp_path / "one.gif"  # a 1-frame video file: its decoded frame, the same clip
    image.save(gif)
    from_file = vlm_for(arch).generate_video([gif], ["q"], max_new_tokens=3)[0]
    decoded = vlm_for(arch).generate_video([decode_video(gif)[0]], ["q"], max_new_tokens=3)[0]
    assert from_file.visual_tokens == 36 and from_file.token_ids == decoded.token_ids


@pytest.mark.parametrize("method,budget", [(None, None), ("divprune", 3), ("promprune", 5), ("fastv", 5)])
def test_onevision_batch_of_different_frame_counts_is_each_clip_alone(method, budget):
    """OneVision's processor stacks a batch's frames, so clips of 4, 2 and 4 frames are processed and encoded by
    frame count and joined for the LLM: each row gets what the clip gets alone (kept tokens, answer), unpruned
    4 x 4 + 1 and 2 x 4 + 1 visual tokens (4 pooled tokens a frame, one closing newline)."""
    clips = [scene_clip(index=3, frames=4), scene_clip(index=8, frames=2), scene_clip(index=5, frames=4)]
    prompts = ["What moves?", "How many objects?", "Which colour?"]
    vlm = vlm_for("llava_onevision", method, budget)
    batch = vlm.generate_video(clips, prompts, max_new_tokens=4)
    alone = [vlm.generate_video([c], [p], max_new_tokens=4)[0] for c, p in zip(clips, prompts)]
    for b, a in zip(batch, alone):
        assert (b.token_ids, b.kept, b.visual_tokens, b.text_tokens) == (a.token_ids, a.kept, a.visual_tokens,
                                                                         a.text_tokens)
    if method is None:
        assert [g.visual_tokens for g in batch] == [17, 9, 17]
    elif method != "fastv":
        assert [g.visual_tokens for g in batch] == [budget] * 3


# ---- Qwen: 3D positions and DeepStack ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("order", ["raster", "selection"])
def test_qwen_kept_tokens_keep_their_3d_positions(arch, order, clips):
    """Each fed video token carries the (t, h, w) position transformers gives its grid index on the unpruned clip."""
    model = tiny_vlm(arch)[0]
    _, inputs = plain_generate(arch, clips, PROMPTS, 1)
    grids = {k: inputs[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in inputs}
    full, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], **grids,
                                         attention_mask=inputs["attention_mask"])  # [3, B, L]
    vlm = vlm_for(arch, "promprune", 12, token_order=order)
    prep = vlm.prepare_video(clips, PROMPTS)
    ids, pos = prep.model_kwargs["input_ids"], prep.model_kwargs["position_ids"]  # [B, L'], [4, B, L']
    for b, stats in enumerate(prep.stats):
        video_cols = (inputs["input_ids"][b] == model.config.video_token_id).nonzero().flatten()  # grid index order
        fed = (ids[b] == model.config.video_token_id).nonzero().flatten()
        got = pos[1:, b, fed]  # [3, 12]
        expected = full[:, b, video_cols[torch.tensor(sorted(stats["kept"]))]]
        if order == "raster":
            assert torch.equal(got, expected)
        else:  # the same positions, in the selection's order
            assert sorted(map(tuple, got.T.tolist())) == sorted(map(tuple, expected.T.tolist()))


def _video_positions(model, prep, b: int = 0):
    """The (t, h, w) positions ``[3, N]`` of row ``b``'s video tokens as a prepared batch feeds them."""
    ids, pos = prep.model_kwargs["input_ids"][b], prep.model_kwargs["position_ids"][1:, b]
    return pos[:, ids == model.config.video_token_id]


@pytest.mark.parametrize("fps,step", [(0.5, 16), (8.0, 1)])
def test_qwen2_5_clip_rate_sets_its_temporal_positions(fps, step):
    """A Qwen2.5-VL clip's temporal positions advance by ``tokens_per_second * 2 / fps`` a temporal patch (tiny: 4
    tokens a second): transformers' own ``get_rope_index`` on its processor's output for the clip dated by
    ``video_metadata``. The rate was passed as an ``fps`` kwarg the processor does not read with frames fed as given,
    so every clip was dated at 24 fps (t = 7, 7, 7, 8 at either rate)."""
    from promprune.models.video import Clip

    frames = np.stack([np.asarray(f) for f in scene_clip(index=3, frames=8)])
    model, processor = tiny_vlm("qwen2_5_vl")
    vlm = PrunedVLM(model, processor, method=None)
    text = vlm.conversation("What moves?", media="video")
    ref = processor(text=[text], videos=[frames], do_sample_frames=False, return_tensors="pt",
                    video_metadata=dated([frames], [fps]))
    assert ref["second_per_grid_ts"].tolist() == [2 / fps]
    full, _ = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                         video_grid_thw=ref["video_grid_thw"],
                                         second_per_grid_ts=ref["second_per_grid_ts"],
                                         attention_mask=ref["attention_mask"])
    expected = full[:, 0, ref["input_ids"][0] == model.config.video_token_id]
    t = expected[0].view(4, -1)[:, 0]  # 8 frames: 4 temporal patches
    assert (t - t[0]).tolist() == [0, step, 2 * step, 3 * step]
    prep = vlm.prepare_video([Clip(frames, fps)], ["What moves?"])
    assert torch.equal(_video_positions(model, prep), expected)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("method,budget", [(None, None), ("promprune", 8)])
def test_qwen_batch_of_different_rates_is_each_clip_alone(arch, method, budget):
    """Clips of different rates in one batch (MVBench's files differ) are each dated at their own rate: each row's
    video positions and answer are those of the clip alone (Qwen2.5-VL refused such a batch, so every batch failed
    and was retried item by item)."""
    from promprune.models.video import Clip

    clips = [Clip(np.stack([np.asarray(f) for f in scene_clip(index=i, frames=8)]), fps)
             for i, fps in ((3, 0.5), (4, 8.0))]
    prompts = ["What moves?", "How many objects?"]
    vlm = vlm_for(arch, method, budget)
    batch = vlm.prepare_video(clips, prompts)
    answers = vlm.generate_video(clips, prompts, max_new_tokens=3)
    for b, (clip, prompt) in enumerate(zip(clips, prompts)):
        alone = vlm.prepare_video([clip], [prompt])
        assert torch.equal(_video_positions(vlm.model, batch, b), _video_positions(vlm.model, alone))
        assert answers[b].token_ids == vlm.generate_video([clip], [prompt], max_new_tokens=3)[0].token_ids
    if arch == "qwen2_5_vl":  # the two rates give different temporal steps
        steps = [_video_positions(vlm.model, batch, b)[0].unique().diff().tolist() for b in range(2)]
        assert steps == [[16] * 3, [1] * 3]


def test_qwen3_deepstack_rows_follow_the_kept_tokens(clips):
    model = tiny_vlm("qwen3_vl")[0]
    _, inputs = plain_generate("qwen3_vl", clips, PROMPTS, 1)
    with torch.inference_mode():
        ref = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                             return_dict=True)
    vlm = vlm_for("qwen3_vl", "divprune", 12)
    prep = vlm.prepare_video(clips, PROMPTS)
    out = prep.model_kwargs["mm_encoder_outputs"]["video"]
    for b, stats in enumerate(prep.stats):
        kept = torch.tensor(stats["kept"])
        torch.testing.assert_close(out.pooler_output[b], ref.pooler_output[b][kept])
        for layer, rows in enumerate(out.deepstack_features):
            torch.testing.assert_close(rows[b], ref.deepstack_features[layer][b][kept])


# ---- every method --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", VIDEO_ARCHS)
@pytest.mark.parametrize("method", all_methods())
def test_every_method_on_a_clip(arch, method, clips):
    budget = 8
    vlm = vlm_for(arch, method, budget)
    out = vlm.generate_video(clips, PROMPTS, max_new_tokens=2)
    assert len(out) == 2 and all(len(g.token_ids) == 2 for g in out)
    n = PER_FRAME[arch] * VIEWS[arch] + (arch == "llava_onevision")
    for g in out:
        if is_in_llm(method):
            assert 0 < g.visual_tokens <= n
        else:
            assert g.visual_tokens == budget
            assert len(set(g.kept)) == budget


# ---- saliency ------------------------------------------------------------------------------------------------------


def test_onevision_frame_saliency_is_pooled_eager_attention(clips):
    """A frame's token saliency is the mean attention each patch receives at the layer the projector reads (an eager
    twin's attention weights), pooled 4x4 -> 2x2 by torch's bilinear interpolation, as the model pools the tokens."""
    model = tiny_vlm("llava_onevision")[0]
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    vlm = vlm_for("llava_onevision", "saliency_only", 4)
    prep = vlm.prepare_video(clips, PROMPTS)
    pixels = video_inputs(vlm, clips, PROMPTS)["pixel_values_videos"]  # [B, F, 3, 32, 32]
    with torch.inference_mode():
        out = twin.model.vision_tower(pixels.flatten(0, 1), output_attentions=True)
    received = out.attentions[-1].mean(dim=(1, 2)).view(-1, 1, 4, 4)  # [B * F, 1, 4, 4]
    pooled = torch.nn.functional.interpolate(received, size=[2, 2], mode="bilinear").view(2, FRAMES * 4)
    for b, item in enumerate(prep.items):
        torch.testing.assert_close(item.saliency, pooled[b], atol=1e-6, rtol=1e-5)
        assert item.groups.tolist() == [f for f in range(FRAMES) for _ in range(4)]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_qwen_clip_of_one_still_image_is_that_image(arch):
    """Qwen's image path feeds an image as a temporal patch of two equal frames, so a clip of those two frames gives
    the image's tokens, saliency (and DeepStack rows) exactly: the video path adds nothing of its own to them."""
    image = scene_clip(index=5, frames=1)[0].resize((48, 48))
    vlm = vlm_for(arch, "saliency_only", 4)
    image_item = vlm.prepare([image], ["q"]).items[0]
    clip_item = vlm.prepare_video([[image, image]], ["q"]).items[0]
    torch.testing.assert_close(clip_item.features, image_item.features)
    torch.testing.assert_close(clip_item.saliency, image_item.saliency)
    assert clip_item.grid_shape == image_item.grid_shape == (6, 6)
    if arch == "qwen3_vl":
        for a, b in zip(clip_item.deepstack, image_item.deepstack):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("arch", video_families())
def test_beam_search_over_clips_in_a_batch_equals_each_clip_alone(arch):
    """``num_beams=2`` over two clips: each row answers as alone (OneVision's clip features went to ``generate`` as
    one tensor that beam expansion repeated whole, as InternVL's images did)."""
    vlm = vlm_for(arch, "promprune", 8)
    clips = [scene_clip(index=2, frames=2), scene_clip(index=7, frames=2)]  # the tiny OneVision's answers differ
    prompts = ["What is in the picture? Please describe it.", "Colour?"]
    pad = vlm.processor.tokenizer.pad_token_id
    batched = [_unpadded(g.token_ids, pad) for g in vlm.generate_video(clips, prompts, max_new_tokens=6, num_beams=2)]
    alone = [_unpadded(vlm.generate_video([c], [p], max_new_tokens=6, num_beams=2)[0].token_ids, pad)
             for c, p in zip(clips, prompts)]
    assert batched == alone


def _unpadded(ids: list[int], pad: int) -> list[int]:
    """A row's tokens without the padding a batch adds after its end (a row alone has none)."""
    while ids and ids[-1] == pad:
        ids = ids[:-1]
    return ids
