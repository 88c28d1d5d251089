"""Hypothesis state machines for sampling that removes records.

* Queue and stack modes against a Python list: a sample returns the oldest
  (queue) or newest (stack, newest first) ``k`` records and removes them;
  the default Queue rate limiter refuses (here: times out at once) a push
  that would overfill the buffer and a sample of more than it holds.
* ``max_times_sampled`` against a dict of draws left per live record: every
  sampled row is a live record with draws left, ``len`` and the contents
  drop exactly the records used up, and eviction still takes the oldest.

Both run over random capacities with and without a cold tier, persistent or
not, with release-and-reopen for persistent buffers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support import engine

from millpond.core import Schema, TieredBuffer
from millpond.errors import InvalidArgumentError, NotEnoughDataError, RateLimitTimeoutError

SCHEMA = Schema.from_spec({"id": ("int64", ()), "twice": ("float32", (2,))})


def records(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n)
    return {"id": ids, "twice": np.stack([2 * ids, -2 * ids], 1).astype(np.float32)}


def ids_of(rows: dict[str, np.ndarray]) -> list[int]:
    ids = rows["id"]
    np.testing.assert_array_equal(rows["twice"], np.stack([2 * ids, -2 * ids], 1))
    return ids.tolist()


class QueueMachine(RuleBasedStateMachine):
    """mode="queue" / "stack" against a list of ids, oldest first."""

    def __init__(self):
        super().__init__()
        self.tmpdir = tempfile.mkdtemp(prefix="millpond-queue-")
        self.buf = None

    @initialize(mode=st.sampled_from(["queue", "stack"]), hot=st.integers(1, 6),
                extra=st.integers(0, 8), persistent=st.booleans())
    def setup(self, mode, hot, extra, persistent):
        self.mode, self.total, self.persistent = mode, hot + extra, persistent
        self.path = os.path.join(self.tmpdir, "q.buffer")
        self.buf = engine(SCHEMA, hot, self.total, self.path, persistent=persistent,
                                mode=mode)
        self.model: list[int] = []
        self.next_id = 0

    def teardown(self):
        if self.buf is not None:
            self.buf.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    @rule(n=st.integers(1, 12))
    def push_batch(self, n):
        if n > self.total:  # could never fit: refused outright
            with pytest.raises(InvalidArgumentError):
                self.buf.push_batch(records(self.next_id, n), timeout=0)
        elif len(self.model) + n > self.total:  # would overfill: waits, here not at all
            with pytest.raises(RateLimitTimeoutError):
                self.buf.push_batch(records(self.next_id, n), timeout=0)
        else:
            self.buf.push_batch(records(self.next_id, n), timeout=0)
            self.model += list(range(self.next_id, self.next_id + n))
        self.next_id += n

    @rule(k=st.integers(1, 12))
    def sample(self, k):
        if k > self.total:
            with pytest.raises(InvalidArgumentError):
                self.buf.sample(k, timeout=0)
        elif k > len(self.model):
            with pytest.raises(RateLimitTimeoutError):
                self.buf.sample(k, timeout=0)
        elif self.mode == "queue":
            assert ids_of(self.buf.sample(k, timeout=0)) == self.model[:k]
            del self.model[:k]
        else:
            assert ids_of(self.buf.sample(k, timeout=0)) == self.model[::-1][:k]
            del self.model[len(self.model) - k:]

    @precondition(lambda self: self.persistent)
    @rule()
    def release_and_reopen(self):
        self.buf.release()
        self.buf = TieredBuffer.open(self.path)
        assert self.buf.config.mode == self.mode and self.buf.config.rate_limiter is not None

    @invariant()
    def contents_match(self):
        if self.buf is not None:
            assert len(self.buf) == len(self.model)
            assert ids_of(self.buf.contents()) == self.model


class MaxTimesMachine(RuleBasedStateMachine):
    """mode="replay" with max_times_sampled against {id: draws left} for live ids."""

    def __init__(self):
        super().__init__()
        self.tmpdir = tempfile.mkdtemp(prefix="millpond-maxtimes-")
        self.buf = None

    @initialize(hot=st.integers(1, 6), extra=st.integers(0, 8), limit=st.integers(1, 3),
                persistent=st.booleans())
    def setup(self, hot, extra, limit, persistent):
        self.total, self.limit, self.persistent = hot + extra, limit, persistent
        self.path = os.path.join(self.tmpdir, "m.buffer")
        self.buf = engine(SCHEMA, hot, self.total, self.path, persistent=persistent,
                                max_times_sampled=limit)
        self.slots: list[int] = []  # ids in the FIFO, used up or not: eviction takes slots
        self.left: dict[int, int] = {}
        self.next_id = 0

    def teardown(self):
        if self.buf is not None:
            self.buf.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    @rule(n=st.integers(0, 10))
    def push_batch(self, n):
        self.buf.push_batch(records(self.next_id, n))
        for i in range(self.next_id, self.next_id + n):
            self.slots.append(i)
            self.left[i] = self.limit
        self.next_id += n
        for evicted in self.slots[: max(0, len(self.slots) - self.total)]:
            self.left.pop(evicted, None)
        del self.slots[: max(0, len(self.slots) - self.total)]

    @rule(k=st.integers(1, 12), seed=st.integers(0, 2**32))
    def sample(self, k, seed):
        if k > len(self.left):
            with pytest.raises(NotEnoughDataError):
                self.buf.sample(k, seed=seed)
            return
        for i, times in Counter(ids_of(self.buf.sample(k, seed=seed))).items():
            assert self.left.get(i, 0) >= times, f"record {i} drawn past its limit"
            self.left[i] -= times
            if not self.left[i]:
                del self.left[i]

    @precondition(lambda self: self.persistent)
    @rule()
    def release_and_reopen(self):
        """Draw counts live in the file: used-up records stay gone, the rest keep theirs."""
        self.buf.release()
        self.buf = TieredBuffer.open(self.path)

    @invariant()
    def contents_match(self):
        if self.buf is not None:
            assert len(self.buf) == len(self.left)
            assert ids_of(self.buf.contents()) == sorted(self.left)


SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestQueueModel = QueueMachine.TestCase
TestQueueModel.settings = SETTINGS
TestMaxTimesModel = MaxTimesMachine.TestCase
TestMaxTimesModel.settings = settings(SETTINGS, max_examples=150)
