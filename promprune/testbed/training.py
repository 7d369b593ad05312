"""``testbed:llava``: the testbed VLM (:mod:`promprune.testbed.model`) trained on the testbed's TRAIN scenes.

Every step draws fresh scenes from the train seed stream (an endless, deterministic supply; the evaluation tasks
use the test stream) and one question each, of a family drawn with fixed weights. Two stages, as LLaVA is built on
a pretrained CLIP tower:

1. The vision tower alone, on the objectives that stand in for the pretraining a real CLIP tower comes with: each
   patch token of the layer LLaVA reads predicts the object kind under it (or background), and the CLS token after
   the last layer predicts which kinds are present and how many objects there are (which is what makes CLS
   attention, the methods' saliency, pick out objects). The heads are discarded afterwards.
2. The tower frozen (LLaVA-1.5's recipe), the projector and the LLM on the questions: the LM loss on the answer
   tokens and EOS, prompts built exactly as :meth:`PrunedVLM.generate` builds them.

What it learns in this budget (docs/testbed.md): counting, well; the existence, attribute and relation
questions stay at chance (it answers every yes/no question "yes"): binding a question's words to the visual tokens
takes a model this small far more steps than 2 CPU cores give in minutes (also tried: the question before the image
as well, and grounding supervision of the visual tokens; neither moved them in 1,200 steps; nor did aligning the
projector to the colour and shape words first, a few-objects-first curriculum, or supervising LLM attention onto the
objects a question names: docs/testbed.md).

One torch thread by default: CPU results depend on the thread count, and one thread gives every machine the same
weights (12-14 minutes measured on a 2-core machine). Trained once into ``$PROMPRUNE_CACHE/testbed-llava-v1``,
loaded from there afterwards.
"""
from __future__ import annotations

import copy
import logging
import random
import time
from pathlib import Path

import torch

from promprune.eval.tasks import cache_dir
from promprune.models import PrunedVLM
from promprune.models.factories import place
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes
from promprune.training import common

log = logging.getLogger(__name__)

ARCH = "llava"
CACHE_NAME = "testbed-llava-v1"  # bump the suffix when the recipe changes, so stale caches are not reused
SEED = 0
VISION_STEPS = 500
VISION_BATCH_SIZE = 32
STEPS = 1200
BATCH_SIZE = 24
LR = 2e-3
THREADS = 1  # torch threads while training: the same weights on every machine
# the prompt suffix per question family (the testbed's lmms-eval tasks use the same)
POST_PROMPTS = {"exist": "\nAnswer with yes or no.", "relation": "\nAnswer with yes or no.",
                "count": "\nAnswer with a number.", "attribute": "\nAnswer with one word."}
FAMILY_WEIGHTS = {"exist": 0.25, "count": 0.3, "attribute": 0.25, "relation": 0.2}
GRID = testbed_model.IMAGE_SIZE // testbed_model.PATCH  # 12 patches per side


def load(arch: str, *, dtype=None, device_map=None, attn_implementation=None):
    """The ``testbed:<arch>`` model factory (only ``llava``): loaded from the cache, trained into it on first use."""
    _check(arch)
    model, processor = load_or_train()
    return place(model, dtype=dtype, device_map=device_map, attn_implementation=attn_implementation), processor, {}


def _check(arch: str) -> None:
    if arch != ARCH:
        raise ValueError(f"unknown testbed arch {arch!r}; valid: {ARCH}")


def _config(arch: str):
    _check(arch)
    return testbed_model.config()


load.config = _config
load.prepare = lambda arch: (_check(arch), load_or_train())  # first use: train, in the caller


def cache_path() -> Path:
    return cache_dir() / CACHE_NAME


def example(index: int, rng: random.Random):
    """Train example ``index``: (scene, question), the family drawn from FAMILY_WEIGHTS (deterministic)."""
    scene = scenes.make_scene("train", index)
    families = list(FAMILY_WEIGHTS)
    for family in rng.choices(families, [FAMILY_WEIGHTS[f] for f in families], k=4) + ["count"]:
        found = scenes.questions(scene, family)
        if found:  # attribute / relation may have nothing to ask about a scene
            return scene, rng.choice(found)
    raise AssertionError("unreachable: count always asks")


def object_patches(obj: scenes.Obj) -> list[int]:
    """Raster indices of the patches whose centre lies inside the object's box."""
    cx, cy = obj.center
    h, step = scenes.extent(obj) / 2, testbed_model.PATCH
    return [r * GRID + c for r in range(GRID) for c in range(GRID)
            if abs(c * step + step / 2 - cx) <= h and abs(r * step + step / 2 - cy) <= h]


def patch_labels(scene: scenes.Scene) -> torch.Tensor:
    """[GRID*GRID] object kind under each patch centre (1 + index in KINDS), 0 for background."""
    labels = torch.zeros(GRID * GRID, dtype=torch.long)
    for obj in scene.objects:
        labels[object_patches(obj)] = 1 + scenes.KINDS.index((obj.color, obj.shape))
    return labels


