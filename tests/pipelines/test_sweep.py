"""End to end on a local Ray: a sweep of the tiny LLaVA on easy-vqa lands in MLflow in the agreed schema, its
predictions equal plain (non-Ray) generation, Rel. is computed against the baseline, and an interrupted sweep
resumes without redoing finished trials."""
from __future__ import annotations

import hashlib
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import ray
import torch
import yaml

from promprune.records import Prediction, table_keys

from pipelines import spec as specs
from pipelines import mlflow_layout, sweep
from pipelines.recording import tracking
from pipelines.run import search
from pipelines.run.ray_connect import init_local
from pipelines.recording.console import SweepConsole
from pipelines.recording.recorder import SweepRecorder
from pipelines.run.requests import build_rows
from pipelines.run.result import PREDICTION_SCHEMA, TrialResult, predictions_table
from tests.pipelines.sweep_cli import GATED, read_until, spawn_sweep

LIMIT = 2  # samples per task: enough to shard over batches, small enough for 2 cores

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    init_local(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def workdir(tmp_path, monkeypatch, mlflow_db):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return tmp_path


def small_spec(**overrides) -> specs.SweepSpec:
    raw = {"name": "e2e", "version": 2, "model": {"pretrained": "tiny:llava"},
           "tasks": ["easyvqa_yesno", "easyvqa_open"], "limit": LIMIT, "baseline": True,
           "grid": {"method": ["promprune", "divprune"], "budget": [8]},
           "generation": {"max_new_tokens": 3}, "resources": {"batch_size": 1}}
    raw.update(overrides)
    return specs.parse(raw)


def on_cpu(spec: specs.SweepSpec) -> dict[str, str]:
    """The model params of ``spec``'s workers on the CPU (what `sweep` hands its `SweepRecorder` there)."""
    return tracking.model_params(spec, on_gpu=False)


def test_sweep_lands_in_mlflow_and_matches_plain_generation(local_ray, workdir):
    spec = small_spec()
    outcome = sweep.run_sweep(spec)
    assert outcome.failed == []

    c = tracking.client()
    parent = c.get_run(outcome.parent_run_id)
    assert c.get_experiment(parent.info.experiment_id).tags[mlflow_layout.EXPERIMENT_KIND] == "custom_model_development"
    assert parent.info.run_name == "e2e" and parent.info.status == "FINISHED"
    assert {k: parent.data.tags[k] for k in (mlflow_layout.ROLE, mlflow_layout.SWEEP, mlflow_layout.VERSION)} == \
        {mlflow_layout.ROLE: "sweep", mlflow_layout.SWEEP: "e2e", mlflow_layout.VERSION: "2"}
    # what the nightly regression check matches: the resolved spec's hash, as the run's state keeps it for --resume
    assert parent.data.tags[mlflow_layout.SPEC_FINGERPRINT] == hashlib.sha256(specs.dump_resolved(spec).encode()) \
        .hexdigest()
    spec_yaml = Path(c.download_artifacts(outcome.parent_run_id, "spec.yaml", str(workdir)))
    assert yaml.safe_load(spec_yaml.read_text()) == yaml.safe_load(specs.dump_resolved(spec))

    # what the workers ran: `dtype: auto` on this CPU-only machine is float32, transformers' default attention sdpa
    model = {"dtype": "float32", "attn_implementation": "sdpa", "model_options": "{}"}
    assert {k: parent.data.params[k] for k in model} == model

    children = tracking.trial_runs(c, outcome.parent_run_id)
    assert sorted(children) == ["baseline", "divprune-b8", "promprune-b8"]
    checkpoints = {p.read_bytes() for p in Path(outcome.experiment_path).rglob(mlflow_layout.PREDICTIONS_ARTIFACT)}
    rows = build_rows(spec.tasks, LIMIT, spec.generation)
    for tid, run in children.items():
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        assert tags[mlflow_layout.ROLE] == "trial" and tags[mlflow_layout.SWEEP] == "e2e"
        assert tags[mlflow_layout.TRIAL] == tid
        assert params["model"] == "tiny:llava" and params["tasks"] == "easyvqa_yesno,easyvqa_open"
        assert {k: params[k] for k in model} == model, tid  # as on the parent: a trial run says what it ran in
        method = None if tid == "baseline" else params["method"]
        assert params["method"] == (method or "none") and params["budget"] == ("none" if method is None else "8")
        assert metrics["samples/total"] == 2 * LIMIT and metrics["samples/failed"] == 0
        for key in ("easyvqa_yesno/accuracy", "easyvqa_yesno/f1", "easyvqa_open/exact_match",
                    "efficiency/prefill_tflops", "efficiency/kv_cache_mb", "efficiency/prefill_ms",
                    "efficiency/peak_mem_gb", "efficiency/visual_tokens", "t_sal/mean", "t_sal/median",
                    "efficiency/vision_ms", "efficiency/select_ms", "efficiency/llm_prefill_ms"):
            assert key in metrics, (tid, key)
        assert metrics["efficiency/visual_tokens"] == (36 if method is None else 8)  # tiny LLaVA: 6x6 grid
        # the run opens when Tune starts the trial (before the trial's own clock starts) and ends at the trial's
        # own end (not the moment the driver logged it)
        span = (run.info.end_time - run.info.start_time) / 1000
        assert metrics["trial/wall_s"] - 0.01 <= span <= metrics["trial/wall_s"] + 10, (tid, span)
        assert "trial/started_at" not in metrics and tags[mlflow_layout.STARTED_AT] < tags[mlflow_layout.FINISHED_AT]
        assert ("entropy/mean" in metrics) == (method == "promprune")  # only PromPrune measures prominence

        artifact = Path(c.download_artifacts(run.info.run_id, "predictions.parquet", str(workdir)))
        # the trial's checkpoint file, uploaded as it is: the same bytes, the whole TrialResult
        assert artifact.read_bytes() in checkpoints
        logged = TrialResult.read(artifact)
        assert logged.metrics["samples/total"] == metrics["samples/total"] and set(logged.scores) == set(spec.tasks)
        frame = pd.read_parquet(artifact)
        assert len(frame) == 2 * LIMIT and not frame.duplicated(["task", "doc_id"]).any()
        assert list(frame.columns) == PREDICTION_SCHEMA.names  # the records' schema, declared once
        assert pq.read_schema(c.download_artifacts(run.info.run_id, "predictions.parquet", str(workdir))) \
            .remove_metadata() == PREDICTION_SCHEMA
        total = (frame["vision_ms"] + frame["select_ms"] + frame["prefill_ms"]).mean()  # Table 6's prefill
        assert metrics["efficiency/prefill_ms"] == pytest.approx(total)
        _check_against_plain_generation(frame, rows, method)
        _check_kv_cache_by_hand(metrics, method)


def _check_against_plain_generation(frame: pd.DataFrame, rows: list, method: str | None) -> None:
    """Independent path: the same PrunedVLM in this process, no Ray, no object-store weights."""
    from promprune.eval import run_requests
    from promprune.models import PrunedVLM

    torch.set_num_threads(1)
    vlm = PrunedVLM.from_pretrained("tiny:llava", method=method, budget=None if method is None else 8,
                                    dtype="float32")
    plain = {(p.task, p.doc_id): p for p in run_requests(vlm, rows, batch_size=1)}
    for rec in frame.to_dict("records"):
        ref = plain[(rec["task"], rec["doc_id"])]
        assert rec["prediction"] == ref.prediction
        assert list(rec["kept"]) == list(ref.kept)


def _check_kv_cache_by_hand(metrics: dict, method: str | None) -> None:
    """KV cache of the visual tokens: 2 (K and V) x layers x kv heads x head dim x 4 bytes (fp32) per token."""
    from promprune.models.tiny import tiny_vlm

    cfg = tiny_vlm("llava")[0].config.text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    tokens = 36 if method is None else 8
    assert metrics["efficiency/kv_cache_mb"] == pytest.approx(per_token * tokens / 2 ** 20)


def test_rel_is_logged_against_the_baseline(workdir, tmp_path):
    """Rel. = mean over tasks of score / baseline score (pope F1 0.6 / 0.8 and MME (600+200) / (800+200))."""
    from ray import tune

    spec = small_spec(tasks=["pope", "mme"])
    c = tracking.client()
    parent = tracking.start_sweep(c, spec.name, spec.version, "name: e2e\n", {})
    recorder = SweepRecorder(spec, parent, SweepConsole(2), model_params=on_cpu(spec))

    def checkpoint(name: str, scores: dict):
        d = tmp_path / name
        d.mkdir()
        table = predictions_table([Prediction(task="pope", doc_id=0, n_docs=1, prompt="q?", prediction="yes")])
        metrics = {"pope/pope_f1_score": scores["pope"]["pope_f1_score"]}
        TrialResult(table, scores, metrics).write(d / "predictions.parquet")
        return tune.Checkpoint.from_directory(str(d))

    pruned = specs.Trial("promprune", 8, {}).to_dict()
    base = specs.Trial(None, None, {}).to_dict()
    recorder.record(pruned, checkpoint("p", {
        "pope": {"pope_f1_score": 0.6}, "mme": {"mme_perception_score": 600.0, "mme_cognition_score": 200.0}}))
    recorder.record(base, checkpoint("b", {
        "pope": {"pope_f1_score": 0.8}, "mme": {"mme_perception_score": 800.0, "mme_cognition_score": 200.0}}))
    recorder.finalize_rel()  # the pruned trial finished before the baseline
    assert recorder.unlogged(60) == []
    recorder.close()
    runs = tracking.trial_runs(c, parent)
    assert runs["promprune-b8"].data.metrics["rel"] == pytest.approx((0.6 / 0.8 + 600 / 800) / 2)  # MME: perception
    assert runs["baseline"].data.metrics["rel"] == pytest.approx(1.0)


def test_a_resume_writes_no_final_metric_a_run_already_has(workdir, tmp_path):
    """A probe's case: a driver killed after a trial's final metrics reached MLflow but before its run ended left it
    RUNNING, and `--resume` logged every final metric again (the outbox stamps each write when made, so MLflow's
    dedupe of an identical (key, timestamp, step, value) never applied): two values in each history. Now each final
    metric, and the parent's counts, stay one value; a value that changed is written."""
    from ray import tune

    spec = small_spec(tasks=["pope"])
    c = tracking.client()
    parent = tracking.start_sweep(c, spec.name, spec.version, "name: e2e\n", {})
    d = tmp_path / "p"
    d.mkdir()
    table = predictions_table([Prediction(task="pope", doc_id=0, n_docs=1, prompt="q?", prediction="yes")])
    TrialResult(table, {"pope": {"pope_f1_score": 0.6}}, {"pope/pope_f1_score": 0.6, "samples/total": 1.0}).write(
        d / "predictions.parquet")
    pruned = specs.Trial("promprune", 8, {}).to_dict()
    first = SweepRecorder(spec, parent, SweepConsole(2), model_params=on_cpu(spec))
    first.record(pruned, tune.Checkpoint.from_directory(str(d)))
    first.parent(metrics={"trials/total": 1, "trials/failed": 0})
    assert first.unlogged(60) == []
    first.close()
    run_id = tracking.trial_runs(c, parent)["promprune-b8"].info.run_id
    c.update_run(run_id, status="RUNNING")  # its metrics in, its end not: the driver died in between
    keys = [k for k in c.get_run(run_id).data.metrics]
    assert "pope/pope_f1_score" in keys and "samples/total" in keys

    again = SweepRecorder(spec, parent, SweepConsole(2), model_params=on_cpu(spec))  # the resumed driver's
    again.record(pruned, tune.Checkpoint.from_directory(str(d)))
    again.parent(metrics={"trials/total": 1, "trials/failed": 0, "trials/stopped": 0})
    again.parent(metrics={"trials/total": 2})  # a changed value is written
    assert again.unlogged(60) == []
    again.close()
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {k: len(c.get_metric_history(run_id, k)) for k in keys} == {k: 1 for k in keys}
    assert [m.value for m in c.get_metric_history(parent, "trials/total")] == [1.0, 2.0]
    assert len(c.get_metric_history(parent, "trials/failed")) == 1
    assert len(c.get_metric_history(parent, "trials/stopped")) == 1


def test_a_stopped_sweep_ends_its_open_trial_runs_killed_and_a_resume_opens_them_clean(workdir):
    """Ctrl-C, SIGTERM or a full disk ended the parent run KILLED and left the trial in flight RUNNING for ever (no
    later start marks it: only a dead driver's parent is looked at); a failed attempt's error tag stayed on the run
    a resume then finished. Read back from the MLflow store, as the UI shows them."""
    spec = small_spec()
    c = tracking.client()
    parent = tracking.start_sweep(c, spec.name, spec.version, "name: e2e\n", {})
    recorder = SweepRecorder(spec, parent, SweepConsole(3), model_params=on_cpu(spec))
    done, open_, failed = (specs.Trial(m, 8, {}).to_dict() for m in ("divprune", "promprune", "vispruner"))
    for trial in (done, open_, failed):
        recorder.started(trial)
    recorder._end(done["trial_id"], "FINISHED")
    recorder.record_error(failed, "RuntimeError: lost a GPU")
    recorder.end_interrupted("python pipelines/sweep.py --resume e2e-1")
    assert recorder.unlogged(60) == []
    recorder.close()
    runs = tracking.latest_trial_runs(c, parent)
    assert {tid: r.info.status for tid, r in runs.items()} == {
        "divprune-b8": "FINISHED", "promprune-b8": "KILLED", "vispruner-b8": "FAILED"}
    assert runs["promprune-b8"].data.tags[mlflow_layout.INTERRUPTED] == \
        "the sweep stopped before its end; resume with: python pipelines/sweep.py --resume e2e-1"
    assert c.get_run(parent).info.status == "KILLED" and mlflow_layout.INTERRUPTED in c.get_run(parent).data.tags

    tracking.reopen(c, parent)  # the resume
    again = SweepRecorder(spec, parent, SweepConsole(3), model_params=on_cpu(spec))
    for trial in (open_, failed):
        again.started(trial)
    assert again.unlogged(60) == []
    again.close()
    runs = tracking.latest_trial_runs(c, parent)
    assert runs["promprune-b8"].info.status == runs["vispruner-b8"].info.status == "RUNNING"
    assert mlflow_layout.INTERRUPTED not in runs["promprune-b8"].data.tags
    assert mlflow_layout.ERROR not in runs["vispruner-b8"].data.tags


def test_every_trial_run_records_the_model_params_of_its_parent_also_after_a_resume(workdir):
    """The parent run recorded the resolved dtype, attention and adapter options, its trial runs did not: filtering
    trials in the UI, or comparing trials of two sweeps, could not tell what they ran in. Now each trial run has the
    parent's values: a run opened by the first driver, one a resumed driver creates, and one an earlier driver made
    before trial runs carried them (marked KILLED by `mark_dead_runs`), which the resumed driver gives them."""
    spec = small_spec(model={"pretrained": "tiny:llava", "dtype": "float16", "attn_implementation": "eager",
                             "options": {"image_tokens": 16, "pad_to_square": True}})
    model = {"dtype": "float16", "attn_implementation": "eager",
             "model_options": '{"image_tokens": 16, "pad_to_square": true}'}
    assert tracking.model_params(spec, on_gpu=True) == model  # a dtype given is the same on CPU and GPU
    c = tracking.client()
    parent = tracking.start_sweep(c, spec.name, spec.version, "name: e2e\n", {"model": "tiny:llava", **model})
    first, later, old = (specs.Trial(m, 8, {}).to_dict() for m in ("divprune", "promprune", "vispruner"))
    old_params = tracking.trial_params(spec.model.pretrained, old, spec.tasks, {})  # as logged before the change
    tracking.log_trial(c, parent, spec.name, spec.version, old, old_params, {}, None, status="KILLED")
    recorder = SweepRecorder(spec, parent, SweepConsole(3), model_params=tracking.model_params(spec, on_gpu=True))
    recorder.started(first)
    recorder.end_interrupted("python pipelines/sweep.py --resume e2e-1")
    assert recorder.unlogged(60) == []
    recorder.close()

    tracking.reopen(c, parent)  # the resume
    again = SweepRecorder(spec, parent, SweepConsole(3), model_params=tracking.model_params(spec, on_gpu=True))
    for trial in (first, later, old):
        again.started(trial)
    assert again.unlogged(60) == []
    again.close()
    runs = tracking.latest_trial_runs(c, parent)
    assert sorted(runs) == ["divprune-b8", "promprune-b8", "vispruner-b8"]
    assert {k: c.get_run(parent).data.params[k] for k in model} == model
    for tid, run in runs.items():
        assert {k: run.data.params.get(k) for k in model} == model, tid
        assert run.data.params["method"] == tid.split("-")[0] and "image_tokens" not in run.data.params


def test_sigterm_stops_the_sweep_as_ctrl_c_does(tmp_path):
    """SIGTERM (`ray job stop`, a scheduler's preemption) ended the driver in Ray's own handler: an abort (exit 134),
    no resume line, and the trial in flight RUNNING in MLflow for ever. Now: exit 130, the resume command, the parent
    and that trial's run KILLED and tagged with it. The command repeats the nightly's --regression-threshold (it had
    dropped it: the resumed night ran unchecked)."""
    gate = tmp_path / "gate"  # never opened: the trial stays in flight
    (tmp_path / "gated.py").write_text(textwrap.dedent(GATED.format(gate=str(gate))))
    spec_path = tmp_path / "term.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "term", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 2, "plugins": ["gated.py"], "baseline": False, "grid": {"method": ["gated"], "budget": [8]},
        "generation": {"max_new_tokens": 2}}))
    proc = spawn_sweep(spec_path, tmp_path, "--regression-threshold", "0.02")
    head = read_until(proc, "[start] gated-b8", timeout=300)
    time.sleep(2)  # its block at the gate
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=180)
    assert proc.returncode == sweep.EXIT_INTERRUPTED, head + rest
    assert "finish it with:" in rest and "--regression-threshold 0.02 --resume term-" in rest, rest
    assert "Traceback" not in rest, rest

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (parent,) = c.search_runs([c.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT).experiment_id],
                              filter_string="tags.`promprune.role` = 'sweep'")
    run = tracking.latest_trial_runs(c, parent.info.run_id)["gated-b8"]
    assert parent.info.status == run.info.status == "KILLED"
    assert "--regression-threshold 0.02 --resume term-" in run.data.tags[mlflow_layout.INTERRUPTED]


