#!/usr/bin/env python3
"""The programs as an operator meets them: ulyssesd and ulysses-demo on bad input.

    programs_test.py --build BUILD_DIR

- ulyssesd: a metrics port another daemon holds is a start-up error (exit 1, the address
  named, no socket or ready file left behind); bad flags exit 64 with one line naming the
  flag and the rule; --help shows the defaults.
- ulysses-demo: bad options exit 64 with one line naming the option, before any daemon
  starts; a daemon that cannot start is reported with its reason and the kept run folder.
Standard library only. Daemons are waited for through their ready files, never by sleeping.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

FAILURES: list[str] = []


def check(ok: bool, what: str, detail: str = "") -> None:
    if ok:
        print(f"ok   {what}")
    else:
        FAILURES.append(f"{what}: {detail}")
        print(f"FAIL {what}: {detail}")


def run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def wait_for_file(path: str, proc: subprocess.Popen, timeout: float = 30) -> bool:
    """True once `path` exists; False if `proc` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def one_line(text: str) -> bool:
    return len(text.strip().splitlines()) == 1


def metrics_port_taken(ulyssesd: str, tmp: str) -> None:
    first_ready = os.path.join(tmp, "a.ready")
    first = subprocess.Popen(
        [ulyssesd, "--device", "0", "--backend", "host", "--socket", os.path.join(tmp, "a.sock"),
         "--ready-file", first_ready, "--metrics-address", "127.0.0.1:0", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if not wait_for_file(first_ready, first):
            check(False, "first daemon serves metrics on a free port", first.stderr.read() if
                  first.poll() is not None else "no ready file within 30 s")
            return
        with open(first_ready, encoding="utf-8") as f:
            address = json.load(f)["metrics_address"]
        check(address.startswith("127.0.0.1:") and not address.endswith(":0"),
              "the ready file has the bound metrics port", address)
        second_sock = os.path.join(tmp, "b.sock")
        second_ready = os.path.join(tmp, "b.ready")
        r = run([ulyssesd, "--device", "1", "--backend", "host", "--socket", second_sock,
                 "--ready-file", second_ready, "--metrics-address", address], timeout=30)
        check(r.returncode == 1, "a second daemon on the same metrics port exits 1",
              f"exit {r.returncode}, stderr {r.stderr!r}")
        check(f"metrics.address: cannot listen on {address}" in r.stderr,
              "its error names the address", r.stderr)
        check(not os.path.exists(second_sock) and not os.path.exists(second_ready),
              "it leaves no socket or ready file behind", str(os.listdir(tmp)))
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.wait(timeout=30)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
        check(first.returncode == 0, "the first daemon still stops cleanly",
              f"exit {first.returncode}")


def ulyssesd_usage(ulyssesd: str) -> None:
    for args, named in [
        (["--device", "-1"], "--device"),
        (["--device", "x"], "--device"),
        (["--call-timeout-ms", "0"], "--call-timeout-ms"),
        (["--call-timeout-ms", "-5"], "--call-timeout-ms"),
        (["--metrics-address", "::1:0"], "--metrics-address"),
        (["--backend", "gloo"], "--backend"),
        (["--bogus"], "--bogus"),
    ]:
        r = run([ulyssesd, *args])
        check(r.returncode == 64 and named in r.stderr and one_line(r.stderr)
              and len(r.stderr) < 300,
              f"ulyssesd {' '.join(args)}: exit 64, one short line naming {named}",
              f"exit {r.returncode}, stderr {r.stderr!r}")
    r = run([ulyssesd, "--help"])
    check(r.returncode == 0 and "--call-timeout-ms INT=30000" in r.stdout
          and "--backend TEXT=auto" in r.stdout and "--device INT=0" in r.stdout,
          "ulyssesd --help shows the defaults", r.stdout)


def demo_usage(demo: str) -> None:
    cases = [
        (["--schedule", "abc"], "--schedule"),
        (["--schedule", "99999999999"], "--schedule"),
        (["--schedule", "1,,2"], "--schedule"),
        (["--heads", "-4"], "--heads"),
        (["--heads", "0"], "--heads"),
        (["--hold-seconds", "-1"], "--hold-seconds"),
        (["--seq-local", "0"], "--seq-local"),
        (["--ranks", "0"], "--ranks"),
        (["--dtype", "int8"], "--dtype"),
        (["--backend", "gpu"], "--backend"),
        # Geometry is checked once, before any daemon starts.
        (["--ranks", "4", "--heads", "6"], "--heads"),
        (["--ranks", "2", "--heads", "8", "--schedule", "1,1"], "--schedule"),
        (["--bogus"], "--bogus"),
    ]
    for args, named in cases:
        r = run([demo, *args], timeout=30)
        check(r.returncode == 64 and named in r.stderr and one_line(r.stderr)
              and "daemons serving" not in r.stdout and len(r.stderr) < 300,
              f"ulysses-demo {' '.join(args)}: exit 64, one line naming {named}, no daemon",
              f"exit {r.returncode}, stdout {r.stdout!r}, stderr {r.stderr!r}")
    r = run([demo, "--help"])
    check(r.returncode == 0 and "--ranks INT=4" in r.stdout and "--dtype TEXT=bfloat16" in r.stdout,
          "ulysses-demo --help shows the defaults", r.stdout)


def demo_missing_daemon(demo: str, tmp: str) -> None:
    missing = os.path.join(tmp, "no-such-ulyssesd")
    r = run([demo, "--ranks", "2", "--ulyssesd", missing], timeout=60)
    out = r.stdout + r.stderr
    check(r.returncode == 1, "ulysses-demo with a missing ulyssesd exits 1",
          f"exit {r.returncode}: {out!r}")
    check(missing in out and "No such file or directory" in out,
          "it says which program could not start and why", out)
    kept = [line.split("kept in ", 1)[1].split()[0].rstrip(".:")
            for line in out.splitlines() if "kept in " in line]
    check(len(kept) == 1 and os.path.isdir(kept[0]),
          "it names the run folder it kept for the logs", out)
    for d in kept:
        if os.path.isdir(d) and os.path.basename(d).startswith("ulysses."):
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    args = ap.parse_args()
    ulyssesd = os.path.join(args.build, "daemon", "ulyssesd")
    demo = os.path.join(args.build, "client", "ulysses-demo")
    with tempfile.TemporaryDirectory(prefix="ulysses-programs.", dir="/tmp") as tmp:
        metrics_port_taken(ulyssesd, tmp)
        ulyssesd_usage(ulyssesd)
        demo_usage(demo)
        demo_missing_daemon(demo, tmp)
    print(f"programs_test: {len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
