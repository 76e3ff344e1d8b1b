"""The fused session: QKV projection + QK-RMSNorm + RoPE + head exchange in one call
(``qkv_norm_rope_exchange``, docs/api.md section 2.1)."""
from __future__ import annotations

import ctypes
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _capi
from . import _torch
from ._client import (ArrayLike, Client, Group, InvalidArgumentError, _Operand, _Session,
                      _SharedBuffer, _Slot, _Submitted, _check)

#: Names of the weights, their dtypes, and their shapes given (H, D, hidden, max_pos).
_WEIGHTS = (
    ("w_qkv", _capi.DTYPE_BFLOAT16, lambda h, d, hidden, mp: (3 * h * d, hidden)),
    ("q_norm", _capi.DTYPE_BFLOAT16, lambda h, d, hidden, mp: (d,)),
    ("k_norm", _capi.DTYPE_BFLOAT16, lambda h, d, hidden, mp: (d,)),
    ("cos_sin", _capi.DTYPE_FLOAT32, lambda h, d, hidden, mp: (mp, d)),
)

QkvResult = Union[ArrayLike, Tuple[ArrayLike, ArrayLike, ArrayLike]]


def _align(n: int) -> int:
    a = _capi.FUSED_ALIGN_BYTES
    return (n + a - 1) // a * a


