"""Generation over request rows: kwargs mapping, stop strings, corrupt images and failing generations isolated."""

import dataclasses
import io
import os

import pytest
from PIL import Image

from promprune.eval import run_requests
from promprune.eval.generation import (
    cut_at_stop, decode_image, generate_kwargs, sampling_problem, sharing_options, unreadable_generation)
from promprune.models import PrunedVLM
from promprune.models.sharing import ImageCache
from promprune.records import Prediction, Request


def _png(color, size=(24, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _rows(n=5):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 200, 0), (0, 90, 200), (10, 10, 10)]
    return [
        Request(task="t", doc_id=i, n_docs=n, prompt=f"what colour is shape {i}?", image=_png(colors[i]),
                gen_kwargs={"max_new_tokens": 4, "temperature": 0, "do_sample": False, "until": ["\n\n"]})
        for i in range(n)
    ]


class FailOnPrompt(PrunedVLM):
    """The real tiny adapter, except that a batch holding a prompt with 'FAIL' in it raises (a failing generation)."""

    def generate(self, images, prompts, **kwargs):
        if any("FAIL" in p for p in prompts):
            raise RuntimeError("CUDA error: device-side assert (simulated)")
        return super().generate(images, prompts, **kwargs)


@pytest.fixture(scope="module")
def tiny_llava():
    return PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8)


def test_generate_kwargs_follow_lmms_eval_semantics():
    kwargs, until = generate_kwargs({"max_new_tokens": 16, "temperature": 0.2, "top_p": 1.0, "num_beams": 1,
                                     "do_sample": False, "until": "\n\n", "image_aspect_ratio": "pad"})
    assert kwargs == {"max_new_tokens": 16, "num_beams": 1, "do_sample": False}  # greedy: no sampling knobs
    # the blank line (lmms-eval's default `until` for a task that sets none) is dropped, as lmms-eval's qwen2_5_vl /
    # qwen3_vl / gemma4 models drop it: it used to cut MM-Vet's step-by-step answers at their first paragraph
    assert until == []
    assert generate_kwargs({"until": ["\n\n", "ASSISTANT:", "\n"]})[1] == ["ASSISTANT:", "\n"]  # the others apply
    kwargs, until = generate_kwargs({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "until": None})
    # a task without max_new_tokens (TextVQA, VizWiz) gets lmms-eval's HF LLaVA default, not transformers' 20
    assert kwargs == {"max_new_tokens": 1024, "do_sample": True, "temperature": 0.7, "top_p": 0.9} and until == []
    # top_k with sampling, repetition_penalty either way: the spec's `generation` takes them (they were dropped)
    kwargs, _ = generate_kwargs({"do_sample": True, "temperature": 0.5, "top_k": 5, "repetition_penalty": 1.3})
    assert kwargs == {"max_new_tokens": 1024, "repetition_penalty": 1.3, "do_sample": True, "temperature": 0.5,
                      "top_k": 5}
    assert generate_kwargs({"top_k": 5, "repetition_penalty": 1.3})[0] == {
        "max_new_tokens": 1024, "repetition_penalty": 1.3, "do_sample": False}
    assert sampling_problem({"do_sample": True, "temperature": "hot"}).startswith("temperature 'hot' is not a number")
    assert sampling_problem({"do_sample": True, "temperature": 0}).startswith("do_sample: true with temperature 0")
    assert sampling_problem({"do_sample": False, "temperature": 0}) is None
    # seeded sampling draws one sequence per sample: sampled beam search fails every sample, so the spec check says so
    assert sampling_problem({"do_sample": True, "temperature": 0.7, "num_beams": 3}).startswith(
        "do_sample: true with num_beams 3")
    assert sampling_problem({"do_sample": True, "temperature": 0.7, "num_beams": 1}) is None
    assert sampling_problem({"do_sample": False, "num_beams": 3}) is None
    assert cut_at_stop("yes\nUSER: more", ["\n"]) == "yes"
    assert cut_at_stop("a.b;c", [";", "."]) == "a"


