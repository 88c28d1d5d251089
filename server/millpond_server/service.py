"""The ``millpond.v1.Replay`` gRPC service (grpc.aio): decode, operate, encode.

Each handler decodes its request, calls the operations layer
(:mod:`.operations`: the rules every transport shares, engine calls on a
thread pool, rate-limit waits on the loop) and encodes the reply. Failures
are translated in one place, :func:`_rpc`, applied to every RPC: the
operations layer classifies the error, and the catalog
(:mod:`millpond.wire.status`) gives its status and stable code.

Bulk paths avoid needless copies of multi-megabyte payloads:

* ``PushBatch`` requests arrive as raw bytes and are parsed on the pool by
  :mod:`millpond.wire.frames` into views of those bytes (no copy);
* ``Sample`` replies are encoded on the pool by the same module: the gathered
  arrays are joined once into the reply's wire bytes, sent as they are.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError

from millpond.core import Schema
from millpond.errors import InvalidArgumentError, MessageTooLargeError
from millpond.shm.protocol import read_boot_id
from millpond.v1 import replay_pb2 as pb
from millpond.wire.codec import config_from_proto, decode_batch, info_to_proto
from millpond.wire.frames import (
    PUSH_BATCH_FIELD,
    PUSH_PRIORITIES_FIELD,
    PUSH_TIMEOUT_FIELD,
    SAMPLE_BATCH_FIELD,
    decode_batch_field,
    decode_double,
    decode_doubles,
    decode_name,
    encode_with_batch,
    encoded_batch_nbytes,
)
from millpond.wire.status import ERROR_CODE_KEY, status_for

from .auth import ADMIN, bearer_token
from .shm_listener import FastPathServer
from .operations import Operations, wait_budget
from .registry import check_name

SERVICE_NAME = "millpond.v1.Replay"
_METHODS = tuple(pb.DESCRIPTOR.services_by_name["Replay"].methods_by_name)
# The role the running call authenticated as (each call runs in a task of its own).
_ROLE: contextvars.ContextVar[str | None] = contextvars.ContextVar("millpond_role", default=None)


def _rpc(method: Callable) -> Callable:
    """The one error translator, and the role and readiness checks, around an RPC handler."""

    parse = _REQUESTS[method.__name__]

    @functools.wraps(method)
    async def handler(self: "ReplayService", raw: bytes, context: grpc.aio.ServicerContext):
        try:
            _ROLE.set(self.ops.auth.rpc_role(method.__name__, context))
            self.ops.check_ready()
            return await method(self, parse(raw), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            error = self.ops.classify(exc, method.__name__)
            status, code = status_for(error)
            await context.abort(status, str(error), trailing_metadata=((ERROR_CODE_KEY, code),))

    return handler


def _parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return message_class.FromString(raw)
        except DecodeError as exc:
            raise InvalidArgumentError(f"malformed {message_class.__name__}: {exc}") from None
    return parse


# Each method's request parser. PushBatch keeps its bytes: frames.py reads them on the pool.
_REQUESTS: dict[str, Callable[[bytes], Any]] = {
    name: (lambda raw: raw) if name == "PushBatch" else _parser(
        getattr(pb, pb.DESCRIPTOR.services_by_name["Replay"].methods_by_name[name].input_type.name))
    for name in _METHODS
}


def sample_reply_nbytes(schema: Schema, batch_size: int) -> int:
    """Exact wire size of the SampleReply for ``batch_size`` records."""
    return encoded_batch_nbytes(
        {f.name: (f.dtype.str, (batch_size, *f.shape), batch_size * f.nbytes) for f in schema})


def _budget(request_timeout: float | None, context: grpc.aio.ServicerContext) -> float | None:
    return wait_budget(request_timeout, context.time_remaining())


class ReplayService:
    """Adapts ``millpond.v1.Replay`` calls to the operations layer."""

    def __init__(self, ops: Operations, max_message_mb: int,
                 fastpath: FastPathServer | None = None, fastpath_off_reason: str = ""):
        self.ops = ops
        self.fastpath = fastpath
        self.fastpath_off_reason = fastpath_off_reason
        self.max_message_mb = max_message_mb
        self.max_message_bytes = max_message_mb * 1024 * 1024

    @_rpc
    async def Create(self, request: pb.CreateRequest, context) -> pb.CreateReply:
        name = check_name(request.name)
        info, created = await self.ops.run(self.ops.create, name,
                                           config_from_proto(request.config), _ROLE.get() == ADMIN)
        return pb.CreateReply(info=info_to_proto(info), created=created)

    @_rpc
    async def Push(self, request: pb.PushRequest, context) -> pb.PushReply:
        timeout = request.timeout if request.HasField("timeout") else None
        size, pushed = await self.ops.admit(_budget(timeout, context), self.ops.push,
                                            request.name, decode_batch(request.record))
        return pb.PushReply(size=size, pushed=pushed)

    @_rpc
    async def PushBatch(self, request: bytes, context) -> pb.PushReply:
        # Arrives unparsed (see add_to_server): parsing megabytes stays off the loop.
        timeout = decode_double(request, PUSH_TIMEOUT_FIELD)
        size, pushed = await self.ops.admit(_budget(timeout, context), self._push_frames, request,
                                            held=len(request))
        return pb.PushReply(size=size, pushed=pushed)

    def _push_frames(self, raw: bytes) -> tuple[int, int]:
        # Columns are views of the request bytes: the push is their only copy.
        priorities = decode_doubles(raw, PUSH_PRIORITIES_FIELD)
        return self.ops.push_batch(decode_name(raw), decode_batch_field(raw, PUSH_BATCH_FIELD),
                                   priorities if len(priorities) else None)

    @_rpc
    async def Sample(self, request: pb.SampleRequest, context) -> bytes:
        seed = request.seed if request.HasField("seed") else None
        timeout = request.timeout if request.HasField("timeout") else None
        return await self.ops.admit(_budget(timeout, context), self._sample_frames,
                                    request.name, request.batch_size, seed)

    def _sample_frames(self, name: str, batch_size: int, seed: int | None) -> bytes:
        schema = self.ops.registry.get(name).schema
        if batch_size > 0:
            nbytes = sample_reply_nbytes(schema, batch_size)
            if nbytes > self.max_message_bytes:
                raise MessageTooLargeError(
                    f"sample reply of {nbytes:,} bytes ({batch_size:,} records of "
                    f"{schema.record_nbytes:,} bytes) exceeds --max-message-mb "
                    f"{self.max_message_mb} ({self.max_message_bytes:,} bytes); "
                    "sample fewer records per call")
        return encode_with_batch(SAMPLE_BATCH_FIELD, self.ops.sample(name, batch_size, seed))

    @_rpc
    async def UpdatePriorities(self, request: pb.UpdatePrioritiesRequest,
                               context) -> pb.UpdatePrioritiesReply:
        updated = await self.ops.run(self.ops.update_priorities, request.name,
                                     list(request.indices), list(request.priorities))
        return pb.UpdatePrioritiesReply(updated=updated)

    @_rpc
    async def SetBeta(self, request: pb.SetBetaRequest, context) -> pb.SetBetaReply:
        self.ops.set_beta(request.name, request.beta)
        return pb.SetBetaReply()

    @_rpc
    async def Close(self, request: pb.CloseRequest, context) -> pb.CloseReply:
        await self.ops.run(self.ops.delete, request.name)
        return pb.CloseReply()

    @_rpc
    async def Info(self, request: pb.InfoRequest, context) -> pb.BufferInfo:
        return info_to_proto(await self.ops.run(self.ops.info, request.name))

    @_rpc
    async def List(self, request: pb.ListRequest, context) -> pb.ListReply:
        infos = await self.ops.run(self.ops.list)
        return pb.ListReply(buffers=[info_to_proto(info) for info in infos])

    @_rpc
    async def Negotiate(self, request: pb.NegotiateRequest, context) -> pb.NegotiateReply:
        boot_id = read_boot_id()
        if not boot_id or request.boot_id != boot_id:  # another host: tell it nothing
            return pb.NegotiateReply(shm=False)
        if self.fastpath is None:
            return pb.NegotiateReply(shm=False, reason=self.fastpath_off_reason)
        ticket = ""  # for a caller with no token to present (authenticated by certificate)
        role = _ROLE.get()
        if self.ops.auth.enabled and role and bearer_token(context.invocation_metadata()) is None:
            ticket = self.ops.auth.issue_ticket(role)
        return pb.NegotiateReply(shm=True, socket=self.fastpath.socket_name,
                                 boot_id=boot_id, uid=self.fastpath.uid, ticket=ticket)


def _passthrough_or_serialize(message) -> bytes:
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
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
