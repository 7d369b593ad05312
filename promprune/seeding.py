"""Seeding that stays private: a deterministic build or recipe seeds torch without moving its caller's random stream.

``with private_seed(seed): ...`` seeds torch's global CPU generator (and, for a CUDA ``device``, that device's
generator) as ``torch.manual_seed(seed)`` would, and on exit puts back the states the caller had: a researcher's
``torch.manual_seed(0); tiny_vlm(...); torch.rand(...)`` draws what it would have drawn without the build. The tiny,
shape and testbed models are built under it, and the offline training recipes run under it. Generators of other
devices are neither seeded nor, for CUDA, initialized (``torch.manual_seed`` would seed every CUDA device, lazily
when CUDA has not started yet).
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def private_seed(seed: int, device: str | torch.device = "cpu"):
    """Inside: torch's CPU generator, and ``device``'s when it is a CUDA device, seeded with ``seed``; the caller's
    states restored on exit (raising or not)."""
    device = torch.device(device)
    cuda = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(int(seed))
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(int(seed))
        yield
