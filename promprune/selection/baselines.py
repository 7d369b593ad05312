"""Pre-LLM baselines: DivPrune, VisPruner and VisionZip as their released code selects (what still differs:
docs/methods.md, "What each method feeds the LLM"), and random."""
from __future__ import annotations

import hashlib

import torch

from . import accel
from .diversity import FPS_TIE_EPS, farthest_point
from .kernels import per_image, segment_sums, stable_descending_order, unit_tokens
from .registry import Selection, TokenSet, in_range, register_method

# VisPruner removes at most this many near-duplicate tokens per round (its released code).
VISPRUNER_ROUND = 8
# VisionZip keeps 54 dominant + 10 contextual tokens of 64 (108+20 of 128, 162+30 of 192): contextual = 10/64.
VISIONZIP_CONTEXTUAL = 10 / 64


def _no_saliency(tokens: TokenSet) -> torch.Tensor:
    return torch.zeros(tokens.batch, dtype=torch.long, device=tokens.x.device)


@register_method("divprune", needs_saliency=False)
def divprune(tokens: TokenSet, budget: int) -> Selection:
    """DivPrune: greedy max-min diversity on cosine distance (first pick: the most isolated token). On the fast path
    one Triton launch from the cosine (``greedy_triton.divprune_picks``): the same picks as the ops below."""
    B, N = tokens.batch, tokens.n
    picks = None
    if accel.fused(tokens.x) and tokens.cosine.dtype == torch.float32 and budget <= N:
        from . import greedy_triton

        picks = accel.kernel("divprune", lambda: greedy_triton.divprune_picks(tokens.cosine, budget, FPS_TIE_EPS))
    if picks is None:  # the plain path, or Triton could not build the kernel here
        distance = (1.0 - tokens.cosine).clamp_min(0)
        every = torch.ones(B, N, dtype=torch.bool, device=tokens.x.device)
        counts = torch.full((B,), budget, dtype=torch.long, device=tokens.x.device)
        picks = farthest_point(distance, every, counts, steps=budget)
    return Selection(picks, _no_saliency(tokens), None, None, torch.zeros_like(picks, dtype=torch.bool))


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, N, d]`` at ``index [B, M]`` -> ``[B, M, d]``."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def _submatrix(mat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``mat [B, N, N]`` at ``rows [B, R]`` x ``cols [B, C]`` -> ``[B, R, C]``."""
    batch = torch.arange(mat.shape[0], device=mat.device)[:, None, None]
    return mat[batch, rows[:, :, None], cols[:, None, :]]


