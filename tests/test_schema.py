"""General schemas (``fields=``): native dtypes, input conversion rules, rejections.

Every rejection is checked to leave the buffer unchanged: same ``len``, same
``info()``, and the same seeded samples (a seeded sample is deterministic for
the same contents, so equal samples before and after mean equal contents).
"""

from __future__ import annotations

import numpy as np
import pytest
from support import without_stats

import millpond

ATARI = {"obs": ("uint8", (84, 84, 4)), "action": ("int64", ()), "reward": ("float32", ())}
SMALL = {"x": ("float32", (3,)), "n": ("int16", ()), "u": ("uint8", ()), "flag": ("bool", ())}


@pytest.fixture(params=["mmap", "ram"])
def make(request, tmp_path):
    """Build a buffer with a schema, as MmapReplayBuffer (hot 4 + cold 6) or ReplayBuffer."""
    made = []

    def build(fields, **kw):
        if request.param == "mmap":
            buf = millpond.MmapReplayBuffer(4, 10, cold_path=str(tmp_path / "c.bin"), fields=fields, **kw)
        else:
            buf = millpond.ReplayBuffer(10, fields=fields, **kw)
        made.append(buf)
        return buf

    yield build
    for b in made:
        b.close()


def small_batch(start: int, n: int) -> dict:
    i = np.arange(start, start + n)
    return {
        "x": np.stack([i, i + 0.5, -i], axis=1).astype(np.float32),
        "n": (i * 7 - 300).astype(np.int16),
        "u": (i % 256).astype(np.uint8),
        "flag": i % 2 == 1,
    }


def draw(buf, rounds: int = 10) -> dict:
    """Many seeded full-size samples, concatenated (sample draws at most len rows)."""
    parts = [buf.sample(len(buf), seed) for seed in range(rounds)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def state(buf) -> tuple:
    """What a user can observe: len, info and seeded samples (full-size)."""
    size = len(buf)
    samples = []
    if size:
        for seed in (0, 1, 2):
            s = buf.sample(size, seed)
            samples.append({k: v.tolist() for k, v in s.items()})
    return size, without_stats(buf.info()), samples


@pytest.fixture
def filled(make):
    """A SMALL-schema buffer holding 7 records (hot and cold for the mmap variant)."""
    buf = make(SMALL)
    buf.push_batch(**small_batch(0, 7))
    return buf


# ---- native dtypes ---------------------------------------------------------


def test_atari_frames_stay_uint8(make):
    buf = make(ATARI)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(9, 84, 84, 4), dtype=np.uint8)
    for i in range(3):
        buf.push(obs=frames[i], action=i, reward=float(i))
    buf.push_batch(obs=frames[3:9], action=np.arange(3, 9), reward=np.arange(3, 9, dtype=np.float32))
    assert len(buf) == 9
    batch = draw(buf, 4)
    assert set(batch) == {"obs", "action", "reward"}
    assert batch["obs"].dtype == np.uint8 and batch["obs"].shape == (36, 84, 84, 4)
    assert batch["action"].dtype == np.int64 and batch["action"].shape == (36,)
    assert batch["reward"].dtype == np.float32 and batch["reward"].shape == (36,)
    # Frames come back bit-exact with their own action (hot and cold rows).
    for row in range(36):
        a = int(batch["action"][row])
        assert batch["reward"][row] == a
        np.testing.assert_array_equal(batch["obs"][row], frames[a])


def test_atari_schema_record_nbytes_is_native(make):
    buf = make(ATARI)
    assert buf.info()["record_nbytes"] == 84 * 84 * 4 + 8 + 4  # uint8 frames, not float32
    assert buf.schema["obs"].dtype == np.uint8


def test_flat_input_accepted_for_schema_fields(make):
    buf = make(SMALL)
    cols = small_batch(0, 5)
    cols["x"] = cols["x"].reshape(-1)  # [n*3]
    buf.push_batch(**cols)
    batch = buf.sample(5, seed=0)
    assert batch["x"].shape == (5, 3)
    np.testing.assert_array_equal(batch["x"][:, 2], -batch["x"][:, 0])


def test_push_record_accepts_flat_and_shaped_values(make):
    buf = make({"img": ("uint8", (2, 3)), "r": ("float32", ())})
    buf.push(img=np.arange(6, dtype=np.uint8).reshape(2, 3), r=1.0)
    buf.push(img=np.arange(6, dtype=np.uint8), r=np.float32(2.0))  # flat [6]
    batch = buf.sample(2, seed=0)
    for row in range(2):
        np.testing.assert_array_equal(batch["img"][row], np.arange(6).reshape(2, 3))


