#!/usr/bin/env python3
"""python_overhead.py: the per-call time of the Python package against the C++ client on the
same shape, through the same kind of daemons (DESIGN.md section 8, "daemon overhead").

The op is scatter_heads, bfloat16, B = 1, H = --heads-per-rank * W, D = --head-dim, S_l =
bytes_per_rank / (H * D * 2), W ranks as W threads of this process, one daemon each.

- Python: this script, through ``ulysses`` (ctypes over libulysses_client.so), rings on.
  Host backend: x and out= in shared buffers of the client (``client.empty``), so nothing is
  staged; GPU backend (``--backend nvlink``, ranks sharing one GPU): x a torch CUDA tensor,
  each rank on a torch stream of its own (calls are stream-ordered), the result a slot view
  released at once, a sample ending when the rank's stream has the result (a synchronize
  that releases the GIL), the L2 flushed (a 256 MiB memset) before each sample, outside its
  time.
- C++: the project's own benches on the same shapes, run as programs: ``ulysses-bench``
  (host backend; its daemon side B, ``b_daemon.work_max_median_us``) or
  ``ulysses-gpu-bench --parts overhead`` (GPU; ``daemon_ring_us``). Both time what this
  script times: per sample the slowest rank's wall time of the call (and, on the GPU, the
  release of its result); the median of all samples.

With --ahead-us (GPU), each side is also timed with the host ahead of its stream, a
framework's case: the stream is held by a spin kernel (torch.cuda._sleep) for about that long
while the host issues the call and its release; CUDA events after the spin and after the
release time the device's part alone (python_ahead_us; cpp_ahead_us from the C++ bench's
daemon_ring_ahead_us; torch_a2a_ahead_us the same for all_to_all_single).

Method: each Python case checks its result bit for bit against the numpy reference before
timing, then warms up and takes --rounds x --samples samples; the two sides run one after the
other, never at once. It prints a table and one JSON line (--json FILE writes it too):
gpu, commit, date, backend, world_size, mps, rows[{world_size, bytes_per_rank, seq_local,
python_us, cpp_us, python_minus_cpp_us, python_over_cpp, torch_a2a_us and, with --ahead-us,
python_ahead_us, cpp_ahead_us, torch_a2a_ahead_us}].

    python3 bench/python_overhead.py                         # host backend, small grid
    python3 bench/python_overhead.py --backend nvlink --json bench/results/DATE-h200-python-overhead.json

ULYSSES_LIBRARY names the client library and --ulyssesd the daemon (defaults: this build).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/python"))  # daemons.py (sets the ULYSSES_LIBRARY default)
sys.path.insert(0, str(ROOT / "client/python"))  # the package, unless installed

import numpy as np  # noqa: E402

from daemons import Cluster  # noqa: E402
from helpers import random_array, ref_scatter_heads, run_ranks, same_bits, unique  # noqa: E402

import ulysses  # noqa: E402

SIZES = {"K": 10, "M": 20, "G": 30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(i?B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError("%r is not a size (bytes, or 64K, 1M, 1G)" % text)
    return int(m.group(1)) << SIZES.get(m.group(2).upper(), 0)


def size_name(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and ulysses.cuda_built()


class PythonSide:
    """W ranks (threads), each with a client and a head-exchange session on its daemon."""

    def __init__(self, sockets: List[str], heads: int, head_dim: int, seq_local: int,
                 device: bool):
        self.W, self.heads, self.head_dim, self.seq_local = len(sockets), heads, head_dim, seq_local
        self.device = device
        name = unique("pyoverhead")
        rng = np.random.default_rng(seq_local * 31 + self.W)
        self.inputs = [random_array(rng, (1, seq_local, heads, head_dim), "bfloat16")
                       for _ in range(self.W)]

        def open_rank(r: int) -> Tuple[Any, Any, Any, Any]:
            if device:
                import torch
                torch.cuda.set_device(0)
            c = ulysses.connect(sockets[r], name="python-overhead-%d" % r)
            g = c.join_group(name, r, self.W, members=sockets,
                             backend="nvlink" if device else "host")
            hx = c.head_exchange(g, heads, head_dim, "bfloat16", max_tokens=seq_local)
            if device:
                import torch
                x = torch.from_numpy(self.inputs[r].view(np.int16)).view(torch.bfloat16).cuda()
                out = None
            else:
                x = c.empty((1, seq_local, heads, head_dim), "bfloat16")
                x[...] = self.inputs[r]
                out = c.empty((1, self.W * seq_local, heads // self.W, head_dim), "bfloat16")
            return c, hx, x, out

        self.ranks = run_ranks(self.W, open_rank)
        self.flush = None
        self.streams: List[Any] = []
        if device:
            import torch
            self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            # Ranks of one process on one stream would each wait for the other's call in that
            # stream's order: a stream per rank.
            self.streams = [torch.cuda.Stream(device=0) for _ in range(self.W)]

    def call(self, r: int) -> Any:
        """One call of rank r; on the GPU it ends when the rank's stream has the result."""
        _, hx, x, out = self.ranks[r]
        if out is not None:
            return hx.scatter_heads(x, out=out)
        # The rank's thread made its stream current once (time()), as a framework does: the
        # sample holds the call, its release and the wait for the stream, as the C++ one does.
        res = hx.scatter_heads(x)
        ulysses.release(res)
        self.streams[r].synchronize()
        return res

    def check(self) -> None:
        """Every rank's result equals the reference bit for bit."""
        def body(r: int) -> np.ndarray:
            _, hx, x, out = self.ranks[r]
            if out is not None:
                return np.array(hx.scatter_heads(x, out=out))
            import torch
            with torch.cuda.stream(self.streams[r]):
                res = hx.scatter_heads(x)
                # Wait without the GIL: t.cpu() would hold it while the other ranks' threads
                # still have to issue their part of the call.
                self.streams[r].synchronize()
                got = res.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
                res.release()
            return got
        got = run_ranks(self.W, body)
        for r in range(self.W):
            if not same_bits(got[r], ref_scatter_heads(self.inputs, r)):
                raise RuntimeError("rank %d: the result differs from the reference" % r)

    def time(self, samples: int, profiles: Optional[List[Any]] = None) -> List[float]:
        """`samples` samples: per sample, the slowest rank's wall time of the call (us).
        With `profiles`, each rank's thread runs its calls under cProfile and appends its
        profile there (the times then include the profiler's cost)."""
        barrier = threading.Barrier(self.W)
        per_rank = [[0.0] * samples for _ in range(self.W)]

        def body(r: int) -> None:
            if self.device:
                import torch
                torch.cuda.set_device(0)
                torch.cuda.set_stream(self.streams[r])  # this thread's current stream
            prof = None
            if profiles is not None:
                import cProfile
                prof = cProfile.Profile()
            for i in range(samples):
                barrier.wait()
                if self.flush is not None and r == 0:
                    self.flush.zero_()
                    torch.cuda.synchronize()
                barrier.wait()
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                self.call(r)
                per_rank[r][i] = (time.perf_counter() - t0) * 1e6
                if prof is not None:
                    prof.disable()
            if prof is not None:
                profiles.append(prof)

        run_ranks(self.W, body)
        return [max(per_rank[r][i] for r in range(self.W)) for i in range(samples)]

    def time_ahead(self, samples: int, cycles: int) -> List[float]:
        """GPU: `samples` samples with the host ahead: per sample and rank, the rank's stream
        held by a spin of `cycles` clocks while the call and its release are issued, the time
        between events after the spin and after the release (us); the slowest rank's."""
        import torch
        barrier = threading.Barrier(self.W)
        per_rank = [[0.0] * samples for _ in range(self.W)]

        def body(r: int) -> None:
            torch.cuda.set_device(0)
            torch.cuda.set_stream(self.streams[r])
            _, hx, x, _ = self.ranks[r]
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            for i in range(samples):
                barrier.wait()
                if r == 0:
                    self.flush.zero_()
                    torch.cuda.synchronize()
                barrier.wait()
                per_rank[r][i] = held_sample_us(
                    cycles, lambda: ulysses.release(hx.scatter_heads(x)), start, stop)

        run_ranks(self.W, body)
        return [max(per_rank[r][i] for r in range(self.W)) for i in range(samples)]

    def close(self) -> None:
        for c, hx, _, _ in self.ranks:
            hx.close()
            c.close()


