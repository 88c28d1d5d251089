"""millpond.datasets: .npz, D4RL-style HDF5 and Minari files the tests write, read back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import millpond
from millpond import datasets

RLOX = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")
D4RL = ("observations", "next_observations", "actions", "rewards", "terminals", "timeouts")


def transitions(n=40, obs_dim=3, act_dim=2, seed=0):
    rng = np.random.default_rng(seed)
    terminated = np.zeros(n, bool)
    truncated = np.zeros(n, bool)
    terminated[[7, 20]] = True
    truncated[[13, 31]] = True
    return dict(obs=rng.normal(size=(n, obs_dim)).astype(np.float32),
                next_obs=rng.normal(size=(n, obs_dim)).astype(np.float32),
                actions=rng.normal(size=(n, act_dim)).astype(np.float32),
                rewards=rng.normal(size=n).astype(np.float32),
                terminated=terminated, truncated=truncated)


def renamed(arrays, names):
    return {new: arrays[old] for old, new in zip(RLOX, names)}


def write_hdf5(path, arrays):
    h5py = pytest.importorskip("h5py")  # the `datasets` extra (not in `test`)

    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value)
        f.create_group("infos").create_dataset("qpos", data=np.zeros((3, 2)))  # ignored
        f.create_group("metadata")
    return path


def write(path, arrays, fmt):
    """``arrays`` saved as ``fmt`` ("npz" or "hdf5") at ``path``."""
    if fmt == "npz":
        np.savez(path, **arrays)
    else:
        write_hdf5(path, arrays)


def same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


@pytest.mark.parametrize("names", [RLOX, D4RL], ids=["rlox", "d4rl"])
@pytest.mark.parametrize("fmt", ["npz", "hdf5"])
def test_files_with_either_naming_load_as_transitions(tmp_path, names, fmt):
    arrays = transitions()
    stored = renamed(arrays, names)
    path = tmp_path / f"data.{fmt}"
    write(path, stored, fmt)
    loaded = datasets.load(path)
    same(loaded, arrays)
    buf = millpond.OfflineDatasetBuffer(**loaded)
    assert len(buf) == 40 and buf.n_episodes() == 5  # 4 flags and a final unflagged run
    assert millpond.datasets.load(str(path)).keys() == loaded.keys()  # str paths too


def test_truncated_may_be_missing(tmp_path):
    arrays = transitions()
    del arrays["truncated"]
    np.savez(tmp_path / "d.npz", **arrays)
    loaded = datasets.load(tmp_path / "d.npz")
    assert not loaded["truncated"].any() and len(loaded["truncated"]) == 40


def d4rl_qlearning(dataset):
    """d4rl.qlearning_dataset's loop (terminate_on_end=False, with timeouts), restated."""
    n = dataset["rewards"].shape[0]
    out = {k: [] for k in ("observations", "actions", "next_observations", "rewards",
                           "terminals")}
    for i in range(n - 1):
        if dataset["timeouts"][i]:
            continue
        out["observations"].append(dataset["observations"][i])
        out["next_observations"].append(dataset["observations"][i + 1])
        out["actions"].append(dataset["actions"][i])
        out["rewards"].append(dataset["rewards"][i])
        out["terminals"].append(bool(dataset["terminals"][i]))
    return {k: np.array(v) for k, v in out.items()}


def raw_d4rl(n=30, seed=1):
    """Observations only (no next ones), as D4RL's env.get_dataset() returns them:
    episodes of 5 steps; episode 2 ends on a terminal, the others on timeouts."""
    rng = np.random.default_rng(seed)
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    for end in range(4, n, 5):
        (terminals if end == 14 else timeouts)[end] = True
    return {"observations": rng.normal(size=(n, 4)).astype(np.float32),
            "actions": rng.normal(size=(n, 2)).astype(np.float32),
            "rewards": rng.normal(size=n).astype(np.float32),
            "terminals": terminals, "timeouts": timeouts}


@pytest.mark.parametrize("fmt", ["npz", "hdf5"])
def test_without_next_observations_transitions_are_built_as_d4rl_does(tmp_path, fmt):
    raw = raw_d4rl()
    path = tmp_path / f"raw.{fmt}"
    write(path, raw, fmt)
    loaded = datasets.load(path)
    expected = d4rl_qlearning(raw)
    np.testing.assert_array_equal(loaded["obs"], expected["observations"])
    np.testing.assert_array_equal(loaded["next_obs"], expected["next_observations"])
    np.testing.assert_array_equal(loaded["actions"], expected["actions"])
    np.testing.assert_array_equal(loaded["rewards"], expected["rewards"])
    np.testing.assert_array_equal(loaded["terminated"], expected["terminals"])
    # 30 rows: 5 timeout rows and the last row (no next observation) dropped
    assert len(loaded["rewards"]) == 30 - 5 == len(expected["rewards"])
    # the row before each dropped timeout ends its episode as truncated (not terminal)
    kept = np.flatnonzero(~raw["timeouts"][:-1])
    np.testing.assert_array_equal(loaded["truncated"], raw["timeouts"][kept + 1])
    buf = millpond.OfflineDatasetBuffer(**loaded)
    assert buf.n_episodes() == 6  # 6 episodes of 5 rows, each one row shorter but the terminal's
    np.testing.assert_array_equal(np.sort(buf.episode_catalog()["lens"]), [4, 4, 4, 4, 4, 5])


def test_without_timeouts_only_terminals_cut(tmp_path):
    raw = raw_d4rl()
    del raw["timeouts"]
    loaded = datasets.transitions(raw)
    assert len(loaded["rewards"]) == 29  # only the last row goes
    np.testing.assert_array_equal(loaded["next_obs"], raw["observations"][1:])
    assert not loaded["truncated"].any()


