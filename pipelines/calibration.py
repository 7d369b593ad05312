"""mu calibration as the paper does it: the median of the prominence metric over calibration images.

A trial option ``mu: calibrate`` means: before the trials run, take ``calibration.n`` images from
``calibration.images`` (pretraining-style images, never the evaluation benchmarks' documents), compute the trial's
prominence metric (spectral entropy by default; feature-norm or attention entropy for the Fig. 4 ablation) on each
with the sweep's own model, and use the median as that trial's mu. The value actually used is logged as the trial's
``mu`` param (with ``mu_source: calibration``) and as ``calibration/median_<metric>`` on the sweep's parent run,
with ``calibration/images``, the images measured (the param ``calibration_images`` names the source).

``calibration.images`` is a local folder of images (searched recursively; the paper used 1,000 images of LLaVA's
pretraining data: download e.g. ``liuhaotian/LLaVA-Pretrain``'s images once and point here), or
``hf:<dataset id>[:<split>[:<image column>]]`` for a Hugging Face dataset read in streaming mode, or
``testbed:<split>`` for rendered scenes of the prominence testbed (``testbed:train``: its training scenes, never
the evaluation ones).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, StrictInt, StrictStr, with_config

from pipelines.config import SECTION, expect

CALIBRATE = "calibrate"  # the option value that asks for a calibrated mu
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_METRIC = "spectral"
# on the sweep's parent run: the median of each metric measured (calibration/median_spectral, ...), and the images
# measured (fewer than calibration.n when the folder holds fewer)
MEDIAN_PREFIX, IMAGES_METRIC = "calibration/median_", "calibration/images"


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


def budget_of(trials) -> int:
    """The budget a sweep calibrates at: the smallest of its ``mu: calibrate`` trials'."""
    return min(t.budget for t in trials if t.options.get("mu") == CALIBRATE)


def apply(options: dict, calibrated: dict[str, float]) -> dict:
    """``options`` with ``mu: calibrate`` replaced by the calibrated median of its metric (and ``mu_source``)."""
    if options.get("mu") != CALIBRATE:
        return options
    metric = options.get("metric", DEFAULT_METRIC)
    if metric not in calibrated:
        raise ValueError(f"mu: calibrate for metric {metric!r}, but the calibration measured {sorted(calibrated)}")
    return {**options, "mu": calibrated[metric]}


def image_files(folder: str | Path) -> Iterator[Path]:
    """The image files under ``folder`` (recursively, by suffix: :data:`IMAGE_SUFFIXES`), none of them opened."""
    return (p for p in Path(folder).expanduser().rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def check_source(images: str | None, n: int | None = None) -> str | None:
    """A problem with the calibration image source, or None. With ``n`` (``calibration.n``), a local folder that
    holds fewer images than ``n`` is no problem (the calibration uses them all) but gets a console note naming how
    many it holds: files counted up to ``n``, none decoded."""
    if not images:
        return ("calibration.images: required when a trial sets mu: calibrate (a folder of images, hf:<dataset> or "
                "testbed:<split>)")
    if images.startswith("hf:"):
        repo = images[3:].split(":")[0]
        if not repo:
            return f"calibration.images: {images!r} names no dataset"
        from promprune.eval.task_checks import hub_dataset_problem  # not here and no hub: before Ray, not after

        return hub_dataset_problem(repo, f"calibration.images ({images!r}) reads",
                                   "give a folder of images instead, or calibrate on testbed:train (the testbed's "
                                   "model only)")
    if images.startswith("testbed:"):
        from promprune.testbed.scenes import SPLITS

        split = images.split(":", 1)[1]
        return None if split in SPLITS else (f"calibration.images: {images!r}: the testbed has the splits "
                                             f"{', '.join(SPLITS)} (calibrate on testbed:train)")
    folder = Path(images).expanduser()
    if not folder.is_dir():
        from promprune.eval.task_checks import NotOnThisMachine  # a folder the machine running the sweep may have

        return NotOnThisMachine(f"calibration.images: {images!r} is not a folder here (give a folder of images, "
                                "hf:<dataset id> or testbed:<split>)")
    held = sum(1 for _ in itertools.islice(image_files(folder), n or 1))
    if not held:
        return f"calibration.images: {images!r} holds no image ({', '.join(IMAGE_SUFFIXES)})"
    if n is not None and held < n:
        from pipelines.console import say

        say(f"note: calibration.images: {images!r} holds {held} image{'s' if held != 1 else ''}, fewer than "
            f"calibration.n = {n}, so mu is calibrated on those {held} (the paper used 1,000 pretraining images): add "
            f"images to the folder, or set calibration.n to {held} to say what is used")
    return None


def load_images(cal: Calibration) -> list:
    """``cal.n`` PIL images from the source, chosen reproducibly by ``cal.seed``, converted to RGB as the evaluation
    converts its images (``promprune.models.images``: transparency onto white, 16-bit scaled, files upright by their
    EXIF orientation). A file that does not decode is a ValueError naming it."""
    from promprune.models.images import as_rgb, load_image

    if cal.images.startswith("hf:"):
        import datasets

        name, split, column = (cal.images[3:].split(":") + ["train", "image"])[:3]
        stream = datasets.load_dataset(name, split=split, streaming=True).shuffle(seed=cal.seed, buffer_size=10_000)
        return [as_rgb(row[column]) for row in stream.take(cal.n)]
    if cal.images.startswith("testbed:"):
        from promprune.testbed import scenes

        rng = random.Random(cal.seed)
        return [scenes.render(scenes.make_scene(cal.images.split(":", 1)[1], rng.randrange(10 ** 9)))
                for _ in range(cal.n)]
    paths = sorted(image_files(cal.images))
    if len(paths) > cal.n:
        paths = sorted(random.Random(cal.seed).sample(paths, cal.n))
    images = []
    for i, p in enumerate(paths):
        try:
            images.append(load_image(p, i))
        except ValueError as err:
            raise ValueError(f"calibration.images: {p}: {err.__cause__ or err} (remove or replace the file)") from None
    return images


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


# ---- calibrations measured once and shipped -------------------------------------------------------------------------
# A calibration is a deterministic function of the model's weights, its dtype and options, the device kind, the
# images (source, n, seed, batch size), the metrics and the budget. Where the weights can be named without loading
# them (the shipped testbed:llava: its sha256), a calibration measured once is shipped here under a digest of all
# of that (`key`), and a sweep with the same settings reads it instead of measuring again (the quickstart's 500
# scenes: seconds of a 2-core machine's CPU). `tests/pipelines/test_calibration.py` measures the shipped entries
# again and compares them exactly (float64); `python -m pipelines.calibration --ship SPEC` (re)writes an entry.
SHIPPED = Path(__file__).with_name("calibrations.json")
VERSION = 1  # bump when the prominence metrics or the calibration code change what a calibration measures


def weights_identity(pretrained: str) -> str | None:
    """A name for exactly the weights ``pretrained`` loads, without loading them, or None (then a calibration is
    always measured): the shipped ``testbed:llava`` (its manifest's sha256, which the driver's `prepare_model`
    checks against the file before anything runs)."""
    if pretrained != "testbed:llava":
        return None
    from promprune.testbed import shipped, zoo

    return f"testbed:llava sha256:{shipped.manifest()['sha256']}" if zoo.shipped_in_use() else None


def settings(source, cal: Calibration, metrics: list[str], budget: int, on_gpu: bool) -> dict | None:
    """Everything a calibration's values depend on, or None when the weights cannot be named (`weights_identity`)."""
    identity = weights_identity(source.pretrained)
    if identity is None:
        return None
    return {"version": VERSION, "weights": identity, "dtype": str(source.dtype), "options": source.options,
            "attn_implementation": source.attn_implementation, "device": "gpu" if on_gpu else "cpu",
            "images": cal.images, "n": cal.n, "seed": cal.seed, "batch_size": cal.batch_size,
            "metrics": sorted(metrics), "budget": budget}


def key(described: dict) -> str:
    """The digest of a calibration's `settings`."""
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:24]