def vispruner_round_count(R: int, keep: int) -> int:
    """Rounds of :func:`vispruner_diverse` from ``R`` candidates to ``keep``: each drops ``min(8, R - keep)`` evens,
    at most all ``ceil(R / 2)`` of them (host arithmetic: the sizes do not depend on the values)."""
    rounds = 0
    while R > keep:
        R -= min(VISPRUNER_ROUND, R - keep, (R + 1) // 2)
        rounds += 1
    return rounds


def vispruner_diverse(cosine: torch.Tensor, rest: torch.Tensor, keep: int) -> torch.Tensor:
    """VisPruner's duplicate removal: shrink the ordered candidates ``rest [B, R]`` to ``keep`` tokens.

    Each round splits the current list into even and odd positions, matches every even token to its most similar
    odd token (cosine), and drops the ``min(8, R - keep)`` even tokens with the highest match; the new list is the
    surviving even tokens (by descending match; ties: the lower position first) followed by the odd ones. ``cosine
    [B, N, N]``: the token kernel, computed once, so each round is a gather instead of a fresh ``[R/2, d] x [d, R/2]``
    product. On the CUDA fast path (``accel``) every round runs in one Triton launch
    (``greedy_triton.vispruner_rounds``, the same steps on the candidates' similarity gathered once, in float32);
    this loop is the reference, the CPU path and float64's.
    """
    if keep <= 0:
        return rest[:, :0]
    if rest.shape[1] > keep and accel.fused(cosine):
        from . import greedy_triton  # every round in one launch (float32: float64 tokens take the loop)

        local = _submatrix(cosine, rest, rest).float()  # [B, R, R] the kernel among the candidates, in their order
        picks = accel.kernel("vispruner", lambda: greedy_triton.vispruner_rounds(
            local, keep, vispruner_round_count(rest.shape[1], keep), VISPRUNER_ROUND))
        if picks is not None:  # None: Triton could not build the kernel here, the loop below picks the same
            return rest.gather(1, picks)
    while rest.shape[1] > keep:
        drop = min(VISPRUNER_ROUND, rest.shape[1] - keep)
        even, odd = rest[:, 0::2], rest[:, 1::2]
        match = _submatrix(cosine, even, odd).amax(dim=2)  # [B, R_even]
        survivors = stable_descending_order(match)[:, min(drop, even.shape[1]):]
        rest = torch.cat([even.gather(1, survivors), odd], dim=1)
    return rest


@register_method("vispruner", needs_saliency=True, options={"important_ratio": 0.5},
                 check=in_range("important_ratio", 0.0, 1.0), reads_vision=True)
def vispruner(tokens: TokenSet, budget: int, *, important_ratio: float) -> Selection:
    """VisPruner: floor(T r) tokens by saliency, the rest by iterative near-duplicate removal.

    The duplicates are measured on the vision tower's hidden states when ``vision`` is given (its released code
    compares the CLIP features before the projector), else on ``features``.
    """
    t_imp = int(budget * float(important_ratio))  # floor
    order = stable_descending_order(tokens.require_saliency("vispruner"))  # [B, N] descending saliency
    kernel = tokens.vision_cosine if tokens.vision is not None else tokens.cosine
    diverse = vispruner_diverse(kernel, order[:, t_imp:], budget - t_imp)
    indices = torch.cat([order[:, :t_imp], diverse], dim=1)
    salient = torch.arange(budget, device=indices.device)[None, :].expand(tokens.batch, budget) < t_imp
    return Selection(indices, torch.full((tokens.batch,), t_imp, device=indices.device), None, None, salient)


def _project(tokens: TokenSet, x: torch.Tensor) -> torch.Tensor:
    """Vision-space rows ``[B, M, dv]`` -> the features' space with ``vision.project``."""
    if tokens.vision.project is None:
        raise ValueError("visionzip merges the vision tower's hidden states: vision.project (the model's projector) "
                         "must bring them into the features' space")
    return tokens.vision.project(x).to(tokens.x.dtype)


@register_method("visionzip", needs_saliency=True, merges=True,
                 options={"contextual_ratio": VISIONZIP_CONTEXTUAL, "keep_cls": True},
                 check=in_range("contextual_ratio", 0.0, 1.0), reads_vision=True)
def visionzip(tokens: TokenSet, budget: int, *, contextual_ratio: float, keep_cls: bool) -> Selection:
    """VisionZip: dominant tokens by attention + contextual tokens merged by similarity (merged features out).

    ``n_ctx = round(T * contextual_ratio)`` contextual tokens, the other ``T - n_ctx`` dominant. With ``vision``
    carrying a CLS token and ``keep_cls`` (the released code on LLaVA) the CLS is one of the dominant tokens
    (``Selection.cls``, projected), so ``T - n_ctx - 1`` tokens are taken by saliency. The remaining tokens, in
    raster order, give ``n_ctx`` targets spaced evenly (step ``R // n_ctx``); every other remaining token joins
    the target it is most similar to (cosine of ``vision.keys``, else ``vision.hidden``, else ``features``), and
    each contextual token is its target plus the mean of the tokens that joined it (the released rule; a target
    nobody joined stays as it is). With ``vision`` the merge runs on the vision tower's hidden states and
    ``vision.project`` brings the merged tokens and the CLS into the features' space; dominant tokens are
    ``features`` rows. Indices report the dominant tokens, then the targets' positions. A budget of N or more keeps
    the N tokens as they are (no CLS, nothing merged), as every method does.
    """
    B = tokens.batch
    vision = tokens.vision
    whole = budget >= tokens.n  # T >= N keeps every token as it is: no CLS in place of one, nothing merged
    with_cls = bool(keep_cls) and vision is not None and vision.cls is not None and not whole
    n_ctx = 0 if whole else min(round(budget * float(contextual_ratio)), budget - int(with_cls))
    n_dom = budget - n_ctx - int(with_cls)  # dominant tokens among the N
    order = stable_descending_order(tokens.require_saliency("visionzip"))
    dominant = order[:, :n_dom]
    rest = order[:, n_dom:].sort(dim=1).values  # [B, R] remaining tokens in raster order
    R = rest.shape[1]
    slots = list(range(0, R, max(1, R // max(n_ctx, 1))))[:n_ctx]  # host-known positions: no boolean mask, no wait
    taken = set(slots)
    rest_of = [r for r in range(R) if r not in taken]
    targets = rest[:, torch.tensor(slots, dtype=torch.long).to(rest.device, non_blocking=True)]  # host data: the
    others = rest[:, torch.tensor(rest_of, dtype=torch.long).to(rest.device, non_blocking=True)]  # stream never waits
    space = vision.hidden if vision is not None else tokens.x  # what is merged
    metric = vision.keys if vision is not None and vision.keys is not None else space  # what decides who joins
    merged = _gather_rows(space, targets)  # [B, n_ctx, d or dv]
    if others.shape[1] and n_ctx:
        unit = unit_tokens(metric)
        sim = _gather_rows(unit, others) @ _gather_rows(unit, targets).transpose(1, 2)  # [B, R - n_ctx, n_ctx]
        target = sim.argmax(dim=2)  # [B, R - n_ctx]: the target each other token joins
        # the others grouped by target, each group in raster order (a stable sort), then each group summed from 0 in
        # that order (kernels.segment_sums): one call whatever the batch, each sum's order its own image's alone
        # (a one-hot product per image was batch-free too, a launch per image; a batched one is not, on CUDA)
        by_target = target.sort(dim=1, stable=True).indices
        counts = target.new_zeros(B, n_ctx).scatter_add_(1, target, torch.ones_like(target))  # [B, n_ctx]
        joined = segment_sums(_gather_rows(space, others.gather(1, by_target)), counts)  # [B, n_ctx, d or dv]
        merged = merged + joined / counts.clamp_min(1).to(merged.dtype)[..., None]
    cls = None
    if vision is not None:  # the projector on each image's rows (merged tokens, then the CLS): batch-free bits, a
        # call per image (the model's module: one call over every image's rows sums in an order that depends on B)
        rows = torch.cat([merged, vision.cls[:, None]], dim=1) if with_cls else merged
        rows = per_image(lambda r: _project(tokens, r), rows)
        merged, cls = (rows[:, :-1], rows[:, -1]) if with_cls else (rows, None)
    indices = torch.cat([dominant, targets], dim=1)
    features = torch.cat([_gather_rows(tokens.x, dominant), merged], dim=1)
    kept = indices.shape[1]
    salient = torch.arange(kept, device=indices.device)[None, :].expand(B, kept) < n_dom
    return Selection(indices, torch.full((B,), n_dom, device=indices.device), None, features, salient, cls)


@register_method("random", needs_saliency=False, options={"seed": 0}, draws_at_random=True)
def random_tokens(tokens: TokenSet, budget: int, *, seed: int) -> Selection:
    """T tokens uniformly at random, reproducible from ``seed`` and the image itself.

    Each row draws from a CPU generator seeded by ``seed`` and the row's key (``select(..., keys=...)``: PrunedVLM
    passes a hash of the image's pixels, and of the view), so an image gets the same tokens whatever batch, shard,
    device or dtype it meets. Without keys, the key is a coarse fingerprint of the row's features
    (:func:`feature_keys`: one small read from the device for the batch). The draw is a permutation's first T: a
    smaller budget keeps a subset of a larger one's. The draws run on the host and reach the device in one copy.
    """
    keys = tokens.keys if tokens.keys is not None else feature_keys(tokens.x)
    rows = [torch.randperm(tokens.n, generator=torch.Generator().manual_seed(draw_seed(key, int(seed))))[:budget]
            for key in keys]
    indices = torch.stack(rows).to(tokens.x.device, non_blocking=True)
    return Selection(indices, _no_saliency(tokens), None, None, torch.zeros_like(indices, dtype=torch.bool))


def draw_seed(key: int, seed: int) -> int:
    """A 63-bit generator seed from a row's ``key`` and the method's ``seed`` (blake2b of both)."""
    digest = hashlib.blake2b(str(key).encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") >> 1


# The features' fingerprint (the key of a row given without one): the means over tokens of the first channels, in
# units of the features' RMS, rounded to this step. Each mean is computed in float64 over N tokens, so a drift of a
# few ulps per value (CPU types, devices) moves it by ~1e-7 steps: a key changes only when a mean sits that close to
# a rounding boundary. A cast to a half dtype is coarser: on 300 random [576, 64] feature sets a float16 round trip
# changed 0.7% of the keys, a bfloat16 one 7% (benchmarks/random_fingerprint.py). Pass keys for a guarantee. Two
# different images share a fingerprint only if all 16 means agree to 1/64 of the RMS.
_FINGERPRINT_CHANNELS = 16
_FINGERPRINT_STEP = 2.0 ** -6


def fingerprints(x: torch.Tensor) -> torch.Tensor:
    """The quantized means ``[B, C]`` (long) of the first channels of ``x [B, N, d]`` in units of each row's RMS,
    computed in float64 where ``x`` lives (no copy of the features to the host)."""
    x64 = x.detach().double()
    rms = x64.square().mean(dim=(1, 2)).sqrt().clamp_min(torch.finfo(torch.float32).tiny)  # [B]
    means = x64[:, :, :_FINGERPRINT_CHANNELS].mean(dim=1) / rms[:, None]  # [B, C] in units of the RMS
    return torch.round(means / _FINGERPRINT_STEP).long()


def feature_keys(x: torch.Tensor) -> list[int]:
    """A 63-bit key per row of ``x [B, N, d]`` that does not change with the last bits of its values."""
    B, N, d = x.shape
    quantized = fingerprints(x).tolist()  # the one read from the device
    return [int.from_bytes(hashlib.blake2b(f"{N}x{d}:{q}".encode(), digest_size=8).digest(), "little") >> 1
            for q in quantized]


def feature_key(x: torch.Tensor) -> int:
    """:func:`feature_keys` of one row ``x [N, d]``."""
    return feature_keys(x[None])[0]
