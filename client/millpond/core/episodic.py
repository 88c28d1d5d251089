"""The episodic calls of the tiered buffer: episode updates and episodic samples.

A mixin of :class:`~.buffer.TieredBuffer`, kept apart so that each module
stays readable: the buffer owns the lock, the rate limiter and the FIFO;
this module checks the arguments and hands the work, lock held, to
:mod:`.sequences` over the buffer's :class:`~.episodes.EpisodeIndex`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .checks import (
    check_batch_size,
    check_count,
    check_episode_ids,
    check_gamma,
    check_indices,
    check_seed,
)
from .config import BufferConfig
from .episodes import EpisodeIndex, check_meta, record_ends
from .draw import Strategy
from .fifo import Fifo
from . import sequences
from .sequences import Out

# Longest n-step return, window or episode cut: far beyond any use, and bounds on one call's work.
MAX_N_STEP = 1 << 16
MAX_WINDOW = 1 << 20


class EpisodicReads:
    """Episode updates and the samples of episodic buffers (see :mod:`.episodes`)."""

    config: BufferConfig
    _episodes: EpisodeIndex | None
    _fifo: Fifo
    _strategy: Strategy
    _lock: Any
    _check_open: Callable[[], None]
    _generator: Callable[[int | None], np.random.Generator]
    _read: Callable[..., dict[str, np.ndarray]]
    _at_positions: Callable[[np.ndarray], np.ndarray]

    def update_episodes(self, updates: Sequence[tuple[int, Mapping[str, Any] | None, bool]]
                        ) -> None:
        """Apply ``(episode id, meta or None, end)`` updates in order: meta values reach
        every record of the episode, past and future; ``end`` ends it. All are checked
        before any is applied."""
        index = self._episodes_or_raise()
        checked = check_updates(self.config, updates)
        with self._lock:
            self._check_open()
            for episode, meta, end in checked:
                index.update(episode, meta, end)

    def sample_n_step(self, batch_size: int, n_step: int, gamma: float = 0.99,
                      seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                      timeout: float | None = None, out: Out = None) -> dict[str, np.ndarray]:
        """n-step transitions (transition schema): ``obs`` and ``actions`` of step ``t``,
        ``rewards`` the discounted sum of the next ``n_step_lens`` rewards from ``t``
        (``n_step_lens = min(n_step, steps stored from t to the episode's last stored
        step)``, returned too), ``next_obs``, ``terminated`` and ``truncated`` of step
        ``t + n_step_lens - 1``. Steps ``t`` are drawn like :meth:`sample`'s records.
        ``out``: arrays for the results (e.g. shared memory), as for :meth:`sample`."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        n_step, gamma = check_n_step(self.config, n_step, gamma)
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        return self._read(batch_size, batch_size, timeout, lambda: sequences.sample_n_step(
            self._fifo, index, self._strategy, self._generator(seed), batch_size, n_step, gamma,
            wanted, out))

    def sample_sequences(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                         filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None, out: Out = None) -> dict[str, np.ndarray]:
        """``batch_size`` windows of ``seq_len`` consecutive steps of one episode each.

        Every field is ``[batch_size, seq_len, ...]``, zero past the window's
        end, with ``mask`` (bool ``[batch_size, seq_len]``), ``lens`` (steps
        in the window: ``seq_len``, or fewer at the episode's last stored
        step), ``episode_ids``, ``start_steps`` (the start's step in its
        episode) and the meta fields (``[batch_size, ...]``). Starts are drawn
        with replacement among the live records, like :meth:`sample`'s
        (prioritized buffers add ``weights`` and ``indices`` of the starts);
        NotEnoughDataError only when there is none.
        """
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        seq_len = check_count("seq_len", seq_len, MAX_WINDOW)
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        return self._read(batch_size, 1, timeout, lambda: sequences.sample_sequences(
            self._fifo, index, self._strategy, self._generator(seed), batch_size, seq_len, wanted,
            out))

    sample_trajectories = sample_sequences  # rlox's name

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> dict[str, np.ndarray]:
        """``batch_size`` complete live episodes, drawn uniformly with replacement: fields
        ``[batch_size, T, ...]`` with ``T`` the longest drawn (or ``max_len``, which
        cuts longer ones), ``mask``, ``lens``, ``episode_ids`` and the meta fields."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        if max_len is not None:
            max_len = check_count("max_len", max_len, MAX_WINDOW)
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        return self._read(batch_size, 1, timeout, lambda: sequences.sample_episodes(
            self._fifo, index, self._generator(seed), batch_size, max_len, wanted))

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                        ) -> dict[str, np.ndarray]:
        """The complete live episodes (matching ``filter_meta``) in episode order:
        ``episode_ids``, ``lens``, meta fields, and ``seqs``, their records' indices
        (episode after episode, step order) for :meth:`read`. Not a sample."""
        index, wanted = self._episodes_or_raise(), self._filter(filter_meta)
        with self._lock:
            self._check_open()
            return sequences.catalog(index, wanted)

    def read(self, seqs: Any, fields: Sequence[str] | None = None, *, positions: bool = False,
             episode_ids: bool = False, out: Out = None) -> dict[str, np.ndarray]:
        """Records by index (the ``seqs`` of :meth:`episode_catalog`, the ``indices`` of
        a sample), in the order given, fields ``fields`` (default: all, in the order
        given), and ``live``: which were still live (the others' rows are zero).

        ``positions``: ``seqs`` are positions in the contents instead (0 = the
        oldest record, see :mod:`.contents`), resolved under the lock with the
        read: IndexOutOfRangeError, nothing read, if one is not in ``[0, len)``.
        ``episode_ids`` (episodic buffers): also each record's episode id.
        Not a sample: no rate limit, no use counted."""
        wanted = check_indices(seqs, "positions" if positions else "seqs")
        names = self._field_names(fields)
        index = self._episodes_or_raise() if episode_ids else None
        with self._lock:
            self._check_open()
            if positions:
                wanted = self._at_positions(wanted)
            return sequences.read(self._fifo, wanted, names, out, index)

    # ---- helpers -------------------------------------------------------------------------

    def _episode_writes(self, n: int, batch: Mapping[str, np.ndarray], episodes: Any,
                        updates: Any) -> Callable[[int, int], None] | None:
        """What a push of ``batch`` (``n`` validated records, of ``episodes``) writes into
        the episode index before it commits, and then ``updates`` (meta, ends) that
        ride with it: visible together with its records (None: not episodic)."""
        ids = check_push_episodes(self.config, episodes, n)
        checked = check_updates(self.config, updates) if updates else []
        index = self._episodes
        if ids is None or index is None:
            return None

        def write(old: int, new: int) -> None:
            index.appended(old, new, ids, record_ends(self.config.schema, batch, n))
            for episode, meta, end in checked:
                index.update(episode, meta, end, index.first_after(new))

        return write

    def _episodes_or_raise(self) -> EpisodeIndex:
        require_episodes(self.config)
        assert self._episodes is not None
        return self._episodes

    def _filter(self, filter_meta: Mapping[str, Any] | None) -> dict[str, np.ndarray] | None:
        return check_filter(self.config, filter_meta)

    def _field_names(self, fields: Sequence[str] | None) -> list[str] | None:
        return check_fields(self.config, fields)

    def _episode_counts(self) -> tuple[int, int]:
        """``info()``'s ``episodes`` and ``episodes_in_progress`` (lock held)."""
        index = self._episodes
        return (0, 0) if index is None else (index.complete, index.in_progress)


# ---- the checks every backend makes (in-process, remote, sharded) -------------------------

def require_episodes(config: BufferConfig) -> None:
    if not config.episodes:
        raise InvalidArgumentError("this buffer is not episodic: create it with episodes=True")


def check_push_episodes(config: BufferConfig, episodes: Any, n: int) -> np.ndarray | None:
    """The episode ids of a push of ``n`` records: required for an episodic buffer,
    refused for another."""
    if not config.episodes:
        if episodes is not None:
            raise InvalidArgumentError("episode ids are for episodic buffers (episodes=True)")
        return None
    return check_episode_ids(episodes, n)


def check_n_step(config: BufferConfig, n_step: Any, gamma: Any) -> tuple[int, float]:
    """``(n_step, gamma)`` of an n-step sample, which needs the transition schema."""
    require_episodes(config)
    if not config.schema.is_transition:
        raise InvalidArgumentError("n-step samples are for the transition schema (obs_dim/act_dim)")
    return check_count("n_step", n_step, MAX_N_STEP), check_gamma(gamma)


def check_filter(config: BufferConfig, filter_meta: Mapping[str, Any] | None
                 ) -> dict[str, np.ndarray] | None:
    """``filter_meta`` checked against the meta fields (None: no filter)."""
    if not filter_meta:
        return None
    require_episodes(config)
    return check_meta(config.meta_fields, filter_meta, "filter_meta")


def check_fields(config: BufferConfig, fields: Sequence[str] | None) -> list[str] | None:
    """Field names to read (None: all), each one of the schema's."""
    if fields is None:
        return None
    names = [fields] if isinstance(fields, str) else fields
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"fields must be field names, got {fields!r}")
    names = list(names)
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"fields must name each field once, got {names}")
    unknown = [name for name in names if name not in config.schema.names]
    if unknown:
        raise InvalidArgumentError(f"unknown fields {unknown}; the buffer has "
                                   f"{list(config.schema.names)}")
    return names


def check_updates(config: BufferConfig, updates: Any
                  ) -> list[tuple[int, dict[str, np.ndarray], bool]]:
    """Episode updates ``(episode id, meta or None, end)``, checked."""
    require_episodes(config)
    checked = []
    for update in updates:
        try:
            episode, meta, end = update
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"an episode update is (episode id, meta, end), got {update!r}") from None
        ids = check_indices([episode], "episode ids")
        checked.append((int(ids[0]), check_meta(config.meta_fields, meta), bool(end)))
    return checked
