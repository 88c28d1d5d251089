"""Streams of calls: PushBatchStream and SampleStream, whose every message is one call.

A client sends its small pushes and its samples as messages on a stream it
keeps open (``millpond/grpc_streams.py``: a message skips the setup a call
pays). Each message is served by the unary call's handler, in order: the same
checks, replies and errors; the first error ends the stream with its status.

A stream ends (OK), between two messages, when left without one for
``--stream-idle-s`` (an open stream counts against ``--max-concurrent-calls``)
and when the daemon stops (:meth:`CallStreams.end`: it does not spend its grace
on streams that wait for nothing). The client opens another for its next call.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from millpond.compat import timeout


class CallStreams:
    """Serves the streams of calls of one daemon."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self.stopping = False
        self._between_messages: set[asyncio.Task] = set()  # streams waiting for one

    async def serve(self, call: Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]],
                    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[Any]:
        """The replies of ``call`` (a unary handler) to the messages of one stream."""
        messages = aiter(requests)
        task = asyncio.current_task()
        assert task is not None
        while not self.stopping:
            self._between_messages.add(task)
            try:
                async with timeout(self.idle_s):
                    raw = await anext(messages)
            except (StopAsyncIteration, TimeoutError):  # the client's end, or idle
                return
            except asyncio.CancelledError:
                if self.stopping:  # end()
                    return
                raise
            finally:
                self._between_messages.discard(task)
            yield await call(raw, context)

    def end(self) -> None:
        """End every stream once its current message is answered, and those waiting
        for one now."""
        self.stopping = True
        for task in list(self._between_messages):
            task.cancel()
