"""Saliency captured with a hook on one vision-encoder layer, so the tower keeps SDPA / flash attention.

The hook sees the attention module's input (the layer-normed hidden states) and recomputes only what saliency
needs with the module's own projections:

- CLIP (LLaVA, LLaVA-NeXT): the CLS query's attention row, softmax over all keys, mean over heads (and, for
  VisionZip, the same layer's keys, mean over heads).
- Qwen2.5-VL (no CLS): the attention each patch receives, averaged over queries and heads, within each image
  (full-attention blocks attend per image), then averaged over each 2x2 group the merger joins.
- LLaVA-OneVision's SigLIP (no CLS): the attention each patch receives at the layer the projector reads, averaged
  over queries and heads, within each view.
- Qwen3-VL (no CLS, every block attends over the whole image, no window permutation): the same received attention,
  pooled over each 2x2 group, already in raster order.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from transformers.vision_utils import get_vision_window_index

from ..dtypes import upcast

QUERY_CHUNK = 1024  # queries per block when summing Qwen attention: bounds memory to H x 1024 x n floats


def cls_attention(attn: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """CLS-to-all attention of a CLIPAttention module, head mean: ``hidden [B, S, C] -> [B, S]`` (float32; float64
    for a float64 model)."""
    B, S, _ = hidden.shape
    H, hd = attn.num_heads, attn.head_dim
    q = upcast(attn.q_proj(hidden[:, :1])).view(B, 1, H, hd).transpose(1, 2)  # [B, H, 1, hd]
    k = upcast(attn.k_proj(hidden)).view(B, S, H, hd).transpose(1, 2)  # [B, H, S, hd]
    probs = torch.softmax((q @ k.transpose(-1, -2)) * attn.scale, dim=-1)  # [B, H, 1, S]
    return probs[:, :, 0].mean(dim=1)  # [B, S]


@contextlib.contextmanager
def capture(attn: torch.nn.Module, sink: list, measure, *arguments: str):
    """While active, append ``measure(attn, input hidden states, *the call's keyword arguments named in arguments)``
    to ``sink`` at every call of ``attn``."""

    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        sink.append(measure(module, hidden, *(kwargs[name] for name in arguments)))

    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield sink
    finally:
        handle.remove()


def view_received_attention(attn: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Mean attention each token receives within its view (queries and heads averaged) of a CLIP / SigLIP attention
    module: ``hidden [B, S, C] -> [B, S]`` (float32), one view at a time to bound memory to H x S x S floats."""
    B, S, _ = hidden.shape
    H, hd = attn.num_heads, attn.head_dim
    out = torch.empty(B, S, dtype=torch.float32, device=hidden.device)
    for b in range(B):
        q = attn.q_proj(hidden[b]).float().view(S, H, hd).transpose(0, 1)  # [H, S, hd]
        k = attn.k_proj(hidden[b]).float().view(S, H, hd).transpose(0, 1)  # [H, S, hd]
        probs = torch.softmax((q @ k.transpose(-1, -2)) * attn.scale, dim=-1)  # [H, S, S]
        out[b] = probs.mean(dim=(0, 1))
    return out


def capture_cls_attention(attn: torch.nn.Module, sink: list):
    """While active, append ``cls_attention(attn, input) [B, S]`` to ``sink`` at every call of ``attn``."""
    return capture(attn, sink, cls_attention)


def attention_keys(attn: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The keys of a CLIPAttention module, mean over heads: ``hidden [B, S, C] -> [B, S, head_dim]`` (float32;
    float64 for a float64 model).

    VisionZip's released code merges its contextual tokens by the similarity of these (its CLIP layer -2).
    """
    B, S, _ = hidden.shape
    return upcast(attn.k_proj(hidden)).view(B, S, attn.num_heads, attn.head_dim).mean(dim=2)


def capture_keys(attn: torch.nn.Module, sink: list):
    """While active, append ``attention_keys(attn, input) [B, S, hd]`` to ``sink`` at every call of ``attn``."""
    return capture(attn, sink, attention_keys)


def clip_attention_module(vision_tower: torch.nn.Module, feature_layer: int) -> torch.nn.Module:
    """The self-attention of the CLIP encoder layer whose output is ``hidden_states[feature_layer]``.

    ``hidden_states[0]`` is the embedding output and ``hidden_states[h]`` the output of layer ``h - 1``.
    """
    body = getattr(vision_tower, "vision_model", vision_tower)  # CLIPVisionModel or the bare transformer
    layers = body.encoder.layers
    h = feature_layer if feature_layer >= 0 else feature_layer + len(layers) + 1
    if not 1 <= h <= len(layers):
        raise ValueError(f"vision_feature_layer {feature_layer} does not name an encoder layer output "
                         f"(the encoder has {len(layers)} layers)")
    return layers[h - 1].self_attn


def segment_received(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scaling: float) -> torch.Tensor:
    """Mean attention each token receives within its segment (queries and heads averaged) of packed sequences that
    attend within themselves: ``q, k [H, S, hd]`` (float32), segments ``cu_seqlens [G + 1]`` -> ``[S]`` float32, the
    queries taken in blocks of :data:`QUERY_CHUNK`."""
    H, S, _ = q.shape
    out = torch.zeros(S, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        kc = k[:, start:end]  # [H, n, hd]
        for q0 in range(start, end, QUERY_CHUNK):
            qc = q[:, q0:min(q0 + QUERY_CHUNK, end)]  # [H, c, hd]
            probs = torch.softmax((qc @ kc.transpose(-1, -2)) * scaling, dim=-1)  # [H, c, n]
            out[start:end] += probs.sum(dim=(0, 1))
        out[start:end] /= (end - start) * H
    return out


def received_attention(attn: torch.nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                       position_embeddings) -> torch.Tensor:
    """Mean attention each token receives within its image: Qwen2.5-VL vision attention, ``hidden [S, C] -> [S]``."""
    S = hidden.shape[0]
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision
    q, k, _ = attn.qkv(hidden).reshape(S, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # [S, H, hd]
    cos, sin = position_embeddings
    q, k = rope(q, k, cos, sin)
    return segment_received(q.float().transpose(0, 1), k.float().transpose(0, 1), cu_seqlens, attn.scaling)


def capture_received_attention(attn: torch.nn.Module, sink: list):
    """While active, append ``received_attention [S]`` (window-permuted order) at every call of ``attn``."""
    return capture(attn, sink, received_attention, "cu_seqlens", "position_embeddings")


def pool_to_merged(received: torch.Tensor, grid_thw: torch.Tensor, vision_config) -> torch.Tensor:
    """Average window-ordered patch scores ``[S]`` over each merge group; returns ``[S / m^2]`` in raster order.

    Inside the Qwen2.5-VL tower the patches are permuted so each consecutive ``m^2`` form one merged token, in
    window order; the merger output is put back into raster order with ``argsort(window_index)``. We do the same.
    """
    unit = vision_config.spatial_merge_size ** 2
    window_index, _ = get_vision_window_index(grid_thw.cpu(), vision_config.spatial_merge_size,
                                              vision_config.window_size, vision_config.patch_size)
    pooled = received.view(-1, unit).mean(dim=1)  # [S / unit], window order
    return pooled[torch.argsort(window_index).to(pooled.device)]


def pool_groups(received: torch.Tensor, vision_config) -> torch.Tensor:
    """Average patch scores ``[S]`` over each merge group of ``m^2`` consecutive patches: ``[S / m^2]``.

    Qwen3-VL's processor lays the patches out so each consecutive ``m^2`` form one merged token, in the merged
    tokens' raster order, and its tower keeps that order (no window permutation).
    """
    return received.view(-1, vision_config.spatial_merge_size ** 2).mean(dim=1)
