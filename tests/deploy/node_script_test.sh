#!/usr/bin/env bash
# node_script_test.sh BUILD_DIR: deploy/ulyssesd-node.sh with the built programs (host
# backend): starts one daemon per devices[] entry, health, drain, SIGTERM -> every daemon
# exits and the script exits 0; a daemon that dies takes the others down with a non-zero
# status (so that the container restarts).
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
node="$here/../../deploy/ulyssesd-node.sh"

dir=$(mktemp -d /tmp/ulysses-node.XXXXXX)
script_pid=""
cleanup() {
  if [ -n "$script_pid" ] && kill -0 "$script_pid" 2>/dev/null; then
    kill -TERM "$script_pid" 2>/dev/null || true
    wait "$script_pid" 2>/dev/null || true
  fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL $*" >&2; [ -f "$dir/node.log" ] && cat "$dir/node.log" >&2; exit 1; }

cat >"$dir/node.json" <<JSON
{
  "backend": "host",
  "log_level": "warn",
  "timeouts": { "drain_ms": 5000 },
  "devices": [
    { "index": 0, "socket": "$dir/gpu0.sock" },
    { "index": 1, "socket": "$dir/gpu1.sock" }
  ]
}
JSON
export ULYSSES_CONFIG="$dir/node.json" ULYSSES_RUN_DIR="$dir"
export ULYSSESD="$build/daemon/ulyssesd" ULYSSESCTL="$build/client/ulyssesctl/ulyssesctl"
export ULYSSES_DRAIN_TIMEOUT_MS=5000

wait_ready() {
  for _ in $(seq 1 300); do
    [ -f "$dir/gpu0.ready" ] && [ -f "$dir/gpu1.ready" ] && return 0
    kill -0 "$script_pid" 2>/dev/null || fail "ulyssesd-node.sh exited before its daemons were ready"
    sleep 0.1
  done
  fail "the daemons were not ready within 30 s"
}

start() {
  rm -f "$dir/node.log"
  "$node" run >"$dir/node.log" 2>&1 &
  script_pid=$!
  wait_ready
}

# wait_exit: waits (at most 30 s) for the script; its status goes to $rc.
wait_exit() {
  for _ in $(seq 1 300); do
    kill -0 "$script_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$script_pid" 2>/dev/null && fail "ulyssesd-node.sh still runs 30 s later"
  rc=0
  wait "$script_pid" || rc=$?
  script_pid=""
}

# 1. Start, list, health, drain, SIGTERM.
start
devices=$("$node" devices)
[ "$devices" = "0 $dir/gpu0.sock
1 $dir/gpu1.sock" ] || fail "devices printed: $devices"
# Without jq: indices from a plain scan of the config, sockets from the ready files.
mkdir -p "$dir/nojq"
for t in bash dirname tr grep sed cat; do ln -sf "$(command -v "$t")" "$dir/nojq/$t"; done
devices=$(PATH="$dir/nojq" "$node" devices)
[ "$devices" = "0 $dir/gpu0.sock
1 $dir/gpu1.sock" ] || fail "devices without jq printed: $devices"
"$node" health || fail "health of a serving node"
"$node" alive || fail "alive of a serving node"
"$ULYSSESCTL" --socket "$dir/gpu1.sock" status >/dev/null || fail "ulyssesctl status on gpu1"
echo "start, devices, health: ok"
"$node" drain || fail "drain"
if "$node" health; then fail "health after drain should fail (NOT_SERVING)"; fi
"$ULYSSESCTL" --socket "$dir/gpu0.sock" status >/dev/null || fail "a drained daemon still answers status"
"$node" alive || fail "alive of a drained node (its daemons answer)"
echo "drain: ok (health NOT_SERVING, alive and status answer)"
kill -TERM "$script_pid"
wait_exit
[ "$rc" -eq 0 ] || fail "SIGTERM: ulyssesd-node.sh exited $rc, want 0"
for f in gpu0.sock gpu1.sock gpu0.ready gpu1.ready; do
  [ ! -e "$dir/$f" ] || fail "$f left behind after SIGTERM"
done
echo "SIGTERM: ok (exit 0, sockets and ready files removed)"

# 2. One daemon dies: the others are stopped, the script fails.
start
pid1=$(grep -o '"pid"[[:space:]]*:[[:space:]]*[0-9]*' "$dir/gpu1.ready" | grep -o '[0-9]*$')
[ -n "$pid1" ] || fail "no pid in gpu1.ready"
kill -KILL "$pid1"
wait_exit
[ "$rc" -ne 0 ] || fail "a daemon was killed but ulyssesd-node.sh exited 0"
[ ! -e "$dir/gpu0.sock" ] || fail "gpu0's daemon still runs after gpu1's died"
echo "a dead daemon: ok (the other stopped, exit $rc)"
if "$node" alive 2>/dev/null; then fail "alive with no daemon running"; fi

# 3. drain waits for every daemon at once: a stand-in ulyssesctl whose `drain --wait` for one
# socket returns only once the waits of both sockets have begun. Waiting in turn would never
# see the second begin: that wait gives up after 20 s and fails the drain.
mkdir -p "$dir/stub"
cat >"$dir/stub/ulyssesctl" <<STUB
#!/usr/bin/env bash
sock=""; wait_flag=0
while [ \$# -gt 0 ]; do
  case \$1 in --socket) sock=\$2; shift ;; --wait) wait_flag=1 ;; esac
  shift
done
[ "\$wait_flag" -eq 1 ] || exit 0
touch "$dir/stub/waiting.\$(basename "\$sock")"
for _ in \$(seq 1 400); do
  [ -e "$dir/stub/waiting.gpu0.sock" ] && [ -e "$dir/stub/waiting.gpu1.sock" ] && exit 0
  sleep 0.05
done
exit 1
STUB
chmod +x "$dir/stub/ulyssesctl"
ULYSSESCTL="$dir/stub/ulyssesctl" "$node" drain || fail "drain did not wait for both daemons at once"
echo "drain waits for all daemons at once: ok"
echo "node_script_test: passed"
