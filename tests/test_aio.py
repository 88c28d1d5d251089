"""millpond.aio against real daemons: what only an asyncio client does.

The contract suite (tests/test_contract.py, tests/test_contract_kinds.py) runs every
common case against this client too; here: tasks sharing one loop (concurrent samples
and pushes, many calls in flight without a thread each), cancellation (a waiting call
is withdrawn, leaving nothing behind), deadlines, typed errors, async iteration with
prefetch, closing, and the same results as the sync client on the same buffer. Each
test runs its coroutine with ``asyncio.run`` (no pytest plugin).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import threading
import time

import numpy as np
import pytest
from support import ServerProcess
from test_contract import transitions

import millpond
import millpond.aio as aio

FIELDS = {"id": ("int64", ()), "obs": ("float32", (3,))}
# A record of 80 KB: a sample of two is a unary call (over 64 KiB), not a stream message.
LARGE = {"id": ("int64", ()), "obs": ("float32", (20_000,))}
_names = itertools.count()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def records(start: int, n: int, fields: dict = FIELDS) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n)
    width = fields["obs"][1][0]
    return {"id": ids, "obs": np.repeat(ids[:, None] * 0.5, width, axis=1).astype(np.float32)}


def name(prefix: str) -> str:
    return f"aio-{prefix}-{next(_names)}"


async def until(predicate, timeout: float = 10.0) -> None:
    """Wait until ``await predicate()`` is true."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.01)


async def waiting(buf, key: str = "waiting_samples") -> int:
    return (await buf.info())[key]


# ---- the API ---------------------------------------------------------------------------------


def test_connect_create_attach_list_and_delete(shared_server):
    async def main():
        async with aio.connect(shared_server.address) as client:
            assert isinstance(client, aio.AsyncClient) and client.transport == "grpc"
            made = await client.create_buffer(name("api"), hot_capacity=4, total_capacity=16,
                                              obs_dim=2, act_dim=1)
            await made.push_batch(**transitions(0, 10))
            again = await client.buffer(made.name)
            assert await again.size() == 10 and again.schema == made.schema
            assert not again.owner and made.owner
            rows = {row["name"]: row for row in await client.list_buffers()}
            assert rows[made.name]["size"] == 10 and rows[made.name]["total_capacity"] == 16
            await again.close()  # attached: only lets go
            assert again.closed and await made.size() == 10
            await made.close()  # created: deletes
            assert made.name not in {row["name"] for row in await client.list_buffers()}
            other = await client.create_buffer(name("api"), capacity=8, obs_dim=2, act_dim=1)
            await client.delete_buffer(other.name)
            with pytest.raises(millpond.BufferNotFoundError):
                await client.buffer(other.name)
        assert client.closed
        await client.close()  # idempotent
        with pytest.raises(millpond.BufferClosedError):
            await client.list_buffers()
        client = await aio.connect(shared_server.address)  # awaited, not entered
        assert await client.list_buffers() is not None
        await client.close()

    run(main())
    client = asyncio.run(aio.connect(shared_server.address))  # a coroutine, as asyncio wants
    assert isinstance(client, aio.AsyncClient)


def _parameters(function) -> list:
    return list(inspect.signature(function).parameters.values())


@pytest.mark.parametrize("sync, asynchronous", [
    (millpond.Client.create_buffer, aio.AsyncClient.create_buffer),
    (millpond.Buffer.push, aio.AsyncBuffer.push),
    (millpond.Buffer.push_batch, aio.AsyncBuffer.push_batch),
    (millpond.Buffer.sample, aio.AsyncBuffer.sample),
    (millpond.Buffer.sampler, aio.AsyncBuffer.samples),
    (millpond.Buffer.sample_sequences, aio.AsyncBuffer.sample_sequences),
    (millpond.Buffer.sample_episodes, aio.AsyncBuffer.sample_episodes),
    (millpond.Buffer.episode_catalog, aio.AsyncBuffer.episode_catalog),
    (millpond.Buffer.read, aio.AsyncBuffer.read),
    (millpond.Buffer.sample_by_index, aio.AsyncBuffer.sample_by_index),
    (millpond.Buffer.sample_all, aio.AsyncBuffer.sample_all),
    (millpond.Buffer.epoch_iterator, aio.AsyncBuffer.epoch_iterator),
    (millpond.PrioritizedBuffer.push, aio.AsyncPrioritizedBuffer.push),
    (millpond.PrioritizedBuffer.push_batch, aio.AsyncPrioritizedBuffer.push_batch),
    (millpond.PrioritizedBuffer.update_priorities, aio.AsyncPrioritizedBuffer.update_priorities),
    (millpond.PrioritizedBuffer.set_beta, aio.AsyncPrioritizedBuffer.set_beta),
], ids=lambda f: f.__qualname__)
def test_calls_take_the_sync_handles_arguments(sync, asynchronous):
    assert _parameters(asynchronous) == _parameters(sync)


