"""The report against hand-worked values, on sweeps logged to a real SQLite MLflow store."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from pipelines import report as report_cli
from pipelines.reporting import tables
from pipelines.reporting.build import build_report, log_report
from pipelines.reporting.published import load_published
from pipelines.reporting.store import load_sweep

from .conftest import log_sweep, trial

TASKS = ["mme", "pope", "gqa"]
GRID = 576  # LLaVA-1.5's 24 x 24 visual tokens
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def scores(perception, cognition, pope_f1, gqa):
    return {"mme/mme_perception_score": perception, "mme/mme_cognition_score": cognition,
            "pope/pope_f1_score": pope_f1, "gqa/exact_match": gqa}


def grey_image(task, doc_id):
    return np.full((48, 64, 3), 128, dtype=np.uint8), ""


def predictions(rows):
    """rows: (task, doc_id, entropy, saliency_count, error); kept = 64 spread-out tokens, salient = the first ones."""
    out = []
    for task, doc, entropy, n_sal, error in rows:
        kept = list(range(0, GRID, GRID // 64))  # 64 tokens, every 9th
        out.append({"task": task, "doc_id": str(doc), "prediction": None if error else "yes", "error": error,
                    "entropy": entropy, "saliency_count": None if error else float(n_sal),
                    "visual_tokens": None if error else 64.0, "kept": None if error else kept,
                    "salient": None if error else kept[:n_sal], "timings": "{}"})
    return out


# MME = the perception score (cognition is logged but not shown). Baseline: MME 1800, POPE F1 0.80, GQA 0.60.
# Rel. = mean of the three ratios: promprune@64 (1620/1800, .80/.80, .57/.60) = (.90 + 1 + .95)/3 = 95.0 %;
# divprune@64 (.95, .95, 1) = 96.67 %; promprune@32 (.85, .90, .90) = 88.33 %; divprune@32 (.80, .90, .85) = 85.0 %.
TABLE_TRIALS = [
    trial("none", None, scores(1800, 300, 0.80, 0.60) | {"efficiency/visual_tokens": GRID}),
    trial("promprune", 64, scores(1620, 270, 0.80, 0.57) | {"t_sal/mean": 32},
          predictions=predictions([("pope", 0, 0.40, 40, None), ("pope", 1, 0.44, 24, None),
                                   ("gqa", 0, 0.46, 20, None), ("gqa", 1, 0.38, 20, None),
                                   ("gqa", 2, None, 0, "gqa doc 2: corrupt image")])),
    trial("divprune", 64, scores(1710, 290, 0.76, 0.60)),
    trial("promprune", 32, scores(1530, 270, 0.72, 0.54)),
    trial("divprune", 32, scores(1440, 240, 0.72, 0.51)),
    # random@32: (1300/1800, .70/.80, .45/.60) = (.7222, .875, .75) -> 78.24 %; a third row, so the POPE tie at
    # 72.0 between divprune and promprune is a tie for the best, not "all equal"
    trial("random", 32, scores(1300, 200, 0.70, 0.45)),
]


@pytest.fixture
def table_sweep(store, tmp_path):
    client, exp = store
    parent = log_sweep(client, exp, "table_demo", TABLE_TRIALS, tasks=TASKS, tmp=tmp_path)
    return client, parent


@pytest.fixture
def published_root(tmp_path):
    root = tmp_path / "paper"
    root.mkdir()
    (root / "table_demo.csv").write_text(
        "method,budget,variant,mme,pope,gqa,rel,source\n"
        "none,,,1862,,,,Table X row 1\n"
        "promprune,64,,,81.5,,96.0,Table X row 5\n"
        "divprune,32,,,,,,not found\n"
        "fastv,64,,,70.0,,,Table X row 2\n")
    return root


def test_rel_and_scores_match_hand_computation(table_sweep):
    _, parent = table_sweep
    table = tables.build_score_table(load_sweep(parent))
    frame = table.frame.set_index(["method", table.frame["budget"].fillna(0)])
    assert list(zip(table.frame["method"], table.frame["budget"].fillna(0))) == [
        ("none", 0), ("divprune", 64), ("promprune", 64), ("random", 32), ("divprune", 32), ("promprune", 32)]
    assert frame.loc[("promprune", 64), "rel"] == pytest.approx(95.0)
    assert frame.loc[("divprune", 64), "rel"] == pytest.approx(290 / 3)
    assert frame.loc[("promprune", 32), "rel"] == pytest.approx(265 / 3)
    assert frame.loc[("divprune", 32), "rel"] == pytest.approx(85.0)
    assert frame.loc[("random", 32), "rel"] == pytest.approx((1300 / 1800 + 0.875 + 0.75) / 3 * 100)
    assert frame.loc[("none", 0), "rel"] == pytest.approx(100.0)
    assert frame.loc[("promprune", 64), "mme"] == pytest.approx(1620)  # perception only


def test_markdown_bolds_the_best_per_budget(table_sweep, tmp_path):
    _, parent = table_sweep
    report = build_report(load_sweep(parent), tmp_path / "out", image_source=grey_image)
    section = report.markdown.split("## Scores", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip() + "@" + line.split("|")[2].strip(): line
            for line in section.splitlines() if line.startswith("| ") and "Method" not in line}
    assert rows["Upper bound@all (576)"] == "| Upper bound | all (576) | 1800.0 | 80.0 | 60.0 | 100.0% |"
    assert rows["DivPrune@64"] == "| DivPrune | 64 | **1710.0** | 76.0 | **60.0** | **96.7%** |"
    assert rows["PromPrune@64"] == "| PromPrune | 64 | 1620.0 | **80.0** | 57.0 | 95.0% |"
    assert rows["DivPrune@32"] == "| DivPrune | 32 | 1440.0 | **72.0** | 51.0 | 85.0% |"  # POPE tie: both bold
    assert rows["PromPrune@32"] == "| PromPrune | 32 | **1530.0** | **72.0** | **54.0** | **88.3%** |"
    assert rows["Random@32"] == "| Random | 32 | 1300.0 | 70.0 | 45.0 | 78.2% |"
    csv = pd.read_csv(tmp_path / "out" / "scores.csv")
    assert csv.loc[csv["label"] == "PromPrune", "POPE"].tolist() == pytest.approx([80.0, 72.0])


def test_a_rel_over_fewer_benchmarks_is_marked_and_not_the_budgets_best(store, tmp_path):
    """A trial run on a subset of the tasks (`tasks:` in its entry): its Rel. averages fewer benchmarks, and was
    bolded as its budget's best over rows averaged over all three. By hand: random@64 on POPE alone is 0.78/0.80 =
    97.5 %; promprune@64 (.90 + 1 + .95) / 3 = 95.0 %; divprune@64 (.95, .95, 1) = 96.7 %, the best over all three."""
    client, exp = store
    subset = trial("random", 64, {"pope/pope_f1_score": 0.78}, tid="random-b64-on=pope")
    subset["metrics"] = {"pope/pope_f1_score": 0.78}
    parent = log_sweep(client, exp, "subset_demo", [
        trial("none", None, scores(1800, 300, 0.80, 0.60)),
        trial("promprune", 64, scores(1620, 270, 0.80, 0.57)),
        trial("divprune", 64, scores(1710, 290, 0.76, 0.60)), subset], tasks=TASKS, tmp=tmp_path)
    table = tables.build_score_table(load_sweep(parent))
    rows = {line.split("|")[1].strip(): line for line in tables.score_table_markdown(table).splitlines()[2:]}
    assert rows["Random"] == "| Random | 64 | – | 78.0 | – | 97.5% (over 1 of 3 benchmarks) |"
    assert rows["DivPrune"] == "| DivPrune | 64 | **1710.0** | 76.0 | **60.0** | **96.7%** |"
    csv = tables.score_table_csv(table)
    assert csv.set_index("method")["Rel. over benchmarks"].to_dict() == pytest.approx(
        {"none": math.nan, "promprune": math.nan, "divprune": math.nan, "random": 1.0}, nan_ok=True)


def test_a_trial_that_sets_an_option_others_leave_at_default_is_named(store, tmp_path):
    """fastv beside fastv with layer: 2 (the testbed spec): two rows that must not share a label."""
    client, exp = store
    parent = log_sweep(client, exp, "label_demo", [
        trial("none", None, scores(1800, 300, 0.80, 0.60)),
        trial("fastv", 16, scores(1700, 300, 0.70, 0.50)),
        trial("fastv", 16, scores(1750, 300, 0.75, 0.55), options={"layer": 2}),
        trial("divprune", 16, scores(1600, 300, 0.70, 0.50))], tasks=TASKS, tmp=tmp_path)
    labels = tables.ordered_trials(load_sweep(parent))["label"].tolist()
    assert labels == ["Upper bound", "FastV", "FastV (layer=2)", "DivPrune"]


def test_deltas_against_published(table_sweep, tmp_path, published_root):
    _, parent = table_sweep
    build_report(load_sweep(parent), tmp_path / "out", published_root=published_root, image_source=grey_image)
    comp = pd.read_csv(tmp_path / "out" / "published_comparison.csv")
    got = {(r.method, r.column): (r.ours, r.paper, r.delta) for r in comp.itertuples()}
    assert got[("none", "mme")] == pytest.approx((1800, 1862, -62))
    assert got[("promprune", "pope")] == pytest.approx((80.0, 81.5, -1.5))
    assert got[("promprune", "rel")] == pytest.approx((95.0, 96.0, -1.0))
    ours, paper, delta = got[("fastv", "pope")]  # published, but the sweep did not run FastV
    assert math.isnan(ours) and paper == 70.0 and math.isnan(delta)
    assert len(comp) == 4  # divprune@32's row has no number: nothing to compare


def test_paper_rows_sit_under_ours_in_the_score_table(table_sweep, tmp_path, published_root):
    _, parent = table_sweep
    report = build_report(load_sweep(parent), tmp_path / "out", published_root=published_root, image_source=grey_image)
    lines = report.markdown.split("## Scores", 1)[1].split("\n## ", 1)[0].splitlines()
    ours = lines.index("| PromPrune | 64 | 1620.0 | **80.0** | 57.0 | 95.0% |")
    assert lines[ours + 1] == "| ↳ paper (Δ ours − paper) | 64 |  | 81.5 (-1.5) |  | 96.0% (-1.0) |"
    base = next(i for i, line in enumerate(lines) if line.startswith("| Upper bound"))
    assert lines[base + 1] == "| ↳ paper (Δ ours − paper) | all (576) | 1862.0 (-62.0) |  |  |  |"
    assert sum(line.startswith("| ↳ paper") for line in lines) == 2  # fastv@64 did not run; divprune@32 has no numbers


def test_all_equal_scores_are_not_bold(store, tmp_path):
    """A random-weight model scores 0 everywhere (the offline quickstart): nothing is "best"."""
    client, exp = store
    zero = scores(0, 0, 0.0, 0.0)
    trials = [trial("none", None, zero), trial("promprune", 16, zero), trial("divprune", 16, zero)]
    parent = log_sweep(client, exp, "zeros", trials, tasks=TASKS, tmp=tmp_path)
    report = build_report(load_sweep(parent), tmp_path / "out", image_source=grey_image)
    section = report.markdown.split("## Scores", 1)[1].split("\n## ", 1)[0]
    assert "**" not in section
    assert "| PromPrune | 16 | 0.0 | 0.0 | 0.0 | – |" in section  # Rel. undefined: the baseline scored 0


def test_figures_are_pngs_and_logged_to_the_parent_run(table_sweep, tmp_path):
    client, parent = table_sweep
    sweep = load_sweep(parent)
    (tmp_path / "out" / "old").mkdir(parents=True)
    (tmp_path / "out" / "notes.txt").write_text("mine")  # in the folder before: not the report's, never logged
    (tmp_path / "out" / "old" / "stale.png").write_bytes(PNG_MAGIC)
    report = build_report(sweep, tmp_path / "out", image_source=grey_image)
    names = {p.name for p in report.files}
    assert {"report.md", "scores.csv", "tradeoff.png", "ablation_bars.png", "entropy_histograms.png",
            "overlay_pope_0.png", "overlay_gqa_0.png"} <= names
    for path in report.files:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == PNG_MAGIC
            with Image.open(path) as img:
                img.verify()
    # report.html: the same report, tables rendered, every figure inline (MLflow renders .html, not .md)
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<table>" in page and 'src="tradeoff.png"' not in page
    figures = [p for p in report.files if p.suffix == ".png" and f"]({p.name})" in report.markdown]
    assert figures and page.count("data:image/png;base64,") == len(figures)
    uri = log_report(sweep, report, client)
    logged = {a.path for a in client.list_artifacts(parent, "report")}
    assert {f"report/{n}" for n in names} == logged  # what the report wrote, nothing else that lay in the folder
    assert uri.endswith("/report")


def test_failed_samples_stay_out_of_the_histograms(table_sweep, tmp_path):
    """The gqa doc 2 row failed: T_sal means use the 4 good rows only (pope 32, gqa 20)."""
    _, parent = table_sweep
    sweep = load_sweep(parent)
    from pipelines.reporting import build as build_mod

    t_sal, how = build_mod._mean_t_sal_per_task(sweep, tables.build_score_table(sweep),
                                                build_mod._PredictionCache(), TABLE_TRIALS_ID(sweep, "promprune", 64))
    assert t_sal == {"gqa": 20.0, "pope": 32.0} and "per-sample" in how


def TABLE_TRIALS_ID(sweep, method, budget):
    t = sweep.trials
    return t.index[(t["method"] == method) & (t["budget"] == budget)][0]


def test_cli_defaults_to_the_latest_sweep_and_prints_where(store, tmp_path, capsys):
    client, exp = store
    log_sweep(client, exp, "older", TABLE_TRIALS[:2], tasks=TASKS, tmp=tmp_path)
    latest = log_sweep(client, exp, "newer", [TABLE_TRIALS[0], TABLE_TRIALS[2]], tasks=TASKS, tmp=tmp_path)
    assert report_cli.main(["--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "# Report: newer" in out and str((tmp_path / "cli").resolve()) in out and "logged to the parent run" in out
    assert any(a.path == "report" for a in client.list_artifacts(latest))
    assert report_cli.main(["--sweep", latest, "--out", str(tmp_path / "byid"), "--no-log"]) == 0
    assert report_cli.main(["--sweep", "nope", "--no-log"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "newer" in err and "older" in err


def test_a_retried_trial_counts_once(store, tmp_path):
    client, exp = store
    failed = trial("promprune", 64, scores(0, 0, 0.0, 0.0), status="FAILED")
    parent = log_sweep(client, exp, "retry", [TABLE_TRIALS[0], failed, TABLE_TRIALS[1]], tasks=TASKS, tmp=tmp_path)
    sweep = load_sweep(parent)
    assert len(sweep.trials) == 2
    assert sweep.metrics.loc[TABLE_TRIALS_ID(sweep, "promprune", 64), "pope/pope_f1_score"] == pytest.approx(0.80)


def test_malformed_published_csv_names_the_problem(tmp_path):
    (tmp_path / "bad.csv").write_text("method,budget,variant,pope,source\npromprune,64,,high,x\n")
    with pytest.raises(ValueError, match=r"bad\.csv.*'pope'"):
        load_published("bad", tmp_path)
    (tmp_path / "nosource.csv").write_text("method,budget,pope\npromprune,64,80\n")
    with pytest.raises(ValueError, match=r"nosource\.csv.*missing column"):
        load_published("nosource", tmp_path)


def test_runs_as_a_script_from_any_directory(table_sweep, tmp_path):
    """`python pipelines/report.py` as the README says: the script finds its package without installation."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(report_cli.__file__)
    out = tmp_path / "script_out"
    proc = subprocess.run([sys.executable, str(script), "--sweep", "table_demo", "--out", str(out), "--no-log"],
                          cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "report.md").is_file() and (out / "tradeoff.png").is_file()
    assert str(out.resolve()) in proc.stdout


