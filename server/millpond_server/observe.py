"""What each gRPC call did, for metrics and logs: a server interceptor.

Installed only when something uses it (``--metrics-port``, ``--log-format
json`` or ``--log-level debug``), so a plain daemon's calls pay nothing. For
each unary call, and each message of a stream of calls (PushBatchStream's
as PushBatch calls), it:

* sets :data:`.logs.CALL` for the call's task, so every line logged while
  serving it names its ``method``, ``peer`` and ``buffer`` (the name is read
  from the request bytes only when a line is logged);
* reports the method, the outcome (``OK`` or the gRPC status name), the
  seconds taken and the buffer named (read from the request's bytes) to
  :meth:`.metrics.Metrics.call`;
* logs one ``call`` line at debug level.

The fast path reports its calls to the same place from its session threads
(:attr:`.operations.Operations.observer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from millpond.v1 import replay_pb2 as pb
from millpond.wire.frames import decode_name

from .logs import CALL
from .service import STREAMED

log = logging.getLogger("millpond.calls")

# Methods whose request has the buffer name in field 1 (all that name one).
NAMED = frozenset(
    method.name for method in pb.DESCRIPTOR.services_by_name["Replay"].methods
    if (first := method.input_type.fields_by_number.get(1)) is not None and first.name == "name")


class CallContext:
    """The call being served: its method, peer and (parsed lazily) buffer."""

    __slots__ = ("method", "peer", "request")

    def __init__(self, method: str, peer: str, request: Any):
        self.method, self.peer, self.request = method, peer, request

    @property
    def buffer(self) -> str | None:
        if self.method not in NAMED or not isinstance(self.request, (bytes, memoryview)):
            return None
        try:
            return decode_name(self.request) or None
        except Exception:  # a malformed request: its error says so
            return None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "peer": self.peer}
        buffer = self.buffer
        if buffer is not None:
            out["buffer"] = buffer
        return out


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """Times unary calls and names them in log lines; see the module docstring.

    ``report(transport, method, code, seconds, buffer)``: where outcomes go (the
    metrics), or None.
    """

    def __init__(self, report: Callable[[str, str, str, float, str | None], None] | None):
        self.report = report

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method.rpartition("/")[2]
        if handler.stream_stream is not None and method in STREAMED:
            return grpc.stream_stream_rpc_method_handler(
                self._observed_stream(handler.stream_stream, STREAMED[method]),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            call = CallContext(method, context.peer(), request)
            CALL.set(call)
            try:
                result = await inner(request, context)
            except BaseException as error:
                self._ended(call, _failure(error, context), start)
                raise
            self._ended(call, _code(context) or "OK", start)
            return result

        return grpc.unary_unary_rpc_method_handler(
            observed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _observed_stream(self, inner: Callable, method: str) -> Callable:
        """A stream whose every message is observed as a call of ``method`` (from its
        request to its reply), and names that method in log lines."""

        async def observed(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[Any]:
            started: float | None = None  # the message being served
            call: CallContext | None = None

            async def pulled() -> AsyncIterator[Any]:
                nonlocal started, call
                async for request in requests:
                    started = time.perf_counter()
                    call = CallContext(method, context.peer(), request)
                    CALL.set(call)
                    yield request

            try:
                async for reply in inner(pulled(), context):
                    assert started is not None and call is not None
                    self._ended(call, "OK", started)
                    started = None
                    yield reply
            except BaseException as error:
                if started is not None and call is not None:  # the message whose error ended it
                    self._ended(call, _failure(error, context), started)
                raise

        return observed

    def _ended(self, call: CallContext, code: str, start: float) -> None:
        """Report and log one call (or message) that began at ``start``."""
        seconds = time.perf_counter() - start
        if self.report is not None:
            self.report("grpc", call.method, code, seconds, call.buffer)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("call", extra={"kv": {"code": code, "ms": round(seconds * 1e3, 3)}})


def _failure(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    """The outcome of a call (or message) whose handler raised ``error``."""
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    return _code(context) or "UNKNOWN"


def _code(context: grpc.aio.ServicerContext) -> str | None:
    """The status the handler set (by abort or set_code), if any."""
    try:
        code = context.code()
    except Exception:
        return None
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return grpc.StatusCode(code).name if isinstance(code, tuple) else str(code)
