#!/usr/bin/env bash
# The GPU acceptance run of a node: the GPU test programs, the Python GPU tests, the demo on the
# GPU and the quick benchmarks, each stage's log (and JSON) written under OUT, a summary last,
# and every case's outcome in OUT/tests.json (scripts/lib/gpu_check_results.py; needs python3).
# It builds and installs nothing: it runs a CUDA build (build/ by default), or the programs
# gathered in one folder (--bin) with the shared libraries they need (--lib).
#
#   scripts/gpu-check.sh [--bin DIR] [--lib DIR] [--python PATH] [--stages LIST] [--commit C]
#                        [--stage-limit SECONDS] [--fused-shards N] OUT
#
# --stage-limit: a stage still running after SECONDS is stopped (TERM, then KILL 10 s later)
# and recorded as FAILED(124); the stages after it still run. Default 0: no limit.
# --fused-shards: the fused kernel cases run as N processes at once on the GPU, each a gtest
# shard of them (scripts/lib/gtest-shards.sh). Default 1: a process computes each shape's fp32
# reference once, and N shards compute it N times over.
# Stages, in this order (default: all):
#   nccl      the nccl backend's GPU cases, each daemon its own NCCL_HOSTID (NCCL's socket
#             transport: a test mode), without MPS
#   tests     every other GPU case of gpu_kernels_test and gpu_daemon_test, under MPS, as the
#             stages kernels (the exchange kernels' cases), kernels-fused (the fused kernel
#             cases, in shards at once), kernels-beside (the cases of work beside a stream
#             wait, alone on the GPU) and daemon, which --stages may also name alone
#   python    tests/python/test_gpu.py (torch CUDA tensors; skipped without torch)
#   demo      ulysses-demo --ranks 4 --backend auto (what scripts/demo.sh runs), under MPS
#   overhead  ulysses-gpu-bench's per-call overhead at W = 1 (64 KiB to 4 MiB), both paths,
#             and the ring path again with daemons that do not probe their hardware queues
#   handoff   bench/handoff_queues.sh
#   queues    bench/queue_probe.sh: which streams share a hardware queue (alone, 2 queues as
#             the control, a greatest-priority stream, 4 processes at once)
#   fused     ulysses-fused-bench: the fused paths with the projection on cuBLASLt and on the
#             CUTLASS GEMM (fused.projection), and the pinned cuBLASLt GEMM against its own pick
# MPS: the stages after nccl run as clients of one MPS server, started here when none runs
# (and stopped at the end); docs/operations.md says why.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

bin="" lib="" python=python3 stages="nccl,tests,python,demo,overhead,handoff,queues,fused" commit="" out=""
limit=0 fused_shards=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --lib) lib="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --stages) stages="$2"; shift 2 ;;
    --commit) commit="$2"; shift 2 ;;
    --stage-limit) limit="$2"; shift 2 ;;
    --fused-shards) fused_shards="$2"; shift 2 ;;
    -h|--help) sed -n 2,31p "$0"; exit 0 ;;
    -*) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
    *) out="$1"; shift ;;
  esac
done
if [ -z "$out" ]; then
  echo "gpu-check: give the folder to write the logs into (OUT)" >&2
  exit 2
fi
if ! [[ "$limit" =~ ^[0-9]+$ ]]; then
  echo "gpu-check: --stage-limit: '$limit' is not a number of seconds" >&2
  exit 2
fi
if ! [[ "$fused_shards" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu-check: --fused-shards: '$fused_shards' is not a positive count" >&2
  exit 2
fi
for s in ${stages//,/ }; do
  case "$s" in
    nccl|tests|kernels|kernels-fused|kernels-beside|daemon) ;;
    python|demo|overhead|handoff|queues|fused) ;;
    *) echo "gpu-check: --stages: unknown stage '$s'" >&2; exit 2 ;;
  esac
done
if [ -z "$commit" ]; then
  commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
fi

# The programs: in --bin, else where the build puts them.
program() {
  local name="$1" sub
  if [ -n "$bin" ]; then
    echo "$bin/$name"
    return
  fi
  case "$name" in
    ulyssesd) sub=daemon ;;
    gpu_*) sub=tests/gpu ;;
    ulysses-demo|libulysses_client.so.1) sub=client ;;
    *) sub=bench ;;
  esac
  echo "$root/build/$sub/$name"
}
needed=(ulyssesd gpu_kernels_test gpu_daemon_test gpu_phase_client ulysses-demo
        ulysses-gpu-bench ulysses-handoff-bench libulysses_client.so.1)
[[ ",$stages," == *",queues,"* ]] && needed+=(ulysses-queue-probe)
[[ ",$stages," == *",fused,"* ]] && needed+=(ulysses-fused-bench)
for p in "${needed[@]}"; do
  if [ ! -e "$(program "$p")" ]; then
    echo "gpu-check: $(program "$p") is missing (build with CUDA, or give --bin)" >&2
    exit 2
  fi
done
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU here (nvidia-smi lists none)" >&2
  exit 2
fi

