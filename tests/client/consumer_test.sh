#!/usr/bin/env bash
# consumer_test.sh BUILD_DIR ULYSSESD: installs the client (cmake --install, component client)
# into a temporary prefix, moves the tree elsewhere, and builds programs outside the project
# against it: a C program with find_package(ulysses) and with pkg-config, and a C++ program
# with ulysses::client_cpp. Checks that the library exports only the API, that a C program
# needs no dependency of the library at link time, and runs every program against a daemon.
set -euo pipefail
build=$(cd "$1" && pwd)
ulyssesd=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

work=$(mktemp -d /tmp/ulysses-consumer.XXXXXX)
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL $*" >&2; exit 1; }

cmake --install "$build" --prefix "$work/prefix" --component client >/dev/null
mv "$work/prefix" "$work/moved"  # the tree must not depend on where it was installed
root="$work/moved"
libdir=$(dirname "$(find "$root" -name 'libulysses_client.so' | head -n 1)")
[ -n "$libdir" ] || fail "no libulysses_client.so installed"
for f in include/ulysses/c_api.h include/ulysses/client/client.h \
         include/ulysses/common/geometry.h include/ulysses/common/fused.h \
         include/ulysses/common/status.h; do
  [ -f "$root/$f" ] || fail "$f is not installed"
done
[ -f "$libdir/cmake/ulysses/ulyssesConfig.cmake" ] || fail "no CMake package"
[ -f "$libdir/pkgconfig/ulysses.pc" ] || fail "no ulysses.pc"
echo "installed: $(cd "$root" && find . -type f | wc -l) files"

# Only the API is exported: the C ABI (uly_*) and the C++ API in namespace ulysses.
lib="$libdir/libulysses_client.so"
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVW]$/ {print $3}' | sed 's/@.*//' | sort -u)
others=$(grep -Ev '^(uly_|ULYSSES_1(\.[0-9]+)?$)' <<<"$exported" | c++filt | grep -Ev '^ulysses::' || true)
[ -z "$others" ] || { echo "$others" | head -n 20; fail "libulysses_client.so exports more than the API"; }
nc=$(grep -c '^uly_' <<<"$exported")
ncpp=$(grep -Ev '^(uly_|ULYSSES_1(\.[0-9]+)?$)' <<<"$exported" | wc -l)
echo "exports: $nc C functions, $ncpp C++ symbols, nothing else"
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libulysses_client.so.1" ] || fail "SONAME is '$soname'"

# find_package(ulysses) from the moved tree.
cmake -S "$here/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$root" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; fail "configure"; }
cmake --build "$work/consumer" >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "build"; }
echo "find_package(ulysses): consumer_c and consumer_cpp built"

# pkg-config from the moved tree.
flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs ulysses)
cc -std=c99 -Wall -Werror "$here/consumer/main.c" $flags -o "$work/consumer_pc"
echo "pkg-config ulysses: $flags"

# A C program links the library alone: nothing of gRPC, protobuf, absl or spdlog.
needed=$(readelf -d "$work/consumer/consumer_c" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | xargs)
grep -q 'libulysses_client.so.1' <<<"$needed" || fail "consumer_c does not need libulysses_client.so.1"
if grep -Eq 'grpc|protobuf|absl|spdlog|fmt' <<<"$needed"; then fail "consumer_c needs: $needed"; fi
echo "consumer_c needs: $needed"

# Run them against a daemon.
mkdir -p "$work/run"
sock="$work/run/gpu0.sock"
"$ulyssesd" --device 0 --socket "$sock" --backend host --ready-file "$work/run/ready" \
  2>"$work/run/ulyssesd.log" &
daemon_pid=$!
for _ in $(seq 1 2000); do
  [ -e "$work/run/ready" ] && break
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/run/ulyssesd.log"; fail "ulyssesd exited"; }
  sleep 0.01
done
[ -e "$work/run/ready" ] || fail "ulyssesd not ready within 20 s"
for p in "$work/consumer/consumer_c" "$work/consumer_pc" "$work/consumer/consumer_cpp"; do
  LD_LIBRARY_PATH="$libdir" "$p" "$sock" || fail "$(basename "$p") exited $?"
done
echo "consumer_test: passed"
