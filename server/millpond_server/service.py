"""The ``millpond.v1.Replay`` gRPC service (grpc.aio): decode, operate, encode.

Each handler decodes its request, runs its operation (:mod:`.operations`)
through the buffer's owner (:mod:`.owner`: where it runs, rate-limit waits)
and encodes the reply. Failures
are translated in one place, :func:`_rpc`, applied to every RPC: the
operations layer classifies the error, and the catalog
(:mod:`millpond.wire.status`) gives its status and stable code.

Bulk paths avoid needless copies of multi-megabyte payloads:

* ``PushBatch`` requests arrive as raw bytes and are parsed by
  :mod:`millpond.wire.frames` into views of those bytes (no copy);
* ``Sample`` replies are gathered by the engine straight into the reply's
  wire bytes (:mod:`millpond.wire.inplace`), sent as they are.

A sample is sized before it draws (see :meth:`ReplayService.Sample`): one that
would consume records (queue, stack, ``max_times_sampled``) consumes them only
when its reply fits every limit on its way to the client.

Pushes, samples and reads of at most ``INLINE_BYTES`` are *small*: the owner
may run them on the event loop; larger ones, and all parsing and gathering of
megabytes, run on the engine pool.

PushBatchStream and SampleStream carry PushBatch and Sample calls as the
messages of one stream (:mod:`.streams`); each is served by the same handler.

Checkpoint answers with a stream of progress messages, written by its handler under the
same :func:`_rpc` (the work is in :mod:`.backups`).
"""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any, Callable, TypeAlias, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from millpond.core import BufferInfo, Schema, TieredBuffer
from millpond.core.config import BufferConfig
from millpond.core.episode_checks import check_fields
from millpond.core.sequences import episodic_reply_nbytes, reply_specs
from millpond.errors import DeadlineExceededError, InvalidArgumentError, MessageTooLargeError
from millpond.remote.shm.protocol import SAMPLE_EXTRAS, read_boot_id
from millpond.v1 import replay_pb2 as pb
from millpond.wire.codec import config_from_proto, decode_batch, info_to_proto
from millpond.wire.episodic import decode_meta, decode_update, decode_updates, optional
from millpond.wire.frames import (
    MAX_RECEIVE_KEY,
    SAMPLE_BATCH_FIELD,
    decode_batches,
    encode_with_batch,
    reply_nbytes,
    split_push_batch,
)
from millpond.wire.inplace import BatchFrame
from millpond.wire.status import ERROR_CODE_KEY, status_for

from .auth import ADMIN
from .backups import checkpoint
from .edge import CALLER_ROLE
from .operations import Operations
from .owner import INLINE_BYTES
from .registry import check_name
from .shm_listener import FastPathServer
from .streams import CallStreams
from .waits import wait_budget

T = TypeVar("T")
SERVICE_NAME = "millpond.v1.Replay"
REUSED_REPLY_BYTES = 64 << 10  # sample replies up to this size are built in a reused buffer
# A request larger than this is decoded on the engine pool, never on the event loop.
DECODE_ON_LOOP_BYTES = 64 << 10
_DESCRIPTORS = pb.DESCRIPTOR.services_by_name["Replay"].methods
# The unary RPCs, and the streams whose every message is one of them (PushBatchStream: PushBatch).
_METHODS = tuple(m.name for m in _DESCRIPTORS if not m.client_streaming and not m.server_streaming)
# RPCs of one request answered by a stream of messages (Checkpoint: its progress).
SERVER_STREAMS = tuple(m.name for m in _DESCRIPTORS
                       if m.server_streaming and not m.client_streaming)
STREAMED = {m.name: m.name.removesuffix("Stream") for m in _DESCRIPTORS if m.client_streaming}
Context: TypeAlias = grpc.aio.ServicerContext  # (grpc has no type stubs)
# Requests that carry no bulk data are refused beyond this size, unparsed: decoding a
# 16 MB Create (a million fields) would cost seconds of a worker and hundreds of MiB.
CONTROL_REQUEST_BYTES = 1 << 20
BULK_METHODS = frozenset({"Push", "PushBatch", "UpdatePriorities", "UpdateEpisodes", "Read"})