def test_connect_refuses_what_the_sync_client_refuses():
    async def main():
        for address, settings in [("localhost:1", {"timeout": 0}), ("", {}),
                                  (["a:1", "b:1"], {}), ("dns:///replay:50051", {}),
                                  ("localhost:1", {"tls": False, "tls_ca": "ca.pem"})]:
            with pytest.raises(millpond.InvalidConfigError):
                await aio.connect(address, **settings)

    run(main())


def test_results_are_the_sync_clients(shared_server):
    """The same buffer through both clients: the same arrays, dtypes, keys and counts."""
    sync = millpond.connect(shared_server.address, shm=False)
    uniform = sync.create_buffer(name("same"), capacity=50, obs_dim=3, act_dim=2)
    prioritized = sync.create_buffer(name("same"), capacity=50, obs_dim=3, act_dim=2,
                                     prioritized=True)
    for buf in (uniform, prioritized):
        buf.push_batch(**transitions(0, 30, obs_dim=3, act_dim=2))

    async def main():
        async with aio.connect(shared_server.address) as client:
            for expected in (uniform, prioritized):
                buf = await client.buffer(expected.backend.name)
                assert type(buf) is (aio.AsyncPrioritizedBuffer if expected is prioritized
                                     else aio.AsyncBuffer)
                for call in (lambda b: b.sample(16, seed=3),
                             lambda b: b.sample_by_index([0, 29, 5], fields=["obs"]),
                             lambda b: b.read([1, 2, 1000]), lambda b: b.sample_all()):
                    mine, theirs = await call(buf), call(expected)
                    assert list(mine) == list(theirs)
                    for key in theirs:
                        assert mine[key].dtype == theirs[key].dtype
                        np.testing.assert_array_equal(mine[key], theirs[key])
                assert (await buf.info()).keys() == expected.info().keys()
            buf = await client.buffer(prioritized.backend.name)
            indices = (await buf.sample(4, seed=1))["indices"]
            assert await buf.update_priorities(indices, [1.0, 2.0, 3.0, 4.0]) == 4
            await buf.set_beta(1.0)
            assert (await buf.info())["beta"] == 1.0 == prioritized.info()["beta"]

    run(main())
    uniform.close()
    prioritized.close()


# ---- concurrency -----------------------------------------------------------------------------


