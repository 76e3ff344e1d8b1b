#!/usr/bin/env bash
# gtest-shards.sh --logs PREFIX N PROGRAM [ARGS...]
# Runs N processes of a gtest PROGRAM at once, process i running shard i of N of its cases
# (GTEST_TOTAL_SHARDS, GTEST_SHARD_INDEX), its output in PREFIX.shard<i>.log. Prints a line for
# each shard as it ends and, last, one line for all of them; exits nonzero when a shard did.
# Stopped (TERM or INT), it stops its shards first, and each shard's log keeps the case it
# was in.
set -uo pipefail

usage() {
  echo "usage: gtest-shards.sh --logs PREFIX N PROGRAM [ARGS...]" >&2
  exit 2
}
if [ "${1:-}" != --logs ] || [ $# -lt 4 ]; then usage; fi
prefix="$2" n="$3"
shift 3
if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
  echo "gtest-shards: N: '$n' is not a positive count of shards" >&2
  exit 2
fi

line_buffered=()
command -v stdbuf >/dev/null 2>&1 && line_buffered=(stdbuf -oL)
pids=()
stop() {
  trap - TERM INT
  echo "gtest-shards: stopped; stopping the shards"
  [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null
  wait
  exit 143
}
trap stop TERM INT

for ((i = 0; i < n; i++)); do
  GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i ${line_buffered[@]+"${line_buffered[@]}"} "$@" \
    > "$prefix.shard$i.log" 2>&1 &
  pids+=($!)
done

failed=0
for ((i = 0; i < n; i++)); do
  # A signal interrupts the wait and runs stop.
  wait "${pids[$i]}"
  rc=$?
  result=$(grep -E '^\[  (PASSED|FAILED)  \]' "$prefix.shard$i.log" | tail -n 1)
  echo "shard $i of $n: exit $rc ${result:-(no result line)}"
  [ $rc -eq 0 ] || failed=$((failed + 1))
done
if [ $failed -eq 0 ]; then
  echo "gtest-shards: all $n shards passed"
else
  echo "gtest-shards: $failed of $n shards FAILED (logs: $prefix.shard<i>.log)"
  exit 1
fi
