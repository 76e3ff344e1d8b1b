#!/usr/bin/env bash
# Which of a waiting context's earlier work slows its stream hand-offs: runs
# ulysses-handoff-bench once per setup of the waiting (pong) process, given as a --pong-steps
# script, and writes every run's JSON into one file. docs/benchmarks.md, "what slows a
# context's hand-offs", says what was found so far; this set tells the candidate rules apart.
#
#   bench/handoff_queues.sh [--bench PATH] [--reps N] [--only NAME[,NAME...]] OUT.json
#
# Run it under MPS as the daemon runs (the hand-off bench's own parent process keeps one
# stream). Each case takes about 2 s per rep.
set -euo pipefail

bench=ulysses-handoff-bench
reps=11
only=""
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    -h|--help) sed -n 2,10p "$0"; exit 0 ;;
    -*) echo "handoff_queues.sh: unknown option $1" >&2; exit 2 ;;
    *) out="$1"; shift ;;
  esac
done
if [ -z "$out" ]; then
  echo "handoff_queues.sh: give the JSON file to write (OUT.json)" >&2
  exit 2
fi
if ! command -v "$bench" > /dev/null 2>&1 && [ ! -x "$bench" ]; then
  echo "handoff_queues.sh: --bench: $bench is not an executable" >&2
  exit 2
fi

idle() {  # idle() PREFIX N: N idle streams, made in turn
  local s="" i
  for ((i = 1; i <= $2; i++)); do s+="make:$1$i,"; done
  printf '%s' "$s"
}

# name|steps. The rounds run on stream "work". "a" is another stream that ran work; "legacy"
# is a memset on the legacy default stream; "copy" a word write and an 8-byte pageable copy.
cases=(
  "one|make:work"
  "kernel_other|make:a,kernel:a,make:work"
  "copy_other|make:a,copy:a,make:work"
  "work_made_first|make:work,make:a,kernel:a"
  # Streams may map to the context's hardware queues in turn as they are made: with 8 queues,
  # a stream made 8 after "a" would share a's queue, the one made 7 after would not.
  "kernel_other_1_between|make:a,kernel:a,$(idle i 1)make:work"
  "kernel_other_2_between|make:a,kernel:a,$(idle i 2)make:work"
  "kernel_other_3_between|make:a,kernel:a,$(idle i 3)make:work"
  "kernel_other_6_between|make:a,kernel:a,$(idle i 6)make:work"
  "kernel_other_7_between|make:a,kernel:a,$(idle i 7)make:work"
  # The same two streams made next to each other, one or two idle streams after the first:
  # tells a rule of neighbouring queues from one of queue pairs (0-1, 2-3, ...).
  "1_made_before_kernel_other|$(idle i 1)make:a,kernel:a,make:work"
  "2_made_before_kernel_other|$(idle i 2)make:a,kernel:a,make:work"
  "legacy_then_kernel_other|legacy,make:a,kernel:a,make:work"
  "kernel_other_then_legacy|make:a,kernel:a,legacy,make:work"
  "legacy_then_copy_other|legacy,make:a,copy:a,make:work"
  "legacy_between_make_and_copy|make:a,legacy,copy:a,make:work"
  # The daemon's order before its allocations were zeroed on the session's stream: the probe
  # allocation's memset, the rescue stream, a session's two allocations (memsets on the legacy
  # stream), its stream (words zeroed there), its calls, its close; then the next session the
  # same way on the same stream. daemon_no_legacy is its order now: the rescue stream, the
  # first session stream (the probe's and the session's allocations zeroed on it), the calls.
  "daemon_cancel_on_rescue|legacy,make:rescue,legacy,legacy,make:work,copy:work,kernel:work,copy:rescue,legacy,legacy,copy:work,kernel:work"
  "daemon_cancel_on_session|legacy,make:rescue,legacy,legacy,make:work,copy:work,kernel:work,copy:work,legacy,legacy,copy:work,kernel:work"
  "daemon_no_legacy|make:rescue,make:work,copy:work,kernel:work,copy:work,copy:work,kernel:work"
)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0
for c in "${cases[@]}"; do
  name="${c%%|*}"
  steps="${c#*|}"
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then continue; fi
  n=$((n + 1))
  echo "== $name: $steps"
  json="$tmp/$(printf '%02d' $n).json"
  "$bench" --sides processes --modes call memop --reps "$reps" --pong-steps "$steps" \
    --label "$name" --json "$json" > "$tmp/log"
  if [ ! -f "$json" ]; then
    cat "$tmp/log"
    if grep -q "no CUDA device" "$tmp/log"; then
      echo "handoff_queues.sh: no CUDA device; nothing written"
      exit 0
    fi
    echo "handoff_queues.sh: $name wrote no result" >&2
    exit 1
  fi
  grep -E '^(processes|sides) ' "$tmp/log" || true
done
if [ "$n" -eq 0 ]; then
  echo "handoff_queues.sh: --only: no case is named $only" >&2
  exit 2
fi
{
  printf '{"bench": "handoff_queues", "cases": [\n'
  first=1
  for f in "$tmp"/*.json; do
    [ $first -eq 1 ] || printf ',\n'
    first=0
    cat "$f"
  done
  printf ']}\n'
} > "$out"
# One line per case: its hand-off, us, in each mode.
if command -v python3 > /dev/null 2>&1; then
  python3 - "$out" <<'PY'
import json, sys
cases = json.load(open(sys.argv[1]))["cases"]
modes = ["call", "memop"]
print("%-34s %10s %10s" % ("case (hand-off, us)", *modes))
for c in cases:
    got = {r["mode"]: r.get("handoff_us") for r in c["rows"] if r.get("sides") == "processes"}
    cells = ["%10.2f" % got[m] if got.get(m) is not None else "%10s" % "-" for m in modes]
    print("%-34s %s" % (c.get("label", "?"), " ".join(cells)))
PY
fi
echo "wrote $out ($n cases)"
