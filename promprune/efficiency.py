"""Efficiency metrics: analytic prefill FLOPs and KV-cache size, measured latency and peak memory.

The analytic formulas follow the convention that reproduces the paper's Table 6 (LLaVA-NeXT-7B, Vicuna-7B text
config: hidden 4096, 32 layers, intermediate 11008, 32 heads):

- ``prefill_flops``: per decoder layer, multiply-accumulates of the q/k/v/o projections, the two attention
  products over the full (non-causal) n x n score matrix, and the three SwiGLU matrices; FLOPs = 2 x MACs.
  With the Vicuna-7B config and 62 text tokens this gives 42.6 TFLOPs with 2880 visual tokens and 5.02 T with 320.
  The paper states no text-token count; 62 is derived from its two published numbers: under this convention 57 to
  62 text tokens round to 42.6 T at 2880 visual tokens, and only 62 rounds to 5.02 T at 320 (61: 5.01, 63: 5.04).
  Embedding lookup, norms, softmax, rotary embeddings and the LM head are not counted.
- ``decode_flops`` / ``lm_head_flops`` / ``vision_flops``: the rest of a sample's compute, for whole-sweep costs
  (``benchmarks/sweep_cost.py``): the generated tokens' forwards, the logits, the vision tower and projector.
- ``kv_cache_bytes``: K and V of every layer for ``n_tokens`` tokens. Table 6's KV column counts the visual tokens
  only and prints MiB (2**20 bytes) as "MB": 2880 tokens x 2 x 32 layers x 4096 x 2 bytes = 1440.0 MiB, 320 -> 160.0.
- LLMs whose layers differ (``layer_types`` with sliding-window layers: Gemma 4) are counted layer by layer
  (:func:`layer_shapes`): each layer's own query / key widths (Gemma 4's full layers: wider heads, fewer KV heads,
  keys used as values, so no value projection), attention over at most ``sliding_window`` keys per query in a
  sliding layer, and a sliding layer's KV cache capped as transformers' ``DynamicSlidingWindowLayer`` keeps it
  (``sliding_window - 1`` tokens; not under an in-LLM method, whose hooks keep every kept column: ``windowed=False``);
  layers that borrow an earlier layer's keys and values (``num_kv_shared_layers``) project none and cache none, and
  their MLP may be double width; per-layer token embeddings add their projections. ``generation_cost``: one
  generation's FLOPs and visual KV bytes as the pipeline logs them (an in-LLM method's layers each on their own).

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
high-water mark since ``reset_peak_memory`` on a GPU, and on CPU the process's peak resident set since it (Linux's
VmHWM, which writing 5 to /proc/self/clear_refs resets), or None where that cannot be reset (not the process's
lifetime high-water mark: model load and all earlier work, no window's peak).
"""

