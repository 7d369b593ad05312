#!/usr/bin/env bash
# Rerun one test while busy loops hold the cores at nice 0 (they stand in for the other pytest-xdist worker's test,
# which is what a 2-core CI machine runs beside it), and when a run passes --dump-after seconds, write the Python
# stacks of every process on the machine (py-spy, where installed: `pip install py-spy`) and their niceness. This is
# how CI's hung store-outage test (stop 74, benchmarks/RESULTS.md "2026-11-28, seventh stop") was reproduced and
# explained: Ray's workers run at nice 15 and starved beside nice-0 work.
#
#   bash scripts/under_load.sh tests/reliability/test_store_outage.py -k running_trial --runs 3   # in the project's env
#   options: -k EXPR, --runs N (default 3), --loops L (busy loops, default: the number of cores),
#            --dump-after S (default 200), --timeout S (pytest-timeout per test, default 600)
# Logs under ${OUT:-/tmp/under-load}: run_<i>.log, dump_<i>.log (a stalled run's stacks), summary.log (one line a run).
set -uo pipefail
cd "$(dirname "$0")/.."
test_path="${1:?usage: bash scripts/under_load.sh TEST [-k EXPR] [--runs N] [--loops L] [--dump-after S] [--timeout S]}"
shift
expr="" runs=3 loops="$(nproc)" dump_after=200 timeout=600
while [ $# -gt 0 ]; do
  case "$1" in
    -k) expr="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --loops) loops="$2"; shift 2 ;;
    --dump-after) dump_after="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    *) echo "under_load.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
out="${OUT:-/tmp/under-load}"
mkdir -p "$out"
: > "$out/summary.log"
busy=()
for _ in $(seq 1 "$loops"); do python3 -c "while True: pass" & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  python -m pytest -q -p no:cacheprovider "$test_path" ${expr:+-k "$expr"} -o timeout="$timeout" \
    > "$out/run_$i.log" 2>&1 &
  pid=$! dumped=""
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ -z "$dumped" ] && [ $(( $(date +%s) - start )) -ge "$dump_after" ]; then
      dumped=1
      {
        echo "# run $i at ${dump_after}s: every process's niceness, then each Python process's stacks"
        ps -eo pid,ni,etime,time,args --sort=-time | cut -c1-160 | head -40
        if command -v py-spy >/dev/null; then
          for p in $(pgrep -f "python|ray::"); do
            echo "=== $p $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-120)"
            py-spy dump --pid "$p" 2>&1 | head -80
          done
        else
          echo "(py-spy is not installed: pip install py-spy for the stacks)"
        fi
      } > "$out/dump_$i.log" 2>&1
    fi
  done
  wait "$pid"
  rc=$?
  echo "run $i: exit $rc after $(( $(date +%s) - start ))s${dumped:+ (stalled: dump_$i.log)}" | tee -a "$out/summary.log"
done
