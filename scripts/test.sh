#!/usr/bin/env bash
# Installs the dependencies, builds everything and runs every test. GPU tests (label gpu) skip
# without a device. The last lines are ctest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
jobs=$(nproc 2>/dev/null || echo 2)
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 600
