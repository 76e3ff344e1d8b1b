#!/usr/bin/env bash
# Installs the dependencies, builds everything and runs every test. GPU tests (label gpu) skip
# without a device. The last line is ctest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
jobs=$(nproc 2>/dev/null || echo 2)
pytest_log=build/tests/python/pytest.log
rm -f "$pytest_log"
set +e
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 600 2>&1 | tee build/ctest.log
rc=${PIPESTATUS[0]}
# The Python tests run inside ctest (python.pytest); show pytest's own summary line too.
if [ -f "$pytest_log" ]; then
  echo "pytest (tests/python, ctest test python.pytest):"
  grep -E '^=+ .*[0-9]+ (passed|failed|error|skipped).* in [0-9.]+s' "$pytest_log" | tail -n 1
fi
# ctest lists skipped tests after its summary; repeat the summary so that it is the last line.
grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' build/ctest.log | tail -n 1
exit "$rc"
