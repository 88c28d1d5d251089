"""Frames stored once (``frame_stack``, ``next_of``: millpond.core.frames).

The same pushes into a plain buffer and into one with the options give the same samples,
reads and contents, across eviction, tiers, prioritized and episodic draws, reopen and a
real daemon; stacks whose frames do not line up come back exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import millpond
from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig
from millpond.wire.codec import config_from_proto, config_to_proto

OPTIONS = {"frame_stack": {"obs": 0}, "next_of": {"next_obs": "obs"}}
TRANSITION = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")


@pytest.fixture(scope="session")
def atari():
    """A few thousand real Atari steps, recorded once per session: Pong with gymnasium's
    padding (the first frame repeated), Breakout with SB3's (zero frames)."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    import atari_frames
    return {"Pong": atari_frames.record("Pong", 2000, seed=1, padding="reset", max_steps=300),
            "Breakout": atari_frames.record("Breakout", 1500, seed=2, padding="zero",
                                            max_steps=200)}


def columns(data, lo, hi, names=TRANSITION):
    return {name: data[name][lo:hi] for name in names}


def fields_of(data, names=TRANSITION):
    return {name: (data[name].dtype.str, data[name].shape[1:]) for name in names}


def same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def push_both(buffers, data, batch=32, episodes=False):
    n = len(data["obs"])
    for lo in range(0, n, batch):
        for buf in buffers:
            if not isinstance(buf, TieredBuffer):  # a handle: its thread's episodes
                buf.push_batch(**columns(data, lo, lo + batch))
                continue
            kw = {"episodes": data["episode"][lo:lo + batch]} if episodes else {}
            buf.push_batch(columns(data, lo, lo + batch), **kw)


def compare(plain, framed, seeds=range(3), n_step=False):
    for seed in seeds:
        same(plain.sample(32, seed), framed.sample(32, seed))
        if n_step:
            if plain.schema.is_transition:
                same(plain.sample(16, seed, n_step=3, gamma=0.9),
                     framed.sample(16, seed, n_step=3, gamma=0.9))
            same(plain.sample_sequences(4, 8, seed), framed.sample_sequences(4, 8, seed))
    seqs = np.arange(plain.pushed - 40, plain.pushed + 3)  # some evicted, some not pushed
    same(plain.read(seqs), framed.read(seqs))
    same(plain.contents(), framed.contents())


KINDS = {
    "ram": dict(capacity=700),
    "tiered": dict(hot_capacity=200, total_capacity=700),
    "prioritized": dict(hot_capacity=200, total_capacity=700, prioritized=True),
    "episodes": dict(capacity=700, episodes=True),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("game", ["Pong", "Breakout"])
def test_atari_pushes_read_back_as_a_plain_buffer_does(atari, tmp_path, game, kind):
    data = atari[game]
    config = dict(KINDS[kind], fields=fields_of(data))
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "plain")
    framed = TieredBuffer(BufferConfig.build(**config, **OPTIONS), tmp_path / "framed")
    push_both([plain, framed], data, episodes=kind == "episodes")
    compare(plain, framed, n_step=kind == "episodes")
    info = framed.info()
    assert info.logical_bytes == plain.info().stored_bytes == 700 * plain.schema.record_nbytes
    assert info.stored_bytes * 7.5 <= info.logical_bytes, info.stored_bytes
    plain.close()
    framed.close()


def test_atari_reopen_and_eviction_after_it(atari, tmp_path):
    data = atari["Pong"]
    config = dict(hot_capacity=150, total_capacity=500, fields=fields_of(data), episodes=True)
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "p.buffer", persistent=True)
    framed = TieredBuffer(BufferConfig.build(**config, **OPTIONS), tmp_path / "f.buffer",
                          persistent=True)
    half = {key: value[:1000] for key, value in data.items()}
    rest = {key: value[1000:] for key, value in data.items()}
    push_both([plain, framed], half, episodes=True)
    plain.release()
    framed.release()
    plain, framed = TieredBuffer.open(tmp_path / "p.buffer"), TieredBuffer.open(tmp_path / "f.buffer")
    assert framed.config.frame_stack == (("obs", 0),)
    assert framed.config.next_of == (("next_obs", "obs"),)
    compare(plain, framed, n_step=True)
    push_both([plain, framed], rest, batch=50, episodes=True)  # evicts what was reopened
    compare(plain, framed, n_step=True)
    assert framed.info().stored_bytes * 7.5 <= framed.info().logical_bytes
    plain.close()
    framed.close()


