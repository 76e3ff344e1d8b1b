#!/usr/bin/env python3
"""Gathers a gpu-check run's outcome, case by case, into one JSON file.

Usage: gpu_check_results.py OUT

OUT is a folder scripts/gpu-check.sh wrote: summary.txt (commit, date and GPU lines),
stages.tsv (a line per stage: name, exit status, seconds, the MPS mode its daemons were to
report) and each stage's log. Writes OUT/tests.json, in the form of the suite runs kept under
bench/results/ ("gpu", "commit", "date", "mps", "rows"), and prints one line: the tally.

A row per case: gtest's cases from each test stage's log (a stage run as shards, from its shard
logs), read from gtest's own lines rather than its JSON so that a stage stopped at its limit
still has the cases it finished, and the case it was in when stopped ("stopped"); the Python
GPU tests' PASS and FAIL lines; the demo's JSON line (with the MPS mode the demo's daemons
reported, beside the mode they were to report); and a row for every other stage.
"""
import collections
import glob
import json
import os
import re
import sys

GTEST_PROGRAMS = {
    "nccl": "gpu_daemon_test",
    "kernels": "gpu_kernels_test",
    "kernels-fused": "gpu_kernels_test",
    "kernels-beside": "gpu_kernels_test",
    "daemon": "gpu_daemon_test",
}
# gtest's line for a case that ended: "[       OK ] Suite.Name (12 ms)". The lists gtest prints
# at the end name the failed and skipped cases again, without a time, and are not counted.
ENDED = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+) \((\d+) ms\)$")
STARTED = re.compile(r"^\[ RUN +\] (\S+)$")
OUTCOME = {"OK": "passed", "FAILED": "failed", "SKIPPED": "skipped"}


def gtest_rows(logs):
    rows = []
    for log in logs:
        running = None
        with open(log, errors="replace") as f:
            for line in f:
                line = line.rstrip("\n")
                started = STARTED.match(line)
                if started:
                    running = started.group(1)
                    continue
                ended = ENDED.match(line)
                if ended:
                    rows.append({"name": ended.group(2), "result": OUTCOME[ended.group(1)],
                                 "time_ms": int(ended.group(3))})
                    running = None
        if running is not None:
            rows.append({"name": running, "result": "stopped", "time_ms": None})
    return rows


def python_rows(log):
    rows = []
    with open(log, errors="replace") as f:
        for line in f:
            for word, result in (("PASS ", "passed"), ("FAIL ", "failed")):
                if line.startswith(word):
                    rows.append({"name": line[len(word):].strip(), "result": result})
    return rows


def demo_row(log, passed):
    row = {"name": "demo", "result": "passed" if passed else "failed"}
    with open(log, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip().startswith("{")]
    if lines:
        try:
            report = json.loads(lines[-1])
        except ValueError:
            return row
        for key in ("backend", "checks", "ranks", "p50_us_worst_rank"):
            if key in report:
                row[key] = report[key]
        if "mps" in report:
            row["mps_reported"] = report["mps"]
    return row


def main(argv):
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = argv[1]
    header = {}
    with open(os.path.join(out, "summary.txt")) as f:
        for line in f:
            key, _, value = line.strip().partition(" ")
            if key in ("commit", "date", "gpu") and key not in header:
                header[key] = value
    stages = []
    with open(os.path.join(out, "stages.tsv")) as f:
        for line in f:
            name, rc, seconds, mode = line.rstrip("\n").split("\t")
            stages.append((name, int(rc), int(seconds), mode))

    rows = []
    for name, rc, seconds, mode in stages:
        log = os.path.join(out, name + ".log")
        base = {"stage": name, "mode": mode or "none"}
        if name in GTEST_PROGRAMS:
            shards = sorted(glob.glob(os.path.join(out, name + ".shard*.log")))
            found = gtest_rows(shards or [log])
            if not found:  # the program did not get as far as a case
                found = [{"name": name, "result": "failed" if rc else "passed",
                          "time_ms": seconds * 1000}]
            rows += [dict(base, program=GTEST_PROGRAMS[name], **r) for r in found]
        elif name == "python":
            found = python_rows(log) or [{"name": name, "result": "failed" if rc else "passed"}]
            rows += [dict(base, program="tests/python/test_gpu.py", **r) for r in found]
        elif name == "demo":
            rows.append(dict(base, program="ulysses-demo", **demo_row(log, rc == 0)))
        else:
            rows.append(dict(base, program=name, name=name,
                             result="failed" if rc else "passed", time_ms=seconds * 1000))

    gpu, _, driver = header.get("gpu", "unknown").partition(", ")
    report = {
        "gpu": gpu,
        "driver": driver or "unknown",
        "commit": header.get("commit", "unknown"),
        "date": header.get("date", "unknown"),
        "mps": any(mode == "mps" for _, _, _, mode in stages),
        "method": "scripts/gpu-check.sh; a row per case, from the stages' logs "
                  "(scripts/lib/gpu_check_results.py). mode: the MPS mode each stage's daemons "
                  "were to report.",
        "rows": rows,
    }
    with open(os.path.join(out, "tests.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    tally = collections.Counter(row["result"] for row in rows)
    counts = ", ".join(f"{tally.get(k, 0)} {k}" for k in ("passed", "failed", "skipped",
                                                          "stopped"))
    print(f"gpu-check: {len(rows)} cases: {counts}; each in {os.path.join(out, 'tests.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
