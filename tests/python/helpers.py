"""Helpers of the Python client tests: numpy references of the four ops (docs/api.md
section 2, written out index by index from the formulas), and running W ranks at once."""
from __future__ import annotations

import threading
import uuid
from typing import Callable, List

import numpy as np


def ref_scatter_heads(xs: List[np.ndarray], r: int) -> np.ndarray:
    """out_r[b, j*S_l+s, h, d] = x_j[b, s, r*H_l+h, d]."""
    W = len(xs)
    B, SL, H, D = xs[0].shape
    HL = H // W
    out = np.empty((B, W * SL, HL, D), xs[0].dtype)
    for j in range(W):
        for h in range(HL):
            out[:, j * SL:(j + 1) * SL, h, :] = xs[j][:, :, r * HL + h, :]
    return out


def ref_gather_heads(ys: List[np.ndarray], r: int) -> np.ndarray:
    """out_r[b, s, p*H_l+h, d] = y_p[b, r*S_l+s, h, d]."""
    W = len(ys)
    B, SG, HL, D = ys[0].shape
    SL = SG // W
    out = np.empty((B, SL, W * HL, D), ys[0].dtype)
    for p in range(W):
        for h in range(HL):
            out[:, :, p * HL + h, :] = ys[p][:, r * SL:(r + 1) * SL, h, :]
    return out


def ref_scatter_qkv_head_chunk(qs, ks, vs, r: int, offset: int, count: int) -> np.ndarray:
    """out_r[b, j*S_l+s, c, 0:D|D:2D|2D:3D] = q|k|v_j[b, s, r*H_l+offset+c, :]."""
    W = len(qs)
    B, SL, H, D = qs[0].shape
    HL = H // W
    out = np.empty((B, W * SL, count, 3 * D), qs[0].dtype)
    for j in range(W):
        rows = slice(j * SL, (j + 1) * SL)
        for c in range(count):
            head = r * HL + offset + c
            out[:, rows, c, 0:D] = qs[j][:, :, head, :]
            out[:, rows, c, D:2 * D] = ks[j][:, :, head, :]
            out[:, rows, c, 2 * D:3 * D] = vs[j][:, :, head, :]
    return out