def test_concurrent_samples_and_pushes_on_one_loop(shared_server):
    """An actor task and learner tasks share one client and one loop; the rate limiter
    makes them wait on each other, and none blocks another."""
    async def main():
        async with aio.connect(shared_server.address) as client:
            buf = await client.create_buffer(
                name("ratio"), capacity=1000, fields=FIELDS,
                rate_limiter=millpond.SampleToInsertRatio(2.0, 4, error_buffer=10))
            rounds = 40

            async def actor():
                for i in range(rounds):
                    await buf.push_batch(**records(4 * i, 4), timeout=20)

            async def learner():
                for _ in range(rounds // 2):
                    batch = await buf.sample(8, timeout=20)  # 2 samples per insert
                    np.testing.assert_array_equal(batch["obs"][:, 0], batch["id"] * 0.5)

            await asyncio.gather(learner(), actor(), learner())
            info = await buf.info()
            assert (info["inserts"], info["samples"]) == (4 * rounds, 8 * rounds)
            assert info["sample_waits"] + info["insert_waits"] > 0  # they did wait
            await buf.close()

    run(main())


def test_many_waiting_calls_are_in_flight_without_a_thread_each(shared_server):
    async def main():
        async with aio.connect(shared_server.address) as client:
            buf = await client.create_buffer(name("queue"), capacity=20, fields=FIELDS,
                                             mode="queue")
            await buf.info()  # the channel is up: gRPC's own threads are started
            threads = threading.active_count()
            tasks = [asyncio.create_task(buf.sample(1, timeout=30)) for _ in range(8)]
            await until(lambda: _equals(waiting(buf), 8))
            assert threading.active_count() <= threads + 1  # not one per call
            await buf.push_batch(**records(0, 8))
            got = sorted(int(batch["id"][0]) for batch in await asyncio.gather(*tasks))
            assert got == list(range(8)) and await buf.size() == 0
            await buf.close()

    run(main())


async def _equals(awaitable, value) -> bool:
    return await awaitable == value


# ---- cancellation ----------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [FIELDS, LARGE], ids=["stream", "unary"])
def test_cancelling_a_waiting_sample_leaves_nothing_behind(shared_server, fields):
    """The daemon withdraws the sample: it draws (and removes) nothing when records come."""
    async def main():
        async with aio.connect(shared_server.address) as client:
            buf = await client.create_buffer(name("cancel"), capacity=10, fields=fields,
                                             mode="queue")
            task = asyncio.create_task(buf.sample(2, timeout=30))
            await until(lambda: _equals(waiting(buf), 1))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: _equals(waiting(buf), 0))
            await buf.push_batch(**records(0, 2, fields))
            await asyncio.sleep(0.2)  # a sample left behind would take them now
            info = await buf.info()
            assert info["size"] == 2 and info["samples"] == 0
            assert (await buf.sample(2, timeout=0))["id"].tolist() == [0, 1]
            await buf.close()

    run(main())


def test_cancelling_a_waiting_push_leaves_nothing_behind(shared_server):
    async def main():
        async with aio.connect(shared_server.address) as client:
            buf = await client.create_buffer(name("cancel-push"), capacity=2, fields=FIELDS,
                                             mode="queue")
            await buf.push_batch(**records(0, 2))  # full: the next push waits
            task = asyncio.create_task(buf.push_batch(**records(10, 2), timeout=30))
            await until(lambda: _equals(waiting(buf, "waiting_inserts"), 1))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: _equals(waiting(buf, "waiting_inserts"), 0))
            assert (await buf.sample(2, timeout=0))["id"].tolist() == [0, 1]
            await asyncio.sleep(0.2)  # a push left behind would be stored now
            info = await buf.info()
            assert info["size"] == 0 and info["pushed"] == 2
            await buf.close()

    run(main())


# ---- deadlines and errors --------------------------------------------------------------------


def test_timeouts_are_typed_and_change_nothing(shared_server):
    async def main():
        async with aio.connect(shared_server.address) as client:
            buf = await client.create_buffer(name("timeout"), capacity=100, fields=FIELDS,
                                             rate_limiter=millpond.MinSize(5))
            await buf.push_batch(**records(0, 2))
            started = time.monotonic()
            with pytest.raises(millpond.RateLimitTimeoutError) as info:
                await buf.sample(2, timeout=0.2)
            assert isinstance(info.value, TimeoutError) and time.monotonic() - started >= 0.18
            assert (await buf.info())["samples"] == 0
            with pytest.raises(millpond.RateLimitTimeoutError):
                await buf.sample(2, timeout=0)  # only tries
            await buf.close()

            big = await client.create_buffer(name("deadline"), capacity=6_400,
                                             fields={"x": ("float32", (1024,))})
            for _ in range(2):
                await big.push_batch(x=np.ones((3_200, 1024), np.float32))
            client.timeout = 0.002  # 26 MB cannot be gathered and handed over in 2 ms
            with pytest.raises(millpond.DeadlineExceededError) as info:
                await big.sample(6_400)
            assert isinstance(info.value, TimeoutError)
            client.timeout = 60
            assert (await big.sample(10))["x"].shape == (10, 1024)  # the client recovers
            await big.close()

    run(main())


