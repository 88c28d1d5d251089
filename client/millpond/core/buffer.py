"""The tiered buffer: one FIFO of at most ``total_capacity`` records.

Every record gets a sequence number ``seq`` (0, 1, 2, ... in push order). With
``pushed`` records so far the live ones are ``[max(0, pushed - total), pushed)``:

* the newest ``hot_capacity`` live records sit in RAM at ``seq % hot_capacity``;
* the older ones sit in the cold file at ``seq % cold_capacity``.

A push computes, per batch, which seq ranges move hot -> cold and which go
straight to each tier, and copies them as a few slices per field. Sampling
draws ``seq`` uniformly over the live range and gathers per tier.

Thread-safe: one lock per buffer guards every public method.
"""

from __future__ import annotations

import numbers
import os
import tempfile
import threading
import weakref
from typing import Any, Mapping

import numpy as np

from ..errors import (
    BufferClosedError,
    CorruptFileError,
    InvalidArgumentError,
    InvalidBatchSizeError,
    InvalidConfigError,
    NotEnoughDataError,
)
from .bufferfile import BufferFile
from .schema import Schema
from .tier import Tier


def check_capacities(hot_capacity: Any, total_capacity: Any) -> tuple[int, int]:
    """Return the capacities as ints, or raise InvalidConfigError."""
    for label, value in (("hot_capacity", hot_capacity), ("total_capacity", total_capacity)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
            raise InvalidConfigError(f"{label} must be a positive integer, got {value!r}")
    if total_capacity < hot_capacity:
        raise InvalidConfigError(
            f"total_capacity ({total_capacity}) must be >= hot_capacity ({hot_capacity})"
        )
    return int(hot_capacity), int(total_capacity)


class TieredBuffer:
    """Hot ring + cold mapped-file ring behind one FIFO.

    ``total_capacity == hot_capacity`` means no cold tier: the record leaving
    the hot ring is evicted. With ``cold_path=None`` and a cold tier, the file
    goes to the system temp directory.

    By default the hot ring lives in RAM and ``close()`` (or dropping the
    buffer) deletes the file, like the reference. A *persistent* buffer keeps
    its hot ring in the file too, so every acknowledged push survives a crash
    of the process; ``release()`` unmaps it and keeps the file, and
    :meth:`open` brings it back. ``sync_every_push`` makes each push wait for
    its pages to reach the disk (msync) before it returns.
    """

    def __init__(
        self,
        schema: Schema,
        hot_capacity: int,
        total_capacity: int,
        cold_path: str | os.PathLike | None = None,
        *,
        persistent: bool = False,
        sync_every_push: bool = False,
        file_meta: Mapping[str, Any] | None = None,
    ):
        hot, total = check_capacities(hot_capacity, total_capacity)
        file = None
        if persistent or total > hot:
            if cold_path is None and persistent:
                raise InvalidConfigError("a persistent buffer needs a file path")
            path = os.fspath(cold_path) if cold_path is not None else _temp_cold_path()
            file = BufferFile.create(path, schema, hot, total, persistent=persistent,
                                     extra_meta=file_meta)
        self._setup(schema, hot, total, file, sync_every_push)

    @classmethod
    def open(cls, path: str | os.PathLike, *, sync_every_push: bool = False,
             skip_corrupt: bool = False, progress=None) -> "TieredBuffer":
        """Reopen a persistent buffer's file with its records, counters and configuration.

        Every live record is checked (seq and checksum). Raises
        CorruptFileError for a file that is not a sound persistent millpond
        buffer file, or that holds damaged records, unless ``skip_corrupt``:
        then the damaged records are left out (never served) and counted in
        ``damaged``. ``progress(checked, live)`` reports the check as it goes
        (a large buffer takes a while: an operator must tell that from a hang).
        """
        file = BufferFile.open(os.fspath(path))
        if not file.meta["persistent"]:
            file.close(delete=False)
            raise CorruptFileError(
                f"{path} belonged to a non-persistent buffer: its hot records were never in it"
            )
        buffer = cls.__new__(cls)
        buffer._setup(file.schema, file.meta["hot_capacity"], file.meta["total_capacity"],
                      file, sync_every_push)
        buffer._pushed, buffer._first, buffer._hot_lo = file.pushed, file.first, file.hot_lo
        buffer._check_records(skip_corrupt, progress)
        return buffer

    def _check_records(self, skip_corrupt: bool, progress=None) -> None:
        """Find live records whose slot fails its seq or checksum check."""
        live = self._pushed - self._first
        cold_live = self._hot_lo - self._first
        report = (lambda done: progress(done, live)) if progress else None
        bad = []
        if self._cold is not None:
            bad.append(self._cold.damaged(self._first, self._hot_lo, report))
        bad.append(self._hot.damaged(
            self._hot_lo, self._pushed,
            (lambda done: progress(cold_live + done, live)) if progress else None))
        bad = np.sort(np.concatenate(bad))
        if len(bad) and not skip_corrupt:
            self._file.close(delete=False)
            raise CorruptFileError(
                f"{self._file.path}: {len(bad):,} of {live:,} live records fail their checks "
                f"(seqs {bad[:5].tolist()}{'...' if len(bad) > 5 else ''}); "
                "--recover=skip-corrupt serves the intact ones"
            )
        self._holes = bad

    def _setup(self, schema: Schema, hot: int, total: int, file: BufferFile | None,
               sync_every_push: bool) -> None:
        self.schema = schema
        self.hot_capacity = hot
        self.total_capacity = total
        self._lock = threading.Lock()
        # Live records are seqs [_first, _pushed); those from _hot_lo on are hot.
        self._pushed = self._first = self._hot_lo = 0
        # Damaged records found at reopen (skip_corrupt): live seqs never served.
        self._holes = np.empty(0, np.int64)
        self._closed = False
        self._rng = np.random.default_rng()
        self._file = file
        self._sync_every_push = sync_every_push
        persistent = file is not None and file.hot_tier is not None
        self.persistent = persistent
        self._hot = file.hot_tier if persistent else Tier.in_memory(schema, hot)
        self._cold = file.tier if file is not None else None
        if file is not None:
            # Like the reference's Drop: a buffer dropped (or alive at exit)
            # without close() still unmaps its file, and deletes it unless
            # the buffer is persistent.
            weakref.finalize(self, file.close, not persistent)

    # ---- sizes --------------------------------------------------------------

    @property
    def cold_path(self) -> str | None:
        """The buffer's file (cold tier, and hot tier when persistent), if any."""
        return self._file.path if self._file else None

    @property
    def pushed(self) -> int:
        """Records ever pushed, including evicted ones."""
        return self._pushed

    def __len__(self) -> int:
        self._check_open()
        return self._size()

    def _size(self) -> int:
        return self._pushed - self._first - len(self._holes)

    @property
    def damaged(self) -> int:
        """Live records left out because they failed their checks at reopen."""
        return len(self._holes)

    @property
    def hot_len(self) -> int:
        return self._pushed - self._hot_lo

    @property
    def cold_len(self) -> int:
        return self._hot_lo - self._first

    @property
    def closed(self) -> bool:
        return self._closed

    def info(self) -> dict[str, Any]:
        """Sizes, capacities and counters (a snapshot)."""
        with self._lock:
            self._check_open()
            return {
                "size": self._size(),
                "pushed": self._pushed,
                "hot_size": self.hot_len,
                "cold_size": self.cold_len,
                "hot_capacity": self.hot_capacity,
                "total_capacity": self.total_capacity,
                "record_nbytes": self.schema.record_nbytes,
                "cold_path": self.cold_path,
            }

    # ---- writes ---------------------------------------------------------------

    def push(self, record: Mapping[str, Any]) -> None:
        """Append one record (``{field: value}``); validated before anything changes."""
        self._check_open()
        self._store(1, self.schema.coerce_record(record))

    def push_batch(self, columns: Mapping[str, Any]) -> int:
        """Append a batch (``{field: array[n, ...]}``); return n.

        Validated in full before anything changes: a rejected batch leaves the
        buffer exactly as it was. An empty batch is accepted and stores nothing.
        """
        self._check_open()
        n, batch = self.schema.coerce_batch(columns)
        self._store(n, batch)
        return n

    def _store(self, n: int, batch: Mapping[str, np.ndarray], extra: Any = None) -> None:
        """Append a validated batch; ``extra`` goes to :meth:`_appended` (e.g. priorities)."""
        with self._lock:
            self._check_open()
            self._append(n, batch, extra)

    def _append(self, n: int, batch: Mapping[str, np.ndarray], extra: Any = None) -> None:
        """Store a validated batch (lock held).

        Persistent buffers commit in three steps so that a crash at any point
        leaves a consistent committed state: (1) the records this push evicts
        are declared gone before their slots are reused; (2) hot records moved
        to cold are declared cold before their hot slots are reused; (3) the
        new records become live. A crash before (3) leaves the push absent.
        """
        old, new = self._pushed, self._pushed + n
        first = max(self._first, new - self.total_capacity)
        hot_lo = max(self._hot_lo, new - self.hot_capacity)
        self._commit(old, first, self._hot_lo)  # (1) evictions
        if self._cold is not None:
            # Hot records pushed out by this batch move to cold; a batch larger
            # than the hot ring sends its own head straight to cold.
            if max(first, self._hot_lo) < min(hot_lo, old):
                self._hot.copy_to(self._cold, max(first, self._hot_lo), min(hot_lo, old))
            if max(first, old) < hot_lo:
                self._cold.write(max(first, old), hot_lo, batch, old)
        self._commit(old, first, hot_lo)  # (2) spilled records now read from cold
        self._hot.write(max(old, hot_lo), new, batch, old)
        self._commit(new, first, hot_lo, final=True)  # (3) the push is in
        self._appended(old, new, extra)

    def _appended(self, old: int, new: int, extra: Any) -> None:
        """Hook after records ``old..new-1`` became live (lock held); nothing here."""

    def _commit(self, pushed: int, first: int, hot_lo: int, final: bool = False) -> None:
        """Adopt the live ranges; record them in the file if persistent (or ``final``)."""
        first = min(first, pushed)
        hot_lo = min(max(hot_lo, first), pushed)
        self._pushed, self._first, self._hot_lo = pushed, first, hot_lo
        if len(self._holes):  # damaged records leave with the evicted ones
            self._holes = self._holes[self._holes >= first]
        if self._file is not None and (self.persistent or final):
            self._file.commit(pushed, first, hot_lo)
            if self._sync_every_push:
                self._file.sync()

    # ---- reads ----------------------------------------------------------------

    def sample(
        self,
        batch_size: int,
        seed: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Draw ``batch_size`` records uniformly (with replacement) from hot + cold.

        The same contents and ``seed`` give the same batch; ``seed=None`` draws
        fresh entropy. Rows holding cold records come first, then hot ones
        (each group in draw order): the batch as a multiset is i.i.d. uniform,
        positions are not exchangeable. ``out`` may supply the destination
        arrays (``{field: array[batch_size, *shape]}``), e.g. shared memory.
        """
        batch_size = check_batch_size(batch_size)
        seed = check_seed(seed)
        with self._lock:
            self._check_open()
            size = self._size()
            if batch_size > size:
                raise NotEnoughDataError(f"batch_size {batch_size} > buffer len {size}")
            # Unseeded draws share one generator (guarded by the lock): making
            # a fresh one costs more than sampling 256 small records.
            rng = self._rng if seed is None else np.random.default_rng(seed)
            seqs, extras = self._draw(rng, batch_size)
            if extras:  # rows come back cold first, then hot: keep extras in step
                order = np.argsort(seqs >= self._hot_lo, kind="stable")
                seqs, extras = seqs[order], {k: v[order] for k, v in extras.items()}
            return {**self._gather(seqs, out), **extras}

    def _draw(self, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, dict]:
        """Which live records to sample (lock held); uniform here. Returns (seqs, extra keys)."""
        seqs = rng.integers(self._first, self._pushed, size=batch_size)
        if len(self._holes):  # redraw any damaged record: uniform over the intact
            hit = np.isin(seqs, self._holes)
            while hit.any():
                seqs[hit] = rng.integers(self._first, self._pushed, size=int(hit.sum()))
                hit = np.isin(seqs, self._holes)
        return seqs, {}

    def contents(self) -> dict[str, np.ndarray]:
        """Every live record, oldest first (a copy): for export, checks and tests."""
        with self._lock:
            self._check_open()
            seqs = np.arange(self._first, self._pushed)
            return self._gather(np.setdiff1d(seqs, self._holes, assume_unique=True), None)

    def _gather(self, seqs: np.ndarray, out: Mapping[str, np.ndarray] | None) -> dict:
        """Copy live records ``seqs`` into ``out``: cold ones first, then hot (lock held)."""
        if out is None:
            out = {f.name: np.empty((len(seqs),) + f.shape, f.dtype) for f in self.schema}
        is_hot = seqs >= self._hot_lo
        cold_seqs, hot_seqs = seqs[~is_hot], seqs[is_hot]
        if len(cold_seqs):
            self._cold.gather(cold_seqs, out, 0)
        self._hot.gather(hot_seqs, out, len(cold_seqs))
        return dict(out)

    # ---- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Release memory, unmap and delete the buffer's file. Idempotent."""
        self._shut(delete=True)

    def release(self) -> None:
        """Unmap; a persistent buffer keeps its file (reopen it with :meth:`open`).

        A non-persistent buffer's file is useless without its RAM hot tier,
        so it is deleted, as by :meth:`close`. Idempotent.
        """
        self._shut(delete=not self.persistent)

    def sync(self) -> None:
        """Write the file's dirty pages to disk and wait (msync)."""
        with self._lock:
            if self._file is not None and not self._closed:
                self._file.sync()

    def _shut(self, delete: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._hot.release()
            if self._file is not None:
                self._file.close(delete=delete)

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("operation on a closed buffer")

    def __reduce__(self):
        raise TypeError(
            "an in-process buffer cannot be pickled; to share one buffer between "
            "processes, serve it (millpond serve) and pass address= and name="
        )


def check_seed(seed: Any) -> int | None:
    """Return ``seed`` (None, or an int in [0, 2**64)), or raise InvalidArgumentError."""
    if seed is None:
        return None
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise InvalidArgumentError(f"seed must be None or an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def check_batch_size(batch_size: Any) -> int:
    """Return ``batch_size`` as an int, or raise InvalidBatchSizeError."""
    if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool):
        raise InvalidBatchSizeError(f"batch_size must be an integer, got {batch_size!r}")
    if batch_size <= 0:
        raise InvalidBatchSizeError(f"batch_size must be > 0, got {batch_size}")
    return int(batch_size)


def _temp_cold_path() -> str:
    fd, path = tempfile.mkstemp(prefix="millpond-", suffix=".cold")
    os.close(fd)
    return path
