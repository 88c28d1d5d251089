"""Connecting to a millpond server.

    client = millpond.connect("localhost:50051")
    buf = client.create_buffer("cartpole", capacity=100_000, obs_dim=4, act_dim=1)
    buf.push_batch(obs, next_obs, actions, rewards, terminated, truncated)
    batch = buf.sample(256)

Every call carries a deadline (``timeout`` seconds). Keepalive pings every
few seconds notice a dead server or a dead network path within
``keepalive_time + keepalive_timeout`` instead of the TCP default of minutes.

A :class:`Client` (and every buffer handle it returns) pickles as its address
and settings, and opens its gRPC channel lazily per process: handles made
before ``fork`` or passed to ``spawn``-ed actors work in the child.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping

import grpc

from .api import Buffer, PrioritizedHandle
from .core.buffer import check_capacities, check_sampling
from .core.ratelimit import RateLimiter
from .core.schema import Schema
from .errors import InvalidConfigError, SharedMemoryError
from .malloc import tune_malloc_for_large_messages
from .shm.protocol import read_boot_id
from .shm.session import ShmSession
from .wire.status import error_from_rpc
from .remote import RemoteBuffer, info_to_dict, translate_rpc_errors
from .v1 import replay_pb2 as pb
from .v1 import replay_pb2_grpc as pb_grpc
from .wire.codec import decode_config, decode_prioritized, encode_config

DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_MESSAGE_MB = 512
DEFAULT_PUSH_BATCH_SIZE = 256
DEFAULT_PUSH_MAX_DELAY = 0.05
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def connect(
    address: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
    shm: bool | str = "auto",
    push_batch_size: int = DEFAULT_PUSH_BATCH_SIZE,
    push_max_delay: float | None = DEFAULT_PUSH_MAX_DELAY,
) -> "Client":
    """A client for the server at ``address`` ("host:port"). Connects lazily.

    ``shm``: "auto" (default) moves bulk data through shared memory when the
    server is on this host and admits this user, else silently over gRPC;
    True requires the fast path (raises if it cannot be had); False never
    uses it. ``client.transport`` says which one is in use.

    ``push_batch_size`` / ``push_max_delay``: single-record ``push`` calls are
    sent in batches of this many records, or once the oldest waited this many
    seconds (None: only by count and ``flush()``); 1 sends every push at once.
    Queued records are acknowledged only when flushed.
    """
    return Client(address, timeout=timeout, max_message_mb=max_message_mb, shm=shm,
                  push_batch_size=push_batch_size, push_max_delay=push_max_delay)


class Client:
    """A connection to one millpond server."""

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, shm: bool | str = "auto",
                 push_batch_size: int = DEFAULT_PUSH_BATCH_SIZE,
                 push_max_delay: float | None = DEFAULT_PUSH_MAX_DELAY):
        if not isinstance(address, str) or not address:
            raise InvalidConfigError(f"address must be 'host:port', got {address!r}")
        if shm not in (True, False, "auto"):
            raise InvalidConfigError(f"shm must be True, False or 'auto', got {shm!r}")
        if not isinstance(push_batch_size, int) or push_batch_size < 1:
            raise InvalidConfigError(f"push_batch_size must be >= 1, got {push_batch_size!r}")
        self.shm = shm
        self.push_batch_size = push_batch_size
        self.push_max_delay = push_max_delay
        if not timeout > 0:
            raise InvalidConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.address = address
        self.timeout = float(timeout)
        self.max_message_bytes = int(max_message_mb) * 1024 * 1024
        self._lock = threading.Lock()
        self._connection: Connection | None = None
        self._pid = -1

    def __reduce__(self):
        settings = dict(timeout=self.timeout, max_message_mb=self.max_message_bytes >> 20,
                        shm=self.shm, push_batch_size=self.push_batch_size,
                        push_max_delay=self.push_max_delay)
        return (_rebuild_client, (self.address, settings))

    @property
    def stub(self) -> pb_grpc.ReplayStub:
        """The generated stub (for the small control calls)."""
        return self.connection.stub

    @property
    def connection(self) -> "Connection":
        """This process's gRPC connection, (re)created in each process that uses it."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    # A channel inherited through fork belongs to the parent's
                    # gRPC threads; never touch it here, just open our own.
                    self._connection = Connection(self.address, self._options(),
                                                  self.shm, self.timeout)
                    self._pid = os.getpid()
        return self._connection

    @property
    def transport(self) -> str:
        """"shm" when bulk data moves through shared memory, else "grpc"."""
        return self.connection.transport

    def _options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    # ---- buffers --------------------------------------------------------------

    @translate_rpc_errors
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
    ) -> Buffer:
        """Create the buffer ``name``, or attach to it if it exists with this config.

        Arguments are those of the in-process classes: ``capacity`` (RAM only,
        like ``ReplayBuffer``) or ``hot_capacity`` + ``total_capacity`` (like
        ``MmapReplayBuffer``), and ``obs_dim``/``act_dim`` or ``fields``.
        ``prioritized=True`` makes a proportional prioritized buffer with
        ``alpha`` and ``beta`` (see :class:`millpond.PrioritizedReplayBuffer`).
        ``mode``, ``max_times_sampled`` and ``rate_limiter``: see
        :class:`millpond.ReplayBuffer`. An existing buffer with another config
        raises ConfigMismatchError.
        """
        schema = Schema.resolve(obs_dim, act_dim, fields)
        hot, total = check_capacities(*_capacities(capacity, hot_capacity, total_capacity))
        sampling = check_sampling(mode, max_times_sampled, rate_limiter, total)
        config = encode_config(schema, hot, total, (alpha, beta) if prioritized else None,
                               sampling)
        request = pb.CreateRequest(name=name, config=config)
        reply = self.stub.Create(request, timeout=self.timeout)
        return self._handle(reply)

    @translate_rpc_errors
    def buffer(self, name: str) -> Buffer:
        """Attach to the existing buffer ``name`` (BufferNotFoundError if none)."""
        return self._handle(self.stub.Info(pb.InfoRequest(name=name), timeout=self.timeout))

    @translate_rpc_errors
    def list_buffers(self) -> list[dict[str, Any]]:
        """Info of every buffer on the server."""
        reply = self.stub.List(pb.ListRequest(), timeout=self.timeout)
        return [info_to_dict(info) for info in reply.buffers]

    def close(self) -> None:
        """Close the channel (buffers stay on the server). Idempotent."""
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                self._connection.close()
            self._connection = None
            self._pid = -1

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r}, timeout={self.timeout})"

    def _handle(self, info: pb.BufferInfo) -> Buffer:
        schema, hot, total = decode_config(info.config)
        remote = RemoteBuffer(self, info.name, schema, hot, total,
                              prioritized=decode_prioritized(info.config) is not None)
        return PrioritizedHandle(remote) if remote.prioritized else Buffer(remote)


