#!/usr/bin/env bash
# Builds the C++ runtime against the torch of $PYTHON (default: the repository's .venv, else python3):
#   runtimes/cpp/build.sh [BUILD_DIR]        (default BUILD_DIR: build/cpp)
# The binary is BUILD_DIR/hstu-export-run; the library BUILD_DIR/libhstu_export_runtime.so; the runtime for Python
# (hstu_export.runtimes.native) BUILD_DIR/libhstu_export_native.so.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="${1:-$repo/build/cpp}"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
command -v c++ >/dev/null 2>&1 || { echo "error: no C++ compiler: install a C++20 compiler (apt-get install g++)" >&2; exit 1; }
prefix="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
# Where fbgemm_gpu's shared libraries are (found without importing it), as the runtime's default.
ops="$("$python" -c 'import importlib.util, os; s = importlib.util.find_spec("fbgemm_gpu"); print(os.path.dirname(s.origin) if s and s.origin else "")')"

# Without CMake, or where torch's CMake config cannot be used (a CUDA build of torch from pip asks for a
# CUDA toolkit that serving machines often lack; the runtime itself needs no CUDA headers), the same
# build with the compiler alone. HSTU_EXPORT_BUILD=compiler forces it.
plain_build() {
  echo "building with the compiler alone ($1)"
  local torch_dir abi libs src
  torch_dir="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
  abi="$("$python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"
  libs="-ltorch -ltorch_cpu -lc10"
  for cuda_lib in torch_cuda c10_cuda; do
    [ -e "$torch_dir/lib/lib$cuda_lib.so" ] && libs="$libs -l$cuda_lib"
  done
  mkdir -p "$build"
  local flags=(-std=c++20 -O2 -fPIC -D_GLIBCXX_USE_CXX11_ABI="$abi" -I"$here/include"
               -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include")
  # CUDA graphs for the KV cache need the CUDA runtime's headers and a CUDA libtorch (as in CMakeLists.txt).
  local cuda_include="${CUDA_HOME:-/usr/local/cuda}/include" graphs=()
  if [ -e "$cuda_include/cuda_runtime_api.h" ] && [ -e "$torch_dir/lib/libtorch_cuda.so" ]; then
    graphs=(-isystem "$cuda_include" -DHSTU_EXPORT_CUDA_GRAPHS)
  fi
  # The runtime library's sources as CMakeLists.txt lists them: a new file is added there alone.
  local sources=()
  for source in $(sed -n '/^add_library(hstu_export_runtime /,/)/p' "$here/CMakeLists.txt" | grep -o 'src/[A-Za-z0-9_]*\.cpp'); do
    sources+=("$here/$source")
  done
  c++ "${flags[@]}" "${graphs[@]}" -shared -DHSTU_EXPORT_DEFAULT_OP_LIBRARY_DIRS="\"$ops\"" "${sources[@]}" \
    -o "$build/libhstu_export_runtime.so" -Wl,--no-as-needed -L"$torch_dir/lib" $libs -ldl \
    -Wl,-rpath,"$torch_dir/lib"
  c++ "${flags[@]}" "$here/src/main.cpp" -o "$build/hstu-export-run" -Wl,--no-as-needed \
    -L"$build" -lhstu_export_runtime -L"$torch_dir/lib" $libs -Wl,-rpath,"$build" -Wl,-rpath,"$torch_dir/lib"
  c++ "${flags[@]}" -shared "$here/src/native.cpp" -o "$build/libhstu_export_native.so" -Wl,--no-as-needed \
    -L"$build" -lhstu_export_runtime -L"$torch_dir/lib" $libs -Wl,-rpath,"$build" -Wl,-rpath,"$torch_dir/lib"
}

if [ "${HSTU_EXPORT_BUILD:-cmake}" = compiler ]; then
  plain_build "HSTU_EXPORT_BUILD=compiler"
elif ! command -v cmake >/dev/null 2>&1; then
  plain_build "cmake is not installed"
elif ! { mkdir -p "$build" && cmake -S "$here" -B "$build" -DCMAKE_PREFIX_PATH="$prefix" \
         -DHSTU_EXPORT_OP_LIBRARY_DIRS="$ops" -DCMAKE_BUILD_TYPE=Release >"$build/configure.log" 2>&1; }; then
  tail -n 5 "$build/configure.log" >&2
  rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
  plain_build "torch's CMake config failed, log in $build/configure.log"
else
  cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)"
fi
echo "built $build/hstu-export-run"
