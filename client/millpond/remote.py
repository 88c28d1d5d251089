"""The remote backend: a buffer that lives on a millpond server.

:class:`RemoteBuffer` has the same methods as the engine's
:class:`~millpond.core.TieredBuffer`, so the public classes in
:mod:`millpond.api` wrap either one. Input is validated here with the same
schema code the engine uses (so bad input fails before it costs a round trip,
with the same exception), and again by the server, which trusts nothing.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

import grpc
import numpy as np

from .batching import PushBatcher
from .core.buffer import check_batch_size, check_seed, check_timeout
from .core.prioritized import check_priorities
from .core.schema import Schema
from .errors import (
    BufferClosedError,
    BufferNotFoundError,
    MessageTooLargeError,
    SharedMemoryError,
)
from .shm.session import ResultPoolExhausted
from .v1 import replay_pb2 as pb
from .wire.frames import (
    PUSH_BATCH_FIELD,
    SAMPLE_BATCH_FIELD,
    decode_batch_field,
    encode_with_batch,
)
from .wire.codec import decode_sampling
from .wire.status import error_from_rpc

if TYPE_CHECKING:
    from .client import Client

T = TypeVar("T")
log = logging.getLogger("millpond.client")

# Protobuf framing per column (name, dtype, shape, length prefixes) is tiny;
# this margin keeps size checks honest without computing it exactly.
_FRAMING_BYTES = 64 * 1024


def translate_rpc_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Re-raise failed gRPC calls as the typed millpond exception."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    return wrapper


def info_to_dict(info: pb.BufferInfo) -> dict[str, Any]:
    """A BufferInfo message as the dict ``TieredBuffer.info()`` returns."""
    mode, max_times_sampled, limiter = decode_sampling(info.config)
    return {
        "name": info.name,
        "size": info.size,
        "pushed": info.pushed,
        "hot_size": info.hot_size,
        "cold_size": info.cold_size,
        "hot_capacity": info.config.hot_capacity,
        "total_capacity": info.config.total_capacity,
        "record_nbytes": info.record_nbytes,
        "cold_path": info.cold_path or None,
        "fields": {f.name: (f.dtype, tuple(f.shape)) for f in info.config.fields},
        "mode": mode,
        "max_times_sampled": max_times_sampled or 0,
        "rate_limiter": limiter and limiter.to_dict(),
        **{key: getattr(info, key) for key in _STATS},
    }


_STATS = ("inserts", "samples", "insert_waits", "sample_waits", "insert_wait_seconds",
          "sample_wait_seconds", "samples_per_insert", "waiting_inserts", "waiting_samples")


class RemoteBuffer:
    """A handle on the server buffer ``name``. Picklable; safe after fork.

    Single-record ``push`` calls are batched on the client (see
    :class:`~millpond.batching.PushBatcher`; ``connect(push_batch_size=,
    push_max_delay=)``): **a pushed record is acknowledged only when flushed**
    (by count, by age, by ``flush()``, ``close()`` or interpreter exit).
    Every other call on this handle flushes first, so it sees its own pushes.
    """

    def __init__(self, client: "Client", name: str, schema: Schema, hot_capacity: int,
                 total_capacity: int, prioritized: bool = False):
        self._client = client
        self.prioritized = prioritized
        self.name = name
        self.schema = schema
        self.hot_capacity = hot_capacity
        self.total_capacity = total_capacity
        self._closed = False
        self._batcher: PushBatcher | None = None

    def __reduce__(self):  # pending records stay with this handle, never in a pickle
        return (
            RemoteBuffer,
            (self._client, self.name, self.schema, self.hot_capacity, self.total_capacity,
             self.prioritized),
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return self.info()["size"]

    @translate_rpc_errors
    def info(self) -> dict[str, Any]:
        self._check_open()
        self.flush()
        reply = self._client.stub.Info(pb.InfoRequest(name=self.name), timeout=self._client.timeout)
        return info_to_dict(reply)

    def push(self, record: Mapping[str, Any], priority: float | None = None, *,
             timeout: float | None = None) -> None:
        """Queue one record for the next batch (validated now); see the class docstring.

        A record with an explicit ``priority`` (prioritized buffers) or
        ``timeout`` (rate-limited buffers) is sent at once, after what is queued.
        """
        self._check_open()
        limit = self._client.push_batch_size
        if priority is not None or timeout is not None or limit <= 1:  # sent now
            prios = None if priority is None else check_priorities([priority], 1)
            batch = self.schema.coerce_record(record)
            self.flush()
            self._store(1, batch, prios, timeout)
            return
        if self._batcher is None:
            fits = max(1, (self._client.max_message_bytes - _FRAMING_BYTES) // self.schema.record_nbytes)
            self._batcher = PushBatcher(self.schema, self._send_batch, min(limit, fits),
                                        self._client.push_max_delay)
        self._batcher.add(record)

    def flush(self) -> None:
        """Return once every record queued by ``push`` is stored."""
        if self._batcher is not None:
            self._batcher.flush()

    def push_batch(self, columns: Mapping[str, Any], priorities: Any = None, *,
                   timeout: float | None = None) -> int:
        """Store a batch (validated locally first, after queued pushes); returns its length.

        ``priorities``: one per record, for prioritized buffers. Over gRPC a
        batch larger than the message limit is refused before sending
        (:class:`MessageTooLargeError`); split it, nothing was stored.
        ``timeout``: the call's deadline in seconds (default: the client's),
        which bounds any wait for the buffer's rate limiter.
        """
        self._check_open()
        timeout = check_timeout(timeout)
        n, batch = self.schema.coerce_batch(columns)
        prios = None if priorities is None else check_priorities(priorities, n)
        self.flush()
        self._store(n, batch, prios, timeout)
        return n

    @translate_rpc_errors
    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """New priorities for sampled records; returns how many were still live."""
        self._check_open()
        seqs = np.asarray(indices, np.int64).reshape(-1)
        values = check_priorities(priorities, len(seqs))
        self.flush()
        session = self._client.connection.fast_path()
        if session is not None:  # a learner calls this after every sample: skip gRPC's latency
            try:
                return session.update_priorities(self.name, seqs, values, self._client.timeout)
            except SharedMemoryError as exc:
                log.warning("shared memory refused an update (%s); sending it over gRPC", exc)
        reply = self._client.stub.UpdatePriorities(
            pb.UpdatePrioritiesRequest(name=self.name, indices=seqs.tolist(),
                                       priorities=values.tolist()),
            timeout=self._client.timeout)
        return reply.updated

    @translate_rpc_errors
    def set_beta(self, beta: float) -> None:
        self._check_open()
        session = self._client.connection.fast_path()
        if session is not None:
            session.set_beta(self.name, float(beta), self._client.timeout)
            return
        self._client.stub.SetBeta(pb.SetBetaRequest(name=self.name, beta=float(beta)),
                                  timeout=self._client.timeout)

    def _send_batch(self, columns: dict[str, np.ndarray]) -> None:
        """The batcher's send: columns are views it reuses, so they are copied here."""
        self._store(len(next(iter(columns.values()))), columns)

    @translate_rpc_errors
    def _store(self, n: int, batch: dict[str, np.ndarray], priorities: np.ndarray | None = None,
               timeout: float | None = None) -> None:
        """Send validated columns (and priorities): through shared memory if we can, else gRPC."""
        timeout = self._client.timeout if timeout is None else timeout
        connection = self._client.connection
        session = connection.fast_path()
        if session is not None:
            # No priorities and an empty list are the same push, as on the gRPC wire.
            prios = priorities if priorities is not None and len(priorities) else None
            try:
                session.push_batch(self.name, self.schema, n, batch, timeout, prios)
                return
            except SharedMemoryError as exc:
                log.warning("shared memory refused a push (%s); sending it over gRPC", exc)
        self._check_message_size(n, "push_batch of")
        request = encode_with_batch(PUSH_BATCH_FIELD, batch, self.name, priorities)
        connection.push_batch(request, timeout=timeout)

    @translate_rpc_errors
    def sample(self, batch_size: int, seed: int | None = None, *,
               timeout: float | None = None) -> dict[str, np.ndarray]:
        """Sample on the server; returns writable arrays like the in-process buffer.

        ``timeout``: as for :meth:`push_batch`.
        """
        self._check_open()
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        timeout = check_timeout(timeout)
        timeout = self._client.timeout if timeout is None else timeout
        self.flush()
        connection = self._client.connection
        session = connection.fast_path()
        if session is not None:
            try:
                return session.sample(self.name, self.schema, batch_size, seed, timeout,
                                      self.prioritized)
            except (SharedMemoryError, ResultPoolExhausted) as exc:
                log.info("sampling over gRPC this time: %s", exc)
        request = pb.SampleRequest(name=self.name, batch_size=batch_size)
        if seed is not None:
            request.seed = seed
        reply = connection.sample(request, timeout=timeout)
        # The decoded arrays view the immutable reply bytes; copy once so the
        # caller may modify them in place, as with in-process results.
        columns = decode_batch_field(reply, SAMPLE_BATCH_FIELD)
        return {name: np.array(column) for name, column in columns.items()}

    @translate_rpc_errors
    def close(self) -> None:
        """Flush queued pushes, then close and delete the buffer on the server. Idempotent."""
        if self._closed:
            return
        if self._batcher is not None:
            self._batcher.close()
        try:
            self._client.stub.Close(pb.CloseRequest(name=self.name), timeout=self._client.timeout)
        except grpc.RpcError as exc:
            if not isinstance(error_from_rpc(exc), BufferNotFoundError):
                raise
        self._closed = True

    def release(self) -> None:
        """Flush queued pushes and stop using this handle; the server keeps the buffer."""
        if not self._closed:
            if self._batcher is not None:
                self._batcher.close()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError(f"buffer {self.name!r} was closed")

    def _check_message_size(self, n: int, what: str) -> None:
        nbytes = n * self.schema.record_nbytes + _FRAMING_BYTES
        limit = self._client.max_message_bytes
        if nbytes > limit:
            raise MessageTooLargeError(
                f"{what} {n:,} records is {nbytes:,} bytes, over the client's message limit "
                f"of {limit:,} bytes (max_message_mb); split it into smaller batches"
            )
