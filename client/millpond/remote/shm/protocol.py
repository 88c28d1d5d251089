"""Messages of the same-host fast path.

One ``SOCK_SEQPACKET`` message per request and per reply (the socket keeps
message boundaries, so no framing). A message is a small JSON object, except
the two a learner sends and gets on every call (see "Binary messages"); file
descriptors travel beside it as ``SCM_RIGHTS`` ancillary data. Requests:

=====================  ===========================================  ======================
op                     fields                                       reply
=====================  ===========================================  ======================
``hello``              ``version``; ``token`` or ``ticket``         ``version``, ``idle_s``
                       (authentication on; with mTLS only a         (the server closes a
                       ``ticket``)                                  session idle this long)
``push_segment``       ``size`` (+ 1 fd: the client's sealed memfd)  ``segment``
``push``               ``buffer``, ``segment``, ``n``, ``columns``  ``size``, ``pushed``
                       (``[[name, offset, dtype, shape], ...]``),
                       optional ``priorities`` (``[offset, "<f8",
                       [n]]``: prioritized buffers)
``result_segment``     ``size``                                     ``segment`` (+ 1 fd, read-only)
``sample``             ``buffer``, ``segment``, ``offset``,         ``extras`` (columns, then
                       ``batch_size``, ``seed``                     extras: ``sample_layout``)
``update_priorities``  ``buffer``, ``segment``, ``n``, ``indices``  ``updated``
                       (``[offset, "<i8", [n]]``), ``priorities``
                       (``[offset, "<f8", [n]]``)
``set_beta``           ``buffer``, ``beta``                         -
``release``            ``segment``                                  -
=====================  ===========================================  ======================

Priorities and indices travel in the client's push segment, not in the JSON:
encoding floats as JSON costs about 1 us each (256 priorities: ~250 us, more
than the whole round trip), and 4,096 of them would not fit in one message.
A prioritized buffer's sample also writes its extra keys (``weights``,
``indices``) after the columns; the reply names the ones it wrote.

Every reply has ``ok``; a failed one carries ``code`` (a stable error code of
:mod:`millpond.errors`) and ``message`` instead, and the client raises the
same exception class as the in-process buffer would.

Binary messages: a ``sample`` request without ``filter_meta`` and the
successful reply to a sample travel as packed structs (:data:`SAMPLE_REQUEST`
then the buffer name in UTF-8; :data:`SAMPLE_REPLY`, one bit per written
extra), and so does a ``read`` request whose ``seqs`` start the push segment
(:data:`READ_REQUEST`, then the buffer name and, if ``fields`` names some,
each after a NUL: neither kind of name can hold one): the learner that reads
by position (the SB3 adapter draws its own indices, as SB3 does) sends one
on every step. Encoding and decoding them as JSON cost 15 us of a 90 us round
trip (measured with ``bench/bench.py``'s shared-memory p50): small in a hot
loop, but the JSON code runs cold between calls. Their first byte is never
``{``, so :func:`recv` tells the forms apart, and decodes both into the same
dicts: handlers see no difference. A request whose values do not fit the
struct (wrong types, out of range: a hostile or buggy peer) goes as JSON, to
be refused by the same checks.
"""

from __future__ import annotations

import array
import functools
import json
import math
import os
import socket
import struct
import time
from typing import Any, Sequence

import numpy as np

from millpond.core.schema import Schema
from millpond.errors import InvalidArgumentError, ReplayError, error_classes

# 2: priorities, update_priorities, set_beta and a sample's extras. A version
# 1 server would ignore a push's priorities: the hello refuses the mismatch
# and the client falls back to gRPC. 3: binary sample requests and replies.
# 4: binary read requests.
VERSION = 4
ALIGN = 64  # every column starts on a cache line
MAX_MESSAGE = 64 * 1024
MAX_FDS = 4
# How long each side polls before sleeping (see recv): the client while it
# waits for a reply, a server session while it waits for the next request.
CLIENT_SPIN = float(os.environ.get("MILLPOND_SHM_SPIN_US", "300")) * 1e-6
SERVER_SPIN = float(os.environ.get("MILLPOND_SHM_SERVER_SPIN_US", "100")) * 1e-6

