"""The testbed's scenes and questions: deterministic, ground truth consistent with the pixels, questions answerable."""
import collections
import itertools
import math

import numpy as np
import pytest

from promprune.testbed import scenes, tasks


def test_scenes_are_deterministic_and_splits_disjoint():
    a, b = scenes.make_scene("test", 7), scenes.make_scene("test", 7)
    assert a == b and np.array_equal(np.asarray(scenes.render(a)), np.asarray(scenes.render(b)))
    train = {scenes.make_scene("train", i).objects for i in range(300)}
    test = {scenes.make_scene("test", i).objects for i in range(300)}
    assert not train & test  # no test scene is a training scene
    with pytest.raises(ValueError, match="unknown split"):
        scenes.make_scene("val", 0)


def test_ground_truth_hand_worked():
    two = scenes.Scene("test", 0, (scenes.Obj("red", "square", "large", 0, 0, 0, 0),
                                   scenes.Obj("blue", "circle", "small", 0, 2, 0, 0)), "plain", 1)
    # centres (8, 8) and (40, 8): centroid (24, 8), each 16 px away -> RMS 16 px = 1/6 of 96
    assert two.spread == pytest.approx(16 / 96)
    assert two.coverage == pytest.approx((14 ** 2 + 9 ** 2) / 96 ** 2)
    assert scenes.make_scene("test", 3, num_objects=1).spread == 0.0


def test_rendered_pixels_match_the_objects():
    scene = scenes.make_scene("test", 11, num_objects=6, background="plain")
    pixels = np.asarray(scenes.render(scene)).astype(int)
    for obj in scene.objects:
        cx, cy = (int(v) for v in obj.center)
        assert tuple(pixels[cy, cx]) == scenes.COLORS[obj.color], obj  # each object's centre has its colour
    occupied = {(o.row, o.col) for o in scene.objects}
    for r in range(scenes.GRID):
        for c in range(scenes.GRID):
            if (r, c) not in occupied:  # empty cells keep the plain background colour
                centre = pixels[r * 16 + 8, c * 16 + 8]
                assert tuple(centre) not in scenes.COLORS.values()


def test_questions_answers_follow_from_the_scene():
    for index in range(60):
        scene = scenes.make_scene("test", index)
        present = {(o.color, o.shape) for o in scene.objects}
        for q in scenes.questions(scene, "exist"):
            words = q.question.split()
            assert (q.answer == "yes") == ((words[3], words[4]) in present)
            if q.answer == "no" and q.category == "adversarial":
                assert any(words[3] == c or words[4] == s for c, s in present)
        (count,) = scenes.questions(scene, "count")
        assert count.answer == str(len(scene.objects))
        for q in scenes.questions(scene, "attribute"):
            region = q.question.split(" at the ")[1].rstrip("?")
            (obj,) = [o for o in scene.objects if o.region == region]  # exactly one object there
            assert q.answer == (obj.color if q.category == "color" else obj.shape)
        for q in scenes.questions(scene, "relation"):
            a, b = ({o.name: o for o in scene.objects}[n] for n in _names(q.question))
            (ax, ay), (bx, by) = a.center, b.center
            truth = {"left of": ax < bx, "right of": ax > bx, "above": ay < by, "below": ay > by}[q.category]
            assert (q.answer == "yes") == truth


def _names(question):
    body = question[len("Is the "):-1]
    for relation in scenes.RELATIONS:
        if f" {relation} the " in body:
            a, b = body.split(f" {relation} the ")
            return a, b
    raise AssertionError(question)


def test_task_tables_balanced_and_regimes_hold():
    exist = tasks.table("exist", n=60)
    assert collections.Counter(exist["answer"]) == {"yes": 60, "no": 60}
    assert set(exist["category"]) == set(scenes.POPE_CATEGORIES)
    spread = tasks.table("count", "_spread", n=20)
    concentrated = tasks.table("count", "_concentrated", n=20)
    assert min(spread["num_objects"]) >= 9 and max(concentrated["num_objects"]) <= 3
    assert np.mean(spread["spread"]) > np.mean(concentrated["spread"])
    assert not math.isnan(sum(spread["coverage"]))



def test_every_tasks_design_factors_are_crossed():
    """On every testbed task the design factors a document carries (object count, question category, background) are
    independent of each other: counted per scene (per question where the category is, as attribute's colour / shape),
    no pair's contingency table departs from independence (chi-square p > 0.01; the smallest on these tables is
    0.18). On the regime tasks, which cycle their object counts, every (count, category) pair comes equally often
    (within one scene): with the count stepped by the scene index, 1-3 objects moved in lockstep with POPE's negative
    category (1 object: always "popular"; p ~ 1e-171)."""
    from scipy.stats import chi2_contingency

    for name, table in tasks.tables().items():
        for a, b in itertools.combinations(("num_objects", "category", "background"), 2):
            levels_a, levels_b = sorted(set(table[a])), sorted(set(table[b]))
            if len(levels_a) < 2 or len(levels_b) < 2:  # count has no category
                continue
            cells = collections.Counter((x, y) for _, x, y in set(zip(table["image_id"], table[a], table[b])))
            grid = [[cells[(x, y)] for y in levels_b] for x in levels_a]
            assert chi2_contingency(grid).pvalue > 0.01, (name, a, b, grid)
            if name.endswith(("_concentrated", "_spread")) and (a, b) == ("num_objects", "category"):
                assert max(map(max, grid)) - min(map(min, grid)) <= 1, (name, grid)
    concentrated = tasks.table("exist", "_concentrated")
    negatives = collections.Counter((k, c) for k, c, answer in zip(concentrated["num_objects"],
                                                                    concentrated["category"], concentrated["answer"])
                                    if answer == "no")
    assert set(negatives) == {(k, c) for k in (1, 2, 3) for c in scenes.POPE_CATEGORIES}

def test_questions_name_the_objects_they_are_about():
    for index in range(40):
        scene = scenes.make_scene("test", index)
        for family in scenes.FAMILIES:
            for q in scenes.questions(scene, family):
                named = [scene.objects[i] for i in q.refs]
                if family == "count":
                    assert len(named) == scene.num_objects
                elif family == "exist":
                    assert (q.answer == "yes") == (len(named) == 1)
                    assert all(o.name in q.question for o in named)
                elif family == "attribute":
                    (obj,) = named
                    assert obj.region in q.question
                else:
                    a, b = named
                    assert q.question.startswith(f"Is the {a.name} ") and q.question.endswith(f" the {b.name}?")


def _digest(rows) -> str:
    import hashlib

    return hashlib.sha256(repr(list(rows)).encode()).hexdigest()[:16]


def test_the_task_cache_version_moves_with_the_documents():
    """The offline task parquet is cached under ``<suite>_<version>`` (``promprune.eval.tasks.SUITES``) and never
    rebuilt while it exists, so a change to the documents must bump the version, or a machine that built the old
    ones keeps serving them. The documents' text (not their images) is pinned here against the version: when this
    fails, bump the suite's version in SUITES and record the new digest beside it."""
    from promprune.eval.tasks import SUITES
    from promprune.testbed import video_tasks

    columns = ("question", "answer", "category", "num_objects", "background", "objects")
    testbed = _digest((name, [table[c] for c in columns]) for name, table in tasks.tables().items())
    video = _digest((scene.index, obj, answer, options) for scene, obj, answer, options in video_tasks.documents())
    assert {"testbed": (SUITES["testbed"][1], testbed), "testbed_video": (SUITES["testbed_video"][1], video)} == {
        "testbed": ("v2", "b8442d7cf5472289"), "testbed_video": ("v2", "41a99bc1c69a4530")}
