"""Every buffer kind on every transport: in-process, gRPC and shared memory, and the
asyncio client (millpond.aio, over gRPC).

Each test builds the same kind of buffer four ways, runs the same calls on
each (seeded samples, bad input, ``timeout=`` values 0, negative, small and
None, priorities) and checks that every call has the same outcome (the same
arrays, or the same exception type) and that the buffers end in the same
state. Threads sharing one client are checked on every transport too (for
"aio", threads whose calls go on at once on one event loop: tests/aio_sync.py).
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from aio_sync import SyncBuffer
from support import run_everywhere

import millpond

FIELDS = {"id": ("int64", ()), "obs": ("float32", (3,)), "next_obs": ("float32", (3,))}
KINDS = {
    "ram": dict(capacity=12),
    "tiered": dict(hot_capacity=4, total_capacity=12),
    "prioritized": dict(hot_capacity=4, total_capacity=12, prioritized=True, alpha=0.7, beta=0.5),
    "rate_limited": dict(hot_capacity=4, total_capacity=12,
                         rate_limiter=millpond.SampleToInsertRatio(2.0, 4, error_buffer=10)),
    "queue": dict(capacity=12, mode="queue"),
    "stack": dict(hot_capacity=3, total_capacity=12, mode="stack"),
    "max_times_sampled": dict(hot_capacity=4, total_capacity=12, max_times_sampled=2),
    # frames stored once: obs a stack of 3 (scalar) frames, next_obs the next record's obs
    "pixel": dict(hot_capacity=4, total_capacity=12, frame_stack={"obs": 0},
                  next_of={"next_obs": "obs"}),
}
TRANSPORTS = ("local", "grpc", "shm")
# The transports of the tests of threads sharing a client: these, and the asyncio client.
THREADED = (*TRANSPORTS, "aio")
SMALL = 0.05  # seconds: a timeout short enough to expire in a test
_names = itertools.count()


def records(start: int, n: int, width: int = 3, next_obs: bool = True) -> dict[str, np.ndarray]:
    """Self-describing records: obs is derived from id, next_obs is the next id's obs."""
    ids = np.arange(start, start + n)
    out = {"id": ids, "obs": np.repeat(ids[:, None] * 0.5, width, axis=1).astype(np.float32)}
    if next_obs:
        out["next_obs"] = np.repeat((ids[:, None] + 1) * 0.5, width, axis=1).astype(np.float32)
    return out


def local_buffer(tmp_path, spec: dict, fields: dict = FIELDS):
    """The in-process buffer for ``spec``, through the public constructors."""
    spec = dict(spec)
    hot = spec.pop("hot_capacity", spec.get("capacity"))
    total = spec.pop("total_capacity", spec.pop("capacity", None))
    path = tmp_path / f"local-{next(_names)}.buffer"
    if spec.pop("prioritized", False):
        return millpond.PrioritizedReplayBuffer(hot_capacity=hot, total_capacity=total,
                                                cold_path=path, fields=fields, **spec)
    return millpond.MmapReplayBuffer(hot, total, cold_path=path, fields=fields, **spec)


@pytest.fixture
def three(shared_server, aio_loop, tmp_path):
    """three(kind) -> {transport: buffer}, all of that kind, empty: "local", "grpc", "shm"
    and (unless ``aio=False``) "aio", millpond.aio's handle driven from sync code."""
    made = []

    def factory(kind: str, aio: bool = True, **client_options) -> dict:
        spec = KINDS[kind]
        name = f"kinds-{kind}-{next(_names)}"
        bufs = {"local": local_buffer(tmp_path, spec)}
        for transport in ("grpc", "shm"):
            client = millpond.connect(shared_server.address, shm=transport == "shm", **client_options)
            assert client.transport == transport
            bufs[transport] = client.create_buffer(f"{name}-{transport}", fields=FIELDS, **spec)
        if aio:
            client = aio_loop.connect(shared_server.address)
            bufs["aio"] = SyncBuffer(aio_loop, aio_loop.run(client.create_buffer(
                f"{name}-aio", fields=FIELDS, **spec)), own_client=True)
        made.extend(bufs.values())
        return bufs

    yield factory
    for buf in made:
        buf.close()


