"""Bulk messages filled in place: one copy of the column data, straight into the bytes sent.

gRPC sends a ``bytes`` object. A sample reply built the plain way is
gathered into new arrays, then joined into its bytes: two copies of what
may be megabytes. A :class:`BatchFrame` lays out such a message once per
shape (its size, its framing bytes, where each column's data lies); for
each reply :meth:`BatchFrame.new` makes a new ``bytes`` object of that size
whose contents are not yet set, writes the framing into it and returns
arrays viewing the data slots, which the engine gathers into. That is the C
API's own way of building a bytes object (``PyBytes_FromStringAndSize(NULL,
n)``, then fill it): the object is complete before anything else sees it,
and never changes after.

The bytes are exactly those of :func:`.frames.encode_with_batch` for the
same columns (tests check this).

The client side has the converse: a sample reply gRPC just received is a
``bytes`` object that nothing but the caller refers to, so its columns may be
handed out as writable arrays over it (:func:`sole_writable`) instead of
being copied out of it. That is checked, not assumed: the object's reference
count must be the one a sole owner's object shows, measured at import
through the same calls (so it holds whatever the interpreter counts); else
the caller copies, as before.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
from typing import Any, Iterable

import numpy as np

from millpond.wire.frames import _column_head, _len_prefix

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_new_bytes.restype = ctypes.py_object


def new_bytes(nbytes: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` of ``nbytes`` unset bytes and a writable uint8 array over them.

    Fill all of it before the bytes object goes anywhere, and keep the bytes
    object referenced while the array is in use (the array does not hold it).
    """
    if nbytes < 2:  # Python shares its empty and one-byte bytes objects: never write those
        return bytes(nbytes), np.zeros(nbytes, np.uint8)
    raw = _new_bytes(None, nbytes)
    address = ctypes.cast(raw, ctypes.c_void_p).value  # its data (PyBytes_AS_STRING)
    assert address is not None
    return raw, np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


_REUSED = threading.local()  # per thread: (frame, message, views) of BatchFrame.reused


class BatchFrame:
    """A message whose one field ``batch_field`` is a Batch of ``columns`` (name, dtype
    and full shape each, little-endian dtypes), laid out once."""

    def __init__(self, batch_field: int, columns: Iterable[tuple[str, np.dtype, tuple[int, ...]]]):
        body = []
        length = 0
        for name, dtype, shape in columns:
            nbytes = math.prod(shape) * dtype.itemsize
            head = _column_head(name, dtype.str, shape, nbytes)
            prefix = _len_prefix(1, len(head) + nbytes)
            body.append((prefix + head, name, dtype, shape, nbytes))
            length += len(prefix) + len(head) + nbytes
        top = _len_prefix(batch_field, length)
        self.framing = [(0, np.frombuffer(top, np.uint8))]  # (offset, bytes)
        self.slots = []  # (name, dtype, shape, offset, nbytes)
        pos = len(top)
        for head, name, dtype, shape, nbytes in body:
            self.framing.append((pos, np.frombuffer(head, np.uint8)))
            pos += len(head)
            self.slots.append((name, dtype, shape, pos, nbytes))
            pos += nbytes
        self.nbytes = pos

    def new(self) -> tuple[bytes, dict[str, np.ndarray]]:
        """A new message: its bytes, framing written, and writable views of its column
        slots. Fill every slot before the bytes go anywhere (see :func:`new_bytes`)."""
        raw, buf = new_bytes(self.nbytes)
        return raw, self._framed(buf)

    def reused(self) -> tuple[bytearray, dict[str, np.ndarray]]:
        """This thread's message of this frame, framed once and filled again on each
        call, and views of its slots: send ``bytes(message)``, a copy. For small
        messages, where one copy costs less than making a new message (a few
        microseconds, more when that code runs cold between calls). A thread keeps
        one such message, of the last frame it used: memory stays bounded whatever
        shapes callers ask for, and a learner repeating its request reuses it."""
        held = getattr(_REUSED, "held", None)
        if held is None or held[0] is not self:
            message = bytearray(self.nbytes)
            held = _REUSED.held = (self, message, self._framed(np.frombuffer(message, np.uint8)))
        return held[1], held[2]

    def _framed(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Write the framing into ``buf``; return views of its column slots."""
        for offset, head in self.framing:
            buf[offset : offset + len(head)] = head
        return {name: buf[offset : offset + nbytes].view(dtype).reshape(shape)
                for name, dtype, shape, offset, nbytes in self.slots}


# ---- the client: a received reply's columns, writable without a copy ---------------------


class _Owner:
    """Keeps a bytes object alive under the writable array :func:`sole_writable` makes."""

    __slots__ = ("data", "__array_interface__")

    def __init__(self, data: bytes, interface: dict[str, Any]):
        self.data = data
        self.__array_interface__ = interface


def sole_writable(data: bytes) -> np.ndarray | None:
    """A writable uint8 array over ``data``, if the caller's one local variable is the only
    reference to it (and it is not one of the objects Python shares); else None."""
    if len(data) < 2 or _references(data) != _SOLE_OWNER:
        return None
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value  # its data, no copy
    return np.asarray(_Owner(data, {"version": 3, "shape": (len(data),), "typestr": "|u1",
                                    "data": (address, False)}))


def _references(data: bytes) -> int:
    return sys.getrefcount(data)


def _sole_owner() -> int:
    owned = bytes(64)  # a new object, held by this one local: as a caller holds its reply
    return _probe(owned)


def _probe(data: bytes) -> int:  # the frames sole_writable's count goes through
    return _references(data)


_SOLE_OWNER = _sole_owner()
