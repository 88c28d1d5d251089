"""A tier: one ring of records stored as columns, wherever the memory lives.

A tier owns one array per field (``[capacity, *shape]``) and a ``seq`` column
saying which record each slot holds. It does not know whether its memory is
anonymous RAM (hot tier) or a view into a mapped file (cold tier); the buffer
decides what lives where.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import numpy as np

from millpond.core.checksum import record_checksums
from millpond.core.coldio import TierFile
from millpond.core.ring import ring_chunks
from millpond.core.schema import Schema

# The seq column stores seq mod 2**32: half the bytes of a full counter (it
# is ~20% of a CartPole record), and a slot check "does slot hold record s?"
# can only be fooled by a record 2**32 pushes newer landing in the same slot.
SEQ_DTYPE = np.dtype("<u4")
# The names of the seq and checksum regions in a file (not identifiers, so no field's).
SEQ_REGION = "#seq"
CHECKSUM_REGION = "#checksum"
# A record checksum function: (columns [k, *shape] in schema order, seqs) -> [k] checksums.
Checksums = Callable[[Mapping[str, np.ndarray], np.ndarray], np.ndarray]
# Recovery reads records this many bytes at a time (and a push copies at most this many).
CHECK_CHUNK_BYTES = 32 << 20
CHECK_CHUNK_RECORDS = 1 << 16  # and at most this many (progress reports come per chunk)


class Tier:
    """Columns ``[capacity, *shape]`` per field plus a ``seq`` column.

    ``seq[slot]`` is the record the slot holds (mod 2**32). Slots never written read 0
    (memory and fresh files start zeroed, and touching them up front would
    make every page resident), so which slots are live always comes from
    the buffer's counters first; the seq column confirms it.

    A tier in a persistent file also has a ``checksum`` column (see
    :mod:`.checksum`), written after the record's payload and seq. A tier
    with a ``file`` (the cold tier) is written with ``pwrite`` and its large
    rows are read with ``preadv`` (see :mod:`.coldio`); the columns are the
    file's mapping, for small rows and checks.
    """

    def __init__(self, capacity: int, columns: dict[str, np.ndarray], seq: np.ndarray,
                 checksum: np.ndarray | None = None, file: TierFile | None = None,
                 checksums: Checksums = record_checksums):
        self.capacity = capacity
        self.columns = columns
        self.seq = seq
        self.checksum = checksum
        self.file = file
        self.checksums = checksums  # the record checksum of the file's format

    @classmethod
    def in_memory(cls, schema: Schema, capacity: int) -> "Tier":
        """A RAM tier; pages become resident only when first written."""
        columns = {f.name: np.empty((capacity,) + f.shape, f.dtype) for f in schema}
        return cls(capacity, columns, np.zeros(capacity, SEQ_DTYPE))

    def write(self, start: int, stop: int, batch: Mapping[str, np.ndarray], first_seq: int) -> None:
        """Store records ``start..stop-1`` taken from ``batch`` (row 0 is ``first_seq``)."""
        for lo, hi in self._pieces(start, stop):
            slot, row, k = lo % self.capacity, lo - first_seq, hi - lo
            rows = {name: batch[name][row : row + k] for name in self.columns}
            seqs = np.arange(lo, hi, dtype=np.uint64)
            if self.checksum is None:
                self._store(slot, rows, seqs.astype(SEQ_DTYPE), None)
                continue
            # The checksum of the bytes stored, computed from the stored copy, never
            # from the batch: the batch may view memory its sender can still change
            # (a fast-path client's segment), and a stored record must pass its check
            # whatever it holds. Rows written with pwrite are copied here first.
            file = self.file
            direct = {name for name in rows if file is not None and file.direct(name)}
            rows = {name: np.array(rows[name]) if name in direct else rows[name] for name in rows}
            self._store(slot, rows, seqs.astype(SEQ_DTYPE), None, direct)
            stored = {name: rows[name] if name in direct else column[slot : slot + k]
                      for name, column in self.columns.items()}
            self.checksum[slot : slot + k] = self.checksums(stored, seqs)

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """``[start, stop)`` as contiguous runs of slots of at most CHECK_CHUNK_BYTES each."""
        per_record = sum(column.strides[0] for column in self.columns.values()) or 1
        step = max(1, CHECK_CHUNK_BYTES // per_record)
        for lo, hi in ring_chunks(start, stop, self.capacity):
            for a in range(lo, hi, step):
                yield a, min(hi, a + step)

    def copy_to(self, other: "Tier", start: int, stop: int) -> None:
        """Copy records ``start..stop-1`` (all held here) into ``other``."""
        for lo, hi in ring_chunks(start, stop, self.capacity, other.capacity):
            src, dst, k = lo % self.capacity, lo % other.capacity, hi - lo
            rows = {name: column[src : src + k] for name, column in self.columns.items()}
            checksums = None
            if other.checksum is not None:
                checksums = (self.checksum[src : src + k] if self.checksum is not None
                             else other.checksums(rows, np.arange(lo, hi, dtype=np.uint64)))
            other._store(dst, rows, self.seq[src : src + k], checksums)

    def _store(self, slot: int, rows: Mapping[str, np.ndarray], seqs: np.ndarray,
               checksums: np.ndarray | None, direct: set[str] | None = None) -> None:
        """Write contiguous rows from ``slot`` on: payload, then seq, then checksum.
        ``direct``: the fields written with pwrite (default: as the file says now)."""
        k, file = len(seqs), self.file
        for name, column in self.columns.items():
            if file is not None and (name in direct if direct is not None else file.direct(name)):
                file.write_rows(name, slot, rows[name])  # no old page faulted in
            else:
                column[slot : slot + k] = rows[name]
        self.seq[slot : slot + k] = seqs
        if checksums is not None and self.checksum is not None:
            self.checksum[slot : slot + k] = checksums

    def gather(self, seqs: np.ndarray, out: Mapping[str, np.ndarray], row: int) -> None:
        """Copy records ``seqs`` (all held here) into ``out[name][row:row+len(seqs)]``,
        for each field ``out`` has."""
        if len(seqs) == 0:
            return
        slots = seqs % self.capacity
        stop = row + len(slots)
        reads = {}
        for name, column in self.columns.items():
            dest = out.get(name)
            if dest is None:
                continue
            if self.file is not None and self.file.direct(name):
                reads[name] = dest[row:stop]
            else:
                # mode="clip" skips numpy's per-index bounds check (2x faster);
                # slots are in range by construction.
                column.take(slots, axis=0, out=dest[row:stop], mode="clip")
        if reads:
            assert self.file is not None
            self.file.read_rows(slots, reads)

    def damaged(self, lo: int, hi: int, progress: Callable[[int], None] | None = None,
                chunk_bytes: int = CHECK_CHUNK_BYTES) -> np.ndarray:
        """Seqs in ``[lo, hi)`` (all meant to be held here) whose slot fails its checks.

        A slot fails if its seq column names another record, or (with a
        checksum column) if its bytes do not match their checksum. Records
        are read in order, ``chunk_bytes`` at a time, as views of the file:
        memory stays bounded whatever the records' size. A file tier's pages
        are dropped from the page cache once checked (recovery must not leave
        the cold tier resident). ``progress(records_checked)`` is called
        after every chunk.
        """
        per_record = (sum(column.strides[0] for column in self.columns.values()) + self.seq.itemsize
                      + (0 if self.checksum is None else self.checksum.itemsize))
        chunk = max(1, min(CHECK_CHUNK_RECORDS, chunk_bytes // per_record))
        bad = []
        for start in range(lo, hi, chunk):
            if progress is not None and start > lo:
                progress(start - lo)
            for a, b in ring_chunks(start, min(hi, start + chunk), self.capacity):
                first, k = a % self.capacity, b - a
                seqs = np.arange(a, b, dtype=np.int64)
                wrong = self.seq[first : first + k] != (seqs & 0xFFFFFFFF).astype(SEQ_DTYPE)
                if self.checksum is not None:
                    stored = {name: column[first : first + k]
                              for name, column in self.columns.items()}
                    wrong |= self.checksum[first : first + k] != self.checksums(stored, seqs)
                bad.append(seqs[wrong])
                if self.file is not None:
                    self.file.forget(first, first + k)
        return np.concatenate(bad) if bad else np.empty(0, np.int64)

    def release(self) -> None:
        """Drop every reference to the tier's memory (needed before unmapping)."""
        self.columns = {}
        self.seq = np.empty(0, SEQ_DTYPE)
        self.checksum = None
        self.file = None
