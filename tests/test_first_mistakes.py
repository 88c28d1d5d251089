"""A newcomer's first mistakes (issue 28): each gives a clear message within seconds.

* a wrong port: a warning saying what is waited for, or (``wait_for_server=False``)
  ServerUnavailableError, instead of 60 silent seconds;
* a learner's mistyped buffer name: BufferNotFoundError naming close names, never a new
  empty buffer to wait on;
* ``sample(k)`` with ``k > len``: one rule with or without a rate limiter;
* a push to a dataset served read-only: ReadOnlyBufferError, not the dataset's fields.

Times are bounded generously (the old behaviour took the 60 s default deadline); no
test measures performance.
"""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time

import numpy as np
import pytest
from support import ServerProcess, wait_until
from test_contract import transitions

import millpond
from millpond.core.dataset import ReadOnlyBuffer, dataset_columns
from millpond.handle.buffer import handle_for

SECONDS = 10.0  # "within seconds": generous, where the old behaviour took 60 s


def unused_address() -> str:
    """An address nothing listens on (a port the kernel just gave and took back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def warnings_about(caplog, address: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING
            and r.name.startswith("millpond") and address in r.getMessage()]


_names = iter(range(10**6))


def name(prefix: str) -> str:
    return f"mistakes-{prefix}-{next(_names)}"


# ---- a wrong port ------------------------------------------------------------------


def test_a_call_waiting_for_an_unreachable_server_says_so_within_seconds(caplog):
    caplog.set_level(logging.WARNING, logger="millpond")
    address = unused_address()
    client = millpond.connect(address, timeout=6)  # (the default: 60 s)
    outcome: list[BaseException] = []

    def call():
        try:
            client.create_buffer("x", capacity=8, obs_dim=2, act_dim=1)
        except BaseException as exc:  # noqa: BLE001 (checked below)
            outcome.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    wait_until(lambda: warnings_about(caplog, address), timeout=SECONDS)
    assert thread.is_alive()  # said while the call still waits, seconds before its deadline
    [record] = warnings_about(caplog, address)
    assert "connection refused" in record.getMessage()
    assert "wait_for_server=False" in record.getMessage()  # how not to wait
    thread.join(6 + SECONDS)
    assert time.monotonic() - start < 6 + SECONDS
    assert isinstance(outcome[0], millpond.DeadlineExceededError)
    client.close()


def test_one_warning_per_episode_and_a_deadline_that_says_why(caplog):
    caplog.set_level(logging.WARNING, logger="millpond")
    address = unused_address()
    client = millpond.connect(address, timeout=2)
    start = time.monotonic()
    for _ in range(2):
        with pytest.raises(millpond.DeadlineExceededError) as info:
            client.create_buffer("x", capacity=8, obs_dim=2, act_dim=1)
        message = str(info.value)
        assert address in message and "nothing listens there" in message
    assert time.monotonic() - start < 2 * (2 + SECONDS)
    assert len(warnings_about(caplog, address)) == 1  # one episode: told once
    client.close()


@pytest.mark.parametrize("make", [
    lambda address: millpond.connect(address, wait_for_server=False).create_buffer(
        "x", capacity=8, obs_dim=2, act_dim=1),
    lambda address: millpond.connect(address, wait_for_server=False).buffer("x"),
    lambda address: millpond.ReplayBuffer(8, 2, 1, address=address, name="x",
                                          wait_for_server=False),
    lambda address: millpond.MmapReplayBuffer(4, 8, 2, 1, address=address, name="x",
                                              wait_for_server=False),
], ids=["create_buffer", "buffer", "ReplayBuffer", "MmapReplayBuffer"])
def test_wait_for_server_false_fails_fast_naming_the_address_and_cause(make):
    address = unused_address()
    start = time.monotonic()
    with pytest.raises(millpond.ServerUnavailableError) as info:
        make(address)
    assert time.monotonic() - start < SECONDS
    assert address in str(info.value) and "connection refused" in str(info.value)


def test_wait_for_server_false_names_a_host_that_does_not_resolve():
    start = time.monotonic()
    with pytest.raises(millpond.ServerUnavailableError) as info:
        millpond.connect("no-such-host.invalid:50051", wait_for_server=False).buffer("x")
    assert time.monotonic() - start < SECONDS
    assert "no-such-host.invalid:50051" in str(info.value)


def test_wait_for_server_is_checked_and_pickled():
    with pytest.raises(millpond.InvalidConfigError):
        millpond.connect("localhost:1", wait_for_server="no")
    client = pickle.loads(pickle.dumps(millpond.connect("localhost:1", wait_for_server=False)))
    assert client.wait_for_server is False


def test_a_fail_fast_client_works_with_a_running_server(shared_server):
    client = millpond.connect(shared_server.address, wait_for_server=False)
    buf = client.create_buffer(name("fast"), capacity=8, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 3))
    assert len(buf) == 3
    buf.close()


@pytest.mark.daemon
def test_a_server_coming_up_is_still_waited_for(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="millpond")
    address = unused_address()
    client = millpond.connect(address, timeout=60)
    made: list = []
    thread = threading.Thread(target=lambda: made.append(
        client.create_buffer("late", capacity=8, obs_dim=2, act_dim=1)), daemon=True)
    thread.start()
    wait_until(lambda: warnings_about(caplog, address), timeout=SECONDS)
    port = address.rsplit(":", 1)[1]
    with ServerProcess(tmp_path / "data", "--port", port):  # (the last --port counts)
        thread.join(40)  # gRPC's reconnect backoff: a few seconds
        assert made and len(made[0]) == 0
        made[0].close()
    client.close()


def test_aio_says_so_too(caplog, aio_loop):
    caplog.set_level(logging.WARNING, logger="millpond")
    address = unused_address()
    fast = aio_loop.connect(address, wait_for_server=False)
    start = time.monotonic()
    with pytest.raises(millpond.ServerUnavailableError) as info:
        aio_loop.run(fast.buffer("x"))
    assert time.monotonic() - start < SECONDS
    assert address in str(info.value) and "connection refused" in str(info.value)
    aio_loop.run(fast.close())
    waiting = aio_loop.connect(address, timeout=2)
    for _ in range(2):
        with pytest.raises(millpond.DeadlineExceededError) as info:
            aio_loop.run(waiting.buffer("x"))
        assert address in str(info.value) and "nothing listens there" in str(info.value)
    assert len(warnings_about(caplog, address)) == 1
    aio_loop.run(waiting.close())


# ---- a learner's typo ----------------------------------------------------------------


def test_a_learners_typo_fails_at_its_first_sample_and_creates_nothing(shared_server):
    address = shared_server.address
    right = name("cartpole")
    actor = millpond.ReplayBuffer(64, 2, 1, address=address, name=right)
    actor.push_batch(**transitions(0, 10))
    typo = right[:-1] + "x"
    learner = millpond.ReplayBuffer(64, 2, 1, address=address, name=typo,
                                    rate_limiter=None)
    start = time.monotonic()
    for read in (lambda: learner.sample(8), lambda: len(learner), learner.info):
        with pytest.raises(millpond.BufferNotFoundError) as info:
            read()
        message = str(info.value)
        assert repr(typo) in message and repr(right) in message and "create=True" in message
    assert time.monotonic() - start < SECONDS
    listed = {i.name for i in millpond.connect(address).list_buffers()}
    assert right in listed and typo not in listed
    learner.close()
    actor.close()


def test_create_false_attaches_only(shared_server):
    address = shared_server.address
    right = name("attach")
    with pytest.raises(millpond.BufferNotFoundError) as info:
        millpond.ReplayBuffer(16, 2, 1, address=address, name=right, create=False)
    assert repr(right) in str(info.value)
    actor = millpond.ReplayBuffer(16, 2, 1, address=address, name=right, create=True)
    actor.push_batch(**transitions(0, 4))
    with pytest.raises(millpond.BufferNotFoundError) as info:
        millpond.ReplayBuffer(16, 2, 1, address=address, name=right + "s", create=False)
    assert f"did you mean {right!r}" in str(info.value)
    learner = millpond.ReplayBuffer(16, 2, 1, address=address, name=right, create=False)
    assert len(learner) == 4 and not learner.backend.owner
    with pytest.raises(millpond.ConfigMismatchError):
        millpond.ReplayBuffer(32, 2, 1, address=address, name=right, create=False)
    with pytest.raises(millpond.InvalidConfigError):
        millpond.ReplayBuffer(16, 2, 1, address=address, name=right, create="yes")
    learner.close()
    actor.close()
    assert right not in {i.name for i in millpond.connect(address).list_buffers()}


def test_the_default_creates_on_the_first_write(shared_server):
    address = shared_server.address
    fresh = name("fresh")
    actor = millpond.ReplayBuffer(16, 2, 1, address=address, name=fresh)
    assert fresh not in {i.name for i in millpond.connect(address).list_buffers()}
    actor.push(np.zeros(2), np.zeros(1), 1.0, False, False, np.ones(2))  # queued
    assert len(actor) == 1  # the read sends it: created
    assert actor.backend.owner  # it made the buffer: close() deletes it, as before
    copy = pickle.loads(pickle.dumps(actor))  # attached: never owns
    assert len(copy) == 1 and not copy.backend.owner
    actor.close()
    assert fresh not in {i.name for i in millpond.connect(address).list_buffers()}


def test_a_learner_that_waits_for_its_actor_creates_or_finds_the_buffer(shared_server):
    address = shared_server.address
    shared = name("shared")
    # Made before the buffer exists, sampled once the actor made it: attaches then.
    early = millpond.ReplayBuffer(16, 2, 1, address=address, name=shared)
    actor = millpond.ReplayBuffer(16, 2, 1, address=address, name=shared)
    actor.push_batch(**transitions(0, 6))
    assert len(early.sample(4)["obs"]) == 4 and not early.backend.owner
    # create=True: a learner that starts first makes it and waits for data.
    first = name("learner-first")
    learner = millpond.ReplayBuffer(16, 2, 1, address=address, name=first, create=True,
                                    rate_limiter=millpond.MinSize(3))
    feeder = millpond.ReplayBuffer(16, 2, 1, address=address, name=first,
                                   rate_limiter=millpond.MinSize(3))
    feeder.push_batch(**transitions(0, 3))
    assert len(learner.sample(3, timeout=SECONDS)["obs"]) == 3
    for buf in (early, actor, feeder, learner):
        buf.close()


def test_a_pickled_pending_handle_creates_but_never_owns(shared_server):
    address = shared_server.address
    fresh = name("pickled")
    pending = millpond.ReplayBuffer(16, 2, 1, address=address, name=fresh)
    child = pickle.loads(pickle.dumps(pending))  # an actor process's copy
    child.push_batch(**transitions(0, 2))
    assert not child.backend.owner
    child.close()  # it did not own what it made: the buffer stays
    assert len(millpond.connect(address).buffer(fresh)) == 2
    millpond.connect(address).delete_buffer(fresh)
    pending.close()


def test_attaching_to_a_typo_names_close_buffers(shared_server, aio_loop):
    address = shared_server.address
    right = name("near")
    buf = millpond.connect(address).create_buffer(right, capacity=8, obs_dim=2, act_dim=1)
    with pytest.raises(millpond.BufferNotFoundError) as info:
        millpond.connect(address).buffer(right.upper())
    assert repr(right) in str(info.value)
    client = aio_loop.connect(address)
    with pytest.raises(millpond.BufferNotFoundError) as info:
        aio_loop.run(client.buffer(right + "x"))
    assert repr(right) in str(info.value)
    aio_loop.run(client.close())
    buf.close()


# ---- sample(k) with k > len ----------------------------------------------------------


@pytest.fixture(params=["in-process", "grpc", "shm", "aio"])
def make_buffer(request, shared_server, aio_loop):
    """Buffers of 16 records, with or without a rate limiter, on each transport: a
    function ``(rate_limiter) -> (push_batch, sample)``."""
    made: list = []

    def make(rate_limiter):
        if request.param == "in-process":
            buf = millpond.ReplayBuffer(16, 2, 1, rate_limiter=rate_limiter)
            made.append(buf.close)
            return buf.push_batch, buf.sample
        if request.param == "aio":
            client = aio_loop.connect(shared_server.address)
            buf = aio_loop.run(client.create_buffer(name("aio"), capacity=16, obs_dim=2,
                                                    act_dim=1, rate_limiter=rate_limiter))
            made.append(lambda: (aio_loop.run(buf.close()), aio_loop.run(client.close())))
            return (lambda **kw: aio_loop.run(buf.push_batch(**kw)),
                    lambda *a, **kw: aio_loop.run(buf.sample(*a, **kw)))
        client = millpond.connect(shared_server.address, shm=request.param == "shm")
        assert client.transport == request.param
        buf = client.create_buffer(name(request.param), capacity=16, obs_dim=2, act_dim=1,
                                   rate_limiter=rate_limiter)
        made.append(buf.close)
        return buf.push_batch, buf.sample

    yield make
    for close in made:
        close()


def test_a_sample_needs_as_many_records_held_limiter_or_not(make_buffer):
    push, sample = make_buffer(None)
    push(**transitions(0, 5))
    with pytest.raises(millpond.NotEnoughDataError, match="batch_size 8 > buffer len 5"):
        sample(8)
    assert len(sample(5)["obs"]) == 5  # with replacement, up to len

    push, sample = make_buffer(millpond.MinSize(2))  # the limiter allows it: len does not
    push(**transitions(0, 5))
    start = time.monotonic()
    with pytest.raises(millpond.RateLimitTimeoutError) as info:
        sample(8, timeout=0.3)
    assert time.monotonic() - start < SECONDS
    assert "fewer than the 8 records a sample of 8 needs" in str(info.value)
    push(**transitions(5, 3))
    assert len(sample(8, timeout=SECONDS)["obs"]) == 8  # held now
    with pytest.raises(millpond.NotEnoughDataError, match="capacity 16"):
        sample(17, timeout=SECONDS)  # could never be held: at once


def test_a_waiting_sample_proceeds_once_enough_records_are_held():
    buf = millpond.ReplayBuffer(64, 2, 1, rate_limiter=millpond.MinSize(1))
    buf.push_batch(**transitions(0, 2))
    got: list = []
    thread = threading.Thread(target=lambda: got.append(buf.sample(10, timeout=SECONDS)))
    thread.start()
    buf.push_batch(**transitions(2, 8))
    thread.join(SECONDS)
    assert got and len(got[0]["obs"]) == 10
    buf.close()


# ---- a push to a read-only dataset ---------------------------------------------------


def dataset_arrays(n: int = 40) -> dict:
    rng = np.random.default_rng(0)
    terminated = np.arange(n) % 10 == 9
    return dict(obs=rng.normal(size=(n, 2)).astype(np.float32),
                next_obs=rng.normal(size=(n, 2)).astype(np.float32),
                actions=rng.normal(size=(n, 1)).astype(np.float32),
                rewards=rng.normal(size=n).astype(np.float32), terminated=terminated,
                truncated=np.zeros(n, bool))


def ordinary_writes(buf) -> dict:
    """Writes of ordinary transitions (no ``returns_to_go``), as a newcomer makes them."""
    batch = transitions(0, 3)
    return {
        "push": lambda: (buf.push(np.zeros(2), np.zeros(1), 1.0, False, False, np.ones(2)),
                         buf.flush()),
        "push_batch": lambda: buf.push_batch(**batch),
        "push_batch positional": lambda: buf.push_batch(
            batch["obs"], batch["next_obs"], batch["actions"], batch["rewards"],
            batch["terminated"], batch["truncated"]),
        "store": lambda: buf.store(obs=np.zeros(2)),
        "end_episode": lambda: buf.end_episode(),
        "one_episode": lambda: buf.one_episode().__enter__(),
        "episode_writer": lambda: buf.episode_writer(2),
        "reset": buf.reset,
    }


def test_an_in_process_dataset_refuses_writes_before_checking_fields():
    dataset = ReadOnlyBuffer(dataset_columns(**dataset_arrays()))
    buf = handle_for(dataset)  # a plain handle over it
    for what, write in ordinary_writes(buf).items():
        with pytest.raises(millpond.ReadOnlyBufferError, match="read-only"):
            write()
        assert len(buf) == 40, what
    assert buf.info()["read_only"] and len(buf) == 40
    assert not millpond.ReplayBuffer(4, 2, 1).info()["read_only"]


@pytest.fixture(scope="module")
def dataset_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dataset")
    np.savez(folder / "walker.npz", **dataset_arrays())
    with ServerProcess(folder / "data", "--dataset", f"walker={folder / 'walker.npz'}") as srv:
        yield srv


@pytest.mark.daemon
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_served_dataset_says_read_only_first(dataset_server, transport):
    client = millpond.connect(dataset_server.address, shm=transport == "shm")
    assert client.transport == transport
    buf = client.buffer("walker")
    assert buf.info()["read_only"]
    start = time.monotonic()
    for what, write in ordinary_writes(buf).items():
        with pytest.raises(millpond.ReadOnlyBufferError) as info:
            write()
        assert "read-only" in str(info.value), what
    assert time.monotonic() - start < SECONDS
    # The daemon too checks it first, whatever a client sends (here: another schema's
    # columns, past the client's own checks), over either transport.
    schema = millpond.ReplayBuffer(4, 2, 1).schema
    columns = schema.coerce_batch(transitions(0, 2))[1]
    with pytest.raises(millpond.ReadOnlyBufferError):
        client.connection.call("push_batch", "walker", schema, 2, columns, None, 0.0, SECONDS)
    assert len(buf) == 40 and buf.info()["pushed"] == 40
    buf.close()
    client.close()


@pytest.mark.daemon
def test_aio_says_read_only_first(dataset_server, aio_loop):
    client = aio_loop.connect(dataset_server.address)
    buf = aio_loop.run(client.buffer("walker"))
    assert buf.read_only
    for write in (lambda: buf.push_batch(**transitions(0, 3)),
                  lambda: buf.push(np.zeros(2), np.zeros(1), 1.0, False, False, np.ones(2)),
                  buf.reset):
        with pytest.raises(millpond.ReadOnlyBufferError):
            aio_loop.run(write())
    aio_loop.run(client.close())
