"""``testbed:llava``'s recipe: the testbed VLM (:mod:`promprune.testbed.model`) trained on the testbed's TRAIN scenes.

The result is shipped (:mod:`promprune.testbed.shipped`, ``promprune/testbed/weights/``): ``testbed:llava`` loads it
and trains nothing. ``python -m promprune.testbed.shipped --out DIR`` (or ``--retrain``, into the cache) runs this
recipe; ``$PROMPRUNE_TESTBED_RETRAIN=1`` makes ``testbed:llava`` use the recipe's cache instead of the shipped file.

Every step draws fresh scenes from the train seed stream (an endless, deterministic supply; the evaluation tasks
use the test stream). Recipe v6, four stages, as LLaVA is built on a pretrained CLIP tower:

1. The vision tower alone, on objectives that stand in for the pretraining a real CLIP tower comes with
   (:class:`TowerHeads`): each patch token of the layer LLaVA reads says what lies under it (the object kind, its
   colour, its shape, its region, its centre: :func:`local_targets`) and how many objects the whole image holds
   (context from the whole image, as CLIP's tokens carry); the CLS token after the last layer predicts the kinds
   present and the count (which is what makes CLS attention, the methods' saliency, pick out objects).
2. LLaVA's alignment stage in small: the projector alone maps each object patch towards the LLM's word embeddings
   of its colour and shape.
3. The tower frozen (LLaVA-1.5's recipe), the projector and the LLM on one question per scene, the four families
   evenly: the LM loss on the answer tokens and EOS (prompts built exactly as :meth:`PrunedVLM.generate` builds
   them), plus two supervisions of *where to look* that a 4-layer LLM trained for minutes does not find by itself
   (docs/testbed.md, v4 and the v5 probes):

   - attention (:func:`attention_targets`): at the position that predicts the answer, two heads of layer
     ``FIND_LAYER`` attend to the visual tokens of the objects the question names (a relation: one head each
     object; a count: every object; an existence question whose answer is "no": the first prompt token, a sink,
     from ``SINK_AFTER`` of the steps on), and two heads of layer ``GATHER_LAYER`` to the question's words that
     name them (the colour and shape; the region for an attribute question);
   - a question probe (:class:`QuestionProbe`): linear read-outs of the named colours, shapes and region from the
     residual stream entering layer ``FIND_LAYER`` at that position, so the gathered words are there for the
     find heads' queries.

4. Relations (:func:`relation_stage`), which stage 3 leaves at chance: half of each batch relation questions, half
   stage 3's mix; stage 3's losses plus a head of layer ``WORD_LAYER`` on the relation's word, read-outs of where
   the first object lies against the second entering layer ``FACTS_LAYER`` (:class:`RelationFacts`) and of the
   answer entering layer ``ANSWER_LAYER`` (:class:`RelationAnswer`).

   The read-outs and the attention losses shape training only; inference is the plain LLaVA forward pass.

Earlier recipes (docs/testbed.md): v1 (local patch targets only) learned to count by the share of object tokens and
nothing else; v2 (patch tokens carrying the whole scene) counted and stayed at chance on the rest; v5 (stages 1-3)
answered everything but relations. One torch thread: the same weights on machines of one CPU type (not across CPU
types).
"""
from __future__ import annotations

import copy
import functools
import logging
import random
import time
from pathlib import Path

import torch

from promprune.env import cache_dir
from promprune.models import PrunedVLM
from promprune.seeding import private_seed
from promprune.testbed import RECIPE  # defined with the package (cheap to import)
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes
from promprune.training import common

log = logging.getLogger(__name__)
F = torch.nn.functional

