"""The client side of the same-host fast path.

A :class:`ShmSession` is one Unix-socket connection to the server's fast-path
listener, served by one server thread: one request in flight at a time
(threads of one client each use their own session, see
:mod:`millpond.remote.shm.transport`). Bulk data moves through segments:

* one push segment, the client's own sealed memfd, grown on demand: a push
  is one copy of the caller's arrays into it, then one small message;
* a pool of result segments, owned by the server and mapped here
  copy-on-write: a sample is gathered by the server straight into a free
  segment and handed out as numpy arrays over it, with no copy; a small
  result (at most ``COPY_OUT_BYTES``, such as a DQN learner's 32
  transitions) is copied out in one ``memcpy`` instead, and its segment is
  free again at once.

Sample results never change under the caller's feet: a result segment
returns to the pool only when every array viewing it has been garbage
collected (a weak reference to the arrays' common base). Results are writable;
writes stay private to this process, and a reused segment first drops any
privately written pages (``MADV_DONTNEED``), so it shows the server's new data.
Copying small results out spares each of them that call and the page faults
that follow it (about a fault per result page): cheaper than the copy up to
sizes well past ``COPY_OUT_BYTES``, kept small so that the copy comes from
the heap and costs no faults of its own.

No reply is trusted, yet a fast-path reply has little to lie with: the client
lays out every result itself, from its own request (rows, dtypes, shapes,
offsets; :mod:`millpond.remote.shm.protocol`), so no reply names an offset,
a size within a segment or a row count. What replies do carry is checked
before use, in :meth:`ShmSession._reply` (the one place), and one that
cannot be the answer raises :class:`~millpond.errors.ProtocolError`: a new
segment's id (an integer none of this session's segments has: a repeated id
would let the server write into a result the caller still holds) and its fd
(one sealed memfd of at least the size asked: the views over it never reach
past its end); which extras a sample wrote (exactly ``weights`` and
``indices`` for a prioritized buffer, none otherwise: more would lay views
past the space the client asked for); the counts a push or
``update_priorities`` answers (:mod:`millpond.remote.replies`).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from millpond.core.schema import Schema
from millpond.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ProtocolError,
    ServerUnavailableError,
    SharedMemoryError,
)
from millpond.remote import replies
from millpond.remote.shm import memfd, protocol

MIN_SEGMENT = 1 << 20
MAX_RESULT_SEGMENTS = 16
COPY_OUT_BYTES = 64 << 10  # results this small are copied out of their segment
_ALL_EXTRAS = list(protocol.SAMPLE_EXTRAS)  # what a prioritized buffer's sample writes


def _round_segment(size: int) -> int:
    """Segment sizes are powers of two from 1 MiB: few sizes, good reuse."""
    return max(MIN_SEGMENT, 1 << (size - 1).bit_length())


@dataclass
class _ResultSegment:
    id: int
    mm: mmap.mmap
    free: bool = True
    used: int = 0  # bytes from the start ever handed out: may hold private (written) pages
    _result: weakref.ref | None = None  # the base of the arrays handed out

    def take(self, size: int) -> np.ndarray:
        """The base array of a result's arrays: a copy of a small one (the segment is
        free again at once), else :meth:`hand_out`."""
        if size <= COPY_OUT_BYTES:
            base = np.frombuffer(self.mm, np.uint8, size).copy()
            self.free = True
            return base
        return self.hand_out(size)

    def hand_out(self, size: int) -> np.ndarray:
        """The base array of a result's arrays: the segment is free again once it is collected."""
        self.used = max(self.used, size)
        base = np.frombuffer(self.mm, np.uint8, size)
        self._result = weakref.ref(base, self._returned)
        return base

    def _returned(self, _: weakref.ref) -> None:
        # Runs in whichever thread drops the last array: a plain attribute store
        # (atomic under the GIL), never a lock the sampling thread may hold.
        self.free = True


