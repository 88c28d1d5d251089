"""What episodic buffers sample: windows of episodes, whole episodes, n-step transitions.

Each function runs with the buffer's lock held, once the buffer decided
that the sample may proceed; it draws with the buffer's strategy (uniform or
by priority, use limits counted) among the records that ``filter_meta``
allows, and gathers rows in draw order. Positions past an episode's end
(``mask`` False) are zero in every field.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Sequence

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.episodes import EpisodeIndex
from millpond.core.fifo import Fifo
from millpond.core.schema import Schema
from millpond.errors import NotEnoughDataError

Filter = Mapping[str, np.ndarray] | None
Out = Mapping[str, np.ndarray] | None  # arrays to write results into (e.g. shared memory)


def sample_sequences(fifo: Fifo, index: EpisodeIndex, strategy: Any, rng: np.random.Generator,
                     batch_size: int, seq_len: int, filter_meta: Filter, out: Out = None
                     ) -> dict[str, np.ndarray]:
    """``batch_size`` windows of ``seq_len`` steps from starts drawn among the live records."""
    starts, extras = strategy.draw(rng, batch_size, _among(index, filter_meta))
    seqs = index.windows(starts, seq_len)
    mask = seqs >= 0
    rows = _padded(fifo, _fill(seqs, mask, starts), mask, None, out)
    return _into(out, {**rows, "mask": mask, "lens": mask.sum(axis=1), **index.describe(starts),
                       **extras})


def sample_episodes(fifo: Fifo, index: EpisodeIndex, rng: np.random.Generator, batch_size: int,
                    max_len: int | None, filter_meta: Filter) -> dict[str, np.ndarray]:
    """``batch_size`` complete live episodes drawn uniformly with replacement, their first
    ``max_len`` steps (default: padded to the longest drawn)."""
    heads = index.heads(filter_meta)
    if not len(heads):
        raise NotEnoughDataError(
            "no complete episode to sample" + (f" with meta {_shown(filter_meta)}"
                                               if filter_meta else "")
            + " (an episode is complete once ended, while its first record is live)")
    picked = heads[rng.integers(0, len(heads), size=batch_size)]
    width = int(index.lengths(picked).max()) if max_len is None else max_len
    seqs = index.windows(picked, width)
    mask = seqs >= 0
    described = index.describe(picked)
    del described["start_steps"]  # always 0
    return {**_padded(fifo, _fill(seqs, mask, picked), mask), "mask": mask, "lens": mask.sum(axis=1),
            **described}


def sample_n_step(fifo: Fifo, index: EpisodeIndex, strategy: Any, rng: np.random.Generator,
                  batch_size: int, n_step: int, gamma: float, filter_meta: Filter,
                  out: Out = None) -> dict[str, np.ndarray]:
    """n-step transitions of the transition schema from steps ``t`` drawn like ``sample``.

    ``rewards`` is ``sum(gamma**k * r[t+k] for k < n_step_lens)`` where
    ``n_step_lens = min(n_step, steps stored from t on)``; ``next_obs``,
    ``terminated`` and ``truncated`` are those of step ``t + n_step_lens - 1``.
    """
    starts, extras = strategy.draw(rng, batch_size, _among(index, filter_meta))
    if len(fifo.holes):  # a damaged record ends a window: the general path
        windows = index.windows(starts, n_step)
        seqs, lens = _fill(windows, windows >= 0, starts), (windows >= 0).sum(axis=1)
    else:  # past an episode's end: its last record again
        seqs, lens = index.walk(starts, n_step)
    returns = np.einsum("ij,ij->i", fifo.take(seqs, "rewards"), _discounts(n_step, gamma)[lens])
    head = fifo.gather_rows(starts, ["obs", "actions"], out)
    tail = fifo.gather_rows(seqs[:, -1], ["next_obs", "terminated", "truncated"], out)
    rows = {**head, **tail, "rewards": returns.astype(fifo.schema["rewards"].dtype)}
    return _into(out, {**{name: rows[name] for name in fifo.schema.names}, "n_step_lens": lens,
                       **extras})


@functools.lru_cache(maxsize=64)
def _discounts(n_step: int, gamma: float) -> np.ndarray:
    """Row ``k``: the discounts of the first ``k`` of ``n_step`` rewards, zero after them
    (a window that ends after ``k`` steps)."""
    powers = np.full((n_step + 1, n_step), gamma, np.float64) ** np.arange(n_step)
    table = np.tril(powers, -1)
    table.flags.writeable = False
    return table


def catalog(index: EpisodeIndex, filter_meta: Filter) -> dict[str, np.ndarray]:
    """The complete live episodes that match, in episode order (their first records'
    order): ``episode_ids``, ``lens``, their meta fields, and ``seqs``, every record of
    each episode in step order, episode after episode."""
    heads = index.heads(filter_meta)
    lengths = index.lengths(heads)
    described = index.describe(heads)
    del described["start_steps"]
    return {**described, "lens": lengths, "seqs": index.chains(heads, lengths)}


def read(fifo: Fifo, seqs: np.ndarray, names: Sequence[str] | None, out: Out = None,
         index: EpisodeIndex | None = None, all_live: bool = False) -> dict[str, np.ndarray]:
    """Records ``seqs`` (fields ``names``, default all, in that order) in the order given,
    and ``live``: which were still live (the others' rows are zero); with ``index``, also
    ``episode_ids`` (0 where not live). ``all_live``: the caller knows every one of
    ``seqs`` is live (positions resolved under the same lock), so none is checked."""
    if all_live:
        if out is not None and "live" in out:  # shared memory: written there, not copied
            live = out["live"]
            live[...] = True
        else:
            live = np.ones(len(seqs), bool)
        rows = fifo.gather_rows(seqs, names, out)
    elif not (live := fifo.is_live(seqs)).any():
        rows = {name: np.zeros((len(seqs),) + fifo.schema[name].shape, fifo.schema[name].dtype)
                for name in names or fifo.schema.names}
    else:
        rows = _padded(fifo, np.where(live, seqs, seqs[live][0]), live, names, out)
    result = {**rows, "live": live}
    if index is not None:
        result["episode_ids"] = np.where(live, index.episode[seqs % fifo.total_capacity], 0)
    return _into(out, result)


def _padded(fifo: Fifo, seqs: np.ndarray, mask: np.ndarray, names: Sequence[str] | None = None,
            out: Out = None) -> dict[str, np.ndarray]:
    """Rows for ``seqs`` (any shape; all live), zeroed where ``mask`` is False: masked
    positions name some live record, so that one gather serves every position."""
    rows = fifo.gather_rows(seqs, names, out)
    if not mask.all():
        for column in rows.values():
            column[~mask] = 0
    return rows


def _into(out: Out, result: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``result`` with each array ``out`` has a place for copied there (the big ones were
    gathered there already)."""
    if out is None:
        return result
    for name, array in result.items():
        if name in out and out[name] is not array:
            out[name][...] = array
            result[name] = out[name]
    return result


def _fill(seqs: np.ndarray, mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``seqs`` with each position past its window's end naming the window's start."""
    return np.where(mask, seqs, starts[:, None])


def _among(index: EpisodeIndex, filter_meta: Filter) -> np.ndarray | None:
    return None if not filter_meta else index.candidates(filter_meta)


def _shown(filter_meta: Filter) -> dict[str, Any]:
    return {name: np.asarray(value).tolist() for name, value in (filter_meta or {}).items()}


# ---- the shapes of results, known before the draw (for shared-memory replies) -------------

Spec = tuple[tuple[str, np.dtype, tuple[int, ...]], ...]  # hashable: layouts are cached
_I8, _BOOL = np.dtype("<i8"), np.dtype(bool)


def sequence_specs(config: BufferConfig, batch_size: int, seq_len: int) -> Spec:
    """Every array :func:`sample_sequences` returns: name, dtype, shape."""
    b = batch_size
    return ((*((f.name, f.dtype, (b, seq_len, *f.shape)) for f in config.schema),
             ("mask", _BOOL, (b, seq_len)), ("lens", _I8, (b,)), ("episode_ids", _I8, (b,)),
             ("start_steps", _I8, (b,)), *_meta_specs(config, b), *_extra_specs(config, b)))


def episode_specs(config: BufferConfig, batch_size: int, width: int) -> Spec:
    """Every array :func:`sample_episodes` returns, ``width`` steps wide (its ``max_len``,
    or the longest episode drawn)."""
    b = batch_size
    return ((*((f.name, f.dtype, (b, width, *f.shape)) for f in config.schema),
             ("mask", _BOOL, (b, width)), ("lens", _I8, (b,)), ("episode_ids", _I8, (b,)),
             *_meta_specs(config, b)))


def catalog_specs(config: BufferConfig, episodes: int, records: int) -> Spec:
    """Every array :func:`catalog` returns for ``episodes`` episodes of ``records``
    records in all."""
    return (("episode_ids", _I8, (episodes,)), *_meta_specs(config, episodes),
            ("lens", _I8, (episodes,)), ("seqs", _I8, (records,)))


def n_step_specs(config: BufferConfig, batch_size: int) -> Spec:
    """Every array :func:`sample_n_step` returns."""
    return ((*((f.name, f.dtype, (batch_size, *f.shape)) for f in config.schema),
             ("n_step_lens", _I8, (batch_size,)), *_extra_specs(config, batch_size)))


def read_specs(config: BufferConfig, n: int, names: Sequence[str] | None,
               episode_ids: bool = False) -> Spec:
    """Every array :func:`read` returns (fields in the order of ``names``). The same
    object for the same arguments while cached: a learner reads the same shape on every
    step, and the shared-memory layouts keyed by it are found at once."""
    return _read_specs(config.schema, n, None if names is None else tuple(names), episode_ids)


@functools.lru_cache(maxsize=256)
def _read_specs(schema: Schema, n: int, names: tuple[str, ...] | None, episode_ids: bool
                ) -> Spec:
    fields = [schema[name] for name in names or schema.names]
    return ((*((f.name, f.dtype, (n, *f.shape)) for f in fields), ("live", _BOOL, (n,)),
             *((("episode_ids", _I8, (n,)),) if episode_ids else ())))


def sample_specs(config: BufferConfig, batch_size: int) -> Spec:
    """Every array a buffer's ``sample`` returns (without ``n_step``)."""
    return ((*((f.name, f.dtype, (batch_size, *f.shape)) for f in config.schema),
             *_extra_specs(config, batch_size)))


def _meta_specs(config: BufferConfig, b: int) -> Spec:
    return tuple((f.name, f.dtype, (b, *f.shape)) for f in config.meta_fields or ())


def _extra_specs(config: BufferConfig, b: int) -> Spec:
    if config.prioritized is None:
        return ()
    return (("weights", np.dtype("<f4"), (b,)), ("indices", _I8, (b,)))


def reply_specs(config: BufferConfig, op: str, n: int, params: Mapping[str, Any]) -> Spec | None:
    """Every array call ``op`` returns for ``n`` (batch size, or records read), when known
    before it runs; None when not (``sample_episodes`` without ``max_len``: the longest
    episode drawn decides)."""
    if op == "sample_sequences":
        return sequence_specs(config, n, params["seq_len"])
    if op == "sample_episodes":
        return episode_specs(config, n, params["max_len"]) if params.get("max_len") else None
    if op == "sample_n_step":
        return n_step_specs(config, n)
    if op == "read":
        return read_specs(config, n, params.get("fields"), params.get("episode_ids", False))
    if op == "sample":
        return sample_specs(config, n)
    return None


def episodic_reply_nbytes(config: BufferConfig, op: str, n: int, params: Mapping[str, Any]) -> int:
    """Bytes of the arrays call ``op`` returns for ``n`` (see :func:`reply_specs`; 0 when
    not known before it runs)."""
    specs = reply_specs(config, op, n, params)
    return 0 if specs is None else sum(math.prod(shape) * dtype.itemsize
                                       for _, dtype, shape in specs)
