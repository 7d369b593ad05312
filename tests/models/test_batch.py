"""A batch of differently sized images gives each item what it gets alone."""
import pytest

from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm

from .conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", [None, "promprune", "vispruner", "fastv", "sparsevlm"])
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