# a plugin (the spec's `plugins`, imported by the driver as it checks the spec) that holds the driver in the summary:
# once the sweep's last experiment has returned from Tune, `paired_lines` (the paired bootstrap, the summary's first
# step on the driver) writes {mark} and waits {hold_s} s before it runs
HELD = """
import os, sys, threading, time

sweep = sys.modules.get("pipelines.sweep")
if (sweep is not None and os.path.basename(sys.argv[0]) == "sweep.py"  # the driver, not a Ray worker
        and threading.current_thread() is threading.main_thread() and not hasattr(sweep, "_held")):
    sweep._held = paired = sweep.paired_lines

    def held(spec, records):
        open({mark!r}, "w").close()
        deadline = time.time() + {hold_s}
        while time.time() < deadline:
            time.sleep(0.1)
        return paired(spec, records)

    sweep.paired_lines = held
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_in_the_summary_after_the_last_trial_stops_the_sweep(tmp_path, sig):
    """A review's case: Tune's SIGINT handler (wrapped by `StopMarker`) stayed installed once ``tuner.fit()`` had
    returned, so a Ctrl-C (or SIGTERM, which runs SIGINT's handler) in the summary, the report or the paired
    bootstrap after the last trial was only marked, where nothing looked any more: the sweep went on and ended
    FINISHED, exit 0. Now the handlers from before Tune are back once fit() returns: the signal stops the sweep at
    once, exit 130 with the command that resumes it, no traceback, the parent run KILLED and tagged with that
    command, the finished trial's run kept FINISHED. The driver is held in the summary by a plugin (`HELD`), and the
    signal sent once it is there."""
    mark = tmp_path / "in-summary"
    (tmp_path / "held.py").write_text(HELD.format(mark=str(mark), hold_s=600))
    spec_path = tmp_path / "held.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "held", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 2, "plugins": ["held.py"], "baseline": False, "grid": {"method": ["random"], "budget": [8]},
        "generation": {"max_new_tokens": 2}}))
    proc = spawn_sweep(spec_path, tmp_path)
    deadline = time.time() + 300
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    if not mark.exists():
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the sweep never reached its summary:\n{out[-3000:]}")
    proc.send_signal(sig)
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # the signal was only marked: the driver (and its Ray) would outlive the test
            proc.kill()
            proc.communicate()
    assert proc.returncode == sweep.EXIT_INTERRUPTED, out[-3000:]
    assert time.monotonic() - started < 120, out[-3000:]  # at once, not once the 600 s hold is over
    assert "interrupted; finish it with:" in out and "--resume held-" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (parent,) = c.search_runs([c.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT).experiment_id],
                              filter_string="tags.`promprune.role` = 'sweep'")
    assert parent.info.status == "KILLED"  # as a sweep stopped while its trials ran
    assert "--resume held-" in parent.data.tags[mlflow_layout.INTERRUPTED]
    runs = tracking.latest_trial_runs(c, parent.info.run_id)
    assert sorted(runs) == ["random-b8"] and runs["random-b8"].info.status == "FINISHED"  # what is recorded kept
    assert mlflow_layout.INTERRUPTED not in runs["random-b8"].data.tags


def test_tune_handlers_end_with_the_experiment():
    """`handlers_kept` gives SIGINT, SIGTERM and SIGUSR1 back the handlers they had before the block (Tune's fit sets
    its own SIGINT and SIGUSR1 handlers, `StopMarker` wraps the first), whether the block returns or raises."""
    def ours(signum, frame):
        pass

    def tunes(signum, frame):
        pass

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    previous = {s: signal.getsignal(s) for s in signals}
    try:
        for s in signals:
            signal.signal(s, ours)
        with sweep.handlers_kept():
            for s in signals:
                signal.signal(s, tunes)
        assert {s: signal.getsignal(s) for s in signals} == {s: ours for s in signals}
        with pytest.raises(KeyboardInterrupt), sweep.handlers_kept():
            signal.signal(signal.SIGINT, tunes)
            raise KeyboardInterrupt
        assert signal.getsignal(signal.SIGINT) is ours
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_the_spec_is_checked_stops_with_exit_130_and_no_traceback(tmp_path, sig):
    """A probe's case: Ctrl-C while the spec was checked (seconds on a busy machine: the plugins imported, the
    preflight) gave a KeyboardInterrupt traceback and exit 1, which the documented codes read as "a trial failed";
    a SIGTERM there killed the driver (exit -15). Both now say the sweep did not start, exit 130. The spec's
    plugin sleeps at its import: the signal lands inside the spec check."""
    (tmp_path / "slow.py").write_text("import sys, time\nprint('plugin importing', flush=True)\ntime.sleep(60)\n")
    spec_path = tmp_path / "slow.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "slow", "version": 1, "model": {"pretrained": "tiny:llava"},
                                         "tasks": ["easyvqa_yesno"], "limit": 2, "plugins": ["slow.py"],
                                         "grid": {"method": ["random"], "budget": [8]}}))
    proc = spawn_sweep(spec_path, tmp_path)
    head = read_until(proc, "plugin importing", timeout=120)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == sweep.EXIT_INTERRUPTED, head + rest
    assert sweep.NOT_STARTED in rest and "Traceback" not in rest, rest
    assert not (tmp_path / "mlflow.db").exists()  # nothing started: no store made


def test_a_sigterm_landing_inside_an_import_ends_the_startup_wait():
    """A driver SIGTERMed while Ray started hung for ever (a probe: 2 of ~30 tries): the handler's exception, raised
    inside importlib's module-lock bookkeeping, was swallowed and left the lock held, so the MLflow store's thread,
    importing meanwhile, never ended and the driver waited on it. There the handler now only marks the signal, and
    the wait turns the mark into the interruption (exit 130 with its resume line)."""
    import threading
    from types import SimpleNamespace

    previous, interrupt = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's own (an earlier test may have left Tune's)
    stuck = threading.Event()
    store = threading.Thread(target=stuck.wait, daemon=True)  # an importer waiting on a lock nobody frees
    store.start()
    try:
        sweep._TERMINATED.clear()
        sweep.stop_on_sigterm()
        handler = signal.getsignal(signal.SIGTERM)
        in_import = SimpleNamespace(f_code=SimpleNamespace(co_filename="<frozen importlib._bootstrap>"))
        assert handler(signal.SIGTERM, in_import) is None and sweep._TERMINATED.is_set()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            sweep.wait_interruptibly(store)
        assert time.monotonic() - started < 5
        with pytest.raises(KeyboardInterrupt):  # anywhere else: the interruption at once, as before
            handler(signal.SIGTERM, None)
    finally:
        stuck.set()
        sweep._TERMINATED.clear()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, interrupt)


def test_ray_init_leaves_our_sigterm_handler_in_place():
    """ray.init sets its own SIGTERM handler (sys.exit: exit 15 and no resume line, or the hang above) through
    ``ray._private.utils.set_sigterm_handler``, which the sweep's start suspends meanwhile."""
    import inspect

    from ray._private import utils as ray_utils
    from ray._private import worker

    assert "ray._private.utils.set_sigterm_handler(" in inspect.getsource(worker.init)  # Ray's own call, this Ray
    previous = signal.getsignal(signal.SIGTERM)

    def ours(signum, frame):
        pass

    signal.signal(signal.SIGTERM, ours)
    try:
        with sweep.keeping_our_sigterm():
            ray_utils.set_sigterm_handler(lambda signum, frame: None)
        assert signal.getsignal(signal.SIGTERM) is ours
        ray_utils.set_sigterm_handler(signal.SIG_DFL)  # restored: Ray's function again
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


