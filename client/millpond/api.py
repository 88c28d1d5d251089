"""The buffer classes users construct: the reference API, local or remote.

``ReplayBuffer`` and ``MmapReplayBuffer`` take the reference constructor
arguments (``PrioritizedReplayBuffer`` adds ``alpha`` and ``beta``). Without
``address`` they run the engine in-process; with ``address="host:port"`` and
``name=...`` the same object talks to a millpond server (a list of addresses,
or ``"dns:///NAME:PORT"``: one buffer over several servers, see
:mod:`millpond.sharded.client`). Either way the
methods, results and exceptions are the same (see :mod:`millpond.handle.buffer`).

This module only turns constructor arguments into a
:class:`~millpond.core.BufferConfig` and picks the backend.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from millpond.client import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_PUSH_BATCH_SIZE,
    DEFAULT_PUSH_MAX_DELAY,
    DEFAULT_TIMEOUT,
    Client,
    check_create,
)
from millpond.core import BufferConfig, Schema, TieredBuffer
from millpond.core.ratelimit import RateLimiter
from millpond.errors import ConfigMismatchError, InvalidConfigError
from millpond.handle.backend import Backend
from millpond.handle.buffer import Buffer, PrioritizedBuffer
from millpond.sharded.client import ShardedClient


def connect(
    address: str | Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
    shm: bool | str = "auto",
    push_batch_size: int = DEFAULT_PUSH_BATCH_SIZE,
    push_max_delay: float | None = DEFAULT_PUSH_MAX_DELAY,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    token: str | None = None,
    tls: bool | None = None,
    tls_ca: str | os.PathLike | None = None,
    tls_cert: str | os.PathLike | None = None,
    tls_key: str | os.PathLike | None = None,
    wait_for_server: bool = True,
) -> "Client | ShardedClient":
    """A client for the server at ``address`` ("host:port"). Connects lazily.

    A list of addresses, or ``"dns:///NAME:PORT"`` (every address NAME
    resolves to, e.g. a Kubernetes headless Service), gives a
    :class:`~millpond.sharded.client.ShardedClient`: the servers act as one buffer
    (see :mod:`millpond.sharded.client`), each with these settings.

    ``timeout``: the deadline of every call, in seconds. A push or sample
    may also wait for the buffer's rate limiter: up to its own ``timeout=``
    argument (default: this one), with this deadline on top.

    ``shm``: "auto" (default) moves bulk data through shared memory when the
    server is on this host and admits this user, else silently over gRPC;
    True requires the fast path (raises if it cannot be had); False never
    uses it. ``client.transport`` says which one is in use.

    ``push_batch_size`` / ``push_max_delay``: single-record ``push`` calls are
    sent in batches of this many records, or once the oldest waited this many
    seconds (None: only by count and ``flush()``); 1 sends every push at once.
    Queued records are acknowledged only when flushed.

    ``max_in_flight``: pushes (``push_batch`` calls, and batches of queued
    ``push`` calls) each handle may have sent and not yet had acknowledged.
    1 (default): a push returns once the server has stored it. N > 1 over gRPC
    (Reverb's ``max_in_flight_items``): a push returns once sent, the server
    stores a handle's pushes in the order sent, and an actor keeps the server
    busy instead of waiting a round trip per push. ``flush()`` waits for every
    acknowledgement; a failed push is raised by the handle's next call (every
    other call flushes first, so it sees the handle's pushes) or ``flush()``.
    Over shared memory, and for sharded buffers, pushes are acknowledged one
    by one whatever this says.

    ``token``: sent with every call (``authorization: Bearer TOKEN``) to a
    server that requires one; default ``MILLPOND_TOKEN``. ``tls=True``
    speaks TLS, verifying the server with the system's roots or the PEM file
    ``tls_ca``; ``tls_cert`` and ``tls_key`` add a client certificate. Their
    defaults are ``MILLPOND_TLS_CA``, ``MILLPOND_TLS_CERT`` and
    ``MILLPOND_TLS_KEY``, any of which turns TLS on (see
    :mod:`millpond.remote.security`). A missing or wrong token raises
    AuthenticationError; a token whose role may not do a call,
    PermissionDeniedError.

    ``wait_for_server``: True (default) lets a call wait, within its deadline,
    for a server that is not reachable yet (a daemon still starting, or
    restarting); within about a second of not reaching it the client logs one
    WARNING (logger ``millpond.client``) naming the address and what the channel
    sees (connection refused, a name that does not resolve, a failed TLS
    handshake), once per episode of unreachability. False fails fast: a call
    that cannot reach the server within about 2 s raises
    ServerUnavailableError naming the address and the cause (a server that is
    reached but still recovering its buffers is waited for either way).
    """
    settings: dict[str, Any] = dict(
        timeout=timeout, max_message_mb=max_message_mb, shm=shm, push_batch_size=push_batch_size,
        push_max_delay=push_max_delay, max_in_flight=max_in_flight, token=token, tls=tls,
        tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, wait_for_server=wait_for_server)
    if not isinstance(address, str) or address.startswith("dns:///"):
        return ShardedClient(address, **settings)
    return Client(address, **settings)



def _backend(config: BufferConfig, address: str | Sequence[str] | None, name: str | None,
             path: str | os.PathLike | None = None, persistent: bool = False,
             token: str | None = None, max_in_flight: int = 1, create: bool | None = None,
             wait_for_server: bool = True) -> Backend:
    """The engine in-process, or the server's buffer ``name`` at ``address``
    (server buffers are always persistent, in the server's data directory).
    ``token`` (default ``MILLPOND_TOKEN``), ``max_in_flight``, ``wait_for_server`` and
    the ``MILLPOND_TLS_*`` variables are those of :func:`millpond.connect` (in-process,
    every push is stored before it returns, whatever ``max_in_flight`` says);
    ``create``: see :class:`ReplayBuffer` (in-process, the buffer is always new)."""
    check_create(create)
    if address is None:
        if token is not None:
            raise InvalidConfigError("token= is for a server's buffer (with address=)")
        return TieredBuffer(config, path, persistent=persistent)
    if not name:
        raise InvalidConfigError("a remote buffer needs name= as well as address=")
    client = connect(address, token=token, max_in_flight=max_in_flight,
                     wait_for_server=wait_for_server)
    return client.remote_buffer(name, config, create=create)


class ReplayBuffer(Buffer):
    """A uniform replay buffer of ``capacity`` records in RAM.

    ``ReplayBuffer(capacity, obs_dim, act_dim)`` stores reference transitions;
    ``ReplayBuffer(capacity, fields={name: (dtype, shape)})`` any schema. With
    ``address=`` and ``name=``, the buffer lives on a millpond server;
    ``token=`` (default ``MILLPOND_TOKEN``) authenticates to it, TLS comes
    from ``MILLPOND_TLS_*``, and ``max_in_flight=N`` lets N pushes be sent
    before the first is acknowledged (see :func:`millpond.connect`).

    On a server, creating and attaching (all buffer classes take these):

    * ``create=None`` (default): attach to the buffer ``name`` if it exists
      (ConfigMismatchError if its config differs); else the handle creates it
      on its first write (``push``, ``push_batch``, episode writes). A read
      first (``sample``, ``len``, ``info``, ...) attaches if the buffer exists
      by then, else raises BufferNotFoundError naming the server's buffers of
      close names: a learner's mistyped ``name`` fails at its first sample
      instead of creating an empty buffer it would wait on forever.
    * ``create=True``: create it now (or attach to an equal one): for a
      learner that starts before its actors.
    * ``create=False``: attach only; BufferNotFoundError now if it is missing.

    The handle that created the buffer deletes it on ``close()`` (see
    :meth:`millpond.Client.create_buffer`). ``wait_for_server=False`` fails fast
    (ServerUnavailableError) when the server cannot be reached, instead of
    waiting for it within each call's deadline (see :func:`millpond.connect`).

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
    * ``episodes=True`` (with optional ``meta_fields={name: (dtype, shape)}``,
      values per episode): records belong to episodes (pushes continue the
      thread's current episode; ``terminated``/``truncated`` end it;
      ``one_episode``, ``store``, ``end_episode``, ``episode_writer``), and
      ``sample_sequences``, ``sample_episodes``, ``sample(n_step=)``,
      ``filter_meta=`` and ``dataloader`` read them.
    * ``frame_stack={"obs": 0}`` (the field is a stack of frames along that
      axis) and ``next_of={"next_obs": "obs"}`` (the field is usually the next
      record's ``obs``): each distinct frame is stored once, checked equal at
      push time; reads return exactly what was pushed. ``frame_capacity``:
      frames kept per source field (see :mod:`millpond.core.frames`; a push
      that does not fit raises StorageFullError).
    * ``compression="zstd"`` or ``"lz4"`` (or per field, with a level:
      ``{"obs": ("zstd", 5)}``): fields of at least 1 KiB per value (per frame,
      with ``frame_stack``/``next_of``) are stored compressed, in RAM and in
      the file; ``compressed_bytes`` bounds each compressed field's ring (see
      :mod:`millpond.core.codecs` and :mod:`millpond.core.arena`).
    """

    def __init__(
        self,
        capacity: int,
        obs_dim: int | None = None,
        act_dim: int | None = None,
        *,
        fields: Mapping[str, Any] | None = None,
        address: str | Sequence[str] | None = None,
        name: str | None = None,
        mode: str = "replay",
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
        token: str | None = None,
        max_in_flight: int = 1,
        episodes: bool = False,
        meta_fields: Mapping[str, Any] | None = None,
        frame_stack: Mapping[str, int] | None = None,
        next_of: Mapping[str, str] | None = None,
        frame_capacity: int | None = None,
        compression: str | Mapping[str, Any] | None = None,
        compressed_bytes: int | None = None,
        create: bool | None = None,
        wait_for_server: bool = True,
    ):
        config = BufferConfig.build(
            capacity=capacity, obs_dim=obs_dim, act_dim=act_dim, fields=fields, mode=mode,
            max_times_sampled=max_times_sampled, rate_limiter=rate_limiter, episodes=episodes,
            meta_fields=meta_fields,
            frame_stack=frame_stack, next_of=next_of, frame_capacity=frame_capacity,
            compression=compression, compressed_bytes=compressed_bytes)
        super().__init__(_backend(config, address, name, token=token,
                                  max_in_flight=max_in_flight, create=create,
                                  wait_for_server=wait_for_server))


class MmapReplayBuffer(Buffer):
    """Hot RAM tier of ``hot_capacity`` records spilling to a mapped cold file.

    Holds at most ``total_capacity`` records; the oldest are evicted first.
    ``cold_path`` names the buffer's file (default: a temp file), which holds
    the cold tier (and the hot one too if ``persistent``); ``close()``
    deletes it. With ``address=`` and ``name=``, the buffer lives on a
    millpond server, which places its file in its data directory (``create=`` and
    ``wait_for_server=``: see :class:`ReplayBuffer`).
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
        address: str | Sequence[str] | None = None,
        name: str | None = None,
        persistent: bool = False,
        mode: str = "replay",
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
        token: str | None = None,
        max_in_flight: int = 1,
        episodes: bool = False,
        meta_fields: Mapping[str, Any] | None = None,
        frame_stack: Mapping[str, int] | None = None,
        next_of: Mapping[str, str] | None = None,
        frame_capacity: int | None = None,
        compression: str | Mapping[str, Any] | None = None,
        compressed_bytes: int | None = None,
        create: bool | None = None,
        wait_for_server: bool = True,
    ):
        config = BufferConfig.build(
            hot_capacity=hot_capacity, total_capacity=total_capacity, obs_dim=obs_dim,
            act_dim=act_dim, fields=fields, mode=mode, max_times_sampled=max_times_sampled,
            rate_limiter=rate_limiter, episodes=episodes, meta_fields=meta_fields,
            frame_stack=frame_stack, next_of=next_of, frame_capacity=frame_capacity,
            compression=compression, compressed_bytes=compressed_bytes)
        super().__init__(_backend(config, address, name, cold_path, persistent, token,
                                  max_in_flight, create, wait_for_server))

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
        actual = backend.config
        expected: dict[str, Any] = {"hot_capacity": hot_capacity,
                                    "total_capacity": total_capacity}
        if fields is not None or obs_dim is not None or act_dim is not None:
            expected["schema"] = Schema.resolve(obs_dim, act_dim, fields)
        wrong = {key: (want, getattr(actual, key)) for key, want in expected.items()
                 if want is not None and want != getattr(actual, key)}
        if wrong:
            backend.release()
            detail = "; ".join(f"{key}: expected {want}, file has {have}"
                               for key, (want, have) in wrong.items())
            raise ConfigMismatchError(f"{path} does not match: {detail}")
        buffer = cls.__new__(cls)
        Buffer.__init__(buffer, backend)
        return buffer


class PrioritizedReplayBuffer(PrioritizedBuffer):
    """Proportional prioritized replay (sum tree), over RAM or hot + cold tiers.

    ``PrioritizedReplayBuffer(capacity, obs_dim, act_dim, alpha, beta)`` keeps
    everything in RAM; with ``hot_capacity=``, ``total_capacity=`` and
    ``cold_path=`` older records spill to the cold file and keep their
    priorities. ``push(..., priority=p)`` (default: the largest priority seen
    so far); ``sample`` adds ``weights`` and ``indices``;
    ``update_priorities(indices, priorities)`` ignores records evicted since
    they were sampled; ``set_beta(b)`` anneals the importance weights.
    ``max_times_sampled`` and ``rate_limiter`` work as for :class:`ReplayBuffer`. With
    ``address=`` and ``name=`` the buffer lives on a millpond server (``create=`` and
    ``wait_for_server=``: see :class:`ReplayBuffer`).
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
        address: str | Sequence[str] | None = None,
        name: str | None = None,
        max_times_sampled: int | None = None,
        rate_limiter: RateLimiter | None = None,
        token: str | None = None,
        max_in_flight: int = 1,
        episodes: bool = False,
        meta_fields: Mapping[str, Any] | None = None,
        frame_stack: Mapping[str, int] | None = None,
        next_of: Mapping[str, str] | None = None,
        frame_capacity: int | None = None,
        compression: str | Mapping[str, Any] | None = None,
        compressed_bytes: int | None = None,
        create: bool | None = None,
        wait_for_server: bool = True,
    ):
        config = BufferConfig.build(
            capacity=capacity, hot_capacity=hot_capacity, total_capacity=total_capacity,
            obs_dim=obs_dim, act_dim=act_dim, fields=fields, prioritized=True, alpha=alpha,
            beta=beta, max_times_sampled=max_times_sampled, rate_limiter=rate_limiter,
            episodes=episodes, meta_fields=meta_fields,
            frame_stack=frame_stack, next_of=next_of, frame_capacity=frame_capacity,
            compression=compression, compressed_bytes=compressed_bytes)
        super().__init__(_backend(config, address, name, cold_path, token=token,
                                  max_in_flight=max_in_flight, create=create,
                                  wait_for_server=wait_for_server))
