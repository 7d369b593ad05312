"""Unpruned == plain transformers; a full budget through the pruning path == unpruned logits."""
import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm

from .conftest import ARCHS, plain_generate, processor_images

NEW_TOKENS = 6


@pytest.mark.parametrize("arch", ARCHS)
def test_unpruned_generates_plain_tokens(arch, images, prompts):
    model, processor = tiny_vlm(arch)
    expected, inputs = plain_generate(model, processor, images, prompts, NEW_TOKENS)
    got = PrunedVLM(model, processor, method=None).generate(images, prompts, max_new_tokens=NEW_TOKENS)
    assert [g.token_ids for g in got] == expected
    n_image = (inputs["input_ids"] == model.config.image_token_id).sum(1).tolist()
    assert [g.visual_tokens for g in got] == n_image
    assert [g.text_tokens for g in got] == (inputs["attention_mask"].sum(1) - torch.tensor(n_image)).tolist()


def unpruned_logits(model, processor, images, prompts):
    """Logits of one plain forward on the processor's inputs (pixel values in, no adapter)."""
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": p}]}],
                                           add_generation_prompt=True, tokenize=False) for p in prompts]
    inputs = processor(images=processor_images(model, images), text=texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        return model(**inputs).logits, inputs["attention_mask"].bool()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", [None, "promprune", "divprune", "fastv", "sparsevlm"])
def test_full_budget_matches_unpruned_logits(arch, method, images, prompts):
    model, processor = tiny_vlm(arch)
    ref, valid = unpruned_logits(model, processor, images, prompts)
    options = {} if method is None else dict(budget=10_000, image_newline="rows")
    vlm = PrunedVLM(model, processor, method=method, **options)
    prep = vlm.prepare(images, prompts)
    assert prep.model_kwargs["input_ids"].shape == ref.shape[:2]
    with torch.inference_mode(), vlm.pruning(prep):
        got = model(**prep.model_kwargs).logits
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_budget_generates_unpruned_tokens(arch, images, prompts):
    """Decoding through the pruning path (Qwen: explicit gathered positions) continues exactly as unpruned."""
    model, processor = tiny_vlm(arch)
    expected, _ = plain_generate(model, processor, images, prompts, NEW_TOKENS)
    got = PrunedVLM(model, processor, method="promprune", budget=10_000, image_newline="rows").generate(
        images, prompts, max_new_tokens=NEW_TOKENS)
    assert [g.token_ids for g in got] == expected


def transparent_images():
    """An RGBA image with transparent and half-transparent areas, and a palette image with a transparent index:
    what a diagram or a logo saved as PNG is."""
    import numpy as np
    from PIL import Image

    rgba = np.zeros((40, 56, 4), np.uint8)
    rgba[8:32, 8:40] = (200, 30, 30, 255)
    rgba[20:40, 30:56] = (20, 90, 200, 128)
    palette = Image.fromarray(np.arange(64 * 30, dtype=np.uint8).reshape(64, 30) % 7, "P")
    palette.putpalette([0, 0, 0, 250, 10, 10, 10, 250, 10, 10, 10, 250, 200, 200, 0, 0, 200, 200, 90, 90, 90])
    palette.info["transparency"] = 3
    return [Image.fromarray(rgba, "RGBA"), palette]


@pytest.mark.parametrize("arch", ARCHS)
def test_unpruned_generates_plain_tokens_for_transparent_images(arch, prompts):
    """PIL's convert("RGB") drops the alpha (transparent areas black); the processors composite onto white
    (transformers' convert_to_rgb), so unpruned answers differed from plain transformers' for a transparent PNG."""
    model, processor = tiny_vlm(arch)
    images = transparent_images()
    expected, _ = plain_generate(model, processor, images, prompts, NEW_TOKENS)
    got = PrunedVLM(model, processor, method=None).generate(images, prompts, max_new_tokens=NEW_TOKENS)
    assert [g.token_ids for g in got] == expected


@pytest.mark.parametrize("arch,size", [("llava_next", (2000, 20)), ("llava_onevision", (300, 24))])
def test_full_budget_matches_unpruned_logits_where_the_unpadding_leaves_rows_empty(arch, size, prompts):
    """An image far taller than wide: the unpadding cuts the crop grid to no column, so a row is its newline alone.
    "rows" kept a newline only beside a kept token, and dropped those: the full budget fed fewer tokens."""
    from .conftest import make_image

    model, processor = tiny_vlm(arch)
    images = [make_image(*size, 0), make_image(40, 56, 1)]
    ref, valid = unpruned_logits(model, processor, images, prompts)
    vlm = PrunedVLM(model, processor, method="promprune", budget=10_000, image_newline="rows")
    prep = vlm.prepare(images, prompts)
    assert prep.model_kwargs["input_ids"].shape == ref.shape[:2]
    with torch.inference_mode(), vlm.pruning(prep):
        got = model(**prep.model_kwargs).logits
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-5, rtol=0)
