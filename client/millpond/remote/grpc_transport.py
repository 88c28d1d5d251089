"""The gRPC transport: every call of the protocol over one channel.

Bulk calls bypass the generated message classes: PushBatch requests and
Sample replies travel as bytes framed by :mod:`millpond.wire.frames`, which
copies column data once instead of three times.

Small pushes and samples go as messages on streams each thread keeps open
(:mod:`millpond.remote.grpc_streams`), with the same contract as the unary calls,
which every other call is.

Every call waits for the server to be ready, within its deadline: gRPC's
``wait_for_ready`` holds it while the server is not listening yet (a client
started before its daemon), and a server still recovering its buffers
answers :class:`~millpond.errors.ServerStartingError`, which is retried with
backoff. Not silently: a call that finds the channel not connected waits about a
second for it, then logs one warning saying what it waits for (the address, and
the channel's last connection error in words), once per episode of
unreachability; with ``wait_for_server=False`` it raises ServerUnavailableError
instead (see :func:`millpond.connect`). A message whose stream had ended before the daemon read it is sent
again on a new stream. Nothing else is retried: a push whose connection broke
may or may not have been stored, and the caller must know.

Every call (and every stream, at its start) carries the client's metadata:
``authorization: Bearer TOKEN`` when it has a token (see
:mod:`millpond.remote.security`), and the largest reply this client can receive
(``max_message_mb``, as ``millpond-max-receive-bytes``): the daemon refuses a sample
whose reply would be larger with MessageTooLargeError before it draws, so a queue's
or a use-limited buffer's records are not consumed by a reply that could not arrive.

No reply is trusted: every reply decoded here is checked against the buffer's
config and the request before it is returned, and one that cannot be the
answer raises :class:`~millpond.errors.ProtocolError` naming the server. The
checks are those of :mod:`millpond.remote.replies`, and requests and replies are
built and read by :mod:`millpond.remote.grpc_calls`, both shared with the asyncio
transport (:mod:`millpond.remote.aio_transport`). Names, dtypes and shapes only: no
check reads the data.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import grpc
import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.schema import Schema
from millpond.core.sequences import Spec, n_step_specs, read_specs, sequence_specs
from millpond.core.snapshot import CheckpointResult
from millpond.core.stored import PREFIX as STORED_PREFIX
from millpond.errors import (
    DeadlineExceededError,
    ProtocolError,
    ReplayError,
    ServerStartingError,
    ServerUnavailableError,
)
from millpond.remote import grpc_calls, replies
from millpond.remote.grpc_calls import FRAMING_BYTES  # noqa: F401 (where callers look for it)
from millpond.remote.grpc_calls import plain_sample_request as _plain_sample_request
from millpond.remote.grpc_calls import sample_specs as _sample_specs
from millpond.remote.grpc_streams import ThreadStreams
from millpond.remote.push_window import PushWindow
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc
from millpond.wire.codec import config_to_proto, info_from_proto
from millpond.wire.episodic import encode_meta, encode_updates
from millpond.wire.frames import MAX_RECEIVE_KEY
from millpond.wire.status import error_from_rpc

# Calls sent on streams (see grpc_streams) move at most this each way: where a call's
# setup costs as much as its message. The daemon keeps a stream's last request until
# the next one arrives, and a reply that came on a stream is not handed out as writable
# views (gRPC keeps a reference to it): large ones go as calls.
STREAMED_MAX_BYTES = 64 << 10
# A sample of a buffer whose replies arrived in the stored form (see
# millpond.core.stored) of at most this goes on the thread's stream too, whatever its
# plain size: compressed frames make a few hundred KB of a 14.5 MB Atari sample(256), and
# the call's setup cost the daemon 0.3 ms a sample of its 1 ms (the copy of the columns a
# streamed reply costs is of those few hundred KB: the arrays are rebuilt anyway).
STORED_STREAMED_MAX_BYTES = 1 << 20
# Backoff between retries of a call the server answered "starting".
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0


class GrpcTransport:
    """Calls over one gRPC channel; raises the typed millpond errors."""

    name = "grpc"

    def __init__(self, channel: grpc.Channel, max_message_bytes: int,
                 metadata: tuple[tuple[str, str], ...] | None = None, address: str = "",
                 wait_for_server: bool = True, episodes: grpc_calls.Episodes | None = None):
        self.wait_for_server = wait_for_server
        # Whether the channel was seen connected since a call last failed to reach the
        # server (then calls skip the check), and whether this episode was told of.
        self._reached = False
        self._episodes = episodes or grpc_calls.Episodes()
        self.max_message_bytes = max_message_bytes
        self.metadata = (*(metadata or ()), (MAX_RECEIVE_KEY, str(max_message_bytes)))
        self.address = address  # named in the errors of replies that do not check
        self.channel = channel
        self.stub = pb_grpc.ReplayStub(channel)
        self._push_batch = channel.unary_unary(
            "/millpond.v1.Replay/PushBatch",
            request_serializer=None,  # already bytes
            response_deserializer=pb.PushReply.FromString,
        )
        self._sample = channel.unary_unary(
            "/millpond.v1.Replay/Sample",
            request_serializer=None,  # already bytes (see sample)
            response_deserializer=None,  # parsed by frames.decode_batch_field
        )
        # The same two calls as messages on open streams (see grpc_streams).
        self._streams = ThreadStreams(self.metadata, address)
        self._push_stream = channel.stream_stream(
            "/millpond.v1.Replay/PushBatchStream", request_serializer=None,
            response_deserializer=pb.PushReply.FromString)
        # (buffer, batch_size) of samples whose last reply was a small stored form.
        self._small_stored: dict[tuple[str, int], bool] = {}
        self._streamed: dict[Callable, grpc.StreamStreamMultiCallable] = {
            self._push_batch: self._push_stream,
            self._sample: channel.stream_stream(
                "/millpond.v1.Replay/SampleStream", request_serializer=None,
                response_deserializer=None),
        }
        # Episodic calls whose replies are framed like a SampleReply, parsed the same way.
        self._bytes = {name: channel.unary_unary(
            f"/millpond.v1.Replay/{name}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=None)
            for name in ("SampleSequences", "SampleEpisodes", "EpisodeCatalog", "Read")}

    def invoke(self, method: Callable, request: Any, deadline: float,
               small: bool = False) -> Any:
        """``method(request)`` within ``deadline`` seconds, once the server is ready.
        ``small``: request and reply are at most STREAMED_MAX_BYTES (see :meth:`_send`)."""
        end = time.monotonic() + deadline
        delay = _RETRY_FIRST
        if not self._reached:
            self._reach(end)
        while True:
            try:
                return self._send(method, request, max(0.0, end - time.monotonic()), small)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
            except DeadlineExceededError as exc:  # a stream's caller waited its deadline
                error = exc
            if type(error) in (DeadlineExceededError, ServerUnavailableError):
                self._reached = False  # the next call checks again (and may tell again)
            if type(error) is DeadlineExceededError:  # perhaps never connected: why?
                error = self._why_unreached(error)
            left = end - time.monotonic()
            if not isinstance(error, ServerStartingError) or left <= delay:
                raise error
            time.sleep(delay)
            delay = min(2 * delay, _RETRY_MAX)

    def _send(self, method: Callable, request: Any, timeout: float, small: bool) -> Any:
        """One try of ``method(request)``: a small call as a message on this thread's
        stream of them, if the method has one; else a unary call."""
        streamed = self._streamed.get(method) if small else None
        if streamed is not None:
            return self._streams.call(streamed, request, timeout)
        return method(request, timeout=timeout, wait_for_ready=True, metadata=self.metadata)

    def close(self) -> None:
        """End this client's streams (its channel is closed by its owner)."""
        self._streams.close()

    def _reach(self, end: float) -> None:
        """Before a call: return once a health check reaches the server; if none does
        within NOTICE_S, log what the call will wait for (once per episode), or, with
        ``wait_for_server=False``, raise ServerUnavailableError saying why (within
        FAIL_FAST_S; at once when the channel fails to connect). Health checks, not the
        channel's connectivity callbacks: those run a polling thread that can hang a
        process at exit."""
        fail_fast = not self.wait_for_server
        patience = grpc_calls.patience(fail_fast, end - time.monotonic())
        cause = grpc_calls.probe_cause(self._probe(patience, wait=not fail_fast))
        if cause is not None and not fail_fast:  # what the channel saw, said plainly
            cause = grpc_calls.probe_cause(self._probe(0.2, wait=False))
        self._reached = grpc_calls.settle_reach(cause, self._episodes, self.address, fail_fast,
                                                end - time.monotonic())

    def _probe(self, timeout: float = 0.2, wait: bool = False) -> grpc.RpcError | None:
        """A health check (``wait``: waiting for the channel to connect, within
        ``timeout``): its error, or None if the server answered it (as anything but
        UNAVAILABLE or DEADLINE_EXCEEDED, say UNIMPLEMENTED or UNAUTHENTICATED)."""
        probe = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                         request_serializer=None, response_deserializer=None)
        try:
            probe(b"", timeout=timeout, metadata=self.metadata, wait_for_ready=wait)
        except grpc.RpcError as exc:
            return exc
        return None

    def _why_unreached(self, error: DeadlineExceededError) -> DeadlineExceededError:
        """A call that waited its whole deadline for a connection says why it never got one.

        A TLS mismatch (plaintext to a TLS server, an unknown CA, no client
        certificate) looks to a waiting call like a server that is not up:
        ask the channel, without waiting, for its last connection error.
        """
        return grpc_calls.unreached(error, self._probe(), self.address)

    # ---- bulk ---------------------------------------------------------------------

    def push_batch(self, buffer: str, schema: Schema, n: int, columns: dict[str, np.ndarray],
                   priorities: np.ndarray | None, timeout: float, deadline: float,
                   updates: list | None = None, capacity: int | None = None,
                   window: PushWindow | None = None) -> None:
        """Store a batch; with ``window``, return once it is sent (acknowledged later:
        see :class:`PushWindow`). ``capacity``: the buffer's, to check the reply against
        (see :func:`millpond.remote.replies.pushed`)."""
        request = grpc_calls.push_request(buffer, n, columns, schema, priorities, timeout,
                                          updates, self.max_message_bytes)
        if window is not None:
            window.send(request, deadline, functools.partial(
                self._pushed, n=n, capacity=capacity))
        else:
            self._pushed(self.invoke(self._push_batch, request, deadline,
                                     len(request) <= STREAMED_MAX_BYTES), None, n, capacity)

    def _pushed(self, reply: pb.PushReply, after: int | None, n: int,
                capacity: int | None) -> int:
        """The ``pushed`` of a PushReply, if possible (:func:`replies.pushed`)."""
        return replies.pushed(reply.size, reply.pushed, n, capacity, after, self.address)

    def push_window(self, size: int, ordered: bool) -> PushWindow:
        """A window of ``size`` pushes in flight on a stream of its own (see
        :mod:`millpond.remote.push_window`), for :meth:`push_batch`'s ``window``.
        ``ordered``: each reply's ``pushed`` is at least the one before it plus its
        records (the buffer is not a stack: see :mod:`millpond.remote.replies`)."""
        return PushWindow(self._streams, self._push_stream, size, ordered)

    def sample(self, buffer: str, schema: Schema, batch_size: int, seed: int | None,
               extras: bool, timeout: float, deadline: float,
               filter_meta: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        if seed is None and filter_meta is None:  # a learner's usual call, again and again
            request = _plain_sample_request(buffer, batch_size, timeout)
        else:
            request = pb.SampleRequest(name=buffer, batch_size=batch_size, seed=seed,
                                       timeout=timeout, filter_meta=encode_meta(filter_meta),
                                       stored_form=True).SerializeToString()
        small = batch_size * schema.record_nbytes <= STREAMED_MAX_BYTES
        key = (buffer, batch_size)
        streamed = small or self._small_stored.get(key, False)
        columns = self._columns(self.invoke(self._sample, request, deadline, streamed))
        if not small:  # whether the next such sample goes on the stream (see above)
            if len(self._small_stored) >= 1024:  # (batch sizes that keep changing)
                self._small_stored.clear()
            self._small_stored[key] = (
                any(name.startswith(STORED_PREFIX) for name in columns)
                and sum(column.nbytes for column in columns.values())
                <= STORED_STREAMED_MAX_BYTES)
        what = f"sample({batch_size})"
        return self._checked(replies.rebuilt(columns, schema, what, self.address),
                             _sample_specs(schema, batch_size, extras), what)

    def _checked(self, columns: dict[str, np.ndarray], specs: Spec, what: str
                 ) -> dict[str, np.ndarray]:
        """``columns`` if they are exactly the arrays of ``specs``; else ProtocolError
        (:func:`millpond.remote.replies.columns`)."""
        return replies.columns(columns, specs, what, self.address)

    # The arrays of a reply framed like a SampleReply (called on the reply alone: see
    # grpc_calls.reply_columns, whose view of references a method in between would change).
    _columns = staticmethod(grpc_calls.reply_columns)

    # ---- episodic buffers -----------------------------------------------------------

    def sample_n_step(self, buffer: str, config: BufferConfig, batch_size: int,
                      filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                      timeout: float, deadline: float) -> dict[str, np.ndarray]:
        request = grpc_calls.sample_request(buffer, batch_size, params["seed"], timeout,
                                            filter_meta, params["n_step"], params["gamma"])
        columns = self._columns(self.invoke(self._sample, request, deadline))
        what = f"sample({batch_size}, n_step={params['n_step']})"
        return self._checked(replies.rebuilt(columns, config.schema, what, self.address),
                             n_step_specs(config, batch_size), what)

    def sample_sequences(self, buffer: str, config: BufferConfig, batch_size: int,
                         filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                         timeout: float, deadline: float) -> dict[str, np.ndarray]:
        request = grpc_calls.sequences_request(buffer, batch_size, filter_meta, params, timeout)
        columns = self._columns(self.invoke(self._bytes["SampleSequences"], request, deadline))
        what = f"sample_sequences({batch_size}, {params['seq_len']})"
        return self._checked(replies.rebuilt(columns, config.schema, what, self.address),
                             sequence_specs(config, batch_size, params["seq_len"]), what)

    def sample_episodes(self, buffer: str, config: BufferConfig, batch_size: int,
                        filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                        timeout: float, deadline: float) -> dict[str, np.ndarray]:
        request = grpc_calls.episodes_request(buffer, batch_size, filter_meta, params, timeout)
        columns = self._columns(self.invoke(self._bytes["SampleEpisodes"], request, deadline))
        return replies.episodes(columns, config, batch_size, params["max_len"], self.address)

    def episode_catalog(self, buffer: str, config: BufferConfig,
                        filter_meta: dict[str, np.ndarray] | None,
                        deadline: float) -> dict[str, np.ndarray]:
        request = grpc_calls.catalog_request(buffer, filter_meta)
        columns = self._columns(self.invoke(self._bytes["EpisodeCatalog"], request, deadline))
        return replies.catalog(columns, config, self.address)

    def read(self, buffer: str, config: BufferConfig, seqs: np.ndarray, names: list[str] | None,
             deadline: float, positions: bool = False, episode_ids: bool = False
             ) -> dict[str, np.ndarray]:
        request = grpc_calls.read_request(buffer, seqs, names, positions, episode_ids)
        columns = self._columns(self.invoke(self._bytes["Read"], request, deadline))
        return self._checked(columns, read_specs(config, len(seqs), names, episode_ids),
                             f"read of {len(seqs)} records")

    def reset(self, buffer: str, deadline: float) -> None:
        self.invoke(self.stub.Reset, pb.ResetRequest(name=buffer), deadline)

    def update_episodes(self, buffer: str, config: BufferConfig,
                        updates: list[tuple[int, dict[str, np.ndarray], bool]],
                        deadline: float) -> None:
        self.invoke(self.stub.UpdateEpisodes, encode_updates(buffer, updates), deadline)

    def update_priorities(self, buffer: str, indices: np.ndarray, priorities: np.ndarray,
                          deadline: float) -> int:
        request = grpc_calls.update_priorities_request(buffer, indices, priorities)
        updated = self.invoke(self.stub.UpdatePriorities, request, deadline).updated
        return replies.count(updated, len(indices), self.address,
                             f"update_priorities of {len(indices):,} records")

    def set_beta(self, buffer: str, beta: float, deadline: float) -> None:
        self.invoke(self.stub.SetBeta, pb.SetBetaRequest(name=buffer, beta=beta), deadline)

    # ---- control ------------------------------------------------------------------

    def create(self, name: str, config: BufferConfig, deadline: float) -> tuple[BufferInfo, bool]:
        """Create ``name`` (or attach to it); return its info and whether it is new. The
        reply's config must be ``config`` (a buffer is made with it, or attached where
        it is equal), else ProtocolError: handles check every later reply against it."""
        request = pb.CreateRequest(name=name, config=config_to_proto(config))
        reply = self.invoke(self.stub.Create, request, deadline)
        return replies.created(self._info(reply.info), config, name, self.address), reply.created

    def info(self, name: str, deadline: float, include_unavailable: bool = False) -> BufferInfo:
        """``name``'s info; a buffer held out of service raises BufferDamagedError, unless
        ``include_unavailable`` (then its info says its state and reason)."""
        request = pb.InfoRequest(name=name, include_unavailable=include_unavailable)
        return self._info(self.invoke(self.stub.Info, request, deadline))

    def _info(self, message: pb.BufferInfo) -> BufferInfo:
        """The info in a reply, if its counts are possible; else ProtocolError
        (:func:`millpond.remote.replies.info`)."""
        return replies.info(info_from_proto(message), self.address)

    def list(self, deadline: float, include_unavailable: bool = True) -> list[BufferInfo]:
        """Every buffer's info; with ``include_unavailable`` those held out of service too."""
        request = pb.ListRequest(include_unavailable=include_unavailable)
        reply = self.invoke(self.stub.List, request, deadline)
        return [self._info(info) for info in reply.buffers]

    def delete(self, name: str, deadline: float) -> None:
        self.invoke(self.stub.Delete, pb.DeleteRequest(name=name), deadline)

    # ---- operators ----------------------------------------------------------------

    def repair(self, name: str, deadline: float) -> tuple[BufferInfo, int, bool]:
        """Repair ``name`` (admin): ``(info, records dropped, repaired)``."""
        reply = self.invoke(self.stub.Repair, pb.RepairRequest(name=name), deadline)
        return self._info(reply.info), reply.dropped, reply.repaired

    def checkpoint(self, name: str, path: str, deadline: float | None,
                   progress: Callable[[int, int], None] | None = None) -> CheckpointResult:
        """Have the daemon write a snapshot of ``name`` to ``path`` under its
        --backup-dir (admin), ``progress(copied, total)`` told of each progress message;
        ``deadline``: seconds for the whole copy (None: no limit). Interrupting it (an
        exception in ``progress``, KeyboardInterrupt) cancels the call: the daemon
        removes its partial file. A daemon still starting is waited for."""
        request = pb.CheckpointRequest(name=name, path=path)
        end = None if deadline is None else time.monotonic() + deadline
        delay = _RETRY_FIRST
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            replies = self.stub.Checkpoint(request, timeout=left, metadata=self.metadata,
                                           wait_for_ready=True)
            heard = False
            try:
                for reply in replies:
                    heard = True
                    if progress is not None:
                        progress(reply.copied, reply.total)
                    if reply.done:
                        return CheckpointResult(reply.path, reply.records, reply.first,
                                                reply.pushed, reply.dropped, reply.damaged,
                                                reply.nbytes)
                raise ProtocolError(f"the server at {self.address or '?'} ended a checkpoint "
                                    "without saying what it wrote")
            except grpc.RpcError as exc:
                error: ReplayError = error_from_rpc(exc)
                if heard or not isinstance(error, ServerStartingError) or (
                        end is not None and end - time.monotonic() <= delay):
                    raise error from None
            finally:
                replies.cancel()  # a no-op once ended; else the daemon stops and cleans up
            time.sleep(delay)
            delay = min(2 * delay, _RETRY_MAX)

    def negotiate(self, boot_id: str, deadline: float) -> pb.NegotiateReply:
        return self.invoke(self.stub.Negotiate, pb.NegotiateRequest(boot_id=boot_id), deadline)
