"""Exceptions raised for the status codes of the C ABI.

Every exception carries the library's (or the daemon's) message and the status code. Bad
arguments raise InvalidArgumentError, a ValueError; every other code raises a RuntimeError
subclass. ``except ulysses.Error`` catches them all.
"""
from __future__ import annotations

from typing import Dict, Type


class Error(Exception):
    """Base of every error this package raises for a status code."""

    code: int = 2
    status: str = "UNKNOWN"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgumentError(Error, ValueError):
    """A bad shape, stride, band, dtype, buffer or spec; the message names the argument."""
    code, status = 3, "INVALID_ARGUMENT"


class CancelledError(Error, RuntimeError):
    code, status = 1, "CANCELLED"


class UnknownError(Error, RuntimeError):
    code, status = 2, "UNKNOWN"


class DeadlineExceededError(Error, RuntimeError):
    """Ranks missing at a collective, or a wait (peer, held slot, completion) past its bound."""
    code, status = 4, "DEADLINE_EXCEEDED"


class NotFoundError(Error, RuntimeError):
    code, status = 5, "NOT_FOUND"


class AlreadyExistsError(Error, RuntimeError):
    code, status = 6, "ALREADY_EXISTS"


class PermissionDeniedError(Error, RuntimeError):
    code, status = 7, "PERMISSION_DENIED"


class ResourceExhaustedError(Error, RuntimeError):
    """Over a capacity: B*S_l above max_tokens, or the daemon's slot memory."""
    code, status = 8, "RESOURCE_EXHAUSTED"


class FailedPreconditionError(Error, RuntimeError):
    """The session or slot is not in a state that allows the call (closed, broken, ...)."""
    code, status = 9, "FAILED_PRECONDITION"


class AbortedError(Error, RuntimeError):
    """A peer failed, closed its session or died during a collective call."""
    code, status = 10, "ABORTED"


class OutOfRangeError(Error, RuntimeError):
    code, status = 11, "OUT_OF_RANGE"


class UnimplementedError(Error, NotImplementedError):
    """Not in this build, e.g. CUDA tensors before the GPU data plane (a RuntimeError)."""
    code, status = 12, "UNIMPLEMENTED"


class InternalError(Error, RuntimeError):
    code, status = 13, "INTERNAL"


class UnavailableError(Error, RuntimeError):
    """No daemon at the socket, the daemon went away, or it is draining."""
    code, status = 14, "UNAVAILABLE"


class DataLossError(Error, RuntimeError):
    code, status = 15, "DATA_LOSS"


class UnauthenticatedError(Error, RuntimeError):
    """A call after the client closed, or after the daemon reclaimed it."""
    code, status = 16, "UNAUTHENTICATED"


_BY_CODE: Dict[int, Type[Error]] = {
    cls.code: cls for cls in (
        CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError,
        NotFoundError, AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError,
        FailedPreconditionError, AbortedError, OutOfRangeError, UnimplementedError,
        InternalError, UnavailableError, DataLossError, UnauthenticatedError)
}


def error_for(code: int, message: str) -> Error:
    """The exception for a non-OK status code."""
    return _BY_CODE.get(code, UnknownError)(message)
