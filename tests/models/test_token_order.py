"""What reaches the LLM: exactly the kept tokens, in the stated order, at the stated positions.

A hook on the language model records the input embeddings; they are compared with the vision features computed
independently by plain transformers (`get_image_features`), gathered in the order the Generation reports.
"""
import copy

import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.options import RELEASED_ORDER, token_order
from promprune.models.tiny import tiny_vlm

from .test_qwen_positions import hand_positions


def llm_input(model, prep):
    """The language model's ``inputs_embeds [B, L, d]`` for a prepared batch (one forward through a hook)."""
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    handle = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            model(**prep.model_kwargs)
    finally:
        handle.remove()
    return seen["embeds"]


def plain_features(model, processor, vlm, images, prompts):
    """Per image ``[N, d]`` projected features in grid order, from transformers alone (no adapter code)."""
    batch = vlm.processed(images, prompts)
    kwargs = {"image_grid_thw": batch["image_grid_thw"]} if "image_grid_thw" in batch else {}
    batch = batch.to(model.device)
    kwargs = {k: v.to(model.device) for k, v in kwargs.items()}
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values=batch["pixel_values"], return_dict=True, **kwargs)
    return list(out.pooler_output)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["raster", "selection", "stages"])
@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_the_llm_receives_the_kept_tokens_in_order(arch, order, device, images, prompts):
    model, processor = tiny_vlm(arch)
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    vlm = PrunedVLM(model, processor, method="promprune", budget=8, token_order=order, saliency_ratio_range=(0.3, 0.7))
    prep = vlm.prepare(images, prompts)
    embeds = llm_input(model, prep)
    feats = plain_features(model, processor, vlm, images, prompts)
    ids = prep.model_kwargs["input_ids"]
    for b, stats in enumerate(prep.stats):
        kept, n_sal, salient = stats["kept"], stats["saliency_count"], stats["salient"]
        got = embeds[b][ids[b] == model.config.image_token_id]
        torch.testing.assert_close(got, feats[b][kept].to(got.dtype), rtol=1e-5, atol=1e-5)
        assert 0 < n_sal < 8  # both stages take part, or the orders would coincide
        if order == "raster":
            assert kept == sorted(kept)
        elif order == "stages":
            assert set(kept[:n_sal]) == set(salient) and kept[:n_sal] == sorted(kept[:n_sal])
            assert kept[n_sal:] == sorted(kept[n_sal:])
        else:  # selection: the salient tokens first by descending saliency, then the coverage picks
            assert set(kept[:n_sal]) == set(salient)
            saliency = prep.items[b].saliency[torch.tensor(kept[:n_sal])]
            assert torch.all(saliency[:-1] >= saliency[1:])


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("order", ["raster", "selection"])
def test_qwen_tokens_keep_their_own_positions_in_any_order(arch, order, images, prompts):
    model, processor = tiny_vlm(arch)
    vlm = PrunedVLM(model, processor, method="promprune", budget=7, token_order=order)
    prep = vlm.prepare(images, prompts)
    kw = prep.model_kwargs
    grid = vlm.processed(images, prompts)["image_grid_thw"]
    for b, stats in enumerate(prep.stats):
        valid = kw["attention_mask"][b].bool()
        expected = hand_positions(kw["input_ids"][b], kw["attention_mask"][b], model.config.image_token_id,
                                  (int(grid[b, 1]) // 2, int(grid[b, 2]) // 2), stats["kept"])
        torch.testing.assert_close(kw["position_ids"][1:, b][:, valid], expected)


def test_selection_order_changes_only_the_order_not_the_answer_set(images, prompts):
    model, processor = tiny_vlm("llava")
    raster = PrunedVLM(model, processor, method="promprune", budget=8).prepare(images, prompts).stats
    picked = PrunedVLM(model, processor, method="promprune", budget=8, token_order="selection").prepare(
        images, prompts).stats
    assert [sorted(s["kept"]) for s in picked] == [s["kept"] for s in raster]


def test_released_orders():
    assert token_order("promprune", "released") == "selection"  # its code concatenates topk and DPP picks
    assert token_order("visionzip", "released") == "stages"     # dominant in index order, then contextual
    assert token_order("divprune", "released") == token_order("vispruner", "released") == "raster"
    assert token_order("divprune", "selection") == "selection"  # an explicit order wins
    assert set(RELEASED_ORDER) >= {"promprune", "divprune", "vispruner", "visionzip"}


def test_newline_rows_need_raster_order():
    from promprune.models import validate_method

    with pytest.raises(ValueError, match="image_newline='rows'.*token_order 'raster'"):
        validate_method("promprune", 8, image_newline="rows", token_order="selection")
