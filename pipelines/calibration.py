"""mu calibration as the paper does it: the median of the prominence metric over calibration images.

A trial option ``mu: calibrate`` means: before the trials run, take ``calibration.n`` images from
``calibration.images`` (pretraining-style images, never the evaluation benchmarks' documents), compute the trial's
prominence metric (spectral entropy by default; feature-norm or attention entropy for the Fig. 4 ablation) on each
with the sweep's own model, and use the median as that trial's mu. The value actually used is logged as the trial's
``mu`` param (with ``mu_source: calibration``) and as ``calibration/median_<metric>`` on the sweep's parent run.

``calibration.images`` is a local folder of images (searched recursively; the paper used 1,000 images of LLaVA's
pretraining data: download e.g. ``liuhaotian/LLaVA-Pretrain``'s images once and point here), or
``hf:<dataset id>[:<split>[:<image column>]]`` for a Hugging Face dataset read in streaming mode, or
``testbed:<split>`` for rendered scenes of the prominence testbed (``testbed:train``: its training scenes, never
the evaluation ones).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, StrictInt, StrictStr, with_config

from pipelines.config import SECTION, expect

CALIBRATE = "calibrate"  # the option value that asks for a calibrated mu
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_METRIC = "spectral"


@with_config(SECTION)
@dataclass
class Calibration:
    """The spec's ``calibration:`` section."""

    # folder, or hf:<dataset id>[:<split>[:<column>]]; required when a trial calibrates mu
    images: Annotated[StrictStr | None, expect("a folder of images, hf:<dataset id> or testbed:<split>")] = None
    n: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")] = 1000  # images (the paper: 1,000)
    seed: Annotated[StrictInt, expect("an int")] = 0  # which images, when the source holds more than n
    batch_size: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")] = 8


def metrics_to_calibrate(trials) -> list[str]:
    """Prominence metrics of the trials whose ``mu`` is ``calibrate`` (sorted, unique)."""
    return sorted({t.options.get("metric", DEFAULT_METRIC) for t in trials if t.options.get("mu") == CALIBRATE})


def apply(options: dict, calibrated: dict[str, float]) -> dict:
    """``options`` with ``mu: calibrate`` replaced by the calibrated median of its metric (and ``mu_source``)."""
    if options.get("mu") != CALIBRATE:
        return options
    metric = options.get("metric", DEFAULT_METRIC)
    if metric not in calibrated:
        raise ValueError(f"mu: calibrate for metric {metric!r}, but the calibration measured {sorted(calibrated)}")
    return {**options, "mu": calibrated[metric]}


def check_source(images: str | None) -> str | None:
    """A problem with the calibration image source, or None."""
    if not images:
        return "calibration.images: required when a trial sets mu: calibrate (a folder of images, or hf:<dataset>)"
    if images.startswith("hf:"):
        return None if images[3:].split(":")[0] else f"calibration.images: {images!r} names no dataset"
    if images.startswith("testbed:"):
        from promprune.testbed.scenes import SPLITS

        split = images.split(":", 1)[1]
        return None if split in SPLITS else (f"calibration.images: {images!r}: the testbed has the splits "
                                             f"{', '.join(SPLITS)} (calibrate on testbed:train)")
    folder = Path(images).expanduser()
    if not folder.is_dir():
        from promprune.eval.task_checks import NotOnThisMachine  # a folder the machine running the sweep may have

        return NotOnThisMachine(f"calibration.images: {images!r} is not a folder here (give a folder of images, or "
                                "hf:<dataset id>)")
    if not any(p.suffix.lower() in IMAGE_SUFFIXES for p in folder.rglob("*")):
        return f"calibration.images: {images!r} holds no image ({', '.join(IMAGE_SUFFIXES)})"
    return None


def load_images(cal: Calibration) -> list:
    """``cal.n`` PIL images from the source, chosen reproducibly by ``cal.seed``."""
    from PIL import Image

    if cal.images.startswith("hf:"):
        import datasets

        name, split, column = (cal.images[3:].split(":") + ["train", "image"])[:3]
        stream = datasets.load_dataset(name, split=split, streaming=True).shuffle(seed=cal.seed, buffer_size=10_000)
        return [row[column].convert("RGB") for row in stream.take(cal.n)]
    if cal.images.startswith("testbed:"):
        from promprune.testbed import scenes

        rng = random.Random(cal.seed)
        return [scenes.render(scenes.make_scene(cal.images.split(":", 1)[1], rng.randrange(10 ** 9)))
                for _ in range(cal.n)]
    paths = sorted(p for p in Path(cal.images).expanduser().rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if len(paths) > cal.n:
        paths = sorted(random.Random(cal.seed).sample(paths, cal.n))
    return [Image.open(p).convert("RGB") for p in paths]


def image_entropies(vlm_factory, metrics: list[str], images: list, batch_size: int = 8) -> dict[str, list[float]]:
    """Each metric's value on each image: the number PromPrune compares with mu (``Generation.entropy``), from
    ``vlm.prepare`` (vision encoder and split only; nothing is generated). ``vlm_factory(metric)`` returns a
    PromPrune ``PrunedVLM`` using that metric."""
    out = {}
    for metric in metrics:
        vlm = vlm_factory(metric)
        values = []
        for start in range(0, len(images), batch_size):
            chunk = images[start:start + batch_size]
            values += [float(s["entropy"]) for s in vlm.prepare(chunk, ["Describe the image."] * len(chunk)).stats]
        out[metric] = values
    return out


def run(source, cal: Calibration, metrics: list[str], budget: int) -> dict[str, dict]:
    """Load the model from ``source`` here and `measure` every metric (a sweep measures on one of its model workers
    instead, which holds the model already: `pipelines.run.workers.Worker.calibrate`)."""
    return measure(source.load(method=None, budget=None), source.options, cal, metrics, budget)


def measure(base, adapter_options: dict, cal: Calibration, metrics: list[str], budget: int) -> dict[str, dict]:
    """Every metric on the calibration images, with ``base`` (the sweep's model, an unpruned ``PrunedVLM``) wrapped
    for PromPrune at ``budget`` with each metric. Returns ``{metric: {"median": m, "n": count, "values": [...]}}``."""
    images = load_images(cal)
    if not images:
        raise ValueError(f"calibration.images {cal.images!r} gave no image")

    def factory(metric):
        from promprune.models import PrunedVLM

        return PrunedVLM(base.model, base.processor, method="promprune", budget=budget, metric=metric,
                         **adapter_options)

    from promprune.selection import accel

    with accel.entropy("exact"):  # the median needs the entropies themselves, not the GPU split's certified bounds
        values = image_entropies(factory, metrics, images, cal.batch_size)
    return {m: {"median": statistics.median(v), "n": len(v), "values": v} for m, v in values.items()}
