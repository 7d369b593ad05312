"""Fixtures for the model-adapter tests: tiny offline models, two differently sized images."""
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from promprune.models.tiny import archs  # noqa: E402 - after the offline switch

ARCHS = tuple(archs())  # every registered family with a tiny model: a new family is tested by every ARCHS test


@pytest.fixture(autouse=True)
def _one_thread():
    """Other engineers share the 2 cores; tiny models do not need more than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_image(height: int, width: int, seed: int) -> Image.Image:
    """Smooth random colour field (not pure noise, so features have structure)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BILINEAR)


@pytest.fixture
def images():
    """A landscape and a portrait image: different anyres grids (NeXT) and token counts (Qwen)."""
    return [make_image(40, 56, 0), make_image(64, 30, 1)]


@pytest.fixture
def prompts():
    return ["What is in the picture?", "Colour?"]


def kept_per_view(stats: dict, tokens_per_view: int, views: int) -> list[int]:
    """How many of a sample's kept grid indices fall in each view (views of ``tokens_per_view`` tokens, in order)."""
    return torch.bincount(torch.tensor(stats["kept"]) // tokens_per_view, minlength=views).tolist()


def processor_images(model, images):
    """The images as the model's processor takes a batch of one-image prompts: Gemma 4's processor one list per prompt
    (as transformers documents it), the others a flat list."""
    return [[image] for image in images] if model.config.model_type == "gemma4" else images


def plain_generate(model, processor, images, prompts, new_tokens: int):
    """Reference: the processor and model.generate exactly as transformers' docs use them."""
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": p}]}],
                                           add_generation_prompt=True, tokenize=False) for p in prompts]
    processor.tokenizer.padding_side = "left"
    inputs = processor(images=processor_images(model, images), text=texts, return_tensors="pt",
                       padding=True).to(model.device)
    if inputs["pixel_values"].is_floating_point():
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[:, inputs["input_ids"].shape[1]:].tolist(), inputs


def sdpa_keys(model, layer: int, model_kwargs: dict) -> torch.Tensor:
    """The keys ``[B, Hkv, L, hd]`` that decoder layer ``layer``'s attention of a copy of ``model`` hands its kernel
    in one plain (unpruned, SDPA) forward on ``model_kwargs``: the model's own keys, after its norms and rotary
    embedding."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    twin = copy.deepcopy(model)
    target = twin.model.language_model.layers[layer].self_attn
    keys = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        if module is target:
            keys.append(key)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("recording_keys", recording)
    AttentionMaskInterface.register("recording_keys", sdpa_mask)
    twin.model.language_model.config._attn_implementation = "recording_keys"
    with torch.inference_mode():
        twin(**model_kwargs)
    return keys[0]


def lm_inputs(model, kwargs):
    """The language model's inputs (embeddings with the image features in) of a plain forward."""
    seen = {}
    lm = model.model.language_model
    handle = lm.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.inference_mode():
            model(**kwargs)
    finally:
        handle.remove()
    return seen


def naive_greedy(model, embeds, pos3, segments, steps):
    """Greedy decoding without a cache: each step re-runs the whole sequence; decoder layers ``[lo, hi)`` of a segment
    see only its prompt columns ``cols`` (ascending) and every generated token, with their own positions (``pos3
    [3, P]``: M-RoPE's; ``[1, P]``: a 1D RoPE's), a generated token's one past the prompt's largest. ``embeds [P, D]``:
    the LLM's input embeddings of one row's prompt (no padding). Returns the logits of each step ``[steps, V]``."""
    lm = model.model.language_model
    embed = model.get_input_embeddings()
    gen, logits = [], []
    P, top = embeds.shape[0], int(pos3.max())
    for _ in range(steps):
        h = torch.cat([embeds, embed(torch.tensor(gen, dtype=torch.long))])
        pos = torch.cat([pos3, (top + 1 + torch.arange(len(gen)))[None].expand(pos3.shape[0], -1)], dim=1)
        cur = torch.arange(P + len(gen))
        for lo, hi, cols in segments:
            keep = torch.cat([cols, torch.arange(P, P + len(gen))])
            h, cur = h[torch.searchsorted(cur, keep)], keep
            x = h[None]
            rope = lm.rotary_emb(x, pos[:, cur][:, None] if pos.shape[0] > 1 else pos[:, cur])  # [3, 1, L] or [1, L]
            for layer in lm.layers[lo:hi]:
                x = layer(x, position_embeddings=rope, attention_mask=None, position_ids=None)  # no cache
            h = x[0]
        logits.append(model.lm_head(lm.norm(h[-1:]))[0])
        gen.append(int(logits[-1].argmax()))
    return torch.stack(logits)
