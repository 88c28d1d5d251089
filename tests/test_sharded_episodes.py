"""Episodic buffers over three real daemons: every episode stays on its writer's shard,
and windows, n-step transitions, episodes, the catalog and reads span the shards."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support import ServerProcess, start_all

import millpond

pytestmark = pytest.mark.daemon

META = {"task": ("int64", ())}
_names = itertools.count()


def steps(writer: int, episode: int, length: int) -> dict:
    """Self-describing steps: obs = (writer, episode, step), reward = step; the last ends."""
    t = np.arange(length)
    obs = np.stack([np.full(length, writer), np.full(length, episode), t], axis=1)
    return dict(obs=obs.astype(np.float32), next_obs=(obs + [0, 0, 1]).astype(np.float32),
                actions=np.zeros((length, 1), np.float32), rewards=t.astype(np.float32),
                terminated=t == length - 1, truncated=np.zeros(length, bool))


def filled(shards, lengths: dict[int, list[int]], timeout: float = 10, **kwargs):
    """A sharded episodic buffer, and one handle per shard that wrote episodes of
    ``lengths[writer]`` (writer = the handle's shard; task meta = writer)."""
    client = millpond.connect(shards, timeout=timeout)
    name = f"episodes-{next(_names)}"
    client.create_buffer(name, obs_dim=3, act_dim=1, episodes=True, meta_fields=META,
                         **(kwargs or {"capacity": 600})).release()
    handles = sorted((client.buffer(name) for _ in shards), key=lambda h: h.backend.shard)
    assert [h.backend.shard for h in handles] == list(range(len(shards)))
    for writer, handle in enumerate(handles):
        for episode, length in enumerate(lengths.get(writer, [])):
            with handle.one_episode(task=writer):
                handle.push_batch(**steps(writer, episode, length))
    return handles[0], name


def test_each_episode_stays_on_its_writers_shard_and_the_catalog_spans_them(shards):
    lengths = {0: [3, 5], 1: [4], 2: [2, 2, 6]}
    buf, name = filled(shards, lengths)
    for shard, address in enumerate(shards):  # each shard alone holds whole episodes
        alone = millpond.connect(address).buffer(name).episode_catalog()
        assert list(alone["lens"]) == lengths[shard]
        assert set(alone["task"]) == {shard}
    catalog = buf.episode_catalog()
    assert list(catalog["lens"]) == [3, 5, 4, 2, 2, 6]
    rows = buf.read(catalog["seqs"])
    assert rows["live"].all()
    expected = np.concatenate([steps(w, e, n)["obs"] for w, ls in lengths.items()
                               for e, n in enumerate(ls)])
    assert (rows["obs"] == expected).all()
    assert list(buf.episode_catalog(filter_meta={"task": 2})["lens"]) == [2, 2, 6]
    assert buf.info().episodes == 6


def test_an_episode_writer_sticks_to_its_handles_shard(shards):
    buf, name = filled(shards, {})
    writer = buf.episode_writer(n_envs=2)
    for t in range(5):
        writer.append(obs=[[7, 0, t], [7, 1, t]], next_obs=[[7, 0, t + 1], [7, 1, t + 1]],
                      actions=[[0], [0]], rewards=[t, t], terminated=[t == 4, t == 2],
                      truncated=[False, False])
    writer.flush()
    sizes = [len(millpond.connect(address).buffer(name)) for address in shards]
    assert sizes == [10, 0, 0]
    assert sorted(buf.episode_catalog()["lens"]) == [3, 5]


def test_windows_never_cross_episodes_and_repeat_for_a_seed(shards):
    buf, _ = filled(shards, {0: [7, 3], 1: [5, 5], 2: [9]})
    out = buf.sample_sequences(200, 4, seed=3)
    assert out["obs"].shape == (200, 4, 3) and out["mask"].shape == (200, 4)
    for obs, mask, n, start in zip(out["obs"], out["mask"], out["lens"], out["start_steps"]):
        assert mask.sum() == n and mask[:n].all()
        assert (obs[:n, :2] == obs[0, :2]).all()  # one writer, one episode
        assert (obs[:n, 2] == start + np.arange(n)).all()  # consecutive steps
        assert (obs[n:] == 0).all()
    assert set(out["task"]) == {0, 1, 2}  # drawn from every shard
    again = buf.sample_sequences(200, 4, seed=3)
    assert all((again[k] == out[k]).all() for k in out if k != "episode_ids")


def test_n_step_and_filtered_samples_span_the_shards(shards):
    buf, _ = filled(shards, {0: [6] * 5, 1: [6] * 5, 2: [6] * 5})
    out = buf.sample(80, seed=1, n_step=3, gamma=0.5)
    t = out["obs"][:, 2]
    lens = out["n_step_lens"]
    assert (lens == np.minimum(3, 6 - t)).all()
    expected = sum(0.5 ** k * (t + k) * (k < lens) for k in range(3))
    assert np.allclose(out["rewards"], expected)
    assert (out["next_obs"][:, 2] == t + lens).all()
    assert set(out["obs"][:, 0]) == {0, 1, 2}
    only = buf.sample_sequences(50, 2, seed=0, filter_meta={"task": 1})
    assert set(only["obs"][:, 0, 0]) == {1}  # the other shards hold no match: they step aside
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample_sequences(5, 2, filter_meta={"task": 9})


def test_episodes_are_equally_likely_across_uneven_shards_and_padded_to_the_widest(shards):
    lengths = {0: [2], 1: [3, 3, 3], 2: [8, 4]}
    buf, _ = filled(shards, lengths)
    out = buf.sample_episodes(3000, seed=5)
    assert out["obs"].shape == (3000, 8, 3) and out["mask"].shape == (3000, 8)
    assert (out["lens"] == out["mask"].sum(axis=1)).all()
    keys = [(int(o[0, 0]), int(o[0, 1])) for o in out["obs"]]
    counts = np.array([keys.count(k) for k in sorted(set(keys))])
    assert len(counts) == 6  # every complete episode, each about 1/6 of the draws
    assert counts.min() > 3000 / 6 * 0.8 and counts.max() < 3000 / 6 * 1.2
    for obs, n in zip(out["obs"], out["lens"]):
        writer, episode = int(obs[0, 0]), int(obs[0, 1])
        assert n == lengths[writer][episode] and (obs[n:] == 0).all()


def test_prioritized_windows_carry_their_shard_for_priority_updates(shards):
    buf, name = filled(shards, {0: [4], 1: [4], 2: [4]}, prioritized=True, hot_capacity=30,
                       total_capacity=600)
    out = buf.sample_sequences(30, 2, seed=0)
    assert buf.update_priorities(out["indices"], np.full(30, 5.0)) == 30
    shards_hit = set(int(i) >> 48 for i in out["indices"])
    assert shards_hit == {0, 1, 2}
    for shard in shards_hit:  # the updates reached each shard
        alone = millpond.connect(shards[shard]).buffer(name).info()
        assert alone.max_priority == pytest.approx(5.0)


def test_a_dead_shard_is_skipped_and_the_live_ones_still_serve(tmp_path):
    servers = start_all([ServerProcess(tmp_path / f"s{i}") for i in range(2)])
    try:
        buf, _ = filled([s.address for s in servers], {0: [4], 1: [5]}, timeout=2, capacity=100)
        servers[1].stop()
        out = buf.sample_sequences(20, 3, seed=0, timeout=2)
        assert set(out["obs"][:, 0, 0]) == {0}
        assert list(buf.episode_catalog()["lens"]) == [4]
        assert buf.info().degraded
    finally:
        for server in servers:
            server.stop()


def test_positions_count_shard_after_shard_and_reset_empties_every_shard(shards, tmp_path):
    buf, name = filled(shards, {0: [3], 1: [2, 2], 2: [4]})
    singles = [millpond.connect(address).buffer(name) for address in shards]
    expected = np.concatenate([s.sample_all()["obs"] for s in singles])
    assert (buf.sample_all()["obs"] == expected).all()
    assert (buf.sample_by_index([10, 0, 3])["obs"] == expected[[10, 0, 3]]).all()
    for outside in ([11], [0, -1]):  # nothing is read
        with pytest.raises(millpond.IndexOutOfRangeError):
            buf.sample_by_index(outside)
    seen = np.concatenate([b["obs"] for b in buf.epoch_iterator(4, seed=0)])
    assert sorted(map(tuple, seen)) == sorted(map(tuple, expected))  # each record once
    path = buf.export(tmp_path / "all.npz")
    with np.load(path) as saved:
        assert (saved["obs"] == expected).all() and len(set(saved["episode_ids"])) == 4
    buf.reset()
    assert len(buf) == 0 and [len(s) for s in singles] == [0, 0, 0]
