"""The certified split's Lanczos stages replayed as CUDA graphs (``promprune.selection.graphed``).

On a GPU: the replayed steps equal the eager ones bit for bit, a shape is captured once, the kept captures are bounded,
and PromPrune's picks do not move. Here (CPU): when a capture cannot be made (no CUDA), the eager steps answer, with one
warning, and a CPU tensor never asks for a graph.
"""
import math
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

import promprune
from promprune.selection import accel, certified, graphed

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rho(B, n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, 2 * n, generator=g, dtype=torch.float64)
    x = x - x.mean(dim=1, keepdim=True)
    return certified.density(x @ x.transpose(1, 2)).to(device)


def _start_args(rho):
    state = certified.Lanczos.start(rho)
    return state.rho, state.v, state.v_prev, rho.new_zeros(rho.shape[0])


@pytest.fixture(autouse=True)
def fresh_captures():
    graphed.clear()
    yield
    graphed.clear()


def test_a_cpu_state_never_asks_for_a_graph():
    with accel.graphs(True):
        assert not graphed.usable(_rho(1, 8, 0), 16)


def test_a_capture_that_fails_gives_the_eager_steps_once_warned():
    """On a machine without CUDA the capture itself fails (a real failure, not a planted one)."""
    if torch.cuda.is_available():
        pytest.skip("here a capture succeeds: the GPU tests below cover it")
    args = _start_args(_rho(2, 12, 1))
    want = certified.lanczos_steps(*args, 5)
    before = graphed.tally()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = graphed.replay(certified.lanczos_steps, args, 5)
        second = graphed.replay(certified.lanczos_steps, args, 5)
    for got in (first, second):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert sum("capture" in str(w.message) for w in seen) == 1
    after = graphed.tally()
    assert {k: after[k] - before[k] for k in after} == {"eager": 2, "captures": 0, "replays": 0}
    assert graphed._FAILED and not graphed.usable(args[0], 5)


def test_a_shape_is_captured_at_its_second_call_and_replayed_after():
    """The policy around the capture, on the CPU (``benchmarks.launches.CaptureStub`` stands for the CUDA graph: it
    runs the call on its static inputs): a shape's first call runs eagerly, its second captures it and returns the
    capture's checked first replay, later calls replay it; every call gives the eager steps' values."""
    from benchmarks.launches import CaptureStub

    made = []

    class Counted(CaptureStub):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)

    args = _start_args(_rho(2, 12, 1))
    want = certified.lanczos_steps(*args, 5)
    real = graphed._Capture
    graphed._Capture = Counted
    before = graphed.tally()
    try:
        for calls, captures in ((1, 0), (2, 1), (3, 1), (4, 1)):
            got = graphed.replay(certified.lanczos_steps, args, 5)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            assert (len(made), len(graphed._CAPTURES)) == (captures, captures), calls
        # the tally a benchmark reads: one eager call (the first sighting), one capture, two replays
        after = graphed.tally()
        assert {k: after[k] - before[k] for k in after} == {"eager": 1, "captures": 1, "replays": 2}
    finally:
        graphed._Capture = real


def _replayed_through(change):
    """Three calls of one shape where the capture's replays pass their outputs through ``change``: (what each call
    returned, the eager steps' values, the warnings raised)."""
    from benchmarks.launches import CaptureStub

    class Changed(CaptureStub):
        def __call__(self, args, fresh):
            return tuple(change(t) for t in super().__call__(args, fresh))

    args = _start_args(_rho(2, 12, 1))
    want = certified.lanczos_steps(*args, 5)
    real = graphed._Capture
    graphed._Capture = Changed
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = [graphed.replay(certified.lanczos_steps, args, 5) for _ in range(3)]
    finally:
        graphed._Capture = real
    return got, want, seen


def test_a_first_replay_that_differs_from_its_warm_up_turns_graphs_off():
    """A capture whose first replay does not give what the same call gave eagerly is not used: the eager values are
    returned, said once, and the process runs eagerly from then on."""
    got, want, seen = _replayed_through(lambda t: t * (1 + 1e-6))
    for values in got:
        assert all(torch.equal(g, w) for g, w in zip(values, want))
    assert [str(w.message) for w in seen if "differs" in str(w.message)], [str(w.message) for w in seen]
    assert len(seen) == 1 and graphed._FAILED and not graphed._CAPTURES