from __future__ import annotations

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
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a per-layer field of a heterogeneous config (Gemma 4): read it per layer
        return None


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


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: query / key widths, a value projection or not (keys as values), a query projection that also
    gives an output gate (``gate``), MLP width, the sliding window (None: full attention), whether it caches keys and
    values, further MACs per token (per-layer token embeddings), and ``linear``: a linear-attention token mixer instead
    of attention (no KV cache; a recurrent state of constant size)."""

    d_q: int
    d_kv: int
    values: bool
    mlp: int
    window: int | None
    caches: bool
    extra: int = 0
    gate: bool = False
    linear: LinearShape | None = None


def layer_shapes(text_config: Any) -> list[LayerShape]:
    """Every decoder layer's :class:`LayerShape`, from a transformers config (Gemma 4's ``per_layer_config``) or a dict
    of its fields (``global_head_dim``, ``num_global_key_value_heads``, as a ``config.json`` holds them). An LLM of
    identical layers gives :func:`text_shape`'s widths at every layer; a hybrid one (Qwen3.5) its linear-attention
    layers; one with sliding-window layers (Gemma 4) each layer's own widths, window, KV sharing and per-layer
    embeddings."""
    inner = _field(text_config, "text_config")
    config = inner if inner is not None else text_config
    s = text_shape(config)  # Gemma 4: its head width / KV heads are the sliding layers' (a dict) or unread (an object)
    types = s.layer_types or ("full_attention",) * s.num_layers
    k_eq_v = bool(_field(config, "attention_k_eq_v"))
    shared = int(_field(config, "num_kv_shared_layers") or 0)
    per_layer = int(_field(config, "hidden_size_per_layer_input") or 0)
    double = bool(_field(config, "use_double_wide_mlp"))
    sliding = "sliding_attention" in types  # Gemma 4's per-layer head widths
    out = []
    for i, kind in enumerate(types):
        full = kind == "full_attention"
        head_dim, kv_heads = _layer_heads(config, i, full, s, k_eq_v) if sliding else (s.head_dim, s.num_kv_heads)
        borrows = i >= len(types) - shared  # keys and values of an earlier layer: no projection, no cache
        linear = s.linear if kind == LINEAR_ATTENTION else None
        out.append(LayerShape(d_q=s.num_heads * head_dim, d_kv=0 if borrows else kv_heads * head_dim,
                              values=not (full and k_eq_v), mlp=s.intermediate_size * (2 if double and borrows else 1),
                              window=int(_field(config, "sliding_window")) if kind == "sliding_attention" else None,
                              caches=not borrows and linear is None, gate=s.gated, linear=linear,
                              extra=3 * s.hidden_size * per_layer))  # gate d->p, projection p->d, its share of d->L*p
    return out


def _layer_heads(config: Any, i: int, full: bool, s: TextShape, k_eq_v: bool) -> tuple[int, int]:
    """``(head_dim, kv_heads)`` of layer ``i``: a config object's ``per_layer_config``, else a dict's global fields (a
    full layer's ``global_head_dim``, default 512, and ``num_global_key_value_heads`` when keys are values)."""
    per_layer = _field(config, "per_layer_config")
    if per_layer is not None and not isinstance(config, dict):
        layer = per_layer[i]
        return int(layer.head_dim), int(layer.num_key_value_heads)
    if not full:
        return s.head_dim, s.num_kv_heads
    global_kv = _field(config, "num_global_key_value_heads")
    kv = int(global_kv) if k_eq_v and global_kv is not None else s.num_kv_heads
    return int(_field(config, "global_head_dim") or 512), kv


def _layer_macs(d: int, layer: LayerShape, n: int, past: int) -> int:
    """MACs of one :class:`LayerShape` on ``n`` new tokens after ``past`` cached ones, Table 6's convention."""
    mlp = 3 * n * d * layer.mlp  # gated MLP
    if layer.linear is not None:
        return linear_mixer_macs(layer.linear, d, n) + mlp + n * layer.extra
    keys = past + n if layer.window is None else min(past + n, layer.window)
    return (n * d * ((2 if layer.gate else 1) * layer.d_q + layer.d_kv * (2 if layer.values else 1))  # q (+gate), k, v
            + n * layer.d_q * d  # output projection
            + 2 * n * keys * layer.d_q  # attention scores and weighted values
            + mlp
            + n * layer.extra)


def _check_tokens(n_tokens: int) -> int:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
    return n_tokens


def _tokens_per_layer(n_tokens, layers: list) -> list[int]:
    """``n_tokens`` for every layer (an int), or one count per layer (a sequence: in-LLM pruning's layers)."""
    if isinstance(n_tokens, (list, tuple)):
        if len(n_tokens) != len(layers):
            raise ValueError(f"one token count per layer: got {len(n_tokens)} for {len(layers)} layers")
        return [_check_tokens(n) for n in n_tokens]
    return [_check_tokens(n_tokens)] * len(layers)


def prefill_flops(text_config: Any, n_tokens: int | list[int], past_tokens: int = 0) -> float:
    """FLOPs of one prefill pass over ``n_tokens`` tokens (visual + text), Table 6's convention.

    Per layer, with n tokens, hidden d, query width d_q = heads * head_dim, key/value width d_kv, MLP width m:
        MACs = n*d*(d_q + 2*d_kv)   q, k, v projections
             + n*d_q*d              output projection
             + 2*n*n*d_q            Q K^T and (softmax) V, full n x n
             + 3*n*d*m              SwiGLU gate, up, down
    FLOPs = 2 * MACs * layers. For a Llama/Vicuna config (d_q = d_kv = d) this is 2L(4nd^2 + 2n^2 d + 3ndm).
    ``past_tokens``: tokens already in the KV cache (a cached prompt prefix, or the tokens before a decode step):
    the n new tokens attend to past + n keys, so the attention term is 2*n*(past + n)*d_q (0: Table 6's prefill).
    The layers are summed one by one (:func:`layer_shapes`): a sliding layer's queries attend to at most
    ``sliding_window`` keys each, a linear-attention layer costs :func:`linear_mixer_macs` (no n x n term).
    ``n_tokens`` one count per layer: each layer on its own (in-LLM pruning runs its first layers on every token).
    """
    past = _check_tokens(past_tokens)
    layers = layer_shapes(text_config)
    d = text_shape(text_config).hidden_size
    return float(sum(2 * _layer_macs(d, layer, n, past) for layer, n in zip(layers, _tokens_per_layer(n_tokens,
                                                                                                        layers))))


def layer_prefill_flops(text_config: Any, n_tokens: int, past_tokens: int = 0, layer: int | None = None) -> float:
    """:func:`prefill_flops` of one decoder layer (in-LLM pruning runs its layers on different token counts): decoder
    layer ``layer``; an LLM whose layers differ (linear or sliding-window layers) needs it, for the others any layer's
    is every layer's."""
    n, past = _check_tokens(n_tokens), _check_tokens(past_tokens)
    layers = layer_shapes(text_config)
    if layer is None:
        if any(other != layers[0] for other in layers):
            raise ValueError("this LLM's layers differ (linear, sliding-window or full attention): pass layer=<index>")
        layer = 0
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers) - 1}], got {layer}")
    return float(2 * _layer_macs(text_shape(text_config).hidden_size, layers[layer], n, past))