_CLASSES = error_classes()
# The fast path is Linux-only (see facilities); elsewhere recv never spins.
_yield_cpu = getattr(os, "sched_yield", lambda: None)
# Made once: json.dumps with separators would build an encoder per message.
_encode = json.JSONEncoder(separators=(",", ":")).encode
_decode = json.JSONDecoder().decode
# Binary messages (see the module doc): tag, has a seed, then segment, offset,
# batch_size, seed (0 if none) and timeout; the buffer name follows.
SAMPLE_REQUEST = struct.Struct("<BB6xQQQQd")
SAMPLE_REPLY = struct.Struct("<BB")  # tag, bit i set: the i-th of SAMPLE_EXTRAS written
# tag, flags (_READ_FLAGS), then push_segment, n, segment and offset; the names follow.
READ_REQUEST = struct.Struct("<BB6xQQQQ")
_SAMPLE_REQUEST_TAG, _SAMPLE_REPLY_TAG, _READ_REQUEST_TAG = 1, 2, 3
_READ_FLAGS = ("positions", "episode_ids")  # bit i: the i-th is true; bit 2: fields follow
_READ_KEYS = {"op", "buffer", "push_segment", "seqs", "n", "fields", "positions", "episode_ids",
              "segment", "offset"}
_U64 = 1 << 64
_OK_JSON = _encode({"ok": True}).encode()  # the plain successful reply, made once


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@functools.lru_cache(maxsize=256)
def layout(schema: Schema, n: int) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each field's ``[n, *shape]`` block sits in a segment: ``({name: (offset, nbytes)}, total)``.

    Cached: callers must not modify the returned dict.
    """
    offsets, pos = {}, 0
    for f in schema:
        nbytes = n * f.nbytes
        offsets[f.name] = (pos, nbytes)
        pos = _align(pos + nbytes)
    return offsets, max(pos, ALIGN)


# A prioritized sample's extra keys, as the engine returns them, in segment order.
SAMPLE_EXTRAS: dict[str, np.dtype] = {"weights": np.dtype(np.float32), "indices": np.dtype(np.int64)}
PRIORITY_DTYPE = np.dtype(np.float64)
INDEX_DTYPE = np.dtype(np.int64)


@functools.lru_cache(maxsize=256)
def sample_layout(schema: Schema, n: int, extras: bool) -> tuple[dict, dict, int]:
    """:func:`layout`, then (if ``extras``) each of :data:`SAMPLE_EXTRAS` ``[n]``.

    Returns ``(column spans, extra spans, total)``; cached, do not modify.
    """
    spans, pos = layout(schema, n)
    extra_spans = {}
    if extras:
        for name, dtype in SAMPLE_EXTRAS.items():
            extra_spans[name] = (pos, n * dtype.itemsize)
            pos = _align(pos + n * dtype.itemsize)
    return spans, extra_spans, pos


Specs = tuple[tuple[str, np.dtype, tuple[int, ...]], ...]  # (name, dtype, shape) per array


@functools.lru_cache(maxsize=256)  # learners ask for the same shapes again and again
def spec_layout(specs: Specs) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each array of ``specs`` (name, dtype, shape) sits in a segment, in order:
    ``({name: (offset, nbytes)}, total)`` (episodic results, reads). Cached: do not
    modify the result."""
    offsets, pos = {}, 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        offsets[name] = (pos, nbytes)
        pos = _align(pos + nbytes)
    return offsets, max(pos, ALIGN)


def spec_views(mm: Any, offset: int, specs: Specs) -> dict[str, np.ndarray]:
    """Arrays over ``mm`` from ``offset`` laid out by :func:`spec_layout`."""
    spans, _ = spec_layout(specs)
    return {name: np.frombuffer(mm, dtype, math.prod(shape), offset + spans[name][0])
            .reshape(shape) for name, dtype, shape in specs}


def encode_filter(filter_meta: dict[str, np.ndarray] | None) -> dict[str, Any] | None:
    """Checked meta values as JSON (each a list, or a number)."""
    if not filter_meta:
        return None
    return {name: np.asarray(value).tolist() for name, value in filter_meta.items()}


