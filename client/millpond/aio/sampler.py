"""Sampling with prefetch, for coroutines: ``async for batch in buf.samples(256, prefetch=4)``.

The asyncio twin of :class:`millpond.handle.sampler.Sampler`, with the same contract,
and tasks of the event loop where that one has threads.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Awaitable, Callable

import numpy as np

from millpond.handle.sampler import sampler_arguments

AsyncSampleFn = Callable[[int, "int | None"], Awaitable[dict[str, np.ndarray]]]


class AsyncSampler:
    """Iterate (``async for``) over batches ``await sample(batch_size, seed)``, with
    ``prefetch`` requests in flight.

    Batches come in request order. With ``seed`` given, request ``i`` (from 0) uses seed
    ``seed + i``: the batches equal ``await sample(batch_size, seed + i)`` for i = 0, 1,
    ... in turn (on the same buffer contents). ``seed=None`` draws fresh batches.
    ``max_batches=None`` never ends; otherwise iteration stops after that many.

    The first requests go out when iteration starts (the first ``__anext__``), so a
    sampler may be made before the buffer holds enough records. From then on, while the
    caller works on batch ``k`` the requests ``k+1 .. k+prefetch`` are in flight or done,
    each a task of the running loop (no thread).

    An error from ``sample`` is raised at the position of the failed request (the
    batches before it are delivered first); the sampler is then closed and iteration
    stops. A consumer cancelled while it waits for a batch cancels that request, and the
    sampler closes.

    :meth:`close` (``aclose``; idempotent; also on leaving an ``async with`` block)
    cancels the requests in flight and waits for them to end: a cancelled request is
    withdrawn on the daemon (a sample waiting for a rate limiter draws nothing). A
    sampler dropped without ``close`` cancels them too.
    """

    def __init__(self, sample: AsyncSampleFn, batch_size: int, prefetch: int = 2,
                 seed: int | None = None, max_batches: int | None = None):
        self.batch_size, self.prefetch, self.seed, self.max_batches = sampler_arguments(
            batch_size, prefetch, seed, max_batches)
        self._sample = sample
        self._pending: collections.deque[asyncio.Task] = collections.deque()
        self._issued = 0     # requests made
        self._delivered = 0  # batches returned
        self._closed = False

    def __aiter__(self) -> "AsyncSampler":
        return self

    async def __anext__(self) -> dict[str, np.ndarray]:
        if self._closed or self._done():
            await self.close()
            raise StopAsyncIteration
        self._fill()
        task = self._pending.popleft()
        try:
            batch = await task
        except BaseException:  # its error, or this consumer cancelled: no more batches
            await self.close()
            raise
        self._delivered += 1
        if self._done():
            await self.close()
        else:
            self._fill()  # one more request goes out
        return batch

    def _done(self) -> bool:
        return self.max_batches is not None and self._delivered >= self.max_batches

    def _fill(self) -> None:
        while len(self._pending) < self.prefetch and (
                self.max_batches is None or self._issued < self.max_batches):
            seed = None if self.seed is None else self.seed + self._issued
            task = asyncio.ensure_future(self._sample(self.batch_size, seed))
            task.add_done_callback(_retrieve)
            self._pending.append(task)
            self._issued += 1

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Cancel the requests in flight and wait for them to end. Idempotent."""
        self._closed = True
        pending, self._pending = list(self._pending), collections.deque()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    aclose = close

    async def __aenter__(self) -> "AsyncSampler":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __del__(self) -> None:  # dropped without close(): its requests go too
        for task in getattr(self, "_pending", ()):
            if not task.done():
                try:
                    task.get_loop().call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop is closed: so is the task
                    pass

    def __repr__(self) -> str:
        return (f"AsyncSampler(batch_size={self.batch_size}, prefetch={self.prefetch}, "
                f"seed={self.seed}, max_batches={self.max_batches}, closed={self.closed})")


def _retrieve(task: asyncio.Task) -> None:
    """Mark a request's error seen: one never awaited (its sampler closed) is no news."""
    if not task.cancelled():
        task.exception()
