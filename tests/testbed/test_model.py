"""The testbed VLM: real LLaVA classes at 144 visual tokens with CLS saliency; its tokenizer; a short training run
through the factory and the once-only cache."""
import pytest
import torch

from promprune.models import PrunedVLM
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes, training, zoo
from promprune.training import common


def test_tokenizer_round_trips_every_prompt_and_answer():
    tok = testbed_model.tokenizer()
    unk = tok.convert_tokens_to_ids("<unk>")
    for family, post in training.POST_PROMPTS.items():
        for index in range(20):
            for q in scenes.questions(scenes.make_scene("test", index), family):
                ids = tok(q.question + post, add_special_tokens=False)["input_ids"]
                assert unk not in ids, q.question  # the vocabulary covers every question the testbed asks
                assert tok.decode(tok(q.answer, add_special_tokens=False)["input_ids"]) == q.answer
    assert tok("Describe the image.", add_special_tokens=False)["input_ids"][0] == unk  # unknown words -> <unk>


def test_architecture_and_placeholders():
    model, processor = testbed_model.untrained()
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.config.vision_feature_layer == -2 and model.config.vision_feature_select_strategy == "default"
    image = scenes.render(scenes.make_scene("test", 0))
    vlm = PrunedVLM(model, processor, method=None)
    batch = vlm.inputs([image], ["How many objects are there?"])
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 144  # 12 x 12 patches, CLS dropped


def test_patch_labels_hand_worked():
    obj = scenes.Obj("red", "square", "large", 0, 0, 0, 0)  # centre (8, 8), 14 px: covers x, y in [1, 15]
    labels = training.patch_labels(scenes.Scene("test", 0, (obj,), "plain", 0)).view(12, 12)
    kind = 1 + scenes.KINDS.index(("red", "square"))
    assert labels[:2, :2].eq(kind).all() and labels.sum() == 4 * kind  # patch centres 4 and 12 px: 2x2 patches


def test_local_targets_hand_worked():
    # a red square alone in the top-left region (cell r0c0), a blue circle in cell r4c4 shifted 1 px right
    objs = (scenes.Obj("red", "square", "large", 0, 0, 0, 0), scenes.Obj("blue", "circle", "small", 4, 4, 1, 0))
    scene = scenes.Scene("test", 0, objs, "plain", 0)
    t = training.local_targets(scene)
    # the circle: centre (73, 72), 9 px across -> patch centres within 4.5 px: x 76 (column 9; 68 is 5 px off),
    # y 68 and 76 (rows 8, 9)
    circle = [8 * 12 + 9, 9 * 12 + 9]
    assert t["kind"][circle].eq(1 + scenes.KINDS.index(("blue", "circle"))).all()
    assert t["color"][[0, 1, 12, 13]].eq(1 + list(scenes.COLORS).index("red")).all()
    assert t["shape"][circle].eq(1 + list(scenes.SHAPES).index("circle")).all()
    assert t["region"][[0, 1, 12, 13]].eq(1 + list(scenes.REGIONS).index("top left")).all()
    assert t["region"][circle].eq(1 + list(scenes.REGIONS).index("bottom right")).all()
    assert t["kind"].ne(0).sum() == 6 and t["center"][t["kind"] == 0].abs().sum() == 0
    assert t["center"][circle[0]].tolist() == pytest.approx([73 / 96, 72 / 96])
    present = training.present_kinds(scene)
    assert present.sum() == 2 and present[scenes.KINDS.index(("red", "square"))] == 1


def _batch(drawn):
    model, processor = testbed_model.untrained()
    vlm = PrunedVLM(model, processor, method=None)
    kwargs, labels = common.teacher_forcing(vlm, *training._prompts(drawn))
    return model, processor, kwargs, labels


