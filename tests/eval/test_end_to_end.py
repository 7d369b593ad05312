"""The offline tasks end to end on a tiny model: our sharded path against lmms-eval's own evaluator and plugin path."""

import random

import pytest
from lmms_eval.evaluator import simple_evaluate
from lmms_eval.models.registry_v2 import ModelRegistryV2

from promprune.eval import EASYVQA_TASKS, PromPruneLMM, build_requests, run_requests, score
from promprune.eval.lmms_plugin import MANIFEST
from promprune.eval.tasks import task_manager
from promprune.models import PrunedVLM

LIMIT = 6  # documents per task: enough for several batches and shards, small enough for a 2-core CPU


@pytest.fixture(scope="module")
def vlm():
    return PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8)


def _sharded(vlm, rows, n_shards=3, seed=0):
    """What the pipeline does: shuffle, split into shards, generate each, gather in arbitrary order."""
    rows = rows[:]
    random.Random(seed).shuffle(rows)
    shards = [rows[i::n_shards] for i in range(n_shards)]
    return [p for shard in reversed(shards) for p in run_requests(vlm, shard, batch_size=1)]


@pytest.mark.slow
def test_sharded_scores_equal_lmms_eval_evaluator(vlm):
    tasks = list(EASYVQA_TASKS)
    ours = _sharded(vlm, build_requests(tasks, limit=LIMIT))
    ours_scores = score(ours)

    lm = PromPruneLMM(vlm=vlm, batch_size=1)
    reference = simple_evaluate(
        model=lm, tasks=tasks, limit=LIMIT, task_manager=task_manager(tasks), bootstrap_iters=0, log_samples=True
    )
    for task in tasks:
        samples = {s["doc_id"]: s for s in reference["samples"][task]}
        mine = {p.doc_id: p for p in ours if p.task == task}
        assert sorted(mine) == sorted(samples) == list(range(LIMIT))
        for doc_id, sample in samples.items():
            # the prompt and generation kwargs lmms-eval built for this doc are the ones our row carried ...
            assert sample["arguments"][:2] == [mine[doc_id].prompt, mine[doc_id].gen_kwargs]
            # ... and the same inputs gave the same generation
            assert sample["filtered_resps"][0] == mine[doc_id].prediction
        # and the same numbers
        expected = {k.split(",")[0]: v for k, v in reference["results"][task].items()
                    if "," in k and "_stderr" not in k}
        assert {k: v for k, v in ours_scores[task].items() if k not in ("n_samples", "n_failed")} == expected
        assert ours_scores[task]["n_samples"] == LIMIT and ours_scores[task]["n_failed"] == 0


@pytest.mark.slow
def test_corrupt_image_counts_as_a_failed_wrong_sample(vlm):
    rows = build_requests(["easyvqa_yesno"], limit=LIMIT)
    rows[1].image = rows[1].image[: len(rows[1].image) // 3]
    predictions = _sharded(vlm, rows)
    failed = [p for p in predictions if p.error]
    assert len(predictions) == LIMIT and len(failed) == 1
    assert failed[0].doc_id == 1 and "easyvqa_yesno doc 1: unreadable image" in failed[0].error
    assert score(predictions)["easyvqa_yesno"]["n_failed"] == 1


def test_plugin_resolves_through_lmms_eval_registry():
    """The manifest the entry point exports is accepted by lmms-eval's registry and yields the plugin class."""
    registry = ModelRegistryV2()
    for manifest in registry._coerce_payload_to_manifests(MANIFEST):  # what load_entrypoint_manifests does
        registry.register_manifest(manifest)
    cls = registry.get_model_class("promprune")
    assert cls is PromPruneLMM
    lm = cls.create_from_arg_string("pretrained=tiny:llava,method=none,budget=none", {"batch_size": 2})
    assert lm.vlm.method is None and lm.vlm.budget is None and lm.batch_size == 2
    # lmms-eval's command line always passes its --batch_size (default 1): batch_size in --model_args too was a
    # TypeError ("got multiple values for keyword argument 'batch_size'")
    with pytest.raises(ValueError, match=r"pass --batch_size N instead of batch_size=N in --model_args"):
        cls.create_from_arg_string("pretrained=tiny:llava,method=none,batch_size=4", {"batch_size": 1})
    assert cls.create_from_arg_string("pretrained=tiny:llava,method=none,batch_size=4").batch_size == 4
    lm = cls.create_from_arg_string("pretrained=tiny:llava,method=promprune,budget=8,tau=0.05")
    assert lm.vlm.budget == 8 and lm.vlm.method_options["tau"] == 0.05
    with pytest.raises(ValueError, match="budget"):
        cls.create_from_arg_string("pretrained=tiny:llava,budget=sixty")
    with pytest.raises(ValueError, match="pretrained"):
        cls.create_from_arg_string("method=promprune")


def _installed_entry_point():
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="lmms_eval.models") if ep.name == "promprune"]
    if not found:
        pytest.skip("promprune is not installed with its lmms_eval.models entry point (pip install -e .)")
    return found[0]


