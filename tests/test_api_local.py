"""The public in-process API: ``millpond.MmapReplayBuffer`` and ``millpond.ReplayBuffer``.

Call signatures of the reference (push / push_batch / sample / len /
is_empty / close), result keys, shapes and dtypes, typed errors, the
lifecycle, and a statistical check that sampling is uniform over hot + cold.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import millpond

OBS, ACT = 3, 2
KEYS = {"obs", "next_obs", "actions", "rewards", "terminated", "truncated"}


@pytest.fixture(params=["mmap", "ram"])
def kind(request):
    return request.param


@pytest.fixture
def new(kind, tmp_path):
    """Build an empty transition buffer of the parametrized class (capacity 10)."""
    made = []

    def build(capacity=10, obs_dim=OBS, act_dim=ACT):
        if kind == "mmap":
            hot = max(1, capacity // 3)
            buf = millpond.MmapReplayBuffer(hot, capacity, obs_dim, act_dim, str(tmp_path / f"c{len(made)}"))
        else:
            buf = millpond.ReplayBuffer(capacity, obs_dim, act_dim)
        made.append(buf)
        return buf

    yield build
    for b in made:
        b.close()


def rec(i: int) -> dict:
    """Record i with the reference's push argument names."""
    return dict(
        obs=np.full(OBS, i, np.float32),
        action=np.array([i, -i], np.float32),
        reward=float(i),
        terminated=i % 2 == 0,
        truncated=i % 5 == 0,
        next_obs=np.full(OBS, i + 0.5, np.float32),
    )


def batch(start: int, n: int) -> dict:
    """Records start..start+n-1 with the reference's push_batch argument names."""
    i = np.arange(start, start + n)
    return dict(
        obs=np.repeat(i[:, None], OBS, axis=1).astype(np.float32),
        next_obs=(np.repeat(i[:, None], OBS, axis=1) + 0.5).astype(np.float32),
        actions=np.stack([i, -i], axis=1).astype(np.float32),
        rewards=i.astype(np.float32),
        terminated=(i % 2 == 0),
        truncated=(i % 5 == 0).astype(np.float32),
    )


def check_rows(out: dict, live: range) -> None:
    """Every row of a sample is one live record, all fields agreeing."""
    r = out["rewards"]
    ints = r.astype(np.int64)
    assert set(ints.tolist()) <= set(live), (ints, live)
    np.testing.assert_array_equal(out["obs"], np.repeat(r[:, None], OBS, axis=1))
    np.testing.assert_array_equal(out["next_obs"], out["obs"] + 0.5)
    np.testing.assert_array_equal(out["actions"], np.stack([r, -r], axis=1))
    np.testing.assert_array_equal(out["terminated"], ints % 2 == 0)
    np.testing.assert_array_equal(out["truncated"], ints % 5 == 0)


def all_seen(buf, rounds=30) -> set:
    seen = set()
    for seed in range(rounds):
        seen |= set(buf.sample(len(buf), seed)["rewards"].astype(int).tolist())
    return seen


# ---- len / is_empty / push -----------------------------------------------------


def test_len_and_is_empty(new):
    buf = new(10)
    assert len(buf) == 0 and buf.is_empty()
    buf.push(**rec(0))
    assert len(buf) == 1 and not buf.is_empty()
    buf.push_batch(**batch(1, 20))
    assert len(buf) == 10  # capped at capacity
    assert buf.info()["pushed"] == 21


def test_push_positional_in_reference_order(new):
    buf = new()
    r = rec(4)
    buf.push(r["obs"], r["action"], r["reward"], r["terminated"], r["truncated"], r["next_obs"])
    out = buf.sample(1, 0)
    check_rows(out, range(4, 5))


def test_push_keyword_any_order_equals_positional(new):
    a, b = new(), new()
    for i in range(6):
        r = rec(i)
        a.push(r["obs"], r["action"], r["reward"], r["terminated"], r["truncated"], r["next_obs"])
        b.push(next_obs=r["next_obs"], truncated=r["truncated"], terminated=r["terminated"],
               reward=r["reward"], action=r["action"], obs=r["obs"])
    for seed in range(3):
        sa, sb = a.sample(6, seed), b.sample(6, seed)
        for key in KEYS:
            np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)
    check_rows(a.sample(6, 0), range(6))


