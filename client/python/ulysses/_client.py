"""Client, groups, head-exchange sessions and the arrays that view receive slots."""
from __future__ import annotations

import bisect
import ctypes
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _capi
from . import _torch
from ._errors import FailedPreconditionError, InvalidArgumentError, error_for

if TYPE_CHECKING:
    from ._fused import QkvNormRopeExchange

#: Session dtypes by name (and the aliases ParseDType accepts).
_DTYPE_CODES = {
    "float16": _capi.DTYPE_FLOAT16, "fp16": _capi.DTYPE_FLOAT16, "half": _capi.DTYPE_FLOAT16,
    "bfloat16": _capi.DTYPE_BFLOAT16, "bf16": _capi.DTYPE_BFLOAT16,
    "float32": _capi.DTYPE_FLOAT32, "fp32": _capi.DTYPE_FLOAT32, "float": _capi.DTYPE_FLOAT32,
}
_DTYPE_NAMES = {_capi.DTYPE_FLOAT16: "float16", _capi.DTYPE_BFLOAT16: "bfloat16",
                _capi.DTYPE_FLOAT32: "float32", _capi.DTYPE_INT32: "int32"}
#: The numpy dtype of a result (bfloat16 travels as raw uint16 bits in numpy).
_NUMPY_DTYPES = {_capi.DTYPE_FLOAT16: np.dtype(np.float16),
                 _capi.DTYPE_BFLOAT16: np.dtype(np.uint16),
                 _capi.DTYPE_FLOAT32: np.dtype(np.float32),
                 _capi.DTYPE_INT32: np.dtype(np.int32)}
#: The uly_dtype of a torch dtype's name (int32: the fused call's positions).
_TENSOR_CODES = {"float16": _capi.DTYPE_FLOAT16, "bfloat16": _capi.DTYPE_BFLOAT16,
                 "float32": _capi.DTYPE_FLOAT32, "int32": _capi.DTYPE_INT32}

_torch_codes: Dict[Any, Optional[int]] = {}


def _torch_dtype_code(dtype: Any) -> Optional[int]:
    """The uly_dtype of a torch dtype (None for one ulysses does not take), remembered per
    dtype: every CUDA operand of every call asks."""
    code = _torch_codes.get(dtype, -1)
    if code == -1:
        code = _torch_codes[dtype] = _TENSOR_CODES.get(str(dtype).replace("torch.", ""))
    return code


DTypeLike = Union[str, np.dtype, type, Any]
ArrayLike = Any  # numpy.ndarray or torch.Tensor


def _check(status: int) -> None:
    if status != _capi.OK:
        lib = _capi.library()
        raise error_for(status, lib.uly_last_error().decode("utf-8", "replace"))


def _dtype_code(dtype: DTypeLike) -> int:
    """The uly_dtype of a name, numpy dtype or torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    elif _torch.is_dtype(dtype):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise InvalidArgumentError("dtype: %r is not a dtype" % (dtype,)) from None
    code = _DTYPE_CODES.get(name.lower())
    if code is None:
        raise InvalidArgumentError("dtype: %r is not float16, bfloat16 or float32" % (dtype,))
    return code


_BFLOAT16_BITS = (np.dtype(np.uint16), np.dtype(np.int16))


def _array_dtype_matches(dt: np.dtype, code: int) -> bool:
    if code == _capi.DTYPE_BFLOAT16:
        # Raw bits, or a bfloat16 dtype such as ml_dtypes' (itemsize 2, named bfloat16).
        return dt in _BFLOAT16_BITS or (dt.name == "bfloat16" and dt.itemsize == 2)
    return dt == _NUMPY_DTYPES[code]


def _dtype_mismatch(name: str, got: Any, want: int, session: int) -> str:
    if want == session:
        return "%s: dtype %s is not the session's %s" % (name, got, _DTYPE_NAMES[want])
    return "%s: dtype %s, want %s" % (name, got, _DTYPE_NAMES[want])


def _default_device() -> int:
    env = os.environ.get("ULYSSES_DEVICE")
    if env:
        return int(env)
    device = _torch.current_cuda_device()
    if device is not None:
        return device
    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) if local_rank else 0


class _Handle:
    """Owns one C handle and frees it once, with the C function `free_name`."""

    __slots__ = ("_ptr", "_free_name", "__weakref__")

    def __init__(self, ptr: int, free_name: str):
        self._ptr = ptr
        self._free_name = free_name

    @property
    def ptr(self) -> int:
        if not self._ptr:
            raise InvalidArgumentError("handle: already freed")
        return self._ptr

    def free(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr:
            getattr(_capi.library(), self._free_name)(ptr)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class _Memory:
    """Exposes `size` bytes at `address` to numpy (``__array_interface__``) and keeps `owner`
    alive for as long as any array viewing them lives."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, address: int, size: int, readonly: bool, owner: Any):
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "version": 3,
                                    "data": (address, readonly)}
        self.owner = owner


