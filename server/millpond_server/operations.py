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
* **order**: every operation on a buffer goes through the buffer's owner
  (:meth:`Operations.owner`, :mod:`.owner`), which decides where it runs and
  parks what the rate limiter holds. The operations here only *try* the engine
  (``timeout=0``): one that would wait raises :class:`~.waits.WouldWait`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from millpond.core import BufferConfig, BufferInfo, TieredBuffer
from millpond.core.episodes import EPISODE_COLUMN
from millpond.core.stored import StoredBatch
from millpond.errors import InternalError, ReplayError, ServerStartingError, StorageIOError

from .auth import Auth
from .backups import BackupDir
from .fatal import fatal_storage_error
from .owner import BufferOwner
from .registry import Registry
from .waits import WaitingCalls, try_now

log = logging.getLogger("millpond.operations")
T = TypeVar("T")


class Operations:
    """The server's operations on its registry; see the module docstring."""

    def __init__(self, registry: Registry, executor: Executor, auth: Auth | None = None,
                 max_waiting_calls: int | None = None, max_waiting_bytes: int | None = None):
        self.registry = registry
        self.executor = executor
        # Calls parked for a rate limiter hold their requests (megabytes of a
        # PushBatch): their number and those bytes are bounded, over all buffers.
        self.waiting = WaitingCalls(max_waiting_calls, max_waiting_bytes)
        self.auth = Auth() if auth is None else auth  # who may call what (both transports)
        self.ready = False  # set once the buffers are recovered
        # Told of every call and rate-limiter wait (the metrics), or None: see .metrics.
        self.observer: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        # Where checkpoints go (--backup-dir; the app sets it): none, they are refused.
        self.backups = BackupDir(None, registry.data_dir)
        self._owners: weakref.WeakKeyDictionary[TieredBuffer, BufferOwner] = \
            weakref.WeakKeyDictionary()
        self._owners_lock = threading.Lock()  # owners are made on the loop and on sessions

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the event loop that runs the owners' waits."""
        self.loop = loop

    def owner(self, buffer: TieredBuffer) -> BufferOwner:
        """The owner of ``buffer`` (made on first use), through which every operation
        on it runs."""
        owner = self._owners.get(buffer)
        if owner is None:
            with self._owners_lock:
                owner = self._owners.get(buffer)
                if owner is None:
                    assert self.loop is not None
                    owner = self._owners[buffer] = BufferOwner(
                        buffer, self.loop, self.executor, self.waiting, self._observe_wait)
        return owner

    def _observe_wait(self, buffer: TieredBuffer, kind: str, seconds: float) -> None:
        if self.observer is not None:
            self.observer.wait(buffer, kind, seconds)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine pool: calls on no one buffer (create, list, info)
        and the decoding of large requests (never on the loop)."""
        assert self.loop is not None
        return await self.loop.run_in_executor(self.executor, fn, *args)

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

    # ---- the calls (synchronous: each runs through its buffer's owner) ------------------

    def create(self, name: str, config: BufferConfig,
               may_create: bool = True) -> tuple[BufferInfo, bool]:
        """Create ``name`` or attach to it. With ``may_create=False`` (every role but
        admin) only attach: where a new buffer would be made, PermissionDeniedError
        (decided under the registry's lock for the name, so no race can create one)."""
        buffer, created = self.registry.create(name, config, may_create)
        return self.info(name, buffer), created

    def delete(self, name: str) -> None:
        self.registry.close(name)

    def info(self, name: str, buffer: TieredBuffer | None = None,
             include_unavailable: bool = False) -> BufferInfo:
        """The registry's info of ``name`` with the waits its owner parked. A buffer held
        out of service: its state and reason with ``include_unavailable``, else
        BufferDamagedError."""
        if buffer is None and include_unavailable:
            held = self.registry.held(name)
            if held is not None:
                return self.registry.held_info(held)
        buffer = self.registry.get(name) if buffer is None else buffer
        info = self.registry.info(name, buffer)
        owner = self._owners.get(buffer)
        return info if owner is None else owner.with_waits(info)

    def list(self, include_unavailable: bool = False) -> list[BufferInfo]:
        """The buffers served, by name; with ``include_unavailable`` those held out of
        service too (their state and reason)."""
        infos = [self.info(name, buffer) for name, buffer in self.registry.list()]
        if include_unavailable:
            infos += [self.registry.held_info(held) for held in self.registry.held_list()]
            infos.sort(key=lambda info: info.name or "")
        return infos

    def repair(self, name: str) -> tuple[BufferInfo, int, bool]:
        """Serve a buffer held out of service again (see :meth:`.registry.Registry.repair`):
        ``(info, records dropped, repaired)``."""
        return self.registry.repair(name)

    def push(self, buffer: TieredBuffer, record: Mapping[str, Any]) -> tuple[int, int]:
        """Store one record now or raise WouldWait; return ``(size, pushed)`` after it."""
        try_now(buffer.push, record)
        return len(buffer), buffer.pushed

    def push_batch(self, buffer: TieredBuffer, columns: Mapping[str, Any],
                   priorities: np.ndarray | None, updates: Any = None) -> tuple[int, int]:
        """Store a batch now or raise WouldWait; return ``(size, pushed)`` after it.
        ``updates``: episode updates applied with it."""
        columns = dict(columns)  # an episodic push's ids ride in one more column
        episodes = columns.pop(EPISODE_COLUMN, None)
        try_now(buffer.push_batch, columns, priorities, episodes=episodes, updates=updates)
        return len(buffer), buffer.pushed

    def sample(self, buffer: TieredBuffer, batch_size: int, seed: int | None,
               out: Mapping[str, np.ndarray] | None = None,
               filter_meta: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """Draw a batch now (into ``out`` if given) or raise WouldWait."""
        if filter_meta:
            return try_now(buffer.sample, batch_size, seed, out, filter_meta=filter_meta)
        return try_now(buffer.sample, batch_size, seed, out)

    def sample_episodic(self, buffer: TieredBuffer, op: str, batch_size: int, seed: int | None,
                        filter_meta: Mapping[str, Any] | None, params: Mapping[str, Any],
                        out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """An episodic sample now (``op``: sample_sequences, sample_n_step,
        sample_episodes; ``params``: its own arguments) or raise WouldWait."""
        extra = {} if out is None else {"out": out}
        return try_now(getattr(buffer, op), batch_size, seed=seed, filter_meta=filter_meta,
                       **params, **extra)

    def sample_stored(self, buffer: TieredBuffer, op: str, batch_size: int, seed: int | None,
                      filter_meta: Mapping[str, Any] | None, params: Mapping[str, Any]
                      ) -> StoredBatch:
        """``op`` (sample, sample_n_step, sample_sequences) now, in the stored form
        (:meth:`TieredBuffer.sample_stored`), or raise WouldWait."""
        return try_now(buffer.sample_stored, batch_size, seed, filter_meta=filter_meta or None,
                       **params)

    @staticmethod
    def read(buffer: TieredBuffer, seqs: Any, fields: Any,
             out: Mapping[str, np.ndarray] | None = None, positions: bool = False,
             episode_ids: bool = False) -> dict[str, np.ndarray]:
        return buffer.read(seqs, fields, positions=positions, episode_ids=episode_ids, out=out)
