#!/usr/bin/env bash
# Configures and builds ulyssesd into build/ (CUDA kernels too when nvcc is found), with line
# tables for debug information (ULYSSES_CMAKE_ARGS="-DULYSSES_DEBUG_INFO=full" for full).
#   scripts/build.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DULYSSES_DEBUG_INFO=lines \
    ${ULYSSES_CMAKE_ARGS:-}
fi
if [ $# -gt 0 ]; then
  targets=(); for t in "$@"; do targets+=(--target "$t"); done
  cmake --build build -j"$jobs" "${targets[@]}"
else
  cmake --build build -j"$jobs"
fi
