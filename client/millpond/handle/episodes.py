"""The handle's episodic calls: writing episodes and reading sequences, episodes, n-step.

A mixin of :class:`millpond.handle.buffer.Buffer`: every buffer handle has these
calls, and a buffer created without ``episodes=True`` answers them with
InvalidArgumentError. The backend (in-process engine, remote buffer) does
the work; the handle keeps, per thread, the :class:`~millpond.handle.episode_writer.EpisodeStream`
that says which episode the thread's next record belongs to.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.episodes import check_meta, record_ends
from millpond.handle.dataloader import EpisodeLoader
from millpond.handle.devices import check_device, to_device
from millpond.errors import InvalidArgumentError
from millpond.handle.episode_writer import EpisodeStream, EpisodeWriter, record_ends_of


class EpisodeMethods:
    """See the module docstring; :class:`millpond.ReplayBuffer` documents the calls."""

    _backend: Any
    config: BufferConfig

    def _bind(self, order: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
        raise NotImplementedError  # the handle's

    # ---- writing -----------------------------------------------------------------------

    def _stream(self) -> EpisodeStream:
        """This thread's stream of episodes on this handle."""
        local = self.__dict__.get("_episode_local")
        if local is None:
            local = self.__dict__.setdefault("_episode_local", threading.local())
        stream = getattr(local, "stream", None)
        if stream is None:
            stream = local.stream = EpisodeStream()
        return stream

    def _push_one(self, record: Mapping[str, Any], priority: float | None,
                  timeout: float | None) -> None:
        """Push one bound record, in this thread's current episode if episodic."""
        if not self.config.episodes:
            self._backend.push(record, priority, timeout=timeout)
            return
        stream = self._stream()
        updates = stream.meta_update()
        self._backend.push(record, priority, episode=stream.current, updates=updates,
                           timeout=timeout)
        stream.take(record_ends_of(record))

    def _push_many(self, columns: Mapping[str, Any], priorities: Any,
                   timeout: float | None) -> None:
        """Push bound columns, continuing this thread's episodes if episodic."""
        if not self.config.episodes:
            self._backend.push_batch(columns, priorities, timeout=timeout)
            return
        n, batch = self.config.schema.coerce_batch(columns)
        stream = self._stream()
        ends = record_ends(self.config.schema, batch, n)
        ids, updates = stream.ids(ends), stream.meta_update() if n else None
        self._backend.push_batch(batch, priorities, episodes=ids, updates=updates,
                                 timeout=timeout)
        stream.advance(ids, ends)

    def store(self, **step: Any) -> None:
        """Append one step (``store(**{field: value})``) to this thread's current episode."""
        self._push_one(self._bind((), (), step), None, None)

    def end_episode(self, **meta: Any) -> None:
        """End this thread's current episode, giving it ``meta`` (meta fields).

        Records pushed before are flushed first. Right after a record's
        ``terminated``/``truncated`` ended the episode, this gives that
        episode its meta. With nothing written since, it does nothing.
        """
        checked = check_meta(self.config.meta_fields, meta)
        self._require_episodes()
        self._flush()
        stream = self._stream()
        running = stream.steps > 0
        target = stream.end()
        if target is not None and (running or checked):  # (a flag ended it already)
            self._backend.update_episodes([(target, checked, True)])

    @contextlib.contextmanager
    def one_episode(self, **meta: Any) -> Iterator[dict[str, Any]]:
        """``with buf.one_episode(**meta): buf.store(**step)``: one episode, ended on leaving.

        ``meta`` reaches every record of the episode (sampled with filters
        while it runs). The block gets a dict: meta put in it is given at the
        end. An exception leaves the episode unended (never complete) and the
        next record starts another.
        """
        checked = check_meta(self.config.meta_fields, meta)
        self._require_episodes()
        stream = self._stream()
        if stream.steps:  # an episode under way is ended first: this one starts fresh
            self.end_episode()
        stream.meta = checked or None  # sent with the episode's first record, atomically
        final: dict[str, Any] = {}
        try:
            yield final
        except BaseException:
            self._stream().end()
            raise
        self.end_episode(**final)

    def episode_writer(self, n_envs: int, max_records: int | None = None) -> EpisodeWriter:
        """A writer for ``n_envs`` vectorized environments (see :class:`EpisodeWriter`)."""
        return EpisodeWriter(self, n_envs, max_records)  # type: ignore[arg-type]

    def _require_episodes(self) -> None:
        if not self.config.episodes:
            raise InvalidArgumentError("this buffer is not episodic: create it with episodes=True")

    def _flush(self) -> None:
        flush = getattr(self._backend, "flush", None)
        if flush is not None:
            flush()

    # ---- reading -----------------------------------------------------------------------

    def sample_sequences(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                         filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None, device: Any = None) -> dict[str, Any]:
        """``batch_size`` windows of ``seq_len`` steps, each within one episode.

        Fields ``[batch_size, seq_len, ...]`` (zero past the window's end),
        ``mask``, ``lens``, ``episode_ids``, ``start_steps`` and meta fields.
        Starts are drawn like :meth:`sample`'s records (by priority on a
        prioritized buffer, adding ``weights`` and ``indices``). ``device``: torch
        tensors on it (see :mod:`millpond.handle.devices`).
        """
        check_device(device)
        return to_device(self._backend.sample_sequences(
            batch_size, seq_len, seed, filter_meta=filter_meta, timeout=timeout), device)

    def sample_trajectories(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                            filter_meta: Mapping[str, Any] | None = None,
                            timeout: float | None = None) -> dict[str, np.ndarray]:
        """:meth:`sample_sequences` under rlox's name."""
        return self.sample_sequences(batch_size, seq_len, seed, filter_meta=filter_meta,
                                     timeout=timeout)

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> dict[str, np.ndarray]:
        """``batch_size`` complete live episodes, padded (``mask``, ``lens``, meta fields)."""
        return self._backend.sample_episodes(batch_size, seed, max_len=max_len,
                                             filter_meta=filter_meta, timeout=timeout)

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                        ) -> dict[str, np.ndarray]:
        """The complete live episodes in episode order: ``episode_ids``, ``lens``, meta
        fields and ``seqs`` (their records, for :meth:`read`)."""
        self._flush()
        return self._backend.episode_catalog(filter_meta)

    def read(self, seqs: Any, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Records by index (``seqs``), and ``live``: which were still there."""
        self._flush()
        return self._backend.read(seqs, fields)

    def dataloader(self, batch_size: int, n_steps: int | None = None,
                   fields: Sequence[str] | None = None,
                   current_fields: Sequence[str] | None = None,
                   next_fields: Sequence[str] | None = None,
                   sequence_fields: Sequence[str] | None = None,
                   filter_meta: Mapping[str, Any] | None = None,
                   fieldname_map: Mapping[str, str] | None = None, return_mask: bool = False,
                   timestep_level: bool = False, to_named_tuple: Sequence[str] | None = None,
                   shuffle: bool = False, drop_last: bool = False, seed: int | None = None,
                   device: Any = None) -> EpisodeLoader:
        """An iterable over the complete episodes at trajectory, timestep or n-step level,
        with memmap-replay-buffer's arguments and output names (see
        :mod:`millpond.handle.dataloader`)."""
        self._require_episodes()
        return EpisodeLoader(self, batch_size, n_steps, fields, current_fields, next_fields,
                             sequence_fields, filter_meta, fieldname_map, return_mask,
                             timestep_level, to_named_tuple, shuffle, drop_last, seed, device)
