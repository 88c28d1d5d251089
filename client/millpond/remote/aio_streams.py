"""Calls sent as messages on open gRPC streams, for coroutines: a pool of streams per method.

The asyncio twin of :mod:`millpond.remote.grpc_streams`, with the same contract, for the
same reason (a message on a stream already open skips the setup a unary call pays:
measured here, a ``sample(256)`` of a small schema makes about twice the calls per
second on a stream as a unary ``grpc.aio`` call). Threads each keep their own stream
there; here any number of tasks share one event loop, so streams are pooled:

* a call takes an idle stream of its method (or opens one), sends its one request,
  waits for its reply and puts the stream back: a stream carries one call at a time,
  and as many streams are open as calls are in flight. A sample waiting for a rate
  limiter holds its own stream and no other call's;
* a caller waits at most its deadline; then its stream is cancelled (the daemon stops
  serving it, as for a unary call past its deadline) and not put back;
* a task cancelled while it waits cancels its stream too: the daemon drops the call
  (a sample parked on the rate limiter is withdrawn and draws nothing);
* an error ends the stream with the status the unary call would have had: the same
  typed exception. A stream that had ended before the daemon read the request (left
  idle for ``--stream-idle-s``, or the daemon stopping between two messages) is
  replaced and the request sent again on the new one, once: nothing had been done.
  A stream the daemon ended while the request was being written (it refused the call on
  its headers) reports only a local INTERNAL error in place of the daemon's status
  (grpc/grpc#36066): :class:`Unsent` then, and the caller sends the request as a unary
  call, whose status is the daemon's own.

At most :data:`MAX_IDLE` idle streams are kept per method (an open stream holds one of
the daemon's call slots); the daemon ends those left idle, and the next call that takes
one finds it ended and opens another.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from millpond.compat import timeout_at
from millpond.errors import DeadlineExceededError, ServerUnavailableError

# Idle streams kept per method, for the next calls.
MAX_IDLE = 8
CLOSE_WAIT_S = 1.0  # closing waits at most this for the idle streams to have ended
# Statuses that end a stream, not the call: the call goes again on a new stream.
_RENEWABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class _Broken(Exception):
    """The stream had ended before it read the request: nothing was done. ``error``: the
    error that ended it, if any."""

    def __init__(self, error: grpc.RpcError | None = None):
        super().__init__(error)
        self.error = error


class Unsent(Exception):
    """The stream ended as the request was written: the daemon did not read it, and gRPC
    hides why. The request may go again as a unary call."""


class StreamPool:
    """Open streams of one stream-stream method, each carrying one call at a time."""

    def __init__(self, method: grpc.aio.StreamStreamMultiCallable,
                 metadata: tuple[tuple[str, str], ...] | None):
        self._method = method
        self._metadata = metadata
        self._idle: list[grpc.aio.StreamStreamCall] = []
        self._closed = False

    async def call(self, request: bytes, timeout: float) -> Any:
        """The reply to ``request`` on an idle stream of this pool (or a new one), within
        ``timeout`` seconds. Raises grpc.RpcError if the call ended with an error,
        DeadlineExceededError after ``timeout`` (the stream is cancelled then),
        ServerUnavailableError if the daemon ended two streams before reading it, Unsent
        if the write of ``request`` failed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, timeout)
        for attempt in range(2):
            stream = self._take()
            try:
                async with timeout_at(end) as scope:
                    reply = await _exchange(stream, request)
            except _Broken as broken:
                stream.cancel()
                error = broken.error
                # Ended idle, or by a daemon stopping or starting: a new stream may do.
                # Refused (no rights, over a limit): so would a new one.
                if error is not None and (attempt == 1 or error.code() not in _RENEWABLE):
                    raise error from None
                continue
            except TimeoutError:
                stream.cancel()
                if not scope.expired():
                    raise
                raise DeadlineExceededError(
                    f"no reply within the deadline ({timeout:.3g} s)") from None
            except BaseException:  # its error ended it, or this task was cancelled
                stream.cancel()
                raise
            self._give_back(stream)
            return reply
        raise ServerUnavailableError("the server ended the call's stream before reading it "
                                     "(it is stopping); nothing was done")

    def _take(self) -> grpc.aio.StreamStreamCall:
        if self._closed:
            raise ValueError("Cannot invoke RPC on closed channel!")  # as gRPC says
        while self._idle:
            stream = self._idle.pop()  # the newest: the least likely to have been ended idle
            if not stream.done():
                return stream
        return self._method(metadata=self._metadata, wait_for_ready=True)

    def _give_back(self, stream: grpc.aio.StreamStreamCall) -> None:
        if self._closed or len(self._idle) >= MAX_IDLE:
            stream.cancel()
        else:
            self._idle.append(stream)

    async def close(self) -> None:
        """End the idle streams, and wait (briefly) for them to have ended: the event loop
        may close next, and gRPC would still have their ends to deliver to it. Streams in
        use end when their calls do. Later calls raise."""
        self._closed = True
        idle, self._idle = self._idle, []
        for stream in idle:
            stream.cancel()
        if idle:
            await asyncio.wait([asyncio.ensure_future(stream.code()) for stream in idle],
                               timeout=CLOSE_WAIT_S)


async def _exchange(stream: grpc.aio.StreamStreamCall, request: bytes) -> Any:
    """Write ``request`` on ``stream`` and read its reply; _Broken if the stream had ended
    before the daemon read the request."""
    if stream.done():
        raise _Broken(await _ending(stream))
    try:
        await stream.write(request)
    except asyncio.InvalidStateError:  # it ended meanwhile
        raise _Broken(await _ending(stream)) from None
    except grpc.RpcError as error:  # it had ended with an error: it read nothing more
        if error.code() == grpc.StatusCode.INTERNAL:  # gRPC's own, for a failed write
            raise Unsent() from error
        raise _Broken(error) from None
    reply = await stream.read()
    if reply is grpc.aio.EOF:  # ended (OK) between two messages: ours was not read
        raise _Broken()
    return reply


async def _ending(stream: grpc.aio.StreamStreamCall) -> grpc.RpcError | None:
    """The error a stream that is done ended with (None: it ended OK)."""
    code = await stream.code()
    if code == grpc.StatusCode.OK:
        return None
    return grpc.aio.AioRpcError(code, await stream.initial_metadata(),
                                await stream.trailing_metadata(), await stream.details())
