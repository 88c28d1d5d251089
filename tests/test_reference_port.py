"""The reference's unit tests (rlox ``MmapReplayBuffer``, shared/reference/001), ported.

Each ``test_*`` below keeps the name and intent of one reference test, run
against the public ``millpond.MmapReplayBuffer``. Where the reference reads
private fields we read ``info()``:

* ``buf.hot.len()``   -> ``info()["hot_size"]``
* ``buf.cold_count``  -> ``info()["cold_size"]``
* ``buf.cold_write_pos`` -> ``(pushed - hot_capacity) % cold_capacity`` (the
  slot the next spilled record lands in).

Where the reference only checks lengths we also check values, since our
``sample`` returns numpy arrays we can inspect cheaply. At the end: the
constructor errors, ``batch_size > len``, and ``total == hot`` (the reference
panics there once full; we evict).
"""

from __future__ import annotations

import numpy as np
import pytest

import millpond


def sample_record(obs_dim: int, act_dim: int = 1, value: float = 1.0) -> dict:
    """The reference's ``sample_record``/``sample_record_multidim``: a valid record."""
    return dict(
        obs=np.full(obs_dim, value, np.float32),
        action=np.full(act_dim, 0.5, np.float32),
        reward=1.0,
        terminated=False,
        truncated=False,
        next_obs=np.full(obs_dim, value + 1.0, np.float32),
    )


def make(tmp_path, hot, total, obs_dim, act_dim, name="cold.bin"):
    return millpond.MmapReplayBuffer(hot, total, obs_dim, act_dim, str(tmp_path / name))


def hot_len(buf) -> int:
    return buf.info()["hot_size"]


def cold_count(buf) -> int:
    return buf.info()["cold_size"]


def cold_write_pos(buf) -> int:
    info = buf.info()
    cold_capacity = info["total_capacity"] - info["hot_capacity"]
    return max(0, info["pushed"] - info["hot_capacity"]) % cold_capacity


@pytest.fixture
def closing():
    """Close every buffer a test made, even when it fails."""
    bufs = []
    yield bufs.append
    for b in bufs:
        b.close()


def test_mmap_buffer_new_is_empty(tmp_path, closing):
    buf = make(tmp_path, 100, 1000, 4, 1)
    closing(buf)
    assert len(buf) == 0
    assert buf.is_empty()


def test_mmap_buffer_push_within_hot_capacity(tmp_path, closing):
    buf = make(tmp_path, 100, 1000, 4, 1)
    closing(buf)
    for _ in range(50):
        buf.push(**sample_record(4))
    assert len(buf) == 50
    assert not buf.is_empty()
    # No cold records should exist.
    assert cold_count(buf) == 0
    assert hot_len(buf) == 50


def test_mmap_buffer_push_exceeds_hot_spills_to_cold(tmp_path, closing):
    buf = make(tmp_path, 10, 100, 4, 1)
    closing(buf)
    # 10 fit in hot, then pushes 11-15 spill records to cold.
    for i in range(15):
        rec = sample_record(4)
        rec["reward"] = float(i)
        buf.push(**rec)
    assert hot_len(buf) == 10
    assert cold_count(buf) == 5
    assert len(buf) == 15
    # Stronger than the reference: no record was lost on the way to cold.
    seen = set()
    for seed in range(40):
        seen |= set(buf.sample(15, seed)["rewards"].tolist())
    assert seen == set(map(float, range(15)))


def test_mmap_buffer_sample_from_hot_only(tmp_path, closing):
    buf = make(tmp_path, 100, 1000, 4, 1)
    closing(buf)
    for i in range(50):
        rec = sample_record(4)
        rec["reward"] = float(i)
        buf.push(**rec)
    batch = buf.sample(10, 42)
    assert batch["obs"].shape == (10, 4)
    assert batch["obs"].size == 10 * 4
    assert batch["rewards"].shape == (10,)
    assert set(batch["rewards"].tolist()) <= set(map(float, range(50)))


def test_mmap_buffer_sample_from_hot_and_cold(tmp_path, closing):
    buf = make(tmp_path, 10, 100, 4, 1)
    closing(buf)
    for i in range(20):
        rec = sample_record(4)
        rec["reward"] = float(i)
        buf.push(**rec)
    assert cold_count(buf) == 10
    assert hot_len(buf) == 10

    batch = buf.sample(20, 99)
    assert batch["rewards"].shape == (20,)
    # Some samples from the cold range [0, 10), some from hot [10, 20).
    assert (batch["rewards"] < 10.0).any(), "expected some samples from cold storage"
    assert (batch["rewards"] >= 10.0).any(), "expected some samples from hot storage"


