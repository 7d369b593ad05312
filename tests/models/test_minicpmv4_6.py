"""MiniCPM-V 4.6: views and runs as the processor writes them, the mergers' token order, hook saliency == eager
attention pooled by hand, the budget over views, each view's kept tokens in its own run, in-LLM methods on its hybrid
LLM kept or refused by name, clips refused, and the published shape offline.

References are plain transformers (``get_image_features``, an eager twin's attention weights, the mergers run on
crafted inputs), torch's own pooling, and counts worked by hand from the released processor's slicing rules. The family
also runs every test that parametrizes over the registered families (``tests/models/conftest.py`` ``ARCHS``):
unpruned == plain ``generate``, every method at its budget, batching, vision and prefix once.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AttentionInterface
from transformers.models.minicpmv4_6 import modeling_minicpmv4_6 as minicpm_mod

from promprune.models import PrunedVLM
from promprune.models.batched_select import split_budget
from promprune.models.shapes import shape_vlm
from promprune.models.tiny import tiny_vlm
from promprune.selection.controls import pooling_matrix

from .test_qwen3_5 import OWN, registered

# the conftest images under the tiny processor (32 px views, 2 px patches, 16x): the 56 x 40 landscape is a 12 x 20
# patch source (3 x 5 tokens) and a 2 x 2 grid of 12 x 20 slices; the 30 x 64 portrait a 24 x 12 source (6 x 3) and
# 2 x 1 slices of 16 x 16 (4 x 4)
VIEW_TOKENS = [[15, 15, 15, 15, 15], [18, 16, 16]]


def vlm_for(method="promprune", budget=6, **options):
    model, processor = tiny_vlm("minicpmv4_6")
    return PrunedVLM(model, processor, method=method, budget=budget, **options)


def runs(ids: torch.Tensor, token: int) -> list[torch.Tensor]:
    """The columns of each run of ``token`` in one row."""
    cols = (ids == token).nonzero().flatten()
    cut = (cols[1:] - cols[:-1] != 1).nonzero().flatten() + 1
    return list(torch.tensor_split(cols, cut.tolist()))


def test_views_are_the_processors_runs_and_the_models_features(images, prompts):
    vlm = vlm_for()
    model = vlm.model
    assert type(model).__name__ == "MiniCPMV4_6ForConditionalGeneration" and model.config.model_type == "minicpmv4_6"
    batch = vlm.inputs(images, prompts)
    items = vlm.adapter.encode(batch, need_saliency=False)
    with torch.inference_mode():
        plain = model.model.get_image_features(batch["pixel_values"], batch["target_sizes"]).pooler_output
    tok, first = vlm.processor.tokenizer, 0
    for ids, item, counts in zip(batch["input_ids"], items, VIEW_TOKENS):
        row_runs = runs(ids, model.config.image_token_id)
        assert [r.numel() for r in row_runs] == counts == item.groups.bincount().tolist()
        assert ids[row_runs[0][0] - 1] == tok.convert_tokens_to_ids("<image>")  # the source between image markers
        assert all(ids[r[0] - 1] == tok.convert_tokens_to_ids("<slice>") for r in row_runs[1:])
        torch.testing.assert_close(item.run, torch.cat(plain[first:first + len(counts)]))
        first += len(counts)


def test_the_mergers_emit_raster_order():
    """Perturbing one patch changes only its 2 x 2 window's token at the window merger's output; a crafted merger
    input changes only its 2 x 2 block's LLM token: both in raster order, which the saliency pooling assumes."""
    model, _ = tiny_vlm("minicpmv4_6")
    tower, merger = model.model.vision_tower, model.model.vision_tower.vit_merger
    h, w, C = 4, 6, tower.config.hidden_size
    sizes = torch.tensor([[h, w]])
    base = torch.randn(1, h * w, C, generator=torch.Generator().manual_seed(0))
    bumped = base.clone()
    bumped[0, 1 * w + 4] += 1.0  # patch (1, 4): window (0, 2), token 2 of the 2 x 3 merged grid
    with torch.inference_mode():
        changed = (merger(bumped, sizes) - merger(base, sizes)).abs().amax(dim=-1)[0]  # [6]
    assert changed.nonzero().flatten().tolist() == [2]
    final = model.model.merger
    bumped = base.clone()
    bumped[0, 3 * w + 1] += 1.0  # token (3, 1) of a 4 x 6 merger input: block (1, 0), LLM token 3 of 2 x 3
    with torch.inference_mode():
        changed = (final(bumped, sizes)[0] - final(base, sizes)[0]).abs().amax(dim=-1)
    assert changed.nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("block,kernel", [(None, 2), (0, 4)])  # the last layer (after the window merger), layer 0
