"""Iterating over an episodic buffer's complete episodes, memmap-replay-buffer style.

:class:`EpisodeLoader` gives memmap-replay-buffer's ``dataloader`` its
meaning on a millpond buffer, local or remote, at three levels:

* trajectory (default): one item per episode, fields padded to the longest
  episode of the batch, ``_lens`` and (``return_mask``) ``_mask``;
* ``timestep_level``: one item per step of every episode;
* ``n_steps=n``: one item per step ``t`` but an episode's last, with
  ``current_fields`` at ``t``, ``next_<f>`` (``next_fields``) at ``t + k``
  and ``seq_<f>`` (``sequence_fields``) over ``t .. t + k - 1``, zero-padded
  to ``n``, where ``k = n_step_lens = min(n, len - t - 1)``.

Every item carries its episode's meta fields; ``fieldname_map`` renames
outputs, ``to_named_tuple`` picks and orders them (leading ``_`` dropped from
the tuple's names). Items come in episode order (each episode's first
record's order), then step order, unless ``shuffle``.

The loader lists the buffer's complete episodes when it is made (the
buffer's :meth:`episode_catalog`) and reads their records batch by batch
(:meth:`read`). Items whose records were evicted since are left out of
their batch, so a batch can come out smaller than ``batch_size``.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from millpond.core.checks import check_batch_size, check_count, check_seed
from millpond.errors import InvalidArgumentError, NotEnoughDataError
from millpond.handle.devices import to_device

MAX_N_STEPS = 1 << 16


class EpisodeLoader:
    """An iterable of batches (dicts of numpy arrays, or named tuples); see the module."""

    def __init__(self, buffer: Any, batch_size: int, n_steps: int | None = None,
                 fields: Sequence[str] | None = None,
                 current_fields: Sequence[str] | None = None,
                 next_fields: Sequence[str] | None = None,
                 sequence_fields: Sequence[str] | None = None,
                 filter_meta: Mapping[str, Any] | None = None,
                 fieldname_map: Mapping[str, str] | None = None, return_mask: bool = False,
                 timestep_level: bool = False, to_named_tuple: Sequence[str] | None = None,
                 shuffle: bool = False, drop_last: bool = False, seed: int | None = None,
                 device: Any = None):
        if to_named_tuple is not None and fields is not None:
            raise InvalidArgumentError("cannot specify both fields and to_named_tuple")
        if n_steps is not None and timestep_level:
            raise InvalidArgumentError("cannot specify both n_steps and timestep_level")
        if return_mask and (timestep_level or n_steps is not None):
            raise InvalidArgumentError("return_mask is only supported for trajectory-level data")
        self.batch_size = check_batch_size(batch_size)
        self.n_steps = None if n_steps is None else check_count("n_steps", n_steps, MAX_N_STEPS)
        names = buffer.schema.names
        self.fields = _fields(fields, names, "fields")
        self.current_fields = _fields(current_fields, names, "current_fields")
        self.next_fields = _fields(next_fields, names, "next_fields")
        self.sequence_fields = _fields(sequence_fields, names, "sequence_fields", default=())
        self.rename = dict(fieldname_map or {})
        self.return_mask, self.timestep_level = return_mask, timestep_level
        self.to_named_tuple = None if to_named_tuple is None else tuple(to_named_tuple)
        self.shuffle, self.drop_last, self.device = shuffle, drop_last, device
        self._rng = np.random.default_rng(check_seed(seed))
        self.buffer = buffer
        self.catalog = catalog = buffer.episode_catalog(filter_meta)
        self.lens = catalog["lens"]
        self.meta_names = [name for name in catalog
                           if name not in ("episode_ids", "lens", "seqs")]
        self.starts = np.r_[0, np.cumsum(self.lens)[:-1]].astype(np.int64)
        self.items = self._items()
        if not len(self.items):
            raise NotEnoughDataError(
                "no complete episode to load" + (f" with meta {dict(filter_meta)}"
                                                 if filter_meta else "")
                + ("" if self.n_steps is None else " (n-step items need 2 steps or more)"))

    # ---- items -------------------------------------------------------------------------

    def _items(self) -> np.ndarray:
        """Trajectory level: episode numbers; otherwise positions in the catalog's seqs."""
        if self.n_steps is None and not self.timestep_level:
            return np.arange(len(self.lens))
        episode = np.repeat(np.arange(len(self.lens)), self.lens)
        positions = np.arange(int(self.lens.sum()))
        if self.n_steps is None:
            return positions
        step = positions - self.starts[episode]
        return positions[step < self.lens[episode] - 1]  # a transition needs a next step

    def __len__(self) -> int:
        """Batches per pass (items later evicted still count)."""
        full, rest = divmod(len(self.items), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[Any]:
        items = self._rng.permutation(self.items) if self.shuffle else self.items
        for i in range(len(self)):
            batch = self._batch(items[i * self.batch_size:(i + 1) * self.batch_size])
            if batch is not None:
                yield batch

    # ---- batches -----------------------------------------------------------------------

    def _batch(self, items: np.ndarray) -> Any:
        if self.n_steps is not None:
            out = self._n_step(items)
        elif self.timestep_level:
            out = self._timesteps(items)
        else:
            out = self._trajectories(items)
        return None if out is None else self._finish(out)

    def _trajectories(self, episodes: np.ndarray) -> dict[str, np.ndarray] | None:
        lens, starts = self.lens[episodes], self.starts[episodes]
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
        rows = self._read(self.catalog["seqs"][positions], self.fields)
        owner = np.repeat(np.arange(len(episodes)), lens)
        keep = np.ones(len(episodes), bool)
        keep[owner[~rows.pop("live")]] = False
        if not keep.any():
            return None
        width = int(lens[keep].max())
        step = np.arange(len(positions)) - np.repeat(np.r_[0, np.cumsum(lens)[:-1]], lens)
        out = {}
        for name, column in rows.items():
            padded = np.zeros((len(episodes), width) + column.shape[1:], column.dtype)
            mine = keep[owner]
            padded[owner[mine], step[mine]] = column[mine]
            out[self._name(name)] = padded[keep]
        out.update(self._meta(episodes[keep]))
        out["_lens"] = lens[keep].astype(np.int64)
        if self.return_mask:
            out["_mask"] = np.arange(width)[None, :] < out["_lens"][:, None]
        return out

    def _timesteps(self, positions: np.ndarray) -> dict[str, np.ndarray] | None:
        rows = self._read(self.catalog["seqs"][positions], self.fields)
        live = rows.pop("live")
        if not live.any():
            return None
        out = {self._name(name): column[live] for name, column in rows.items()}
        return {**out, **self._meta(self._episode_of(positions[live]))}

    def _n_step(self, positions: np.ndarray) -> dict[str, np.ndarray] | None:
        n = self.n_steps
        assert n is not None
        episode = self._episode_of(positions)
        step = positions - self.starts[episode]
        k = np.minimum(n, self.lens[episode] - step - 1)
        seqs = self.catalog["seqs"]
        now = self._read(seqs[positions], self.current_fields)
        later = self._read(seqs[positions + k], self.next_fields)
        window = positions[:, None] + np.arange(n)[None, :]
        inside = np.arange(n)[None, :] < k[:, None]
        run = self._read(seqs[np.where(inside, window, positions[:, None]).reshape(-1)],
                         self.sequence_fields) if self.sequence_fields else {"live": np.ones(0, bool)}
        live = now.pop("live") & later.pop("live")
        if self.sequence_fields:
            live &= run.pop("live").reshape(len(positions), n).all(axis=1)
        else:
            run.pop("live")
        if not live.any():
            return None
        out = {self._name(name): column[live] for name, column in now.items()}
        out.update({self._name(f"next_{name}"): column[live] for name, column in later.items()})
        for name, column in run.items():
            shaped = column.reshape((len(positions), n) + column.shape[1:])
            shaped[~inside] = 0
            out[self._name(f"seq_{name}")] = shaped[live]
        out[self._name("n_step_lens")] = k[live].astype(np.int64)
        return {**out, **self._meta(episode[live])}

    # ---- helpers -----------------------------------------------------------------------

    def _read(self, seqs: np.ndarray, fields: Sequence[str]) -> dict[str, np.ndarray]:
        if not fields:
            return {"live": np.ones(len(seqs), bool)}
        return self.buffer.read(seqs, list(fields))

    def _episode_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, positions, side="right") - 1

    def _meta(self, episodes: np.ndarray) -> dict[str, np.ndarray]:
        return {self._name(name): self.catalog[name][episodes] for name in self.meta_names}

    def _name(self, name: str) -> str:
        return self.rename.get(name, name)

    def _finish(self, batch: dict[str, np.ndarray]) -> Any:
        if self.device is not None:
            batch = to_device(batch, self.device)
        if self.to_named_tuple is None:
            return batch
        missing = [name for name in self.to_named_tuple if name not in batch]
        if missing:
            raise InvalidArgumentError(f"fields {missing} not found in batch; available: "
                                       f"{list(batch)}")
        named = namedtuple("Batch", [name.lstrip("_") for name in self.to_named_tuple])  # type: ignore[misc]
        return named(*(batch[name] for name in self.to_named_tuple))


def _fields(given: Sequence[str] | None, names: Sequence[str], label: str,
            default: Sequence[str] | None = None) -> tuple[str, ...]:
    if given is None:
        return tuple(names if default is None else default)
    chosen = (given,) if isinstance(given, str) else tuple(given)
    unknown = [name for name in chosen if name not in names]
    if unknown:
        raise InvalidArgumentError(f"{label}: unknown fields {unknown}; the buffer has {list(names)}")
    return chosen
