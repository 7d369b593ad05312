"""Generation over request rows: kwargs mapping, stop strings, corrupt images and failing generations isolated."""

import dataclasses
import io

import pytest
from PIL import Image

from promprune.eval import run_requests
from promprune.eval.generation import cut_at_stop, decode_image, generate_kwargs
from promprune.models import PrunedVLM
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
    assert until == ["\n\n"]
    kwargs, until = generate_kwargs({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "until": None})
    # a task without max_new_tokens (TextVQA, VizWiz) gets lmms-eval's HF LLaVA default, not transformers' 20
    assert kwargs == {"max_new_tokens": 1024, "do_sample": True, "temperature": 0.7, "top_p": 0.9} and until == []
    assert cut_at_stop("yes\n\nUSER: more", ["\n\n"]) == "yes"
    assert cut_at_stop("a.b;c", [";", "."]) == "a"


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
