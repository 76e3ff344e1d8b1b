#!/usr/bin/env bash
# Which streams share a hardware queue, in the setups the daemon meets: runs ulysses-queue-probe
# (12 streams) alone with CUDA's default queue count, with 2 queues (the control: 12 streams on
# 2 queues must share, or the probe is blind), with stream 3 at the greatest priority (as the
# fused plan's second stream is, made after the rescue and two session streams), and as 4
# processes at once (clients of one MPS server share its queues), and across two processes
# (ulysses-queue-probe --across). Writes every run's JSON into one file and prints a line per
# run.
#
#   bench/queue_probe.sh PROBE OUT.json [COMMIT]   (PROBE: the ulysses-queue-probe to run;
#                                                  COMMIT: the build's, for the JSON)
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: queue_probe.sh PROBE OUT.json [COMMIT] (PROBE: the ulysses-queue-probe to run)" >&2
  exit 2
fi
probe="$1" out="$2" commit="${3:-unknown}"
if [ ! -x "$probe" ]; then
  echo "queue_probe.sh: PROBE: $probe is not an executable" >&2
  exit 2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$probe" --streams 12 --label alone --json "$tmp/1.json" > "$tmp/1.out"
if grep -q "no CUDA device" "$tmp/1.out"; then
  echo "queue_probe.sh: no CUDA device; nothing written"
  exit 0
fi
CUDA_DEVICE_MAX_CONNECTIONS=2 "$probe" --streams 12 --label two-queues --json "$tmp/2.json" > /dev/null
"$probe" --streams 12 --greatest 3 --label greatest-3 --json "$tmp/3.json" > /dev/null
pids=()
for k in 1 2 3 4; do
  "$probe" --streams 12 --hold-ms 4000 --label "concurrent-$k" --json "$tmp/c$k.json" > /dev/null &
  pids+=($!)
  sleep 0.5
done
for p in "${pids[@]}"; do wait "$p"; done
# Whether another process's waiting streams hold back this one's (queues shared across
# processes, as clients of one MPS server might).
# A failed run (a write never landed) still wrote its JSON: keep the other runs' rows.
"$probe" --streams 12 --across --label across --json "$tmp/x.json" > /dev/null || across_rc=$?
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
mps=false
[ -S "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control" ] && mps=true
python3 - "$out" "$tmp" "$gpu" "$commit" "$mps" <<'PY'
import datetime, glob, json, os, sys
out, tmp, gpu, commit, mps = sys.argv[1:6]
runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(tmp, "*.json")))]
json.dump({"bench": "queue_probe_set", "gpu": gpu, "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "mps": mps == "true", "rows": runs}, open(out, "w"), indent=1)
for r in runs:
    if r.get("mode") == "across":
        held = r["held_by_the_other_process"]
        print(f'{r["label"]:14s} {len(held)} of {r["streams"]} streams held back by another '
              f'process\'s waits: {held}')
        continue
    print(f'{r["label"]:14s} queues seen {r["queues_seen"]:2d} of {r["streams"]} streams: {r["classes"]}')
blind = [r for r in runs if r["label"] == "two-queues" and r["queues_seen"] == r["streams"]]
if blind:
    print("queue_probe.sh: with 2 queues every stream came out on its own: the probe is blind here")
print(f"wrote {out} ({len(runs)} runs)")
PY
if [ "${across_rc:-0}" -ne 0 ]; then
  echo "queue_probe.sh: the run across two processes failed (exit status $across_rc)" >&2
  exit "$across_rc"
fi
