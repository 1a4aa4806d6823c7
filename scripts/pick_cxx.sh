# Sourced by setup.sh and device_check.sh: export CXX/CUDAHOSTCXX as a compiler
# whose libstdc++ is the one torch's process loads. An extension built by a
# newer GCC instantiates libstdc++ internals (ostream, locale) from headers the
# runtime does not match; on the GPU machine (/opt/gcc vs the system GCC 13)
# that crashed every error message formatted by c10::str.
_stdcpp_of() { basename "$(readlink -f "$("$1" -print-file-name=libstdc++.so.6 2>/dev/null)")" 2>/dev/null; }
_runtime=$(${PYTHON:-python3} -c "import torch
print(next((l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l), ''))" 2>/dev/null)
_runtime=$(basename "$(readlink -f "$_runtime" 2>/dev/null)" 2>/dev/null)
if [ -n "$_runtime" ]; then
  _cur=${CXX:-$(command -v c++ || command -v g++)}
  if [ -n "$_cur" ] && [ "$(_stdcpp_of "$_cur")" != "$_runtime" ]; then
    for _c in /usr/bin/g++ /usr/bin/c++; do
      if [ -x "$_c" ] && [ "$(_stdcpp_of "$_c")" = "$_runtime" ]; then
        echo "cutlass_fused: $_cur links $(_stdcpp_of "$_cur"), torch runs $_runtime: building with $_c"
        export CXX=$_c CUDAHOSTCXX=$_c
        break
      fi
    done
  fi
fi
