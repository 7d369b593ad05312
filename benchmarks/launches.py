"""A GPU cost model counted on the CPU: the kernel launches, host syncs and matmul FLOPs of one call on the fast path.

``with fast_path_on_cpu(): counts = count(fn, *args)`` runs ``fn`` with the selection's CUDA fast path switched on for
CPU tensors (``accel.active`` true, the Triton kernels (greedy selectors, VisPruner's rounds) replaced by stubs that
count one launch each and fill their output with valid picks; those whose outputs the call reads on (the certified
split's, the Gram's and the cosine's, PromPrune's saliency stage's) by stubs that do their work with torch ops,
uncounted) under a dispatch mode that counts every ATen op that would launch a kernel (view and metadata ops excluded),
the ops that make the host wait on the device (``item``/``int``/``bool`` of a tensor, ``nonzero``, boolean indexing,
``tolist``, ``equal``, ``bincount``, ``repeat_interleave`` of a tensor of repeats without ``output_size``, and the
linear algebra whose error codes the host checks on CUDA: ``eigh`` / ``eigvalsh``, ``svd``, ``cholesky`` / ``solve`` /
``inv`` without ``_ex``, ``eig``) and the copies between host and device, as :func:`count_model` counts them (the
selection's own deliberate reads, ``accel.count_sync``, are such copies). ``fast_path_on_cpu(graphs=True)``
also replays the certified split's stages as CUDA graphs would (``CaptureStub`` stands for each capture: a replay counts
its input copies, one launch and its output clones; a host read inside a graph's body is listed as ``breaks
capture:<op>``).
Only ops on the device's tensors count (the call's tensor arguments and what device ops made from them, plus
factories given the device): the host's arithmetic on values it has read does not.
What the counts are for: a change that adds launches or syncs shows here without a GPU; a GPU time can be projected
from them (``project_ms``), and the GPU run says how good the projection was.

``count_model(model, fn, ...)`` counts a whole model path (``PrunedVLM.prepare``), where host and device tensors
meet, ``model``'s parameters and buffers on the device; ``count`` counts alike with only the call's tensor arguments
there. The device is played by ``cpu:0``: a device tensor (the model's parameters and buffers, the call's tensor
arguments, what device ops make) says ``t.device == cpu:0``, a host tensor ``cpu``, so code that asks a tensor for its
device gets the answer it would get on a GPU. A factory given ``device=cpu:0`` makes a device tensor, given none (or
``cpu``) a host one; ``.to`` of a host tensor to the device (``copy=True`` or not) and ``torch.tensor`` /
``torch.as_tensor`` given the device are a copy (one launch, and one sync unless ``non_blocking=True``: torch's
blocking copy waits for the stream); ``.cpu()``, ``.numpy()``, ``.to(<host>)`` of a device tensor are reads (syncs)
and return host tensors; an op that meets a device tensor and a host tensor of one
or more dimensions (indexing with host indices: torch moves them with a blocking copy; elementwise ops fail on a
GPU) counts as a sync, listed as ``implicit:<op>``.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
import traceback
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from promprune.selection import accel, graphed, greedy_triton, lanczos_triton
from promprune.selection.kernels import start_basis

# ops that launch nothing: views, metadata, allocation without a fill
NO_LAUNCH = {"view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select",
             "as_strided", "detach", "alias", "permute", "diagonal", "unbind", "split", "split_with_sizes", "chunk",
             "lift_fresh", "_reshape_alias", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
             "resolve_conj", "resolve_neg", "unfold", "narrow", "expand_as", "view_as",
             "promote_types", "result_type",  # dtype arithmetic: no tensor made
             "_local_scalar_dense", "item", "is_nonzero"}  # the last three: a device-to-host copy, counted as a sync
# ops whose result the host needs before it can go on (a device-to-host wait on CUDA); ``item`` / ``is_nonzero`` are
# what ``float(t)`` / ``bool(t)`` dispatch under inference mode (``_local_scalar_dense`` outside it), never both
SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal", "_unique2", "unique_dim",
            "unique_consecutive", "nonzero_static",
            # a histogram as long as its largest value: the host reads the maximum first
            "bincount",
            # linear algebra that checks LAPACK / cuSOLVER's error codes on the host (``_linalg_check_errors``:
            # ``infos.any().item()``): inside the kernel for eigh / eigvalsh and svd, as an op of its own after
            # cholesky / solve / inv and their kind (their ``_ex`` forms without ``check_errors`` skip it); eig runs
            # on the host on CUDA (MAGMA's geev): a copy there and back
            "_linalg_eigh", "linalg_eigh", "_linalg_svd", "_linalg_check_errors", "linalg_eig",
            # the same under inference mode, where the dispatch mode sees the composite ops whole
            "linalg_eigvalsh", "linalg_eigvals", "linalg_svd", "linalg_svdvals", "linalg_cholesky", "linalg_solve",
            "linalg_inv"}


def _sized_by_host(func, kwargs) -> bool:
    """``repeat_interleave`` with a tensor of repeats and no ``output_size``: the host reads their sum to size the
    output (a sync); with ``output_size``, or repeats given as an int, none."""
    return func.overloadpacket.__name__ == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") \
        and (kwargs or {}).get("output_size") is None
MASK_INDEXING = {"index", "index_put"}  # with a boolean mask among the indices: a nonzero inside, a sync
MATMUL = {"bmm", "mm", "matmul", "baddbmm", "addmm", "addbmm"}


@dataclass
class Costs:
    """What one call costs: ``launches`` (kernels), ``syncs`` (host waits), ``flops`` (matmul), per-op counts, and
    ``sync_sites``: where the syncs happened (the innermost frame outside torch: ``file:line function``)."""

    launches: int = 0
    syncs: int = 0
    flops: float = 0.0
    ops: Counter = field(default_factory=Counter)
    sync_sites: Counter = field(default_factory=Counter)

    def sync(self, n: int = 1) -> None:
        self.syncs += n
        self.sync_sites[_site()] += n


def _site() -> str:
    """The innermost caller outside torch and this module: ``path:line function`` (path from its package root)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith("benchmarks/launches.py"):
            continue
        for root in ("/promprune/", "/transformers/", "/benchmarks/", "/tests/"):
            if root in path:
                path = root.strip("/") + "/" + path.rsplit(root, 1)[1]
                break
        return f"{path}:{frame.lineno} {frame.name}"
    return "?"


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):  # VisionFeatures, Instruction, ...
        return [t for f in dataclasses.fields(tree) for t in _tensors(getattr(tree, f.name))]
    return []


