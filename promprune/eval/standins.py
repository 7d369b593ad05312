"""Local stand-ins of the paper's nine hub datasets, served to ``datasets`` offline exactly where the hub's would be.

    hf_home = build_standins(Path("/tmp/hf"), docs_per_task=8)     # writes hf_home/datasets/<org>___<name>/...
    # then, in a fresh process: HF_HOME=/tmp/hf HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m pipelines.sweep ...
    # or: python -m promprune.eval standins --out /tmp/hf

Each stand-in has the hub dataset's repository (as lmms-eval 0.7.3's task YAML names it, ``lmms-lab-encoder/*``),
config, split, field names and feature types (from the datasets' cards), a few documents, and images drawn
procedurally (a seeded scene of coloured shapes and words over a crop of one of scikit-image's bundled photos) and
stored as the hub stores them: encoded JPEG or PNG bytes, in modes RGB, L, RGBA and P. The questions are about what
was drawn, so the stored answers are right (a colour question on a grey image, as the hub's COCO photos have them,
is right about the scene only). Structure that lmms-eval's code relies on is kept: MME's two questions
per image (yes, no), MMBench's circular variants (index + k*1e6, options rotated), GQA's questions in one config and
images in another joined by ``imageId``, VQAv2's several questions per image with ten ``answers``.

How they are served. ``datasets`` (5.x) offline never reads the hub cache (``hub/datasets--org--name``); it falls
back to its own cache, ``$HF_DATASETS_CACHE/<org>___<snake_name>/<config>/<version>/<hash>/`` holding
``dataset_info.json`` and ``<snake_name>-<split>.arrow`` (``datasets.packaged_modules.cache``: the newest hash
directory of the requested config, or the only config when none is named). We write that layout with ``datasets``'
own builder: a local copy of the hub repository (a README with the hub's ``configs:`` block, parquet shards under
the same paths) is prepared by the parquet builder into a staging cache, and the result moved under the hub
repository's ``<org>___`` name, the only part of the path a local repository lacks.

A fresh process needs only the environment of :func:`standin_env`. Inside a process that already imported
``datasets`` or loaded an lmms-eval task, use ``with serving(hf_home):``: both libraries read some of that
environment once per process, and it sets those values too.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from promprune.env import temporary_env

STANDIN_VERSION = "v1"  # bump when the documents change
MARKER = "promprune-standins.json"  # in hf_home: what was built, so a rebuild replaces only stand-ins

# ---------------------------------------------------------------------------------------------------------------
# Procedural scenes

COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 70, 220), "yellow": (240, 210, 20),
          "purple": (140, 40, 170), "orange": (245, 130, 20), "white": (250, 250, 250), "black": (10, 10, 10)}
SHAPES = ("circle", "square", "triangle")
WORDS = ("stop", "exit", "cafe", "open", "sale", "taxi", "bus", "park", "menu", "hotel")
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "text", "immunohistochemistry", "colorwheel", "brick")
SIZES = ((96, 72), (80, 80), (120, 90), (72, 96), (112, 64))  # (width, height): a mix of aspect ratios


@dataclass
class Thing:
    shape: str
    color: str
    x: float  # centre, as a fraction of the width
    y: float


@dataclass
class Scene:
    image: Image.Image  # RGB
    things: list[Thing]
    word: str | None = None

    def count(self, shape: str) -> int:
        return sum(t.shape == shape for t in self.things)

    def absent_shape(self) -> str | None:
        missing = [s for s in SHAPES if self.count(s) == 0]
        return missing[0] if missing else None


class Painter:
    """Deterministic scenes: ``Painter(seed).scene(n_things, word=...)``."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def _background(self, size: tuple[int, int]) -> Image.Image:
        photo = _photo(PHOTOS[self.rng.integers(len(PHOTOS))])
        H, W, _ = photo.shape
        h, w = self.rng.integers(H // 3, H + 1), self.rng.integers(W // 3, W + 1)
        top, left = self.rng.integers(0, H - h + 1), self.rng.integers(0, W - w + 1)
        crop = Image.fromarray(photo[top:top + h, left:left + w])
        return crop.resize(size, Image.Resampling.BILINEAR)

    def scene(self, n_things: int = 2, word: bool = False) -> Scene:
        size = SIZES[self.rng.integers(len(SIZES))]
        image = self._background(size)
        draw = ImageDraw.Draw(image)
        W, H = size
        things, r = [], min(W, H) // 7
        for i in range(n_things):
            # things sit in distinct vertical bands, so left/right and colours stay unambiguous; below a word's banner
            x = (i + 0.5) / n_things
            y = float(self.rng.uniform(0.6, 0.75) if word else self.rng.uniform(0.3, 0.7))
            thing = Thing(str(self.rng.choice(SHAPES)), str(self.rng.choice(list(COLORS)[:6])), x, y)
            _draw_thing(draw, thing, (x * W, y * H), r)
            things.append(thing)
        text = None
        if word:
            text = str(self.rng.choice(WORDS))
            font = ImageFont.load_default(size=max(10, H // 5))
            draw.rectangle((2, 2, W - 2, H // 4 + 4), fill=COLORS["white"])
            draw.text((4, 2), text.upper(), fill=COLORS["black"], font=font)
        return Scene(image, things, text)

    def choice(self, options):
        return options[self.rng.integers(len(options))]


@functools.lru_cache(maxsize=len(PHOTOS))
def _photo(name: str) -> np.ndarray:
    """One of scikit-image's bundled photos as H x W x 3 uint8 (grey ones stacked, alpha dropped)."""
    import skimage.data

    photo = np.asarray(getattr(skimage.data, name)())
    return np.stack([photo] * 3, axis=-1) if photo.ndim == 2 else photo[..., :3]


def _draw_thing(draw: ImageDraw.ImageDraw, thing: Thing, centre: tuple[float, float], r: int) -> None:
    cx, cy = centre
    fill = COLORS[thing.color]
    if thing.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill, outline=COLORS["black"])
    elif thing.shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill, outline=COLORS["black"])
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill, outline=COLORS["black"])


def encode(image: Image.Image, fmt: str, mode: str) -> dict:
    """An RGB image -> the ``{"bytes", "path"}`` a datasets Image column stores: ``fmt`` JPEG or PNG, PIL ``mode``
    RGB, L, RGBA (alpha falls off towards the bottom edge) or P (an adaptive 32-colour palette)."""
    if mode == "L":
        image = image.convert("L")
    elif mode == "RGBA":
        W, H = image.size
        alpha = np.linspace(255, 96, H, dtype=np.uint8)[:, None].repeat(W, axis=1)  # H x W
        image = image.convert("RGBA")
        image.putalpha(Image.fromarray(alpha))
    elif mode == "P":
        image = image.quantize(colors=32)
    elif mode != "RGB":
        raise ValueError(f"unsupported image mode {mode!r}; use RGB, L, RGBA or P")
    if fmt == "JPEG" and mode not in ("RGB", "L"):
        raise ValueError(f"JPEG cannot hold mode {mode!r}")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return {"bytes": buffer.getvalue(), "path": None}


# ---------------------------------------------------------------------------------------------------------------
# The hub datasets: repository, config, split, features (as the dataset cards give them), and their documents


@dataclass
class Table:
    """One (config, split) of a hub dataset repository, as columns."""

    repo: str  # the task YAML's dataset_path
    config: str  # its dataset_name, "default" when it names none
    split: str  # the task's test_split
    features: dict  # name -> datasets feature
    columns: dict[str, list] = field(default_factory=dict)

    def add(self, **row) -> None:
        if set(row) != set(self.features):
            raise ValueError(f"{self.repo}/{self.config}: row fields {sorted(row)} != features {sorted(self.features)}")
        for name, value in row.items():
            self.columns.setdefault(name, []).append(value)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))