class QkvNormRopeExchange(_Session):
    """A prepared ``qkv_norm_rope_exchange`` on a group: each rank passes its token shard
    ``x[B, S_l, hidden]`` (bfloat16) and the tokens' positions ``[B, S_l]`` (int32) and gets
    its head band of q, k, v over the whole sequence, ``S_g = W * S_l``. Call it::

        q, k, v = sess(x, positions)        # layout "bshd": each [B, S_g, H/W, D]
        qkv = sess(x, positions)            # layout "fused": [B, S_g, H/W, 3D]

    Every call is collective (each rank issues the same calls in the same order) and runs
    from one thread at a time. Results are read-only views of this rank's receive slot, as
    for the head-exchange ops: numpy arrays (bfloat16 as uint16 bits, or the input's
    bfloat16 numpy dtype), CPU tensors for torch inputs, CUDA tensors on a GPU backend.
    q, k and v share one slot: it is released when all three (and their views) are dropped,
    or when any one of them is released (``ulysses.release(q)``): then none may be read.

    The session keeps its weights alive: host weights were copied into a shared buffer of
    the session unless they already lay in one of the client's (then they must stay
    unchanged); CUDA weights are used in place and must stay unchanged.
    """

    def __init__(self, client: Client, group: Group, ptr: int, hidden: int, num_heads: int,
                 head_dim: int, layout: str, max_tokens: int, num_slots: int, max_pos: int,
                 path: str, weights: List[Any]):
        super().__init__(client, group, ptr, _capi.DTYPE_BFLOAT16, max_tokens, num_slots)
        self.hidden = hidden
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.layout = layout
        self.max_pos = max_pos
        self.path = path
        self._weights = weights  # the arrays, tensors or buffers the daemon reads

    @property
    def local_heads(self) -> int:
        """H/W: the heads each rank owns."""
        return self.num_heads // self.group.world_size

    def out_shape(self, batch: int, seq_local: int) -> Tuple[int, ...]:
        """The shape `out` must have for a call of `batch` x `seq_local` tokens:
        ``[3, B, S_g, H/W, D]`` (bshd: q, k, v planes) or ``[B, S_g, H/W, 3D]`` (fused)."""
        sg, hl, d = seq_local * self.world_size, self.local_heads, self.head_dim
        if self.layout == "bshd":
            return (3, batch, sg, hl, d)
        return (batch, sg, hl, 3 * d)

    def __call__(self, x: ArrayLike, positions: ArrayLike,
                 out: Optional[ArrayLike] = None) -> QkvResult:
        """Runs the fused call: ``x[B, S_l, hidden]`` bfloat16 and ``positions[B, S_l]`` int32
        in ``[0, max_pos)`` -> ``(q, k, v)`` (bshd) or one tensor (fused), views of the slot.

        `out` (:meth:`out_shape`; bfloat16, contiguous, writable) receives the result and no
        slot stays held: the call returns ``(out[0], out[1], out[2])`` (bshd) or `out`. Host
        arrays that are not contiguous, not 32-byte aligned or outside the client's shared
        buffers are copied into staging buffers first; CUDA tensors must be contiguous."""
        call = self._fused_args(x, positions, out)
        results = (ctypes.c_void_p * _capi.MAX_FUSED_RESULTS)()
        count = ctypes.c_int32()
        _check(_capi.library().uly_session_qkv_norm_rope_exchange(
            self._handle.ptr, ctypes.byref(call.args), results if call.want_results else None,
            ctypes.byref(count)))
        return self._fused_finish(call, results, count.value)

    def submit(self, x: ArrayLike, positions: ArrayLike,
               out: Optional[ArrayLike] = None) -> "FusedPending":
        """Queues the fused call through the call rings and returns at once;
        :meth:`FusedPending.wait` gives what the call would have returned. Calls complete in
        submission order. x, positions (and `out`) must stay unchanged and alive until the
        wait; host arrays outside shared buffers are copied into staging buffers of this call
        alone. Raises :class:`UnimplementedError` when the client has no rings."""
        pool: List[Tuple[str, _SharedBuffer]] = []
        try:
            call = self._fused_args(x, positions, out, pool)
            epoch = ctypes.c_uint64()
            _check(_capi.library().uly_session_qkv_norm_rope_submit(
                self._handle.ptr, ctypes.byref(call.args), ctypes.byref(epoch)))
        except BaseException:
            self._give_back(pool)
            raise
        return FusedPending(self, int(epoch.value), call, pool)

    def _fused_args(self, x: ArrayLike, positions: ArrayLike, out: Optional[ArrayLike],
                    pool: Optional[List[Tuple[str, _SharedBuffer]]] = None) -> "_FusedCall":
        """The uly_fused_call_args of a call, and what stays alive until it finished."""
        call = _FusedCall()
        call.xo = self._operand("x", x, call.is_torch, dense=True, pool=pool)
        call.po = self._operand("positions", positions, [], dtype_code=_capi.DTYPE_INT32,
                                dense=True, pool=pool)
        cuda = self._check_out_kind([call.xo, call.po], out)
        args = _capi.new(_capi.FusedCallArgs)
        args.x = ctypes.addressof(call.xo.tensor)
        args.positions = ctypes.addressof(call.po.tensor)
        if cuda is not None:
            args.stream = _torch.current_stream(cuda) or None
        call.out = out
        if out is not None:
            shape = tuple(int(n) for n in getattr(x, "shape", ()))
            want = self.out_shape(*shape[:2]) if len(shape) == 3 else None
            got = tuple(int(n) for n in getattr(out, "shape", ()))
            if want is not None and got != want:
                raise InvalidArgumentError("out: shape %s, want %s (%s)" % (
                    list(got), list(want), "[3, B, S_g, H/W, D]" if self.layout == "bshd"
                    else "[B, S_g, H/W, 3D]"))
            call.out_op = self._operand("out", out, [], is_out=True, copy_in=False,
                                        dense=True, pool=pool)
            call.copy_out_later = call.out_op.staged is not None
            if not call.copy_out_later:
                args.out = ctypes.addressof(call.out_op.tensor)
        call.want_results = out is None or call.copy_out_later
        call.args = args
        return call

    def _fused_finish(self, call: "_FusedCall", results: Any, count: int) -> QkvResult:
        """What a fused call returns, once its results (handles, or none with out) are here."""
        out, out_op = call.out, call.out_op
        if not call.want_results:
            self._remember_out(out)
            return self._split_out(out)
        slot = _Slot([results[i] for i in range(count)], self, call.args.stream)
        if out is not None:
            try:
                planes = [self._slot_array(slot, out_op.array.dtype, i)
                          for i in range(len(slot.parts))]
                want = planes[0].shape if len(planes) == 1 else (3,) + planes[0].shape
                if out_op.array.shape != want:
                    raise InvalidArgumentError("out: shape %s, want %s" % (
                        list(out_op.array.shape), list(want)))
                if len(planes) == 1:
                    np.copyto(out_op.array, planes[0])
                else:
                    for i, plane in enumerate(planes):
                        np.copyto(out_op.array[i], plane)
            finally:
                slot.release()
            self._remember_out(out)
            return self._split_out(out)
        like = call.xo.array.dtype if call.xo.array is not None else None
        torch_input = bool(call.is_torch and call.is_torch[0])
        self._remember_slot(slot, like, torch_input, len(slot.parts) == 1)
        views = [self._result(slot, like, torch_input, i) for i in range(len(slot.parts))]
        return views[0] if len(views) == 1 else tuple(views)

    def _split_out(self, out: Any) -> QkvResult:
        if self.layout == "bshd":
            return (out[0], out[1], out[2])
        return out

    def __enter__(self) -> "QkvNormRopeExchange":
        return self

    def __repr__(self) -> str:
        return ("QkvNormRopeExchange(id=%d, rank=%d/%d, hidden=%d, heads=%d, head_dim=%d, "
                "layout=%s, max_tokens=%d, slots=%d, max_pos=%d, path=%s)" % (
                    self.id, self.rank, self.world_size, self.hidden, self.num_heads,
                    self.head_dim, self.layout, self.max_tokens, self.num_slots, self.max_pos,
                    self.path))