def test_a_first_replay_that_moves_only_the_last_bits_is_kept():
    """A library that picks another algorithm under capture moves the last bits of every entry, those near zero
    included (relative to themselves that is more than AGREE_RTOL): the capture is kept and replayed, no warning."""
    def nudged(t):
        return t + 1e-11 * torch.nan_to_num(t.abs(), nan=0.0).amax() if t.is_floating_point() else t

    got, want, seen = _replayed_through(nudged)
    for values in got:
        assert all(torch.allclose(g, w, rtol=0, atol=1e-10, equal_nan=True) for g, w in zip(values, want))
    assert not seen and not graphed._FAILED and len(graphed._CAPTURES) == 1
    # the case a tolerance relative to each entry refuses: entries so small that 1e-11 of the largest is > 1e-9 of them
    assert any((w.abs() < 1e-2 * w.abs().amax()).any() for w in want if w.is_floating_point())


def test_the_steps_continue_where_they_stopped():
    """Two stages (5 then 7 steps) give the 12-step recurrence: the state carried between stages is complete."""
    rho = _rho(2, 20, 2)
    whole = certified.Lanczos.start(rho).run(12)
    staged = certified.Lanczos.start(rho).run(5).run(7)
    assert torch.equal(whole.alpha, staged.alpha) and torch.equal(whole.beta, staged.beta)
    assert certified.Lanczos.start(rho).run(0).alpha.shape == (2, 0)


def test_stages_of_one_step_replayed_from_the_same_graph_continue_the_recurrence():
    """Stages replayed from borrowed buffers (``Lanczos.run(borrow=True)``, as ``split`` runs a stage every image goes
    on from, with no copy of its rows), here one step each, so that a stage's graph is the next stage's too and its
    ``v_prev`` out is its own input ``v``: the replayed coefficients are the eager recurrence's (the capture stood for
    by ``benchmarks.launches``' stub on the CPU)."""
    from benchmarks.launches import fast_path_on_cpu

    rho = _rho(1, 24, 4)
    eager = certified.Lanczos.start(rho).run(8)
    with fast_path_on_cpu(graphs=True):
        for _ in range(3):  # the shape's first sighting runs eagerly, the second captures, the third replays
            state = certified.Lanczos.start(rho).run(2)
            for _ in range(6):
                state = state.run(1, borrow=True)
    assert graphed.tally()["replays"] > 0, graphed.tally()
    torch.testing.assert_close(state.alpha, eager.alpha, rtol=1e-12, atol=0)
    torch.testing.assert_close(state.beta, eager.beta, rtol=1e-12, atol=0)


@needs_cuda
@pytest.mark.parametrize("B,n", [(1, 576), (5, 64), (3, 200)])
def test_cuda_replayed_steps_equal_the_eager_steps(B, n):
    rho = _rho(B, n, 3, "cuda")
    eager = certified.Lanczos.start(rho).run(16).run(32)
    with accel.graphs(True):
        assert graphed.usable(rho, 16)
        for _ in range(graphed.SIGHTINGS + 1):  # eager until the capture, its checked first replay, a replay
            replayed = certified.Lanczos.start(rho).run(16).run(32)
            for name in ("alpha", "beta", "v", "v_prev"):
                assert torch.equal(getattr(replayed, name), getattr(eager, name)), name
    assert len(graphed._CAPTURES) == 2  # one per stage's shape, captured once


@needs_cuda
def test_cuda_captures_follow_their_inputs_and_stay_bounded():
    with accel.graphs(True):
        for seed in range(graphed.KEEP + 3):
            rho = _rho(1, 32 + seed, seed, "cuda")  # a new shape each time: a new capture at its second call
            args = _start_args(rho)
            want = certified.lanczos_steps(*args, 4)
            for _ in range(graphed.SIGHTINGS):
                got = graphed.replay(certified.lanczos_steps, args, 4)
                assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert len(graphed._CAPTURES) == graphed.KEEP
        other = _start_args(_rho(1, 32 + seed, 99, "cuda"))  # the last shape, other values: the replay reads them
        got = graphed.replay(certified.lanczos_steps, other, 4)
        assert all(torch.equal(g, w) for g, w in zip(got, certified.lanczos_steps(*other, 4)))


