#!/usr/bin/env bash
# venv.sh VENV_DIR [REQUIREMENTS]: creates (once) a Python venv with REQUIREMENTS (default:
# tests/deploy/requirements.txt). Re-creates it when the requirements change. Fails when PyPI
# cannot be reached: the tests need these packages and must not pass without them.
set -euo pipefail
venv=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
req=${2:-"$here/requirements.txt"}
python=${PYTHON:-python3}
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
stamp="$venv/.requirements"
if [ -x "$venv/bin/python" ] && cmp -s "$req" "$stamp"; then
  exit 0
fi
rm -rf "$venv"
echo "venv: creating $venv with $(grep -v '^#' "$req" | xargs)" >&2
"$python" -m venv "$venv"
if ! "$venv/bin/python" -m pip install --disable-pip-version-check -q -r "$req"; then
  echo "venv: pip could not install $req (is PyPI reachable?)" >&2
  rm -rf "$venv"
  exit 1
fi
cp "$req" "$stamp"
