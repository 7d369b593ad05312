"""Per-family accuracy of a testbed model on TEST scenes, with each family's chance level beside it.

- ``exist``: F1 of "yes" (POPE's headline metric); chance: a coin flip scores F1 0.5, answering "yes" always 0.667;
- ``attribute``: exact match; chance 0.267 (a uniform guess: 1/5 for a colour, 1/3 for a shape, asked equally);
- ``relation``: exact match, balanced yes/no; chance 0.5;
- ``count``: exact match; chance 1/12 (k uniform in 1..12).
"""
from __future__ import annotations

from promprune.testbed import scenes, tasks

CHANCE = {"exist": 0.5, "attribute": (1 / 5 + 1 / 3) / 2, "relation": 0.5, "count": 1 / scenes.MAX_OBJECTS}
POST_PROMPTS = {"exist": "\nAnswer with yes or no.", "relation": "\nAnswer with yes or no.",
                "count": "\nAnswer with a number.", "attribute": "\nAnswer with one word."}


def family_questions(family: str, n: int) -> list[tuple[scenes.Scene, scenes.Question]]:
    """The first ``n`` questions of task ``testbed_<family>`` (test scenes, in the task's order)."""
    out = []
    for scene in tasks.task_scenes(family, "", 2 * n + 8):  # some scenes have no question of a family
        out += [(scene, q) for q in scenes.questions(scene, family)]
        if len(out) >= n:
            break
    return out[:n]


def f1_yes(predictions: list[str], answers: list[str]) -> float:
    tp = sum(p == "yes" and a == "yes" for p, a in zip(predictions, answers))
    fp = sum(p == "yes" and a != "yes" for p, a in zip(predictions, answers))
    fn = sum(p != "yes" and a == "yes" for p, a in zip(predictions, answers))
    return 2 * tp / max(2 * tp + fp + fn, 1)


def answers(vlm, drawn, batch_size: int = 32) -> list[str]:
    """Greedy answers of ``vlm`` (a PrunedVLM) to ``drawn`` [(scene, question)], lower-cased."""
    out = []
    for i in range(0, len(drawn), batch_size):
        chunk = drawn[i:i + batch_size]
        gens = vlm.generate([scenes.render(s) for s, _ in chunk],
                            [q.question + POST_PROMPTS[q.family] for _, q in chunk], max_new_tokens=3)
        out += [g.text.strip().lower() for g in gens]
    return out


def family_scores(vlm, n: int = 96, families=scenes.FAMILIES) -> dict[str, dict]:
    """{family: {"score", "metric", "chance", "n"}} on the first ``n`` test questions of each family."""
    result = {}
    for family in families:
        drawn = family_questions(family, n)
        pred, gold = answers(vlm, drawn), [q.answer for _, q in drawn]
        if family == "exist":
            score, metric = f1_yes(pred, gold), "F1"
        else:
            score, metric = sum(p == g for p, g in zip(pred, gold)) / len(gold), "accuracy"
        result[family] = {"score": round(score, 4), "metric": metric, "chance": round(CHANCE[family], 4),
                          "n": len(gold)}
    return result
