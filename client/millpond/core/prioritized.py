"""Priority updates and ``beta``, for prioritized buffers (a mixin of the buffer)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError
from .checks import check_indices, check_priorities
from .config import check_exponent
from .draw import Proportional, Strategy
from .fifo import Fifo


class PriorityUpdates:
    """:meth:`update_priorities` and :meth:`set_beta`, for :class:`.buffer.TieredBuffer`."""

    _fifo: Fifo
    _strategy: Strategy
    _lock: Any
    _check_open: Any

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
