#!/usr/bin/env bash
# The full prominence-testbed study (docs/testbed.md), offline on a 2-core machine: four sweeps on the shipped
# `testbed:llava` weights (promprune/testbed/weights/, checksum-verified; nothing is trained), each followed by
# its report.
#   bash scripts/testbed_reproduce.sh            # MLflow store: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
#   bash scripts/testbed_reproduce.sh --retrain  # first train the model from the recipe (about 1.5 hours of one CPU
#                                                # thread) into $PROMPRUNE_CACHE/testbed-llava-<recipe>, and use that
# Reports land in reports/<sweep>/ (report.md, CSVs, PNGs) and on each sweep's MLflow parent run.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
start=$(date +%s)
stamp() { echo "[testbed] $1 after $(( $(date +%s) - start )) s"; }
if [[ "${1:-}" == "--retrain" ]]; then
    python -m promprune.testbed.shipped --retrain      # the recipe, one torch thread; writes its own manifest
    export PROMPRUNE_TESTBED_RETRAIN=1                 # testbed:llava = the retrained cache, in every Ray worker
    stamp "model retrained"
elif [[ -n "${1:-}" ]]; then
    echo "usage: $0 [--retrain]" >&2; exit 2
fi
python -c "from promprune.testbed.zoo import load_or_train; load_or_train()"   # fails early on a bad file
stamp "model ready"
for spec in testbed_methods testbed_saliency_ratio testbed_prominence testbed_split_headroom; do
    python pipelines/sweep.py --config "sweeps/$spec.yaml"
    python pipelines/report.py --sweep "$spec" > /dev/null
    stamp "$spec done (reports/$spec/report.md)"
done
