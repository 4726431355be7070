#!/usr/bin/env bash
# Builds the C++ runtime against the torch of $PYTHON (default: the repository's .venv, else python3):
#   runtimes/cpp/build.sh [BUILD_DIR]        (default BUILD_DIR: build/cpp)
# The binary is BUILD_DIR/hstu-export-run; the library BUILD_DIR/libhstu_export_runtime.so.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="${1:-$repo/build/cpp}"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool is missing: install cmake and a C++20 compiler (apt-get install cmake g++)" >&2; exit 1; }
done
prefix="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
# Where fbgemm_gpu's shared libraries are (found without importing it), as the runtime's default.
ops="$("$python" -c 'import importlib.util, os; s = importlib.util.find_spec("fbgemm_gpu"); print(os.path.dirname(s.origin) if s and s.origin else "")')"
cmake -S "$here" -B "$build" -DCMAKE_PREFIX_PATH="$prefix" -DHSTU_EXPORT_OP_LIBRARY_DIRS="$ops" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)"
echo "built $build/hstu-export-run"
