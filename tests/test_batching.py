"""Client-side batching for actors: :class:`millpond.remote.batcher.PushBatcher`.

Real schemas, real numpy arrays and a real in-process TieredBuffer as the
sink. No fixed sleeps: waits poll a condition against a deadline.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from support import engine, wait_until

from millpond.core import Schema
from millpond.errors import (
    BufferClosedError,
    DTypeMismatchError,
    FieldMismatchError,
    InvalidArgumentError,
    ServerUnavailableError,
    ShapeMismatchError,
)
from millpond.remote.batcher import PushBatcher

DEADLINE = 10.0
THREAD_NAME = "millpond-push-batcher"

# CartPole transitions plus an id column so order can be checked.
SCHEMA = Schema.from_spec({
    "obs": ("float32", (4,)),
    "next_obs": ("float32", (4,)),
    "actions": ("float32", (1,)),
    "rewards": ("float32", ()),
    "terminated": ("bool", ()),
    "truncated": ("bool", ()),
    "id": ("int64", ()),
})


def rec(i: int) -> dict:
    return {
        "obs": np.full(4, i, np.float32),
        "next_obs": np.full(4, i + 0.5, np.float32),
        "actions": np.array([i % 3], np.float32),
        "rewards": float(i),
        "terminated": i % 2 == 0,
        "truncated": i % 5 == 0,
        "id": np.int64(i),
    }


class Sink:
    """A ``send`` that keeps a copy of every batch (thread-safe)."""

    def __init__(self):
        self.batches: list[dict[str, np.ndarray]] = []
        self.lock = threading.Lock()
        self.calls_in_flight = 0
        self.max_in_flight = 0

    def __call__(self, columns):
        with self.lock:
            self.calls_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.calls_in_flight)
        try:
            copied = {k: np.array(v) for k, v in columns.items()}
            with self.lock:
                self.batches.append(copied)
        finally:
            with self.lock:
                self.calls_in_flight -= 1

    @property
    def sizes(self) -> list[int]:
        with self.lock:
            return [len(b["id"]) for b in self.batches]

    def ids(self) -> list[int]:
        with self.lock:
            return [int(x) for b in self.batches for x in b["id"]]


def batcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.fixture
def sink():
    return Sink()


# ---- sending by count, age and flush --------------------------------------------


def test_count_triggered_sends_are_exactly_max_records(sink):
    with PushBatcher(SCHEMA, sink, max_records=8, max_delay=None) as b:
        for i in range(20):
            b.add(rec(i))
        assert sink.sizes == [8, 8]
        assert b.pending == 4
        b.flush()
        assert sink.sizes == [8, 8, 4]
        assert b.pending == 0
    assert sink.ids() == list(range(20))
    got = {k: np.concatenate([b[k] for b in sink.batches]) for k in SCHEMA.names}
    for i in range(20):
        want = SCHEMA.coerce_record(rec(i))
        for k in SCHEMA.names:
            np.testing.assert_array_equal(got[k][i], want[k][0])


def test_values_match_coerce_record_on_the_slow_path(sink):
    # Lists, float64, Python ints: not the fast path, same result as coerce_record.
    record = {
        "obs": [1, 2, 3, 4], "next_obs": np.arange(4, dtype=np.float64),
        "actions": 2, "rewards": 3, "terminated": 1.0, "truncated": np.int8(0), "id": 7,
    }
    with PushBatcher(SCHEMA, sink, max_records=4) as b:
        b.add(record)
    want = SCHEMA.coerce_record(record)
    for k in SCHEMA.names:
        np.testing.assert_array_equal(sink.batches[0][k], want[k])
        assert sink.batches[0][k].dtype == want[k].dtype


def test_sends_into_a_real_tiered_buffer():
    buf = engine(SCHEMA, 100, 100)
    with PushBatcher(SCHEMA, buf.push_batch, max_records=16, max_delay=None) as b:
        for i in range(40):
            b.add(rec(i))
        assert buf.pushed == 32
        b.flush()
        assert buf.pushed == 40
    out = buf.sample(40, seed=1)
    ids = out["id"]
    np.testing.assert_array_equal(out["obs"][:, 0], ids.astype(np.float32))
    np.testing.assert_array_equal(out["terminated"], ids % 2 == 0)
    assert set(ids.tolist()) <= set(range(40))
    buf.close()


def test_age_triggered_send_without_further_adds(sink):
    with PushBatcher(SCHEMA, sink, max_records=1000, max_delay=0.02) as b:
        b.add(rec(0))
        b.add(rec(1))
        assert wait_until(lambda: sink.sizes == [2])
        assert b.pending == 0
        # And again after the thread went back to sleep.
        b.add(rec(2))
        assert wait_until(lambda: sink.sizes == [2, 1])
    assert sink.ids() == [0, 1, 2]


def test_age_send_into_a_real_tiered_buffer():
    buf = engine(SCHEMA, 100, 100)
    b = PushBatcher(SCHEMA, buf.push_batch, max_records=64, max_delay=0.01)
    for i in range(5):
        b.add(rec(i))
    assert wait_until(lambda: buf.pushed == 5)
    b.close()
    buf.close()


def test_no_age_send_when_max_delay_is_none(sink):
    before = set(batcher_threads())
    b = PushBatcher(SCHEMA, sink, max_records=10, max_delay=None)
    b.add(rec(0))
    assert set(batcher_threads()) <= before  # no thread without an age limit
    assert b.pending == 1 and sink.sizes == []
    b.close()
    assert sink.sizes == [1]


def test_flush_waits_for_a_send_in_progress():
    # flush() must not return while another thread is still sending earlier records.
    release = threading.Event()
    entered = threading.Event()
    sent = []

    def slow_send(columns):
        entered.set()
        assert release.wait(DEADLINE)
        sent.append(len(columns["id"]))

    b = PushBatcher(SCHEMA, slow_send, max_records=2, max_delay=None)
    adder = threading.Thread(target=lambda: [b.add(rec(i)) for i in range(2)])
    adder.start()
    assert entered.wait(DEADLINE)
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (b.flush(), flushed.set()))
    flusher.start()
    assert not flushed.wait(0.05)  # still blocked behind the slow send
    release.set()
    assert flushed.wait(DEADLINE)
    assert sent == [2]
    adder.join(DEADLINE)
    flusher.join(DEADLINE)
    b.close()


# ---- concurrency ------------------------------------------------------------------


def test_order_preserved_and_sends_never_overlap_across_threads(sink):
    n_threads, per_thread = 4, 500
    b = PushBatcher(SCHEMA, sink, max_records=7, max_delay=0.001)
    start = threading.Barrier(n_threads)

    def actor(t):
        start.wait()
        for k in range(per_thread):
            b.add(rec(t * 1_000_000 + k))

    threads = [threading.Thread(target=actor, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    b.close()
    ids = sink.ids()
    every = [t * 1_000_000 + k for t in range(n_threads) for k in range(per_thread)]
    assert sorted(ids) == sorted(every)
    for t in range(n_threads):  # each actor's records arrive in the order it added them
        mine = [i for i in ids if i // 1_000_000 == t]
        assert mine == sorted(mine)
    assert sink.max_in_flight == 1
    # No record is torn: every row is consistent with its id.
    for batch in sink.batches:
        np.testing.assert_array_equal(batch["obs"][:, 0], batch["id"].astype(np.float32))
        np.testing.assert_array_equal(batch["next_obs"][:, 3], batch["id"] + np.float32(0.5))


# ---- validation -------------------------------------------------------------------


@pytest.mark.parametrize("bad, error", [
    ({"obs": np.zeros(3, np.float32)}, ShapeMismatchError),
    ({"obs": np.zeros((2, 4), np.float32)}, ShapeMismatchError),
    ({"id": 1.5}, DTypeMismatchError),
    ({"id": np.float32(1)}, DTypeMismatchError),
    ({"obs": np.array(["a", "b", "c", "d"])}, DTypeMismatchError),
    ({"extra": 1}, FieldMismatchError),
    ({"id": None}, DTypeMismatchError),
])
def test_bad_record_raises_at_once_and_is_not_queued(sink, bad, error):
    b = PushBatcher(SCHEMA, sink, max_records=4, max_delay=None)
    b.add(rec(0))
    record = {**rec(1), **bad}
    with pytest.raises(error):
        SCHEMA.coerce_record(record)  # the reference behaviour
    with pytest.raises(error):
        b.add(record)
    assert b.pending == 1
    b.add(rec(2))
    b.close()
    assert sink.ids() == [0, 2]


def test_missing_field_and_non_mapping(sink):
    b = PushBatcher(SCHEMA, sink, max_records=4, max_delay=None)
    record = rec(0)
    del record["id"]
    with pytest.raises(FieldMismatchError):
        b.add(record)
    with pytest.raises(FieldMismatchError):
        b.add([1, 2, 3])
    assert b.pending == 0
    b.close()
    assert sink.batches == []


@pytest.mark.parametrize("kwargs", [
    {"max_records": 0}, {"max_records": -1}, {"max_records": 2.0}, {"max_records": True},
    {"max_delay": -0.1}, {"max_delay": float("inf")}, {"max_delay": "1"},
])
def test_invalid_arguments(sink, kwargs):
    with pytest.raises(InvalidArgumentError):
        PushBatcher(SCHEMA, sink, **kwargs)


# ---- errors from send ------------------------------------------------------------


class FailingSink(Sink):
    """Fails the calls whose 0-based index is in ``fail``."""

    def __init__(self, fail):
        super().__init__()
        self.fail = set(fail)
        self.calls = 0

    def __call__(self, columns):
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail:
            raise ServerUnavailableError(f"send {call} failed")
        super().__call__(columns)


def test_send_error_raises_from_flush():
    sink = FailingSink({0})
    b = PushBatcher(SCHEMA, sink, max_records=10, max_delay=None)
    b.add(rec(0))
    with pytest.raises(ServerUnavailableError, match="send 0"):
        b.flush()
    b.add(rec(1))
    b.flush()  # the next send works; the failed batch was dropped, not retried
    assert sink.ids() == [1]
    b.close()


def test_send_error_raises_from_the_add_that_filled_the_batch():
    sink = FailingSink({0})
    b = PushBatcher(SCHEMA, sink, max_records=2, max_delay=None)
    b.add(rec(0))
    with pytest.raises(ServerUnavailableError):
        b.add(rec(1))
    assert b.pending == 0
    b.add(rec(2))
    b.close()
    assert sink.ids() == [2]


def test_background_send_error_is_raised_by_the_next_add():
    sink = FailingSink({0})
    b = PushBatcher(SCHEMA, sink, max_records=100, max_delay=0.01)
    b.add(rec(0))
    assert wait_until(lambda: sink.calls == 1 and b.pending == 0)
    with pytest.raises(ServerUnavailableError, match="send 0"):
        b.add(rec(1))
    assert b.pending == 0  # the add that raised queued nothing
    b.add(rec(2))
    b.flush()  # raised once, not again
    assert sink.ids() == [2]
    b.close()


def test_background_send_error_is_raised_by_the_next_flush():
    sink = FailingSink({0})
    b = PushBatcher(SCHEMA, sink, max_records=100, max_delay=0.01)
    b.add(rec(0))
    assert wait_until(lambda: sink.calls == 1)
    with pytest.raises(ServerUnavailableError, match="send 0"):
        b.flush()
    b.flush()
    b.close()


def test_background_send_error_is_raised_by_close():
    sink = FailingSink({0})
    b = PushBatcher(SCHEMA, sink, max_records=100, max_delay=0.01)
    b.add(rec(0))
    assert wait_until(lambda: sink.calls == 1)
    with pytest.raises(ServerUnavailableError):
        b.close()
    assert b.closed
    b.close()  # idempotent, and the error was reported once


# ---- lifecycle ------------------------------------------------------------------


def test_close_flushes_is_idempotent_and_refuses_adds(sink):
    b = PushBatcher(SCHEMA, sink, max_records=10)
    b.add(rec(0))
    b.add(rec(1))
    b.close()
    assert sink.ids() == [0, 1]
    b.close()
    assert sink.sizes == [2]
    with pytest.raises(BufferClosedError):
        b.add(rec(2))
    with pytest.raises(BufferClosedError):
        b.add({"obs": [1.0] * 4, **{k: v for k, v in rec(2).items() if k != "obs"}})


def test_thread_goes_away_after_close(sink):
    before = set(batcher_threads())
    b = PushBatcher(SCHEMA, sink, max_records=10, max_delay=0.5)
    b.add(rec(0))
    mine = [t for t in batcher_threads() if t not in before]
    assert len(mine) == 1 and mine[0].daemon
    b.close()
    assert wait_until(lambda: not mine[0].is_alive())
    assert sink.ids() == [0]


def test_thread_goes_away_and_records_are_sent_when_the_batcher_is_collected(sink):
    before = set(batcher_threads())
    b = PushBatcher(SCHEMA, sink, max_records=10, max_delay=60)
    b.add(rec(0))
    b.add(rec(1))
    mine = [t for t in batcher_threads() if t not in before]
    assert len(mine) == 1
    del b
    gc.collect()
    assert wait_until(lambda: not mine[0].is_alive())
    assert sink.ids() == [0, 1]


def test_thread_does_not_keep_the_batcher_alive(sink):
    import weakref

    b = PushBatcher(SCHEMA, sink, max_records=10, max_delay=60)
    b.add(rec(0))
    ref = weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None


def test_atexit_flushes_live_batchers(tmp_path):
    out = tmp_path / "sent.txt"
    script = textwrap.dedent(f"""
        import numpy as np
        from millpond.remote.batcher import PushBatcher
        from millpond.core import Schema

        schema = Schema.from_spec({{"id": ("int64", ()), "x": ("float32", (2,))}})

        def send(columns):
            with open({str(out)!r}, "a") as f:
                f.write(" ".join(map(str, columns["id"].tolist())) + "\\n")

        keep = PushBatcher(schema, send, max_records=4, max_delay=3600)
        for i in range(6):
            keep.add({{"id": i, "x": np.zeros(2, np.float32)}})
        print("added", keep.pending)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "added 2"
    assert out.read_text().split("\n")[:2] == ["0 1 2 3", "4 5"]


