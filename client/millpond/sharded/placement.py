"""The arithmetic of a buffer spread over shards: no I/O here (see :mod:`millpond.sharded.client`).

* **Capacities.** A buffer of ``total_capacity`` records over ``n`` shards
  gives shard ``i`` ``total_capacity // n`` records, plus one for each of the
  first ``total_capacity % n`` shards (the same for ``hot_capacity``, so
  every shard keeps ``hot <= total``). Each shard needs at least one hot
  record: ``hot_capacity >= n``. A buffer with ``frame_stack`` or ``next_of``
  gives each shard frames for its share: the default ``frame_capacity`` is the
  shard's own default (:func:`~millpond.core.frames.default_frame_capacity` of its
  ``total_capacity``), one given is split in proportion to the shards'
  ``total_capacity`` (rounded up). A shard's ring must hold its live records'
  frames and those of a push, which goes whole to one shard.
* **Indices.** A sharded prioritized sample's ``indices`` are
  ``shard * 2**48 + seq`` (``seq``: the record's index on its shard), so
  ``update_priorities`` sends each back to its shard.
* **Draws.** A sample of ``k`` draws per-shard counts from a multinomial over
  the shards' sizes (prioritized buffers: their ``priority ** alpha`` mass),
  then one seed per shard from the same generator: the same seed and
  contents give the same batch.
* **Weights.** A shard weighs its records ``(value / shard_min) ** -beta``;
  against the whole buffer a record's weight is ``(value / global_min) **
  -beta`` (the global total cancels out of the normalized weight), that is the
  shard's weight times ``(global_min / shard_min) ** beta``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.frames import default_frame_capacity
from millpond.core.info import COUNTERS, BufferInfo, ShardInfo
from millpond.core.ratelimit import Queue
from millpond.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    InvalidConfigError,
    RateLimitTimeoutError,
    ServerUnavailableError,
)

SHARD_SHIFT = 48
SEQ_MASK = (1 << SHARD_SHIFT) - 1
_SUMMED = tuple(key for key in COUNTERS if key not in ("samples_per_insert", "read_only"))


def is_down(exc: BaseException) -> bool:
    """Whether ``exc`` means a shard did not answer (rather than answered with an error)."""
    if isinstance(exc, RateLimitTimeoutError):
        return False
    return isinstance(exc, (ServerUnavailableError, DeadlineExceededError))


def raise_answered(errors: Mapping[Any, BaseException]) -> None:
    """Raise the first error a shard answered with (jobs in order: a shard, or a tuple
    starting with one); not answering (:func:`is_down`) is the caller's to handle."""
    for job in sorted(errors, key=lambda j: j if isinstance(j, int) else j[0:2]):
        if not is_down(errors[job]):
            raise errors[job]


