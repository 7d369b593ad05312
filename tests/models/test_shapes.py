"""The published 7B architectures without weights (``promprune.models.shapes``), built on the meta device.

Checked against facts independent of our code: the checkpoints' published parameter counts, the paper's visual
token counts (576; 2880 + 48 newlines for a square anyres image; 1296), Qwen2-VL's M-RoPE rule worked by hand, and
Table 6's TFLOPs and KV cache.
"""
import numpy as np
import pytest
import torch
from PIL import Image

import promprune
from promprune.efficiency import MIB, kv_cache_bytes, prefill_flops
from promprune.models import PrunedVLM
from promprune.models.sequence import shrink_placeholders
from promprune.models.shapes import default_options, shape_spec, shape_vlm, shapes

from .test_qwen_positions import hand_positions

# parameters of the released checkpoints (the hub's safetensors totals)
PUBLISHED_PARAMS = {"llava_1_5_7b": 7_063_427_072, "llava_next_7b": 7_063_431_168, "qwen2_5_vl_7b": 8_292_166_656,
                    "qwen3_vl_8b": 8_767_123_696,
                    # not the hub's exact total (unverifiable offline): our config's count, which the hub card's
                    # rounded "8.03B" agrees with
                    "llava_onevision_7b": 8_030_807_584,
                    # also our config's count (from memory, unverifiable offline), as the hub card's rounded "7.94B"
                    "internvl3_8b": 7_944_373_760,
                    # our config's count (transformers' model: the hub's safetensors also hold a multi-token-prediction
                    # head it does not load), as the published "4.5B"; tied embeddings
                    "qwen3_5_4b": 4_539_265_536,
                    # our configs' counts (unverifiable offline): InternVL3.5-8B's card says 0.3B + 8.2B = 8.5B;
                    # Gemma 4 31B's LLM 30.7B (embeddings included) + its ~550M encoder; E2B's "5.1B with embeddings"
                    "internvl3_5_8b": 8_528_318_464, "gemma4_31b": 31_273_086_512, "gemma4_e2b": 5_104_297_504,
                    # our config's count (transformers' GLM-4.1V-9B defaults, unverifiable offline): its LLM's 9.40B,
                    # which the name "9B" rounds, plus a 0.89B vision tower
                    "glm46v_flash": 10_292_777_472,
                    # our config's count (inferred, unverifiable offline): its LLM 752M and vision side 548M are the
                    # split ollama's minicpm-v4.6 listing gives
                    "minicpm_v_4_6": 1_300_659_440}
# visual tokens of one square image: LLaVA-1.5 24x24; NeXT base view + 2x2 crops of 24x24 plus one newline per row
# of the 48-row grid; Qwen2.5-VL at the paper's fixed 36x36 merged grid, Qwen3-VL at the same grid (our choice)
# OneVision (512 px square): the 27x27 base view + 2x2 crops (54x54, under anyres_max_9's resize limit) + 54 newlines
# InternVL3 (512 px square): one 448 px tile of 16 x 16 tokens, no thumbnail (a 2x2 grid would cover more than twice
# the image)
# Gemma 4 (512 px square, 280 soft tokens at most): scaled by sqrt(2520 * 16^2 / 512^2) to 803 px, floored to 768 px
# (a multiple of 3 x 16 px) = 48 x 48 patches = 16 x 16 soft tokens
VISUAL_TOKENS = {"llava_1_5_7b": 576, "llava_next_7b": 5 * 576 + 48, "qwen2_5_vl_7b": 1296, "qwen3_vl_8b": 1296,
                 "llava_onevision_7b": 729 + 54 * 54 + 54, "internvl3_8b": 256, "internvl3_5_8b": 256,
                 "qwen3_5_4b": 1296,  # Qwen3.5 at Qwen3-VL's grid (our choice)
                 "gemma4_31b": 256, "gemma4_e2b": 256,
                 "glm46v_flash": 1296,  # GLM-4.6V at Qwen's fixed grid (our choice)
                 # MiniCPM-V 4.6 (released slicing, 16x): a 448 x 448 source (32 x 32 patches, 64 tokens) and 2 x 1
                 # slices, each 336 x 616 px (24 x 44 patches, 66 tokens)
                 "minicpm_v_4_6": 64 + 2 * 66}


