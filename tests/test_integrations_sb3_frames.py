"""millpond.integrations.sb3 with ``optimize_memory_usage=True`` and ``frame_stack``, against
SB3's own ``ReplayBuffer(optimize_memory_usage=True)``, in-process and on a real daemon.

Both buffers get the same steps of environments that behave as SB3's VecEnvs do: a step's
``next_obs`` is the next step's ``obs`` unless the step ended its episode (then it is the
episode's last observation, and the next step begins a new episode). With numpy's global
generator seeded alike, each sample equals SB3's field by field, except the
``next_observations`` of a step that ended its episode: SB3's single array holds the next
episode's first observation there, millpond the true last one (checked against a log).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("private_tmpdir")  # SB3 logs go there

_names = itertools.count()
sb3 = th = spaces = sb3_buffers = mp_sb3 = None


@pytest.fixture(scope="module", autouse=True)
def frameworks():
    global sb3, th, spaces, sb3_buffers, mp_sb3
    sb3 = pytest.importorskip("stable_baselines3")
    th = pytest.importorskip("torch")
    from gymnasium import spaces
    from stable_baselines3.common import buffers as sb3_buffers

    from millpond.integrations import sb3 as mp_sb3


@pytest.fixture(params=["local", pytest.param("server", marks=pytest.mark.daemon)])
def where(request):
    """In-process, or on the shared same-host server."""
    if request.param == "local":
        return {}
    return {"address": request.getfixturevalue("shared_server").address,
            "name": f"sb3-frames-{next(_names)}"}


class Envs:
    """``n_envs`` environments whose observations are stacks of ``k`` frames along axis 0
    (``k = 0``: plain vectors), each frame ``shape``; an episode ends with p=0.15
    (terminated or truncated). Every observation's first element of its newest frame is
    unique, so a sample is traced back to its step. ``last[id]`` is the true last
    observation of a step that ended an episode."""

    def __init__(self, n_envs, k=0, shape=(3,), seed=0):
        self.n, self.k, self.shape = n_envs, k, shape
        self.rng = np.random.default_rng(seed)
        self.count = 0
        self.obs = np.stack([self.reset() for _ in range(n_envs)])
        self.last = {}

    def frame(self):
        self.count += 1
        frame = self.rng.integers(0, 200, self.shape).astype(np.float32 if not self.k
                                                             else np.uint8)
        frame.reshape(-1)[0] = self.count % 200 if self.k else self.count
        return frame

    def reset(self):
        if not self.k:
            return self.frame()
        return np.stack([np.zeros(self.shape, np.uint8)] * (self.k - 1) + [self.frame()])

    def advance(self, obs):
        if not self.k:
            return self.frame()
        return np.concatenate([obs[1:], self.frame()[None]])

    def step(self, buffers, act_space):
        obs = self.obs
        nxt = np.stack([self.advance(o) for o in obs])
        action = np.array([act_space.sample() for _ in range(self.n)])
        reward = self.rng.normal(size=self.n).astype(np.float32)
        done = self.rng.random(self.n) < 0.15
        timeout = done & (self.rng.random(self.n) < 0.5)
        infos = [{"TimeLimit.truncated": bool(x)} for x in timeout]
        for buf in buffers:
            buf.add(obs.copy(), nxt.copy(), action.copy(), reward.copy(), done.copy(), infos)
        self.obs = nxt.copy()
        for i in np.flatnonzero(done):
            self.last[obs[i].tobytes()] = nxt[i]
            self.obs[i] = self.reset()


def compare(ours, ref, envs, batch_size=256, seed=0):
    """One sample of each, drawn alike: equal but for the next observations of ended steps."""
    np.random.seed(seed)
    got = ours.sample(batch_size)
    np.random.seed(seed)
    want = ref.sample(batch_size)
    for name in ("observations", "actions", "dones", "rewards"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert th.equal(a, b), name
    a, b = got.next_observations.numpy(), want.next_observations.numpy()
    assert a.shape == b.shape and a.dtype == b.dtype
    ended = got.dones[:, 0].numpy() == 1
    assert np.array_equal(a[~ended], b[~ended])
    for i in np.flatnonzero(ended):  # the true last observation, not the next episode's first
        assert np.array_equal(a[i], envs.last[got.observations[i].numpy().tobytes()])
    return got


@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("kind", ["vector", "stacks"])
def test_optimize_memory_usage_samples_equal_sb3s(where, n_envs, kind):
    k, shape = (0, (3,)) if kind == "vector" else (4, (6, 5))
    envs = Envs(n_envs, k, shape, seed=n_envs)
    dtype = np.float32 if not k else np.uint8
    obs_space = spaces.Box(0, 255, (k, *shape) if k else shape, dtype)
    act_space = spaces.Discrete(4)
    kwargs = {"n_envs": n_envs, "handle_timeout_termination": False, "device": "cpu",
              "optimize_memory_usage": True}
    ref = sb3_buffers.ReplayBuffer(90, obs_space, act_space, **kwargs)
    ours = mp_sb3.ReplayBuffer(90, obs_space, act_space, **kwargs, **where,
                               **({"frame_stack": 0} if k else {}))
    t = 0
    for chunk in (7, 13, 1, 40, 29, 3, 61):  # before full, at, across and past the wrap
        for _ in range(chunk):
            envs.step([ref, ours], act_space)
        t += chunk
        assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size())
        got = compare(ours, ref, envs, seed=t)
    assert (got.dones == 1).any() and (got.dones == 0).any()
    config = ours.millpond_buffer.info().config  # (stored bytes: the Atari test below)
    assert config.next_of == (("next_obs", "obs"),)
    assert config.frame_stack == ((("obs", 0),) if k else ())
    ours.close()


def test_time_limits_are_right_with_it():
    """SB3 refuses optimize_memory_usage with handle_timeout_termination (issue #934: its
    single array loses a truncated step's last observation); millpond keeps it."""
    envs = Envs(2, seed=5)
    space, act = spaces.Box(-1e9, 1e9, (3,), np.float32), spaces.Discrete(2)
    with pytest.raises(ValueError):
        sb3_buffers.ReplayBuffer(40, space, act, optimize_memory_usage=True)
    ours = mp_sb3.ReplayBuffer(40, space, act, device="cpu", n_envs=2,
                               optimize_memory_usage=True)  # handle_timeout_termination=True
    for _ in range(50):
        envs.step([ours], act)
    got = ours.sample(400)
    done_rows = got.dones[:, 0].numpy() == 1
    for i in range(400):
        key = got.observations[i].numpy().tobytes()
        if key in envs.last:  # ended: truncated ones bootstrap (dones 0) from the true last obs
            assert np.array_equal(got.next_observations[i].numpy(), envs.last[key])
        else:
            assert not done_rows[i]
    ours.close()
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        mp_sb3.NStepReplayBuffer(40, space, act, optimize_memory_usage=True)


def test_dqn_with_optimize_memory_usage_trains_exactly_as_with_sb3s_own():
    """Same seed, same draws: the networks end bit-for-bit equal (the next observations
    of ended steps differ, and the target ignores them)."""
    params = []
    for cls in (sb3_buffers.ReplayBuffer, mp_sb3.ReplayBuffer):
        model = sb3.DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=cls,
                        replay_buffer_kwargs={"handle_timeout_termination": False},
                        optimize_memory_usage=True, learning_starts=100, buffer_size=300,
                        batch_size=32, train_freq=4, seed=7, device="cpu",
                        policy_kwargs={"net_arch": [16]})
        model.learn(700)  # the buffer wraps twice
        params.append(th.cat([p.detach().flatten() for p in model.policy.parameters()]))
        if cls is mp_sb3.ReplayBuffer:
            model.replay_buffer.close()
    assert th.equal(params[0], params[1])


