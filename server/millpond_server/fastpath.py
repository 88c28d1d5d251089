"""The server side of the same-host fast path (see :mod:`millpond.shm`).

A listener thread accepts connections on an abstract Unix socket and admits
only peers of the server's user (or of a configured group), checked with
``SO_PEERCRED``. Each admitted client gets a session thread that serves its
requests straight against the registry's buffers: no event loop hop, no
gRPC, no serialization of bulk data.

Nothing from a client is trusted: every segment fd must be a sealed memfd of
the announced size, every offset and shape is checked against the segment
and the schema before a view is made, unexpected fds are closed, and bad
requests get an error reply while the session and the server keep serving.
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

from millpond.core.buffer import abandon_waits_when, check_batch_size, check_seed, check_timeout
from millpond.core.prioritized import PrioritizedTieredBuffer, as_prioritized
from millpond.errors import (
    InternalError,
    InvalidArgumentError,
    InvalidConfigError,
    ReplayError,
    SharedMemoryError,
    StorageIOError,
)
from millpond.shm import memfd, protocol

from .fatal import fatal_storage_error
from .registry import Registry

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
    """Listens on ``\\0<socket_name>``; one :class:`Session` thread per client."""

    def __init__(self, registry: Registry, allowed_gids: frozenset[int] = frozenset(),
                 max_session_bytes: int = 8 << 30):
        self.registry = registry
        self.allowed_gids = allowed_gids
        self.max_session_bytes = max_session_bytes
        self.socket_name = f"millpond-{os.getpid()}-{uuid.uuid4().hex}"
        self.uid = os.getuid()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind("\0" + self.socket_name)
        self._listener.listen(128)
        self._sessions: set[Session] = set()
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
            session = Session(self, conn, pid)
            with self._lock:
                self._sessions.add(session)
            session.start()

    def _ended(self, session: "Session") -> None:
        with self._lock:
            self._sessions.discard(session)


class Session(threading.Thread):
    """Serves one client's requests in order until it disconnects."""

    def __init__(self, server: FastPathServer, conn: socket.socket, pid: int):
        super().__init__(name=f"millpond-shm-{pid}", daemon=True)
        self.server = server
        self.conn = conn
        self.pid = pid
        self.push_segments: dict[int, mmap.mmap] = {}
        self.result_segments: dict[int, mmap.mmap] = {}
        self.reserved = 0
        self._next_id = 0
        # (segment, offset, batch_size, buffer) -> the views a sample gathers into
        self._sample_views: dict[tuple, dict[str, np.ndarray]] = {}
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
        # This thread serves only this client: any call of its that waits for
        # a rate limiter gives up when the client hangs up.
        with abandon_waits_when(self.peer_gone):
            while True:
                try:
                    message, fds = protocol.recv(self.conn, protocol.SERVER_SPIN)
                except ReplayError as exc:  # malformed message: say so, keep serving
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
        try:
            handler = self._handlers.get(message.get("op"))
            if handler is None:
                raise InvalidArgumentError(f"unknown fast-path op {message.get('op')!r}")
            return handler(message, fds)
        except StorageIOError as exc:
            fatal_storage_error(exc)
        except ReplayError as exc:
            return protocol.error_reply(exc), []
        except Exception as exc:  # a bug, not the client's fault: report, keep serving
            log.exception("fast-path request failed", extra={"kv": {"op": message.get("op")}})
            return protocol.error_reply(InternalError(f"{type(exc).__name__}: {exc}")), []
        finally:
            protocol.close_fds(fds)

    def peer_gone(self) -> bool:
        """Whether the client hung up (it sends nothing while its call waits)."""
        poller = select.poll()
        poller.register(self.conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def hello(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        self._no_fds(fds)
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
        memfd.check_segment(fds[0], size)
        self.push_segments[segment] = memfd.map_segment(fds[0], size, writable=False)
        self.reserved += size
        return {"ok": True, "segment": segment}, []

    def new_result_segment(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        self._no_fds(fds)
        size = message.get("size")
        segment = self._reserve(size)
        fd = memfd.create_segment(size, f"millpond-result-{self.pid}")
        try:
            self.result_segments[segment] = memfd.map_segment(fd, size, writable=True)
            readonly = memfd.reopen_readonly(fd)
        finally:
            os.close(fd)
        self.reserved += size
        return {"ok": True, "segment": segment}, [readonly]

    def release(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        self._no_fds(fds)
        segment = message.get("segment")
        for table in (self.push_segments, self.result_segments):
            if segment in table:
                self._sample_views = {k: v for k, v in self._sample_views.items() if k[0] != segment}
                mm = table.pop(segment)
                self.reserved -= len(mm)
                _close_map(mm)
                return {"ok": True}, []
        raise InvalidArgumentError(f"no segment {segment!r} in this session")

    # ---- data -----------------------------------------------------------------------

    def push(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        self._no_fds(fds)
        buffer = self._buffer(message)
        mm = self._segment(self.push_segments, message.get("segment"))
        n = _count(message)
        columns = message.get("columns")
        if not isinstance(columns, list):
            raise InvalidArgumentError("columns must be a list of [name, offset, dtype, shape]")
        views = {}
        for entry in columns:
            name, array = self._column_view(mm, buffer.schema, entry, n)
            views[name] = array
        if "priorities" in message:  # values checked by the engine, as over gRPC
            prioritized = as_prioritized(buffer)
            priorities = self._vector(mm, message["priorities"], protocol.PRIORITY_DTYPE, n,
                                      "priorities")
            prioritized.push_batch(views, priorities, timeout=_wait(message))
        else:  # checks the field set; copies the views once
            buffer.push_batch(views, timeout=_wait(message))
        return {"ok": True, "size": len(buffer), "pushed": buffer.pushed}, []

    def update_priorities(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        self._no_fds(fds)
        buffer = as_prioritized(self._buffer(message))
        mm = self._segment(self.push_segments, message.get("segment"))
        n = _count(message)
        indices = self._vector(mm, message.get("indices"), protocol.INDEX_DTYPE, n, "indices")
        priorities = self._vector(mm, message.get("priorities"), protocol.PRIORITY_DTYPE, n,
                                  "priorities")
        return {"ok": True, "updated": buffer.update_priorities(indices, priorities)}, []

    def set_beta(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        self._no_fds(fds)
        buffer = as_prioritized(self._buffer(message))
        beta = message.get("beta")
        if not isinstance(beta, float):  # the client sends floats; the engine checks the range
            raise InvalidConfigError(f"beta must be a finite number >= 0, got {beta!r}")
        buffer.set_beta(beta)
        return {"ok": True}, []

    @staticmethod
    def _vector(mm: mmap.mmap, entry: Any, dtype: np.dtype, n: int, what: str) -> np.ndarray:
        """A copy of the ``[offset, dtype, [n]]`` vector in a client's segment.

        A copy, not a view: the client can still write its segment, and the
        engine must not see values change after it checked them.
        """
        if not (isinstance(entry, list) and len(entry) == 3):
            raise InvalidArgumentError(f"{what} must be [offset, dtype, [n]]")
        offset, dtype_str, shape = entry
        if dtype_str != dtype.str or shape != [n]:
            raise InvalidArgumentError(f"{what}: expected {dtype.str}{[n]}, got {dtype_str}{shape}")
        nbytes = n * dtype.itemsize
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 \
                or offset % dtype.itemsize or offset + nbytes > len(mm):
            raise InvalidArgumentError(
                f"{what}: {nbytes:,} bytes at offset {offset!r} do not fit the "
                f"{len(mm):,}-byte segment"
            )
        return np.frombuffer(mm, dtype, n, offset).copy()

    def _column_view(self, mm: mmap.mmap, schema, entry: Any, n: int) -> tuple[str, np.ndarray]:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise InvalidArgumentError("each column must be [name, offset, dtype, shape]")
        name, offset, dtype, shape = entry
        try:
            field = schema[name]
        except (KeyError, TypeError):
            raise InvalidArgumentError(f"unknown field {name!r}") from None
        if dtype != field.dtype.str or shape != [n, *field.shape]:
            raise InvalidArgumentError(
                f"field {name!r}: expected {field.dtype.str}{[n, *field.shape]}, got {dtype}{shape}"
            )
        nbytes = n * field.nbytes
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 \
                or offset % field.dtype.itemsize or offset + nbytes > len(mm):
            raise InvalidArgumentError(
                f"field {name!r}: {nbytes:,} bytes at offset {offset!r} do not fit the "
                f"{len(mm):,}-byte segment"
            )
        array = np.frombuffer(mm, field.dtype, n * field.size, offset)
        return name, array.reshape((n, *field.shape))

    def sample(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        self._no_fds(fds)
        buffer = self._buffer(message)
        mm = self._segment(self.result_segments, message.get("segment"))
        batch_size = check_batch_size(message.get("batch_size"))
        seed = check_seed(message.get("seed"))
        offset = message.get("offset")
        prioritized = isinstance(buffer, PrioritizedTieredBuffer)
        spans, extra_spans, total = protocol.sample_layout(buffer.schema, batch_size, prioritized)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 \
                or offset % protocol.ALIGN or offset + total > len(mm):
            raise InvalidArgumentError(
                f"a sample of {total:,} bytes at offset {offset!r} does not fit the "
                f"{len(mm):,}-byte segment"
            )
        key = (message["segment"], offset, batch_size, buffer)
        views = self._sample_views.get(key)
        if views is None:  # learners repeat the same request shape: build views once
            if len(self._sample_views) >= 64:
                self._sample_views.clear()
            views = self._sample_views[key] = (
                {f.name: np.frombuffer(mm, f.dtype, batch_size * f.size, offset + spans[f.name][0])
                 .reshape((batch_size, *f.shape))
                 for f in buffer.schema},
                {name: np.frombuffer(mm, protocol.SAMPLE_EXTRAS[name], batch_size, offset + start)
                 for name, (start, _) in extra_spans.items()},
            )
        out, extras = views
        result = buffer.sample(batch_size, seed, out=out, timeout=_wait(message))
        # Weights and indices are small new arrays: one copy each into the segment.
        written = [name for name in extras if name in result]
        for name in written:
            np.copyto(extras[name], result[name], casting="no")
        return {"ok": True, "extras": written}, []

    # ---- helpers --------------------------------------------------------------------

    def _buffer(self, message: dict):
        name = message.get("buffer")
        if not isinstance(name, str):
            raise InvalidArgumentError(f"buffer must be a name, got {name!r}")
        return self.server.registry.get(name)

    @staticmethod
    def _no_fds(fds: list[int]) -> None:
        if fds:
            raise InvalidArgumentError("this request takes no fds")

    @staticmethod
    def _segment(table: dict[int, mmap.mmap], segment: Any) -> mmap.mmap:
        try:
            return table[segment]
        except (KeyError, TypeError):
            raise InvalidArgumentError(f"no such segment {segment!r} in this session") from None

    def shutdown(self) -> None:
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cleanup(self) -> None:
        self._sample_views.clear()
        for table in (self.push_segments, self.result_segments):
            for mm in table.values():
                _close_map(mm)
            table.clear()
        self.conn.close()
        self.server._ended(self)


def _count(message: dict) -> int:
    """The request's record count ``n``, checked."""
    n = message.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidArgumentError(f"n must be a non-negative integer, got {n!r}")
    return n


def _wait(message: dict) -> float:
    """How long the call may wait for a rate limiter: the client's ``timeout`` (0 if absent)."""
    return check_timeout(message.get("timeout", 0))


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive somewhere; the map goes when it does
