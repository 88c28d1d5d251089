"""A sample in the stored form: the distinct frames once, and where each value takes them.

A buffer with frame groups (``frame_stack``, ``next_of``, ``compression``: see
:mod:`.frames`) stores each frame once and refers to it from its records by id. A
sample of ``m`` stacked records of ``k`` frames refers to ``m * k`` frames (twice that
with ``next_obs``), but to far fewer *distinct* ones: consecutive records share ``k - 1``
of them, ``next_obs`` shares every frame with the next ``obs``, an R2D2 sequence of
stacked frames has about one new frame per step. :class:`StoredBatch` is that sample as
the buffer holds it (:meth:`TieredBuffer.sample_stored
<millpond.core.buffer.TieredBuffer.sample_stored>` draws it exactly as the plain call
with the same seed draws its arrays):

* ``columns``: the fields outside the frame groups, and the call's other arrays
  (``weights``, ``indices``, ``mask``, ...), as the plain call returns them;
* ``tables``, one per group drawn: its distinct frames, either plain
  (``frames[u, *frame_shape]``) or, for a compressed group, as stored: the blobs one after
  the other (``data``, uint8) with their lengths (``lens``, uint32; a blob of exactly the
  frame's bytes is raw, anything shorter compressed with ``codec``, see :mod:`.arena`);
* ``refs``: per group field, the group's source, the stack axis (None: a value is one
  frame) and ``int32[*lead, k]`` indices into the table, ``-1`` for a zero frame (the
  padding of a sequence past its episode's end).

:meth:`StoredBatch.rebuild` gives the arrays of the plain call, exactly. It trusts
nothing it is given: every index in range, every blob length in ``[1, frame bytes]``
and adding up, each decompressed frame exactly the frame's bytes, codecs known,
shapes and dtypes those of the schema; anything else is :class:`StoredFormError` (a
client turns it into ``ProtocolError`` naming the server). Compressed tables
decompress on a few threads when they are large enough to pay (see
:data:`PARALLEL_FRAMES`).

**Who sends it.** The daemon, over gRPC, to a client that asks (``stored_form`` in
``SampleRequest`` and ``SampleSequencesRequest``; an older client does not, and gets
plain arrays; a newer client talking to an older daemon gets plain arrays too, and takes
them as they are): ``sample`` (uniform, prioritized, n-step) and ``sample_sequences`` of
buffers with frame groups that draw (a queue's or a stack's samples remove records, and
keep the plain path and its delivery rules), whenever the stored form is the smaller
(frames of a few bytes cost more in indices than they save). ``sample_episodes`` (sized
by its draw), ``read`` and catalogs stay plain: they are not a learner's steady call. Over
shared memory the arrays stay plain too: there the daemon gathers a sample straight into
the client's segment, one copy, and the stored form would move the same decompression and
one copy of the arrays to the client, measured no faster (0.3-0.9x in-process, see
``shm_choice`` in bench/bench_pixels.py).

**On the wire** (:meth:`StoredBatch.to_columns`, :meth:`StoredBatch.from_columns`) the
form is plain columns with reserved names (field names are identifiers, so a name
starting with ``@`` is never a field's): ``@frames:<source>`` (a plain table),
``@<codec>:<source>`` with ``@lens:<source>`` (a compressed one), and
``@ids:<field>:<source>:<axis or ->`` (the indices). So the reply framing, size
limits and parsing of samples carry it unchanged, and a reply without such names is
a plain one (an older daemon's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from millpond.core.codecs import CODECS, Codec
from millpond.core.schema import Schema

INDEX_DTYPE = np.dtype("<i4")
LEN_DTYPE = np.dtype("<u4")
PREFIX = "@"
# A compressed table is decompressed on two threads (a half each) when it has at least this
# many frames (lz4), or a quarter of it (zstd): both codecs release the GIL while they
# work, but lz4 takes it back after each frame (0.7-0.8 us of work), zstd once per half
# (see codecs._zstd_many). Measured on the 2-core development machine, sample(256) of
# Atari frames (800-850 distinct) over gRPC on two threads: lz4 0.82-0.87x of one (the
# bench's "decompressing on 2 threads"), zstd 0.97-1.14x, and 2.7-3.0 instead of 2.8-3.6
# ms a call (sampler(prefetch=4): 0.93-1.08x); earlier, 2,700 frames at 1.0x with lz4.
PARALLEL_FRAMES = int(os.environ.get("MILLPOND_REBUILD_PARALLEL_FRAMES", 0)) or 2048
THREADS = 2
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# Tables of a codec that takes the GIL back after each value (lz4: every ~1 us) decompress
# one at a time in a process: two threads doing so at once (a sampler's prefetching
# threads) hand the GIL to each other at every frame. Measured on the 2-core development
# machine, sampler(256, prefetch=4) of Atari frames over gRPC: 75-80 context switches and
# 0.7-1.2 ms of system time per sample without turns, 18 and 0.3-0.5 ms with them, and
# 1.15-1.25x the samples per second. zstd's tables (one GIL-free call) need no turns.
_TURNS = threading.Lock()
_CODECS: dict[str, Codec] = {}


class StoredFormError(ValueError):
    """A stored-form batch that cannot be what it claims (see the module doc)."""


@dataclass
class FrameTable:
    """One group's distinct frames of a sample: ``frames`` (plain), or ``data`` and
    ``lens`` compressed with ``codec``."""

    codec: str | None
    frames: np.ndarray | None = None
    data: np.ndarray | None = None
    lens: np.ndarray | None = None

    def __len__(self) -> int:
        if self.frames is not None:
            return len(self.frames)
        assert self.lens is not None
        return len(self.lens)

    @property
    def nbytes(self) -> int:
        if self.frames is not None:
            return self.frames.nbytes
        assert self.data is not None and self.lens is not None
        return self.data.nbytes + self.lens.nbytes


@dataclass
class StoredBatch:
    """A sample in the stored form (see the module doc)."""

    columns: dict[str, np.ndarray]
    tables: dict[str, FrameTable] = field(default_factory=dict)
    refs: dict[str, tuple[str, int | None, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (what crosses a wire)."""
        return (sum(a.nbytes for a in self.columns.values())
                + sum(t.nbytes for t in self.tables.values())
                + sum(ids.nbytes for _, _, ids in self.refs.values()))

    # ---- the wire form ---------------------------------------------------------------

    def to_columns(self) -> dict[str, np.ndarray]:
        """The batch as columns (see the module doc), the reserved ones first."""
        out: dict[str, np.ndarray] = {}
        for source, table in self.tables.items():
            if table.codec is None:
                assert table.frames is not None
                out[f"{PREFIX}frames:{source}"] = table.frames
            else:
                assert table.data is not None and table.lens is not None
                out[f"{PREFIX}{table.codec}:{source}"] = table.data
                out[f"{PREFIX}lens:{source}"] = table.lens
        for name, (source, axis, ids) in self.refs.items():
            out[f"{PREFIX}ids:{name}:{source}:{'-' if axis is None else axis}"] = ids
        return {**out, **self.columns}

    @classmethod
    def from_columns(cls, columns: Mapping[str, np.ndarray]) -> "StoredBatch | None":
        """The batch of :meth:`to_columns`' columns; None if none is reserved (a plain
        reply). StoredFormError for reserved names that do not parse."""
        if not any(name.startswith(PREFIX) for name in columns):
            return None
        batch = cls({})
        blobs: dict[str, tuple[str, np.ndarray]] = {}
        lens: dict[str, np.ndarray] = {}
        for name, array in columns.items():
            if not name.startswith(PREFIX):
                batch.columns[name] = array
                continue
            kind, _, rest = name[len(PREFIX):].partition(":")
            if kind == "ids":
                parts = rest.split(":")
                if len(parts) != 3 or not parts[0] or not parts[1]:
                    raise StoredFormError(f"a column named {name!r}")
                axis: int | None = None
                if parts[2] != "-":
                    if not parts[2].isdigit() or len(parts[2]) > 2:
                        raise StoredFormError(f"a column named {name!r}")
                    axis = int(parts[2])
                if parts[0] in batch.refs:
                    raise StoredFormError(f"two index columns for {parts[0]!r}")
                batch.refs[parts[0]] = (parts[1], axis, array)
            elif kind == "frames" and rest:
                batch.tables[rest] = FrameTable(None, frames=array)
            elif kind in CODECS and rest:
                blobs[rest] = (kind, array)
            elif kind == "lens" and rest:
                lens[rest] = array
            else:
                raise StoredFormError(f"a column named {name!r} (unknown kind {kind!r})")
        if set(blobs) != set(lens) or set(blobs) & set(batch.tables):
            raise StoredFormError(f"compressed tables {sorted(blobs)} with lengths for "
                                  f"{sorted(lens)} and plain tables {sorted(batch.tables)}")
        for source, (codec_name, data) in blobs.items():
            batch.tables[source] = FrameTable(codec_name, data=data, lens=lens[source])
        return batch

    # ---- rebuilding ------------------------------------------------------------------

    def rebuild(self, schema: Schema) -> dict[str, np.ndarray]:
        """The arrays of the plain call: each referring field gathered from its group's
        decoded table, the other columns as they are. StoredFormError if anything does not
        fit (see the module doc); the result's names, dtypes and shapes are for the
        caller to check against what it asked for."""
        decoded: dict[str, np.ndarray] = {}
        out = dict(self.columns)
        for name, (source, axis, ids) in self.refs.items():
            if name in out or name not in schema.names:
                raise StoredFormError(f"indices for {name!r}, not a field of the buffer "
                                      "(or sent twice)")
            spec = schema[name]
            if ids.dtype != INDEX_DTYPE or ids.ndim < 2:
                raise StoredFormError(f"indices for {name!r} of {ids.dtype}{list(ids.shape)}")
            k = ids.shape[-1]
            if axis is None:
                frame_shape = spec.shape
                if k != 1:
                    raise StoredFormError(f"{k} frames per value of {name!r}, not stacked")
            else:
                if not 0 <= axis < len(spec.shape) or spec.shape[axis] != k:
                    raise StoredFormError(f"{name!r} stacked on axis {axis} by {k}, "
                                          f"but it is {list(spec.shape)}")
                frame_shape = spec.shape[:axis] + spec.shape[axis + 1:]
            table = self.tables.get(source)
            if table is None:
                raise StoredFormError(f"indices for {name!r} into a table {source!r} not sent")
            frames = decoded.get(source)
            if frames is None:
                frames = decoded[source] = _decode(source, table, spec.dtype, frame_shape)
            elif frames.dtype != spec.dtype or frames.shape[1:] != frame_shape:
                raise StoredFormError(f"{name!r} and another field of table {source!r} have "
                                      "different frames")
            if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= len(frames)):
                raise StoredFormError(f"indices for {name!r} outside [-1, {len(frames)})")
            out[name] = _gather(frames, ids, axis)
        unused = set(self.tables) - {source for source, _, _ in self.refs.values()}
        if unused:
            raise StoredFormError(f"tables {sorted(unused)} no field refers to")
        return out


