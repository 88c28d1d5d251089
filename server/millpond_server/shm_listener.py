"""The listener of the same-host fast path: who may connect, and how many of them.

A thread accepts connections on an abstract Unix socket and admits only peers
of the server's user, or of a configured group (``--shm-group``), checked
with ``SO_PEERCRED`` / ``SO_PEERGROUPS``. Each admitted connection gets a
:class:`~.fastpath.FastPathSession` thread. A refused peer is told why before
the connection closes. Sessions are counted per client process, per user and
in all; shared memory per client process and in all (:class:`FastPathLimits`).
Running out of file descriptors pauses accepting, and failing to admit one
connection (no thread for it) closes that connection: neither ends accepting.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass

from millpond.errors import PermissionDeniedError, ReplayError, SharedMemoryError
from millpond.remote.shm import protocol

from .fastpath import FastPathSession
from .operations import Operations

log = logging.getLogger("millpond.fastpath")

# accept() failures that pass (out of fds, memory, buffers): the loop goes on.
_TRANSIENT_ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                            errno.ECONNABORTED, errno.EPROTO}


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+
# Refusals in progress at once (each reads the hello, answers, closes); more are just closed.
MAX_REFUSALS = 16
# Sessions all clients together may hold by default (less if the open files limit is low).
MAX_SESSIONS_TOTAL = 1024


def peer_groups(conn: socket.socket, pid: int, gid: int) -> set[int]:
    """The peer's primary and supplementary groups.

    ``SO_PEERGROUPS`` asks the kernel, which works across PID namespaces (a
    client in another container); ``/proc/<pid>/status`` is the fallback.
    """
    groups = {gid}
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)  # Python caps it at 1024
        groups.update(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
        return groups
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return groups


@dataclass(frozen=True)
class FastPathLimits:
    """What fast-path clients may hold, and for how long (the ``serve`` flag of each)."""

    bytes_total: int = 8 << 30  # --shm-max-mb: shared memory, all clients together
    bytes_per_client: int = 8 << 30  # --shm-max-mb-per-client: one client process
    sessions_per_client: int = 64  # --shm-max-sessions: one client process
    sessions_per_user: int = 256  # --shm-max-sessions-per-user: one uid's processes together
    sessions_total: int = MAX_SESSIONS_TOTAL  # --shm-max-sessions-total
    hello_s: float = 5.0  # --shm-hello-s: a connection's time to complete a hello
    idle_s: float = 300.0  # --shm-idle-s: a session's time without a request


class FastPathServer:
    """Listens on ``\\0<socket_name>``; one :class:`FastPathSession` thread per connection."""

    def __init__(self, ops: Operations, allowed_gids: frozenset[int] = frozenset(),
                 limits: FastPathLimits = FastPathLimits()):
        self.ops = ops
        self.allowed_gids = allowed_gids
        self.limits = limits
        # Per client process (pid): [sessions, bytes of shared memory held].
        self._clients: dict[int, list[int]] = {}
        self._users: dict[int, int] = {}  # uid -> sessions
        self._bytes = 0  # shared memory held, all clients together
        self._refusals = threading.BoundedSemaphore(MAX_REFUSALS)
        self.socket_name = f"millpond-{os.getpid()}-{uuid.uuid4().hex}"
        self.uid = os.getuid()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind("\0" + self.socket_name)
        self._listener.listen(128)
        self._sessions: set[FastPathSession] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._accept_loop, name="millpond-shm-accept",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, end every session, release every segment."""
        self._stopping = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(5)
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.shutdown()
        for session in sessions:
            session.join(5)

    def admits(self, conn: socket.socket, uid: int, pid: int, gid: int) -> bool:
        return uid == self.uid or bool(self.allowed_gids & peer_groups(conn, pid, gid))

    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._stopping or exc.errno not in _TRANSIENT_ACCEPT_ERRORS:
                    return  # listener closed by stop()
                # Out of fds or memory: existing sessions keep working; try again soon.
                backoff = min(max(2 * backoff, 0.01), 1.0)
                log.warning("fast path cannot accept", extra={"kv": {"error": exc}})
                time.sleep(backoff)
                continue
            backoff = 0.0
            try:
                self._admit(conn)
            except Exception as exc:
                # This connection alone fails (no thread for it: "can't start new thread",
                # its peer gone...): the listener keeps serving the others.
                conn.close()
                log.warning("fast path could not admit a connection",
                            extra={"kv": {"error": exc}})

    def _admit(self, conn: socket.socket) -> None:
        """Start a session for ``conn``, or refuse it saying why. Raises if its thread
        cannot start; nothing stays counted then."""
        pid, uid, gid = peer_credentials(conn)
        if not self.admits(conn, uid, pid, gid):
            reason: str | None = (f"uid {uid} is neither the server's user (uid {self.uid}) "
                                  "nor in a group it admits (--shm-group)")
        else:
            with self._lock:
                reason = self._full(pid, uid)
                if reason is None:
                    session = FastPathSession(self, conn, pid, uid)
                    self._sessions.add(session)
                    self._clients.setdefault(pid, [0, 0])[0] += 1
                    self._users[uid] = self._users.get(uid, 0) + 1
        if reason is not None:
            log.warning("shm peer refused", extra={"kv": {"pid": pid, "uid": uid, "why": reason}})
            self._refuse(conn, reason)
            return
        try:
            session.start()
        except BaseException:
            session.cleanup()  # closes the connection, counts the session no more
            raise

    def _full(self, pid: int, uid: int) -> str | None:
        """Which session limit a new session of client ``pid`` of user ``uid`` would pass,
        if any (under the lock)."""
        limits = self.limits
        held = self._clients.get(pid, (0, 0))[0]
        if held >= limits.sessions_per_client:
            return f"this client already has {held} fast-path sessions (--shm-max-sessions)"
        held = self._users.get(uid, 0)
        if held >= limits.sessions_per_user:
            return (f"uid {uid} already has {held} fast-path sessions "
                    "(--shm-max-sessions-per-user)")
        if len(self._sessions) >= limits.sessions_total:
            return (f"the server already has {len(self._sessions)} fast-path sessions "
                    "(--shm-max-sessions-total)")
        return None

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        """Answer the hello with the reason (so the client can say why), then close."""
        if not self._refusals.acquire(blocking=False):
            conn.close()
            return

        def answer() -> None:
            try:
                conn.settimeout(2.0)
                _, fds = protocol.recv(conn)
                protocol.close_fds(fds)
                protocol.send(conn, protocol.error_reply(
                    PermissionDeniedError(f"the fast path refused this client: {reason}")))
            except (OSError, ReplayError):
                pass
            finally:
                conn.close()
                self._refusals.release()

        try:
            threading.Thread(target=answer, name="millpond-shm-refuse", daemon=True).start()
        except BaseException:
            self._refusals.release()  # the caller closes the connection
            raise

    def reserve(self, pid: int, size: int) -> None:
        """Count ``size`` bytes of shared memory against client ``pid``'s limit
        (--shm-max-mb-per-client) and all clients' (--shm-max-mb); SharedMemoryError
        if either would be passed."""
        limits = self.limits
        with self._lock:
            held = self._clients.setdefault(pid, [0, 0])
            if held[1] + size > limits.bytes_per_client:
                raise SharedMemoryError(
                    f"a segment of {size:,} bytes would take this client's shared memory over "
                    f"its limit of {limits.bytes_per_client:,} bytes (--shm-max-mb-per-client)")
            if self._bytes + size > limits.bytes_total:
                raise SharedMemoryError(
                    f"a segment of {size:,} bytes would take the shared memory of all fast-path "
                    f"clients ({self._bytes:,} bytes now) over the server's limit of "
                    f"{limits.bytes_total:,} bytes (--shm-max-mb)")
            held[1] += size
            self._bytes += size

    def usage(self) -> tuple[int, int, int]:
        """``(client processes, sessions, bytes of shared memory)`` held now."""
        with self._lock:
            return len(self._clients), len(self._sessions), self._bytes

    def unreserve(self, pid: int, size: int) -> None:
        with self._lock:
            self._clients[pid][1] -= size
            self._bytes -= size

    def _ended(self, session: "FastPathSession") -> None:
        with self._lock:
            self._sessions.discard(session)
            held = self._clients[session.pid]
            held[0] -= 1
            if held == [0, 0]:
                del self._clients[session.pid]
            self._users[session.uid] -= 1
            if not self._users[session.uid]:
                del self._users[session.uid]
