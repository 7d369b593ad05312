"""The paper's specs say what the issue asks for, and pass the pipeline's own validator (no model, no GPU)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipelines import spec

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"
BASELINES = ["fastv", "sparsevlm", "visionzip", "vispruner", "divprune"]
RIVALS = ["cdpruner", "dart", "pyramiddrop", "downsample", "random"]  # issue 25: rivals and controls
TABLE1_TASKS = ["mme", "pope", "mmbench_en_dev_static", "textvqa_val", "scienceqa_img", "gqa", "vqav2_val",
                "vizwiz_vqa_val", "mmvet"]
TABLE2_TASKS = ["mme", "pope", "mmbench_en_dev_static", "scienceqa_img", "gqa"]
PAPER_SPECS = ["table1_llava15", "table2_llava_next", "table3_qwen25vl", "table4_adaptive_vs_fixed",
               "fig4_entropy_metric", "table5_diversity", "fig5_mu_tau", "fig1a_saliency_ratio",
               "figA1_saliency_ratio", "table6_efficiency", "figC1_entropy_distribution", "mu_calibration",
               "mu_calibration_grid", "table2_llava_next_extended", "table3_qwen25vl_extended",
               "table5_diversity_extended", "table6_efficiency_extended", "figE1_overlays", "table1_llava15_extended",
               "extended_models", "extended_models_llava_onevision", "extended_models_internvl",
               "extended_models_qwen35", "extended_models_gemma4"]
PAPER_BASELINES = ["vispruner", "divprune"]  # what Tables 2, 3 and 6 compare PromPrune with


def trials_of(name):
    loaded = spec.load(SWEEPS / f"{name}.yaml")
    return loaded, spec.expand(loaded)


def grid(trials, method):
    """{(budget, sorted options)} of one method's trials."""
    return {(t.budget, tuple(sorted(t.options.items()))) for t in trials if t.method == method}


@pytest.mark.parametrize("name", PAPER_SPECS)
def test_spec_validates_and_is_named_after_its_file(name):
    loaded, trials = trials_of(name)
    assert loaded.name == name and trials


@pytest.mark.parametrize("name,model,tasks,budgets,methods", [
    ("table1_llava15", "llava-hf/llava-1.5-7b-hf", TABLE1_TASKS, [128, 64, 32], BASELINES),
    ("table2_llava_next", "llava-hf/llava-v1.6-vicuna-7b-hf", TABLE2_TASKS, [640, 320, 160], PAPER_BASELINES),
    ("table3_qwen25vl", "Qwen/Qwen2.5-VL-7B-Instruct", TABLE2_TASKS, [512, 256, 128], PAPER_BASELINES),
    ("table1_llava15_extended", "llava-hf/llava-1.5-7b-hf", TABLE1_TASKS, [128, 64, 32], BASELINES + RIVALS),
    ("table2_llava_next_extended", "llava-hf/llava-v1.6-vicuna-7b-hf", TABLE2_TASKS, [640, 320, 160],
     BASELINES + RIVALS),
    ("table3_qwen25vl_extended", "Qwen/Qwen2.5-VL-7B-Instruct", TABLE2_TASKS, [512, 256, 128], BASELINES + RIVALS),
    ("extended_models", "Qwen/Qwen3-VL-8B-Instruct", TABLE2_TASKS, [512, 256, 128], BASELINES + RIVALS),
    ("extended_models_llava_onevision", "llava-hf/llava-onevision-qwen2-7b-ov-hf", TABLE2_TASKS, [640, 320, 160],
     BASELINES + RIVALS),
    ("extended_models_internvl", "OpenGVLab/InternVL3-8B-hf", TABLE2_TASKS, [640, 320, 160], BASELINES + RIVALS),
    ("extended_models_qwen35", "Qwen/Qwen3.5-4B", TABLE2_TASKS, [512, 256, 128], BASELINES + RIVALS),
    # 2/9, 1/9, 1/18 of Gemma 4's 280 soft tokens (LLaVA-1.5's 128 / 64 / 32 of 576), rounded
    ("extended_models_gemma4", "google/gemma-4-31B-it", TABLE2_TASKS, [62, 31, 16], BASELINES + RIVALS),
])
def test_main_tables_compare_what_the_paper_compares(name, model, tasks, budgets, methods):
    loaded, trials = trials_of(name)
    assert loaded.model.pretrained == model and loaded.tasks == tasks and loaded.baseline
    assert {t.method for t in trials if t.method} == {"promprune", *methods}
    assert loaded.model.options["token_order"] == "released"  # each method feeds its LLM as released
    if "llava_next" in name:  # and meets LLaVA-NeXT's views and newline tokens as released
        assert loaded.model.options["budget_mode"] == "released"
    for method in ["promprune"] + [m for m in methods if m != "sparsevlm"]:
        assert grid(trials, method) == {(b, ()) for b in budgets}, method
    if "sparsevlm" in methods and name.startswith("table1_llava15"):  # the released schedule where one ships (no 32)
        assert grid(trials, "sparsevlm") == {(128, (("schedule", "released"),)), (64, (("schedule", "released"),)),
                                             (32, (("schedule", "geometric"),))}
    assert sum(t.method is None for t in trials) == 1


