#!/usr/bin/env bash
# ulyssesd-node.sh: runs one ulyssesd per GPU of a node, as listed in the node config.
#
#   ulyssesd-node.sh [run]     start one daemon per devices[] entry, forward SIGTERM/SIGINT,
#                              exit when they have all exited (the container entrypoint)
#   ulyssesd-node.sh drain     drain every daemon of the node, then wait for the running
#                              calls of all of them at once (a Kubernetes preStop hook:
#                              at most ULYSSES_DRAIN_TIMEOUT_MS in all, whatever the count)
#   ulyssesd-node.sh health    exit 0 only when every daemon of the node is SERVING
#                              (a readiness probe)
#   ulyssesd-node.sh alive     exit 0 only when every daemon of the node answers, drained
#                              or not (a startup and liveness probe)
#   ulyssesd-node.sh devices   print "INDEX SOCKET" for every daemon of the node
#
# If one daemon exits on its own, the others are stopped and the script exits with that
# daemon's status (non-zero), so that the container is restarted as a whole.
#
# Environment:
#   ULYSSES_CONFIG             node config (default /etc/ulysses/ulyssesd.json)
#   ULYSSES_DEVICES            GPU indices, e.g. "0 1 2 3" (default: the config's devices[];
#                              when the config lists none: every GPU nvidia-smi lists, else 0)
#   ULYSSES_RUN_DIR            where the ready files gpuN.ready go (default /run/ulysses); the
#                              sockets are the config's devices[].socket (default
#                              /run/ulysses/gpuN.sock)
#   ULYSSES_METRICS_HOST       with ULYSSES_METRICS_PORT_BASE: daemon N serves metrics on
#   ULYSSES_METRICS_PORT_BASE  HOST:(BASE+N) (HOST defaults to 127.0.0.1); unset: the config
#   ULYSSES_DRAIN_TIMEOUT_MS   how long `drain` waits for running calls (default 30000)
#   ULYSSESD, ULYSSESCTL       the programs (default: next to this script, else on PATH)
#   ULYSSESD_ARGS              extra arguments for every daemon (word-split)
set -euo pipefail

config=${ULYSSES_CONFIG:-/etc/ulysses/ulyssesd.json}
run_dir=${ULYSSES_RUN_DIR:-/run/ulysses}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

find_program() {  # NAME ENV_VALUE
  if [ -n "$2" ]; then echo "$2"; return; fi
  if [ -x "$here/$1" ]; then echo "$here/$1"; return; fi
  command -v "$1" || { echo "ulyssesd-node: $1 not found" >&2; exit 127; }
}

log() { echo "ulyssesd-node: $*" >&2; }

# Prints the node's GPU indices, one a line: $ULYSSES_DEVICES, else the config's devices[]
# (read with jq when it is installed, else by a plain scan for "index" keys, the only key of
# that name in the format), else every GPU nvidia-smi lists, else 0.
device_indices() {
  local listed=""
  if [ -n "${ULYSSES_DEVICES:-}" ]; then
    # shellcheck disable=SC2086  # a list of indices, split on purpose
    listed=$(printf '%s\n' $ULYSSES_DEVICES)
  elif [ -r "$config" ]; then
    if command -v jq >/dev/null 2>&1; then
      listed=$(jq -r '(.devices // [])[] | .index' "$config")
    else
      listed=$(tr -d '\n' <"$config" | grep -o '"index"[[:space:]]*:[[:space:]]*[0-9]*' |
        grep -o '[0-9]*$') || true
    fi
  fi
  if [ -z "$listed" ] && command -v nvidia-smi >/dev/null 2>&1; then
    listed=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ') || true
  fi
  echo "${listed:-0}"
}

# The control socket of device INDEX: from its ready file (the daemon writes its socket
# there), else from the config (jq), else the default.
socket_of() {  # INDEX
  local sock="" ready="$run_dir/gpu$1.ready"
  if [ -r "$ready" ]; then
    sock=$(grep -o '"socket"[[:space:]]*:[[:space:]]*"[^"]*"' "$ready" | sed -E 's/.*"([^"]*)"$/\1/') || true
  fi
  if [ -z "$sock" ] && [ -r "$config" ] && command -v jq >/dev/null 2>&1; then
    sock=$(jq -r --argjson i "$1" '(.devices // [])[] | select(.index == $i) | .socket // ""' "$config")
  fi
  echo "${sock:-/run/ulysses/gpu$1.sock}"
}

