"""Copies between the host and the device in bulk: one read of many small tensors, one write of many index arrays.

The model path keeps the bookkeeping the host needs (views, run positions, grid places, kept indices) on the host
and the features on the device. On a GPU each read of a device value is a sync (the host waits for every queued
kernel) and a blocking copy to the device is one too (torch's blocking copy synchronizes the stream), so the path
reads many small tensors with :func:`to_host` (one copy per device) and sends many index arrays with
:func:`to_device` (one non-blocking copy: the host's array is staged before the call returns, so it may go away).
"""
from __future__ import annotations

import numpy as np
import torch


def to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Numpy copies of ``tensors`` (any shapes and devices) with one device-to-host copy per device.

    Integer and bool tensors come back as int64 / bool arrays; if any tensor is a float one, the batch travels as
    float64 (exact for float32 / float16 / bfloat16 values and for integers below 2**53) and floats come back as
    float64.
    """
    out: list[np.ndarray | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for members in by_device.values():
        group = [tensors[i] for i in members]
        as_float = any(t.is_floating_point() for t in group)
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64 if as_float else torch.int64) for t in group])
        host = flat.cpu().numpy()  # the one read of this device
        start = 0
        for i, t in zip(members, group):
            part = host[start:start + t.numel()].reshape(tuple(t.shape))
            start += t.numel()
            if t.dtype == torch.bool:
                part = part != 0
            elif not t.is_floating_point():
                part = part.astype(np.int64, copy=False)
            out[i] = part
    return out


def to_device(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """``arrays`` (integer, any shapes) as int64 tensors on ``device``: one non-blocking copy of them all."""
    if not arrays:
        return []
    flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays])
    moved = torch.from_numpy(flat).to(device, non_blocking=True)  # views of it follow, no launch
    out, start = [], 0
    for a in arrays:
        size = int(np.prod(np.shape(a), dtype=np.int64))
        out.append(moved[start:start + size].view(np.shape(a)))
        start += size
    return out
