#!/usr/bin/env bash
# The CPU test suite against another torch version (the README declares torch >= 2.4):
#
#   bash scripts/cpu_torch_check.sh 2.4.1 [pytest args...]
#
# A venv in /tmp/cutlass_fused-torch<VERSION> with that torch from the package index, a CPU-only
# build of the extension (-DCUTLASS_FUSED_CUDA=OFF) in its own build folder, then pytest. The
# index's torch wheels are CUDA builds, whose CMake config wants CUDA libraries even for a CPU-only
# extension: nvrtc and nvToolsExt from torch's own nvidia-* wheels, and a libcuda for the link
# (a machine without a driver gets an empty stand-in, never loaded by a CPU test).
set -euo pipefail
version=${1:?usage: scripts/cpu_torch_check.sh TORCH_VERSION [pytest args...]}
shift
cd "$(dirname "$0")/.."
venv=/tmp/cutlass_fused-torch$version
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py=$venv/bin/python
$py -c "import torch" 2>/dev/null || $py -m pip install -q "torch==$version" numpy
$py -m pip install -q scikit-build-core ninja pytest pytest-timeout tqdm matplotlib nvidia-cutlass==4.2.0.0
site=$($py -c "import site; print(site.getsitepackages()[0])")
cuda=${CUDA_HOME:-/usr/local/cuda}
nvrtc=$(find "$site/nvidia" -name "libnvrtc.so*" | head -1)
nvtx=$(find "$site/nvidia" -name "libnvToolsExt.so*" | head -1)
libcuda=$(find / -name "libcuda.so" -not -path "/proc/*" 2>/dev/null | head -1 || true)
if [ -z "$libcuda" ]; then
  libcuda=$venv/fakecuda/libcuda.so
  mkdir -p "$(dirname "$libcuda")"
  echo "" | gcc -shared -Wl,-soname,libcuda.so.1 -o "$libcuda" -x c -
  ln -sf libcuda.so "$(dirname "$libcuda")/libcuda.so.1"
fi
# torch <= 2.4's Caffe2 config requires the CUDA::nvToolsExt target, which CUDA 12.9+ toolkits lack.
shim=$venv/nvtx_shim.cmake
printf 'find_package(CUDAToolkit)\nif(NOT TARGET CUDA::nvToolsExt)\n  add_library(CUDA::nvToolsExt INTERFACE IMPORTED)\nendif()\n' > "$shim"
source scripts/pick_cxx.sh
defs=(-C cmake.define.CUTLASS_FUSED_CUDA=OFF -C "cmake.define.CMAKE_PROJECT_INCLUDE=$shim"
      -C "cmake.define.CUDA_TOOLKIT_ROOT_DIR=$cuda" -C "cmake.define.CUDA_cuda_driver_LIBRARY=$libcuda")
[ -n "$nvrtc" ] && defs+=(-C "cmake.define.CUDA_nvrtc_LIBRARY=$nvrtc")
[ -n "$nvtx" ] && defs+=(-C "cmake.define.LIBNVTOOLSEXT=$nvtx")
CUDA_HOME=$cuda $py -m pip install -q --no-build-isolation --no-deps -C "build-dir=$venv/build" "${defs[@]}" -e .
export LD_LIBRARY_PATH=$(dirname "$libcuda")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
$py -c "import torch; print('torch', torch.__version__)"
$py -m pytest -q tests -p no:cacheprovider "$@"
