#!/usr/bin/env bash
# gpu_check_test.sh: scripts/gpu-check.sh's plumbing without a GPU. Stand-in programs (each
# prints its arguments and the environment the stages need) and a stand-in nvidia-smi: every
# stage runs its program with the right arguments and environment and gets its log and its
# summary line; the fused kernel cases run as --fused-shards gtest shards at once; the daemon
# tests are told what MPS to expect, and an MPS control socket left by a daemon that quit is
# not taken for MPS; a failing stage or shard, or a stage stopped at --stage-limit, makes the
# run exit non-zero and says FAILED, and the stages after it still run; every case's outcome
# lands in tests.json; bad arguments and a missing program are refused before anything runs.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check="$here/../../scripts/gpu-check.sh"
dir=$(mktemp -d /tmp/ulysses-gpu-check.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir -p "$dir/bin" "$dir/path"
for p in ulyssesd gpu_kernels_test gpu_daemon_test gpu_phase_client ulysses-demo \
         ulysses-gpu-bench ulysses-fused-bench libulysses_client.so.1; do
  cat > "$dir/bin/$p" <<STUB
#!/usr/bin/env bash
echo "$p \$* ULYSSESD=\$ULYSSESD EAGER=\$CUDA_MODULE_LOADING NVLS=\$NCCL_NVLS_ENABLE" \
  "MPS=\${ULYSSES_TEST_EXPECT_MPS:-} SHARD=\${GTEST_SHARD_INDEX:-}/\${GTEST_TOTAL_SHARDS:-}"
case="Stub.$p\${GTEST_SHARD_INDEX:+_shard\$GTEST_SHARD_INDEX}"
echo "[ RUN      ] \$case"
[ "$p" != gpu_kernels_test ] || [ -z "\${KERNELS_HANG:-}" ] || exec sleep 600
if [ "$p" = gpu_kernels_test ] && [ "\${FUSED_SHARD_FAILS:-x}" = "\${GTEST_SHARD_INDEX:-}" ]; then
  echo "[  FAILED  ] \$case (3 ms)"
  exit 4
fi
echo "[       OK ] \$case (2 ms)"
echo "[  PASSED  ] 1 test."
[ "$p" != ulysses-demo ] || [ -z "\${DEMO_FAILS:-}" ] || exit 3
[ "$p" != ulysses-demo ] || [ -z "\${DEMO_HANGS:-}" ] || exec sleep 600
[ "$p" != ulysses-demo ] || echo '{"ok": true, "backend": "nvlink", "checks": 7, "mps": "no-mps"}'
STUB
done
# The hand-off bench as handoff_queues.sh calls it: a JSON file per case.
cat > "$dir/bin/ulysses-handoff-bench" <<'STUB'
#!/usr/bin/env bash
while [ $# -gt 0 ]; do case "$1" in --json) j="$2"; shift 2 ;; *) shift ;; esac; done
echo "processes  call  6.0  3.0"
echo '{"rows": []}' > "$j"
STUB
# The queue probe as queue_probe.sh calls it: a JSON file per run.
cat > "$dir/bin/ulysses-queue-probe" <<'STUB'
#!/usr/bin/env bash
across=0
while [ $# -gt 0 ]; do case "$1" in --json) j="$2"; shift 2 ;; --label) l="$2"; shift 2 ;; --across) across=1; shift ;; *) shift ;; esac; done
if [ $across = 1 ]; then
  echo "{\"mode\": \"across\", \"label\": \"$l\", \"streams\": 12, \"held_by_the_other_process\": [3]}" | tee "$j"
else
  echo "{\"label\": \"$l\", \"streams\": 12, \"queues_seen\": 2, \"classes\": [[0]]}" | tee "$j"
fi
STUB
cat > "$dir/path/nvidia-smi" <<'STUB'
#!/usr/bin/env bash
if [ "${1:-}" = -L ]; then echo "GPU 0: stand-in"; else echo "stand-in GPU, 1.0"; fi
STUB
chmod +x "$dir"/bin/* "$dir/path/nvidia-smi"
# No MPS control program on this PATH: the stages run without MPS, and say so.
run() { PATH="$dir/path:/usr/bin:/bin" bash "$check" --bin "$dir/bin" --python /bin/false "$@"; }

run --commit c0ffee "$dir/out" > "$dir/stdout" || fail "a run of passing stages exited $?"
summary="$dir/out/summary.txt"
grep -q "^commit c0ffee$" "$summary" || fail "no commit line"
grep -q "^gpu stand-in GPU, 1.0$" "$summary" || fail "no gpu line"
grep -q "^mps off$" "$summary" || fail "no mps line"
for s in nccl kernels kernels-fused kernels-beside daemon demo overhead-grpc overhead-ring overhead-ring-noprobe handoff queues \
         fused-projection fused-pinning; do
  grep -Eq "^$s +passed" "$summary" || fail "stage $s has no passed line"
  [ -s "$dir/out/$s.log" ] || fail "stage $s wrote no log"
done
grep -Eq "^python +skipped" "$summary" || fail "the python stage was not skipped without torch"
grep -q -- "--gtest_filter=\*nccl\*:NcclCluster" "$dir/out/nccl.log" || fail "nccl filter"
grep -q -- "--gtest_filter=-\*nccl\*" "$dir/out/daemon.log" || fail "daemon filter"
grep -q "ULYSSESD=$dir/bin/ulyssesd EAGER=EAGER NVLS=0" "$dir/out/daemon.log" || fail "environment"
grep -q "MPS=no-mps SHARD=/$" "$dir/out/daemon.log" || fail "the MPS the daemon tests expect"
grep -q -- "--gtest_filter=-\*Fused\*:\*BesideAWait\* .*SHARD=/$" "$dir/out/kernels.log" ||
  fail "the exchange kernels' filter"
grep -q -- "--gtest_filter=\*BesideAWait\* .*SHARD=/$" "$dir/out/kernels-beside.log" ||
  fail "the beside-a-wait filter"
grep -q -- "--gtest_filter=\*Fused\*:-\*BesideAWait\* .*SHARD=0/1$" \
  "$dir/out/kernels-fused.shard0.log" || fail "the fused cases in the default one shard"
grep -q "all 1 shards passed" "$dir/out/kernels-fused.log" || fail "the fused shards' last line"
grep -q -- "--no-grpc --commit c0ffee --json $dir/out/overhead-ring.json" \
  "$dir/out/overhead-ring.log" || fail "the ring overhead arguments"
grep -q -- "--no-grpc" "$dir/out/overhead-grpc.log" && fail "the grpc overhead run has --no-grpc"
grep -q -- "--no-grpc --queue-probe-streams 0 --commit c0ffee" "$dir/out/overhead-ring-noprobe.log" \
  || fail "the ring overhead arguments without the queue probe"
grep -q -- "--cutlass-projection .*--commit c0ffee --json $dir/out/fused-projection.json" \
  "$dir/out/fused-projection.log" || fail "the fused projection arguments"
grep -q -- "--pinning-rows .*--pinning-max-rows 16384 .*--json $dir/out/fused-pinning.json" \
  "$dir/out/fused-pinning.log" || fail "the fused pinning arguments"
python3 -c "import json,sys; assert len(json.load(open(sys.argv[1]))['cases']) == 18" \
  "$dir/out/handoff-queues.json" || fail "the hand-off set's JSON"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert len(d['rows']) == 8; assert d['commit'] == 'c0ffee'" \
  "$dir/out/queue-probe.json" || fail "the queue probe set's JSON"
grep -q "across .*1 of 12 streams held back by another process's waits: \[3\]" "$dir/out/queues.log" \
  || fail "the queue probe set's line for the run across two processes"
# Every case in tests.json: gtest's cases from the test stages' logs (the fused cases from
# their shard's), the demo's report, a row for each other stage; and the tally in the summary.
python3 - "$dir/out/tests.json" <<'PY' || fail "tests.json of a passing run"
import json, sys
d = json.load(open(sys.argv[1]))
assert (d["gpu"], d["driver"], d["commit"], d["mps"]) == ("stand-in GPU", "1.0", "c0ffee", False), d
rows = {(r["stage"], r["name"]): r for r in d["rows"]}
want = {("nccl", "Stub.gpu_daemon_test"), ("kernels", "Stub.gpu_kernels_test"),
        ("kernels-fused", "Stub.gpu_kernels_test_shard0"),
        ("kernels-beside", "Stub.gpu_kernels_test"), ("daemon", "Stub.gpu_daemon_test"),
        ("demo", "demo"), ("handoff", "handoff"), ("fused-pinning", "fused-pinning")}
assert want <= set(rows), sorted(rows)
assert all(r["result"] == "passed" and r["mode"] == "no-mps" for r in d["rows"]), d["rows"]
assert rows[("daemon", "Stub.gpu_daemon_test")]["time_ms"] == 2
assert rows[("daemon", "Stub.gpu_daemon_test")]["program"] == "gpu_daemon_test"
demo = rows[("demo", "demo")]
assert (demo["backend"], demo["checks"], demo["mps_reported"]) == ("nvlink", 7, "no-mps"), demo
PY
grep -Eq "^gpu-check: [0-9]+ cases: [0-9]+ passed, 0 failed, 0 skipped, 0 stopped" "$summary" ||
  fail "no tally line in the summary"

# A failing stage: non-zero exit, FAILED in the summary, later stages still run.
if DEMO_FAILS=1 run --stages demo,overhead "$dir/out2" > "$dir/stdout2"; then
  fail "a failing demo stage exited 0"
fi
grep -Eq "^demo +FAILED\(3\)" "$dir/out2/summary.txt" || fail "no FAILED line for the demo"
grep -Eq "^overhead-ring +passed" "$dir/out2/summary.txt" || fail "the stage after a failure"
grep -q "a stage FAILED" "$dir/stdout2" || fail "the last line does not say a stage failed"
[ ! -e "$dir/out2/nccl.log" ] || fail "--stages ran a stage it did not name"

# A failing fused shard fails its stage, and the stage's line names it; --fused-shards counts.
if FUSED_SHARD_FAILS=1 run --stages tests --fused-shards 2 "$dir/out9" > /dev/null; then
  fail "a failing fused shard exited 0"
fi
grep -Eq "^kernels-fused +FAILED\(1\) .*1 of 2 shards FAILED" "$dir/out9/summary.txt" ||
  fail "no FAILED line naming the failed shard"
[ -e "$dir/out9/kernels-fused.shard1.log" ] && [ ! -e "$dir/out9/kernels-fused.shard2.log" ] ||
  fail "--fused-shards 2 did not run 2 shards"
grep -Eq "^daemon +passed" "$dir/out9/summary.txt" || fail "the stage after a failed shard"
python3 - "$dir/out9/tests.json" <<'PY' || fail "tests.json of a failed shard"
import json, sys
rows = {r["name"]: r["result"] for r in json.load(open(sys.argv[1]))["rows"]
        if r["stage"] == "kernels-fused"}
assert rows == {"Stub.gpu_kernels_test_shard0": "passed",
                "Stub.gpu_kernels_test_shard1": "failed"}, rows
PY
grep -q "cases: [0-9]* passed, 1 failed" "$dir/out9/summary.txt" ||
  fail "the tally of a failed shard"

# One stage of tests named alone runs alone.
run --stages kernels-fused --fused-shards 3 "$dir/out10" > /dev/null || fail "kernels-fused alone"
for i in 0 1 2; do
  grep -q -- "--gtest_filter=\*Fused\*:-\*BesideAWait\* .*SHARD=$i/3$" \
    "$dir/out10/kernels-fused.shard$i.log" || fail "fused shard $i of 3"
done
grep -q "all 3 shards passed" "$dir/out10/kernels-fused.log" || fail "the 3 shards' last line"
for s in kernels kernels-beside daemon nccl demo; do
  [ ! -e "$dir/out10/$s.log" ] || fail "--stages kernels-fused also ran $s"
done

# A stage past --stage-limit is stopped and recorded as failed; the next stage runs.
if DEMO_HANGS=1 run --stages demo,overhead --stage-limit 2 "$dir/out5" > "$dir/stdout5"; then
  fail "a stage past the limit exited 0"
fi
grep -Eq "^demo +FAILED\(124\)" "$dir/out5/summary.txt" || fail "no FAILED(124) line for the demo"
grep -Eq "^overhead-ring +passed" "$dir/out5/summary.txt" || fail "the stage after a timeout"
# A test stage stopped in a case: the case is recorded as stopped.
if KERNELS_HANG=1 run --stages kernels --stage-limit 2 "$dir/out13" > /dev/null; then
  fail "a test stage past the limit exited 0"
fi
python3 - "$dir/out13/tests.json" <<'PY' || fail "the case a stopped stage was in"
import json, sys
rows = [(r["name"], r["result"]) for r in json.load(open(sys.argv[1]))["rows"]]
assert rows == [("Stub.gpu_kernels_test", "stopped")], rows
PY

# MPS: a control daemon that quit leaves its socket behind (the stand-in does as the real one).
# A stale socket is no MPS: the run starts its own and stops it at the end. A live one is used
# by every stage, the nccl stage included, and left running.
mkdir -p "$dir/mpsbin" "$dir/pipes" "$dir/mpslog"
cat > "$dir/mpsbin/nvidia-cuda-mps-control" <<'STUB'
#!/usr/bin/env bash
pipes=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
if [ "${1:-}" = -d ]; then
  [ -S "$pipes/control" ] ||
    python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$pipes/control"
  touch "$pipes/live"
  echo start >> "$pipes/calls"
  exit 0
fi
read -r cmd
[ -e "$pipes/live" ] || { echo "Cannot find MPS control daemon process"; exit 1; }
[ "$cmd" != quit ] || { rm -f "$pipes/live"; echo quit >> "$pipes/calls"; }
exit 0
STUB
chmod +x "$dir/mpsbin/nvidia-cuda-mps-control"
run_mps() {
  CUDA_MPS_PIPE_DIRECTORY="$dir/pipes" CUDA_MPS_LOG_DIRECTORY="$dir/mpslog" \
    PATH="$dir/mpsbin:$dir/path:/usr/bin:/bin" bash "$check" --bin "$dir/bin" "$@"
}
python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$dir/pipes/control"
run_mps --stages nccl,daemon "$dir/out11" > "$dir/stdout11" || fail "a run beside a stale MPS socket"
grep -q "started an MPS control daemon" "$dir/stdout11" || fail "a stale MPS socket taken for MPS"
grep -q "runs already" "$dir/out11/summary.txt" && fail "a stale MPS socket said to run"
grep -q "^mps on$" "$dir/out11/summary.txt" || fail "no mps on line after starting MPS"
grep -q "MPS=no-mps" "$dir/out11/nccl.log" || fail "the nccl stage told to expect MPS"
grep -q "MPS=mps" "$dir/out11/daemon.log" || fail "the daemon tests not told to expect MPS"
python3 - "$dir/out11/tests.json" <<'PY' || fail "the modes in tests.json"
import json, sys
d = json.load(open(sys.argv[1]))
modes = {r["stage"]: r["mode"] for r in d["rows"]}
assert d["mps"] and modes == {"nccl": "no-mps", "daemon": "mps"}, modes
PY
[ "$(cat "$dir/pipes/calls")" = "$(printf 'start\nquit')" ] && [ ! -e "$dir/pipes/live" ] ||
  fail "the MPS the run started was not stopped: $(cat "$dir/pipes/calls")"
CUDA_MPS_PIPE_DIRECTORY="$dir/pipes" "$dir/mpsbin/nvidia-cuda-mps-control" -d
run_mps --stages nccl,daemon "$dir/out12" > "$dir/stdout12" || fail "a run beside a live MPS"
grep -q "an MPS server runs already; the nccl stage runs under it" "$dir/out12/summary.txt" ||
  fail "a live MPS not found"
grep -q "MPS=mps" "$dir/out12/nccl.log" || fail "the nccl stage not told of the live MPS"
grep -q "started an MPS" "$dir/stdout12" && fail "a second MPS started beside a live one"
[ -e "$dir/pipes/live" ] && [ "$(grep -c quit "$dir/pipes/calls")" = 1 ] ||
  fail "an MPS the run did not start was stopped"

# Refused before anything runs.
if run --stage-limit soon "$dir/out6" 2> "$dir/err6"; then fail "a bad --stage-limit ran"; fi
grep -q "stage-limit: 'soon'" "$dir/err6" || fail "the bad limit is not named"
if run --fused-shards 0 "$dir/out6" 2> "$dir/err6"; then fail "--fused-shards 0 ran"; fi
grep -q "fused-shards: '0'" "$dir/err6" || fail "the bad shard count is not named"
if run --stages demo,bogus "$dir/out3" 2> "$dir/err3"; then fail "an unknown stage ran"; fi
grep -q "unknown stage 'bogus'" "$dir/err3" || fail "the unknown stage is not named"
mv "$dir/bin/ulysses-fused-bench" "$dir/fused-bench"
if run --stages fused "$dir/out7" 2> "$dir/err7"; then fail "a fused stage without its bench"; fi
grep -q "ulysses-fused-bench is missing" "$dir/err7" || fail "the missing fused bench is not named"
run --stages demo "$dir/out8" > /dev/null || fail "a demo stage needs the fused bench"
mv "$dir/fused-bench" "$dir/bin/ulysses-fused-bench"
rm "$dir/bin/gpu_phase_client"
if run "$dir/out4" 2> "$dir/err4"; then fail "a run without gpu_phase_client"; fi
grep -q "gpu_phase_client is missing" "$dir/err4" || fail "the missing program is not named"
[ ! -e "$dir/out3" ] && [ ! -e "$dir/out4" ] && [ ! -e "$dir/out6" ] && [ ! -e "$dir/out7" ] ||
  fail "a refused run wrote its folder"
echo "gpu-check plumbing: ok"
