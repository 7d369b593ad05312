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
