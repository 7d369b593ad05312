"""The LLM receives exactly the budget; LLaVA-NeXT budget modes and newline rules."""
import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.batched_select import split_budget
from promprune.models.tiny import tiny_vlm

from .conftest import ARCHS


def llm_visual_counts(model, prep):
    """Image placeholders per row that the LLM's embedding sees (real tokens only)."""
    ids, mask = prep.model_kwargs["input_ids"], prep.model_kwargs["attention_mask"].bool()
    return ((ids == model.config.image_token_id) & mask).sum(1).tolist()


def captured_lm_lengths(model, vlm, images, prompts):
    """Sequence length the language model itself receives in the prefill (captured with a hook)."""
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].shape[1]), with_kwargs=True)
    try:
        vlm.generate(images, prompts, max_new_tokens=1)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [1, 5, 12])
def test_llm_receives_exactly_budget(arch, budget, images, prompts):
    model, processor = tiny_vlm(arch)
    full = PrunedVLM(model, processor, method=None).prepare(images, prompts)
    vlm = PrunedVLM(model, processor, method="promprune", budget=budget)
    prep = vlm.prepare(images, prompts)
    assert llm_visual_counts(model, prep) == [budget, budget]
    assert [s["visual_tokens"] for s in prep.stats] == [budget, budget]
    # text tokens are untouched: the LLM's length = longest row's text + budget
    text = [int(m.sum()) - n for m, n in zip(full.model_kwargs["attention_mask"], llm_visual_counts(model, full))]
    assert captured_lm_lengths(model, vlm, images, prompts) == max(text) + budget


def test_kept_tokens_are_the_selected_features_in_raster_order(images, prompts):
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="divprune", budget=7)
    prep = vlm.prepare(images, prompts)
    feats = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output
    for b, item in enumerate(prep.items):
        kept = prep.stats[b]["kept"]
        assert kept == sorted(kept) and len(set(kept)) == 7
        torch.testing.assert_close(feats[b], item.run[kept])


@pytest.mark.parametrize("mode", ["per_crop", "global", "adaptive_views"])
def test_llava_next_budget_modes(mode, images, prompts):
    model, processor = tiny_vlm("llava_next")
    budget = 11
    prep = PrunedVLM(model, processor, method="saliency_only", budget=budget, budget_mode=mode).prepare(
        images, prompts)
    assert llm_visual_counts(model, prep) == [budget, budget]
    for b, item in enumerate(prep.items):
        per_view = torch.bincount(torch.tensor(prep.stats[b]["kept"]) // 16, minlength=int(item.groups.max()) + 1)
        if mode == "per_crop":  # 11 over 5 views -> 3,2,2,2,2; over 3 views -> 4,4,3
            counts = [int((item.groups == v).sum()) for v in range(len(per_view))]
            assert per_view.tolist() == split_budget(budget, counts)
        if mode == "global":  # one top-k over all candidates
            top = item.saliency.topk(budget).indices.sort().values
            assert prep.stats[b]["kept"] == sorted(item.grid_index[top].tolist())


def test_llava_next_newline_rows(images, prompts):
    model, processor = tiny_vlm("llava_next")
    prep = PrunedVLM(model, processor, method="saliency_only", budget=6, image_newline="rows").prepare(
        images, prompts)
    for b, item in enumerate(prep.items):
        n_rows = len({int(item.row_of_run[item.run_pos[item.grid_index.tolist().index(g)]])
                      for g in prep.stats[b]["kept"]} - {-1})
        assert prep.stats[b]["visual_tokens"] == 6 + n_rows  # each kept crop row brings its newline


def test_split_budget_hand_worked():
    assert split_budget(11, [16, 16, 16, 16, 16]) == [3, 2, 2, 2, 2]
    assert split_budget(10, [2, 16, 16]) == [2, 4, 4]  # a small view's unused share goes to the others
    assert split_budget(100, [3, 4]) == [3, 4]  # never more than available
    assert split_budget(6, [16, 16], weights=[0.75, 0.25]) == [5, 1]  # 4.5 / 1.5 -> ties go to the first
    assert split_budget(0, [4, 4]) == [0, 0]


def test_merging_method_feeds_merged_features(images, prompts):
    """VisionZip's merged contextual tokens, not the raw ones, reach the LLM, after its projected CLS
    (tests/models/test_vision_features.py recomputes them from the vision tower)."""
    import promprune

    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="visionzip", budget=8)
    prep = vlm.prepare(images, prompts)
    feats = prep.model_kwargs["mm_encoder_outputs"]["image"].pooler_output
    items = prep.items
    vision = promprune.VisionFeatures(hidden=torch.stack([it.vision for it in items]),
                                      keys=torch.stack([it.keys for it in items]),
                                      cls=torch.cat([it.cls for it in items]), project=items[0].project)
    sel = promprune.select(torch.stack([it.features for it in items]), torch.stack([it.saliency for it in items]),
                           budget=8, method="visionzip", vision=vision)
    for b in range(len(items)):
        torch.testing.assert_close(feats[b], torch.cat([sel.cls[b][None], sel.features[b]]))
        assert prep.stats[b]["kept"] == sel.indices[b].tolist() and prep.stats[b]["visual_tokens"] == 8


def test_a_budget_that_keeps_every_token_of_an_image_warns(images, prompts):
    """LLaVA-1.5 gives every image one fixed grid: a budget at or above it prunes nothing (the LLM gets the unpruned
    count, counted here from the processor's placeholders) and says so; one token fewer prunes and is silent."""
    import warnings

    from promprune.models import FullBudgetWarning

    model, processor = tiny_vlm("llava")
    grid = llm_visual_counts(model, PrunedVLM(model, processor, method=None).prepare(images, prompts))[0]
    with pytest.warns(FullBudgetWarning, match=f"budget {grid} keeps all {grid} visual tokens"):
        full = PrunedVLM(model, processor, method="promprune", budget=grid)
    assert llm_visual_counts(model, full.prepare(images, prompts)) == [grid, grid]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FullBudgetWarning)
        pruned = PrunedVLM(model, processor, method="promprune", budget=grid - 1)
        PrunedVLM(model, processor, method=None)
    assert llm_visual_counts(model, pruned.prepare(images, prompts)) == [grid - 1, grid - 1]
