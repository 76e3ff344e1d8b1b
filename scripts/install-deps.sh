#!/usr/bin/env bash
# Installs what ulyssesd builds with, from the distribution (Debian 12 / Ubuntu 24.04 or newer).
# The CUDA toolkit (nvcc, cuBLAS, NCCL) is optional: without it the host backend alone is built.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libgtest-dev libgmock-dev
  libcli11-dev nlohmann-json3-dev libcpp-httplib-dev
  libdlpack-dev                  # the client library's DLPack export of results
  patchelf python3-venv systemd  # the deploy tests: tarball RUNPATH, Python venv, systemd-analyze
  clang-14 libclang-rt-14-dev    # scripts/fuzz.sh and scripts/sanitize.sh: libFuzzer, sanitizers
  python3-pip                    # fetches the CUTLASS headers' wheel (below)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
else
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "install-deps: done"
fi

# CUTLASS's C++ headers for the epilogue-fused GEMM (pinned; the CMake default place).
"$(dirname "$0")/fetch-cutlass.sh"
