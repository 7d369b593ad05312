"""What a model's LLM attention implementation, dtype and device can run, checked before any model work.

- float64 under ``eager`` attention: transformers' eager attention takes its softmax in float32, where float64's mask
  value (``torch.finfo(torch.float64).min``) is ``-inf``; a left-padded row's padding query masks every key, its
  softmax is NaN, and the NaN spreads through the row (its answer empty or wrong, not an error).
  :func:`precision_problem`.
- in-LLM methods (``llm_hooks``) build their own masks in the ``sdpa`` or ``eager`` format only:
  :func:`in_llm_attention_problem`.
- a device string torch cannot place a model on here (``cuda`` without a GPU, ``cuda:3`` of two, ``mps``, a typo):
  :func:`device_problem`.

Importing it does not import torch; the functions that need it import it when called.
"""
from __future__ import annotations

from promprune.dtypes import AUTO, dtype_name
from promprune.suggest import did_you_mean

IN_LLM_ATTENTION = ("sdpa", "eager")  # the attention implementations whose masks the in-LLM hooks write
# device_map strings that are not one device (transformers' / accelerate's strategies; promprune.models.placement)
DEVICE_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def precision_problem(dtype, attn_implementation: str | None) -> str | None:
    """Why ``dtype`` (a name, a torch dtype, None / "auto": the checkpoint's own, not refused) cannot run under the
    LLM attention ``attn_implementation``, or None: float64 with ``eager``."""
    if attn_implementation != "eager" or dtype in (None, AUTO):
        return None
    try:
        name = dtype_name(dtype)
    except ValueError:
        return None  # the dtype's own check says why
    if name != "float64":
        return None
    return ("dtype float64 with attn_implementation 'eager' gives wrong answers, silently, for the padded rows of a "
            "batch: transformers' eager attention takes its softmax in float32, where float64's mask value "
            "(finfo(float64).min) becomes -inf, so a left-padding row that masks every key is NaN and the NaN spreads "
            "through that row's answer (an empty answer, not an error). Use attn_implementation 'sdpa' (the default) "
            "with float64, or another dtype with 'eager'")


def in_llm_attention_problem(method: str | None, attn_implementation: str | None) -> str | None:
    """Why in-LLM ``method`` cannot prune under the LLM attention ``attn_implementation`` (None: transformers'
    default, sdpa), or None (a pre-LLM method, the unpruned model: any attention)."""
    from .options import is_in_llm

    if not is_in_llm(method) or (attn_implementation or "sdpa") in IN_LLM_ATTENTION:
        return None
    return (f"in-LLM method {method!r} prunes inside the LLM by writing its attention masks, which it can do for "
            f"attn_implementation 'sdpa' or 'eager' only; this model's LLM attention is {attn_implementation!r}, so "
            f"every sample would fail. Use attn_implementation 'sdpa' (the default) for {method}")


def llm_attention(model) -> str | None:
    """The attention implementation of ``model``'s LLM (its text config's; the config's own where it has none)."""
    config = model.config
    return getattr(getattr(config, "text_config", None) or config, "_attn_implementation", None)


def model_attention_problems(model, method: str | None) -> list[str]:
    """:func:`precision_problem` and :func:`in_llm_attention_problem` of a built ``model`` (its dtype and its LLM's
    attention implementation)."""
    attn = llm_attention(model)
    found = [precision_problem(model.dtype, attn), in_llm_attention_problem(method, attn)]
    return [p for p in found if p is not None]


def device_problem(device_map) -> str | None:
    """Why the device string ``device_map`` cannot hold a model on this machine, or None (None, a mapping, a
    strategy of :data:`DEVICE_STRATEGIES`, ``cpu``, a CUDA device this machine has, by name or by index as
    transformers takes it (``3``: ``cuda:3``), ``mps`` where torch has it)."""
    import torch

    if isinstance(device_map, bool) or (isinstance(device_map, int) and device_map < 0):
        return (f"device_map {device_map!r} is not a device; use 'cpu', 'cuda' (or 'cuda:N', or the GPU's index N), "
                "'auto' (CUDA when there is one), or a strategy spreading the model over GPUs ('balanced', "
                "'balanced_low_0', 'sequential')")
    if isinstance(device_map, int):  # transformers' GPU index: as 'cuda:N' (it was torch's "Found no NVIDIA driver")
        problem = device_problem(f"cuda:{device_map}")
        return problem and problem.replace(f"{f'cuda:{device_map}'!r}", f"{device_map} (GPU cuda:{device_map})", 1)
    if device_map is None or not isinstance(device_map, (str, torch.device)) or device_map in DEVICE_STRATEGIES:
        return None
    text = str(device_map)
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        return (f"device_map {text!r} is not a device{did_you_mean(text, ('cpu', 'cuda', *DEVICE_STRATEGIES))}; "
                "use 'cpu', 'cuda' (or 'cuda:N'), 'auto' (CUDA when there is one), or a strategy spreading the model "
                "over GPUs ('balanced', 'balanced_low_0', 'sequential')")
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (device.index is None or device.index < count):
            return None
        have = "no CUDA GPU torch can use" if not count else f"{count} CUDA GPU(s) (cuda:0 .. cuda:{count - 1})"
        return (f"device_map {text!r}: this machine has {have}; use 'cpu', 'auto' (CUDA when there is one)"
                + ("" if not count else f" or a device up to cuda:{count - 1}"))
    if device.type == "mps":
        if torch.backends.mps.is_available():
            return None
        return f"device_map {text!r}: torch has no MPS device on this machine; use 'cpu' or 'auto'"
    return (f"device_map {text!r}: PromPrune places models on 'cpu' or CUDA ('cuda', 'cuda:N'); use one of those or "
            "'auto'")
