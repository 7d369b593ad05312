"""Test-only Triton kernels that write out what the greedy kernels compute inside a launch (``greedy_triton``'s own
``@triton.jit`` helpers, called as the kernels call them), for ``triton_cases.py`` to hold to a float64 reference.
Importing this module imports Triton: ``triton_cases`` imports it inside the cases that need it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from promprune.selection.greedy_triton import _blocks, _dpp_extend, _fl_gains


@triton.jit
def _fl_gains_kernel(S, cover, gain, N, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    tl.store(gain + b * N + offs, _fl_gains(S + b * N * N, cover + b * N, offs, inb, N, BLOCK_N, BLOCK_I), mask=inb)


def fl_gains(similarity: torch.Tensor, cover: torch.Tensor) -> torch.Tensor:
    """The gains ``[B, N]`` of ``similarity [B, N, N]`` float32 given ``cover [B, N]``, as ``_fl_kernel`` sums them
    at each step (``_blocks``' BLOCK_I rows at a time)."""
    B, N, _ = similarity.shape
    block_n, block_i, warps = _blocks(N)
    gain = torch.empty(B, N, dtype=torch.float32, device=similarity.device)
    _fl_gains_kernel[(B,)](similarity.contiguous(), cover.float().contiguous(), gain, N, BLOCK_N=block_n,
                           BLOCK_I=block_i, num_warps=warps, enable_fp_fusion=False)
    return gain


@triton.jit
def _dpp_row_kernel(K, F, gains, j, step, N, GAIN_EPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inb = offs < N
    g = tl.load(gains + b * N + offs, mask=inb, other=0.0)
    _dpp_extend(K + b * N * N, F + b * (step + 1) * N, g, offs, inb, tl.load(j + b), step >= 0, step, N, GAIN_EPS,
                BLOCK_S)


def dpp_row(kernel: torch.Tensor, rows: torch.Tensor, gains: torch.Tensor, j: torch.Tensor,
            gain_eps: float) -> torch.Tensor:
    """The Cholesky row ``e [B, N]`` that ``_dpp_kernel`` adds for token ``j [B]`` after the ``rows [B, S, N]`` kept so
    far, with residual gains ``gains [B, N]`` (``_dpp_extend``: ``(K_j - c_j^T F) / sqrt(d2_j)``, BLOCK_S rows of F
    at a time)."""
    B, S, N = rows.shape
    block_n, block_s, warps = _blocks(N)
    factor = torch.cat([rows.float(), rows.new_zeros(B, 1, N, dtype=torch.float32)], 1).contiguous()
    _dpp_row_kernel[(B,)](kernel.contiguous(), factor, gains.float().contiguous(), j.contiguous(), S, N,
                          GAIN_EPS=gain_eps, BLOCK_N=block_n, BLOCK_S=block_s, num_warps=warps, enable_fp_fusion=False)
    return factor[:, S]