def encode_updates(updates: Sequence[tuple[int, dict[str, np.ndarray], bool]]) -> list:
    """Checked episode updates as JSON: ``[[episode id, {meta field: value}, end], ...]``."""
    return [[episode, encode_filter(meta) or {}, end] for episode, meta, end in updates]


def read_boot_id() -> str:
    """This kernel boot's id: equal ids on both ends mean the same host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = encode(message)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary)


def recv(sock: socket.socket, spin: float = 0.0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it; ``(None, [])`` at end of stream.

    ``spin``: poll without sleeping for up to this many seconds before
    blocking. On virtual machines a sleeping thread can take 100+ us to wake
    (measured here: 150 us vs 15 us round trips), so a short spin where the
    reply or next request is expected soon buys most of the latency back.
    Between polls the spinning thread yields its CPU (``sched_yield``): when
    the peer that is about to answer waits for this very CPU (a busy machine,
    or the scheduler placing a woken thread beside its waker, as it does for
    Unix sockets), a plain spin would keep it off until the spin ends: a DQN
    learner's sample of 32 took 220 us instead of 100 us on a loaded 2-core
    machine. With the CPU otherwise idle the yield returns at once.

    Raises InvalidArgumentError for a truncated or malformed message; any fds
    that arrived are closed first, so a hostile peer cannot leak them into us.
    """
    space = socket.CMSG_SPACE(MAX_FDS * 4)
    received = None
    if spin > 0:
        # A socket with a timeout polls before every recv, even with
        # MSG_DONTWAIT: switch it to non-blocking for the spin.
        timeout = sock.gettimeout()
        sock.setblocking(False)
        try:
            deadline = time.perf_counter() + spin
            while received is None and time.perf_counter() < deadline:
                try:
                    received = sock.recvmsg(MAX_MESSAGE, space)
                except BlockingIOError:
                    _yield_cpu()
        finally:
            sock.settimeout(timeout)
    data, ancillary, flags, _ = received or sock.recvmsg(MAX_MESSAGE, space)
    fds = _fds(ancillary)
    if not data and not fds:
        return None, []
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise InvalidArgumentError("fast-path message or its fds were truncated")
        message = decode(data)
    except (ValueError, RecursionError, InvalidArgumentError) as exc:
        close_fds(fds)
        if isinstance(exc, InvalidArgumentError):
            raise
        raise InvalidArgumentError("fast-path message is malformed (not UTF-8 or JSON, or "
                                   "nested too deep)") from exc
    return message, fds


def encode(message: dict[str, Any]) -> bytes:
    """A message's bytes: binary for a sample request or reply that fits, else JSON."""
    if len(message) == 1 and message.get("ok") is True:  # a read's reply, a release's...
        return _OK_JSON
    op = message.get("op")
    if op == "sample":
        binary = _pack_sample_request(message)
        if binary is not None:
            return binary
    elif op == "read":
        binary = _pack_read_request(message)
        if binary is not None:
            return binary
    elif message.get("ok") is True and message.keys() == {"ok", "extras"}:
        binary = _pack_sample_reply(message["extras"])
        if binary is not None:
            return binary
    return _encode(message).encode()


