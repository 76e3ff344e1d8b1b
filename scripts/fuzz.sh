#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang into build-fuzz/ and runs each for a bounded
# number of inputs or seconds (one target per core at a time), then prints one line per target:
# inputs, seconds, crashes.
#   scripts/fuzz.sh [--runs N] [--seconds S] [TARGET...]   (default: --seconds 60, every target)
# Crashing inputs are kept as build-fuzz/artifacts/<target>/crash-*; the exit status is 1 when
# any target crashed. ULYSSES_FUZZ_BUILD overrides the build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ULYSSES_FUZZ_BUILD:-build-fuzz}
runs="" seconds=60
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 64 ;;
    *) targets+=("$1"); shift ;;
  esac
done
all=(fd_frames_fuzz ring_descriptor_fuzz control_requests_fuzz admin_requests_fuzz
     peer_requests_fuzz config_fuzz)
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")

cxx=${ULYSSES_FUZZ_CXX:-$(command -v clang++-14 || command -v clang++)}
cc=${ULYSSES_FUZZ_CC:-$(command -v clang-14 || command -v clang)}
if [ ! -f "$build/build.ninja" ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DULYSSES_DEBUG_INFO=lines \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_C_COMPILER="$cc" "${launcher[@]}" \
    -DULYSSES_WITH_CUDA=OFF -DULYSSES_FUZZ=ON -DULYSSES_BUILD_BENCH=OFF >/dev/null
fi
jobs=$(nproc 2>/dev/null || echo 2)
build_args=()
for t in "${targets[@]}"; do build_args+=(--target "$t"); done
cmake --build "$build" -j"$jobs" "${build_args[@]}"

limit=(-max_total_time="$seconds")
[ -z "$runs" ] || limit=(-runs="$runs")
# One target per core at a time (libFuzzer runs one process per target); each writes its own
# log, and the summary comes in the targets' order once all have ended.
run_target() {
  local t=$1 corpus="$build/corpus/$1" artifacts="$build/artifacts/$1" log="$build/fuzz-$1.log"
  mkdir -p "$corpus" "$artifacts"
  local seeds=()
  [ -d "fuzz/seeds/$t" ] && seeds=("fuzz/seeds/$t")
  rm -f "$log.rc"
  touch "$log.start"  # the crashes of this run are the artifacts newer than it
  local rc=0
  "$build/fuzz/$t" "${limit[@]}" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" "$corpus" "${seeds[@]}" >"$log" 2>&1 ||
    rc=$?
  echo "$rc" >"$log.rc"
}
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_target "$t" &
  running=$((running + 1))
done
wait
failed=0
summary=()
for t in "${targets[@]}"; do
  artifacts="$build/artifacts/$t" log="$build/fuzz-$t.log"
  rc=$(cat "$log.rc" 2>/dev/null || echo "?")
  inputs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -n 1)
  crashes=$(find "$artifacts" -type f -newer "$log.start" | wc -l)
  if [ "$rc" != 0 ]; then
    failed=1
    echo "fuzz: $t failed (exit $rc); the end of $log:" >&2
    tail -n 40 "$log" >&2
  fi
  summary+=("fuzz: $t: ${inputs:-?} inputs in ${secs:-?} s, exit $rc, $crashes crashing input(s) kept in $artifacts")
done
printf '%s\n' "${summary[@]}"
exit "$failed"