def test_attention_targets_point_at_the_named_objects_and_words():
    """Hand-worked: the image tokens of each object's patches (raster order after the prompt's first image token),
    the question's own words, and the first prompt token for an existence question answered "no"."""
    objs = (scenes.Obj("red", "square", "large", 0, 0, 0, 0), scenes.Obj("blue", "circle", "small", 4, 4, 1, 0))
    scene = scenes.Scene("test", 0, objs, "plain", 0)
    red, blue = [0, 1, 12, 13], [105, 117]  # as in test_local_targets_hand_worked
    drawn = [(scene, scenes.Question("relation", "Is the red square above the blue circle?", "yes", "above", (0, 1))),
             (scene, scenes.Question("exist", "Is there a white triangle in the image?", "no", "random")),
             (scene, scenes.Question("attribute", "What color is the object at the top left?", "red", "color", (0,))),
             (scene, scenes.Question("count", "How many objects are there?", "2", "", (0, 1)))]
    model, processor, kwargs, labels = _batch(drawn)
    ids, tok = kwargs["input_ids"], processor.tokenizer
    found = training.attention_targets(ids, kwargs["attention_mask"], labels, drawn, model.config.image_token_id)
    by = {(role, row, head): keys.tolist() for role, row, head, _, keys in found}
    for _, row, _, pos, _ in found:
        assert labels[row, pos + 1] != -100 and labels[row, pos] == -100  # the position that predicts the answer
    first_image = [int((ids[r] == model.config.image_token_id).nonzero()[0]) for r in range(4)]
    assert by[("find", 0, 0)] == [first_image[0] + c for c in red]
    assert by[("find", 0, 1)] == [first_image[0] + c for c in blue]
    words = lambda row, keys: tok.convert_ids_to_tokens(ids[row, keys].tolist())  # noqa: E731
    assert words(0, by[("gather", 0, 2)]) == ["red", "square"] and words(0, by[("gather", 0, 3)]) == ["blue", "circle"]
    first_token = int(kwargs["attention_mask"][1].nonzero()[0])
    assert by[("find", 1, 0)] == by[("find", 1, 1)] == [first_token] and words(1, [first_token]) == ["user"]
    assert words(1, by[("gather", 1, 2)]) == ["white", "triangle"]
    assert by[("find", 2, 0)] == [first_image[2] + c for c in red] and words(2, by[("gather", 2, 3)]) == ["top", "left"]
    assert by[("find", 3, 1)] == sorted(first_image[3] + c for c in red + blue) and ("gather", 3, 2) not in by
    assert len(found) == 4 * 2 + 3 * 2  # find heads in every row, gather heads where the question names something
    no_sink = training.attention_targets(ids, kwargs["attention_mask"], labels, drawn, model.config.image_token_id,
                                         sink=False)
    plain = lambda targets: [(*t[:4], t[4].tolist()) for t in targets]  # noqa: E731
    assert plain(t for t in found if t[1] != 1 or t[0] != "find") == plain(no_sink)

    colors, shapes, regions = list(scenes.COLORS), list(scenes.SHAPES), list(scenes.REGIONS)
    assert training.QuestionProbe.targets(drawn[0][1]) == [1 + colors.index("red"), 1 + shapes.index("square"),
                                                            1 + colors.index("blue"), 1 + shapes.index("circle"), 0]
    assert training.QuestionProbe.targets(drawn[2][1]) == [0, 0, 0, 0, 1 + regions.index("top left")]
    assert training.QuestionProbe.targets(drawn[3][1]) == [0] * 5


