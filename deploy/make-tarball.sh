#!/usr/bin/env bash
# make-tarball.sh BUILD_DIR OUT_DIR
#
# Packs a built tree into OUT_DIR/ulyssesd-<version>-linux-<arch>.tar.gz, a relocatable
# install that runs wherever it is unpacked, without the -dev packages:
#
#   ulyssesd-<version>-linux-<arch>/
#     bin/       ulyssesd ulyssesctl ulysses-demo ulyssesd-node.sh
#     lib/       the shared libraries the programs need beyond the base system (gRPC,
#                protobuf, absl, spdlog, fmt, c-ares, re2, OpenSSL, ...), found with ldd
#     lib/       libulysses_client.so* (the client library: C ABI and C++ API), its CMake
#                package (lib/cmake/ulysses) and pkg-config files (lib/pkgconfig)
#     include/   ulysses/c_api.h, ulysses/client/client.h and the headers they include
#     python/    the Python package's source: pip install <root>/python
#     etc/       ulyssesd.example.json config.schema.json
#     systemd/   ulyssesd@.service nvidia-mps.service
#     share/doc/ulyssesd/  operations.md README.md
#
# Left out on purpose, expected from the target system: glibc (libc, libm, ld-linux, ...),
# libstdc++ and libgcc_s, the NVIDIA driver (libcuda, libnvidia-*) and the CUDA toolkit's
# libraries (cudart, cuBLAS, NCCL, ...), which a GPU build takes from the CUDA installation.
#
# The programs find lib/ through RUNPATH $ORIGIN/../lib (and each bundled library, the client
# library included, through RUNPATH $ORIGIN), set with patchelf. Without patchelf the programs
# go to libexec/ and bin/ holds wrapper scripts that set LD_LIBRARY_PATH (a program linking the
# client library then needs LD_LIBRARY_PATH=<root>/lib too).
#
# Prints the tarball's path on its last line.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR" >&2
  exit 64
fi
build=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { echo "make-tarball: $*" >&2; }

# The programs and where the build tree has them.
declare -A programs=(
  [ulyssesd]=daemon/ulyssesd
  [ulyssesctl]=client/ulyssesctl/ulyssesctl
  [ulysses-demo]=client/ulysses-demo
)
for name in "${!programs[@]}"; do
  if [ ! -x "$build/${programs[$name]}" ]; then
    log "$build/${programs[$name]} is missing: build first (cmake --build $1)"
    exit 1
  fi
done

version=$(sed -n 's/^CMAKE_PROJECT_VERSION:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null | head -n1)
if [ -z "$version" ]; then
  version=$("$build/daemon/ulyssesd" --version | awk '{print $2}')
fi
arch=$(uname -m)
name="ulyssesd-$version-linux-$arch"
tarball="$out/$name.tar.gz"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/$name"
mkdir -p "$root"/{bin,lib,etc,systemd,share/doc/ulyssesd}

for name_ in "${!programs[@]}"; do
  install -m 0755 "$build/${programs[$name_]}" "$root/bin/$name_"
done
install -m 0755 "$src/deploy/ulyssesd-node.sh" "$root/bin/ulyssesd-node.sh"
install -m 0644 "$src/deploy/ulyssesd.example.json" "$src/deploy/config.schema.json" "$root/etc/"
install -m 0644 "$src/deploy/systemd/ulyssesd@.service" "$src/deploy/systemd/nvidia-mps.service" \
  "$root/systemd/"
install -m 0644 "$src/docs/operations.md" "$src/README.md" "$root/share/doc/ulyssesd/"
install -m 0644 "$src/docs/api.md" "$root/share/doc/ulyssesd/"

# The client library with its headers, CMake package and pkg-config files.
if ! cmake --install "$build" --prefix "$root" --component client >/dev/null; then
  log "cmake --install $1 --component client failed: build first (cmake --build $1)"
  exit 1
fi
client_lib=$(find "$root/lib" -maxdepth 1 -name 'libulysses_client.so.*.*' -type f | head -n 1)
if [ -z "$client_lib" ]; then
  log "the client install put no libulysses_client.so.X.Y.Z into lib/"
  exit 1
fi
mkdir -p "$root/python/ulysses"
install -m 0644 "$src/client/python/pyproject.toml" "$src/client/python/README.md" "$root/python/"
install -m 0644 "$src/client/python/ulysses/"*.py "$src/client/python/ulysses/py.typed" \
  "$root/python/ulysses/"

# Libraries the target system provides (matched on the soname).
system_lib='^(linux-vdso|linux-gate|ld-linux|libc\.so|libm\.so|libmvec\.so|libpthread\.so|libdl\.so|librt\.so|libresolv\.so|libutil\.so|libanl\.so|libnsl\.so|libBrokenLocale\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnvidia-|libcudart\.so|libcublas\.so|libcublasLt\.so|libnccl\.so|libnvrtc|libnvJitLink|libcufft|libcurand|libcusparse|libcusolver|libcupti|libnvToolsExt)'

# ldd lists the whole closure; an unresolved library is an error.
declare -A bundled=()
closure=("$client_lib")
for name_ in "${!programs[@]}"; do closure+=("$root/bin/$name_"); done
for file_ in "${closure[@]}"; do
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue
    if [ "$path" = "not" ]; then
      log "$(basename "$file_"): $soname not found"
      exit 1
    fi
    [[ "$soname" =~ $system_lib ]] && continue
    if [ -z "${bundled[$soname]:-}" ]; then
      cp -L "$path" "$root/lib/$soname"
      chmod 0644 "$root/lib/$soname"
      bundled[$soname]=$path
    fi
  done < <(ldd "$file_")
done
log "bundled ${#bundled[@]} libraries"

if command -v patchelf >/dev/null 2>&1; then
  # shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not the shell
  for name_ in "${!programs[@]}"; do
    patchelf --set-rpath '$ORIGIN/../lib' "$root/bin/$name_"
  done
  for lib in "$root"/lib/*; do
    { [ -f "$lib" ] && [ ! -L "$lib" ]; } || continue
    # shellcheck disable=SC2016
    patchelf --set-rpath '$ORIGIN' "$lib"
  done
  log "RUNPATH set with patchelf"
else
  mkdir -p "$root/libexec/ulyssesd"
  for name_ in "${!programs[@]}"; do
    mv "$root/bin/$name_" "$root/libexec/ulyssesd/$name_"
    cat >"$root/bin/$name_" <<EOF
#!/bin/sh
# Runs libexec/ulyssesd/$name_ with the bundled libraries (patchelf was not available).
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/../libexec/ulyssesd/$name_" "\$@"
EOF
    chmod 0755 "$root/bin/$name_"
  done
  log "patchelf not found: bin/ holds wrapper scripts setting LD_LIBRARY_PATH"
fi

tar -C "$stage" --owner=0 --group=0 --numeric-owner -czf "$tarball" "$name"
log "wrote $tarball"
echo "$tarball"
