"""The writes every client-side backend shares (one server, or many shards).

:class:`QueuedWrites` validates pushes as the engine does, queues single
records in a :class:`~millpond.remote.batcher.PushBatcher` and hands every batch to
the backend's ``_send``; it also owns the handle's open/closed state. A
backend (:class:`~millpond.remote.buffer.RemoteBuffer`,
:class:`~millpond.sharded.buffer.ShardedBuffer`) provides ``_send`` (where a
batch goes) and ``delete``.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import numpy as np

from millpond.core.checks import check_priorities, check_timeout
from millpond.core.config import BufferConfig
from millpond.core.episode_checks import check_push_episodes, check_updates
from millpond.core.episodes import EPISODE_COLUMN, with_episode_column
from millpond.core.schema import Schema
from millpond.errors import BufferClosedError, InvalidArgumentError, ReadOnlyBufferError
from millpond.remote.batcher import PushBatcher
from millpond.remote.grpc_transport import FRAMING_BYTES


class QueuedWrites:
    """``push`` (queued), ``push_batch``, ``flush`` and the handle's lifecycle.

    A pushed record is acknowledged only when flushed (by count, by age, by
    ``flush()``, ``close()`` or interpreter exit); ``owner``: this handle's
    create made the buffer, so :meth:`close` deletes it.
    """

    config: BufferConfig
    schema: Schema
    name: str
    owner: bool
    _client: Any  # push_batch_size, push_max_delay, max_message_bytes
    read_only: bool = False  # a dataset the daemon serves read-only (its info says so)
    _closed: bool = False
    _batcher: PushBatcher | None = None

    def _send(self, n: int, batch: dict[str, np.ndarray], priorities: np.ndarray | None,
              timeout: float | None, episodes: np.ndarray | None = None,
              updates: list | None = None) -> None:
        raise NotImplementedError  # the backend's

    def delete(self) -> None:
        raise NotImplementedError  # the backend's

    @functools.cached_property
    def _push_schema(self) -> Schema:
        """Pushes of an episodic buffer carry each record's episode id in one more column."""
        return with_episode_column(self.schema) if self.config.episodes else self.schema

    def push(self, record: Mapping[str, Any], priority: float | None = None, *,
             episode: int | None = None, updates: Any = None,
             timeout: float | None = None) -> None:
        """Queue one record for the next batch (validated now); see the class docstring.

        A record with an explicit ``priority`` (prioritized buffers),
        ``timeout`` (rate-limited buffers) or episode ``updates`` is sent at
        once, after what is queued. ``episode``: its episode's id (episodic
        buffers).
        """
        self._check_writable("push")
        timeout = check_timeout(timeout)
        ids = check_push_episodes(self.config, episode, 1)
        checked = check_updates(self.config, updates) if updates else None
        limit = self._client.push_batch_size
        if priority is not None or timeout is not None or checked or limit <= 1:  # sent now
            prios, batch = checked_record(self.config, record, priority)
            self._flush_queued()
            self._send(1, batch, prios, timeout, ids, checked)
            return
        if self._batcher is None:
            fits = max(1, (self._client.max_message_bytes - FRAMING_BYTES)
                       // self._push_schema.record_nbytes)
            self._batcher = PushBatcher(self._push_schema, self._send_batch, min(limit, fits),
                                        self._client.push_max_delay)
        self._batcher.add(record if ids is None else {**record, EPISODE_COLUMN: ids[0]})

    def push_batch(self, columns: Mapping[str, Any], priorities: Any = None, *,
                   episodes: Any = None, updates: Any = None,
                   timeout: float | None = None) -> int:
        """Store a batch (validated locally first, after queued pushes); returns its length.

        ``priorities``: one per record, for prioritized buffers. ``episodes``:
        one id per record, and ``updates`` applied with them, for episodic
        buffers (see the engine's ``push_batch``). Over gRPC a batch larger
        than the message limit is refused before sending
        (:class:`MessageTooLargeError`); split it, nothing was stored.
        ``timeout``: seconds the push may wait for the buffer's rate limiter
        (None: the client's timeout).
        """
        self._check_writable("push_batch")
        push = checked_push(self.config, columns, priorities, episodes, updates, timeout)
        self._flush_queued()
        self._send(*push)
        return push.n

    def flush(self) -> None:
        """Return once every record queued by ``push`` is stored."""
        self._flush_queued()

    def _flush_queued(self) -> None:
        """Send the records queued by ``push`` (before a push sent at once: in order)."""
        if self._batcher is not None:
            self._batcher.flush()

    def _send_batch(self, columns: dict[str, np.ndarray]) -> None:
        """The batcher's send (its columns are views it reuses: sending copies them)."""
        ids = columns.pop(EPISODE_COLUMN, None)
        self._send(len(next(iter(columns.values()))), columns, None, None, ids)

    def _check_priorities_allowed(self, priorities: Any) -> None:
        check_priorities_allowed(self.config, priorities)

    # ---- lifecycle ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Flush; then delete the buffer if this handle created it, else release. Idempotent."""
        if self.owner:
            self.delete()
        else:
            self.release()

    def release(self) -> None:
        """Flush queued pushes and stop using this handle; the buffer stays. Idempotent."""
        if not self._closed:
            try:
                if self._batcher is not None:
                    self._batcher.close()
            finally:
                self._closed = True

    def _check_writable(self, what: str) -> None:
        """Open, and not a read-only dataset: checked before a write's arguments, since
        that no write is taken is what is wrong first (the daemon would refuse it too)."""
        self._check_open()
        if self.read_only:
            raise ReadOnlyBufferError(f"{what} to {self.name!r}: it is a dataset the server "
                                      "serves read-only; nothing was written")

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError(f"buffer {self.name!r} was closed")


class CheckedPush(NamedTuple):
    """A push's arguments, validated and coerced as the engine will take them (the
    arguments of a backend's ``_send``, in its order)."""

    n: int
    batch: dict[str, np.ndarray]
    priorities: np.ndarray | None
    timeout: float | None
    episodes: np.ndarray | None
    updates: list | None


def checked_push(config: BufferConfig, columns: Mapping[str, Any], priorities: Any,
                 episodes: Any, updates: Any, timeout: Any) -> CheckedPush:
    """The arguments of a ``push_batch`` of ``columns`` (bound to field names), checked
    as :meth:`QueuedWrites.push_batch` and millpond.aio's push check them: the whole
    batch before any of it is sent."""
    timeout = check_timeout(timeout)
    n, batch = config.schema.coerce_batch(columns)
    ids = check_push_episodes(config, episodes, n)
    checked = check_updates(config, updates) if updates else None
    check_priorities_allowed(config, priorities)
    prios = None if priorities is None else check_priorities(priorities, n)
    return CheckedPush(n, batch, prios, timeout, ids, checked)


def checked_record(config: BufferConfig, record: Mapping[str, Any], priority: Any
                   ) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """``(priorities, batch)`` of a ``push`` of one ``record`` sent at once (not queued),
    checked: its ``priority`` (prioritized buffers only), then the record."""
    check_priorities_allowed(config, priority)
    prios = None if priority is None else check_priorities([priority], 1)
    return prios, config.schema.coerce_record(record)


def check_priorities_allowed(config: BufferConfig, priorities: Any) -> None:
    """InvalidArgumentError if ``priorities`` are given to a uniform buffer."""
    if priorities is not None and config.prioritized is None:
        raise InvalidArgumentError("priorities are for prioritized buffers; this one is uniform")