class _FusedCall:
    """One fused call's operands, out and arguments, kept alive while it runs."""

    def __init__(self) -> None:
        self.is_torch: List[bool] = []
        self.xo: Optional[_Operand] = None
        self.po: Optional[_Operand] = None
        self.out: Any = None
        self.out_op: Optional[_Operand] = None
        self.copy_out_later = False
        self.want_results = True
        self.args: Any = None


class FusedPending(_Submitted):
    """A submitted fused call (:meth:`QkvNormRopeExchange.submit`). :meth:`wait` gives what
    the call returns: ``(q, k, v)`` or one band (views of the slot), or `out` split the same
    way; until then its inputs, `out` and staging buffers stay alive. Wait for every
    submitted call."""

    def _collect(self, call: _FusedCall, ms: int) -> QkvResult:
        s = self.session
        results = (ctypes.c_void_p * _capi.MAX_FUSED_RESULTS)()
        count = ctypes.c_int32()
        _check(_capi.library().uly_session_qkv_norm_rope_wait(
            s._handle.ptr, self.epoch, ms, results if call.want_results else None,
            ctypes.byref(count)))
        return s._fused_finish(call, results, count.value)


def _host_weight(client: Client, name: str, value: Any, code: int) -> np.ndarray:
    """A host weight as a numpy array of `code`'s dtype (bfloat16 as its raw bits)."""
    if _torch.is_tensor(value):
        value = _torch.to_numpy(value)
    elif not isinstance(value, np.ndarray):
        raise TypeError("%s: expected a numpy array or a torch tensor, got %s"
                        % (name, type(value).__name__))
    from ._client import _array_dtype_matches, _DTYPE_NAMES
    if not _array_dtype_matches(value.dtype, code):
        raise InvalidArgumentError("%s: dtype %s, want %s" % (name, value.dtype,
                                                              _DTYPE_NAMES[code]))
    return value


