"""millpond.aio's handles driven from sync code, for the contract suite.

:class:`SyncBuffer` wraps an :class:`~millpond.aio.AsyncBuffer` with the sync handle's
calls; each runs the async call on an event loop of its own thread (:class:`LoopThread`)
and waits for it. So every case of tests/test_contract.py and
tests/test_contract_kinds.py runs, unchanged, against the asyncio client too, threads
included (their calls then go on at once on the one loop, as tasks would).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Iterator

import millpond.aio


class LoopThread:
    """An event loop running on a thread of its own; :meth:`run` from any thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aio-loop",
                                       daemon=True)
        self.thread.start()

    def run(self, awaitable: Any, timeout: float = 120) -> Any:
        async def wrapped():
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)

    def connect(self, address: str, **settings: Any) -> millpond.aio.AsyncClient:
        return self.run(millpond.aio.connect(address, **settings))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class SyncBuffer:
    """The sync handle's calls over an AsyncBuffer (see the module docstring). ``close``
    closes the client too when ``own_client``."""

    def __init__(self, runner: LoopThread, buf: millpond.aio.AsyncBuffer,
                 own_client: bool = False):
        self._runner = runner
        self._buf = buf
        self._own_client = own_client

    @property
    def aio(self) -> millpond.aio.AsyncBuffer:
        return self._buf

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._buf, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *args, **kwargs: self._runner.run(attr(*args, **kwargs))
        return attr

    def __len__(self) -> int:
        return self._runner.run(self._buf.size())

    @property
    def size(self) -> int:
        return len(self)

    def epoch_iterator(self, *args: Any, **kwargs: Any) -> Iterator[dict]:
        batches = self._buf.epoch_iterator(*args, **kwargs)  # checked now, as the sync one

        def sync() -> Iterator[dict]:
            while True:
                try:
                    yield self._runner.run(anext(batches))
                except StopAsyncIteration:
                    return

        return sync()

    def close(self) -> None:
        self._runner.run(self._buf.close())
        if self._own_client:
            self._runner.run(self._buf.client.close())
