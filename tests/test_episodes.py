"""Episodic buffers in-process: writing, reading, the dataloader, and bad input.

The dataloader is checked against a straightforward model of
memmap-replay-buffer's semantics (loops over episodes and steps) at all
three levels. Transports are covered by test_episodes_remote.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import millpond
from millpond.errors import InvalidArgumentError, NotEnoughDataError

FIELDS = {"state": ("float32", (3,)), "action": ("int64", (2,)), "reward": ("float32", ())}
META = {"task_id": ("int64", ()), "goal": ("float32", (2,))}


def step(episode: int, t: int) -> dict:
    """Self-describing steps: every value says which episode and step it is."""
    return {"state": np.array([episode, t, episode * 100 + t], np.float32),
            "action": np.array([episode, t]), "reward": float(episode * 100 + t)}


@pytest.fixture
def stored():
    """An episodic buffer with 5 complete episodes (lengths 4, 1, 6, 2, 3) and one running."""
    buf = millpond.ReplayBuffer(100, fields=FIELDS, episodes=True, meta_fields=META)
    lengths = [4, 1, 6, 2, 3]
    for e, n in enumerate(lengths):
        with buf.one_episode(task_id=e % 2, goal=[e, -e]):
            for t in range(n):
                buf.store(**step(e, t))
    for t in range(2):  # in progress
        buf.store(**step(9, t))
    yield buf, lengths
    buf.close()


# ---- a model of memmap-replay-buffer's dataloader ------------------------------------------

def model_items(lengths, level, n_steps, tasks, want_task=None):
    """memmap-replay-buffer's items, in order: (episode, t) pairs or episodes."""
    episodes = [e for e in range(len(lengths)) if want_task is None or tasks[e] == want_task]
    if level == "trajectory":
        return episodes
    if level == "timestep":
        return [(e, t) for e in episodes for t in range(lengths[e])]
    return [(e, t) for e in episodes if lengths[e] >= 2 for t in range(lengths[e] - 1)]


def model_n_step(e, t, n, lengths):
    k = min(n, lengths[e] - t - 1)
    seq = [step(e, u)["reward"] for u in range(t, t + k)] + [0.0] * (n - k)
    return {"state": step(e, t)["state"], "next_state": step(e, t + k)["state"],
            "seq_reward": np.array(seq, np.float32), "n_step_lens": k}


def test_dataloader_trajectory_level_matches_memmap_semantics(stored):
    buf, lengths = stored
    loader = buf.dataloader(batch_size=2, return_mask=True)
    batches = list(loader)
    assert len(batches) == len(loader) == 3
    for b, episodes in zip(batches, [[0, 1], [2, 3], [4]]):
        width = max(lengths[e] for e in episodes)
        assert b["state"].shape == (len(episodes), width, 3)
        assert b["_lens"].tolist() == [lengths[e] for e in episodes]
        assert b["_mask"].tolist() == [[t < lengths[e] for t in range(width)] for e in episodes]
        assert b["task_id"].tolist() == [e % 2 for e in episodes]
        assert b["goal"].tolist() == [[e, -e] for e in episodes]
        for row, e in enumerate(episodes):
            for t in range(width):
                want = step(e, t) if t < lengths[e] else {k: 0 for k in FIELDS}
                np.testing.assert_array_equal(b["state"][row, t], want["state"])
                np.testing.assert_array_equal(b["action"][row, t], want["action"])


