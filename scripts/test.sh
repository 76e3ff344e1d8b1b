#!/usr/bin/env bash
# Installs the dependencies, builds everything and runs every test. GPU tests (label gpu) skip
# without a device. The last line is ctest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
jobs=$(nproc 2>/dev/null || echo 2)
set +e
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 600 2>&1 | tee build/ctest.log
rc=${PIPESTATUS[0]}
# ctest lists skipped tests after its summary; repeat the summary so that it is the last line.
grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' build/ctest.log | tail -n 1
exit "$rc"
