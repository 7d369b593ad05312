"""The pydantic schema of sweep specs: every problem at once under its dotted path, strict numbers, and trial ids
that stay byte-identical across the rewrite (they key nightly comparisons)."""
from __future__ import annotations

import pytest

from pipelines import spec as specs

BASE = {"name": "t", "version": 1, "grid": {"method": "promprune", "budget": 8}}


def problems(**fields) -> list[str]:
    with pytest.raises(specs.SpecError) as e:
        specs.parse({**BASE, **fields})
    return e.value.errors


def test_trial_ids_are_those_computed_before_the_schema_rewrite():
    """Hard-coded from pipelines/spec.py at 84c32cb (the hand-written validation), not recomputed here."""
    raw = {"name": "t", "version": 1, "calibration": {"images": "testbed:train"}, "tune": {"num_samples": 2},
           "grid": {"method": ["promprune", "divprune"], "budget": [16, 8], "mu": [0.4, "calibrate"], "tau": [0.02],
                    "metric": ["spectral", "feature_norm"]},
           "trials": [{"method": "fastv", "budget": 4, "layer": 3},
                      {"method": "promprune", "budget": 64, "tasks": ["easyvqa_open"],
                       "saliency_ratio_range": [0.1, 0.9]}]}
    ids = [t.trial_id for t in specs.expand(specs.parse(raw))]
    assert ids[:4] == ["baseline", "baseline-r1", "promprune-b16-metric=spectral-mu=0.4-tau=0.02",
                       "promprune-b16-metric=spectral-mu=0.4-tau=0.02-r1"]
    assert ids[8] == "promprune-b16-metric=feature_norm-mu=calibrate-tau=0.02"
    assert ids[-6:] == ["divprune-b8", "divprune-b8-r1", "fastv-b4-layer=3", "fastv-b4-layer=3-r1",
                        "promprune-b64-saliency_ratio_range=0.1,0.9-on=easyvqa_open",
                        "promprune-b64-saliency_ratio_range=0.1,0.9-on=easyvqa_open-r1"]
    assert len(ids) == 26

    random = {"name": "t", "version": 1, "baseline": False, "tune": {"search": "random", "num_samples": 4, "seed": 7},
              "grid": {"method": "promprune", "budget": [32, 16, 8], "mu": [0.3, 0.4, 0.5], "tau": [0.01, 0.02]}}
    # issue 37: a random search draws without replacement, `random.Random(seed).sample` over the grid's distinct
    # trials in grid order (at 84c32cb: 4 draws with replacement, the last "promprune-b32-mu=0.3-tau=0.02")
    assert [t.trial_id for t in specs.expand(specs.parse(random))] == [
        "promprune-b16-mu=0.5-tau=0.01", "promprune-b32-mu=0.5-tau=0.01", "promprune-b8-mu=0.3-tau=0.01",
        "promprune-b8-mu=0.5-tau=0.02"]
    assert specs.trial_id("promprune", 64, {f"opt{i}": "x" * 10 for i in range(10)}) == \
        "promprune-b64-opt0=xxxxxxxxxx-opt1=xxxxxxxxxx-opt2=xxxxxxxxxx-opt3=xxxx-4514c5c7"
    assert specs.trial_id("promprune", 64, {f"opt{i}": [1.5, "y"] for i in range(8)}, 2, ("a", "b")) == \
        "promprune-b64-opt0=1.5,y-opt1=1.5,y-opt2=1.5,y-opt3=1.5,y-opt4=1.5,y-op-338ca308"


