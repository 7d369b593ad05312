"""Efficiency metrics: analytic prefill FLOPs and KV-cache size, measured latency and peak memory.

The analytic formulas follow the convention that reproduces the paper's Table 6 (LLaVA-NeXT-7B, Vicuna-7B text
config: hidden 4096, 32 layers, intermediate 11008, 32 heads):

- ``prefill_flops``: per decoder layer, multiply-accumulates of the q/k/v/o projections, the two attention
  products over the full (non-causal) n x n score matrix, and the three SwiGLU matrices; FLOPs = 2 x MACs.
  With the Vicuna-7B config and 62 text tokens this gives 42.6 TFLOPs with 2880 visual tokens and 5.02 T with 320
  (the paper says "about 60" text tokens; 62 is the count that hits both published numbers after rounding).
  Embedding lookup, norms, softmax, rotary embeddings and the LM head are not counted.
- ``decode_flops`` / ``lm_head_flops`` / ``vision_flops``: the rest of a sample's compute, for whole-sweep costs
  (``benchmarks/sweep_cost.py``): the generated tokens' forwards, the logits, the vision tower and projector.
- ``kv_cache_bytes``: K and V of every layer for ``n_tokens`` tokens. Table 6's KV column counts the visual tokens
  only and prints MiB (2**20 bytes) as "MB": 2880 tokens x 2 x 32 layers x 4096 x 2 bytes = 1440.0 MiB, 320 -> 160.0.

Hybrid LLMs (Qwen3.5: ``layer_types`` with Gated DeltaNet ``linear_attention`` layers between full-attention ones) are
counted as they are. A full-attention layer is the formula above, its query projection twice as wide where it also
gives an output gate (Qwen3.5's gated attention). A linear-attention layer costs the same per token whatever the
context: its projections (q, k, v, the output gate z, the decay a and the write strength b; the output projection),
the depthwise causal convolution, and the delta rule as a recurrence (per token and value head three dk x dv
matrix-vector products: reading the state with the key, writing the corrected value, reading it with the query; a
chunked kernel's intra-chunk products are an implementation choice, not counted); no n x n term. Only the
full-attention layers hold a KV cache that grows with the tokens (``kv_cache_bytes`` counts those); each linear layer
holds a state of constant size per sequence (``recurrent_state_bytes``: its convolution's last inputs in the model's
dtype and the delta rule's state in float32, as transformers keeps them), which a token adds nothing to.

Measured numbers: ``Stopwatch`` times a region with CUDA events on a GPU (kernels are asynchronous, so a host clock
would time the launch, not the work) and ``time.perf_counter`` on CPU; ``peak_memory_mb`` reads the CUDA allocator's
high-water mark on a GPU and the process's peak resident set size on CPU.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from promprune.dtypes import parse_dtype

MIB = 2**20  # Table 6 prints MiB and labels them "MB"


@dataclass(frozen=True)
class LinearShape:
    """A Gated DeltaNet layer's dimensions (``linear_*`` fields of a Qwen3.5 text config)."""

    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_kernel: int

    @property
    def conv_width(self) -> int:
        """Channels of the depthwise convolution: queries, keys and values."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class TextShape:
    """The decoder dimensions the formulas need, read from a transformers text config. ``layer_types`` (empty: every
    layer full attention), ``gated`` (the query projection also gives an output gate) and ``linear`` (None: no
    linear-attention layer) describe a hybrid LLM."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] = ()
    gated: bool = False
    linear: LinearShape | None = None

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache (every layer but the linear-attention ones)."""
        return sum(not self.is_linear(i) for i in range(self.num_layers))


LINEAR_ATTENTION = "linear_attention"  # a layer type whose token mixer keeps a recurrent state, not a KV cache
# text configs whose attention gates its output with a second half of q_proj (transformers' Qwen3.5 / Qwen3-Next
# attention always does; their hub configs say attn_output_gate: true)
GATED_ATTENTION_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def _field(config: Any, name: str) -> Any:
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def text_shape(text_config: Any) -> TextShape:
    """Read decoder dimensions from a text config (a transformers config object or a dict).

    A full VLM config (one with a ``text_config``) is accepted too and its text part is used.
    ``num_key_value_heads`` defaults to ``num_attention_heads`` (no GQA) and ``head_dim`` to hidden / heads,
    as transformers' Llama-family configs do.
    """
    inner = _field(text_config, "text_config")
    if inner is not None:
        text_config = inner
    required = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    missing = [name for name in required if _field(text_config, name) is None]
    if missing:
        raise ValueError(f"text_config lacks field(s) {missing}; need {list(required)}")
    hidden = int(_field(text_config, "hidden_size"))
    heads = int(_field(text_config, "num_attention_heads"))
    kv_heads = _field(text_config, "num_key_value_heads")
    head_dim = _field(text_config, "head_dim")
    shape = TextShape(
        hidden_size=hidden,
        num_layers=int(_field(text_config, "num_hidden_layers")),
        intermediate_size=int(_field(text_config, "intermediate_size")),
        num_heads=heads,
        num_kv_heads=int(kv_heads) if kv_heads is not None else heads,
        head_dim=int(head_dim) if head_dim is not None else hidden // heads,
    )
    for name, value in vars(shape).items():
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"text_config field {name} must be positive, got {value}")
    return _hybrid(text_config, shape)


def _hybrid(text_config: Any, shape: TextShape) -> TextShape:
    """``shape`` with the text config's layer types, attention gate and linear-attention dimensions."""
    from dataclasses import replace

    types = tuple(_field(text_config, "layer_types") or ())
    if types and len(types) != shape.num_layers:
        raise ValueError(f"text_config has {len(types)} layer_types for {shape.num_layers} layers")
    gated = bool(_field(text_config, "attn_output_gate")) or _field(text_config, "model_type") in GATED_ATTENTION_TYPES
    linear = None
    if LINEAR_ATTENTION in types:
        names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
        missing = [n for n in names if _field(text_config, n) is None]
        if missing:
            raise ValueError(f"text_config has linear_attention layers but lacks {missing}")
        linear = LinearShape(*(int(_field(text_config, n)) for n in names))
    return replace(shape, layer_types=types, gated=gated, linear=linear)


