#!/usr/bin/env python3
"""Checks deploy/config.schema.json and `ulyssesd --check-config` against each other.

    check_config.py --ulyssesd BIN --deploy DEPLOY_DIR

- The schema is a valid draft 2020-12 schema with additionalProperties false on every object.
- Good configs (deploy/ulyssesd.example.json, the ConfigMap's ulyssesd.json, a config with
  every key, {}) pass the schema and `ulyssesd --check-config` (exit 0).
- Bad configs (unknown keys at every level, wrong types, out-of-range values, backends this
  build does not run, addresses that cannot be bound as written) fail both: the schema
  rejects them, and ulyssesd exits 1 naming the key on stderr. Every example gets the same
  verdict from the schema and from ulyssesd.
- Flags go through the same validation: a bad value exits 64 (bad usage) naming the flag, a
  good one passes, with the same rule as the key it overrides.
Needs jsonschema and PyYAML (tests/deploy/requirements.txt).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jsonschema
import yaml

FULL = {
    "log_level": "debug",
    "backend": "host",
    "timeouts": {"call_ms": 20000, "peer_ms": 40000, "drain_ms": 0, "bind_ms": 5000},
    "slots": {"memory_budget_bytes": 1 << 30, "uid_share_percent": 50},
    "metrics": {"address": "127.0.0.1:9500"},
    "ready_file": "/run/ulysses/gpu0.ready",
    "flight_recorder_size": 64,
    "rings": {"worker_spin_us": 500},
    "admin": {"operator_group": "0"},
    "queues": {"probe_streams": 8, "sharing": "refuse"},
    "fused": {"projection": "cutlass"},
    "limits": {"max_clients": 64, "clients_per_uid": 8, "buffers_per_client": 128,
               "buffers_per_uid": 512, "max_buffers": 1024, "max_pending_fds": 128,
               "groups_per_client": 4, "sessions_per_client": 8, "sessions_per_uid": 16,
               "max_sessions": 32, "pending_fds_per_uid": 64, "connections_per_uid": 32,
               "max_connections": 128,
               "buffer_bytes_per_client": 1 << 30, "buffer_bytes_per_uid": 1 << 31,
               "pending_fds_per_client": 16, "calls_in_progress_per_client": 16,
               "calls_in_progress_per_uid": 32, "admin_calls_in_progress": 8},
    "devices": [{"index": 0, "socket": "/run/ulysses/gpu0.sock"}, {"index": 1}],
}

# (name, config, the key ulyssesd must name on stderr)
BAD = [
    ("unknown top-level key", {"log_level": "info", "bogus": 1}, "bogus"),
    ("unknown key in timeouts", {"timeouts": {"call_ms": 10, "drain": 5}}, "timeouts.drain"),
    ("unknown key in slots", {"slots": {"budget": 5}}, "slots.budget"),
    ("unknown key in metrics", {"metrics": {"addr": "127.0.0.1:1"}}, "metrics.addr"),
    ("unknown key in devices[]", {"devices": [{"index": 0, "sockett": "/x"}]}, "devices[0].sockett"),
    ("device without index", {"devices": [{"socket": "/x"}]}, "devices[0].index"),
    ("unknown backend", {"backend": "gpu"}, "backend"),
    ("unknown log level", {"log_level": "loud"}, "log_level"),
    ("string timeout", {"timeouts": {"call_ms": "10"}}, "timeouts.call_ms"),
    ("zero call timeout", {"timeouts": {"call_ms": 0}}, "timeouts.call_ms"),
    ("negative drain timeout", {"timeouts": {"drain_ms": -1}}, "timeouts.drain_ms"),
    ("negative budget", {"slots": {"memory_budget_bytes": -1}}, "slots.memory_budget_bytes"),
    ("uid share 0", {"slots": {"uid_share_percent": 0}}, "slots.uid_share_percent"),
    ("uid share past 100", {"slots": {"uid_share_percent": 101}}, "slots.uid_share_percent"),
    ("metrics address without port", {"metrics": {"address": "localhost"}}, "metrics.address"),
    ("recorder of size 0", {"flight_recorder_size": 0}, "flight_recorder_size"),
    ("devices not an array", {"devices": {"index": 0}}, "devices"),
    ("socket path too long", {"devices": [{"index": 0, "socket": "/" + "s" * 120}]}, "socket"),
    ("empty socket of another device", {"devices": [{"index": 0}, {"index": 1, "socket": ""}]},
     "devices[1].socket"),
    ("negative device index", {"devices": [{"index": -1}]}, "devices[0].index"),
    ("backend gloo (not a backend)", {"backend": "gloo"}, "backend"),
    ("port 99999", {"metrics": {"address": "127.0.0.1:99999"}}, "metrics.address"),
    ("port with a leading zero", {"metrics": {"address": "127.0.0.1:0080"}}, "metrics.address"),
    ("IPv6 host without brackets", {"metrics": {"address": "::1:0"}}, "metrics.address"),
    ("empty metrics host", {"metrics": {"address": ":9500"}}, "metrics.address"),
    ("flight recorder too large", {"flight_recorder_size": 1000001}, "flight_recorder_size"),
    ("peer timeout 0", {"timeouts": {"peer_ms": 0}}, "timeouts.peer_ms"),
    ("bind timeout 0", {"timeouts": {"bind_ms": 0}}, "timeouts.bind_ms"),
    ("unknown key in limits", {"limits": {"clients": 5}}, "limits.clients"),
    ("zero max_clients", {"limits": {"max_clients": 0}}, "limits.max_clients"),
    ("zero buffer bytes per uid", {"limits": {"buffer_bytes_per_uid": 0}},
     "limits.buffer_bytes_per_uid"),
    ("string limit", {"limits": {"buffers_per_client": "8"}}, "limits.buffers_per_client"),
    ("bind timeout over an hour", {"timeouts": {"bind_ms": 3600001}}, "timeouts.bind_ms"),
    ("worker stall threshold below 0", {"timeouts": {"worker_stall_ms": -1}},
     "timeouts.worker_stall_ms"),
    ("negative ring spin", {"rings": {"worker_spin_us": -1}}, "rings.worker_spin_us"),
    ("ring spin over a second", {"rings": {"worker_spin_us": 1000001}}, "rings.worker_spin_us"),
    ("unknown key in rings", {"rings": {"spin": 5}}, "rings.spin"),
    ("unknown key in admin", {"admin": {"group": "0"}}, "admin.group"),
    ("probe streams over 64", {"queues": {"probe_streams": 65}}, "queues.probe_streams"),
    ("negative probe streams", {"queues": {"probe_streams": -1}}, "queues.probe_streams"),
    ("unknown sharing policy", {"queues": {"sharing": "never"}}, "queues.sharing"),
    ("unknown key in queues", {"queues": {"probe": 4}}, "queues.probe"),
    ("unknown fused projection", {"fused": {"projection": "cublas"}}, "fused.projection"),
    ("unknown key in fused", {"fused": {"path": "auto"}}, "fused.path"),
    ("operator group not a string", {"admin": {"operator_group": 0}}, "admin.operator_group"),
]

# Good configs beyond the shipped ones: edge values both must accept.
GOOD_EDGES = [
    ("IPv6 metrics address", {"metrics": {"address": "[::1]:0"}}),
    ("metrics off (empty address)", {"metrics": {"address": ""}}),
    ("largest port and a host name", {"metrics": {"address": "node-1.example:65535"}}),
    ("backend auto", {"backend": "auto"}),
    ("backend nvlink", {"backend": "nvlink"}),
    ("backend nccl", {"backend": "nccl"}),
    ("drain timeout 0", {"timeouts": {"drain_ms": 0}}),
    ("stall watch off", {"timeouts": {"worker_stall_ms": 0}}),
    ("recorder of size 1000000", {"flight_recorder_size": 1000000}),
    ("no ring spin", {"rings": {"worker_spin_us": 0}}),
    ("no queue probe", {"queues": {"probe_streams": 0}}),
    ("queue probe of 64 streams, sharing allowed", {"queues": {"probe_streams": 64, "sharing": "allow"}}),
    ("fused projection on cuBLASLt", {"fused": {"projection": "cublaslt"}}),
    ("ring spin of a second", {"rings": {"worker_spin_us": 1000000}}),
    ("operator group by name", {"admin": {"operator_group": "root"}}),
    ("no operator group (empty)", {"admin": {"operator_group": ""}}),
]

# (flag, value, ok?, what stderr names): ulyssesd --check-config {} FLAG VALUE.
FLAGS = [
    ("--call-timeout-ms", "0", False, "--call-timeout-ms"),
    ("--call-timeout-ms", "-5", False, "--call-timeout-ms"),
    ("--call-timeout-ms", "abc", False, "--call-timeout-ms"),
    ("--call-timeout-ms", "1", True, ""),
    ("--peer-timeout-ms", "0", False, "--peer-timeout-ms"),
    ("--drain-timeout-ms", "-1", False, "--drain-timeout-ms"),
    ("--drain-timeout-ms", "0", True, ""),
    ("--ring-spin-us", "-1", False, "--ring-spin-us"),
    ("--ring-spin-us", "2000", True, ""),
    ("--operator-group", "no-such-group-x", False, "--operator-group"),
    ("--operator-group", "0", True, ""),
    ("--backend", "nccl", True, ""),
    ("--backend", "nvlink", True, ""),
    ("--backend", "gpu", False, "--backend"),
    ("--backend", "host", True, ""),
    ("--metrics-address", "::1:0", False, "--metrics-address"),
    ("--metrics-address", "127.0.0.1:99999", False, "--metrics-address"),
    ("--metrics-address", "[::1]:0", True, ""),
    ("--log-level", "loud", False, "--log-level"),
    ("--socket", "/" + "s" * 120, False, "--socket"),
    ("--queue-probe-streams", "65", False, "--queue-probe-streams"),
    ("--queue-probe-streams", "0", True, ""),
    ("--queue-sharing", "sometimes", False, "--queue-sharing"),
    ("--queue-sharing", "refuse", True, ""),
    ("--fused-projection", "cublas", False, "--fused-projection"),
    ("--fused-projection", "cutlass", True, ""),
    ("--device", "-1", False, "--device"),
    ("--device", "99999999999", False, "--device"),
]


def check_strict_schema(node: object, where: str, problems: list[str]) -> None:
    """Every object schema with properties must say additionalProperties: false."""
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            if node.get("additionalProperties") is not False:
                problems.append(f"schema {where or '/'}: additionalProperties is not false")
        for key, value in node.items():
            check_strict_schema(value, f"{where}/{key}", problems)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            check_strict_schema(value, f"{where}/{i}", problems)


def write(tmp: str, name: str, config: object) -> str:
    path = os.path.join(tmp, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def run_check(ulyssesd: str, config: object, tmp: str, name: str) -> subprocess.CompletedProcess:
    path = write(tmp, "bad-" + name.replace(" ", "_").replace("/", "_") + ".json", config)
    return subprocess.run([ulyssesd, "--check-config", path], capture_output=True, text=True,
                          timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ulyssesd", required=True)
    ap.add_argument("--deploy", required=True, help="the deploy/ folder")
    args = ap.parse_args()

    with open(os.path.join(args.deploy, "config.schema.json"), encoding="utf-8") as f:
        schema = json.load(f)
    failures: list[str] = []

    if schema.get("$schema") != "https://json-schema.org/draft/2020-12/schema":
        failures.append("schema: $schema is not draft 2020-12")
    jsonschema.Draft202012Validator.check_schema(schema)
    check_strict_schema(schema, "", failures)
    validator = jsonschema.Draft202012Validator(schema)

    good: list[tuple[str, object]] = []
    example_path = os.path.join(args.deploy, "ulyssesd.example.json")
    with open(example_path, encoding="utf-8") as f:
        good.append(("deploy/ulyssesd.example.json", json.load(f)))
    with open(os.path.join(args.deploy, "kubernetes", "configmap.yaml"), encoding="utf-8") as f:
        configmap = yaml.safe_load(f)
    good.append(("ConfigMap ulyssesd-config", json.loads(configmap["data"]["ulyssesd.json"])))
    good.append(("every key", FULL))
    good.append(("empty", {}))
    good.extend(GOOD_EDGES)

    with tempfile.TemporaryDirectory() as tmp:
        # The example file itself, as shipped.
        r = subprocess.run([args.ulyssesd, "--check-config", example_path], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            failures.append(f"ulyssesd --check-config {example_path}: exit {r.returncode}: {r.stderr.strip()}")
        good_seen: list[str] = []
        for name, config in good:
            good_seen.append(name)
            errors = [e.message for e in validator.iter_errors(config)]
            if errors:
                failures.append(f"good config {name!r}: schema rejects it: {errors}")
            for device in sorted({d["index"] for d in config.get("devices", [])} or {0}):
                path = write(tmp, f"good-{len(good_seen)}-{device}.json", config)
                r = subprocess.run([args.ulyssesd, "--device", str(device), "--check-config", path],
                                   capture_output=True, text=True, timeout=30)
                if r.returncode != 0:
                    failures.append(f"good config {name!r} (device {device}): ulyssesd exits "
                                    f"{r.returncode}: {r.stderr.strip()}")
            print(f"ok   good config {name!r}")
        for name, config, key in BAD:
            if validator.is_valid(config):
                failures.append(f"bad config {name!r}: the schema accepts it")
            r = run_check(args.ulyssesd, config, tmp, name)
            if r.returncode != 1:
                failures.append(f"bad config {name!r}: ulyssesd exits {r.returncode}, want 1 "
                                f"(stderr: {r.stderr.strip()!r})")
            elif key not in r.stderr:
                failures.append(f"bad config {name!r}: stderr does not name {key!r}: {r.stderr.strip()!r}")
            else:
                print(f"ok   bad config {name!r}: {r.stderr.strip()}")

        empty = write(tmp, "empty.json", {})
        for flag, value, ok, named in FLAGS:
            r = subprocess.run([args.ulyssesd, "--check-config", empty, flag, value],
                               capture_output=True, text=True, timeout=30)
            want = 0 if ok else 64
            if r.returncode != want:
                failures.append(f"flag {flag} {value}: ulyssesd exits {r.returncode}, want {want} "
                                f"(stderr: {r.stderr.strip()!r})")
            elif not ok and (named not in r.stderr or len(r.stderr.strip().splitlines()) != 1):
                failures.append(f"flag {flag} {value}: stderr is not one line naming {named!r}: "
                                f"{r.stderr.strip()!r}")
            else:
                print(f"ok   flag {flag} {value}: exit {r.returncode} {r.stderr.strip()}")

    for f in failures:
        print(f"FAIL {f}")
    print(f"check_config: {len(good) + len(BAD)} configs, {len(FLAGS)} flags, "
          f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
