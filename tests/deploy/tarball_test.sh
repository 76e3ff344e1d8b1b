#!/usr/bin/env bash
# tarball_test.sh BUILD_DIR: builds the relocatable tarball from BUILD_DIR with
# deploy/make-tarball.sh, unpacks it, moves it elsewhere, and runs it from there with an empty
# LD_LIBRARY_PATH: ulyssesd --version, ulyssesctl --help, and a 2-rank ulysses-demo (host
# backend) whose daemons are the tarball's ulyssesd. Checks that every bundled library is
# the one the programs load.
set -euo pipefail
build=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/../.." && pwd)

work=$(mktemp -d /tmp/ulysses-tarball.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL $*" >&2; exit 1; }

tarball=$("$src/deploy/make-tarball.sh" "$build" "$work/out" | tail -n 1)
[ -f "$tarball" ] || fail "make-tarball.sh wrote no tarball"
base=$(basename "$tarball" .tar.gz)
[[ "$base" =~ ^ulyssesd-[0-9]+\.[0-9]+\.[0-9]+-linux-[a-z0-9_]+$ ]] || fail "tarball name $base"
echo "tarball: $(basename "$tarball") ($(du -h "$tarball" | cut -f1))"

mkdir -p "$work/a"
tar -xzf "$tarball" -C "$work/a"
# Relocate: the tree must not depend on where it was unpacked.
mv "$work/a/$base" "$work/moved"
root="$work/moved"

for f in bin/ulyssesd bin/ulyssesctl bin/ulysses-demo bin/ulyssesd-node.sh \
         etc/ulyssesd.example.json etc/config.schema.json \
         systemd/ulyssesd@.service systemd/nvidia-mps.service \
         share/doc/ulyssesd/operations.md; do
  [ -e "$root/$f" ] || fail "$f is missing from the tarball"
done
# The client library for programs outside the tree, with headers, CMake package, pkg-config
# and the Python package's source.
for f in lib/libulysses_client.so lib/libulysses_client.so.1 include/ulysses/c_api.h \
         include/ulysses/client/client.h lib/cmake/ulysses/ulyssesConfig.cmake \
         lib/pkgconfig/ulysses.pc python/pyproject.toml python/ulysses/__init__.py; do
  [ -e "$root/$f" ] || fail "$f is missing from the tarball"
done
nlibs=$(find "$root/lib" -name '*.so*' | wc -l)
[ "$nlibs" -gt 0 ] || fail "lib/ is empty"
compgen -G "$root/lib/libgrpc++.so*" >/dev/null || fail "lib/ has no libgrpc++"
compgen -G "$root/lib/libprotobuf.so*" >/dev/null || fail "lib/ has no libprotobuf"
for sys in libc.so.6 libstdc++.so.6 libgcc_s.so.1 libm.so.6; do
  [ ! -e "$root/lib/$sys" ] || fail "lib/ bundles the system library $sys"
done
echo "contents: ok ($nlibs libraries in lib/)"

run() { env LD_LIBRARY_PATH= "$@"; }

if [ -d "$root/libexec" ]; then
  echo "layout: wrapper scripts (no patchelf when the tarball was made)"
  progs=("$root"/libexec/ulyssesd/*)
else
  progs=("$root/bin/ulyssesd" "$root/bin/ulyssesctl" "$root/bin/ulysses-demo")
  for p in "${progs[@]}"; do
    # shellcheck disable=SC2016
    readelf -d "$p" | grep -Eq 'RUNPATH.*\[\$ORIGIN/\.\./lib\]' ||
      fail "$(basename "$p") has no RUNPATH \$ORIGIN/../lib"
  done
  echo "layout: RUNPATH \$ORIGIN/../lib"
fi
# Every bundled library a program needs must resolve into lib/ (not to the system copy).
for p in "${progs[@]}"; do
  deps=$(if [ -d "$root/libexec" ]; then env LD_LIBRARY_PATH="$root/lib" ldd "$p"; else run ldd "$p"; fi)
  if grep -q 'not found' <<<"$deps"; then
    echo "$deps"
    fail "$(basename "$p"): unresolved libraries"
  fi
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue
    if [ -e "$root/lib/$soname" ] && [ "$(realpath "$path")" != "$(realpath "$root/lib/$soname")" ]; then
      fail "$(basename "$p"): $soname resolves to $path, not to the bundled copy"
    fi
  done <<<"$deps"
done
if [ ! -d "$root/libexec" ]; then
  client_deps=$(run ldd "$root/lib/libulysses_client.so.1")
  grep -q 'not found' <<<"$client_deps" && { echo "$client_deps"; fail "libulysses_client.so.1: unresolved libraries"; }
  grep -q "$root/lib/libgrpc++" <<<"$client_deps" || fail "libulysses_client.so.1 does not load the bundled gRPC"
fi
echo "libraries: every bundled library is the one loaded"

version=$(run "$root/bin/ulyssesd" --version)
[[ "$version" == "ulyssesd "* ]] || fail "ulyssesd --version printed '$version'"
[[ "$base" == "ulyssesd-${version#ulyssesd }-linux-"* ]] || fail "tarball $base is not version ${version#ulyssesd }"
echo "bin/ulyssesd --version: $version"
run "$root/bin/ulyssesctl" --help >"$work/help.txt" || fail "ulyssesctl --help exited $?"
grep -q health "$work/help.txt" || fail "ulyssesctl --help does not list health"
echo "bin/ulyssesctl --help: ok"
run "$root/bin/ulyssesd" --check-config "$root/etc/ulyssesd.example.json" >/dev/null ||
  fail "ulyssesd --check-config etc/ulyssesd.example.json"
echo "bin/ulyssesd --check-config etc/ulyssesd.example.json: ok"

# Two daemons and two clients, all from the tarball.
mkdir -p "$work/run"
if ! run timeout 120 "$root/bin/ulysses-demo" --ranks 2 --iterations 1 --backend host \
      --run-dir "$work/run" >"$work/demo.txt" 2>&1; then
  cat "$work/demo.txt"
  fail "ulysses-demo from the tarball"
fi
tail -n 1 "$work/demo.txt" | grep -q '"ok": true' || { cat "$work/demo.txt"; fail "ulysses-demo did not report ok"; }
echo "bin/ulysses-demo --ranks 2: ok"
echo "tarball_test: passed"
