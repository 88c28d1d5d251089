"""Stable-Baselines3 replay buffers whose records live in millpond.

Pass :class:`ReplayBuffer` (or, for ``spaces.Dict`` observations,
:class:`DictReplayBuffer`; for n-step returns, :class:`NStepReplayBuffer`) to any
SB3 off-policy algorithm (DQN, SAC, TD3, DDPG)::

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
  Adds are written into a local chunk (up to ``CHUNK_STEPS`` steps and about
  ``CHUNK_BYTES``) that is pushed to millpond as one ``push_batch`` when full, on
  ``flush()``/``close()``/pickling, and whenever ``buffer.millpond_buffer`` is
  read; ``sample`` reads the steps still in the chunk from it, so it sees every
  add (read-your-writes), as SB3's own buffer does. Other readers of a server
  buffer see a step once its chunk is pushed; a crash loses at most one chunk;
  a failed push raises from the ``add`` (or ``flush``) that sends its chunk.
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

* :class:`NStepReplayBuffer` takes SB3's ``n_steps`` and ``gamma`` and computes
  n-step returns at sample time exactly as SB3's ``NStepReplayBuffer`` (see the
  class); with the same seed its batches equal SB3's.

* ``optimize_memory_usage=True`` (:class:`ReplayBuffer`, :class:`DictReplayBuffer`)
  stores each next observation once: the millpond buffer is made with
  ``next_of={"next_obs": "obs"}`` (see :mod:`millpond.core.frames`), so a step's
  ``next_obs`` shares the storage of the next step's ``obs`` of the same
  environment and is stored apart only where it differs (an episode's last
  step). Draws are SB3's for this variant: once the ring is full, the oldest
  step is never drawn. Samples equal SB3's own buffer's, except the
  ``next_observations`` of a step that ended an episode: SB3 keeps one array
  and returns the next episode's first observation there (its target ignores
  it, ``dones`` being 1; it refuses time limits for that reason, SB3 issue
  #934), millpond returns the step's true last observation. So time limits
  work: ``handle_timeout_termination=True`` is allowed with it.
* ``frame_stack=axis`` (keyword): observations are stacks of frames along
  ``axis`` (SB3's ``VecFrameStack`` stacks along the channel axis: 0 after
  ``VecTransposeImage``, as SB3's CNN policies see Atari, -1 before it); each
  frame is stored once (``frame_stack={"obs": axis}``), with or without
  ``optimize_memory_usage``. ``frame_capacity`` (keyword): frames each store
  holds (default: 1.25 per transition held or pushed at once with
  ``frame_stack``, enough for episodes of 8 steps or more; 2 without, which
  always suffices; see :mod:`millpond.core.frames`). A store too small makes
  an ``add`` raise ``StorageFullError``.

Not supported: ``HerReplayBuffer``, ``optimize_memory_usage`` with
:class:`NStepReplayBuffer` (as in SB3). There is no
prioritized variant: SB3's algorithms never hand TD errors back to their buffer
(no hook for ``update_priorities``), so a prioritized buffer would silently
behave as a uniform one; use millpond's ``PrioritizedReplayBuffer`` directly
in your own training loop instead.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common import buffers as sb3
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from millpond.api import MmapReplayBuffer as _MmapBuffer
from millpond.api import ReplayBuffer as _RamBuffer
from millpond.errors import InvalidConfigError, NotEnoughDataError

# A server buffer's pushes in flight (see millpond.connect's max_in_flight): a push returns
# once its chunk is sent, and every read waits for them first.
MAX_IN_FLIGHT = 32
# ``add`` writes into a local chunk of at most this many steps (and about CHUNK_BYTES), pushed
# to millpond as one ``push_batch`` when full, or when anything reads the millpond handle.
CHUNK_STEPS = 256
CHUNK_BYTES = 1 << 20


class _MillpondStorage:
    """What the classes share: the millpond handle, the local chunk of adds, reads by slot.

    Attributes set by SB3's ``BaseBuffer.__init__`` (``buffer_size``,
    ``n_envs``, ``obs_shape``, ``action_dim``, ``device``, ``pos``, ``full``)
    keep SB3's meaning. ``millpond_buffer`` is the millpond handle (reading the
    attribute first pushes the adds still in the local chunk).
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
    device: th.device
    _handle: Any

    def _setup(self, buffer_size: int, optimize_memory_usage: bool,
               handle_timeout_termination: bool, obs_fields: dict[str, Any],
               address: str | Sequence[str] | None, name: str | None, token: str | None,
               hot_capacity: int | None, cold_path: str | None, max_in_flight: int,
               frame_stack: dict[str, int] | None = None, frame_capacity: int | None = None
               ) -> None:
        if name is not None and address is None:
            raise InvalidConfigError("name= names a server's buffer: give address= as well")
        self.buffer_size = max(buffer_size // self.n_envs, 1)  # steps, as in SB3
        self.optimize_memory_usage = bool(optimize_memory_usage)
        # next_obs fields are the obs fields with "next_" in front (obs, obs_<key>)
        sources = [name for name in obs_fields if name.startswith("obs")]
        frames: dict[str, Any] = {}
        if self.optimize_memory_usage:
            frames["next_of"] = {"next_" + source: source for source in sources}
        if frame_stack:  # {obs field: axis}; next_obs fields are stacks too, or next_of them
            frames["frame_stack"] = dict(frame_stack)
            if not self.optimize_memory_usage:
                frames["frame_stack"].update({"next_" + k: v for k, v in frame_stack.items()})
        if frames and frame_capacity is None:
            # The ring holds the live transitions' frames and those of a chunk being
            # pushed. A stack adds about one frame per step (plus a few per episode's
            # start); a single observation, one, and one more where an episode ends:
            # two always suffice.
            chunk = min(CHUNK_STEPS, self.buffer_size) * self.n_envs
            per = 1.25 if frame_stack else 2.0
            frame_capacity = int(per * (self.buffer_size * self.n_envs + chunk)) + 64
        if frame_capacity is not None:
            frames["frame_capacity"] = frame_capacity
        self._frames = frames
        self.handle_timeout_termination = handle_timeout_termination
        act_dtype = sb3.ReplayBuffer._maybe_cast_dtype(self.action_space.dtype)
        fields = {**obs_fields,
                  "actions": (act_dtype, (self.action_dim,)),
                  "rewards": ("float32", ()),
                  "terminated": ("bool", ()),
                  "truncated": ("bool", ())}
        capacity = self.buffer_size * self.n_envs
        self._in_process = address is None
        # SB3's buffer is its own writer and reader: a server's buffer is made (or found)
        # now, as SB3's is, not on the first add (millpond's classes' default).
        if hot_capacity is None:
            self._handle = _RamBuffer(capacity, fields=fields, address=address, name=name,
                                      token=token, max_in_flight=max_in_flight, create=True, **frames)
        else:
            self._handle = _MmapBuffer(hot_capacity, capacity, cold_path=cold_path,
                                       fields=fields, address=address, name=name,
                                       token=token, max_in_flight=max_in_flight, create=True, **frames)
        held = len(self._handle) // self.n_envs  # an existing server buffer's steps
        self.pos, self.full = held % self.buffer_size, held >= self.buffer_size
        self._stored = min(held, self.buffer_size)  # steps in millpond that this object counts
        self._new_chunk(self._handle.schema.spec())

    def _new_chunk(self, spec: dict[str, Any]) -> None:
        """The local chunk: ``{field: array[steps, n_envs, *shape]}``, none staged yet."""
        step_nbytes = sum(np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
                          for dtype, shape in spec.values()) * self.n_envs
        steps = max(1, min(CHUNK_STEPS, CHUNK_BYTES // max(step_nbytes, 1), self.buffer_size))
        self._chunk = {name: np.zeros((steps, self.n_envs, *shape), dtype)
                       for name, (dtype, shape) in spec.items()}
        # The same memory as [steps * n_envs, *shape]: a row (step * n_envs + env) per record
        self._chunk_rows = {name: column.reshape(-1, *column.shape[2:])
                            for name, column in self._chunk.items()}
        self._staged = 0

    @property
    def millpond_buffer(self) -> Any:
        """The millpond handle, holding every step added so far (pushes the local chunk)."""
        self.flush()
        return self._handle

    def flush(self) -> None:
        """Push the steps of the local chunk to millpond and wait until they are stored."""
        self._push_chunk()
        self._handle.flush()

    def _push_chunk(self) -> None:
        if self._staged:
            n = self._staged * self.n_envs
            self._handle.push_batch(**{name: column[:self._staged].reshape(n, *column.shape[2:])
                                       for name, column in self._chunk.items()})
            self._stored = min(self.buffer_size, self._stored + self._staged)
            self._staged = 0

    def _stage(self, columns: dict[str, Any], done: np.ndarray,
               infos: list[dict[str, Any]]) -> None:
        """Write one step of every environment into the chunk (casting as SB3 does on
        assignment); push the chunk once full; advance ``pos``."""
        row = self._staged
        chunk = self._chunk
        for name, value in columns.items():
            chunk[name][row] = value
        done = np.asarray(done).reshape(self.n_envs).astype(bool)
        timeout = np.fromiter((info.get("TimeLimit.truncated", False) for info in infos),
                              dtype=bool, count=self.n_envs)
        chunk["terminated"][row] = done & ~timeout
        chunk["truncated"][row] = done & timeout
        self._mirror(done, timeout, columns["rewards"])
        self._staged = row + 1
        if self._staged == len(chunk["rewards"]):
            self._push_chunk()
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
            self.pos = 0

    def _mirror(self, done: np.ndarray, timeout: np.ndarray, reward: Any) -> None:
        """NStepReplayBuffer keeps SB3's rewards, dones and timeouts of every slot."""

    def _gather(self, slots: np.ndarray, envs: np.ndarray,
                fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The records of SB3's ring ``slots`` (steps) and ``envs``, in that order: from
        millpond, or from the local chunk for the steps still in it."""
        steps = self.buffer_size if self.full else self.pos
        # SB3's ring slot -> the step's age order (0 = the oldest step held)
        order = (slots - self.pos) % self.buffer_size if self.full else slots
        first_staged = steps - self._staged  # the chunk holds the newest steps
        offset = self._stored - first_staged  # steps in millpond evicted since (SB3's view)
        positions = order + offset
        if self.n_envs > 1:
            positions = positions * self.n_envs + envs
        if not self._staged or order.max() < first_staged:  # all in millpond: one read
            return self._read(positions, fields)
        names = list(self._chunk) if fields is None else list(fields)
        in_chunk = np.flatnonzero(order >= first_staged)
        rows = (order[in_chunk] - first_staged) * self.n_envs + envs[in_chunk]
        if len(in_chunk) == len(slots):  # all in the chunk
            return {name: self._chunk_rows[name].take(rows, axis=0) for name in names}
        # One read of every draw (those in the chunk read as position 0, which exists:
        # millpond holds steps), then the chunk's rows written over theirs.
        positions[in_chunk] = 0
        out = self._read(positions, names)
        for name in names:
            batch = out[name]
            if not batch.flags.writeable:
                out[name] = batch = batch.copy()
            batch[in_chunk] = self._chunk_rows[name].take(rows, axis=0)
        return out

    def _read(self, positions: np.ndarray, fields: Sequence[str] | None) -> dict[str, np.ndarray]:
        return self._handle.sample_by_index(positions, fields)

    def _draw(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """SB3's draw: slots (steps) from ``BaseBuffer.sample``, then environments, from
        numpy's global generator."""
        rows = self.buffer_size if self.full else self.pos
        if rows == 0:
            raise NotEnoughDataError("the replay buffer is empty")
        if self.optimize_memory_usage and self.full:
            # SB3's variant never draws the oldest step (its slot holds the newest
            # next_obs): the same draws, the same samples
            slots = (np.random.randint(1, self.buffer_size, size=batch_size) + self.pos
                     ) % self.buffer_size
        else:
            slots = np.random.randint(0, rows, size=batch_size)
        return slots, np.random.randint(0, high=self.n_envs, size=(batch_size,))

    def _sample_rows(self, batch_size: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """A uniform sample, its ``dones [B, 1]`` and raw ``rewards [B, 1]`` (float32).

        Drawn exactly as SB3 draws and read by position: with the same seed, the same
        batches as SB3's own buffer holding the same transitions."""
        batch = self._gather(*self._draw(batch_size))
        dones = batch["terminated"]
        if not self.handle_timeout_termination:
            dones = dones | batch["truncated"]
        return (batch, dones.astype(np.float32).reshape(-1, 1),
                batch["rewards"].astype(np.float32, copy=False).reshape(-1, 1))

    def size(self) -> int:
        """Steps held, as SB3 counts: at most ``buffer_size``."""
        return self.buffer_size if self.full else self.pos

    def reset(self) -> None:
        """Drop every record (the millpond buffer keeps its config); ``pos = 0``."""
        self.pos = 0
        self.full = False
        self._staged = 0
        self._stored = 0
        self._handle.reset()

    def close(self) -> None:
        """Push the local chunk and close the millpond handle (deleting the buffer if this
        handle created it)."""
        try:
            self._push_chunk()
        finally:
            self._handle.close()

    def __getstate__(self) -> dict[str, Any]:
        """For SB3's ``save_replay_buffer``: a server's buffer pickles as its address and
        name (unpickling attaches to it); an in-process one carries its records. The
        local chunk is pushed first."""
        self.flush()
        state = dict(self.__dict__)
        buf = self._handle
        del state["_chunk"]
        state["_chunk_spec"] = buf.schema.spec()
        if self._in_process:
            state["_handle"] = {"capacity": buf.total_capacity,
                                "hot_capacity": buf.hot_capacity,
                                "fields": buf.schema.spec(), "records": buf.sample_all(),
                                "frames": self._frames}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        saved = state.pop("_handle")
        if state.get("_in_process") and isinstance(saved, dict):
            buf: Any
            frames = saved.get("frames") or {}
            if saved["hot_capacity"] < saved["capacity"]:
                buf = _MmapBuffer(saved["hot_capacity"], saved["capacity"], fields=saved["fields"],
                                  **frames)
            else:
                buf = _RamBuffer(saved["capacity"], fields=saved["fields"], **frames)
            if len(next(iter(saved["records"].values()))):
                buf.push_batch(**saved["records"])
            saved = buf
        spec = state.pop("_chunk_spec")
        self.__dict__.update(state)
        self._handle = saved
        self._new_chunk(spec)

    def _tensor(self, array: np.ndarray) -> th.Tensor:
        """SB3's ``to_torch`` of an array a sample made: on the CPU the tensor takes the
        array's memory instead of a copy (the sample's arrays are its own: made for this
        call, never kept nor handed out again), as values, dtype and device stay SB3's."""
        if self.device.type == "cpu" and array.flags.writeable and array.flags.c_contiguous:
            try:
                return th.from_numpy(array)
            except TypeError:  # a dtype torch does not share (th.tensor may still convert)
                pass
        return th.tensor(array, device=self.device)  # SB3's to_torch

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        raise NotImplementedError(
            "millpond draws the transitions itself: call sample(batch_size, env)")


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
        frame_stack: int | None = None,
        frame_capacity: int | None = None,
    ):
        if isinstance(observation_space, spaces.Dict):
            raise ValueError("Dict observation spaces need "
                             "millpond.integrations.sb3.DictReplayBuffer (as in SB3)")
        sb3.BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device,
                                n_envs=n_envs)
        shape = (observation_space.dtype, self.obs_shape)
        self._setup(buffer_size, optimize_memory_usage, handle_timeout_termination,
                    {"obs": shape, "next_obs": shape}, address, name, token, hot_capacity,
                    cold_path, max_in_flight,
                    None if frame_stack is None else {"obs": frame_stack}, frame_capacity)

    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Store one step of every environment (SB3's ``add``)."""
        n = self.n_envs
        self._stage({"obs": np.asarray(obs).reshape((n, *self.obs_shape)),
                     "next_obs": np.asarray(next_obs).reshape((n, *self.obs_shape)),
                     "actions": np.asarray(action).reshape((n, self.action_dim)),
                     "rewards": np.asarray(reward).reshape(n)}, done, infos)

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """``batch_size`` uniform draws as SB3's ``ReplayBufferSamples``."""
        batch, dones, rewards = self._sample_rows(batch_size)
        return ReplayBufferSamples(
            self._tensor(self._normalize_obs(batch["obs"], env)),  # type: ignore[arg-type]
            self._tensor(batch["actions"]),
            self._tensor(self._normalize_obs(batch["next_obs"], env)),  # type: ignore[arg-type]
            self._tensor(dones),
            self._tensor(self._normalize_reward(rewards, env)),
        )


class DictReplayBuffer(_MillpondStorage, sb3.DictReplayBuffer):
    """SB3's ``DictReplayBuffer`` (``spaces.Dict`` observations); same extra arguments
    as :class:`ReplayBuffer`, but ``frame_stack`` is ``{key: axis}`` for the keys whose
    values are frame stacks. Keys must be Python identifiers (they name fields)."""

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
        frame_stack: dict[str, int] | None = None,
        frame_capacity: int | None = None,
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
                    address, name, token, hot_capacity, cold_path, max_in_flight,
                    {f"obs_{key}": axis for key, axis in (frame_stack or {}).items()},
                    frame_capacity)

    def add(self, obs: dict[str, np.ndarray], next_obs: dict[str, np.ndarray],  # type: ignore[override]
            action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        """Store one step of every environment (SB3's ``add``)."""
        n = self.n_envs
        columns: dict[str, np.ndarray] = {}
        for prefix, value in (("obs", obs), ("next_obs", next_obs)):
            for key, shape in self.obs_shape.items():
                columns[f"{prefix}_{key}"] = np.asarray(value[key]).reshape((n, *shape))
        columns["actions"] = np.asarray(action).reshape((n, self.action_dim))
        columns["rewards"] = np.asarray(reward).reshape(n)
        self._stage(columns, done, infos)

    def sample(self, batch_size: int,  # type: ignore[override]
               env: VecNormalize | None = None) -> DictReplayBufferSamples:
        """``batch_size`` uniform draws as SB3's ``DictReplayBufferSamples``."""
        batch, dones, rewards = self._sample_rows(batch_size)
        obs, next_obs = ({key: batch[f"{prefix}_{key}"] for key in self.obs_shape}
                         for prefix in ("obs", "next_obs"))
        obs_, next_obs_ = self._normalize_obs(obs, env), self._normalize_obs(next_obs, env)
        assert isinstance(obs_, dict) and isinstance(next_obs_, dict)
        return DictReplayBufferSamples(
            observations={key: self._tensor(value) for key, value in obs_.items()},
            actions=self._tensor(batch["actions"]),
            next_observations={key: self._tensor(value) for key, value in next_obs_.items()},
            dones=self._tensor(dones),
            rewards=self._tensor(self._normalize_reward(rewards, env)),
        )


class NStepReplayBuffer(ReplayBuffer):
    """SB3's ``NStepReplayBuffer``: :class:`ReplayBuffer` whose samples are n-step
    transitions, computed at sample time exactly as SB3 computes them.

    Arguments are :class:`ReplayBuffer`'s plus SB3's keyword ``n_steps`` (default 3) and
    ``gamma`` (0.99). ``sample`` draws a step and an environment as SB3 does and returns
    ``ReplayBufferSamples`` with ``observations``/``actions`` of that step; the window is
    the ``n_steps`` steps from it, cut after the first step that is ``done``
    (terminated or truncated) or the newest step held; ``rewards`` is
    ``sum(gamma**k * r[t+k])`` over the window (each reward normalized by ``env`` first,
    as SB3 does), ``next_observations`` those of the window's last step, ``dones`` 1
    if that step terminated (with ``handle_timeout_termination=False``: if it was
    done), and ``discounts = gamma ** len(window)``, the factor of the bootstrapped
    value. Like SB3's it keeps every step's reward, done and timeout beside the
    records (float32 ``[buffer_size, n_envs]`` arrays: ``rewards``, ``dones``,
    ``timeouts``) and reads ``obs``, ``actions`` and ``next_obs`` from millpond.
    """

    def __init__(self, *args: Any, n_steps: int = 3, gamma: float = 0.99, **kwargs: Any):
        if kwargs.get("optimize_memory_usage") or (len(args) > 5 and args[5]):
            raise ValueError("NStepReplayBuffer does not support optimize_memory_usage=True "
                             "(as SB3's)")
        super().__init__(*args, **kwargs)
        if n_steps < 1:
            raise ValueError(f"n_steps must be at least 1, got {n_steps}")
        self.n_steps = n_steps
        self.gamma = gamma
        shape = (self.buffer_size, self.n_envs)
        self.rewards = np.zeros(shape, np.float32)
        self.dones = np.zeros(shape, np.float32)
        self.timeouts = np.zeros(shape, np.float32)
        held = self.size()
        if held:  # an existing server buffer: its steps, oldest first, are slots 0..held-1
            flags = self._handle.sample_all(["rewards", "terminated", "truncated"])
            rows = held * self.n_envs
            done = flags["terminated"][-rows:] | flags["truncated"][-rows:]
            self.rewards[:held] = flags["rewards"][-rows:].reshape(held, self.n_envs)
            self.dones[:held] = done.reshape(held, self.n_envs)
            if self.handle_timeout_termination:
                self.timeouts[:held] = flags["truncated"][-rows:].reshape(held, self.n_envs)

    def _mirror(self, done: np.ndarray, timeout: np.ndarray, reward: Any) -> None:
        self.rewards[self.pos] = reward
        self.dones[self.pos] = done
        if self.handle_timeout_termination:
            self.timeouts[self.pos] = timeout

    def reset(self) -> None:
        super().reset()
        for array in (self.rewards, self.dones, self.timeouts):
            array[:] = 0

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """``batch_size`` n-step transitions as SB3's ``ReplayBufferSamples`` (with
        ``discounts``)."""
        batch_inds, env_indices = self._draw(batch_size)
        # As SB3: the newest step ends every window (it is marked truncated meanwhile
        # unless done), so no window runs on into the oldest step of the ring.
        last_valid_index = self.pos - 1
        original = self.timeouts[last_valid_index].copy()
        self.timeouts[last_valid_index] = np.logical_or(
            original, np.logical_not(self.dones[last_valid_index]))
        try:
            steps = np.arange(self.n_steps).reshape(1, -1)
            indices = (batch_inds[:, None] + steps) % self.buffer_size
            rewards_seq = self._normalize_reward(self.rewards[indices, env_indices[:, None]], env)
            dones_seq = self.dones[indices, env_indices[:, None]]
            truncated_seq = self.timeouts[indices, env_indices[:, None]]
            done_or_truncated = np.logical_or(dones_seq, truncated_seq)
            done_idx = np.where(done_or_truncated.any(axis=1), done_or_truncated.argmax(axis=1),
                                self.n_steps - 1)
            mask = steps <= done_idx[:, None]
            target_q_discounts = self.gamma ** mask.sum(axis=1, keepdims=True).astype(np.float32)
            discounts = self.gamma ** np.arange(self.n_steps, dtype=np.float32).reshape(1, -1)
            n_step_returns = (rewards_seq * discounts * mask).sum(axis=1, keepdims=True)
            last_indices = (batch_inds + done_idx) % self.buffer_size
            next_dones = self.dones[last_indices, env_indices][:, None].astype(np.float32)
            next_timeouts = self.timeouts[last_indices, env_indices][:, None].astype(np.float32)
            final_dones = next_dones * (1.0 - next_timeouts)
        finally:
            self.timeouts[last_valid_index] = original
        # One read: obs and actions of the first steps, next_obs of the last ones.
        rows = self._gather(np.concatenate([batch_inds, last_indices]),
                            np.concatenate([env_indices, env_indices]),
                            ["obs", "actions", "next_obs"])
        return ReplayBufferSamples(
            observations=self._tensor(self._normalize_obs(rows["obs"][:batch_size], env)),  # type: ignore[arg-type]
            actions=self._tensor(rows["actions"][:batch_size]),
            next_observations=self._tensor(
                self._normalize_obs(rows["next_obs"][batch_size:], env)),  # type: ignore[arg-type]
            dones=self._tensor(final_dones),
            rewards=self._tensor(n_step_returns),
            discounts=self._tensor(target_q_discounts),
        )