def test_a_score_with_failed_samples_carries_their_count(store, tmp_path):
    """A failed sample is replayed as a wrong answer, which POPE's F1 leaves out: every score shown to a person
    says how many of its samples failed (issue 21)."""
    client, exp = store
    trials = [trial("none", None, scores(1800, 300, 0.80, 0.60)),
              trial("promprune", 64, scores(1620, 270, 0.80, 0.57) | {"pope/n_failed": 5, "gqa/n_failed": 0})]
    parent = log_sweep(client, exp, "failed_demo", trials, tasks=TASKS, tmp=tmp_path)
    table = tables.build_score_table(load_sweep(parent))
    markdown = tables.score_table_markdown(table)
    (row,) = [line for line in markdown.splitlines() if line.startswith("| PromPrune") or "promprune" in line.lower()
              and "64" in line]
    assert "80.0 [5 failed]" in row and "57.0 [" not in row  # GQA had none
    csv = tables.score_table_csv(table)
    assert csv.loc[csv["method"] == "promprune", "POPE failed samples"].item() == 5


def test_the_default_image_source_draws_the_tasks_own_image():
    """The production default (no image_source): an offline task's real image, not the labelled stand-in (issue 24:
    it indexed Request records as dicts, and a broad except turned that into a stand-in on every report)."""
    from promprune.eval import build_requests

    from pipelines.reporting.build import task_image

    image, note = task_image("easyvqa_yesno", "3")
    assert note == ""
    (row,) = [r for r in build_requests(["easyvqa_yesno"], limit=4) if r.doc_id == 3]
    expected = np.asarray(Image.open(__import__("io").BytesIO(row.image)).convert("RGB"))
    assert image.shape == expected.shape and (image == expected).all()
    stand_in, note = task_image("easyvqa_yesno", "999999")
    assert "stand-in image" in note


