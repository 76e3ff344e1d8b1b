"""torch support, without importing torch: every helper looks torch up in sys.modules (a
caller that passes a tensor has imported it) or imports it only when asked for a torch-only
feature."""
from __future__ import annotations

import ctypes
import os
import sys
import warnings
from typing import Any, Optional

import numpy as np

_slot_tensor_type: Any = None


def _torch() -> Any:
    return sys.modules.get("torch")


def is_available() -> bool:
    """Whether torch is imported (a caller that passes tensors has imported it)."""
    return _torch() is not None


def is_tensor(obj: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(obj, t.Tensor)


def is_dtype(obj: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(obj, t.dtype)


def is_device_tensor(t: Any) -> bool:
    # is_cpu is a flag of the tensor; t.device builds a torch.device object each time.
    return not t.is_cpu


def current_cuda_device() -> Optional[int]:
    """torch's current CUDA device, if torch is imported and has initialised CUDA."""
    t = _torch()
    if t is None or not hasattr(t, "cuda"):
        return None
    try:
        if t.cuda.is_initialized():
            return int(t.cuda.current_device())
    except Exception:
        return None
    return None


def to_numpy(t: Any) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor; bfloat16 as uint16 bits."""
    torch = _torch()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, bfloat16: bool) -> Any:
    """A CPU tensor viewing `a` (no copy); uint16 bits become bfloat16 when `bfloat16`."""
    torch = _torch()
    with warnings.catch_warnings():
        # Receive slots are mapped read-only; torch has no read-only tensors and says so.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a.view(np.int16) if bfloat16 else a)
    return t.view(torch.bfloat16) if bfloat16 else t


def _slot_tensor_class() -> Any:
    global _slot_tensor_type
    if _slot_tensor_type is None:
        torch = _torch()

        class SlotTensor(torch.Tensor):
            """A tensor viewing a receive slot: a CPU tensor on the host backend, a CUDA tensor
            on a GPU backend. Read-only: do not write into it (the slot is mapped read-only; on
            the device a kernel writing there faults); clone() it to get a tensor of your own.
            The slot is released by release() or when the tensor and its views are dropped.
            Operations on it return plain tensors."""

            __torch_function__ = torch._C._disabled_torch_function_impl

            def release(self) -> None:
                """Gives the receive slot back now; do not read the tensor afterwards."""
                slot = getattr(self, "_ulysses_slot", None)
                if slot is not None:
                    slot.release()

            @property
            def held(self) -> bool:
                slot = getattr(self, "_ulysses_slot", None)
                return slot is not None and slot.held

        _slot_tensor_type = SlotTensor
    return _slot_tensor_type


def slot_tensor(view: np.ndarray, bfloat16: bool, slot: Any) -> Any:
    """A SlotTensor over the numpy view of a slot; it keeps the view (and so the slot) alive."""
    t = from_numpy(view, bfloat16).as_subclass(_slot_tensor_class())
    t._ulysses_slot = slot
    return t


class DeviceSlot:
    """A receive slot in device memory (GPU backends), as ``__cuda_array_interface__``
    (version 3) describes it: ``torch.as_tensor(slot)``, ``cupy.asarray(slot)`` or numba view it
    without a copy, and keep this object (and so the slot) alive while they live. The data is
    valid in the order of the call's stream (torch's current stream at the call): work on
    that stream sees it; another stream must wait for that stream first. The interface's
    ``stream`` entry names that stream (1 for the legacy default stream), so consumers that
    follow version 3 (cupy, numba) order their use after it. It is also a DLPack producer
    (``__dlpack__``, ``__dlpack_device__``): ``torch.from_dlpack(slot)``, ``cupy.from_dlpack``
    or ``jax.dlpack.from_dlpack`` view it without a copy, and a consumer that names another
    stream gets a wait for the call's stream enqueued on its own (no host wait). Read-only,
    although the interface cannot say so (torch refuses the read-only flag): a kernel writing
    into it faults. bfloat16 results are exposed as int16 bits (``typestr`` ``<i2``); torch
    users get a bfloat16 tensor from the calls directly."""

    __slots__ = ("__cuda_array_interface__", "_slot", "_part", "_lib", "_device", "bfloat16",
                 "__weakref__")

    def __init__(self, slot: Any, typestr: str, bfloat16: bool, part: int = 0,
                 lib: Any = None):
        self._slot = slot
        self._part = part
        self._lib = lib  # the C library (for the DLPack export); None: no DLPack
        self._device: Optional[tuple] = None
        self.bfloat16 = bfloat16
        data, shape, _ = slot.parts[part]  # q, k or v of a fused call's slot: part 0, 1, 2
        stream = getattr(slot, "stream", None)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (int(data), False),
            "strides": None, "version": 3, "stream": int(stream) if stream else 1}

    @property
    def shape(self) -> tuple:
        return self.__cuda_array_interface__["shape"]

    @property
    def held(self) -> bool:
        """Whether the result still holds its slot."""
        return self._slot.held

    @property
    def epoch(self) -> int:
        return self._slot.epoch

    def release(self) -> None:
        """Gives the receive slot back now; do not read the data afterwards. Idempotent."""
        self._slot.release()

    def _export(self) -> int:
        """A DLManagedTensor of the result (its own reference on the slot)."""
        if self._lib is None:
            raise BufferError("DeviceSlot: made without the library; no DLPack export")
        managed = ctypes.c_void_p()
        status = self._lib.uly_result_to_dlpack(self._slot._handles[self._part].ptr,
                                                ctypes.byref(managed))
        if status != 0:
            raise BufferError("DeviceSlot: " + self._lib.uly_last_error().decode("utf-8", "replace"))
        return int(managed.value)

    def __dlpack_device__(self) -> tuple:
        """(kDLCUDA, device ordinal) of the slot, as the DLPack exchange protocol asks."""
        if self._device is None:
            managed = self._export()
            try:
                dl = _DLManagedTensor.from_address(managed).dl_tensor
                self._device = (int(dl.device_type), int(dl.device_id))
            finally:
                self._lib.uly_dlpack_free(managed)
        return self._device

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Optional[bool] = None) -> Any:
        """A "dltensor" capsule viewing the slot (DLPack 0.6+ legacy form, no copy). `stream`
        is the consumer's CUDA stream as the protocol gives it: None or 1 the legacy default
        stream, 2 the per-thread default stream, -1 no ordering, else a cudaStream_t. When it
        is not the call's stream, a wait for the call's stream is enqueued on it first."""
        if copy:
            raise BufferError("DeviceSlot: the result is shared in place; no copy is made "
                              "(copy=True)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError("DeviceSlot: dl_device %r: the slot is on %r"
                              % (tuple(dl_device), self.__dlpack_device__()))
        if stream == 0:
            raise ValueError("stream: 0 is ambiguous in the DLPack protocol; pass 1 for the "
                             "legacy default stream")
        if stream != -1:
            consumer = _protocol_stream(1 if stream is None else int(stream))
            producer = _protocol_stream(int(self._slot.stream or 1))
            if consumer != producer:
                status = self._lib.uly_stream_wait(consumer, producer)
                if status != 0:
                    raise BufferError("stream: " + self._lib.uly_last_error().decode(
                        "utf-8", "replace"))
        return _owned_capsule(self._lib, self._export())

    def __repr__(self) -> str:
        return "DeviceSlot(shape=%s, typestr=%r, epoch=%d, held=%s)" % (
            self.shape, self.__cuda_array_interface__["typestr"], self.epoch, self.held)


def _protocol_stream(stream: int) -> Optional[int]:
    """A stream as the DLPack protocol names it, as a cudaStream_t for the C library (None is
    NULL, the legacy default stream)."""
    if stream == 1:
        return None
    if stream == 2:
        return 2  # cudaStreamPerThread
    return stream


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", ctypes.c_uint32), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]

    @property
    def device_type(self) -> int:
        return self.device.device_type

    @property
    def device_id(self) -> int:
        return self.device.device_id


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


# A capsule that no consumer took (its name still "dltensor") gives its tensor back when it
# goes: the destructor runs the tensor's deleter. Consumers rename what they take.
_DLTENSOR_NAME = ctypes.c_char_p(b"dltensor")
_capsule_api: Any = None


def _capsule_functions() -> Any:
    global _capsule_api
    if _capsule_api is None:
        api = ctypes.pythonapi
        new = api.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        valid = api.PyCapsule_IsValid
        valid.restype = ctypes.c_int
        valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        pointer = api.PyCapsule_GetPointer
        pointer.restype = ctypes.c_void_p
        pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        _capsule_api = (new, valid, pointer)
    return _capsule_api


_free_unconsumed: Any = None


def _owned_capsule(lib: Any, managed: int) -> Any:
    """A "dltensor" capsule of `managed` whose destructor frees it unless a consumer took it."""
    global _free_unconsumed
    new, valid, pointer = _capsule_functions()
    if _free_unconsumed is None:
        free = lib.uly_dlpack_free

        @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        def destructor(capsule: int) -> None:
            if valid(capsule, _DLTENSOR_NAME):
                free(pointer(capsule, _DLTENSOR_NAME))

        _free_unconsumed = destructor  # kept for the life of the process
    try:
        # The name must outlive the capsule: _DLTENSOR_NAME's buffer lives as long as the module.
        return new(managed, _DLTENSOR_NAME, ctypes.cast(_free_unconsumed, ctypes.c_void_p))
    except BaseException:
        lib.uly_dlpack_free(managed)
        raise


_raw_stream: Any = None  # torch._C._cuda_getCurrentRawStream, or False where torch lacks it


def current_stream(t: Any) -> int:
    """The cudaStream_t of torch's current stream on the device of CUDA tensor `t` (0 for the
    legacy default stream)."""
    global _raw_stream
    torch = _torch()
    # The raw lookup costs a fifth of a microsecond; building a torch.cuda.Stream costs about
    # six. Older torch builds without it take the public way.
    raw = _raw_stream
    if raw is None:
        raw = _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or False
    if raw:
        return raw(t.get_device())
    return int(torch.cuda.current_stream(t.device).cuda_stream)


def _dltensor_capsule(managed: int) -> Any:
    """A PyCapsule named "dltensor" around a DLManagedTensor pointer, as from_dlpack takes it."""
    new, _, _ = _capsule_functions()
    return new(managed, _DLTENSOR_NAME, None)


_from_capsule: Any = None


def dlpack_slot_tensor(lib: Any, managed: int, slot: Any) -> Any:
    """A CUDA SlotTensor over a result exported by uly_result_to_dlpack (the DLManagedTensor
    `managed`), no copy: the tensor's storage holds its own reference on the result, so the
    slot stays held while any view of the storage lives (or until release())."""
    global _from_capsule
    if _from_capsule is None:
        torch = _torch()
        # The C entry that torch.utils.dlpack.from_dlpack ends in for a capsule (its Python
        # wrapper first asks the argument for __dlpack__).
        _from_capsule = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
    try:
        t = _from_capsule(_dltensor_capsule(managed))
    except BaseException:
        lib.uly_dlpack_free(managed)  # no consumer took it: its deleter runs here
        raise
    t = t.as_subclass(_slot_tensor_class())
    t._ulysses_slot = slot
    return t


def join_group(client: Any, process_group: Any, name: Optional[str], backend: str,
               timeout: Optional[float]) -> Any:
    import torch.distributed as dist  # only this helper needs torch.distributed

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("join_torch_group: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    socket = os.path.abspath(client.socket)
    members: list = [None] * world
    dist.all_gather_object(members, socket, group=process_group)
    if name is None:
        # Rank 0 names the group, unique per process and call, so that two groups formed from
        # the same ranks do not collide in their daemons.
        global _groups_formed
        _groups_formed += 1
        pick = ["torch-%d-%d" % (os.getpid(), _groups_formed)]
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(pick, src=src, group=process_group)
        name = pick[0]
    return client.join_group(name, rank, world, members=members, backend=backend,
                             timeout=timeout)


_groups_formed = 0
