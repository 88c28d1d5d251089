"""Backups: snapshots of live buffers written by the daemon, and restoring one offline.

**Checkpoint** (the RPC; ``millpond backup``, ``Client.checkpoint``): the daemon writes a
consistent copy of a served buffer as a buffer file under ``--backup-dir``, while
actors keep pushing. The copy is the engine's :class:`~millpond.core.snapshot.Snapshot`
(its module says what a snapshot holds): the cut is taken, and every step of the copy
read, through the buffer's owner like any other operation, a few MiB at a time, so
pushes are held up for one step at most; each step is written to the new file on the
engine pool, outside the owner's lane. Only an admin may ask (``auth.METHOD_ROLES``).

Where it may write: a path relative to ``--backup-dir``, or absolute inside it; every
directory on the way is checked as it is walked (a symbolic link, a ``..`` or anything
resolving outside the directory, or into the data directory, is refused; missing
directories are created, private). The file is created under a temporary name that
nothing can have planted (exclusive, no link followed) and given its name only once
complete and synced, never over an existing file. Without ``--backup-dir``, checkpoints
are refused.

**Restore** (offline, ``millpond restore``): :func:`restore` copies a snapshot into a
data directory no daemon is using (its lock is taken), under a temporary name, checks
every record of the copy, then gives it its name (never over an existing buffer).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import secrets
import stat
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from millpond.core import BufferConfig, TieredBuffer
from millpond.core.bufferfile import BufferFile, dense_nbytes
from millpond.core.fileops import CREATE_FLAGS, fsync_directory, unlink_quietly
from millpond.core.snapshot import CheckpointResult, snapshot_path
from millpond.errors import (
    CorruptFileError,
    FileConflictError,
    InternalError,
    InvalidArgumentError,
    PermissionDeniedError,
    ReplayError,
)

from .declared import ConfigError
from .registry import FILE_SUFFIX, _lock_directory, _probe, check_name, check_private

if TYPE_CHECKING:
    from .operations import Operations

log = logging.getLogger("millpond.backups")
T = TypeVar("T")
PROGRESS_S = 0.5  # at most one progress message per this many seconds
COPY_BYTES = 8 << 20  # restore copies this many bytes at a time


class BackupDir:
    """``--backup-dir`` (``root``; None: checkpoints are refused) of a daemon whose data
    directory is ``data_dir``; see the module docstring."""

    def __init__(self, root: str | os.PathLike | None, data_dir: str | os.PathLike):
        self.root = None if root is None else Path(os.path.abspath(root))
        self.data_dir = Path(os.path.realpath(data_dir))

    def prepare(self) -> None:
        """At start: create the directory (private), and refuse one that other users may
        write to, that is not ours, or that is the data directory or inside it
        (ConfigError: exit 2)."""
        if self.root is None:
            return
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.root.stat()
        except OSError as exc:
            raise ConfigError(f"--backup-dir {self.root}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"--backup-dir {self.root} is not a directory")
        check_private(self.root, "--backup-dir", ConfigError, st)
        real = Path(os.path.realpath(self.root))
        if real == self.data_dir or self.data_dir in real.parents:
            raise ConfigError(
                f"--backup-dir {self.root} is the data directory or inside it: a snapshot "
                "there would be served as a buffer at the next start; use another directory")

    def target(self, path: str) -> Path:
        """The file a checkpoint asked to write at ``path`` goes to (directories on the way
        created); see the module docstring for what is refused."""
        if self.root is None:
            raise PermissionDeniedError(
                "this daemon writes no snapshots: start it with --backup-dir DIR "
                "(or MILLPOND_BACKUP_DIR) to allow checkpoints")
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidArgumentError(f"a checkpoint needs a file path, got {path!r}")
        given = PurePosixPath(path)
        if given.is_absolute():
            try:
                given = given.relative_to(self.root)
            except ValueError:
                raise InvalidArgumentError(
                    f"{path} is outside the daemon's --backup-dir ({self.root}); give a path "
                    "relative to it, or absolute inside it") from None
        parts = given.parts
        if not parts or ".." in parts:
            raise InvalidArgumentError(
                f"checkpoint path {path!r} must name a file inside --backup-dir, without '..'")
        folder = self.root
        for part in parts[:-1]:
            folder = folder / part
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise InvalidArgumentError(f"cannot make directory {folder}: {exc.strerror}"
                                           ) from None
            if not stat.S_ISDIR(folder.lstat().st_mode):  # a link, or a file
                raise InvalidArgumentError(
                    f"{folder} is not a directory (a symbolic link, or a file): checkpoints "
                    "follow no links")
        real = Path(os.path.realpath(folder))
        if real == self.data_dir or self.data_dir in real.parents:
            raise InvalidArgumentError(f"{folder} is in the data directory: a snapshot there "
                                       "would be served as a buffer at the next start")
        target = folder / snapshot_path(parts[-1])
        if os.path.lexists(target):
            raise FileConflictError(f"{target} exists; a checkpoint never replaces a file: "
                                    "name another, or move that one away")
        return target


async def checkpoint(ops: "Operations", backups: BackupDir, name: str, path: str,
                     report: Callable[[int, int], Awaitable[None]]) -> CheckpointResult:
    """Write a snapshot of the served buffer ``name`` to ``path`` under ``backups``;
    ``report(copied, total)`` is awaited at the start and then at most every
    :data:`PROGRESS_S` (see the module docstring). A cancelled call removes the partial
    file, once the step under way has ended."""
    buffer = ops.registry.get(name)
    target = await ops.run(backups.target, path)
    owner = ops.owner(buffer)
    snapshot = buffer.snapshot(target)
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    try:
        # Allocated before the cut: the copy starts as soon as the cut is taken.
        await _written(ops.run(snapshot.create), target)
        await owner.run(snapshot.begin)
        log.info("checkpoint started", extra={"kv": {
            "buffer": name, "file": str(target), "records": snapshot.progress[1]}})
        await report(*snapshot.progress)
        last = loop.time()
        while True:
            chunk = await _step(owner.run(snapshot.read))
            if chunk is None:
                break
            await _written(ops.run(snapshot.write, chunk), target)
            if loop.time() - last >= PROGRESS_S:
                await report(*snapshot.progress)
                last = loop.time()
        result = await _written(ops.run(snapshot.finish), target)
    except BaseException:
        snapshot.abort()
        raise
    log.info("checkpoint written", extra={"kv": {
        "buffer": name, "file": result.path, "records": result.records,
        "dropped": result.dropped, "seconds": round(time.monotonic() - started, 3)}})
    return result


async def _step(work: Awaitable[T]) -> T:
    """``await work`` (a step on the pool), such that a cancelled caller leaves only once
    the step has ended: the snapshot's file must not be closed under a thread writing it."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                continue
        raise


