"""Screenshots of the MLflow UI as a researcher sees it after a sweep, for the README (and a check that it works).

    python scripts/ui_screenshots.py [--tracking-uri URI] [--sweep NAME] [--out docs/screenshots]

Starts `mlflow ui` on the store (default: the pipeline's, `$MLFLOW_TRACKING_URI` or ./mlflow.db) on 127.0.0.1 and
a free port, opens it in headless Chromium through Playwright, and saves:

  1_runs.png         the experiment's runs page through the link the sweep prints (its saved view: the parent
                     run above one row per trial; each trial's method, mu, tau and Rel. checked in its row)
  2_trial.png        one trial run's page (metrics, duration, tags)
  3_report_md.png    the sweep's parent run, artifacts, report/report.md (tables)
  4_report_html.png  report/report.html scrolled to its figures

Before each screenshot it checks the page in the DOM (the runs table: the parent run first, each trial's name,
method, mu, tau and Rel. in its row as MLflow holds them, on the screen; the view's line charts of running values,
when a trial has one, against samples/scored; the run's name and duration; the report's title and figures) and
fails when one is missing. The server is stopped afterwards.
Needs `pip install -c constraints.txt -e ".[ui]"` (Playwright) and a Chromium: Debian's (`apt-get install chromium`,
/usr/bin/chromium) or `--chromium PATH`; Playwright's own browser download is not needed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines import mlflow_layout  # noqa: E402

VIEWPORT = {"width": 1400, "height": 900}
# what a returning user sees: the MLflow Assistant panel (opened by itself on a first visit) closed
BROWSER_STATE = {"mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true", "mlflow.assistant.panelOpen_v1": "false"}


class Problem(Exception):
    """Something the user can fix; printed as one paragraph, no traceback."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI or "
                   "sqlite:///mlflow.db in the working directory)")
    p.add_argument("--sweep", default=None, help="sweep name (its latest finished run); default: the latest sweep")
    p.add_argument("--out", default=str(REPO / "docs" / "screenshots"), help="folder for the PNGs")
    p.add_argument("--chromium", default=None, help="Chromium executable (default: /usr/bin/chromium or chromium "
                                                    "on PATH)")
    p.add_argument("--timeout", type=float, default=120, help="seconds to wait for the server and for each page")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# what to show


