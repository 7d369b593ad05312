"""Turn a finished sweep in MLflow into the paper's tables and figures.

    python pipelines/report.py [--sweep NAME_OR_RUN_ID] [--grid NAME_OR_RUN_ID] [--out DIR] [--tracking-uri URI]
                               [--no-log]

Reads the sweep's runs with `mlflow.search_runs` (default: the latest sweep in the store at
`MLFLOW_TRACKING_URI`, else sqlite:///mlflow.db), writes `report.md`, CSV tables and PNG figures to DIR
(default `reports/<sweep name>/`), logs them as artifacts of the sweep's parent run (folder `report/`), and prints
where they are. Published numbers shipped under `pipelines/paper_results/` appear beside ours with deltas.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import mlflow

from pipelines.reporting.build import build_report, log_report
from pipelines.reporting.store import load_sweep, tracking_uri


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mlflow.set_tracking_uri(tracking_uri(args.tracking_uri))
    try:
        sweep = load_sweep(args.sweep)
        grid = None if args.grid is None else load_sweep(args.grid)
    except LookupError as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("reports") / safe_dir_name(sweep.name)
    report = build_report(sweep, out, grid=grid)
    print(report.markdown)
    print(f"report for sweep {sweep.name!r} (parent run {sweep.run_id}): {len(report.files)} files in {out.resolve()}")
    if not args.no_log:
        uri = log_report(sweep, report)
        print(f"logged to the parent run as artifacts: {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
