#!/usr/bin/env python3
"""Checks that deploy/kubernetes carries what operators of GPU nodes expect.

    k8s_properties.py --deploy DEPLOY_DIR

kubernetes-validate (deploy.kubernetes) checks that the manifests are valid; this checks
what they say:
- the image is named in one place (kustomization.yaml: registry, tag and sha256 digest);
  every container refers to it by the bare name the kustomization rewrites;
- the DaemonSet has priorityClassName system-node-critical; startup, readiness and
  liveness probes that ask every GPU's daemon (ulyssesd-node.sh alive / health), never one
  socket; a preStop drain; a termination grace that covers one drain wait (all daemons at
  once) plus the daemons' own drain timeout;
- the GPU count comes from the node: the ConfigMap lists no devices[], and the container
  sees every GPU (NVIDIA_VISIBLE_DEVICES=all);
- the MPS container can be left out (components/without-mps deletes the container the
  DaemonSet names mps);
- the example client runs as another uid than the daemon, reaches the sockets through the
  daemon's group, and its namespace enforces the privileged Pod Security level (hostIPC and
  hostPath need it).
Then it breaks a copy of the manifests, one property at a time, and checks that each is
caught. Needs PyYAML.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys

import yaml


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_tree(kube: str) -> dict[str, dict]:
    """Every YAML file under `kube`, by path relative to it."""
    docs = {}
    for root, _, names in os.walk(kube):
        for name in sorted(names):
            if name.endswith(".yaml"):
                path = os.path.join(root, name)
                docs[os.path.relpath(path, kube)] = load(path)
    return docs


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec.get("containers", [])


def pod_specs(docs: dict[str, dict]) -> list[tuple[str, dict]]:
    out = []
    for path, d in docs.items():
        if d.get("kind") == "DaemonSet":
            out.append((path, d["spec"]["template"]["spec"]))
        elif d.get("kind") == "Pod":
            out.append((path, d["spec"]))
    return out


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def check(docs: dict[str, dict]) -> list[str]:
    problems: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    # The image, in one place.
    kust = docs.get("kustomization.yaml", {})
    images = {i.get("name"): i for i in kust.get("images", [])}
    image = images.get("ulyssesd", {})
    need("/" in image.get("newName", "") and "." in image.get("newName", "").split("/")[0],
         "kustomization.yaml: images[ulyssesd].newName does not start with a registry host")
    need(bool(re.fullmatch(r"\d+\.\d+\.\d+", str(image.get("newTag", "")))),
         "kustomization.yaml: images[ulyssesd].newTag is not a version tag")
    need(bool(re.fullmatch(r"sha256:[0-9a-f]{64}", str(image.get("digest", "")))),
         "kustomization.yaml: images[ulyssesd].digest is not a sha256 digest")
    for res in kust.get("resources", []):
        need(res in docs, f"kustomization.yaml: resource {res} does not exist")
    for comp in ("components/without-mps", "components/example-client"):
        need(f"{comp}/kustomization.yaml" in docs, f"{comp}/kustomization.yaml is missing")
    for path, spec in pod_specs(docs):
        for c in containers(spec):
            need(c.get("image") == "ulyssesd",
                 f"{path}: container {c['name']} has image {c.get('image')!r}, not the bare "
                 f"name 'ulyssesd' that kustomization.yaml rewrites")
    for path, d in docs.items():
        if path != "kustomization.yaml":
            need(image.get("newName", "?") not in json.dumps(d),
                 f"{path}: names the registry itself (kustomization.yaml is the one place)")

    # The DaemonSet.
    ds_path = next((p for p, d in docs.items() if d.get("kind") == "DaemonSet"), None)
    need(ds_path is not None, "no DaemonSet")
    if ds_path is None:
        return problems
    spec = docs[ds_path]["spec"]["template"]["spec"]
    need(spec.get("priorityClassName") == "system-node-critical",
         "DaemonSet: priorityClassName is not system-node-critical")
    by_name = {c["name"]: c for c in spec.get("containers", [])}
    daemon = by_name.get("ulyssesd", {})
    want_probe = {"startupProbe": "alive", "readinessProbe": "health", "livenessProbe": "alive"}
    for probe, verb in want_probe.items():
        cmd = daemon.get(probe, {}).get("exec", {}).get("command", [])
        need(cmd == ["ulyssesd-node.sh", verb],
             f"DaemonSet: {probe} is {cmd!r}, not ulyssesd-node.sh {verb} (every GPU's daemon)")
    for c in spec.get("containers", []):
        for probe in want_probe:
            need("gpu0" not in json.dumps(c.get(probe, {})),
                 f"DaemonSet: container {c['name']} {probe} looks at one GPU only")
    need(daemon.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
         == ["ulyssesd-node.sh", "drain"], "DaemonSet: preStop is not ulyssesd-node.sh drain")
    env = env_of(daemon)
    need(env.get("NVIDIA_VISIBLE_DEVICES") == "all",
         "DaemonSet: the ulyssesd container does not see every GPU (NVIDIA_VISIBLE_DEVICES)")
    cm = next((d for d in docs.values() if d.get("kind") == "ConfigMap"), {})
    config = json.loads(cm.get("data", {}).get("ulyssesd.json", "{}"))
    need("devices" not in config,
         "ConfigMap: devices[] fixes the GPU count; leave it out (ulyssesd-node.sh asks the node)")
    drain_wait_s = int(env.get("ULYSSES_DRAIN_TIMEOUT_MS", "30000")) / 1000
    drain_s = config.get("timeouts", {}).get("drain_ms", 30000) / 1000
    grace = spec.get("terminationGracePeriodSeconds", 30)
    need(grace >= drain_wait_s + drain_s + 10,
         f"DaemonSet: terminationGracePeriodSeconds {grace} does not cover the preStop wait "
         f"({drain_wait_s:g} s, all daemons at once) + timeouts.drain_ms ({drain_s:g} s) + 10 s")

    # MPS, optional.
    need("mps" in by_name, "DaemonSet: no container named mps (what without-mps deletes)")
    comp = docs.get("components/without-mps/kustomization.yaml", {})
    need(comp.get("kind") == "Component", "components/without-mps is not a kustomize Component")
    patch_text = "".join(p.get("patch", "") for p in comp.get("patches", []))
    patch = yaml.safe_load(patch_text) if patch_text else {}
    deleted = [c.get("name") for c in
               patch.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
               if c.get("$patch") == "delete"]
    need(deleted == ["mps"], f"components/without-mps deletes {deleted!r}, not the mps container")

    # The example client: its own uid, the daemon's group, a privileged namespace.
    daemon_uid = daemon.get("securityContext", {}).get("runAsUser")
    daemon_gid = daemon.get("securityContext", {}).get("runAsGroup")
    pods = [(p, d) for p, d in docs.items() if d.get("kind") == "Pod"]
    need(bool(pods), "no example client pod")
    namespaces = {d["metadata"]["name"]: d for d in docs.values() if d.get("kind") == "Namespace"}
    for path, pod in pods:
        sc = pod["spec"].get("securityContext", {})
        uids = {sc.get("runAsUser")} | {c.get("securityContext", {}).get("runAsUser", sc.get("runAsUser"))
                                        for c in pod["spec"]["containers"]}
        need(daemon_uid not in uids and None not in uids,
             f"{path}: the client runs as the daemon's uid ({daemon_uid}) or an unset one")
        need(daemon_gid in sc.get("supplementalGroups", []),
             f"{path}: supplementalGroups lacks the daemon's group {daemon_gid} (sockets 0660)")
        ns = namespaces.get(pod["metadata"].get("namespace", ""), {})
        labels = ns.get("metadata", {}).get("labels", {})
        needs_privileged = pod["spec"].get("hostIPC") or any(
            "hostPath" in v for v in pod["spec"].get("volumes", []))
        need(not needs_privileged or labels.get("pod-security.kubernetes.io/enforce") == "privileged",
             f"{path}: its namespace does not enforce the privileged Pod Security level that "
             f"hostIPC and hostPath need")
    return problems


def breakages(docs: dict[str, dict]):
    """(what, a copy of docs with one property broken)."""
    def ds(d):
        return next(v for v in d.values() if v.get("kind") == "DaemonSet")["spec"]["template"]["spec"]

    def ulyssesd(d):
        return next(c for c in ds(d)["containers"] if c["name"] == "ulyssesd")

    def pod(d):
        return next(v for v in d.values() if v.get("kind") == "Pod")["spec"]

    def edit(fn):
        d = copy.deepcopy(docs)
        fn(d)
        return d

    yield "no priority class", edit(lambda d: ds(d).pop("priorityClassName"))
    yield "liveness on gpu0 only", edit(lambda d: ulyssesd(d)["livenessProbe"].update(
        {"exec": {"command": ["ulyssesctl", "--socket", "/run/ulysses/gpu0.sock", "status"]}}))
    yield "no startup probe", edit(lambda d: ulyssesd(d).pop("startupProbe"))
    yield "grace of 45 s", edit(lambda d: ds(d).update({"terminationGracePeriodSeconds": 45}))
    yield "a tagged image in the DaemonSet", edit(
        lambda d: ulyssesd(d).update({"image": "ulyssesd:0.1.0"}))
    yield "no digest", edit(lambda d: d["kustomization.yaml"]["images"][0].pop("digest"))
    yield "devices in the ConfigMap", edit(lambda d: next(
        v for v in d.values() if v.get("kind") == "ConfigMap")["data"].update(
        {"ulyssesd.json": json.dumps({"devices": [{"index": 0}]})}))
    yield "client as the daemon's uid", edit(lambda d: pod(d)["securityContext"].update(
        {"runAsUser": 10001}))
    yield "client namespace at baseline", edit(lambda d: next(
        v for v in d.values() if v.get("kind") == "Namespace"
        and v["metadata"]["name"] != "ulysses-system")["metadata"]["labels"].update(
        {"pod-security.kubernetes.io/enforce": "baseline"}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deploy", required=True)
    args = ap.parse_args()
    docs = load_tree(os.path.join(args.deploy, "kubernetes"))
    problems = check(docs)
    for p in problems:
        print(f"FAIL {p}")
    missed = 0
    for what, broken in breakages(docs):
        if check(broken):
            print(f"ok   a broken copy is caught: {what}")
        else:
            print(f"FAIL a broken copy is not caught: {what}")
            missed += 1
    print(f"k8s_properties: {len(docs)} files, {len(problems)} problem(s), {missed} missed breakage(s)")
    return 1 if problems or missed else 0


if __name__ == "__main__":
    sys.exit(main())
