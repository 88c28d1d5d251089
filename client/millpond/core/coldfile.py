"""The cold file: a self-describing, preallocated, memory-mapped ring.

Layout (all integers little-endian)::

    offset 0   magic  b"MILLPOND"
    offset 8   u32    format version
    offset 12  u32    header size in bytes (a multiple of the page size)
    offset 16  u64    pushed: records ever pushed to the buffer
    offset 24  u32    length of the JSON metadata
    offset 64  JSON   {"schema", "hot_capacity", "total_capacity",
                       "cold_capacity", "regions": {name: [offset, nbytes]}}
    then one page-aligned region per field, and one for the per-slot seq

The whole file is allocated with ``posix_fallocate`` at creation, so a full
disk fails there with :class:`StorageFullError` instead of raising SIGBUS on
a later write through the mapping. It is mapped once; reads and writes go
through the same mapping and nothing is remapped or msynced per sample.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct

import numpy as np

from ..errors import CorruptFileError, InvalidConfigError, StorageFullError
from .schema import Schema
from .tier import SEQ_DTYPE, Tier

MAGIC = b"MILLPOND"
FORMAT_VERSION = 1
PAGE = mmap.PAGESIZE
_PREFIX = struct.Struct("<8sIIQI")  # magic, version, header size, pushed, json length
_PUSHED_OFFSET = 16
_JSON_OFFSET = 64
# Not a Python identifier, so no field name (fields must be identifiers) can
# collide with it in the region table.
SEQ_REGION = "#seq"


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def _layout(schema: Schema, cold_capacity: int, meta: dict) -> tuple[int, dict, int]:
    """Return (header size, regions, file size) for a schema and capacity."""
    sizes = [(f.name, cold_capacity * f.nbytes) for f in schema]
    sizes.append((SEQ_REGION, cold_capacity * SEQ_DTYPE.itemsize))
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


class ColdFile:
    """One buffer's cold tier in a mapped file. Not thread-safe: the buffer locks."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, meta: dict, tier: Tier):
        self.path = path
        self._fd = fd
        self._mm = mm
        self.meta = meta
        self.tier = tier

    @classmethod
    def create(cls, path: str, schema: Schema, hot_capacity: int, total_capacity: int) -> "ColdFile":
        """Create (or replace) the file at ``path``, fully allocated.

        Raises :class:`StorageFullError` when the disk cannot hold it; the
        partial file is removed.
        """
        cold_capacity = total_capacity - hot_capacity
        meta = {
            "schema": {name: [dt, list(shape)] for name, (dt, shape) in schema.spec().items()},
            "hot_capacity": hot_capacity,
            "total_capacity": total_capacity,
            "cold_capacity": cold_capacity,
        }
        header, regions, size = _layout(schema, cold_capacity, meta)
        meta["regions"] = regions
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise InvalidConfigError(f"cannot create cold file {path}: {exc.strerror}") from exc
        try:
            _allocate(fd, size, path)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        blob = json.dumps(meta).encode()
        _PREFIX.pack_into(mm, 0, MAGIC, FORMAT_VERSION, header, 0, len(blob))
        mm[_JSON_OFFSET : _JSON_OFFSET + len(blob)] = blob
        return cls(path, fd, mm, meta, _map_tier(mm, schema, cold_capacity, regions))

    @staticmethod
    def read_meta(mm: mmap.mmap, path: str) -> tuple[dict, int]:
        """Parse and check the header; return (metadata, pushed)."""
        if len(mm) < _JSON_OFFSET:
            raise CorruptFileError(f"{path}: too short to be a millpond file")
        magic, version, header, pushed, length = _PREFIX.unpack_from(mm, 0)
        if magic != MAGIC:
            raise CorruptFileError(f"{path}: not a millpond cold file (bad magic)")
        if version != FORMAT_VERSION:
            raise CorruptFileError(f"{path}: format version {version}, expected {FORMAT_VERSION}")
        try:
            meta = json.loads(bytes(mm[_JSON_OFFSET : _JSON_OFFSET + length]))
        except ValueError as exc:
            raise CorruptFileError(f"{path}: damaged header metadata") from exc
        return meta, pushed

    def set_pushed(self, pushed: int) -> None:
        """Record the buffer's push counter in the header."""
        struct.pack_into("<Q", self._mm, _PUSHED_OFFSET, pushed)

    def close(self, delete: bool) -> None:
        """Unmap and close; remove the file when ``delete``. Idempotent."""
        if self._mm is None:
            return
        self.tier.release()  # views into the map must go before it closes
        self._mm.close()
        os.close(self._fd)
        self._mm = None
        if delete:
            _unlink_quietly(self.path)


def _map_tier(mm: mmap.mmap, schema: Schema, capacity: int, regions: dict) -> Tier:
    def view(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        offset = regions[name][0]
        count = capacity * int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(mm, dtype, count, offset).reshape((capacity,) + shape)

    columns = {f.name: view(f.name, f.dtype, f.shape) for f in schema}
    return Tier(capacity, columns, view(SEQ_REGION, SEQ_DTYPE, ()))


def _allocate(fd: int, size: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise StorageFullError(
                f"cannot allocate {size:,} bytes for cold file {path}: {os.strerror(exc.errno)}"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # filesystem without fallocate: best effort


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
