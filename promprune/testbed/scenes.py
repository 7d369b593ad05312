"""Procedural scenes whose semantic prominence is known, and the questions the testbed asks about them.

A scene is ``k`` objects (1..12; shape, colour, size) placed in distinct cells of a 6x6 layout over a 96x96 px
canvas (each cell 16 px: 2x2 patches of an 8 px ViT), on a plain or a cluttered background. Every scene carries its
ground truth: the number of semantic units (``num_objects``), their spatial spread (root-mean-square distance of the
object centres from their centroid, as a fraction of the canvas side) and the share of the canvas they cover.

Everything is deterministic from ``(split, index)``: the train and test splits draw from disjoint seed streams, so
no test scene is ever a training scene.

Question families (each needs different evidence):

- ``exist``: "is there a <colour> <shape> in the image?", yes/no, POPE's protocol: every image gets positives
  (objects present) and negatives of one ``category``: ``random`` (any absent kind), ``popular`` (the absent kinds
  most frequent over the dataset; kinds are drawn with skewed frequencies, so popularity means something) or
  ``adversarial`` (an absent kind sharing the colour or the shape of an object present).
- ``count``: "how many objects are there?", a number 1..12.
- ``attribute``: "what color / shape is the object at the <region>?" for a region of the 3x3 grid that holds
  exactly one object.
- ``relation``: "is the <a> left of / right of / above / below the <b>?", yes/no, for two objects whose centres
  are at least one cell apart along that axis.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

CANVAS = 96
GRID = 6  # cells per side
CELL = CANVAS // GRID  # 16 px
MAX_OBJECTS = 12
COLORS = {"red": (220, 45, 45), "green": (40, 175, 70), "blue": (55, 90, 225), "yellow": (235, 205, 40),
          "white": (245, 245, 245)}
SHAPES = ("circle", "square", "triangle")
KINDS = tuple((c, s) for c in COLORS for s in SHAPES)  # 15 object kinds
# how often each kind is drawn: skewed (Zipf-like, in a fixed shuffled order) so POPE's "popular" negatives differ
# from random ones
_KIND_ORDER = sorted(KINDS, key=lambda kind: hashlib.sha256(repr(kind).encode()).hexdigest())
KIND_WEIGHTS = {kind: 1.0 / (rank + 1) ** 0.7 for rank, kind in enumerate(_KIND_ORDER)}
POPULAR = tuple(_KIND_ORDER)  # most frequent first
BACKGROUNDS = ("plain", "cluttered")
REGIONS = {  # name -> (row band, column band) of the 3x3 grid over the 6x6 cells
    "top left": (0, 0), "top": (0, 1), "top right": (0, 2),
    "left": (1, 0), "center": (1, 1), "right": (1, 2),
    "bottom left": (2, 0), "bottom": (2, 1), "bottom right": (2, 2),
}
RELATIONS = ("left of", "right of", "above", "below")
FAMILIES = ("exist", "count", "attribute", "relation")
POPE_CATEGORIES = ("random", "popular", "adversarial")
SPLITS = {"train": 0, "test": 1, "calibration": 2}  # disjoint seed streams


@dataclass(frozen=True)
class Obj:
    color: str
    shape: str
    size: str  # "large" (14 px) or "small" (9 px)
    row: int  # cell
    col: int
    dx: int  # jitter of the centre within the cell, px
    dy: int

    @property
    def center(self) -> tuple[float, float]:
        return self.col * CELL + CELL / 2 + self.dx, self.row * CELL + CELL / 2 + self.dy

    @property
    def region(self) -> str:
        band = (self.row // 2, self.col // 2)
        return next(name for name, b in REGIONS.items() if b == band)

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"


@dataclass(frozen=True)
class Scene:
    split: str
    index: int
    objects: tuple[Obj, ...]
    background: str
    seed: int = field(repr=False)

    @property
    def num_objects(self) -> int:
        return len(self.objects)

    @property
    def spread(self) -> float:
        """RMS distance of the object centres from their centroid, as a fraction of the canvas side (0 for k=1)."""
        xs, ys = zip(*(o.center for o in self.objects))
        cx, cy = sum(xs) / len(xs), sum(ys) / len(ys)
        return math.sqrt(sum((x - cx) ** 2 + (y - cy) ** 2 for x, y in zip(xs, ys)) / len(xs)) / CANVAS

    @property
    def coverage(self) -> float:
        """Share of the canvas the objects' bounding boxes cover."""
        return sum(extent(o) ** 2 for o in self.objects) / CANVAS ** 2

    def truth(self) -> dict:
        """The scene's ground truth as plain columns."""
        return {"num_objects": self.num_objects, "spread": round(self.spread, 4), "coverage": round(self.coverage, 4),
                "background": self.background,
                "objects": ";".join(f"{o.color} {o.shape} {o.size} r{o.row}c{o.col}" for o in self.objects)}


def extent(obj: Obj) -> int:
    """Side of the object's bounding box, px."""
    return 14 if obj.size == "large" else 9


