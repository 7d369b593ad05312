"""scripts/ui_screenshots.py: the MLflow UI in a real browser on a store written by the pipeline's own writer.

The browser tests need Playwright and Debian's Chromium (`tests.browser`; .ci/run installs both); the saved view,
the table check and the script's error messages are checked without a browser.
"""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipelines import mlflow_layout
from pipelines.recording import tracking
from pipelines.recording.view import SweepView
from tests.browser import needs_browser

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "ui_screenshots.py"
TASKS = ["easyvqa_yesno", "easyvqa_open"]


def _sweep(client, tmp_path: Path, name: str = "ui_demo") -> tuple[str, list[str]]:
    """A finished two-trial sweep through pipelines.recording.tracking, with a report (md + html with one inline
    figure)."""
    t0 = time.time() - 60
    parent = tracking.start_sweep(client, name, 1, f"name: {name}\n",
                                  {"model": "tiny:llava", "tasks": ",".join(TASKS), "limit": 4, "trials": 2},
                                  started=t0, view=SweepView(TASKS, ["mu"]))
    names = []
    for i, (method, budget) in enumerate([("none", None), ("promprune", 8)]):
        trial = {"method": method, "budget": budget, "options": {"mu": 0.006} if budget else {},
                 "trial_id": "baseline" if budget is None else "promprune-b8-mu=0.006"}
        metrics = {"easyvqa_yesno/f1": 0.8 - 0.1 * i, "easyvqa_yesno/accuracy": 0.75, "easyvqa_open/exact_match": 0.25,
                   "rel": 1.0 - 0.05 * i, "efficiency/visual_tokens": budget or 36, "samples/total": 8}
        tracking.log_trial(client, parent, name, 1, trial, tracking.trial_params("tiny:llava", trial, TASKS, {}),
                           metrics, None, span=(t0 + 10 * i, t0 + 10 * i + 7.5))
        names.append(trial["trial_id"])
    tracking.finish(client, parent)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([8, 36], [95, 100], marker="o")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode()
    client.log_text(parent, f"# Report: {name}\n\n## Figures\n\n![tradeoff](tradeoff.png)\n", "report/report.md")
    client.log_text(parent, f"<html><body><h1>Report: {name}</h1><h2>Figures</h2>"
                            f"<img src='data:image/png;base64,{png}'></body></html>", "report/report.html")
    return parent, names


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=os.environ.copy(),
                          capture_output=True, text=True, timeout=timeout)


def test_a_sweep_saves_its_runs_view(store, tmp_path):
    """start_sweep saves the view the printed link opens: this run of the sweep (the parent and its trials, not an
    earlier run's), flat, the parent first (sorted by the role tag, which MLflow's own search honours), rel and
    visual tokens first, method, budget and the options as params; the link opens the Model-training side of
    MLflow 3's UI."""
    client, exp = store
    earlier, _ = _sweep(client, tmp_path)
    parent, names = _sweep(client, tmp_path)
    tags = client.get_experiment(exp).tags
    envelope = json.loads(tags[mlflow_layout.SAVED_VIEW + f"promprune-ui_demo-{parent}"])
    state = json.loads(envelope["state"])
    assert envelope["name"].startswith("ui_demo ") and envelope["name"].endswith(f" {parent[:8]}")
    assert state["searchFilter"] == f"tags.`promprune.sweep_run` = '{parent}'"
    assert (state["orderByKey"], state["orderByAsc"], state["groupBy"]) == ("tags.`promprune.role`", True, None)
    assert state["columnOrder"][:5] == ["attributes.`Run Name`", "metrics.`rel`", "metrics.`efficiency/visual_tokens`",
                                        "params.`method`", "params.`budget`"]
    assert state["selectedColumns"] == ["metrics.`rel`", "metrics.`efficiency/visual_tokens`", "params.`method`",
                                        "params.`budget`", "params.`mu`", "metrics.`easyvqa_yesno/f1`",
                                        "metrics.`easyvqa_open/exact_match`"]
    assert state["globalLineChartConfig"]["selectedXAxisMetricKey"] == "samples/scored"
    # what the UI asks the server for: MLflow's search with the view's filter and order
    shown = client.search_runs([exp], state["searchFilter"], order_by=[f"{state['orderByKey']} ASC"])
    assert [r.info.run_name for r in shown] == ["ui_demo"] + names[::-1]  # the parent, then its trials newest first
    assert earlier not in {r.info.run_id for r in shown}
    assert tracking.ui_url("ui_demo", parent) == (f"http://127.0.0.1:5000/#/experiments/{exp}/runs"
                                                  f"?workflowType=machine_learning&viewStateShareKey=promprune-ui_demo-"
                                                  f"{parent}")
    assert tracking.ui_url("ui_demo", earlier).endswith(f"&viewStateShareKey=promprune-ui_demo-{earlier}")
    assert tracking.ui_url("no_such_sweep", parent).endswith("?workflowType=machine_learning")