class AuxHeads(torch.nn.Module):
    """The vision tower's training objectives: patch -> kind, CLS -> kinds present + object count."""

    def __init__(self, width: int):
        super().__init__()
        self.patch = torch.nn.Linear(width, 1 + len(scenes.KINDS))
        self.cls = torch.nn.Sequential(torch.nn.LayerNorm(width),
                                       torch.nn.Linear(width, len(scenes.KINDS) + scenes.MAX_OBJECTS))

    def loss(self, vision_out, batch_scenes) -> torch.Tensor:
        patches = vision_out.hidden_states[-2][:, 1:]  # the layer LLaVA reads, CLS dropped
        dense = torch.stack([patch_labels(s) for s in batch_scenes])
        loss = torch.nn.functional.cross_entropy(self.patch(patches).flatten(0, 1), dense.flatten())
        pooled = self.cls(vision_out.last_hidden_state[:, 0])  # the CLS token after the last layer
        present = torch.zeros(len(batch_scenes), len(scenes.KINDS))
        for row, s in enumerate(batch_scenes):
            for o in s.objects:
                present[row, scenes.KINDS.index((o.color, o.shape))] = 1.0
        count = torch.tensor([s.num_objects - 1 for s in batch_scenes])
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(pooled[:, :len(scenes.KINDS)], present)
        return loss + torch.nn.functional.cross_entropy(pooled[:, len(scenes.KINDS):], count)


def _prompts(drawn) -> tuple[list, list, list]:
    return ([scenes.render(s) for s, _ in drawn], [f"{q.question}{POST_PROMPTS[q.family]}" for _, q in drawn],
            [q.answer for _, q in drawn])


def train(steps: int = STEPS, *, vision_steps: int = VISION_STEPS, batch_size: int = BATCH_SIZE,
          vision_batch_size: int = VISION_BATCH_SIZE, lr: float = LR, seed: int = SEED, threads: int | None = THREADS,
          progress: bool = True):
    """Train a fresh testbed VLM; returns ``(model, processor, losses)``. Deterministic for given arguments (CPU).

    Two stages, as LLaVA is built on a pretrained CLIP: ``vision_steps`` train the vision tower alone on its own
    objectives (:class:`AuxHeads`), then ``steps`` train the projector and the LLM on the questions with the tower
    frozen (LLaVA-1.5's recipe). ``losses``: one per step of both stages.
    """
    model, processor = testbed_model.untrained()
    vlm = PrunedVLM(model, processor, method=None)
    tower = model.model.vision_tower
    heads = AuxHeads(model.config.vision_config.hidden_size)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    bar = common.Progress(vision_steps + steps, f"training {CACHE_NAME} (once)", progress)
    with common.torch_threads(threads):
        try:
            # stage 1: the vision tower (what a pretrained CLIP would bring)
            params = list(tower.parameters()) + list(heads.parameters())
            opt, schedule = common.optimizer(params, vision_steps, lr)
            tower.train()
            for step in range(vision_steps):
                drawn = [example(step * vision_batch_size + i, rng) for i in range(vision_batch_size)]
                pixels = processor.image_processor([scenes.render(s) for s, _ in drawn], return_tensors="pt")
                out = tower(pixels["pixel_values"], output_hidden_states=True)
                bar.update(step, common.step(heads.loss(out, [s for s, _ in drawn]), params, opt, schedule))
            # stage 2: projector + LLM on the questions, the tower frozen
            tower.eval().requires_grad_(False)
            params = [p for p in model.parameters() if p.requires_grad]
            opt, schedule = common.optimizer(params, steps, lr)
            model.train()
            offset = vision_steps * vision_batch_size
            for step in range(steps):
                drawn = [example(offset + step * batch_size + i, rng) for i in range(batch_size)]
                kwargs, labels = common.teacher_forcing(vlm, *_prompts(drawn))
                loss = common.lm_loss(model(**kwargs).logits, labels)
                bar.update(vision_steps + step, common.step(loss, params, opt, schedule))
        finally:
            bar.close()
            model.eval().requires_grad_(True)
    losses = bar.losses
    log.info("trained %s: %d + %d steps in %.0f s, loss %.3f -> %.3f", CACHE_NAME, vision_steps, steps,
             time.perf_counter() - t0, losses[vision_steps] if len(losses) > vision_steps else float("nan"),
             losses[-1] if losses else float("nan"))
    return model, processor, losses


def load_or_train(directory: str | Path | None = None, **train_kwargs):
    """``(model, processor)`` of ``testbed:llava``: loaded from ``directory`` (default :func:`cache_path`),
    trained into it first when it is missing. ``train_kwargs`` go to :func:`train` (tests: few ``steps``)."""
    directory = Path(directory) if directory is not None else cache_path()
    model = common.load_trained(directory, lambda: train(**train_kwargs)[:2],
                                "testbed:llava on testbed train scenes (12-14 min on 2 CPU cores)")
    return model, copy.deepcopy(testbed_model.untrained()[1])
