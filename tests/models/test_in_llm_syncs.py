"""The in-LLM methods' stages read the device a fixed number of times per stage, whatever the batch size or the
number of tokens: per row or per token reads (``nonzero``, boolean-mask indexing, ``item``, ``tolist``) each make a
GPU's host wait inside the prefill (issue 53). Their stages launch as many kernels at any batch size (no loop over the
rows), and the hooks that run at every layer (Qwen3-VL's DeepStack additions, Qwen3.5's linear-attention masks) read
nothing."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.launches import MASK_INDEXING, NO_LAUNCH, SYNC_OPS
from promprune.models import PrunedVLM
from promprune.models.llm_hooks import InLLMPruner
from promprune.models.tiny import tiny_vlm

from .conftest import make_image


class _Reads(TorchDispatchMode):
    """Counts what would make the host wait for a GPU: the sync ops of the cost model, indexing with a boolean mask
    among the indices, and ``tolist`` (which dispatches nothing); and under ``"launches " + key`` the ops that launch
    a kernel (the cost model's: all but views, metadata and allocations)."""

    def __init__(self, counts: Counter, key: str):
        super().__init__()
        self.counts, self.key = counts, key

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        indices = args[1] if name in MASK_INDEXING and len(args) > 1 else ()
        if name in SYNC_OPS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            self.counts[self.key] += 1
        if name not in NO_LAUNCH:
            self.counts["launches " + self.key] += 1
        return func(*args, **(kwargs or {}))


def next_rows() -> tuple[list, list[str]]:
    """Four LLaVA-NeXT rows: images of different visual token counts, prompts of different lengths (left-padded)."""
    images = [make_image(40, 56, 0), make_image(64, 30, 1), make_image(64, 64, 5), make_image(50, 80, 3)]
    return images, ["What is in the picture? Please describe it in detail.", "Colour?", "Why?", "A cat?"]


def counted_generate(monkeypatch, vlm, batch: int) -> tuple[Counter, list]:
    """``(counts, answers)``: the reads of ``vlm.generate`` (two new tokens) on the first ``batch`` of
    :func:`next_rows`, counted by :func:`_counted`."""
    images, prompts = next_rows()
    counts = Counter()
    with monkeypatch.context() as patch:
        _counted(patch, counts)
        got = vlm.generate(images[:batch], prompts[:batch], max_new_tokens=2)
    return counts, got


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
    model, processor = tiny_vlm("llava_next")
    vlm = PrunedVLM(model, processor, method=method, budget=12, **options)
    per_call = {}
    for batch in (1, 4):
        counts, got = counted_generate(monkeypatch, vlm, batch)
        assert all(g.visual_tokens == 12 for g in got)
        for key in reads:
            assert counts["calls " + key] >= 1
            per_call[batch, key] = counts[key] / counts["calls " + key]
    assert {key: per_call[1, key] for key in reads} == reads
    assert {key: per_call[4, key] for key in reads} == reads


def _stage_launches(monkeypatch, vlm, images, prompts) -> list[int]:
    """The kernels each stage launches in the prefill of ``vlm.generate`` (its ranking, ``_received``, and its cut,
    ``_prune``), in the order the stages run."""
    per_stage = []
    with monkeypatch.context() as patch:
        for name in ("_prune", "_received"):
            real = getattr(InLLMPruner, name)

            def wrapped(self, *args, _real=real, _name=name):
                counts = Counter()
                with _Reads(counts, _name):
                    out = _real(self, *args)
                per_stage.append((_name, counts["launches " + _name]))
                return out

            patch.setattr(InLLMPruner, name, wrapped)
        vlm.generate(images, prompts, max_new_tokens=1)
    return per_stage


@pytest.mark.parametrize("method, options", [
    ("fastv", {}),
    ("pyramiddrop", {}),
    ("sparsevlm", {"recycle_ratio": 1.0, "merge_ratio": 0.3}),
    ("dart", {}),
])
def test_each_stage_launches_as_many_kernels_at_any_batch_size(method, options, monkeypatch):
    """SparseVLM's raters and recycling and DART's pivots run on the whole batch at once: a stage launches the same
    kernels for one row as for four of different visual token counts and prompt lengths (before: a loop over the rows,
    some dozen launches a row)."""
    model, processor = tiny_vlm("llava_next")  # rows of different visual token counts, left-padded prompts
    images = [make_image(40, 56, 0), make_image(64, 30, 1), make_image(64, 64, 5), make_image(50, 80, 3)]
    prompts = ["What is in the picture? Please describe it in detail.", "Colour?", "Why?", "A cat?"]
    vlm = PrunedVLM(model, processor, method=method, budget=12, **options)
    one, four = (_stage_launches(monkeypatch, vlm, images[:batch], prompts[:batch]) for batch in (1, 4))
    assert len(one) == len(four) >= 1 and all(n > 0 for _, n in one)
    assert four == one


def _hook_reads(monkeypatch, vlm, images, prompts) -> Counter:
    """The reads of the device inside every per-layer hook of the pruner during ``vlm.generate`` (the layers', the
    scorers' and the DeepStack wrapper, transformers' own addition within it), under "hooks", those of the stages
    (``_prune``, ``_received``) among them, under "stages", and those of the LLM's hook (once per forward) under
    "lm"."""
    counts = Counter()
    with monkeypatch.context() as patch:
        real_tolist = torch.Tensor.tolist
        active = []

        def tolist(t):
            if active:
                counts["lm" if active[-1] == "lm" else "hooks"] += 1
                counts["stages"] += active[-1] == "stages"
            return real_tolist(t)

        patch.setattr(torch.Tensor, "tolist", tolist)

        def counted(fn, key):
            def run(*args, **kwargs):
                active.append(key)
                try:
                    with _Reads(counts, key):
                        return fn(*args, **kwargs)
                finally:
                    active.pop()
            return run

        for name in ("_on_layer", "_scorer", "_deepstack"):  # hook factories: count inside what they return
            real = getattr(InLLMPruner, name)
            patch.setattr(InLLMPruner, name, lambda self, *a, _real=real: counted(_real(self, *a), "hooks"))
        patch.setattr(InLLMPruner, "_on_lm", counted(InLLMPruner._on_lm, "lm"))  # once per forward, not per layer
        for name in ("_prune", "_received"):
            patch.setattr(InLLMPruner, name, counted(getattr(InLLMPruner, name), "stages"))
        vlm.generate(images, prompts, max_new_tokens=2)
    return counts


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("method", ["fastv", "pyramiddrop"])
def test_the_per_layer_hooks_read_nothing(arch, method, monkeypatch):
    """Qwen3-VL's DeepStack additions (one per early layer; before: a boolean index of the kept columns and
    transformers' own boolean indexing, three reads a layer) and Qwen3.5's linear-attention masks (before: a
    ``bool(alive.all())`` per linear layer after the cut) read the device nowhere: a generate's hooks read it only
    in the stages, once per stage, at batch 1 as at batch 3."""
    model, processor = tiny_vlm(arch)
    images = [make_image(40, 56, 0), make_image(64, 30, 1), make_image(64, 64, 5)]
    prompts = ["What is in the picture? Please describe it in detail.", "Colour?", "Why?"]
    vlm = PrunedVLM(model, processor, method=method, budget=5)
    stages = 1 if method == "fastv" else 3
    for batch in (1, 3):
        counts = _hook_reads(monkeypatch, vlm, images[:batch], prompts[:batch])
        assert counts["stages"] == stages and counts["hooks"] == counts["stages"], (batch, counts)
        # the LLM's own hook, once per forward: at most one read there (transformers 5.25's hybrid cache gives its
        # length as a tensor; read once, where each layer's hook read it again)
        assert counts["lm"] <= 2, (batch, counts)  # two forwards: the prefill and one decoding step
