"""A connection to one millpond server: :class:`Client` (``millpond.connect`` makes one).

    client = millpond.connect("localhost:50051")
    buf = client.create_buffer("cartpole", capacity=100_000, obs_dim=4, act_dim=1)
    buf.push_batch(obs, next_obs, actions, rewards, terminated, truncated)
    batch = buf.sample(256)

Every call carries a deadline (``timeout`` seconds) and waits, within it, for
a server that is not up yet or still recovering its buffers: after about a
second of not reaching it, the client logs one warning (logger ``millpond.client``)
naming the address and the cause; ``connect(wait_for_server=False)`` raises
ServerUnavailableError instead, within about 2 s. Keepalive pings
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

import difflib
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from millpond.core.checks import is_real
from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.ratelimit import RateLimiter
from millpond.core.schema import Schema
from millpond.core.snapshot import CheckpointResult
from millpond.errors import BufferNotFoundError, InvalidConfigError, ReplayError
from millpond.handle.backend import Backend
from millpond.handle.buffer import Buffer, handle_for
from millpond.remote.buffer import RemoteBuffer
from millpond.remote.connection import Connection
from millpond.remote.grpc_calls import Episodes
from millpond.remote.security import Credentials

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


@dataclass(frozen=True)
class RepairResult:
    """What :meth:`Client.repair_buffer` did: the buffer's ``info`` (served again),
    ``dropped`` records that failed their checks, and whether it was ``repaired`` (False:
    it was served already; nothing was done)."""

    info: BufferInfo
    dropped: int
    repaired: bool


class BufferClient:
    """What every client does with buffers, one server or shards: :meth:`create_buffer`
    turns the user-facing arguments into a config and wraps the backend that the
    client's :meth:`remote_buffer` gives in its handle."""

    def remote_buffer(self, name: str, config: BufferConfig,
                      create: bool | None = True) -> Backend:
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
        frame_stack: Mapping[str, int] | None = None,
        next_of: Mapping[str, str] | None = None,
        frame_capacity: int | None = None,
        compression: str | Mapping[str, Any] | None = None,
        compressed_bytes: int | None = None,
    ) -> Buffer:
        """Create the buffer ``name``, or attach to it if it exists with this config.

        Arguments are those of the in-process classes (see
        :meth:`millpond.BufferConfig.build`): ``capacity`` (RAM only, like
        ``ReplayBuffer``) or ``hot_capacity`` + ``total_capacity`` (like
        ``MmapReplayBuffer``), and ``obs_dim``/``act_dim`` or ``fields``.
        ``prioritized=True`` makes a proportional prioritized buffer with
        ``alpha`` and ``beta`` (see :class:`millpond.PrioritizedReplayBuffer`).
        ``mode``, ``max_times_sampled``, ``rate_limiter``, ``episodes``,
        ``meta_fields``, ``frame_stack``, ``next_of``, ``frame_capacity``,
        ``compression`` and ``compressed_bytes``: see
        :class:`millpond.ReplayBuffer`. An existing buffer with another config
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
            meta_fields=meta_fields,
            frame_stack=frame_stack, next_of=next_of, frame_capacity=frame_capacity,
            compression=compression, compressed_bytes=compressed_bytes)
        return handle_for(self.remote_buffer(name, config))


class Client(BufferClient):
    """A connection to one millpond server; see :func:`connect`."""

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, shm: bool | str = "auto",
                 push_batch_size: int = DEFAULT_PUSH_BATCH_SIZE,
                 push_max_delay: float | None = DEFAULT_PUSH_MAX_DELAY,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, token: str | None = None,
                 tls: bool | None = None, tls_ca: str | os.PathLike | None = None,
                 tls_cert: str | os.PathLike | None = None,
                 tls_key: str | os.PathLike | None = None, wait_for_server: bool = True):
        check_address(address)
        if not isinstance(wait_for_server, bool):
            raise InvalidConfigError(f"wait_for_server must be True or False, got "
                                     f"{wait_for_server!r}")
        self.wait_for_server = wait_for_server
        self._unreachable = Episodes()  # told of, across this client's connections
        if shm not in (True, False, "auto"):
            raise InvalidConfigError(f"shm must be True, False or 'auto', got {shm!r}")
        if not isinstance(push_batch_size, int) or push_batch_size < 1:
            raise InvalidConfigError(f"push_batch_size must be >= 1, got {push_batch_size!r}")
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or not (
                1 <= max_in_flight <= MAX_IN_FLIGHT):
            raise InvalidConfigError(
                f"max_in_flight must be an int in [1, {MAX_IN_FLIGHT}], got {max_in_flight!r}")
        self.address = address
        self.timeout = check_client_timeout(timeout)
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
                        wait_for_server=self.wait_for_server, **self.credentials.settings())
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
                                                  self.credentials, self.wait_for_server,
                                                  self._unreachable)
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
        return budget(timeout, self.timeout, may_wait)

    def _options(self) -> list[tuple[str, Any]]:
        return channel_options(self.max_message_bytes)

    # ---- buffers --------------------------------------------------------------

    def remote_buffer(self, name: str, config: BufferConfig,
                      create: bool | None = True) -> RemoteBuffer:
        """The backend of a handle on ``name`` with ``config``.

        ``create=True``: create it, or attach to it if it exists with this config.
        ``create=False``: attach only; BufferNotFoundError (naming the server's buffers
        of close names) if it does not exist. ``create=None``: attach if it exists; else
        the handle creates it on its first write (push, push_batch, episode writes), and
        a read before that (sample, len, info, ...) raises BufferNotFoundError unless it
        exists by then: a learner's mistyped name fails at its first sample instead of
        making an empty buffer to wait on. An existing buffer with another config raises
        ConfigMismatchError, whatever ``create`` says.
        """
        check_create(create)
        grpc = self.connection.grpc
        if create is not True:
            try:
                grpc.info(name, self.timeout)
            except BufferNotFoundError:
                if create is False:
                    raise self.missing_buffer(name) from None
                return RemoteBuffer(self, name, config, pending=True)
        # (found: Create attaches, checking the config; it creates only if the buffer was
        # deleted in between)
        info, created = grpc.create(name, config, self.timeout)
        return RemoteBuffer(self, name, info.checked_config(), owner=created,
                            read_only=info.read_only)

    def buffer(self, name: str) -> Buffer:
        """Attach to the existing buffer ``name`` (BufferNotFoundError, naming the
        server's buffers of close names, if none).

        The handle's ``close()`` releases it; ``delete()`` deletes the buffer.
        """
        try:
            info = self.connection.grpc.info(name, self.timeout)
        except BufferNotFoundError:
            raise self.missing_buffer(name) from None
        return handle_for(RemoteBuffer(self, name, info.checked_config(),
                                       read_only=info.read_only))

    def missing_buffer(self, name: str, lazy: bool = False) -> BufferNotFoundError:
        """The error for a buffer ``name`` this server lacks: it names the buffers it has
        of close names (a typo?). ``lazy``: a handle that would create it on its first
        write was read first."""
        try:
            names = [info.name for info in self.connection.grpc.list(self.timeout)
                     if info.name]
        except ReplayError:
            names = None
        return missing_buffer_error(name, self.address, names, lazy)

    def list_buffers(self) -> list[BufferInfo]:
        """Info of every buffer on the server, by name: those served (``info.state`` is
        ``"ok"``) and those the daemon holds out of service because their file failed at
        start-up (``state`` "damaged", "unreadable" or "unknown-format", ``reason`` says
        what; see :meth:`repair_buffer`)."""
        return self.connection.grpc.list(self.timeout)

    def info(self, name: str) -> BufferInfo:
        """Info of the buffer ``name``, served or held out of service (its ``state`` and
        ``reason``); BufferNotFoundError if none. (A handle's ``info()`` raises
        BufferDamagedError for a buffer held out of service.)"""
        return self.connection.grpc.info(name, self.timeout, include_unavailable=True)

    def delete_buffer(self, name: str) -> None:
        """Delete the buffer ``name`` and its file (BufferNotFoundError if none); a buffer
        held out of service too. Needs the admin role."""
        self.connection.grpc.delete(name, self.timeout)

    def repair_buffer(self, name: str, timeout: float | None = None) -> RepairResult:
        """Serve the buffer ``name`` held out of service again, online: its file is
        reopened and every record checked; those that fail are dropped and the file
        rewritten without them (the others keep their order). A buffer served already is
        left as it is. BufferDamagedError if its file still cannot be used (the message
        says why and what to do). Needs the admin role; ``timeout``: seconds (default:
        this client's; a large buffer takes a while to check)."""
        info, dropped, repaired = self.connection.grpc.repair(
            name, self.timeout if timeout is None else timeout)
        return RepairResult(info, dropped, repaired)

    def checkpoint(self, name: str, path: str | os.PathLike, *,
                   progress: Callable[[int, int], None] | None = None,
                   timeout: float | None = None) -> CheckpointResult:
        """Have the daemon write a consistent copy of the live buffer ``name`` to ``path``
        while actors keep pushing: a buffer file (``.buffer`` appended if missing) under
        the daemon's ``--backup-dir``, ``path`` relative to it or absolute inside it.

        The snapshot holds the records acknowledged before the call began that were
        still live when copied, each checked (see :mod:`millpond.core.snapshot`); a
        daemon started with it in its data directory serves it (``millpond restore``).
        ``progress(copied, total)`` hears the copy's progress; ``timeout``: seconds for
        the whole copy (None: no limit). Needs the admin role; refused by a daemon
        without ``--backup-dir`` (PermissionDeniedError), and for a path outside it or
        a file that exists. Pushes this process made through a handle and has not
        flushed are not in it: use the handle's ``checkpoint``, which flushes first."""
        return self.connection.grpc.checkpoint(name, os.fspath(path), timeout, progress)

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


# ---- what every client of one server does alike (this one, millpond.aio's) ---------------


def check_address(address: Any) -> str:
    """``address`` ("host:port"), or InvalidConfigError."""
    if not isinstance(address, str) or not address:
        raise InvalidConfigError(f"address must be 'host:port', got {address!r}")
    return address


def check_create(create: Any) -> bool | None:
    """A buffer constructor's ``create`` (True, False or None), or InvalidConfigError."""
    if create not in (True, False, None) or not isinstance(create, (bool, type(None))):
        raise InvalidConfigError(f"create must be True, False or None, got {create!r}")
    return create


def missing_buffer_error(name: str, address: str, names: list[str] | None,
                         lazy: bool = False) -> BufferNotFoundError:
    """BufferNotFoundError for ``name`` at ``address``, naming those of ``names`` (the
    server's buffers; None: unknown) that are close to it."""
    message = f"no buffer named {name!r} at {address}"
    if names is not None:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        if close:
            message += f"; did you mean {' or '.join(map(repr, close))}?"
        elif names:
            shown = ", ".join(map(repr, sorted(names)[:10]))
            message += f"; it has {shown}{', ...' if len(names) > 10 else ''}"
        else:
            message += "; it has no buffers"
    if lazy:
        message += (". This handle was made with create=None (the default), which creates "
                    "the buffer on its first write and never on a read; pass create=True "
                    "to create it at once (e.g. a learner that starts before its actors)")
    return BufferNotFoundError(message)


def check_client_timeout(timeout: Any) -> float:
    """A client's ``timeout`` (finite seconds > 0) as a float, or InvalidConfigError."""
    if not is_real(timeout) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise InvalidConfigError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


def budget(timeout: float | None, client_timeout: float, may_wait: bool) -> tuple[float, float]:
    """``(wait, deadline)`` of a push or sample: see :meth:`Client.budget`."""
    if not may_wait:
        return 0.0, client_timeout
    wait = client_timeout if timeout is None else timeout
    return wait, wait + client_timeout


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """The options of a client's gRPC channel: message limits and keepalive pings."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A channel of its own connection: a forked child's new channel must not reuse
        # its parent's (gRPC's global pool would hand it the parent's socket).
        ("grpc.use_local_subchannel_pool", 1),
    ]