def test_push_accepts_lists_and_python_scalars(new):
    buf = new()
    buf.push([7.0] * OBS, [7, -7], 7, True, False, [7.5] * OBS)
    out = buf.sample(1, 0)
    assert out["rewards"][0] == 7 and out["terminated"][0] and not out["truncated"][0]
    np.testing.assert_array_equal(out["actions"][0], [7, -7])


def test_push_argument_errors(new):
    buf = new()
    r = rec(1)
    args = (r["obs"], r["action"], r["reward"], r["terminated"], r["truncated"], r["next_obs"])
    with pytest.raises(millpond.FieldMismatchError):
        buf.push(*args, 1.0)  # too many positional arguments
    with pytest.raises(millpond.FieldMismatchError):
        buf.push(*args[:5])  # next_obs missing
    with pytest.raises(millpond.FieldMismatchError):
        buf.push(*args, obs=r["obs"])  # obs given twice
    with pytest.raises(millpond.ShapeMismatchError):
        buf.push(np.zeros(OBS + 1), *args[1:])
    assert len(buf) == 0


def test_stored_records_are_copies(new):
    buf = new()
    r = rec(3)
    buf.push(**r)
    cols = batch(4, 2)
    buf.push_batch(**cols)
    r["obs"][:] = 99  # caller reuses its arrays
    cols["obs"][:] = 99
    out = buf.sample(3, 0)
    check_rows(out, range(3, 6))
    out["obs"][:] = -1  # and mutating a sample does not touch the buffer
    check_rows(buf.sample(3, 0), range(3, 6))


# ---- push_batch -----------------------------------------------------------------


def test_push_batch_positional_in_reference_order(new):
    buf = new()
    c = batch(0, 8)
    buf.push_batch(c["obs"], c["next_obs"], c["actions"], c["rewards"], c["terminated"], c["truncated"])
    assert len(buf) == 8
    assert all_seen(buf) == set(range(8))
    check_rows(buf.sample(8, 1), range(8))


def test_push_batch_keyword_and_reference_names(new):
    a, b, c = new(), new(), new()
    cols = batch(0, 8)
    a.push_batch(**cols)
    # The reference's Rust argument names are accepted too.
    b.push_batch(obs_batch=cols["obs"], next_obs_batch=cols["next_obs"],
                 actions_batch=cols["actions"], rewards=cols["rewards"],
                 terminated=cols["terminated"], truncated=cols["truncated"])
    # Flat [n*dim] arrays, as the reference takes them.
    c.push_batch(cols["obs"].ravel(), cols["next_obs"].ravel(), cols["actions"].ravel(),
                 cols["rewards"], cols["terminated"], cols["truncated"])
    for seed in range(3):
        ref = a.sample(8, seed)
        for other in (b, c):
            out = other.sample(8, seed)
            for key in KEYS:
                np.testing.assert_array_equal(out[key], ref[key], err_msg=key)


def test_push_batch_empty_is_a_no_op(new):
    buf = new()
    buf.push_batch(**batch(0, 3))
    buf.push_batch(**batch(3, 0))
    assert len(buf) == 3 and buf.info()["pushed"] == 3


def test_push_batch_larger_than_capacity_keeps_newest(new):
    buf = new(10)
    buf.push_batch(**batch(0, 37))
    assert len(buf) == 10
    assert all_seen(buf) == set(range(27, 37))
    check_rows(buf.sample(10, 0), range(27, 37))


def test_push_batch_shape_error_changes_nothing(new):
    buf = new()
    buf.push_batch(**batch(0, 4))
    before = buf.sample(4, 9)
    cols = batch(4, 3)
    cols["actions"] = cols["actions"][:, :1]
    with pytest.raises(millpond.ShapeMismatchError) as excinfo:
        buf.push_batch(**cols)
    assert isinstance(excinfo.value, ValueError)
    assert len(buf) == 4 and buf.info()["pushed"] == 4
    after = buf.sample(4, 9)
    for key in KEYS:
        np.testing.assert_array_equal(before[key], after[key])


