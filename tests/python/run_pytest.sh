#!/usr/bin/env bash
# run_pytest.sh VENV SOURCE_DIR ULYSSESD LIBRARY LOG: installs the Python package into VENV the
# way the README says (pip install ./client/python, from a copy so that the source tree stays
# clean), then runs tests/python with pytest against real daemons. The output goes to LOG too,
# so that scripts/test.sh can show pytest's summary line.
set -euo pipefail
venv=$1 src=$2 ulyssesd=$3 lib=$4 log=$5
work=$(mktemp -d /tmp/ulysses-pytest.XXXXXX)
trap 'rm -rf "$work"' EXIT
cp -R "$src/client/python" "$work/package"
rm -rf "$work/package/build" "$work/package/"*.egg-info
"$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation \
  --force-reinstall "$work/package" >"$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
cd "$work"
set +e
ULYSSESD="$ulyssesd" ULYSSES_LIBRARY="$lib" ULYSSES_TEST_INSTALLED=1 PYTHONDONTWRITEBYTECODE=1 \
  "$venv/bin/python" -m pytest -p no:cacheprovider -rs "$src/tests/python" 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