def test_the_export_of_an_episodic_buffer_loads_back(tmp_path):
    online = millpond.ReplayBuffer(100, obs_dim=2, act_dim=1, episodes=True)
    with online.episode_writer(n_envs=2) as writer:  # two envs: interleaved episodes
        for t in range(12):
            done = np.array([t % 4 == 3, t % 6 == 5])
            writer.append(obs=np.full((2, 2), t), next_obs=np.full((2, 2), t + 1),
                          actions=np.zeros((2, 1)), rewards=np.ones(2), terminated=done,
                          truncated=np.zeros(2, bool))
    path = online.export(tmp_path / "online.npz")
    loaded = datasets.load(path)
    assert set(loaded) == set(RLOX) | {"episode_ids"}
    buf = millpond.OfflineDatasetBuffer(**loaded)
    assert len(buf) == 24 and buf.n_episodes() == 3 + 2
    stats = buf.stats()
    assert stats["max_return"] == 6.0 and stats["min_return"] == 4.0
    traj = buf.sample_trajectories(16, 8, seed=0)
    for b in range(16):
        steps = traj["obs"][b, traj["mask"][b], 0]
        np.testing.assert_array_equal(np.diff(steps), 1)  # one env's episode, in order
        np.testing.assert_array_equal(traj["returns_to_go"][b, traj["mask"][b]],
                                      traj["returns_to_go"][b, 0] - np.arange(len(steps)))


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        datasets.load(tmp_path / "missing.npz")
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(millpond.InvalidArgumentError, match="unknown dataset format"):
        datasets.load(tmp_path / "data.csv")
    np.savez(tmp_path / "partial.npz", obs=np.zeros((3, 2)), rewards=np.zeros(3))
    with pytest.raises(millpond.InvalidArgumentError, match=r"lacks \['actions', 'terminated'\]"):
        datasets.load(tmp_path / "partial.npz")
    both = {**transitions(), "observations": transitions()["obs"]}
    with pytest.raises(millpond.InvalidArgumentError, match="two names"):
        datasets.transitions(both)
    short = {**transitions(), "actions": np.zeros((3, 2))}
    with pytest.raises(millpond.InvalidArgumentError, match="rows"):
        datasets.transitions(short)


def write_minari(root: Path, dataset_id: str, episodes=4, seed=0):
    """A small CartPole-v1 dataset, collected with Minari's own DataCollector."""
    gym = pytest.importorskip("gymnasium")
    minari = pytest.importorskip("minari")

    env = minari.DataCollector(gym.make("CartPole-v1"))
    env.reset(seed=seed)
    env.action_space.seed(seed)
    for _ in range(episodes):
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            done = terminated or truncated
        env.reset()
    dataset = env.create_dataset(dataset_id=dataset_id, algorithm_name="random",
                                 author="millpond tests", author_email="tests@example.com",
                                 code_permalink="https://example.com", description="tests",
                                 eval_env="CartPole-v1")
    env.close()
    return dataset


@pytest.fixture
def minari_root(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


def test_minari_datasets_load_by_id_and_by_folder(minari_root):
    dataset = write_minari(minari_root, "cartpole/random-v0")
    by_id = datasets.from_minari("cartpole/random-v0")
    folder = minari_root / "cartpole" / "random-v0"
    same(by_id, datasets.from_minari(folder))
    same(by_id, datasets.from_minari(folder / "data"))
    same(by_id, datasets.load(folder))  # load() takes the folder too
    episodes = list(dataset.iterate_episodes())
    assert len(by_id["rewards"]) == dataset.total_steps == sum(len(e) for e in episodes)
    first = episodes[0]
    k = len(first)
    np.testing.assert_array_equal(by_id["obs"][:k], first.observations[:-1])
    np.testing.assert_array_equal(by_id["next_obs"][:k], first.observations[1:])
    np.testing.assert_array_equal(by_id["actions"][:k, 0], first.actions)
    np.testing.assert_array_equal(by_id["terminated"][:k], first.terminations)
    buf = millpond.OfflineDatasetBuffer(**by_id)
    assert buf.n_episodes() == dataset.total_episodes == 4
    stats = buf.stats()
    assert stats["obs_dim"] == 4 and stats["act_dim"] == 1
    assert stats["mean_return"] == pytest.approx(np.mean([e.rewards.sum() for e in episodes]))
    assert stats["mean_episode_length"] == pytest.approx(dataset.total_steps / 4)


def test_an_unknown_minari_id_is_not_downloaded(minari_root):
    pytest.importorskip("minari")
    with pytest.raises(FileNotFoundError):
        datasets.from_minari("cartpole/absent-v0")


def test_missing_optional_packages_say_what_to_install(tmp_path):
    code = ("import sys; sys.modules['minari'] = None; sys.modules['h5py'] = None\n"
            "from millpond import datasets\n"
            "for call in (lambda: datasets.from_minari('x/y-v0'),\n"
            "             lambda: datasets.load(sys.argv[1])):\n"
            "    try:\n"
            "        call()\n"
            "    except ImportError as exc:\n"
            "        print(exc)\n")
    (tmp_path / "d.h5").touch()  # never read: the import fails first
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.h5")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "minari package: pip install 'millpond[datasets]'" in out
    assert "h5py package: pip install 'millpond[datasets]'" in out


def test_the_readme_example_runs(tmp_path, monkeypatch):
    readme = Path(__file__).resolve().parents[1] / "README.md"
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
                 if "millpond.OfflineDatasetBuffer(" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
