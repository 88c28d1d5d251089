"""OfflineDatasetBuffer in-process: rlox's arguments, statistics, normalization, windows."""

from __future__ import annotations

import os

import numpy as np
import pytest

import millpond
from millpond.core.dataset import ReadOnlyBuffer, dataset_columns
from millpond.offline.progress import ProgressBar

# Episodes of lengths 4, 3, 5 (terminated, truncated, terminated) and a final one of 2
# with no flag: 14 transitions.
LENGTHS = (4, 3, 5, 2)


def make(obs_dim=3, act_dim=2, seed=0):
    """Arrays whose obs say (episode, step, row): obs[i] = [episode, step, i, ...]."""
    rng = np.random.default_rng(seed)
    n = sum(LENGTHS)
    episode = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    step = np.concatenate([np.arange(k) for k in LENGTHS])
    obs = rng.normal(size=(n, obs_dim)).astype(np.float32)
    obs[:, 0], obs[:, 1], obs[:, 2] = episode, step, np.arange(n)
    next_obs = obs + 0.5
    actions = rng.normal(size=(n, act_dim)).astype(np.float32)
    rewards = rng.integers(-3, 10, n).astype(np.float32)
    ends = np.cumsum(LENGTHS) - 1
    terminated = np.zeros(n, np.uint8)
    truncated = np.zeros(n, np.uint8)
    terminated[ends[[0, 2]]] = 1
    truncated[ends[1]] = 1
    return dict(obs=obs, next_obs=next_obs, actions=actions, rewards=rewards,
                terminated=terminated, truncated=truncated), episode, step


def hand_returns_to_go(rewards, episode):
    out = np.zeros(len(rewards))
    for i in range(len(rewards)):
        same = (episode == episode[i]) & (np.arange(len(rewards)) >= i)
        out[i] = rewards[same].sum()
    return out


def test_stats_are_rloxs_computed_by_hand():
    arrays, episode, _ = make()
    buf = millpond.OfflineDatasetBuffer(**arrays)
    returns = np.array([arrays["rewards"][episode == e].sum() for e in range(len(LENGTHS))])
    stats = buf.stats()
    assert stats == pytest.approx({
        "n_transitions": 14, "n_episodes": 4, "obs_dim": 3, "act_dim": 2,
        "mean_return": returns.mean(), "std_return": returns.std(ddof=1),
        "min_return": returns.min(), "max_return": returns.max(),
        "mean_episode_length": 14 / 4})
    assert isinstance(stats["n_episodes"], int) and isinstance(stats["std_return"], float)
    assert buf.n_episodes() == 4 and len(buf) == 14
    assert "obs_mean" not in stats  # only when normalizing


def test_one_episode_has_zero_std_like_rlox():
    n = 5
    buf = millpond.OfflineDatasetBuffer(np.zeros(n), np.zeros(n), np.zeros(n), np.ones(n),
                                        np.zeros(n), np.zeros(n))
    stats = buf.stats()
    assert stats["n_episodes"] == 1 and stats["std_return"] == 0.0
    assert stats["mean_return"] == stats["min_return"] == stats["max_return"] == 5.0
    assert stats["obs_dim"] == stats["act_dim"] == 1


def test_flat_and_2d_inputs_are_the_same_dataset():
    arrays, _, _ = make()
    flat = {k: v.ravel() for k, v in arrays.items()}
    a = millpond.OfflineDatasetBuffer(**arrays)
    b = millpond.OfflineDatasetBuffer(flat["obs"], flat["next_obs"], flat["actions"],
                                      flat["rewards"], flat["terminated"], flat["truncated"])
    assert a.stats() == b.stats()
    assert a.config == b.config
    sa, sb = a.sample(12, seed=7), b.sample(12, seed=7)
    assert sa["obs"].shape == (12, 3) and sa["actions"].shape == (12, 2)
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key])
    assert sa["obs"].dtype == np.float32 and sa["terminated"].dtype == bool
    # same seed, same batch; the drawn rows are real rows
    np.testing.assert_array_equal(a.sample(12, seed=7)["obs"], sa["obs"])
    rows = sa["obs"][:, 2].astype(int)
    np.testing.assert_array_equal(sa["actions"], arrays["actions"][rows])
    np.testing.assert_array_equal(sa["next_obs"], arrays["next_obs"][rows])


@pytest.mark.parametrize("bad,error", [
    (dict(obs=np.zeros(13)), millpond.ShapeMismatchError),          # 13 is not k * 14
    (dict(next_obs=np.zeros((14, 4))), millpond.ShapeMismatchError),  # obs is [14, 3]
    (dict(actions=np.zeros((10, 2))), millpond.ShapeMismatchError),
    (dict(terminated=np.zeros(3)), millpond.ShapeMismatchError),
    (dict(rewards=np.zeros(0)), millpond.ShapeMismatchError),
    (dict(obs=np.array(["a"] * 14)), millpond.DTypeMismatchError),
    (dict(rewards=None), millpond.InvalidArgumentError),
])
def test_bad_arrays_are_typed_errors(bad, error):
    arrays, _, _ = make()
    with pytest.raises(error):
        millpond.OfflineDatasetBuffer(**{**arrays, **bad})


