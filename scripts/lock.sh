#!/usr/bin/env bash
# Refresh constraints.txt on purpose: resolve pyproject.toml's ranges afresh in a throwaway virtualenv and freeze
# every installed version. Run it when you mean to move to newer releases, then run the tests and regenerate the
# README's numbers (README "Reproducibility" and benchmarks/RESULTS.md) before committing the new lock.
#   bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
# shellcheck disable=SC1091
source "$tmp/venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[dev,ui,bench]"  # ui: Playwright for scripts/ui_screenshots.py; bench: benchmarks/ (pinned too)
{
  echo "# Exact versions of everything 'pip install -e \".[dev,ui,bench]\"' resolved on $(date -u +%F) (Python $(python -c 'import sys; print(*sys.version_info[:3], sep=".")'), $(uname -m))."
  echo "# Used as 'pip install -c constraints.txt ...' by the README and .ci/run. Refresh on purpose: bash scripts/lock.sh"
  python -m pip freeze --all --exclude-editable | grep -v -i '^promprune'
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
