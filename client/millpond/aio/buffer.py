"""The buffer handle for coroutines: :class:`AsyncBuffer` (and :class:`AsyncPrioritizedBuffer`).

The methods of :class:`millpond.Buffer` that a learner or an asyncio service uses, as
coroutines, with the same arguments, checked by the same functions
(:mod:`millpond.handle.buffer`, :mod:`millpond.remote.writes`) before anything is sent,
the same results (a dict of numpy arrays, the same keys, dtypes and shapes) and the same
typed errors. What differs is when a call returns: every ``await`` returns once the server
has answered; nothing is queued on the client (no push batching, no pushes in flight:
tasks give the concurrency).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Sequence

import numpy as np

from millpond.aio.sampler import AsyncSampler
from millpond.client import budget
from millpond.core.checks import check_indices, check_timeout
from millpond.core.config import BufferConfig, ConfigAccessors, check_exponent
from millpond.core.episode_checks import check_fields, check_filter, require_episodes
from millpond.core.info import BufferInfo
from millpond.errors import (
    BufferClosedError,
    BufferNotFoundError,
    InvalidArgumentError,
    ReadOnlyBufferError,
)
from millpond.handle.buffer import (
    PUSH_BATCH_ORDER,
    PUSH_ORDER,
    EpochPlan,
    bind,
    episode_arguments,
    num_batches,
    priority_arguments,
    sample_arguments,
    sampler_options,
    sequence_arguments,
)
from millpond.handle.devices import check_device, to_device
from millpond.remote.buffer import Contents, read_chunk
from millpond.remote.grpc_transport import STREAMED_MAX_BYTES
from millpond.remote.writes import checked_push, checked_record

if TYPE_CHECKING:
    from millpond.aio.client import AsyncClient


class AsyncBuffer(ConfigAccessors):
    """A handle on the server buffer ``name``, for coroutines of its client's event loop.

    Made by :meth:`AsyncClient.create_buffer <millpond.aio.AsyncClient.create_buffer>` or
    :meth:`AsyncClient.buffer <millpond.aio.AsyncClient.buffer>`. ``owner``: this handle's
    create made the buffer, so :meth:`close` deletes it (as the sync handle's does); one
    that attached only lets go. Tasks may share a handle: its calls go on at once.

    Episodic buffers: every sample of them (``n_step=``, ``filter_meta=``,
    :meth:`sample_sequences`, :meth:`sample_episodes`, :meth:`episode_catalog`) but no
    writes, which need each writer's episode (the sync handle keeps one per thread):
    a push raises InvalidArgumentError there.
    """

    def __init__(self, client: "AsyncClient", name: str, config: BufferConfig,
                 owner: bool = False, read_only: bool = False):
        self._client = client
        self.name = name
        self.config = config  # fixed at creation
        self.owner = owner
        self.read_only = read_only  # a dataset the daemon serves read-only (its info says)
        self._may_wait = config.rate_limiter is not None  # (queues and stacks have one)
        self._closed = False

    @property
    def client(self) -> "AsyncClient":
        """The client this handle's calls go through."""
        return self._client

    @property
    def transport(self) -> str:
        """How this handle's large calls move their data: the client's ``transport``."""
        return self._client.transport

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- writes ---------------------------------------------------------------

    async def push(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append one record and return once it is stored. Arguments as
        :meth:`millpond.Buffer.push`'s: ``push(obs, action, reward, terminated, truncated,
        next_obs)``, or ``push(**{field: value})``; ``timeout`` as for :meth:`push_batch`.
        One call per record: an actor of many records sends them with :meth:`push_batch`."""
        self._check_writable("push")
        await self._push_one(bind(self.schema, PUSH_ORDER, args, kwargs), None, timeout)

    async def push_batch(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append many records, validated as a whole before sending; return once they are
        stored. Arguments as :meth:`millpond.Buffer.push_batch`'s. With a rate limiter the
        push waits up to ``timeout`` seconds (None: the client's timeout) while it would
        break it, then raises RateLimitTimeoutError; a task cancelled meanwhile withdraws it."""
        self._check_writable("push_batch")
        await self._push_many(bind(self.schema, PUSH_BATCH_ORDER, args, kwargs), None, timeout)

    async def flush(self) -> None:
        """Nothing to wait for: every push's ``await`` returned once it was stored (for code
        written against the sync handle, whose pushes may be queued)."""
        self._check_open()

    async def _push_one(self, record: Mapping[str, Any], priority: Any,
                        timeout: float | None) -> None:
        self._check_writable("push")
        timeout = check_timeout(timeout)
        priorities, batch = checked_record(self.config, record, priority)
        await self._send(1, batch, priorities, timeout)

    async def _push_many(self, columns: Mapping[str, Any], priorities: Any,
                         timeout: float | None) -> None:
        self._check_writable("push_batch")
        push = checked_push(self.config, columns, priorities, None, None, timeout)
        await self._send(push.n, push.batch, push.priorities, push.timeout)

    def _check_writable(self, what: str) -> None:
        """Open, not a read-only dataset (said before a write's arguments are checked: it
        is what is wrong first), and not episodic."""
        self._check_open()
        if self.read_only:
            raise ReadOnlyBufferError(f"{what} to {self.name!r}: it is a dataset the server "
                                      "serves read-only; nothing was written")
        if self.config.episodes:
            raise InvalidArgumentError(
                "millpond.aio does not write to episodic buffers (each writer's episode is "
                "the sync handle's, per thread); push with millpond.connect's handle")

    async def _send(self, n: int, batch: dict[str, np.ndarray], priorities: np.ndarray | None,
                    timeout: float | None) -> None:
        if priorities is not None and not len(priorities):
            priorities = None  # no priorities and an empty list are the same push
        wait, deadline = budget(timeout, self._client.timeout, self._may_wait)
        await self._bulk("push_batch", n * self.schema.record_nbytes, self._may_wait,
                         self.name, self.schema, n, batch, priorities, wait, deadline, None,
                         self.config.total_capacity)

    async def _bulk(self, op: str, nbytes: int, may_wait: bool, *args: Any) -> Any:
        """Bulk call ``op`` (a :class:`~millpond.remote.connection.Transport` method) of
        ``nbytes``: through shared memory, on a thread, if it is large and cannot wait and
        the client has the fast path (see :func:`millpond.aio.connect`); else a coroutine
        on the client's channel."""
        client = self._client
        if nbytes > STREAMED_MAX_BYTES and not may_wait and client.shm is not False:
            connection = await client.fast_path()
            if connection is not None:
                return await client.on_thread(connection.call, op, *args)
        return await getattr(client.counted(op), op)(*args)

    async def reset(self) -> None:
        """Drop every record; keep the buffer (see :meth:`millpond.Buffer.reset`)."""
        self._check_open()
        if self.read_only:
            raise ReadOnlyBufferError(f"reset of {self.name!r}: it is a dataset the server "
                                      "serves read-only")
        await self._client.grpc.reset(self.name, self._client.timeout)

    # ---- samples --------------------------------------------------------------

    async def sample(self, batch_size: int, seed: int | None = None, *,
                     timeout: float | None = None, n_step: int | None = None,
                     gamma: float = 0.99, filter_meta: Mapping[str, Any] | None = None,
                     device: Any = None) -> dict[str, Any]:
        """Draw ``batch_size`` records: :meth:`millpond.Buffer.sample`'s arguments and
        result (``{field: array[batch_size, *shape]}``, plus ``weights`` and ``indices``
        on a prioritized buffer). With a rate limiter it waits up to ``timeout`` seconds,
        then raises RateLimitTimeoutError; a task cancelled meanwhile withdraws the sample
        (it draws nothing)."""
        if device is not None:  # checked before the draw (a queue's sample removes)
            check_device(device)
            return to_device(await self.sample(batch_size, seed, timeout=timeout,
                                               n_step=n_step, gamma=gamma,
                                               filter_meta=filter_meta), device)
        call = sample_arguments(self.config, batch_size, seed, timeout, n_step, gamma,
                                filter_meta)
        self._check_open()
        wait, deadline = budget(call.timeout, self._client.timeout, self._may_wait)
        nbytes = call.batch_size * self.schema.record_nbytes
        if call.n_step is not None:
            params = {"n_step": call.n_step, "gamma": call.gamma, "seed": call.seed}
            return await self._bulk("sample_n_step", nbytes, self._may_wait, self.name,
                                    self.config, call.batch_size, call.filter_meta, params,
                                    wait, deadline)
        return await self._bulk("sample", nbytes, self._may_wait, self.name, self.schema,
                                call.batch_size, call.seed, self.config.prioritized is not None,
                                wait, deadline, call.filter_meta)

    def samples(self, batch_size: int, prefetch: int = 2, seed: int | None = None,
                max_batches: int | None = None, device: Any = None, *,
                n_step: int | None = None, gamma: float = 0.99,
                filter_meta: Mapping[str, Any] | None = None) -> AsyncSampler:
        """``async for batch in buf.samples(batch_size, prefetch=N)``: batches of
        :meth:`sample` with ``prefetch`` requests in flight (see :class:`AsyncSampler`).
        With ``seed``, batch ``i`` equals ``await sample(batch_size, seed + i)``. Endless
        unless ``max_batches`` is given; close it (``await it.close()``, or ``async
        with``) when done. The other arguments are :meth:`sample`'s."""
        options = sampler_options(device, n_step, gamma, filter_meta)
        sample = functools.partial(self.sample, **options) if options else self.sample
        return AsyncSampler(sample, batch_size, prefetch=prefetch, seed=seed,
                            max_batches=max_batches)

    async def sample_sequences(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                               filter_meta: Mapping[str, Any] | None = None,
                               timeout: float | None = None, device: Any = None
                               ) -> dict[str, Any]:
        """``batch_size`` windows of ``seq_len`` steps, each within one episode (see
        :meth:`millpond.Buffer.sample_sequences`)."""
        check_device(device)
        call = sequence_arguments(self.config, batch_size, seq_len, seed, filter_meta, timeout)
        self._check_open()
        wait, deadline = budget(call.timeout, self._client.timeout, self._may_wait)
        nbytes = call.batch_size * call.seq_len * self.schema.record_nbytes
        return to_device(await self._bulk(
            "sample_sequences", nbytes, self._may_wait, self.name, self.config, call.batch_size,
            call.filter_meta, {"seq_len": call.seq_len, "seed": call.seed}, wait, deadline),
            device)

    async def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                              max_len: int | None = None,
                              filter_meta: Mapping[str, Any] | None = None,
                              timeout: float | None = None) -> dict[str, np.ndarray]:
        """``batch_size`` complete live episodes, padded (see
        :meth:`millpond.Buffer.sample_episodes`)."""
        call = episode_arguments(self.config, batch_size, seed, max_len, filter_meta, timeout)
        self._check_open()
        wait, deadline = budget(call.timeout, self._client.timeout, self._may_wait)
        # Over gRPC whatever the transport (as the sync client's): their size is known
        # only once drawn.
        return await self._client.counted("sample_episodes").sample_episodes(
            self.name, self.config, call.batch_size, call.filter_meta,
            {"max_len": call.max_len, "seed": call.seed}, wait, deadline)

    async def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                              ) -> dict[str, np.ndarray]:
        """The complete live episodes (see :meth:`millpond.Buffer.episode_catalog`)."""
        require_episodes(self.config)
        wanted = check_filter(self.config, filter_meta)
        self._check_open()
        return await self._client.counted("episode_catalog").episode_catalog(
            self.name, self.config, wanted, self._client.timeout)

    # ---- reads ----------------------------------------------------------------

    async def info(self) -> BufferInfo:
        """Sizes, capacities and counters: a read-only mapping (:class:`millpond.BufferInfo`)."""
        self._check_open()
        return await self._client.grpc.info(self.name, self._client.timeout)

    async def size(self) -> int:
        """Records held: the sync handle's ``len(buf)``."""
        return (await self.info()).size

    async def is_empty(self) -> bool:
        return await self.size() == 0

    async def read(self, seqs: Any, fields: Sequence[str] | None = None
                   ) -> dict[str, np.ndarray]:
        """Records by index (``seqs``), and ``live`` (see :meth:`millpond.Buffer.read`)."""
        return await self._read(check_indices(seqs, "seqs"), check_fields(self.config, fields))

    async def sample_by_index(self, indices: Any, fields: Sequence[str] | None = None, *,
                              device: Any = None) -> dict[str, Any]:
        """Records at positions ``indices`` (0 = oldest), in the order given (see
        :meth:`millpond.Buffer.sample_by_index`)."""
        check_device(device)
        batch = await self._read(check_indices(indices, "positions"),
                                 check_fields(self.config, fields), positions=True)
        del batch["live"]  # every position names a live record
        return to_device(batch, device)

    async def sample_all(self, fields: Sequence[str] | None = None, *,
                         device: Any = None) -> dict[str, Any]:
        """Every record held, oldest first, in replies of at most the client's message size
        (see :meth:`millpond.Buffer.sample_all`)."""
        check_device(device)
        names = check_fields(self.config, fields)
        contents = Contents(self.config, names, await self.size(), self._read_chunk)
        for positions in contents.reads():
            contents.add(await self._read(positions, contents.names, positions=True))
        return to_device(contents.result(), device)

    def epoch_iterator(self, batch_size: int, n_epochs: int = 1, shuffle: bool = True,
                       seed: int | None = None, drop_last: bool = False, *,
                       fields: Sequence[str] | None = None,
                       device: Any = None) -> AsyncIterator[dict[str, Any]]:
        """``async for batch in buf.epoch_iterator(...)``: batches that cover the records
        held once per epoch (see :meth:`millpond.Buffer.epoch_iterator`). Arguments are
        checked now; batches are read as the iteration goes."""
        plan = EpochPlan(self.config, batch_size, n_epochs, shuffle, seed, drop_last, fields,
                         device)

        async def batches() -> AsyncIterator[dict[str, Any]]:
            for _ in range(plan.n_epochs):
                for positions in plan.epoch(await self.size()):
                    yield await self.sample_by_index(positions, plan.names, device=device)

        return batches()

    async def calculate_num_batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` per epoch: ``ceil(size / batch_size)``."""
        return num_batches(await self.size(), batch_size)

    async def _read(self, seqs: np.ndarray, names: list[str] | None, *,
                    positions: bool = False) -> dict[str, np.ndarray]:
        self._check_open()
        schema = self.schema
        nbytes = len(seqs) * sum(schema[name].nbytes for name in names or schema.names)
        return await self._bulk("read", nbytes, False, self.name, self.config, seqs, names,
                                self._client.timeout, positions)

    def _read_chunk(self, record_nbytes: int) -> int:
        return read_chunk(self._client.max_message_bytes, record_nbytes)

    # ---- lifecycle ------------------------------------------------------------

    async def close(self) -> None:
        """Stop using this handle; later calls raise BufferClosedError. Idempotent. The
        buffer is deleted if this handle created it (see :class:`AsyncBuffer`)."""
        if self.owner:
            await self.delete()
        else:
            await self.release()

    async def release(self) -> None:
        """Stop using this handle; the buffer stays. Idempotent."""
        self._closed = True

    async def delete(self) -> None:
        """Delete the buffer on the server, whoever created it. Idempotent."""
        if self._closed:
            return
        try:
            await self._client.grpc.delete(self.name, self._client.timeout)
        except BufferNotFoundError:
            pass  # deleted already: the result this call wants
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError(f"buffer {self.name!r} was closed")

    async def __aenter__(self) -> "AsyncBuffer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, hot_capacity={self.hot_capacity}, "
                f"total_capacity={self.total_capacity}, schema={self.schema!r}, "
                f"closed={self._closed})")


class AsyncPrioritizedBuffer(AsyncBuffer):
    """A prioritized buffer's handle: ``push(..., priority=)``, ``push_batch(...,
    priorities=)``, :meth:`update_priorities`, :meth:`set_beta`."""

    async def push(self, *args: Any, priority: float | None = None,
                   timeout: float | None = None, **kwargs: Any) -> None:
        """``await push(obs, action, reward, terminated, truncated, next_obs, priority=None)``."""
        self._check_writable("push")
        await self._push_one(bind(self.schema, PUSH_ORDER, args, kwargs), priority, timeout)

    async def push_batch(self, *args: Any, priorities: Any = None,
                         timeout: float | None = None, **kwargs: Any) -> None:
        """Like :meth:`AsyncBuffer.push_batch`, with one priority per record (optional)."""
        self._check_writable("push_batch")
        await self._push_many(bind(self.schema, PUSH_BATCH_ORDER, args, kwargs), priorities,
                              timeout)

    async def update_priorities(self, indices: Any, priorities: Any) -> int:
        """New priorities for sampled ``indices``; returns how many were still live."""
        self._check_writable("update_priorities")
        seqs, values = priority_arguments(indices, priorities)
        return await self._client.counted("update_priorities").update_priorities(
            self.name, seqs, values, self._client.timeout)

    async def set_beta(self, beta: float) -> None:
        """Set the importance-sampling exponent (anneal it towards 1)."""
        beta = check_exponent("beta", beta)
        self._check_open()
        await self._client.counted("set_beta").set_beta(self.name, beta, self._client.timeout)


def handle_for(client: "AsyncClient", name: str, info: BufferInfo,
               owner: bool = False) -> AsyncBuffer:
    """The handle of the buffer ``info`` describes: prioritized or not."""
    config = info.checked_config()
    cls = AsyncPrioritizedBuffer if config.prioritized is not None else AsyncBuffer
    return cls(client, name, config, owner, info.read_only)