def shipped_results(described: dict | None) -> dict[str, dict] | None:
    """The shipped results (as `measure` returns them) of a calibration with exactly these `settings`, or None."""
    if described is None or not SHIPPED.exists():
        return None
    entry = json.loads(SHIPPED.read_text()).get(key(described))
    return None if entry is None or entry["settings"] != _plain(described) else entry["results"]


def _plain(described: dict) -> dict:
    """``described`` as JSON reads it back (tuples as lists, other values as strings)."""
    return json.loads(json.dumps(described, default=str))


def ship(spec_path: str, overrides: list[str] | None = None) -> str:
    """Measure the calibration a spec's ``mu: calibrate`` trials need here (CPU) and write it to `SHIPPED`;
    returns its key. A spec with nothing to ship here (no such trial, weights that cannot be named, calibration
    images this machine cannot read: `check_source`) raises SpecError before the model loads."""
    from pipelines import spec as specs

    spec = specs.load(spec_path, overrides or [])
    trials = specs.expand(spec)
    metrics = metrics_to_calibrate(trials)
    if not metrics:
        raise specs.SpecError(["trials: no trial sets mu: calibrate, so there is no calibration to ship (add one, "
                               "e.g. --set 'trials=[{method: promprune, budget: 16, mu: calibrate}]')"], spec_path)
    problem = check_source(spec.calibration.images, spec.calibration.n)
    if problem:
        raise specs.SpecError([problem], spec_path)
    budget = budget_of(trials)
    described = settings(spec.model, spec.calibration, metrics, budget, on_gpu=False)
    if described is None:
        raise specs.SpecError([f"model.pretrained: {spec.model.pretrained}'s weights cannot be named without loading "
                               "them, and only calibrations of named weights are shipped (testbed:llava's); a sweep "
                               "of this model measures its calibration when it starts"], spec_path)
    results = run(spec.model, spec.calibration, metrics, budget)
    entries = json.loads(SHIPPED.read_text()) if SHIPPED.exists() else {}
    entries[key(described)] = {"settings": _plain(described), "results": results,
                               "measured": f"{time.strftime('%Y-%m-%d')}: python -m pipelines.calibration --ship "
                                           f"{spec_path}"}
    SHIPPED.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    return key(described)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from pipelines import spec as specs
    from pipelines.frontdoor import EXIT_BAD_INPUT

    parser = argparse.ArgumentParser(description="Ship the calibration of a spec's mu: calibrate trials "
                                                 f"({SHIPPED.name}): measured here, on the CPU.")
    parser.add_argument("--ship", required=True, metavar="SPEC", help="a sweep spec, e.g. sweeps/quickstart.yaml")
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="spec overrides (key=value)")
    args = parser.parse_args(argv)
    try:
        shipped = ship(args.ship, args.overrides)
    except specs.SpecError as exc:  # a spec that cannot be read, is wrong or ships nothing: its paragraph, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{SHIPPED}: {shipped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