def test_a_server_that_is_never_reached_is_a_deadline_saying_so():
    async def main():
        async with aio.connect("127.0.0.1:1", timeout=0.5) as client:
            started = time.monotonic()
            with pytest.raises(millpond.DeadlineExceededError, match="never reached"):
                await client.buffer("nothing")
            assert time.monotonic() - started < 5

    run(main())


def test_errors_are_typed_and_leave_the_buffer_as_it_was(shared_server):
    async def main():
        # (shm=False: over shared memory a push is not bound by the message limit)
        async with aio.connect(shared_server.address, max_message_mb=1, shm=False) as client:
            buf = await client.create_buffer(name("errors"), capacity=100_000, fields=FIELDS)
            await buf.push_batch(**records(0, 4))
            with pytest.raises(millpond.ConfigMismatchError):
                await client.create_buffer(buf.name, capacity=10, fields=FIELDS)
            with pytest.raises(millpond.BufferNotFoundError) as missing:
                await client.buffer(name("missing"))
            assert isinstance(missing.value, KeyError)
            bad = [(lambda: buf.sample(5), millpond.NotEnoughDataError),  # the daemon's
                   (lambda: buf.sample(0), millpond.InvalidBatchSizeError),
                   (lambda: buf.sample(1, timeout=-1), millpond.InvalidArgumentError),
                   (lambda: buf.push_batch(id=np.arange(2), obs=np.zeros((2, 4))),
                    millpond.ShapeMismatchError),
                   (lambda: buf.push_batch(id=np.arange(2.0), obs=np.zeros((2, 3))),
                    millpond.DTypeMismatchError),
                   (lambda: buf.push_batch(id=np.arange(2)), millpond.FieldMismatchError),
                   (lambda: buf.push(id=1, obs=np.zeros(3), more=2), millpond.FieldMismatchError),
                   (lambda: buf.push_batch(**records(0, 2), priorities=[1.0, 1.0]),
                    millpond.InvalidArgumentError),
                   (lambda: buf.sample_sequences(2, 3), millpond.InvalidArgumentError),
                   (lambda: buf.push_batch(**records(0, 100_000)), millpond.MessageTooLargeError)]
            for call, error in bad:
                with pytest.raises(error):
                    await call()
            info = await buf.info()
            assert (info["size"], info["pushed"], info["samples"]) == (4, 4, 0)
            with pytest.raises(AttributeError):  # no such call on a uniform buffer, as in sync
                await buf.update_priorities([0], [1.0])
            await buf.close()

    run(main())


@pytest.mark.daemon
def test_a_call_in_flight_when_the_server_dies_fails_in_seconds(tmp_path):
    server = ServerProcess(tmp_path / "data").start()

    async def main():
        async with aio.connect(server.address, timeout=30) as client:
            buf = await client.create_buffer("gone", capacity=8, fields=FIELDS,
                                             rate_limiter=millpond.MinSize(5))
            await buf.push_batch(**records(0, 2))
            task = asyncio.create_task(buf.sample(1, timeout=60))
            await until(lambda: _equals(waiting(buf), 1))
            server.proc.kill()
            started = time.monotonic()
            with pytest.raises(millpond.ServerUnavailableError):
                await task
            assert time.monotonic() - started < 15

    try:
        run(main())
    finally:
        server.stop()


@pytest.mark.daemon
def test_a_stream_the_daemon_ended_idle_is_replaced(tmp_path):
    """After --stream-idle-s without a call the daemon ends the stream; the next call
    finds it ended and goes on a new one, having done nothing twice."""
    with ServerProcess(tmp_path / "data", "--stream-idle-s", "0.2") as server:
        async def main():
            async with aio.connect(server.address) as client:
                buf = await client.create_buffer("idle", capacity=100, fields=FIELDS)
                for round_ in range(3):
                    await buf.push_batch(**records(10 * round_, 10))
                    assert len((await buf.sample(5))["id"]) == 5
                    await asyncio.sleep(0.5)  # every stream ends idle
                info = await buf.info()
                assert (info["pushed"], info["samples"]) == (30, 15)

        run(main())


# ---- async iteration -------------------------------------------------------------------------