def test_installed_entry_point_is_a_manifest_lmms_eval_accepts():
    """lmms-eval calls a callable payload with no arguments: the entry point must name MANIFEST, not the class."""
    payload = _installed_entry_point().load()
    assert ModelRegistryV2()._coerce_payload_to_manifests(payload) == [MANIFEST()]


@pytest.mark.parametrize("first", ["from promprune.eval import PromPruneLMM", "import promprune.eval.lmms_plugin", ""])
def test_lmms_evals_registry_finds_the_plugin_whatever_is_imported_first(first):
    """A fresh process: lmms-eval's registry holds promprune whether the plugin or lmms-eval's models are imported
    first. Importing ``lmms_eval.models`` loads every entry point's manifest; the plugin imported it at its top, before
    MANIFEST existed, so with the plugin imported first lmms-eval read MANIFEST from the half-imported module, logged
    "has no attribute 'MANIFEST'" and left promprune (and any later plugin) out of its registry."""
    import subprocess
    import sys

    _installed_entry_point()
    code = f"{first}\nfrom lmms_eval.models import get_model\nprint(get_model('promprune').__qualname__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "PromPruneLMM" and "MANIFEST" not in out.stderr


@pytest.mark.slow
def test_lmms_eval_command_line_runs_the_plugin(tmp_path):
    """`lmms-eval --model promprune ...` as a user types it, on an offline task."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from promprune.eval import prepare_offline_tasks

    _installed_entry_point()
    cli = Path(sys.executable).with_name("lmms-eval")
    cmd = [str(cli), "--model", "promprune", "--model_args", "pretrained=tiny:llava,method=promprune,budget=8",
           "--tasks", "easyvqa_yesno", "--include_path", str(prepare_offline_tasks()), "--limit", "3",
           "--output_path", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in tmp_path.rglob("*results*.json")]
    assert results, "lmms-eval wrote no results:\n" + done.stdout[-2000:] + done.stderr[-3000:]
    assert results[0]["results"]["easyvqa_yesno"]["accuracy,none"] >= 0
    assert results[0]["n-samples"]["easyvqa_yesno"]["effective"] == 3


def test_plugin_sharing_flags_are_checked_before_loading():
    with pytest.raises(ValueError, match="model_args vision_once='maybe' must be true or false"):
        PromPruneLMM(pretrained="tiny:llava", method="none", vision_once="maybe")
    with pytest.raises(ValueError, match="prefix_cache=true needs vision_once=true"):
        PromPruneLMM(pretrained="tiny:llava", method="none", prefix_cache="true")


def test_the_plugin_refuses_a_budget_that_prunes_nothing_before_loading(monkeypatch):
    """A probe's case: budget=100000 ran unpruned through the plugin, reported as PromPrune; the sweep and
    evaluate.py refuse it. tiny:llava gives an image 36 visual tokens (a 6 x 6 grid: counted by hand from its
    config, image 96 / patch 16)."""
    from promprune.models import PrunedVLM
    from promprune.models.factories import model_config

    config = model_config("tiny:llava")
    assert (config.vision_config.image_size // config.vision_config.patch_size) ** 2 == 36
    loads = []
    monkeypatch.setattr(PrunedVLM, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a)))
    for budget in (36, "100000"):
        with pytest.raises(ValueError, match=rf"budget={budget} keeps all 36 visual tokens tiny:llava gives"):
            PromPruneLMM(pretrained="tiny:llava", method="promprune", budget=budget)
    assert loads == []
    PromPruneLMM(pretrained="tiny:llava", method="promprune", budget=35)  # below: loads
    assert len(loads) == 1
    # a video run (video_frames given): a clip of several frames gives more tokens than an image, so the budget
    # still prunes it and is not refused (tiny LLaVA-OneVision: 48 a single image, 8 frames of its pooled grid more)
    with pytest.raises(ValueError, match="budget=64 keeps all 48 visual tokens tiny:llava_onevision gives"):
        PromPruneLMM(pretrained="tiny:llava_onevision", method="promprune", budget=64)
    PromPruneLMM(pretrained="tiny:llava_onevision", method="promprune", budget=64, video_frames=8)
    assert len(loads) == 2


def test_the_plugin_refuses_what_the_model_cannot_run_before_loading(monkeypatch):
    """float64 with eager attention (NaN in padded rows: the plugin returned '' as a success), an in-LLM method under
    flash attention (every sample failed at generate), a device this machine lacks: refused before loading."""
    import torch

    from promprune.models import PrunedVLM

    loads = []
    monkeypatch.setattr(PrunedVLM, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a)))
    with pytest.raises(ValueError, match=r"model_args: dtype float64 with attn_implementation 'eager'.*'sdpa'"):
        PromPruneLMM(pretrained="tiny:llava", method="none", dtype="double", attn_implementation="eager")
    with pytest.raises(ValueError, match=r"'fastv'.*'flash_attention_2'"):
        PromPruneLMM(pretrained="tiny:llava", method="fastv", budget=8, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match=r"device_map 'cpuu'.*did you mean 'cpu'"):
        PromPruneLMM(pretrained="tiny:llava", method="none", device="cpuu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device_map 'cuda:3'"):
            PromPruneLMM(pretrained="tiny:llava", method="none", device="cuda:3")
    assert loads == []
    PromPruneLMM(pretrained="tiny:llava", method="none", dtype="float64", attn_implementation="sdpa")
    PromPruneLMM(pretrained="tiny:llava", method="none", dtype="auto", attn_implementation="eager")
    assert len(loads) == 2


def test_the_plugin_fails_a_cut_off_image_instead_of_answering_it(monkeypatch):
    """Under lmms-eval's process-wide LOAD_TRUNCATED_IMAGES a JPEG cut to a third decoded partly grey, and the model
    answered a picture nobody asked about; as in the pipeline's requests, it is one failed sample."""
    import io

    import numpy as np
    from lmms_eval.api.instance import Instance
    from PIL import Image, ImageFile

    from promprune.eval.scoring import FAILED_ANSWER

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # what importing lmms-eval's tasks sets
    jpeg = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(jpeg, "JPEG")
    whole, cut = jpeg.getvalue(), jpeg.getvalue()[: len(jpeg.getvalue()) // 3]
    lm = PromPruneLMM(pretrained="tiny:llava", method="promprune", budget=8)
    lm.task_dict = {"toy": {"test": [{"image": Image.open(io.BytesIO(data))} for data in (whole, cut)]}}
    def doc_to_visual(doc):  # as lmms-eval's tasks write it
        return [doc["image"].convert("RGB")]

    requests = [Instance("generate_until", ("Is it red?", {"max_new_tokens": 2}, doc_to_visual, i, "toy", "test"),
                         idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 1}) for i in range(2)]
    answers = lm.generate_until(requests)
    assert len(answers) == 2 and answers[1] == FAILED_ANSWER  # the answer every task scores wrong (not "")
    assert [(task, doc) for task, doc, _ in lm.failures] == [("toy", 1)] and "truncated" in lm.failures[0][2]