def _seed(split: str, index: int, salt: str = "") -> int:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    digest = hashlib.sha256(f"promprune-testbed/{split}/{index}/{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def make_scene(split: str, index: int, num_objects: int | None = None, background: str | None = None) -> Scene:
    """Scene ``index`` of ``split``: k uniform in 1..12 and a random background unless given."""
    rng = random.Random(_seed(split, index))
    k = num_objects if num_objects is not None else rng.randint(1, MAX_OBJECTS)
    if not 1 <= k <= MAX_OBJECTS:
        raise ValueError(f"num_objects must be in 1..{MAX_OBJECTS}, got {k}")
    background = background or rng.choice(BACKGROUNDS)
    cells = rng.sample([(r, c) for r in range(GRID) for c in range(GRID)], k)
    weights = [KIND_WEIGHTS[kind] for kind in KINDS]
    kinds: list[tuple[str, str]] = []
    while len(kinds) < k:  # distinct kinds, so every question names one object
        kind = rng.choices(KINDS, weights)[0]
        if kind not in kinds:
            kinds.append(kind)
    objects = tuple(Obj(color, shape, rng.choice(("large", "small")), r, c, rng.randint(-1, 1), rng.randint(-1, 1))
                    for (color, shape), (r, c) in zip(kinds, cells))
    return Scene(split, index, objects, background, _seed(split, index))


def render(scene: Scene) -> Image.Image:
    """The scene as a 96x96 RGB image (deterministic)."""
    rng = random.Random(scene.seed ^ 0x5EED)
    base = tuple(rng.randint(70, 110) for _ in range(3))
    image = Image.new("RGB", (CANVAS, CANVAS), base)
    draw = ImageDraw.Draw(image)
    if scene.background == "cluttered":  # low-contrast blobs and strokes: texture with no meaning
        for _ in range(40):
            x, y, r = rng.randint(0, CANVAS), rng.randint(0, CANVAS), rng.randint(2, 7)
            tone = tuple(min(255, max(0, v + rng.randint(-28, 28))) for v in base)
            if rng.random() < 0.5:
                draw.ellipse((x - r, y - r, x + r, y + r), fill=tone)
            else:
                draw.line((x, y, x + rng.randint(-12, 12), y + rng.randint(-12, 12)), fill=tone, width=2)
    for obj in scene.objects:
        cx, cy = obj.center
        h = extent(obj) / 2
        box = (cx - h, cy - h, cx + h, cy + h)
        fill = COLORS[obj.color]
        if obj.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif obj.shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=fill)
    return image


# ---- questions ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    family: str
    question: str
    answer: str
    category: str = ""  # exist: the POPE negative category; attribute: color|shape; relation: the relation
    refs: tuple = ()  # indices (in Scene.objects) of the objects the question is about: its grounding


def exist_question(kind: tuple[str, str]) -> str:
    return f"Is there a {kind[0]} {kind[1]} in the image?"


def _negative(scene: Scene, category: str, rng: random.Random, used: set) -> tuple[str, str] | None:
    present = {(o.color, o.shape) for o in scene.objects}
    absent = [kind for kind in KINDS if kind not in present and kind not in used]
    if category == "popular":
        absent.sort(key=POPULAR.index)
        return absent[0] if absent else None
    if category == "adversarial":
        near = [kind for kind in absent if any(kind[0] == c or kind[1] == s for c, s in present)]
        return rng.choice(near) if near else None
    return rng.choice(absent) if absent else None


def questions(scene: Scene, family: str, *, per_image: int = 2) -> list[Question]:
    """Up to ``per_image`` questions of ``family`` about ``scene`` (deterministic; yes/no families balanced)."""
    rng = random.Random(_seed(scene.split, scene.index, family))
    if family == "count":
        return [Question("count", "How many objects are there?", str(scene.num_objects), "",
                         tuple(range(scene.num_objects)))]
    if family == "exist":
        category = POPE_CATEGORIES[scene.index % len(POPE_CATEGORIES)]
        out, used = [], set()
        for i in range(per_image):
            if i % 2 == 0:
                index = rng.randrange(len(scene.objects))
                obj = scene.objects[index]
                out.append(Question("exist", exist_question((obj.color, obj.shape)), "yes", category, (index,)))
            else:
                kind = _negative(scene, category, rng, used)
                if kind is not None:
                    used.add(kind)
                    out.append(Question("exist", exist_question(kind), "no", category))
        return out
    if family == "attribute":
        by_region: dict[str, list[Obj]] = {}
        for obj in scene.objects:
            by_region.setdefault(obj.region, []).append(obj)
        alone = [objs[0] for objs in by_region.values() if len(objs) == 1]
        rng.shuffle(alone)
        out = []
        for i, obj in enumerate(alone[:per_image]):
            what = ("color", "shape")[(scene.index + i) % 2]
            out.append(Question("attribute", f"What {what} is the object at the {obj.region}?",
                                obj.color if what == "color" else obj.shape, what, (scene.objects.index(obj),)))
        return out
    if family == "relation":
        pairs = [(a, b) for a in scene.objects for b in scene.objects if a is not b]
        rng.shuffle(pairs)
        out = []
        for a, b in pairs:
            if len(out) == per_image:
                break
            (ax, ay), (bx, by) = a.center, b.center
            axis = rng.choice(("x", "y"))
            delta = bx - ax if axis == "x" else by - ay
            if abs(delta) < CELL:
                continue
            truth = ("left of" if delta > 0 else "right of") if axis == "x" else ("above" if delta > 0 else "below")
            # alternate yes / no: ask the true relation or its opposite
            want_yes = len(out) % 2 == 0
            opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
            relation = truth if want_yes else opposite[truth]
            out.append(Question("relation", f"Is the {a.name} {relation} the {b.name}?", "yes" if want_yes else "no",
                                relation, (scene.objects.index(a), scene.objects.index(b))))
        return out
    raise ValueError(f"unknown question family {family!r}; valid: {', '.join(FAMILIES)}")

