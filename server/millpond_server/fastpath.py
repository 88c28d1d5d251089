"""The server side of the same-host fast path (see :mod:`millpond.shm`).

A listener thread accepts connections on an abstract Unix socket and admits
only peers of the server's user (or of a configured group), checked with
``SO_PEERCRED``. Each admitted client connection gets a session thread that
decodes its requests and calls the operations layer (:mod:`.operations`)
directly: no event loop hop, no gRPC, no serialization of bulk data. A call
that must wait for a rate limiter waits on the operations layer's loop, like
a gRPC call, and ends early if the client hangs up.

Nothing from a client is trusted: every segment fd must be a sealed memfd of
the announced size, every offset and shape is checked against the segment
and the schema before a view is made (:func:`segment_view`), unexpected fds
are closed, and bad requests get an error reply while the session and the
server keep serving.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import struct
import threading
import uuid
from typing import Any

import numpy as np

from millpond.core.checks import check_batch_size, check_seed, check_timeout
from millpond.errors import InvalidArgumentError, InvalidConfigError, SharedMemoryError
from millpond.shm import memfd, protocol

from .operations import Operations
from . import shm_requests as req

log = logging.getLogger("millpond.fastpath")

MAX_SEGMENTS = 64  # per session


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def _peer_groups(pid: int, gid: int) -> set[int]:
    groups = {gid}
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
                 max_session_bytes: int = 8 << 30):
        self.ops = ops
        self.allowed_gids = allowed_gids
        self.max_session_bytes = max_session_bytes
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

    def admits(self, uid: int, pid: int, gid: int) -> bool:
        return uid == self.uid or bool(self.allowed_gids & _peer_groups(pid, gid))

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed by stop()
            pid, uid, gid = peer_credentials(conn)
            if not self.admits(uid, pid, gid):
                log.warning("shm peer refused", extra={"kv": {"pid": pid, "uid": uid}})
                conn.close()
                continue
            session = FastPathSession(self, conn, pid)
            with self._lock:
                self._sessions.add(session)
            session.start()

    def _ended(self, session: "FastPathSession") -> None:
        with self._lock:
            self._sessions.discard(session)


class FastPathSession(threading.Thread):
    """Serves one client connection's requests in order until it disconnects."""

    def __init__(self, server: FastPathServer, conn: socket.socket, pid: int):
        super().__init__(name=f"millpond-shm-{pid}", daemon=True)
        self.server = server
        self.ops = server.ops
        self.conn = conn
        self.pid = pid
        self.push_segments: dict[int, mmap.mmap] = {}
        self.result_segments: dict[int, mmap.mmap] = {}
        self.reserved = 0
        self._next_id = 0
        # (segment, offset, batch_size, buffer name, schema) -> the views a sample gathers into
        self._sample_views: dict[tuple, tuple[dict, dict]] = {}
        self._handlers = {
            "hello": self.hello,
            "push_segment": self.attach_push_segment,
            "push": self.push,
            "result_segment": self.new_result_segment,
            "sample": self.sample,
            "update_priorities": self.update_priorities,
            "set_beta": self.set_beta,
            "release": self.release,
        }

    def run(self) -> None:
        try:
            self._serve()
        except OSError:
            pass  # client went away (or shutdown): clean up below
        finally:
            self.cleanup()

    def _serve(self) -> None:
        while True:
            try:
                message, fds = protocol.recv(self.conn, protocol.SERVER_SPIN)
            except InvalidArgumentError as exc:  # malformed message: say so, keep serving
                protocol.send(self.conn, protocol.error_reply(exc))
                continue
            if message is None:
                return
            reply, out_fds = self.handle(message, fds)
            try:
                protocol.send(self.conn, reply, out_fds)
            finally:
                protocol.close_fds(out_fds)

    def handle(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """Run one request; fds that arrived with it are always closed here."""
        op = message.get("op")
        try:
            handler = self._handlers.get(op)  # type: ignore[arg-type]
            if handler is None:
                raise InvalidArgumentError(f"unknown fast-path op {op!r}")
            if op != "hello":
                self.ops.check_ready()
            return handler(message, fds)
        except Exception as exc:
            return protocol.error_reply(self.ops.classify(exc, f"shm {op}")), []
        finally:
            protocol.close_fds(fds)

    def peer_gone(self) -> bool:
        """Whether the client hung up (it sends nothing while its call waits)."""
        poller = select.poll()
        poller.register(self.conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def _admit(self, message: dict, fn, *args: Any) -> Any:
        """Run an operation that may wait for a rate limiter, up to the request's timeout."""
        budget = check_timeout(message.get("timeout", 0))
        return self.ops.admit_from_thread(budget, self.peer_gone, fn, *args)

    def hello(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        if message.get("version") != protocol.VERSION:
            raise InvalidArgumentError(
                f"fast-path protocol version {message.get('version')!r}; "
                f"this server speaks {protocol.VERSION}"
            )
        return {"ok": True, "version": protocol.VERSION}, []

    # ---- segments -----------------------------------------------------------------

    def _reserve(self, size: Any) -> int:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgumentError(f"segment size must be a positive integer, got {size!r}")
        if len(self.push_segments) + len(self.result_segments) >= MAX_SEGMENTS:
            raise SharedMemoryError(f"a fast-path session may hold at most {MAX_SEGMENTS} segments")
        if self.reserved + size > self.server.max_session_bytes:
            raise SharedMemoryError(
                f"segment of {size:,} bytes would exceed this session's shared-memory limit "
                f"of {self.server.max_session_bytes:,} bytes (--shm-max-mb)"
            )
        self._next_id += 1
        return self._next_id

    def attach_push_segment(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        if len(fds) != 1:
            raise InvalidArgumentError("push_segment needs exactly one fd")
        size = message.get("size")
        segment = self._reserve(size)
        assert isinstance(size, int)  # checked by _reserve
        memfd.check_segment(fds[0], size)
        self.push_segments[segment] = memfd.map_segment(fds[0], size, writable=False)
        self.reserved += size
        return {"ok": True, "segment": segment}, []

    def new_result_segment(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        size = message.get("size")
        segment = self._reserve(size)
        assert isinstance(size, int)  # checked by _reserve
        fd = memfd.create_segment(size, f"millpond-result-{self.pid}")
        try:
            self.result_segments[segment] = memfd.map_segment(fd, size, writable=True)
            readonly = memfd.reopen_readonly(fd)
        finally:
            os.close(fd)
        self.reserved += size
        return {"ok": True, "segment": segment}, [readonly]

    def release(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        segment = message.get("segment")
        for table in (self.push_segments, self.result_segments):
            if segment in table:
                self._sample_views = {k: v for k, v in self._sample_views.items()
                                      if k[0] != segment}
                mm = table.pop(segment)
                self.reserved -= len(mm)
                req.close_map(mm)
                return {"ok": True}, []
        raise InvalidArgumentError(f"no segment {segment!r} in this session")

    # ---- data -----------------------------------------------------------------------

    def push(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        name = req.buffer_name(message)
        schema = self.ops.registry.get(name).schema
        mm = req.mapped(self.push_segments, message.get("segment"))
        n = req.record_count(message)
        columns = message.get("columns")
        if not isinstance(columns, list):
            raise InvalidArgumentError("columns must be a list of [name, offset, dtype, shape]")
        views = dict(req.column_view(mm, schema, entry, n) for entry in columns)
        priorities = None
        if "priorities" in message:  # a copy: the client could still change them
            priorities = req.vector(mm, message["priorities"], protocol.PRIORITY_DTYPE, n,
                                 "priorities").copy()
        size, pushed = self._admit(message, self.ops.push_batch, name, views, priorities)
        return {"ok": True, "size": size, "pushed": pushed}, []

    def update_priorities(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        mm = req.mapped(self.push_segments, message.get("segment"))
        n = req.record_count(message)
        # Copies: the engine must not see values change after it checked them.
        indices = req.vector(mm, message.get("indices"), protocol.INDEX_DTYPE, n, "indices").copy()
        priorities = req.vector(mm, message.get("priorities"), protocol.PRIORITY_DTYPE, n,
                             "priorities").copy()
        updated = self.ops.update_priorities(req.buffer_name(message), indices, priorities)
        return {"ok": True, "updated": updated}, []

    def set_beta(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        beta = message.get("beta")
        if not isinstance(beta, float):  # the client sends floats; the engine checks the range
            raise InvalidConfigError(f"beta must be a finite number >= 0, got {beta!r}")
        self.ops.set_beta(req.buffer_name(message), beta)
        return {"ok": True}, []

    def sample(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        name = req.buffer_name(message)
        buffer = self.ops.registry.get(name)
        mm = req.mapped(self.result_segments, message.get("segment"))
        batch_size = check_batch_size(message.get("batch_size"))
        seed = check_seed(message.get("seed"))
        offset = message.get("offset")
        extras = buffer.config.prioritized is not None
        spans, extra_spans, total = protocol.sample_layout(buffer.schema, batch_size, extras)
        req.segment_view(mm, offset, np.dtype(np.uint8), total, "sample", protocol.ALIGN)
        key = (message["segment"], offset, batch_size, name, buffer.schema)
        views = self._sample_views.get(key)
        if views is None:  # learners repeat the same request shape: build views once
            if len(self._sample_views) >= 64:
                self._sample_views.clear()
            views = self._sample_views[key] = (
                {f.name: np.frombuffer(mm, f.dtype, batch_size * f.size, offset + spans[f.name][0])
                 .reshape((batch_size, *f.shape)) for f in buffer.schema},
                {key: np.frombuffer(mm, protocol.SAMPLE_EXTRAS[key], batch_size, offset + start)
                 for key, (start, _) in extra_spans.items()},
            )
        out, extra_views = views
        result = self._admit(message, self.ops.sample, name, batch_size, seed, out)
        # Weights and indices are small new arrays: one copy each into the segment.
        written = [key for key in extra_views if key in result]
        for key in written:
            np.copyto(extra_views[key], result[key], casting="no")
        return {"ok": True, "extras": written}, []

    # ---- lifecycle ------------------------------------------------------------------

    def shutdown(self) -> None:
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cleanup(self) -> None:
        self._sample_views.clear()
        for table in (self.push_segments, self.result_segments):
            for mm in table.values():
                req.close_map(mm)
            table.clear()
        self.conn.close()
        self.server._ended(self)
