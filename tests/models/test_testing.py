"""The tiny models are the real transformers classes with the paper's structure, built offline and fast."""
import pytest
import transformers

from promprune.models.tiny import tiny_vlm

from .conftest import ARCHS, plain_generate


@pytest.mark.parametrize("arch,cls", [("llava", transformers.LlavaForConditionalGeneration),
                                      ("llava_next", transformers.LlavaNextForConditionalGeneration),
                                      ("qwen2_5_vl", transformers.Qwen2_5_VLForConditionalGeneration),
                                      ("qwen3_vl", transformers.Qwen3VLForConditionalGeneration),
                                      ("llava_onevision", transformers.LlavaOnevisionForConditionalGeneration),
                                      ("internvl", transformers.InternVLForConditionalGeneration),
                                      ("qwen3_5", transformers.Qwen3_5ForConditionalGeneration),
                                      ("gemma4", transformers.Gemma4ForConditionalGeneration)])
def test_real_classes_cached(arch, cls):
    model, processor = tiny_vlm(arch)
    assert type(model) is cls
    assert tiny_vlm(arch)[0] is model  # built once per process


def test_paper_structure():
    llava, _ = tiny_vlm("llava")
    assert llava.config.vision_feature_layer == -2 and llava.config.vision_feature_select_strategy == "default"
    nxt, _ = tiny_vlm("llava_next")
    assert nxt.model.image_newline.shape == (nxt.config.text_config.hidden_size,)
    qwen, _ = tiny_vlm("qwen2_5_vl")
    assert qwen.config.vision_config.spatial_merge_size == 2 and qwen.config.vision_config.fullatt_block_indexes
    qwen3, _ = tiny_vlm("qwen3_vl")
    assert qwen3.config.vision_config.spatial_merge_size == 2
    assert len(qwen3.config.vision_config.deepstack_visual_indexes) == 3  # as the released 8B (blocks 8, 16, 24)


def test_unknown_arch():
    with pytest.raises(ValueError, match="llava_next"):
        tiny_vlm("llava2")


@pytest.mark.parametrize("arch", ARCHS)
def test_processor_and_generate_work_offline(arch, images, prompts):
    model, processor = tiny_vlm(arch)
    new, _ = plain_generate(model, processor, images, prompts, 8)
    assert all(len(row) == 8 for row in new)
