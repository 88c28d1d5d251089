"""The buffer file: a self-describing, preallocated, memory-mapped home for the tiers.

It always holds the cold ring. A *persistent* buffer keeps its hot ring in the
file too, so that everything it acknowledged survives a crash of the process:
the mapping's pages live in the page cache, not in the process.

Layout (format version 5; all integers little-endian)::

    offset 0    magic  b"MILLPOND"
    offset 8    u32    format version
    offset 12   u32    header size in bytes (a multiple of the page size)
    offset 16   u32    length of the JSON metadata
    offset 20   u32    crc32 of bytes 0..20 and of the JSON metadata
    offset 32   commit slot A: u64 generation, u64 pushed, u64 first, u64 hot_lo,
                u32 crc32 of the four (live seqs: [first, pushed); hot from hot_lo)
    offset 72   commit slot B: the same
    offset 128  JSON   {"schema", "hot_capacity", "total_capacity",
                        "cold_capacity", "persistent", "spare", "checksum",
                        ["slot_arrays": {name: dtype}],
                        "regions": {name: [offset, nbytes]}}
    then one page-aligned region per tier and field, one per tier for seq and
    (persistent) for the records' checksums (:mod:`.checksum`), one per slot
    array ("slot:<name>", ``total_capacity`` elements)

Every byte of it the daemon trusts is checked: the prefix and the metadata
by their crc32 (a same-length edit of the JSON, a flipped bit, is
CorruptFileError), each commit slot by its own, each record by its checksum.

The commit point of a change is its counters, written to slot A and then
to slot B (the same counters, generation and crc32). A crash while writing
A leaves B with the previous commit; one while writing B leaves A with this
one; at rest both hold the last. So damage to one slot (a torn write, a bad
sector, a flipped bit) never loses an acknowledged push: the other holds
the same commit, or the one before a change that was never acknowledged.
Reopening takes A if it is sound and B holds the same generation or the one
before; B if A is damaged; both damaged, or disagreeing otherwise, is
CorruptFileError. A damaged slot is reported (:attr:`BufferFile.notes`).
Records past the committed counter are ignored, so an interrupted push is
absent, never half present (see :mod:`.fifo` for pushes larger than the
spare slots).

A persistent file's hot tier has ``spare`` slots beyond ``hot_capacity``
(at most :data:`SPARE_BYTES` of records): a push writes its records into
hot slots that hold no live record and commits them and the evictions they
cause in one step (see :meth:`.fifo.Fifo.append`).

Format version 6 is format 5 with *frame regions* (``"frame_regions": {name:
[dtype, shape]}`` in the metadata, each a region of the region table): the frame
rings of a buffer with ``frame_stack`` or ``next_of`` (see :mod:`.frames`), whose
metadata also record those options and the fields as pushed (``"fields"``; its
``"schema"`` is what the tiers hold). Only such buffers write it: every other
buffer's file is format 5, byte for byte as before.

Format version 7 is format 6 with compressed frame rings (``compression``: see
:mod:`.codecs` and :mod:`.arena`): regions ``framebytes:<source>`` (the ring of
bytes), ``frameoff:``/``framelen:`` (each frame's offset and length),
``framelap:`` (the ring's size now: it grows up to its region's) beside
``frameid:`` and ``framesum:`` (then the crc32 of each stored blob), and the
option in the metadata. Only buffers with compression write it. The rings of
bytes come last in the file and are left *sparse* (``ftruncate``, not
allocated): the file takes on disk what has been written to them, not their
size, and they are written with ``pwrite`` (a full disk fails that push with
StorageFullError; a write through the mapping into a hole would raise SIGBUS).

Format version 4 (millpond 0.1.0's first files) is still read and served as
it is: its 16-bit checksum (:mod:`.checksum_v4`), no metadata checksum, no
spare slots (a push commits in three steps), and commit slots written one
at a time, alternately: there a damaged slot may have held the last
acknowledged push, so reopening with one damaged slot is CorruptFileError
unless the caller accepts it (``--recover=skip-corrupt``).

Slot arrays are side arrays with one element per record slot of the whole
FIFO (``seq % total_capacity``), e.g. the priorities of a prioritized buffer.
They are plain mapped memory: what is written there is not part of the
commit; their owner decides what a stale or damaged element means.

The whole file is allocated with ``posix_fallocate`` at creation: a full disk
fails there with :class:`StorageFullError` (the partial file is removed)
instead of raising SIGBUS on a later write through the mapping. It is mapped
once; nothing is remapped or synced per sample.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import secrets
import struct
import zlib
from typing import Callable, Mapping

import numpy as np

from millpond.core import checksum, checksum_v4
from millpond.core.coldio import TierFile
from millpond.core.fileops import (
    CREATE_FLAGS,
    allocate,
    check_free_space,
    fsync_directory,
    sync_fd,
    unlink_quietly,
)
from millpond.core.memory import keep_resident
from millpond.core.schema import Schema
from millpond.core.tier import CHECKSUM_REGION, SEQ_DTYPE, SEQ_REGION, Checksums, Tier
from millpond.errors import (
    CorruptFileError,
    FileConflictError,
    InvalidConfigError,
    StorageFullError,
    StorageIOError,
)

MAGIC = b"MILLPOND"
FORMAT_VERSION = 5  # the format of files without frame regions
FRAMES_VERSION = 6  # format 5 with frame regions (see the module doc)
COMPRESSED_VERSION = 7  # format 6 with compressed frame rings (see the module doc)
NEWEST_VERSION = COMPRESSED_VERSION
SERVED_VERSIONS = (FORMAT_VERSION, FRAMES_VERSION, COMPRESSED_VERSION)  # what a daemon serves
SPARSE_PREFIX = "framebytes:"  # regions left sparse (the last ones of a file)
OLDEST_VERSION = 4  # the oldest format this millpond reads
CHECKSUM_NAME = "mix32"  # the record checksum of format 5 (see .checksum)
PAGE = mmap.PAGESIZE
_PREFIX = struct.Struct("<8sIII")  # magic, version, header size, json length
_HEADER_CRC = struct.Struct("<I")  # crc32 of the prefix and the JSON (format 5)
_HEADER_CRC_OFFSET = 20
_COUNTERS = struct.Struct("<QQQQ")  # generation, pushed, first, hot_lo
_SLOT = struct.Struct("<QQQQI")  # the counters and their crc32
_SLOT_OFFSETS = (32, 72)
SLOT_NAMES = ("A", "B")
_JSON_OFFSET = 128
# A persistent hot tier's spare slots: this many bytes of records (at most total_capacity).
SPARE_BYTES = 4 << 20
HOT_PREFIX = "hot:"
SLOT_PREFIX = "slot:"  # never a field name's prefix either: fields are identifiers


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class Format:
    """What a format version means: its record checksum, whether its metadata is
    checksummed, whether its commits are written to both slots."""

    def __init__(self, version: int, checksum_dtype: np.dtype, checksums: Checksums,
                 checked_header: bool):
        self.version = version
        self.checksum_dtype = checksum_dtype
        self.checksums = checksums
        self.checked_header = checked_header  # crc32 of the metadata; commits mirrored

    @staticmethod
    def of(version: int) -> "Format":
        return FORMATS[version]


FORMATS = {
    4: Format(4, checksum_v4.CHECKSUM_DTYPE, checksum_v4.record_checksums, False),
    5: Format(5, checksum.CHECKSUM_DTYPE, checksum.record_checksums, True),
    6: Format(6, checksum.CHECKSUM_DTYPE, checksum.record_checksums, True),
    7: Format(7, checksum.CHECKSUM_DTYPE, checksum.record_checksums, True),
}
Regions = Mapping[str, tuple[str, tuple[int, ...]]]  # extra regions: {name: (dtype, shape)}


def spare_slots(schema: Schema, total_capacity: int) -> int:
    """The spare hot slots of a persistent file: :data:`SPARE_BYTES` of records, at
    least 1, at most ``total_capacity`` (a push of more evicts everything anyway)."""
    per_record = schema.record_nbytes + SEQ_DTYPE.itemsize + checksum.CHECKSUM_DTYPE.itemsize
    return max(1, min(total_capacity, SPARE_BYTES // per_record))


def _region_sizes(schema: Schema, capacity: int, prefix: str,
                  checksums: bool) -> list[tuple[str, int]]:
    sizes = [(prefix + f.name, capacity * f.nbytes) for f in schema]
    sizes.append((prefix + SEQ_REGION, capacity * SEQ_DTYPE.itemsize))
    if checksums:
        sizes.append((prefix + CHECKSUM_REGION, capacity * checksum.CHECKSUM_DTYPE.itemsize))
    return sizes


def _layout(sizes: list[tuple[str, int]], meta: dict) -> tuple[int, dict, int]:
    """Return (header size, regions, file size) for the given regions."""
    # The header holds the region table, whose offsets depend on the header
    # size: grow the header a page at a time until the table fits.
    header = PAGE
    while True:
        regions, offset = {}, header
        for name, nbytes in sizes:
            regions[name] = [offset, nbytes]
            offset = _round_up(offset + nbytes)
        blob = json.dumps({**meta, "regions": regions}).encode()
        if _JSON_OFFSET + len(blob) <= header:
            return header, regions, offset
        header = _round_up(_JSON_OFFSET + len(blob))


def _plan(schema: Schema, hot_capacity: int, total_capacity: int, persistent: bool,
          extra_meta: dict | None, slot_arrays: Mapping[str, str] | None,
          frame_regions: Regions | None = None) -> tuple[int, dict, int]:
    """(header size, metadata with its region table, file size) of a new file."""
    checked = _check_slot_arrays(slot_arrays or {})
    cold_capacity = total_capacity - hot_capacity
    # Only a persistent file is ever reopened: only it needs checksums and spare slots.
    spare = spare_slots(schema, total_capacity) if persistent else 0
    meta = {
        "schema": {name: [dt, list(shape)] for name, (dt, shape) in schema.spec().items()},
        "hot_capacity": hot_capacity,
        "total_capacity": total_capacity,
        "cold_capacity": cold_capacity,
        "persistent": persistent,
        "spare": spare,
        "checksum": CHECKSUM_NAME,
        **(extra_meta or {}),  # e.g. the sampler of a prioritized buffer
    }
    sizes = _region_sizes(schema, cold_capacity, "", persistent) if cold_capacity else []
    if persistent:
        sizes += _region_sizes(schema, hot_capacity + spare, HOT_PREFIX, True)
    if checked:
        meta["slot_arrays"] = checked
        sizes += [(SLOT_PREFIX + name, total_capacity * np.dtype(dtype).itemsize)
                  for name, dtype in checked.items()]
    if frame_regions:
        meta["frame_regions"] = {name: [np.dtype(dt).str, list(shape)]
                                 for name, (dt, shape) in frame_regions.items()}
        sizes += [(name, _region_nbytes(dt, shape)) for name, (dt, shape) in frame_regions.items()]
    header, regions, size = _layout(sizes, meta)
    meta["regions"] = regions
    return header, meta, size


def dense_nbytes(meta: Mapping, size: int) -> int:
    """Where the sparse regions of a file of ``size`` bytes with metadata ``meta`` begin
    (they come last; ``size`` if it has none): the bytes allocated at its creation."""
    return min((offset for name, (offset, _) in meta["regions"].items()
                if name.startswith(SPARSE_PREFIX)), default=size)


def _region_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _version_of(frame_regions: Mapping | None) -> int:
    """The format of a file with these frame regions (see the module doc)."""
    if not frame_regions:
        return FORMAT_VERSION
    if any(name.startswith(SPARSE_PREFIX) for name in frame_regions):
        return COMPRESSED_VERSION
    return FRAMES_VERSION


def _slot_crc(*counters: int) -> int:
    return zlib.crc32(_COUNTERS.pack(*counters))


def _header_crc(mm: mmap.mmap, length: int) -> int:
    """The crc32 of the prefix (bytes 0..20) and of the JSON metadata."""
    return zlib.crc32(mm[_JSON_OFFSET : _JSON_OFFSET + length],
                      zlib.crc32(mm[:_HEADER_CRC_OFFSET]))


class BufferFile:
    """One buffer's tiers in a mapped file. Not thread-safe: the buffer locks."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, meta: dict, schema: Schema,
                 counters: tuple[int, int, int, int] = (0, 0, 0, 0),
                 version: int = FORMAT_VERSION, commit: "CommitState | None" = None):
        self.path = path
        self.final_path = path  # where publish() puts a created file
        self._fd = fd
        self._mm: mmap.mmap | None = mm  # None once closed
        self.meta = meta
        self.schema = schema
        self.format = Format.of(version)
        self.generation, self.pushed, self.first, self.hot_lo = counters
        # How the commit was read (None: created here): which slot, what was damaged.
        self.commit_state = commit
        self.spare = int(meta.get("spare", 0))  # spare hot slots (format 5, persistent)
        regions = meta["regions"]
        cold = meta["cold_capacity"]
        fmt = self.format
        # The cold tier reads and writes through the fd (disk-sized, mostly not resident);
        # the hot tier through the mapping (memory-sized, kept resident).
        self.tier = _map_tier(mm, schema, cold, regions, "", fmt, fd) if cold else None
        self.hot_tier = (_map_tier(mm, schema, meta["hot_capacity"] + self.spare, regions,
                                   HOT_PREFIX, fmt)
                         if meta["persistent"] else None)
        self._slot_arrays = {
            name: np.frombuffer(mm, np.dtype(dtype), meta["total_capacity"],
                                regions[SLOT_PREFIX + name][0])
            for name, dtype in meta.get("slot_arrays", {}).items()
        }
        self._frame_regions = {
            name: np.frombuffer(mm, np.dtype(dtype), _region_nbytes(dtype, shape)
                                // np.dtype(dtype).itemsize, regions[name][0]).reshape(shape)
            for name, (dtype, shape) in meta.get("frame_regions", {}).items()
        }

    def settle(self, lock_hot: bool) -> bool:
        """Arrange what stays in memory: the cold tier is read in random order (no
        read-ahead); the hot tier of a persistent file is kept resident (mlock,
        where permitted) if ``lock_hot``. Returns whether the hot tier is locked."""
        if self.tier is not None and self.tier.file is not None:
            self.tier.file.random_access(self.tier.capacity)
        if not lock_hot or self.hot_tier is None:
            return False
        assert self._mm is not None
        spans = [self.meta["regions"][name] for name in self.meta["regions"]
                 if name.startswith(HOT_PREFIX)]
        start = min(offset for offset, _ in spans)
        end = max(offset + nbytes for offset, nbytes in spans)
        base = np.frombuffer(self._mm, np.uint8, 1).ctypes.data
        return keep_resident(self._mm, start, end - start, base + start)

    def frame_region(self, name: str) -> np.ndarray | None:
        """The writable mapped frame region ``name`` (format 6), or None."""
        return self._frame_regions.get(name)

    def region_writer(self, name: str) -> Callable[[int, bytes], None]:
        """A function writing bytes at an offset of region ``name`` with ``pwrite``
        (a sparse region: see the module doc): StorageFullError when the disk is full,
        StorageIOError when the write fails otherwise."""
        start, nbytes = self.meta["regions"][name]
        fd, path = self._fd, self.path

        def write(offset: int, data: bytes) -> None:
            if offset < 0 or offset + len(data) > nbytes:
                raise ValueError(f"a write of {len(data)} bytes at {offset} outside region "
                                 f"{name!r}")
            view = memoryview(data)
            done = 0
            try:
                while done < len(view):
                    done += os.pwrite(fd, view[done:], start + offset + done)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise StorageFullError(f"the disk of buffer file {path} is full: "
                                           f"{os.strerror(exc.errno)}") from exc
                raise StorageIOError(f"write to {path} failed: {exc}") from exc
        return write

    def slot_array(self, name: str) -> np.ndarray | None:
        """The writable mapped array ``name`` (one element per slot), or None if the file has none."""
        return self._slot_arrays.get(name)

    # ---- create / open -------------------------------------------------------------

    @classmethod
    def create(cls, path: str, schema: Schema, hot_capacity: int, total_capacity: int,
               persistent: bool = False, extra_meta: dict | None = None,
               slot_arrays: Mapping[str, str] | None = None,
               frame_regions: Regions | None = None) -> "BufferFile":
        """The file for ``path``, fully allocated, under a temporary name beside it.

        :meth:`publish` gives it its name once its owner is fully built, so a
        creation that fails at any point leaves nothing at ``path``
        (:meth:`close` with ``delete`` removes the temporary file). The
        temporary file is created exclusively and never through a symlink.

        ``persistent`` puts the hot ring in the file as well. ``slot_arrays``
        (``{name: numpy dtype string}``, e.g. ``{"priority": "<f8"}``) adds one
        zeroed array of ``total_capacity`` elements each: see
        :meth:`slot_array`. ``frame_regions`` (``{name: (dtype, shape)}``) adds
        those regions and makes the file format 6: see :meth:`frame_region`.
        Raises :class:`StorageFullError` when the disk cannot hold it, before
        writing anything.
        """
        header, meta, size = _plan(schema, hot_capacity, total_capacity, persistent, extra_meta,
                                   slot_arrays, frame_regions)
        version = _version_of(frame_regions)
        dense = dense_nbytes(meta, size)  # what is allocated: the sparse regions come last
        directory, base = os.path.split(os.path.abspath(path))
        check_free_space(directory, dense, path)
        temp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(temp, CREATE_FLAGS, 0o600)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise InvalidConfigError(f"cannot create buffer file {path}: {exc.strerror}") from exc
        try:
            allocate(fd, dense, path)
            if dense < size:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            unlink_quietly(temp)
            raise
        blob = json.dumps(meta).encode()
        _PREFIX.pack_into(mm, 0, MAGIC, version, header, len(blob))
        mm[_JSON_OFFSET : _JSON_OFFSET + len(blob)] = blob
        _HEADER_CRC.pack_into(mm, _HEADER_CRC_OFFSET, _header_crc(mm, len(blob)))
        created = cls(temp, fd, mm, meta, schema, version=version)
        created.final_path = path
        created.commit(0, 0, 0)
        return created

    @staticmethod
    def allocated_nbytes(schema: Schema, hot_capacity: int, total_capacity: int,
                         persistent: bool = False, extra_meta: dict | None = None,
                         slot_arrays: Mapping[str, str] | None = None,
                         frame_regions: Regions | None = None) -> int:
        """The bytes :meth:`create` allocates with these arguments: all of the file but its
        sparse regions (compressed rings, written as they fill)."""
        _, meta, size = _plan(schema, hot_capacity, total_capacity, persistent, extra_meta,
                              slot_arrays, frame_regions)
        return dense_nbytes(meta, size)

    def publish(self, replace: bool = True) -> None:
        """Give a created file its name (atomically). ``replace=False`` refuses to
        take the place of anything already there (a file, a symlink): FileConflictError."""
        if self.path == self.final_path:
            return
        if replace:
            os.rename(self.path, self.final_path)
        else:
            try:
                os.link(self.path, self.final_path)  # fails if anything has that name
            except FileExistsError:
                raise FileConflictError(
                    f"{self.final_path} exists and is not a buffer this process serves; "
                    "move it away") from None
            os.unlink(self.path)
        self.path = self.final_path
        if self.meta["persistent"]:  # the new name survives a machine crash too
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))

    @classmethod
    def open(cls, path: str, readonly: bool = False) -> "BufferFile":
        """Map an existing buffer file; raises CorruptFileError if it is not a sound one.
        ``readonly``: for reading only (:mod:`.inspect`); nothing may be written then."""
        try:
            fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW
                         | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise InvalidConfigError(f"no buffer file at {path}") from exc
        except OSError as exc:  # ELOOP: a symlink; never followed
            raise CorruptFileError(f"{path} is not a regular file ({exc.strerror})") from exc
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                raise CorruptFileError(f"{path}: {size} bytes is too short for a millpond file")
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_DEFAULT)
            try:
                meta, schema, version = _read_meta(mm, path)
                state = read_commit(mm, path, version)
            except BaseException:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, meta, schema, state.counters, version, state)

    @staticmethod
    def peek(path: str) -> dict:
        """The metadata of the buffer file at ``path``, without keeping it open."""
        file = BufferFile.open(path)
        try:
            return file.meta
        finally:
            file.close(delete=False)

    @staticmethod
    def read_meta(mm: mmap.mmap, path: str) -> tuple[dict, int]:
        """Parse and check the header of a mapped file; return (metadata, pushed)."""
        meta, _, version = _read_meta(mm, path)
        _, pushed, _, _ = read_commit(mm, path, version).counters
        return meta, pushed

    @staticmethod
    def write_meta(path: str, meta: dict) -> None:
        """Replace the JSON metadata of the file at ``path`` (the new one must fit in its
        header) and reseal its checksum: for tools and tests that edit a file's
        metadata; serving never does. The version and layout are the caller's."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with mmap.mmap(fd, PAGE) as head:
                magic, version, header, _ = _PREFIX.unpack_from(head, 0)
            blob = json.dumps(meta).encode()
            if _JSON_OFFSET + len(blob) > header:
                raise InvalidConfigError(f"{path}: the new metadata do not fit its header")
            with mmap.mmap(fd, header) as mm:
                mm[_JSON_OFFSET : _JSON_OFFSET + len(blob)] = blob
                _PREFIX.pack_into(mm, 0, magic, version, header, len(blob))
                if version in FORMATS and Format.of(version).checked_header:
                    _HEADER_CRC.pack_into(mm, _HEADER_CRC_OFFSET, _header_crc(mm, len(blob)))
        finally:
            os.close(fd)

    # ---- writes ----------------------------------------------------------------------

    def commit(self, pushed: int, first: int, hot_lo: int) -> None:
        """Record the live ranges: the commit point of every change of them. Written to
        slot A, then to slot B (see the module doc), in files of every format: a reader
        of format 4 takes the sound slot of the highest generation, which is this one."""
        self.generation += 1
        counters = (self.generation, pushed, first, hot_lo)
        assert self._mm is not None  # the buffer commits only while open, under its lock
        crc = _slot_crc(*counters)
        for offset in _SLOT_OFFSETS:
            _SLOT.pack_into(self._mm, offset, *counters, crc)
        self.pushed, self.first, self.hot_lo = pushed, first, hot_lo

    def sync(self) -> None:
        """Write dirty pages to disk and wait (see :func:`sync_fd`)."""
        if self._mm is not None:
            sync_fd(self._fd, self.path)

    def sync_handle(self) -> int | None:
        """A duplicate of the file's fd for :func:`sync_fd` (the caller closes it), which
        stays valid if the file is closed meanwhile; None if no fd is left to spare."""
        try:
            return os.dup(self._fd) if self._mm is not None else None
        except OSError:
            return None

    def close(self, delete: bool) -> None:
        """Unmap and close; remove the file when ``delete``. Idempotent."""
        if self._mm is None:
            return
        for part in (self.tier, self.hot_tier):
            if part is not None:
                part.release()  # views into the map must go before it closes
        self._slot_arrays = {}
        self._frame_regions = {}
        self._mm.close()
        os.close(self._fd)
        self._mm = None
        if delete:
            unlink_quietly(self.path)


def _version() -> str:
    """This millpond's version (installed or not: millpond/_version.py)."""
    from .._version import __version__

    return __version__