def decode(data: bytes) -> dict[str, Any]:
    """The message :func:`encode` made; InvalidArgumentError (or ValueError) if malformed."""
    if data == _OK_JSON:
        return {"ok": True}
    tag = data[0] if data else None
    if tag == _SAMPLE_REQUEST_TAG:
        if len(data) < SAMPLE_REQUEST.size:
            raise InvalidArgumentError("fast-path sample request is truncated")
        _, has_seed, segment, offset, batch_size, seed, timeout = SAMPLE_REQUEST.unpack_from(data)
        return {"op": "sample", "buffer": data[SAMPLE_REQUEST.size:].decode(),
                "segment": segment, "offset": offset, "batch_size": batch_size,
                "seed": seed if has_seed else None, "timeout": timeout}
    if tag == _READ_REQUEST_TAG:
        if len(data) < READ_REQUEST.size:
            raise InvalidArgumentError("fast-path read request is truncated")
        _, flags, push_segment, n, segment, offset = READ_REQUEST.unpack_from(data)
        buffer, *fields = data[READ_REQUEST.size:].decode().split("\0")
        if bool(flags & 4) != bool(fields):
            raise InvalidArgumentError("fast-path read request is malformed")
        return {"op": "read", "buffer": buffer, "push_segment": push_segment,
                "seqs": [0, INDEX_DTYPE.str, [n]], "n": n, "fields": fields or None,
                **{name: bool(flags >> i & 1) for i, name in enumerate(_READ_FLAGS)},
                "segment": segment, "offset": offset}
    if tag == _SAMPLE_REPLY_TAG:
        if len(data) != SAMPLE_REPLY.size:
            raise InvalidArgumentError("fast-path sample reply is malformed")
        written = SAMPLE_REPLY.unpack(data)[1]
        return {"ok": True, "extras": [name for i, name in enumerate(SAMPLE_EXTRAS)
                                       if written >> i & 1]}
    message = _decode(data.decode())
    if not isinstance(message, dict):
        raise InvalidArgumentError("fast-path message is not a JSON object")
    return message


def _pack_sample_request(message: dict[str, Any]) -> bytes | None:
    if message.keys() != {"op", "buffer", "segment", "offset", "batch_size", "seed", "timeout"}:
        return None  # filter_meta, or a peer's own mistake: JSON
    name, seed, timeout = message["buffer"], message["seed"], message["timeout"]
    numbers = (message["segment"], message["offset"], message["batch_size"],
               0 if seed is None else seed)
    if not (isinstance(name, str) and type(timeout) in (float, int)
            and all(type(v) is int and 0 <= v < _U64 for v in numbers)):
        return None
    return SAMPLE_REQUEST.pack(_SAMPLE_REQUEST_TAG, seed is not None, *numbers,
                               timeout) + name.encode()


def _pack_read_request(message: dict[str, Any]) -> bytes | None:
    if message.keys() != _READ_KEYS:
        return None
    name, fields, n = message["buffer"], message["fields"], message["n"]
    numbers = (message["push_segment"], n, message["segment"], message["offset"])
    flags = [message[key] for key in _READ_FLAGS]
    names_fit = fields is None or (type(fields) is list and bool(fields) and all(
        type(field) is str and "\0" not in field for field in fields))
    if not (names_fit and isinstance(name, str) and "\0" not in name
            and all(type(v) is int and 0 <= v < _U64 for v in numbers)
            and all(type(flag) is bool for flag in flags)
            and type(message["seqs"]) is list and message["seqs"] == [0, INDEX_DTYPE.str, [n]]):
        return None  # seqs elsewhere, no fields (an empty list), a peer's own mistake: JSON
    bits = sum(1 << i for i, flag in enumerate(flags) if flag) | (4 if fields else 0)
    names = name if fields is None else "\0".join((name, *fields))
    return READ_REQUEST.pack(_READ_REQUEST_TAG, bits, *numbers) + names.encode()


def _pack_sample_reply(extras: Any) -> bytes | None:
    if not isinstance(extras, list) or not all(name in SAMPLE_EXTRAS for name in extras):
        return None
    written = sum(1 << i for i, name in enumerate(SAMPLE_EXTRAS) if name in extras)
    return SAMPLE_REPLY.pack(_SAMPLE_REPLY_TAG, written)


def _fds(ancillary: list) -> list[int]:
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(array.array("i", payload[:usable]))
    return fds


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def error_reply(error: ReplayError) -> dict[str, Any]:
    return {"ok": False, "code": type(error).code, "message": str(error)}


def raise_for(reply: dict[str, Any]) -> dict[str, Any]:
    """Return a successful reply; raise the typed error a failed one names."""
    if reply.get("ok"):
        return reply
    code = reply.get("code")
    cls = _CLASSES.get(code, ReplayError) if isinstance(code, str) else ReplayError
    raise cls(str(reply.get("message", "fast-path request failed")))
