"""A search end to end on a local Ray: optuna proposes (mu, tau), ASHA stops weak trials at rungs of samples scored
(on the same first samples for every trial, paired with the baseline), stopped trials land in MLflow as stopped,
and a search interrupted and resumed (Ctrl-C, or its driver SIGKILLed right after a stop) runs the same trials
to the same stops and best (the testbed model: real scores)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import yaml

from pipelines import mlflow_layout, sweep, timeline
from pipelines.recording import tracking
from pipelines import spec as specs
from pipelines.run import search
from pipelines.run.ray_connect import init_local
from pipelines.recording.console import best_line
from pipelines.run.requests import build_rows, requests_dataset
from tests.browser import needs_browser
from tests.pipelines.sweep_cli import REPO, read_until, spawn_sweep

pytest.importorskip("optuna")  # the `pipeline` extra installs it

pytestmark = pytest.mark.slow

RAW = {"name": "search", "version": 1, "model": {"pretrained": "testbed:llava"},
       "tasks": ["testbed_exist", "testbed_attribute"], "limit": 8, "resources": {"batch_size": 4},
       "grid": {"method": ["promprune"], "budget": [16], "mu": {"uniform": [0.14, 0.4]}, "tau": [0.02]},
       "tune": {"search": "optuna", "num_samples": 4, "scheduler": "asha", "grace_period": 4, "reduction_factor": 2,
                "max_concurrent_trials": 1, "seed": 3}}


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    """The timeline folder of this module's sweeps: every process of them (the trials, the workers) writes there."""
    folder = tmp_path_factory.mktemp("timeline")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(timeline.ENV, str(folder))  # before Ray starts: its workers inherit it
        yield folder


@pytest.fixture(scope="module")
def local_ray(events):
    init_local(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def searched(local_ray, tmp_path_factory, mlflow_template):
    """The search run once, uninterrupted: (spec, outcome, its MLflow client)."""
    import shutil

    tmp = tmp_path_factory.mktemp("search")
    shutil.copyfile(mlflow_template, tmp / "mlflow.db")
    old = Path.cwd()
    os.chdir(tmp)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
    try:
        spec = specs.parse(RAW)
        yield spec, sweep.run_sweep(spec), tracking.client()
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI")
        os.chdir(old)


def _rung_history(client, run_id: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, f"{mlflow_layout.RUNNING}/rel")}


def test_asha_stops_weak_trials_at_rungs_and_they_are_logged_as_stopped(searched, events):
    spec, outcome, client = searched
    records = outcome.records
    assert outcome.failed == [] and len(records) == 5 and "baseline" in records
    stopped = [tid for tid, rec in records.items() if rec.get("stopped")]
    assert stopped, "no trial was stopped: the seed no longer shows ASHA at work"
    runs = {r.data.tags[mlflow_layout.TRIAL]: r for r in client.search_runs(
        [client.get_experiment_by_name(mlflow_layout.experiment_name()).experiment_id],
        filter_string=mlflow_layout.tag_filter(mlflow_layout.PARENT, outcome.parent_run_id))}
    assert sorted(runs) == sorted(records)
    finished = tracking.trial_runs(client, outcome.parent_run_id)  # what the regression check and Rel. read
    assert not set(stopped) & set(finished)
    rungs = search.rungs(spec, 16)
    assert rungs == [4, 8]
    for tid in stopped:
        run = runs[tid]
        assert run.info.status == "KILLED" and run.data.tags[mlflow_layout.STOPPED].startswith("stopped by ASHA at ")
        m = run.data.metrics
        assert m["samples/scored"] in rungs and m["samples/done"] < m["samples/total"] == 16
        assert mlflow_layout.REL not in m and f"{mlflow_layout.RUNNING}/{mlflow_layout.REL}" in m
        assert not any(k.startswith("testbed_") for k in m)  # running scores only under running/
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == []  # no predictions
        # its run spans the trial, from its start to its stop, not the moment it was logged: every block the workers
        # started for it started inside the run (the timeline's clock is the same wall clock; a block in flight at
        # the stop may end after it, unread), but for a block already sent to a worker when the stop came, which may
        # still start there (ray.cancel is asynchronous; one started 10 ms after the run's end on 2026-11-28): at
        # most one such block per worker, as a worker holds one block of a trial at a time
        starts = [e for e in timeline.read(events) if e.get("trial") == tid and e["event"] == "predict_start"]
        started = [e["t"] * 1000 for e in starts]
        assert started and run.info.start_time <= min(started)
        late = [e["pid"] for e in starts if e["t"] * 1000 > run.info.end_time + 1]
        assert len(set(late)) == len(late), (late, run.info.end_time, sorted(started))
        assert {mlflow_layout.STARTED_AT, mlflow_layout.FINISHED_AT} <= set(run.data.tags)

    # ASHA's rule, re-derived: one trial at a time, so a trial at rung r is compared with the values the trials
    # before it recorded there; it stops when below their (1 - 1/reduction factor) quantile
    order = [tid for tid in records if tid != "baseline"]  # the order they ran (and were recorded) in
    history = {tid: _rung_history(client, runs[tid].info.run_id) for tid in order}
    for i, tid in enumerate(order):
        for r in rungs:
            if r not in history[tid]:
                continue
            before = [history[t][r] for t in order[:i] if r in history[t]]
            cutoff = np.nanpercentile(before, (1 - 1 / RAW["tune"]["reduction_factor"]) * 100) if before else None
            was_stopped_here = tid in stopped and runs[tid].data.metrics["samples/scored"] == r
            assert was_stopped_here == (cutoff is not None and history[tid][r] < cutoff), (tid, r, history)