def find_runs(uri: str, sweep: str | None) -> dict:
    """The experiment, the sweep's parent run, one trial run and whether the parent has a report."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise Problem(f"no MLflow store at {uri}: run a sweep first (python pipelines/sweep.py) in this directory, "
                      "or pass --tracking-uri")
    c = MlflowClient(uri)
    name = mlflow_layout.experiment_name()
    try:
        exp = c.get_experiment_by_name(name)
    except Exception as e:  # noqa: BLE001 - an unreadable store is the user's to fix
        raise Problem(f"cannot read the MLflow store {uri}: {e}") from None
    if exp is None:
        raise Problem(f"the MLflow store {uri} has no experiment {name!r}: run a sweep first "
                      "(python pipelines/sweep.py) or pass --tracking-uri")
    filters = [mlflow_layout.tag_filter(mlflow_layout.ROLE, mlflow_layout.ROLE_SWEEP)]
    filters += [mlflow_layout.tag_filter(mlflow_layout.SWEEP, sweep)] if sweep else []
    parents = [r for r in c.search_runs([exp.experiment_id], " and ".join(filters),
                                        order_by=["attributes.start_time DESC"], max_results=50)
               if r.info.status == "FINISHED"]
    if not parents:
        raise Problem(f"experiment {name!r} in {uri} has no finished sweep"
                      + (f" named {sweep!r}" if sweep else "") + ": run python pipelines/sweep.py first")
    parent = parents[0]
    trials = c.search_runs([exp.experiment_id], mlflow_layout.tag_filter(mlflow_layout.PARENT, parent.info.run_id),
                           order_by=["attributes.start_time ASC"], max_results=1000)
    finished = [r for r in trials if r.info.status == "FINISHED"]
    if not finished:
        raise Problem(f"sweep {parent.info.run_name!r} ({parent.info.run_id}) has no finished trial run")
    shown = next((r for r in finished if r.data.params.get("method") == "promprune"), None) or finished[-1]
    report = {a.path for a in c.list_artifacts(parent.info.run_id, mlflow_layout.REPORT_DIR)}
    sweep_name = parent.data.tags.get(mlflow_layout.SWEEP, parent.info.run_name)
    # this run's own view (the link its sweep printed), else the one view per sweep that earlier versions saved
    keys = [mlflow_layout.view_key(sweep_name, parent.info.run_id), mlflow_layout.view_key(sweep_name)]
    return {"experiment": exp.experiment_id, "parent": parent, "trials": trials, "shown": shown,
            "report": report, "view": next((k for k in keys if mlflow_layout.SAVED_VIEW + k in exp.tags), None),
            "lines": any(_has_line(c, r) for r in trials)}


def _has_line(c, run) -> bool:
    """Whether a trial has a running value at two steps or more (the runs page draws it as a line chart)."""
    running = [k for k in run.data.metrics if k.startswith(f"{mlflow_layout.RUNNING}/")]
    return bool(running) and len(c.get_metric_history(run.info.run_id, running[0])) >= 2


def expected_cells(run) -> dict[str, str | float]:
    """What a trial's row must show, by the runs table's column ids: its method, mu and tau (the params it has) and
    its Rel. (a trial a scheduler stopped: its running Rel.)."""
    params, metrics = run.data.params, run.data.metrics
    want: dict[str, str | float] = {"params.`method`": params.get("method", "")}
    want |= {f"params.`{k}`": params[k] for k in mlflow_layout.MU_TAU if k in params}
    for key in (mlflow_layout.REL, f"{mlflow_layout.RUNNING}/{mlflow_layout.REL}"):
        if key in metrics:
            want[f"metrics.`{key}`"] = metrics[key]
            break
    return want


def table_problems(cells: dict[str, dict[str, str]], trials: list) -> list[str]:
    """Each trial's `expected_cells` against the table's cells ({run id: {column id: text}}): what is missing or
    differs (a metric's text is read as a number: the UI writes 16.0 as 16)."""
    problems = []
    for run in trials:
        row = cells.get(run.info.run_id, {})
        for col, want in expected_cells(run).items():
            got = row.get(col)
            if got is None:
                problems.append(f"{run.info.run_name}: no {col} cell on the screen")
            elif isinstance(want, float) and not _same_number(got, want) or isinstance(want, str) and got != want:
                problems.append(f"{run.info.run_name}: {col} shows {got!r}, MLflow holds {want!r}")
    return problems


def _same_number(text: str, value: float) -> bool:
    try:
        return abs(float(text) - value) <= 1e-12 * max(1.0, abs(value))
    except ValueError:
        return False


# the runs table's cells ag-grid has rendered (those on the screen): {run id: {column id: text, ROW: row index}}
ROW = "#row"
TABLE_CELLS_JS = """() => { const out = {};
  for (const cell of document.querySelectorAll('.ag-row .ag-cell')) {
    const row = cell.closest('.ag-row'), id = row.getAttribute('row-id');
    out[id] = out[id] || {'%s': row.getAttribute('row-index')};
    out[id][cell.getAttribute('col-id')] = cell.textContent.trim(); }
  return out; }""" % ROW


# ----------------------------------------------------------------------------------------------------------------
# the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow ui` in its own process group (it starts workers), stopped as a group."""

    def __init__(self, uri: str, timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mlflow-ui-", suffix=".log", delete=False)
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner: a faster start
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Problem(f"mlflow ui exited with code {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise Problem(f"mlflow ui did not answer on {self.url} within {timeout:.0f}s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return " | ".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-5:])

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        self.log.close()
        os.unlink(self.log.name)


# ----------------------------------------------------------------------------------------------------------------
# the browser


def chromium_path(given: str | None) -> str:
    path = given or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else shutil.which("chromium"))
    if not path or not os.access(path, os.X_OK):
        raise Problem("no Chromium found" + (f" at {given}" if given else " (/usr/bin/chromium or chromium on "
                                             "PATH)") + ": install Debian's with `apt-get install chromium`, or "
                      "pass --chromium PATH")
    return path


