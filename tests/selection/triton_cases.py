"""The corpus on which the Triton kernels (the greedy selectors, VisPruner's rounds) must select exactly what the torch
reference selects.

Run as a script under ``TRITON_INTERPRET=1`` (``test_greedy_triton.py`` does, in a subprocess, because the variable
must be set before Triton is imported) it prints one JSON object: case name -> {"match", "got", "want"}. With
``--device cuda`` it runs the same corpus on a GPU (compiled kernels, CUDA tensors) against the CPU reference.
Importing this module imports neither Triton nor the kernels.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # run as a script: this checkout first, for promprune and for benchmarks (the graphs cases)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from promprune.selection import accel, diversity
from promprune.selection.registry import TokenSet

Case = Callable[[str], tuple[torch.Tensor, torch.Tensor]]  # device -> (got on the fast path, want from the CPU)

# Cases whose reference picks are decided by float32 rounding noise: 19 anchors condition a rank-16 kernel, so every
# residual gain is noise of about GAIN_EPS (1e-6) and which noise value wins depends on the summation order (torch's
# own CPU result moves with the BLAS). There the kernel must make a valid selection of the same size, not the same.
# "select-vispruner/duplicates": duplicated tokens give exactly tied matches on one device, and VisPruner breaks ties by
# the matches' floats alone (its released code sorts them; no tolerance), so a whole select on CUDA (its cosine from
# cuBLAS) against the CPU's (MKL) is decided by the last bit of each duplicate's cosine (H100, 2026-11-26: one row
# differed in two picks). The kernel itself matches the loop exactly on the same matrix ("vispruner/duplicates-...").
NOISY = {"dpp-conditional/random-2x64x16", "select-vispruner/duplicates"}


def _tokens(kind: str, B: int, N: int, d: int, seed: int) -> torch.Tensor:
    """Features ``[B, N, d]``: random, low-rank, with duplicated or zero tokens, or orthonormal (all gains tie)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(B, N, d, generator=g)
    if kind == "lowrank":  # rank 3 < counts: the gains run out, the fallback fills the rest
        return torch.randn(B, N, 3, generator=g) @ torch.randn(B, 3, d, generator=g)
    if kind == "duplicates":  # every token repeated: exact ties in every gain, the lowest index must win
        half = torch.randn(B, (N + 1) // 2, d, generator=g)
        return half.repeat_interleave(2, dim=1)[:, :N]
    if kind == "zeros":  # a few zero tokens: kernel diagonal 0, gain 0 from the start
        x = torch.randn(B, N, d, generator=g)
        x[:, ::5] = 0.0
        return x
    if kind == "identical":  # the first image one token repeated (its centered Gram rounding noise), the rest random
        x = torch.randn(B, N, d, generator=g)
        x[0] = x[0, :1]
        return x
    if kind == "alike":  # the first image's tokens nearly alike: its centered trace ~1e-4 a row, above float32's
        # rounding noise and below the certified split's refusal threshold (``certified.refusal_trace``: the exact
        # route's eigenvalue floor), so both paths refuse its bounds (NaN rho)
        x = torch.randn(B, N, d, generator=g)
        x[0] = torch.randn(1, d, generator=g) + 0.01 * torch.randn(N, d, generator=g)
        return x
    if kind == "orthonormal":  # identity kernel: every gain is 1 until the end
        return torch.eye(N, d).expand(B, N, d).clone()
    raise ValueError(kind)


def _saliency(B: int, N: int, seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    s = torch.rand(B, N, generator=g)
    return (s * 4).floor() / 4 if ties else s  # ties: four distinct values only


def _inputs(kind, B, N, d, seed, ties=False):
    x = _tokens(kind, B, N, d, seed)
    s = _saliency(B, N, seed, ties)
    g = torch.Generator().manual_seed(seed + 2)
    anchor = torch.rand(B, N, generator=g) < 0.25
    anchor[0] = False  # one image without salient tokens
    counts = torch.randint(0, N // 2, (B,), generator=g)
    counts[-1] = N - int(anchor[-1].sum())  # one image takes every remaining token
    return TokenSet(x, s).cosine, s, anchor, counts


def _on(device: str, *tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def _fast(device: str):
    """The fast path's switch for ``device``: on CPU tensors (the interpreter) it is forced on."""
    if device == "cpu":
        real = accel.active

        class _Forced:
            def __enter__(self):
                accel.active = lambda t: True

            def __exit__(self, *exc):
                accel.active = real
        return _Forced()
    return _Nothing()


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def dpp_case(kind, B, N, d, seed, *, anchored: bool, conditional: bool, ties=False) -> Case:
    def run(device):
        K, s, anchor, counts = _inputs(kind, B, N, d, seed, ties)
        anc = anchor if anchored else torch.zeros_like(anchor)
        kw = {"anchor": anc if anchored or conditional else None, "conditional": conditional, "fallback": s}
        want = diversity.dpp_greedy(K, ~anc, counts, steps=N, **kw)
        with _fast(device):
            Kd, ad, cd, sd, ancd = _on(device, K, ~anc, counts, s, anc)
            kw_d = {**kw, "fallback": sd, "anchor": ancd if kw["anchor"] is not None else None}
            got = diversity.dpp_greedy(Kd, ad, cd, steps=N, **kw_d)
        return got.cpu(), want
    return run


def fps_case(kind, B, N, d, seed, *, anchored: bool, conditional: bool) -> Case:
    def run(device):
        K, _, anchor, counts = _inputs(kind, B, N, d, seed)
        anc = anchor if anchored else None
        avail = ~anchor if anchored else torch.ones_like(anchor)
        dist = (1.0 - K).clamp_min(0)
        want = diversity.farthest_point(dist, avail, counts, anchor=anc, conditional=conditional, steps=N)
        with _fast(device):
            dd, ad, cd, ancd = _on(device, dist, avail, counts, anc)
            got = diversity.farthest_point(dd, ad, cd, anchor=ancd, conditional=conditional, steps=N)
        return got.cpu(), want
    return run


def fl_case(kind, B, N, d, seed, *, conditional: bool) -> Case:
    def run(device):
        K, s, anchor, counts = _inputs(kind, B, N, d, seed)
        sim = ((K + 1.0) / 2.0).clamp(0.0, 1.0)
        kw = {"anchor": anchor, "conditional": conditional, "steps": N}
        want = diversity.facility_location(sim, ~anchor, counts, fallback=s, **kw)
        with _fast(device):
            sd, ad, cd, fd, ancd = _on(device, sim, ~anchor, counts, s, anchor)
            got = diversity.facility_location(sd, ad, cd, fallback=fd, **{**kw, "anchor": ancd})
        return got.cpu(), want
    return run


def fl_long_sum_case(N: int, seed: int) -> Case:
    """Facility location past 4096 tokens, where ``_fl_kernel`` adds its gains 2 rows a step (``_blocks``): the first
    pick is the float64 reference's (its best gain exceeds the one plain float32 steps picked, 2948, by 0.0232, out
    of ``FL_TIE_EPS``' window, 0.0207), and the kernel's gains (``triton_probes.fl_gains``) are no further from the
    float64 gains than twice the torch loop's float32 sum is (summed plainly, 10x: 4.7e-3 on gains of ~2074).
    ``got``: the pick, then the bound held (1); ``want``: float64's pick, then 1."""
    def run(device):
        from tests.selection import triton_probes

        x = torch.randn(1, N, 6, generator=torch.Generator().manual_seed(seed))
        sim = ((TokenSet(x, None).cosine + 1.0) / 2.0).clamp(0.0, 1.0)
        every, one = torch.ones(1, N, dtype=torch.bool), torch.tensor([1])
        want = diversity.facility_location(sim.double(), every, one, steps=1)
        exact = sim.double().sum(1)  # cover 0: every s_ij >= 0 counts
        torch_err = (sim.sum(1).double() - exact).abs().max()
        with _fast(device):
            sd, ad, cd = _on(device, sim, every, one)
            got = diversity.facility_location(sd, ad, cd, steps=1).cpu()
            gains = triton_probes.fl_gains(sd, torch.zeros(1, N, device=sd.device)).cpu()
        held = (gains.double() - exact).abs().max() <= 2 * torch_err
        return torch.cat([got[0], torch.tensor([int(held)])]), torch.cat([want[0], torch.tensor([1])])
    return run


def dpp_long_sum_case(N: int, S: int, d: int, seed: int) -> Case:
    """The DPP's Cholesky row past 4096 tokens, where ``_dpp_extend`` adds ``c_j^T F`` 2 rows of F a step
    (``_blocks``), after ``S`` rows (the exact factor of the first S tokens, rounded to float32): the kernel's row
    (``triton_probes.dpp_row``) within 4 float32 ulps of 1 (the dot product's scale), over ``sqrt(d2_j)``, of the
    float64 row from the same float32 inputs (compensated: 5.3e-7, a tenth of the bound; summed plainly: 1.6e-5, 3x
    it; torch's ``bmm`` on the CPU: 7.8e-6). ``got``: the bound held."""
    def run(device):
        from tests.selection import triton_probes

        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, N, 16, generator=g) @ torch.randn(1, 16, d, generator=g) + 0.5 * torch.randn(1, N, d,
                                                                                                        generator=g)
        K = TokenSet(x, None).cosine
        K64 = K[0].double()
        rows = torch.linalg.solve_triangular(torch.linalg.cholesky(K64[:S, :S]), K64[:S], upper=False).float()
        gains = (K[0].diagonal().double() - (rows.double() ** 2).sum(0)).clamp_min(0).float()
        j = S + 7
        F = rows.double()
        want = (K64[j] - F[:, j] @ F) / gains[j].double().sqrt()
        with _fast(device):
            Kd, Fd, gd, jd = _on(device, K, rows[None], gains[None], torch.tensor([j]))
            got = triton_probes.dpp_row(Kd, Fd, gd, jd, diversity.GAIN_EPS)[0].cpu()
        bound = 4 * torch.finfo(torch.float32).eps / gains[j].double().sqrt()
        held = torch.tensor([bool((got.double() - want).abs().max() <= bound)])
        return held, torch.ones_like(held)
    return run


def _vispruner_inputs(kind, B, N, d, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """The token kernel ``[B, N, N]`` and VisPruner's candidates ``[B, N - 2]`` (a random order of all but two
    tokens)."""
    K = TokenSet(_tokens(kind, B, N, d, seed), None).cosine
    g = torch.Generator().manual_seed(seed + 3)
    return K, torch.stack([torch.randperm(N, generator=g)[:N - 2] for _ in range(B)])


def _kernel_keeps(similarity: torch.Tensor, keep: int, rank: str, **tiles) -> torch.Tensor:
    """``greedy_triton.vispruner_rounds`` on ``similarity [B, R0, R0]`` (the candidates' own, in their order) with
    ``VisTiles(rank=rank, **tiles)``: the kept positions, on the CPU."""
    from promprune.selection import baselines, greedy_triton

    rounds = baselines.vispruner_round_count(similarity.shape[1], keep)
    return greedy_triton.vispruner_rounds(similarity, keep, rounds, baselines.VISPRUNER_ROUND,
                                          greedy_triton.VisTiles(rank=rank, **tiles)).cpu()


def vispruner_case(kind, B, N, d, seed) -> Case:
    """VisPruner's duplicate removal alone: the candidates a random order of all but two tokens, ``keep`` a fifth."""
    from promprune.selection import baselines

    def run(device):
        K, rest = _vispruner_inputs(kind, B, N, d, seed)
        want = baselines.vispruner_diverse(K, rest, N // 5)
        with _fast(device):
            Kd, rd = _on(device, K, rest)
            got = baselines.vispruner_diverse(Kd, rd, N // 5)
        return got.cpu(), want
    return run


def vispruner_sort_case(kind, B, N, d, seed, rank: str = "sort") -> Case:
    """VisPruner's kernel with its ranking by one sort a round (``VisTiles(rank="sort")``, not the default; or
    ``rank="wide"``, the other kernel) on the candidates of ``vispruner_case``, against the loop."""
    from promprune.selection import baselines

    def run(device):
        K, rest = _vispruner_inputs(kind, B, N, d, seed)
        want = baselines.vispruner_diverse(K, rest, N // 5)
        local = baselines._submatrix(K, rest, rest).float().to(device)
        return rest.gather(1, _kernel_keeps(local, N // 5, rank)), want
    return run


def vispruner_signed_zeros_case(rank: str) -> Case:
    """Every match +0.0 or -0.0 (one pair 0.5): ties the comparisons see as ties, whatever the zero's sign, so the
    lower place goes first; the sort's integer keys must say the same."""
    from promprune.selection import baselines

    def run(device):
        R0, keep = 40, 8
        g = torch.Generator().manual_seed(30)
        C = torch.where(torch.rand(2, R0, R0, generator=g) < 0.5, -0.0, 0.0)
        C[:, torch.arange(R0), torch.arange(R0)] = 1.0
        C[1, 3, 5] = C[1, 5, 3] = 0.5
        rest = torch.arange(R0).expand(2, R0)
        return _kernel_keeps(C.to(device), keep, rank), baselines.vispruner_diverse(C, rest, keep)
    return run


def vispruner_deep_scan_case(rank: str, **tiles) -> Case:
    """Every candidate most similar to those of its own parity (0.5 plus noise, 0 plus noise across; 1 on the
    diagonal): in round 0 an even's sorted row holds every even (50 of 100 candidates) before its first odd, so its
    scan reads several chunks (``chunk`` 32 or 16; the wide kernel at ``scan`` 2048: its 50 evens at the level of 64,
    ``[64, 32]`` tiles) before it meets one. Past the first chunk the scan's masks are the ones it narrowed itself:
    Triton 3.9's interpreter refuses a load mask that is not bool, and the rows' end, tested in the vector, had made
    them int32 there (a scalar comparison splat with its operands' type)."""
    from promprune.selection import baselines

    def run(device):
        R0, keep = 100, 20
        g = torch.Generator().manual_seed(31)
        parity = torch.arange(R0) % 2
        same = (parity[:, None] == parity[None, :]).float()
        noise = torch.rand(2, R0, R0, generator=g) * 0.01
        C = 0.5 * same + noise + noise.transpose(1, 2)
        C[:, torch.arange(R0), torch.arange(R0)] = 1.0
        rest = torch.arange(R0).expand(2, R0)
        return _kernel_keeps(C.to(device), keep, rank, **tiles), baselines.vispruner_diverse(C, rest, keep)
    return run


def select_case(method: str, kind: str, seed: int, **options) -> Case:
    """A whole ``promprune.select`` call: the fast path (sync-free stages + kernels) against the CPU path."""
    import promprune

    def run(device):
        x = _tokens(kind, 2, 48, 24, seed)
        s = _saliency(2, 48, seed, ties=False)
        kw = {"budget": 12, "method": method, "order": "selection", **options}
        want = promprune.select(x, s, **kw)
        with _fast(device):
            got = promprune.select(x.to(device), s.to(device), **kw)
        return got.indices.cpu(), want.indices
    return run


class _Graphs:
    """PromPrune's selection as CUDA graphs (``accel.graphs``), the captures fresh; on the CPU the cost model's capture
    stub stands for each capture (it replays the captured function eagerly)."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        from promprune.selection import graphed

        self.graphs = accel.graphs(True)
        self.graphs.__enter__()
        graphed.clear()
        if self.device == "cpu":
            from benchmarks.launches import CaptureStub

            self.real, graphed._Capture = graphed._Capture, CaptureStub

    def __exit__(self, *exc):
        from promprune.selection import graphed

        if self.device == "cpu":
            graphed._Capture = self.real
        graphed.clear()
        self.graphs.__exit__(*exc)


def graphed_select_case(kind: str, seed: int, near_boundary: float = 0.0, **options) -> Case:
    """PromPrune's whole ``select`` with its split (certified bounds, from the tokens' Gram in the first stage's graph)
    and its picking stages (as wide as the budget, the counts from the device) replayed as graphs, called until the
    shape's captures have replayed, against the CPU path. mu is the first image's entropy (about half its budget
    salient, half from the coverage stage); ``near_boundary``: mu puts that image this far (in normalized entropy)
    above the count boundary between 6 and 7 salient tokens: near enough that every Lanczos stage's bracket straddles
    the boundary, so the split runs every stage and the exact eigensolve (asserted), far enough that float32 rounding
    cannot move the decision. Exactly on the boundary the count is rounding noise: a rank-3 Gram's float32 entropy
    moves by ~1.2e-6 between float32 and float64 (the zero eigenvalues' noise), and an H200 (2026-11-28) put that image
    at 7 where the CPU put it at 6. The boundary is placed from the float64 entropy."""
    import math

    import promprune
    from promprune.selection import certified, graphed

    def run(device):
        x = _tokens(kind, 2, 48, 64, seed)
        s = _saliency(2, 48, seed, ties=False)
        kw = {"budget": 12, "method": "promprune", "order": "selection", **options}
        with accel.entropy("certified"):
            r = 6.5 / 12
            shift = 0.02 * math.log((1 - r) / r) + near_boundary if near_boundary else 0.0
            kw["mu"] = float(TokenSet(x.double(), None).spectral_entropy[0]) - shift
            want = promprune.select(x, s, **kw)
            if near_boundary:
                assert certified.LAST_REPORT[0].exact >= 1, certified.LAST_REPORT[0]  # the eigensolve decided one
            with _fast(device), _Graphs(device):
                for _ in range(graphed.SIGHTINGS + 1):  # eager, the captures and their first replays, replays
                    got = promprune.select(x.to(device), s.to(device), **kw)
                assert any(key[1] == "_picking" for key in graphed._CAPTURES) and not graphed._FAILED
        assert 0 < int(want.saliency_count[0]) < 12, want.saliency_count  # both stages pick for the first image
        return got.indices.cpu(), want.indices
    return run


def cosine_case(kind: str, B: int, N: int, d: int, seed: int) -> Case:
    """``TokenSet.cosine`` on the fast path (one kernel from the unit Gram) against the torch ops on the CPU, bit for
    bit; "tiny": tokens of norms 1e-9 to 1e-5 (the two eps' rescaling, 1e-8 and 1e-6, is not 1 there)."""
    def run(device):
        if kind == "tiny":
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(B, N, d, generator=g) / d ** 0.5 * 10.0 ** torch.linspace(-9, -5, N)[None, :, None]
        else:
            x = _tokens(kind, B, N, d, seed)
        want = TokenSet(x, None).cosine
        with _fast(device):
            got = TokenSet(x.to(device), None).cosine
        return got.cpu(), want
    return run


def half_gram_case(kind: str, B: int, N: int, d: int, seed: int) -> Case:
    """``TokenSet.unit_gram`` of fp16 tokens on the fast path, from their raw float32 product: the kernel
    (``greedy_triton.scaled_gram``) against the torch ops on the same product, bit for bit ("tiny": norms of 1e-9 to
    1e-5, some below the 1e-8 floor)."""
    from promprune.selection import greedy_triton
    from promprune.selection.kernels import ENTROPY_EPS, token_norms, unit_gram_from_product

    def run(device):
        x = _tokens("random" if kind == "tiny" else kind, B, N, d, seed)
        if kind == "tiny":
            x = x / d ** 0.5 * 10.0 ** torch.linspace(-9, -5, N)[None, :, None]
        src = x.to(torch.float16).float()  # fp16 values, the product and the norms in float32
        raw = src @ src.transpose(1, 2)
        norms = token_norms(src)
        want = unit_gram_from_product(raw, norms, ENTROPY_EPS)
        with _fast(device):
            got = greedy_triton.scaled_gram(raw.to(device), norms.to(device), ENTROPY_EPS)
        return got.cpu(), want
    return run


def divprune_case(kind: str, B: int, N: int, d: int, seed: int, budget: int) -> Case:
    """DivPrune's whole ``select``: the fast path (one kernel from the cosine, ``greedy_triton.divprune_picks``)
    against the CPU's torch ops."""
    import promprune

    def run(device):
        x = _tokens(kind, B, N, d, seed)
        kw = {"budget": budget, "method": "divprune", "order": "selection"}
        want = promprune.select(x, None, **kw)
        with _fast(device):
            got = promprune.select(x.to(device), None, **kw)
        return got.indices.cpu(), want.indices
    return run


def ascending_case(B: int, T: int, N: int, seed: int, flags: bool = True, pad: int = 0) -> Case:
    """A selection's ascending order at the end of ``select`` (``greedy_triton.ascending``: one sort of ``2 index +
    flag`` keys) against ``registry._sorted``'s torch ops (a sort, a gather of the salient flags): ``T`` distinct
    indices of ``N`` per row in random order, random flags (or none), the last ``pad`` of each row -1 (no pick)."""
    from promprune.selection import greedy_triton
    from promprune.selection.registry import Selection, _sorted

    def run(device):
        g = torch.Generator().manual_seed(seed)
        idx = torch.stack([torch.randperm(N, generator=g)[:T] for _ in range(B)])
        if pad:
            idx[:, T - pad:] = -1
        sal = torch.rand(B, T, generator=g) < 0.4 if flags else None
        if pad and flags:
            sal[:, T - pad:] = False  # a -1 (no pick) is never salient: equal keys, in any order
        want = _sorted(Selection(idx, torch.zeros(B, dtype=torch.long), salient=sal))
        with _fast(device):
            got_idx, got_sal = greedy_triton.ascending(idx.to(device), None if sal is None else sal.to(device))
        got = torch.cat([got_idx.cpu(), torch.zeros_like(idx) if sal is None else got_sal.cpu().long()], 1)
        return got, torch.cat([want.indices, torch.zeros_like(idx) if sal is None else want.salient.long()], 1)
    return run


def _stage_saliency(kind: str, B: int, N: int, seed: int) -> torch.Tensor:
    """Saliency ``[B, N]`` for the two stages: random, four values (ties), one constant row (min-max maps it to 0:
    raster order), descending by index (the top tokens are 0, 1, ...), or zeros of both signs among 0.5 and 1 (where
    the min is +0.0, min-max gives -0.0 for the -0.0 tokens, which must sort as +0.0 does: by index)."""
    g = torch.Generator().manual_seed(seed + 3)
    s = torch.rand(B, N, generator=g)
    if kind == "ties":
        return (s * 4).floor() / 4
    if kind == "constant":
        s[0] = 0.25
        return s
    if kind == "by-index":
        return -torch.arange(N, dtype=torch.float32).expand(B, N).clone()
    if kind == "signed-zeros":  # -0.0, +0.0, then 0.5 or 1, ..., ending in +0.0: the interpreter's min is then +0.0
        j = torch.arange(N).expand(B, N)
        s = torch.where(j % 3 == 0, -0.0, torch.where(j % 3 == 1, 0.0, torch.where(s < 0.5, 0.5, 1.0)))
        s[:, -1] = 0.0
        return s
    return s


def stages_case(kind: str, B: int, N: int, d: int, seed: int, saliency: str, t_sal: list[int], budget: int,
                conditional: bool = False) -> Case:
    """``two_stage`` with a DPP coverage stage, ``t_sal`` salient tokens per image given on the device: the fast path
    (the saliency stage and the DPP in two kernels, ``greedy_triton.salient_front``) against the torch ops on the CPU:
    the indices, then the salient flags."""
    from promprune.selection.two_stage import two_stage

    def run(device):
        x = _tokens(kind, B, N, d, seed)
        s = _stage_saliency(saliency, B, N, seed)
        counts = torch.tensor(t_sal)
        kw = {"diversity": "dpp", "conditional": conditional, "method": "promprune"}
        want = two_stage(TokenSet(x, s), budget, counts, **kw)
        with _fast(device):
            got = two_stage(TokenSet(x.to(device), s.to(device)), budget, counts.to(device), **kw)
        return (torch.cat([got.indices.cpu(), got.salient.cpu().long()], 1),
                torch.cat([want.indices, want.salient.long()], 1))
    return run


def _density(kind: str, B: int, N: int, d: int, seed: int) -> torch.Tensor:
    """``rho [B, N, N]`` float64: the trace-normalized centered Gram of unit tokens, what the certified split's
    recurrence runs on."""
    from promprune.selection import certified
    from promprune.selection.entropy import centered_gram

    x = _tokens(kind, B, N, d, seed).double()
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return certified.density(centered_gram(x @ x.transpose(1, 2)))


def lanczos_case(kind: str, B: int, N: int, d: int, seed: int, first: int = 6, more: int = 5,
                 programs: int | None = None, fused: bool = False) -> Case:
    """``certified.lanczos_steps`` on the fast path (``lanczos_triton``: three launches a step, or with ``fused`` one,
    ``_fused_kernel``) against the torch loop on the CPU: a first stage of ``first`` steps from the start (``v``
    None, as the split's first stage runs it: the fast path never forms ``I / sqrt(n)``), then ``more`` steps
    continued from its state (its ``v``, ``v_prev`` and last beta), the coefficients and basis matrices equal to
    float64 rounding (relative 1e-11 of the largest). Where the Krylov space runs out (a beta below
    ``certified.BREAKDOWN`` of the largest coefficient: low-rank tokens) both must say so at the same step; what
    follows is rounding noise in both (the split sends such images to the eigensolve) and is not compared, nor is
    such an image's state. ``programs``: `TARGET_PROGRAMS` for the case (1: one program per view, its loop over many
    tiles). ``got`` holds the comparisons, ``want`` all true."""
    from promprune.selection import certified

    def joined(stages):  # -> alpha, beta [B, first + more]
        halves = [h.view(h.shape[0], 2, -1) for h in stages]
        return torch.cat([h[:, 0] for h in halves], 1), torch.cat([h[:, 1] for h in halves], 1)

    def run(device):
        from promprune.selection import lanczos_triton

        rho = _density(kind, B, N, d, seed)
        ref = certified.lanczos_steps(rho, None, None, None, first)
        ref_more = certified.lanczos_steps(rho, ref[1], ref[2], ref[0][:, -1], more)
        saved = lanczos_triton.TARGET_PROGRAMS
        lanczos_triton.TARGET_PROGRAMS = programs or saved
        try:
            with _fast(device), lanczos_triton.fusing(fused):
                r = rho.to(device)
                got = certified.lanczos_steps(r, None, None, None, first)
                got_more = certified.lanczos_steps(r, got[1], got[2], got[0][:, -1], more)
        finally:
            lanczos_triton.TARGET_PROGRAMS = saved
        (a_ref, b_ref), (a_got, b_got) = joined((ref[0], ref_more[0])), joined((got[0].cpu(), got_more[0].cpu()))
        scale = torch.cat([a_ref, b_ref], 1).abs().amax(1, keepdim=True)
        low = b_ref < certified.BREAKDOWN * scale  # [B, K]: the Krylov space ran out at this step
        before = torch.cat([torch.ones_like(low[:, :1]), ~low[:, :-1]], 1).cumprod(1).bool()  # up to the first
        checks = [((a_got - a_ref).abs() <= 1e-11 * scale)[before],
                  (((b_got - b_ref).abs() <= 1e-11 * scale) | (low & (b_got < certified.BREAKDOWN * scale)))[before]]
        whole = ~low.any(1)  # images whose recurrence never ran out: their state too
        for g, w in zip(got[1:] + got_more[1:], ref[1:] + ref_more[1:]):
            g, w = g.cpu()[whole], w[whole]
            if w.numel():
                checks.append(((g - w).abs() <= 1e-11 * w.abs().amax().clamp_min(1e-300)).flatten())
        checks = torch.cat([c.flatten() for c in checks])
        return checks, torch.ones_like(checks)
    return run


def density_case(kind: str, B: int, N: int, d: int, seed: int) -> Case:
    """``lanczos_triton.density_from_gram`` (the fast path's centering and rho, from the float32 unit Gram) against
    ``certified.density(centered_gram(...))`` in torch on the CPU: equal to float32 rounding (relative 1e-6 of the
    largest entry: the two sum the row means in different orders) and exactly symmetric. ``got`` holds the
    comparisons, ``want`` all true."""
    from promprune.selection import certified
    from promprune.selection.entropy import centered_gram

    def run(device):
        from promprune.selection import lanczos_triton

        gram = TokenSet(_tokens(kind, B, N, d, seed), None).unit_gram  # float32, exactly symmetric
        want = certified.density(centered_gram(gram))
        got = lanczos_triton.density_from_gram(gram.to(device)).cpu()
        scale = torch.nan_to_num(want.abs(), nan=0.0).amax().clamp_min(1e-300)
        close = ((got - want).abs() <= 1e-6 * scale) | (got.isnan() & want.isnan())  # NaN: a view of rounding noise
        checks = torch.cat([close.flatten(), ((got == got.transpose(1, 2)) | got.isnan()).flatten()])
        return checks, torch.ones_like(checks)
    return run


def opening_case(kind: str, B: int, N: int, d: int, seed: int, steps: int) -> Case:
    """``lanczos_triton.opening_from_gram`` (the first stage from the float32 unit Gram, its first fused launch making
    rho where it reads it) against ``density_from_gram`` and then ``steps`` fused (rho in a launch of its own) on the
    same device: rho equal bit for bit, the coefficients and basis matrices to float64 rounding (relative 1e-13 of
    the largest: the start's alpha sums rho's diagonal in its own order). ``got`` holds the comparisons, ``want`` all
    true."""
    def run(device):
        from promprune.selection import lanczos_triton

        gram = TokenSet(_tokens(kind, B, N, d, seed), None).unit_gram.to(device)
        with _fast(device):
            packed, rho, v, v_prev = lanczos_triton.opening_from_gram(gram, steps)
            want_rho = lanczos_triton.density_from_gram(gram)
            want = lanczos_triton.steps(want_rho, None, None, None, steps, fused=True)
        checks = [torch.equal(rho, want_rho)]
        for g, w in zip((packed, v, v_prev), want):
            checks.append(bool((g - w).abs().max() <= 1e-13 * w.abs().max()))
        got = torch.tensor(checks)
        return got, torch.ones_like(got)
    return run


def split_case(kind: str, B: int, N: int, d: int, seed: int, gap: float, gram: bool = False,
               fused: bool = False, mu: float | None = None) -> Case:
    """``certified.split``'s counts and per-stage decisions on the fast path (its recurrence in ``lanczos_triton``)
    against the torch loop's, mu placed so that the first image's entropy lies ``gap`` (normalized) above the count
    boundary between 8 and 9 salient tokens of T = 16: at 1e-5 it runs every stage and ends in the eigensolve (the
    other images fall where they fall; low-rank tokens' recurrences run out and go there too). ``got``: the counts,
    then the stages' decided numbers and the eigensolve's. ``gram``: the split from the tokens' float32 unit Gram
    (with its ``tokens``, as PromPrune calls it), centered by ``lanczos_triton.density_from_gram`` on the fast path.
    ``fused``: the recurrence in ``lanczos_triton._fused_kernel`` (else a product, the dot and the update a step).
    ``mu``: given instead of placed (a first image without an entropy of its own: "identical" tokens)."""
    import math

    from promprune.selection import certified
    from promprune.selection.budget import split_budget

    def run(device):
        from promprune.selection import lanczos_triton

        nonlocal mu
        rho = _density(kind, B, N, d, seed)
        if mu is None:
            lam = torch.linalg.eigvalsh(rho[0]).clamp_min(0)
            h0 = float(-(lam * torch.where(lam > 0, lam.log(), torch.zeros_like(lam))).sum() / math.log(N))
            mu = h0 - 0.02 * math.log((1 - 8.5 / 16) / (8.5 / 16)) - gap

        def outcome(t_sal: torch.Tensor) -> torch.Tensor:
            report = certified.LAST_REPORT[0]
            return torch.cat([t_sal, torch.tensor(report.decided + [report.exact])])

        def count(h: torch.Tensor) -> torch.Tensor:
            return split_budget(h, 16, mu=mu, tau=0.02)

        x = _tokens(kind, B, N, d, seed)
        matrix = TokenSet(x, None).unit_gram if gram else rho
        want = outcome(certified.split(matrix, count, tokens=x if gram else None)[0])
        with _fast(device), lanczos_triton.fusing(fused):
            got = outcome(certified.split(matrix.to(device), count, tokens=x.to(device) if gram else None)[0])
        return got, want
    return run


def cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    shapes = [("random", 3, 37, 48), ("random", 2, 64, 16), ("lowrank", 3, 40, 24), ("duplicates", 3, 30, 16),
              ("zeros", 2, 33, 20), ("orthonormal", 2, 24, 32)]
    for i, (kind, B, N, d) in enumerate(shapes):
        tag = f"{kind}-{B}x{N}x{d}"
        out[f"dpp/{tag}"] = dpp_case(kind, B, N, d, i, anchored=False, conditional=False)
        out[f"dpp-anchor/{tag}"] = dpp_case(kind, B, N, d, i, anchored=True, conditional=False, ties=True)
        out[f"dpp-conditional/{tag}"] = dpp_case(kind, B, N, d, i, anchored=True, conditional=True)
        out[f"fps/{tag}"] = fps_case(kind, B, N, d, i, anchored=False, conditional=False)
        out[f"fps-anchor/{tag}"] = fps_case(kind, B, N, d, i, anchored=True, conditional=False)
        out[f"fps-conditional/{tag}"] = fps_case(kind, B, N, d, i, anchored=True, conditional=True)
        out[f"fl/{tag}"] = fl_case(kind, B, N, d, i, conditional=False)
        out[f"fl-conditional/{tag}"] = fl_case(kind, B, N, d, i, conditional=True)
        out[f"vispruner/{tag}"] = vispruner_case(kind, B, N, d, i)
    # past 4096 tokens: the kernels' long sums (2 rows a step) compensated, as close to float64 as torch's
    out["fl-long-sum/random-1x4100x6"] = fl_long_sum_case(4100, 11)
    out["dpp-long-sum/random-1x4100x2048-after-1500"] = dpp_long_sum_case(4100, 1500, 2048, 5)
    # past one tile of VisPruner's kernel: 298 candidates are 5 tiles of evens by 2 of columns in the first rounds
    out["vispruner/random-1x300x24"] = vispruner_case("random", 1, 300, 24, 6)
    out["vispruner/duplicates-2x300x16"] = vispruner_case("duplicates", 2, 300, 16, 7)
    out["vispruner/random-1x576x64"] = vispruner_case("random", 1, 576, 64, 8)  # LLaVA-1.5's token count
    # small: Triton's interpreter runs tl.sort slowly (2 x 300 took 40 s, 576 took 81 s); benchmarks/vispruner_tiles.py
    # checks the sort against the loop at the paper's sizes on a GPU
    for i, (kind, B, N, d) in enumerate([("duplicates", 2, 120, 16), ("zeros", 2, 33, 20), ("random", 1, 200, 32)]):
        out[f"vispruner-sort/{kind}-{B}x{N}x{d}"] = vispruner_sort_case(kind, B, N, d, 20 + i)
    out["vispruner/signed-zeros"] = vispruner_signed_zeros_case("tiles")
    out["vispruner-sort/signed-zeros"] = vispruner_signed_zeros_case("sort")
    # the wide kernel (a round's evens at once, a sort sized to the round): 1 x 300 passes every level from 256 evens
    # down to the smallest (16); 2 x 33 (31 candidates, 16 evens) runs at the smallest alone
    for i, (kind, B, N, d) in enumerate([("duplicates", 2, 120, 16), ("zeros", 2, 33, 20), ("random", 1, 300, 24),
                                         ("lowrank", 1, 42, 8)]):
        out[f"vispruner-wide/{kind}-{B}x{N}x{d}"] = vispruner_sort_case(kind, B, N, d, 40 + i, rank="wide")
    out["vispruner-wide/signed-zeros"] = vispruner_signed_zeros_case("wide")
    out["vispruner/deep-scan"] = vispruner_deep_scan_case("tiles")
    out["vispruner/deep-scan-chunk-16"] = vispruner_deep_scan_case("tiles", chunk=16)
    out["vispruner-wide/deep-scan"] = vispruner_deep_scan_case("wide", scan=2048)
    for kind in ("random", "lowrank", "duplicates"):
        out[f"select-promprune/{kind}"] = select_case("promprune", kind, 7, mu=0.5)
        out[f"select-promprune-conditional/{kind}"] = select_case("promprune", kind, 7, mu=0.5, conditional=True)
        out[f"select-promprune-fps/{kind}"] = select_case("promprune", kind, 7, mu=0.5, diversity="fps")
        out[f"select-promprune-fl/{kind}"] = select_case("promprune", kind, 7, mu=0.5, diversity="facility_location")
        out[f"select-fixed-ratio/{kind}"] = select_case("fixed_ratio", kind, 8)
        out[f"select-coverage-only/{kind}"] = select_case("coverage_only", kind, 9)
        out[f"select-saliency-only/{kind}"] = select_case("saliency_only", kind, 15)
        out[f"select-divprune/{kind}"] = select_case("divprune", kind, 10)
        out[f"select-vispruner/{kind}"] = select_case("vispruner", kind, 11)
    # the cosine kernel in one launch: one tile, several (64 a side) and a ragged edge
    for i, (kind, B, N, d) in enumerate([("random", 2, 37, 48), ("zeros", 2, 70, 20), ("tiny", 1, 130, 24),
                                         ("duplicates", 2, 64, 16)]):
        out[f"cosine/{kind}-{B}x{N}x{d}"] = cosine_case(kind, B, N, d, 70 + i)
        out[f"half-gram/{kind}-{B}x{N}x{d}"] = half_gram_case(kind, B, N, d, 75 + i)
    # DivPrune in one kernel: its first pick's scores over several chunks of rows (300 tokens), ties everywhere
    for i, (kind, B, N, d, T) in enumerate([("random", 3, 37, 48, 12), ("duplicates", 2, 30, 16, 16),
                                            ("zeros", 2, 33, 20, 33), ("orthonormal", 2, 24, 32, 10),
                                            ("random", 1, 300, 24, 64)]):
        out[f"divprune/{kind}-{B}x{N}x{d}"] = divprune_case(kind, B, N, d, 80 + i, T)
    # the ascending order at the end of select, with and without salient flags, one row to many, past 1024 kept tokens
    for i, (B, T, N, flags, pad) in enumerate([(3, 12, 37, True, 0), (2, 1, 5, True, 0), (2, 64, 64, False, 0),
                                               (1, 300, 576, True, 0), (2, 20, 40, True, 3), (1, 1100, 2000, True, 0)]):
        out[f"ascending/{B}x{T}-of-{N}" + ("" if flags else "-no-flags") + (f"-pad{pad}" if pad else "")] = (
            ascending_case(B, T, N, 90 + i, flags, pad))
    # PromPrune's two stages as two kernels (the saliency stage's sort, masks and first pick; the DPP after it):
    # images with no salient token, with all of them, and between; ties in the saliency and in the first pick
    for i, (kind, B, N, d, sal, t_sal, T) in enumerate([
            ("random", 3, 37, 48, "random", [0, 12, 5], 12), ("random", 3, 37, 48, "ties", [3, 12, 7], 12),
            ("lowrank", 2, 40, 24, "constant", [6, 2], 10), ("duplicates", 2, 30, 16, "signed-zeros", [12, 11], 12),
            ("zeros", 2, 33, 20, "ties", [33, 20], 33), ("random", 1, 300, 24, "ties", [40], 64),
            ("orthonormal", 1, 300, 320, "by-index", [40], 48)]):
        tag = f"{kind}-{B}x{N}x{d}-{sal}"
        out[f"stages-dpp/{tag}"] = stages_case(kind, B, N, d, 60 + i, sal, t_sal, T)
        if i < 3:
            out[f"stages-dpp-conditional/{tag}"] = stages_case(kind, B, N, d, 60 + i, sal, t_sal, T, True)
    for selector in ("dpp", "fps", "facility_location"):
        out[f"graphs-promprune-{selector}/random"] = graphed_select_case("random", 12, diversity=selector)
    out["graphs-promprune-conditional/random"] = graphed_select_case("random", 12, conditional=True)
    out["graphs-promprune/random-near-boundary"] = graphed_select_case("random", 13, near_boundary=1e-5)
    out["graphs-promprune/lowrank-near-boundary"] = graphed_select_case("lowrank", 14, near_boundary=1e-4)
    # the certified split's recurrence (``lanczos_triton``): its coefficients and state, and the split's decisions
    for i, (kind, B, N, d, programs) in enumerate([("random", 1, 40, 64, None), ("random", 3, 70, 33, None),
                                                   ("random", 2, 100, 120, None), ("random", 2, 100, 120, 1),
                                                   ("lowrank", 2, 48, 24, None), ("zeros", 2, 33, 20, 3)]):
        out[f"lanczos/{kind}-{B}x{N}x{d}" + (f"-programs{programs}" if programs else "")] = lanczos_case(
            kind, B, N, d, 30 + i, programs=programs)
    # one step from the start: its v_prev is the start itself, formed only then
    out["lanczos/random-2x40x64-one-step"] = lanczos_case("random", 2, 40, 64, 36, first=1, more=3)
    for i, (kind, B, N, d, gap) in enumerate([("random", 3, 80, 96, 1e-3), ("random", 3, 80, 96, 1e-5),
                                              ("lowrank", 2, 40, 24, 1e-3)]):
        out[f"split/{kind}-{B}x{N}x{d}-gap{gap:g}"] = split_case(kind, B, N, d, 40 + i, gap)
    out["split-gram/random-3x80x96-gap0.001"] = split_case("random", 3, 80, 96, 43, 1e-3, gram=True)
    # one token repeated: its Gram's centering is rounding noise, refused (NaN rho) on both paths, H = 1 in the exact
    out["split-gram/identical-2x80x96"] = split_case("identical", 2, 80, 96, 44, 0.0, gram=True, mu=0.42)
    # tokens nearly alike: a centered trace below the refusal threshold (the exact route's eigenvalue floor), refused
    # on both paths; the exact route's eigensolve gives its count
    out["split-gram/alike-2x80x96"] = split_case("alike", 2, 80, 96, 45, 0.0, gram=True, mu=0.42)
    # the fused recurrence (a launch a step: the update and the next product, ``_fused_kernel``): one 64 x 64 block
    # (40), blocks cut at the view's edge (70, 100: the product's columns summed 16 at a time, the last 6 or 4 masked),
    # 3 x 3 blocks (130); the start's one step (unfused) then steps from its state; a stage of one step from a state
    for i, (kind, B, N, d) in enumerate([("random", 1, 40, 64), ("random", 3, 70, 33), ("random", 2, 100, 120),
                                         ("lowrank", 2, 48, 24), ("zeros", 2, 33, 20), ("random", 1, 130, 150)]):
        out[f"lanczos-fused/{kind}-{B}x{N}x{d}"] = lanczos_case(kind, B, N, d, 70 + i, fused=True)
    out["lanczos-fused/random-2x40x64-one-step"] = lanczos_case("random", 2, 40, 64, 76, first=1, more=3, fused=True)
    out["lanczos-fused/random-2x70x64-then-one"] = lanczos_case("random", 2, 70, 64, 77, first=2, more=1, fused=True)
    for i, (kind, B, N, d, gap) in enumerate([("random", 3, 80, 96, 1e-3), ("random", 3, 80, 96, 1e-5),
                                              ("lowrank", 2, 40, 24, 1e-3)]):
        out[f"split-fused/{kind}-{B}x{N}x{d}-gap{gap:g}"] = split_case(kind, B, N, d, 40 + i, gap, fused=True)
    out["split-gram-fused/random-3x80x96-gap0.001"] = split_case("random", 3, 80, 96, 43, 1e-3, gram=True, fused=True)
    out["split-gram-fused/identical-2x80x96"] = split_case("identical", 2, 80, 96, 44, 0.0, gram=True, fused=True,
                                                           mu=0.42)
    out["split-gram-fused/alike-2x80x96"] = split_case("alike", 2, 80, 96, 45, 0.0, gram=True, fused=True, mu=0.42)
    # the first stage fused from the Gram: rho made where the first step reads it (one block, blocks cut at the edge)
    for i, (kind, B, N, d, k) in enumerate([("random", 2, 40, 64, 6), ("random", 1, 70, 96, 2),
                                            ("lowrank", 2, 48, 24, 6), ("random", 2, 130, 150, 3)]):
        out[f"opening-fused/{kind}-{B}x{N}x{d}-steps{k}"] = opening_case(kind, B, N, d, 80 + i, k)
    for i, (kind, B, N, d) in enumerate([("random", 2, 70, 96), ("duplicates", 2, 40, 16), ("zeros", 1, 33, 20),
                                         ("orthonormal", 2, 24, 32), ("identical", 2, 70, 96), ("alike", 2, 70, 96)]):
        out[f"density/{kind}-{B}x{N}x{d}"] = density_case(kind, B, N, d, 50 + i)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--part", default="0/1", metavar="I/N", help="run every N-th case from the I-th (0-based)")
    args = ap.parse_args()
    part, parts = (int(x) for x in args.part.split("/"))
    torch.set_num_threads(1)
    results = {}
    for i, (name, run) in enumerate(cases().items()):
        if args.only in name and i % parts == part:
            got, want = run(args.device)
            results[name] = {"match": bool(torch.equal(got, want)), "got": got.tolist(), "want": want.tolist()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