def _read_meta(mm: mmap.mmap, path: str) -> tuple[dict, Schema, int]:
    """(metadata, schema, format version) of a mapped file, all checked."""
    if len(mm) < _JSON_OFFSET:
        raise CorruptFileError(f"{path}: too short to be a millpond buffer file")
    magic, version, header, length = _PREFIX.unpack_from(mm, 0)
    if magic != MAGIC:
        raise CorruptFileError(f"{path}: not a millpond buffer file (bad magic)")
    if version not in FORMATS:
        newer = "a newer millpond made it: serve it with that one" if version > NEWEST_VERSION \
            else "the header is damaged, or a millpond too old to be read made it"
        raise CorruptFileError(
            f"{path}: format version {version}; millpond {_version()} reads versions "
            f"{OLDEST_VERSION} to {NEWEST_VERSION} ({newer})")
    if not _JSON_OFFSET + length <= header <= len(mm):
        raise CorruptFileError(f"{path}: damaged header (metadata length {length})")
    if Format.of(version).checked_header:
        (stored,) = _HEADER_CRC.unpack_from(mm, _HEADER_CRC_OFFSET)
        if stored != _header_crc(mm, length):
            raise CorruptFileError(f"{path}: damaged header: the metadata fail their checksum "
                                   "(crc32): the file's layout cannot be trusted")
    try:
        meta = json.loads(bytes(mm[_JSON_OFFSET : _JSON_OFFSET + length]))
        schema = Schema.from_spec({k: (dt, tuple(shape)) for k, (dt, shape) in meta["schema"].items()})
        regions = meta["regions"]
        end = max((off + n for off, n in regions.values()), default=header)
        for name, dtype in meta.get("slot_arrays", {}).items():
            if regions[SLOT_PREFIX + name][1] != meta["total_capacity"] * np.dtype(dtype).itemsize:
                raise ValueError(f"slot array {name!r} has the wrong size")
        tiers = [("", meta["cold_capacity"])]
        if meta["persistent"]:
            tiers.append((HOT_PREFIX, meta["hot_capacity"] + meta.get("spare", 0)))
        for prefix, capacity in tiers:
            for f in schema if capacity else ():
                if regions[prefix + f.name][1] != capacity * f.nbytes:
                    raise ValueError(f"region {prefix + f.name!r} has the wrong size")
        if version >= 5 and meta.get("checksum") != CHECKSUM_NAME:
            raise ValueError(f"record checksum {meta.get('checksum')!r}")
        frame_regions = meta.get("frame_regions", {})
        if _version_of(frame_regions) != max(version, FORMAT_VERSION):  # (4: none)
            raise ValueError(f"format {version} with frame regions {sorted(frame_regions)}")
        for name, (dtype, shape) in frame_regions.items():
            if regions[name][1] != _region_nbytes(dtype, shape):
                raise ValueError(f"frame region {name!r} has the wrong size")
        spare = meta.get("spare", 0)
        if not isinstance(spare, int) or spare < 0 or (spare and version < 5):
            raise ValueError(f"spare {spare!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptFileError(f"{path}: damaged header metadata ({exc})") from exc
    if end > len(mm):
        raise CorruptFileError(f"{path}: truncated: {len(mm):,} bytes, regions need {end:,}")
    return meta, schema, version


def read_slots(raw: bytes) -> list[tuple[tuple[int, int, int, int], bool]]:
    """Both commit slots of a file's first bytes, as stored, and whether each is sound
    (for a look at a file that cannot be opened)."""
    slots = []
    for offset in _SLOT_OFFSETS:
        if len(raw) < offset + _SLOT.size:
            break
        generation, pushed, first, hot_lo, crc = _SLOT.unpack_from(raw, offset)
        counters = (generation, pushed, first, hot_lo)
        slots.append((counters, bool(generation) and crc == _slot_crc(*counters)
                      and first <= hot_lo <= pushed))
    return slots


class CommitState:
    """What the two commit slots of a file say: the counters to use, each slot as read,
    and what was wrong (``notes``; ``doubt``: why an acknowledged push may be missing)."""

    def __init__(self, counters: tuple[int, int, int, int], used: str,
                 slots: list[tuple[tuple[int, int, int, int], bool]], notes: list[str],
                 doubt: str | None = None):
        self.counters = counters
        self.used = used  # "A", "B"
        self.slots = slots  # per slot: (counters as stored, sound)
        self.notes = notes
        self.doubt = doubt


def read_commit(mm: mmap.mmap, path: str, version: int) -> CommitState:
    """The committed live ranges of a mapped file (see the module doc); CorruptFileError
    if neither slot can be trusted."""
    slots: list[tuple[tuple[int, int, int, int], bool]] = []
    for offset in _SLOT_OFFSETS:
        generation, pushed, first, hot_lo, crc = _SLOT.unpack_from(mm, offset)
        counters = (generation, pushed, first, hot_lo)
        sound = bool(generation) and crc == _slot_crc(*counters) and first <= hot_lo <= pushed
        slots.append((counters, sound))
    (a, a_ok), (b, b_ok) = slots
    if not a_ok and not b_ok:
        raise CorruptFileError(f"{path}: both copies of the push counter (commit slots A and B) "
                               "are damaged: which records were acknowledged is unknown")
    if a_ok and b_ok:
        if version < 5 or a[0] == b[0] + 1 or a == b:  # format 4: the newer one
            used = "A" if a[0] >= b[0] else "B"
            return CommitState(a if used == "A" else b, used, slots, [])
        raise CorruptFileError(
            f"{path}: the commit slots disagree (generation {a[0]} in A, {b[0]} in B): "
            "damaged beyond what one torn write explains")
    used, bad = ("A", "B") if a_ok else ("B", "A")
    counters = a if a_ok else b
    note = f"commit slot {bad} is damaged; slot {used} (generation {counters[0]}) is used"
    if version >= 5:  # every commit is in both: the other one holds it, or the one before
        return CommitState(counters, used, slots, [note + " (no acknowledged push lost)"])
    doubt = (f"{note}, which may lack the last acknowledged push (a format 4 file writes "
             "its commits to one slot at a time)")
    return CommitState(counters, used, slots, [doubt], doubt)


def _map_tier(mm: mmap.mmap, schema: Schema, capacity: int, regions: dict, prefix: str,
              fmt: Format, fd: int | None = None) -> Tier:
    """The tier whose regions have ``prefix``; with ``fd``, it does its I/O through it."""
    def view(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        offset = regions[prefix + name][0]
        count = capacity * int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(mm, dtype, count, offset).reshape((capacity,) + shape)

    columns = {f.name: view(f.name, f.dtype, f.shape) for f in schema}
    seq = view(SEQ_REGION, SEQ_DTYPE, ())
    checksum_column = (view(CHECKSUM_REGION, fmt.checksum_dtype, ())
                       if prefix + CHECKSUM_REGION in regions else None)
    file = None
    if fd is not None:
        arrays = {**columns, SEQ_REGION: seq, **({} if checksum_column is None else
                                                  {CHECKSUM_REGION: checksum_column})}
        file = TierFile(fd, mm, {name: regions[prefix + name][0] for name in arrays},
                        {name: array.strides[0] for name, array in arrays.items()})
    return Tier(capacity, columns, seq, checksum_column, file, fmt.checksums)


def _check_slot_arrays(slot_arrays: Mapping[str, str]) -> dict[str, str]:
    checked = {}
    for name, dtype in slot_arrays.items():
        if not isinstance(name, str) or not name:
            raise InvalidConfigError(f"slot array names must be non-empty strings, got {name!r}")
        try:
            dt = np.dtype(dtype)
        except TypeError as exc:
            raise InvalidConfigError(f"slot array {name!r}: bad dtype {dtype!r}") from exc
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
            raise InvalidConfigError(f"slot array {name!r}: dtype {dtype!r} cannot live in a file")
        checked[name] = dt.str  # e.g. "<f8": explicit byte order
    return checked
