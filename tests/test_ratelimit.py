"""Rate limiting, queue mode and max_times_sampled in-process: waits, timeouts, ratios, stats.

Concurrency here is real threads on one buffer; the same rules over a real
server (processes, killed clients, the event loop) are in
``test_ratelimit_server.py``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support import engine, wait_until

import millpond
from millpond.core import Schema, TieredBuffer
from millpond.errors import (
    BufferClosedError,
    DeadlineExceededError,
    InvalidArgumentError,
    InvalidConfigError,
    RateLimitTimeoutError,
)

SCHEMA = Schema.from_spec({"id": ("int64", ())})


def ids(start: int, n: int) -> dict[str, np.ndarray]:
    return {"id": np.arange(start, start + n)}


def diff(info: dict, limiter: millpond.RateLimiter) -> float:
    return info["inserts"] * limiter.samples_per_insert - info["samples"]


class Background(threading.Thread):
    """Run ``fn`` in a thread, keeping its result or exception for the test."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def outcome(self, timeout: float = 20.0):
        self.join(timeout)
        assert not self.is_alive(), "the call never returned"
        if self.error is not None:
            raise self.error
        return self.result


def test_min_size_makes_samples_wait_until_enough_records_arrive():
    buf = engine(SCHEMA, 100, 100, rate_limiter=millpond.MinSize(10))
    buf.push_batch(ids(0, 5))
    waiter = Background(lambda: buf.sample(4, timeout=20))
    wait_until(lambda: buf.info()["waiting_samples"] == 1)
    assert waiter.is_alive()
    buf.push_batch(ids(5, 5))
    assert len(waiter.outcome()["id"]) == 4
    info = buf.info()
    assert info["sample_waits"] == 1 and info["waiting_samples"] == 0
    assert info["sample_wait_seconds"] > 0


def test_a_sample_that_times_out_changes_nothing():
    buf = engine(SCHEMA, 100, 100, rate_limiter=millpond.MinSize(10))
    buf.push_batch(ids(0, 3))
    before = buf.contents()
    start = time.monotonic()
    with pytest.raises(RateLimitTimeoutError) as caught:
        buf.sample(2, timeout=0.2)
    assert time.monotonic() - start >= 0.2
    assert isinstance(caught.value, DeadlineExceededError) and isinstance(caught.value, TimeoutError)
    assert "min size to sample 10" in str(caught.value)
    np.testing.assert_array_equal(buf.contents()["id"], before["id"])
    info = buf.info()
    assert (info["samples"], info["sample_waits"]) == (0, 1)


def test_pushes_wait_when_actors_run_ahead_of_learners():
    limiter = millpond.SampleToInsertRatio(samples_per_insert=2.0, min_size_to_sample=4,
                                           error_buffer=8)  # diff in [0, 16]
    buf = engine(SCHEMA, 100, 100, rate_limiter=limiter)
    buf.push_batch(ids(0, 4))  # free until min size: diff 8
    buf.push_batch(ids(4, 4))  # diff 16: at the top of the band
    with pytest.raises(RateLimitTimeoutError):
        buf.push_batch(ids(8, 1), timeout=0.05)
    assert len(buf) == 8  # refused whole
    pusher = Background(lambda: buf.push_batch(ids(8, 1), timeout=20))
    wait_until(lambda: buf.info()["waiting_inserts"] == 1)
    buf.sample(2)  # diff 14: room for one insert (worth 2)
    pusher.outcome()
    assert len(buf) == 9 and diff(buf.info(), limiter) == 16


def test_samples_wait_when_learners_run_ahead_of_actors():
    limiter = millpond.SampleToInsertRatio(1.0, 2, error_buffer=2)  # diff in [0, 4]
    buf = engine(SCHEMA, 100, 100, rate_limiter=limiter)
    buf.push_batch(ids(0, 2))
    buf.sample(2)  # diff 0
    with pytest.raises(RateLimitTimeoutError):
        buf.sample(1, timeout=0.05)
    learner = Background(lambda: buf.sample(2, timeout=20))
    wait_until(lambda: buf.info()["waiting_samples"] == 1)
    buf.push_batch(ids(2, 1))
    assert learner.is_alive()  # one insert is not enough for two samples
    buf.push_batch(ids(3, 1))
    assert len(learner.outcome()["id"]) == 2


