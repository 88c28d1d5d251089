"""The Stable-Baselines3 adapter against SB3's own buffers, fed the same transitions.

Every test runs in-process and against a real server (``shared_server``).
Observations carry a transition id (``obs[0]``), so a sampled row can be
looked up in SB3's arrays: same shapes and dtypes, and every sampled row is a
stored, live transition with SB3's meaning of ``dones``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support import ServerProcess

pytestmark = pytest.mark.usefixtures("private_tmpdir")  # SB3 logs go there

_names = itertools.count()

# Imported by the fixture below when the first test here runs, not when the suite is collected
# (Stable-Baselines3 imports torch).
sb3 = gym = th = spaces = sb3_buffers = DummyVecEnv = VecNormalize = mp_sb3 = None


@pytest.fixture(scope="module", autouse=True)
def frameworks():
    global sb3, gym, th, spaces, sb3_buffers, DummyVecEnv, VecNormalize, mp_sb3
    sb3 = pytest.importorskip("stable_baselines3")
    gym = pytest.importorskip("gymnasium")
    th = pytest.importorskip("torch")
    from gymnasium import spaces
    from stable_baselines3.common import buffers as sb3_buffers
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from millpond.integrations import sb3 as mp_sb3


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory):
    """A daemon without the shared-memory fast path: adds go over gRPC, in flight."""
    with ServerProcess(tmp_path_factory.mktemp("grpc") / "data", "--no-shm") as proc:
        yield proc


@pytest.fixture(params=["local", pytest.param("server", marks=pytest.mark.daemon),
                        pytest.param("server-grpc", marks=pytest.mark.daemon)])
def where(request):
    """Keyword arguments that put the adapter in-process, on the shared server (same
    host: shared memory), or on a server it reaches over gRPC only (adds in flight)."""
    if request.param == "local":
        return {}
    server = request.getfixturevalue("shared_server" if request.param == "server"
                                     else "grpc_server")
    return {"address": server.address, "name": f"sb3-{next(_names)}"}


def feed(buffers, n_steps, n_envs, obs_space, act_space, rng, timeout_every=7, done_every=5):
    """Add the same ``n_steps`` steps to every buffer; obs[..., 0] is the transition id."""
    for t in range(n_steps):
        ids = t * n_envs + np.arange(n_envs)
        shape = (n_envs, *obs_space.shape)
        obs = np.zeros(shape, obs_space.dtype)
        obs[..., 0] = ids[(slice(None),) + (None,) * (len(shape) - 2)]
        next_obs = obs + 1
        action = np.array([act_space.sample() for _ in range(n_envs)])
        reward = rng.normal(size=n_envs).astype(np.float32)
        done = (ids % done_every == 0) | (ids % timeout_every == 0)
        infos = [{"TimeLimit.truncated": bool(i % timeout_every == 0)} for i in ids]
        for buf in buffers:
            buf.add(obs.copy(), next_obs.copy(), action.copy(), reward.copy(), done.copy(), infos)


def sb3_rows(ref: sb3_buffers.ReplayBuffer) -> dict[int, tuple]:
    """id -> (actions, next_obs, reward, effective done) of every live transition in ``ref``."""
    rows = {}
    steps = ref.buffer_size if ref.full else ref.pos
    for step in range(steps):
        for env in range(ref.n_envs):
            key = int(ref.observations[step, env].reshape(-1)[0])
            done = ref.dones[step, env] * (1 - ref.timeouts[step, env])
            rows[key] = (ref.actions[step, env], ref.next_observations[step, env],
                         ref.rewards[step, env], done)
    return rows


SPACES = ["box-discrete", "image-box", "box-multidiscrete"]


def spaces_of(kind: str) -> tuple:
    """The observation and action spaces of a kind in SPACES."""
    if kind == "box-discrete":
        return spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3)
    if kind == "image-box":
        return spaces.Box(0, 255, (3, 5, 5), np.uint8), spaces.Box(-1, 1, (2,), np.float64)
    assert kind == "box-multidiscrete", kind
    return spaces.Box(-1, 1, (2,), np.float64), spaces.MultiDiscrete([3, 4])


@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("timeouts", [True, False])
@pytest.mark.parametrize("kind", SPACES)
def test_samples_match_sb3s_buffer(where, n_envs, timeouts, kind):
    obs_space, act_space = spaces_of(kind)
    rng = np.random.default_rng(0)
    kwargs = {"n_envs": n_envs, "handle_timeout_termination": timeouts, "device": "cpu"}
    ref = sb3_buffers.ReplayBuffer(60, obs_space, act_space, **kwargs)
    ours = mp_sb3.ReplayBuffer(60, obs_space, act_space, **kwargs, **where)
    feed([ref, ours], 45 // n_envs, n_envs, obs_space, act_space, rng)  # wraps around
    assert ours.size() == ref.size() and ours.pos == ref.pos and ours.full == ref.full
    expected, theirs = ours.sample(500), ref.sample(500)
    for got, want in zip(expected, theirs):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
    live = sb3_rows(ref)
    seen = set()
    for i in range(500):
        key = int(expected.observations[i].reshape(-1)[0])
        seen.add(key)
        action, next_obs, reward, done = live[key]  # a live transition, not an evicted one
        assert np.array_equal(expected.actions[i].numpy(), action)
        assert np.array_equal(expected.next_observations[i].numpy(), next_obs)
        assert expected.rewards[i, 0].item() == pytest.approx(float(reward))
        assert expected.dones[i, 0].item() == float(done)
    assert len(seen) > 0.9 * len(live)  # uniform over all of them
    ours.close()


def test_draws_follow_numpys_global_seed():
    space, act = spaces_of("box-discrete")
    buf = mp_sb3.ReplayBuffer(100, space, act, device="cpu")
    feed([buf], 50, 1, space, act, np.random.default_rng(1))
    np.random.seed(3)
    first = buf.sample(16).observations
    np.random.seed(3)
    assert th.equal(first, buf.sample(16).observations)
    assert not th.equal(first, buf.sample(16).observations)


def test_vecnormalize_normalizes_as_sb3_does(where):
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]))
    venv.obs_rms.mean[:] = 3.0
    venv.obs_rms.var[:] = 4.0
    venv.ret_rms.var = 9.0
    space, act = venv.observation_space, venv.action_space
    buf = mp_sb3.ReplayBuffer(100, space, act, device="cpu", **where)
    feed([buf], 50, 1, space, act, np.random.default_rng(2))
    np.random.seed(5)
    raw = buf.sample(32)
    np.random.seed(5)
    norm = buf.sample(32, env=venv)
    assert th.allclose(norm.observations, th.as_tensor(venv.normalize_obs(raw.observations.numpy())))
    assert th.allclose(norm.rewards, raw.rewards / np.sqrt(9.0 + venv.epsilon))
    buf.close()
    venv.close()


def test_dict_observations_match_sb3s_dict_buffer(where):
    obs_space = spaces.Dict({"pos": spaces.Box(-1, 1, (3,), np.float32),
                             "cell": spaces.Discrete(9)})
    act_space = spaces.Box(-1, 1, (2,), np.float32)
    ref = sb3_buffers.DictReplayBuffer(40, obs_space, act_space, device="cpu", n_envs=2)
    ours = mp_sb3.DictReplayBuffer(40, obs_space, act_space, device="cpu", n_envs=2, **where)
    for t in range(30):
        ids = np.array([2 * t, 2 * t + 1])
        obs = {"pos": np.stack([np.full(3, i, np.float32) for i in ids]), "cell": ids % 9}
        nxt = {"pos": obs["pos"] + 1, "cell": (ids + 1) % 9}
        act = np.stack([np.full(2, i / 100, np.float32) for i in ids])
        infos = [{"TimeLimit.truncated": bool(i % 4 == 0)} for i in ids]
        for buf in (ref, ours):
            buf.add({k: v.copy() for k, v in obs.items()}, {k: v.copy() for k, v in nxt.items()},
                    act, ids.astype(np.float32), ids % 3 == 0, infos)
    got, want = ours.sample(200), ref.sample(200)
    for key in obs_space.spaces:
        for a, b in ((got.observations, want.observations),
                     (got.next_observations, want.next_observations)):
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype
    for name in ("actions", "dones", "rewards"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype
    ids = got.observations["pos"][:, 0].numpy().astype(int)
    assert ids.min() >= 60 - 40  # the 40 newest (20 steps x 2 envs) only
    assert np.array_equal(got.observations["cell"][:, 0].numpy(), ids % 9)
    assert np.array_equal(got.rewards[:, 0].numpy(), ids.astype(np.float32))
    expected_done = (ids % 3 == 0) & ~(ids % 4 == 0)
    assert np.array_equal(got.dones[:, 0].numpy(), expected_done.astype(np.float32))
    ours.close()


def test_what_is_refused_is_refused_clearly():
    space, act = spaces_of("box-discrete")
    with pytest.raises(ValueError, match="optimize_memory_usage"):  # as SB3's
        mp_sb3.NStepReplayBuffer(100, space, act, optimize_memory_usage=True,
                                 handle_timeout_termination=False)
    with pytest.raises(ValueError, match="DictReplayBuffer"):
        mp_sb3.ReplayBuffer(100, spaces.Dict({"a": space}), act)
    with pytest.raises(Exception, match="address"):
        mp_sb3.ReplayBuffer(100, space, act, name="orphan")


def test_reset_and_export_of_the_run(where, tmp_path):
    space, act = spaces_of("box-discrete")
    buf = mp_sb3.ReplayBuffer(100, space, act, device="cpu", **where)
    feed([buf], 30, 1, space, act, np.random.default_rng(3))
    if hasattr(buf.millpond_buffer, "export"):
        buf.millpond_buffer.export(tmp_path / "run.npz")
        data = np.load(tmp_path / "run.npz")
        assert data["obs"].shape == (30, 4) and np.array_equal(data["obs"][:, 0], np.arange(30))
        assert data["terminated"].sum() + data["truncated"].sum() == sum(
            i % 5 == 0 or i % 7 == 0 for i in range(30))
    buf.reset()
    assert buf.size() == 0 and buf.pos == 0 and len(buf.millpond_buffer) == 0
    buf.close()


@pytest.mark.parametrize("algo", ["DQN", "SAC"])
def test_an_algorithm_learns_with_the_buffer(where, algo):
    env_id = "CartPole-v1" if algo == "DQN" else "Pendulum-v1"
    cls = getattr(sb3, algo)
    model = cls("MlpPolicy", env_id, replay_buffer_class=mp_sb3.ReplayBuffer,
                replay_buffer_kwargs=where, learning_starts=50, buffer_size=1_000, batch_size=32,
                seed=0, device="cpu", policy_kwargs={"net_arch": [16]})
    model.learn(300)
    assert isinstance(model.replay_buffer, mp_sb3.ReplayBuffer)
    assert model.replay_buffer.size() == 300
    assert len(model.replay_buffer.millpond_buffer) == 300
    model.replay_buffer.close()


def test_save_and_load_replay_buffer(where, tmp_path):
    model = sb3.DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=mp_sb3.ReplayBuffer,
                    replay_buffer_kwargs=where, learning_starts=1_000, buffer_size=1_000,
                    device="cpu", policy_kwargs={"net_arch": [8]})
    model.learn(120)
    before = model.replay_buffer.millpond_buffer.sample_all()
    model.save_replay_buffer(tmp_path / "buffer.pkl")
    model.replay_buffer = None
    model.load_replay_buffer(tmp_path / "buffer.pkl")
    loaded = model.replay_buffer
    assert isinstance(loaded, mp_sb3.ReplayBuffer) and loaded.size() == 120
    after = loaded.millpond_buffer.sample_all()
    for key, value in before.items():
        assert np.array_equal(value, after[key]), key
    loaded.close()


def test_dqn_trains_exactly_as_with_sb3s_own_buffer(where):
    """Same seed, same draws: the networks end bit-for-bit equal."""
    params = []
    for cls, kwargs in ((sb3_buffers.ReplayBuffer, {}), (mp_sb3.ReplayBuffer, where)):
        model = sb3.DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=cls,
                        replay_buffer_kwargs=kwargs, learning_starts=100, buffer_size=300,
                        batch_size=32, train_freq=4, seed=7, device="cpu",
                        policy_kwargs={"net_arch": [16]})
        model.learn(600)  # the buffer wraps twice
        params.append(th.cat([p.detach().flatten() for p in model.policy.parameters()]))
    assert th.equal(params[0], params[1])