def require_playwright() -> None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        raise Problem("Playwright is not installed: pip install -c constraints.txt -e \".[ui]\" "
                      "(its browser download is not needed; Debian's Chromium is used)") from None


def shoot(runs: dict, base: str, out: Path, chromium: str, timeout: float) -> list[Path]:
    from playwright.sync_api import sync_playwright

    ms = timeout * 1000
    exp, parent, shown = runs["experiment"], runs["parent"], runs["shown"]
    q = "?workflowType=machine_learning"
    saved = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, timeout=ms)  # Playwright's own is 30 s
        ctx = browser.new_context(viewport=VIEWPORT)
        ctx.set_default_timeout(ms)  # clicks and typing too: a loaded machine renders the page late
        ctx.add_init_script("".join(f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});"
                                    for k, v in BROWSER_STATE.items()))
        page = ctx.new_page()

        def save(name: str) -> None:
            page.wait_for_timeout(800)  # let the last layout pass and fonts settle
            path = out / name
            page.screenshot(path=str(path))
            saved.append(path)

        # what a bare experiment link opens on (MLflow 3.17's default GenAI side ignores mlflow.experimentKind)
        page.goto(f"{base}/#/experiments/{exp}")
        page.wait_for_url(lambda u: "/overview" in u or "/runs" in u or "/traces" in u, timeout=ms)
        bare = page.url.split("#", 1)[1].split("?")[0]
        # 1: the runs, as the link printed by the sweep opens them
        link = mlflow_layout.ui_url(exp, runs["view"], base=base)  # what the sweep printed, on this server
        page.goto(link)
        for trial in runs["trials"]:
            name = trial.info.run_name
            shows(page.get_by_text(name, exact=True).first, f"the runs table's row {name}", ms)
        # the metric and param cells fill in after the names, later on a loaded machine: read until they show
        deadline = time.monotonic() + timeout
        while True:
            cells = page.evaluate(TABLE_CELLS_JS)
            problems = table_problems(cells, runs["trials"])
            if not problems or time.monotonic() > deadline:
                break
            page.wait_for_timeout(500)
        if runs["view"] and cells.get(parent.info.run_id, {}).get(ROW) != "0":
            problems.insert(0, f"the parent run {parent.info.run_name} is not the first row")
        if problems:
            raise RuntimeError(f"the runs table at {VIEWPORT['width']} px does not show what MLflow holds: "
                               + "; ".join(problems[:6]))
        save("1_runs.png")
        axes = chart_axes(page, link, ms) if runs["lines"] and runs["view"] else None
        # 2: one trial run
        page.goto(f"{base}/#/experiments/{exp}/runs/{shown.info.run_id}{q}")
        shows(page.get_by_role("heading", name=shown.info.run_name).first, "the trial run's page", ms)
        shows(page.get_by_text("Duration", exact=True).first, "the trial run's duration", ms)
        save("2_trial.png")
        report = f"{base}/#/experiments/{exp}/runs/{parent.info.run_id}/artifacts/{mlflow_layout.REPORT_DIR}"
        has_md = f"{mlflow_layout.REPORT_DIR}/report.md" in runs["report"]
        if has_md:
            page.goto(f"{report}/report.md{q}")
            shows(page.get_by_role("heading", name=f"Report: {parent.info.run_name}").first, "report.md", ms)
            save("3_report_md.png")
        if f"{mlflow_layout.REPORT_DIR}/report.html" in runs["report"]:
            if has_md:  # as a user does: a click in the artifact tree (a changed URL alone keeps report.md shown)
                page.get_by_text("report.html", exact=True).first.click()
            else:
                page.goto(f"{report}/report.html{q}")
            frame = page.frame_locator("iframe").first
            shows(frame.locator("h2", has_text="Figures"), "report.html's figures section", ms)
            figure = frame.locator("img").first
            shows(figure, "report.html's first figure", ms)
            figure.evaluate("img => img.scrollIntoView({block: 'center'})")
            if not figure.evaluate("img => img.complete && img.naturalWidth > 0"):
                raise Problem("report.html shows no figure in MLflow's artifact viewer")
            save("4_report_html.png")
        browser.close()
    print(f"a bare experiment link (#/experiments/{exp}) opens on #{bare} in a fresh browser; the sweep's link: "
          f"#{link.split('#', 1)[1]}")
    if axes is not None:
        print(f"its charts: {axes} line charts of running values against {mlflow_layout.SCORED}")
    return saved


