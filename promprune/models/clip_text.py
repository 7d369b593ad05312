"""CLIP's text tower and visual projection for CDPruner's instruction relevance on CLIP-based VLMs.

LLaVA checkpoints ship only CLIP's vision tower. CDPruner's released code loads the text tower
(``CLIPTextModelWithProjection``) and the ``visual_projection`` of the same CLIP (openai/clip-vit-large-patch14-336)
separately; :func:`load` does the same from any CLIP checkpoint, or (``"tiny"``) builds a seeded random one sized to
the model's vision tower (the offline tiny models, :mod:`promprune.models.tiny`).
"""
from __future__ import annotations

import torch

# The CLIP of LLaVA-1.5 / LLaVA-NeXT, whose text tower CDPruner's released code loads.
RELEASED_CLIP = "openai/clip-vit-large-patch14-336"
# The short-answer instruction lmms-eval / LLaVA append to a question; CDPruner's evaluation scripts strip it.
SHORT_ANSWER_SUFFIX = "\nAnswer the question using a single word or phrase."


def question_text(prompt: str) -> str:
    """The question CDPruner embeds: the prompt without the short-answer suffix."""
    return prompt.replace(SHORT_ANSWER_SUFFIX, "")


class ClipText:
    """``tokenizer``, ``text_model`` (a ``CLIPTextModelWithProjection``) and ``visual_projection`` of one CLIP."""

    def __init__(self, tokenizer, text_model, visual_projection):
        self.tokenizer, self.text_model, self.visual_projection = tokenizer, text_model.eval(), visual_projection

    def to(self, device, dtype=None):
        """Both modules on ``device`` (in ``dtype``; None: as they are)."""
        self.text_model.to(device=device, dtype=dtype)
        self.visual_projection.to(device=device, dtype=dtype)
        return self

    @torch.inference_mode()
    def embed(self, text: str) -> torch.Tensor:
        """``[c]``: the mean unit text embedding over the question's windows of ``max_position_embeddings`` tokens
        (the released code cuts longer questions into such windows, zero-padded, and averages the cosines)."""
        enc = self.tokenizer(text, return_tensors="pt")
        window = self.text_model.config.max_position_embeddings
        ids, mask = enc["input_ids"], enc["attention_mask"]  # [1, L]
        pad = -ids.shape[1] % window
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1).view(-1, window)  # [M, window]
        mask = torch.cat([mask, mask.new_zeros(1, pad)], dim=1).view(-1, window)
        device = next(self.text_model.parameters()).device
        emb = self.text_model(input_ids=ids.to(device), attention_mask=mask.to(device)).text_embeds.float()  # [M, c]
        return torch.nn.functional.normalize(emb, dim=-1).mean(dim=0)

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor, post_layernorm) -> torch.Tensor:
        """Vision-tower hidden states ``[N, dv]`` -> CLIP's joint space ``[N, c]`` (post_layernorm,
        visual_projection)."""
        weight = self.visual_projection.weight
        return self.visual_projection(post_layernorm(hidden).to(weight.dtype)).float()


def load(name: str, vision_config) -> ClipText:
    """The text tower and visual projection of CLIP checkpoint ``name`` ("tiny": seeded, sized to ``vision_config``)."""
    if name == "tiny":
        from .tiny import tiny_clip_text

        return ClipText(*tiny_clip_text(vision_config))
    from transformers import (
        AutoTokenizer,
        CLIPTextModelWithProjection,
        CLIPVisionModelWithProjection,
    )

    vision = CLIPVisionModelWithProjection.from_pretrained(name)
    return ClipText(AutoTokenizer.from_pretrained(name), CLIPTextModelWithProjection.from_pretrained(name),
                    vision.visual_projection)