mkdir -p "$out"
[ -n "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# ulyssesd does not use NVLink multicast: keep the libraries it loads from probing it. Modules
# load eagerly (a lazy load behind a blocked stream would wait for it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_MODULE_LOADING=EAGER
export ULYSSESD="$(program ulyssesd)" GPU_PHASE_CLIENT="$(program gpu_phase_client)"
source "$root/scripts/lib/mps.sh"
trap 'mps_stop gpu-check' EXIT

summary="$out/summary.txt"
: > "$summary"
: > "$out/stages.tsv"
failed=0
# stage NAME CMD...: runs CMD with its output in OUT/NAME.log, and records the outcome.
stage() {
  local name="$1" start rc
  shift
  echo "== $name: $*"
  start=$(date +%s)
  # Line-buffered output (stdbuf, where coreutils has it; Python's own switch): a stage
  # stopped at its limit still shows in its log the test it was in, which a full stdio buffer
  # would have lost.
  local line_buffered=()
  command -v stdbuf >/dev/null 2>&1 && line_buffered=(stdbuf -oL)
  if [ "$limit" -gt 0 ]; then
    PYTHONUNBUFFERED=1 timeout --kill-after=10 "$limit" ${line_buffered[@]+"${line_buffered[@]}"} \
      "$@" > "$out/$name.log" 2>&1
  else
    PYTHONUNBUFFERED=1 ${line_buffered[@]+"${line_buffered[@]}"} "$@" > "$out/$name.log" 2>&1
  fi
  rc=$?
  [ $rc -ne 124 ] && [ $rc -ne 137 ] || echo "gpu-check: stopped after the stage limit of ${limit} s" >> "$out/$name.log"
  local line seconds=$(( $(date +%s) - start ))
  line=$(printf '%-10s %-7s %4ds  %s' "$name" "$([ $rc -eq 0 ] && echo passed || echo "FAILED($rc)")" \
    "$seconds" "$(tail -n 1 "$out/$name.log")")
  echo "$line" | tee -a "$summary"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" \
    "${ULYSSES_TEST_EXPECT_MPS:-}" >> "$out/stages.tsv"
  [ $rc -eq 0 ] || failed=1
}
want() { [[ ",$stages," == *",$1,"* ]]; }
# What the daemons started from here should report of MPS (GpuCluster.ReportsWhetherItRunsUnderMps).
expect_mps() {
  ULYSSES_TEST_EXPECT_MPS=no-mps
  mps_running && ULYSSES_TEST_EXPECT_MPS=mps
  export ULYSSES_TEST_EXPECT_MPS
}
nccl_filter='*nccl*:NcclCluster.*:*NcclSemantics*'

{
  echo "commit $commit"
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/gpu /'
} | tee -a "$summary"

if want nccl; then
  if mps_running; then
    echo "gpu-check: an MPS server runs already; the nccl stage runs under it" | tee -a "$summary"
  fi
  expect_mps
  stage nccl "$(program gpu_daemon_test)" --gtest_filter="$nccl_filter"
fi
mps_start gpu-check
if mps_running; then echo "mps on" | tee -a "$summary"; else echo "mps off" | tee -a "$summary"; fi
expect_mps
# tests is its four stages; each may also be named alone.
tests_want() { want tests || want "$1"; }
if tests_want kernels; then
  stage kernels "$(program gpu_kernels_test)" --gtest_filter='-*Fused*:*BesideAWait*'
fi
if tests_want kernels-fused; then
  stage kernels-fused bash "$root/scripts/lib/gtest-shards.sh" --logs "$out/kernels-fused" \
    "$fused_shards" "$(program gpu_kernels_test)" --gtest_filter='*Fused*:-*BesideAWait*'
fi
if tests_want kernels-beside; then
  stage kernels-beside "$(program gpu_kernels_test)" --gtest_filter='*BesideAWait*'
fi
if tests_want daemon; then
  stage daemon "$(program gpu_daemon_test)" --gtest_filter="-$nccl_filter"
fi
if want python; then
  if "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    ULYSSES_LIBRARY="$(program libulysses_client.so.1)" PYTHONPATH="$root/client/python" \
      stage python "$python" "$root/tests/python/test_gpu.py"
  else
    echo "python     skipped (no torch with CUDA in $python)" | tee -a "$summary"
  fi
fi
if want demo; then
  stage demo "$(program ulysses-demo)" --ranks 4 --backend auto
fi
if want overhead; then
  # ring-noprobe: the ring path with daemons that do not probe their hardware queues (the
  # probe's one write per stream is work on every queue of the daemon's context).
  for path in grpc ring ring-noprobe; do
    extra=()
    [ "$path" = ring ] && extra=(--no-grpc)
    [ "$path" = ring-noprobe ] && extra=(--no-grpc --queue-probe-streams 0)
    stage "overhead-$path" "$(program ulysses-gpu-bench)" --ulyssesd "$ULYSSESD" --parts overhead \
      --overhead-world 1 --overhead-sizes 64K,256K,1M,4M --rounds 2 "${extra[@]}" \
      --commit "$commit" --json "$out/overhead-$path.json"
  done
fi
if want handoff; then
  stage handoff bash "$root/bench/handoff_queues.sh" --bench "$(program ulysses-handoff-bench)" \
    "$out/handoff-queues.json"
fi
if want queues; then
  stage queues bash "$root/bench/queue_probe.sh" "$(program ulysses-queue-probe)" \
    "$out/queue-probe.json" "$commit"
fi
if want fused; then
  # Every output is checked against the reference before it is timed.
  stage fused-projection "$(program ulysses-fused-bench)" --cutlass-projection --world 2,4 \
    --hidden 3072,8192 --s-global 2048,8192,32768 --rounds 2 --samples 5 --commit "$commit" \
    --json "$out/fused-projection.json"
  stage fused-pinning "$(program ulysses-fused-bench)" \
    --pinning-rows 1,100,300,700,1500,3000,6000,12000,16384 --pinning-max-rows 16384 \
    --hidden 3072,8192 --rounds 2 --samples 5 --commit "$commit" --json "$out/fused-pinning.json"
fi
# Every case's outcome in OUT/tests.json (where python3 is).
if command -v python3 >/dev/null 2>&1; then
  python3 "$root/scripts/lib/gpu_check_results.py" "$out" | tee -a "$summary" || failed=1
fi
echo "gpu-check: $([ $failed -eq 0 ] && echo "every stage passed" || echo "a stage FAILED"); logs in $out"
exit $failed
