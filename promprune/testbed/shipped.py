"""The shipped ``testbed:llava`` weights: trained once with the recipe in :mod:`promprune.testbed.training` and
committed (``promprune/testbed/weights/``), as a model zoo ships its checkpoints, so nobody waits for a training.

``weights/`` holds ``model.safetensors`` and ``config.json`` (``LlavaForConditionalGeneration.save_pretrained``) and
``testbed-llava.json``: the recipe version, seed, hyper-parameters, the exact command that reproduces the file, the
sha256 of both files (``files``; ``sha256``: the weights'), the per-family scores (with chance levels) unpruned and
pruned, and a few fixed questions with the greedy answers the weights gave when they were made (the tests check the
checksums and the answers). Loading verifies both files: an edited ``config.json`` (``vision_feature_layer: -1``)
would load the same weights into another model, silently worse.

Score weights without writing anything (the manifest's ``scores``, as the tasks score them today)::

    python -m promprune.testbed.shipped --evaluate promprune/testbed/weights

Reproduce (about 1.5 hours of one CPU thread; one thread gives the same weights on one CPU type, not across them)::

    python -m promprune.testbed.shipped --out promprune/testbed/weights
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

WEIGHTS_DIR = Path(__file__).parent / "weights"
MANIFEST = "testbed-llava.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
VERIFIED_FILES = (WEIGHTS_FILE, CONFIG_FILE)  # every file of the folder the load reads; the manifest's ``files``
# read by from_pretrained when present (the generation defaults), but never saved with the weights: refused unless the
# manifest records it
UNSAVED_READ = ("generation_config.json",)
FIXED_PER_FAMILY = 2  # the manifest records the answers to the first 2 test questions of each family


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(directory: Path = WEIGHTS_DIR) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path}: no testbed manifest (make one with python -m promprune.testbed.shipped)")
    return json.loads(path.read_text())


def available(directory: Path = WEIGHTS_DIR) -> bool:
    directory = Path(directory)
    return all((directory / name).exists() for name in (MANIFEST, *VERIFIED_FILES))


def load(directory: Path = WEIGHTS_DIR, *, verify: bool = True):
    """The ``LlavaForConditionalGeneration`` in ``directory`` (float32, eval), the sha256 of its weights and its
    config checked against the manifest (:func:`check`) and its recipe version against the code's."""
    from transformers import LlavaForConditionalGeneration

    directory = Path(directory)
    check(directory, checksum=verify)
    return LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()


def check(directory: Path, *, checksum: bool) -> None:
    """ValueError unless the manifest's recipe is the code's and (``checksum``) the sha256 of each file the load reads
    (:data:`VERIFIED_FILES`) is the manifest's: a mismatch names the file and both digests. A manifest made before
    it recorded ``config.json``'s digest (``files``) has that file unverified, with a warning; a
    ``generation_config.json`` the manifest does not record is refused (the load would read it)."""
    from promprune.testbed import RECIPE

    directory = Path(directory)
    meta = manifest(directory)
    if meta.get("recipe") != RECIPE:
        raise ValueError(f"{directory / MANIFEST}: recipe {meta.get('recipe')!r}, but this code trains recipe "
                         f"{RECIPE!r}: retrain (python -m promprune.testbed.shipped --out {directory})")
    if not checksum:
        return
    recorded = {WEIGHTS_FILE: meta.get("sha256"), **(meta.get("files") or {})}
    for name in (*VERIFIED_FILES, *(n for n in UNSAVED_READ if n not in recorded and (directory / n).exists())):
        if name not in recorded:
            if name in UNSAVED_READ:
                raise ValueError(f"{directory / name}: the load would read this file (transformers' generation "
                                 f"defaults), but it is not one of the files the manifest {MANIFEST} records "
                                 f"({', '.join(VERIFIED_FILES)}): remove it")
            log.warning("%s: the manifest records no sha256 of %s (made before it did), so that file is not verified;"
                        " remake the folder (python -m promprune.testbed.shipped --out %s) to verify it", directory,
                        name, directory)
            continue
        found = sha256(directory / name)
        if found != recorded[name]:
            raise ValueError(f"{directory / name}: sha256 {found} does not match the manifest's {recorded[name]} (a "
                             f"corrupted, edited or replaced file: the load reads it with the weights, so another "
                             f"one would give another model); restore the file that came with the weights, or remake "
                             f"the folder (python -m promprune.testbed.shipped --out {directory})")


