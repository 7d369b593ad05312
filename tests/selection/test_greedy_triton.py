"""The Triton kernels (``greedy_triton``) select exactly what the torch loops of ``diversity`` (and VisPruner's rounds
in ``baselines``) select.

On the CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set in a subprocess: it must be set before
Triton is imported, and must not leak into other tests); on a GPU, compiled, against the CPU reference
(``-k cuda``). The corpus and its reasons live in ``triton_cases.py``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.selection import triton_cases

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(triton_cases.cases())
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (it ships with the CUDA builds of torch)")


def _interpreter_cannot_run_here() -> str | None:
    """Why Triton's interpreter cannot run the kernels with this numpy, or None. Before Triton 3.8 (torch 2.11 brings
    3.6) the interpreter turns a loaded scalar into a loop bound with ``int()`` of a one-element array, which numpy
    2.5 refuses (``range(count)`` in the kernels); 3.8 squeezes it first. The compiled kernels are not affected."""
    import numpy as np

    try:
        int(np.zeros(1))
        return None
    except TypeError:
        pass
    from triton.runtime import interpreter

    if "int(self.handle.data))" in Path(interpreter.__file__).read_text():
        import triton

        return (f"Triton {triton.__version__}'s interpreter calls int() on one-element arrays, which numpy "
                f"{np.__version__} refuses (Triton 3.8 squeezes first); the compiled kernels are checked by -k cuda")
    return None


def _check(name: str, result: dict) -> None:
    got, want = torch.tensor(result["got"]), torch.tensor(result["want"])
    if name in triton_cases.NOISY:  # decided by rounding noise: a valid selection of the same size
        assert torch.equal(got == -1, want == -1), name
        for row in got:
            kept = row[row >= 0]
            assert kept.unique().numel() == kept.numel(), f"{name}: a token picked twice: {row.tolist()}"
        return
    assert result["match"], f"{name}: kernel {result['got']} != reference {result['want']}"


def _interpret(part: str = "0/1") -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_cases.py")), "--part", part], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"triton_cases.py under TRITON_INTERPRET=1 failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """The corpus under the interpreter (~55 s of one core), run once per test session. pytest-xdist's workers each
    set this fixture up: the corpus is cut in one part per worker, each worker runs its own part first, then each
    other part that nobody has run (waiting on one that another worker is running), the results in the session's
    temp dir. Every worker ends with every case; no case runs twice."""
    why = _interpreter_cannot_run_here()
    if why:
        pytest.skip(why)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return _interpret()
    import fcntl

    parts, mine = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), int(worker.removeprefix("gw"))
    shared = tmp_path_factory.getbasetemp().parent  # this session's, every worker's
    results = {}
    for part in [mine, *(p for p in range(parts) if p != mine)]:
        done = shared / f"triton-interpreted-{part}-of-{parts}.json"
        with open(f"{done}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held while the part runs; released when the file closes
            if not done.is_file():
                done.write_text(json.dumps(_interpret(f"{part}/{parts}")))
        results.update(json.loads(done.read_text()))
    return results


@needs_triton
@pytest.mark.parametrize("name", NAMES)
def test_interpreted_kernel_matches_reference(interpreted, name):
    _check(name, interpreted[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_kernel_matches_reference(name):
    got, want = triton_cases.cases()[name]("cuda")
    _check(name, {"match": bool(torch.equal(got, want)), "got": got.tolist(), "want": want.tolist()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rank", ["tiles", "wide"])
@pytest.mark.parametrize("B,N,keep", [(1, 576, 32), (5, 576, 32), (1, 1296, 64), (2, 2880, 160)])
def test_cuda_vispruner_kernel_at_the_papers_sizes(B, N, keep, rank):
    """VisPruner's kernels (the default's tiles, the wide one) at LLaVA-1.5's, LLaVA-NeXT's (five views), Qwen2.5-VL's
    and LLaVA-NeXT's whole-image candidate counts (T = 64, 64, 128, 320; half kept by saliency) against the CPU loop
    on the same similarity."""
    from promprune.selection import baselines, greedy_triton
    from promprune.selection.registry import TokenSet

    g = torch.Generator().manual_seed(N + B)
    K = TokenSet(torch.randn(B, N, 64, generator=g), None).cosine
    rest = torch.stack([torch.randperm(N, generator=g)[:N - keep] for _ in range(B)])
    want = baselines.vispruner_diverse(K, rest, keep)  # the loop, on the CPU
    local = baselines._submatrix(K, rest, rest).float().cuda()
    rounds = baselines.vispruner_round_count(N - keep, keep)
    tiles = greedy_triton.VisTiles(rank=rank)
    picks = greedy_triton.vispruner_rounds(local, keep, rounds, baselines.VISPRUNER_ROUND, tiles).cpu()
    assert torch.equal(rest.gather(1, picks), want)


def _kernels():
    """Each kernel specialization ``select`` can launch: (kernel, signature, constexprs)."""
    from promprune.selection import greedy_triton as g
    from promprune.selection.diversity import FL_TIE_EPS, FPS_TIE_EPS

    dpp = {"K": "*fp32", "avail": "*i8", "anchor": "*i8", "order": "*fp32", "first": "*i64", "counts": "*i32",
           "F": "*fp32", "out": "*i64", "N": "i32", "OUT_W": "i32", "S_ROWS": "i32", "OUT_AT": "*i32"}
    dpp_at = {**dpp, "counts": "*i64", "OUT_AT": "*i64"}  # after the saliency stage's kernel: t_sal, long
    front = {"S": "*fp32", "T_SAL": "*i64", "K": "*fp32", "out": "*i64", "salient": "*i8", "anchor": "*i8",
             "free": "*i8", "first": "*i64", "N": "i32", "T": "i32"}
    fps = {"D": "*fp32", "first_score": "*fp32", "nearest": "*fp32", "avail": "*i8", "counts": "*i32",
           "out": "*i64", "N": "i32", "OUT_W": "i32"}
    fl = {"S": "*fp32", "cover": "*fp32", "avail": "*i8", "order": "*fp32", "counts": "*i32", "out": "*i64",
          "N": "i32", "OUT_W": "i32"}
    out = []
    for conditional, first, at in ((False, True, False), (True, False, False), (False, False, False),
                                   (False, True, True), (True, False, True)):
        consts = {"GAIN_EPS": 1e-6, "CONDITIONAL": conditional, "USE_FIRST": first, "AT": at, "BLOCK_N": 1024,
                  "BLOCK_S": 16}
        out.append((g._dpp_kernel, dpp_at if at else dpp, consts))
    scaled = {"G": "*fp32", "norms": "*fp32", "out": "*fp32", "N": "i32", "EPS_NUM": "fp32", "EPS": "fp32"}
    for ratio in (True, False):  # the cosine from the unit Gram; the unit Gram from the half tokens' product
        out.append((g._scaled_gram_kernel, scaled, {"RATIO": ratio, "DIAG": ratio, "BLOCK": g.GRAM_BLOCK}))
    for first, block_n in ((True, 2048), (False, 2048), (True, g.FRONT_MAX)):  # Qwen2.5-VL's 1296 tokens; the most
        out.append((g._front_kernel, front, {"FIRST": first, "BLOCK_N": block_n, "ROWS": max(1, 16384 // block_n),
                                             "GAIN_EPS": 1e-6}))
    out.append((g._fps_kernel, fps, {"TOL": FPS_TIE_EPS, "BLOCK_N": 2048}))
    ascending = {"IDX": "*i64", "SAL": "*u8", "out_idx": "*i64", "out_sal": "*u8", "T": "i32"}
    for has_sal, block_t in ((True, 64), (False, 1024), (True, g.ASCENDING_MAX)):  # LLaVA-1.5's budget; the most
        out.append((g._ascending_kernel, ascending, {"HAS_SAL": has_sal, "BLOCK_T": block_t}))
    divprune = {"C": "*fp32", "out": "*i64", "N": "i32", "OUT_W": "i32"}
    out.append((g._divprune_kernel, divprune, {"TOL": FPS_TIE_EPS, "BLOCK_N": 2048, "ROWS": 8}))
    out.append((g._fl_kernel, fl, {"TIE": FL_TIE_EPS, "BLOCK_N": 1024, "BLOCK_I": 16}))
    vis = {"C": "*fp32", "SI": "*i32", "lists": "*i32", "odd": "*i32", "match": "*fp32", "out": "*i64", "R0": "i32",
           "KEEP": "i32", "ROUNDS": "i32"}
    block_e, block_p, _ = g.vispruner_blocks(1232)  # Qwen2.5-VL's candidates at T = 128
    for sort_n in (0, 1024):  # the ranking by tiles, by one sort a round
        out.append((g._vispruner_kernel, vis, {"ROUND": 8, "BLOCK_E": block_e, "BLOCK_P": block_p,
                                               "BLOCK_M": g.VIS_TILES.evens, "CHUNK": g.VIS_TILES.chunk,
                                               "SORT_N": sort_n}))
    block_w, scan, levels, _ = g.vispruner_wide_blocks(1232, g.VisTiles(rank="wide"))
    wide = {k: v for k, v in vis.items() if k != "match"}
    out.append((g._vispruner_wide_kernel, wide, {"ROUND": 8, "BLOCK_W": block_w, "SCAN": scan, "LEVELS": levels}))
    from promprune.selection import lanczos_triton as lz

    chunk = {"TILE": lz.TILE}
    for ident in (True, False):
        out.append((lz._dot_kernel, {"U": "*fp64", "W": "*fp64", "DOT": "*fp64", "N2": "i32", "PARTS": "i32",
                                     "CHUNK": "i32", "N": "i32"}, {"IDENT": ident, **chunk}))
    update = {"W": "*fp64", "U": "*fp64", "VP": "*fp64", "OUT": "*fp64", "DOT": "*fp64", "NORM_IN": "*fp64",
              "NORM_OUT": "*fp64", "COEF": "*fp64", "BPREV": "*fp64", "BPREV_STRIDE": "i32", "N2": "i32",
              "PARTS": "i32", "PARTS_IN": "i32", "CHUNK": "i32", "N": "i32", "STEPS": "i32", "j": "i32"}
    # the start's step, the step after it, a later stage's first step, every other step
    for first, has_prev, ident, vp_ident in ((True, False, True, False), (False, True, False, True),
                                             (True, True, False, False), (False, True, False, False)):
        out.append((lz._update_kernel, update, {"FIRST": first, "HAS_PREV": has_prev, "IDENT": ident,
                                                "VP_IDENT": vp_ident, "PARTS_P2": 512, **chunk}))
    fused = {**{k: "*fp64" for k in ("RHO", "W", "U", "VP", "NEW", "VOUT", "WOUT", "DOT", "NORM_IN", "DOT_OUT",
                                     "NORM_OUT", "COEF", "BPREV")},
             "BPREV_STRIDE": "i32", "G": "*fp32", "R": "*fp32", "DG": "*fp32", "N": "i32", "PARTS_IN": "i32",
             "STEPS": "i32", "j": "i32"}
    blocks = {"PARTS_P2": 512, "DIAG": 1024, "BM": lz.BLOCK, "BN": lz.BLOCK, "BK": lz.BLOCK_K}
    # a stage's first product from a state; the start's update (from rho, from the Gram); the step after it; a later
    # stage's first update; every other step
    for update, first, has_prev, ident, vp_ident, gram in ((False, True, True, False, False, False),
                                                           (True, True, False, True, False, False),
                                                           (True, True, False, True, False, True),
                                                           (True, False, True, False, True, False),
                                                           (True, True, True, False, False, False),
                                                           (True, False, True, False, False, False)):
        out.append((lz._fused_kernel, fused, {"UPDATE": update, "FIRST": first, "HAS_PREV": has_prev, "IDENT": ident,
                                              "VP_IDENT": vp_ident, "GRAM": gram, "N_P2": 1024 if gram else 1,
                                              **blocks}))
    out.append((lz._finish_kernel, {"W": "*fp64", "NORM_IN": "*fp64", "COEF": "*fp64", "N2": "i32", "PARTS": "i32",
                                    "CHUNK": "i32", "STEPS": "i32"}, {"PARTS_P2": 512, **chunk}))
    out.append((lz._row_means_kernel, {"G": "*fp32", "R": "*fp32", "DG": "*fp32", "N": "i32"},
                {"ROWS": 16, "COLS": 128}))
    out.append((lz._density_kernel, {"G": "*fp32", "R": "*fp32", "DG": "*fp32", "RHO": "*fp64", "N": "i32",
                                     "N2": "i32", "CHUNK": "i32"}, {"N_P2": 2048, **chunk}))
    return out


# The most shared memory a block may have on sm_86 / sm_89 (A40, A6000, L40, RTX 30 / 40: 99 KB, opted in)
A40_SHARED = 99 * 1024


@needs_triton
@pytest.mark.parametrize("capability", [90, 86])
def test_kernels_compile_for_an_h100_and_an_a40_without_one(capability):
    """The interpreter is lenient about types; the compiler (Triton's bundled ptxas) is not: sm_90 (H100 / H200), and
    sm_86 (A40, the paper's GPU: no float64 tensor cores, 99 KB of shared memory a block against sm_90's 227). For
    sm_86 every kernel at the paper's sizes, less the three widest sorts (the front and the ascending order at 4096,
    VisPruner's wide kernel, not the default): ~2.5 minutes of ptxas there, for the same code at a larger size."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from promprune.selection import greedy_triton as g

    widest = (g._vispruner_wide_kernel,)
    for fn, signature, consts in _kernels():
        if capability == 86 and (fn in widest or consts.get("BLOCK_N") == g.FRONT_MAX
                                 or consts.get("BLOCK_T") == g.ASCENDING_MAX):
            continue
        source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": 8, "enable_fp_fusion": False})
        assert "cubin" in compiled.asm, fn.__name__
        assert capability != 86 or compiled.metadata.shared <= A40_SHARED, (fn.__name__, compiled.metadata.shared)


def test_the_wide_vispruner_kernel_compiles_without_spills(tmp_path):
    """The wide kernel at its defaults (16 warps; one compile for the paper's candidate counts) fits sm_90's registers:
    ptxas (the one Triton uses for sm_90) reports no spill stores or loads in any of its functions. Inlining its
    rounds' eight levels into one body spilled ~300 bytes (every level's constants hoisted out of the rounds' loop);
    each level is its own function (``noinline``)."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    import os
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from promprune.selection import greedy_triton as g

    try:  # the ptxas Triton itself assembles sm_90 with (Triton 3.9's bundles two; its "ptxas" is too old for its PTX)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError) as exc:
        pytest.skip(f"no ptxas from Triton here: {exc}")
    block_w, scan, levels, warps = g.vispruner_wide_blocks(1232)
    assert g.vispruner_wide_blocks(544)[:3] == g.vispruner_wide_blocks(2720)[:3] == (block_w, scan, levels)
    wide = {"C": "*fp32", "SI": "*i32", "lists": "*i32", "odd": "*i32", "out": "*i64", "R0": "i32", "KEEP": "i32",
            "ROUNDS": "i32"}
    consts = {"ROUND": 8, "BLOCK_W": block_w, "SCAN": scan, "LEVELS": levels}
    source = ASTSource(fn=g._vispruner_wide_kernel, signature={**wide, **dict.fromkeys(consts, "constexpr")},
                       constexprs=consts)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]
    path = tmp_path / "vispruner-wide.ptx"
    path.write_text(ptx)
    report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(path), "-o", os.devnull], capture_output=True,
                            text=True, check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert len(spills) >= 2 * levels and not any(spills), report  # the kernel and each level's function


@needs_triton
@pytest.mark.parametrize("dtype,extra", [(torch.long, 0), (torch.float32, 0), (torch.uint8, 0), (torch.bool, 1)])
def test_the_ascending_order_refuses_flags_it_would_misread(dtype, extra):
    """``ascending`` carries the salient flags as one byte each: int64 or float flags (a view of 8 or 4 bytes a flag)
    came back mostly unwritten, so flags other than bool of the indices' shape are refused before the launch
    (``select`` refuses them from a method of one's own first, on every path: ``registry._check_output``)."""
    from promprune.selection import greedy_triton

    idx = torch.tensor([[4, 1, 3]])
    with pytest.raises(TypeError, match="salient must be a bool tensor of the indices' shape"):
        greedy_triton.ascending(idx, torch.zeros(1, 3 + extra, dtype=dtype))


@needs_triton
def test_the_cosine_and_the_saliency_stage_divide_as_torch_does():
    """The Gram's and the cosine's scaling and the saliency's min-max divide in IEEE round-to-nearest float32
    (``div.rn.f32``; Triton's plain ``/`` is an approximate division, 2 ulp), with no fused multiply-add: the same bits
    as torch's ops, on which the cosine's ties and the salient order's depend."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from promprune.selection import greedy_triton as g

    checked = 0
    for fn, signature, consts in _kernels():
        if fn not in (g._scaled_gram_kernel, g._front_kernel) or consts.get("BLOCK_N") == g.FRONT_MAX:
            continue
        source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
        assert "div.rn.f32" in ptx, fn.__name__
        assert "approx" not in ptx and "div.full" not in ptx and "fma." not in ptx, fn.__name__
        checked += 1
    assert checked == 4


@needs_triton
def test_the_fused_step_multiplies_on_float64_tensor_cores_only_where_they_exist():
    """Why ``lanczos_triton.fuses`` needs ``accel.float64_mma``: for sm_80 (A100) the fused step's product compiles to
    float64 MMA; for sm_86 and sm_89 (A40, L40, RTX cards), which have none, to a loop of scalar float64 FMAs."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from promprune.selection import accel
    from promprune.selection import lanczos_triton as lz

    fn, signature, consts = next(k for k in _kernels() if k[0] is lz._fused_kernel and not k[2]["FIRST"])
    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    for capability in (80, 86, 89):
        ptx = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                             options={"num_warps": lz.FUSED_WARPS, "enable_fp_fusion": False}).asm["ptx"]
        mma = bool(re.search(r"mma\.sync[^\n]*\.f64", ptx))
        assert mma == (divmod(capability, 10) in accel.FLOAT64_MMA), capability
        assert mma or "fma.rn.f64" in ptx, capability


@needs_triton
def test_the_lanczos_kernels_round_as_the_torch_loop_does():
    """The recurrence's square root and divisions compile to IEEE round-to-nearest float64 instructions (an
    approximate one would move its coefficients past the 1e-11 the interpreted corpus holds them to), with no fused
    multiply-add (``enable_fp_fusion=False``, as the launches pass it)."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from promprune.selection import lanczos_triton as lz

    for fn, signature, consts in _kernels():
        if fn not in (lz._update_kernel, lz._finish_kernel, lz._fused_kernel) or consts.get("FIRST"):
            continue
        warps = lz.FUSED_WARPS if fn is lz._fused_kernel else lz.WARPS
        source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]
        assert "sqrt.rn.f64" in ptx and "div.rn.f64" in ptx, fn.__name__
        assert "approx" not in ptx and "fma." not in ptx, fn.__name__
        if fn is lz._fused_kernel:  # its product in float64 MMA (sm_80 and later), not a loop of scalar FMAs
            assert re.search(r"mma\.sync[^\n]*\.f64", ptx), fn.__name__

