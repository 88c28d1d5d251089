"""The owner of one served buffer: the one place that orders its operations.

Reverb's table worker is the model. Every operation a client asks of a buffer
(push, sample, read, priorities, episodes, reset, delete), over gRPC or the
fast path, goes through the buffer's :class:`BufferOwner`, which decides:

* **one at a time**: an operation runs holding the owner's *lane*, so it never
  waits inside the engine for another of this buffer's operations;
* **where it runs**: a small operation (it moves at most ``INLINE_BYTES``)
  runs on the event loop itself when the lane is free, since it takes less
  time than the hop to a worker; every other one runs on the engine pool, and
  a fast-path session runs its operations on its own thread. A small one that
  took longer than ``INLINE_SLOW_S`` on the loop (it waited for the disk: a
  cold page, writeback) sends this buffer's operations to the pool for
  ``INLINE_BACKOFF_S``;
* **what waits**: engine calls only try (``timeout=0``). A call the rate
  limiter holds (:class:`~.waits.WouldWait`) is parked here, on the loop,
  costing no thread, and tried again each time another operation of this
  buffer has completed, until its budget runs out. The owner counts these
  waits: they are the wait statistics of the buffer's ``info()``;
* **acknowledgement**: a reply goes out once its operation returned, so a push
  is acknowledged once stored (durable as the documentation says).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, TypeVar

from millpond.compat import timeout
from millpond.core import BufferInfo, TieredBuffer
from millpond.core.ratelimit import WaitCounts
from millpond.errors import RateLimitTimeoutError

from .waits import WaitingCalls, WouldWait

T = TypeVar("T")
# An operation that moves at most this many bytes may run on the event loop itself
# (see the module docstring).
INLINE_BYTES = 256 << 10
INLINE_SLOW_S = 0.005
INLINE_BACKOFF_S = 1.0
# How often a session thread whose call is parked checks that its client is still there.
HANGUP_POLL_S = 0.2


class BufferOwner:
    """Orders the operations of one served buffer; see the module docstring.

    ``waiting``: the daemon's bounds on parked calls (their number and the
    bytes they hold), shared by every owner. ``observe(buffer, kind, seconds)``
    is told of every wait that ended (the metrics).
    """

    def __init__(self, buffer: TieredBuffer, loop: asyncio.AbstractEventLoop,
                 executor: Executor, waiting: WaitingCalls,
                 observe: Callable[[TieredBuffer, str, float], None] | None = None):
        self.buffer = buffer
        self._loop = loop
        self._executor = executor
        self._waiting = waiting
        self._observe = observe
        self._lane = threading.Lock()  # held by the operation under way
        self._pooled_until = 0.0  # small operations go to the pool until then
        self._parked = 0
        self._completed = asyncio.Event()  # set (and replaced) when an operation completes
        self.waits = WaitCounts()  # of the calls parked here

    # ---- running operations ------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any, small: bool = False,
                  budget: float | None = None, held: int = 0) -> T:
        """``fn(*args)`` in this buffer's order, on the loop if ``small`` and the lane is
        free, else on the pool. While it would wait for the rate limiter, it is parked
        (at most ``budget`` seconds; None: no limit), holding ``held`` bytes (its
        request). ``fn`` uses this buffer only, and no I/O but the buffer's."""
        try:
            return await self._once(fn, args, small)
        except WouldWait as wait:
            return await self._park(wait, budget, fn, args, held)

    def run_here(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this thread (a worker, a fast-path session) in this buffer's
        order: waits for the lane. Raises WouldWait (the caller parks it or not)."""
        with self._lane:
            result = fn(*args)
        if self._parked:
            self._loop.call_soon_threadsafe(self._wake)
        return result

    def run_from_thread(self, budget: float | None, cancelled: Callable[[], bool],
                        fn: Callable[..., T], *args: Any) -> T:
        """:meth:`run` for a thread that serves one client (a fast-path session): the
        first try runs here (no hop); a parked call waits on the loop and ends early once
        ``cancelled()`` (the client hung up)."""
        try:
            return self.run_here(fn, *args)
        except WouldWait as exc:
            wait = exc
        future = asyncio.run_coroutine_threadsafe(self._park(wait, budget, fn, args), self._loop)
        # Not future.result(timeout): its TimeoutError is also the base of the
        # RateLimitTimeoutError the wait may end with.
        while not concurrent.futures.wait([future], HANGUP_POLL_S).done:
            if cancelled():
                future.cancel()
                raise RateLimitTimeoutError(f"{wait.kind} abandoned: its caller went away",
                                            wait.kind, wait.records)
        return future.result()

    async def _once(self, fn: Callable[..., T], args: tuple, small: bool) -> T:
        start = time.monotonic()
        if small and self._pooled_until <= start and self._lane.acquire(blocking=False):
            try:
                result = fn(*args)
            finally:
                self._lane.release()
                if time.monotonic() - start > INLINE_SLOW_S:
                    self._pooled_until = start + INLINE_BACKOFF_S
            self._wake()
            return result
        return await self._loop.run_in_executor(self._executor, self.run_here, fn, *args)

    def _wake(self) -> None:
        """An operation completed (on the loop): parked calls try again."""
        if self._parked:
            self._completed.set()
            self._completed = asyncio.Event()

    # ---- parked calls ---------------------------------------------------------------------

    async def _park(self, wait: WouldWait, budget: float | None, fn: Callable[..., T],
                    args: tuple, held: int = 0) -> T:
        """Try ``fn`` again after each completed operation until it passes or ``budget``
        runs out (RateLimitTimeoutError)."""
        if budget == 0:  # a try-only call: it would have had to wait
            raise _timed_out(wait, 0.0)
        self._waiting.start(held)
        loop = self._loop
        start = loop.time()
        deadline = None if budget is None else start + budget
        self._parked += 1
        self.waits.started(wait.kind)
        try:
            while True:
                completed = self._completed  # before the try: a completion after it sets this
                try:
                    return await self._once(fn, args, small=False)
                except WouldWait as again:
                    wait = again
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise _timed_out(wait, loop.time() - start)
                try:
                    async with timeout(left):
                        await completed.wait()
                except TimeoutError:
                    pass
        finally:
            waited = loop.time() - start
            self._parked -= 1
            self.waits.finished(wait.kind, waited)
            self._waiting.stop(held)
            if self._observe is not None:
                self._observe(self.buffer, wait.kind, waited)

    def with_waits(self, info: BufferInfo) -> BufferInfo:
        """``info`` (the engine's) with the waits parked here added."""
        stats = self.waits.stats()
        return dataclasses.replace(info, **{key: getattr(info, key) + value
                                            for key, value in stats.items()})


def _timed_out(wait: WouldWait, waited: float) -> RateLimitTimeoutError:
    return RateLimitTimeoutError(
        f"{wait.kind} of {wait.records} records waited {waited:.3g} s for the rate limiter "
        f"until its timeout ({wait.state}); pass a longer timeout", wait.kind, wait.records)
