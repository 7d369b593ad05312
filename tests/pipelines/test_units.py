"""Pipeline pieces without Ray: resource planning, metric summaries, MLflow regression check, shared weights."""
from __future__ import annotations

import copy
import json
import math
import os
import pickle
import textwrap

import pyarrow.parquet as pq
import pytest
import torch

from promprune.records import Prediction, from_arrow

from pipelines import mlflow_layout, spec as specs, weights
from pipelines.recording import tracking
from pipelines.run import result, search, state as run_state
from pipelines.config import Resources
from pipelines.run import resources as planning


# ----------------------------------------------------------------------------------------------------------------
# resource planning


def _spec(**kw) -> specs.SweepSpec:
    s = specs.SweepSpec(name="t", version=1)
    for key, value in kw.items():
        section, _, field = key.partition("__")
        setattr(getattr(s, section), field, value)
    return s


GPU8 = {"GPU": 8, "CPU": 64}


@pytest.mark.parametrize("n_trials,blocks,kw,cluster,expect", [
    # (device, workers one trial uses, trials at once, workers the sweep's pool holds)
    (9, 100, {}, {"CPU": 2}, ("cpu", 2, 2, 2)),  # a laptop: two trials at a time, both sending to both workers
    (1, 100, {}, {"CPU": 2}, ("cpu", 2, 1, 2)),  # one evaluation alone: both cores
    (1, 1, {}, {"CPU": 2}, ("cpu", 1, 1, 1)),  # never more workers than blocks
    (9, 100, {"cpus_per_worker": 2}, {"CPU": 2}, ("cpu", 1, 1, 1)),  # one 2-core worker
    # GPUs, max_gpus auto: a trial leases a worker per block (at most MAX_ACTORS); two trials overlap
    (19, 3000, {}, GPU8, ("gpu", planning.MAX_ACTORS, 2, planning.MAX_ACTORS)),
    # small trials: enough at once to fill 8 GPUs (8 / 2 + 1 = 5 trials of 2 blocks)
    (19, 2, {"max_gpus": 8}, GPU8, ("gpu", 2, 5, 8)),
    (19, 3000, {"max_gpus": 8}, GPU8, ("gpu", 8, 2, 8)),  # Table 1 on 8 GPUs: 8 workers per trial, one overlapping
    (19, 3000, {"max_gpus": 8, "gpus_per_worker": 2}, GPU8, ("gpu", 4, 2, 4)),  # 2-GPU workers: 4 fit
    (19, 3000, {"max_gpus": 8, "workers": 2}, GPU8, ("gpu", 2, 5, 8)),  # explicit workers cap each trial
    (3, 2, {"max_gpus": 64}, GPU8, ("gpu", 2, 3, 6)),  # never more trials than there are
    (200, 1, {}, GPU8, ("gpu", 1, planning.MAX_AUTO_TRIALS, planning.MAX_AUTO_TRIALS)),  # the head's memory
])
def test_plan(n_trials, blocks, kw, cluster, expect):
    plan = planning.plan(Resources(**kw), n_trials, blocks, cluster=cluster, can_add_gpus=False)
    assert (plan.device, plan.max_actors, plan.trials_at_once, plan.pool_size) == expect
    assert plan.gpus == (Resources(**kw).gpus_per_worker if plan.on_gpu else 0)


def test_plan_device_is_never_a_silent_cpu_run():
    # a cluster whose autoscaler can add GPU nodes (or whose node types are unknown): GPUs, the sweep waits for them
    waits = planning.plan(Resources(), 4, 10, cluster={"CPU": 8}, can_add_gpus=True)
    assert waits.device == "gpu" and "autoscaler can add GPU nodes" in waits.note
    assert planning.plan(Resources(), 4, 10, cluster={"CPU": 8}, can_add_gpus=None).device == "gpu"
    cpu_only = planning.plan(Resources(), 4, 10, cluster={"CPU": 2}, can_add_gpus=False, model="tiny:llava")
    assert cpu_only.device == "cpu" and "no GPU" in cpu_only.note  # a CPU-only cluster or laptop: CPU, and said
    assert planning.plan(Resources(), 4, 10, cluster={"CPU": 2, "GPU": 1}, can_add_gpus=False).device == "gpu"
    assert planning.plan(Resources(device="gpu"), 4, 10, cluster={"CPU": 2}, can_add_gpus=False).device == "gpu"
    assert planning.plan(Resources(device="cpu"), 4, 10, cluster=GPU8, can_add_gpus=True).device == "cpu"


def test_a_7b_model_with_no_gpu_anywhere_is_refused_at_once():
    """LLaVA-1.5-7B has 7.06B parameters (its model card): too many for CPUs, so auto refuses instead of running it
    there; resources.device: cpu still runs it on purpose, and a cluster that can add GPUs waits for them."""
    from promprune.models.factories import parameter_count

    assert parameter_count("shape:llava_1_5_7b") == pytest.approx(7.06e9, rel=0.01)
    assert parameter_count("tiny:llava") < planning.CPU_MAX_PARAMS
    with pytest.raises(planning.NoCapacity, match=r"shape:llava_1_5_7b has 7\.1B parameters.*resources\.device: cpu"):
        planning.plan(Resources(), 4, 10, cluster={"CPU": 2}, can_add_gpus=False, model="shape:llava_1_5_7b")
    assert planning.plan(Resources(device="cpu"), 4, 10, cluster={"CPU": 2}, can_add_gpus=False,
                         model="shape:llava_1_5_7b").device == "cpu"
    assert planning.plan(Resources(), 4, 10, cluster={"CPU": 2}, can_add_gpus=True,
                         model="shape:llava_1_5_7b").device == "gpu"


def test_the_autoscalers_node_types_are_read_from_its_monitors_command_line(tmp_path):
    """The v1 monitor's --autoscaling-config (both spellings), a monitor without one (a plain `ray start --head`:
    it only mirrors the nodes) and a process that is gone."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "autoscaler.yaml"
    path.write_text(yaml.safe_dump({"max_workers": 4, "available_node_types": {
        "head": {"resources": {"CPU": 2}, "max_workers": 0}, "gpu": {"resources": {"CPU": 8, "GPU": 1}},
        "cpu": {"resources": {"CPU": 8}, "max_workers": 2}}}))
    wait = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    for args in ([f"--autoscaling-config={path}"], ["--autoscaling-config", str(path)], []):
        proc = subprocess.Popen(wait + args, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "up\n"  # running (its command line is readable once it has started)
            types = planning._monitor_node_types(proc.pid)
        finally:
            proc.kill()
            proc.wait()
        expected = [{"resources": {"CPU": 2}, "max_workers": 0}, {"resources": {"CPU": 8, "GPU": 1}, "max_workers": 4},
                    {"resources": {"CPU": 8}, "max_workers": 2}] if args else []  # a type without max_workers: the cap
        assert sorted(types, key=str) == sorted(expected, key=str)
    assert planning._monitor_node_types(proc.pid) is None  # gone: cannot tell


def test_plan_takes_a_set_cap_on_trials_at_once():
    assert planning.plan(Resources(), 19, 2, 3, cluster=GPU8, can_add_gpus=False).trials_at_once == 3
    assert planning.plan(Resources(), 19, 2, 3, cluster={"CPU": 2}, can_add_gpus=False).trials_at_once == 3
    assert planning.plan(Resources(), 2, 2, 10, cluster={"CPU": 2}, can_add_gpus=False).trials_at_once == 2
    one = planning.plan(Resources(), 9, 100, 1, cluster={"CPU": 2}, can_add_gpus=False)
    assert (one.trials_at_once, one.max_actors) == (1, 2)  # one trial at a time: both cores for it


# ----------------------------------------------------------------------------------------------------------------
# summaries


def test_summarize_hand_values():
    preds = [
        _pred("a", 0, entropy=0.2, saliency_count=4, visual_tokens=8, prefill_ms=10.0, peak_mem_mb=100.0,
              prefill_flops=2e12, kv_cache_bytes=2 * 2 ** 20),
        _pred("a", 1, entropy=0.6, saliency_count=2, visual_tokens=8, prefill_ms=30.0, peak_mem_mb=300.0,
              prefill_flops=4e12, kv_cache_bytes=4 * 2 ** 20),
        _pred("a", 2, entropy=0.4, saliency_count=6, visual_tokens=8, prefill_ms=20.0, peak_mem_mb=200.0,
              prefill_flops=3e12, kv_cache_bytes=3 * 2 ** 20),
        _pred("a", 3, prediction="", error="ValueError: corrupt image"),
    ]
    m = result.summarize(result.predictions_table(preds), {"a": {"accuracy": 0.5, "n_samples": 4}})
    assert m["a/accuracy"] == 0.5 and m["samples/total"] == 4 and m["samples/failed"] == 1
    assert m["entropy/mean"] == pytest.approx(0.4) and m["entropy/median"] == pytest.approx(0.4)
    assert m["t_sal/mean"] == 4 and m["t_sal/median"] == 4
    assert m["efficiency/prefill_tflops"] == pytest.approx(3.0) and m["efficiency/kv_cache_mb"] == pytest.approx(3.0)
    assert m["efficiency/llm_prefill_ms"] == 20.0 and m["efficiency/peak_mem_gb"] == pytest.approx(300 / 1024)
    assert math.isnan(m["efficiency/prefill_ms"])  # vision and selection times not given: no total
    assert m["efficiency/visual_tokens"] == 8


def test_unpruned_summary_has_no_entropy():
    table = result.predictions_table([_pred("a", 0, entropy=None, saliency_count=0, visual_tokens=36)])
    m = result.summarize(table, {"a": {"accuracy": 1.0}})
    assert math.isnan(m["entropy/mean"])


def test_exactly_once_names_duplicates_and_missing():
    keys = [f"a/{i}" for i in range(3)]
    result.check_exactly_once(keys, result.predictions_table([_pred("a", i) for i in (2, 0, 1)]))
    with pytest.raises(RuntimeError, match=r"duplicated \['a/1'\].*missing \['a/2'\]"):
        result.check_exactly_once(keys, result.predictions_table([_pred("a", i) for i in (0, 1, 1)]))


def _pred(task, doc_id, **fields):
    return Prediction(task=task, doc_id=doc_id, n_docs=3, prompt="q?", **fields)


def test_predictions_table_schema():
    """Columns, order and types come from the Prediction declaration; rows sorted by (task, doc_id)."""
    table = result.predictions_table([
        _pred("b", 1, prediction="no", entropy=0.5, saliency_count=3, visual_tokens=8, kept=[1, 2], vision_ms=1.0,
              gen_kwargs={"until": ["\n"]}),
        _pred("a", 0, error="boom"),
    ])
    assert table.schema == result.PREDICTION_SCHEMA
    assert table.schema.names[:2] == ["task", "doc_id"] and "image" not in table.schema.names
    assert str(table.schema.field("kept").type) == "list<item: int64>"
    assert str(table.schema.field("visual_tokens").type) == "int64"
    rows = table.to_pylist()
    assert [r["task"] for r in rows] == ["a", "b"]
    assert rows[1]["kept"] == [1, 2] and rows[0]["error"] == "boom" and rows[0]["visual_tokens"] is None
    assert rows[1]["gen_kwargs"] == '{"until": ["\\n"]}'  # dicts travel as JSON text
    assert from_arrow(table, Prediction)[1] == _pred("b", 1, prediction="no", entropy=0.5, saliency_count=3,
                                                     visual_tokens=8, kept=[1, 2], vision_ms=1.0,
                                                     gen_kwargs={"until": ["\n"]})


def test_trial_result_is_one_parquet_file(tmp_path):
    """The file a trial checkpoints and the driver uploads: predictions as written, scores and metrics (NaN kept)."""
    table = result.predictions_table([_pred("a", 1, prediction="no", kept=[3]), _pred("a", 0, error="boom")])
    scores = {"a": {"accuracy": 0.5, "n_samples": 2, "n_failed": 1}}
    metrics = {"a/accuracy": 0.5, "entropy/mean": float("nan"), "trial/wall_s": 1.25}
    path = result.TrialResult(table, scores, metrics).write(tmp_path / mlflow_layout.PREDICTIONS_ARTIFACT)
    back = result.TrialResult.read(path)
    assert back.predictions.equals(table) and back.predictions.schema.metadata is None
    assert back.scores == scores and back.metrics["trial/wall_s"] == 1.25 and math.isnan(back.metrics["entropy/mean"])
    assert pq.read_schema(path).remove_metadata() == result.PREDICTION_SCHEMA  # what the reports read is unchanged
    pq.write_table(table, tmp_path / "bare.parquet")
    with pytest.raises(ValueError, match="bare.parquet holds predictions but no trial result"):
        result.TrialResult.read(tmp_path / "bare.parquet")


def test_assembled_predictions_are_sorted_and_checked_once():
    """The actors' blocks arrive in any order; assembled they are one table sorted by (task, doc_id)."""
    blocks = [result.predictions_table([_pred("b", 0), _pred("a", 2)]),
              result.predictions_table([_pred("a", 10), _pred("a", 1)])]
    keys = ["a/1", "a/2", "a/10", "b/0"]
    table = result.assemble_predictions(keys, blocks)
    assert list(zip(table.column("task").to_pylist(), table.column("doc_id").to_pylist())) == [
        ("a", 1), ("a", 2), ("a", 10), ("b", 0)]
    with pytest.raises(RuntimeError, match=r"unexpected \['b/0'\]"):
        result.assemble_predictions(keys[:3], blocks)