def test_mmap_buffer_total_count(tmp_path, closing):
    buf = make(tmp_path, 5, 50, 4, 1)
    closing(buf)
    for _ in range(30):
        buf.push(**sample_record(4))
    assert len(buf) == 30
    assert hot_len(buf) == 5
    assert cold_count(buf) == 25


def test_mmap_buffer_deterministic_sampling(tmp_path, closing):
    buf1 = make(tmp_path, 10, 100, 4, 1, "a.bin")
    buf2 = make(tmp_path, 10, 100, 4, 1, "b.bin")
    closing(buf1)
    closing(buf2)
    for i in range(20):
        rec = sample_record(4, value=float(i))
        rec["reward"] = float(i)
        rec["terminated"] = i % 3 == 0
        buf1.push(**rec)
        buf2.push(**rec)

    b1 = buf1.sample(15, 42)
    b2 = buf2.sample(15, 42)
    for key in ("obs", "next_obs", "actions", "rewards", "terminated", "truncated"):
        np.testing.assert_array_equal(b1[key], b2[key], err_msg=key)
    # And the same buffer sampled twice with the same seed.
    np.testing.assert_array_equal(buf1.sample(15, 42)["rewards"], b1["rewards"])


def test_mmap_buffer_cleanup_removes_file(tmp_path):
    cold_path = tmp_path / "cold.bin"
    buf = millpond.MmapReplayBuffer(5, 50, 4, 1, str(cold_path))
    # Push enough to spill into the cold file.
    for _ in range(10):
        buf.push(**sample_record(4))
    assert cold_path.exists(), "cold file should exist after spill"
    buf.close()
    assert not cold_path.exists(), "cold file should be removed after close()"


def test_mmap_buffer_large_obs_dim(tmp_path, closing):
    obs_dim = 28224  # Atari-scale (84*84*4)
    act_dim = 1
    buf = make(tmp_path, 5, 20, obs_dim, act_dim)
    closing(buf)
    for i in range(10):
        rec = sample_record(obs_dim, act_dim)
        rec["reward"] = float(i)
        rec["obs"][0] = float(i)  # first obs element distinguishes records
        buf.push(**rec)

    assert len(buf) == 10
    assert hot_len(buf) == 5
    assert cold_count(buf) == 5

    batch = buf.sample(5, 42)
    assert batch["obs"].shape == (5, obs_dim)
    assert batch["obs"].size == 5 * obs_dim
    # Each row is the record its reward names (cold and hot rows alike).
    np.testing.assert_array_equal(batch["obs"][:, 0], batch["rewards"])
    np.testing.assert_array_equal(batch["obs"][:, 1:], 1.0)


# ---- push_batch tests ----


def _ramp_batch(n: int, obs_dim: int):
    obs = np.arange(n * obs_dim, dtype=np.float32)
    next_obs = obs + 100.0
    actions = np.arange(n, dtype=np.float32) * 0.1
    rewards = np.arange(n, dtype=np.float32)
    return obs, next_obs, actions, rewards, np.zeros(n, np.float32), np.zeros(n, np.float32)


def test_push_batch_fills_hot_correctly(tmp_path, closing):
    buf = make(tmp_path, 100, 1000, 4, 1)
    closing(buf)
    buf.push_batch(*_ramp_batch(10, 4))  # flat [n*obs_dim] arrays, as in the reference

    assert len(buf) == 10
    assert cold_count(buf) == 0

    # Sample and verify rewards round-trip with their rows.
    batch = buf.sample(10, 42)
    assert batch["rewards"].shape == (10,)
    for row in range(10):
        r = int(batch["rewards"][row])
        assert 0 <= r < 10
        np.testing.assert_array_equal(batch["obs"][row], np.arange(4 * r, 4 * r + 4))
        np.testing.assert_array_equal(batch["next_obs"][row], batch["obs"][row] + 100.0)
        assert batch["actions"][row, 0] == np.float32(r * np.float32(0.1))


def test_push_batch_triggers_spill_to_cold(tmp_path, closing):
    buf = make(tmp_path, 5, 100, 2, 1)
    closing(buf)
    buf.push_batch(*_ramp_batch(12, 2))

    assert hot_len(buf) == 5
    assert cold_count(buf) == 7
    assert len(buf) == 12


