"""lmms-eval's own path with Gemma 4: ``--model promprune`` model_args naming tiny:gemma4, lmms-eval's gemma4
conversation (its system prompt) and its soft-token budget, answered by lmms-eval's evaluator on an offline task."""
import pytest
from lmms_eval.evaluator import simple_evaluate
from lmms_eval.models.registry_v2 import ModelRegistryV2

from promprune.eval import PromPruneLMM
from promprune.eval.lmms_plugin import MANIFEST
from promprune.eval.tasks import task_manager

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
    with pytest.raises(ValueError, match="fastv on .*option 'layer' gives layer 1"):
        _plugin_class().create_from_arg_string("pretrained=tiny:gemma4,method=fastv,budget=16,layer=1")


@pytest.mark.slow
def test_lmms_eval_evaluator_answers_with_gemma4():
    """lmms-eval's evaluator drives the plugin: every document answered, 16 of each image's soft tokens kept."""
    lm = PromPruneLMM(pretrained="tiny:gemma4", method="promprune", budget=16,
                      system_prompt="You are a helpful assistant.", batch_size=2)
    seen = []
    generate = lm.vlm.generate

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        seen.extend(g.visual_tokens for g in out)
        return out

    lm.vlm.generate = recording
    out = simple_evaluate(model=lm, tasks=["easyvqa_yesno"], limit=4, task_manager=task_manager(["easyvqa_yesno"]),
                          bootstrap_iters=0, log_samples=True)
    assert len(out["samples"]["easyvqa_yesno"]) == 4 and not lm.failures
    assert seen == [16] * 4
    assert 0 <= out["results"]["easyvqa_yesno"]["accuracy,none"] <= 1
