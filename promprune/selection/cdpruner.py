"""CDPruner (Zhang et al., NeurIPS 2025): a conditional DPP over the visual tokens before the LLM.

What its released code (Theia-4869/CDPruner, ``llava_arch.py`` / ``clip_encoder.py``) computes on LLaVA, and what
we do:

- Relevance of token i to the instruction: the cosine of the token's CLIP image embedding (the vision tower's
  hidden state at the layer LLaVA reads, through the tower's ``post_layernorm`` and CLIP's ``visual_projection``)
  with the CLIP text embedding of the question (``CLIPTextModelWithProjection`` of openai/clip-vit-large-patch14-336;
  a question longer than 77 tokens is cut into 77-token segments and the cosines are averaged over them). The
  released code NEGATES this cosine (``(-relevance).mean(-1)``) and min-max normalizes it:
  ``r = (r - min + 1e-6) / (max - min)``, over its whole batch (one image on LLaVA-1.5; all views of one image on
  LLaVA-NeXT). We normalize per selection unit (per image; per view on LLaVA-NeXT).
- Optional ``theta`` (commented out in the released code, off by default): ``r = exp(alpha r)`` with
  ``alpha = theta / (2 (1 - theta))``, computed as ``exp(alpha (r - max r))``: every weight divided by the largest,
  which is then 1 as in the released kernel. A constant factor does not change the greedy's picks, and without it
  the kernel (weights squared) overflows float32 from theta ~0.99 (alpha 49.5: e^99), repeating a token.
- Kernel ``L_ij = r_i S_ij r_j`` with ``S`` the cosine similarity of the tokens after LLaVA's projector
  (``features``), then greedy MAP inference for ``budget`` tokens (Chen et al. 2018), kept in index order.

The question text is the prompt with lmms-eval's / LLaVA's short-answer suffix removed, as the released evaluation
scripts pass it. Which embeddings the :class:`Instruction` holds is the adapters' business (option ``text_source``):
"clip" as released; "llm" for models without a CLIP (Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision): the mean of the LLM's
input embeddings of the question's tokens vs. the projected visual tokens, not negated (no released path; a positive
cosine there means related). "released": "clip" on CLIP-based models (LLaVA, LLaVA-NeXT), "llm" on the others. Real
SigLIP checkpoints have a text tower, but the llava-onevision checkpoints ship only SigLIP's vision tower, so
LLaVA-OneVision takes "llm" too (and refuses "clip").
"""
from __future__ import annotations

import torch

from .diversity import dpp_greedy
from .kernels import unit_tokens
from .registry import Selection, TokenSet, register_method

# The released code adds this to the min-max normalized relevance's numerator (no token gets exactly 0).
RELEVANCE_EPS = 1e-6
TEXT_SOURCES = ("released", "clip", "llm")


def relevance(tokens: TokenSet, negate: bool | None, theta: float | None) -> torch.Tensor:
    """Per-token relevance ``[B, N]`` to the instruction, min-max normalized per image (see the module docstring)."""
    instr = tokens.require_instruction("cdpruner")
    r = (unit_tokens(instr.tokens) @ instr.query[..., None]).squeeze(-1)  # [B, N] mean cosine over segments
    if (instr.source == "clip") if negate is None else negate:
        r = -r
    low, high = r.amin(dim=1, keepdim=True), r.amax(dim=1, keepdim=True)
    spread = high - low
    r = torch.where(spread > 0, (r - low + RELEVANCE_EPS) / spread.clamp_min(torch.finfo(r.dtype).tiny),
                    torch.ones_like(r))  # all equal: uniform relevance
    if theta is not None:
        r = torch.exp(theta / (2 * (1 - theta)) * (r - r.amax(dim=1, keepdim=True)))  # the largest weight 1
    return r


def _check(opts: dict, budget: int | None = None) -> None:
    theta, negate = opts["theta"], opts["negate"]
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 <= theta < 1):
        raise ValueError(f"option 'theta' of cdpruner must be None or a number in [0, 1), got {theta!r}")
    if negate is not None and not isinstance(negate, bool):
        raise ValueError(f"option 'negate' of cdpruner must be None (per text source) or true/false, got {negate!r}")


@register_method("cdpruner", options={"text_source": "released", "theta": None, "negate": None},
                 choices={"text_source": TEXT_SOURCES}, check=_check, needs_instruction=True)
def cdpruner(tokens: TokenSet, budget: int, *, text_source: str, theta: float | None,
             negate: bool | None) -> Selection:
    """CDPruner: greedy DPP MAP on the kernel r_i cos_ij r_j, r = relevance to the instruction.

    ``text_source`` is read by the model adapters, which build the :class:`Instruction`; ``negate`` None: negate
    the cosine for CLIP embeddings (released), not for LLM embeddings; ``theta`` None: the released kernel.
    """
    r = relevance(tokens, negate, theta)  # [B, N]
    kernel = r[:, :, None] * tokens.cosine * r[:, None, :]  # [B, N, N]
    every = torch.ones(tokens.batch, tokens.n, dtype=torch.bool, device=tokens.x.device)
    counts = torch.full((tokens.batch,), budget, dtype=torch.long, device=tokens.x.device)
    picks = dpp_greedy(kernel, every, counts, steps=budget)  # the host knows the width: no read of the counts
    zeros = torch.zeros(tokens.batch, dtype=torch.long, device=picks.device)
    return Selection(picks, zeros, None, None, torch.zeros_like(picks, dtype=torch.bool))