def held_sample_us(cycles: int, issue: Any, start: Any, stop: Any) -> float:
    """One sample with the host ahead: the current stream held by a spin of `cycles` clocks
    while `issue()` is called, then the time between events after the spin and after it (us)."""
    import torch
    torch.cuda._sleep(cycles)
    start.record()
    issue()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3


def spin_cycles(ahead_us: int) -> int:
    """Clocks of torch.cuda._sleep that hold a stream for about `ahead_us` (measured here)."""
    import torch
    probe = 1 << 20
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # the first launch loads the kernel
    start.record()
    torch.cuda._sleep(probe)
    stop.record()
    stop.synchronize()
    return max(1, int(probe * ahead_us / (start.elapsed_time(stop) * 1e3)))


CppTimes = Dict[Tuple[int, int], Tuple[float, Optional[float]]]


def cpp_times(args: argparse.Namespace, device: bool, worlds: List[int],
              sizes: List[int]) -> Tuple[CppTimes, Optional[bool]]:
    """{(W, bytes_per_rank): (us, us with the host ahead or None)} from the C++ bench, and its
    MPS verdict (GPU only)."""
    build = ROOT / "build"
    with tempfile.TemporaryDirectory(prefix="ulysses-pyoverhead-") as tmp:
        out = os.path.join(tmp, "cpp.json")
        common = ["--heads-per-rank", str(args.heads_per_rank), "--head-dim",
                  str(args.head_dim), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
                  "--samples", str(max(args.samples, 2)), "--json", out]
        if args.ulyssesd:
            common += ["--ulyssesd", args.ulyssesd]
        times: CppTimes = {}
        if device:
            prog = args.cpp_bench or str(build / "bench/ulysses-gpu-bench")
            cmd = [prog, "--parts", "overhead", "--overhead-world", ",".join(map(str, worlds)),
                   "--overhead-sizes", ",".join(map(str, sizes)), "--mps", args.mps,
                   "--ahead-us", str(args.ahead_us)] + common
            run(cmd)
            doc = json.loads(Path(out).read_text())
            for row in doc["rows"]:
                if row.get("part") == "overhead":
                    times[(row["world_size"], row["bytes_per_rank"])] = (
                        row["daemon_ring_us"], row.get("daemon_ring_ahead_us"))
            return times, bool(doc.get("mps"))
        prog = args.cpp_bench or str(build / "bench/ulysses-bench")
        for w in worlds:
            token = args.heads_per_rank * w * args.head_dim * 2
            seqs = [b // token for b in sizes]
            run([prog, "--ranks", str(w), "--ops", "scatter_heads", "--batch", "1", "--dtype",
                 "bf16", "--seq-local", ",".join(map(str, seqs))] + common)
            for case in json.loads(Path(out).read_text())["cases"]:
                times[(case["world"], case["bytes_per_rank"])] = (
                    case["b_daemon"]["work_max_median_us"], None)
        return times, None


def torch_a2a_times(sizes: List[int], heads_per_rank: int, head_dim: int, warmup: int,
                    samples: int, cycles: int) -> Dict[int, Tuple[float, Optional[float]]]:
    """{bytes_per_rank: (us, us with the host ahead or None)} of
    torch.distributed.all_to_all_single over NCCL in a group of one
    (this process, GPU 0) on the same bytes: the call a framework would make instead, timed
    like the Python side (the rank's stream current, L2 flushed outside the sample, the sample
    ending when the stream has the result). A group of more ranks needs a process per rank
    and a GPU per rank (NCCL refuses two ranks on one GPU), so W = 1 is what one GPU can show.
    With `cycles` > 0 also timed with the host ahead (PythonSide.time_ahead's method)."""
    import torch
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        stream = torch.cuda.Stream(device=0)
        torch.cuda.set_stream(stream)
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        out: Dict[int, Tuple[float, Optional[float]]] = {}
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        for b in sizes:
            seq = b // (heads_per_rank * head_dim * 2)
            x = torch.randn(1, seq, heads_per_rank, head_dim, device="cuda").to(torch.bfloat16)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x)
            stream.synchronize()
            if not torch.equal(y.view(torch.int16), x.view(torch.int16)):
                raise RuntimeError("all_to_all_single of a group of one changed the data")
            times: List[float] = []
            for i in range(warmup + samples):
                flush.zero_()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dist.all_to_all_single(y, x)
                stream.synchronize()
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e6)
            ahead: List[float] = []
            for i in range(warmup + samples if cycles > 0 else 0):
                flush.zero_()
                torch.cuda.synchronize()
                us = held_sample_us(cycles, lambda: dist.all_to_all_single(y, x), start, stop)
                if i >= warmup:
                    ahead.append(us)
            out[b] = (statistics.median(times), statistics.median(ahead) if ahead else None)
        return out
    finally:
        dist.destroy_process_group()