def test_truncated_may_be_left_out():
    arrays, _, _ = make()
    arrays["truncated"] = None
    assert millpond.OfflineDatasetBuffer(**arrays).n_episodes() == 3  # 4+3 merge: no flag


def test_normalize_uses_the_observation_statistics():
    arrays, _, _ = make()
    buf = millpond.OfflineDatasetBuffer(**arrays, normalize=True)
    mean = arrays["obs"].astype(np.float64).mean(axis=0)
    std = np.maximum(arrays["obs"].astype(np.float64).std(axis=0), 1e-8)  # ddof=0, as rlox
    stats = buf.stats()
    np.testing.assert_allclose(stats["obs_mean"], mean, rtol=1e-6)
    np.testing.assert_allclose(stats["obs_std"], std, rtol=1e-6)
    raw = millpond.OfflineDatasetBuffer(**arrays).sample(14, seed=3)
    out = buf.sample(14, seed=3)
    np.testing.assert_allclose(out["obs"], (raw["obs"] - mean) / std, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["next_obs"], (raw["next_obs"] - mean) / std,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["actions"], raw["actions"])  # only observations
    assert out["obs"].dtype == np.float32
    traj = buf.sample_trajectories(8, 4, seed=1)
    raw_traj = millpond.OfflineDatasetBuffer(**arrays).sample_trajectories(8, 4, seed=1)
    valid = traj["mask"]
    assert (traj["obs"][~valid] == 0).all() and (traj["next_obs"][~valid] == 0).all()
    np.testing.assert_allclose(traj["obs"][valid], (raw_traj["obs"][valid] - mean) / std,
                               rtol=1e-5, atol=1e-6)


def test_a_constant_feature_gets_rloxs_floor():
    arrays, _, _ = make()
    arrays["obs"][:, 1] = 2.0
    buf = millpond.OfflineDatasetBuffer(**arrays, normalize=True)
    assert buf.stats()["obs_std"][1] == np.float32(1e-8)
    assert (buf.sample(8, seed=0)["obs"][:, 1] == 0).all()


def test_trajectories_stay_in_their_episode_with_returns_to_the_episode_end():
    arrays, episode, step = make()
    buf = millpond.OfflineDatasetBuffer(**arrays)
    rtg = hand_returns_to_go(arrays["rewards"], episode)
    seen_windows_ending_early = 0
    for seed in range(20):
        traj = buf.sample_trajectories(16, 3, seed=seed)
        assert set(traj) >= {"obs", "actions", "rewards", "returns_to_go", "timesteps", "mask"}
        assert traj["obs"].shape == (16, 3, 3) and traj["actions"].shape == (16, 3, 2)
        assert traj["rewards"].shape == traj["returns_to_go"].shape == (16, 3)
        for b in range(16):
            valid = traj["mask"][b]
            assert valid[0] and (np.diff(valid.astype(int)) <= 0).all()  # a prefix
            rows = traj["obs"][b, valid, 2].astype(int)
            assert len(set(episode[rows])) == 1  # never crosses an episode
            np.testing.assert_array_equal(np.diff(rows), 1)
            np.testing.assert_array_equal(traj["timesteps"][b, valid], step[rows])
            np.testing.assert_allclose(traj["returns_to_go"][b, valid], rtg[rows])
            np.testing.assert_array_equal(traj["rewards"][b, valid], arrays["rewards"][rows])
            assert (traj["timesteps"][b, ~valid] == 0).all()
            assert (traj["returns_to_go"][b, ~valid] == 0).all()
            last = rows[-1]
            if last + 1 < len(episode) and episode[last + 1] == episode[last]:
                seen_windows_ending_early += 1  # its return runs past the window
    assert seen_windows_ending_early > 0


def test_the_final_unflagged_episode_counts():
    arrays, episode, _ = make()
    buf = millpond.OfflineDatasetBuffer(**arrays)
    last = buf.sample_episodes(50, seed=0)
    assert set(last["lens"]) == set(LENGTHS)  # every episode, the last (2 steps) included
    assert buf.info()["episodes_in_progress"] == 0


def test_episode_ids_group_interleaved_rows():
    arrays, episode, step = make()
    mixed = np.lexsort((episode, step))  # round robin: step 0 of each episode, then step 1...
    shuffled = {k: v[mixed] for k, v in arrays.items()}
    buf = millpond.OfflineDatasetBuffer(**shuffled, episode_ids=episode[mixed] + 100)
    plain = millpond.OfflineDatasetBuffer(**arrays)
    assert buf.stats() == plain.stats()
    everything = buf.sample_all()
    rtg = hand_returns_to_go(arrays["rewards"], episode)
    np.testing.assert_allclose(everything["returns_to_go"], rtg[mixed])
    traj = buf.sample_trajectories(32, 4, seed=0)
    for b in range(32):
        ids = traj["obs"][b, traj["mask"][b], 0]
        assert len(set(ids)) == 1


