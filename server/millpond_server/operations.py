"""What clients may ask of the server, whatever the transport: one operations layer.

The gRPC service (:mod:`.service`) and the shared-memory fast path
(:mod:`.fastpath`) both decode their requests and call this layer, which
owns the rules they share:

* **errors**: :meth:`Operations.classify` turns any failure into the typed
  error the client gets; a storage I/O error stops the daemon; anything
  unexpected is logged (once, with its traceback) and reported as INTERNAL;
* **roles**: :attr:`Operations.auth` (:mod:`.auth`) says who may call what;
  both transports check it before anything else;
* **readiness**: until the buffers are recovered every call fails with
  :class:`ServerStartingError`, which clients retry;
* **rate limits**: the engine is only ever *tried* (``timeout=0``). A call
  that would wait raises :class:`WouldWait`; :meth:`Operations.admit` then
  waits on the event loop for the buffer's next change and retries, until
  the call's budget (:func:`wait_budget`) runs out. Waiting costs no thread,
  so any number of waiting learners leave other buffers and calls alone. The
  fast path, whose session threads call the engine directly, hands its waits
  to the same loop (:meth:`Operations.admit_from_thread`);
* **where calls run**: engine calls go to a thread pool, except small gRPC
  pushes and samples, which run on the loop when their buffer is free
  (:meth:`Operations.admit_small`): they take less time than the hop. A push
  is answered once stored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import time
import weakref
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from millpond.core import BufferConfig, BufferInfo, TieredBuffer
from millpond.core.episodes import EPISODE_COLUMN
from millpond.errors import (
    InternalError,
    LimitExceededError,
    RateLimitTimeoutError,
    ReplayError,
    ServerStartingError,
    StorageIOError,
)

from millpond.malloc import release_free_memory

from .auth import Auth
from .waits import BufferChanges, WouldWait, try_now
from .fatal import fatal_storage_error
from .registry import Registry

log = logging.getLogger("millpond.operations")
# A call that moves at most this many bytes runs on the event loop itself when
# its buffer is free (see Operations.admit_small): the hop to the engine pool
# and back costs more than such a call. One that took longer than INLINE_SLOW_S
# there (it waited for the disk: a cold page, writeback) sends its buffer's
# calls to the pool for INLINE_BACKOFF_S.
INLINE_BYTES = 256 << 10
INLINE_SLOW_S = 0.005
INLINE_BACKOFF_S = 1.0

T = TypeVar("T")
# How often a thread whose call waits on the loop checks that its client is still there.
HANGUP_POLL_S = 0.2
# Waiting calls that held more than this, once all gone, give their memory back to the OS.
RELEASE_AFTER_BYTES = 64 << 20
RELEASE_DELAY_S = 0.5


class Operations:
    """The server's operations on its registry; see the module docstring."""

    def __init__(self, registry: Registry, executor: Executor, auth: Auth | None = None,
                 max_waiting_calls: int | None = None, max_waiting_bytes: int | None = None):
        self.registry = registry
        self.executor = executor
        # Calls waiting for a rate limiter hold their requests (megabytes of a
        # PushBatch): their number and those bytes are bounded.
        self.max_waiting_calls = max_waiting_calls
        self.max_waiting_bytes = max_waiting_bytes
        self._waiting_calls = 0
        self._waiting_bytes = 0
        self._waiting_peak = 0
        self.auth = Auth() if auth is None else auth  # who may call what (both transports)
        self.ready = False  # set once the buffers are recovered
        # Told of every call and rate-limiter wait (the metrics), or None: see .metrics.
        self.observer: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._changes: weakref.WeakKeyDictionary[TieredBuffer, BufferChanges] = \
            weakref.WeakKeyDictionary()
        # Buffers whose small calls go to the pool until then (admit_small).
        self._pooled_until: weakref.WeakKeyDictionary[TieredBuffer, float] = \
            weakref.WeakKeyDictionary()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the event loop that runs the waits."""
        self.loop = loop

    # ---- errors and readiness ---------------------------------------------------------

    def check_ready(self) -> None:
        if not self.ready:
            raise ServerStartingError("the server is recovering its buffers; retry shortly")

    @staticmethod
    def classify(exc: BaseException, op: str) -> ReplayError:
        """The error a client gets for ``exc``, raised by operation ``op``."""
        if isinstance(exc, StorageIOError):
            fatal_storage_error(exc)
        if isinstance(exc, ReplayError):
            return exc
        log.error("unexpected error", exc_info=exc, extra={"kv": {"op": op}})
        return InternalError(f"internal server error in {op}: {type(exc).__name__}: {exc}")

    # ---- the calls (synchronous; run on the pool or a fast-path session) --------------

    def create(self, name: str, config: BufferConfig,
               may_create: bool = True) -> tuple[BufferInfo, bool]:
        """Create ``name`` or attach to it. With ``may_create=False`` (every role but
        admin) only attach: where a new buffer would be made, PermissionDeniedError
        (decided under the registry's lock for the name, so no race can create one)."""
        buffer, created = self.registry.create(name, config, may_create)
        return self.registry.info(name, buffer), created

    def delete(self, name: str) -> None:
        self.registry.close(name)

    def info(self, name: str) -> BufferInfo:
        return self.registry.info(name)

    def list(self) -> list[BufferInfo]:
        return [self.registry.info(name, buffer) for name, buffer in self.registry.list()]

    def push(self, name: str, record: Mapping[str, Any]) -> tuple[int, int]:
        """Store one record now or raise WouldWait; return ``(size, pushed)`` after it."""
        buffer = self.registry.get(name)
        try_now(buffer, buffer.push, record, timeout=0)
        return len(buffer), buffer.pushed

    def push_batch(self, name: str, columns: Mapping[str, Any], priorities: np.ndarray | None,
                   buffer: TieredBuffer | None = None, updates: Any = None) -> tuple[int, int]:
        """Store a batch now or raise WouldWait; return ``(size, pushed)`` after it.
        ``buffer``: the one named ``name``, if the caller has it already. ``updates``:
        episode updates applied with it."""
        if buffer is None:
            buffer = self.registry.get(name)
        columns = dict(columns)  # an episodic push's ids ride in one more column
        episodes = columns.pop(EPISODE_COLUMN, None)
        try_now(buffer, buffer.push_batch, columns, priorities, episodes=episodes,
                updates=updates, timeout=0)
        return len(buffer), buffer.pushed

    def on_loop(self) -> bool:
        """Whether this runs on the daemon's event loop (else a pool or session thread)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:  # a pool thread, a fast-path session
            return False

    def sample(self, name: str, batch_size: int, seed: int | None,
               out: Mapping[str, np.ndarray] | None = None,
               buffer: TieredBuffer | None = None,
               filter_meta: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Draw a batch now (into ``out`` if given) or raise WouldWait."""
        if buffer is None:
            buffer = self.registry.get(name)
        if filter_meta:
            return try_now(buffer, buffer.sample, batch_size, seed, out, timeout=0,
                           filter_meta=filter_meta)
        return try_now(buffer, buffer.sample, batch_size, seed, out, timeout=0)

    def sample_episodic(self, name: str, op: str, batch_size: int, seed: int | None,
                        filter_meta: Mapping[str, Any] | None, params: Mapping[str, Any],
                        out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """An episodic sample now (``op``: sample_sequences, sample_n_step,
        sample_episodes; ``params``: its own arguments) or raise WouldWait."""
        buffer = self.registry.get(name)
        extra = {} if out is None else {"out": out}
        return try_now(buffer, getattr(buffer, op), batch_size, seed=seed,
                       filter_meta=filter_meta, timeout=0, **params, **extra)

    def update_episodes(self, name: str, updates: Any) -> None:
        self.registry.get(name).update_episodes(updates)

    def episode_catalog(self, name: str, filter_meta: Mapping[str, Any] | None
                        ) -> dict[str, np.ndarray]:
        return self.registry.get(name).episode_catalog(filter_meta)

    def read(self, name: str, seqs: Any, fields: Any, out: Mapping[str, np.ndarray] | None = None,
             positions: bool = False, episode_ids: bool = False) -> dict[str, np.ndarray]:
        return self.registry.get(name).read(seqs, fields, positions=positions,
                                            episode_ids=episode_ids, out=out)

    def reset(self, name: str) -> None:
        self.registry.get(name).reset()

    def update_priorities(self, name: str, indices: Any, priorities: Any) -> int:
        return self.registry.get(name).update_priorities(indices, priorities)

    def set_beta(self, name: str, beta: float) -> None:
        self.registry.get(name).set_beta(beta)

    # ---- running them ------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine pool (never blocks the loop)."""
        assert self.loop is not None
        return await self.loop.run_in_executor(self.executor, fn, *args)

    async def admit(self, budget: float | None, fn: Callable[..., T], *args: Any,
                    held: int = 0) -> T:
        """``fn(*args)`` on the pool; while it would wait, wait here (at most ``budget`` s).

        ``held``: bytes the call keeps while it waits (its request), counted
        against ``max_waiting_bytes``.
        """
        try:
            return await self.run(fn, *args)
        except WouldWait as wait:
            return await self._wait_and_retry(wait, budget, fn, args, held)

    async def admit_small(self, buffer: TieredBuffer, budget: float | None,
                          fn: Callable[..., T], *args: Any, held: int = 0) -> T:
        """:meth:`admit` for a call on ``buffer`` that moves at most INLINE_BYTES.

        If no other thread holds the buffer's lock, the call runs here, on
        the loop, holding it: its engine calls then never wait for another
        thread (the lock is re-entrant). Else it goes to the pool, as would a
        wait. ``fn`` must use no other buffer, and do no I/O but the buffer's.
        """
        start = time.monotonic()
        lock = buffer._lock  # re-entrant, for this
        if self._pooled_until.get(buffer, 0.0) > start or not lock.acquire(blocking=False):
            return await self.admit(budget, fn, *args, held=held)
        try:
            return fn(*args)
        except WouldWait as exc:
            wait = exc
        finally:
            lock.release()
            self.ran_on_loop(buffer, start)
        return await self._wait_and_retry(wait, budget, fn, args, held)

    def ran_on_loop(self, buffer: TieredBuffer, start: float) -> None:
        """Work on ``buffer`` ran on the loop since ``start``: if that took over INLINE_SLOW_S
        (it waited for the disk), the buffer's calls go to the pool for INLINE_BACKOFF_S."""
        if time.monotonic() - start > INLINE_SLOW_S:
            self._pooled_until[buffer] = start + INLINE_BACKOFF_S

    def admit_from_thread(self, budget: float | None, cancelled: Callable[[], bool],
                          fn: Callable[..., T], *args: Any) -> T:
        """:meth:`admit` for a thread that serves one client (a fast-path session).

        The first try runs on this thread (no hop to the pool); a wait runs
        on the loop, and ends early once ``cancelled()`` (the client hung up).
        """
        try:
            return fn(*args)
        except WouldWait as exc:
            wait = exc
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(
            self._wait_and_retry(wait, budget, fn, args), self.loop)
        # Not future.result(timeout): its TimeoutError is also the base of the
        # RateLimitTimeoutError the wait may end with.
        while not concurrent.futures.wait([future], HANGUP_POLL_S).done:
            if cancelled():
                future.cancel()
                raise RateLimitTimeoutError(f"{wait.kind} abandoned: its caller went away",
                                            wait.kind, wait.records)
        return future.result()

    async def _wait_and_retry(self, wait: WouldWait, budget: float | None,
                              fn: Callable[..., T], args: tuple, held: int = 0) -> T:
        """Retry ``fn`` each time its buffer changes, until it passes or ``budget`` runs out."""
        start = asyncio.get_running_loop().time()
        if budget == 0:  # a try-only call: it would have had to wait
            raise self._timed_out(wait, 0.0)
        self._start_waiting(held)
        try:
            return await self._retry_on_changes(wait, budget, fn, args, start)
        finally:
            self._stop_waiting(held)

    def _start_waiting(self, held: int) -> None:
        """Count a waiting call (on the loop), or refuse it past the limits."""
        if self.max_waiting_calls is not None and self._waiting_calls >= self.max_waiting_calls:
            raise LimitExceededError(
                f"{self._waiting_calls} calls already wait for rate limiters, the server's limit "
                "(--max-waiting-calls); retry later")
        if (self.max_waiting_bytes is not None
                and self._waiting_bytes + held > self.max_waiting_bytes):
            raise LimitExceededError(
                f"calls waiting for rate limiters already hold {self._waiting_bytes:,} bytes; "
                f"{held:,} more would pass the server's limit (--max-waiting-mb)")
        self._waiting_calls += 1
        self._waiting_bytes += held
        self._waiting_peak = max(self._waiting_peak, self._waiting_bytes)

    def _stop_waiting(self, held: int) -> None:
        self._waiting_calls -= 1
        self._waiting_bytes -= held
        if self._waiting_bytes == 0 and self._waiting_peak > RELEASE_AFTER_BYTES:
            # malloc keeps large freed blocks for reuse: give them back once the
            # calls are over and their requests freed (not yet: they are in scope).
            self._waiting_peak = 0
            assert self.loop is not None
            self.loop.call_later(RELEASE_DELAY_S, self._release_if_idle)

    def _release_if_idle(self) -> None:
        if self._waiting_bytes == 0:
            # A call that timed out raised in frames that hold its request: the
            # cycle (exception, traceback, frame) waits for the cyclic collector,
            # which an idle server may not run for a long while.
            gc.collect()
            release_free_memory()

    async def _retry_on_changes(self, wait: WouldWait, budget: float | None,
                                fn: Callable[..., T], args: tuple, start: float) -> T:
        loop = asyncio.get_running_loop()
        buffer = wait.buffer
        changes = self._changes.get(buffer)
        if changes is None:
            changes = self._changes[buffer] = BufferChanges(loop, buffer)
        deadline = None if budget is None else start + budget
        changes.waiting += 1
        buffer.wait_started(wait.kind)
        try:
            while True:
                event = changes.event  # before the check: a change after it sets this one
                if not buffer.would_wait(wait.kind, wait.records):
                    try:
                        return await self.run(fn, *args)
                    except WouldWait:
                        pass
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise self._timed_out(wait, loop.time() - start)
                try:
                    await asyncio.wait_for(event.wait(), left)
                except TimeoutError:
                    pass
        finally:
            changes.waiting -= 1
            waited = loop.time() - start
            buffer.wait_ended(wait.kind, waited)
            if self.observer is not None:
                self.observer.wait(buffer, wait.kind, waited)

    @staticmethod
    def _timed_out(wait: WouldWait, waited: float) -> RateLimitTimeoutError:
        return RateLimitTimeoutError(
            f"{wait.kind} of {wait.records} records waited {waited:.3g} s for the rate limiter "
            f"until its timeout ({wait.buffer.describe_rate()}); pass a longer timeout",
            wait.kind, wait.records)
