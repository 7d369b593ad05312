"""``testbed:llava``'s recipe: the testbed VLM (:mod:`promprune.testbed.model`) trained on the testbed's TRAIN scenes.

The result is shipped (:mod:`promprune.testbed.shipped`, ``promprune/testbed/weights/``): ``testbed:llava`` loads it
and trains nothing. ``python -m promprune.testbed.shipped --out DIR`` (or ``--retrain``, into the cache) runs this
recipe; ``$PROMPRUNE_TESTBED_RETRAIN=1`` makes ``testbed:llava`` use the recipe's cache instead of the shipped file.

Every step draws fresh scenes from the train seed stream (an endless, deterministic supply; the evaluation tasks
use the test stream) and one question each, the four families evenly. Recipe v2, three stages, as LLaVA is built on
a pretrained CLIP tower:

1. The vision tower alone, on objectives that stand in for the pretraining a real CLIP tower comes with: each patch
   token of the layer LLaVA reads predicts the object kind under it (local) and the whole scene (the kinds present,
   the count, each region's lone object, each kind's centre: context from the whole image, as CLIP's tokens carry);
   the CLS token after the last layer predicts the kinds present and the count (which is what makes CLS attention,
   the methods' saliency, pick out objects). The heads are discarded afterwards.
2. LLaVA's alignment stage in small: the projector alone maps each object patch towards the LLM's word embeddings
   of its colour and shape.
3. The tower frozen (LLaVA-1.5's recipe), the projector and the LLM on the questions: the LM loss on the answer
   tokens and EOS, prompts built exactly as :meth:`PrunedVLM.generate` builds them; the first quarter of the steps
   on scenes of 1-4 objects (a curriculum).

``turns`` and ``scene_targets`` (``python -m promprune.testbed.shipped --turns 8 --scene-targets present,count
--vision-steps 2400 --steps 3000``) reproduce the v3 candidate: multi-turn supervision, a tower trained on fewer scene
targets; measured and not shipped (docs/testbed.md).

v1 (500 + 1,200 steps, local patch targets only) learned to count, by the share of object tokens, and nothing else
(docs/testbed.md). One torch thread: the same weights on machines of one CPU type (not across CPU types).
"""
from __future__ import annotations

import functools
import logging
import random
import time
from pathlib import Path

import torch

from promprune.eval.tasks import cache_dir
from promprune.models import PrunedVLM
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes
from promprune.training import common

log = logging.getLogger(__name__)

ARCH = "llava"
RECIPE = "v2"  # bump when the recipe changes: the cache directory and the shipped manifest carry it
CACHE_NAME = f"testbed-llava-{RECIPE}"  # so a stale cache is never reused
SEED = 0
VISION_STEPS = 1000
VISION_BATCH_SIZE = 32
ALIGN_STEPS = 200
STEPS = 5000
BATCH_SIZE = 16
CURRICULUM = 0.25  # share of the LLM steps on scenes of 1-4 objects
LR = 2e-3
THREADS = 1  # torch threads while training: the same weights on every machine
# the prompt suffix per question family (the testbed's lmms-eval tasks use the same)
POST_PROMPTS = {"exist": "\nAnswer with yes or no.", "relation": "\nAnswer with yes or no.",
                "count": "\nAnswer with a number.", "attribute": "\nAnswer with one word."}
FAMILY_WEIGHTS = {"exist": 0.25, "count": 0.25, "attribute": 0.25, "relation": 0.25}  # v2: evenly
TURNS = 1  # questions per scene in one training sequence (> 1: a multi-turn conversation; tried for v3, not shipped)
# what every patch token is trained to carry about the whole scene (v2: all five; the v3 candidate: present, count)
SCENE_TARGETS = ("present", "count", "region_color", "region_shape", "position")
GRID = testbed_model.IMAGE_SIZE // testbed_model.PATCH  # 12 patches per side


def check_arch(arch: str) -> None:
    if arch != ARCH:
        raise ValueError(f"unknown testbed arch {arch!r}; valid: {ARCH}")


def cache_path() -> Path:
    return cache_dir() / CACHE_NAME


def train_scene(index: int, max_objects: int | None = None) -> scenes.Scene:
    """Train scene ``index``; ``max_objects``: the curriculum's bound (it then holds 1 + index % max_objects)."""
    return scenes.make_scene("train", index, num_objects=None if max_objects is None else 1 + index % max_objects)


def example(index: int, rng: random.Random, max_objects: int | None = None):
    """Train example ``index``: (:func:`train_scene`, question), the family drawn from FAMILY_WEIGHTS
    (deterministic)."""
    scene = train_scene(index, max_objects)
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