def test_a_method_from_outside_is_reported_with_its_options(store, tmp_path):
    """A sweep's plugins are not imported where the report runs; its method's rows are still told apart by their
    options (every trial param but the model, tasks and such is an option)."""
    import promprune

    client, exp = store
    trials = [trial("none", None, scores(1800, 300, 0.80, 0.60)),
              trial("largest_norm", 64, scores(1620, 270, 0.80, 0.57), options={"p": 1.0}),
              trial("largest_norm", 64, scores(1530, 270, 0.72, 0.54), options={"p": 2.0})]
    sweep = load_sweep(log_sweep(client, exp, "outside", trials, tasks=TASKS, tmp=tmp_path))
    assert "largest_norm" not in promprune.methods(None) and sweep.option_names == ["p"]
    frame = tables.build_score_table(sweep).frame
    assert sorted(frame.loc[frame["method"] == "largest_norm", "variant"]) == ["p=1", "p=2"]
    assert sorted(frame.loc[frame["method"] == "largest_norm", "rel"].round(2)) == [
        pytest.approx(round((1530 / 1800 + 0.72 / 0.80 + 0.54 / 0.60) / 3 * 100, 2)),
        pytest.approx(round((1620 / 1800 + 1 + 0.57 / 0.60) / 3 * 100, 2))]