def _shows(client, exp, url: str) -> set[str]:
    """The runs a printed link's saved view shows (MLflow's search with the view's filter)."""
    key = url.split("viewStateShareKey=")[1]
    state = json.loads(json.loads(client.get_experiment(exp).tags[mlflow_layout.SAVED_VIEW + key])["state"])
    return {r.info.run_id for r in client.search_runs([exp], state["searchFilter"])}


def test_two_runs_of_a_sweep_at_once_each_link_their_own_view(store, tmp_path):
    """The nightly and a manual run of the same spec in one experiment at the same time: each saved its view under
    the sweep's one key, so the later start overwrote the earlier's and the earlier's printed link opened the other
    run's rows. Now each run's link opens its own parent and trials, whichever started or finished first, each view
    named apart; a sweep keeps its latest VIEWS_KEPT views and those of its running runs; a resume saves its run's
    view again (the same name, and creation time when still there; back when later runs removed it)."""
    from pipelines.recording import view as views

    client, exp = store
    nightly = tracking.start_sweep(client, "nightly", 1, "name: nightly\n", {"tasks": ",".join(TASKS)})
    manual = tracking.start_sweep(client, "nightly", 1, "name: nightly\n", {"tasks": ",".join(TASKS)})
    for parent in (nightly, manual):
        trial = {"method": "promprune", "budget": 8, "options": {}, "trial_id": f"promprune-b8-{parent[:4]}"}
        tracking.log_trial(client, parent, "nightly", 1, trial, tracking.trial_params("tiny:llava", trial, TASKS, {}),
                           {"rel": 0.9}, None)
    own = {p: {p, *(r.info.run_id for r in tracking.latest_trial_runs(client, p).values())} for p in (nightly, manual)}
    filters = [json.loads(json.loads(v)["state"])["searchFilter"] for k, v in client.get_experiment(exp).tags.items()
               if k.startswith(mlflow_layout.SAVED_VIEW)]
    assert [p for p in (nightly, manual) if not any(p in f for f in filters)] == []  # (the nightly's was overwritten)
    tracking.finish(client, manual)
    tracking.finish(client, nightly)  # the one started first ends last: its printed link
    for parent in (nightly, manual):
        url = tracking.ui_url("nightly", parent)
        assert url.endswith(f"viewStateShareKey=promprune-nightly-{parent}")
        assert _shows(client, exp, url) == own[parent]
    saved = {p: json.loads(client.get_experiment(exp).tags[mlflow_layout.SAVED_VIEW + f"promprune-nightly-{p}"])
             for p in (nightly, manual)}
    assert saved[nightly]["name"] != saved[manual]["name"]  # told apart in the Views menu too

    # later runs of the sweep: the oldest finished views go, a running one stays; the resume saves its own again
    tracking.reopen(client, manual, "nightly", views.SweepView(TASKS))  # `--resume` of the manual one: RUNNING
    again = json.loads(client.get_experiment(exp).tags[mlflow_layout.SAVED_VIEW + f"promprune-nightly-{manual}"])
    assert (again["name"], again["createdAt"]) == (saved[manual]["name"], saved[manual]["createdAt"])
    later = [tracking.start_sweep(client, "nightly", 1, "name: nightly\n", {}) for _ in range(views.VIEWS_KEPT)]
    for parent in later:
        tracking.finish(client, parent)
    kept = views.sweep_views(client.get_experiment(exp).tags, "nightly")
    assert set(kept) == {manual, *later} and nightly not in kept
    assert tracking.ui_url("nightly", nightly).endswith("?workflowType=machine_learning")  # no other run's view
    tracking.reopen(client, nightly, "nightly", views.SweepView(TASKS))  # `--resume` of the nightly
    again = json.loads(client.get_experiment(exp).tags[mlflow_layout.SAVED_VIEW + f"promprune-nightly-{nightly}"])
    assert again["name"] == saved[nightly]["name"]
    assert _shows(client, exp, tracking.ui_url("nightly", nightly)) == own[nightly]
    kept = views.sweep_views(client.get_experiment(exp).tags, "nightly")  # the latest, and the running one
    assert set(kept) == {nightly, *later[1:], manual} and len(kept) == views.VIEWS_KEPT + 1
    # another sweep's views, whose name starts with this one's, are not this sweep's
    other = tracking.start_sweep(client, "nightly-b", 1, "name: nightly-b\n", {})
    assert other not in views.sweep_views(client.get_experiment(exp).tags, "nightly")
    # nor is the one per-sweep key an earlier version saved for sweep "nightly-gpu" (read as run "gpu", it was pruned)
    old_key = mlflow_layout.SAVED_VIEW + mlflow_layout.view_key("nightly-gpu")
    client.set_experiment_tag(exp, old_key, json.dumps({"name": "nightly-gpu", "createdAt": 1, "state": "{}"}))
    assert views.sweep_views(client.get_experiment(exp).tags, "nightly") == kept
    views.prune_views(client, exp, "nightly", kept=0)
    assert old_key in client.get_experiment(exp).tags