def test_scored_result_replays_the_rows_scoring_reads():
    seen = []
    table = result.predictions_table([_pred("a", 0, prediction="yes", visual_tokens=4)])
    got = result.TrialResult.scored(table, lambda rows: seen.extend(rows) or {"a": {"accuracy": 1.0}})
    assert seen == [{"task": "a", "doc_id": 0, "n_docs": 3, "prediction": "yes", "error": None}]
    assert got.metrics["a/accuracy"] == 1.0 and got.metrics["efficiency/visual_tokens"] == 4


def test_calibrated_mu_is_applied_once_on_the_driver():
    """Tune's config holds the trial with the options it runs with; the id stays the spec's; the run's params say
    where mu came from."""
    from pipelines.recording.recorder import trial_run_params

    trial = specs.Trial("promprune", 8, {"mu": "calibrate", "metric": "attention"})
    calibrated = trial.with_calibration({"attention": 0.81})
    assert calibrated.run_options == {"mu": 0.81, "metric": "attention"} and calibrated.calibrated == {"mu": 0.81}
    assert calibrated.trial_id == trial.trial_id == "promprune-b8-metric=attention-mu=calibrate"
    spec = specs.parse({"name": "t", "version": 1, "trials": [{"method": "promprune", "budget": 8}]})
    config = search.param_space(spec, search.Phase("", [trial]), {"attention": 0.81})
    assert config["trial"]["grid_search"] == [calibrated]  # what Tune carries to the trial, as it is
    record = calibrated.to_dict()
    assert record["options"] == {"mu": 0.81, "metric": "attention"} and record["mu_source"] == "calibration"
    plain = specs.Trial("promprune", 8, {"mu": 0.4})
    assert plain.with_calibration({"attention": 0.81}) is plain and "mu_source" not in plain.to_dict()
    params = trial_run_params(specs.SweepSpec(name="t", version=1), record, {})
    assert params["mu"] == "0.81" and params["mu_source"] == "calibration" and params["metric"] == "attention"


# ----------------------------------------------------------------------------------------------------------------
# MLflow: the nightly regression check, on a real SQLite store


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch, mlflow_db):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "test")
    return tracking.client()


def _night(c, rels: dict, version: int = 1, name: str = "nightly", spec_yaml: str = "name: nightly\n",
           params: dict | None = None) -> str:
    parent = tracking.start_sweep(c, name, version, spec_yaml, params or {})
    for tid, rel in rels.items():
        trial = {"trial_id": tid, "method": tid.split("-")[0], "budget": 8, "options": {}}
        metrics = {} if rel is None else {"rel": rel}  # None: a trial whose Rel. was NaN (the outbox logs no NaN)
        tracking.log_trial(c, parent, name, version, trial, {"method": trial["method"]}, metrics, None)
    return parent


def _check(c, run_id: str, spec_yaml: str = "name: nightly\n", version: int = 1) -> tuple[list[str], str]:
    return tracking.regression_check(c, run_id, "nightly", version, 0.02, run_state.spec_fingerprint(spec_yaml))


def test_regression_check_against_the_previous_night(mlflow_store):
    c = mlflow_store
    first = _night(c, {"promprune-b8": 0.95, "divprune-b8": 0.90})
    assert _check(c, first) == ([], "no earlier FINISHED run of sweep nightly v1 in this experiment")
    assert c.get_run(first).data.tags[mlflow_layout.REGRESSION] == "no-previous"
    tracking.finish(c, first)
    _night(c, {"promprune-b8": 0.10}, version=2)  # another spec version: not comparable, must be skipped
    second = _night(c, {"promprune-b8": 0.94, "divprune-b8": 0.85})  # -0.01 ok, -0.05 regression
    found, note = _check(c, second)
    assert len(found) == 1 and found[0].startswith("divprune-b8: rel 0.9000 -> 0.8500")
    assert note.startswith(f"compared with {first} (started ")
    tags = c.get_run(second).data.tags
    assert tags[mlflow_layout.REGRESSION] == "true" and tags[f"{mlflow_layout.REGRESSION}.previous_run"] == first
    assert tags[f"{mlflow_layout.REGRESSION}.note"] == note


def test_a_night_whose_trials_failed_is_no_baseline_and_says_what_it_did_not_compare(mlflow_store):
    """A probe's case: a night whose baseline trial failed ended FINISHED with no Rel., tagged regression=false
    "compared with" the night before though it compared nothing; the next night took it as its baseline, and
    PromPrune falling from 0.80 to 0.00 exited 0. A night with failed trials says which trials it did not compare
    (`incomplete`), and the next compares with the last night whose trials all finished."""
    c = mlflow_store
    good = _night(c, {"promprune-b8": 0.80, "none": 1.0})
    tracking.finish(c, good)
    failed = _night(c, {})  # every trial failed: no Rel. anywhere
    found, note = _check(c, failed)
    assert found == [] and c.get_run(failed).data.tags[mlflow_layout.REGRESSION] == "incomplete"
    assert note.endswith("; 2 trial(s) of that run have no Rel. in this one, so were not compared: none, promprune-b8")
    c.log_metric(failed, mlflow_layout.TRIALS_FAILED, 2)  # as the sweep logs it at its end
    tracking.finish(c, failed)
    fallen = _night(c, {"promprune-b8": 0.0, "none": 1.0})
    found, note = _check(c, fallen)
    assert found == ["promprune-b8: rel 0.8000 -> 0.0000 (-0.8000)"]
    assert note.startswith(f"compared with {good} (started ") and note.endswith(
        "whose trials all finished; 1 later run(s) of it had failed trials and are not compared with")
    assert c.get_run(fallen).data.tags[mlflow_layout.REGRESSION] == "true"
    c.log_metric(good, mlflow_layout.TRIALS_FAILED, 1)  # no run whose trials all finished: nothing to compare with
    again = _night(c, {"promprune-b8": 0.0, "none": 1.0})
    c.log_metric(fallen, mlflow_layout.TRIALS_FAILED, 1)
    tracking.finish(c, fallen)
    assert _check(c, again) == ([], "the 3 earlier FINISHED run(s) of the same resolved spec of sweep nightly v1 all "
                                    "had failed trials: nothing to compare with")
    assert c.get_run(again).data.tags[mlflow_layout.REGRESSION] == "no-previous"