def test_qwen_runs_at_a_fixed_1296_tokens():
    loaded, _ = trials_of("table3_qwen25vl")
    assert loaded.model.options == {"image_tokens": 1296, "token_order": "released"}


def test_table4_runs_each_benchmark_at_its_own_mean_t_sal():
    loaded, trials = trials_of("table4_adaptive_vs_fixed")
    assert loaded.tasks == ["mmbench_en_dev_static", "textvqa_val", "gqa", "scienceqa_img", "pope"] and loaded.baseline
    assert grid(trials, "promprune") == {(64, ())}
    fixed = {t.tasks: t.options["saliency_ratio"] * 64 for t in trials if t.method == "fixed_ratio"}
    assert fixed == {("mmbench_en_dev_static",): 33, ("textvqa_val",): 17, ("gqa",): 13, ("scienceqa_img",): 40,
                     ("pope",): 12}  # the paper's printed mean T_sal per benchmark


def test_ablations_run_the_papers_settings():
    loaded, t5 = trials_of("table5_diversity")
    assert loaded.tasks == ["pope", "mme", "scienceqa_img", "mmbench_en_dev_static", "gqa"] and not loaded.baseline
    assert {(b, dict(o)["diversity"]) for b, o in grid(t5, "promprune")} == {
        (64, d) for d in ("dpp", "fps", "facility_location")}
    loaded, f4 = trials_of("fig4_entropy_metric")
    assert loaded.tasks == ["mme", "pope", "gqa"]
    arms = {dict(o).get("metric", "spectral"): dict(o).get("mu") for _, o in grid(f4, "promprune")}
    assert arms == {"spectral": None, "feature_norm": "calibrate", "attention": "calibrate"}  # per-metric mu
    assert loaded.calibration.images and loaded.calibration.n == 1000
    loaded, f5 = trials_of("fig5_mu_tau")
    assert loaded.tasks == ["scienceqa_img", "pope", "gqa"]
    assert len(grid(f5, "promprune")) == 7 * 4 and grid(f5, "vispruner") == {(64, ())}
    for name, tasks in [("fig1a_saliency_ratio", ["pope", "scienceqa_img"]),
                        ("figA1_saliency_ratio", ["mmbench_en_dev_static", "textvqa_val", "gqa"])]:
        loaded, f1 = trials_of(name)
        assert loaded.tasks == tasks
        assert sorted(dict(o)["saliency_ratio"] for _, o in grid(f1, "fixed_ratio")) == pytest.approx(
            [0.1 * k for k in range(1, 10)])
        assert {b for b, _ in grid(f1, "fixed_ratio")} == {64} and grid(f1, "promprune") == {(64, ())}
    _, t6 = trials_of("table6_efficiency")
    assert {t.method for t in t6} == {None, "promprune", "vispruner", "divprune"}
    assert {t.budget for t in t6 if t.method} == {320}


def test_mu_is_calibrated_on_pretraining_images_not_benchmarks():
    loaded, trials = trials_of("mu_calibration")
    assert {t.options.get("mu") for t in trials if t.method == "promprune"} == {"calibrate"}
    assert loaded.calibration.images and loaded.calibration.n == 1000


