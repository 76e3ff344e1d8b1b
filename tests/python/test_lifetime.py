"""Results hold their receive slot until released or dropped; several client processes share
one daemon."""
from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ulysses
from ulysses import _capi, _torch
from helpers import unique

X = np.arange(16, dtype=np.float32).reshape(1, 4, 2, 2)


@pytest.fixture
def one_slot(cluster):
    """A session with a single receive slot on a daemon whose calls wait at most 300 ms for a
    held slot: a call while the last result is still held fails with DEADLINE_EXCEEDED."""
    sock, = cluster.start(1, ["--call-timeout-ms", "300"])
    c = ulysses.connect(sock)
    g = c.join_group(unique(), 0, 1)
    hx = c.head_exchange(g, 2, 2, "float32", 4, num_slots=1)
    yield hx
    hx.close()
    c.close()


def test_a_held_result_blocks_its_slot_until_released(one_slot):
    hx = one_slot
    r = hx.scatter_heads(X)
    assert r.held
    with pytest.raises(ulysses.DeadlineExceededError, match="release it"):
        hx.scatter_heads(X)
    r.release()
    r.release()  # idempotent
    assert not r.held
    r2 = hx.scatter_heads(X)  # the refused call used no epoch
    assert r2.epoch == 2 and np.array_equal(r2, X)
    ulysses.release(r2)
    assert not r2.held


def test_dropping_the_last_view_releases_the_slot(one_slot):
    hx = one_slot
    r = hx.scatter_heads(X)
    view = r[0, 1:]  # a view keeps the result alive
    assert isinstance(view, ulysses.SlotArray) and view.held
    del r
    gc.collect()
    with pytest.raises(ulysses.DeadlineExceededError):
        hx.scatter_heads(X)
    assert np.array_equal(view, X[0, 1:])
    del view
    gc.collect()
    assert np.array_equal(hx.scatter_heads(X), X)  # dropped at once: released again


class _DlpackExport:
    """A DLManagedTensor pointer as an object np.from_dlpack takes (a host result: kDLCPU)."""

    def __init__(self, managed: int):
        self.managed = managed

    def __dlpack__(self, **_kwargs):
        return _torch._dltensor_capsule(self.managed)

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def _export(result) -> int:
    lib = _capi.library()
    managed = ctypes.c_void_p()
    status = lib.uly_result_to_dlpack(result._slot._handles[0].ptr, ctypes.byref(managed))
    assert status == 0, lib.uly_last_error()
    return managed.value


def test_a_dlpack_export_holds_the_slot_until_its_consumer_deletes_it(one_slot):
    hx = one_slot
    r = hx.scatter_heads(X)
    a = np.from_dlpack(_DlpackExport(_export(r)))
    assert a.shape == X.shape and a.dtype == np.float32 and np.array_equal(a, X)
    del r
    gc.collect()  # the handle is freed, the export still holds the slot
    with pytest.raises(ulysses.DeadlineExceededError, match="release it"):
        hx.scatter_heads(X)
    del a
    gc.collect()  # numpy ran the tensor's deleter: the last reference released the slot
    r = hx.scatter_heads(X)
    assert np.array_equal(r, X)
    # An export nobody took, given back: the handle alone holds the slot again.
    ulysses_free = _capi.library().uly_dlpack_free
    ulysses_free(_export(r))
    with pytest.raises(ulysses.DeadlineExceededError):
        hx.scatter_heads(X)
    r.release()
    managed = ctypes.c_void_p()
    lib = _capi.library()
    assert lib.uly_result_to_dlpack(r._slot._handles[0].ptr, ctypes.byref(managed)) == 9
    assert b"holds no slot" in lib.uly_last_error() and not managed.value
    assert lib.uly_result_to_dlpack(None, ctypes.byref(managed)) == 3
    assert np.array_equal(hx.scatter_heads(X), X)


def test_out_holds_no_slot(one_slot):
    hx = one_slot
    out = np.empty_like(X)
    for _ in range(3):
        assert hx.scatter_heads(X, out=out) is out
    assert np.array_equal(out, X)


def test_release_all_and_session_close(one_slot):
    hx = one_slot
    r = hx.scatter_heads(X)
    hx.release_all()
    assert not r.held
    kept = hx.scatter_heads(X)
    hx.close()
    assert np.array_equal(kept, X)  # a live result stays readable after its session closed
    with pytest.raises(ulysses.FailedPreconditionError, match="closed"):
        hx.scatter_heads(X)


def test_results_are_read_only(one_slot):
    r = one_slot.scatter_heads(X)
    with pytest.raises(ValueError):
        r[0, 0, 0, 0] = 1.0


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import ulysses
    sock, name, seed, group_size, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        int(sys.argv[4]), int(sys.argv[5])
    rng = np.random.default_rng(seed)
    with ulysses.connect(sock, name="child%d" % seed) as c:
        g = c.join_group(name, rank, group_size, members=[sock] * group_size)
        hx = c.head_exchange(g, 2 * group_size, 3, "float32", 8)
        for i in range(20):
            x = rng.standard_normal((2, 4, 2 * group_size, 3)).astype(np.float32)
            band = hx.scatter_heads(x)
            back = hx.gather_heads(np.array(band))
            band.release()
            assert np.array_equal(back, x), "round trip differs at call %d" % i
            assert back.epoch == 2 * i + 2
            back.release()  # the next gather_heads needs its slot
    print("child ok", c.id)
""")


def spawn(args):
    env = dict(os.environ)
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out)
    return outs


def test_two_client_processes_share_one_daemon(sockets):
    # Each process has its own group of one on the same daemon; their calls interleave.
    procs = [spawn([sockets[2], unique(), seed, 1, 0]) for seed in (1, 2)]
    outs = finish(procs)
    ids = {o.split()[-1] for o in outs}
    assert len(ids) == 2 and all(o.startswith("child ok") for o in outs)


def test_two_processes_form_one_group_on_one_daemon(sockets):
    # Two ranks of one group whose members are the same daemon (ranks sharing a GPU).
    name = unique()
    procs = [spawn([sockets[2], name, 3 + r, 2, r]) for r in (0, 1)]
    finish(procs)


def test_a_rank_that_leaves_its_group_ends_the_other_ranks_next_session(sockets):
    # Rank 1 leaves once its session is closed; rank 0's next session of the group is ABORTED
    # naming it at once, not at the minute's rendezvous timeout.
    from helpers import run_ranks
    name = unique()
    clients = [ulysses.connect(sockets[r]) for r in (0, 1)]
    try:
        groups = run_ranks(2, lambda r: clients[r].join_group(name, r, 2, members=sockets[:2]))
        sessions = run_ranks(2, lambda r: clients[r].head_exchange(groups[r], 2, 2, "float32", 4))
        with pytest.raises(ulysses.FailedPreconditionError, match="still has session"):
            groups[1].leave()
        for s in sessions:
            s.close()
        groups[1].leave()
        with pytest.raises(ulysses.NotFoundError):
            groups[1].leave()
        with pytest.raises(ulysses.AbortedError, match="rank 1 left the group"):
            clients[0].head_exchange(groups[0], 2, 2, "float32", 4, timeout=60)
    finally:
        for c in clients:
            c.close()