def linear_mixer_macs(lin: LinearShape, d: int, n_tokens: int) -> int:
    """MACs of a Gated DeltaNet token mixer of hidden width ``d`` over ``n_tokens`` tokens (any context: no term in the
    past tokens)."""
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


def kv_cache_bytes(text_config: Any, n_tokens: int | list[int], dtype: torch.dtype | str = torch.float16,
                   windowed: bool = True) -> int:
    """Bytes of the KV cache for ``n_tokens`` tokens: K and V of every layer with a KV cache, num_kv_heads * head_dim
    each (:func:`layer_shapes`: each layer its own width).

    Table 6 passes the visual-token count only (1440.0 MiB for 2880 tokens of Vicuna-7B in fp16). A hybrid LLM's
    linear-attention layers keep a state of constant size instead (:func:`recurrent_state_bytes`); a sliding layer
    holds at most ``sliding_window - 1`` tokens (what transformers' ``DynamicSlidingWindowLayer`` keeps between
    forwards), or with ``windowed=False`` every token it was given (an in-LLM method's run: its hooks give the sliding
    layers plain ``DynamicLayer`` caches, ``llm_hooks.InLLMPruner._full_cache``); a layer borrowing another's keys and
    values none. ``n_tokens`` one count per layer: each layer's own (in-LLM pruning caches every token in the layers
    before its cut).
    """
    layers = layer_shapes(text_config)
    kept = [n if lay.window is None or not windowed else min(n, lay.window - 1)
            for lay, n in zip(layers, _tokens_per_layer(n_tokens, layers))]
    return sum(2 * k * lay.d_kv * dtype_bytes(dtype) for k, lay in zip(kept, layers) if lay.caches)


