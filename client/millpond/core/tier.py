"""A tier: one ring of records stored as columns, wherever the memory lives.

A tier owns one array per field (``[capacity, *shape]``) and a ``seq`` column
saying which record each slot holds. It does not know whether its memory is
anonymous RAM (hot tier) or a view into a mapped file (cold tier); the buffer
decides what lives where.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

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
    """

    def __init__(self, capacity: int, columns: dict[str, np.ndarray], seq: np.ndarray):
        self.capacity = capacity
        self.columns = columns
        self.seq = seq

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
            self.seq[slot : slot + hi - lo] = np.arange(lo, hi, dtype=np.uint64).astype(SEQ_DTYPE)

    def copy_to(self, other: "Tier", start: int, stop: int) -> None:
        """Copy records ``start..stop-1`` (all held here) into ``other``."""
        for lo, hi in ring_chunks(start, stop, self.capacity, other.capacity):
            src, dst, k = lo % self.capacity, lo % other.capacity, hi - lo
            for name, column in self.columns.items():
                other.columns[name][dst : dst + k] = column[src : src + k]
            other.seq[dst : dst + k] = self.seq[src : src + k]

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

    def release(self) -> None:
        """Drop every reference to the tier's memory (needed before unmapping)."""
        self.columns = {}
        self.seq = np.empty(0, SEQ_DTYPE)