def _f():
    """(string, image) features, and datasets itself for the rest (imported lazily: it is slow to import)."""
    import datasets

    return datasets, datasets.Value("string"), datasets.Image()


def _yes_no_pair(scene: Scene, category: str) -> tuple[str, str]:
    """MME: a (yes question, no question) pair about ``scene`` for a category."""
    t = scene.things[0]
    other = scene.absent_shape() or "star"
    wrong_color = next(c for c in COLORS if c != t.color)
    side, other_side = ("left", "right") if t.x < 0.5 else ("right", "left")
    pairs = {
        "existence": (f"Is there a {t.shape} in this image?", f"Is there a {other} in this image?"),
        "count": (f"Are there {scene.count(t.shape)} {t.shape}s in the image?",
                  f"Are there {scene.count(t.shape) + 2} {t.shape}s in the image?"),
        "color": (f"Is the {t.shape} on the {side} {t.color}?", f"Is the {t.shape} on the {side} {wrong_color}?"),
        "position": (f"Is the {t.color} {t.shape} on the {side} of the image?",
                     f"Is the {t.color} {t.shape} on the {other_side} of the image?"),
        "OCR": (f"Is the word in the image \"{(scene.word or '').upper()}\"?", "Is the word in the image \"ZEBRA\"?"),
        "commonsense_reasoning": (f"Is the {t.shape} in this picture drawn in {t.color}?",
                                  f"Is the {t.shape} in this picture drawn in {wrong_color}?"),
        "numerical_calculation": (f"Is the number of shapes in the image {len(scene.things)}?",
                                  f"Is the number of shapes in the image {len(scene.things) + 3}?"),
    }
    yes, no = pairs[category]
    return f"{yes} Please answer yes or no.", f"{no} Please answer yes or no."


