"""VisPruner and VisionZip read the vision tower's own features, and LLaVA-NeXT's budget modes, through the real
adapters of the tiny models: each selection is recomputed here by a naive transcription of the released algorithm
from plain transformers outputs (an eager twin of the vision tower for attention, hidden states and keys), and the
LLM's input embeddings (a hook on the language model) hold exactly the tokens that selection keeps.
"""
import copy
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from promprune.models import PrunedVLM
from promprune.models.adapters import max_views
from promprune.models.options import next_layout
from promprune.models.tiny import tiny_vlm

from .test_token_order import llm_input


# ---- naive references -------------------------------------------------------------------------------------------
def tower(model, pixel_values):
    """``(hidden [V, S, dv], keys [V, S, dk], saliency [V, S - 1])`` at the layer the projector reads (-2), from an
    eager twin of the vision tower: its hidden states, that layer's keys (k_proj of its layer-normed input, head
    mean) and the CLS row of its attention (head mean, CLS column dropped)."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    vt = twin.model.vision_tower
    with torch.inference_mode():
        out = vt(pixel_values, output_attentions=True, output_hidden_states=True)
        body = getattr(vt, "vision_model", vt)  # CLIPVisionModel or the bare transformer
        layer = body.encoder.layers[-2]  # hidden_states[-2] is its output
        k = layer.self_attn.k_proj(layer.layer_norm1(out.hidden_states[-3]))
    V, S, _ = k.shape
    heads = layer.self_attn.num_heads
    keys = k.view(V, S, heads, -1).mean(dim=2)
    return out.hidden_states[-2], keys, out.attentions[-2][:, :, 0, 1:].mean(dim=1)


def cos(a, b):
    return float(a @ b / (a.norm() * b.norm()))


def naive_vispruner(saliency, feats, budget, ratio=0.5):
    """VisPruner's released selection, sorted: floor(T r) by saliency; the rest shrinks by rounds that drop the
    min(8, R - keep) even-position tokens most similar to an odd-position one."""
    t_imp = int(budget * ratio)
    order = sorted(range(len(saliency)), key=lambda i: -float(saliency[i]))
    important, rest = order[:t_imp], order[t_imp:]
    keep = budget - t_imp
    while keep > 0 and len(rest) > keep:
        drop = min(8, len(rest) - keep)
        even, odd = rest[0::2], rest[1::2]
        score = [max(cos(feats[e], feats[o]) for o in odd) for e in even]
        survivors = sorted(range(len(even)), key=lambda i: -score[i])[drop:]
        rest = [even[i] for i in survivors] + odd
    return sorted(important + (rest if keep > 0 else []))


def naive_visionzip(saliency, hidden, keys, budget, ratio=10 / 64):
    """VisionZip's released tokens in its order, in the vision space ``[T, dv]``, and their patch indices.

    ``hidden`` / ``keys`` ``[S, .]`` with the CLS at row 0; ``saliency [S - 1]`` over the patches. The CLS and the
    top ``T - n_ctx - 1`` patches by saliency are dominant (CLS first, then ascending); the remaining patches, in
    index order, give ``n_ctx`` targets every ``R // n_ctx``; each other one joins the target whose key is most
    similar; a contextual token is its target plus the mean of those that joined it.
    """
    n_ctx = round(budget * ratio)
    top = sorted(range(len(saliency)), key=lambda i: -float(saliency[i]))[:budget - n_ctx - 1]
    dominant = sorted(top)
    remaining = [i for i in range(len(saliency)) if i not in dominant]
    step = max(1, len(remaining) // n_ctx) if n_ctx else 1
    targets = remaining[0::step][:n_ctx]
    groups = {t: [] for t in targets}
    for i in remaining:
        if i not in groups:
            groups[max(targets, key=lambda t: cos(keys[1 + i], keys[1 + t]))].append(i)
    rows = [hidden[0]] + [hidden[1 + i] for i in dominant]
    for t in targets:
        joined = groups[t]
        rows.append(hidden[1 + t] + (torch.stack([hidden[1 + i] for i in joined]).mean(0) if joined else 0))
    return torch.stack(rows), dominant + targets


def naive_divprune(feats, budget):
    """DivPrune's released max-min selection on 1 - cos, sorted: first the token farthest from its nearest
    neighbour, then each time the token farthest from the picked set."""
    unit = feats / feats.norm(dim=-1, keepdim=True)
    dist = 1 - unit @ unit.T
    n = feats.shape[0]
    first = max(range(n), key=lambda j: min(float(dist[i, j]) for i in range(n) if i != j))
    picks = [first]
    while len(picks) < budget:
        picks.append(max((j for j in range(n) if j not in picks), key=lambda j: min(float(dist[p, j]) for p in picks)))
    return sorted(picks)


def projector(model, rows):
    with torch.inference_mode():
        return model.model.multi_modal_projector(rows)


def packed_layout(model, image_size, views, n):
    """Which grid token (view * n + patch) each packed position of one image holds, -1 for image_newline:
    transformers' own packing run on index tensors."""
    ids = [torch.arange(views * n, dtype=torch.float64).view(views, n, 1)]
    packed, _ = model.model.pack_image_features(ids, image_size[None].cpu(), "default",
                                                image_newline=torch.tensor([-1.0], dtype=torch.float64))
    return packed[0][:, 0].round().long().tolist()