NONE = 0  # region target: no object, or several (the attribute questions ask only about regions holding one)


def scene_targets(scene: scenes.Scene) -> dict[str, torch.Tensor]:
    """What a patch token is trained to carry about the WHOLE scene (recipe v2): the kinds present, the object
    count, the colour and shape of the lone object of each 3x3 region, and each present kind's centre."""
    present = torch.zeros(len(scenes.KINDS))
    position = torch.zeros(len(scenes.KINDS), 2)  # (x, y) / canvas side; 0 where absent (masked by present)
    by_region: dict[str, list[scenes.Obj]] = {}
    for obj in scene.objects:
        kind = scenes.KINDS.index((obj.color, obj.shape))
        present[kind] = 1.0
        position[kind] = torch.tensor(obj.center) / scenes.CANVAS
        by_region.setdefault(obj.region, []).append(obj)
    colors, shapes = list(scenes.COLORS), list(scenes.SHAPES)
    region_color = torch.zeros(len(scenes.REGIONS), dtype=torch.long)
    region_shape = torch.zeros(len(scenes.REGIONS), dtype=torch.long)
    for r, name in enumerate(scenes.REGIONS):
        objs = by_region.get(name, [])
        if len(objs) == 1:
            region_color[r] = 1 + colors.index(objs[0].color)
            region_shape[r] = 1 + shapes.index(objs[0].shape)
    return {"present": present, "position": position, "count": torch.tensor(scene.num_objects - 1),
            "region_color": region_color, "region_shape": region_shape}


