"""Tiny, offline, seeded VLMs built from the real transformers classes: ``tiny:<family>``.

``tiny_vlm(name)`` returns ``(model, processor)`` for every registered family that declares a tiny factory
(:func:`archs`; :mod:`promprune.models.registry`): the genuine ``...ForConditionalGeneration`` class with random
weights (seed 0), and a processor whose tokenizer, image processor and chat template are constructed from code (no
hub access). The structure is the released model's, the sizes are not: each family's module says what its tiny
model keeps (LLaVA-1.5: a 3-layer CLIP with a CLS token read at layer -2, 36 tokens; Qwen2.5-VL: 4 px patches,
windowed attention with full-attention blocks, 2 x 2 merging; ...).

This module holds what the families' factories share: the byte-level tokenizer (no merges, one token per byte, plus
the architecture's special tokens, so any text round-trips and nothing is ever unknown), the tiny LLM sizes, the seeded
build, and the tiny CLIP text tower of CDPruner on the CLIP-based families.
"""
from __future__ import annotations

import copy
import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, PreTrainedTokenizerFast

from ..seeding import private_seed
from .factories import place
from .registry import check_builds_own, families, family

SEED = 0  # fixed so every process builds bit-identical tiny models


def byte_level_tokenizer(special_tokens: list[str], **named) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: 256 byte tokens, then `special_tokens` (ids 256, 257, ...)."""
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(special_tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **named)


def text_sizes(vocab_size: int) -> dict:
    """A 4-layer LLM: deep enough for FastV at layer 2 and SparseVLM's several pruning layers."""
    return dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )


def seeded(build):
    """``build()`` with torch seeded (:data:`SEED`), in eval mode; the caller's random state is left as it was
    (:func:`promprune.seeding.private_seed`)."""
    with private_seed(SEED):
        return build().eval()


def tiny_clip_text(vision_config):
    """``(tokenizer, text model, visual projection)``: a seeded random CLIP text tower matching ``vision_config``
    (CDPruner on the tiny LLaVAs; :func:`promprune.models.clip_text.load` with "tiny"): byte-level tokens between
    CLIP's start / end markers, 16-token windows (so long questions take several)."""
    tok = byte_level_tokenizer(["<|startoftext|>", "<|endoftext|>"], bos_token="<|startoftext|>",
                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)])
    config = CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=16,
                            projection_dim=vision_config.projection_dim,
                            bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    with private_seed(SEED):
        text = CLIPTextModelWithProjection(config).eval()
        projection = torch.nn.Linear(vision_config.hidden_size, vision_config.projection_dim, bias=False)
    return tok, text, projection


def archs() -> list[str]:
    """The families with a tiny model (``tiny:<name>``), sorted."""
    return [name for name in families() if family(name).tiny is not None]


@functools.lru_cache(maxsize=None)
def _cached(arch: str):
    fam = family(arch)
    model, processor = fam.tiny()
    check_builds_own(fam, model.config, "tiny")
    return model, processor


def load(arch: str, *, dtype=None, device_map=None, attn_implementation=None, max_memory=None):
    """The ``tiny:<arch>`` model factory: a private copy of ``tiny_vlm(arch)``, placed like ``from_pretrained``."""
    model, processor = tiny_vlm(arch)
    model = place(copy.deepcopy(model), dtype=dtype, device_map=device_map, attn_implementation=attn_implementation,
                  max_memory=max_memory)
    return model, copy.deepcopy(processor), {}


load.config = lambda arch: tiny_vlm(arch)[0].config  # noqa: E731 - the factory's config, for validation


def tiny_vlm(arch: str):
    """`(model, processor)` for a tiny seeded random-weight VLM of family `arch` (:func:`archs`).

    Built once per process and cached: callers must not mutate the weights (dtype changes included,
    use `copy.deepcopy(model)` first). An unknown name is a ValueError with did-you-mean and the valid names.
    """
    if family(arch).tiny is None:  # an unknown name raises in family()
        raise ValueError(f"model family {arch!r} has no tiny model; tiny models: {', '.join(archs())}")
    return _cached(arch)
