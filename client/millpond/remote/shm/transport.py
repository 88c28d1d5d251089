"""The shared-memory transport: bulk calls through a pool of fast-path sessions.

A session serves one request at a time (one server thread each), so a call
takes a session from the pool for its duration and gives it back after:
threads sharing one client proceed independently, and a sample waiting for
a rate limiter never holds up another thread's push. The pool opens
sessions as concurrency needs them and keeps a few idle ones.

A session that broke (deadline passed mid-call, connection lost) is closed,
not returned. A lost connection also marks the transport :attr:`stale`: the
server may have restarted under a new socket, so the connection negotiates
again before the next call. Idle sessions the server is about to close
(``--shm-idle-s``) are closed here first and a fresh one opened instead.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, TypeVar

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.schema import Schema
from millpond.core.sequences import n_step_specs, read_specs, sequence_specs
from millpond.errors import SharedMemoryError
from millpond.remote.shm import protocol
from millpond.remote.shm.session import ShmSession

T = TypeVar("T")

MAX_IDLE_SESSIONS = 4


class ShmTransport:
    """Bulk calls over the server's fast-path socket ``socket_name`` (owned by ``uid``).

    Opening it opens one session, so an unreachable socket or a refusal
    raises OSError here, not on the first call. ``hello``: what each
    session's hello presents to a server with authentication on (a token or
    a ticket).
    """

    name = "shm"

    def __init__(self, socket_name: str, uid: int, deadline: float,
                 hello: dict[str, str] | None = None, address: str = ""):
        self.address = address  # the server's gRPC address, named in ProtocolErrors
        self._socket_name = socket_name
        self._uid = uid
        self._hello = hello or {}
        self._lock = threading.Lock()
        self.served: Counter[str] = Counter()  # successful requests per op, all sessions
        self._idle = [self._open(deadline)]
        self.stale = False

    def _open(self, deadline: float) -> ShmSession:
        return ShmSession(self._socket_name, self._uid, deadline, self.served, self._hello,
                          self.address)

    def _on_session(self, deadline: float, call: Callable[[ShmSession], T]) -> T:
        """``call(session)`` on an idle session (or a new one), which is then put back
        (or closed, if it broke). A plain try/finally: this runs on every call."""
        with self._lock:
            # The newest idle session is last: if it is expiring, so are all the others.
            expired = self._idle if self._idle and self._idle[-1].expiring() else []
            if expired:
                self._idle = []
            session = self._idle.pop() if self._idle else None
        for old in expired:
            old.close()
        if session is None:
            try:
                session = self._open(deadline)
            except OSError as exc:  # the server may have restarted: negotiate again
                self.stale = True
                raise SharedMemoryError(f"cannot open another fast-path session: {exc}") from exc
        try:
            return call(session)
        finally:
            if session.broken:
                self.stale = self.stale or session.lost
            with self._lock:  # a stale transport's sessions are not reused
                if not session.broken and not self.stale and len(self._idle) < MAX_IDLE_SESSIONS:
                    self._idle.append(session)
                    session = None
            if session is not None:
                session.close()

    def push_batch(self, buffer: str, schema: Schema, n: int, columns: dict[str, np.ndarray],
                   priorities: np.ndarray | None, timeout: float, deadline: float,
                   updates: list | None = None, capacity: int | None = None) -> None:
        self._on_session(deadline, lambda session: session.push_batch(
            buffer, schema, n, columns, priorities, timeout, deadline, updates, capacity))

    def sample(self, buffer: str, schema: Schema, batch_size: int, seed: int | None,
               extras: bool, timeout: float, deadline: float,
               filter_meta: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return self._on_session(deadline, lambda session: session.sample(
            buffer, schema, batch_size, seed, extras, timeout, deadline, filter_meta))

    def sample_sequences(self, buffer: str, config: BufferConfig, batch_size: int,
                         filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                         timeout: float, deadline: float) -> dict[str, np.ndarray]:
        specs = sequence_specs(config, batch_size, params["seq_len"])
        return self._episodic("sample_sequences", buffer, batch_size, filter_meta, params,
                              specs, timeout, deadline)

    def sample_n_step(self, buffer: str, config: BufferConfig, batch_size: int,
                      filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                      timeout: float, deadline: float) -> dict[str, np.ndarray]:
        specs = n_step_specs(config, batch_size)
        return self._episodic("sample_n_step", buffer, batch_size, filter_meta, params, specs,
                              timeout, deadline)

    def _episodic(self, op: str, buffer: str, batch_size: int,
                  filter_meta: dict[str, np.ndarray] | None, params: dict[str, Any],
                  specs: protocol.Specs, timeout: float, deadline: float) -> dict[str, np.ndarray]:
        message = {"op": op, "buffer": buffer, "batch_size": batch_size, "timeout": timeout,
                   "filter_meta": protocol.encode_filter(filter_meta), **params}
        return self._on_session(deadline,
                                lambda session: session.into_result(message, specs, deadline))

    def read(self, buffer: str, config: BufferConfig, seqs: np.ndarray, names: list[str] | None,
             deadline: float, positions: bool = False, episode_ids: bool = False
             ) -> dict[str, np.ndarray]:
        specs = read_specs(config, len(seqs), names, episode_ids)
        flags = {"positions": positions, "episode_ids": episode_ids}
        return self._on_session(deadline, lambda session: session.read(
            buffer, seqs, names, specs, deadline, flags))

    def update_priorities(self, buffer: str, indices: np.ndarray, priorities: np.ndarray,
                          deadline: float) -> int:
        return self._on_session(deadline, lambda session: session.update_priorities(
            buffer, indices, priorities, deadline))

    def set_beta(self, buffer: str, beta: float, deadline: float) -> None:
        self._on_session(deadline, lambda session: session.set_beta(buffer, beta, deadline))

    def close(self) -> None:
        """Close the idle sessions (those in use close when their call ends)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for session in idle:
            session.close()
        self.stale = True
