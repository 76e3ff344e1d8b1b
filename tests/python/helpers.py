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
