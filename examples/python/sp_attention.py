#!/usr/bin/env python3
"""A sequence-parallel (Ulysses) attention layer whose head exchanges go through ulyssesd.

Each of W ranks holds S_l = S/W tokens of the sequence. Per layer a rank
  1. projects its tokens to q, k, v [B, S_l, H, D];
  2. scatter_qkv_head_chunk: receives its head band of every rank's tokens, q|k|v packed as
     [B, S_g, H/W, 3D] (one exchange for the three);
  3. runs torch.nn.functional.scaled_dot_product_attention over the whole sequence for its
     H/W heads;
  4. gather_heads: gets back all heads of its own tokens, [B, S_l, H, D];
  5. projects the output.
Every rank checks its output against a single-process reference of the same layer.

Run it with torchrun (one process per rank; each rank's daemon at $ULYSSES_SOCKET, or
<--socket-dir>/gpu<LOCAL_RANK>.sock, or /run/ulysses/gpu<LOCAL_RANK>.sock)::

    torchrun --nproc-per-node 2 examples/python/sp_attention.py

or alone, in which case it starts W daemons and W rank processes itself::

    python3 examples/python/sp_attention.py --world-size 2 --ulyssesd build/daemon/ulyssesd

--device cpu (the default): CPU tensors on the host backend. --device cuda: CUDA tensors on
the GPU backend (run alone, it starts the daemons with --backend nvlink, rank r on GPU
r % <GPUs>, so that ranks share a GPU when W exceeds them); the exchanges read and write the
tensors in place, ordered after torch's current stream.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ulysses

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The layer computes in the argument dtype; the reference in float32 from the same inputs (and
# the same bfloat16-rounded weights), on the layer's device. One bound per dtype, on CPU and
# CUDA alike: bfloat16 keeps 8 significant bits, and |y| stays below 1 at these shapes (the
# CPU runs show max errors near 1e-3 for bfloat16).
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}


class SequenceParallelAttention(torch.nn.Module):
    """Multi-head self-attention over a sequence split across the ranks of `hx`'s group."""

    def __init__(self, hx: ulysses.HeadExchange, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.hx = hx
        self.heads, self.head_dim = hx.num_heads, hx.head_dim
        assert self.heads * self.head_dim == hidden
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype)
        self.out = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, SL, hidden = x.shape
        H, D, HL = self.heads, self.head_dim, self.hx.local_heads
        qkv = self.qkv(x).view(B, SL, 3, H, D)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # strided views, [B, S_l, H, D]
        band = self.hx.scatter_qkv_head_chunk(q, k, v, 0, HL)  # [B, S_g, H_l, 3D], a slot view
        qb, kb, vb = (band[..., i * D:(i + 1) * D].transpose(1, 2) for i in range(3))
        o = F.scaled_dot_product_attention(qb, kb, vb)  # [B, H_l, S_g, D]
        # Read (on CUDA: the reads are enqueued on the current stream, and the session's next
        # call is ordered after that stream, so the slot is not overwritten before they ran).
        band.release()
        heads = self.hx.gather_heads(o.transpose(1, 2))  # [B, S_l, H, D], a slot view
        y = self.out(heads.reshape(B, SL, hidden))
        heads.release()
        return y


def reference(layer: SequenceParallelAttention, x_full: torch.Tensor) -> torch.Tensor:
    """The same layer in one process over the whole sequence, in float32."""
    B, S, hidden = x_full.shape
    H, D = layer.heads, layer.head_dim
    w_qkv = layer.qkv.weight.float()
    w_out = layer.out.weight.float()
    qkv = (x_full.float() @ w_qkv.T).view(B, S, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, hidden)
    return o @ w_out.T


