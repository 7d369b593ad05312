"""``testbed:llava`` by name: the shipped weights (:mod:`promprune.testbed.shipped`), or the recipe's
(:mod:`promprune.testbed.training`) when asked to retrain. The model factory registered for ``testbed:``.

The model's code (:mod:`promprune.testbed.model`, which imports transformers' image processing and, with it,
torchvision: seconds) is imported when a model is built, not when a sweep's driver asks for the config or prepares
the shipped weights: those read ``weights/config.json`` and the file's checksum."""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

from promprune.models.factories import place
from promprune.testbed import check_arch, shipped

log = logging.getLogger(__name__)

RETRAIN_ENV = "PROMPRUNE_TESTBED_RETRAIN"  # "1": testbed:llava trained from the recipe into the cache, not shipped
WEIGHTS_ENV = "PROMPRUNE_TESTBED_WEIGHTS"  # a directory made by ``python -m promprune.testbed.shipped --out DIR``


def _retrain_asked() -> bool:
    return os.environ.get(RETRAIN_ENV, "").strip().lower() in ("1", "true", "yes")


def shipped_in_use() -> bool:
    """Whether ``testbed:llava`` loads the shipped weights: no retraining asked, no other weights named
    (``WEIGHTS_ENV``), and the files are there."""
    return not _retrain_asked() and not os.environ.get(WEIGHTS_ENV) and shipped.available()


def weights_sha256() -> str | None:
    """The sha256 of the weights :func:`load_or_train` loads here, as their manifest records it (the load verifies
    the file against it), read without hashing the weights: those of ``$PROMPRUNE_TESTBED_WEIGHTS``, else the shipped
    ones when in use. None for the recipe's (retrained) weights or a folder without a manifest. A sweep's state keeps
    it with the mu it calibrated, and a ``--resume`` on other weights is refused (`pipelines.run.state`)."""
    if os.environ.get(WEIGHTS_ENV):
        directory = Path(os.environ[WEIGHTS_ENV])
    elif shipped_in_use():
        directory = shipped.WEIGHTS_DIR
    else:
        return None
    try:
        return shipped.manifest(directory).get("sha256")
    except (OSError, ValueError):
        return None


def load_or_train(directory: str | Path | None = None, **train_kwargs):
    """``(model, processor)`` of ``testbed:llava``.

    By default the shipped weights (:mod:`promprune.testbed.shipped`, checksum verified; no training). With
    ``directory`` or ``$PROMPRUNE_TESTBED_RETRAIN=1``: loaded from ``directory`` (default
    :func:`training.cache_path`, whose name carries the recipe version), trained into it first with the recipe when
    it is missing (``train_kwargs`` go to :func:`training.train`; tests: few steps). ``$PROMPRUNE_TESTBED_WEIGHTS``:
    weights made by ``shipped --out DIR``.
    """
    from promprune.testbed import model as testbed_model
    from promprune.testbed import training
    from promprune.training import common

    processor = copy.deepcopy(testbed_model.untrained()[1])
    if directory is None and os.environ.get(WEIGHTS_ENV):
        return shipped.load(Path(os.environ[WEIGHTS_ENV])), processor
    if directory is None and shipped_in_use():
        return shipped.load(), processor
    if directory is None and not _retrain_asked():
        log.warning("no shipped testbed weights in %s: training from the recipe", shipped.WEIGHTS_DIR)
    directory = Path(directory) if directory is not None else training.cache_path()
    model = common.load_trained(directory, lambda: training.train(**train_kwargs)[:2],
                                f"testbed:llava recipe {training.RECIPE} on testbed train scenes (about 1.5 hours of "
                                "one CPU thread)")
    return model, processor


def load(arch: str, *, dtype=None, device_map=None, attn_implementation=None):
    """The ``testbed:<arch>`` model factory (only ``llava``): the shipped weights (see :func:`load_or_train`), as a
    :class:`~promprune.testbed.model.TestbedLlava` (``dtype="float64"``: float64 throughout)."""
    from promprune.testbed import model as testbed_model

    check_arch(arch)
    model, processor = load_or_train()
    model = testbed_model.widen(model)
    return place(model, dtype=dtype, device_map=device_map, attn_implementation=attn_implementation), processor, {}


def _config(arch: str):
    """The model's config without building it: the shipped ``config.json`` when the shipped weights are in use
    (the recipe's config, saved with them: `tests/testbed/test_shipped.py` checks), else the recipe's."""
    check_arch(arch)
    if shipped_in_use():
        from transformers import LlavaConfig

        return LlavaConfig.from_pretrained(shipped.WEIGHTS_DIR)
    from promprune.testbed import model as testbed_model

    return testbed_model.config()


def _prepare(arch: str) -> None:
    """First-use work, in the caller (a sweep's driver, before Ray): the shipped weights' checksum and recipe
    checked, or the recipe trained into the cache (``load_or_train``)."""
    check_arch(arch)
    if shipped_in_use():
        shipped.check(shipped.WEIGHTS_DIR, checksum=True)
    else:
        load_or_train()


load.config = _config
load.prepare = _prepare