def test_a_night_without_rel_is_no_baseline_and_a_check_that_compared_nothing_is_not_false(mlflow_store):
    """Probe Q: a night whose task scored NaN (Rel. undefined, not logged, no trial failed) ended FINISHED and became
    the next night's baseline, which compared no trial and was tagged regression=false "compared with" it, passing
    over the last night with a Rel.; two NaN nights in a row were tagged false too. Such a night is passed over (said
    in the line), and a check that compared nothing is `incomplete`, never `false`."""
    c = mlflow_store
    good = _night(c, {"none": 1.0, "promprune-b8": 0.80})
    tracking.finish(c, good)
    nan = _night(c, {"none": None, "promprune-b8": None})
    found, note = _check(c, nan)
    assert found == [] and c.get_run(nan).data.tags[mlflow_layout.REGRESSION] == "incomplete"
    tracking.finish(c, nan)
    fallen = _night(c, {"none": 1.0, "promprune-b8": 0.50})  # against the NaN night it compared nothing: "false"
    found, note = _check(c, fallen)
    assert found == ["promprune-b8: rel 0.8000 -> 0.5000 (-0.3000)"]
    assert note.startswith(f"compared with {good} (started ") and note.endswith(
        "whose trials all finished with a Rel. for some; 1 later run(s) of it had no trial with a Rel. (a score NaN, "
        "or a baseline score of 0) and are not compared with")
    c.set_tag(fallen, mlflow_layout.REGRESSION, "accepted")
    tracking.finish(c, fallen)
    second_nan = _night(c, {"none": None, "promprune-b8": None})  # compared with fallen: nothing, so incomplete
    assert _check(c, second_nan)[1].startswith(f"compared with {fallen} (started ")
    assert c.get_run(second_nan).data.tags[mlflow_layout.REGRESSION] == "incomplete"
    tracking.finish(c, second_nan)
    c.set_tag(fallen, mlflow_layout.REGRESSION, "true")
    c.log_metric(good, mlflow_layout.TRIALS_FAILED, 1)
    found, note = _check(c, _night(c, {"none": 1.0, "promprune-b8": 0.80}))
    assert found == [] and note == (
        "the 4 earlier FINISHED run(s) of the same resolved spec of sweep nightly v1 all had failed trials or "
        "regressed (tag promprune.regression=true) or had no trial with a Rel. (a score NaN, or a baseline score of "
        "0): nothing to compare with")


def test_a_trial_that_never_gets_a_rel_leaves_the_check_on_for_the_others(mlflow_store):
    """Reviewer's case: a trial whose score is NaN every night (seeded, greedy nights repeat it) made every night
    no baseline, so every check was `no-previous` and a fall of the others passed (exit 0). A night with a Rel. for
    some trials is a baseline for those; the trial without one is named as not compared (in neither night too: it
    was not named, the tag `false` as if every trial was compared; the tag stays the others'), and a check with no
    regression among the compared is `incomplete` where a trial has a Rel. in one night only."""
    c = mlflow_store
    first = _night(c, {"none": 1.0, "promprune-b8": 0.90, "fastv-b8": None})
    tracking.finish(c, first)
    fallen = _night(c, {"none": 1.0, "promprune-b8": 0.50, "fastv-b8": None})
    found, note = _check(c, fallen)
    assert found == ["promprune-b8: rel 0.9000 -> 0.5000 (-0.4000)"]
    assert note.startswith(f"compared with {first} (started ")
    assert c.get_run(fallen).data.tags[mlflow_layout.REGRESSION] == "true"
    c.set_tag(fallen, mlflow_layout.REGRESSION, "accepted")
    tracking.finish(c, fallen)
    steady = _night(c, {"none": 1.0, "promprune-b8": 0.50, "fastv-b8": None})  # fastv-b8 in neither: named only
    found, note = _check(c, steady)
    assert found == [] and c.get_run(steady).data.tags[mlflow_layout.REGRESSION] == "false"
    assert note.endswith("; 1 trial(s) have a Rel. in neither run, so were not compared: fastv-b8")
    assert c.get_run(steady).data.tags[f"{mlflow_layout.REGRESSION}.note"] == note
    tracking.finish(c, steady)
    scored = _night(c, {"none": 1.0, "promprune-b8": 0.50, "fastv-b8": 0.70})  # fastv-b8's first Rel.
    found, note = _check(c, scored)
    assert found == [] and c.get_run(scored).data.tags[mlflow_layout.REGRESSION] == "incomplete"
    assert note.endswith("; 1 trial(s) of this run had no Rel. in that one, so were not compared: fastv-b8")
    tracking.finish(c, scored)
    partial = _night(c, {"none": 1.0, "promprune-b8": None, "fastv-b8": 0.70})
    found, note = _check(c, partial)
    assert found == [] and c.get_run(partial).data.tags[mlflow_layout.REGRESSION] == "incomplete"
    assert note.endswith("; 1 trial(s) of that run have no Rel. in this one, so were not compared: promprune-b8")


def test_a_night_that_regressed_is_no_baseline_so_the_regression_fails_every_night_until_fixed(mlflow_store):
    """A probe's case: a night whose PromPrune Rel. fell 0.80 -> 0.70 exited 3, and became the next night's baseline,
    which then compared 0.70 with 0.70 and exited 0: a regression failed one night only. A night tagged
    promprune.regression=true is passed over (said in the line) and the baseline stays the last good night; its tag
    set to anything else (accepting the drop) makes it a baseline again."""
    c = mlflow_store
    good = _night(c, {"promprune-b8": 0.80, "none": 1.0})
    assert _check(c, good)[0] == []
    tracking.finish(c, good)
    fell = _night(c, {"promprune-b8": 0.70, "none": 1.0})
    assert _check(c, fell)[0] == ["promprune-b8: rel 0.8000 -> 0.7000 (-0.1000)"]
    assert c.get_run(fell).data.tags[mlflow_layout.REGRESSION] == "true"
    tracking.finish(c, fell)
    still = _night(c, {"promprune-b8": 0.70, "none": 1.0})  # not fixed: still a regression of the good night
    found, note = _check(c, still)
    assert found == ["promprune-b8: rel 0.8000 -> 0.7000 (-0.1000)"]
    assert note.startswith(f"compared with {good} (started ") and note.endswith(
        "whose trials all finished and that did not regress; 1 later run(s) of it regressed (tag "
        "promprune.regression=true) and are not compared with")
    tracking.finish(c, still)
    c.set_tag(good, mlflow_layout.REGRESSION, "true")  # every earlier night regressed: nothing to compare with
    assert _check(c, _night(c, {"promprune-b8": 0.70}))[1] == (
        "the 3 earlier FINISHED run(s) of the same resolved spec of sweep nightly v1 all regressed (tag "
        "promprune.regression=true): nothing to compare with")
    c.set_tag(good, mlflow_layout.REGRESSION, "no-previous")
    c.set_tag(still, mlflow_layout.REGRESSION, "accepted")  # the drop accepted: that night is the baseline now
    found, note = _check(c, _night(c, {"promprune-b8": 0.70, "none": 1.0}))
    assert found == [] and note.startswith(f"compared with {still} (started ")


def test_the_regression_check_compares_only_runs_of_the_same_resolved_dtype(mlflow_store):
    """``dtype: auto`` resolves to float32 on CPU workers and bfloat16 on GPU ones under one spec fingerprint: a GPU
    night was compared with a CPU night. The parent run records the resolved dtype (`tracking.model_params`, as the
    workers resolve it) and the check compares runs of one dtype only, saying which it passed over."""
    c = mlflow_store
    spec = specs.SweepSpec(name="nightly", version=1)
    assert spec.model.dtype == "auto"
    cpu, gpu = tracking.model_params(spec, on_gpu=False), tracking.model_params(spec, on_gpu=True)
    assert cpu == {"dtype": "float32", "attn_implementation": "sdpa", "model_options": "{}"}
    assert gpu["dtype"] == "bfloat16"
    first = _night(c, {"promprune-b8": 0.95}, params=cpu)
    tracking.finish(c, first)
    on_gpu = _night(c, {"promprune-b8": 0.80}, params=gpu)  # -0.15 against a CPU night: not a regression of it
    found, note = _check(c, on_gpu)
    assert found == [] and c.get_run(on_gpu).data.tags[mlflow_layout.REGRESSION] == "no-previous"
    assert note == ("the 1 earlier FINISHED run(s) of the same resolved spec of sweep nightly v1 ran in another dtype "
                    "(float32, this one bfloat16; dtype auto resolves by the device the workers run on): nothing to "
                    "compare with")
    tracking.finish(c, on_gpu)
    again = _night(c, {"promprune-b8": 0.90}, params=cpu)
    found, note = _check(c, again)
    assert found == ["promprune-b8: rel 0.9500 -> 0.9000 (-0.0500)"]
    assert note.startswith(f"compared with {first} ") and note.endswith(
        "; 1 run(s) of it ran in another dtype (bfloat16, this one float32) and are not compared with")


def _nightly_yaml(*overrides: str) -> str:
    """sweeps/nightly.yaml resolved, with ``--set`` overrides, as a sweep logs it."""
    from pipelines.frontdoor import REPO

    return specs.dump_resolved(specs.load(REPO / "sweeps" / "nightly.yaml", list(overrides)))


