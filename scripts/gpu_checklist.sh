#!/usr/bin/env bash
# The GPU checklist (../shared/GPU_CHECKLIST.md) and issue 23's pipeline runs on a lent GPU machine: one command per
# device call, each stage's log tee'd into $OUT (or ./gpu-logs), so logs come back even when a call hits its limit.
#
#   bash scripts/gpu_checklist.sh [--install-batch N]... STAGE...
#
# Stages: install (every .whlN here) | parity | library | lanczos | margin | view-shares | selection | vispruner-tiles |
#         speed | table6 | shapes | deps | sweep | table6-pipeline | scaling | gemma4 | two-gpus | plan.
# --install-batch N installs .whlN only (one batch travels per call). Every stage runs even when one before it
# failed; exit 1 when any failed (the last line names them), exit 2 for a stage name it does not know (before any
# install runs).
#
# The machine (Python 3.12, torch 2.11 CUDA 13, transformers 5.17) has no network and no Ray, MLflow or lmms-eval;
# a call sends at most 64 MiB, runs at most 10 min (2,000-character command), 30 device-minutes in all, and the
# machine is given back 30 s after a call (then everything installed is gone): send the calls back to back.
# Batch N installs into .site/whlN of the working tree (git-ignored), which stays while the machine is kept; a
# stage that needs a batch not installed says so and which call to repeat.
#
# PLAN. Here first (PyPI reachable; minutes):
#   python scripts/device_wheels.py build && python scripts/device_wheels.py check
#       -> .whl1, .whl2, .whl3: <= 60 MiB each; batch 1 holds what call 1 needs (transformers 5.23), Ray
#          (without ray/jars), MLflow, lmms-eval, datasets... fill the rest (~128 MiB in all since the image's
#          versions are pinned, 2026-11-28: its pandas 3.0.6, pillow 12.3.0 and markdown-it-py 4.2.0 are below
#          pyproject's floors and travel too)
#   (the quickstart's testbed model is shipped in the tree: promprune/testbed/weights/, nothing to carry for it)
#   bash scripts/device_rehearsal.sh   -> the stages that need no CUDA, on a device-like Python 3.12 virtualenv
#       (~15 min): what a newer package there breaks, or a stage that cannot start, shows here, not on the machine
# The shortest way to the selection stages (2026-11-26 evening: two calls, 416 s and 262 s; 2026-11-28 on an H200:
# 273 s and 274 s, each on a fresh machine, ~35 s of start around each): a .whl1 of one wheel,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl1 transformers==5.23.0
#   carry [".whl1"]  bash scripts/gpu_checklist.sh --install-batch 1 lanczos margin view-shares selection table6 parity vispruner-tiles
# (lanczos, ~1-2 min expected: the certified split's steps fused or not by size, the line that sets
# lanczos_triton.FUSED_UP_TO; margin, ~1 min expected: the bracket against the GPU's own eigensolve on adversarial
# near-low-rank tokens, the headroom of certified.decision_margin there; view-shares, under ~1 min expected:
# adaptive_views' share decision per image from certified brackets against one eigensolve per view, LLaVA-NeXT's
# 5 x 576 x 4096 and OneVision clips of 8 / 16 frames x 196 x 3584 in float16, batches 1 and 8, with the share of
# views decided without an eigensolve and whether every image's shares were the exact route's;
# selection times PromPrune with and without CUDA graphs, fused and unfused; table6 times
# its model path eager and with graphs interleaved, `--graph-pairs`: the line that decides PROMPRUNE_GRAPHS, and ends
# with benchmarks/profile_select.py).
# Then three device calls, back to back (each line: run's carry, then its command):
#   1. carry [".whl1"]              bash scripts/gpu_checklist.sh --install-batch 1 parity selection table6    ~7 min
#      (then vispruner-tiles, ~2 min expected: VisPruner's kernels at other block sizes, the wide one too, checked)
#   2. carry [".whl2"]              bash scripts/gpu_checklist.sh --install-batch 2                            ~1 min
#      carry [".whl3"]              bash scripts/gpu_checklist.sh --install-batch 3 sweep table6-pipeline      ~7 min
#      (installing the last batch checks every requirement against the versions there: install.log)
#   3. carry []                     bash scripts/gpu_checklist.sh scaling                                      ~7 min
#      (SCALING_GPUS="4 8" by default; the 1-GPU point, ~6 min more, in a later call if time is left:
#       SCALING_GPUS=1 SCALING_SHELL=arithmetic bash scripts/gpu_checklist.sh scaling)
#   4. carry []                     bash scripts/gpu_checklist.sh shapes                                       ~6 min
#      (efficiency at LLaVA-1.5, Qwen2.5-VL and issue 26's Qwen3-VL-8B, OneVision-7B, InternVL3-8B shapes;
#       issue 46's Qwen3.5-4B)
#   5. carry []                     bash scripts/gpu_checklist.sh gemma4                                       ~8 min
#      (issue 46: Gemma 4 31B in bfloat16, ~62 GB, on one 80 GB GPU: efficiency rows unpruned / promprune / fastv)
#   6. carry [] on a machine with TWO GPUs   bash scripts/gpu_checklist.sh two-gpus                         ~6 min
#      (resources.gpus_per_worker: 2's placement: Gemma 4 31B spread over both GPUs by promprune.models.placement,
#       each GPU's share of the weights, one greedy answer unpruned / promprune / fastv / dart through the split model)
# Call 1 also brings back image-freeze.txt: `python scripts/device_wheels.py pin-image <it>` here records the image's
# versions in scripts/device_image.txt (commit it), so later builds carry exactly what the image lacks.
# A call that finds a fresh machine (the last one was given back) repeats the installs: call 1's batch again, then
# this call's, e.g. carry [".whl1"] `--install-batch 1`, then carry [".whl2"] `--install-batch 2 ...`.
# At most 8 files come back per call: call 2 writes 7 (install, sweep and table6-pipeline logs, their GPU-utilization
# CSVs and reports), 8 on a fresh machine (installing batch 1 again writes image-freeze.txt again).
# CALL_BUDGET_S (default 570) bounds one call: a stage that would start with under STAGE_MIN_S (60) left is skipped
# with a note, and a running stage is stopped at the budget, so its log still comes back.
set -uo pipefail
OUT="${OUT:-gpu-logs}"; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"; cd "$ROOT"
SITE="$ROOT/.site"
START=$SECONDS
CALL_BUDGET_S="${CALL_BUDGET_S:-570}"
STAGE_MIN_S="${STAGE_MIN_S:-60}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0 MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$ROOT/mlflow.db}"

