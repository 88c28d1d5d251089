"""A FIFO byte ring of compressed values ("blobs"), one per id: the storage of a
compressed frame group (see :mod:`.frames` and :mod:`.codecs`).

Compressed frames have variable lengths, but they live and die in id order: a
frame group writes ids ``0, 1, 2, ...`` in order and frees them from its head in
the same order. So a ring of bytes suffices, with no allocator: blob ``i`` lies
at a *logical* offset ``offs[i]`` that only grows, at ``offs[i] % nbytes`` in
the ring's ``data``. A blob never straddles the ring's end: one that would is
placed at the next lap's start, and the skipped bytes count as used until the
head passes them. The index (``ids``, ``offs``, ``lens`` and, in a persistent
file, ``sums``) has one slot per id, ``id % capacity``, like the fixed frame
ring's.

**Room.** Frames ``[low, tail)`` occupy the logical bytes
``[offs[low], end)``; a push may write new blobs only if, placed from ``end``
on, they end within ``nbytes`` of ``offs[low]`` (:meth:`Arena.prepare`): so a
blob a live record (or a record the push evicts: see :mod:`.fifo`) refers to is
never overwritten. Otherwise :class:`StorageFullError`, before anything is
written.

**Raw values.** A value that does not shrink is stored as it is, and a blob's
length says which: ``lens[i] == frame_nbytes`` is a raw value, anything shorter
is compressed. So a blob is never larger than the value, and the ring never
needs more bytes than the fixed ring it replaces.

**Integrity.** ``sums[i]`` is the crc32 of the blob's stored (compressed)
bytes, keyed by its id, offset and length: a damaged blob is found without
decompressing it, and one found at another id or offset fails. Nothing here is
committed: at reopen the live records' ids say which blobs are live, each is
checked (:meth:`Arena.damaged`), and :meth:`Arena.restore` puts the write
position after the newest live one (blobs of a push that never committed lie
past it and are overwritten).

**Writes** go through ``writer(offset, bytes)`` when given (a file's region,
written with ``pwrite``: a disk that fills up fails the push with
StorageFullError; a write through a mapping of a sparse file would raise
SIGBUS), else into ``data``. Reads read ``data`` (the mapping, or RAM).

**Reads** decompress each distinct blob once, on a few threads when there are
many (both codecs release the GIL): :meth:`Arena.read`. The stored form of
blobs (:meth:`Arena.blob`) is the seam for sending them compressed over the
wire, to be decompressed by the client.

Not thread-safe: the buffer holds its lock around every call.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
import zlib
from typing import Callable, Sequence

import numpy as np

from millpond.core.codecs import Codec
from millpond.errors import StorageFullError

ID_DTYPE = np.dtype("<i8")
OFF_DTYPE = np.dtype("<i8")
LEN_DTYPE = np.dtype("<u4")
SUM_DTYPE = np.dtype("<u4")
INDEX_NBYTES = ID_DTYPE.itemsize + OFF_DTYPE.itemsize + LEN_DTYPE.itemsize
_KEY = struct.Struct("<qqq")
# Blobs decompressed on threads when a read has at least this many (and a thread has
# at least half of it): below that, handing out the work costs more than it saves.
PARALLEL_MIN = 64
THREADS = int(os.environ.get("MILLPOND_DECOMPRESS_THREADS", 0)) or max(2, min(4, os.cpu_count() or 2))
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()

Writer = Callable[[int, bytes], None]  # (offset in the ring's data, bytes)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=THREADS,
                thread_name_prefix="millpond-decompress")
        return _POOL


def blob_sum(frame_id: int, offset: int, data: bytes | memoryview) -> int:
    """The checksum of a stored blob (see the module doc)."""
    return zlib.crc32(data, zlib.crc32(_KEY.pack(frame_id, offset, len(data))))


def place(end: int, nbytes: int, sizes: Sequence[int]) -> tuple[list[int], int]:
    """Logical offsets of blobs of ``sizes`` written from ``end`` on in a ring of
    ``nbytes``, and the end after them: no blob straddles a lap's end."""
    offsets = []
    for size in sizes:
        if end % nbytes + size > nbytes:
            end += nbytes - end % nbytes
        offsets.append(end)
        end += size
    return offsets, end