async def _written(work: Awaitable[T], target: Path) -> T:
    """:func:`_step` for the steps that write the snapshot: a failure of its own file
    (the backup disk) is the caller's error, never the daemon's (a sync failure of the
    data directory stops the daemon; one of a backup must not)."""
    try:
        return await _step(work)
    except ReplayError:
        raise
    except OSError as exc:
        log.error("checkpoint failed", extra={"kv": {"file": str(target), "error": exc}})
        raise InternalError(f"writing the snapshot {target} failed: {exc}") from exc


# ---- restore (offline) ----------------------------------------------------------------------

def restore(snapshot: str | os.PathLike, data_dir: str | os.PathLike, name: str | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Put the snapshot file ``snapshot`` in ``data_dir`` as buffer ``name`` (default: the
    snapshot's file name without ``.buffer``); a daemon started on ``data_dir`` serves it.

    Offline: refused while a daemon holds the directory (its lock is taken here), and
    never over an existing buffer. The file is copied under a temporary name, synced and
    every record of the copy checked before it gets its name: a failure leaves the data
    directory as it was. ``progress(stage, done, total)``: stage "copy" (bytes) then
    "check" (records). Returns ``{"name", "path", "records", "pushed", "config"}``.
    """
    source = Path(snapshot)
    name = check_name(name if name is not None else source.name.removesuffix(FILE_SUFFIX))
    held = _probe(name, source)
    if held is not None:
        raise CorruptFileError(f"cannot restore {source}: {held.reason}")
    folder = Path(data_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(folder)
    lock = _lock_directory(folder)
    try:
        dest = folder / f"{name}{FILE_SUFFIX}"
        if os.path.lexists(dest):
            raise FileConflictError(
                f"{dest} exists: a restore never replaces a buffer; delete it first "
                f"(millpond delete {name}, with the daemon running) or give --name")
        temp = folder / f".{name}{FILE_SUFFIX}.{secrets.token_hex(6)}.tmp"
        try:
            _copy(source, temp, progress)
            records, pushed, config = _check(source, temp, progress)
            try:
                os.link(temp, dest)  # fails if anything has that name by now
            except FileExistsError:
                raise FileConflictError(f"{dest} appeared while restoring; nothing "
                                        "was replaced") from None
        finally:
            unlink_quietly(str(temp))
        fsync_directory(str(folder))
    finally:
        os.close(lock)
    return {"name": name, "path": str(dest), "records": records, "pushed": pushed,
            "config": config}


def _copy(source: Path, temp: Path, progress: Callable[[str, int, int], None] | None) -> None:
    """Copy ``source`` to ``temp``, keeping the sparse regions of a compressed buffer's file
    sparse (see :mod:`millpond.core.bufferfile`): only their data is written (where the
    file system says it is, and not all zero), so the copy takes the disk the snapshot
    takes, not its size. The rest is written whole (allocated, as a created file is)."""
    total = source.stat().st_size
    with open(source, "rb") as src:
        dense = _dense_part(src.fileno(), total)
        fd = os.open(temp, CREATE_FLAGS, 0o600)
        try:
            for lo, hi in [(0, dense), *_data_extents(src.fileno(), dense, total)]:
                at = lo
                while at < hi:
                    block = os.pread(src.fileno(), min(COPY_BYTES, hi - at), at)
                    if not block:
                        break
                    if at < dense or block.count(0) != len(block):
                        view = memoryview(block)
                        done = 0
                        while done < len(view):
                            done += os.pwrite(fd, view[done:], at + done)
                    at += len(block)
                    if progress is not None:
                        progress("copy", at, total)
            os.ftruncate(fd, total)
            if progress is not None:
                progress("copy", total, total)
            os.fsync(fd)
        finally:
            os.close(fd)


def _dense_part(fd: int, size: int) -> int:
    """The bytes of a buffer file before its sparse regions (all of it for a file that has
    none, or whose header cannot be read: the check after the copy says what is wrong)."""
    try:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            meta, _ = BufferFile.read_meta(mm, "")
        return min(size, dense_nbytes(meta, size))
    except (ReplayError, ValueError, OSError, KeyError, TypeError):
        return size


def _data_extents(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The runs of ``[start, end)`` of a file that hold data (the rest are holes); all of
    it where the file system cannot tell."""
    if start >= end:
        return []
    if not hasattr(os, "SEEK_DATA"):
        return [(start, end)]
    runs: list[tuple[int, int]] = []
    at = start
    while at < end:
        try:
            lo = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole from here on
                break
            return runs + [(at, end)]
        if lo >= end:
            break
        hi = min(end, os.lseek(fd, lo, os.SEEK_HOLE))
        runs.append((lo, hi))
        at = hi
    return runs


def _check(source: Path, temp: Path, progress: Callable[[str, int, int], None] | None
           ) -> tuple[int, int, BufferConfig]:
    """Open the copy of ``source``, checking every record (CorruptFileError names what
    fails)."""
    def report(done: int, total: int) -> None:
        if progress is not None:
            progress("check", done, total)

    try:
        buffer = TieredBuffer.open(temp, progress=report)
    except CorruptFileError as exc:
        raise CorruptFileError(f"cannot restore {source}: {exc}") from None
    try:
        return len(buffer), buffer.pushed, buffer.config
    finally:
        buffer.release()
