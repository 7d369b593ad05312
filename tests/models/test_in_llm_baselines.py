"""DART, PyramidDrop and SparseVLM inside the LLM: pivots, stage counts, ranking layers and positions, worked by hand
and against plain transformers forwards."""
import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from promprune.models import PrunedVLM
from promprune.models.llm_hooks import (
    dart_keep,
    fastv_layer,
    make,
    pyramid_average,
    pyramid_ratio_for_average,
)
from promprune.models.tiny import tiny_vlm

N_VISUAL = 36  # the tiny LLaVA's 6 x 6 grid


def test_dart_pivots_and_least_similar_picks_by_hand():
    # columns 0..7: 1-5 visual, 6-7 text after the image; states on the unit circle at the given angles (degrees)
    angles = torch.tensor([0.0, 0, 10, 90, 100, 180, 85, 170])
    hidden = torch.stack([torch.cos(torch.deg2rad(angles)), torch.sin(torch.deg2rad(angles))], dim=1)
    keys = torch.tensor([0.0, 1, 5, 2, 3, 1, 4, 9])  # L1 key norms
    cand, text = torch.arange(1, 6), torch.tensor([6, 7])
    # image pivot: column 2 (norm 5); text pivot: column 7 (norm 9); pivots in column order: 2, then 7;
    # 2 picks, one each: least similar to 2 (10 deg) among {1, 3, 4, 5} is 5 (180 deg); to 7 (170 deg) among
    # {1, 3, 4}: 1 (0 deg)
    assert dart_keep(keys, hidden, cand, text, 1, 1, 3).tolist() == [2, 5, 1]
    # 4 kept: 3 picks, the first pivot takes the remainder: 2 -> {5, 4 (100 deg)}, 7 -> {1}
    assert dart_keep(keys, hidden, cand, text, 1, 1, 4).tolist() == [2, 5, 4, 1]


def _reference_dart(model, inputs, layer, n_img, n_txt, n_keep):
    """DART's kept grid indices from a plain forward: keys of layer - 1 (k_proj + rotary of the unpruned sequence)
    and the input of ``layer`` through the final norm; the pivot loop as the released code writes it (sets)."""
    twin = copy.deepcopy(model)
    keys = []
    attn = twin.model.language_model.layers[layer - 1].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, a, out: keys.append(out))
    with torch.inference_mode():
        out = twin(**inputs, output_hidden_states=True)
    hook.remove()
    L = inputs["input_ids"].shape[1]
    k = keys[0].view(1, L, -1, attn.head_dim).transpose(1, 2)
    cos, sin = twin.model.language_model.rotary_emb(k, torch.arange(L)[None])
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    norms = k[0].abs().sum(dim=(0, 2))  # [L]
    states = twin.model.language_model.norm(out.hidden_states[layer][0])  # [L, D]
    run = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten().tolist()
    text = list(range(run[-1] + 1, L))
    img = sorted(run, key=lambda c: -norms[c].item())[:n_img]
    txt = sorted(text, key=lambda c: -norms[c].item())[:n_txt]
    kept, left = set(img), [c for c in run if c not in img]
    need, pivots = n_keep - n_img, sorted(img + txt)
    for p, pivot in enumerate(pivots):
        share = need // len(pivots) + (1 if p < need % len(pivots) else 0)
        sims = {c: torch.nn.functional.cosine_similarity(states[c], states[pivot], dim=0).item() for c in left}
        take = sorted(left, key=lambda c: sims[c])[:share]
        kept |= set(take)
        left = [c for c in left if c not in take]
    return sorted(run.index(c) for c in kept)


