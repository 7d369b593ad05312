"""The testbed VLM: real LLaVA classes at 144 visual tokens with CLS saliency; its tokenizer; a short training run
through the factory and the once-only cache."""
import pytest
import torch

from promprune.models import PrunedVLM
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes, training, zoo


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


def test_scene_targets_hand_worked():
    # a red square alone in the top-left region (cells r0c0), two objects sharing the bottom-right region (r4c4, r5c5)
    objs = (scenes.Obj("red", "square", "large", 0, 0, 0, 0), scenes.Obj("blue", "circle", "small", 4, 4, 1, 0),
            scenes.Obj("white", "triangle", "small", 5, 5, 0, -1))
    t = training.scene_targets(scenes.Scene("test", 0, objs, "plain", 0))
    assert t["present"].sum() == 3 and t["present"][scenes.KINDS.index(("blue", "circle"))] == 1
    assert int(t["count"]) == 2  # class index: 3 objects
    x, y = t["position"][scenes.KINDS.index(("blue", "circle"))].tolist()  # centre of cell r4c4, 1 px right
    assert (x, y) == pytest.approx(((4 * 16 + 8 + 1) / 96, (4 * 16 + 8) / 96))
    top_left, bottom_right = list(scenes.REGIONS).index("top left"), list(scenes.REGIONS).index("bottom right")
    assert int(t["region_color"][top_left]) == 1 + list(scenes.COLORS).index("red")
    assert int(t["region_shape"][top_left]) == 1 + list(scenes.SHAPES).index("square")
    assert int(t["region_color"][bottom_right]) == training.NONE  # two objects: no lone object to ask about
    assert int(t["region_color"].ne(0).sum()) == 1


def test_short_training_is_deterministic_and_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPRUNE_CACHE", str(tmp_path))
    monkeypatch.setenv(zoo.RETRAIN_ENV, "1")  # the recipe, not the shipped weights (tests/testbed/test_shipped)
    kwargs = dict(vision_steps=6, align_steps=4, steps=8, batch_size=6, vision_batch_size=8, threads=1,
                  progress=False)
    model_a, _, losses_a = training.train(**kwargs)
    model_b, _, losses_b = training.train(**kwargs)
    assert losses_a == losses_b and len(losses_a) == 18
    assert all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    assert min(losses_a[:6][-2:]) < losses_a[0]  # the vision objectives go down
    assert losses_a[9] < losses_a[6]  # the projector's alignment
    assert sum(losses_a[-2:]) / 2 < sum(losses_a[10:12]) / 2  # and the answer loss

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



def test_multi_turn_batch_is_the_chat_template_conversation():
    """Recipe v3's teacher forcing: each row, unpadded, is the processor's chat template applied to the whole
    conversation (image, question, answer, question, answer, ...); exactly the answers and their EOS are labelled;
    the first turn is the prompt generate builds."""
    import random

    model, processor = testbed_model.untrained()
    vlm = PrunedVLM(model, processor, method=None)
    rng = random.Random(0)
    drawn = [training.conversation(i, rng, 3) for i in range(2)]
    kwargs, labels = training.teacher_forcing_turns(vlm, drawn)
    tok = processor.tokenizer
    for row, (scene, asked) in enumerate(drawn):
        messages = []
        for t, q in enumerate(asked):
            text = {"type": "text", "text": q.question + training.POST_PROMPTS[q.family]}
            messages += [{"role": "user", "content": [{"type": "image"}, text] if t == 0 else [text]},
                         {"role": "assistant", "content": [{"type": "text", "text": q.answer}]}]
        expected = processor(images=[scenes.render(scene)], text=processor.apply_chat_template(messages),
                             return_tensors="pt")["input_ids"][0]
        keep = kwargs["attention_mask"][row].bool()
        assert kwargs["input_ids"][row][keep].tolist() == expected.tolist()
        answers = [i for q in asked for i in tok(q.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
        assert [int(i) for i in labels[row] if i != -100] == answers
        assert kwargs["position_ids"][row][keep].tolist() == list(range(int(keep.sum())))
    first = vlm.inputs([scenes.render(s) for s, _ in drawn],
                       [qs[0].question + training.POST_PROMPTS[qs[0].family] for _, qs in drawn])
    for row in range(2):
        prompt = first["input_ids"][row][first["attention_mask"][row].bool()].tolist()
        assert kwargs["input_ids"][row][kwargs["attention_mask"][row].bool()].tolist()[:len(prompt)] == prompt


def test_multi_turn_recipe_option_trains_deterministically_and_scene_targets_are_checked():
    kwargs = dict(vision_steps=3, align_steps=2, steps=3, batch_size=4, vision_batch_size=4, threads=1,
                  turns=4, scene_targets=("present", "count"), progress=False)
    model_a, _, losses_a = training.train(**kwargs)
    model_b, _, losses_b = training.train(**kwargs)
    assert losses_a == losses_b and len(losses_a) == 8
    assert all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    heads = training.AuxHeads(64, targets=("present", "count"))
    assert list(heads.sizes) == ["present", "count"]
    with pytest.raises(ValueError, match="need present and count"):
        training.AuxHeads(64, targets=("present", "colour"))
