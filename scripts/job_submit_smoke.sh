#!/usr/bin/env bash
# The real entry point, end to end: a Ray head on loopback, then the README's
#   RAY_AUTH_MODE=token ray job submit --working-dir . -- python pipelines/sweep.py ...
# runs the default sweep (sweeps/quickstart.yaml, shrunk to SMOKE_LIMIT questions per task) as a Ray job on a head
# with CPUs only, naming no MLflow store: the job must keep its runs in $PROMPRUNE_HOME (default ~/promprune; here a
# folder of the work dir), not in Ray's per-job package copy. A 7B-class spec on the same head must exit 2 at once.
# Then the head is stopped and its temp dir deleted, and every run must still be in the store, predictions included.
#
#   scripts/job_submit_smoke.sh            # from the repository root, with the project's environment active
#
# Starts its own head (own temp dir, free ports, so it never touches another Ray on the machine) and stops exactly
# that head on exit. SMOKE_KEEP=1 keeps the work dir (MLflow store, Ray logs) for inspection.
set -euo pipefail
cd "$(dirname "$0")/.."

# free ports for everything `ray start --head` would otherwise take from its fixed defaults
read -r PORT DASHBOARD_PORT AGENT_PORT CLIENT_PORT < <(python - <<'PY'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
WORK=$(mktemp -d /tmp/pp-smoke.XXXXXX)   # short: Ray's unix sockets live under --temp-dir
ADDRESS="http://127.0.0.1:${DASHBOARD_PORT}"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
# Ray 2.60 token auth, with a throwaway token shared by this head and this script's clients only
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(python -c "import secrets; print(secrets.token_hex(32))")
export RAY_AUTH_TOKEN

# `ray start` as a user runs it, through pipelines.run.patient_ray: the same command line, with a busy machine's slow
# node registration waited for (Ray alone gives it 30 s; CI's suite saw a start pass that)
python -m pipelines.run.patient_ray start --head --block --node-ip-address=127.0.0.1 --port="$PORT" \
    --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" --dashboard-agent-listen-port="$AGENT_PORT" \
    --ray-client-server-port="$CLIENT_PORT" --num-cpus=2 --temp-dir="$WORK/ray" --disable-usage-stats \
    > "$WORK/head.log" 2>&1 &
HEAD_PID=$!
cleanup() {
    kill "$HEAD_PID" 2>/dev/null || true   # `ray start --block` stops the processes it started
    wait "$HEAD_PID" 2>/dev/null || true
    [ "${SMOKE_KEEP:-0}" = 1 ] && echo "kept $WORK" || rm -rf "$WORK"
}
trap cleanup EXIT

for _ in $(seq 1 60); do   # the job server needs the dashboard: wait up to ~2 minutes for it
    if ray job list --address "$ADDRESS" > /dev/null 2>&1; then break; fi
    if ! kill -0 "$HEAD_PID" 2>/dev/null; then cat "$WORK/head.log"; exit 1; fi
    sleep 2
done

# the design card's entry point as written: the default sweep (sweeps/quickstart.yaml), no device override. The head
# has CPUs only and no autoscaler, so `device: auto` runs the testbed model on the CPUs (and says so).
# SMOKE_LIMIT questions per task (default 10, CI's size; unset it to 100 for the full quickstart: about a minute)
# No MLFLOW_TRACKING_URI and no PROMPRUNE_STORAGE: the job picks its durable places itself (pipelines/paths.py)
RUNTIME_ENV=$(printf '{"env_vars": {"PROMPRUNE_HOME": "%s/home", "HF_HUB_OFFLINE": "1"}}' "$WORK")
START=$(date +%s)
ray job submit --address "$ADDRESS" --submission-id "smoke-$(date +%s)" --working-dir . \
    --runtime-env-json "$RUNTIME_ENV" -- \
    python pipelines/sweep.py --set "limit=${SMOKE_LIMIT:-10}" | tee "$WORK/job.log"
grep -q "the actors run on the CPUs" "$WORK/job.log" || { echo "the job did not say it runs on the CPUs"; exit 1; }
grep -q "a Ray job keeps nothing in its package copy: MLflow store sqlite:///$WORK/home/mlflow.db" "$WORK/job.log" \
    || { echo "the job did not say where its records go"; exit 1; }
grep -q "mlflow ui --backend-store-uri sqlite:///$WORK/home/mlflow.db" "$WORK/job.log" \
    || { echo "the closing mlflow ui line does not name the durable store"; exit 1; }
echo "job: $(( $(date +%s) - START ))s"

# a 7B-class model on the same CPU-only head: refused at once with one paragraph (exit 2), never run on the CPUs
START=$(date +%s)
set +e
MLFLOW_TRACKING_URI="sqlite:///$WORK/7b.db" python pipelines/sweep.py --address "127.0.0.1:$PORT" \
    --set model.pretrained=shape:llava_1_5_7b > "$WORK/7b.log" 2>&1
CODE=$?
set -e
ELAPSED=$(( $(date +%s) - START ))
if [ "$CODE" != 2 ] || ! grep -q "has 7.1B parameters" "$WORK/7b.log" || grep -q Traceback "$WORK/7b.log"; then
    echo "the 7B spec on a CPU-only head: exit $CODE after ${ELAPSED}s"; cat "$WORK/7b.log"; exit 1
fi
echo "7B on a CPU-only head: exit 2 after ${ELAPSED}s"

# the head stopped and Ray's temp dir (the job's package copy with it) deleted: the runs must outlive both
kill "$HEAD_PID" 2>/dev/null || true
wait "$HEAD_PID" 2>/dev/null || true
rm -rf "$WORK/ray"
[ -d "$WORK/home/outputs/tune/_promprune_state" ] || { echo "no Tune state in \$PROMPRUNE_HOME"; exit 1; }

MLFLOW_TRACKING_URI="sqlite:///$WORK/home/mlflow.db" WORK="$WORK" python - <<'PY'
import os
import tempfile

from mlflow.tracking import MlflowClient

c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
exp = c.get_experiment_by_name(os.environ.get("MLFLOW_EXPERIMENT_NAME", "promprune"))
assert exp is not None, "no MLflow experiment: the job logged nothing"
assert exp.artifact_location.startswith(os.environ["WORK"] + "/home/"), exp.artifact_location
parents = c.search_runs([exp.experiment_id], filter_string="tags.`promprune.role` = 'sweep'")
assert len(parents) == 1 and parents[0].info.status == "FINISHED", parents
children = c.search_runs([exp.experiment_id],
                         filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
trials = sorted(r.data.tags["promprune.trial"] for r in children)
assert trials == ["baseline", "divprune-b16", "promprune-b16-mu=calibrate-tau=0.03", "vispruner-b16"], trials
with tempfile.TemporaryDirectory() as tmp:
    for run in children:
        assert c.download_artifacts(run.info.run_id, "predictions.parquet", tmp), run.info.run_id
print(f"smoke OK: sweep run {parents[0].info.run_id} with trials {trials}, their predictions, after the head and its "
      "temp dir are gone")
PY
