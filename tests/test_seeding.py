"""Seeded builds and recipes keep their seeding to themselves (promprune.seeding.private_seed).

A researcher's ``torch.manual_seed(0); <build a tiny / shape / testbed model or run a training recipe>; torch.rand()``
draws what it would have drawn without the build, while the built weights stay those that ``torch.manual_seed(SEED)``
before the constructor gives (the reference here: transformers' class built right after ``torch.manual_seed``).
"""
import pytest
import torch

from promprune.models.registry import family
from promprune.models.shapes import shape_vlm
from promprune.models.tiny import SEED, archs, tiny_clip_text
from promprune.seeding import private_seed
from promprune.testbed import model as testbed_model
from promprune.testbed import training as testbed_training
from promprune.training import easyvqa


def _draws(build):
    """(state before, state after ``build()``, what ``build()`` returned), the caller seeded with 1234."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    built = build()
    return before, torch.get_rng_state(), built


def assert_same_weights(model, reference):
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("arch", archs())
def test_a_tiny_build_leaves_the_callers_rng_and_keeps_its_weights(arch):
    before, after, (model, _) = _draws(family(arch).tiny)
    assert torch.equal(before, after)
    torch.manual_seed(SEED)
    reference = type(model)(model.config).eval()
    assert_same_weights(model, reference)


def test_the_tiny_clip_text_tower_leaves_the_callers_rng():
    vision = family("llava").tiny()[0].config.vision_config
    before, after, (_, text, projection) = _draws(lambda: tiny_clip_text(vision))
    assert torch.equal(before, after)
    torch.manual_seed(SEED)
    reference = type(text)(text.config)
    assert_same_weights(text, reference)
    assert torch.equal(projection.weight, torch.nn.Linear(vision.hidden_size, vision.projection_dim,
                                                          bias=False).weight)


def test_a_shape_build_leaves_the_callers_rng():
    build = lambda: shape_vlm("llava_1_5_7b", dtype=torch.float32, text_layers=1, vision_layers=1,  # noqa: E731
                              width_divisor=16)[0]
    before, after, model = _draws(build)
    assert torch.equal(before, after)
    torch.manual_seed(SEED)
    assert_same_weights(model, type(model)._from_config(model.config, dtype=torch.float32))


def test_the_untrained_testbed_model_leaves_the_callers_rng():
    before, after, (model, _) = _draws(testbed_model._untrained.__wrapped__)
    assert torch.equal(before, after)
    torch.manual_seed(SEED)
    assert_same_weights(model, type(model)(model.config))


def test_the_testbed_recipe_leaves_the_callers_rng():
    """A few steps of every stage (and stage 4 alone on its result): the recipe seeds itself, the caller's stream
    goes on as before, and the result does not depend on the caller's state."""
    small = dict(steps=1, vision_steps=1, align_steps=1, relation_steps=1, batch_size=2, vision_batch_size=2,
                 progress=False)
    before, after, (model, _, _) = _draws(lambda: testbed_training.train(**small))
    assert torch.equal(before, after)
    torch.manual_seed(99)
    assert_same_weights(model, testbed_training.train(**small)[0])
    before, after, _ = _draws(lambda: testbed_training.train(init=model, **small))
    assert torch.equal(before, after)


def test_the_easyvqa_recipe_leaves_the_callers_rng():
    before, after, (model, _, _) = _draws(lambda: easyvqa.train(steps=1, batch_size=2, progress=False))
    assert torch.equal(before, after)
    torch.manual_seed(99)
    assert_same_weights(model, easyvqa.train(steps=1, batch_size=2, progress=False)[0])


def test_private_seed_seeds_as_manual_seed_does_and_restores_on_a_raise():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError):
        with private_seed(SEED):
            inside = torch.rand(4)
            raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(SEED)
    assert torch.equal(inside, torch.rand(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_build_on_cuda_leaves_the_callers_cuda_rng():
    torch.manual_seed(1234)
    states = torch.cuda.get_rng_state_all()
    family("llava").tiny()
    model = shape_vlm("llava_1_5_7b", dtype=torch.float32, text_layers=1, vision_layers=1, width_divisor=16,
                      device="cuda")[0]
    assert all(torch.equal(a, b) for a, b in zip(states, torch.cuda.get_rng_state_all()))
    torch.manual_seed(SEED)  # the old build: every generator seeded, then the constructor on the device
    with torch.device("cuda"):
        reference = type(model)._from_config(model.config, dtype=torch.float32)
    assert_same_weights(model, reference)
