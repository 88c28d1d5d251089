"""The client's transport seam: one protocol, two implementations, one fallback policy.

A :class:`Transport` carries the bulk calls of a buffer handle: gRPC
(:class:`~millpond.remote.grpc_transport.GrpcTransport`) or same-host shared memory
(:class:`~millpond.remote.shm.transport.ShmTransport`). A :class:`Connection` is one
process's channel to a server; :meth:`Connection.call` picks the transport
for each call (see its docstring for the policy). Control calls (create,
info, list, delete, negotiate) always go over gRPC (:attr:`Connection.grpc`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Protocol

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.schema import Schema
from millpond.errors import (
    AuthenticationError,
    DeadlineExceededError,
    PermissionDeniedError,
    ReplayError,
    ServerUnavailableError,
    SharedMemoryError,
)
from millpond.remote.grpc_calls import Episodes
from millpond.remote.grpc_transport import GrpcTransport
from millpond.remote.malloc import tune_malloc_for_large_messages
from millpond.remote.security import Credentials
from millpond.remote.shm import facilities
from millpond.remote.shm.protocol import read_boot_id
from millpond.remote.shm.session import ResultPoolExhausted
from millpond.remote.shm.transport import ShmTransport

log = logging.getLogger("millpond.client")
_told: set[str] = set()  # why this system has no fast path, once logged (once a process)


class Transport(Protocol):
    """The bulk calls of a buffer, by buffer name.

    ``timeout``: seconds the server may wait for the buffer's rate limiter
    (0: not at all). ``deadline``: seconds the whole call may take.
    """

    name: str

    def push_batch(self, buffer: str, schema: Schema, n: int, columns: dict[str, np.ndarray],
                   priorities: np.ndarray | None, timeout: float, deadline: float,
                   updates: list | None = None, capacity: int | None = None) -> None: ...

    def sample(self, buffer: str, schema: Schema, batch_size: int, seed: int | None,
               extras: bool, timeout: float, deadline: float,
               filter_meta: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]: ...

    def sample_sequences(self, buffer: str, config: BufferConfig, batch_size: int,
                         filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                         timeout: float, deadline: float) -> dict[str, np.ndarray]: ...

    def sample_n_step(self, buffer: str, config: BufferConfig, batch_size: int,
                      filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                      timeout: float, deadline: float) -> dict[str, np.ndarray]: ...

    def read(self, buffer: str, config: BufferConfig, seqs: np.ndarray, names: list[str] | None,
             deadline: float, positions: bool = False, episode_ids: bool = False
             ) -> dict[str, np.ndarray]: ...

    def update_priorities(self, buffer: str, indices: np.ndarray, priorities: np.ndarray,
                          deadline: float) -> int: ...

    def set_beta(self, buffer: str, beta: float, deadline: float) -> None: ...


class Connection:
    """One process's gRPC channel to a server and, when negotiated, its fast path.

    ``shm``: "auto" uses the fast path when the server offers it and this
    process can reach it; True requires it (SharedMemoryError if it cannot be
    had, with the reason); False never uses it. ``wait_for_server``: see
    :func:`millpond.connect` (the fast path is negotiated at once, so an unreachable
    server is found, waited for or refused, when the connection is made).
    """

    def __init__(self, address: str, options: list[tuple[str, Any]], shm: bool | str,
                 timeout: float, max_message_bytes: int,
                 credentials: Credentials | None = None, wait_for_server: bool = True,
                 episodes: Episodes | None = None):
        tune_malloc_for_large_messages()
        self.credentials = credentials = credentials or Credentials()
        self.channel = credentials.channel(address, options)  # TLS when configured
        self.grpc = GrpcTransport(self.channel, max_message_bytes, credentials.metadata(),
                                  address, wait_for_server, episodes)
        self._timeout = timeout
        self._lock = threading.Lock()
        self.calls: Counter[tuple[str, str]] = Counter()  # (transport, op) -> calls made
        self.shm: ShmTransport | None = None
        self.shm_reason = "disabled by the client (shm=False)"
        self._want_shm = shm
        if shm is not False:
            try:
                self.shm, self.shm_reason = self._negotiate()
            except BaseException:  # (an unreachable server, say): no channel left behind
                self.grpc.close()
                self.channel.close()
                raise
            if shm is True and self.shm is None:
                self.channel.close()
                raise SharedMemoryError(f"shared memory was required but {self.shm_reason}")

    @property
    def transport(self) -> str:
        """"shm" while the fast path is in use, else "grpc"."""
        return "shm" if self.shm is not None else "grpc"

    def call(self, op: str, *args: Any) -> Any:
        """Run bulk call ``op`` (a :class:`Transport` method) with ``args``.

        The one fallback policy:

        * with a fast path, the call goes through shared memory;
        * if shared memory cannot carry this call (a segment cannot be
          reserved: :class:`SharedMemoryError`; too many earlier results are
          still alive; the connection was found closed before the request
          went out, as when the server restarted), this call alone goes over
          gRPC. Nothing was stored or drawn by the refused attempt;
        * a fast path whose connection was lost (the server restarted) is
          negotiated again before the next call; until a new one is had,
          calls go over gRPC;
        * without a fast path, gRPC.

        Errors of the call itself (bad input, rate-limit timeouts, a lost
        connection in the middle of a call) are raised, never retried: a
        push may have been stored.
        """
        shm = self._fast_path()
        if shm is not None:
            try:
                result = getattr(shm, op)(*args)
                self.calls["shm", op] += 1
                return result
            except (SharedMemoryError, ResultPoolExhausted) as exc:
                log.info("%s over gRPC this time: %s", op, exc)
        return self.grpc_call(op, *args)

    def grpc_call(self, op: str, *args: Any) -> Any:
        """Run call ``op`` over gRPC, whatever the transport: for calls whose results
        have sizes known only once made (sample_episodes, episode_catalog)."""
        result = getattr(self.grpc, op)(*args)
        self.calls["grpc", op] += 1
        return result

    def _fast_path(self) -> ShmTransport | None:
        shm = self.shm
        if shm is None or not shm.stale:
            return shm
        with self._lock:
            if self.shm is shm:
                shm.close()
                self.shm, self.shm_reason = self._negotiate()
            return self.shm

    def _negotiate(self) -> tuple[ShmTransport | None, str]:
        """Open the fast path if the server offers it and it is reachable from here."""
        lacking = facilities.lacking()
        if lacking:  # not Linux, or a Python without what the fast path uses: gRPC only
            if lacking not in _told:
                _told.add(lacking)
                log.warning("the shared-memory fast path is off: %s; calls use gRPC", lacking)
            return None, lacking
        boot_id = read_boot_id()
        try:
            offer = self.grpc.negotiate(boot_id, self._timeout)
        except (ServerUnavailableError, DeadlineExceededError, AuthenticationError,
                PermissionDeniedError):
            raise
        except ReplayError as exc:  # e.g. a server without the fast path's RPC
            return None, f"the server did not negotiate it ({exc})"
        if not offer.shm:
            return None, offer.reason or "the server does not offer it here (another host?)"
        if not boot_id or offer.boot_id != boot_id:
            return None, "the server runs on another host"
        # The hello shows the ticket Negotiate gave us, if any (a server requiring client
        # certificates takes nothing else: the ticket stands for our certified channel),
        # else our token.
        hello = {"ticket": offer.ticket} if offer.ticket else self.credentials.hello()
        try:
            return ShmTransport(offer.socket, offer.uid, self._timeout, hello,
                                self.grpc.address), ""
        except OSError as exc:  # other network namespace, refused peer, no memfd...
            return None, f"its socket is not reachable from here ({exc})"

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        self.grpc.close()
        self.channel.close()
