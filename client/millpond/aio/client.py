"""``millpond.aio.connect`` and :class:`AsyncClient`: one server, from an event loop."""

from __future__ import annotations

import asyncio
import functools
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Coroutine, Generator, Mapping, TypeVar

from millpond.aio.buffer import AsyncBuffer, handle_for
from millpond.client import (
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_TIMEOUT,
    channel_options,
    check_address,
    check_client_timeout,
    missing_buffer_error,
)
from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.ratelimit import RateLimiter
from millpond.core.schema import Schema
from millpond.errors import BufferClosedError, BufferNotFoundError, InvalidConfigError, ReplayError
from millpond.remote.aio_transport import AioTransport
from millpond.remote.connection import Connection
from millpond.remote.security import Credentials

T = TypeVar("T")

# Threads of a client's calls on the shared-memory fast path (the large ones only).
FAST_PATH_THREADS = 4


def connect(address: str, *, timeout: float = DEFAULT_TIMEOUT,
            max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, shm: bool | str = "auto",
            token: str | None = None, tls: bool | None = None,
            tls_ca: str | os.PathLike | None = None, tls_cert: str | os.PathLike | None = None,
            tls_key: str | os.PathLike | None = None,
            wait_for_server: bool = True) -> "Connecting":
    """A client of the server at ``address`` ("host:port"), for coroutines of the running
    event loop: ``client = await connect(address)``, or ``async with connect(address) as
    client:`` (closed on leaving). The settings are :func:`millpond.connect`'s, checked
    alike (InvalidConfigError, raised by ``await``): ``timeout`` (every call's deadline;
    a push or sample may also wait up to its own ``timeout=`` for the rate limiter),
    ``max_message_mb``, ``token`` and the TLS files (defaults from ``MILLPOND_TOKEN`` and
    ``MILLPOND_TLS_*``). One server only.

    ``shm``: "auto" (default) moves a call's data through shared memory when the server
    is on this host and admits this user, the call moves more than 64 KiB and cannot
    wait (its buffer has no rate limiter; reads); True requires the fast path (raised at
    connect if it cannot be had); False never uses it. Such a call runs on one of the
    client's few threads (see :mod:`millpond.aio`); every other call is a coroutine on
    the client's gRPC channel.

    Connecting sends nothing (``shm=True`` aside): the first call waits (within its
    deadline) for a server that is not up yet, and after about a second logs one warning
    saying what it waits for; ``wait_for_server=False`` raises ServerUnavailableError
    instead, within about 2 s (see :func:`millpond.connect`).
    """
    return Connecting(address, dict(timeout=timeout, max_message_mb=max_message_mb, shm=shm,
                                    token=token, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                                    tls_key=tls_key, wait_for_server=wait_for_server))


class Connecting(Coroutine[Any, Any, "AsyncClient"]):
    """What :func:`connect` returns: a coroutine whose result is the client (``await``,
    ``asyncio.run``, ``create_task``), and an ``async with`` of the client for the block,
    closed on leaving it (as aiohttp's requests are)."""

    def __init__(self, address: str, settings: dict[str, Any]):
        self._coro = self._open(address, settings)
        self._client: AsyncClient | None = None

    @staticmethod
    async def _open(address: str, settings: dict[str, Any]) -> "AsyncClient":
        client = AsyncClient(address, **settings)  # (its channel: the running loop's)
        if client.shm is True:  # required: had now, or SharedMemoryError
            try:
                await client.fast_path()
            except BaseException:
                await client.close()
                raise
        return client

    def send(self, value: Any) -> Any:
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        return self._coro.throw(*args)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, "AsyncClient"]:
        return self._coro.__await__()

    async def __aenter__(self) -> "AsyncClient":
        self._client = await self._coro
        return self._client

    async def __aexit__(self, *exc: Any) -> None:
        assert self._client is not None
        await self._client.close()