def test_the_regression_check_compares_only_runs_of_the_same_resolved_spec(mlflow_store):
    """A `--set limit=20` quick check of the nightly (which sweeps/nightly.yaml suggests) had the same name and
    version, and became the next 500-question night's baseline: a false regression (exit 3), or one masked. Each
    run is compared with the latest earlier FINISHED run logged from the same spec file and overrides."""
    c = mlflow_store
    full, quick = _nightly_yaml(), _nightly_yaml("limit=20")
    assert run_state.spec_fingerprint(full) != run_state.spec_fingerprint(quick)
    night = _night(c, {"promprune-b64": 0.95}, version=2, spec_yaml=full)
    tracking.finish(c, night)
    check = _night(c, {"promprune-b64": 0.80}, version=2, spec_yaml=quick)  # 20 questions: a noisy Rel.
    tracking.finish(c, check)
    steady = _night(c, {"promprune-b64": 0.94}, version=2, spec_yaml=full)  # -0.01 from the last night: fine
    assert _check(c, steady, full, 2)[0] == []  # against the quick check it would have been +0.14, also fine ...
    assert c.get_run(steady).data.tags[f"{mlflow_layout.REGRESSION}.previous_run"] == night
    fallen = _night(c, {"promprune-b64": 0.85}, version=2, spec_yaml=full)  # -0.10: a real regression ...
    found, note = _check(c, fallen, full, 2)
    assert found == ["promprune-b64: rel 0.9500 -> 0.8500 (-0.1000)"]  # ... the quick check's 0.80 masked
    assert note.startswith(f"compared with {night} ") and c.get_run(fallen).data.tags[
        f"{mlflow_layout.REGRESSION}.previous_run"] == night
    again = _night(c, {"promprune-b64": 0.79}, version=2, spec_yaml=quick)  # quick checks among themselves
    assert _check(c, again, quick, 2)[0] == []
    assert c.get_run(again).data.tags[f"{mlflow_layout.REGRESSION}.previous_run"] == check


def test_with_no_earlier_run_of_the_same_spec_the_check_says_why(mlflow_store):
    """Only a quick check and a parent run logged before runs carried the spec's fingerprint came before: nothing
    to compare with (`no-previous`, exit 0), said in one line naming the differing field and the older run."""
    c = mlflow_store
    full, quick = _nightly_yaml(), _nightly_yaml("limit=20")
    older = _night(c, {"promprune-b64": 0.95}, version=2, spec_yaml=full)
    c.delete_tag(older, mlflow_layout.SPEC_FINGERPRINT)  # as a run logged before the tag existed
    tracking.finish(c, older)
    check = _night(c, {"promprune-b64": 0.80}, version=2, spec_yaml=quick)
    tracking.finish(c, check)
    night = _night(c, {"promprune-b64": 0.50}, version=2, spec_yaml=full)
    found, note = _check(c, night, full, 2)
    assert found == [] and c.get_run(night).data.tags[mlflow_layout.REGRESSION] == "no-previous"
    assert note == (f"none of the 2 earlier FINISHED run(s) of sweep nightly v2 ran this resolved spec: 1 ran another "
                    f"resolved spec (the latest, {check}: limit: 20 -> 500); 1 logged before parent runs recorded "
                    "their spec's fingerprint, so they cannot be told to be the same spec")
    assert "\n" not in note and c.get_run(night).data.tags[f"{mlflow_layout.REGRESSION}.note"] == note


def test_a_night_recorded_before_a_field_existed_is_the_baseline_while_the_field_holds_its_default(mlflow_store):
    """A field the code gains with a default (resources.load_timeout_s) changes the resolved spec's fingerprint: the
    first night after it compared with nothing ("ran another resolved spec: resources.load_timeout_s: '(unset)' ->
    1800") though it ran the same experiment, which --resume already tolerates (`state.check_resume`). A night whose
    spec lacks only fields this run holds at their default is its baseline, and the line says so; one lacking it and
    differing in anything else is not, nor is any earlier night when this run sets the new field to another value."""
    import yaml

    from pipelines.frontdoor import REPO

    c = mlflow_store

    def as_before_the_field(resolved: str) -> str:  # the spec as the code resolved it before load_timeout_s existed
        data = yaml.safe_load(resolved)
        assert data["resources"].pop("load_timeout_s") == 1800
        return yaml.safe_dump(data, sort_keys=False)

    def check(run_id, *overrides):
        spec = specs.load(REPO / "sweeps" / "nightly.yaml", list(overrides))
        return tracking.regression_check(c, run_id, "nightly", spec.version, 0.02,
                                         run_state.spec_fingerprint(specs.dump_resolved(spec)), spec)

    version = specs.load(REPO / "sweeps" / "nightly.yaml", []).version
    good = _night(c, {"promprune-b64": 0.95}, version=version, spec_yaml=as_before_the_field(_nightly_yaml()))
    tracking.finish(c, good)
    quick = _night(c, {"promprune-b64": 0.50}, version=version,
                   spec_yaml=as_before_the_field(_nightly_yaml("limit=20")))  # lacks the field, and a real difference
    tracking.finish(c, quick)
    fallen = _night(c, {"promprune-b64": 0.85}, version=version, spec_yaml=_nightly_yaml())
    found, note = check(fallen)
    assert found == ["promprune-b64: rel 0.9500 -> 0.8500 (-0.1000)"]  # the old code: no-previous, exit 0
    assert note.startswith(f"compared with {good} (started ") and note.endswith(
        "whose trials all finished; it was recorded before the code had resources.load_timeout_s, which this run "
        "holds at the default (what the code did before)")
    assert c.get_run(fallen).data.tags[f"{mlflow_layout.REGRESSION}.previous_run"] == good
    longer = _night(c, {"promprune-b64": 0.85}, version=version,
                    spec_yaml=_nightly_yaml("resources.load_timeout_s=7200"))
    found, note = check(longer, "resources.load_timeout_s=7200")
    assert found == [] and c.get_run(longer).data.tags[mlflow_layout.REGRESSION] == "no-previous"
    assert note.startswith(f"none of the 2 earlier FINISHED run(s) of sweep nightly v{version} ran this resolved "
                           f"spec: 2 ran another resolved spec (the latest, {quick}: ") and \
        "resources.load_timeout_s: '(unset)' -> 7200" in note


def test_a_spec_without_the_fields_it_gained_is_the_one_the_earlier_code_resolved():
    """`state.without_gained_defaults`: the current spec, resolved, less the fields an earlier spec lacks, when each
    holds its declared default; a section new as a whole goes with its fields. A new key of a free mapping (grid) or
    a new field set to another value is a real difference: None. So is no difference at all."""
    import yaml

    spec = specs.parse({"name": "n", "version": 1, "grid": {"method": "promprune", "budget": 8, "mu": [0.4]}})
    now = yaml.safe_load(specs.dump_resolved(spec))
    before = {k: v for k, v in now.items() if k != "calibration"}  # calibration: a section the code gained
    del before["resources"]["load_timeout_s"]
    older, gained = run_state.without_gained_defaults(spec, yaml.safe_dump(before, sort_keys=False))
    assert older == yaml.safe_dump(before, sort_keys=False)
    assert sorted(gained) == sorted(["resources.load_timeout_s"] + [f"calibration.{k}" for k in now["calibration"]])
    assert run_state.without_gained_defaults(spec, specs.dump_resolved(spec)) is None
    del before["grid"]["mu"]
    assert run_state.without_gained_defaults(spec, yaml.safe_dump(before, sort_keys=False)) is None
    longer = specs.parse({"name": "n", "version": 1, "resources": {"load_timeout_s": 60}})
    assert run_state.without_gained_defaults(longer, yaml.safe_dump(
        {k: v for k, v in yaml.safe_load(specs.dump_resolved(longer)).items() if k != "resources"})) is None


def test_a_spec_fingerprint_ignores_where_the_checkout_lies(tmp_path, monkeypatch):
    """A Ray job's working directory is a new package copy of the checkout whenever a file changed: a spec's plugins
    resolved under it must not make two nights' specs differ. A plugin elsewhere still counts."""
    spec = "name: n\nplugins: [{}/plugins/m.py, /opt/shared/p.py, my_module]\ninclude_path: [{}/tasks]\n"
    fingerprints = set()
    for package in ("_ray_pkg_aaa", "_ray_pkg_bbb"):
        (tmp_path / package).mkdir()
        monkeypatch.chdir(tmp_path / package)
        fingerprints.add(run_state.spec_fingerprint(spec.format(tmp_path / package, tmp_path / package)))
    assert len(fingerprints) == 1
    assert run_state.spec_fingerprint(spec.format(tmp_path / "x", tmp_path / "x")) not in fingerprints


