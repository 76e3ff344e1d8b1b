#!/usr/bin/env bash
# Builds the tests with sanitizers (clang, no CUDA) and runs them; every report of the
# daemons they start is collected too. Exit status 1 on a failed test or any report.
#   scripts/sanitize.sh address|thread [TEST_EXECUTABLE...]
# address: AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer, in build-fuzz/ (the
#          fuzz build: the same instrumentation plus the fuzz targets' coverage hooks);
# thread:  ThreadSanitizer, in build-tsan/.
# Default tests: common_test ipc_test kernels_test security_test integration_test. Reports go to
# <build>/sanitizer/; suppressions, each with its reason, are in scripts/sanitizers/.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
shift || true
case "$mode" in
  address) build=${ULYSSES_FUZZ_BUILD:-build-fuzz}; flags=(-DULYSSES_FUZZ=ON) ;;
  # Full debug information: line tables name inlined frames without their scopes, and the
  # suppressions of gRPC's own races (scripts/sanitizers/tsan.supp) match scoped names.
  thread) build=${ULYSSES_TSAN_BUILD:-build-tsan}
          flags=(-DULYSSES_SANITIZE=thread -DULYSSES_DEBUG_INFO=full) ;;
  *) echo "usage: scripts/sanitize.sh address|thread [TEST_EXECUTABLE...]" >&2; exit 64 ;;
esac
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(common_test ipc_test kernels_test security_test integration_test)

cxx=${ULYSSES_FUZZ_CXX:-$(command -v clang++-14 || command -v clang++)}
cc=${ULYSSES_FUZZ_CC:-$(command -v clang-14 || command -v clang)}
if [ ! -f "$build/build.ninja" ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DULYSSES_DEBUG_INFO=lines \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_C_COMPILER="$cc" "${launcher[@]}" \
    -DULYSSES_WITH_CUDA=OFF -DULYSSES_BUILD_BENCH=OFF "${flags[@]}" >/dev/null
fi
jobs=$(nproc 2>/dev/null || echo 2)
build_args=()
for t in "${tests[@]}"; do build_args+=(--target "$t"); done
cmake --build "$build" -j"$jobs" "${build_args[@]}"

reports="$PWD/$build/sanitizer"
rm -rf "$reports"
mkdir -p "$reports"
supp="$PWD/scripts/sanitizers"
# log_path sends every process's report to a file of its own, the daemons' included.
# Only the mode's own options are set: the ThreadSanitizer runtime reads UBSAN_OPTIONS too, and
# its log_path would name every report file "ubsan".
case "$mode" in
  address)
    export ASAN_OPTIONS="log_path=$reports/asan:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1"
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="log_path=$reports/ubsan:print_stacktrace=1:halt_on_error=1" ;;
  thread)
    unset UBSAN_OPTIONS
    export TSAN_OPTIONS="log_path=$reports/tsan:suppressions=$supp/tsan.supp:halt_on_error=0:second_deadlock_stack=1" ;;
esac
regex=$(IFS='|'; echo "${tests[*]}")
set +e
# ULYSSES_SANITIZE_ATTEMPTS=N: a failed test runs again, up to N times in all (CI: 2; the
# instrumented daemons are 5-15 times slower, and a 2-core machine shared by the daemons of
# parallel tests can miss a test's own timeouts). Every test that needed a second attempt is
# named at the end; a sanitizer report fails the run whatever the attempts.
repeat=()
attempts=${ULYSSES_SANITIZE_ATTEMPTS:-1}
[ "$attempts" -gt 1 ] && repeat=(--repeat "until-pass:$attempts")
ctest --test-dir "$build" --output-on-failure -j"$jobs" --timeout 600 "${repeat[@]}" \
  -R "^($regex)\." 2>&1 | tee "$build/sanitize-$mode.log"
rc=${PIPESTATUS[0]}
set -e
# ctest prints a test that failed and then passed on a later attempt without a count.
mapfile -t retried < <(grep -oE 'Test +#[0-9]+: [^ ]+ [.]+[*]+(Failed|Timeout|Exception)' \
  "$build/sanitize-$mode.log" | sed -E 's/Test +#[0-9]+: ([^ ]+) .*/\1/' | sort -u)
if [ ${#retried[@]} -gt 0 ]; then
  echo "sanitize ($mode): failed at least once (see $build/sanitize-$mode.log):" >&2
  printf '  %s\n' "${retried[@]}" >&2
fi
found=$(find "$reports" -type f | wc -l)
if [ "$found" -gt 0 ]; then
  echo "sanitize: $found report file(s) in $reports:" >&2
  for f in "$reports"/*; do echo "== $f" >&2; head -n 60 "$f" >&2; done
  # One line per kind of report, however long the reports were.
  grep -h '^SUMMARY: ' "$reports"/* | sort | uniq -c | sed 's/^ */sanitize: /' >&2 || true
  rc=1
fi
summary=$(grep -E '^[0-9]+% tests passed' "$build/sanitize-$mode.log" | tail -n 1)
once=""
[ ${#retried[@]} -eq 0 ] || once="; failed at least once: ${retried[*]}"
echo "sanitize ($mode): ${summary:-no tests ran}; $found sanitizer report(s)$once"
exit "$rc"