# The device's tensors, id -> weak reference (tensors compare by value, not identity): what the calls' arguments were
# and what device ops made, kept from one count to the next, so that what a process keeps on the device (a warm-up's
# cached matrices, a graph's inputs) is still the device's when a later counted call uses it.
_MARKED: dict[int, weakref.ref] = {}


class _Counter(TorchDispatchMode):
    """Counts the ops of the device: those with a device tensor among their inputs (the call's arguments and what
    device ops made from them) or with no tensor input (factories); an op on host tensors only (the host's own
    arithmetic on values it read, e.g. ``torch.from_numpy`` results) launches nothing and waits for nothing."""

    def __init__(self, costs: Costs, inputs):
        super().__init__()
        self.costs = costs
        self.paused = False
        self.in_graph = False  # inside a replayed CUDA graph: its kernels are the graph's one launch
        self.device = _MARKED
        for key in [k for k, ref in _MARKED.items() if ref() is None]:  # what died since the last count
            del _MARKED[key]
        self.mark(_tensors(inputs))

    def mark(self, tensors) -> None:
        for t in tensors:
            self.device[id(t)] = weakref.ref(t)

    def on_device(self, t: torch.Tensor) -> bool:
        ref = self.device.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = _tensors(args) + _tensors(kwargs or {})
        if self.paused or (ins and not any(self.on_device(t) for t in ins)):
            return out
        self.mark(_tensors(out))
        name = func.overloadpacket.__name__.rstrip("_")
        if name in MATMUL and isinstance(out, torch.Tensor):
            inner = args[0].shape[-1] if name in ("bmm", "mm", "matmul") else args[1].shape[-1]  # the summed dim
            self.costs.flops += 2.0 * out.numel() * inner
        if self.in_graph:  # a read of the device here would break the capture: counted apart, never as a launch
            if name in SYNC_OPS or _sized_by_host(func, kwargs) \
                    or any(not self.on_device(t) and t.dim() > 0 for t in ins):
                self.costs.ops["breaks capture:" + name] += 1
            return out
        if any(t.dim() > 0 and not self.on_device(t) for t in ins):
            self.costs.sync()  # host tensors meet device ones: torch copies them over, blocking (or fails)
            self.costs.ops["implicit:" + name] += 1
        if name in SYNC_OPS or name in MASK_INDEXING and any(t.dtype in (torch.bool, torch.uint8) for t in ins) \
                or _sized_by_host(func, kwargs):
            self.costs.sync()
        if name not in NO_LAUNCH:
            self.costs.launches += 1
            self.costs.ops[name] += 1
        return out


_ACTIVE: list[_Counter] = []