def test_table6_extended_measures_every_implemented_method():
    """Its header, the README and docs/reproducing.md say "every implemented method": it listed 6 of them."""
    from promprune import selection

    loaded, trials = trials_of("table6_efficiency_extended")
    ablations = {"fixed_ratio", "saliency_only", "coverage_only"}  # PromPrune's own stages: Tables 4 and 5
    assert {t.method for t in trials if t.method} == set(selection.methods(None)) - ablations
    assert {t.budget for t in trials if t.method} == {320} and sum(t.method is None for t in trials) == 1


def test_video_clip_spec_runs_the_video_methods_but_the_grid_ones():
    """extended_models_video_clip.yaml (one budget over the clip) listed downsample, which pools one frame's token grid
    (``needs_grid``): its 3 trials failed every clip while the spec passed its check. It runs the per-frame spec's
    methods but the grid ones, at its budgets, every trial one its check and the library accept."""
    import promprune
    from promprune.models.options import validate_method

    per_frame, frame_trials = trials_of("extended_models_video")
    clip, clip_trials = trials_of("extended_models_video_clip")
    assert per_frame.model.options["video_budget"] == "per_frame" and clip.model.options["video_budget"] == "clip"
    grid_methods = {m for m in promprune.methods(None) if promprune.method_spec(m).needs_grid}
    assert grid_methods == {"downsample"} and grid_methods <= {t.method for t in frame_trials}  # the control runs
    assert {t.method for t in clip_trials if t.method} == {t.method for t in frame_trials if t.method} - grid_methods
    assert {t.budget for t in clip_trials if t.method} == {784, 392, 196} and len(clip_trials) == 10 * 3 + 1
    for trial in clip_trials:
        validate_method(trial.method, trial.budget, **{**clip.model.options, **trial.options})


def test_table6_measures_latency_one_sample_at_a_time():
    loaded, _ = trials_of("table6_efficiency")
    assert loaded.resources.batch_size == 1 and loaded.model.options["budget_mode"] == "released"


def test_fig_e1_compares_the_stages_at_64_tokens_on_llava15():
    loaded, trials = trials_of("figE1_overlays")
    assert loaded.model.pretrained == "llava-hf/llava-1.5-7b-hf" and loaded.baseline  # the grid the overlays use
    for method in ("saliency_only", "coverage_only", "promprune"):  # each at the paper's T = 64, defaults
        assert grid(trials, method) == {(64, ())}, method
    assert {t.method for t in trials if t.method} == {"saliency_only", "coverage_only", "promprune"}
    assert loaded.limit and loaded.limit <= 16  # a figure needs a few documents, not the benchmarks


def test_mu_grid_never_scores_documents_a_table_or_figure_evaluates():
    grid_tasks = set(spec.load(SWEEPS / "mu_calibration_grid.yaml").tasks)
    evaluated = set()
    for path in SWEEPS.glob("*.yaml"):
        if path.stem.startswith(("table", "fig", "nightly")):
            loaded, trials = trials_of(path.stem)
            evaluated |= set(loaded.tasks) | {t for trial in trials for t in (trial.tasks or [])}
    assert grid_tasks and not grid_tasks & evaluated, grid_tasks & evaluated


MU_TAU_SEARCHES = {  # spec -> (the model it searches for, its shape: the published architecture, random weights)
    "mu_tau_search_llava15": ("llava-hf/llava-1.5-7b-hf", "llava_1_5_7b"),
    "mu_tau_search_qwen25vl": ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl_7b"),
    "mu_tau_search_qwen3vl": ("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl_8b"),
    "mu_tau_search_internvl3": ("OpenGVLab/InternVL3-8B-hf", "internvl3_8b"),
    "mu_tau_search_llava_onevision": ("llava-hf/llava-onevision-qwen2-7b-ov-hf", "llava_onevision_7b"),
    "mu_tau_search_qwen35": ("Qwen/Qwen3.5-4B", "qwen3_5_4b"),
    "mu_tau_search_gemma4": ("google/gemma-4-31B-it", "gemma4_31b"),
}


