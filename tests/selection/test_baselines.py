"""VisPruner and VisionZip on tiny hand-made examples; Random's draw."""
import hashlib
import math

import pytest
import torch

import promprune
from promprune.selection import baselines
from promprune.selection.baselines import feature_key


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_vision", [True, False])
def test_visionzip_merges_an_image_to_the_same_bits_alone_as_in_a_batch(dtype, with_vision):
    """The merge's batched product of a few target rows and the projector's one product over every image's merged
    rows summed in orders that depended on the batch: an image's merged tokens and CLS moved by an ulp or more
    (float64 2e-15, float32 5e-7) between alone and in a batch. The merge is now one segmented sum from 0 in raster
    order (``kernels.segment_sums``) and the projector runs per image: the same bits whatever the batch."""
    torch.manual_seed(1)
    B, N, d, dv = 5, 576, 256, 128
    x, s = torch.randn(B, N, d).to(dtype), torch.rand(B, N).to(dtype)
    hidden, keys, cls = (torch.randn(B, N, dv).to(dtype), torch.randn(B, N, 64).to(dtype),
                         torch.randn(B, dv).to(dtype))
    mlp = torch.nn.Sequential(torch.nn.Linear(dv, d), torch.nn.GELU(), torch.nn.Linear(d, d))  # float32 in and out
    mlp = mlp.to(torch.float64 if dtype == torch.float64 else torch.float32)  # (VisionFeatures.project)

    def run(lo, hi):
        vision = promprune.VisionFeatures(hidden[lo:hi], keys[lo:hi], cls[lo:hi], mlp) if with_vision else None
        with torch.no_grad():
            return promprune.select(x[lo:hi], s[lo:hi], budget=64, method="visionzip", vision=vision)

    batched = run(0, B)
    for lo, hi in ((0, 1), (1, 2), (4, 5), (1, 4)):
        part = run(lo, hi)
        assert torch.equal(part.indices, batched.indices[lo:hi])
        gap = (part.features - batched.features[lo:hi]).abs().max()
        assert torch.equal(part.features, batched.features[lo:hi]), gap
        if with_vision:
            assert torch.equal(part.cls, batched.cls[lo:hi])


@pytest.mark.parametrize("budget", [8, 20])
def test_visionzip_at_a_budget_of_every_token_keeps_them_as_they_are(budget):
    # select's contract, T >= N keeps every token: the CLS took a slot and a merge folded a token away before
    x, s = torch.randn(1, 8, 3), torch.rand(1, 8)
    vision = promprune.VisionFeatures(hidden=torch.randn(1, 8, 5), cls=torch.randn(1, 5),
                                      project=lambda h: h @ torch.ones(5, 3))
    sel = promprune.select(x, s, budget=budget, method="visionzip", vision=vision)
    assert sel.indices.tolist() == [list(range(8))] and sel.cls is None
    assert torch.equal(sel.features, x)
    one_less = promprune.select(x, s, budget=7, method="visionzip", vision=vision)
    assert one_less.cls is not None and one_less.indices.shape == (1, 6)  # below N the released rule: the CLS counts


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


# ---- random: the draw depends on the image (its key) and the seed, not on the features' last bits ----------------