devices() {
  local idx
  for idx in $(device_indices); do echo "$idx $(socket_of "$idx")"; done
}

cmd_run() {
  local ulyssesd
  ulyssesd=$(find_program ulyssesd "${ULYSSESD:-}")
  local config_args=()
  if [ -r "$config" ]; then
    "$ulyssesd" --check-config "$config" >/dev/null
    config_args=(--config "$config")
  else
    log "no config at $config: defaults and flags only"
  fi
  mkdir -p "$run_dir"

  local -a pids=()
  local -A device_of=()
  local stopping=0 status=0
  stop_all() {
    stopping=1
    local p
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  }
  trap 'log "signal: stopping ${#pids[@]} daemon(s)"; stop_all' TERM INT

  local idx
  for idx in $(device_indices); do
    # The daemon takes its socket from the config's devices[] (default /run/ulysses/gpuN.sock).
    local -a args=(--device "$idx" "${config_args[@]}" --ready-file "$run_dir/gpu$idx.ready")
    if [ -n "${ULYSSES_METRICS_PORT_BASE:-}" ]; then
      args+=(--metrics-address "${ULYSSES_METRICS_HOST:-127.0.0.1}:$((ULYSSES_METRICS_PORT_BASE + idx))")
    fi
    # shellcheck disable=SC2206
    args+=(${ULYSSESD_ARGS:-})
    "$ulyssesd" "${args[@]}" &
    pids+=("$!")
    device_of[$!]=$idx
    log "started ulyssesd for device $idx (pid $!)"
  done

  while [ "${#pids[@]}" -gt 0 ]; do
    local done_pid="" rc=0
    wait -n -p done_pid "${pids[@]}" || rc=$?
    if [ -z "${done_pid:-}" ]; then
      continue  # interrupted by a signal; the trap has forwarded it
    fi
    local -a alive=()
    local p
    for p in "${pids[@]}"; do [ "$p" = "$done_pid" ] || alive+=("$p"); done
    pids=("${alive[@]+"${alive[@]}"}")
    if [ "$stopping" -eq 0 ]; then
      log "ulyssesd for device ${device_of[$done_pid]} exited on its own (status $rc): stopping the others"
      status=$((rc == 0 ? 1 : rc))
      stop_all
    elif [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
      log "ulyssesd for device ${device_of[$done_pid]} exited with status $rc"
      status=$rc
    fi
  done
  log "all daemons stopped (status $status)"
  exit "$status"
}

cmd_drain() {
  local ulyssesctl idx sock rc=0
  ulyssesctl=$(find_program ulyssesctl "${ULYSSESCTL:-}")
  local timeout=${ULYSSES_DRAIN_TIMEOUT_MS:-30000}
  local -a waits=()
  # Drain every daemon first (new sessions are refused at once everywhere), then wait.
  while read -r idx sock; do
    "$ulyssesctl" --socket "$sock" drain >/dev/null || rc=$?
    waits+=("$sock")
  done < <(devices)
  # Wait for all at once: the whole drain takes at most one timeout, so the pod's
  # terminationGracePeriodSeconds need not grow with the number of GPUs.
  local -a waiters=()
  for sock in "${waits[@]}"; do
    "$ulyssesctl" --socket "$sock" drain --wait --wait-timeout-ms "$timeout" >/dev/null &
    waiters+=("$!")
  done
  local w
  for w in "${waiters[@]}"; do wait "$w" || rc=$?; done
  return "$rc"
}

cmd_alive() {
  local ulyssesctl idx sock rc=0
  ulyssesctl=$(find_program ulyssesctl "${ULYSSESCTL:-}")
  while read -r idx sock; do
    "$ulyssesctl" --socket "$sock" --timeout-ms 3000 status >/dev/null || rc=1
  done < <(devices)
  return "$rc"
}

cmd_health() {
  local ulyssesctl idx sock rc=0
  ulyssesctl=$(find_program ulyssesctl "${ULYSSESCTL:-}")
  while read -r idx sock; do
    "$ulyssesctl" --socket "$sock" --timeout-ms 3000 health >/dev/null || rc=1
  done < <(devices)
  return "$rc"
}

case "${1:-run}" in
  run) cmd_run ;;
  drain) cmd_drain ;;
  health) cmd_health ;;
  alive) cmd_alive ;;
  devices) devices ;;
  -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) echo "usage: ulyssesd-node.sh [run|drain|health|alive|devices]" >&2; exit 64 ;;
esac
