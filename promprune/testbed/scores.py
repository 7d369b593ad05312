"""Per-family scores of a testbed model on TEST scenes, each family scored as its lmms-eval task scores it, with
the family's chance level beside it.

:func:`family_scores` runs the first ``n`` documents of task ``testbed_<family>`` through the sweep's own path
(``promprune.eval``: the task's prompt and ``generation_kwargs``, ``run_requests``, then lmms-eval's evaluation with
the task's ``process_results`` and aggregation) and reports the task's primary metric
(``promprune.eval.tasks.PRIMARY_METRICS``):

- ``exist``: ``f1``, F1 of "yes" (POPE's headline metric) on the first word of the answer (``normalize_yesno``);
  chance: a coin flip scores F1 0.5, answering "yes" always 0.667;
- ``attribute``: ``exact_match`` after normalization (``normalize_open``); chance 0.267 (a uniform guess: 1/5 for a
  colour, 1/3 for a shape, asked equally);
- ``relation``: ``accuracy`` of the first word's yes/no, balanced yes/no; chance 0.5;
- ``count``: ``exact_match`` after normalization; chance 1/12 (k uniform in 1..12).
"""
from __future__ import annotations

from promprune.testbed import scenes, tasks

CHANCE = {"exist": 0.5, "attribute": (1 / 5 + 1 / 3) / 2, "relation": 0.5, "count": 1 / scenes.MAX_OBJECTS}


def task_name(family: str) -> str:
    return f"testbed_{family}"


def family_questions(family: str, n: int) -> list[tuple[scenes.Scene, scenes.Question]]:
    """The first ``n`` questions of task ``testbed_<family>`` (test scenes, in the task's order)."""
    out = []
    for scene in tasks.task_scenes(family, "", 2 * n + 8):  # some scenes have no question of a family
        out += [(scene, q) for q in scenes.questions(scene, family)]
        if len(out) >= n:
            break
    return out[:n]


def answers(vlm, drawn, batch_size: int = 32) -> list[str]:
    """Greedy answers of ``vlm`` (a PrunedVLM) to ``drawn`` [(scene, question)], lower-cased, prompted and
    generated as each question's task does (its ``post_prompt`` and ``max_new_tokens``), the text not normalized."""
    from promprune.eval.tasks import task_config

    configs = {q.family: task_config(task_name(q.family)) for _, q in drawn}
    out: list[str] = [""] * len(drawn)
    for family, config in configs.items():  # one generate per family: its task's own max_new_tokens
        post = config["lmms_eval_specific_kwargs"]["default"]["post_prompt"]
        mine = [i for i, (_, q) in enumerate(drawn) if q.family == family]
        for start in range(0, len(mine), batch_size):
            chunk = mine[start:start + batch_size]
            gens = vlm.generate([scenes.render(drawn[i][0]) for i in chunk],
                                [drawn[i][1].question + post for i in chunk],
                                max_new_tokens=config["generation_kwargs"]["max_new_tokens"])
            for i, g in zip(chunk, gens):
                out[i] = g.text.strip().lower()
    return out


def family_scores(vlm, n: int = 96, families=scenes.FAMILIES, batch_size: int = 32) -> dict[str, dict]:
    """{family: {"score", "metric", "chance", "n"}} on the first ``n`` documents of each family's task, scored as
    a sweep scores them: ``score`` is the task's primary metric (``metric``: its lmms-eval name)."""
    from promprune.eval.requests import build_requests, run_requests
    from promprune.eval.scoring import score
    from promprune.eval.tasks import primary_metrics

    names = {family: task_name(family) for family in families}
    scored = score(run_requests(vlm, build_requests(list(names.values()), limit=n), batch_size=batch_size))
    result = {}
    for family, name in names.items():
        metric = primary_metrics(name)[0]
        result[family] = {"score": round(scored[name][metric], 4), "metric": metric,
                          "chance": round(CHANCE[family], 4), "n": int(scored[name]["n_samples"])}
    return result