@pytest.mark.parametrize("name", sorted(MU_TAU_SEARCHES))
def test_mu_tau_searches_are_ready_for_their_checkpoints_and_valid_on_their_shapes(name):
    from pipelines import preflight

    model, shape = MU_TAU_SEARCHES[name]
    loaded, trials = trials_of(name)
    assert loaded.model.pretrained == model and [t.trial_id for t in trials] == ["baseline"]
    assert (loaded.tune.search, loaded.tune.scheduler, loaded.tune.metric) == ("optuna", "asha", "rel")
    assert set(loaded.grid["mu"]) == {"uniform"} and set(loaded.grid["tau"]) == {"loguniform"}
    assert loaded.grid["method"] == ["promprune"]
    # held out: a (mu, tau) tuned on a benchmark the tables report would be tuned on the test set
    assert set(loaded.tasks) == set(spec.load(SWEEPS / "mu_calibration_grid.yaml").tasks)
    offline = spec.load(SWEEPS / f"{name}.yaml", [f"model.pretrained=shape:{shape}"])
    assert preflight.check_model(offline.model.pretrained, offline.model.options, preflight.budgets(offline)) == []
    too_many = spec.load(SWEEPS / f"{name}.yaml", [f"model.pretrained=shape:{shape}", "grid.budget=[100000]"])
    assert preflight.check_model(too_many.model.pretrained, too_many.model.options, preflight.budgets(too_many))


def test_the_testbed_search_covers_the_grid_it_is_measured_against():
    grid, grid_trials = trials_of("testbed_mu_tau_grid")
    found, _ = trials_of("testbed_mu_tau_search")
    assert grid.tasks == found.tasks and grid.model == found.model and grid.limit == found.limit is None
    assert {t.method for t in grid_trials if t.method} == {"promprune"} and grid.grid["budget"] == [16]
    assert found.grid["mu"] == {"uniform": [min(grid.grid["mu"]), max(grid.grid["mu"])]}
    assert found.grid["tau"] == {"loguniform": [min(grid.grid["tau"]), max(grid.grid["tau"])]}
    assert len(grid_trials) == 31 and found.tune.num_samples < len(grid_trials) - 1
    assert found.tune.max_concurrent_trials == 1  # the same seed, the same trials
    assert set(grid.tasks) == {"testbed_exist", "testbed_exist_concentrated", "testbed_exist_spread",
                               "testbed_attribute"}  # the existence and attribute tasks


SPLIT_HEADROOM = {  # spec -> (its checkpoint, the checkpoint's shape: the published architecture, its budgets)
    "split_headroom_llava15": ("llava-hf/llava-1.5-7b-hf", "llava_1_5_7b", [64, 32]),
    "split_headroom_qwen25vl": ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl_7b", [256, 128]),
}
EVERY_RATIO = {k / 10 for k in range(11)}  # 0.0, 0.1, ..., 1.0


@pytest.mark.parametrize("name", sorted(SPLIT_HEADROOM))
def test_split_headroom_runs_every_ratio_on_full_benchmarks_and_is_valid_on_its_shape(name):
    from pipelines import preflight

    model, shape, budgets = SPLIT_HEADROOM[name]
    loaded, trials = trials_of(name)
    assert loaded.model.pretrained == model and loaded.limit is None and loaded.baseline
    assert "mmvet" not in loaded.tasks and {"mme", "pope", "gqa"} <= set(loaded.tasks)
    for budget in budgets:
        fixed = {t.options["saliency_ratio"] for t in trials if t.method == "fixed_ratio" and t.budget == budget}
        assert fixed == EVERY_RATIO
        assert [t.options for t in trials if t.method == "promprune" and t.budget == budget] == [{}]  # defaults
    offline = spec.load(SWEEPS / f"{name}.yaml", [f"model.pretrained=shape:{shape}"])
    assert preflight.check_model(offline.model.pretrained, offline.model.options, preflight.budgets(offline)) == []