class SignalledAsTheFirstExperimentEnds(sweep.StopMarker):
    """`StopMarker`, and the signal ``sig`` sent for real to this process as the sweep's first Tune experiment ends
    (``on_experiment_end``: its trials all finished, inside ``tuner.fit()``, Tune's handler still holding SIGINT)."""

    sig = None
    ended: list = []

    def on_experiment_end(self, trials, **info):
        type(self).ended.append(sorted(search.trial_of(t.config).trial_id for t in trials))
        if len(type(self).ended) == 1:
            os.kill(os.getpid(), type(self).sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_after_the_fixed_trials_ends_the_sweep_before_its_search(local_ray, workdir, monkeypatch, sig):
    """A probe's case: a search of two Tune experiments (the baseline's, then the search's: here ASHA's) stopped by
    Ctrl-C or SIGTERM right after the baseline finished. Tune logged "Stop signal received ... ending Ray Tune run",
    its fit returned as after a finished run, and the sweep started its search anyway (the signal lost). Now it
    ends as a stop does: SweepInterrupted (exit 130 in `main`) with the command that resumes it, before the search
    ran any trial. The signal is sent for real, to this process, as the baseline's experiment ends inside Tune (a
    signal after its fit returned is a KeyboardInterrupt at once:
    `test_a_signal_in_the_summary_after_the_last_trial_stops_the_sweep`)."""
    spec = small_spec(grid={"method": ["promprune"], "budget": [8]},
                      tune={"search": "random", "num_samples": 1, "scheduler": "asha", "grace_period": 1})
    reconcile, phases = sweep._reconcile, []

    def seen(recorder, grid, trials, searched=None):
        phases.append([t.trial_id for t in trials])
        return reconcile(recorder, grid, trials, searched)

    monkeypatch.setattr(sweep, "_reconcile", seen)
    monkeypatch.setattr(SignalledAsTheFirstExperimentEnds, "sig", sig)
    monkeypatch.setattr(SignalledAsTheFirstExperimentEnds, "ended", [])
    monkeypatch.setattr(sweep, "StopMarker", SignalledAsTheFirstExperimentEnds)
    previous, interrupt = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    sweep.stop_on_sigterm()  # as `main` installs it
    try:
        with pytest.raises(sweep.SweepInterrupted) as stopped:
            sweep.run_sweep(spec)
    finally:
        sweep._TERMINATED.clear()
        sweep._INTERRUPTED.clear()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, interrupt)
    assert SignalledAsTheFirstExperimentEnds.ended == [["baseline"]]  # the signal came as the baseline's ended
    assert phases == [["baseline"]]  # the search's experiment never started
    assert "-search started" in str(stopped.value) and "--resume e2e-" in stopped.value.resume


