"""Model adapters: prune visual tokens of real transformers VLMs (LLaVA-1.5, LLaVA-NeXT, Qwen2.5-VL).

``PrunedVLM(model, processor, method, budget, **options).generate(images, prompts) -> list[Generation]``;
``PrunedVLM.from_pretrained(name_or_path, ...)`` also takes ``"tiny:<arch>"`` for the offline tiny models.
"""
from . import gemma4  # noqa: F401 - registers the Gemma 4 adapter (adapters.ADAPTERS)
from . import internvl  # noqa: F401 - registers the InternVL adapter (adapters.ADAPTERS)
from .options import ADAPTER_OPTIONS, DEFAULT_MU, all_methods, is_in_llm, validate_method
from .vlm import Generation, Prepared, PrunedVLM

__all__ = ["PrunedVLM", "Generation", "Prepared", "all_methods", "validate_method", "is_in_llm", "ADAPTER_OPTIONS",
           "DEFAULT_MU"]
