"""The buffer handle users hold: the reference API, whatever backs it.

A :class:`Buffer` binds the reference's call signatures (positional
transition arguments, ``action``/``reward`` aliases) to field names and
delegates to its backend: the engine's :class:`~millpond.core.TieredBuffer`
in-process, or a :class:`~millpond.remote.buffer.RemoteBuffer` on a server. Both
have the same methods, results and exceptions.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from millpond.core.config import BufferConfig, ConfigAccessors
from millpond.core.info import BufferInfo
from millpond.handle.devices import check_device, to_device
from millpond.handle.episodes import EpisodeMethods
from millpond.errors import FieldMismatchError
from millpond.handle.learner import LearnerMethods
from millpond.handle.sampler import Sampler

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


class Buffer(LearnerMethods, EpisodeMethods, ConfigAccessors):
    """A replay buffer handle; see :class:`millpond.ReplayBuffer` for the methods.

    What backs it, read-only: :attr:`backend` (the object calls go to), :attr:`client`
    (the server connection, None in-process) and :attr:`transport` (how the data moves).
    """

    def __init__(self, backend: Any):
        self._backend = backend
        self.config: BufferConfig = backend.config  # fixed at creation

    @property
    def backend(self) -> Any:
        """The object this handle delegates to: in-process the engine's
        :class:`~millpond.core.TieredBuffer` (a read-only dataset for an in-process
        :class:`~millpond.OfflineDatasetBuffer`); on a server a
        :class:`~millpond.remote.buffer.RemoteBuffer`; across shards a
        :class:`~millpond.sharded.buffer.ShardedBuffer`. Same methods, results and errors."""
        return self._backend

    @property
    def client(self) -> Any:
        """The client this handle reaches its server through (a :class:`millpond.Client`,
        or for shards a :class:`millpond.sharded.client.ShardedClient`); None in-process."""
        return getattr(self._backend, "_client", None)  # remote and sharded backends keep it

    @property
    def transport(self) -> str:
        """How this handle's data moves: "in-process"; for a server "shm" while the
        same-host shared-memory fast path is in use, else "grpc" (the client's
        ``transport``); across shards that of every shard, or "mixed"."""
        client = self.client
        return "in-process" if client is None else client.transport

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_episode_local", None)  # per-thread episodes stay with this process
        return state

    def __len__(self) -> int:
        return len(self._backend)

    def is_empty(self) -> bool:
        return len(self) == 0

    def push(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append one record.

        Transition buffers: ``push(obs, action, reward, terminated, truncated,
        next_obs)``; schema buffers: ``push(**{field: value})``. ``timeout``:
        see :meth:`push_batch`. On an episodic buffer the record continues
        this thread's current episode, and ends it if its ``terminated`` or
        ``truncated`` is true.
        """
        self._push_one(self._bind(_PUSH_ORDER, args, kwargs), None, timeout)

    def push_batch(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append many records at once, validated as a whole before storing.

        Transition buffers: ``push_batch(obs, next_obs, actions, rewards,
        terminated, truncated)`` with ``[n, dim]`` or flat ``[n*dim]`` arrays;
        ``terminated``/``truncated`` may be bool or float (non-zero is true).
        Schema buffers: ``push_batch(**{field: array[n, *shape]})``.
        With a rate limiter the push waits up to ``timeout`` seconds while it
        would break it (in-process None waits without limit; remote None is the
        client's call timeout), then raises RateLimitTimeoutError. On an
        episodic buffer the records continue this thread's episodes, like
        pushes one by one.
        """
        self._push_many(self._bind(_PUSH_BATCH_ORDER, args, kwargs), None, timeout)

    def sample(self, batch_size: int, seed: int | None = None, *, timeout: float | None = None,
               n_step: int | None = None, gamma: float = 0.99,
               filter_meta: Mapping[str, Any] | None = None,
               device: Any = None) -> dict[str, Any]:
        """Draw ``batch_size`` records from hot + cold storage.

        Returns ``{field: array[batch_size, *shape]}`` (for transitions: ``obs``,
        ``next_obs``, ``actions``, ``rewards``, ``terminated``, ``truncated``).
        Uniform and deterministic for the same contents and ``seed`` in
        replay mode; the oldest (queue) or newest (stack) records, removed,
        otherwise. With a rate limiter it waits up to ``timeout`` seconds
        (see :meth:`push_batch`), then raises RateLimitTimeoutError.

        Episodic buffers: ``filter_meta={name: value}`` draws only records of
        episodes with those meta values. ``n_step=N`` (transition schema)
        returns n-step transitions: ``obs``/``actions`` of step t,
        ``rewards`` = sum of ``gamma**k * r[t+k]`` for k < ``n_step_lens`` =
        min(N, steps stored from t on), and ``next_obs``/``terminated``/
        ``truncated`` of step t + n_step_lens - 1.

        ``device`` (a torch device, e.g. ``"cpu"``, ``"cuda"``): torch tensors on
        it instead of numpy arrays (see :mod:`millpond.handle.devices`).
        """
        if device is not None:  # checked before the draw (a queue's sample removes)
            check_device(device)
            return to_device(self.sample(batch_size, seed, timeout=timeout, n_step=n_step,
                                         gamma=gamma, filter_meta=filter_meta), device)
        if n_step is not None:
            return self._backend.sample_n_step(batch_size, n_step, gamma, seed,
                                               filter_meta=filter_meta, timeout=timeout)
        if filter_meta:
            return self._backend.sample(batch_size, seed, timeout=timeout,
                                        filter_meta=filter_meta)
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
        device: Any = None,
        *,
        n_step: int | None = None,
        gamma: float = 0.99,
        filter_meta: Mapping[str, Any] | None = None,
    ) -> Sampler:
        """An iterator of ``sample(batch_size)`` batches with ``prefetch`` requests in flight.

        With ``seed``, batch ``i`` equals ``sample(batch_size, seed + i)``.
        Endless unless ``max_batches`` is given; close it (or use ``with``)
        when done. See :class:`millpond.handle.sampler.Sampler`. ``device``,
        ``n_step``, ``gamma``, ``filter_meta``: as for :meth:`sample` (the
        prefetching threads make the tensors).
        """
        check_device(device)
        given = {"device": device, "n_step": n_step, "filter_meta": filter_meta}
        options: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
        if n_step is not None:
            options["gamma"] = gamma
        sample = functools.partial(self.sample, **options) if options else self.sample
        return Sampler(sample, batch_size, prefetch=prefetch, seed=seed, max_batches=max_batches)

    def info(self) -> BufferInfo:
        """Sizes, capacities and counters: a read-only mapping (see :class:`millpond.BufferInfo`)."""
        return self._backend.info()

    def close(self) -> None:
        """Stop using this handle; later calls raise BufferClosedError. Idempotent.

        In-process, and on a server when this handle created the buffer, the
        buffer and its file are deleted (as the reference does). A handle
        that attached to an existing server buffer (``client.buffer(name)``,
        or a create that found it) leaves it to the others sharing it.
        """
        self._backend.close()

    def delete(self) -> None:
        """Delete the buffer and its file, whoever created it. Idempotent."""
        self._backend.delete()

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
        schema = self.schema
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


class PrioritizedBuffer(Buffer):
    """A prioritized buffer handle: ``push(..., priority=)``, ``update_priorities``, ``set_beta``."""

    def push(self, *args: Any, priority: float | None = None, timeout: float | None = None,
             **kwargs: Any) -> None:
        """``push(obs, action, reward, terminated, truncated, next_obs, priority=None)``."""
        self._push_one(self._bind(_PUSH_ORDER, args, kwargs), priority, timeout)

    def push_batch(self, *args: Any, priorities: Any = None, timeout: float | None = None,
                   **kwargs: Any) -> None:
        """Like :meth:`Buffer.push_batch`, with one priority per record (optional)."""
        self._push_many(self._bind(_PUSH_BATCH_ORDER, args, kwargs), priorities, timeout)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """New priorities for sampled ``indices``; returns how many were still live."""
        return self._backend.update_priorities(indices, priorities)

    def set_beta(self, beta: float) -> None:
        """Set the importance-sampling exponent (anneal it towards 1)."""
        self._backend.set_beta(beta)


def handle_for(backend: Any) -> Buffer:
    """The handle class for ``backend``'s config: prioritized or not."""
    if backend.config.prioritized is not None:
        return PrioritizedBuffer(backend)
    return Buffer(backend)