class _KernelStub:
    """Stands for a Triton kernel: ``stub[grid](*args, **meta)`` counts one launch (none inside a graph's body: the
    graph is the launch) and fills the picks it would write (``args[out_arg]``, ``[B, width]``) with distinct in-range
    indices."""

    def __init__(self, out_arg: int, name: str):
        self.out_arg, self.name = out_arg, name

    def __getitem__(self, grid):
        def launch(*args, **meta):
            out, n = args[self.out_arg], args[self.out_arg + 1]
            if _ACTIVE:
                if not _ACTIVE[-1].in_graph:  # inside a graph's body it is one of the graph's kernels
                    _ACTIVE[-1].costs.launches += 1
                    _ACTIVE[-1].costs.ops["triton:" + self.name] += 1
                _ACTIVE[-1].paused = True
            try:
                out.copy_(torch.arange(out.shape[1]).remainder(n).expand_as(out))
            finally:
                if _ACTIVE:
                    _ACTIVE[-1].paused = False
        return launch


def _ident(B: int, N: int, like: torch.Tensor) -> torch.Tensor:
    """``kernels.start_basis`` flattened ``[B, N * N]`` (the recurrence's start, which the kernels never form)."""
    return start_basis(like.new_empty(1, N, N)).reshape(1, -1).expand(B, -1)


def _lanczos_dot(U, W, DOT, N2, PARTS, CHUNK, N, *, TILE, IDENT):
    """``lanczos_triton._dot_kernel``'s work in torch: the whole dot as the first share, the others 0."""
    B = DOT.shape[0]
    w = W.reshape(B, -1)
    u = _ident(B, N, w) if IDENT else U.reshape(B, -1)
    DOT.zero_()
    DOT[:, 0] = (u * (w / math.sqrt(N) if IDENT else w)).sum(1)


def _coefficients(DOT, NORM_IN, BPREV, BPREV_STRIDE, B, FIRST, HAS_PREV):
    """``lanczos_triton._coefficients`` in torch: ``(alpha, beta)`` ``[B, 1]`` each (beta 0 where it has none)."""
    dot = DOT.sum(1, keepdim=True)
    if FIRST:
        beta = BPREV.as_strided((B, 1), (BPREV_STRIDE, 0)) if HAS_PREV else torch.zeros_like(dot)
        return dot, beta
    beta = NORM_IN.sum(1, keepdim=True).sqrt()
    return dot / (beta * beta), beta


def _residual(w, u, vp, alpha, beta, FIRST, HAS_PREV):
    """``lanczos_triton._residual`` in torch: ``(new, v)``."""
    if FIRST:
        new = w - alpha * u
        return (new - beta * vp if HAS_PREV else new), u
    v = u / beta
    return w / beta - alpha * v - beta * vp, v


def _lanczos_update(W, U, VP, OUT, DOT, NORM_IN, NORM_OUT, COEF, BPREV, BPREV_STRIDE, N2, PARTS, PARTS_IN, CHUNK, N,
                    STEPS, j, *, FIRST, HAS_PREV, IDENT, VP_IDENT, TILE, PARTS_P2):
    """``lanczos_triton._update_kernel``'s work in torch, on the same buffers."""
    B = DOT.shape[0]
    w = W.reshape(B, -1) / math.sqrt(N) if IDENT else W.view(B, -1)
    u = _ident(B, N, w) if IDENT else U.view(B, -1)
    vp = _ident(B, N, w) if VP_IDENT else VP.view(B, -1)
    alpha, beta = _coefficients(DOT, NORM_IN, BPREV, BPREV_STRIDE, B, FIRST, HAS_PREV)
    new, v = _residual(w, u, vp, alpha, beta, FIRST, HAS_PREV)
    if not FIRST:
        u.copy_(v)
        COEF[:, STEPS + j - 1] = beta[:, 0]
    OUT.view(B, -1).copy_(new)
    NORM_OUT.zero_()
    NORM_OUT[:, 0] = (new * new).sum(1)
    COEF[:, j] = alpha[:, 0]


