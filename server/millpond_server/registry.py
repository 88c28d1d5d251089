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
import struct
import threading
import time
from pathlib import Path
from typing import Callable

from millpond.core import BufferConfig, BufferInfo, TieredBuffer
from millpond.core.bufferfile import FORMAT_VERSION, MAGIC, SERVED_VERSIONS, BufferFile
from millpond.core.dataset import ReadOnlyBuffer
from millpond.core.fileops import fsync_directory
from millpond.core.footprint import disk_nbytes
from millpond.errors import (
    BufferDamagedError,
    BufferNotFoundError,
    ConfigMismatchError,
    CorruptFileError,
    FileConflictError,
    InvalidArgumentError,
    InvalidConfigError,
    LimitExceededError,
    PermissionDeniedError,
    ReadOnlyBufferError,
    StorageFullError,
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


# Why a buffer file found at start-up is held out of service (BufferInfo.state).
DAMAGED, UNREADABLE, UNKNOWN_FORMAT = "damaged", "unreadable", "unknown-format"


@dataclasses.dataclass(frozen=True)
class HeldBuffer:
    """A buffer whose file failed at start-up (or at a repair): listed, never served.

    ``state``: :data:`DAMAGED`, :data:`UNREADABLE` or :data:`UNKNOWN_FORMAT`;
    ``reason``: what is wrong, naming the file; ``config``: what its header says, if it
    could be read."""

    name: str
    path: Path
    state: str
    reason: str
    config: BufferConfig | None = None

    @property
    def advice(self) -> str:
        """What an admin can do about it."""
        name = self.name
        restore = f"or restore a backup of it (millpond restore SNAPSHOT --name {name})"
        if self.state == UNREADABLE:
            return (f"make the file readable and writable by the daemon, then `millpond repair "
                    f"{name}`; or `millpond delete {name}` (its records are lost), {restore}")
        if self.state == UNKNOWN_FORMAT:
            return (f"serve it with the millpond that wrote it, or `millpond delete {name}` "
                    f"(its records are lost), {restore}")
        return (f"`millpond repair {name}` serves the records that pass their checks and drops "
                f"the others; or `millpond delete {name}`, {restore}")

    def error(self) -> BufferDamagedError:
        return BufferDamagedError(f"buffer {self.name!r} is held out of service ({self.state}: "
                                  f"{self.reason}); {self.advice}")


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
        check_private(self.data_dir)
        self._lock_fd = _lock_directory(self.data_dir)
        self.sync_every_push = sync_every_push
        self.skip_corrupt = skip_corrupt
        self.max_buffers = max_buffers
        self.max_data_bytes = max_data_bytes
        self._buffers: dict[str, TieredBuffer] = {}
        self._held: dict[str, HeldBuffer] = {}  # files found damaged: listed, not served
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
        """Reopen every buffer file in the data directory; return how many are served.

        Logs each buffer before and after, so a long recovery is visibly not
        a hang. One file never stops the others: a file that cannot be opened
        (unreadable, not a buffer file of this format, a damaged header, not a
        regular file) is held out of service, logged as an error with its reason,
        and so is one with damaged records unless ``skip_corrupt``, which repairs
        it (:meth:`repair`). Leftovers of creations a crash interrupted are removed.
        """
        for leftover in self.data_dir.glob(f".*{FILE_SUFFIX}.*.tmp"):
            log.warning("removing an unfinished buffer file", extra={"kv": {"file": leftover.name}})
            leftover.unlink(missing_ok=True)
        paths = sorted(self.data_dir.glob(f"*{FILE_SUFFIX}"))
        self.recovery = (0, len(paths), 0, 0)
        began = time.monotonic()
        log.info("recovery started", extra={"kv": {
            "data_dir": str(self.data_dir), "buffers": len(paths),
            "bytes": sum(_size(path) for path in paths)}})
        for i, path in enumerate(paths, 1):
            name = path.name[: -len(FILE_SUFFIX)]
            opened = time.monotonic()
            log.info("recovering buffer", extra={"kv": {
                "buffer": name, "progress": f"{i}/{len(paths)}", "bytes": _size(path)}})
            buffer, held = self._reopen(name, path, self._progress(i - 1, len(paths), name))
            for note in buffer.recovery_notes if buffer is not None else ():
                log.warning(note, extra={"kv": {"buffer": name}})  # e.g. a damaged commit slot
            if buffer is not None and (buffer.info().damaged or buffer.recovery_doubt):
                if self.skip_corrupt:
                    log.warning("damaged records left out", extra={"kv": {
                        "buffer": name, "damaged": buffer.info().damaged,
                        "intact": len(buffer)}})
                    buffer, held = self._rewrite(name, path, buffer)
                else:
                    held = HeldBuffer(name, path, DAMAGED, _damage(path, buffer), buffer.config)
                    buffer.release()
                    buffer = None
            self.recovery = (i, len(paths), 0, 0)
            if held is not None:
                self._hold(held)
                continue
            assert buffer is not None
            with self._lock:
                self._buffers[name] = buffer
            log.info("buffer recovered", extra={"kv": {
                "buffer": name, "records": len(buffer), "pushed": buffer.pushed,
                "seconds": round(time.monotonic() - opened, 3)}})
        log.info("recovery done", extra={"kv": {
            "buffers": len(self._buffers), "held_out": len(self._held),
            "seconds": round(time.monotonic() - began, 3)}})
        return len(self._buffers)

    def _reopen(self, name: str, path: Path, progress: Callable[[int, int], None] | None = None
                ) -> tuple[TieredBuffer | None, HeldBuffer | None]:
        """Open the buffer file at ``path``, its damaged records left out (see
        ``info().damaged``): ``(buffer, None)``; or ``(None, held)`` saying why it cannot
        be served at all."""
        held = _probe(name, path)
        if held is not None:
            return None, held
        try:
            return TieredBuffer.open(path, sync_every_push=self.sync_every_push,
                                     skip_corrupt=True, progress=progress), None
        except MemoryError:
            raise
        except Exception as exc:  # one file must not stop the daemon: say what it is
            return None, _held_for(name, path, exc)

    def _hold(self, held: HeldBuffer) -> None:
        """Keep ``held`` out of service, listed, and say so."""
        with self._lock:
            self._held[held.name] = held
        log.error("buffer held out of service", extra={"kv": {
            "buffer": held.name, "file": str(held.path), "state": held.state,
            "reason": held.reason, "fix": held.advice}})

    def _rewrite(self, name: str, path: Path, buffer: TieredBuffer
                 ) -> tuple[TieredBuffer | None, HeldBuffer | None]:
        """``buffer`` (opened from ``path``, damaged records left out) written again without
        them in place of its file (a new file renamed over it), then reopened (see
        :meth:`_reopen`). Without room for the new file, ``buffer`` is served as it is:
        its damage is found again at the next start."""
        dropped = buffer.info().damaged
        try:
            result = buffer.snapshot(path, replace=True).run()
        except StorageFullError as exc:
            log.warning("no room to rewrite a damaged buffer: served without its damaged "
                        "records until the next start", extra={"kv": {
                            "buffer": name, "error": exc}})
            return buffer, None
        buffer.release()
        log.warning("buffer rewritten without its damaged records", extra={"kv": {
            "buffer": name, "dropped": dropped, "records": result.records}})
        return self._reopen(name, path)

    def repair(self, name: str) -> tuple[BufferInfo, int, bool]:
        """Serve the buffer ``name`` held out of service again: its file reopened, its
        records that fail their checks dropped (the file rewritten without them).
        ``(info, records dropped, repaired)``; a buffer served already is left as it is
        (``repaired`` False). BufferDamagedError, still held, if its file still cannot
        be opened (the reason and what to do in the message)."""
        check_name(name)
        with self._name_lock(name):
            with self._lock:
                held = self._held.get(name)
            if held is None:
                return self.info(name), 0, False
            log.info("repairing buffer", extra={"kv": {"buffer": name, "file": str(held.path)}})
            buffer, still = self._reopen(name, held.path, _progress_logger(name))
            if still is not None:
                self._hold(still)
                raise still.error()
            assert buffer is not None
            dropped = buffer.info().damaged
            if dropped:
                buffer, still = self._rewrite(name, held.path, buffer)
                if still is not None:
                    self._hold(still)
                    raise still.error()
                assert buffer is not None
            with self._lock:
                self._held.pop(name, None)
                self._buffers[name] = buffer
        log.warning("buffer served again", extra={"kv": {
            "buffer": name, "dropped": dropped, "records": len(buffer)}})
        return self.info(name, buffer), dropped, True

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
                held = self._held.get(name)
                count = len(self._buffers) + len(self._held)
            if held is not None:
                raise held.error()
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
            # What the files take on disk (their blocks), not their sizes: a compressed ring
            # is a sparse region that fills as its buffer stores (see millpond.core.arena).
            used = sum(_allocated(p) for p in self.data_dir.glob(f"*{FILE_SUFFIX}"))
            needed = disk_nbytes(config, persistent=True)
            if used + needed > self.max_data_bytes:
                raise LimitExceededError(
                    f"a buffer file taking {needed:,} bytes of disk would take the data "
                    f"directory's buffer files to {used + needed:,} bytes, over its limit of "
                    f"{self.max_data_bytes:,} (--max-data-gb)")

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
                taken = name in self._buffers or name in self._held
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
        """The buffer served as ``name``: BufferNotFoundError if none, BufferDamagedError
        (with what to do) if it is held out of service."""
        with self._lock:
            buffer = self._buffers.get(name)
            held = self._held.get(name) if buffer is None else None
        if held is not None:
            raise held.error()
        if buffer is None:
            raise BufferNotFoundError(f"no buffer named {name!r}")
        return buffer

    def held(self, name: str) -> HeldBuffer | None:
        """``name`` if it is held out of service, else None."""
        with self._lock:
            return self._held.get(name)

    def holds(self, name: str) -> bool:
        """Whether ``name`` is a buffer of this daemon: served, or held out of service."""
        with self._lock:
            return name in self._buffers or name in self._held

    def disk_bytes(self, name: str) -> int:
        """The disk the file of buffer ``name`` takes: its blocks allocated (a sparse file
        takes less than its size). 0 for a dataset (its source is not ours) or a file gone."""
        with self._lock:
            held = self._held.get(name)
            dataset = isinstance(self._buffers.get(name), ReadOnlyBuffer)
        if dataset:
            return 0
        try:
            path = held.path if held is not None else self.path(name)
        except InvalidArgumentError:
            return 0
        return _allocated(path)

    def held_list(self) -> list[HeldBuffer]:
        """The buffers held out of service, by name (a snapshot)."""
        with self._lock:
            return [held for _, held in sorted(self._held.items())]

    @staticmethod
    def held_info(held: HeldBuffer) -> BufferInfo:
        """The info of a buffer held out of service: its state, reason and (if its header
        could be read) config; no numbers."""
        return BufferInfo(held.config, name=held.name, path=held.path.name, state=held.state,
                          reason=held.reason)

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
                held = self._held.get(name) if buffer is None else None
            if held is not None:
                self._delete_held(held)
                return
            if buffer is None:
                raise BufferNotFoundError(f"no buffer named {name!r}")
            buffer.close()
        log.info("buffer closed", extra={"kv": {"buffer": name}})

    def _delete_held(self, held: HeldBuffer) -> None:
        """Remove the file of a buffer held out of service (name lock held)."""
        try:
            held.path.unlink(missing_ok=True)  # a link itself, never what it names
        except (IsADirectoryError, PermissionError) as exc:
            raise FileConflictError(f"{held.path} cannot be removed ({exc.strerror}); remove "
                                    "it by hand") from exc
        fsync_directory(str(self.data_dir))
        with self._lock:
            self._held.pop(held.name, None)
        log.warning("buffer held out of service deleted", extra={"kv": {
            "buffer": held.name, "file": str(held.path), "state": held.state}})

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


def _allocated(path: Path) -> int:
    """The disk the file at ``path`` takes (its blocks; 0 if it is gone, or not a file)."""
    try:
        found = path.lstat()
    except OSError:
        return 0
    return found.st_blocks * 512 if stat.S_ISREG(found.st_mode) else 0


def _probe(name: str, path: Path) -> HeldBuffer | None:
    """Why the file at ``path`` cannot be a buffer file to open, if that shows before
    opening it: not a regular file, not openable for reading and writing, not a millpond
    file, or another format version. None if it may be one."""
    try:
        mode = path.lstat().st_mode
    except OSError as exc:
        return HeldBuffer(name, path, UNREADABLE, f"{path}: {exc.strerror}")
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        return HeldBuffer(name, path, UNREADABLE,
                          f"{path} is {kind}; the daemon never follows links or opens anything "
                          "but regular files in its data directory")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return HeldBuffer(name, path, UNREADABLE,
                          f"{path} cannot be opened for reading and writing: {exc.strerror}")
    try:
        head = os.pread(fd, _HEAD.size, 0)
    except OSError as exc:
        return HeldBuffer(name, path, UNREADABLE, f"{path} cannot be read: {exc.strerror}")
    finally:
        os.close(fd)
    if len(head) < _HEAD.size or head[:len(MAGIC)] != MAGIC:
        return HeldBuffer(name, path, UNKNOWN_FORMAT,
                          f"{path} is not a millpond buffer file ({len(head)} bytes read, "
                          "no millpond header)" if len(head) < _HEAD.size else
                          f"{path} is not a millpond buffer file (it does not begin with "
                          f"{MAGIC!r})")
    _, version = _HEAD.unpack(head)
    if version not in SERVED_VERSIONS:
        return HeldBuffer(name, path, UNKNOWN_FORMAT,
                          f"{path} has buffer file format version {version}; this millpond "
                          f"reads version {FORMAT_VERSION} (and 6 and {SERVED_VERSIONS[-1]}, "
                          "with frame regions) only")
    return None


_HEAD = struct.Struct("<8sI")  # magic, format version (see millpond.core.bufferfile)


def _held_for(name: str, path: Path, exc: Exception) -> HeldBuffer:
    """The held-out entry for a file whose open raised ``exc``."""
    if isinstance(exc, OSError) and not isinstance(exc, CorruptFileError):
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        return HeldBuffer(name, path, UNREADABLE, f"{path} cannot be read: {why}")
    reason = str(exc) if isinstance(exc, CorruptFileError) else (
        f"{path}: damaged header ({type(exc).__name__}: {exc})")
    return HeldBuffer(name, path, DAMAGED, reason, _config_of(path))


def _config_of(path: Path) -> BufferConfig | None:
    """The config the header of the file at ``path`` records, if it can be read."""
    try:
        file = BufferFile.open(str(path))
    except Exception:
        return None
    try:
        return BufferConfig.from_file_meta(file.meta, file.schema)
    except Exception:
        return None
    finally:
        file.close(delete=False)


def _damage(path: Path, buffer: TieredBuffer) -> str:
    """The reason of a buffer opened with damaged records left out (or whose file's
    commit may lack its last acknowledged push)."""
    if buffer.recovery_doubt is not None:
        return f"{path}: {buffer.recovery_doubt}"
    info, seqs = buffer.info(), buffer.damaged_seqs()
    return (f"{path}: {info.damaged:,} of {info.hot_size + info.cold_size:,} live records fail "
            f"their checks (seqs {seqs[:5].tolist()}{'...' if len(seqs) > 5 else ''})")


def check_private(folder: Path, label: str = "data directory",
                  error: type[Exception] = DataDirError, st: os.stat_result | None = None) -> None:
    """Refuse a directory (``label`` names it in the error, of type ``error``) that is not
    this server's or that other users may write to: they could plant files or links in
    it. ``st``: its stat, if already made."""
    st = folder.stat() if st is None else st
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise error(f"{label} {folder} belongs to uid {st.st_uid}, not to this server's "
                    f"uid {os.geteuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise error(
            f"{label} {folder} is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}): they could plant files or links in it; chmod "
            "go-w it or use a private directory")


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


# Seconds between two progress lines of one buffer's check (recovery, repair).
PROGRESS_LOG_S = 5.0


def _progress_logger(name: str) -> Callable[[int, int], None]:
    """A progress callback that logs at most every :data:`PROGRESS_LOG_S` seconds (a
    buffer checked faster logs none: its start and end lines say enough)."""
    last = [time.monotonic()]

    def report(checked: int, live: int) -> None:
        if time.monotonic() - last[0] >= PROGRESS_LOG_S:
            last[0] = time.monotonic()
            log.info("checking records", extra={"kv": {
                "buffer": name, "checked": checked, "live": live,
                "percent": round(100 * checked / max(live, 1))}})

    return report


def _size(path: Path) -> int:
    """The size of the file at ``path`` (not followed), 0 if it cannot be read."""
    try:
        return path.lstat().st_size
    except OSError:
        return 0