def test_trial_run_schema(mlflow_store):
    c = mlflow_store
    parent = tracking.start_sweep(c, "s", 3, "name: s\n", {"model": "tiny:llava"})
    trial = {"trial_id": "promprune-b8-mu=0.4", "method": "promprune", "budget": 8, "options": {"mu": 0.4}}
    params = tracking.trial_params("tiny:llava", trial, ["easyvqa_yesno"], {})
    run_id = tracking.log_trial(c, parent, "s", 3, trial, params, {"x/y": 1.0, "bad": float("nan")}, None)
    run = c.get_run(run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags[mlflow_layout.TRIAL] == trial["trial_id"]
    assert run.data.params == {"model": "tiny:llava", "method": "promprune", "budget": "8",
                               "tasks": "easyvqa_yesno", "repeat": "0", "mu": "0.4"}
    assert run.data.metrics == {"x/y": 1.0}  # NaN = not measured, never logged
    assert c.get_run(parent).data.tags[mlflow_layout.VERSION] == "3"
    assert list(tracking.trial_runs(c, parent)) == ["promprune-b8-mu=0.4"]
    with pytest.raises(ValueError, match="must be named predictions.parquet"):
        tracking.log_trial(c, parent, "s", 3, trial, params, {}, "/tmp/preds.parquet")


def test_a_standalone_evaluation_logs_its_trial_result(mlflow_store, tmp_path):
    """`pipelines/evaluate.py`'s run: role evaluation, the trial's params and metrics, the TrialResult file."""
    c = mlflow_store
    table = result.predictions_table([_pred("a", 0, prediction="yes")])
    done = result.TrialResult(table, {"a": {"accuracy": 1.0}}, {"a/accuracy": 1.0, "entropy/mean": float("nan")})
    spec = specs.SweepSpec(name="evaluate", version=1, model=weights.ModelSource("tiny:llava"), tasks=["a"])
    run = c.get_run(tracking.log_evaluation(spec, specs.Trial("promprune", 8, {"mu": 0.4}), done, on_gpu=False))
    assert run.data.tags[mlflow_layout.ROLE] == "evaluation"
    assert run.data.tags[mlflow_layout.TRIAL] == "promprune-b8-mu=0.4"
    assert run.data.params["mu"] == "0.4" and run.data.metrics == {"a/accuracy": 1.0}
    # what its workers ran: `dtype: auto` on CPU workers is float32
    assert {k: run.data.params[k] for k in ("dtype", "attn_implementation", "model_options")} == \
        {"dtype": "float32", "attn_implementation": "sdpa", "model_options": "{}"}
    path = c.download_artifacts(run.info.run_id, mlflow_layout.PREDICTIONS_ARTIFACT, str(tmp_path))
    back = result.TrialResult.read(path)
    assert back.predictions.equals(table) and back.scores == done.scores


# ----------------------------------------------------------------------------------------------------------------
# shared weights: extract -> object-store bytes -> restore gives the same model


def _logits(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    size = cfg.vision_config.image_size
    ids = torch.randint(3, 100, (1, 6), generator=g)
    pixel = torch.randn(1, 3, size, size, generator=g)
    n_img = (size // cfg.vision_config.patch_size) ** 2
    image_ids = torch.full((1, n_img), cfg.image_token_id)
    input_ids = torch.cat([ids[:, :2], image_ids, ids[:, 2:]], dim=1)
    with torch.inference_mode():
        return model(input_ids=input_ids, pixel_values=pixel.to(model.dtype)).logits.float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restore_reproduces_the_model(dtype):
    torch.set_num_threads(1)
    from promprune.models.tiny import tiny_vlm

    model, _ = tiny_vlm("llava")
    model = copy.deepcopy(model).to(getattr(torch, dtype)).eval()  # the cached model is shared: never cast it
    expected = _logits(model)
    recipe, arrays = weights.extract(model)
    recipe, arrays = pickle.loads(pickle.dumps((recipe, arrays)))  # what the object store does
    for a in arrays:
        a.setflags(write=False)  # object-store arrays are read-only
    restored = weights.restore(recipe, arrays)
    assert restored is not model and restored.dtype == getattr(torch, dtype)
    torch.testing.assert_close(_logits(restored), expected, rtol=0, atol=0)
    n_unique = len({id(t) for t in list(model.parameters()) + list(model.buffers())})
    assert len(arrays) == n_unique  # shared tensors are shipped once
    tied_src = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    tied_dst = restored.get_input_embeddings().weight is restored.get_output_embeddings().weight
    assert tied_src == tied_dst


def test_resolve_dtype():
    assert weights.resolve_dtype("auto", on_gpu=True) == "bfloat16"
    assert weights.resolve_dtype("auto", on_gpu=False) == "float32"
    with pytest.raises(ValueError, match="dtype"):
        weights.resolve_dtype("fp8", on_gpu=True)


def test_sweep_state_records(tmp_path):
    from pipelines.run.state import load_state, save_state

    storage = str(tmp_path / "tune")
    for stamp in ("20261120-020000", "20261121-020000"):
        save_state(storage, {"experiment": f"nightly-{stamp}", "parent_run_id": stamp, "storage_path": storage})
    save_state(storage, {"experiment": "other-20261122-020000", "parent_run_id": "x", "storage_path": storage})
    assert load_state(storage, "nightly", "latest")["parent_run_id"] == "20261121-020000"
    assert load_state(storage, "nightly", "nightly-20261120-020000")["parent_run_id"] == "20261120-020000"
    with pytest.raises(specs.SpecError, match="no run 'nightly-1999' of sweep 'nightly'"):
        load_state(storage, "nightly", "nightly-1999")
    with pytest.raises(specs.SpecError, match="found: none"):
        load_state(str(tmp_path / "empty"), "nightly", "latest")


def test_validate_only_shows_what_each_task_generates_with():
    """A task without max_new_tokens (TextVQA) gets lmms-eval's 1024, not transformers' 20; the spec's generation
    lies over every task's own (issue 21)."""
    from pipelines.sweep import generation_plan

    spec = specs.parse({"name": "g", "version": 1, "tasks": ["easyvqa_yesno", "textvqa_val", "mme"],
                        "grid": {"method": ["promprune"], "budget": [8]}})
    lines = generation_plan(spec).splitlines()[1:]
    assert lines[0].startswith("  easyvqa_yesno: max_new_tokens=16,")
    assert lines[1].startswith("  textvqa_val: max_new_tokens=1024,") and "ASSISTANT:" in lines[1]
    assert lines[2].startswith("  mme: max_new_tokens=16,")
    spec.generation = {"max_new_tokens": 3}
    assert all("max_new_tokens=3," in line for line in generation_plan(spec).splitlines()[1:])


def test_preflight_refuses_generation_an_in_llm_trial_cannot_run(tmp_path, monkeypatch):
    """An in-LLM method runs one beam (``PrunedVLM`` refuses num_beams > 1 on every call): a spec whose `generation`,
    or a task whose own generation_kwargs, set num_beams 2 passed --validate-only, then every sample of every in-LLM
    trial failed. Preflight refuses it, naming the field, where it is set and the fix, for the in-LLM trials only; the
    spec's num_beams: 1 over the task's clears it. What it refuses is what the model refuses on those kwargs."""
    from pipelines import preflight
    from promprune.eval import tasks
    from promprune.eval.generation import generate_kwargs
    from PIL import Image
    from promprune.models import PrunedVLM
    from tests.own_task import write_task

    monkeypatch.delenv(tasks.INCLUDE_PATH_ENV, raising=False)
    yaml = write_task(tmp_path / "mine", "own_task_b", questions=["Is it red?"])
    yaml.write_text(yaml.read_text() + "generation_kwargs: {num_beams: 2, max_new_tokens: 4}\n")
    base = {"name": "s", "version": 1, "model": {"pretrained": "tiny:llava"}, "include_path": [str(tmp_path / "mine")],
            "tasks": ["own_task_b"], "grid": {"method": ["fastv", "divprune"], "budget": [8]}}
    rule = ("generation: in-LLM method 'fastv' prunes inside the language model and runs one sequence per prompt: "
            "num_beams must be 1, got {n} (use num_beams=1 and num_return_sequences=1). ")
    assert preflight.preflight(specs.parse(base), store=False) == [
        rule.format(n=2) + "The task's own generation_kwargs (its lmms-eval YAML) set num_beams: set "
        "generation.num_beams in the spec, which overrides a task's, or run these trials with a pre-LLM method "
        "(tasks own_task_b; trial fastv-b8)"]
    assert preflight.preflight(specs.parse({**base, "generation": {"num_beams": 3}}), store=False) == [
        rule.format(n=3) + "The spec's generation.num_beams sets it: change that, or run these trials with a pre-LLM "
        "method (tasks own_task_b; trial fastv-b8)"]
    assert preflight.preflight(specs.parse({**base, "generation": {"num_beams": 1}}), store=False) == []
    # the model: fastv refuses the task's kwargs on every call, divprune answers with them
    kwargs, _ = generate_kwargs(preflight.task_generation(specs.parse(base), "own_task_b"))
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    with pytest.raises(ValueError, match=r"num_beams must be 1, got 2 \(use num_beams=1"):
        PrunedVLM.from_pretrained("tiny:llava", method="fastv", budget=8).generate([image], ["Is it red?"], **kwargs)
    assert PrunedVLM.from_pretrained("tiny:llava", method="divprune", budget=8).generate(
        [image], ["Is it red?"], **kwargs)[0].token_ids


def test_preflight_refuses_generation_it_cannot_read(tmp_path, monkeypatch):
    """A generation value `generate_kwargs` cannot read (the spec's ``num_beams: x``, a task YAML's ``max_new_tokens:
    lots``) passed --validate-only, then failed every sample at run time. Preflight refuses it before any work, one
    paragraph naming the field, where it is set (the spec or the task) and the fix; the spec's own readable value over
    the task's clears it. What it refuses is what ``generate_kwargs`` fails on at run time."""
    from pipelines import preflight
    from promprune.eval import tasks
    from promprune.eval.generation import generate_kwargs
    from tests.own_task import write_task

    monkeypatch.delenv(tasks.INCLUDE_PATH_ENV, raising=False)
    yaml = write_task(tmp_path / "mine", "own_task_r", questions=["Is it red?"])
    yaml.write_text(yaml.read_text() + "generation_kwargs: {max_new_tokens: lots}\n")
    base = {"name": "s", "version": 1, "model": {"pretrained": "tiny:llava"}, "include_path": [str(tmp_path / "mine")],
            "tasks": ["own_task_r", "easyvqa_yesno"], "grid": {"method": ["divprune"], "budget": [8]}}
    assert preflight.preflight(specs.parse(base), store=False) == [
        "generation: max_new_tokens 'lots' cannot be read for generate (ValueError: invalid literal for int() with "
        "base 10: 'lots'), so every sample asking it would fail. The task's own generation_kwargs (its lmms-eval YAML) "
        "set it: set generation.max_new_tokens in the spec to a number (it overrides a task's), or correct the task's "
        "YAML (tasks own_task_r)"]
    beams = specs.parse({**base, "generation": {"num_beams": "x", "max_new_tokens": 4}})
    with pytest.raises(specs.SpecError) as refused:  # what --validate-only runs, before the generation plan
        preflight.check_or_raise(beams, "s.yaml", store=False, spec_only=True)
    assert refused.value.errors == [
        "generation: num_beams 'x' cannot be read for generate (ValueError: invalid literal for int() with base 10: "
        "'x'), so every sample asking it would fail. The spec's generation.num_beams sets it: give it a number (tasks "
        "own_task_r, easyvqa_yesno)"]
    fixed = specs.parse({**base, "generation": {"max_new_tokens": 4}})
    assert preflight.preflight(fixed, store=False) == []
    # the run time's reading of the same kwargs: it fails where preflight refused, and reads the fixed spec's
    for spec in (specs.parse(base), beams):
        with pytest.raises(ValueError, match="invalid literal for int"):
            generate_kwargs(preflight.task_generation(spec, "own_task_r"))
    assert generate_kwargs(preflight.task_generation(fixed, "own_task_r"))[0]["max_new_tokens"] == 4


def test_preflight_reads_a_task_of_ones_own_from_the_specs_include_path(tmp_path, monkeypatch):
    """`preflight.preflight(spec)` called directly (no `plugins.activate`, so no $PROMPRUNE_INCLUDE_PATH): the
    checks that read a task's YAML (its generation_kwargs, its metric_list) and the --validate-only generation plan
    find a task of one's own in the spec's `include_path` (they raised "unknown lmms-eval task(s)"). Its YAML says
    temperature 0, the spec do_sample: true, and tune.metric names a metric it does not report: both are problems. A
    tune.metric on a task that is not found is the tasks' one problem, not a traceback."""
    from pipelines import preflight
    from pipelines.sweep import generation_plan
    from promprune.eval import tasks
    from tests.own_task import write_task

    monkeypatch.delenv(tasks.INCLUDE_PATH_ENV, raising=False)
    yaml = write_task(tmp_path / "mine", "own_task_g", metrics=("hits", "accuracy"),
                      process_results="    return {'hits': 1.0, 'accuracy': 1.0}", questions=["Is it red?"])
    yaml.write_text(yaml.read_text() + "generation_kwargs: {temperature: 0, max_new_tokens: 4}\n")
    text = """
        name: s
        version: 1
        model: {pretrained: "tiny:llava"}
        include_path: [mine]
        tasks: [own_task_g]
        generation: {do_sample: true}
        tune: {metric: own_task_g/hitz}
        grid: {method: [divprune], budget: [8]}
        """
    (tmp_path / "s.yaml").write_text(textwrap.dedent(text))
    spec = specs.load(tmp_path / "s.yaml")
    assert tasks.INCLUDE_PATH_ENV not in os.environ
    assert preflight.preflight(spec, store=False) == [
        "generation: do_sample: true with temperature 0 (lmms-eval's greedy setting; transformers samples only at a "
        "temperature above 0): set generation.temperature above 0 (e.g. 0.7) to sample, or leave do_sample out for "
        "greedy answers (tasks own_task_g)",
        "tune.metric: own_task_g reports no metric 'hitz' (did you mean 'hits'?); valid: accuracy, hits"]
    assert generation_plan(spec).splitlines()[1] == "  own_task_g: max_new_tokens=4, do_sample=True, temperature=0.0"
    (tmp_path / "t.yaml").write_text(textwrap.dedent(text.replace("own_task_g", "own_task_gg")))
    typo = specs.load(tmp_path / "t.yaml")
    (problem,) = preflight.preflight(typo, store=False)
    assert problem.startswith("tasks: unknown lmms-eval task(s) ['own_task_gg'] (did you mean 'own_task_g'")


# ----------------------------------------------------------------------------------------------------------------
# the console when trials go quiet


def test_a_quiet_sweep_says_what_its_workers_do_then_waits_twice_as_long(monkeypatch, capsys):
    """Trials running and silent for QUIET_S: one line from the pool's state; the next after twice the silence; any
    trial event resets the wait; no line while no trial runs."""
    from pipelines.recording import console as sweep_console

    clock = [1000.0]
    monkeypatch.setattr(sweep_console.time, "monotonic", lambda: clock[0])
    states = [{"workers": 2, "up": 1, "granted": 1}, {"workers": 2, "up": 2, "granted": 2},
              {"workers": 0, "up": 0, "granted": 0}]
    con = sweep_console.SweepConsole(3, workers=lambda: states.pop(0))

    def lines_after(seconds: float) -> list[str]:
        clock[0] += seconds
        con.tick()
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("no trial")]

    assert lines_after(500) == []  # nothing runs yet
    con.started("a")
    capsys.readouterr()
    assert lines_after(59) == []
    assert lines_after(1) == ["no trial has reported for 60s (1 running): 1 of 2 model worker(s) up, the rest still "
                              "loading the model (Ray starts its workers at nice 15 unless RAY_worker_niceness says "
                              "otherwise: other busy processes on a node slow them)"]
    assert lines_after(59) == []  # the next at 120 s of silence
    assert lines_after(1) == ["no trial has reported for 120s (1 running): 2 of 2 model worker(s) answering a block"]
    con.advanced("a", 4)  # a block came back: quiet again only after QUIET_S
    assert lines_after(59) == []
    assert lines_after(1) == ["no trial has reported for 60s (1 running): the pool holds no model worker (none asked "
                              "for yet, or none could start)"]
    con.started("b")
    capsys.readouterr()
    assert lines_after(60) == ["no trial has reported for 60s (2 running)"]  # the pool said nothing (no state left)
    con.ended("a")
    con.ended("b")
    assert lines_after(1000) == []


# ----------------------------------------------------------------------------------------------------------------
# the console's summary table


def test_the_summary_table_is_markdown_of_what_the_answers_decide_and_times_below_it():
    from pipelines.recording.console import summary_table

    spec = _spec()
    spec.tasks = ["testbed_exist_concentrated"]
    base = {"trial": {"method": None, "budget": None, "options": {}}, "error": None,
            "metrics": {"testbed_exist_concentrated/f1": 1.0, "rel": 1.0, "efficiency/visual_tokens": 144.0,
                        "efficiency/prefill_ms": 31.234, "samples/failed": 0}}
    ours = {"trial": {"method": "promprune", "budget": 16, "options": {"mu": 0.24193, "tau": 0.03},
                      "mu_source": "calibration"}, "error": None,
            "metrics": {"testbed_exist_concentrated/f1": 0.88501, "rel": 0.84166, "efficiency/visual_tokens": 16.0,
                        "efficiency/prefill_ms": 12.06, "samples/failed": 2}}
    broken = {"trial": {"method": "divprune", "budget": 16, "options": {}}, "error": "boom", "metrics": {}}
    text = summary_table(spec, {"promprune-b16-mu=calibrate-tau=0.03": ours, "baseline": base,
                                "divprune-b16": broken})
    assert text.splitlines() == [
        "| trial | method | budget | testbed_exist_concentrated/f1 | Rel. | visual tokens | failed |",
        "|---|---|---:|---:|---:|---:|---:|",
        "| baseline | none | - | 1.0000 | 1.0000 | 144.0 | 0 |",
        "| divprune-b16 | divprune | 16 | - | - | - | ERROR |",  # trials the spec does not list: by id
        "| promprune-b16-mu=calibrate-tau=0.03 | promprune (mu calibrated: 0.2419) | 16 | 0.8850 | 0.8417 | 16.0 | 2 |",
        "prefill ms per sample (this machine's clock): baseline 31.2, divprune-b16 -, "
        "promprune-b16-mu=calibrate-tau=0.03 12.1",
    ]


def test_a_task_without_its_metric_has_no_headline_rather_than_a_count():
    """A task of one's own whose scores hold only `score`'s counts (its metric never came back) shows no column; one
    that has a metric shows it, never n_samples beside it."""
    from pipelines.recording.console import headline_keys

    counts = {"own/n_samples": 4.0, "own/n_failed": 0.0, "own/accuracy_ci_low": 0.5}
    assert headline_keys(["own"], counts) == []
    assert headline_keys(["own"], {**counts, "own/accuracy": 0.75}) == ["own/accuracy"]


# the console's best (mu, tau) per search, and the parent run's best/*


def _rec(method, budget, options, rel, **trial):
    """A finished trial's record (no predictions: no interval), its id as the spec's."""
    t = {"method": method, "budget": budget, "options": options, "tasks": None, **trial}
    t["trial_id"] = specs.trial_id(method, budget, {**options, **trial.pop("spec_options", {})})
    return t["trial_id"], {"trial": t, "metrics": {"rel": rel}, "scores": {}, "predictions": None, "error": None}


def _search_spec():
    spec = _spec()
    spec.tasks = ["mme", "pope", "gqa"]
    return spec


def test_per_metric_calibrated_mus_are_no_search_on_the_console_or_the_parent():
    """Fig. 4 (sweeps/fig4_entropy_metric.yaml): the spectral trial at its default mu, feature-norm and attention
    entropy each with their own calibrated mu (0.9978, 0.9818: other metrics' scales). No best line and no best/*
    (the console printed "best rel 0.9100 at mu=0.9818" and the parent logged it as the sweep's best)."""
    from pipelines.recording.console import best_line, best_metrics, best_trial

    records = dict([
        _rec(None, None, {}, 1.0),
        _rec("promprune", 64, {"metric": "spectral"}, 0.95),
        _rec("promprune", 64, {"metric": "feature_norm", "mu": 0.9978}, 0.88, mu_source="calibration",
             spec_options={"mu": "calibrate"}),
        _rec("promprune", 64, {"metric": "attention", "mu": 0.9818}, 0.91, mu_source="calibration",
             spec_options={"mu": "calibrate"}),
    ])
    spec = _search_spec()
    assert best_line(spec, records, 400) is None
    assert best_trial(spec, records) is None and best_metrics(best_trial(spec, records)) == {}


def test_two_searches_get_a_best_line_each_and_no_best_metrics_on_the_parent():
    """Two budgets, each searched over mu (and a trial at 64 tokens leaving tau at its default 0.02, a point of the
    same search as tau=0.02 set). By hand: at 64 tokens mu=0.4 (Rel. 0.80 > 0.75), at 128 mu=0.3 (0.90 > 0.85; the
    sweep's overall best, which the old console named alone). Neither is the sweep's best: no best/*."""
    from pipelines.recording.console import best_line, best_metrics, best_trial

    records = dict([
        _rec(None, None, {}, 1.0),
        _rec("promprune", 64, {"mu": 0.3, "tau": 0.02}, 0.75),
        _rec("promprune", 64, {"mu": 0.4}, 0.80),
        _rec("promprune", 128, {"mu": 0.3, "tau": 0.02}, 0.90),
        _rec("promprune", 128, {"mu": 0.4, "tau": 0.02}, 0.85),
    ])
    spec = _search_spec()
    assert best_line(spec, records, 500).splitlines() == [
        # in the spec's trial order; trials it does not list (these), by id
        "best rel 0.9000 at mu=0.3 tau=0.02 (budget=128)",
        "best rel 0.8000 at mu=0.4 tau=default (budget=64); 500 samples generated (all searches)",
    ]
    assert best_trial(spec, records) is None and best_metrics(best_trial(spec, records)) == {}


def test_a_search_per_metric_names_its_metric_and_an_unset_metric_is_the_default():
    """Spectral and attention entropy each searched over two mu; a trial leaving `metric` unset runs spectral (the
    registered default) and is a point of the spectral search. By hand: spectral best mu=0.4 (0.80), attention best
    mu=0.9 (0.90)."""
    from pipelines.recording.console import best_line

    records = dict([
        _rec(None, None, {}, 1.0),
        _rec("promprune", 64, {"metric": "spectral", "mu": 0.3}, 0.70),
        _rec("promprune", 64, {"mu": 0.4}, 0.80),
        _rec("promprune", 64, {"metric": "attention", "mu": 0.8}, 0.67),
        _rec("promprune", 64, {"metric": "attention", "mu": 0.9}, 0.90),
    ])
    assert best_line(_search_spec(), records, 500).splitlines() == [
        "best rel 0.9000 at mu=0.9 tau=default (metric=attention)",
        "best rel 0.8000 at mu=0.4 tau=default (metric=spectral); 500 samples generated (all searches)",
    ]


def test_one_search_beside_other_methods_is_the_parents_best():
    """One search (PromPrune at 64 tokens over mu x tau) beside VisPruner: its best line and best/* as before, the
    best by hand mu=0.3, tau=0.03 (Rel. 0.84); a tie at 0.80 would go to the first trial id."""
    from pipelines.recording.console import best_line, best_metrics, best_trial

    records = dict([
        _rec(None, None, {}, 1.0),
        _rec("promprune", 64, {"mu": 0.2, "tau": 0.01}, 0.80),
        _rec("promprune", 64, {"mu": 0.3, "tau": 0.03}, 0.84),
        _rec("promprune", 64, {"mu": 0.2, "tau": 0.03}, 0.80),
        _rec("vispruner", 64, {}, 0.86),
    ])
    spec = _search_spec()
    assert best_line(spec, records, 300) == "best rel 0.8400 at mu=0.3 tau=0.03; 300 samples generated"
    best = best_trial(spec, records)
    assert best["trial_id"] == "promprune-b64-mu=0.3-tau=0.03"
    assert best_metrics(best) == {"best/rel": 0.84, "best/mu": 0.3, "best/tau": 0.03}


def test_a_failed_trial_says_the_exception_that_ended_it_not_a_cut_of_its_traceback(tmp_path):
    """Tune's error file holds a traceback per failure of the trial (a chained one: the user's exception, then the
    one it caused); the console and the run's tag get the last exception's own lines and the file's path."""
    import traceback
    from types import SimpleNamespace

    from pipelines.recording.callback import error_text

    def user_code():
        raise AttributeError("'KeyError' object has no attribute 'strip'")

    def failure():
        try:
            user_code()
        except AttributeError as exc:
            raise RuntimeError("task 'own': its process_results raised AttributeError\nsecond line") from exc

    try:
        failure()
    except RuntimeError as exc:
        told = "".join(traceback.format_exception(exc))
    path = tmp_path / "error.txt"
    path.write_text(f"Failure # 1 (occurred at now)\n{'x' * 3000}\n{told}")
    assert error_text(SimpleNamespace(error_file=str(path))) == (
        f"RuntimeError: task 'own': its process_results raised AttributeError\nsecond line (traceback: {path})")
    kept = SimpleNamespace(error_file=str(path), path="/storage/sweep/trial_0")  # Tune's own trial directory
    assert error_text(kept).endswith("second line (traceback: /storage/sweep/trial_0/error.txt)")
    path.write_text("The actor died unexpectedly before finishing this task.\n\tclass_name: ImplicitFunc\n")
    assert error_text(SimpleNamespace(error_file=str(path))) == path.read_text()  # no traceback: the file's end


def test_tunes_callback_tag_is_rays_without_importing_wandb():
    """`callbacks_counted_without_integrations` records the usage tag Ray's own `tag_callbacks` records for the
    sweep's callbacks, without Ray's logger integrations (wandb, installed by lmms-eval) imported; a callback list
    that is not all the sweep's goes to Ray's function. A fresh interpreter: this one may have wandb already."""
    import importlib.util
    import subprocess
    import sys
    import textwrap

    probe = textwrap.dedent("""
        import json, sys
        from ray import tune
        from ray.air._internal import usage as air_usage
        from ray._common.usage import usage_lib
        from pipelines.recording.callback import RecorderHook, callbacks_counted_without_integrations
        from pipelines.run.disk import DiskWatch
        ours = [RecorderHook(), DiskWatch("x", [])]
        with callbacks_counted_without_integrations():
            air_usage.tag_callbacks(ours)
        light = dict(usage_lib._recorded_extra_usage_tags)
        wandb_after_light = "wandb" in sys.modules
        usage_lib._recorded_extra_usage_tags.clear()
        air_usage.tag_callbacks(ours)  # Ray's own, which imports the integrations
        print(json.dumps([light, dict(usage_lib._recorded_extra_usage_tags), wandb_after_light,
                          "wandb" in sys.modules, air_usage.tag_callbacks.__module__]))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    light, rays, wandb_light, wandb_rays, restored = json.loads(out.stdout.strip().splitlines()[-1])
    assert light == rays == {"air_callbacks": '{"CustomCallback": 2}'}
    assert not wandb_light and restored == "ray.air._internal.usage"
    assert wandb_rays == (importlib.util.find_spec("wandb") is not None)  # what the light path saves


def test_evaluate_does_first_use_work_before_ray(monkeypatch, tmp_path):
    """`pipelines/evaluate.py` prepares a factory-built model (training tiny-easyvqa:llava on first use) in the
    driver before it connects to Ray, as the sweep does: in a Ray worker the training ran niced, its bar relayed
    a line now and then (~4x slower on a shared machine)."""
    from pipelines import evaluate
    from pipelines.run.ray_connect import RayUnreachable

    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(evaluate, "prepare_model", lambda name: calls.append(("prepare", name)))

    def no_ray(address):
        calls.append(("connect", address))
        raise RayUnreachable("stop here")

    monkeypatch.setattr(evaluate, "connect", no_ray)
    assert evaluate.main(["--method", "promprune", "--budget", "8", "--limit", "2", "--no-mlflow"]) == 2
    assert [c[0] for c in calls] == ["prepare", "connect"] and calls[0][1] == "tiny-easyvqa:llava"
    # an address that cannot answer is refused before that work (a probe: the weights loaded, then the refusal)
    calls.clear()
    assert evaluate.main(["--method", "promprune", "--budget", "8", "--limit", "2", "--no-mlflow",
                          "--address", "127.0.0.1:1"]) == 2
    assert calls == []


def test_evaluate_names_a_task_whose_scoring_fails_in_one_paragraph(monkeypatch, tmp_path, capsys):
    """A task of one's own whose process_results returns a string for a metric lmms-eval's mean aggregates: one
    paragraph naming the task and the metric, exit 2 (was a ~40-line TypeError traceback through lmms-eval's
    metrics.mean, exit 1). The scoring is the real one, over this task's documents; Ray and the model are not."""
    import contextlib

    from pipelines import evaluate
    from promprune.eval import score
    from tests.own_task import write_task

    monkeypatch.chdir(tmp_path)
    write_task(tmp_path / "own", "own_str", metrics=("accuracy", "length"), questions=["q0", "q1"],
               process_results="    return {'accuracy': 1.0, 'length': 'long'}")
    monkeypatch.setattr(evaluate, "prepare_model", lambda name: None)
    monkeypatch.setattr(evaluate, "connect", lambda address: None)
    monkeypatch.setattr(evaluate.trials, "alone", lambda spec: contextlib.nullcontext(None))
    rows = [{"task": "own_str", "doc_id": i, "n_docs": 2, "prediction": "yes"} for i in range(2)]
    monkeypatch.setattr(evaluate.trials, "evaluate",
                        lambda trial, spec, shared: score(rows, include_path=spec.include_path))
    assert evaluate.main(["--include-path", "own", "--tasks", "own_str", "--limit", "2", "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    (message,) = [line for line in err.splitlines() if line.startswith("error: ")]  # beside lmms-eval's bars
    assert message.startswith("error: task 'own_str': the aggregation of metric 'length', lmms-eval's mean, raised "
                              "TypeError: ") and "returned str values for 'length' (e.g. 'long')" in message, err
    assert "Traceback" not in err


def test_two_runs_making_the_experiment_at_once_both_get_it(mlflow_store, monkeypatch):
    """A probe's case: two processes on a new store both looked the experiment up, found none, and created it; one
    raised "already exists" (UNIQUE constraint), after Ray had started. Here the other process's creation lands
    between this one's lookup and its creation: it takes the experiment that is there."""
    c = mlflow_store
    other = tracking.experiment_id(c)  # the other process made it
    real, calls = c.get_experiment_by_name, []

    def stale_then_real(name):  # this process's lookup came before the other's creation
        calls.append(name)
        return None if len(calls) == 1 else real(name)

    monkeypatch.setattr(c, "get_experiment_by_name", stale_then_real)
    assert tracking.experiment_id(c) == other and len(calls) == 2


def test_a_trial_that_reports_it_is_not_retried_gets_no_tune_retry(monkeypatch):
    """Tune 2.60 decides a retry with `Trial.should_recover` (failures so far <= the trial's `max_failures`) before
    any callback hears of the error. A trial about to raise its `ScoringError` reports `SCORING_FAILED` first; the
    driver's callback then gives that trial no retry (its first error ends it), and puts its retries back once the
    error has ended it, so the state Tune saves for a --resume keeps them. Another trial's retries are untouched."""
    from ray.tune.experiment import Trial

    from pipelines.run import trial

    reports = []
    monkeypatch.setattr(trial.tune, "report", lambda metrics, **kw: reports.append(dict(metrics)))
    trial.TrialProgress(4).report_not_retried(trial.SCORING_FAILED)
    searched = trial.TrialProgress(4, objective=search.Objective("rel", ["t/0"], [1]))
    searched.report_not_retried(trial.SCORING_FAILED)  # with the search's metric, as Tune requires of every result
    assert reports[0] == {trial.SCORING_FAILED: 1.0}
    assert set(reports[1]) == {trial.SCORING_FAILED, "rel"} and math.isnan(reports[1]["rel"])

    failing, other = Trial("__fake", stub=True, max_failures=2), Trial("__fake", stub=True, max_failures=2)
    hook = trial.NotRetried()
    hook.on_trial_result(0, [failing, other], other, {"samples/done": 1.0})
    hook.on_trial_result(0, [failing, other], failing, reports[0])
    for t in (failing, other):
        t.run_metadata.num_failures = 1  # the error reached the driver (`Trial.handle_error` counts it)
    assert not failing.should_recover() and other.should_recover()  # the old code retried both
    hook.on_trial_error(0, [failing, other], failing)
    assert failing.max_failures == 2 and other.max_failures == 2

    # the sweep's workers could not load the model (`engine.WorkersFailed`): no retry either
    trial.TrialProgress(4).report_not_retried(trial.WORKERS_FAILED)
    assert reports[2] == {trial.WORKERS_FAILED: 1.0}
    hook.on_trial_result(0, [failing, other], failing, reports[2])
    assert not failing.should_recover() and other.should_recover()
    hook.on_trial_error(0, [failing, other], failing)
    assert failing.max_failures == 2


def test_a_callback_pickled_under_its_old_name_still_unpickles():
    """Reviewer's case: Tune pickles a run's callbacks in its tuner.pkl; renaming `ScoringErrorsNotRetried` to
    `NotRetried` made every run started before the rename unresumable (`check_tune_state`: "tuner.pkl cannot be read
    (AttributeError: Can't get attribute 'ScoringErrorsNotRetried' ...)", its saved blocks thrown away). A pickle
    naming the old class, as those runs wrote it, loads as the callback."""
    import pickle

    from pipelines.run import trial

    data = pickle.dumps(trial.NotRetried(), protocol=0)  # protocol 0: the class named as text, as "module\nname"
    assert b"\nNotRetried\n" in data
    old = data.replace(b"\nNotRetried\n", b"\nScoringErrorsNotRetried\n")
    assert isinstance(pickle.loads(old), trial.NotRetried)


# ----------------------------------------------------------------------------------------------------------------
# a worker's wrappers


def test_a_workers_kept_wrappers_hold_nothing_on_the_device_but_the_one_serving():
    """A worker keeps the wrappers of the trials it served (`WRAPPED_PER_WORKER`); CDPruner's loads CLIP's text tower
    onto the model's device (CLIP-L/14-336's: ~124M parameters, ~0.23 GiB in fp16). Kept there, it sat in the peak
    memory of every later trial the worker served (Table 6's extended grid: DART, PyramidDrop, downsample, random
    after CDPruner; the paper's memory column separates methods by 0.1-0.4 GB). Serving another trial releases it
    (host memory); serving CDPruner again brings it back, with the same selections."""
    import numpy as np
    from PIL import Image

    from promprune.models import PrunedVLM
    from promprune.models.tiny import tiny_vlm

    from pipelines.run.workers import Worker
    from pipelines.spec.trials import Trial

    torch.set_num_threads(1)
    model, processor = tiny_vlm("llava")
    worker = Worker.__new__(Worker)  # no Ray: the state `Worker.__init__` gives it
    worker.source, worker.wrapped = weights.ModelSource(pretrained="tiny:llava"), {}
    worker.base = PrunedVLM(model, processor, method=None)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((56, 40))
    prompt = "What is in the picture?"
    cdpruner = worker._vlm(Trial("cdpruner", 8))
    assert cdpruner.adapter.device_extras() == ["clip_text"]
    kept = cdpruner.generate([image], [prompt], max_new_tokens=1)[0].kept
    divprune = worker._vlm(Trial("divprune", 8))
    divprune.generate([image], [prompt], max_new_tokens=1)
    assert [vlm.adapter.device_extras() for vlm in worker.wrapped.values()] == [[], []]
    tower = cdpruner.adapter.extras()["clip_text"]
    assert {p.device.type for p in tower.text_model.parameters()} == {"cpu"}
    assert worker.base.model is cdpruner.model is divprune.model  # the weights stay shared
    assert worker._vlm(Trial("cdpruner", 8)) is cdpruner
    assert cdpruner.adapter.device_extras() == ["clip_text"] and divprune.adapter.device_extras() == []
    assert cdpruner.generate([image], [prompt], max_new_tokens=1)[0].kept == kept


def test_a_trials_sampled_answers_do_not_depend_on_the_blocks_its_worker_answered_before():
    """Sampled generation (generation: {do_sample: true}) drew from the worker process's torch RNG: a `random` trial's
    block answered first changed a later fastv trial's answers, and two runs of one spec differed. Each sample is now
    seeded from the trial's id (with the spec's generation.seed and the sample's key): the fastv trial's answers
    are the same alone, after another trial's block, and after the process drew anything else; its repeat (r1)
    draws its own. Run functions that take no seed (the tests' stand-ins) are still called as before."""
    import functools
    import io

    import numpy as np
    from PIL import Image

    from promprune.models import PrunedVLM
    from promprune.models.tiny import tiny_vlm
    from promprune.records import Request, to_arrow

    from pipelines.run.requests import seal
    from pipelines.run.workers import Failover, Worker, default_run_requests, takes_seed
    from pipelines.spec.trials import Trial

    torch.set_num_threads(1)
    model, processor = tiny_vlm("llava")
    worker = Worker.__new__(Worker)  # no Ray: the state `Worker.__init__` gives it
    worker.source, worker.wrapped = weights.ModelSource(pretrained="tiny:llava"), {}
    worker.pool = worker.node = None
    worker.base = PrunedVLM(model, processor, method=None)
    worker.batch_size, worker.failover = 2, Failover()
    worker.run_fn, worker.seeds = default_run_requests, True
    rows = []
    for i in range(4):
        buffer = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (56, 40, 3), dtype=np.uint8)).save(buffer, "PNG")
        rows.append(Request(task="t", doc_id=i, n_docs=4, prompt="What is in the picture?", image=buffer.getvalue(),
                            image_key=f"img{i}", gen_kwargs={"max_new_tokens": 4, "do_sample": True,
                                                             "temperature": 30.0}))
    block = seal(to_arrow(rows, Request))

    def answers(trial):
        out = from_arrow(worker.answer(trial, block, "run"), Prediction)
        assert not any(p.error for p in out)
        return [p.prediction for p in out]

    fastv = Trial("fastv", 8)
    alone = answers(fastv)
    answers(Trial("random", 8))  # another trial's sampled block on this worker
    torch.rand(1000)
    assert answers(fastv) == alone
    assert answers(Trial("fastv", 8, repeat=1)) != alone
    assert takes_seed(default_run_requests) and takes_seed(lambda vlm, rows, batch_size, **kw: None)
    assert not takes_seed(functools.partial(lambda vlm, rows, batch_size, *, log: None, log="x"))
    assert not takes_seed(lambda *a: None)


def test_a_search_without_an_unpruned_trial_says_there_is_no_rel():
    """`baseline: false` with a (mu, tau) grid: every trial finished, none has Rel. (no unpruned trial to divide
    by); the console said "no trial varying mu or tau finished with rel", as if the trials had failed."""
    from pipelines.recording.console import best_line

    records = dict(_rec("promprune", 64, {"mu": mu, "tau": 0.02}, None) for mu in (0.3, 0.4))
    for rec in records.values():
        rec["metrics"] = {}
    assert best_line(_search_spec(), records, 200) == (
        "no Rel. to rank the (mu, tau) search by: the sweep has no unpruned trial (baseline: false); its scores are "
        "in the table above; 200 samples generated")


@pytest.mark.parametrize("score_s", [0.5, 6.0])
def test_running_scores_take_at_most_their_share_of_a_trial(monkeypatch, score_s):
    """A running score scores every sample answered so far, so it takes longer as they grow (1 s at 8,000 samples,
    2.4 s at 16,000), and the trial sends no block meanwhile. Every 30 s, its share of the trial grew with the
    samples (quadratic over a trial). Now the next one waits at least 30 s and the last one's duration over
    `SCORE_SHARE`: a block every 5 s of the trial's clock for 2,000 s, each score taking ``score_s`` of it."""
    import pyarrow as pa

    from pipelines.run import trial

    now, scored = [0.0], []

    def score(predictions, partial=False, only=None):  # (lmms-eval's stand-in: a clock that moves while it scores)
        scored.append(now[0])
        now[0] += score_s
        return {"t": {"m": 1.0}}

    monkeypatch.setattr(trial, "score_table", score)
    reports = []
    progress = trial.TrialProgress(10_000, clock=lambda: now[0], report=reports.append)
    tables = [pa.table({"task": ["t"], "doc_id": [0]})]
    for done in range(1, 401):
        now[0] += 5.0
        progress(done, tables)
    assert len(reports) == 400 and sum("t/m" in r for r in reports) == len(scored)
    gaps = [b - a for a, b in zip(scored, scored[1:])]
    assert min(gaps) >= trial.SCORE_EVERY_S  # never more often than every 30 s
    assert len(scored) * score_s <= trial.SCORE_SHARE * now[0] + score_s  # at most its share (one score of slack)
    if score_s < trial.SCORE_EVERY_S * trial.SCORE_SHARE:  # a quick score: every 30-35 s, as before
        assert max(gaps) <= trial.SCORE_EVERY_S + 5.0 + score_s
