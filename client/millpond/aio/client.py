"""``millpond.aio.connect`` and :class:`AsyncClient`: one server, from an event loop."""

from __future__ import annotations

import os
from typing import Any, Generator, Mapping

from millpond.aio.buffer import AsyncBuffer, handle_for
from millpond.client import (
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_TIMEOUT,
    channel_options,
    check_address,
    check_client_timeout,
)
from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.ratelimit import RateLimiter
from millpond.core.schema import Schema
from millpond.errors import BufferClosedError, InvalidConfigError
from millpond.remote.aio_transport import AioTransport
from millpond.remote.security import Credentials


def connect(address: str, *, timeout: float = DEFAULT_TIMEOUT,
            max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, token: str | None = None,
            tls: bool | None = None, tls_ca: str | os.PathLike | None = None,
            tls_cert: str | os.PathLike | None = None,
            tls_key: str | os.PathLike | None = None) -> "Connecting":
    """A client of the server at ``address`` ("host:port"), for coroutines of the running
    event loop: ``client = await connect(address)``, or ``async with connect(address) as
    client:`` (closed on leaving). The settings are :func:`millpond.connect`'s, checked
    alike (InvalidConfigError, raised by ``await``): ``timeout`` (every call's deadline;
    a push or sample may also wait up to its own ``timeout=`` for the rate limiter),
    ``max_message_mb``, ``token`` and the TLS files (defaults from ``MILLPOND_TOKEN`` and
    ``MILLPOND_TLS_*``). One server only; no shared memory (see :mod:`millpond.aio`).

    Connecting sends nothing: the first call waits (within its deadline) for a server
    that is not up yet.
    """
    return Connecting(address, dict(timeout=timeout, max_message_mb=max_message_mb,
                                    token=token, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                                    tls_key=tls_key))


class Connecting:
    """What :func:`connect` returns: awaited, the client; as ``async with``, the client
    for the block, closed on leaving it."""

    def __init__(self, address: str, settings: dict[str, Any]):
        self._address = address
        self._settings = settings
        self._client: AsyncClient | None = None

    async def _open(self) -> "AsyncClient":
        return AsyncClient(self._address, **self._settings)  # (its channel: this loop's)

    def __await__(self) -> Generator[Any, None, "AsyncClient"]:
        return self._open().__await__()

    async def __aenter__(self) -> "AsyncClient":
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc: Any) -> None:
        assert self._client is not None
        await self._client.close()


class AsyncClient:
    """A connection to one millpond server for coroutines; see :func:`connect`.

    Made in an event loop, and used in that loop only (its ``grpc.aio`` channel is that
    loop's). Every method is a coroutine but :attr:`transport`; calls from many tasks go
    on at once.
    """

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, token: str | None = None,
                 tls: bool | None = None, tls_ca: str | os.PathLike | None = None,
                 tls_cert: str | os.PathLike | None = None,
                 tls_key: str | os.PathLike | None = None):
        if not isinstance(address, str) or address.startswith("dns:///"):
            raise InvalidConfigError(
                "millpond.aio connects to one server ('host:port'); for shards (a list of "
                f"addresses, or dns:///), use millpond.connect; got {address!r}")
        self.address = check_address(address)
        self.timeout = check_client_timeout(timeout)
        self.max_message_bytes = int(max_message_mb) * 1024 * 1024
        self.credentials = Credentials.resolve(token, tls, tls_ca, tls_cert, tls_key)
        self._channel = self.credentials.aio_channel(address,
                                                     channel_options(self.max_message_bytes))
        self._grpc = AioTransport(self._channel, self.max_message_bytes,
                                  self.credentials.metadata(), address)
        self._closed = False

    @property
    def transport(self) -> str:
        """"grpc": millpond.aio moves its data over gRPC only."""
        return "grpc"

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
            meta_fields=meta_fields)
        info, created = await self.grpc.create(name, config, self.timeout)
        return handle_for(self, name, info.config, owner=created)

    async def buffer(self, name: str) -> AsyncBuffer:
        """Attach to the existing buffer ``name`` (BufferNotFoundError if none). The
        handle's ``close()`` releases it; ``delete()`` deletes the buffer."""
        info = await self.grpc.info(name, self.timeout)
        return handle_for(self, name, info.config)

    async def list_buffers(self) -> list[BufferInfo]:
        """Info of every buffer on the server."""
        return await self.grpc.list(self.timeout)

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

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient({self.address!r}, timeout={self.timeout})"