def _lanczos_fused(RHO, W, U, VP, NEW, VOUT, WOUT, DOT, NORM_IN, DOT_OUT, NORM_OUT, COEF, BPREV, BPREV_STRIDE, G, R,
                   DG, N, PARTS_IN, STEPS, j, *, UPDATE, FIRST, HAS_PREV, IDENT, VP_IDENT, GRAM, PARTS_P2, DIAG, N_P2,
                   BM, BN, BK):
    """``lanczos_triton._fused_kernel``'s work in torch, on the same buffers (each sum as the first share; with
    ``GRAM``, rho made first from the Gram as ``_density`` makes it)."""
    B = RHO.shape[0]
    if GRAM:
        _density(G, R, DG, RHO, N, N * N, 0, TILE=0, N_P2=N_P2)
        W = RHO
    if not UPDATE:
        x = U.reshape(B, -1)
    else:
        w = W.reshape(B, -1) / math.sqrt(N) if IDENT else W.reshape(B, -1)
        u = _ident(B, N, w) if IDENT else U.reshape(B, -1)
        vp = _ident(B, N, w) if VP_IDENT else VP.reshape(B, -1)
        if IDENT:
            alpha, beta = RHO.diagonal(dim1=1, dim2=2).sum(1, keepdim=True) / N, torch.zeros(B, 1, dtype=RHO.dtype)
        else:
            alpha, beta = _coefficients(DOT, NORM_IN, BPREV, BPREV_STRIDE, B, FIRST, HAS_PREV)
        x, v = _residual(w, u, vp, alpha, beta, FIRST, HAS_PREV)
        NEW.view(B, -1).copy_(x)
        if not FIRST:
            VOUT.view(B, -1).copy_(v)
            COEF[:, STEPS + j - 1] = beta[:, 0]
        COEF[:, j] = alpha[:, 0]
        NORM_OUT.zero_()
        NORM_OUT[:, 0] = (x * x).sum(1)
    product = torch.bmm(RHO, x.view(B, N, N))
    WOUT.copy_(product)
    DOT_OUT.zero_()
    DOT_OUT[:, 0] = (x * product.view(B, -1)).sum(1)


def _fused_flops(RHO, *args, **meta) -> float:
    """The fused step's product: ``2 B n^3``."""
    B, n, _ = RHO.shape
    return 2.0 * B * n ** 3


def _row_means(G, R, DG, N, *, ROWS, COLS):
    """``lanczos_triton._row_means_kernel``'s work in torch."""
    R.copy_(G.mean(dim=2))
    DG.copy_(G.diagonal(dim1=1, dim2=2))


def _density(G, R, DG, RHO, N, N2, CHUNK, *, TILE, N_P2):
    """``lanczos_triton._density_kernel``'s work in torch."""
    g = R.mean(dim=1)[:, None, None]
    c = (G - (R[:, :, None] + R[:, None, :])) + g
    trace = c.diagonal(dim1=1, dim2=2).double().sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    RHO.copy_(c.double() / trace[:, None, None])


def _lanczos_finish(W, NORM_IN, COEF, N2, PARTS, CHUNK, STEPS, *, TILE, PARTS_P2):
    """``lanczos_triton._finish_kernel``'s work in torch."""
    B = NORM_IN.shape[0]
    beta = NORM_IN.sum(1, keepdim=True).sqrt()
    W.view(B, -1).div_(beta)
    COEF[:, 2 * STEPS - 1] = beta[:, 0]


def _front(S, T_SAL, K, out, salient, anchor, free, first, N, T, *, FIRST, BLOCK_N, ROWS, GAIN_EPS):
    """``greedy_triton._front_kernel``'s work in torch: ``two_stage``'s own ops."""
    from promprune.selection.diversity import _first_from_anchor
    from promprune.selection.kernels import ranks_to_mask, stable_descending_order
    from promprune.selection.two_stage import minmax

    order = stable_descending_order(minmax(S))
    held = ranks_to_mask(order, T_SAL)
    head = torch.arange(T)[None, :] < T_SAL[:, None]
    out.copy_(torch.where(head, order[:, :T], -1))
    salient.copy_(head)
    anchor.copy_(held)
    free.copy_(~held)
    if FIRST:
        index, has_anchor = _first_from_anchor(K, ~held, held)
        first.copy_(torch.where(has_anchor, index, -1))


def _scaled_gram(G, norms, out, N, EPS_NUM, EPS, *, RATIO, DIAG, BLOCK):
    """``greedy_triton._scaled_gram_kernel``'s work in torch: ``TokenSet.cosine``'s or ``TokenSet.unit_gram``'s own
    ops."""
    from promprune.selection.kernels import cosine_from_unit_gram, unit_gram_from_product

    out.copy_(cosine_from_unit_gram(G, norms, EPS_NUM, EPS) if RATIO else unit_gram_from_product(G, norms, EPS))


def _ascending(IDX, SAL, out_idx, out_sal, T, *, HAS_SAL, BLOCK_T):
    """``greedy_triton._ascending_kernel``'s work in torch: ``registry._sorted``'s own sort and gather."""
    indices, perm = IDX.sort(dim=1)
    out_idx.copy_(indices)
    if HAS_SAL:
        out_sal.copy_(SAL.gather(1, perm))