@pytest.mark.parametrize("gen_kwargs, fields", [
    ({"num_beams": "x", "max_new_tokens": 4}, ["num_beams"]),
    ({"max_new_tokens": "lots", "until": 5}, ["max_new_tokens", "until"]),
    ({"do_sample": True, "temperature": "hot", "top_k": "a", "top_p": 0.9}, ["temperature", "top_k"]),
    ({"temperature": "hot"}, []),  # not sampled: generate_kwargs never reads it
    ({"max_new_tokens": "16", "num_beams": 2, "repetition_penalty": "1.1", "until": ["\n"]}, []),
    ({"do_sample": "maybe", "max_new_tokens": 4}, ["do_sample"]),
    ({"max_new_tokens": float("inf")}, ["max_new_tokens"]),  # int(inf): OverflowError, a refusal, not a crash
    ({"do_sample": True, "top_k": float("inf"), "num_beams": float("nan")}, ["top_k", "num_beams"]),
    ({"do_sample": 2}, ["do_sample"]),
])
def test_unreadable_generation_names_the_fields_generate_kwargs_fails_on(gen_kwargs, fields):
    """The rule the pipeline's preflight and the lmms-eval plugin refuse generation with: the fields
    ``generate_kwargs`` cannot read, each named. Without them generate_kwargs reads the rest; with any one of them it
    fails."""
    assert list(unreadable_generation(gen_kwargs)) == fields
    generate_kwargs({k: v for k, v in gen_kwargs.items() if k not in fields})
    for field in fields:
        with pytest.raises((TypeError, ValueError, OverflowError)):
            generate_kwargs({k: v for k, v in gen_kwargs.items() if k not in fields or k == field})


@pytest.mark.parametrize("given, sampled", [("false", False), ("False", False), ("no", False), ("0", False), (0, False),
                                           (False, False), ("true", True), ("YES", True), (1, True), (True, True)])
def test_do_sample_is_read_as_a_flag_not_by_truthiness(given, sampled):
    """A quoted ``do_sample: "false"`` (a spec, a command line) is greedy: ``bool("false")`` is True, and such a
    spec sampled. ``sampling_problem`` reads it the same way (a temperature of 0 is refused only when sampling)."""
    assert generate_kwargs({"do_sample": given})[0]["do_sample"] is sampled
    assert (sampling_problem({"do_sample": given, "temperature": 0}) is not None) is sampled


# MM-Vet's generation kwargs as lmms-eval builds them: no `until` in mmvet.yaml, so the task's default ["\n\n"]
MMVET_KWARGS = {"max_new_tokens": 4, "temperature": 0.2, "top_p": 1.0, "num_beams": 1, "do_sample": False,
                "until": ["\n\n"]}
STEP_BY_STEP = "First, the image shows a sign.\n\nThe sign reads 'STOP', so the answer is STOP."


def test_answers_are_not_cut_at_a_blank_line_on_either_path(monkeypatch):
    """The sweep's requests and the lmms-eval plugin keep a step-by-step answer whole, as lmms-eval's own models do
    (llava / llava_hf never apply `until`, qwen2_5_vl / qwen3_vl / gemma4 drop "\n\n"); the decoded text stands in
    for what the model generated. Before, both cut it to its first paragraph."""
    from lmms_eval.api.instance import Instance

    from promprune.eval.lmms_plugin import PromPruneLMM

    vlm = PrunedVLM.from_pretrained("tiny:llava", method=None)
    monkeypatch.setattr(vlm.processor, "batch_decode", lambda ids, **kw: [STEP_BY_STEP] * len(ids))
    row = dataclasses.replace(_rows(1)[0], gen_kwargs=dict(MMVET_KWARGS))
    assert run_requests(vlm, [row])[0].prediction == STEP_BY_STEP
    lm = PromPruneLMM(vlm=vlm)
    lm.task_dict = {"mmvet": {"test": [{"image": Image.new("RGB", (32, 32), "red")}]}}
    args = ("What does the sign say?", dict(MMVET_KWARGS), lambda d: [d["image"]], 0, "mmvet", "test")
    request = Instance("generate_until", args, idx=0, metadata={"task": "mmvet", "doc_id": 0, "repeats": 1})
    assert lm.generate_until([request]) == [STEP_BY_STEP] and not lm.failures
    # a task's own stop strings still cut (TextVQA's and MMBench's "ASSISTANT:")
    row = dataclasses.replace(row, gen_kwargs={**MMVET_KWARGS, "until": ["\n\n", "so the answer"]})
    assert run_requests(vlm, [row])[0].prediction == "First, the image shows a sign.\n\nThe sign reads 'STOP', "


def test_decode_image_names_the_item():
    with pytest.raises(ValueError, match="easyvqa_open doc 7: unreadable image"):
        decode_image(_png((1, 2, 3))[:60], "easyvqa_open doc 7")
    with pytest.raises(ValueError, match="doc 3: image must be PNG/JPEG bytes"):
        decode_image(None, "doc 3")
    assert decode_image(_png((1, 2, 3)), "ok").getpixel((0, 0)) == (1, 2, 3)