def test_push_batch_shape_mismatch(tmp_path, closing):
    buf = make(tmp_path, 100, 1000, 4, 1)
    closing(buf)
    with pytest.raises(millpond.ShapeMismatchError) as excinfo:
        buf.push_batch(
            [1.0, 2.0, 3.0],  # 3 instead of 4
            [1.0, 2.0, 3.0, 4.0],
            [0.0],
            [1.0],
            [0.0],
            [0.0],
        )
    assert isinstance(excinfo.value, ValueError)
    assert len(buf) == 0


def test_push_batch_terminated_truncated_flags(tmp_path, closing):
    buf = make(tmp_path, 100, 1000, 2, 1)
    closing(buf)
    obs = [1.0, 2.0, 3.0, 4.0]  # 2 records, obs_dim=2
    next_obs = [5.0, 6.0, 7.0, 8.0]
    actions = [0.0, 1.0]
    rewards = [1.0, 2.0]
    terminated = [1.0, 0.0]  # first terminated
    truncated = [0.0, 1.0]  # second truncated
    buf.push_batch(obs, next_obs, actions, rewards, terminated, truncated)

    batch = buf.sample(2, 42)
    assert batch["terminated"].shape == (2,)
    assert batch["truncated"].shape == (2,)
    assert batch["terminated"].dtype == np.bool_
    assert batch["truncated"].dtype == np.bool_
    # The flags travel with their record: reward 1 terminated, reward 2 truncated.
    np.testing.assert_array_equal(batch["terminated"], batch["rewards"] == 1.0)
    np.testing.assert_array_equal(batch["truncated"], batch["rewards"] == 2.0)


# ---- cold ring-buffer eviction tests ----


def _push_i(buf, i: int, obs_dim: int, **over):
    rec = dict(
        obs=np.full(obs_dim, i, np.float32),
        action=np.array([i * 0.1], np.float32),
        reward=float(i),
        terminated=False,
        truncated=False,
        next_obs=np.full(obs_dim, i + 100.0, np.float32),
    )
    rec.update(over)
    buf.push(**rec)


def test_cold_ring_buffer_eviction_overwrites_oldest(tmp_path, closing):
    # hot_capacity=3, total_capacity=6 => cold_capacity=3
    buf = make(tmp_path, 3, 6, 2, 1)
    closing(buf)
    for i in range(10):
        _push_i(buf, i, 2)

    # Total capped at total_capacity=6.
    assert len(buf) == 6
    assert hot_len(buf) == 3
    assert cold_count(buf) == 3

    batch = buf.sample(6, 42)
    assert batch["rewards"].shape == (6,)
    # Rewards 0..3 were overwritten; hot has 7, 8, 9 and cold the 3 most recent spills.
    assert (batch["rewards"] >= 4.0).all(), batch["rewards"]
    # Over many draws, exactly the live records 4..9 appear.
    seen = set()
    for seed in range(50):
        seen |= set(buf.sample(6, seed)["rewards"].tolist())
    assert seen == {4.0, 5.0, 6.0, 7.0, 8.0, 9.0}


def test_cold_eviction_cold_write_pos_wraps(tmp_path, closing):
    # hot_capacity=2, total_capacity=4 => cold_capacity=2
    buf = make(tmp_path, 2, 4, 1, 1)
    closing(buf)
    for i in range(8):
        _push_i(buf, i, 1, next_obs=np.array([i + 10.0], np.float32), action=[0.0])

    assert len(buf) == 4
    assert cold_count(buf) == 2
    # 6 spills into capacity 2 => next cold slot is 0.
    assert cold_write_pos(buf) == 0
    assert buf.info()["pushed"] == 8


def test_sampling_after_cold_eviction_returns_valid_data(tmp_path, closing):
    # hot=5, total=8, cold_capacity=3
    buf = make(tmp_path, 5, 8, 3, 1)
    closing(buf)
    for i in range(20):
        buf.push(
            np.full(3, i, np.float32),
            np.array([i * 0.01], np.float32),
            float(i),
            i % 3 == 0,
            i % 5 == 0,
            np.full(3, i + 0.5, np.float32),
        )

    assert len(buf) == 8

    batch = buf.sample(8, 123)
    assert batch["obs"].shape == (8, 3)
    assert batch["next_obs"].shape == (8, 3)
    assert batch["actions"].shape == (8, 1)
    assert batch["rewards"].shape == (8,)

    # Each sampled row is internally consistent (obs was [r; 3]) and live (r >= 12).
    for row in range(8):
        r = batch["rewards"][row]
        assert 12 <= r < 20
        np.testing.assert_allclose(batch["obs"][row], r, atol=1e-6)
        np.testing.assert_allclose(batch["next_obs"][row], r + 0.5, atol=1e-6)
        np.testing.assert_allclose(batch["actions"][row, 0], np.float32(r * 0.01), rtol=1e-6)
        assert batch["terminated"][row] == (int(r) % 3 == 0)
        assert batch["truncated"][row] == (int(r) % 5 == 0)