set_path() {  # the working tree first (the code), then this project's entry points, then each installed batch
  local pp="$ROOT" d
  for d in "$SITE/promprune" "$SITE"/whl[0-9]*; do
    [ -f "$d/.installed" ] || [ "$d" = "$SITE/promprune" ] && [ -d "$d" ] && pp="$pp:$d"
    [ -d "$d/bin" ] && PATH="$d/bin:$PATH"
  done
  export PYTHONPATH="$pp" PATH
}

install_batch() {  # .whlN -> .site/whlN, once per machine (a stamp of the batch's file names marks it done)
  local n="$1" src="$ROOT/.whl$1" dst="$SITE/whl$1" stamp
  if [ ! -d "$src" ]; then
    echo "batch $n: no .whl$n in this call's tree: name it in the call's carry (python scripts/device_wheels.py build)"
    return 1
  fi
  stamp="$(ls "$src" | sha1sum | cut -c1-16)"
  if [ "$(cat "$dst/.installed" 2>/dev/null)" = "$stamp" ]; then echo "batch $n: already installed"; return 0; fi
  rm -rf "$dst"; mkdir -p "$SITE"
  if [ "$n" = 1 ]; then  # the image's own versions (no batch on the path), for `device_wheels.py pin-image` here
    env -u PYTHONPATH python3 -m pip freeze --all > "$OUT/image-freeze.txt" 2>/dev/null \
      && echo "image: $(wc -l < "$OUT/image-freeze.txt") packages in image-freeze.txt (bring it back: pin-image)"
  fi
  local t0=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dst" "$src"/*.whl || return 1
  echo "$stamp" > "$dst/.installed"
  [ -f "$src/REQUIREMENTS.json" ] && cp "$src/REQUIREMENTS.json" "$SITE/"
  python3 scripts/device_wheels.py dist-info --target "$SITE/promprune" >/dev/null
  echo "batch $n: $(ls "$src"/*.whl | wc -l) wheels installed into .site/whl$n in $((SECONDS - t0)) s"
  set_path
  if python3 -c "import ray, mlflow, lmms_eval" 2>/dev/null; then  # the last batch: every requirement, real versions
    python3 scripts/device_wheels.py check-installed --site "$SITE"
  elif [ -f "$SITE/REQUIREMENTS.json" ]; then  # so far: the image's versions against what the closure asks of them
    python3 scripts/device_wheels.py check-installed --site "$SITE" --image-only "$SITE/REQUIREMENTS.json"
  fi
}

