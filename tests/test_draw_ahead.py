"""Samples drawn ahead of their call (core/drawahead.py; the daemon's ahead.py).

A daemon draws a learner's next plain sample while the learner is busy. That
must be invisible: the rows served are those a draw at the call would make
(tests/test_buffer_model.py checks that against a model, with pushes between),
counted at the call, and only buffers whose draws change nothing draw ahead.
Over a real daemon, tests/test_contract.py checks that unseeded samples see
every push and reset at once.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import millpond
from millpond.core import Schema
from millpond.errors import NotEnoughDataError, RateLimitTimeoutError
from support import engine

SCHEMA = Schema.from_spec({"id": ("int64", ())})


def ids(start: int, n: int) -> dict[str, np.ndarray]:
    return {"id": np.arange(start, start + n)}


def out(n: int) -> dict[str, np.ndarray]:
    return {"id": np.empty(n, np.int64)}


@pytest.mark.parametrize("sampling", [
    {"prioritized": True}, {"max_times_sampled": 2}, {"mode": "queue"}, {"mode": "stack"},
])
def test_only_buffers_whose_draws_change_nothing_draw_ahead(sampling):
    """A prioritized draw's weights, a use count, a queue's pop: these must happen at
    the call, so such buffers never draw ahead."""
    buf = engine(SCHEMA, 8, 8, **sampling)
    buf.push_batch(ids(0, 8))
    assert not buf.draws_ahead
    assert buf.draw_ahead(2, out(2)) is None
    assert len(buf) == 8
    plain = engine(SCHEMA, 8, 8)
    plain.push_batch(ids(0, 8))
    assert plain.draws_ahead and plain.draw_ahead(2, out(2)) is not None


def test_rows_drawn_before_a_reset_are_never_served():
    buf = engine(SCHEMA, 4, 8)
    buf.push_batch(ids(0, 8))
    drawn = buf.draw_ahead(4, out(4))
    buf.reset()
    with pytest.raises(NotEnoughDataError):
        buf.sample_drawn(drawn, timeout=0)
    buf.push_batch(ids(100, 8))
    rows, served = buf.sample_drawn(drawn, timeout=0)
    assert not served and (rows["id"] >= 100).all()


def test_a_drawn_sample_waits_for_the_rate_limiter_like_any_sample():
    limiter = millpond.SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=4,
                                           error_buffer=4)  # diff in [0, 8]
    buf = engine(SCHEMA, 100, 100, rate_limiter=limiter)
    buf.push_batch(ids(0, 8))
    drawn = buf.draw_ahead(8, out(8))
    assert drawn is not None and buf.info()["samples"] == 0  # drawing counts nothing
    buf.sample(4)
    with pytest.raises(RateLimitTimeoutError):  # 4 more samples would break the ratio
        buf.sample_drawn(drawn, timeout=0)
    assert buf.info()["samples"] == 4
    buf.push_batch(ids(8, 4))
    rows, served = buf.sample_drawn(drawn, timeout=0)
    assert not served and len(rows["id"]) == 8 and buf.info()["samples"] == 12


def test_draw_ahead_never_waits_for_the_lock():
    """The daemon draws ahead on its event loop: a buffer busy elsewhere is skipped."""
    buf = engine(SCHEMA, 8, 8)
    buf.push_batch(ids(0, 8))
    held, release = threading.Event(), threading.Event()

    def hold():
        with buf._lock:
            held.set()
            release.wait(20)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(20)
        assert buf.draw_ahead(2, out(2)) is None
    finally:
        release.set()
        holder.join(20)
    assert buf.draw_ahead(2, out(2)) is not None
