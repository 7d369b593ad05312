"""Qwen3.5 through lmms-eval (issue 46): ``--model promprune`` on tiny:qwen3_5, with Qwen3.5's chat format.

References: lmms-eval's own evaluator (its prompts and answers per document) against PrunedVLM answering the same
context and image alone; the chat template's reasoning switch as lmms-eval's qwen3_5 model sets it."""
import pytest
import torch
from lmms_eval.evaluator import simple_evaluate
from lmms_eval.models.registry_v2 import ModelRegistryV2

from promprune.eval import PromPruneLMM
from promprune.eval.generation import cut_at_stop, generate_kwargs
from promprune.eval.lmms_plugin import MANIFEST
from promprune.eval.tasks import task_manager

LIMIT = 3


@pytest.fixture(autouse=True)
def _one_thread():
    """The 2 cores are shared; a tiny model gets nothing from a second thread but contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def plugin_class():
    registry = ModelRegistryV2()
    for manifest in registry._coerce_payload_to_manifests(MANIFEST):
        registry.register_manifest(manifest)
    return registry.get_model_class("promprune")


@pytest.mark.parametrize("flag,thinks", [("false", False), ("true", True), (None, True)])
def test_model_args_set_qwen35s_reasoning_switch(flag, thinks):
    """``enable_thinking`` from lmms-eval's model_args (a string) reaches the chat template; unset, the template's
    default holds (Qwen3.5-4B thinks first, as lmms-eval's qwen3_5 model runs it)."""
    args = "pretrained=tiny:qwen3_5,method=fastv,budget=6" + (f",enable_thinking={flag}" if flag else "")
    lm = plugin_class().create_from_arg_string(args)
    assert lm.vlm.thinks is thinks and lm.vlm.budget == 6
    tail = "<think>\n" if thinks else "<think>\n\n</think>\n\n"
    assert lm.vlm.conversation("Is it red?").endswith("Is it red?<|im_end|>\n<|im_start|>assistant\n" + tail)
    with pytest.raises(ValueError, match="model_args enable_thinking='maybe' must be true or false"):
        PromPruneLMM(pretrained="tiny:qwen3_5", method="none", enable_thinking="maybe")


@pytest.mark.parametrize("model_args", ["method=fastv,budget=6,enable_thinking=false",
                                        "method=promprune,budget=8,enable_thinking=false,vision_once=true,"
                                        "prefix_cache=true"])
def test_lmms_evals_evaluator_gets_the_answers_pruned_vlm_gives(model_args):
    """lmms-eval's evaluator with ``--model promprune`` on tiny:qwen3_5: every document's answer is the one PrunedVLM
    gives its context and image alone (in-LLM FastV on the hybrid LLM; PromPrune with vision and prefix once)."""
    lm = plugin_class().create_from_arg_string(f"pretrained=tiny:qwen3_5,{model_args}", {"batch_size": 2})
    tasks = ["easyvqa_yesno"]
    manager = task_manager(tasks)
    out = simple_evaluate(model=lm, tasks=tasks, limit=LIMIT, task_manager=manager, bootstrap_iters=0,
                          log_samples=True)
    samples = sorted(out["samples"]["easyvqa_yesno"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(LIMIT)) and not lm.failures
    task = manager.load_task_or_group(tasks)["easyvqa_yesno"]
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    for sample in samples:
        context, gen_kwargs = sample["arguments"][:2]
        image = task.doc_to_visual(docs[sample["doc_id"]])[0]
        kwargs, until = generate_kwargs(gen_kwargs)
        alone = lm.vlm.generate([image.convert("RGB")], [context], **kwargs)[0]
        assert sample["resps"][0][0] == cut_at_stop(alone.text, until)
