"""The one exception hierarchy of millpond.

Every error the engine raises is a :class:`ReplayError`. Each concrete error
also inherits the builtin a Python user would expect (``ValueError`` for bad
arguments, ``KeyError`` for an unknown buffer, ...), so ``except ValueError``
keeps working for code written against the reference API.

Each class carries a stable ``code``. The wire catalog
(:mod:`millpond.wire.status`) maps codes to gRPC status codes; the client maps
them back to the same classes, so remote and in-process buffers raise the same
types. Errors are never matched by message text.
"""

from __future__ import annotations


class ReplayError(Exception):
    """Base of every millpond error."""

    code = "REPLAY_ERROR"


class InvalidArgumentError(ReplayError, ValueError):
    """A request argument is malformed; nothing was changed."""

    code = "INVALID_ARGUMENT"


class InvalidConfigError(InvalidArgumentError):
    """A buffer configuration is impossible (zero capacity, bad schema, ...)."""

    code = "INVALID_CONFIG"


class ShapeMismatchError(InvalidArgumentError):
    """An array does not have the shape the buffer's schema requires."""

    code = "SHAPE_MISMATCH"


class DTypeMismatchError(InvalidArgumentError):
    """An array's dtype cannot be stored in the schema's dtype without loss."""

    code = "DTYPE_MISMATCH"


class FieldMismatchError(InvalidArgumentError):
    """A batch names fields the schema lacks, or lacks fields it has."""

    code = "FIELD_MISMATCH"


class InvalidBatchSizeError(InvalidArgumentError):
    """``batch_size`` is not a positive integer."""

    code = "INVALID_BATCH_SIZE"


class IndexOutOfRangeError(InvalidArgumentError, IndexError):
    """A position is outside the buffer's live contents (``0 <= position < len``);
    nothing was read. gRPC status INVALID_ARGUMENT, like every bad argument."""

    code = "INDEX_OUT_OF_RANGE"


class NotEnoughDataError(ReplayError, ValueError):
    """A sample asks for more records than the buffer holds."""

    code = "NOT_ENOUGH_DATA"


class BufferClosedError(ReplayError, ValueError):
    """The buffer was closed; like I/O on a closed file, this is a ValueError."""

    code = "BUFFER_CLOSED"


class ReadOnlyBufferError(ReplayError, ValueError):
    """A write (push, priorities, episode updates, reset, delete) to a read-only buffer,
    such as an offline dataset; nothing was changed. gRPC status FAILED_PRECONDITION."""

    code = "READ_ONLY"


class BufferDamagedError(ReplayError, OSError):
    """The buffer exists but is held out of service: its file failed its checks at start-up
    (damaged records or header), cannot be read (permissions, I/O errors) or is not a
    buffer file this millpond reads. Nothing was done. An admin brings it back with
    ``millpond repair NAME`` (its intact records served, the others dropped), deletes it
    (``millpond delete NAME``) or restores it from a backup (``millpond restore``); the
    message says which applies. gRPC status FAILED_PRECONDITION."""

    code = "BUFFER_DAMAGED"


class BufferNotFoundError(ReplayError, KeyError):
    """No buffer of that name exists on the server."""

    code = "BUFFER_NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep messages readable
        return str(self.args[0]) if self.args else ""


class ConfigMismatchError(ReplayError, ValueError):
    """A buffer of that name exists with a different configuration."""

    code = "CONFIG_MISMATCH"


class StorageFullError(ReplayError, OSError):
    """Not enough disk or memory to create the buffer; nothing was left behind."""

    code = "STORAGE_FULL"


class FileConflictError(ReplayError, FileExistsError):
    """A file that is not this buffer's is where the buffer's file should go; nothing changed."""

    code = "FILE_CONFLICT"


class LimitExceededError(ReplayError):
    """A limit the server was configured with (``--max-*``) refuses the request; nothing changed."""

    code = "LIMIT_EXCEEDED"


class SharedMemoryError(StorageFullError):
    """A shared-memory segment could not be made or reserved (the client falls back to gRPC)."""

    code = "SHM_UNAVAILABLE"


class StorageIOError(ReplayError, OSError):
    """Writing buffer data to disk failed (fdatasync); the data may be lost. Not retryable."""

    code = "STORAGE_IO"


class CorruptFileError(ReplayError, ValueError):
    """A cold file is not a millpond file, or its header is damaged."""

    code = "CORRUPT_FILE"


class MessageTooLargeError(ReplayError, ValueError):
    """A request or reply would exceed the configured gRPC message size limit."""

    code = "MESSAGE_TOO_LARGE"


class DeadlineExceededError(ReplayError, TimeoutError):
    """The call did not complete before its deadline."""

    code = "DEADLINE_EXCEEDED"


class RateLimitTimeoutError(DeadlineExceededError):
    """A push or sample waited for the buffer's rate limiter until its timeout; nothing changed.

    ``kind`` ("insert" or "sample") and ``records`` say what waited, and
    ``state`` the rate limiter's state then, in words, when known.
    """

    code = "RATE_LIMIT_TIMEOUT"

    def __init__(self, message: str = "", kind: str | None = None, records: int | None = None,
                 state: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.records = records
        self.state = state


class ServerUnavailableError(ReplayError, ConnectionError):
    """The server cannot be reached (not started, dead, or shutting down)."""

    code = "UNAVAILABLE"


class ServerStartingError(ServerUnavailableError):
    """The server is still recovering its buffers; clients retry until their deadline."""

    code = "SERVER_STARTING"


class AuthenticationError(ReplayError, PermissionError):
    """The call carried no credentials the server accepts (no token, a wrong one, or no
    client certificate where one is required). gRPC status UNAUTHENTICATED."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(ReplayError, PermissionError):
    """The caller's role may not do this (e.g. a ``read`` token pushing, an ``actor``
    creating a new buffer). gRPC status PERMISSION_DENIED; nothing was changed."""

    code = "PERMISSION_DENIED"


class ProtocolError(ReplayError):
    """A server's reply does not match the request or the buffer (rows, columns,
    dtypes, shapes, an impossible size): the client refuses it rather than hand out
    wrong data. Raised by the client; a server never sends it."""

    code = "PROTOCOL_ERROR"


class InternalError(ReplayError, RuntimeError):
    """The server failed in a way that is a bug, not the caller's fault."""

    code = "INTERNAL"


def error_classes() -> dict[str, type[ReplayError]]:
    """All error classes by their stable code (used to decode remote errors)."""
    found: dict[str, type[ReplayError]] = {}
    pending = [ReplayError]
    while pending:
        cls = pending.pop()
        found[cls.code] = cls
        pending.extend(cls.__subclasses__())
    return found