# Seconds the stubs below spent doing their kernels' work on this CPU (device work: ``host_ms`` leaves it out).
_STUB_WORK = [0.0]


class _WorkStub:
    """Stands for a Triton kernel whose outputs the call reads back (the certified split's, the cosine's, the saliency
    stage's): ``stub[grid](*args, **meta)`` counts one launch (none inside a graph's body) and, with ``flops``, the
    FLOPs of the product the kernel does, and does the kernel's work with ``work`` in torch, uncounted, its time kept
    apart (``_STUB_WORK``)."""

    def __init__(self, work, name: str, flops=None):
        self.work, self.name, self.flops = work, name, flops

    def __getitem__(self, grid):
        def launch(*args, num_warps=None, enable_fp_fusion=None, **meta):
            if _ACTIVE:
                if not _ACTIVE[-1].in_graph:
                    _ACTIVE[-1].costs.launches += 1
                    _ACTIVE[-1].costs.ops["triton:" + self.name] += 1
                if self.flops is not None:  # a product inside the kernel: its FLOPs count, in a graph's body too
                    _ACTIVE[-1].costs.flops += self.flops(*args, **meta)
                _ACTIVE[-1].paused = True
            start = time.perf_counter()
            try:
                with torch.no_grad():
                    self.work(*args, **meta)
            finally:
                _STUB_WORK[0] += time.perf_counter() - start
                if _ACTIVE:
                    _ACTIVE[-1].paused = False
        return launch


class CaptureStub(graphed._Capture):
    """Stands for a CUDA graph capture (``graphed._Capture``) on the CPU. Made once per shape, as a capture is (under
    ``fast_path_on_cpu(graphs=True)`` at a shape's first call: ``count``'s warm-up, uncounted); each replay counts
    what the real one launches: a copy per input, the graph's one launch (``cuda_graph``), a clone per fresh output.
    The body's kernels run inside the graph: their FLOPs count, their launches do not, and a host read among them
    (which would break a real capture) is listed as ``breaks capture:<op>``."""

    def __init__(self, fn, args, static):
        self.fn, self.static = fn, static
        self.inputs = tuple(None if a is None else a.detach().clone() for a in args)
        self.eager = fn(*self.inputs, static)  # the warm-up, which graphed.replay checks the first replay against

    def _replay(self):
        counter = _ACTIVE[-1] if _ACTIVE else None
        if counter is None:
            return self.fn(*self.inputs, self.static)
        counter.mark([t for t in self.inputs if t is not None])
        counter.in_graph = True
        try:
            outputs = self.fn(*self.inputs, self.static)
        finally:
            counter.in_graph = False
        counter.costs.launches += 1
        counter.costs.ops["cuda_graph"] += 1
        return outputs


class KeptReplay(CaptureStub):
    """A capture stand-in whose replays give its warm-up's outputs without running the body: with it, a call's wall time
    on the CPU is the host's work around its graphs (``host_ms``)."""

    def __init__(self, fn, args, static):
        super().__init__(fn, args, static)
        self.kept = self.eager  # graphed.replay drops ``eager`` once the first replay is checked

    def _replay(self):
        return self.kept


