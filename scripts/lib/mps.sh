# MPS for the scripts that run daemons and clients on GPUs (sourced). The daemon and its
# clients are separate CUDA contexts: under one MPS server their streams hand off in microseconds,
# time-sliced without it (docs/operations.md).
#   mps_start PREFIX: when this machine has a GPU and MPS, starts an MPS control daemon unless
#     one is running; says so on stdout, prefixed "PREFIX: ". Returns 0 either way.
#   mps_stop PREFIX: stops the MPS control daemon that mps_start started, if any.
#   mps_running: whether an MPS control daemon answers at CUDA_MPS_PIPE_DIRECTORY (its socket
#     alone is not enough: it outlives the daemon).
mps_started=0

mps_running() {
  local pipes="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
  [ -S "$pipes/control" ] || return 1
  # A control daemon that quit leaves its socket behind, so ask it. Without the control program
  # here (a container beside an MPS container), the socket is all there is to go by.
  command -v nvidia-cuda-mps-control >/dev/null 2>&1 || return 0
  echo get_server_list | CUDA_MPS_PIPE_DIRECTORY="$pipes" timeout 10 nvidia-cuda-mps-control \
    >/dev/null 2>&1
}

mps_start() {
  local who="$1"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || return 0
  command -v nvidia-cuda-mps-control >/dev/null 2>&1 || return 0
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
  mps_running && return 0
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    mps_started=1
    echo "$who: started an MPS control daemon (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
  else
    echo "$who: could not start MPS; the GPU runs time-sliced (slow hand-offs)" >&2
  fi
}

mps_stop() {
  local who="$1"
  if [ "$mps_started" = 1 ]; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
    mps_started=0
    echo "$who: stopped the MPS control daemon it started"
  fi
}
