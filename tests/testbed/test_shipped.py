"""The shipped testbed:llava weights: checksum, recipe version, and the answers recorded when they were made; the
recipe shrunken to a few steps makes a loadable, verified model the same way (what CI can afford)."""
import json

import pytest
import torch

from promprune.models import PrunedVLM
from promprune.testbed import scenes, scores, shipped, training, zoo

pytestmark = pytest.mark.skipif(not shipped.available(), reason="no shipped weights in promprune/testbed/weights")


def test_shipped_file_matches_its_manifest():
    meta = shipped.manifest()
    assert shipped.sha256(shipped.WEIGHTS_DIR / shipped.WEIGHTS_FILE) == meta["sha256"]
    assert (shipped.WEIGHTS_DIR / shipped.WEIGHTS_FILE).stat().st_size == meta["bytes"] <= 25 * 2 ** 20
    assert meta["files"] == {name: shipped.sha256(shipped.WEIGHTS_DIR / name)
                             for name in ("model.safetensors", "config.json")}
    assert meta["recipe"] == training.RECIPE and meta["hyperparameters"]["seed"] == meta["seed"]
    assert meta["command"].startswith("python -m promprune.testbed.shipped --out")
    for family in scenes.FAMILIES:  # every score is recorded with its chance level
        assert meta["scores"]["unpruned"][family]["chance"] == round(scores.CHANCE[family], 4)


def test_testbed_llava_loads_the_shipped_weights_and_answers_as_recorded(monkeypatch):
    monkeypatch.delenv(zoo.RETRAIN_ENV, raising=False)
    monkeypatch.delenv(zoo.WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(training, "train", lambda **kw: pytest.fail("testbed:llava must not train"))
    vlm = PrunedVLM.from_pretrained("testbed:llava", method=None)
    recorded = shipped.manifest()["fixed_answers"]
    drawn = shipped.fixed_questions()
    assert [q.question for _, q in drawn] == [r["question"] for r in recorded]
    with torch.inference_mode():
        assert scores.answers(vlm, drawn) == [r["answer"] for r in recorded]


def test_a_corrupted_or_stale_file_is_refused(tmp_path):
    for name in (shipped.WEIGHTS_FILE, "config.json", shipped.MANIFEST):
        (tmp_path / name).write_bytes((shipped.WEIGHTS_DIR / name).read_bytes())
    data = bytearray((tmp_path / shipped.WEIGHTS_FILE).read_bytes())
    data[-1] ^= 1
    (tmp_path / shipped.WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match the manifest"):
        shipped.load(tmp_path)
    meta = json.loads((tmp_path / shipped.MANIFEST).read_text())
    (tmp_path / shipped.MANIFEST).write_text(json.dumps({**meta, "recipe": "v0"}))
    with pytest.raises(ValueError, match="recipe 'v0'"):
        shipped.load(tmp_path)


def test_an_edited_config_is_refused_by_name(tmp_path, monkeypatch):
    """config.json is read with the weights: vision_feature_layer -1 (the tower's last layer, not the one it was
    trained for) would load silently and answer worse. testbed:llava from a folder (PROMPRUNE_TESTBED_WEIGHTS) with it
    edited is refused, naming the file; so is a generation_config.json the manifest does not record."""
    for name in (shipped.WEIGHTS_FILE, "config.json", shipped.MANIFEST):
        (tmp_path / name).write_bytes((shipped.WEIGHTS_DIR / name).read_bytes())
    monkeypatch.delenv(zoo.RETRAIN_ENV, raising=False)
    monkeypatch.setenv(zoo.WEIGHTS_ENV, str(tmp_path))
    monkeypatch.setattr(training, "train", lambda **kw: pytest.fail("testbed:llava must not train"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vision_feature_layer"] == -2
    (tmp_path / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -1}, indent=2))
    with pytest.raises(ValueError, match=r"config\.json: sha256 [0-9a-f]{64} does not match the manifest's"):
        PrunedVLM.from_pretrained("testbed:llava", method=None)
    (tmp_path / "config.json").write_bytes((shipped.WEIGHTS_DIR / "config.json").read_bytes())
    shipped.check(tmp_path, checksum=True)  # restored: accepted
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 1}))
    with pytest.raises(ValueError, match=r"generation_config\.json: the load would read this file"):
        shipped.load(tmp_path)


def test_the_recipe_shrunken_makes_a_loadable_verified_model(tmp_path, monkeypatch):
    out = tmp_path / "weights"
    meta = shipped.make(out, eval_n=4, vision_steps=2, align_steps=2, steps=3, relation_steps=2, batch_size=4,
                        vision_batch_size=4, progress=False)
    assert meta["sha256"] == shipped.sha256(out / shipped.WEIGHTS_FILE) == meta["files"][shipped.WEIGHTS_FILE]
    assert meta["files"]["config.json"] == shipped.sha256(out / "config.json")
    assert meta["hyperparameters"]["steps"] == 3 and len(meta["fixed_answers"]) == 2 * len(scenes.FAMILIES)
    assert set(meta["scores"]) == {"n_per_family", "budget", "unpruned", "random@16", "divprune@16",
                                   "vispruner@16", "promprune@16"}
    monkeypatch.setenv(zoo.WEIGHTS_ENV, str(out))
    vlm = PrunedVLM.from_pretrained("testbed:llava", method="promprune", budget=16)
    with torch.inference_mode():
        assert scores.answers(vlm.__class__(vlm.model, vlm.processor, method=None), shipped.fixed_questions()) == [
            r["answer"] for r in meta["fixed_answers"]]


def test_the_config_a_driver_reads_is_the_recipes(monkeypatch):
    """A sweep's driver reads testbed:llava's config from the shipped config.json and prepares the shipped weights by
    their checksum, without the model's code (which imports transformers' image processing: seconds); the config is
    the recipe's, field for field (the saved dtype and architectures aside)."""
    import subprocess
    import sys

    from promprune.models.factories import model_config
    from promprune.testbed import model as testbed_model

    monkeypatch.delenv(zoo.RETRAIN_ENV, raising=False)
    monkeypatch.delenv(zoo.WEIGHTS_ENV, raising=False)
    saved, recipe = model_config("testbed:llava").to_dict(), testbed_model.config().to_dict()
    for config in (saved, recipe):
        for part in (config, config["vision_config"], config["text_config"]):
            part.pop("dtype", None)
        config.pop("architectures", None)
    assert saved == recipe
    probe = ("import sys; from promprune.models.factories import model_config, find_model_factory; "
             "model_config('testbed:llava'); f, name = find_model_factory('testbed:llava'); f.prepare(name); "
             "print('promprune.testbed.model' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