def test_a_tracking_server_that_does_not_answer_is_said_in_seconds(tmp_path):
    """Issue 57 item 4: against an unreachable tracking server the report waited 261 s (MLflow's retries) and ended
    in a traceback; it now says so in one paragraph, exit 2, before its imports load (time: benchmarks/frontdoor.py).
    A store file that does not exist is said the same way, and is not created."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(report_cli.__file__)
    for uri, needle in [(f"http://127.0.0.1:{port}", f"the MLflow store at http://127.0.0.1:{port} does not answer"),
                        (f"sqlite:///{tmp_path / 'none.db'}", f"there is no MLflow store at sqlite:///{tmp_path}")]:
        proc = subprocess.run([sys.executable, str(script), "--tracking-uri", uri], cwd=tmp_path, env=os.environ.copy(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "none.db").exists()


def test_a_server_that_answers_passes_the_probe_whatever_it_answers():
    """The probe asks `/health` (an MLflow server answers OK there); any HTTP answer means the server is up, and what
    it says is MLflow's client's to explain."""
    import http.server
    import threading

    for status in (200, 404, 401):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self, status=status):
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert report_cli.store_problem(f"http://127.0.0.1:{server.server_port}") is None
        finally:
            server.shutdown()
            server.server_close()


def test_an_unfinished_sweep_says_so_and_counts_the_trials_that_never_started(store, tmp_path, capsys):
    """Issue 57 item 4: a sweep killed midway printed dashes as if it had finished. Its parent run is still RUNNING
    (or KILLED): the report says the sweep is unfinished and how many of its planned trials never started, on the
    console and at the top of report.md."""
    client, exp = store
    parent = log_sweep(client, exp, "killed_demo", [trial("none", None, scores(1800, 300, 0.80, 0.60)),
                                                    trial("divprune", 64, scores(1700, 280, 0.78, 0.58))],
                       tasks=TASKS, tmp=tmp_path)
    client.log_param(parent, "trials", 5)  # what the sweep logs when it starts
    client.update_run(parent, status="RUNNING")  # its driver was SIGKILLed: nobody ended the run
    assert report_cli.main(["--sweep", "killed_demo", "--out", str(tmp_path / "out"), "--no-log"]) == 0
    err = capsys.readouterr().err
    said = ("the sweep is unfinished (its parent run is still RUNNING: the sweep is running, or its driver was "
            "killed): 2 trial(s) have a run, 2 finished; 3 of its 5 trials never started")
    assert said in err
    assert said in (tmp_path / "out" / "report.md").read_text()
    client.update_run(parent, status="KILLED")
    assert "it was interrupted (parent run KILLED)" in load_sweep(parent).unfinished()
    client.update_run(parent, status="FINISHED")
    assert load_sweep(parent).unfinished() is None


def test_a_plain_path_as_the_store_is_refused_as_a_sweep_refuses_it(tmp_path, capsys):
    """Audit: `--tracking-uri /x/mlflow.db` (a path, not sqlite:///) ended in MLflow's file-store traceback. It is
    refused as `sweep.py` refuses it (`preflight.check_store`), in one paragraph, exit 2, naming the URI to give; a
    folder (an old file store) is pointed at `mlflow migrate-filestore`."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    db = tmp_path / "x" / "mlflow.db"
    db.parent.mkdir()
    proc = subprocess.run([sys.executable, str(Path(report_cli.__file__)), "--tracking-uri", str(db)], cwd=tmp_path,
                          env=os.environ.copy(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert f"MLflow store {db}: plain file stores are refused by MLflow 3" in proc.stderr
    assert f"give --tracking-uri sqlite:///{db}" in proc.stderr
    assert list(db.parent.iterdir()) == [] and not (tmp_path / "reports").exists()
    assert report_cli.main(["--tracking-uri", db.parent.as_uri(), "--no-log"]) == 2
    err = capsys.readouterr().err
    assert "plain file stores are refused" in err and f"mlflow migrate-filestore --source {db.parent}" in err


def test_a_store_file_that_is_not_a_database_is_refused(tmp_path, monkeypatch, capsys):
    """Audit: a `./mlflow.db` (or a named SQLite file) that is no database ended in sqlalchemy's DatabaseError; it is
    refused as `sweep.py` refuses it, one paragraph, exit 2, before the report loads or writes anything."""
    junk = tmp_path / "mlflow.db"
    junk.write_text("junk\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for argv in (["--no-log"], ["--tracking-uri", f"sqlite:///{junk}"]):
        assert report_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"MLflow store sqlite:///{junk} does not answer" in err and "file is not a database" in err, err
        assert err.count("\n") == 1 and "--tracking-uri" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_a_read_only_store_is_read_with_no_log_and_refused_for_logging(mlflow_db, tmp_path, read_only):
    """A store the user cannot write: with --no-log the report only reads it (and says so if it is no database);
    without, `check_store` refuses it for the writes logging makes, and the report adds --no-log to the fix. Made
    read-only for real (root's writes pass `os.access` whatever the mode bits: a test write tells)."""
    from pathlib import Path

    junk = tmp_path / "junk" / "junk.db"
    junk.parent.mkdir()
    junk.write_text("junk\n")
    read_only(Path(mlflow_db[len("sqlite:///"):]))
    read_only(junk)
    assert report_cli.store_problem(mlflow_db, write=False) is None
    problem = report_cli.store_problem(mlflow_db)
    assert "is not writable" in problem and "pass --no-log" in problem
    problem = report_cli.store_problem(f"sqlite:///{junk}", write=False)
    assert f"cannot be read ({junk}: DatabaseError: file is not a database)" in problem


def test_a_store_in_a_read_only_folder_is_read_with_no_log_and_refused_for_logging(mlflow_db, tmp_path, read_only):
    """The database file writable, its folder not: SQLite cannot make its journal there, so logging the report
    would fail in MLflow; refused up front like a read-only file, and read with --no-log."""
    read_only(tmp_path)
    problem = report_cli.store_problem(mlflow_db)
    assert f"{tmp_path} is not writable" in problem and "journal" in problem and "pass --no-log" in problem
    assert report_cli.store_problem(mlflow_db, write=False) is None


def test_an_out_that_cannot_be_a_folder_is_refused_before_the_sweep_loads(mlflow_db, tmp_path, monkeypatch, capsys,
                                                                          read_only):
    """Audit: `--out` an existing file, below one, or in a folder that cannot be written ended in an OSError from
    `build_report`'s mkdir after the sweep loaded; it is refused in one paragraph naming --out, exit 2, before the
    sweep loads, and nothing is created (the default, reports/, likewise)."""
    from pipelines.reporting import store as store_module

    def no_load(*args, **kwargs):
        raise AssertionError("the sweep loaded before --out was checked")

    monkeypatch.setattr(store_module, "load_sweep", no_load)
    afile = tmp_path / "afile"
    afile.write_text("")
    locked = tmp_path / "ro"
    locked.mkdir()
    read_only(locked)
    for out, said in [(afile, f"--out {afile} is a file, not a folder"),
                      (afile / "sub", f"--out {afile / 'sub'} cannot be made: {afile} is a file, not a folder"),
                      (locked / "sub", f"--out {locked / 'sub'}: the report cannot write in {locked}")]:
        assert report_cli.main(["--out", str(out), "--no-log"]) == 2
        err = capsys.readouterr().err
        assert said in err and "give --out a folder you can write" in err and err.count("\n") == 1, err
    assert list(locked.iterdir()) == []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").write_text("")
    assert report_cli.main(["--no-log"]) == 2
    assert "the default --out reports is a file, not a folder" in capsys.readouterr().err


def test_a_grid_that_names_no_sweep_is_said_as_grid(store, tmp_path, capsys):
    """Audit: `--grid nonexist` was refused as "--sweep 'nonexist'"; the message names the flag given."""
    client, exp = store
    log_sweep(client, exp, "grid_demo", TABLE_TRIALS[:2], tasks=TASKS, tmp=tmp_path)
    assert report_cli.main(["--grid", "nonexist", "--out", str(tmp_path / "out"), "--no-log"]) == 2
    err = capsys.readouterr().err
    assert "--grid 'nonexist': no sweep run with that name or run id in experiment 'promprune'" in err
    assert err.endswith("(its sweeps: grid_demo)\n") and err.count("\n") == 1, err
    assert "--sweep" not in err and not (tmp_path / "out").exists()


def test_a_benchmark_the_baseline_scored_0_on_marks_every_rel(store, tmp_path):
    """The baseline scores 0 on POPE (every sample failed): the sweep calls Rel. undefined and logs none; the report's
    Rel. leaves POPE out of every row's average, so each says it is over 2 of 3 benchmarks and none is bolded as a
    budget's best against a full Rel. By hand: promprune (1620/1800 + 0.57/0.60) / 2 = 92.5 %; divprune (0.95 + 1) / 2
    = 97.5 %."""
    client, exp = store
    parent = log_sweep(client, exp, "zero_base", [
        trial("none", None, scores(1800, 300, 0.0, 0.60)),
        trial("promprune", 64, scores(1620, 270, 0.80, 0.57)),
        trial("divprune", 64, scores(1710, 290, 0.76, 0.60))], tasks=TASKS, tmp=tmp_path)
    table = tables.build_score_table(load_sweep(parent))
    rows = {line.split("|")[1].strip(): line for line in tables.score_table_markdown(table).splitlines()[2:]}
    assert rows["PromPrune"].endswith("| 92.5% (over 2 of 3 benchmarks) |")
    assert rows["DivPrune"].endswith("| 97.5% (over 2 of 3 benchmarks) |")
    assert "**9" not in rows["DivPrune"] and "**9" not in rows["PromPrune"]


def test_every_built_in_method_has_a_label_and_a_place_before_promprune():
    """Every method the package registers (in a fresh interpreter: no test's or plugin's method) is named in the
    tables and ordered among the baselines, PromPrune last (an extended table printed `cdpruner` raw, after
    PromPrune)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PROMPRUNE_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", "import promprune; print(' '.join(promprune.methods(None)))"],
                         capture_output=True, text=True, check=True, env=env).stdout.split()
    assert {"cdpruner", "dart", "pyramiddrop", "downsample", "promprune"} <= set(out)
    assert not [m for m in out if m not in tables.METHOD_LABELS or m not in tables.METHOD_ORDER]
    assert tables.METHOD_ORDER[-1] == "promprune" and tables.METHOD_ORDER[0] == "none"
    assert len(set(tables.METHOD_ORDER)) == len(tables.METHOD_ORDER)
    assert tables.METHOD_LABELS["cdpruner"] == "CDPruner" and tables.METHOD_LABELS["pyramiddrop"] == "PyramidDrop"


def _figures_made(monkeypatch) -> dict:
    """{file name: matplotlib figure} of every figure the report saves (saved as well)."""
    from pipelines.reporting import figures

    made, save = {}, figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, path: made.setdefault(path.name, fig) and save(fig, path))
    return made


def _lines(ax) -> dict:
    """{legend label: y values} of an axis' plotted lines."""
    return {line.get_label(): [float(y) for y in line.get_ydata()] for line in ax.get_lines()}


def test_no_cross_benchmark_mean_of_mixed_units_without_rel(store, tmp_path, monkeypatch):
    """No unpruned trial, so no Rel.: the trade-off curve and the mu x tau heatmap averaged raw lmms-eval scores,
    MME's points (1620) with POPE's fraction (0.80): (1620 + 0.80) / 2 = 810.4, no score of anything. Mixed units: one
    panel per benchmark in the paper's units (MME 1620 points, POPE 80.0 %), and no mean panel in the heatmap."""
    client, exp = store
    mp = ["mme", "pope"]

    def two(perception, pope, budget, **options):
        return trial("promprune", budget, {"mme/mme_perception_score": perception, "pope/pope_f1_score": pope},
                     options=options)
    log_sweep(client, exp, "mixed_units", [
        two(1620, 0.80, 64), two(1530, 0.72, 32),
        two(1600, 0.70, 16, mu=0.3, tau=0.01), two(1610, 0.71, 16, mu=0.3, tau=0.02),
        two(1500, 0.74, 16, mu=0.4, tau=0.01), two(1550, 0.76, 16, mu=0.4, tau=0.02)], tasks=mp, tmp=tmp_path)
    made = _figures_made(monkeypatch)
    build_report(load_sweep("mixed_units"), tmp_path / "out", image_source=grey_image)
    mme, pope = made["tradeoff.png"].axes[:2]
    assert (mme.get_ylabel(), pope.get_ylabel()) == ("MME (points)", "POPE (%)")
    assert _lines(mme)["PromPrune"][-2:] == pytest.approx([1530, 1620])  # budgets 32, 64 (the grid's 16 apart)
    assert _lines(pope)["PromPrune"][-2:] == pytest.approx([72.0, 80.0])
    titles = [ax.get_title() for ax in made["mu_tau_heatmap.png"].axes if ax.get_title()]
    assert len(titles) == 2 and titles[0].startswith("16 tokens, MME (points)")
    assert titles[1].startswith("16 tokens, POPE (%)") and not any("mean" in t for t in titles)


def test_one_units_mean_is_in_the_papers_units_and_rel_is_titled_as_the_paper_defines_it(store, tmp_path,
                                                                                         monkeypatch):
    """POPE and GQA both in percent: without a baseline, their mean in percent ((80 + 57) / 2 = 68.5 at 64 tokens),
    labelled so; with one, Rel. titled as the mean over benchmarks of each score over the unpruned one (it was
    "mean score / unpruned's", a ratio of means)."""
    client, exp = store

    def two(pope, gqa, budget):
        return trial("promprune", budget, {"pope/pope_f1_score": pope, "gqa/exact_match": gqa})
    log_sweep(client, exp, "percent_only", [two(0.80, 0.57, 64), two(0.72, 0.54, 32)], tasks=["pope", "gqa"],
              tmp=tmp_path)
    made = _figures_made(monkeypatch)
    build_report(load_sweep("percent_only"), tmp_path / "out", image_source=grey_image)
    (ax,) = [a for a in made["tradeoff.png"].axes]
    assert ax.get_ylabel() == "mean score over 2 benchmarks (%; no unpruned trial)"
    assert _lines(ax)["PromPrune"] == pytest.approx([63.0, 68.5])
    made.clear()
    log_sweep(client, exp, "table_demo", TABLE_TRIALS, tasks=TASKS, tmp=tmp_path)
    build_report(load_sweep("table_demo"), tmp_path / "rel", image_source=grey_image)
    (ax,) = made["tradeoff.png"].axes
    assert ax.get_title() == "Rel. (mean over benchmarks of score / unpruned score) against the token budget"
    assert _lines(ax)["PromPrune"] == pytest.approx([265 / 3, 95.0])  # the tables' Rel., hand-worked above


def _repeat_run(method, budget, pope, gqa, r):
    """Run ``r`` of a configuration a grid repeated (param ``repeat``), scored on POPE and GQA."""
    tid = ("baseline" if method == "none" else f"{method}-b{budget}") + (f"-r{r}" if r else "")
    return trial(method, budget, {"pope/pope_f1_score": pope, "gqa/exact_match": gqa}, options={"repeat": r}, tid=tid)


def test_repeated_runs_are_one_row_their_mean_with_sd_and_count(store, tmp_path, monkeypatch):
    """`tune.num_samples: 2` on a grid runs every configuration twice (param `repeat`): one row per configuration,
    the mean of its runs ± their sd, n=2, Rel. against the mean baseline, one line point per budget. By hand
    (POPE, GQA): baseline (.80, .60), (.82, .60) -> mean (.81, .60), POPE sd = 2 / sqrt 2 = 1.4 points; DivPrune@16
    (.70, .50), (.74, .52) -> (72.0, 51.0), sd 2.8 and 1.4, Rel. (.72 / .81 + .51 / .60) / 2 = 86.9 %, its runs' Rel.
    against the mean baseline 84.88 and 89.01: sd 2.9; PromPrune@16 twice (.76, .55): 92.7 %, sd 0."""
    client, exp = store
    run = _repeat_run
    log_sweep(client, exp, "repeats", [
        run("none", None, 0.80, 0.60, 0), run("none", None, 0.82, 0.60, 1),
        run("divprune", 16, 0.70, 0.50, 0), run("divprune", 16, 0.74, 0.52, 1),
        run("promprune", 16, 0.76, 0.55, 0), run("promprune", 16, 0.76, 0.55, 1),
        run("divprune", 8, 0.60, 0.40, 0), run("divprune", 8, 0.64, 0.40, 1),
        run("promprune", 8, 0.66, 0.45, 0), run("promprune", 8, 0.70, 0.47, 1)], tasks=["pope", "gqa"], tmp=tmp_path)
    made = _figures_made(monkeypatch)
    md = build_report(load_sweep("repeats"), tmp_path / "out", image_source=grey_image).markdown
    rows = [line for line in md.split("## Scores", 1)[1].split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    assert rows[1] == "| Upper bound | all | 81.0 ± 1.4, n=2 | 60.0 ± 0.0, n=2 | 100.0% ± 0.9, n=2 |"
    assert rows[2] == "| DivPrune | 16 | 72.0 ± 2.8, n=2 | 51.0 ± 1.4, n=2 | 86.9% ± 2.9, n=2 |"
    assert rows[3] == ("| PromPrune | 16 | **76.0** ± 0.0, n=2 | **55.0** ± 0.0, n=2 | **92.7%** ± 0.0, n=2 |")
    assert len(rows) == 6  # the header and five configurations
    assert "± sd, n: a configuration the sweep ran n times" in md and "- model: `tiny:llava`; trials: 10;" in md
    (ax,) = made["tradeoff.png"].axes
    assert _lines(ax)["PromPrune"] == pytest.approx([(0.68 / 0.81 + 0.46 / 0.60) * 50,  # one point per budget
                                                     (0.76 / 0.81 + 0.55 / 0.60) * 50])
    csv = pd.read_csv(tmp_path / "out" / "scores.csv").set_index("label")
    assert csv.loc["DivPrune", "POPE runs"].tolist() == [2, 2] and csv.loc["Upper bound", "Rel. (%)"] == 100.0


def test_a_repeated_rows_rel_spread_leaves_out_what_its_rel_leaves_out(store, tmp_path):
    """A baseline scoring 0 on POPE leaves POPE out of every Rel. (the row's, "over 1 of 2 benchmarks"), and so out
    of each run's Rel. behind the row's ± (each run's Rel. was NaN, n=0). By hand, over GQA alone against the mean
    baseline .61: .50 / .61 = 81.97 %, .56 / .61 = 91.80 %: mean 86.9, sd 6.95."""
    client, exp = store
    run = _repeat_run
    log_sweep(client, exp, "repeats0", [
        run("none", None, 0.0, 0.60, 0), run("none", None, 0.0, 0.62, 1),
        run("divprune", 16, 0.70, 0.50, 0), run("divprune", 16, 0.74, 0.56, 1)], tasks=["pope", "gqa"], tmp=tmp_path)
    md = tables.score_table_markdown(tables.build_score_table(load_sweep("repeats0").mean_over_repeats()))
    (row,) = [line for line in md.splitlines() if line.startswith("| DivPrune")]
    assert row.endswith("| 86.9% ± 7.0, n=2 (over 1 of 2 benchmarks) |"), row


def test_a_task_of_ones_own_with_no_number_logged_is_a_column_of_nan_or_dashes(store, tmp_path, capsys):
    """Probe Q: a task of one's own (include_path) whose process_results returned NaN in every trial has no number
    in MLflow (it keeps no NaN), only `<task>/<metric>_n_nan`; the report raised "no metric ... was logged" (a
    traceback, exit 1), and so for such a task in a sweep whose trials all failed. Now its column is there: "NaN"
    with the NaN samples' count where the count says the score was NaN, a dash where nothing was logged, as for a
    shipped task."""
    client, exp = store
    own = {"pope/pope_f1_score": 0.80, "own_task/n_samples": 6, "own_task/n_failed": 0}
    nan_trials = [trial("none", None, own | {"own_task/accuracy_n_nan": 1}),
                  trial("divprune", 64, own | {"pope/pope_f1_score": 0.72, "own_task/accuracy_n_nan": 2})]
    log_sweep(client, exp, "nan_demo", nan_trials, tasks=["own_task", "pope"], tmp=tmp_path)
    assert report_cli.main(["--sweep", "nan_demo", "--out", str(tmp_path / "nan"), "--no-log"]) == 0
    md = (tmp_path / "nan" / "report.md").read_text()
    assert "| Upper bound | all | NaN [1 NaN sample(s)] | 80.0 |" in md
    assert "| DivPrune | 64 | NaN [2 NaN sample(s)] | 72.0 |" in md
    assert "(`own_task`: accuracy)" in md  # the metric the count names, in percent as any `accuracy`
    csv = pd.read_csv(tmp_path / "nan" / "scores.csv")
    assert csv["own_task"].isna().all() and list(csv["own_task NaN samples"]) == [1, 2]

    failed = [trial("none", None, {}, status="FAILED"), trial("divprune", 64, {}, status="FAILED")]
    client.log_param(log_sweep(client, exp, "failed_demo", failed, tasks=["own_task", "pope"], tmp=tmp_path),
                     "trials", 2)
    assert report_cli.main(["--sweep", "failed_demo", "--out", str(tmp_path / "failed"), "--no-log"]) == 0
    md = (tmp_path / "failed" / "report.md").read_text()
    assert "(`own_task`: no metric logged)" in md and "| Method | Tokens | own_task | POPE | Rel. |" in md
    assert "Traceback" not in capsys.readouterr().err


def test_a_task_of_ones_own_is_shown_by_the_metric_its_yaml_lists_first_as_the_sweeps_rel(store, tmp_path):
    """Probe S: a task of one's own (include_path) whose YAML lists f1 before accuracy: the sweep's Rel. used f1
    (`primary_metrics`: the YAML's first), the report its fallback list (accuracy first), so the two disagreed (0.9941
    against 99.1%). The sweep logs the task's metric on its parent (`tracking.own_primary_metrics`, read from a real
    task folder here) and the report's column and Rel. use it. By hand: f1 .90 / .80 -> Rel. (.80 / .90 + .72 / .80) / 2
    = 89.4%; by accuracy (.50 / .60) it would be 86.7%."""
    from pipelines import mlflow_layout
    from pipelines.recording import tracking
    from pipelines import spec as specs
    from tests.own_task import write_task

    folder = tmp_path / "tasks" / "own_f1"
    write_task(folder, "own_f1", metrics=("f1", "accuracy"), questions=["q"])
    spec = specs.parse({"name": "own_f1", "version": 1, "model": {"pretrained": "tiny:llava"},
                        "tasks": ["own_f1", "pope"], "include_path": [str(folder)], "baseline": True,
                        "grid": {"method": ["divprune"], "budget": [64]}})
    params = tracking.own_primary_metrics(spec)
    assert params == {mlflow_layout.PRIMARY_PARAM: '{"own_f1": ["f1"]}'}  # POPE: promprune.eval names its metric
    client, exp = store
    rows = [trial("none", None, {"own_f1/f1": 0.90, "own_f1/accuracy": 0.60, "pope/pope_f1_score": 0.80}),
            trial("divprune", 64, {"own_f1/f1": 0.80, "own_f1/accuracy": 0.50, "pope/pope_f1_score": 0.72})]
    for name, logged in (("own_f1_old", {}), ("own_f1_new", params)):
        parent = log_sweep(client, exp, name, rows, tasks=["own_f1", "pope"], tmp=tmp_path)
        for key, value in logged.items():
            client.log_param(parent, key, value)
    table = tables.build_score_table(load_sweep("own_f1_new"))
    assert [c.metrics for c in table.columns] == [("f1",), ("pope_f1_score",)]
    assert table.frame.set_index("method").loc["divprune", "rel"] == pytest.approx((0.80 / 0.90 + 0.72 / 0.80) * 50)
    old = tables.build_score_table(load_sweep("own_f1_old"))  # a store without the param: the fallback, as before
    assert old.frame.set_index("method").loc["divprune", "rel"] == pytest.approx((0.50 / 0.60 + 0.72 / 0.80) * 50)


def test_a_run_recorded_before_the_primary_param_takes_its_metric_from_its_recorded_include_path(store, tmp_path):
    """A parent run recorded without `mlflow_layout.PRIMARY_PARAM` (before 2026-12-08) of a task of one's own whose
    YAML lists f1 before accuracy: the report resolves the task through the `include_path` its `spec.yaml` records
    (the resolved spec the sweep logs), as the sweep did, and shows f1; once that folder is gone, the fallback list
    (accuracy first), as before. By hand: f1 .90 / .80 -> Rel. (.80 / .90 + .72 / .80) / 2 = 89.4%; by accuracy
    (.50 / .60) 86.7%."""
    import shutil

    from pipelines import spec as specs
    from tests.own_task import write_task

    folder = tmp_path / "tasks" / "own_f1_rec"
    write_task(folder, "own_f1_rec", metrics=("f1", "accuracy"), questions=["q"])
    spec = specs.parse({"name": "own_f1_rec", "version": 1, "model": {"pretrained": "tiny:llava"},
                        "tasks": ["own_f1_rec", "pope"], "include_path": [str(folder)], "baseline": True,
                        "grid": {"method": ["divprune"], "budget": [64]}})
    client, exp = store
    rows = [trial("none", None, {"own_f1_rec/f1": 0.90, "own_f1_rec/accuracy": 0.60, "pope/pope_f1_score": 0.80}),
            trial("divprune", 64, {"own_f1_rec/f1": 0.80, "own_f1_rec/accuracy": 0.50, "pope/pope_f1_score": 0.72})]
    parent = log_sweep(client, exp, "own_f1_rec", rows, tasks=["own_f1_rec", "pope"], tmp=tmp_path)
    client.log_text(parent, specs.dump_resolved(spec), "spec.yaml")  # what tracking.start_sweep records
    table = tables.build_score_table(load_sweep("own_f1_rec"))
    assert [c.metrics for c in table.columns] == [("f1",), ("pope_f1_score",)]
    assert table.frame.set_index("method").loc["divprune", "rel"] == pytest.approx((0.80 / 0.90 + 0.72 / 0.80) * 50)
    shutil.rmtree(folder)  # the task folder is not where the report runs: its fallback list, as before
    gone = tables.build_score_table(load_sweep("own_f1_rec"))
    assert [c.metrics for c in gone.columns] == [("accuracy",), ("pope_f1_score",)]
    assert gone.frame.set_index("method").loc["divprune", "rel"] == pytest.approx((0.50 / 0.60 + 0.72 / 0.80) * 50)


def test_no_figure_of_empty_axes_when_no_trial_has_a_number(store, tmp_path, monkeypatch):
    """Probe Q: a sweep none of whose pruned trials finished drew `ablation_bars.png` with a legend and no bar (and two
    budgets of them an empty trade-off curve). The score figures are skipped, and the report says so; a trial with no
    number beside two with one gets no bar of its own."""
    client, exp = store
    unfinished = [trial("none", None, scores(1800, 300, 0.80, 0.60)),
                  trial("divprune", 64, {}, status="FAILED"), trial("promprune", 64, {}, status="FAILED"),
                  trial("divprune", 32, {}, status="FAILED"), trial("promprune", 32, {}, status="FAILED")]
    log_sweep(client, exp, "nothing_demo", unfinished, tasks=TASKS, tmp=tmp_path)
    made = _figures_made(monkeypatch)
    report = build_report(load_sweep("nothing_demo"), tmp_path / "out", image_source=grey_image)
    assert made == {} and not list((tmp_path / "out").glob("*.png"))
    assert "Score figures skipped: no pruned trial has a score or a Rel. to draw" in report.markdown

    some = [trial("none", None, scores(1800, 300, 0.80, 0.60)), trial("divprune", 64, scores(1710, 290, 0.76, 0.60)),
            trial("promprune", 64, scores(1620, 270, 0.80, 0.57)), trial("random", 64, {}, status="FAILED")]
    log_sweep(client, exp, "some_demo", some, tasks=TASKS, tmp=tmp_path)
    report = build_report(load_sweep("some_demo"), tmp_path / "some", image_source=grey_image)
    (ax,) = made["ablation_bars.png"].axes
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["DivPrune", "PromPrune"]
    assert "Score figures skipped" not in report.markdown
