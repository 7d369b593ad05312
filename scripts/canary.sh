#!/usr/bin/env bash
# The canary: the newest releases pyproject.toml's ranges allow (resolved afresh, WITHOUT constraints.txt), against
# the tests that touch transformers, torch, lmms-eval, Ray, MLflow and pyarrow: the adapters and in-LLM methods
# (tests/models), the selection (tests/selection), the eval bridge (tests/eval), the testbed model, the efficiency
# counters, one local sweep into a real MLflow store and the report; then the long tier (Ray's and MLflow's end-to-end
# tests that CI leaves out: `-m long`). Not part of CI (a release upstream must not
# block our work): run it before a session stops and before publishing new ranges. What it finds is fixed, or the
# range in pyproject.toml is narrowed with the reason beside it, so that the published ranges are ranges it passed.
#   bash scripts/canary.sh                       # builds $PROMPRUNE_CANARY_VENV (default /tmp/promprune-canary)
#   PROMPRUNE_CANARY_REUSE=1 bash scripts/canary.sh   # reuse that virtualenv as it is (no new resolution)
#   bash scripts/canary.sh -x -k in_llm          # extra arguments go to pytest
#   PROMPRUNE_CANARY_PYTHON=python3.13 PROMPRUNE_CANARY_VENV=/tmp/promprune-canary-313 bash scripts/canary.sh
#                                                # the newest Python too (default: python3; CI runs 3.11)
# The last line is always: canary: N passed, M failed on python P, transformers X, torch Y, ray Z, mlflow W,
# lmms-eval V
# (exit status 1 when M > 0 or the environment could not be built). The install pulls torch's CUDA build (a few GB).
set -uo pipefail
cd "$(dirname "$0")/.."

VENV="${PROMPRUNE_CANARY_VENV:-/tmp/promprune-canary}"
PYTHON="${PROMPRUNE_CANARY_PYTHON:-python3}"  # the interpreter the virtualenv is made from
TESTS=(tests/models tests/selection tests/eval tests/testbed tests/test_efficiency.py tests/report/test_report.py
       "tests/pipelines/test_sweep.py::test_sweep_lands_in_mlflow_and_matches_plain_generation")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

say() { echo "[canary] $*" >&2; }
fail_build() {
    tail -n 20 "$tmp/pip.log" >&2 2>/dev/null
    echo "canary: 0 passed, 0 failed on python ?, transformers ?, torch ?, ray ?, mlflow ?, lmms-eval ? (environment not built: $1)"
    exit 1
}

if [[ "${PROMPRUNE_CANARY_REUSE:-0}" != 1 || ! -x "$VENV/bin/python" ]]; then
    say "resolving the newest releases into $VENV (no constraints.txt, no site pip config)"
    "$PYTHON" -m venv --clear "$VENV" || fail_build "$PYTHON -m venv failed"
    # PIP_CONFIG_FILE=/dev/null: a machine's pip.conf may pin or cap releases (this one caps torch); the canary wants
    # what a user who runs `pip install promprune` gets
    export PIP_CONFIG_FILE=/dev/null
    unset PIP_CONSTRAINT PIP_REQUIRE_VIRTUALENV
    "$VENV/bin/python" -m pip install -q --upgrade pip > "$tmp/pip.log" 2>&1 || fail_build "pip upgrade failed"
    "$VENV/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev]" >> "$tmp/pip.log" 2>&1 \
        || fail_build "pip install -e .[dev] failed"
fi
# decord, which lmms-eval's llava_hf imports (the throughput benchmark's smoke run, in the long tier): the bench
# extra's other half, ray[serve]==2.60.0, would hold Ray at the pinned release, and its row degrades without it
"$VENV/bin/python" -c "import decord" 2>/dev/null || "$VENV/bin/python" -m pip install -q decord >> "$tmp/pip.log" 2>&1 \
    || fail_build "pip install decord failed"

versions="$("$VENV/bin/python" - <<'EOF'
import platform
from importlib.metadata import PackageNotFoundError, version

def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"

packages = [("transformers", "transformers"), ("torch", "torch"), ("ray", "ray"), ("mlflow", "mlflow"),
            ("lmms-eval", "lmms_eval")]
print(", ".join([f"python {platform.python_version()}"] + [f"{label} {v(dist)}" for label, dist in packages]))
EOF
)"
say "$versions"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export MLFLOW_TRACKING_URI="sqlite:///$tmp/canary-mlflow.db"  # the sweep test logs to its own store anyway
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$tmp/junit.xml" "${TESTS[@]}" "$@" >&2
# the long tier (pyproject's markers), which CI leaves out: Ray's and MLflow's end-to-end paths a second time (resumes,
# the nine hub benchmarks in one sweep, a disk filled mid-sweep, ...), on two workers as CI runs the rest
say "the long tier"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 -m long --junitxml="$tmp/junit-long.xml" tests "$@" >&2
counts="$("$VENV/bin/python" - "$tmp/junit.xml" "$tmp/junit-long.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

suites = []
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        print(f"0 passed, 0 failed (pytest wrote no report: {path.rsplit('/', 1)[-1]})")
        sys.exit()
    suites += [root] if root.tag == "testsuite" else list(root)
total = sum(int(s.get(k, 0)) for s in suites for k in ("tests",))
failed = sum(int(s.get(k, 0)) for s in suites for k in ("failures", "errors"))
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(f"{total - failed - skipped} passed, {failed} failed")
EOF
)"
echo "canary: $counts on $versions"
[[ "$counts" == *" 0 failed"* && "$counts" != "0 passed"* ]]
