"""The in-LLM methods' stages read the device a fixed number of times per stage, whatever the batch size or the
number of tokens: per row or per token reads (``nonzero``, boolean-mask indexing, ``item``, ``tolist``) each make a
GPU's host wait inside the prefill (issue 53)."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.launches import MASK_INDEXING, SYNC_OPS
from promprune.models import PrunedVLM
from promprune.models.llm_hooks import InLLMPruner
from promprune.models.tiny import tiny_vlm

from .conftest import make_image


class _Reads(TorchDispatchMode):
    """Counts what would make the host wait for a GPU: the sync ops of the cost model, indexing with a boolean mask
    among the indices, and ``tolist`` (which dispatches nothing)."""

    def __init__(self, counts: Counter, key: str):
        super().__init__()
        self.counts, self.key = counts, key

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        indices = args[1] if name in MASK_INDEXING and len(args) > 1 else ()
        if name in SYNC_OPS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            self.counts[self.key] += 1
        return func(*args, **(kwargs or {}))


def _counted(monkeypatch, counts: Counter):
    """Count the reads of every ``_prune`` and ``_received`` call (and the calls)."""
    real_tolist = torch.Tensor.tolist
    current = []

    def tolist(t):
        if current:
            counts[current[-1]] += 1
        return real_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for name in ("_prune", "_received"):
        real = getattr(InLLMPruner, name)

        def wrapped(self, *args, _real=real, _name=name):
            key = _name + ("/raters" if _name == "_received" and args[-1] == "raters" else "")
            counts["calls " + key] += 1
            current.append(key)
            try:
                with _Reads(counts, key):
                    return _real(self, *args)
            finally:
                current.pop()

        monkeypatch.setattr(InLLMPruner, name, wrapped)


@pytest.mark.parametrize("method, options, reads", [
    ("fastv", {}, {"_prune": 1, "_received": 0}),
    ("pyramiddrop", {}, {"_prune": 1, "_received": 0}),
    ("sparsevlm", {"recycle_ratio": 1.0, "merge_ratio": 0.3}, {"_prune": 1, "_received/raters": 2}),
    ("dart", {}, {"_prune": 1}),
])
def test_each_stage_reads_the_device_a_fixed_number_of_times_at_any_batch_size(method, options, reads,
                                                                                monkeypatch):
    model, processor = tiny_vlm("llava_next")  # rows of different visual token counts, left-padded prompts
    images = [make_image(40, 56, 0), make_image(64, 30, 1), make_image(64, 64, 5), make_image(50, 80, 3)]
    prompts = ["What is in the picture? Please describe it in detail.", "Colour?", "Why?", "A cat?"]
    vlm = PrunedVLM(model, processor, method=method, budget=12, **options)
    per_call = {}
    for batch in (1, 4):
        counts = Counter()
        with monkeypatch.context() as patch:
            _counted(patch, counts)
            got = vlm.generate(images[:batch], prompts[:batch], max_new_tokens=2)
        assert all(g.visual_tokens == 12 for g in got)
        for key in reads:
            assert counts["calls " + key] >= 1
            per_call[batch, key] = counts[key] / counts["calls " + key]
    assert {key: per_call[1, key] for key in reads} == reads
    assert {key: per_call[4, key] for key in reads} == reads
