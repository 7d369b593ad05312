"""Model adapters: prune the visual tokens of real transformers VLMs, one registered family per architecture.

``PrunedVLM(model, processor, method, budget, **options).generate(images, prompts) -> list[Generation]``;
``PrunedVLM.from_pretrained(name_or_path, ...)`` also takes ``"tiny:<family>"`` (offline tiny models) and
``"shape:<checkpoint>"`` (published sizes, random weights). :func:`families` lists the supported architectures
(:mod:`promprune.models.architectures`, one module each); :func:`family` gives one's facts (its adapter, mu, ...).
"""
from .options import ADAPTER_OPTIONS, all_methods, is_in_llm, validate_method
from .registry import families, family, register_family
from .vlm import FullBudgetWarning, Generation, Prepared, PrunedVLM

__all__ = ["PrunedVLM", "Generation", "Prepared", "all_methods", "validate_method", "is_in_llm", "ADAPTER_OPTIONS",
           "families", "family", "register_family", "FullBudgetWarning"]
