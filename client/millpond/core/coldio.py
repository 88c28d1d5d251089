"""Positioned I/O for a tier that lives in a file: rows read and written with syscalls.

A buffer larger than the memory it may use keeps most records in its cold
tier on disk. Reading those rows through the file mapping faults one page at
a time (with read-around, while a memory cgroup thrashes): measured 0.004
GB/s. Reading them with ``preadv`` straight into the batch, from a few
threads (the GIL is released in the syscall), reads at disk speed; adjacent
rows are coalesced into one call. Writing them with ``pwritev`` (a spill to
cold appends whole rows) never faults a cold page in just to overwrite it.

Positioned I/O is for large rows (at least :data:`PREAD_MIN_ROW_BYTES`) of
a tier larger than half the memory the process may still use (checked again
every :data:`RECHECK_S`): rows in the page cache are copied 1.5-3x faster
through the mapping (from mapped pages, against a syscall and a page-cache
lookup per row), so a tier that fits keeps being read and written that way,
and so are small rows and the seq and checksum columns, whose regions are
small enough to stay resident.
Reads and writes through the mapping and through the file descriptor see the
same page cache, so both stay coherent. ``MILLPOND_COLD_IO=direct`` (or
``mapped``) forces one way for every large row instead of this choice.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Mapping

import numpy as np

from millpond.core.memory import available_memory
from millpond.errors import StorageIOError

# Rows at least this large are read with preadv (from a tier that does not fit in memory).
PREAD_MIN_ROW_BYTES = 4096
RECHECK_S = 1.0  # how often to look again at whether the tier fits
# Reads of at least this many bytes are spread over the pool's threads.
PARALLEL_MIN_BYTES = 1 << 20
READ_THREADS = 16
_IOV_MAX = 1024
PAGE = mmap.PAGESIZE

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="millpond-coldio")
        return _pool


class TierFile:
    """Where a tier's columns sit in an open file (``offsets[name]``: slot 0 of its region)."""

    def __init__(self, fd: int, mm: mmap.mmap, offsets: Mapping[str, int],
                 row_nbytes: Mapping[str, int]):
        self.fd = fd
        self.mm = mm  # the file's mapping, for what is read through it
        self.offsets = dict(offsets)
        self.row_nbytes = dict(row_nbytes)
        self.nbytes = 0  # the tier's bytes, set by random_access()
        self._direct, self._checked = False, -RECHECK_S
        self._forced = {"direct": True, "mapped": False}.get(
            os.environ.get("MILLPOND_COLD_IO", "auto"))

    def direct(self, name: str) -> bool:
        """Whether rows of column ``name`` are read and written through the fd: large
        rows of a tier larger than half the memory still available."""
        if self.row_nbytes[name] < PREAD_MIN_ROW_BYTES:
            return False
        if self._forced is not None:
            return self._forced
        now = time.monotonic()
        if now - self._checked >= RECHECK_S:
            available = available_memory()
            self._direct = available is not None and self.nbytes > available // 2
            self._checked = now
        return self._direct

    # ---- reads -------------------------------------------------------------------------

    def read_rows(self, slots: np.ndarray, outs: Mapping[str, np.ndarray]) -> None:
        """Read the rows of ``slots`` of each column in ``outs`` into ``outs[name]``
        (``[len(slots), *shape]``, row ``i`` for ``slots[i]``)."""
        if not len(slots) or not outs:
            return
        order = np.argsort(slots, kind="stable")
        ordered = slots[order]
        breaks = np.flatnonzero(np.diff(ordered) != 1) + 1  # runs of adjacent slots
        starts, ends = np.r_[0, breaks], np.r_[breaks, len(ordered)]
        jobs = []  # (fd offset, destination rows) per preadv call
        for name, out in outs.items():
            rows = out.reshape(len(slots), -1).view(np.uint8)
            base, size = self.offsets[name], self.row_nbytes[name]
            for a, b in zip(starts.tolist(), ends.tolist()):
                for c in range(a, b, _IOV_MAX):
                    d = min(b, c + _IOV_MAX)
                    jobs.append((base + int(ordered[c]) * size, [rows[i] for i in order[c:d]]))
        nbytes = sum(self.row_nbytes[name] for name in outs) * len(slots)
        if nbytes < PARALLEL_MIN_BYTES:
            self._read(jobs)
            return
        share = -(-len(jobs) // READ_THREADS)
        pending = [_threads().submit(self._read, jobs[i : i + share])
                   for i in range(0, len(jobs), share)]
        for future in pending:
            future.result()

    def _read(self, jobs: list) -> None:
        for offset, buffers in jobs:
            want = sum(b.nbytes for b in buffers)
            got = os.preadv(self.fd, buffers, offset)
            if got != want:  # the file is preallocated: short only if it was cut
                raise StorageIOError(f"read {got} of {want} bytes at offset {offset}: "
                                     "the buffer file was truncated")

    # ---- writes ------------------------------------------------------------------------

    def write_rows(self, name: str, slot: int, rows: np.ndarray) -> None:
        """Write contiguous ``rows`` (``[k, ...]``) of column ``name`` from ``slot`` on."""
        self.write_bytes(self.offsets[name] + slot * self.row_nbytes[name], rows)

    def write_bytes(self, offset: int, data: np.ndarray) -> None:
        view = np.ascontiguousarray(data).data.cast("B")
        while len(view):
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    # ---- page cache --------------------------------------------------------------------

    def _spans(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """``(offset, length)`` of slots ``[lo, hi)`` in each region, widened to whole pages."""
        for name, size in self.row_nbytes.items():
            start = (self.offsets[name] + lo * size) // PAGE * PAGE
            end = -(-(self.offsets[name] + hi * size) // PAGE) * PAGE
            yield start, min(end, len(self.mm)) - start

    def random_access(self, capacity: int) -> None:
        """Reads of the whole tier come in random order: no read-ahead (disk I/O would
        fetch what no one asked for, and a memory cgroup would hold it).

        The mapping gets ``MADV_RANDOM`` too only when the tier is larger than
        half the memory available (its large rows then go through the fd): on a
        tier written through the mapping it made every spill page-fault alone
        (sustained Atari pushes over shared memory ran at 0.65x)."""
        self.nbytes = capacity * sum(self.row_nbytes.values())
        available = available_memory()
        larger = self._forced if self._forced is not None else (
            available is not None and self.nbytes > available // 2)
        for offset, length in self._spans(0, capacity):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_RANDOM)
            if larger:
                self.mm.madvise(mmap.MADV_RANDOM, offset, length)

    def forget(self, lo: int, hi: int) -> None:
        """Drop slots ``[lo, hi)`` from this process's mapping and from the page cache
        (clean pages only: nothing unwritten is lost)."""
        for offset, length in self._spans(lo, hi):
            self.mm.madvise(mmap.MADV_DONTNEED, offset, length)
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)