def file_digests(directory: Path) -> dict[str, str]:
    """{name: sha256} of the files the load reads (:data:`VERIFIED_FILES`): the manifest's ``files``."""
    return {name: sha256(Path(directory) / name) for name in VERIFIED_FILES}


def fixed_questions() -> list[tuple]:
    """[(scene, question)]: the first :data:`FIXED_PER_FAMILY` questions of each family's test task."""
    from promprune.testbed import scenes, scores

    return [d for family in scenes.FAMILIES for d in scores.family_questions(family, FIXED_PER_FAMILY)]


def fixed_answers(model, processor) -> list[dict]:
    """The greedy answers of ``model`` to :func:`fixed_questions`, with the questions and the truth."""
    from promprune.models import PrunedVLM
    from promprune.testbed import scores

    drawn = fixed_questions()
    said = scores.answers(PrunedVLM(model, processor, method=None), drawn)
    return [{"family": q.family, "scene": s.index, "question": q.question, "truth": q.answer, "answer": a}
            for (s, q), a in zip(drawn, said)]


def evaluate(model, processor, n: int, budget: int, methods=("random", "divprune", "vispruner", "promprune")) -> dict:
    """Per-family scores unpruned and at ``budget`` tokens per method (PromPrune with its default mu)."""
    from promprune.models import PrunedVLM
    from promprune.testbed import scores

    out = {"unpruned": scores.family_scores(PrunedVLM(model, processor, method=None), n)}
    for method in methods:
        out[f"{method}@{budget}"] = scores.family_scores(PrunedVLM(model, processor, method=method, budget=budget), n)
    return out


def progress_report(every: int, n: int = 48):
    """An ``on_step`` hook for :func:`training.train`: every ``every`` LLM steps, log the unpruned per-family scores
    on ``n`` test questions each (greedy, no randomness: the weights stay those of a run without it)."""
    from promprune.models import PrunedVLM
    from promprune.testbed import model as testbed_model
    from promprune.testbed import scores

    processor = testbed_model.untrained()[1]

    def hook(stage: str, step: int, model) -> None:
        if stage in ("llm", "relation") and every and (step + 1) % every == 0:
            with torch.inference_mode():
                found = scores.family_scores(PrunedVLM(model, processor, method=None), n)
            model.train()
            log.info("%s step %d: %s", stage, step + 1, {f: v["score"] for f, v in found.items()})
    return hook


