"""VisPruner and VisionZip on tiny hand-made examples."""
import math

import torch

import promprune


def unit2d(degrees):
    a = torch.tensor(degrees, dtype=torch.float32) * math.pi / 180
    return torch.stack([a.cos(), a.sin()], dim=-1)


def test_vispruner_hand_example():
    # T = 8, important_ratio 0.5 -> the 4 most salient (tokens 0-3). The rest, by descending saliency, is
    # [4, 5, 6, 7, 8, 9]: R = 6 must shrink to 4, so one round drops min(8, 2) = 2 even-position tokens.
    # even = [4, 6, 8], odd = [5, 7, 9]; 4 and 6 sit 1 deg from their odd partners 5 and 7 (highest match),
    # 8 (200 deg) matches nothing well -> drop 4 and 6. New list: survivors [8] then odd [5, 7, 9].
    x = unit2d([10, 50, 130, 300, 0, 1, 90, 91, 200, 45])[None]
    s = torch.arange(10, 0, -1, dtype=torch.float32)[None]
    sel = promprune.select(x, s, budget=8, method="vispruner", order="selection")
    assert sel.indices[0].tolist() == [0, 1, 2, 3, 8, 5, 7, 9]
    assert sel.saliency_count.tolist() == [4]
    assert promprune.select(x, s, budget=8, method="vispruner").indices[0].tolist() == [0, 1, 2, 3, 5, 7, 8, 9]


def test_vispruner_multi_round_and_floor():
    # T = 3 with ratio 0.5 -> floor(1.5) = 1 important token; R = 5 -> 2 over rounds of at most 8.
    # Round 1: drop min(8, 3) = 3, even has 3 -> all even dropped: [2, 4] (odd positions of [1..5]).
    x = unit2d([0, 20, 40, 60, 80, 100])[None]
    s = torch.tensor([[6.0, 5, 4, 3, 2, 1]])
    sel = promprune.select(x, s, budget=3, method="vispruner", order="selection")
    assert sel.indices[0].tolist() == [0, 2, 4]
    assert sel.saliency_count.tolist() == [1]


def test_visionzip_merges_contextual_tokens():
    # T = 4, contextual_ratio 0.5 -> 2 dominant (tokens 0, 1 by saliency) + 2 contextual. Remaining tokens in
    # raster order [2..7], R = 6, step 3 -> targets at positions 0 and 3: tokens 2 and 5. Tokens 3, 6 point
    # like 2 (x-axis); 4, 7 like 5 (y-axis). Each target becomes itself plus the mean of the tokens that joined it
    # (the released rule: target_hidden + aggregated_hidden).
    x = torch.tensor([[9, 9], [8, -8], [1, 0], [2, 0.1], [0.1, 3], [0, 1], [1, 0.2], [0, 1]], dtype=torch.float32)
    s = torch.tensor([[10.0, 9, 1, 1, 1, 1, 1, 1]])
    sel = promprune.select(x[None], s, budget=4, method="visionzip", contextual_ratio=0.5)
    assert sel.indices[0].tolist() == [0, 1, 2, 5]
    want = torch.stack([x[0], x[1], x[2] + x[[3, 6]].mean(0), x[5] + x[[4, 7]].mean(0)])
    torch.testing.assert_close(sel.features[0], want)
    assert sel.saliency_count.tolist() == [2] and sel.cls is None


def test_visionzip_merges_the_vision_space_by_keys_and_keeps_cls():
    # The same geometry moved into the vision features: who joins whom is decided by the keys (here the
    # opposite grouping to the hidden states'), the merge runs on the hidden states and `project` maps the
    # result into the features' space. The CLS is the first dominant token: 1 + 1 by saliency + 2 contextual.
    x = torch.randn(1, 8, 3)
    hidden = torch.randn(1, 8, 5)
    keys = torch.tensor([[9, 9], [8, -8], [0, 1], [2, 0.1], [0.1, 3], [1, 0], [1, 0.2], [0, 1]])[None]
    cls = torch.randn(1, 5)
    weight = torch.randn(5, 3)
    vision = promprune.VisionFeatures(hidden=hidden, keys=keys, cls=cls, project=lambda h: h @ weight)
    s = torch.tensor([[10.0, 9, 1, 1, 1, 1, 1, 1]])
    sel = promprune.select(x, s, budget=4, method="visionzip", contextual_ratio=0.5, vision=vision)
    # dominant: token 0 only (the CLS took the other slot); rest [1..7], R = 7, step 3 -> targets 1 and 4.
    # By their keys, 3, 5, 6 (near the x axis) are closest to target 1 ([8, -8]), 2 and 7 (the y axis) to 4.
    assert sel.indices[0].tolist() == [0, 1, 4]
    h = hidden[0]
    want = torch.stack([x[0, 0], (h[1] + h[[3, 5, 6]].mean(0)) @ weight, (h[4] + h[[2, 7]].mean(0)) @ weight])
    torch.testing.assert_close(sel.features[0], want)
    torch.testing.assert_close(sel.cls, cls @ weight)
    assert sel.saliency_count.tolist() == [1]
    no_cls = promprune.select(x, s, budget=4, method="visionzip", contextual_ratio=0.5, vision=vision, keep_cls=False)
    assert no_cls.cls is None and no_cls.indices.shape[1] == 4


def test_vispruner_removes_duplicates_on_the_vision_features():
    # The hand example's geometry in the vision features, the projected features all alike: the result follows
    # the vision features.
    x = torch.ones(1, 10, 4)
    s = torch.arange(10, 0, -1, dtype=torch.float32)[None]
    vision = promprune.VisionFeatures(hidden=unit2d([10, 50, 130, 300, 0, 1, 90, 91, 200, 45])[None])
    sel = promprune.select(x, s, budget=8, method="vispruner", order="selection", vision=vision)
    assert sel.indices[0].tolist() == [0, 1, 2, 3, 8, 5, 7, 9]


def test_vision_features_are_checked_and_ignored_by_other_methods():
    x, s = torch.randn(2, 6, 4), torch.rand(2, 6)
    bad = promprune.VisionFeatures(hidden=torch.randn(2, 5, 3))
    try:
        promprune.select(x, s, budget=3, method="vispruner", vision=bad)
    except ValueError as e:
        assert "vision.hidden" in str(e)
    else:
        raise AssertionError("a mismatched vision.hidden must be refused")
    good = promprune.VisionFeatures(hidden=torch.randn(2, 6, 3))
    for method in ("promprune", "divprune"):
        assert torch.equal(promprune.select(x, s, budget=3, method=method, vision=good).indices,
                           promprune.select(x, s, budget=3, method=method).indices)


def test_visionzip_default_split_matches_paper_counts():
    x, s = torch.randn(1, 576, 16), torch.rand(1, 576)
    for budget, dominant in [(64, 54), (128, 108), (192, 162)]:
        assert promprune.select(x, s, budget=budget, method="visionzip").saliency_count.item() == dominant


def test_random_is_seeded():
    x = torch.randn(2, 40, 8)
    a = promprune.select(x, budget=10, method="random", seed=3).indices
    assert torch.equal(a, promprune.select(x, budget=10, method="random", seed=3).indices)
    assert not torch.equal(a, promprune.select(x, budget=10, method="random", seed=4).indices)