def reference_draw(key: int, seed: int, n: int, budget: int) -> list[int]:
    """The documented draw, written out: the first T of ``randperm(N)`` from a CPU generator seeded with
    blake2b(str(key), key=str(seed)) (8 bytes, little-endian, top bit dropped)."""
    digest = hashlib.blake2b(str(key).encode(), digest_size=8, key=str(seed).encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randperm(n, generator=gen)[:budget].tolist()


def few_ulps(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``x`` with every value moved by -4..4 ulps (float32), as another CPU type or the GPU computes it."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(-4, 5, x.shape, generator=g).float()
    return x + steps * torch.finfo(torch.float32).eps * x.abs()


def random_rows(x, keys=None, budget=12, seed=0):
    return promprune.select(x, budget=budget, method="random", seed=seed, keys=keys, order="selection").indices


def test_random_with_keys_is_the_documented_draw():
    x = torch.randn(3, 50, 8)
    keys = [7, 2**62 + 5, 123456789]
    got = random_rows(x, keys, budget=12, seed=4)
    assert got.tolist() == [reference_draw(k, 4, 50, 12) for k in keys]


def test_random_with_keys_ignores_the_features_last_bits_and_dtype():
    x = torch.randn(2, 64, 16)
    keys = [11, 12]
    want = random_rows(x, keys)
    assert not torch.equal(few_ulps(x), x)
    for same_image in (few_ulps(x), x.half().float(), x.bfloat16().float(), x.half(), x.bfloat16()):
        assert torch.equal(random_rows(same_image, keys), want)


def test_random_with_keys_two_images_draw_differently_and_batching_does_not_matter():
    x = torch.randn(4, 64, 16)
    keys = [101, 102, 103, 104]
    batched = random_rows(x, keys)
    assert len({tuple(r) for r in batched.tolist()}) == 4
    for b in range(4):  # alone, and in another batch at another place
        assert torch.equal(random_rows(x[b:b + 1], keys[b:b + 1])[0], batched[b])
        others = torch.cat([x[(b + 1) % 4:(b + 1) % 4 + 1], x[b:b + 1]])
        assert torch.equal(random_rows(others, [keys[(b + 1) % 4], keys[b]])[1], batched[b])


def test_random_smaller_budget_keeps_a_subset():
    x = torch.randn(2, 64, 16)
    small = random_rows(x, [1, 2], budget=8)
    large = random_rows(x, [1, 2], budget=24)
    assert torch.equal(large[:, :8], small)


def test_random_without_keys_ignores_ulp_noise_and_tells_images_apart():
    """The fallback fingerprint: stable under a few ulps of drift on every one of 40 images, distinct draws."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 576, 32, generator=g) * 0.5 + torch.randn(40, 1, 32, generator=g) * 0.3
    want = random_rows(x)
    for seed in range(3):
        assert torch.equal(random_rows(few_ulps(x, seed)), want)
    assert len({tuple(r) for r in want.tolist()}) == 40
    assert torch.equal(random_rows(x[5:6])[0], want[5])  # batch placement does not matter


def test_feature_key_is_the_quantized_channel_means():
    # 16 channel means of 0.5 in units of the RMS (1.0) -> round(0.5 * 64) = 32 each; channel 17 is not read
    x = torch.zeros(4, 20)
    x[:, :16] = 0.5
    x[:, 16:] = math.sqrt((20 - 16 * 0.25) / 4)  # total mean square 1
    digest = hashlib.blake2b(f"4x20:{[32] * 16}".encode(), digest_size=8).digest()
    assert feature_key(x) == int.from_bytes(digest, "little") >> 1
    y = x.clone()
    y[:, 17] *= 1.0 + 1e-6
    assert feature_key(y) == feature_key(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_random_on_cuda_draws_what_the_cpu_draws():
    x = torch.randn(3, 64, 16)
    assert torch.equal(random_rows(x.cuda(), [1, 2, 3]).cpu(), random_rows(x, [1, 2, 3]))
    assert torch.equal(random_rows(x.cuda()).cpu(), random_rows(x))


@pytest.mark.parametrize("keys, fragment", [([1], "2 ints"), ([1, 2.0], "2 ints"), ([1, True], "2 ints"),
                                             ("ab", "sequence of 2 ints"),
                                             (torch.tensor([1.0, 2.0]), "integer tensor")])
def test_bad_keys_are_named(keys, fragment):
    with pytest.raises(ValueError, match=fragment):
        promprune.select(torch.randn(2, 10, 4), budget=3, method="random", keys=keys)
    assert random_rows(torch.randn(2, 10, 4), torch.tensor([1, 2]), budget=3).shape == (2, 3)


def test_a_kernel_triton_cannot_build_falls_back_to_the_loop_once(monkeypatch):
    """A Triton failure (here the real one of a CPU machine: no GPU driver) gives the loop's picks and one warning,
    and the kernel is not tried again in the process; an error that is not Triton's (CUDA out of memory) is raised."""
    import warnings

    from promprune.selection import accel
    from promprune.selection.registry import TokenSet

    monkeypatch.setattr(accel, "_BROKEN", {})
    g = torch.Generator().manual_seed(5)
    cosine = TokenSet(torch.randn(2, 40, 16, generator=g), None).cosine
    rest = torch.stack([torch.randperm(40, generator=g)[:38] for _ in range(2)])
    want = baselines.vispruner_diverse(cosine, rest, 8)  # the CPU loop
    monkeypatch.setattr(accel, "active", lambda t: True)  # as if these were CUDA tensors
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = baselines.vispruner_diverse(cosine, rest, 8)
        second = baselines.vispruner_diverse(cosine, rest, 8)
    assert torch.equal(first, want) and torch.equal(second, want)
    said = [str(w.message) for w in seen if "could not compile" in str(w.message)]
    assert len(said) == 1 and "vispruner" in said[0], said
    assert set(accel.broken_kernels()) == {"vispruner"}

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        accel.kernel("fps", out_of_memory)
    assert "fps" not in accel.broken_kernels()