class Prepared:
    """The blobs of a push, compressed and placed, not yet written."""

    def __init__(self, blobs: list[bytes], offsets: list[int], end: int):
        self.blobs, self.offsets, self.end = blobs, offsets, end


class Arena:
    """One compressed frame group's blobs: ``data`` (uint8, the ring), the index
    (``ids``: the id each slot holds, -1 none; ``offs``, ``lens``; ``sums`` in a
    persistent file), its ``codec`` and the values' size ``frame_nbytes``."""

    def __init__(self, data: np.ndarray, ids: np.ndarray, offs: np.ndarray, lens: np.ndarray,
                 sums: np.ndarray | None, codec: Codec, frame_nbytes: int,
                 writer: Writer | None = None):
        self.data, self.ids, self.offs, self.lens, self.sums = data, ids, offs, lens, sums
        self.codec = codec
        self.frame_nbytes = frame_nbytes
        self.nbytes = len(data)
        self.capacity = len(ids)
        self.writer = writer
        self.end = 0  # the logical offset of the next blob

    @classmethod
    def in_memory(cls, capacity: int, nbytes: int, codec: Codec, frame_nbytes: int) -> "Arena":
        return cls(np.empty(nbytes, np.uint8), np.full(capacity, -1, ID_DTYPE),
                   np.zeros(capacity, OFF_DTYPE), np.zeros(capacity, LEN_DTYPE), None, codec,
                   frame_nbytes)

    # ---- pushes -------------------------------------------------------------------

    def compress(self, raw: bytes) -> bytes:
        """The stored form of one value's bytes: compressed, or raw if that is not smaller."""
        blob = self.codec.compress(raw)
        return blob if len(blob) < len(raw) else raw

    def offset(self, frame_id: int, tail: int) -> int:
        """The logical offset of frame ``frame_id`` (``end`` if it is ``tail`` or later)."""
        return int(self.offs[frame_id % self.capacity]) if frame_id < tail else self.end

    def prepare(self, blobs: list[bytes], low: int, tail: int, source: str) -> Prepared:
        """Place ``blobs`` (ids ``tail`` on) after the others; StorageFullError if they
        would overwrite frame ``low`` or later (see the module doc)."""
        offsets, end = place(self.end, self.nbytes, [len(b) for b in blobs])
        start = self.offset(low, tail)
        if end - start > self.nbytes:
            raise StorageFullError(
                f"the compressed frame store of {source!r} holds {self.nbytes:,} bytes; the "
                f"live records' frames take {self.end - start:,} and this push adds "
                f"{end - self.end:,}: give the buffer a larger compressed_bytes (its values "
                "compress less than the default assumes)")
        return Prepared(blobs, offsets, end)

    def write(self, first: int, prepared: Prepared) -> None:
        """Store the prepared blobs as ids ``first, first + 1, ...``: the bytes, then
        their index entries."""
        blobs, offsets = prepared.blobs, prepared.offsets
        if not blobs:
            return
        nbytes, cap = self.nbytes, self.capacity
        # Contiguous runs of blobs (one per lap) go in one write each.
        run_start = 0
        for j in range(1, len(blobs) + 1):
            if (j == len(blobs) or offsets[j] % nbytes == 0
                    or offsets[j] != offsets[j - 1] + len(blobs[j - 1])):
                self._store(offsets[run_start] % nbytes, b"".join(blobs[run_start:j]))
                run_start = j
        ids = np.arange(first, first + len(blobs), dtype=np.int64)
        slots = ids % cap
        self.offs[slots] = offsets
        self.lens[slots] = [len(b) for b in blobs]
        if self.sums is not None:
            self.sums[slots] = [blob_sum(i, off, b) for i, off, b
                                in zip(ids.tolist(), offsets, blobs)]
        self.ids[slots] = ids
        self.end = prepared.end

    def _store(self, at: int, data: bytes) -> None:
        if self.writer is not None:
            self.writer(at, data)
        else:
            self.data[at:at + len(data)] = np.frombuffer(data, np.uint8)

    # ---- reads --------------------------------------------------------------------

    def blob(self, frame_id: int) -> memoryview:
        """Frame ``frame_id``'s stored bytes (compressed, or raw if their length is
        ``frame_nbytes``): a view, valid until the ring is written again."""
        slot = frame_id % self.capacity
        at = int(self.offs[slot]) % self.nbytes
        return memoryview(self.data[at:at + int(self.lens[slot])].data)

    def read(self, frame_ids: np.ndarray, out: np.ndarray) -> None:
        """Frames ``frame_ids`` (live) decompressed into ``out`` (``[len(frame_ids)]`` of
        ``frame_nbytes`` each, C-contiguous), on threads when they are many."""
        n = len(frame_ids)
        slots = frame_ids % self.capacity
        starts = (self.offs[slots] % self.nbytes).tolist()
        lengths = self.lens[slots].tolist()
        if n < PARALLEL_MIN or THREADS < 2:
            parts = self._read(starts, lengths, 0, n)
        else:
            pool = _pool()
            count = min(THREADS, n // (PARALLEL_MIN // 2))
            bounds = [n * p // count for p in range(count + 1)]
            futures = [pool.submit(self._read, starts, lengths, lo, hi)
                       for lo, hi in zip(bounds[1:-1], bounds[2:])]
            parts = self._read(starts, lengths, bounds[0], bounds[1])  # a share here too
            for future in futures:
                parts += future.result()
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(b"".join(parts), np.uint8)

    def _read(self, starts: list[int], lengths: list[int], lo: int, hi: int) -> list[bytes]:
        """The values of ``[lo, hi)`` of a read, as bytes (decompressed, or copied raw)."""
        size, data = self.frame_nbytes, memoryview(self.data.data)
        decompress = self.codec.decompress
        return [bytes(data[at:at + length]) if length == size
                else decompress(data[at:at + length], size)
                for at, length in zip(starts[lo:hi], lengths[lo:hi])]

    def stored_nbytes(self, head: int, tail: int) -> int:
        """The ring's bytes in use by frames ``[head, tail)`` (skipped ends included) and
        their index entries."""
        return self.end - self.offset(head, tail) + (tail - head) * INDEX_NBYTES

    # ---- reopen -------------------------------------------------------------------

    def damaged(self, wanted: np.ndarray) -> np.ndarray:
        """Which of the frames ``wanted`` are not intact: another id in their slot, a
        length or offset that cannot be, a checksum that fails (persistent files);
        decompression is not tried."""
        slots = wanted % self.capacity
        lens = self.lens[slots].astype(np.int64)
        offs = self.offs[slots]
        wrong = ((wanted < 0) | (self.ids[slots] != wanted) | (lens < 1)
                 | (lens > self.frame_nbytes) | (offs < 0)
                 | (offs % self.nbytes + lens > self.nbytes))
        if self.sums is not None:
            data, nbytes = self.data, self.nbytes
            for j in np.flatnonzero(~wrong).tolist():
                at = int(offs[j]) % nbytes
                blob = data[at:at + int(lens[j])].data
                if blob_sum(int(wanted[j]), int(offs[j]), blob) != int(self.sums[slots[j]]):
                    wrong[j] = True
        return wrong

    def restore(self, tail: int) -> None:
        """Resume writing after frame ``tail - 1`` (intact), or from 0 if none is live."""
        if tail <= 0:
            self.end = 0
            return
        slot = (tail - 1) % self.capacity
        self.end = int(self.offs[slot]) + int(self.lens[slot])

    def release(self) -> None:
        self.data = np.empty(0, np.uint8)
        self.ids = np.empty(0, ID_DTYPE)
        self.offs = np.empty(0, OFF_DTYPE)
        self.lens = np.empty(0, LEN_DTYPE)
        self.sums = None
        self.writer = None
