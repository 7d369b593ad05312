"""``tiny-easyvqa:llava``: the tiny LLaVA of :mod:`promprune.models.testing`, trained on easy-vqa's TRAIN split.

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

import contextlib
import copy
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import LlavaForConditionalGeneration

from promprune.eval.tasks import cache_dir
from promprune.models import PrunedVLM
from promprune.models.factories import place
from promprune.models.testing import tiny_vlm

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


def _threads() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


def _train_examples():
    """(image path, prompt, answer) of every easy-vqa train question, in the package's order."""
    import easy_vqa

    texts, answers, image_ids = easy_vqa.get_train_questions()
    paths = easy_vqa.get_train_image_paths()
    return [(paths[i], f"{q.strip()}{POST_PROMPT}", a.strip().lower()) for q, a, i in zip(texts, answers, image_ids)]


def _batch(vlm, examples):
    """Teacher-forcing batch: ``PrunedVLM.inputs`` (left-padded prompts) + answer + EOS, right-padded.

    Returns model kwargs (with the positions ``generate`` derives from the attention mask) and the labels.
    """
    from PIL import Image

    tok = vlm.processor.tokenizer
    images = [Image.open(p).convert("RGB") for p, _, _ in examples]
    batch = vlm.inputs(images, [prompt for _, prompt, _ in examples])
    answers = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, _, a in examples]
    width = max(len(a) for a in answers)
    n = len(examples)
    tail = torch.full((n, width), tok.pad_token_id, dtype=torch.long)
    tail_mask = torch.zeros((n, width), dtype=torch.long)
    for row, ids in enumerate(answers):
        tail[row, :len(ids)] = torch.tensor(ids)
        tail_mask[row, :len(ids)] = 1
    ids = torch.cat([batch["input_ids"], tail], dim=1)
    mask = torch.cat([batch["attention_mask"], tail_mask], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, batch["input_ids"].shape[1]:] = torch.where(tail_mask.bool(), tail, -100)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids, pixel_values=batch["pixel_values"])
    return kwargs, labels


def _loss(model, kwargs, labels):
    logits = model(**kwargs).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def train(steps: int = STEPS, *, batch_size: int = BATCH_SIZE, lr: float = LR, seed: int = SEED,
          threads: int | None = None, progress: bool = True):
    """Train a fresh copy of the tiny LLaVA on easy-vqa train; returns ``(model, processor, losses)``.

    Deterministic for a given ``(steps, batch_size, lr, seed)``: seeded shuffling and initialisation, CPU only.
    ``threads``: torch threads while training (default: the CPUs this process may use), restored afterwards.
    """

    base_model, base_processor = tiny_vlm(ARCH)
    model, processor = copy.deepcopy(base_model), copy.deepcopy(base_processor)
    vlm = PrunedVLM(model, processor, method=None)
    examples = _train_examples()
    order = list(range(len(examples)))
    rng = random.Random(seed)
    rng.shuffle(order)
    torch.manual_seed(seed)

    before = torch.get_num_threads()
    torch.set_num_threads(threads or _threads())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(steps - warmup, 1))))
    bar, every = _progress(steps, progress), max(steps // 20, 1)
    losses, cursor, t0 = [], 0, time.perf_counter()
    model.train()
    try:
        for step in range(steps):
            if cursor + batch_size > len(order):
                rng.shuffle(order)
                cursor = 0
            chunk = [examples[i] for i in order[cursor:cursor + batch_size]]
            cursor += batch_size
            kwargs, labels = _batch(vlm, chunk)
            loss = _loss(model, kwargs, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if (step + 1) % every == 0 or step + 1 == steps:  # ~20 refreshes: Ray logs print each one as a line
                bar.set_postfix(loss=f"{sum(losses[-every:]) / len(losses[-every:]):.3f}", refresh=False)
                bar.update(step + 1 - bar.n)
    finally:
        bar.close()
        torch.set_num_threads(before)
        model.eval()
    log.info("trained %s: %d steps in %.0f s, loss %.3f -> %.3f", CACHE_NAME, steps, time.perf_counter() - t0,
             losses[0] if losses else float("nan"), losses[-1] if losses else float("nan"))
    return model, processor, losses


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"training {CACHE_NAME} (once)", disable=not enabled, mininterval=0)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; other platforms: no lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _complete(directory: Path) -> bool:
    return (directory / "config.json").exists() and any(directory.glob("model*.safetensors"))


def load_or_train(directory: str | Path | None = None, **train_kwargs):
    """``(model, processor)`` of ``tiny-easyvqa:llava``: loaded from ``directory`` (default :func:`cache_path`),
    trained into it first when it is missing. ``train_kwargs`` go to :func:`train` (tests: few ``steps``)."""
    directory = Path(directory) if directory is not None else cache_path()
    if not _complete(directory):
        with _locked(directory.with_name(f".{directory.name}.lock")):
            if not _complete(directory):  # another process may have finished while we waited
                log.warning("%s not found: training it on easy-vqa train (once, ~3 min on 2 CPU cores)", directory)
                model, processor, _ = train(**train_kwargs)
                tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                model.save_pretrained(tmp)
                processor.save_pretrained(tmp)
                shutil.rmtree(directory, ignore_errors=True)  # an incomplete leftover, never a finished one
                os.replace(tmp, directory)
    model = LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    # the processor is the code-built offline one (what was saved beside the weights is for inspection)
    processor = copy.deepcopy(tiny_vlm(ARCH)[1])
    return model, processor