def test_a_trial_asha_stops_sends_no_more_work(searched, events):
    """The workers answered a stopped trial's samples up to its stop and at most the blocks it had in flight then
    (one per worker it used): its coordinator sent nothing after the scheduler stopped it, and what it had queued and
    no worker had started was cancelled."""
    spec, outcome, _ = searched
    answered: dict[str, int] = {}
    for e in timeline.read(events):
        if e["event"] == "predict_end" and e.get("trial"):
            answered[e["trial"]] = answered.get(e["trial"], 0) + e["rows"]
    stopped = {tid: rec for tid, rec in outcome.records.items() if rec.get("stopped")}
    assert stopped
    in_flight = 2 * spec.resources.batch_size  # two workers (two cores), one block of at most batch_size each
    for tid, rec in stopped.items():
        assert rec["stopped"]["done"] <= answered[tid] <= rec["stopped"]["done"] + in_flight, (tid, answered[tid])
    finished = [tid for tid in outcome.records if tid not in stopped]
    assert all(answered[tid] == 16 for tid in finished)  # (a trial answers each of its samples once)


def test_a_rung_value_is_rel_over_the_first_samples_paired_with_the_baseline(searched):
    """Recomputed here from the predictions: each finished trial's value at a rung equals Rel. of its first r
    samples (the sweep's block order) over the baseline's same r samples."""
    from promprune.eval import relative_score, score

    spec, outcome, client = searched
    keys = requests_dataset(build_rows(spec.tasks, spec.limit, spec.generation), spec.resources.batch_size).keys

    def first(tid, r):
        rows = {f"{row['task']}/{row['doc_id']}": row for row in outcome.records[tid]["predictions"].select(
            ["task", "doc_id", "n_docs", "prediction", "error"]).to_pylist()}
        return score([rows[k] for k in keys[:r]], partial=True)

    runs = {r.data.tags[mlflow_layout.TRIAL]: r for r in client.search_runs(
        [client.get_experiment_by_name(mlflow_layout.experiment_name()).experiment_id],
        filter_string=mlflow_layout.tag_filter(mlflow_layout.PARENT, outcome.parent_run_id))}
    checked = 0
    for tid, rec in outcome.records.items():
        if tid == "baseline" or rec.get("stopped"):
            continue
        for r, value in _rung_history(client, runs[tid].info.run_id).items():
            assert value == pytest.approx(relative_score(first(tid, r), first("baseline", r)))
            checked += 1
    assert checked


