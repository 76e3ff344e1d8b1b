"""ctypes declarations of the C ABI (ulysses/c_api.h) and the loading of the library.

The structs mirror the header field for field; each starts with its own size, which the
library checks, so a mismatch is an error rather than a misread.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Optional

ABI_VERSION_MAJOR = 1
ABI_VERSION_MINOR = 5
ABI_VERSION = (ABI_VERSION_MAJOR << 16) | ABI_VERSION_MINOR
MAX_DIMS = 8

# uly_status
OK = 0
INVALID_ARGUMENT = 3

# uly_dtype
DTYPE_FLOAT16 = 1
DTYPE_BFLOAT16 = 2
DTYPE_FLOAT32 = 3
DTYPE_INT32 = 4  # the fused call's positions

# uly_device_kind
DEVICE_HOST = 1
DEVICE_CUDA = 2

# uly_op
OP_SCATTER_HEADS = 1
OP_GATHER_HEADS = 2
OP_SCATTER_QKV_HEAD_CHUNK = 3
OP_GATHER_OUTPUT_HEAD_CHUNK = 4

# uly_qkv_layout, uly_fused_path
QKV_LAYOUTS = {"bshd": 1, "fused": 2}
FUSED_PATHS = {"auto": 0, "per_operator": 1, "chunked": 2, "epilogue": 3}
MAX_FUSED_RESULTS = 3
#: Byte alignment the fused session needs of x and of its weights.
FUSED_ALIGN_BYTES = 32

_i32 = ctypes.c_int32
_u32 = ctypes.c_uint32
_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p
_cp = ctypes.c_char_p


class ConnectOptions(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("abi_version", _u32), ("socket", _cp), ("name", _cp),
                ("device", _i32), ("disable_rings", _i32), ("connect_timeout_ms", _i64)]


class GroupSpec(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("world_size", _i32), ("rank", _i32),
                ("num_members", _i32), ("name", _cp), ("members", ctypes.POINTER(_cp)),
                ("backend", _cp), ("timeout_ms", _i64)]


class SessionSpec(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("num_heads", _i32), ("head_dim", _i32), ("dtype", _i32),
                ("max_tokens", _i64), ("num_slots", _i32), ("schedule_length", _i32),
                ("schedule", ctypes.POINTER(_i32)), ("timeout_ms", _i64)]


class Tensor(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("device_kind", _i32), ("dtype", _i32), ("ndim", _i32),
                ("buffer_id", _u64), ("byte_offset", _u64), ("data", _vp),
                ("device_index", _i32), ("reserved", _i32),
                ("shape", _i64 * MAX_DIMS), ("strides", _i64 * MAX_DIMS)]


# The per-call structs take their Tensors' addresses (ctypes.addressof: the caller keeps the
# Tensors alive), as a ctypes pointer object costs more to make than the rest of the arguments.
class CallArgs(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("op", _i32), ("head_offset", _i32), ("head_count", _i32),
                ("inputs", _vp * 3), ("out", _vp),
                ("stream", _vp), ("timeout_ms", _i64)]


class ResultInfo(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("slot", _i32), ("epoch", _u64), ("device_kind", _i32),
                ("dtype", _i32), ("ndim", _i32), ("held", _i32),
                ("shape", _i64 * MAX_DIMS), ("strides", _i64 * MAX_DIMS),
                ("data", _vp), ("bytes", _u64), ("daemon_us", _i64)]


class FusedSessionSpec(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("hidden", _i32), ("num_heads", _i32), ("head_dim", _i32),
                ("layout", _i32), ("path", _i32), ("num_slots", _i32), ("max_pos", _i32),
                ("max_tokens", _i64), ("w_qkv", ctypes.POINTER(Tensor)),
                ("q_norm", ctypes.POINTER(Tensor)), ("k_norm", ctypes.POINTER(Tensor)),
                ("cos_sin", ctypes.POINTER(Tensor)), ("timeout_ms", _i64)]


class FusedCallArgs(ctypes.Structure):
    _fields_ = [("struct_size", _u32), ("reserved", _i32), ("x", _vp), ("positions", _vp),
                ("out", _vp),
                ("stream", _vp)]


def new(struct_type: type) -> ctypes.Structure:
    """A zeroed struct with its struct_size set."""
    s = struct_type()
    s.struct_size = ctypes.sizeof(struct_type)
    return s


_P = ctypes.POINTER
# name: (restype, argtypes)
_SIGNATURES = {
    "uly_abi_version": (_u32, []),
    "uly_cuda_built": (_i32, []),
    "uly_version": (_cp, []),
    "uly_last_error": (_cp, []),
    "uly_status_name": (_cp, [_i32]),
    "uly_connect": (_i32, [_P(ConnectOptions), _P(_vp)]),
    "uly_client_close": (_i32, [_vp]),
    "uly_client_free": (None, [_vp]),
    "uly_client_id": (_u64, [_vp]),
    "uly_client_backend": (_cp, [_vp]),
    "uly_client_socket": (_cp, [_vp]),
    "uly_client_uses_rings": (_i32, [_vp]),
    "uly_buffer_alloc": (_i32, [_vp, _u64, _cp, _P(_vp)]),
    "uly_buffer_free": (_i32, [_vp]),
    "uly_buffer_id": (_u64, [_vp]),
    "uly_buffer_data": (_vp, [_vp]),
    "uly_buffer_size": (_u64, [_vp]),
    "uly_join_group": (_i32, [_vp, _P(GroupSpec), _P(_vp)]),
    "uly_group_free": (None, [_vp]),
    "uly_group_id": (_u64, [_vp]),
    "uly_group_rank": (_i32, [_vp]),
    "uly_group_world_size": (_i32, [_vp]),
    "uly_group_backend": (_cp, [_vp]),
    "uly_group_backend_reason": (_cp, [_vp]),
    "uly_session_create": (_i32, [_vp, _vp, _P(SessionSpec), _P(_vp)]),
    "uly_session_close": (_i32, [_vp]),
    "uly_session_free": (None, [_vp]),
    "uly_session_id": (_u64, [_vp]),
    "uly_session_backend": (_cp, [_vp]),
    "uly_session_poison_slots": (_i32, [_vp, _P(_i32)]),
    "uly_session_call": (_i32, [_vp, _P(CallArgs), _P(_vp)]),
    "uly_session_submit": (_i32, [_vp, _P(CallArgs), _P(_u64)]),
    "uly_session_wait": (_i32, [_vp, _u64, _i64, _P(_vp)]),
    "uly_session_create_fused": (_i32, [_vp, _vp, _P(FusedSessionSpec), _P(_vp)]),
    "uly_session_qkv_norm_rope_exchange": (_i32, [_vp, _P(FusedCallArgs), _P(_vp), _P(_i32)]),
    "uly_session_qkv_norm_rope_submit": (_i32, [_vp, _P(FusedCallArgs), _P(_u64)]),
    "uly_session_qkv_norm_rope_wait": (_i32, [_vp, _u64, _i64, _P(_vp), _P(_i32)]),
    "uly_session_describe": (_i32, [_vp, _P(_cp)]),
    "uly_result_get_info": (_i32, [_vp, _P(ResultInfo)]),
    "uly_result_release": (_i32, [_vp]),
    "uly_result_free": (None, [_vp]),
    "uly_result_to_dlpack": (_i32, [_vp, _P(_vp)]),
    "uly_dlpack_free": (None, [_vp]),
    "uly_stream_wait": (_i32, [_vp, _vp]),
    "uly_group_leave": (_i32, [_vp]),
}

LIBRARY_NAME = "libulysses_client.so.%d" % ABI_VERSION_MAJOR
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def _candidates() -> list:
    env = os.environ.get("ULYSSES_LIBRARY")
    if env:
        return [env]  # an explicit choice is not second-guessed
    here = Path(__file__).resolve().parent
    beside = [here / LIBRARY_NAME, here / "libulysses_client.so"]
    return [str(p) for p in beside if p.exists()] + [LIBRARY_NAME, "libulysses_client.so"]


def library() -> ctypes.CDLL:
    """The loaded C library, loaded on first use. Raises OSError naming every place tried."""
    global _lib
    lib = _lib  # loaded: every call of every op asks, and needs no lock
    if lib is not None:
        return lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        lib = None
        for c in _candidates():
            try:
                lib = ctypes.CDLL(c)
                break
            except OSError as e:
                tried.append("%s (%s)" % (c, e))
        if lib is None:
            raise OSError("ulysses: cannot load libulysses_client; set ULYSSES_LIBRARY to its "
                          "path. Tried: " + "; ".join(tried))
        lib.uly_abi_version.restype = _u32
        lib.uly_abi_version.argtypes = []
        version = lib.uly_abi_version()
        major, minor = version >> 16, version & 0xffff
        if major != ABI_VERSION_MAJOR or minor < ABI_VERSION_MINOR:
            raise OSError("ulysses: %s implements C ABI %d.%d, this package needs %d.%d or a "
                          "later %d.x" % (getattr(lib, "_name", "?"), major, minor,
                                          ABI_VERSION_MAJOR, ABI_VERSION_MINOR,
                                          ABI_VERSION_MAJOR))
        for name, (restype, argtypes) in _SIGNATURES.items():
            f = getattr(lib, name)
            f.restype = restype
            f.argtypes = argtypes
        _lib = lib
        return lib
