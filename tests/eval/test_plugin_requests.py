"""The lmms-eval plugin's requests: decoded a batch at a time, their generation kwargs checked before any is read,
and a video task's clip given as its frames answered as a clip (on both request paths)."""

import textwrap
import weakref

import numpy as np
import pytest
from PIL import Image

from promprune.eval import PromPruneLMM, build_requests, run_requests
from promprune.eval.generation import Item, generate_items
from promprune.eval.requests import document_visual
from promprune.eval.tasks import VIDEO_TASKS, load_task, task_manager
from promprune.models import PrunedVLM
from promprune.models.video import Clip


class _Tracked(Item):
    """The plugin's Item, each one remembered (weakly) as it is made, to count those alive."""

    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Tracked.made.append(weakref.ref(self))


def _held() -> int:
    """The plugin's items alive now that hold pixels (a decoded image or clip; none is in a reference cycle)."""
    return sum(1 for ref in _Tracked.made if (it := ref()) is not None and
               (it.image is not None or isinstance(it.video, Clip)))


def _instances(tasks, limit, **gen):
    """lmms-eval's own requests of ``tasks`` (their first ``limit`` documents), with ``gen`` over their generation
    kwargs, and the data lmms-eval hands the model (``lm.task_dict``)."""
    instances, data = [], {}
    for name in tasks:
        task = load_task(name)
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        for inst in task.instances:
            inst.arguments = (inst.args[0], {**inst.args[1], **gen}, *inst.args[2:])
        instances += task.instances
        data[name] = task.dataset
    return instances, data


@pytest.mark.parametrize("arch, tasks, options", [
    ("qwen2_5_vl", list(VIDEO_TASKS), {}),
    ("llava", ["easyvqa_yesno", "easyvqa_open"], {"vision_once": "true"}),
    ("llava", ["easyvqa_yesno", "easyvqa_open"], {}),
])
def test_the_plugin_holds_a_batch_of_decoded_visuals_however_many_requests(arch, tasks, options, monkeypatch):
    """lmms-eval hands generate_until every request of a run at once, and the plugin decoded every image and clip
    before the first answer (MVBench: ~40 GB). At each generate call now only that batch's items hold pixels, in a
    run of 2 or 3 requests and in one of 7 or 13 alike; the answers are those of the requests decoded up front
    (generate_items without ``load``: the same batches)."""
    from promprune.eval import lmms_plugin

    monkeypatch.setattr(lmms_plugin, "Item", _Tracked)
    vlm = PrunedVLM.from_pretrained(f"tiny:{arch}", method="promprune", budget=8)
    held = []
    for name in ("generate", "generate_video"):
        real = getattr(vlm, name)
        monkeypatch.setattr(vlm, name, lambda *a, _real=real, **k: held.append(_held()) or _real(*a, **k))
    for limit in (1, 6):
        requests, data = _instances(tasks, limit, max_new_tokens=2)
        requests = requests[::2] + requests[1::2] + requests[:1]  # out of task order, one asked twice
        lm = PromPruneLMM(vlm=vlm, batch_size=2, **options)
        lm.task_dict.update(data)
        held.clear()
        answers = lm.generate_until(requests)
        assert held and max(held) == 2 and not lm.failures
        eager = generate_items(vlm, [lm._item(r) for r in requests], batch_size=2, vision_once=lm.vision_once,
                               prefix_cache=lm.prefix_cache, seed=lm.sample_seed)
        assert answers == [a.prediction for a in eager]


