"""The error catalog: millpond error classes <-> gRPC status codes.

One table, used in both directions: the server's translator turns an engine
error into (status, code), the client turns a failed call back into the
same-named exception using the code in trailing metadata. Nothing here
matches on message text.
"""

from __future__ import annotations

import grpc

from millpond import errors as e

ERROR_CODE_KEY = "millpond-error-code"

# Looked up along the exception's MRO, so subclasses inherit their parent's row.
STATUS_BY_ERROR: dict[type[e.ReplayError], grpc.StatusCode] = {
    e.InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    e.NotEnoughDataError: grpc.StatusCode.FAILED_PRECONDITION,
    e.BufferClosedError: grpc.StatusCode.FAILED_PRECONDITION,
    e.ReadOnlyBufferError: grpc.StatusCode.FAILED_PRECONDITION,
    e.BufferDamagedError: grpc.StatusCode.FAILED_PRECONDITION,
    e.BufferNotFoundError: grpc.StatusCode.NOT_FOUND,
    e.ConfigMismatchError: grpc.StatusCode.ALREADY_EXISTS,
    e.FileConflictError: grpc.StatusCode.ALREADY_EXISTS,
    e.StorageFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.MessageTooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    e.CorruptFileError: grpc.StatusCode.DATA_LOSS,
    e.StorageIOError: grpc.StatusCode.DATA_LOSS,
    e.DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    e.ServerUnavailableError: grpc.StatusCode.UNAVAILABLE,
    e.InternalError: grpc.StatusCode.INTERNAL,
    e.AuthenticationError: grpc.StatusCode.UNAUTHENTICATED,
    e.PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    e.ReplayError: grpc.StatusCode.UNKNOWN,
}

# For failures that carry no millpond code (raised by gRPC itself).
_ERROR_BY_STATUS: dict[grpc.StatusCode, type[e.ReplayError]] = {
    grpc.StatusCode.UNAVAILABLE: e.ServerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: e.DeadlineExceededError,
    # gRPC's own limits: concurrent calls (--max-concurrent-calls), message size.
    grpc.StatusCode.RESOURCE_EXHAUSTED: e.LimitExceededError,
    grpc.StatusCode.NOT_FOUND: e.BufferNotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: e.InvalidArgumentError,
    grpc.StatusCode.INTERNAL: e.InternalError,
    grpc.StatusCode.UNAUTHENTICATED: e.AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: e.PermissionDeniedError,
}

_CLASSES_BY_CODE = e.error_classes()


def status_for(error: e.ReplayError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and stable code to report for an engine error."""
    for cls in type(error).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls], type(error).code
    return grpc.StatusCode.UNKNOWN, e.ReplayError.code


def error_from_rpc(error: grpc.RpcError) -> e.ReplayError:
    """The typed exception for a failed call (code from trailers, else status)."""
    code = None
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == ERROR_CODE_KEY:
            code = value
    status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(status)
    cls = (code is not None and _CLASSES_BY_CODE.get(code)) or _ERROR_BY_STATUS.get(status, e.ReplayError)
    return cls(details)