def _rpc(method: Callable) -> Callable:
    """The one error translator, and the readiness and request size checks, around an RPC
    handler (the caller is authenticated and bounded before: :mod:`.edge`). A handler of an
    RPC answered by a stream writes its messages with ``context.write`` and returns None;
    a failure ends the stream with its status and code."""

    name = method.__name__

    @functools.wraps(method)
    async def handler(self: "ReplayService", raw: bytes, context: Context) -> Any:
        try:
            self.ops.check_ready()
            if len(raw) > CONTROL_REQUEST_BYTES and name not in BULK_METHODS:
                raise MessageTooLargeError(
                    f"a {name} request of {len(raw):,} bytes; it may have at most "
                    f"{CONTROL_REQUEST_BYTES:,}")
            parse = _REQUESTS[name]
            request = parse(raw) if len(raw) <= DECODE_ON_LOOP_BYTES else await self.ops.run(
                parse, raw)  # decoding a large request would stall every other call
            return await method(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            error = self.ops.classify(exc, name)
            status, code = status_for(error)
            await context.abort(status, str(error), trailing_metadata=((ERROR_CODE_KEY, code),))

    return handler


def _split_push(request: bytes) -> tuple[str, list[memoryview], np.ndarray | None,
                                          float | None, list | None]:
    """A PushBatchRequest's top-level fields (:func:`split_push_batch`), its episode
    updates decoded."""
    name, batches, priorities, timeout, raw_updates = split_push_batch(request)
    return name, batches, priorities, timeout, [
        decode_update(bytes(raw)) for raw in raw_updates] or None


def _parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return message_class.FromString(raw)
        except DecodeError as exc:
            raise InvalidArgumentError(f"malformed {message_class.__name__}: {exc}") from None
    return parse


# Each method's request parser. PushBatch keeps its bytes: frames.py reads them on the pool.
_REQUESTS: dict[str, Callable[[bytes], Any]] = {
    m.name: (lambda raw: raw) if m.name == "PushBatch" else _parser(getattr(pb, m.input_type.name))
    for m in _DESCRIPTORS if not m.client_streaming
}


@functools.lru_cache(maxsize=256)  # learners ask for the same size again and again
def sample_reply_frame(schema: Schema, batch_size: int) -> BatchFrame:
    """The SampleReply of ``batch_size`` records of ``schema`` (without sample extras)."""
    return BatchFrame(SAMPLE_BATCH_FIELD,
                      [(f.name, f.dtype, (max(0, batch_size), *f.shape)) for f in schema])


@functools.lru_cache(maxsize=256)
def _sample_reply_nbytes(schema: Schema, batch_size: int, prioritized: bool) -> int:
    if batch_size <= 0:
        return 0
    extras = tuple((name, dtype, (batch_size,))
                   for name, dtype in SAMPLE_EXTRAS.items()) if prioritized else ()
    return reply_nbytes((*((f.name, f.dtype, (batch_size, *f.shape)) for f in schema), *extras))


def sample_reply_nbytes(config: BufferConfig, batch_size: int) -> int:
    """Exact wire size of the SampleReply of ``batch_size`` records drawn from a buffer of
    ``config``: its columns and, prioritized, the ``weights`` and ``indices`` it carries."""
    return _sample_reply_nbytes(config.schema, batch_size, config.prioritized is not None)


STORED_OPS = ("sample", "sample_n_step", "sample_sequences")  # replied in the stored form


def stored_replies(config: BufferConfig) -> bool:
    """Whether samples of a buffer of ``config`` may reply in the stored form (see
    :meth:`ReplayService._episodic`): it has frame groups, and its samples draw (a
    queue's or a stack's remove records: their replies stay plain)."""
    return config.stored_schema != config.schema and not consumes(config)


def consumes(config: BufferConfig) -> bool:
    """Whether a sample of a buffer of ``config`` consumes what it returns: a queue's or a
    stack's records are removed, a use-limited buffer's draws are counted."""
    return config.removes or bool(config.max_times_sampled)


def _budget(request_timeout: float | None, context: grpc.aio.ServicerContext) -> float | None:
    return wait_budget(request_timeout, context.time_remaining())


class ReplayService:
    """Adapts ``millpond.v1.Replay`` calls to the operations layer."""

    def __init__(self, ops: Operations, max_message_mb: int,
                 fastpath: FastPathServer | None = None, fastpath_off_reason: str = "",
                 stream_idle_s: float = 10.0):
        self.ops = ops
        self.streams = CallStreams(stream_idle_s)
        self.fastpath = fastpath
        self.fastpath_off_reason = fastpath_off_reason
        self.max_message_mb = max_message_mb
        self.max_message_bytes = max_message_mb * 1024 * 1024

    @_rpc
    async def Create(self, request: pb.CreateRequest, context: Context) -> pb.CreateReply:
        name = check_name(request.name)
        info, created = await self.ops.run(self.ops.create, name,
                                           config_from_proto(request.config),
                                           self._may_create())
        return pb.CreateReply(info=info_to_proto(info), created=created)

    def _may_create(self) -> bool:
        """Whether this call may make a new buffer: admin's right (with authentication
        off, every caller is admin; with it on, a call the edge did not pass may not)."""
        return not self.ops.auth.enabled or CALLER_ROLE.get() == ADMIN

    @_rpc
    async def Push(self, request: pb.PushRequest, context: Context) -> pb.PushReply:
        timeout = request.timeout if request.HasField("timeout") else None
        buffer = self.ops.registry.get(request.name)
        size, pushed = await self.ops.owner(buffer).run(
            self.ops.push, buffer, decode_batch(request.record), budget=_budget(timeout, context))
        return pb.PushReply(size=size, pushed=pushed)

    @_rpc
    async def PushBatch(self, request: bytes, context: Context) -> pb.PushReply:
        # Arrives unparsed (see add_to_server); its top-level fields are read here (on
        # the pool if it is large), its columns where the push runs.
        if len(request) <= DECODE_ON_LOOP_BYTES:
            name, batches, priorities, timeout, updates = _split_push(request)
        else:
            name, batches, priorities, timeout, updates = await self.ops.run(_split_push, request)
        buffer = self.ops.registry.get(name)
        # (--sync always: every push waits for the disk, never on the loop)
        small = len(request) <= INLINE_BYTES and not self.ops.registry.sync_every_push
        size, pushed = await self.ops.owner(buffer).run(
            self._push_frames, buffer, batches, priorities, updates, small=small,
            budget=_budget(timeout, context), held=len(request))
        return pb.PushReply(size=size, pushed=pushed)

    def _push_frames(self, buffer: TieredBuffer, batches: list[memoryview],
                     priorities: np.ndarray | None, updates: list | None) -> tuple[int, int]:
        # Columns are views of the request bytes: the push is their only copy.
        return self.ops.push_batch(buffer, decode_batches(batches), priorities, updates)

    @_rpc
    async def Sample(self, request: pb.SampleRequest, context: Context) -> bytes:
        """A sample: gathered into its reply's bytes, once sized.

        Delivery: a sample that consumes records (queue and stack modes remove them,
        ``max_times_sampled`` counts each draw) consumes them only when its reply is sent.
        Before anything is drawn, its reply's exact size (every column, a prioritized
        buffer's ``weights`` and ``indices``, the framing) is held to the smaller of
        --max-message-mb and the client's own receive limit (the ``MAX_RECEIVE_KEY``
        metadata of the call, or of its stream): a reply over it is MessageTooLargeError,
        nothing drawn. Then, under the buffer's lane just before the draw, the call must
        still be live: not cancelled, within its deadline (else DeadlineExceededError,
        nothing drawn; see :meth:`_consuming`). After the draw the reply is bytes in
        memory, handed to gRPC. Consumption and delivery cannot be one atomic step over a
        network: a call cancelled, or whose deadline passes, or whose connection breaks
        while the draw runs or the reply travels, has consumed its records, and they are
        delivered to no one (at most once; its client sees DeadlineExceededError or
        ServerUnavailableError and must count those records as gone).
        """
        seed = request.seed if request.HasField("seed") else None
        timeout = request.timeout if request.HasField("timeout") else None
        buffer = self.ops.registry.get(request.name)
        config = buffer.config
        stored = request.stored_form and stored_replies(config)
        if request.HasField("n_step") or request.filter_meta.columns or stored:
            params = ({"n_step": request.n_step, "gamma": request.gamma}
                      if request.HasField("n_step") else {})
            return await self._episodic(
                "sample_n_step" if params else "sample", request.name, request.batch_size, seed,
                request.filter_meta, params, timeout, context, stored)
        nbytes = sample_reply_nbytes(config, request.batch_size)
        limit = self._reply_limit(context)
        if nbytes > limit:
            raise MessageTooLargeError(
                f"sample reply of {nbytes:,} bytes ({request.batch_size:,} records of "
                f"{buffer.schema.record_nbytes:,} bytes"
                f"{', weights and indices' if config.prioritized is not None else ''}) "
                f"exceeds {self._limit_name(limit)}; sample fewer records per call"
                f"{' (nothing was drawn)' if consumes(config) else ''}")
        owner, budget = self.ops.owner(buffer), _budget(timeout, context)
        if not consumes(config):
            return await owner.run(self._sample_frames, buffer, request.batch_size, seed,
                                   small=nbytes <= INLINE_BYTES, budget=budget)
        return await self._consuming(context, owner.run, self._sample_frames, buffer,
                                     request.batch_size, seed, small=nbytes <= INLINE_BYTES,
                                     budget=budget)

    def _sample_frames(self, buffer: TieredBuffer, batch_size: int, seed: int | None) -> bytes:
        if buffer.config.prioritized is not None or batch_size <= 0:  # weights, indices too
            return encode_with_batch(SAMPLE_BATCH_FIELD, self.ops.sample(buffer, batch_size, seed))
        # Gathered straight into the reply: a large one's bytes (the column
        # data's one copy), a small one's reused buffer (then copied once).
        # The engine fills every row of ``out`` (cold rows, then hot ones) and
        # returns those very arrays; anything else is encoded the plain way.
        frame = sample_reply_frame(buffer.schema, batch_size)
        reply, columns = frame.new() if frame.nbytes > REUSED_REPLY_BYTES else frame.reused()
        result = self.ops.sample(buffer, batch_size, seed, columns)
        if result.keys() != columns.keys() or any(result[k] is not v for k, v in columns.items()):
            return encode_with_batch(SAMPLE_BATCH_FIELD, result)
        return bytes(reply)  # the same object if it is bytes already

    async def _consuming(self, context: Context, run: Callable[..., Any], fn: Callable[..., T],
                         *args: Any, **kwargs: Any) -> T:
        """``run(fn, *args, **kwargs)`` for a sample that consumes records: ``fn`` runs
        (under the buffer's lane, just before the draw) only if the call can still be
        answered: not ended (cancelled: this coroutine was; stopped waiting) and within
        its deadline. Else DeadlineExceededError, nothing drawn."""
        ended = False

        def draw(*fn_args: Any) -> T:
            remaining = context.time_remaining()
            if ended or (remaining is not None and remaining <= 0):
                raise DeadlineExceededError("the call ended (cancelled, or its deadline "
                                            "passed) before its sample ran; nothing was drawn")
            return fn(*fn_args)

        try:
            return await run(draw, *args, **kwargs)
        except asyncio.CancelledError:
            ended = True  # a draw queued for the lane will not start
            raise

    @_rpc
    async def UpdatePriorities(self, request: pb.UpdatePrioritiesRequest,
                               context: Context) -> pb.UpdatePrioritiesReply:
        buffer = self.ops.registry.get(request.name)
        buffer.check_writable("update_priorities")
        if len(request.indices) > buffer.config.total_capacity:  # before they become objects
            raise InvalidArgumentError(
                f"{len(request.indices):,} priorities to update in a buffer of capacity "
                f"{buffer.config.total_capacity:,}")

        def update() -> int:  # (millions of items: not on the loop)
            return buffer.update_priorities(list(request.indices), list(request.priorities))

        updated = await self.ops.owner(buffer).run(update)
        return pb.UpdatePrioritiesReply(updated=updated)

    @_rpc
    async def SetBeta(self, request: pb.SetBetaRequest, context: Context) -> pb.SetBetaReply:
        buffer = self.ops.registry.get(request.name)
        await self.ops.owner(buffer).run(buffer.set_beta, request.beta, small=True)
        return pb.SetBetaReply()

    # ---- episodic buffers ---------------------------------------------------------------

    @_rpc
    async def UpdateEpisodes(self, request: pb.UpdateEpisodesRequest,
                             context: Context) -> pb.UpdateEpisodesReply:
        buffer = self.ops.registry.get(request.name)
        await self.ops.owner(buffer).run(buffer.update_episodes, decode_updates(request))
        return pb.UpdateEpisodesReply()

    @_rpc
    async def SampleSequences(self, request: pb.SampleSequencesRequest, context: Context) -> bytes:
        return await self._episodic("sample_sequences", request.name, request.batch_size,
                                    optional(request, "seed"), request.filter_meta,
                                    {"seq_len": request.seq_len}, optional(request, "timeout"),
                                    context, request.stored_form)

    @_rpc
    async def SampleEpisodes(self, request: pb.SampleEpisodesRequest, context: Context) -> bytes:
        return await self._episodic("sample_episodes", request.name, request.batch_size,
                                    optional(request, "seed"), request.filter_meta,
                                    {"max_len": optional(request, "max_len")},
                                    optional(request, "timeout"), context)

    async def _episodic(self, op: str, name: str, batch_size: int, seed: int | None,
                        filter_meta: pb.Batch, params: dict[str, Any], timeout: float | None,
                        context: grpc.aio.ServicerContext, stored: bool = False) -> bytes:
        """An episodic sample (or a filtered one), its reply encoded on the pool. Sized
        before it draws, as :meth:`Sample`: exactly, framing, weights and indices
        included (``sample_episodes`` without ``max_len``, whose size the draw decides,
        consumes no record: it is sized once encoded).

        ``stored`` (the client asked for it, see ``SampleRequest.stored_form``): a
        ``sample``, ``sample_n_step`` or ``sample_sequences`` of a buffer with frame groups
        that consumes nothing replies in the stored form (:mod:`millpond.core.stored`:
        each group's distinct frames once, compressed ones as stored; the client
        rebuilds the arrays), or plainly where that is not smaller (frames of a few bytes,
        whose indices cost more than they save): so a reply is never larger than the
        plain one it was sized as."""
        wanted = decode_meta(filter_meta) or None
        buffer = self.ops.registry.get(name)
        limit = self._reply_limit(context)
        specs = reply_specs(buffer.config, op, batch_size, params)
        if specs is not None:
            self._check_reply(reply_nbytes(specs), op, limit)
        stored = (stored and specs is not None and op in STORED_OPS
                  and stored_replies(buffer.config))

        def frames() -> bytes:
            if stored:
                assert specs is not None
                batch = self.ops.sample_stored(buffer, op, batch_size, seed, wanted, params)
                plain = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in specs)
                columns = (batch.to_columns() if batch.nbytes < plain
                           else batch.rebuild(buffer.schema))
                return self._check_reply(encode_with_batch(SAMPLE_BATCH_FIELD, columns), op,
                                         limit)
            if op == "sample":
                result = self.ops.sample(buffer, batch_size, seed, filter_meta=wanted)
            else:
                result = self.ops.sample_episodic(buffer, op, batch_size, seed, wanted, params)
            return self._check_reply(encode_with_batch(SAMPLE_BATCH_FIELD, result), op, limit)

        owner, budget = self.ops.owner(buffer), _budget(timeout, context)
        if op == "sample_episodes" or not consumes(buffer.config):
            return await owner.run(frames, budget=budget)
        return await self._consuming(context, owner.run, frames, budget=budget)

    @_rpc
    async def EpisodeCatalog(self, request: pb.EpisodeCatalogRequest, context: Context) -> bytes:
        buffer = self.ops.registry.get(request.name)

        def frames() -> bytes:
            catalog = buffer.episode_catalog(decode_meta(request.filter_meta) or None)
            return self._check_reply(encode_with_batch(SAMPLE_BATCH_FIELD, catalog),
                                     "episode_catalog")
        return await self.ops.owner(buffer).run(frames)

    @_rpc
    async def Read(self, request: pb.ReadRequest, context: Context) -> bytes:
        buffer = self.ops.registry.get(request.name)
        names = check_fields(buffer.config, list(request.fields) or None)  # before sizing them
        nbytes = self._check_reply(episodic_reply_nbytes(
            buffer.config, "read", len(request.seqs),
            {"fields": names, "episode_ids": request.episode_ids}), "read")
        seqs = np.asarray(request.seqs, np.int64)

        def read() -> bytes:
            return encode_with_batch(SAMPLE_BATCH_FIELD, self.ops.read(
                buffer, seqs, names, None, request.positions, request.episode_ids))

        # a learner's batch by position: small ones on the loop, as samples
        return await self.ops.owner(buffer).run(read, small=nbytes <= INLINE_BYTES)

    @_rpc
    async def Reset(self, request: pb.ResetRequest, context: Context) -> pb.ResetReply:
        buffer = self.ops.registry.get(request.name)
        await self.ops.owner(buffer).run(buffer.reset)
        return pb.ResetReply()

    def _check_reply(self, reply: Any, op: str, limit: int | None = None) -> Any:
        """``reply`` (bytes, or a size) if within ``limit`` (default: --max-message-mb;
        see :meth:`_reply_limit`), else MessageTooLargeError."""
        limit = self.max_message_bytes if limit is None else limit
        nbytes = reply if isinstance(reply, int) else len(reply)
        if nbytes > limit:
            raise MessageTooLargeError(
                f"{op} reply of {nbytes:,} bytes exceeds {self._limit_name(limit)}; "
                "ask for fewer records per call")
        return reply

    def _reply_limit(self, context: Context) -> int:
        """The largest reply this call may carry: --max-message-mb, or the client's own
        receive limit if lower (the ``MAX_RECEIVE_KEY`` metadata every client call sends;
        absent, as from an older client: ours)."""
        for key, value in context.invocation_metadata() or ():
            if key == MAX_RECEIVE_KEY:
                try:
                    limit = int(value)
                except ValueError:
                    limit = 0
                if limit <= 0:
                    raise InvalidArgumentError(
                        f"metadata {MAX_RECEIVE_KEY}: {value[:40]!r} is not a positive "
                        "number of bytes")
                return min(limit, self.max_message_bytes)
        return self.max_message_bytes

    def _limit_name(self, limit: int) -> str:
        if limit < self.max_message_bytes:
            return f"the client's limit of {limit:,} bytes (its max_message_mb)"
        return f"--max-message-mb {self.max_message_mb} ({self.max_message_bytes:,} bytes)"

    @_rpc
    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteReply:
        if self.ops.registry.held(request.name) is not None:  # not served: no owner
            await self.ops.run(self.ops.delete, request.name)
            return pb.DeleteReply()
        buffer = self.ops.registry.get(request.name)
        await self.ops.owner(buffer).run(self.ops.delete, request.name)  # parked calls end
        return pb.DeleteReply()

    @_rpc
    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.BufferInfo:
        return self._with_disk(await self.ops.run(self.ops.info, request.name, None,
                                                  request.include_unavailable))

    @_rpc
    async def List(self, request: pb.ListRequest, context: Context) -> pb.ListReply:
        infos = await self.ops.run(self.ops.list, request.include_unavailable)
        return pb.ListReply(buffers=[self._with_disk(info) for info in infos])

    def _with_disk(self, info: BufferInfo) -> pb.BufferInfo:
        """``info`` as its message, with the disk its file takes (the daemon's to say)."""
        message = info_to_proto(info)
        message.disk_bytes = self.ops.registry.disk_bytes(info.name or "")
        return message

    # ---- operators ------------------------------------------------------------------------

    @_rpc
    async def Repair(self, request: pb.RepairRequest, context: Context) -> pb.RepairReply:
        info, dropped, repaired = await self.ops.run(self.ops.repair, check_name(request.name))
        return pb.RepairReply(info=info_to_proto(info), dropped=dropped, repaired=repaired)

    @_rpc
    async def Checkpoint(self, request: pb.CheckpointRequest, context: Context) -> None:
        name = check_name(request.name)

        async def report(copied: int, total: int) -> None:
            await context.write(pb.CheckpointProgress(copied=copied, total=total))

        result = await checkpoint(self.ops, self.ops.backups, name, request.path, report)
        cut = result.records + result.dropped
        await context.write(pb.CheckpointProgress(
            copied=cut, total=cut, done=True, path=result.path, records=result.records,
            first=result.first, pushed=result.pushed, dropped=result.dropped,
            damaged=result.damaged, nbytes=result.nbytes))

    @_rpc
    async def Negotiate(self, request: pb.NegotiateRequest, context: Context) -> pb.NegotiateReply:
        boot_id = read_boot_id()
        if not boot_id or request.boot_id != boot_id:  # another host: tell it nothing
            return pb.NegotiateReply(shm=False)
        if self.fastpath is None:
            return pb.NegotiateReply(shm=False, reason=self.fastpath_off_reason)
        # With mTLS the fast path takes a ticket only (it sees no certificate): every caller
        # gets one, bound to the role this call authenticated as (a token's, or admin).
        role = CALLER_ROLE.get()
        ticket = self.ops.auth.issue_ticket(role) if self.ops.auth.mtls and role else ""
        return pb.NegotiateReply(shm=True, socket=self.fastpath.socket_name,
                                 boot_id=boot_id, uid=self.fastpath.uid, ticket=ticket)


def _passthrough_or_serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(service: ReplayService, server: grpc.aio.Server) -> None:
    """Register the service like the generated ``add_ReplayServicer_to_server``,
    except that requests are handed over as bytes (parsed by :func:`_rpc`, so
    that a malformed one is INVALID_ARGUMENT, not gRPC's INTERNAL) and
    handlers may return already-serialized replies (bytes)."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(service, name), request_deserializer=None,
            response_serializer=_passthrough_or_serialize)
        for name in _METHODS
    }
    handlers.update({  # answered by a stream of messages (Checkpoint's progress)
        name: grpc.unary_stream_rpc_method_handler(
            getattr(service, name), request_deserializer=None,
            response_serializer=_passthrough_or_serialize)
        for name in SERVER_STREAMS
    })
    handlers.update({  # each message of PushBatchStream is a PushBatch call...
        name: grpc.stream_stream_rpc_method_handler(
            functools.partial(service.streams.serve, getattr(service, unary)),
            request_deserializer=None, response_serializer=_passthrough_or_serialize)
        for name, unary in STREAMED.items()
    })
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