def test_an_item_that_fails_as_it_is_read_takes_no_place_in_a_batch(monkeypatch):
    """With ``load``, an item whose picture fails to read is one failed answer and the batches are those of the
    items that read (as when the failing item arrives failed), in input order."""
    vlm = PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8)
    colours = ["red", "green", "blue", "yellow", "purple"]
    items = [Item(f"Colour {i}?", Image.new("RGB", (24, 24), c), {"max_new_tokens": 3}, id=str(i))
             for i, c in enumerate(colours)]
    broken = Item("Colour 1?", None, {"max_new_tokens": 3}, error="doc 1: unreadable image", id="1")
    expected = generate_items(vlm, [items[0], broken, *items[2:]], batch_size=2)
    sizes = []
    real = vlm.generate
    monkeypatch.setattr(vlm, "generate", lambda images, *a, **k: sizes.append(len(images)) or real(images, *a, **k))
    stand_ins = [Item(it.prompt, None, it.gen_kwargs, id=it.id) for it in items]
    got = generate_items(vlm, stand_ins, batch_size=2, load=lambda i: broken if i == 1 else items[i])
    assert [(a.prediction, a.error) for a in got] == [(a.prediction, a.error) for a in expected]
    assert got[1].error == "doc 1: unreadable image" and sizes == [2, 2]  # [0, 2], [3, 4]: item 1 took no place
    with pytest.raises(ValueError, match="item 0 is a stand-in .* with neither id nor key"):
        generate_items(vlm, [Item("q", None, {})], load=lambda i: items[0])


def test_sampling_at_temperature_zero_is_refused_before_any_document_is_read():
    """``lmms-eval --gen_kwargs do_sample=true`` over a task whose YAML sets temperature 0 (VideoMME, MVBench, POPE;
    the offline tasks here): transformers refuses the pair, and every request was answered as a failed sample. One
    error now names the task, the kwargs and the fix, raised before a document is read."""
    from lmms_eval.evaluator import simple_evaluate

    vlm = PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8)
    read = []
    requests, data = _instances(["easyvqa_yesno"], 3, do_sample=True)
    requests = [_recording(r, read) for r in requests]
    lm = PromPruneLMM(vlm=vlm, batch_size=2)
    lm.task_dict.update(data)
    with pytest.raises(ValueError) as refused:
        lm.generate_until(requests)
    message = str(refused.value)
    assert message.startswith("lmms-eval asks task easyvqa_yesno for do_sample=True with temperature=0.0: ")
    assert "--gen_kwargs do_sample=true,temperature=0.7" in message and "leave do_sample out" in message
    assert not read and not lm.failures
    # lmms-eval's own command-line path: --gen_kwargs laid over the task's YAML
    with pytest.raises(ValueError, match="for do_sample=True with temperature=0.0: transformers samples only"):
        simple_evaluate(model=PromPruneLMM(vlm=vlm), tasks=["easyvqa_yesno"], limit=2, gen_kwargs="do_sample=true",
                        task_manager=task_manager(["easyvqa_yesno"]), bootstrap_iters=0)
    # a temperature above 0 samples (answered, none failed)
    requests, _ = _instances(["easyvqa_yesno"], 2, do_sample=True, temperature=0.7, max_new_tokens=2)
    assert len(lm.generate_until(requests)) == 2 and not lm.failures


def test_generation_kwargs_it_cannot_read_are_refused_naming_the_field_before_any_document_is_read():
    """``--gen_kwargs max_new_tokens=lots`` (or a task YAML's): every request would fail reading it. Refused once,
    naming the field and its value (``generation.unreadable_generation``, the rule the pipeline's preflight refuses
    a spec's with), before a document is read."""
    read = []
    requests, data = _instances(["easyvqa_yesno"], 2, max_new_tokens="lots")
    requests = [_recording(r, read) for r in requests]
    lm = PromPruneLMM(vlm=PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8), batch_size=2)
    lm.task_dict.update(data)
    with pytest.raises(ValueError, match=r"lmms-eval asks task easyvqa_yesno for generation kwargs it cannot read "
                                         r"\(max_new_tokens 'lots': ValueError: invalid literal for int\(\)"):
        lm.generate_until(requests)
    assert not read and not lm.failures


def test_beam_search_under_an_in_llm_method_is_refused_once_before_any_document_is_read():
    """PrunedVLM refuses beam search for an in-LLM method on every call: a task (or --gen_kwargs) asking num_beams 2
    failed every request. Refused once, naming the tasks sharing the kwargs; a pre-LLM method still answers it."""
    read = []
    requests, data = _instances(["easyvqa_yesno", "easyvqa_open"], 2, num_beams=2, max_new_tokens=2)
    requests = [_recording(r, read) for r in requests]
    fastv = PromPruneLMM(vlm=PrunedVLM.from_pretrained("tiny:llava", method="fastv", budget=8), batch_size=2)
    fastv.task_dict.update(data)
    with pytest.raises(ValueError) as refused:
        fastv.generate_until(requests)
    message = str(refused.value)
    assert message.startswith("lmms-eval asks tasks easyvqa_yesno, easyvqa_open for num_beams=2: in-LLM method "
                              "'fastv' prunes inside the language model")
    assert "Pass --gen_kwargs num_beams=1" in message and message.count("lmms-eval asks") == 1
    assert not read and not fastv.failures
    promprune = PromPruneLMM(vlm=PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8), batch_size=2)
    promprune.task_dict.update(data)
    assert len(promprune.generate_until(requests)) == 4 and not promprune.failures and read


