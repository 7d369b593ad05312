"""LLaVA-OneVision's prompt as lmms-eval's published OneVision numbers were run: lmms-eval's ``llava_onevision`` model
(lmms_eval/models/simple/llava_onevision.py, lmms-eval 0.7.3) writes ``"<image>\\n" + context`` as the user turn of
LLaVA's ``qwen_1_5`` conversation (LLaVA-NeXT's llava/conversation.py: ``conv_qwen``, ChatML with the system prompt
"You are a helpful assistant.") and renders it with ``get_prompt()``; for one image and the question "What is it?"
that is, worked by hand from the CHATML branch (system + sep + "\\n", then role + "\\n" + message + sep + "\\n" per
turn, the open assistant turn as role + "\\n"):

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n<image>\\nWhat is it?<|im_end|>\\n
    <|im_start|>assistant\\n

llava-hf's OneVision chat template (below) renders the same turns the same way but adds no system turn of its own,
so without the adapter option ``system_prompt`` the model saw no system turn (the OneVision specs cleared it until
extended_models_llava_onevision.yaml v4 / extended_models_video.yaml v3). A video's placeholder is ``<video>`` in the
llava-hf port where LLaVA's own code writes ``<image>``; either stands for the clip's visual tokens, the text around
it is the same."""
from pathlib import Path

import pytest

from pipelines import spec
from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"
QWEN_1_5 = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\n{placeholder}\nWhat is it?<|im_end|>\n<|im_start|>assistant\n")
# The chat template published with llava-hf's OneVision checkpoints (llava-onevision-qwen2-7b-si-hf's
# chat_template.json; -7b-ov-hf's has the same size and comes from the same upload), re-typed here: images, then
# videos, then text, each turn "<|im_start|>role\n...<|im_end|>\n". The tiny processor's template is a stand-in for it.
RELEASED_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] }}{% endgeneration %}{% endfor %}"
    "{% endif %}{{'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("name, media", [("extended_models_llava_onevision", "image"),
                                         ("mu_tau_search_llava_onevision", "image"),
                                         ("extended_models_video", "video"),
                                         ("extended_models_video_clip", "video")])
@pytest.mark.parametrize("template", ["tiny", "released"])
def test_onevision_specs_render_lmms_evals_qwen_1_5_conversation(name, media, template):
    loaded = spec.load(SWEEPS / f"{name}.yaml", ["model.pretrained=tiny:llava_onevision"])
    model, processor = tiny_vlm("llava_onevision")
    if template == "released":
        processor.chat_template = RELEASED_TEMPLATE
    vlm = PrunedVLM(model, processor, method=None, **loaded.model.options)  # the spec's adapter options
    # an <image> tag lmms-eval's context may carry is dropped, the image placed once where the template puts it
    for prompt in ("What is it?", "<image>\nWhat is it?"):
        assert vlm.conversation(prompt, media=media) == QWEN_1_5.format(placeholder=f"<{media}>")