def _check_tokens(n_tokens: int) -> int:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
    return n_tokens


def prefill_flops(text_config: Any, n_tokens: int, past_tokens: int = 0) -> float:
    """FLOPs of one prefill pass over ``n_tokens`` tokens (visual + text), Table 6's convention.

    Per layer, with n tokens, hidden d, query width d_q = heads * head_dim, key/value width d_kv, MLP width m:
        MACs = n*d*(d_q + 2*d_kv)   q, k, v projections
             + n*d_q*d              output projection
             + 2*n*n*d_q            Q K^T and (softmax) V, full n x n
             + 3*n*d*m              SwiGLU gate, up, down
    FLOPs = 2 * MACs * layers. For a Llama/Vicuna config (d_q = d_kv = d) this is 2L(4nd^2 + 2n^2 d + 3ndm).
    ``past_tokens``: tokens already in the KV cache (a cached prompt prefix, or the tokens before a decode step):
    the n new tokens attend to past + n keys, so the attention term is 2*n*(past + n)*d_q (0: Table 6's prefill).
    """
    layers = text_shape(text_config).num_layers
    return float(sum(layer_prefill_flops(text_config, n_tokens, past_tokens, layer=i) for i in range(layers)))


def layer_prefill_flops(text_config: Any, n_tokens: int, past_tokens: int = 0, layer: int | None = None) -> float:
    """:func:`prefill_flops` of one decoder layer (in-LLM pruning runs its layers on different token counts):
    decoder layer ``layer`` of a hybrid LLM (a ValueError without it; any layer of the others)."""
    n, past = _check_tokens(n_tokens), _check_tokens(past_tokens)
    s = text_shape(text_config)
    if s.linear is not None and layer is None:
        raise ValueError("a hybrid LLM's layers cost differently (linear vs full attention): pass layer=")
    if layer is not None and not 0 <= layer < s.num_layers:
        raise ValueError(f"layer must be in [0, {s.num_layers - 1}], got {layer}")
    d, d_q, d_kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    mlp = 3 * n * d * s.intermediate_size  # SwiGLU MLP
    if layer is not None and s.is_linear(layer):
        return float(2 * (linear_mixer_macs(s, n) + mlp))
    macs = (
        n * d * ((2 if s.gated else 1) * d_q + 2 * d_kv)  # q (and its output gate), k, v projections
        + n * d_q * d  # output projection
        + 2 * n * (past + n) * d_q  # attention scores and weighted values
        + mlp
    )
    return float(2 * macs)