@pytest.mark.parametrize("budget", [6, 9])
def test_dart_keeps_what_a_plain_forward_gives(budget, images, prompts):
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="dart", budget=budget, pivot_image=2, pivot_text=2)
    got = vlm.generate(images[:1], prompts[:1], max_new_tokens=1)[0]
    assert got.visual_tokens == budget
    # the default K: FastV's 2 of 32 layers scaled to the depth (round(2 * 4 / 32) = 0, at least 1: K = 1 of 4)
    assert fastv_layer(len(model.model.language_model.layers)) == 1
    assert got.kept == _reference_dart(model, vlm.inputs(images[:1], prompts[:1]), 1, 2, 2, budget)


def test_dart_explicit_layer_is_absolute(images, prompts):
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="dart", budget=6, pivot_image=2, pivot_text=2, layer=2)
    got = vlm.generate(images[:1], prompts[:1], max_new_tokens=1)[0]
    assert got.kept == _reference_dart(model, vlm.inputs(images[:1], prompts[:1]), 2, 2, 2, 6)


def test_dart_released_count():
    # max_num_trunction = budget: pivot_image + (pivot_image + pivot_text) * (budget // (pivot_image + pivot_text))
    model, _ = tiny_vlm("llava")
    ids = torch.full((1, 50), 5)
    ids[0, 3:3 + N_VISUAL] = model.config.image_token_id
    pruner = make("dart", model, ids, 13, {"budget_semantics": "released", "pivot_image": 2, "pivot_text": 2})
    assert pruner.stages[0].targets == [2 + 4 * 3]  # 14 tokens for a budget of 13 (132 for 128 on LLaVA-1.5)
    assert make("dart", model, ids, 13, {}).stages[0].targets == [13]


def test_pyramiddrop_stage_counts_by_hand():
    model, _ = tiny_vlm("llava")  # 4 layers: the released 8, 16, 24 of 32 become 1, 2, 3
    ids = torch.full((1, 50), 5)
    ids[0, 3:3 + N_VISUAL] = model.config.image_token_id
    exact = make("pyramiddrop", model, ids, 5, {})
    assert [s.layer for s in exact.stages] == [1, 2, 3]
    assert [s.targets[0] for s in exact.stages] == [20, 10, 5]  # 5 / 0.5^2, 5 / 0.5, 5
    assert [s.targets[0] for s in make("pyramiddrop", model, ids, 12, {}).stages] == [36, 24, 12]  # capped at N
    # released: int(N lambda^s), lambda set so that the layer average is the budget
    assert pyramid_average(576, 0.5, [8, 16, 24], 32) == (576 + 288 + 144 + 72) / 4 == 270
    lam = pyramid_ratio_for_average(576, 270, [8, 16, 24], 32)  # the largest lambda giving these counts
    assert [int(576 * lam ** s) for s in (1, 2, 3)] == [288, 144, 72]
    released = make("pyramiddrop", model, ids, 18, {"budget_semantics": "released"})
    counts = [s.targets[0] for s in released.stages]
    assert (N_VISUAL + sum(counts)) / 4 <= 18 and counts == sorted(counts, reverse=True)
    with pytest.raises(ValueError, match="at least 9"):
        make("pyramiddrop", model, ids, 8, {"budget_semantics": "released"})


def test_pyramiddrop_released_floors_a_late_stage_to_no_token_and_says_so():
    """Released semantics keep int(N lambda^s), floored as released: 36 tokens at budget 12 on 4 layers need
    36 + a + b + c <= 48; a = 11 forces lambda >= 11/36, so b >= 3 (14 > 12): a = 10, then b = 3 would need
    lambda >= sqrt(3/36) and 13 > 12, so b = 2 and c = int(36 lambda^3) < 1 = 0. Kept, and warned about."""
    model, _ = tiny_vlm("llava")
    ids = torch.full((1, 50), 5)
    ids[0, 3:3 + N_VISUAL] = model.config.image_token_id
    with pytest.warns(UserWarning, match=r"keeps no visual token after its stage at layer 3 .*\[10, 2, 0\] of 36.*"
                                         "budget_semantics='exact'"):
        released = make("pyramiddrop", model, ids, 12, {"budget_semantics": "released"})
    assert [s.targets[0] for s in released.stages] == [10, 2, 0]


