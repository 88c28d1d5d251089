"""The ``millpond.v1.Replay`` gRPC service (grpc.aio).

Each handler is decode -> engine call -> encode. Engine calls that may block
(disk, big copies, lock waits) run on a thread pool, never on the event loop.
Errors are translated in one place, :func:`translate_errors`, applied to every
RPC of the class: a :class:`~millpond.errors.ReplayError` becomes its catalog
status plus the stable code in trailing metadata; anything else is a bug,
logged with its traceback and reported as INTERNAL.

Bulk paths avoid needless copies of multi-megabyte payloads:

* ``PushBatch`` requests arrive as raw bytes and are parsed on the pool by
  :mod:`millpond.wire.frames` into views of those bytes (no copy);
* ``Sample`` replies are encoded on the pool by the same module: the gathered
  arrays are joined once into the reply's wire bytes, sent as they are.

Rate-limited pushes and samples never wait on the pool (a few waiting
learners would starve every other buffer): the pool only *tries* them
(``timeout=0``); while they would wait, the handler awaits the buffer's next
change on the event loop, up to the call's deadline. A client that goes away
cancels its handler, and with it the wait.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from concurrent.futures import Executor
from typing import Callable

import grpc

from millpond.core import Schema, TieredBuffer
from millpond.core.ratelimit import RateState
from millpond.errors import (
    InternalError,
    MessageTooLargeError,
    RateLimitTimeoutError,
    ReplayError,
    StorageIOError,
)
from millpond.shm.protocol import read_boot_id
from millpond.v1 import replay_pb2 as pb
from millpond.core.prioritized import PrioritizedTieredBuffer, as_prioritized
from millpond.wire.codec import (
    decode_batch,
    decode_config,
    decode_prioritized,
    decode_sampling,
    encode_config,
)
from millpond.wire.frames import (
    PUSH_BATCH_FIELD,
    PUSH_PRIORITIES_FIELD,
    decode_doubles,
    SAMPLE_BATCH_FIELD,
    decode_batch_field,
    decode_name,
    encode_with_batch,
    encoded_batch_nbytes,
)
from millpond.wire.status import ERROR_CODE_KEY, status_for

from .fastpath import FastPathServer
from .fatal import fatal_storage_error
from .registry import Registry, check_name

log = logging.getLogger("millpond.service")

SERVICE_NAME = "millpond.v1.Replay"
_METHODS = tuple(pb.DESCRIPTOR.services_by_name["Replay"].methods_by_name)


# ---- the one error translator -----------------------------------------------------

def _rpc(method: Callable) -> Callable:
    @functools.wraps(method)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is recovering its buffers; retry shortly",
                                trailing_metadata=((ERROR_CODE_KEY, "UNAVAILABLE"),))
        try:
            return await method(self, request, context)
        except StorageIOError as exc:
            fatal_storage_error(exc)
        except ReplayError as exc:
            status, code = status_for(exc)
            await context.abort(status, str(exc), trailing_metadata=((ERROR_CODE_KEY, code),))
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("unexpected error", extra={"kv": {"rpc": method.__name__}})
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal server error in {method.__name__}: {type(exc).__name__}: {exc}",
                trailing_metadata=((ERROR_CODE_KEY, InternalError.code),),
            )

    return handler


def translate_errors(cls: type) -> type:
    """Wrap every RPC method of the service class in the error translator."""
    for name in _METHODS:
        setattr(cls, name, _rpc(getattr(cls, name)))
    return cls


# ---- wire helpers -------------------------------------------------------------------

def buffer_info(name: str, buffer: TieredBuffer, waiters: "_Waiters | None" = None
                ) -> pb.BufferInfo:
    info = buffer.info()
    if waiters is not None:
        waiters.add_stats(info)
    prioritized = ((buffer.alpha, buffer.beta)
                   if isinstance(buffer, PrioritizedTieredBuffer) else None)
    return pb.BufferInfo(
        name=name,
        config=encode_config(buffer.schema, info["hot_capacity"], info["total_capacity"],
                             prioritized, buffer.sampling),
        cold_path=info["cold_path"] or "",
        **{key: info[key] for key in _INFO_NUMBERS},
    )


_INFO_NUMBERS = ("size", "pushed", "hot_size", "cold_size", "record_nbytes", "inserts",
                 "samples", "insert_waits", "sample_waits", "insert_wait_seconds",
                 "sample_wait_seconds", "samples_per_insert", "waiting_inserts",
                 "waiting_samples")


def sample_reply_nbytes(schema: Schema, batch_size: int) -> int:
    """Exact wire size of the SampleReply for ``batch_size`` records."""
    return encoded_batch_nbytes(
        {f.name: (f.dtype.str, (batch_size, *f.shape), batch_size * f.nbytes) for f in schema}
    )


def _passthrough_or_serialize(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class _WouldWait(Exception):
    """A try on the pool found the rate limiter closed: retry ``call`` once it may pass."""

    def __init__(self, buffer: TieredBuffer, kind: str, n: int, call: Callable):
        super().__init__(kind)
        self.buffer, self.kind, self.n, self.call = buffer, kind, n, call


def attempt(buffer: TieredBuffer, kind: str, n: int, call: Callable):
    """Run ``call()`` (an engine call with ``timeout=0``); raise _WouldWait if it would wait."""
    try:
        return call()
    except RateLimitTimeoutError:
        raise _WouldWait(buffer, kind, n, call) from None


class _Waiters:
    """The handlers waiting for one buffer to change, and the event that wakes them.

    The buffer calls :meth:`changed` from any thread, with its lock held;
    only when someone waits does that cost a hop to the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, buffer: TieredBuffer):
        self.loop = loop
        self.count = 0
        self.event = asyncio.Event()
        # Statistics of these waits (the engine counts only its own), loop-owned.
        self.stats = RateState(None)
        buffer.add_listener(self.changed)

    def started(self, kind: str) -> None:
        self.count += 1
        self.stats.wait_started(kind)

    def ended(self, kind: str, seconds: float) -> None:
        self.count -= 1
        self.stats.wait_ended(kind, seconds)

    def add_stats(self, info: dict) -> None:
        """Add these waits to a buffer's ``info()``."""
        for key, value in self.stats.wait_stats().items():
            info[key] += value

    def changed(self) -> None:
        if self.count:
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


