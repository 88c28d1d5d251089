"""Reading a fast-path client's requests, trusting nothing.

Every field of a request is checked before it is used: offsets, lengths,
dtypes and shapes against the segment and the buffer's schema
(:func:`check_span`, :func:`segment_view`), counts, names, segment ids. A bad field raises
InvalidArgumentError; the session replies with it and keeps serving.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from millpond.core.schema import Schema
from millpond.errors import InvalidArgumentError


def check_span(mm: mmap.mmap, offset: Any, nbytes: int, align: int, what: str) -> int:
    """``offset``, after checking that it is a non-negative int, a multiple of ``align``,
    and that ``nbytes`` from it fit the segment."""
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 \
            or offset % align or offset + nbytes > len(mm):
        raise InvalidArgumentError(
            f"{what}: {nbytes:,} bytes at offset {offset!r} do not fit the "
            f"{len(mm):,}-byte segment")
    return offset


def segment_view(mm: mmap.mmap, offset: Any, dtype: np.dtype, count: int, what: str
                 ) -> np.ndarray:
    """The ``count`` items of ``dtype`` at ``offset`` in a segment, after
    :func:`check_span` (aligned to the item size). A view: copy what must not change."""
    offset = check_span(mm, offset, count * dtype.itemsize, dtype.itemsize, what)
    return np.frombuffer(mm, dtype, count, offset)


def column_view(mm: mmap.mmap, schema: Schema, entry: Any, n: int) -> tuple[str, np.ndarray]:
    if not (isinstance(entry, list) and len(entry) == 4):
        raise InvalidArgumentError("each column must be [name, offset, dtype, shape]")
    name, offset, dtype, shape = entry
    try:
        field = schema[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown field {name!r}") from None
    if dtype != field.dtype.str or shape != [n, *field.shape]:
        raise InvalidArgumentError(
            f"field {name!r}: expected {field.dtype.str}{[n, *field.shape]}, got {dtype}{shape}")
    view = segment_view(mm, offset, field.dtype, n * field.size, f"field {name!r}")
    return name, view.reshape((n, *field.shape))


def vector(mm: mmap.mmap, entry: Any, dtype: np.dtype, n: int, what: str) -> np.ndarray:
    """The ``[offset, dtype, [n]]`` vector in a client's segment (a view)."""
    if not (isinstance(entry, list) and len(entry) == 3):
        raise InvalidArgumentError(f"{what} must be [offset, dtype, [n]]")
    offset, dtype_str, shape = entry
    if dtype_str != dtype.str or shape != [n]:
        raise InvalidArgumentError(f"{what}: expected {dtype.str}{[n]}, got {dtype_str}{shape}")
    return segment_view(mm, offset, dtype, n, what)


def buffer_name(message: dict) -> str:
    name = message.get("buffer")
    if not isinstance(name, str):
        raise InvalidArgumentError(f"buffer must be a name, got {name!r}")
    return name


def no_fds(fds: list[int]) -> None:
    if fds:
        raise InvalidArgumentError("this request takes no fds")


def mapped(table: dict[int, mmap.mmap], segment: Any) -> mmap.mmap:
    try:
        return table[segment]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"no such segment {segment!r} in this session") from None


def record_count(message: dict) -> int:
    """The request's record count ``n``, checked."""
    n = message.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidArgumentError(f"n must be a non-negative integer, got {n!r}")
    return n


def close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive somewhere; the map goes when it does