def common_calls(kind: str) -> list:
    """A session of pushes, samples and mistakes; every outcome must agree across transports."""
    calls = [
        lambda b: len(b),
        lambda b: b.push_batch(**records(0, 6)),
        lambda b: [b.push(**{k: v[0] for k, v in records(6 + i, 1).items()}) for i in range(3)],
        lambda b: len(b),
        lambda b: b.push_batch(id=np.arange(3), obs=np.zeros((3, 2))),  # wrong shape
        lambda b: b.push_batch(id=np.arange(2.0), obs=np.zeros((2, 3))),  # floats into int64
        lambda b: b.push_batch(id=np.arange(2)),  # a field missing
        lambda b: b.push_batch(**records(20, 2), timeout=-1),
        lambda b: b.push(**{k: v[0] for k, v in records(30, 1).items()}, timeout=-0.5),
        lambda b: b.push_batch(**records(20, 2), timeout=float("nan")),
        lambda b: b.sample(2, timeout=-1),
        lambda b: b.sample(2, timeout=float("inf")),
        lambda b: b.sample(0),
        lambda b: b.sample(2, seed=-1),
        lambda b: b.sample(100),
        # None waits without limit in-process (remote: the client's timeout), so
        # these come where no kind has to wait; 0 and SMALL come where some do.
        lambda b: b.sample(2, seed=4, timeout=None),
        lambda b: b.push_batch(**records(48, 1), timeout=None),
        lambda b: b.sample(3, seed=1),
        lambda b: b.sample(3, seed=2, timeout=0),
        lambda b: b.sample(2, seed=3, timeout=SMALL),
        lambda b: b.push_batch(**records(40, 4), timeout=0),
        lambda b: b.push_batch(**records(44, 4), timeout=SMALL),  # rate_limited: over the band
        lambda b: b.sample(4, seed=5),
        lambda b: len(b),
        # Learner-side access: positions into the records held (0 = oldest), reset.
        lambda b: b.size,
        lambda b: b.sample_by_index([0, len(b) - 1, 1]),
        lambda b: b.sample_by_index([1, 0], fields=["obs"]),
        lambda b: b.sample_by_index([len(b)]),  # IndexOutOfRangeError
        lambda b: b.sample_by_index([-1]),
        lambda b: b.sample_by_index([0.5]),
        lambda b: b.sample_by_index([0], fields=["nope"]),
        lambda b: b.sample_all(),
        lambda b: b.sample_all(fields=["id"]),
        lambda b: list(b.epoch_iterator(3, n_epochs=2, seed=3)),
        lambda b: list(b.epoch_iterator(3, shuffle=False, drop_last=True, fields=["id"])),
        lambda b: b.epoch_iterator(0),
        lambda b: b.calculate_num_batches(3),
        lambda b: b.reset(),
        lambda b: (len(b), b.sample_all()),
        lambda b: b.sample_by_index([0]),
        lambda b: b.push_batch(**records(70, 5)),
        lambda b: (b.sample_all(), b.sample_by_index([4, 0])),
        lambda b: b.sample(2, seed=8, timeout=0),
    ]
    if kind == "prioritized":
        calls += [
            lambda b: b.update_priorities(b.sample(4, seed=6)["indices"], [0.5, 2.0, 3.0, 1.0]),
            lambda b: b.update_priorities([0, 1], [1.0, -1.0]),
            lambda b: b.set_beta(1.0),
            lambda b: b.set_beta(-1.0),
            lambda b: b.push_batch(**records(60, 2), priorities=[5.0, 0.0]),
            lambda b: b.push_batch(**records(62, 2), priorities=[1.0]),
            lambda b: b.sample(6, seed=7),
        ]
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_behaves_the_same_on_every_transport(three, kind):
    run_everywhere(three(kind), common_calls(kind))


# 8 KB records: a call of 8 or more moves over 64 KiB, which millpond.aio sends through
# shared memory (on its threads) when the buffer cannot make it wait, else over gRPC.
LARGE = {"id": ("int64", ()), "obs": ("float32", (2048,))}
LARGE_PIXEL = {"id": ("int64", ()), "obs": ("float32", (1024,)), "next_obs": ("float32", (1024,))}


@pytest.mark.parametrize("kind", KINDS)
def test_large_calls_have_the_same_outcomes_on_every_kind(shared_server, aio_loop, tmp_path,
                                                          kind):
    spec, name = KINDS[kind], f"kinds-large-{kind}-{next(_names)}"
    pixel = "next_of" in spec  # (the same 8 KB records: obs and next_obs of 4 KB)
    fields = LARGE_PIXEL if pixel else LARGE
    bufs = {"local": local_buffer(tmp_path, spec, fields),
            "shm": millpond.connect(shared_server.address, shm=True).create_buffer(
                f"{name}-shm", fields=fields, **spec)}
    client = aio_loop.connect(shared_server.address)
    bufs["aio"] = SyncBuffer(aio_loop, aio_loop.run(client.create_buffer(
        f"{name}-aio", fields=fields, **spec)), own_client=True)
    big = lambda start, n: records(start, n, 1024 if pixel else 2048, next_obs=pixel)  # noqa: E731
    calls = [lambda b: b.push_batch(**big(0, 6), timeout=0),  # (timeout=0: only try)
             lambda b: b.push_batch(**big(6, 4), timeout=0),
             lambda b: b.sample(9, seed=1, timeout=0),
             lambda b: b.sample_all(),
             lambda b: b.sample_by_index(np.arange(len(b))[::-1]),
             lambda b: b.push_batch(**big(20, 10), timeout=0),
             lambda b: b.sample(100, timeout=0),
             lambda b: b.sample(9, seed=2, timeout=SMALL),
             lambda b: (len(b), b.sample_all(fields=["id"]))]
    if kind == "prioritized":
        calls.append(lambda b: b.update_priorities(b.sample(9, seed=3)["indices"], np.ones(9)))
    try:
        run_everywhere(bufs, calls)
        transports = {transport for transport, _ in client.calls.elements()}
        assert transports == ({"grpc"} if "rate_limiter" in spec or "mode" in spec
                              else {"grpc", "shm"}), client.calls  # (queues, stacks: limited)
    finally:
        for buf in bufs.values():
            buf.close()


