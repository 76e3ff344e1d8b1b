#!/usr/bin/env bash
# Puts CUTLASS's C++ headers, for the epilogue-fused GEMM, in DEST (default
# /opt/ulysses/cutlass-4.2.0.0, the CMake default of ULYSSES_CUTLASS_DIR): include/ and
# tools/util/include/ of the nvidia-cutlass wheel on PyPI, pinned and hash-checked. Nothing of
# the wheel is imported or installed as a Python package. Needs python3 with pip (Debian:
# python3-pip). Does nothing when DEST already has them.
#
#   scripts/fetch-cutlass.sh [DEST]
set -euo pipefail
version=4.2.0.0
sha256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
dest=${1:-/opt/ulysses/cutlass-$version}
if [ -f "$dest/include/cutlass/cutlass.h" ]; then
  echo "fetch-cutlass: CUTLASS $version present in $dest"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || [ -w "$(dirname "$dest")" ] || sudo="sudo"
python=/usr/bin/python3
[ -x "$python" ] || python=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==$version"
wheel=$(ls "$tmp"/nvidia_cutlass-"$version"-*.whl)
echo "$sha256  $wheel" | sha256sum -c --quiet
"$python" - "$wheel" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith(("cutlass_library/source/include/",
                            "cutlass_library/source/tools/util/include/")):
            z.extract(name, sys.argv[2])
PY
$sudo mkdir -p "$dest/tools/util"
$sudo cp -r "$tmp/x/cutlass_library/source/include" "$dest/"
$sudo cp -r "$tmp/x/cutlass_library/source/tools/util/include" "$dest/tools/util/"
echo "fetch-cutlass: CUTLASS $version headers in $dest"
