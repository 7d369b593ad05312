"""The dtype x attention x device x method combinations that cannot run are refused before any model work, and a row
whose logits went non-finite is a failed sample, not an empty answer.

References: plain transformers (the float64 eager model's own forward on a padded batch) and each row run alone."""
import copy

import pytest
import torch

from promprune.eval.generation import Item, generate_items
from promprune.models import PrunedVLM
from promprune.models.attention import device_problem, in_llm_attention_problem, precision_problem
from promprune.models.tiny import tiny_vlm
from promprune.models.vlm import NONFINITE


def _double(arch="llava", attn="sdpa"):
    model, processor = tiny_vlm(arch)
    model = copy.deepcopy(model).to(torch.float64)  # the tiny model is cached for the process: never mutate it
    model.set_attn_implementation(attn)
    return model, processor


def test_plain_transformers_float64_eager_pads_to_nan(images, prompts):
    """Why float64 + eager is refused: plain transformers' own forward on a left-padded batch gives the padded row
    NaN logits under eager attention (its float32 softmax over float64's finfo.min mask, -inf), finite under sdpa."""
    inputs = PrunedVLM(*_double(), method=None).inputs(images, ["What is in the picture? Describe it.", prompts[1]])
    assert not bool(inputs["attention_mask"].all())  # a padded row
    finite = {}
    for attn in ("eager", "sdpa"):
        model, _ = _double(attn=attn)
        with torch.no_grad():
            logits = model(**inputs).logits[:, -1]
        finite[attn] = torch.isfinite(logits).all(-1).tolist()
    assert finite == {"eager": [True, False], "sdpa": [True, True]}


def test_float64_eager_refused_before_loading():
    """from_pretrained refuses it before it looks for the checkpoint (a path that does not exist is not reached)."""
    with pytest.raises(ValueError, match=r"dtype float64 with attn_implementation 'eager'.*sdpa"):
        PrunedVLM.from_pretrained("/no/such/checkpoint", method=None, dtype="fp64", attn_implementation="eager")
    with pytest.raises(ValueError, match="float64"):
        PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8, dtype="float64",
                                  attn_implementation="eager")
    assert precision_problem("auto", "eager") is None and precision_problem(None, "eager") is None
    assert precision_problem("float32", "eager") is None and precision_problem("float64", "sdpa") is None


@pytest.mark.parametrize("method", [None, "promprune", "fastv"])
def test_built_float64_eager_model_refused(method):
    """A model built in float64 with eager LLM attention (the config's, as a factory or a caller set it) is refused
    by the constructor, naming dtype and attention and the fix."""
    with pytest.raises(ValueError, match=r"float64.*'eager'.*Use attn_implementation 'sdpa'"):
        PrunedVLM(*_double(attn="eager"), method=method, budget=None if method is None else 8)


@pytest.mark.parametrize("method", ["fastv", "sparsevlm", "dart", "pyramiddrop"])
def test_in_llm_method_needs_sdpa_or_eager(method):
    """An in-LLM method under flex_attention constructed fine and failed every sample at generate; now the
    constructor refuses it (and from_pretrained before loading), naming the method and the attention."""
    model, processor = tiny_vlm("llava")
    model = copy.deepcopy(model)  # the tiny model is cached for the process: never mutate it
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match=rf"'{method}'.*'flex_attention'"):
        PrunedVLM(model, processor, method=method, budget=8)
    with pytest.raises(ValueError, match=rf"'{method}'.*'flash_attention_2'"):
        PrunedVLM.from_pretrained("/no/such/checkpoint", method=method, budget=8,
                                  attn_implementation="flash_attention_2")
    PrunedVLM(model, processor, method="promprune", budget=8)  # a pre-LLM method prunes before the LLM: any attention
    assert in_llm_attention_problem(method, None) is None and in_llm_attention_problem(method, "eager") is None


