"""The testbed's evaluation data: one table per lmms-eval task, from the TEST seed stream (never trained on).

Tasks (``promprune.eval.tasks.TESTBED_TASKS``):

- ``testbed_exist`` (POPE protocol: random / popular / adversarial negatives, balanced yes/no), ``testbed_count``,
  ``testbed_attribute``, ``testbed_relation``: scenes with k uniform in 1..12, plain and cluttered backgrounds.
- ``testbed_{exist,count}_{concentrated,spread}``: the same questions on scenes of 1-3 objects (meaning
  concentrated in a few tokens) and of 9-12 objects (spread over the image): the axis the paper's adaptive split is
  about (its Fig. 1a). Each object count comes equally often, and on the existence tasks with each of POPE's three
  negative categories equally often.

Each document carries its scene's ground truth: ``num_objects``, ``spread``, ``coverage``, ``background`` and the
object list, so any per-sample statistic can be related to the known prominence.
"""
from __future__ import annotations

import io

from promprune.testbed import scenes

IMAGES = 200  # scenes per task (the yes/no, attribute and relation tasks ask 2 questions per scene)
REGIMES = {"": None, "_concentrated": (1, 3), "_spread": (9, 12)}
# each task draws its scenes from its own block of the test stream
_OFFSETS = {"exist": 0, "count": 10_000, "attribute": 20_000, "relation": 30_000}
_REGIME_OFFSETS = {"": 0, "_concentrated": 100_000, "_spread": 200_000}


def task_scenes(family: str, regime: str = "", n: int = IMAGES) -> list[scenes.Scene]:
    """The scenes of task ``testbed_<family><regime>``, deterministic."""
    base = _OFFSETS[family] + _REGIME_OFFSETS[regime]
    bounds = REGIMES[regime]
    out = []
    cycle = len(scenes.POPE_CATEGORIES)  # an existence question's negatives follow the scene index modulo this
    for i in range(n):
        k = None
        if bounds is not None:
            # cycle through the regime's object counts, one step per full cycle of the negative categories, so that
            # every (count, category) pair comes equally often: stepping k with i, 1-3 objects moved in lockstep
            # with the category (1 object: always "popular")
            k = bounds[0] + (i // cycle) % (bounds[1] - bounds[0] + 1)
        out.append(scenes.make_scene("test", base + i, num_objects=k))
    return out


def _png(scene: scenes.Scene) -> bytes:
    buffer = io.BytesIO()
    scenes.render(scene).save(buffer, format="PNG")
    return buffer.getvalue()


def table(family: str, regime: str = "", n: int = IMAGES) -> dict:
    """Column dict of task ``testbed_<family><regime>``."""
    columns: dict[str, list] = {name: [] for name in (
        "question_id", "image_id", "question", "answer", "image", "family", "category", "num_objects", "spread",
        "coverage", "background", "objects")}
    for scene in task_scenes(family, regime, n):
        png, truth = None, scene.truth()
        for q in scenes.questions(scene, family):
            png = png or _png(scene)
            row = {"question_id": len(columns["question_id"]), "image_id": scene.index, "question": q.question,
                   "answer": q.answer, "image": {"bytes": png, "path": None}, "family": q.family,
                   "category": q.category, **truth}
            for name, value in row.items():
                columns[name].append(value)
    return columns


def tables(n: int = IMAGES) -> dict[str, dict]:
    """{task name: columns} for every testbed task."""
    out = {}
    for family in scenes.FAMILIES:
        for regime in REGIMES:
            if regime and family not in ("exist", "count"):
                continue
            out[f"testbed_{family}{regime}"] = table(family, regime, n)
    return out
