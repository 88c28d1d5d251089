"""Snapshots in the engine (core/snapshot.py): a consistent, checked copy of a live buffer.

The in-process checkpoint, and the step-by-step copy a daemon runs, with pushes, samples,
resets and closes between the steps. (Against a real daemon: tests/test_operator.py.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from support import engine
from test_contract import transitions
from test_durability import CRASH_FIELDS, crash_records, flip_byte, valid

import millpond
from millpond.core import Schema, TieredBuffer
from millpond.core.snapshot import Snapshot

FIELDS = Schema.from_spec(CRASH_FIELDS)


def steps(snapshot: Snapshot, between=lambda i: None) -> millpond.CheckpointResult:
    """Run ``snapshot`` step by step, calling ``between(i)`` before the i-th read."""
    snapshot.create()
    snapshot.begin()
    i = 0
    while True:
        between(i)
        chunk = snapshot.read()
        if chunk is None:
            return snapshot.finish()
        snapshot.write(chunk)
        i += 1


def same_contents(a: TieredBuffer, b: TieredBuffer) -> None:
    x, y = a.contents(), b.contents()
    assert x.keys() == y.keys()
    for name in x:
        np.testing.assert_array_equal(x[name], y[name], err_msg=name)


def reopened(path) -> TieredBuffer:
    return TieredBuffer.open(path)  # every record checked (no skip_corrupt)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "in-memory"])
@pytest.mark.parametrize("hot,total", [(10, 60), (60, 60)], ids=["cold", "hot-only"])
def test_a_checkpoint_reopens_with_the_same_records(tmp_path, persistent, hot, total):
    buf = engine(Schema.transition(2, 1), hot, total, tmp_path / "b.buffer" if persistent else None,
                 persistent=persistent)
    buf.push_batch(transitions(0, 95))  # wrapped: 60 live, seqs 35..94
    seen = []
    result = buf.checkpoint(tmp_path / "snap", progress=lambda c, t: seen.append((c, t)))
    assert result.path == str(tmp_path / "snap.buffer") and os.path.exists(result.path)
    assert (result.records, result.first, result.pushed, result.dropped) == (60, 35, 95, 0)
    assert seen[-1] == (60, 60) and result.nbytes == os.path.getsize(result.path)
    copy = reopened(result.path)
    same_contents(buf, copy)
    info = copy.info()
    assert (info.pushed, info.size, info.hot_capacity, info.total_capacity) == (95, 60, hot, total)
    copy.push_batch(transitions(95, 5))  # a snapshot is a buffer like any other
    assert len(copy) == 60 and copy.pushed == 100
    copy.release()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_checkpoint_never_replaces_a_file_and_leaves_nothing_when_it_fails(tmp_path):
    buf = engine(Schema.transition(2, 1), 10, 60)
    buf.push_batch(transitions(0, 20))
    (tmp_path / "taken.buffer").write_bytes(b"mine")
    with pytest.raises(millpond.FileConflictError, match="never replaces"):
        buf.checkpoint(tmp_path / "taken.buffer")
    assert (tmp_path / "taken.buffer").read_bytes() == b"mine"
    snapshot = buf.snapshot(tmp_path / "closed")
    snapshot.create()
    snapshot.begin()
    buf.close()  # a Delete while the copy runs
    with pytest.raises(millpond.BufferClosedError):
        snapshot.read()
    snapshot.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.buffer"]


def test_steps_between_pushes_copy_the_cut_less_what_was_evicted_before_its_turn(tmp_path):
    buf = engine(FIELDS, 100, 1_000, tmp_path / "b.buffer", persistent=True)
    buf.push_batch(crash_records(1, 0, 1_000))  # full: seqs 0..999
    step = 100 * FIELDS.record_nbytes  # 100 records a step
    snapshot = Snapshot(buf, tmp_path / "snap", step_bytes=step)
    pushed = [1_000]

    def push(i: int) -> None:  # 150 records between steps: the oldest go, newest first copied
        buf.push_batch(crash_records(1, pushed[0], 150))
        pushed[0] += 150

    result = steps(snapshot, push)
    # Step i reads seqs [900 - 100 i, 1000 - 100 i) once 150 (i + 1) are evicted: the
    # copy meets the evictions at step 4 ([500, 600), with 750 evicted): 400 copied.
    assert (result.records, result.first, result.pushed) == (400, 600, 1_000)
    assert result.dropped == 600 and result.damaged == 0
    copy = reopened(result.path)
    records = copy.contents()
    assert valid(records).all()
    assert records["seq"].tolist() == list(range(600, 1_000))  # the cut's newest, in order
    copy.release()
    assert len(buf) == 1_000 and valid(buf.contents()).all()  # the buffer went on


def test_a_reset_while_copying_keeps_what_was_copied(tmp_path):
    buf = engine(FIELDS, 50, 500, tmp_path / "b.buffer", persistent=True)
    buf.push_batch(crash_records(1, 0, 300))
    snapshot = Snapshot(buf, tmp_path / "snap", step_bytes=100 * FIELDS.record_nbytes)
    result = steps(snapshot, lambda i: buf.reset() if i == 1 else None)
    assert (result.records, result.first, result.pushed, result.dropped) == (100, 200, 300, 200)
    copy = reopened(result.path)
    assert copy.contents()["seq"].tolist() == list(range(200, 300))
    copy.release()


def test_damaged_records_are_dropped_and_the_older_ones_renumbered(tmp_path):
    path = tmp_path / "b.buffer"
    buf = engine(FIELDS, 10, 60, path, persistent=True)
    buf.push_batch(crash_records(1, 0, 40))  # seqs 30..39 hot, 0..29 cold
    buf.release()
    flip_byte(path, "payload", 3, hot=False)  # seq 3
    flip_byte(path, "payload", 34, hot=True)  # seq 34
    survivor = TieredBuffer.open(path, skip_corrupt=True)
    assert survivor.damaged_seqs().tolist() == [3, 34]
    result = survivor.checkpoint(tmp_path / "repaired")
    assert (result.records, result.first, result.pushed, result.dropped) == (38, 2, 40, 2)
    copy = reopened(result.path)  # no hole left: every record checks
    same_contents(survivor, copy)
    assert copy.info().damaged == 0 and copy.pushed == 40
    copy.release()
    survivor.release()


def test_a_record_that_fails_its_check_while_copied_is_dropped(tmp_path):
    buf = engine(FIELDS, 10, 60, tmp_path / "b.buffer", persistent=True)
    buf.push_batch(crash_records(1, 0, 40))
    buf._fifo.cold.columns["payload"][7, 0] ^= 0xFF  # bit rot in a served record (seq 7)
    result = buf.checkpoint(tmp_path / "snap")
    assert (result.records, result.dropped, result.damaged) == (39, 1, 1)
    copy = reopened(result.path)
    assert valid(copy.contents()).all() and 7 not in copy.contents()["seq"].tolist()
    copy.release()


def test_a_stacks_samples_between_steps_never_put_a_newer_record_in(tmp_path):
    buf = engine(FIELDS, 100, 100, tmp_path / "b.buffer", persistent=True, mode="stack")
    buf.push_batch(crash_records(1, 0, 60))
    snapshot = Snapshot(buf, tmp_path / "snap", step_bytes=20 * FIELDS.record_nbytes)

    def churn(i: int) -> None:
        if i == 1:  # the newest 20 are copied: take 30 off, push 30 others on the same seqs
            buf.sample(30)
            buf.push_batch(crash_records(2, 0, 30))

    result = steps(snapshot, churn)
    copy = reopened(result.path)
    records = copy.contents()
    assert valid(records).all() and set(records["actor"].tolist()) == {1}
    # copied: 40..59 before the samples; 30..39 may have been taken, so they are left out
    assert records["seq"].tolist() == list(range(30)) + list(range(40, 60))
    assert (result.records, result.pushed) == (50, 60)
    copy.release()


def test_sampling_state_comes_along(tmp_path):
    """Priorities, draw counts and episodes are copied with their records."""
    buf = engine(Schema.transition(2, 1), 20, 100, tmp_path / "p.buffer", persistent=True,
                 prioritized=True, alpha=1.0, max_times_sampled=3)
    buf.push_batch(transitions(0, 50), priorities=np.arange(1, 51, dtype=np.float64))
    buf.sample(20, seed=1)
    copy = reopened(buf.checkpoint(tmp_path / "p-snap").path)
    before, after = buf.info(), copy.info()
    assert (after.size, after.priority_total, after.max_priority) == (
        before.size, before.priority_total, before.max_priority)
    same_contents(buf, copy)  # the used-up records are out of both
    copy.release()

    episodic = millpond.ReplayBuffer(200, obs_dim=2, act_dim=1, episodes=True,
                                     meta_fields={"task": "int64"})
    with episodic.one_episode(task=7):
        for t in range(5):
            episodic.push(np.zeros(2), np.zeros(1), 1.0, t == 4, False, np.zeros(2))
    episodic.push_batch(**transitions(0, 12))  # more episodes, ended by their flags
    path = episodic.checkpoint(tmp_path / "e-snap").path
    copy = reopened(path)
    a, b = episodic.backend.episode_catalog(), copy.episode_catalog()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert b["task"].tolist()[0] == 7
    copy.release()


def test_an_episode_that_loses_a_record_is_no_longer_complete(tmp_path):
    path = tmp_path / "e.buffer"
    buf = engine(Schema.transition(2, 1), 40, 40, path, persistent=True, episodes=True)
    ends = np.zeros(30, bool)
    ends[[9, 19, 29]] = True  # three episodes of 10
    batch = transitions(0, 30)
    batch["terminated"], batch["truncated"] = ends, np.zeros(30, bool)
    buf.push_batch(batch, episodes=np.repeat([1, 2, 3], 10))
    buf.release()
    flip_byte(path, "rewards", 14, hot=True)  # a record of episode 2
    survivor = TieredBuffer.open(path, skip_corrupt=True)
    assert survivor.episode_catalog()["episode_ids"].tolist() == [1, 3]
    copy = reopened(survivor.checkpoint(tmp_path / "snap").path)
    catalog = copy.episode_catalog()
    assert catalog["episode_ids"].tolist() == [1, 3] and catalog["lens"].tolist() == [10, 10]
    assert np.array_equal(copy.read(catalog["seqs"])["rewards"],
                          survivor.read(survivor.episode_catalog()["seqs"])["rewards"])
    windows = copy.sample_sequences(64, 10, seed=0)  # none crosses the gap
    assert (np.diff(windows["rewards"], axis=1)[windows["mask"][:, 1:]] == 1).all()
    copy.release()
    survivor.release()


def test_the_handles_checkpoint_in_process(tmp_path):
    buf = millpond.MmapReplayBuffer(10, 100, obs_dim=2, act_dim=1,
                                    cold_path=tmp_path / "live.buffer")
    buf.push_batch(*transitions(0, 70).values())
    result = buf.checkpoint(tmp_path / "copy.buffer")
    assert result.records == 70
    again = millpond.MmapReplayBuffer.open(result.path, obs_dim=2, act_dim=1)
    assert len(again) == 70 and np.array_equal(again.sample_all()["rewards"],
                                               np.arange(70, dtype=np.float32))
    again.release()
