"""Calls sent as messages on open gRPC streams: one stream per thread and method.

A unary call pays gRPC's setup of a call (a new HTTP/2 stream, its headers,
call objects on both sides) on top of its message: here about as much as a
small push or sample itself. A message on a stream already open does not
(``make bench`` prints the bare figures: about 1.5x the round trips). So the
hot calls, PushBatch and Sample (of at most 64 KiB each way), go as messages of PushBatchStream and
SampleStream, which the daemon answers one by one with the unary calls' code,
with the same contract:

* one request, then its reply: a thread's calls never overlap on its stream,
  and every thread has its own;
* a caller waits at most its deadline; then its stream is cancelled (the
  daemon stops serving it, as for a unary call past its deadline) and the
  thread's next call opens a new one;
* an error ends the stream with the status the unary call would have had:
  the same typed exception; the next call opens a new stream. A stream that
  ended before it read the request (the daemon restarted, or closed it after
  --stream-idle-s without a message) is replaced and the request sent again on
  the new one: nothing had been done.

A stream ends with its thread, or when the client closes. Before the process
forks, idle streams are closed (gRPC skips its fork handlers while a call is
open); the threads' next calls open new ones.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any

import grpc

from millpond.errors import DeadlineExceededError, ServerUnavailableError

_ENDED = object()  # the stream ended without an error
# Statuses that end a stream, not the call: the call goes again on a new stream.
_RENEWABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
FORK_WAIT_S = 0.5  # a fork waits at most this for the streams it closed to end


class StreamBroken(Exception):
    """The stream had ended before it read the request: nothing was done. ``error``:
    the error that ended it, if any."""

    def __init__(self, error: grpc.RpcError | None = None):
        super().__init__(error)
        self.error = error


class CallStream:
    """One open stream of calls of one method, for one thread at a time.

    The replies are read by a thread of the stream's own, so that a caller
    can wait for its reply with a timeout (gRPC's iterator has none).
    """

    def __init__(self, method: grpc.StreamStreamMultiCallable,
                 metadata: tuple[tuple[str, str], ...] | None, address: str = ""):
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call = method(iter(self._requests.get, None), metadata=metadata,
                            wait_for_ready=True)
        self.broken = False
        self.error: grpc.RpcError | None = None  # what ended it
        # Held by a call under way, or by a window sending and receiving (PushWindow).
        self.busy = threading.Lock()
        self.outstanding = 0  # requests sent, replies not yet received
        self.reader = threading.Thread(target=self._read, daemon=True,
                                       name=f"millpond-stream {address}".rstrip())
        self.reader.start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
        except grpc.RpcError as error:
            self.error, self.broken = error, True
            self._replies.put(error)
        else:  # ended by close(), or by the daemon between two messages
            self.broken = True
            self._replies.put(_ENDED)

    def call(self, request: Any, timeout: float) -> Any:
        """The reply to ``request``, within ``timeout`` seconds.

        Raises StreamBroken if the stream ended before it read the request,
        grpc.RpcError if it ended with an error, DeadlineExceededError after
        ``timeout`` (the stream is cancelled then).
        """
        with self.busy:
            self.send(request)
            return self.receive(timeout)

    def send(self, request: Any) -> None:
        """Put ``request`` on the stream without waiting for its reply (the caller holds
        :attr:`busy`; replies come in order, each taken by :meth:`receive`).
        StreamBroken if the stream has ended."""
        if self.broken:
            raise StreamBroken(self.error)
        self._requests.put(request)
        self.outstanding += 1

    def receive(self, timeout: float) -> Any:
        """The reply to the oldest request sent and not yet answered; raises as :meth:`call`.
        The end of the stream is sticky: every later receive sees it too."""
        try:
            reply = self._replies.get(timeout=max(0.0, timeout))
        except queue.Empty:
            self.close()
            raise DeadlineExceededError(
                f"no reply within the deadline ({timeout:.3g} s)") from None
        self.outstanding -= 1
        if reply is _ENDED or isinstance(reply, grpc.RpcError):
            self._replies.put(reply)
        if reply is _ENDED:  # ended before it read the request: nothing was done
            raise StreamBroken()
        if isinstance(reply, grpc.RpcError):
            raise reply
        return reply

    def close_if_idle(self) -> bool:
        """:meth:`close`, unless a call is under way or replies are due; whether it closed."""
        if not self.busy.acquire(blocking=False):
            return False
        try:
            if self.outstanding:
                return False
            self.close()
        finally:
            self.busy.release()
        return True

    def close(self) -> None:
        """End the stream: no more requests, and the call cancelled. Idempotent."""
        self.broken = True
        self._requests.put(None)
        self._call.cancel()


class _Held:
    """A thread's reference to one of its streams: when the thread ends, this goes
    (thread-local) and closes the stream; the stream's reader holds the stream only."""

    def __init__(self, stream: CallStream):
        self.stream = stream
        weakref.finalize(self, stream.close)


class ThreadStreams:
    """Each thread's open stream of each method, made on first use."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] | None, address: str = ""):
        self.metadata = metadata
        self.address = address  # names the streams' reader threads
        self._local = threading.local()
        self._all: weakref.WeakSet[CallStream] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        _EVERY.add(self)

    def open_streams(self) -> list[CallStream]:
        """Every thread's streams that have not ended."""
        with self._lock:
            return [stream for stream in self._all if not stream.broken]

    def call(self, method: grpc.StreamStreamMultiCallable, request: Any, timeout: float) -> Any:
        """``method``'s reply to ``request`` on this thread's stream (see :class:`CallStream`);
        a stream that ended idle, cancelled or UNAVAILABLE is replaced and the request sent again,
        once. A stream refused before it read the request (no rights, over a limit), or
        a new one that ends before it reads it, raises the error that ended it, or
        ServerUnavailableError (the daemon stops)."""
        for attempt in range(2):
            stream = self._stream(method)
            try:
                return stream.call(request, timeout)
            except StreamBroken as broken:
                self._forget(method)
                error = broken.error
                # Ended idle, closed here (a fork), or by a daemon stopping or starting: a
                # new stream may do. Refused (no rights, over a limit): so would a new one.
                if error is not None and (attempt == 1 or error.code() not in _RENEWABLE):
                    raise error from None
            except BaseException:
                self._forget(method)  # ended, or cancelled: the next call opens another
                raise
        raise ServerUnavailableError("the server ended the call's stream before reading it "
                                     "(it is stopping); nothing was done")

    def _stream(self, method: grpc.StreamStreamMultiCallable) -> CallStream:
        held: dict[Any, _Held] | None = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = {}
        entry = held.get(method)
        if entry is None:
            entry = held[method] = _Held(self.open(method))
        return entry.stream

    def open(self, method: grpc.StreamStreamMultiCallable) -> CallStream:
        """A new stream of ``method``, closed with the others (:meth:`close`, a fork)."""
        with self._lock:  # not while close() runs: every stream made is closed
            if self._closed:
                raise ValueError("Cannot invoke RPC on closed channel!")  # as gRPC says
            stream = CallStream(method, self.metadata, self.address)
            self._all.add(stream)
        return stream

    def _forget(self, method: grpc.StreamStreamMultiCallable) -> None:
        entry = self._local.held.pop(method, None)
        if entry is not None:
            entry.stream.close()

    def close(self) -> None:
        """Close every thread's streams; later calls raise."""
        with self._lock:
            self._closed = True
            streams = list(self._all)
        for stream in streams:
            stream.close()


_EVERY: weakref.WeakSet[ThreadStreams] = weakref.WeakSet()


def _end_before_fork() -> None:
    """Close the idle open streams before the process forks, and wait (briefly) for them
    to end: gRPC skips its fork handlers while a call is open, as a stream is. Their
    threads' next calls open new streams; calls under way are left alone."""
    closed = [stream for every in list(_EVERY) for stream in every.open_streams()
              if stream.close_if_idle()]
    deadline = time.monotonic() + FORK_WAIT_S
    for stream in closed:
        stream.reader.join(max(0.0, deadline - time.monotonic()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_end_before_fork)
