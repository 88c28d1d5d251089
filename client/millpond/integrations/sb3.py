"""Stable-Baselines3 replay buffers whose records live in millpond.

Pass :class:`ReplayBuffer` (or, for ``spaces.Dict`` observations,
:class:`DictReplayBuffer`) to any SB3 off-policy algorithm (DQN, SAC, TD3,
DDPG)::

    from stable_baselines3 import DQN
    from millpond.integrations.sb3 import ReplayBuffer

    model = DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=ReplayBuffer,
                replay_buffer_kwargs={"address": "localhost:50051", "name": "dqn"})

Without ``address``/``name`` the buffer is an in-process millpond buffer.

Contract (the same as SB3's own buffers, checked against them in the tests):

* SB3 passes ``buffer_size``; as in SB3 the buffer keeps ``buffer_size //
  n_envs`` steps of all ``n_envs`` environments, i.e. that many times
  ``n_envs`` transitions, and evicts the oldest step first.
* ``add(obs, next_obs, action, reward, done, infos)`` stores one transition per
  environment as one millpond record, in SB3's dtypes (observations in the
  space's dtype, actions cast from float64 to float32, rewards float32).
* ``sample(batch_size, env)`` draws transitions uniformly with replacement (as
  SB3 draws a step and an environment uniformly) and returns SB3's
  ``ReplayBufferSamples`` (``DictReplayBufferSamples``): ``observations``
  ``[B, *obs_shape]``, ``actions [B, action_dim]``, ``dones [B, 1]`` and
  ``rewards [B, 1]`` float32, on the algorithm's device; ``env`` (a
  ``VecNormalize``) normalizes observations and rewards as SB3 does. The
  indices are drawn from numpy's global generator exactly as SB3 draws them
  and read with ``sample_by_index``: with the same seed an algorithm trains
  exactly as with SB3's own buffer (a test checks it). Steps are counted by
  this object's adds (``pos``, ``full``), as SB3 counts them; a server buffer
  shared with other writers is read within the steps this object knows of.
* ``handle_timeout_termination=True`` (SB3's default): a step whose info has
  ``TimeLimit.truncated`` samples with ``dones == 0`` (the learner bootstraps
  through a time limit); with ``False``, every ``done`` samples as 1.
* Records are stored with millpond's transition names and their true meaning:
  ``obs``, ``next_obs``, ``actions``, ``rewards``, ``terminated`` (done and not a
  time limit) and ``truncated`` (done by a time limit), so
  ``buffer.millpond_buffer.export(path)`` makes an offline dataset of the run.
  Dict observations are stored as ``obs_<key>`` and ``next_obs_<key>``.

Not supported: ``optimize_memory_usage=True`` (raises ValueError: millpond
stores ``next_obs`` beside ``obs``), SB3's ``NStepReplayBuffer`` arguments, and
``HerReplayBuffer``. There is no prioritized variant: SB3's algorithms never
hand TD errors back to their buffer (no hook for ``update_priorities``), so a
prioritized buffer would silently behave as a uniform one; use millpond's
``PrioritizedReplayBuffer`` directly in your own training loop instead.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from gymnasium import spaces
from stable_baselines3.common import buffers as sb3
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from millpond.api import MmapReplayBuffer as _MmapBuffer
from millpond.api import ReplayBuffer as _RamBuffer
from millpond.errors import InvalidConfigError, NotEnoughDataError

# A server buffer's adds in flight (see millpond.connect's max_in_flight): ``add`` returns
# once its step is sent, and ``sample`` (which reads) waits for them first.
MAX_IN_FLIGHT = 32


class _MillpondStorage:
    """What both classes share: the millpond handle, ``add``'s flags, sampling.

    Attributes set by SB3's ``BaseBuffer.__init__`` (``buffer_size``,
    ``n_envs``, ``obs_shape``, ``action_dim``, ``device``, ``pos``, ``full``)
    keep SB3's meaning. ``millpond_buffer`` is the millpond handle.
    """

    buffer_size: int
    n_envs: int
    pos: int
    full: bool
    action_dim: int
    action_space: spaces.Space
    observation_space: Any
    handle_timeout_termination: bool
    optimize_memory_usage: bool
    millpond_buffer: Any

    def _setup(self, buffer_size: int, optimize_memory_usage: bool,
               handle_timeout_termination: bool, obs_fields: dict[str, Any],
               address: str | Sequence[str] | None, name: str | None, token: str | None,
               hot_capacity: int | None, cold_path: str | None, max_in_flight: int) -> None:
        if optimize_memory_usage:
            raise ValueError(
                "millpond's SB3 replay buffers do not support optimize_memory_usage=True "
                "(next observations are stored beside observations); pass "
                "optimize_memory_usage=False")
        if name is not None and address is None:
            raise InvalidConfigError("name= names a server's buffer: give address= as well")
        self.buffer_size = max(buffer_size // self.n_envs, 1)  # steps, as in SB3
        self.optimize_memory_usage = False
        self.handle_timeout_termination = handle_timeout_termination
        act_dtype = sb3.ReplayBuffer._maybe_cast_dtype(self.action_space.dtype)
        fields = {**obs_fields,
                  "actions": (act_dtype, (self.action_dim,)),
                  "rewards": ("float32", ()),
                  "terminated": ("bool", ()),
                  "truncated": ("bool", ())}
        capacity = self.buffer_size * self.n_envs
        self._in_process = address is None
        if hot_capacity is None:
            self.millpond_buffer = _RamBuffer(capacity, fields=fields, address=address, name=name,
                                              token=token, max_in_flight=max_in_flight)
        else:
            self.millpond_buffer = _MmapBuffer(hot_capacity, capacity, cold_path=cold_path,
                                               fields=fields, address=address, name=name,
                                               token=token, max_in_flight=max_in_flight)
        held = len(self.millpond_buffer) // self.n_envs  # an existing server buffer's steps
        self.pos, self.full = held % self.buffer_size, held >= self.buffer_size

    def _flags(self, done: np.ndarray, infos: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """``terminated``/``truncated`` columns from SB3's ``done`` and ``infos``."""
        done = np.asarray(done).reshape(self.n_envs).astype(bool)
        timeout = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos],
                           dtype=bool).reshape(self.n_envs)
        return {"terminated": done & ~timeout, "truncated": done & timeout}

    def _store(self, columns: dict[str, np.ndarray]) -> None:
        """Push one step of every environment (``n_envs`` records); advance ``pos``."""
        self.millpond_buffer.push_batch(**columns)
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
            self.pos = 0

    def _draw(self, batch_size: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """A uniform sample, its ``dones [B, 1]`` and raw ``rewards [B, 1]`` (float32).

        Drawn exactly as SB3 draws (a step, then an environment, from numpy's global
        generator), and read by position: with the same seed, the same batches as
        SB3's own buffer holding the same transitions."""
        rows = self.buffer_size if self.full else self.pos
        if rows == 0:
            raise NotEnoughDataError("the replay buffer is empty")
        steps = np.random.randint(0, rows, size=batch_size)
        envs = np.random.randint(0, high=self.n_envs, size=(batch_size,))
        if self.full:  # SB3's ring slot -> millpond's position (0 = the oldest step)
            steps = (steps - self.pos) % self.buffer_size
        batch = self.millpond_buffer.sample_by_index(steps * self.n_envs + envs)
        dones = batch["terminated"]
        if not self.handle_timeout_termination:
            dones = dones | batch["truncated"]
        return (batch, dones.astype(np.float32).reshape(-1, 1),
                batch["rewards"].astype(np.float32).reshape(-1, 1))

    def size(self) -> int:
        """Steps held (records // ``n_envs``), as SB3 counts: at most ``buffer_size``."""
        return min(len(self.millpond_buffer) // self.n_envs, self.buffer_size)

    def reset(self) -> None:
        """Drop every record (the millpond buffer keeps its config); ``pos = 0``."""
        self.pos = 0
        self.full = False
        self.millpond_buffer.reset()

    def close(self) -> None:
        """Close the millpond handle (deleting the buffer if this handle created it)."""
        self.millpond_buffer.close()

    def __getstate__(self) -> dict[str, Any]:
        """For SB3's ``save_replay_buffer``: a server's buffer pickles as its address and
        name (unpickling attaches to it); an in-process one carries its records."""
        state = dict(self.__dict__)
        buf = self.millpond_buffer
        if self._in_process:
            state["millpond_buffer"] = {"capacity": buf.total_capacity,
                                        "hot_capacity": buf.hot_capacity,
                                        "fields": buf.schema.spec(), "records": buf.sample_all()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        saved = state["millpond_buffer"]
        if state.get("_in_process") and isinstance(saved, dict):
            buf: Any
            if saved["hot_capacity"] < saved["capacity"]:
                buf = _MmapBuffer(saved["hot_capacity"], saved["capacity"], fields=saved["fields"])
            else:
                buf = _RamBuffer(saved["capacity"], fields=saved["fields"])
            if len(next(iter(saved["records"].values()))):
                buf.push_batch(**saved["records"])
            state = {**state, "millpond_buffer": buf}
        self.__dict__.update(state)

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        raise NotImplementedError(
            "millpond draws the transitions itself: call sample(batch_size, env)")


def _check_obs_shape(value: Any, n_envs: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``value`` as ``[n_envs, *shape]`` in ``dtype`` (SB3 casts on assignment too)."""
    return np.asarray(value).reshape((n_envs, *shape)).astype(dtype, copy=False)


class ReplayBuffer(_MillpondStorage, sb3.ReplayBuffer):
    """SB3's ``ReplayBuffer`` (Box, Discrete, MultiDiscrete, MultiBinary observations).

    Arguments are SB3's, plus keyword-only ``address``/``name`` (the server
    buffer to create or attach to; none: in-process), ``token``,
    ``hot_capacity``/``cold_path`` (keep only ``hot_capacity`` records in RAM
    and spill the rest to a memory-mapped file) and ``max_in_flight`` (adds
    sent to a server before the first is acknowledged; ``sample`` waits for
    them). See the module docstring.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: Any = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        address: str | Sequence[str] | None = None,
        name: str | None = None,
        token: str | None = None,
        hot_capacity: int | None = None,
        cold_path: str | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
    ):
        if isinstance(observation_space, spaces.Dict):
            raise ValueError("Dict observation spaces need "
                             "millpond.integrations.sb3.DictReplayBuffer (as in SB3)")
        sb3.BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device,
                                n_envs=n_envs)
        shape = (observation_space.dtype, self.obs_shape)
        self._setup(buffer_size, optimize_memory_usage, handle_timeout_termination,
                    {"obs": shape, "next_obs": shape}, address, name, token, hot_capacity,
                    cold_path, max_in_flight)

    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Store one step of every environment (SB3's ``add``)."""
        n, dtype = self.n_envs, self.observation_space.dtype
        self._store({
            "obs": _check_obs_shape(obs, n, self.obs_shape, dtype),
            "next_obs": _check_obs_shape(next_obs, n, self.obs_shape, dtype),
            "actions": np.asarray(action).reshape((n, self.action_dim)).astype(
                self._maybe_cast_dtype(self.action_space.dtype), copy=False),
            "rewards": np.asarray(reward, dtype=np.float32).reshape(n),
            **self._flags(done, infos),
        })

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """``batch_size`` uniform draws as SB3's ``ReplayBufferSamples``."""
        batch, dones, rewards = self._draw(batch_size)
        data = (
            self._normalize_obs(batch["obs"], env),
            batch["actions"],
            self._normalize_obs(batch["next_obs"], env),
            dones,
            self._normalize_reward(rewards, env),
        )
        return ReplayBufferSamples(*(self.to_torch(array) for array in data))  # type: ignore[arg-type]


class DictReplayBuffer(_MillpondStorage, sb3.DictReplayBuffer):
    """SB3's ``DictReplayBuffer`` (``spaces.Dict`` observations); same extra arguments
    as :class:`ReplayBuffer`. Keys must be Python identifiers (they name fields)."""

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        device: Any = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        address: str | Sequence[str] | None = None,
        name: str | None = None,
        token: str | None = None,
        hot_capacity: int | None = None,
        cold_path: str | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
    ):
        if not isinstance(observation_space, spaces.Dict):
            raise ValueError("DictReplayBuffer needs a spaces.Dict observation space")
        sb3.BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device,
                                n_envs=n_envs)
        fields: dict[str, Any] = {}
        for prefix in ("obs", "next_obs"):
            for key, shape in self.obs_shape.items():
                if not key.isidentifier():
                    raise ValueError(f"observation key {key!r} is not a Python identifier")
                fields[f"{prefix}_{key}"] = (observation_space[key].dtype, shape)
        self._setup(buffer_size, optimize_memory_usage, handle_timeout_termination, fields,
                    address, name, token, hot_capacity, cold_path, max_in_flight)

    def add(self, obs: dict[str, np.ndarray], next_obs: dict[str, np.ndarray],  # type: ignore[override]
            action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        """Store one step of every environment (SB3's ``add``)."""
        n = self.n_envs
        columns: dict[str, np.ndarray] = {}
        for prefix, value in (("obs", obs), ("next_obs", next_obs)):
            for key, shape in self.obs_shape.items():
                dtype = self.observation_space[key].dtype
                columns[f"{prefix}_{key}"] = _check_obs_shape(value[key], n, shape, dtype)
        columns["actions"] = np.asarray(action).reshape((n, self.action_dim)).astype(
            self._maybe_cast_dtype(self.action_space.dtype), copy=False)
        columns["rewards"] = np.asarray(reward, dtype=np.float32).reshape(n)
        self._store({**columns, **self._flags(done, infos)})

    def sample(self, batch_size: int,  # type: ignore[override]
               env: VecNormalize | None = None) -> DictReplayBufferSamples:
        """``batch_size`` uniform draws as SB3's ``DictReplayBufferSamples``."""
        batch, dones, rewards = self._draw(batch_size)
        obs, next_obs = ({key: batch[f"{prefix}_{key}"] for key in self.obs_shape}
                         for prefix in ("obs", "next_obs"))
        obs_, next_obs_ = self._normalize_obs(obs, env), self._normalize_obs(next_obs, env)
        assert isinstance(obs_, dict) and isinstance(next_obs_, dict)
        return DictReplayBufferSamples(
            observations={key: self.to_torch(value) for key, value in obs_.items()},
            actions=self.to_torch(batch["actions"]),
            next_observations={key: self.to_torch(value) for key, value in next_obs_.items()},
            dones=self.to_torch(dones),
            rewards=self.to_torch(self._normalize_reward(rewards, env)),
        )
