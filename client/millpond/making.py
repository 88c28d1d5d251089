"""``create_buffer``: one signature for every client (one server, or shards).

A client provides ``remote_buffer(name, config)``, the backend of a buffer
created with (or attached to) ``config``; :class:`BufferMaker` turns the
user-facing arguments into that config and wraps the backend in its handle.
"""

from __future__ import annotations

from typing import Any, Mapping

from millpond.core.config import BufferConfig
from millpond.core.ratelimit import RateLimiter
from millpond.core.schema import Schema
from millpond.handle.buffer import Buffer, handle_for


class BufferMaker:
    """The ``create_buffer`` of :class:`millpond.Client` and the sharded client."""

    def remote_buffer(self, name: str, config: BufferConfig) -> Any:
        raise NotImplementedError

    def create_buffer(
        self,
        name: str,
        capacity: int | None = None,
        obs_dim: int | None = None,
        act_dim: int | None = None,
        *,
        hot_capacity: int | None = None,
        total_capacity: int | None = None,
        fields: Mapping[str, Any] | Schema | None = None,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        mode: str = "replay",
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
        episodes: bool = False,
        meta_fields: Mapping[str, Any] | None = None,
    ) -> Buffer:
        """Create the buffer ``name``, or attach to it if it exists with this config.

        Arguments are those of the in-process classes (see
        :meth:`millpond.BufferConfig.build`): ``capacity`` (RAM only, like
        ``ReplayBuffer``) or ``hot_capacity`` + ``total_capacity`` (like
        ``MmapReplayBuffer``), and ``obs_dim``/``act_dim`` or ``fields``.
        ``prioritized=True`` makes a proportional prioritized buffer with
        ``alpha`` and ``beta`` (see :class:`millpond.PrioritizedReplayBuffer`).
        ``mode``, ``max_times_sampled``, ``rate_limiter``, ``episodes`` and
        ``meta_fields``: see :class:`millpond.ReplayBuffer`. An existing buffer with another config
        raises ConfigMismatchError.

        The handle's ``close()`` deletes the buffer if this call created it;
        if it attached, ``close()`` only releases the handle. A sharded
        client splits the capacities over its shards (see
        :meth:`millpond.sharded.client.ShardedClient.remote_buffer`).
        """
        config = BufferConfig.build(
            capacity=capacity, hot_capacity=hot_capacity, total_capacity=total_capacity,
            obs_dim=obs_dim, act_dim=act_dim, fields=fields, mode=mode,
            max_times_sampled=max_times_sampled, rate_limiter=rate_limiter,
            prioritized=prioritized, alpha=alpha, beta=beta, episodes=episodes,
            meta_fields=meta_fields)
        return handle_for(self.remote_buffer(name, config))