def create(client: Client, group: Group, *, hidden: Optional[int], num_heads: int,
           head_dim: int, layout: str, max_tokens: int, num_slots: int, max_pos: Optional[int],
           w_qkv: ArrayLike, q_norm: ArrayLike, k_norm: ArrayLike, cos_sin: ArrayLike,
           path: str, timeout: Optional[float]) -> QkvNormRopeExchange:
    """Client.qkv_norm_rope_exchange (documented there)."""
    if layout not in _capi.QKV_LAYOUTS:
        raise InvalidArgumentError("layout: %r is not one of %s"
                                   % (layout, ", ".join(_capi.QKV_LAYOUTS)))
    if path not in _capi.FUSED_PATHS:
        raise InvalidArgumentError("path: %r is not one of %s"
                                   % (path, ", ".join(_capi.FUSED_PATHS)))
    named = {"w_qkv": w_qkv, "q_norm": q_norm, "k_norm": k_norm, "cos_sin": cos_sin}
    for name, value in named.items():
        if value is None:
            raise InvalidArgumentError("%s: must not be None" % name)
    if max_pos is None:
        if len(getattr(cos_sin, "shape", ())) != 2:
            raise InvalidArgumentError("cos_sin: shape %s, want [max_pos, head_dim]"
                                       % (list(getattr(cos_sin, "shape", ())),))
        max_pos = int(cos_sin.shape[0])
    if hidden is None:
        hidden = num_heads * head_dim
    tensors = [_capi.new(_capi.Tensor) for _ in _WEIGHTS]
    keep: List[Any] = []  # what the daemon reads for the session's lifetime
    on_device = [_torch.is_tensor(v) and _torch.is_device_tensor(v) for v in named.values()]
    if any(on_device):
        for (name, code, _), t in zip(_WEIGHTS, tensors):
            value = named[name]
            if not (_torch.is_tensor(value) and _torch.is_device_tensor(value)):
                raise InvalidArgumentError("%s: a host array, but %s is a CUDA tensor; give "
                                           "every weight on the device" % (
                                               name, _WEIGHTS[on_device.index(True)][0]))
            if str(value.dtype).replace("torch.", "") != ("bfloat16" if code ==
                                                          _capi.DTYPE_BFLOAT16 else "float32"):
                raise InvalidArgumentError("%s: dtype %s, want %s" % (
                    name, value.dtype, "bfloat16" if code == _capi.DTYPE_BFLOAT16 else "float32"))
            if not value.is_contiguous():
                raise InvalidArgumentError("%s: must be contiguous (call .contiguous())" % name)
            t.device_kind = _capi.DEVICE_CUDA
            t.dtype = code
            t.ndim = value.dim()
            for i in range(min(t.ndim, _capi.MAX_DIMS)):
                t.shape[i] = value.shape[i]
            t.data = value.data_ptr()
            t.device_index = value.device.index if value.device.index is not None else 0
            keep.append(value)
    else:
        arrays = [_host_weight(client, name, named[name], code) for name, code, _ in _WEIGHTS]
        # Weights already in a shared buffer of the client, contiguous and aligned, are used in
        # place; the others are copied into one buffer of the session, each 32-byte aligned.
        in_place = [a.ndim <= _capi.MAX_DIMS and a.flags.c_contiguous and a.size > 0 and
                    a.ctypes.data % _capi.FUSED_ALIGN_BYTES == 0 and
                    client._shared_strides(a) is not None for a in arrays]
        offsets, total = [], 0
        for a, here in zip(arrays, in_place):
            offsets.append(total)
            if not here:
                total = _align(total + a.nbytes)
        buf = _SharedBuffer(client, total, "fused-weights") if total else None
        if buf is not None:
            keep.append(buf)
        for (name, code, _), a, t, here, off in zip(_WEIGHTS, arrays, tensors, in_place,
                                                     offsets):
            t.device_kind = _capi.DEVICE_HOST
            t.dtype = code
            t.ndim = min(a.ndim, _capi.MAX_DIMS)
            for i in range(t.ndim):
                t.shape[i] = a.shape[i]
            if here:
                t.data = a.ctypes.data
                keep.append(a)
            else:
                raw = np.asarray(buf.array((buf.size,), np.dtype(np.uint8)))
                dst = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
                np.copyto(dst, a)
                t.buffer_id = buf.id
                t.byte_offset = off
    spec = _capi.new(_capi.FusedSessionSpec)
    spec.hidden = hidden
    spec.num_heads = num_heads
    spec.head_dim = head_dim
    spec.layout = _capi.QKV_LAYOUTS[layout]
    spec.path = _capi.FUSED_PATHS[path]
    spec.num_slots = num_slots
    spec.max_pos = max_pos
    spec.max_tokens = max_tokens
    spec.w_qkv, spec.q_norm, spec.k_norm, spec.cos_sin = (ctypes.pointer(t) for t in tensors)
    spec.timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
    out = ctypes.c_void_p()
    _check(_capi.library().uly_session_create_fused(client._handle.ptr, group._handle.ptr,
                                                    ctypes.byref(spec), ctypes.byref(out)))
    return QkvNormRopeExchange(client, group, out.value, hidden, num_heads, head_dim, layout,
                               max_tokens, num_slots, max_pos, path, keep)
