"""LLaVA-OneVision (images): hook saliency == eager attention, the anyres-max resized crop grid, budget modes.

References come from plain transformers (an eager twin of the SigLIP tower) and from torch's own bilinear
interpolation of the stitched crop grid, not from the adapter's layout code.
"""
import copy

import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.batched_select import split_budget
from promprune.models.tiny import tiny_vlm

from .conftest import kept_per_view, make_image

SIDE, N = 4, 16  # tiny: 32 px views of 8 px patches


def eager_saliency(model, pixel_values):
    """``[V, N]``: mean attention each patch receives at the last SigLIP layer (the one the projector reads), from an
    eager twin's attention weights (heads and queries averaged)."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        out = twin.model.vision_tower(pixel_values, output_attentions=True)
    return out.attentions[-1].mean(dim=(1, 2))


def encoded(images, prompts):
    model, processor = tiny_vlm("llava_onevision")
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=4)
    batch = vlm.inputs(images, prompts)
    return model, batch, vlm.adapter.encode(batch, need_saliency=True)


def stitched(sal, rows, cols):
    """The crop views' ``[1 + rows * cols, SIDE, SIDE]`` saliency laid out as the crop grid ``[rows * SIDE, ...]``."""
    return torch.cat([torch.cat(list(sal[1 + r * cols:1 + (r + 1) * cols]), dim=1) for r in range(rows)], dim=0)


def bilinear(grid, size):
    return torch.nn.functional.interpolate(grid[None, None].double(), size, mode="bilinear")[0, 0].flatten().float()


