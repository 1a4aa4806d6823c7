#!/usr/bin/env bash
# Compiles every CUDA source, and the CUDA binding, through CMake's own targets
# (cutlass_fused_kernels, cutlass_fused_cuda_glue) with their real flags and
# archs, without linking: no GPU and no CUDA torch needed (the CPU torch wheel
# ships the CUDA headers). CI runs it. CONFIGURE_ONLY=1 stops after the configure, for one
# object by hand: CPATH=$PWD/build/cuda-headers/include ninja -C build/compile-cuda <object>.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pick_cxx.sh
[ -n "${CXX:-}" ] && export CUDAHOSTCXX=${CUDAHOSTCXX:-$CXX}
build=build/compile-cuda
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUTLASS_FUSED_CUDA=ON \
  -DPython_EXECUTABLE="$(command -v python3)" > "$build.log" 2>&1 || { tail -30 "$build.log"; exit 1; }
grep -E "cutlass_fused:" "$build.log" || true
# The binding includes ATen/cuda/CUDAContext.h, which needs the cuBLAS, cuSPARSE and cuSOLVER
# headers and c10's generated c10/cuda/impl/cuda_cmake_macros.h. A toolkit with nvcc alone (the CI
# machine's) and the CPU torch wheel have neither: the headers come from NVIDIA's wheels (their
# include/ folders only), the generated one as the line a shared-library CUDA build of torch has.
targets=(cutlass_fused_kernels)
probe() { printf '#include <cusparse.h>\n#include <cublas_v2.h>\n#include <cusolverDn.h>\n' | nvcc -E -x cu - > /dev/null 2>&1; }
if ! probe; then
  hdr=$PWD/build/cuda-headers
  if [ ! -d "$hdr/include" ]; then
    python3 -m pip download -q --no-deps -d "$hdr/wheels" nvidia-cublas==13.1.1.3 nvidia-cusparse==12.6.3.3 \
      nvidia-cusolver==12.0.4.66 > "$hdr.log" 2>&1 && python3 - "$hdr" <<'PY' || rm -rf "$hdr/include"
import pathlib, sys, zipfile
hdr = pathlib.Path(sys.argv[1])
for whl in (hdr / "wheels").glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if "/include/" in name and not name.endswith("/"):
                out = hdr / "include" / name.split("/include/", 1)[1]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
macros = hdr / "include/c10/cuda/impl/cuda_cmake_macros.h"
macros.parent.mkdir(parents=True, exist_ok=True)
macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
PY
  fi
  export CPATH=$hdr/include${CPATH:+:$CPATH}
fi
if probe; then
  targets+=(cutlass_fused_cuda_glue)
else
  echo "compile_cuda: no cuBLAS/cuSPARSE/cuSOLVER headers (see build/cuda-headers.log): skipping the CUDA binding"
fi
[ -n "${CONFIGURE_ONLY:-}" ] && exit 0
cmake --build "$build" --target "${targets[@]}" -j "${JOBS:-2}"
for t in "${targets[@]}"; do
  echo "compile_cuda: $t: $(find "$build/CMakeFiles/$t.dir" -name '*.o' | wc -l) objects"
done
