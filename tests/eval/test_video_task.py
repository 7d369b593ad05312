"""The offline video task end to end: requests carrying clips, our path against lmms-eval's evaluator and plugin."""
import numpy as np
import pytest
from lmms_eval.evaluator import simple_evaluate

from promprune.eval import PromPruneLMM, build_requests, run_requests, score
from promprune.eval.tasks import VIDEO_TASKS, load_task, task_manager
from promprune.models import PrunedVLM
from promprune.models.video import DEFAULT_FRAMES, Clip, decode_video
from promprune.records import Prediction, Request, arrow_schema, from_arrow, to_arrow
from promprune.testbed.video_tasks import FRAMES, direction

TASK = VIDEO_TASKS[0]
LIMIT = 4


@pytest.fixture(scope="module")
def rows():
    return build_requests([TASK], limit=LIMIT)


def test_requests_carry_the_sampled_clip(rows):
    """Each row carries its clip (the frames decode_video samples from the document's mp4, losslessly) and no
    image; the prompt is MVBench's; the answer is one of the options and names the asked object's direction."""
    task = load_task(TASK)
    docs = task.dataset["test"]
    assert len(rows) == LIMIT and all(r.image is None and r.image_key is None and r.error is None for r in rows)
    for row in rows:
        doc = docs[row.doc_id]
        clip = Clip.from_bytes(row.video)
        frames, fps = decode_video(doc["video"])
        assert clip.frames.shape == (min(DEFAULT_FRAMES, FRAMES), 96, 96, 3)
        assert np.array_equal(clip.frames, frames) and clip.fps == pytest.approx(fps)
        assert row.prompt.startswith(f"Question:{doc['question']}\nOption:\n(A) ")
        assert doc["answer"] in doc["candidates"].split("|")
    assert direction(3, -1) == "right" and direction(0, -2) == "up" and direction(2, -2) is None


def test_video_frames_sets_how_many_frames_each_clip_carries():
    """``video_frames`` samples that many frames from each document's file (as decode_video does), and the lmms-eval
    plugin's ``video_frames`` model_arg is read the same way; a count below 1 is refused by name."""
    from promprune.eval.lmms_plugin import _video_frames

    docs = load_task(TASK).dataset["test"]
    four = build_requests([TASK], limit=2, video_frames=4)
    for row in four:
        frames, _ = decode_video(docs[row.doc_id]["video"], 4)
        assert np.array_equal(Clip.from_bytes(row.video).frames, frames) and len(frames) == 4
    with pytest.raises(ValueError, match="video_frames must be a positive int, got 0"):
        build_requests([TASK], limit=2, video_frames=0)
    assert _video_frames(None) == DEFAULT_FRAMES and _video_frames("4") == 4
    with pytest.raises(ValueError, match="video_frames='0' must be a positive integer"):
        _video_frames("0")


def test_video_requests_survive_arrow(rows):
    assert "video" in arrow_schema(Request).names and "video" not in arrow_schema(Prediction).names
    back = from_arrow(to_arrow(rows, Request), Request)
    assert [r.video for r in back] == [r.video for r in rows]


def test_video_prefill_flops_count_the_text_the_llm_read(rows):
    """A video sample's prefill FLOPs (the workers' add_efficiency) count the visual tokens kept plus the text tokens
    of the prompt the processor built, Qwen3-VL's per-frame timestamps included (counted here from the processor's
    own output, the clip given as the request carries it)."""
    from pipelines.run.workers import add_efficiency
    from promprune.efficiency import prefill_flops
    from promprune.models.video import inputs as video_inputs

    vlm = PrunedVLM.from_pretrained("tiny:qwen3_vl", method="promprune", budget=8)
    preds = [add_efficiency(vlm, p) for p in run_requests(vlm, rows[:2], batch_size=2)]
    clips = [Clip.from_bytes(r.video) for r in rows[:2]]
    batch = video_inputs(vlm, [c.frames for c in clips], [r.prompt for r in rows[:2]], clips[0].fps)
    video_id = vlm.model.config.video_token_id
    text = ((batch["attention_mask"] == 1) & (batch["input_ids"] != video_id)).sum(1).tolist()
    assert [p.text_tokens for p in preds] == text
    config = vlm.model.config.get_text_config()
    assert [p.prefill_flops for p in preds] == [float(prefill_flops(config, 8 + t)) for t in text]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava_onevision"])