def make(out: Path, *, eval_n: int = 200, budget: int = 16, report_every: int = 0, command: str | None = None,
         init: Path | None = None, **train_kwargs) -> dict:
    """Train with the recipe (``train_kwargs`` override it), save into ``out`` with its manifest; the manifest.

    ``init``: a directory saved by this recipe's stages 1-3 (a run with ``relation_steps=0``): only stage 4 runs on
    it (:func:`training.train`'s ``init``), which gives the weights a whole run would; the manifest records it."""
    from transformers import LlavaForConditionalGeneration

    from promprune.testbed import model as testbed_model
    from promprune.testbed import training

    out = Path(out)
    t0 = time.perf_counter()
    start = None
    if init is not None:
        init = Path(init)
        start = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
        earlier = manifest(init)
        init_meta = {"path": str(init), "sha256": sha256(init / WEIGHTS_FILE), "command": earlier.get("command"),
                     "train_seconds": earlier.get("train_seconds"),
                     "hyperparameters": earlier.get("hyperparameters")}
    model, _, losses = training.train(on_step=progress_report(report_every), init=start, **train_kwargs)
    seconds = time.perf_counter() - t0
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # model.safetensors + config.json (+ generation_config.json, not needed)
    for extra in tmp.iterdir():
        if extra.name not in VERIFIED_FILES:
            extra.unlink()
    processor = testbed_model.untrained()[1]
    hyper = {**training.recipe(), **train_kwargs}
    tail = losses[-50:]
    meta = {"model": "testbed:llava", "recipe": training.RECIPE, "seed": hyper["seed"], "hyperparameters": hyper,
            "command": command or f"python -m promprune.testbed.shipped --out {out}",
            "sha256": sha256(tmp / WEIGHTS_FILE), "files": file_digests(tmp),
            "bytes": (tmp / WEIGHTS_FILE).stat().st_size,
            "train_seconds": round(seconds), "final_llm_loss": round(sum(tail) / max(len(tail), 1), 4),
            "made_with": {"torch": torch.__version__, "python": platform.python_version(),
                          "machine": platform.machine(), "processor": platform.processor() or "unknown"}}
    if init is not None:
        meta["stages_1_to_3"] = init_meta
        meta["train_seconds"] = round(seconds + (init_meta["train_seconds"] or 0))
    with torch.inference_mode():
        meta["fixed_answers"] = fixed_answers(model, processor)
        meta["scores"] = {"n_per_family": eval_n, "budget": budget, **evaluate(model, processor, eval_n, budget)}
    (tmp / MANIFEST).write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return meta


def main(argv=None) -> None:
    from promprune.testbed import training

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the weights and manifest (default with --retrain: the cache "
                             "directory testbed:llava uses when PROMPRUNE_TESTBED_RETRAIN=1)")
    parser.add_argument("--retrain", action="store_true",
                        help=f"train into {training.CACHE_NAME} under $PROMPRUNE_CACHE (used with "
                             "PROMPRUNE_TESTBED_RETRAIN=1) instead of shipping")
    parser.add_argument("--eval-n", type=int, default=200, help="test questions per family for the manifest")
    parser.add_argument("--evaluate", type=Path, default=None, metavar="DIR",
                        help="train nothing: print the per-family scores of the weights in DIR (verified), unpruned "
                             "and at 16 tokens per method, as the manifest's scores (--eval-n questions per family)")
    parser.add_argument("--report-every", type=int, default=0, help="log per-family scores every N LLM steps")
    parser.add_argument("--init", type=Path, default=None,
                        help="a directory saved by stages 1-3 of this recipe (--relation-steps 0): run stage 4 on it")
    for name in ("steps", "vision_steps", "align_steps", "relation_steps", "batch_size", "vision_batch_size", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--relation-answer", action=argparse.BooleanOptionalAction, default=None,
                        help="stage 4 also reads the relation's answer out of the residual entering layer 3 "
                             "(the recipe's default: on)")
    parser.add_argument("--sink-after", type=float, default=None,
                        help="share of the LLM steps before an existence 'no' is taught to look at the sink")
    args = parser.parse_args(argv)
    if args.evaluate is not None:
        from promprune.testbed import model as testbed_model

        model, processor = load(args.evaluate), testbed_model.untrained()[1]
        with torch.inference_mode():
            found = {"n_per_family": args.eval_n, "budget": 16, **evaluate(model, processor, args.eval_n, 16)}
        print(json.dumps(found, indent=1))
        return
    out = args.out or (training.cache_path() if args.retrain else None)
    if out is None:
        parser.error("give --out DIR (promprune/testbed/weights to remake the shipped file) or --retrain")
    kwargs = {name: getattr(args, name) for name in ("steps", "vision_steps", "align_steps", "relation_steps",
                                                     "batch_size", "vision_batch_size", "seed", "sink_after",
                                                     "relation_answer")
              if getattr(args, name) is not None}
    logging.basicConfig(level=logging.INFO)
    command = "python -m promprune.testbed.shipped " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = make(out, eval_n=args.eval_n, report_every=args.report_every, command=command, init=args.init, **kwargs)
    print(json.dumps({k: meta[k] for k in ("recipe", "sha256", "train_seconds", "scores")}, indent=1))


if __name__ == "__main__":
    main()