def test_every_row_yields_one_result_in_order(tiny_llava):
    rows = _rows()
    out = run_requests(tiny_llava, rows, batch_size=2)
    assert [(r.task, r.doc_id) for r in out] == [(r.task, r.doc_id) for r in rows]
    for row in out:
        assert isinstance(row, Prediction) and "image" not in {f.name for f in dataclasses.fields(row)}
        assert row.error is None and isinstance(row.prediction, str)
        assert row.visual_tokens == 8 and len(row.kept) == 8
        assert row.prefill_ms > 0 and row.peak_mem_mb > 0


def test_corrupt_image_becomes_one_failed_sample(tiny_llava):
    rows = _rows()
    clean = run_requests(tiny_llava, rows, batch_size=1)
    rows[2].image = rows[2].image[:50]
    out = run_requests(tiny_llava, rows, batch_size=1)
    assert out[2].prediction == "" and "t doc 2: unreadable image" in out[2].error
    assert [r.prediction for i, r in enumerate(out) if i != 2] == [r.prediction for i, r in enumerate(clean) if i != 2]
    assert all(r.error is None for i, r in enumerate(out) if i != 2)


def test_failing_batch_is_retried_item_by_item():
    vlm = FailOnPrompt.from_pretrained("tiny:llava", method="promprune", budget=8)
    rows = _rows(6)
    reference = run_requests(vlm, rows, batch_size=1)
    rows[4].prompt = "FAIL here"
    out = run_requests(vlm, rows, batch_size=3)  # the second batch (3, 4, 5) fails as a whole, then item by item
    assert len(out) == 6
    assert out[4].prediction == "" and "RuntimeError: CUDA error" in out[4].error
    for i in (0, 1, 2, 3, 5):
        assert out[i].error is None
    # items retried alone (3, 5) generate exactly what they generate alone
    assert out[3].prediction == reference[3].prediction and out[5].prediction == reference[5].prediction


def test_rows_with_an_error_from_the_driver_are_not_generated(tiny_llava):
    rows = _rows(2)
    rows[0] = dataclasses.replace(rows[0], image=None, error="t doc 0: expected exactly one image, the task gives 2")
    out = run_requests(tiny_llava, rows)
    assert out[0].error.startswith("t doc 0: expected exactly one image") and out[0].prediction == ""
    assert out[1].error is None
    with pytest.raises(TypeError, match="item 0 is dict"):
        run_requests(tiny_llava, [{"task": "t", "doc_id": 0}])


# ---------------------------------------------------------------------------------------------------------------
# vision once / prefix once over the questions of one image


def _shared_rows():
    """Six questions about two images (one image's questions split by the other's), as requests carry them: the
    PNG and its key."""
    from promprune.eval.requests import image_key

    pictures = [Image.new("RGB", (24, 24), (255, 0, 0)), Image.new("RGB", (30, 20), (0, 90, 200))]
    which = [0, 0, 1, 0, 1, 1]
    return [Request(task="t", doc_id=i, n_docs=6, prompt=f"question {i} about it?", image=_png_of(pictures[w]),
                    image_key=image_key(pictures[w]), gen_kwargs={"max_new_tokens": 5, "until": ["\n\n"]})
            for i, w in enumerate(which)]


