"""Offline datasets in the engine: arrays checked, split into episodes, stored read-only.

A dataset is an ordinary episodic :class:`~.buffer.TieredBuffer` (RAM only,
capacity = its number of transitions) whose records are the transition
fields plus :data:`RETURNS_TO_GO`, computed once here, and whose write calls
all raise :class:`~millpond.errors.ReadOnlyBufferError`. Every read of the
episodic buffers works on it unchanged (samples, windows, catalog, reads), in
process and on a server, over gRPC and shared memory.

Episodes (as rlox's ``OfflineDatasetBuffer`` finds them): a record whose
``terminated`` or ``truncated`` is true ends its episode and the next record
starts another. The records after the last such flag, if any, form a final
episode that the data ends without a flag (an episode cut short by the end
of the dataset): it is stored ended, so it counts in ``n_episodes`` and in the
return statistics like every other (rlox counts it too). Given explicit
``episode_ids`` (an exported episodic buffer), records are grouped by id
instead, interleaved or not, and every episode is ended after the load.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from millpond.core.buffer import TieredBuffer
from millpond.core.checks import check_indices
from millpond.core.config import BufferConfig
from millpond.errors import DTypeMismatchError, InvalidArgumentError, ReadOnlyBufferError, ShapeMismatchError

RETURNS_TO_GO = "returns_to_go"
# The dataset's fields beside the returns-to-go, in rlox's argument order.
DATASET_FIELDS = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")
LOAD_CHUNK = 1 << 16  # records per push while loading (a progress step)

Progress = Callable[[int], None]  # told the records stored so far


def dataset_columns(obs: Any, next_obs: Any, actions: Any, rewards: Any, terminated: Any,
                    truncated: Any = None) -> dict[str, np.ndarray]:
    """rlox's constructor arguments as checked columns ``{field: array[n, ...]}``.

    ``n = len(rewards)``. ``obs``, ``next_obs`` and ``actions`` are ``[n, ...]``
    arrays, or flat ``ravel()``ed ones whose size ``n`` divides (``obs_dim =
    obs.size // n``, as rlox infers it); they are stored as float32, like
    rewards; ``terminated``/``truncated`` (None: all false) as bool, non-zero
    being true. A typed error names the first argument that does not fit.
    """
    rewards_arr = _numeric("rewards", rewards)
    if rewards_arr.ndim == 2 and rewards_arr.shape[1] == 1:
        rewards_arr = rewards_arr[:, 0]
    if rewards_arr.ndim != 1 or rewards_arr.size == 0:
        raise ShapeMismatchError(f"rewards must be a non-empty 1-D array, got shape "
                                 f"{list(rewards_arr.shape)}")
    n = rewards_arr.size
    columns = {"obs": _rows("obs", obs, n), "next_obs": _rows("next_obs", next_obs, n),
               "actions": _rows("actions", actions, n),
               "rewards": rewards_arr.astype(np.float32, copy=False)}
    if columns["next_obs"].shape != columns["obs"].shape:
        raise ShapeMismatchError(f"next_obs has shape {list(columns['next_obs'].shape)}, obs "
                                 f"{list(columns['obs'].shape)}: they must match")
    for name, value in (("terminated", terminated), ("truncated", truncated)):
        flags = np.zeros(n, bool) if value is None and name == "truncated" else _numeric(name, value)
        if flags.size != n:
            raise ShapeMismatchError(f"{name} has {flags.size} values for {n} transitions")
        columns[name] = flags.reshape(n) != 0
    return columns


def _numeric(name: str, value: Any) -> np.ndarray:
    if value is None:
        raise InvalidArgumentError(f"{name} is required")
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise DTypeMismatchError(f"{name} must be numbers or booleans, got dtype {arr.dtype}")
    return arr


def _rows(name: str, value: Any, n: int) -> np.ndarray:
    """``value`` as float32 ``[n, ...]`` (flat input: ``[n, size // n]``)."""
    arr = _numeric(name, value)
    if arr.ndim <= 1:
        if arr.size == 0 or arr.size % n:
            raise ShapeMismatchError(f"{name} has {arr.size} values, not a multiple of the "
                                     f"{n} transitions (len(rewards))")
        arr = arr.reshape(n, arr.size // n)
    elif arr.shape[0] != n:
        raise ShapeMismatchError(f"{name} has {arr.shape[0]} rows for {n} transitions "
                                 "(len(rewards))")
    elif 0 in arr.shape:
        raise ShapeMismatchError(f"{name} has an empty shape {list(arr.shape)}")
    return arr.astype(np.float32, copy=False)


def episode_ids_of(columns: Mapping[str, np.ndarray], episode_ids: Any = None) -> np.ndarray:
    """Each record's episode id: ``episode_ids`` checked, or counted from the flags
    (record ``i`` is in episode ``number of flagged records before i``)."""
    ends = columns["terminated"] | columns["truncated"]
    n = ends.size
    if episode_ids is None:
        ids = np.zeros(n, np.int64)
        np.cumsum(ends[:-1], out=ids[1:])
        return ids
    ids = check_indices(episode_ids, "episode_ids")
    if ids.shape != (n,):
        raise ShapeMismatchError(f"episode_ids has {ids.size} values for {n} transitions")
    order = np.argsort(ids, kind="stable")
    last = np.ones(n, bool)  # in episode order: the last record of its episode
    last[:-1] = ids[order][1:] != ids[order][:-1]
    if (ends[order] & ~last).any():
        raise InvalidArgumentError("episode_ids: an episode has records after one whose "
                                   "terminated or truncated ends it")
    return ids


def returns_to_go(rewards: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """For each record, the sum of its episode's rewards from it to the episode's last
    record (float64 sums, stored as float32)."""
    order = np.argsort(ids, kind="stable")  # each episode's records together, in order
    grouped = rewards[order].astype(np.float64)
    tail = np.cumsum(grouped[::-1])[::-1]  # tail[j] = sum of grouped[j:]
    n = grouped.size
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    after = np.r_[starts[1:], n]  # where each record's episode ends (exclusive)
    lengths = np.diff(np.r_[starts, n])
    following = np.r_[tail, 0.0][np.repeat(after, lengths)]
    out = np.empty(n, np.float32)
    out[order] = tail - following
    return out


def dataset_config(columns: Mapping[str, np.ndarray]) -> BufferConfig:
    """The config of a dataset of these checked columns: RAM only, episodic."""
    n = columns["rewards"].size
    spec: dict[str, tuple[str, tuple[int, ...]]] = {
        name: (columns[name].dtype.name, columns[name].shape[1:]) for name in DATASET_FIELDS}
    spec[RETURNS_TO_GO] = ("float32", ())
    return BufferConfig.build(capacity=n, fields=spec, episodes=True)


def is_dataset_config(config: BufferConfig) -> bool:
    """Whether ``config`` has a dataset's fields (and episodes)."""
    return config.episodes and set(DATASET_FIELDS) | {RETURNS_TO_GO} <= set(config.schema.names)


class ReadOnlyBuffer(TieredBuffer):
    """An offline dataset: filled once at construction, then read-only.

    ``columns``: :func:`dataset_columns`'s output; ``episode_ids``: see
    :func:`episode_ids_of`; ``source``: where it came from (a path, for
    ``info()``); ``progress``: told the records stored so far, while loading.
    Pushes, priority and episode updates and ``reset`` raise
    ReadOnlyBufferError and change nothing; reads are the episodic buffer's.
    ``close()`` drops the in-memory copy (the source file is never touched).
    """

    def __init__(self, columns: Mapping[str, np.ndarray], episode_ids: Any = None, *,
                 source: str | None = None, progress: Progress | None = None):
        ids = episode_ids_of(columns, episode_ids)
        full = {**columns, RETURNS_TO_GO: returns_to_go(columns["rewards"], ids)}
        super().__init__(dataset_config(columns))
        self.source = source
        n = ids.size
        for start in range(0, n, LOAD_CHUNK):
            stop = min(start + LOAD_CHUNK, n)
            TieredBuffer.push_batch(self, {k: v[start:stop] for k, v in full.items()},
                                    episodes=ids[start:stop])
            if progress is not None:
                progress(stop)
        ends = columns["terminated"] | columns["truncated"]
        order = np.argsort(ids, kind="stable")
        last = np.r_[ids[order][1:] != ids[order][:-1], True]  # each episode's last record
        unended = np.unique(ids[order][last & ~ends[order]])
        TieredBuffer.update_episodes(self, [(int(e), None, True) for e in unended])

    read_only = True

    def check_writable(self, what: str) -> None:
        raise self._refuse(what)

    def _refuse(self, what: str) -> ReadOnlyBufferError:
        self._check_open()
        return ReadOnlyBufferError(f"this buffer is a read-only dataset: {what} is refused")

    def push(self, *args: Any, **kwargs: Any) -> None:
        raise self._refuse("push")

    def push_batch(self, *args: Any, **kwargs: Any) -> int:
        raise self._refuse("push_batch")

    def update_priorities(self, *args: Any, **kwargs: Any) -> int:
        raise self._refuse("update_priorities")

    def update_episodes(self, *args: Any, **kwargs: Any) -> None:
        raise self._refuse("update_episodes")

    def reset(self, *args: Any, **kwargs: Any) -> None:
        raise self._refuse("reset")