def _recording(request, read):
    """``request`` with its doc_to_visual recording each document it reads into ``read``."""
    context, gen, doc_to_visual, *rest = request.args

    def recorded(doc):
        read.append(doc)
        return doc_to_visual(doc)

    request.arguments = (context, gen, recorded, *rest)
    return request


def _frames(index, count=8, size=(48, 32)):
    """A clip's frames: a square moving right over ``count`` frames (index shifts the colour)."""
    frames = []
    for t in range(count):
        image = Image.new("RGB", size, (20 * index, 40, 90))
        image.paste((250, 250, 40), (4 * t, 10, 4 * t + 8, 18))
        frames.append(image)
    return frames


def test_a_list_of_frames_is_a_clip_only_where_the_task_gives_clips_as_frames():
    """Frames (a list of images of one size) are a clip in a task that gives clips so (``frames_are_clips``), read
    as a file's frames are picked; several images in another task are refused by a message naming frames."""
    from promprune.eval.requests import read_clip
    from promprune.eval.tasks import frames_are_clips

    frames = _frames(0)
    assert frames_are_clips("mvbench_episodic_reasoning") and frames_are_clips("osi_bench_frames")
    assert not frames_are_clips("site_bench_image") and not frames_are_clips("mix_evals_image2text_mc")
    visual, video, error = document_visual(lambda doc: frames, {}, "mvbench_episodic_reasoning doc 0", True)
    assert video and error is None and visual == frames
    # a multi-image task's images are not a clip: refused, the message naming both readings
    visual, video, error = document_visual(lambda doc: frames, {}, "site_bench_image doc 0", False)
    assert visual is None and not video and error.startswith(
        "site_bench_image doc 0: expected exactly one image, the task gives 8 images: several images of one document "
        "are not answered")
    assert "frames_are_clips" in error
    # frames of different sizes are no clip
    odd = frames[:3] + [frames[3].resize((40, 32))]
    visual, video, error = document_visual(lambda doc: odd, {}, "osi_bench_frames doc 2", True)
    assert not video and error == ("osi_bench_frames doc 2: the task gives a clip as 4 frames of different sizes "
                                   "(frame 0 is 48x32, frame 3 is 40x32); a clip's frames share one size")
    # a path is still a path, and one image of an image task one image
    assert document_visual(lambda doc: ["/x/a.mp4"], {}, "t doc 0", True) == ("/x/a.mp4", True, None)
    assert document_visual(lambda doc: frames[:1], {}, "t doc 0", False) == (frames[0], False, None)
    # the frames read as a file's are sampled: 4 of 8 are frames 0, 2, 4 and 7 (linspace rounded down)
    clip = read_clip(frames, "osi_bench_frames doc 0", 4)
    assert clip.fps is None and np.array_equal(clip.frames, np.stack([np.asarray(frames[k]) for k in (0, 2, 4, 7)]))
    assert np.array_equal(read_clip(frames[:3], "d", 8).frames, np.stack([np.asarray(f) for f in frames[:3]]))


TOY = "mvbench_frames_toy"  # an MVBench task (frames_are_clips) whose documents give their clips as frames