def _png_of(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _answers(preds):
    return [(p.prediction, p.visual_tokens, p.kept, p.text_tokens, p.error) for p in preds]


@pytest.mark.parametrize("method,budget", [(None, None), ("promprune", 8), ("cdpruner", 8)])
def test_sharing_options_give_the_same_answers(method, budget):
    vlm = PrunedVLM.from_pretrained("tiny:llava", method=method, budget=budget)
    rows = _shared_rows()
    off = run_requests(vlm, rows, batch_size=2, vision_once=False, prefix_cache=False)
    assert _answers(run_requests(vlm, rows, batch_size=2, vision_once=True, prefix_cache=False)) == _answers(off)
    assert _answers(run_requests(vlm, rows, batch_size=2)) == _answers(off)  # both on: the default
    # vision_once off alone: the prefix cache, which needs it, follows (was a ValueError naming prefix_cache)
    assert _answers(run_requests(vlm, rows, batch_size=2, vision_once=False)) == _answers(off)


def test_sharing_options_come_from_the_rows_and_never_reach_generate():
    assert sharing_options({}, True, True) == (True, True)
    assert sharing_options({"prefix_cache": False, "vision_once": None}, True, True) == (True, False)
    assert sharing_options({"vision_once": False, "prefix_cache": False}, True, True) == (False, False)
    with pytest.raises(ValueError, match="prefix_cache continues each image's cached prompt prefix"):
        sharing_options({"vision_once": False}, True, True)
    with pytest.raises(ValueError, match="vision_once must be true or false, got 'yes'"):
        sharing_options({"vision_once": "yes"}, True, True)
    kwargs, _ = generate_kwargs({"max_new_tokens": 3, "vision_once": True, "prefix_cache": True})
    assert kwargs == {"max_new_tokens": 3, "do_sample": False}


class Recording(ImageCache):
    """The cache ``generate_items`` keeps, recording what it frees and when (how many items were answered by then)."""

    log: list = []

    def release(self, key):
        Recording.log.append((key, len(self.images)))
        super().release(key)


def test_an_image_is_encoded_once_and_freed_after_its_last_question(monkeypatch):
    import promprune.eval.generation as generation

    vlm = PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8)
    calls = []
    encode = vlm.adapter.encode
    monkeypatch.setattr(vlm.adapter, "encode", lambda batch, *a, **k: calls.append(len(batch["pixel_values"]))
                        or encode(batch, *a, **k))
    monkeypatch.setattr(generation, "ImageCache", Recording)
    Recording.log = []
    rows = _shared_rows()
    # a row's gen_kwargs choose, as a spec's generation does; the batches of 2: [0, 1], [3, 2] (by image), [4, 5]
    rows = [dataclasses.replace(r, gen_kwargs={**r.gen_kwargs, "prefix_cache": True}) for r in rows]
    out = run_requests(vlm, rows, batch_size=2, vision_once=True, prefix_cache=False)
    assert all(p.error is None for p in out)
    assert calls == [1, 1]  # each image once: the first in the first batch, the second in the second
    assert [key for key, _ in Recording.log] == [rows[0].image_key, rows[2].image_key]
    assert Recording.log[0][1] == 2  # the first image is freed after the second batch, with both cached


def test_the_plugins_items_are_grouped_by_image():
    """Items about one image that are not neighbours (lmms-eval's task order) are batched together when shared."""
    from promprune.eval.generation import Item, generate_items

    vlm = PrunedVLM.from_pretrained("tiny:llava", method="divprune", budget=6)
    red, blue = Image.new("RGB", (24, 24), (255, 0, 0)), Image.new("RGB", (24, 24), (0, 0, 255))
    items = [Item(f"q{i}?", img, {"max_new_tokens": 4}, key=k)
             for i, (img, k) in enumerate([(red, "r"), (blue, "b"), (red, "r"), (blue, "b"), (red, "r")])]
    alone = generate_items(vlm, items, batch_size=1)
    shared = generate_items(vlm, items, batch_size=1, vision_once=True, prefix_cache=True)
    assert [a.prediction for a in shared] == [a.prediction for a in alone]


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_a_context_holding_the_image_tag_is_answered_as_the_plain_question(arch):
    """lmms-eval's egothink_* contexts place the image themselves (``USER: <image>\\n...``): the tag is removed, so the
    image goes where the family's chat template puts it, once, and the answer is the plain question's. On LLaVA
    every such request failed ("Found total 2 <image> tokens and 1 images"); Qwen read the tag as text."""
    from lmms_eval.api.instance import Instance

    from promprune.eval.lmms_plugin import PromPruneLMM

    lm = PromPruneLMM(pretrained=f"tiny:{arch}", method="promprune", budget=8, batch_size=2)
    lm.task_dict = {"toy": {"test": [{"image": Image.new("RGB", (32, 32), "red")}]}}
    contexts = ["USER: <image>\nIs it red? ASSISTANT:", "USER: Is it red? ASSISTANT:", "<image>\nIs it red?",
                "Is it red?"]
    requests = [Instance("generate_until", (c, {"max_new_tokens": 6}, lambda d: [d["image"]], 0, "toy", "test"),
                         idx=0, metadata={"task": "toy", "doc_id": 0, "repeats": 1}) for c in contexts]
    answers = lm.generate_until(requests)
    assert not lm.failures
    assert answers[0] == answers[1] and answers[2] == answers[3]
    plain = lm.vlm.generate([Image.new("RGB", (32, 32), "red")] * 2, contexts[1::2], max_new_tokens=6)
    assert answers[1::2] == [g.text for g in plain]  # the plain questions' answers are PrunedVLM's own
    assert lm.vlm.conversation(contexts[0]) == lm.vlm.conversation(contexts[1])
    assert lm.vlm.conversation(contexts[2]) == lm.vlm.conversation(contexts[3])