def test_samples_keep_a_window_of_requests_in_flight(shared_server):
    async def main():
        async with aio.connect(shared_server.address) as client:
            buf = await client.create_buffer(name("window"), capacity=50, fields=FIELDS,
                                             mode="queue")
            batches = buf.samples(2, prefetch=3, max_batches=4)
            first = asyncio.create_task(anext(batches))
            await until(lambda: _equals(waiting(buf), 3))  # the window, before any record
            await buf.push_batch(**records(0, 8))
            got = [(await first)["id"].tolist()]
            got += [batch["id"].tolist() async for batch in batches]
            assert sorted(itertools.chain(*got)) == list(range(8)) and len(got) == 4
            assert batches.closed and await buf.size() == 0
            # Closing withdraws the requests in flight: they draw nothing.
            async with buf.samples(1, prefetch=3) as batches:
                waiter = asyncio.create_task(anext(batches))
                await until(lambda: _equals(waiting(buf), 3))
                waiter.cancel()
            await until(lambda: _equals(waiting(buf), 0))
            assert batches.closed
            await buf.push_batch(**records(10, 3))
            await asyncio.sleep(0.2)
            assert await buf.size() == 3
            await buf.close()

    run(main())


def test_seeded_samples_are_the_seeded_draws_and_an_error_ends_them(shared_server):
    async def main():
        async with aio.connect(shared_server.address) as client:
            buf = await client.create_buffer(name("seeded"), capacity=50, fields=FIELDS)
            await buf.push_batch(**records(0, 20))
            async with buf.samples(5, prefetch=4, seed=7, max_batches=6) as batches:
                got = [batch async for batch in batches]
            expected = [await buf.sample(5, seed=7 + i) for i in range(6)]
            assert len(got) == 6
            for mine, theirs in zip(got, expected):
                np.testing.assert_array_equal(mine["id"], theirs["id"])
            batches = buf.samples(50, prefetch=2)  # more than held: NotEnoughDataError
            with pytest.raises(millpond.NotEnoughDataError):
                await anext(batches)
            with pytest.raises(StopAsyncIteration):
                await anext(batches)
            for bad in ({"prefetch": 0}, {"max_batches": -1}, {"seed": -1}, {"device": "nope"}):
                with pytest.raises(millpond.InvalidArgumentError):
                    buf.samples(5, **bad)
            with pytest.raises(millpond.InvalidBatchSizeError):
                buf.samples(0)
            await buf.close()

    run(main())


def test_closing_the_client_ends_its_calls_under_way(shared_server):
    async def main():
        client = await aio.connect(shared_server.address)
        buf = await client.create_buffer(name("closing"), capacity=10, fields=FIELDS,
                                         mode="queue")
        task = asyncio.create_task(buf.sample(2, timeout=30))
        await until(lambda: _equals(waiting(buf), 1))
        await client.close()
        with pytest.raises(millpond.BufferClosedError):
            await task
        with pytest.raises(millpond.BufferClosedError):
            await buf.size()
        async with aio.connect(shared_server.address) as other:
            again = await other.buffer(buf.name)
            await until(lambda: _equals(waiting(again), 0))  # withdrawn on the daemon
            await again.delete()
            with pytest.raises(millpond.BufferClosedError):
                await again.sample(1)

    run(main())


# ---- episodic buffers ------------------------------------------------------------------------


def test_episodic_samples_are_the_sync_clients(shared_server):
    sync = millpond.connect(shared_server.address, shm=False)
    buf = sync.create_buffer(name("episodes"), capacity=200, obs_dim=2, act_dim=1,
                             episodes=True, meta_fields={"task": ("int64", ())})
    for episode in range(8):
        with buf.one_episode(task=episode % 2):
            buf.push_batch(**transitions(10 * episode, 5 + episode))
    calls = [lambda b: b.sample(6, seed=1, n_step=3, gamma=0.5),
             lambda b: b.sample(6, seed=2, filter_meta={"task": 1}),
             lambda b: b.sample_sequences(4, 3, seed=3),
             lambda b: b.sample_episodes(3, seed=4),
             lambda b: b.sample_episodes(3, seed=5, max_len=4, filter_meta={"task": 0}),
             lambda b: b.episode_catalog(filter_meta={"task": 1})]

    async def main():
        async with aio.connect(shared_server.address) as client:
            mine = await client.buffer(buf.backend.name)
            for call in calls:
                ours, theirs = await call(mine), call(buf)
                assert list(ours) == list(theirs)
                for key in theirs:
                    assert ours[key].dtype == theirs[key].dtype
                    np.testing.assert_array_equal(ours[key], theirs[key])
            with pytest.raises(millpond.InvalidArgumentError, match="episodic"):
                await mine.push_batch(**transitions(0, 2))
            assert await mine.size() == len(buf)

    run(main())
    buf.close()


