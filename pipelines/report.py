"""Turn a finished sweep in MLflow into the paper's tables and figures.

    python pipelines/report.py [--sweep NAME_OR_RUN_ID] [--grid NAME_OR_RUN_ID] [--out DIR] [--tracking-uri URI]
                               [--no-log]

Reads the sweep's runs with `mlflow.search_runs` (default: the latest sweep in the store at
`MLFLOW_TRACKING_URI`, else sqlite:///mlflow.db, in the sweeps' experiment: `promprune`, or
`MLFLOW_EXPERIMENT_NAME`), writes `report.md`, CSV tables and PNG figures to DIR
(default `reports/<sweep name>/`), logs them as artifacts of the sweep's parent run (folder `report/`), and prints
where they are. The files are built in a hidden folder of DIR of this report's own and logged from there, then copied
into DIR while holding its lock (`.report.lock`): two reports into one folder at once (two runs of a sweep name) each
log their own files, and the folder holds the last to finish whole (an earlier report's other files stay
beside it). Published numbers shipped under `pipelines/paper_results/` appear beside ours with deltas.

A mistake is said in one paragraph, exit 2, without a traceback: in seconds and before the sweep loads, an --out that
cannot be a folder (a file, or below one; a folder that cannot be written) and a store that cannot be read (a
tracking server that is down or unreachable, a SQLite file that does not exist or is not a database, a plain path,
which MLflow 3 refuses as a file store); then a --sweep or --grid that names no sweep in the experiment (naming
the other experiments that hold one). A sweep that did
not finish (killed, interrupted, still running) is reported with what it has, its first line saying so and how many
of its trials never started; where no pruned trial has a number (all failed or unfinished), its score figures are
skipped and the report says so (no axes drawn empty).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

if __name__ == "__main__" and (Path(__file__).resolve().parents[1] / "pyproject.toml").is_file():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: its packages first

from pipelines import paths
from pipelines.mlflow_layout import sqlite_path, tracking_uri
from pipelines.paths import out_problem, refuses_file_writes, refuses_writes

PROBE_TIMEOUT_S = 5.0  # one request: a server that is down refuses at once, one that never answers times out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default=None, help="sweep name (its latest run) or parent run id, in the experiment "
                        "$MLFLOW_EXPERIMENT_NAME (default promprune); default: the latest")
    parser.add_argument("--grid", default=None,
                        help="a grid sweep over the same (mu, tau) (name or parent run id): drawn beside a search, "
                             "which is compared with its best point and its samples (beside a sweep that is not a (mu, "
                             "tau) search, a one-line note says it was not drawn)")
    parser.add_argument("--out", default=None, help="output folder; default: reports/<sweep name>")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store; default: $MLFLOW_TRACKING_URI or "
                                                             "sqlite:///mlflow.db")
    parser.add_argument("--no-log", action="store_true", help="write files only, log nothing to MLflow")
    return parser.parse_args(argv)


def safe_dir_name(name: str) -> str:
    """A sweep name (an MLflow tag anyone with store access can write) as one harmless directory name: no path
    separators, no leading dots, nothing but letters, digits, '-', '_' and '.'."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).lstrip(".")
    return cleaned[:120] or "sweep"