CACHE_NAME = f"testbed-llava-{RECIPE}"  # so a stale cache is never reused
SEED = 0
VISION_STEPS = 4000
VISION_BATCH_SIZE = 32
ALIGN_STEPS = 200
STEPS = 5000
BATCH_SIZE = 32
LR = 2e-3
SINK_AFTER = 0.5  # share of the LLM steps before an existence "no" is taught to look at the sink
RELATION_STEPS = 1500  # stage 4: relations, which stage 3 leaves at chance, on top of stage 3's mix
RELATION_LR = 1e-3
WORD_LAYER, WORD_HEAD = 0, 0  # stage 4: the head that reads a relation question's relation word
FACTS_LAYER = 2  # stage 4: the residual entering this layer says where the first object lies against the second
ANSWER_LAYER = 3  # stage 4, with relation_answer: the residual entering this layer says whether the relation holds
RELATION_ANSWER = True  # without it, 1,000 steps left relations at chance (docs/testbed.md)
FIND_LAYER, FIND_HEADS = 1, (0, 1)  # the heads that look at the objects a question names
GATHER_LAYER, GATHER_HEADS = 0, (2, 3)  # the heads that read the words naming them
TOWER_CHECK_SCENES = 64  # test scenes the log's tower accuracies are measured on (no training effect)
THREADS = 1  # torch threads while training: the same weights on every machine
# the prompt suffix per question family (the testbed's lmms-eval tasks use the same)
POST_PROMPTS = {"exist": "\nAnswer with yes or no.", "relation": "\nAnswer with yes or no.",
                "count": "\nAnswer with a number.", "attribute": "\nAnswer with one word."}
FAMILY_WEIGHTS = {"exist": 0.25, "count": 0.25, "attribute": 0.25, "relation": 0.25}  # evenly
GRID = testbed_model.IMAGE_SIZE // testbed_model.PATCH  # 12 patches per side
COLORS, SHAPES, REGIONS = list(scenes.COLORS), list(scenes.SHAPES), list(scenes.REGIONS)


def cache_path() -> Path:
    return cache_dir() / CACHE_NAME


def train_scene(index: int) -> scenes.Scene:
    return scenes.make_scene("train", index)


def example(index: int, rng: random.Random):
    """Train example ``index``: (:func:`train_scene`, question), the family drawn from FAMILY_WEIGHTS
    (deterministic)."""
    scene = train_scene(index)
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


def local_targets(scene: scenes.Scene) -> dict[str, torch.Tensor]:
    """What each of the GRID*GRID patch tokens is trained to say about what lies under it: the object ``kind``
    (1 + index in KINDS), its ``color``, ``shape`` and ``region`` (each 1 + index; 0 for background) and its
    ``center`` (x, y) / canvas side (0 for background)."""
    n = GRID * GRID
    out = {name: torch.zeros(n, dtype=torch.long) for name in ("kind", "color", "shape", "region")}
    out["center"] = torch.zeros(n, 2)
    for obj in scene.objects:
        cells = object_patches(obj)
        out["kind"][cells] = 1 + scenes.KINDS.index((obj.color, obj.shape))
        out["color"][cells] = 1 + COLORS.index(obj.color)
        out["shape"][cells] = 1 + SHAPES.index(obj.shape)
        out["region"][cells] = 1 + REGIONS.index(obj.region)
        out["center"][cells] = torch.tensor(obj.center) / scenes.CANVAS
    return out


def patch_labels(scene: scenes.Scene) -> torch.Tensor:
    """[GRID*GRID] object kind under each patch centre (1 + index in KINDS), 0 for background."""
    return local_targets(scene)["kind"]


def present_kinds(scene: scenes.Scene) -> torch.Tensor:
    """[len(KINDS)] 1.0 for each kind the scene holds."""
    present = torch.zeros(len(scenes.KINDS))
    for obj in scene.objects:
        present[scenes.KINDS.index((obj.color, obj.shape))] = 1.0
    return present


