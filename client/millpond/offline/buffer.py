"""rlox's ``OfflineDatasetBuffer``: a read-only dataset for offline RL, local or served.

In-process, from arrays (rlox's arguments) or from a file::

    buf = millpond.OfflineDatasetBuffer(obs.ravel(), next_obs.ravel(), actions.ravel(),
                                        rewards, terminated, truncated, normalize=True)
    buf = millpond.OfflineDatasetBuffer(**millpond.datasets.load("hopper.hdf5"))

On a server that serves it (``millpond serve --dataset hopper=hopper.hdf5``)::

    buf = millpond.OfflineDatasetBuffer(address="host:50051", name="hopper")

Either way it is an episodic buffer handle (:class:`millpond.Buffer`) over a
dataset whose records carry one more field, ``returns_to_go``, and whose writes
raise :class:`~millpond.ReadOnlyBufferError` (see :mod:`millpond.core.dataset`
for how episodes are found, the final unflagged episode included).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from millpond.api import connect
from millpond.core.dataset import RETURNS_TO_GO, ReadOnlyBuffer, dataset_columns, is_dataset_config
from millpond.errors import InvalidArgumentError, InvalidConfigError, ReadOnlyBufferError
from millpond.handle.backend import Backend
from millpond.handle.buffer import Buffer
from millpond.offline.progress import ProgressBar

MIN_STD = 1e-8  # rlox's floor on the observations' standard deviation
READ_BYTES = 32 << 20  # bytes of observations per read while computing their statistics


class OfflineDatasetBuffer(Buffer):
    """A read-only offline dataset: uniform transitions and trajectory windows.

    ``OfflineDatasetBuffer(obs, next_obs, actions, rewards, terminated,
    truncated, normalize=False)``: rlox's arguments. ``n = len(rewards)``;
    the other arrays are ``[n, ...]`` or flat (``ravel()``ed), their dims
    inferred as ``size // n``; stored as float32 (flags as bool);
    ``truncated=None`` means all false. ``episode_ids=`` (one per row, e.g.
    from an exported episodic buffer) groups rows into episodes by id instead
    of cutting them at the flags. With ``address=`` and ``name=`` (and
    ``token=``), no arrays: the dataset the server at ``address`` serves as
    ``name`` (see also :meth:`from_buffer`).

    ``normalize=True`` computes the observations' mean and standard deviation
    (per feature, over every record; std as rlox: ``sqrt(var)`` with ``ddof=0``,
    at least 1e-8) and returns ``(x - mean) / std`` for ``obs`` and
    ``next_obs`` from :meth:`sample` (and the :meth:`sampler`) and
    :meth:`sample_trajectories`; the stored data stay raw (other reads return
    them). On a server the statistics cost one pass over its observations,
    once.

    Writes (``push``, ``push_batch``, ``store``, episode calls, ``reset``,
    priorities) raise ReadOnlyBufferError and change nothing. ``close()``
    drops this handle: in-process, the in-memory copy; remote, it only lets
    go (the server keeps serving the dataset, and refuses ``delete()``).
    Nothing ever writes or deletes the dataset's file.
    """

    def __init__(self, obs: Any = None, next_obs: Any = None, actions: Any = None,
                 rewards: Any = None, terminated: Any = None, truncated: Any = None,
                 normalize: bool = False, *, episode_ids: Any = None, address: str | None = None,
                 name: str | None = None, token: str | None = None):
        given = [label for label, value in (
            ("obs", obs), ("next_obs", next_obs), ("actions", actions), ("rewards", rewards),
            ("terminated", terminated), ("truncated", truncated), ("episode_ids", episode_ids))
            if value is not None]
        if address is not None or name is not None:
            if given:
                raise InvalidArgumentError(f"give the arrays or address= and name=, not both "
                                           f"(got {given} too)")
            if not address or not name:
                raise InvalidConfigError("a served dataset needs both address= and name=")
            handle = connect(address, token=token).buffer(name)
            self._wrap(handle, normalize, owned=True)
            return
        if token is not None:
            raise InvalidConfigError("token= is for a served dataset (with address=)")
        columns = dataset_columns(obs, next_obs, actions, rewards, terminated, truncated)
        with ProgressBar(len(columns["rewards"]), "storing the dataset") as bar:
            backend = ReadOnlyBuffer(columns, episode_ids, progress=bar)
        self._setup(backend, normalize)

    @classmethod
    def from_buffer(cls, buffer: Buffer, normalize: bool = False) -> "OfflineDatasetBuffer":
        """A dataset handle over ``buffer``, a handle of a dataset (e.g.
        ``millpond.connect(address, shm=False).buffer(name)``, to pick the transport).
        Both handles then share one backend: closing either closes both.
        InvalidArgumentError if it is not one."""
        self = cls.__new__(cls)
        self._wrap(buffer, normalize, owned=False)
        return self

    def _wrap(self, handle: Buffer, normalize: bool, owned: bool) -> None:
        """Use ``handle``'s backend (shared with it); ``owned``: ours to let go on failure."""
        if not is_dataset_config(handle.config):
            if owned:
                handle.release()
            raise InvalidArgumentError(
                f"a buffer of fields {list(handle.config.schema.names)} (episodic: "
                f"{handle.config.episodes}) is not an offline dataset: it needs the fields obs, "
                f"next_obs, actions, rewards, terminated, truncated, {RETURNS_TO_GO} and episodes")
        self._setup(handle.backend, normalize, owned)

    def _setup(self, backend: Backend, normalize: bool, owned: bool = True) -> None:
        Buffer.__init__(self, backend)
        self.normalize = bool(normalize)
        self._stats: dict[str, Any] | None = None
        self._moments: tuple[np.ndarray, np.ndarray] | None = None
        if self.normalize:
            try:
                self._moments = observation_moments(self)
            except BaseException:
                if owned:  # a local copy goes; a served dataset stays on its server
                    (self.close if isinstance(backend, ReadOnlyBuffer) else self.release)()
                raise

    # ---- rlox's reads ----------------------------------------------------------------

    def sample(self, batch_size: int, seed: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """``batch_size`` transitions drawn uniformly with replacement (deterministic for
        a ``seed``): ``obs``, ``next_obs`` (normalized if ``normalize``), ``actions``,
        ``rewards``, ``terminated``, ``truncated`` and ``returns_to_go``. At most
        ``len(self)`` per batch (NotEnoughDataError beyond, as every millpond buffer;
        rlox has no such limit). Keywords as for :meth:`millpond.Buffer.sample`
        (``timeout``, ``device``)."""
        device = kwargs.pop("device", None)
        out = super().sample(batch_size, seed, **kwargs)
        return self._finish(out, None, device)

    def sample_trajectories(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                            filter_meta: Mapping[str, Any] | None = None,
                            timeout: float | None = None, device: Any = None) -> dict[str, Any]:
        """``batch_size`` windows of ``seq_len`` consecutive steps of one episode each
        (Decision Transformer's input): ``obs``, ``actions``, ``rewards``,
        ``returns_to_go``, ``timesteps`` and ``mask`` ``[batch_size, seq_len, ...]``, plus
        :meth:`sample_sequences`'s other keys (``next_obs``, flags, ``lens``,
        ``episode_ids``, ``start_steps``).

        ``returns_to_go[b, t]`` is the sum of the rewards from that step to the end
        of its **episode** (not of the window), as Decision Transformer conditions
        on. ``timesteps`` is each step's index in its episode (0 at its first
        step). Past the window's end (``mask`` false) everything is 0.

        Windows are :meth:`sample_sequences`'s: starts drawn uniformly among all
        transitions (rlox draws an episode first), and a window that reaches its
        episode's end is padded rather than moved back. ``obs``/``next_obs`` are
        normalized if ``normalize``.
        """
        out = self.sample_sequences(batch_size, seq_len, seed, filter_meta=filter_meta,
                                    timeout=timeout)
        mask = out["mask"]
        steps = out["start_steps"][:, None] + np.arange(mask.shape[1], dtype=np.int64)
        out["timesteps"] = np.where(mask, steps, 0)
        return self._finish(out, mask, device)

    def n_episodes(self) -> int:
        """Episodes in the dataset (the final unflagged one included)."""
        return int(self.info()["episodes"])

    def stats(self) -> dict[str, Any]:
        """rlox's statistics: ``n_transitions``, ``n_episodes``, ``obs_dim``, ``act_dim``
        (features per row), ``mean_return``, ``std_return`` (``ddof=1``, as rlox; 0.0 for
        one episode), ``min_return``, ``max_return``, ``mean_episode_length``; plus
        ``obs_mean`` and ``obs_std`` (arrays) when normalizing. Computed once."""
        if self._stats is None:
            self._stats = episode_stats(self)
        stats = dict(self._stats)
        if self._moments is not None:
            stats["obs_mean"], stats["obs_std"] = (m.copy() for m in self._moments)
        return stats

    def _finish(self, out: dict[str, Any], mask: np.ndarray | None, device: Any) -> dict[str, Any]:
        if self._moments is not None:
            mean, std = self._moments
            for key in ("obs", "next_obs"):
                normalized = ((out[key] - mean) / std).astype(np.float32, copy=False)
                if mask is not None:  # padding stays zero
                    normalized[~mask] = 0
                out[key] = normalized
        if device is None:
            return out
        from millpond.handle.devices import to_device

        return to_device(out, device)

    # ---- refused writes --------------------------------------------------------------

    def _refused(self, what: str) -> ReadOnlyBufferError:
        return ReadOnlyBufferError(f"{what}: this buffer is a read-only offline dataset")

    def push(self, *args: Any, **kwargs: Any) -> None:
        raise self._refused("push")

    def push_batch(self, *args: Any, **kwargs: Any) -> None:
        raise self._refused("push_batch")

    def store(self, **step: Any) -> None:
        raise self._refused("store")

    def end_episode(self, **meta: Any) -> None:
        raise self._refused("end_episode")

    def one_episode(self, **meta: Any) -> Any:
        raise self._refused("one_episode")

    def episode_writer(self, n_envs: int, max_records: int | None = None) -> Any:
        raise self._refused("episode_writer")

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        raise self._refused("update_priorities")

    def reset(self) -> None:
        raise self._refused("reset")


# ---- statistics: the same calls on a local or a served dataset -------------------------

def episode_stats(buf: Buffer) -> dict[str, Any]:
    """rlox's dataset statistics of a dataset handle (see :meth:`OfflineDatasetBuffer.stats`),
    from its episode catalog and each episode's first ``returns_to_go`` (its return)."""
    catalog = buf.episode_catalog()
    lens = catalog["lens"].astype(np.int64)
    firsts = catalog["seqs"][np.cumsum(lens) - lens]
    returns = buf.read(firsts, [RETURNS_TO_GO])[RETURNS_TO_GO].astype(np.float64)
    schema = buf.config.schema
    count = len(lens)
    return {
        "n_transitions": len(buf),
        "n_episodes": count,
        "obs_dim": schema["obs"].size,
        "act_dim": schema["actions"].size,
        "mean_return": float(returns.mean()) if count else 0.0,
        "std_return": float(returns.std(ddof=1)) if count > 1 else 0.0,
        "min_return": float(returns.min()) if count else 0.0,
        "max_return": float(returns.max()) if count else 0.0,
        "mean_episode_length": float(lens.mean()) if count else 0.0,
    }


def observation_moments(buf: Buffer) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and std (``ddof=0``, at least :data:`MIN_STD`) of every record's
    ``obs``, as float32, read in chunks in catalog order (chunks combined as Chan et al.)."""
    seqs = buf.episode_catalog()["seqs"]
    field = buf.config.schema["obs"]
    chunk = max(1, READ_BYTES // max(field.nbytes, 1))
    most = buf.backend.read_chunk(field.nbytes + 1)  # what one remote reply may hold
    if most is not None:
        chunk = min(chunk, most)
    count = 0
    mean = np.zeros(field.shape, np.float64)
    m2 = np.zeros(field.shape, np.float64)
    for start in range(0, len(seqs), chunk):
        rows = buf.read(seqs[start:start + chunk], ["obs"])["obs"].astype(np.float64)
        n_b = len(rows)
        mean_b = rows.mean(axis=0)
        m2_b = ((rows - mean_b) ** 2).sum(axis=0)
        total = count + n_b
        delta = mean_b - mean
        mean = mean + delta * (n_b / total)
        m2 = m2 + m2_b + delta ** 2 * (count * n_b / total)
        count = total
    if count == 0:
        raise InvalidArgumentError("the dataset has no complete episode to normalize by")
    std = np.maximum(np.sqrt(m2 / count), MIN_STD)
    return mean.astype(np.float32), std.astype(np.float32)
