"""Sweep specs: every shipped spec validates, bad specs fail at once naming every bad field, expansion is exact."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from pipelines import spec as specs

REPO = Path(__file__).resolve().parents[2]
SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_text(tmp_path: Path, text: str, overrides=None) -> specs.SweepSpec:
    return specs.load(write(tmp_path, text), overrides)


MINIMAL = """
name: t
version: 1
grid: {method: [promprune, divprune], budget: [16, 8]}
"""


@pytest.mark.parametrize("path", SWEEPS, ids=[p.name for p in SWEEPS])
def test_every_shipped_spec_validates(path):
    spec = specs.load(path)
    trials = specs.expand(spec)
    assert trials, f"{path.name} runs no trial"
    ids = [t.trial_id for t in trials]
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate trial ids"
    assert spec.name == path.stem, "the spec's name is its file name (the MLflow sweep id)"


def test_quickstart_is_offline_and_compares_methods():
    from promprune.eval.tasks import OFFLINE_TASKS

    spec = specs.load(REPO / "sweeps" / "quickstart.yaml")
    assert spec.model.pretrained == "testbed:llava"  # offline: trained once into the cache on first use
    assert set(spec.tasks) <= set(OFFLINE_TASKS) and spec.baseline
    pruned = [t for t in specs.expand(spec) if t.method is not None]
    assert len({t.method for t in pruned}) >= 3
    assert spec.calibration.images == "testbed:train"  # mu from train scenes, never the evaluation's
    assert spec.model.dtype == "float64"  # the same answers on every CPU (docs/testbed.md)


def test_defaults_fill_in(tmp_path):
    spec = load_text(tmp_path, MINIMAL)
    assert spec.model.pretrained == "tiny:llava" and spec.model.dtype == "auto"
    assert spec.resources.workers == "auto" and spec.tune.search == "grid" and spec.baseline is True


def test_unknown_fields_fail_together_with_did_you_mean(tmp_path):
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, MINIMAL + """
        limt: 3
        tune: {max_concurent_trials: 2}
        resources: {gpu_per_worker: 1}
        model: {pretrained: tiny:llava, dtpye: float32}
        generation: {max_new_token: 4}
        """.replace("        ", ""))
    errors = e.value.errors
    assert len(errors) == 5, errors
    text = str(e.value)
    for bad, good in [("limt", "limit"), ("tune.max_concurent_trials", "max_concurrent_trials"),
                      ("resources.gpu_per_worker", "gpus_per_worker"), ("model.dtpye", "dtype"),
                      ("generation.max_new_token", "max_new_tokens")]:
        assert f"{bad}: unknown field (did you mean '{good}'?)" in text


def test_bad_methods_options_and_values_are_named(tmp_path):
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, """
        name: t
        version: 1
        grid: {method: [promprune, divprun], budget: [16]}
        trials: [{method: fastvv, budget: 4}]
        """)
    text = str(e.value)
    assert "grid.method: unknown method 'divprun' (did you mean 'divprune'?)" in text
    assert "trials[0].method: unknown method 'fastvv' (did you mean 'fastv'?)" in text

    with pytest.raises(specs.SpecError, match=r"grid\.mue: no method in grid\.method \(promprune\) accepts this "
                                              r"option \(did you mean 'mu'\?\)"):
        load_text(tmp_path, "name: t\nversion: 1\ngrid: {method: promprune, budget: 8, mue: [0.4]}\n")
    # a real option of a method the grid does not run: name its owners, never "did you mean" the same word
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, "name: t\nversion: 1\ngrid: {method: [divprune, vispruner], budget: 8, tau: [0.1]}\n")
    text = str(e.value)
    assert "grid.tau: no method in grid.method (divprune, vispruner) accepts this option; it is an option of " \
           "promprune (add one to grid.method, or move it to trials:)" in text and "did you mean" not in text
    # a typo of another method's option names that method; "valid" lists what the grid's methods take
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, "name: t\nversion: 1\ngrid: {method: divprune, budget: 8, tauu: [0.1]}\n")
    assert "grid.tauu: no method in grid.method (divprune) accepts this option (did you mean 'tau', an option of " \
           "promprune?); valid: order" in str(e.value)
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, "name: t\nversion: 1\ntrials: [{method: promprune, budget: 8, mu: calibrat}]\n")
    assert "must be a finite number, got 'calibrat' (did you mean 'calibrate', which measures mu on " \
           "calibration.images?)" in str(e.value)
    # mu outside [0, 1], where every prominence metric lies: one split for every image (42 meant 0.42)
    for bad in ("42", "-0.1"):
        with pytest.raises(specs.SpecError) as e:
            load_text(tmp_path, f"name: t\nversion: 1\ntrials: [{{method: promprune, budget: 8, mu: {bad}}}]\n")
        assert f"option 'mu' is {float(bad) if '.' in bad else int(bad)!r}, outside [0, 1]" in str(e.value)
    with pytest.raises(specs.SpecError, match=r"grid.mu: 1.2 of uniform\[0.3, 1.2\]: option 'mu' is 1.2, outside"):
        load_text(tmp_path, "name: t\nversion: 1\nbaseline: true\ngrid: {method: promprune, budget: 8, mu: "
                            "{uniform: [0.3, 1.2]}}\ntune: {search: optuna, num_samples: 2}\n")
    # a typo of the grid's own fields (grid.budget was set, so "required" did not show it)
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, "name: t\nversion: 1\ngrid: {method: divprune, budget: 8, budgte: [4]}\n")
    assert "grid.budgte: unknown field (did you mean 'budget'?); valid: method, budget and the options of the " \
           "grid's methods (order)" in str(e.value)
    with pytest.raises(specs.SpecError, match=r"trial promprune-b8-metric=spectrall: .*metric"):
        load_text(tmp_path, "name: t\nversion: 1\ngrid: {method: promprune, budget: 8, metric: [spectrall]}\n")
    with pytest.raises(specs.SpecError, match=r"model\.options\.max_pixel: unknown adapter option"):
        load_text(tmp_path, MINIMAL + "model: {options: {max_pixel: 10}}\n")


def test_types_and_required_fields(tmp_path):
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, """
        version: "1"
        limit: 0
        tasks: []
        tune: {search: bayes, max_failures: x}
        resources: {workers: 0, actor_wait_s: -1}
        grid: {method: [promprune]}
        """)
    text = str(e.value)
    for fragment in ["name: required field missing", "version: expected an int >= 1", "limit: expected an int >= 1",
                     "tasks: expected a non-empty list", "tune.search: 'bayes' is not one of grid, random, optuna",
                     "tune.max_failures: expected an int", "resources.workers: expected an int >= 1 or 'auto'",
                     "resources.actor_wait_s: expected a number of seconds > 0",
                     "grid.budget: required when grid is set"]:
        assert fragment in text, fragment


def test_include_deep_merges_and_overrides_apply(tmp_path):
    write(tmp_path, """
    name: base
    version: 1
    model: {pretrained: tiny:llava, options: {budget_mode: per_crop}}
    tasks: [easyvqa_yesno]
    grid: {method: [promprune], budget: [16], mu: [0.4, 0.5]}
    resources: {batch_size: 4}
    """, "base.yaml")
    path = write(tmp_path, """
    name: child
    version: 2
    include: base.yaml
    grid: {budget: [8]}
    resources: {workers: 2}
    """)
    spec = specs.load(path, ["limit=3", "grid.tau=[0.01]", "model.dtype=float32"])
    assert spec.name == "child" and spec.version == 2 and spec.tasks == ["easyvqa_yesno"]
    assert spec.grid == {"method": ["promprune"], "budget": [8], "mu": [0.4, 0.5], "tau": [0.01]}
    assert spec.resources.batch_size == 4 and spec.resources.workers == 2  # merged, not replaced
    assert spec.model.options == {"budget_mode": "per_crop"} and spec.model.dtype == "float32"
    assert spec.limit == 3
    resolved = yaml.safe_load(specs.dump_resolved(spec))
    assert resolved["grid"]["tau"] == [0.01] and "include" not in resolved
    # includes are merged as the file is read: an include given by --set did nothing at all, silently
    with pytest.raises(specs.SpecError, match=r"override 'include=base.yaml': include is read with the spec file, "
                                              r"before --set, so it cannot be overridden"):
        specs.load(path, ["include=base.yaml"])


def test_an_override_given_twice_is_refused_naming_both(tmp_path):
    """Applied in order, `--set limit=8 --set limit=80` ran 80 without a word; a field and one inside it the same."""
    path = write(tmp_path, MINIMAL)
    assert specs.load(path, ["limit=8", "grid.mu=[0.5]", "grid.tau=[0.01]"]).limit == 8  # siblings are fine
    with pytest.raises(specs.SpecError, match=r"overrides 'limit=8' and ' limit =80' set the same field"):
        specs.load(path, ["limit=8", "grid.mu=[0.5]", " limit =80"])
    with pytest.raises(specs.SpecError, match=r"overrides 'grid.mu=\[0.5\]' and 'grid=\{budget: \[8\]\}' overlap "
                                              r"\(grid holds the other\)"):
        specs.load(path, ["grid.mu=[0.5]", "grid={budget: [8]}"])


def test_a_dotted_override_into_a_list_or_a_value_says_to_set_the_whole_field(tmp_path):
    """``--set trials.0.tau=0.5`` said "trials is not a mapping" and no fix: the message now says a dotted key cannot
    index a list and shows the whole field to set, its value now (then the edited list is taken)."""
    path = write(tmp_path, MINIMAL + "trials: [{method: promprune, budget: 16, tau: 0.03}]\n")
    with pytest.raises(specs.SpecError) as err:
        specs.load(path, ["trials.0.tau=0.5"])
    assert err.value.errors == [
        "override 'trials.0.tau=0.5': trials is a list (1 entry), and a dotted key reaches into mappings only (it "
        "cannot index a list); set the whole field instead, e.g. --set 'trials=[{method: promprune, budget: 16, tau: "
        "0.03}]' (its value now) with your change made in it"]
    [trial] = specs.load(path, ["trials=[{method: promprune, budget: 16, tau: 0.5}]"]).trials
    assert trial["tau"] == 0.5
    with pytest.raises(specs.SpecError) as err:
        specs.load(path, ["name.x=1"])
    assert err.value.errors == ["override 'name.x=1': name is 't', not a mapping with fields to set; set the whole "
                                "field instead, e.g. --set 'name=t' (its value now) with your change made in it"]


def test_a_tab_that_indents_a_spec_says_to_indent_with_spaces(tmp_path):
    path = write(tmp_path, "name: t\nversion: 1\ngrid:\n\tmethod: [random]\n")
    with pytest.raises(specs.SpecError) as err:
        specs.load(path)
    assert err.value.errors == ["malformed YAML: line 4, column 1: found character '\\t' that cannot start any token; "
                                "YAML indents with spaces only: replace the tab with spaces"]


def test_a_bad_grid_axis_or_trial_hides_no_other_problem(tmp_path):
    """A schema problem in the grid or the trials stopped the checks of option values: an inherited grid.mu
    mistake hid a saliency_ratio out of range until it was fixed. Each is reported in the first run now."""
    write(tmp_path, """
    name: base
    version: 1
    model: {pretrained: tiny:llava}
    tasks: [easyvqa_yesno]
    grid: {method: [promprune], budget: [16], mu: {uniform: [0.6, 0.4]}}
    """, "base.yaml")
    path = write(tmp_path, """
    include: base.yaml
    name: child
    version: 1
    trials:
      - {method: fixed_ratio, budget: 8, saliency_ratio: 1.7}
      - {method: promprune, budget: 8, saliency_ratio: 0.5}
    """)
    with pytest.raises(specs.SpecError) as info:
        specs.load(path)
    assert info.value.errors == [
        "grid.mu: uniform: expected two finite numbers lo < hi, got [0.6, 0.4]",
        "trials[1].saliency_ratio: promprune takes no option 'saliency_ratio' (did you mean 'saliency_ratio_range'?); "
        "valid: conditional, diversity, metric, mu, order, rounding, saliency_ratio_range, tau",
        "trial fixed_ratio-b8-saliency_ratio=1.7: option 'saliency_ratio' must be in [0, 1], got 1.7"]
    # a grid without a usable method or budget leaves nothing of it to expand: the trials are still checked, and
    # "the spec runs nothing" is not said of a grid that is there
    path = write(tmp_path, """
    name: t
    version: 1
    grid: {method: [nosuch], budget: [16]}
    trials: [{method: fixed_ratio, budget: 8, saliency_ratio: 1.7}]
    """, "t.yaml")
    with pytest.raises(specs.SpecError) as info:
        specs.load(path)
    assert [e.split(":")[0] for e in info.value.errors] == ["grid.method", "trial fixed_ratio-b8-saliency_ratio=1.7"]
    path = write(tmp_path, "name: t\nversion: 1\nbaseline: false\ntrials: [{method: nosuch, budget: 8}]\n", "u.yaml")
    with pytest.raises(specs.SpecError) as info:
        specs.load(path)
    assert len(info.value.errors) == 1 and info.value.errors[0].startswith("trials[0].method: unknown method 'nosuch'")


def test_include_cycle_and_missing_file(tmp_path):
    write(tmp_path, "name: a\nversion: 1\ninclude: b.yaml\n", "a.yaml")
    write(tmp_path, "name: b\nversion: 1\ninclude: a.yaml\n", "b.yaml")
    with pytest.raises(specs.SpecError, match="include cycle"):
        specs.load(tmp_path / "a.yaml")
    with pytest.raises(specs.SpecError, match="spec file not found"):
        specs.load(tmp_path / "nope.yaml")
    with pytest.raises(specs.SpecError, match=r"is a directory: give a spec file in it"):  # was "not found"
        specs.load(tmp_path)
    (tmp_path / "bases").mkdir()
    write(tmp_path, "name: c\nversion: 1\ninclude: bases\n", "c.yaml")
    with pytest.raises(specs.SpecError, match=r"include: .*bases is a directory: name a spec file in it"):
        specs.load(tmp_path / "c.yaml")  # was "file not found"
    write(tmp_path, "name: d\nversion: 1\n", "d.yaml")
    for item in ("=5", "grid..mu=1", " =x"):  # was "- : unknown field"
        with pytest.raises(specs.SpecError, match=r"the key before '=' names no field"):
            specs.load(tmp_path / "d.yaml", [item])


def test_expand_grid_product_baseline_and_ids(tmp_path):
    spec = load_text(tmp_path, """
    name: t
    version: 1
    grid: {method: [promprune, divprune], budget: [16, 8], mu: [0.4, 0.5]}
    trials: [{method: fastv, budget: 4, layer: 3}, {method: divprune, budget: 16}]
    """)
    ids = [t.trial_id for t in specs.expand(spec)]
    # baseline first; mu applies to promprune only, so divprune's mu variants collapse; the explicit divprune-b16
    # trial duplicates a grid point and runs once
    assert ids == ["baseline",
                   "promprune-b16-mu=0.4", "promprune-b16-mu=0.5", "promprune-b8-mu=0.4", "promprune-b8-mu=0.5",
                   "divprune-b16", "divprune-b8", "fastv-b4-layer=3"]
    fastv = specs.expand(spec)[-1]
    assert fastv.options == {"layer": 3} and fastv.budget == 4


def test_random_search_is_seeded_and_draws_without_replacement_from_the_grid(tmp_path):
    text = """
    name: t
    version: 1
    baseline: false
    grid: {method: [promprune], budget: [32, 16, 8], mu: [0.3, 0.4, 0.5], tau: [0.01, 0.02]}
    tune: {search: random, num_samples: 5, seed: SEED}
    """
    grid_ids = {t.trial_id for t in specs.expand(load_text(tmp_path, text.replace("random", "grid")
                                                           .replace("num_samples: 5", "num_samples: 1")
                                                           .replace("SEED", "0")))}
    a = [t.trial_id for t in specs.expand(load_text(tmp_path, text.replace("SEED", "7")))]
    b = [t.trial_id for t in specs.expand(load_text(tmp_path, text.replace("SEED", "7")))]
    assert a == b and len(set(a)) == len(a) == 5 and set(a) <= grid_ids and len(grid_ids) == 18


def test_trial_id_is_stable_and_bounded():
    assert specs.trial_id(None, None, {}) == "baseline"
    assert specs.trial_id("promprune", 64, {"tau": 0.02, "mu": 0.42}) == "promprune-b64-mu=0.42-tau=0.02"
    long = specs.trial_id("promprune", 64, {f"opt{i}": "x" * 10 for i in range(10)})
    assert len(long) == 80 and long == specs.trial_id("promprune", 64, {f"opt{i}": "x" * 10 for i in range(10)})


def test_cli_rejects_a_bad_spec_before_starting_ray(tmp_path):
    bad = write(tmp_path, MINIMAL + "tasks: [easyvqa_yesno]\nbaseline: yes\ntune: {serach: grid}\n")
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", str(bad)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "tune.serach: unknown field (did you mean 'search'?)" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_sweep_refuses_a_spec_for_another_command_naming_it(tmp_path):
    """sweeps/fig2_concentration.yaml is run by pipelines/fig2_concentration.py; sweep.py ran it as a sweep (hours of
    the wrong work) without a word."""
    shipped = REPO / "sweeps" / "fig2_concentration.yaml"
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", str(shipped),
                           "--validate-only"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "command: fig2_concentration: this spec is for pipelines/fig2_concentration.py" in proc.stderr
    assert f"run it with: python pipelines/fig2_concentration.py --config {shipped}" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(specs.SpecError, match="command: 'fig3' is not one of sweep, fig2_concentration"):
        load_text(tmp_path, MINIMAL + "command: fig3\n")
    # who runs a spec is not what a run does: the resolved spec (a run's fingerprint, the nightly's) leaves it out
    marked = load_text(tmp_path, MINIMAL + "command: fig2_concentration\n")
    assert marked.command == "fig2_concentration"
    assert specs.dump_resolved(marked) == specs.dump_resolved(load_text(tmp_path, MINIMAL))
    assert "command" not in specs.dump_resolved(marked)


GRID_CLIP_PROBLEM = ("option video_budget='clip' makes one selection over every frame of a clip, and method "
                     "'downsample' pools one view's token grid")


def test_cli_refuses_a_grid_method_with_a_clip_budget_before_starting_ray(tmp_path):
    """downsample (a grid method) under model.options.video_budget: clip failed every clip while the check passed and
    the sweep exited 0 (sweeps/extended_models_video_clip.yaml v2's three downsample trials). Refused per trial,
    exit 2, naming the option and its fix, whether the grid, an explicit trial or --set brings the pair together."""
    text = MINIMAL.replace("[promprune, divprune]", "[promprune, downsample]")
    clip = write(tmp_path, text + "model: {pretrained: tiny:llava_onevision, options: {video_budget: clip}}\n")
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", str(clip),
                           "--validate-only"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "2 problem(s)" in proc.stderr
    for budget in (16, 8):
        assert f"  - trial downsample-b{budget}: {GRID_CLIP_PROBLEM}" in proc.stderr
    assert "Use video_budget='per_frame' (the default: the budget split evenly over the frames) or 'adaptive_frames'" \
        in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    per_frame = write(tmp_path, text + "model: {pretrained: tiny:llava_onevision}\n", "per_frame.yaml")
    assert len(specs.expand(specs.load(per_frame))) == 5  # 4 trials + the baseline: per frame, downsample runs
    with pytest.raises(specs.SpecError) as e:
        specs.load(per_frame, ["model.options.video_budget=clip"])
    assert sorted(m.split(":")[0] for m in e.value.errors) == ["trial downsample-b16", "trial downsample-b8"]
    listed = write(tmp_path, "name: t\nversion: 1\nmodel: {options: {video_budget: clip}}\ntrials:\n"
                             "  - {method: downsample, budget: 4}\n", "listed.yaml")
    with pytest.raises(specs.SpecError, match="trial downsample-b4: option video_budget='clip'"):
        specs.load(listed)


def test_evaluate_cli_refuses_a_bad_video_frames_before_starting_ray(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "evaluate.py"), "--video-frames", "0",
                           "--no-mlflow"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "--video-frames: expected an int >= 1, got 0" in proc.stderr and "Traceback" not in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv, problem", [
    (["--budget", "16"], "--budget 16: needs --method (without one the unpruned model runs, keeping every visual "
                         "token); add a method, e.g. --method promprune, or drop --budget 16"),
    (["--option", "mu=0.4"], "--option mu: needs --method"),
    (["--method", "promprune", "--budget", "8", "--option", "mu=[0.4"],
     "--option 'mu=[0.4': the value is not valid YAML (expected ',' or ']', but got '<stream end>'); quote strings "
     "with special characters"),
    (["--method", "promprune", "--budget", "8", "--option", "mu"], "--option mu: expected KEY=VALUE"),
    (["--method", "promprune"], "--budget: required with --method promprune (the visual tokens it keeps of each "
                                "image), e.g. --budget 64"),
    (["--method", "promprune", "--budget", "8", "--option", "mu=calibrate"],
     "--option mu=calibrate: evaluate.py cannot calibrate mu (calibrating needs calibration.images, which only a sweep "
     "spec sets); pass a number, e.g. --option mu=0.42"),
], ids=["budget-without-method", "method-option-without-method", "option-not-yaml", "option-without-value",
        "method-without-budget", "mu-calibrate"])
def test_evaluate_spec_refuses_a_command_line_that_makes_no_spec(argv, problem):
    """`evaluate.py`'s command line as a spec: a --budget or a method's option with no --method (the unpruned model
    would run, ignoring it) and an --option that is not KEY=VALUE with a YAML value are refused, named by the flag as
    typed, before anything is checked or started."""
    from pipelines import evaluate

    with pytest.raises(specs.SpecError) as exc:
        evaluate.spec_of(evaluate.parse_args(argv))
    assert len(exc.value.errors) == 1 and exc.value.errors[0].startswith(problem)


def test_a_bad_adapter_option_is_reported_once(tmp_path):
    """A bad value of model.options is the model's problem, said once as model.options, not again for every trial
    and grid corner that inherits it (evaluate.py said it twice: --option, then trial promprune-b16)."""
    from pipelines import evaluate

    problem = "option 'budget_mode' must be one of"
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, MINIMAL + "model: {options: {budget_mode: bogus}}\n")  # 4 trials
    assert [m for m in e.value.errors if problem in m] == [m for m in e.value.errors if m.startswith("model.options")]
    assert len([m for m in e.value.errors if problem in m]) == 1
    with pytest.raises(specs.SpecError) as e:
        load_text(tmp_path, "name: t\nversion: 1\nmodel: {options: {budget_mode: bogus}}\ngrid: {method: promprune, "
                            "budget: 8, tau: {uniform: [0.01, 0.05]}}\ntune: {search: random, num_samples: 2}\n")
    assert len([m for m in e.value.errors if problem in m]) == 1
    args = evaluate.parse_args(["--method", "promprune", "--budget", "16", "--option", "budget_mode=bogus"])
    with pytest.raises(specs.SpecError) as e:
        specs.parse(evaluate.spec_of(args), source=evaluate.SOURCE)
    assert evaluate.in_flags(str(e.value), args).splitlines()[1:] == [f"  - --option: {problem} ['per_crop', "
                                                                      "'global', 'adaptive_views', 'view_quota', "
                                                                      "'packed', 'released'], got 'bogus'"]


def test_evaluate_spec_takes_adapter_options_without_a_method():
    """The unpruned model takes the model adapter's options (`promprune.models.ADAPTER_OPTIONS`); a method its own."""
    from pipelines import evaluate

    raw = evaluate.spec_of(evaluate.parse_args(["--option", "image_newline=keep"]))
    assert raw["baseline"] is True and raw["trials"] == [] and raw["model"]["options"] == {"image_newline": "keep"}
    raw = evaluate.spec_of(evaluate.parse_args(["--method", "promprune", "--budget", "16", "--option", "mu=[0.4]"]))
    assert raw["baseline"] is False and raw["trials"] == [{"method": "promprune", "budget": 16, "mu": [0.4]}]


def test_evaluate_cli_refuses_a_budget_without_a_method_and_a_bad_option_before_starting_ray(tmp_path):
    """Every command-line problem at once, exit 2, no traceback, nothing started (the budget alone used to run the
    unpruned baseline; the option, a YAML scanner traceback)."""
    proc = subprocess.run([sys.executable, str(REPO / "pipelines" / "evaluate.py"), "--budget", "16", "--option",
                           "mu=[0.4", "--no-mlflow"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "2 problem(s)" in proc.stderr
    assert "  - --option 'mu=[0.4': the value is not valid YAML" in proc.stderr
    assert "  - --budget 16: needs --method" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv, limit, workers", [
    ([], 8, "auto"),  # the defaults: a smoke run, as many workers as the blocks and the cluster allow
    (["--limit", "all"], None, "auto"),
    (["--limit", "null", "--workers", "2"], None, 2),
    (["--limit", "32", "--workers", "auto"], 32, "auto"),
])
def test_evaluate_limit_takes_the_full_benchmark_and_workers_auto(argv, limit, workers):
    """--limit all/null is the spec's ``limit: null`` (the full benchmark) and --workers auto the spec's
    ``resources.workers: auto``: the words the spec's own messages offer ("an int >= 1 or null", "or 'auto'")."""
    from pipelines import evaluate

    spec = specs.parse(evaluate.spec_of(evaluate.parse_args(argv)), source=evaluate.SOURCE)
    assert (spec.limit, spec.resources.workers) == (limit, workers)
    written = specs.parse({"name": "s", "version": 1, "limit": None, "resources": {"workers": "auto"}}, source="s")
    assert (written.limit, written.resources.workers) == (None, "auto")  # what a spec file means by them


@pytest.mark.parametrize("argv, problem", [
    (["--limit", "0"], "--limit: expected an int >= 1 or null, got 0"),
    (["--workers", "0"], "--workers: expected an int >= 1 or 'auto', got 0"),
])
def test_evaluate_limit_and_workers_out_of_range_named_by_flag(argv, problem):
    from pipelines import evaluate

    args = evaluate.parse_args(argv)
    with pytest.raises(specs.SpecError) as e:
        specs.parse(evaluate.spec_of(args), source=evaluate.SOURCE)
    assert evaluate.in_flags(str(e.value), args).splitlines()[1:] == [f"  - {problem}"]


@pytest.mark.parametrize("argv, message", [
    (["--limit", "some"], "argument --limit: expected an int >= 1 or all (null), got 'some'"),
    (["--workers", "many"], "argument --workers: expected an int >= 1 or 'auto', got 'many'"),
])
def test_evaluate_limit_and_workers_words_argparse_refuses(argv, message, capsys):
    from pipelines import evaluate

    with pytest.raises(SystemExit) as exit_:
        evaluate.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("typed", [["easyvqa_yesno", "easyvqa_open"], ["easyvqa_yesno,easyvqa_open"],
                                   ["easyvqa_yesno,", "easyvqa_open"], ["easyvqa_yesno, easyvqa_open"]])
def test_evaluate_and_fig2_take_tasks_space_or_comma_separated(typed):
    """--tasks a,b (lmms-eval's form) is the same spec as --tasks a b, in evaluate.py and fig2_concentration.py (the
    comma list was one unknown task 'a,b' in evaluate.py; fig2 took only the comma list)."""
    from pipelines import evaluate
    from pipelines import fig2_concentration as fig2

    spec = specs.parse(evaluate.spec_of(evaluate.parse_args(["--tasks", *typed])), source=evaluate.SOURCE)
    assert spec.tasks == ["easyvqa_yesno", "easyvqa_open"]
    assert 'tasks=["easyvqa_yesno", "easyvqa_open"]' in fig2.overrides(fig2.parse_args(["--tasks", *typed]))