def write_profile(path: str, case: str, side: PythonSide, samples: int) -> None:
    """Appends to `path` what the Python package spends the time of `samples` calls per rank of
    `side` in: per function, calls and own and cumulative time per call of the bench, in us
    (cProfile; a ctypes call counts in its Python caller's own time)."""
    import pstats
    profiles: List[Any] = []
    side.time(samples, profiles)
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        stats.add(p)
    calls = samples * len(profiles)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:40]  # type: ignore[attr-defined]
    with open(path, "a") as f:
        f.write("== %s: %d calls per rank, %d ranks; us per call ==\n" % (
            case, samples, len(profiles)))
        f.write("%10s %10s %10s  %s\n" % ("n/call", "own us", "cum us", "function"))
        for (file, line, fn), (_, nc, tt, ct, _) in rows:
            where = "%s:%d(%s)" % (os.path.basename(file), line, fn) if line else fn
            f.write("%10.2f %10.2f %10.2f  %s\n" % (nc / calls, tt / calls * 1e6,
                                                    ct / calls * 1e6, where))


def run(cmd: List[str]) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout)
        raise SystemExit("python_overhead: %s failed (exit %d)" % (cmd[0], p.returncode))


def device_name(device: bool) -> str:
    if device:
        import torch
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("auto", "host", "nvlink"), default="auto",
                    help="auto: nvlink when torch sees a GPU and the library has CUDA, else host")
    ap.add_argument("--world", default="1,2", help="world sizes W (comma-separated)")
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M",
                    help="bytes per rank (comma-separated; 64K, 1M, ...)")
    ap.add_argument("--heads-per-rank", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=10, help="samples per round")
    ap.add_argument("--mps", choices=("auto", "yes", "no"), default="auto",
                    help="GPU: recorded MPS state (auto: what ulysses-gpu-bench reports)")
    ap.add_argument("--ulyssesd", default=None, help="the daemon (default: this build's)")
    ap.add_argument("--cpp-bench", default=None,
                    help="the C++ bench (default: build/bench/ulysses-bench or ulysses-gpu-bench)")
    ap.add_argument("--no-cpp", action="store_true", help="skip the C++ side (cpp_us null)")
    ap.add_argument("--commit", default=None, help="commit recorded in the JSON")
    ap.add_argument("--json", default=None, help="also write the JSON to this file")
    ap.add_argument("--torch-a2a", action="store_true",
                    help="GPU, W = 1: also time torch.distributed.all_to_all_single (NCCL, a "
                         "group of one) on the same bytes (torch_a2a_us)")
    ap.add_argument("--ahead-us", type=int, default=0,
                    help="GPU: also time each side with the host this far ahead of a held "
                         "stream (python_ahead_us, cpp_ahead_us, torch_a2a_ahead_us; 0: not)")
    ap.add_argument("--profile", default=None,
                    help="after timing each case, run its samples again under cProfile and "
                         "write the functions by own time into this text file")
    args = ap.parse_args()
    if args.ulyssesd:
        os.environ["ULYSSESD"] = args.ulyssesd
        import daemons
        daemons.ULYSSESD = args.ulyssesd
    worlds = [int(w) for w in args.world.split(",") if w]
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    device = args.backend == "nvlink" or (args.backend == "auto" and gpu_available())
    if device and not gpu_available():
        raise SystemExit("python_overhead: --backend nvlink needs torch with CUDA and a "
                         "libulysses_client built with CUDA")
    for w in worlds:
        token = args.heads_per_rank * w * args.head_dim * 2
        for b in sizes:
            if b % token:
                raise SystemExit("python_overhead: --sizes: %d bytes per rank is not a multiple "
                                 "of a token's H*D*2 = %d bytes at W=%d" % (b, token, w))

    if args.ahead_us < 0:
        raise SystemExit("python_overhead: --ahead-us must be >= 0")
    cpp: CppTimes = {}
    mps: Optional[bool] = None
    if not args.no_cpp:
        cpp, mps = cpp_times(args, device, worlds, sizes)

    rows = []
    total = args.rounds * args.samples
    a2a: Dict[int, Tuple[float, Optional[float]]] = {}
    cycles = spin_cycles(args.ahead_us) if device and args.ahead_us > 0 else 0
    if args.torch_a2a and device and 1 in worlds:
        a2a = torch_a2a_times(sizes, args.heads_per_rank, args.head_dim, args.warmup, total,
                              cycles)
    for w in worlds:
        cluster = Cluster()
        try:
            sockets = cluster.start(w, backend="nvlink" if device else "host",
                                    gpus=1 if device else 0)
            for b in sizes:
                heads = args.heads_per_rank * w
                seq = b // (heads * args.head_dim * 2)
                side = PythonSide(sockets, heads, args.head_dim, seq, device)
                try:
                    side.check()
                    side.time(args.warmup)
                    us = statistics.median(side.time(total))
                    us_ahead = None
                    if cycles > 0:
                        side.time_ahead(args.warmup, cycles)
                        us_ahead = statistics.median(side.time_ahead(total, cycles))
                    if args.profile:
                        write_profile(args.profile, "W=%d %s/rank" % (w, size_name(b)),
                                      side, total)
                finally:
                    side.close()
                c, c_ahead = cpp.get((w, b), (None, None))
                t, t_ahead = a2a.get(b, (None, None)) if w == 1 else (None, None)
                r1 = lambda v: None if v is None else round(v, 1)  # noqa: E731
                row = {"world_size": w, "bytes_per_rank": b, "seq_local": seq,
                       "python_us": round(us, 1), "cpp_us": r1(c),
                       "python_minus_cpp_us": None if c is None else round(us - c, 1),
                       "python_over_cpp": None if not c else round(us / c, 3),
                       "torch_a2a_us": r1(t)}
                if cycles > 0:
                    row.update({"python_ahead_us": r1(us_ahead), "cpp_ahead_us": r1(c_ahead),
                                "torch_a2a_ahead_us": r1(t_ahead)})
                rows.append(row)
                print("W=%d %s/rank: python %.1f us, C++ %s" % (
                    w, size_name(b), us, "-" if c is None else "%.1f us" % c),
                    file=sys.stderr, flush=True)
        finally:
            cluster.close()

    print("Python vs C++ per-call time, scatter_heads bf16, %s backend, D=%d, H=%d*W" % (
        "nvlink" if device else "host", args.head_dim, args.heads_per_rank))
    print("%3s %10s %8s %12s %12s %10s %8s %10s %10s %10s %10s" % (
        "W", "bytes/rank", "S_l", "python us", "C++ us", "py-C++", "py/C++", "a2a us",
        "py ahead", "C++ ahead", "a2a ahead"))
    for r in rows:
        fmt = lambda v, f: "-" if v is None else f % v  # noqa: E731
        print("%3d %10s %8d %12.1f %12s %10s %8s %10s %10s %10s %10s" % (
            r["world_size"], size_name(r["bytes_per_rank"]), r["seq_local"], r["python_us"],
            fmt(r["cpp_us"], "%.1f"), fmt(r["python_minus_cpp_us"], "%.1f"),
            fmt(r["python_over_cpp"], "%.3f"), fmt(r["torch_a2a_us"], "%.1f"),
            fmt(r.get("python_ahead_us"), "%.1f"), fmt(r.get("cpp_ahead_us"), "%.1f"),
            fmt(r.get("torch_a2a_ahead_us"), "%.1f")))
    doc = {
        "bench": "python_overhead",
        "gpu": device_name(device),
        "commit": args.commit or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": "nvlink" if device else "host",
        "world_size": worlds,
        "mps": mps if device else None,
        "op": "scatter_heads",
        "dtype": "bf16",
        "heads_per_rank": args.heads_per_rank,
        "head_dim": args.head_dim,
        "method": ("per sample the slowest rank's wall time of one call%s; %d warm-up, %d x %d "
                   "samples, median; Python checked bit for bit first; C++ from %s" % (
                       " and its release, L2 flushed before each sample" if device else
                       " with out= in shared buffers", args.warmup, args.rounds, args.samples,
                       "ulysses-gpu-bench --parts overhead (daemon_ring_us)" if device else
                       "ulysses-bench (b_daemon.work_max_median_us)")),
        "ahead_us": args.ahead_us if cycles > 0 else None,
        "rows": rows,
    }
    line = json.dumps(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
