"""The tiered buffer: one FIFO of at most ``total_capacity`` records, and its lifecycle.

It composes the parts of the engine: the :class:`~.fifo.Fifo` (live ranges,
tiers, the crash-safe commit), a drawing strategy (:mod:`.draw`: uniform,
proportional, use limits) and the rate limiter's state (:mod:`.ratelimit`),
which makes pushes and samples wait, up to their ``timeout``, while they
would break it.

Thread-safe: one lock per buffer guards every public method.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Mapping, NoReturn, Sequence, TypeVar

import numpy as np

from millpond.core import sequences
from millpond.core.bufferfile import BufferFile
from millpond.core.checks import (
    check_batch_size,
    check_count,
    check_indices,
    check_priorities,
    check_seed,
    check_timeout,
)
from millpond.core.config import BufferConfig, ConfigAccessors, check_exponent
from millpond.core.draw import Proportional, UseLimit, strategy_for
from millpond.core.episode_checks import (
    MAX_WINDOW,
    check_fields,
    check_filter,
    check_n_step,
    check_push_episodes,
    check_updates,
    require_episodes,
)
from millpond.core.episodes import META_PREFIX, EpisodeIndex, record_ends
from millpond.core.fifo import BeforeCommit, Fifo
from millpond.core.fileops import sync_fd, temp_path
from millpond.core.footprint import (
    frame_regions_for,
    frames_for,
    hot_nbytes,
    memory_needed,
    slot_arrays_for,
)
from millpond.core.info import BufferInfo
from millpond.core.memory import available_memory, check_available, memory_limit
from millpond.core.ratelimit import RateState
from millpond.core.recovery import recover
from millpond.core.sequences import Out
from millpond.core.snapshot import CheckpointResult, Snapshot
from millpond.core.stored import StoredBatch
from millpond.core.tier import Tier
from millpond.errors import (
    BufferClosedError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidConfigError,
    NotEnoughDataError,
)

_R = TypeVar("_R")


class TieredBuffer(ConfigAccessors):
    """Hot ring + cold mapped-file ring behind one FIFO, as ``config`` describes.

    ``total_capacity == hot_capacity`` means no cold tier: the record leaving
    the hot ring is evicted. With ``path=None`` and a cold tier, the file goes
    to the system temp directory.

    By default the hot ring lives in RAM and ``close()`` (or dropping the
    buffer) deletes the file, like the reference. A *persistent* buffer keeps
    its hot ring in the file too, so every acknowledged push survives a crash
    of the process; ``release()`` unmaps it and keeps the file, and
    :meth:`open` brings it back. ``sync_every_push`` makes each push wait for
    its pages to reach the disk (fdatasync) before it returns.
    The *contents* are the records ``len(buffer)`` counts: live, not damaged,
    not used up (``max_times_sampled``), oldest first. A *position* indexes
    them: 0 is the oldest record, ``len - 1`` the newest. Positions are
    resolved to seqs under the lock, in the call that reads the records.

    Episodic buffers (``config.episodes``) keep an
    :class:`~.episodes.EpisodeIndex` beside the FIFO, and their windows,
    n-step transitions and episodes are laid out by :mod:`.sequences`.

    Sampling (``config.mode``): ``"replay"`` draws with replacement (see
    :mod:`.draw`) and keeps records until they are evicted or used up;
    ``"queue"`` returns the oldest records and removes them (FIFO),
    ``"stack"`` the newest, newest first (LIFO).
    """

    # A read-only dataset (:class:`~.dataset.ReadOnlyBuffer`) says True: every write
    # raises ReadOnlyBufferError before its arguments are looked at (see check_writable).
    read_only = False

    def __init__(self, config: BufferConfig, path: str | os.PathLike | None = None, *,
                 persistent: bool = False, sync_every_push: bool = False, exclusive: bool = False):
        """Everything is checked (config, memory, disk) before anything is written, and
        the file gets its name only once the buffer is built: a failed creation
        leaves nothing behind. ``exclusive``: refuse to take the place of anything
        already at ``path`` (FileConflictError) instead of replacing it."""
        if not isinstance(config, BufferConfig):
            raise InvalidConfigError(f"config must be a millpond BufferConfig, got {config!r}")
        hot, total = config.hot_capacity, config.total_capacity
        check_available(memory_needed(config, persistent), "this buffer")
        file = None
        if persistent or total > hot:
            if path is None and persistent:
                raise InvalidConfigError("a persistent buffer needs a file path")
            file = BufferFile.create(
                os.fspath(path) if path is not None else temp_path(), config.stored_schema, hot,
                total, persistent=persistent, extra_meta=config.sampling_meta(),
                slot_arrays=slot_arrays_for(config) if persistent else None,
                frame_regions=frame_regions_for(config, persistent))
        try:
            hot_tier = file.hot_tier if file is not None and persistent else Tier.in_memory(
                config.stored_schema, hot)
            assert hot_tier is not None  # a persistent buffer's file holds its hot tier
            fifo = Fifo(config.schema, hot_tier, None if file is None else file.tier, total, file,
                        durable=persistent, sync_every_push=sync_every_push,
                        spare=file.spare if file is not None and persistent else 0,
                        frames=frames_for(config, file), stored=config.stored_schema)
            self._setup(config, fifo, persistent)
            if file is not None:
                file.publish(replace=not exclusive)
        except BaseException:
            if file is not None:
                file.close(delete=True)
            raise

    @classmethod
    def open(cls, path: str | os.PathLike, *, sync_every_push: bool = False,
             skip_corrupt: bool = False, progress: Callable[[int, int], None] | None = None
             ) -> "TieredBuffer":
        """Reopen a persistent buffer's file with its records, counters and configuration.

        See :func:`.recovery.recover` for the checks, ``skip_corrupt`` and
        ``progress``. The rate limiter's counters restart (mid-band; a queue
        or stack counts what it holds as not yet sampled) and ``beta``
        returns to its value at creation.
        """
        config, fifo = recover(path, sync_every_push=sync_every_push,
                               skip_corrupt=skip_corrupt, progress=progress)
        buffer = cls.__new__(cls)
        buffer._setup(config, fifo, persistent=True)
        buffer._strategy.restore()
        if buffer._episodes is not None:
            buffer._episodes.restore()
        buffer._rate.restart(buffer._size(), removes=config.removes)
        return buffer

    def _setup(self, config: BufferConfig, fifo: Fifo, persistent: bool) -> None:
        self.config = config
        self.persistent = persistent
        self._fifo = fifo
        self._build_index()
        if fifo.file is not None:  # the hot tier resident while there is room for it
            available = available_memory()
            self.hot_locked = fifo.file.settle(lock_hot=persistent and (
                available is None or hot_nbytes(config, persistent) <= available))
        self._lock = threading.RLock()  # re-entrant: see Operations.admit_small, server
        self._rate = RateState(config.rate_limiter, self._lock)
        self._closed = False
        self._rng = np.random.default_rng()
        if fifo.file is not None:
            # Like the reference's Drop: a buffer dropped (or alive at exit)
            # without close() still unmaps its file, and deletes it unless
            # the buffer is persistent. (Its listeners are the FIFO's then: reset replaces them.)
            weakref.finalize(self, _unmap, fifo, not persistent)

    # ---- properties -----------------------------------------------------------

    @property
    def path(self) -> str | None:
        """The buffer's file (both tiers if persistent), or None if it has none."""
        return self._fifo.file.path if self._fifo.file is not None else None

    @property
    def recovery_notes(self) -> list[str]:
        """What reopening found wrong and got around (e.g. a damaged commit slot), to be
        reported; empty for a buffer made here."""
        file = self._fifo.file
        state = file.commit_state if file is not None else None
        return list(state.notes) if state is not None else []

    @property
    def recovery_doubt(self) -> str | None:
        """Why reopening may have missed the last acknowledged push (a format 4 file with a
        damaged commit slot), or None."""
        file = self._fifo.file
        state = file.commit_state if file is not None else None
        return state.doubt if state is not None else None

    @property
    def pushed(self) -> int:
        """Records ever pushed, including evicted ones."""
        return self._fifo.pushed

    @property
    def closed(self) -> bool:
        return self._closed

    def damaged_seqs(self) -> np.ndarray:
        """The live seqs left out as damaged when the file was reopened (``info().damaged``
        of them), sorted: never served, gone once evicted."""
        with self._lock:
            return self._fifo.holes.copy()

    def __len__(self) -> int:
        self._check_open()
        return self._size()

    def _size(self) -> int:
        return self._fifo.size - self._strategy.removed

    def info(self) -> BufferInfo:
        """Sizes, capacities and counters (a snapshot). ``stored_bytes``: what the
        live records occupy (RAM and disk: their stored fields and, with frames, the
        frames they refer to); ``logical_bytes``: what they would as plain arrays."""
        with self._lock:
            self._check_open()
            fifo, proportional = self._fifo, self._proportional(required=False)
            episodes, in_progress = self._episode_counts()
            live = fifo.pushed - fifo.first
            stored = live * self.config.stored_schema.record_nbytes
            if fifo.frames is not None:
                stored += fifo.frames.stored_nbytes(fifo.first, fifo.pushed)
            return BufferInfo(
                self.config, stored_bytes=stored, logical_bytes=live * self.schema.record_nbytes,
                path=self.path, **({} if proportional is None else proportional.state()),
                size=self._size(), pushed=fifo.pushed, hot_size=fifo.pushed - fifo.hot_lo,
                cold_size=fifo.hot_lo - fifo.first, damaged=len(fifo.holes),
                memory_needed=memory_needed(self.config, self.persistent),
                memory_limit=memory_limit() or 0, episodes=episodes,
                episodes_in_progress=in_progress, read_only=self.read_only,
                **self._rate.stats())

    def check_writable(self, what: str) -> None:
        """Nothing here; ReadOnlyBufferError in a read-only dataset. Callers that check a
        write's arguments before the engine does (the daemon's fast path) call it first:
        that the buffer takes no writes is what is wrong first."""

    # ---- writes ---------------------------------------------------------------

    def push(self, record: Mapping[str, Any], priority: float | None = None, *,
             episode: int | None = None, updates: Any = None,
             timeout: float | None = None) -> None:
        """Append one record (``{field: value}``); validated before anything changes.

        ``priority``: prioritized buffers only (default: the largest seen so
        far). ``episode`` (its id), ``updates``: see :meth:`push_batch`. With
        a rate limiter, waits up to ``timeout`` seconds (None: no limit)
        while the push would break it, then raises RateLimitTimeoutError.
        """
        self._check_open()
        batch = self.schema.coerce_record(record)
        self._store(1, batch, None if priority is None else [priority], episode, updates, timeout)

    def push_batch(self, columns: Mapping[str, Any], priorities: Any = None, *,
                   episodes: Any = None, updates: Any = None,
                   timeout: float | None = None) -> int:
        """Append a batch (``{field: array[n, ...]}``); return n.

        Validated in full before anything changes: a rejected batch leaves the
        buffer exactly as it was. An empty batch is accepted and stores nothing.
        ``priorities``: one per record, prioritized buffers only. ``episodes``:
        episodic buffers only, one id per record (or one for all); a record
        whose ``terminated`` or ``truncated`` is true ends its episode.
        ``updates``: :meth:`update_episodes`'s, applied with the batch (its
        episodes' meta becomes visible with their records).
        ``timeout``: as for :meth:`push`; the batch is admitted whole or not at all.
        """
        self._check_open()
        n, batch = self.schema.coerce_batch(columns)
        self._store(n, batch, priorities, episodes, updates, timeout)
        return n

    def _store(self, n: int, batch: Mapping[str, np.ndarray], priorities: Any, episodes: Any,
               updates: Any, timeout: float | None) -> tuple[int, int]:
        """Append a coerced batch; ``(size, pushed)`` after it."""
        timeout = check_timeout(timeout)
        if priorities is not None:
            self._proportional()
            priorities = check_priorities(priorities, n)
        before_commit = self._episode_writes(n, batch, episodes, updates)
        limiter = self.config.rate_limiter
        if limiter is not None and n:
            limiter.check_insert(n)
        with self._lock:
            self._check_open()
            if n and limiter is not None:
                self._rate.wait_until("insert", n, lambda: self._rate.can_insert(n, self._size()),
                                      timeout, self._size, self._check_open)
            self._append(n, batch, before_commit, priorities)
            return self._size(), self._fifo.pushed

    def _append(self, n: int, batch: Mapping[str, np.ndarray],
                before_commit: BeforeCommit | None = None,
                priorities: np.ndarray | None = None) -> None:
        """Store a batch admitted in full (lock held)."""
        old, new = self._fifo.append(n, batch, before_commit)
        self._strategy.appended(old, new, priorities)
        self._rate.inserts += n
        self._rate.changed()

    # ---- reads ----------------------------------------------------------------

    def sample(self, batch_size: int, seed: int | None = None,
               out: Mapping[str, np.ndarray] | None = None, *, timeout: float | None = None,
               n_step: int | None = None, gamma: float = 0.99,
               filter_meta: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Draw ``batch_size`` records from hot + cold.

        Replay mode draws with replacement: the same contents and ``seed``
        give the same batch; ``seed=None`` draws fresh entropy. Rows holding
        cold records come first, then hot ones (each group in draw order):
        the batch as a multiset follows the strategy's distribution,
        positions are not exchangeable. Prioritized buffers add ``weights``
        and ``indices``. Queue mode returns (and removes) the oldest records,
        oldest first; stack mode the newest, newest first. ``out`` may supply
        the destination arrays (``{field: array[batch_size, *shape]}``), e.g.
        shared memory.

        One rule for every mode, with or without a rate limiter (as the
        reference's ``sample``): a sample of ``batch_size`` needs at least
        ``batch_size`` records held, although replay draws with replacement.
        Without a rate limiter, asking for more raises NotEnoughDataError at
        once; with one (always, in queue and stack modes) the sample waits up
        to ``timeout`` seconds (None: no limit) until enough records are held
        and the limiter allows it (RateLimitTimeoutError then says which it
        waited for). More than the buffer's capacity can never be held:
        NotEnoughDataError at once, limiter or not.

        Episodic buffers: ``filter_meta`` draws only records of episodes
        with those meta values; ``n_step`` (with ``gamma``) returns n-step
        transitions (see :meth:`sample_n_step`).
        """
        return self._read(*self._sample_draw(batch_size, seed, out, timeout, n_step, gamma,
                                             filter_meta))

    def sample_stored(self, batch_size: int, seed: int | None = None, *,
                      timeout: float | None = None, n_step: int | None = None,
                      gamma: float = 0.99, filter_meta: Mapping[str, Any] | None = None,
                      seq_len: int | None = None) -> StoredBatch:
        """What :meth:`sample` (``seq_len``: :meth:`sample_sequences`) returns, in the
        stored form: the distinct frames of its frame groups once (compressed ones as
        stored), and per group field the indices of its values' frames (see
        :mod:`.stored`). The same draw as the plain call's: with the same contents and
        ``seed``, ``sample_stored(...).rebuild(schema)`` is exactly the plain call's
        result (the use counts, rate limits and priorities alike). For readers that
        move the sample elsewhere (a server replying over a wire) before rebuilding it.
        A buffer without frame groups gives its plain arrays as ``columns``. Not for
        queue and stack modes (NotImplementedError: their samples remove records)."""
        if self.config.removes:
            raise NotImplementedError("sample_stored draws; queue and stack samples remove")
        if seq_len is not None:
            if n_step is not None:
                raise InvalidArgumentError("seq_len and n_step are different calls")
            plan = self._sequences_draw(batch_size, seq_len, seed, filter_meta, timeout, None)
        else:
            plan = self._sample_draw(batch_size, seed, None, timeout, n_step, gamma, filter_meta)
        size, need, wait, draw = plan
        return self._read(size, need, wait, lambda: self._fifo.stored_reads(draw))

    def _sample_draw(self, batch_size: int, seed: int | None, out: Out, timeout: float | None,
                     n_step: int | None, gamma: float, filter_meta: Mapping[str, Any] | None
                     ) -> tuple[int, int, float | None, Callable[[], dict[str, np.ndarray]]]:
        """:meth:`sample`'s arguments checked, and its draw (for :meth:`_read`)."""
        if n_step is not None:
            return self._n_step_draw(batch_size, n_step, gamma, seed, filter_meta, timeout, out)
        batch_size = check_batch_size(batch_size)
        seed = check_seed(seed)
        wanted = self._filter(filter_meta)

        def draw() -> dict[str, np.ndarray]:
            if self.config.removes:
                return self._fifo.pop(batch_size, newest=self.config.mode == "stack", out=out)
            among = None if wanted is None else self._episodes_or_raise().candidates(wanted)
            seqs, extras = self._strategy.draw(self._generator(seed), batch_size, among)
            if extras:  # rows come back cold first, then hot: keep extras in step
                order = self._fifo.tier_order(seqs)
                seqs, extras = seqs[order], {k: v[order] for k, v in extras.items()}
            return {**self._fifo.gather(seqs, out), **extras}

        return batch_size, batch_size, timeout, draw

    def _read(self, batch_size: int, need: int, timeout: float | None,
              read: Callable[[], _R]) -> _R:
        """``read()`` under the lock once a sample of ``batch_size`` may proceed: without a
        rate limiter, at once if ``need`` records are held (else NotEnoughDataError);
        with one, after waiting up to ``timeout`` while it would break it. Counted
        as ``batch_size`` samples."""
        timeout = check_timeout(timeout)
        limiter = self.config.rate_limiter
        if limiter is not None:
            limiter.check_sample(batch_size)
        with self._lock:
            self._check_open()
            if limiter is not None and need > self.config.total_capacity:
                raise NotEnoughDataError(  # waiting could never end
                    f"batch_size {batch_size} > buffer capacity {self.config.total_capacity}: "
                    "a sample needs that many records held")
            if limiter is None:
                if need > self._size():
                    raise NotEnoughDataError(f"batch_size {batch_size} > buffer len {self._size()}"
                                             if need == batch_size else "the buffer is empty")
            else:
                self._rate.wait_until("sample", batch_size,
                                      lambda: self._sample_ready(batch_size, need),
                                      timeout, self._size, self._check_open, need)
            result = read()
            self._rate.samples += batch_size
            self._rate.changed()
            return result

    def _generator(self, seed: int | None) -> np.random.Generator:
        """The generator of a draw (lock held). Unseeded draws share one: making a fresh
        one costs more than sampling 256 small records."""
        return self._rng if seed is None else np.random.default_rng(seed)

    def _sample_ready(self, batch_size: int, need: int) -> bool:
        """Whether a sample of ``batch_size`` (of ``need`` records at least) may proceed
        now (lock held)."""
        size = self._size()
        if size < need:  # one rule, limiter or not: see sample
            return False
        if self.config.removes or self.config.max_times_sampled:
            if size < batch_size:  # it takes batch_size distinct records (or draws left)
                return False
        return self._rate.can_sample(batch_size, size)

    # ---- contents: positions, everything, reset ------------------------------------

    def _build_index(self) -> None:
        """A fresh drawing strategy and episode index over the FIFO, the FIFO's listeners
        (at creation; at reopen, then restored from the file; at reset)."""
        config, fifo, persistent = self.config, self._fifo, self.persistent
        self._strategy = strategy_for(config, fifo, fifo.file, persistent)
        self._episodes = (EpisodeIndex(fifo, config.meta_fields, fifo.file if persistent else None)
                          if config.episodes else None)
        fifo.listeners = (self._strategy,) if self._episodes is None else (
            self._strategy, self._episodes)

    def _at_positions(self, positions: np.ndarray) -> np.ndarray:
        """The seqs of the records at ``positions`` (lock held). IndexOutOfRangeError,
        before anything is read, if a position is not in ``[0, len)``."""
        size = self._size()
        # Two reductions decide the usual case (all inside); the mask only for the message.
        if len(positions) and (positions.min() < 0 or positions.max() >= size):
            outside = (positions < 0) | (positions >= size)
            raise IndexOutOfRangeError(
                f"position {int(positions[outside][0])} is out of range: the buffer holds "
                f"{size} records, at positions 0 (oldest) to {size - 1} (newest)")
        fifo = self._fifo
        if not len(fifo.holes) and not self._strategy.removed:  # the contents are one range
            return positions + fifo.first
        seqs = fifo.live()
        return seqs[self._strategy.drawable(seqs)][positions]

    def flush(self) -> None:
        """Nothing to wait for: every push is stored before it returns."""

    def read_chunk(self, record_nbytes: int) -> None:
        """None: one :meth:`read` may return any number of records."""
        return None

    def contents(self, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Every record that can be sampled, oldest first (a copy; fields ``fields``,
        default all, in that order), read at once: ``sample_all``, checks, tests."""
        names = check_fields(self.config, fields)
        with self._lock:
            self._check_open()
            seqs = self._fifo.live()
            return self._fifo.gather_rows(seqs[self._strategy.drawable(seqs)], names)

    def checkpoint(self, path: str | os.PathLike, *,
                   progress: Callable[[int, int], None] | None = None) -> CheckpointResult:
        """Write a consistent copy of this buffer to the new buffer file at ``path``
        (``.buffer`` appended if missing; never over an existing file) while it goes on.

        The copy holds the records live when the call began that are still live when
        copied (see :mod:`millpond.core.snapshot` for the guarantee), each checked as it
        is copied, in steps of a few MiB under the buffer's lock: pushes and samples from
        other threads go on between them. ``progress(copied, total)`` after each step.
        A daemon serves the file once in its data directory (``millpond restore``);
        :meth:`open` reopens it in-process.
        """
        return self.snapshot(path).run(progress)

    def snapshot(self, path: str | os.PathLike, *, replace: bool = False) -> Snapshot:
        """A :class:`~millpond.core.snapshot.Snapshot` of this buffer to ``path``, to run
        step by step (a daemon runs each step through the buffer's owner). A buffer with
        ``frame_stack``, ``next_of`` or ``compression`` takes its frames along (compressed
        ones as stored)."""
        self._check_open()
        return Snapshot(self, path, replace=replace)

    def _slot_state(self) -> dict[str, np.ndarray]:
        """The per-slot state beside the records, by the names of a file's slot arrays
        (lock held): a persistent buffer's in its file; otherwise draw counts and episodes
        in RAM (raw priorities are kept only in a file: RAM holds the sum tree)."""
        file = self._fifo.file
        if self.persistent and file is not None:
            found = {name: file.slot_array(name) for name in slot_arrays_for(self.config)}
            return {name: array for name, array in found.items() if array is not None}
        state: dict[str, np.ndarray] = {}
        if isinstance(self._strategy, UseLimit):
            state["times_sampled"] = self._strategy.times
        index = self._episodes
        if index is not None:
            state.update(episode=index.episode, step=index.step, next=index.next,
                         length=index.length)
            state.update({META_PREFIX + name: column for name, column in index.meta.items()})
        return state

    def reset(self) -> None:
        """Drop every record; keep the config, the file and the handle.

        One commit drops them (a persistent buffer reopened after a crash is
        either as before or empty, never half reset). Priorities, the sum
        tree and ``max_priority`` (back to 1), use counts
        (``max_times_sampled``) and the episode index start again as at
        creation; ``beta`` keeps its value (set_beta's schedule is the
        learner's, not the contents'). The rate limiter's diff restarts at 0
        and ``min_size_to_sample`` applies to the empty buffer; ``inserts``,
        ``samples`` and ``pushed`` keep counting (they are totals), as do
        seqs: a sample's ``indices`` from before never name a later record.
        An episode being written when the buffer is reset goes on as a new
        episode (its steps count from 0). Calls waiting for the rate limiter
        are woken to check again.
        """
        with self._lock:
            self._check_open()
            old = getattr(self._strategy, "inner", self._strategy)
            beta = old.beta if isinstance(old, Proportional) else None
            self._fifo.clear()
            for listener in self._fifo.listeners:  # views of the file's map go
                listener.release()
            self._build_index()
            new = getattr(self._strategy, "inner", self._strategy)
            if beta is not None and isinstance(new, Proportional):
                new.beta = beta
            self._rate.reset()
            self._rate.changed()

    # ---- episodes ------------------------------------------------------------------

    def update_episodes(self, updates: Sequence[tuple[int, Mapping[str, Any] | None, bool]]
                        ) -> None:
        """Apply ``(episode id, meta or None, end)`` updates in order: meta values reach
        every record of the episode, past and future; ``end`` ends it. All are checked
        before any is applied."""
        index = self._episodes_or_raise()
        checked = check_updates(self.config, updates)
        with self._lock:
            self._check_open()
            for episode, meta, end in checked:
                index.update(episode, meta, end)

    def sample_n_step(self, batch_size: int, n_step: int, gamma: float = 0.99,
                      seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                      timeout: float | None = None, out: Out = None) -> dict[str, np.ndarray]:
        """n-step transitions (transition schema): ``obs`` and ``actions`` of step ``t``,
        ``rewards`` the discounted sum of the next ``n_step_lens`` rewards from ``t``
        (``n_step_lens = min(n_step, steps stored from t to the episode's last stored
        step)``, returned too), ``next_obs``, ``terminated`` and ``truncated`` of step
        ``t + n_step_lens - 1``. Steps ``t`` are drawn like :meth:`sample`'s records.
        ``out``: arrays for the results (e.g. shared memory), as for :meth:`sample`."""
        return self._read(*self._n_step_draw(batch_size, n_step, gamma, seed, filter_meta,
                                             timeout, out))

    def _n_step_draw(self, batch_size: int, n_step: int, gamma: float, seed: int | None,
                     filter_meta: Mapping[str, Any] | None, timeout: float | None, out: Out
                     ) -> tuple[int, int, float | None, Callable[[], dict[str, np.ndarray]]]:
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        n_step, gamma = check_n_step(self.config, n_step, gamma)
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        return batch_size, batch_size, timeout, lambda: sequences.sample_n_step(
            self._fifo, index, self._strategy, self._generator(seed), batch_size, n_step, gamma,
            wanted, out)

    def sample_sequences(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                         filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None, out: Out = None) -> dict[str, np.ndarray]:
        """``batch_size`` windows of ``seq_len`` consecutive steps of one episode each.

        Every field is ``[batch_size, seq_len, ...]``, zero past the window's
        end, with ``mask`` (bool ``[batch_size, seq_len]``), ``lens`` (steps
        in the window: ``seq_len``, or fewer at the episode's last stored
        step), ``episode_ids``, ``start_steps`` (the start's step in its
        episode) and the meta fields (``[batch_size, ...]``). Starts are drawn
        with replacement among the live records, like :meth:`sample`'s
        (prioritized buffers add ``weights`` and ``indices`` of the starts);
        NotEnoughDataError only when there is none.
        """
        return self._read(*self._sequences_draw(batch_size, seq_len, seed, filter_meta, timeout,
                                                out))

    def _sequences_draw(self, batch_size: int, seq_len: int, seed: int | None,
                        filter_meta: Mapping[str, Any] | None, timeout: float | None, out: Out
                        ) -> tuple[int, int, float | None, Callable[[], dict[str, np.ndarray]]]:
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        seq_len = check_count("seq_len", seq_len, MAX_WINDOW)
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        return batch_size, 1, timeout, lambda: sequences.sample_sequences(
            self._fifo, index, self._strategy, self._generator(seed), batch_size, seq_len, wanted,
            out)

    sample_trajectories = sample_sequences  # rlox's name

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> dict[str, np.ndarray]:
        """``batch_size`` complete live episodes, drawn uniformly with replacement: fields
        ``[batch_size, T, ...]`` with ``T`` the longest drawn (or ``max_len``, which
        cuts longer ones), ``mask``, ``lens``, ``episode_ids`` and the meta fields."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        if max_len is not None:
            max_len = check_count("max_len", max_len, MAX_WINDOW)
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        return self._read(batch_size, 1, timeout, lambda: sequences.sample_episodes(
            self._fifo, index, self._generator(seed), batch_size, max_len, wanted))

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                        ) -> dict[str, np.ndarray]:
        """The complete live episodes (matching ``filter_meta``) in episode order:
        ``episode_ids``, ``lens``, meta fields, and ``seqs``, their records' indices
        (episode after episode, step order) for :meth:`read`. Not a sample."""
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        with self._lock:
            self._check_open()
            return sequences.catalog(index, wanted)

    def read(self, seqs: Any, fields: Sequence[str] | None = None, *, positions: bool = False,
             episode_ids: bool = False, out: Out = None) -> dict[str, np.ndarray]:
        """Records by index (the ``seqs`` of :meth:`episode_catalog`, the ``indices`` of
        a sample), in the order given, fields ``fields`` (default: all, in the order
        given), and ``live``: which were still live (the others' rows are zero).

        ``positions``: ``seqs`` are positions in the contents instead (0 = the
        oldest record, see :mod:`.contents`), resolved under the lock with the
        read: IndexOutOfRangeError, nothing read, if one is not in ``[0, len)``.
        ``episode_ids`` (episodic buffers): also each record's episode id.
        Not a sample: no rate limit, no use counted."""
        wanted = check_indices(seqs, "positions" if positions else "seqs")
        names = self._field_names(fields)
        index = self._episodes_or_raise() if episode_ids else None
        with self._lock:
            self._check_open()
            if positions:  # resolved to live records: read with no liveness check
                return sequences.read(self._fifo, self._at_positions(wanted), names, out, index,
                                      all_live=True)
            return sequences.read(self._fifo, wanted, names, out, index)

    # ---- helpers -------------------------------------------------------------------------

    def _episode_writes(self, n: int, batch: Mapping[str, np.ndarray], episodes: Any,
                        updates: Any) -> BeforeCommit | None:
        """What a push of ``batch`` (``n`` validated records, of ``episodes``) writes into
        the episode index before it commits (a chunk of it at a time), and then, with
        its last chunk, ``updates`` (meta, ends) that ride with it: visible together with
        its records (None: not episodic)."""
        ids = check_push_episodes(self.config, episodes, n)
        checked = check_updates(self.config, updates) if updates else []
        index = self._episodes
        if ids is None or index is None:
            return None
        ends = record_ends(self.config.schema, batch, n)

        def write(lo: int, hi: int, row: int) -> None:
            rows = slice(row, row + hi - lo)
            index.appended(lo, hi, ids[rows], ends[rows])
            if rows.stop == n:
                for episode, meta, end in checked:
                    index.update(episode, meta, end, index.first_after(hi))

        return write

    def _episodes_or_raise(self) -> EpisodeIndex:
        require_episodes(self.config)
        assert self._episodes is not None
        return self._episodes

    def _filter(self, filter_meta: Mapping[str, Any] | None) -> dict[str, np.ndarray] | None:
        return check_filter(self.config, filter_meta)

    def _field_names(self, fields: Sequence[str] | None) -> list[str] | None:
        return check_fields(self.config, fields)

    def _episode_counts(self) -> tuple[int, int]:
        """``info()``'s ``episodes`` and ``episodes_in_progress`` (lock held)."""
        index = self._episodes
        return (0, 0) if index is None else (index.complete, index.in_progress)

    # ---- priorities ----------------------------------------------------------------

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set new priorities for sampled records; returns how many were still live.

        ``indices`` are the ``indices`` a sample returned. Records evicted (or
        used up) since then are ignored: their slot may hold a newer record.
        """
        proportional = self._proportional()
        assert proportional is not None  # required: raised otherwise
        seqs = check_indices(indices)
        values = check_priorities(priorities, len(seqs))
        with self._lock:
            self._check_open()
            live = self._fifo.is_live(seqs)
            live[live] &= self._strategy.drawable(seqs[live])
            proportional.update(seqs[live], values[live])
            return int(live.sum())

    def set_beta(self, beta: float) -> None:
        """Set the importance-sampling exponent (anneal it towards 1)."""
        proportional = self._proportional()
        assert proportional is not None  # required: raised otherwise
        proportional.beta = check_exponent("beta", beta)

    def _proportional(self, required: bool = True) -> Proportional | None:
        strategy = getattr(self._strategy, "inner", self._strategy)
        if isinstance(strategy, Proportional):
            return strategy
        if required:
            raise InvalidArgumentError("priorities are for prioritized buffers; this one is uniform")
        return None

    # ---- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Release memory, unmap and delete the buffer's file. Idempotent."""
        self._shut(delete=True)

    def delete(self) -> None:
        """The same as :meth:`close` (a remote handle tells the two apart)."""
        self._shut(delete=True)

    def release(self) -> None:
        """Unmap; a persistent buffer keeps its file (reopen it with :meth:`open`).

        A non-persistent buffer's file is useless without its RAM hot tier,
        so it is deleted, as by :meth:`close`. Idempotent.
        """
        self._shut(delete=not self.persistent)

    def sync(self) -> None:
        """Write the file's dirty pages to disk and wait. Everything acknowledged before the
        call is on disk when it returns. Calls go on meanwhile: the write runs outside the
        lock, on a duplicate fd (a Close meanwhile cannot pull it away). That is as safe as
        the kernel's own write-back, which may also write pages of a later push before its
        commit: the checks at reopen catch any record not wholly on disk."""
        with self._lock:
            file = self._fifo.file
            if file is None or self._closed:
                return
            fd = file.sync_handle()
            if fd is None:  # no fd to spare: sync here, holding the lock
                file.sync()
                return
        try:
            sync_fd(fd, file.path)
        finally:
            os.close(fd)

    def _shut(self, delete: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._rate.changed()  # waiters wake up and raise BufferClosedError
            _unmap(self._fifo, delete)

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("operation on a closed buffer")

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "an in-process buffer cannot be pickled; to share one buffer between "
            "processes, serve it (millpond serve) and pass address= and name="
        )


def _unmap(fifo: Fifo, delete: bool) -> None:
    """Drop every view of the buffer's memory, then unmap (and maybe delete) its file."""
    fifo.hot.release()
    if fifo.frames is not None:
        fifo.frames.release()
    for listener in fifo.listeners:  # views of the file's map must go before it closes
        listener.release()
    if fifo.file is not None:
        fifo.file.close(delete=delete)