class _SharedBuffer:
    """A shared host buffer of the client (uly_buffer); freed when the last view is gone."""

    def __init__(self, client: "Client", size: int, name: str):
        lib = _capi.library()
        out = ctypes.c_void_p()
        _check(lib.uly_buffer_alloc(client._handle.ptr, size, name.encode(), ctypes.byref(out)))
        self._handle = _Handle(out.value, "uly_buffer_free")
        self.client = client  # the client outlives its buffers' handles
        self.id = lib.uly_buffer_id(out.value)
        self.address = lib.uly_buffer_data(out.value)
        self.size = lib.uly_buffer_size(out.value)
        client._add_buffer(self)

    def array(self, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A writable C-contiguous array of `shape` at the start of the buffer."""
        raw = np.asarray(_Memory(self.address, self.size, False, self))
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return raw[:n].view(dtype).reshape(shape)


class _Slot:
    """Holds one call's result and the receive slot it occupies: one uly_result, or the q, k,
    v results of a fused call (one handle each, sharing the slot). ``parts`` lists
    ``(data, shape, bytes)`` of each handle; ``data``, ``shape`` and ``bytes`` are the first's."""

    def __init__(self, ptrs: Union[int, Sequence[int]], session: "_Session",
                 stream: Optional[int] = None):
        ptrs = [ptrs] if isinstance(ptrs, int) else list(ptrs)
        self._handles = [_Handle(p, "uly_result_free") for p in ptrs]
        self.session = session  # its segment stays mapped while this lives
        # The cudaStream_t the call was ordered on (None or 0: the legacy default stream).
        self.stream = stream
        lib = _capi.library()
        self.parts: List[Tuple[Optional[int], Tuple[int, ...], int]] = []
        held = False
        info = session._result_info  # the session's one ResultInfo, filled per result
        for p in ptrs:
            _check(lib.uly_result_get_info(p, ctypes.byref(info)))
            self.parts.append((info.data, tuple(info.shape[:info.ndim]), info.bytes))
            held = bool(info.held)
            self.epoch = int(info.epoch)
            self.slot = int(info.slot)
            self.device = info.device_kind == _capi.DEVICE_CUDA  # `data` is device memory
            self.daemon_us = int(info.daemon_us)
        self.data, self.shape, self.bytes = self.parts[0]
        self._held = held
        session._held.add(self)

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        self.session._held.discard(self)
        # One release gives the slot back for every handle of the call.
        _check(_capi.library().uly_result_release(self._handles[0].ptr))


class SlotArray(np.ndarray):
    """A read-only numpy view of this rank's receive slot, as the head-exchange calls return it.

    The slot stays held (the daemon never overwrites it) until :meth:`release` is called or
    the last array viewing it is dropped. The session's call that needs the slot next waits for
    that, so release results as soon as they have been read. bfloat16 results are uint16 arrays
    of raw bits unless the input had a bfloat16 numpy dtype.
    """

    _slot: Optional[_Slot] = None

    def __array_finalize__(self, obj: Any) -> None:
        self._slot = getattr(obj, "_slot", None)

    def release(self) -> None:
        """Gives the receive slot back now. The data must not be read afterwards. Idempotent."""
        if self._slot is not None:
            self._slot.release()

    @property
    def held(self) -> bool:
        """Whether the result still holds its slot."""
        return self._slot is not None and self._slot.held

    @property
    def epoch(self) -> int:
        """The session's call counter of this result (from 1, the same on every rank)."""
        return self._slot.epoch if self._slot is not None else 0


def release(result: Any) -> None:
    """Releases the receive slot of a result (a :class:`SlotArray`, a :class:`DeviceSlot` or a
    torch tensor that a call returned, or a numpy view of one). Idempotent."""
    slot = getattr(result, "_ulysses_slot", None) or getattr(result, "_slot", None)
    if slot is not None:
        slot.release()


class Group:
    """A joined group of W ranks, one daemon each."""

    def __init__(self, client: "Client", ptr: int, name: str):
        lib = _capi.library()
        self._handle = _Handle(ptr, "uly_group_free")
        self.client = client
        self.name = name
        self.id: int = lib.uly_group_id(ptr)
        self.rank: int = lib.uly_group_rank(ptr)
        self.world_size: int = lib.uly_group_world_size(ptr)
        self.backend: str = lib.uly_group_backend(ptr).decode()
        self.backend_reason: str = lib.uly_group_backend_reason(ptr).decode()

    def leave(self) -> None:
        """Leaves the group; its sessions must be closed first (FailedPreconditionError).
        The other ranks' later sessions of the group then fail at once with AbortedError
        naming this rank, instead of waiting for it."""
        _check(_capi.library().uly_group_leave(self._handle.ptr))

    def __repr__(self) -> str:
        return "Group(%r, rank=%d, world_size=%d, backend=%r)" % (
            self.name, self.rank, self.world_size, self.backend)


class _Operand:
    """How one argument reaches the library: a uly_tensor over shared memory (the caller's,
    when the array lies in a buffer of this client, or a staging buffer's)."""

    def __init__(self, tensor: _capi.Tensor, array: Optional[np.ndarray],
                 staged: Optional[np.ndarray], cuda: Any = None):
        self.tensor = tensor
        self.array = array    # the caller's array (numpy view of it); None for CUDA tensors
        self.staged = staged  # the staging copy the call reads or writes, if any
        self.cuda = cuda      # the caller's CUDA tensor, if it is one


class _Session:
    """What every session kind shares: its handle, the receive slots its results hold, the
    staging buffers of host operands, and the conversion of arrays and tensors to uly_tensors.
    Use from one thread at a time."""

    def __init__(self, client: "Client", group: Group, ptr: int, dtype_code: int,
                 max_tokens: int, num_slots: int):
        lib = _capi.library()
        self._handle = _Handle(ptr, "uly_session_free")
        self.client = client
        self.group = group
        self.id: int = lib.uly_session_id(ptr)
        self.backend: str = lib.uly_session_backend(ptr).decode()
        self.dtype: str = _DTYPE_NAMES[dtype_code]
        self.max_tokens = max_tokens
        self.num_slots = num_slots
        self._dtype_code = dtype_code
        self._staging: Dict[str, _SharedBuffer] = {}
        # Staging buffers that submitted calls gave back, by role, for the next submits.
        self._spare: Dict[str, List[_SharedBuffer]] = {}
        self._held: "weakref.WeakSet[_Slot]" = weakref.WeakSet()
        self._result_info = _capi.new(_capi.ResultInfo)  # reused by each _Slot (one thread)
        self._closed = False
        # last_outputs: how to give the last call's result again, never holding anything
        # itself (weak references to its slot or to the out it copied into).
        self._last: Optional[Tuple[Any, ...]] = None

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def rank(self) -> int:
        return self.group.rank

    # -- slots and lifetime ------------------------------------------------------------------

    def release(self, result: Any) -> None:
        """Releases the slot of `result` (same as :func:`ulysses.release`)."""
        release(result)

    def release_all(self) -> None:
        """Releases every slot a result of this session still holds."""
        for slot in list(self._held):
            slot.release()

    def last_outputs(self) -> Any:
        """What the last call of this session that returned gave, again: views of its slot
        (a fused call's ``(q, k, v)`` or one band; any other call's one view), or the `out` it
        copied into. Views share the call's slot, so they are given only while a result of
        that call still holds it; the session's own record never holds a slot. Raises
        FailedPreconditionError before any call, and once that result was given back (every
        view dropped, or one released): its slot may be reused by then."""
        if self._last is None:
            raise FailedPreconditionError("session %d: no call has returned yet" % self.id)
        kind, ref, extra = self._last
        target = ref()
        if kind == "out":
            if target is None:
                raise FailedPreconditionError(
                    "session %d: the out of the last call is gone" % self.id)
            return self._split_out(target)
        if target is None or not target.held:
            raise FailedPreconditionError(
                "session %d: the result of epoch %d was given back (every view of it dropped, "
                "or one released), so its slot may be reused; keep a view of it, or call with "
                "out=" % (self.id, extra[0]))
        epoch, like, torch_input, single = extra
        views = tuple(self._result(target, like, torch_input, i) for i in range(len(target.parts)))
        return views[0] if single else views

    def _remember_slot(self, slot: _Slot, like: Optional[np.dtype], torch_input: bool,
                       single: bool) -> None:
        self._last = ("slot", weakref.ref(slot), (slot.epoch, like, torch_input, single))

    def _remember_out(self, out: Any) -> None:
        try:
            ref: Any = weakref.ref(out)
        except TypeError:  # an array kind without weak references: the caller's anyway
            ref = lambda: out  # noqa: E731
        self._last = ("out", ref, None)

    def _split_out(self, out: Any) -> Any:
        """What a call that copied into `out` returns (the fused session splits it)."""
        return out

    def poison_slots(self) -> int:
        """Fills this rank's receive slots that are not held with NaN (all bits set); returns
        how many. Not collective. For tests telling fresh results from stale ones."""
        n = ctypes.c_int32()
        _check(_capi.library().uly_session_poison_slots(self._handle.ptr, ctypes.byref(n)))
        return n.value

    def describe(self) -> str:
        """How the daemon runs this session's calls (for a fused session the path per prepared
        row count and why), as it reports it now."""
        text = ctypes.c_char_p()
        _check(_capi.library().uly_session_describe(self._handle.ptr, ctypes.byref(text)))
        return (text.value or b"").decode("utf-8", "replace")

    def close(self) -> None:
        """Closes the session on this rank (results still alive stay readable; on a GPU
        session the calls already made run to their end first, waited for up to 10 s).
        Idempotent."""
        if not self._closed:
            self._closed = True
            _check(_capi.library().uly_session_close(self._handle.ptr))

    def __enter__(self) -> "_Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------

    def _staging_buffer(self, role: str, nbytes: int,
                        pool: Optional[List[Tuple[str, _SharedBuffer]]] = None) -> _SharedBuffer:
        """The staging buffer of `role` (at least `nbytes`). With `pool` (a submitted call's),
        a buffer of that call alone, recorded in `pool` so that the call gives it back."""
        if pool is not None:
            spare = self._spare.setdefault(role, [])
            buf = next((b for b in spare if b.size >= nbytes), None)
            if buf is not None:
                spare.remove(buf)
            else:
                buf = _SharedBuffer(self.client, max(nbytes, 4096), "staging-" + role)
            pool.append((role, buf))
            return buf
        buf = self._staging.get(role)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 2 * buf.size if buf is not None else 0, 4096)
            buf = _SharedBuffer(self.client, size, "staging-" + role)
            self._staging[role] = buf
        return buf

    def _give_back(self, pool: List[Tuple[str, _SharedBuffer]]) -> None:
        for role, buf in pool:
            self._spare.setdefault(role, []).append(buf)
        pool.clear()

    def _operand(self, name: str, value: Any, is_torch: List[bool], is_out: bool = False,
                 copy_in: bool = True, dtype_code: Optional[int] = None, dense: bool = False,
                 pool: Optional[List[Tuple[str, _SharedBuffer]]] = None) -> _Operand:
        """Describes `value` for the library; `copy_in`: a staging copy starts as `value`.
        `dtype_code`: the dtype it must have (default: the session's). `dense`: the library
        takes it only contiguous and 32-byte aligned (a host array that is not is staged).
        `pool`: stage into buffers of a submitted call (see _staging_buffer)."""
        code = self._dtype_code if dtype_code is None else dtype_code
        if value is None:
            raise InvalidArgumentError("%s: must not be None" % name)
        t = _capi.new(_capi.Tensor)
        t.dtype = code
        if isinstance(value, np.ndarray):
            is_torch.append(False)
        elif _torch.is_tensor(value):
            is_torch.append(True)
            if _torch.is_device_tensor(value):
                return self._cuda_operand(name, value, t, code, dense)
            value = _torch.to_numpy(value)
        else:
            raise TypeError("%s: expected a numpy array or a torch tensor, got %s"
                            % (name, type(value).__name__))
        a = value
        if not _array_dtype_matches(a.dtype, code):
            raise InvalidArgumentError(_dtype_mismatch(name, a.dtype, code, self._dtype_code))
        if a.ndim > _capi.MAX_DIMS:
            raise InvalidArgumentError("%s: ndim %d, at most %d" % (name, a.ndim, _capi.MAX_DIMS))
        if is_out and not a.flags.writeable:
            raise InvalidArgumentError("%s: the array is read-only" % name)
        t.device_kind = _capi.DEVICE_HOST
        t.ndim = a.ndim
        t.shape[:a.ndim] = a.shape  # one slice store: a loop of element stores costs 3x
        data = a.ctypes.data  # costs a ctypes helper object: read once
        strides = self.client._shared_strides(a, data)
        if strides is not None and dense and not (
                a.flags.c_contiguous and data % _capi.FUSED_ALIGN_BYTES == 0):
            strides = None  # in a shared buffer, but not as the library takes it: staged
        if strides is not None:
            t.data = data
            if not dense:
                t.strides[:len(strides)] = strides
            return _Operand(t, a, None)
        buf = self._staging_buffer(name, max(a.nbytes, 1), pool)
        staged = buf.array(a.shape, a.dtype)
        if copy_in:
            np.copyto(staged, a)
        t.data = buf.address
        return _Operand(t, a, staged)

    def _cuda_operand(self, name: str, value: Any, t: _capi.Tensor, code: int,
                      dense: bool) -> _Operand:
        """A torch CUDA tensor as a uly_tensor of kind CUDA (the library registers its
        allocation with the daemon; nothing is copied)."""
        if not value.is_cuda:
            raise InvalidArgumentError("%s: a %s tensor; ulysses takes CPU and CUDA tensors"
                                       % (name, value.device.type))
        shape = value.shape
        ndim = len(shape)
        if ndim > _capi.MAX_DIMS:
            raise InvalidArgumentError("%s: ndim %d, at most %d" % (name, ndim, _capi.MAX_DIMS))
        if _torch_dtype_code(value.dtype) != code:
            raise InvalidArgumentError(_dtype_mismatch(name, value.dtype, code,
                                                       self._dtype_code))
        if dense and not value.is_contiguous():
            raise InvalidArgumentError("%s: must be contiguous (call .contiguous())" % name)
        t.device_kind = _capi.DEVICE_CUDA
        t.ndim = ndim
        t.shape[:ndim] = shape
        if not dense:
            stride = value.stride()
            if 1 in shape:
                # A size-1 dimension's stride is arbitrary in torch; any positive one will do.
                stride = [st if n != 1 else 1 for n, st in zip(shape, stride)]
            t.strides[:ndim] = stride
        t.data = value.data_ptr()
        t.device_index = value.get_device()
        return _Operand(t, None, None, cuda=value)

    def _check_out_kind(self, operands: Sequence[_Operand], out: Any) -> Any:
        """The CUDA tensor among the inputs (None for host inputs); refuses an `out` of the
        other kind."""
        cuda = next((o.cuda for o in operands if o.cuda is not None), None)
        if out is not None and (cuda is not None) != (
                _torch.is_tensor(out) and _torch.is_device_tensor(out)):
            raise InvalidArgumentError(
                "out: a %s, but the inputs are %s; give out where the inputs are" % (
                    "CUDA tensor" if cuda is None else "host array",
                    "CUDA tensors" if cuda is not None else "host arrays"))
        return cuda

    def _result(self, slot: _Slot, like: Optional[np.dtype], torch_input: bool,
                part: int = 0) -> Any:
        """Part `part` of a slot as the caller's kind of array: a CUDA tensor (or DeviceSlot)
        for device results, a SlotTensor for torch inputs, else a SlotArray."""
        if slot.device:
            return self._device_result(slot, part)
        view = self._slot_array(slot, like, part)
        if torch_input:
            return _torch.slot_tensor(view, self._dtype_code == _capi.DTYPE_BFLOAT16, slot)
        return view

    def _device_result(self, slot: _Slot, part: int = 0) -> Any:
        """A result in device memory: a CUDA torch tensor viewing the slot when torch is
        imported, else the :class:`DeviceSlot` (``__cuda_array_interface__``) itself."""
        if _torch.is_available():
            # DLPack: the tensor's storage holds the result itself, and torch builds it in a
            # third of the time __cuda_array_interface__ takes.
            lib = _capi.library()
            managed = ctypes.c_void_p()
            _check(lib.uly_result_to_dlpack(slot._handles[part].ptr, ctypes.byref(managed)))
            return _torch.dlpack_slot_tensor(lib, managed.value, slot)
        bf16 = self._dtype_code == _capi.DTYPE_BFLOAT16
        typestr = "<i2" if bf16 else _NUMPY_DTYPES[self._dtype_code].str
        return _torch.DeviceSlot(slot, typestr, bf16, part, _capi.library())

    def _slot_array(self, slot: _Slot, like: Optional[np.dtype], part: int = 0) -> SlotArray:
        dtype = _NUMPY_DTYPES[self._dtype_code]
        if like is not None and like.itemsize == dtype.itemsize and _array_dtype_matches(
                like, self._dtype_code):
            dtype = like
        data, shape, nbytes = slot.parts[part]
        raw = np.asarray(_Memory(data, nbytes, True, slot))
        arr = raw.view(dtype).reshape(shape).view(SlotArray)
        arr._slot = slot
        return arr