def image_rows(model, prep, b):
    """The LLM's input embeddings at row ``b``'s image placeholders."""
    embeds = llm_input(model, prep)
    ids = prep.model_kwargs["input_ids"][b]
    return embeds[b][ids == model.config.image_token_id]


# ---- LLaVA-1.5 --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [6, 12])
def test_vispruner_removes_duplicates_on_the_vision_towers_features(budget, images, prompts):
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="vispruner", budget=budget, token_order="released")
    prep = vlm.prepare(images, prompts)
    batch = vlm.inputs(images, prompts)
    hidden, _, saliency = tower(model, batch["pixel_values"])
    plain = projector(model, hidden[:, 1:])
    for b, stats in enumerate(prep.stats):
        want = naive_vispruner(saliency[b], hidden[b, 1:], budget)
        assert stats["kept"] == want and stats["visual_tokens"] == budget
        torch.testing.assert_close(image_rows(model, prep, b), plain[b][want], rtol=1e-5, atol=1e-5)


def test_vispruner_on_projected_features_would_differ(images, prompts):
    """The check above can tell the two feature spaces apart on these images."""
    model, processor = tiny_vlm("llava")
    batch = PrunedVLM(model, processor, method="vispruner", budget=12).inputs(images, prompts)
    hidden, _, saliency = tower(model, batch["pixel_values"])
    plain = projector(model, hidden[:, 1:])
    assert any(naive_vispruner(saliency[b], hidden[b, 1:], 12) != naive_vispruner(saliency[b], plain[b], 12)
               for b in range(len(images)))


@pytest.mark.parametrize("budget", [8, 13])
def test_visionzip_merges_vision_states_by_keys_and_feeds_the_cls_first(budget, images, prompts):
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="visionzip", budget=budget, token_order="released")
    prep = vlm.prepare(images, prompts)
    hidden, keys, saliency = tower(model, vlm.inputs(images, prompts)["pixel_values"])
    for b, stats in enumerate(prep.stats):
        rows, kept = naive_visionzip(saliency[b], hidden[b], keys[b], budget)
        got = image_rows(model, prep, b)
        assert got.shape[0] == budget == stats["visual_tokens"]
        assert stats["kept"] == kept  # the CLS is fed but has no grid index
        torch.testing.assert_close(got, projector(model, rows), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], projector(model, hidden[b, 0]), rtol=1e-5, atol=1e-5)  # the CLS


def test_other_methods_do_not_read_the_vision_features(images, prompts):
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="promprune", budget=8)
    assert not vlm.spec.reads_vision
    assert all(it.vision is None and it.cls is None for it in vlm.prepare(images, prompts).items)


