"""The buffer classes users construct: the reference API, local or remote.

``ReplayBuffer`` and ``MmapReplayBuffer`` take the reference constructor
arguments. Without ``address`` they run the engine in-process; with
``address="host:port"`` and ``name=...`` the same object talks to a millpond
server. Either way the methods, results and exceptions are the same.

This module only binds the reference's call signatures to field names; the
backend (:class:`millpond.core.TieredBuffer` or
:class:`millpond.remote.RemoteBuffer`) does the work.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from .core import Schema, TieredBuffer
from .core.ratelimit import RateLimiter
from .core.prioritized import PrioritizedTieredBuffer
from .errors import ConfigMismatchError, FieldMismatchError, InvalidConfigError
from .sampler import Sampler

# The reference's positional order for push and push_batch of transitions,
# and the argument names it uses for each field.
_PUSH_ORDER = ("obs", "actions", "rewards", "terminated", "truncated", "next_obs")
_PUSH_BATCH_ORDER = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")
_ALIASES = {
    "action": "actions",
    "reward": "rewards",
    "obs_batch": "obs",
    "next_obs_batch": "next_obs",
    "actions_batch": "actions",
}


class Buffer:
    """A replay buffer handle; see :class:`ReplayBuffer` for the methods."""

    def __init__(self, backend: Any):
        self._backend = backend

    @property
    def schema(self) -> Schema:
        return self._backend.schema

    @property
    def hot_capacity(self) -> int:
        return self._backend.hot_capacity

    @property
    def total_capacity(self) -> int:
        return self._backend.total_capacity

    def __len__(self) -> int:
        return len(self._backend)

    def is_empty(self) -> bool:
        return len(self) == 0

    def push(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append one record.

        Transition buffers: ``push(obs, action, reward, terminated, truncated,
        next_obs)``; schema buffers: ``push(**{field: value})``. ``timeout``:
        see :meth:`push_batch`.
        """
        self._backend.push(self._bind(_PUSH_ORDER, args, kwargs), timeout=timeout)

    def push_batch(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append many records at once, validated as a whole before storing.

        Transition buffers: ``push_batch(obs, next_obs, actions, rewards,
        terminated, truncated)`` with ``[n, dim]`` or flat ``[n*dim]`` arrays;
        ``terminated``/``truncated`` may be bool or float (non-zero is true).
        Schema buffers: ``push_batch(**{field: array[n, *shape]})``.
        With a rate limiter the push waits up to ``timeout`` seconds while it
        would break it (in-process None waits without limit; remote None is the
        client's call timeout), then raises RateLimitTimeoutError.
        """
        self._backend.push_batch(self._bind(_PUSH_BATCH_ORDER, args, kwargs), timeout=timeout)

    def sample(self, batch_size: int, seed: int | None = None, *,
               timeout: float | None = None) -> dict[str, np.ndarray]:
        """Draw ``batch_size`` records from hot + cold storage.

        Returns ``{field: array[batch_size, *shape]}`` (for transitions: ``obs``,
        ``next_obs``, ``actions``, ``rewards``, ``terminated``, ``truncated``).
        Uniform and deterministic for the same contents and ``seed`` in
        replay mode; the oldest (queue) or newest (stack) records, removed,
        otherwise. With a rate limiter it waits up to ``timeout`` seconds
        (see :meth:`push_batch`), then raises RateLimitTimeoutError.
        """
        return self._backend.sample(batch_size, seed, timeout=timeout)

    def flush(self) -> None:
        """Return once every record pushed before this call is stored.

        For remote buffers with client-side batching, ``push`` only queues
        records: they are acknowledged when ``flush()`` (or ``close()``)
        returns, and a failed send raises here. The in-process buffer stores
        on push, so this does nothing there.
        """
        flush = getattr(self._backend, "flush", None)
        if flush is not None:
            flush()

    def sampler(
        self,
        batch_size: int,
        prefetch: int = 2,
        seed: int | None = None,
        max_batches: int | None = None,
    ) -> Sampler:
        """An iterator of ``sample(batch_size)`` batches with ``prefetch`` requests in flight.

        With ``seed``, batch ``i`` equals ``sample(batch_size, seed + i)``.
        Endless unless ``max_batches`` is given; close it (or use ``with``)
        when done. See :class:`millpond.sampler.Sampler`.
        """
        return Sampler(self.sample, batch_size, prefetch=prefetch, seed=seed,
                       max_batches=max_batches)

    def info(self) -> dict[str, Any]:
        """Sizes, capacities and counters."""
        return self._backend.info()

    def close(self) -> None:
        """Release the buffer and delete its files; later calls raise BufferClosedError."""
        self._backend.close()

    def release(self) -> None:
        """Stop using this handle but keep the data (a persistent file, or the server's buffer)."""
        self._backend.release()

    @property
    def closed(self) -> bool:
        return self._backend.closed

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(len={len(self)}, hot_capacity={self.hot_capacity}, "
            f"total_capacity={self.total_capacity}, schema={self.schema!r}, "
            f"backend={type(self._backend).__name__})"
        )

    def _bind(self, order: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
        """Map the reference's positional/keyword arguments to field names."""
        schema = self._backend.schema
        transition = schema.is_transition
        if not transition:
            order = schema.names
        if len(args) > len(order):
            raise FieldMismatchError(f"expected at most {len(order)} positional arguments")
        bound = dict(zip(order, args))
        for key, value in kwargs.items():
            name = _ALIASES.get(key, key) if transition else key
            if name in bound:
                raise FieldMismatchError(f"field {name!r} given twice")
            bound[name] = value
        return bound


def _remote(address: str, name: str | None, **config: Any) -> Any:
    if not name:
        raise ValueError("a remote buffer needs name= as well as address=")
    from .client import connect  # the client imports this module; bind late

    return connect(address).create_buffer(name, **config)._backend


class ReplayBuffer(Buffer):
    """A uniform replay buffer of ``capacity`` records in RAM.

    ``ReplayBuffer(capacity, obs_dim, act_dim)`` stores reference transitions;
    ``ReplayBuffer(capacity, fields={name: (dtype, shape)})`` any schema. With
    ``address=`` and ``name=``, the buffer lives on a millpond server.

    How it is sampled (all buffer classes take these):

    * ``mode="replay"`` (default): uniform draws with replacement; records
      stay until evicted, or until drawn ``max_times_sampled`` times.
    * ``mode="queue"`` / ``"stack"``: ``sample(k)`` returns and removes the
      ``k`` oldest (FIFO) / newest (LIFO, newest first) records; pushes wait
      while the buffer is full, samples while it holds fewer than ``k``.
    * ``rate_limiter=millpond.MinSize(n)`` or
      ``millpond.SampleToInsertRatio(samples_per_insert, min_size_to_sample,
      error_buffer)``: pushes and samples wait (up to their ``timeout``)
      while they would break it. ``info()`` reports inserts, samples, waits,
      time waited and the current samples per insert.
    """

    def __init__(
        self,
        capacity: int,
        obs_dim: int | None = None,
        act_dim: int | None = None,
        *,
        fields: Mapping[str, Any] | None = None,
        address: str | None = None,
        name: str | None = None,
        mode: str = "replay",
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
    ):
        schema = Schema.resolve(obs_dim, act_dim, fields)
        sampling = dict(mode=mode, max_times_sampled=max_times_sampled, rate_limiter=rate_limiter)
        if address is not None:
            backend = _remote(address, name, capacity=capacity, fields=schema, **sampling)
        else:
            backend = TieredBuffer(schema, capacity, capacity, **sampling)
        super().__init__(backend)


class MmapReplayBuffer(Buffer):
    """Hot RAM tier of ``hot_capacity`` records spilling to a mapped cold file.

    Holds at most ``total_capacity`` records; the oldest are evicted first.
    ``cold_path`` names the cold file (default: a temp file); ``close()``
    deletes it. With ``address=`` and ``name=``, the buffer lives on a
    millpond server, which places the cold file in its data directory.
    """

    def __init__(
        self,
        hot_capacity: int,
        total_capacity: int,
        obs_dim: int | None = None,
        act_dim: int | None = None,
        cold_path: str | os.PathLike | None = None,
        *,
        fields: Mapping[str, Any] | None = None,
        address: str | None = None,
        name: str | None = None,
        persistent: bool = False,
        mode: str = "replay",
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
    ):
        schema = Schema.resolve(obs_dim, act_dim, fields)
        sampling = dict(mode=mode, max_times_sampled=max_times_sampled, rate_limiter=rate_limiter)
        if address is not None:  # server buffers are always persistent
            backend = _remote(
                address, name, hot_capacity=hot_capacity,
                total_capacity=total_capacity, fields=schema, **sampling,
            )
        else:
            backend = TieredBuffer(schema, hot_capacity, total_capacity, cold_path,
                                   persistent=persistent, **sampling)
        super().__init__(backend)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        hot_capacity: int | None = None,
        total_capacity: int | None = None,
        obs_dim: int | None = None,
        act_dim: int | None = None,
        *,
        fields: Mapping[str, Any] | None = None,
    ) -> "MmapReplayBuffer":
        """Reopen a persistent buffer's file (``persistent=True``, then ``release()``).

        Any configuration given must match the file's, else ConfigMismatchError
        names what differs; a damaged file raises CorruptFileError.
        """
        backend = TieredBuffer.open(path)
        expected = {"hot_capacity": hot_capacity, "total_capacity": total_capacity}
        if fields is not None or obs_dim is not None or act_dim is not None:
            expected["schema"] = Schema.resolve(obs_dim, act_dim, fields)
        actual = {"hot_capacity": backend.hot_capacity,
                  "total_capacity": backend.total_capacity, "schema": backend.schema}
        wrong = {k: (v, actual[k]) for k, v in expected.items() if v is not None and v != actual[k]}
        if wrong:
            backend.release()
            detail = "; ".join(f"{k}: expected {want}, file has {have}"
                               for k, (want, have) in wrong.items())
            raise ConfigMismatchError(f"{path} does not match: {detail}")
        buffer = cls.__new__(cls)
        Buffer.__init__(buffer, backend)
        return buffer


class PrioritizedHandle(Buffer):
    """A prioritized buffer handle: ``push(..., priority=)``, ``update_priorities``, ``set_beta``."""

    def push(self, *args: Any, priority: float | None = None, timeout: float | None = None,
             **kwargs: Any) -> None:
        """``push(obs, action, reward, terminated, truncated, next_obs, priority=None)``."""
        self._backend.push(self._bind(_PUSH_ORDER, args, kwargs), priority, timeout=timeout)

    def push_batch(self, *args: Any, priorities: Any = None, timeout: float | None = None,
                   **kwargs: Any) -> None:
        """Like :meth:`Buffer.push_batch`, with one priority per record (optional)."""
        self._backend.push_batch(self._bind(_PUSH_BATCH_ORDER, args, kwargs), priorities,
                                 timeout=timeout)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """New priorities for sampled ``indices``; returns how many were still live."""
        return self._backend.update_priorities(indices, priorities)

    def set_beta(self, beta: float) -> None:
        """Set the importance-sampling exponent (anneal it towards 1)."""
        self._backend.set_beta(beta)


class PrioritizedReplayBuffer(PrioritizedHandle):
    """Proportional prioritized replay (sum tree), over RAM or hot + cold tiers.

    ``PrioritizedReplayBuffer(capacity, obs_dim, act_dim, alpha, beta)`` keeps
    everything in RAM; with ``hot_capacity=``, ``total_capacity=`` and
    ``cold_path=`` older records spill to the cold file and keep their
    priorities. ``push(..., priority=p)`` (default: the largest priority seen
    so far); ``sample`` adds ``weights`` and ``indices``;
    ``update_priorities(indices, priorities)`` ignores records evicted since
    they were sampled; ``set_beta(b)`` anneals the importance weights.
    ``max_times_sampled`` and ``rate_limiter`` work as for :class:`ReplayBuffer`. With
    ``address=`` and ``name=`` the buffer lives on a millpond server.
    """

    def __init__(
        self,
        capacity: int | None = None,
        obs_dim: int | None = None,
        act_dim: int | None = None,
        alpha: float = 0.6,
        beta: float = 0.4,
        *,
        hot_capacity: int | None = None,
        total_capacity: int | None = None,
        cold_path: str | os.PathLike | None = None,
        fields: Mapping[str, Any] | None = None,
        address: str | None = None,
        name: str | None = None,
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
    ):
        schema = Schema.resolve(obs_dim, act_dim, fields)
        sampling = dict(max_times_sampled=max_times_sampled, rate_limiter=rate_limiter)
        if capacity is not None:
            if hot_capacity is not None or total_capacity is not None:
                raise InvalidConfigError("give capacity= or hot_capacity=/total_capacity=, not both")
            hot_capacity = total_capacity = capacity
        if address is not None:
            backend = _remote(address, name, hot_capacity=hot_capacity,
                              total_capacity=total_capacity, fields=schema,
                              prioritized=True, alpha=alpha, beta=beta, **sampling)
        else:
            backend = PrioritizedTieredBuffer(schema, hot_capacity, total_capacity, cold_path,
                                              alpha=alpha, beta=beta, **sampling)
        super().__init__(backend)