class TowerHeads(torch.nn.Module):
    """The vision tower's training objectives (what stands in for CLIP's pretraining), discarded after stage 1:
    every patch token of the layer LLaVA reads predicts :func:`local_targets` and the scene's object count; the CLS
    token after the last layer the kinds present and the count."""

    def __init__(self, width: int):
        super().__init__()
        k, n = len(scenes.KINDS), scenes.MAX_OBJECTS
        self.kind = torch.nn.Linear(width, 1 + k)
        self.color = torch.nn.Linear(width, 1 + len(COLORS))
        self.shape = torch.nn.Linear(width, 1 + len(SHAPES))
        self.region = torch.nn.Linear(width, 1 + len(REGIONS))
        self.center = torch.nn.Linear(width, 2)
        self.count = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, n))
        self.cls = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, k + n))

    def loss(self, vision_out, batch_scenes) -> torch.Tensor:
        patches = vision_out.hidden_states[-2][:, 1:]  # [B, 144, width] the layer LLaVA reads, CLS dropped
        t = {name: torch.stack([local[name] for local in map(local_targets, batch_scenes)])
             for name in ("kind", "color", "shape", "region", "center")}
        loss = sum(F.cross_entropy(getattr(self, name)(patches).flatten(0, 1), t[name].flatten())
                   for name in ("kind", "color", "shape", "region"))
        on = (t["kind"] > 0).float()
        error = (self.center(patches) - t["center"]).pow(2).sum(-1)
        loss = loss + 20 * (error * on).sum() / on.sum().clamp(min=1)
        count = torch.tensor([s.num_objects - 1 for s in batch_scenes])
        loss = loss + F.cross_entropy(self.count(patches).flatten(0, 1), count.repeat_interleave(patches.shape[1]))
        pooled = self.cls(vision_out.last_hidden_state[:, 0])  # the CLS token after the last layer
        k = len(scenes.KINDS)
        present = torch.stack([present_kinds(s) for s in batch_scenes])
        return loss + F.binary_cross_entropy_with_logits(pooled[:, :k], present) + F.cross_entropy(pooled[:, k:], count)

    @torch.no_grad()
    def accuracy(self, vision_out, batch_scenes) -> dict[str, float]:
        """What the training log reports after stage 1: on object patches, how often each local head is right;
        ``background``: background patches called background; ``count``: patch tokens that tell the object count."""
        patches = vision_out.hidden_states[-2][:, 1:]
        t = {name: torch.stack([local[name] for local in map(local_targets, batch_scenes)])
             for name in ("kind", "color", "shape", "region")}
        on = t["kind"] > 0
        out = {name: (getattr(self, name)(patches).argmax(-1) == t[name])[on].float().mean().item() for name in t}
        out["background"] = (self.kind(patches).argmax(-1) == 0)[~on].float().mean().item()
        count = torch.tensor([s.num_objects - 1 for s in batch_scenes])
        out["count"] = (self.count(patches).argmax(-1) == count[:, None]).float().mean().item()
        return {name: round(value, 3) for name, value in out.items()}


def _prompts(drawn) -> tuple[list, list, list]:
    return ([scenes.render(s) for s, _ in drawn], [f"{q.question}{POST_PROMPTS[q.family]}" for _, q in drawn],
            [q.answer for _, q in drawn])


def recipe() -> dict:
    """The recipe's hyper-parameters (what :func:`train` uses by default; recorded with the shipped weights)."""
    return {"vision_steps": VISION_STEPS, "vision_batch_size": VISION_BATCH_SIZE, "align_steps": ALIGN_STEPS,
            "steps": STEPS, "batch_size": BATCH_SIZE, "lr": LR, "sink_after": SINK_AFTER,
            "relation_steps": RELATION_STEPS, "relation_lr": RELATION_LR, "relation_answer": RELATION_ANSWER,
            "find": {"layer": FIND_LAYER, "heads": list(FIND_HEADS)},
            "gather": {"layer": GATHER_LAYER, "heads": list(GATHER_HEADS)},
            "relation_word": {"layer": WORD_LAYER, "head": WORD_HEAD}, "facts_layer": FACTS_LAYER,
            "seed": SEED, "threads": THREADS, "family_weights": FAMILY_WEIGHTS}


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
    cos = F.cosine_similarity(tokens[mask], targets[mask], dim=-1)
    return (1 - cos).mean()


@functools.lru_cache(maxsize=1)
def _WORD_IDS() -> dict[str, int]:  # noqa: N802 - a constant, computed once
    tok = testbed_model.tokenizer()
    return {w: tok.convert_tokens_to_ids(w) for w in testbed_model.vocabulary()}


# ---- stage 3's supervision of where to look ----------------------------------------------------------------------


def answer_positions(labels: torch.Tensor) -> list[int]:
    """Per row, the position whose next token is the first labelled one (the position that predicts the answer)."""
    labelled = labels != -100
    first = labelled[:, 1:] & ~labelled[:, :-1]
    return [int(row.nonzero()[0]) for row in first]


def named_kinds(q: scenes.Question) -> list[tuple[str, str]]:
    """The (colour, shape) kinds the question names, in order (an existence question one, a relation two)."""
    words = q.question.lower().rstrip("?").split()
    return [(a, b) for a, b in zip(words, words[1:]) if a in COLORS and b in SHAPES]