def test_dataloader_timestep_level_with_filter(stored):
    buf, lengths = stored
    tasks = [e % 2 for e in range(len(lengths))]
    want = model_items(lengths, "timestep", None, tasks, want_task=1)
    loader = buf.dataloader(batch_size=3, timestep_level=True, filter_meta={"task_id": 1},
                            to_named_tuple=("state", "action", "task_id"))
    got = [tuple(a.tolist()) for batch in loader for a in batch.action]
    assert got == want
    assert all((batch.task_id == 1).all() for batch in loader)
    dropped = buf.dataloader(batch_size=3, timestep_level=True, filter_meta={"task_id": 1},
                             drop_last=True)
    assert [len(b["state"]) for b in dropped] == [3] * (len(want) // 3)


def test_dataloader_n_step_level_with_fieldname_map(stored):
    buf, lengths = stored
    items = model_items(lengths, "n_step", 3, None)
    loader = buf.dataloader(batch_size=4, n_steps=3, current_fields=("state",),
                            next_fields=("state",), sequence_fields=("reward",),
                            fieldname_map={"next_state": "next_state", "seq_reward": "seq_reward"},
                            to_named_tuple=("state", "next_state", "seq_reward", "n_step_lens",
                                            "task_id"))
    rows = [(b, i) for b in loader for i in range(len(b.state))]
    assert len(rows) == len(items)
    for (batch, i), (e, t) in zip(rows, items):
        want = model_n_step(e, t, 3, lengths)
        np.testing.assert_array_equal(batch.state[i], want["state"])
        np.testing.assert_array_equal(batch.next_state[i], want["next_state"])
        np.testing.assert_array_equal(batch.seq_reward[i], want["seq_reward"])
        assert batch.n_step_lens[i] == want["n_step_lens"]
        assert batch.task_id[i] == e % 2


def test_dataloader_shuffle_is_a_seeded_permutation(stored):
    buf, lengths = stored
    plain = [tuple(a) for b in buf.dataloader(batch_size=5, timestep_level=True)
             for a in b["action"].tolist()]
    one = [tuple(a) for b in buf.dataloader(batch_size=5, timestep_level=True, shuffle=True,
                                            seed=3) for a in b["action"].tolist()]
    two = [tuple(a) for b in buf.dataloader(batch_size=5, timestep_level=True, shuffle=True,
                                            seed=3) for a in b["action"].tolist()]
    assert one == two and sorted(one) == sorted(plain) and one != plain


def test_dataloader_arguments_are_checked(stored):
    buf, _ = stored
    with pytest.raises(InvalidArgumentError):
        buf.dataloader(batch_size=2, fields=("state",), to_named_tuple=("state",))
    with pytest.raises(InvalidArgumentError):
        buf.dataloader(batch_size=2, n_steps=2, timestep_level=True)
    with pytest.raises(InvalidArgumentError):
        buf.dataloader(batch_size=2, timestep_level=True, return_mask=True)
    with pytest.raises(InvalidArgumentError):
        buf.dataloader(batch_size=2, fields=("nope",))
    with pytest.raises(NotEnoughDataError):
        buf.dataloader(batch_size=2, filter_meta={"task_id": 7})
    with pytest.raises(InvalidArgumentError):
        next(iter(buf.dataloader(batch_size=2, to_named_tuple=("state", "missing"))))


# ---- writing --------------------------------------------------------------------------------

def test_transition_pushes_make_episodes_with_no_change_to_actor_code():
    buf = millpond.ReplayBuffer(50, obs_dim=2, act_dim=1, episodes=True)
    for t in range(7):  # rlox-style: one push per step, terminated ends the episode
        buf.push(np.full(2, t), [0.0], 1.0, t in (2, 5), False, np.full(2, t + 1))
    info = buf.info()
    assert (info["episodes"], info["episodes_in_progress"]) == (2, 1)
    catalog = buf.episode_catalog()
    assert catalog["lens"].tolist() == [3, 3]
    buf.push_batch(np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 1)), np.ones(4),
                   [False, True, False, False], np.zeros(4))
    assert buf.episode_catalog()["lens"].tolist() == [3, 3, 3]  # 6, then 0..1 of the batch


def test_end_episode_right_after_a_flag_gives_that_episode_its_meta():
    buf = millpond.ReplayBuffer(50, obs_dim=1, act_dim=1, episodes=True,
                                meta_fields={"score": "float64"})
    for t in range(3):
        buf.push([t], [0], 1.0, t == 2, False, [t])
    buf.end_episode(score=2.5)
    assert buf.episode_catalog()["score"].tolist() == [2.5]
    buf.end_episode(score=9.0)  # the same episode again: meta updated, nothing else
    assert buf.info()["episodes"] == 1


def test_one_episode_meta_reaches_running_episodes_and_filters(stored):
    buf, _ = stored
    with buf.one_episode(task_id=5) as final:
        for t in range(3):
            buf.store(**step(20, t))
        running = buf.sample_sequences(4, 2, seed=1, filter_meta={"task_id": 5})
        assert (running["task_id"] == 5).all() and (running["action"][:, 0, 0] == 20).all()
        final["goal"] = [1.5, 2.5]
    assert buf.episode_catalog({"task_id": 5})["goal"].tolist() == [[1.5, 2.5]]


def test_an_exception_in_one_episode_leaves_it_unended():
    buf = millpond.ReplayBuffer(50, fields=FIELDS, episodes=True, meta_fields=META)
    with pytest.raises(RuntimeError):
        with buf.one_episode(task_id=1):
            buf.store(**step(0, 0))
            raise RuntimeError("env crashed")
    buf.store(**step(1, 0))
    buf.end_episode()
    catalog = buf.episode_catalog()
    assert catalog["lens"].tolist() == [1] and catalog["task_id"].tolist() == [0]
    assert buf.info()["episodes_in_progress"] == 1