def test_the_summary_names_the_best_finished_trial_and_every_sample_generated(searched):
    spec, outcome, _ = searched
    done = {tid: rec for tid, rec in outcome.records.items() if not rec.get("stopped") and tid != "baseline"}
    best = min(done.values(), key=lambda rec: (-rec["metrics"][mlflow_layout.REL], rec["trial"]["trial_id"]))
    mu = best["trial"]["options"]["mu"]
    assert best_line(spec, outcome.records, outcome.generated) == outcome.best == \
        f"best rel {best['metrics'][mlflow_layout.REL]:.4f} at mu={mu} tau=0.02; {outcome.generated} samples generated"
    stopped = [rec["stopped"]["done"] for rec in outcome.records.values() if rec.get("stopped")]
    assert 16 * (len(done) + 1) + sum(stopped) <= outcome.generated < 16 * len(outcome.records)


@pytest.mark.long  # the long tier (pyproject's markers): resumes run in CI (test_engine's
# killed driver, tests/reliability/test_resume.py's)
def test_an_interrupted_search_resumes_to_the_same_trials_and_best(searched, tmp_path):
    """The same spec and seed from the command line, interrupted (Ctrl-C) after its first searched trial, then
    resumed: optuna's and ASHA's state come back with the experiment, so it runs the trials the uninterrupted
    search ran, stops the same ones, and ends on the same best."""
    spec, outcome, _ = searched
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(RAW))
    # RAY_ADDRESS=local: never a head someone else's `ray start` left on this machine
    first = spawn_sweep(path, tmp_path, ray_address="local")
    head = read_until(first, "[2/5]", timeout=600)  # the baseline and one searched trial are in
    first.send_signal(signal.SIGINT)
    rest, _ = first.communicate(timeout=300)
    assert first.returncode == sweep.EXIT_INTERRUPTED, head + rest
    second = spawn_sweep(path, tmp_path, "--resume", ray_address="local")
    out, _ = second.communicate(timeout=900)
    assert second.returncode == 0, out[-3000:]
    assert "resuming" in out and "-search: finished trials are kept" in out
    expected = best_line(spec, outcome.records, outcome.generated).split(";")[0]
    assert expected in out, out[-2000:]
    ran = {line.split("] ", 1)[1].split(":")[0] for line in (head + rest + out).splitlines()
           if line.startswith("[") and "/5] " in line}
    assert ran == set(outcome.records)  # the same trials (their ids name their sampled mu)
    stopped_now = {line.split("] ", 1)[1].split(":")[0] for line in (head + rest + out).splitlines()
                   if "stopped by ASHA" in line and line.startswith("[")}
    assert stopped_now == {tid for tid, rec in outcome.records.items() if rec.get("stopped")}


@pytest.mark.long  # the long tier: a search run twice more from the command line (about two minutes on 2 cores)
def test_a_search_whose_driver_is_killed_after_a_stop_resumes_without_running_the_stopped_trial(searched, tmp_path):
    """The driver SIGKILLed as soon as it has said that ASHA stopped a trial (Tune saves its experiment only every so
    often, so its state may still hold the trial unfinished), its Ray processes killed, then `--resume`: the stopped
    trial is not run again (no `[resume]` line for it), and the search ends with the uninterrupted search's trials,
    the same stops at the same rungs, and the same best (`searched`, run in one go)."""
    import re

    spec, outcome, _ = searched
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(RAW))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PYTHONUNBUFFERED": "1",
           "RAY_ADDRESS": "local"}
    first = subprocess.Popen([sys.executable, str(REPO / "pipelines" / "sweep.py"), "--config", str(path)],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # its group: the Ray processes it starts, killed after it
    try:
        head = read_until(first, re.compile(r"^\[\d+/5\] .*stopped by ASHA"), timeout=600)
        os.kill(first.pid, signal.SIGKILL)  # the driver alone, at once: nothing of it runs after the line
        first.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    killed_at = head.strip().splitlines()[-1].split("] ", 1)[1].split(":")[0]
    second = spawn_sweep(path, tmp_path, "--resume", ray_address="local")
    out, _ = second.communicate(timeout=900)
    assert second.returncode == 0, out[-3000:]
    assert f"[resume] {killed_at}:" not in out, out[-3000:]  # not run again
    lines = (head + out).splitlines()
    ran = {line.split("] ", 1)[1].split(":")[0] for line in lines if re.match(r"\[\d+/5\] ", line)}
    assert ran == set(outcome.records)
    stops = {line.split("] ", 1)[1].split(":")[0]: int(line.split("stopped by ASHA at ")[1].split()[0])
             for line in lines if re.match(r"\[\d+/5\] .*stopped by ASHA", line)}
    assert stops == {tid: int(rec["stopped"]["scored"]) for tid, rec in outcome.records.items() if rec.get("stopped")}
    expected = best_line(spec, outcome.records, outcome.generated).split(";")[0]
    assert expected in out, out[-2000:]


@needs_browser
def test_the_printed_link_shows_each_trials_method_mu_tau_and_rel_in_a_browser(searched, tmp_path):
    """The link the sweep prints, opened in a fresh headless Chromium on `mlflow ui` over the sweep's store
    (scripts/ui_screenshots.py): the parent run first, then every trial, finished or stopped, with its method, mu,
    tau and Rel. (a stopped one's running Rel.) in its row as MLflow holds them, on a 1400 px screen; the charts of
    running values against samples/scored."""
    spec, outcome, client = searched
    printed = tracking.ui_url(spec.name, outcome.parent_run_id)  # what `pipelines/sweep.py` prints last
    assert "workflowType=machine_learning" in printed
    assert f"viewStateShareKey=promprune-search-{outcome.parent_run_id}" in printed
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "ui_screenshots.py"), "--sweep", spec.name,
                           "--tracking-uri", tracking.tracking_uri(), "--out", str(tmp_path / "shots")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"the sweep's link: #{printed.split('#', 1)[1]}" in proc.stdout
    assert f"(parent run {outcome.parent_run_id}), {len(outcome.records)} trial runs shown" in proc.stdout
    assert "each trial's method, mu, rel, running/rel, tau in its row as MLflow holds them" in proc.stdout
    assert "line charts of running values against samples/scored" in proc.stdout  # not MLflow's "Step"