# ---- sample -------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 5, 10])
def test_sample_keys_shapes_dtypes(new, batch_size):
    buf = new(10)
    buf.push_batch(**{k: (v.astype(np.float64) if k != "terminated" else v) for k, v in batch(0, 15).items()})
    out = buf.sample(batch_size, 3)
    assert set(out) == KEYS
    B = batch_size
    expected = {
        "obs": ((B, OBS), np.float32),
        "next_obs": ((B, OBS), np.float32),
        "actions": ((B, ACT), np.float32),
        "rewards": ((B,), np.float32),
        "terminated": ((B,), np.bool_),
        "truncated": ((B,), np.bool_),
    }
    for key, (shape, dtype) in expected.items():
        assert out[key].shape == shape, key
        assert out[key].dtype == dtype, key
        assert isinstance(out[key], np.ndarray)
    check_rows(out, range(5, 15))


def test_sample_act_dim_one_keeps_2d_actions(tmp_path):
    with millpond.MmapReplayBuffer(2, 4, 1, 1, str(tmp_path / "c")) as buf:
        buf.push_batch(np.zeros(3), np.zeros(3), np.arange(3), np.arange(3), np.zeros(3), np.zeros(3))
        out = buf.sample(3, 0)
        assert out["obs"].shape == (3, 1) and out["actions"].shape == (3, 1)
        np.testing.assert_array_equal(out["actions"][:, 0], out["rewards"])


def test_sample_seed_none_draws_fresh_entropy(new):
    buf = new(100)
    buf.push_batch(**batch(0, 100))
    a, b = buf.sample(30), buf.sample(30, seed=None)
    check_rows(a, range(100))
    check_rows(b, range(100))
    # 100^30 possible batches: two equal unseeded draws means the seed is fixed.
    assert not np.array_equal(a["rewards"], b["rewards"])


def test_sample_same_seed_same_batch_different_seed_differs(new):
    buf = new(100)
    buf.push_batch(**batch(0, 100))
    a, b, c = buf.sample(30, 5), buf.sample(30, 5), buf.sample(30, 6)
    for key in KEYS:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["rewards"], c["rewards"])


def test_sample_accepts_numpy_int_batch_size(new):
    buf = new()
    buf.push_batch(**batch(0, 5))
    assert buf.sample(np.int64(4), np.uint64(2))["rewards"].shape == (4,)


@pytest.mark.parametrize("bad", [0, -1, -100, 1.5, 2.0, "3", None, True, [2]])
def test_sample_invalid_batch_size(new, bad):
    buf = new()
    buf.push_batch(**batch(0, 5))
    with pytest.raises(millpond.InvalidBatchSizeError) as excinfo:
        buf.sample(bad, 0)
    assert isinstance(excinfo.value, ValueError)
    assert len(buf) == 5


def test_sample_more_than_len(new):
    buf = new()
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample(1, 0)
    buf.push_batch(**batch(0, 5))
    with pytest.raises(millpond.NotEnoughDataError) as excinfo:
        buf.sample(6, 0)
    assert isinstance(excinfo.value, ValueError)


# ---- lifecycle ----------------------------------------------------------------


def test_use_after_close_raises(new):
    buf = new()
    buf.push_batch(**batch(0, 5))
    buf.close()
    assert buf.closed
    calls = [
        lambda: buf.push(**rec(9)),
        lambda: buf.push_batch(**batch(9, 2)),
        lambda: buf.sample(1, 0),
        lambda: len(buf),
        lambda: buf.is_empty(),
        lambda: buf.info(),
    ]
    for call in calls:
        with pytest.raises(millpond.BufferClosedError) as excinfo:
            call()
        assert isinstance(excinfo.value, ValueError)


def test_close_is_idempotent(new):
    buf = new()
    buf.close()
    buf.close()
    assert buf.closed


def test_context_manager_closes(tmp_path):
    path = tmp_path / "cold.bin"
    with millpond.MmapReplayBuffer(2, 6, OBS, ACT, str(path)) as buf:
        assert path.exists()
        buf.push_batch(**batch(0, 6))
        assert len(buf) == 6
    assert buf.closed
    assert not path.exists()
    with pytest.raises(millpond.BufferClosedError):
        buf.sample(1, 0)