def test_transition_flat_and_2d_inputs_are_equivalent(tmp_path):
    a = millpond.MmapReplayBuffer(2, 5, 3, 2, str(tmp_path / "a"))
    b = millpond.MmapReplayBuffer(2, 5, 3, 2, str(tmp_path / "b"))
    try:
        obs = np.arange(12, dtype=np.float32).reshape(4, 3)
        act = np.arange(8, dtype=np.float32).reshape(4, 2)
        rew, term, trunc = np.arange(4.0), np.zeros(4), np.zeros(4)
        a.push_batch(obs, obs + 1, act, rew, term, trunc)
        b.push_batch(obs.reshape(-1), (obs + 1).reshape(-1), act.reshape(-1), rew, term, trunc)
        sa, sb = draw(a), draw(b)
        for key in sa:
            np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([0.0, 1.0, 2.5, -1.0], [False, True, True, True]),
        ([False, True, False, True], [False, True, False, True]),
        ([0, 3, 0, 1], [False, True, False, True]),
        (np.array([0, 1, 0, 0], np.uint8), [False, True, False, False]),
    ],
)
def test_terminated_truncated_nonzero_is_true(flags, expected):
    buf = millpond.ReplayBuffer(8, 1, 1)
    try:
        rewards = np.arange(4, dtype=np.float32)
        buf.push_batch(np.zeros(4), np.zeros(4), np.zeros(4), rewards, flags, flags[::-1])
        batch = draw(buf, 16)
        assert batch["terminated"].dtype == np.bool_
        idx = batch["rewards"].astype(int)
        np.testing.assert_array_equal(batch["terminated"], np.array(expected)[idx])
        np.testing.assert_array_equal(batch["truncated"], np.array(expected[::-1])[idx])
    finally:
        buf.close()


# ---- conversion rules -------------------------------------------------------


def test_ints_into_float_field_ok(make):
    buf = make({"v": ("float32", (2,))})
    buf.push_batch(v=np.array([[1, 2], [3, 4]], np.int64))
    buf.push(v=[5, 6])  # Python ints
    batch = draw(buf)
    assert batch["v"].dtype == np.float32
    assert set(map(tuple, batch["v"].tolist())) <= {(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)}


def test_float64_into_float32_ok(make):
    buf = make({"v": ("float32", ())})
    buf.push_batch(v=np.array([0.25, 1.5], np.float64))
    batch = draw(buf)
    assert batch["v"].dtype == np.float32
    assert set(batch["v"].tolist()) <= {0.25, 1.5}


def test_in_range_ints_into_uint8_ok(make):
    buf = make({"p": ("uint8", ())})
    buf.push_batch(p=np.array([0, 17, 255], np.int64))
    buf.push(p=200)
    batch = draw(buf)
    assert batch["p"].dtype == np.uint8
    assert set(batch["p"].tolist()) == {0, 17, 255, 200}


def test_bools_into_int_field_ok(make):
    buf = make({"k": ("int8", ())})
    buf.push_batch(k=np.array([True, False]))
    assert set(draw(buf)["k"].tolist()) == {0, 1}


@pytest.mark.parametrize(
    "column",
    [
        np.array([1.0, 2.0, 3.0]),  # floats, even integral ones
        np.array([1.5, 2.0, 3.0], np.float32),
        np.array([0, 256, 1], np.int64),  # out of range for uint8
        np.array([0, -1, 1], np.int16),
        np.array([0, 1, 2**40], np.uint64),
    ],
)
def test_lossy_conversions_into_uint8_rejected(filled, column):
    before = state(filled)
    cols = small_batch(7, 3)
    cols["u"] = column
    with pytest.raises(millpond.DTypeMismatchError) as excinfo:
        filled.push_batch(**cols)
    assert isinstance(excinfo.value, ValueError)
    assert state(filled) == before


def test_float_into_int_field_rejected_in_push(filled):
    before = state(filled)
    rec = {k: v[0] for k, v in small_batch(7, 1).items()}
    with pytest.raises(millpond.DTypeMismatchError):
        filled.push(**{**rec, "n": 3.0})
    with pytest.raises(millpond.DTypeMismatchError):
        filled.push(**{**rec, "u": 300})
    assert state(filled) == before


@pytest.mark.parametrize(
    "value",
    [
        np.array(["a", "b", "c"]),
        np.array([1, None, 2], dtype=object),
        np.array([1, 2, 3], dtype=object),  # even numbers, boxed as objects
        ["x", "y", "z"],
        np.array([1 + 0j, 2, 3]),  # complex is not storable either
    ],
)
def test_object_and_string_arrays_rejected(filled, value):
    before = state(filled)
    cols = small_batch(7, 3)
    cols["n"] = value
    with pytest.raises(millpond.DTypeMismatchError):
        filled.push_batch(**cols)
    assert state(filled) == before


# ---- field and shape mismatches ----------------------------------------------


def test_missing_field_rejected(filled):
    before = state(filled)
    cols = small_batch(7, 2)
    del cols["flag"]
    with pytest.raises(millpond.FieldMismatchError):
        filled.push_batch(**cols)
    rec = {k: v[0] for k, v in cols.items()}
    with pytest.raises(millpond.FieldMismatchError):
        filled.push(**rec)
    assert state(filled) == before