def question_words(q: scenes.Question) -> tuple[list[str], list[str]]:
    """The words each of the two gather heads reads: the colour and shape of the first and the last kind named
    (one kind: the same twice); for an attribute question the region, twice; a count names nothing."""
    if q.family == "attribute":
        region = q.question.lower().rstrip("?").split(" at the ")[1].split()
        return region, region
    kinds = named_kinds(q)
    if not kinds:
        return [], []
    return list(kinds[0]), list(kinds[-1])


def question_region(q: scenes.Question) -> str | None:
    return q.question.lower().rstrip("?").split(" at the ")[1] if q.family == "attribute" else None


def attention_targets(input_ids, attention_mask, labels, drawn, image_token_id: int, sink: bool = True):
    """The attention supervision of one batch: [(role, row, head, query position, key positions)].

    ``role`` "find" (layer FIND_LAYER, FIND_HEADS): the visual tokens of the objects the question is about
    (``Question.refs``; a relation: the first head its first object, the second head its second); an existence
    question without refs (answer "no"), when ``sink``: the row's first prompt token. ``role`` "gather" (layer
    GATHER_LAYER, GATHER_HEADS): the question's words that name them (:func:`question_words`; the first
    occurrence after the image for the first head, the last occurrence for the second)."""
    out = []
    ids_of = _WORD_IDS()
    for row, ((scene, q), pos) in enumerate(zip(drawn, answer_positions(labels))):
        ids = input_ids[row]
        image = (ids == image_token_id).nonzero().flatten()
        groups = [q.refs[:1], q.refs[1:]] if q.family == "relation" else [q.refs, q.refs]
        for head, refs in zip(FIND_HEADS, groups):
            if refs:
                cells = sorted({c for i in refs for c in object_patches(scene.objects[i])})
                out.append(("find", row, head, pos, image[cells]))
            elif sink and q.family == "exist":
                out.append(("find", row, head, pos, attention_mask[row].nonzero()[:1].flatten()))
        start = int(image[-1]) + 1
        span = ids[start:pos + 1]
        for which, (head, words) in enumerate(zip(GATHER_HEADS, question_words(q))):
            hits = [(span == ids_of[w]).nonzero().flatten() for w in words]
            if hits and all(len(h) for h in hits):
                out.append(("gather", row, head, pos, start + torch.stack([h[-which] for h in hits])))
    return out


def attention_loss(attentions, targets) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean of -log(attention mass on the targets) over ``targets`` (:func:`attention_targets`), and the mean mass
    per role (what the training log prints)."""
    layers = {"find": FIND_LAYER, "gather": GATHER_LAYER}
    masses = {"find": [], "gather": []}
    total = attentions[0].new_zeros(())
    for role, row, head, pos, keys in targets:
        mass = attentions[layers[role]][row, head, pos, keys].sum()
        total = total - torch.log(mass + 1e-6)
        masses[role].append(mass.detach())
    mean = {role: float(torch.stack(m).mean()) for role, m in masses.items() if m}
    return total / max(len(targets), 1), mean


class QuestionProbe(torch.nn.Module):
    """Linear read-outs, from the residual stream entering layer FIND_LAYER at the answer-predicting position, of
    what the question names: the colour and shape of the first and of the last kind, and the region (each 1 + index,
    0 for none). Training only."""

    def __init__(self, width: int):
        super().__init__()
        sizes = [len(COLORS), len(SHAPES), len(COLORS), len(SHAPES), len(REGIONS)]
        self.heads = torch.nn.ModuleList([torch.nn.Linear(width, 1 + n) for n in sizes])

    @staticmethod
    def targets(q: scenes.Question) -> list[int]:
        kinds = named_kinds(q)
        out = []
        for kind in (kinds[0], kinds[-1]) if kinds else (None, None):
            out += [1 + COLORS.index(kind[0]), 1 + SHAPES.index(kind[1])] if kind else [0, 0]
        region = question_region(q)
        return out + [1 + REGIONS.index(region) if region else 0]

    def loss(self, hidden: torch.Tensor, positions: list[int], drawn) -> torch.Tensor:
        h = hidden[torch.arange(len(positions)), positions]
        t = torch.tensor([self.targets(q) for _, q in drawn])
        return sum(F.cross_entropy(head(h), t[:, i]) for i, head in enumerate(self.heads))


# ---- stage 4: relations ---------------------------------------------------------------------------------------


RELATIONS = list(scenes.RELATIONS)


def relation_facts(scene: scenes.Scene, q: scenes.Question) -> list[int]:
    """What a relation question's answer rests on: [the first object named lies left of the second (0/1), it lies
    above the second (0/1), the relation asked (index in scenes.RELATIONS)]."""
    (ax, ay), (bx, by) = (scene.objects[i].center for i in q.refs)
    return [int(ax < bx), int(ay < by), RELATIONS.index(q.category)]


def relation_example(index: int, rng: random.Random):
    """A relation question about the first train scene from ``index`` on that has one: (scene, question)."""
    while True:
        scene = train_scene(index)
        found = scenes.questions(scene, "relation")
        if found:
            return scene, rng.choice(found)
        index += 1


def relation_rows(hidden: torch.Tensor, positions: list[int], drawn) -> tuple[list[int], torch.Tensor | None]:
    """The batch rows asking a relation question, and ``hidden`` [B, T, width] at their answer-predicting
    ``positions`` ([rows, width]; None without such a row): what stage 4's read-outs read."""
    rows = [i for i, (_, q) in enumerate(drawn) if q.family == "relation"]
    return rows, hidden[rows, [positions[i] for i in rows]] if rows else None