class AsyncClient:
    """A connection to one millpond server for coroutines; see :func:`connect`.

    Made in an event loop, and used in that loop only (its ``grpc.aio`` channel is that
    loop's). Every method is a coroutine but the properties; calls from many tasks go
    on at once.
    """

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, shm: bool | str = "auto",
                 token: str | None = None, tls: bool | None = None,
                 tls_ca: str | os.PathLike | None = None,
                 tls_cert: str | os.PathLike | None = None,
                 tls_key: str | os.PathLike | None = None, wait_for_server: bool = True):
        if not isinstance(address, str) or address.startswith("dns:///"):
            raise InvalidConfigError(
                "millpond.aio connects to one server ('host:port'); for shards (a list of "
                f"addresses, or dns:///), use millpond.connect; got {address!r}")
        if shm not in (True, False, "auto"):
            raise InvalidConfigError(f"shm must be True, False or 'auto', got {shm!r}")
        self.address = check_address(address)
        self.timeout = check_client_timeout(timeout)
        self.max_message_bytes = int(max_message_mb) * 1024 * 1024
        self.shm = shm
        if not isinstance(wait_for_server, bool):
            raise InvalidConfigError(f"wait_for_server must be True or False, got "
                                     f"{wait_for_server!r}")
        self.wait_for_server = wait_for_server
        self.credentials = Credentials.resolve(token, tls, tls_ca, tls_cert, tls_key)
        options = channel_options(self.max_message_bytes)
        self._channel = self.credentials.aio_channel(address, options)
        self._grpc = AioTransport(self._channel, self.max_message_bytes,
                                  self.credentials.metadata(), address, wait_for_server)
        self._closed = False
        self._grpc_calls: Counter[tuple[str, str]] = Counter()
        # The fast path: the sync client's connection (its negotiation, sessions and
        # fallback), made at the first call that may use it; its calls run on _threads.
        self._connection: Connection | None = None
        self._negotiated = shm is False
        self._negotiating = asyncio.Lock()
        self._threads: ThreadPoolExecutor | None = None
        self.shm_reason = "disabled by the client (shm=False)" if shm is False else (
            "not negotiated yet (at the first call that may use it)")

    @property
    def transport(self) -> str:
        """"shm" while large calls move their data through shared memory (negotiated at
        the first call that may: see :func:`connect`), else "grpc"."""
        return self._connection.transport if self._connection is not None else "grpc"

    @property
    def calls(self) -> Counter[tuple[str, str]]:
        """Bulk calls this client made, by ``(transport, op)``, e.g. ``("shm", "sample")``."""
        calls = self._grpc_calls.copy()
        if self._connection is not None:
            calls.update(self._connection.calls)
        return calls

    async def fast_path(self) -> Connection | None:
        """The connection whose fast path carries large calls (negotiated on first use),
        or None (see :attr:`shm_reason`). Raises as a call would if the server cannot
        be reached; ``shm=True``: SharedMemoryError if the fast path cannot be had."""
        if self._closed:
            raise BufferClosedError(f"the client of {self.address} was closed")
        if not self._negotiated:
            async with self._negotiating:
                if not self._negotiated:
                    self._connection = await self._negotiate()
                    self._negotiated = True
        return self._connection

    async def _negotiate(self) -> Connection | None:
        connection = await asyncio.to_thread(
            Connection, self.address, channel_options(self.max_message_bytes), self.shm,
            self.timeout, self.max_message_bytes, self.credentials, self.wait_for_server)
        self.shm_reason = connection.shm_reason
        if connection.shm is None or self._closed:  # no fast path: its channel goes
            await asyncio.to_thread(connection.close)
            return None
        self._threads = ThreadPoolExecutor(FAST_PATH_THREADS,
                                           thread_name_prefix=f"millpond-aio {self.address}")
        return connection

    async def on_thread(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` on one of the fast path's threads (a blocking call of it)."""
        assert self._threads is not None
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._threads, functools.partial(call, *args))
        except Exception as exc:
            if self._closed:  # its sessions closed under it
                raise BufferClosedError(f"the client of {self.address} was closed while "
                                        "its call was under way") from exc
            raise

    def counted(self, op: str) -> AioTransport:
        """The transport, for a bulk call ``op`` (counted in :attr:`calls`)."""
        transport = self.grpc
        self._grpc_calls["grpc", op] += 1
        return transport

    @property
    def grpc(self) -> AioTransport:
        """The transport of this client's calls; BufferClosedError once it is closed."""
        if self._closed:
            raise BufferClosedError(f"the client of {self.address} was closed")
        return self._grpc

    # ---- buffers --------------------------------------------------------------

    async def create_buffer(
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
    ) -> AsyncBuffer:
        """Create the buffer ``name``, or attach to it if it exists with this config; the
        arguments are :meth:`millpond.Client.create_buffer`'s. An existing buffer with
        another config raises ConfigMismatchError. The handle's ``close()`` deletes the
        buffer if this call created it; if it attached, ``close()`` only releases it."""
        config = BufferConfig.build(
            capacity=capacity, hot_capacity=hot_capacity, total_capacity=total_capacity,
            obs_dim=obs_dim, act_dim=act_dim, fields=fields, mode=mode,
            max_times_sampled=max_times_sampled, rate_limiter=rate_limiter,
            prioritized=prioritized, alpha=alpha, beta=beta, episodes=episodes,
            meta_fields=meta_fields, frame_stack=frame_stack, next_of=next_of,
            frame_capacity=frame_capacity, compression=compression,
            compressed_bytes=compressed_bytes)
        info, created = await self.grpc.create(name, config, self.timeout)
        return handle_for(self, name, info, owner=created)

    async def buffer(self, name: str) -> AsyncBuffer:
        """Attach to the existing buffer ``name`` (BufferNotFoundError if none;
        BufferDamagedError if the daemon holds it out of service). The handle's ``close()``
        releases it; ``delete()`` deletes the buffer. The error of a missing buffer names
        the server's buffers of close names (a typo?)."""
        try:
            info = await self.grpc.info(name, self.timeout)
        except BufferNotFoundError:
            try:
                names: list[str] | None = [i.name for i in await self.grpc.list(self.timeout)
                                           if i.name]
            except ReplayError:
                names = None
            raise missing_buffer_error(name, self.address, names) from None
        return handle_for(self, name, info)

    async def list_buffers(self) -> list[BufferInfo]:
        """Info of every buffer on the server: those served (``info.state`` is ``"ok"``)
        and those held out of service (see :meth:`millpond.Client.list_buffers`)."""
        return await self.grpc.list(self.timeout)

    async def info(self, name: str) -> BufferInfo:
        """Info of the buffer ``name``, served or held out of service (its ``state`` and
        ``reason``); BufferNotFoundError if none."""
        return await self.grpc.info(name, self.timeout, include_unavailable=True)

    async def delete_buffer(self, name: str) -> None:
        """Delete the buffer ``name`` and its file (BufferNotFoundError if none)."""
        await self.grpc.delete(name, self.timeout)

    async def close(self) -> None:
        """Close the connection (buffers stay on the server); calls under way are
        cancelled, later ones raise BufferClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._grpc.close()
        await self._channel.close()
        if self._connection is not None:
            await asyncio.to_thread(self._connection.close)
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient({self.address!r}, timeout={self.timeout})"

