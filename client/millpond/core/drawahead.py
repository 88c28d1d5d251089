"""Drawing a uniform replay buffer's next sample ahead of its call (a mixin of the buffer).

A server draws a learner's next sample while the learner is busy with the last
one (see ``millpond_server.ahead``). Served later, it must be the batch a draw
then would make: so only a buffer whose draws change nothing but its generator
draws ahead, and a draw is served only if the buffer has not changed since.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .checks import check_batch_size
from .config import BufferConfig
from .draw import Uniform
from .fifo import Fifo


@dataclass(frozen=True)
class Drawn:
    """A sample :meth:`TieredBuffer.draw_ahead` drew into ``out``, not yet served or
    counted; ``state``: the buffer's when it was drawn."""

    batch_size: int
    out: Mapping[str, np.ndarray]
    state: tuple[int, int]


class DrawAhead:
    """:meth:`draw_ahead` and :meth:`sample_drawn`, for :class:`.buffer.TieredBuffer`."""

    config: BufferConfig
    _fifo: Fifo
    _strategy: Any
    _lock: Any
    _closed: bool
    _rng: np.random.Generator
    _size: Callable[[], int]
    _read: Callable[..., dict[str, np.ndarray]]

    @property
    def draws_ahead(self) -> bool:
        """Whether :meth:`draw_ahead` may draw here: a uniform replay buffer (no
        priorities, no use limit), whose draws change nothing but its generator."""
        return not self.config.removes and type(self._strategy) is Uniform

    def draw_ahead(self, batch_size: int, out: Mapping[str, np.ndarray]
                   ) -> Drawn | None:
        """Draw the next unseeded sample of ``batch_size`` into ``out`` now, neither served
        nor counted, for :meth:`sample_drawn` to serve later (a server draws the next
        sample while its caller is busy elsewhere).

        Only where that is invisible (:attr:`draws_ahead`), holding ``batch_size``
        records. Never waits: None if another thread holds the lock, or it cannot draw.
        """
        batch_size = check_batch_size(batch_size)
        if not self.draws_ahead or not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed or self._size() < batch_size:
                return None
            self._draw_uniform(batch_size, out)
            return Drawn(batch_size, out, self._state())
        finally:
            self._lock.release()

    def sample_drawn(self, drawn: Drawn, *, timeout: float | None = None
                     ) -> tuple[dict[str, np.ndarray], bool]:
        """``sample(drawn.batch_size, out=drawn.out, timeout=timeout)``, served from
        ``drawn``'s rows if the buffer has not changed since :meth:`draw_ahead` made them:
        then they are the very batch a draw now would make. Else it draws again. Rate
        limiter and counts as for any sample, now. Returns the batch and whether it is
        the one drawn ahead."""
        served = False

        def read() -> dict[str, np.ndarray]:
            nonlocal served
            if drawn.state == self._state():
                served = True
                return dict(drawn.out)
            return self._draw_uniform(drawn.batch_size, drawn.out)

        return self._read(drawn.batch_size, drawn.batch_size, timeout, read), served

    def _draw_uniform(self, batch_size: int, out: Mapping[str, np.ndarray]
                      ) -> dict[str, np.ndarray]:
        """An unseeded draw of a uniform replay buffer into ``out`` (lock held)."""
        seqs, _ = self._strategy.draw(self._rng, batch_size)
        return self._fifo.gather(seqs, out)

    def _state(self) -> tuple[int, int]:
        """What a uniform replay buffer's draws see (lock held): both counters only ever
        grow there, and every change of its records moves one of them."""
        return self._fifo.pushed, self._fifo.first