need_pipeline() {  # Ray, MLflow and lmms-eval importable, or say which call to repeat
  python3 -c "import ray, mlflow, lmms_eval" 2>/dev/null && return 0
  echo "the pipeline's packages are not installed on this machine (fresh machine?): installed batches:" \
       "$(ls -d "$SITE"/whl* 2>/dev/null | xargs -n1 basename 2>/dev/null | tr '\n' ' ')- repeat the calls that" \
       "carry each .whlN with --install-batch N"
  return 1
}

env_line() {
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'device', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'none (no CUDA device: a rehearsal?)')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import ray, mlflow, lmms_eval; print('ray', ray.__version__, 'mlflow', mlflow.__version__)" 2>/dev/null
}

gpu_watch() {  # GPU utilization once a second into $OUT/$1 until gpu_unwatch
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/$1" 2>&1 &
  WATCH_PID=$!
}
gpu_unwatch() {
  kill "$WATCH_PID" 2>/dev/null; wait "$WATCH_PID" 2>/dev/null
  python3 - "$OUT/$1" <<'PY'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]).read().splitlines()[1:] if l.count(",") == 2]
util = [float(r[1].split()[0]) for r in rows if r[1].split()[0].replace(".", "").isdigit()]
busy = [u for u in util if u > 0]
if util:
    print(f"GPU utilization over {len(util)} s: mean {sum(util) / len(util):.1f}%, max {max(util):.0f}%, "
          f"mean while nonzero {sum(busy) / max(1, len(busy)):.1f}% ({len(busy)} s nonzero)")
PY
}

pipeline_sweep() {  # $1 name for the logs, then pipelines/sweep.py's arguments; the GPU watched, the report made
  local name="$1"; shift
  need_pipeline || return 1
  env_line
  gpu_watch "gpu-util-$name.csv"
  local t0=$SECONDS rc
  python3 pipelines/sweep.py "$@"; rc=$?
  echo "sweep.py exit $rc after $((SECONDS - t0)) s"
  gpu_unwatch "gpu-util-$name.csv"
  if [ $rc -ne 0 ]; then
    local log; log="$(ls -t outputs/logs/*.log 2>/dev/null | head -1)"
    [ -n "$log" ] && { echo "--- last 150 lines of $log"; tail -150 "$log"; }
  fi
  local sweep; sweep="$(python3 -c "from pipelines import spec; import sys; \
print(spec.load(sys.argv[1], sys.argv[2:]).name)" "${@:2:1}" 2>/dev/null)"
  python3 pipelines/report.py ${sweep:+--sweep "$sweep"} --out "reports/$name" && cp "reports/$name/report.md" \
    "$OUT/report-$name.md"
  python3 - <<'PY'
import mlflow
runs = mlflow.search_runs(search_all_experiments=True)
print(f"MLflow: {len(runs)} runs in {mlflow.get_tracking_uri()}")
cols = [c for c in runs.columns if c.startswith("metrics.samples/") or c.startswith("metrics.efficiency/")]
if len(runs) and cols:
    print(runs[["tags.mlflow.runName", *cols]].to_string(max_colwidth=40))
PY
  return $rc
}

