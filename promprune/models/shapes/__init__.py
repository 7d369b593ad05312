"""The published shapes without their weights: random-weight VLMs at the released checkpoints' sizes.

``shape_vlm(name)`` builds a checkpoint's architecture from the sizes in this folder's JSON file ``<name>.json`` (copied
from the checkpoint's ``config.json``; each file's ``_source`` says where from) with random weights, and an offline
processor with the checkpoint's image settings: the JSON's ``model_type`` names the registered family
(:mod:`promprune.models.registry`) whose ``shape`` factory builds the config and processor (LLaVA-1.5-7B, LLaVA-NeXT-7B
(Vicuna), Qwen2.5-VL-7B, Qwen3-VL-8B, LLaVA-OneVision-7B, InternVL3-8B, InternVL3.5-8B, Qwen3.5-4B, Gemma 4 31B and
E2B, ...: :func:`shapes` lists them). Latency, memory, FLOPs and token counts do not depend on weight values, so these
stand in for the checkpoints wherever those cannot be downloaded (``PrunedVLM.from_pretrained("shape:llava_next_7b")``).
The text is byte-level tokenized (one token per byte), so a prompt has more text tokens than under the real tokenizer;
the vocabulary size, and so the embedding and LM-head shapes, stay the published ones.

``text_layers`` / ``vision_layers`` shorten the stacks at full width (tests build one or two layers on CPU; a family
may keep more of its structure, e.g. a shortened Gemma 4 keeps the first layers' types, its last layer full attention,
and no KV sharing); ``width_divisor`` narrows both towers by one factor (hidden and MLP widths, attention heads; the
head width stays), so that a CPU can run a LLaVA-1.5 whose towers are shrunk alike (benchmarks/throughput.py: 1/8 of
the layers and 1/4 of the widths, the vision-to-LLM cost ratio near the 7B's).
"""
from __future__ import annotations

import json
from importlib import resources

import torch

from promprune.dtypes import AUTO, parse_dtype

from ...seeding import private_seed
from ..factories import place
from ..registry import check_builds_own, family

SEED = 0


def shapes() -> list[str]:
    """Names of the shipped shapes (the JSON files of this folder)."""
    return sorted(p.name.removesuffix(".json") for p in resources.files(__package__).iterdir()
                  if p.name.endswith(".json"))


def shape_spec(name: str) -> dict:
    """The published sizes of ``name`` as a dict (``model_type``, ``text_config``, ``vision_config``, ...)."""
    if name not in shapes():
        raise ValueError(f"unknown shape {name!r}; shipped shapes: {', '.join(shapes())}")
    return json.loads(resources.files(__package__).joinpath(f"{name}.json").read_text())


def section(spec: dict, name: str, layers: int | None, key: str = "num_hidden_layers", **extra) -> dict:
    """A copy of ``spec[name]`` (a sub-config) with ``extra`` over it, shrunk to ``layers`` when given (``key``: the
    field holding the layer count)."""
    out = dict(spec[name], **extra)
    if layers is not None:
        out[key] = layers
    return out


def _build(spec: dict, text_layers: int | None, vision_layers: int | None) -> tuple:
    """``(model class, config, processor)`` from the ``shape`` factory of the family ``spec["model_type"]`` names,
    checked to build that family's own config."""
    found = family(spec["model_type"])
    if found.shape is None:
        raise ValueError(f"model family {found.name!r} has no shape factory ({found.module})")
    built = found.shape(spec, text_layers, vision_layers)
    check_builds_own(found, built[1], "shape")
    return built


# the width fields of each tower's config that ``width_divisor`` divides (head_dim, where given, stays)
_WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "projection_dim",
           "out_hidden_size", "num_heads")


def narrowed(spec: dict, divisor: int) -> dict:
    """``spec`` with both towers' widths divided by ``divisor`` (each must divide evenly: heads stay whole)."""
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"width_divisor must be a positive int, got {divisor!r}")
    out = dict(spec)
    for tower in ("vision_config", "text_config"):
        section = dict(spec[tower])
        for key in _WIDTHS:
            if key in section:
                if section[key] % divisor:
                    raise ValueError(f"width_divisor {divisor} does not divide {tower}.{key} = {section[key]}")
                section[key] //= divisor
        out[tower] = section
    return out


def shape_vlm(name: str, *, dtype=torch.float16, device="cpu", text_layers: int | None = None,
              vision_layers: int | None = None, width_divisor: int = 1):
    """``(model, processor)``: ``name``'s published architecture with seeded random weights on ``device`` (the
    caller's random state is left as it was: :func:`promprune.seeding.private_seed`).

    The weights are created directly on ``device`` in ``dtype`` (a 7B model in fp16 needs ~14 GB there);
    ``device="meta"`` builds the module tree without memory (shapes, configs, placeholder counts).
    """
    spec = narrowed(shape_spec(name), width_divisor)
    model_cls, config, processor = _build(spec, text_layers, vision_layers)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with private_seed(SEED, device), torch.device(device):  # the caller's random state is left as it was
        model = model_cls._from_config(config, dtype=dtype)
    return model.eval(), processor


def load(name: str, *, dtype=None, device_map=None, attn_implementation=None, max_memory=None):
    """The ``shape:<name>`` model factory: random weights built directly on the device (fp16 unless ``dtype``
    says otherwise), with the paper's adapter options for that model. A device map over several GPUs ("balanced",
    ...: a model too big for one) builds it on the CPU and spreads it (:mod:`promprune.models.placement`)."""
    from ..placement import is_multi_gpu

    dtype = parse_dtype(dtype, allow_auto=True)
    device = device_map or "cpu"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    spread = is_multi_gpu(device)
    model, processor = shape_vlm(name, dtype=torch.float16 if dtype in (None, AUTO) else dtype,
                                 device="cpu" if spread else device)
    model = place(model, attn_implementation=attn_implementation, device_map=device if spread else None,
                  max_memory=max_memory)
    return model, processor, default_options(name)


def _config(name: str):
    spec = shape_spec(name)
    return _build(spec, None, None)[1]


load.config = _config


def default_options(name: str) -> dict:
    """Adapter options the paper used with this shape (Qwen2.5-VL: a fixed 1296-token grid; Qwen3-VL and Qwen3.5: the
    same, our choice)."""
    spec = shape_spec(name)
    return {"image_tokens": spec["image_tokens"]} if "image_tokens" in spec else {}
