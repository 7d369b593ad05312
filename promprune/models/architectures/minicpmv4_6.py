"""MiniCPM-V 4.6 (``MiniCPMV4_6ForConditionalGeneration``, ``openbmb/MiniCPM-V-4.6``): slices, a ViT that compresses.

The processor cuts an image into a source view (the whole image, resized to about ``scale_resolution``^2 pixels,
448^2 released) and, when the image is larger than that, a grid of up to ``max_slice_nums`` (9) slices of about that
size; each view is one native-resolution run of 14 px patches through SigLIP2-400M (27 layers), packed with the others
and attending within itself. **The ViT already compresses its tokens 16x**: after layer ``insert_layer_id`` (6) a
window-attention merger joins every 2 x 2 window of patches into one token, the later layers run on those, and the
final merger joins every 2 x 2 of them again and projects into the LLM (``downsample_mode`` "16x"; "4x" skips the
first merge). A 448 px view is 32 x 32 = 1024 patches but only 8 x 8 = 64 LLM tokens, each summarizing a 4 x 4 patch
(56 px) block; the prompt holds ``<image>`` + the source's run + ``</image>``, then each slice's run between
``<slice>`` and ``</slice>``, rows of slices ended by a newline. The LLM is Qwen3.5-0.8B's hybrid stack (Gated DeltaNet
linear attention, full attention every 4th layer), fed 1D positions: a pruned sequence is numbered by its own mask, as
LLaVA's.

**Pruning on top of that compression** selects among the already-merged tokens: the budget counts 16x tokens (64 per
448 px view), so a budget of 64 on a sliced image keeps one view's worth out of up to 640, each kept token still
standing for its 56 px block; what pruning saves is LLM work (prefill, KV cache), never ViT work, which runs whole and
has already cut the patch count by 16 (the released model's mixed 4x / 16x mode trades the same way inside the ViT).
The views are the slices (source first): ``budget_mode`` ``per_crop`` (default) splits the budget evenly over them,
``global`` selects over all, ``adaptive_views`` shares it by each view's entropy, ``view_quota`` gives each view
``budget // (1 + max_slice_nums)``. Each view keeps its own placeholder run between the slice markers (several runs
per image: ``contiguous_run`` False), so a kept token stays in its view's run.

Saliency: the tower has no CLS token, so it is the no-CLS rule of Qwen2.5-VL: the attention each token receives within
its view at one encoder layer (``saliency_block``, default the last, whose output the final merger reads), queries and
heads averaged, recomputed by a hook with the layer's own projections (SDPA stays on), then averaged over the block of
that layer's tokens each LLM token merges (2 x 2 after the window merger, 4 x 4 before it). No vision-tower features
(VisPruner / VisionZip / CDPruner work on the projected tokens; CDPruner's instruction is the LLM's input embeddings);
``downsample`` pools each view's own token grid (``VisualItem.cells``). Clips are not adapted (``generate_video``
refuses this family); MiniCPM-V 4.7 (``minicpmv4_7``, canvas M-RoPE positions for its markers) is not registered.

Tiny (``tiny:minicpmv4_6``): 2 px patches, 32 px views (``scale_resolution``; a view of 16 x 16 patches is 4 x 4
tokens), up to 4 slices, a 3-layer tower merging after layer 0, Qwen3.5's tiny hybrid LLM (8 layers, full attention
every 2nd). Shape: ``shape:minicpm_v_4_6`` (sizes inferred, unverified offline).
"""
from __future__ import annotations

import contextlib

import torch
from transformers import (
    MiniCPMV4_6Config,
    MiniCPMV4_6ForConditionalGeneration,
    MiniCPMV4_6ImageProcessor,
    MiniCPMV4_6Processor,
    MiniCPMV4_6VideoProcessor,
)

from ..adapters import Adapter, VisualItem, as_encoder_outputs, saliency_layer
from ..registry import register_family
from ..saliency import capture, segment_received
from ..shapes import section
from ..tiny import byte_level_tokenizer, seeded, text_sizes
from .qwen3_5 import QWEN3_5_LAYERS

