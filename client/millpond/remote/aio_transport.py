"""The asyncio gRPC transport: every call millpond.aio makes, as a coroutine on a
``grpc.aio`` channel.

The twin of :class:`~millpond.remote.grpc_transport.GrpcTransport`, with the same
contract; only the waiting differs. Requests are built and replies read and checked
by the functions both use (:mod:`millpond.remote.grpc_calls`,
:mod:`millpond.remote.replies`): the same bytes go out, the same typed errors come
back (the catalog of :mod:`millpond.wire.status`), and a reply one refuses the other
refuses (:class:`~millpond.errors.ProtocolError`, naming the server).

* Every call (and stream) carries the client's metadata: the token, if any, and the
  largest reply it can receive (``millpond-max-receive-bytes``: a sample that consumes
  records and would not fit is refused before it draws), as the sync transport's do.
* Every call waits for the server to be ready, within its deadline (``wait_for_ready``;
  a server still recovering its buffers answers ServerStartingError, retried with
  backoff), and says so as the sync transport does: one warning after about a second
  of not reaching it, or with ``wait_for_server=False`` ServerUnavailableError within
  about 2 s. Nothing else is retried.
* Small pushes and samples (at most 64 KiB each way) go as messages on open streams
  (:mod:`millpond.remote.aio_streams`, pooled: one call per stream at a time); the rest
  are unary calls. Every request and reply is bytes, framed and parsed here.
* A task cancelled while its call is under way cancels the call: the daemon stops
  serving it, and a push or sample waiting for the rate limiter is withdrawn.

The arguments of every bulk call are those of the sync transports' (the
:class:`~millpond.remote.connection.Transport` protocol): millpond.aio hands a call to
either (see :mod:`millpond.aio`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np

from millpond.compat import cancelling
from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.schema import Schema
from millpond.core.sequences import n_step_specs, read_specs, sequence_specs
from millpond.errors import (
    BufferClosedError,
    DeadlineExceededError,
    ServerStartingError,
    ServerUnavailableError,
)
from millpond.remote import grpc_calls, replies
from millpond.remote.aio_streams import StreamPool, Unsent
from millpond.remote.grpc_transport import _RETRY_FIRST, _RETRY_MAX, STREAMED_MAX_BYTES
from millpond.v1 import replay_pb2 as pb
from millpond.wire.codec import config_to_proto, info_from_proto
from millpond.wire.frames import MAX_RECEIVE_KEY
from millpond.wire.status import error_from_rpc

_SERVICE = "/millpond.v1.Replay/"
# The unary methods this transport calls; PushBatch and Sample have streams too.
_UNARY = ("Create", "Info", "List", "Delete", "PushBatch", "Sample", "SampleSequences",
          "SampleEpisodes", "EpisodeCatalog", "Read", "Reset", "UpdatePriorities", "SetBeta")
_STREAMED = {"PushBatch": "PushBatchStream", "Sample": "SampleStream"}


class AioTransport:
    """Calls over one ``grpc.aio`` channel (made by the caller, in its event loop); raises
    the typed millpond errors."""

    name = "grpc"

    def __init__(self, channel: grpc.aio.Channel, max_message_bytes: int,
                 metadata: tuple[tuple[str, str], ...] | None = None, address: str = "",
                 wait_for_server: bool = True):
        self.channel = channel
        self.wait_for_server = wait_for_server
        self._reached = False  # as GrpcTransport's
        self._episodes = grpc_calls.Episodes()
        self.max_message_bytes = max_message_bytes
        self.metadata = (*(metadata or ()), (MAX_RECEIVE_KEY, str(max_message_bytes)))
        self.address = address  # named in the errors of replies that do not check
        self._unary = {name: channel.unary_unary(_SERVICE + name, request_serializer=None,
                                                 response_deserializer=None)
                       for name in _UNARY}
        self._streams = {name: StreamPool(channel.stream_stream(
            _SERVICE + streamed, request_serializer=None, response_deserializer=None),
            self.metadata) for name, streamed in _STREAMED.items()}
        self.closed = False

    async def invoke(self, method: str, request: bytes, deadline: float,
                     small: bool = False) -> bytes:
        """The reply (bytes) of RPC ``method`` to ``request`` (bytes), within ``deadline``
        seconds, once the server is ready. ``small``: request and reply are at most
        STREAMED_MAX_BYTES: then the call goes on a stream, if the method has one."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        delay = _RETRY_FIRST
        if not self._reached:
            await self._reach(end)
        while True:
            error: DeadlineExceededError | Exception
            try:
                return await self._send(method, request, max(0.0, end - loop.time()), small)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
            except DeadlineExceededError as exc:  # a stream's caller waited its deadline
                error = exc
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self.closed and task is not None and not cancelling(task):
                    # gRPC cancels the calls of a channel that closes: not this task
                    raise BufferClosedError(f"the client of {self.address} was closed while "
                                            f"its {method} call was under way") from None
                raise
            if type(error) in (DeadlineExceededError, ServerUnavailableError):
                self._reached = False  # the next call checks again (and may tell again)
            if type(error) is DeadlineExceededError:  # perhaps never connected: why?
                error = await self._why_unreached(error)
            left = end - loop.time()
            if not isinstance(error, ServerStartingError) or left <= delay:
                raise error
            await asyncio.sleep(delay)
            delay = min(2 * delay, _RETRY_MAX)

    async def _send(self, method: str, request: bytes, timeout: float, small: bool) -> bytes:
        pool = self._streams.get(method) if small else None
        if pool is not None:
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout
            try:
                return await pool.call(request, timeout)
            except Unsent:  # refused on its headers, perhaps: the unary call says why
                timeout = max(0.0, end - loop.time())
        return await self._unary[method](request, timeout=timeout, wait_for_ready=True,
                                         metadata=self.metadata)

    async def _reach(self, end: float) -> None:
        """As :meth:`GrpcTransport._reach
        <millpond.remote.grpc_transport.GrpcTransport._reach>`: return once a health
        check reaches the server; else tell (once per episode) or, failing fast, raise
        ServerUnavailableError."""
        loop = asyncio.get_running_loop()
        fail_fast = not self.wait_for_server
        patience = grpc_calls.patience(fail_fast, end - loop.time())
        cause = grpc_calls.probe_cause(await self._probe(patience, wait=not fail_fast))
        if cause is not None and not fail_fast:  # what the channel saw, said plainly
            cause = grpc_calls.probe_cause(await self._probe(0.2, wait=False))
        self._reached = grpc_calls.settle_reach(cause, self._episodes, self.address, fail_fast,
                                                end - loop.time())

    async def _probe(self, timeout: float = 0.2, wait: bool = False) -> grpc.RpcError | None:
        """A health check, as the sync transport's: its error, or None if answered."""
        probe = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                         request_serializer=None, response_deserializer=None)
        try:
            await probe(b"", timeout=timeout, metadata=self.metadata, wait_for_ready=wait)
        except grpc.RpcError as exc:
            return exc
        return None

    async def _why_unreached(self, error: DeadlineExceededError) -> DeadlineExceededError:
        """See :func:`millpond.remote.grpc_calls.unreached`."""
        return grpc_calls.unreached(error, await self._probe(), self.address)

    async def close(self) -> None:
        """End the idle streams (the channel is closed by its owner: its calls under way
        then raise BufferClosedError)."""
        self.closed = True
        for pool in self._streams.values():
            await pool.close()

    # ---- bulk ---------------------------------------------------------------------

    async def push_batch(self, buffer: str, schema: Schema, n: int,
                         columns: dict[str, np.ndarray], priorities: np.ndarray | None,
                         timeout: float, deadline: float, updates: list | None = None,
                         capacity: int | None = None) -> int:
        """Store a batch (and episode ``updates`` with it); returns the buffer's ``pushed``
        after it (checked against ``capacity``: :func:`millpond.remote.replies.pushed`)."""
        request = grpc_calls.push_request(buffer, n, columns, schema, priorities, timeout,
                                          updates, self.max_message_bytes)
        raw = await self.invoke("PushBatch", request, deadline,
                                len(request) <= STREAMED_MAX_BYTES)
        reply = pb.PushReply.FromString(raw)
        return replies.pushed(reply.size, reply.pushed, n, capacity, None, self.address)

    async def sample(self, buffer: str, schema: Schema, batch_size: int, seed: int | None,
                     extras: bool, timeout: float, deadline: float,
                     filter_meta: dict[str, np.ndarray] | None = None
                     ) -> dict[str, np.ndarray]:
        request = grpc_calls.sample_request(buffer, batch_size, seed, timeout, filter_meta)
        small = batch_size * schema.record_nbytes <= STREAMED_MAX_BYTES
        columns = grpc_calls.reply_columns(await self.invoke("Sample", request, deadline, small))
        what = f"sample({batch_size})"
        return replies.columns(replies.rebuilt(columns, schema, what, self.address),
                               grpc_calls.sample_specs(schema, batch_size, extras), what,
                               self.address)

    async def sample_n_step(self, buffer: str, config: BufferConfig, batch_size: int,
                            filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                            timeout: float, deadline: float) -> dict[str, np.ndarray]:
        request = grpc_calls.sample_request(buffer, batch_size, params["seed"], timeout,
                                            filter_meta, params["n_step"], params["gamma"])
        columns = grpc_calls.reply_columns(await self.invoke("Sample", request, deadline))
        what = f"sample({batch_size}, n_step={params['n_step']})"
        return replies.columns(replies.rebuilt(columns, config.schema, what, self.address),
                               n_step_specs(config, batch_size), what, self.address)

    async def sample_sequences(self, buffer: str, config: BufferConfig, batch_size: int,
                               filter_meta: dict[str, np.ndarray] | None,
                               params: dict[str, Any], timeout: float, deadline: float
                               ) -> dict[str, np.ndarray]:
        request = grpc_calls.sequences_request(buffer, batch_size, filter_meta, params, timeout)
        columns = grpc_calls.reply_columns(await self.invoke(
            "SampleSequences", request.SerializeToString(), deadline))
        what = f"sample_sequences({batch_size}, {params['seq_len']})"
        return replies.columns(replies.rebuilt(columns, config.schema, what, self.address),
                               sequence_specs(config, batch_size, params["seq_len"]), what,
                               self.address)

    async def sample_episodes(self, buffer: str, config: BufferConfig, batch_size: int,
                              filter_meta: dict[str, np.ndarray] | None,
                              params: dict[str, Any], timeout: float, deadline: float
                              ) -> dict[str, np.ndarray]:
        request = grpc_calls.episodes_request(buffer, batch_size, filter_meta, params, timeout)
        columns = grpc_calls.reply_columns(await self.invoke(
            "SampleEpisodes", request.SerializeToString(), deadline))
        return replies.episodes(columns, config, batch_size, params["max_len"], self.address)

    async def episode_catalog(self, buffer: str, config: BufferConfig,
                              filter_meta: dict[str, np.ndarray] | None,
                              deadline: float) -> dict[str, np.ndarray]:
        request = grpc_calls.catalog_request(buffer, filter_meta)
        columns = grpc_calls.reply_columns(await self.invoke(
            "EpisodeCatalog", request.SerializeToString(), deadline))
        return replies.catalog(columns, config, self.address)

    async def read(self, buffer: str, config: BufferConfig, seqs: np.ndarray,
                   names: list[str] | None, deadline: float, positions: bool = False,
                   episode_ids: bool = False) -> dict[str, np.ndarray]:
        request = grpc_calls.read_request(buffer, seqs, names, positions, episode_ids)
        columns = grpc_calls.reply_columns(await self.invoke(
            "Read", request.SerializeToString(), deadline))
        return replies.columns(columns, read_specs(config, len(seqs), names, episode_ids),
                               f"read of {len(seqs)} records", self.address)

    async def reset(self, buffer: str, deadline: float) -> None:
        await self._unary_message("Reset", pb.ResetRequest(name=buffer), deadline)

    async def update_priorities(self, buffer: str, indices: np.ndarray, priorities: np.ndarray,
                                deadline: float) -> int:
        request = grpc_calls.update_priorities_request(buffer, indices, priorities)
        reply = pb.UpdatePrioritiesReply.FromString(
            await self._unary_message("UpdatePriorities", request, deadline))
        return replies.count(reply.updated, len(indices), self.address,
                             f"update_priorities of {len(indices):,} records")

    async def set_beta(self, buffer: str, beta: float, deadline: float) -> None:
        await self._unary_message("SetBeta", pb.SetBetaRequest(name=buffer, beta=beta), deadline)

    # ---- control ------------------------------------------------------------------

    async def create(self, name: str, config: BufferConfig, deadline: float
                     ) -> tuple[BufferInfo, bool]:
        """Create ``name`` (or attach to it); its info (with ``config``, checked) and
        whether it is new."""
        request = pb.CreateRequest(name=name, config=config_to_proto(config))
        reply = pb.CreateReply.FromString(await self._unary_message("Create", request, deadline))
        return replies.created(self._info(reply.info), config, name, self.address), reply.created

    async def info(self, name: str, deadline: float, include_unavailable: bool = False
                   ) -> BufferInfo:
        """``name``'s info; a buffer held out of service raises BufferDamagedError, unless
        ``include_unavailable`` (then its info says its state and reason)."""
        request = pb.InfoRequest(name=name, include_unavailable=include_unavailable)
        raw = await self._unary_message("Info", request, deadline)
        return self._info(pb.BufferInfo.FromString(raw))

    async def list(self, deadline: float, include_unavailable: bool = True) -> list[BufferInfo]:
        """Every buffer's info; with ``include_unavailable`` those held out of service too."""
        request = pb.ListRequest(include_unavailable=include_unavailable)
        reply = pb.ListReply.FromString(await self._unary_message("List", request, deadline))
        return [self._info(info) for info in reply.buffers]

    async def delete(self, name: str, deadline: float) -> None:
        await self._unary_message("Delete", pb.DeleteRequest(name=name), deadline)

    def _info(self, message: pb.BufferInfo) -> BufferInfo:
        return replies.info(info_from_proto(message), self.address)

    async def _unary_message(self, method: str, request: Any, deadline: float) -> bytes:
        return await self.invoke(method, request.SerializeToString(), deadline)
