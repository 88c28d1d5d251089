"""One behaviour suite, run against the in-process buffer and the remote one.

"The client mimics the in-process API" is checked here, not claimed: every
test runs once per backend, with the same calls and the same assertions,
including the exception types. "aio" is the asyncio client (millpond.aio), driven
from these sync tests by tests/aio_sync.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from aio_sync import SyncBuffer

import millpond

_names = itertools.count()


def frame_options(total: int, obs_dim=None, fields=None) -> dict:
    """Frames stored once for a schema with ``obs`` and ``next_obs`` alike: ``obs`` a stack
    along axis 0 (if it has one), ``next_obs`` next_of it, a frame store that always
    suffices (``2 k`` frames per record held or pushed at once: see millpond.core.frames);
    nothing for another schema."""
    if fields is None:
        if obs_dim is None:
            return {}
        shape: tuple = (obs_dim,)
    else:
        spec = {name: (np.dtype(dtype).str, tuple(np.atleast_1d(dims)) if dims != () else ())
                for name, (dtype, dims) in dict(fields).items()}
        if "obs" not in spec or spec.get("next_obs") != spec["obs"]:
            return {}
        shape = spec["obs"][1]
    k = shape[0] if shape else 1
    return {"next_of": {"next_obs": "obs"}, "frame_stack": {"obs": 0} if shape else None,
            "frame_capacity": 2 * k * (total + 4096) + 64}


@pytest.fixture(params=["local", pytest.param("grpc", marks=pytest.mark.daemon),
                        pytest.param("shm", marks=pytest.mark.daemon),
                        pytest.param("aio", marks=pytest.mark.daemon), "pixel",
                        pytest.param("pixel-grpc", marks=pytest.mark.daemon)])
def make(request, tmp_path):
    """make(hot, total, obs_dim=, act_dim= | fields=) -> a buffer on the backend under test.

    "grpc" and "shm" are remote buffers on a real daemon, with bulk data over
    gRPC and over the shared-memory fast path respectively; "aio" one made by
    millpond.aio's client (its calls awaited on an event loop of their own);
    "pixel" and "pixel-grpc" in-process and remote buffers storing frames once
    (:func:`frame_options`): they must behave as the others.
    """
    made = []

    def factory(hot, total, obs_dim=None, act_dim=None, fields=None):
        frames = (frame_options(total, obs_dim, fields)
                  if request.param.startswith("pixel") else {})
        if request.param in ("local", "pixel"):
            buf = millpond.MmapReplayBuffer(
                hot, total, obs_dim, act_dim, tmp_path / f"b{next(_names)}.cold", fields=fields,
                **frames
            )
        elif request.param == "aio":
            server, loop = request.getfixturevalue("shared_server"), request.getfixturevalue("aio_loop")
            client = loop.connect(server.address)
            assert client.transport == "grpc"
            buf = SyncBuffer(loop, loop.run(client.create_buffer(
                f"contract-{next(_names)}", hot_capacity=hot, total_capacity=total,
                obs_dim=obs_dim, act_dim=act_dim, fields=fields)), own_client=True)
        else:
            server = request.getfixturevalue("shared_server")
            transport = request.param.removeprefix("pixel-")
            client = millpond.connect(server.address, shm=transport == "shm")
            assert client.transport == transport
            buf = client.create_buffer(
                f"contract-{next(_names)}", hot_capacity=hot, total_capacity=total,
                obs_dim=obs_dim, act_dim=act_dim, fields=fields, **frames
            )
        made.append(buf)
        return buf

    yield factory
    for buf in made:
        buf.close()


def transitions(start: int, n: int, obs_dim: int = 2, act_dim: int = 1) -> dict:
    """n self-identifying transitions: every value derives from the record index."""
    idx = np.arange(start, start + n, dtype=np.float32)
    return {
        "obs": np.repeat(idx[:, None], obs_dim, axis=1),
        "next_obs": np.repeat(idx[:, None] + 0.5, obs_dim, axis=1),
        "actions": np.repeat(idx[:, None] * 0.25, act_dim, axis=1),
        "rewards": idx,
        "terminated": (np.arange(start, start + n) % 3 == 0),
        "truncated": (np.arange(start, start + n) % 5 == 0).astype(np.float32),
    }


def assert_rows_consistent(batch: dict) -> None:
    r = batch["rewards"]
    np.testing.assert_array_equal(batch["obs"], np.repeat(r[:, None], batch["obs"].shape[1], 1))
    np.testing.assert_array_equal(batch["next_obs"][:, 0], r + 0.5)
    np.testing.assert_array_equal(batch["actions"][:, 0], r * 0.25)
    np.testing.assert_array_equal(batch["terminated"], r.astype(int) % 3 == 0)
    np.testing.assert_array_equal(batch["truncated"], r.astype(int) % 5 == 0)


def seen_rewards(buf, draws: int = 40) -> set:
    """Rewards seen over many seeded full-size samples (batch_size may not exceed len)."""
    return {r for seed in range(draws) for r in buf.sample(len(buf), seed=seed)["rewards"].tolist()}


def snapshot(buf) -> tuple:
    """What a user can observe of a buffer: sizes, counters and a seeded sample."""
    info = buf.info()
    sample = buf.sample(len(buf), seed=7) if len(buf) else {}
    return (len(buf), info["pushed"], info["hot_size"], info["cold_size"],
            {k: v.tobytes() for k, v in sample.items()})


def test_new_buffer_is_empty(make):
    buf = make(10, 100, 4, 1)
    assert len(buf) == 0
    assert buf.is_empty()


def test_push_one_record_at_a_time(make):
    buf = make(4, 8, 2, 1)
    for i in range(6):
        buf.push([i, i], [i * 0.25], float(i), i % 3 == 0, i % 5 == 0, [i + 0.5, i + 0.5])
    assert len(buf) == 6 and not buf.is_empty()
    assert buf.info()["hot_size"] == 4 and buf.info()["cold_size"] == 2
    assert_rows_consistent(buf.sample(6, seed=1))
    assert seen_rewards(buf) == set(range(6))


def test_push_keyword_arguments_match_reference_names(make):
    buf = make(4, 8, 2, 1)
    buf.push(obs=[1, 1], action=[0.25], reward=1.0, terminated=False, truncated=False,
             next_obs=[1.5, 1.5])
    assert_rows_consistent(buf.sample(1, seed=0))


def test_sample_keys_shapes_and_dtypes(make):
    buf = make(10, 100, 3, 2)
    buf.push_batch(**transitions(0, 20, obs_dim=3, act_dim=2))
    batch = buf.sample(16, seed=3)
    assert set(batch) == {"obs", "next_obs", "actions", "rewards", "terminated", "truncated"}
    assert batch["obs"].shape == (16, 3) and batch["obs"].dtype == np.float32
    assert batch["next_obs"].shape == (16, 3) and batch["next_obs"].dtype == np.float32
    assert batch["actions"].shape == (16, 2) and batch["actions"].dtype == np.float32
    assert batch["rewards"].shape == (16,) and batch["rewards"].dtype == np.float32
    assert batch["terminated"].shape == (16,) and batch["terminated"].dtype == np.bool_
    assert batch["truncated"].shape == (16,) and batch["truncated"].dtype == np.bool_


def test_push_batch_flat_arrays_like_the_reference(make):
    buf = make(5, 100, 2, 1)
    t = transitions(0, 12)
    buf.push_batch(t["obs"].ravel(), t["next_obs"].ravel(), t["actions"].ravel(),
                   t["rewards"], t["terminated"].astype(np.float32), t["truncated"])
    info = buf.info()
    assert (len(buf), info["hot_size"], info["cold_size"]) == (12, 5, 7)
    assert_rows_consistent(buf.sample(12, seed=2))


def test_oldest_records_are_evicted_first(make):
    buf = make(3, 6, 2, 1)
    buf.push_batch(**transitions(0, 10))
    assert len(buf) == 6
    assert seen_rewards(buf) == {4.0, 5.0, 6.0, 7.0, 8.0, 9.0}


def test_batch_larger_than_total_capacity_keeps_its_tail(make):
    buf = make(2, 5, 2, 1)
    buf.push_batch(**transitions(0, 3))
    buf.push_batch(**transitions(3, 20))
    info = buf.info()
    assert (len(buf), info["pushed"], info["hot_size"], info["cold_size"]) == (5, 23, 2, 3)
    assert seen_rewards(buf) == {18.0, 19.0, 20.0, 21.0, 22.0}


def test_ram_only_buffer_evicts_without_cold_tier(make):
    buf = make(4, 4, 2, 1)
    buf.push_batch(**transitions(0, 9))
    assert len(buf) == 4 and buf.info()["cold_size"] == 0
    assert seen_rewards(buf) == {5.0, 6.0, 7.0, 8.0}


def test_sampling_is_deterministic_for_a_seed(make):
    buf = make(10, 100, 2, 1)
    buf.push_batch(**transitions(0, 40))
    first, second = buf.sample(25, seed=42), buf.sample(25, seed=42)
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])
    assert_rows_consistent(first)


def test_sample_reaches_hot_and_cold(make):
    buf = make(10, 100, 2, 1)
    buf.push_batch(**transitions(0, 20))
    rewards = buf.sample(20, seed=99)["rewards"]
    assert (rewards < 10).any() and (rewards >= 10).any()


def test_unseeded_samples_see_each_push_and_reset_at_once(make):
    """A learner's repeated samples without a seed (which a daemon draws ahead, while the
    learner is busy) show each acknowledged push and reset at once: no evicted record."""
    buf = make(4, 8, 2, 1)
    for start in range(0, 48, 8):
        buf.push_batch(**transitions(start, 8))  # evicts every record held before
        for _ in range(3):
            batch = buf.sample(4)
            assert_rows_consistent(batch)
            assert set(batch["rewards"].tolist()) <= set(range(start, start + 8))
    buf.reset()
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample(1)


def test_sample_results_are_writable_arrays(make):
    buf = make(4, 8, 2, 1)
    buf.push_batch(**transitions(0, 8))
    batch = buf.sample(4, seed=0)
    batch["obs"] /= 2  # in-place normalisation is common in learners
    assert buf.sample(4, seed=0)["obs"][0, 0] == batch["obs"][0, 0] * 2


def test_general_schema_keeps_native_dtypes(make):
    fields = {"frame": ("uint8", (6, 6, 2)), "action": ("int64", ()), "reward": ("float32", ())}
    buf = make(3, 10, fields=fields)
    n = 7
    frames = np.arange(n * 72, dtype=np.uint8).reshape(n, 6, 6, 2)
    buf.push_batch(frame=frames, action=np.arange(n), reward=np.arange(n, dtype=np.float32))
    buf.push(frame=frames[0], action=100, reward=0.5)
    batch = buf.sample(8, seed=4)
    assert set(batch) == {"frame", "action", "reward"}
    assert batch["frame"].dtype == np.uint8 and batch["frame"].shape == (8, 6, 6, 2)
    assert batch["action"].dtype == np.int64
    for frame, action in zip(batch["frame"], batch["action"]):
        np.testing.assert_array_equal(frame, frames[0 if action == 100 else action])


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"obs": np.zeros((4, 3), np.float32)}, millpond.ShapeMismatchError),
        ({"rewards": np.zeros(3, np.float32)}, millpond.ShapeMismatchError),
        ({"actions": np.zeros((4, 2), np.float32)}, millpond.ShapeMismatchError),
        ({"obs": np.array([["a", "b"]] * 4)}, millpond.DTypeMismatchError),
        ({"extra": np.zeros(4)}, millpond.FieldMismatchError),
    ],
    ids=["obs-width", "rewards-length", "action-width", "string-dtype", "unknown-field"],
)
def test_rejected_push_batch_changes_nothing(make, bad, error):
    buf = make(3, 8, 2, 1)
    buf.push_batch(**transitions(0, 6))
    before = snapshot(buf)
    with pytest.raises(error) as info:
        buf.push_batch(**{**transitions(6, 4), **bad})
    assert isinstance(info.value, ValueError)
    assert snapshot(buf) == before


def test_missing_field_is_rejected(make):
    buf = make(3, 8, 2, 1)
    batch = transitions(0, 4)
    del batch["truncated"]
    with pytest.raises(millpond.FieldMismatchError):
        buf.push_batch(**batch)
    assert len(buf) == 0


def test_wrong_record_shape_is_rejected(make):
    buf = make(3, 8, 2, 1)
    with pytest.raises(millpond.ShapeMismatchError):
        buf.push([1, 2, 3], [0.0], 1.0, False, False, [1, 2])
    assert len(buf) == 0


def test_empty_batch_is_accepted_and_stores_nothing(make):
    buf = make(3, 8, 2, 1)
    buf.push_batch(**transitions(0, 0))
    assert len(buf) == 0 and buf.info()["pushed"] == 0


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_invalid_batch_size(make, batch_size):
    buf = make(3, 8, 2, 1)
    buf.push_batch(**transitions(0, 4))
    with pytest.raises(millpond.InvalidBatchSizeError):
        buf.sample(batch_size)


def test_batch_size_larger_than_len(make):
    buf = make(3, 8, 2, 1)
    buf.push_batch(**transitions(0, 4))
    with pytest.raises(millpond.NotEnoughDataError) as info:
        buf.sample(5)
    assert isinstance(info.value, ValueError)


def test_use_after_close_raises_typed_error(make):
    buf = make(3, 8, 2, 1)
    buf.push_batch(**transitions(0, 4))
    buf.close()
    buf.close()  # idempotent
    assert buf.closed
    for call in (lambda: buf.sample(1), lambda: buf.push_batch(**transitions(0, 1)),
                 lambda: buf.push([0, 0], [0], 0.0, False, False, [0, 0]), lambda: len(buf)):
        with pytest.raises(millpond.BufferClosedError):
            call()
