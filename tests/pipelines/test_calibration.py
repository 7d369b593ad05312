"""mu: calibrate — the median prominence over calibration images, measured with the sweep's model."""
from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines import calibration, preflight
from pipelines import spec as specs
from pipelines.weights import ModelSource
from promprune.models.tiny import tiny_vlm
from promprune.selection.entropy import feature_norm_entropy, spectral_entropy


@pytest.fixture
def image_folder(tmp_path):
    """Real photographs from scikit-image (offline) plus a nested one and a non-image file."""
    from skimage import data

    folder = tmp_path / "pretrain"
    (folder / "part2").mkdir(parents=True)
    photos = {"astronaut": data.astronaut(), "coffee": data.coffee(), "chelsea": data.chelsea(),
              "rocket": data.rocket(), "hubble": data.hubble_deep_field()}
    for i, (name, pixels) in enumerate(photos.items()):
        target = folder / "part2" if i == 4 else folder
        Image.fromarray(np.asarray(pixels)).convert("RGB").save(target / f"{name}.jpg")
    (folder / "README.txt").write_text("not an image")
    return folder


def _reference(images, metric):
    """Independent of PrunedVLM: the processor, plain get_image_features (LLaVA drops CLS: 'default'), the metric."""
    model, processor = tiny_vlm("llava")
    values = []
    for image in images:
        pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            feats = model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        feats = feats[0][None]  # one image: [1, 36, d]
        fn = spectral_entropy if metric == "spectral" else feature_norm_entropy
        values.append(float(fn(feats)[0]))
    return values


@pytest.mark.parametrize("metric", ["spectral", "feature_norm"])
def test_median_equals_an_independent_computation(image_folder, metric):
    cal = calibration.Calibration(images=str(image_folder), n=1000, batch_size=2)
    found = calibration.run(ModelSource("tiny:llava"), cal, [metric], budget=8)[metric]
    expected = _reference(calibration.load_images(cal), metric)
    assert found["n"] == 5
    np.testing.assert_allclose(found["values"], expected, rtol=1e-5, atol=1e-6)
    assert found["median"] == pytest.approx(statistics.median(expected))


def test_images_are_sampled_reproducibly(image_folder):
    a = calibration.load_images(calibration.Calibration(images=str(image_folder), n=3, seed=1))
    b = calibration.load_images(calibration.Calibration(images=str(image_folder), n=3, seed=1))
    assert len(a) == 3 and [np.asarray(x).sum() for x in a] == [np.asarray(x).sum() for x in b]


def test_apply_replaces_only_calibrate():
    assert calibration.apply({"mu": "calibrate", "metric": "attention"}, {"attention": 0.81}) == {
        "mu": 0.81, "metric": "attention"}
    assert calibration.apply({"mu": 0.42}, {"spectral": 0.5}) == {"mu": 0.42}
    with pytest.raises(ValueError, match="measured \\['spectral'\\]"):
        calibration.apply({"mu": "calibrate", "metric": "attention"}, {"spectral": 0.5})