def test_extra_field_rejected(filled):
    before = state(filled)
    cols = small_batch(7, 2)
    with pytest.raises(millpond.FieldMismatchError):
        filled.push_batch(**cols, bonus=np.zeros(2))
    rec = {k: v[0] for k, v in cols.items()}
    with pytest.raises(millpond.FieldMismatchError):
        filled.push(**rec, bonus=1.0)
    assert state(filled) == before


def test_fields_disagreeing_on_n_rejected(filled):
    before = state(filled)
    cols = small_batch(7, 3)
    cols["flag"] = cols["flag"][:2]
    with pytest.raises(millpond.ShapeMismatchError):
        filled.push_batch(**cols)
    cols = small_batch(7, 3)
    cols["x"] = cols["x"].reshape(-1)[:-3]  # flat, but only 2 records' worth
    with pytest.raises(millpond.ShapeMismatchError):
        filled.push_batch(**cols)
    assert state(filled) == before


@pytest.mark.parametrize(
    "x",
    [
        np.zeros((3, 4), np.float32),  # wrong per-record shape
        np.zeros((3, 3, 1), np.float32),  # extra axis
        np.zeros(10, np.float32),  # flat but not a multiple of 3
        np.float32(1.0),  # a scalar for a batch
    ],
)
def test_wrong_record_shape_rejected(filled, x):
    before = state(filled)
    cols = small_batch(7, 3)
    cols["x"] = x
    with pytest.raises(millpond.ShapeMismatchError):
        filled.push_batch(**cols)
    assert state(filled) == before


def test_push_wrong_shape_rejected(filled):
    before = state(filled)
    rec = {k: v[0] for k, v in small_batch(7, 1).items()}
    with pytest.raises(millpond.ShapeMismatchError):
        filled.push(**{**rec, "x": np.zeros(4, np.float32)})
    with pytest.raises(millpond.ShapeMismatchError):
        filled.push(**{**rec, "n": np.array([1, 2], np.int16)})
    assert state(filled) == before


def test_empty_batch_accepted_and_changes_nothing(filled):
    before = state(filled)
    filled.push_batch(**small_batch(7, 0))
    assert state(filled) == before


# ---- invalid schemas ---------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"x": ("notadtype", ())},
        {"x": ("object", ())},
        {"x": ("U4", ())},
        {"x": ("complex64", ())},
        {"x": ("datetime64[s]", ())},
        {"x": ("float32", (0,))},
        {"x": ("float32", (3, 0))},
        {"x": ("float32", (-1,))},
        {"x": ("float32", ("a",))},
        {"x": ("float32", (2.5,))},  # not silently truncated to 2
        {"x": ("float32", 2.7)},
        {"x": ("float32", ("3",))},
        {"x": ("float32", (True,))},
        {"my field": ("float32", ())},
        {"1x": ("float32", ())},
        {"": ("float32", ())},
        {"x": "float32"},  # not a (dtype, shape) pair
        {},  # no fields at all
    ],
)
@pytest.mark.parametrize("cls", ["mmap", "ram"])
def test_invalid_schema_rejected(tmp_path, fields, cls):
    path = tmp_path / "c.bin"
    with pytest.raises(millpond.InvalidConfigError) as excinfo:
        if cls == "mmap":
            millpond.MmapReplayBuffer(4, 10, cold_path=str(path), fields=fields)
        else:
            millpond.ReplayBuffer(10, fields=fields)
    assert isinstance(excinfo.value, ValueError)
    assert not path.exists()


def test_fields_and_dims_together_rejected(tmp_path):
    with pytest.raises(millpond.InvalidConfigError):
        millpond.MmapReplayBuffer(4, 10, 3, 1, str(tmp_path / "c"), fields=SMALL)
    with pytest.raises(millpond.InvalidConfigError):
        millpond.ReplayBuffer(10, 3, fields=SMALL)
    with pytest.raises(millpond.InvalidConfigError):
        millpond.ReplayBuffer(10, act_dim=1, fields=SMALL)
    with pytest.raises(millpond.InvalidConfigError):
        millpond.ReplayBuffer(10)  # neither
    assert not (tmp_path / "c").exists()


def test_schema_dims_accept_numpy_ints_and_bare_int():
    schema = millpond.Schema.from_spec({"x": ("float32", (np.int64(2), 3)), "y": ("uint8", 4)})
    assert schema["x"].shape == (2, 3) and schema["y"].shape == (4,)


def test_schema_spec_round_trips():
    schema = millpond.Schema.from_spec(ATARI)
    assert millpond.Schema.from_spec(schema.spec()) == schema
    assert schema.names == ("obs", "action", "reward")
    assert not schema.is_transition
    assert millpond.Schema.transition(4, 1).is_transition
