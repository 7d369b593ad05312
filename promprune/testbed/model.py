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
"""
from __future__ import annotations

import copy
import functools
import re

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

from promprune.models.tiny import LLAVA_TEMPLATE
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
    torch.manual_seed(SEED)
    return LlavaForConditionalGeneration(config(tok)).eval(), processor(tok)


def untrained():
    """A fresh, seeded, untrained ``(model, processor)`` (private copies)."""
    model, proc = _untrained()
    return copy.deepcopy(model), copy.deepcopy(proc)