def test_spec_needs_images_when_a_trial_calibrates(image_folder, tmp_path):
    raw = {"name": "c", "version": 1, "grid": {"method": "promprune", "budget": 8, "mu": "calibrate"}}
    with pytest.raises(specs.SpecError, match="calibration.images: required"):
        specs.parse(raw)
    parsed = specs.parse({**raw, "calibration": {"images": str(image_folder), "n": 4}})
    assert calibration.metrics_to_calibrate(specs.expand(parsed)) == ["spectral"]
    assert calibration.check_source(str(image_folder)) is None
    assert "is not a folder" in calibration.check_source(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert "holds no image" in calibration.check_source(str(tmp_path / "empty"))


def test_a_folder_with_fewer_images_than_n_is_a_note_not_a_refusal(image_folder, capsys, monkeypatch):
    """A probe's case: calibration.n 1000 on a folder of 3 images calibrated on 3 while the run said n=1000. The
    checks count the image files by their suffix (none decoded) and say so."""
    monkeypatch.setattr("PIL.Image.open", lambda *a, **k: pytest.fail("an image was decoded"))
    assert calibration.check_source(str(image_folder), 1000) is None
    note = capsys.readouterr().out
    assert note.startswith(f"note: calibration.images: {str(image_folder)!r} holds 5 images, fewer than "
                           "calibration.n = 1000, so mu is calibrated on those 5") and "set calibration.n to 5" in note
    assert calibration.check_source(str(image_folder), 5) is None
    assert calibration.check_source(str(image_folder)) is None
    assert capsys.readouterr().out == ""  # enough images, or no n: nothing said


def test_the_parent_run_records_how_many_images_the_calibration_used(image_folder, tmp_path, monkeypatch):
    """The parent run said ``calibration_images: <folder> (n=1000, seed=0)`` for a calibration of 5 images, and no
    param or metric held 5: the param now gives the count used (with the n asked) and ``calibration/images`` is 5."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from pipelines import sweep

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    parent = client.create_run(client.create_experiment("c")).info.run_id
    spec = specs.parse({"name": "c", "version": 1, "model": {"pretrained": "tiny:llava"},
                        "grid": {"method": "promprune", "budget": 8, "mu": "calibrate"},
                        "calibration": {"images": str(image_folder), "n": 1000}})
    source = ModelSource("tiny:llava")
    pool = SimpleNamespace(source=source, plan=SimpleNamespace(on_gpu=False),
                           calibrate=lambda cal, metrics, budget: calibration.run(source, cal, metrics, budget))
    medians = sweep.calibrate(spec, specs.expand(spec), pool, client, parent)
    run = client.get_run(parent)
    assert run.data.metrics["calibration/images"] == 5
    assert run.data.metrics["calibration/median_spectral"] == medians["spectral"]
    assert run.data.params["calibration_images"] == f"{image_folder} (n=5 of calibration.n=1000, seed=0)"


def test_a_hub_calibration_source_not_here_is_refused_before_ray(tmp_path, monkeypatch):
    # it used to pass the checks and fail ~45 s later inside the sweep, its MLflow run left RUNNING
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    problem = calibration.check_source("hf:someone/pretrain-images:train")
    assert problem.startswith("calibration.images ('hf:someone/pretrain-images:train') reads the Hugging Face hub "
                              "dataset 'someone/pretrain-images', which is not in this machine's datasets cache")
    assert problem.endswith("give a folder of images instead, or calibrate on testbed:train (the testbed's model "
                            "only)")
    raw = {"name": "c", "version": 1, "grid": {"method": "promprune", "budget": 8, "mu": "calibrate"},
           "calibration": {"images": "hf:someone/pretrain-images"}}
    with pytest.raises(specs.SpecError, match=r"calibration.images \('hf:someone/pretrain-images'\) reads"):
        preflight.check_or_raise(specs.parse(raw), "c.yaml", store=False)
    (tmp_path / "hub" / "datasets--someone--pretrain-images").mkdir(parents=True)  # the hub's download cache
    assert calibration.check_source("hf:someone/pretrain-images") is None


def _quickstart_calibration():
    spec = specs.load("sweeps/quickstart.yaml", [])
    trials = specs.expand(spec)
    metrics = calibration.metrics_to_calibrate(trials)
    return spec, metrics, calibration.budget_of(trials)


def test_the_shipped_calibration_is_what_measuring_gives():
    """The quickstart's shipped entry (read by the sweep instead of measuring its 500 scenes) holds what measuring
    gives now with the shipped weights, value for value (float64: exact): its first 50 scenes measured again (the
    scenes are drawn in order from the seed, so n=50 draws the first 50 of n=500; 50 keep CI's time down), and its
    median is the median of its values."""
    spec, metrics, budget = _quickstart_calibration()
    described = calibration.settings(spec.model, spec.calibration, metrics, budget, on_gpu=False)
    shipped = calibration.shipped_results(described)
    assert shipped is not None, "no shipped calibration for sweeps/quickstart.yaml: python -m pipelines.calibration " \
                                "--ship sweeps/quickstart.yaml"
    first = calibration.Calibration(**{**{f: getattr(spec.calibration, f) for f in ("images", "seed", "batch_size")},
                                       "n": 50})
    measured = calibration.run(spec.model, first, metrics, budget)
    for metric in metrics:
        assert json.loads(json.dumps(measured[metric]["values"])) == shipped[metric]["values"][:50]
        assert shipped[metric]["n"] == len(shipped[metric]["values"]) == spec.calibration.n
        assert shipped[metric]["median"] == statistics.median(shipped[metric]["values"])
    assert round(shipped["spectral"]["median"], 4) == 0.2419  # the README's "mu calibrated: 0.2419"


@pytest.mark.parametrize("change", [
    {"n": 499}, {"seed": 1}, {"images": "testbed:calibration"}, {"batch_size": 4}, {"dtype": "float32"},
    {"options": {"image_tokens": 64}}, {"metrics": ["feature_norm"]}, {"budget": 8}, {"on_gpu": True}])
def test_a_calibration_is_reused_only_with_the_same_settings(change):
    """Any setting the values depend on, changed, finds no shipped entry (the sweep measures)."""
    spec, metrics, budget = _quickstart_calibration()
    source, cal = spec.model, spec.calibration
    if {"dtype", "options"} & set(change):
        source = ModelSource(**{**{f: getattr(source, f) for f in ("pretrained", "dtype", "attn_implementation",
                                                                   "options")}, **change})
    cal = calibration.Calibration(**{**{f: getattr(cal, f) for f in ("images", "n", "seed", "batch_size")},
                                     **{k: v for k, v in change.items() if k in ("images", "n", "seed", "batch_size")}})
    args = (change.get("metrics", metrics), change.get("budget", budget), change.get("on_gpu", False))
    assert calibration.shipped_results(calibration.settings(source, cal, *args)) is None
    assert calibration.shipped_results(calibration.settings(spec.model, spec.calibration, metrics, budget,
                                                            False)) is not None


def test_weights_that_cannot_be_named_are_always_measured(monkeypatch, tmp_path):
    """Only the shipped testbed weights are named (their sha256); a checkpoint, a tiny model, or testbed weights
    retrained or taken from elsewhere are not, so nothing is reused for them."""
    from promprune.testbed import shipped, zoo

    assert calibration.weights_identity("testbed:llava") == f"testbed:llava sha256:{shipped.manifest()['sha256']}"
    assert calibration.weights_identity("tiny:llava") is None
    assert calibration.weights_identity("llava-hf/llava-1.5-7b-hf") is None
    monkeypatch.setenv(zoo.RETRAIN_ENV, "1")
    assert calibration.weights_identity("testbed:llava") is None
    monkeypatch.delenv(zoo.RETRAIN_ENV)
    monkeypatch.setenv(zoo.WEIGHTS_ENV, str(tmp_path))
    assert calibration.weights_identity("testbed:llava") is None


def test_shipping_a_spec_that_cannot_be_read_is_one_paragraph(tmp_path):
    """``python -m pipelines.calibration --ship`` with a missing or broken spec: the loader's own words, exit 2, no
    traceback, nothing written."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: t\ngrid: {method: [promprune\n")
    before = calibration.SHIPPED.read_bytes()
    for path in (tmp_path / "missing.yaml", broken):
        out = subprocess.run([sys.executable, "-m", "pipelines.calibration", "--ship", str(path)], cwd=repo,
                             capture_output=True, text=True, timeout=120)
        with pytest.raises(specs.SpecError) as raised:
            specs.load(str(path))
        assert (out.returncode, out.stderr.strip()) == (2, f"error: {raised.value}")
    assert calibration.SHIPPED.read_bytes() == before


@pytest.mark.parametrize("images,needle", [
    ("/nonexistent/imgs", "calibration.images: '/nonexistent/imgs' is not a folder here"),
    ("testbed:trian", "calibration.images: 'testbed:trian': the testbed has the splits"),
    ("hf:nosuch/ds", "calibration.images ('hf:nosuch/ds') reads the Hugging Face hub dataset 'nosuch/ds', which is "
                     "not in this machine's datasets cache")])
def test_shipping_images_that_cannot_be_read_is_refused_before_the_model_loads(images, needle, tmp_path, monkeypatch,
                                                                               capsys):
    """``--ship`` checks the calibration source as the sweep does (`check_source`): it used to load the model, then
    fail with a ValueError or a ConnectionError traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(calibration, "run", lambda *a, **k: pytest.fail("the model was loaded"))
    before = calibration.SHIPPED.read_bytes()
    with pytest.raises(specs.SpecError, match="1 problem") as raised:
        calibration.ship("sweeps/quickstart.yaml", [f"calibration.images={images}"])
    assert needle in str(raised.value)
    assert calibration.main(["--ship", "sweeps/quickstart.yaml", "--set", f"calibration.images={images}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {raised.value}"
    assert calibration.SHIPPED.read_bytes() == before


def test_shipping_a_spec_without_a_calibrating_trial_is_bad_input():
    """No trial sets mu: calibrate: exit 2 (bad input), as every refusal of the command line (it exited 1)."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", "pipelines.calibration", "--ship", "sweeps/quickstart.yaml", "--set",
                          "trials=[]"], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: sweeps/quickstart.yaml: 1 problem(s):\n  - trials: no trial sets mu: "
                                 "calibrate, so there is no calibration to ship")
