"""Fixtures of the Python client tests: real ulyssesd processes on temporary unix sockets.

ULYSSESD names the daemon binary and ULYSSES_LIBRARY the client library (the ctest test sets
both; by hand they default to the build folder of this checkout).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("ULYSSES_LIBRARY", str(ROOT / "build/client/libulysses_client.so"))
ULYSSESD = os.environ.get("ULYSSESD", str(ROOT / "build/daemon/ulyssesd"))


class Daemon:
    """One ulyssesd (host backend) on a socket in `directory`, stopped by stop()."""

    def __init__(self, directory: str, device: int, extra: Sequence[str] = ()):
        self.socket = os.path.join(directory, "gpu%d.sock" % device)
        ready = os.path.join(directory, "gpu%d.ready" % device)
        self.log = os.path.join(directory, "gpu%d.log" % device)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [ULYSSESD, "--device", str(device), "--socket", self.socket, "--backend", "host",
                 "--ready-file", ready, *extra], stdout=log, stderr=subprocess.STDOUT)
        # The daemon renames the ready file into place once it serves.
        deadline = time.monotonic() + 20
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise RuntimeError("ulyssesd exited before serving: " + Path(self.log).read_text())
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("ulyssesd not ready within 20 s")
            time.sleep(0.005)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """Starts daemons on demand in one temporary folder; stops them all at the end."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ulysses-py-")
        self.daemons: List[Daemon] = []

    def start(self, n: int, extra: Sequence[str] = ()) -> List[str]:
        """Starts n more daemons; returns their sockets."""
        started = [Daemon(self.dir, len(self.daemons) + i, extra) for i in range(n)]
        self.daemons += started
        return [d.socket for d in started]

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def sockets() -> List[str]:
    """Three daemons shared by the tests that only run calls (groups have unique names)."""
    c = Cluster()
    try:
        yield c.start(3)
    finally:
        c.close()


@pytest.fixture
def cluster() -> Cluster:
    """Daemons of this test alone (for daemon options such as a short call timeout)."""
    c = Cluster()
    try:
        yield c
    finally:
        c.close()
