"""The four ops driven from Python through real daemons, checked bit for bit against numpy
references, for numpy inputs inside and outside shared buffers, strided views and out=."""
from __future__ import annotations

import numpy as np
import pytest

import ulysses
from helpers import (random_array, ref_gather_heads, ref_gather_output_head_chunk,
                     ref_scatter_heads, ref_scatter_qkv_head_chunk, run_ranks, same_bits, unique)


def open_ranks(sockets, num_heads, head_dim, dtype, max_tokens, num_slots=2, schedule=None,
               use_rings=True):
    """One client and one session per rank (each rank's daemon is sockets[rank])."""
    W = len(sockets)
    name = unique()

    def rank(r):
        c = ulysses.connect(sockets[r], name="test-rank%d" % r, use_rings=use_rings)
        g = c.join_group(name, r, W, members=sockets)
        hx = c.head_exchange(g, num_heads, head_dim, dtype, max_tokens, num_slots=num_slots,
                             schedule=schedule)
        return c, hx

    return run_ranks(W, rank)


def close_ranks(ranks):
    for c, hx in ranks:
        hx.close()
        c.close()


@pytest.mark.parametrize("W,dtype", [(1, "float32"), (2, "float32"), (2, "float16"),
                                     (3, "bfloat16")])
def test_scatter_then_gather_match_the_reference(sockets, W, dtype):
    B, SL, D = 2, 5, 4
    H = 2 * W
    rng = np.random.default_rng(W)
    xs = [random_array(rng, (B, SL, H, D), dtype) for _ in range(W)]
    ranks = open_ranks(sockets[:W], H, D, dtype, B * SL)
    try:
        def body(r):
            _, hx = ranks[r]
            band = hx.scatter_heads(xs[r])
            assert isinstance(band, ulysses.SlotArray) and band.held and band.epoch == 1
            got_band = np.array(band)
            band.release()
            back = np.array(hx.gather_heads(got_band))
            return got_band, back
        out = run_ranks(W, body)
        bands = [o[0] for o in out]
        for r in range(W):
            assert same_bits(bands[r], ref_scatter_heads(xs, r))
            assert same_bits(out[r][1], ref_gather_heads(bands, r))
            assert same_bits(out[r][1], xs[r])  # gather_heads inverts scatter_heads
    finally:
        close_ranks(ranks)