def _decode(source: str, table: FrameTable, dtype: np.dtype, frame_shape: tuple[int, ...]
            ) -> np.ndarray:
    """The frames of ``table`` as ``[u, *frame_shape]`` of ``dtype``, checked."""
    nbytes = math.prod(frame_shape) * dtype.itemsize
    if table.codec is None:
        frames = table.frames
        assert frames is not None
        if frames.dtype != dtype or frames.shape[1:] != frame_shape or frames.ndim < 1:
            raise StoredFormError(f"table {source!r} of {frames.dtype}{list(frames.shape)}, "
                                  f"not of {dtype}{list(frame_shape)} frames")
        return frames
    data, lens = table.data, table.lens
    assert data is not None and lens is not None
    if data.dtype != np.uint8 or data.ndim != 1 or lens.dtype != LEN_DTYPE or lens.ndim != 1:
        raise StoredFormError(f"compressed table {source!r} of {data.dtype}{list(data.shape)} "
                              f"with lengths {lens.dtype}{list(lens.shape)}")
    n = len(lens)
    if n and (int(lens.min()) < 1 or int(lens.max()) > nbytes):
        raise StoredFormError(f"compressed table {source!r}: a blob length outside "
                              f"[1, {nbytes}]")
    ends = np.cumsum(lens, dtype=np.int64)
    if (int(ends[-1]) if n else 0) != len(data):
        raise StoredFormError(f"compressed table {source!r}: blob lengths adding up to "
                              f"{int(ends[-1]) if n else 0:,}, not its {len(data):,} bytes")
    codec = _codec(table.codec)
    data = np.ascontiguousarray(data)
    if table.codec == "zstd":
        _check_zstd_sizes(source, data, ends - lens, lens, nbytes)
    starts = (ends - lens).tolist()
    lengths = lens.tolist()
    view = memoryview(data.data)

    many = codec.decompress_many

    def run(lo: int, hi: int) -> list:
        try:
            parts = many(view, starts[lo:hi], lengths[lo:hi], nbytes)
        except Exception as exc:  # lz4/zstd errors: data that is not a blob
            raise StoredFormError(f"compressed table {source!r}: a blob that does not "
                                  f"decompress ({type(exc).__name__}: {exc})") from None
        return parts

    with _TURNS if codec.gil_per_value else contextlib.nullcontext():
        if n < (PARALLEL_FRAMES if codec.gil_per_value else PARALLEL_FRAMES // 4):
            parts = run(0, n)
        else:
            half = n // 2
            future = _pool().submit(run, half, n)
            parts = run(0, half)
            parts += future.result()
    whole = b"".join(parts)
    # Neither codec writes past the size it is given (lz4's uncompressed_size, zstd's
    # decompressed_sizes), and raw blobs are exactly it: so no part is longer than a frame,
    # and the whole is n frames only if every part is one.
    if len(whole) != n * nbytes:
        wrong = next(len(part) for part in parts if len(part) != nbytes)
        raise StoredFormError(f"compressed table {source!r}: a blob decompressing to "
                              f"{wrong:,} bytes, not {nbytes:,}")
    return np.frombuffer(whole, dtype).reshape((n, *frame_shape))


def _check_zstd_sizes(source: str, data: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                      nbytes: int) -> None:
    """Every compressed zstd blob's header says ``nbytes`` (ours always carry the size):
    zstd decompresses to the size a frame's header gives, whatever ``max_output_size``
    says, so a blob of a few KB could otherwise make a reader allocate gigabytes. The
    headers are read for all blobs at once (:func:`zstd_content_sizes`)."""
    packed = lens != nbytes
    sizes = zstd_content_sizes(data, starts[packed], lens[packed])
    if len(sizes) and not (sizes == nbytes).all():
        raise StoredFormError(f"compressed table {source!r}: a zstd blob whose header does "
                              f"not give the frame's {nbytes:,} bytes (or not a zstd frame)")


ZSTD_MAGIC = 0xFD2FB528
_ZSTD_HEADER_MAX = 18  # magic 4, descriptor 1, window 1, dictionary id 4, content size 8


def _descriptor_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per frame header descriptor byte: the content size field's bytes (0: none, or a
    reserved bit set) and where it starts."""
    fhd = np.arange(256)
    single = (fhd >> 5) & 1
    flag = fhd >> 6
    size = np.where(flag == 0, single, 1 << flag)  # flag 0: one byte if single segment
    size = np.where(fhd & 8, 0, size)  # the reserved bit
    first = 5 + (1 - single) + np.array([0, 1, 2, 4])[fhd & 3]  # after window, dictionary id
    return size, first


_FCS_BYTES, _FCS_AT = _descriptor_tables()
_WINDOW_LOG_MAX = 31  # zstd's on 64-bit: a header asking more is not a frame it reads
_MASKS = np.array([(1 << (8 * b)) - 1 for b in range(9)], np.uint64)


def zstd_content_sizes(data: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The content size each zstd frame ``data[start:start + len]`` declares in its
    header (int64), -1 where it declares none or is not a zstd frame (another magic
    number, a reserved bit set, a header longer than the blob, a size of 2**63 or more): what
    ``zstandard.frame_content_size`` says of each (-1 for its errors too), read from the
    header's bytes (RFC 8878, 3.1.1.1) of all blobs at once: 80 us instead of 250 us
    (a call per blob) for 850 Atari frames."""
    n = len(starts)
    if not n or not len(data):
        return np.full(n, -1, np.int64)
    # The first bytes of each blob, those past its end (the next blob's: ignored below).
    head = data[np.minimum(starts.astype(np.int64)[:, None] + np.arange(_ZSTD_HEADER_MAX),
                           len(data) - 1)]
    magic = np.ascontiguousarray(head[:, :4]).view("<u4")[:, 0]
    fhd = head[:, 4]
    size, first = _FCS_BYTES[fhd], _FCS_AT[fhd]
    field = head[np.arange(n)[:, None], np.minimum(first[:, None] + np.arange(8),
                                                   _ZSTD_HEADER_MAX - 1)]
    value = np.ascontiguousarray(field).view("<u8")[:, 0] & _MASKS[size]
    value = np.where(size == 2, value + np.uint64(256), value)
    windowed = (fhd & 0x20) == 0  # not single segment: a window descriptor follows
    ok = ((magic == ZSTD_MAGIC) & (size > 0) & (first + size <= lens)
          & (value < np.uint64(1 << 63))
          & ~(windowed & (10 + (head[:, 5] >> 3) > _WINDOW_LOG_MAX)))
    return np.where(ok, value.astype(np.int64), -1)


def _gather(frames: np.ndarray, ids: np.ndarray, axis: int | None) -> np.ndarray:
    """Values ``[*lead, *shape]`` of frames ``ids`` (``[*lead, k]``), ``-1`` zero."""
    lead, k = ids.shape[:-1], ids.shape[-1]
    zero = ids < 0
    if zero.any():  # a zero frame at the table's end
        frames = np.concatenate([frames, np.zeros((1, *frames.shape[1:]), frames.dtype)])
        ids = np.where(zero, len(frames) - 1, ids)
    taken = frames.take(ids.reshape(-1), axis=0).reshape((*lead, k, *frames.shape[1:]))
    if axis is None:
        return taken.reshape((*lead, *frames.shape[1:]))
    if axis == 0:
        return taken
    return np.ascontiguousarray(np.moveaxis(taken, len(lead), len(lead) + axis))


def _codec(name: str) -> Codec:
    codec = _CODECS.get(name)
    if codec is None:
        if name not in CODECS:
            raise StoredFormError(f"unknown codec {name!r}")
        codec = _CODECS[name] = Codec(name, 0 if name == "lz4" else 3)  # levels: compress only
    return codec


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=THREADS - 1, thread_name_prefix="millpond-rebuild")
        return _POOL