RELEASED_SLICES = 9  # the released image processor's max_slice_nums
MINICPM_SPECIALS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
                    "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}
# ChatML (Qwen3.5's turns) with the image placeholder the processor expands into its views' runs
MINICPM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|image_pad|>\n{% elif c['type'] == 'video' %}"
    "<|video_pad|>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def minicpm_tokenizer():
    """The byte-level tokenizer with Qwen's chat tokens and MiniCPM-V's image, slice and image-id markers, named as
    MiniCPMV4_6Processor reads them (``image_token``, ``slice_start_token``, ...)."""
    return byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *MINICPM_SPECIALS.values()],
                                eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                extra_special_tokens=dict(MINICPM_SPECIALS))


def minicpm_processor(tok, patch: int, scale_resolution: int, max_slices: int):
    """A MiniCPMV4_6Processor around ``tok``: ``patch`` px patches, views of about ``scale_resolution``^2 pixels, up to
    ``max_slices`` slices (16x compression, image ids before each image as released)."""
    sizes = dict(patch_size=patch, scale_resolution=scale_resolution, max_slice_nums=max_slices)
    return MiniCPMV4_6Processor(image_processor=MiniCPMV4_6ImageProcessor(**sizes),
                                video_processor=MiniCPMV4_6VideoProcessor(**sizes), tokenizer=tok,
                                chat_template=MINICPM_TEMPLATE)


def tiny_minicpmv4_6():
    tok = minicpm_tokenizer()
    patch = 2  # 32 px views of 16 x 16 patches -> 4 x 4 tokens, so the test images give tens of tokens and slices
    # Qwen3.5's tiny hybrid LLM (linear / full attention alternating, 32-wide heads, a quarter rotary)
    text = dict(**text_sizes(len(tok)), pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id)
    text.update(num_hidden_layers=QWEN3_5_LAYERS, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention"] * (QWEN3_5_LAYERS // 2),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    # the window merger after layer 0 of 3, so two layers (the saliency default among them) run on merged tokens
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                  patch_size=patch)
    config = MiniCPMV4_6Config(text_config=text, vision_config=vision, insert_layer_id=0, image_size=32,
                               image_token_id=tok.image_token_id, video_token_id=tok.video_token_id)
    config.promprune_max_slice_nums = 4  # its processor's, which fewest_tokens reads from the config
    model = seeded(lambda: MiniCPMV4_6ForConditionalGeneration(config))
    return model, minicpm_processor(tok, patch, scale_resolution=32, max_slices=config.promprune_max_slice_nums)