# each line chart on the runs page's chart view: [its card's title (the metric), its x axis's title]
CHART_AXES_JS = """() => Array.from(document.querySelectorAll('.xtitle')).map(axis => {
  const card = axis.closest('[data-testid="experiment-view-compare-runs-card"]');
  return [card ? card.innerText.trim().split('\\n')[0] : '', axis.textContent]; })"""


def shows(locator, what: str, ms: float) -> None:
    """Wait for ``locator``; a RuntimeError naming ``what`` when it does not show."""
    from playwright.sync_api import TimeoutError as PageTimeout

    try:
        locator.wait_for(timeout=ms)
    except PageTimeout:
        raise RuntimeError(f"{what} did not show within {ms / 1000:.0f}s") from None


def chart_axes(page, link: str, ms: float) -> int:
    """The view's charts of running values (the charts' search box set to `running/`, on a page tall enough to draw
    them): each line chart's x axis must be named `samples/scored`, not MLflow's "Step"; returns how many there
    are."""
    page.set_viewport_size({"width": VIEWPORT["width"], "height": 2400})
    page.goto(link + "&compareRunsMode=CHART")
    search = page.get_by_placeholder("Search metric charts").first
    shows(search, "the charts' search box", ms)
    search.fill(f"{mlflow_layout.RUNNING}/")  # the charts of running values alone, first
    page.wait_for_timeout(800)  # the filter applies after a debounce
    shows(page.locator(".xtitle").first, "a line chart of a running value", ms)
    charts, waited = [], 0.0
    while waited < ms:  # the charts draw one by one after the filter (slowly on a busy machine): poll, not one wait
        page.wait_for_timeout(400)
        waited += 400
        drawn = [(t, x) for t, x in page.evaluate(CHART_AXES_JS) if t.startswith(f"{mlflow_layout.RUNNING}/")]
        if drawn and drawn == charts:  # the same charts twice in a row: all drawn
            break
        charts = drawn
    page.set_viewport_size(VIEWPORT)
    wrong = sorted({f"{t}: {x}" for t, x in charts if x != mlflow_layout.SCORED})
    if not charts or wrong:
        raise RuntimeError(f"the view's charts of running values have x axes {wrong or 'nowhere'}, not "
                           f"{mlflow_layout.SCORED}")
    return len(charts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    uri = mlflow_layout.tracking_uri(args.tracking_uri)
    out = Path(args.out)
    server = None
    try:
        chromium = chromium_path(args.chromium)
        runs = find_runs(uri, args.sweep)  # the user's inputs first, then what to install
        require_playwright()
        out.mkdir(parents=True, exist_ok=True)
        server = Server(uri, args.timeout)
        saved = shoot(runs, server.url, out, chromium, args.timeout)
    except Problem as e:
        print(f"ui_screenshots: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a page that never showed what it should: say which, briefly
        print(f"ui_screenshots: the UI check failed: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    print(f"mlflow ui ran on {server.url} and is stopped")
    parent = runs["parent"]
    print(f"sweep {parent.info.run_name!r} (parent run {parent.info.run_id}), {len(runs['trials'])} trial runs "
          f"shown in the runs table; saved view: {runs['view'] or 'none (a sweep from before saved views)'}")
    shown = sorted({col.split("`")[1] for run in runs["trials"] for col in expected_cells(run)})
    print(f"each trial's {', '.join(shown)} in its row as MLflow holds them, at {VIEWPORT['width']} px")
    if not runs["report"]:
        print("no report/ artifacts: run python pipelines/report.py for the report screenshots")
    for path in saved:
        print(f"{path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