def test_saliency_is_the_eager_attention_each_token_block_receives(block, kernel, images, prompts):
    """An eager twin's attention weights at the layer, averaged over heads and queries within each view, pooled over
    the block each LLM token merges (torch's avg_pool2d on the view's grid at that layer)."""
    vlm = vlm_for("saliency_only", 4, **({} if block is None else {"saliency_block": block}))
    batch = vlm.inputs(images, prompts)
    items = vlm.adapter.encode(batch, need_saliency=True)
    assert vlm.model.config.vision_config._attn_implementation == "sdpa"  # the hook did not force eager
    twin = copy.deepcopy(vlm.model)
    target = twin.model.vision_tower.encoder.layers[-1 if block is None else block].self_attn
    recorded = []

    def recording_eager(module, *args, **kwargs):
        out, weights = minicpm_mod.eager_attention_forward(module, *args, **kwargs)
        if module is target:
            recorded.append(weights[0])  # [H, n, n]: one view per call outside flash attention
        return out, weights

    AttentionInterface.register("recording_eager_minicpmv4_6", recording_eager)
    twin.model.vision_tower.config._attn_implementation = "recording_eager_minicpmv4_6"
    with torch.inference_mode():
        twin.model.get_image_features(batch["pixel_values"], batch["target_sizes"])
    stride = 4 // kernel  # patches per side of one token at that layer
    expected = []
    for weights, (h, w) in zip(recorded, batch["target_sizes"].tolist()):
        grid = weights.mean(dim=(0, 1)).view(1, h // stride, w // stride)
        expected.append(F.avg_pool2d(grid, kernel).flatten())
    torch.testing.assert_close(torch.cat([it.saliency for it in items]), torch.cat(expected), atol=1e-6, rtol=1e-5)


def test_saliency_block_and_mu():
    with pytest.raises(ValueError, match=r"saliency_block must be a layer of the vision encoder \(0 \.\. 2\)"):
        vlm_for(saliency_block=3)
    assert vlm_for().method_options["mu"] == 0.42  # borrowed from CLIP (a SigLIP tower), uncalibrated


@pytest.mark.parametrize("mode", ["per_crop", "global", "view_quota"])
def test_budget_over_the_views(mode, images, prompts):
    budget = 12
    vlm = vlm_for("saliency_only", budget, budget_mode=mode)
    prep = vlm.prepare(images, prompts)
    assert vlm.adapter.max_views() == 5  # the source + the tiny processor's 4 slices
    for b, (item, counts) in enumerate(zip(prep.items, VIEW_TOKENS)):
        per_view = torch.bincount(item.groups[torch.tensor(prep.stats[b]["kept"])], minlength=len(counts)).tolist()
        if mode == "per_crop":  # 12 over 5 views: 3, 3, 2, 2, 2; over 3: 4 each
            assert per_view == split_budget(budget, counts)
        elif mode == "global":
            assert sorted(prep.stats[b]["kept"]) == sorted(item.saliency.topk(budget).indices.tolist())
        else:  # 12 // 5 = 2 per view, whatever the image's view count
            assert per_view == [2] * len(counts)


def test_each_views_kept_tokens_stay_in_its_run(images, prompts):
    """Pruned, every view keeps its own run between its markers, as long as the tokens kept of it, fed in order."""
    vlm = vlm_for("divprune", 8)
    prep = vlm.prepare(images, prompts)
    fed = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output
    for b, item in enumerate(prep.items):
        kept = torch.tensor(prep.stats[b]["kept"])
        row_runs = runs(prep.model_kwargs["input_ids"][b], vlm.model.config.image_token_id)
        counts = torch.bincount(item.groups[kept], minlength=len(VIEW_TOKENS[b])).tolist()  # kept of each view
        assert [r.numel() for r in row_runs] == [c for c in counts if c]
        torch.testing.assert_close(fed[b], item.run[kept])


def test_downsample_pools_each_views_grid(images, prompts):
    budget = 8  # over the portrait's 3 views (6 x 3, 4 x 4, 4 x 4): 3, 3, 2
    vlm = vlm_for("downsample", budget)
    prep = vlm.prepare(images[1:], prompts[1:])
    item = prep.items[0]
    expected, kept = [], []
    for view, (shape, share) in enumerate(zip([(6, 3), (4, 4), (4, 4)], split_budget(budget, VIEW_TOKENS[1]))):
        members = (item.groups == view).nonzero().flatten()
        weights, centres = pooling_matrix(*shape, share)
        expected.append(weights @ item.run[members].float())
        kept += members[centres].tolist()
    fed = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output[0]
    torch.testing.assert_close(fed.float(), torch.cat(expected), atol=1e-6, rtol=1e-5)
    assert prep.stats[0]["kept"] == kept


@pytest.mark.parametrize("method", ["fastv", "sparsevlm", "dart", "pyramiddrop", OWN])
def test_in_llm_methods_run_on_the_hybrid_llm(method, images, prompts):
    """A scored method of one's own at its default layer cuts before layer 3, after the cache's first layer with keys
    (it cut before 1, and the first decoding step failed); PyramidDrop given layer 1 is refused as on Qwen3.5."""
    with registered(method):
        vlm = vlm_for(method, 6)
        assert vlm.pruning(vlm.prepare(images[:1], prompts[:1])).stages[0].layer > 1  # after layer 1, full attention
        out = vlm.generate(images, prompts, max_new_tokens=2)
    assert [g.visual_tokens for g in out] == [6, 6] and all(len(set(g.kept)) == 6 for g in out)
    if method == "pyramiddrop":
        with pytest.raises(ValueError, match=r"option 'layers' gives layer 1, which cuts before layer 1.* Give "
                                             r"'layers' from \[3, 5, 7\]"):
            vlm_for(method, 6, layers=[1, 3])


def test_an_in_llm_layer_ranking_at_a_linear_layer_is_refused_by_name():
    """Its LLM attends in full at layers 1, 3, 5, 7 only (linear attention between): FastV's K = 1 ranks at layer 0."""
    with pytest.raises(ValueError, match=r"in-LLM method 'fastv' on .*model type 'minicpmv4_6'.*layer 1, which ranks "
                                         r"the visual tokens at layer 0, a linear-attention layer"):
        vlm_for("fastv", 6, layer=1)


def test_clips_are_refused_by_name(images, prompts):
    with pytest.raises(ValueError, match="video needs one of llava_onevision, .*; this model is 'minicpmv4_6'"):
        vlm_for().prepare_video([[images[0]] * 2], prompts[:1])


def test_the_published_shape_offline():
    """shape:minicpm_v_4_6 on the meta device, a 640 x 480 photo by the released slicing: 307200 / 448^2 = 1.53 -> 2
    slices, 1 x 2 nearest its 4:3; the source resized to 387 x 515 -> multiples of 56: 392 x 504 px = 28 x 36 patches =
    63 tokens; each slice refined to 560 x 392 px = 40 x 28 patches = 70 tokens: 203, in three runs."""
    model, processor = shape_vlm("minicpm_v_4_6", device="meta")
    vlm = PrunedVLM(model, processor, method="promprune", budget=64)
    batch = vlm.processed([Image.new("RGB", (640, 480))], ["Describe the image."])
    assert batch["target_sizes"].tolist() == [[28, 36], [40, 28], [40, 28]]
    assert [r.numel() for r in runs(batch["input_ids"][0], model.config.image_token_id)] == [63, 70, 70]
    assert vlm.adapter.max_views() == 10 and model.config.vision_config.insert_layer_id == 6


def test_the_floor_is_the_fewest_placeholders_the_processor_writes_for_any_image():
    """MiniCPM-V 4.6 had no floor, so a PyramidDrop released budget no image can run was not refused. Its count varies
    with the image's size (a larger image is sliced) and aspect ratio. The processor's own placeholders: small images
    give their source view alone (at least 10 tokens over a grid of shapes), large ones a source and slices; the
    fewest is an ultra-wide image (1 x 4100 px: more than 4 slices x 32^2 times wider than tall), a one-token source
    and four one-token slices, 5 = the floor (released: 1 + 9)."""
    from promprune.models.adapters import visual_token_floor
    from promprune.models.options import validate_method
    from promprune.models.vlm import construction_problems

    model, processor = tiny_vlm("minicpmv4_6")
    token = model.config.image_token_id

    def placeholders(h, w):
        image = Image.new("RGB", (w, h), (120, 60, 30))
        ids = processor(images=[image], text=["<|image_pad|>"], return_tensors="pt")["input_ids"]
        return int((ids == token).sum())

    side = [1, 2, 3, 5, 8, 13, 15, 20, 31, 32]
    small = [placeholders(h, w) for h in side for w in side]
    assert min(small) == 10 and placeholders(32, 32) == 16  # no slices: the source view alone
    assert placeholders(64, 64) == 16 + 4 * 16 and placeholders(300, 40) > 16  # sliced
    assert placeholders(1, 4100) == 5 == visual_token_floor(model.config)
    assert placeholders(1, 4000) > 5  # not yet wide enough: its slices are many tokens each
    released, _ = shape_vlm("minicpm_v_4_6", device="meta")
    assert visual_token_floor(released.config) == 10
    refused = construction_problems(model.config, "pyramiddrop", 1,
                                    *validate_method("pyramiddrop", 1, budget_semantics="released"), views=5)
    assert [str(p) for p in refused][0].startswith("no image can run: each gives this model at least 5 visual tokens")
