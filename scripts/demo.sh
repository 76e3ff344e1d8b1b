#!/usr/bin/env bash
# The main job: W daemons (separate processes) and W clients doing a layer's head exchanges,
# verified bit for bit. On the GPUs if this build and machine have them, else the host backend.
#   scripts/demo.sh [--ranks 4] [--backend auto|host|nvlink|nccl] [other ulysses-demo options]
# (nccl needs a GPU per rank: NCCL refuses two ranks on one GPU.)
# On a machine with GPUs it runs the daemons and clients as clients of one MPS server (the fast
# mode, docs/operations.md): it starts an MPS control daemon when none is running and stops the
# one it started when the demo ends.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh ulyssesd ulysses-demo ulyssesctl
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--ranks 4 --backend auto)

source scripts/lib/mps.sh
mps_start demo
trap 'mps_stop demo' EXIT
# NVLink multicast is not used by ulyssesd; keep the libraries it loads from probing it.
export NCCL_NVLS_ENABLE=0 CUDA_MODULE_LOADING=EAGER
build/client/ulysses-demo "${args[@]}"