#: The ops of a head-exchange session by name, with their input names.
_OPS = {"scatter_heads": (_capi.OP_SCATTER_HEADS, ("x",)),
        "gather_heads": (_capi.OP_GATHER_HEADS, ("y",)),
        "scatter_qkv_head_chunk": (_capi.OP_SCATTER_QKV_HEAD_CHUNK, ("q", "k", "v")),
        "gather_output_head_chunk": (_capi.OP_GATHER_OUTPUT_HEAD_CHUNK, ("x",))}


class HeadExchange(_Session):
    """A prepared head exchange on a group (a session). Every call is collective: each rank
    issues the same calls, with the same arguments, in the same order. Use from one thread
    at a time.

    On the host backend, arguments are numpy arrays or CPU torch tensors of shape
    ``[B, S, heads, D]`` in the session's dtype, any positive strides. Arrays inside shared
    buffers of this client (:meth:`Client.empty`) are passed as they are; others are copied
    into shared staging buffers that the session allocates once and reuses. Results are views
    of the receive slot (:class:`SlotArray`, or a CPU tensor for torch inputs).

    On a GPU backend (daemons started with ``--backend nvlink``), arguments are torch CUDA
    tensors (any positive strides, from the caching allocator or anywhere cudaMalloc'd). Each
    allocation is handed to the daemon once, by CUDA IPC, and cached; memory freed and
    allocated again is registered afresh. The call is ordered after the work enqueued so far
    on torch's current stream of the tensors' device and returns at once: its result is valid
    for work enqueued afterwards on that stream (like any torch op), and an error the daemon
    finds later is raised by the next call. Results are read-only CUDA tensors viewing the receive slot (through
    ``__cuda_array_interface__``, no copy); ``out=`` takes CUDA tensors.
    """

    def __init__(self, client: "Client", group: Group, ptr: int, num_heads: int, head_dim: int,
                 dtype_code: int, max_tokens: int, num_slots: int, schedule: List[int]):
        super().__init__(client, group, ptr, dtype_code, max_tokens, num_slots)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.schedule: List[int] = list(schedule)

    @property
    def local_heads(self) -> int:
        """H/W: the heads each rank owns."""
        return self.num_heads // self.group.world_size

    def head_chunks(self) -> List[Tuple[int, int]]:
        """(head_offset, head_count) of each band of the schedule (the whole band without)."""
        counts = self.schedule or [self.local_heads]
        offsets = np.cumsum([0] + counts[:-1]).tolist()
        return list(zip(offsets, counts))

    # -- the four ops ------------------------------------------------------------------------

    def scatter_heads(self, x: ArrayLike, out: Optional[ArrayLike] = None) -> ArrayLike:
        """``x[B,S_l,H,D] -> [B,S_g,H/W,D]``: this rank's head band of every rank's tokens,
        ``out[b, j*S_l+s, h, d] = x_j[b, s, rank*H_l+h, d]``. Returns a view of the receive
        slot, or `out` when given (the slot is then released at once)."""
        return self._call(_capi.OP_SCATTER_HEADS, [("x", x)], out)

    def gather_heads(self, y: ArrayLike, out: Optional[ArrayLike] = None) -> ArrayLike:
        """``y[B,S_g,H/W,D] -> [B,S_l,H,D]``, the inverse of :meth:`scatter_heads`."""
        return self._call(_capi.OP_GATHER_HEADS, [("y", y)], out)

    def scatter_qkv_head_chunk(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, head_offset: int,
                               head_count: int, out: Optional[ArrayLike] = None) -> ArrayLike:
        """``q,k,v[B,S_l,H,D] -> [B,S_g,HC,3D]`` for local heads ``[head_offset,
        head_offset+HC)``, Q in ``[0,D)``, K in ``[D,2D)``, V in ``[2D,3D)`` of the last axis."""
        return self._call(_capi.OP_SCATTER_QKV_HEAD_CHUNK, [("q", q), ("k", k), ("v", v)], out,
                          head_offset, head_count)

    def gather_output_head_chunk(self, x: ArrayLike, head_offset: int, head_count: int,
                                 out: ArrayLike) -> ArrayLike:
        """``x[B,S_g,HC,D]`` -> writes heads ``p*H_l + head_offset + [0, HC)`` of
        ``out[B,S_l,H,D]`` for every source rank p; the other heads of `out` stay untouched.
        Returns `out`."""
        if out is None:
            raise InvalidArgumentError("out: gather_output_head_chunk needs out")
        return self._call(_capi.OP_GATHER_OUTPUT_HEAD_CHUNK, [("x", x)], out, head_offset,
                          head_count)

    # -- submit and wait ---------------------------------------------------------------------

    def submit(self, op: str, *inputs: ArrayLike, head_offset: int = 0, head_count: int = 0,
               out: Optional[ArrayLike] = None) -> "Pending":
        """Queues one of the four ops (by name: ``"scatter_heads"``, ``"gather_heads"``,
        ``"scatter_qkv_head_chunk"``, ``"gather_output_head_chunk"``) through the call rings
        and returns at once; :meth:`Pending.wait` gives what the op's method would have
        returned. Calls complete in submission order. The inputs (and `out`) must stay
        unchanged (and alive) until the wait: the daemon reads them while the call runs. Host
        arrays outside shared buffers are copied into staging buffers of this call alone.
        Raises :class:`UnimplementedError` when the client has no rings
        (``connect(use_rings=False)``)."""
        if op not in _OPS:
            raise InvalidArgumentError("op: %r is not one of %s" % (op, ", ".join(_OPS)))
        code, names = _OPS[op]
        if len(inputs) != len(names):
            raise InvalidArgumentError("inputs: %s takes %d input(s) (%s), got %d" % (
                op, len(names), ", ".join(names), len(inputs)))
        if code == _capi.OP_GATHER_OUTPUT_HEAD_CHUNK and out is None:
            raise InvalidArgumentError("out: gather_output_head_chunk needs out")
        pool: List[Tuple[str, _SharedBuffer]] = []
        try:
            args, keep = self._call_args(code, list(zip(names, inputs)), out, head_offset,
                                         head_count, pool)
            epoch = ctypes.c_uint64()
            _check(_capi.library().uly_session_submit(self._handle.ptr, ctypes.byref(args),
                                                      ctypes.byref(epoch)))
        except BaseException:
            self._give_back(pool)
            raise
        return Pending(self, int(epoch.value), keep, pool)

    # -- plumbing ----------------------------------------------------------------------------

    def _call_args(self, op: int, inputs: Sequence[Tuple[str, Any]], out: Optional[ArrayLike],
                   head_offset: int, head_count: int,
                   pool: Optional[List[Tuple[str, _SharedBuffer]]] = None) -> Tuple[Any, "_Call"]:
        """The uly_call_args of a call, and what must stay alive (and be done after it)."""
        is_torch: List[bool] = []
        operands = [self._operand(n, v, is_torch, pool=pool) for n, v in inputs]
        cuda = self._check_out_kind(operands, out)
        args = _capi.new(_capi.CallArgs)
        if cuda is not None:
            args.stream = _torch.current_stream(cuda) or None
        args.op = op
        args.head_offset = head_offset
        args.head_count = head_count
        for i, o in enumerate(operands):
            args.inputs[i] = ctypes.addressof(o.tensor)
        call = _Call(operands, out, is_torch)
        if out is not None:
            # gather_output_head_chunk writes a band only: a staged out starts as the caller's.
            call.out_op = self._operand("out", out, [], is_out=True,
                                        copy_in=op == _capi.OP_GATHER_OUTPUT_HEAD_CHUNK,
                                        pool=pool)
            if call.out_op.staged is not None and op != _capi.OP_GATHER_OUTPUT_HEAD_CHUNK:
                # Not in a shared buffer: take the result from the slot and copy it over.
                call.copy_out_later = True
            else:
                args.out = ctypes.addressof(call.out_op.tensor)
        call.args = args
        return args, call

    def _finish(self, call: "_Call", result: ctypes.c_void_p) -> ArrayLike:
        """What a call returns, once its result (a uly_result, or NULL with out) is there."""
        out, out_op = call.out, call.out_op
        if out is not None:
            if call.copy_out_later:
                slot = _Slot(result.value, self)
                if slot.device:  # host operands on a GPU backend: refused before this
                    slot.release()
                    raise InvalidArgumentError("out: the session's results are device memory; "
                                               "give out as a CUDA tensor")
                try:
                    view = self._slot_array(slot, out_op.array.dtype)
                    if view.shape != out_op.array.shape:
                        raise InvalidArgumentError("out: shape %s does not match the op's %s" % (
                            list(out_op.array.shape), list(view.shape)))
                    np.copyto(out_op.array, view)
                finally:
                    slot.release()
            elif out_op.staged is not None:
                np.copyto(out_op.array, out_op.staged)
            self._remember_out(out)
            return out
        slot = _Slot(result.value, self, call.args.stream)
        first = call.operands[0]
        like = first.array.dtype if first.array is not None else None
        torch_input = bool(call.is_torch and call.is_torch[0])
        self._remember_slot(slot, like, torch_input, True)
        return self._result(slot, like, torch_input)

    def _call(self, op: int, inputs: Sequence[Tuple[str, Any]], out: Optional[ArrayLike],
              head_offset: int = 0, head_count: int = 0) -> ArrayLike:
        args, call = self._call_args(op, inputs, out, head_offset, head_count)
        result = ctypes.c_void_p()
        want_result = out is None or call.copy_out_later
        _check(_capi.library().uly_session_call(
            self._handle.ptr, ctypes.byref(args), ctypes.byref(result) if want_result else None))
        return self._finish(call, result)

    def __enter__(self) -> "HeadExchange":
        return self

    def __repr__(self) -> str:
        return ("HeadExchange(id=%d, rank=%d/%d, heads=%d, head_dim=%d, dtype=%s, "
                "max_tokens=%d, slots=%d)" % (self.id, self.rank, self.world_size,
                                              self.num_heads, self.head_dim, self.dtype,
                                              self.max_tokens, self.num_slots))


