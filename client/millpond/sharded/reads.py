"""The episodic calls, reads and reset of a buffer spread over shards (mixed into
:class:`~millpond.sharded.buffer.ShardedBuffer`).

Episodes never span shards: a handle writes every record, meta and end of
its episodes to its own shard (:meth:`ShardedBuffer._send`), so each shard
holds whole episodes and serves windows, n-step transitions and episodes
from them on its own. Across shards:

* ``sample_sequences`` and ``sample(n_step=...)`` draw their starts like
  ``sample``: per-shard counts from a multinomial over the live shards'
  sizes (prioritized: priority mass), fetched in parallel, concatenated in
  shard order, ``indices`` carrying the shard.
* ``sample_episodes`` draws per-shard counts over the shards' complete
  episodes, so each complete episode is equally likely; the parts are
  padded to the widest.
* With ``filter_meta``, the counts still follow the shards' sizes (a shard
  does not say how many records match without a scan); a shard holding no
  match gives its draws to the others. Within each shard draws are uniform
  among the matches.
* ``episode_catalog`` lists shard after shard; its ``seqs`` carry the
  shard like sample ``indices``, so ``read`` sends each to its shard.
* Positions (``sample_by_index``, ``sample_all``, ``epoch_iterator``,
  ``export``) count the shards' records shard after shard (shard 0's oldest
  is 0), from the sizes the shards report at the start of the call; each
  shard resolves its own positions under its lock, but the shards are not
  read at one instant. ``reset`` empties every shard, and every shard must
  answer.
* If a handle's shard stops answering mid-episode, the rest of the episode
  goes to the next shard, which stores it as an episode of its own (steps
  from 0); the head stays on the old shard, never ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.checks import check_batch_size, check_count, check_indices, check_seed, check_timeout
from millpond.core.episode_checks import (
    MAX_WINDOW,
    check_fields,
    check_filter,
    check_n_step,
    check_updates,
    require_episodes,
)
from millpond.errors import IndexOutOfRangeError, NotEnoughDataError
from millpond.sharded.placement import decode_indices, encode_indices, raise_answered

if TYPE_CHECKING:
    from millpond.remote.buffer import RemoteBuffer
    from millpond.sharded.client import ShardedClient


class ShardedReads:
    """Episodic reads and updates over the shards (see the module docstring)."""

    config: BufferConfig
    remotes: list["RemoteBuffer"]
    _client: "ShardedClient"
    _home: int
    _check_open: Callable[[], None]
    flush: Callable[[], None]
    _live_infos: Callable[[], dict[int, BufferInfo]]
    _draw: Callable[..., dict[str, np.ndarray]]
    _draw_records: Callable[..., dict[str, np.ndarray]]

    def update_episodes(self, updates: Any) -> None:
        """Apply ``(episode id, meta, end)`` updates on this handle's shard (where its
        episodes are), after the pushes queued before."""
        self._check_open()
        checked = check_updates(self.config, updates)
        self.flush()
        self.remotes[self._home].update_episodes(checked)

    def sample_n_step(self, batch_size: int, n_step: int, gamma: float = 0.99,
                      seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                      timeout: float | None = None) -> dict[str, np.ndarray]:
        """n-step transitions drawn over the shards (see the engine's ``sample_n_step``)."""
        n_step, gamma = check_n_step(self.config, n_step, gamma)
        return self._episodic_draw(batch_size, seed, filter_meta, timeout, "records",
                                   lambda remote, count, sd, options: remote.sample_n_step(
                                       count, n_step, gamma, sd, **options))

    def sample_sequences(self, batch_size: int, seq_len: int,
                         seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None) -> dict[str, np.ndarray]:
        """Windows of episodes drawn over the shards (see the engine's ``sample_sequences``)."""
        seq_len = check_count("seq_len", seq_len, MAX_WINDOW)
        return self._episodic_draw(batch_size, seed, filter_meta, timeout, "starts",
                                   lambda remote, count, sd, options: remote.sample_sequences(
                                       count, seq_len, sd, **options))

    sample_trajectories = sample_sequences  # rlox's name

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> dict[str, np.ndarray]:
        """Complete episodes drawn over the shards, each equally likely (see the engine's
        ``sample_episodes``), padded to the longest drawn (or ``max_len``)."""
        if max_len is not None:
            max_len = check_count("max_len", max_len, MAX_WINDOW)
        return self._episodic_draw(batch_size, seed, filter_meta, timeout, "episodes",
                                   lambda remote, count, sd, options: remote.sample_episodes(
                                       count, sd, max_len=max_len, **options))

    def _episodic_draw(self, batch_size: int, seed: int | None,
                       filter_meta: Mapping[str, Any] | None, timeout: float | None,
                       draws: str, call: Callable[..., dict[str, np.ndarray]]
                       ) -> dict[str, np.ndarray]:
        """Validate, then ``call(remote, count, seed, options)`` on each shard drawn, and
        merge. ``draws``: ``"records"`` like :meth:`sample` (at most the records held),
        ``"starts"`` with replacement, or ``"episodes"`` over complete episodes."""
        self._check_open()
        require_episodes(self.config)
        k, seed, timeout = check_batch_size(batch_size), check_seed(seed), check_timeout(timeout)
        check_filter(self.config, filter_meta)
        options: dict[str, Any] = {"timeout": timeout}
        if filter_meta:
            options["filter_meta"] = filter_meta
        self.flush()
        infos = self._live_infos()

        def fetch(shard: int, count: int, sd: int | None) -> dict[str, np.ndarray]:
            return call(self.remotes[shard], count, sd, options)

        if draws == "starts":
            return self._draw(k, seed, infos, fetch, shed_short=True)
        if draws == "records":
            return self._draw_records(k, seed, infos, fetch, True)
        masses = {s: float(i.episodes) for s, i in infos.items()}
        if not any(masses.values()):
            raise NotEnoughDataError("no complete episode to sample (on any live shard)")
        stepwise = {*self.config.schema.names, "mask"}
        return self._draw(k, seed, infos, fetch, shed_short=True, masses=masses,
                          merge=lambda parts: _merge_padded(parts, stepwise))

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                        ) -> dict[str, np.ndarray]:
        """Every live shard's catalog, shard after shard; ``seqs`` carry their shard."""
        self._check_open()
        require_episodes(self.config)
        check_filter(self.config, filter_meta)
        self.flush()
        shards = sorted(self._live_infos())
        got, errors = self._client.fan_out(
            shards, lambda s: self.remotes[s].episode_catalog(filter_meta))
        raise_answered(errors)
        parts = [{**got[s], "seqs": encode_indices(s, got[s]["seqs"])} for s in sorted(got)]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def read(self, seqs: Any, fields: Any = None, *, positions: bool = False,
             episode_ids: bool = False) -> dict[str, np.ndarray]:
        """Records by index (a sharded sample's ``indices``, a sharded catalog's ``seqs``)
        or by position (see the module docstring), in the order given, and ``live``.
        A shard that does not answer raises: its records cannot be read elsewhere."""
        self._check_open()
        wanted = check_indices(seqs, "positions" if positions else "seqs")
        names = check_fields(self.config, fields)
        if episode_ids:
            require_episodes(self.config)
        self.flush()
        if positions:
            shards, local = self._positions(wanted)
        else:
            shards, local = decode_indices(wanted, self._client.shards)
        rows = {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}
        options = dict(positions=positions, episode_ids=episode_ids)
        if not rows:  # nothing asked: the shape of an answer from shard 0
            return self.remotes[0].read(local, names, **options)
        got, errors = self._client.fan_out(
            list(rows), lambda s: self.remotes[s].read(local[rows[s]], names, **options))
        for shard in sorted(errors):
            raise errors[shard]
        first = got[min(got)]
        out = {name: np.empty((len(wanted),) + a.shape[1:], a.dtype) for name, a in first.items()}
        for s, part in got.items():
            for name, array in part.items():
                out[name][rows[s]] = array
        return out

    def _positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shards, local positions)`` of positions over the shards' contents, shard
        after shard; IndexOutOfRangeError (nothing read) for one past the end."""
        sizes = [0] * self._client.shards
        for shard, info in self._every_info().items():
            sizes[shard] = info.size
        starts = np.cumsum([0] + sizes)
        outside = (positions < 0) | (positions >= starts[-1])
        if outside.any():
            raise IndexOutOfRangeError(
                f"position {int(positions[outside][0])} is out of range: the buffer holds "
                f"{int(starts[-1])} records (positions 0 to {int(starts[-1]) - 1})")
        shards = np.searchsorted(starts, positions, side="right") - 1
        return shards, positions - starts[shards]

    def _every_info(self) -> dict[int, BufferInfo]:
        """Every shard's info; raise if one does not answer (reads by position and
        reset need them all)."""
        shards = list(range(self._client.shards))
        infos, errors = self._client.fan_out(shards, lambda s: self.remotes[s].info())
        for shard in sorted(errors):
            raise errors[shard]
        return infos

    def read_chunk(self, record_nbytes: int) -> int:
        """Records one read's reply may carry (the smallest of the shards' limits)."""
        return min(remote.read_chunk(record_nbytes) for remote in self.remotes)

    def reset(self) -> None:
        """Drop every record on every shard (each answers, or this raises; shards that
        did answer are empty then)."""
        self._check_open()
        self.flush()
        _, errors = self._client.fan_out(list(range(self._client.shards)),
                                         lambda s: self.remotes[s].reset())
        for shard in sorted(errors):
            raise errors[shard]


def _merge_padded(parts: list[dict[str, np.ndarray]], stepwise: set[str]
                  ) -> dict[str, np.ndarray]:
    """Episode samples of different widths as one: the ``stepwise`` arrays (fields and
    ``mask``, ``[batch, width, ...]``) zero-padded to the widest part."""
    width = max(p["mask"].shape[1] for p in parts)
    out = {}
    for name in parts[0]:
        arrays = [part[name] for part in parts]
        if name in stepwise:
            arrays = [np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
                      for a in arrays]
        out[name] = np.concatenate(arrays)
    return out
