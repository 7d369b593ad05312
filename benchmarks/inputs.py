"""The stand-in inputs of the selection benchmarks (``selection.py``, ``launches.py``): random features with the
structure of a vision tower's, their saliency, and a question for the methods that read one. Seeded: the same
inputs on every machine."""
from __future__ import annotations

import torch

import promprune


def make_inputs(B: int, N: int, d: int, device: str, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in features ``[B, N, d]`` (a smooth rank-32 structure plus noise, so the spectral entropy lands in the
    paper's range: ~0.55 at 576 x 4096, ~0.49 at 1296 x 3584) in ``dtype`` on ``device``, and random saliency ``[B, N]``
    (a softmax: it sums to 1 per view), seeded."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(B, 32, d, generator=g)
    mix = torch.randn(B, N, 32, generator=g)
    x = mix @ basis + 0.5 * torch.randn(B, N, d, generator=g)
    return x.to(device, dtype), torch.rand(B, N, generator=g).softmax(dim=1).to(device)


def instruction_for(x: torch.Tensor, seed: int = 0) -> promprune.Instruction:
    """A question for the methods that weigh tokens by their relevance to it (CDPruner): a random query in the
    features' own space (the LLM-embedding source), seeded."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(x.shape[0], x.shape[-1], generator=g).to(x.device, x.dtype)  # [B, d]
    return promprune.Instruction(query=query, tokens=x, source="llm")