# perception and cognition categories interleaved, so a handful of pairs covers both of MME's scores
MME_CATEGORIES = ("existence", "color", "commonsense_reasoning", "count", "OCR", "position", "numerical_calculation")
MME_IMAGES = (("JPEG", "RGB"), ("PNG", "RGB"), ("PNG", "P"), ("JPEG", "L"))


def mme(painter: Painter, n: int) -> list[Table]:
    """lmms-lab MME (test): two rows per image, same question_id, answers Yes then No; ``n`` rounded up to even."""
    _, s, img = _f()
    table = Table("lmms-lab-encoder/MME", "default", "test",
                  {"question_id": s, "image": img, "question": s, "answer": s, "category": s})
    for i in range((n + 1) // 2):
        category = MME_CATEGORIES[i % len(MME_CATEGORIES)]
        scene = painter.scene(2, word=category == "OCR")
        fmt, mode = MME_IMAGES[i % len(MME_IMAGES)]
        image = encode(scene.image, fmt, mode)
        qid = f"{category}/{i:04d}.{'jpg' if fmt == 'JPEG' else 'png'}"
        for question, answer in zip(_yes_no_pair(scene, category), ("Yes", "No")):
            table.add(question_id=qid, image=image, question=question, answer=answer, category=category)
    return [table]


POPE_CATEGORIES = ("adversarial", "popular", "random")


def pope(painter: Painter, n: int, per_image: int = 2) -> list[Table]:
    """lmms-lab POPE (test): "Is there a X in the image?", a yes and a no per image (POPE reuses each image), or
    ``per_image`` questions (the real POPE asks 18 of each of its 500 images: 9000): after those two, "Is there a
    <colour> <shape> in the image?" alternately about what is drawn (yes) and what is not (no)."""
    _, s, img = _f()
    table = Table("lmms-lab-encoder/POPE", "default", "test",
                  {"id": s, "question_id": s, "question": s, "answer": s, "image_source": s, "image": img,
                   "category": s})
    i = 0
    while len(table) < n:
        scene = painter.scene(2)
        image = encode(scene.image, "JPEG", "L" if i % 4 == 3 else "RGB")
        source = f"COCO_val2014_{100000 + i:012d}"
        present, absent = scene.things[0].shape, scene.absent_shape() or "star"
        asked = [(f"Is there a {present} in the image?", "yes"), (f"Is there a {absent} in the image?", "no")]
        asked += _more_pope(scene, per_image - len(asked))
        for question, answer in asked[: min(per_image, n - len(table))]:
            table.add(id=str(len(table)), question_id=str(len(table) + 1), question=question, answer=answer,
                      image_source=source, image=image, category=POPE_CATEGORIES[i % 3])
        i += 1
    return [table]


def _more_pope(scene: Scene, n: int) -> list[tuple[str, str]]:
    """``n`` more POPE questions about ``scene`` (no random draws: the other documents stay as they are), a drawn
    thing (yes) and one not drawn (no) in turn."""
    drawn = [(t.color, t.shape) for t in scene.things]
    absent = [(c, sh) for c in list(COLORS)[:6] for sh in SHAPES if (c, sh) not in drawn]
    out = []
    for k in range(max(n, 0)):
        color, shape = drawn[k // 2 % len(drawn)] if k % 2 == 0 else absent[k // 2 % len(absent)]
        out.append((f"Is there a {color} {shape} in the image?", "yes" if k % 2 == 0 else "no"))
    return out


def _rotations(options: list[str], answer: int) -> list[tuple[list[str], int]]:
    """MMBench's circular evaluation: the options rotated k = 0..len-1 places, and where the answer went."""
    m = len(options)
    return [(options[k:] + options[:k], (answer - k) % m) for k in range(m)]


def mmbench(painter: Painter, n: int) -> list[Table]:
    """lmms-lab MMBench, config en, split dev: index (int64; circular copies at index + k*1e6, options rotated),
    question, hint (None for some), options A-D (None beyond the question's count), answer letter, categories."""
    datasets, s, img = _f()
    table = Table("lmms-lab-encoder/MMBench", "en", "dev",
                  {"index": datasets.Value("int64"), "question": s, "hint": s, "answer": s, "A": s, "B": s, "C": s,
                   "D": s, "category": s, "image": img, "source": s, "L2-category": s, "comment": s, "split": s})
    rows, q = [], 0
    while len(rows) < n:
        scene = painter.scene(1)
        t = scene.things[0]
        m = (4, 2, 3)[q % 3]  # options per question, as MMBench mixes them
        wrong = [c for c in list(COLORS)[:6] if c != t.color][: m - 1]
        options = [t.color, *wrong]
        order = painter.rng.permutation(m)
        options = [options[j] for j in order]
        answer = int(np.flatnonzero(order == 0)[0])
        image = encode(scene.image, *((("JPEG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"))[q % 3]))
        hint = None if q % 2 else f"The picture shows one {t.shape} drawn over a photograph."
        for k, (rotated, a) in enumerate(_rotations(options, answer)):
            letters = dict(zip("ABCD", rotated + [None] * (4 - m)))
            rows.append(dict(index=q + k * 1_000_000, question=f"What is the colour of the {t.shape}?", hint=hint,
                             answer="ABCD"[a], **letters, category="attribute_recognition", image=image,
                             source="promprune-standin", **{"L2-category": "finegrained_perception (instance-level)"},
                             comment=None, split="dev"))
        q += 1
    for row in sorted(rows, key=lambda r: r["index"])[:n]:  # the hub's order: every question, then each rotation
        table.add(**row)
    return [table]


def _ten_answers(answer: str, alternatives: list[str], painter: Painter) -> list[str]:
    """Ten human answers, seven agreeing: VQA accuracy of the agreed answer is 1 (each leave-one-out keeps >= 3)."""
    answers = [answer] * 7 + [painter.choice(alternatives) for _ in range(3)]
    return [answers[j] for j in painter.rng.permutation(10)]


def textvqa(painter: Painter, n: int) -> list[Table]:
    """lmms-lab textvqa (validation): a word drawn on the image; ten answers, OCR tokens."""
    datasets, s, img = _f()
    strings = datasets.List(s)
    table = Table("lmms-lab-encoder/textvqa", "default", "validation",
                  {"image_id": s, "question_id": datasets.Value("int32"), "question": s, "question_tokens": strings,
                   "image": img, "image_width": datasets.Value("int32"), "image_height": datasets.Value("int32"),
                   "flickr_original_url": s, "flickr_300k_url": s, "answers": strings, "image_classes": strings,
                   "set_name": s, "ocr_tokens": strings})
    for i in range(n):
        scene = painter.scene(1, word=True)
        question = "what word is written at the top of the image?"
        W, H = scene.image.size
        image_id = f"{zlib.crc32(f'textvqa{i}'.encode()):08x}{i:08x}"
        table.add(image_id=image_id, question_id=34602 + i, question=question, question_tokens=question[:-1].split(),
                  image=encode(scene.image, "JPEG", "L" if i % 3 == 2 else "RGB"), image_width=W, image_height=H,
                  flickr_original_url=f"https://farm1.staticflickr.com/{i}/{image_id}_o.jpg",
                  flickr_300k_url=f"https://c1.staticflickr.com/{i}/{image_id}_z.jpg",
                  answers=_ten_answers(scene.word, ["sign", "unanswerable", "text"], painter),
                  image_classes=["Sign", scene.things[0].shape.capitalize()], set_name="val",
                  ocr_tokens=[scene.word.upper()])
    return [table]


SQA_IMAGES = (("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"), ("PNG", "L"))


def scienceqa(painter: Painter, n: int) -> list[Table]:
    """lmms-lab ScienceQA, config ScienceQA-IMG, split test: choices (2-4), answer an int8 index, hint "" or text."""
    datasets, s, img = _f()
    table = Table("lmms-lab-encoder/ScienceQA", "ScienceQA-IMG", "test",
                  {"image": img, "question": s, "choices": datasets.List(s), "answer": datasets.Value("int8"),
                   "hint": s, "task": s, "grade": s, "subject": s, "topic": s, "category": s, "skill": s,
                   "lecture": s, "solution": s})
    for i in range(n):
        scene = painter.scene(1)
        shape = scene.things[0].shape
        m = 2 + i % 3
        choices = [shape, *[x for x in (*SHAPES, "star", "hexagon") if x != shape][: m - 1]]
        order = painter.rng.permutation(m)
        choices = [choices[j] for j in order]
        table.add(image=encode(scene.image, *SQA_IMAGES[i % len(SQA_IMAGES)]),
                  question="Which shape is drawn in the picture?", choices=choices,
                  answer=int(np.flatnonzero(order == 0)[0]),
                  hint="" if i % 2 else "Look at the coloured shape in front of the photograph.",
                  task="closed choice", grade=f"grade{3 + i % 4}", subject="natural science", topic="geometry",
                  category="Identify shapes", skill="Identify two-dimensional shapes",
                  lecture="A shape is named by its sides and corners.",
                  solution=f"The drawn shape is a {shape}.")
    return [table]


GQA_QUESTIONS_PER_IMAGE = 3


def gqa(painter: Painter, n: int) -> list[Table]:
    """lmms-lab GQA: config testdev_balanced_instructions (questions, ``imageId``) and testdev_balanced_images
    (``id``, image), both split testdev; utils.gqa_process_docs joins them. lmms-eval reads id, imageId, question
    and answer; the other fields follow GQA's question records as the lmms-lab conversion stores them."""
    datasets, s, img = _f()

    def struct(*names):
        return {k: s for k in names}

    questions = Table("lmms-lab-encoder/GQA", "testdev_balanced_instructions", "testdev",
                      {"id": s, "imageId": s, "question": s, "answer": s, "fullAnswer": s,
                       "isBalanced": datasets.Value("bool"), "groups": struct("global", "local"), "entailed": s,
                       "equivalent": s, "types": struct("structural", "semantic", "detailed"),
                       "annotations": struct("answer", "question", "fullAnswer"),
                       "semantic": datasets.List({"operation": s, "argument": s,
                                                  "dependencies": datasets.List(datasets.Value("int32"))}),
                       "semanticStr": s})
    images = Table("lmms-lab-encoder/GQA", "testdev_balanced_images", "testdev", {"id": s, "image": img})
    i = 0
    while len(questions) < n:
        scene = painter.scene(2)
        image_id = f"n{161313 + i}"
        images.add(id=image_id, image=encode(scene.image, "JPEG", "RGB"))
        a, b = scene.things
        asked = [(f"What color is the {a.shape} on the left?", a.color, f"The {a.shape} is {a.color}.", "query"),
                 (f"Is the {b.color} {b.shape} to the left or right of the {a.shape}?", "right",
                  f"The {b.shape} is to the right of the {a.shape}.", "choose"),
                 (f"Is there a {scene.absent_shape() or 'star'} in the picture?", "no",
                  "No, there is no such shape.", "verify")]
        for question, answer, full, kind in asked[: min(GQA_QUESTIONS_PER_IMAGE, n - len(questions))]:
            qid = f"20{len(questions):07d}"
            questions.add(id=qid, imageId=image_id, question=question, answer=answer, fullAnswer=full,
                          isBalanced=True, groups={"global": None, "local": f"10{kind}-{a.shape}"},
                          entailed="[]", equivalent=f"['{qid}']",
                          types={"structural": kind, "semantic": "attr", "detailed": f"{kind}Attr"},
                          annotations={"answer": "{}", "question": "{}", "fullAnswer": "{}"},
                          semantic=[{"operation": "select", "argument": f"{a.shape} (0)", "dependencies": []},
                                    {"operation": kind, "argument": "color", "dependencies": [0]}],
                          semanticStr=f"select: {a.shape} (0)->{kind}: color [0]")
        i += 1
    return [questions, images]


VQAV2_QUESTIONS_PER_IMAGE = 5  # VQAv2-val: 214,354 questions over 40,504 images, 5.3 per image


def vqav2(painter: Painter, n: int) -> list[Table]:
    """lmms-lab VQAv2 (validation): several questions per COCO-style image, ten answer records each."""
    datasets, s, img = _f()
    table = Table("lmms-lab-encoder/VQAv2", "default", "validation",
                  {"question_type": s, "multiple_choice_answer": s,
                   "answers": datasets.List({"answer": s, "answer_confidence": s,
                                             "answer_id": datasets.Value("int64")}),
                   "image_id": datasets.Value("int64"), "answer_type": s, "question_id": datasets.Value("int64"),
                   "question": s, "image": img})
    i = 0
    while len(table) < n:
        scene = painter.scene(2)
        image_id = 262148 + 7 * i
        image = encode(scene.image, "JPEG", "L" if i % 3 == 2 else "RGB")
        a, b = scene.things
        asked = [("what color is the", f"What color is the {a.shape} on the left?", a.color, "other"),
                 ("how many", f"How many {a.shape}s are there?", str(scene.count(a.shape)), "number"),
                 ("is there a", f"Is there a {scene.absent_shape() or 'star'}?", "no", "yes/no"),
                 ("what color is the", f"What color is the {b.shape} on the right?", b.color, "other"),
                 ("is the", f"Is the {a.shape} left of the {b.shape}?", "yes", "yes/no")]
        for k, (qtype, question, answer, atype) in enumerate(asked[: min(VQAV2_QUESTIONS_PER_IMAGE, n - len(table))]):
            alternatives = {"other": ["pink", "brown"], "number": ["3", "4"],
                            "yes/no": ["yes" if answer == "no" else "no"]}
            answers = _ten_answers(answer, alternatives[atype], painter)
            table.add(question_type=qtype, multiple_choice_answer=answer,
                      answers=[{"answer": x, "answer_confidence": "yes" if x == answer else "maybe", "answer_id": j + 1}
                               for j, x in enumerate(answers)],
                      image_id=image_id, answer_type=atype, question_id=image_id * 1000 + k, question=question,
                      image=image)
        i += 1
    return [table]


def vizwiz(painter: Painter, n: int) -> list[Table]:
    """lmms-lab VizWiz-VQA (val): question_id is the image file name, ten answers, some "unanswerable"."""
    datasets, s, img = _f()
    table = Table("lmms-lab-encoder/VizWiz-VQA", "default", "val",
                  {"question_id": s, "image": img, "question": s, "answers": datasets.List(s), "category": s})
    for i in range(n):
        scene = painter.scene(1, word=i % 3 == 1)
        t = scene.things[0]
        if i % 3 == 0:
            question, answer, category = f"What color is this {t.shape}?", t.color, "other"
        elif i % 3 == 1:
            question, answer, category = "What does this sign say?", scene.word, "other"
        else:  # a photo too blurred to answer, as many VizWiz photos are
            scene.image = scene.image.resize((8, 6)).resize(scene.image.size)
            question, answer, category = "What is the expiration date on this can?", "unanswerable", "unanswerable"
        table.add(question_id=f"VizWiz_val_{i:08d}.jpg", image=encode(scene.image, "JPEG", "RGB"), question=question,
                  answers=_ten_answers(answer, ["unsuitable", "unanswerable", "i don't know"], painter),
                  category=category)
    return [table]


MMVET_IMAGES = (("PNG", "RGBA"), ("JPEG", "RGB"), ("PNG", "P"))


def mmvet(painter: Painter, n: int) -> list[Table]:
    """lmms-lab MMVet (test): open answers (with MM-Vet's <AND> / <OR>), capability a comma-joined string."""
    _, s, img = _f()
    table = Table("lmms-lab-encoder/MMVet", "default", "test",
                  {"question_id": s, "image": img, "question": s, "answer": s, "image_source": s, "capability": s})
    for i in range(n):
        scene = painter.scene(2, word=i % 2 == 1)
        a, b = scene.things
        if i % 2:
            question, answer, capability = "What word is written in the image?", scene.word.upper(), "ocr,rec"
        else:
            question, answer, capability = ("What are the colours of the two shapes?", f"{a.color}<AND>{b.color}",
                                            "rec")
        table.add(question_id=f"v1_{i}", image=encode(scene.image, *MMVET_IMAGES[i % len(MMVET_IMAGES)]),
                  question=question, answer=answer, image_source=f"standin_{i}", capability=capability)
    return [table]


# lmms-eval task name -> the stand-in(s) of the hub data it loads
TASK_BUILDERS: dict[str, Callable[..., list[Table]]] = {
    "mme": mme, "pope": pope, "mmbench_en_dev_static": mmbench, "textvqa_val": textvqa,
    "scienceqa_img": scienceqa, "gqa": gqa, "vqav2_val": vqav2, "vizwiz_vqa_val": vizwiz, "mmvet": mmvet,
}
STANDIN_TASKS = tuple(TASK_BUILDERS)


# ---------------------------------------------------------------------------------------------------------------
# Writing them where datasets looks offline


def snake_dir(repo: str) -> str:
    """``lmms-lab-encoder/MMBench`` -> ``lmms-lab-encoder___mm_bench``: datasets' cache directory of a hub repo."""
    from datasets.naming import camelcase_to_snakecase

    org, name = repo.split("/")
    return f"{org}___{camelcase_to_snakecase(name)}"


def _stage_repo(tables: list[Table], stage: Path) -> Path:
    """A local copy of the hub repository: README with the ``configs:`` block, one parquet shard per split."""
    import datasets
    import yaml

    local = stage / tables[0].repo.split("/")[1]  # same name as the hub repo -> same snake-cased dataset name
    configs = {}
    for table in tables:
        relative = f"{table.config}/{table.split}-00000-of-00001.parquet"
        (local / table.config).mkdir(parents=True, exist_ok=True)
        features = datasets.Features(table.features)
        datasets.Dataset.from_dict(table.columns, features=features).to_parquet(str(local / relative))
        configs.setdefault(table.config, []).append({"split": table.split, "path": relative})
    card = {"configs": [{"config_name": name, "data_files": files} for name, files in configs.items()]}
    (local / "README.md").write_text("---\n" + yaml.safe_dump(card, sort_keys=False) + "---\n")
    return local


def _prepare(local: Path, config: str, staging_cache: Path, target_root: Path) -> Path:
    """Prepare one config with datasets' parquet builder, move it under the hub repo's cache name; returns its dir."""
    import datasets

    builder = datasets.load_dataset_builder(str(local), config, cache_dir=str(staging_cache))
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)  # staging_cache/<snake_name>/<config>/<version>/<hash>
    snake_name, *rest = prepared.relative_to(staging_cache).parts
    if f"___{snake_name}" not in target_root.name:
        raise RuntimeError(f"datasets named the staged copy {snake_name!r}, the hub's cache is {target_root.name!r}")
    target = target_root.joinpath(*rest)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(prepared), str(target))
    return target


