#!/usr/bin/env bash
# validate_k8s.sh VENV_DIR MANIFEST_DIR: validates every manifest (the kustomize files aside)
# under MANIFEST_DIR with kubernetes-validate --strict (unknown fields are errors) against a
# pinned Kubernetes version, and checks that the validator does reject a broken manifest.
set -euo pipefail
venv=$1
manifests=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# A version the pinned kubernetes-validate (requirements.txt) ships schemas for.
k8s_version=1.31.0

"$here/venv.sh" "$venv"
kv=("$venv/bin/kubernetes-validate" --strict --kubernetes-version "$k8s_version")

# kustomization.yaml files are kustomize's, not the API server's: k8s_properties.py reads them.
mapfile -t files < <(find "$manifests" -name '*.yaml' ! -name kustomization.yaml | sort)
if [ "${#files[@]}" -eq 0 ]; then
  echo "validate_k8s: no manifests in $manifests" >&2
  exit 1
fi
rc=0
for f in "${files[@]}"; do
  if ! out=$("${kv[@]}" "$f" 2>&1); then
    echo "$out"
    echo "FAIL $f" >&2
    rc=1
  else
    echo "$out"
  fi
  # Everything lives in ulysses-system; the example client in its own namespace.
  case $f in */components/example-client/*) ns=ulysses-example ;; *) ns=ulysses-system ;; esac
  if ! grep -Eq "^\s*(namespace|name): $ns\s*\$" "$f"; then
    echo "FAIL $f: not in namespace $ns" >&2
    rc=1
  fi
done

# The validator must catch an unknown field and a wrong type (strict mode works).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed 's/^\(\s*\)hostIPC: true/\1hostIPC: true\n\1hostIPCC: true/' "$manifests/daemonset.yaml" >"$tmp/unknown-field.yaml"
sed 's/maxUnavailable: 1/maxUnavailable: [1]/' "$manifests/daemonset.yaml" >"$tmp/wrong-type.yaml"
for f in "$tmp"/*.yaml; do
  if "${kv[@]}" "$f" >/dev/null 2>&1; then
    echo "FAIL kubernetes-validate accepted $(basename "$f")" >&2
    rc=1
  fi
done
[ "$rc" -eq 0 ] && echo "validate_k8s: ${#files[@]} manifests valid for Kubernetes $k8s_version (strict)"
exit "$rc"