run_stage() {
  local stage="$1" left=$((CALL_BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt "$STAGE_MIN_S" ]; then
    echo "SKIPPED $stage: ${left}s left of this call's ${CALL_BUDGET_S}s; run it in the next call" \
      | tee -a "$OUT/skipped.log"
    return 0
  fi
  echo "=== $stage (${left}s left in this call)"
  # each stage runs in its own bash under `timeout`, so the call ends inside its limit with every log written
  STAGE_LEFT="$left" timeout --signal=INT --kill-after=20 "$left" bash "$0" --stage-only "$stage" 2>&1 \
    | tee "$OUT/$stage.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $stage done (exit $rc, $((SECONDS - START))s into the call)"
  if [ "$rc" -ne 0 ]; then FAILED_STAGES+=("$stage"); fi
}

KNOWN_STAGES="install|parity|library|selection|lanczos|margin|view-shares|vispruner-tiles|speed|table6|shapes|deps"
KNOWN_STAGES+="|sweep|table6-pipeline|scaling|gemma4|two-gpus|plan"
FAILED_STAGES=()

stage() {
  case "$1" in
    plan) sed -n '2,/^set -uo/p' "$0" | sed '$d' ;;
    install)
      for src in "$ROOT"/.whl[0-9]*; do install_batch "${src##*.whl}" || return 1; done ;;
    deps)  # every requirement of the closure against what this machine imports
      env_line; python3 scripts/device_wheels.py check-installed --site "$SITE" ;;
    parity)
      env_line; python3 -m pytest -q -p no:cacheprovider -k cuda tests/models tests/selection \
          tests/test_efficiency.py ;;
    library)  # the whole library suite (CPU and CUDA tests) on the device's torch / transformers
      env_line; python3 -m pytest -q -p no:cacheprovider tests/models tests/selection tests/test_efficiency.py \
          tests/test_architecture.py ;;
    selection)  # issue 53's measurements: every method, PromPrune's stages, the certified split's fallback share
      env_line
      python3 benchmarks/selection.py --device cuda --dtype float16 --batch 1 8 --repeats 9 --split-images 24; echo
      python3 benchmarks/selection.py --device cuda --dtype float32 --batch 1 8 --repeats 9 --tables timing ;;
    lanczos)  # issue 53: the certified split's steps fused (a launch a step) or not, by size: lanczos_triton.FUSED_UP_TO
      env_line; python3 benchmarks/lanczos_steps.py --repeats 15 ;;
    margin)  # issue 53: the certified split's decision margin against the GPU's own eigensolve (the exact route there)
      env_line; python3 benchmarks/margin_by_size.py --device cuda --sizes 576,1296 ;;
    view-shares)  # issue 53: adaptive_views' shares from certified brackets against one eigensolve per view
      env_line; python3 benchmarks/view_shares.py --device cuda --dtype float16 --batch 1 8 --repeats 9 ;;
    vispruner-tiles)  # issue 53: which chain of VisPruner's kernel its time follows (ranking tiles or the row scan)
      env_line; python3 benchmarks/vispruner_tiles.py --repeats 9 ;;
    speed)
      env_line; python3 -m benchmarks.spectrum --device cuda
      python3 - <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
import promprune
from benchmarks.selection import make_inputs
for method in ("divprune", "promprune"):
    x, s = make_inputs(1, 576, 4096, "cuda", dtype=torch.float16)
    promprune.select(x, s, budget=64, method=method)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        promprune.select(x, s, budget=64, method=method)
        torch.cuda.synchronize()
    print(f"### {method}, llava-1.5 shape, fp16, T=64")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=40))
PY
      for dt in float16 float32; do
        python3 benchmarks/selection.py --device cuda --dtype $dt --batch 1 8 --repeats 9; echo; done ;;
    table6)
      env_line; python3 benchmarks/efficiency.py --model shape:llava_next_7b --dtype float16 --device cuda \
          --budgets none,320 --methods vispruner,divprune,promprune --repeats 5 --max-new-tokens 8
      # at batch 1 the eager LLM's prefill is host-bound (47 ms at 365 tokens on 2026-11-26: vision + LLM = 0.618x
      # of unpruned with no selection at all); at batch 8 compute weighs as on the paper's A40 (RESULTS 2026-11-27)
      python3 benchmarks/efficiency.py --model shape:llava_next_7b --dtype float16 --device cuda --skip-analytic \
          --budgets none,320 --methods divprune,promprune --batch 8 --repeats 3 --max-new-tokens 8
      # PromPrune's select ms there (35 ms on 2026-11-26) against promprune.select alone (10 ms): where it goes
      python3 benchmarks/profile_select.py --model shape:llava_next_7b --dtype float16 --budget 320 --rows 16 ;;
    shapes)
      env_line
      python3 benchmarks/efficiency.py --model shape:llava_1_5_7b --dtype float16 --device cuda --skip-analytic \
        --budgets none,64 --methods vispruner,divprune,promprune --repeats 5 --max-new-tokens 8
      python3 benchmarks/efficiency.py --model shape:qwen2_5_vl_7b --dtype bfloat16 --device cuda --skip-analytic \
        --budgets none,128 --methods vispruner,divprune,promprune --repeats 5 --max-new-tokens 8
      # issue 26's models (needs batch 1: transformers 5.23)
      for m in qwen3_vl_8b:bfloat16:128 llava_onevision_7b:float16:320 internvl3_8b:bfloat16:64; do
        IFS=: read -r name dt budget <<< "$m"
        python3 benchmarks/efficiency.py --model shape:$name --dtype $dt --device cuda --skip-analytic \
          --budgets none,$budget --methods divprune,promprune --repeats 5 --max-new-tokens 8; done
      # issue 46's Qwen3.5-4B (a hybrid LLM: KV only for its full-attention layers, a constant recurrent state), FastV
      # at the full-attention layer it maps to
      python3 benchmarks/efficiency.py --model shape:qwen3_5_4b --dtype bfloat16 --device cuda --skip-analytic \
        --budgets none,128 --methods divprune,promprune,fastv --repeats 5 --max-new-tokens 8 ;;
    gemma4)  # issue 46: the 31B's efficiency rows on one 80 GB GPU (bfloat16 weights ~62 GB)
      env_line
      python3 benchmarks/efficiency.py --model shape:gemma4_31b --dtype bfloat16 --device cuda --skip-analytic \
        --budgets none,64 --methods promprune,fastv --repeats 3 --max-new-tokens 8 ;;
    two-gpus)  # issue 46: one model over two GPUs (what an actor with gpus_per_worker: 2 loads)
      env_line
      python3 - <<'PY'