def _check_replaceable(hf_home: Path, repos: list[str]) -> dict:
    """The marker of earlier stand-ins; refuses to touch a cache directory that no stand-in build wrote."""
    marker = hf_home / MARKER
    built = json.loads(marker.read_text()) if marker.exists() else {"datasets": []}
    for repo in repos:
        if (hf_home / "datasets" / snake_dir(repo)).exists() and repo not in built["datasets"]:
            raise FileExistsError(
                f"{hf_home / 'datasets' / snake_dir(repo)} exists and was not written by build_standins (no entry "
                f"for {repo} in {marker}); it may be the real dataset's cache. Build the stand-ins into a fresh "
                "HF_HOME.")
    return built


# stand-ins whose questions per image can be chosen (build_standins' per_image): POPE (default 2; the real one 18)
PER_IMAGE_TASKS = ("pope",)


def build_standins(hf_home: Path, tasks=STANDIN_TASKS, docs_per_task: int = 8, seed: int = 0,
                   per_image: dict[str, int] | None = None) -> Path:
    """Write stand-ins of the hub data of ``tasks`` (lmms-eval names) into ``hf_home/datasets``; returns ``hf_home``.

    ``docs_per_task`` documents each (MME: rounded up to whole pairs). Deterministic in ``seed``; each dataset draws
    from its own stream, so the documents of a task do not depend on which other tasks are built. Rebuilding
    replaces earlier stand-ins; an existing cache directory that no stand-in build wrote is an error.
    ``per_image``: questions per image of the tasks in :data:`PER_IMAGE_TASKS` (``{"pope": 18}``: POPE's shape;
    benchmarks/throughput.py).
    """
    per_image = dict(per_image or {})
    bad = {t: k for t, k in per_image.items() if t not in PER_IMAGE_TASKS or isinstance(k, bool)
           or not isinstance(k, int) or k < 2}
    if bad:
        raise ValueError(f"per_image sets questions per image (an int >= 2) of {list(PER_IMAGE_TASKS)}; got {bad}")
    hf_home = Path(hf_home)
    unknown = [t for t in tasks if t not in TASK_BUILDERS]
    if isinstance(tasks, str) or unknown or not tasks:
        raise ValueError(f"tasks must be a list of {list(STANDIN_TASKS)}; unknown: {unknown or tasks!r}")
    if isinstance(docs_per_task, bool) or not isinstance(docs_per_task, int) or docs_per_task < 1:
        raise ValueError(f"docs_per_task must be a positive int, got {docs_per_task!r}")
    by_repo: dict[str, list[Table]] = {}
    for task in tasks:
        painter = Painter(np.random.SeedSequence([seed, zlib.crc32(task.encode())]).generate_state(1)[0])
        extra = {"per_image": per_image[task]} if task in per_image else {}
        for table in TASK_BUILDERS[task](painter, docs_per_task, **extra):
            by_repo.setdefault(table.repo, []).append(table)
    built = _check_replaceable(hf_home, list(by_repo))
    cache = hf_home / "datasets"
    with tempfile.TemporaryDirectory(prefix="promprune-standins-") as tmp:
        for repo, tables in by_repo.items():
            shutil.rmtree(cache / snake_dir(repo), ignore_errors=True)
            local = _stage_repo(tables, Path(tmp) / "repos")
            for config in dict.fromkeys(t.config for t in tables):
                _prepare(local, config, Path(tmp) / "cache", cache / snake_dir(repo))
    built = {"version": STANDIN_VERSION, "seed": seed, "docs_per_task": docs_per_task, "per_image": per_image,
             "tasks": sorted(set(built.get("tasks", [])) | set(tasks)),
             "datasets": sorted(set(built["datasets"]) | set(by_repo))}
    (hf_home / MARKER).write_text(json.dumps(built, indent=1))
    return hf_home


