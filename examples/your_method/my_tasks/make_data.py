"""Write my_exist_medium.parquet, the data of the benchmark in this directory (already shipped; run again to change it).

A benchmark of your own is an lmms-eval task directory: a task YAML, the `utils.py` its `!function` tags name, and
its data (here a parquet file next to the YAML, found relative to it). This one asks the prominence testbed's
existence questions (balanced yes / no) on scenes of 5 to 8 objects, a density between the testbed's concentrated
(1-3) and spread-out (9-12) tasks, drawn from a block of the test scenes no shipped task uses.

    python my_tasks/make_data.py
"""
from __future__ import annotations

import io
from pathlib import Path

import datasets

from promprune.testbed import scenes

SCENES = 24  # two questions each: 48 documents, a quick benchmark
FIRST_SCENE = 900_000  # a block of the test stream the shipped testbed tasks do not draw from


def columns() -> dict[str, list]:
    out = {"question_id": [], "question": [], "answer": [], "image": []}
    for i in range(SCENES):
        scene = scenes.make_scene("test", FIRST_SCENE + i, num_objects=5 + i % 4)
        png = io.BytesIO()
        scenes.render(scene).save(png, format="PNG")
        for q in scenes.questions(scene, "exist"):
            out["question_id"].append(len(out["question_id"]))
            out["question"].append(q.question)
            out["answer"].append(q.answer)
            out["image"].append({"bytes": png.getvalue(), "path": None})
    return out


def main() -> None:
    features = datasets.Features({"question_id": datasets.Value("int64"), "question": datasets.Value("string"),
                                  "answer": datasets.Value("string"), "image": datasets.Image()})
    path = Path(__file__).with_name("my_exist_medium.parquet")
    datasets.Dataset.from_dict(columns(), features=features).to_parquet(str(path))
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