class ShmSession:
    """One fast-path connection. Thread-safe (calls take turns); not usable across fork.

    ``deadline`` arguments are the seconds a whole call may take; ``timeout``
    arguments the seconds the server may wait for a rate limiter within it.
    A call that fails mid-way (its deadline passed, the connection was lost)
    marks the session :attr:`broken`: replies may be out of step, so it must
    be closed. ``served`` counts each op's successful requests. :attr:`idle_s`:
    the seconds without a request after which the server closes the session
    (its hello says; None if it does not).
    """

    def __init__(self, socket_name: str, server_uid: int, deadline: float,
                 served: Counter[str] | None = None, hello: dict[str, str] | None = None,
                 address: str = ""):
        self.address = address  # the server's, named in the errors of replies refused
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(deadline)
        self.deadline = deadline
        try:
            self._sock.connect("\0" + socket_name)
            _, uid, _ = struct.unpack("3i", self._sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid != server_uid:
                raise ConnectionRefusedError(f"fast-path socket is owned by uid {uid}")
            # The server closes connections from peers it does not admit, and
            # (authentication on) refuses a hello without a token or ticket it
            # knows: learn that now, not on the first push.
            protocol.send(self._sock, {"op": "hello", "version": protocol.VERSION, **(hello or {})})
            reply, fds = protocol.recv(self._sock)
            protocol.close_fds(fds)
            if not reply or not reply.get("ok"):
                raise ConnectionRefusedError("the server did not admit this client: "
                                             + str((reply or {}).get("message", "connection closed")))
        except OSError:
            self._sock.close()
            raise
        idle_s = reply.get("idle_s")
        self.idle_s = (float(idle_s) if isinstance(idle_s, (int, float))
                       and not isinstance(idle_s, bool) and idle_s > 0 else None)
        self.last_used = time.monotonic()  # when the last reply came
        self._lock = threading.Lock()
        self.broken = False  # a request failed mid-way: replies may be out of step
        self.lost = False  # the connection is gone (the server died or restarted)
        self._push_segment: tuple[int, mmap.mmap] | None = None
        self._results: list[_ResultSegment] = []
        self.served: Counter[str] = Counter() if served is None else served

    def expiring(self) -> bool:
        """Whether the server may close this session for idleness before a request sent
        now reaches it: idle for half the server's ``--shm-idle-s`` (a margin that no
        request's trip comes near)."""
        return self.idle_s is not None and time.monotonic() - self.last_used > self.idle_s / 2

    def _set_deadline(self, deadline: float) -> None:
        if deadline != self.deadline:
            self._sock.settimeout(deadline)
            self.deadline = deadline

    def _request(self, message: dict[str, Any], fds: tuple[int, ...] = ()) -> tuple[dict, list[int]]:
        if self.broken:
            raise ServerUnavailableError("fast-path session is broken")
        try:
            protocol.send(self._sock, message, fds)
        except OSError as exc:  # never delivered: the call may go another way
            self.broken = self.lost = True
            raise SharedMemoryError(f"fast-path connection lost before the request: {exc}") from exc
        try:
            reply, reply_fds = protocol.recv(self._sock, protocol.CLIENT_SPIN)
        except TimeoutError as exc:
            self.broken = True
            raise DeadlineExceededError(f"fast-path {message.get('op')} timed out") from exc
        except OSError as exc:
            self.broken = self.lost = True
            raise ServerUnavailableError(f"fast-path connection lost: {exc}") from exc
        if reply is None:
            self.broken = self.lost = True
            raise ServerUnavailableError("fast-path connection closed by the server")
        self.last_used = time.monotonic()
        try:
            protocol.raise_for(reply)
        except BaseException:
            protocol.close_fds(reply_fds)
            raise
        self.served[message["op"]] += 1
        return reply, reply_fds

    # ---- push -----------------------------------------------------------------------

    def push_batch(self, buffer: str, schema: Schema, n: int, columns: dict[str, np.ndarray],
                   priorities: np.ndarray | None, timeout: float, deadline: float,
                   updates: list | None = None, capacity: int | None = None) -> None:
        """Copy validated columns ``[n, *shape]`` (and priorities) into the push segment; store them.

        ``priorities``: float64[n], after the columns in the segment.
        ``updates``: checked episode updates, applied with the records.
        ``capacity``: the buffer's, to check the reply against.
        """
        spans, total = protocol.layout(schema, n)
        size = total + (0 if priorities is None else n * protocol.PRIORITY_DTYPE.itemsize)
        with self._lock:
            self._set_deadline(deadline)
            segment, mm = self._push_segment_for(size)
            described = []
            for f in schema:
                offset, nbytes = spans[f.name]
                if nbytes:
                    target = np.frombuffer(mm, f.dtype, n * f.size, offset).reshape((n, *f.shape))
                    np.copyto(target, columns[f.name], casting="no")
                described.append([f.name, offset, f.dtype.str, [n, *f.shape]])
            message = {"op": "push", "buffer": buffer, "segment": segment, "n": n,
                       "columns": described, "timeout": timeout}
            if updates:
                message["updates"] = protocol.encode_updates(updates)
            if priorities is not None:
                message["priorities"] = _write_vector(mm, total, priorities,
                                                      protocol.PRIORITY_DTYPE)
            reply, _ = self._request(message)
            self._reply(reply, "push", n=n, capacity=capacity)

    # ---- priorities -----------------------------------------------------------------

    def update_priorities(self, buffer: str, indices: np.ndarray, priorities: np.ndarray,
                          deadline: float) -> int:
        """Send int64 ``indices`` and float64 ``priorities`` through the push segment."""
        n = len(indices)
        start = n * protocol.INDEX_DTYPE.itemsize  # both 8-byte items: aligned back to back
        with self._lock:
            self._set_deadline(deadline)
            segment, mm = self._push_segment_for(start + n * protocol.PRIORITY_DTYPE.itemsize)
            reply, _ = self._request({
                "op": "update_priorities", "buffer": buffer, "segment": segment, "n": n,
                "indices": _write_vector(mm, 0, indices, protocol.INDEX_DTYPE),
                "priorities": _write_vector(mm, start, priorities, protocol.PRIORITY_DTYPE),
            })
        return self._reply(reply, "update_priorities", n=n)

    def set_beta(self, buffer: str, beta: float, deadline: float) -> None:
        with self._lock:
            self._set_deadline(deadline)
            self._request({"op": "set_beta", "buffer": buffer, "beta": beta})

    def _push_segment_for(self, size: int) -> tuple[int, mmap.mmap]:
        if self._push_segment is not None and len(self._push_segment[1]) >= size:
            return self._push_segment
        if self._push_segment is not None:
            old, mm = self._push_segment
            self._push_segment = None
            _close_quietly(mm)
            self._request({"op": "release", "segment": old})
        size = _round_segment(size)
        fd = memfd.create_segment(size, "millpond-push")
        try:
            mm = memfd.map_segment(fd, size, writable=True)
            reply, _ = self._request({"op": "push_segment", "size": size}, (fd,))
        finally:
            os.close(fd)
        self._push_segment = (self._reply(reply, "push_segment"), mm)
        return self._push_segment

    # ---- sample ---------------------------------------------------------------------

    def sample(self, buffer: str, schema: Schema, batch_size: int, seed: int | None,
               extras: bool, timeout: float, deadline: float,
               filter_meta: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Sample into a free result segment; return arrays viewing it (no copy).

        ``extras``: leave room for the extra keys of a prioritized buffer
        (``weights``, ``indices``) after the columns; they are returned if the
        server wrote them. ``filter_meta``: checked meta values (episodic buffers).
        """
        size = protocol.sample_layout(schema, batch_size, extras)[2]
        message = {"op": "sample", "buffer": buffer, "offset": 0, "batch_size": batch_size,
                   "seed": seed, "timeout": timeout}
        if filter_meta:
            message["filter_meta"] = protocol.encode_filter(filter_meta)
        with self._lock:
            self._set_deadline(deadline)
            segment = self._free_result_segment(size)
            message["segment"] = segment.id
            try:
                reply, _ = self._request(message)
            except BaseException:
                segment.free = True
                raise
        # Laid out as the server did it (it checked that this fits the segment).
        written = self._reply(reply, "sample", extras=extras)
        spans, extra_spans, total = protocol.sample_layout(schema, batch_size, bool(written))
        base = segment.take(total)
        result = {f.name: np.ndarray((batch_size, *f.shape), f.dtype, base, spans[f.name][0])
                  for f in schema}
        for name in written:
            result[name] = np.ndarray(batch_size, protocol.SAMPLE_EXTRAS[name], base,
                                      extra_spans[name][0])
        return result

    # ---- episodic samples and reads: results of shapes known before the call ---------

    def into_result(self, message: dict[str, Any], specs: protocol.Specs, deadline: float
                    ) -> dict[str, np.ndarray]:
        """Send ``message``; the server writes the arrays of ``specs`` into a free result
        segment (laid out by :func:`protocol.spec_layout`); return arrays viewing it."""
        with self._lock:
            self._set_deadline(deadline)
            return self._into_result(message, specs)

    def read(self, buffer: str, seqs: np.ndarray, names: list[str] | None,
             specs: protocol.Specs, deadline: float, flags: dict[str, bool] | None = None
             ) -> dict[str, np.ndarray]:
        """Records by index: ``seqs`` travel through the push segment. ``flags``:
        ``positions``, ``episode_ids`` (see the engine's ``read``)."""
        with self._lock:
            self._set_deadline(deadline)
            segment, mm = self._push_segment_for(max(1, len(seqs)) * protocol.INDEX_DTYPE.itemsize)
            seqs_entry = _write_vector(mm, 0, seqs, protocol.INDEX_DTYPE)
            return self._into_result({"op": "read", "buffer": buffer, "push_segment": segment,
                                      "seqs": seqs_entry, "n": len(seqs), "fields": names,
                                      **(flags or {})}, specs)

    def _into_result(self, message: dict[str, Any], specs: protocol.Specs
                     ) -> dict[str, np.ndarray]:
        _, size = protocol.spec_layout(specs)
        segment = self._free_result_segment(size)
        try:
            self._request({**message, "segment": segment.id, "offset": 0})
        except BaseException:
            segment.free = True
            raise
        base = segment.take(size)
        return protocol.spec_views(base, 0, specs)

    def _free_result_segment(self, size: int) -> _ResultSegment:
        fitting = [s for s in self._results if s.free and len(s.mm) >= size]
        if fitting:
            segment = min(fitting, key=lambda s: len(s.mm))
            if segment.used:  # forget pages a previous holder wrote privately
                # (only those handed out: a small result of a big segment costs little)
                segment.mm.madvise(mmap.MADV_DONTNEED, 0, segment.used)
                segment.used = 0
        else:
            segment = self._new_result_segment(_round_segment(size))
        segment.free = False
        return segment

    def _new_result_segment(self, size: int) -> _ResultSegment:
        if len(self._results) >= MAX_RESULT_SEGMENTS:
            # Every segment is still referenced by live results: drop the
            # smallest free one if any, else refuse (the caller falls back).
            free = [s for s in self._results if s.free]
            if not free:
                raise ResultPoolExhausted(
                    f"{MAX_RESULT_SEGMENTS} earlier sample results are still alive"
                )
            victim = min(free, key=lambda s: len(s.mm))
            self._results.remove(victim)
            self._request({"op": "release", "segment": victim.id})
        reply, fds = self._request({"op": "result_segment", "size": size})
        try:
            segment_id = self._reply(reply, "result_segment", fds=fds, size=size)
            mm = mmap.mmap(fds[0], size, access=mmap.ACCESS_COPY)
        finally:
            protocol.close_fds(fds)
        segment = _ResultSegment(segment_id, mm)
        self._results.append(segment)
        return segment

    # ---- replies: what each may be (see the module docstring) -------------------------

    def _reply(self, reply: dict[str, Any], op: str, n: int = 0, capacity: int | None = None,
               extras: bool = False, fds: list[int] | None = None, size: int = 0) -> Any:
        """What the successful ``reply`` to ``op`` says, if it is possible; else
        ProtocolError. ``push``: its ``pushed`` (``n`` records into a buffer of
        ``capacity``); ``update_priorities``: how many of ``n`` were live; ``sample``:
        the extras written (``extras``: a prioritized buffer's, all of them; else
        none); ``push_segment`` and ``result_segment``: the new segment's id (one
        this session's segments do not have), the latter's ``fds`` one sealed memfd
        of at least ``size`` bytes. A session that got a reply refused is
        :attr:`broken` (closed after the call, the server's state with it)."""
        try:
            return self._possible(reply, op, n, capacity, extras, fds, size)
        except ProtocolError:
            self.broken = True
            raise

    def _possible(self, reply: dict[str, Any], op: str, n: int, capacity: int | None,
                  extras: bool, fds: list[int] | None, size: int) -> Any:
        what = f"fast-path {op}"
        if op == "push":
            return replies.pushed(reply.get("size"), reply.get("pushed"), n, capacity, None,
                                  self.address)
        if op == "update_priorities":
            return replies.count(reply.get("updated"), n, self.address,
                                 f"{what} of {n:,} records")
        if op == "sample":
            written = reply.get("extras") or []
            if written != (_ALL_EXTRAS if extras else []):
                raise replies.refused(self.address, what, f"extras {written!r} written, for a "
                                      f"{'' if extras else 'non-'}prioritized buffer")
            return written
        segment = reply.get("segment")
        taken = {s.id for s in self._results}
        if self._push_segment is not None:
            taken.add(self._push_segment[0])
        if not isinstance(segment, int) or isinstance(segment, bool) or segment in taken:
            raise replies.refused(self.address, what, f"segment id {segment!r} (this "
                                  f"session's segments are {sorted(taken)})")
        if op == "result_segment":
            assert fds is not None
            if len(fds) != 1:
                raise replies.refused(self.address, what, f"{len(fds)} fds, not 1")
            try:
                memfd.check_segment(fds[0], size)
            except InvalidArgumentError as exc:
                raise replies.refused(self.address, what, f"an fd that is not the segment "
                                      f"asked for: {exc}") from None
        return segment

    def close(self) -> None:
        """Close the connection; arrays already handed out stay valid."""
        with self._lock:
            if self._push_segment is not None:
                _close_quietly(self._push_segment[1])
                self._push_segment = None
            self._results.clear()  # maps close when their last array goes
            self._sock.close()


class ResultPoolExhausted(Exception):
    """Too many live sample results to give another one its own segment."""


def _write_vector(mm: mmap.mmap, offset: int, values: np.ndarray, dtype: np.dtype) -> list:
    """Copy ``values`` into ``mm`` at ``offset``; return its ``[offset, dtype, [n]]`` entry."""
    np.copyto(np.frombuffer(mm, dtype, len(values), offset), values, casting="no")
    return [offset, dtype.str, [len(values)]]


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view (e.g. in a traceback) is still alive: the map goes when it does