# ---- the fast path ---------------------------------------------------------------------------


def test_large_calls_that_cannot_wait_move_through_shared_memory(shared_server):
    """On the server's host: samples, pushes and reads of more than 64 KiB of a buffer
    without a rate limiter take the fast path (on the client's threads), with the
    results of gRPC; small calls, and those that may wait, stay on the channel."""
    big = {"id": ("int64", ()), "obs": ("float32", (1024,))}  # 4 KB: sample(64) is 256 KB

    async def main():
        async with aio.connect(shared_server.address) as fast, \
                aio.connect(shared_server.address, shm=False) as slow:
            assert fast.transport == "grpc" and "not negotiated" in fast.shm_reason
            buf = await fast.create_buffer(name("fast"), capacity=1000, fields=big)
            await buf.push_batch(**records(0, 300, big))
            assert fast.transport == "shm" and buf.transport == "shm"
            other = await slow.buffer(buf.name)
            for call in (lambda b: b.sample(64, seed=1), lambda b: b.sample(4, seed=2),
                         lambda b: b.sample_all(), lambda b: b.sample_by_index([5, 0, 9])):
                mine, theirs = await call(buf), await call(other)
                assert list(mine) == list(theirs)
                for key in theirs:
                    np.testing.assert_array_equal(mine[key], theirs[key])
                    assert mine[key].dtype == theirs[key].dtype and mine[key].flags.writeable
            calls = fast.calls
            assert calls["shm", "push_batch"] == 1 and calls["shm", "sample"] == 1
            assert calls["shm", "read"] == 1  # sample_all
            assert calls["grpc", "sample"] == calls["grpc", "read"] == 1  # the small ones
            assert slow.transport == "grpc" and not any(t == "shm" for t, _ in slow.calls)
            limited = await fast.create_buffer(name("fast-limited"), capacity=1000, fields=big,
                                               rate_limiter=millpond.MinSize(10))
            await limited.push_batch(**records(0, 100, big))
            await limited.sample(64)  # may wait: on the channel, where it can be withdrawn
            assert fast.calls["grpc", "sample"] == 2 and fast.calls["grpc", "push_batch"] == 1
            await asyncio.gather(*(buf.sample(64) for _ in range(8)))  # on the threads at once
            assert fast.calls["shm", "sample"] == 9
            await buf.close()
            await limited.close()

    run(main())


@pytest.mark.daemon
def test_shared_memory_required_but_not_offered_is_refused_at_connect(tmp_path):
    with ServerProcess(tmp_path / "data", "--no-shm") as server:
        async def main():
            with pytest.raises(millpond.SharedMemoryError, match="required"):
                await aio.connect(server.address, shm=True)
            async with aio.connect(server.address) as client:  # "auto": gRPC, and why
                buf = await client.create_buffer("no-shm", capacity=100, fields=LARGE)
                await buf.push_batch(**records(0, 4, LARGE))
                assert client.transport == "grpc" and client.shm_reason
                assert client.calls["grpc", "push_batch"] == 1

        run(main())


# ---- tokens and roles ------------------------------------------------------------------------


