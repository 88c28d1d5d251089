"""Samples drawn ahead: a learner's next plain sample, drawn while the learner is busy.

A learner asks for ``sample(n)`` again and again, and between two of its calls
the daemon's loop sits idle while gRPC carries the reply and the learner uses
it. So after serving a plain sample (no seed, no filter) whose reply is small
enough to be made on the loop, the daemon draws the next one there and then,
into a reply of its own (:meth:`TieredBuffer.draw_ahead`). The buffer's next
such call of that size is served from it (:meth:`TieredBuffer.sample_drawn`):

* if the buffer has not changed since, these are the very rows a draw then
  would make (its generator is where it would be), counted then;
* else (a push came in between) it draws again, into the same reply.

Nothing is visible to callers but the time: the draw happens off their call.
A change that made the draw useless costs the loop that one draw; it also
stops drawing ahead on that buffer for 1, 2, 4, ... up to 64 calls, so a
buffer whose every sample follows a push does not pay for a draw per call.
At most one drawn reply (at most ``INLINE_BYTES``) is held per buffer.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

from millpond.core import TieredBuffer
from millpond.core.drawahead import Drawn
from millpond.wire.inplace import BatchFrame

from .operations import Operations
from .waits import try_now

MAX_SKIP = 64  # calls served without drawing ahead after useless draws, at most


@dataclass
class _Ahead:
    """One buffer's sample drawn ahead and the reply its rows are in, swapped as one
    object (a pooled call may take it while the loop puts the next one)."""

    ready: tuple[Drawn, bytes] | None = None
    skip: int = 0  # calls to serve before drawing ahead again
    backoff: int = 1  # the skip after the next useless draw


class SamplesAhead:
    """Draws each buffer's next plain sample ahead, on the event loop."""

    def __init__(self, ops: Operations):
        self.ops = ops
        self._buffers: weakref.WeakKeyDictionary[TieredBuffer, _Ahead] = \
            weakref.WeakKeyDictionary()

    def serve(self, buffer: TieredBuffer, batch_size: int) -> bytes | None:
        """The reply of a plain sample of ``batch_size`` from the one drawn ahead, or
        None if there is none of that size (the caller samples the plain way)."""
        ahead = self._buffers.get(buffer)
        if ahead is None or ahead.ready is None:
            return None
        (drawn, reply), ahead.ready = ahead.ready, None
        if drawn.batch_size != batch_size:
            return None
        _, served = try_now(buffer, buffer.sample_drawn, drawn, timeout=0)
        if served:
            ahead.backoff = 1
        else:
            ahead.skip, ahead.backoff = ahead.backoff, min(2 * ahead.backoff, MAX_SKIP)
        return reply

    def draw_next(self, buffer: TieredBuffer, frame: BatchFrame, batch_size: int) -> None:
        """Draw the next sample of ``batch_size`` once the running call is done, if this
        runs on the loop (a call on the pool found the buffer busy: no more work for it)."""
        if not self.ops.on_loop():
            return
        assert self.ops.loop is not None
        ahead = self._buffers.get(buffer)
        if ahead is None:
            ahead = self._buffers[buffer] = _Ahead()
        if ahead.skip:
            ahead.skip -= 1
            return
        self.ops.loop.call_soon(self._draw, buffer, ahead, frame, batch_size)

    def _draw(self, buffer: TieredBuffer, ahead: _Ahead, frame: BatchFrame,
              batch_size: int) -> None:
        if ahead.ready is not None:  # several callers: one drawn sample waits already
            return
        start = time.monotonic()
        reply, columns = frame.new()
        drawn = buffer.draw_ahead(batch_size, columns)
        if drawn is not None:
            ahead.ready = (drawn, reply)
        self.ops.ran_on_loop(buffer, start)  # a draw that read from the disk: as a slow call
