"""Hand-written protobuf wire format for the bulk messages.

``PushBatchRequest`` and ``SampleReply`` carry megabytes of column data. The
protobuf runtime copies a ``bytes`` field when a message is built, again when
it is serialized or parsed, and again on every attribute access. Here the
column bytes are copied exactly once on the way out (``b"".join`` of the
framing and the arrays' memory) and not at all on the way in (arrays are
``np.frombuffer`` views of the received bytes).

The bytes produced are exactly what protobuf produces for the same message
(tests check this), so either side may use the generated classes instead.
The parser accepts any valid encoding of these messages (unknown fields are
skipped) and checks every length against the buffer, so a hostile message
raises a typed error instead of reading out of bounds.

A buffer's batches repeat their framing (names, dtypes, shapes) call after
call, so column heads are encoded once, and a Batch whose framing is byte
for byte that of the last one parsed at its length is not parsed again
(see :class:`_Layout`): per call, framing costs microseconds, not tens.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from typing import Any, Iterator, Mapping

import numpy as np

from millpond.core.schema import MAX_FIELD_NDIM
from millpond.errors import InvalidArgumentError, ShapeMismatchError
from millpond.wire.codec import check_column

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# No message read here has more fields than this (a push: its name, batch, priorities,
# timeout and one update per episode ended; a Batch: one per column). The bound keeps
# a hostile message of millions of tiny fields from costing seconds of Python.
MAX_MESSAGE_FIELDS = 1 << 16

# Field numbers of the Batch inside the bulk messages (see replay.proto).
PUSH_BATCH_FIELD = 2   # PushBatchRequest.batch
PUSH_PRIORITIES_FIELD = 3  # PushBatchRequest.priorities (packed doubles)
PUSH_TIMEOUT_FIELD = 4  # PushBatchRequest.timeout (optional double)
PUSH_UPDATES_FIELD = 5  # PushBatchRequest.updates (EpisodeUpdate messages)
SAMPLE_BATCH_FIELD = 1  # SampleReply.batch
# Call metadata: the largest message the caller can receive, in bytes (a client's
# max_message_mb). The daemon answers nothing larger (MessageTooLargeError, before a
# sample draws); a call without it is held to the daemon's own --max-message-mb.
MAX_RECEIVE_KEY = "millpond-max-receive-bytes"


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


_ONE_BYTE = [bytes([i]) for i in range(0x80)]


def _len_prefix(field: int, length: int) -> bytes:
    """Tag (wire type LEN) and length of a length-delimited field."""
    return _varint(field << 3 | _LEN) + _varint(length)


@functools.lru_cache(maxsize=1024)  # a buffer's columns: the same heads call after call
def _column_head(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """``Column`` fields name (1), dtype (2), packed shape (3) and data's prefix (4)."""
    name_b, dtype_b = name.encode(), dtype.encode()
    shape_b = b"".join(_varint(d) for d in shape)
    head = _len_prefix(1, len(name_b)) + name_b + _len_prefix(2, len(dtype_b)) + dtype_b
    if shape_b:
        head += _len_prefix(3, len(shape_b)) + shape_b
    return head + (_len_prefix(4, nbytes) if nbytes else b"")


def _batch_parts(columns: Mapping[str, np.ndarray]) -> tuple[list, int]:
    """Framing + array memory of a ``Batch``, and its encoded length."""
    parts: list = []
    length = 0
    for name, arr in columns.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        head = _column_head(name, arr.dtype.str, arr.shape, arr.nbytes)
        column_len = len(head) + arr.nbytes
        prefix = _len_prefix(1, column_len)
        parts += [prefix, head]
        if arr.nbytes:
            parts.append(arr.data.cast("B"))  # arr.data is memoryview(arr)
        length += len(prefix) + column_len
    return parts, length


def encode_with_batch(batch_field: int, columns: Mapping[str, np.ndarray],
                      name: str | None = None, priorities: np.ndarray | None = None,
                      timeout: float | None = None) -> bytes:
    """A message whose field 1 is ``name`` (if given) and ``batch_field`` a Batch.

    ``encode_with_batch(2, cols, name, priorities, timeout)`` is a
    ``PushBatchRequest``; ``encode_with_batch(1, cols)`` is a ``SampleReply``.
    """
    parts, length = _batch_parts(columns)
    head = b""
    if name:
        name_b = name.encode()
        head = _len_prefix(1, len(name_b)) + name_b
    head += _len_prefix(batch_field, length)  # present even when empty, as protobuf does
    if priorities is not None and len(priorities):
        packed = np.ascontiguousarray(priorities, "<f8").tobytes()
        parts += [_len_prefix(PUSH_PRIORITIES_FIELD, len(packed)), packed]
    if timeout is not None:
        parts += [_varint(PUSH_TIMEOUT_FIELD << 3 | _I64), struct.pack("<d", timeout)]
    return b"".join([head, *parts])