def test_short_training_is_deterministic_and_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPRUNE_CACHE", str(tmp_path))
    monkeypatch.setenv(zoo.RETRAIN_ENV, "1")  # the recipe, not the shipped weights (tests/testbed/test_shipped)
    kwargs = dict(vision_steps=6, align_steps=4, steps=8, relation_steps=2, batch_size=6, vision_batch_size=8,
                  threads=1, progress=False)
    model_a, _, losses_a = training.train(**kwargs)
    model_b, _, losses_b = training.train(**kwargs)
    assert losses_a == losses_b and len(losses_a) == 6 + 4 + 8 + 2
    assert all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    assert min(losses_a[:6][-2:]) < losses_a[0]  # the vision objectives go down
    assert losses_a[9] < losses_a[6]  # the projector's alignment
    assert sum(losses_a[16:18]) / 2 < sum(losses_a[10:12]) / 2  # and the answer loss

    calls = []
    real = training.train
    monkeypatch.setattr(training, "train", lambda **kw: calls.append(kw) or real(**{**kwargs, **kw}))
    vlm = PrunedVLM.from_pretrained("testbed:llava", method="promprune", budget=16)
    again = PrunedVLM.from_pretrained("testbed:llava", method=None)
    assert len(calls) == 1  # trained once into the cache, loaded from there the second time
    assert (tmp_path / training.CACHE_NAME / "config.json").exists() and training.CACHE_NAME.endswith(training.RECIPE)
    images = [scenes.render(scenes.make_scene("test", i)) for i in range(2)]
    out = vlm.generate(images, ["How many objects are there?\nAnswer with a number."] * 2, max_new_tokens=2)
    assert [g.visual_tokens for g in out] == [16, 16] and all(g.salient is not None for g in out)
    assert again.model.config.vision_config.image_size == 96
    with pytest.raises(ValueError, match="unknown testbed arch 'qwen'"):
        PrunedVLM.from_pretrained("testbed:qwen", method=None)


def test_relation_stage_targets_hand_worked():
    """Stage 4's read-out targets and its relation-word attention target, on the hand-worked scene above."""
    objs = (scenes.Obj("red", "square", "large", 0, 0, 0, 0), scenes.Obj("blue", "circle", "small", 4, 4, 1, 0))
    scene = scenes.Scene("test", 0, objs, "plain", 0)
    ask = lambda text, answer, relation, refs: (scene, scenes.Question("relation", text, answer, relation, refs))  # noqa: E731
    drawn = [ask("Is the red square above the blue circle?", "yes", "above", (0, 1)),
             ask("Is the blue circle left of the red square?", "no", "left of", (1, 0)),
             (scene, scenes.Question("count", "How many objects are there?", "2", "", (0, 1)))]
    # red square centre (8, 8), blue circle (73, 72): the square is left of and above the circle
    assert training.relation_facts(*drawn[0]) == [1, 1, list(scenes.RELATIONS).index("above")]
    assert training.relation_facts(*drawn[1]) == [0, 0, list(scenes.RELATIONS).index("left of")]
    model, processor, kwargs, labels = _batch(drawn)
    found = training.relation_word_targets(kwargs["input_ids"], labels, drawn)
    assert [(role, row, head) for role, row, head, _, _ in found] == [("word", 0, training.WORD_HEAD),
                                                                     ("word", 1, training.WORD_HEAD)]
    words = [processor.tokenizer.convert_ids_to_tokens(kwargs["input_ids"][row, keys].tolist())
             for _, row, _, _, keys in found]
    assert words == [["above"], ["left"]]
    positions = training.answer_positions(labels)
    assert [pos for _, _, _, pos, _ in found] == positions[:2]


def test_stage_four_on_saved_stages_one_to_three_gives_a_whole_runs_weights(tmp_path):
    """What lets the shipped file be made by stage 4 on a saved stage-3 model: the same weights, to the bit, as one
    run of all four stages (same machine, one thread)."""
    from transformers import LlavaForConditionalGeneration

    kwargs = dict(vision_steps=2, align_steps=2, steps=3, batch_size=4, vision_batch_size=4, threads=1,
                  progress=False)
    whole, _, _ = training.train(relation_steps=3, **kwargs)
    first, _, _ = training.train(relation_steps=0, **kwargs)
    first.save_pretrained(tmp_path)
    loaded = LlavaForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    resumed, _, losses = training.train(relation_steps=3, init=loaded, **kwargs)
    assert len(losses) == 3
    names = list(whole.state_dict())
    assert all(torch.equal(whole.state_dict()[n], resumed.state_dict()[n]) for n in names)
    llm = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(whole.state_dict()[llm], first.state_dict()[llm])  # stage 4 did train
    tower = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert torch.equal(whole.state_dict()[tower], first.state_dict()[tower])  # with the tower frozen
