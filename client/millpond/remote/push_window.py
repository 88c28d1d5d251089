"""An actor's pushes in flight: ``connect(max_in_flight=N)`` (Reverb's ``max_in_flight_items``).

A push that waits for its acknowledgement before the next one is sent leaves
the daemon idle for a round trip per push. A :class:`PushWindow` sends a
handle's pushes as messages of one PushBatchStream of its own and returns at
once, as long as fewer than ``size`` are unacknowledged; the daemon serves a
stream's messages one after another, in the order sent. The contract:

* :meth:`PushWindow.send` returns once the push is on its way; while ``size``
  pushes are unacknowledged it first waits for the oldest reply;
* :meth:`PushWindow.flush` returns once every push sent is acknowledged
  (stored by the daemon, with the durability an acknowledged push has);
* a failed push is raised by the next :meth:`~PushWindow.send` or
  :meth:`~PushWindow.flush`. The daemon ends a stream at its first error and
  serves nothing after it, so the pushes sent after the failed one were not
  stored: they are dropped, and a note on the error says how many;
* pushes whose stream ended before the daemon read them (it ended an idle
  stream, it was still starting) are sent again, in order, on a new stream;
* a reply that does not come within its push's deadline is a
  DeadlineExceededError: that push and the ones after it may or may not have
  been stored;
* each reply is checked by its push's ``check`` (the transport's: a
  ProtocolError for one that cannot be the answer), given the ``pushed`` of
  the reply before it on the same stream when that must be smaller (an
  ``ordered`` window: see :mod:`millpond.remote.replies`). A reply refused
  fails its push like an error: the stream is ended, and the pushes after it
  may or may not have been stored.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import grpc

from millpond.compat import add_note
from millpond.errors import (
    DeadlineExceededError,
    ProtocolError,
    ServerStartingError,
    ServerUnavailableError,
)
from millpond.remote.grpc_streams import CallStream, StreamBroken, ThreadStreams
from millpond.wire.status import error_from_rpc

# Sends again of the pushes of a stream that ended before serving them, in a row.
MAX_RESENDS = 3
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0
# A push's check of its reply: (reply, pushed of the reply before it on the stream or
# None) -> the reply's pushed; raises ProtocolError.
Check = Callable[[Any, "int | None"], int]


class PushWindow:
    """At most ``size`` pushes unacknowledged on one stream; see the module docstring.
    Thread-safe: pushes from several threads go out in the order they take the lock."""

    def __init__(self, streams: ThreadStreams, method: grpc.StreamStreamMultiCallable,
                 size: int, ordered: bool = False):
        self.size = size
        self.ordered = ordered
        self._streams = streams
        self._method = method
        self._stream: CallStream | None = None
        self._pushed: int | None = None  # the last reply's on this stream (ordered)
        self._pending: collections.deque[tuple[bytes, float, Check | None]] = \
            collections.deque()
        self._error: BaseException | None = None  # raised by the next send or flush
        self._lock = threading.Lock()
        _LIVE.add(self)

    def send(self, request: bytes, deadline: float, check: Check | None = None) -> None:
        """Send ``request`` (a framed PushBatchRequest), to be acknowledged within
        ``deadline`` seconds, its reply checked by ``check``; see the module docstring.
        Raises the failure of an earlier push instead of sending (then this one is not
        sent)."""
        with self._lock:
            self._raise_kept()
            if self._stream is not None and self._stream.broken:  # it may have failed
                self._settle_all()
                self._end_stream()  # what it carried is settled: the next goes on a new one
            while len(self._pending) >= self.size:
                self._settle_oldest()
                self._raise_kept()
            self._pending.append((request, time.monotonic() + deadline, check))
            self._send_pending([self._pending[-1]])
            if _exiting:  # nobody is left to flush it: acknowledged before returning
                self._settle_all()

    def flush(self) -> None:
        """Return once every push sent is acknowledged; raise the first that failed."""
        with self._lock:
            self._settle_all()

    def close(self) -> None:
        """:meth:`flush`, then end the stream."""
        try:
            self.flush()
        finally:
            with self._lock:
                self._end_stream()

    # ---- under the lock ---------------------------------------------------------------

    def _settle_oldest(self) -> None:
        """Take the oldest push's reply, or settle its failure."""
        resends, delay = 0, _RETRY_FIRST
        while True:
            _, end, check = self._pending[0]
            stream = self._stream
            assert stream is not None  # every pending push was sent on it
            try:
                with stream.busy:
                    reply = stream.receive(end - time.monotonic())
                if check is not None:
                    pushed = check(reply, self._pushed)
                    self._pushed = pushed if self.ordered else None
                self._pending.popleft()
                return
            except ProtocolError as exc:  # stored, by its word: but nothing it says is sure
                self._fail(exc, "may or may not have been stored")
                return
            except StreamBroken:  # it ended without reading the rest: nothing was done
                error: BaseException | None = None
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
            except DeadlineExceededError as exc:
                self._fail(exc, "may or may not have been stored")
                return
            self._end_stream()
            if error is None or isinstance(error, ServerStartingError):  # nothing was done
                resends += 1
                if resends > MAX_RESENDS or time.monotonic() + delay >= end:
                    self._fail(error or ServerUnavailableError(
                        "the server ended the push stream before reading it (it is stopping); "
                        "nothing was done"), "were not stored")
                    return
                if error is not None:
                    time.sleep(delay)
                    delay = min(2 * delay, _RETRY_MAX)
                self._send_pending(self._pending)
                continue
            self._fail(error, "were not stored")
            return

    def _settle_all(self) -> None:
        while self._pending:
            self._settle_oldest()
        self._raise_kept()

    def _send_pending(self, pushes: Iterable[tuple[bytes, float, Check | None]]) -> None:
        """Send ``pushes`` (of :attr:`_pending`) on the stream, opening one if needed. On a
        stream that has ended, the rest are not sent: the replies say what became of
        the pushes before them, and those are settled as their fate says."""
        if self._stream is None:
            self._stream = self._streams.open(self._method)
        with self._stream.busy:
            for request, _, _ in pushes:
                try:
                    self._stream.send(request)
                except StreamBroken:
                    return

    def _fail(self, error: BaseException, fate: str) -> None:
        """Keep ``error`` (of the oldest push) for the caller; drop the pushes after it."""
        dropped = len(self._pending) - 1
        if dropped:
            add_note(error, f"{dropped} push_batch call(s) sent after it on this handle {fate}")
        self._pending.clear()
        self._end_stream()
        if self._error is None:
            self._error = error

    def _raise_kept(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _end_stream(self) -> None:
        self._pushed = None  # a new stream may reach a new daemon
        if self._stream is not None:
            self._stream.close()
            self._stream = None


_LIVE: weakref.WeakSet[PushWindow] = weakref.WeakSet()
_exiting = False


@atexit.register
def _flush_at_exit() -> None:
    """Wait for what every live window has in flight (a process that exits right after
    its last push_batch has it stored), and from now on send pushes one at a time: the
    queued pushes flushed at exit (remote/batcher.py) may come after this, or before."""
    global _exiting
    _exiting = True
    for window in list(_LIVE):
        try:
            window.flush()
        except BaseException as exc:
            print(f"millpond: pushes in flight at exit failed: {exc!r}", file=sys.stderr)


def _forget_in_child() -> None:
    """A forked child's windows: what is in flight is the parent's, on the parent's
    streams (no reader runs here). The child's pushes open new streams."""
    for window in list(_LIVE):
        window._pending.clear()
        window._stream = None
        window._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