def test_concurrent_actors_and_learners_hold_the_ratio_within_its_band():
    limiter = millpond.SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=64,
                                           error_buffer=200)
    buf = engine(SCHEMA, 1000, 5000, rate_limiter=limiter)
    stop = threading.Event()
    snapshots = []

    def actor(seed):
        start = seed * 10**6
        while not stop.is_set():
            try:
                buf.push_batch(ids(start, 8), timeout=0.1)
                start += 8
            except RateLimitTimeoutError:
                pass

    def learner():
        for _ in range(150):
            buf.sample(32, timeout=20)

    def observer():
        while not stop.is_set():
            snapshots.append(buf.info())

    actors = [Background(lambda s=s: actor(s)) for s in range(3)]
    watch = Background(observer)
    learners = [Background(learner) for _ in range(2)]
    for thread in learners:
        thread.outcome(60)
    stop.set()
    for thread in actors + [watch]:
        thread.outcome()
    final = buf.info()
    assert final["samples"] == 2 * 150 * 32
    for info in snapshots + [final]:
        assert limiter.min_diff <= diff(info, limiter) <= limiter.max_diff, info
    assert final["sample_waits"] + final["insert_waits"] > 0  # the limiter did work
    expected = limiter.samples_per_insert
    assert abs(final["samples_per_insert"] - expected) <= limiter.band / final["inserts"] + 0.5


def test_closing_the_buffer_releases_its_waiters():
    buf = engine(SCHEMA, 10, 10, rate_limiter=millpond.MinSize(5))
    waiter = Background(lambda: buf.sample(1, timeout=60))
    wait_until(lambda: buf.info()["waiting_samples"] == 1)
    buf.close()
    with pytest.raises(BufferClosedError):
        waiter.outcome()


def test_requests_that_could_never_pass_are_refused_at_once():
    limiter = millpond.SampleToInsertRatio(1.0, 1, error_buffer=(0, 10))
    buf = engine(SCHEMA, 100, 100, rate_limiter=limiter)
    with pytest.raises(InvalidArgumentError, match="band"):
        buf.push_batch(ids(0, 11), timeout=60)
    assert len(buf) == 0 and buf.info()["inserts"] == 0
    buf.push_batch(ids(0, 10))
    with pytest.raises(InvalidArgumentError, match="band"):
        buf.sample(11, timeout=60)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        buf.sample(1, timeout=-1)


@pytest.mark.parametrize("make", [
    lambda: millpond.MinSize(0),
    lambda: millpond.SampleToInsertRatio(0.0, 1, 10),
    lambda: millpond.SampleToInsertRatio(1.0, 1, -1),
    lambda: millpond.SampleToInsertRatio(1.0, 1, (5, 1)),
    lambda: millpond.RateLimiter(float("nan"), 1),
    lambda: engine(SCHEMA, 10, 10, mode="ring"),
    lambda: engine(SCHEMA, 10, 10, mode="queue", max_times_sampled=2),
    lambda: engine(SCHEMA, 10, 10, max_times_sampled=-1),
    lambda: engine(SCHEMA, 10, 10, rate_limiter="fast"),
    lambda: millpond.PrioritizedReplayBuffer(10, obs_dim=1, act_dim=1, rate_limiter=object()),
    lambda: engine(SCHEMA, 10, 10, mode="stack", prioritized=True),
])
def test_impossible_sampling_configs_are_refused(make):
    with pytest.raises(InvalidConfigError):
        make()


def test_a_queue_hands_every_record_out_once_in_order_between_threads():
    buf = millpond.ReplayBuffer(16, fields={"id": ("int64", ())}, mode="queue")
    total = 2000

    def producer():
        for start in range(0, total, 10):
            buf.push_batch(id=np.arange(start, start + 10), timeout=20)

    pushing = Background(producer)
    got = []
    while len(got) < total:
        got.extend(buf.sample(5, timeout=20)["id"].tolist())
    pushing.outcome()
    assert got == list(range(total))  # FIFO, nothing lost, nothing twice
    info = buf.info()
    assert len(buf) == 0 and info["inserts"] == info["samples"] == total
    assert info["insert_waits"] > 0  # the 16-record queue made the producer wait


def test_a_stack_returns_the_newest_first_and_removes_them(tmp_path):
    buf = millpond.MmapReplayBuffer(2, 6, fields={"id": ("int64", ())}, mode="stack",
                                    cold_path=tmp_path / "stack.cold")
    buf.push_batch(id=np.arange(5))
    assert buf.sample(3)["id"].tolist() == [4, 3, 2]
    buf.push_batch(id=np.array([10, 11]))
    assert buf.sample(4)["id"].tolist() == [11, 10, 1, 0]
    with pytest.raises(RateLimitTimeoutError):
        buf.sample(1, timeout=0)


