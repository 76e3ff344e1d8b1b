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

# CUTLASS's C++ headers for the epilogue-fused GEMM, from the nvidia-cutlass wheel on PyPI
# (pinned, hash-checked; nothing of it is imported), into /opt/ulysses/cutlass-<version>
# (the CMake default of ULYSSES_CUTLASS_DIR).
cutlass_version=4.2.0.0
cutlass_sha256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
cutlass_dir=/opt/ulysses/cutlass-$cutlass_version
if [ -f "$cutlass_dir/include/cutlass/cutlass.h" ]; then
  echo "install-deps: CUTLASS $cutlass_version present"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  /usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
    "nvidia-cutlass==$cutlass_version"
  wheel=$(ls "$tmp"/nvidia_cutlass-"$cutlass_version"-*.whl)
  echo "$cutlass_sha256  $wheel" | sha256sum -c --quiet
  /usr/bin/python3 - "$wheel" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith(("cutlass_library/source/include/",
                            "cutlass_library/source/tools/util/include/")):
            z.extract(name, sys.argv[2])
PY
  $sudo mkdir -p "$cutlass_dir"
  $sudo cp -r "$tmp/x/cutlass_library/source/include" "$cutlass_dir/"
  $sudo mkdir -p "$cutlass_dir/tools/util"
  $sudo cp -r "$tmp/x/cutlass_library/source/tools/util/include" "$cutlass_dir/tools/util/"
  echo "install-deps: CUTLASS $cutlass_version headers in $cutlass_dir"
fi
