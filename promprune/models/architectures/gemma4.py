"""Gemma 4 (``Gemma4ForConditionalGeneration``): variable resolution, soft tokens pooled 3x3, received attention.

The image processor resizes each image, keeping its aspect ratio, to the largest size whose patches (16 px on the
released models) fit ``max_soft_tokens * 9`` and whose sides are multiples of 3 patches, and pads the patch list to
that length; the encoder attends over the image's patches only (padding masked), and its pooler averages each 3 x 3
block of patches into one *soft token*. An image therefore gives ``(patch rows / 3) x (patch columns / 3)`` soft
tokens, a number that varies with its aspect ratio (a 4:3 photo at the default budget 280: 15 x 18 = 270; the
processor reports it as ``num_soft_tokens_per_image``); ``embed_vision`` projects them into the LLM, where the prompt
holds ``<|image>``, one ``<|image|>`` placeholder per soft token, and ``<image|>``. The LLM numbers the sequence itself
(1D RoPE), so a pruned run is numbered as LLaVA's.

Candidates are the soft tokens, in the pooler's raster order over the pooled grid (``grid_shape`` (rows, cols) per
image); the budget is per image, whatever its token count, and a batch of images of different sizes gives each its
own (``batched_select`` groups the selections by token count).

Saliency: the encoder has no CLS token, so it is the no-CLS rule of Qwen2.5-VL / LLaVA-OneVision: the attention each
patch receives, averaged over the image's (non-padding) queries and the heads, at the encoder layer whose output is
pooled (the last; adapter option ``saliency_block`` picks another), recomputed by a hook on that layer's attention with
its own projections, q / k norms and 2D RoPE (SDPA stays on). The LLM sees pooled tokens, so a soft token's saliency is
the SUM of the received attention of the 3 x 3 patches its pooler averages (the attention mass of its region; every
soft token pools 9 patches, so the ranking is that of their mean). Features: the soft tokens after ``embed_vision``
(no CLS for VisionZip to feed, no tower-side features: VisPruner / VisionZip / CDPruner work on the projected tokens, as
on Qwen; CDPruner's instruction is the LLM's input embeddings of the question).

The LLM's vision tokens attend to each other bidirectionally in its sliding-window layers
(``use_bidirectional_attention: vision``, on the released 31B), which transformers reads from ``mm_token_type_ids``:
the adapter rebuilds them for the (pruned) sequence it feeds.

Tiny (``tiny:gemma4``): the encoder (no CLS) on 4 px patches, each image resized keeping its aspect ratio to at most
70 x 9 patches (the smallest released soft-token budget, 70) and pooled 3x3 into up to 70 soft tokens; an LLM of 6
layers alternating sliding-window (160 tokens: wider than the test prompts, as the 31B's 1024 is for a 280-token image;
tests narrow it to make it cut) and full attention, the full layers with their own head width, one KV head, keys as
values (``attention_k_eq_v``) and partial RoPE, vision tokens attending bidirectionally in the sliding layers (the 31B:
5 sliding to 1 full). Shapes: ``shape:gemma4_31b``, ``shape:gemma4_e2b``.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from transformers import (
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
)

from ..adapters import Adapter, VisualItem, saliency_layer
from ..registry import register_family
from ..saliency import capture
from ..shapes import section
from ..tiny import byte_level_tokenizer, seeded, text_sizes

QUERY_CHUNK = 1024  # queries per block when summing attention: bounds memory to H x 1024 x n floats
RELEASED_SOFT_TOKENS = 280  # the released processor's (and lmms-eval's gemma4 model's) max_soft_tokens
GEMMA4_SPECIALS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                   "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
# Gemma 4's turns (``<|turn>role ... <turn|>``, the model's role named "model"), the image as its ``<|image|>``
# placeholder before the text, as the -it checkpoints' template renders a user turn without thinking
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def gemma4_tokenizer():
    """The byte-level tokenizer with Gemma's pad / eos / bos, its turn markers and its image and audio tokens, named
    as Gemma4Processor reads them (``image_token``, ``boi_token``, ...)."""
    return byte_level_tokenizer(["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", *GEMMA4_SPECIALS.values()],
                                bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                extra_special_tokens=dict(GEMMA4_SPECIALS))


def gemma4_token_ids(tok) -> dict:
    """Gemma4Config's token-id fields wired to ``tok`` (the processor adds ``<|video|>`` to it)."""
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in GEMMA4_SPECIALS.items()}
    return dict(image_token_id=ids["image_token"], boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
                audio_token_id=ids["audio_token"], boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"],
                video_token_id=tok.convert_tokens_to_ids("<|video|>"))


