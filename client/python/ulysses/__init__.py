"""ulysses: the Python client of ulyssesd.

ulyssesd is a per-GPU communication daemon for Ulysses sequence parallelism: each rank's
framework process connects to its GPU's daemon, joins a group with the other ranks, and runs
the head exchanges of its attention layers through it::

    import ulysses
    client = ulysses.connect()                     # $ULYSSES_SOCKET or /run/ulysses/gpuN.sock
    group = client.join_torch_group()              # or client.join_group(name, rank, W, members)
    hx = client.head_exchange(group, num_heads=H, head_dim=D, dtype="float32", max_tokens=B * S)
    q_band = hx.scatter_heads(q)                   # [B,S_l,H,D] -> [B,S_g,H/W,D], a slot view
    ...
    o = hx.gather_heads(o_band, out=o_local)       # [B,S_g,H/W,D] -> [B,S_l,H,D]

    # The fused front end: QKV projection + QK-RMSNorm + RoPE + head exchange in one call.
    sess = client.qkv_norm_rope_exchange(group, num_heads=H, head_dim=D, max_tokens=B * S,
                                         w_qkv=w, q_norm=qn, k_norm=kn, cos_sin=cs)
    q, k, v = sess(x_tokens, positions)            # each [B,S_g,H/W,D], views of one slot

The package is ctypes over the library's C ABI and loads libulysses_client.so from
``$ULYSSES_LIBRARY``, from beside the package, or from the loader's search path.
"""
from ._capi import ABI_VERSION
from ._client import Client, Group, HeadExchange, Pending, SlotArray, connect, release
from ._fused import FusedPending, QkvNormRopeExchange
from ._torch import DeviceSlot
from ._errors import (AbortedError, AlreadyExistsError, CancelledError, DataLossError,
                      DeadlineExceededError, Error, FailedPreconditionError, InternalError,
                      InvalidArgumentError, NotFoundError, OutOfRangeError,
                      PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError,
                      UnavailableError, UnimplementedError, UnknownError)

__version__ = "0.1.0"


def cuda_built() -> bool:
    """Whether the loaded libulysses_client was built with CUDA (takes CUDA tensors on GPU
    backends)."""
    from ._capi import library
    return bool(library().uly_cuda_built())


def library_version() -> str:
    """The release version of the loaded libulysses_client."""
    from ._capi import library
    return library().uly_version().decode()


__all__ = [
    "ABI_VERSION", "Client", "DeviceSlot", "FusedPending", "Group", "HeadExchange", "Pending",
    "QkvNormRopeExchange", "SlotArray", "connect",
    "release", "cuda_built", "library_version", "Error", "AbortedError", "AlreadyExistsError",
    "CancelledError", "DataLossError", "DeadlineExceededError", "FailedPreconditionError",
    "InternalError", "InvalidArgumentError", "NotFoundError", "OutOfRangeError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError",
    "UnavailableError", "UnimplementedError", "UnknownError",
]
