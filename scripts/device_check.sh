#!/usr/bin/env bash
# Build, test and benchmark on a GPU machine in one go; full logs go to $OUT
# (the device tool's folder) or ./out. Wheels the machine lacks (nvidia-cutlass,
# treelib, pydot) are taken from .wheels/ when present.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # we set archs per source; this only quiets detection
source scripts/pick_cxx.sh
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1
rc=$?
grep -E "cutlass_fused:|error" "$OUT/build.log" | head -40
echo "build rc=$rc in $(( $(date +%s) - start )) s"
[ $rc -eq 0 ] || { tail -60 "$OUT/build.log"; exit $rc; }
python3 -m pytest tests -q -rs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test.log" | tail -40
echo "pytest rc=$?"
python3 -m cutlass_fused 2>&1 | tee "$OUT/demo.log"