def test_a_pyramiddrop_released_budget_no_image_can_run_is_refused_at_construction(images, prompts):
    """The tiny LLaVA's every image gives 36 tokens; its first stage at layer 1 of 4 already averages 36 / 4 = 9 of
    them, so a released budget below 9 failed every sample at generate (construction passed). It is refused at
    construction now, by ``vlm.construction_problems`` (what the preflight runs), naming the budget. Where the count
    depends on the image (Qwen2.5-VL without ``image_tokens``: no known floor) it is still each sample's, at run
    time."""
    from promprune.models.options import OptionError, validate_method
    from promprune.models.vlm import construction_problems

    model, processor = tiny_vlm("llava")
    want = ("no image can run: each gives this model at least 36 visual tokens, and pyramiddrop's released budget "
            "semantics average the visual tokens over the LLM's layers: with 36 tokens and the first stage at layer 1 "
            "of 4 the average is at least 9, above the budget 8; use budget_semantics='exact' or earlier 'layers'")
    with pytest.raises(OptionError) as raised:
        PrunedVLM(model, processor, method="pyramiddrop", budget=8, budget_semantics="released")
    assert raised.value.option == "budget" and str(raised.value) == want
    problems = construction_problems(model.config, "pyramiddrop", 8,
                                     *validate_method("pyramiddrop", 8, budget_semantics="released"), views=1)
    assert [str(p) for p in problems] == [want]
    for budget, options in [(12, {"budget_semantics": "released"}), (8, {}), (1, {})]:  # at the floor; exact
        assert not construction_problems(model.config, "pyramiddrop", budget,
                                         *validate_method("pyramiddrop", budget, **options), views=1)
    for method in ("fastv", "sparsevlm", "dart"):  # no schedule of theirs refuses a budget by the token count
        assert not construction_problems(model.config, method, 4, *validate_method(method, 4), views=1)
    qwen, qwen_processor = tiny_vlm("qwen2_5_vl")
    vlm = PrunedVLM(qwen, qwen_processor, method="pyramiddrop", budget=2, budget_semantics="released")
    with pytest.raises(ValueError, match="above the budget 2"):
        vlm.generate(images, prompts, max_new_tokens=2)


