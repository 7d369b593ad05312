"""The process environment: variables set for the duration of a block; the package's cache directory."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

# How PromPrune's split reads the spectral entropy (``PROMPRUNE_ENTROPY``; ``promprune.selection.accel``): here, where
# no torch is imported, so the pipeline's front door checks the variable without it
ENTROPY_MODES = ("auto", "certified", "exact")


@contextlib.contextmanager
def temporary_env(**values: str):
    """Set ``values`` in ``os.environ`` inside the block; afterwards every variable is as it was (unset if it was)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def cache_dir() -> Path:
    """Where converted data, generated task YAMLs and trained tiny models live: $PROMPRUNE_CACHE or
    ~/.cache/promprune."""
    return Path(os.environ.get("PROMPRUNE_CACHE") or Path.home() / ".cache" / "promprune")
