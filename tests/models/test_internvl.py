"""InternVL3: hook saliency == eager CLS attention, the tiles and thumbnail as views, the budget modes over tiles.

References come from plain transformers (an eager twin of InternViT, ``get_image_features``) and hand-worked tile
grids, not from the adapter's layout code: the 2x2 blocks a token merges are summed here by reshaping the patch grid,
independently of the model's ``pixel_shuffle`` that the adapter runs on an index grid.
"""
import copy

import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.adapters import visual_token_capacity
from promprune.models.batched_select import split_budget
from promprune.models.tiny import tiny_vlm
from promprune.selection.controls import pooling_matrix

from .conftest import kept_per_view


SIDE, N = 8, 16  # tiny: 32 px tiles of 4 px patches (8x8), pixel-shuffled to 4x4 tokens
# tiles of the conftest images, hand-worked from the released tiling rule (the grid of at most 12 tiles whose
# columns / rows is nearest the image's width / height; a thumbnail when there are several): the 40x56 landscape
# (1.4) is nearest 4 x 3 (1.33; 3 x 2 is 1.5), so 12 tiles + the thumbnail; the 30x64 portrait (0.47) is nearest
# 1 x 2 (0.5; 2 x 4 ties but would cover more than twice the image), so 2 tiles + the thumbnail
TILES = [13, 3]


