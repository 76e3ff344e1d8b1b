#!/usr/bin/env python3
"""python_call_split.py: where a Python call's host time goes. One daemon, one rank (W = 1),
scatter_heads bf16; the parts are timed alternately in rounds, in one process.

Host backend (default): x and out= in shared buffers of the client.

- ``prep``: building the call's arguments (the package's ``_call_args``: operands, uly_tensors,
  uly_call_args), no daemon involved;
- ``raw``: the bare ``uly_session_call`` through ctypes on arguments built once (the C++
  client's own work and the daemon's);
- ``full``: ``HeadExchange.scatter_heads(x, out=out)`` as a user calls it.

GPU backend (``--backend nvlink``): x a torch CUDA tensor, on a torch stream of its own; the
result a slot view. A call returns once its descriptor is on the ring, so these are host
times alone; the stream is synchronized after each sample, outside its time.

- ``prep`` as above (with the current stream's lookup);
- ``raw``: ``uly_session_call`` on arguments built once, then the C release and free of its
  result (the least C work of a call);
- ``result``: a raw call (untimed), then the package's making of the result tensor from it
  (``_finish``: the result's info, DLPack, the tensor subclass), timed; released untimed;
- ``release``: a full call (untimed), then ``ulysses.release`` of its result, timed;
- ``full``: ``ulysses.release(hx.scatter_heads(x))`` as a user calls it.

``prep`` is pure Python on one core, so it compares packages even on a busy machine; ``raw``
and ``full`` also time the daemon's thread and need a quiet one. Prints a table and one JSON
line (``--json FILE`` writes it too).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/python"))  # daemons.py (sets the ULYSSES_LIBRARY default)
sys.path.insert(0, str(ROOT / "client/python"))  # the package, unless installed

from daemons import Cluster  # noqa: E402

import ulysses  # noqa: E402
from ulysses import _capi  # noqa: E402
from ulysses._client import _check as _capi_check  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("host", "nvlink"), default="host",
                   help="nvlink: the GPU backend with torch CUDA tensors")
    p.add_argument("--seq-local", type=int, default=32, help="S_l (H = 8, D = 128)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--samples", type=int, default=300, help="samples per part and round")
    p.add_argument("--commit", default=None, help="commit recorded in the JSON (default: git)")
    p.add_argument("--json", default=None, help="also write the JSON to this file")
    a = p.parse_args()
    for name in ("seq_local", "rounds", "samples"):
        if getattr(a, name) < 1:
            p.error("--%s: must be at least 1" % name.replace("_", "-"))
    commit = a.commit or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12",
                                         "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = a.backend == "nvlink"
    cluster = Cluster()
    try:
        sockets = cluster.start(1, backend=a.backend, gpus=1 if gpu else 0)
        client = ulysses.connect(sockets[0], name="python-call-split")
        group = client.join_group("python-call-split", 0, 1, members=sockets, backend=a.backend)
        hx = client.head_exchange(group, 8, 128, "bfloat16", max_tokens=a.seq_local)
        lib, handle = _capi.library(), hx._handle.ptr
        op = _capi.OP_SCATTER_HEADS
        # Each part: (untimed set-up returning its argument, the timed step on it).
        parts: Dict[str, Tuple[Callable[[], object], Callable[[object], object]]]
        sync: Callable[[], object] = lambda: None  # noqa: E731
        if gpu:
            import torch
            torch.cuda.set_device(0)
            stream = torch.cuda.Stream(device=0)
            torch.cuda.set_stream(stream)
            sync = stream.synchronize
            x = torch.zeros((1, a.seq_local, 8, 128), dtype=torch.bfloat16, device="cuda")
            args, keep = hx._call_args(op, [("x", x)], None, 0, 0)
            args_ref = ctypes.byref(args)

            def raw_call() -> ctypes.c_void_p:
                res = ctypes.c_void_p()
                _capi_check(lib.uly_session_call(handle, args_ref, ctypes.byref(res)))
                return res

            def raw_step(_: object) -> None:
                res = raw_call()
                lib.uly_result_release(res)
                lib.uly_result_free(res)

            parts = {
                "prep": (lambda: None, lambda _: hx._call_args(op, [("x", x)], None, 0, 0)),
                "raw": (lambda: None, raw_step),
                "result": (raw_call, lambda res: hx._finish(keep, res)),
                "release": (lambda: hx.scatter_heads(x), ulysses.release),
                "full": (lambda: None, lambda _: ulysses.release(hx.scatter_heads(x))),
            }
        else:
            x = client.empty((1, a.seq_local, 8, 128), "bfloat16")
            out = client.empty((1, a.seq_local, 8, 128), "bfloat16")
            args, _keep = hx._call_args(op, [("x", x)], out, 0, 0)
            args_ref = ctypes.byref(args)
            parts = {
                "prep": (lambda: None, lambda _: hx._call_args(op, [("x", x)], out, 0, 0)),
                "raw": (lambda: None, lambda _: lib.uly_session_call(handle, args_ref, None)),
                "full": (lambda: None, lambda _: hx.scatter_heads(x, out=out)),
            }
        for setup, step in parts.values():
            for _ in range(a.warmup):
                ulysses.release(step(setup()))
                sync()
        times: Dict[str, List[float]] = {k: [] for k in parts}
        for _ in range(a.rounds):
            for k, (setup, step) in parts.items():
                for _ in range(a.samples):
                    arg = setup()
                    t0 = time.perf_counter()
                    ret = step(arg)
                    times[k].append((time.perf_counter() - t0) * 1e6)
                    ulysses.release(ret)  # a result the step returned (no-op otherwise)
                    sync()
        hx.close()
    finally:
        cluster.close()
    rows = [{"part": k, "median_us": round(statistics.median(v), 1),
             "p10_us": round(sorted(v)[len(v) // 10], 1)} for k, v in times.items()]
    print("Python call split, scatter_heads bf16, %s backend, W=1, S_l=%d, H=8, D=128"
          % (a.backend, a.seq_local))
    print("  %-6s %10s %10s" % ("part", "median us", "p10 us"))
    for r in rows:
        print("  %-6s %10.1f %10.1f" % (r["part"], r["median_us"], r["p10_us"]))
    if gpu:
        import torch
        device = torch.cuda.get_device_name(0)
    else:
        device = "cpu: " + platform.machine()
    doc = {"bench": "python_call_split", "gpu": device, "commit": commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "backend": a.backend,
           "world_size": 1, "seq_local": a.seq_local,
           "method": "%d warm-up per part; %d rounds x %d samples per part, parts alternating "
                     "by round; median and 10th percentile" % (a.warmup, a.rounds, a.samples),
           "rows": rows}
    line = json.dumps(doc)
    print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
