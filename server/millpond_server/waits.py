"""What a call that would wait for a buffer's rate limiter is made of.

The engine is only ever *tried* (``timeout=0``, :func:`try_now`); a call that
would wait raises :class:`WouldWait`, and the buffer's owner
(:mod:`.owner`) parks it, within the call's budget (:func:`wait_budget`) and
the daemon's bounds on parked calls (:class:`WaitingCalls`).
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any, Callable, TypeVar

from millpond.errors import LimitExceededError, RateLimitTimeoutError
from millpond.remote.malloc import release_free_memory

T = TypeVar("T")
# Parked calls that held more than this, once all gone, give their memory back to the OS.
RELEASE_AFTER_BYTES = 64 << 20
RELEASE_DELAY_S = 0.5


class WouldWait(Exception):
    """An engine call tried with ``timeout=0`` found the rate limiter closed; ``state``:
    the limiter's state then, in words."""

    def __init__(self, kind: str, records: int, state: str):
        super().__init__(kind)
        self.kind, self.records, self.state = kind, records, state


def try_now(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """An engine call with ``timeout=0``; WouldWait if the rate limiter is closed."""
    try:
        return call(*args, timeout=0, **kwargs)
    except RateLimitTimeoutError as exc:
        raise WouldWait(exc.kind or "", exc.records or 0, exc.state or "") from None


def wait_budget(requested: float | None, remaining: float | None) -> float | None:
    """Seconds a call may wait for a rate limiter: what it asked for (None: no
    limit of its own), never past its deadline (``remaining`` seconds away)
    less a margin, so that its caller gets our clear error rather than gRPC's."""
    if remaining is None:
        return requested
    cap = max(0.0, remaining - min(0.05, remaining / 10))
    return cap if requested is None else min(requested, cap)


class WaitingCalls:
    """The daemon's bounds on parked calls, over every buffer: how many, and the bytes
    they hold (a parked PushBatch keeps its request: megabytes). Used on the loop only.
    """

    def __init__(self, max_calls: int | None = None, max_bytes: int | None = None):
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self.calls = 0
        self.bytes = 0
        self._peak = 0

    def start(self, held: int) -> None:
        """Count a parked call holding ``held`` bytes, or refuse it past the bounds."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            raise LimitExceededError(
                f"{self.calls} calls already wait for rate limiters, the server's limit "
                "(--max-waiting-calls); retry later")
        if self.max_bytes is not None and self.bytes + held > self.max_bytes:
            raise LimitExceededError(
                f"calls waiting for rate limiters already hold {self.bytes:,} bytes; "
                f"{held:,} more would pass the server's limit (--max-waiting-mb)")
        self.calls += 1
        self.bytes += held
        self._peak = max(self._peak, self.bytes)

    def stop(self, held: int) -> None:
        self.calls -= 1
        self.bytes -= held
        if self.bytes == 0 and self._peak > RELEASE_AFTER_BYTES:
            # malloc keeps large freed blocks for reuse: give them back once the
            # calls are over and their requests freed (not yet: they are in scope).
            self._peak = 0
            asyncio.get_running_loop().call_later(RELEASE_DELAY_S, self._release_if_idle)

    def _release_if_idle(self) -> None:
        if self.bytes == 0:
            # A call that timed out raised in frames that hold its request: the
            # cycle (exception, traceback, frame) waits for the cyclic collector,
            # which an idle server may not run for a long while.
            gc.collect()
            release_free_memory()
