"""CPU torch tensors on the host backend, the torch.distributed group helper and the
example layer. Skipped when torch is not installed (CI does not install it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ulysses
from helpers import ref_gather_heads, ref_scatter_heads, run_ranks, same_bits, unique

torch = pytest.importorskip("torch", reason="torch is not installed")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples/python/sp_attention.py"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tensors_in_slot_tensors_out(sockets, dtype):
    W, B, SL, H, D = 2, 2, 3, 4, 5
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(B, SL, H, D, generator=g).to(dtype) for _ in range(W)]
    bits = [ulysses._torch.to_numpy(x) for x in xs]
    name = unique()

    def rank(r):
        with ulysses.connect(sockets[r]) as c:
            hx = c.head_exchange(c.join_group(name, r, W, members=sockets[:W]), H, D, dtype,
                                 B * SL)
            band = hx.scatter_heads(xs[r].transpose(1, 2).contiguous().transpose(1, 2))
            assert band.dtype == dtype and band.shape == (B, W * SL, H // W, D) and band.held
            doubled = band * 2  # operations give plain tensors
            assert type(doubled) is torch.Tensor
            got_band = ulysses._torch.to_numpy(band).copy()
            band.release()
            assert not band.held
            out = torch.full((B, SL, H, D), float("nan"), dtype=dtype)
            back = hx.gather_heads(torch.from_numpy(got_band).view(dtype) if dtype ==
                                   torch.bfloat16 else torch.from_numpy(got_band), out=out)
            assert back is out
            hx.close()
            return got_band, ulysses._torch.to_numpy(out).copy()

    res = run_ranks(W, rank)
    for r in range(W):
        assert same_bits(res[r][0], ref_scatter_heads(bits, r))
        assert same_bits(res[r][1], bits[r])
        assert same_bits(res[r][1], ref_gather_heads([x[0] for x in res], r))


def test_empty_gives_a_shared_tensor(sockets):
    with ulysses.connect(sockets[0]) as c:
        hx = c.head_exchange(c.join_group(unique(), 0, 1), 2, 2, "bfloat16", 4)
        x = c.empty((1, 4, 2, 2), torch.bfloat16)
        assert x.dtype == torch.bfloat16 and not x.any()
        x.copy_(torch.arange(16, dtype=torch.float32).view(1, 4, 2, 2))
        assert torch.equal(hx.scatter_heads(x), x)
        hx.close()


def test_a_host_session_refuses_cuda_tensors(sockets):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with ulysses.connect(sockets[0]) as c:
        hx = c.head_exchange(c.join_group(unique(), 0, 1), 2, 2, "float32", 4)
        expected = ulysses.InvalidArgumentError if ulysses.cuda_built() else \
            ulysses.FailedPreconditionError
        with pytest.raises(expected, match="^x: "):
            hx.scatter_heads(torch.zeros(1, 4, 2, 2, device="cuda"))
        with pytest.raises(ulysses.InvalidArgumentError, match="^out: a CUDA tensor, but"):
            hx.scatter_heads(torch.zeros(1, 4, 2, 2), out=torch.zeros(1, 4, 2, 2, device="cuda"))


def test_tensors_of_other_devices_are_refused(sockets):
    with ulysses.connect(sockets[0]) as c:
        hx = c.head_exchange(c.join_group(unique(), 0, 1), 2, 2, "float32", 4)
        with pytest.raises(ulysses.InvalidArgumentError, match="^x: a meta tensor"):
            hx.scatter_heads(torch.zeros(1, 4, 2, 2, device="meta"))


@pytest.mark.parametrize("world,extra", [(1, []), (2, []), (2, ["--dtype", "bfloat16"]),
                                         (3, ["--heads", "6", "--seq-local", "5"])])
def test_the_example_layer_matches_its_reference(world, extra):
    """examples/python/sp_attention.py run alone: its own daemons, torch.distributed (gloo)
    for the socket exchange, checked against the single-process reference on every rank."""
    p = subprocess.run([sys.executable, str(EXAMPLE), "--world-size", str(world), "--steps", "2",
                        "--ulyssesd", os.environ.get("ULYSSESD", ""), *extra],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "every rank matches the single-process reference" in p.stdout
    assert p.stdout.count(" ok\n") == world