class _Call:
    """One call's operands and out, kept alive while it runs."""

    def __init__(self, operands: List[_Operand], out: Any, is_torch: List[bool]):
        self.operands = operands
        self.out = out
        self.is_torch = is_torch
        self.out_op: Optional[_Operand] = None
        self.copy_out_later = False
        self.args: Any = None


class _Submitted:
    """What a submitted call and its wait share: the epoch, the call's operands and staging
    buffers kept alive until the one wait, which gives the buffers back whatever happens.
    Subclasses say how the result is collected (_collect)."""

    def __init__(self, session: Any, epoch: int, call: Any,
                 pool: List[Tuple[str, _SharedBuffer]]):
        self.session = session
        self.epoch = epoch
        self._call: Any = call
        self._pool = pool

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` returned (or raised) already."""
        return self._call is None

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Waits for the call (`timeout` seconds; None: 5 minutes) and returns what the call
        would have returned. An error the daemon found in the call is raised here. Once only:
        a second wait raises FailedPreconditionError."""
        call = self._call
        if call is None:
            raise FailedPreconditionError("epoch %d: already waited for" % self.epoch)
        ms = 0 if timeout is None else max(1, int(timeout * 1000))
        try:
            return self._collect(call, ms)
        finally:
            self._call = None
            self.session._give_back(self._pool)

    def _collect(self, call: Any, ms: int) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return "%s(epoch=%d, done=%s)" % (type(self).__name__, self.epoch, self.done)


class Pending(_Submitted):
    """A submitted call (:meth:`HeadExchange.submit`). :meth:`wait` gives what the op's method
    returns (a view of the receive slot, or `out`); until then its inputs, `out` and staging
    buffers stay alive. Wait for every submitted call (in any order; calls complete in
    submission order); an unwaited Pending keeps its staging buffers from reuse."""

    def _collect(self, call: "_Call", ms: int) -> ArrayLike:
        s = self.session
        result = ctypes.c_void_p()
        _check(_capi.library().uly_session_wait(s._handle.ptr, self.epoch, ms,
                                                ctypes.byref(result)))
        if call.out is not None and not call.copy_out_later:
            # The result was copied to out: it holds nothing.
            _capi.library().uly_result_free(result.value)
            result = ctypes.c_void_p()
        return s._finish(call, result)


class Client:
    """A connection to one ulyssesd (one GPU's daemon). Use :func:`connect`.

    Closing the client (or dropping it) detaches it: the daemon releases every buffer,
    session and slot the client holds. Arrays viewing its buffers and results stay readable.
    """

    def __init__(self, ptr: int):
        lib = _capi.library()
        self._handle = _Handle(ptr, "uly_client_free")
        self.id: int = lib.uly_client_id(ptr)
        self.backend: str = lib.uly_client_backend(ptr).decode()
        self.socket: str = lib.uly_client_socket(ptr).decode()
        self.uses_rings: bool = bool(lib.uly_client_uses_rings(ptr))
        self._starts: List[int] = []
        self._buffers: Dict[int, "weakref.ReferenceType[_SharedBuffer]"] = {}
        self._closed = False

    # -- buffers -----------------------------------------------------------------------------

    def _add_buffer(self, buf: _SharedBuffer) -> None:
        bisect.insort(self._starts, buf.address)
        start = buf.address

        def gone(_: Any) -> None:
            self._buffers.pop(start, None)
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                del self._starts[i]

        self._buffers[start] = weakref.ref(buf, gone)

    def _shared_strides(self, a: np.ndarray,
                        start: Optional[int] = None) -> Optional[List[int]]:
        """Element strides of `a` when it lies wholly inside one shared buffer of this client
        with positive strides (size-1 dimensions count as stride 1); None otherwise. `start`:
        `a`'s data address, when the caller has it."""
        if a.size == 0:
            return None
        if start is None:
            start = a.ctypes.data
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return None
        ref = self._buffers.get(self._starts[i])
        buf = ref() if ref is not None else None
        if buf is None:
            return None
        item = a.dtype.itemsize
        strides, last = [], start
        for n, s in zip(a.shape, a.strides):
            if n == 1:
                strides.append(1)
                continue
            if s <= 0 or s % item:
                return None
            strides.append(s // item)
            last += (n - 1) * s
        if last + item > buf.address + buf.size:
            return None
        return strides

    def empty(self, shape: Sequence[int], dtype: DTypeLike, name: str = "") -> ArrayLike:
        """A new zero-filled C-contiguous array in a shared buffer of this client: passing it
        (or a view of it) to a call costs no copy. A torch dtype gives a CPU torch tensor,
        anything else a numpy array (bfloat16 as uint16 bits). The buffer is freed when the
        last view of it is gone."""
        code = _dtype_code(dtype)
        np_dtype = _NUMPY_DTYPES[code]
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise InvalidArgumentError("shape: negative extent in %s" % (shape,))
        nbytes = max(int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize, 1)
        arr = _SharedBuffer(self, nbytes, name).array(shape, np_dtype)
        if _torch.is_dtype(dtype):
            return _torch.from_numpy(arr, code == _capi.DTYPE_BFLOAT16)
        return arr

    # -- groups and sessions -----------------------------------------------------------------

    def join_group(self, name: str, rank: int, world_size: int,
                   members: Optional[Sequence[str]] = None, backend: str = "auto",
                   timeout: Optional[float] = None) -> Group:
        """Collective: joins (forms) the group `name` of `world_size` ranks. Every rank passes
        the same name, world size and members; ``members[r]`` is rank r's daemon socket
        (None: this client's socket, for a group of one). `timeout` in seconds (None: the
        daemon's peer timeout)."""
        if members is None:
            if world_size != 1:
                raise InvalidArgumentError("members: needed when world_size is not 1")
            members = [self.socket]
        encoded = [str(m).encode() for m in members]
        arr = (ctypes.c_char_p * max(len(encoded), 1))(*encoded)
        spec = _capi.new(_capi.GroupSpec)
        spec.world_size = world_size
        spec.rank = rank
        spec.num_members = len(encoded)
        spec.name = name.encode()
        spec.members = arr
        spec.backend = backend.encode()
        spec.timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        out = ctypes.c_void_p()
        _check(_capi.library().uly_join_group(self._handle.ptr, ctypes.byref(spec),
                                              ctypes.byref(out)))
        return Group(self, out.value, name)

    def join_torch_group(self, process_group: Any = None, name: Optional[str] = None,
                         backend: str = "auto", timeout: Optional[float] = None) -> Group:
        """Collective over a torch.distributed process group (default: the world): forms the
        ulysses group of its ranks, each rank's daemon socket exchanged through it, so that a
        torchrun script needs no member list. `name` defaults to one that rank 0 picks."""
        return _torch.join_group(self, process_group, name, backend, timeout)

    def head_exchange(self, group: Group, num_heads: int, head_dim: int, dtype: DTypeLike,
                      max_tokens: int, num_slots: int = 2,
                      schedule: Optional[Sequence[int]] = None,
                      timeout: Optional[float] = None) -> HeadExchange:
        """Collective over `group`: creates a head-exchange session. Every rank passes the same
        arguments. `max_tokens` bounds B*S_l of every call; `num_slots` (1..8) receive slots
        are cycled by consecutive calls; `schedule` is an optional head-chunk schedule summing
        to H/W (e.g. [7, 14, 7])."""
        code = _dtype_code(dtype)
        sched = [int(c) for c in (schedule or [])]
        arr = (ctypes.c_int32 * max(len(sched), 1))(*sched)
        spec = _capi.new(_capi.SessionSpec)
        spec.num_heads = num_heads
        spec.head_dim = head_dim
        spec.dtype = code
        spec.max_tokens = max_tokens
        spec.num_slots = num_slots
        spec.schedule_length = len(sched)
        spec.schedule = arr
        spec.timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        out = ctypes.c_void_p()
        _check(_capi.library().uly_session_create(self._handle.ptr, group._handle.ptr,
                                                  ctypes.byref(spec), ctypes.byref(out)))
        return HeadExchange(self, group, out.value, num_heads, head_dim, code, max_tokens,
                            num_slots, sched)

    def qkv_norm_rope_exchange(self, group: Group, *, num_heads: int, head_dim: int,
                               max_tokens: int, w_qkv: ArrayLike, q_norm: ArrayLike,
                               k_norm: ArrayLike, cos_sin: ArrayLike,
                               hidden: Optional[int] = None, layout: str = "bshd",
                               num_slots: int = 2, max_pos: Optional[int] = None,
                               path: str = "auto",
                               timeout: Optional[float] = None) -> "QkvNormRopeExchange":
        """Collective over `group`: creates a fused ``qkv_norm_rope_exchange`` session and
        returns it, a callable: ``sess(x, positions, out=None)`` (docs/api.md section 2.1).
        Every rank passes the same geometry and path, and its own weights.

        `hidden` (default ``num_heads * head_dim``) must equal ``num_heads * head_dim`` and be
        a multiple of 64; `num_heads` divisible by the world size; `head_dim` even (128 on a
        GPU backend); `layout` ``"bshd"`` (q, k, v each ``[B, S_g, H/W, D]``) or ``"fused"``
        (one ``[B, S_g, H/W, 3D]``); `max_tokens` bounds ``B*S_l`` of every call; `max_pos`
        (default ``cos_sin.shape[0]``) the rows of the cos/sin table; `path` ``"auto"``,
        ``"per_operator"``, ``"chunked"`` or ``"epilogue"`` (GPU backends; the host backend
            ignores it; ``"auto"`` never takes ``"chunked"``, whose calls were seen to wait
            for another session's blocked call under MPS).

        Weights: `w_qkv` bfloat16 ``[3*H*D, hidden]`` (Q, K, V planes, head-major), `q_norm`
        and `k_norm` bfloat16 ``[D]``, `cos_sin` float32 ``[max_pos, D]`` (cos in the first
        half, sin in the second). On the host backend numpy arrays (bfloat16 as uint16 bits)
        or CPU tensors, copied once into a shared buffer of the session; on a GPU backend
        torch CUDA tensors, contiguous, used in place (registered like call operands; the
        session keeps them alive, and they must not change while it lives). Bad arguments
        raise :class:`InvalidArgumentError` (a ValueError) naming the argument."""
        from ._fused import create
        return create(self, group, hidden=hidden, num_heads=num_heads, head_dim=head_dim,
                      layout=layout, max_tokens=max_tokens, num_slots=num_slots,
                      max_pos=max_pos, w_qkv=w_qkv, q_norm=q_norm, k_norm=k_norm,
                      cos_sin=cos_sin, path=path, timeout=timeout)

    def close(self) -> None:
        """Detaches from the daemon, which releases everything this client holds. Idempotent."""
        if not self._closed:
            self._closed = True
            _check(_capi.library().uly_client_close(self._handle.ptr))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Client(id=%d, socket=%r, backend=%r)" % (self.id, self.socket, self.backend)


def connect(socket: Optional[str] = None, *, device: Optional[int] = None, name: str = "",
            use_rings: bool = True, timeout: float = 10.0) -> Client:
    """Connects to a daemon.

    `socket`: its control socket. None: ``$ULYSSES_SOCKET`` if set, else
    ``/run/ulysses/gpu<device>.sock``, where `device` defaults to ``$ULYSSES_DEVICE``, else
    torch's current CUDA device (when torch is imported and has initialised CUDA), else
    ``$LOCAL_RANK``, else 0. `name` is shown to operators. `use_rings`: calls through the
    shared-memory rings (else one RPC per call; results are the same). Raises
    :class:`UnavailableError` when no daemon answers within `timeout` seconds.
    """
    lib = _capi.library()
    opts = _capi.new(_capi.ConnectOptions)
    opts.abi_version = _capi.ABI_VERSION
    opts.socket = os.fspath(socket).encode() if socket else None
    opts.name = (name or os.path.basename(sys.argv[0]) or "python").encode()
    opts.device = _default_device() if device is None else int(device)
    opts.disable_rings = 0 if use_rings else 1
    opts.connect_timeout_ms = max(1, int(timeout * 1000))
    out = ctypes.c_void_p()
    _check(lib.uly_connect(ctypes.byref(opts), ctypes.byref(out)))
    return Client(out.value)