@pytest.fixture(scope="module")
def meta_models():
    return {name: shape_vlm(name, device="meta") for name in shapes()}


def square_image(side=512, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def test_every_published_shape_ships():
    assert shapes() == sorted(PUBLISHED_PARAMS)
    with pytest.raises(ValueError, match="shipped shapes"):
        shape_spec("llava_13b")


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_is_the_checkpoints(meta_models, name):
    model, _ = meta_models[name]
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("name", sorted(VISUAL_TOKENS))
def test_placeholder_counts_through_the_pruned_vlm(meta_models, name):
    model, processor = meta_models[name]
    vlm = PrunedVLM(model, processor, method="promprune", budget=64, **default_options(name))
    batch = vlm.processed([square_image()], ["Describe the image briefly."])
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == VISUAL_TOKENS[name]


@pytest.mark.parametrize("name", ["qwen2_5_vl_7b", "qwen3_vl_8b", "qwen3_5_4b", "glm46v_flash"])
def test_qwen_positions_of_a_pruned_real_sequence(meta_models, name):
    """128 of 1296 kept: each keeps its (t, h, w) position on the 36 x 36 grid, text after continues at s + 36."""
    model, processor = meta_models[name]
    vlm = PrunedVLM(model, processor, method="divprune", budget=128, image_tokens=1296)
    batch = vlm.processed([square_image()], ["Describe the image briefly."])
    kept = sorted(torch.randperm(1296, generator=torch.Generator().manual_seed(0))[:128].tolist())
    ids, mask, col_map = shrink_placeholders(batch["input_ids"], batch["attention_mask"],
                                             model.config.image_token_id, [torch.tensor(kept)],
                                             processor.tokenizer.pad_token_id)
    pos = vlm.adapter.generate_kwargs(batch, ids, mask, col_map)["position_ids"]
    expected = hand_positions(ids[0], mask[0], model.config.image_token_id, (36, 36), kept)
    torch.testing.assert_close(pos[1:, 0][:, mask[0].bool()], expected)


@pytest.mark.parametrize("name, budget", [("llava_1_5_7b", 64), ("qwen2_5_vl_7b", 128), ("qwen3_vl_8b", 128),
                                          ("qwen3_5_4b", 128)])
def test_selection_at_the_real_token_count(name, budget):
    spec = shape_spec(name)
    d = spec["text_config"]["hidden_size"]
    n = VISUAL_TOKENS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, 32, generator=g) @ torch.randn(32, d, generator=g) + 0.5 * torch.randn(1, n, d, generator=g)
    sel = promprune.select(x, torch.rand(1, n, generator=g), budget=budget)
    assert sel.indices.shape == (1, budget) and len(set(sel.indices[0].tolist())) == budget
    assert 0.0 < float(sel.entropy) < 1.0


def test_table6_from_the_shipped_llava_next_config():
    text = shape_spec("llava_next_7b")["text_config"]
    assert float(f"{prefill_flops(text, 2880 + 62) / 1e12:.3g}") == 42.6
    assert float(f"{prefill_flops(text, 320 + 62) / 1e12:.3g}") == 5.02
    assert kv_cache_bytes(text, 2880, torch.float16) / MIB == 1440.0
    assert kv_cache_bytes(text, 320, "fp16") / MIB == 160.0