def test_a_pickled_buffer_keeps_its_frame_options(tmp_path):
    import pickle

    envs = Envs(1, 4, (6, 5), seed=3)
    space, act = spaces.Box(0, 255, (4, 6, 5), np.uint8), spaces.Discrete(2)
    ours = mp_sb3.ReplayBuffer(50, space, act, device="cpu", optimize_memory_usage=True,
                               frame_stack=0)
    for _ in range(30):
        envs.step([ours], act)
    again = pickle.loads(pickle.dumps(ours))
    config = again.millpond_buffer.config
    assert config.frame_stack == (("obs", 0),) and config.next_of == (("next_obs", "obs"),)
    np.random.seed(0)
    a = ours.sample(64)
    np.random.seed(0)
    b = again.sample(64)
    for x, y in zip(a, b):
        assert (x is None and y is None) or th.equal(x, y)


# ---- real Atari: SB3's own wrappers ---------------------------------------------------------

@pytest.mark.parametrize("where_", ["local", pytest.param("server", marks=pytest.mark.daemon)])
def test_vecframestack_observations_are_stored_about_once_per_frame(where_, request):
    """Pong through SB3's make_atari_env, VecFrameStack(4) and VecTransposeImage (what a
    CnnPolicy sees: uint8[4, 84, 84], zero frames padding each episode's start), 4
    environments: the stored bytes per transition are about one 84x84 frame, and samples
    equal SB3's own optimize_memory_usage buffer's."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    import ale_py
    import gymnasium as gym
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack, VecTransposeImage

    gym.register_envs(ale_py)
    where = ({} if where_ == "local" else
             {"address": request.getfixturevalue("shared_server").address,
              "name": f"sb3-atari-{next(_names)}"})
    venv = VecTransposeImage(VecFrameStack(make_atari_env("PongNoFrameskip-v4", n_envs=4,
                                                          seed=0), 4))
    space, act = venv.observation_space, venv.action_space
    assert space.shape == (4, 84, 84)
    kwargs = {"n_envs": 4, "device": "cpu", "optimize_memory_usage": True,
              "handle_timeout_termination": False}
    ref = sb3_buffers.ReplayBuffer(2_000, space, act, **kwargs)
    ours = mp_sb3.ReplayBuffer(2_000, space, act, **kwargs, **where, frame_stack=0)
    obs = venv.reset()
    rng = np.random.default_rng(0)
    for _ in range(600):  # 2,400 transitions: the 2,000 held wrap
        action = rng.integers(act.n, size=4)
        nxt, reward, done, infos = venv.step(action)
        real_next = nxt.copy()
        for i in np.flatnonzero(done):
            real_next[i] = infos[i]["terminal_observation"]
        for buf in (ref, ours):
            buf.add(obs, real_next, action, reward, done, infos)
        obs = nxt
    venv.close()
    for seed in range(3):
        np.random.seed(seed)
        got = ours.sample(64)
        np.random.seed(seed)
        want = ref.sample(64)
        for name in ("observations", "actions", "dones", "rewards"):
            assert th.equal(getattr(got, name), getattr(want, name)), name
        going = got.dones[:, 0] == 0  # (an ended step's: see the module doc)
        assert th.equal(got.next_observations[going], want.next_observations[going])
    info = ours.millpond_buffer.info()
    frame = 84 * 84
    assert info.size == 2_000 and info.logical_bytes >= 2_000 * 8 * frame
    per = info.stored_bytes / info.size
    assert per < 1.2 * frame, per  # one frame per transition (plain: 8)
    print(f"Pong, VecFrameStack(4), 4 envs: {per:,.0f} stored bytes per transition, "
          f"plain {info.logical_bytes / info.size:,.0f} ({info.logical_bytes / info.stored_bytes:.1f}x)")
    ours.close()