def test_episode_writer_interleaves_sixteen_envs():
    buf = millpond.ReplayBuffer(1000, obs_dim=1, act_dim=1, episodes=True,
                                meta_fields={"env": "int64"})
    with buf.episode_writer(n_envs=16) as writer:
        for t in range(10):
            done = (np.arange(16) + t) % 4 == 3
            writer.append(obs=np.arange(16)[:, None] * 100 + t, next_obs=np.zeros((16, 1)),
                          actions=np.zeros((16, 1)), rewards=np.ones(16), terminated=done,
                          truncated=np.zeros(16, bool))
            for env in np.flatnonzero(done):
                writer.end_episode(int(env), env=int(env))
        writer.append(env=3, obs=[999.0], next_obs=[0.0], actions=[0.0], rewards=1.0,
                      terminated=False, truncated=False)
    catalog = buf.episode_catalog()
    obs = buf.read(catalog["seqs"], ["obs"])["obs"][:, 0]
    start = 0
    for env, n in zip(catalog["env"], catalog["lens"]):  # each episode: one env, steps in order
        steps = obs[start:start + n]
        assert (steps // 100 == env).all() and (np.diff(steps) == 1).all()
        start += n
    assert len(catalog["lens"]) == sum(((np.arange(16) + t) % 4 == 3).sum() for t in range(10))


# ---- reading --------------------------------------------------------------------------------

def test_sequences_never_cross_an_episode_end(stored):
    buf, lengths = stored
    out = buf.sample_sequences(64, 5, seed=0)
    for row in range(64):
        e, t = out["action"][row, 0]
        n = out["lens"][row]
        assert out["start_steps"][row] == t
        assert (out["action"][row, :n, 0] == e).all()
        assert out["action"][row, :n, 1].tolist() == list(range(t, t + n))
        length = lengths[e] if e < len(lengths) else 2
        assert n == min(5, length - t)
        assert not out["state"][row, n:].any() and not out["mask"][row, n:].any()
    assert buf.sample_trajectories(64, 5, seed=0)["lens"].tolist() == out["lens"].tolist()


def test_sample_episodes_returns_whole_complete_episodes(stored):
    buf, lengths = stored
    out = buf.sample_episodes(10, seed=4)
    for row in range(10):
        e = int(out["action"][row, 0, 0])
        assert out["lens"][row] == lengths[e] and out["task_id"][row] == e % 2
        assert out["action"][row, :lengths[e], 1].tolist() == list(range(lengths[e]))
    assert out["state"].shape[1] == max(out["lens"])
    assert buf.sample_episodes(3, seed=4, max_len=2)["state"].shape == (3, 2, 3)


def test_n_step_sample_sums_discounted_rewards():
    buf = millpond.ReplayBuffer(50, obs_dim=1, act_dim=1, episodes=True)
    rewards = [1.0, 2.0, 4.0, 8.0]
    for t, r in enumerate(rewards):
        buf.push([t], [0], r, t == 3, False, [t + 1])
    draws = [buf.sample(4, seed=seed, n_step=2, gamma=0.5) for seed in range(16)]
    out = {key: np.concatenate([d[key] for d in draws]) for key in draws[0]}
    assert set(out["obs"][:, 0].tolist()) == {0, 1, 2, 3}
    for obs, ret, n, nxt, term in zip(out["obs"][:, 0], out["rewards"], out["n_step_lens"],
                                      out["next_obs"][:, 0], out["terminated"]):
        t = int(obs)
        k = min(2, 4 - t)
        assert n == k and nxt == t + k and term == (t + k == 4)
        assert ret == pytest.approx(sum(0.5 ** i * rewards[t + i] for i in range(k)))


def test_a_sampler_prefetches_n_step_and_filtered_samples(stored):
    buf = millpond.ReplayBuffer(50, obs_dim=1, act_dim=1, episodes=True)
    for t in range(8):
        buf.push([t], [0], 1.0, t == 3, False, [t + 1])
    with buf.sampler(4, seed=7, max_batches=3, n_step=3, gamma=0.5) as sampler:
        batches = list(sampler)
    for i, batch in enumerate(batches):  # batch i is sample(seed=7 + i) with the same options
        again = buf.sample(4, seed=7 + i, n_step=3, gamma=0.5)
        assert all((batch[key] == again[key]).all() for key in again)
    episodic, _ = stored
    with episodic.sampler(16, max_batches=2, filter_meta={"task_id": 1}) as sampler:
        assert all(set(b["state"][:, 0] % 2) == {1} for b in sampler)  # episodes 1 and 3


def test_prioritized_sequences_give_weights_and_indices_update_priorities_accepts():
    buf = millpond.PrioritizedReplayBuffer(50, obs_dim=1, act_dim=1, episodes=True)
    for t in range(10):
        buf.push([t], [0], 1.0, t % 5 == 4, False, [t])
    out = buf.sample_sequences(8, 3, seed=0)
    assert out["weights"].shape == (8,) and out["indices"].shape == (8,)
    assert buf.update_priorities(out["indices"], np.full(8, 5.0)) == 8
    assert (buf.sample_sequences(8, 3, seed=0)["weights"] <= 1.0).all()


# ---- bad input changes nothing --------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda b: b.sample_sequences(2, 0),
    lambda b: b.sample_sequences(2, -3),
    lambda b: b.sample_sequences(0, 3),
    lambda b: b.sample(2, n_step=0),
    lambda b: b.sample(2, n_step=2, gamma=1.5),
    lambda b: b.sample_episodes(2, max_len=0),
    lambda b: b.sample(2, filter_meta={"nope": 1}),
    lambda b: b.sample(2, filter_meta={"task_id": "one"}),
    lambda b: b.sample(2, filter_meta={"task_id": 1.5}),
    lambda b: b.sample_sequences(2, 3, filter_meta={"task_id": 42}),
    lambda b: b.end_episode(task_id="x"),
    lambda b: b.end_episode(nope=1),
    lambda b: b.one_episode(goal=[1, 2, 3]).__enter__(),
    lambda b: b.episode_writer(n_envs=0),
    lambda b: b.read([0], ["nope"]),
])
def test_bad_episodic_input_is_a_typed_error_that_changes_nothing(stored, call):
    buf, _ = stored
    before = dict(buf.info())
    catalog = buf.episode_catalog()
    with pytest.raises((InvalidArgumentError, NotEnoughDataError)):
        call(buf)
    after = dict(buf.info())
    assert {k: v for k, v in after.items() if k not in ("samples", "memory_limit")} == \
        {k: v for k, v in before.items() if k not in ("samples", "memory_limit")}
    assert after["samples"] == before["samples"]
    np.testing.assert_array_equal(buf.episode_catalog()["seqs"], catalog["seqs"])