def _sampled_under_lmms_eval(batch_size, torch_seed, limit=LIMIT):
    """Each doc's sampled answers (two repeats) from lmms-eval's own evaluator, which builds the plugin by name after
    seeding torch, as ``lmms-eval --model promprune --seed ... --batch_size N --gen_kwargs ...`` does."""
    tasks = ["easyvqa_open"]
    out = simple_evaluate(model="promprune", model_args="pretrained=tiny:llava,method=promprune,budget=8",
                          tasks=tasks, limit=limit, batch_size=batch_size, torch_random_seed=torch_seed, repeats=2,
                          gen_kwargs="do_sample=True,temperature=30,max_new_tokens=4", task_manager=task_manager(tasks),
                          bootstrap_iters=0, log_samples=True)
    return {s["doc_id"]: tuple(s["resps"][0]) for s in out["samples"]["easyvqa_open"]}


@pytest.mark.slow
def test_sampled_answers_under_lmms_eval_follow_its_seed_not_the_batch():
    """The plugin passed no seed: sampled requests drew from transformers' multinomial over each batch, so an
    answer changed with --batch_size. Each request now draws from its own stream, seeded from lmms-eval's torch
    seed and the request (task, doc, repeat): the same answers at batch sizes 1 and 4; the two repeats of a doc
    draw apart; another --seed draws others (temperature 30 on the tiny model: 4 tokens near uniform over its top
    50, so equal answers would be a seeding bug)."""
    import torch

    first = _sampled_under_lmms_eval(1, 7)
    assert sorted(first) == list(range(LIMIT)) and all(len(r) == 2 for r in first.values())
    torch.manual_seed(99)
    torch.rand(100)  # what the process drew before does not matter either
    assert _sampled_under_lmms_eval(4, 7) == first
    assert sum(a != b for a, b in first.values()) >= LIMIT - 1
    other = _sampled_under_lmms_eval(4, 8)
    assert sum(other[d][0] != first[d][0] for d in first) >= LIMIT - 1


