"""Bad arguments raise ValueError (ulysses.InvalidArgumentError) naming the argument; other
refusals raise the RuntimeError subclass of their status code, with the daemon's message.
Nothing is written by a refused call."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import ulysses
from ulysses import _capi
from helpers import run_ranks, unique


@pytest.fixture
def solo(sockets):
    """A client and a session on a group of one: H=4, D=2, float32, max_tokens 8."""
    c = ulysses.connect(sockets[0], name="errors")
    g = c.join_group(unique(), 0, 1)
    hx = c.head_exchange(g, 4, 2, "float32", 8)
    yield c, hx
    hx.close()
    c.close()


def x_of(shape=(1, 4, 4, 2), dtype=np.float32):
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def test_exception_classes_map_the_status_codes():
    assert issubclass(ulysses.InvalidArgumentError, ValueError)
    assert not issubclass(ulysses.InvalidArgumentError, RuntimeError)
    for cls in (ulysses.AbortedError, ulysses.UnavailableError, ulysses.DeadlineExceededError,
                ulysses.ResourceExhaustedError, ulysses.FailedPreconditionError,
                ulysses.UnimplementedError, ulysses.UnauthenticatedError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, ulysses.Error)
        assert not issubclass(cls, ValueError)
    assert ulysses.AbortedError.code == 10 and ulysses.AbortedError.status == "ABORTED"


@pytest.mark.parametrize("bad,argument", [
    (x_of(dtype=np.float16), "x: dtype float16 is not the session's float32"),
    (x_of((1, 4, 3, 2)), "x: shape [1, 4, 3, 2] does not match the op's [1, 4, 4, 2]"),
    (x_of((1, 4, 8)), "x: ndim 3, this op takes 4-D tensors"),
])
def test_bad_operands_raise_value_error_naming_the_argument(solo, bad, argument):
    _, hx = solo
    with pytest.raises(ValueError) as e:
        hx.scatter_heads(bad)
    assert str(e.value).startswith(argument)
    assert isinstance(e.value, ulysses.InvalidArgumentError)
    # Nothing was issued: the next call is epoch 1.
    assert hx.scatter_heads(x_of()).epoch == 1


def test_non_arrays_raise_type_error(solo):
    _, hx = solo
    with pytest.raises(TypeError, match="x: expected a numpy array"):
        hx.scatter_heads([[1.0]])


def test_capacity_raises_resource_exhausted(solo):
    _, hx = solo
    with pytest.raises(ulysses.ResourceExhaustedError, match="max_tokens 8") as e:
        hx.scatter_heads(x_of((3, 4, 4, 2)))
    assert isinstance(e.value, RuntimeError)


def test_bands_and_out_are_checked(solo):
    c, hx = solo
    q = x_of()
    with pytest.raises(ValueError, match="head"):
        hx.scatter_qkv_head_chunk(q, q, q, 3, 2)  # [3, 5) is past H_l = 4
    with pytest.raises(ValueError, match="out: shape"):
        hx.scatter_heads(q, out=np.empty((1, 4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="out: shape"):
        hx.scatter_heads(q, out=c.empty((1, 4, 4, 3), "float32"))
    readonly = np.empty_like(q)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out: the array is read-only"):
        hx.scatter_heads(q, out=readonly)
    with pytest.raises(ValueError, match="out: gather_output_head_chunk needs out"):
        hx.gather_output_head_chunk(x_of((1, 4, 1, 2)), 0, 1, None)
    # out may not overlap an input (the shared validator's rule).
    shared = c.empty((1, 4, 4, 2), "float32")
    with pytest.raises(ValueError, match="overlap"):
        hx.scatter_heads(shared, out=shared)


def test_bad_specs_raise_value_error(sockets):
    with ulysses.connect(sockets[0]) as c:
        g = c.join_group(unique(), 0, 1)
        with pytest.raises(ValueError, match="num_slots"):
            c.head_exchange(g, 4, 2, "float32", 8, num_slots=9)
        with pytest.raises(ValueError, match="schedule"):
            c.head_exchange(g, 4, 2, "float32", 8, schedule=[1, 2])
        with pytest.raises(ValueError, match="dtype"):
            c.head_exchange(g, 4, 2, "int8", 8)
        with pytest.raises(ValueError, match="members"):
            c.join_group(unique(), 0, 2)


def test_ranks_that_disagree_all_get_value_error(sockets):
    name = unique()

    def rank(r):
        c = ulysses.connect(sockets[r])
        try:
            g = c.join_group(name, r, 2, members=sockets[:2])
            with pytest.raises(ValueError) as e:
                c.head_exchange(g, 4, 2 + r, "float32", 8)  # head_dim differs between ranks
            return str(e.value)
        finally:
            c.close()

    messages = run_ranks(2, rank)
    assert all(m for m in messages)


def test_no_daemon_raises_unavailable(tmp_path):
    with pytest.raises(ulysses.UnavailableError, match="no ulyssesd answers") as e:
        ulysses.connect(str(tmp_path / "none.sock"), timeout=0.2)
    assert isinstance(e.value, RuntimeError)


def test_default_socket_comes_from_the_environment(sockets, monkeypatch):
    monkeypatch.setenv("ULYSSES_SOCKET", sockets[1])
    with ulysses.connect() as c:
        assert c.socket == sockets[1]
    monkeypatch.delenv("ULYSSES_SOCKET")
    monkeypatch.setenv("ULYSSES_DEVICE", "7")
    with pytest.raises(ulysses.UnavailableError, match="/run/ulysses/gpu7.sock"):
        ulysses.connect(timeout=0.1)


def test_calls_after_close_raise_unauthenticated(sockets):
    c = ulysses.connect(sockets[0])
    g = c.join_group(unique(), 0, 1)
    hx = c.head_exchange(g, 4, 2, "float32", 8)
    kept = c.empty((1, 4, 4, 2), "float32")
    kept[...] = 3.0
    c.close()
    c.close()  # idempotent
    with pytest.raises(ulysses.UnauthenticatedError):
        c.head_exchange(g, 4, 2, "float32", 8)
    with pytest.raises(ulysses.Error):
        hx.scatter_heads(kept)
    assert (kept == 3.0).all()  # the buffer's memory stays readable after the client closed


def test_the_c_abi_refuses_what_a_host_session_cannot_take(solo):
    """A host-backend session takes neither CUDA tensors nor a stream: INVALID_ARGUMENT naming
    them (FAILED_PRECONDITION from a library built without CUDA); then bad host tensors."""
    c, hx = solo
    lib = _capi.library()
    shared = c.empty((1, 4, 4, 2), "float32")
    t = _capi.new(_capi.Tensor)
    t.device_kind, t.dtype, t.ndim = _capi.DEVICE_HOST, _capi.DTYPE_FLOAT32, 4
    t.data = shared.ctypes.data
    for i, n in enumerate(shared.shape):
        t.shape[i] = n
    args = _capi.new(_capi.CallArgs)
    args.op = _capi.OP_SCATTER_HEADS
    args.inputs[0] = ctypes.addressof(t)
    result = ctypes.c_void_p()
    call = lambda: lib.uly_session_call(hx._handle.ptr, ctypes.byref(args), ctypes.byref(result))

    built = lib.uly_cuda_built() == 1
    refused = 3 if built else 9  # INVALID_ARGUMENT | FAILED_PRECONDITION
    why = b"the session runs on the host backend" if built else b"without CUDA"
    args.stream = 1
    assert call() == refused and lib.uly_last_error().startswith(b"stream: ")
    assert why in lib.uly_last_error()
    args.stream = None
    t.device_kind = _capi.DEVICE_CUDA
    assert call() == refused and lib.uly_last_error().startswith(b"x: ")
    assert why in lib.uly_last_error()
    t.device_kind = 7
    assert call() == 3 and lib.uly_last_error() == b"x: unknown device_kind 7"
    t.device_kind = _capi.DEVICE_HOST
    t.struct_size = 8
    assert call() == 3 and b"struct_size" in lib.uly_last_error()
    t.struct_size = ctypes.sizeof(_capi.Tensor)
    t.data = None
    assert call() == 3 and lib.uly_last_error().startswith(b"x: neither buffer_id nor data")
    t.data = x_of().ctypes.data  # not a shared buffer of this client
    keep = x_of()
    t.data = keep.ctypes.data
    assert call() == 3 and b"does not point into a shared buffer" in lib.uly_last_error()
    t.data = shared.ctypes.data
    assert call() == 0
    lib.uly_result_free(result.value)


def test_an_abi_of_another_major_version_is_refused(sockets):
    lib = _capi.library()
    opts = _capi.new(_capi.ConnectOptions)
    opts.abi_version = (_capi.ABI_VERSION_MAJOR + 1) << 16
    opts.socket = sockets[0].encode()
    out = ctypes.c_void_p()
    assert lib.uly_connect(ctypes.byref(opts), ctypes.byref(out)) == 9  # FAILED_PRECONDITION
    assert b"abi_version" in lib.uly_last_error() and not out.value


def test_a_caller_of_an_older_minor_version_is_served(sockets):
    lib = _capi.library()
    assert lib.uly_abi_version() == _capi.ABI_VERSION == (1 << 16) | 5
    opts = _capi.new(_capi.ConnectOptions)
    opts.socket = sockets[0].encode()
    out = ctypes.c_void_p()
    for minor in (0, 1, 2):  # 1.0, 1.1 and 1.2
        opts.abi_version = (_capi.ABI_VERSION_MAJOR << 16) | minor
        assert lib.uly_connect(ctypes.byref(opts), ctypes.byref(out)) == 0, lib.uly_last_error()
        lib.uly_client_free(out.value)
    opts.abi_version = _capi.ABI_VERSION + 1  # a newer minor than the library's
    assert lib.uly_connect(ctypes.byref(opts), ctypes.byref(out)) == 9 and not out.value


def test_the_last_error_is_per_thread(sockets):
    lib = _capi.library()
    with pytest.raises(ValueError):
        ulysses.connect(sockets[0]).join_group("", 0, 1)
    mine = lib.uly_last_error()
    seen = []
    t = threading.Thread(target=lambda: seen.append(lib.uly_last_error()))
    t.start()
    t.join()
    assert mine.startswith(b"name: ") and seen == [b""]


def test_a_missing_library_is_named(tmp_path):
    env = dict(os.environ, ULYSSES_LIBRARY=str(tmp_path / "nope.so"))
    p = subprocess.run([sys.executable, "-c", "import ulysses; ulysses.connect()"], env=env,
                       capture_output=True, text=True)
    assert p.returncode != 0 and "set ULYSSES_LIBRARY" in p.stderr and "nope.so" in p.stderr


def test_a_stream_waits_for_itself_without_cuda_work_and_a_build_without_cuda_says_so():
    lib = _capi.library()
    rc = lib.uly_stream_wait(None, None)
    if lib.uly_cuda_built():
        assert rc == 0, lib.uly_last_error()  # the same stream: nothing to order
    else:
        assert rc == 12 and b"without CUDA" in lib.uly_last_error()  # UNIMPLEMENTED