def test_received_attention_matches_eager(images, prompts):
    """The portrait image (2x1 crops, an 8x4 grid: neither unpadded nor resized) matches the eager saliency token for
    token; the landscape one (2x2 crops, 8x8, unpadded to rows 1..6 by hand: 40 / 56 x 8 = 5.7 -> 5 rows, 1 of
    padding each side; 48 tokens > 2 x 16 x 1.21, so resized to 4x6) matches on its base view and as torch's
    bilinear resize on its crops."""
    model, batch, items = encoded(images, prompts)
    assert model.config.vision_config._attn_implementation == "sdpa"  # the hook did not force eager
    portrait, landscape = items[1], items[0]
    ref = eager_saliency(model, batch["pixel_values"][1, :3]).flatten()  # [3 * 16], view-major
    assert portrait.features.shape[0] == 48 and int(portrait.newline.sum()) == 8
    torch.testing.assert_close(portrait.saliency, ref[portrait.grid_index], atol=1e-6, rtol=1e-5)
    sal = eager_saliency(model, batch["pixel_values"][0, :5]).view(5, SIDE, SIDE)
    assert landscape.features.shape[0] == 16 + 24 and int(landscape.newline.sum()) == 4
    torch.testing.assert_close(landscape.saliency[:16], sal[0].flatten(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(landscape.saliency[16:], bilinear(stitched(sal, 2, 2)[1:7], [4, 6]), atol=1e-6,
                               rtol=1e-5)


def test_anyres_max_resizes_the_crop_grid():
    """A square 64 px image: base view + 2x2 crops (an 8x8 grid, no padding) above anyres_max_2's limit, so the model
    resizes the grid to 5x5 (+ 5 newlines): the candidates carry torch's bilinear resize of the stitched saliency,
    and each its nearest source patch's view."""
    model, batch, items = encoded([make_image(64, 64, 2)], ["q"])
    item = items[0]
    assert item.run.shape[0] == 16 + 25 + 5 and item.features.shape[0] == 16 + 25
    sal = eager_saliency(model, batch["pixel_values"][0, :5]).view(5, SIDE, SIDE)
    torch.testing.assert_close(item.saliency[:16], sal[0].flatten(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(item.saliency[16:], bilinear(stitched(sal, 2, 2), [5, 5]), atol=1e-6, rtol=1e-5)
    # resized token (i, j) samples the 8x8 grid at ((i + 0.5) * 8 / 5 - 0.5, ...): its view is that point's crop
    src = ((torch.arange(5) + 0.5) * 8 / 5 - 0.5).round().long()
    views = 1 + (src[:, None] // SIDE) * 2 + src[None, :] // SIDE
    assert item.groups[16:].tolist() == views.flatten().tolist()
    assert item.grid_index.unique().numel() == 41


@pytest.mark.parametrize("mode", ["per_crop", "global", "adaptive_views", "view_quota"])
def test_budget_modes(mode, images, prompts):
    model, processor = tiny_vlm("llava_onevision")
    budget = 9
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=budget, budget_mode=mode)
    prep = vlm.prepare(images, prompts)
    for b, item in enumerate(prep.items):
        kept = torch.tensor(prep.stats[b]["kept"])
        views = int(item.groups.max()) + 1
        per_view = kept_per_view(prep.stats[b], N, views)
        counts = [int((item.groups == v).sum()) for v in range(views)]
        if mode == "per_crop":
            assert per_view == split_budget(budget, counts)
        elif mode == "global":  # one top-k over every view's candidates
            assert sorted(kept.tolist()) == sorted(item.grid_index[item.saliency.topk(budget).indices].tolist())
        elif mode == "view_quota":  # budget // (1 + 4 crops) = 1 per view
            assert per_view == [1] * views
        assert prep.stats[b]["visual_tokens"] == (views if mode == "view_quota" else budget)


def packed_counts(config, sizes) -> list[tuple[int, int]]:
    """``(candidates, newlines)`` per image size (H, W): transformers' own ``pack_image_features`` (it reads only
    ``self.config``) run on zero features of each image's views with a newline of ones."""
    from types import SimpleNamespace

    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
        image_size_to_num_patches,
    )

    n = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    views = [image_size_to_num_patches(s, config.image_grid_pinpoints, config.vision_config.image_size) for s in sizes]
    packed, _ = LlavaOnevisionModel.pack_image_features(
        SimpleNamespace(config=config), [torch.zeros(v, n, 1) for v in views], torch.tensor(sizes),
        image_newline=torch.ones(1), vision_aspect_ratio=config.vision_aspect_ratio)
    return [(int((p == 0).sum()), int((p == 1).sum())) for p in packed]


def test_capacity_is_the_most_candidates_transformers_packs_for_any_image():
    """The declared capacity was one view's patches times the most views (tiny: 16 x 5 = 80; released 7B: 729 x 37 =
    26973), the crops counted before anyres-max resizing. Now it is the most non-newline tokens any image gives.
    Tiny, hand-worked: anyres_max_2 resizes a crop grid above 2 x 16 x 1.21 = 38.7 tokens to about 32, so the most is
    an unresized 4 x 8 (1x2 crops) or 8 x 4 (2x1) grid: 16 + 32 = 48, which the real model packs for the portrait
    64 x 30 image and which none of ~500 sizes (extreme aspect ratios included) exceeds, by the model's own count.
    Released 7B, hand-worked: 27 x 27 patches, anyres_max_9: an unresized grid holds at most 9 x 729 x 1.21 = 7938.8
    tokens; 3 x 4 crops (81 x 108) unpadded to 81 x 98 = 7938 reach it (an 1100 x 1331 image, which the processor
    gives 3 x 4 crops: it is too small for 4 x 4 to see more of it), so 729 + 7938 = 8667."""
    from promprune.models.adapters import model_capacity, visual_token_capacity
    from promprune.models.factories import model_config

    model, processor = tiny_vlm("llava_onevision")
    assert visual_token_capacity(model.config) == 48
    grid = [4, 7, 12, 20, 30, 33, 40, 56, 64, 65, 90, 128, 200, 300, 517, 1000, 2500]
    sizes = [(h, w) for h in grid for w in grid]
    counts = packed_counts(model.config, sizes)
    assert max(c for c, _ in counts) == 48
    batch = processor(images=[make_image(h, w, 0) for h, w in [(64, 30), (30, 64), (40, 56), (4, 2500), (2500, 7)]],
                      text=["<image>"] * 5, return_tensors="pt", padding=True)
    with torch.inference_mode():  # the real model: the same counts, the portrait at the capacity
        runs = model.model.get_image_features(pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"],
                                              return_dict=True).pooler_output
    newline = model.model.image_newline
    real = [(int((~(r == newline).all(-1)).sum()), int((r == newline).all(-1).sum())) for r in runs]
    assert real == packed_counts(model.config, batch["image_sizes"].tolist())
    assert real[0] == (48, 8) and max(c for c, _ in real) == 48
    placeholders = (batch["input_ids"] == model.config.image_token_id).sum(1).tolist()
    assert placeholders == [c + n for c, n in real]  # the processor's count agrees

    config = model_config("shape:llava_onevision_7b")
    assert config.vision_aspect_ratio == "anyres_max_9" and model_capacity("shape:llava_onevision_7b") == 729 + 7938
    from transformers.models.llava_onevision.modeling_llava_onevision import get_anyres_image_grid_shape
    assert get_anyres_image_grid_shape((1100, 1331), config.image_grid_pinpoints, 384) == (3, 4)
    grid = [64, 300, 384, 500, 768, 1000, 1100, 1331, 1536, 2000, 2304, 3000, 5000]
    counts = packed_counts(config, [(1100, 1331), *((h, w) for h in grid for w in grid)])
    assert counts[0] == (7938 + 729, 81) and max(c for c, _ in counts) == 8667


def test_the_capacity_counts_no_crop_grid_no_image_is_given():
    """Counting every unpadded extent of every pinpoint's grid over-counts where the even cut of the padding or the
    pinpoint transformers picks leaves that extent to no image: the released 7B config at anyres_max_8 (an unresized
    grid holds at most 8 x 729 x 1.21 = 7056.7 tokens) was given 729 + 7047, 3 x 4 crops (81 x 108) unpadded to 81 x
    87, but 108 - 87 columns of padding are not cut evenly: an image keeps 86 or 88 of them (81 x 88 = 7128 is
    resized down). The most the model's own pack_image_features gives is 729 + 7020 (a 739 x 1920 image), which no
    size of a grid of aspect ratios exceeds."""
    from promprune.models.adapters import visual_token_capacity
    from promprune.models.factories import model_config

    config = model_config("shape:llava_onevision_7b")
    config.vision_aspect_ratio = "anyres_max_8"
    assert visual_token_capacity(config) == 729 + 7020
    grid = [300, 384, 500, 739, 768, 1000, 1100, 1331, 1536, 1920, 2304, 3000]
    counts = packed_counts(config, [(739, 1920), *((h, w) for h in grid for w in grid)])
    assert counts[0][0] == 729 + 7020 and max(c for c, _ in counts) == 729 + 7020


def test_the_most_and_fewest_placeholders_an_image_gives_are_the_processors_newlines_included():
    """The in-LLM methods prune the prompt's ``<image>`` placeholders, ``image_newline`` tokens included, so the most
    an image gives them (``visual_token_ceiling``) is more than the capacity, and the fewest (``visual_token_floor``)
    may be more than the base view. Plain transformers, the processor's own placeholder counts over a grid of sizes
    and aspect ratios (extreme ones included). Tiny: the most is 16 + 32 + 8 newlines = 56 (the 64 x 30 portrait,
    an unresized 8 x 4 grid), the capacity 48; the fewest 16, the base view alone (a 7 x 64 image keeps no row of its
    1 x 2 crops' 4 patch rows). Released 7B: 729 + 7938 + 98 = 8765 (a 1200 x 988 image: 4 x 3 crops, 108 x 81
    unpadded to 98 x 81, under the anyres_max_9 resize), where the capacity, newlines not counted, is 8667; the
    fewest 729 + 27 + 1 = 757 (a 14 x 384 image keeps 1 row of a one-crop-high grid of 27 patch rows), where the
    base view counted 729."""
    from promprune.models.adapters import visual_token_capacity, visual_token_ceiling, visual_token_floor
    from promprune.models.shapes import shape_vlm

    model, processor = tiny_vlm("llava_onevision")

    def placeholders(sizes):
        batch = processor(images=[make_image(h, w, 0) for h, w in sizes], text=["<image>"] * len(sizes),
                          return_tensors="pt", padding=True)
        return (batch["input_ids"] == model.config.image_token_id).sum(1).tolist()

    assert placeholders([(64, 30), (7, 64)]) == [56, 16]
    side = [1, 4, 7, 9, 16, 30, 32, 33, 47, 64, 65, 100, 200, 640]
    counts = placeholders([(h, w) for h in side for w in side])
    assert max(counts) == 56 and min(counts) == 16
    config = model.config
    assert (visual_token_capacity(config), visual_token_ceiling(config), visual_token_floor(config)) == (48, 56, 16)

    shape, processor = shape_vlm("llava_onevision_7b", device="meta")
    config = shape.config
    assert processor.vision_feature_select_strategy == "full"  # no CLS: the processor's count is the placeholders
    ids = processor(images=[make_image(1200, 988, 0)], text=["<image>"], return_tensors="pt")["input_ids"]
    assert int((ids == config.image_token_id).sum()) == 8765 == visual_token_ceiling(config)
    assert packed_counts(config, [(1200, 988)]) == [(729 + 7938, 98)]  # the model packs as many

    def count(h, w):  # what the processor writes for an h x w image
        return processor._get_number_of_features(h, w, 384, 384)

    side = [1, 2, 5, 14, 27, 50, 100, 200, 300, 384, 500, 700, 768, 900, 988, 1000, 1100, 1200, 1331, 1393, 1536,
            1800, 2000, 2304, 3000, 5000, 10000]
    sizes = [(1200, 988), (14, 384), *((h, w) for h in side for w in side)]
    counts = [count(h, w) for h, w in sizes]
    assert counts[:2] == [8765, 757] and max(counts) == 8765 and min(counts) == 757
    assert (visual_token_capacity(config), visual_token_floor(config)) == (8667, 757)
