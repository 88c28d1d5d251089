"""Sealed memfd segments: shared memory that no peer can shrink under a mapping.

A mapping of a file that another process truncates raises SIGBUS on access.
Every segment here is sealed against shrinking and growing before its fd is
passed on, and a receiver checks those seals before mapping it, so neither
side can crash the other. memfd memory lives in no file system (nothing in
``/dev/shm`` to leak) and is freed when the last fd and mapping go away.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

from millpond.core.memory import available_memory
from millpond.errors import InvalidArgumentError, SharedMemoryError

# Linux's values where this Python has no such constants: the module imports everywhere,
# and the fast path is used only where all it needs is there (facilities.py).
REQUIRED_SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0x0002) | getattr(fcntl, "F_SEAL_GROW", 0x0004)
                  | getattr(fcntl, "F_SEAL_SEAL", 0x0001))


# Never reserve more than this share of the memory still available: memfd
# memory has no size limit of its own, and reserving past what is free ends
# in the OOM killer, not in an error.
MAX_SHARE_OF_AVAILABLE = 0.5


def create_segment(size: int, label: str) -> int:
    """A sealed memfd of ``size`` bytes with its memory reserved; returns the fd.

    Reserving up front (``posix_fallocate``) turns "not enough shared memory"
    into a clear :class:`SharedMemoryError` here instead of SIGBUS later; a
    size beyond half the available memory is refused before reserving.
    """
    available = available_memory()
    if available is not None and size > available * MAX_SHARE_OF_AVAILABLE:
        raise SharedMemoryError(
            f"a shared-memory segment of {size:,} bytes is more than half of the "
            f"{available:,} bytes of memory available"
        )
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SharedMemoryError(
                f"cannot reserve {size:,} bytes of shared memory: {os.strerror(exc.errno)}"
            ) from exc
        raise
    return fd


def reopen_readonly(fd: int) -> int:
    """A new read-only file description of the same memfd (to hand to a reader)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def check_segment(fd: int, size: int) -> None:
    """Refuse a received fd unless it is a sealed memfd holding ``size`` bytes."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise InvalidArgumentError("shared segment is not a sealable memfd") from exc
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise InvalidArgumentError("shared segment is not sealed against shrinking and growing")
    actual = os.fstat(fd).st_size
    if not 0 < size <= actual:
        raise InvalidArgumentError(f"shared segment holds {actual:,} bytes, not {size:,}")


def map_segment(fd: int, size: int, writable: bool) -> mmap.mmap:
    access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
    return mmap.mmap(fd, size, access=access)
