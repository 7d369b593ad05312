"""``tiny-easyvqa:llava``: the tiny LLaVA of :mod:`promprune.models.tiny`, trained on easy-vqa's TRAIN split.

The random-weight ``tiny:llava`` answers garbage, so every score of the offline quickstart is 0 and Rel. is undefined.
This module trains the same architecture and processor (whole model, AdamW, CPU, seeded) with teacher forcing on
the train split of the ``easy-vqa`` package (the offline eval tasks use its test split: no leakage). Prompts are
built exactly as :meth:`PrunedVLM.generate` builds them (``PrunedVLM.inputs``: the processor's chat template, all
36 visual tokens) with the easy-vqa task's prompt suffix; the loss covers only the answer tokens and EOS.

``load_or_train()`` trains once (about a minute or two on 2 cores) into ``$PROMPRUNE_CACHE/tiny-easyvqa-llava-v1``
(``save_pretrained``; a file lock and an atomic rename keep concurrent processes, e.g. Ray actors, from training
twice or reading half a checkpoint) and loads from there afterwards.
"""
from __future__ import annotations

import copy
import logging
import random
import time
from pathlib import Path

from promprune.env import cache_dir
from promprune.models import PrunedVLM
from promprune.models.factories import place
from promprune.models.tiny import tiny_vlm
from promprune.seeding import private_seed
from promprune.training import common

log = logging.getLogger(__name__)

ARCH = "llava"
CACHE_NAME = "tiny-easyvqa-llava-v1"  # bump the suffix when the recipe changes, so stale caches are not reused
# The suffix of the offline easy-vqa task's prompt (lmms_tasks/easyvqa/_easyvqa_common_yaml, post_prompt)
POST_PROMPT = "\nAnswer the question using a single word or phrase."
SEED = 0
STEPS = 600
BATCH_SIZE = 32
LR = 3e-3


def load(arch: str, *, dtype=None, device_map=None, attn_implementation=None):
    """The ``tiny-easyvqa:<arch>`` model factory (only ``llava`` is trained): loaded from the cache, trained into it
    on first use."""
    if arch != ARCH:
        raise ValueError(f"unknown tiny-easyvqa arch {arch!r}; valid: {ARCH}")
    model, processor = load_or_train()
    return place(model, dtype=dtype, device_map=device_map, attn_implementation=attn_implementation), processor, {}


def _config(arch: str):
    if arch != ARCH:
        raise ValueError(f"unknown tiny-easyvqa arch {arch!r}; valid: {ARCH}")
    return tiny_vlm(ARCH)[0].config  # the trained model keeps the tiny LLaVA's config


load.config = _config
load.prepare = lambda arch: load_or_train() if arch == ARCH else _config(arch)  # first use: train, in the caller


def cache_path() -> Path:
    return cache_dir() / CACHE_NAME


def _train_examples():
    """(image path, prompt, answer) of every easy-vqa train question, in the package's order."""
    import easy_vqa

    texts, answers, image_ids = easy_vqa.get_train_questions()
    paths = easy_vqa.get_train_image_paths()
    return [(paths[i], f"{q.strip()}{POST_PROMPT}", a.strip().lower()) for q, a, i in zip(texts, answers, image_ids)]


def _batch(vlm, examples):
    from PIL import Image

    images = [Image.open(p).convert("RGB") for p, _, _ in examples]
    return common.teacher_forcing(vlm, images, [prompt for _, prompt, _ in examples], [a for _, _, a in examples])


def train(steps: int = STEPS, *, batch_size: int = BATCH_SIZE, lr: float = LR, seed: int = SEED,
          threads: int | None = None, progress: bool = True):
    """Train a fresh copy of the tiny LLaVA on easy-vqa train; returns ``(model, processor, losses)``.

    Deterministic for a given ``(steps, batch_size, lr, seed)``: seeded shuffling and initialisation, CPU only; the
    caller's torch random state is left as it was (:func:`promprune.seeding.private_seed`).
    ``threads``: torch threads while training (default: the CPUs this process may use), restored afterwards.
    """

    base_model, base_processor = tiny_vlm(ARCH)
    model, processor = copy.deepcopy(base_model), copy.deepcopy(base_processor)
    vlm = PrunedVLM(model, processor, method=None)
    examples = _train_examples()
    order = list(range(len(examples)))
    rng = random.Random(seed)
    rng.shuffle(order)

    bar, cursor, t0 = None, 0, time.perf_counter()
    with private_seed(seed), common.torch_threads(threads):
        params = list(model.parameters())
        opt, schedule = common.optimizer(params, steps, lr)
        bar = common.Progress(steps, f"training {CACHE_NAME} (once)", progress)
        model.train()
        try:
            for step in range(steps):
                if cursor + batch_size > len(order):
                    rng.shuffle(order)
                    cursor = 0
                chunk = [examples[i] for i in order[cursor:cursor + batch_size]]
                cursor += batch_size
                kwargs, labels = _batch(vlm, chunk)
                bar.update(step, common.step(common.lm_loss(model(**kwargs).logits, labels), params, opt, schedule))
        finally:
            bar.close()
            model.eval()
    losses = bar.losses
    log.info("trained %s: %d steps in %.0f s, loss %.3f -> %.3f", CACHE_NAME, steps, time.perf_counter() - t0,
             losses[0] if losses else float("nan"), losses[-1] if losses else float("nan"))
    return model, processor, losses


def load_or_train(directory: str | Path | None = None, **train_kwargs):
    """``(model, processor)`` of ``tiny-easyvqa:llava``: loaded from ``directory`` (default :func:`cache_path`),
    trained into it first when it is missing. ``train_kwargs`` go to :func:`train` (tests: few ``steps``)."""
    directory = Path(directory) if directory is not None else cache_path()
    model = common.load_trained(directory, lambda: train(**train_kwargs)[:2],
                                "tiny-easyvqa:llava on easy-vqa train (~3 min on 2 CPU cores)")
    # the processor is the code-built offline one (what was saved beside the weights is for inspection)
    processor = copy.deepcopy(tiny_vlm(ARCH)[1])
    return model, processor
