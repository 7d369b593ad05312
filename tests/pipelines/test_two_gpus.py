"""One model over an actor's two GPUs (Gemma 4 31B in bfloat16, ~62 GB, on 48 GB A40s): the placement, on the CPU.

- the memory limits per GPU and the refusal of a GPU count torch and Ray disagree on, worked by hand;
- the balanced device map of the published 31B over two A40s (meta device: no memory), every decoder layer whole;
- real Ray with fake GPUs (``ray.init(num_gpus=4)``): the plan for ``gpus_per_worker: 2`` asks 2 GPUs per actor, and
  two such actors each get two GPUs of their own, from which the actor's placement is a two-GPU split.

The CUDA half (``from_pretrained`` / ``materialize`` dispatching onto two real GPUs, a generation through the split
model) is stage ``two-gpus`` of scripts/gpu_checklist.sh's plan.
"""
from __future__ import annotations

import collections
import os
import shutil
import tempfile

import pytest
import ray

from pipelines.config import Resources
from pipelines.run import resources as planning
from pipelines.run.ray_connect import patient_start
from pipelines.weights import gpu_placement
from promprune.models.placement import HEADROOM, device_map_for, gpu_split

A40 = 48 * 2 ** 30  # bytes


def test_gpu_split_by_hand():
    assert gpu_split([A40, A40]) == {"device_map": "balanced", "max_memory": {0: int(A40 * HEADROOM),
                                                                               1: int(A40 * HEADROOM)}}
    assert gpu_split([A40]) is None and gpu_split([]) is None  # one device: nothing to spread
    assert gpu_split([100, 200], headroom=0.5)["max_memory"] == {0: 50, 1: 100}
    with pytest.raises(ValueError, match=r"headroom must be in \(0, 1\]"):
        gpu_split([A40, A40], headroom=0)


def test_gpu_placement_follows_rays_assignment():
    assert gpu_placement(["3"], [A40]) is None
    assert gpu_placement(["2", "3"], [A40, A40])["max_memory"] == {0: int(A40 * HEADROOM), 1: int(A40 * HEADROOM)}
    with pytest.raises(RuntimeError, match=r"Ray assigned this actor GPUs \['2', '3'\] but torch sees 4 GPU\(s\)"):
        gpu_placement(["2", "3"], [A40] * 4)


def test_the_31b_splits_evenly_over_two_a40s_by_whole_layers():
    """bfloat16 (2 bytes a parameter): ~29 GiB on each GPU, under 85% of 48 GiB; no decoder or vision layer split."""
    import torch

    from promprune.models.shapes import shape_vlm

    model, _ = shape_vlm("gemma4_31b", device="meta", dtype=torch.bfloat16)
    split = gpu_split([A40, A40])
    placed = device_map_for(model, split["device_map"], split["max_memory"])
    assert set(placed.values()) == {0, 1}
    held = collections.Counter()
    for name, p in model.named_parameters():
        owner = max((k for k in placed if name == k or name.startswith(k + ".")), key=len)
        held[placed[owner]] += p.numel() * 2
        assert ".layers." not in owner or owner.split(".")[-1].isdigit()  # a whole layer, never part of one
    assert all(held[d] <= split["max_memory"][d] for d in (0, 1))
    assert abs(held[0] - held[1]) < 0.05 * (held[0] + held[1])
    assert placed["model.language_model.embed_tokens"] == 0 and placed["model.language_model.layers.59"] == 1


@pytest.mark.slow  # a local Ray (tens of seconds to start on a busy 2-core machine)
def test_two_gpus_per_worker_reach_each_actor_as_a_two_gpu_split():
    plan = planning.plan(Resources(gpus_per_worker=2, max_gpus=4), n_trials=1, blocks_per_trial=8,
                         cluster={"GPU": 4, "CPU": 2})
    assert plan.bundle() == {"GPU": 2, "CPU": 1} and plan.max_actors == 2  # 4 GPUs: two 2-GPU actors

    def probe():  # defined here, so the worker unpickles it without importing this module (and the pipeline)
        return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    with patient_start():  # a busy machine's slow node registration is waited for
        ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, _temp_dir=ray_dir)
    try:
        task = ray.remote(probe).options(num_gpus=plan.gpus, num_cpus=0.5)
        probes = ray.get([task.remote() for _ in range(2)])
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    seen = []
    for ids, visible in probes:
        assert len(ids) == 2 and visible == ",".join(str(i) for i in ids)  # torch would see exactly these two
        # the actor's placement: local indices 0 and 1 (each an A40, as torch reports it), whatever the node's ids
        assert gpu_placement(ids, [A40, A40]) == gpu_split([A40, A40])
        seen += ids
    assert sorted(int(i) for i in seen) == [0, 1, 2, 3]  # each actor its own two


def test_an_actors_placement_reaches_the_model_through_both_loading_paths(monkeypatch):
    """ModelSource.load hands the actor's placement to from_pretrained (a factory model: built, then dispatched by
    promprune.models.placement) and to materialize (published weights): here a CPU "placement" (this machine has no
    GPU; the probe of the actor's GPUs is what is replaced), real accelerate dispatch, the same answers as unspread."""
    import pipelines.weights as weights
    from pipelines.weights import ModelSource, extract, materialize
    from tests.models.conftest import make_image

    split = {"device_map": "sequential", "max_memory": {"cpu": 2 ** 34}}
    monkeypatch.setattr(weights, "local_device", lambda: "cuda")  # as in an actor holding GPUs
    monkeypatch.setattr(weights, "actor_placement", lambda: split)
    source = ModelSource(pretrained="tiny:gemma4", dtype="float32")
    spread = source.load(method="promprune", budget=8)
    assert spread.model.hf_device_map == {"": "cpu"}
    monkeypatch.setattr(weights, "actor_placement", lambda: None)
    monkeypatch.setattr(weights, "local_device", lambda: "cpu")
    reference = source.load(method="promprune", budget=8)
    assert not hasattr(reference.model, "hf_device_map")
    image, question = make_image(40, 56, 0), "Colour?"
    want = reference.generate([image], [question], max_new_tokens=3)[0].token_ids
    assert spread.generate([image], [question], max_new_tokens=3)[0].token_ids == want
    recipe, arrays = extract(reference.model)
    model, _ = materialize((recipe, reference.processor, arrays), "cuda", split)
    assert model.hf_device_map == {"": "cpu"}