def test_episodic_calls_on_a_plain_buffer_say_what_is_missing():
    buf = millpond.ReplayBuffer(10, obs_dim=1, act_dim=1)
    buf.push([0], [0], 0.0, False, False, [0])
    for call in (lambda: buf.sample_sequences(1, 2), lambda: buf.sample(1, n_step=2),
                 lambda: buf.end_episode(), lambda: buf.episode_catalog(),
                 lambda: buf.dataloader(1)):
        with pytest.raises(InvalidArgumentError, match="episodes=True"):
            call()


@pytest.mark.parametrize("kwargs", [
    dict(meta_fields={"task": "int64"}),  # without episodes=True
    dict(episodes=True, mode="queue"),
    dict(episodes=True, meta_fields={"obs": "int64"}),  # taken by a field
    dict(episodes=True, meta_fields={"mask": "int64"}),  # taken by a sample key
    dict(episodes="yes"),
    dict(episodes=True, meta_fields={"task": "str"}),
])
def test_bad_episodic_configs_are_refused(kwargs):
    with pytest.raises(millpond.InvalidConfigError):
        millpond.ReplayBuffer(10, obs_dim=1, act_dim=1, **kwargs)


def test_non_episodic_buffers_keep_their_memory_cost():
    plain = millpond.ReplayBuffer(1000, obs_dim=4, act_dim=1)
    episodic = millpond.ReplayBuffer(1000, obs_dim=4, act_dim=1, episodes=True,
                                     meta_fields={"task": "int64"})
    assert episodic.info()["memory_needed"] - plain.info()["memory_needed"] == 1000 * (32 + 8)


def test_an_episode_id_reused_after_its_end_keeps_the_counts_right():
    """An id reused after its episode ended (a writer's ids, or a hostile client's)
    starts another episode: nothing is in progress once it ends too. (The ended one left
    the index uncounted: in progress went negative, and a client then refused the
    daemon's info as impossible.)"""
    from millpond.core import BufferConfig, Schema, TieredBuffer

    buf = TieredBuffer(BufferConfig(Schema.transition(2, 1), 100, 100, episodes=True))
    for k in range(3):
        steps = {"obs": np.zeros((5, 2), np.float32), "next_obs": np.zeros((5, 2), np.float32),
                 "actions": np.zeros((5, 1), np.float32), "rewards": np.zeros(5, np.float32),
                 "terminated": np.arange(5) == 4, "truncated": np.zeros(5, bool)}
        buf.push_batch(steps, episodes=np.full(5, 7))
        assert (buf.info().episodes, buf.info().episodes_in_progress) == (k + 1, 0)