def encode_messages(field: int, messages: list[bytes]) -> bytes:
    """Serialized messages as repeated field ``field`` (to append to a message)."""
    return b"".join(_len_prefix(field, len(m)) + m for m in messages)


def encoded_batch_nbytes(columns: Mapping[str, tuple[str, tuple[int, ...], int]]) -> int:
    """Exact size of a Batch field 1 of ``{name: (dtype, shape, nbytes)}`` (a SampleReply)."""
    length = 0
    for name, (dtype, shape, nbytes) in columns.items():
        column_len = len(_column_head(name, dtype, shape, nbytes)) + nbytes
        length += len(_len_prefix(1, column_len)) + column_len
    return len(_len_prefix(1, length)) + length


@functools.lru_cache(maxsize=1024)  # a learner's shapes, again and again
def reply_nbytes(specs: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> int:
    """Exact size of the SampleReply (field 1: a Batch) :func:`encode_with_batch` makes of
    arrays of ``specs``, ``(name, little-endian dtype, shape)`` each: known before any
    array exists."""
    return encoded_batch_nbytes({name: (dtype.str, shape, math.prod(shape) * dtype.itemsize)
                                 for name, dtype, shape in specs})


# ---- parsing ------------------------------------------------------------------------


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ShapeMismatchError("malformed message: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def iter_fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """Yield (field number, wire type, value); LEN values are memoryview slices.

    The value is an ``int`` (VARINT) or a ``memoryview`` (LEN, I64, I32): the
    wire type tells which, hence ``Any``.
    """
    pos, count = 0, 0
    value: int | memoryview
    while pos < len(buf):
        count += 1
        if count > MAX_MESSAGE_FIELDS:
            raise InvalidArgumentError(
                f"malformed message: more than {MAX_MESSAGE_FIELDS:,} fields")
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ShapeMismatchError("malformed message: field runs past the end")
            value, pos = buf[pos : pos + length], pos + length
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if pos + width > len(buf):
                raise ShapeMismatchError("malformed message: field runs past the end")
            value, pos = buf[pos : pos + width], pos + width
        else:
            raise ShapeMismatchError(f"malformed message: wire type {wire_type}")
        yield field, wire_type, value


def _text(value: memoryview) -> str:
    try:
        return bytes(value).decode()
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError("malformed message: a string field is not UTF-8") from exc


def _decode_shape(field_values: list) -> tuple[int, ...]:
    dims: list[int] = []
    for wire_type, value in field_values:
        if wire_type == _VARINT:  # unpacked encoding
            dims.append(value)
        else:
            pos = 0
            while pos < len(value) and len(dims) <= MAX_FIELD_NDIM + 1:
                dim, pos = _read_varint(value, pos)
                dims.append(dim)
        if len(dims) > MAX_FIELD_NDIM + 1:  # refused by check_column, unread beyond that
            break
    # int64 on the wire: a negative dimension arrives as a huge unsigned value
    return tuple(d - (1 << 64) if d >= 1 << 63 else d for d in dims)


def _decode_column(buf: memoryview) -> tuple[str, np.ndarray]:
    name, dtype, data = "", "", memoryview(b"")
    shape_values = []
    for field, wire_type, value in iter_fields(buf):
        if field == 1 and wire_type == _LEN:
            name = _text(value)
        elif field == 2 and wire_type == _LEN:
            dtype = _text(value)
        elif field == 3:
            shape_values.append((wire_type, value))
        elif field == 4 and wire_type == _LEN:
            data = value
    arr_dtype, shape = check_column(name, dtype, _decode_shape(shape_values), len(data))
    return name, np.frombuffer(data, arr_dtype).reshape(shape)


def decode_batch_field(message: bytes | memoryview, batch_field: int) -> dict[str, np.ndarray]:
    """The columns of the Batch at ``batch_field`` of ``message``, as views of it."""
    return decode_batches([value for field, wire_type, value in iter_fields(memoryview(message))
                           if field == batch_field and wire_type == _LEN])


def decode_batches(batches: list[memoryview]) -> dict[str, np.ndarray]:
    """The columns of a Batch field that arrived in ``batches`` (protobuf merges them)."""
    if len(batches) == 1:
        return _decode_batch(batches[0])
    columns: dict[str, np.ndarray] = {}
    for batch in batches:
        for name, arr in _decode_batch(batch).items():
            if name in columns:
                raise ShapeMismatchError(f"column {name!r} appears twice")
            columns[name] = arr
    return columns


def split_push_batch(message: bytes | memoryview) -> tuple[
        str, list[memoryview], np.ndarray | None, float | None, list[memoryview]]:
    """A ``PushBatchRequest`` in one pass over its fields: ``(name, batches, priorities,
    timeout, updates)``, as :func:`decode_name`, :func:`decode_doubles` (None if there
    are none) and :func:`decode_double` read them; the batches are parsed by
    :func:`decode_batches`, the updates (serialized EpisodeUpdate messages) by protobuf."""
    name = ""
    batches, chunks, timeout, updates = [], [], None, []
    for field, wire_type, value in iter_fields(memoryview(message)):
        if field == 1 and wire_type == _LEN:
            name = _text(value)
        elif field == PUSH_BATCH_FIELD and wire_type == _LEN:
            batches.append(value)
        elif field == PUSH_PRIORITIES_FIELD and wire_type in (_LEN, _I64):
            if len(value) % 8:
                raise InvalidArgumentError("malformed message: packed doubles of odd length")
            chunks.append(np.frombuffer(value, "<f8"))
        elif field == PUSH_TIMEOUT_FIELD and wire_type == _I64:
            timeout = struct.unpack("<d", value)[0]
        elif field == PUSH_UPDATES_FIELD and wire_type == _LEN:
            updates.append(value)
    priorities = (chunks[0] if len(chunks) == 1 else np.concatenate(chunks)) if chunks else None
    if priorities is not None and not len(priorities):
        priorities = None
    return name, batches, priorities, timeout, updates


def _parse_batch(batch: memoryview) -> dict[str, np.ndarray]:
    columns: dict[str, np.ndarray] = {}
    for field, wire_type, value in iter_fields(batch):
        if field == 1 and wire_type == _LEN:
            name, arr = _decode_column(value)
            if name in columns:
                raise ShapeMismatchError(f"column {name!r} appears twice")
            columns[name] = arr
    return columns


# ---- a Batch framed like the last one ----------------------------------------------
#
# The parser reads a Batch's framing only: a column's data is a slice it never
# looks into. So a Batch whose every byte outside the column data equals that
# of a Batch parsed before (and which has the same length) parses the same:
# its columns are views at the same offsets, with the same names, dtypes and
# shapes. _decode_batch checks exactly that before it skips the parse.


class _Layout:
    """A parsed Batch's framing (every byte that is not column data) and its columns."""

    __slots__ = ("framing", "columns")

    def __init__(self, batch: memoryview, columns: dict[str, np.ndarray]):
        base = _address(np.frombuffer(batch, np.uint8)) if len(batch) else 0
        data = []
        self.columns = []  # (name, dtype, shape, offset of the data, scalars)
        for name, arr in columns.items():
            offset = _address(arr) - base if arr.nbytes else 0
            self.columns.append((name, arr.dtype, arr.shape, offset, arr.size))
            if arr.nbytes:
                data.append((offset, offset + arr.nbytes))
        self.framing = []  # (offset, bytes) of the stretches between the data
        pos = 0
        for start, stop in sorted(data):
            if start > pos:
                self.framing.append((pos, bytes(batch[pos:start])))
            pos = stop
        if pos < len(batch):
            self.framing.append((pos, bytes(batch[pos:])))

    def decode(self, batch: memoryview) -> dict[str, np.ndarray] | None:
        """The columns of ``batch`` (of this layout's length) if its framing is this one's."""
        for offset, framing in self.framing:
            if batch[offset : offset + len(framing)] != framing:
                return None
        return {name: np.frombuffer(batch, dtype, count, offset).reshape(shape)
                for name, dtype, shape, offset, count in self.columns}


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


_LAYOUTS: dict[int, _Layout] = {}  # by the Batch's length: the last one parsed
_MAX_LAYOUTS = 256
_layouts_lock = threading.Lock()


def _decode_batch(batch: memoryview) -> dict[str, np.ndarray]:
    layout = _LAYOUTS.get(len(batch))
    if layout is not None:
        columns = layout.decode(batch)
        if columns is not None:
            return columns
    columns = _parse_batch(batch)
    layout = _Layout(batch, columns)
    with _layouts_lock:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:  # many shapes of batch (or a hostile peer)
            _LAYOUTS.clear()
        _LAYOUTS[len(batch)] = layout
    return columns


def decode_doubles(message: bytes | memoryview, field_number: int) -> np.ndarray:
    """A repeated double field (packed or not) of ``message``."""
    chunks = []
    for field, wire_type, value in iter_fields(memoryview(message)):
        if field != field_number:
            continue
        if wire_type == _LEN:
            if len(value) % 8:
                raise InvalidArgumentError("malformed message: packed doubles of odd length")
            chunks.append(np.frombuffer(value, "<f8"))
        elif wire_type == _I64:
            chunks.append(np.frombuffer(value, "<f8"))
    return np.concatenate(chunks) if chunks else np.empty(0, np.float64)


def decode_double(message: bytes | memoryview, field_number: int) -> float | None:
    """An optional double field of ``message`` (the last one wins), or None if absent."""
    value = None
    for field, wire_type, raw in iter_fields(memoryview(message)):
        if field == field_number and wire_type == _I64:
            value = struct.unpack("<d", raw)[0]
    return value


def decode_name(message: bytes | memoryview) -> str:
    """Field 1 (the buffer name) of a request; the last one wins, as in protobuf."""
    name = ""
    for field, wire_type, value in iter_fields(memoryview(message)):
        if field == 1 and wire_type == _LEN:
            name = _text(value)
    return name