def store_problem(uri: str, *, write: bool = True) -> str | None:
    """Why the MLflow store at ``uri`` cannot be read (None: it answers). A SQLite file that does not exist and a server
    that does not answer one plain HTTP request within seconds (MLflow's client would retry for minutes) are said with
    the standard library, before MLflow, pandas and matplotlib load. Any other store is `preflight.check_store`'s, as a
    sweep's is (a plain path, which MLflow 3 refuses as a file store; a SQLite file that is no database or cannot be
    written; a store MLflow cannot open), followed by how to name a store to the report. ``write=False`` (--no-log): a
    SQLite file this user cannot write is only read, so it only has to be a database."""
    import urllib.error
    import urllib.request

    fix = "point --tracking-uri (or MLFLOW_TRACKING_URI) at the store the sweep wrote"
    path = sqlite_path(uri)
    if path is not None and not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        return f"there is no MLflow store at {uri} ({path} {what}); {fix}"
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S).close()
        except urllib.error.HTTPError:
            return None  # it answered (an error status is MLflow's to explain)
        except (OSError, ValueError) as exc:  # refused, timed out, no route, a malformed address
            reason = getattr(exc, "reason", None) or exc
            return (f"the MLflow store at {uri} does not answer ({type(reason).__name__}: {str(reason)[:200]}); start "
                    "its server (`mlflow server ...`, or cluster.yaml's on the head, reached through `ray attach "
                    f"cluster.yaml -p 5000`) or {fix}")
        return None
    # a test write (os.access says yes to root): the file, and its folder, where SQLite writes its journal
    read_only = path is not None and bool(refuses_file_writes(path) or refuses_writes(path.parent))
    if read_only and not write:
        return _unreadable_sqlite(uri, path, fix)  # check_store would refuse it for the writes a sweep makes
    from pipelines.preflight import check_store

    problems = check_store(uri)
    if not problems:
        return None
    scheme = urlparse(uri).scheme
    if read_only:
        hint = "or pass --no-log to read it without logging the report to it"
    elif scheme in ("", "file"):
        local = Path(urlparse(uri).path if scheme == "file" else uri)
        hint = (f"for a SQLite store in that file, give --tracking-uri sqlite:///{local}" if not local.is_dir() else
                f"{local} is a folder: if it is an MLflow file store, `mlflow migrate-filestore --source {local} "
                "--target sqlite:///mlflow.db` copies it into a SQLite store to name as --tracking-uri sqlite:///mlflow.db")
    else:
        hint = fix
    return f"{'; '.join(problems)}; {hint}"


def _unreadable_sqlite(uri: str, path: Path, fix: str) -> str | None:
    """Why the SQLite file ``path``, opened read-only, is no database (None: it is one); standard library only."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            db.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.Error as exc:
        return f"the MLflow store at {uri} cannot be read ({path}: {type(exc).__name__}: {exc}); {fix}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    uri = tracking_uri(args.tracking_uri)
    # before the report's imports (pandas, matplotlib), MLflow's minutes of retries and loading the sweep
    problem = (out_problem(Path(args.out or "reports"), "the report", default=not args.out)
               or store_problem(uri, write=not args.no_log))
    if problem:
        print(f"report: {problem}", file=sys.stderr)
        return 2
    import mlflow

    from pipelines.reporting.build import build_report, log_report
    from pipelines.reporting.store import load_sweep

    mlflow.set_tracking_uri(uri)
    try:
        sweep = load_sweep(args.sweep, "--sweep")
        grid = None if args.grid is None else load_sweep(args.grid, "--grid")
    except LookupError as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("reports") / safe_dir_name(sweep.name)
    # the default's folder, now the sweep names it
    problem = None if args.out else out_problem(out, "the report", default=True)
    if problem:
        print(f"report: {problem}", file=sys.stderr)
        return 2
    unfinished = sweep.unfinished()
    if unfinished:
        print(f"report: {unfinished}", file=sys.stderr, flush=True)
    with paths.staging_folder(out) as staging:  # its own files, whatever another report writes to ``out``
        built = build_report(sweep, staging, grid=grid)
        report = publish(built, out)
        print(report.markdown)
        print(f"report for sweep {sweep.name!r} (parent run {sweep.run_id}): {len(report.files)} files in "
              f"{out.resolve()}")
        if not args.no_log:
            uri = log_report(sweep, built)  # from the staging folder: what this report wrote, never another's
            print(f"logged to the parent run as artifacts: {uri}")
    return 0



def publish(built, out: Path):
    """The report ``built`` in its staging folder copied into ``out`` (`paths.publish`: whole files, under ``out``'s
    lock), as it now lies there."""
    import dataclasses

    return dataclasses.replace(built, out_dir=out, files=paths.publish(built.files, built.out_dir, out))

if __name__ == "__main__":
    sys.exit(main())