def test_finalizer_run_in_a_thread_holding_the_lock_still_stops_the_thread(sink):
    # Garbage collection may run the finalizer inside the batcher's own
    # thread while it holds the lock; the stop must not be lost or deadlock.
    from millpond.remote.batcher import _stop_from_finalizer

    b = PushBatcher(SCHEMA, sink, max_records=10, max_delay=60)
    b.add(rec(0))
    state = b._state
    thread = state.thread
    with state.lock:
        _stop_from_finalizer(state)
    assert wait_until(lambda: not thread.is_alive())
    assert sink.ids() == [0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_child_starts_empty_and_works(tmp_path):
    out = tmp_path / "sent.txt"

    def send(columns):
        with open(out, "a") as f:
            f.write(f"{os.getpid()} {' '.join(map(str, columns['id'].tolist()))}\n")

    b = PushBatcher(SCHEMA, send, max_records=10, max_delay=60)
    b.add(rec(1))
    b.add(rec(2))
    pid = os.fork()
    if pid == 0:  # child: the parent's pending records are the parent's to send
        code = 1
        try:
            if b.pending == 0:
                b.add(rec(3))
                b.flush()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    b.close()
    lines = sorted(out.read_text().splitlines())
    assert sorted(lines) == sorted([f"{pid} 3", f"{os.getpid()} 1 2"])
