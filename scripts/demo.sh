#!/usr/bin/env bash
# The main job: W daemons (separate processes) and W clients doing a layer's head exchanges,
# verified bit for bit. On the GPUs if this build and machine have them, else the host backend.
#   scripts/demo.sh [--ranks 4] [--backend auto|host|nvlink] [other ulysses-demo options]
# On a machine with GPUs it runs the daemons and clients as clients of one MPS server (the fast
# mode, docs/operations.md): it starts an MPS control daemon when none is running and stops the
# one it started when the demo ends.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh ulyssesd ulysses-demo ulyssesctl
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--ranks 4 --backend auto)

started_mps=0
stop_mps() {
  if [ "$started_mps" = 1 ]; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
    echo "demo: stopped the MPS control daemon it started"
  fi
}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
   command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
  if [ ! -S "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      started_mps=1
      echo "demo: started an MPS control daemon (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
    else
      echo "demo: could not start MPS; the GPU runs time-sliced (slow hand-offs)" >&2
    fi
  fi
  trap stop_mps EXIT
fi
# NVLink multicast is not used by ulyssesd; keep the libraries it loads from probing it.
export NCCL_NVLS_ENABLE=0 CUDA_MODULE_LOADING=EAGER
build/client/ulysses-demo "${args[@]}"
