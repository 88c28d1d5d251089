"""Sampling with prefetch for learners: :class:`millpond.handle.sampler.Sampler`.

Real buffers (TieredBuffer and the public ReplayBuffer), real threads; waits
are on conditions with deadlines, never fixed sleeps.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from support import engine, wait_until

import millpond
from millpond.core import Schema
from millpond.errors import (
    BufferClosedError,
    InvalidArgumentError,
    InvalidBatchSizeError,
    NotEnoughDataError,
)
from millpond.handle.sampler import THREAD_NAME, Sampler

DEADLINE = 10.0
SCHEMA = Schema.transition(4, 1)


_EXISTING: set = set()


def sampler_threads() -> list[threading.Thread]:
    """Live sampler threads started since the current test began."""
    return [t for t in threading.enumerate()
            if t.name == THREAD_NAME and t.is_alive() and t not in _EXISTING]


@pytest.fixture(autouse=True)
def _ignore_older_threads():
    _EXISTING.clear()
    _EXISTING.update(threading.enumerate())


@pytest.fixture
def tiered():
    buf = engine(SCHEMA, 100, 100)
    n = 100
    buf.push_batch({
        "obs": np.arange(n * 4, dtype=np.float32).reshape(n, 4),
        "next_obs": np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 0.5,
        "actions": np.arange(n, dtype=np.float32).reshape(n, 1),
        "rewards": np.arange(n, dtype=np.float32),
        "terminated": np.arange(n) % 2 == 0,
        "truncated": np.arange(n) % 3 == 0,
    })
    yield buf
    buf.close()


def assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype


# ---- order and determinism -----------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_seeded_sequence_equals_sequential_calls(tiered, prefetch):
    with Sampler(tiered.sample, 32, prefetch=prefetch, seed=1234, max_batches=20) as s:
        got = list(s)
    assert len(got) == 20
    for i, batch in enumerate(got):
        assert_batches_equal(batch, tiered.sample(32, 1234 + i))
    assert len({batch["obs"].tobytes() for batch in got}) == 20  # really different draws


def test_batches_come_in_request_order_even_when_requests_finish_out_of_order():
    # Request i takes longer when i is even: later requests finish first.
    def sample(batch_size, seed):
        if seed % 2 == 0:
            time.sleep(0.01)
        return {"seed": np.full(batch_size, seed)}

    with Sampler(sample, 3, prefetch=4, seed=100, max_batches=12) as s:
        seeds = [int(b["seed"][0]) for b in s]
    assert seeds == list(range(100, 112))


def test_unseeded_batches_are_fresh_draws(tiered):
    with Sampler(tiered.sample, 64, prefetch=2, max_batches=5) as s:
        got = [b["obs"].tobytes() for b in s]
    assert len(set(got)) == 5


def test_max_batches(tiered):
    calls = []

    def sample(batch_size, seed):
        calls.append(seed)
        return tiered.sample(batch_size, seed)

    s = Sampler(sample, 8, prefetch=3, seed=0, max_batches=4)
    assert len(list(s)) == 4
    with pytest.raises(StopIteration):
        next(s)
    assert sorted(calls) == [0, 1, 2, 3]  # no request beyond max_batches
    assert s.closed
    s.close()
    assert list(Sampler(sample, 8, max_batches=0)) == []


def test_endless_by_default(tiered):
    with Sampler(tiered.sample, 8, prefetch=2, seed=0) as s:
        batches = sum(1 for _ in zip(range(200), s))
    assert batches == 200


# ---- prefetch really overlaps --------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_prefetch_requests_run_concurrently_and_never_more(prefetch):
    lock = threading.Lock()
    running = 0
    peak = 0
    # Every group of `prefetch` requests meets at a barrier: it only passes
    # if that many calls are in flight at once.
    barrier = threading.Barrier(prefetch, timeout=DEADLINE)

    def sample(batch_size, seed):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        try:
            barrier.wait()
            return {"seed": np.array([seed])}
        finally:
            with lock:
                running -= 1

    with Sampler(sample, 1, prefetch=prefetch, seed=0, max_batches=4 * prefetch) as s:
        seeds = [int(b["seed"][0]) for b in s]
    assert seeds == list(range(4 * prefetch))
    assert peak == prefetch


def test_requests_stay_in_flight_while_the_consumer_works():
    # With prefetch=3, after the consumer takes batch 0 and holds on to it,
    # requests 1..3 all start without it calling next() again.
    started = []
    cond = threading.Condition()

    def sample(batch_size, seed):
        with cond:
            started.append(seed)
            cond.notify_all()
        return {"seed": np.array([seed])}

    with Sampler(sample, 1, prefetch=3, seed=0) as s:
        assert int(next(s)["seed"][0]) == 0
        with cond:
            assert cond.wait_for(lambda: len(started) >= 4, DEADLINE)
        assert sorted(started) == [0, 1, 2, 3]


# ---- errors ------------------------------------------------------------------


def test_errors_surface_at_their_position(tiered):
    def sample(batch_size, seed):
        if seed == 3:
            raise NotEnoughDataError("request 3 failed")
        return tiered.sample(batch_size, seed)

    s = Sampler(sample, 4, prefetch=3, seed=0)
    for i in range(3):
        assert_batches_equal(next(s), tiered.sample(4, i))
    with pytest.raises(NotEnoughDataError, match="request 3"):
        next(s)
    assert s.closed
    with pytest.raises(StopIteration):
        next(s)
    s.close()
    assert wait_until(lambda: not sampler_threads())


def test_not_enough_data_is_raised_typed():
    buf = millpond.ReplayBuffer(10, 4, 1)
    with buf.sampler(5) as s:
        with pytest.raises(NotEnoughDataError):
            next(s)
    buf.close()


def test_closing_the_buffer_does_not_hang_the_sampler(tiered):
    s = Sampler(tiered.sample, 16, prefetch=2)
    next(s)
    tiered.close()
    with pytest.raises(BufferClosedError):
        for _ in range(10):  # at most `prefetch` batches were already drawn
            next(s)
    s.close()
    assert wait_until(lambda: not sampler_threads())


# ---- lifecycle --------------------------------------------------------------------


def test_close_joins_threads_and_is_idempotent(tiered):
    s = Sampler(tiered.sample, 8, prefetch=3)
    next(s)
    assert len(sampler_threads()) == 3
    s.close()
    assert not sampler_threads()  # close() joined them
    s.close()
    with pytest.raises(StopIteration):
        next(s)


def test_close_from_another_thread_wakes_a_waiting_consumer():
    release = threading.Event()

    def sample(batch_size, seed):
        release.wait(DEADLINE)
        return {"x": np.zeros(batch_size)}

    s = Sampler(sample, 1, prefetch=2)
    outcome = []

    def consume():
        try:
            next(s)
            outcome.append("batch")
        except StopIteration:
            outcome.append("stopped")

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert wait_until(lambda: len(sampler_threads()) == 2)
    closer = threading.Thread(target=s.close)
    closer.start()
    consumer.join(DEADLINE)
    assert outcome == ["stopped"]
    release.set()  # let the running requests return so close() can join them
    closer.join(DEADLINE)
    assert not closer.is_alive()
    assert not sampler_threads()


def test_dropped_sampler_stops_its_threads(tiered):
    s = Sampler(tiered.sample, 8, prefetch=2)
    next(s)
    assert sampler_threads()
    del s
    gc.collect()
    assert wait_until(lambda: not sampler_threads())


def test_no_threads_before_iteration(tiered):
    s = Sampler(tiered.sample, 8)
    assert not sampler_threads()
    s.close()


# ---- arguments -------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True, "8", None])
def test_invalid_batch_size(batch_size):
    with pytest.raises(InvalidBatchSizeError):
        Sampler(lambda b, s: {}, batch_size)


@pytest.mark.parametrize("kwargs", [
    {"prefetch": 0}, {"prefetch": -2}, {"prefetch": 1.5}, {"prefetch": True}, {"prefetch": None},
    {"seed": -1}, {"seed": 1.0}, {"seed": 2**64},
    {"max_batches": -1}, {"max_batches": 1.0},
])
def test_invalid_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        Sampler(lambda b, s: {}, 8, **kwargs)


# ---- through the public Buffer ------------------------------------------------------


def test_buffer_sampler_and_flush():
    buf = millpond.ReplayBuffer(50, 4, 1)
    for i in range(20):
        buf.push(np.full(4, i, np.float32), np.zeros(1, np.float32), float(i), False, False,
                 np.full(4, i, np.float32))
    buf.flush()  # in-process: stored on push, flush is a no-op
    with buf.sampler(8, prefetch=2, seed=7, max_batches=3) as s:
        got = list(s)
    for i, batch in enumerate(got):
        assert_batches_equal(batch, buf.sample(8, 7 + i))
    with pytest.raises(InvalidArgumentError):
        buf.sampler(8, prefetch=0)
    buf.close()