class RelationFacts(torch.nn.Module):
    """Linear read-outs of :func:`relation_facts` from the residual entering layer FACTS_LAYER at the position that
    predicts a relation question's answer. Training only."""

    def __init__(self, width: int):
        super().__init__()
        self.heads = torch.nn.ModuleList([torch.nn.Linear(width, n) for n in (2, 2, len(RELATIONS))])

    def loss(self, hidden: torch.Tensor, positions: list[int], drawn) -> torch.Tensor:
        rows, h = relation_rows(hidden, positions, drawn)
        if not rows:
            return hidden.new_zeros(())
        t = torch.tensor([relation_facts(*drawn[i]) for i in rows])
        return sum(F.cross_entropy(head(h), t[:, k]) for k, head in enumerate(self.heads))


class RelationAnswer(torch.nn.Module):
    """A linear read-out of a relation question's answer (does the relation hold) from the residual entering layer
    ANSWER_LAYER at the answer-predicting position (stage 4 with ``relation_answer``). Training only."""

    def __init__(self, width: int):
        super().__init__()
        self.head = torch.nn.Linear(width, 2)

    def loss(self, hidden: torch.Tensor, positions: list[int], drawn) -> torch.Tensor:
        rows, h = relation_rows(hidden, positions, drawn)
        if not rows:
            return hidden.new_zeros(())
        t = torch.tensor([int(drawn[i][1].answer == "yes") for i in rows])
        return F.cross_entropy(self.head(h), t)


def relation_word_targets(input_ids, labels, drawn) -> list:
    """Attention supervision of stage 4, as :func:`attention_targets`' tuples: on a relation question, head WORD_HEAD
    of layer WORD_LAYER at the answer-predicting position attends to the relation's first word ("left", "right",
    "above", "below"; role "word")."""
    ids_of = _WORD_IDS()
    out = []
    for row, ((_, q), pos) in enumerate(zip(drawn, answer_positions(labels))):
        if q.family == "relation":
            hits = (input_ids[row, :pos + 1] == ids_of[q.category.split()[0]]).nonzero().flatten()
            out.append(("word", row, WORD_HEAD, pos, hits[-1:]))
    return out


