# Sourced by setup.sh and device_run.sh: make sure CXX links libstdc++ as a
# shared library, like torch. A compiler that links it statically (the GPU
# machine's /opt/gcc/bin/g++ wrapper does, through its -B search path) gives
# the extension its own uninitialised copy of the iostream/locale code, and
# every error message c10::str formats then crashes the process.
_shared_stdcpp() {
  local d; d=$(mktemp -d)
  printf 'int f(int x) { if (x) throw x; return 0; }\n' > "$d/t.cpp"
  "$1" -shared -fPIC "$d/t.cpp" -o "$d/t.so" 2>/dev/null && ldd "$d/t.so" 2>/dev/null | grep -q 'libstdc++'
  local rc=$?; rm -rf "$d"; return $rc
}
_cur=${CXX:-$(command -v c++ || command -v g++)}
if [ -n "$_cur" ] && ! _shared_stdcpp "$_cur"; then
  for _c in /usr/bin/g++ /usr/bin/c++; do
    if [ -x "$_c" ] && _shared_stdcpp "$_c"; then
      echo "cutlass_fused: $_cur links libstdc++ statically; building with $_c"
      export CXX=$_c CUDAHOSTCXX=$_c
      break
    fi
  done
fi
