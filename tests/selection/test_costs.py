"""The GPU fast path's cost model, counted on the CPU (``benchmarks/launches.py``): host syncs and launches of one
selection, so a change that adds a wait on the device or a launch per token shows without a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import promprune
from benchmarks.launches import count, fast_path_on_cpu
from benchmarks.selection import make_inputs
from promprune.selection import accel, certified, lanczos_triton
from promprune.selection.entropy import centered_gram
from promprune.selection.registry import TokenSet, method_spec


def fast_call(method: str, x, s, budget: int, **options):
    """The registered function on validated inputs (``select`` itself adds one sync: its finiteness check)."""
    spec = method_spec(method)
    opts = spec.resolve(options)
    opts.pop("order")
    return spec.fn(TokenSet(x.float(), s, source=x), budget, **opts)


@pytest.fixture(scope="module")
def views():
    return make_inputs(5, 96, 128, "cpu")  # five views, as LLaVA-NeXT's


@pytest.mark.parametrize("method", ["fixed_ratio", "divprune", "coverage_only", "saliency_only", "visionzip",
                                    "vispruner", "downsample"])
def test_these_methods_never_wait_on_the_device(method, views):
    x, s = views
    with fast_path_on_cpu():
        costs = count(fast_call, method, x, s, 16)
    assert costs.syncs == 0, costs.ops


def _merge_inputs(B: int):
    """Eight views of 96 tokens (an 8 x 12 grid) with vision-tower states, keys, a CLS and a projector."""
    torch.manual_seed(2)
    N, d, dv = 96, 128, 64
    projector = torch.nn.Sequential(torch.nn.Linear(dv, d), torch.nn.GELU(), torch.nn.Linear(d, d))
    vision = promprune.VisionFeatures(torch.randn(B, N, dv), torch.randn(B, N, 32), torch.randn(B, dv), projector)
    return torch.randn(B, N, d), torch.rand(B, N), vision


def _views(vision, b: int):
    return promprune.VisionFeatures(vision.hidden[:b], vision.keys[:b], vision.cls[:b], vision.project)


@pytest.mark.parametrize("method", ["visionzip", "downsample"])
def test_one_view_and_eight_launch_as_often(method):
    """The merges ran a product per image (``kernels.per_image``): 8 views launched 7 products and a join more than
    one (the cost model at LLaVA-NeXT's batch 8, 40 views: ~1 ms a call). One segmented sum for the batch now
    (``kernels.segment_sums``): the same launches at 1 view and at 8."""
    x, s, _ = _merge_inputs(8)
    with fast_path_on_cpu():
        one, eight = (count(promprune.select, x[:b], s[:b], budget=16, method=method, grid=(8, 12)) for b in (1, 8))
    assert one.launches == eight.launches, (one.ops, eight.ops)
    assert one.syncs == eight.syncs


def test_visionzip_with_a_projector_launches_more_per_view_only_by_the_projector():
    """The model's projector still runs once per image (``kernels.per_image``): one call over every image's rows sums
    in an order that depends on the batch (its GEMMs are the library's, not the selection's), so it alone grows
    with the views: by its own launches a view and the join of the results; the merge does not."""
    from benchmarks.launches import count_model

    x, s, vision = _merge_inputs(8)
    mlp = vision.project  # its weights on the device
    with fast_path_on_cpu(), torch.no_grad():
        one, eight = (count_model(mlp, promprune.select, x[:b], s[:b], budget=16, method="visionzip",
                                  vision=_views(vision, b)) for b in (1, 8))
        projector = count_model(mlp, mlp, torch.randn(1, 3, 64))  # one image's rows: its merged tokens and its CLS
    assert eight.launches - one.launches == 7 * projector.launches + 1, (one.ops, eight.ops, projector.ops)
    assert one.syncs == eight.syncs


def test_without_float64_tensor_cores_the_steps_take_cublas_product(views, monkeypatch):
    """On a GPU without float64 MMA (an A40, sm_86: ``accel.float64_mma``) the Lanczos steps are not fused: the fused
    product would be scalar FMAs there (``test_greedy_triton``), so cuBLAS' product, the dot and the update a step."""
    x, s = views
    monkeypatch.setattr(accel, "_capability", lambda index: (8, 6))
    assert not accel.float64_mma(torch.device("cuda", 0)) and not lanczos_triton.fuses(1, 576, "cuda:0")
    assert accel.float64_mma("cpu") and lanczos_triton.fuses(1, 576, "cpu")  # the CPU stands for an H100 / H200
    monkeypatch.setattr(accel, "_capability", lambda index: (9, 0))
    assert accel.float64_mma("cuda:0") and lanczos_triton.fuses(5, 576, "cuda:0") \
        and not lanczos_triton.fuses(1, 1296, "cuda:0")
    with fast_path_on_cpu():
        fused = count(fast_call, "promprune", x, s, 16, mu=0.95)
        with monkeypatch.context() as m:
            m.setattr(accel, "float64_mma", lambda device: False)
            plain = count(fast_call, "promprune", x, s, 16, mu=0.95)
    assert fused.ops["triton:lanczos_fused"] == certified.LEAD - 1 and not plain.ops["triton:lanczos_fused"]
    assert plain.ops["triton:lanczos_update"] == certified.LEAD and plain.ops["bmm"] == certified.LEAD, plain.ops


def test_cdpruner_reads_the_device_only_for_selects_finiteness_check(views):
    """CDPruner's DPP is as wide as the budget, which the host knows: no read of its counts (one before)."""
    from benchmarks.selection import instruction_for

    x, s = views
    with fast_path_on_cpu():
        costs = count(promprune.select, x, s, budget=16, method="cdpruner", instruction=instruction_for(x))
    assert costs.syncs == 1 and all("_check_finite" in site for site in costs.sync_sites), costs.sync_sites


@pytest.mark.parametrize("fused", [True, False])
def test_promprune_waits_once_when_the_first_stage_decides(views, fused, monkeypatch):
    monkeypatch.setattr(lanczos_triton, "FUSED_UP_TO", math.inf if fused else -1)
    x, s = views
    with fast_path_on_cpu():
        costs = count(fast_call, "promprune", x, s, 16, mu=0.95)  # far above every entropy
    assert certified.LAST_REPORT[0].decided == [5] and costs.syncs == 1
    steps = certified.LEAD  # eager: every call opens with the lead (``certified.schedule``)
    lanczos = {k: v for k, v in costs.ops.items() if k.startswith("triton:lanczos")}
    if fused:  # a launch a step (the update and the next product) but the last, whose update ends it; no cuBLAS
        # product but the Gram's
        assert costs.ops["bmm"] == 1 and lanczos == {"triton:lanczos_fused": steps - 1, "triton:lanczos_update": 1,
                                                     "triton:lanczos_finish": 1}, costs.ops
    else:  # per Lanczos step one product (its Frobenius dot is no bmm) but for the first (rho I / sqrt(n) needs
        # none), and the Gram; two Triton kernels a step (the dot's shares, the update), one more to end the stage
        assert costs.ops["bmm"] == steps - 1 + 1, costs.ops
        assert lanczos == {"triton:lanczos_dot": steps, "triton:lanczos_update": steps,
                           "triton:lanczos_finish": 1}, costs.ops
    assert costs.launches <= 3 * steps + 60, costs.ops.most_common(10)


HALF = {"saliency_ratio_range": (0.5, 0.5)}  # PromPrune's split pinned at 8 of 16: both stages pick


# PromPrune's 31 / 20 became 33 / 22 when ``count`` began to see copies to the device (2026-12, issue 53): the counts
# t_sal the host worked out now reach the device by a counted copy, and the torch ops that turn them into the coverage
# stage's counts and dtype (a subtraction, a cast: the front kernel's work) are device ops, which ``count`` had taken
# for the host's arithmetic
@pytest.mark.parametrize("method,options,dpp,fewer", [("promprune", HALF, 1, 33),
                                                      ("promprune", {**HALF, "conditional": True}, 1, 22),
                                                      ("fixed_ratio", {}, 1, 33), ("saliency_only", {}, 0, 16),
                                                      ("coverage_only", {}, 1, 24)])
def test_the_stages_after_the_split_are_two_kernels(method, options, dpp, fewer, views):
    """With a DPP coverage stage, the saliency stage (min-max, sort, masks, the DPP's first pick, the indices' layout)
    and the DPP are two launches (``greedy_triton.salient_front``, then the DPP into its indices), against their torch
    ops (which run only where Triton cannot build that kernel): 33 launches fewer for PromPrune (22 for its
    conditional DPP, which has no first pick), the syncs the same. Saliency-only runs the first kernel alone, with no
    cosine (no Gram) to compute. Coverage alone (no saliency: ``select`` passes none to it) takes the same two kernels
    with the DPP's raster fallback order for a saliency (two launches to make it): 24 fewer. (The first pick's
    torch ops include two that rank a token with no gain last.) (The picks are the
    interpreted corpus' to check, ``select-coverage-only/*``: the cost model stubs the DPP.)"""
    x, s = views
    s = None if method == "coverage_only" else s
    with fast_path_on_cpu():
        fused = count(fast_call, method, x, s, 16, **options)
        with accel.without_kernel("front"):
            ops = count(fast_call, method, x, s, 16, **options)
    assert (fused.ops["triton:front"], fused.ops["triton:dpp"], ops.ops["triton:front"]) == (1, dpp, 0), fused.ops
    assert fused.syncs == ops.syncs and fused.flops == ops.flops
    assert ops.launches - fused.launches == fewer, (fused.ops, ops.ops)


@pytest.mark.parametrize("method", ["promprune", "divprune", "fixed_ratio", "saliency_only", "random", "vispruner"])
def test_the_ascending_order_is_one_kernel(method, views):
    """``select``'s ascending order at the end (the indices' sort and the salient flags' gather) is one launch
    (``greedy_triton.ascending``): one fewer than the torch ops, the same selection."""
    x, s = views
    with fast_path_on_cpu():
        fused = count(promprune.select, x, s, budget=16, method=method)
        got = promprune.select(x, s, budget=16, method=method)
        with accel.without_kernel("ascending"):
            torch_ops = count(promprune.select, x, s, budget=16, method=method)
            want = promprune.select(x, s, budget=16, method=method)
    assert fused.ops["triton:ascending"] == 1 and not torch_ops.ops["triton:ascending"], fused.ops
    assert fused.launches == torch_ops.launches - 1 and fused.syncs == torch_ops.syncs
    assert torch.equal(got.indices, want.indices) and torch.equal(got.salient, want.salient)


def test_the_cosine_is_one_kernel(views):
    """``TokenSet.cosine`` from the unit Gram on the fast path: one launch (``greedy_triton.scaled_gram``) where
    its torch ops (the rescaling, the symmetrization, the exact diagonal) take eleven; the same matrix."""
    x, _ = views

    def cosine(t):
        return TokenSet(t, None).cosine

    with fast_path_on_cpu():
        fused = count(cosine, x)
        with accel.without_kernel("cosine"):
            ops = count(cosine, x)
        got = cosine(x)
    assert (fused.ops["triton:scaled_gram"], ops.ops["triton:scaled_gram"], ops.launches - fused.launches) == (1, 0, 10)
    assert torch.equal(got, cosine(x))


def test_a_fused_step_triton_cannot_build_falls_back_to_three_launches_a_step(views, monkeypatch):
    """Where Triton cannot build the fused step (here: its launch fails inside Triton, as on a machine without a GPU
    driver), the recurrence takes the unfused kernels (a product, the dot, the update a step), says so once and
    keeps to them; the same values. With "lanczos" itself off, neither runs: the torch loop."""
    import triton

    x, _ = views
    rho = certified.density(centered_gram(TokenSet(x.double(), None).unit_gram))
    monkeypatch.setattr(accel, "_BROKEN", {})

    class Unbuildable:
        def __getitem__(self, grid):
            return lambda *args, **meta: triton.runtime.driver.active.get_current_device()

    with fast_path_on_cpu():
        want = certified.lanczos_steps(rho, None, None, None, 4)
        with monkeypatch.context() as patch:  # undone before fast_path_on_cpu puts the real kernel back
            patch.setattr(lanczos_triton, "_fused_kernel", Unbuildable())
            with pytest.warns(RuntimeWarning, match="lanczos_fused kernel"):
                costs = count(certified.lanczos_steps, rho, None, None, None, 4, warmup=False)
            got = certified.lanczos_steps(rho, None, None, None, 4)
    assert set(accel.broken_kernels()) == {"lanczos_fused"}
    assert costs.launches == 3 * 4 and costs.ops["bmm"] == 3, costs.ops
    assert all(torch.allclose(g, w, rtol=0, atol=1e-12 * float(w.abs().max())) for g, w in zip(got, want))
    with fast_path_on_cpu(), accel.without_kernel("lanczos"):
        loop = count(certified.lanczos_steps, rho, None, None, None, 4, warmup=False)
    assert not [op for op in loop.ops if op.startswith("triton:")], loop.ops


@pytest.mark.parametrize("fused", [True, False])
def test_the_cost_models_lanczos_kernels_give_the_torch_loops_values(views, fused, monkeypatch):
    """On the counted fast path the recurrence's Triton kernels are stood for by their work in torch
    (``launches._WorkStub``): one launch each, and the coefficients and state of the torch loop, for a first stage and
    one continued from it. ``fused`` (``lanczos_triton._fused_kernel``): a launch a step, the products inside it."""
    monkeypatch.setattr(lanczos_triton, "FUSED_UP_TO", math.inf if fused else -1)
    x, _ = views
    rho = certified.density(centered_gram(TokenSet(x.double(), None).unit_gram))
    want = certified.lanczos_steps(rho, None, None, None, 4)
    want_more = certified.lanczos_steps(rho, want[1], want[2], want[0][:, -1], 3)
    with fast_path_on_cpu():
        costs = count(certified.lanczos_steps, rho, None, None, None, 4, warmup=False)
        got = certified.lanczos_steps(rho, None, None, None, 4)
        more = count(certified.lanczos_steps, rho, got[1], got[2], got[0][:, -1], 3, warmup=False)
        got_more = certified.lanczos_steps(rho, got[1], got[2], got[0][:, -1], 3)
    # from the start: no product and no basis matrix for the first step (rho I / sqrt(n) is rho / sqrt(n))
    B, n, _ = rho.shape
    if fused:  # from the start: three fused steps, the last update, the finish; from a state one more (its first
        # product); each product's 2 B n^3 FLOPs counted in the fused launch
        assert (costs.launches, more.launches, costs.ops["bmm"], more.ops["bmm"]) == (4 + 1, 3 + 2, 0, 0), costs.ops
        assert (costs.flops, more.flops) == (3 * 2.0 * B * n ** 3, 3 * 2.0 * B * n ** 3)
    else:
        assert costs.launches == 3 * 4 + 1 - 1 and costs.ops["bmm"] == 3, costs.ops
        assert more.launches == 3 * 3 + 1 and more.ops["bmm"] == 3, more.ops
        assert (costs.flops, more.flops) == (3 * 2.0 * B * n ** 3, 3 * 2.0 * B * n ** 3)
    with fast_path_on_cpu(), accel.without_kernel("lanczos"):  # the torch loop: the start formed (eye, div, copy),
        loop = count(certified.lanczos_steps, rho, None, None, None, 4, warmup=False)  # its coefficients by a cat
    assert loop.launches == 3 + 6 + 7 * 3 + 1 and "lanczos" not in accel.broken_kernels(), loop.ops
    for g, w in zip(got + got_more, want + want_more):
        assert torch.allclose(g, w, rtol=0, atol=1e-12 * float(w.abs().max())), (g - w).abs().max()
    # the first stage from the float32 unit Gram: its centering and rho in two launches (``density_from_gram``), the
    # same matrix to float32 rounding (the row means summed in another order), and then the same recurrence; fused,
    # the first step makes rho where it reads it (``lanczos_triton.opening_from_gram``): the row means' launch only
    gram = TokenSet(x, None).unit_gram
    packed, rho32, *_ = certified.opening_from_gram(gram, 4)
    with fast_path_on_cpu():
        opened = count(certified.opening_from_gram, gram, 4, warmup=False)
        fast_packed, fast_rho, *_ = certified.opening_from_gram(gram, 4)
    assert (opened.ops["triton:row_means"], opened.ops["triton:density"], opened.launches) == \
        (1, 0 if fused else 1, (1 if fused else 2) + costs.launches), opened
    assert torch.allclose(fast_rho, rho32, rtol=0, atol=1e-6 * float(rho32.abs().max()))
    assert torch.allclose(fast_packed, packed, rtol=1e-5, atol=1e-9)


def test_random_with_keys_never_waits_and_without_reads_one_fingerprint(views):
    x, s = views
    with fast_path_on_cpu():
        keyed = count(promprune.select, x, None, budget=16, method="random", keys=list(range(5)))
        unkeyed = count(promprune.select, x, None, budget=16, method="random")
    assert keyed.syncs == 1 and unkeyed.syncs == 2  # select's finiteness check; the fingerprints' one read


def test_select_checks_every_input_with_one_read(views):
    x, s = views
    with fast_path_on_cpu():
        costs = count(promprune.select, x, s, budget=16, method="saliency_only")
    assert costs.syncs == 1


def test_a_sync_on_host_values_is_not_counted():
    x = torch.ones(4)

    def host_work(t):
        host = torch.from_numpy(np.ones(4))  # values the host already holds
        return int(host.sum()) + int(t.sum())  # only the second reads the device

    assert count(host_work, x).syncs == 1


@pytest.mark.parametrize("read", [lambda t: t.cpu(), lambda t: t.numpy(), lambda t: t.to("cpu"),
                                  lambda t: t.to("cpu", torch.float64, copy=True), lambda t: t.tolist(),
                                  lambda t: np.asarray(t.detach().cpu())])
def test_count_sees_every_read_of_the_device(read):
    """``.cpu()``, ``.numpy()``, ``.to(<host>)`` of a call's tensor are reads of the device: one sync each (``count``
    saw none of them: it ran the call on CPU tensors, where they are no-ops), and what they return is the host's, its
    arithmetic uncounted."""
    def work(t):
        host = torch.as_tensor(read(t))
        return host * 2 + 1

    c = count(work, torch.ones(4))
    assert (c.syncs, c.launches) == (1, 0), (c.ops, c.sync_sites)


@pytest.mark.parametrize("to_device, syncs", [
    (lambda h, x: h.to(x.device), 1), (lambda h, x: h.to(x.device, torch.float32, copy=True), 1),
    (lambda h, x: h.to(x.device, non_blocking=True), 0), (lambda h, x: torch.tensor([1.0, 2.0], device=x.device), 1),
    (lambda h, x: torch.as_tensor(np.ones(2), device=x.device), 1)])
def test_count_sees_copies_to_the_device(to_device, syncs):
    """Host data copied to the device: one launch, and a sync unless non-blocking (torch's blocking copy waits for the
    stream); ``count`` saw neither (the copy of a CPU tensor to the CPU launches nothing). The copy is the device's:
    what is made from it counts."""
    def work(x):
        return to_device(torch.ones(2, dtype=torch.float64), x) * x[:2]

    c = count(work, torch.ones(4))
    assert (c.syncs, c.launches, c.ops["to_device"], c.ops["mul"]) == (syncs, 2, 1, 1), (c.ops, c.sync_sites)


@pytest.mark.parametrize("name, op, syncs", [
    ("eigvalsh", lambda a: torch.linalg.eigvalsh(a), 1), ("eigh", lambda a: torch.linalg.eigh(a), 1),
    ("cholesky", lambda a: torch.linalg.cholesky(a), 1), ("cholesky_ex", lambda a: torch.linalg.cholesky_ex(a), 0),
    ("solve", lambda a: torch.linalg.solve(a, a[..., :1]), 1), ("inv", lambda a: torch.linalg.inv(a), 1),
    ("inv_ex", lambda a: torch.linalg.inv_ex(a), 0),
    ("repeat_interleave", lambda a: a.repeat_interleave(a.diagonal().long(), dim=0), 1),  # repeats 2, 2, 2, 2
    ("repeat_interleave sized", lambda a: a.repeat_interleave(a.diagonal().long(), dim=0, output_size=8), 0),
    ("repeat_interleave int", lambda a: a.repeat_interleave(2, dim=0), 0),
    ("bincount", lambda a: torch.bincount(a[0].long().clamp_min(0)), 1)])
@pytest.mark.parametrize("inference", [False, True])
def test_count_sees_the_waits_inside_ops(name, op, syncs, inference):
    """Ops whose host waits on CUDA are inside them: the linear algebra that checks cuSOLVER's error codes on the host
    (``_linalg_check_errors``; none for the ``_ex`` forms), ``repeat_interleave`` sized by its repeats' sum,
    ``bincount`` sized by its largest value; under inference mode too (the model path's), where the dispatch mode
    sees the composite ops whole."""
    a = torch.eye(4) * 2 + 0.1
    with torch.inference_mode(inference):
        c = count(op, a)
    assert c.syncs == syncs, (name, c.ops, c.sync_sites)


def _count_of(mu: float, budget: int = 16):
    from promprune.selection.budget import split_budget

    return lambda h: split_budget(h, budget, mu=mu, tau=0.02)


def test_with_graphs_the_first_stage_costs_four_launches(views):
    """PromPrune's split from the unit Gram with its stages as CUDA graphs (``PROMPRUNE_GRAPHS=1``, each replay
    stood for on the CPU): the centering, the density, the start, the first stage's steps and the rows' flags
    (``entropy.cancels``, joined to the coefficients for the one read) are one graph; around it only the Gram's and
    the tokens' copies into the graph's inputs and the coefficients' copy out (the state is borrowed)."""
    x, _ = views
    gram = TokenSet(x, None).unit_gram
    with fast_path_on_cpu(graphs=True):
        costs = count(certified.split, gram, _count_of(0.95), tokens=x)
    assert certified.LAST_REPORT[0].decided == [5]
    assert (costs.launches, costs.syncs) == (4, 1), costs.ops
    assert (costs.ops["cuda_graph"], costs.ops["copy"], costs.ops["clone"]) == (1, 2, 1), costs.ops
    # the graph's products still count as device work: one per step but the first
    assert costs.flops == 2 * (certified.STEPS[0] - 1) * 5 * 96 ** 3


def test_with_graphs_promprune_is_two_graphs_around_one_read(views, graphs_schedule):
    """PromPrune's whole ``select`` on the fast path with graphs, for images its first stage decides: the input guard
    (one sum per input and their total, one read), the first stage's graph (the tokens' copy in, the coefficients'
    copy out), one read of them with the rows' flags (``entropy.cancels``, made and joined to them in the graph), the
    picking stages' graph (the tokens', saliency's and the counts' copies in, the indices' and salient flags' copies
    out; the counts and entropies come from the host: two non-blocking copies to the device, as eagerly), and the
    ascending order (one kernel): 16 launches (13 before ``count`` saw copies to the device: the two copies from the
    host and the counts' copy into the graph), where the same call eagerly launches every kernel of the Gram, the
    cosine, the saliency order and the DPP's set-up, and at least one a Lanczos step (one fused, three not). Same
    picks."""
    x, s = views
    with fast_path_on_cpu():
        want = promprune.select(x, s, budget=16, method="promprune", mu=0.95)
        eager = count(promprune.select, x, s, budget=16, method="promprune", mu=0.95)
    with fast_path_on_cpu(graphs=True):
        got = promprune.select(x, s, budget=16, method="promprune", mu=0.95)
        graphs = count(promprune.select, x, s, budget=16, method="promprune", mu=0.95)
    assert certified.LAST_REPORT[0].decided == [5]
    assert torch.equal(got.indices, want.indices) and torch.equal(got.salient, want.salient)
    assert torch.equal(got.saliency_count, want.saliency_count) and torch.equal(got.entropy, want.entropy)
    assert (graphs.launches, graphs.syncs) == (16, 2), graphs.ops
    assert (graphs.ops["cuda_graph"], graphs.ops["copy"], graphs.ops["clone"], graphs.ops["to_device"]) \
        == (2, 4, 3, 2), graphs.ops
    assert not [op for op in graphs.ops if op.startswith("breaks capture")], graphs.ops
    assert eager.launches - graphs.launches > certified.STEPS[0] and eager.syncs == graphs.syncs


def test_graph_bodies_never_read_the_device_through_every_stage(views, graphs_schedule):
    """Images placed at t_sal's count boundaries run every stage (and some the eigensolve): no stage's graph body
    reads a device value (that would break a real capture), one graph per stage, and the picks are the eager
    split's."""
    x, s = views
    tokens = TokenSet(x, s)
    h0 = float(tokens.spectral_entropy[0])
    mu = h0 - 0.02 * math.log(0.46875 / 0.53125)  # the first image on the boundary between t_sal = 8 and 9 (T = 16)
    with fast_path_on_cpu():
        want = fast_call("promprune", x, s, 16, mu=mu)
        eager = count(fast_call, "promprune", x, s, 16, mu=mu)
    stages = len(certified.LAST_REPORT[0].decided)
    with fast_path_on_cpu(graphs=True):
        got = fast_call("promprune", x, s, 16, mu=mu)
        graphs = count(fast_call, "promprune", x, s, 16, mu=mu)
    assert stages >= 2, certified.LAST_REPORT
    assert torch.equal(got.indices, want.indices)
    assert not [op for op in graphs.ops if op.startswith("breaks capture")], graphs.ops
    assert graphs.ops["cuda_graph"] == stages + 1 and graphs.syncs == eager.syncs  # and the picking stages' graph
    assert graphs.launches < eager.launches - certified.STEPS[0]  # eagerly a launch a step at least (three unfused)


def test_a_stage_that_every_image_goes_on_from_copies_nothing(views):
    """An image its first stage leaves undecided, alone in its call: the next stage goes on from the state as it is,
    eagerly and from a graph's borrowed buffers, with no copy of the state's rows (four launches a stage), and the
    same count as the exact algorithm's."""
    x, s = views
    x, s = x[:1], s[:1]
    tokens = TokenSet(x, s)
    h0 = float(tokens.spectral_entropy[0])
    # near the boundary between t_sal = 8 and 9 (T = 16), not on it: a later stage decides, not the eigensolve
    mu = h0 - 0.02 * math.log(0.46875 / 0.53125) + 1e-4
    want = fast_call("promprune", x, s, 16, mu=mu)  # no fast path: the exact eigensolve
    for graphs in (False, True):
        with fast_path_on_cpu(graphs=graphs):
            fast_call("promprune", x, s, 16, mu=mu)  # with graphs: the shapes' first sighting runs eagerly
            costs = count(fast_call, "promprune", x, s, 16, mu=mu)
            got = fast_call("promprune", x, s, 16, mu=mu)
        report = certified.LAST_REPORT[0]
        assert len(report.decided) >= 2 and report.exact == 0, report
        assert costs.ops["index"] == 0, costs.ops
        assert torch.equal(got.saliency_count, want.saliency_count)  # (the picks: the stubs' stand-ins here)


def test_host_time_leaves_out_what_the_graphs_run():
    """``host_ms`` with graphs times the host's work around a replay, not the replayed body (here 30 ms of sleep,
    which the eager call pays every time)."""
    import time

    from benchmarks.launches import host_ms
    from promprune.selection import graphed

    def body(x, static):
        time.sleep(0.03)
        return (x + 1,)

    def call(x):
        return graphed.replay(body, (x,), 0) if graphed.fits(x, 1) else body(x, 0)

    x = torch.zeros(3)
    assert host_ms(call, x, calls=3) >= 30
    assert host_ms(call, x, graphs=True, calls=9) < 10  # a median of 9: a busy machine's few preemptions pass


def test_the_host_sizes_launches_without_tritons_constexpr_functions(views, monkeypatch):
    """``accel.cdiv`` and ``accel.pow2_at_least`` give Triton's ``cdiv`` and ``next_power_of_2`` on every size, and a
    select on the fast path calls neither of Triton's (each a ``ConstexprFunction``: ~5 us a call from Python)."""
    import triton

    sizes = [0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 576, 1296, 331776, 2 ** 20 + 1]
    assert [accel.pow2_at_least(n) for n in sizes[1:]] == [triton.next_power_of_2(n) for n in sizes[1:]]
    assert [accel.cdiv(n, d) for n in sizes for d in (1, 16, 64, 1024)] == \
        [triton.cdiv(n, d) for n in sizes for d in (1, 16, 64, 1024)]
    calls = []

    def counted(name):
        real = getattr(triton, name)
        return lambda *args: calls.append(name) or real(*args)

    monkeypatch.setattr(triton, "cdiv", counted("cdiv"))
    monkeypatch.setattr(triton, "next_power_of_2", counted("next_power_of_2"))
    x, s = views
    with fast_path_on_cpu():
        for method in ("promprune", "divprune", "vispruner", "fixed_ratio"):
            promprune.select(x, s, budget=16, method=method)
    assert not calls, calls
