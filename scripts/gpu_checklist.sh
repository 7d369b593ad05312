#!/usr/bin/env bash
# The GPU checklist (../shared/GPU_CHECKLIST.md) on a lent GPU machine, one stage per call:
#   bash scripts/gpu_checklist.sh parity|selection|speed|table6|shapes
# Logs go to $OUT (or ./gpu-logs). The machine has torch but no network: wheels the project needs beyond its
# image (transformers >= 5.23) travel in .whl/ and install into /tmp/site.
set -uo pipefail
OUT="${OUT:-gpu-logs}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && [ ! -d /tmp/site/transformers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD"
env_line() {
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'device', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}
for stage in "$@"; do
  case "$stage" in
    parity)
      { env_line; python3 -m pytest -q -p no:cacheprovider -k cuda tests/models tests/selection \
          tests/test_efficiency.py; } 2>&1 | tee "$OUT/parity.log" ;;
    library)  # the whole library suite (CPU and CUDA tests) on the device's torch / transformers
      { env_line; python3 -m pytest -q -p no:cacheprovider tests/models tests/selection tests/test_efficiency.py \
          tests/test_architecture.py; } 2>&1 | tee "$OUT/library.log" ;;
    selection)
      { env_line
        for dt in float32 float16; do for b in 1 8; do
          python3 benchmarks/selection.py --device cuda --dtype $dt --batch $b --repeats 9; echo; done; done
      } 2>&1 | tee "$OUT/selection.log" ;;
    speed)
      { env_line; python3 -m benchmarks.spectrum --device cuda
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
        for dt in float16 float32; do for b in 1 8; do
          python3 benchmarks/selection.py --device cuda --dtype $dt --batch $b --repeats 9; echo; done; done
      } 2>&1 | tee "$OUT/speed.log" ;;
    table6)
      { env_line; python3 benchmarks/efficiency.py --model shape:llava_next_7b --dtype float16 --device cuda \
          --budgets none,320 --methods vispruner,divprune,promprune --repeats 5 --max-new-tokens 8; } \
        2>&1 | tee "$OUT/table6.log" ;;
    shapes)
      { env_line
        python3 benchmarks/efficiency.py --model shape:llava_1_5_7b --dtype float16 --device cuda --skip-analytic \
          --budgets none,64 --methods vispruner,divprune,promprune --repeats 5 --max-new-tokens 8
        python3 benchmarks/efficiency.py --model shape:qwen2_5_vl_7b --dtype bfloat16 --device cuda --skip-analytic \
          --budgets none,128 --methods vispruner,divprune,promprune --repeats 5 --max-new-tokens 8; } \
        2>&1 | tee "$OUT/shapes.log" ;;
    *) echo "unknown stage $stage (parity|library|selection|speed|table6|shapes)"; exit 2 ;;
  esac
done
