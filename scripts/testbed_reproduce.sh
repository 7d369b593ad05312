#!/usr/bin/env bash
# The full prominence-testbed study (docs/testbed.md), offline on a 2-core machine in about
# half an hour: trains `testbed:llava` on first use, then three sweeps, each followed by its report.
#   bash scripts/testbed_reproduce.sh            # MLflow store: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
# Reports land in reports/<sweep>/ (report.md, CSVs, PNGs) and on each sweep's MLflow parent run.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
start=$(date +%s)
stamp() { echo "[testbed] $1 after $(( $(date +%s) - start )) s"; }
python -c "from promprune.testbed.training import load_or_train; load_or_train()"   # once; cached afterwards
stamp "model ready"
for spec in testbed_methods testbed_saliency_ratio testbed_prominence; do
    python pipelines/sweep.py --config "sweeps/$spec.yaml"
    python pipelines/report.py --sweep "$spec" > /dev/null
    stamp "$spec done (reports/$spec/report.md)"
done