def linear_mixer_macs(shape: TextShape, n_tokens: int) -> int:
    """MACs of a Gated DeltaNet token mixer over ``n_tokens`` tokens (any context: no term in the past tokens)."""
    lin, d = shape.linear, shape.hidden_size
    v = lin.value_heads * lin.value_dim
    return n_tokens * (d * (lin.conv_width + v + 2 * lin.value_heads)  # in_proj_qkv, in_proj_z, in_proj_a / b
                       + lin.conv_width * lin.conv_kernel  # depthwise causal convolution
                       + 3 * lin.value_heads * lin.key_dim * lin.value_dim  # state read (k), write, read (q)
                       + v * d)  # out_proj


def decode_flops(text_config: Any, context_tokens: int, new_tokens: int) -> float:
    """FLOPs of the decoder layers generating ``new_tokens`` after a prefill of ``context_tokens``: the prefill's
    forward yields the first new token, and each further one is one forward of 1 token over the cache (step t attends
    to context + t keys), :func:`prefill_flops`' convention. The LM head is :func:`lm_head_flops`."""
    context, new = _check_tokens(context_tokens), _check_tokens(new_tokens)
    return float(sum(prefill_flops(text_config, 1, context + t) for t in range(max(new - 1, 0))))


def lm_head_flops(text_config: Any, rows: int) -> float:
    """FLOPs of ``rows`` rows of logits (2 * d * vocab each; ``generate`` computes one row per forward)."""
    rows = _check_tokens(rows)
    inner = _field(text_config, "text_config")
    config = inner if inner is not None else text_config
    vocab = _field(config, "vocab_size")
    if vocab is None:
        raise ValueError("text_config lacks vocab_size")
    return float(2 * rows * text_shape(config).hidden_size * int(vocab))


# ---------------------------------------------------------------------------------------------------------------
# the vision tower

# vision towers whose FLOPs are modelled: ViTs with a CLS token (CLIP) or without (SigLIP)
_VIT_CLS = {"clip_vision_model": True, "siglip_vision_model": False}


