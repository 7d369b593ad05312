"""A batch of differently sized images gives each item what it gets alone."""
import pytest

from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm

from .conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", [None, "promprune", "vispruner", "fastv", "sparsevlm", "dart", "pyramiddrop"])
def test_batch_equals_single_items(arch, method, images, prompts):
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method=method, budget=None if method is None else 6)
    batched = vlm.generate(images, prompts, max_new_tokens=5)
    singles = [vlm.generate([img], [p], max_new_tokens=5)[0] for img, p in zip(images, prompts)]
    assert [g.token_ids for g in batched] == [g.token_ids for g in singles]
    assert [g.kept for g in batched] == [g.kept for g in singles]
    if arch != "llava":  # the two images really have different token counts there
        full = PrunedVLM(model, processor, method=None).prepare(images, prompts)
        assert full.stats[0]["visual_tokens"] != full.stats[1]["visual_tokens"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method,mode", [("promprune", "per_crop"), ("promprune", "adaptive_views"),
                                         ("visionzip", "per_crop"), ("divprune", "adaptive_views")])
def test_an_image_keeps_its_order_in_any_batch(arch, method, mode):
    """With a token order other than raster (the specs' `released`: selection order, VisionZip's stages) an image's
    kept tokens are fed view after view in view order, whatever images share its batch: the views' parts had been
    joined in the order the batch's buckets formed, so a square image before a wide one reordered the wide one's
    views (same set, another LLM input, another answer: LLaVA-OneVision, 2026-12-06)."""
    from .conftest import make_image

    square, wide, tall = make_image(64, 64, 5), make_image(40, 56, 0), make_image(64, 30, 1)
    model, processor = tiny_vlm(arch)
    try:
        vlm = PrunedVLM(model, processor, method=method, budget=12, token_order="released", budget_mode=mode)
    except ValueError as exc:  # a family without views refuses a view mode; nothing to order
        pytest.skip(str(exc))
    alone = vlm.generate([wide], ["Is there a cat?"], max_new_tokens=4)[0]
    for batch in ([square, wide], [tall, square, wide], [wide, tall][::-1] + [square]):
        row = next(i for i, im in enumerate(batch) if im is wide)
        got = vlm.generate(batch, ["Colour?"] * row + ["Is there a cat?"] + ["Why?"] * (len(batch) - row - 1),
                           max_new_tokens=4)[row]
        assert got.kept == alone.kept and got.token_ids == alone.token_ids


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", [None, "promprune"])
def test_beam_search_in_a_batch_equals_each_row_alone(arch, method, images, prompts):
    """``num_beams=2`` over two images: each row answers as alone, and unpruned as plain transformers' generate on the
    same processor batch. InternVL's features went to ``generate`` as one ``[1, sum M, d]`` tensor, which beam
    expansion repeated whole (r0, r1, r0, r1), so row 0's second beam and row 1's beams read the wrong image."""
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method=method, budget=None if method is None else 8)
    prompts = ["What is in the picture? Please describe it.", prompts[1]]  # rows of different lengths
    pad = processor.tokenizer.pad_token_id
    batched = [g.token_ids for g in vlm.generate(images, prompts, max_new_tokens=5, num_beams=2)]
    alone = [vlm.generate([im], [p], max_new_tokens=5, num_beams=2)[0].token_ids for im, p in zip(images, prompts)]
    assert [_unpadded(ids, pad) for ids in batched] == [_unpadded(ids, pad) for ids in alone]
    if method is None and arch == "internvl":  # plain transformers on the same batch
        inputs = vlm.inputs(images, prompts)
        out = model.generate(**inputs, max_new_tokens=5, num_beams=2, do_sample=False)
        assert out[:, inputs["input_ids"].shape[1]:].tolist() == batched


def _unpadded(ids: list[int], pad: int) -> list[int]:
    """A row's tokens without the padding a batch adds after its end (a row alone has none)."""
    while ids and ids[-1] == pad:
        ids = ids[:-1]
    return ids
