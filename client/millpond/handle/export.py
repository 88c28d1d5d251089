"""A live buffer's records, read in chunks by position, and written out as a ``.npz``.

:func:`export` turns an online run into an offline dataset: one array per
field under the schema's names (a transition buffer's are rlox's: ``obs``,
``next_obs``, ``actions``, ``rewards``, ``terminated``, ``truncated``, which
:func:`millpond.datasets.load` reads back), oldest record first, plus
``episode_ids`` for an episodic buffer. It works on any handle, local or
remote, and reads the buffer in chunks (:func:`read_chunks`) streamed to
disk, so a buffer larger than memory exports in one chunk's memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from typing import Any, Iterator, Sequence

import numpy as np
from numpy.lib import format as npy

# Bytes of records one read of an export carries (remote reads: also at most one message).
EXPORT_CHUNK_BYTES = 64 << 20
EPISODE_IDS = "episode_ids"


def chunk_records(buf: Any, names: Sequence[str] | None, episode_ids: bool,
                  max_bytes: int) -> int:
    """How many records one read of ``names`` (and episode ids) may carry: at most
    ``max_bytes`` of them, and what one reply of a remote buffer may hold."""
    schema = buf.config.schema
    nbytes = sum(schema[name].nbytes for name in names or schema.names) + 1 + 8 * episode_ids
    step = max(1, max_bytes // nbytes)
    chunk = buf.backend.read_chunk(nbytes)
    return step if chunk is None else min(step, chunk)


def read_chunks(buf: Any, names: Sequence[str] | None, episode_ids: bool = False,
                max_bytes: int = EXPORT_CHUNK_BYTES
                ) -> tuple[int, Iterator[tuple[int, dict[str, np.ndarray]]]]:
    """``(n, chunks)``: ``n = len(buf)`` now, and ``(start, records)`` for the positions
    ``start ..`` of ``range(n)``, one read each (positions resolved by the backend, so
    each chunk is one state of the buffer; records evicted between two chunks shift
    the next one's). Fields ``names`` (None: all), ``episode_ids`` if asked."""
    n = len(buf)
    step = chunk_records(buf, names, episode_ids, max_bytes)

    def chunks() -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        for start in range(0, n, step):
            batch = buf.backend.read(np.arange(start, min(n, start + step)), names,
                                      positions=True, episode_ids=episode_ids)
            del batch["live"]  # every position names a live record
            yield start, batch

    return n, chunks()


def export(buf: Any, path: str | os.PathLike, *, chunk_bytes: int = EXPORT_CHUNK_BYTES) -> str:
    """Write ``buf``'s records, oldest first, to the ``.npz`` at ``path``; return the path.

    One array per field (``[len, *shape]``, the schema's dtype), plus
    ``episode_ids`` (int64) if the buffer is episodic. ``np.load(path)``
    reads it, as does :func:`millpond.datasets.load` for a transition
    buffer. Each field is streamed to a temporary file beside ``path`` chunk
    by chunk, then the archive is built (stored, not compressed, as
    ``np.savez`` does) and renamed into place: a failed export leaves no
    half-written ``path``. ``len(buf)`` is taken at the start; see
    :func:`read_chunks` for a buffer that pushes change meanwhile. ``chunk_bytes``:
    the most record bytes one read carries.
    """
    target = os.fspath(path)
    if not target.endswith(".npz"):
        target += ".npz"  # as np.savez names it
    schema, episodic = buf.config.schema, bool(buf.config.episodes)
    n, chunks = read_chunks(buf, None, episode_ids=episodic, max_bytes=chunk_bytes)
    columns = [(f.name, f.dtype, f.shape) for f in schema]
    if episodic:
        columns.append((EPISODE_IDS, np.dtype("<i8"), ()))
    folder = tempfile.mkdtemp(prefix=".millpond-export-",
                              dir=os.path.dirname(os.path.abspath(target)))
    try:
        files = {name: open(os.path.join(folder, f"{i}.npy"), "wb")
                 for i, (name, _, _) in enumerate(columns)}
        try:
            for (_, dtype, shape), f in zip(columns, files.values()):
                npy.write_array_header_1_0(f, {"descr": npy.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": (n, *shape)})
            for _, batch in chunks:
                for name, f in files.items():
                    f.write(np.ascontiguousarray(batch[name]).tobytes())
        finally:
            for f in files.values():
                f.close()
        partial = os.path.join(folder, "export.npz")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for i, (name, _, _) in enumerate(columns):
                archive.write(os.path.join(folder, f"{i}.npy"), f"{name}.npy")
        os.replace(partial, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return target