def test_shared_buffers_strided_views_and_out(sockets):
    W, B, SL, H, D = 2, 1, 3, 4, 6
    rng = np.random.default_rng(7)
    wide = [random_array(rng, (B, SL, H, 2 * D), "float32") for _ in range(W)]
    xs = [w[..., :D] for w in wide]  # positive-stride views, not contiguous
    ranks = open_ranks(sockets[:W], H, D, "float32", B * SL)
    try:
        def body(r):
            c, hx = ranks[r]
            # The same view, once inside a shared buffer of the client (passed as it is).
            shared = c.empty((B, SL, H, 2 * D), "float32")
            shared[...] = wide[r]
            a = np.array(hx.scatter_heads(shared[..., :D]))
            # ... and once outside (copied into a staging buffer).
            b = np.array(hx.scatter_heads(xs[r]))
            # out= into a shared buffer: written there, no slot held, out returned.
            out_shared = c.empty((B, W * SL, H // W, D), "float32")
            got = hx.scatter_heads(xs[r], out=out_shared)
            assert got is out_shared
            # out= into a plain array, strided too.
            out_plain = np.full((B, W * SL, H // W, 2 * D), np.nan, np.float32)
            got = hx.scatter_heads(shared[..., :D], out=out_plain[..., D:])
            assert np.isnan(out_plain[..., :D]).all()
            return a, b, np.array(out_shared), out_plain[..., D:].copy()
        out = run_ranks(W, body)
        for r in range(W):
            want = ref_scatter_heads(xs, r)
            for got in out[r]:
                assert same_bits(got, want)
    finally:
        close_ranks(ranks)


@pytest.mark.parametrize("use_rings", [True, False])
def test_head_chunks_write_only_their_band(sockets, use_rings):
    W, B, SL, D = 3, 2, 2, 3
    schedule = [1, 2, 1]
    H = W * sum(schedule)
    rng = np.random.default_rng(11)
    # q, k, v: strided views of one [B, S_l, H, 3, D] array per rank.
    qkv = [random_array(rng, (B, SL, H, 3, D), "float32") for _ in range(W)]
    qs = [a[:, :, :, 0, :] for a in qkv]
    ks = [a[:, :, :, 1, :] for a in qkv]
    vs = [a[:, :, :, 2, :] for a in qkv]
    ranks = open_ranks(sockets[:W], H, D, "float32", B * SL, schedule=schedule,
                       use_rings=use_rings)
    try:
        assert ranks[0][1].head_chunks() == [(0, 1), (1, 2), (3, 1)]

        def body(r):
            _, hx = ranks[r]
            chunks, outs = [], []
            for offset, count in hx.head_chunks():
                chunk = hx.scatter_qkv_head_chunk(qs[r], ks[r], vs[r], offset, count)
                assert chunk.shape == (B, W * SL, count, 3 * D)
                chunks.append(np.array(chunk))
                del chunk  # dropping the view releases its slot
                x = np.ascontiguousarray(chunks[-1][..., :D])  # "attention" output: Q
                out = np.full((B, SL, H, D), np.nan, np.float32)
                got = hx.gather_output_head_chunk(x, offset, count, out=out)
                assert got is out
                outs.append((x, out))
            return chunks, outs
        res = run_ranks(W, body)
        for i, (offset, count) in enumerate(ranks[0][1].head_chunks()):
            xs = [res[p][1][i][0] for p in range(W)]
            for r in range(W):
                assert same_bits(res[r][0][i], ref_scatter_qkv_head_chunk(qs, ks, vs, r, offset,
                                                                          count))
                nan = np.full((B, SL, H, D), np.nan, np.float32)
                # Heads outside the band stay NaN: the reference leaves them untouched too.
                assert same_bits(res[r][1][i][1], ref_gather_output_head_chunk(xs, r, offset,
                                                                               count, nan))
    finally:
        close_ranks(ranks)


def test_gather_output_head_chunk_into_a_shared_out_keeps_other_heads(sockets):
    W, B, SL, H, D = 2, 1, 2, 4, 2
    rng = np.random.default_rng(3)
    xs = [random_array(rng, (B, W * SL, 1, D), "float32") for _ in range(W)]
    ranks = open_ranks(sockets[:W], H, D, "float32", B * SL)
    try:
        def body(r):
            c, hx = ranks[r]
            out = c.empty((B, SL, H, D), "float32")
            out[...] = -1.0
            hx.gather_output_head_chunk(xs[r], 1, 1, out)
            return np.array(out)
        res = run_ranks(W, body)
        for r in range(W):
            before = np.full((B, SL, H, D), -1.0, np.float32)
            assert same_bits(res[r], ref_gather_output_head_chunk(xs, r, 1, 1, before))
    finally:
        close_ranks(ranks)


def test_poisoned_slots_tell_fresh_results_from_stale(sockets):
    (c, hx), = open_ranks(sockets[:1], 2, 2, "float32", 4, num_slots=2)
    try:
        x = np.ones((1, 4, 2, 2), np.float32)
        assert hx.poison_slots() == 2
        r = hx.scatter_heads(x)
        assert same_bits(r, x)
        assert hx.poison_slots() == 1  # the held slot is left alone
        r.release()
    finally:
        hx.close()
        c.close()


def test_submitted_calls_complete_in_order_with_their_own_staging(sockets):
    W, B, SL, H, D = 2, 1, 3, 4, 2
    rng = np.random.default_rng(21)
    xs = [[random_array(rng, (B, SL, H, D), "float32") for _ in range(3)] for _ in range(W)]
    ranks = open_ranks(sockets[:W], H, D, "float32", B * SL, num_slots=4)
    try:
        def body(r):
            c, hx = ranks[r]
            # Three calls in flight at once from plain arrays: each is staged in its own buffer.
            pending = [hx.submit("scatter_heads", x) for x in xs[r]]
            assert [p.epoch for p in pending] == [1, 2, 3]
            got = [np.array(p.wait()) for p in reversed(pending)][::-1]
            assert all(p.done for p in pending)
            with pytest.raises(ulysses.FailedPreconditionError, match="already waited"):
                pending[0].wait()
            out = np.full((B, W * SL, H // W, D), np.nan, np.float32)
            assert hx.submit("scatter_heads", xs[r][0], out=out).wait() is out
            shared = c.empty((B, W * SL, H // W, D), "float32")
            assert hx.submit("scatter_heads", xs[r][1], out=shared).wait() is shared
            back = hx.submit("gather_heads", got[2]).wait()
            return got, out, np.array(shared), np.array(back)
        res = run_ranks(W, body)
        for r in range(W):
            got, out, shared, back = res[r]
            for i in range(3):
                assert same_bits(got[i], ref_scatter_heads([xs[j][i] for j in range(W)], r))
            assert same_bits(out, got[0]) and same_bits(shared, got[1])
            assert same_bits(back, xs[r][2])
    finally:
        close_ranks(ranks)


def test_submit_refuses_bad_arguments_and_needs_rings(sockets):
    (c, hx), = open_ranks(sockets[:1], 2, 2, "float32", 4, use_rings=False)
    try:
        x = np.ones((1, 4, 2, 2), np.float32)
        with pytest.raises(ValueError, match="^op: 'scatter'"):
            hx.submit("scatter", x)
        with pytest.raises(ValueError, match="^inputs: scatter_qkv_head_chunk takes 3"):
            hx.submit("scatter_qkv_head_chunk", x)
        with pytest.raises(ValueError, match="^out: gather_output_head_chunk needs out"):
            hx.submit("gather_output_head_chunk", x, head_count=1)
        with pytest.raises(ulysses.UnimplementedError, match="rings"):
            hx.submit("scatter_heads", x)
        assert same_bits(hx.scatter_heads(x), x)  # the session still works
    finally:
        hx.close()
        c.close()
