"""PromPrune: semantic prominence-aware visual token budgeting for vision-language models.

``promprune.select`` decides which visual tokens a VLM keeps; ``promprune.models`` runs real transformers VLMs
with it; ``promprune.eval`` scores them with lmms-eval. The library never imports Ray or MLflow.
"""
from .selection import (IN_LLM, PRE_LLM, Instruction, MethodSpec, Selection, VisionFeatures, attention_entropy,
                        feature_norm_entropy, method_spec, methods, register_method, select, spectral_entropy)

__version__ = "0.1.0"
__all__ = ["select", "Selection", "VisionFeatures", "Instruction", "methods", "method_spec", "MethodSpec",
           "register_method", "PRE_LLM", "IN_LLM", "spectral_entropy", "feature_norm_entropy", "attention_entropy",
           "__version__"]