def standin_env(hf_home: Path) -> dict[str, str]:
    """The environment under which a fresh process loads the stand-ins as the hub datasets (offline)."""
    hf_home = Path(hf_home)
    cache = str(hf_home / "datasets")
    # lmms-eval loads from LMMS_EVAL_DATASETS_CACHE when it is set, else from HF_DATASETS_CACHE
    return {"HF_HOME": str(hf_home), "HF_DATASETS_CACHE": cache, "LMMS_EVAL_DATASETS_CACHE": cache,
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _forget_lmms_eval_cache_dir() -> None:
    """lmms-eval 0.7.3 resolves its datasets cache directory once per process (an lru_cache on
    ``lmms_eval.api.task._resolve_hf_datasets_cache_dir``); forget it so the next task load reads the environment."""
    try:
        from lmms_eval.api import task
    except ImportError:
        return
    resolve = getattr(task, "_resolve_hf_datasets_cache_dir", None)
    if hasattr(resolve, "cache_clear"):
        resolve.cache_clear()


@contextlib.contextmanager
def serving(hf_home: Path):
    """Inside the block, this process loads the stand-ins in ``hf_home`` as the hub datasets, offline: the
    environment of :func:`standin_env`, plus what ``datasets`` and ``huggingface_hub`` read from it once, at import
    (the datasets cache, where lmms-eval's GQA utils load images without a ``cache_dir``; offline mode), and
    lmms-eval's once-per-process choice of its cache directory. Everything is restored afterwards."""
    import datasets.config
    import huggingface_hub.constants

    if not (Path(hf_home) / MARKER).exists():
        raise FileNotFoundError(f"no stand-ins in {hf_home} (no {MARKER}); build them with build_standins first")
    env = standin_env(hf_home)
    patched = [(datasets.config, "HF_DATASETS_CACHE", Path(env["HF_DATASETS_CACHE"])),
               (datasets.config, "HF_HUB_OFFLINE", True), (huggingface_hub.constants, "HF_HUB_OFFLINE", True)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    try:
        for module, name, value in patched:
            setattr(module, name, value)
        with temporary_env(**env):
            _forget_lmms_eval_cache_dir()
            yield Path(hf_home)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        _forget_lmms_eval_cache_dir()