@pytest.mark.parametrize("method", ["fastv", "pyramiddrop", "sparsevlm"])
def test_float64_sdpa_in_llm_padded_rows_equal_rows_alone(method, images):
    """The in-LLM hooks' masks (``InLLMPruner._as_mask``: boolean under sdpa) leave a float64 padded batch's rows as
    they are alone: no NaN from a fully masked padding row."""
    vlm = PrunedVLM(*_double(), method=method, budget=8)
    prompts = ["What is in the picture? Please describe it.", "Colour?"]  # rows of different lengths: padding
    batched = vlm.generate(images, prompts, max_new_tokens=5)
    alone = [vlm.generate([im], [p], max_new_tokens=5)[0] for im, p in zip(images, prompts)]
    assert [g.error for g in batched] == [None, None]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]


def test_nonfinite_logits_are_a_failed_sample(images):
    """The guard: a float64 model switched to eager attention after construction (what the constructor refuses)
    generates NaN for its padded row; that row is a failed sample with the reason, the other row answers."""
    model, processor = _double()
    vlm = PrunedVLM(model, processor, method=None)
    model.set_attn_implementation("eager")
    prompts = ["What is in the picture? Please describe it.", "Colour?"]
    got = vlm.generate(images, prompts, max_new_tokens=3)
    assert [g.error for g in got] == [None, NONFINITE]
    answers = generate_items(vlm, [Item(p, im, {"max_new_tokens": 3}) for im, p in zip(images, prompts)],
                             batch_size=2)
    assert [a.failed for a in answers] == [False, True] and answers[1].error == NONFINITE
    assert answers[1].prediction == ""


def test_devices_refused_before_loading():
    """A device this machine does not have fails before the model is built, in one paragraph."""
    assert "did you mean 'cpu'" in device_problem("cpuu")
    assert device_problem("cpu") is None and device_problem("auto") is None and device_problem(None) is None
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in device_problem("cuda") and "no CUDA GPU" in device_problem("cuda:3")
    else:
        assert device_problem(f"cuda:{torch.cuda.device_count()}") is not None
    if not torch.backends.mps.is_available():
        assert "MPS" in device_problem("mps")
    with pytest.raises(ValueError, match="device_map 'cpuu'"):
        PrunedVLM.from_pretrained("/no/such/checkpoint", method=None, device_map="cpuu")


def test_a_gpu_index_is_a_device_map_checked_as_cuda_n(monkeypatch):
    """transformers takes an int device_map as a GPU index: without that GPU it was torch's bare "Found no NVIDIA
    driver" RuntimeError while the weights loaded; now refused up front naming device_map, as 'cuda:N' is."""
    monkeypatch.setattr("promprune.models.vlm.find_model_factory", lambda name: pytest.fail("the model was built"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert device_problem(count) == device_problem(f"cuda:{count}").replace(f"'cuda:{count}'",
                                                                             f"{count} (GPU cuda:{count})")
    assert device_problem(count).startswith(f"device_map {count} (GPU cuda:{count}): this machine has ")
    assert "is not a device" in device_problem(True) and "is not a device" in device_problem(-1)
    with pytest.raises(ValueError, match=rf"^device_map {count} \(GPU cuda:{count}\): this machine has"):
        PrunedVLM.from_pretrained("tiny:llava", method=None, device_map=count)


@pytest.mark.parametrize("dtype,said", [
    (torch.int8, "unknown dtype torch.int8; use one of auto, bf16, bfloat16, double, float, float16, float32, "
                 "float64, fp16, fp32, fp64, half"),
    ("flaot32", "unknown dtype 'flaot32' (did you mean 'float32'?); use one of auto, bf16"),
])
@pytest.mark.parametrize("name", ["tiny:llava", "testbed:llava"])
def test_a_dtype_that_is_no_models_is_refused_before_loading(monkeypatch, name, dtype, said):
    """dtype=torch.int8 was a torch TypeError once the model was built; a mistyped name was refused by testbed:llava
    only after its weights loaded. Both now before any model work, naming the dtype and the valid ones."""
    monkeypatch.setattr("promprune.models.vlm.find_model_factory", lambda name: pytest.fail("the model was built"))
    with pytest.raises(ValueError) as err:
        PrunedVLM.from_pretrained(name, method=None, dtype=dtype)
    assert str(err.value).startswith(said)
