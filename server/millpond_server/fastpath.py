"""The sessions of the same-host fast path (see :mod:`millpond.remote.shm`).

Each connection the listener (:mod:`.shm_listener`) admits gets a session
thread that decodes its requests and calls the operations layer
(:mod:`.operations`) directly: no event loop hop, no gRPC, no serialization of bulk data. A call
that must wait for a rate limiter waits on the operations layer's loop, like
a gRPC call, and ends early if the client hangs up.

A session is closed, and its segments released, when it has not completed a
successful hello within ``--shm-hello-s`` of being accepted, or has had no
request for ``--shm-idle-s`` (the hello's reply tells the client this, so
that it opens a fresh session rather than race the close).

Nothing from a client is trusted: every segment fd must be a sealed memfd of
the announced size, every offset and shape is checked against the segment
and the schema before a view is made (:mod:`.shm_requests`), unexpected fds
are closed, and bad requests get an error reply while the session and the
server keep serving.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from millpond.core import TieredBuffer
from millpond.core.checks import check_batch_size, check_count, check_seed, check_timeout
from millpond.core.episode_checks import MAX_WINDOW, check_fields, check_n_step
from millpond.core.episodes import with_episode_column
from millpond.core.sequences import n_step_specs, read_specs, sequence_specs
from millpond.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    MessageTooLargeError,
    ServerUnavailableError,
    SharedMemoryError,
)
from millpond.remote.shm import memfd, protocol
from millpond.wire.status import status_for

from . import shm_requests as req

T = TypeVar("T")

if TYPE_CHECKING:
    from .shm_listener import FastPathServer

log = logging.getLogger("millpond.fastpath")

MAX_SEGMENTS = 64  # per session


class FastPathSession(threading.Thread):
    """Serves one client connection's requests in order until it disconnects."""

    def __init__(self, server: "FastPathServer", conn: socket.socket, pid: int, uid: int):
        super().__init__(name=f"millpond-shm-{pid}", daemon=True)
        self.server = server
        self.ops = server.ops
        self.conn = conn
        self.pid = pid
        self.uid = uid
        # Authentication on: none until a hello presents a token or ticket (admin when off).
        self.role: str | None = self.ops.auth.session_role()
        self.greeted = False  # a hello succeeded
        self.push_segments: dict[int, mmap.mmap] = {}
        self.result_segments: dict[int, mmap.mmap] = {}
        self._next_id = 0
        # (segment, offset, batch_size, buffer name, schema) -> the views a sample gathers into
        self._sample_views: dict[tuple, tuple[dict, dict]] = {}
        self._handlers = {
            "hello": self.hello,
            "push_segment": self.attach_push_segment,
            "push": self.push,
            "result_segment": self.new_result_segment,
            "sample": self.sample,
            "sample_sequences": self.sample_episodic,
            "sample_n_step": self.sample_episodic,
            "read": self.read,
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
        limits = self.server.limits
        hello_by = time.monotonic() + limits.hello_s
        spin, replied = protocol.SERVER_SPIN, time.perf_counter()
        while True:
            # The socket's timeout bounds the wait for the next request, and a reply's
            # send to a client that reads none.
            timeout = limits.idle_s if self.greeted else hello_by - time.monotonic()
            if timeout != self.conn.gettimeout():
                self.conn.settimeout(max(timeout, 1e-3))
            try:
                message, fds = protocol.recv(self.conn, spin)
            except TimeoutError:
                why = (f"no request for {limits.idle_s:g} s (--shm-idle-s)" if self.greeted else
                       f"no successful hello within {limits.hello_s:g} s (--shm-hello-s)")
                # Debug: per session, and the client replaces it unnoticed at its next call.
                log.debug("fast-path session closed", extra={"kv": {"pid": self.pid, "why": why}})
                return
            except InvalidArgumentError as exc:  # malformed message: say so, keep serving
                protocol.send(self.conn, protocol.error_reply(exc))
                continue
            if message is None:
                return
            spin = next_spin(time.perf_counter() - replied)
            reply, out_fds = self.handle(message, fds)
            try:
                protocol.send(self.conn, reply, out_fds)
            finally:
                protocol.close_fds(out_fds)
            replied = time.perf_counter()

    def handle(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """Run one request; fds that arrived with it are always closed here."""
        op = message.get("op")
        observer, start, code = self.ops.observer, time.perf_counter(), "OK"
        try:
            handler = self._handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise InvalidArgumentError(f"unknown fast-path op {op!r}")
            if op != "hello":
                self.ops.auth.check_op(self.role, str(op))  # the roles of the RPC it mirrors
                self.ops.check_ready()
            return handler(message, fds)
        except Exception as exc:
            error = self.ops.classify(exc, f"shm {op}")
            code = status_for(error)[0].name
            # Its traceback's frames hold segment views: a cycle (frame, error, traceback)
            # would keep a segment mapped after its session ends, until the next GC.
            exc.__traceback__ = None
            return protocol.error_reply(error), []
        finally:
            protocol.close_fds(fds)
            if observer is not None:  # the metrics
                name = message.get("buffer")
                observer.call("shm", str(op), code, time.perf_counter() - start,
                              name if isinstance(name, str) else None)

    def peer_gone(self) -> bool:
        """Whether the client hung up (it sends nothing while its call waits)."""
        poller = select.poll()
        poller.register(self.conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def _admit(self, message: dict, buffer: TieredBuffer, fn: Callable[..., T], *args: Any) -> T:
        """Run an operation on ``buffer`` here, in its owner's order; one that would wait
        for the rate limiter is parked up to the request's timeout."""
        budget = check_timeout(message.get("timeout", 0))
        return self.ops.owner(buffer).run_from_thread(budget, self.peer_gone, fn, *args)

    def hello(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        if message.get("version") != protocol.VERSION:
            raise InvalidArgumentError(
                f"fast-path protocol version {message.get('version')!r}; "
                f"this server speaks {protocol.VERSION}"
            )
        self.role = self.ops.auth.session_role()  # a failed hello leaves none
        self.role = self.ops.auth.hello_role(message)  # its token or Negotiate's ticket
        self.greeted = True
        return {"ok": True, "version": protocol.VERSION, "idle_s": self.server.limits.idle_s}, []

    # ---- segments -----------------------------------------------------------------

    def _add_segment(self, table: dict[int, mmap.mmap], size: Any,
                     make: Callable[[int], mmap.mmap]) -> int:
        """Check ``size`` against the limits, map a segment with ``make(size)`` and add it
        to ``table``; return its id. Nothing stays counted if mapping fails."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgumentError(f"segment size must be a positive integer, got {size!r}")
        if len(self.push_segments) + len(self.result_segments) >= MAX_SEGMENTS:
            raise SharedMemoryError(f"a fast-path session may hold at most {MAX_SEGMENTS} segments")
        self.server.reserve(self.pid, size)
        try:
            mm = make(size)
        except BaseException:
            self.server.unreserve(self.pid, size)
            raise
        self._next_id += 1
        table[self._next_id] = mm
        return self._next_id

    def attach_push_segment(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        if len(fds) != 1:
            raise InvalidArgumentError("push_segment needs exactly one fd")

        def attach(size: int) -> mmap.mmap:
            memfd.check_segment(fds[0], size)
            return memfd.map_segment(fds[0], size, writable=False)

        segment = self._add_segment(self.push_segments, message.get("size"), attach)
        return {"ok": True, "segment": segment}, []

    def new_result_segment(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        readonly: list[int] = []

        def create(size: int) -> mmap.mmap:
            fd = memfd.create_segment(size, f"millpond-result-{self.pid}")
            try:
                mm = memfd.map_segment(fd, size, writable=True)
                readonly.append(memfd.reopen_readonly(fd))
                return mm
            finally:
                os.close(fd)

        segment = self._add_segment(self.result_segments, message.get("size"), create)
        return {"ok": True, "segment": segment}, readonly

    def release(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        segment = message.get("segment")
        if not isinstance(segment, int) or isinstance(segment, bool):
            raise InvalidArgumentError(f"no segment {segment!r} in this session")
        for table in (self.push_segments, self.result_segments):
            if segment in table:
                self._sample_views = {k: v for k, v in self._sample_views.items()
                                      if k[0] != segment}
                mm = table.pop(segment)
                self.server.unreserve(self.pid, len(mm))
                req.close_map(mm)
                return {"ok": True}, []
        raise InvalidArgumentError(f"no segment {segment!r} in this session")

    # ---- data -----------------------------------------------------------------------

    def push(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        buffer = self.ops.registry.get(req.buffer_name(message))
        buffer.check_writable("push_batch")  # before its columns are checked: it is what is wrong
        config = buffer.config
        # An episodic push carries its records' episode ids in one more column.
        schema = with_episode_column(config.schema) if config.episodes else config.schema
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
        updates = message.get("updates")
        if updates is not None and not isinstance(updates, list):
            raise InvalidArgumentError("updates must be a list of [episode id, meta, end]")
        size, pushed = self._admit(message, buffer, self.ops.push_batch, buffer, views, priorities,
                                   updates)
        return {"ok": True, "size": size, "pushed": pushed}, []

    def update_priorities(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        self.ops.registry.get(req.buffer_name(message)).check_writable("update_priorities")
        mm = req.mapped(self.push_segments, message.get("segment"))
        n = req.record_count(message)
        # Copies: the engine must not see values change after it checked them.
        indices = req.vector(mm, message.get("indices"), protocol.INDEX_DTYPE, n, "indices").copy()
        priorities = req.vector(mm, message.get("priorities"), protocol.PRIORITY_DTYPE, n,
                             "priorities").copy()
        buffer = self.ops.registry.get(req.buffer_name(message))
        updated = self.ops.owner(buffer).run_here(buffer.update_priorities, indices, priorities)
        return {"ok": True, "updated": updated}, []

    def set_beta(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        req.no_fds(fds)
        beta = message.get("beta")
        if not isinstance(beta, float):  # the client sends floats; the engine checks the range
            raise InvalidConfigError(f"beta must be a finite number >= 0, got {beta!r}")
        buffer = self.ops.registry.get(req.buffer_name(message))
        self.ops.owner(buffer).run_here(buffer.set_beta, beta)
        return {"ok": True}, []

    def sample(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """A sample gathered into the client's result segment.

        Delivery, as over gRPC (see ``service.ReplayService.Sample``): the segment must
        hold the whole reply (columns, and a prioritized buffer's weights and indices)
        before anything is drawn, else MessageTooLargeError; a sample that consumes
        records (queue, stack, ``max_times_sampled``) also checks, under the buffer's
        lane just before the draw, that its client is still connected. Once drawn, the
        records are in the segment and the reply goes out on the socket: a client that
        hangs up (or stops waiting) after the draw has consumed them, delivered to no one.
        """
        req.no_fds(fds)
        name = req.buffer_name(message)
        buffer = self.ops.registry.get(name)
        mm = req.mapped(self.result_segments, message.get("segment"))
        batch_size = check_batch_size(message.get("batch_size"))
        seed = check_seed(message.get("seed"))
        offset = message.get("offset")
        extras = buffer.config.prioritized is not None
        spans, extra_spans, total = protocol.sample_layout(buffer.schema, batch_size, extras)
        _fits(mm, offset, total, "sample")
        key = (message["segment"], offset, batch_size, name, buffer.schema, extras)
        views = self._sample_views.get(key)
        if views is None:  # learners repeat the same request shape: build views once
            if len(self._sample_views) >= 64:
                self._sample_views.clear()
            views = self._sample_views[key] = (
                {f.name: np.ndarray((batch_size, *f.shape), f.dtype, mm, offset + spans[f.name][0])
                 for f in buffer.schema},
                {key: np.ndarray(batch_size, protocol.SAMPLE_EXTRAS[key], mm, offset + start)
                 for key, (start, _) in extra_spans.items()},
            )
        out, extra_views = views
        filter_meta = message.get("filter_meta")
        result = self._admit(message, buffer, self._delivering(buffer, self.ops.sample), buffer,
                             batch_size, seed, out, filter_meta)
        # Weights and indices are small new arrays: one copy each into the segment.
        written = [key for key in extra_views if key in result]
        for key in written:
            np.copyto(extra_views[key], result[key], casting="no")
        return {"ok": True, "extras": written}, []

    def sample_episodic(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """sample_sequences, sample_n_step: gathered into the client's result segment,
        laid out as the client expects (:mod:`millpond.core.sequences`'s specs), which
        must hold all of it before the draw; delivery as :meth:`sample`'s."""
        req.no_fds(fds)
        op = message["op"]
        buffer = self.ops.registry.get(req.buffer_name(message))
        config = buffer.config
        batch_size = check_batch_size(message.get("batch_size"))
        seed = check_seed(message.get("seed"))
        params: dict[str, Any]
        if op == "sample_sequences":
            params = {"seq_len": check_count("seq_len", message.get("seq_len"), MAX_WINDOW)}
            specs = sequence_specs(config, batch_size, params["seq_len"])
        else:
            n_step, gamma = check_n_step(config, message.get("n_step"), message.get("gamma"))
            params = {"n_step": n_step, "gamma": gamma}
            specs = n_step_specs(config, batch_size)
        out = self._result_views(message, specs)
        self._admit(message, buffer, self._delivering(buffer, self.ops.sample_episodic), buffer,
                    op, batch_size, seed, message.get("filter_meta"), params, out)
        return {"ok": True}, []

    def _delivering(self, buffer: TieredBuffer, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn``, or for a buffer whose samples consume records, ``fn`` run only while
        this session's client is still connected (checked under the buffer's lane, just
        before the draw: a sample parked for the rate limiter may run long after it was
        asked for); else ServerUnavailableError, nothing drawn."""
        config = buffer.config
        if not (config.removes or config.max_times_sampled):
            return fn

        def delivering(*args: Any) -> T:
            if self.peer_gone():
                raise ServerUnavailableError("the fast-path client hung up before its "
                                             "sample ran; nothing was drawn")
            return fn(*args)

        return delivering

    def read(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """Records by index: the seqs in the push segment, the records into a result one."""
        req.no_fds(fds)
        buffer = self.ops.registry.get(req.buffer_name(message))
        config = buffer.config
        n = req.record_count(message)
        mm = req.mapped(self.push_segments, message.get("push_segment"))
        seqs = req.vector(mm, message.get("seqs"), protocol.INDEX_DTYPE, n, "seqs").copy()
        names = check_fields(config, message.get("fields"))
        positions, episode_ids = (message.get(key, False) for key in ("positions", "episode_ids"))
        if not isinstance(positions, bool) or not isinstance(episode_ids, bool):
            raise InvalidArgumentError("positions and episode_ids must be true or false")
        out = self._result_views(message, read_specs(config, n, names, episode_ids))
        self.ops.owner(buffer).run_here(self.ops.read, buffer, seqs, names, out, positions,
                                        episode_ids)
        return {"ok": True}, []

    def _result_views(self, message: dict, specs: protocol.Specs) -> dict[str, np.ndarray]:
        """The arrays of ``specs`` in the request's result segment, bounds checked (built
        once per segment, offset and shapes: learners repeat their requests)."""
        key = (message.get("segment"), message.get("offset"), specs)
        views = self._sample_views.get(key)
        if views is None:
            mm = req.mapped(self.result_segments, key[0])
            _, total = protocol.spec_layout(specs)
            offset = _fits(mm, key[1], total, message["op"])
            if len(self._sample_views) >= 64:
                self._sample_views.clear()
            views = self._sample_views[key] = (protocol.spec_views(mm, offset, specs), {})
        return views[0]

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
                self.server.unreserve(self.pid, len(mm))
                req.close_map(mm)
            table.clear()
        self.conn.close()
        self.server._ended(self)


def next_spin(gap: float) -> float:
    """How long a session polls for its next request, given the ``gap`` (seconds) between
    its last reply and the request that followed it: ``SERVER_SPIN`` for a client that
    asks back to back (the gap, which includes a sleeping thread's wake-up of up to 100 us
    on virtual machines, within twice the spin), else nothing. A learner that trains
    between samples (a DQN step: a millisecond) never comes within the spin: polling for
    it only takes a CPU from it and from everything else on the machine."""
    spin = protocol.SERVER_SPIN
    return spin if gap <= 2 * spin else 0.0


def _fits(mm: mmap.mmap, offset: Any, nbytes: int, op: str) -> int:
    """``offset`` (a well-formed one: :func:`.shm_requests.check_span`) at which a reply of
    ``nbytes`` fits the result segment ``mm``; else MessageTooLargeError: the segment
    is the fast path's limit on a reply, checked before anything is drawn."""
    if isinstance(offset, int) and not isinstance(offset, bool) and 0 <= offset <= len(mm) \
            and offset % protocol.ALIGN == 0 and offset + nbytes > len(mm):
        raise MessageTooLargeError(
            f"{op}: its reply of {nbytes:,} bytes at offset {offset:,} does not fit the "
            f"{len(mm):,}-byte result segment; nothing was drawn")
    return req.check_span(mm, offset, nbytes, protocol.ALIGN, op)
