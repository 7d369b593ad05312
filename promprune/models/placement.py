"""One model over several GPUs: the device map and memory limits for a process that holds more than one.

Gemma 4 31B in bfloat16 is ~62 GB of weights, more than an A40's 48 GB (the paper's GPU): the pipeline then gives each
actor two GPUs (``resources.gpus_per_worker: 2``), and the actor loads one model across both. Ray hands an actor its
GPUs by setting ``CUDA_VISIBLE_DEVICES``, so torch numbers them 0 .. n-1 whatever their ids on the node; the map is
over those local indices. Layers are never split (the model's ``_no_split_modules``); accelerate's "balanced" map
spreads them so each GPU holds about the same share, within ``max_memory`` per GPU (a fraction of its memory, the rest
left to activations and the KV cache).

Loading a checkpoint: ``from_pretrained(device_map="balanced", max_memory=...)`` (transformers calls accelerate).
Models built in code (``tiny:`` / ``shape:`` factories, weights published by a sweep): :func:`spread` dispatches the
built module the same way.
"""
from __future__ import annotations

MULTI_GPU_MAPS = ("balanced", "balanced_low_0", "sequential")  # accelerate's device-map strategies
HEADROOM = 0.85  # the share of each GPU's memory the weights may take; the rest: activations, KV cache, CUDA context


def gpu_split(gpu_bytes: list[int], headroom: float = HEADROOM) -> dict | None:
    """``{"device_map": "balanced", "max_memory": {0: bytes, 1: bytes, ...}}`` spreading one model over the visible
    GPUs of ``gpu_bytes`` (each one's total memory, local index order); None for fewer than two GPUs (one device)."""
    if len(gpu_bytes) < 2:
        return None
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
    return {"device_map": "balanced", "max_memory": {i: int(b * headroom) for i, b in enumerate(gpu_bytes)}}


def is_multi_gpu(device_map) -> bool:
    """Whether ``device_map`` spreads a model over devices (a strategy name or an explicit mapping)."""
    return isinstance(device_map, dict) or device_map in MULTI_GPU_MAPS


def device_map_for(model, strategy: str, max_memory: dict) -> dict:
    """``{module name: device}`` placing ``model`` (a built module; the meta device will do) by ``strategy``
    (:data:`MULTI_GPU_MAPS`) within ``max_memory``, each of its ``_no_split_modules`` (a decoder layer, a vision
    encoder layer) whole on one device."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if strategy not in MULTI_GPU_MAPS:
        raise ValueError(f"device_map {strategy!r}: use one of {list(MULTI_GPU_MAPS)} or an explicit mapping")
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if strategy != "sequential":
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         low_zero=strategy == "balanced_low_0")
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)


def spread(model, device_map, max_memory: dict | None = None):
    """Dispatch a built ``model`` over GPUs: ``device_map`` a strategy (:func:`device_map_for`) or an explicit
    ``{module name: device}``. Returns the dispatched model (its ``hf_device_map`` says where each module went)."""
    from accelerate import dispatch_model

    if not isinstance(device_map, dict):
        device_map = device_map_for(model, device_map, max_memory)
    model = dispatch_model(model, device_map=device_map)
    model.hf_device_map = device_map
    return model