def relation_stage(model, processor, steps: int = RELATION_STEPS, *, lr: float = RELATION_LR,
                   batch_size: int = BATCH_SIZE, seed: int = SEED, answer: bool = RELATION_ANSWER, bar=None,
                   hook=None) -> None:
    """Stage 4 on a model that has been through stages 1-3 (in place; tower frozen; eager attention while it runs):
    batches half relation questions, half the stage-3 mix; stage 3's losses plus :func:`relation_word_targets` and
    :class:`RelationFacts`. Depends only on the weights it is given and ``seed`` (its own generators), so stages
    1-3, a save and a load, then this stage give the same weights as one :func:`train`."""
    with private_seed(seed + 4):  # the caller's random state is left as it was
        rng = random.Random(seed + 4)
        vlm = PrunedVLM(model, processor, method=None)
        width = model.config.text_config.hidden_size
        probe, facts = QuestionProbe(width), RelationFacts(width)
        model.set_attn_implementation("eager")
        model.requires_grad_(True)
        model.model.vision_tower.eval().requires_grad_(False)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        params += list(probe.parameters()) + list(facts.parameters())
        told = RelationAnswer(width) if answer else None
        params += list(told.parameters()) if told is not None else []
        opt, schedule = common.optimizer(params, max(steps, 1), lr)
        first = bar.total - steps if bar is not None else 0
        offset = 10 ** 9  # train scenes far from those stages 1-3 drew
        try:
            for step in range(steps):
                start = offset + step * batch_size * 4
                half = batch_size // 2
                drawn = [relation_example(start + 2 * i, rng) for i in range(half)]
                drawn += [example(start + 2 * batch_size + i, rng) for i in range(batch_size - half)]
                kwargs, labels = common.teacher_forcing(vlm, *_prompts(drawn))
                out = model(**kwargs, output_attentions=True, output_hidden_states=True)
                lm = common.lm_loss(out.logits, labels)
                positions = answer_positions(labels)
                targets = attention_targets(kwargs["input_ids"], kwargs["attention_mask"], labels, drawn,
                                            model.config.image_token_id)
                looked, mass = attention_loss(out.attentions, targets)
                word = relation_word_targets(kwargs["input_ids"], labels, drawn)
                read = -torch.stack([out.attentions[WORD_LAYER][r, h, p, k].sum() for _, r, h, p, k in word]).add(
                    1e-6).log().mean() if word else lm.new_zeros(())
                extra = (probe.loss(out.hidden_states[FIND_LAYER], positions, drawn)
                         + facts.loss(out.hidden_states[FACTS_LAYER], positions, drawn))
                if told is not None:
                    extra = extra + told.loss(out.hidden_states[ANSWER_LAYER], positions, drawn)
                loss = common.step(lm + looked + read + extra, params, opt, schedule)
                if bar is not None:
                    bar.update(first + step, loss)
                if (step + 1) % 100 == 0:
                    log.info("relation step %d: lm %.3f, attention %.3f (mass %s), relation word %.3f, read-outs %.3f",
                             step + 1, lm.item(), looked.item(), {r: round(m, 2) for r, m in mass.items()},
                             read.item(), extra.item())
                if hook is not None:
                    hook("relation", step, model)
        finally:
            model.set_attn_implementation("sdpa")
            model.eval().requires_grad_(True)