class AuxHeads(torch.nn.Module):
    """The vision tower's training objectives (what stands in for CLIP's pretraining).

    - every patch token of the layer LLaVA reads: the object kind under it (local), and the scene around it
      (:func:`scene_targets`: kinds present, count, each region's lone object, each kind's centre), as CLIP's
      tokens carry context from the whole image (recipe v2; v1 had only the local target);
    - the CLS token after the last layer: the kinds present and the count (what makes CLS attention, the methods'
      saliency, pick out objects).
    """

    def __init__(self, width: int, context: bool = True, targets=SCENE_TARGETS):
        super().__init__()
        k, n, regions = len(scenes.KINDS), scenes.MAX_OBJECTS, len(scenes.REGIONS)
        sizes = {"present": k, "count": n, "region_color": regions * (1 + len(scenes.COLORS)),
                 "region_shape": regions * (1 + len(scenes.SHAPES)), "position": 2 * k}
        if not {"present", "count"} <= set(targets) <= set(sizes):
            raise ValueError(f"scene targets {tuple(targets)}: need present and count, from {', '.join(sizes)}")
        self.sizes = {name: sizes[name] for name in sizes if name in targets}
        self.context = context
        self.patch = torch.nn.Linear(width, 1 + k)
        self.scene = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, sum(self.sizes.values())))
        self.cls = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, k + n))

    def _scene_loss(self, logits: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """logits [B, P, sum(sizes)] (P tokens each predicting its scene); targets batched per scene ([B, ...])."""
        f = torch.nn.functional
        parts = dict(zip(self.sizes, logits.split(list(self.sizes.values()), dim=-1)))
        b, p = logits.shape[:2]
        each = lambda t: t.unsqueeze(1).expand(b, p, *t.shape[1:])  # noqa: E731 - the scene target of every token
        present = each(targets["present"])
        loss = f.binary_cross_entropy_with_logits(parts["present"], present)
        loss = loss + f.cross_entropy(parts["count"].flatten(0, 1), each(targets["count"]).flatten())
        regions = len(scenes.REGIONS)
        for name in ("region_color", "region_shape"):
            if name in parts:
                loss = loss + f.cross_entropy(parts[name].reshape(b * p * regions, -1),
                                              each(targets[name]).flatten())
        if "position" in parts:
            error = (parts["position"].view(b, p, -1, 2) - each(targets["position"])).pow(2).sum(-1)  # [B, P, K]
            loss = loss + 20 * (error * present).sum() / present.sum().clamp(min=1)
        return loss

    def loss(self, vision_out, batch_scenes) -> torch.Tensor:
        f = torch.nn.functional
        patches = vision_out.hidden_states[-2][:, 1:]  # [B, 144, width] the layer LLaVA reads, CLS dropped
        dense = torch.stack([patch_labels(s) for s in batch_scenes])
        loss = f.cross_entropy(self.patch(patches).flatten(0, 1), dense.flatten())
        targets = {k: torch.stack([t[k] for t in map(scene_targets, batch_scenes)]) for k in self.sizes}
        if self.context:
            loss = loss + self._scene_loss(self.scene(patches), targets)
        pooled = self.cls(vision_out.last_hidden_state[:, 0])  # the CLS token after the last layer
        k = len(scenes.KINDS)
        loss = loss + f.binary_cross_entropy_with_logits(pooled[:, :k], targets["present"])
        return loss + f.cross_entropy(pooled[:, k:], targets["count"])


def _prompts(drawn) -> tuple[list, list, list]:
    return ([scenes.render(s) for s, _ in drawn], [f"{q.question}{POST_PROMPTS[q.family]}" for _, q in drawn],
            [q.answer for _, q in drawn])


def conversation(index: int, rng: random.Random, turns: int, max_objects: int | None = None):
    """Train scene ``index`` and ``turns`` questions about it, the families in turn (a family with nothing to ask
    about the scene asks a count), in a random order; ``max_objects`` as in :func:`train_scene`."""
    scene = train_scene(index, max_objects)
    families = list(FAMILY_WEIGHTS)
    asked = [rng.choice(scenes.questions(scene, families[t % len(families)]) or scenes.questions(scene, "count"))
             for t in range(turns)]
    rng.shuffle(asked)
    return scene, asked


def teacher_forcing_turns(vlm, drawn):
    """Teacher forcing over multi-turn conversations (recipe v3): row ``i`` is scene ``i``'s first question exactly as
    :meth:`PrunedVLM.generate` prompts it, its answer and EOS, then each further question as the chat template
    continues a conversation (``USER: q ASSISTANT:``) with its answer and EOS; every answer and EOS is labelled.
    Left-padded like the prompts, positions from the mask. ``drawn``: [(scene, [questions])]."""
    tok = vlm.processor.tokenizer
    first = [(s, qs[0]) for s, qs in drawn]
    kwargs, labels = common.teacher_forcing(vlm, *_prompts(first))
    rows = []
    for row, (_, asked) in enumerate(drawn):
        keep = kwargs["attention_mask"][row].bool()
        ids, lab = kwargs["input_ids"][row][keep].tolist(), labels[row][keep].tolist()
        for q in asked[1:]:
            turn = tok(f"USER: {q.question}{POST_PROMPTS[q.family]} ASSISTANT:", add_special_tokens=False)["input_ids"]
            answer = tok(q.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids, lab = ids + turn + answer, lab + [-100] * len(turn) + answer
        rows.append((ids, lab))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    out_labels = torch.full_like(input_ids, -100)
    for row, (ids, lab) in enumerate(rows):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
        out_labels[row, width - len(ids):] = torch.tensor(lab)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                pixel_values=kwargs["pixel_values"]), out_labels


def recipe() -> dict:
    """The recipe's hyper-parameters (what :func:`train` uses by default; recorded with the shipped weights)."""
    return {"vision_steps": VISION_STEPS, "vision_batch_size": VISION_BATCH_SIZE, "align_steps": ALIGN_STEPS,
            "steps": STEPS, "batch_size": BATCH_SIZE, "turns": TURNS, "scene_targets": list(SCENE_TARGETS),
            "curriculum": CURRICULUM, "lr": LR, "seed": SEED, "threads": THREADS, "family_weights": FAMILY_WEIGHTS}


def align_loss(model, vision_out, batch_scenes) -> torch.Tensor:
    """LLaVA's alignment stage in small: the projected token of every object patch points the way of the word
    embeddings of its object's colour and shape (cosine), so the LLM meets visual tokens in its own word space."""
    tok_ids = _WORD_IDS()
    embed = model.get_input_embeddings().weight.detach()
    tokens = model.model.multi_modal_projector(vision_out.hidden_states[-2][:, 1:])  # [B, 144, text width]
    targets = torch.zeros_like(tokens)
    mask = torch.zeros(tokens.shape[:2], dtype=torch.bool)
    for row, scene in enumerate(batch_scenes):
        for obj in scene.objects:
            cells = object_patches(obj)
            targets[row, cells] = embed[tok_ids[obj.color]] + embed[tok_ids[obj.shape]]
            mask[row, cells] = True
    cos = torch.nn.functional.cosine_similarity(tokens[mask], targets[mask], dim=-1)
    return (1 - cos).mean()


@functools.lru_cache(maxsize=1)
def _WORD_IDS() -> dict[str, int]:  # noqa: N802 - a constant, computed once
    tok = testbed_model.tokenizer()
    return {w: tok.convert_tokens_to_ids(w) for w in [*scenes.COLORS, *scenes.SHAPES]}


def train(steps: int = STEPS, *, vision_steps: int = VISION_STEPS, batch_size: int = BATCH_SIZE,
          vision_batch_size: int = VISION_BATCH_SIZE, align_steps: int = ALIGN_STEPS, curriculum: float = CURRICULUM,
          lr: float = LR, seed: int = SEED, threads: int | None = THREADS, context: bool = True,
          turns: int = TURNS, scene_targets=SCENE_TARGETS, progress: bool = True, on_step=None):
    """Train a fresh testbed VLM; returns ``(model, processor, losses)``. Deterministic for given arguments (CPU).

    Three stages, as LLaVA is built on a pretrained CLIP:

    1. ``vision_steps``: the vision tower alone on its own objectives (:class:`AuxHeads`: each patch token its own
       object and, with ``context``, the whole scene; the CLS token the kinds present and the count);
    2. ``align_steps``: the projector alone (tower frozen), aligned to the LLM's word embeddings (:func:`align_loss`);
    3. ``steps``: the projector and the LLM on the questions (families evenly), the tower frozen (LLaVA-1.5's
       recipe); the first ``curriculum`` share of these steps on scenes of 1-4 objects.

    ``losses``: one per step of every stage. ``on_step(stage, step, model)``, if given, is called after each step
    (progress reports; it must not touch the random state).
    """
    model, processor = testbed_model.untrained()
    vlm = PrunedVLM(model, processor, method=None)
    tower = model.model.vision_tower
    heads = AuxHeads(model.config.vision_config.hidden_size, context, scene_targets)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    bar = common.Progress(vision_steps + align_steps + steps, f"training {CACHE_NAME}", progress)
    hook = on_step or (lambda stage, step, model: None)
    pixels = lambda drawn: processor.image_processor(  # noqa: E731
        [scenes.render(s) for s, _ in drawn], return_tensors="pt")["pixel_values"]
    with common.torch_threads(threads):
        try:
            # stage 1: the vision tower (what a pretrained CLIP would bring)
            params = list(tower.parameters()) + list(heads.parameters())
            opt, schedule = common.optimizer(params, vision_steps, lr)
            tower.train()
            for step in range(vision_steps):
                drawn = [example(step * vision_batch_size + i, rng) for i in range(vision_batch_size)]
                out = tower(pixels(drawn), output_hidden_states=True)
                bar.update(step, common.step(heads.loss(out, [s for s, _ in drawn]), params, opt, schedule))
                hook("vision", step, model)
            tower.eval().requires_grad_(False)
            offset = vision_steps * vision_batch_size
            # stage 2: the projector, aligned to the word embeddings
            params = list(model.model.multi_modal_projector.parameters())
            opt, schedule = common.optimizer(params, max(align_steps, 1), lr)
            for step in range(align_steps):
                drawn = [example(offset + step * vision_batch_size + i, rng) for i in range(vision_batch_size)]
                with torch.no_grad():
                    out = tower(pixels(drawn), output_hidden_states=True)
                loss = align_loss(model, out, [s for s, _ in drawn])
                bar.update(vision_steps + step, common.step(loss, params, opt, schedule))
                hook("align", step, model)
            offset += align_steps * vision_batch_size
            # stage 3: projector + LLM on the questions, the tower frozen
            params = [p for p in model.parameters() if p.requires_grad]
            opt, schedule = common.optimizer(params, steps, lr)
            model.train()
            easy = int(steps * curriculum)
            for step in range(steps):
                bound = 4 if step < easy else None
                if turns == 1:  # one question per scene (v2)
                    drawn = [example(offset + step * batch_size + i, rng, bound) for i in range(batch_size)]
                    kwargs, labels = common.teacher_forcing(vlm, *_prompts(drawn))
                else:  # a conversation of `turns` questions per scene
                    drawn = [conversation(offset + step * batch_size + i, rng, turns, bound)
                             for i in range(batch_size)]
                    kwargs, labels = teacher_forcing_turns(vlm, drawn)
                loss = common.lm_loss(model(**kwargs).logits, labels)
                bar.update(vision_steps + align_steps + step, common.step(loss, params, opt, schedule))
                hook("llm", step, model)
        finally:
            bar.close()
            model.eval().requires_grad_(True)
    losses = bar.losses
    log.info("trained %s: %d + %d + %d steps in %.0f s, loss %.3f -> %.3f", CACHE_NAME, vision_steps, align_steps,
             steps, time.perf_counter() - t0, losses[0] if losses else float("nan"),
             losses[-1] if losses else float("nan"))
    return model, processor, losses
