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
