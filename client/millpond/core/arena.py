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
on, they end within ``lap`` (the ring's size) of ``offs[low]``
(:meth:`Arena.prepare`): so a blob a live record (or a record the push evicts:
see :mod:`.fifo`) refers to is never overwritten. Otherwise the ring doubles
(see :class:`Arena`), up to its limit (``compressed_bytes``), and past that the
push fails with :class:`StorageFullError`, before anything is written. So the
ring's RAM and file pages follow the bytes the live records need (within a
factor of two), not the capacity times the plain value size.

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

**Reads** decompress each distinct blob once (:meth:`Arena.read`), on a few
threads when there are many large ones (both codecs release the GIL while they
work; on small values the GIL's handoffs cost more: see ``PARALLEL_BYTES``). The stored form of
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
# Values (de)compressed on threads when a call has at least this many (a thread at least
# half of it), each of at least PARALLEL_BYTES: a thread releases the GIL only while it
# (de)compresses one value, and on small values (an 84x84 frame: 1-3 us) the handoffs cost
# more than a second core gives. Measured on Atari frames on the 2-core development
# machine: two threads sampled at 0.5-0.9x of one, with stalls to 0.15x under load.
PARALLEL_MIN = 64
PARALLEL_BYTES = 64 << 10
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


def _base(frame_nbytes: int) -> int:
    return max(1 << 20, 16 * frame_nbytes)  # the least first size: 1 MiB, or 16 values


def ring_limit(nbytes: int, frame_nbytes: int) -> int:
    """The size a ring asked to hold ``nbytes`` may grow to: ``nbytes`` rounded up to a
    multiple of ``2**k``, the most halvings that leave at least the first size (see
    :func:`first_lap`): by less than a millionth of it."""
    base = _base(frame_nbytes)
    if nbytes <= base:
        return nbytes
    step = 1 << ((nbytes // base).bit_length() - 1)
    return -(-nbytes // step) * step


def first_lap(limit: int, frame_nbytes: int) -> int:
    """The ring's size when it is made: ``limit`` halved while it halves evenly and stays
    at least 1 MiB (or 16 values), so that doublings lead to ``limit`` exactly."""
    base, lap = _base(frame_nbytes), limit
    while lap % 2 == 0 and lap // 2 >= base:
        lap //= 2
    return lap


class Prepared:
    """The blobs of a push, compressed and placed (in a ring of ``lap`` bytes, grown
    if larger than the current one), not yet written."""

    def __init__(self, blobs: list[bytes], offsets: list[int], end: int, lap: int, start: int):
        self.blobs, self.offsets, self.end, self.lap = blobs, offsets, end, lap
        self.start = start  # the logical offset of the oldest bytes kept


class Arena:
    """One compressed frame group's blobs: ``data`` (uint8: the ring, or room for it
    to grow into), the index (``ids``: the id each slot holds, -1 none; ``offs``,
    ``lens``; ``sums`` in a persistent file), its ``codec`` and the values' size
    ``frame_nbytes``.

    **Size.** The ring is ``lap`` bytes and grows (doubles) when a push does not fit,
    up to ``limit`` bytes (``compressed_bytes``, see :func:`ring_limit`), a power of
    two times its first size (:func:`first_lap`): a blob never
    straddles a multiple of a lap, so after doubling each live blob is where it was
    or ``lap`` bytes further, and the blobs that move are one contiguous run of the
    old ring, copied (into bytes no live blob uses) before the new size is adopted
    and stored (``lap_store``: one int64 in the file; 0 there is the first lap). So
    RAM and disk follow what the live records hold, not ``limit``. In RAM, ``data``
    is reallocated; in a file, it is the whole sparse region."""

    def __init__(self, data: np.ndarray, ids: np.ndarray, offs: np.ndarray, lens: np.ndarray,
                 sums: np.ndarray | None, codec: Codec, frame_nbytes: int,
                 writer: Writer | None = None, limit: int | None = None,
                 lap_store: np.ndarray | None = None, lap: int | None = None):
        self.data, self.ids, self.offs, self.lens, self.sums = data, ids, offs, lens, sums
        self.codec = codec
        self.frame_nbytes = frame_nbytes
        self.limit = len(data) if limit is None else limit
        self.capacity = len(ids)
        self.writer = writer
        self.lap_store = lap_store
        stored = 0 if lap_store is None else int(lap_store[0])
        self.lap = stored or lap or first_lap(self.limit, frame_nbytes)
        ratio = self.limit // self.lap
        if self.limit % self.lap or ratio & (ratio - 1):
            raise ValueError(f"a ring of {self.lap} bytes cannot double to {self.limit}")
        self.end = 0  # the logical offset of the next blob

    @classmethod
    def in_memory(cls, capacity: int, limit: int, codec: Codec, frame_nbytes: int,
                  lap: int | None = None) -> "Arena":
        """A ring in RAM of at most ``limit`` bytes, ``lap`` (``limit`` halved evenly; default
        :func:`first_lap`) to begin with."""
        lap = lap or first_lap(limit, frame_nbytes)
        return cls(np.empty(lap, np.uint8), np.full(capacity, -1, ID_DTYPE),
                   np.zeros(capacity, OFF_DTYPE), np.zeros(capacity, LEN_DTYPE), None, codec,
                   frame_nbytes, limit=limit, lap=lap)

    @property
    def nbytes(self) -> int:
        """The ring's bytes now."""
        return self.lap

    # ---- pushes -------------------------------------------------------------------

    def compress(self, raw: bytes) -> bytes:
        """The stored form of one value's bytes: compressed, or raw if that is not smaller."""
        blob = self.codec.compress(raw)
        return blob if len(blob) < len(raw) else raw

    def compress_many(self, raws: list[bytes]) -> list[bytes]:
        """:meth:`compress` of each, on threads when they are many."""
        n = len(raws)
        if n < PARALLEL_MIN or THREADS < 2 or self.frame_nbytes < PARALLEL_BYTES:
            return [self.compress(raw) for raw in raws]
        count = min(THREADS, n // (PARALLEL_MIN // 2))
        bounds = [n * p // count for p in range(count + 1)]

        def part(lo: int, hi: int) -> list[bytes]:
            return [self.compress(raw) for raw in raws[lo:hi]]
        futures = [_pool().submit(part, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
        out = part(bounds[0], bounds[1])
        for future in futures:
            out += future.result()
        return out

    def offset(self, frame_id: int, tail: int) -> int:
        """The logical offset of frame ``frame_id`` (``end`` if it is ``tail`` or later)."""
        return int(self.offs[frame_id % self.capacity]) if frame_id < tail else self.end

    def prepare(self, blobs: list[bytes], low: int, tail: int, source: str) -> Prepared:
        """Place ``blobs`` (ids ``tail`` on) after the others, in a grown ring if they
        do not fit this one; StorageFullError if they would overwrite frame ``low`` or
        later even in a ring of ``limit`` bytes (see the module doc). Changes nothing."""
        sizes = [len(b) for b in blobs]
        start = self.offset(low, tail)
        lap = self.lap
        while True:
            offsets, end = place(self.end, lap, sizes)
            if end - start <= lap:
                return Prepared(blobs, offsets, end, lap, start)
            if lap >= self.limit:
                raise StorageFullError(
                    f"the compressed frame store of {source!r} holds {self.limit:,} bytes; the "
                    f"live records' frames take {self.end - start:,} and this push adds "
                    f"{sum(sizes):,}: give the buffer a larger compressed_bytes (its values "
                    "compress less than that assumes)")
            lap *= 2

    def write(self, first: int, prepared: Prepared) -> None:
        """Store the prepared blobs as ids ``first, first + 1, ...`` (the ring grown first,
        if they need it): the bytes, then their index entries."""
        while self.lap < prepared.lap:
            self._grow(prepared.start)
        blobs, offsets = prepared.blobs, prepared.offsets
        if not blobs:
            return
        nbytes, cap = self.lap, self.capacity
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

    def _grow(self, start: int) -> None:
        """Double the ring, keeping the bytes ``[start, end)`` (see the class doc)."""
        lap, end = self.lap, self.end
        moved = None  # (old position, bytes) of the run that moves up by lap
        for block in (start // lap, start // lap + 1):
            lo, hi = max(start, block * lap), min(end, (block + 1) * lap)
            if block % 2 and lo < hi:
                moved = (lo % lap, hi - lo)
        if self.writer is None and self.lap_store is None:  # in RAM: a new array
            data = np.empty(2 * lap, np.uint8)
            data[:lap] = self.data[:lap]
            if moved is not None:
                at, n = moved
                data[lap + at:lap + at + n] = self.data[at:at + n]
            self.data = data
        else:
            if 2 * lap > len(self.data):
                raise ValueError("the ring's region is smaller than its limit")
            if moved is not None:
                at, n = moved
                self._store(lap + at, bytes(self.data[at:at + n]))
            if self.lap_store is not None:
                self.lap_store[0] = 2 * lap  # the commit point of the growth
        self.lap = 2 * lap

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
        at = int(self.offs[slot]) % self.lap
        return memoryview(self.data[at:at + int(self.lens[slot])].data)

    def blobs(self, frame_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Frames ``frame_ids``' (live) stored bytes, one after the other (uint8, a copy),
        and their lengths (:meth:`blob` of many, in one gather: what a reader that
        decompresses elsewhere is sent)."""
        slots = frame_ids % self.capacity
        lens = self.lens[slots]
        if not len(slots):
            return np.empty(0, np.uint8), lens
        starts = self.offs[slots] % self.lap
        ends = starts + lens
        # One join of views of the runs of blobs that lie one after the other in the ring
        # (a sample's frames come in runs of consecutive ids): 4x faster than a take of one
        # index per byte, and than a view per blob (850 Atari blobs in 150-250 runs).
        cut = np.flatnonzero(starts[1:] != ends[:-1]) + 1
        data = memoryview(self.data.data)
        joined = b"".join(map(data.__getitem__, map(
            slice, starts[np.concatenate([[0], cut])].tolist(),
            ends[np.concatenate([cut - 1, [len(ends) - 1]])].tolist())))
        return np.frombuffer(joined, np.uint8), lens

    def read(self, frame_ids: np.ndarray) -> np.ndarray:
        """Frames ``frame_ids`` (live) decompressed, as the bytes of each, one after the
        other (a read-only uint8 array), on threads when they are many."""
        n = len(frame_ids)
        slots = frame_ids % self.capacity
        starts = (self.offs[slots] % self.lap).tolist()
        lengths = self.lens[slots].tolist()
        if n < PARALLEL_MIN or THREADS < 2 or self.frame_nbytes < PARALLEL_BYTES:
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
        return np.frombuffer(b"".join(parts), np.uint8)

    def _read(self, starts: list[int], lengths: list[int], lo: int, hi: int) -> list[bytes]:
        """The values of ``[lo, hi)`` of a read, as bytes (decompressed, or copied raw)."""
        return self.codec.decompress_many(memoryview(self.data.data), starts[lo:hi],
                                          lengths[lo:hi], self.frame_nbytes)

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
                 | (offs % self.lap + lens > self.lap))
        if self.sums is not None:
            data, nbytes = self.data, self.lap
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
        self.lap_store = None
        self.offs = np.empty(0, OFF_DTYPE)
        self.lens = np.empty(0, LEN_DTYPE)
        self.sums = None
        self.writer = None

    # ---- snapshots (see .snapshot) --------------------------------------------------

    def copy_out(self, frame_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                       np.ndarray, np.ndarray | None]:
        """Copies of frames ``frame_ids``' blobs as stored (not decompressed), one after
        the other (uint8), with their logical offsets, their lengths, the ids their slots
        hold (another id: the frame is gone) and their stored checksums (None: a ring in
        RAM keeps none). A slot whose offset or length cannot be (see :meth:`damaged`)
        is copied as an empty blob, its held id -1."""
        slots = frame_ids % self.capacity
        held = self.ids[slots].copy()
        offs = self.offs[slots].copy()
        lens = self.lens[slots].astype(np.int64)
        wrong = ((lens < 1) | (lens > self.frame_nbytes) | (offs < 0)
                 | (offs % self.lap + lens > self.lap))
        held[wrong] = -1
        lens[wrong] = 0
        data = memoryview(self.data.data)
        joined = b"".join([data[at:at + n] for at, n in
                           zip((offs % self.lap).tolist(), lens.tolist())])
        return (np.frombuffer(joined, np.uint8), offs, lens.astype(LEN_DTYPE), held,
                None if self.sums is None else self.sums[slots].copy())

    def adopt(self, lap: int) -> None:
        """Make an empty ring ``lap`` bytes (a power of two times its first size, at most
        its limit): a snapshot's copy keeps its blobs' logical offsets, so it takes its
        source's size (see :meth:`put`). ValueError for a size it cannot have."""
        first = first_lap(self.limit, self.frame_nbytes)
        ratio = lap // first
        if lap % first or ratio < 1 or ratio & (ratio - 1) or lap > self.limit:
            raise ValueError(f"a ring of {self.limit} bytes cannot be {lap} bytes")
        if self.writer is None and self.lap_store is None:  # in RAM: a new array
            self.data = np.empty(lap, np.uint8)
        if self.lap_store is not None:
            self.lap_store[0] = lap
        self.lap = lap

    def put(self, frame_ids: np.ndarray, offsets: np.ndarray, data: np.ndarray,
            lens: np.ndarray, sums: np.ndarray) -> None:
        """Store blobs (``data``: one after the other, ``lens`` each) of frames
        ``frame_ids`` (ascending, no two in one slot) at their logical ``offsets``, with
        their checksums: a snapshot's copy of another ring's blobs, in a ring of its
        size (:meth:`adopt`), where blobs that were live together do not overlap. Runs of
        adjacent blobs go in one write each."""
        n = len(frame_ids)
        if not n:
            return
        ends = np.cumsum(lens, dtype=np.int64)
        starts = ends - lens
        at = (offsets % self.lap).tolist()
        offs, sizes, lo, hi = offsets.tolist(), lens.tolist(), starts.tolist(), ends.tolist()
        run = 0
        for j in range(1, n + 1):
            if j == n or at[j] == 0 or offs[j] != offs[j - 1] + sizes[j - 1]:
                self._store(at[run], data[lo[run]:hi[j - 1]].tobytes())
                run = j
        slots = frame_ids % self.capacity
        self.offs[slots] = offsets
        self.lens[slots] = lens
        if self.sums is not None:
            self.sums[slots] = sums
        self.ids[slots] = frame_ids
        last = int(np.argmax(offsets))
        self.end = max(self.end, int(offsets[last]) + int(lens[last]))