def _same_selection(got, want) -> bool:
    return (torch.equal(got.indices, want.indices) and torch.equal(got.salient, want.salient)
            and torch.equal(got.saliency_count, want.saliency_count) and torch.equal(got.entropy, want.entropy))


@needs_cuda
@pytest.mark.parametrize("shape", [(1, 576, 1024), (5, 576, 1024), (1, 1296, 1280)])
def test_cuda_promprune_keeps_the_same_tokens_with_graphs(shape, graphs_schedule):
    """With graphs the whole selection is two graphs (the split's first stage from the tokens, the picking stages as
    wide as the budget): the same indices, salient flags, counts and entropies as the eager call on the same stage
    schedule."""
    B, N, d = shape
    g = torch.Generator().manual_seed(N)
    x = torch.randn(B, N, d, generator=g).cuda().half()
    s = torch.rand(B, N, generator=g).cuda()
    budget = int(round(N / 9))
    want = promprune.select(x, s, budget=budget, method="promprune")
    with accel.graphs(True):
        for _ in range(graphed.SIGHTINGS + 1):  # eager, the capture and its first replay, a replay
            got = promprune.select(x, s, budget=budget, method="promprune")
            assert _same_selection(got, want)
    assert graphed._CAPTURES and not graphed._FAILED


@needs_cuda
@pytest.mark.parametrize("options", [{}, {"diversity": "fps"}, {"diversity": "facility_location"},
                                     {"conditional": True}], ids=["dpp", "fps", "fl", "conditional"])
def test_cuda_one_picking_graph_serves_every_split_of_a_shape(options, graphs_schedule):
    """The picking graph takes the counts as an input: images whose splits differ (mu swept across their entropies,
    some on a count boundary, so the later stages and the eigensolve run too) replay the same capture and keep the
    eager call's tokens, in fp32 and fp16, for every coverage selector."""
    from promprune.selection.registry import TokenSet

    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 300, 512, generator=g).cuda()
    s = torch.rand(2, 300, generator=g).cuda()
    h0 = float(TokenSet(x, None).spectral_entropy[0])
    for dtype in (torch.float32, torch.float16):
        for mu in (h0 - 0.1, h0 - 0.02 * math.log(0.46875 / 0.53125), h0, h0 + 0.1):
            want = promprune.select(x.to(dtype), s, budget=16, method="promprune", mu=mu, **options)
            with accel.graphs(True):
                for _ in range(graphed.SIGHTINGS + 1):
                    got = promprune.select(x.to(dtype), s, budget=16, method="promprune", mu=mu, **options)
                    assert _same_selection(got, want), (dtype, mu)
    picking = [key for key in graphed._CAPTURES if key[1] == "_picking"]
    assert len(picking) == 2 and not graphed._FAILED  # one per dtype: the splits did not make new captures


@needs_cuda
def test_cuda_split_with_graphs_equals_the_eager_split_through_every_stage(graphs_schedule):
    """An image on a count boundary runs every stage and the eigensolve: the graphed split (the first stage centered
    inside its graph, the later stages' state borrowed until copied) decides as the eager one on the same stage
    schedule, value for value."""
    from promprune.selection.budget import split_budget
    from promprune.selection.registry import TokenSet

    g = torch.Generator().manual_seed(7)
    tokens = TokenSet(torch.randn(4, 300, 512, generator=g).cuda(), None)
    h0 = float(tokens.spectral_entropy[0])
    mu = h0 - 0.02 * math.log(0.46875 / 0.53125)  # image 0 between t_sal = 8 and 9 at T = 16

    def count(h):
        return split_budget(h, 16, mu=mu, tau=0.02)

    want = certified.split(tokens.unit_gram, count, tokens=tokens.x)
    stages = len(certified.LAST_REPORT[0].decided)
    assert stages >= 2, certified.LAST_REPORT
    with accel.graphs(True):
        for _ in range(graphed.SIGHTINGS + 1):  # eager, the captures and their first replays, replays
            got = certified.split(tokens.unit_gram, count, tokens=tokens.x)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(graphed._CAPTURES) == stages


