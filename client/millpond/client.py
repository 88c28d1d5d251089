"""Connecting to a millpond server.

    client = millpond.connect("localhost:50051")
    buf = client.create_buffer("cartpole", capacity=100_000, obs_dim=4, act_dim=1)
    buf.push_batch(obs, next_obs, actions, rewards, terminated, truncated)
    batch = buf.sample(256)

Every call carries a deadline (``timeout`` seconds) and waits, within it, for
a server that is not up yet or still recovering its buffers. Keepalive pings
every few seconds notice a dead server or a dead network path within
``keepalive_time + keepalive_timeout`` instead of the TCP default of minutes.

A :class:`Client` (and every buffer handle it returns) pickles as its address
and settings, and opens its connection lazily per process: handles made
before ``fork`` or passed to ``spawn``-ed actors work in the child. The
settings include the token the client authenticates with (passed or read
from ``MILLPOND_TOKEN``) and the paths of its TLS files (read again in the
child), so a child acts as its parent did whatever its own environment says;
keep pickled clients out of places other users can read.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from millpond.core.checks import is_real
from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.errors import InvalidConfigError
from millpond.handle.buffer import Buffer, handle_for
from millpond.making import BufferMaker
from millpond.remote.buffer import RemoteBuffer
from millpond.remote.security import Credentials
from millpond.remote.connection import Connection

if TYPE_CHECKING:
    from millpond.sharded.client import ShardedClient

DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_MESSAGE_MB = 512
DEFAULT_PUSH_BATCH_SIZE = 256
DEFAULT_PUSH_MAX_DELAY = 0.05
DEFAULT_MAX_IN_FLIGHT = 1
MAX_IN_FLIGHT = 1024  # a window holds its requests until acknowledged: bounded
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# Connections a forked child inherited from its parent (see Client.connection).
_INHERITED: list = []


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
    """
    settings: dict[str, Any] = dict(
        timeout=timeout, max_message_mb=max_message_mb, shm=shm, push_batch_size=push_batch_size,
        push_max_delay=push_max_delay, max_in_flight=max_in_flight, token=token, tls=tls,
        tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    if not isinstance(address, str) or address.startswith("dns:///"):
        from millpond.sharded.client import ShardedClient

        return ShardedClient(address, Client, **settings)
    return Client(address, **settings)


class Client(BufferMaker):
    """A connection to one millpond server; see :func:`connect`."""

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, shm: bool | str = "auto",
                 push_batch_size: int = DEFAULT_PUSH_BATCH_SIZE,
                 push_max_delay: float | None = DEFAULT_PUSH_MAX_DELAY,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, token: str | None = None,
                 tls: bool | None = None, tls_ca: str | os.PathLike | None = None,
                 tls_cert: str | os.PathLike | None = None,
                 tls_key: str | os.PathLike | None = None):
        if not isinstance(address, str) or not address:
            raise InvalidConfigError(f"address must be 'host:port', got {address!r}")
        if shm not in (True, False, "auto"):
            raise InvalidConfigError(f"shm must be True, False or 'auto', got {shm!r}")
        if not isinstance(push_batch_size, int) or push_batch_size < 1:
            raise InvalidConfigError(f"push_batch_size must be >= 1, got {push_batch_size!r}")
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or not (
                1 <= max_in_flight <= MAX_IN_FLIGHT):
            raise InvalidConfigError(
                f"max_in_flight must be an int in [1, {MAX_IN_FLIGHT}], got {max_in_flight!r}")
        if not is_real(timeout) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
            raise InvalidConfigError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.address = address
        self.timeout = float(timeout)
        self.shm = shm
        self.push_batch_size = push_batch_size
        self.push_max_delay = push_max_delay
        self.max_in_flight = max_in_flight
        self.max_message_bytes = int(max_message_mb) * 1024 * 1024
        self.credentials = Credentials.resolve(token, tls, tls_ca, tls_cert, tls_key)
        self._lock = threading.Lock()
        self._connection: Connection | None = None
        self._pid = -1

    def __reduce__(self) -> tuple[Any, tuple]:
        settings = dict(timeout=self.timeout, max_message_mb=self.max_message_bytes >> 20,
                        shm=self.shm, push_batch_size=self.push_batch_size,
                        push_max_delay=self.push_max_delay, max_in_flight=self.max_in_flight,
                        **self.credentials.settings())
        return (_rebuild_client, (self.address, settings))

    @property
    def connection(self) -> Connection:
        """This process's connection, (re)created in each process that uses it."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    # A channel inherited through fork belongs to the parent's
                    # gRPC threads: never touch it here, not even to close it
                    # (keep it from the garbage collector), and open our own.
                    if self._connection is not None:
                        _INHERITED.append(self._connection)
                    self._connection = Connection(self.address, self._options(), self.shm,
                                                  self.timeout, self.max_message_bytes,
                                                  self.credentials)
                    self._pid = os.getpid()
        assert self._connection is not None
        return self._connection

    @property
    def transport(self) -> str:
        """"shm" when bulk data moves through shared memory, else "grpc"."""
        return self.connection.transport

    @property
    def calls(self) -> Counter[tuple[str, str]]:
        """Bulk calls this process made, by ``(transport, op)``, e.g. ``("shm", "sample")``."""
        return self.connection.calls.copy()

    def budget(self, timeout: float | None, may_wait: bool = True) -> tuple[float, float]:
        """``(wait, deadline)`` of a push or sample given its ``timeout=`` argument (checked).

        ``wait``: seconds the server may wait for the buffer's rate limiter
        (``timeout``, or this client's timeout if None); ``deadline``: the
        whole call's, ``wait`` plus this client's timeout for the rest. A
        buffer without a rate limiter never waits (``may_wait=False``): its
        calls get this client's timeout, as every other call does.
        """
        if not may_wait:
            return 0.0, self.timeout
        wait = self.timeout if timeout is None else timeout
        return wait, wait + self.timeout

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

    def remote_buffer(self, name: str, config: BufferConfig) -> RemoteBuffer:
        """Create ``name`` with ``config`` (or attach to it): the backend of a handle."""
        info, created = self.connection.grpc.create(name, config, self.timeout)
        return RemoteBuffer(self, name, info.config, owner=created)

    def buffer(self, name: str) -> Buffer:
        """Attach to the existing buffer ``name`` (BufferNotFoundError if none).

        The handle's ``close()`` releases it; ``delete()`` deletes the buffer.
        """
        info = self.connection.grpc.info(name, self.timeout)
        return handle_for(RemoteBuffer(self, name, info.config))

    def list_buffers(self) -> list[BufferInfo]:
        """Info of every buffer on the server."""
        return self.connection.grpc.list(self.timeout)

    def delete_buffer(self, name: str) -> None:
        """Delete the buffer ``name`` and its file (BufferNotFoundError if none)."""
        self.connection.grpc.delete(name, self.timeout)

    def close(self) -> None:
        """Close the connection (buffers stay on the server). Idempotent."""
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


def _rebuild_client(address: str, settings: dict[str, Any]) -> Client:
    return Client(address, **settings)
