"""The push log: a push acknowledged before it is stored, and never lost for that.

Storing a small push costs a daemon more than receiving it: the records'
checksums, the move of the oldest hot records to the cold tier, three
commits. A persistent buffer's file has one more region, the push log, so that
a push can be acknowledged once it is *logged*, and stored right after, while
the client is busy with its next one:

1. **log** (:meth:`PushLog.write`): the batch's bytes (each field's rows, in
   schema order) are copied into the region, then its header: the push's first
   seq and length, the payload's crc32 and the header's own. From then on the
   push is as safe as a stored one against a crash of the process: the file's
   pages live in the page cache, not in the process.
2. **store**: the usual append (:meth:`.fifo.Fifo.append`), before anything
   else uses the buffer (:class:`.loggedpush.SettlingLock`); then the header is cleared.

Reopening a file whose log holds a valid push that starts at the committed
``pushed`` stores it first (:mod:`.recovery`): the append can be redone from
any of its commit points. A machine crash may tear a push logged after the last
sync began; its crc then fails and it is dropped, like any record written
since (README, "Durability").

Layout of the region (little-endian)::

    offset 0    u64 first seq, u64 records, u64 payload bytes, u32 crc32 of
                the payload, u32 crc32 of the 28 bytes before it
    offset 64   the payload: per field, ``records * field bytes``, each field
                starting at a multiple of 8
"""

from __future__ import annotations

import mmap
import struct
import zlib
from typing import Mapping

import numpy as np

from .schema import Schema

LOG_REGION = "#log"  # the region's name in a file's table (not an identifier: no field's)
LOG_PAYLOAD_BYTES = 256 << 10  # the largest batch a push log takes (a daemon's small push)
_HEADER = struct.Struct("<QQQI")  # first, records, payload bytes, payload crc32
_HEADER_NBYTES = _HEADER.size + 4  # and the header's own crc32
_PAYLOAD_OFFSET = 64


def log_region_nbytes(schema: Schema) -> int:
    """The size of a push log region for ``schema`` (room for padding every field)."""
    return _PAYLOAD_OFFSET + LOG_PAYLOAD_BYTES + 8 * len(schema.fields)


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class PushLog:
    """One file's push log region (see the module docstring). Not thread-safe: the
    buffer's lock guards it."""

    def __init__(self, mm: mmap.mmap, offset: int, nbytes: int, schema: Schema):
        self._mm = mm
        self._offset = offset
        self._schema = schema
        self._payload = np.frombuffer(mm, np.uint8, nbytes - _PAYLOAD_OFFSET,
                                      offset + _PAYLOAD_OFFSET)

    @classmethod
    def in_file(cls, mm: mmap.mmap, regions: Mapping[str, list[int]], schema: Schema
                ) -> "PushLog | None":
        """The push log of a mapped file with the region table ``regions``; None if it
        has none."""
        if LOG_REGION not in regions:
            return None
        offset, nbytes = regions[LOG_REGION]
        return cls(mm, offset, nbytes, schema)

    def fits(self, n: int) -> bool:
        """Whether a batch of ``n`` records fits in the log."""
        return self._payload_nbytes(n) <= len(self._payload)

    def _payload_nbytes(self, n: int) -> int:
        return sum(_padded(n * f.nbytes) for f in self._schema)

    def write(self, first: int, n: int, batch: Mapping[str, np.ndarray]) -> None:
        """Log the validated batch of ``n`` records (``[n, *shape]`` in the field dtypes)
        that starts at seq ``first``: payload, then header. It must fit."""
        for name, column in self.columns(n).items():
            column[...] = batch[name]
        nbytes = self._payload_nbytes(n)
        self._write_header(first, n, nbytes, zlib.crc32(self._payload[:nbytes].data))

    def read(self) -> tuple[int, int, dict[str, np.ndarray]] | None:
        """The logged push ``(first seq, records, batch)``, its columns copied out; None if
        the log holds none or it fails its checks (cleared, or torn by a machine crash)."""
        first, n, nbytes, payload_crc = _HEADER.unpack_from(self._mm, self._offset)
        (crc,) = struct.unpack_from("<I", self._mm, self._offset + _HEADER.size)
        if (crc != zlib.crc32(self._mm[self._offset : self._offset + _HEADER.size])
                or nbytes != self._payload_nbytes(n) or not self.fits(n) or not n
                or payload_crc != zlib.crc32(self._payload[:nbytes].data)):
            return None
        return first, n, {name: column.copy() for name, column in self.columns(n).items()}

    def columns(self, n: int) -> dict[str, np.ndarray]:
        """The logged batch of ``n`` records as views of the log, one ``[n, *shape]``
        array per field (the mapping cannot close while they live)."""
        columns, pos = {}, 0
        for f in self._schema:
            nbytes = n * f.nbytes
            columns[f.name] = self._payload[pos : pos + nbytes].view(f.dtype).reshape(
                (n,) + f.shape)
            pos += _padded(nbytes)
        return columns

    def clear(self) -> None:
        """Forget the logged push (stored now): a zeroed header fails its crc."""
        self._mm[self._offset : self._offset + _HEADER_NBYTES] = bytes(_HEADER_NBYTES)

    def release(self) -> None:
        """Drop the view of the mapping (before it is closed)."""
        self._payload = np.empty(0, np.uint8)

    def _write_header(self, first: int, n: int, nbytes: int, payload_crc: int) -> None:
        header = _HEADER.pack(first, n, nbytes, payload_crc)
        self._mm[self._offset : self._offset + _HEADER_NBYTES] = (
            header + struct.pack("<I", zlib.crc32(header)))