@pytest.mark.daemon
def test_tokens_and_roles_are_checked_on_streams_and_unary_calls(tmp_path):
    """Every call carries the token, messages on streams too; a missing or wrong one is
    AuthenticationError, a role that may not make the call PermissionDeniedError."""
    tokens = tmp_path / "tokens"
    tokens.write_text("learner learner-token-0123456789\n")
    tokens.chmod(0o600)
    with ServerProcess(tmp_path / "data", "--token-file", str(tokens),
                       env={"MILLPOND_TOKEN": "admin-token-0123456789"}) as server:
        async def main():
            async with aio.connect(server.address, token="admin-token-0123456789", shm=False) as admin:
                buf = await admin.create_buffer("auth", capacity=100, fields=FIELDS)
                await buf.push_batch(**records(0, 10))  # a message on a stream
                assert len((await buf.sample(4))["id"]) == 4
            async with aio.connect(server.address, token="learner-token-0123456789", shm=False) as learner:
                mine = await learner.buffer("auth")
                assert len((await mine.sample(4))["id"]) == 4
                with pytest.raises(millpond.PermissionDeniedError):
                    await mine.push_batch(**records(10, 2))  # a learner may not push
                with pytest.raises(millpond.PermissionDeniedError):
                    await learner.delete_buffer("auth")
            for token in ("wrong-token-0123456789", ""):
                async with aio.connect(server.address, token=token, shm=False) as stranger:
                    with pytest.raises(millpond.AuthenticationError):
                        await stranger.buffer("auth")
            async with aio.connect(server.address, token="admin-token-0123456789", shm=False) as admin:
                assert (await (await admin.buffer("auth")).info())["pushed"] == 10

        run(main())


@pytest.mark.daemon
def test_calls_refused_on_their_headers_say_why_however_many_race(tmp_path):
    """A stream the daemon refuses as the request is written hides the daemon's status
    behind a local INTERNAL error of gRPC (grpc/grpc#36066): every refused push still
    raises PermissionDeniedError, never InternalError, and none is stored."""
    tokens = tmp_path / "tokens"
    tokens.write_text("learner learner-token-0123456789\n")
    tokens.chmod(0o600)
    with ServerProcess(tmp_path / "data", "--token-file", str(tokens),
                       env={"MILLPOND_TOKEN": "admin-token-0123456789"}) as server:
        async def main():
            async with aio.connect(server.address, token="admin-token-0123456789", shm=False) as admin:
                buf = await admin.create_buffer("auth", capacity=100, fields=FIELDS)
                async with aio.connect(server.address, token="learner-token-0123456789",
                                       shm=False) as learner:
                    mine = await learner.buffer("auth")

                    async def refused() -> str:
                        try:
                            await mine.push_batch(**records(0, 2))
                        except millpond.ReplayError as exc:
                            return type(exc).__name__
                        return "stored"

                    for _ in range(10):  # about one in ten raced before the fix
                        outcomes = await asyncio.gather(*(refused() for _ in range(20)))
                        assert set(outcomes) == {"PermissionDeniedError"}
                assert (await buf.info())["pushed"] == 0

        run(main())


# ---- what the daemon refuses before it draws, and buffers it holds out of service ------------


def test_a_consuming_sample_larger_than_the_client_can_receive_draws_nothing(shared_server):
    """The client sends its max_message_mb with every call (as the sync one does): a
    queue's sample whose reply would not arrive is refused before it draws."""
    async def main():
        async with aio.connect(shared_server.address, max_message_mb=1) as client:
            buf = await client.create_buffer(name("too-large"), capacity=40, fields=LARGE,
                                             mode="queue")
            for start in (0, 10):
                await buf.push_batch(**records(start, 10, LARGE))  # 10 x 80 KB each
            with pytest.raises(millpond.MessageTooLargeError):
                await buf.sample(14, timeout=0)  # 14 records: 1.12 MB, over 1 MiB
            assert await buf.size() == 20
            assert (await buf.sample(5, timeout=0))["id"].tolist() == [0, 1, 2, 3, 4]
            await buf.close()

    run(main())


@pytest.mark.daemon
def test_a_buffer_held_out_of_service_is_listed_and_refused(tmp_path):
    from test_operator import damage, make

    data = tmp_path / "data"
    make(data, "bad", "good")
    damage(data / "bad.buffer", "damaged-records")
    with ServerProcess(data) as server:
        async def main():
            async with aio.connect(server.address) as client:
                infos = {info.name: info for info in await client.list_buffers()}
                assert infos["good"].ok and infos["bad"].state == "damaged"
                assert (await client.info("bad")).reason == infos["bad"].reason
                with pytest.raises(millpond.BufferDamagedError):
                    await client.buffer("bad")
                assert await (await client.buffer("good")).size() == 40

        run(main())