def test_episode_ids_must_not_continue_after_an_end():
    arrays, episode, _ = make()
    with pytest.raises(millpond.InvalidArgumentError, match="after"):
        millpond.OfflineDatasetBuffer(**arrays, episode_ids=np.zeros(len(episode), int))
    with pytest.raises(millpond.ShapeMismatchError):
        millpond.OfflineDatasetBuffer(**arrays, episode_ids=[0, 1])


def test_writes_are_refused_and_change_nothing():
    arrays, _, _ = make()
    buf = millpond.OfflineDatasetBuffer(**arrays)
    before = buf.sample_all()
    one = {k: v[0] for k, v in arrays.items()}
    calls = [
        lambda: buf.push(one["obs"], one["actions"], 1.0, False, False, one["next_obs"]),
        lambda: buf.push_batch(**arrays),
        lambda: buf.store(**one),
        lambda: buf.end_episode(),
        lambda: buf.one_episode(),
        lambda: buf.episode_writer(2),
        lambda: buf.update_priorities([0], [1.0]),
        lambda: buf.reset(),
        # the engine refuses too, whoever calls it
        lambda: buf.backend.push_batch({**arrays, "returns_to_go": arrays["rewards"]},
                                       episodes=0),
        lambda: buf.backend.push({k: v[0] for k, v in before.items()}, episode=0),
        lambda: buf.backend.update_episodes([(0, None, True)]),
        lambda: buf.backend.reset(),
    ]
    for call in calls:
        with pytest.raises(millpond.ReadOnlyBufferError):
            call()
    assert isinstance(millpond.ReadOnlyBufferError("x"), millpond.ReplayError)
    after = buf.sample_all()
    assert len(buf) == 14 and buf.n_episodes() == 4
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])
    buf.close()
    assert buf.closed


def test_reads_of_the_episodic_buffer_work_on_a_dataset():
    arrays, _, _ = make()
    buf = millpond.OfflineDatasetBuffer(**arrays)
    catalog = buf.episode_catalog()
    np.testing.assert_array_equal(catalog["lens"], LENGTHS)
    with buf.sampler(8, seed=0, max_batches=2) as batches:
        assert [len(b["obs"]) for b in batches] == [8, 8]
    assert buf.sample_sequences(4, 2, seed=0)["obs"].shape == (4, 2, 3)


def test_arguments_that_do_not_go_together():
    arrays, _, _ = make()
    with pytest.raises(millpond.InvalidArgumentError):
        millpond.OfflineDatasetBuffer(**arrays, address="localhost:1", name="x")
    with pytest.raises(millpond.InvalidConfigError):
        millpond.OfflineDatasetBuffer(address="localhost:1")
    with pytest.raises(millpond.InvalidConfigError):
        millpond.OfflineDatasetBuffer(**arrays, token="t")
    plain = millpond.ReplayBuffer(10, obs_dim=3, act_dim=2, episodes=True)
    with pytest.raises(millpond.InvalidArgumentError, match="not an offline dataset"):
        millpond.OfflineDatasetBuffer.from_buffer(plain)
    assert not plain.closed  # not ours to close


def test_the_engine_buffer_directly():
    arrays, _, _ = make()
    ticks = []
    buf = ReadOnlyBuffer(dataset_columns(**arrays), progress=ticks.append, source="x.npz")
    assert ticks[-1] == 14 and buf.source == "x.npz"
    assert buf.info().episodes == 4


def test_progress_bar_draws_on_a_terminal_only(tmp_path):
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        with ProgressBar(200, "storing test", stream=tty, delay=0, interval=0) as bar:
            for done in range(0, 201, 50):
                bar(done)
    drawn = _read_all(master)
    os.close(master)
    assert "storing test" in drawn and "100%" in drawn and "200/200 records" in drawn
    assert drawn.endswith("\n") or drawn.endswith("\r\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as plain:
        with ProgressBar(200, "storing test", stream=plain, delay=0, interval=0) as bar:
            bar(100)
    assert log.read_text() == ""  # not a terminal: nothing
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        with ProgressBar(200, "quick", stream=tty, delay=60) as bar:
            bar(200)  # done before the delay: silent
        os.set_blocking(master, False)
        with pytest.raises(BlockingIOError):  # nothing to read
            os.read(master, 100)
    os.close(master)


def test_device_gives_normalized_tensors():
    torch = pytest.importorskip("torch")
    arrays, _, _ = make()
    buf = millpond.OfflineDatasetBuffer(**arrays, normalize=True)
    out = buf.sample(8, seed=0, device="cpu")
    assert isinstance(out["obs"], torch.Tensor)
    np.testing.assert_array_equal(out["obs"].numpy(), buf.sample(8, seed=0)["obs"])
    traj = buf.sample_trajectories(4, 3, seed=0, device="cpu")
    assert isinstance(traj["timesteps"], torch.Tensor) and traj["obs"].shape == (4, 3, 3)


def _read_all(master: int) -> str:
    """Everything written to a pty whose other end is closed (one read may return only
    part of it: read until the end, EIO on Linux)."""
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()