def test_onevision_vision_side_is_transformers_own_default_for_the_7b():
    """LlavaOnevisionConfig's defaults are documented as llava-onevision-qwen2-7b-ov-hf's: our from-memory vision
    tower, pinpoints and feature settings must equal them (an independent source for the part that sets the visual
    token counts; the text side's defaults are Qwen2's generic ones, not the 7B's)."""
    from transformers import LlavaOnevisionConfig

    default, ours = LlavaOnevisionConfig(), shape_spec("llava_onevision_7b")
    assert "llava-onevision-qwen2-7b-ov-hf" in LlavaOnevisionConfig.__doc__
    vision = default.vision_config.to_dict()
    assert {k: vision[k] for k in ours["vision_config"] if k in vision} == \
        {k: v for k, v in ours["vision_config"].items() if k in vision}
    for key in ("image_grid_pinpoints", "vision_feature_layer", "vision_feature_select_strategy",
                "vision_aspect_ratio"):
        assert getattr(default, key) == ours[key], key


def test_width_divisor_narrows_both_towers_alike():
    """benchmarks/throughput.py's model: LLaVA-1.5-7B at 1/8 of the depth and 1/4 of the widths, heads as wide."""
    model, _ = shape_vlm("llava_1_5_7b", device="meta", text_layers=4, vision_layers=3, width_divisor=4)
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_attention_heads, text.num_hidden_layers) == \
        (1024, 2752, 8, 4)
    assert text.hidden_size // text.num_attention_heads == 128  # Vicuna-7B's head width
    assert (vision.hidden_size, vision.intermediate_size, vision.num_attention_heads, vision.num_hidden_layers) == \
        (256, 1024, 4, 3)
    assert model.config.text_config.vocab_size == shape_spec("llava_1_5_7b")["text_config"]["vocab_size"]
    with pytest.raises(ValueError, match="width_divisor 3 does not divide vision_config.hidden_size = 1024"):
        shape_vlm("llava_1_5_7b", device="meta", width_divisor=3)


def test_gemma4_31b_soft_tokens_and_layers(meta_models):
    """A 640 x 480 photo at 280 soft tokens: scaled by sqrt(2520 * 256 / 307200) = 1.449 to 927 x 696 px, floored to
    912 x 672 px = 57 x 42 patches = 19 x 14 = 266 soft tokens between <|image> and <image|>; the LLM's full-attention
    layers are every sixth, its window 1024, its full layers' 4 KV heads of 512 wide, its sliding layers' 16 of 256."""
    model, processor = meta_models["gemma4_31b"]
    vlm = PrunedVLM(model, processor, method="promprune", budget=64)
    batch = vlm.processed([Image.new("RGB", (640, 480))], ["Describe the image."])
    ids = batch["input_ids"][0]
    run = (ids == model.config.image_token_id).nonzero().flatten()
    assert run.numel() == 266 and ids[run[0] - 1] == model.config.boi_token_id
    assert ids[run[-1] + 1] == model.config.eoi_token_id
    text = model.config.text_config
    assert text.sliding_window == 1024 and text.layer_types[5::6] == ["full_attention"] * 10
    layers = model.model.language_model.layers
    assert (layers[5].self_attn.k_proj.out_features, layers[0].self_attn.k_proj.out_features) == (4 * 512, 16 * 256)
    assert layers[5].self_attn.v_proj is None  # keys as values on the full layers


def test_internvl3_5_runs_through_the_internvl_adapter():
    """InternVL3.5-8B (a Qwen3 LLM behind InternViT) at 1/8 width and two layers: a pre-LLM and an in-LLM method run
    through the InternVL adapter (Qwen3's q / k norms in the hooks), one 448 px tile of 256 tokens pruned to 16."""
    model, processor = shape_vlm("internvl3_5_8b", dtype=torch.float32, text_layers=2, vision_layers=1,
                                 width_divisor=8)
    assert type(model.config.text_config).__name__ == "Qwen3Config"
    image = square_image(448)
    for method in ("promprune", "fastv"):
        out = PrunedVLM(model, processor, method=method, budget=16).generate([image], ["Colour?"], max_new_tokens=2)
        assert out[0].visual_tokens == 16 and len(out[0].token_ids) == 2