def test_later_stages_replay_a_graph_per_bucket_of_undecided_views_not_per_count(monkeypatch):
    """Capture churn (issue 53): the views a split stage leaves undecided, which the next stage runs on
    (``Lanczos.going``), number anything from 1 to the call's views, and a graph's key holds their number. Unpadded,
    each count was a capture of its own: 12 keys per stage here against a ``KEEP`` of 8, and a stream over every
    count re-captured what it had evicted (a capture costs about two eager calls and saves nothing when evicted
    before its replays). Padded to ``graphed.bucket``'s sizes (powers of two, at most the state's rows), a stage
    replays one graph per bucket: at most 1, 2, 4, 8 and the call's 12 rows, each captured once over four rounds of
    every count; and each undecided view's coefficients are bit for bit those of its rows run on their own (the
    padding rows are never read). The capture stood for by ``benchmarks.launches``' stub on the CPU, under
    ``graphed``'s own policy (a key captured at its second sighting)."""
    from benchmarks.launches import CaptureStub, fast_path_on_cpu

    rho = _rho(12, 16, 5)
    rng = np.random.default_rng(0)
    made = []

    class Counted(CaptureStub):
        def __init__(self, fn, args, static):
            made.append(graphed._key(fn, args, static))
            super().__init__(fn, args, static)

    monkeypatch.setattr(graphed, "KEEP", 8)
    with fast_path_on_cpu(graphs=True):  # (it restores SIGHTINGS and the capture class after)
        graphed.SIGHTINGS, graphed._Capture = 2, Counted
        for _ in range(4):  # an evicted key comes back eager at its next sighting, captured again at the one after
            for count in range(1, 13):
                going = np.zeros(12, dtype=bool)
                going[rng.choice(12, count, replace=False)] = True
                later = certified.Lanczos.start(rho).run(2).going(going).run(3)
                with accel.graphs(False):  # the same kernels, eagerly, on the going rows alone
                    alone = certified.Lanczos.start(rho[torch.from_numpy(np.flatnonzero(going))]).run(2).run(3)
                assert torch.equal(later.alpha[:count, -3:], alone.alpha[:, -3:]), count
                assert torch.equal(later.beta[:count, -3:], alone.beta[:, -3:]), count
    stage = Counter(key[3][0][0] for key in made if key[1] == "lanczos_steps" and key[2] == 3)  # rows per capture
    assert set(stage) <= {1, 2, 4, 8, 12} and set(stage.values()) == {1}, stage


def test_padded_stages_keep_promprunes_tokens_and_split_bit_for_bit(monkeypatch):
    """PromPrune with its graphs, the later stages padded (``graphed.PAD``) and not: the same tokens, salient flags,
    counts, entropies (brackets' midpoints) and half-widths, and the same views decided at each stage, bit for bit,
    over 12 views of spread entropies with mu across them and a schedule of short stages, so that views go on in
    counts no bucket holds (3, 5, 6, 7, 9, ...: asserted, else the comparison would be empty). On the CPU, each
    capture stood for by ``benchmarks.launches``' stub (the same kernels, run)."""
    from benchmarks.launches import fast_path_on_cpu
    from benchmarks.selection import spread_inputs

    x = spread_inputs(12, 96, 128, seed=3)
    s = torch.rand(12, 96, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(certified, "schedule", lambda views, n, eager=True: (1, 2, 3, 4, 6, 8, 12))
    rows = {}
    for mu in (0.42, 0.53, 0.64, 0.75):
        got = {}
        for pad in (True, False):
            monkeypatch.setattr(graphed, "PAD", pad)
            with fast_path_on_cpu(graphs=True):
                got[pad] = promprune.select(x, s, budget=48, method="promprune", mu=mu), certified.LAST_REPORT[0]
                rows[pad] = rows.get(pad, set()) | {key[3][0][0] for key in graphed._CAPTURES
                                                    if key[1] == "lanczos_steps"}
        (padded, report), (unpadded, want) = got[True], got[False]
        assert _same_selection(padded, unpadded) and torch.equal(padded.entropy_halfwidth, unpadded.entropy_halfwidth)
        assert (report.decided, report.exact, report.widths) == (want.decided, want.exact, want.widths), mu
    assert rows[True] <= {1, 2, 4, 8, 12} and rows[False] - {1, 2, 4, 8, 12}, rows