def split(count: int, n: int) -> list[int]:
    """``count`` split over ``n`` shards: the first ``count % n`` get one more."""
    base, extra = divmod(count, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _default_queue(config: BufferConfig) -> bool:
    """Whether ``config``'s limiter is the queue a queue/stack gets by default."""
    return config.removes and config.rate_limiter == Queue(config.total_capacity)


def shard_configs(config: BufferConfig, n: int) -> list[BufferConfig]:
    """The config of each of ``n`` shards of a buffer with ``config``.

    Capacities are split (see the module docstring); every other setting,
    the rate limiter included, is the same on every shard, except a queue's
    or stack's default ``Queue(total_capacity)``, which follows the shard's
    capacity.
    """
    if config.hot_capacity < n:
        raise InvalidConfigError(
            f"hot_capacity {config.hot_capacity} cannot be split over {n} shards: each "
            "shard needs at least one record")
    default_queue = _default_queue(config)
    out = []
    for hot, total in zip(split(config.hot_capacity, n), split(config.total_capacity, n)):
        limiter = Queue(total) if default_queue else config.rate_limiter
        out.append(dataclasses.replace(config, hot_capacity=hot, total_capacity=total,
                                       rate_limiter=limiter,
                                       frame_capacity=_frame_share(config, total)))
    return out


def _frame_share(config: BufferConfig, total: int) -> int | None:
    """The ``frame_capacity`` of a shard of ``total`` records (None: its default)."""
    frames = config.frame_capacity
    if frames is None or frames == default_frame_capacity(config.total_capacity):
        return None
    return -(-frames * total // config.total_capacity)


def global_config(configs: Sequence[BufferConfig]) -> BufferConfig:
    """The config the shards with ``configs`` make together (capacities summed)."""
    first = configs[0]
    hot = sum(c.hot_capacity for c in configs)
    total = sum(c.total_capacity for c in configs)
    limiter = Queue(total) if _default_queue(first) else first.rate_limiter
    frames = (None if first.frame_capacity is None
              else sum(c.frame_capacity or 0 for c in configs))
    return dataclasses.replace(first, hot_capacity=hot, total_capacity=total, rate_limiter=limiter,
                               frame_capacity=frames)


def same_but_capacities(a: BufferConfig, b: BufferConfig) -> list[tuple[str, str, str]]:
    """What differs between ``a`` and ``b`` besides capacities (and a default queue)."""
    capacities = dict(hot_capacity=b.hot_capacity, total_capacity=b.total_capacity)
    if a.frame_capacity is not None and b.frame_capacity is not None:
        capacities["frame_capacity"] = b.frame_capacity  # (split too)
    if _default_queue(a) and _default_queue(b):
        capacities["rate_limiter"] = b.rate_limiter  # type: ignore[assignment]
    return dataclasses.replace(a, **capacities).differences(b)  # type: ignore[arg-type]


# ---- indices -----------------------------------------------------------------------------

def encode_indices(shard: int, seqs: np.ndarray) -> np.ndarray:
    """A shard's sample ``indices`` as the sharded buffer's: ``shard * 2**48 + seq``."""
    return np.asarray(seqs, np.int64) + np.int64(shard << SHARD_SHIFT)


def decode_indices(indices: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(shards, seqs)`` of sharded ``indices`` (int64); InvalidArgumentError for a
    negative index or one naming a shard this client does not have."""
    if len(indices) and indices.min() < 0:
        raise InvalidArgumentError("indices must be >= 0 (the indices a sample returned)")
    shards = indices >> SHARD_SHIFT
    if len(indices) and shards.max() >= n:
        raise InvalidArgumentError(
            f"index {int(indices[shards >= n][0])} names shard {int(shards.max())}, but this "
            f"client has {n} shards (indices are shard * 2**{SHARD_SHIFT} + seq)")
    return shards, indices & SEQ_MASK


# ---- draws ---------------------------------------------------------------------------------

def plan(rng: np.random.Generator, k: int, masses: dict[int, float], n: int,
         seeded: bool) -> tuple[dict[int, int], list[int | None]]:
    """``({shard: count}, seeds)`` of a sample of ``k`` over the shards in ``masses``
    (those answering, with their sizes or priority masses; ``n`` shards in all).

    Counts come from a multinomial over ``masses``; then one seed per shard
    (all ``n``, so a shard's seed does not depend on which others answered),
    or None each if the sample is unseeded.
    """
    shards = sorted(masses)
    weights = np.array([masses[s] for s in shards], np.float64)
    total = weights.sum()
    if not total > 0:  # nothing drawable (or every priority zero): none is more likely
        weights = np.ones(len(shards))
        total = float(len(shards))
    counts = rng.multinomial(k, weights / total)
    seeds: list[int | None] = ([int(s) for s in rng.integers(0, 2**63, size=n)] if seeded
                               else [None] * n)
    return {s: int(c) for s, c in zip(shards, counts) if c}, seeds


def pieces(count: int, size: int, seed: int | None) -> list[tuple[int, int | None]]:
    """``count`` draws from a shard holding ``size`` records, as calls of at most ``size``
    (a shard refuses to draw more than it holds): ``[(batch, seed), ...]``."""
    if count <= size or size <= 0:
        return [(count, seed)]
    out = []
    for j, start in enumerate(range(0, count, size)):
        out.append((min(size, count - start), None if seed is None else (seed + j) % 2**63))
    return out


def cap(counts: dict[int, int], sizes: dict[int, int]) -> dict[int, int]:
    """Counts no larger than the shards' drawable records (``max_times_sampled``): the
    excess goes to the shards with the most room (the lowest index on ties)."""
    out = {s: min(c, sizes[s]) for s, c in counts.items()}
    excess = sum(counts.values()) - sum(out.values())
    while excess:
        room = {s: size - out.get(s, 0) for s, size in sizes.items() if size > out.get(s, 0)}
        target = (max(room, key=lambda s: (room[s], -s)) if room
                  else max(sizes, key=lambda s: (sizes[s], -s)))  # it will say it is short
        take = min(excess, room[target]) if room else excess
        out[target] = out.get(target, 0) + take
        excess -= take
    return {s: c for s, c in out.items() if c}


def rescale_weights(weights: np.ndarray, shard_min: float | None, global_min: float,
                    beta: float | None) -> np.ndarray:
    """A shard's importance weights against the whole buffer's smallest priority."""
    if not beta or shard_min is None or not 0 < global_min < shard_min < np.inf:
        return weights
    return (weights * (global_min / shard_min) ** beta).astype(np.float32)


# ---- infos ---------------------------------------------------------------------------------

def aggregate(name: str | None, config: BufferConfig | None, shards: Sequence[ShardInfo]
              ) -> BufferInfo:
    """One info for the whole buffer: counters summed over the shards that answered,
    ``shards`` the breakdown (see :attr:`BufferInfo.degraded`)."""
    live = [s.info for s in shards if s.info is not None]
    numbers: dict = {key: sum(getattr(i, key) for i in live) for key in _SUMMED}
    numbers["samples_per_insert"] = (numbers["samples"] / numbers["inserts"]
                                     if numbers["inserts"] else 0.0)
    numbers["read_only"] = any(i.read_only for i in live)
    prioritized = [i for i in live if i.priority_total is not None]
    if prioritized:
        numbers.update(
            beta=prioritized[0].beta, max_priority=max(i.max_priority or 0.0 for i in prioritized),
            priority_total=sum(i.priority_total or 0.0 for i in prioritized),
            priority_min=min(i.priority_min if i.priority_min is not None else np.inf
                             for i in prioritized))
    return BufferInfo(config, name=name, shards=tuple(shards), **numbers)