def test_testbed_split_headroom_runs_every_distinct_split():
    from promprune.eval.tasks import OFFLINE_TASKS
    from promprune.selection.budget import fixed_count

    loaded, trials = trials_of("testbed_split_headroom")
    assert set(loaded.tasks) <= set(OFFLINE_TASKS) and loaded.limit is None
    ratios = {b: sorted(t.options["saliency_ratio"] for t in trials if t.method == "fixed_ratio" and t.budget == b)
              for b in (16, 8)}
    assert set(ratios[16]) == EVERY_RATIO
    # at 8 tokens every ratio of the grid gives one of 9 splits; each runs once (0.3 and 0.8 would repeat 0.2, 0.7)
    assert sorted(fixed_count(8, r) for r in ratios[8]) == list(range(9))
    assert {fixed_count(8, r) for r in EVERY_RATIO} == set(range(9))
    calibrated = [t for t in trials if t.method == "promprune"]
    assert sorted(t.budget for t in calibrated) == [8, 16] and all(t.options["mu"] == "calibrate" for t in calibrated)


def test_qwen35_sweep_is_valid_offline_and_its_in_llm_trials_find_full_attention():
    """extended_models_qwen35.yaml on the 4B's shape: every budget prunes, every in-LLM trial ranks at a
    full-attention layer (preflight, before Ray); an explicit FastV K that ranks at a linear layer is refused there in
    one paragraph naming the model type and the method. The sweep answers without thinking, at 1296 tokens,
    after lmms-eval's qwen3_5 system turn."""
    from pipelines import preflight

    offline = spec.load(SWEEPS / "extended_models_qwen35.yaml", ["model.pretrained=shape:qwen3_5_4b"])
    assert offline.model.options == {"image_tokens": 1296, "token_order": "released", "enable_thinking": False,
                                     "system_prompt": "You are a helpful assistant."}  # lmms-eval's qwen3_5 turn
    assert preflight.check_model(offline.model.pretrained, offline.model.options, preflight.budgets(offline)) == []
    assert preflight.check_in_llm_layers(offline) == []
    refused = spec.load(SWEEPS / "extended_models_qwen35.yaml", ["model.pretrained=shape:qwen3_5_4b",
                                                                 "grid.method=[fastv]", "grid.budget=[128]",
                                                                 "grid.layer=[2]"])
    problems = preflight.check_in_llm_layers(refused)
    assert len(problems) == 1 and problems[0].startswith("in-LLM method 'fastv' on shape:qwen3_5_4b (model type "
                                                         "'qwen3_5')")
    assert problems[0].endswith("(trial fastv-b128-layer=2)")
    assert "Give 'layer' from [4, 8, 12, 16, 20, 24, 28]" in problems[0]


@pytest.mark.parametrize("name", ["extended_models_gemma4", "mu_tau_search_gemma4"])
def test_gemma4_specs_fit_the_31b_and_refuse_in_llm_methods_on_the_e2b_before_ray(name):
    """On shape:gemma4_31b every trial passes the preflight (budgets below 280 soft tokens, in-LLM layers on full
    attention); the 31B's 62 GB goes to two GPUs per actor, loaded by each (not via the object store). On
    shape:gemma4_e2b every in-LLM trial is refused, one paragraph per method naming the model and its trials."""
    from pipelines import preflight

    loaded, trials = trials_of(name)
    assert loaded.resources.gpus_per_worker == 2 and not loaded.resources.share_weights
    assert loaded.model.options["max_soft_tokens"] == 280
    assert loaded.model.options["system_prompt"] == "You are a helpful assistant."  # lmms-eval's gemma4 model's
    offline = spec.load(SWEEPS / f"{name}.yaml", ["model.pretrained=shape:gemma4_31b"])
    assert preflight.check_in_llm_layers(offline) == []
    assert preflight.check_model(offline.model.pretrained, offline.model.options, preflight.budgets(offline)) == []
    e2b = spec.load(SWEEPS / f"{name}.yaml", ["model.pretrained=shape:gemma4_e2b"])
    problems = preflight.check_in_llm_layers(e2b)
    in_llm = sorted({t.method for t in trials if t.method in ("fastv", "sparsevlm", "dart", "pyramiddrop")})
    assert sorted(p.split("'")[1] for p in problems) == in_llm
    for problem in problems:
        assert "cannot run on shape:gemma4_e2b" in problem and "(trials " in problem