# ---- the service --------------------------------------------------------------------

@translate_errors
class ReplayService:
    """Adapts ``millpond.v1.Replay`` calls to the registry and its buffers."""

    def __init__(self, registry: Registry, executor: Executor, max_message_mb: int,
                 fastpath: FastPathServer | None = None, fastpath_off_reason: str = ""):
        self.registry = registry
        self.ready = False  # set once the buffers are recovered
        self.fastpath = fastpath
        self.fastpath_off_reason = fastpath_off_reason
        self.executor = executor
        self.max_message_mb = max_message_mb
        self.max_message_bytes = max_message_mb * 1024 * 1024
        # Per buffer, set up on its first wait; gone with the buffer.
        self._waiters: weakref.WeakKeyDictionary[TieredBuffer, _Waiters] = \
            weakref.WeakKeyDictionary()

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _admit(self, context, fn: Callable, *args):
        """Run ``fn(*args)`` on the pool; if it must wait for a rate limiter, wait here."""
        try:
            return await self._run(fn, *args)
        except _WouldWait as wait:
            return await self._wait_and_retry(context, wait)

    async def _wait_and_retry(self, context, wait: _WouldWait):
        """Retry ``wait.call`` each time its buffer changes, until it passes or the
        call's deadline (less a margin, so the caller gets our clear error)."""
        loop = asyncio.get_running_loop()
        buffer, start = wait.buffer, loop.time()
        waiters = self._waiters.get(buffer)
        if waiters is None:
            waiters = self._waiters[buffer] = _Waiters(loop, buffer)
        remaining = context.time_remaining()
        deadline = None if remaining is None else start + remaining - min(0.05, remaining / 10)
        waiters.started(wait.kind)
        try:
            while True:
                event = waiters.event  # before the check: a change after it sets this one
                if not buffer.would_wait(wait.kind, wait.n):
                    try:
                        return await self._run(attempt, buffer, wait.kind, wait.n, wait.call)
                    except _WouldWait:
                        pass
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise RateLimitTimeoutError(
                        f"{wait.kind} of {wait.n} records waited {loop.time() - start:.3g} s "
                        f"for the rate limiter until the call's deadline "
                        f"({buffer.describe_rate()}); pass a longer timeout")
                try:
                    await asyncio.wait_for(event.wait(), left)
                except TimeoutError:
                    pass
        finally:
            waiters.ended(wait.kind, loop.time() - start)

    async def Create(self, request: pb.CreateRequest, context) -> pb.BufferInfo:
        name = check_name(request.name)
        schema, hot, total = decode_config(request.config)
        prioritized = decode_prioritized(request.config)
        sampling = decode_sampling(request.config)
        buffer, _ = await self._run(self.registry.create, name, schema, hot, total, prioritized,
                                    sampling)
        return await self._run(buffer_info, name, buffer)

    async def Push(self, request: pb.PushRequest, context) -> pb.PushReply:
        buffer = self.registry.get(request.name)
        record = decode_batch(request.record)
        return await self._admit(context, attempt, buffer, "insert", 1,
                                 functools.partial(self._push, buffer, record))

    @staticmethod
    def _push(buffer: TieredBuffer, record: dict) -> pb.PushReply:
        buffer.push(record, timeout=0)
        return pb.PushReply(size=len(buffer), pushed=buffer.pushed)

    async def PushBatch(self, request: bytes, context) -> pb.PushReply:
        # Arrives unparsed (see add_to_server): parsing megabytes stays off the loop.
        return await self._admit(context, self._push_batch, request)

    def _push_batch(self, raw: bytes) -> pb.PushReply:
        # Columns are views of the request bytes: the push is their only copy.
        buffer = self.registry.get(decode_name(raw))
        columns = decode_batch_field(raw, PUSH_BATCH_FIELD)
        priorities = decode_doubles(raw, PUSH_PRIORITIES_FIELD)
        n = len(next(iter(columns.values()))) if columns else 0
        return attempt(buffer, "insert", n, functools.partial(
            self._push_columns, buffer, columns, priorities))

    @staticmethod
    def _push_columns(buffer: TieredBuffer, columns: dict, priorities) -> pb.PushReply:
        if len(priorities):
            as_prioritized(buffer).push_batch(columns, priorities, timeout=0)
        else:
            buffer.push_batch(columns, timeout=0)
        return pb.PushReply(size=len(buffer), pushed=buffer.pushed)

    async def UpdatePriorities(self, request: pb.UpdatePrioritiesRequest,
                               context) -> pb.UpdatePrioritiesReply:
        buffer = as_prioritized(self.registry.get(request.name))
        updated = await self._run(buffer.update_priorities, list(request.indices),
                                  list(request.priorities))
        return pb.UpdatePrioritiesReply(updated=updated)

    async def SetBeta(self, request: pb.SetBetaRequest, context) -> pb.SetBetaReply:
        as_prioritized(self.registry.get(request.name)).set_beta(request.beta)
        return pb.SetBetaReply()

    async def Sample(self, request: pb.SampleRequest, context) -> bytes:
        buffer = self.registry.get(request.name)
        seed = request.seed if request.HasField("seed") else None
        return await self._admit(context, attempt, buffer, "sample", request.batch_size,
                                 functools.partial(self._sample, buffer, request.batch_size, seed))

    def _sample(self, buffer: TieredBuffer, batch_size: int, seed: int | None) -> bytes:
        if batch_size > 0:
            nbytes = sample_reply_nbytes(buffer.schema, batch_size)
            if nbytes > self.max_message_bytes:
                raise MessageTooLargeError(
                    f"sample reply of {nbytes:,} bytes ({batch_size:,} records of "
                    f"{buffer.schema.record_nbytes:,} bytes) exceeds --max-message-mb "
                    f"{self.max_message_mb} ({self.max_message_bytes:,} bytes); "
                    "sample fewer records per call"
                )
        return encode_with_batch(SAMPLE_BATCH_FIELD, buffer.sample(batch_size, seed, timeout=0))

    async def Close(self, request: pb.CloseRequest, context) -> pb.CloseReply:
        await self._run(self.registry.close, request.name)
        return pb.CloseReply()

    async def Info(self, request: pb.InfoRequest, context) -> pb.BufferInfo:
        buffer = self.registry.get(request.name)
        return await self._run(buffer_info, request.name, buffer,
                               self._waiters.get(buffer))

    async def List(self, request: pb.ListRequest, context) -> pb.ListReply:
        return await self._run(self._list)

    def _list(self) -> pb.ListReply:
        return pb.ListReply(buffers=[buffer_info(n, b, self._waiters.get(b))
                                     for n, b in self.registry.list()])

    async def Negotiate(self, request: pb.NegotiateRequest, context) -> pb.NegotiateReply:
        if self.fastpath is None:
            return pb.NegotiateReply(shm=False, reason=self.fastpath_off_reason)
        return pb.NegotiateReply(shm=True, socket=self.fastpath.socket_name,
                                 boot_id=read_boot_id(), uid=self.fastpath.uid)


def add_to_server(service: ReplayService, server: grpc.aio.Server) -> None:
    """Register the service like the generated ``add_ReplayServicer_to_server``,
    except that PushBatch requests are handed over unparsed and handlers may
    return already-serialized replies (bytes)."""
    requests = {
        "Create": pb.CreateRequest.FromString,
        "Push": pb.PushRequest.FromString,
        "PushBatch": None,  # handed over as bytes, parsed on the pool
        "Sample": pb.SampleRequest.FromString,
        "Close": pb.CloseRequest.FromString,
        "Info": pb.InfoRequest.FromString,
        "List": pb.ListRequest.FromString,
        "Negotiate": pb.NegotiateRequest.FromString,
        "UpdatePriorities": pb.UpdatePrioritiesRequest.FromString,
        "SetBeta": pb.SetBetaRequest.FromString,
    }
    assert set(requests) == set(_METHODS), "service methods changed: update add_to_server"
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(service, name),
            request_deserializer=parse,
            response_serializer=_passthrough_or_serialize,
        )
        for name, parse in requests.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
