"""Named buffers of one server: name -> :class:`millpond.core.TieredBuffer`.

No gRPC here. Thread-safe: the name table has its own short lock, and buffer
creation (which may preallocate a large cold file) is serialized by a second
lock so lookups of other buffers never wait for a disk allocation.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from millpond.core import BufferConfig, BufferInfo, TieredBuffer
from millpond.core.dataset import ReadOnlyBuffer
from millpond.core.footprint import file_nbytes
from millpond.errors import (
    BufferNotFoundError,
    ConfigMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    LimitExceededError,
    PermissionDeniedError,
    ReadOnlyBufferError,
)

log = logging.getLogger("millpond.registry")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
FILE_SUFFIX = ".buffer"
LOCK_FILE = ".millpond.lock"


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid buffer name (safe as a file name)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidArgumentError(
            f"invalid buffer name {name!r}: use 1-128 of A-Z a-z 0-9 _ . - "
            "starting with a letter or digit"
        )
    return name


class DataDirError(OSError):
    """The data directory cannot be used safely (exit 1 with the reason)."""


class DataDirLockedError(DataDirError):
    """Another daemon already serves this data directory."""


class Registry:
    """The server's named buffers, each persistent in ``<data_dir>/<name>.buffer``.

    Buffers outlive the daemon: :meth:`recover` reopens every buffer file at
    start-up and :meth:`release_all` keeps them at shutdown; only
    :meth:`close` deletes one. An exclusive lock on the data directory keeps a
    second daemon out (it would corrupt the files), and the directory must not
    be writable by other users (they could plant files or links in it).

    Creating and closing one name are serialized (a Close racing a Create
    must not delete the new file, nor a Create truncate the old one under
    its mapping); other names proceed in parallel. A new buffer's file is
    built under a temporary name and published only once the buffer is
    complete, never over anything already there.
    """

    def __init__(self, data_dir: str | Path, sync_every_push: bool = False,
                 skip_corrupt: bool = False, max_buffers: int | None = None,
                 max_data_bytes: int | None = None):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(self.data_dir)
        self._lock_fd = _lock_directory(self.data_dir)
        self.sync_every_push = sync_every_push
        self.skip_corrupt = skip_corrupt
        self.max_buffers = max_buffers
        self.max_data_bytes = max_data_bytes
        self._buffers: dict[str, TieredBuffer] = {}
        # Start-up progress: (buffers recovered, buffer files, records checked, live records)
        # of the buffer being checked (read by the metrics).
        self.recovery = (0, 0, 0, 0)
        self._lock = threading.Lock()  # guards _buffers; held briefly
        # Per name (striped: bounded, never pruned): creations and closes of one name.
        self._name_locks = [threading.Lock() for _ in range(64)]

    def _name_lock(self, name: str) -> threading.Lock:
        return self._name_locks[hash(name) % len(self._name_locks)]

    def path(self, name: str) -> Path:
        """The file where buffer ``name`` keeps its records (both tiers)."""
        return self.data_dir / f"{check_name(name)}{FILE_SUFFIX}"

    def recover(self) -> int:
        """Reopen every buffer file in the data directory; return how many.

        Logs each buffer before and after, so a long recovery is visibly not
        a hang. A damaged file stops the start with CorruptFileError naming
        it. Leftovers of creations a crash interrupted are removed; anything
        that is not a regular file (a symlink) is left alone, with a warning.
        """
        for leftover in self.data_dir.glob(f".*{FILE_SUFFIX}.*.tmp"):
            log.warning("removing an unfinished buffer file", extra={"kv": {"file": leftover.name}})
            leftover.unlink(missing_ok=True)
        paths = []
        for path in sorted(self.data_dir.glob(f"*{FILE_SUFFIX}")):
            if stat.S_ISREG(path.lstat().st_mode):
                paths.append(path)
            else:
                log.warning("not a regular file: ignored", extra={"kv": {"file": path.name}})
        self.recovery = (0, len(paths), 0, 0)
        for i, path in enumerate(paths, 1):
            name = path.name[: -len(FILE_SUFFIX)]
            log.info("recovering buffer", extra={"kv": {
                "buffer": name, "progress": f"{i}/{len(paths)}",
                "bytes": path.stat().st_size}})
            buffer = TieredBuffer.open(path, sync_every_push=self.sync_every_push,
                                       skip_corrupt=self.skip_corrupt,
                                       progress=self._progress(i - 1, len(paths), name))
            with self._lock:
                self._buffers[name] = buffer
            self.recovery = (i, len(paths), 0, 0)
            for note in buffer.recovery_notes:  # e.g. a damaged commit slot, not relied on
                log.warning(note, extra={"kv": {"buffer": name}})
            damaged = buffer.info().damaged
            if damaged:
                log.warning("damaged records left out", extra={"kv": {
                    "buffer": name, "damaged": damaged, "intact": len(buffer)}})
            log.info("buffer recovered", extra={"kv": {
                "buffer": name, "records": len(buffer), "pushed": buffer.pushed}})
        return len(paths)

    def _progress(self, done: int, total: int, name: str) -> Callable[[int, int], None]:
        """The progress callback of one buffer's recovery: kept for the metrics, logged."""
        logger = _progress_logger(name)

        def report(checked: int, live: int) -> None:
            self.recovery = (done, total, checked, live)
            logger(checked, live)

        return report

    def create(self, name: str, config: BufferConfig,
               may_create: bool = True) -> tuple[TieredBuffer, bool]:
        """Create ``name`` or attach to it; return ``(buffer, created)``.

        Attaching requires an equal config (``beta`` aside: learners anneal
        it), else :class:`ConfigMismatchError` names what differs. A caller
        that may only attach (``may_create=False``) gets PermissionDeniedError
        where a new buffer would be made. Limits (``max_buffers``, the data
        directory's disk budget) are checked before anything is written.
        """
        path = self.path(name)
        with self._name_lock(name):
            with self._lock:
                existing = self._buffers.get(name)
                count = len(self._buffers)
            if existing is not None:
                if existing.config != config:
                    raise ConfigMismatchError(
                        f"buffer {name!r} exists with a different config: " + "; ".join(
                            f"{setting}: has {has}, asked for {wants}"
                            for setting, has, wants in existing.config.differences(config)))
                return existing, False
            if not may_create:
                raise PermissionDeniedError(
                    f"no buffer {name!r}: creating one needs the admin role")
            self._check_limits(count, config)
            buffer = TieredBuffer(config, path, persistent=True, exclusive=True,
                                  sync_every_push=self.sync_every_push)
            with self._lock:
                self._buffers[name] = buffer
        log.info("buffer created", extra={"kv": {
            "buffer": name, "hot": config.hot_capacity, "total": config.total_capacity,
            "record_bytes": config.schema.record_nbytes}})
        return buffer, True

    def _check_limits(self, count: int, config: BufferConfig) -> None:
        if self.max_buffers is not None and count >= self.max_buffers:
            raise LimitExceededError(
                f"the server holds {count} buffers, its limit (--max-buffers); close one first")
        if self.max_data_bytes is not None:
            used = sum(p.stat().st_size for p in self.data_dir.glob(f"*{FILE_SUFFIX}"))
            needed = file_nbytes(config, persistent=True)
            if used + needed > self.max_data_bytes:
                raise LimitExceededError(
                    f"a buffer file of {needed:,} bytes would take the data directory to "
                    f"{used + needed:,} bytes, over its limit of {self.max_data_bytes:,} "
                    "(--max-data-gb)")

    def add_dataset(self, name: str, path: str | Path) -> ReadOnlyBuffer:
        """Load the offline dataset at ``path`` (see :mod:`millpond.datasets`) and serve
        it read-only as ``name``, in RAM (it has no file here; the source is only read).

        Its writes raise ReadOnlyBufferError, and so does :meth:`close` (a client's
        ``delete``): a dataset is served until the daemon stops, and loaded again at
        each start. InvalidConfigError if a buffer already has the name.
        """
        from millpond.datasets import open_dataset  # numpy + h5py/minari: only if used

        check_name(name)
        with self._name_lock(name):
            with self._lock:
                taken = name in self._buffers
            if taken:
                raise InvalidConfigError(f"dataset {name!r}: a buffer of that name exists in "
                                         f"the data directory ({self.path(name).name})")
            log.info("loading dataset", extra={"kv": {"buffer": name, "path": str(path)}})
            buffer = open_dataset(path, name)
            with self._lock:
                self._buffers[name] = buffer
        log.info("dataset loaded", extra={"kv": {
            "buffer": name, "records": len(buffer), "episodes": buffer.info().episodes}})
        return buffer

    def get(self, name: str) -> TieredBuffer:
        with self._lock:
            buffer = self._buffers.get(name)
        if buffer is None:
            raise BufferNotFoundError(f"no buffer named {name!r}")
        return buffer

    def close(self, name: str) -> None:
        """Remove ``name`` and close it: its file is deleted. Calls still using it get
        BufferClosedError; a Create of the same name waits until the file is gone.
        A dataset (:meth:`add_dataset`) is never removed: ReadOnlyBufferError."""
        with self._name_lock(name):
            with self._lock:
                if isinstance(self._buffers.get(name), ReadOnlyBuffer):
                    raise ReadOnlyBufferError(f"buffer {name!r} is a dataset the server serves "
                                              "read-only: it cannot be deleted")
                buffer = self._buffers.pop(name, None)
            if buffer is None:
                raise BufferNotFoundError(f"no buffer named {name!r}")
            buffer.close()
        log.info("buffer closed", extra={"kv": {"buffer": name}})

    def info(self, name: str, buffer: TieredBuffer | None = None) -> BufferInfo:
        """``buffer.info()`` (``buffer``: the one named ``name``, looked up if not
        given) with its name, and its file relative to the data directory."""
        buffer = self.get(name) if buffer is None else buffer
        path = (Path(buffer.source or "").name if isinstance(buffer, ReadOnlyBuffer)
                else self.path(name).name)  # a dataset: its source's name
        return dataclasses.replace(buffer.info(), name=name, path=path)

    def list(self) -> list[tuple[str, TieredBuffer]]:
        """``(name, buffer)`` pairs sorted by name (a snapshot)."""
        with self._lock:
            return sorted(self._buffers.items())

    def sync_all(self) -> None:
        """Sync every buffer's file. An OSError here must stop the daemon."""
        for _, buffer in self.list():
            buffer.sync()

    def release_all(self) -> None:
        """Sync and unmap every buffer, keeping the files (shutdown)."""
        with self._lock:
            buffers, self._buffers = list(self._buffers.items()), {}
        for name, buffer in buffers:
            try:
                buffer.sync()
                buffer.release()
            except Exception:  # keep releasing the others
                log.exception("releasing buffer failed", extra={"kv": {"buffer": name}})
        os.close(self._lock_fd)

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)


def _check_private(data_dir: Path) -> None:
    """Refuse a data directory other users may write to (or that is not ours)."""
    st = data_dir.stat()
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise DataDirError(f"data directory {data_dir} belongs to uid {st.st_uid}, "
                           f"not to this server's uid {os.geteuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DataDirError(
            f"data directory {data_dir} is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}): they could plant files in it; chmod go-w it "
            "or use a private directory")


def _lock_directory(data_dir: Path) -> int:
    """Hold an exclusive lock on the data directory for this process's life."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLockedError(
            f"data directory {data_dir} is in use by another millpond daemon"
        ) from None
    return fd


def _progress_logger(name: str, every: float = 2.0) -> Callable[[int, int], None]:
    """A progress callback that logs at most every ``every`` seconds."""
    last = [time.monotonic()]

    def report(checked: int, live: int) -> None:
        if time.monotonic() - last[0] >= every:
            last[0] = time.monotonic()
            log.info("checking records", extra={"kv": {
                "buffer": name, "checked": checked, "live": live,
                "percent": round(100 * checked / max(live, 1))}})

    return report
