"""PromPrune: semantic prominence-aware visual token budgeting for vision-language models.

``promprune.select`` decides which visual tokens a VLM keeps; ``promprune.models`` runs real transformers VLMs
with it; ``promprune.eval`` scores them with lmms-eval. The library never imports Ray or MLflow.

The names below come from ``promprune.selection`` on first use (PEP 562), so importing a light submodule
(``promprune.records``: what every process of a sweep shares) does not import torch: the sweep's pool actor, which
Ray makes import the worker's module, and a trial's process before it scores need none of it.
"""
import importlib

__version__ = "0.1.0"
__all__ = ["select", "Selection", "VisionFeatures", "Instruction", "methods", "method_spec", "MethodSpec",
           "register_method", "register_in_llm_method", "PRE_LLM", "IN_LLM", "spectral_entropy",
           "feature_norm_entropy", "attention_entropy",
           "__version__"]
_FROM_SELECTION = frozenset(__all__) - {"__version__"}
# subpackages the docs reach as attributes after `import promprune` (`promprune.testing.check_method(...)`,
# `promprune.models.PrunedVLM`), imported on first use
_SUBMODULES = frozenset({"testing", "models", "eval", "selection"})


def __getattr__(name: str):
    if name in _FROM_SELECTION:
        value = getattr(importlib.import_module(".selection", __name__), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import binds it here
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_SELECTION | _SUBMODULES)