def eager_saliency(model, pixel_values):
    """``[T, N]``: each token's saliency from an eager twin's attention weights: the CLS row of the last layer (the one
    the projector reads), head mean, CLS column dropped, summed over each 2x2 block of the 8x8 patch grid (raster
    order of the 4x4 blocks)."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        out = twin.model.vision_tower(pixel_values, output_attentions=True)
    cls = out.attentions[-1][:, :, 0, 1:].mean(dim=1)  # [T, 64]
    T = cls.shape[0]
    return cls.view(T, SIDE // 2, 2, SIDE // 2, 2).sum(dim=(2, 4)).reshape(T, N)


def encoded(images, prompts, **options):
    model, processor = tiny_vlm("internvl")
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=4, **options)
    batch = vlm.inputs(images, prompts)
    return model, batch, vlm.adapter.encode(batch, need_saliency=True)


def test_tiles_and_features_are_the_models(images, prompts):
    """Each item holds its image's tiles (thumbnail last) in the placeholder order: plain ``get_image_features``
    rows, grouped by tile."""
    model, batch, items = encoded(images, prompts)
    assert batch["pixel_values"].shape[0] == sum(TILES)
    with torch.inference_mode():
        plain = model.model.get_image_features(pixel_values=batch["pixel_values"], return_dict=True).pooler_output
    first = 0
    for item, tiles in zip(items, TILES):
        assert item.run.shape[0] == tiles * N
        torch.testing.assert_close(item.run, plain[first:first + tiles].reshape(tiles * N, -1))
        assert item.groups.tolist() == [t for t in range(tiles) for _ in range(N)]
        first += tiles


def test_cls_saliency_matches_eager(images, prompts):
    model, batch, items = encoded(images, prompts)
    assert model.config.vision_config._attn_implementation == "sdpa"  # the hook did not force eager
    ref = eager_saliency(model, batch["pixel_values"])  # [13 + 3, 16]
    torch.testing.assert_close(items[0].saliency, ref[:13].flatten(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(items[1].saliency, ref[13:].flatten(), atol=1e-6, rtol=1e-5)
    # the CLS attention of a tile sums to one over CLS + patches: the tokens carry all but the CLS's own share
    assert bool((items[1].saliency.view(3, N).sum(1) < 1).all())


def test_saliency_block_picks_another_layer(images, prompts):
    model, batch, items = encoded(images, prompts, saliency_block=0)
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        out = twin.model.vision_tower(batch["pixel_values"], output_attentions=True)
    cls = out.attentions[0][:, :, 0, 1:].mean(dim=1).view(-1, SIDE // 2, 2, SIDE // 2, 2).sum(dim=(2, 4))
    torch.testing.assert_close(items[1].saliency, cls[13:].flatten(), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"saliency_block must be a layer of the vision tower \(0 \.\. 2\)"):
        PrunedVLM(model, tiny_vlm("internvl")[1], budget=4, saliency_block=3)


@pytest.mark.parametrize("mode", ["per_crop", "global", "adaptive_views", "view_quota"])
def test_budget_modes_over_tiles(mode, images, prompts):
    model, processor = tiny_vlm("internvl")
    budget = 26
    vlm = PrunedVLM(model, processor, method="saliency_only", budget=budget, budget_mode=mode)
    prep = vlm.prepare(images, prompts)
    for b, item in enumerate(prep.items):
        kept = torch.tensor(prep.stats[b]["kept"])
        per_tile = kept_per_view(prep.stats[b], N, TILES[b])
        if mode == "per_crop":  # 26 over 13 tiles: 2 each; over 3 tiles: 9, 9, 8
            assert per_tile == split_budget(budget, [N] * TILES[b]) == ([2] * 13 if b == 0 else [9, 9, 8])
        elif mode == "global":  # one top-k over every tile's tokens
            assert sorted(kept.tolist()) == sorted(item.saliency.topk(budget).indices.tolist())
        elif mode == "adaptive_views":  # shares by each tile's entropy: every token still kept once, budget in all
            assert sum(per_tile) == budget
        else:  # view_quota: budget // (12 tiles + thumbnail) = 2 per tile, whatever the image's tile count
            assert per_tile == [2] * TILES[b]
        assert prep.stats[b]["visual_tokens"] == (2 * TILES[b] if mode == "view_quota" else budget)


def test_view_quota_reads_the_processors_tiling():
    model, processor = tiny_vlm("internvl")
    processor = copy.deepcopy(processor)
    processor.image_processor.max_patches = 6
    assert PrunedVLM(model, processor, budget=21, budget_mode="view_quota").view_budget == 3  # 21 // (6 + 1)
    assert visual_token_capacity(model.config) == 16 * 13  # config only: the released tiling (12 + thumbnail)


def test_mu_borrows_clips():
    model, processor = tiny_vlm("internvl")
    assert PrunedVLM(model, processor, budget=4).method_options["mu"] == 0.42  # uncalibrated for InternViT


def test_downsample_pools_each_tiles_grid(images, prompts):
    """Per tile (``per_crop``), the 4 x 4 token grid of each tile is pooled to its share: plain
    ``get_image_features`` rows times the pooling weights, tile after tile."""
    model, processor = tiny_vlm("internvl")
    budget = 7  # over 3 tiles: 3, 2, 2
    vlm = PrunedVLM(model, processor, method="downsample", budget=budget)
    prep = vlm.prepare(images[1:], prompts[1:])
    batch = vlm.inputs(images[1:], prompts[1:])
    with torch.inference_mode():
        plain = model.model.get_image_features(pixel_values=batch["pixel_values"], return_dict=True).pooler_output
    expected, kept = [], []
    for tile, share in enumerate(split_budget(budget, [N] * 3)):
        weights, centres = pooling_matrix(4, 4, share)
        expected.append(weights @ plain[tile].float())
        kept += (tile * N + centres).tolist()
    fed = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output[:, 0]  # [sum M, 1, d]: one token a row
    torch.testing.assert_close(fed.float(), torch.cat(expected), atol=1e-6, rtol=1e-5)
    assert prep.stats[0]["kept"] == kept


def test_the_published_shape_tiles_a_photo_into_13_tiles():
    """shape:internvl3_8b (meta device): a 640 x 480 photo is 4 x 3 tiles + the thumbnail = 13 x 256 placeholders, the
    most an image gives (``visual_token_capacity``); each token merges the 2 x 2 patch block at its place in the 32 x 32
    patch grid; ``view_quota`` at 640 gives every tile 640 // 13 = 49."""
    from PIL import Image

    from promprune.models.shapes import shape_vlm

    model, processor = shape_vlm("internvl3_8b", device="meta")
    vlm = PrunedVLM(model, processor, method="promprune", budget=640, budget_mode="view_quota")
    batch = vlm.processed([Image.new("RGB", (640, 480))], ["Describe the image."])
    assert batch["pixel_values"].shape == (13, 3, 448, 448)
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 13 * 256
    assert visual_token_capacity(model.config) == 13 * 256 and vlm.view_budget == 49
    r, c = torch.arange(16).repeat_interleave(16), torch.arange(16).repeat(16)  # token (r, c), raster order
    block = torch.stack([(2 * r + i) * 32 + 2 * c + j for i in (0, 1) for j in (0, 1)], dim=1)  # [256, 4]
    assert torch.equal(vlm.adapter.members.sort(dim=1).values, block)