@contextmanager
def fast_path_on_cpu(graphs: bool = False, bodies: bool = True):
    """The selection's CUDA fast path taken by CPU tensors, its Triton kernels stubbed (launch counted, picks
    filled); with ``graphs`` PromPrune's stages replay as CUDA graphs would (``accel.graphs``, each capture stood for
    by ``CaptureStub``, or with ``bodies=False`` by ``KeptReplay``: replays skip their bodies)."""
    saved = (accel.active, accel.has_triton, greedy_triton._dpp_kernel, greedy_triton._fps_kernel,
             greedy_triton._fl_kernel, greedy_triton._vispruner_kernel, graphed._Capture, dict(graphed._CAPTURES),
             list(graphed._FAILED), dict(graphed._SEEN), graphed.SIGHTINGS,
             (lanczos_triton._dot_kernel, lanczos_triton._update_kernel, lanczos_triton._finish_kernel,
              lanczos_triton._row_means_kernel, lanczos_triton._density_kernel, lanczos_triton._fused_kernel),
             greedy_triton._front_kernel,
             greedy_triton._scaled_gram_kernel, greedy_triton._divprune_kernel, greedy_triton._ascending_kernel)
    graphed._CAPTURES.clear()
    graphed._FAILED.clear()
    graphed._SEEN.clear()
    graphed._Capture = CaptureStub if bodies else KeptReplay
    graphed.SIGHTINGS = 1  # each shape captured at its first call (count's warm-up): the counted calls are replays
    accel.active = lambda t: accel._STATE["on"]  # every tensor on the fast path, unless the switch is off
    accel.has_triton = lambda: True
    (greedy_triton._dpp_kernel, greedy_triton._fps_kernel, greedy_triton._fl_kernel,
     greedy_triton._vispruner_kernel) = (_KernelStub(7, "dpp"), _KernelStub(5, "fps"), _KernelStub(5, "fl"),
                                         _KernelStub(5, "vispruner"))
    (lanczos_triton._dot_kernel, lanczos_triton._update_kernel, lanczos_triton._finish_kernel,
     lanczos_triton._row_means_kernel, lanczos_triton._density_kernel, lanczos_triton._fused_kernel) = (
        _WorkStub(_lanczos_dot, "lanczos_dot"), _WorkStub(_lanczos_update, "lanczos_update"),
        _WorkStub(_lanczos_finish, "lanczos_finish"), _WorkStub(_row_means, "row_means"),
        _WorkStub(_density, "density"), _WorkStub(_lanczos_fused, "lanczos_fused", _fused_flops))
    greedy_triton._front_kernel = _WorkStub(_front, "front")
    greedy_triton._scaled_gram_kernel = _WorkStub(_scaled_gram, "scaled_gram")
    greedy_triton._divprune_kernel = _KernelStub(1, "divprune")
    greedy_triton._ascending_kernel = _WorkStub(_ascending, "ascending")
    try:
        with accel.graphs(graphs):
            yield
    finally:
        (accel.active, accel.has_triton, greedy_triton._dpp_kernel, greedy_triton._fps_kernel,
         greedy_triton._fl_kernel, greedy_triton._vispruner_kernel, graphed._Capture) = saved[:7]
        graphed._CAPTURES.clear()
        graphed._CAPTURES.update(saved[7])
        graphed._FAILED[:] = saved[8]
        graphed._SEEN.clear()
        graphed._SEEN.update(saved[9])
        graphed.SIGHTINGS = saved[10]
        (lanczos_triton._dot_kernel, lanczos_triton._update_kernel, lanczos_triton._finish_kernel,
         lanczos_triton._row_means_kernel, lanczos_triton._density_kernel, lanczos_triton._fused_kernel) = saved[11]
        (greedy_triton._front_kernel, greedy_triton._scaled_gram_kernel, greedy_triton._divprune_kernel,
         greedy_triton._ascending_kernel) = saved[12:16]


def host_ms(fn, *args, graphs: bool = False, calls: int = 30, **kwargs) -> float:
    """Median wall ms of ``fn(*args, **kwargs)`` on the CPU on the fast path (kernels stubbed; with ``graphs``, every
    graph's replay skips its body), after one warm-up call: at a small stand-in size, where each eager op costs the
    CPU about what dispatching it costs, this is the host's share of a GPU call (Python, NumPy, torch's dispatch),
    which the launch count prices only on average. The time the stubs spend doing a kernel's work for the call (the
    certified split's recurrence, the cosine: device work) is left out. A measurement on this machine's CPU, not a GPU
    time."""
    with fast_path_on_cpu(graphs=graphs, bodies=False):
        fn(*args, **kwargs)
        times = []
        for _ in range(calls):
            start, stubs = time.perf_counter(), _STUB_WORK[0]
            fn(*args, **kwargs)
            times.append(time.perf_counter() - start - (_STUB_WORK[0] - stubs))
    return statistics.median(times) * 1e3


def count(fn, *args, warmup: bool = True, **kwargs) -> Costs:
    """The launches, syncs and matmul FLOPs of ``fn(*args, **kwargs)`` (``Tensor.tolist`` counts as a sync), after one
    uncounted call (``warmup``) that fills what a process builds once (cached pooling matrices, compiled kernels).
    The call's tensor arguments are the device's, played by ``cpu:0`` as in :func:`count_model`: copies between host
    and device count where they happen (a blocking copy to the device a sync, ``.cpu()`` / ``.numpy()`` of a device
    tensor a read). The warm-up runs as the device too (what a process keys by device is made there)."""
    if warmup:
        _count(fn, args, kwargs, resident=())
    return _count(fn, args, kwargs, resident=())


def count_model(model: torch.nn.Module, fn, *args, warmup: bool = True, **kwargs) -> Costs:
    """:func:`count` of ``fn(*args, **kwargs)`` with ``model``'s parameters and buffers on the device and the copies
    between host and device counted (the module docstring): for a model path that starts from host data. The warm-up
    call runs as the device (``cpu:0``) too, so what a process keys by device (a graph's capture) is made there."""
    resident = list(model.parameters()) + list(model.buffers())
    if warmup:
        _count(fn, args, kwargs, resident=resident)
    return _count(fn, args, kwargs, resident=resident)


