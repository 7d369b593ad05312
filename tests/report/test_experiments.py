"""The report reads the sweeps' experiment only (`promprune`, or MLFLOW_EXPERIMENT_NAME), as the sweep writes there:
a probe's `MLFLOW_EXPERIMENT_NAME=alice python pipelines/report.py` reported bob's newer sweep and logged the report
into bob's run, and `--sweep quickstart` took the newest run of that name in any experiment."""
from __future__ import annotations

from pipelines import report as report_cli
from pipelines.reporting.build import calibration_medians
from pipelines.reporting.store import load_sweep

from .conftest import log_sweep, trial

TASKS = ["pope"]


def _sweep(client, experiment, f1, tmp, name="quickstart", **kwargs):
    """A sweep ``name`` in ``experiment`` (made when missing): the baseline at F1 0.8 and one PromPrune trial."""
    found = client.get_experiment_by_name(experiment)
    exp = found.experiment_id if found else client.create_experiment(experiment,
                                                                    artifact_location=(tmp / experiment).as_uri())
    trials = [trial("none", None, {"pope/pope_f1_score": 0.8}), trial("promprune", 64, {"pope/pope_f1_score": f1})]
    return log_sweep(client, exp, name, trials, tasks=TASKS, tmp=tmp, **kwargs)


def test_the_report_reads_and_logs_to_its_own_experiment(store, tmp_path, monkeypatch, capsys):
    client, _ = store
    alice = _sweep(client, "alice", 0.4, tmp_path)
    bob = _sweep(client, "bob", 0.6, tmp_path)  # newer, same sweep name
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "alice")
    for argv in ([], ["--sweep", "quickstart"]):
        assert report_cli.main(["--out", str(tmp_path / "out"), *argv]) == 0
        out = capsys.readouterr().out
        assert f"report for sweep 'quickstart' (parent run {alice})" in out, out
    assert [a.path for a in client.list_artifacts(alice)] == ["report", "spec.yaml"]
    assert [a.path for a in client.list_artifacts(bob)] == ["spec.yaml"]  # nothing logged into bob's run
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "bob")
    assert load_sweep("quickstart").run_id == bob and load_sweep().run_id == bob and load_sweep(bob).run_id == bob


def test_a_sweep_only_another_experiment_holds_is_refused_naming_that_experiment(store, tmp_path, monkeypatch,
                                                                                capsys):
    client, _ = store
    _sweep(client, "alice", 0.4, tmp_path)
    bob = _sweep(client, "bob", 0.6, tmp_path)
    uri = client.tracking_uri
    # the default experiment, `promprune`, holds no sweep: the experiment with the newest sweep is named first
    assert report_cli.main(["--out", str(tmp_path / "out"), "--no-log"]) == 2
    assert capsys.readouterr().err == (
        "report: no sweep runs (tag promprune.role=sweep) in experiment 'promprune' (the default; "
        f"MLFLOW_EXPERIMENT_NAME selects another) of the MLflow store {uri}; experiments 'bob', 'alice' have one: to "
        "read it, select that experiment with `MLFLOW_EXPERIMENT_NAME=bob` in front of the command (the report "
        "reads, and logs to, the one experiment the sweeps write to)\n")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "carol")  # no such experiment
    for argv, said in [(["--sweep", bob], f"--sweep {bob!r}: no sweep run with that name or run id in experiment "
                                          "'carol' (MLFLOW_EXPERIMENT_NAME) of the MLflow store"),
                       (["--sweep", "quickstart"], "--sweep 'quickstart': no sweep run with that name")]:
        assert report_cli.main(["--out", str(tmp_path / "out"), "--no-log", *argv]) == 2
        err = capsys.readouterr().err
        assert said in err and "(its sweeps: none)" in err and err.count("\n") == 1, err
    assert "; experiments 'bob', 'alice' have it: to read it, select that experiment with " \
           "`MLFLOW_EXPERIMENT_NAME=bob`" in err
    # a name no experiment holds: this experiment's sweeps, no other experiment named
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "alice")
    assert report_cli.main(["--out", str(tmp_path / "out"), "--no-log", "--sweep", "nightly"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("report: --sweep 'nightly': no sweep run with that name or run id in experiment 'alice'")
    assert err.endswith("(its sweeps: quickstart)\n"), err
    assert not (tmp_path / "out").exists()


def test_an_earlier_calibration_is_read_from_the_sweeps_experiment_only(store, tmp_path, monkeypatch):
    """A grid given its mu takes the calibration medians of the latest earlier sweep on its model: of its own
    experiment (0.43), not another's newer one (0.39)."""
    client, _ = store
    measured = _sweep(client, "alice", 0.4, tmp_path, name="mu_calibration",
                      parent_metrics={"calibration/median_spectral": 0.43, "calibration/images": 100})
    newer = _sweep(client, "bob", 0.4, tmp_path, name="mu_calibration",
                   parent_metrics={"calibration/median_spectral": 0.39})
    for run in (measured, newer):
        client.log_param(run, "model", "tiny:llava")  # as the sweep logs it on its parent run
    grid = _sweep(client, "alice", 0.4, tmp_path, name="mu_calibration_grid")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "alice")
    assert calibration_medians(load_sweep(grid)) == (
        {"spectral": 0.43}, 100, f"measured by sweep mu_calibration, run {measured}, on the same model (adapter "
                                 "options not recorded by one of the two sweeps: check they match)")


def test_the_closing_link_opens_the_runs_own_experiment(store, tmp_path, monkeypatch):
    """The link a sweep prints last goes to its parent run's experiment, also when the shell that resumed it sets
    another MLFLOW_EXPERIMENT_NAME (the run continues where it started)."""
    from pipelines.recording import tracking

    client, _ = store
    alice = _sweep(client, "alice", 0.4, tmp_path)
    _sweep(client, "bob", 0.6, tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "bob")
    experiment = client.get_experiment_by_name("alice").experiment_id
    assert tracking.ui_url("quickstart", alice).startswith(f"http://127.0.0.1:5000/#/experiments/{experiment}/runs")
    bob = client.get_experiment_by_name("bob").experiment_id
    assert tracking.ui_url().startswith(f"http://127.0.0.1:5000/#/experiments/{bob}/runs")
