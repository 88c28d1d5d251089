"""The remote backend: a buffer that lives on a millpond server.

:class:`RemoteBuffer` has the methods of the engine's
:class:`~millpond.core.TieredBuffer`, so the public handles
(:mod:`millpond.handle.buffer`) wrap either one. The handle checks the
arguments of every call once, before it reaches a backend (bad input fails
before it costs a round trip, with the engine's exception); writes are
validated here, as they are encoded (:mod:`millpond.remote.writes`); the
server checks everything again, trusting nothing.
Bulk calls go through the connection's transport seam
(:meth:`~millpond.remote.connection.Connection.call`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from millpond.core.config import BufferConfig, ConfigAccessors
from millpond.core.episode_checks import (
    check_updates,
)
from millpond.core.episodes import EPISODE_COLUMN
from millpond.core.info import BufferInfo
from millpond.core.snapshot import CheckpointResult
from millpond.errors import BufferNotFoundError
from millpond.remote.grpc_transport import FRAMING_BYTES
from millpond.remote.writes import QueuedWrites

if TYPE_CHECKING:
    from millpond.client import Client
    from millpond.remote.connection import Connection
    from millpond.remote.push_window import PushWindow
    from millpond.sharded.buffer import ShardedBuffer


class RemoteBuffer(QueuedWrites, ConfigAccessors):
    """A handle on the server buffer ``name``. Picklable; safe after fork.

    Single-record ``push`` calls are batched on the client (see
    :class:`~millpond.remote.batcher.PushBatcher`; ``connect(push_batch_size=,
    push_max_delay=)``): **a pushed record is acknowledged only when flushed**
    (by count, by age, by ``flush()``, ``close()`` or interpreter exit).
    Every other call on this handle flushes first, so it sees its own pushes.

    ``owner``: this handle's Create made the buffer, so :meth:`close`
    deletes it (as closing an in-process buffer does). A handle that
    attached to an existing buffer only releases itself on :meth:`close`;
    :meth:`delete` deletes in either case. A pickled handle never owns.
    """

    def __init__(self, client: "Client", name: str, config: BufferConfig, owner: bool = False,
                 windowed: bool = True, read_only: bool = False, pending: bool = False,
                 may_own: bool = True):
        self._client = client
        self.name = name
        self.config = config
        self.owner = owner
        self.read_only = read_only  # a dataset: writes refused here, before their checks
        # Pending: the buffer did not exist when this handle was made, and the handle
        # creates it (with ``config``) on its first write; a read before that attaches if
        # it exists by then, else raises BufferNotFoundError (see Client.remote_buffer).
        self.pending = pending
        self._may_own = may_own  # a handle made by unpickling never owns what it creates
        self._pending_lock = threading.Lock()
        self._may_wait = config.rate_limiter is not None  # (queues and stacks have one)
        # A window of pushes in flight, and the connection it is on; see _push_window.
        self._window: tuple[Connection, PushWindow] | None = None
        self._windowed = windowed

    @property
    def client(self) -> Any:
        """The client this buffer's calls go through."""
        return self._client

    def __reduce__(self) -> tuple[Any, tuple]:  # pending records stay with this handle, never in a pickle
        return (RemoteBuffer, (self._client, self.name, self.config, False, True,
                               self.read_only, self.pending, False))

    def __len__(self) -> int:
        return self.info().size

    def info(self) -> BufferInfo:
        self._check_attached()
        self.flush()
        return self._client.connection.grpc.info(self.name, self._client.timeout)

    def _check_attached(self) -> None:
        """Open, and attached: a pending handle (see ``pending``) attaches to the buffer if
        it exists by now, else raises BufferNotFoundError naming the buffers of close
        names: a read never creates a buffer."""
        self._check_open()
        if self.pending:  # (records queued by push() are this handle's first write)
            self._settle(create=self._batcher is not None)

    def _settle(self, create: bool) -> None:
        """End the pending state: Create the buffer (``create``: the first write), or
        attach to it if it exists now (Create finds it: the server checks the config)."""
        with self._pending_lock:
            if not self.pending:
                return
            grpc = self._client.connection.grpc
            if not create:
                try:
                    grpc.info(self.name, self._client.timeout)
                except BufferNotFoundError:
                    raise self._client.missing_buffer(self.name, lazy=True) from None
            info, created = grpc.create(self.name, self.config, self._client.timeout)
            self.owner = created and self._may_own
            self.read_only = info.read_only
            self.pending = False

    # ---- writes ---------------------------------------------------------------

    def _send(self, n: int, batch: dict[str, np.ndarray], priorities: np.ndarray | None,
              timeout: float | None, episodes: np.ndarray | None = None,
              updates: list | None = None) -> None:
        """Push ``batch`` to the server (the writes' one way out)."""
        if self.pending:
            self._settle(create=True)
        if priorities is not None and not len(priorities):
            priorities = None  # no priorities and an empty list are the same push
        schema = self.schema
        if episodes is not None:
            batch, schema = {**batch, EPISODE_COLUMN: episodes}, self._push_schema
        wait, deadline = self._client.budget(timeout, self._may_wait)
        connection = self._client.connection
        window = self._push_window(connection)
        capacity = self.config.total_capacity  # (the reply's size is checked against it)
        if window is not None:
            connection.grpc.push_batch(self.name, schema, n, batch, priorities, wait, deadline,
                                       updates, capacity, window)
        else:
            connection.call("push_batch", self.name, schema, n, batch, priorities, wait,
                            deadline, updates, capacity)

    def _push_window(self, connection: Connection) -> PushWindow | None:
        """This handle's window of pushes in flight on ``connection``, if it has one
        (``connect(max_in_flight=)`` over gRPC; a fork's child opens its own)."""
        size = self._client.max_in_flight
        if size <= 1 or not self._windowed or connection.transport != "grpc":
            return None
        window = self._window
        if window is None or window[0] is not connection:
            window = self._window = (connection, connection.grpc.push_window(
                size, ordered=self.config.mode != "stack"))  # (a stack's pops lower pushed)
        return window[1]

    def flush(self) -> None:
        """Return once every push of this handle is acknowledged: records queued by
        ``push`` and pushes in flight (``connect(max_in_flight=)``). Raises the first
        that failed."""
        super().flush()
        if self._window is not None:
            self._window[1].flush()

    def update_episodes(self, updates: Any) -> None:
        """Apply ``(episode id, meta, end)`` updates, after the pushes queued before."""
        self._check_writable("update_episodes")
        self._check_attached()
        checked = check_updates(self.config, updates)
        self.flush()
        self._client.connection.grpc.update_episodes(self.name, self.config, checked,
                                                     self._client.timeout)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """New priorities for sampled records; returns how many were still live."""
        self._check_writable("update_priorities")
        self._check_attached()
        self._check_priorities_allowed(True)
        self.flush()
        return self._client.connection.call("update_priorities", self.name, indices, priorities,
                                            self._client.timeout)

    def set_beta(self, beta: float) -> None:
        self._check_attached()
        self._check_priorities_allowed(True)
        self.flush()
        self._client.connection.call("set_beta", self.name, beta, self._client.timeout)

    # ---- reads ----------------------------------------------------------------

    def sample(self, batch_size: int, seed: int | None = None, *,
               timeout: float | None = None, filter_meta: Mapping[str, Any] | None = None
               ) -> dict[str, np.ndarray]:
        """Sample on the server; returns writable arrays like the in-process buffer.

        ``timeout``: as for :meth:`push_batch`. ``filter_meta``: episodic buffers.

        A sample that consumes records (queue, stack, ``max_times_sampled``) consumes
        them only when the server sends the reply. A reply larger than the server's
        --max-message-mb or this client's ``max_message_mb`` (or, over shared memory,
        than its result segment) is MessageTooLargeError, and nothing is drawn. Sent is
        not received: if the call fails after the draw (the deadline passes, the
        connection breaks), the records are consumed and delivered to no one (see
        docs/concepts.md, "Samples that consume records, remotely").
        """
        self._check_attached()
        wait, deadline = self._client.budget(timeout, self._may_wait)
        self.flush()
        return self._client.connection.call(
            "sample", self.name, self.schema, batch_size, seed,
            self.config.prioritized is not None, wait, deadline, filter_meta or None)

    def sample_n_step(self, batch_size: int, n_step: int, gamma: float = 0.99,
                      seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                      timeout: float | None = None) -> dict[str, np.ndarray]:
        """n-step transitions, drawn on the server (see the engine's ``sample_n_step``)."""
        self._check_attached()
        return self._episodic("sample_n_step", batch_size, timeout, filter_meta,
                              n_step=n_step, gamma=gamma, seed=seed)

    def sample_sequences(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                         filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None) -> dict[str, np.ndarray]:
        """Windows of episodes, drawn on the server (see the engine's ``sample_sequences``)."""
        self._check_attached()
        return self._episodic("sample_sequences", batch_size, timeout, filter_meta,
                              seq_len=seq_len, seed=seed)

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> dict[str, np.ndarray]:
        """Complete episodes, drawn on the server. Over gRPC whatever the transport:
        their size is known only once drawn."""
        self._check_attached()
        return self._episodic("sample_episodes", batch_size, timeout, filter_meta,
                              max_len=max_len, seed=seed)

    def _episodic(self, op: str, batch_size: int, timeout: float | None,
                  filter_meta: Mapping[str, Any] | None, **params: Any) -> dict[str, np.ndarray]:
        wait, deadline = self._client.budget(timeout, self._may_wait)
        self.flush()
        connection = self._client.connection
        call = connection.grpc_call if op == "sample_episodes" else connection.call
        return call(op, self.name, self.config, batch_size, filter_meta or None, params, wait,
                    deadline)

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                        ) -> dict[str, np.ndarray]:
        """The complete live episodes (see the engine's ``episode_catalog``), over gRPC."""
        self._check_attached()
        self.flush()
        return self._client.connection.grpc_call("episode_catalog", self.name, self.config,
                                                 filter_meta or None, self._client.timeout)

    def read(self, seqs: Any, fields: Any = None, *, positions: bool = False,
             episode_ids: bool = False) -> dict[str, np.ndarray]:
        """Records by index or position, and ``live`` (see the engine's ``read``)."""
        self._check_attached()
        self.flush()
        return self._client.connection.call("read", self.name, self.config, seqs, fields,
                                            self._client.timeout, positions, episode_ids)

    def contents(self, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Every record, oldest first, in reads of at most :meth:`read_chunk` records
        (each read one state of the buffer: see :func:`read_all`)."""
        return read_all(self, fields)

    def read_chunk(self, record_nbytes: int) -> int:
        """Records of ``record_nbytes`` each that one read's reply may carry (the client's
        message limit; the server's may be lower: then it says MessageTooLargeError)."""
        return read_chunk(self._client.max_message_bytes, record_nbytes)

    def checkpoint(self, path: str | os.PathLike, *,
                   progress: Callable[[int, int], None] | None = None,
                   timeout: float | None = None) -> CheckpointResult:
        """Flush this handle's pushes, then have the daemon write a snapshot of the buffer
        to ``path`` under its --backup-dir (see :meth:`millpond.Client.checkpoint`)."""
        self._check_attached()
        self.flush()
        return self._client.connection.grpc.checkpoint(self.name, os.fspath(path), timeout,
                                                       progress)

    def reset(self) -> None:
        """Drop every record on the server, after the pushes queued before (see the
        engine's ``reset``). Over gRPC: it moves no data."""
        self._check_attached()
        self.flush()
        self._client.connection.grpc.reset(self.name, self._client.timeout)

    # ---- lifecycle ------------------------------------------------------------

    def release(self) -> None:
        """Flush queued pushes and pushes in flight, and stop using this handle; the
        buffer stays. Idempotent."""
        if self._closed:
            return
        try:
            super().release()
        finally:
            if self._window is not None:
                self._window[1].close()

    def delete(self) -> None:
        """Flush queued pushes, then delete the buffer on the server. Idempotent."""
        if self._closed:
            return
        if self._batcher is not None:
            self._batcher.close()
        if self._window is not None:
            self._window[1].close()
        try:
            self._client.connection.grpc.delete(self.name, self._client.timeout)
        except BufferNotFoundError:
            pass  # deleted already: the result this call wants
        self._closed = True


def read_all(backend: "RemoteBuffer | ShardedBuffer", fields: Sequence[str] | None
             ) -> dict[str, np.ndarray]:
    """Every record of a remote or sharded ``backend``, oldest first: the positions
    ``range(len)`` as ``len`` is now, in reads of at most what one reply may carry, each
    resolved by the daemon under the buffer's lock. With pushes going on meanwhile,
    records evicted between two reads shift the positions of the next one."""
    contents = Contents(backend.config, fields, len(backend), backend.read_chunk)
    for positions in contents.reads():
        contents.add(backend.read(positions, contents.names, positions=True))
    return contents.result()


def read_chunk(max_message_bytes: int, record_nbytes: int) -> int:
    """Records of ``record_nbytes`` each that one read's reply may carry, under a client's
    message limit of ``max_message_bytes``."""
    return max(1, (max_message_bytes - FRAMING_BYTES) // max(1, record_nbytes))


class Contents:
    """Every record of a buffer of ``n`` records, read in reads of at most ``chunk(record
    bytes)`` records each: the positions of each read (:meth:`reads`), then each read's
    reply (:meth:`add`, in order) make the :meth:`result`. Shared by :func:`read_all` and
    millpond.aio's ``sample_all``, whose reads are awaited."""

    def __init__(self, config: BufferConfig, fields: Sequence[str] | None, n: int,
                 chunk: Callable[[int], int]):
        self.config = config
        self.names = list(fields) if fields is not None else None  # (checked by the handle)
        self.n = n
        schema = config.schema
        self.step = chunk(sum(schema[name].nbytes for name in self.names or schema.names) + 1)
        self._out: dict[str, np.ndarray] | None = None
        self._start = 0

    def reads(self) -> Iterator[np.ndarray]:
        """The positions each read asks for."""
        for start in range(0, self.n, self.step):
            yield np.arange(start, min(self.n, start + self.step))

    def add(self, batch: dict[str, np.ndarray]) -> None:
        """The reply to the next read (its ``live`` column is dropped: every position
        names a live record)."""
        del batch["live"]
        if self.step >= self.n:  # one reply: its arrays as they came
            self._out = batch
            return
        n, start = self.n, self._start
        if self._out is None:
            self._out = {k: np.empty((n, *v.shape[1:]), v.dtype) for k, v in batch.items()}
        rows = len(next(iter(batch.values())))
        for name, column in batch.items():
            self._out[name][start:start + rows] = column
        self._start = start + self.step

    def result(self) -> dict[str, np.ndarray]:
        if self._out is None:  # empty
            schema = self.config.schema
            return {name: np.empty((0, *schema[name].shape), schema[name].dtype)
                    for name in self.names or schema.names}
        return self._out
