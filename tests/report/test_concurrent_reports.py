"""Two reports of one sweep name at once (two people, or a nightly's report and a manual one): both write the
default folder ``reports/<sweep name>/``, and each must log its own files to its own parent run."""
from __future__ import annotations

import csv
import io

from pipelines import paths
from pipelines import report as report_cli
from pipelines.reporting import build as build_mod

from .conftest import log_sweep, trial

TASKS = ["pope", "gqa"]


def _scores(pope, gqa):
    return {"pope/pope_f1_score": pope, "gqa/exact_match": gqa}


def _trial_ids(client, exp, parent) -> set[str]:
    runs = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent}'")
    return {r.info.run_id for r in runs}


def _csv_run_ids(text: str) -> set[str]:
    return {row["run_id"] for row in csv.DictReader(io.StringIO(text))}


def _logged(client, parent, name) -> str:
    path = client.download_artifacts(parent, f"report/{name}")
    with open(path) as f:
        return f.read()


def test_a_report_run_while_another_writes_the_same_folder_logs_only_its_own_files(store, tmp_path, monkeypatch):
    """Report B builds its files in reports/shared/; before it logs them, report A (another process, another run of
    the same sweep name) writes the same folder and logs. B's parent run must get B's tables, not A's (it got A's
    scores.csv, efficiency.csv and figures: the two processes' files had the same names in the same folder)."""
    client, exp = store
    a = log_sweep(client, exp, "shared", [trial("none", None, _scores(0.8, 0.6)),
                                          trial("divprune", 64, _scores(0.7, 0.5))], tasks=TASKS, tmp=tmp_path)
    b = log_sweep(client, exp, "shared", [trial("none", None, _scores(0.9, 0.7)),
                                          trial("promprune", 64, _scores(0.85, 0.65))], tasks=TASKS, tmp=tmp_path)
    monkeypatch.chdir(tmp_path)  # the default --out: reports/shared/ here
    real, others = build_mod.build_report, []

    def build_then_the_other_report(sweep, out_dir, **kw):
        report = real(sweep, out_dir, **kw)
        if sweep.run_id == b and not others:  # the other report runs to its end between B's writing and logging
            others.append(report_cli.main(["--sweep", a]))
        return report

    monkeypatch.setattr(build_mod, "build_report", build_then_the_other_report)
    assert report_cli.main(["--sweep", b]) == 0 and others == [0]
    for parent in (a, b):
        logged = _logged(client, parent, "scores.csv")
        assert _csv_run_ids(logged) == _trial_ids(client, exp, parent), f"run {parent} holds another run's table"
        assert f"parent run: `{parent}`" in _logged(client, parent, "report.md")
    # the folder holds one report whole (the last to finish), not a mix of the two
    folder = tmp_path / "reports" / "shared"
    last = b if f"parent run: `{b}`" in (folder / "report.md").read_text() else a
    assert _csv_run_ids((folder / "scores.csv").read_text()) == _trial_ids(client, exp, last)
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != ".report.lock"]


def test_a_report_publishes_only_once_the_other_report_in_that_folder_has(store, tmp_path, monkeypatch):
    """While another report holds the folder's lock (publishing its files), this one builds aside and copies nothing
    into the folder; once the lock is let go, its whole report lands there."""
    import threading

    from promprune.atomic import locked

    client, exp = store
    a = log_sweep(client, exp, "shared", [trial("none", None, _scores(0.8, 0.6)),
                                          trial("divprune", 64, _scores(0.7, 0.5))], tasks=TASKS, tmp=tmp_path)
    folder = tmp_path / "reports" / "shared"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    codes = []
    with locked(folder / paths.OUT_LOCK):
        worker = threading.Thread(target=lambda: codes.append(report_cli.main(["--sweep", a, "--no-log"])))
        worker.start()
        for _ in range(600):  # its build done aside (report.html is written last), so it is at the lock now
            if any(folder.glob(".building-*/report.html")) or not worker.is_alive():
                break
            worker.join(0.1)
        assert any(folder.glob(".building-*/report.html")), "the report was not built aside"
        worker.join(1.0)
        assert worker.is_alive() and not (folder / "report.md").exists()
    worker.join(60)
    assert codes == [0] and f"parent run: `{a}`" in (folder / "report.md").read_text()
    assert _csv_run_ids((folder / "scores.csv").read_text()) == _trial_ids(client, exp, a)
