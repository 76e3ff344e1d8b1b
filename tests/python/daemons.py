"""Real ulyssesd processes on temporary unix sockets, for the Python client tests (pytest
fixtures in conftest.py, and test_gpu.py run as a plain script).

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
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("ULYSSES_LIBRARY", str(ROOT / "build/client/libulysses_client.so"))
ULYSSESD = os.environ.get("ULYSSESD", str(ROOT / "build/daemon/ulyssesd"))


class Daemon:
    """One ulyssesd on a socket in `directory`, stopped by stop(). `index` names its socket
    (gpu<index>.sock); `device` is its --device (default `index`), so that several daemons
    of a GPU backend can share one GPU."""

    def __init__(self, directory: str, index: int, extra: Sequence[str] = (),
                 backend: str = "host", device: Optional[int] = None):
        self.socket = os.path.join(directory, "gpu%d.sock" % index)
        ready = os.path.join(directory, "gpu%d.ready" % index)
        self.log = os.path.join(directory, "gpu%d.log" % index)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [ULYSSESD, "--device", str(index if device is None else device), "--socket",
                 self.socket, "--backend", backend, "--ready-file", ready, *extra],
                stdout=log, stderr=subprocess.STDOUT)
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

    def start(self, n: int, extra: Sequence[str] = (), backend: str = "host",
              gpus: int = 0) -> List[str]:
        """Starts n more daemons; returns their sockets. With `gpus` > 0 daemon i runs on
        GPU i % gpus (ranks share GPUs when there are more of them)."""
        first = len(self.daemons)
        started = [Daemon(self.dir, i, extra, backend, i % gpus if gpus > 0 else None)
                   for i in range(first, first + n)]
        self.daemons += started
        return [d.socket for d in started]

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
        keep = os.environ.get("ULYSSES_TEST_LOG_DIR")
        if keep:  # the daemons' logs outlive the run (a machine where only that folder returns)
            os.makedirs(keep, exist_ok=True)
            for d in self.daemons:
                shutil.copy(d.log, os.path.join(keep, "%s-%s" % (os.path.basename(self.dir),
                                                                 os.path.basename(d.log))))
        shutil.rmtree(self.dir, ignore_errors=True)