# ----------------------------------------------------------------------------------------------------------------
# sampled generation, seeded


def _sampled(rows, **extra):
    return [dataclasses.replace(r, gen_kwargs={"max_new_tokens": 4, "do_sample": True, "temperature": 30.0,
                                               "until": ["\n\n"], **extra}) for r in rows]


def test_sampled_answers_depend_on_the_seeds_and_samples_not_on_what_the_process_drew_before(tiny_llava):
    """A sampled batch used to draw from the process's torch RNG as it stood: two runs of one spec gave different
    answers, and a trial answered after another on the same worker got other answers than alone. Seeded, each
    sample's draws come from (the caller's seed, the spec's generation.seed, its sample key) and the process's RNG is
    left as it was."""
    import torch

    rows = _sampled(_rows(4))
    torch.manual_seed(1)
    first = _answers(run_requests(tiny_llava, rows, batch_size=2, seed="fastv-b16"))
    torch.manual_seed(2)
    torch.rand(1000)  # another trial's draws on the same worker
    state = torch.get_rng_state()
    again = _answers(run_requests(tiny_llava, rows, batch_size=2, seed="fastv-b16"))
    assert again == first
    assert torch.equal(torch.get_rng_state(), state)  # nothing leaks into what runs next
    # another trial (a repeat: its id differs) or another generation.seed draws other answers (temperature 30: the
    # tiny model's 4 tokens drawn near uniformly from its vocabulary, so equal answers would be a seeding bug)
    assert _answers(run_requests(tiny_llava, rows, batch_size=2, seed="fastv-b16-r1")) != first
    assert _answers(run_requests(tiny_llava, _sampled(_rows(4), seed=1), batch_size=2, seed="fastv-b16")) != first
    # without any seed (generate_items / run_requests called without one) a batch draws from the process's RNG
    torch.manual_seed(3)
    unseeded = _answers(run_requests(tiny_llava, rows, batch_size=2))
    torch.manual_seed(3)
    assert _answers(run_requests(tiny_llava, rows, batch_size=2)) == unseeded