@pytest.mark.filterwarnings("ignore:pyramiddrop with budget_semantics='released' keeps no visual token")
def test_pyramiddrop_released_refuses_at_construction_only_what_every_image_fails_and_the_rest_per_sample():
    """Released semantics refuse a budget below n x 1 / 4 (first stage at layer 1 of the tiny LLM's 4), and n varies
    with the image on LLaVA-NeXT: the tiny model's placeholders (newlines included) are 16 for an 8 x 200 image (the
    base view, its crops unpadded to nothing), 56 for 64 x 30, 70 for 40 x 56 and 88 for 64 x 64. Construction used
    the capacity, 80 (newlines not counted): it refused budget 15, which the first two images run (4, 14 <= 15), and
    passed 21, which the 64 x 64 image fails (22). Now construction refuses only below the base view's floor (16 / 4 =
    4: budget 3, every image), and a budget some images fail runs the others, each failing image one failed sample
    naming its count (``generate_items``' isolation, as the pipeline runs), not a refusal of the trial."""
    from promprune.eval.generation import Item, generate_items
    from promprune.models.options import validate_method
    from promprune.models.vlm import construction_problems

    from .conftest import make_image

    model, processor = tiny_vlm("llava_next")
    sizes = [(8, 200), (64, 30), (40, 56), (64, 64)]
    counts = [int((processor(images=[make_image(*s, 0)], text=["<image>"], return_tensors="pt")["input_ids"]
                   == model.config.image_token_id).sum()) for s in sizes]
    assert counts == [16, 56, 70, 88]

    def problems(budget):
        return [str(p) for p in construction_problems(
            model.config, "pyramiddrop", budget, *validate_method("pyramiddrop", budget, budget_semantics="released"),
            views=5)]

    assert problems(3) == ["no image can run: each gives this model at least 16 visual tokens, and pyramiddrop's "
                           "released budget semantics average the visual tokens over the LLM's layers: with 16 tokens "
                           "and the first stage at layer 1 of 4 the average is at least 4, above the budget 3; use "
                           "budget_semantics='exact' or earlier 'layers'"]
    assert problems(4) == problems(15) == problems(21) == []
    from promprune.models.adapters import visual_token_floor

    internvl, internvl_processor = tiny_vlm("internvl")  # a one-tile image has no thumbnail: one tile's 16 tokens
    ids = internvl_processor(images=[make_image(20, 20, 0)], text=["<IMG_CONTEXT>"], return_tensors="pt")["input_ids"]
    assert visual_token_floor(internvl.config) == int((ids == internvl.config.image_token_id).sum()) == 16
    assert visual_token_floor(tiny_vlm("qwen2_5_vl")[0].config) is None  # no known floor: every image per sample
    items = [Item(prompt="Colour?", image=make_image(*s, 0), gen_kwargs={"max_new_tokens": 2}) for s in sizes]
    for budget, fails in [(15, [False, False, True, True]), (21, [False, False, False, True])]:
        vlm = PrunedVLM(model, processor, method="pyramiddrop", budget=budget, budget_semantics="released")
        answers = generate_items(vlm, items, batch_size=4)
        assert [a.failed for a in answers] == fails
        for answer, n in zip(answers, counts):
            if answer.failed:
                assert answer.prediction == "" and f"with {n} tokens and the first stage at layer 1 of 4 the average " \
                    f"is at least {n / 4:g}, above the budget {budget}" in answer.error
            else:  # ran, its own count at the first layer
                assert answer.layer_visual_tokens[0] == n


def test_the_most_visual_tokens_an_image_gives_count_llava_next_newlines_as_the_processor_writes_them():
    """The in-LLM methods prune the prompt's placeholders, one ``image_newline`` per row of the unpadded crop grid
    included, so the most an image gives them is more than the capacity (80 on the tiny LLaVA-NeXT: 16 x 5 views).
    Plain transformers, the processor's ``<image>`` placeholders: an image of a pinpoint's own aspect ratio keeps its
    whole crop grid, 16 + 64 + 8 rows = 88 for 2 x 2 crops (64 x 64), 16 + 32 + 8 = 56 for 2 x 1 (64 x 32), 16 + 32 +
    4 = 52 for 1 x 2 (32 x 64), and no size of a grid of aspect ratios gives more than 88; llava-v1.6 (336 px, 2 x 2
    crops at most): 576 + 2304 + 48 = 2928 for a 672 x 672 image, which no other size exceeds."""
    from promprune.models.adapters import visual_token_capacity, visual_token_ceiling
    from promprune.models.shapes import shape_vlm

    from .conftest import make_image

    model, processor = tiny_vlm("llava_next")

    def placeholders(sizes):
        batch = processor(images=[make_image(h, w, 0) for h, w in sizes], text=["<image>"] * len(sizes),
                          return_tensors="pt", padding=True)
        return (batch["input_ids"] == model.config.image_token_id).sum(1).tolist()

    assert placeholders([(64, 64), (64, 32), (32, 64)]) == [88, 56, 52]
    side = [4, 9, 16, 30, 32, 33, 47, 64, 65, 100, 128, 200, 640]
    assert max(placeholders([(h, w) for h in side for w in side])) == 88
    assert visual_token_capacity(model.config) == 80 and visual_token_ceiling(model.config) == 88

    shape, processor = shape_vlm("llava_next_7b", device="meta")
    config = shape.config
    ids = processor(images=[make_image(672, 672, 0)], text=["<image>"], return_tensors="pt")["input_ids"]
    assert int((ids == config.image_token_id).sum()) == 2928 == visual_token_ceiling(config)

    def count(h, w):  # what the processor writes for an h x w image: its count, less the CLS "default" drops
        return processor._get_number_of_features(h, w, 336, 336) - (processor.vision_feature_select_strategy ==
                                                                     "default")

    side = [100, 336, 500, 672, 700, 1008, 1300, 2000, 4000]
    assert count(672, 672) == 2928 and max(count(h, w) for h in side for w in side) == 2928


