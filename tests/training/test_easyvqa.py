"""tiny-easyvqa:llava: a few training steps into a tmp cache; the cache is written once and reloads identically."""
import pytest
import torch

from promprune.models import PrunedVLM
from promprune.training import easyvqa as easyvqa_train

STEPS = 12


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few steps, deterministic: the loss trace and the cache directory they were saved to."""
    cache = tmp_path_factory.mktemp("promprune_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PROMPRUNE_CACHE", str(cache))
        losses = []
        real_train = easyvqa_train.train

        def recording_train(**kwargs):
            model, processor, trace = real_train(**{"steps": STEPS, "batch_size": 8, "threads": 1, **kwargs})
            losses.extend(trace)
            return model, processor, trace

        mp.setattr(easyvqa_train, "train", recording_train)
        vlm = PrunedVLM.from_pretrained("tiny-easyvqa:llava", method=None)
        mp.setattr(easyvqa_train, "train", lambda **kw: pytest.fail("trained twice: the cache was not reused"))
        again = PrunedVLM.from_pretrained("tiny-easyvqa:llava", method="divprune", budget=4)
    return dict(losses=losses, cache=cache, vlm=vlm, again=again)


def test_loss_decreases(trained):
    losses = trained["losses"]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5


def test_cache_written_and_reloaded_identically(trained, images, prompts):
    directory = trained["cache"] / easyvqa_train.CACHE_NAME
    assert (directory / "config.json").exists()
    assert not list(trained["cache"].glob(".*.tmp"))  # the atomic rename left nothing behind
    first, second = trained["vlm"], trained["again"]
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)
    batch = first.inputs(images, prompts)
    with torch.no_grad():
        assert torch.equal(first.model(**batch).logits, second.model(**batch).logits)
    # trained: differs from the random-weight tiny:llava it started from
    base = PrunedVLM.from_pretrained("tiny:llava", method=None)
    with torch.no_grad():
        assert not torch.allclose(base.model(**batch).logits, first.model(**batch).logits)


def test_name_resolves_and_generates(trained, images, prompts):
    vlm = trained["again"]
    assert vlm.method == "divprune" and vlm.budget == 4
    out = vlm.generate(images, prompts, max_new_tokens=3)
    assert [g.visual_tokens for g in out] == [4, 4]


def test_unknown_arch_rejected():
    with pytest.raises(ValueError, match="tiny-easyvqa"):
        PrunedVLM.from_pretrained("tiny-easyvqa:qwen2_5_vl", method=None)