@pytest.mark.parametrize("kind", ["rate_limited", "queue", "stack"])
def test_calls_that_must_wait_time_out_the_same_way(three, kind):
    """timeout=0 refuses at once, a small timeout waits that long, and neither changes anything."""
    bufs = three(kind)
    calls = [lambda b: b.push_batch(**records(0, 3))]  # below min size / fewer than asked
    for timeout in (0, SMALL):
        calls.append(lambda b, t=timeout: b.sample(4, timeout=t))
    # Fill the band (9 inserts x 2 = 18: pushes wait for samples) or the queue (12 held).
    fill = 6 if kind == "rate_limited" else 9
    calls += [lambda b: b.push_batch(**records(3, fill)),
              lambda b: b.push_batch(**records(20, 1), timeout=0),
              lambda b: b.push(**{k: v[0] for k, v in records(21, 1).items()}, timeout=SMALL)]
    calls.append(lambda b: b.sample(4, seed=9, timeout=0))
    run_everywhere(bufs, calls)
    for buf in bufs.values():
        info = buf.info()
        assert info["insert_waits"] == 1 and info["sample_waits"] == 1  # timeout=0 is no wait
        assert info["insert_wait_seconds"] >= SMALL * 0.9
        assert info["waiting_inserts"] == info["waiting_samples"] == 0


@pytest.mark.parametrize("transport", THREADED)
def test_a_waiting_call_proceeds_when_another_thread_unblocks_it(three, transport):
    """timeout=None (remote: the client's timeout) waits for a push from another thread."""
    buf = three("queue")[transport]
    got = {}

    def consumer():
        got["batch"] = buf.sample(2, timeout=None)

    thread = threading.Thread(target=consumer)
    thread.start()
    _wait_for(lambda: buf.info()["waiting_samples"] == 1)
    buf.push_batch(**records(0, 2))
    thread.join(30)
    assert not thread.is_alive()
    assert got["batch"]["id"].tolist() == [0, 1] and len(buf) == 0


@pytest.mark.parametrize("transport", THREADED)
def test_one_client_shared_by_an_actor_thread_and_a_waiting_learner(three, transport):
    """An actor pushes and a learner samples through one client at once; the learner
    keeps waiting on the rate limiter, and neither blocks the other."""
    buf = three("rate_limited")[transport]
    rounds, errors = 60, []

    def guarded(fn):
        def run():
            try:
                fn()
            except Exception as exc:  # reported below, with the transport
                errors.append(repr(exc))
        return run

    @guarded
    def actor():
        for i in range(rounds):
            buf.push_batch(**records(4 * i, 4), timeout=20)

    @guarded
    def learner():
        for _ in range(rounds):
            batch = buf.sample(8, timeout=20)  # 2 samples per insert: 8 per 4 pushed
            np.testing.assert_array_equal(batch["obs"][:, 0], batch["id"] * 0.5)

    threads = [threading.Thread(target=learner), threading.Thread(target=actor)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads), (transport, errors)
    info = buf.info()
    assert (info["inserts"], info["samples"]) == (4 * rounds, 8 * rounds)
    assert info["sample_waits"] + info["insert_waits"] > 0  # they really did wait on each other


@pytest.mark.parametrize("transport", ["grpc", "shm", "aio"])
def test_many_threads_share_one_client(three, transport):
    buf = three("tiered")[transport]
    buf.push_batch(**records(0, 12))
    errors = []

    def work(seed: int):
        try:
            for i in range(20):
                batch = buf.sample(5, seed=seed * 100 + i)
                np.testing.assert_array_equal(batch["obs"][:, 1], batch["id"] * 0.5)
                buf.push_batch(**records(100 + seed, 1))
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and buf.info()["pushed"] == 12 + 6 * 20


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)
