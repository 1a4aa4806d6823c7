#!/usr/bin/env bash
# One-time setup on a fresh machine: torch (only if missing), nvidia-cutlass,
# build deps, then an editable build of cutlass_fused against that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# torch: never replaced. The CPU dev/CI machines carry torch 2.13.0 on disk.
$py -c "import torch" 2>/dev/null || $py -m pip install -q torch==2.13.0
# nvidia-cutlass: its headers build the kernels; its Python interface (cutlass_cppgen, with networkx,
# pydot, scipy, treelib) traces the epilogues (python -m codegen.generate, tests/test_trace.py).
if ! $py -c "import cutlass_library" 2>/dev/null; then
  if ls .wheels/nvidia_cutlass-*.whl >/dev/null 2>&1; then   # offline GPU machine: carried wheels
    $py -m pip install -q --no-index --no-deps .wheels/*.whl
  else
    $py -m pip install -q nvidia-cutlass==4.2.0.0
  fi
fi
$py -c "import scikit_build_core" 2>/dev/null || $py -m pip install -q scikit-build-core
$py -c "import pytest, xdist, ninja" 2>/dev/null || $py -m pip install -q pytest pytest-xdist ninja
# The tabular example's test reads scikit-learn's bundled breast-cancer table (a test-only need).
$py -c "import sklearn" 2>/dev/null || $py -m pip install -q scikit-learn
# The benchmark CLI's progress bar and plots (the [bench] extra).
$py -c "import tqdm, matplotlib" 2>/dev/null || $py -m pip install -q tqdm matplotlib
source scripts/pick_cxx.sh
echo "setup: building cutlass_fused (the CUDA kernels take minutes where nvcc and CUDA torch are here)"
$py -m pip install -q --no-build-isolation --no-deps -e .
$py - <<'PY'
import torch
import cutlass_fused
n = len(cutlass_fused.built_kernels())
print(f"setup: built cutlass_fused {cutlass_fused.__version__} against torch {torch.__version__}: {n} CUDA kernels"
      + ("" if n else " (a CPU build: the ops run in PyTorch)"))
PY