def test_context_manager_closes_on_error(tmp_path):
    path = tmp_path / "cold.bin"
    with pytest.raises(RuntimeError):
        with millpond.MmapReplayBuffer(2, 6, OBS, ACT, str(path)) as buf:
            raise RuntimeError("boom")
    assert buf.closed and not path.exists()


# ---- ReplayBuffer (RAM only) ------------------------------------------------------


def test_replay_buffer_is_ram_only_fifo():
    buf = millpond.ReplayBuffer(8, OBS, ACT)
    try:
        info = buf.info()
        assert info["path"] is None
        assert info["hot_capacity"] == info["total_capacity"] == 8
        for i in range(5):
            buf.push(**rec(i))
        buf.push_batch(**batch(5, 7))
        assert len(buf) == 8
        assert buf.info()["cold_size"] == 0
        assert all_seen(buf) == set(range(4, 12))
        check_rows(buf.sample(8, 0), range(4, 12))
    finally:
        buf.close()
    assert buf.closed


@pytest.mark.parametrize("args", [(0, 3, 1), (-1, 3, 1), (8, 0, 1), (8, 3, 0), (8.0, 3, 1), (8, 3.0, 1)])
def test_replay_buffer_bad_config(args):
    with pytest.raises(millpond.InvalidConfigError) as excinfo:
        millpond.ReplayBuffer(*args)
    assert isinstance(excinfo.value, ValueError)


def test_mmap_capacity_types_checked(tmp_path):
    for hot, total in [(2.0, 6), (2, 6.5), (True, 6), ("2", 6)]:
        with pytest.raises(millpond.InvalidConfigError):
            millpond.MmapReplayBuffer(hot, total, OBS, ACT, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_repr_names_the_buffer(tmp_path):
    with millpond.MmapReplayBuffer(2, 6, OBS, ACT, str(tmp_path / "c")) as buf:
        text = repr(buf)
        assert "MmapReplayBuffer" in text and "hot_capacity=2" in text and "total_capacity=6" in text


# ---- statistics: uniform over hot + cold --------------------------------------------


def test_sampling_is_uniform_over_hot_and_cold(tmp_path):
    hot, total, pushed = 50, 200, 300  # live records 100..299: 150 cold, 50 hot
    with millpond.MmapReplayBuffer(hot, total, OBS, ACT, str(tmp_path / "c")) as buf:
        buf.push_batch(**batch(0, 120))
        buf.push_batch(**batch(120, 180))
        info = buf.info()
        assert (info["hot_size"], info["cold_size"]) == (50, 150)
        draws, rounds = 200, 1000  # batch_size may not exceed len
        counts = np.zeros(pushed, np.int64)
        for seed in range(rounds):
            out = buf.sample(draws, seed)
            if seed == 0:
                check_rows(out, range(100, 300))
            counts += np.bincount(out["rewards"].astype(np.int64), minlength=pushed)
    n = draws * rounds
    assert counts[:100].sum() == 0, "evicted records were sampled"
    p = 1 / total
    mean, sigma = n * p, math.sqrt(n * p * (1 - p))
    live = counts[100:]
    worst = np.abs(live - mean).max() / sigma
    assert worst < 5, f"a record's frequency is {worst:.1f} sigma off uniform"
    # Hot vs cold share: 50/200 of draws should hit the hot tier.
    hot_hits = live[-hot:].sum()
    q = hot / total
    assert abs(hot_hits - n * q) < 5 * math.sqrt(n * q * (1 - q)), hot_hits
    # And the spread across records looks binomial, not degenerate (chi-square, 199 dof).
    chi2 = float(((live - mean) ** 2 / mean).sum())
    assert 199 - 5 * math.sqrt(2 * 199) < chi2 < 199 + 5 * math.sqrt(2 * 199), chi2


@pytest.mark.parametrize("seed", [-1, 1.5, "7", [1, 2]])
def test_sample_invalid_seed_is_a_typed_error(new, seed):
    """A bad seed is the caller's mistake: a millpond error (and a ValueError), not numpy's."""
    buf = new()
    buf.push_batch(**batch(0, 5))
    with pytest.raises(millpond.InvalidArgumentError) as excinfo:
        buf.sample(2, seed)
    assert isinstance(excinfo.value, ValueError)
    assert len(buf) == 5