def test_a_version_5_file_still_opens_and_frame_files_are_version_6(tmp_path):
    fields = {"obs": ("uint8", (2, 3)), "next_obs": ("uint8", (2, 3))}
    plain = millpond.MmapReplayBuffer(4, 8, fields=fields, cold_path=tmp_path / "p", persistent=True)
    framed = millpond.MmapReplayBuffer(4, 8, fields=fields, cold_path=tmp_path / "f",
                                       persistent=True, **OPTIONS)
    for buf in (plain, framed):
        buf.push_batch(obs=np.ones((3, 2, 3), np.uint8), next_obs=np.ones((3, 2, 3), np.uint8))
        buf.release()
    assert (tmp_path / "p").read_bytes()[8] == 5 and (tmp_path / "f").read_bytes()[8] == 6
    assert len(millpond.MmapReplayBuffer.open(tmp_path / "p")) == 3
    assert len(millpond.MmapReplayBuffer.open(tmp_path / "f")) == 3


# ---- stacks whose frames do not line up -----------------------------------------------------

def synthetic(rng, steps, k=4, shape=(3, 5), writers=3, padding="reset", reset_p=0.1):
    """Transitions of ``writers`` interleaved episodes of frame stacks (axis 0) with random
    resets, padded at each episode's start by repeating its first frame ("reset"), with
    zero frames ("zero") or with random frames ("noise": nothing lines up)."""
    def fresh():
        first = rng.integers(0, 256, shape, np.uint8)
        pad = {"reset": first, "zero": np.zeros(shape, np.uint8)}.get(padding)
        return [pad if pad is not None else rng.integers(0, 256, shape, np.uint8)
                for _ in range(k - 1)] + [first]

    stacks = [fresh() for _ in range(writers)]
    out = {name: [] for name in ("obs", "next_obs", "terminated", "episode")}
    episode_ids = list(range(writers))
    next_id = writers
    for _ in range(steps):
        w = int(rng.integers(writers))
        frames = stacks[w]
        new = rng.integers(0, 4, shape, np.uint8)  # few values: equal frames happen by chance
        nxt = frames[1:] + [new]
        end = bool(rng.random() < reset_p)
        out["obs"].append(np.stack(frames))
        out["next_obs"].append(np.stack(nxt))
        out["terminated"].append(end)
        out["episode"].append(episode_ids[w])
        if end:
            stacks[w] = fresh()
            episode_ids[w], next_id = next_id, next_id + 1
        else:
            stacks[w] = nxt
    return {name: np.array(values) for name, values in out.items()}


@pytest.mark.parametrize("padding", ["reset", "zero", "noise"])
@pytest.mark.parametrize("axis", [0, 2])
def test_misaligned_stacks_come_back_exactly(tmp_path, padding, axis):
    rng = np.random.default_rng(7)
    data = synthetic(rng, 600, padding=padding)
    if axis:
        data["obs"], data["next_obs"] = (np.moveaxis(data[name], 1, 1 + axis)
                                         for name in ("obs", "next_obs"))
    names = ("obs", "next_obs", "terminated")
    fields = fields_of(data, names)
    plain = TieredBuffer(BufferConfig.build(hot_capacity=50, total_capacity=200, fields=fields),
                         tmp_path / "p")
    framed = TieredBuffer(BufferConfig.build(
        hot_capacity=50, total_capacity=200, fields=fields, frame_stack={"obs": axis},
        next_of={"next_obs": "obs"}, frame_capacity=(200 + 17) * 8), tmp_path / "f")
    for lo in range(0, 600, 17):
        for buf in (plain, framed):
            buf.push_batch(columns(data, lo, lo + 17, names))
        same(plain.contents(), framed.contents())
    compare(plain, framed)


def test_next_of_alone_and_a_stack_without_next_of():
    rng = np.random.default_rng(3)
    states = rng.normal(size=(301, 5)).astype(np.float32)
    states[100] = -0.0  # equal as floats to 0.0, not as bytes: kept apart
    states[101] = 0.0
    states[150:153] = np.nan
    nxt = states[1:].copy()
    nxt[::10] = rng.normal(size=(30, 5))  # where next_obs is not the next obs
    data = {"obs": states[:-1], "next_obs": nxt}
    fields = fields_of(data, ("obs", "next_obs"))
    plain = TieredBuffer(BufferConfig.build(capacity=120, fields=fields))
    framed = TieredBuffer(BufferConfig.build(capacity=120, fields=fields,
                                             next_of={"next_obs": "obs"}))
    stacked = TieredBuffer(BufferConfig.build(capacity=120, fields=fields,
                                              frame_stack={"obs": 0},
                                              frame_capacity=(120 + 13) * 10))
    for lo in range(0, 300, 13):
        for buf in (plain, framed, stacked):
            buf.push_batch(columns(data, lo, lo + 13, ("obs", "next_obs")))
    for buf in (framed, stacked):
        got, want = buf.contents(), plain.contents()
        for name in want:
            assert got[name].tobytes() == want[name].tobytes()
    assert framed.info().stored_bytes < plain.info().stored_bytes


