"""A millpond daemon whose replies lie, for the tests of a client that trusts no reply.

    python tests/lying_daemon.py serve ...   # the arguments of `millpond serve`

``MILLPOND_LIE`` says how. Every reply of columns over gRPC (samples plain,
filtered and n-step, windows, episodes, the catalog, reads):

* ``rows``: twice the rows asked for;
* ``dtype``: float32 columns sent as float64;
* ``extra``: one more column; ``missing``: a column left out;
* ``width``: windows and episodes (the arrays as wide as ``mask``) 1,000 steps wider;
* ``seqs``: the catalog's ``seqs`` one short of its lengths;
* ``indices``: a prioritized sample's ``indices`` past ``2**48`` (another shard's).

Counts, on both transports:

* ``push``: a push answers a size one beyond the capacity;
* ``pushed``: a push answers ``pushed`` equal to the size (stuck once full: each reply
  possible alone, not one after another);
* ``updated``: ``update_priorities`` counts one more record than it was given.

Infos: ``size`` (every info claims 2**62 records), ``capacity`` (Info, not Create nor
List: a thousand times the capacity, and as many records), ``episodes`` (2**40
complete episodes), ``priority`` (a NaN priority total); ``config``: Create answers
with twice the capacity asked.

The fast path's replies: ``shm-extras`` (a sample says it wrote a prioritized buffer's
``weights`` and ``indices``), ``shm-segment`` (a result segment's fd half the size
asked), ``shm-segment-id`` (every result segment has the first one's id).

Samples in the stored form (``stored-index``, ``stored-length``, ``stored-codec``,
``stored-size``): see :func:`_lying_stored`.
For tests only.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np

from millpond.core import TieredBuffer
from millpond.remote.shm import memfd
from millpond.wire import frames
from millpond_server import cli, fastpath, operations, service

LIE = os.environ.get("MILLPOND_LIE", "")
_real_encode = frames.encode_with_batch


def _lying_columns(field: int, columns: Any, *args: Any, **kwargs: Any) -> bytes:
    """``encode_with_batch`` as the service calls it, its columns lied about."""
    if field != frames.SAMPLE_BATCH_FIELD:
        return _real_encode(field, columns, *args, **kwargs)
    columns = dict(columns)
    if LIE == "rows":
        columns = {name: np.concatenate([column, column]) for name, column in columns.items()}
    elif LIE == "dtype":
        columns = {name: column.astype(np.float64) if column.dtype == np.float32 else column
                   for name, column in columns.items()}
    elif LIE == "extra":
        columns["surprise"] = np.zeros(len(next(iter(columns.values()))), np.int8)
    elif LIE == "missing":
        columns.pop(next(iter(columns)))
    elif LIE == "width" and "mask" in columns:
        steps = columns["mask"].shape[:2]
        columns = {name: np.pad(column, [(0, 0), (0, 1000)] + [(0, 0)] * (column.ndim - 2))
                   if column.shape[:2] == steps else column for name, column in columns.items()}
    elif LIE == "seqs" and "seqs" in columns:
        columns["seqs"] = columns["seqs"][:-1]
    elif LIE == "indices" and "indices" in columns:
        columns["indices"] = columns["indices"] + (1 << 48)
    elif LIE.startswith("stored-"):
        columns = _lying_stored(columns)
    return _real_encode(field, columns, *args, **kwargs)


def _lying_stored(columns: dict) -> dict:
    """A stored-form reply (millpond.core.stored) lied about: an index past its table
    (``stored-index``), a blob one byte longer than its bytes (``stored-length``), an
    unknown codec (``stored-codec``), a blob decompressing to 100 bytes, not a frame's
    (``stored-size``)."""
    out = {}
    for name, column in columns.items():
        kind, _, source = name[1:].partition(":") if name.startswith("@") else ("", "", "")
        if LIE == "stored-index" and kind == "ids":
            column = column.copy()
            column.flat[0] = 1 << 20
        elif LIE == "stored-length" and kind == "lens":
            column = column.copy()
            column[0] += 1
        elif LIE == "stored-codec" and kind == "lz4":
            name = f"@lzma:{source}"
        elif LIE == "stored-size" and kind == "lz4":
            from millpond.core.codecs import codec
            lens = columns[f"@lens:{source}"]
            small = np.frombuffer(codec("lz4", 0).compress(bytes(100)), np.uint8)
            column = np.concatenate([small, column[int(lens[0]):]])
            out[f"@lens:{source}"] = np.concatenate([[len(small)], lens[1:]]).astype(lens.dtype)
        if name not in out:
            out[name] = column
    return out


def _lying_sample(self: service.ReplayService, buffer: TieredBuffer, batch_size: int,
                  seed: int | None) -> bytes:
    """Every Sample reply encoded (and lied about) by ``encode_with_batch``."""
    return service.encode_with_batch(frames.SAMPLE_BATCH_FIELD,
                                     self.ops.sample(buffer, batch_size, seed))


_real_push_batch = operations.Operations.push_batch


def _lying_push_batch(self: operations.Operations, buffer: TieredBuffer, *args: Any,
                      **kwargs: Any) -> tuple[int, int]:
    size, pushed = _real_push_batch(self, buffer, *args, **kwargs)
    if LIE == "push":
        size = buffer.config.total_capacity + 1
        return size, max(pushed, size)
    return size, size  # "pushed"


_real_update_priorities = TieredBuffer.update_priorities


def _lying_update_priorities(self: TieredBuffer, indices: Any, priorities: Any) -> int:
    return _real_update_priorities(self, indices, priorities) + len(indices) + 1


_real_info = operations.Operations.info


def _lying_info(self: operations.Operations, name: str, buffer: Any = None,
                include_unavailable: bool = False) -> Any:
    info = _real_info(self, name, buffer, include_unavailable)
    if LIE == "size":
        return dataclasses.replace(info, size=2**62)
    if LIE == "capacity" and buffer is None:  # the Info call (Create and List pass the buffer)
        config = dataclasses.replace(info.config, hot_capacity=info.config.hot_capacity * 1000,
                                     total_capacity=info.config.total_capacity * 1000)
        size = config.total_capacity
        return dataclasses.replace(info, config=config, size=size, pushed=max(size, info.pushed))
    if LIE == "episodes":
        return dataclasses.replace(info, episodes=2**40)
    if LIE == "priority":
        return dataclasses.replace(info, priority_total=float("nan"))
    return info


_real_create = operations.Operations.create


def _lying_create(self: operations.Operations, *args: Any, **kwargs: Any) -> Any:
    info, created = _real_create(self, *args, **kwargs)
    config = dataclasses.replace(info.config, total_capacity=2 * info.config.total_capacity)
    return dataclasses.replace(info, config=config), created


_real_fast_sample = fastpath.FastPathSession.sample


def _lying_fast_sample(self: fastpath.FastPathSession, message: dict, fds: list[int]) -> Any:
    reply, out_fds = _real_fast_sample(self, message, fds)
    return {**reply, "extras": ["weights", "indices"]}, out_fds


_real_result_segment = fastpath.FastPathSession.new_result_segment


def _lying_result_segment(self: fastpath.FastPathSession, message: dict, fds: list[int]) -> Any:
    if LIE == "shm-segment":  # a sealed memfd, but half the size asked
        size = message["size"]
        fd = memfd.create_segment(size // 2, "millpond-lie")
        try:
            return {"ok": True, "segment": 999}, [memfd.reopen_readonly(fd)]
        finally:
            os.close(fd)
    reply, out_fds = _real_result_segment(self, message, fds)
    first = self.__dict__.setdefault("first_result_segment", reply["segment"])
    return {**reply, "segment": first}, out_fds


LIARS: dict[str, tuple[Any, str, Any]] = {  # the lie -> (class, method, lying method)
    **{lie: (service.ReplayService, "_sample_frames", _lying_sample)
       for lie in ("rows", "dtype", "extra", "missing", "width", "seqs", "indices")},
    **{lie: (service.ReplayService, "_sample_frames", _lying_sample)
       for lie in ("stored-index", "stored-length", "stored-codec", "stored-size")},
    "push": (operations.Operations, "push_batch", _lying_push_batch),
    "pushed": (operations.Operations, "push_batch", _lying_push_batch),
    "updated": (TieredBuffer, "update_priorities", _lying_update_priorities),
    **{lie: (operations.Operations, "info", _lying_info)
       for lie in ("size", "capacity", "episodes", "priority")},
    "config": (operations.Operations, "create", _lying_create),
    "shm-extras": (fastpath.FastPathSession, "sample", _lying_fast_sample),
    "shm-segment": (fastpath.FastPathSession, "new_result_segment", _lying_result_segment),
    "shm-segment-id": (fastpath.FastPathSession, "new_result_segment", _lying_result_segment),
}

if __name__ == "__main__":
    if LIE not in LIARS:
        sys.exit(f"MILLPOND_LIE must be one of {sorted(LIARS)}, not {LIE!r}")
    cls, method, liar = LIARS[LIE]
    setattr(cls, method, liar)
    service.encode_with_batch = _lying_columns  # type: ignore[assignment]
    sys.exit(cli.main(sys.argv[1:]))