import collections, time, torch
from PIL import Image
from promprune.models import PrunedVLM
from promprune.models.placement import gpu_split
n = torch.cuda.device_count()
assert n >= 2, f"this stage needs two GPUs; the machine shows {n}"
split = gpu_split([torch.cuda.get_device_properties(i).total_memory for i in range(2)])
t0 = time.time()
vlm = PrunedVLM.from_pretrained("shape:gemma4_31b", method=None, dtype="bfloat16", **split)
print(f"loaded in {time.time() - t0:.0f} s; modules per GPU:", collections.Counter(vlm.model.hf_device_map.values()))
print("GiB allocated per GPU:", [round(torch.cuda.memory_allocated(i) / 2**30, 1) for i in range(2)])
image = Image.new("RGB", (640, 480), (120, 90, 60))
for method, budget in ((None, None), ("promprune", 64), ("fastv", 64), ("dart", 64)):
    pruned = PrunedVLM(vlm.model, vlm.processor, method=method, budget=budget)
    g = pruned.generate([image], ["What colour is the image?"], max_new_tokens=8)[0]
    print(method, "visual tokens", g.visual_tokens, "tokens", g.token_ids, f"prefill {g.prefill_ms:.0f} ms")
PY
      ;;
    sweep)  # the quickstart (testbed) sweep, its actors on the GPU
      pipeline_sweep quickstart --config sweeps/quickstart.yaml ${SWEEP_SET:-} ;;
    table6-pipeline)  # Table 6 through the pipeline: random LLaVA-NeXT-7B weights, easy-vqa yes/no for POPE
      # TABLE6_MODEL_SET replaces the model's two fields (a field given twice is refused); TABLE6_SET adds others
      pipeline_sweep table6 --config sweeps/table6_efficiency.yaml \
        ${TABLE6_MODEL_SET:---set model.pretrained=shape:llava_next_7b --set model.dtype=float16} \
        --set "tasks=[easyvqa_yesno]" --set limit="${TABLE6_LIMIT:-50}" \
        --set resources.share_weights=false ${TABLE6_SET:-} ;;
    scaling)  # CPU only: simulated GPU nodes on this machine's cores; the timeline says where the time went
      need_pipeline || return 1
      nproc; python3 -c "import ray; print('ray', ray.__version__)"
      OMP_NUM_THREADS=1 python3 benchmarks/sweep_scaling.py --gpus ${SCALING_GPUS:-4 8} \
        --shell "${SCALING_SHELL:-measured}" --timeline "$OUT/scaling-timeline.csv" ${SCALING_ARGS:-} ;;
    *) echo "unknown stage $1 ($KNOWN_STAGES)"; return 2 ;;
  esac
}

set_path
if [ "${1:-}" = "--stage-only" ]; then stage "$2"; exit $?; fi
# every stage named before anything runs: a mistyped one on a device call is refused at once (exit 2), not found in
# the logs after the installs and the other stages spent the call
skip_next=0
for arg in "$@"; do
  if [ "$skip_next" = 1 ]; then skip_next=0; continue; fi
  case "$arg" in
    --install-batch) skip_next=1 ;;
    *) if ! [[ "|$KNOWN_STAGES|" == *"|$arg|"* ]]; then echo "unknown stage $arg ($KNOWN_STAGES)"; exit 2; fi ;;
  esac
done
stages=()
while [ $# -gt 0 ]; do
  case "$1" in
    --install-batch) { install_batch "$2" 2>&1 | tee -a "$OUT/install.log"; } ; set_path; shift 2 ;;
    install) { stage install 2>&1 | tee -a "$OUT/install.log"; }; set_path; shift ;;
    *) stages+=("$1"); shift ;;
  esac
done
for s in "${stages[@]}"; do run_stage "$s"; done
echo "call done in $((SECONDS - START)) s; logs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ "${#FAILED_STAGES[@]}" -gt 0 ]; then  # every stage ran; the call's exit says whether one failed
  echo "FAILED stages: ${FAILED_STAGES[*]}"
  exit 1
fi