def rank_main(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)  # for the socket exchange
    try:
        device = torch.device("cpu")
        if args.device == "cuda":
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)  # before connecting: the slots are mapped on it
            torch.backends.cuda.matmul.allow_tf32 = False  # the float32 bound assumes IEEE
            torch.backends.cudnn.allow_tf32 = False
        sock = os.environ.get("ULYSSES_SOCKET") or (
            os.path.join(args.socket_dir, "gpu%d.sock" % local_rank) if args.socket_dir else None)
        dtype = DTYPES[args.dtype]
        B, SL = args.batch, args.seq_local
        hidden = args.heads * args.head_dim
        with ulysses.connect(sock, device=local_rank, name="sp-attention-rank%d" % rank) as client:
            group = client.join_torch_group()  # sockets exchanged through torch.distributed
            hx = client.head_exchange(group, args.heads, args.head_dim, args.dtype,
                                      max_tokens=B * SL)
            torch.manual_seed(0)  # the same weights and inputs on every rank
            layer = SequenceParallelAttention(hx, hidden, dtype).to(device)
            worst = 0.0
            for step in range(args.steps):
                x_full = torch.randn(B, world * SL, hidden).to(dtype).to(device)
                y = layer(x_full[:, rank * SL:(rank + 1) * SL])
                want = reference(layer, x_full)[:, rank * SL:(rank + 1) * SL]
                worst = max(worst, (y.float() - want).abs().max().item())
            ok = worst <= TOLERANCE[args.dtype]
            print("rank %d/%d: %s (%s backend), %d steps, max |error| %.3g (tolerance %g) %s" % (
                rank, world, device, hx.backend, args.steps, worst, TOLERANCE[args.dtype],
                "ok" if ok else "FAILED"), flush=True)
            hx.close()
        oks = [None] * world
        dist.all_gather_object(oks, ok)
        return 0 if all(oks) else 1
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_ulyssesd(given: Optional[str]) -> str:
    """--ulyssesd, $ULYSSESD, ulyssesd on PATH, or this checkout's build/daemon/ulyssesd."""
    checkout = Path(__file__).resolve().parent.parent.parent
    for c in (given, os.environ.get("ULYSSESD"), shutil.which("ulyssesd"),
              str(checkout / "build/daemon/ulyssesd")):
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("sp_attention: no ulyssesd found; pass --ulyssesd PATH")


def launch(args: argparse.Namespace) -> int:
    """Starts W daemons and W rank processes (torchrun-style environment), waits for them."""
    ulyssesd = find_ulyssesd(args.ulyssesd)
    backend, gpus = "host", 0
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            sys.exit("sp_attention: --device cuda, but torch sees no CUDA device")
        backend = "nvlink"
    run_dir = tempfile.mkdtemp(prefix="sp-attention-")
    daemons: List[subprocess.Popen] = []
    try:
        for r in range(args.world_size):
            ready = os.path.join(run_dir, "gpu%d.ready" % r)
            log = open(os.path.join(run_dir, "gpu%d.log" % r), "wb")
            daemons.append(subprocess.Popen(
                [ulyssesd, "--device", str(r % gpus if gpus else r), "--socket",
                 os.path.join(run_dir, "gpu%d.sock" % r), "--backend", backend,
                 "--ready-file", ready], stdout=log, stderr=subprocess.STDOUT))
            log.close()
            deadline = time.monotonic() + 20
            while not os.path.exists(ready):  # renamed into place once the daemon serves
                if daemons[-1].poll() is not None or time.monotonic() > deadline:
                    sys.exit("sp_attention: ulyssesd for rank %d did not start (see %s)" % (
                        r, os.path.join(run_dir, "gpu%d.log" % r)))
                time.sleep(0.01)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(args.world_size))
        env.pop("ULYSSES_SOCKET", None)
        argv = [sys.executable, os.path.abspath(__file__), "--socket-dir", run_dir,
                "--heads", str(args.heads), "--head-dim", str(args.head_dim),
                "--batch", str(args.batch), "--seq-local", str(args.seq_local),
                "--steps", str(args.steps), "--dtype", args.dtype, "--device", args.device]
        ranks = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(args.world_size)]
        codes = [p.wait() for p in ranks]
        ok = all(c == 0 for c in codes)
        print("sp_attention: W=%d B=%d S_l=%d H=%d D=%d %s on %s: %s" % (
            args.world_size, args.batch, args.seq_local, args.heads, args.head_dim, args.dtype,
            args.device,
            "every rank matches the single-process reference" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        for d in daemons:
            d.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks when run alone (W)")
    p.add_argument("--heads", type=int, default=8, help="H, a multiple of W")
    p.add_argument("--head-dim", type=int, default=16, help="D")
    p.add_argument("--batch", type=int, default=2, help="B")
    p.add_argument("--seq-local", type=int, default=32, help="S_l: tokens per rank")
    p.add_argument("--steps", type=int, default=3, help="layer calls per rank")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: CPU tensors, host backend; cuda: CUDA tensors, GPU backend")
    p.add_argument("--ulyssesd", help="ulyssesd to start when run alone")
    p.add_argument("--socket-dir", help="folder of the daemons' sockets gpu<LOCAL_RANK>.sock")
    args = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return rank_main(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
