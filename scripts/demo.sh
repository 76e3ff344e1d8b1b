#!/usr/bin/env bash
# The main job: W daemons (separate processes) and W clients doing a layer's head exchanges,
# verified bit for bit. On the GPUs if this build and machine have them, else the host backend.
#   scripts/demo.sh [--ranks 4] [--backend auto|host] [other ulysses-demo options]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh ulyssesd ulysses-demo ulyssesctl
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--ranks 4 --backend auto)
exec build/client/ulysses-demo "${args[@]}"
