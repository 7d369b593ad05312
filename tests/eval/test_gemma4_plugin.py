"""lmms-eval's own path with Gemma 4: ``--model promprune`` model_args naming tiny:gemma4, lmms-eval's gemma4
conversation (its system prompt) and its soft-token budget, answering lmms-eval's requests."""
import pytest
from lmms_eval.models.registry_v2 import ModelRegistryV2

from promprune.eval import PromPruneLMM
from promprune.eval.lmms_plugin import MANIFEST

ARGS = "pretrained=tiny:gemma4,method=promprune,budget=16,system_prompt=You are a helpful assistant.,max_soft_tokens=70"


def _plugin_class():
    registry = ModelRegistryV2()
    for manifest in registry._coerce_payload_to_manifests(MANIFEST):
        registry.register_manifest(manifest)
    return registry.get_model_class("promprune")


def test_model_args_reach_the_gemma4_adapter():
    lm = _plugin_class().create_from_arg_string(ARGS, {"batch_size": 2})
    assert type(lm.vlm.model).__name__ == "Gemma4ForConditionalGeneration" and lm.batch_size == 2
    assert lm.vlm.adapter.options["system_prompt"] == "You are a helpful assistant."
    assert lm.vlm.adapter.max_soft_tokens() == 70 and lm.vlm.budget == 16
    with pytest.raises(ValueError, match="in-LLM method 'fastv' on .*option 'layer' gives layer 1"):
        _plugin_class().create_from_arg_string("pretrained=tiny:gemma4,method=fastv,budget=16,layer=1")


def test_generate_until_answers_lmms_eval_requests_with_gemma4():
    """lmms-eval's requests, as its evaluator hands them to a model (``Instance``: context, generation kwargs,
    doc_to_visual, doc id, task, split; the docs in ``task_dict``): each answered with 16 of its image's soft tokens,
    the same answer as the PrunedVLM's own generate on lmms-eval's gemma4 conversation."""
    from lmms_eval.api.instance import Instance

    from tests.models.conftest import make_image

    lm = PromPruneLMM(pretrained="tiny:gemma4", method="promprune", budget=16,
                      system_prompt="You are a helpful assistant.", batch_size=2)
    docs = [{"image": make_image(40, 56, 0), "q": "Is there a circle?"},
            {"image": make_image(64, 30, 1), "q": "What colour is it?"}]
    lm.task_dict = {"toy": {"test": docs}}
    kwargs = {"max_new_tokens": 4, "until": ["\n\n"]}
    requests = [Instance("generate_until", (d["q"], dict(kwargs), lambda doc: [doc["image"]], i, "toy", "test"), idx=0,
                         metadata={"task": "toy", "doc_id": i, "repeats": 1}) for i, d in enumerate(docs)]
    answers = lm.generate_until(requests)
    assert not lm.failures and len(answers) == 2
    direct = lm.vlm.generate([d["image"] for d in docs], [d["q"] for d in docs], max_new_tokens=4)
    assert answers == [g.text for g in direct] and [g.visual_tokens for g in direct] == [16, 16]
