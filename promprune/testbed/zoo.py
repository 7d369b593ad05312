"""``testbed:llava`` by name: the shipped weights (:mod:`promprune.testbed.shipped`), or the recipe's
(:mod:`promprune.testbed.training`) when asked to retrain. The model factory registered for ``testbed:``."""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

from promprune.models.factories import place
from promprune.testbed import model as testbed_model
from promprune.testbed import shipped, training
from promprune.training import common

log = logging.getLogger(__name__)

RETRAIN_ENV = "PROMPRUNE_TESTBED_RETRAIN"  # "1": testbed:llava trained from the recipe into the cache, not shipped
WEIGHTS_ENV = "PROMPRUNE_TESTBED_WEIGHTS"  # a directory made by ``python -m promprune.testbed.shipped --out DIR``


def load_or_train(directory: str | Path | None = None, **train_kwargs):
    """``(model, processor)`` of ``testbed:llava``.

    By default the shipped weights (:mod:`promprune.testbed.shipped`, checksum verified; no training). With
    ``directory`` or ``$PROMPRUNE_TESTBED_RETRAIN=1``: loaded from ``directory`` (default
    :func:`training.cache_path`, whose name carries the recipe version), trained into it first with the recipe when
    it is missing (``train_kwargs`` go to :func:`training.train`; tests: few steps). ``$PROMPRUNE_TESTBED_WEIGHTS``:
    weights made by ``shipped --out DIR``.
    """
    processor = copy.deepcopy(testbed_model.untrained()[1])
    if directory is None and os.environ.get(WEIGHTS_ENV):
        return shipped.load(Path(os.environ[WEIGHTS_ENV])), processor
    retrain = os.environ.get(RETRAIN_ENV, "").strip().lower() in ("1", "true", "yes")
    if directory is None and not retrain:
        if shipped.available():
            return shipped.load(), processor
        log.warning("no shipped testbed weights in %s: training from the recipe", shipped.WEIGHTS_DIR)
    directory = Path(directory) if directory is not None else training.cache_path()
    model = common.load_trained(directory, lambda: training.train(**train_kwargs)[:2],
                                f"testbed:llava recipe {training.RECIPE} on testbed train scenes (about 1.5 hours of "
                                "one CPU thread)")
    return model, processor


def load(arch: str, *, dtype=None, device_map=None, attn_implementation=None):
    """The ``testbed:<arch>`` model factory (only ``llava``): the shipped weights (see :func:`load_or_train`), as a
    :class:`~promprune.testbed.model.TestbedLlava` (``dtype="float64"``: float64 throughout)."""
    training.check_arch(arch)
    model, processor = load_or_train()
    model = testbed_model.widen(model)
    return place(model, dtype=dtype, device_map=device_map, attn_implementation=attn_implementation), processor, {}


def _config(arch: str):
    training.check_arch(arch)
    return testbed_model.config()


load.config = _config
load.prepare = lambda arch: (training.check_arch(arch), load_or_train())  # first use: train, in the caller