@pytest.mark.filterwarnings("ignore:pyramiddrop with budget_semantics='released' keeps no visual token")
def test_a_released_budget_only_larger_images_fail_is_said_at_construction_with_the_first_count_that_fails():
    """Released semantics fail an image of n tokens when n x 1 / 4 (the tiny LLM's first stage at layer 1 of 4)
    exceeds the budget: at budget 15 every n from 61 (61 / 4 = 15.25), which the tiny LLaVA-NeXT's 64 x 64 image (88)
    and 40 x 56 one (70) reach, while its floor (16) and 64 x 30 (56) run. Construction passes it (some images run)
    and says, once, which images will be failed samples; exact semantics and a budget no image runs (refused) say
    nothing here. Budget 21 fails from 85 on, which only the newline tokens reach (the 64 x 64 image: 80 candidates
    and 8 newlines): counted without them (up to 80), it was not said."""
    import warnings

    from promprune.models.options import validate_method
    from promprune.models.vlm import larger_images_problem

    model, processor = tiny_vlm("llava_next")

    def larger(budget, **options):
        return larger_images_problem(model.config, "pyramiddrop", budget,
                                     *validate_method("pyramiddrop", budget, **options))

    said = larger(15, budget_semantics="released")
    assert said.startswith("pyramiddrop at budget 15 cannot prune an image of 61 or more visual tokens (")
    assert larger(19, budget_semantics="released").startswith("pyramiddrop at budget 19 cannot prune an image of 77 ")
    assert larger(21, budget_semantics="released").startswith(
        "pyramiddrop at budget 21 cannot prune an image of 85 or more visual tokens (this model gives one up to 88)")
    assert larger(22, budget_semantics="released") is None  # 88 / 4 = 22: every image runs
    assert larger(3, budget_semantics="released") is None  # no image runs it: construction refuses it
    assert larger(15) is None  # exact semantics prune any count
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PrunedVLM(model, processor, method="pyramiddrop", budget=15, budget_semantics="released")
    assert [str(w.message) for w in caught if str(w.message).startswith("pyramiddrop at budget")] == [said]


