"""A batch of differently sized images gives each item what it gets alone."""
import pytest
import torch

import promprune
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


def test_view_entropies_are_each_views_exact_entropy_in_one_batch():
    """``adaptive_views``' weights (``batched_select._view_entropies``): views of several sizes (N <= d: the Gram;
    N > d: the covariance) batched by size give each view's ``promprune.spectral_entropy`` alone (the values the loop
    per view gave); a view with NaN does not stop the others (the buckets' finiteness check refuses the batch after)."""
    from types import SimpleNamespace

    import numpy as np

    from promprune.models.batched_select import Unit, _view_entropies

    gen = torch.Generator().manual_seed(0)
    feats = [torch.randn(40, 32, generator=gen) @ torch.randn(32, 32, generator=gen),
             torch.randn(50, 16, generator=gen, dtype=torch.float64).float()]
    items = [SimpleNamespace(features=f) for f in feats]
    sizes = {0: [(0, 10), (10, 34), (34, 40)], 1: [(0, 30), (30, 50)]}  # 10, 24, 6 of d 32; 30 (> d 16), 20
    per_view = {b: [Unit(b, np.arange(lo, hi), 0, v, whole=False, dev=torch.arange(lo, hi))
                    for v, (lo, hi) in enumerate(spans)] for b, spans in sizes.items()}
    want = {b: [float(promprune.spectral_entropy(u.take(feats[b])[None])[0]) for u in units]
            for b, units in per_view.items()}
    got = _view_entropies(items, per_view)
    assert got.keys() == want.keys()
    for b in want:
        assert got[b] == pytest.approx(want[b], rel=1e-6, abs=1e-7), (b, got[b], want[b])
    feats[0][12, 3] = float("nan")  # in the second view of item 0
    with_nan = _view_entropies(items, per_view)
    assert with_nan[1] == got[1] and with_nan[0][0] == got[0][0] and with_nan[0][2] == got[0][2]
    assert all(np.isfinite(with_nan[0]))