@pytest.mark.parametrize("name, options, running, best, longest", [
    ("quickstart", ["mu", "tau"], None, None, "promprune-b16-mu=calibrate-tau=0.03"),
    ("testbed_mu_tau_grid", ["mu", "tau"], None, "rel", "promprune-b16-mu=0.14-tau=0.005"),
    ("testbed_mu_tau_search", ["mu", "tau"], "rel", "rel", "promprune-b16-mu=0.1234-tau=0.01234"),
    ("fig1a_saliency_ratio", ["saliency_ratio"], None, None, "fixed_ratio-b64-saliency_ratio=0.1"),
    # Fig. 4 on the testbed: one trial per metric, each its own calibrated mu and tau: no search, no best/*
    ("testbed_prominence", ["mu", "tau", "metric"], None, None,
     "promprune-b16-metric=feature_norm-mu=calibrate-tau=0.0006"),
])
def test_a_specs_view_shows_what_tells_its_trials_apart(name, options, running, best, longest):
    """The options its trials set or its search varies (mu and tau first), a scheduler's running value, the parent's
    best where the trials make one (mu, tau) search (alike in all else: `mlflow_layout.trial_searches`), and room
    for the longest name (a searched one: its sampled values' digits)."""
    from pipelines import spec as specs

    spec = specs.load(REPO / "sweeps" / f"{name}.yaml")
    view = SweepView.of(spec, specs.expand(spec))
    assert (view.options, view.running, view.best) == (options, running, best)
    assert len(longest) <= view.name_chars <= len(longest) + 3
def test_clear_errors_without_a_browser(store, tmp_path):
    """No Chromium, no store, a store without a sweep: one paragraph on stderr, exit 2, no traceback, nothing
    created. (The store is checked before any browser starts: any executable passes for --chromium there.)"""
    cases = [(["--chromium", str(tmp_path / "no-chromium")], "no Chromium found"),
             (["--chromium", "/bin/sh", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"], "no MLflow store at"),
             (["--chromium", "/bin/sh", "--tracking-uri", os.environ[mlflow_layout.TRACKING_URI_ENV]],
              "has no finished sweep")]
    for args, says in cases:
        proc = _run(*args, "--out", str(tmp_path / "shots"))
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "none.db").exists() and not (tmp_path / "shots").exists()


def test_the_table_check_names_what_differs(store, tmp_path):
    """The script's check of the runs table (no browser: the cells as the page would give them): a number as the
    UI writes it (16.0 as 16) passes, a wrong or missing cell is named; a stopped trial's Rel. is its running one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ui_screenshots", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    client, exp = store
    run = client.create_run(exp, run_name="promprune-b16-mu=0.2-tau=0.02")
    for key, value in {"method": "promprune", "mu": "0.2", "tau": "0.02"}.items():
        client.log_param(run.info.run_id, key, value)
    client.log_metric(run.info.run_id, "running/rel", 16.0)
    run = client.get_run(run.info.run_id)
    row = {"params.`method`": "promprune", "params.`mu`": "0.2", "params.`tau`": "0.02", "metrics.`running/rel`": "16"}
    assert script.table_problems({run.info.run_id: row}, [run]) == []
    wrong = {**row, "params.`mu`": "0.3"}
    del wrong["params.`tau`"]
    assert script.table_problems({run.info.run_id: wrong}, [run]) == [
        "promprune-b16-mu=0.2-tau=0.02: params.`mu` shows '0.3', MLflow holds '0.2'",
        "promprune-b16-mu=0.2-tau=0.02: no params.`tau` cell on the screen"]


@pytest.mark.slow
@needs_browser
def test_screenshots_show_the_runs(store, tmp_path):
    """The script starts `mlflow ui`, finds every trial with its method, mu and Rel. in the runs table of the saved
    view, the trial's page and the report with its figure, writes four valid 1400x900 PNGs and stops the server."""
    from PIL import Image

    client, _ = store
    parent, names = _sweep(client, tmp_path)
    out = tmp_path / "shots"
    proc = _run("--tracking-uri", os.environ[mlflow_layout.TRACKING_URI_ENV], "--out", str(out), "--timeout", "120")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"(parent run {parent}), 2 trial runs shown in the runs table" in proc.stdout
    assert f"saved view: promprune-ui_demo-{parent}" in proc.stdout
    assert "each trial's method, mu, rel in its row as MLflow holds them, at 1400 px" in proc.stdout
    assert "opens on #/experiments/" in proc.stdout
    shots = sorted(p.name for p in out.glob("*.png"))
    assert shots == ["1_runs.png", "2_trial.png", "3_report_md.png", "4_report_html.png"]
    for name in shots:
        with Image.open(out / name) as img:
            img.verify()
            assert img.format == "PNG" and img.size == (1400, 900)
        assert (out / name).stat().st_size < 300_000
    url = proc.stdout.split("mlflow ui ran on ")[1].split()[0]
    with pytest.raises(OSError):  # the server is gone when the script returns
        urllib.request.urlopen(f"{url}/health", timeout=5)