def train(steps: int = STEPS, *, vision_steps: int = VISION_STEPS, batch_size: int = BATCH_SIZE,
          vision_batch_size: int = VISION_BATCH_SIZE, align_steps: int = ALIGN_STEPS, lr: float = LR,
          sink_after: float = SINK_AFTER, relation_steps: int = RELATION_STEPS, relation_lr: float = RELATION_LR,
          relation_answer: bool = RELATION_ANSWER, seed: int = SEED, threads: int | None = THREADS,
          progress: bool = True, on_step=None, init=None):
    """Train a fresh testbed VLM; returns ``(model, processor, losses)``. Deterministic for given arguments (CPU);
    the caller's torch random state is left as it was (:func:`promprune.seeding.private_seed`).

    Four stages, as LLaVA is built on a pretrained CLIP:

    1. ``vision_steps``: the vision tower alone on its own objectives (:class:`TowerHeads`);
    2. ``align_steps``: the projector alone (tower frozen), aligned to the LLM's word embeddings (:func:`align_loss`);
    3. ``steps``: the projector and the LLM on the questions (families evenly), the tower frozen (LLaVA-1.5's
       recipe): LM loss + attention supervision (:func:`attention_targets`; the existence "no" sink from
       ``sink_after`` of the steps on) + the question probe (:class:`QuestionProbe`);
    4. ``relation_steps``: :func:`relation_stage`, half the batches relation questions, which stage 3 leaves at
       chance.

    ``init``: a model that has been through stages 1-3 (saved by an earlier run of this recipe): only stage 4 runs,
    on a copy, and the result is the same as a whole run's. ``losses``: one per step of every stage run (stages 3-4:
    the sum of their losses). ``on_step(stage, step, model)``, if given, is called after each step (progress
    reports; it must not touch the random state).
    """
    if init is not None:
        model, processor = copy.deepcopy(init), testbed_model.untrained()[1]
        bar = common.Progress(relation_steps, f"training {CACHE_NAME} (stage 4)", progress)
        with common.torch_threads(threads):
            try:
                relation_stage(model, processor, relation_steps, lr=relation_lr, batch_size=batch_size, seed=seed,
                               answer=relation_answer, bar=bar, hook=on_step)
            finally:
                bar.close()
        return model, processor, bar.losses
    model, processor = testbed_model.untrained()
    vlm = PrunedVLM(model, processor, method=None)
    tower = model.model.vision_tower
    rng = random.Random(seed)
    with private_seed(seed):  # the caller's random state is left as it was
        heads = TowerHeads(model.config.vision_config.hidden_size)
        probe = QuestionProbe(model.config.text_config.hidden_size)
        t0 = time.perf_counter()
        bar = common.Progress(vision_steps + align_steps + steps + relation_steps, f"training {CACHE_NAME}", progress)
        hook = on_step or (lambda stage, step, model: None)
        pixels = lambda batch: processor.image_processor(  # noqa: E731
            [scenes.render(s) for s in batch], return_tensors="pt")["pixel_values"]
        with common.torch_threads(threads):
            try:
                # stage 1: the vision tower (what a pretrained CLIP would bring)
                params = list(tower.parameters()) + list(heads.parameters())
                opt, schedule = common.optimizer(params, vision_steps, lr)
                tower.train()
                for step in range(vision_steps):
                    batch = [train_scene(step * vision_batch_size + i) for i in range(vision_batch_size)]
                    out = tower(pixels(batch), output_hidden_states=True)
                    bar.update(step, common.step(heads.loss(out, batch), params, opt, schedule))
                    hook("vision", step, model)
                tower.eval().requires_grad_(False)
                held_out = [scenes.make_scene("test", 10_000 + i) for i in range(TOWER_CHECK_SCENES)]
                log.info("tower after %d steps, on %d test scenes: %s", vision_steps, len(held_out),
                         heads.accuracy(tower(pixels(held_out), output_hidden_states=True), held_out))
                offset = vision_steps * vision_batch_size
                # stage 2: the projector, aligned to the word embeddings
                params = list(model.model.multi_modal_projector.parameters())
                opt, schedule = common.optimizer(params, max(align_steps, 1), lr)
                for step in range(align_steps):
                    batch = [train_scene(offset + step * vision_batch_size + i) for i in range(vision_batch_size)]
                    with torch.no_grad():
                        out = tower(pixels(batch), output_hidden_states=True)
                    bar.update(vision_steps + step, common.step(align_loss(model, out, batch), params, opt, schedule))
                    hook("align", step, model)
                offset += align_steps * vision_batch_size
                # stage 3: projector + LLM on the questions, the tower frozen; eager attention, whose weights the
                # attention supervision needs
                model.set_attn_implementation("eager")
                params = [p for p in model.parameters() if p.requires_grad] + list(probe.parameters())
                opt, schedule = common.optimizer(params, steps, lr)
                model.train()
                for step in range(steps):
                    drawn = [example(offset + step * batch_size + i, rng) for i in range(batch_size)]
                    kwargs, labels = common.teacher_forcing(vlm, *_prompts(drawn))
                    out = model(**kwargs, output_attentions=True, output_hidden_states=True)
                    lm = common.lm_loss(out.logits, labels)
                    targets = attention_targets(kwargs["input_ids"], kwargs["attention_mask"], labels, drawn,
                                                model.config.image_token_id, sink=step >= int(steps * sink_after))
                    looked, mass = attention_loss(out.attentions, targets)
                    probed = probe.loss(out.hidden_states[FIND_LAYER], answer_positions(labels), drawn)
                    loss = common.step(lm + looked + probed, params, opt, schedule)
                    bar.update(vision_steps + align_steps + step, loss)
                    if (step + 1) % 250 == 0:
                        log.info("LLM step %d: lm %.3f, attention %.3f (mass %s), probe %.3f", step + 1, lm.item(),
                                 looked.item(), {r: round(m, 2) for r, m in mass.items()}, probed.item())
                    hook("llm", step, model)
                relation_stage(model, processor, relation_steps, lr=relation_lr, batch_size=batch_size, seed=seed,
                               answer=relation_answer, bar=bar, hook=hook)
            finally:
                bar.close()
                model.set_attn_implementation("sdpa")
                model.eval().requires_grad_(True)
    losses = bar.losses
    log.info("trained %s: %d + %d + %d + %d steps in %.0f s, loss %.3f -> %.3f", CACHE_NAME, vision_steps,
             align_steps, steps, relation_steps, time.perf_counter() - t0, losses[0] if losses else float("nan"),
             losses[-1] if losses else float("nan"))
    return model, processor, losses
