"""File-system steps of a buffer file: room first, exclusive creation, allocation, a durable
name; syncing it."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

from millpond.errors import InvalidConfigError, StorageFullError, StorageIOError

CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def check_free_space(directory: str, size: int, path: str) -> None:
    try:
        free = shutil.disk_usage(directory).free
    except FileNotFoundError as exc:
        raise InvalidConfigError(f"cannot create buffer file {path}: no directory {directory}") from exc
    if size > free:
        raise StorageFullError(
            f"buffer file {path} needs {size:,} bytes; the disk has {free:,} free")


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_fd(fd: int, path: str) -> None:
    """``fdatasync``: what ``msync(MS_SYNC)`` of a file's one mapping does on Linux, without
    the GIL (``mmap.flush`` holds it through the write, stalling every other thread).
    StorageIOError on failure: the kernel may have dropped the pages it could not write,
    so a retry could falsely succeed."""
    try:
        getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
    except OSError as exc:
        raise StorageIOError(f"sync of {path} failed: {exc}") from exc


def allocate(fd: int, size: int, path: str) -> None:
    if not hasattr(os, "posix_fallocate"):  # macOS has none
        os.ftruncate(fd, size)  # best effort, as on a file system without fallocate
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise StorageFullError(
                f"cannot allocate {size:,} bytes for buffer file {path}: {os.strerror(exc.errno)}"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # filesystem without fallocate: best effort


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def temp_path() -> str:
    """A new file's path in the system's temp directory (for a buffer given none)."""
    fd, path = tempfile.mkstemp(prefix="millpond-", suffix=".buffer")
    os.close(fd)
    return path