def test_an_optuna_proposal_of_a_trial_already_run_is_said_and_every_count_is_of_distinct_trials(
        local_ray, tmp_path, monkeypatch, mlflow_db, capsys):
    """A probe's case: FastV takes no mu, so every proposal of fastv after the first names the trial ``fastv-b16``
    again, which is not run again. The console's ``[k/N]`` stopped at ``[3/6]`` before "finished", and the parent run
    had param ``trials=6`` beside ``trials/total=3``, with nothing saying why. Now each repeat is said, ``N`` counts
    the distinct trials, and the param, ``trials/total`` and the records agree; ``trials/proposed`` counts optuna's
    proposals."""
    monkeypatch.chdir(tmp_path)
    proposals = 6
    spec = specs.parse({**RAW, "name": "repeats", "tasks": ["testbed_exist"], "limit": 2,
                        "grid": {"method": ["fastv", "promprune"], "budget": [16], "mu": {"uniform": [0.2, 0.6]}},
                        "tune": {"search": "optuna", "num_samples": proposals, "scheduler": "none",
                                 "max_concurrent_trials": 1, "seed": 0}})
    outcome = sweep.run_sweep(spec)
    out = capsys.readouterr().out
    ran = set(outcome.records)  # the distinct trials: the baseline and optuna's distinct picks
    repeats = [line for line in out.splitlines() if ": optuna proposed it again, " in line]
    assert len(repeats) == 1 + proposals - len(ran) >= 1, out[-3000:]  # (seed 0: fastv proposed twice or more)
    assert all(line.endswith(" fastv-b16: optuna proposed it again, a trial that already ran: not run again (no "
                             "sample generated: its saved answers are scored again and the same result goes to "
                             "optuna)") for line in repeats), repeats
    counted = [line.split("]", 1)[0] for line in out.splitlines() if line.startswith("[") and "/" in line.split("]")[0]]
    assert counted[-1] == f"[{len(ran)}/{len(ran)}", out[-3000:]  # the counter ends at its total
    run = tracking.client().get_run(outcome.parent_run_id)
    assert run.data.params["trials"] == str(len(ran))
    assert run.data.metrics[mlflow_layout.TRIALS_TOTAL] == len(ran)
    assert run.data.metrics[mlflow_layout.TRIALS_PROPOSED] == proposals
    assert run.data.metrics[mlflow_layout.TRIALS_REPEATED] == len(repeats)
    assert f"optuna proposed {proposals} trial(s), {len(repeats)} of them one the sweep had already run" in (
        run.data.tags[mlflow_layout.NOTE])
