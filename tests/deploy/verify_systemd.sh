#!/usr/bin/env bash
# verify_systemd.sh UNIT_DIR: `systemd-analyze verify` of the units in UNIT_DIR, strict: any
# message (unknown directive, bad value, missing dependency) fails the test.
#
# The units run programs that are not installed here (/opt/ulyssesd/bin/ulyssesd,
# nvidia-cuda-mps-control). They are verified inside a scratch root (--root) holding the
# distribution's own units and a stub executable at every path the units execute, so that
# verify checks syntax and directives without complaining about the missing programs. Also
# checks that verify does fail on a unit with an unknown directive.
set -euo pipefail
units=$1
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "verify_systemd: systemd-analyze is missing (scripts/install-deps.sh installs systemd)" >&2
  exit 1
fi
if ! systemd-analyze --help | grep -q -- '--root='; then
  echo "verify_systemd: this systemd-analyze has no --root" >&2
  exit 1
fi
sysunits=""
for d in /usr/lib/systemd/system /lib/systemd/system; do
  [ -e "$d/sysinit.target" ] && { sysunits=$d; break; }
done
if [ -z "$sysunits" ]; then
  echo "verify_systemd: no system units (sysinit.target) found" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# make_root DIR UNITS...: a scratch root with the system units, the given units and stubs.
make_root() {
  local root=$1; shift
  mkdir -p "$root/usr/lib/systemd" "$root/etc/systemd/system"
  cp -r "$sysunits" "$root/usr/lib/systemd/system"
  cp "$@" "$root/etc/systemd/system/"
  local exe
  # The first word of every Exec*= line, less systemd's prefixes (-, @, :, +, !).
  while read -r exe; do
    case $exe in /*) ;; *) continue ;; esac
    mkdir -p "$root$(dirname "$exe")"
    [ -e "$root$exe" ] || { printf '#!/bin/sh\nexit 0\n' >"$root$exe"; chmod +x "$root$exe"; }
  done < <(sed -n 's/^Exec[A-Za-z]*=[-@:+!]*\([^ ]*\).*/\1/p' "$@" | sort -u)
}

# verify ROOT UNIT_NAMES...: prints what verify says; fails on any message or status.
verify() {
  local root=$1; shift
  local names=() n out
  for n in "$@"; do names+=("/etc/systemd/system/$n"); done
  if ! out=$(SYSTEMD_LOG_COLOR=0 systemd-analyze verify --man=no --generators=no \
                --root="$root" "${names[@]}" 2>&1); then
    echo "$out"
    return 1
  fi
  if [ -n "$out" ]; then
    echo "$out"
    return 1
  fi
}

# Template units are verified through an instance (ulyssesd@.service as ulyssesd@0.service).
instances() {
  local f b
  for f in "$@"; do
    b=$(basename "$f")
    case $b in *@.service) echo "${b%@.service}@0.service" ;; *) echo "$b" ;; esac
  done
}

shopt -s nullglob
files=("$units"/*.service)
if [ "${#files[@]}" -eq 0 ]; then
  echo "verify_systemd: no units in $units" >&2
  exit 1
fi
make_root "$tmp/good" "${files[@]}"
mapfile -t names < <(instances "${files[@]}")
if ! verify "$tmp/good" "${names[@]}"; then
  echo "FAIL systemd-analyze verify ${names[*]}" >&2
  exit 1
fi
echo "verify_systemd: ${names[*]}: clean"

# The check must catch an unknown directive and a bad value (one broken unit at a time, the
# other one intact).
check_broken() {  # NAME UNIT_FILE SED_EXPRESSION
  local dir="$tmp/bad-$1"
  mkdir -p "$dir/units"
  cp "${files[@]}" "$dir/units/"
  sed "$3" "$units/$2" >"$dir/units/$2"
  if cmp -s "$units/$2" "$dir/units/$2"; then
    echo "FAIL the $1 case did not change $2" >&2
    exit 1
  fi
  make_root "$dir/root" "$dir/units"/*.service
  if verify "$dir/root" "$(instances "$dir/units/$2")" >/dev/null; then
    echo "FAIL verify accepted $2 with $1" >&2
    exit 1
  fi
}
check_broken unknown-directive ulyssesd@.service 's/^Restart=on-failure/&\nRestartt=always/'
check_broken bad-value nvidia-mps.service 's/^Type=forking/Type=forkin/'
check_broken bad-section ulyssesd@.service 's/^\[Install\]/[Instal]/'
echo "verify_systemd: broken units are caught"

# ulyssesd@.service fails loudly without its config (Assert, not Condition: a Condition
# skips the unit and reports success).
unit="$units/ulyssesd@.service"
grep -q '^AssertPathExists=/etc/ulysses/ulyssesd.json$' "$unit" ||
  { echo "FAIL ulyssesd@.service does not assert its config exists" >&2; exit 1; }
if grep -q '^Condition' "$unit"; then
  echo "FAIL ulyssesd@.service has a Condition*= (a missing file would skip it silently)" >&2
  exit 1
fi

# Its sandbox: systemd-analyze security rates the exposure below 4.0 (threshold 39 of 100),
# and the same unit without the sandbox lines is rated above it (the check can fail).
security() {  # ROOT: exit status of the threshold check
  SYSTEMD_LOG_COLOR=0 systemd-analyze security --offline=yes --root="$1" --threshold=39 \
    ulyssesd@0.service >"$tmp/security.txt" 2>&1
}
if ! security "$tmp/good"; then
  cat "$tmp/security.txt"
  echo "FAIL ulyssesd@.service: exposure at or above 4.0" >&2
  exit 1
fi
grep -o 'Overall exposure level.*' "$tmp/security.txt" | sed 's/^/verify_systemd: /'
mkdir -p "$tmp/unsandboxed/units"
cp "${files[@]}" "$tmp/unsandboxed/units/"
sed -n '/^# Sandbox/,/^KeyringMode=/!p' "$unit" >"$tmp/unsandboxed/units/ulyssesd@.service"
make_root "$tmp/unsandboxed/root" "$tmp/unsandboxed/units"/*.service
if security "$tmp/unsandboxed/root"; then
  echo "FAIL the security check passed ulyssesd@.service without its sandbox" >&2
  exit 1
fi
echo "verify_systemd: ulyssesd@.service asserts its config; sandboxed below 4.0"