class Connection:
    """One process's channel, its call objects and, when negotiated, its fast path.

    The bulk calls bypass the generated message classes: PushBatch requests
    and Sample replies travel as bytes framed by :mod:`millpond.wire.frames`,
    which copies column data once instead of three times.
    """

    def __init__(self, address: str, options: list[tuple[str, Any]], shm: bool | str,
                 timeout: float):
        tune_malloc_for_large_messages()
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.ReplayStub(self.channel)
        self.push_batch = self.channel.unary_unary(
            "/millpond.v1.Replay/PushBatch",
            request_serializer=None,  # already bytes
            response_deserializer=pb.PushReply.FromString,
        )
        self.sample = self.channel.unary_unary(
            "/millpond.v1.Replay/Sample",
            request_serializer=pb.SampleRequest.SerializeToString,
            response_deserializer=None,  # parsed by frames.decode_batch_field
        )
        self._timeout = timeout
        self._lock = threading.Lock()
        self.session: ShmSession | None = None
        self.shm_reason = "disabled by the client (shm=False)"
        if shm is not False:
            self.session, self.shm_reason = self._negotiate(timeout)
            if shm is True and self.session is None:
                self.channel.close()
                raise SharedMemoryError(f"shared memory was required but {self.shm_reason}")

    @property
    def transport(self) -> str:
        return "shm" if self.session is not None else "grpc"

    def fast_path(self) -> ShmSession | None:
        """The usable fast-path session, if any.

        A session broken by a timeout or a lost connection is replaced by a
        freshly negotiated one (or by gRPC, if that fails) on the next call.
        """
        session = self.session
        if session is None or not session.broken:
            return session
        with self._lock:
            if self.session is session:
                session.close()
                self.session, self.shm_reason = self._negotiate(self._timeout)
        return self.session

    def _negotiate(self, timeout: float) -> tuple[ShmSession | None, str]:
        """Open the fast path if the server offers it and it is reachable from here."""
        boot_id = read_boot_id()
        try:
            offer = self.stub.Negotiate(pb.NegotiateRequest(boot_id=boot_id), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None, "the server has no fast path"
            raise error_from_rpc(exc) from None
        if not offer.shm:
            return None, offer.reason or "the server does not offer it"
        if not boot_id or offer.boot_id != boot_id:
            return None, "the server runs on another host"
        try:
            return ShmSession(offer.socket, offer.uid, timeout), ""
        except OSError as exc:  # other network namespace, refused peer, no memfd...
            return None, f"its socket is not reachable from here ({exc})"

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        self.channel.close()


def _capacities(capacity: Any, hot_capacity: Any, total_capacity: Any) -> tuple[Any, Any]:
    if capacity is not None:
        if hot_capacity is not None or total_capacity is not None:
            raise InvalidConfigError("give capacity= or hot_capacity=/total_capacity=, not both")
        return capacity, capacity
    if hot_capacity is None or total_capacity is None:
        raise InvalidConfigError("give capacity=, or both hot_capacity= and total_capacity=")
    return hot_capacity, total_capacity


def _rebuild_client(address: str, settings: dict[str, Any]) -> Client:
    return Client(address, **settings)