def test_a_sampled_answer_does_not_depend_on_the_batch_size_the_order_or_the_batch_mates(tiny_llava):
    """Sampled batches were seeded per batch (from the trial's id and the batch's sample keys): a question's sampled
    answer changed with the batch size, the order the requests came in (the by-image grouping) and which questions
    shared its batch, a worker's shard. Each sample now draws from its own stream (the seeds and its key): the same
    answers at batch sizes 1, 2 and 4, shuffled, without the image sharing, and with a subset of the requests; another
    trial id or generation.seed draws others. Prompts of several lengths (left padding) and two questions per image."""
    import random

    rows = _rows(6)
    rows = [dataclasses.replace(r, prompt=r.prompt + " Please answer." * (i % 3), image=rows[i // 2 * 2].image,
                                image_key=f"img{i // 2}") for i, r in enumerate(rows)]
    rows = _sampled(rows, top_k=60, top_p=0.95)

    def by_key(preds):
        assert not any(p.error for p in preds)
        return {p.key: p.prediction for p in preds}

    first = by_key(run_requests(tiny_llava, rows, batch_size=1, seed="fastv-b16"))
    assert len(set(first.values())) == 6
    for batch_size in (2, 4):
        assert by_key(run_requests(tiny_llava, rows, batch_size=batch_size, seed="fastv-b16")) == first
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    assert by_key(run_requests(tiny_llava, shuffled, batch_size=4, seed="fastv-b16")) == first
    assert by_key(run_requests(tiny_llava, shuffled, batch_size=3, seed="fastv-b16", vision_once=False)) == first
    part = by_key(run_requests(tiny_llava, shuffled[1:4], batch_size=2, seed="fastv-b16"))
    assert part == {k: first[k] for k in part}
    # other seeds: other answers somewhere (temperature 30: 4 tokens near uniform over the top 60 of each step)
    other = by_key(run_requests(tiny_llava, rows, batch_size=2, seed="fastv-b16-r1"))
    assert sum(other[k] != first[k] for k in first) >= 5
    spec_seed = by_key(run_requests(tiny_llava, _sampled(rows, top_k=60, top_p=0.95, seed=1), batch_size=2,
                                   seed="fastv-b16"))
    assert sum(spec_seed[k] != first[k] for k in first) >= 5


def test_a_request_asked_twice_draws_twice_the_same_way_in_any_batch(tiny_llava):
    """Two items with one identity (lmms-eval asks a task's repeats as copies of one request) draw from streams of
    their own, told apart by their repeat (the first, the second), not by the batch they land in."""
    from promprune.eval.generation import Item, generate_items

    image = Image.new("RGB", (32, 32), "red")
    kwargs = {"max_new_tokens": 4, "do_sample": True, "temperature": 30.0}
    items = [Item("What colour?", image, kwargs, id="t/0"), Item("Any shape?", image, kwargs, id="t/1"),
             Item("What colour?", image, kwargs, id="t/0")]
    answers = [a.prediction for a in generate_items(tiny_llava, items, batch_size=3, seed="s")]
    assert answers[0] != answers[2]
    assert [a.prediction for a in generate_items(tiny_llava, items, batch_size=1, seed="s")] == answers
    swapped = [a.prediction for a in generate_items(tiny_llava, items[1:] + items[:1], batch_size=2, seed="s")]
    assert swapped == [answers[1], answers[0], answers[2]]  # copies are interchangeable: the first asked draws first


def test_items_without_an_id_or_key_are_told_apart_by_their_pictures(tiny_llava):
    """An item with neither id nor key (generate_items called directly, seed given) was known by its prompt alone:
    two such questions about different images were one request asked twice, so each one's draws followed the order
    of the items (the first asked drew the first stream). Their pictures now tell them apart: an image's (and a
    clip's) sampled answer is the same in either order and alone; one picture asked twice still draws twice."""
    import numpy as np

    from promprune.eval.generation import Item, generate_items, sample_seeds
    from promprune.models.video import Clip

    kwargs = {"max_new_tokens": 4, "do_sample": True, "temperature": 30.0}
    red, blue = Image.new("RGB", (32, 32), "red"), Image.new("RGB", (32, 32), "blue")

    def answers(*images):
        return [a.prediction for a in generate_items(tiny_llava, [Item("What colour?", im, kwargs) for im in images],
                                                     batch_size=2, seed="s")]

    first = answers(red, blue)
    assert answers(blue, red) == first[::-1]
    assert answers(red) == first[:1]
    twice = answers(red, red)
    assert twice[0] == first[0] and twice[1] != twice[0]
    # clips (seeds alone: no model needed), and an image given as a copy of equal pixels
    clips = [Clip(np.full((2, 8, 8, 3), value, np.uint8), 2.0) for value in (0, 255)]
    clip_items = [Item("What moves?", None, kwargs, video=clip) for clip in clips]
    assert sample_seeds("s", clip_items) == sample_seeds("s", clip_items[::-1])[::-1]
    assert sample_seeds("s", [Item("What colour?", red.copy(), kwargs)]) == \
        sample_seeds("s", [Item("What colour?", red, kwargs)])


def test_greedy_answers_are_untouched_by_the_seed(tiny_llava):
    """Greedy decoding draws nothing: a seed changes neither its tokens nor the process's RNG."""
    import torch

    rows = _rows(4)
    plain = run_requests(tiny_llava, rows, batch_size=2)
    state = torch.get_rng_state()
    seeded = run_requests(tiny_llava, [dataclasses.replace(r, gen_kwargs={**r.gen_kwargs, "seed": 5}) for r in rows],
                          batch_size=2, seed="t")
    assert _answers(seeded) == _answers(plain)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_a_batchs_cpu_peak_memory_is_its_own_not_what_the_process_held_before(tiny_llava):
    """On CPU a sample's peak_mem_mb was the process's lifetime high-water mark: on a warm worker a light trial after
    a hungry one reported the hungry one's peak (and the model load's). A 512 MiB array held and freed before the
    batch no longer shows in it."""
    from promprune.efficiency import MIB, peak_memory_mb, reset_peak_memory

    reset_peak_memory("cpu")
    held = bytearray(512 * MIB)
    held[::4096] = b"\1" * len(held[::4096])  # every page touched: resident
    hungry = peak_memory_mb("cpu")
    del held
    peaks = [p.peak_mem_mb for p in run_requests(tiny_llava, _rows(2), batch_size=2)]
    assert all(10 < peak < hungry - 400 for peak in peaks)
