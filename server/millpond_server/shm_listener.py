"""The listener of the same-host fast path: who may connect, and how many of them.

A thread accepts connections on an abstract Unix socket and admits only peers
of the server's user, or of a configured group (``--shm-group``), checked
with ``SO_PEERCRED`` / ``SO_PEERGROUPS``. Each admitted connection gets a
:class:`~.fastpath.FastPathSession` thread. A refused peer is told why before
the connection closes. Shared memory and sessions are counted per client
process, against ``--shm-max-mb`` and ``--shm-max-sessions``. Running out of
file descriptors pauses accepting, and failing to admit one connection (no
thread for it) closes that connection: neither ends accepting.
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


class FastPathServer:
    """Listens on ``\\0<socket_name>``; one :class:`FastPathSession` thread per connection."""

    def __init__(self, ops: Operations, allowed_gids: frozenset[int] = frozenset(),
                 max_client_bytes: int = 8 << 30, max_client_sessions: int = 64):
        self.ops = ops
        self.allowed_gids = allowed_gids
        self.max_client_bytes = max_client_bytes
        self.max_client_sessions = max_client_sessions
        # Per client process (pid): [sessions, bytes of shared memory held].
        self._clients: dict[int, list[int]] = {}
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
        reason = None
        if not self.admits(conn, uid, pid, gid):
            reason = (f"uid {uid} is neither the server's user (uid {self.uid}) nor in a group "
                      "it admits (--shm-group)")
        else:
            with self._lock:
                sessions = self._clients.setdefault(pid, [0, 0])
                if sessions[0] >= self.max_client_sessions:
                    reason = (f"this client already has {sessions[0]} fast-path sessions "
                              "(--shm-max-sessions)")
                else:
                    sessions[0] += 1
        if reason is not None:
            log.warning("shm peer refused", extra={"kv": {"pid": pid, "uid": uid, "why": reason}})
            self._refuse(conn, reason)
            return
        session = FastPathSession(self, conn, pid)
        with self._lock:
            self._sessions.add(session)
        try:
            session.start()
        except BaseException:
            session.cleanup()  # closes the connection, counts the session no more
            raise

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
        """Count ``size`` bytes of shared memory against client ``pid``'s limit (--shm-max-mb)."""
        with self._lock:
            held = self._clients.setdefault(pid, [0, 0])
            if held[1] + size > self.max_client_bytes:
                raise SharedMemoryError(
                    f"a segment of {size:,} bytes would take this client's shared memory over "
                    f"its limit of {self.max_client_bytes:,} bytes (--shm-max-mb)")
            held[1] += size

    def usage(self) -> tuple[int, int, int]:
        """``(client processes, sessions, bytes of shared memory)`` held now."""
        with self._lock:
            held = list(self._clients.values())
        return len(held), sum(h[0] for h in held), sum(h[1] for h in held)

    def unreserve(self, pid: int, size: int) -> None:
        with self._lock:
            self._clients[pid][1] -= size

    def _ended(self, session: "FastPathSession") -> None:
        with self._lock:
            self._sessions.discard(session)
            held = self._clients[session.pid]
            held[0] -= 1
            if held == [0, 0]:
                del self._clients[session.pid]