def test_pyramiddrop_ranks_by_the_last_tokens_attention_with_the_next_layers_projections(images, prompts):
    """Stage 1 (before layer 1) keeps the top 20 by layer 1's own attention of the last token (head mean): the
    unpruned eager forward's ``attentions[1]``."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method="pyramiddrop", budget=5)
    prep = vlm.prepare(images[:1], prompts[:1])
    with torch.inference_mode(), vlm.pruning(prep) as pruner:
        vlm.model(**prep.model_kwargs)
    kept, run, att = _kept_and_attention(vlm, prep, pruner, 1, 1, images, prompts)
    scores = att[:, -1, run].mean(0)
    assert kept == sorted(scores.topk(20).indices.tolist())


def _kept_and_attention(vlm, prep, pruner, layer: int, attention: int, images, prompts):
    """``(kept grid indices at decoder layer ``layer``, the image's columns, the unpruned eager forward's attention
    at layer ``attention`` [H, L, L])``: the first row's, from the pruner's record and a plain transformers twin."""
    keep, alive, _ = pruner.layer_cols[layer]
    ids = prep.model_kwargs["input_ids"][0]
    run = (ids == vlm.model.config.image_token_id).nonzero().flatten()
    kept = sorted(run.tolist().index(c) for c in keep[0][alive[0]].tolist() if c in run.tolist())
    twin = copy.deepcopy(vlm.model)
    twin.set_attn_implementation("eager")
    with torch.inference_mode():
        att = twin(**vlm.inputs(images[:1], prompts[:1]), output_attentions=True).attentions[attention]
    return kept, run, att[0]


def test_sparsevlm_cuts_after_its_ranking_layer_by_that_layers_raters(images, prompts):
    """SparseVLM's released code (Gumpest/SparseVLMs@26a5f48, USE_VERSION 1_0) runs its pruning layer l on every token,
    ranks with l's own attention and prunes l's output: ``layers=[3]`` (the cut before layer 3) is its pruning_loc 2.
    Layers 0-2 see every token, layer 3 the kept ones: the top 5 by the raters' attention in the unpruned eager
    forward's ``attentions[2]`` (raters: the text rows after the image whose attention to the image is at least their
    mean, head-averaged; a visual token's score: its head and rater mean)."""
    model, processor = tiny_vlm("llava")
    layers = model.model.language_model.layers
    seen = {}

    def recorder(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, kwargs["hidden_states"].shape[1])
        return hook

    vlm = PrunedVLM(model, processor, method="sparsevlm", budget=5, layers=[3], recycle_ratio=0.0)
    prep = vlm.prepare(images[:1], prompts[:1])
    hooks = [layers[i].self_attn.register_forward_pre_hook(recorder(i), with_kwargs=True) for i in range(4)]
    try:
        with torch.inference_mode(), vlm.pruning(prep) as pruner:
            vlm.model(**prep.model_kwargs)
    finally:
        for h in hooks:
            h.remove()
    full = seen[0]
    assert [seen[i] for i in range(4)] == [full, full, full, full - N_VISUAL + 5]
    kept, run, att = _kept_and_attention(vlm, prep, pruner, 3, 2, images, prompts)
    text = torch.arange(int(run.max()) + 1, att.shape[-1])
    to_image = att[:, text][:, :, run].sum(-1).mean(0)  # [R] each text row's attention to the image
    raters = text[to_image >= to_image.mean()]
    scores = att[:, raters][:, :, run].mean(dim=(0, 1))
    assert kept == sorted(scores.topk(5).indices.tolist())


# visual tokens each of the tiny LLaVA's 4 layers sees at budget 5: PyramidDrop's stages before layers 1, 2, 3;
# SparseVLM cut before layer 2 (ranked at layer 1, which runs on every token)
SEEN_VISUAL = {"pyramiddrop": ({}, [36, 20, 10, 5]),
               "sparsevlm": ({"layers": [2], "recycle_ratio": 0.0}, [36, 36, 5, 5])}


@pytest.mark.parametrize("method", sorted(SEEN_VISUAL))
@pytest.mark.parametrize("positions", ["released", "original"])
def test_released_positions_renumber_the_kept_sequence(method, positions, images, prompts):
    """Released (PyramidDrop's code; SparseVLM's USE_VERSION 1_0: position_ids[:, :len(kept)]): the kept sequence is
    renumbered 0..L_l - 1 at every layer and decoding continues from L_l, each layer's cache length; original (FastV's
    rule; SparseVLM's 2_0 "keep position id"): kept tokens keep their prompt positions."""
    model, processor = tiny_vlm("llava")
    layers = model.model.language_model.layers
    rope = model.model.language_model.rotary_emb
    options, visual = SEEN_VISUAL[method]
    seen = {}

    def recorder(i):
        def hook(module, args, kwargs):
            seen.setdefault(i, []).append((kwargs["hidden_states"].shape[1], kwargs["position_embeddings"][0]))
        return hook

    hooks = [layers[i].self_attn.register_forward_pre_hook(recorder(i), with_kwargs=True) for i in range(4)]
    try:
        PrunedVLM(model, processor, method=method, budget=5, positions=positions, **options).generate(
            images[:1], prompts[:1], max_new_tokens=3)
    finally:
        for h in hooks:
            h.remove()
    full = seen[0][0][0]
    for i in range(4):
        length, cos = seen[i][0]
        assert length == full - N_VISUAL + visual[i]
        contiguous = rope(cos, torch.arange(length)[None])[0]
        if positions == "released" or visual[i] == N_VISUAL:  # (before any cut the two agree)
            torch.testing.assert_close(cos, contiguous)
            for step, (_, cos_step) in enumerate(seen[i][1:]):  # decoding: position L_i + step
                torch.testing.assert_close(cos_step, rope(cos, torch.tensor([[length + step]]))[0])
        else:
            assert not torch.allclose(cos, contiguous)


