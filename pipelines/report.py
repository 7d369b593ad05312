"""Turn a finished sweep in MLflow into the paper's tables and figures.

    python pipelines/report.py [--sweep NAME_OR_RUN_ID] [--grid NAME_OR_RUN_ID] [--out DIR] [--tracking-uri URI]
                               [--no-log]

Reads the sweep's runs with `mlflow.search_runs` (default: the latest sweep in the store at
`MLFLOW_TRACKING_URI`, else sqlite:///mlflow.db), writes `report.md`, CSV tables and PNG figures to DIR
(default `reports/<sweep name>/`), logs them as artifacts of the sweep's parent run (folder `report/`), and prints
where they are. Published numbers shipped under `pipelines/paper_results/` appear beside ours with deltas.

A store that does not answer (a tracking server that is down or unreachable, a SQLite file that does not exist) is
said in seconds, exit 2, before anything else loads; a sweep that did not finish (killed, interrupted, still running)
is reported with what it has, its first line saying so and how many of its trials never started.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pipelines.mlflow_layout import sqlite_path, tracking_uri

PROBE_TIMEOUT_S = 5.0  # one request: a server that is down refuses at once, one that never answers times out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default=None, help="sweep name (its latest run) or parent run id; default: latest")
    parser.add_argument("--grid", default=None,
                        help="a grid sweep over the same (mu, tau) (name or parent run id): drawn beside a search, "
                             "which is compared with its best point and its samples")
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


def store_problem(uri: str) -> str | None:
    """Why the MLflow store at ``uri`` cannot be read (None: it answers): a SQLite file that does not exist, a
    server that does not answer one plain HTTP request within seconds (MLflow's client would retry for minutes).
    Standard library only: said before MLflow, pandas and matplotlib load."""
    import urllib.error
    import urllib.request

    fix = "point --tracking-uri (or MLFLOW_TRACKING_URI) at the store the sweep wrote"
    path = sqlite_path(uri)
    if path is not None:
        return None if path.is_file() else f"there is no MLflow store at {uri} ({path} does not exist); {fix}"
    if not uri.startswith(("http://", "https://")):
        return None  # another scheme: MLflow's client says what it makes of it
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None  # it answered (an error status is MLflow's to explain)
    except (OSError, ValueError) as exc:  # refused, timed out, no route, a malformed address
        reason = getattr(exc, "reason", None) or exc
        return (f"the MLflow store at {uri} does not answer ({type(reason).__name__}: {str(reason)[:200]}); start its "
                "server (`mlflow server ...`, or cluster.yaml's on the head, reached through `ray attach cluster.yaml "
                f"-p 5000`) or {fix}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    uri = tracking_uri(args.tracking_uri)
    problem = store_problem(uri)  # before the report's imports (pandas, matplotlib) and MLflow's minutes of retries
    if problem:
        print(f"report: {problem}", file=sys.stderr)
        return 2
    import mlflow

    from pipelines.reporting.build import build_report, log_report
    from pipelines.reporting.store import load_sweep

    mlflow.set_tracking_uri(uri)
    try:
        sweep = load_sweep(args.sweep)
        grid = None if args.grid is None else load_sweep(args.grid)
    except LookupError as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("reports") / safe_dir_name(sweep.name)
    unfinished = sweep.unfinished()
    if unfinished:
        print(f"report: {unfinished}", file=sys.stderr, flush=True)
    report = build_report(sweep, out, grid=grid)
    print(report.markdown)
    print(f"report for sweep {sweep.name!r} (parent run {sweep.run_id}): {len(report.files)} files in {out.resolve()}")
    if not args.no_log:
        uri = log_report(sweep, report)
        print(f"logged to the parent run as artifacts: {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