def ref_gather_output_head_chunk(xs: List[np.ndarray], r: int, offset: int, count: int,
                                 out: np.ndarray) -> np.ndarray:
    """out_r[b, s, p*H_l+offset+c, d] = x_p[b, r*S_l+s, c, d]; other heads untouched."""
    W = len(xs)
    SL = xs[0].shape[1] // W
    HL = out.shape[2] // W
    out = out.copy()
    for p in range(W):
        for c in range(count):
            out[:, :, p * HL + offset + c, :] = xs[p][:, r * SL:(r + 1) * SL, c, :]
    return out


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Finite random values; bfloat16 as the uint16 bits of finite numbers."""
    if dtype == "bfloat16":
        f = rng.standard_normal(shape).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return rng.standard_normal(shape).astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality (NaN payloads included)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and \
        a.tobytes() == b.tobytes()


def unique(prefix: str = "g") -> str:
    return "%s-%s" % (prefix, uuid.uuid4().hex[:12])


def run_ranks(world: int, fn: Callable[[int], object]) -> list:
    """Runs fn(rank) for every rank in its own thread (the library releases the GIL while a
    call waits for the other ranks) and returns the results by rank; re-raises the first
    exception."""
    results: list = [None] * world
    errors: list = [None] * world

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # re-raised below, in the test's thread
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a rank did not finish within 120 s"
    for e in errors:
        if e is not None:
            raise e
    return results


# -- the fused op (docs/api.md section 2.1) ---------------------------------------------------

def bf16_bits(f: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (as the daemon's reference rounds)."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_float(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _round(f: np.ndarray) -> np.ndarray:
    return bf16_float(bf16_bits(f))


class FusedProblem:
    """Weights and every rank's inputs of one fused-session test, all bfloat16 as bits (the
    cos/sin table float32), deterministic in `seed`."""

    def __init__(self, world: int, heads: int, head_dim: int, batch: int, seq_local: int,
                 max_pos: int, seed: int):
        rng = np.random.default_rng(seed)
        self.world, self.heads, self.head_dim = world, heads, head_dim
        self.batch, self.seq_local, self.max_pos = batch, seq_local, max_pos
        self.hidden = heads * head_dim
        hd = self.hidden
        self.w_qkv = bf16_bits(rng.standard_normal((3 * hd, hd)).astype(np.float32) /
                               np.float32(np.sqrt(hd)))
        self.q_norm = bf16_bits(1 + 0.25 * rng.standard_normal(head_dim).astype(np.float32))
        self.k_norm = bf16_bits(1 + 0.25 * rng.standard_normal(head_dim).astype(np.float32))
        half = head_dim // 2
        inv = 10000.0 ** (-np.arange(half) * 2.0 / head_dim)
        angle = np.arange(max_pos)[:, None] * inv[None, :]
        self.cos_sin = np.concatenate([np.cos(angle), np.sin(angle)], axis=1).astype(np.float32)
        self.x = [bf16_bits(rng.standard_normal((batch, seq_local, hd)).astype(np.float32))
                  for _ in range(world)]
        self.positions = [rng.integers(0, max_pos, (batch, seq_local)).astype(np.int32)
                          for _ in range(world)]

    def local(self, src: int) -> np.ndarray:
        """Source rank `src`'s projection + norm + RoPE, float32 values of bfloat16 numbers,
        [B*S_l, 3, H, D]: fp32 math with bfloat16 rounding where section 2.1 puts it."""
        H, D = self.heads, self.head_dim
        x = bf16_float(self.x[src]).reshape(-1, self.hidden).astype(np.float64)
        w = bf16_float(self.w_qkv).astype(np.float64)
        qkv = _round((x @ w.T).astype(np.float32)).reshape(-1, 3, H, D)
        cs = self.cos_sin[self.positions[src].reshape(-1)]  # [T, D]
        c, s = cs[:, None, :D // 2], cs[:, None, D // 2:]
        for plane, norm in ((0, self.q_norm), (1, self.k_norm)):
            y = qkv[:, plane]  # [T, H, D]
            inv_rms = np.float32(1) / np.sqrt((y * y).sum(-1, keepdims=True, dtype=np.float32)
                                              / np.float32(D) + np.float32(1e-6))
            u = _round(_round(y * inv_rms) * bf16_float(norm))
            a, b = u[..., 0::2], u[..., 1::2]
            rot = np.empty_like(u)
            rot[..., 0::2] = _round(c * a - s * b)
            rot[..., 1::2] = _round(s * a + c * b)
            qkv[:, plane] = rot
        return qkv

    def expected(self, dst: int, layout: str) -> np.ndarray:
        """Rank `dst`'s result as bfloat16 bits: [3, B, S_g, H_l, D] (bshd: the q, k, v planes)
        or [B, S_g, H_l, 3D] (fused)."""
        W, B, SL, D = self.world, self.batch, self.seq_local, self.head_dim
        HL = self.heads // W
        band = np.empty((3, B, W * SL, HL, D), np.float32)
        for src in range(W):
            part = self.local(src).reshape(B, SL, 3, self.heads, D)
            band[:, :, src * SL:(src + 1) * SL] = np.moveaxis(
                part[:, :, :, dst * HL:(dst + 1) * HL], 2, 0)
        if layout == "fused":
            band = np.concatenate(list(band), axis=-1)
        return bf16_bits(band)


def _bf16_bound(w: np.ndarray, tol: float, rope_pairs: bool) -> np.ndarray:
    bound = tol + tol * np.abs(w)
    if rope_pairs:
        pairs = w.reshape(w.shape[:-1] + (w.shape[-1] // 2, 2))
        magnitude = np.sqrt((pairs.astype(np.float64) ** 2).sum(axis=-1))
        bound = bound + np.repeat(magnitude, 2, axis=-1).reshape(w.shape) * 2.0 ** -7
    return bound


def describe_bf16_mismatches(got: np.ndarray, want: np.ndarray, tol: float = 1e-2,
                             rope_pairs: bool = False, limit: int = 4) -> str:
    """The first `limit` elements of compare_bf16's mismatches: index, got, want, bound."""
    g = bf16_float(np.ascontiguousarray(got).view(np.uint16))
    w = bf16_float(np.ascontiguousarray(want).view(np.uint16))
    bound = _bf16_bound(w, tol, rope_pairs)
    bad = np.argwhere(np.abs(g - w) > bound)[:limit]
    return "; ".join("at %s got %r want %r bound %.4g" % (tuple(int(i) for i in at), float(g[tuple(at)]),
                                                        float(w[tuple(at)]), float(bound[tuple(at)]))
                     for at in bad)


def compare_bf16(got: np.ndarray, want: np.ndarray, tol: float = 1e-2, rope_pairs: bool = False):
    """(mismatches beyond atol = rtol = tol, elements whose bits differ) of two bfloat16 bit
    arrays of one shape.

    rope_pairs: the last axis holds rotated pairs (2i, 2i+1) of interleaved RoPE. A GEMM on
    the GPU may round its bf16 output one ulp (2^-8 relative) away from the reference's; the
    rotation then mixes both inputs of a pair, so an output may be off by up to 2^-7 of the
    pair's magnitude (which the rotation preserves), however small the output itself is.
    That much is added to the tolerance of each element."""
    assert got.shape == want.shape, (got.shape, want.shape)
    g = bf16_float(np.ascontiguousarray(got).view(np.uint16))
    w = bf16_float(np.ascontiguousarray(want).view(np.uint16))
    bound = _bf16_bound(w, tol, rope_pairs)
    mismatches = int((np.abs(g - w) > bound).sum())
    flips = int((np.ascontiguousarray(got).view(np.uint16) != want).sum())
    return mismatches, flips
