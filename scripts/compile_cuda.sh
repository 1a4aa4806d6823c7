#!/usr/bin/env bash
# Compiles every CUDA source, and the CUDA binding, through CMake's own targets
# (cutlass_fused_kernels, cutlass_fused_cuda_glue) with their real flags and
# archs, without linking: no GPU and no CUDA torch needed (the CPU torch wheel
# ships the CUDA headers). CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pick_cxx.sh
[ -n "${CXX:-}" ] && export CUDAHOSTCXX=${CUDAHOSTCXX:-$CXX}
build=build/compile-cuda
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUTLASS_FUSED_CUDA=ON \
  -DPython_EXECUTABLE="$(command -v python3)" > "$build.log" 2>&1 || { tail -30 "$build.log"; exit 1; }
grep -E "cutlass_fused:" "$build.log" || true
# The binding includes ATen/cuda/CUDAContext.h, which needs the cuBLAS and cuSPARSE
# headers: a toolkit with nvcc alone (the CI machine's) compiles the kernels only.
targets=(cutlass_fused_kernels)
if printf '#include <cusparse.h>\n#include <cublas_v2.h>\n' | nvcc -E -x cu - > /dev/null 2>&1; then
  targets+=(cutlass_fused_cuda_glue)
else
  echo "compile_cuda: nvcc finds no cuBLAS/cuSPARSE headers: skipping the CUDA binding (ops_cuda.cpp ...)"
fi
cmake --build "$build" --target "${targets[@]}" -j "${JOBS:-2}"
for t in "${targets[@]}"; do
  echo "compile_cuda: $t: $(find "$build/CMakeFiles/$t.dir" -name '*.o' | wc -l) objects"
done
