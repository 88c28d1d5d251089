"""Writing episodes: which episode each pushed record belongs to, decided by the writer.

Every writer (a thread pushing through a handle, an environment of an
:class:`EpisodeWriter`) has an :class:`EpisodeStream`: the id of its
current episode, drawn at random (63 bits: writers on many hosts never need
to agree on ids), and a fresh one after each end. A record whose
``terminated`` or ``truncated`` is true ends its episode, on the server as
here (:func:`millpond.core.episodes.record_ends`), so both agree without a
round trip.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from millpond.core.checks import is_integral
from millpond.core.episodes import END_FIELDS, check_meta, record_ends
from millpond.errors import InvalidArgumentError

if TYPE_CHECKING:
    from millpond.handle.buffer import Buffer


def new_episode_id() -> int:
    """A random 63-bit id (``random`` reseeds in forked children: ids stay distinct)."""
    return random.getrandbits(63)


class EpisodeStream:
    """One writer's episodes: ``current`` is the id its next record gets.

    ``previous`` is the episode it ended last by a record's flag: an explicit
    end right after that (to give it meta) reaches it, not a new, empty one.
    """

    def __init__(self) -> None:
        self.current = new_episode_id()
        self.steps = 0  # records of the current episode written by this stream
        self.previous: int | None = None
        # Meta for the current episode, sent once it has a record (a server keeps the
        # meta of an episode with no record only in memory: a restart would lose it).
        self.meta: dict[str, Any] | None = None

    def ids(self, ends: np.ndarray) -> np.ndarray:
        """The episode of each of the next records (``ends``: which end their episode),
        without moving on: :meth:`advance` does, once they are stored."""
        nth = np.r_[0, np.cumsum(ends[:-1], dtype=np.int64)]  # the batch's nth episode
        fresh = [new_episode_id() for _ in range(int(nth[-1]) if len(nth) else 0)]
        return np.array([self.current, *fresh], np.int64)[nth]

    def advance(self, ids: np.ndarray, ends: np.ndarray) -> None:
        """Records of ``ids`` (from :meth:`ids`) were stored."""
        if not len(ids):
            return
        self.meta = None  # sent with these records if it was held
        if ends.any():
            self.previous = int(ids[np.flatnonzero(ends)[-1]])
        if ends[-1]:
            self.current, self.steps = new_episode_id(), 0
        elif ids[-1] == self.current:
            self.steps += len(ids)
        else:
            self.current, self.steps = int(ids[-1]), int((ids == ids[-1]).sum())

    def meta_update(self) -> list[tuple[int, dict[str, Any], bool]] | None:
        """The update that gives the current episode its held meta (sent with its first
        record; cleared once that record is stored), or None."""
        return None if not self.meta else [(self.current, self.meta, False)]

    def take(self, end: bool) -> int:
        """The id of the next record, which ends its episode or not, and move on."""
        episode, self.meta = self.current, None  # sent with this record if it was held
        if end:
            self.previous, self.current, self.steps = episode, new_episode_id(), 0
        else:
            self.steps += 1
        return episode

    def end(self) -> int | None:
        """The episode an explicit end is for, moving on if it is the current one
        (None: this stream has written nothing since its last end)."""
        if self.steps:
            ended, self.previous = self.current, self.current
            self.current, self.steps, self.meta = new_episode_id(), 0, None
            return ended
        return self.previous


def record_ends_of(record: Mapping[str, Any]) -> bool:
    """Whether one record (as given, before validation) ends its episode."""
    return any(bool(np.any(np.asarray(record[name]))) for name in END_FIELDS if name in record)


class EpisodeWriter:
    """Steps of ``n_envs`` vectorized environments into an episodic buffer.

    ``append(**steps)`` takes one step of every environment (leading
    dimension ``n_envs``); ``append(env=i, **step)`` one step of environment
    ``i``. An environment's episode ends on its ``terminated``/``truncated``
    flag or on :meth:`end_episode`. Records and ends are sent on
    :meth:`flush` (also when ``max_records`` are pending, and on ``close``
    or leaving a ``with`` block): **records are acknowledged when flushed**,
    like the client's batched pushes. Not thread-safe: one writer per thread.
    """

    def __init__(self, buffer: "Buffer", n_envs: int, max_records: int | None = None):
        if not is_integral(n_envs) or isinstance(n_envs, bool) or n_envs <= 0:
            raise InvalidArgumentError(f"n_envs must be a positive integer, got {n_envs!r}")
        if not buffer.config.episodes:
            raise InvalidArgumentError("episode_writer needs an episodic buffer (episodes=True)")
        self.buffer = buffer
        self.n_envs = int(n_envs)
        self.streams = [EpisodeStream() for _ in range(self.n_envs)]
        record_nbytes = buffer.schema.record_nbytes
        self.max_records = max_records or max(self.n_envs, min(4096, (8 << 20) // record_nbytes))
        self._batches: list[dict[str, np.ndarray]] = []
        self._ids: list[np.ndarray] = []
        self._pending = 0
        self._updates: list[tuple[int, dict[str, np.ndarray], bool]] = []

    def append(self, env: int | None = None, **steps: Any) -> None:
        """One step of every environment (``env=None``) or of environment ``env``."""
        schema = self.buffer.schema
        bound = self.buffer._bind((), (), steps)
        if env is None:
            n, batch = schema.coerce_batch(bound)
            if n != self.n_envs:
                raise InvalidArgumentError(f"append() without env= takes one step of each of "
                                           f"the {self.n_envs} environments, got {n}")
            envs = range(self.n_envs)
        else:
            envs = range(self._env(env), self._env(env) + 1)
            batch = schema.coerce_record(bound)
        ends = record_ends(schema, batch, len(envs)).tolist()
        # Ids are decided now, so that ends and meta given later apply to the right episodes.
        ids = np.array([self.streams[e].take(end) for e, end in zip(envs, ends)], np.int64)
        self._batches.append({name: np.array(column) for name, column in batch.items()})
        self._ids.append(ids)
        self._pending += len(ids)
        if self._pending >= self.max_records:
            self.flush()

    def end_episode(self, env: int, /, **meta: Any) -> None:
        """End environment ``env``'s episode, giving it ``meta`` (sent on flush, after the
        steps appended before). Right after a flag ended its episode, the meta reaches
        that episode."""
        stream = self.streams[self._env(env)]
        checked = check_meta(self.buffer.config.meta_fields, meta)
        target = stream.end()
        if target is not None:
            self._updates.append((target, checked, True))

    def flush(self) -> None:
        """Store every pending step and, with them, the pending ends and meta (one
        call). A failed send drops them (and raises)."""
        updates, self._updates = self._updates, []
        if self._batches:
            batch = {name: np.concatenate([b[name] for b in self._batches])
                     for name in self._batches[0]}
            ids = np.concatenate(self._ids)
            self._batches, self._ids, self._pending = [], [], 0
            self.buffer.backend.push_batch(batch, episodes=ids, updates=updates or None)
        elif updates:
            self.buffer.backend.update_episodes(updates)

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "EpisodeWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.flush()

    def _env(self, env: Any) -> int:
        if not is_integral(env) or isinstance(env, bool) or not 0 <= env < self.n_envs:
            raise InvalidArgumentError(f"env must be an integer in [0, {self.n_envs}), got {env!r}")
        return int(env)