def vision_flops(config: Any, views: int = 1) -> float:
    """FLOPs of encoding one image of ``views`` views (LLaVA-NeXT / OneVision: base view + crops) with a LLaVA-family
    model's vision tower and projector, the prefill convention (2 x MACs, norms / softmax / activations not counted):

        patch embedding   P * (3 * p^2) * dv               P patches of p x p pixels
        each layer        n*dv*3dv + n*dv*dv + 2*n*n*dv + 2*n*dv*mv     n = P (+1 with a CLS token), MLP width mv
        projector         P * (dv_in * d + d * d)          LLaVA's two-layer MLP (dv_in: dv x feature layers)

    over every layer of the tower (transformers runs them all, whichever layer the projector reads). ``config``: the
    VLM's config (``vision_config``, ``text_config``). Other towers (Qwen's windowed ViT, InternViT) are a ValueError.
    """
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise ValueError(f"views must be a positive int, got {views!r}")
    vision, text = _field(config, "vision_config"), _field(config, "text_config")
    kind = _field(vision, "model_type") if vision is not None else None
    if kind not in _VIT_CLS:
        raise ValueError(f"vision FLOPs are modelled for the LLaVA family's CLIP / SigLIP towers "
                         f"({', '.join(_VIT_CLS)}); this config's vision tower is {kind!r}")
    dv, mv = int(_field(vision, "hidden_size")), int(_field(vision, "intermediate_size"))
    layers, p = int(_field(vision, "num_hidden_layers")), int(_field(vision, "patch_size"))
    patches = (int(_field(vision, "image_size")) // p) ** 2
    n = patches + (1 if _VIT_CLS[kind] else 0)
    feature_layer = _field(config, "vision_feature_layer")
    dv_in = dv * (len(feature_layer) if isinstance(feature_layer, (list, tuple)) else 1)
    d = text_shape(text).hidden_size
    macs = (patches * 3 * p * p * dv  # patch embedding
            + layers * (n * dv * 3 * dv + n * dv * dv + 2 * n * n * dv + 2 * n * dv * mv)
            + patches * (dv_in * d + d * d))  # projector
    return float(2 * macs * views)


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a torch dtype or one of the names fp16/float16/bf16/bfloat16/fp32/float32."""
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


def kv_cache_bytes(text_config: Any, n_tokens: int, dtype: torch.dtype | str = torch.float16) -> int:
    """Bytes of the KV cache for ``n_tokens`` tokens: K and V, every layer with a KV cache (a hybrid LLM's
    full-attention layers; its linear-attention layers keep a state of constant size instead,
    :func:`recurrent_state_bytes`), num_kv_heads * head_dim each.

    Table 6 passes the visual-token count only (1440.0 MiB for 2880 tokens of Vicuna-7B in fp16).
    """
    n = _check_tokens(n_tokens)
    s = text_shape(text_config)
    return 2 * s.attention_layers * n * s.num_kv_heads * s.head_dim * dtype_bytes(dtype)


def recurrent_state_bytes(text_config: Any, dtype: torch.dtype | str = torch.float16,
                          state_dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes a sequence's linear-attention layers hold, whatever its length (0 without such layers): per layer the
    convolution's last ``conv_kernel`` inputs (``conv_width`` channels, in ``dtype``) and the delta rule's state
    (value heads x key dim x value dim, in ``state_dtype``: float32 in transformers' kernels)."""
    s = text_shape(text_config)
    if s.linear is None:
        return 0
    lin = s.linear
    per_layer = (lin.conv_width * lin.conv_kernel * dtype_bytes(dtype)
                 + lin.value_heads * lin.key_dim * lin.value_dim * dtype_bytes(state_dtype))
    return (s.num_layers - s.attention_layers) * per_layer


# ---------------------------------------------------------------------------------------------------------------
# measured latency and memory


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class Stopwatch:
    """Time a region in milliseconds: CUDA events on a CUDA device, ``time.perf_counter`` otherwise.

    >>> with Stopwatch("cpu") as sw:
    ...     work()
    >>> sw.ms
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self.ms: float = float("nan")

    def __enter__(self) -> "Stopwatch":
        if _is_cuda(self.device):
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if _is_cuda(self.device):
            self._end.record(torch.cuda.current_stream(self.device))
            self._end.synchronize()
            self.ms = float(self._start.elapsed_time(self._end))
        else:
            self.ms = (time.perf_counter() - self._t0) * 1e3


def measure_ms(fn, *, device: torch.device | str | None = None, warmup: int = 1, repeats: int = 5) -> list[float]:
    """Run ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed; returns the timings in ms.

    Warm-up runs absorb one-off costs (CUDA context and kernel selection, allocator growth) that are not part of
    steady-state latency; report the median of the returned list.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Stopwatch(device) as sw:
            fn()
        times.append(sw.ms)
    return times


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start a new peak-memory window on a CUDA device (no-op on CPU: the process peak RSS cannot be reset)."""
    if _is_cuda(device) and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device | str | None = None) -> float:
    """Peak memory in MiB: CUDA allocator high-water mark since the last reset, or the process peak RSS on CPU."""
    if _is_cuda(device) and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / MIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS
    return peak / MIB if sys.platform == "darwin" else peak / 1024
