#!/usr/bin/env bash
# Rehearse the GPU plan (scripts/gpu_checklist.sh) here, without a GPU, so that a lent machine's 30 minutes go to
# measuring and not to finding out that a stage cannot start.
#
#   bash scripts/device_rehearsal.sh [STAGE...]      (default: library sweep table6-pipeline scaling)
#
# 1. A CPython 3.12 virtualenv holding the GPU image's package list (scripts/device_image.txt, less its CUDA- and
#    JAX-only entries). Since 2026-11-28 every entry has the version the image's `pip freeze` showed; a virtualenv
#    made before then holds PyPI's newest of the unversioned ones (a pessimistic stand-in: delete it to remake it).
# 2. The wheel batches (scripts/device_wheels.py build), installed into a copy of this commit's tree exactly as
#    gpu_checklist.sh installs them on the machine (PYTHONPATH over .site/whlN, the image's packages below).
# 3. The stages that need no CUDA, on the CPU: `library` (the library's tests on the image's torch), `sweep` (the
#    quickstart with resources.device=cpu), `table6-pipeline` (on tiny:llava_next at 32 tokens, 8 samples) and
#    `scaling` (2 simulated GPUs, 4 samples per task). parity / lanczos / margin / view-shares / selection /
#    vispruner-tiles / table6 / shapes / speed need CUDA.
#
# Logs go to $OUT (default ./devsim-logs), one per stage, as on the machine. Needs PyPI and a CPython 3.12 (PY312;
# default: python3.12 on PATH, else pyenv's newest 3.12). ~3 min for the virtualenv the first time, then ~12 min for
# the four stages on 2 cores. DEVSIM_VENV / DEVSIM_TREE choose where the virtualenv and the tree copy go.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${DEVSIM_VENV:-/tmp/promprune-devsim}"
TREE="${DEVSIM_TREE:-/tmp/promprune-devsim-tree}"
export OUT="${OUT:-$PWD/devsim-logs}"
mkdir -p "$OUT"
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(library sweep table6-pipeline scaling)

py312() {
  local c
  for c in "${PY312:-}" python3.12 "$(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python3 2>/dev/null | sort -V | tail -1)"; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$c"; return; }
  done
  echo "device_rehearsal: no CPython 3.12 found (the GPU machine runs 3.12): install one, or set PY312=/path/to/python3.12" >&2
  exit 2
}

if [ ! -x "$VENV/bin/python3" ]; then
  "$(py312)" -m venv "$VENV"
  grep -v '^#' "$ROOT/scripts/device_image.txt" \
    | grep -v -E '^(cupy|cuda-|nvidia|jax|flax|chex|diffrax|equinox|e3nn|botorch|gpytorch|cmake)' > "$VENV/image.txt"
  "$VENV/bin/pip" install -q -r "$VENV/image.txt"
fi
"$VENV/bin/python3" -c "import torch, transformers, numpy; print('device-like venv: python', __import__('sys').version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"

cd "$ROOT"
python3 scripts/device_wheels.py build > "$OUT/wheels.log" && python3 scripts/device_wheels.py check >> "$OUT/wheels.log"
grep -E '^  \.whl|all met|not met' "$OUT/wheels.log"

rm -rf "$TREE" && mkdir -p "$TREE"
git archive HEAD | tar -x -C "$TREE"
cp -r "$ROOT"/.whl[0-9]* "$TREE"/
cd "$TREE"
export PATH="$VENV/bin:$PATH" RAY_TMPDIR="${RAY_TMPDIR:-$(mktemp -d /tmp/devsim-ray-XXXX)}" CALL_BUDGET_S=3600
export SWEEP_SET="--set resources.device=cpu" TABLE6_LIMIT=8
export TABLE6_MODEL_SET="--set model.pretrained=tiny:llava_next --set model.dtype=float32"
export TABLE6_SET="--set resources.device=cpu --set grid.budget=[32]"
export SCALING_GPUS=2 SCALING_ARGS="--samples-per-task 4 --sample-s 0.02 --load-s 0.1"
batches=()  # every batch the build made (three since the image's versions were pinned), at once: no 64 MiB limit here
for d in .whl[0-9]*; do batches+=(--install-batch "${d#.whl}"); done
bash scripts/gpu_checklist.sh "${batches[@]}" "${STAGES[@]}" || echo "(a stage failed: the summary says which)"
echo "--- summary"
for s in "${STAGES[@]}"; do
  printf '%-16s %s\n' "$s" "$(grep -E '[0-9]+ passed|sweep.py exit [0-9]+ after|^efficiency [0-9.]+ at' "$OUT/$s.log" | tail -1)"
done