def test_an_in_llm_method_the_hooks_do_not_implement_is_refused_by_name():
    """``register_in_llm_method`` is documented for in-LLM methods, but the hooks implement the four built-ins by name
    and others only by a score they register (``test_in_llm_scored``): a fifth name with FastV's options and no score
    failed in PrunedVLM with a bare KeyError 'layers' (and the sweep's --validate-only with a traceback through its
    preflight); one with SparseVLM's options ran SparseVLM's hooks under its own name, without a word. Refused as it
    registers, saying how to register a score; one in the registry all the same (written into it) is refused by
    ``validate_method`` (PrunedVLM before any weight loads, the sweep spec's check as the trial's problem) and by each
    entry point of the hooks, before any option of it is read."""
    from types import SimpleNamespace

    import promprune
    from pipelines import spec as specs
    from promprune.models import llm_hooks
    from promprune.models.options import validate_method
    from promprune.selection import registry

    builtin = {m for m in promprune.methods("in_llm") if promprune.method_spec(m).score is None}
    assert set(llm_hooks.STAGE_KINDS) == set(registry.IN_LLM_HOOKED) == builtin
    refused = (r"in-LLM method 'mine' has no hooks to prune with: .*promprune.models.llm_hooks's, implement fastv, "
               r"sparsevlm, dart, pyramiddrop by name, and any other in-LLM method by the score it registers\. "
               r"Register yours with register_in_llm_method\(name, score=fn, layers=\.\.\., options=\.\.\.\): .*"
               r"registers with promprune.register_method instead")
    with pytest.raises(ValueError, match=refused):
        registry.register_in_llm_method("mine", description="my FastV variant", options={"layer": 2})
    assert "mine" not in promprune.methods(None)
    sparse = promprune.method_spec("sparsevlm")
    for options, choices in (({"layer": 2}, {}), (dict(sparse.options), dict(sparse.choices))):
        registry._REGISTRY["mine"] = registry.MethodSpec("mine", None, options=options, choices=choices,
                                                         stage=registry.IN_LLM)
        try:
            with pytest.raises(ValueError, match=refused):
                validate_method("mine", 8)
            with pytest.raises(ValueError, match=refused):
                PrunedVLM.from_pretrained("tiny:llava", method="mine", budget=8)
            with pytest.raises(ValueError, match=refused):
                llm_hooks.schedule("mine", 4, 8, {})
            with pytest.raises(ValueError, match=refused):
                llm_hooks.stage_layers(SimpleNamespace(num_hidden_layers=4, model_type="llama"), "mine", options)
            with pytest.raises(ValueError, match=refused):
                llm_hooks.make("mine", None, torch.zeros(1, 4, dtype=torch.long), 8, {})
            with pytest.raises(specs.SpecError) as info:
                specs.parse({"name": "s", "version": 1, "model": {"pretrained": "tiny:llava"}, "baseline": False,
                             "trials": [{"method": "mine", "budget": 8}]})
            assert any(e.startswith("trial mine-b8: in-LLM method 'mine' has no hooks to prune with: ")
                       for e in info.value.errors), info.value.errors
        finally:
            registry._REGISTRY.pop("mine", None)
    for method in promprune.methods("in_llm"):  # the built-ins keep their hooks
        assert llm_hooks.hooks_problem(method) is None and validate_method(method, 64)