def test_push_batch_then_sample_consistency(tmp_path, closing):
    buf = make(tmp_path, 5, 15, 2, 1)
    closing(buf)
    # 3 batches of 5 fill past hot and into cold.
    for batch_idx in range(3):
        base = batch_idx * 5.0
        v = base + np.arange(5, dtype=np.float32)
        obs = np.stack([v, v + 0.1], axis=1).reshape(-1)
        next_obs = obs + 100.0
        actions = v * 0.01
        buf.push_batch(obs, next_obs, actions, v, np.zeros(5), np.zeros(5))

    assert len(buf) == 15
    assert hot_len(buf) == 5
    assert cold_count(buf) == 10

    batch = buf.sample(15, 7)
    assert batch["obs"].shape == (15, 2)
    # Each observation pair matches: obs[1] - obs[0] == 0.1, and obs[0] is the reward.
    for i in range(15):
        o0, o1 = batch["obs"][i]
        assert abs(o1 - o0 - 0.1) < 1e-5, f"obs pair mismatch at sample {i}: {o0}, {o1}"
        assert o0 == batch["rewards"][i]


# ---- beyond the reference's tests: the errors its constructor and sample return ----


@pytest.mark.parametrize(
    "hot, total, obs_dim, act_dim",
    [
        (0, 1000, 4, 1),  # hot_capacity must be > 0
        (100, 99, 4, 1),  # total_capacity must be >= hot_capacity
        (100, 1000, 0, 1),  # obs_dim must be > 0
        (100, 1000, 4, 0),  # act_dim must be > 0
    ],
)
def test_mmap_buffer_new_rejects_bad_config(tmp_path, hot, total, obs_dim, act_dim):
    path = tmp_path / "cold.bin"
    with pytest.raises(millpond.InvalidConfigError) as excinfo:
        millpond.MmapReplayBuffer(hot, total, obs_dim, act_dim, str(path))
    assert isinstance(excinfo.value, ValueError)
    assert not path.exists(), "a rejected configuration must leave no file behind"


def test_mmap_buffer_sample_more_than_len(tmp_path, closing):
    buf = make(tmp_path, 10, 100, 4, 1)
    closing(buf)
    with pytest.raises(millpond.NotEnoughDataError) as excinfo:
        buf.sample(1, 0)  # empty buffer
    assert isinstance(excinfo.value, ValueError)
    for i in range(12):
        _push_i(buf, i, 4)
    with pytest.raises(ValueError):
        buf.sample(13, 0)
    assert buf.sample(12, 0)["rewards"].shape == (12,)  # == len is fine


def test_mmap_buffer_push_wrong_shapes(tmp_path, closing):
    buf = make(tmp_path, 10, 100, 4, 2)
    closing(buf)
    good = sample_record(4, 2)
    for key, bad in (
        ("obs", np.ones(3, np.float32)),
        ("next_obs", np.ones(5, np.float32)),
        ("action", np.ones(1, np.float32)),
    ):
        with pytest.raises(millpond.ShapeMismatchError):
            buf.push(**{**good, key: bad})
    assert len(buf) == 0


def test_mmap_buffer_total_equals_hot_evicts(tmp_path, closing):
    """``total == hot``: no cold tier. The reference panics once full; we evict the oldest."""
    path = tmp_path / "cold.bin"
    buf = millpond.MmapReplayBuffer(4, 4, 2, 1, str(path))
    closing(buf)
    assert not path.exists(), "no cold tier, so no cold file"
    for i in range(10):
        _push_i(buf, i, 2)
    assert len(buf) == 4
    info = buf.info()
    assert (info["hot_size"], info["cold_size"]) == (4, 0)
    seen = set()
    for seed in range(40):
        seen |= set(buf.sample(4, seed)["rewards"].tolist())
    assert seen == {6.0, 7.0, 8.0, 9.0}
