"""What a call that would wait for a buffer's rate limiter is made of.

The engine is only ever *tried* (``timeout=0``, :func:`try_now`); a call that
would wait raises :class:`WouldWait`, and :class:`.operations.Operations` then
waits on the event loop for the buffer's next change (:class:`BufferChanges`),
within the call's budget (:func:`wait_budget`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

from millpond.core import TieredBuffer
from millpond.errors import RateLimitTimeoutError

T = TypeVar("T")


class WouldWait(Exception):
    """An engine call tried with ``timeout=0`` found the rate limiter closed."""

    def __init__(self, buffer: TieredBuffer, kind: str, records: int):
        super().__init__(kind)
        self.buffer, self.kind, self.records = buffer, kind, records


def wait_budget(requested: float | None, remaining: float | None) -> float | None:
    """Seconds a call may wait for a rate limiter: what it asked for (None: no
    limit of its own), never past its deadline (``remaining`` seconds away)
    less a margin, so that its caller gets our clear error rather than gRPC's."""
    if remaining is None:
        return requested
    cap = max(0.0, remaining - min(0.05, remaining / 10))
    return cap if requested is None else min(requested, cap)


class BufferChanges:
    """The event that wakes the loop's waiters on one buffer when it changes.

    The buffer calls :meth:`changed` from any thread with its lock held;
    only while someone waits does that cost a hop to the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, buffer: TieredBuffer):
        self.loop = loop
        self.waiting = 0
        self.event = asyncio.Event()
        buffer.add_listener(self.changed)

    def changed(self) -> None:
        if self.waiting:
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


def try_now(buffer: TieredBuffer, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """An engine call with ``timeout=0``; WouldWait if the rate limiter is closed."""
    try:
        return call(*args, **kwargs)
    except RateLimitTimeoutError as exc:
        raise WouldWait(buffer, exc.kind or "", exc.records or 0) from None
