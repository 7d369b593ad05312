"""The testbed VLM: the real transformers LLaVA classes at a size that trains on 2 CPU cores.

- Vision: a CLIP ViT with a CLS token, 96x96 px images, 8 px patches -> a 12x12 grid = **144 visual tokens**;
  ``vision_feature_layer=-2`` and the "default" strategy (CLS dropped), as LLaVA-1.5. Saliency is therefore real
  CLS attention at the layer the LLM reads. No pretrained vision weights could be had offline (no package on
  PyPI / Debian / npm ships a ViT checkpoint; the hub is unreachable), so the tower is trained too, and given an
  image-level objective of its own on the CLS token (which object kinds are present, how many), the role CLIP's
  contrastive pretraining plays for the real tower: it is what makes CLS attention pick out objects.
- Language: a 4-layer Llama. The tokenizer is word-level over the testbed's vocabulary (questions, answers,
  LLaVA's chat template and prompt words; anything else is ``<unk>``), so prompts stay short and answers are one
  token: training fits in a few minutes.
- Float64 (:class:`TestbedLlava`, what ``testbed:llava`` loads as): transformers' Llama computes its RMSNorm and
  its rotary cos / sin in float32 whatever the model's dtype; the testbed's keep a float64 model in float64 there
  too, so a float64 run carries no float32 rounding anywhere (the quickstart runs so: its answers then come out
  the same on every CPU kind, docs/testbed.md). In float32 they compute exactly what transformers' do.
"""
from __future__ import annotations

import copy
import functools
import re

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from promprune.dtypes import compute_dtype
from promprune.models.architectures.llava import LLAVA_TEMPLATE
from promprune.seeding import private_seed
from promprune.testbed import scenes

IMAGE_SIZE = scenes.CANVAS
PATCH = 8
SEED = 0
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]
# prompt words beyond the questions: LLaVA's template and the post prompts the tasks and training use
_EXTRA_TEXT = ("USER: ASSISTANT: Answer the question using a single word or phrase. Answer with yes or no. "
               "Answer with a number. Answer with one word.")
_WORD = re.compile(r"\w+|[^\w\s]+")  # what pre_tokenizers.Whitespace splits on


def vocabulary() -> list[str]:
    """Every word the testbed's prompts and answers use (lower-cased), in a fixed order."""
    texts = [_EXTRA_TEXT, "yes no", " ".join(str(n) for n in range(0, scenes.MAX_OBJECTS + 1))]
    texts += [scenes.exist_question(kind) for kind in scenes.KINDS]
    texts += [f"What {w} is the object at the {r}?" for w in ("color", "shape") for r in scenes.REGIONS]
    texts += [f"Is the {c} {s} {rel} the x?" for c in scenes.COLORS for s in scenes.SHAPES for rel in scenes.RELATIONS]
    texts += ["How many objects are there?", " ".join(scenes.COLORS), " ".join(scenes.SHAPES)]
    words: list[str] = []
    for text in texts:
        for word in _WORD.findall(text.lower()):
            if word not in words:
                words.append(word)
    return words


def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: LLaVA's special tokens, then :func:`vocabulary`; unknown words map to ``<unk>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+|[^\w\s]+, whitespace dropped
    backend.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.image_token = "<image>"
    return tok


def config(tok=None) -> LlavaConfig:
    tok = tok or tokenizer()
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=64)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=192, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                       vision_feature_layer=-2, vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id)


def processor(tok=None) -> LlavaProcessor:
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=True, do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    return LlavaProcessor(image_processor=image_processor, tokenizer=tok or tokenizer(), patch_size=PATCH,
                          vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                          image_token="<image>", num_additional_image_tokens=1)


@functools.lru_cache(maxsize=1)
def _untrained():
    tok = tokenizer()
    with private_seed(SEED):
        return LlavaForConditionalGeneration(config(tok)).eval(), processor(tok)


def untrained():
    """A fresh, seeded, untrained ``(model, processor)`` (private copies)."""
    model, proc = _untrained()
    return copy.deepcopy(model), copy.deepcopy(proc)


class WideRMSNorm(LlamaRMSNorm):
    """``LlamaRMSNorm`` computing in float64 for a float64 input (transformers' casts to float32 first); the same
    ops in float32 otherwise."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(compute_dtype(input_dtype))  # float32, as transformers', or float64
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class WideRotaryEmbedding(LlamaRotaryEmbedding):
    """``LlamaRotaryEmbedding`` whose cos / sin for a float64 model are computed in float64, inverse frequencies
    included (transformers' come from a float32 ``pow`` at construction and a float32 ``cos`` / ``sin`` per call);
    transformers' own forward otherwise. The default RoPE only (the testbed's)."""

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if x.dtype != torch.float64:
            return super().forward(x, position_ids)
        if self.rope_type != "default":
            raise ValueError(f"WideRotaryEmbedding: RoPE type {self.rope_type!r}; only the default RoPE is widened")
        base = self.config.rope_parameters["rope_theta"]
        dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim  # [dim/2]
        inv_freq = 1.0 / (base ** exponents)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq  # [B, S, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, dim]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


_WIDE = {LlamaRMSNorm: WideRMSNorm, LlamaRotaryEmbedding: WideRotaryEmbedding}


class TestbedLlava(LlavaForConditionalGeneration):
    """``LlavaForConditionalGeneration`` whose Llama norms and RoPE keep float64 (:class:`WideRMSNorm`,
    :class:`WideRotaryEmbedding`): the class ``testbed:llava`` loads as, so a model rebuilt from its class and
    config (the sweep's published weights) is widened too. Bit for bit transformers' model in float32."""

    def __init__(self, config):
        super().__init__(config)
        _widen_modules(self)


def _widen_modules(model: torch.nn.Module) -> None:
    for module in model.modules():
        wide = _WIDE.get(type(module))
        if wide is not None:
            module.__class__ = wide  # a subclass with no state of its own: only forward differs


def widen(model: LlavaForConditionalGeneration) -> TestbedLlava:
    """``model`` (a testbed LLaVA) as a :class:`TestbedLlava`, in place: its class and its Llama norms' and
    RoPE's swapped for the widened ones (no weight changes)."""
    if type(model) not in (LlavaForConditionalGeneration, TestbedLlava):
        raise TypeError(f"widen: a LlavaForConditionalGeneration, got {type(model).__name__}")
    model.__class__ = TestbedLlava
    _widen_modules(model)
    return model