def test_n_step_of_a_transition_schema_with_next_of(tmp_path):
    rng = np.random.default_rng(5)
    states = rng.normal(size=(401, 16)).astype(np.float32)
    data = {"obs": states[:-1], "next_obs": states[1:].copy(),
            "actions": rng.normal(size=(400, 2)).astype(np.float32),
            "rewards": rng.normal(size=400).astype(np.float32),
            "terminated": rng.random(400) < 0.05, "truncated": np.zeros(400, bool),
            "episode": np.zeros(400, np.int64)}
    data["episode"] = np.cumsum(np.r_[False, data["terminated"][:-1]])
    ends = np.flatnonzero(data["terminated"])
    data["next_obs"][ends] = rng.normal(size=(len(ends), 16))  # final observations
    config = dict(hot_capacity=40, total_capacity=150, obs_dim=16, act_dim=2, episodes=True)
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "p", persistent=True)
    framed = TieredBuffer(BufferConfig.build(**config, next_of={"next_obs": "obs"}),
                          tmp_path / "f", persistent=True)
    push_both([plain, framed], data, batch=7, episodes=True)
    compare(plain, framed, n_step=True)
    assert framed.info().stored_bytes < plain.info().stored_bytes
    plain.release()
    framed.release()
    plain, framed = TieredBuffer.open(tmp_path / "p"), TieredBuffer.open(tmp_path / "f")
    compare(plain, framed, n_step=True)


def test_a_push_that_does_not_fit_the_frame_store_changes_nothing():
    rng = np.random.default_rng(0)
    fields = {"obs": ("uint8", (4, 8)), "next_obs": ("uint8", (4, 8))}
    buf = TieredBuffer(BufferConfig.build(capacity=10, fields=fields, frame_capacity=40,
                                          **OPTIONS))
    noise = {name: rng.integers(0, 256, (5, 4, 8), np.uint8) for name in fields}
    buf.push_batch(noise)  # 40 frames: full
    before = buf.contents()
    with pytest.raises(millpond.StorageFullError, match="frame_capacity"):
        buf.push_batch({name: value[:1] + 1 for name, value in noise.items()})
    same(before, buf.contents())
    assert buf.pushed == 5


def test_config_checks_and_round_trips():
    fields = {"obs": ("uint8", (4, 8)), "next_obs": ("uint8", (4, 8)), "a": ("int64", ())}
    config = BufferConfig.build(capacity=10, fields=fields, **OPTIONS)
    assert config_from_proto(config_to_proto(config)) == config
    assert config.frame_capacity == BufferConfig.build(capacity=10, fields=fields, **OPTIONS,
                                                       frame_capacity=None).frame_capacity
    assert BufferConfig.build(capacity=10, fields=fields).stored_schema == \
        BufferConfig.build(capacity=10, fields=fields).schema
    for bad in [dict(frame_stack={"nope": 0}), dict(frame_stack={"obs": 2}),
                dict(next_of={"next_obs": "a"}), dict(next_of={"obs": "obs"}),
                dict(frame_stack={"obs": 0, "next_obs": 0}, next_of={"next_obs": "obs"}),
                dict(frame_capacity=5), dict(frame_stack={"obs": 0}, frame_capacity=0),
                dict(frame_stack={"obs": True})]:
        with pytest.raises(millpond.InvalidConfigError):
            BufferConfig.build(capacity=10, fields=fields, **bad)


def test_toml_declares_frame_options(tmp_path):
    from millpond_server.declared import load_buffers

    path = tmp_path / "buffers.toml"
    path.write_text('[[buffers]]\nname = "px"\ncapacity = 100\nframe_stack = { obs = 0 }\n'
                    'next_of = { next_obs = "obs" }\n'
                    '[buffers.fields]\nobs = { dtype = "uint8", shape = [4, 8] }\n'
                    'next_obs = { dtype = "uint8", shape = [4, 8] }\n')
    (spec,) = load_buffers(path)
    assert spec.config.frame_stack == (("obs", 0),)
    assert spec.config.next_of == (("next_obs", "obs"),)


# ---- a property: a model of episodes with random resets -------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), padding=st.sampled_from(["reset", "zero", "noise"]),
       writers=st.integers(1, 4), reset_p=st.floats(0, 0.5), capacity=st.integers(1, 40),
       batches=st.lists(st.integers(0, 12), min_size=1, max_size=25))
