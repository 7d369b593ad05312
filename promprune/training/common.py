"""What every trained offline model shares: teacher-forcing batches built the way ``PrunedVLM.generate`` prompts,
the answer-only LM loss, the optimiser and schedule, a progress bar, and a once-only, process-safe cache.

A cached model is trained once into a directory under ``$PROMPRUNE_CACHE``: a file lock keeps concurrent processes
(Ray actors, two sweeps started at once) from training twice, a process that finds it held says once that it waits
for the other's training, and an atomic rename keeps them from reading half a checkpoint.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from promprune.atomic import atomic_path, locked

log = logging.getLogger(__name__)


def threads() -> int:
    """The CPUs this process may use."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run with ``n`` torch threads (default :func:`threads`), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def teacher_forcing(vlm, images, prompts, answers):
    """Teacher-forcing batch: ``PrunedVLM.inputs`` (left-padded prompts) + answer + EOS, right-padded.

    Returns model kwargs (with the positions ``generate`` derives from the attention mask) and the labels (-100
    everywhere but the answer tokens and EOS).
    """
    tok = vlm.processor.tokenizer
    batch = vlm.inputs(list(images), list(prompts))
    answers = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    width = max(len(a) for a in answers)
    n = len(answers)
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


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over the labelled positions."""
    logits = logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def optimizer(params, steps: int, lr: float):
    """AdamW with a linear warm-up over 5% of the steps and a linear decay to 0."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(steps - warmup, 1))))
    return opt, schedule


def step(loss: torch.Tensor, params, opt, schedule) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    schedule.step()
    return loss.item()


class Progress:
    """One tqdm bar for a training run, refreshed about 20 times (Ray logs print each refresh as a line)."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, disable=not enabled, mininterval=0)
        self.every, self.total, self.losses = max(total // 20, 1), total, []

    def update(self, step_index: int, loss: float) -> None:
        self.losses.append(loss)
        if (step_index + 1) % self.every == 0 or step_index + 1 == self.total:
            recent = self.losses[-self.every:]
            self.bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", refresh=False)
            self.bar.update(step_index + 1 - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def complete(directory: Path) -> bool:
    return (directory / "config.json").exists() and any(directory.glob("model*.safetensors"))


def load_trained(directory: Path, train: Callable[[], tuple], what: str):
    """The ``LlavaForConditionalGeneration`` cached in ``directory`` (float32, eval), trained into it first by
    :func:`train_once` when it is missing."""
    from transformers import LlavaForConditionalGeneration

    train_once(directory, train, what)
    return LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()


def train_once(directory: Path, train: Callable[[], tuple], what: str) -> None:
    """Make sure ``directory`` holds a finished checkpoint: ``train()`` -> ``(model, processor)`` saved into it once.

    Concurrent callers wait for the one that trains, saying so once (a second sweep started beside the first waited
    minutes without a line); a leftover half-written directory is replaced.
    """
    from filelock import Timeout

    directory = Path(directory)
    if complete(directory):
        return
    lock = locked(directory.with_name(f".{directory.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("%s is being trained by another process (its lock %s is held): waiting for it to finish, then "
                    "loading it", what, lock.lock_file)
        lock.acquire()
    try:
        if complete(directory):  # another process finished while we waited
            return
        log.warning("%s not found: training %s (once)", directory, what)
        model, processor = train()
        with atomic_path(directory) as tmp:  # replaces an incomplete leftover, never a finished one
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
    finally:
        lock.release()