def gemma4_processor(tok, patch: int, max_soft_tokens: int, pooling: int = 3):
    """A Gemma4Processor around ``tok``: ``patch`` px patches, at most ``max_soft_tokens`` soft tokens per image (one of
    the released budgets 70 / 140 / 280 / 560 / 1120), ``pooling`` x ``pooling`` patches per soft token; the audio
    feature extractor and video processor its constructor requires."""
    sizes = dict(patch_size=patch, max_soft_tokens=max_soft_tokens, pooling_kernel_size=pooling)
    return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                           image_processor=Gemma4ImageProcessor(**sizes), tokenizer=tok,
                           video_processor=Gemma4VideoProcessor(**sizes), chat_template=GEMMA4_TEMPLATE,
                           image_seq_length=max_soft_tokens)


def tiny_gemma4():
    tok = gemma4_tokenizer()
    processor = gemma4_processor(tok, patch=4, max_soft_tokens=70)  # adds <|video|> to tok: build it first
    text = dict(**text_sizes(len(tok)), head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                attention_k_eq_v=True, sliding_window=160, final_logit_softcapping=30.0,
                layer_types=["sliding_attention", "full_attention"] * 3, use_bidirectional_attention="vision",
                hidden_size_per_layer_input=0, num_kv_shared_layers=0, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    text["num_hidden_layers"] = 6  # three sliding / full pairs: in-LLM ranks land on full layers (llm_hooks.py)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, patch_size=4, pooling_kernel_size=3,
                  # a side of up to 70 * 9 / 3 = 210 patches (an image 3 patches thin): a table of 64 failed on
                  # elongated images (an IndexError inside the tower) where the released model's 10240 does not
                  position_embedding_size=256, standardize=True)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, vision_soft_tokens_per_image=70,
                          **gemma4_token_ids(tok))
    model = seeded(lambda: Gemma4ForConditionalGeneration(config))
    return model, processor


def shape_gemma4(spec: dict, text_layers, vision_layers):
    """A shortened Gemma 4 keeps its first layers' types (the last forced full, as transformers does) and no KV
    sharing."""
    tok = gemma4_tokenizer()
    p = spec["processor"]
    processor = gemma4_processor(tok, p["patch_size"], p["max_soft_tokens"], p["pooling_kernel_size"])
    text = section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   bos_token_id=tok.bos_token_id)
    if text_layers is not None:
        types = text.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                            for i in range(spec["text_config"]["num_hidden_layers"])]
        text["layer_types"] = [*types[:text_layers - 1], "full_attention"]
        text["num_kv_shared_layers"] = 0
    config = Gemma4Config(text_config=text, vision_config=section(spec, "vision_config", vision_layers),
                          audio_config=spec.get("audio_config"), tie_word_embeddings=spec["tie_word_embeddings"],
                          vision_soft_tokens_per_image=spec["vision_soft_tokens_per_image"],
                          **gemma4_token_ids(tok))
    return Gemma4ForConditionalGeneration, config, processor


