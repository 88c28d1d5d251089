"""A hypothesis state machine: the tiered buffer against a plain Python list.

The model is the list of every record ever pushed; the live records are its
last ``total_capacity`` entries, the newest ``hot_capacity`` of them in the
hot tier and the rest in the cold tier. Capacities are random (hot 1..8,
total hot..hot+12, including ``total == hot``, i.e. no cold tier).

Records are self-identifying: record ``i`` has ``id = i`` (float64) and
fields derived from it, so any sampled row can be checked for being a live
record whose fields all agree.

The exact-contents invariant READS INTERNALS: sampling cannot enumerate the
buffer exactly, so after every step we look at ``_hot.seq``,
``_cold_file.tier.seq`` and the tier columns and require that slot
``seq % capacity`` of the right tier holds each live seq ``[pushed - len, pushed)`` with the
right field values. Everything else goes through the public methods.
Half the machines drive ``TieredBuffer`` directly, half the public
``millpond.MmapReplayBuffer(fields=...)`` wrapper.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from support import engine, without_stats

import millpond
from millpond.core import Schema, TieredBuffer

FIELDS = {
    "id": ("float64", ()),
    "obs": ("float32", (2,)),
    "k": ("int16", ()),
    "done": ("bool", ()),
}
SCHEMA = Schema.from_spec(FIELDS)


def records(start: int, n: int) -> dict[str, np.ndarray]:
    """Columns for records ``start .. start+n-1``."""
    i = np.arange(start, start + n)
    return {
        "id": i.astype(np.float64),
        "obs": np.stack([i, -2 * i], axis=1).astype(np.float32),
        "k": (i % 1000).astype(np.int16),
        "done": i % 3 == 0,
    }


def check_rows_consistent(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Every row's fields agree with its id; return the ids as ints."""
    ids = rows["id"]
    assert np.all(ids == np.floor(ids)), ids
    ints = ids.astype(np.int64)
    expected = records(0, 0)  # dtypes only
    for name, col in rows.items():
        assert col.dtype == expected[name].dtype, (name, col.dtype)
    want = {
        "obs": np.stack([ints, -2 * ints], axis=1).astype(np.float32),
        "k": (ints % 1000).astype(np.int16),
        "done": ints % 3 == 0,
    }
    for name, col in want.items():
        np.testing.assert_array_equal(rows[name], col, err_msg=name)
    return ints


class BufferMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmpdir = tempfile.mkdtemp(prefix="millpond-model-")
        self.buf = None
        self.closed = False

    # ---- setup ----------------------------------------------------------------

    @initialize(
        hot=st.integers(1, 8),
        extra=st.integers(0, 12),
        public=st.booleans(),
        persistent=st.booleans(),
    )
    def setup(self, hot, extra, public, persistent):
        self.hot, self.total = hot, hot + extra
        self.public = public
        self.persistent = persistent
        self.cold_path = os.path.join(self.tmpdir, "cold.bin")
        if public:
            self.buf = millpond.MmapReplayBuffer(
                hot, self.total, cold_path=self.cold_path, fields=FIELDS, persistent=persistent
            )
            self.engine = self.buf.backend
        else:
            self.buf = engine(SCHEMA, hot, self.total, self.cold_path, persistent=persistent)
            self.engine = self.buf
        self.pushed = 0  # the model: records 0..pushed-1, live = the last `total`
        assert os.path.exists(self.cold_path) == (extra > 0 or persistent)

    @precondition(lambda self: self.buf is not None and not self.closed and self.persistent)
    @rule()
    def release_and_reopen(self):
        """A persistent buffer comes back from its file exactly as it was."""
        before = self.snapshot()
        self.buf.release()
        if self.public:
            self.buf = millpond.MmapReplayBuffer.open(self.cold_path)
            self.engine = self.buf.backend
        else:
            self.buf = TieredBuffer.open(self.cold_path)
            self.engine = self.buf
        assert self.snapshot() == before

    def teardown(self):
        if self.buf is not None:
            self.buf.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    # ---- model ------------------------------------------------------------------

    @property
    def model_len(self) -> int:
        return min(self.pushed, self.total)

    @property
    def live(self) -> range:
        return range(self.pushed - self.model_len, self.pushed)

    def _push_batch(self, cols):
        if self.public:
            self.buf.push_batch(**cols)
        else:
            self.buf.push_batch(cols)

    def _push(self, rec):
        if self.public:
            self.buf.push(**rec)
        else:
            self.buf.push(rec)

    def snapshot(self):
        """len, info (but its statistics, which restart at reopen) and a full
        enumeration of the stored records (internals)."""
        return len(self.buf), without_stats(self.buf.info()), self.enumerate_internals()

    def enumerate_internals(self) -> dict[int, tuple]:
        """For each live seq (by the model), the tier, slot, stored seq and row found there.

        Slots never written read seq 0, so which slots to look at comes from
        the model's counters; the stored seq must then confirm the record.
        """
        hot_lo = self.pushed - min(self.pushed, self.hot)
        out = {}
        for seq in self.live:
            is_hot = seq >= hot_lo
            tier = self.engine._fifo.hot if is_hot else self.engine._fifo.cold
            slot = seq % tier.capacity
            row = tuple(np.asarray(tier.columns[name][slot]).tolist() for name in FIELDS)
            out[seq] = (is_hot, int(tier.seq[slot]), row)
        return out

    # ---- rules ------------------------------------------------------------------

    @precondition(lambda self: not self.closed)
    @rule()
    def push(self):
        cols = records(self.pushed, 1)
        # one record: scalars for scalar fields, [2] for obs
        self._push({name: col[0] for name, col in cols.items()})
        self.pushed += 1

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(0, 25), flat=st.booleans())
    def push_batch(self, n, flat):
        cols = records(self.pushed, n)
        if flat:
            cols["obs"] = cols["obs"].reshape(-1)  # flat [n*2] is accepted too
        self._push_batch(cols)
        self.pushed += n

    @precondition(lambda self: not self.closed)
    @rule(batch_size=st.integers(1, 40), seed=st.integers(0, 2**32))
    def sample(self, batch_size, seed):
        if batch_size > self.model_len:
            with pytest.raises(millpond.NotEnoughDataError):
                self.buf.sample(batch_size, seed)
            return
        rows = self.buf.sample(batch_size, seed)
        assert set(rows) == set(FIELDS)
        for name, (dtype, shape) in FIELDS.items():
            assert rows[name].shape == (batch_size,) + shape
            assert rows[name].dtype == np.dtype(dtype)
        ids = check_rows_consistent(rows)
        assert all(i in self.live for i in ids.tolist()), (ids, self.live)

    @precondition(lambda self: not self.closed and self.model_len > 0)
    @rule(batch_size=st.integers(1, 40), seed=st.integers(0, 2**32))
    def sample_is_deterministic(self, batch_size, seed):
        batch_size = min(batch_size, self.model_len)
        a = self.buf.sample(batch_size, seed)
        b = self.buf.sample(batch_size, seed)
        for name in FIELDS:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    @precondition(lambda self: not self.closed)
    @rule(
        n=st.integers(1, 12),
        kind=st.sampled_from(
            ["obs_shape", "missing", "extra", "n_disagree", "float_into_int", "int_overflow",
             "strings", "scalar_column"]
        ),
    )
    def bad_push_batch(self, n, kind):
        cols = records(self.pushed, n)
        expected = millpond.ReplayError
        if kind == "obs_shape":
            cols["obs"] = np.zeros((n, 3), np.float32)
            expected = millpond.ShapeMismatchError
        elif kind == "missing":
            del cols["k"]
            expected = millpond.FieldMismatchError
        elif kind == "extra":
            cols["bonus"] = np.zeros(n)
            expected = millpond.FieldMismatchError
        elif kind == "n_disagree":
            cols["done"] = cols["done"][:-1] if n > 1 else np.zeros(2, bool)
            expected = millpond.ShapeMismatchError
        elif kind == "float_into_int":
            cols["k"] = cols["k"].astype(np.float64) + 0.5
            expected = millpond.DTypeMismatchError
        elif kind == "int_overflow":
            cols["k"] = np.full(n, 70000, np.int64)
            expected = millpond.DTypeMismatchError
        elif kind == "strings":
            cols["id"] = np.array(["x"] * n)
            expected = millpond.DTypeMismatchError
        elif kind == "scalar_column":
            cols["id"] = np.float64(1.0)
            expected = millpond.ShapeMismatchError
        before = self.snapshot()
        with pytest.raises(expected) as excinfo:
            self._push_batch(cols)
        assert isinstance(excinfo.value, ValueError)
        assert self.snapshot() == before, "a rejected push_batch changed the buffer"

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self):
        self.buf.close()
        self.closed = True
        assert not os.path.exists(self.cold_path), "close() must delete the cold file"
        assert self.buf.closed
        self.buf.close()  # idempotent

    @precondition(lambda self: self.closed)
    @rule(n=st.integers(0, 3))
    def closed_buffer_raises(self, n):
        rec = {name: col[0] for name, col in records(0, 1).items()}
        with pytest.raises(millpond.BufferClosedError):
            self._push(rec)
        with pytest.raises(millpond.BufferClosedError):
            self._push_batch(records(0, n))
        with pytest.raises(millpond.BufferClosedError):
            self.buf.sample(1, 0)
        with pytest.raises(millpond.BufferClosedError):
            len(self.buf)
        with pytest.raises(millpond.BufferClosedError):
            self.buf.info()
        if self.public:
            with pytest.raises(millpond.BufferClosedError):
                self.buf.is_empty()
        assert not os.path.exists(self.cold_path)

    # ---- invariants ---------------------------------------------------------------

    @invariant()
    def sizes_match_model(self):
        if self.buf is None or self.closed:
            return
        assert len(self.buf) == self.model_len
        info = self.buf.info()
        hot_size = min(self.pushed, self.hot)
        assert info["size"] == self.model_len
        assert info["pushed"] == self.pushed
        assert info["hot_size"] == hot_size
        assert info["cold_size"] == self.model_len - hot_size
        assert info["hot_capacity"] == self.hot
        assert info["total_capacity"] == self.total

    @invariant()
    def contents_match_model(self):
        """Reads internals: the tiers hold exactly the live seqs, each in its slot."""
        if self.buf is None or self.closed:
            return
        stored = self.enumerate_internals()
        for seq, (is_hot, stored_seq, row) in stored.items():
            assert stored_seq == seq % 2**32, f"slot of seq {seq} holds seq {stored_seq}"
            want = tuple(np.asarray(col[0]).tolist() for col in records(seq, 1).values())
            assert row == want, (seq, is_hot, row, want)


BufferMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBufferModel = BufferMachine.TestCase
