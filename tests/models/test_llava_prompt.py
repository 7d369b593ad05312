"""LLaVA-1.5 as the paper's lmms-eval runs feed it (lmms-eval's llava model, conv_template=vicuna_v1, the checkpoint's
image_aspect_ratio "pad"): the image padded to a square of the processor's mean colour before the centre crop, and the
vicuna_v1 system prompt before the user's turn, as llava-hf's chat template renders a system turn."""
import numpy as np
import torch
from PIL import Image

from promprune.models import PrunedVLM
from promprune.models.architectures.llava import VICUNA_V1_SYSTEM
from promprune.models.tiny import tiny_vlm


def _photo(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_pad_to_square_pads_with_the_mean_colour_before_the_centre_crop():
    model, processor = tiny_vlm("llava")
    wide, tall = _photo(40, 24), _photo(18, 30)
    mean = tuple(int(x * 255) for x in processor.image_processor.image_mean)  # LLaVA's background colour
    by_hand = []
    for image, offset in ((wide, (0, 8)), (tall, (6, 0))):  # (40 - 24) // 2 rows above; (30 - 18) // 2 columns left
        side = max(image.size)
        canvas = Image.new("RGB", (side, side), mean)
        canvas.paste(image, offset)
        by_hand.append(canvas)
    expected = processor.image_processor(by_hand, return_tensors="pt")["pixel_values"]
    padded = PrunedVLM(model, processor, method=None, pad_to_square=True)
    got = padded.inputs([wide, tall], ["q", "q"])["pixel_values"]
    torch.testing.assert_close(got, expected)
    cropped = processor.image_processor([wide, tall], return_tensors="pt")["pixel_values"]  # llava-hf's default
    torch.testing.assert_close(PrunedVLM(model, processor, method=None).inputs([wide, tall], ["q", "q"])
                               ["pixel_values"], cropped)
    assert not torch.allclose(expected, cropped)
    square = _photo(24, 24)
    torch.testing.assert_close(padded.inputs([square], ["q"])["pixel_values"],
                               processor.image_processor([square], return_tensors="pt")["pixel_values"])


def test_llava_next_ignores_pad_to_square():
    """anyres makes its own views (LLaVA's image_aspect_ratio "anyres"): nothing is padded before them."""
    model, processor = tiny_vlm("llava_next")
    wide = _photo(40, 24)
    plain = PrunedVLM(model, processor, method=None).inputs([wide], ["q"])
    padded = PrunedVLM(model, processor, method=None, pad_to_square=True).inputs([wide], ["q"])
    torch.testing.assert_close(padded["pixel_values"], plain["pixel_values"])


def test_the_system_turn_renders_as_llava_hfs_template_does():
    """llava-hf's template writes a system turn's text and a space, no role: with vicuna_v1's system prompt the
    conversation is LLaVA's own "<system> USER: <image>\\n<question> ASSISTANT:"."""
    model, processor = tiny_vlm("llava")
    vlm = PrunedVLM(model, processor, method=None, system_prompt=VICUNA_V1_SYSTEM)
    assert vlm.conversation("What is it?") == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: <image>\nWhat is it? ASSISTANT:")
    assert PrunedVLM(model, processor, method=None).conversation("What is it?") == \
        "USER: <image>\nWhat is it? ASSISTANT:"
