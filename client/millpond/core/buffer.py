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

import contextlib
import numbers
import os
import tempfile
import threading
import time
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
    RateLimitTimeoutError,
)
from .bufferfile import BufferFile
from .ratelimit import Queue, RateLimiter, RateState
from .schema import Schema
from .sumtree import SumTree
from .tier import Tier

MODES = ("replay", "queue", "stack")
# How a buffer samples: (mode, max_times_sampled or None, rate limiter or None).
Sampling = tuple[str, "int | None", "RateLimiter | None"]
DEFAULT_SAMPLING: Sampling = ("replay", None, None)
# The slot array of a persistent buffer with max_times_sampled: draws so far.
COUNT_ARRAYS = {"times_sampled": "<u4"}

# Per thread: a predicate telling a waiting call that its caller is gone.
_waits = threading.local()


@contextlib.contextmanager
def abandon_waits_when(abandoned, every: float = 0.2):
    """Within this block, on this thread, rate-limiter waits check ``abandoned()``
    at least every ``every`` seconds and end (RateLimitTimeoutError) once it is
    true. For servers, whose caller may vanish while its call waits."""
    previous = getattr(_waits, "check", None)
    _waits.check = (abandoned, every)
    try:
        yield
    finally:
        _waits.check = previous


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


def check_sampling(mode: Any, max_times_sampled: Any, rate_limiter: Any,
                   total_capacity: int) -> Sampling:
    """Validate how a buffer is sampled; return ``(mode, max_times_sampled, rate_limiter)``.

    ``queue`` and ``stack`` remove what they return and default to a
    :func:`~millpond.core.ratelimit.Queue` limiter of ``total_capacity``
    (pushes wait when full, samples when too few records are held).
    """
    if mode not in MODES:
        raise InvalidConfigError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if max_times_sampled is not None:
        if (not isinstance(max_times_sampled, numbers.Integral)
                or isinstance(max_times_sampled, bool) or max_times_sampled < 0):
            raise InvalidConfigError(
                f"max_times_sampled must be an integer >= 0 (0: unlimited), got {max_times_sampled!r}")
        max_times_sampled = int(max_times_sampled) or None
    if max_times_sampled is not None and mode != "replay":
        raise InvalidConfigError(f"a {mode} removes every record it returns: "
                                 "max_times_sampled is for mode='replay'")
    if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
        if not isinstance(rate_limiter, Mapping):
            raise InvalidConfigError(
                "rate_limiter must come from millpond.MinSize, SampleToInsertRatio or Queue")
        rate_limiter = RateLimiter.from_dict(rate_limiter)
    if rate_limiter is None and mode != "replay":
        rate_limiter = Queue(total_capacity)
    return mode, max_times_sampled, rate_limiter


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

    Sampling: ``mode="replay"`` (the default) draws with replacement and
    keeps records until they are evicted, or until they have been sampled
    ``max_times_sampled`` times. ``mode="queue"`` returns the oldest records
    and removes them (FIFO), ``mode="stack"`` the newest, newest first
    (LIFO). A ``rate_limiter`` (:mod:`millpond.core.ratelimit`) makes pushes
    and samples wait, up to their ``timeout``, while they would break it;
    waits end early when the buffer is closed.
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
        mode: str = "replay",
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
        slot_arrays: Mapping[str, str] | None = None,
    ):
        hot, total = check_capacities(hot_capacity, total_capacity)
        sampling = check_sampling(mode, max_times_sampled, rate_limiter, total)
        if persistent and sampling[1]:  # draw counts survive a restart with the records
            slot_arrays = {**(slot_arrays or {}), **COUNT_ARRAYS}
        file = None
        if persistent or total > hot:
            if cold_path is None and persistent:
                raise InvalidConfigError("a persistent buffer needs a file path")
            path = os.fspath(cold_path) if cold_path is not None else _temp_cold_path()
            meta = {**(file_meta or {}), **_sampling_meta(*sampling)}
            file = BufferFile.create(path, schema, hot, total, persistent=persistent,
                                     extra_meta=meta, slot_arrays=slot_arrays)
        self._setup(schema, hot, total, file, sync_every_push)
        self._setup_sampling(*sampling)

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
        meta = file.meta
        buffer._setup_sampling(meta.get("mode", "replay"), meta.get("max_times_sampled"),
                               meta.get("rate_limiter") and RateLimiter.from_dict(meta["rate_limiter"]))
        buffer._rate.restart(len(buffer), removes=buffer.mode != "replay")
        if buffer._tree is not None:  # uniform with max_times_sampled: all but the used up
            live = np.arange(buffer._first, buffer._pushed)
            buffer._tree.update(live % buffer.total_capacity, np.ones(len(live)),
                                unset=np.isin(live, buffer._holes))
            buffer._restore_counts()
        return buffer

    def _restore_counts(self) -> None:
        """After a reopen: live records used up before stay used up (out of the tree)."""
        if self._times is None:
            return
        self._times[self._holes % self.total_capacity] = 0  # damaged ones count as holes
        slots = np.arange(self._first, self._pushed) % self.total_capacity
        used = slots[self._times[slots] >= self.max_times_sampled]
        self._removed = len(used)
        self._tree.update(used, np.zeros(len(used)), unset=np.ones(len(used), bool))

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
        # Waiting pushes and samples sleep here; every change that may let
        # them proceed notifies it (and the listeners, e.g. a server's loop).
        self._changed_cond = threading.Condition(self._lock)
        self._listeners: list = []
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

    def _setup_sampling(self, mode: str, max_times_sampled: int | None,
                        rate_limiter: RateLimiter | None) -> None:
        self.mode = mode
        self.max_times_sampled = max_times_sampled
        self.rate_limiter = rate_limiter
        self._rate = RateState(rate_limiter)
        # max_times_sampled: draws per record slot (in the file if persistent),
        # and a 0/1 tree to draw uniformly among those not used up (_removed).
        self._times = None
        if max_times_sampled:
            stored = self._file.slot_array("times_sampled") if self.persistent else None
            self._times = stored if stored is not None else np.zeros(self.total_capacity,
                                                                     np.uint32)
        self._removed = 0
        self._tree = SumTree(self.total_capacity) if max_times_sampled else None

    # ---- sizes --------------------------------------------------------------

    @property
    def cold_path(self) -> str | None:
        """The buffer's file (cold tier, and hot tier when persistent), if any."""
        return self._file.path if self._file else None

    @property
    def sampling(self) -> Sampling:
        """``(mode, max_times_sampled, rate_limiter)``, as :func:`check_sampling` returns."""
        return self.mode, self.max_times_sampled, self.rate_limiter

    @property
    def pushed(self) -> int:
        """Records ever pushed, including evicted ones."""
        return self._pushed

    def __len__(self) -> int:
        self._check_open()
        return self._size()

    def _size(self) -> int:
        return self._pushed - self._first - len(self._holes) - self._removed

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
                "mode": self.mode,
                "max_times_sampled": self.max_times_sampled or 0,
                "rate_limiter": self.rate_limiter and self.rate_limiter.to_dict(),
                **self._rate.stats(),
            }

    # ---- writes ---------------------------------------------------------------

    def push(self, record: Mapping[str, Any], *, timeout: float | None = None) -> None:
        """Append one record (``{field: value}``); validated before anything changes.

        With a rate limiter, waits up to ``timeout`` seconds (None: no limit)
        while the push would break it, then raises RateLimitTimeoutError.
        """
        self._check_open()
        self._store(1, self.schema.coerce_record(record), timeout=timeout)

    def push_batch(self, columns: Mapping[str, Any], *, timeout: float | None = None) -> int:
        """Append a batch (``{field: array[n, ...]}``); return n.

        Validated in full before anything changes: a rejected batch leaves the
        buffer exactly as it was. An empty batch is accepted and stores nothing.
        ``timeout``: as for :meth:`push`; the batch is admitted whole or not at all.
        """
        self._check_open()
        n, batch = self.schema.coerce_batch(columns)
        self._store(n, batch, timeout=timeout)
        return n

    def _store(self, n: int, batch: Mapping[str, np.ndarray], extra: Any = None,
               timeout: float | None = None) -> None:
        """Append a validated batch; ``extra`` goes to :meth:`_appended` (e.g. priorities)."""
        timeout = check_timeout(timeout)
        if self.rate_limiter is not None and n:
            self.rate_limiter.check_insert(n)
        with self._lock:
            self._check_open()
            if n and self.rate_limiter is not None:
                self._await("insert", lambda: self._rate.can_insert(n, self._size()), timeout)
            self._append(n, batch, extra)
            self._rate.inserts += n
            self._changed()

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
        if self._times is not None:  # the freed slots' draw counts start again
            self._times[np.arange(max(old, new - self.total_capacity), new)
                        % self.total_capacity] = 0
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
        """Hook after records ``old..new-1`` became live (lock held): they can be drawn."""
        if self._times is not None:
            slots = np.arange(max(old, self._first), new) % self.total_capacity
            self._tree.update(slots, np.ones(len(slots)))

    def _commit(self, pushed: int, first: int, hot_lo: int, final: bool = False) -> None:
        """Adopt the live ranges; record them in the file if persistent (or ``final``)."""
        first = min(first, pushed)
        hot_lo = min(max(hot_lo, first), pushed)
        if self._removed and first > self._first:  # used-up records leave with the evicted
            gone = np.arange(self._first, first) % self.total_capacity
            self._removed -= int((self._times[gone] >= self.max_times_sampled).sum())
        self._pushed, self._first, self._hot_lo = pushed, first, hot_lo
        if len(self._holes):  # damaged records leave with the evicted ones (or popped)
            self._holes = self._holes[(self._holes >= first) & (self._holes < pushed)]
        if self._file is not None and (self.persistent or final):
            self._file.commit(pushed, first, hot_lo)
            if self._sync_every_push:
                self._file.sync()

    # ---- waiting for the rate limiter -----------------------------------------

    def _await(self, kind: str, ready, timeout: float | None) -> None:
        """Wait (lock held) until ``ready()``, at most ``timeout`` seconds; count the wait."""
        if ready():
            return
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        if timeout != 0:  # a try-only call (timeout 0) is not a wait
            self._rate.wait_started(kind)
        abandoned, every = getattr(_waits, "check", None) or (None, None)
        try:
            while not ready():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RateLimitTimeoutError(
                        f"{kind} timed out after {timeout:g} s waiting for the rate limiter "
                        f"({self.describe_rate()})")
                if abandoned is not None:
                    remaining = every if remaining is None else min(remaining, every)
                self._changed_cond.wait(remaining)
                self._check_open()
                if abandoned is not None and abandoned():
                    raise RateLimitTimeoutError(f"{kind} abandoned: its caller went away")
        finally:
            if timeout != 0:
                self._rate.wait_ended(kind, time.monotonic() - start)

    def describe_rate(self) -> str:
        """The rate limiter's state in words (for timeout messages)."""
        return self._rate.describe(self._size())

    def _changed(self) -> None:
        """Wake waiting pushes and samples (lock held): the state has changed."""
        if self._rate.limiter is not None:
            self._changed_cond.notify_all()
            for listener in self._listeners:
                listener()

    def add_listener(self, listener) -> None:
        """Call ``listener()`` (cheap, non-blocking, lock held) after every change that
        may let a rate-limited push or sample proceed, and at close: for waiters
        that cannot sleep on this buffer's condition, like an event loop."""
        with self._lock:
            self._listeners.append(listener)

    def would_wait(self, kind: str, n: int) -> bool:
        """Whether a push (``kind="insert"``) or sample of ``n`` records would wait now.

        A hint read without the lock: the call itself decides (a closed buffer
        never waits: the call raises).
        """
        if self._closed:
            return False
        if kind == "insert":
            return not self._rate.can_insert(n, self._size())
        return not self._sample_ready(n)

    # ---- reads ----------------------------------------------------------------

    def sample(
        self,
        batch_size: int,
        seed: int | None = None,
        out: Mapping[str, np.ndarray] | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Draw ``batch_size`` records from hot + cold.

        Replay mode draws uniformly with replacement. The same contents and
        ``seed`` give the same batch; ``seed=None`` draws fresh entropy. Rows
        holding cold records come first, then hot ones (each group in draw
        order): the batch as a multiset is i.i.d. uniform, positions are not
        exchangeable. Queue mode returns (and removes) the oldest records,
        oldest first; stack mode the newest, newest first. ``out`` may supply
        the destination arrays (``{field: array[batch_size, *shape]}``), e.g.
        shared memory. With a rate limiter (always, in queue and stack
        modes) waits up to ``timeout`` seconds (None: no limit) while the
        sample would break it; without one, asking for more records than are
        held raises NotEnoughDataError at once.
        """
        batch_size = check_batch_size(batch_size)
        seed = check_seed(seed)
        timeout = check_timeout(timeout)
        if self.rate_limiter is not None:
            self.rate_limiter.check_sample(batch_size)
        with self._lock:
            self._check_open()
            if self.rate_limiter is None:
                if batch_size > self._size():
                    raise NotEnoughDataError(f"batch_size {batch_size} > buffer len {self._size()}")
            else:
                self._await("sample", lambda: self._sample_ready(batch_size), timeout)
            if self.mode != "replay":
                result = self._pop(batch_size, out)
            else:
                # Unseeded draws share one generator (guarded by the lock): making
                # a fresh one costs more than sampling 256 small records.
                rng = self._rng if seed is None else np.random.default_rng(seed)
                seqs, extras = self._draw(rng, batch_size)
                if self._times is not None:
                    seqs, extras = self._use_up(rng, seqs, extras)
                if extras:  # rows come back cold first, then hot: keep extras in step
                    order = np.argsort(seqs >= self._hot_lo, kind="stable")
                    seqs, extras = seqs[order], {k: v[order] for k, v in extras.items()}
                result = {**self._gather(seqs, out), **extras}
            self._rate.samples += batch_size
            self._changed()
            return result

    def _sample_ready(self, batch_size: int) -> bool:
        """Whether a sample of ``batch_size`` may proceed now (lock held)."""
        size = self._size()
        if self.mode != "replay" or self._times is not None:
            if size < batch_size:  # it takes batch_size distinct records (or draws left)
                return False
        return self._rate.can_sample(batch_size, size)

    def _draw(self, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, dict]:
        """Which live records to sample (lock held); uniform here. Returns (seqs, extra keys)."""
        if self._times is not None:  # some records are used up: draw among the others
            leaves = self._tree.find(rng.random(batch_size) * self._tree.total)
            return self._first + (leaves - self._first) % self.total_capacity, {}
        seqs = rng.integers(self._first, self._pushed, size=batch_size)
        if len(self._holes):  # redraw any damaged record: uniform over the intact
            hit = np.isin(seqs, self._holes)
            while hit.any():
                seqs[hit] = rng.integers(self._first, self._pushed, size=int(hit.sum()))
                hit = np.isin(seqs, self._holes)
        return seqs, {}

    def _use_up(self, rng: np.random.Generator, seqs: np.ndarray,
                extras: dict) -> tuple[np.ndarray, dict]:
        """Count the draws of ``seqs`` against ``max_times_sampled`` (lock held).

        Draws are with replacement, so one batch may draw a record more often
        than it has draws left: those surplus rows are redrawn among the
        records not used up. A record reaching the limit leaves the tree (it
        is never drawn again) and stops counting towards ``len``.
        """
        limit, times = self.max_times_sampled, self._times
        pending = np.arange(len(seqs))
        while len(pending):
            slots = seqs[pending] % self.total_capacity
            order = np.argsort(slots, kind="stable")
            ordered = slots[order]
            starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
            counts = np.diff(np.r_[starts, len(ordered)])
            unique = ordered[starts]
            left = (limit - times[unique]).astype(np.int64)
            rank = np.arange(len(ordered)) - np.repeat(starts, counts)  # nth draw of its slot
            surplus = np.empty(len(ordered), bool)
            surplus[order] = rank >= np.repeat(left, counts)
            times[unique] += np.minimum(counts, left).astype(np.uint32)
            done = unique[times[unique] >= limit]
            self._removed += len(done)
            self._tree.update(done, np.zeros(len(done)), unset=np.ones(len(done), bool))
            pending = pending[surplus]
            if len(pending):  # the size check before sampling leaves enough draws
                redrawn, more = self._draw(rng, len(pending))
                seqs[pending] = redrawn
                for key, column in more.items():
                    extras[key][pending] = column
        return seqs, extras

    def _pop(self, batch_size: int, out: Mapping[str, np.ndarray] | None) -> dict:
        """Queue: remove and return the oldest records, oldest first. Stack: the
        newest, newest first (lock held; the size was checked)."""
        if self.mode == "queue":
            span = np.arange(self._first, min(self._pushed, self._first + batch_size + len(self._holes)))
            seqs = np.setdiff1d(span, self._holes, assume_unique=True)[:batch_size]
            result = self._gather(seqs, out)
            self._commit(self._pushed, int(seqs[-1]) + 1, self._hot_lo, final=True)
        else:
            span = np.arange(max(self._first, self._pushed - batch_size - len(self._holes)), self._pushed)
            seqs = np.setdiff1d(span, self._holes, assume_unique=True)[-batch_size:][::-1]
            result = self._gather(seqs, out, hot_first=True)
            self._commit(int(seqs[-1]), self._first, self._hot_lo, final=True)
        return result

    def contents(self) -> dict[str, np.ndarray]:
        """Every live record, oldest first (a copy): for export, checks and tests."""
        with self._lock:
            self._check_open()
            seqs = np.setdiff1d(np.arange(self._first, self._pushed), self._holes,
                                assume_unique=True)
            if self._removed:
                seqs = seqs[self._times[seqs % self.total_capacity] < self.max_times_sampled]
            return self._gather(seqs, None)

    def _gather(self, seqs: np.ndarray, out: Mapping[str, np.ndarray] | None,
                hot_first: bool = False) -> dict:
        """Copy live records ``seqs`` into ``out``: cold ones first, then hot, each
        in the order given (hot first if ``hot_first``). Lock held."""
        if out is None:
            out = {f.name: np.empty((len(seqs),) + f.shape, f.dtype) for f in self.schema}
        is_hot = seqs >= self._hot_lo
        cold_seqs, hot_seqs = seqs[~is_hot], seqs[is_hot]
        if hot_first:
            self._hot.gather(hot_seqs, out, 0)
        if len(cold_seqs):
            self._cold.gather(cold_seqs, out, len(hot_seqs) if hot_first else 0)
        if not hot_first:
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
            self._changed()  # waiters wake up and raise BufferClosedError
            self._hot.release()
            self._times = None  # it may view the file's map, which must close
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


def check_timeout(timeout: Any) -> float | None:
    """Return ``timeout`` (None, or seconds >= 0) as a float, or raise InvalidArgumentError."""
    if timeout is None:
        return None
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not timeout >= 0:
        raise InvalidArgumentError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def _sampling_meta(mode: str, max_times_sampled: int | None,
                   rate_limiter: RateLimiter | None) -> dict[str, Any]:
    """How a buffer samples, as recorded in its file (reopened the same way)."""
    return {"mode": mode, "max_times_sampled": max_times_sampled,
            "rate_limiter": rate_limiter and rate_limiter.to_dict()}


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