def _count(fn, args, kwargs, resident) -> Costs:
    costs = Costs()
    real_tolist = torch.Tensor.tolist

    def tolist(t):
        if _ACTIVE and not _ACTIVE[-1].paused and _ACTIVE[-1].on_device(t):
            costs.sync()
        return real_tolist(t)

    torch.Tensor.tolist = tolist
    counter = _Counter(costs, (args, kwargs, resident))
    _ACTIVE.append(counter)
    try:
        with counter, _Transfers(counter):
            fn(*args, **kwargs)
    finally:
        _ACTIVE.pop()
        torch.Tensor.tolist = real_tolist
    return costs  # the selection's deliberate reads (``accel.count_sync``: a ``.cpu()``) are counted where they happen


@contextmanager
def on_host(owner, name: str):
    """``owner.name`` runs on the host inside the block: what it does is not counted and what it returns are host
    tensors (e.g. ``PrunedVLM.processed``, the processor: on a GPU run it works on the CPU before the copy over)."""
    real = getattr(owner, name)

    def host(*args, **kwargs):
        if not _ACTIVE:
            return real(*args, **kwargs)
        counter, before = _ACTIVE[-1], _ACTIVE[-1].paused
        counter.paused = True
        try:
            return real(*args, **kwargs)
        finally:
            counter.paused = before

    own = getattr(owner, "__dict__", {}).get(name)  # an instance's bound method lives on its class: None
    setattr(owner, name, host)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


# factories that make a host tensor unless given the device; tensor / as_tensor copy host data to that device
_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "eye", "linspace", "rand", "randn", "randint", "randperm",
              "tensor", "as_tensor", "scalar_tensor")
_COPIES = ("tensor", "as_tensor")
DEVICE = torch.device("cpu", 0)  # the device, as count_model's device tensors report it
HOST = torch.device("cpu")


def _is_device(device) -> bool:
    return device is not None and torch.device(device) == DEVICE


def _without_copy(args: tuple, kwargs: dict) -> tuple[tuple, bool]:
    """``Tensor.to``'s arguments less ``copy`` (a keyword, or the second bool after the target: ``to(device, dtype,
    non_blocking, copy)``), which ``kwargs`` loses, and its value."""
    copy = bool(kwargs.pop("copy", False))
    flags = [i for i, a in enumerate(args) if isinstance(a, bool)]
    if len(flags) == 2:
        copy = copy or args[flags[1]]
        args = args[:flags[1]] + args[flags[1] + 1:]
    return args, copy


