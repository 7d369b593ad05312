"""Random draws per image (a hash of its pixels) and view, not per float: the same tokens in float32 and bfloat16,
alone or in a batch. References: the documented draw written out with hashlib and ``torch.randperm``."""
import hashlib

import numpy as np
import pytest
import torch

from promprune.models import PrunedVLM
from promprune.models.batched_select import unit_key
from promprune.models.images import pixel_key
from promprune.models.video import clip_key
from promprune.testbed.clips import scene_clip

from ..selection.test_baselines import reference_draw
from .conftest import make_image

BUDGET = 6


def kept(arch, images, prompts, dtype=torch.float32):
    vlm = PrunedVLM.from_pretrained(f"tiny:{arch}", method="random", budget=BUDGET, dtype=dtype)
    prep = vlm.prepare(images, prompts)
    return [s["kept"] for s in prep.stats], prep.items


def test_pixel_key_is_blake2b_of_mode_size_and_pixels():
    image = make_image(20, 30, 0)
    digest = hashlib.blake2b(b"RGB:30x20:" + image.tobytes(), digest_size=8).digest()
    assert pixel_key(image) == int.from_bytes(digest, "little") >> 1
    assert pixel_key(image.copy()) == pixel_key(image) != pixel_key(make_image(20, 30, 1))


def test_clip_key_is_blake2b_of_shape_and_frames():
    frames = np.stack([np.asarray(make_image(20, 30, i)) for i in range(3)])
    digest = hashlib.blake2b(b"clip:3x20x30x3:" + frames.tobytes(), digest_size=8).digest()
    assert clip_key(frames) == int.from_bytes(digest, "little") >> 1 != clip_key(frames[::-1])


def test_llava_kept_tokens_are_the_documented_draw(images, prompts):
    got, items = kept("llava", images, prompts)
    n = items[0].features.shape[0]  # LLaVA: one view, every grid token a candidate
    for image, item, k in zip(images, items, got):
        assert item.key == pixel_key(image)
        assert k == sorted(reference_draw(unit_key(pixel_key(image), 0), 0, n, BUDGET))


@pytest.mark.parametrize("arch", ["llava", "llava_next", "qwen2_5_vl"])
def test_random_keeps_the_same_tokens_in_float32_and_bfloat16(arch, images, prompts):
    full, items = kept(arch, images, prompts)
    half, half_items = kept(arch, images, prompts, torch.bfloat16)
    assert half_items[0].features.dtype == torch.bfloat16
    assert not torch.equal(half_items[0].features.float(), items[0].features)  # the features do differ
    assert half == full


@pytest.mark.parametrize("arch", ["llava", "llava_next"])
def test_an_image_draws_the_same_alone_or_in_any_batch(arch, prompts):
    a, b, c = make_image(40, 56, 0), make_image(40, 56, 1), make_image(40, 56, 2)
    alone = kept(arch, [a], ["Colour?"])[0][0]
    batch = kept(arch, [b, a, c, a], ["What?", "Colour?", "Where?", "Shape?"])[0]
    assert batch[1] == batch[3] == alone  # same image, other place, other question
    assert len({tuple(k) for k in batch[:3]}) == 3  # different images draw differently


def test_llava_next_views_draw_on_their_own():
    """Per-view units combine the image key with the view index: the views' draws differ (same token count)."""
    from promprune.models.batched_select import split_budget

    image = make_image(40, 56, 0)
    vlm = PrunedVLM.from_pretrained("tiny:llava_next", method="random", budget=BUDGET)
    prep = vlm.prepare([image], ["Colour?"])
    item = prep.items[0]
    views = item.groups.unique().tolist()
    members = [(item.groups == v).nonzero().flatten() for v in views]
    shares = split_budget(BUDGET, [len(m) for m in members])
    want = sorted(int(item.grid_index[m[i]]) for v, m, t in zip(views, members, shares) if t
                  for i in reference_draw(unit_key(pixel_key(image), v), 0, len(m), t))
    assert prep.stats[0]["kept"] == want
    assert len({unit_key(pixel_key(image), v) for v in views}) == len(views)


def test_clip_keys_hold_across_dtypes_and_batches():
    clips = [scene_clip(index=3, frames=4), scene_clip(index=8, frames=4)]
    prompts = ["What moves?", "How many objects?"]
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        vlm = PrunedVLM.from_pretrained("tiny:llava_onevision", method="random", budget=BUDGET, dtype=dtype)
        prep = vlm.prepare_video(clips, prompts)
        got[dtype] = [s["kept"] for s in prep.stats]
        assert [it.key for it in prep.items] == [clip_key(np.stack([np.asarray(f) for f in c])) for c in clips]
        assert [s["kept"] for s in vlm.prepare_video(clips[1:], prompts[1:]).stats] == got[dtype][1:]
    assert got[torch.float32] == got[torch.bfloat16]
    assert got[torch.float32][0] != got[torch.float32][1]


_KEPT_SCRIPT = """
import json, sys, torch
from promprune.models import PrunedVLM
from tests.models.conftest import make_image
torch.set_num_threads(1)
vlm = PrunedVLM.from_pretrained("tiny:llava", method="random", budget=6)
prep = vlm.prepare([make_image(40, 56, 0), make_image(64, 30, 1)], ["What?", "Colour?"])
json.dump({"kept": [s["kept"] for s in prep.stats], "features": prep.items[0].features[:, :8].tolist()}, sys.stdout)
"""


@pytest.mark.slow  # two fresh interpreters load torch, transformers and the tiny model (~10-20 s)
def test_random_keeps_its_tokens_under_another_cpu_kernel_set():
    """The same model and images with torch's CPU kernels for another instruction set (ATEN_CPU_CAPABILITY=default,
    no AVX; MKL and oneDNN held to SSE4): the features differ in their last bits, the kept tokens do not."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    runs = []
    for extra in ({}, {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                       "ONEDNN_MAX_CPU_ISA": "SSE41"}):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), **extra}
        out = subprocess.run([sys.executable, "-c", _KEPT_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout))
    assert runs[0]["kept"] == runs[1]["kept"]
    if runs[0]["features"] == runs[1]["features"]:
        pytest.skip("this CPU computes the same bits under both kernel sets (the kept tokens agree anyway)")
