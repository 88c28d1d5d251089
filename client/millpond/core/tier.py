"""A tier: one ring of records stored as columns, wherever the memory lives.

A tier owns one array per field (``[capacity, *shape]``) and a ``seq`` column
saying which record each slot holds. It does not know whether its memory is
anonymous RAM (hot tier) or a view into a mapped file (cold tier); the buffer
decides what lives where.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .checksum import record_checksums
from .ring import ring_chunks
from .schema import Schema

# The seq column stores seq mod 2**32: half the bytes of a full counter (it
# is ~20% of a CartPole record), and a slot check "does slot hold record s?"
# can only be fooled by a record 2**32 pushes newer landing in the same slot.
SEQ_DTYPE = np.dtype("<u4")


class Tier:
    """Columns ``[capacity, *shape]`` per field plus a ``seq`` column.

    ``seq[slot]`` is the record the slot holds (mod 2**32). Slots never written read 0
    (memory and fresh files start zeroed, and touching them up front would
    make every page resident), so which slots are live always comes from
    the buffer's counters first; the seq column confirms it.

    A tier in a persistent file also has a ``checksum`` column (see
    :mod:`.checksum`), written after the record's payload and seq.
    """

    def __init__(self, capacity: int, columns: dict[str, np.ndarray], seq: np.ndarray,
                 checksum: np.ndarray | None = None):
        self.capacity = capacity
        self.columns = columns
        self.seq = seq
        self.checksum = checksum

    @classmethod
    def in_memory(cls, schema: Schema, capacity: int) -> "Tier":
        """A RAM tier; pages become resident only when first written."""
        columns = {f.name: np.empty((capacity,) + f.shape, f.dtype) for f in schema}
        return cls(capacity, columns, np.zeros(capacity, SEQ_DTYPE))

    def write(self, start: int, stop: int, batch: Mapping[str, np.ndarray], first_seq: int) -> None:
        """Store records ``start..stop-1`` taken from ``batch`` (row 0 is ``first_seq``)."""
        for lo, hi in ring_chunks(start, stop, self.capacity):
            slot, row = lo % self.capacity, lo - first_seq
            for name, column in self.columns.items():
                column[slot : slot + hi - lo] = batch[name][row : row + hi - lo]
            seqs = np.arange(lo, hi, dtype=np.uint64)
            self.seq[slot : slot + hi - lo] = seqs.astype(SEQ_DTYPE)
            if self.checksum is not None:  # over the stored bytes, after them
                stored = {name: column[slot : slot + hi - lo] for name, column in self.columns.items()}
                self.checksum[slot : slot + hi - lo] = record_checksums(stored, seqs)

    def copy_to(self, other: "Tier", start: int, stop: int) -> None:
        """Copy records ``start..stop-1`` (all held here) into ``other``."""
        for lo, hi in ring_chunks(start, stop, self.capacity, other.capacity):
            src, dst, k = lo % self.capacity, lo % other.capacity, hi - lo
            for name, column in self.columns.items():
                other.columns[name][dst : dst + k] = column[src : src + k]
            other.seq[dst : dst + k] = self.seq[src : src + k]
            if other.checksum is not None:
                other.checksum[dst : dst + k] = (
                    self.checksum[src : src + k] if self.checksum is not None
                    else record_checksums({n: c[dst : dst + k] for n, c in other.columns.items()},
                                          np.arange(lo, hi, dtype=np.uint64))
                )

    def gather(self, seqs: np.ndarray, out: Mapping[str, np.ndarray], row: int) -> None:
        """Copy records ``seqs`` (all held here) into ``out[name][row:row+len(seqs)]``."""
        if len(seqs) == 0:
            return
        slots = seqs % self.capacity
        stop = row + len(slots)
        for name, column in self.columns.items():
            # mode="clip" skips numpy's per-index bounds check (2x faster);
            # slots are in range by construction.
            column.take(slots, axis=0, out=out[name][row:stop], mode="clip")

    def damaged(self, lo: int, hi: int, progress=None, chunk: int = 1 << 16) -> np.ndarray:
        """Seqs in ``[lo, hi)`` (all meant to be held here) whose slot fails its checks.

        A slot fails if its seq column names another record, or (with a
        checksum column) if its bytes do not match their checksum.
        ``progress(records_checked)`` is called after every chunk.
        """
        bad = []
        for start in range(lo, hi, chunk):
            if progress is not None and start > lo:
                progress(start - lo)
            seqs = np.arange(start, min(hi, start + chunk), dtype=np.int64)
            slots = seqs % self.capacity
            wrong = self.seq[slots] != (seqs & 0xFFFFFFFF).astype(SEQ_DTYPE)
            if self.checksum is not None:
                stored = {name: column[slots] for name, column in self.columns.items()}
                wrong |= self.checksum[slots] != record_checksums(stored, seqs)
            bad.append(seqs[wrong])
        return np.concatenate(bad) if bad else np.empty(0, np.int64)

    def release(self) -> None:
        """Drop every reference to the tier's memory (needed before unmapping)."""
        self.columns = {}
        self.seq = np.empty(0, SEQ_DTYPE)
        self.checksum = None
