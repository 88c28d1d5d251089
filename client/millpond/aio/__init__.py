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
thread, so a learner keeps as many samples in flight as it likes, and a service serves
many buffers from one loop. Running the sync client's calls with ``asyncio.to_thread``
would have been shorter, but it takes a thread per call in flight (the default pool has
``min(32, cpus + 4)``: a few waiting samples starve the rest), and a call on a thread
cannot be withdrawn: a cancelled task whose sample waits for a rate limiter would leave
it waiting on the daemon, to draw (and, from a queue, remove) records nobody receives.
Here cancelling the task cancels the call, and the daemon drops it.

Small pushes and samples (at most 64 KiB each way) go as messages on open streams, as
the sync client's do, pooled since tasks share one loop
(:mod:`millpond.remote.aio_streams`): on the 2-core development machine a stream
message made about twice the calls per second of a unary ``grpc.aio`` call for
``sample(256)`` of a CartPole record.

**Nothing is written twice.** The requests are built, and the replies decoded and
checked, by the functions the sync gRPC transport uses
(:mod:`millpond.remote.grpc_calls`, :mod:`millpond.remote.replies`); failed calls map to
the same typed errors through the same catalog (:mod:`millpond.wire.status`); arguments
are checked, before anything is sent, by the functions the sync handle uses
(:mod:`millpond.handle.buffer`: ``bind``, ``sample_arguments``, ...;
:mod:`millpond.remote.writes`: ``checked_push``).

**No shared memory.** A client on the server's host still moves its data over gRPC.
The fast path's sessions are blocking sockets: using them from a loop means a thread per
call again, with the cancellation problem above. Measured on that machine (``python
bench/aio.py``; same daemon, same run), the gRPC path here is as fast as the sync
client's fast path for small records, and slower for large ones: see
``docs/performance.md``. A learner of large records on the server's host that needs the
fast path's bandwidth uses the sync client (``millpond.connect``), its sampler
prefetching on threads.

**Every await is one acknowledged call.** ``await buf.push(...)`` returns once the
record is stored: there is no client-side batching of single pushes and no window of
pushes in flight (``connect(push_batch_size=, max_in_flight=)`` of the sync client);
an actor sends batches with ``push_batch``, and concurrency comes from tasks.

Not here (yet): sharded buffers (one server per client), writes to episodic buffers
(each writer's episode is the sync handle's, per thread; samples of every kind are
here), device tensors come as in the sync handle (``device=``), exports and the
dataloader.
"""

from __future__ import annotations

from millpond.aio.buffer import AsyncBuffer, AsyncPrioritizedBuffer
from millpond.aio.client import AsyncClient, Connecting, connect
from millpond.aio.sampler import AsyncSampler

__all__ = ["AsyncBuffer", "AsyncClient", "AsyncPrioritizedBuffer", "AsyncSampler",
           "Connecting", "connect"]
