"""Token selection: the pure-tensor core of PromPrune (no model knowledge)."""
from . import baselines, cdpruner, controls, in_llm, two_stage  # noqa: F401  (registers the methods)
from .entropy import attention_entropy, feature_norm_entropy, spectral_entropy
from .registry import (IN_LLM, PRE_LLM, Instruction, MethodSpec, Selection, VisionFeatures, method_spec, methods,
                       register_in_llm_method, register_method, select)

__all__ = ["select", "Selection", "VisionFeatures", "Instruction", "methods", "method_spec", "MethodSpec",
           "register_method", "register_in_llm_method", "PRE_LLM", "IN_LLM", "spectral_entropy",
           "feature_norm_entropy", "attention_entropy"]
