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
import threading
import time
from pathlib import Path

from millpond.core import BufferConfig, BufferInfo, TieredBuffer
from millpond.errors import BufferNotFoundError, ConfigMismatchError, InvalidArgumentError

log = logging.getLogger("millpond.registry")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
FILE_SUFFIX = ".buffer"
LOCK_FILE = ".millpond.lock"


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid buffer name (safe as a file name)."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise InvalidArgumentError(
            f"invalid buffer name {name!r}: use 1-128 of A-Z a-z 0-9 _ . - "
            "starting with a letter or digit"
        )
    return name


class DataDirLockedError(OSError):
    """Another daemon already serves this data directory."""


class Registry:
    """The server's named buffers, each persistent in ``<data_dir>/<name>.buffer``.

    Buffers outlive the daemon: :meth:`recover` reopens every buffer file at
    start-up and :meth:`release_all` keeps them at shutdown; only
    :meth:`close` deletes one. An exclusive lock on the data directory keeps a
    second daemon out (it would corrupt the files).
    """

    def __init__(self, data_dir: str | Path, sync_every_push: bool = False,
                 skip_corrupt: bool = False):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.data_dir)
        self.sync_every_push = sync_every_push
        self.skip_corrupt = skip_corrupt
        self._buffers: dict[str, TieredBuffer] = {}
        self._lock = threading.Lock()         # guards _buffers; held briefly
        self._create_lock = threading.Lock()  # serializes creations

    def path(self, name: str) -> Path:
        """The file where buffer ``name`` keeps its records (both tiers)."""
        return self.data_dir / f"{check_name(name)}{FILE_SUFFIX}"

    def recover(self) -> int:
        """Reopen every buffer file in the data directory; return how many.

        Logs each buffer before and after, so a long recovery is visibly not
        a hang. A damaged file stops the start with CorruptFileError naming it.
        """
        paths = sorted(self.data_dir.glob(f"*{FILE_SUFFIX}"))
        for i, path in enumerate(paths, 1):
            name = path.name[: -len(FILE_SUFFIX)]
            log.info("recovering buffer", extra={"kv": {
                "buffer": name, "progress": f"{i}/{len(paths)}",
                "bytes": path.stat().st_size}})
            buffer = TieredBuffer.open(path, sync_every_push=self.sync_every_push,
                                       skip_corrupt=self.skip_corrupt,
                                       progress=_progress_logger(name))
            with self._lock:
                self._buffers[name] = buffer
            damaged = buffer.info().damaged
            if damaged:
                log.warning("damaged records left out", extra={"kv": {
                    "buffer": name, "damaged": damaged, "intact": len(buffer)}})
            log.info("buffer recovered", extra={"kv": {
                "buffer": name, "records": len(buffer), "pushed": buffer.pushed}})
        return len(paths)

    def create(self, name: str, config: BufferConfig) -> tuple[TieredBuffer, bool]:
        """Create ``name`` or attach to it; return ``(buffer, created)``.

        Attaching requires an equal config (``beta`` aside: learners anneal
        it), else :class:`ConfigMismatchError` names what differs.
        """
        path = self.path(name)
        with self._create_lock:
            with self._lock:
                existing = self._buffers.get(name)
            if existing is not None:
                if existing.config != config:
                    raise ConfigMismatchError(
                        f"buffer {name!r} exists with a different config: " + "; ".join(
                            f"{setting}: has {has}, asked for {wants}"
                            for setting, has, wants in existing.config.differences(config)))
                return existing, False
            buffer = TieredBuffer(config, path, persistent=True,
                                  sync_every_push=self.sync_every_push)
            with self._lock:
                self._buffers[name] = buffer
        log.info("buffer created", extra={"kv": {
            "buffer": name, "hot": config.hot_capacity, "total": config.total_capacity,
            "record_bytes": config.schema.record_nbytes}})
        return buffer, True

    def get(self, name: str) -> TieredBuffer:
        with self._lock:
            buffer = self._buffers.get(name)
        if buffer is None:
            raise BufferNotFoundError(f"no buffer named {name!r}")
        return buffer

    def close(self, name: str) -> None:
        """Remove ``name`` and close it (its cold file is deleted)."""
        with self._lock:
            buffer = self._buffers.pop(name, None)
        if buffer is None:
            raise BufferNotFoundError(f"no buffer named {name!r}")
        buffer.close()
        log.info("buffer closed", extra={"kv": {"buffer": name}})

    def info(self, name: str, buffer: TieredBuffer | None = None) -> BufferInfo:
        """``buffer.info()`` (``buffer``: the one named ``name``, looked up if not
        given) with its name, and its file relative to the data directory."""
        buffer = self.get(name) if buffer is None else buffer
        return dataclasses.replace(buffer.info(), name=name, path=self.path(name).name)

    def list(self) -> list[tuple[str, TieredBuffer]]:
        """``(name, buffer)`` pairs sorted by name (a snapshot)."""
        with self._lock:
            return sorted(self._buffers.items())

    def sync_all(self) -> None:
        """msync every buffer's file. An OSError here must stop the daemon."""
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


def _lock_directory(data_dir: Path) -> int:
    """Hold an exclusive lock on the data directory for this process's life."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLockedError(
            f"data directory {data_dir} is in use by another millpond daemon"
        ) from None
    return fd


def _progress_logger(name: str, every: float = 2.0):
    """A progress callback that logs at most every ``every`` seconds."""
    last = [time.monotonic()]

    def report(checked: int, live: int) -> None:
        if time.monotonic() - last[0] >= every:
            last[0] = time.monotonic()
            log.info("checking records", extra={"kv": {
                "buffer": name, "checked": checked, "live": live,
                "percent": round(100 * checked / max(live, 1))}})

    return report