@pytest.mark.long  # the long tier (pyproject's markers): resumes run in CI (test_engine's
# killed driver, tests/reliability/test_resume.py's)
def test_interrupted_sweep_resumes_without_redoing_finished_trials(tmp_path):
    """Ctrl-C once the baseline is logged, while a trial is held at a gate (with warm workers a tiny sweep would
    otherwise finish before the signal lands); `--resume` runs what was unfinished, not the baseline."""
    gate = tmp_path / "gate"
    (tmp_path / "gated.py").write_text(textwrap.dedent(GATED.format(gate=str(gate))))
    spec_path = tmp_path / "resume.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "resume", "version": 1, "model": {"pretrained": "tiny:llava"}, "tasks": ["easyvqa_yesno"],
        "limit": 2, "plugins": ["gated.py"], "grid": {"method": ["promprune", "gated"], "budget": [8]},
        "generation": {"max_new_tokens": 2}}))
    first = spawn_sweep(spec_path, tmp_path)
    head = read_until(first, re.compile(r"\[\d+/\d+\] baseline: "), timeout=300)  # the baseline finished, logged
    first.send_signal(signal.SIGINT)  # Ctrl-C: Tune saves its state and stops
    rest, _ = first.communicate(timeout=180)
    assert first.returncode == sweep.EXIT_INTERRUPTED, head + rest
    assert "--resume" in rest

    gate.touch()
    second = spawn_sweep(spec_path, tmp_path, "--resume")
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out[-3000:]
    assert "resuming" in out and "[start] baseline" not in out  # the finished trial was not run again
    assert "[start] gated-b8" in out or "[resume] gated-b8" in out  # (it may have saved blocks before)

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parents = c.search_runs([c.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT).experiment_id],
                            filter_string="tags.`promprune.role` = 'sweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # the same parent run continued
    assert f"viewStateShareKey=promprune-resume-{parents[0].info.run_id}" in out  # its own view (the resume saved it)
    children = c.search_runs([parents[0].info.experiment_id],
                             filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    ids = sorted(r.data.tags[mlflow_layout.TRIAL] for r in children)
    assert ids == ["baseline", "gated-b8", "promprune-b8"]  # each trial logged exactly once


def flaky_run(vlm, rows, batch_size, *, marker: str, times: int):
    """Fails the first ``times`` calls (an out-of-memory error, a lost GPU), then behaves."""
    from promprune.eval import run_requests

    path = Path(marker)
    failed = int(path.read_text()) if path.exists() else 0
    if failed < times:
        path.write_text(str(failed + 1))
        raise RuntimeError(f"injected failure {failed + 1}")
    return run_requests(vlm, rows, batch_size=batch_size)


def test_a_failing_block_is_retried_then_recorded(local_ray, workdir):
    """A block whose whole call raises is tried again (resources.block_attempts); one that keeps raising becomes
    failed samples carrying the error, and the trial finishes: never a crashed sweep, never a dropped sample."""
    import functools

    marker = workdir / "attempts"
    spec = small_spec(baseline=False, grid={"method": ["divprune"], "budget": [4]}, tasks=["easyvqa_yesno"],
                      resources={"batch_size": LIMIT, "block_attempts": 2})
    outcome = sweep.run_sweep(spec, run_fn=functools.partial(flaky_run, marker=str(marker), times=1))
    assert marker.read_text() == "1"  # the first attempt did fail
    frame = outcome.records["divprune-b4"]["predictions"].to_pandas()
    assert outcome.failed == [] and len(frame) == LIMIT and frame["error"].isna().all()

    marker.unlink()
    always = specs.parse({**yaml.safe_load(specs.dump_resolved(spec)), "name": "always"})
    outcome = sweep.run_sweep(always, run_fn=functools.partial(flaky_run, marker=str(marker), times=10))
    assert marker.read_text() == "2"  # block_attempts tries, no more
    assert outcome.failed == []  # the trial finished ...
    frame = outcome.records["divprune-b4"]["predictions"].to_pandas()
    assert len(frame) == LIMIT  # ... with every sample, each failed with the error that failed it
    assert frame["error"].str.contains("2 time\\(s\\): RuntimeError: injected failure 2").all()
    run = tracking.trial_runs(tracking.client(), outcome.parent_run_id)["divprune-b4"]
    assert run.data.metrics["samples/failed"] == LIMIT


@pytest.mark.long  # the long tier (pyproject's markers): shards' builds are pinned without Ray
# (tests/eval/test_hub_standins.py::test_shards_build_the_same_requests)
def test_requests_built_in_shards_equal_the_driver_build(local_ray):
    """Large benchmarks build their rows in parallel Ray tasks; the result must be exactly the plain build."""
    import dataclasses


    from promprune.eval import build_requests
    from promprune.eval.requests import share_images
    from promprune.records import Request, from_arrow

    from pipelines.run.trial import alone, predict
    from pipelines.run.requests import Requests, build_requests_dataset, unseal
    from pipelines.config import Resources
    from pipelines.weights import ModelSource

    tasks, gen = ["easyvqa_yesno", "easyvqa_open"], {"max_new_tokens": 2}
    plain = {r.key: dataclasses.replace(r, gen_kwargs={**r.gen_kwargs, **gen}) for r in build_requests(tasks, limit=3)}
    sharded = build_requests_dataset(tasks, 3, gen, batch_size=2, shards=3)
    assert isinstance(sharded, Requests) and sorted(sharded.keys) == sorted(plain)
    blocks = [b for env in ray.get(sharded.blocks) for _, b in unseal(env)]
    built = {r.key: r for b in blocks for r in share_images(from_arrow(b, Request))}
    assert built == plain  # same prompts, same image bytes and keys, same doc ids and n_docs

    spec = specs.SweepSpec(name="shards", version=1, model=ModelSource("tiny:llava"), resources=Resources(batch_size=2))
    with alone(spec, sharded) as shared:
        preds = predict(specs.Trial("divprune", 4), shared)
    assert table_keys(preds) == sorted(plain, key=lambda k: (plain[k].task, plain[k].doc_id))  # once each, sorted


def test_a_calibration_that_fails_ends_the_parent_run_failed(local_ray, workdir, monkeypatch):
    """Nothing is saved to resume before the calibration: its failure left the parent run RUNNING, which the report
    then offered to finish with --resume (which found no run)."""
    def broken(*args, **kwargs):
        raise OSError("calibration image 17 is truncated")

    monkeypatch.setattr(sweep, "calibrate", broken)
    spec = small_spec(baseline=False, grid={}, tasks=["easyvqa_yesno"], name="calfail",
                      trials=[{"method": "promprune", "budget": 8, "mu": "calibrate"}],
                      calibration={"images": "testbed:train", "n": 4})
    with pytest.raises(OSError, match="truncated"):
        sweep.run_sweep(spec)
    c = tracking.client()
    (parent,) = c.search_runs([tracking.experiment_id(c)], "tags.`promprune.sweep` = 'calfail'")
    assert parent.info.status == "FAILED"


def test_a_calibration_not_shipped_is_measured_with_the_sweeps_model(local_ray, workdir):
    """A `mu: calibrate` trial whose calibration is not shipped (tiny:llava's weights cannot be named) is measured
    with the sweep's model and logged as measured; its median is what `calibration.run` gives here, and the trial
    runs with it as mu. (The quickstart reads its shipped calibration, so this is the path a real checkpoint takes.)"""
    from pipelines import calibration

    spec = small_spec(baseline=False, grid={}, tasks=["easyvqa_yesno"],
                      trials=[{"method": "promprune", "budget": 8, "mu": "calibrate"}],
                      calibration={"images": "testbed:train", "n": 4})
    outcome = sweep.run_sweep(spec)
    assert outcome.failed == []
    expected = calibration.run(spec.model, spec.calibration, ["spectral"], 8)["spectral"]["median"]
    parent = tracking.client().get_run(outcome.parent_run_id)
    assert parent.data.params["calibration_source"] == "measured"
    assert parent.data.metrics["calibration/median_spectral"] == round(expected, 4)
    (run,) = tracking.trial_runs(tracking.client(), outcome.parent_run_id).values()
    assert float(run.data.params["mu"]) == pytest.approx(round(expected, 4))