class _Transfers:
    """While active: device tensors report ``cpu:0``; factories, ``.to`` / ``.cpu`` / ``.numpy`` between host and
    device counted (the module docstring)."""

    def __init__(self, counter: "_Counter"):
        self.counter = counter
        self.saved: dict = {}

    def __enter__(self):
        for name in _FACTORIES:
            self.saved[("torch", name)] = real = getattr(torch, name)
            setattr(torch, name, self._factory(real, name in _COPIES))
        for name in ("to", "cpu", "numpy", "device"):
            self.saved[("Tensor", name)] = torch.Tensor.__dict__.get(name, getattr(torch.Tensor, name))
        real_device = self.saved[("Tensor", "device")]
        c = self.counter
        torch.Tensor.device = property(lambda t: DEVICE if c.on_device(t) else real_device.__get__(t))
        torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.numpy = self._to(), self._cpu(), self._numpy()
        return self

    def __exit__(self, *exc):
        for (owner, name), real in self.saved.items():
            setattr(torch if owner == "torch" else torch.Tensor, name, real)
        return False

    def _to(self):
        c, real_to = self.counter, self.saved[("Tensor", "to")]

        def to(t, *args, **kwargs):
            args, copy = _without_copy(args, kwargs)  # torch's parser takes no ``copy`` (transformers' generate
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)  # passes it)
            if c.paused or device is None:
                return real_to(t, *args, **kwargs, copy=copy)
            same = dict(dtype=dtype, non_blocking=non_blocking, copy=copy)
            if memory_format is not None:
                same["memory_format"] = memory_format
            if c.on_device(t) == _is_device(device):  # stays where it is
                return real_to(t, **same)
            if c.on_device(t):
                return self._read(t, lambda: real_to(t, **same))
            return self._write(t, lambda: real_to(t, **same), non_blocking)
        return to

    def _cpu(self):
        c, real_cpu = self.counter, self.saved[("Tensor", "cpu")]

        def cpu(t, *args, **kwargs):
            if c.on_device(t) and not c.paused:
                return self._read(t, lambda: real_cpu(t, *args, **kwargs))
            return real_cpu(t, *args, **kwargs)
        return cpu

    def _numpy(self):
        c, real_numpy = self.counter, self.saved[("Tensor", "numpy")]

        def numpy(t, *args, **kwargs):
            if c.on_device(t) and not c.paused:
                c.costs.sync()
                c.costs.ops["read"] += 1
            return real_numpy(t, *args, **kwargs)
        return numpy

    def _factory(self, real, copies: bool):
        c = self.counter

        def make(*args, **kwargs):
            if c.paused or not _is_device(kwargs.get("device")):
                return self._host(lambda: real(*args, **{**kwargs, "device": HOST} if "device" in kwargs else kwargs))
            kwargs = {**kwargs, "device": HOST}
            if copies:  # host data copied to the device with a blocking copy
                return self._write(None, lambda: real(*args, **kwargs), non_blocking=False)
            return real(*args, **kwargs)
        return make

    def _host(self, make):
        c, before = self.counter, self.counter.paused
        c.paused = True
        try:
            return make()
        finally:
            c.paused = before

    def _read(self, t, move):
        """A device tensor read by the host: one sync; what comes back is a host tensor (a copy, unmarked)."""
        c = self.counter
        c.costs.sync()
        c.costs.ops["read"] += 1
        out = self._host(move)
        return self._host(out.clone) if out is t else out

    def _write(self, t, move, non_blocking: bool):
        """Host data copied to the device: one launch, one sync unless non-blocking; the copy is a device tensor."""
        c = self.counter
        c.costs.launches += 1
        c.costs.ops["to_device"] += 1
        if not non_blocking:
            c.costs.sync()
            c.costs.ops["to_device_blocking"] += 1
        out = self._host(move)
        out = self._host(out.clone) if out is t else out
        c.mark(_tensors(out))
        return out


# A projection's constants: what one eager launch costs the host, what one host wait costs, and the float64 / float32
# matmul rate. LAUNCH_US is fitted: on the H100 of 2026-11-26 (evening, fp16, batch 1; RESULTS), the eight methods
# whose time is their launches (all but PromPrune and VisPruner) at the three shapes took 0.11 ms + 27.8 us per
# launch counted here at that commit (least squares over 24 times; 6 us was assumed before). The others are
# assumptions, not measurements.
LAUNCH_US = 28.0
SYNC_US = 20.0
MATMUL_TFLOPS = 40.0


def project_ms(c: Costs) -> float:
    """A GPU time projected from the counts: launches and waits at their cost, matmuls at ``MATMUL_TFLOPS``."""
    return (c.launches * LAUNCH_US + c.syncs * SYNC_US) / 1e3 + c.flops / (MATMUL_TFLOPS * 1e12) * 1e3


def main(argv: list[str] | None = None) -> None:
    """``python benchmarks/launches.py [--method M ...] [--shape BxNxd] [--budget T]``: the cost table of methods."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
    import promprune
    from benchmarks import Flags
    from benchmarks.inputs import instruction_for, make_inputs

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("--method", nargs="+", default=None, help="registered methods (default: all pre-LLM ones)")
    ap.add_argument("--shape", default="1x576x4096", help="B x N x d of the features (default: LLaVA-1.5's)")
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args(argv)
    flags = Flags(__file__)
    flags.methods("--method", args.method or [], stage=promprune.PRE_LLM)
    parts = args.shape.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        flags.add(f"--shape {args.shape}", "expected BxNxd, three positive ints (images, tokens, feature width), "
                  "e.g. --shape 1x576x4096")
        parts = ["1", "0", "1"]
    B, N, d = (int(v) for v in parts)
    flags.budgets("--budget", [args.budget], N or None, f"--shape {args.shape}")
    flags.refuse()
    x, s = make_inputs(B, N, d, "cpu")
    print(f"one call at {args.shape}, T={args.budget}, on the GPU fast path counted on the CPU")
    print("| method | launches | syncs | matmul GFLOP | projected ms |\n|---|---:|---:|---:|---:|")
    for m in args.method or promprune.methods():
        text = instruction_for(x) if promprune.method_spec(m).needs_instruction else None
        with fast_path_on_cpu():
            c = count(promprune.select, x, s, budget=args.budget, method=m, instruction=text)
        print(f"| {m} | {c.launches} | {c.syncs} | {c.flops / 1e9:.2f} | {project_ms(c):.2f} |")


if __name__ == "__main__":
    main()
