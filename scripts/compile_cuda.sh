#!/usr/bin/env bash
# Compiles every torch-free CUDA source with nvcc for the archs CMake uses,
# two at a time (each sm90 unit needs ~3.5 GB and ~40 s). No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
cut=$(python3 -c "import cutlass_library; print(cutlass_library.source_path)")
out=$(mktemp -d)
flags="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -Xcudafe --diag_suppress=940 -Icsrc -I$cut/include -I$cut/tools/util/include"
jobs=()
for f in csrc/generated/sm90_*.cu; do jobs+=("$f|-gencode=arch=compute_90a,code=sm_90a"); done
for f in csrc/generated/sm80_*.cu; do jobs+=("$f|-gencode=arch=compute_80,code=sm_80"); done
for f in csrc/kernels/batch_norm.cu csrc/kernels/tf32x3.cu; do
  jobs+=("$f|-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90")
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} bash -c '
  f=${1%%|*}; arch=${1#*|}
  nvcc '"$flags"' $arch -c "$f" -o '"$out"'/$(basename "$f").o || { echo "FAILED: $f"; exit 255; }
  echo "compiled: $f ($arch)"' _ {}
echo "compile_cuda: ${#jobs[@]} sources compiled"