def test_contents_match_a_model_of_episodes(seed, padding, writers, reset_p, capacity, batches):
    rng = np.random.default_rng(seed)
    data = synthetic(rng, max(1, sum(batches)), k=3, shape=(2, 3), writers=writers, padding=padding,
                     reset_p=reset_p)
    buf = TieredBuffer(BufferConfig.build(capacity=capacity, fields=fields_of(
        data, ("obs", "next_obs")), **OPTIONS, frame_capacity=(capacity + 12) * 6))
    model: list[tuple[np.ndarray, np.ndarray]] = []
    lo = 0
    for n in batches:
        buf.push_batch(columns(data, lo, lo + n, ("obs", "next_obs")))
        model += list(zip(data["obs"][lo:lo + n], data["next_obs"][lo:lo + n]))
        lo += n
        model = model[-capacity:]
        got = buf.contents()
        assert len(got["obs"]) == len(model)
        for i, (obs, nxt) in enumerate(model):
            np.testing.assert_array_equal(got["obs"][i], obs)
            np.testing.assert_array_equal(got["next_obs"][i], nxt)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), writers=st.integers(1, 5), k=st.integers(1, 4),
       padding=st.sampled_from(["reset", "zero", "noise"]), reset_p=st.floats(0, 0.3),
       pattern=st.sampled_from(["steps", "runs"]), capacity=st.integers(1, 40),
       sizes=st.lists(st.integers(1, 12), min_size=1, max_size=20))
def test_streams_stepping_together_or_in_runs_match_a_model(seed, writers, k, padding, reset_p,
                                                           pattern, capacity, sizes):
    """Pushes as vectorized environments make them (a step of every stream per push, some
    streams skipping a step) or as actors do (a run of one stream's steps per push):
    where records continue one another the ids follow without lookups, and the contents
    are still exactly what was pushed."""
    rng = np.random.default_rng(seed)
    streams = [synthetic(rng, 60, k=k, shape=(2, 3), writers=1, padding=padding,
                         reset_p=reset_p) for _ in range(writers)]
    at = [0] * writers
    buf = TieredBuffer(BufferConfig.build(capacity=capacity, fields=fields_of(
        streams[0], ("obs", "next_obs")), **OPTIONS, frame_capacity=(capacity + 60) * 2 * k))
    model: list[tuple[np.ndarray, np.ndarray]] = []
    for size in sizes:
        if pattern == "steps":  # a step of each stream, but those that skip it
            rows = [(w, at[w]) for w in range(writers) if rng.random() < 0.9 and at[w] < 60]
            for w, _ in rows:
                at[w] += 1
        else:
            w = int(rng.integers(writers))
            rows = [(w, t) for t in range(at[w], min(at[w] + size, 60))]
            at[w] += len(rows)
        if not rows:
            continue
        batch = {name: np.array([streams[w][name][t] for w, t in rows]).reshape(
            (len(rows),) + streams[0][name].shape[1:]) for name in ("obs", "next_obs")}
        buf.push_batch(batch)
        model = (model + list(zip(batch["obs"], batch["next_obs"])))[-capacity:]
        got = buf.contents()
        assert len(got["obs"]) == len(model)
        for i, (obs, nxt) in enumerate(model):
            np.testing.assert_array_equal(got["obs"][i], obs)
            np.testing.assert_array_equal(got["next_obs"][i], nxt)


# ---- through a daemon ----------------------------------------------------------------------

@pytest.mark.daemon
def test_a_daemon_serves_frame_buffers_as_plain_ones(atari, server):
    data = {key: value[:800] for key, value in atari["Breakout"].items()}
    with millpond.connect(server.address) as client:
        kw = dict(hot_capacity=150, total_capacity=500, fields=fields_of(data), episodes=True)
        plain = client.create_buffer("plain", **kw)
        framed = client.create_buffer("framed", **kw, **OPTIONS)
        push_both([plain, framed], data, episodes=True)
        for seed in range(2):
            same(plain.sample(32, seed), framed.sample(32, seed))
            a, b = plain.sample_sequences(4, 6, seed), framed.sample_sequences(4, 6, seed)
            del a["episode_ids"], b["episode_ids"]  # each handle's writer draws its own ids
            same(a, b)
        seqs = np.arange(250, 520)
        same(plain.read(seqs), framed.read(seqs))
        info = framed.info()
        assert info.config.frame_stack == (("obs", 0),)
        assert info.stored_bytes * 7.5 <= info.logical_bytes
        assert client.create_buffer("framed", **kw, **OPTIONS).info().size == 500