def test_max_times_sampled_removes_records_after_n_draws():
    buf = millpond.ReplayBuffer(100, fields={"id": ("int64", ())}, max_times_sampled=3)
    buf.push_batch(id=np.arange(20))
    drawn, seed = [], 0
    while len(buf) >= 4:  # a sample of k needs k records not used up
        drawn.append(buf.sample(4, seed=seed)["id"])
        seed += 1
    counts = np.bincount(np.concatenate(drawn), minlength=20)
    assert counts.max() == 3  # never past the limit, within a batch either
    assert len(buf) == (counts < 3).sum() < 4  # the used-up ones are gone
    np.testing.assert_array_equal(buf.backend.contents()["id"], np.flatnonzero(counts < 3))
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample(4)


def test_sampling_config_and_stats_are_in_info():
    limiter = millpond.SampleToInsertRatio(2.0, 3, error_buffer=10)
    buf = millpond.ReplayBuffer(50, obs_dim=1, act_dim=1, rate_limiter=limiter,
                                max_times_sampled=5)
    buf.push_batch(np.zeros((4, 1)), np.zeros((4, 1)), np.zeros((4, 1)), np.zeros(4),
                   np.zeros(4), np.zeros(4))
    buf.sample(3)
    info = buf.info()
    assert info["mode"] == "replay" and info["max_times_sampled"] == 5
    assert millpond.RateLimiter.from_dict(info["rate_limiter"]) == limiter
    assert (info["inserts"], info["samples"], info["samples_per_insert"]) == (4, 3, 0.75)


def test_draw_counts_of_a_persistent_buffer_survive_a_reopen(tmp_path):
    path = tmp_path / "counted.buffer"
    buf = engine(SCHEMA, 4, 12, path, persistent=True, max_times_sampled=2)
    buf.push_batch(ids(0, 12))
    for seed in range(4):
        buf.sample(3, seed=seed)
    before = buf.contents()["id"].tolist()
    assert len(before) < 12  # some are used up
    buf.release()
    again = TieredBuffer.open(path)
    assert again.config.max_times_sampled == 2 and again.contents()["id"].tolist() == before
    drawn, seed = [], 0
    while len(again):  # draw what is left, one at a time
        drawn.append(int(again.sample(1, seed=seed)["id"][0]))
        seed += 1
    assert set(drawn) == set(before)  # the used-up ones are never drawn again
    assert len(drawn) <= 2 * len(before)
    again.push_batch(ids(100, 3))  # slots reused by new records count from 0
    assert sorted(again.contents()["id"].tolist()) == [100, 101, 102]
    again.close()


def test_prioritized_records_used_up_stay_gone(tmp_path):
    buf = engine(SCHEMA, 10, 10, max_times_sampled=1, prioritized=True, alpha=1.0)
    buf.push_batch(ids(0, 10), priorities=np.arange(1, 11))
    batch = buf.sample(4, seed=1)
    assert len(set(batch["id"].tolist())) == 4 and len(buf) == 6
    assert buf.update_priorities(batch["indices"], np.full(4, 100.0)) == 0  # not revived
    rest = buf.sample(6, seed=2)["id"].tolist()
    assert sorted(rest) == sorted(set(range(10)) - set(batch["id"].tolist()))


def test_all_zero_priorities_still_give_weights_and_indices():
    buf = engine(SCHEMA, 10, 10, prioritized=True)
    buf.push_batch(ids(0, 5), priorities=np.zeros(5))
    batch = buf.sample(5, seed=0)
    np.testing.assert_array_equal(batch["weights"], np.ones(5, np.float32))
    np.testing.assert_array_equal(batch["indices"], batch["id"])


def test_a_reopened_buffer_restarts_its_limiter_mid_band(tmp_path):
    limiter = millpond.SampleToInsertRatio(2.0, 5, error_buffer=6)  # diff in [4, 16]
    path = tmp_path / "limited.buffer"
    buf = engine(SCHEMA, 10, 50, path, persistent=True, rate_limiter=limiter)
    buf.push_batch(ids(0, 5))  # free up to the min size
    buf.push_batch(ids(5, 3))  # diff 16: pushes now wait for samples
    with pytest.raises(RateLimitTimeoutError):
        buf.push_batch(ids(8, 1), timeout=0)
    buf.release()
    again = TieredBuffer.open(path)
    assert again.config.rate_limiter == limiter and again.info()["inserts"] == 0
    # The diff restarts at 10, the middle of [4, 16], so both sides may move:
    again.push_batch(ids(8, 3), timeout=0)  # 10 + 6 = 16 (from 11 or more it would wait)
    again.sample(6, timeout=0)  # (a sample of 12 would need 12 records held)
    again.sample(6, timeout=0)  # 16 - 12 = 4
    with pytest.raises(RateLimitTimeoutError):
        again.sample(1, timeout=0)
    again.close()