@pytest.fixture
def frames_task(tmp_path, monkeypatch):
    """A task of one's own (include_path) whose doc_to_visual is lmms-eval's mvbench_frames_doc_to_visual (what
    mvbench_episodic_reasoning's YAML offers), reading each clip's frames from its folder under the MVBench cache."""
    import lmms_eval.tasks.mvbench.utils as mvbench

    from promprune.eval.tasks import _write_parquet

    monkeypatch.setattr(mvbench, "base_cache_dir", str(tmp_path / "hf"))  # where the MVBench archives unpack
    root = tmp_path / "hf" / "mvbench_video" / mvbench.DATA_LIST["episodic_reasoning"]
    for index in range(3):
        (root / f"clip{index}").mkdir(parents=True)
        for t, frame in enumerate(_frames(index)):
            frame.save(root / f"clip{index}" / f"{t:03d}.png")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_parquet({"video": [f"clip{i}" for i in range(3)], "question": ["Which way does the square move?"] * 3,
                    "candidates": ["left|right|up"] * 3, "answer": ["right"] * 3}, tasks / "toy.parquet")
    (tasks / f"{TOY}.yaml").write_text(textwrap.dedent(f"""\
        task: {TOY}
        dataset_path: parquet
        dataset_kwargs:
          data_files:
            test: {tasks / "toy.parquet"}
        test_split: test
        output_type: generate_until
        doc_to_visual: !function toy_utils.doc_to_visual
        doc_to_text: !function toy_utils.doc_to_text
        doc_to_target: answer
        process_results: !function toy_utils.process_results
        generation_kwargs:
          max_new_tokens: 3
          temperature: 0
          do_sample: false
        lmms_eval_specific_kwargs:
          default:
            sub_task: episodic_reasoning
            post_prompt: "Only give the best option.\\n"
        metric_list:
          - metric: mvbench_accuracy
            aggregation: !function toy_utils.aggregate_results
            higher_is_better: true
        """))
    (tasks / "toy_utils.py").write_text(textwrap.dedent("""\
        from lmms_eval.tasks.mvbench import utils as mvbench


        def _doc(doc):
            return {**doc, "candidates": doc["candidates"].split("|")}


        def doc_to_visual(doc, lmms_eval_specific_kwargs=None):
            return mvbench.mvbench_frames_doc_to_visual(doc, lmms_eval_specific_kwargs)


        def doc_to_text(doc, lmms_eval_specific_kwargs=None):
            return mvbench.mvbench_doc_to_text(_doc(doc), lmms_eval_specific_kwargs)


        def process_results(doc, results):
            return mvbench.mvbench_process_results(_doc(doc), results)


        def aggregate_results(results):
            return mvbench.mvbench_aggregate_results(results)
        """))
    return str(tasks), mvbench


def test_a_video_tasks_clip_given_as_frames_is_answered_as_a_clip_on_both_paths(frames_task):
    """lmms-eval's mvbench_frames_doc_to_visual gives a clip as its frames (PIL images): every document failed as
    "expected exactly one image, the task gives 8", on the request rows and under the plugin. Each is a clip now:
    the rows carry the frames the task gave, and lmms-eval's evaluator through the plugin answers what
    PrunedVLM.generate_video answers about those frames (and what the rows are answered)."""
    from lmms_eval.evaluator import simple_evaluate

    include, mvbench = frames_task
    rows = build_requests([TOY], include_path=include)
    docs = load_task(TOY, include).dataset["test"]
    given = [mvbench.mvbench_frames_doc_to_visual(doc, {"sub_task": "episodic_reasoning"}) for doc in docs]
    assert [r.error for r in rows] == [None] * 3
    for row, frames in zip(rows, given):
        assert np.array_equal(Clip.from_bytes(row.video).frames, np.stack([np.asarray(f) for f in frames]))
    vlm = PrunedVLM.from_pretrained("tiny:qwen2_5_vl", method="promprune", budget=8)
    reference = [g.text for g in vlm.generate_video(given[:2], [r.prompt for r in rows[:2]], max_new_tokens=3)]
    reference += [g.text for g in vlm.generate_video(given[2:], [rows[2].prompt], max_new_tokens=3)]
    lm = PromPruneLMM(vlm=vlm, batch_size=2)
    out = simple_evaluate(model=lm, tasks=[TOY], task_manager=task_manager([TOY], include), bootstrap_iters=0,
                          log_samples=True)
    assert not lm.failures
    assert [s["resps"][0][0] for s in sorted(out["samples"][TOY], key=lambda s: s["doc_id"])] == reference
    assert [p.prediction for p in run_requests(vlm, rows, batch_size=2)] == reference