def test_five_mistakes_in_five_places_come_back_together_by_dotted_path():
    errors = problems(version=0, tune={"max_failures": -5}, model={"dtpye": "float32"},
                      trials=[{"method": "fastv", "budget": 4}, {"method": "fastvv", "budget": 4}],
                      generation={"max_new_tokens": 0})
    assert sorted(errors) == sorted([
        "version: expected an int >= 1, got 0",
        "tune.max_failures: expected an int >= 0 (or -1: unlimited), got -5",
        "model.dtpye: unknown field (did you mean 'dtype'?); valid: attn_implementation, dtype, options, pretrained",
        "trials[1].method: unknown method 'fastvv' (did you mean 'fastv'?); valid: "
        + ", ".join(sorted(specs.MethodCatalog().names)),
        "generation.max_new_tokens: expected an int >= 1, got 0"])


@pytest.mark.parametrize("budget, shown", [([16, 0], "0"), (-4, "-4"), (["a"], "'a'"), ([True], "True")])
def test_a_bad_grid_budget_is_named_once_at_the_grid(budget, shown):
    """Not once per trial the grid expands to (it was "budget: ... (trial divprune-b0)", then vispruner's)."""
    errors = problems(grid={"method": ["divprune", "vispruner"], "budget": budget})
    assert errors == [f"grid.budget: expected an int >= 1 or a list of them, got {shown}"]


def test_option_values_are_checked_with_the_other_fields_problems():
    errors = problems(tune={"search": "bayes"}, resources={"batch_size": 0},
                      grid={"method": "promprune", "budget": 8, "mu": "abc"})
    assert errors[:2] == ["resources.batch_size: expected an int >= 1, got 0",
                          "tune.search: 'bayes' is not one of grid, random, optuna"]
    assert errors[2].startswith("trial promprune-b8-mu=abc: option 'mu' of method 'promprune' must be a finite")
    assert len(errors) == 3


@pytest.mark.parametrize("where, field", [
    ((), "version"), ((), "limit"), ((), "bootstrap"), (("resources",), "workers"),
    (("resources",), "gpus_per_worker"), (("resources",), "batch_size"), (("resources",), "actor_wait_s"),
    (("tune",), "num_samples"), (("tune",), "max_concurrent_trials"), (("tune",), "max_failures"),
    (("tune",), "seed"), (("calibration",), "n"), (("generation",), "max_new_tokens")])
def test_a_bool_is_not_a_number(where, field):
    raw = {field: True} if not where else {where[0]: {field: True}}
    (error,) = problems(**raw)
    assert error.startswith(".".join(where + (field,)) + ": expected ") and error.endswith(", got True")


@pytest.mark.parametrize("where, field", [
    ((), "version"), ((), "limit"), (("resources",), "workers"), (("resources",), "batch_size"),
    (("tune",), "num_samples"), (("tune",), "max_failures"), (("calibration",), "batch_size")])
def test_a_float_is_not_an_int(where, field):
    raw = {field: 2.0} if not where else {where[0]: {field: 2.0}}
    (error,) = problems(**raw)
    assert error.startswith(".".join(where + (field,)) + ": expected ") and error.endswith(", got 2.0")


def test_numbers_stay_as_written_and_must_be_finite():
    spec = specs.parse({**BASE, "resources": {"gpus_per_worker": 2, "cpus_per_worker": 0.5}})
    assert type(spec.resources.gpus_per_worker) is int and spec.resources.cpus_per_worker == 0.5
    for bad in (float("nan"), float("inf")):
        (error,) = problems(resources={"actor_wait_s": bad})
        assert error == f"resources.actor_wait_s: expected a number of seconds > 0 (finite), got {bad!r}"


def test_the_load_allowance_is_a_positive_number_of_seconds():
    """resources.load_timeout_s (how long a worker's model load may last): 1800 s unless set; 0, a negative or
    non-finite number, a bool or a string is refused naming the field (the field's own rule, as block_timeout_s)."""
    assert specs.parse(BASE).resources.load_timeout_s == 1800
    assert specs.parse({**BASE, "resources": {"load_timeout_s": 7200}}).resources.load_timeout_s == 7200
    for bad in (0, -5, float("nan"), float("inf"), True, "1h"):
        (error,) = problems(resources={"load_timeout_s": bad})
        assert error == f"resources.load_timeout_s: expected a number of seconds > 0 (finite), got {bad!r}", error