# ---- LLaVA-NeXT -------------------------------------------------------------------------------------------------
def next_setup(method, budget, images, prompts, **options):
    """The tiny LLaVA-NeXT's prepared batch and, from plain transformers, each image's packed run, view count and
    packed layout."""
    model, processor = tiny_vlm("llava_next")
    vlm = PrunedVLM(model, processor, method=method, budget=budget, token_order="released", **options)
    batch = vlm.inputs(images, prompts)
    with torch.inference_mode():
        runs = model.model.get_image_features(pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"],
                                              return_dict=True).pooler_output
    n = (model.config.vision_config.image_size // model.config.vision_config.patch_size) ** 2
    views = [image_size_to_num_patches(s, model.config.image_grid_pinpoints, model.config.vision_config.image_size)
             for s in batch["image_sizes"]]
    layouts = [packed_layout(model, s, v, n) for s, v in zip(batch["image_sizes"], views)]
    return SimpleNamespace(model=model, vlm=vlm, prep=vlm.prepare(images, prompts), batch=batch, runs=runs, n=n,
                           views=views, layouts=layouts)


def test_released_next_layouts():
    assert next_layout("divprune", "released", "drop") == ("packed", "drop", True)
    # VisPruner / CDPruner / VisionZip strip "_unpad": the padding's picks fed, no newline
    assert next_layout("vispruner", "released", "all") == ("view_quota", "drop", False)
    assert next_layout("cdpruner", "released", "all") == ("view_quota", "drop", False)
    assert next_layout("visionzip", "released", "rows") == ("view_quota", "drop", False)
    assert next_layout("promprune", "released", "rows") == ("per_crop", "rows", True)  # ours: no released NeXT path
    assert next_layout("vispruner", "global", "drop") == ("global", "drop", True)  # an explicit mode wins
    assert next_layout("vispruner", "view_quota", "drop", False) == ("view_quota", "drop", False)
    assert max_views(tiny_vlm("llava_next")[0].config) == 5 and max_views(tiny_vlm("llava")[0].config) == 1


def released_spatial_packing(mask, feats, grid):
    """LLaVA's "spatial" merge without "_unpad", as VisPruner's / CDPruner's released ``prepare_inputs_labels_for_
    multimodal`` runs it on llava-v1.6, transcribed: ``mask [V, n]`` the picks of every view on its whole grid,
    ``feats [V, n, d]``, ``grid`` the crops' (rows, cols). The base view's picks in index order, then the crops viewed
    as ``[rows, cols, h, w]``, permuted to ``[rows, h, cols, w]`` (the stitched grid, padding kept) and flattened:
    their picks in its raster order. No newline."""
    rows, cols = grid
    side = int(mask.shape[1] ** 0.5)
    crop_feats = feats[1:].view(rows, cols, side, side, -1).permute(0, 2, 1, 3, 4).flatten(0, 3)
    crop_mask = mask[1:].view(rows, cols, side, side).permute(0, 2, 1, 3).flatten(0, 3)
    return torch.cat([feats[0][mask[0]], crop_feats[crop_mask]])


# (image, its crop grid (rows, cols) worked by hand from the tiny pinpoints (h, w) 32x64, 64x32, 64x64 and
# transformers' rule (the largest effective resolution, then the least waste), whether the unpadding drops rows)
NEXT_IMAGES = [((200, 700), (1, 2), True),   # 700 x 200: 1x2 and 2x2 both fit 64 x 18.3; 1x2 wastes less
               ((300, 500), (2, 2), True),   # 500 x 300: 2x2 fits 64 x 38.4, the most pixels
               ((64, 64), (2, 2), False)]    # square: the 2x2 grid, no padding


@pytest.mark.parametrize("shape,grid,padded", NEXT_IMAGES)
def test_next_vispruner_released_feeds_the_spatial_merge_without_unpadding(shape, grid, padded):
    """budget_mode released (VisPruner's llava-v1.6 code strips "_unpad"): every view's budget // 5 picks on its whole
    grid, the padding's included, no image_newline, base view first then the crops' stitched grid in raster order:
    exactly budget // 5 x views tokens (the budget on a 5-view image; the old layout fed 16 + 4 newlines at 20 on
    500 x 300). The LLM's input embeddings are the transcribed released packing of a naive VisPruner's picks."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

    from .conftest import make_image

    budget, per_view = 20, 4
    image = make_image(*shape, seed=7)
    t = next_setup("vispruner", budget, [image], ["What is in the picture?"], budget_mode="released")
    model, n, views = t.model, t.n, t.views[0]
    assert tuple(get_anyres_image_grid_shape(t.batch["image_sizes"][0], model.config.image_grid_pinpoints,
                                             model.config.vision_config.image_size)) == grid
    assert views == 1 + grid[0] * grid[1]
    hidden, _, saliency = tower(model, t.batch["pixel_values"][0, :views])
    mask = torch.zeros(views, n, dtype=torch.bool)
    for v in range(views):
        mask[v, naive_vispruner(saliency[v], hidden[v, 1:], per_view)] = True
    want = released_spatial_packing(mask, projector(model, hidden[:, 1:]), grid)
    stats = t.prep.stats[0]
    assert stats["visual_tokens"] == per_view * views == want.shape[0]
    if views == 5:
        assert stats["visual_tokens"] == budget
    assert sorted(stats["kept"]) == mask.flatten().nonzero().flatten().tolist()
    assert padded == any(g not in t.layouts[0] for g in stats["kept"])  # picks the unpadding would drop: fed
    got = image_rows(model, t.prep, 0)
    assert got.shape[0] == want.shape[0]  # the placeholders: what is fed, no newline
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_next_cdpruner_released_feeds_the_spatial_merge_without_unpadding(images, prompts):
    """CDPruner's released NeXT path is VisPruner's: its picks on every view's whole grid, fed in the transcribed
    spatial packing, exactly budget // 5 x views tokens."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

    budget = 10
    t = next_setup("cdpruner", budget, images, prompts, budget_mode="released")
    model, n = t.model, t.n
    hidden, _, _ = tower(model, t.batch["pixel_values"].flatten(0, 1))
    for b, stats in enumerate(t.prep.stats):
        views = t.views[b]
        grid = tuple(get_anyres_image_grid_shape(t.batch["image_sizes"][b], model.config.image_grid_pinpoints,
                                                 model.config.vision_config.image_size))  # transformers' pick
        assert stats["visual_tokens"] == 2 * views
        mask = torch.zeros(views * n, dtype=torch.bool)
        mask[stats["kept"]] = True
        per_view = mask.view(views, n).sum(1).tolist()
        assert per_view == [2] * views
        start = b * t.batch["pixel_values"].shape[1]
        want = released_spatial_packing(mask.view(views, n), projector(model, hidden[start:start + views, 1:]), grid)
        torch.testing.assert_close(image_rows(model, t.prep, b), want, rtol=1e-5, atol=1e-5)


def test_next_unpad_false_grows_the_placeholder_run_where_it_feeds_more():
    """At 15 per view the 500 x 300 image's released layout feeds 75 tokens; its unpadded prompt holds 52
    placeholders (16 + 32 unpadded + 4 newlines): the run grows to 75, and generation runs."""
    from .conftest import make_image

    image = make_image(300, 500, seed=7)
    vlm = PrunedVLM.from_pretrained("tiny:llava_next", method="vispruner", budget=75, budget_mode="released")
    image_token = vlm.model.config.image_token_id
    assert int((vlm.processed([image], ["Hi?"])["input_ids"] == image_token).sum()) == 52
    prep = vlm.prepare([image], ["Hi?"])
    assert prep.stats[0]["visual_tokens"] == 75
    assert int((prep.model_kwargs["input_ids"] == image_token).sum()) == 75
    assert image_rows(vlm.model, prep, 0).shape[0] == 75
    assert vlm.generate([image], ["Hi?"], max_new_tokens=2)[0].visual_tokens == 75


def test_unpad_false_needs_view_quota_and_no_newline():
    from promprune.models import validate_method

    for bad in (dict(budget_mode="per_crop"), dict(budget_mode="view_quota", image_newline="all")):
        with pytest.raises(ValueError, match="unpad=False .* needs budget_mode 'view_quota' and image_newline 'drop'"):
            validate_method("vispruner", 10, unpad=False, **bad)
    with pytest.raises(ValueError, match="option 'unpad' must be one of"):
        validate_method("vispruner", 10, unpad="no")
    validate_method("vispruner", 10, unpad=False, budget_mode="view_quota")
    validate_method("fastv", 10, unpad=False)  # in-LLM: the model's own packing, whatever it says
    validate_method(None, None, unpad=False)


def test_next_vispruner_view_quota_unpads_and_keeps_every_newline_when_asked(images, prompts):
    """view_quota with unpad True and image_newline "all" (our explicit options, no longer VisPruner's released
    layout): every view gets budget // 5 tokens on its whole grid (padding included); the unpadding drops the picks
    in the padding; every image_newline token stays, in the packed order."""
    budget = 15  # 3 per view
    t = next_setup("vispruner", budget, images, prompts, budget_mode="view_quota", image_newline="all")
    model, n = t.model, t.n
    assert t.vlm.view_budget == 3
    dropped_any = False
    for b, stats in enumerate(t.prep.stats):
        hidden, _, saliency = tower(model, t.batch["pixel_values"][b, :t.views[b]])
        picks = [v * n + p for v in range(t.views[b]) for p in naive_vispruner(saliency[v], hidden[v, 1:], 3)]
        layout = t.layouts[b]
        fed = [g for g in picks if g in layout]
        dropped_any |= len(fed) < len(picks)
        keep = [pos for pos, g in enumerate(layout) if g < 0 or g in fed]
        assert stats["kept"] == [layout[pos] for pos in keep if layout[pos] >= 0]
        assert stats["visual_tokens"] == len(fed) + layout.count(-1) == len(keep)
        torch.testing.assert_close(image_rows(model, t.prep, b), t.runs[b][keep], rtol=1e-5, atol=1e-5)
    assert dropped_any  # the landscape / portrait images have padding, and picks there are not fed


def test_next_divprune_released_selects_over_the_packed_sequence(images, prompts):
    budget = 9
    t = next_setup("divprune", budget, images, prompts, budget_mode="released")
    for b, stats in enumerate(t.prep.stats):
        picks = naive_divprune(t.runs[b].float(), budget)  # newline tokens are candidates too
        assert stats["visual_tokens"] == budget
        assert stats["kept"] == [t.layouts[b][p] for p in picks if t.layouts[b][p] >= 0]
        torch.testing.assert_close(image_rows(t.model, t.prep, b), t.runs[b][picks], rtol=1e-5, atol=1e-5)


SIDE = 4  # the tiny LLaVA-NeXT's view: 32 px of 8 px patches, 4 x 4


def released_visionzip_next(views_rows, dominant, grid, side=SIDE):
    """VisionZip's released llava-v1.6 packing (``prepare_inputs_labels_for_multimodal_visionzip`` with its
    ``restore_image_features_sorted``; llava-v1.6's "spatial_unpad" takes that branch, which neither unpads nor adds
    a newline), transcribed: ``views_rows [V, D + C, d]`` every view's tokens as its tower gives them (CLS, the
    D - 1 dominant patches ascending, the C contextual tokens), ``dominant [V, D - 1]`` those patches' indices,
    ``grid`` the crops' (rows, cols), ``side`` a view's patch rows. The base view as it is; then the crops' dominant
    tokens scattered into [crops, side * side] grids, viewed as [rows, cols, side, side], permuted to
    [rows, side, cols, side] (the stitched grid) and read where a token was kept; then the crops' CLS tokens
    (``image_feature[:, 0]``); then their contextual tokens crop by crop (``image_feature[:, -num_extra:]``)."""
    rows, cols = grid
    crops, num_keep = views_rows[1:], dominant.shape[1] + 1
    dim = views_rows.shape[-1]
    restored = views_rows.new_zeros(crops.shape[0], side * side, dim)
    mask = torch.zeros(crops.shape[0], side * side, dtype=torch.bool)
    mask.scatter_(1, dominant[1:].sort(dim=1).values, True)
    restored[mask] = crops[:, 1:num_keep].reshape(-1, dim)
    restored = restored.view(rows, cols, side, side, dim).permute(0, 2, 1, 3, 4).reshape(rows * side, cols * side, dim)
    mask = mask.view(rows, cols, side, side).permute(0, 2, 1, 3).reshape(rows * side, cols * side)
    return torch.cat([views_rows[0], restored[mask], crops[:, 0], crops[:, num_keep:].reshape(-1, dim)])


def test_released_visionzip_next_transcription_by_hand():
    """The transcription above on a hand-worked image of 2 x 2 patch views, base + 1 x 2 crops, 2 dominant patches
    (with the CLS: D = 3) and 1 contextual token per view. Base: dominant {1, 3}, target 0; crop 1: {1, 2}, target
    0; crop 2: {0, 3}, target 1. The stitched crop grid (2 x 4 patches) reads c1p0 c1p1 c2p0 c2p1 / c1p2 c1p3 c2p2
    c2p3, so the crops' dominant tokens come as c1p1, c2p0, c1p2, c2p3. Tokens named by grid index (view * 4 +
    patch), CLS of view v as -(v + 1)."""
    dominant = torch.tensor([[1, 3], [1, 2], [0, 3]])
    targets = [0, 0, 1]
    rows = torch.tensor([[-(v + 1.0)] + [v * 4.0 + p for p in dominant[v].tolist()] + [v * 4.0 + targets[v]]
                         for v in range(3)])[..., None]  # [3, 4, 1]
    got = released_visionzip_next(rows, dominant, (1, 2), side=2)[:, 0].tolist()
    assert got == [-1, 1, 3, 0,  5, 8, 6, 11,  -2, -3,  4, 9]


def test_next_visionzip_released_order_by_hand():
    """Our released NeXT order (``token_order`` "stages" on the stitched views of ``unpad=False``) on the
    hand-worked selection of the test above: the same 12 tokens in the same order, CLS tokens after 0 and after 7
    kept tokens."""
    import numpy as np

    from promprune.models.batched_select import _combine, _Part
    from promprune.models.architectures.llava_next import spatial_positions

    run_pos = spatial_positions(4, 3, (1, 2))  # grid index -> place in the spatial packing
    kept = [[1, 3, 0], [5, 6, 4], [8, 11, 9]]  # "stages": dominant ascending, then the target
    cls = torch.tensor([[-1.0], [-2.0], [-3.0]])
    parts = [_Part(kept=np.array(k), rows=np.arange(3) + 3 * v, count=2, entropy=None, salient=np.array(k[:2]),
                   cls=cls[v][None]) for v, k in enumerate(kept)]
    sel, rows = _combine(parts, run_pos, keep_order=True, stitched=True)
    assert sel.kept.tolist() == [1, 3, 0, 5, 8, 6, 11, 4, 9]
    assert sel.cls_at.tolist() == [0, 7, 7] and sel.cls[:, 0].tolist() == [-1, -2, -3]
    assert rows.tolist() == [0, 1, 2, 3, 6, 4, 7, 5, 8]  # each kept token's merged row goes with it
    fed = []
    for i, g in enumerate(sel.kept.tolist() + [None]):  # the fed order: each CLS before the kept token at its place
        fed += [float(c) for c, at in zip(sel.cls[:, 0].tolist(), sel.cls_at.tolist()) if at == i]
        fed += [] if g is None else [g]
    assert fed == [-1, 1, 3, 0, 5, 8, 6, 11, -2, -3, 4, 9]  # the transcription's, by hand above
    plain, _ = _combine(parts, run_pos, keep_order=True)  # not stitched: CLS first, view after view
    assert plain.kept.tolist() == [1, 3, 0, 5, 6, 4, 8, 11, 9] and plain.cls_at is None


@pytest.mark.parametrize("shape,grid,padded", NEXT_IMAGES)
def test_next_visionzip_released_feeds_its_released_layout(shape, grid, padded):
    """budget_mode and token_order released: every view budget // 5 tokens (its CLS, dominant patches on its whole
    grid, contextual tokens), fed as VisionZip's released llava-v1.6 code packs them (the transcription above):
    the base view's CLS, dominant and contextual tokens; the crops' dominant tokens in the stitched grid's raster
    order; the crops' CLS tokens; their contextual tokens crop by crop. No unpadding (the padding's picks fed), no
    newline: exactly budget // 5 x views tokens."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

    from .conftest import make_image

    budget, per_view = 20, 4  # the view's CLS + 2 dominant + 1 contextual (n_ctx = round(4 * 10 / 64) = 1)
    image = make_image(*shape, seed=7)
    t = next_setup("visionzip", budget, [image], ["What is in the picture?"], budget_mode="released")
    model, n, views = t.model, t.n, t.views[0]
    assert n == SIDE * SIDE
    assert tuple(get_anyres_image_grid_shape(t.batch["image_sizes"][0], model.config.image_grid_pinpoints,
                                             model.config.vision_config.image_size)) == grid
    hidden, keys, saliency = tower(model, t.batch["pixel_values"][0, :views])
    rows, dominant, ids = [], [], []
    for v in range(views):
        r, k = naive_visionzip(saliency[v], hidden[v], keys[v], per_view)
        rows.append(r)
        dominant.append(k[:2])
        ids.append([-1] + [v * n + g for g in k])  # what each row is: CLS (-1) or its grid index
    dominant = torch.tensor(dominant)
    want = released_visionzip_next(projector(model, torch.stack(rows)), dominant, grid)
    order = released_visionzip_next(torch.tensor(ids, dtype=torch.float64)[..., None], dominant, grid)[:, 0]
    stats = t.prep.stats[0]
    assert stats["visual_tokens"] == per_view * views == want.shape[0]
    assert stats["kept"] == [int(g) for g in order.tolist() if g >= 0]  # the CLS is fed but has no grid index
    assert padded == any(g not in t.layouts[0] for g in stats["kept"])  # picks the unpadding would drop: fed
    got = image_rows(model, t.prep, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:views], projector(model, hidden[:, 0]), atol=1e-3)  # not every CLS first


def test_next_visionzip_released_layout_alone_and_in_a_batch(images, prompts):
    """The released layout of each image does not depend on the batch: the same fed tokens alone."""
    t = next_setup("visionzip", 20, images, prompts, budget_mode="released")
    for b, (image, prompt) in enumerate(zip(images, prompts)):
        alone = t.vlm.prepare([image], [prompt])
        assert alone.stats[0]["kept"] == t.prep.stats[b]["kept"]
        torch.testing.assert_close(alone.fed[0].features, t.prep.fed[b].features, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,newline", [("view_quota", "drop"), ("view_quota", "all"), ("packed", "drop")])
def test_next_budget_mode_counts(mode, newline, images, prompts):
    """view_quota: at most budget // 5 per view whatever the image's view count (fewer where the padding's picks
    are dropped), plus every newline with "all"; packed: exactly the budget, newlines counted in it."""
    budget = 10
    t = next_setup("random", budget, images, prompts, budget_mode=mode, image_newline=newline)
    for b, stats in enumerate(t.prep.stats):
        per_view = torch.bincount(torch.tensor(stats["kept"]) // t.n, minlength=t.views[b]).tolist()
        newlines = t.layouts[b].count(-1)
        if mode == "packed":
            assert stats["visual_tokens"] == budget
        else:
            assert max(per_view) <= 2 and per_view[0] == 2  # the base view has no padding
            assert stats["visual_tokens"] == sum(per_view) + (newlines if newline == "all" else 0)
        assert image_rows(t.model, t.prep, b).shape[0] == stats["visual_tokens"]


def test_packed_refuses_methods_that_need_saliency_or_vision():
    from promprune.models import validate_method

    for method in ("promprune", "vispruner", "visionzip"):
        with pytest.raises(ValueError, match="budget_mode 'packed'"):
            validate_method(method, 8, budget_mode="packed")
    validate_method("divprune", 8, budget_mode="packed")
    model, processor = tiny_vlm("llava_next")
    with pytest.raises(ValueError, match="view_quota"):
        PrunedVLM(model, processor, method="vispruner", budget=4, budget_mode="view_quota")


@pytest.mark.parametrize("budget", [23, 31])
def test_next_visionzip_where_one_views_share_is_all_its_tokens(budget):
    """per_crop over views of 16 / 8 / 8 tokens (a wide image): at 23 or 31 tokens a small view's share is all its
    tokens (kept as they are, no CLS) while the base view's is not (its CLS and patches): the CLS of the views that
    have one were joined with torch.cat, which met the others' None (TypeError). Exactly the budget is fed, alone
    and beside another image."""
    import numpy as np
    from PIL import Image

    wide = Image.fromarray(np.random.default_rng(4).integers(0, 255, (60, 200, 3), dtype=np.uint8))
    other = Image.fromarray(np.random.default_rng(5).integers(0, 255, (64, 48, 3), dtype=np.uint8))
    vlm = PrunedVLM.from_pretrained("tiny:llava_next", method="visionzip", budget=budget)
    alone = vlm.prepare([wide], ["Hi?"])
    assert alone.stats[0]["visual_tokens"] == budget
    assert image_rows(vlm.model, alone, 0).shape[0] == budget
    both = vlm.prepare([other, wide], ["Hi?", "Hi?"])
    assert both.stats[1] == alone.stats[0]
    torch.testing.assert_close(both.fed[1].features, alone.fed[0].features, rtol=1e-5, atol=1e-6)
