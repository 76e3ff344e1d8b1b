"""The fused session (qkv_norm_rope_exchange) driven from Python through real daemons of the
host backend: every rank's head band against the numpy reference of helpers.FusedProblem at
atol = rtol = 1e-2 (one-ulp flips counted), both layouts, W = 1 and 2, out= inside and outside
shared buffers, results sharing one slot and released on drop, submit/wait through the rings,
and bad arguments."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import ulysses
from helpers import FusedProblem, compare_bf16, run_ranks, same_bits, unique

B, SL, H, D, MAX_POS = 2, 7, 4, 16, 64


def open_fused(sockets, p: FusedProblem, layout: str, num_slots: int = 2, **kw):
    """One client and one fused session per rank."""
    W = len(sockets)
    name = unique("fused")

    def rank(r):
        c = ulysses.connect(sockets[r], name="test-fused%d" % r, use_rings=r % 2 == 0)
        g = c.join_group(name, r, W, members=sockets)
        sess = c.qkv_norm_rope_exchange(
            g, num_heads=p.heads, head_dim=p.head_dim, layout=layout,
            max_tokens=p.batch * p.seq_local, num_slots=num_slots, w_qkv=p.w_qkv,
            q_norm=p.q_norm, k_norm=p.k_norm, cos_sin=p.cos_sin, **kw)
        return c, sess

    return run_ranks(W, rank)


def close_all(ranks):
    for c, sess in ranks:
        sess.close()
        c.close()


@pytest.mark.parametrize("W,layout", [(1, "bshd"), (1, "fused"), (2, "bshd"), (2, "fused")])
def test_every_rank_gets_its_band_of_the_reference(sockets, W, layout):
    p = FusedProblem(W, H, D, B, SL, MAX_POS, seed=10 + W)
    ranks = open_fused(sockets[:W], p, layout, num_slots=3)
    try:
        def body(r):
            c, sess = ranks[r]
            assert sess.backend == "host" and sess.local_heads == H // W
            got = sess(p.x[r], p.positions[r])
            hl, sg = H // W, W * SL
            if layout == "bshd":
                assert isinstance(got, tuple) and len(got) == 3
                for t in got:
                    assert isinstance(t, ulysses.SlotArray) and t.held and t.epoch == 1
                    assert t.shape == (B, sg, hl, D)
                band = np.stack([np.array(t) for t in got])
            else:
                assert isinstance(got, ulysses.SlotArray) and got.shape == (B, sg, hl, 3 * D)
                band = np.array(got)
            # out= in a shared buffer (written by the daemon) and in a plain array (copied).
            shared = c.empty(sess.out_shape(B, SL), "bfloat16")
            copied = sess(p.x[r], p.positions[r], out=shared)
            plain = np.zeros(sess.out_shape(B, SL), np.uint16)
            sess(p.x[r], p.positions[r], out=plain)
            if layout == "bshd":
                assert all(v.base is not None for v in copied) and copied[1].shape == (B, sg, hl, D)
            else:
                assert copied is shared
            # The first result was held all along: the later calls used the other slots.
            held = np.stack([np.array(t) for t in got]) if layout == "bshd" else np.array(got)
            assert same_bits(held, band)
            return band, np.array(shared), plain, sess.describe()
        out = run_ranks(W, body)
        for r in range(W):
            band, shared, plain, described = out[r]
            want = p.expected(r, layout)
            mismatches, flips = compare_bf16(band, want)
            print("W=%d %s rank %d: %d elements, %d mismatches, %d one-ulp flips"
                  % (W, layout, r, want.size, mismatches, flips))
            assert mismatches == 0 and flips <= want.size // 100
            assert same_bits(shared, band) and same_bits(plain, band)
            assert "reference" in described
    finally:
        close_all(ranks)


def test_cpu_torch_tensors_as_weights_and_inputs(sockets):
    torch = pytest.importorskip("torch")
    p = FusedProblem(1, H, D, B, SL, MAX_POS, seed=3)
    bits = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)  # noqa: E731
    c = ulysses.connect(sockets[0])
    g = c.join_group(unique("fused-torch"), 0, 1)
    with c, c.qkv_norm_rope_exchange(g, num_heads=H, head_dim=D, layout="fused",
                                     max_tokens=B * SL, w_qkv=bits(p.w_qkv),
                                     q_norm=bits(p.q_norm), k_norm=bits(p.k_norm),
                                     cos_sin=torch.from_numpy(p.cos_sin)) as sess:
        got = sess(bits(p.x[0]), torch.from_numpy(p.positions[0]))
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
        mismatches, _ = compare_bf16(got.view(torch.int16).numpy().view(np.uint16),
                                     p.expected(0, "fused"))
        assert mismatches == 0


def test_strided_and_unaligned_inputs_are_staged(sockets):
    p = FusedProblem(1, H, D, B, SL, MAX_POS, seed=5)
    c = ulysses.connect(sockets[0])
    g = c.join_group(unique("fused-staged"), 0, 1)
    with c, c.qkv_norm_rope_exchange(g, num_heads=H, head_dim=D, layout="bshd",
                                     max_tokens=B * SL, w_qkv=p.w_qkv, q_norm=p.q_norm,
                                     k_norm=p.k_norm, cos_sin=p.cos_sin) as sess:
        # x in a shared buffer but 2 bytes off the 32-byte alignment, positions strided.
        room = c.empty((B * SL * H * D + 1,), "bfloat16")
        x = room[1:].reshape(B, SL, H * D)
        x[...] = p.x[0]
        wide = np.zeros((B, SL, 2), np.int32)
        wide[..., 0] = p.positions[0]
        q, k, v = sess(x, wide[..., 0])
        want = p.expected(0, "bshd")
        assert compare_bf16(np.stack([q, k, v]), want)[0] == 0


def test_a_call_holds_one_slot_until_every_view_is_gone(cluster):
    sock, = cluster.start(1, ["--call-timeout-ms", "300"])
    p = FusedProblem(1, H, D, B, SL, MAX_POS, seed=7)
    (c, sess), = open_fused([sock], p, "bshd", num_slots=1)
    try:
        q, k, v = sess(p.x[0], p.positions[0])
        want = np.array(v)
        del q, k
        gc.collect()
        with pytest.raises(ulysses.DeadlineExceededError, match="release it"):
            sess(p.x[0], p.positions[0])  # v still holds the slot
        assert same_bits(v, want)
        del v
        gc.collect()
        q, k, v = sess(p.x[0], p.positions[0])  # dropped: released
        assert same_bits(v, want) and q.held
        ulysses.release(k)  # one release gives the slot back for all three
        assert not q.held and not k.held and not v.held
        out = np.empty(sess.out_shape(B, SL), np.uint16)
        for _ in range(2):
            q2, _, _ = sess(p.x[0], p.positions[0], out=out)  # out= holds nothing
        assert same_bits(out[2], want) and not isinstance(q2, ulysses.SlotArray)
        r = sess(p.x[0], p.positions[0])
        sess.release_all()
        assert not r[0].held
    finally:
        close_all([(c, sess)])


@pytest.mark.parametrize("layout", ["bshd", "fused"])
def test_last_outputs_gives_the_last_result_while_it_is_held(cluster, layout):
    sock, = cluster.start(1)
    p = FusedProblem(1, H, D, B, SL, MAX_POS, seed=9)
    (c, sess), = open_fused([sock], p, layout, num_slots=2)
    try:
        with pytest.raises(ulysses.FailedPreconditionError, match="no call"):
            sess.last_outputs()
        got = sess(p.x[0], p.positions[0])
        views = got if layout == "bshd" else (got,)
        want = [np.array(v) for v in views]
        again = sess.last_outputs()
        again = again if layout == "bshd" else (again,)
        assert len(again) == len(want)
        assert all(same_bits(a, w) and a.held for a, w in zip(again, want))
        # The call's own views dropped, the ones last_outputs gave still hold the slot.
        del got, views
        gc.collect()
        third = sess.last_outputs()
        third = third if layout == "bshd" else (third,)
        assert same_bits(third[-1], want[-1])
        ulysses.release(again[0])  # given back for every view
        with pytest.raises(ulysses.FailedPreconditionError, match="epoch 1 was given back"):
            sess.last_outputs()
        del again, third
        gc.collect()
        # A call into out=: the out, split as the call returned it.
        out = np.empty(sess.out_shape(B, SL), np.uint16)
        sess(p.x[0], p.positions[0], out=out)
        last = sess.last_outputs()
        if layout == "bshd":
            assert len(last) == 3 and all(np.shares_memory(a, out) for a in last)
            assert same_bits(last[2], want[2])
        else:
            assert last is out and same_bits(out, want[0])
        # Every view of a result dropped: given back, and refused.
        r = sess(p.x[0], p.positions[0])
        del r
        gc.collect()
        with pytest.raises(ulysses.FailedPreconditionError, match="epoch 3 was given back"):
            sess.last_outputs()
    finally:
        close_all([(c, sess)])


@pytest.mark.parametrize("layout", ["bshd", "fused"])
def test_submitted_calls_give_what_the_call_gives(sockets, layout):
    """submit/wait through the rings: three calls queued at once (a view, out= in a shared
    buffer, out= in a plain array, x staged), waited in order, bit for bit the synchronous
    call's results and the reference's band."""
    W = 2
    p = FusedProblem(W, H, D, B, SL, MAX_POS, seed=20 + len(layout))
    name = unique("fused-submit")

    def rank(r):
        c = ulysses.connect(sockets[r], name="test-fused-submit%d" % r)
        g = c.join_group(name, r, W, members=sockets[:W])
        with c, c.qkv_norm_rope_exchange(
                g, num_heads=H, head_dim=D, layout=layout, max_tokens=B * SL, num_slots=3,
                w_qkv=p.w_qkv, q_norm=p.q_norm, k_norm=p.k_norm, cos_sin=p.cos_sin) as sess:
            want_sync = sess(p.x[r], p.positions[r])
            want = np.stack(want_sync) if layout == "bshd" else np.array(want_sync)
            del want_sync  # its slot is free again
            shared = c.empty(sess.out_shape(B, SL), "bfloat16")
            plain = np.zeros(sess.out_shape(B, SL), np.uint16)
            room = np.zeros(B * SL * H * D + 1, np.uint16)  # x off its alignment: staged
            x = room[1:].reshape(B, SL, H * D)
            x[...] = p.x[r]
            pending = [sess.submit(x, p.positions[r]),
                       sess.submit(p.x[r], p.positions[r], out=shared),
                       sess.submit(p.x[r], p.positions[r], out=plain)]
            assert [q.epoch for q in pending] == [2, 3, 4] and not pending[0].done
            got = [q.wait() for q in pending]
            assert all(q.done for q in pending)
            with pytest.raises(ulysses.FailedPreconditionError, match="already waited"):
                pending[0].wait()
            view = np.stack(got[0]) if layout == "bshd" else np.array(got[0])
            if layout == "bshd":
                assert all(t.held and t.epoch == 2 for t in got[0])
                assert got[1][0].base is not None and got[2][2].shape == (B, W * SL, H // W, D)
            else:
                assert got[0].held and got[1] is shared and got[2] is plain
            return want, view, np.array(shared), plain

    out = run_ranks(W, rank)
    for r in range(W):
        want, view, shared, plain = out[r]
        assert same_bits(view, want) and same_bits(shared, want) and same_bits(plain, want)
        assert compare_bf16(want, p.expected(r, layout))[0] == 0


def test_submit_needs_the_rings(sockets):
    p = FusedProblem(1, H, D, B, SL, MAX_POS, seed=4)
    c = ulysses.connect(sockets[0], use_rings=False)
    g = c.join_group(unique("fused-norings"), 0, 1)
    with c, c.qkv_norm_rope_exchange(g, num_heads=H, head_dim=D, layout="fused",
                                     max_tokens=B * SL, w_qkv=p.w_qkv, q_norm=p.q_norm,
                                     k_norm=p.k_norm, cos_sin=p.cos_sin) as sess:
        with pytest.raises(ulysses.UnimplementedError, match="rings"):
            sess.submit(p.x[0], p.positions[0])
        assert sess(p.x[0], p.positions[0]).epoch == 1  # the refusal used no epoch


def test_bad_arguments_name_the_argument(sockets):
    p = FusedProblem(1, H, D, B, SL, MAX_POS, seed=9)
    c = ulysses.connect(sockets[0])
    g = c.join_group(unique("fused-bad"), 0, 1)
    weights = dict(w_qkv=p.w_qkv, q_norm=p.q_norm, k_norm=p.k_norm, cos_sin=p.cos_sin)
    make = lambda **kw: c.qkv_norm_rope_exchange(  # noqa: E731
        g, **{**dict(num_heads=H, head_dim=D, max_tokens=B * SL, **weights), **kw})
    with c:
        for kw, match in [
                (dict(layout="bhsd"), "^layout: 'bhsd'"),
                (dict(path="fast"), "^path: 'fast'"),
                (dict(w_qkv=None), "^w_qkv: must not be None"),
                (dict(w_qkv=p.w_qkv[:-1]), "^w_qkv: shape"),
                (dict(q_norm=p.q_norm.astype(np.float32)), "^q_norm: dtype float32, want bfloat16"),
                (dict(cos_sin=p.cos_sin.astype(np.float16)), "^cos_sin: dtype"),
                (dict(hidden=H * D + 64), "hidden"),
                (dict(head_dim=D + 1, hidden=H * (D + 1)), "head_dim|w_qkv"),
                (dict(num_slots=9), "num_slots"),
                (dict(max_tokens=0), "max_tokens")]:
            with pytest.raises(ValueError, match=match):
                make(**kw)
        with pytest.raises(TypeError, match="^k_norm: expected a numpy array"):
            make(k_norm=[1.0] * D)
        with make() as sess:
            x, pos = p.x[0], p.positions[0]
            for args, kw, match in [
                    ((x[..., :-16], pos), {}, "^x: shape"),
                    ((x.astype(np.float32), pos), {}, "^x: dtype float32 is not the session's"),
                    ((x[0], pos[0]), {}, "^x: ndim 2"),
                    ((x, pos.astype(np.int64)), {}, "^positions: dtype int64, want int32"),
                    ((x, pos[:, :-1]), {}, "^positions: shape"),
                    ((x, np.full_like(pos, MAX_POS)), {}, r"positions\[0\]"),
                    ((x, pos), dict(out=np.empty((B, SL, H, 3 * D), np.uint16)), "^out: shape"),
                    ((x, pos), dict(out=np.empty(sess.out_shape(B, SL), np.float32)),
                     "^out: dtype")]:
                with pytest.raises(ValueError, match=match):
                    sess(*args, **kw)
            big = np.zeros((B, SL + 1, H * D), np.uint16)
            with pytest.raises(ulysses.ResourceExhaustedError, match="max_tokens"):
                sess(big, np.zeros((B, SL + 1), np.int32))
            # The refused calls used no epoch.
            assert sess(x, pos)[0].epoch == 1


def test_a_head_exchange_session_is_not_a_fused_one(sockets):
    c = ulysses.connect(sockets[0])
    g = c.join_group(unique("fused-kind"), 0, 1)
    with c, c.head_exchange(g, 2, 2, "bfloat16", 4) as hx:
        from ulysses import _capi
        args = _capi.new(_capi.FusedCallArgs)
        assert _capi.library().uly_session_qkv_norm_rope_exchange(
            hx._handle.ptr, args, None, None) == _capi.INVALID_ARGUMENT
        assert "head_exchange session" in _capi.library().uly_last_error().decode()
        assert hx.describe()