def shape_minicpmv4_6(spec: dict, text_layers, vision_layers):
    """A shortened LLM keeps its first layers' types; a shortened tower keeps the window merger inside it."""
    tok = minicpm_tokenizer()
    text = section(spec, "text_config", text_layers, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    text["layer_types"] = text["layer_types"][:text["num_hidden_layers"]]
    vision = section(spec, "vision_config", vision_layers)
    insert = min(spec["insert_layer_id"], vision["num_hidden_layers"] - 1)
    config = MiniCPMV4_6Config(text_config=text, vision_config=vision, insert_layer_id=insert,
                               image_size=spec["image_size"], tie_word_embeddings=spec["tie_word_embeddings"],
                               image_token_id=tok.image_token_id, video_token_id=tok.video_token_id)
    p = spec["processor"]
    processor = minicpm_processor(tok, p["patch_size"], p["scale_resolution"], p["max_slice_nums"])
    return MiniCPMV4_6ForConditionalGeneration, config, processor


def released_views(config) -> int:
    """The most views one image gives: the source plus the released processor's 9 slices (the adapter reads its own
    processor's ``max_slice_nums``)."""
    return 1 + RELEASED_SLICES


def fewest_tokens(config, options: dict) -> int:
    """The fewest visual tokens any image gives (16x or 4x tokens, as the prompt's placeholders count them), with the
    released slicing (``slice_mode`` on) into up to ``config.promprune_max_slice_nums`` slices (the tiny model's 4;
    else the released 9). The count varies with the image's size (a larger one is sliced) and its aspect ratio. The
    source view is the whole image resized to about ``S^2`` px (``S`` = ``image_size``) at its aspect ratio ``r``
    (``MiniCPMV4_6ImageProcessor.find_best_resize``: ``h = int(S / sqrt(r))``, ``w = int(h x r)``, each side rounded
    to whole tokens of ``d`` px, at least one): its fewest, over each ``h``, is at the narrowest ``w`` that ``h``
    allows, just above ``h x S^2 / (h + 1)^2`` (42 tokens released, 10 tiny). An image more than ``S^2`` times wider
    than tall has ``h = 0``, a one-token source, and sliced (it is larger than ``S^2``) into slices that are one token
    each once it is about ``slices x S^2`` times wider: ``1 + slices`` in all (1 x 1806345 px: 10 released; 1 x 4100
    px: 5 tiny). The least of the two."""
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import ensure_divide

    side = config.image_size  # the processor's scale_resolution
    d = config.vision_config.patch_size * (2 if config.downsample_mode == "4x" else 4)  # px per token side
    slices = int(getattr(config, "promprune_max_slice_nums", RELEASED_SLICES))
    fewest = 1 + (slices if slices > 1 else 0)  # max_slice_nums 1 slices nothing: a one-token source alone
    h = 1
    while ensure_divide(h, d) // d < fewest:  # rows only grow with h
        narrowest = (h * side * side - 1) // (h + 1) ** 2  # one less where exact: float may floor it so
        fewest = min(fewest, ensure_divide(h, d) // d * (ensure_divide(narrowest, d) // d))
        h += 1
    return fewest


def received_attention(attn, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean attention each token receives within its view (queries and heads averaged) of a
    ``MiniCPMV4_6VisionAttention``: packed views ``hidden [1, S, C] -> [S]`` float32 (no rotary: the tower adds
    learned position embeddings at its input)."""
    S = hidden.shape[1]
    shape = (S, attn.num_heads, attn.head_dim)
    q = attn.q_proj(hidden[0]).float().view(shape).transpose(0, 1)  # [H, S, hd]
    k = attn.k_proj(hidden[0]).float().view(shape).transpose(0, 1)  # [H, S, hd]
    return segment_received(q, k, cu_seqlens, attn.scaling)


def block_mean(scores: torch.Tensor, rows: int, cols: int, k: int) -> torch.Tensor:
    """``scores [rows * cols]`` of a raster grid averaged over each ``k x k`` block: ``[(rows / k) * (cols / k)]``, in
    the blocks' raster order (the order the merger emits its tokens)."""
    return scores.view(rows // k, k, cols // k, k).mean(dim=(1, 3)).flatten()


# mu 0.42: borrowed from CLIP (a SigLIP tower, as LLaVA-OneVision's), uncalibrated: recalibrate with
# sweeps/mu_calibration.yaml on the real checkpoint before reading PromPrune's numbers there
@register_family("minicpmv4_6", model_class="MiniCPMV4_6ForConditionalGeneration", default_mu=0.42,
                 tiny=tiny_minicpmv4_6, shape=shape_minicpmv4_6, fewest=fewest_tokens, max_views=released_views)
class MiniCPMV46Adapter(Adapter):
    """MiniCPM-V 4.6: a source view and slices, each a run of 16x-merged tokens; saliency = received attention at one
    encoder layer, averaged over each token's block (see the module docstring)."""

    encoder = "minicpmv4_6"
    contiguous_run = False  # one placeholder run per view, between the slice markers

    def __init__(self, model, processor, options: dict):
        super().__init__(model, processor, options)
        self.layer = self.saliency_index(model.config, options)  # checked at construction (check_options)

    @classmethod
    def saliency_index(cls, config, options: dict) -> int:
        depth = config.vision_config.num_hidden_layers
        return saliency_layer(options, depth, depth - 1)  # default: the last, whose output the final merger reads

    @classmethod
    def views(cls, config, processor=None) -> int | None:
        """The source plus the processor's ``max_slice_nums`` slices (1 when it does not slice)."""
        if processor is None:
            return None
        image_processor = processor.image_processor
        return 1 + int(image_processor.max_slice_nums) if image_processor.slice_mode else 1

    def _strides(self) -> tuple[int, int]:
        """``(s, f)``: patches per side of one token at the saliency layer (2 after the window merger, else 1) and of
        one LLM token (4 under "16x", 2 under "4x")."""
        cfg = self.model.config
        merged = cfg.downsample_mode != "4x"
        after_window = merged and self.layer > cfg.vision_config.insert_layer_id
        return (2 if after_window else 1), (4 if merged else 2)

    def encode(self, inputs, need_saliency, need_vision=False):
        """One item per image: its views' tokens (source first, then the slices row by row), ``groups`` the view."""
        core = self.model.model
        attn = core.vision_tower.encoder.layers[self.layer].self_attn
        sink: list = []
        with capture(attn, sink, received_attention, "cu_seqlens") if need_saliency else contextlib.nullcontext():
            out = core.get_image_features(inputs["pixel_values"], inputs["target_sizes"], return_dict=True)
        views = list(out.pooler_output)  # per view [n_v, d], every image's views in placeholder order
        sizes = inputs["target_sizes"].tolist()  # per view (patch rows, patch cols)
        scores = self._view_saliency(sink[0], sizes) if need_saliency else [None] * len(views)
        items, first = [], 0
        for count in self._views_per_image(inputs["input_ids"], views):
            items.append(self._item(views[first:first + count], sizes[first:first + count],
                                    scores[first:first + count]))
            first += count
        return items

    def _view_saliency(self, received: torch.Tensor, sizes) -> list[torch.Tensor]:
        """Per view ``[n_v]``: the received attention ``[S]`` of the saliency layer's packed tokens, averaged over the
        block each LLM token merges."""
        s, f = self._strides()
        out, start = [], 0
        for h, w in sizes:
            n = (h // s) * (w // s)  # the view's tokens at the saliency layer
            out.append(block_mean(received[start:start + n], h // s, w // s, f // s))
            start += n
        return out

    def _views_per_image(self, input_ids: torch.Tensor, views: list) -> list[int]:
        """Views of each row's image: the placeholder runs of the row, each as long as its view's tokens."""
        counts, v = [], 0
        for b, row in enumerate(input_ids):
            cols = (row == self.model.config.image_token_id).nonzero().flatten()
            breaks = (cols[1:] - cols[:-1] != 1).nonzero().flatten()
            lengths = torch.diff(torch.cat([cols.new_tensor([-1]), breaks, cols.new_tensor([cols.numel() - 1])]))
            if lengths.tolist() != [t.shape[0] for t in views[v:v + lengths.numel()]]:
                raise ValueError(f"prompt {b}: its placeholder runs {lengths.tolist()} do not match the views the "
                                 "images gave")
            counts.append(lengths.numel())
            v += lengths.numel()
        return counts

    def _item(self, views: list[torch.Tensor], sizes, scores) -> VisualItem:
        """One image's item from its views ``[n_v, d]``, their patch grids and saliency ``[n_v]`` (or None)."""
        _s, f = self._strides()
        run = torch.cat(views)  # [P, d]
        idx = torch.arange(run.shape[0], device=run.device)
        groups = torch.cat([torch.full((t.shape[0],), g, dtype=torch.long) for g, t in enumerate(views)])
        cells = torch.cat([torch.stack([torch.arange(t.shape[0]) // (w // f), torch.arange(t.shape[0]) % (w // f)], -1)
                           for t, (_h, w) in zip(views, sizes)])  # [P, 2]: (row, col) in its view's token grid
        saliency = None if scores[0] is None else torch.cat(scores).to(run.device)
        return VisualItem(run=run, features=run, run_pos=idx, grid_index=idx, saliency=saliency,
                          groups=groups.to(run.device), cells=cells.to(run.device))

    def encoder_outputs(self, items, feats, run_pos):
        return as_encoder_outputs(feats)  # the model concatenates them into the placeholders, row after row
