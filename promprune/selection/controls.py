"""Controls without selection: the token grid pooled down to the budget (``downsample``).

VTC-Bench (Liao et al., 2025) downsamples the IMAGE: its Qwen2-VL evaluation resizes each image to 1/3 of its
width and height (bicubic) before the processor, so a native-resolution encoder emits about 1/9 of the tokens.
A fixed-resolution encoder (CLIP in LLaVA) would resize the small image back up and emit as many tokens as before,
so this control pools the TOKEN grid instead, which works alike on every model and meets the budget exactly:

- ``h = round(sqrt(T * rows / cols))`` rows of cells (clamped to ``[ceil(T / cols), min(rows, T)]``); row band i
  gets ``floor((i + 1) T / h) - floor(i T / h)`` cells, so the cell counts sum to exactly T (a regular h x w grid
  whenever T = h * w, e.g. 24 x 24 -> 8 x 8 at T = 64; otherwise rows differ by one cell);
- every cell is the mean of the projected tokens in its bin (the bins of adaptive average pooling:
  ``[floor(i n / m), ceil((i + 1) n / m))`` along each axis), i.e. the LLM-space features are averaged;
- a cell is fed at the place (LLaVA: sequence slot; Qwen2.5-VL: 3D position) of its bin's centre token.

On Qwen2.5-VL / Qwen3-VL the grid is the merged-patch grid of the image (Qwen3-VL's DeepStack rows: the bin centre's);
on LLaVA-NeXT each view's grid (after unpadding) is pooled on its own (budget modes that split the budget per view);
on LLaVA-OneVision each view's grid as the LLM is fed it (a crop's rectangle of the stitched crop grid after
unpadding and anyres-max resizing). The adapter option ``image_tokens`` of
Qwen2.5-VL is the image-level variant (the processor resizes the image to a fixed token count).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from .kernels import segment_sums
from .registry import Selection, TokenSet, register_method


def pooled_cells(rows: int, cols: int, budget: int) -> list[tuple[int, int, int, int]]:
    """The ``budget`` pooling bins ``(r0, r1, c0, c1)`` (end-exclusive) of a ``rows x cols`` grid, in raster order."""
    h = min(max(round(math.sqrt(budget * rows / cols)), math.ceil(budget / cols), 1), rows, budget)
    cells = []
    for i in range(h):
        r0, r1 = (i * rows) // h, -((-(i + 1) * rows) // h)
        n_i = ((i + 1) * budget) // h - (i * budget) // h
        for j in range(n_i):
            cells.append((r0, r1, (j * cols) // n_i, -((-(j + 1) * cols) // n_i)))
    return cells


def pooling_matrix(rows: int, cols: int, budget: int, device=None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, N], centres [T])``: cell t is ``weights[t] @ tokens``; ``centres[t]`` its bin's centre token.
    Built once per grid and budget on the host (float64: each weight 1/k rounds to ``dtype`` as if set there) and
    copied once per device and dtype, then kept there (`DEVICE_COPIES` of them): a call copies nothing, and the host
    never waits (a blocking copy per call synchronized the stream twice). The tensors are shared: read them only."""
    return _device_pooling(rows, cols, budget, torch.device("cpu") if device is None else torch.device(device), dtype)


DEVICE_COPIES = 64  # (grid, budget, device, dtype) kept on their device; a LLaVA-NeXT run uses a few per budget


@lru_cache(maxsize=DEVICE_COPIES)
def _device_pooling(rows: int, cols: int, budget: int, device: torch.device,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # built as normal tensors whatever mode the first call runs in: an inference tensor (a first call under
    # torch.inference_mode, as PrunedVLM.generate runs) cached here would fail every later call under autograd
    with torch.inference_mode(False):
        weights, centres = _host_pooling(rows, cols, budget)
        # non-blocking: the host's tensors are staged at once and stay alive in their own cache
        return weights.to(device, dtype, non_blocking=True), centres.to(device, non_blocking=True)


@lru_cache(maxsize=256)
def _host_pooling(rows: int, cols: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The host's float64 weights and centres (`_device_pooling` calls it outside inference mode)."""
    cells = pooled_cells(rows, cols, budget)
    weights = torch.zeros(len(cells), rows * cols, dtype=torch.float64)
    centres = torch.empty(len(cells), dtype=torch.long)
    for t, (r0, r1, c0, c1) in enumerate(cells):
        members = (torch.arange(r0, r1)[:, None] * cols + torch.arange(c0, c1)[None, :]).flatten()
        weights[t, members] = 1.0 / members.numel()
        centres[t] = ((r0 + r1 - 1) // 2) * cols + (c0 + c1 - 1) // 2
    return weights, centres


def pooling_runs(rows: int, cols: int, budget: int, device=None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(members [L], weights [L], lengths [T], centres [T])``: the nonzero entries of :func:`pooling_matrix` cell by
    cell (each cell's tokens in raster order, ``lengths[t]`` of them; ``L`` sums them, more than N where adaptive bins
    overlap) and each cell's centre token: cell t is the sum of ``weights[i] * tokens[members[i]]`` over its run.
    Kept on the device per grid, budget and dtype as :func:`pooling_matrix` is (read them only)."""
    return _device_runs(rows, cols, budget, torch.device("cpu") if device is None else torch.device(device), dtype)


@lru_cache(maxsize=DEVICE_COPIES)
def _device_runs(rows: int, cols: int, budget: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):  # normal tensors whatever mode the first call runs in (_device_pooling)
        weights, centres = _host_pooling(rows, cols, budget)
        cell, members = weights.nonzero(as_tuple=True)  # row-major: cell by cell, each cell's tokens ascending
        lengths = torch.bincount(cell, minlength=weights.shape[0])
        return (members.to(device, non_blocking=True), weights[cell, members].to(device, dtype, non_blocking=True),
                lengths.to(device, non_blocking=True), centres.to(device, non_blocking=True))


@register_method("downsample", merges=True, needs_grid=True)
def downsample(tokens: TokenSet, budget: int) -> Selection:
    """Downsampling control: the token grid average-pooled to exactly T cells (no selection).

    Each cell is its tokens times their weights (:func:`pooling_matrix`'s 1/k, rounded to the features' dtype),
    summed from 0 in raster order (:func:`kernels.segment_sums`): one gather, one product and one segmented sum
    whatever the batch, and each cell's sum runs in the same order alone as in a batch, on the CPU and on CUDA (a
    GEMM per image was batch-free too, but a launch per image; one ``[T, N] x [N, B d]`` product summed float64
    tokens in an order that depended on B, ~1 ulp)."""
    rows, cols = tokens.grid
    members, weights, lengths, centres = pooling_runs(rows, cols, budget, tokens.x.device, tokens.x.dtype)
    products = tokens.x.index_select(1, members) * weights[:, None]  # [B, L, d], each token times its weight
    features = segment_sums(products, lengths.expand(tokens.batch, -1))  # [B, T, d]
    indices = centres[None].expand(tokens.batch, -1).clone()  # [B, T], ascending
    zeros = torch.zeros(tokens.batch, dtype=torch.long, device=indices.device)
    return Selection(indices, zeros, None, features, torch.zeros_like(indices, dtype=torch.bool))
