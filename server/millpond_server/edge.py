"""The daemon's gRPC edge: who is calling, and how much of the daemon each caller may hold.

:class:`Gate` is the first server interceptor every call meets. It decides on the
call's metadata alone, before a byte of its body is read:

* **Authentication and rights.** A call without a token the daemon knows, or whose
  role may not call the method, is refused at once (UNAUTHENTICATED,
  PERMISSION_DENIED): it never holds a call slot and its body is never received.
* **Call slots.** A call, or a stream of calls, holds one slot from its start to
  its end: at most ``--max-calls-per-peer`` per peer address and
  ``--max-concurrent-calls`` in all. More are refused (RESOURCE_EXHAUSTED), never
  queued. gRPC's own ``maximum_concurrent_rpcs`` is not used: it refuses the
  health check too.
* **Time to the first message.** A call's request (a stream's first message) must
  arrive within ``--first-message-s``; a call that sends headers and then nothing
  is ended (DEADLINE_EXCEEDED) and gives its slot back.
* **Bytes in flight.** A request's bytes count from their arrival to the end of
  the call (a stream's message until the next one): at most
  ``--max-inflight-mb-per-peer`` per peer and ``--max-inflight-mb`` in all. A request
  beyond them is refused and dropped at once.

The health service's ``Check`` passes untouched: Kubernetes probes are answered
whatever the load. Everything here runs on the event loop only, so the counts
need no lock.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator
from urllib.parse import unquote

import grpc

from millpond.compat import timeout
from millpond.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    LimitExceededError,
    ReplayError,
)
from millpond.wire.status import ERROR_CODE_KEY, status_for

from .auth import Auth

# The role the running call authenticated as (each call runs in a task of its own).
CALLER_ROLE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "millpond_role", default=None)
REPLAY_PREFIX = "/millpond.v1.Replay/"
ALWAYS_ANSWERED = frozenset({"/grpc.health.v1.Health/Check"})


@dataclass(frozen=True)
class EdgeLimits:
    """What one peer, and all of them together, may hold of the daemon."""

    max_calls: int = 1024
    max_calls_per_peer: int = 512
    first_message_s: float = 30.0
    max_inflight_bytes: int = 2048 << 20
    max_inflight_bytes_per_peer: int = 1024 << 20


def peer_host(peer: str) -> str:
    """The address part of gRPC's ``context.peer()`` (``ipv4:10.0.0.7:51234`` ->
    ``ipv4:10.0.0.7``): every connection of one host is one peer."""
    kind, _, rest = unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer  # unix sockets and the like: one peer each


class Quota:
    """Amounts held per peer and in total, each under its limit."""

    def __init__(self, per_peer: int, total: int, what: str, flags: tuple[str, str]):
        self.per_peer, self.total = per_peer, total
        self.what, self.flags = what, flags
        self.held: Counter[str] = Counter()
        self.sum = 0

    def take(self, peer: str, amount: int) -> None:
        """Hold ``amount`` for ``peer``, or raise LimitExceededError holding nothing."""
        if self.held[peer] + amount > self.per_peer:
            raise LimitExceededError(
                f"this client's host already holds {self.held[peer]:,} {self.what} of the "
                f"{self.per_peer:,} one host may ({self.flags[0]}); retry when some end")
        if self.sum + amount > self.total:
            raise LimitExceededError(
                f"the server already holds {self.sum:,} {self.what} of the {self.total:,} it "
                f"allows ({self.flags[1]}); retry when some end")
        self.held[peer] += amount
        self.sum += amount

    def give(self, peer: str, amount: int) -> None:
        self.held[peer] -= amount
        if self.held[peer] <= 0:
            del self.held[peer]
        self.sum -= amount

    @contextlib.contextmanager
    def holding(self, peer: str, amount: int) -> Iterator[None]:
        self.take(peer, amount)
        try:
            yield
        finally:
            self.give(peer, amount)


class Gate(grpc.aio.ServerInterceptor):
    """Authenticates and bounds every Replay call before its body is read; see the
    module docstring. ``refused(method, status)`` (the metrics), if given, is told of
    each call the gate ends."""

    def __init__(self, auth: Auth, limits: EdgeLimits,
                 refused: Callable[[str, str], None] | None = None):
        self.auth, self.limits, self.refused = auth, limits, refused
        self.calls = Quota(limits.max_calls_per_peer, limits.max_calls, "calls",
                           ("--max-calls-per-peer", "--max-concurrent-calls"))
        self.inflight = Quota(limits.max_inflight_bytes_per_peer, limits.max_inflight_bytes,
                              "request bytes", ("--max-inflight-mb-per-peer", "--max-inflight-mb"))

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in ALWAYS_ANSWERED:
            return handler
        method = details.method.rpartition("/")[2]
        if not details.method.startswith(REPLAY_PREFIX):  # health Watch and the like: counted
            return self._bounded(handler, method, None)
        try:
            role = self.auth.call_role(method, details.invocation_metadata)
        except ReplayError as error:
            return self._refusal(handler, method, error)
        return self._bounded(handler, method, role)

    # ---- handlers -------------------------------------------------------------------

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str,
                 error: ReplayError) -> grpc.RpcMethodHandler:
        """A handler of the same kind that ends the call with ``error``, reading nothing."""
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._abort(context, method, error)
        return _rebuilt(handler, refuse, stream_reply=handler.response_streaming)

    def _bounded(self, handler: grpc.RpcMethodHandler, method: str,
                 role: str | None) -> grpc.RpcMethodHandler:
        """``handler`` run holding a call slot, its request read under the gate's limits
        (a unary request is read here: a handler of a client stream)."""
        if handler.request_streaming and handler.response_streaming:
            return _rebuilt(handler, self._stream(handler.stream_stream, method, role), True)
        if handler.unary_unary is not None:
            return _rebuilt(handler, self._unary(handler.unary_unary, method, role), False)
        if handler.unary_stream is not None:
            return _rebuilt(handler, self._watch(handler.unary_stream, method), True)
        return handler  # no Replay method is a client stream with one reply

    def _unary(self, inner: Callable, method: str, role: str | None) -> Callable:
        async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            peer = peer_host(context.peer())
            try:
                with self.calls.holding(peer, 1):
                    request = await self._only(requests)
                    with self.inflight.holding(peer, _nbytes(request)):
                        CALLER_ROLE.set(role)
                        return await inner(request, context)
            except ReplayError as error:
                await self._abort(context, method, error)
        return call

    def _watch(self, inner: Callable, method: str) -> Callable:
        """A server stream that writes its replies with ``context.write`` (the health
        service's Watch): it holds a call slot while it lasts."""
        async def watch(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
            peer = peer_host(context.peer())
            try:
                with self.calls.holding(peer, 1):
                    await inner(await self._first(requests), context)
            except ReplayError as error:
                await self._abort(context, method, error)
        return watch

    def _stream(self, inner: Callable, method: str, role: str | None) -> Callable:
        async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
            peer = peer_host(context.peer())
            held = [0]  # bytes of the message being served, given back with its reply
            try:
                with self.calls.holding(peer, 1):
                    CALLER_ROLE.set(role)
                    try:
                        async for reply in inner(self._counted(requests, peer, held), context):
                            self.inflight.give(peer, held[0])
                            held[0] = 0
                            yield reply
                    finally:
                        self.inflight.give(peer, held[0])
            except ReplayError as error:
                await self._abort(context, method, error)
        return stream

    async def _first(self, requests: AsyncIterator[Any]) -> Any:
        """The first message, within --first-message-s of the call's start."""
        try:
            async with timeout(self.limits.first_message_s):
                return await anext(aiter(requests))
        except TimeoutError:
            raise self._late() from None

    async def _only(self, requests: AsyncIterator[Any]) -> Any:
        """A unary call's one request, and the end of its requests, within
        --first-message-s. (Reading to the end also lets gRPC's receiver drop its
        reference to the request: else a cancelled call's request stays in memory
        until a full garbage collection.)"""
        messages = aiter(requests)
        try:
            async with timeout(self.limits.first_message_s):
                request = await anext(messages)
                await anext(messages)
        except StopAsyncIteration:
            return request
        except TimeoutError:
            raise self._late() from None
        raise InvalidArgumentError("a unary call carried more than one request")

    def _late(self) -> DeadlineExceededError:
        return DeadlineExceededError(
            f"the request did not arrive within {self.limits.first_message_s:g} s of the "
            "call's start (--first-message-s)")

    async def _counted(self, requests: AsyncIterator[Any], peer: str,
                       held: list[int]) -> AsyncIterator[Any]:
        """A stream's messages, each counted in flight (``held[0]``) until its reply; the
        first must arrive within --first-message-s (the stream's idle limit covers the
        others)."""
        request = await self._first(requests)
        while True:
            self.inflight.take(peer, _nbytes(request))
            held[0] = _nbytes(request)
            yield request
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return

    async def _abort(self, context: grpc.aio.ServicerContext, method: str,
                     error: ReplayError) -> None:
        status, code = status_for(error)
        if self.refused is not None:
            self.refused(method, status.name)
        await context.abort(status, str(error), trailing_metadata=((ERROR_CODE_KEY, code),))


def _nbytes(request: Any) -> int:
    return len(request) if isinstance(request, (bytes, memoryview)) else request.ByteSize()


def _rebuilt(handler: grpc.RpcMethodHandler, behavior: Callable,
             stream_reply: bool) -> grpc.RpcMethodHandler:
    """A handler whose ``behavior`` reads the requests itself (a client stream, which
    a unary client's one message is on the wire), with ``handler``'s serializers."""
    make = (grpc.stream_stream_rpc_method_handler if stream_reply
            else grpc.stream_unary_rpc_method_handler)
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