def generation_cost(text_config: Any, visual_tokens: int, text_tokens: int,
                    layer_visual_tokens: list[int] | None = None,
                    dtype: torch.dtype | str = torch.float16) -> tuple[float, int]:
    """``(prefill FLOPs, visual KV-cache bytes)`` of one generation under Table 6's convention: the FLOPs of the
    visual tokens the LLM received plus the prompt's ``text_tokens``, the KV cache of the visual tokens only.

    ``layer_visual_tokens`` (an in-LLM method's generation: the visual tokens each decoder layer ran on and cached,
    every one before its cut) counts each layer on its own, and its cache as that run holds it (``windowed=False``: the
    in-LLM hooks' sliding layers keep every column); without it every layer counts ``visual_tokens``. What the
    pipeline logs per sample (``pipelines.run.workers.add_efficiency``) and ``benchmarks/efficiency.py`` prints.
    """
    in_llm = bool(layer_visual_tokens)
    visual = [int(v) for v in layer_visual_tokens] if in_llm else int(visual_tokens)
    tokens = [v + int(text_tokens) for v in visual] if in_llm else visual + int(text_tokens)
    return (prefill_flops(text_config, tokens),
            kv_cache_bytes(text_config, visual, dtype, windowed=not in_llm))


def recurrent_state_bytes(text_config: Any, dtype: torch.dtype | str = torch.float16,
                          state_dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes a sequence's linear-attention layers hold, whatever its length (0 without such layers): per layer the
    convolution's last ``conv_kernel`` inputs (``conv_width`` channels, in ``dtype``) and the delta rule's state
    (value heads x key dim x value dim, in ``state_dtype``: float32 in transformers' kernels)."""
    return sum(lin.conv_width * lin.conv_kernel * dtype_bytes(dtype)
               + lin.value_heads * lin.key_dim * lin.value_dim * dtype_bytes(state_dtype)
               for lin in (layer.linear for layer in layer_shapes(text_config)) if lin is not None)


# ---------------------------------------------------------------------------------------------------------------
# measured latency and memory


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class Stopwatch:
    """Time a region in milliseconds: CUDA events on a CUDA device, ``time.perf_counter`` otherwise.

    >>> with Stopwatch("cpu") as sw:
    ...     work()
    >>> sw.ms

    On CUDA the region's end is an event recorded on the stream, and the host waits for it only when ``ms`` is first
    read: a model path that times its stages and reads the times after ``generate`` (which ends in a wait for the
    device anyway) adds no wait of its own. ``ms`` is NaN before the region has ended.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self._ms: float | None = float("nan")
        self._end = None

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
            self._ms = None  # read from the events when asked
        else:
            self._ms = (time.perf_counter() - self._t0) * 1e3

    @property
    def ms(self) -> float:
        """The region's milliseconds (on CUDA, the first read waits for the region's end on the device)."""
        if self._ms is None:
            self._end.synchronize()
            self._ms = float(self._start.elapsed_time(self._end))
        return self._ms


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


_RSS_WINDOW = {"open": False}  # whether this process's peak resident set was reset (a CPU window is open)
CLEAR_REFS, STATUS = "/proc/self/clear_refs", "/proc/self/status"


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start a new peak-memory window: the CUDA allocator's on a GPU; on CPU this process's peak resident set
    (Linux: 5 written to /proc/self/clear_refs resets VmHWM to the current resident set; elsewhere, or where it
    cannot be written, no window opens and ``peak_memory_mb`` says None)."""
    if _is_cuda(device) and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        _RSS_WINDOW["open"] = True
    except OSError:
        _RSS_WINDOW["open"] = False


def peak_memory_mb(device: torch.device | str | None = None) -> float | None:
    """Peak memory in MiB since the last ``reset_peak_memory``: the CUDA allocator's high-water mark, or on CPU the
    process's peak resident set (VmHWM: the model's resident weights and everything else the process holds). None
    on CPU where no window is open: the process's lifetime high-water mark (``ru_maxrss``: its model load and every
    earlier, hungrier batch) is nobody's peak."""
    if _is_cuda(device) and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / MIB
    if not _RSS_WINDOW["open"]:
        return None
    try:
        with open(STATUS) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib / 1024
