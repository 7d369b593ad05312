"""CDPruner's instruction and the downsampling grid through the adapters."""
import pytest
import torch

import promprune
from promprune.models import PrunedVLM
from promprune.models.clip_text import question_text
from promprune.models.tiny import tiny_clip_text, tiny_vlm
from promprune.selection.controls import pooling_matrix


def test_cdpruner_on_llava_uses_clips_text_tower_as_released(images, prompts):
    """Kept = select() on an instruction built by hand from a plain forward: the penultimate layer's patch states
    through post_layernorm and the visual projection vs. the tiny CLIP's text embedding of the question."""
    model, processor = tiny_vlm("llava")
    prompt = "What is in the picture?\nAnswer the question using a single word or phrase."
    vlm = PrunedVLM(model, processor, method="cdpruner", budget=7)
    got = vlm.generate(images[:1], [prompt], max_new_tokens=1)[0]
    inputs = vlm.inputs(images[:1], [prompt])
    with torch.inference_mode():
        tower = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True)
        feats = model.model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).pooler_output[0]
        tokenizer, text_model, visual_projection = tiny_clip_text(model.config.vision_config)
        tokens = visual_projection(model.model.vision_tower.post_layernorm(tower.hidden_states[-2][:, 1:]))
        ids = tokenizer("What is in the picture?")["input_ids"]  # 25 tokens: two 16-token windows
        assert len(ids) == 25
        windows = torch.tensor(ids + [0] * 7).view(2, 16)
        mask = torch.tensor([1] * 25 + [0] * 7).view(2, 16)
        emb = text_model(input_ids=windows, attention_mask=mask).text_embeds
        query = torch.nn.functional.normalize(emb, dim=-1).mean(0, keepdim=True)
    want = promprune.select(feats[None], budget=7, method="cdpruner",
                            instruction=promprune.Instruction(query=query, tokens=tokens))
    assert got.kept == want.indices[0].tolist()
    other = vlm.generate(images[:1], ["Colour?"], max_new_tokens=1)[0]
    assert other.kept != got.kept  # the same image, another question


def test_cdpruner_loads_its_clip_text_tower_at_construction_not_in_a_timed_sample(monkeypatch, images, prompts):
    """The tower was loaded lazily by the first sample's ``attach_instruction``, inside its vision Stopwatch: the
    first sample's vision_ms held a checkpoint load (CLIP-L/14-336 from disk). It is loaded when the wrapper is built,
    once; no generate loads it again (the other wrapper of the same model too: a text source of the LLM loads none)."""
    from promprune.models import clip_text, vlm as vlm_module

    model, processor = tiny_vlm("llava")
    calls = []
    real_load = clip_text.load
    monkeypatch.setattr(clip_text, "load", lambda *a, **k: calls.append(a[0]) or real_load(*a, **k))
    timed = []
    real_stopwatch = vlm_module.Stopwatch

    class Watched(real_stopwatch):  # the loads made while a timed stage runs
        def __enter__(self):
            self.before = len(calls)
            return super().__enter__()

        def __exit__(self, *exc):
            timed.append(len(calls) - self.before)
            return super().__exit__(*exc)

    monkeypatch.setattr(vlm_module, "Stopwatch", Watched)
    vlm = PrunedVLM(model, processor, method="cdpruner", budget=7)
    assert calls == ["tiny"]
    vlm.generate(images[:1], prompts[:1], max_new_tokens=1)
    vlm.generate(images[1:], prompts[1:], max_new_tokens=1)
    assert calls == ["tiny"] and timed and not any(timed)
    PrunedVLM(model, processor, method="cdpruner", budget=7, text_source="llm")
    assert calls == ["tiny"]


def test_a_clip_text_tower_that_does_not_load_is_refused_at_construction_naming_the_option(tmp_path):
    from promprune.models.options import OptionError

    model, processor = tiny_vlm("llava")
    with pytest.raises(OptionError, match=r"CDPruner's CLIP text tower '.*no-clip' \(adapter option clip_text\) does "
                                          r"not load: .*text_source 'llm'") as caught:
        PrunedVLM(model, processor, method="cdpruner", budget=7, clip_text=str(tmp_path / "no-clip"))
    assert caught.value.option == "clip_text"


def test_question_text_strips_the_short_answer_suffix():
    assert question_text("Is it red?\nAnswer the question using a single word or phrase.") == "Is it red?"


def test_cdpruner_on_qwen_uses_the_llms_input_embeddings(images, prompts):
    model, processor = tiny_vlm("qwen2_5_vl")
    vlm = PrunedVLM(model, processor, method="cdpruner", budget=5)
    got = vlm.generate(images[:1], prompts[:1], max_new_tokens=1)[0]
    prep = vlm.prepare(images[:1], prompts[:1])
    feats = prep.items[0].features.float()
    with torch.inference_mode():
        ids = processor.tokenizer(prompts[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
        query = model.get_input_embeddings()(ids)[0].float().mean(0)
    want = promprune.select(feats[None], budget=5, method="cdpruner",
                            instruction=promprune.Instruction(query[None], feats[None], source="llm"))
    assert got.kept == want.indices[0].tolist()
    with pytest.raises(ValueError, match="text_source 'clip' needs a CLIP vision tower"):
        PrunedVLM(model, processor, method="cdpruner", budget=5, text_source="clip")


def test_downsample_pools_qwens_merged_grid(images, prompts):
    model, processor = tiny_vlm("qwen2_5_vl")
    vlm = PrunedVLM(model, processor, method="downsample", budget=4)
    for image, prompt in zip(images, prompts):
        got = vlm.generate([image], [prompt], max_new_tokens=1)[0]
        _, h, w = vlm.inputs([image], [prompt])["image_grid_thw"][0].tolist()
        _, centres = pooling_matrix(h // 2, w // 2, 4)
        assert got.kept == centres.tolist() and got.visual_tokens == 4


def test_downsample_pools_each_llava_next_view(images, prompts):
    model, processor = tiny_vlm("llava_next")
    vlm = PrunedVLM(model, processor, method="downsample", budget=10)
    prep = vlm.prepare(images[:1], prompts[:1])
    assert prep.stats[0]["visual_tokens"] == 10
    views = {g // 16 for g in prep.stats[0]["kept"]}
    assert len(views) == len(prep.items[0].groups.unique())  # every view pooled, none skipped
    with pytest.raises(ValueError, match="one rectangle of one view"):
        PrunedVLM(model, processor, method="downsample", budget=10, budget_mode="global").prepare(images[:1],
                                                                                                  prompts[:1])