def test_video_task_matches_lmms_eval_evaluator(arch, rows):
    """Our request path (clips in rows, batched) and lmms-eval's evaluator through the plugin (the video file's path)
    give the same answers and the same MVBench accuracy."""
    vlm = PrunedVLM.from_pretrained(f"tiny:{arch}", method="promprune", budget=8)
    ours = run_requests(vlm, rows, batch_size=2)
    assert all(p.error is None and p.visual_tokens == 8 for p in ours)
    reference = simple_evaluate(model=PromPruneLMM(vlm=vlm, batch_size=2), tasks=[TASK], limit=LIMIT,
                                task_manager=task_manager([TASK]), bootstrap_iters=0, log_samples=True)
    samples = {s["doc_id"]: s for s in reference["samples"][TASK]}
    assert {p.doc_id: p.prediction for p in ours} == {d: s["filtered_resps"][0] for d, s in samples.items()}
    mine = score(ours)[TASK]
    assert mine["mvbench_accuracy"] == reference["results"][TASK]["mvbench_accuracy,none"]
    assert mine["n_samples"] == LIMIT and mine["n_failed"] == 0


def test_a_cut_off_clip_is_one_failed_request(tmp_path, monkeypatch):
    """A document whose mp4 is cut off (a faststart mp4, as streamed files are, losing the last 40% of its bytes:
    40 frames stated, 1 decodes) is one request with its error, beside the others, as a cut-off image is; it was
    sampled from the one frame that decoded and answered as a clip."""
    av = pytest.importorskip("av", reason="PyAV writes the clip")
    from promprune.eval import requests
    from promprune.testbed.clips import scene_clip

    whole = tmp_path / "whole.mp4"
    with av.open(str(whole), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 96, "yuv420p"
        for image in scene_clip(index=3, frames=40, step=1):
            out.mux(stream.encode(av.VideoFrame.from_image(image)))
        out.mux(stream.encode())
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: int(whole.stat().st_size * 0.6)])
    read = requests._document

    def document(task, split, doc_id, name):  # document 1's visual is the cut-off file
        doc, error = read(task, split, doc_id, name)
        return ({**doc, "video": str(cut)} if doc is not None and doc_id == 1 else doc), error

    monkeypatch.setattr(requests, "_document", document)
    rows = build_requests([TASK], limit=LIMIT)
    assert [r.doc_id for r in rows if r.error] == [1]
    assert rows[1].error.startswith(f"{TASK} doc 1: unreadable video {cut} (TruncatedVideo: ")
    assert "truncated video: 1 of 40 frames decoded" in rows[1].error
    assert rows[1].video is None and all(r.video for r in rows if not r.error)


def test_a_request_whose_clip_rate_dates_nothing_is_one_failed_sample(rows):
    """A request carrying a clip whose rate is no finite number above 0 (its bytes written by hand: ``Clip`` refuses
    to make one) was answered with nonsense temporal positions on Qwen2.5-VL; it is one failed sample naming the
    rate, the other requests of its batch answered as alone."""
    import dataclasses
    import io

    frames = Clip.from_bytes(rows[1].video).frames
    buffer = io.BytesIO()
    np.savez_compressed(buffer, frames=frames, fps=np.float64(-2.0))
    bad = [rows[0], dataclasses.replace(rows[1], video=buffer.getvalue())]
    vlm = PrunedVLM.from_pretrained("tiny:qwen2_5_vl", method="promprune", budget=8)
    preds = run_requests(vlm, bad, batch_size=2)
    assert preds[0].error is None and preds[1].error == (
        f"{TASK} doc {rows[1].doc_id}: unreadable clip (ValueError: Clip.fps must be a frame rate in frames per "
        "second, a finite number above 0 (or None: unknown), got -2.0)")
    assert preds[0].prediction == run_requests(vlm, rows[:1], batch_size=1)[0].prediction


def test_video_tasks_are_known_from_their_yaml_alone():
    """What the pipeline's preflight refuses a video task on an image-only model by: the offline stand-in (and a
    group with it) is certain to give clips. A task that only sets lmms-eval's ``dataset_kwargs.video`` is flagged,
    not certain, because the flag only makes lmms-eval download data archives: Video-MME gives clips,
    while MixEval-X's image2text tasks and site_bench_image give images. A group of such tasks is flagged too.
    Image tasks are neither."""
    from promprune.eval.tasks import video_task_kind

    assert video_task_kind("testbed_video_direction") == "clips"
    # answered as clips by name (frames_are_clips): a path or frames, a clip either way, so an image-only model is
    # refused up front (a reviewer's case: preflight only noted them, and every sample failed at run time)
    for name in ("mvbench_moving_direction", "mvbench", "vsibench_multiimage"):
        assert video_task_kind(name) == "clips", name
    for name in ("videomme", "mix_evals_image2text_mc", "mix_evals_image2text", "site_bench_image"):
        assert video_task_kind(name) == "flagged", name
    for name in ("easyvqa_yesno", "testbed_exist", "mme", "pope"):
        assert video_task_kind(name) is None, name
    with pytest.raises(ValueError, match="unknown lmms-eval task"):
        video_task_kind("mvbench_moving_directoin")
