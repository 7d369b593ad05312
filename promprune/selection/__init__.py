"""Token selection: the pure-tensor core of PromPrune (no model knowledge)."""
from . import baselines, two_stage  # noqa: F401  (registers the methods)
from .entropy import attention_entropy, feature_norm_entropy, spectral_entropy
from .registry import MethodSpec, Selection, method_spec, methods, register_method, select

__all__ = ["select", "Selection", "methods", "method_spec", "MethodSpec", "register_method",
           "spectral_entropy", "feature_norm_entropy", "attention_entropy"]
