"""millpond.integrations.sb3.NStepReplayBuffer against SB3's own NStepReplayBuffer, and the
adapter's local chunk of adds, in-process and on a real daemon.

Both buffers get the same random episodes (terminations and time-limit truncations at
random steps, several environments, the ring wrapping); with numpy's global generator
seeded alike, each sample of ours must equal SB3's field by field (observations, actions,
next_observations, dones, n-step rewards, discounts), including samples taken while the
newest steps are still in the adapter's local chunk.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("private_tmpdir")  # SB3 logs go there

_names = itertools.count()
sb3 = th = spaces = sb3_buffers = DummyVecEnv = VecNormalize = mp_sb3 = gym = None


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


@pytest.fixture(params=["local", pytest.param("server", marks=pytest.mark.daemon)])
def where(request):
    """In-process, or on the shared same-host server (shared memory)."""
    if request.param == "local":
        return {}
    return {"address": request.getfixturevalue("shared_server").address,
            "name": f"nstep-{next(_names)}"}


def feed(buffers, steps, n_envs, obs_space, act_space, rng, start=0):
    """The same ``steps`` random steps into every buffer; ``obs[:, 0]`` is the transition
    id, ``next_obs = obs + 0.5``; each environment terminates with p=0.1 and is truncated
    with p=0.1 at each step."""
    for t in range(start, start + steps):
        ids = t * n_envs + np.arange(n_envs)
        obs = rng.normal(size=(n_envs, *obs_space.shape)).astype(obs_space.dtype)
        obs[:, 0] = ids
        next_obs = obs + 0.5
        action = np.array([act_space.sample() for _ in range(n_envs)])
        reward = rng.normal(size=n_envs).astype(np.float32)
        terminated = rng.random(n_envs) < 0.1
        truncated = ~terminated & (rng.random(n_envs) < 0.1)
        infos = [{"TimeLimit.truncated": bool(x)} for x in truncated]
        for buf in buffers:
            buf.add(obs.copy(), next_obs.copy(), action.copy(), reward.copy(),
                    terminated | truncated, infos)


def assert_same_samples(ours, ref, batch_size=256, seed=0, env=None):
    np.random.seed(seed)
    got = ours.sample(batch_size, env=env)
    np.random.seed(seed)
    want = ref.sample(batch_size, env=env)
    for name in ("observations", "actions", "next_observations", "dones", "rewards",
                 "discounts"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, name
        assert th.equal(a, b), name
    return got


@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("timeouts", [True, False])
@pytest.mark.parametrize("n_steps", [1, 3, 5])
def test_nstep_samples_equal_sb3s(where, n_envs, timeouts, n_steps):
    obs_space = spaces.Box(-10, 10, (3,), np.float32)
    act_space = spaces.Discrete(4)
    kwargs = {"n_envs": n_envs, "handle_timeout_termination": timeouts, "device": "cpu",
              "n_steps": n_steps, "gamma": 0.9}
    ref = sb3_buffers.NStepReplayBuffer(90, obs_space, act_space, **kwargs)
    ours = mp_sb3.NStepReplayBuffer(90, obs_space, act_space, **kwargs, **where)
    rng = np.random.default_rng(n_steps * 10 + n_envs)
    t, cut, whole = 0, False, False
    for chunk in (7, 13, 1, 40, 29, 3, 61):  # before full, at, across and past the wrap
        feed([ref, ours], chunk, n_envs, obs_space, act_space, rng, start=t)
        t += chunk
        assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size())
        got = assert_same_samples(ours, ref, seed=t)
        cut |= bool((got.discounts > 0.9 ** n_steps + 1e-6).any())
        whole |= bool(th.isclose(got.discounts, th.tensor(0.9 ** n_steps)).any())
    assert whole and (cut or n_steps == 1)  # windows cut short by an episode's end, and not
    ours.close()


def test_nstep_rewards_are_normalized_step_by_step_as_sb3_does(where):
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]), clip_reward=0.7)
    venv.ret_rms.var = 4.0  # clipping makes the normalized sum differ from the sum's
    space, act = venv.observation_space, venv.action_space
    ref = sb3_buffers.NStepReplayBuffer(200, space, act, device="cpu", n_steps=4)
    ours = mp_sb3.NStepReplayBuffer(200, space, act, device="cpu", n_steps=4, **where)
    feed([ref, ours], 150, 1, space, act, np.random.default_rng(4))
    assert_same_samples(ours, ref, env=venv)
    ours.close()
    venv.close()


def test_nstep_is_a_valid_n_step_transition_of_what_was_added(where):
    """Independently of SB3's code: every sample is the n-step transition of SB3's
    definition, recomputed from the steps as added."""
    n_envs, n_steps, gamma = 2, 4, 0.95
    obs_space, act_space = spaces.Box(-10, 10, (2,), np.float32), spaces.Discrete(2)
    ours = mp_sb3.NStepReplayBuffer(60, obs_space, act_space, device="cpu", n_envs=n_envs,
                                    n_steps=n_steps, gamma=gamma, **where)
    rng = np.random.default_rng(9)
    log = []  # (ids, rewards, terminated, truncated) per step
    for t in range(47):
        ids = t * n_envs + np.arange(n_envs)
        obs = np.stack([ids, np.zeros(n_envs)], axis=1).astype(np.float32)
        reward = rng.normal(size=n_envs).astype(np.float32)
        term = rng.random(n_envs) < 0.15
        trunc = ~term & (rng.random(n_envs) < 0.15)
        log.append((reward, term, trunc))
        ours.add(obs, obs + 0.5, np.zeros(n_envs), reward, term | trunc,
                 [{"TimeLimit.truncated": bool(x)} for x in trunc])
    newest = 46
    oldest = newest - 30 + 1  # 30 steps of 2 environments held
    got = ours.sample(2_000)
    seen = set()
    for i in range(2_000):
        tid = int(got.observations[i, 0])
        step, env = divmod(tid, n_envs)
        assert oldest <= step <= newest
        ret, k = 0.0, 0
        while True:
            reward, term, trunc = log[step + k]
            ret += gamma ** k * reward[env]
            if term[env] or trunc[env] or k == n_steps - 1 or step + k == newest:
                break
            k += 1
        last = step + k
        assert int(got.next_observations[i, 0] - 0.5) == last * n_envs + env
        assert got.rewards[i, 0].item() == pytest.approx(ret, rel=1e-5, abs=1e-5)
        assert got.discounts[i, 0].item() == pytest.approx(gamma ** (k + 1))
        assert got.dones[i, 0].item() == float(log[last][1][env])
        seen.add(tid)
    assert len(seen) > 0.95 * 60  # uniform over the 60 transitions held
    ours.close()


def test_dqn_with_nstep_trains_exactly_as_with_sb3s_own(where):
    """Same seed, same draws: the networks end bit-for-bit equal."""
    params = []
    for cls, kwargs in ((sb3_buffers.NStepReplayBuffer, {}), (mp_sb3.NStepReplayBuffer, where)):
        model = sb3.DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=cls,
                        replay_buffer_kwargs={"n_steps": 3, **kwargs}, learning_starts=100,
                        buffer_size=300, batch_size=32, train_freq=4, seed=7, device="cpu",
                        policy_kwargs={"net_arch": [16]})
        model.learn(600)  # the buffer wraps twice
        params.append(th.cat([p.detach().flatten() for p in model.policy.parameters()]))
        model.replay_buffer.close() if cls is mp_sb3.NStepReplayBuffer else None
    assert th.equal(params[0], params[1])


@pytest.mark.daemon
def test_nstep_attaches_to_a_server_buffer_it_did_not_fill(shared_server):
    obs_space, act_space = spaces.Box(-10, 10, (3,), np.float32), spaces.Discrete(2)
    kwargs = {"n_envs": 2, "device": "cpu", "n_steps": 3}
    name = f"nstep-attach-{next(_names)}"
    ref = sb3_buffers.NStepReplayBuffer(100, obs_space, act_space, **kwargs)
    first = mp_sb3.NStepReplayBuffer(100, obs_space, act_space, **kwargs,
                                     address=shared_server.address, name=name)
    feed([ref, first], 30, 2, obs_space, act_space, np.random.default_rng(5))
    first.flush()
    second = mp_sb3.NStepReplayBuffer(100, obs_space, act_space, **kwargs,
                                      address=shared_server.address, name=name)
    assert (second.pos, second.full) == (ref.pos, ref.full)
    assert_same_samples(second, ref)
    second.close()
    first.close()


def test_the_local_chunk_is_read_and_pushed(where):
    """Adds wait in the local chunk; samples read them; the handle sees all of them."""
    obs_space, act_space = spaces.Box(-10, 10, (3,), np.float32), spaces.Discrete(2)
    ref = sb3_buffers.ReplayBuffer(1_000, obs_space, act_space, device="cpu")
    ours = mp_sb3.ReplayBuffer(1_000, obs_space, act_space, device="cpu", **where)
    rng = np.random.default_rng(6)
    feed([ref, ours], 300, 1, obs_space, act_space, rng)  # one chunk pushed, 44 steps in the next
    assert 0 < ours._staged < 300
    np.random.seed(1)
    got = ours.sample(512)
    np.random.seed(1)
    want = ref.sample(512)
    for a, b in zip(got, want):
        if b is not None:
            assert th.equal(a, b)
    assert (got.observations[:, 0] >= 256).any()  # some were still in the chunk
    assert len(ours.millpond_buffer) == 300 and ours._staged == 0
    ours.close()