def test_sections_are_the_components_own_objects():
    from pipelines.calibration import Calibration
    from pipelines.config import Resources
    from pipelines.weights import ModelSource

    spec = specs.parse({**BASE, "model": {"dtype": "float32"}, "generation": {"temperature": 0, "max_new_tokens": 3}})
    assert type(spec.model) is ModelSource and type(spec.resources) is Resources
    assert type(spec.calibration) is Calibration and type(spec.tune) is specs.TuneSpec
    assert list(spec.generation) == ["temperature", "max_new_tokens"]  # as written (dump_resolved, fingerprints)
    assert problems(model={"shared": 1}) == [
        "model.shared: unknown field; valid: attn_implementation, dtype, options, pretrained"]


def test_an_explicit_trial_option_its_method_does_not_take_is_refused_not_dropped():
    """The grid drops options a crossed method does not take (mu for divprune); an explicit trial names one method,
    so an option it does not take (an adapter option, a misspelling, a nested `options:`) is an error, not a
    silently different trial."""
    raw = {"name": "t", "version": 1, "model": {"pretrained": "tiny:llava"},
           "trials": [{"method": "promprune", "budget": 8, "video_budget": "clip"},
                      {"method": "divprune", "budget": 8, "mu": 0.5},
                      {"method": "promprune", "budget": 8, "options": {"mu": 0.5}},
                      {"method": "promprune", "budget": 8, "mu": 0.5}]}
    with pytest.raises(specs.SpecError) as err:
        specs.parse(raw)
    assert err.value.errors == [
        "trials[0].video_budget: promprune takes no option 'video_budget' (an adapter option: set it in "
        "model.options, or in a spec of its own)",
        "trials[1].mu: divprune takes no option 'mu'" + err.value.errors[1].split("'mu'", 1)[1],
        "trials[2].options: promprune takes no option 'options'" + err.value.errors[2].split("'options'", 1)[1],
    ]
    assert "did you mean" not in err.value.errors[0]


def test_video_frames_defaults_to_the_bridge_and_refuses_non_positive_counts():
    from promprune.models.video import DEFAULT_FRAMES

    assert specs.parse(BASE).video_frames == DEFAULT_FRAMES
    assert specs.parse({**BASE, "video_frames": 32}).video_frames == 32
    assert problems(video_frames=0) == ["video_frames: expected an int >= 1, got 0"]
    assert problems(video_frames="16") == ["video_frames: expected an int >= 1, got '16'"]


def test_sharing_options_are_flags_and_prefix_needs_vision():
    """generation.vision_once / prefix_cache (promprune.eval.generation): true or false, checked like every field."""
    assert specs.parse({**BASE, "generation": {"vision_once": False, "prefix_cache": False}}).generation == {
        "vision_once": False, "prefix_cache": False}
    assert problems(generation={"prefix_cache": "no"}) == ["generation.prefix_cache: expected true or false, got 'no'"]
    assert problems(generation={"vision_once": False}) == [
        "generation: prefix_cache continues each image's shared encoding, so it needs vision_once: with vision_once: "
        "false set prefix_cache: false too"]
    (error,) = problems(generation={"prefix_cach": True})
    assert error.startswith("generation.prefix_cach: unknown field (did you mean 'prefix_cache'?)")


def test_generation_seed_is_an_int():
    """generation.seed (promprune.eval.generation.sample_seeds: seeds each sampled answer with the trial's id and the
    sample's key): an int, checked before any model loads; before, the key was unknown."""
    assert specs.parse({**BASE, "generation": {"do_sample": True, "seed": 3}}).generation == {"do_sample": True,
                                                                                             "seed": 3}
    assert problems(generation={"seed": "3"}) == ["generation.seed: expected an int, got '3'"]
