"""millpond for asyncio: ``await connect(...)``, ``await buf.sample(...)``, ``async for``.

A learner or an RL service written with asyncio uses a server's buffers without a
thread per call::

    import millpond.aio

    async with millpond.aio.connect("localhost:50051") as client:
        buf = await client.create_buffer("cartpole", capacity=100_000, obs_dim=4, act_dim=1)
        await buf.push_batch(obs, next_obs, actions, rewards, terminated, truncated)
        batch = await buf.sample(256)
        async with buf.samples(256, prefetch=4) as batches:
            async for batch in batches:
                ...

:func:`connect` gives an :class:`AsyncClient` (``create_buffer``, ``buffer``,
``list_buffers``, ``delete_buffer``, ``close``, ``async with``), whose handles
(:class:`AsyncBuffer`, :class:`AsyncPrioritizedBuffer`) have the sync handle's calls as
coroutines, with its arguments, results and typed errors: the contract suite
(``tests/test_contract.py``, ``tests/test_contract_kinds.py``) runs every case against
this client too.

How it is made, and why
-----------------------

**Native grpc.aio, not the sync client on threads.** Every call is a coroutine on a
``grpc.aio`` channel made in the caller's event loop
(:mod:`millpond.remote.aio_transport`): a call in flight costs the loop a future, not a
thread, so a learner keeps as many samples in flight as it likes and a service serves
many buffers from one loop. Running the sync client's calls with ``asyncio.to_thread``
would have been shorter, but it takes a thread per call in flight (the default pool has
``min(32, cpus + 4)``: a few samples waiting for a rate limiter starve the rest), and a
call on a thread cannot be withdrawn: a cancelled task whose sample waits for a rate
limiter would leave it waiting on the daemon, to draw (from a queue: remove) records
nobody receives. Here cancelling the task cancels the call, and the daemon drops it
(``tests/test_aio.py`` checks that nothing is left behind).

Small pushes and samples (at most 64 KiB each way) go as messages on open streams, as
the sync client's do, pooled since tasks share one loop
(:mod:`millpond.remote.aio_streams`): on the 2-core development machine a unary
``grpc.aio`` ``sample(256)`` of CartPole records made 0.50-0.56x the calls per second of
the same call as a message on a stream (``bench/aio.py``). One caller's ``sample(256)``
made 0.90-1.18x the calls of the sync client's over gRPC, four tasks' 1.10-1.48x four
threads' (medians of three runs on a loaded machine; ``docs/performance.md``).

**Large calls that cannot wait take the fast path, on a few threads.** On the
server's host (``connect(shm="auto")``, the default), a push, sample or read that moves
more than 64 KiB, on a buffer without a rate limiter (reads never wait), goes through
shared memory: the sync client's connection (its negotiation, sessions and fallback to
gRPC, :mod:`millpond.remote.connection`) runs it on one of the client's
:data:`~millpond.aio.client.FAST_PATH_THREADS` threads. There the bytes dominate: an
Atari ``sample(32)`` (1.8 MB) made 2.7-3.0x the calls per second of the same call
over ``grpc.aio``. Such a call cannot wait, so it ends within milliseconds whatever happens
to its task; calls that may wait (a rate limiter's) stay on the channel, where
cancelling withdraws them. Small calls stay on the channel too, thread-free: one
caller's CartPole ``sample(256)`` through shared memory on a thread made 0.8-1.3x the
calls of the channel's stream (four callers: 1.1-2.4x, on a loaded machine); a
same-host learner of small records that needs more has the sync client's
shared-memory sampler.

**Nothing is written twice.** The requests are built, and the replies decoded and
checked, by the functions the sync gRPC transport uses
(:mod:`millpond.remote.grpc_calls`, :mod:`millpond.remote.replies`); failed calls map to
the same typed errors through the same catalog (:mod:`millpond.wire.status`); arguments
are checked, before anything is sent, by the functions the sync handle uses
(:mod:`millpond.handle.buffer`: ``bind``, ``sample_arguments``, ...;
:mod:`millpond.remote.writes`: ``checked_push``); the fast path is the sync client's.

**Every await is one acknowledged call.** ``await buf.push(...)`` returns once the
record is stored: there is no client-side batching of single pushes and no window of
pushes in flight (``connect(push_batch_size=, max_in_flight=)`` of the sync client);
an actor sends batches with ``push_batch``, and concurrency comes from tasks.

Not here (yet): sharded buffers (one server per client), writes to episodic buffers
(each writer's episode is the sync handle's, per thread; samples of every kind are
here), exports and the dataloader, and the operator's calls (``repair_buffer``,
``checkpoint``).
"""

from __future__ import annotations

from millpond.aio.buffer import AsyncBuffer, AsyncPrioritizedBuffer
from millpond.aio.client import AsyncClient, Connecting, connect
from millpond.aio.sampler import AsyncSampler

__all__ = ["AsyncBuffer", "AsyncClient", "AsyncPrioritizedBuffer", "AsyncSampler",
           "Connecting", "connect"]
