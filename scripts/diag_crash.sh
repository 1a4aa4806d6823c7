#!/usr/bin/env bash
# Device diagnostics for the error-path crash: toolchain, linkage, and a
# backtrace of one failing call under cuda-gdb. Logs to $OUT.
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0
python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=build.verbose=true > "$OUT/build.log" 2>&1
echo "build rc=$?"
which c++ g++ gcc; g++ --version | head -1; readlink -f "$(which g++)"
python3 -c "import torch; print(torch.__config__.show())" | grep -iE "compiler|abi|CXX_FLAGS" | cut -c1-300
so=$(python3 -c "import cutlass_fused._C as c; print(c.__file__)")
ldd "$so" | grep -E "stdc|gcc_s|c10|torch"
python3 -c "import torch,os; p=os.path.dirname(torch.__file__)+'/lib/libc10.so'; os.system('ldd '+p+' | grep -E \"stdc|gcc_s\"')"
grep -m2 -E "ops.cpp.o -c" "$OUT/build.log" | cut -c1-700
cuda-gdb -batch -ex run -ex bt --args python3 -c "import torch, cutlass_fused; from cutlass_fused.ops import ops; ops.linear_scale_stats(torch.randn(4,7), torch.randn(5,6), None, torch.randn(5), 'auto', False)" 2>&1 | grep -vE "^\[New Thread|^\[Thread" | tail -30
