"""The tiered buffer's contents as a learner sees them: positions, everything, reset.

A mixin of :class:`~.buffer.TieredBuffer`, kept apart so that each module
stays readable. The *contents* are the records ``len(buffer)`` counts: live,
not damaged, not used up (``max_times_sampled``), oldest first. A *position*
is an index into them: 0 is the oldest record, ``len - 1`` the newest.
Positions are resolved to seqs under the buffer's lock, in the same call
that reads the records, so concurrent pushes cannot make a read mix records
of two different states.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..errors import IndexOutOfRangeError
from .config import BufferConfig
from .draw import Proportional, Strategy, strategy_for
from .episodes import EpisodeIndex
from .episodic import check_fields
from .fifo import Fifo
from .ratelimit import RateState


class Contents:
    """Positions, contents and reset of a tiered buffer (see the module docstring)."""

    config: BufferConfig
    persistent: bool
    _fifo: Fifo
    _strategy: Strategy
    _episodes: EpisodeIndex | None
    _lock: Any
    _rate: RateState
    _check_open: Callable[[], None]
    _size: Callable[[], int]

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
        outside = (positions < 0) | (positions >= size)
        if outside.any():
            raise IndexOutOfRangeError(
                f"position {int(positions[outside][0])} is out of range: the buffer holds "
                f"{size} records, at positions 0 (oldest) to {size - 1} (newest)")
        fifo = self._fifo
        if not len(fifo.holes) and not self._strategy.removed:  # the contents are one range
            return positions + fifo.first
        seqs = fifo.live()
        return seqs[self._strategy.drawable(seqs)][positions]

    def contents(self, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Every record that can be sampled, oldest first (a copy; fields ``fields``,
        default all, in that order), read at once: ``sample_all``, checks, tests."""
        names = check_fields(self.config, fields)
        with self._lock:
            self._check_open()
            seqs = self._fifo.live()
            return self._fifo.gather_rows(seqs[self._strategy.drawable(seqs)], names)

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