def test_the_plugins_sampled_answers_do_not_depend_on_the_request_order_or_batch(vlm):
    """generate_until on lmms-eval Instances (a repeated request comes as copies of one Instance, as lmms-eval
    clones it): the same answers at batch sizes 1 and 4 and with the requests shuffled (a request's copies draw in
    the order asked: the k-th copy the k-th stream); the seed is torch's when the plugin is constructed."""
    import torch
    from lmms_eval.api.instance import Instance
    from PIL import Image

    colours = ["red", "green", "blue", "yellow", "purple"]
    kwargs = {"max_new_tokens": 4, "do_sample": True, "temperature": 30.0, "until": ["\n\n"]}

    def requests():
        made = [Instance("generate_until", (f"Question {i}: what colour?", dict(kwargs), lambda d: [d["image"]], i,
                                            "toy", "test"), idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 2})
                for i in range(len(colours))]
        return [r for r in made for _ in range(2)]  # lmms-eval's [req] * req.repeats

    def answers(batch_size, order=None, seed=7):
        torch.manual_seed(seed)  # what lmms-eval's --seed does just before it builds the model
        lm = PromPruneLMM(vlm=vlm, batch_size=batch_size)
        lm.task_dict = {"toy": {"test": [{"image": Image.new("RGB", (32, 32), c)} for c in colours]}}
        reqs = requests()
        order = list(range(len(reqs))) if order is None else order
        got = lm.generate_until([reqs[i] for i in order])
        assert not lm.failures
        by_doc: dict = {}
        for i, answer in zip(order, got):
            by_doc.setdefault(reqs[i].doc_id, []).append(answer)
        return by_doc

    first = answers(1)
    assert answers(4) == first
    shuffled = list(range(2 * len(colours)))
    random.Random(3).shuffle(shuffled)
    assert answers(4, shuffled) == first
    assert answers(3, shuffled[::-1]) == first
    assert sum(a != b for a, b in first.values()) >= len(colours) - 1  # the two copies draw apart
    other = answers(4, seed=8)
    assert sum(other[d][0] != first[d][0] for d in first) >= len(colours) - 1


def test_the_plugin_still_answers_sampled_beam_search(vlm):
    """Sampled beam search cannot draw per request (promprune.models.sampling refuses it): under the seeded plugin a
    task asking for it would fail every request; it keeps transformers' own sampling (and warns), answering what
    transformers' sampled beam search answers from the same torch state."""
    import torch
    from lmms_eval.api.instance import Instance
    from PIL import Image

    kwargs = {"max_new_tokens": 3, "do_sample": True, "temperature": 2.0, "num_beams": 2, "until": ["\n\n"]}
    lm = PromPruneLMM(vlm=vlm, batch_size=2)
    lm.task_dict = {"toy": {"test": [{"image": Image.new("RGB", (32, 32), c)} for c in ("red", "blue")]}}
    reqs = [Instance("generate_until", ("What colour?", dict(kwargs), lambda d: [d["image"]], i, "toy", "test"),
                     idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 1}) for i in range(2)]
    torch.manual_seed(5)
    answers = lm.generate_until(reqs)
    assert not lm.failures
    torch.manual_seed(5)
    plain = vlm.generate([Image.new("RGB", (32, 32), c) for c in ("red", "blue")], ["What colour?"] * 2,
                         max_new_tokens=3, do_sample=True, temperature=2.0, num_beams=2)
    assert answers == [g.text for g in plain]