def soft_token_capacity(config, options: dict) -> int:
    """The most soft tokens an image gives: the adapter option ``max_soft_tokens``, else the config's
    ``vision_soft_tokens_per_image``, else the released 280."""
    return options.get("max_soft_tokens") or getattr(config, "vision_soft_tokens_per_image", None) \
        or RELEASED_SOFT_TOKENS


def soft_token_floor(config, options: dict) -> int:
    """The fewest soft tokens any image gives under :func:`soft_token_capacity` ``T``. The count does not depend on
    the image's size, only on its aspect ratio (save for the float rounding of a side that lands exactly on a whole
    cell: 34 x 595 px gives the tiny model 1 x 34, 340 x 5950 px 2 x 35): the processor
    (``get_aspect_ratio_preserving_size``) scales every image, up or down, to about ``T`` pooled cells, ``a x T / a``
    with ``a = sqrt(T x height / width)``, and floors each side to whole cells, ``floor(a) x floor(T / a)`` soft
    tokens (an image more than ``T`` times wider than tall, or taller than wide, is one cell thick and ``T`` long).
    For ``a`` in ``[m, m + 1)`` that is at least ``m x floor(T / (m + 1))``, and one less per side where ``a`` falls
    on ``m + 1`` exactly, which the float arithmetic floors on both sides: ``m x floor((T - 1) / (m + 1))``. The
    least over ``m`` is ``floor((T - 1) / 2)``, m = 1: an image 17.5 times wider than tall (34 x 595 px) gives the
    tiny model's ``T`` 70 1 x 34 tokens, one 70 times wider (17 x 1190) 1 x 139 of the released 280."""
    most = soft_token_capacity(config, options)
    return min([most, *(m * ((most - 1) // (m + 1)) for m in range(1, most - 1))])


def received_attention(attn, hidden: torch.Tensor, position_embeddings, position_ids: torch.Tensor) -> torch.Tensor:
    """Mean attention each patch receives within its image (non-padding queries and heads averaged) of a
    ``Gemma4VisionAttention``: ``hidden [B, S, C] -> [B, S]`` float32, 0 at padding patches (``position_ids`` -1)."""
    B, S, _ = hidden.shape
    rope = sys.modules[type(attn).__module__].apply_multidimensional_rope
    cos, sin = position_embeddings
    shape = (B, S, -1, attn.head_dim)
    q = rope(attn.q_norm(attn.q_proj(hidden).view(shape)), cos, sin, position_ids)  # [B, S, H, hd]
    k = rope(attn.k_norm(attn.k_proj(hidden).view(shape)), cos, sin, position_ids)  # [B, S, Hkv, hd]
    q, k = q.transpose(1, 2).float(), k.transpose(1, 2).float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, H, S, hd]
    valid = (position_ids != -1).any(dim=-1)  # [B, S]
    out = torch.zeros(B, S, dtype=torch.float32, device=hidden.device)
    for b in range(B):
        idx = valid[b].nonzero().flatten()
        kb = k[b][:, idx]  # [H, n, hd]
        for q0 in range(0, idx.numel(), QUERY_CHUNK):
            qc = q[b][:, idx[q0:q0 + QUERY_CHUNK]]  # [H, c, hd]
            probs = torch.softmax((qc @ kb.transpose(-1, -2)) * attn.scaling, dim=-1)  # [H, c, n]
            out[b, idx] += probs.sum(dim=(0, 1))
        out[b, idx] /= idx.numel() * q.shape[1]
    return out


def capture_received_attention(attn, sink: list):
    """While active, append :func:`received_attention` ``[B, S]`` to ``sink`` at every call of ``attn``."""
    return capture(attn, sink, received_attention, "position_embeddings", "position_ids")


def pooled_layout(positions: torch.Tensor, k: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """``(rows, cols, patches, token)`` of one image's patch positions ``[S, 2]`` ((x, y); -1: padding): its pooled grid
    and, for each non-padding patch (``patches [P]``, indices into S), the soft token it is pooled into (``token [P]``,
    raster order over the ``rows x cols`` grid, as the model's pooler numbers them)."""
    patches = (positions != -1).any(dim=-1).nonzero().flatten()
    x, y = positions[patches, 0], positions[patches, 1]
    cols, rows = (int(x.max()) + 1) // k, (int(y.max()) + 1) // k
    return rows, cols, patches, (y // k) * cols + x // k


# mu 0.42: borrowed from CLIP, uncalibrated (sweeps/mu_tau_search_gemma4.yaml searches its own)
@register_family("gemma4", model_class="Gemma4ForConditionalGeneration", default_mu=0.42, tiny=tiny_gemma4,
                 shape=shape_gemma4, capacity=soft_token_capacity, fewest=soft_token_floor)
class Gemma4Adapter(Adapter):
    """Gemma 4: variable resolution, 3x3 pooled soft tokens; saliency = received attention summed over each soft token's
    patches (see the module docstring)."""

    encoder = "gemma4"

    def __init__(self, model, processor, options: dict):
        super().__init__(model, processor, options)
        self.layer = self.saliency_index(model.config, options)  # checked at construction (check_options)

    @classmethod
    def saliency_index(cls, config, options: dict) -> int:
        depth = config.vision_config.num_hidden_layers
        return saliency_layer(options, depth, depth - 1)  # default: the last layer, whose output the pooler averages

    def prepare_images(self, images):
        return [[image] for image in images]  # Gemma4Processor takes one list of images per prompt

    def processor_kwargs(self) -> dict:
        n = self.options.get("max_soft_tokens")
        return {} if n is None else {"max_soft_tokens": n}

    def max_soft_tokens(self) -> int:
        """The most soft tokens one image gives: option ``max_soft_tokens``, else the processor's own."""
        n = self.options.get("max_soft_tokens")
        return int(n if n is not None else self.processor.image_processor.max_soft_tokens)

    def encode(self, inputs, need_saliency, need_vision=False):
        """One item per image: its soft tokens in the pooler's raster order (``grid_shape`` its pooled grid)."""
        core = self.model.model
        attn = core.vision_tower.encoder.layers[self.layer].self_attn
        sink: list = []
        with capture_received_attention(attn, sink) if need_saliency else contextlib.nullcontext():
            out = core.get_image_features(pixel_values=inputs["pixel_values"],
                                          image_position_ids=inputs["image_position_ids"], return_dict=True)
        k = self.model.config.vision_config.pooling_kernel_size
        items = []
        for b, run in enumerate(out.pooler_output):  # [n_b, d] per image
            rows, cols, patches, token = pooled_layout(inputs["image_position_ids"][b], k)
            if rows * cols != run.shape[0]:
                raise ValueError(f"image {b}: the pooled grid {rows} x {cols} does not match the {run.shape[0]} soft "
                                 "tokens the model gives")
            saliency = None
            if need_saliency:  # each soft token: the attention its 3 x 3 patches receive, summed
                saliency = torch.zeros(run.shape[0], dtype=torch.float32, device=run.device)
                saliency.index_add_(0, token.to(run.device), sink[0][b, patches].to(run.device))
            idx = torch.arange(run.shape[0], device=run.device)
            items.append(VisualItem(run=run, features=run, run_pos=idx, grid_index=idx, saliency=saliency,
                                    groups=torch.zeros_like(idx), grid_shape=(rows, cols)))
        return items

    def generate_kwargs(self, inputs, new_ids, new_mask, col_map):
        """``mm_token_type_ids [B, L']`` of the rebuilt sequence (1 at the image placeholders): the LLM's sliding layers
        let vision tokens attend to each other by them (``use_bidirectional_attention: vision``)."""
        if "mm_token_type_ids" not in inputs:
            return {}
        types = inputs["mm_token_type_ids"].to(col_map.device)
        return {"mm_token_type_ids": types.gather(1, col_map.clamp_min(0)).masked_fill(col_map < 0, 0)}

