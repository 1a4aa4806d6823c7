#!/usr/bin/env bash
# One device call: build, GPU test suite, then benchmark CLI runs given as
# arguments (each a quoted argument list for `python3 -m cutlass_fused.bench`).
# TESTS picks the test paths (default: tests; run as the README runs them, -n auto). Logs go to $OUT.
# Usage: bash scripts/device_run.sh "--impl eager --impl cutlass_fused" ...
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
source scripts/pick_cxx.sh
# SKIP_BUILD=1: a later call on a warm machine, whose editable install an earlier call built
# (built anyway where the extension does not import: a fresh machine).
if [ -z "${SKIP_BUILD:-}" ] || ! python3 -c "import cutlass_fused._C" 2>/dev/null; then
  start=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1
  rc=$?
  grep -E "cutlass_fused:|error" "$OUT/build.log" | head -20
  echo "build rc=$rc in $(( $(date +%s) - start )) s"
  [ $rc -eq 0 ] || { tail -60 "$OUT/build.log"; exit $rc; }
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  start=$(date +%s)
  CUTLASS_FUSED_POISON=1 timeout ${TEST_TIMEOUT:-540} python3 -m pytest -n auto ${TESTS:-tests} -q -rs ${PYTEST_ARGS:-} > "$OUT/test.log" 2>&1
  echo "pytest rc=$? in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/test.log")"
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/test.log" | head -20
fi
i=0
for a in "$@"; do
  i=$((i + 1))
  echo "== bench $i: $a"
  eval timeout ${BENCH_TIMEOUT:-400} python3 -m cutlass_fused.bench --out "$OUT/bench$i" $a 2> "$OUT/bench$i.err" | grep -v "^check" 
  echo "bench $i rc=$?"; grep -iE "error|skipped" "$OUT/bench$i.err" | head -5
done
